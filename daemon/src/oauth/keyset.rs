//! The issuer's key set as held, the choice of a token's key from it, and the state of
//! its refreshes: the one fetch in flight and what it tells those waiting for it, the
//! refetch cooldown, when the schedule refreshes next, how the last attempt went.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use jsonwebtoken::Algorithm;
use reqwest::Url;
use serde_json::Value;
use tokio::sync::watch;

use super::jwks::{FetchError, VerifyKey};
use crate::vocab::Reason;

/// Least time between two key-set fetches triggered by tokens.
pub const REFETCH_COOLDOWN: Duration = Duration::from_secs(30);
/// How long after a key-set fetch started a request with an unknown `kid` may still wait
/// for it; then it is answered `keys-unavailable` and the fetch goes on without it. (A
/// request arriving at a fetch that has run that long already is answered at once.)
pub const UNKNOWN_KEY_WAIT: Duration = Duration::from_secs(1);

pub(super) struct KeySet {
    pub(super) keys: Vec<VerifyKey>,
    /// The JWK entries the keys came from (a refresh that returns the same ones changes
    /// nothing).
    pub(super) raw: Vec<Value>,
    pub(super) origin: Origin,
    /// When the keys were fetched (for a cached set: originally fetched).
    pub(super) at: SystemTime,
}

pub(super) enum Origin {
    Fetched(String),
    File(PathBuf),
    /// Read back from the cache; the URL the keys were originally fetched from.
    Cache(String),
}

/// Why no key was chosen.
pub(super) enum Miss {
    /// No key with that `kid` (or none of that algorithm): worth one refetch.
    Unknown,
    Refused(Reason),
}

impl KeySet {
    /// `kid` present: the one key with exactly that `kid`. Absent: the one key of `alg`.
    /// Either way the key's own algorithm must be the token's.
    pub(super) fn select(&self, kid: Option<&str>, alg: Algorithm) -> Result<usize, Miss> {
        let mut candidates = self
            .keys
            .iter()
            .enumerate()
            .filter(|(_, key)| match kid {
                Some(kid) => key.kid.as_deref() == Some(kid),
                None => key.alg == alg,
            })
            .map(|(index, _)| index);
        match (candidates.next(), candidates.next()) {
            (None, _) => Err(Miss::Unknown),
            (Some(_), Some(_)) => Err(Miss::Refused(Reason::AmbiguousKey)),
            (Some(index), None) if self.keys[index].alg != alg => {
                Err(Miss::Refused(Reason::KeyMismatch))
            }
            (Some(index), None) => Ok(index),
        }
    }
}

/// What a finished fetch tells those waiting for it.
pub(super) type Outcome = Result<(), Arc<FetchError>>;
pub(super) type Done = watch::Receiver<Option<Outcome>>;

#[derive(Default)]
pub(super) struct RefreshState {
    /// The fetch running now, and when it started; its outcome is published here when it
    /// ends.
    pub(super) in_flight: Option<(Done, tokio::time::Instant)>,
    /// When a token last started a fetch (the refetch cooldown).
    pub(super) last_token_fetch: Option<Instant>,
    /// The `jwks_uri` found by discovery, reused until a fetch from it fails.
    pub(super) jwks_uri: Option<Url>,
    /// When the schedule refreshes next.
    pub(super) next: Option<Instant>,
    /// When the last fetch ended, and why it failed if it did.
    pub(super) last_attempt: Option<SystemTime>,
    pub(super) last_error: Option<String>,
    /// SHA-256 of the key file as last read: a scheduled check of an unchanged file
    /// changes nothing.
    pub(super) file_digest: Option<[u8; 32]>,
}

impl RefreshState {
    /// The fetch running now, if any (one whose task is gone counts as none).
    pub(super) fn running(&self) -> Option<Done> {
        self.running_since().map(|(done, _)| done)
    }

