//! Signing keys for the JWT verifier: parsing a JWK set into verification keys, fetching it
//! over HTTPS (RFC 8414 / OIDC discovery or an explicit `jwks_uri`), reading a local JWKS
//! file, and the on-disk cache of the last good set.
//!
//! Invariants:
//! - Only RSA, EC P-256 and OKP Ed25519 keys meant for signatures are kept; `oct` keys never
//!   become verification keys (jsonwebtoken's `from_jwk` would make them HMAC secrets).
//! - A key's algorithm comes from its own `alg` or its type, never from a token.
//! - Fetches are HTTPS only, never follow redirects, stop after 10 s and 64 KiB, and come
//!   only from the configured issuer's metadata or `jwks_uri` — never from a token's `jku`
//!   or `x5u`. Every fetch is counted in `jwks_fetches_total`.
//! - Nothing here sees a token.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use jsonwebtoken::{Algorithm, DecodingKey, DecodingKeyKind};
use reqwest::Url;
use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::metrics::Metrics;
use crate::vocab::FetchOutcome;

/// Largest discovery document or key set we read.
pub const MAX_BODY_BYTES: usize = 64 * 1024;
/// Most usable keys a key set may hold.
pub const MAX_KEYS: usize = 32;
/// Total time allowed for one fetch (connect, TLS, headers, body).
pub const FETCH_TIMEOUT: Duration = Duration::from_secs(10);
/// Largest cache file we read back (32 keys of the largest RSA size fit well within it).
const MAX_CACHE_BYTES: u64 = 256 * 1024;
/// RSA moduli outside this range (in bytes) are dropped: 2048 to 8192 bits.
const RSA_MODULUS_BYTES: std::ops::RangeInclusive<usize> = 256..=1024;

/// One verification key of the set.
#[derive(Clone, Debug)]
pub(crate) struct VerifyKey {
    pub kid: Option<String>,
    /// From the key's own `alg`, or its type and curve.
    pub alg: Algorithm,
    pub key: DecodingKey,
}

/// The usable keys of one JWK set, plus their JSON (for the cache).
#[derive(Clone, Debug, Default)]
pub(crate) struct ParsedKeys {
    pub keys: Vec<VerifyKey>,
    pub raw: Vec<Value>,
    /// Entries skipped: wrong type or use, unsupported or unconfigured algorithm, bad
    /// parameters.
    pub dropped: usize,
}

/// Why a fetch (or a key-set read) failed. [`FetchError::outcome`] gives its metric label.
#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    #[error("{url} is not an https URL")]
    NotHttps { url: String },
    #[error("{method} {url} failed")]
    Transport {
        method: &'static str,
        url: String,
        #[source]
        source: reqwest::Error,
    },
    #[error("{method} {url} did not finish within {}", humantime::format_duration(*.limit))]
    Timeout {
        method: &'static str,
        url: String,
        limit: Duration,
    },
    #[error("{method} {url} answered {status}; redirects are not followed")]
    Redirect {
        method: &'static str,
        url: String,
        status: u16,
    },
    #[error("{method} {url} answered {status}")]
    Status {
        method: &'static str,
        url: String,
        status: u16,
    },
    #[error("{url}: body larger than {} bytes", MAX_BODY_BYTES)]
    TooLarge { url: String },
    #[error("{url}: not a JSON object")]
    NotJson { url: String },
    #[error("{url}: metadata names issuer {found:?}, expected exactly {expected:?}")]
    IssuerMismatch {
        url: String,
        found: String,
        expected: String,
    },
    #[error("{url}: metadata has no https `{member}`")]
    NoEndpoint { url: String, member: &'static str },
    #[error("{origin}: not a JWK set (an object with a `keys` array)")]
    NotKeySet { origin: String },
    #[error("{origin}: {count} usable keys, at most {} allowed", MAX_KEYS)]
    TooManyKeys { origin: String, count: usize },
    #[error("{origin}: no usable signing key ({dropped} skipped)")]
    NoUsableKeys { origin: String, dropped: usize },
    #[error("cannot read {}", path.display())]
    File {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("the key-set fetch ended without an outcome")]
    Interrupted,
    #[error("issuer discovery failed (RFC 8414 metadata: {oauth}); OpenID metadata")]
    Discovery {
        /// The RFC 8414 failure, with its causes.
        oauth: String,
        #[source]
        oidc: Box<FetchError>,
    },
}

impl FetchError {
    /// The `jwks_fetches_total` label: refused content is `rejected`, anything that kept us
    /// from getting content is `error`.
    pub fn outcome(&self) -> FetchOutcome {
        match self {
            FetchError::TooLarge { .. }
            | FetchError::NotJson { .. }
            | FetchError::IssuerMismatch { .. }
            | FetchError::NoEndpoint { .. }
            | FetchError::NotKeySet { .. }
            | FetchError::TooManyKeys { .. }
            | FetchError::NoUsableKeys { .. } => FetchOutcome::Rejected,
            FetchError::Discovery { oidc, .. } => oidc.outcome(),
            FetchError::NotHttps { .. }
            | FetchError::Transport { .. }
            | FetchError::Timeout { .. }
            | FetchError::Redirect { .. }
            | FetchError::Status { .. }
            | FetchError::File { .. }
            | FetchError::Interrupted => FetchOutcome::Error,
        }
    }
}

/// How long a fetched key set stays fresh, by the key server's `Cache-Control` (RFC 9111
/// §5.2.2.1 `max-age`, less the `Age` the response already has).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Freshness {
    /// No `max-age` (or no `Cache-Control`): the configured default applies.
    Unstated,
    /// `max-age`: fresh for this long.
    For(Duration),
    /// `no-cache`, `no-store`, a `max-age` that does not parse or is given twice with
    /// different values: stale at once (the schedule's lower bound applies).
    Stale,
}

