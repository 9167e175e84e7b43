//! The verified-token cache, and beside it the digests of tokens whose signature failed:
//! what spares a replayed token its signature check; both bounded.

use std::collections::{HashMap, VecDeque};
use std::time::SystemTime;

use super::Principal;
use super::claims::{Checked, expired, premature};

/// Most tokens remembered as verified.
pub const VERIFIED_CACHE_ENTRIES: usize = 10_000;
/// Most tokens remembered as forged (a bad signature against the held key set).
pub const FORGED_CACHE_ENTRIES: usize = 4_096;

/// Values by token digest (SHA-256 of the token text), at most `max` of them. A full map
/// drops first the entries `lapsed` says are done, then the oldest, down to nine tenths of
/// `max` in one go, so that a full map does not sweep on every insert. The one bounded
/// memory of tokens: verified ones and forged ones here, introspection answers beside.
pub(super) struct ByDigest<V> {
    max: usize,
    entries: HashMap<[u8; 32], V>,
    order: VecDeque<[u8; 32]>,
}

impl<V> ByDigest<V> {
    pub(super) fn new(max: usize) -> Self {
        Self {
            max,
            entries: HashMap::new(),
            order: VecDeque::new(),
        }
    }

    pub(super) fn get(&self, digest: &[u8; 32]) -> Option<&V> {
        self.entries.get(digest)
    }

    pub(super) fn insert(&mut self, digest: [u8; 32], value: V, lapsed: impl Fn(&V) -> bool) {
        if self.entries.len() >= self.max {
            self.entries.retain(|_, v| !lapsed(v));
            let entries = &self.entries;
            self.order.retain(|d| entries.contains_key(d));
            while self.entries.len() >= self.max / 10 * 9 {
                let Some(oldest) = self.order.pop_front() else {
                    break;
                };
                self.entries.remove(&oldest);
            }
        }
        if self.entries.insert(digest, value).is_none() {
            self.order.push_back(digest);
        }
    }

    pub(super) fn clear(&mut self) {
        self.entries.clear();
        self.order.clear();
    }

    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.entries.len()
    }
}

/// Tokens that verified, until they expire; beside them, tokens whose signature failed: a
/// bad signature stays bad while the key set is the same. Both emptied with the key set.
pub(super) struct VerifiedCache {
    entries: ByDigest<Checked>,
    forged: ByDigest<()>,
}

impl Default for VerifiedCache {
    fn default() -> Self {
        Self {
            entries: ByDigest::new(VERIFIED_CACHE_ENTRIES),
            forged: ByDigest::new(FORGED_CACHE_ENTRIES),
        }
    }
}

impl VerifiedCache {
    pub(super) fn get(&self, digest: &[u8; 32], now: SystemTime) -> Option<Principal> {
        let entry = self.entries.get(digest)?;
        let valid = !expired(entry.principal.expires_at, now)
            && !entry.not_before.is_some_and(|nbf| premature(nbf, now));
        // An entry past its time stays until evicted; the full path refuses the token
        // with the exact reason.
        valid.then(|| entry.principal.clone())
    }

    pub(super) fn insert(&mut self, digest: [u8; 32], checked: &Checked, now: SystemTime) {
        let entry = Checked {
            principal: checked.principal.clone(),
            not_before: checked.not_before,
        };
        self.entries
            .insert(digest, entry, |e| expired(e.principal.expires_at, now));
    }

    pub(super) fn forged(&self, digest: &[u8; 32]) -> bool {
        self.forged.get(digest).is_some()
    }

    pub(super) fn insert_forged(&mut self, digest: [u8; 32]) {
        self.forged.insert(digest, (), |()| false);
    }

