//! The shipped [`Verifier`]: JWT access tokens (RFC 9068) signed by the configured issuer,
//! checked with jsonwebtoken against the issuer's key set (see [`super::jwks`]).
//!
//! Order of checks, cheapest first: size; the verified-token cache; shape (three
//! base64url segments) and header (`alg` in the configured list, `typ` `at+jwt`); key
//! choice (exact `kid`, else the single key of that algorithm; the key's own algorithm must
//! be the token's); signature (jsonwebtoken, signature only); then the claims, checked here
//! against the caller's clock: `iss`, `aud`, `exp`/`nbf`/`iat` with 60 s skew, `sub`,
//! `client_id`, scopes, principal allow-list.
//!
//! The key set is refreshed on a schedule (the key server's `max-age` within
//! [`KeyRefresh`] bounds), on reload and on an operator's command, and when a token names
//! a key the set does not hold (at most once per [`REFETCH_COOLDOWN`]). A failed refresh
//! keeps the held set.
//!
//! Invariants: no token text in any log line or error; a token's `jku`, `x5u`, `jwk` and
//! `x5c` are never used; successes are cached until they expire, and a token whose
//! signature failed is remembered as forged (by digest, [`FORGED_CACHE_ENTRIES`] at most)
//! so that replaying it costs a hash, not a signature check; a changed key set empties
//! both; at most one key-set fetch is in flight, whatever started it; a request waits at
//! most [`UNKNOWN_KEY_WAIT`] for a fetch.

use std::collections::{HashMap, HashSet, VecDeque};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use jsonwebtoken::errors::ErrorKind;
use jsonwebtoken::{Algorithm, Validation};
use parking_lot::{Mutex, RwLock};
use reqwest::Url;
use robota_proto::KeySetStatus;
use serde::Deserialize;
use serde_json::{Map, Value};
use sha2::{Digest, Sha256};
use tokio::sync::{Notify, watch};

use super::introspect::{
    self, IntrospectionSettings, Introspector, SecretFileError, SettingsError,
};
use super::jwks::{self, CacheDoc, ClientError, FetchError, Fetcher, ParsedKeys, VerifyKey};
use super::{MAX_TOKEN_BYTES, Principal, RefreshFuture, Verifier, VerifyFuture, b64};
use crate::config::{KeyRefresh, KeySource};
use crate::metrics::Metrics;
use crate::vocab::Reason;
use crate::vocab::{FetchOutcome, RefreshTrigger};

/// Allowed clock difference for `exp`, `nbf` and `iat`.
pub const CLOCK_SKEW: Duration = Duration::from_secs(60);
/// Least time between two key-set fetches triggered by tokens.
pub const REFETCH_COOLDOWN: Duration = Duration::from_secs(30);
/// How long after a key-set fetch started a request with an unknown `kid` may still wait
/// for it; then it is answered `keys-unavailable` and the fetch goes on without it. (A
/// request arriving at a fetch that has run that long already is answered at once.)
pub const UNKNOWN_KEY_WAIT: Duration = Duration::from_secs(1);
/// Most tokens remembered as verified.
pub const VERIFIED_CACHE_ENTRIES: usize = 10_000;
/// Most tokens remembered as forged (a bad signature against the held key set).
pub const FORGED_CACHE_ENTRIES: usize = 4_096;
/// The algorithms this verifier can be configured with.
pub const SUPPORTED_ALGORITHMS: [Algorithm; 3] =
    [Algorithm::RS256, Algorithm::ES256, Algorithm::EdDSA];

/// What the verifier accepts; built by the remote carrier from `[remote]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JwtConfig {
    /// The exact `iss`, an `https://` URL.
    pub issuer: String,
    /// Accepted `aud` values (the public URL by default); a token must name exactly one.
    pub audiences: Vec<String>,
    /// A non-empty subset of RS256, ES256, EdDSA.
    pub algorithms: Vec<Algorithm>,
    pub required_scopes: Vec<String>,
    /// Exact `sub` values admitted.
    pub allowed_subjects: Vec<String>,
    /// Exact `client_id` values admitted.
    pub allowed_clients: Vec<String>,
    pub keys: KeySource,
    /// Extra PEM trust anchors for issuer fetches, added to webpki-roots.
    pub ca_file: Option<PathBuf>,
    /// The last good key set (`<state_dir>/jwks-cache.json`).
    pub cache_path: PathBuf,
    /// Start even when no key set can be loaded; tokens then get `keys-unavailable` until
    /// a fetch succeeds.
    pub start_without_keys: bool,
    pub refresh: KeyRefresh,
    /// Opaque (non-JWT) tokens go to the issuer's introspection endpoint; without this
    /// they are `malformed`.
    pub introspection: Option<IntrospectionSettings>,
}

/// Why a [`JwtVerifier`] cannot be built (a configuration error).
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    #[error("no principal allow-list: set allowed subjects and/or allowed clients")]
    NoAllowList,
    #[error("an allowed {kind} is {value:?}; entries are exact, non-empty values (no wildcards)")]
    BadAllowListEntry { kind: &'static str, value: String },
    #[error("no algorithm configured (choose from RS256, ES256, EdDSA)")]
    NoAlgorithms,
    #[error("algorithm {0:?} is not supported (only RS256, ES256, EdDSA)")]
    UnsupportedAlgorithm(Algorithm),
    #[error("no audience configured")]
    NoAudiences,
    #[error("issuer {0:?} is not an https URL without user-info, query or fragment")]
    Issuer(String),
    #[error("jwks_uri {0:?} is not an https URL without user-info or fragment")]
    JwksUri(String),
    #[error("key refresh bounds must be 1s to 7d with min <= default <= max, got {0:?}")]
    KeyRefresh(KeyRefresh),
    #[error(
        "jsonwebtoken has no usable crypto provider (exactly one of its `aws_lc_rs`/`rust_crypto` features must be enabled)"
    )]
    CryptoProvider,
    #[error(transparent)]
    Client(#[from] ClientError),
    #[error("introspection")]
    Introspection(#[from] SettingsError),
}

/// Why the start-up key load failed.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error(
        "cannot load the signing keys of issuer {issuer}, and the key-set cache is unusable ({cache})"
    )]
    Unavailable {
        issuer: String,
        /// Why the cache was not used.
        cache: String,
        #[source]
        source: Arc<FetchError>,
    },
    #[error("cannot load the signing keys of issuer {issuer}")]
    File {
        issuer: String,
        #[source]
        source: Arc<FetchError>,
    },
}

/// Make sure jsonwebtoken has a process-wide crypto provider, so that decoding cannot panic
/// at run time: with exactly one backend feature enabled it picks that one; otherwise we
/// install aws-lc-rs (ours) if nothing else was installed first.
pub fn ensure_crypto_provider() -> Result<(), BuildError> {
    use jsonwebtoken::crypto::{CryptoProvider, aws_lc};
    if CryptoProvider::try_get_default().is_none() {
        // Losing a race to another installer is fine; the check below decides.
        let _ = aws_lc::DEFAULT_PROVIDER.install_default();
    }
    CryptoProvider::try_get_default()
        .map(|_| ())
        .ok_or(BuildError::CryptoProvider)
}

/// The monotonic clock behind the refetch cooldown and the refresh schedule (injectable
/// for tests). The default is tokio's clock, so paused-time tests move it too.
pub(crate) type Clock = Arc<dyn Fn() -> Instant + Send + Sync>;

/// JWT access-token verifier for the remote carrier.
pub struct JwtVerifier(Arc<Inner>);

struct Inner {
    policy: Policy,
    algorithms: Vec<Algorithm>,
    validations: Vec<(Algorithm, Validation)>,
    source: KeySource,
    cache_path: PathBuf,
    start_without_keys: bool,
    refresh: KeyRefresh,
    fetcher: Fetcher,
    metrics: Metrics,
    keys: RwLock<Option<Arc<KeySet>>>,
    state: Mutex<RefreshState>,
    /// Woken whenever the next scheduled refresh moves.
    rescheduled: Arc<Notify>,
    clock: Clock,
    verified: Mutex<VerifiedCache>,
    /// The lane of one for signature checks of suspect tokens ([`Verifier::verify_suspect`]).
    suspect_lane: tokio::sync::Semaphore,
    signature_checks: AtomicU64,
    introspector: Option<Introspector>,
}

/// The claim rules, separate from keys and I/O.
pub(super) struct Policy {
    issuer: String,
    audiences: Vec<String>,
    required_scopes: Vec<String>,
    allowed_subjects: HashSet<String>,
    allowed_clients: HashSet<String>,
}

struct KeySet {
    keys: Vec<VerifyKey>,
    /// The JWK entries the keys came from (a refresh that returns the same ones changes
    /// nothing).
    raw: Vec<Value>,
    origin: Origin,
    /// When the keys were fetched (for a cached set: originally fetched).
    at: SystemTime,
}

enum Origin {
    Fetched(String),
    File(PathBuf),
    /// Read back from the cache; the URL the keys were originally fetched from.
    Cache(String),
}

/// What a finished fetch tells those waiting for it.
type Outcome = Result<(), Arc<FetchError>>;
type Done = watch::Receiver<Option<Outcome>>;

#[derive(Default)]
struct RefreshState {
    /// The fetch running now, and when it started; its outcome is published here when it
    /// ends.
    in_flight: Option<(Done, tokio::time::Instant)>,
    /// When a token last started a fetch (the refetch cooldown).
    last_token_fetch: Option<Instant>,
    /// The `jwks_uri` found by discovery, reused until a fetch from it fails.
    jwks_uri: Option<Url>,
    /// When the schedule refreshes next.
    next: Option<Instant>,
    /// When the last fetch ended, and why it failed if it did.
    last_attempt: Option<SystemTime>,
    last_error: Option<String>,
    /// SHA-256 of the key file as last read: a scheduled check of an unchanged file
    /// changes nothing.
    file_digest: Option<[u8; 32]>,
}

impl RefreshState {
    /// The fetch running now, if any (one whose task is gone counts as none).
    fn running(&self) -> Option<Done> {
        self.running_since().map(|(done, _)| done)
    }

    fn running_since(&self) -> Option<(Done, tokio::time::Instant)> {
        self.in_flight
            .as_ref()
            .filter(|(done, _)| done.borrow().is_none() && done.has_changed().is_ok())
            .cloned()
    }
}

/// Wait for a fetch to end; its outcome.
async fn outcome_of(mut done: Done) -> Outcome {
    match done.wait_for(Option::is_some).await {
        Ok(outcome) => outcome.clone().unwrap_or(Ok(())),
        Err(_) => Err(Arc::new(FetchError::Interrupted)),
    }
}

