//! Loopback bearers: 256 random bits, hex encoded, compared in constant time.
//!
//! The host bearer (label `default`) is minted at every attach and kept in memory so the
//! trusted owner can fetch it over the control socket. Labelled bearers are shown once at
//! minting and then kept only as a SHA-256 digest: those issued with a lifetime are
//! [`Durable`] (the daemon keeps them in its store and they survive restarts until they
//! expire or are revoked), those without one live until the next attach. Nothing here
//! logs, formats or returns a secret except [`BearerStore::host_secret`] and the minting
//! calls.
//!
//! A caller-given lifetime meets the clock here, so arithmetic is checked: the lint below
//! refuses any operator that could overflow or panic.

#![deny(clippy::arithmetic_side_effects)]

use std::fmt;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use parking_lot::Mutex;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

/// The host bearer's label.
pub const HOST_LABEL: &str = "default";
/// Most extra bearers alive at once.
pub const MAX_BEARERS: usize = 256;
/// Longest label.
pub const MAX_LABEL_LEN: usize = 64;
/// Longest lifetime of an extra bearer, in days; the shortest is one second.
pub const MAX_TTL_DAYS: u64 = 365;
/// [`MAX_TTL_DAYS`] as a duration.
pub const MAX_TTL: Duration = Duration::from_secs(MAX_TTL_DAYS * 24 * 3600);

/// A bearer secret in memory. `Debug` is redacted; the bytes are wiped on drop.
pub struct Secret(String);

impl Secret {
    fn mint() -> Self {
        let mut bytes = [0u8; 32];
        getrandom::fill(&mut bytes).expect("the OS random source is available");
        let secret = Secret(hex::encode(bytes));
        bytes.fill(0);
        secret
    }

    /// A secret read from elsewhere (a client secret file); held like a bearer.
    pub fn new(text: String) -> Self {
        Secret(text)
    }

    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl Drop for Secret {
    fn drop(&mut self) {
        // Overwrite in place; the String's length stays, its bytes become '0'.
        let wiped = "0".repeat(self.0.len());
        self.0.replace_range(.., &wiped);
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}

struct Entry {
    label: String,
    digest: [u8; 32],
    created: SystemTime,
    expires: Option<SystemTime>,
    last_used: Option<SystemTime>,
}

/// What `bearer list` shows: never the secret.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BearerMeta {
    pub label: String,
    pub created: SystemTime,
    pub expires: Option<SystemTime>,
    pub last_used: Option<SystemTime>,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum BearerError {
    // Labels are quoted as they are: whoever shows the message (robota-mcpctl) escapes
    // what is not printable, once.
    #[error("a bearer labelled \"{0}\" already exists; revoke it first")]
    Exists(String),
    #[error("no bearer labelled \"{0}\"")]
    NotFound(String),
    #[error("label \"{0}\" is invalid: use 1 to 64 characters of [A-Za-z0-9_.-]")]
    BadLabel(String),
    #[error("the label {HOST_LABEL:?} belongs to the host bearer; use `bearer rotate`")]
    Reserved,
    #[error("too many bearers ({MAX_BEARERS}); revoke some first")]
    Full,
    #[error("a bearer's ttl must be between 1s and {MAX_TTL_DAYS}d")]
    BadTtl,
}

/// A labelled bearer with a lifetime, as it is kept across restarts: never the secret.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Durable {
    pub label: String,
    pub digest: [u8; 32],
    pub created: SystemTime,
    pub expires: SystemTime,
}

/// What [`BearerStore::issue`] minted.
pub struct Issued {
    /// The secret, shown once.
    pub secret: String,
    pub expires: Option<SystemTime>,
    /// What to keep so it survives a restart (bearers issued with a lifetime).
    pub durable: Option<Durable>,
}

impl fmt::Debug for Issued {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Issued")
            .field("secret", &"<redacted>")
            .field("expires", &self.expires)
            .field("durable", &self.durable)
            .finish()
    }
}

/// The live bearers: the host bearer of this attach and the labelled ones.
pub struct BearerStore {
    host: Mutex<Secret>,
    entries: Mutex<Vec<Entry>>,
}

fn digest(token: &str) -> [u8; 32] {
    Sha256::digest(token.as_bytes()).into()
}

