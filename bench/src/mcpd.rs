//! robota-mcpd under test: the real shipped binary started by the e2e harness (config in
//! a temp dir, `READY=1` on a private notify socket, port 0, addresses from
//! `robota-mcpctl --json status`), and for the remote carrier an ES256 key set of four
//! keys in a `jwks_file` plus the tokens the load generator sends; for opaque tokens the
//! end-to-end tests' oidc-provider, whose introspection endpoint the daemon asks.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use http::HeaderValue;
use jsonwebtoken::Algorithm;
use robota_e2e::authz::{SigningKey, TokenBuilder, now_secs};
use robota_e2e::oidc::{OPAQUE_CLIENT, Oidc};
use robota_e2e::remote::RemoteConfig;
use robota_e2e::{Daemon, DaemonBuilder};
use serde_json::json;
use tempfile::TempDir;

use crate::load::bearer;

/// The remote carrier's public URL; requests carry its authority as `Host`, as a reverse
/// proxy in front of a plain-HTTP `[remote]` listener would pass it.
pub const PUBLIC_URL: &str = "https://mcp.example.com/mcp";
pub const PUBLIC_HOST: &str = "mcp.example.com";
pub const ISSUER: &str = "https://auth.example.com";

/// The `[remote]` line of the throughput matrix's remote daemons: every client of a cell
/// connects from 127.0.0.1, as every client behind one proxy would, and the default cap
/// of 16 connections per address would have the 32-client cells' connections evict each
/// other. 64 is the default `max_connections`, so the cap is off. (The flood keeps the
/// default: the cap is part of what it measures.)
pub const MATRIX_PER_ADDRESS: &str = "max_connections_per_address = 64";

/// The carriers' line for every daemon whose cells run many clients as one caller (the
/// host bearer, or alice's token): the default share of a caller, half the in-flight
/// slots, would answer a 32-client cell's 17th request 503 `caller-busy`. 32 is the
/// default `max_in_flight`, so the share is the whole carrier: the carrier's speed is
/// measured here, not one caller's share of it.
pub const MATRIX_PER_CALLER: &str = "max_in_flight_per_caller = 32";

/// Fails early, with the command to run, when the daemon binaries are missing.
pub fn check_binaries() -> Result<(), String> {
    let daemon = binary_dir();
    let fixtures = robota_e2e::bin_dir();
    for path in [
        daemon.join("robota-mcpd"),
        daemon.join("robota-mcpctl"),
        fixtures.join("robota-e2e-upstream"),
    ] {
        if !path.is_file() {
            return Err(format!(
                "{} is missing: build it first (the commands at the top of docs/benchmarks.md)",
                path.display()
            ));
        }
    }
    Ok(())
}

/// The directory of the daemon binaries this run uses: the shipped build's when
/// `ROBOTA_BIN_DIR` names it, as the documented command does.
pub fn binary_dir() -> PathBuf {
    robota_e2e::daemon_bin_dir()
}

/// A daemon with the harness's config, the loopback carrier only, and
/// [`MATRIX_PER_CALLER`].
pub fn loopback_daemon() -> Daemon {
    loopback_daemon_with(&[])
}

/// [`loopback_daemon`] with extra environment variables (experiments: allocator tunables).
pub fn loopback_daemon_with(env: &[(String, String)]) -> Daemon {
    with_env(Daemon::builder().loopback(MATRIX_PER_CALLER), env).start()
}

fn with_env(builder: DaemonBuilder, env: &[(String, String)]) -> DaemonBuilder {
    env.iter().fold(builder, |b, (k, v)| b.env(k, v))
}

/// `Authorization` for the loopback carrier: the host bearer (`robota-mcpctl bearer issue`).
pub fn host_bearer(d: &Daemon) -> HeaderValue {
    bearer(&d.bearer())
}

/// Four ES256 signing keys published in a JWKS file, and a fifth, unpublished key for
/// bad signatures.
pub struct KeySet {
    pub keys: Vec<Arc<SigningKey>>,
    rogue: Arc<SigningKey>,
    dir: TempDir,
}