impl JwtVerifier {
    /// Check the configuration and build the HTTPS client; no I/O beyond reading `ca_file`.
    pub fn build(config: JwtConfig, metrics: Metrics) -> Result<Self, BuildError> {
        ensure_crypto_provider()?;
        if config.allowed_subjects.is_empty() && config.allowed_clients.is_empty() {
            return Err(BuildError::NoAllowList);
        }
        for (kind, values) in [
            ("subject", &config.allowed_subjects),
            ("client", &config.allowed_clients),
        ] {
            if let Some(bad) = values.iter().find(|v| v.is_empty() || v.as_str() == "*") {
                return Err(BuildError::BadAllowListEntry {
                    kind,
                    value: bad.clone(),
                });
            }
        }
        if config.algorithms.is_empty() {
            return Err(BuildError::NoAlgorithms);
        }
        if let Some(alg) = config
            .algorithms
            .iter()
            .find(|a| !SUPPORTED_ALGORITHMS.contains(a))
        {
            return Err(BuildError::UnsupportedAlgorithm(*alg));
        }
        if config.audiences.is_empty() {
            return Err(BuildError::NoAudiences);
        }
        if jwks::https_url(&config.issuer).is_none_or(|u| u.query().is_some()) {
            return Err(BuildError::Issuer(config.issuer));
        }
        if let KeySource::JwksUri(uri) = &config.keys
            && jwks::https_url(uri).is_none()
        {
            return Err(BuildError::JwksUri(uri.clone()));
        }
        let r = config.refresh;
        if ![r.default, r.min, r.max]
            .iter()
            .all(|d| KeyRefresh::RANGE.contains(d))
            || r.min > r.default
            || r.default > r.max
        {
            return Err(BuildError::KeyRefresh(r));
        }
        let fetcher = Fetcher::new(config.ca_file.as_deref(), metrics.clone())?;
        let clock: Clock = Arc::new(|| tokio::time::Instant::now().into_std());
        let introspector = match config.introspection {
            Some(settings) => Some(Introspector::build(
                settings,
                &config.issuer,
                clock.clone(),
            )?),
            None => None,
        };
        let mut algorithms: Vec<Algorithm> = Vec::new();
        for alg in config.algorithms {
            if !algorithms.contains(&alg) {
                algorithms.push(alg);
            }
        }
        let validations = algorithms
            .iter()
            .map(|&alg| (alg, signature_only(alg)))
            .collect();
        Ok(Self(Arc::new(Inner {
            policy: Policy {
                issuer: config.issuer,
                audiences: config.audiences,
                required_scopes: config.required_scopes,
                allowed_subjects: config.allowed_subjects.into_iter().collect(),
                allowed_clients: config.allowed_clients.into_iter().collect(),
            },
            algorithms,
            validations,
            source: config.keys,
            cache_path: config.cache_path,
            start_without_keys: config.start_without_keys,
            refresh: config.refresh,
            fetcher,
            metrics,
            keys: RwLock::new(None),
            state: Mutex::new(RefreshState::default()),
            rescheduled: Arc::new(Notify::new()),
            clock,
            verified: Mutex::new(VerifiedCache::default()),
            suspect_lane: tokio::sync::Semaphore::new(1),
            signature_checks: AtomicU64::new(0),
            introspector,
        })))
    }

    /// The initial key load at start-up, before any request. If the keys cannot be
    /// fetched, the cached set is used (with a warning); with no usable cache this fails
    /// unless `start_without_keys`.
    pub async fn load(&self) -> Result<(), LoadError> {
        let inner = &self.0;
        if let Some(introspector) = &inner.introspector {
            // Not fatal: JWTs are served either way, and an unknown endpoint is looked
            // up again when an opaque token arrives.
            if let Some(url) = introspector.endpoint(&inner.fetcher).await {
                tracing::info!(endpoint = %url, "opaque tokens are checked by introspection");
            }
        }
        // A successful start-up load does not start the refetch cooldown: a key rotated
        // just before (or just after) a start is picked up by the first unknown `kid`.
        // A failed one does, so an unreachable issuer is not asked again at once.
        let error = match inner.refresh_now(RefreshTrigger::Start).await {
            Ok(()) => return Ok(()),
            Err(e) => {
                inner.state.lock().last_token_fetch = Some((inner.clock)());
                e
            }
        };
        let issuer = inner.policy.issuer.clone();
        if let KeySource::JwksFile(_) = inner.source {
            if inner.start_without_keys {
                tracing::warn!(%issuer, error = %crate::error_chain(&*error), "no signing keys; tokens are refused with keys-unavailable until the key file loads");
                return Ok(());
            }
            return Err(LoadError::File {
                issuer,
                source: error,
            });
        }
        match jwks::read_cache(&inner.cache_path, &issuer, &inner.algorithms) {
            Ok(cached) => {
                tracing::warn!(
                    %issuer,
                    error = %crate::error_chain(&*error),
                    keys = cached.keys.keys.len(),
                    fetched = %humantime::format_rfc3339_seconds(cached.fetched_at),
                    "issuer unreachable; using the cached key set"
                );
                inner.install(cached.keys, Origin::Cache(cached.source), cached.fetched_at);
                Ok(())
            }
            Err(cache_error) if inner.start_without_keys => {
                tracing::warn!(
                    %issuer,
                    error = %crate::error_chain(&*error),
                    cache = %crate::error_chain(&cache_error),
                    "no signing keys; tokens are refused with keys-unavailable until a fetch succeeds"
                );
                Ok(())
            }
            Err(cache_error) => Err(LoadError::Unavailable {
                issuer,
                cache: crate::error_chain(&cache_error),
                source: error,
            }),
        }
    }

    /// Refresh the key set on schedule for as long as the verifier lives (the task ends
    /// when it is dropped). Spawned once, by the daemon.
    pub fn spawn_schedule(&self) -> tokio::task::JoinHandle<()> {
        let weak = Arc::downgrade(&self.0);
        let rescheduled = self.0.rescheduled.clone();
        tokio::spawn(async move {
            loop {
                let Some(inner) = weak.upgrade() else { return };
                let wait = inner
                    .state
                    .lock()
                    .next
                    .map(|next| next.saturating_duration_since((inner.clock)()));
                // Not holding the verifier while asleep.
                drop(inner);
                let moved = rescheduled.notified();
                match wait {
                    None => {
                        moved.await;
                        continue;
                    }
                    Some(wait) if !wait.is_zero() => tokio::select! {
                        () = tokio::time::sleep(wait) => {}
                        () = moved => continue,
                    },
                    Some(_) => {}
                }
                let Some(inner) = weak.upgrade() else { return };
                let now = (inner.clock)();
                if inner.state.lock().next.is_some_and(|next| next <= now) {
                    let _ = inner.scheduled().await;
                    // Never spin: a refresh that left no later time waits the least.
                    let mut state = inner.state.lock();
                    if state.next.is_none_or(|next| next <= now) {
                        state.next = now.checked_add(inner.refresh.min);
                    }
                }
            }
        })
    }

    /// Read the files holding secrets (the introspection client secret), at start and
    /// never by `check-config`.
    pub fn read_secrets(&self) -> Result<(), SecretFileError> {
        match &self.0.introspector {
            Some(introspector) => introspector.read_secret(),
            None => Ok(()),
        }
    }

    /// The key set for `status`.
    pub fn key_set(&self) -> KeySetStatus {
        self.0.key_set()
    }

    #[cfg(test)]
    pub(crate) fn with_clock(mut self, clock: Clock) -> Self {
        let inner =
            Arc::get_mut(&mut self.0).expect("the clock is set before the verifier is shared");
        if let Some(introspector) = &mut inner.introspector {
            introspector.set_clock(clock.clone());
        }
        inner.clock = clock;
        self
    }

    /// How many signatures were checked (the crypto the verified-token cache saves).
    #[cfg(test)]
    pub(crate) fn signature_checks(&self) -> u64 {
        self.0.signature_checks.load(Ordering::Relaxed)
    }
}

impl Inner {
    /// Start a fetch (the caller made sure none is running); the task publishes its
    /// outcome on the returned channel.
    fn begin(self: &Arc<Self>, trigger: RefreshTrigger, state: &mut RefreshState) -> Done {
        let (tx, done) = watch::channel(None);
        state.in_flight = Some((done.clone(), tokio::time::Instant::now()));
        let inner = self.clone();
        tokio::spawn(async move {
            let outcome = inner.attempt(trigger).await;
            let _ = tx.send(Some(outcome));
        });
        done
    }

    /// Fetch now, whatever the schedule and the cooldown say. A fetch already running may
    /// have started before the change the caller wants picked up: it is waited for, then
    /// the keys are fetched again.
    async fn refresh_now(self: &Arc<Self>, trigger: RefreshTrigger) -> Outcome {
        let running = self.state.lock().running();
        if let Some(done) = running {
            let _ = outcome_of(done).await;
        }
        let done = {
            let mut state = self.state.lock();
            match state.running() {
                // Started after ours was asked for: as good as our own.
                Some(done) => done,
                None => self.begin(trigger, &mut state),
            }
        };
        outcome_of(done).await
    }

    /// The schedule's refresh: joins a fetch that is running.
    async fn scheduled(self: &Arc<Self>) -> Outcome {
        let done = {
            let mut state = self.state.lock();
            match state.running() {
                Some(done) => done,
                None => self.begin(RefreshTrigger::Schedule, &mut state),
            }
        };
        outcome_of(done).await
    }

    /// For a token naming a key we do not hold: join the fetch that is running, or start
    /// one unless a token started one less than [`REFETCH_COOLDOWN`] ago. With the time
    /// until which the token may wait for it.
    fn token_fetch(self: &Arc<Self>, why: &'static str) -> Option<(Done, tokio::time::Instant)> {
        let mut state = self.state.lock();
        if let Some((done, since)) = state.running_since() {
            return Some((done, since + UNKNOWN_KEY_WAIT));
        }
        let now = (self.clock)();
        if let Some(last) = state.last_token_fetch
            && now.saturating_duration_since(last) < REFETCH_COOLDOWN
        {
            tracing::debug!(why, "key-set refetch rate-limited");
            return None;
        }
        state.last_token_fetch = Some(now);
        tracing::info!(issuer = %self.policy.issuer, why, "refetching the signing key set");
        let done = self.begin(RefreshTrigger::Token, &mut state);
        Some((done, tokio::time::Instant::now() + UNKNOWN_KEY_WAIT))
    }

    /// One fetch (or read), start to end: obtain and install the keys, then record how it
    /// went and when the schedule refreshes next.
    async fn attempt(&self, trigger: RefreshTrigger) -> Outcome {
        let result = self.obtain(trigger).await;
        let now = (self.clock)();
        let ended = SystemTime::now();
        let held = self.current_keys().map_or(0, |set| set.keys.len());
        let mut state = self.state.lock();
        state.in_flight = None;
        state.last_attempt = Some(ended);
        let outcome = match result {
            Ok(period) => {
                state.last_error = None;
                state.next = now.checked_add(period);
                drop(state);
                self.metrics.jwks_refreshed(ended);
                Ok(())
            }
            Err(e) => {
                let message = crate::error_chain(&e);
                state.last_error = Some(message.clone());
                state.next = now.checked_add(self.refresh.min);
                drop(state);
                self.metrics.jwks_refresh_failed(trigger);
                // The start-up load says what it falls back to itself.
                if trigger != RefreshTrigger::Start {
                    tracing::warn!(
                        issuer = %self.policy.issuer,
                        trigger = trigger.as_str(),
                        error = %message,
                        keys = held,
                        "key-set refresh failed; keeping the keys held"
                    );
                }
                Err(Arc::new(e))
            }
        };
        self.rescheduled.notify_one();
        outcome
    }

    /// Fetch (or read) the key set and install it; how long until the schedule refreshes
    /// it next. Only one runs at a time.
    async fn obtain(&self, trigger: RefreshTrigger) -> Result<Duration, FetchError> {
        let bounds = self.refresh;
        let (parsed, origin, period) = match &self.source {
            KeySource::JwksFile(path) => {
                let held = self.current_keys().is_some();
                let read = jwks::read_key_file(path);
                let digest: Option<[u8; 32]> =
                    read.as_ref().ok().map(|bytes| Sha256::digest(bytes).into());
                {
                    let state = self.state.lock();
                    if trigger == RefreshTrigger::Schedule
                        && held
                        && digest.is_some()
                        && state.file_digest == digest
                        && state.last_error.is_none()
                    {
                        return Ok(bounds.min);
                    }
                }
                let origin = path.display().to_string();
                let result =
                    read.and_then(|bytes| jwks::parse_key_set(&bytes, &self.algorithms, &origin));
                self.metrics.jwks_fetch(match &result {
                    Ok(_) => FetchOutcome::Ok,
                    Err(e) => e.outcome(),
                });
                let parsed = result?;
                self.state.lock().file_digest = digest;
                (parsed, Origin::File(path.clone()), bounds.min)
            }
            KeySource::JwksUri(uri) => {
                let url = jwks::https_url(uri)
                    .ok_or_else(|| FetchError::NotHttps { url: uri.clone() })?;
                let (parsed, freshness) = self.fetcher.fetch_keys(&url, &self.algorithms).await?;
                let period = freshness.period(bounds.default, bounds.min, bounds.max);
                (parsed, Origin::Fetched(url.to_string()), period)
            }
            KeySource::Discovery => {
                let known = self.state.lock().jwks_uri.take();
                let url = match known {
                    Some(url) => url,
                    None => self.fetcher.discover(&self.policy.issuer).await?,
                };
                let (parsed, freshness) = self.fetcher.fetch_keys(&url, &self.algorithms).await?;
                self.state.lock().jwks_uri = Some(url.clone());
                let period = freshness.period(bounds.default, bounds.min, bounds.max);
                (parsed, Origin::Fetched(url.to_string()), period)
            }
        };
        let at = SystemTime::now();
        if let Origin::Fetched(source) = &origin {
            self.persist(source, &parsed, at).await;
        }
        self.install(parsed, origin, at);
        Ok(period)
    }

