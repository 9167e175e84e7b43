//! Token introspection (RFC 7662) for access tokens that are not JWTs: the issuer's
//! endpoint is asked whether an opaque token is active, and its answer is held to the
//! same claim rules as a JWT's claims (docs/design.md §6.5).
//!
//! - The endpoint is `[remote.introspection] endpoint`, else the `introspection_endpoint`
//!   of the issuer's metadata (RFC 8414, then OpenID discovery; looked up at start and,
//!   while unknown, on demand at most every [`DISCOVERY_COOLDOWN`]).
//! - Every request is an https POST through the verifier's fetcher (rustls, no proxy, no
//!   redirect, 64 KiB, [`INTROSPECTION_TIMEOUT`] in all) with client authentication
//!   (`client_secret_basic` or `client_secret_post`); at most [`MAX_IN_FLIGHT`] run at
//!   once, and a request waits at most [`SLOT_WAIT`] for a place. A request sent runs to
//!   its end in a task of its own, holding its place, whether or not its asker still
//!   waits: its answer is cached, and a token it refuses counts against its client.
//! - No usable answer — unreachable, slow, a status but 200, a body that is not an
//!   introspection answer, no place free — is `introspection-unavailable`: the carrier
//!   answers 503 and never counts it toward throttling. After one no token could cause,
//!   the issuer rests [`ERROR_REST`].
//! - Answers are cached by the SHA-256 of the token: an active one until the token's
//!   `exp` or `[remote.introspection] cache`, whichever comes first; an inactive one for
//!   `cache`. Refusals of the claim rules are not cached.
//!
//! Invariants: the token and the client secret never appear in a log line, an error or a
//! URL; a JWT never comes here (the verifier decides by the token's shape); the secret
//! file is refused unless only its owner (root or the daemon's user) can read it.

use std::collections::HashMap;
use std::io::Read;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use base64::Engine;
use parking_lot::Mutex;
use reqwest::Url;
use serde_json::Value;
use tokio::sync::{oneshot, watch};

use super::cache::ByDigest;
use super::claims::{Policy, StrictObject, check_claims};
use super::jwks::{FetchError, Fetcher, https_url};
use super::places::Places;
use super::{Asker, Clock, MAX_TOKEN_BYTES, Principal};
use crate::bearer::Secret;
use crate::metrics::Metrics;
use crate::vocab::{ClientAuth, IntrospectionOutcome, Reason};

/// Longest one introspection request (or an on-demand endpoint discovery) may take.
pub const INTROSPECTION_TIMEOUT: Duration = Duration::from_secs(5);
/// Introspection requests in flight at once, whatever tokens arrive.
pub const MAX_IN_FLIGHT: usize = 16;
/// Of those, one client's (its address group) at most; a freed place goes to the waiting
/// client with the fewest in flight, so a few busy clients never take every place.
pub const PER_CLIENT: usize = 2;
/// Of those, the places only clients that have not failed in the current throttle window
/// may take; they also go first for every place that frees.
pub const KEPT_FOR_CLEAN: usize = 4;
/// Longest a token waits for a place among them (then `introspection-unavailable`).
pub const SLOT_WAIT: Duration = Duration::from_secs(1);
/// Least time between two on-demand discoveries of the endpoint after one failed.
pub const DISCOVERY_COOLDOWN: Duration = Duration::from_secs(30);
/// How long no token goes to the issuer after a request got no usable answer from it
/// (`introspection-unavailable` meanwhile): an issuer refusing the daemon's credentials,
/// overloaded or failing is asked at most a place-full of times per rest, not once per
/// unknown token a peer sends. Not after a 400 or a 200 that is no introspection answer:
/// one odd token might bring those, and its sender must not rest the issuer for everyone.
pub const ERROR_REST: Duration = Duration::from_secs(1);
/// The `Retry-After` of a 503 `introspection-unavailable`.
pub const RETRY_AFTER_SECS: u64 = 5;
/// Most answers the cache holds (when full: lapsed entries, then the oldest, go).
pub const CACHE_ENTRIES: usize = 10_000;
/// Largest client secret file read.
pub const MAX_SECRET_BYTES: u64 = 4096;

/// What `[remote.introspection]` says, for the verifier.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IntrospectionSettings {
    /// An https URL; `None`: discovered.
    pub endpoint: Option<String>,
    pub client_id: String,
    pub client_secret_file: PathBuf,
    pub auth: ClientAuth,
    /// Longest an answer is reused; zero: never.
    pub cache: Duration,
}

/// Why the client secret file was refused (a configuration error). Never the secret.
#[derive(Debug, thiserror::Error)]
pub enum SecretFileError {
    #[error("cannot read the client secret file {}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("the client secret file {} is not a regular file", path.display())]
    NotAFile { path: PathBuf },
    #[error(
        "the client secret file {} has mode {mode:04o}; only its owner may read it (chmod 600)",
        path.display()
    )]
    Mode { path: PathBuf, mode: u32 },
    #[error(
        "the client secret file {} belongs to uid {uid}; it must belong to root or to the daemon's user",
        path.display()
    )]
    Owner { path: PathBuf, uid: u32 },
    #[error("the client secret file {} is larger than {MAX_SECRET_BYTES} bytes", path.display())]
    TooLarge { path: PathBuf },
    #[error(
        "the client secret file {} must hold the secret on one line of printable text",
        path.display()
    )]
    NotASecret { path: PathBuf },
}

/// Why the introspection settings cannot be used (a configuration error).
#[derive(Debug, thiserror::Error)]
pub enum SettingsError {
    #[error("introspection endpoint {0:?} is not an https URL without user-info or fragment")]
    Endpoint(String),
}