fn check_label(label: &str) -> Result<(), BearerError> {
    let ok = !label.is_empty()
        && label.len() <= MAX_LABEL_LEN
        && label
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "_.-".contains(c));
    if ok {
        Ok(())
    } else {
        Err(BearerError::BadLabel(label.to_owned()))
    }
}

impl Default for BearerStore {
    fn default() -> Self {
        Self::new()
    }
}

impl BearerStore {
    /// A store with a freshly minted host bearer.
    pub fn new() -> Self {
        let host = Secret::mint();
        let entry = Entry {
            label: HOST_LABEL.into(),
            digest: digest(host.expose()),
            created: SystemTime::now(),
            expires: None,
            last_used: None,
        };
        Self {
            host: Mutex::new(host),
            entries: Mutex::new(vec![entry]),
        }
    }

    /// The host bearer, for the trusted owner on the control socket.
    pub fn host_secret(&self) -> String {
        self.host.lock().expose().to_owned()
    }

    /// A fresh attach: a new host bearer, and the labelled bearers without a lifetime
    /// gone; those with one carry on.
    pub fn fresh_attach(&self) {
        let fresh = Secret::mint();
        let now = SystemTime::now();
        let mut entries = self.entries.lock();
        entries.retain(|e| e.label != HOST_LABEL && e.expires.is_some_and(|t| t > now));
        entries.push(Entry {
            label: HOST_LABEL.into(),
            digest: digest(fresh.expose()),
            created: now,
            expires: None,
            last_used: None,
        });
        *self.host.lock() = fresh;
    }

    /// Replace the host bearer and revoke every labelled one: the old secrets stop
    /// working now. Returns the new host secret and the labels revoked.
    pub fn rotate_all(&self) -> (String, Vec<String>) {
        let fresh = Secret::mint();
        let out = fresh.expose().to_owned();
        let mut entries = self.entries.lock();
        let revoked = entries
            .iter()
            .filter(|e| e.label != HOST_LABEL)
            .map(|e| e.label.clone())
            .collect();
        entries.clear();
        entries.push(Entry {
            label: HOST_LABEL.into(),
            digest: digest(&out),
            created: SystemTime::now(),
            expires: None,
            last_used: None,
        });
        *self.host.lock() = fresh;
        (out, revoked)
    }

    /// Take back bearers kept from an earlier process (the expired, a label already live
    /// and any past [`MAX_BEARERS`] are left out). Returns how many were taken.
    pub fn restore(&self, kept: impl IntoIterator<Item = Durable>) -> usize {
        let now = SystemTime::now();
        let mut entries = self.entries.lock();
        let mut taken = 0usize;
        for d in kept {
            let clash = d.label == HOST_LABEL || entries.iter().any(|e| e.label == d.label);
            if d.expires <= now || clash || check_label(&d.label).is_err() {
                continue;
            }
            if entries.len() > MAX_BEARERS {
                break;
            }
            entries.push(Entry {
                label: d.label,
                digest: d.digest,
                created: d.created,
                expires: Some(d.expires),
                last_used: None,
            });
            taken = taken.saturating_add(1);
        }
        taken
    }

    /// Mint an extra bearer; the secret is returned once and kept only as a digest.
    pub fn issue(&self, label: &str, ttl: Option<Duration>) -> Result<Issued, BearerError> {
        check_label(label)?;
        if label == HOST_LABEL {
            return Err(BearerError::Reserved);
        }
        let now = SystemTime::now();
        let expires = match ttl {
            None => None,
            Some(ttl) if ttl < Duration::from_secs(1) || ttl > MAX_TTL => {
                return Err(BearerError::BadTtl);
            }
            // Up to a whole second, so the expiry shown (in seconds) is the one enforced,
            // and never sooner than asked.
            Some(ttl) => {
                let at = now.checked_add(ttl).ok_or(BearerError::BadTtl)?;
                let since = at
                    .duration_since(UNIX_EPOCH)
                    .map_err(|_| BearerError::BadTtl)?;
                let secs = since
                    .as_secs()
                    .saturating_add(u64::from(since.subsec_nanos() > 0));
                Some(
                    UNIX_EPOCH
                        .checked_add(Duration::from_secs(secs))
                        .ok_or(BearerError::BadTtl)?,
                )
            }
        };
        let mut entries = self.entries.lock();
        entries.retain(|e| e.expires.is_none_or(|t| t > now));
        if entries.iter().any(|e| e.label == label) {
            return Err(BearerError::Exists(label.to_owned()));
        }
        if entries.len() > MAX_BEARERS {
            return Err(BearerError::Full);
        }
        let secret = Secret::mint();
        let entry = Entry {
            label: label.to_owned(),
            digest: digest(secret.expose()),
            created: now,
            expires,
            last_used: None,
        };
        let durable = expires.map(|expires| Durable {
            label: entry.label.clone(),
            digest: entry.digest,
            created: entry.created,
            expires,
        });
        entries.push(entry);
        Ok(Issued {
            secret: secret.expose().to_owned(),
            expires,
            durable,
        })
    }