    /// Write the cache file; a failure is logged, not fatal.
    async fn persist(&self, source: &str, parsed: &ParsedKeys, at: SystemTime) {
        let doc = CacheDoc {
            issuer: self.policy.issuer.clone(),
            source: source.to_owned(),
            fetched_at: jwks::unix_seconds(at),
            keys: parsed.raw.clone(),
        };
        let path = self.cache_path.clone();
        let written = tokio::task::spawn_blocking(move || jwks::write_cache(&path, &doc)).await;
        match written {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                tracing::warn!(path = %self.cache_path.display(), error = %e, "cannot write the key-set cache")
            }
            Err(e) => tracing::warn!(error = %e, "the key-set cache writer failed"),
        }
    }

    fn install(&self, parsed: ParsedKeys, origin: Origin, at: SystemTime) {
        let from = match &origin {
            Origin::Fetched(url) => url.clone(),
            Origin::File(path) => path.display().to_string(),
            Origin::Cache(url) => format!("cache {} (of {url})", self.cache_path.display()),
        };
        let (count, skipped) = (parsed.keys.len(), parsed.dropped);
        let mut keys = self.keys.write();
        let unchanged = keys.as_ref().is_some_and(|held| held.raw == parsed.raw);
        *keys = Some(Arc::new(KeySet {
            keys: parsed.keys,
            raw: parsed.raw,
            origin,
            at,
        }));
        drop(keys);
        if unchanged {
            tracing::debug!(issuer = %self.policy.issuer, keys = count, %from, "the signing key set is unchanged");
            return;
        }
        tracing::info!(
            issuer = %self.policy.issuer,
            keys = count,
            skipped,
            %from,
            "loaded the signing key set"
        );
        // Tokens verified against the old set are judged again against the new one.
        self.verified.lock().clear();
    }

    fn current_keys(&self) -> Option<Arc<KeySet>> {
        self.keys.read().clone()
    }

    fn key_set(&self) -> KeySetStatus {
        let set = self.current_keys();
        let state = self.state.lock();
        let now = (self.clock)();
        let wall = SystemTime::now();
        let unix = jwks::unix_seconds;
        KeySetStatus {
            source: self.source.kind(),
            location: set.as_ref().map(|set| match &set.origin {
                Origin::Fetched(url) | Origin::Cache(url) => url.clone(),
                Origin::File(path) => path.display().to_string(),
            }),
            keys: set.as_ref().map_or(0, |set| set.keys.len()),
            from_cache: set
                .as_ref()
                .is_some_and(|set| matches!(set.origin, Origin::Cache(_))),
            fetched_at: set.as_ref().map(|set| unix(set.at)),
            last_attempt_at: state.last_attempt.map(unix),
            last_error: state.last_error.clone(),
            next_refresh_at: state
                .next
                .and_then(|next| wall.checked_add(next.saturating_duration_since(now)))
                .map(unix),
            refreshing: state.running().is_some(),
        }
    }

    /// The key for a token's `kid` and `alg`. For a key we do not hold, a fetch is started
    /// or joined and waited for until it has run [`UNKNOWN_KEY_WAIT`]: a new key that is
    /// slow to fetch is `keys-unavailable` (try again), not `unknown-key` (a bad token).
    async fn find_key(
        self: &Arc<Self>,
        kid: Option<&str>,
        alg: Algorithm,
    ) -> Result<(Arc<KeySet>, usize), Reason> {
        let held = self.current_keys();
        if let Some(set) = &held {
            match set.select(kid, alg) {
                Ok(index) => return Ok((set.clone(), index)),
                Err(Miss::Unknown) => {}
                Err(Miss::Refused(reason)) => return Err(reason),
            }
        }
        let why = if held.is_some() {
            "unknown key"
        } else {
            "no key set"
        };
        let Some((done, until)) = self.token_fetch(why) else {
            return Err(if held.is_some() {
                Reason::UnknownKey
            } else {
                Reason::KeysUnavailable
            });
        };
        if tokio::time::timeout_at(until, outcome_of(done))
            .await
            .is_err()
        {
            return Err(Reason::KeysUnavailable);
        }
        let set = self.current_keys().ok_or(Reason::KeysUnavailable)?;
        match set.select(kid, alg) {
            Ok(index) => Ok((set, index)),
            Err(Miss::Unknown) => Err(Reason::UnknownKey),
            Err(Miss::Refused(reason)) => Err(reason),
        }
    }

    /// `suspect`: the token comes from an address over its failure budget, so its
    /// signature check (if one is needed) waits for the suspect lane and runs off the
    /// request workers.
    async fn check(
        self: &Arc<Self>,
        token: &str,
        now: SystemTime,
        suspect: bool,
    ) -> Result<Principal, Reason> {
        if token.len() > MAX_TOKEN_BYTES {
            return Err(Reason::Oversize);
        }
        let digest: [u8; 32] = Sha256::digest(token.as_bytes()).into();
        {
            let cache = self.verified.lock();
            if let Some(principal) = cache.get(&digest, now) {
                return Ok(principal);
            }
            // The same bytes failed their signature against the held key set already.
            if cache.forged(&digest) {
                return Err(Reason::BadSignature);
            }
        }
        if !introspect::jwt_shaped(token) {
            // Opaque: only the issuer can say (a JWT never goes there).
            return match &self.introspector {
                Some(introspector) => {
                    introspector
                        .check(
                            &self.fetcher,
                            &self.metrics,
                            &self.policy,
                            token,
                            &digest,
                            now,
                        )
                        .await
                }
                None => Err(Reason::Malformed),
            };
        }
        let (header, _, _) = split(token)?;
        let header = parse_header(header, &self.algorithms)?;
        let (set, index) = self.find_key(header.kid.as_deref(), header.alg).await?;
        let key = &set.keys[index];
        let validation = self
            .validations
            .iter()
            .find_map(|(alg, v)| (*alg == key.alg).then_some(v))
            .ok_or(Reason::UnsupportedAlgorithm)?;
        self.signature_checks.fetch_add(1, Ordering::Relaxed);
        let decoded = if suspect {
            // One at a time, on a blocking thread: a flood of fresh forgeries from
            // addresses over budget occupies at most one thread, never the workers.
            let _turn = self
                .suspect_lane
                .acquire()
                .await
                .map_err(|_| Reason::KeysUnavailable)?;
            let (set, token, validation) = (set.clone(), token.to_owned(), validation.clone());
            tokio::task::spawn_blocking(move || {
                jsonwebtoken::decode::<StrictObject>(&token, &set.keys[index].key, &validation)
            })
            .await
            .map_err(|_| Reason::Malformed)?
        } else {
            jsonwebtoken::decode::<StrictObject>(token, &key.key, validation)
        };
        // Remembered only if the key set is still the one it was checked against: a set
        // installed meanwhile has emptied the caches, and this token must not refill them.
        let still_held = || {
            self.current_keys()
                .is_some_and(|current| Arc::ptr_eq(&current, &set))
        };
        let data = match decoded {
            Ok(data) => data,
            Err(e) if *e.kind() == ErrorKind::InvalidSignature => {
                let mut cache = self.verified.lock();
                if still_held() {
                    cache.insert_forged(digest);
                }
                return Err(Reason::BadSignature);
            }
            Err(_) => return Err(Reason::Malformed),
        };
        let checked = check_claims(&data.claims.0, &self.policy, now)?;
        let mut verified = self.verified.lock();
        if still_held() {
            verified.insert(digest, &checked, now);
        }
        Ok(checked.principal)
    }
}

impl Verifier for JwtVerifier {
    fn verify<'a>(&'a self, token: &'a str, now: SystemTime) -> VerifyFuture<'a> {
        Box::pin(self.0.check(token, now, false))
    }

    fn verify_suspect<'a>(&'a self, token: &'a str, now: SystemTime) -> VerifyFuture<'a> {
        Box::pin(self.0.check(token, now, true))
    }

    fn required_scopes(&self) -> &[String] {
        &self.0.policy.required_scopes
    }

    fn key_set(&self) -> KeySetStatus {
        self.0.key_set()
    }

    fn refresh(&self, trigger: RefreshTrigger) -> RefreshFuture<'_> {
        Box::pin(async move {
            self.0
                .refresh_now(trigger)
                .await
                .map_err(|e| crate::error_chain(&*e))
        })
    }
}

/// A jsonwebtoken `Validation` that checks the signature and nothing else: the claims
/// are checked by [`check_claims`] against the caller's clock.
fn signature_only(alg: Algorithm) -> Validation {
    let mut v = Validation::new(alg);
    v.required_spec_claims.clear();
    v.validate_exp = false;
    v.validate_nbf = false;
    v.validate_aud = false;
    v.leeway = 0;
    v
}

/// Why no key was chosen.
enum Miss {
    /// No key with that `kid` (or none of that algorithm): worth one refetch.
    Unknown,
    Refused(Reason),
}

impl KeySet {
    /// `kid` present: the one key with exactly that `kid`. Absent: the one key of `alg`.
    /// Either way the key's own algorithm must be the token's.
    fn select(&self, kid: Option<&str>, alg: Algorithm) -> Result<usize, Miss> {
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

/// The three segments, each base64url (the signature may be empty; it then fails to verify).
fn split(token: &str) -> Result<(&str, &str, &str), Reason> {
    let mut parts = token.split('.');
    let (Some(header), Some(payload), Some(signature), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(Reason::Malformed);
    };
    if header.is_empty()
        || payload.is_empty()
        || ![header, payload, signature]
            .iter()
            .all(|s| b64::is_alphabet(s.as_bytes()))
    {
        return Err(Reason::Malformed);
    }
    Ok((header, payload, signature))
}

/// What we use from a JWS header.
#[derive(Debug, PartialEq, Eq)]
struct TokenHeader {
    alg: Algorithm,
    kid: Option<String>,
    /// `typ` is `at+jwt` (RFC 9068 §2.1), in either spelling, any case.
    access_token: bool,
}

/// Read the header of an access token: [`jose_header`], then `typ` must be `at+jwt`.
fn parse_header(segment: &str, allowed: &[Algorithm]) -> Result<TokenHeader, Reason> {
    let header = jose_header(segment, allowed)?;
    if !header.access_token {
        return Err(Reason::WrongType);
    }
    Ok(header)
}

/// Read a JWS header ourselves, before choosing a key (jsonwebtoken's `decode_header`
/// cannot tell `alg: none` from a broken header): strict base64url, a JSON object without
/// duplicate members, `alg` one of `allowed`, no `crit`, `kid` a string if present.
fn jose_header(segment: &str, allowed: &[Algorithm]) -> Result<TokenHeader, Reason> {
    let bytes = b64::decode(segment.as_bytes()).ok_or(Reason::Malformed)?;
    let StrictObject(header) = serde_json::from_slice(&bytes).map_err(|_| Reason::Malformed)?;
    let alg = match header.get("alg") {
        Some(Value::String(alg)) => alg.as_str(),
        _ => return Err(Reason::Malformed),
    };
    let alg = SUPPORTED_ALGORITHMS
        .into_iter()
        .find(|a| algorithm_name(*a) == alg && allowed.contains(a))
        .ok_or(Reason::UnsupportedAlgorithm)?;
    let access_token = match header.get("typ") {
        Some(Value::String(typ)) => {
            typ.eq_ignore_ascii_case("at+jwt") || typ.eq_ignore_ascii_case("application/at+jwt")
        }
        _ => false,
    };
    // We implement no JWS extension, so any `crit` is unmet (RFC 7515 §4.1.11).
    if header.contains_key("crit") {
        return Err(Reason::Malformed);
    }
    let kid = match header.get("kid") {
        None => None,
        Some(Value::String(kid)) => Some(kid.clone()),
        Some(_) => return Err(Reason::Malformed),
    };
    // `jku`, `x5u`, `jwk`, `x5c`: deliberately ignored — keys come only from our key set.
    Ok(TokenHeader {
        alg,
        kid,
        access_token,
    })
}

fn algorithm_name(alg: Algorithm) -> &'static str {
    match alg {
        Algorithm::RS256 => "RS256",
        Algorithm::ES256 => "ES256",
        Algorithm::EdDSA => "EdDSA",
        _ => "",
    }
}

/// A JSON object whose parse fails on a duplicate member (at the top level), so that two
/// parsers can never read different values from one token.
pub(super) struct StrictObject(pub(super) Map<String, Value>);

impl<'de> Deserialize<'de> for StrictObject {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl<'de> serde::de::Visitor<'de> for Visitor {
            type Value = StrictObject;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut access: A,
            ) -> Result<StrictObject, A::Error> {
                let mut map = Map::new();
                while let Some(key) = access.next_key::<String>()? {
                    let value: Value = access.next_value()?;
                    if map.contains_key(&key) {
                        return Err(serde::de::Error::custom("duplicate member"));
                    }
                    map.insert(key, value);
                }
                Ok(StrictObject(map))
            }
        }
        deserializer.deserialize_map(Visitor)
    }
}