    pub(super) fn running_since(&self) -> Option<(Done, tokio::time::Instant)> {
        self.in_flight
            .as_ref()
            .filter(|(done, _)| done.borrow().is_none() && done.has_changed().is_ok())
            .cloned()
    }
}

/// Wait for a fetch to end; its outcome.
pub(super) async fn outcome_of(mut done: Done) -> Outcome {
    match done.wait_for(Option::is_some).await {
        Ok(outcome) => outcome.clone().unwrap_or(Ok(())),
        Err(_) => Err(Arc::new(FetchError::Interrupted)),
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::oauth::testutil::{TestKey, claims, file_verifier, now, verdict};

    #[tokio::test]
    async fn key_choice_refusals() {
        let dir = tempfile::tempdir().unwrap();
        let rsa = TestKey::new(Algorithm::RS256, "rsa");
        let ec1 = TestKey::new(Algorithm::ES256, "ec1");
        let ec2 = TestKey::new(Algorithm::ES256, "ec2");
        let v = file_verifier(dir.path(), &[&rsa, &ec1, &ec2]).await;

        // Unknown kid (the file is re-read once, still unknown).
        let stranger = TestKey::new(Algorithm::ES256, "stranger");
        assert_eq!(
            verdict(&v, &stranger.token()).await,
            Err(Reason::UnknownKey)
        );

        // No kid, two keys of that algorithm.
        let mut header = ec1.header();
        header.as_object_mut().unwrap().remove("kid");
        assert_eq!(
            verdict(&v, &ec1.sign(&header, &claims())).await,
            Err(Reason::AmbiguousKey)
        );
        // No kid, exactly one key of that algorithm: that one.
        let mut header = rsa.header();
        header.as_object_mut().unwrap().remove("kid");
        assert!(verdict(&v, &rsa.sign(&header, &claims())).await.is_ok());

        // The kid of an EC key on an RS256 token.
        let mut header = rsa.header();
        header["kid"] = json!("ec1");
        assert_eq!(
            verdict(&v, &rsa.sign(&header, &claims())).await,
            Err(Reason::KeyMismatch)
        );
        assert_eq!(v.signature_checks(), 1);

        // Two keys with the same kid.
        let dup_dir = tempfile::tempdir().unwrap();
        let mut twin = TestKey::new(Algorithm::ES256, "ec1");
        twin.kid = "ec1".into();
        let v = file_verifier(dup_dir.path(), &[&ec1, &twin]).await;
        assert_eq!(verdict(&v, &ec1.token()).await, Err(Reason::AmbiguousKey));
    }

    #[test]
    fn key_selection_is_exact() {
        let key = |kid: Option<&str>, alg| VerifyKey {
            kid: kid.map(str::to_owned),
            alg,
            key: jsonwebtoken::DecodingKey::from_ed_components(
                "11qYAYKxCrfVS_7TyWQHOg7hcvPapiMlrwIaaPcHURo",
            )
            .unwrap(),
        };
        let set = KeySet {
            keys: vec![
                key(Some("a"), Algorithm::ES256),
                key(Some("A"), Algorithm::ES256),
                key(None, Algorithm::EdDSA),
            ],
            raw: Vec::new(),
            origin: Origin::Cache(String::new()),
            at: now(),
        };
        assert!(matches!(set.select(Some("a"), Algorithm::ES256), Ok(0)));
        assert!(matches!(set.select(Some("A"), Algorithm::ES256), Ok(1)));
        assert!(matches!(
            set.select(Some("a "), Algorithm::ES256),
            Err(Miss::Unknown)
        ));
        assert!(matches!(set.select(None, Algorithm::EdDSA), Ok(2)));
        assert!(matches!(
            set.select(None, Algorithm::RS256),
            Err(Miss::Unknown)
        ));
        assert!(matches!(
            set.select(None, Algorithm::ES256),
            Err(Miss::Refused(Reason::AmbiguousKey))
        ));
        assert!(matches!(
            set.select(Some("a"), Algorithm::EdDSA),
            Err(Miss::Refused(Reason::KeyMismatch))
        ));
    }
}
