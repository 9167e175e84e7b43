//! OAuth 2 resource-server verification: the [`Verifier`] trait the remote carrier is
//! built with, and the shipped JWT/JWKS verifier.
//!
//! Invariant: a verifier decides on a token string and a clock only; it never sees the
//! request, never mints anything, and never honours a loopback bearer. Its refusals are
//! the closed set of [`Reason`]s shared with audit and metrics.

use std::future::Future;
use std::net::{IpAddr, Ipv4Addr};
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Instant, SystemTime};

use robota_proto::KeySetStatus;

use crate::vocab::Reason;
use crate::vocab::RefreshTrigger;

/// Tokens longer than this are refused unparsed (`oversize`).
pub const MAX_TOKEN_BYTES: usize = 8192;

/// Who a valid token speaks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Principal {
    pub client_id: String,
    pub subject: String,
    pub scopes: Vec<String>,
    /// The token's `exp`.
    pub expires_at: SystemTime,
}

pub type VerifyFuture<'a> = Pin<Box<dyn Future<Output = Result<Principal, Reason>> + Send + 'a>>;
/// A key-set refresh: `Err` carries why it failed (the held keys stay in use).
pub type RefreshFuture<'a> = Pin<Box<dyn Future<Output = Result<(), String>> + Send + 'a>>;

/// The monotonic clock behind the verifier's cooldowns and its key-set refresh schedule
/// (injectable for tests). The default is tokio's clock, so paused-time tests move it too.
pub(crate) type Clock = Arc<dyn Fn() -> Instant + Send + Sync>;

/// Who presents a token, as far as its verification cares (never the request itself):
/// what decides how much of the daemon and of the issuer checking it may cost.
#[derive(Clone, Copy)]
pub struct Asker<'a> {
    /// The client's address group: its opaque tokens share a few places with the issuer
    /// ([`introspect::PER_CLIENT`]), and a client with fewer in flight gets a place first.
    pub client: IpAddr,
    /// Over its failure budget when the request came: a signature check it needs waits
    /// its turn in a lane of one, off the request workers, so a flood of fresh forgeries
    /// costs at most one thread. The verdict is the same.
    pub suspect: bool,
    /// Has failed in the current window: its opaque tokens wait for a place with the
    /// issuer behind those of clients that have not ([`places`]).
    pub failing: bool,
    /// Asked just before an opaque token goes to the issuer: may this client still cost
    /// it a request? `false` refuses the token `not-introspected`, nothing sent.
    pub may_introspect: &'a (dyn Fn() -> bool + Sync),
    /// Called just before a request about its token goes to the issuer (never for a
    /// token answered from the cache or by another request's question): its connection
    /// then outlasts the other undecided ones, so the answer has someone to reach.
    pub sending: &'a (dyn Fn() + Sync),
    /// Asked when a request about its token is sent to the issuer: what counts a failure
    /// against the client, and audits the refusal, if the answer refuses the token after
    /// the asker went away (its connection closed, reset or evicted) — the token was bad
    /// all the same, so a flood whose connections are closed while the issuer judges its
    /// tokens still fails, and is seen.
    pub late_failure: &'a (dyn Fn() -> LateFailure + Sync),
}

/// Counts one failure against a client, later, for the reason the answer refused its
/// token ([`Asker::late_failure`]).
pub type LateFailure = Box<dyn FnOnce(Reason) + Send>;

fn always() -> bool {
    true
}

fn nothing() {}

fn no_failure() -> LateFailure {
    Box::new(|_| {})
}

impl Asker<'static> {
    /// A caller with no history: never suspect, never held back (tools, benches, tests).
    pub fn anyone() -> Self {
        Self {
            client: IpAddr::V4(Ipv4Addr::UNSPECIFIED),
            suspect: false,
            failing: false,
            may_introspect: &always,
            sending: &nothing,
            late_failure: &no_failure,
        }
    }
}

/// Decides whether an access token is acceptable at `now`.
///
/// Refusal reasons a verifier may return: `oversize`, `malformed`, `wrong-type`,
/// `unsupported-algorithm`, `ambiguous-key`, `unknown-key`, `key-mismatch`,
/// `bad-signature`, `wrong-issuer`, `wrong-audience`, `expired`, `not-yet-valid`,
/// `missing-scope`, `principal-not-allowed`, `keys-unavailable`,
/// `introspection-unavailable`, `not-introspected`. A valid JWT, or an opaque token whose
/// answer is cached, is never refused for who presents it; only the issuer can vouch for
/// an opaque token it has not been asked about, and a client over its budget gets few
/// such questions.
pub trait Verifier: Send + Sync + 'static {
    fn verify<'a>(&'a self, token: &'a str, now: SystemTime, asker: Asker<'a>) -> VerifyFuture<'a>;

    /// The scopes every request needs (for `scope=` in challenges).
    fn required_scopes(&self) -> &[String];

    /// The key set, for `status`.
    fn key_set(&self) -> KeySetStatus;

    /// Fetch (or re-read) the key set now, whatever the schedule and the refetch cooldown
    /// say; a fetch already running is waited for first.
    fn refresh(&self, trigger: RefreshTrigger) -> RefreshFuture<'_>;
}

mod b64;
pub mod cache;
pub mod claims;
pub mod introspect;
pub mod jwks;
pub mod jwt;
pub mod keyset;
pub mod places;
#[cfg(test)]
mod testutil;
pub mod token;

pub use jwt::{BuildError, JwtConfig, JwtVerifier, LoadError};