/// A token whose claims passed.
pub(super) struct Checked {
    pub(super) principal: Principal,
    not_before: Option<SystemTime>,
}

/// A JSON NumericDate (non-negative seconds, possibly fractional) as a time.
fn numeric_date(value: &Value) -> Option<SystemTime> {
    let since_epoch = match value.as_u64() {
        Some(secs) => Duration::from_secs(secs),
        None => Duration::try_from_secs_f64(value.as_f64()?).ok()?,
    };
    UNIX_EPOCH.checked_add(since_epoch)
}

/// `exp` has passed, beyond the skew.
fn expired(exp: SystemTime, now: SystemTime) -> bool {
    now.checked_sub(CLOCK_SKEW).is_some_and(|limit| exp < limit)
}

/// `nbf` (or `iat`) is in the future, beyond the skew.
fn premature(t: SystemTime, now: SystemTime) -> bool {
    now.checked_add(CLOCK_SKEW).is_none_or(|limit| t > limit)
}

/// Check the claims of a token whose signature verified.
///
/// `aud` must be a single value — a string or a one-element array — equal to one of our
/// audiences. A multi-valued `aud` is refused even when it contains ours: such a token is
/// also good at another resource server, which could replay it to us (the confused-deputy
/// problem; RFC 8707 audience restriction, RFC 9068 §4).
pub(super) fn check_claims(
    claims: &Map<String, Value>,
    policy: &Policy,
    now: SystemTime,
) -> Result<Checked, Reason> {
    match claims.get("iss") {
        Some(Value::String(iss)) if *iss == policy.issuer => {}
        _ => return Err(Reason::WrongIssuer),
    }
    let aud = match claims.get("aud") {
        Some(Value::String(aud)) => Some(aud),
        Some(Value::Array(values)) => match values.as_slice() {
            [Value::String(aud)] => Some(aud),
            _ => None,
        },
        _ => None,
    };
    if !aud.is_some_and(|aud| policy.audiences.iter().any(|a| a == aud)) {
        return Err(Reason::WrongAudience);
    }
    let exp = claims
        .get("exp")
        .and_then(numeric_date)
        .ok_or(Reason::Malformed)?;
    if expired(exp, now) {
        return Err(Reason::Expired);
    }
    let not_before = match claims.get("nbf") {
        None => None,
        Some(nbf) => Some(numeric_date(nbf).ok_or(Reason::Malformed)?),
    };
    if not_before.is_some_and(|nbf| premature(nbf, now)) {
        return Err(Reason::NotYetValid);
    }
    // Issued in the future (beyond the skew): not valid yet either.
    if let Some(iat) = claims.get("iat") {
        let iat = numeric_date(iat).ok_or(Reason::Malformed)?;
        if premature(iat, now) {
            return Err(Reason::NotYetValid);
        }
    }
    let string_claim = |name: &str| match claims.get(name) {
        Some(Value::String(s)) => Ok(s.clone()),
        _ => Err(Reason::Malformed),
    };
    let subject = string_claim("sub")?;
    let client_id = string_claim("client_id")?;
    let scopes = scopes(claims)?;
    if !policy
        .required_scopes
        .iter()
        .all(|required| scopes.contains(required))
    {
        return Err(Reason::MissingScope);
    }
    if !policy.allowed_subjects.contains(&subject) && !policy.allowed_clients.contains(&client_id) {
        return Err(Reason::PrincipalNotAllowed);
    }
    Ok(Checked {
        principal: Principal {
            client_id,
            subject,
            scopes,
            expires_at: exp,
        },
        not_before,
    })
}

/// Scopes from `scope` (space-separated, RFC 9068 §2.2.3) or else `scp` (an array of
/// strings, or a space-separated string).
fn scopes(claims: &Map<String, Value>) -> Result<Vec<String>, Reason> {
    let split = |s: &str| -> Vec<String> {
        s.split(' ')
            .filter(|s| !s.is_empty())
            .map(str::to_owned)
            .collect()
    };
    match (claims.get("scope"), claims.get("scp")) {
        (Some(Value::String(s)), _) => Ok(split(s)),
        (Some(_), _) => Err(Reason::Malformed),
        (None, Some(Value::String(s))) => Ok(split(s)),
        (None, Some(Value::Array(values))) => values
            .iter()
            .map(|v| v.as_str().map(str::to_owned))
            .collect::<Option<Vec<_>>>()
            .ok_or(Reason::Malformed),
        (None, Some(_)) => Err(Reason::Malformed),
        (None, None) => Ok(Vec::new()),
    }
}

/// A full verified-token cache shrinks to this size (expired entries first, then the
/// oldest).
const EVICT_TO: usize = VERIFIED_CACHE_ENTRIES / 10 * 9;

/// Tokens that verified, by SHA-256 of the token text, until they expire. Bounded: when
/// full, expired entries go first, then the oldest, down to [`EVICT_TO`].
///
/// Beside them, tokens whose signature failed, by digest, oldest dropped first past
/// [`FORGED_CACHE_ENTRIES`]: a bad signature stays bad while the key set is the same.
#[derive(Default)]
struct VerifiedCache {
    entries: HashMap<[u8; 32], Checked>,
    order: VecDeque<[u8; 32]>,
    forged: HashSet<[u8; 32]>,
    forged_order: VecDeque<[u8; 32]>,
}

impl VerifiedCache {
    fn get(&self, digest: &[u8; 32], now: SystemTime) -> Option<Principal> {
        let entry = self.entries.get(digest)?;
        let valid = !expired(entry.principal.expires_at, now)
            && !entry.not_before.is_some_and(|nbf| premature(nbf, now));
        // An entry past its time stays until evicted; the full path refuses the token
        // with the exact reason.
        valid.then(|| entry.principal.clone())
    }

    fn insert(&mut self, digest: [u8; 32], checked: &Checked, now: SystemTime) {
        if self.entries.len() >= VERIFIED_CACHE_ENTRIES {
            self.entries
                .retain(|_, e| !expired(e.principal.expires_at, now));
            let entries = &self.entries;
            self.order.retain(|d| entries.contains_key(d));
            // Evict in a batch so that a full cache does not sweep on every insert.
            while self.entries.len() >= EVICT_TO {
                let Some(oldest) = self.order.pop_front() else {
                    break;
                };
                self.entries.remove(&oldest);
            }
        }
        let entry = Checked {
            principal: checked.principal.clone(),
            not_before: checked.not_before,
        };
        if self.entries.insert(digest, entry).is_none() {
            self.order.push_back(digest);
        }
    }

    fn forged(&self, digest: &[u8; 32]) -> bool {
        self.forged.contains(digest)
    }

    fn insert_forged(&mut self, digest: [u8; 32]) {
        if !self.forged.insert(digest) {
            return;
        }
        self.forged_order.push_back(digest);
        if self.forged_order.len() > FORGED_CACHE_ENTRIES
            && let Some(oldest) = self.forged_order.pop_front()
        {
            self.forged.remove(&oldest);
        }
    }

    fn clear(&mut self) {
        self.entries.clear();
        self.order.clear();
        self.forged.clear();
        self.forged_order.clear();
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use jsonwebtoken::EncodingKey;
    use serde_json::json;

    use robota_proto::KeySourceKind;

    use super::*;
    use crate::oauth::testutil::{
        self, AUDIENCE, ISSUER, ManualClock, Route, TestKey, TestServer, claims, config, jwks, now,
        sign_with, unix, unsigned, write,
    };

    fn build(config: JwtConfig) -> JwtVerifier {
        JwtVerifier::build(config, Metrics::new()).expect("verifier builds")
    }

    /// A verifier over a local JWKS file holding `keys`, loaded.
    async fn file_verifier(dir: &std::path::Path, keys: &[&TestKey]) -> JwtVerifier {
        let path = write(dir, "jwks.json", &jwks(keys));
        let v = build(config(ISSUER, KeySource::JwksFile(path), dir));
        v.load().await.expect("keys load");
        v
    }

    async fn verdict(v: &JwtVerifier, token: &str) -> Result<Principal, Reason> {
        v.verify(token, now()).await
    }

    /// `claims()` with `changes` applied (`null` removes a claim).
    fn with(changes: Value) -> Value {
        let mut c = claims();
        for (k, v) in changes.as_object().unwrap() {
            if v.is_null() {
                c.as_object_mut().unwrap().remove(k);
            } else {
                c[k] = v.clone();
            }
        }
        c
    }

    fn fetches(metrics: &Metrics, outcome: &str) -> u64 {
        let prefix = format!("robota_mcpd_jwks_fetches_total{{outcome=\"{outcome}\"}} ");
        metrics
            .render()
            .lines()
            .find_map(|l| l.strip_prefix(&prefix).map(|n| n.parse().unwrap()))
            .unwrap_or(0)
    }

    #[test]
    fn crypto_provider_is_usable() {
        ensure_crypto_provider().unwrap();
        assert!(jsonwebtoken::crypto::CryptoProvider::try_get_default().is_some());
    }

    #[tokio::test]
    async fn accepts_valid_rs256_es256_and_eddsa_tokens() {
        let dir = tempfile::tempdir().unwrap();
        let keys = [
            TestKey::new(Algorithm::RS256, "rsa"),
            TestKey::new(Algorithm::ES256, "ec"),
            TestKey::new(Algorithm::EdDSA, "ed"),
        ];
        let v = file_verifier(dir.path(), &keys.iter().collect::<Vec<_>>()).await;
        for key in &keys {
            let principal = verdict(&v, &key.token()).await.unwrap_or_else(|r| {
                panic!("{:?} refused: {}", key.alg, r.as_str());
            });
            assert_eq!(
                principal,
                Principal {
                    client_id: "client-a".into(),
                    subject: "alice".into(),
                    scopes: vec!["mcp:tools".into(), "other".into()],
                    expires_at: UNIX_EPOCH + Duration::from_secs(unix(now()) + 300),
                }
            );
        }
        assert_eq!(v.signature_checks(), 3);
        let state = v.key_set();
        assert_eq!(
            (state.source, state.keys, state.from_cache),
            (KeySourceKind::JwksFile, 3, false),
            "{state:?}"
        );
        assert!(state.location.unwrap().ends_with("jwks.json"));
        assert_eq!(v.required_scopes(), ["mcp:tools".to_owned()]);
    }

    #[tokio::test]
    async fn size_limit_is_checked_before_parsing() {
        let dir = tempfile::tempdir().unwrap();
        let key = TestKey::new(Algorithm::ES256, "ec");
        let v = file_verifier(dir.path(), &[&key]).await;
        // A valid token of exactly MAX_TOKEN_BYTES is accepted; one byte more is not parsed.
        let mut exact = None;
        let base = key.sign(&key.header(), &with(json!({"pad": ""}))).len();
        let estimate = (MAX_TOKEN_BYTES - base) * 3 / 4;
        'search: for extra in 0..4 {
            let mut header = key.header();
            header["x"] = json!("y".repeat(extra));
            for pad in estimate.saturating_sub(8)..estimate + 8 {
                let token = key.sign(&header, &with(json!({"pad": "p".repeat(pad)})));
                if token.len() == MAX_TOKEN_BYTES {
                    exact = Some(token);
                    break 'search;
                }
            }
        }
        let exact = exact.expect("found a token of exactly 8192 bytes");
        assert!(verdict(&v, &exact).await.is_ok());
        let junk = "a".repeat(MAX_TOKEN_BYTES);
        assert_eq!(verdict(&v, &junk).await, Err(Reason::Malformed));
        let over = format!("{exact}a");
        assert_eq!(over.len(), MAX_TOKEN_BYTES + 1);
        assert_eq!(verdict(&v, &over).await, Err(Reason::Oversize));
        let before = v.signature_checks();
        assert_eq!(
            verdict(&v, &"a".repeat(5_000_000)).await,
            Err(Reason::Oversize)
        );
        assert_eq!(v.signature_checks(), before);
    }

