//! Test fixtures for the OAuth verifier: signing keys with their public JWKs, token
//! minting with arbitrary headers and claims, a verifier over a key file and its verdicts,
//! a manual clock, and a tiny HTTPS server on 127.0.0.1 with its own CA.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, LazyLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use jsonwebtoken::jwk::{AlgorithmParameters, Jwk};
use jsonwebtoken::{Algorithm, EncodingKey};
use parking_lot::Mutex;
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair, KeyUsagePurpose,
};
use rustls::pki_types::{PrivateKeyDer, PrivatePkcs8KeyDer};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::b64;
use super::jwt::{JwtConfig, JwtVerifier};
use super::token::SUPPORTED_ALGORITHMS;
use super::{Asker, Clock, Principal, Verifier};
use crate::config::KeySource;
use crate::metrics::Metrics;
use crate::vocab::Reason;

/// The verifiers' clock in tests (2027-01-15).
pub(crate) fn now() -> SystemTime {
    UNIX_EPOCH + Duration::from_secs(1_800_000_000)
}

pub(crate) fn unix(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).unwrap().as_secs()
}

pub(crate) const ISSUER: &str = "https://issuer.example";
pub(crate) const AUDIENCE: &str = "https://mcp.example/mcp";
pub(crate) const SCOPE: &str = "mcp:tools";

/// A signing key and its public JWK (with `kid`, without `alg`).
#[derive(Clone)]
pub(crate) struct TestKey {
    pub kid: String,
    pub alg: Algorithm,
    pub encoding: EncodingKey,
    pub jwk: Value,
    /// The public key as PEM (what an attacker would use as an HMAC secret).
    pub public_pem: String,
}

static RSA_PAIR: LazyLock<KeyPair> =
    LazyLock::new(|| KeyPair::generate_for(&rcgen::PKCS_RSA_SHA256).expect("RSA key"));

impl TestKey {
    /// A fresh key (RSA keys share one generated pair: generation is slow).
    pub fn new(alg: Algorithm, kid: &str) -> Self {
        let fresh;
        let pair = match alg {
            Algorithm::RS256 => &*RSA_PAIR,
            Algorithm::ES256 => {
                fresh = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap();
                &fresh
            }
            Algorithm::EdDSA => {
                fresh = KeyPair::generate_for(&rcgen::PKCS_ED25519).unwrap();
                &fresh
            }
            other => panic!("no test key for {other:?}"),
        };
        let pem = pair.serialize_pem();
        let raw = pair.public_key_raw();
        let (encoding, jwk) = match alg {
            Algorithm::RS256 => {
                let encoding = EncodingKey::from_rsa_pem(pem.as_bytes()).unwrap();
                let jwk = Jwk::from_encoding_key(&encoding, Algorithm::RS256).unwrap();
                let AlgorithmParameters::RSA(rsa) = jwk.algorithm else {
                    panic!("not an RSA JWK")
                };
                (encoding, json!({"kty": "RSA", "n": rsa.n, "e": rsa.e}))
            }
            Algorithm::ES256 => (
                EncodingKey::from_ec_pem(pem.as_bytes()).unwrap(),
                json!({"kty": "EC", "crv": "P-256",
                       "x": b64::encode(&raw[1..33]), "y": b64::encode(&raw[33..65])}),
            ),
            _ => (
                EncodingKey::from_ed_pem(pem.as_bytes()).unwrap(),
                json!({"kty": "OKP", "crv": "Ed25519", "x": b64::encode(raw)}),
            ),
        };
        let mut jwk = jwk;
        jwk["kid"] = json!(kid);
        Self {
            kid: kid.to_owned(),
            alg,
            encoding,
            jwk,
            public_pem: pair.public_key_pem(),
        }
    }

    /// The standard header: `alg`, `typ: at+jwt`, `kid`.
    pub fn header(&self) -> Value {
        json!({"alg": alg_name(self.alg), "typ": "at+jwt", "kid": self.kid})
    }

    /// A valid token for the standard test configuration.
    pub fn token(&self) -> String {
        self.sign(&self.header(), &claims())
    }

    pub fn sign(&self, header: &Value, claims: &Value) -> String {
        sign_with(&self.encoding, self.alg, header, claims)
    }
}

pub(crate) fn alg_name(alg: Algorithm) -> &'static str {
    match alg {
        Algorithm::RS256 => "RS256",
        Algorithm::ES256 => "ES256",
        Algorithm::EdDSA => "EdDSA",
        Algorithm::HS256 => "HS256",
        other => panic!("no name for {other:?}"),
    }
}

/// `base64url(header).base64url(claims).signature` with any header.
pub(crate) fn sign_with(
    key: &EncodingKey,
    alg: Algorithm,
    header: &Value,
    claims: &Value,
) -> String {
    let message = unsigned(header, claims);
    let signature = jsonwebtoken::crypto::sign(message.as_bytes(), key, alg).unwrap();
    format!("{message}.{signature}")
}