/// Read a client secret: a regular file owned by root or `euid`, readable by nobody else
/// (no group or other permission bit), at most [`MAX_SECRET_BYTES`], one line of
/// printable text (a final newline is dropped).
pub(crate) fn read_secret_file(path: &Path, euid: u32) -> Result<Secret, SecretFileError> {
    let read_error = |source| SecretFileError::Read {
        path: path.to_owned(),
        source,
    };
    let mut file = std::fs::File::open(path).map_err(read_error)?;
    // The checks are made on the file that was opened, not on the name.
    let meta = file.metadata().map_err(read_error)?;
    if !meta.is_file() {
        return Err(SecretFileError::NotAFile {
            path: path.to_owned(),
        });
    }
    let mode = meta.mode() & 0o7777;
    if mode & 0o077 != 0 {
        return Err(SecretFileError::Mode {
            path: path.to_owned(),
            mode,
        });
    }
    if meta.uid() != 0 && meta.uid() != euid {
        return Err(SecretFileError::Owner {
            path: path.to_owned(),
            uid: meta.uid(),
        });
    }
    if meta.len() > MAX_SECRET_BYTES {
        return Err(SecretFileError::TooLarge {
            path: path.to_owned(),
        });
    }
    let mut bytes = Vec::new();
    file.by_ref()
        .take(MAX_SECRET_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(read_error)?;
    if bytes.len() as u64 > MAX_SECRET_BYTES {
        bytes.fill(0);
        return Err(SecretFileError::TooLarge {
            path: path.to_owned(),
        });
    }
    let text = match String::from_utf8(bytes) {
        Ok(text) => Secret::new(text),
        Err(e) => {
            e.into_bytes().fill(0);
            return Err(SecretFileError::NotASecret {
                path: path.to_owned(),
            });
        }
    };
    let line = text.expose();
    let line = line.strip_suffix('\n').unwrap_or(line);
    let line = line.strip_suffix('\r').unwrap_or(line);
    if line.is_empty() || line.chars().any(char::is_control) {
        return Err(SecretFileError::NotASecret {
            path: path.to_owned(),
        });
    }
    Ok(Secret::new(line.to_owned()))
}

/// Whether a token has the shape of a JWT — a compact JWS (three segments) or JWE (five),
/// each in the base64url alphabet. Such a token is verified as a JWT and never sent to
/// introspection.
pub(crate) fn jwt_shaped(token: &str) -> bool {
    let segments = token.split('.').count();
    (segments == 3 || segments == 5)
        && token
            .split('.')
            .all(|s| super::b64::is_alphabet(s.as_bytes()))
}

/// Where requests go.
struct Found {
    url: Option<Url>,
    /// When an on-demand discovery last failed.
    failed_at: Option<std::time::Instant>,
}

/// The introspection client of the remote verifier.
pub(crate) struct Introspector {
    issuer: String,
    configured: Option<Url>,
    found: Mutex<Found>,
    /// One discovery at a time.
    discovering: tokio::sync::Mutex<()>,
    client_id: String,
    secret_file: PathBuf,
    /// Read at start (like a TLS key, never by `check-config`).
    secret: parking_lot::RwLock<Option<Secret>>,
    auth: ClientAuth,
    ttl: Duration,
    places: Places,
    asking: Asking,
    /// Until when no token goes to the issuer ([`ERROR_REST`] after its last error).
    resting_until: Mutex<Option<std::time::Instant>>,
    metrics: Metrics,
    cache: Mutex<AnswerCache>,
    clock: Clock,
}

impl Introspector {
    /// Check the settings; no file, no network.
    pub fn build(
        settings: IntrospectionSettings,
        issuer: &str,
        clock: Clock,
        metrics: Metrics,
    ) -> Result<Self, SettingsError> {
        let configured = match &settings.endpoint {
            Some(text) => {
                Some(https_url(text).ok_or_else(|| SettingsError::Endpoint(text.clone()))?)
            }
            None => None,
        };
        Ok(Self {
            issuer: issuer.to_owned(),
            configured,
            found: Mutex::new(Found {
                url: None,
                failed_at: None,
            }),
            discovering: tokio::sync::Mutex::new(()),
            client_id: settings.client_id,
            secret_file: settings.client_secret_file,
            secret: parking_lot::RwLock::new(None),
            auth: settings.auth,
            ttl: settings.cache,
            places: Places::new(MAX_IN_FLIGHT, PER_CLIENT, KEPT_FOR_CLEAN),
            asking: Asking::default(),
            resting_until: Mutex::new(None),
            metrics,
            cache: Mutex::new(AnswerCache::default()),
            clock,
        })
    }

    /// Read the client secret file (at start).
    pub fn read_secret(&self) -> Result<(), SecretFileError> {
        let euid = nix::unistd::geteuid().as_raw();
        *self.secret.write() = Some(read_secret_file(&self.secret_file, euid)?);
        Ok(())
    }

    #[cfg(test)]
    pub(crate) fn set_clock(&mut self, clock: Clock) {
        self.clock = clock;
    }

    /// The endpoint: configured, found before, or discovered now (one discovery at a
    /// time, none within [`DISCOVERY_COOLDOWN`] of a failed one; a waiter gives up after
    /// [`SLOT_WAIT`]).
    pub async fn endpoint(&self, fetcher: &Fetcher) -> Option<Url> {
        if let Some(url) = &self.configured {
            return Some(url.clone());
        }
        if let Some(url) = self.found.lock().url.clone() {
            return Some(url);
        }
        let _turn = tokio::time::timeout(SLOT_WAIT, self.discovering.lock())
            .await
            .ok()?;
        {
            let found = self.found.lock();
            if let Some(url) = &found.url {
                return Some(url.clone());
            }
            let now = (self.clock)();
            if found
                .failed_at
                .is_some_and(|at| now.saturating_duration_since(at) < DISCOVERY_COOLDOWN)
            {
                return None;
            }
        }
        let discovered = tokio::time::timeout(
            INTROSPECTION_TIMEOUT,
            fetcher.discover_endpoint(&self.issuer, "introspection_endpoint"),
        )
        .await;
        let mut found = self.found.lock();
        match discovered {
            Ok(Ok(url)) => {
                tracing::info!(issuer = %self.issuer, endpoint = %url, "found the token introspection endpoint");
                found.url = Some(url.clone());
                found.failed_at = None;
                Some(url)
            }
            outcome => {
                let why = match outcome {
                    Ok(Err(e)) => crate::error_chain(&e),
                    _ => format!(
                        "discovery took longer than {}",
                        humantime::format_duration(INTROSPECTION_TIMEOUT)
                    ),
                };
                tracing::warn!(issuer = %self.issuer, error = %why, "cannot find the token introspection endpoint; opaque tokens are refused with introspection-unavailable");
                found.failed_at = Some((self.clock)());
                None
            }
        }
    }

    /// Decide on an opaque token (`digest` is its SHA-256): the cache, else the answer to
    /// a question about it already on its way to the issuer, else the issuer, once
    /// `asker` has a place and may still ask. One question per token at a time: tokens
    /// sent by many clients at once cost the issuer one request.
    pub(super) async fn check(
        self: &Arc<Self>,
        fetcher: &Fetcher,
        policy: &Arc<Policy>,
        token: &str,
        digest: &[u8; 32],
        now: SystemTime,
        asker: Asker<'_>,
    ) -> Result<Principal, Reason> {
        debug_assert!(token.len() <= MAX_TOKEN_BYTES);
        let question = match self.question(digest, now).await {
            Ok(question) => question,
            Err(answer) => return answer,
        };
        let Some(url) = self.endpoint(fetcher).await else {
            return Err(Reason::IntrospectionUnavailable);
        };
        let deadline = tokio::time::Instant::now() + SLOT_WAIT;
        let Some(place) = self
            .places
            .take(asker.client, asker.failing, deadline)
            .await
        else {
            self.metrics.introspection(IntrospectionOutcome::Busy);
            tracing::warn!(
                in_flight = MAX_IN_FLIGHT,
                per_client = PER_CLIENT,
                "no introspection request place came free within 1 s (every place busy, or the client's own); refusing with introspection-unavailable"
            );
            return Err(Reason::IntrospectionUnavailable);
        };
        // An answer cached just before this question began.
        if let Some(answer) = self.cache.lock().get(digest, now) {
            return answer;
        }
        if self.resting() {
            self.metrics.introspection(IntrospectionOutcome::Resting);
            return Err(Reason::IntrospectionUnavailable);
        }
        if !(asker.may_introspect)() {
            return Err(Reason::NotIntrospected);
        }
        let (form, authorization) = match self.request(token) {
            Ok(request) => request,
            Err(why) => {
                let unasked = Err(NoAnswer {
                    why,
                    issuer_at_fault: true,
                });
                let verdict = self.verdict(unasked, &url, policy, digest, now);
                question.answer(&verdict);
                return verdict;
            }
        };
        (asker.sending)();
        // The request runs to its end — the answer, or the time limit — in a task of its
        // own that holds the place, judges the answer, caches it and gives it to everyone
        // waiting on the question, whether or not this asker still waits: the issuer
        // works on it either way. So peers whose connections close (or are closed to make
        // room) while their tokens are with the issuer never have more than the places'
        // requests on it at once, a client that asks again finds the answer its last
        // connection did not live to see, and a token the answer refuses counts against
        // its client even when nobody waited for it.
        let failed = (asker.late_failure)();
        let (told, answered) = oneshot::channel();
        let (this, fetcher, policy, digest) = (
            Arc::clone(self),
            fetcher.clone(),
            Arc::clone(policy),
            *digest,
        );
        tokio::spawn(async move {
            let posted = fetcher
                .post_form(&url, form, authorization, INTROSPECTION_TIMEOUT)
                .await;
            drop(place);
            let verdict = this.verdict(read_answer(posted), &url, &policy, &digest, now);
            question.answer(&verdict);
            if let Err(Err(reason)) = told.send(verdict)
                && reason != Reason::IntrospectionUnavailable
            {
                failed(reason);
            }
        });
        let mut pending = Pending {
            armed: true,
            metrics: &self.metrics,
        };
        let verdict = answered
            .await
            .unwrap_or(Err(Reason::IntrospectionUnavailable));
        pending.armed = false;
        verdict
    }

    /// The question about the token `digest` names, for this request to ask — or, when
    /// the cache knows it or another request asks it already, the answer. A question
    /// whose asker went away before sending it is asked again by one of those who waited,
    /// a few times at most (once sent, it is answered whether or not its asker waits).
    async fn question(
        &self,
        digest: &[u8; 32],
        now: SystemTime,
    ) -> Result<Question, Result<Principal, Reason>> {
        for _ in 0..3 {
            if let Some(answer) = self.cache.lock().get(digest, now) {
                return Err(answer);
            }
            let mut answer = match self.asking.join(digest) {
                Turn::Ask(question) => return Ok(question),
                Turn::Wait(answer) => answer,
            };
            let waited = tokio::time::timeout(
                SLOT_WAIT + INTROSPECTION_TIMEOUT,
                answer.wait_for(Option::is_some),
            )
            .await;
            match waited {
                Ok(Ok(answer)) => return Err(answer.clone().expect("waited for an answer")),
                Ok(Err(_gone)) => {}
                Err(_late) => return Err(Err(Reason::IntrospectionUnavailable)),
            }
        }
        Err(Err(Reason::IntrospectionUnavailable))
    }

    /// What the issuer's answer (or the failure to get one) means for the token; an
    /// answer is cached.
    fn verdict(
        &self,
        asked: Result<serde_json::Map<String, Value>, NoAnswer>,
        url: &Url,
        policy: &Policy,
        digest: &[u8; 32],
        now: SystemTime,
    ) -> Result<Principal, Reason> {
        let answer = match asked {
            Ok(answer) => answer,
            Err(NoAnswer {
                why,
                issuer_at_fault,
            }) => {
                self.metrics.introspection(IntrospectionOutcome::Error);
                if issuer_at_fault {
                    *self.resting_until.lock() = Some((self.clock)() + ERROR_REST);
                }
                tracing::warn!(endpoint = %url, error = %why, "token introspection failed; refusing with introspection-unavailable");
                return Err(Reason::IntrospectionUnavailable);
            }
        };
        let active = matches!(answer.get("active"), Some(Value::Bool(true)));
        self.metrics.introspection(if active {
            IntrospectionOutcome::Active
        } else {
            IntrospectionOutcome::Inactive
        });
        if !active {
            // Expired, revoked or never issued: the issuer does not say which.
            let until = now.checked_add(self.ttl);
            self.remember(digest, Err(Reason::Expired), until, now);
            return Err(Reason::Expired);
        }
        let principal = judge(&answer, policy, now)?;
        let until = now
            .checked_add(self.ttl)
            .map(|t| t.min(principal.expires_at));
        self.remember(digest, Ok(principal.clone()), until, now);
        Ok(principal)
    }

    fn remember(
        &self,
        digest: &[u8; 32],
        answer: Result<Principal, Reason>,
        until: Option<SystemTime>,
        now: SystemTime,
    ) {
        if let Some(until) = until.filter(|until| *until > now) {
            self.cache.lock().insert(*digest, answer, until, now);
        }
    }

    /// Whether the issuer is resting after an error ([`ERROR_REST`]).
    fn resting(&self) -> bool {
        self.resting_until
            .lock()
            .is_some_and(|until| (self.clock)() < until)
    }

    /// The form and the `Authorization` header of one request.
    fn request(
        &self,
        token: &str,
    ) -> Result<(String, Option<reqwest::header::HeaderValue>), String> {
        let secret = self.secret.read();
        let Some(secret) = secret.as_ref() else {
            return Err("the client secret has not been read".to_owned());
        };
        let mut form = form_urlencoded::Serializer::new(String::new());
        form.append_pair("token", token)
            .append_pair("token_type_hint", "access_token");
        let authorization = match self.auth {
            ClientAuth::ClientSecretBasic => {
                // RFC 6749 §2.3.1: both parts form-encoded before Base64.
                let encode =
                    |s: &str| form_urlencoded::byte_serialize(s.as_bytes()).collect::<String>();
                let pair = Secret::new(format!(
                    "{}:{}",
                    encode(&self.client_id),
                    encode(secret.expose())
                ));
                let header = Secret::new(format!(
                    "Basic {}",
                    base64::engine::general_purpose::STANDARD.encode(pair.expose())
                ));
                Some(
                    reqwest::header::HeaderValue::from_str(header.expose())
                        .map_err(|_| "the client credentials do not fit a header".to_owned())?,
                )
            }
            ClientAuth::ClientSecretPost => {
                form.append_pair("client_id", &self.client_id)
                    .append_pair("client_secret", secret.expose());
                None
            }
        };
        Ok((form.finish(), authorization))
    }
}

/// The issuer's answer to a request, if it is one.
fn read_answer(
    posted: Result<Vec<u8>, FetchError>,
) -> Result<serde_json::Map<String, Value>, NoAnswer> {
    let body = posted.map_err(|e| NoAnswer {
        // RFC 7662 answers a token it does not know `active: false`; so an error status is
        // the issuer's state or the daemon's credentials, never the token's doing — except
        // a 400, which an issuer may give one odd token (and which must not let its sender
        // rest the issuer for everyone).
        issuer_at_fault: !matches!(e, FetchError::Status { status: 400, .. }),
        why: crate::error_chain(&e),
    })?;
    let token_specific = |why: &str| NoAnswer {
        why: why.to_owned(),
        issuer_at_fault: false,
    };
    let StrictObject(answer) = serde_json::from_slice(&body).map_err(|_| {
        token_specific("the answer is not a JSON object (without duplicate members)")
    })?;
    if !matches!(answer.get("active"), Some(Value::Bool(_))) {
        return Err(token_specific("the answer has no boolean `active`"));
    }
    Ok(answer)
}

/// Why a request to the issuer brought no usable answer.
struct NoAnswer {
    /// For the log: never the token or the secret.
    why: String,
    /// Not something one token could cause: the issuer rests ([`ERROR_REST`]).
    issuer_at_fault: bool,
}

/// A request sent to the issuer whose answer has not come back yet.
/// Questions to the issuer on their way, by token digest: one per token at a time.
#[derive(Default, Clone)]
struct Asking(Arc<Mutex<HashMap<[u8; 32], Awaited>>>);

type Answer = Result<Principal, Reason>;

/// The answer to one question, once it comes (`None` until then).
type Awaited = watch::Receiver<Option<Answer>>;

/// Whether a request asks the issuer about its token, or waits for the answer to the
/// question another request asks.
enum Turn {
    Ask(Question),
    Wait(watch::Receiver<Option<Answer>>),
}

/// A question about one token, asked by one request; those waiting on it see the closed
/// channel (and ask again) if it goes away without an answer.
struct Question {
    asking: Asking,
    digest: [u8; 32],
    answer: watch::Sender<Option<Answer>>,
}

impl Asking {
    fn join(&self, digest: &[u8; 32]) -> Turn {
        let mut asking = self.0.lock();
        if let Some(answer) = asking.get(digest) {
            return Turn::Wait(answer.clone());
        }
        let (answer, waiting) = watch::channel(None);
        asking.insert(*digest, waiting);
        Turn::Ask(Question {
            asking: self.clone(),
            digest: *digest,
            answer,
        })
    }
}

impl Question {
    /// What the issuer's answer meant (or its failure to give one): for everyone waiting.
    fn answer(&self, verdict: &Answer) {
        self.answer.send_replace(Some(verdict.clone()));
    }
}

impl Drop for Question {
    fn drop(&mut self) {
        // Out of the map before the channel closes, so a waiter that finds it closed and
        // asks again starts a new question.
        self.asking.0.lock().remove(&self.digest);
    }
}

/// A request sent whose asker waits for the answer: counted `abandoned` if it stops
/// waiting (the request runs on).
struct Pending<'a> {
    armed: bool,
    metrics: &'a Metrics,
}

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.metrics.introspection(IntrospectionOutcome::Abandoned);
        }
    }
}