    #[tokio::test]
    async fn refuses_alg_none_and_hmac_with_the_public_key() {
        let dir = tempfile::tempdir().unwrap();
        let rsa = TestKey::new(Algorithm::RS256, "rsa");
        let v = file_verifier(dir.path(), &[&rsa]).await;
        let none = format!(
            "{}.",
            unsigned(
                &json!({"alg": "none", "typ": "at+jwt", "kid": "rsa"}),
                &claims()
            )
        );
        assert_eq!(verdict(&v, &none).await, Err(Reason::UnsupportedAlgorithm));
        let none_upper = format!(
            "{}.",
            unsigned(&json!({"alg": "NONE", "typ": "at+jwt"}), &claims())
        );
        assert_eq!(
            verdict(&v, &none_upper).await,
            Err(Reason::UnsupportedAlgorithm)
        );
        // The classic key-confusion attack: HS256 keyed with the RSA public key.
        let secret = EncodingKey::from_secret(rsa.public_pem.as_bytes()).unwrap();
        let hs = sign_with(
            &secret,
            Algorithm::HS256,
            &json!({"alg": "HS256", "typ": "at+jwt", "kid": "rsa"}),
            &claims(),
        );
        assert_eq!(verdict(&v, &hs).await, Err(Reason::UnsupportedAlgorithm));
        // An algorithm we support but did not configure.
        let mut cfg = config(
            ISSUER,
            KeySource::JwksFile(dir.path().join("jwks.json")),
            dir.path(),
        );
        cfg.algorithms = vec![Algorithm::RS256];
        let rs_only = build(cfg);
        rs_only.load().await.unwrap();
        let ec = TestKey::new(Algorithm::ES256, "ec");
        assert_eq!(
            verdict(&rs_only, &ec.token()).await,
            Err(Reason::UnsupportedAlgorithm)
        );
        assert_eq!(v.signature_checks() + rs_only.signature_checks(), 0);
    }

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

    #[tokio::test]
    async fn jku_x5u_and_embedded_jwk_are_never_used() {
        let dir = tempfile::tempdir().unwrap();
        let ours = TestKey::new(Algorithm::ES256, "ours");
        let evil = TestKey::new(Algorithm::ES256, "evil");
        let server = TestServer::start(dir.path()).await;
        server.route("/evil-jwks", Route::json(jwks(&[&evil])));
        let v = file_verifier(dir.path(), &[&ours]).await;
        let mut header = evil.header();
        header["jku"] = json!(server.url("/evil-jwks"));
        header["x5u"] = json!(server.url("/evil-cert"));
        header["jwk"] = evil.jwk.clone();
        assert_eq!(
            verdict(&v, &evil.sign(&header, &claims())).await,
            Err(Reason::UnknownKey)
        );
        // Same attacker headers, but the evil key pretends to be ours.
        header["kid"] = json!("ours");
        assert_eq!(
            verdict(&v, &evil.sign(&header, &claims())).await,
            Err(Reason::BadSignature)
        );
        // Our own token with a `jku` elsewhere is judged against our keys only.
        let mut header = ours.header();
        header["jku"] = json!(server.url("/evil-jwks"));
        assert!(verdict(&v, &ours.sign(&header, &claims())).await.is_ok());
        assert_eq!(server.total_hits(), 0, "nothing was fetched from jku/x5u");
    }

    #[tokio::test]
    async fn typ_must_be_at_jwt() {
        let dir = tempfile::tempdir().unwrap();
        let key = TestKey::new(Algorithm::EdDSA, "ed");
        let v = file_verifier(dir.path(), &[&key]).await;
        for (typ, expected) in [
            (json!("JWT"), Err(Reason::WrongType)),
            (json!("at+JWT"), Ok(())),
            (json!("application/AT+jwt"), Ok(())),
            (json!("at+jwt; x"), Err(Reason::WrongType)),
            (json!(["at+jwt"]), Err(Reason::WrongType)),
            (Value::Null, Err(Reason::WrongType)),
        ] {
            let mut header = key.header();
            if typ.is_null() {
                header.as_object_mut().unwrap().remove("typ");
            } else {
                header["typ"] = typ.clone();
            }
            let got = verdict(&v, &key.sign(&header, &claims())).await.map(|_| ());
            assert_eq!(got, expected, "typ {typ}");
        }
    }

    #[tokio::test]
    async fn claim_refusals() {
        let dir = tempfile::tempdir().unwrap();
        let key = TestKey::new(Algorithm::ES256, "ec");
        let v = file_verifier(dir.path(), &[&key]).await;
        let t = unix(now());
        let cases = [
            (
                "wrong iss",
                json!({"iss": "https://other.example"}),
                Err(Reason::WrongIssuer),
            ),
            (
                "iss with slash",
                json!({"iss": format!("{ISSUER}/")}),
                Err(Reason::WrongIssuer),
            ),
            (
                "iss array",
                json!({"iss": [ISSUER]}),
                Err(Reason::WrongIssuer),
            ),
            ("no iss", json!({"iss": null}), Err(Reason::WrongIssuer)),
            (
                "wrong aud",
                json!({"aud": "https://other.example/mcp"}),
                Err(Reason::WrongAudience),
            ),
            (
                "aud others",
                json!({"aud": ["https://a.example", "https://b.example"]}),
                Err(Reason::WrongAudience),
            ),
            (
                "aud ours and another",
                json!({"aud": [AUDIENCE, "https://b.example"]}),
                Err(Reason::WrongAudience),
            ),
            (
                "aud ours twice",
                json!({"aud": [AUDIENCE, AUDIENCE]}),
                Err(Reason::WrongAudience),
            ),
            ("aud one-element array", json!({"aud": [AUDIENCE]}), Ok(())),
            ("no aud", json!({"aud": null}), Err(Reason::WrongAudience)),
            ("aud number", json!({"aud": 5}), Err(Reason::WrongAudience)),
            (
                "expired beyond skew",
                json!({"exp": t - 61}),
                Err(Reason::Expired),
            ),
            ("expired within skew", json!({"exp": t - 59}), Ok(())),
            (
                "fractional exp",
                json!({"exp": (t + 10) as f64 + 0.5}),
                Ok(()),
            ),
            (
                "nbf beyond skew",
                json!({"nbf": t + 61}),
                Err(Reason::NotYetValid),
            ),
            ("nbf within skew", json!({"nbf": t + 59}), Ok(())),
            (
                "iat in the future",
                json!({"iat": t + 3600}),
                Err(Reason::NotYetValid),
            ),
            ("no exp", json!({"exp": null}), Err(Reason::Malformed)),
            ("exp string", json!({"exp": "soon"}), Err(Reason::Malformed)),
            ("exp negative", json!({"exp": -1}), Err(Reason::Malformed)),
            (
                "exp absurd",
                json!({"exp": u64::MAX}),
                Err(Reason::Malformed),
            ),
            (
                "exp huge float",
                json!({"exp": 1e300}),
                Err(Reason::Malformed),
            ),
            ("nbf string", json!({"nbf": "now"}), Err(Reason::Malformed)),
            ("no sub", json!({"sub": null}), Err(Reason::Malformed)),
            ("sub number", json!({"sub": 7}), Err(Reason::Malformed)),
            (
                "no client_id",
                json!({"client_id": null}),
                Err(Reason::Malformed),
            ),
            (
                "missing scope",
                json!({"scope": "other"}),
                Err(Reason::MissingScope),
            ),
            (
                "no scope at all",
                json!({"scope": null}),
                Err(Reason::MissingScope),
            ),
            (
                "scope prefix only",
                json!({"scope": "mcp:tools:read"}),
                Err(Reason::MissingScope),
            ),
            (
                "scope array",
                json!({"scope": ["mcp:tools"]}),
                Err(Reason::Malformed),
            ),
            (
                "scp array",
                json!({"scope": null, "scp": ["mcp:tools"]}),
                Ok(()),
            ),
            (
                "scp string",
                json!({"scope": null, "scp": "x mcp:tools"}),
                Ok(()),
            ),
            (
                "subject not allowed",
                json!({"sub": "mallory"}),
                Err(Reason::PrincipalNotAllowed),
            ),
            (
                "allowed client",
                json!({"sub": "mallory", "client_id": "client-b"}),
                Ok(()),
            ),
            (
                "client not allowed",
                json!({"sub": "mallory", "client_id": "client-c"}),
                Err(Reason::PrincipalNotAllowed),
            ),
        ];
        assert!(!cases.is_empty());
        for (name, changes, expected) in cases {
            let token = key.sign(&key.header(), &with(changes));
            let got = verdict(&v, &token).await.map(|_| ());
            assert_eq!(got, expected, "{name}");
        }
    }

