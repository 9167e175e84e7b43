//! Admission cost per request, loopback next to remote, printed side by side.

//!
//! `cargo bench -p robota-mcpd --bench admission` (release build). Measures the work each
//! carrier does on a request head before anything reaches the session:
//! - loopback: `admit` (path, Host, Origin, bearer parse) + the constant-time bearer check;
//! - remote: `route` + `credentials` + `decide` around a real `JwtVerifier` holding four
//!   ES256 keys, with the verified-token cache hit (cached) and with a fresh token per
//!   iteration so every call does the signature check (uncached).

// A benchmark's output is its report.
#![allow(clippy::print_stdout)]

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use http::{HeaderMap, HeaderValue, Uri};
use robota_mcpd::bearer::BearerStore;
use robota_mcpd::carrier::loopback::admission::{self as loopback, Expected};
use robota_mcpd::carrier::remote::admission::{self as remote, Challenges, Credentials, Failure};
use robota_mcpd::config::{KeySource, PublicUrl};
use robota_mcpd::metrics::Metrics;
use robota_mcpd::oauth::jwt::{JwtConfig, JwtVerifier};
use robota_mcpd::oauth::{Asker, Verifier};

const PUBLIC: &str = "https://mcp.example.com/mcp";
const ISSUER: &str = "https://auth.example.com";

fn b64url(bytes: &[u8]) -> String {
    const T: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let n =
            chunk.iter().fold(0u32, |acc, b| (acc << 8) | u32::from(*b)) << (8 * (3 - chunk.len()));
        for i in 0..=chunk.len() {
            out.push(T[((n >> (18 - 6 * i)) & 63) as usize] as char);
        }
    }
    out
}

struct Key {
    kid: String,
    encoding: jsonwebtoken::EncodingKey,
    jwk: serde_json::Value,
}

fn es256_key(kid: &str) -> Key {
    let pair = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).expect("P-256 key");
    let raw = pair.public_key_raw();
    let (x, y) = raw[1..].split_at(32);
    Key {
        kid: kid.into(),
        encoding: jsonwebtoken::EncodingKey::from_ec_pem(pair.serialize_pem().as_bytes())
            .expect("PEM"),
        jwk: serde_json::json!({"kty": "EC", "crv": "P-256", "alg": "ES256", "use": "sig", "kid": kid, "x": b64url(x), "y": b64url(y)}),
    }
}

fn token(key: &Key, jti: u64) -> String {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let mut header = jsonwebtoken::Header::new(jsonwebtoken::Algorithm::ES256);
    header.typ = Some("at+jwt".into());
    header.kid = Some(key.kid.clone());
    let claims = serde_json::json!({
        "iss": ISSUER, "aud": PUBLIC, "sub": "alice", "client_id": "client-a",
        "scope": "mcp", "exp": now + 3600, "iat": now, "jti": jti,
    });
    jsonwebtoken::encode(&header, &claims, &key.encoding).expect("sign")
}

/// Nanoseconds per iteration of `f`, the best of five runs of `n`.
fn time(n: u32, mut f: impl FnMut(u32)) -> f64 {
    let mut best = f64::MAX;
    for _ in 0..5 {
        let start = Instant::now();
        for i in 0..n {
            f(i);
        }
        best = best.min(start.elapsed().as_nanos() as f64 / f64::from(n));
    }
    best
}

fn main() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();

    // Loopback.
    let bearers = BearerStore::new();
    let secret = bearers.host_secret();
    let expected = Expected::new("/mcp", 8765);
    let uri: Uri = "/mcp".parse().unwrap();
    let mut lh = HeaderMap::new();
    lh.insert("host", HeaderValue::from_static("127.0.0.1:8765"));
    lh.insert(
        "authorization",
        HeaderValue::from_str(&format!("Bearer {secret}")).unwrap(),
    );
    let loopback_ns = time(200_000, |_| {
        let now = SystemTime::now();
        black_box(loopback::admit(&uri, &lh, &expected, |t| bearers.check(t, now)).unwrap());
    });

    // Remote: four ES256 keys in a key file, a real verifier.
    let dir = tempfile::tempdir().unwrap();
    let keys: Vec<Key> = (0..4).map(|i| es256_key(&format!("k{i}"))).collect();
    let jwks = serde_json::json!({"keys": keys.iter().map(|k| k.jwk.clone()).collect::<Vec<_>>()});
    let jwks_path = dir.path().join("jwks.json");
    std::fs::write(&jwks_path, jwks.to_string()).unwrap();
    let verifier = JwtVerifier::build(
        JwtConfig {
            issuer: ISSUER.into(),
            audiences: vec![PUBLIC.into()],
            algorithms: vec![jsonwebtoken::Algorithm::ES256],
            required_scopes: vec!["mcp".into()],
            allowed_subjects: vec!["alice".into()],
            allowed_clients: vec![],
            keys: KeySource::JwksFile(jwks_path),
            ca_file: None,
            cache_path: dir.path().join("jwks-cache.json"),
            start_without_keys: false,
            refresh: robota_mcpd::config::KeyRefresh::DEFAULT,
            introspection: None,
        },
        Metrics::new(),
    )
    .expect("verifier");
    rt.block_on(verifier.load()).expect("keys");
    let verifier: Arc<dyn Verifier> = Arc::new(verifier);
    let url = PublicUrl::parse(PUBLIC).unwrap();
    let challenges = Challenges {
        metadata_url: url.metadata_url(),
        scope: "mcp".into(),
    };
    let ruri: Uri = "/mcp".parse().unwrap();
    let admit = |headers: &HeaderMap| {
        remote::route(&ruri, headers, &url).unwrap();
        let outcome = match remote::credentials(headers) {
            Credentials::Token(t) => rt
                .block_on(verifier.verify(t, SystemTime::now(), Asker::anyone()))
                .map_err(Failure::Token),
            _ => Err(Failure::Missing),
        };
        black_box(remote::decide(outcome, || None, &challenges).expect("admitted"));
    };
    let remote_headers = |token: &str| {
        let mut h = HeaderMap::new();
        h.insert("host", HeaderValue::from_static("mcp.example.com"));
        h.insert(
            "authorization",
            HeaderValue::from_str(&format!("Bearer {token}")).unwrap(),
        );
        h
    };
    let cached = remote_headers(&token(&keys[3], 0));
    admit(&cached);
    let cached_ns = time(200_000, |_| admit(&cached));
    // Every token is new, so each call verifies a signature (one pass: a second would hit
    // the cache).
    let start = Instant::now();
    let more: Vec<HeaderMap> = (0..2_000u64)
        .map(|i| remote_headers(&token(&keys[(i % 4) as usize], 10_000 + i)))
        .collect();
    let sign_ns = start.elapsed().as_nanos() as f64 / 2_000.0;
    let start = Instant::now();
    for h in &more {
        admit(h);
    }
    let uncached_first_ns = start.elapsed().as_nanos() as f64 / 2_000.0;

    println!("admission cost per request (release, best of 5 unless noted)");
    println!(
        "  loopback (head checks + bearer digest compare) {:>10.0} ns   1.00x",
        loopback_ns
    );
    println!(
        "  remote, verified-token cache hit               {:>10.0} ns {:>6.2}x",
        cached_ns,
        cached_ns / loopback_ns
    );
    println!(
        "  remote, uncached ES256 verify (4-key set)      {:>10.0} ns {:>6.2}x",
        uncached_first_ns,
        uncached_first_ns / loopback_ns
    );
    println!(
        "  (for scale: signing one ES256 token here        {:>10.0} ns)",
        sign_ns
    );
}