/// An active answer, held to the JWT claim rules, plus what only an introspection answer
/// can say: a `token_type` other than a bearer token (a refresh token, a DPoP-bound
/// token) or a `cnf` confirmation (the token is bound to a key this daemon cannot check)
/// is `wrong-type`.
fn judge(
    answer: &serde_json::Map<String, Value>,
    policy: &Policy,
    now: SystemTime,
) -> Result<Principal, Reason> {
    match answer.get("token_type") {
        None => {}
        Some(Value::String(t))
            if t.eq_ignore_ascii_case("bearer") || t.eq_ignore_ascii_case("access_token") => {}
        Some(_) => return Err(Reason::WrongType),
    }
    if answer.contains_key("cnf") {
        return Err(Reason::WrongType);
    }
    check_claims(answer, policy, now).map(|checked| checked.principal)
}

/// Answers by token digest, each until a time that is never past the token's `exp`.
struct AnswerCache(ByDigest<(Result<Principal, Reason>, SystemTime)>);

impl Default for AnswerCache {
    fn default() -> Self {
        Self(ByDigest::new(CACHE_ENTRIES))
    }
}

impl AnswerCache {
    fn get(&self, digest: &[u8; 32], now: SystemTime) -> Option<Result<Principal, Reason>> {
        let (answer, until) = self.0.get(digest)?;
        (now < *until).then(|| answer.clone())
    }