    #[tokio::test]
    async fn shape_refusals() {
        let dir = tempfile::tempdir().unwrap();
        let key = TestKey::new(Algorithm::ES256, "ec");
        let v = file_verifier(dir.path(), &[&key]).await;
        let good = key.token();
        let parts: Vec<&str> = good.split('.').collect();
        let header_of =
            |h: &str| format!("{}.{}.{}", testutil_b64(h.as_bytes()), parts[1], parts[2]);
        let cases = [
            ("empty", String::new()),
            ("two segments", format!("{}.{}", parts[0], parts[1])),
            ("four segments", format!("{good}.{}", parts[2])),
            ("padded", format!("{}=.{}.{}", parts[0], parts[1], parts[2])),
            (
                "standard alphabet",
                format!("{}.{}+/.{}", parts[0], parts[1], parts[2]),
            ),
            ("not base64", format!("{}.*.{}", parts[0], parts[2])),
            ("empty header", format!(".{}.{}", parts[1], parts[2])),
            ("empty payload", format!("{}..{}", parts[0], parts[2])),
            (
                "header 4n+1",
                format!("{}a.{}.{}", parts[0], parts[1], parts[2]),
            ),
            ("header not JSON", header_of("not json")),
            ("header array", header_of("[1,2]")),
            (
                "header without alg",
                header_of(r#"{"typ":"at+jwt","kid":"ec"}"#),
            ),
            ("alg not a string", header_of(r#"{"alg":5,"typ":"at+jwt"}"#)),
            (
                "duplicate alg",
                header_of(r#"{"alg":"ES256","alg":"none","typ":"at+jwt","kid":"ec"}"#),
            ),
            (
                "crit",
                header_of(r#"{"alg":"ES256","typ":"at+jwt","kid":"ec","crit":["exp"]}"#),
            ),
            (
                "kid not a string",
                header_of(r#"{"alg":"ES256","typ":"at+jwt","kid":7}"#),
            ),
        ];
        for (name, token) in cases {
            assert_eq!(verdict(&v, &token).await, Err(Reason::Malformed), "{name}");
        }
        // A signed payload that is not a JSON object, or has a duplicate claim.
        let signed_payload = |payload: &str| {
            let message = format!("{}.{}", parts[0], testutil_b64(payload.as_bytes()));
            let sig =
                jsonwebtoken::crypto::sign(message.as_bytes(), &key.encoding, key.alg).unwrap();
            format!("{message}.{sig}")
        };
        let c = claims();
        let dup = format!(
            r#"{{"iss":"{ISSUER}","aud":"{AUDIENCE}","exp":{},"sub":"bob","sub":"alice","client_id":"client-a","scope":"mcp:tools"}}"#,
            c["exp"]
        );
        assert_eq!(
            verdict(&v, &signed_payload(&dup)).await,
            Err(Reason::Malformed)
        );
        assert_eq!(
            verdict(&v, &signed_payload("[1]")).await,
            Err(Reason::Malformed)
        );
        assert_eq!(
            verdict(&v, &signed_payload("nope")).await,
            Err(Reason::Malformed)
        );
    }

    fn testutil_b64(bytes: &[u8]) -> String {
        crate::oauth::b64::encode(bytes)
    }

    #[tokio::test]
    async fn tampered_tokens_fail_the_signature() {
        let dir = tempfile::tempdir().unwrap();
        let keys = [
            TestKey::new(Algorithm::RS256, "rsa"),
            TestKey::new(Algorithm::ES256, "ec"),
            TestKey::new(Algorithm::EdDSA, "ed"),
        ];
        let v = file_verifier(dir.path(), &keys.iter().collect::<Vec<_>>()).await;
        for key in &keys {
            let token = key.token();
            let sig_start = token.rfind('.').unwrap() + 1;
            // Flip a byte of the signature.
            let mut bytes = token.clone().into_bytes();
            bytes[sig_start + 5] = if bytes[sig_start + 5] == b'A' {
                b'B'
            } else {
                b'A'
            };
            let flipped = String::from_utf8(bytes).unwrap();
            assert_eq!(
                verdict(&v, &flipped).await,
                Err(Reason::BadSignature),
                "{:?}",
                key.alg
            );
            // Claims changed after signing.
            let parts: Vec<&str> = token.split('.').collect();
            let forged = format!(
                "{}.{}.{}",
                parts[0],
                testutil_b64(&serde_json::to_vec(&with(json!({"sub": "root"}))).unwrap()),
                parts[2]
            );
            assert_eq!(
                verdict(&v, &forged).await,
                Err(Reason::BadSignature),
                "{:?}",
                key.alg
            );
            // No signature at all.
            let stripped = &token[..sig_start];
            assert_eq!(
                verdict(&v, stripped).await,
                Err(Reason::BadSignature),
                "{:?}",
                key.alg
            );
        }
    }

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
            v.verify(&token, exp + Duration::from_secs(59))
                .await
                .is_ok()
        );
        assert_eq!(v.signature_checks(), 1);
        assert_eq!(
            v.verify(&token, exp + Duration::from_secs(61)).await,
            Err(Reason::Expired)
        );
        // Before nbf (beyond the skew) a cached token is not valid either.
        let nbf = now() + Duration::from_secs(30);
        let early = key.sign(&key.header(), &with(json!({"nbf": unix(nbf)})));
        assert!(verdict(&v, &early).await.is_ok());
        assert_eq!(
            v.verify(&early, nbf - Duration::from_secs(61)).await,
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

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn suspect_tokens_get_the_same_verdicts_one_check_at_a_time() {
        let dir = tempfile::tempdir().unwrap();
        let ours = TestKey::new(Algorithm::ES256, "ours");
        let evil = TestKey::new(Algorithm::ES256, "evil");
        let v = Arc::new(file_verifier(dir.path(), &[&ours]).await);
        let mut header = evil.header();
        header["kid"] = json!("ours");
        // Many fresh forgeries at once, and valid tokens among them: every forgery is
        // checked (none is a replay) and refused, every valid token admitted.
        let tasks: Vec<_> = (0..24)
            .map(|i| {
                let v = v.clone();
                let token = if i % 3 == 0 {
                    ours.sign(&ours.header(), &with(json!({"jti": format!("ok-{i}")})))
                } else {
                    evil.sign(&header, &with(json!({"jti": format!("bad-{i}")})))
                };
                tokio::spawn(async move { (i, v.verify_suspect(&token, now()).await) })
            })
            .collect();
        for task in tasks {
            let (i, verdict) = task.await.unwrap();
            if i % 3 == 0 {
                assert!(verdict.is_ok(), "{i}: {verdict:?}");
            } else {
                assert_eq!(verdict, Err(Reason::BadSignature), "{i}");
            }
        }
        assert_eq!(v.signature_checks(), 24);
        // A suspect token that verified is cached like any other.
        let token = ours.token();
        assert!(v.verify_suspect(&token, now()).await.is_ok());
        assert!(verdict(&v, &token).await.is_ok());
        assert_eq!(v.signature_checks(), 25);
        assert_eq!(
            v.0.suspect_lane.available_permits(),
            1,
            "the lane is given back"
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
        assert_eq!(cache.forged.len(), FORGED_CACHE_ENTRIES);
        assert!(!cache.forged(&digest(0)), "the oldest went first");
        assert!(cache.forged(&digest(FORGED_CACHE_ENTRIES)));
        cache.insert_forged(digest(FORGED_CACHE_ENTRIES));
        assert_eq!(
            cache.forged_order.len(),
            FORGED_CACHE_ENTRIES,
            "no duplicate"
        );
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
        // Full with nothing expired: the oldest go, down to EVICT_TO.
        let mut i = VERIFIED_CACHE_ENTRIES + 1;
        while cache.entries.len() < VERIFIED_CACHE_ENTRIES {
            cache.insert(digest(i), &checked(1000), later);
            i += 1;
        }
        cache.insert(digest(i), &checked(1000), later);
        assert_eq!(cache.entries.len(), EVICT_TO);
        assert_eq!(cache.order.len(), EVICT_TO);
        assert!(cache.get(&digest(1), later).is_none(), "oldest evicted");
        assert!(cache.get(&digest(i - 1), later).is_some());
        assert!(cache.get(&digest(i), later).is_some());
    }

    #[test]
    fn build_refusals() {
        let dir = tempfile::tempdir().unwrap();
        let base = || {
            config(
                ISSUER,
                KeySource::JwksUri(format!("{ISSUER}/jwks")),
                dir.path(),
            )
        };
        let refuse = |cfg: JwtConfig| {
            JwtVerifier::build(cfg, Metrics::new())
                .err()
                .expect("refused")
        };

        let mut cfg = base();
        cfg.allowed_subjects.clear();
        cfg.allowed_clients.clear();
        assert!(matches!(refuse(cfg), BuildError::NoAllowList));
        let mut cfg = base();
        cfg.allowed_subjects = vec!["*".into()];
        assert!(matches!(refuse(cfg), BuildError::BadAllowListEntry { .. }));
        let mut cfg = base();
        cfg.algorithms = vec![Algorithm::RS256, Algorithm::HS256];
        assert!(matches!(
            refuse(cfg),
            BuildError::UnsupportedAlgorithm(Algorithm::HS256)
        ));
        let mut cfg = base();
        cfg.algorithms = vec![Algorithm::PS256];
        assert!(matches!(refuse(cfg), BuildError::UnsupportedAlgorithm(_)));
        let mut cfg = base();
        cfg.algorithms.clear();
        assert!(matches!(refuse(cfg), BuildError::NoAlgorithms));
        let mut cfg = base();
        cfg.audiences.clear();
        assert!(matches!(refuse(cfg), BuildError::NoAudiences));
        for issuer in [
            "http://issuer.example",
            "issuer.example",
            "https://user@issuer.example",
            "https://issuer.example/?q=1",
            "https://issuer.example/#f",
        ] {
            let mut cfg = base();
            cfg.issuer = issuer.into();
            assert!(matches!(refuse(cfg), BuildError::Issuer(_)), "{issuer}");
        }
        let mut cfg = base();
        cfg.keys = KeySource::JwksUri("http://issuer.example/jwks".into());
        assert!(matches!(refuse(cfg), BuildError::JwksUri(_)));
        let mut cfg = base();
        cfg.ca_file = Some(write(dir.path(), "empty.pem", ""));
        assert!(matches!(
            refuse(cfg),
            BuildError::Client(ClientError::CaEmpty { .. })
        ));
        let mut cfg = base();
        cfg.ca_file = Some(dir.path().join("missing.pem"));
        let e = refuse(cfg);
        assert!(matches!(e, BuildError::Client(ClientError::CaFile { .. })));
        assert!(crate::error_chain(&e).contains("missing.pem"));
        // And the good one builds outside any runtime.
        assert!(JwtVerifier::build(base(), Metrics::new()).is_ok());
    }

    /// A discovery-configured verifier against `server`, with a manual cooldown clock.
    fn discovery_verifier(
        server: &TestServer,
        dir: &std::path::Path,
        metrics: &Metrics,
        clock: &ManualClock,
    ) -> JwtVerifier {
        let mut cfg = config(&server.url(""), KeySource::Discovery, dir);
        cfg.ca_file = Some(server.ca_file.clone());
        JwtVerifier::build(cfg, metrics.clone())
            .unwrap()
            .with_clock(clock.clock())
    }

    fn serve_discovery(server: &TestServer, keys: &[&TestKey]) {
        server.route(
            "/.well-known/oauth-authorization-server",
            Route::json(
                json!({"issuer": server.url(""), "jwks_uri": server.url("/jwks")}).to_string(),
            ),
        );
        server.route("/jwks", Route::json(jwks(keys)));
    }

    /// Standard claims with the test server as issuer.
    fn claims_for(server: &TestServer) -> Value {
        with(json!({"iss": server.url("")}))
    }

    #[tokio::test]
    async fn discovery_load_writes_the_cache_and_serves_it_when_the_issuer_is_down() {
        let dir = tempfile::tempdir().unwrap();
        let server = TestServer::start(dir.path()).await;
        let key = TestKey::new(Algorithm::ES256, "ec");
        serve_discovery(&server, &[&key]);
        let metrics = Metrics::new();
        let clock = ManualClock::new();
        let v = discovery_verifier(&server, dir.path(), &metrics, &clock);
        assert_eq!(v.key_set().keys, 0);
        assert_eq!(v.key_set().location, None);
        v.load().await.unwrap();
        let token = key.sign(&key.header(), &claims_for(&server));
        assert!(verdict(&v, &token).await.is_ok());
        let state = v.key_set();
        assert_eq!(state.source, KeySourceKind::Discovery);
        assert_eq!(state.keys, 1);
        assert_eq!(
            state.location.as_deref(),
            Some(server.url("/jwks").as_str())
        );
        assert!(!state.from_cache && state.last_error.is_none() && !state.refreshing);
        assert!(state.fetched_at.is_some() && state.last_attempt_at.is_some());
        assert_eq!(fetches(&metrics, "ok"), 2, "metadata and key set");

        // The cache: 0600, no temporary files left, names the issuer.
        let cache = dir.path().join("jwks-cache.json");
        let mode = std::fs::metadata(&cache).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let leftovers: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .filter_map(|e| e.ok())
            .filter(|e| e.file_name().to_string_lossy().contains(".tmp"))
            .collect();
        assert!(leftovers.is_empty());
        let doc: CacheDoc = serde_json::from_slice(&std::fs::read(&cache).unwrap()).unwrap();
        assert_eq!(doc.issuer, server.url(""));
        assert_eq!(doc.keys.len(), 1);

        // The issuer goes down; a new verifier starts from the cache.
        server.route(
            "/.well-known/oauth-authorization-server",
            Route::status(503),
        );
        server.route("/.well-known/openid-configuration", Route::status(503));
        let metrics = Metrics::new();
        let restarted = discovery_verifier(&server, dir.path(), &metrics, &clock);
        restarted.load().await.unwrap();
        assert!(verdict(&restarted, &token).await.is_ok());
        let state = restarted.key_set();
        assert!(state.from_cache && state.keys == 1, "{state:?}");
        assert_eq!(
            state.location.as_deref(),
            Some(server.url("/jwks").as_str())
        );
        assert!(
            state
                .last_error
                .as_deref()
                .is_some_and(|e| e.contains("openid-configuration")),
            "{state:?}"
        );
        assert_eq!(
            fetches(&metrics, "error"),
            2,
            "both discovery documents failed"
        );

        // A cache for another issuer is ignored.
        let mut doc = doc;
        doc.issuer = "https://other.example".into();
        jwks::write_cache(&cache, &doc).unwrap();
        let other = discovery_verifier(&server, dir.path(), &Metrics::new(), &clock);
        let e = other.load().await.unwrap_err();
        assert!(matches!(e, LoadError::Unavailable { .. }));
    }

    #[tokio::test]
    async fn no_keys_and_no_cache_fails_the_start_with_a_clear_message() {
        let dir = tempfile::tempdir().unwrap();
        let server = TestServer::start(dir.path()).await;
        let v = discovery_verifier(&server, dir.path(), &Metrics::new(), &ManualClock::new());
        let e = v.load().await.unwrap_err();
        let message = crate::error_chain(&e);
        assert!(message.contains(&server.url("")), "{message}");
        assert!(message.contains("oauth-authorization-server"), "{message}");
        assert!(message.contains("404"), "{message}");
        assert!(message.contains("no cache file"), "{message}");

        // A local key file that cannot be read is a start error too.
        let mut cfg = config(
            ISSUER,
            KeySource::JwksFile(dir.path().join("none.json")),
            dir.path(),
        );
        cfg.start_without_keys = false;
        let e = build(cfg).load().await.unwrap_err();
        assert!(matches!(e, LoadError::File { .. }));
        assert!(crate::error_chain(&e).contains("none.json"));
    }

    #[tokio::test]
    async fn start_without_keys_answers_keys_unavailable_then_recovers() {
        let dir = tempfile::tempdir().unwrap();
        let server = TestServer::start(dir.path()).await;
        let key = TestKey::new(Algorithm::ES256, "ec");
        let clock = ManualClock::new();
        let metrics = Metrics::new();
        let mut cfg = config(
            &server.url(""),
            KeySource::JwksUri(server.url("/jwks")),
            dir.path(),
        );
        cfg.ca_file = Some(server.ca_file.clone());
        cfg.start_without_keys = true;
        let v = JwtVerifier::build(cfg, metrics.clone())
            .unwrap()
            .with_clock(clock.clock());
        v.load().await.unwrap();
        assert_eq!(v.key_set().keys, 0);
        let token = key.sign(&key.header(), &claims_for(&server));
        // Within the cooldown of the start-up attempt: no fetch.
        assert_eq!(verdict(&v, &token).await, Err(Reason::KeysUnavailable));
        assert_eq!(server.hits("/jwks"), 1);
        // Malformed tokens are still told apart.
        assert_eq!(verdict(&v, "x.y").await, Err(Reason::Malformed));
        server.route("/jwks", Route::json(jwks(&[&key])));
        clock.advance(Duration::from_secs(10));
        assert_eq!(verdict(&v, &token).await, Err(Reason::KeysUnavailable));
        assert_eq!(server.hits("/jwks"), 1);
        clock.advance(REFETCH_COOLDOWN);
        assert!(verdict(&v, &token).await.is_ok());
        assert_eq!(server.hits("/jwks"), 2);
        assert_eq!(fetches(&metrics, "error"), 1);
        assert_eq!(fetches(&metrics, "ok"), 1);
    }

    #[tokio::test]
    async fn unknown_kid_refetches_at_most_once_per_cooldown() {
        let dir = tempfile::tempdir().unwrap();
        let server = TestServer::start(dir.path()).await;
        let a = TestKey::new(Algorithm::ES256, "a");
        let b = TestKey::new(Algorithm::ES256, "b");
        let stranger = TestKey::new(Algorithm::ES256, "x");
        serve_discovery(&server, &[&a]);
        let clock = ManualClock::new();
        let metrics = Metrics::new();
        let v = Arc::new(discovery_verifier(&server, dir.path(), &metrics, &clock));
        v.load().await.unwrap();
        assert_eq!(server.hits("/jwks"), 1);
        let claims = claims_for(&server);

        // Right after a successful start-up load, the first unknown kid refetches once
        // (from the discovered jwks_uri, no new discovery): the load does not start the
        // cooldown, so a key rotated around a restart is picked up at once ...
        assert_eq!(
            verdict(&v, &stranger.sign(&stranger.header(), &claims)).await,
            Err(Reason::UnknownKey)
        );
        assert_eq!(server.hits("/jwks"), 2);
        assert_eq!(server.hits("/.well-known/oauth-authorization-server"), 1);
        // ... and a second unknown kid within 30 s does not refetch.
        let mut header = stranger.header();
        header["kid"] = json!("y");
        clock.advance(Duration::from_secs(29));
        assert_eq!(
            verdict(&v, &stranger.sign(&header, &claims)).await,
            Err(Reason::UnknownKey)
        );
        assert_eq!(server.hits("/jwks"), 2);

        // A burst of random kids after the cooldown: one fetch in total.
        clock.advance(Duration::from_secs(2));
        let mut burst = tokio::task::JoinSet::new();
        for i in 0..50 {
            let v = v.clone();
            let mut header = stranger.header();
            header["kid"] = json!(format!("random-{i}"));
            let token = stranger.sign(&header, &claims);
            burst.spawn(async move { v.verify(&token, now()).await });
        }
        while let Some(result) = burst.join_next().await {
            assert_eq!(result.unwrap(), Err(Reason::UnknownKey));
        }
        assert_eq!(server.hits("/jwks"), 3);

        // Key rotation: the issuer adds b; the next unknown-kid refetch picks it up.
        server.route("/jwks", Route::json(jwks(&[&a, &b])));
        let token_b = b.sign(&b.header(), &claims);
        assert_eq!(
            verdict(&v, &token_b).await,
            Err(Reason::UnknownKey),
            "still in cooldown"
        );
        clock.advance(REFETCH_COOLDOWN);
        assert!(verdict(&v, &token_b).await.is_ok());
        assert_eq!(server.hits("/jwks"), 4);
        assert_eq!(v.key_set().keys, 2);

        // A refetched set that is refused (too many keys) keeps the old set.
        let many: Vec<TestKey> = (0..33)
            .map(|i| TestKey::new(Algorithm::ES256, &format!("k{i}")))
            .collect();
        server.route("/jwks", Route::json(jwks(&many.iter().collect::<Vec<_>>())));
        clock.advance(REFETCH_COOLDOWN);
        assert_eq!(
            verdict(&v, &stranger.token()).await,
            Err(Reason::UnknownKey)
        );
        assert_eq!(server.hits("/jwks"), 5);
        assert_eq!(fetches(&metrics, "rejected"), 1);
        assert!(verdict(&v, &a.sign(&a.header(), &claims)).await.is_ok());
        assert_eq!(v.key_set().keys, 2);
    }

    #[tokio::test]
    async fn es256_verify_cost_uncached_vs_cached() {
        let dir = tempfile::tempdir().unwrap();
        let key = TestKey::new(Algorithm::ES256, "ec");
        let v = file_verifier(dir.path(), &[&key]).await;
        const N: u32 = 200;
        let tokens: Vec<String> = (0..N)
            .map(|i| key.sign(&key.header(), &with(json!({"jti": format!("t-{i}")}))))
            .collect();
        let started = Instant::now();
        for token in &tokens {
            assert!(verdict(&v, token).await.is_ok());
        }
        let uncached = started.elapsed() / N;
        let started = Instant::now();
        for token in &tokens {
            assert!(verdict(&v, token).await.is_ok());
        }
        let cached = started.elapsed() / N;
        assert_eq!(v.signature_checks(), u64::from(N));
        let profile = if cfg!(debug_assertions) {
            "debug"
        } else {
            "release"
        };
        eprintln!("ES256 verify ({profile}): uncached {uncached:?}/token, cached {cached:?}/token");
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

    #[test]
    fn testutil_fixtures_are_consistent() {
        // The fixtures' claims pass the standard policy directly.
        let policy = Policy {
            issuer: ISSUER.into(),
            audiences: vec![AUDIENCE.into()],
            required_scopes: vec![testutil::SCOPE.into()],
            allowed_subjects: ["alice".to_owned()].into(),
            allowed_clients: HashSet::new(),
        };
        let Value::Object(c) = claims() else { panic!() };
        assert!(check_claims(&c, &policy, now()).is_ok());
    }

    /// Run a Wycheproof corpus through our key import, token split, header parse and key
    /// choice, then jsonwebtoken's signature check. Their tokens carry no `typ` or claims,
    /// so the access-token layer is left out. A vector is expected to pass when Wycheproof
    /// calls it valid, its keys are RS256 or ES256 (never `oct`: we do not verify HMAC),
    /// and its payload is not empty (no claims: we refuse it before any crypto).
    /// Returns (vectors run, vectors accepted).
    fn run_wycheproof(corpus: &str) -> (usize, usize) {
        ensure_crypto_provider().unwrap();
        let corpus: Value = serde_json::from_str(corpus).unwrap();
        let signature_stage = |token: &str, keys: Option<&ParsedKeys>| -> bool {
            let Ok((header, payload, signature)) = split(token) else {
                return false;
            };
            let Ok(header_fields) = jose_header(header, &SUPPORTED_ALGORITHMS) else {
                return false;
            };
            let Some(keys) = keys else { return false };
            let set = KeySet {
                keys: keys.keys.clone(),
                raw: Vec::new(),
                origin: Origin::Cache(String::new()),
                at: now(),
            };
            let Ok(index) = set.select(header_fields.kid.as_deref(), header_fields.alg) else {
                return false;
            };
            let message = &token[..header.len() + 1 + payload.len()];
            jsonwebtoken::crypto::verify(
                signature,
                message.as_bytes(),
                &set.keys[index].key,
                header_fields.alg,
            )
            .unwrap_or(false)
        };
        let (mut checked, mut accepted) = (0, 0);
        let mut mismatches = Vec::new();
        for group in corpus["groups"].as_array().unwrap() {
            let keys = jwks::parse_key_set(
                json!({"keys": group["keys"]}).to_string().as_bytes(),
                &SUPPORTED_ALGORITHMS,
                "wycheproof",
            )
            .ok();
            let asymmetric = group["keys"]
                .as_array()
                .unwrap()
                .iter()
                .all(|k| matches!(k["alg"].as_str(), Some("RS256" | "ES256")));
            for test in group["tests"].as_array().unwrap() {
                let token = test["jws"].as_str().unwrap();
                let empty_payload = token.split('.').nth(1) == Some("");
                let expected = test["result"] == "valid" && asymmetric && !empty_payload;
                let got = signature_stage(token, keys.as_ref());
                if got != expected {
                    mismatches.push(format!(
                        "tcId {} ({}, {}): got {got}",
                        test["tcId"], group["comment"], test["comment"]
                    ));
                }
                checked += 1;
                accepted += usize::from(got);
            }
        }
        assert!(mismatches.is_empty(), "{mismatches:#?}");
        (checked, accepted)
    }

    #[test]
    fn wycheproof_jws_vectors() {
        let (checked, accepted) = run_wycheproof(include_str!("testdata/wycheproof_jws.json"));
        assert_eq!(checked, 316, "every vector of the corpus ran");
        assert_eq!(accepted, 9, "the valid RS256 and ES256 vectors");
    }

    /// Key-set vectors: mixed and duplicate sets, wrong `use`, ROCA, 1024-bit RSA,
    /// exponent 1, HMAC keys of any length, mismatched algorithm and curve, bad points.
    #[test]
    fn wycheproof_jwk_vectors() {
        let (checked, accepted) = run_wycheproof(include_str!("testdata/wycheproof_jwk.json"));
        assert_eq!(checked, 26, "every vector of the corpus ran");
        assert_eq!(accepted, 1, "only the valid RS256 vector");
    }

    // -----------------------------------------------------------------------------------
    // Key refresh: the schedule, the operator, a stalled issuer.

    /// A verifier fetching `server`'s `/jwks` directly, with a manual cooldown clock.
    fn uri_verifier(
        server: &TestServer,
        dir: &std::path::Path,
        metrics: &Metrics,
        clock: &ManualClock,
    ) -> Arc<JwtVerifier> {
        let mut cfg = config(
            &server.url(""),
            KeySource::JwksUri(server.url("/jwks")),
            dir,
        );
        cfg.ca_file = Some(server.ca_file.clone());
        Arc::new(
            JwtVerifier::build(cfg, metrics.clone())
                .unwrap()
                .with_clock(clock.clock()),
        )
    }

    fn failures(metrics: &Metrics, trigger: RefreshTrigger) -> u64 {
        let prefix = format!(
            "robota_mcpd_jwks_refresh_failures_total{{trigger=\"{}\"}} ",
            trigger.as_str()
        );
        metrics
            .render()
            .lines()
            .find_map(|l| l.strip_prefix(&prefix).map(|n| n.parse().unwrap()))
            .unwrap_or(0)
    }

    /// Seconds from the end of the last fetch to the next scheduled refresh.
    fn scheduled_in(v: &JwtVerifier) -> u64 {
        let state = v.key_set();
        state.next_refresh_at.unwrap() - state.last_attempt_at.unwrap()
    }

    #[tokio::test]
    async fn the_schedule_follows_max_age_within_its_bounds() {
        let dir = tempfile::tempdir().unwrap();
        let server = TestServer::start(dir.path()).await;
        let key = TestKey::new(Algorithm::ES256, "a");
        let v = uri_verifier(&server, dir.path(), &Metrics::new(), &ManualClock::new());
        let body = jwks(&[&key]);
        let cases: [(&[(&str, &str)], u64); 8] = [
            (&[], 600),
            (&[("Cache-Control", "max-age=120")], 120),
            (&[("Cache-Control", "public, max-age=\"300\"")], 300),
            (&[("Cache-Control", "max-age=5")], 60),
            (&[("Cache-Control", "max-age=31536000")], 86_400),
            (&[("Cache-Control", "max-age=600"), ("Age", "590")], 60),
            (&[("Cache-Control", "no-store")], 60),
            (&[("Cache-Control", "max-age=120, max-age=900")], 60),
        ];
        for (i, (headers, want)) in cases.into_iter().enumerate() {
            let mut route = Route::json(body.clone());
            for (name, value) in headers {
                route = route.with_header(name, value);
            }
            server.route("/jwks", route);
            if i == 0 {
                v.load().await.unwrap();
            } else {
                v.refresh(RefreshTrigger::Operator).await.unwrap();
            }
            let got = scheduled_in(&v);
            assert!(
                (want..=want + 1).contains(&got),
                "{headers:?}: next refresh in {got} s, want {want}"
            );
        }
    }

    #[tokio::test]
    async fn a_removed_key_stops_verifying_at_the_scheduled_refresh() {
        let dir = tempfile::tempdir().unwrap();
        let server = TestServer::start(dir.path()).await;
        let (a, b) = (
            TestKey::new(Algorithm::ES256, "a"),
            TestKey::new(Algorithm::ES256, "b"),
        );
        let max_age =
            |keys: &[&TestKey]| Route::json(jwks(keys)).with_header("Cache-Control", "max-age=120");
        server.route("/jwks", max_age(&[&a, &b]));
        let metrics = Metrics::new();
        let v = uri_verifier(&server, dir.path(), &metrics, &ManualClock::new());
        v.load().await.unwrap();
        let claims = claims_for(&server);
        let token_b = b.sign(&b.header(), &claims);
        assert!(verdict(&v, &token_b).await.is_ok());
        assert!(verdict(&v, &token_b).await.is_ok(), "now from the cache");

        // The issuer removes b. Until the schedule says so, nothing is fetched.
        server.route("/jwks", max_age(&[&a]));
        assert!(verdict(&v, &token_b).await.is_ok());
        assert_eq!(server.hits("/jwks"), 1);
        v.0.scheduled().await.unwrap();
        assert_eq!(server.hits("/jwks"), 2);
        // b is gone, from the set and from the verified-token cache (the unknown kid
        // refetches once more, and still does not find it).
        assert_eq!(verdict(&v, &token_b).await, Err(Reason::UnknownKey));
        assert!(verdict(&v, &a.sign(&a.header(), &claims)).await.is_ok());
        assert_eq!(v.key_set().keys, 1);
        assert_eq!(scheduled_in(&v), 120);
        assert_eq!(fetches(&metrics, "ok"), 3);
    }

    /// The schedule itself, in paused time, over a key file: a changed file is re-read
    /// within `min`, an unchanged one is left alone, a broken one keeps the keys held.
    #[tokio::test(start_paused = true)]
    async fn the_schedule_rereads_a_changed_key_file_and_survives_a_broken_one() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (
            TestKey::new(Algorithm::EdDSA, "a"),
            TestKey::new(Algorithm::EdDSA, "b"),
        );
        let path = write(dir.path(), "jwks.json", &jwks(&[&a, &b]));
        let metrics = Metrics::new();
        let v = build_with(
            config(ISSUER, KeySource::JwksFile(path.clone()), dir.path()),
            &metrics,
        );
        v.load().await.unwrap();
        let schedule = v.spawn_schedule();
        let min = KeyRefresh::DEFAULT.min;
        assert!(verdict(&v, &b.token()).await.is_ok());

        // Unchanged for ten minutes: checked every minute, never re-loaded.
        tokio::time::sleep(Duration::from_secs(600)).await;
        assert_eq!(fetches(&metrics, "ok"), 1);

        std::fs::write(&path, jwks(&[&a])).unwrap();
        tokio::time::sleep(min + Duration::from_secs(1)).await;
        assert_eq!(fetches(&metrics, "ok"), 2, "the changed file was read");
        assert_eq!(v.key_set().keys, 1);
        assert_eq!(verdict(&v, &b.token()).await, Err(Reason::UnknownKey));

        // A broken file: the keys held stay, the failure shows.
        std::fs::write(&path, "{not json").unwrap();
        tokio::time::sleep(min + Duration::from_secs(1)).await;
        let state = v.key_set();
        assert_eq!(state.keys, 1);
        assert!(
            state
                .last_error
                .as_deref()
                .is_some_and(|e| e.contains("not a JWK set")),
            "{state:?}"
        );
        assert_eq!(failures(&metrics, RefreshTrigger::Schedule), 1);
        assert!(verdict(&v, &a.token()).await.is_ok());
        // Mended: picked up at the next check.
        std::fs::write(&path, jwks(&[&a, &b])).unwrap();
        tokio::time::sleep(min + Duration::from_secs(1)).await;
        assert_eq!(v.key_set().last_error, None);
        assert!(verdict(&v, &b.token()).await.is_ok());
        // The task ends with the verifier.
        drop(v);
        tokio::time::timeout(Duration::from_secs(3600), schedule)
            .await
            .expect("the schedule ends when the verifier is dropped")
            .unwrap();
    }

    fn build_with(config: JwtConfig, metrics: &Metrics) -> JwtVerifier {
        JwtVerifier::build(config, metrics.clone()).expect("verifier builds")
    }

    #[tokio::test]
    async fn operator_refresh_fetches_at_once_and_a_failure_keeps_the_keys() {
        let dir = tempfile::tempdir().unwrap();
        let server = TestServer::start(dir.path()).await;
        let (a, b, stranger) = (
            TestKey::new(Algorithm::ES256, "a"),
            TestKey::new(Algorithm::ES256, "b"),
            TestKey::new(Algorithm::ES256, "x"),
        );
        server.route("/jwks", Route::json(jwks(&[&a, &b])));
        let metrics = Metrics::new();
        let v = uri_verifier(&server, dir.path(), &metrics, &ManualClock::new());
        v.load().await.unwrap();
        let claims = claims_for(&server);
        let (token_a, token_b) = (a.sign(&a.header(), &claims), b.sign(&b.header(), &claims));
        // An unknown kid starts the refetch cooldown.
        assert_eq!(
            verdict(&v, &stranger.sign(&stranger.header(), &claims)).await,
            Err(Reason::UnknownKey)
        );
        assert!(verdict(&v, &token_b).await.is_ok());
        assert_eq!(server.hits("/jwks"), 2);

        server.route("/jwks", Route::json(jwks(&[&a])));
        v.refresh(RefreshTrigger::Operator).await.unwrap();
        assert_eq!(server.hits("/jwks"), 3, "fetched despite the cooldown");
        assert_eq!(verdict(&v, &token_b).await, Err(Reason::UnknownKey));
        assert_eq!(server.hits("/jwks"), 3, "the cooldown holds for tokens");

        // The issuer fails: the refresh says why, the keys held keep verifying.
        server.route("/jwks", Route::status(503));
        let error = v.refresh(RefreshTrigger::Operator).await.unwrap_err();
        assert!(error.contains("503"), "{error}");
        let state = v.key_set();
        assert_eq!(state.keys, 1);
        assert!(
            state
                .last_error
                .as_deref()
                .is_some_and(|e| e.contains("503"))
        );
        assert!(verdict(&v, &token_a).await.is_ok());
        assert_eq!(failures(&metrics, RefreshTrigger::Operator), 1);
        assert!(metrics.render().lines().any(|l| {
            l.strip_prefix("robota_mcpd_jwks_last_success_timestamp_seconds ")
                .is_some_and(|n| n.parse::<u64>().unwrap() > 0)
        }));
        // A failure retries at the schedule's least period.
        assert_eq!(scheduled_in(&v), KeyRefresh::DEFAULT.min.as_secs());

        server.route("/jwks", Route::json(jwks(&[&a, &b])));
        v.refresh(RefreshTrigger::Reload).await.unwrap();
        assert_eq!(v.key_set().last_error, None);
        assert!(verdict(&v, &token_b).await.is_ok());
    }

    /// A stalled issuer: requests with an unknown kid wait at most `UNKNOWN_KEY_WAIT` for
    /// the one fetch in flight, then get `keys-unavailable`; known keys are served
    /// meanwhile.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn unknown_kids_wait_a_bounded_time_for_one_fetch() {
        let dir = tempfile::tempdir().unwrap();
        let server = TestServer::start(dir.path()).await;
        let a = TestKey::new(Algorithm::ES256, "a");
        server.route("/jwks", Route::json(jwks(&[&a])));
        let v = uri_verifier(&server, dir.path(), &Metrics::new(), &ManualClock::new());
        v.load().await.unwrap();
        let claims = claims_for(&server);
        server.route("/jwks", Route::hang());

        let started = Instant::now();
        let mut burst = tokio::task::JoinSet::new();
        for i in 0..50 {
            let v = v.clone();
            let mut header = a.header();
            header["kid"] = json!(format!("new-{i}"));
            let token = a.sign(&header, &claims);
            burst.spawn(async move {
                let t = Instant::now();
                (v.verify(&token, now()).await, t.elapsed())
            });
        }
        // Meanwhile a known key is served at once.
        let t = Instant::now();
        assert!(verdict(&v, &a.sign(&a.header(), &claims)).await.is_ok());
        assert!(t.elapsed() < UNKNOWN_KEY_WAIT / 2, "{:?}", t.elapsed());
        while let Some(joined) = burst.join_next().await {
            let (verdict, waited) = joined.unwrap();
            assert_eq!(verdict, Err(Reason::KeysUnavailable));
            assert!(waited < UNKNOWN_KEY_WAIT * 3 / 2, "waited {waited:?}");
        }
        assert!(started.elapsed() < UNKNOWN_KEY_WAIT * 2);
        assert_eq!(server.hits("/jwks"), 2, "one fetch for the whole burst");
        assert!(v.key_set().refreshing);
        // Still stalled: a later unknown kid joins the same fetch, which has run its
        // second already, and is answered at once.
        let mut header = a.header();
        header["kid"] = json!("later");
        let t = Instant::now();
        assert_eq!(
            verdict(&v, &a.sign(&header, &claims)).await,
            Err(Reason::KeysUnavailable)
        );
        assert!(t.elapsed() < UNKNOWN_KEY_WAIT / 2, "{:?}", t.elapsed());
        assert_eq!(server.hits("/jwks"), 2);
    }
}