/// `base64url(header).base64url(claims)`.
pub(crate) fn unsigned(header: &Value, claims: &Value) -> String {
    format!(
        "{}.{}",
        b64::encode(&serde_json::to_vec(header).unwrap()),
        b64::encode(&serde_json::to_vec(claims).unwrap())
    )
}

/// Claims the standard configuration accepts (subject `alice`).
pub(crate) fn claims() -> Value {
    json!({
        "iss": ISSUER,
        "aud": AUDIENCE,
        "exp": unix(now()) + 300,
        "iat": unix(now()) - 10,
        "nbf": unix(now()) - 10,
        "sub": "alice",
        "client_id": "client-a",
        "scope": format!("{SCOPE} other"),
        "jti": "t-1",
    })
}

/// `{"keys": [...]}` of the keys' JWKs.
pub(crate) fn jwks(keys: &[&TestKey]) -> String {
    json!({"keys": keys.iter().map(|k| k.jwk.clone()).collect::<Vec<_>>()}).to_string()
}

/// The standard configuration: all three algorithms, audience [`AUDIENCE`], scope
/// [`SCOPE`], subject `alice` or client `client-b` allowed.
pub(crate) fn config(issuer: &str, keys: KeySource, dir: &Path) -> JwtConfig {
    JwtConfig {
        issuer: issuer.to_owned(),
        audiences: vec![AUDIENCE.to_owned()],
        algorithms: SUPPORTED_ALGORITHMS.to_vec(),
        required_scopes: vec![SCOPE.to_owned()],
        allowed_subjects: vec!["alice".to_owned()],
        allowed_clients: vec!["client-b".to_owned()],
        keys,
        ca_file: None,
        cache_path: dir.join("jwks-cache.json"),
        start_without_keys: false,
        refresh: crate::config::KeyRefresh::DEFAULT,
        introspection: None,
    }
}

/// Write `body` to `dir/name`; return the path.
pub(crate) fn write(dir: &Path, name: &str, body: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, body).unwrap();
    path
}

pub(crate) fn build(config: JwtConfig) -> JwtVerifier {
    JwtVerifier::build(config, Metrics::new()).expect("verifier builds")
}

/// A verifier over a local JWKS file holding `keys`, loaded.
pub(crate) async fn file_verifier(dir: &std::path::Path, keys: &[&TestKey]) -> JwtVerifier {
    let path = write(dir, "jwks.json", &jwks(keys));
    let v = build(config(ISSUER, KeySource::JwksFile(path), dir));
    v.load().await.expect("keys load");
    v
}

pub(crate) async fn verdict(v: &JwtVerifier, token: &str) -> Result<Principal, Reason> {
    v.verify(token, now(), Asker::anyone()).await
}

/// A client over its failure budget, still allowed to have tokens introspected.
pub(crate) fn suspect() -> Asker<'static> {
    Asker {
        suspect: true,
        ..Asker::anyone()
    }
}