impl Freshness {
    pub fn of(headers: &reqwest::header::HeaderMap) -> Self {
        let mut max_age: Option<u64> = None;
        let mut stale = false;
        let directives = headers
            .get_all(reqwest::header::CACHE_CONTROL)
            .iter()
            .flat_map(|v| v.as_bytes().split(|b| *b == b','));
        for directive in directives {
            let directive = directive.trim_ascii();
            let (name, value) = match directive.iter().position(|b| *b == b'=') {
                Some(i) => (&directive[..i], Some(&directive[i + 1..])),
                None => (directive, None),
            };
            let name = name.trim_ascii();
            if name.eq_ignore_ascii_case(b"no-cache") || name.eq_ignore_ascii_case(b"no-store") {
                stale = true;
            } else if name.eq_ignore_ascii_case(b"max-age") {
                let seconds = value
                    .map(|v| v.trim_ascii())
                    .map(|v| {
                        v.strip_prefix(b"\"")
                            .and_then(|v| v.strip_suffix(b"\""))
                            .unwrap_or(v)
                    })
                    .and_then(delta_seconds);
                match (seconds, max_age) {
                    (Some(s), None) => max_age = Some(s),
                    (Some(s), Some(seen)) if s == seen => {}
                    _ => stale = true,
                }
            }
        }
        if stale {
            return Freshness::Stale;
        }
        let Some(max_age) = max_age else {
            return Freshness::Unstated;
        };
        let age = headers
            .get(reqwest::header::AGE)
            .and_then(|v| delta_seconds(v.as_bytes().trim_ascii()))
            .unwrap_or(0);
        Freshness::For(Duration::from_secs(max_age.saturating_sub(age)))
    }

    /// The time until the next refresh: `max-age` clamped to `[min, max]`, `default` when
    /// none was given, `min` when stale.
    pub fn period(self, default: Duration, min: Duration, max: Duration) -> Duration {
        match self {
            Freshness::Unstated => default,
            Freshness::Stale => min,
            Freshness::For(d) => d.clamp(min, max),
        }
    }
}

/// RFC 9111 delta-seconds: digits only; values beyond `u64` saturate.
fn delta_seconds(text: &[u8]) -> Option<u64> {
    if text.is_empty() || !text.iter().all(u8::is_ascii_digit) {
        return None;
    }
    Some(text.iter().fold(0u64, |n, d| {
        n.saturating_mul(10).saturating_add(u64::from(d - b'0'))
    }))
}