    pub fn revoke(&self, label: &str) -> Result<(), BearerError> {
        if label == HOST_LABEL {
            return Err(BearerError::Reserved);
        }
        let mut entries = self.entries.lock();
        let before = entries.len();
        entries.retain(|e| e.label != label);
        if entries.len() == before {
            return Err(BearerError::NotFound(label.to_owned()));
        }
        Ok(())
    }

    pub fn list(&self) -> Vec<BearerMeta> {
        let now = SystemTime::now();
        self.entries
            .lock()
            .iter()
            .filter(|e| e.expires.is_none_or(|t| t > now))
            .map(|e| BearerMeta {
                label: e.label.clone(),
                created: e.created,
                expires: e.expires,
                last_used: e.last_used,
            })
            .collect()
    }

    pub fn len(&self) -> usize {
        self.list().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The label of the live bearer equal to `token`, compared in constant time against
    /// every entry (the digest comparison does not stop at the first match).
    pub fn check(&self, token: &str, now: SystemTime) -> Option<String> {
        let presented = digest(token);
        let mut entries = self.entries.lock();
        let mut found = None;
        for (i, e) in entries.iter().enumerate() {
            let live = e.expires.is_none_or(|t| t > now);
            if bool::from(e.digest.ct_eq(&presented)) && live {
                found = Some(i);
            }
        }
        let entry = &mut entries[found?];
        entry.last_used = Some(now);
        Some(entry.label.clone())
    }
}

/// Unix seconds, for the wire.
pub fn unix_secs(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

#[cfg(test)]
#[allow(
    clippy::arithmetic_side_effects,
    reason = "tests step clocks by known amounts"
)]
mod tests {
    use super::*;

    #[test]
    fn secrets_are_256_bit_hex_and_unique() {
        let a = BearerStore::new().host_secret();
        let b = BearerStore::new().host_secret();
        assert_eq!(a.len(), 64);
        assert!(a.chars().all(|c| c.is_ascii_hexdigit()));
        assert_ne!(a, b);
    }

    #[test]
    fn rotation_replaces_every_bearer() {
        let store = BearerStore::new();
        let old = store.host_secret();
        let ci = store.issue("ci", Some(Duration::from_secs(60))).unwrap();
        let now = SystemTime::now();
        assert_eq!(store.check(&old, now).as_deref(), Some(HOST_LABEL));
        let (new, revoked) = store.rotate_all();
        assert_eq!(revoked, ["ci"]);
        assert_eq!(store.check(&old, now), None);
        assert_eq!(store.check(&ci.secret, now), None);
        assert_eq!(store.check(&new, now).as_deref(), Some(HOST_LABEL));
        assert_eq!(store.host_secret(), new);
        assert_eq!(store.len(), 1);
    }