    pub(super) fn clear(&mut self) {
        self.entries.clear();
        self.forged.clear();
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use jsonwebtoken::Algorithm;
    use serde_json::json;

    use super::*;
    use crate::config::KeySource;
    use crate::oauth::testutil::{
        ISSUER, TestKey, build, claims, config, file_verifier, jwks, now, unix, verdict, with,
        write,
    };
    use crate::oauth::{Asker, Verifier};
    use crate::vocab::{Reason, RefreshTrigger};

    #[tokio::test]
    async fn verified_tokens_are_cached_until_expiry() {
        let dir = tempfile::tempdir().unwrap();
        let key = TestKey::new(Algorithm::ES256, "ec");
        let v = file_verifier(dir.path(), &[&key]).await;
        let token = key.token();
        let first = verdict(&v, &token).await.unwrap();
        assert_eq!(v.signature_checks(), 1);
        for _ in 0..5 {
            assert_eq!(verdict(&v, &token).await.unwrap(), first);
        }
        assert_eq!(v.signature_checks(), 1, "cache hits do no crypto");
        // Within the skew after exp: still a hit; beyond it: refused with the exact reason.
        let exp = first.expires_at;
        assert!(
            v.verify(&token, exp + Duration::from_secs(59), Asker::anyone())
                .await
                .is_ok()
        );
        assert_eq!(v.signature_checks(), 1);
        assert_eq!(
            v.verify(&token, exp + Duration::from_secs(61), Asker::anyone())
                .await,
            Err(Reason::Expired)
        );
        // Before nbf (beyond the skew) a cached token is not valid either.
        let nbf = now() + Duration::from_secs(30);
        let early = key.sign(&key.header(), &with(json!({"nbf": unix(nbf)})));
        assert!(verdict(&v, &early).await.is_ok());
        assert_eq!(
            v.verify(&early, nbf - Duration::from_secs(61), Asker::anyone())
                .await,
            Err(Reason::NotYetValid)
        );
        // Failures of a well-signed token are not cached.
        let bad = key.sign(&key.header(), &with(json!({"sub": "mallory"})));
        let checks = v.signature_checks();
        for _ in 0..3 {
            assert_eq!(verdict(&v, &bad).await, Err(Reason::PrincipalNotAllowed));
        }
        assert_eq!(v.signature_checks(), checks + 3);
    }

    #[tokio::test]
    async fn a_forged_token_is_checked_once_per_key_set() {
        let dir = tempfile::tempdir().unwrap();
        let ours = TestKey::new(Algorithm::ES256, "ours");
        let evil = TestKey::new(Algorithm::ES256, "evil");
        let path = write(dir.path(), "jwks.json", &jwks(&[&ours]));
        let v = build(config(
            ISSUER,
            KeySource::JwksFile(path.clone()),
            dir.path(),
        ));
        v.load().await.expect("keys load");
        let mut header = evil.header();
        header["kid"] = json!("ours");
        let forged = evil.sign(&header, &claims());
        for _ in 0..5 {
            assert_eq!(verdict(&v, &forged).await, Err(Reason::BadSignature));
        }
        assert_eq!(
            v.signature_checks(),
            1,
            "a replayed forgery costs no crypto"
        );
        // Another forgery is checked in full, and a valid token is not affected.
        let other = evil.sign(&header, &with(json!({"jti": "2"})));
        assert_eq!(verdict(&v, &other).await, Err(Reason::BadSignature));
        assert!(verdict(&v, &ours.token()).await.is_ok());
        assert_eq!(v.signature_checks(), 3);
        // A new key set forgets the verdicts: the same bytes are judged against it.
        std::fs::write(&path, jwks(&[&ours, &evil])).unwrap();
        v.refresh(RefreshTrigger::Operator).await.unwrap();
        let mut renamed = evil.header();
        renamed["kid"] = json!("evil");
        assert!(verdict(&v, &evil.sign(&renamed, &claims())).await.is_ok());
        assert_eq!(verdict(&v, &forged).await, Err(Reason::BadSignature));
        assert_eq!(
            v.signature_checks(),
            5,
            "checked again after the key set changed"
        );
    }

    #[test]
    fn forged_cache_is_bounded() {
        let mut cache = VerifiedCache::default();
        let digest = |i: usize| {
            let mut d = [0u8; 32];
            d[..8].copy_from_slice(&(i as u64).to_le_bytes());
            d
        };
        for i in 0..=FORGED_CACHE_ENTRIES {
            cache.insert_forged(digest(i));
        }
        // Full at the last insert: the oldest tenth went in one go.
        assert_eq!(cache.forged.len(), FORGED_CACHE_ENTRIES / 10 * 9);
        assert!(!cache.forged(&digest(0)), "the oldest went first");
        assert!(cache.forged(&digest(FORGED_CACHE_ENTRIES)));
        let before = cache.forged.len();
        cache.insert_forged(digest(FORGED_CACHE_ENTRIES));
        assert_eq!(cache.forged.len(), before, "no duplicate");
        assert_eq!(cache.forged.order.len(), before);
    }

    #[test]
    fn verified_cache_is_bounded() {
        let mut cache = VerifiedCache::default();
        let checked = |secs: u64| Checked {
            principal: Principal {
                client_id: "c".into(),
                subject: "s".into(),
                scopes: vec![],
                expires_at: now() + Duration::from_secs(secs),
            },
            not_before: None,
        };
        let digest = |i: usize| {
            let mut d = [0u8; 32];
            d[..8].copy_from_slice(&(i as u64).to_be_bytes());
            d
        };
        // Half of the entries expire soon, half later.
        for i in 0..VERIFIED_CACHE_ENTRIES {
            cache.insert(
                digest(i),
                &checked(if i % 2 == 0 { 10 } else { 1000 }),
                now(),
            );
        }
        assert_eq!(cache.entries.len(), VERIFIED_CACHE_ENTRIES);
        // Full, later: the expired half goes first.
        let later = now() + Duration::from_secs(100);
        cache.insert(digest(VERIFIED_CACHE_ENTRIES), &checked(1000), later);
        assert_eq!(cache.entries.len(), VERIFIED_CACHE_ENTRIES / 2 + 1);
        assert!(cache.get(&digest(1), later).is_some());
        assert!(cache.get(&digest(0), later).is_none());
        // Full with nothing expired: the oldest go, down to nine tenths.
        let mut i = VERIFIED_CACHE_ENTRIES + 1;
        while cache.entries.len() < VERIFIED_CACHE_ENTRIES {
            cache.insert(digest(i), &checked(1000), later);
            i += 1;
        }
        cache.insert(digest(i), &checked(1000), later);
        let evict_to = VERIFIED_CACHE_ENTRIES / 10 * 9;
        assert_eq!(cache.entries.len(), evict_to);
        assert_eq!(cache.entries.order.len(), evict_to);
        assert!(cache.get(&digest(1), later).is_none(), "oldest evicted");
        assert!(cache.get(&digest(i - 1), later).is_some());
        assert!(cache.get(&digest(i), later).is_some());
    }
}