impl KeySet {
    pub fn generate() -> KeySet {
        let keys: Vec<Arc<SigningKey>> = (1..=4)
            .map(|i| SigningKey::generate(Algorithm::ES256, &format!("es-{i}")))
            .collect();
        let rogue = SigningKey::generate(Algorithm::ES256, "rogue");
        let dir = tempfile::Builder::new()
            .prefix("robota-bench-keys-")
            .tempdir()
            .unwrap_or_else(|e| panic!("tempdir: {e}"));
        let jwks = json!({"keys": keys.iter().map(|k| k.jwk()).collect::<Vec<_>>()});
        std::fs::write(dir.path().join("jwks.json"), jwks.to_string())
            .unwrap_or_else(|e| panic!("write the JWKS file: {e}"));
        KeySet { keys, rogue, dir }
    }

    pub fn jwks_file(&self) -> PathBuf {
        self.dir.path().join("jwks.json")
    }

    /// The `[remote]` section: plain HTTP on `127.0.0.1:0` (no `[remote.tls]`, as behind
    /// a reverse proxy), the four keys from the file, scope `mcp`, principal `alice` /
    /// `client-a`, default throttle (20 failures per 60 s per address).
    pub fn remote_config(&self, trusted_proxies: &[&str]) -> RemoteConfig {
        RemoteConfig {
            public_url: PUBLIC_URL.into(),
            jwks_file: Some(self.jwks_file().display().to_string()),
            trusted_proxies: (!trusted_proxies.is_empty())
                .then(|| trusted_proxies.iter().map(|s| s.to_string()).collect()),
            ..RemoteConfig::for_issuer(ISSUER, None)
        }
    }

    /// The throughput matrix's remote daemon: the remote carrier (and the harness's loopback carrier) with
    /// [`MATRIX_PER_ADDRESS`], [`MATRIX_PER_CALLER`] and extra environment variables.
    pub fn matrix_remote_daemon(&self, env: &[(String, String)]) -> Daemon {
        let config = self
            .remote_config(&[])
            .line(MATRIX_PER_ADDRESS)
            .line(MATRIX_PER_CALLER);
        with_env(config.builder().loopback(MATRIX_PER_CALLER), env).start()
    }

    /// The flood's remote daemon: the remote listener's defaults but [`MATRIX_PER_ADDRESS`]
    /// (the flood's 16 connections and the valid client's share 127.0.0.1; the per-address
    /// connection cap is not what the flood measures).
    pub fn flood_daemon(&self) -> Daemon {
        self.remote_config(&[])
            .line(MATRIX_PER_ADDRESS)
            .builder()
            .start()
    }

    /// `count` distinct forgeries ([`KeySet::bad_signature_token`]), minted on every CPU.
    pub fn bad_signature_tokens(&self, count: usize) -> Vec<HeaderValue> {
        mint(count, |n| bearer(&self.bad_signature_token(n)))
    }

    /// A valid access token signed by key `n % 4`, unique by its `jti`, valid for an hour.
    pub fn token(&self, n: usize) -> String {
        let key = &self.keys[n % self.keys.len()];
        TokenBuilder::new(key, ISSUER, PUBLIC_URL)
            .claim("exp", now_secs() + 3600)
            .claim("jti", format!("bench-{n}"))
            .build()
    }

    /// `count` valid tokens, minted on every CPU (the signing is the expensive part).
    pub fn tokens(&self, count: usize) -> Vec<HeaderValue> {
        mint(count, |n| bearer(&self.token(n)))
    }

    /// A token naming published key `es-1` but signed by the unpublished key: the daemon
    /// finds the key and does the whole signature check before refusing it
    /// (`bad-signature`), the most expensive refusal to provoke.
    pub fn bad_signature_token(&self, n: usize) -> String {
        TokenBuilder::new(&self.keys[0], ISSUER, PUBLIC_URL)
            .claim("exp", now_secs() + 3600)
            .claim("jti", format!("bad-{n}"))
            .signed_by(&self.rogue)
            .build()
    }
}

/// The directory of the end-to-end tests' authorization server (`tests/oidc`).
fn oidc_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map_or_else(|| PathBuf::from("."), Path::to_path_buf)
        .join("tests")
        .join("oidc")
}