    #[test]
    fn a_fresh_attach_keeps_only_bearers_with_a_lifetime() {
        let store = BearerStore::new();
        let host = store.host_secret();
        let kept = store.issue("ci", Some(Duration::from_secs(600))).unwrap();
        let gone = store.issue("adhoc", None).unwrap();
        assert!(gone.durable.is_none());
        store.fresh_attach();
        let now = SystemTime::now();
        assert_eq!(store.check(&host, now), None);
        assert_eq!(store.check(&gone.secret, now), None);
        assert_eq!(store.check(&kept.secret, now).as_deref(), Some("ci"));
        assert_ne!(store.host_secret(), host);
        // What a later process restores from the kept record checks the same secret.
        let durable = kept.durable.unwrap();
        assert_eq!(durable.expires, kept.expires.unwrap());
        let later = BearerStore::new();
        let expired = Durable {
            label: "stale".into(),
            expires: now - Duration::from_secs(1),
            ..durable.clone()
        };
        let clash = Durable {
            label: HOST_LABEL.into(),
            ..durable.clone()
        };
        assert_eq!(later.restore([durable, expired, clash]), 1);
        assert_eq!(later.check(&kept.secret, now).as_deref(), Some("ci"));
        assert_eq!(later.len(), 2);
    }

    #[test]
    fn extra_bearers_expire_and_revoke() {
        let store = BearerStore::new();
        let ci = store.issue("ci", None).unwrap().secret;
        let short = store.issue("short", Some(Duration::from_secs(60))).unwrap();
        let (short, expires) = (short.secret, short.expires);
        let now = SystemTime::now();
        assert_eq!(store.check(&ci, now).as_deref(), Some("ci"));
        assert_eq!(store.check(&short, now).as_deref(), Some("short"));
        assert_eq!(
            store.check(&short, expires.unwrap() + Duration::from_secs(1)),
            None
        );
        assert_eq!(
            store.issue("ci", None).unwrap_err(),
            BearerError::Exists("ci".into())
        );
        store.revoke("ci").unwrap();
        assert_eq!(store.check(&ci, now), None);
        assert_eq!(
            store.revoke("ci").unwrap_err(),
            BearerError::NotFound("ci".into())
        );
        assert_eq!(store.revoke(HOST_LABEL).unwrap_err(), BearerError::Reserved);
        assert_eq!(
            store.issue(HOST_LABEL, None).unwrap_err(),
            BearerError::Reserved
        );
        assert!(matches!(
            store.issue("a b", None),
            Err(BearerError::BadLabel(_))
        ));
    }

    #[test]
    fn ttls_are_checked_at_both_edges() {
        let store = BearerStore::new();
        for bad in [
            Duration::ZERO,
            Duration::from_millis(999),
            MAX_TTL + Duration::from_secs(1),
            // 300000000000 years: past what a SystemTime can hold.
            Duration::from_secs(300_000_000_000 * 31_557_600),
            Duration::MAX,
        ] {
            assert_eq!(
                store.issue("edge", Some(bad)).unwrap_err(),
                BearerError::BadTtl,
                "{bad:?}"
            );
        }
        assert_eq!(store.len(), 1, "a refused issue leaves nothing behind");
        let before = SystemTime::now();
        let one = store
            .issue("short", Some(Duration::from_secs(1)))
            .unwrap()
            .expires
            .unwrap();
        assert!(
            one >= before + Duration::from_secs(1)
                && one <= SystemTime::now() + Duration::from_secs(2)
        );
        // On a whole second: what `bearer list` shows is what is enforced.
        assert_eq!(one.duration_since(UNIX_EPOCH).unwrap().subsec_nanos(), 0);
        let max = store.issue("long", Some(MAX_TTL)).unwrap().expires;
        assert!(max.unwrap() >= before + MAX_TTL);
        assert!(
            BearerError::BadTtl
                .to_string()
                .ends_with("between 1s and 365d"),
            "{}",
            BearerError::BadTtl
        );
    }

    #[test]
    fn list_never_shows_secrets() {
        let store = BearerStore::new();
        let ci = store.issue("ci", None).unwrap().secret;
        let listed = format!("{:?}", store.list());
        assert!(!listed.contains(&ci));
        assert!(!listed.contains(&store.host_secret()));
        assert_eq!(store.len(), 2);
    }

    #[test]
    fn wrong_tokens_are_refused() {
        let store = BearerStore::new();
        let now = SystemTime::now();
        assert_eq!(store.check("", now), None);
        assert_eq!(store.check(&"0".repeat(64), now), None);
        let mut near = store.host_secret();
        near.replace_range(63.., if near.ends_with('0') { "1" } else { "0" });
        assert_eq!(store.check(&near, now), None);
    }
}
