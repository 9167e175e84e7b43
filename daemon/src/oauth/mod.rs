//! OAuth 2 resource-server verification: the [`Verifier`] trait the remote carrier is
//! built with, and the shipped JWT/JWKS verifier.
//!
//! Invariant: a verifier decides on a token string and a clock only; it never sees the
//! request, never mints anything, and never honours a loopback bearer. Its refusals are
//! the closed set of [`Reason`]s shared with audit and metrics.

use std::future::Future;
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

/// Decides whether an access token is acceptable at `now`.
///
/// Refusal reasons a verifier may return: `oversize`, `malformed`, `wrong-type`,
/// `unsupported-algorithm`, `ambiguous-key`, `unknown-key`, `key-mismatch`,
/// `bad-signature`, `wrong-issuer`, `wrong-audience`, `expired`, `not-yet-valid`,
/// `missing-scope`, `principal-not-allowed`, `keys-unavailable`,
/// `introspection-unavailable`.
pub trait Verifier: Send + Sync + 'static {
    fn verify<'a>(&'a self, token: &'a str, now: SystemTime) -> VerifyFuture<'a>;

    /// [`Verifier::verify`] for a token from an address already over its failure budget:
    /// the same verdict (a valid token is never refused for its address), but a signature
    /// check it needs waits its turn in a lane of one, off the request workers, so a
    /// flood of fresh forgeries costs at most one thread.
    fn verify_suspect<'a>(&'a self, token: &'a str, now: SystemTime) -> VerifyFuture<'a>;

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
#[cfg(test)]
mod testutil;
pub mod token;

pub use jwt::{BuildError, JwtConfig, JwtVerifier, LoadError};