/// The oidc-provider version `tests/oidc/package-lock.json` pins.
pub fn provider_version() -> Option<String> {
    let text = std::fs::read_to_string(oidc_dir().join("package-lock.json")).ok()?;
    let lock: serde_json::Value = serde_json::from_str(&text).ok()?;
    lock["packages"]["node_modules/oidc-provider"]["version"]
        .as_str()
        .map(str::to_owned)
}

/// Lifetime of the provider's access tokens: longer than any run, so that the cached
/// cells' answers are bounded by `cache`, not by the token's `exp`.
pub const OPAQUE_TOKEN_TTL_SECS: u64 = 4 * 3600;

/// Fails, with the command to run, when oidc-provider is not installed.
pub fn check_provider() -> Result<(), String> {
    let module = oidc_dir().join("node_modules/oidc-provider/package.json");
    if module.is_file() {
        return Ok(());
    }
    Err(format!(
        "the opaque-token cells need oidc-provider, which is not installed ({} is missing): run `npm ci --prefix tests/oidc`",
        module.display()
    ))
}

/// Starts the end-to-end tests' oidc-provider (Node, HTTPS, test CA), or says what is
/// missing.
pub fn start_provider() -> Result<Oidc, String> {
    check_provider()?;
    std::panic::catch_unwind(|| Oidc::start(OPAQUE_TOKEN_TTL_SECS)).map_err(|panic| {
        let why = panic
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| panic.downcast_ref::<&str>().copied())
            .unwrap_or("(no message)");
        format!(
            "oidc-provider did not start (is Node.js 20 or later installed, and did `npm ci --prefix tests/oidc` succeed?): {why}"
        )
    })
}

/// A daemon whose remote carrier trusts `oidc` (keys and introspection endpoint
/// discovered from its metadata, its test CA), scope `mcp`, the opaque client allowed,
/// opaque tokens checked at the introspection endpoint with answers cached `cache`.
pub fn opaque_daemon(oidc: &Oidc, cache: &str, env: &[(String, String)]) -> Daemon {
    let config = RemoteConfig {
        allowed_subjects: Vec::new(),
        allowed_clients: vec![OPAQUE_CLIENT.id.into()],
        lines: vec![MATRIX_PER_ADDRESS.into(), MATRIX_PER_CALLER.into()],
        ..RemoteConfig::for_issuer(oidc.issuer(), Some(&oidc.ca_file()))
    };
    let builder = config
        .builder()
        .extra(format!("\n{}", oidc.introspection_section(cache)));
    with_env(builder, env).start()
}

/// `count` opaque access tokens of [`OPAQUE_CLIENT`] (client credentials, scope `mcp`,
/// resource the opaque daemons' public URL), one token request each.
pub async fn opaque_tokens(oidc: &Oidc, count: usize) -> Result<Vec<HeaderValue>, String> {
    let mut out = Vec::with_capacity(count);
    for _ in 0..count {
        let token = oidc.token(OPAQUE_CLIENT, "mcp").await;
        if token.contains('.') {
            return Err(format!(
                "oidc-provider issued a JWT, not an opaque token, to {}",
                OPAQUE_CLIENT.id
            ));
        }
        out.push(bearer(&token));
    }
    Ok(out)
}

/// Introspection requests a daemon made, by outcome (its own counter).
pub fn introspections(d: &Daemon) -> Vec<(String, u64)> {
    let Some(text) = d.metrics_text() else {
        return Vec::new();
    };
    let name = "robota_mcpd_introspection_requests_total{";
    let mut out: Vec<(String, u64)> = text
        .lines()
        .filter(|l| l.starts_with(name))
        .filter_map(|l| {
            let outcome = l.split("outcome=\"").nth(1)?.split('"').next()?.to_owned();
            let value = l.rsplit(' ').next()?.parse::<f64>().ok()?;
            Some((outcome, value as u64))
        })
        .filter(|(_, n)| *n > 0)
        .collect();
    out.sort();
    out
}

/// `make(0..count)`, spread over every CPU, in order.
fn mint(count: usize, make: impl Fn(usize) -> HeaderValue + Sync) -> Vec<HeaderValue> {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let per = count.div_ceil(threads);
    let make = &make;
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                scope.spawn(move || {
                    (t * per..((t + 1) * per).min(count))
                        .map(make)
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().unwrap_or_else(|_| panic!("token minting thread")))
            .collect()
    })
}