/// Why the HTTPS client could not be built.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("cannot read CA file {}", path.display())]
    CaFile {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("CA file {} is not PEM", path.display())]
    CaPem {
        path: PathBuf,
        #[source]
        source: rustls::pki_types::pem::Error,
    },
    #[error("CA file {} holds no certificate", path.display())]
    CaEmpty { path: PathBuf },
    #[error("CA file {} holds an unusable certificate", path.display())]
    CaCertificate {
        path: PathBuf,
        #[source]
        source: rustls::Error,
    },
    #[error("cannot configure TLS")]
    Tls(#[source] rustls::Error),
    #[error("cannot build the HTTPS client")]
    Client(#[source] reqwest::Error),
}

/// Parse a JWK set, keeping only the keys this verifier may use.
///
/// A key is kept when: `kty` is `RSA`, `EC` (`crv` `P-256`) or `OKP` (`crv` `Ed25519`);
/// `use` is absent or `sig`; `key_ops`, if present, contains `verify`; its algorithm —
/// its own `alg`, else RS256 / ES256 / EdDSA by type — is consistent with its type and in
/// `allowed`; it carries no private-key member; and its parameters decode (RSA modulus
/// 2048–8192 bits without the ROCA fingerprint, exponent odd and at least 3; EC point 65
/// bytes; Ed25519 key 32 bytes). `kid`, if present, must be a string.
pub(crate) fn parse_key_set(
    body: &[u8],
    allowed: &[Algorithm],
    origin: &str,
) -> Result<ParsedKeys, FetchError> {
    let not_key_set = || FetchError::NotKeySet {
        origin: origin.to_owned(),
    };
    let doc: Value = serde_json::from_slice(body).map_err(|_| not_key_set())?;
    let entries = doc
        .get("keys")
        .and_then(Value::as_array)
        .ok_or_else(not_key_set)?;
    keys_from_entries(entries, allowed, origin)
}

fn keys_from_entries(
    entries: &[Value],
    allowed: &[Algorithm],
    origin: &str,
) -> Result<ParsedKeys, FetchError> {
    let mut parsed = ParsedKeys::default();
    for entry in entries {
        match usable_key(entry, allowed) {
            Some(key) => {
                parsed.keys.push(key);
                parsed.raw.push(entry.clone());
            }
            None => parsed.dropped += 1,
        }
    }
    if parsed.keys.len() > MAX_KEYS {
        return Err(FetchError::TooManyKeys {
            origin: origin.to_owned(),
            count: parsed.keys.len(),
        });
    }
    if parsed.keys.is_empty() {
        return Err(FetchError::NoUsableKeys {
            origin: origin.to_owned(),
            dropped: parsed.dropped,
        });
    }
    Ok(parsed)
}

/// The verification key an entry of a JWK set describes, if we may use it.
fn usable_key(entry: &Value, allowed: &[Algorithm]) -> Option<VerifyKey> {
    let obj = entry.as_object()?;
    let str_member = |name: &str| -> Option<Option<&str>> {
        match obj.get(name) {
            None => Some(None),
            Some(Value::String(s)) => Some(Some(s.as_str())),
            Some(_) => None,
        }
    };
    let kty = str_member("kty")??;
    // A published private key is a leaked key: anyone could sign with it.
    if ["d", "p", "q", "dp", "dq", "qi", "k"]
        .iter()
        .any(|m| obj.contains_key(*m))
    {
        return None;
    }
    if !matches!(str_member("use")?, None | Some("sig")) {
        return None;
    }
    if let Some(ops) = obj.get("key_ops") {
        let ops = ops.as_array()?;
        if !ops.iter().any(|op| op.as_str() == Some("verify")) {
            return None;
        }
    }
    let kid = str_member("kid")?.map(str::to_owned);
    let declared = str_member("alg")?;
    let crv = str_member("crv")?;
    let alg = match (kty, crv, declared) {
        ("RSA", _, None | Some("RS256")) => Algorithm::RS256,
        ("EC", Some("P-256"), None | Some("ES256")) => Algorithm::ES256,
        ("OKP", Some("Ed25519"), None | Some("EdDSA")) => Algorithm::EdDSA,
        // `oct` (an HMAC secret), other curves, other algorithms, inconsistent pairs.
        _ => return None,
    };
    if !allowed.contains(&alg) {
        return None;
    }
    let key = match alg {
        Algorithm::RS256 => {
            let key =
                DecodingKey::from_rsa_components(str_member("n")??, str_member("e")??).ok()?;
            let DecodingKeyKind::RsaModulusExponent { n, e } = key.kind() else {
                return None;
            };
            let n = strip_zeros(n);
            let e = strip_zeros(e);
            let exponent_ok = (1..=8).contains(&e.len())
                && e.last().is_some_and(|b| b % 2 == 1)
                && (e.len() > 1 || e[0] >= 3);
            if !RSA_MODULUS_BYTES.contains(&n.len()) || !exponent_ok || roca_fingerprint(n) {
                return None;
            }
            key
        }
        Algorithm::ES256 => {
            let key = DecodingKey::from_ec_components(str_member("x")??, str_member("y")??).ok()?;
            (key.try_get_as_bytes().ok()?.len() == 65).then_some(key)?
        }
        _ => {
            let key = DecodingKey::from_ed_components(str_member("x")??).ok()?;
            (key.try_get_as_bytes().ok()?.len() == 32).then_some(key)?
        }
    };
    Some(VerifyKey { kid, alg, key })
}

fn strip_zeros(bytes: &[u8]) -> &[u8] {
    let start = bytes.iter().position(|&b| b != 0).unwrap_or(bytes.len());
    &bytes[start..]
}

/// Whether an RSA modulus has the fingerprint of the ROCA weakness (CVE-2017-15361,
/// Infineon RSALib): for every small prime p below, `n mod p` lies in the subgroup
/// generated by 65537 mod p. A random modulus passes all 38 tests with probability
/// about 2^-154.
fn roca_fingerprint(n: &[u8]) -> bool {
    const PRIMES: [u32; 38] = [
        3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61, 67, 71, 73, 79, 83, 89,
        97, 101, 103, 107, 109, 113, 127, 131, 137, 139, 149, 151, 157, 163, 167,
    ];
    PRIMES.iter().all(|&p| {
        let residue = n.iter().fold(0u32, |r, &b| (r * 256 + u32::from(b)) % p);
        let generator = 65537 % p;
        let mut power = 1;
        loop {
            if power == residue {
                return true;
            }
            power = power * generator % p;
            if power == 1 {
                return false;
            }
        }
    })
}

/// Read a local JWKS file's bytes (at most 64 KiB).
pub(crate) fn read_key_file(path: &Path) -> Result<Vec<u8>, FetchError> {
    let file_error = |source| FetchError::File {
        path: path.to_owned(),
        source,
    };
    let too_large = || FetchError::TooLarge {
        url: path.display().to_string(),
    };
    let meta = fs::metadata(path).map_err(file_error)?;
    if meta.len() > MAX_BODY_BYTES as u64 {
        return Err(too_large());
    }
    let body = fs::read(path).map_err(file_error)?;
    if body.len() > MAX_BODY_BYTES {
        return Err(too_large());
    }
    Ok(body)
}

/// The discovery URLs for `issuer`, in the order tried: RFC 8414 §3.1 (well-known segment
/// between host and path, a terminating `/` dropped), then OpenID Connect Discovery §4
/// (appended to the issuer).
pub(crate) fn discovery_urls(issuer: &Url) -> [Url; 2] {
    let path = issuer.path().trim_end_matches('/');
    let mut oauth = issuer.clone();
    oauth.set_path(&format!("/.well-known/oauth-authorization-server{path}"));
    let mut oidc = issuer.clone();
    oidc.set_path(&format!("{path}/.well-known/openid-configuration"));
    [oauth, oidc]
}

/// Parse `s` as an `https` URL without user-info or fragment.
pub(crate) fn https_url(s: &str) -> Option<Url> {
    let url = Url::parse(s).ok()?;
    (url.scheme() == "https"
        && url.host().is_some()
        && url.username().is_empty()
        && url.password().is_none()
        && url.fragment().is_none())
    .then_some(url)
}

/// The HTTPS client for discovery and key-set fetches (a clone shares its connections).
#[derive(Clone)]
pub(crate) struct Fetcher {
    client: reqwest::Client,
    metrics: Metrics,
}

impl Fetcher {
    /// TLS via rustls with the aws-lc-rs provider, trusting webpki-roots plus the
    /// certificates in `ca_file`; no proxy, no redirects, HTTPS only, 10 s timeout.
    pub fn new(ca_file: Option<&Path>, metrics: Metrics) -> Result<Self, ClientError> {
        let mut roots = rustls::RootCertStore {
            roots: webpki_roots::TLS_SERVER_ROOTS.to_vec(),
        };
        if let Some(path) = ca_file {
            let pem = fs::read(path).map_err(|source| ClientError::CaFile {
                path: path.to_owned(),
                source,
            })?;
            let mut added = 0;
            for cert in CertificateDer::pem_slice_iter(&pem) {
                let cert = cert.map_err(|source| ClientError::CaPem {
                    path: path.to_owned(),
                    source,
                })?;
                roots
                    .add(cert)
                    .map_err(|source| ClientError::CaCertificate {
                        path: path.to_owned(),
                        source,
                    })?;
                added += 1;
            }
            if added == 0 {
                return Err(ClientError::CaEmpty {
                    path: path.to_owned(),
                });
            }
        }
        let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
        let mut tls = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(ClientError::Tls)?
            .with_root_certificates(roots)
            .with_no_client_auth();
        tls.alpn_protocols = vec![b"http/1.1".to_vec()];
        let client = reqwest::Client::builder()
            .tls_backend_preconfigured(tls)
            .https_only(true)
            .redirect(reqwest::redirect::Policy::none())
            .no_proxy()
            .timeout(FETCH_TIMEOUT)
            .connect_timeout(FETCH_TIMEOUT)
            .user_agent(concat!("robota-mcpd/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(ClientError::Client)?;
        Ok(Self { client, metrics })
    }

    /// Find the issuer's `jwks_uri`: RFC 8414 metadata, then OIDC. The document's `issuer`
    /// must equal `issuer` exactly and its `jwks_uri` must be https.
    pub async fn discover(&self, issuer: &str) -> Result<Url, FetchError> {
        self.discover_endpoint(issuer, "jwks_uri").await
    }

    /// An https URL the issuer's metadata names under `member` (`jwks_uri`,
    /// `introspection_endpoint`): RFC 8414 metadata, then OIDC, each document's `issuer`
    /// equal to `issuer` exactly.
    pub async fn discover_endpoint(
        &self,
        issuer: &str,
        member: &'static str,
    ) -> Result<Url, FetchError> {
        let parsed = https_url(issuer).ok_or_else(|| FetchError::NotHttps {
            url: issuer.to_owned(),
        })?;
        let [oauth_url, oidc_url] = discovery_urls(&parsed);
        let oauth = match self
            .fetch(&oauth_url, |b, _| {
                metadata_endpoint(b, issuer, &oauth_url, member)
            })
            .await
        {
            Ok(url) => return Ok(url),
            Err(e) => e,
        };
        tracing::debug!(url = %oauth_url, error = %crate::error_chain(&oauth), "RFC 8414 discovery failed; trying OpenID discovery");
        match self
            .fetch(&oidc_url, |b, _| {
                metadata_endpoint(b, issuer, &oidc_url, member)
            })
            .await
        {
            Ok(url) => Ok(url),
            Err(oidc) => Err(FetchError::Discovery {
                oauth: crate::error_chain(&oauth),
                oidc: Box::new(oidc),
            }),
        }
    }

    /// Fetch and parse the key set at `url`, with how long the server says it stays fresh.
    pub async fn fetch_keys(
        &self,
        url: &Url,
        allowed: &[Algorithm],
    ) -> Result<(ParsedKeys, Freshness), FetchError> {
        self.fetch(url, |body, freshness| {
            parse_key_set(body, allowed, url.as_str()).map(|keys| (keys, freshness))
        })
        .await
    }

    /// One counted fetch: GET `url`, then `accept` the body.
    async fn fetch<T>(
        &self,
        url: &Url,
        accept: impl FnOnce(&[u8], Freshness) -> Result<T, FetchError>,
    ) -> Result<T, FetchError> {
        let result = match self.get(url).await {
            Ok((body, freshness)) => accept(&body, freshness),
            Err(e) => Err(e),
        };
        self.metrics.jwks_fetch(match &result {
            Ok(_) => FetchOutcome::Ok,
            Err(e) => e.outcome(),
        });
        result
    }

    async fn get(&self, url: &Url) -> Result<(Vec<u8>, Freshness), FetchError> {
        if url.scheme() != "https" {
            return Err(FetchError::NotHttps {
                url: url.as_str().to_owned(),
            });
        }
        let request = self
            .client
            .get(url.clone())
            .header(reqwest::header::ACCEPT, "application/json");
        self.exchange("GET", url, request, FETCH_TIMEOUT).await
    }

    /// POST a form (`application/x-www-form-urlencoded`) to an https `url`, with an
    /// optional `Authorization`, bounded like every fetch but to `limit` in all; the body
    /// of a 200 answer. Neither the form nor the header ever appears in an error.
    pub async fn post_form(
        &self,
        url: &Url,
        form: String,
        authorization: Option<reqwest::header::HeaderValue>,
        limit: Duration,
    ) -> Result<Vec<u8>, FetchError> {
        if url.scheme() != "https" {
            return Err(FetchError::NotHttps {
                url: url.as_str().to_owned(),
            });
        }
        let mut request = self
            .client
            .post(url.clone())
            .header(reqwest::header::ACCEPT, "application/json")
            .header(
                reqwest::header::CONTENT_TYPE,
                "application/x-www-form-urlencoded",
            )
            .body(form);
        if let Some(mut value) = authorization {
            value.set_sensitive(true);
            request = request.header(reqwest::header::AUTHORIZATION, value);
        }
        self.exchange("POST", url, request, limit)
            .await
            .map(|(body, _)| body)
    }

    /// Send `request`, then read a 200 answer of at most [`MAX_BODY_BYTES`], all within
    /// `limit`; no redirect is followed.
    async fn exchange(
        &self,
        method: &'static str,
        url: &Url,
        request: reqwest::RequestBuilder,
        limit: Duration,
    ) -> Result<(Vec<u8>, Freshness), FetchError> {
        let name = || url.as_str().to_owned();
        let transport = |source: reqwest::Error| {
            if source.is_timeout() {
                FetchError::Timeout {
                    method,
                    url: name(),
                    limit,
                }
            } else {
                FetchError::Transport {
                    method,
                    url: name(),
                    source: source.without_url(),
                }
            }
        };
        let exchange = async {
            let mut response = request.send().await.map_err(transport)?;
            let status = response.status();
            if status.is_redirection() {
                return Err(FetchError::Redirect {
                    method,
                    url: name(),
                    status: status.as_u16(),
                });
            }
            if status != reqwest::StatusCode::OK {
                return Err(FetchError::Status {
                    method,
                    url: name(),
                    status: status.as_u16(),
                });
            }
            if response
                .content_length()
                .is_some_and(|n| n > MAX_BODY_BYTES as u64)
            {
                return Err(FetchError::TooLarge { url: name() });
            }
            let freshness = Freshness::of(response.headers());
            let mut body = Vec::new();
            while let Some(chunk) = response.chunk().await.map_err(transport)? {
                if body.len() + chunk.len() > MAX_BODY_BYTES {
                    return Err(FetchError::TooLarge { url: name() });
                }
                body.extend_from_slice(&chunk);
            }
            Ok((body, freshness))
        };
        tokio::time::timeout(limit, exchange)
            .await
            .map_err(|_| FetchError::Timeout {
                method,
                url: name(),
                limit,
            })?
    }
}

/// The https URL under `member` of an authorization-server metadata document.
fn metadata_endpoint(
    body: &[u8],
    issuer: &str,
    url: &Url,
    member: &'static str,
) -> Result<Url, FetchError> {
    let doc: Value = serde_json::from_slice(body).map_err(|_| FetchError::NotJson {
        url: url.to_string(),
    })?;
    let doc = doc.as_object().ok_or_else(|| FetchError::NotJson {
        url: url.to_string(),
    })?;
    match doc.get("issuer") {
        Some(Value::String(found)) if found == issuer => {}
        other => {
            return Err(FetchError::IssuerMismatch {
                url: url.to_string(),
                found: other
                    .map(Value::to_string)
                    .unwrap_or_else(|| "(none)".into()),
                expected: issuer.to_owned(),
            });
        }
    }
    doc.get(member)
        .and_then(Value::as_str)
        .and_then(https_url)
        .ok_or_else(|| FetchError::NoEndpoint {
            url: url.to_string(),
            member,
        })
}

/// The cache file: the last good key set of one issuer.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct CacheDoc {
    pub issuer: String,
    /// The JWKS URL the keys came from.
    pub source: String,
    /// Seconds since the Unix epoch.
    pub fetched_at: u64,
    pub keys: Vec<Value>,
}

/// Why a cache file was not used.
#[derive(Debug, thiserror::Error)]
pub(crate) enum CacheError {
    #[error("no cache file")]
    Missing,
    #[error("cannot read the cache file")]
    Io(#[source] io::Error),
    #[error("the cache file is larger than {} bytes", MAX_CACHE_BYTES)]
    TooLarge,
    #[error("the cache file is not a key-set cache")]
    Corrupt(#[source] serde_json::Error),
    #[error("the cache file is for issuer {found:?}, not {expected:?}")]
    OtherIssuer { found: String, expected: String },
    #[error("the cached key set is unusable")]
    Keys(#[source] FetchError),
}

/// A key set read back from the cache.
pub(crate) struct Cached {
    pub keys: ParsedKeys,
    pub source: String,
    pub fetched_at: SystemTime,
}

/// Read the cache at `path` for `issuer`, re-applying the key filter for `allowed`.
pub(crate) fn read_cache(
    path: &Path,
    issuer: &str,
    allowed: &[Algorithm],
) -> Result<Cached, CacheError> {
    let meta = match fs::metadata(path) {
        Ok(meta) => meta,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Err(CacheError::Missing),
        Err(e) => return Err(CacheError::Io(e)),
    };
    if meta.len() > MAX_CACHE_BYTES {
        return Err(CacheError::TooLarge);
    }
    let bytes = fs::read(path).map_err(CacheError::Io)?;
    let doc: CacheDoc = serde_json::from_slice(&bytes).map_err(CacheError::Corrupt)?;
    if doc.issuer != issuer {
        return Err(CacheError::OtherIssuer {
            found: doc.issuer,
            expected: issuer.to_owned(),
        });
    }
    let origin = format!("cache {}", path.display());
    let keys = keys_from_entries(&doc.keys, allowed, &origin).map_err(CacheError::Keys)?;
    Ok(Cached {
        keys,
        source: doc.source,
        fetched_at: UNIX_EPOCH + Duration::from_secs(doc.fetched_at),
    })
}

/// Replace the cache at `path` atomically: a 0600 temporary file in the same directory,
/// written and fsynced, renamed over `path`, then the directory fsynced.
pub(crate) fn write_cache(path: &Path, doc: &CacheDoc) -> io::Result<()> {
    let dir = match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => Path::new("."),
    };
    let name = path
        .file_name()
        .ok_or_else(|| io::Error::other("the cache path has no file name"))?;
    let mut nonce = [0u8; 8];
    getrandom::fill(&mut nonce).map_err(|e| io::Error::other(e.to_string()))?;
    let tmp = dir.join(format!(
        ".{}.{}.tmp",
        name.to_string_lossy(),
        hex::encode(nonce)
    ));
    let bytes = serde_json::to_vec_pretty(doc).map_err(io::Error::other)?;
    let result = (|| {
        let mut file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp)?;
        file.write_all(&bytes)?;
        file.sync_all()?;
        drop(file);
        fs::rename(&tmp, path)?;
        File::open(dir)?.sync_all()
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

/// Seconds since the Unix epoch (0 before it).
pub(crate) fn unix_seconds(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use serde_json::json;

    use super::*;
    use crate::oauth::testutil::{Route, TestKey, TestServer, jwks};

    const ALL: [Algorithm; 3] = [Algorithm::RS256, Algorithm::ES256, Algorithm::EdDSA];

    fn parse(doc: Value, allowed: &[Algorithm]) -> Result<ParsedKeys, FetchError> {
        parse_key_set(doc.to_string().as_bytes(), allowed, "test")
    }

    #[test]
    fn keeps_only_signature_keys_of_configured_algorithms() {
        let rsa = TestKey::new(Algorithm::RS256, "rsa");
        let ec = TestKey::new(Algorithm::ES256, "ec");
        let ed = TestKey::new(Algorithm::EdDSA, "ed");
        let with = |base: &Value, extra: Value| {
            let mut k = base.clone();
            for (name, v) in extra.as_object().unwrap() {
                k[name] = v.clone();
            }
            k
        };
        let entries = vec![
            rsa.jwk.clone(),                                       // kept, RS256 by type
            with(&ec.jwk, json!({"use": "sig", "alg": "ES256"})),  // kept
            with(&ed.jwk, json!({"key_ops": ["verify"]})),         // kept, EdDSA by type
            json!({"kty": "oct", "k": "c2VjcmV0", "kid": "hmac"}), // HMAC secret: never
            json!({"kty": "oct", "k": "c2VjcmV0", "alg": "HS256"}),
            with(&rsa.jwk, json!({"use": "enc"})), // encryption key
            with(&rsa.jwk, json!({"alg": "PS256"})), // unsupported algorithm
            with(&rsa.jwk, json!({"alg": "ES256"})), // inconsistent with kty
            with(&ec.jwk, json!({"crv": "P-384"})), // other curve
            with(&ec.jwk, json!({"key_ops": ["sign"]})), // not for verifying
            with(&ec.jwk, json!({"kid": 5})),      // kid not a string
            with(&ec.jwk, json!({"x": "not base64!"})), // bad parameters
            with(&ed.jwk, json!({"crv": "X25519"})), // not a signature curve
            json!({"kty": "RSA", "n": "AQAB", "e": "AQAB"}), // RSA far below 2048 bits
            with(&rsa.jwk, json!({"e": "AQ"})),    // exponent 1
            with(&rsa.jwk, json!({"e": "AQAA"})),  // even exponent
            with(&ec.jwk, json!({"d": "AAAA"})),   // private key published
            json!("not an object"),
        ];
        let parsed = parse(json!({"keys": entries}), &ALL).unwrap();
        let kept: Vec<_> = parsed
            .keys
            .iter()
            .map(|k| (k.kid.clone().unwrap(), k.alg))
            .collect();
        assert_eq!(
            kept,
            [
                ("rsa".to_owned(), Algorithm::RS256),
                ("ec".to_owned(), Algorithm::ES256),
                ("ed".to_owned(), Algorithm::EdDSA)
            ]
        );
        assert_eq!(parsed.dropped, 15);
        assert_eq!(parsed.raw.len(), 3);

        // Keys of algorithms not configured are dropped too.
        let parsed = parse(json!({"keys": [rsa.jwk, ec.jwk]}), &[Algorithm::ES256]).unwrap();
        assert_eq!(parsed.keys.len(), 1);
        assert_eq!(parsed.keys[0].alg, Algorithm::ES256);
    }

    #[test]
    fn freshness_follows_cache_control_and_age() {
        use reqwest::header::{HeaderMap, HeaderValue};
        let of = |pairs: &[(&'static str, &'static str)]| {
            let mut h = HeaderMap::new();
            for (name, value) in pairs {
                h.append(*name, HeaderValue::from_static(value));
            }
            Freshness::of(&h)
        };
        let secs = |n| Freshness::For(Duration::from_secs(n));
        let cases: [(&[(&str, &str)], Freshness); 14] = [
            (&[], Freshness::Unstated),
            (&[("cache-control", "public")], Freshness::Unstated),
            (&[("cache-control", "max-age=300")], secs(300)),
            (&[("cache-control", "Public, MAX-AGE = 300 ")], secs(300)),
            (&[("cache-control", "max-age=\"300\"")], secs(300)),
            (
                &[("cache-control", "public"), ("cache-control", "max-age=60")],
                secs(60),
            ),
            (
                &[("cache-control", "max-age=300"), ("age", "100")],
                secs(200),
            ),
            (&[("cache-control", "max-age=300"), ("age", "900")], secs(0)),
            (&[("cache-control", "max-age=300, max-age=300")], secs(300)),
            (
                &[("cache-control", "max-age=300, max-age=30")],
                Freshness::Stale,
            ),
            (&[("cache-control", "max-age=-1")], Freshness::Stale),
            (&[("cache-control", "max-age")], Freshness::Stale),
            (
                &[("cache-control", "max-age=300, no-cache")],
                Freshness::Stale,
            ),
            (
                &[("cache-control", "max-age=99999999999999999999999")],
                secs(u64::MAX),
            ),
        ];
        for (headers, want) in cases {
            assert_eq!(of(headers), want, "{headers:?}");
        }
        let (default, min, max) = (
            Duration::from_secs(600),
            Duration::from_secs(60),
            Duration::from_secs(86_400),
        );
        for (freshness, want) in [
            (Freshness::Unstated, 600),
            (Freshness::Stale, 60),
            (secs(0), 60),
            (secs(120), 120),
            (secs(u64::MAX), 86_400),
        ] {
            assert_eq!(
                freshness.period(default, min, max),
                Duration::from_secs(want),
                "{freshness:?}"
            );
        }
    }

    #[test]
    fn roca_fingerprint_matches_only_weak_moduli() {
        // 65537 generates {1, 10} mod 11: a modulus that is 2 mod 11 cannot match.
        assert!(!roca_fingerprint(&[2]));
        // 1 = 65537^0 is in every subgroup.
        assert!(roca_fingerprint(&[1]));
        // Wycheproof's ROCA key (2049 bits: only this check refuses it) matches.
        let corpus: Value =
            serde_json::from_str(include_str!("testdata/wycheproof_jwk.json")).unwrap();
        let roca = corpus["groups"]
            .as_array()
            .unwrap()
            .iter()
            .find(|g| g["comment"] == "jws_rsa_roca_key")
            .expect("the ROCA group");
        let jwk = &roca["keys"][0];
        let key = DecodingKey::from_rsa_components(
            jwk["n"].as_str().unwrap(),
            jwk["e"].as_str().unwrap(),
        )
        .unwrap();
        let DecodingKeyKind::RsaModulusExponent { n, .. } = key.kind() else {
            panic!("RSA components")
        };
        assert!(RSA_MODULUS_BYTES.contains(&strip_zeros(n).len()));
        assert!(roca_fingerprint(n));
        assert!(usable_key(jwk, &ALL).is_none());
        // A generated key does not match.
        let rsa = TestKey::new(Algorithm::RS256, "rsa");
        let key = DecodingKey::from_rsa_components(
            rsa.jwk["n"].as_str().unwrap(),
            rsa.jwk["e"].as_str().unwrap(),
        )
        .unwrap();
        let DecodingKeyKind::RsaModulusExponent { n, .. } = key.kind() else {
            panic!("RSA components")
        };
        assert!(!roca_fingerprint(n));
    }

    #[test]
    fn refuses_sets_that_are_empty_too_large_or_not_sets() {
        let oct_only = json!({"keys": [{"kty": "oct", "k": "c2VjcmV0"}]});
        assert!(matches!(
            parse(oct_only, &ALL),
            Err(FetchError::NoUsableKeys { dropped: 1, .. })
        ));
        for not_a_set in [
            json!([]),
            json!({"keys": {}}),
            json!({"key": []}),
            json!("x"),
        ] {
            let e = parse(not_a_set, &ALL).unwrap_err();
            assert!(matches!(e, FetchError::NotKeySet { .. }));
            assert_eq!(e.outcome(), FetchOutcome::Rejected);
        }
        let keys: Vec<TestKey> = (0..=MAX_KEYS)
            .map(|i| TestKey::new(Algorithm::EdDSA, &format!("k{i}")))
            .collect();
        let refs: Vec<&TestKey> = keys.iter().collect();
        let e = parse_key_set(jwks(&refs).as_bytes(), &ALL, "test").unwrap_err();
        assert!(matches!(e, FetchError::TooManyKeys { count: 33, .. }));
        assert_eq!(e.outcome(), FetchOutcome::Rejected);
        assert_eq!(
            parse_key_set(jwks(&refs[..MAX_KEYS]).as_bytes(), &ALL, "test")
                .unwrap()
                .keys
                .len(),
            MAX_KEYS
        );
    }

    #[test]
    fn discovery_urls_follow_rfc_8414_then_oidc() {
        let urls =
            |issuer: &str| discovery_urls(&Url::parse(issuer).unwrap()).map(|u| u.to_string());
        assert_eq!(
            urls("https://as.example"),
            [
                "https://as.example/.well-known/oauth-authorization-server",
                "https://as.example/.well-known/openid-configuration"
            ]
        );
        assert_eq!(
            urls("https://as.example/"),
            [
                "https://as.example/.well-known/oauth-authorization-server",
                "https://as.example/.well-known/openid-configuration"
            ]
        );
        assert_eq!(
            urls("https://as.example:8443/tenants/a"),
            [
                "https://as.example:8443/.well-known/oauth-authorization-server/tenants/a",
                "https://as.example:8443/tenants/a/.well-known/openid-configuration"
            ]
        );
    }

    #[test]
    fn cache_round_trip_is_atomic_and_private() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("jwks-cache.json");
        let key = TestKey::new(Algorithm::ES256, "ec");
        assert!(matches!(
            read_cache(&path, "https://i", &ALL),
            Err(CacheError::Missing)
        ));
        // An existing, world-readable file is replaced by a private one.
        std::fs::write(&path, "old").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let doc = CacheDoc {
            issuer: "https://i".into(),
            source: "https://i/jwks".into(),
            fetched_at: 1_800_000_000,
            keys: vec![key.jwk.clone()],
        };
        write_cache(&path, &doc).unwrap();
        assert_eq!(
            std::fs::metadata(&path).unwrap().permissions().mode() & 0o777,
            0o600
        );
        let names: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names, ["jwks-cache.json"]);
        let cached = read_cache(&path, "https://i", &ALL).unwrap();
        assert_eq!(cached.keys.keys.len(), 1);
        assert_eq!(cached.source, "https://i/jwks");
        assert_eq!(unix_seconds(cached.fetched_at), 1_800_000_000);
        assert!(matches!(
            read_cache(&path, "https://j", &ALL),
            Err(CacheError::OtherIssuer { .. })
        ));
        // Keys are filtered again on read: the configuration may have changed.
        assert!(matches!(
            read_cache(&path, "https://i", &[Algorithm::RS256]),
            Err(CacheError::Keys(_))
        ));
        std::fs::write(&path, "{").unwrap();
        assert!(matches!(
            read_cache(&path, "https://i", &ALL),
            Err(CacheError::Corrupt(_))
        ));
        // A failed write leaves nothing behind.
        let missing_dir = dir.path().join("absent").join("jwks-cache.json");
        assert!(write_cache(&missing_dir, &doc).is_err());
    }

    fn fetcher(server: &TestServer, metrics: &Metrics) -> Fetcher {
        Fetcher::new(Some(&server.ca_file), metrics.clone()).unwrap()
    }

    fn count(metrics: &Metrics, outcome: FetchOutcome) -> u64 {
        let prefix = format!(
            "robota_mcpd_jwks_fetches_total{{outcome=\"{}\"}} ",
            outcome.as_str()
        );
        metrics
            .render()
            .lines()
            .find_map(|l| l.strip_prefix(&prefix).map(|n| n.parse().unwrap()))
            .unwrap_or(0)
    }

    #[tokio::test]
    async fn fetch_limits_body_size_and_never_follows_redirects() {
        let dir = tempfile::tempdir().unwrap();
        let server = TestServer::start(dir.path()).await;
        let metrics = Metrics::new();
        let f = fetcher(&server, &metrics);
        let key = TestKey::new(Algorithm::ES256, "ec");
        server.route("/jwks", Route::json(jwks(&[&key])));
        let url = Url::parse(&server.url("/jwks")).unwrap();
        assert_eq!(f.fetch_keys(&url, &ALL).await.unwrap().0.keys.len(), 1);

        // Just over 64 KiB: refused from Content-Length, and while streaming without it.
        let padded = |n: usize| {
            let mut body = jwks(&[&key]);
            body.insert_str(1, &format!("\"pad\":\"{}\",", "p".repeat(n)));
            body
        };
        let at_limit = padded(MAX_BODY_BYTES - jwks(&[&key]).len() - r#""pad":"","#.len());
        assert_eq!(at_limit.len(), MAX_BODY_BYTES);
        server.route("/at-limit", Route::json(at_limit.clone()));
        let over = format!("{at_limit} ");
        server.route("/large", Route::json(over.clone()));
        let mut streamed = Route::json(over);
        streamed.content_length = false;
        server.route("/large-streamed", streamed);
        let mut streamed_ok = Route::json(at_limit);
        streamed_ok.content_length = false;
        server.route("/at-limit-streamed", streamed_ok);
        for path in ["/at-limit", "/at-limit-streamed"] {
            let url = Url::parse(&server.url(path)).unwrap();
            assert!(f.fetch_keys(&url, &ALL).await.is_ok(), "{path}");
        }
        for path in ["/large", "/large-streamed"] {
            let url = Url::parse(&server.url(path)).unwrap();
            let e = f.fetch_keys(&url, &ALL).await.unwrap_err();
            assert!(matches!(e, FetchError::TooLarge { .. }), "{path}: {e}");
        }
        assert_eq!(count(&metrics, FetchOutcome::Rejected), 2);

        // A redirect is an error, and its target is never asked.
        let mut redirect = Route::status(302);
        redirect
            .headers
            .push(("Location".into(), server.url("/jwks")));
        server.route("/moved", redirect);
        let before = server.hits("/jwks");
        let url = Url::parse(&server.url("/moved")).unwrap();
        let e = f.fetch_keys(&url, &ALL).await.unwrap_err();
        assert!(matches!(e, FetchError::Redirect { status: 302, .. }), "{e}");
        assert_eq!(server.hits("/jwks"), before);
        assert_eq!(e.outcome(), FetchOutcome::Error);

        let url = Url::parse(&server.url("/missing")).unwrap();
        assert!(matches!(
            f.fetch_keys(&url, &ALL).await,
            Err(FetchError::Status { status: 404, .. })
        ));
        assert_eq!(count(&metrics, FetchOutcome::Error), 2);
        assert_eq!(count(&metrics, FetchOutcome::Ok), 3);
    }

    #[tokio::test(start_paused = true)]
    async fn fetch_gives_up_after_the_timeout() {
        // A server that accepts connections and never answers.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let silent = tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((stream, _)) = listener.accept().await {
                held.push(stream);
            }
        });
        let metrics = Metrics::new();
        let f = Fetcher::new(None, metrics.clone()).unwrap();
        let started = tokio::time::Instant::now();
        let url = Url::parse(&format!("https://{addr}/jwks")).unwrap();
        let e = f.fetch_keys(&url, &ALL).await.unwrap_err();
        assert!(matches!(e, FetchError::Timeout { .. }), "{e}");
        assert!(started.elapsed() >= FETCH_TIMEOUT);
        assert_eq!(count(&metrics, FetchOutcome::Error), 1);
        silent.abort();
    }

    #[tokio::test]
    async fn fetch_needs_a_trusted_https_server() {
        let dir = tempfile::tempdir().unwrap();
        let server = TestServer::start(dir.path()).await;
        let key = TestKey::new(Algorithm::ES256, "ec");
        server.route("/jwks", Route::json(jwks(&[&key])));
        // Without our CA: the TLS handshake fails.
        let metrics = Metrics::new();
        let untrusting = Fetcher::new(None, metrics.clone()).unwrap();
        let url = Url::parse(&server.url("/jwks")).unwrap();
        let e = untrusting.fetch_keys(&url, &ALL).await.unwrap_err();
        assert!(matches!(e, FetchError::Transport { .. }), "{e}");
        assert_eq!(server.hits("/jwks"), 0);
        // Plain http is refused before any connection.
        let plain = Url::parse(&format!("http://{}/jwks", server.addr)).unwrap();
        let e = fetcher(&server, &metrics)
            .fetch_keys(&plain, &ALL)
            .await
            .unwrap_err();
        assert!(matches!(e, FetchError::NotHttps { .. }), "{e}");
        assert_eq!(count(&metrics, FetchOutcome::Error), 2);
    }

    #[tokio::test]
    async fn discovery_checks_the_issuer_and_falls_back_to_oidc() {
        let dir = tempfile::tempdir().unwrap();
        let server = TestServer::start(dir.path()).await;
        let metrics = Metrics::new();
        let f = fetcher(&server, &metrics);
        let issuer = server.url("/tenant");
        let oauth = "/.well-known/oauth-authorization-server/tenant";
        let oidc = "/tenant/.well-known/openid-configuration";

        // RFC 8414 answers: used.
        server.route(
            oauth,
            Route::json(json!({"issuer": issuer, "jwks_uri": server.url("/k1")}).to_string()),
        );
        assert_eq!(
            f.discover(&issuer).await.unwrap().as_str(),
            server.url("/k1")
        );
        assert_eq!(server.hits(oidc), 0);

        // RFC 8414 missing: OIDC.
        server.route(oauth, Route::status(404));
        server.route(
            oidc,
            Route::json(json!({"issuer": issuer, "jwks_uri": server.url("/k2")}).to_string()),
        );
        assert_eq!(
            f.discover(&issuer).await.unwrap().as_str(),
            server.url("/k2")
        );

        // Metadata for another issuer (here: a trailing slash) is refused.
        server.route(
            oidc,
            Route::json(
                json!({"issuer": format!("{issuer}/"), "jwks_uri": server.url("/k2")}).to_string(),
            ),
        );
        let e = f.discover(&issuer).await.unwrap_err();
        assert!(crate::error_chain(&e).contains("expected exactly"), "{e}");
        assert_eq!(e.outcome(), FetchOutcome::Rejected);

        // A jwks_uri that is not https is refused.
        server.route(
            oidc,
            Route::json(json!({"issuer": issuer, "jwks_uri": "http://127.0.0.1/jwks"}).to_string()),
        );
        let e = f.discover(&issuer).await.unwrap_err();
        assert!(
            crate::error_chain(&e).contains("no https `jwks_uri`"),
            "{e}"
        );
        assert_eq!(count(&metrics, FetchOutcome::Ok), 2);
    }
}