/// `claims()` with `changes` applied (`null` removes a claim).
pub(crate) fn with(changes: Value) -> Value {
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

pub(crate) fn testutil_b64(bytes: &[u8]) -> String {
    crate::oauth::b64::encode(bytes)
}

/// A monotonic clock the test moves by hand.
#[derive(Clone)]
pub(crate) struct ManualClock(Arc<Mutex<Instant>>);

impl ManualClock {
    pub fn new() -> Self {
        Self(Arc::new(Mutex::new(Instant::now())))
    }

    pub fn advance(&self, by: Duration) {
        *self.0.lock() += by;
    }

    pub fn clock(&self) -> Clock {
        let at = self.0.clone();
        Arc::new(move || *at.lock())
    }
}

/// One canned answer of the test server.
#[derive(Clone, Debug)]
pub(crate) struct Route {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
    /// Send `Content-Length` (else the body ends when the connection closes).
    pub content_length: bool,
    /// Read the request, then never answer (a stalled issuer).
    pub hang: bool,
    /// Read the request, then wait this long before answering (a slow issuer).
    pub delay: Duration,
}

impl Route {
    pub fn json(body: impl Into<String>) -> Self {
        Self {
            status: 200,
            headers: vec![("Content-Type".into(), "application/json".into())],
            body: body.into().into_bytes(),
            content_length: true,
            hang: false,
            delay: Duration::ZERO,
        }
    }

    /// Never answers.
    pub fn hang() -> Self {
        Self {
            hang: true,
            ..Self::status(200)
        }
    }

    /// Answered after `delay`.
    pub fn after(self, delay: Duration) -> Self {
        Self { delay, ..self }
    }

    /// With one more response header.
    pub fn with_header(mut self, name: &str, value: &str) -> Self {
        self.headers.push((name.to_owned(), value.to_owned()));
        self
    }

    pub fn status(status: u16) -> Self {
        Self {
            status,
            headers: Vec::new(),
            body: Vec::new(),
            content_length: true,
            hang: false,
            delay: Duration::ZERO,
        }
    }
}

/// An HTTPS server on 127.0.0.1 answering GETs from a route table, counting requests per
/// path. Its certificate chains to a CA written to `ca_file`.
pub(crate) struct TestServer {
    pub addr: SocketAddr,
    pub ca_file: PathBuf,
    routes: Arc<Mutex<HashMap<String, Route>>>,
    hits: Arc<Mutex<HashMap<String, usize>>>,
    /// Every request as received (head and body), by path.
    requests: Arc<Mutex<HashMap<String, Vec<String>>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for TestServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl TestServer {
    pub async fn start(dir: &Path) -> Self {
        let ca_key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap();
        let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        ca_params
            .distinguished_name
            .push(DnType::CommonName, "robota-mcpd test CA");
        let ca = CertifiedIssuer::self_signed(ca_params, ca_key).unwrap();
        let leaf_key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap();
        let leaf_params =
            CertificateParams::new(vec!["127.0.0.1".to_owned(), "localhost".to_owned()]).unwrap();
        let leaf = leaf_params.signed_by(&leaf_key, &ca).unwrap();
        let ca_file = write(dir, "ca.pem", &ca.pem());

        let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
        let tls = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(
                vec![leaf.der().clone()],
                PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(leaf_key.serialize_der())),
            )
            .unwrap();
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(tls));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let routes: Arc<Mutex<HashMap<String, Route>>> = Arc::default();
        let hits: Arc<Mutex<HashMap<String, usize>>> = Arc::default();
        let requests: Arc<Mutex<HashMap<String, Vec<String>>>> = Arc::default();
        let (r, h, q) = (routes.clone(), hits.clone(), requests.clone());
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let (acceptor, r, h, q) = (acceptor.clone(), r.clone(), h.clone(), q.clone());
                tokio::spawn(async move {
                    let _ = serve(stream, acceptor, r, h, q).await;
                });
            }
        });
        Self {
            addr,
            ca_file,
            routes,
            hits,
            requests,
            task,
        }
    }

    /// `https://127.0.0.1:<port><path>`.
    pub fn url(&self, path: &str) -> String {
        format!("https://{}{path}", self.addr)
    }

    pub fn route(&self, path: &str, route: Route) {
        self.routes.lock().insert(path.to_owned(), route);
    }

    pub fn hits(&self, path: &str) -> usize {
        self.hits.lock().get(path).copied().unwrap_or(0)
    }

    pub fn total_hits(&self) -> usize {
        self.hits.lock().values().sum()
    }

    /// The requests to `path` so far, each as its head and body.
    pub fn requests(&self, path: &str) -> Vec<String> {
        self.requests.lock().get(path).cloned().unwrap_or_default()
    }
}

async fn serve(
    stream: tokio::net::TcpStream,
    acceptor: tokio_rustls::TlsAcceptor,
    routes: Arc<Mutex<HashMap<String, Route>>>,
    hits: Arc<Mutex<HashMap<String, usize>>>,
    requests: Arc<Mutex<HashMap<String, Vec<String>>>>,
) -> std::io::Result<()> {
    let mut tls = acceptor.accept(stream).await?;
    let mut head = Vec::new();
    let mut buf = [0u8; 2048];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = tls.read(&mut buf).await?;
        if n == 0 || head.len() > 16 * 1024 {
            return Ok(());
        }
        head.extend_from_slice(&buf[..n]);
    }
    // The body, as far as `Content-Length` says.
    let end = head.windows(4).position(|w| w == b"\r\n\r\n").unwrap_or(0) + 4;
    let declared = String::from_utf8_lossy(&head[..end])
        .lines()
        .find_map(|l| {
            let (name, value) = l.split_once(':')?;
            name.eq_ignore_ascii_case("content-length")
                .then(|| value.trim().parse::<usize>().ok())?
        })
        .unwrap_or(0)
        .min(64 * 1024);
    while head.len() < end + declared {
        let n = tls.read(&mut buf).await?;
        if n == 0 {
            break;
        }
        head.extend_from_slice(&buf[..n]);
    }
    let head = String::from_utf8_lossy(&head).into_owned();
    let path = head.split(' ').nth(1).unwrap_or("").to_owned();
    *hits.lock().entry(path.clone()).or_default() += 1;
    requests
        .lock()
        .entry(path.clone())
        .or_default()
        .push(head.clone());
    let route = routes
        .lock()
        .get(&path)
        .cloned()
        .unwrap_or_else(|| Route::status(404));
    if route.hang {
        std::future::pending::<()>().await;
    }
    tokio::time::sleep(route.delay).await;
    let mut out = format!("HTTP/1.1 {} Test\r\nConnection: close\r\n", route.status);
    for (name, value) in &route.headers {
        out.push_str(&format!("{name}: {value}\r\n"));
    }
    if route.content_length {
        out.push_str(&format!("Content-Length: {}\r\n", route.body.len()));
    }
    out.push_str("\r\n");
    tls.write_all(out.as_bytes()).await?;
    tls.write_all(&route.body).await?;
    tls.shutdown().await
}