    fn insert(
        &mut self,
        digest: [u8; 32],
        answer: Result<Principal, Reason>,
        until: SystemTime,
        now: SystemTime,
    ) {
        self.0
            .insert(digest, (answer, until), |(_, until)| *until <= now);
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.0.len()
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use serde_json::json;

    use super::*;
    use crate::config::KeySource;
    use crate::oauth::Verifier;
    use crate::oauth::jwt::JwtVerifier;
    use crate::oauth::testutil::{
        AUDIENCE, ISSUER, ManualClock, Route, TestKey, TestServer, claims, config, jwks, now, unix,
        write,
    };

    const OPAQUE: &str = "2YotnFZFEjr1zCsicMWpAA";

    fn secret_file(dir: &Path, text: &str, mode: u32) -> PathBuf {
        let path = dir.join(format!("secret-{mode:o}"));
        std::fs::write(&path, text).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
        path
    }

    /// An active answer the standard configuration accepts.
    fn active() -> Value {
        let mut c = claims();
        c["active"] = json!(true);
        c["token_type"] = json!("Bearer");
        c
    }

    struct Setup {
        _dir: tempfile::TempDir,
        server: TestServer,
        verifier: JwtVerifier,
        metrics: Metrics,
        clock: ManualClock,
    }

    impl Setup {
        /// A verifier with a key file and introspection at the test server's
        /// `/introspect` (or found by discovery when `endpoint` is false).
        async fn new(endpoint: bool, auth: ClientAuth, cache: Duration) -> Setup {
            let dir = tempfile::tempdir().unwrap();
            let server = TestServer::start(dir.path()).await;
            let key = TestKey::new(jsonwebtoken::Algorithm::ES256, "k");
            let keys = write(dir.path(), "jwks.json", &jwks(&[&key]));
            let issuer = if endpoint {
                ISSUER.to_owned()
            } else {
                server.url("")
            };
            let mut c = config(&issuer, KeySource::JwksFile(keys), dir.path());
            c.ca_file = Some(server.ca_file.clone());
            c.introspection = Some(IntrospectionSettings {
                endpoint: endpoint.then(|| server.url("/introspect")),
                client_id: "robota mcpd".into(),
                client_secret_file: secret_file(dir.path(), "s3cr:et+/%\n", 0o600),
                auth,
                cache,
            });
            let metrics = Metrics::new();
            let clock = ManualClock::new();
            let verifier = JwtVerifier::build(c, metrics.clone())
                .expect("builds")
                .with_clock(clock.clock());
            verifier.read_secrets().expect("the secret file reads");
            Setup {
                _dir: dir,
                server,
                verifier,
                metrics,
                clock,
            }
        }

        fn answer(&self, body: &Value) {
            self.server
                .route("/introspect", Route::json(body.to_string()));
        }

        async fn verdict(&self, token: &str) -> Result<Principal, Reason> {
            self.verify_at(token, now()).await
        }

        async fn verify_at(&self, token: &str, at: SystemTime) -> Result<Principal, Reason> {
            self.verifier.verify(token, at, Asker::anyone()).await
        }

        fn count(&self, outcome: IntrospectionOutcome) -> u64 {
            self.metrics
                .render()
                .lines()
                .find(|l| {
                    l.starts_with(&format!(
                        "robota_mcpd_introspection_requests_total{{outcome=\"{}\"}}",
                        outcome.as_str()
                    ))
                })
                .and_then(|l| l.rsplit(' ').next()?.parse().ok())
                .unwrap_or(0)
        }
    }

    #[test]
    fn the_secret_file_must_be_private_and_hold_one_line() {
        let dir = tempfile::tempdir().unwrap();
        let me = nix::unistd::geteuid().as_raw();
        let ok = secret_file(dir.path(), "abc\n", 0o600);
        assert_eq!(read_secret_file(&ok, me).unwrap().expose(), "abc");
        let ok = secret_file(dir.path(), "abc\r\n", 0o400);
        assert_eq!(read_secret_file(&ok, me).unwrap().expose(), "abc");
        for mode in [0o640, 0o604, 0o660, 0o644, 0o610] {
            let wide = secret_file(dir.path(), "abc", mode);
            let e = read_secret_file(&wide, me).unwrap_err();
            assert!(matches!(e, SecretFileError::Mode { .. }), "{mode:o}: {e}");
            assert!(!e.to_string().contains("abc"));
        }
        for bad in ["", "\n", "a\nb", "a\u{7}b"] {
            let path = secret_file(dir.path(), bad, 0o600);
            let e = read_secret_file(&path, me).unwrap_err();
            assert!(
                matches!(e, SecretFileError::NotASecret { .. }),
                "{bad:?}: {e}"
            );
        }
        let big = secret_file(dir.path(), &"x".repeat(5000), 0o600);
        assert!(matches!(
            read_secret_file(&big, me),
            Err(SecretFileError::TooLarge { .. })
        ));
        // Someone else's file: refused even at 0600 (root's is fine).
        let theirs = secret_file(dir.path(), "abc", 0o600);
        let reader = if me == 0 {
            nix::unistd::chown(&theirs, Some(nix::unistd::Uid::from_raw(65534)), None).unwrap();
            0
        } else {
            me.wrapping_add(1)
        };
        assert!(matches!(
            read_secret_file(&theirs, reader),
            Err(SecretFileError::Owner { uid, .. }) if uid != reader
        ));
        assert!(matches!(
            read_secret_file(dir.path(), me),
            Err(SecretFileError::NotAFile { .. } | SecretFileError::Read { .. })
        ));
        assert!(matches!(
            read_secret_file(&dir.path().join("missing"), me),
            Err(SecretFileError::Read { .. })
        ));
    }

    #[tokio::test]
    async fn a_wide_secret_file_is_refused_at_start() {
        let dir = tempfile::tempdir().unwrap();
        let mut c = config(ISSUER, KeySource::Discovery, dir.path());
        c.introspection = Some(IntrospectionSettings {
            endpoint: Some("https://issuer.example/introspect".into()),
            client_id: "c".into(),
            client_secret_file: secret_file(dir.path(), "abc", 0o644),
            auth: ClientAuth::ClientSecretBasic,
            cache: Duration::from_secs(60),
        });
        // Built (check-config reads no secret), then refused when the file is read.
        let v = JwtVerifier::build(c.clone(), Metrics::new()).unwrap();
        let text = crate::error_chain(&v.read_secrets().unwrap_err());
        assert!(text.contains("mode 0644"), "{text}");
        c.introspection.as_mut().unwrap().endpoint = Some("http://issuer.example/i".into());
        c.introspection.as_mut().unwrap().client_secret_file =
            secret_file(dir.path(), "abc", 0o600);
        assert!(
            JwtVerifier::build(c, Metrics::new()).is_err(),
            "http endpoint"
        );
    }

    #[test]
    fn what_looks_like_a_jwt() {
        for jwt in ["a.b.c", "eyJ.eyJ.", "a..c", "a.b.c.d.e", "A-_.b.c"] {
            assert!(jwt_shaped(jwt), "{jwt}");
        }
        for opaque in [
            OPAQUE,
            "a.b",
            "a.b.c.d",
            "a+b.c.d",
            "a/b.c.d",
            "x=",
            "a.b.c.d.e.f",
        ] {
            assert!(!jwt_shaped(opaque), "{opaque}");
        }
    }

    #[tokio::test]
    async fn an_active_answer_admits_with_basic_client_authentication() {
        let s = Setup::new(true, ClientAuth::ClientSecretBasic, Duration::from_secs(60)).await;
        s.answer(&active());
        let principal = s.verdict(OPAQUE).await.unwrap();
        assert_eq!(
            (principal.subject.as_str(), principal.client_id.as_str()),
            ("alice", "client-a")
        );
        assert!(
            principal
                .scopes
                .contains(&crate::oauth::testutil::SCOPE.to_owned())
        );
        let requests = s.server.requests("/introspect");
        assert_eq!(requests.len(), 1);
        let request = &requests[0];
        assert!(request.starts_with("POST /introspect "), "{request}");
        // RFC 6749 §2.3.1: form-encoded id and secret, then Base64.
        let basic =
            base64::engine::general_purpose::STANDARD.encode("robota+mcpd:s3cr%3Aet%2B%2F%25");
        assert!(
            request.to_ascii_lowercase().contains(&format!(
                "authorization: basic {}",
                basic.to_ascii_lowercase()
            )),
            "{request}"
        );
        assert!(
            request.contains("application/x-www-form-urlencoded"),
            "{request}"
        );
        assert!(
            request.ends_with(&format!("token={OPAQUE}&token_type_hint=access_token")),
            "{request}"
        );
        assert!(!request.contains("client_secret"));
        assert_eq!(s.count(IntrospectionOutcome::Active), 1);
    }

    #[tokio::test]
    async fn client_secret_post_sends_the_credentials_in_the_body() {
        let s = Setup::new(true, ClientAuth::ClientSecretPost, Duration::from_secs(60)).await;
        s.answer(&active());
        s.verdict(OPAQUE).await.unwrap();
        let request = &s.server.requests("/introspect")[0];
        assert!(
            !request.to_ascii_lowercase().contains("authorization:"),
            "{request}"
        );
        assert!(
            request.ends_with(&format!(
                "token={OPAQUE}&token_type_hint=access_token&client_id=robota+mcpd&client_secret=s3cr%3Aet%2B%2F%25"
            )),
            "{request}"
        );
    }

    #[tokio::test]
    async fn answers_are_cached_by_digest_never_past_exp_nor_the_cache_time() {
        let s = Setup::new(true, ClientAuth::ClientSecretBasic, Duration::from_secs(60)).await;
        let mut answer = active();
        answer["exp"] = json!(unix(now()) + 30);
        s.answer(&answer);
        s.verdict(OPAQUE).await.unwrap();
        s.verdict(OPAQUE).await.unwrap();
        assert_eq!(
            s.server.hits("/introspect"),
            1,
            "the second came from the cache"
        );
        // Another token is another entry.
        s.verdict("another-opaque-token").await.unwrap();
        assert_eq!(s.server.hits("/introspect"), 2);
        // Past `exp` (30 s, before the 60 s cache time): asked again — and now refused.
        s.answer(&json!({"active": false}));
        let later = now() + Duration::from_secs(31);
        assert_eq!(s.verify_at(OPAQUE, later).await, Err(Reason::Expired));
        assert_eq!(s.server.hits("/introspect"), 3);
        // The inactive answer is cached for the cache time.
        assert_eq!(s.verify_at(OPAQUE, later).await, Err(Reason::Expired));
        assert_eq!(s.server.hits("/introspect"), 3);
        assert_eq!(
            s.verify_at(OPAQUE, later + Duration::from_secs(61)).await,
            Err(Reason::Expired)
        );
        assert_eq!(s.server.hits("/introspect"), 4);
        assert_eq!(s.count(IntrospectionOutcome::Inactive), 2);

        // And never past the cache time, however far away `exp` is.
        let s = Setup::new(true, ClientAuth::ClientSecretBasic, Duration::from_secs(10)).await;
        s.answer(&active());
        s.verdict(OPAQUE).await.unwrap();
        s.verify_at(OPAQUE, now() + Duration::from_secs(9))
            .await
            .unwrap();
        assert_eq!(s.server.hits("/introspect"), 1);
        s.verify_at(OPAQUE, now() + Duration::from_secs(10))
            .await
            .unwrap();
        assert_eq!(s.server.hits("/introspect"), 2);
    }

    #[tokio::test]
    async fn a_zero_cache_time_asks_every_time() {
        let s = Setup::new(true, ClientAuth::ClientSecretBasic, Duration::ZERO).await;
        s.answer(&active());
        for _ in 0..3 {
            s.verdict(OPAQUE).await.unwrap();
        }
        assert_eq!(s.server.hits("/introspect"), 3);
    }

    #[tokio::test]
    async fn active_answers_meet_the_jwt_claim_rules() {
        let s = Setup::new(true, ClientAuth::ClientSecretBasic, Duration::ZERO).await;
        let change = |changes: Value| {
            let mut a = active();
            for (k, v) in changes.as_object().unwrap() {
                if v.is_null() {
                    a.as_object_mut().unwrap().remove(k);
                } else {
                    a[k] = v.clone();
                }
            }
            a
        };
        let cases = [
            (json!({"iss": "https://other.example"}), Reason::WrongIssuer),
            (json!({"iss": null}), Reason::WrongIssuer),
            (
                json!({"aud": "https://other.example/mcp"}),
                Reason::WrongAudience,
            ),
            (
                json!({"aud": [AUDIENCE, "https://other.example/mcp"]}),
                Reason::WrongAudience,
            ),
            (json!({"aud": null}), Reason::WrongAudience),
            (json!({"exp": unix(now()) - 120}), Reason::Expired),
            (json!({"exp": null}), Reason::Malformed),
            (json!({"nbf": unix(now()) + 120}), Reason::NotYetValid),
            (json!({"sub": null}), Reason::Malformed),
            (json!({"client_id": 7}), Reason::Malformed),
            (json!({"scope": "other"}), Reason::MissingScope),
            (
                json!({"sub": "mallory", "client_id": "client-x"}),
                Reason::PrincipalNotAllowed,
            ),
            // A refresh token or a DPoP-bound token presented as a bearer token.
            (json!({"token_type": "refresh_token"}), Reason::WrongType),
            (json!({"token_type": "DPoP"}), Reason::WrongType),
            (json!({"cnf": {"jkt": "abc"}}), Reason::WrongType),
        ];
        assert!(!cases.is_empty());
        for (changes, reason) in cases {
            s.answer(&change(changes.clone()));
            assert_eq!(s.verdict(OPAQUE).await, Err(reason), "{changes}");
        }
        for ok in [json!({"token_type": null}), json!({"token_type": "bearer"})] {
            s.answer(&change(ok.clone()));
            assert!(s.verdict(OPAQUE).await.is_ok(), "{ok}");
        }
    }

    #[tokio::test]
    async fn no_usable_answer_is_introspection_unavailable() {
        let s = Setup::new(true, ClientAuth::ClientSecretBasic, Duration::from_secs(60)).await;
        for route in [
            Route::status(500),
            Route::status(401),
            Route::status(302).with_header("Location", "https://127.0.0.1/elsewhere"),
            Route::json("not json"),
            Route::json(r#"{"active": "true"}"#),
            Route::json(r#"{"active": true, "active": false}"#),
            Route::json("[true]"),
            Route::json(format!(
                r#"{{"active": true, "pad": "{}"}}"#,
                "x".repeat(70_000)
            )),
        ] {
            s.server.route("/introspect", route.clone());
            assert_eq!(
                s.verdict(OPAQUE).await,
                Err(Reason::IntrospectionUnavailable),
                "{route:?}"
            );
            s.clock.advance(ERROR_REST);
        }
        assert_eq!(s.count(IntrospectionOutcome::Error), 8);
        // Nothing was cached: the issuer back, the token is admitted.
        s.answer(&active());
        assert!(s.verdict(OPAQUE).await.is_ok());
    }

    #[tokio::test]
    async fn after_an_error_the_issuer_rests_before_it_is_asked_again() {
        let s = Setup::new(true, ClientAuth::ClientSecretBasic, Duration::from_secs(60)).await;
        // The daemon's credentials refused: every token would be one more request.
        s.server.route("/introspect", Route::status(401));
        for i in 0..20 {
            let token = format!("unknown-{i}");
            assert_eq!(
                s.verdict(&token).await,
                Err(Reason::IntrospectionUnavailable)
            );
        }
        assert_eq!(s.server.hits("/introspect"), 1);
        assert_eq!(s.count(IntrospectionOutcome::Error), 1);
        assert_eq!(s.count(IntrospectionOutcome::Resting), 19);
        // Rested, it is asked again; an answer ends the rest.
        s.clock.advance(ERROR_REST);
        s.answer(&active());
        assert!(s.verdict(OPAQUE).await.is_ok());
        s.answer(&json!({"active": false}));
        assert_eq!(s.verdict("another").await, Err(Reason::Expired));
        assert_eq!(s.server.hits("/introspect"), 3);
        // A 400 may be about the one token: no rest.
        s.server.route("/introspect", Route::status(400));
        for token in ["odd-1", "odd-2"] {
            assert_eq!(
                s.verdict(token).await,
                Err(Reason::IntrospectionUnavailable)
            );
        }
        assert_eq!(s.server.hits("/introspect"), 5);
    }

    #[tokio::test(start_paused = true)]
    async fn a_stalled_issuer_costs_a_request_the_time_limit_only() {
        let s = Setup::new(true, ClientAuth::ClientSecretBasic, Duration::from_secs(60)).await;
        s.server.route("/introspect", Route::hang());
        let started = tokio::time::Instant::now();
        assert_eq!(
            s.verdict(OPAQUE).await,
            Err(Reason::IntrospectionUnavailable)
        );
        let took = started.elapsed();
        assert!(
            took >= INTROSPECTION_TIMEOUT && took < INTROSPECTION_TIMEOUT * 2,
            "{took:?}"
        );
    }

    fn from(n: u8) -> Asker<'static> {
        Asker {
            client: std::net::IpAddr::from([198, 51, 100, n]),
            ..Asker::anyone()
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_request_whose_asker_went_away_holds_its_place_until_it_ends() {
        let s = Setup::new(true, ClientAuth::ClientSecretBasic, Duration::from_secs(60)).await;
        s.server.route("/introspect", Route::hang());
        for token in ["gone-1", "gone-2"] {
            let gone = tokio::time::timeout(
                Duration::from_millis(500),
                s.verifier.verify(token, now(), from(1)),
            )
            .await;
            assert!(gone.is_err());
        }
        // The issuer still works on both: the client's two places are taken.
        assert_eq!(
            s.verifier.verify("third", now(), from(1)).await,
            Err(Reason::IntrospectionUnavailable)
        );
        assert_eq!(s.count(IntrospectionOutcome::Busy), 1);
        assert_eq!(s.server.hits("/introspect"), 2);
        // Once the time limit has ended them, the places are free again (after the rest
        // their errors gave the issuer, as any error no token could cause).
        tokio::time::sleep(INTROSPECTION_TIMEOUT).await;
        assert_eq!(s.count(IntrospectionOutcome::Error), 2);
        s.clock.advance(ERROR_REST);
        s.answer(&active());
        assert!(s.verifier.verify(OPAQUE, now(), from(1)).await.is_ok());
    }

    #[tokio::test(start_paused = true)]
    async fn a_token_sent_by_many_clients_at_once_is_asked_about_once() {
        let s = Setup::new(true, ClientAuth::ClientSecretBasic, Duration::from_secs(60)).await;
        s.server.route("/introspect", Route::hang());
        let v = &s.verifier;
        let verdicts = tokio::join!(
            v.verify(OPAQUE, now(), from(1)),
            v.verify(OPAQUE, now(), from(2)),
            v.verify(OPAQUE, now(), from(3)),
            v.verify(OPAQUE, now(), from(4)),
        );
        let verdicts = [verdicts.0, verdicts.1, verdicts.2, verdicts.3];
        assert!(
            verdicts
                .iter()
                .all(|v| *v == Err(Reason::IntrospectionUnavailable)),
            "{verdicts:?}"
        );
        assert_eq!(
            s.server.hits("/introspect"),
            1,
            "one question for four requests"
        );
    }

    #[tokio::test]
    async fn when_the_one_asking_goes_away_those_waiting_still_get_its_answer() {
        let s = Setup::new(true, ClientAuth::ClientSecretBasic, Duration::from_secs(60)).await;
        let slow = Duration::from_millis(300);
        s.server
            .route("/introspect", Route::json(active().to_string()).after(slow));
        let mut asking = Box::pin(s.verifier.verify(OPAQUE, now(), from(1)));
        let mut waiting = Box::pin(s.verifier.verify(OPAQUE, now(), from(2)));
        let tick = Duration::from_millis(1);
        assert!(tokio::time::timeout(tick, &mut asking).await.is_err());
        assert!(tokio::time::timeout(tick, &mut waiting).await.is_err());
        drop(asking);
        assert!(waiting.await.is_ok());
        assert_eq!(s.server.hits("/introspect"), 1, "only the first asks");
        assert_eq!(s.count(IntrospectionOutcome::Abandoned), 1);
        assert_eq!(s.count(IntrospectionOutcome::Active), 1);
    }

    /// An evicted connection's request still gets its answer: cached for the client that
    /// asks again, and counted against the client if it refuses the token.
    #[tokio::test]
    async fn an_answer_nobody_waited_for_is_cached_and_a_refusal_still_counts() {
        let s = Setup::new(true, ClientAuth::ClientSecretBasic, Duration::from_secs(60)).await;
        let failures = Arc::new(Mutex::new(Vec::new()));
        let late_failure = || -> crate::oauth::LateFailure {
            let failures = Arc::clone(&failures);
            Box::new(move |reason| failures.lock().push(reason))
        };
        let asker = Asker {
            late_failure: &late_failure,
            ..Asker::anyone()
        };
        let slow = Duration::from_millis(300);
        let s = &s;
        let gone = |token: &'static str| {
            tokio::time::timeout(
                Duration::from_millis(50),
                s.verifier.verify(token, now(), asker),
            )
        };
        let answered = |outcome: IntrospectionOutcome| async move {
            for _ in 0..200 {
                if s.count(outcome) == 1 {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            panic!("no {} answer within 2 s", outcome.as_str());
        };
        // A good token: the answer nobody waited for is there when the client asks again.
        s.server
            .route("/introspect", Route::json(active().to_string()).after(slow));
        assert!(gone(OPAQUE).await.is_err());
        answered(IntrospectionOutcome::Active).await;
        assert!(s.verifier.verify(OPAQUE, now(), asker).await.is_ok());
        assert_eq!(s.server.hits("/introspect"), 1, "answered from the cache");
        assert!(failures.lock().is_empty());
        // A bad one: refused from the cache too, and one failure counted without anyone
        // waiting for it (the refusal the client then gets counts in the carrier).
        s.server.route(
            "/introspect",
            Route::json(json!({"active": false}).to_string()).after(slow),
        );
        assert!(gone("bad-token").await.is_err());
        answered(IntrospectionOutcome::Inactive).await;
        assert_eq!(*failures.lock(), [Reason::Expired]);
        assert_eq!(
            s.verifier.verify("bad-token", now(), asker).await,
            Err(Reason::Expired)
        );
        assert_eq!(s.server.hits("/introspect"), 2);
        // No usable answer is not the token's doing: no failure.
        s.server
            .route("/introspect", Route::status(500).after(slow));
        assert!(gone("unanswered").await.is_err());
        answered(IntrospectionOutcome::Error).await;
        assert_eq!(*failures.lock(), [Reason::Expired]);
        assert_eq!(s.count(IntrospectionOutcome::Abandoned), 3);
    }

    #[tokio::test]
    async fn a_jwt_never_goes_to_introspection_and_without_it_opaque_is_malformed() {
        let s = Setup::new(true, ClientAuth::ClientSecretBasic, Duration::from_secs(60)).await;
        s.answer(&active());
        for jwt in [
            "eyJhbGciOiJFUzI1NiJ9.eyJ9.c2ln",
            "a.b.c",
            "a..c",
            "a.b.c.d.e",
        ] {
            assert_ne!(s.verdict(jwt).await, Ok(s.verdict(OPAQUE).await.unwrap()));
        }
        assert_eq!(
            s.server.hits("/introspect"),
            1,
            "only the opaque token was sent"
        );

        let dir = tempfile::tempdir().unwrap();
        let key = TestKey::new(jsonwebtoken::Algorithm::ES256, "k");
        let keys = write(dir.path(), "jwks.json", &jwks(&[&key]));
        let plain = JwtVerifier::build(
            config(ISSUER, KeySource::JwksFile(keys), dir.path()),
            Metrics::new(),
        )
        .unwrap();
        plain.load().await.unwrap();
        assert_eq!(
            plain.verify(OPAQUE, now(), Asker::anyone()).await,
            Err(Reason::Malformed)
        );
    }

    #[tokio::test]
    async fn the_endpoint_is_discovered_from_the_issuer_metadata() {
        let s = Setup::new(
            false,
            ClientAuth::ClientSecretBasic,
            Duration::from_secs(60),
        )
        .await;
        let issuer = s.server.url("");
        // Discovery first fails (no metadata): unavailable, and not asked again at once.
        assert_eq!(
            s.verdict(OPAQUE).await,
            Err(Reason::IntrospectionUnavailable)
        );
        let asked = s.server.total_hits();
        assert!(asked >= 1);
        s.server.route(
            "/.well-known/oauth-authorization-server",
            Route::json(
                json!({
                    "issuer": issuer,
                    "jwks_uri": s.server.url("/jwks"),
                    "introspection_endpoint": s.server.url("/introspect"),
                })
                .to_string(),
            ),
        );
        let mut answer = active();
        answer["iss"] = json!(issuer);
        s.answer(&answer);
        assert_eq!(
            s.verdict(OPAQUE).await,
            Err(Reason::IntrospectionUnavailable)
        );
        assert_eq!(
            s.server.total_hits(),
            asked,
            "within the discovery cooldown"
        );
        s.clock.advance(DISCOVERY_COOLDOWN);
        assert!(s.verdict(OPAQUE).await.is_ok());
        assert_eq!(s.server.hits("/introspect"), 1);
        // Found once, kept.
        s.verdict("another-opaque").await.unwrap();
        assert_eq!(s.server.hits("/.well-known/oauth-authorization-server"), 2);
    }

    #[test]
    fn the_cache_is_bounded() {
        let mut cache = AnswerCache::default();
        let t = now();
        for i in 0..(CACHE_ENTRIES + 10) {
            let mut digest = [0u8; 32];
            digest[..8].copy_from_slice(&(i as u64).to_le_bytes());
            cache.insert(digest, Err(Reason::Expired), t + Duration::from_secs(60), t);
            assert!(cache.len() <= CACHE_ENTRIES);
        }
        assert!(cache.len() < CACHE_ENTRIES);
    }
}
