//! OAuth 2 resource-server verification: the [`Verifier`] trait the remote carrier is
//! built with, and the shipped JWT/JWKS verifier.
//!
//! Invariant: a verifier decides on a token string and a clock only; it never sees the
//! request, never mints anything, and never honours a loopback bearer. Its refusals are
//! the closed set of [`Reason`]s shared with audit and metrics.

use std::future::Future;
use std::pin::Pin;
use std::time::SystemTime;

use crate::audit::Reason;

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

/// Decides whether an access token is acceptable at `now`.
///
/// Refusal reasons a verifier may return: `oversize`, `malformed`, `wrong-type`,
/// `unsupported-algorithm`, `ambiguous-key`, `unknown-key`, `key-mismatch`,
/// `bad-signature`, `wrong-issuer`, `wrong-audience`, `expired`, `not-yet-valid`,
/// `missing-scope`, `principal-not-allowed`, `keys-unavailable`.
pub trait Verifier: Send + Sync + 'static {
    fn verify<'a>(&'a self, token: &'a str, now: SystemTime) -> VerifyFuture<'a>;

    /// The scopes every request needs (for `scope=` in challenges).
    fn required_scopes(&self) -> &[String];

    /// A one-line description of the key set for `status` (`3 keys from https://…, fetched …`).
    fn key_set_state(&self) -> String;
}

mod b64;
pub mod jwks;
pub mod jwt;
#[cfg(test)]
mod testutil;

pub use jwks::KeySource;
pub use jwt::{BuildError, JwtConfig, JwtVerifier, LoadError};
