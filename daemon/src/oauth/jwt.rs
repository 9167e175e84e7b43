//! The shipped [`Verifier`]: JWT access tokens (RFC 9068) signed by the configured issuer,
//! checked with jsonwebtoken against the issuer's key set (see [`super::jwks`]).
//!
//! Order of checks, cheapest first: size; the verified-token cache ([`super::cache`]);
//! shape (three base64url segments) and header (`alg` in the configured list, `typ`
//! `at+jwt`: [`super::token`]); key choice (exact `kid`, else the single key of that
//! algorithm; the key's own algorithm must be the token's: [`super::keyset`]); signature
//! (jsonwebtoken, signature only); then the claims, against the caller's clock
//! ([`super::claims`]): `iss`, `aud`, `exp`/`nbf`/`iat` with 60 s skew, `sub`,
//! `client_id`, scopes, principal allow-list.
//!
//! The key set is refreshed on a schedule (the key server's `max-age` within
//! [`KeyRefresh`] bounds), on reload and on an operator's command, and when a token names
//! a key the set does not hold (at most once per [`REFETCH_COOLDOWN`]). A failed refresh
//! keeps the held set.
//!
//! Invariants: no token text in any log line or error; a token's `jku`, `x5u`, `jwk` and
//! `x5c` are never used; successes are cached until they expire, and a token whose
//! signature failed is remembered as forged (by digest,
//! [`FORGED_CACHE_ENTRIES`](super::cache::FORGED_CACHE_ENTRIES) at most) so that
//! replaying it costs a hash, not a signature check; a changed key set empties both; at
//! most one key-set fetch is in flight, whatever started it; a request waits at most
//! [`UNKNOWN_KEY_WAIT`] for a fetch.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use jsonwebtoken::errors::ErrorKind;
use jsonwebtoken::{Algorithm, Validation};
use parking_lot::{Mutex, RwLock};
use robota_proto::KeySetStatus;
use sha2::{Digest, Sha256};
use tokio::sync::{Notify, watch};

use super::cache::VerifiedCache;
use super::claims::{Policy, StrictObject, check_claims};
use super::introspect::{
    self, IntrospectionSettings, Introspector, SecretFileError, SettingsError,
};
use super::jwks::{self, CacheDoc, ClientError, FetchError, Fetcher, ParsedKeys};
use super::keyset::{
    Done, KeySet, Miss, Origin, Outcome, REFETCH_COOLDOWN, RefreshState, UNKNOWN_KEY_WAIT,
    outcome_of,
};
use super::token::{SUPPORTED_ALGORITHMS, parse_header, signature_only, split};
use super::{Asker, Clock, MAX_TOKEN_BYTES, Principal, RefreshFuture, Verifier, VerifyFuture};
use crate::config::{KeyRefresh, KeySource};
use crate::metrics::Metrics;
use crate::vocab::Reason;
use crate::vocab::{FetchOutcome, RefreshTrigger};

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

/// JWT access-token verifier for the remote carrier.
pub struct JwtVerifier(Arc<Inner>);

struct Inner {
    policy: Arc<Policy>,
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
    /// The lane of one for signature checks of suspect tokens ([`Asker::suspect`]).
    suspect_lane: tokio::sync::Semaphore,
    signature_checks: AtomicU64,
    introspector: Option<Arc<Introspector>>,
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
            Some(settings) => Some(Arc::new(Introspector::build(
                settings,
                &config.issuer,
                clock.clone(),
                metrics.clone(),
            )?)),
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
            policy: Arc::new(Policy {
                issuer: config.issuer,
                audiences: config.audiences,
                required_scopes: config.required_scopes,
                allowed_subjects: config.allowed_subjects.into_iter().collect(),
                allowed_clients: config.allowed_clients.into_iter().collect(),
            }),
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
            Arc::get_mut(introspector)
                .expect("the clock is set before the introspector is shared")
                .set_clock(clock.clone());
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

    /// A suspect `asker` (over its failure budget) has its signature check, if one is
    /// needed, wait for the suspect lane and run off the request workers; an opaque token
    /// goes to the introspector with the asker.
    async fn check(
        self: &Arc<Self>,
        token: &str,
        now: SystemTime,
        asker: Asker<'_>,
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
                        .check(&self.fetcher, &self.policy, token, &digest, now, asker)
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
        let decoded = if asker.suspect {
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
    fn verify<'a>(&'a self, token: &'a str, now: SystemTime, asker: Asker<'a>) -> VerifyFuture<'a> {
        Box::pin(self.0.check(token, now, asker))
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

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;
    use std::time::{Instant, UNIX_EPOCH};

    use serde_json::{Value, json};

    use robota_proto::KeySourceKind;

    use super::*;
    use crate::oauth::testutil::{
        ISSUER, ManualClock, Route, TestKey, TestServer, build, config, file_verifier, jwks, now,
        suspect, testutil_b64, unix, verdict, with, write,
    };

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
                tokio::spawn(async move { (i, v.verify(&token, now(), suspect()).await) })
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
        assert!(v.verify(&token, now(), suspect()).await.is_ok());
        assert!(verdict(&v, &token).await.is_ok());
        assert_eq!(v.signature_checks(), 25);
        assert_eq!(
            v.0.suspect_lane.available_permits(),
            1,
            "the lane is given back"
        );
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
            burst.spawn(async move { v.verify(&token, now(), Asker::anyone()).await });
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
                (v.verify(&token, now(), Asker::anyone()).await, t.elapsed())
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
