//! A test OAuth authorization server, in the test process: a private CA, an HTTPS listener
//! on `127.0.0.1:0` serving RFC 8414 (and optionally OIDC) discovery and a JWKS, signing
//! keys for RS256, ES256 and EdDSA, and a JWT access-token minting helper whose every part
//! can be overridden (header and claims members, raw header/claims JSON, the signature).
//!
//! Controls: publish, withdraw and rotate keys; count requests per path (the daemon's JWKS
//! fetches); go down (close the listener and every open connection) and come back on the
//! same port; hang (accept, never answer); serve a raw JWKS body instead of the key set;
//! send a `Cache-Control` header with the JWKS.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use bytes::Bytes;
use http_body_util::Full;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use jsonwebtoken::{Algorithm, EncodingKey};
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair, KeyUsagePurpose,
};
use serde_json::{Map, Value, json};
use tempfile::TempDir;
use tokio::net::TcpListener;
use tokio::task::{JoinHandle, JoinSet};
use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::pem::PemObject;

/// base64url without padding, as JWS wants it.
pub fn b64(bytes: impl AsRef<[u8]>) -> String {
    URL_SAFE_NO_PAD.encode(bytes)
}

/// Unix seconds now.
pub fn now_secs() -> i64 {
    i64::try_from(
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .expect("clock after 1970")
            .as_secs(),
    )
    .expect("seconds fit i64")
}

fn rustls_provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::aws_lc_rs::default_provider())
}

/// A private certificate authority issuing server certificates for the tests.
pub struct TestCa {
    issuer: CertifiedIssuer<'static, KeyPair>,
}

impl TestCa {
    pub fn new() -> TestCa {
        let key = KeyPair::generate().expect("CA key");
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
        params
            .distinguished_name
            .push(DnType::CommonName, "robota-e2e test CA");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let issuer = CertifiedIssuer::self_signed(params, key).expect("self-signed CA");
        TestCa { issuer }
    }

    /// The CA certificate, PEM.
    pub fn pem(&self) -> String {
        self.issuer.pem()
    }

    /// A leaf certificate for `names` (IP addresses or DNS names): (cert PEM, key PEM).
    pub fn leaf(&self, names: &[&str]) -> (String, String) {
        let key = KeyPair::generate().expect("leaf key");
        let mut params =
            CertificateParams::new(names.iter().map(|s| s.to_string()).collect::<Vec<_>>())
                .expect("leaf params");
        params
            .distinguished_name
            .push(DnType::CommonName, names.first().copied().unwrap_or("leaf"));
        let cert = params.signed_by(&key, &self.issuer).expect("sign leaf");
        (cert.pem(), key.serialize_pem())
    }

    /// A rustls server config presenting a leaf for `names`.
    pub fn server_config(&self, names: &[&str], alpn: &[&[u8]]) -> Arc<rustls::ServerConfig> {
        let (cert_pem, key_pem) = self.leaf(names);
        let cert = rustls::pki_types::CertificateDer::from_pem_slice(cert_pem.as_bytes())
            .expect("leaf cert DER");
        let key = rustls::pki_types::PrivateKeyDer::from_pem_slice(key_pem.as_bytes())
            .expect("leaf key DER");
        let mut config = rustls::ServerConfig::builder_with_provider(rustls_provider())
            .with_safe_default_protocol_versions()
            .expect("protocol versions")
            .with_no_client_auth()
            .with_single_cert(vec![cert], key)
            .expect("server config");
        config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
        Arc::new(config)
    }

    /// A rustls client config trusting only this CA.
    pub fn client_config(&self) -> Arc<rustls::ClientConfig> {
        let mut roots = rustls::RootCertStore::empty();
        roots
            .add(self.issuer.der().clone())
            .expect("CA into root store");
        Arc::new(
            rustls::ClientConfig::builder_with_provider(rustls_provider())
                .with_safe_default_protocol_versions()
                .expect("protocol versions")
                .with_root_certificates(roots)
                .with_no_client_auth(),
        )
    }
}

impl Default for TestCa {
    fn default() -> Self {
        TestCa::new()
    }
}

/// One signing key with its public JWK.
pub struct SigningKey {
    pub kid: String,
    pub alg: Algorithm,
    encoding: EncodingKey,
    public_pem: String,
    public_jwk: Value,
}

impl std::fmt::Debug for SigningKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SigningKey")
            .field("kid", &self.kid)
            .field("alg", &self.alg)
            .finish_non_exhaustive()
    }
}

impl SigningKey {
    /// A fresh key for `alg` (RS256, ES256 or EdDSA) named `kid`.
    pub fn generate(alg: Algorithm, kid: &str) -> Arc<SigningKey> {
        let (kp, encoding) = match alg {
            Algorithm::RS256 => {
                let kp = KeyPair::generate_for(&rcgen::PKCS_RSA_SHA256).expect("RSA key");
                let enc = EncodingKey::from_rsa_pem(kp.serialize_pem().as_bytes())
                    .expect("RSA encoding key");
                (kp, enc)
            }
            Algorithm::ES256 => {
                let kp = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).expect("EC key");
                let enc = EncodingKey::from_ec_pem(kp.serialize_pem().as_bytes())
                    .expect("EC encoding key");
                (kp, enc)
            }
            Algorithm::EdDSA => {
                let kp = KeyPair::generate_for(&rcgen::PKCS_ED25519).expect("Ed25519 key");
                let enc = EncodingKey::from_ed_pem(kp.serialize_pem().as_bytes())
                    .expect("Ed25519 encoding key");
                (kp, enc)
            }
            other => panic!("the test authorization server signs RS256/ES256/EdDSA, not {other:?}"),
        };
        let raw = kp.public_key_raw();
        let mut jwk = match alg {
            Algorithm::RS256 => {
                let j = jsonwebtoken::jwk::Jwk::from_encoding_key(&encoding, alg)
                    .expect("RSA public JWK");
                let v = serde_json::to_value(&j).expect("JWK JSON");
                json!({"kty": "RSA", "n": v["n"], "e": v["e"]})
            }
            Algorithm::ES256 => {
                assert_eq!(raw.len(), 65, "uncompressed P-256 point");
                assert_eq!(raw[0], 4, "uncompressed P-256 point");
                json!({"kty": "EC", "crv": "P-256", "x": b64(&raw[1..33]), "y": b64(&raw[33..])})
            }
            _ => {
                assert_eq!(raw.len(), 32, "Ed25519 public key");
                json!({"kty": "OKP", "crv": "Ed25519", "x": b64(raw)})
            }
        };
        let alg_name = alg_name(alg);
        let obj = jwk.as_object_mut().expect("object");
        obj.insert("kid".into(), Value::from(kid));
        obj.insert("use".into(), Value::from("sig"));
        obj.insert("alg".into(), Value::from(alg_name));
        Arc::new(SigningKey {
            kid: kid.to_owned(),
            alg,
            encoding,
            public_pem: kp.public_key_pem(),
            public_jwk: jwk,
        })
    }

    /// The public JWK (`kty`, key material, `kid`, `use: sig`, `alg`).
    pub fn jwk(&self) -> Value {
        self.public_jwk.clone()
    }

    /// The public key as a SubjectPublicKeyInfo PEM (what an algorithm-confusion attacker
    /// uses as an HMAC secret).
    pub fn public_pem(&self) -> &str {
        &self.public_pem
    }

    /// Signs `message` with this key under `alg`.
    pub fn sign(&self, message: &[u8], alg: Algorithm) -> String {
        jsonwebtoken::crypto::sign(message, &self.encoding, alg)
            .unwrap_or_else(|e| panic!("sign with {} as {alg:?}: {e}", self.kid))
    }
}

/// The JOSE name of an algorithm.
pub fn alg_name(alg: Algorithm) -> String {
    match serde_json::to_value(alg) {
        Ok(Value::String(s)) => s,
        other => panic!("algorithm {alg:?} serialized as {other:?}"),
    }
}

/// How a minted token is signed.
#[derive(Clone)]
enum Signing {
    /// With `key` under `alg` (normally the key's own algorithm).
    Key(Arc<SigningKey>, Algorithm),
    /// HMAC with `secret` under `alg` (HS256/384/512).
    Hmac(Vec<u8>, Algorithm),
    /// The given signature segment, verbatim (empty for `alg: none`).
    Raw(String),
}

/// Builds one JWT. Defaults: `typ: at+jwt`, the key's `alg` and `kid`; `iss` the issuer,
/// `aud` the given audience, `sub: alice`, `client_id: client-a`, `scope: mcp`, `iat` and
/// `nbf` now, `exp` in five minutes.
#[derive(Clone)]
pub struct TokenBuilder {
    header: Map<String, Value>,
    claims: Map<String, Value>,
    raw_header: Option<Vec<u8>>,
    raw_claims: Option<Vec<u8>>,
    signing: Signing,
}

impl TokenBuilder {
    pub fn new(key: &Arc<SigningKey>, issuer: &str, audience: &str) -> TokenBuilder {
        let now = now_secs();
        let mut header = Map::new();
        header.insert("typ".into(), Value::from("at+jwt"));
        header.insert("alg".into(), Value::from(alg_name(key.alg)));
        header.insert("kid".into(), Value::from(key.kid.as_str()));
        let mut claims = Map::new();
        claims.insert("iss".into(), Value::from(issuer));
        claims.insert("aud".into(), Value::from(audience));
        claims.insert("exp".into(), Value::from(now + 300));
        claims.insert("nbf".into(), Value::from(now));
        claims.insert("iat".into(), Value::from(now));
        claims.insert("sub".into(), Value::from("alice"));
        claims.insert("client_id".into(), Value::from("client-a"));
        claims.insert("scope".into(), Value::from("mcp"));
        TokenBuilder {
            header,
            claims,
            raw_header: None,
            raw_claims: None,
            signing: Signing::Key(key.clone(), key.alg),
        }
    }

    /// Sets (or replaces) a header member.
    pub fn header(mut self, name: &str, value: impl Into<Value>) -> Self {
        self.header.insert(name.into(), value.into());
        self
    }

    /// Removes a header member.
    pub fn no_header(mut self, name: &str) -> Self {
        self.header.remove(name);
        self
    }

    /// Sets (or replaces) a claim.
    pub fn claim(mut self, name: &str, value: impl Into<Value>) -> Self {
        self.claims.insert(name.into(), value.into());
        self
    }

    /// Removes a claim.
    pub fn no_claim(mut self, name: &str) -> Self {
        self.claims.remove(name);
        self
    }

    /// The header segment's JSON text, verbatim (replaces the header members).
    pub fn raw_header(mut self, text: impl AsRef<[u8]>) -> Self {
        self.raw_header = Some(text.as_ref().to_vec());
        self
    }

    /// The claims segment's JSON text, verbatim (replaces the claims).
    pub fn raw_claims(mut self, text: impl AsRef<[u8]>) -> Self {
        self.raw_claims = Some(text.as_ref().to_vec());
        self
    }

    /// Signs with `key` under its own algorithm; the header is left as it is.
    pub fn signed_by(mut self, key: &Arc<SigningKey>) -> Self {
        self.signing = Signing::Key(key.clone(), key.alg);
        self
    }

    /// Signs with `key` under `alg`; the header is left as it is.
    pub fn signed_by_as(mut self, key: &Arc<SigningKey>, alg: Algorithm) -> Self {
        self.signing = Signing::Key(key.clone(), alg);
        self
    }

    /// Signs with HMAC `secret` under `alg`; the header is left as it is.
    pub fn hmac(mut self, secret: impl AsRef<[u8]>, alg: Algorithm) -> Self {
        self.signing = Signing::Hmac(secret.as_ref().to_vec(), alg);
        self
    }

    /// Uses `sig` verbatim as the signature segment (`""` for an unsigned token).
    pub fn raw_signature(mut self, sig: &str) -> Self {
        self.signing = Signing::Raw(sig.into());
        self
    }

    /// The header JSON text that [`TokenBuilder::build`] encodes.
    pub fn header_json(&self) -> Vec<u8> {
        self.raw_header
            .clone()
            .unwrap_or_else(|| serde_json::to_vec(&self.header).expect("header JSON"))
    }

    /// The claims JSON text that [`TokenBuilder::build`] encodes.
    pub fn claims_json(&self) -> Vec<u8> {
        self.raw_claims
            .clone()
            .unwrap_or_else(|| serde_json::to_vec(&self.claims).expect("claims JSON"))
    }

    /// The compact JWS `header.claims.signature`.
    pub fn build(&self) -> String {
        let signing_input = format!("{}.{}", b64(self.header_json()), b64(self.claims_json()));
        let sig = match &self.signing {
            Signing::Key(key, alg) => key.sign(signing_input.as_bytes(), *alg),
            Signing::Hmac(secret, alg) => jsonwebtoken::crypto::sign(
                signing_input.as_bytes(),
                &EncodingKey::from_secret(secret).expect("HMAC key"),
                *alg,
            )
            .expect("HMAC sign"),
            Signing::Raw(sig) => sig.clone(),
        };
        format!("{signing_input}.{sig}")
    }

    /// A valid-looking token of exactly `len` bytes: pads a `pad` claim and, where base64
    /// lengths leave a gap, the header JSON with insignificant whitespace.
    pub fn build_with_len(&self, len: usize) -> String {
        for header_spaces in 0..4 {
            let mut header = self.header_json();
            let close = header.pop().expect("header JSON ends with }");
            header.extend(std::iter::repeat_n(b' ', header_spaces));
            header.push(close);
            let base = self.clone().raw_header(&header);
            let probe = base.clone().claim("pad", "").build();
            if probe.len() > len {
                break;
            }
            // Each pad byte adds 4/3 characters; search around the estimate.
            let estimate = (len - probe.len()) * 3 / 4;
            for pad in estimate.saturating_sub(4)..=estimate + 4 {
                let t = base.clone().claim("pad", "p".repeat(pad)).build();
                if t.len() == len {
                    return t;
                }
            }
        }
        panic!("no token of exactly {len} bytes could be built");
    }
}

/// What `/.well-known/*` answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Discovery {
    /// RFC 8414 `/.well-known/oauth-authorization-server` only.
    Rfc8414,
    /// OpenID `/.well-known/openid-configuration` only (RFC 8414 path → 404).
    OidcOnly,
}

#[derive(Default)]
struct State {
    /// Keys published in the JWKS, in order.
    published: Vec<Arc<SigningKey>>,
    /// Extra raw JWK objects published after the keys (e.g. an `oct` key).
    extra_jwks: Vec<Value>,
    /// A raw body served at the JWKS path instead of the key set.
    jwks_body: Option<Vec<u8>>,
    /// `Cache-Control` sent with the JWKS.
    jwks_cache_control: Option<String>,
    /// Requests per path (query included).
    hits: BTreeMap<String, usize>,
    hang: bool,
}

struct Shared {
    issuer: String,
    discovery: Discovery,
    state: Mutex<State>,
}

/// The HTTPS authorization server, on a runtime of its own (tests may block their own
/// threads freely while the daemon fetches from it). Dropping it closes the listener.
pub struct Authz {
    addr: SocketAddr,
    shared: Arc<Shared>,
    tls: Arc<rustls::ServerConfig>,
    ca: TestCa,
    ca_file: PathBuf,
    _dir: TempDir,
    rt: Option<tokio::runtime::Runtime>,
    server: Mutex<Option<JoinHandle<()>>>,
}

/// Path of the JWKS.
pub const JWKS_PATH: &str = "/jwks";
/// Path of RFC 8414 metadata.
pub const RFC8414_PATH: &str = "/.well-known/oauth-authorization-server";
/// Path of OpenID discovery.
pub const OIDC_PATH: &str = "/.well-known/openid-configuration";

/// Binds `addr` with SO_REUSEADDR (so that the port can be taken again right after the
/// server went down) inside the server's runtime.
fn bind_on(rt: &tokio::runtime::Runtime, addr: SocketAddr) -> std::io::Result<TcpListener> {
    let (tx, rx) = std::sync::mpsc::channel();
    rt.spawn(async move {
        let bound = (|| {
            let sock = tokio::net::TcpSocket::new_v4()?;
            sock.set_reuseaddr(true)?;
            sock.bind(addr)?;
            sock.listen(1024)
        })();
        let _ = tx.send(bound);
    });
    rx.recv_timeout(Duration::from_secs(10))
        .unwrap_or_else(|e| panic!("authz runtime did not bind {addr}: {e}"))
}

impl Authz {
    /// Starts a server with RFC 8414 discovery and no keys.
    pub fn start() -> Authz {
        Authz::start_with(Discovery::Rfc8414)
    }

    pub fn start_with(discovery: Discovery) -> Authz {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("authz-e2e")
            .enable_all()
            .build()
            .expect("authz runtime");
        let ca = TestCa::new();
        let dir = tempfile::Builder::new()
            .prefix("authz-e2e-")
            .tempdir()
            .expect("tempdir");
        let ca_file = dir.path().join("ca.pem");
        std::fs::write(&ca_file, ca.pem()).expect("write CA PEM");
        let tls = ca.server_config(&["127.0.0.1", "localhost"], &[b"http/1.1"]);
        let listener = bind_on(&rt, "127.0.0.1:0".parse().expect("addr")).expect("bind authz");
        let addr = listener.local_addr().expect("authz local_addr");
        let shared = Arc::new(Shared {
            issuer: format!("https://127.0.0.1:{}", addr.port()),
            discovery,
            state: Mutex::new(State::default()),
        });
        let server = rt.spawn(serve(
            listener,
            TlsAcceptor::from(tls.clone()),
            shared.clone(),
        ));
        Authz {
            addr,
            shared,
            tls,
            ca,
            ca_file,
            _dir: dir,
            rt: Some(rt),
            server: Mutex::new(Some(server)),
        }
    }

    /// Starts a server publishing fresh keys `rsa-1` (RS256), `ec-1` (ES256), `ed-1` (EdDSA).
    pub fn with_standard_keys() -> (Authz, StandardKeys) {
        let a = Authz::start();
        let keys = StandardKeys {
            rsa: SigningKey::generate(Algorithm::RS256, "rsa-1"),
            ec: SigningKey::generate(Algorithm::ES256, "ec-1"),
            ed: SigningKey::generate(Algorithm::EdDSA, "ed-1"),
        };
        a.publish(&keys.rsa);
        a.publish(&keys.ec);
        a.publish(&keys.ed);
        (a, keys)
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `https://127.0.0.1:<port>`.
    pub fn issuer(&self) -> &str {
        &self.shared.issuer
    }

    /// `https://127.0.0.1:<port>/jwks`.
    pub fn jwks_uri(&self) -> String {
        format!("{}{JWKS_PATH}", self.shared.issuer)
    }

    /// The CA certificate file the daemon trusts (`ca_file`).
    pub fn ca_file(&self) -> &Path {
        &self.ca_file
    }

    pub fn ca(&self) -> &TestCa {
        &self.ca
    }

    /// Adds `key` to the published key set (replacing a key with the same `kid`).
    pub fn publish(&self, key: &Arc<SigningKey>) {
        let mut st = self.lock();
        st.published.retain(|k| k.kid != key.kid);
        st.published.push(key.clone());
    }

    /// Removes the key named `kid` from the published key set.
    pub fn withdraw(&self, kid: &str) {
        self.lock().published.retain(|k| k.kid != kid);
    }

    /// Replaces the published key set by `keys`.
    pub fn rotate_to(&self, keys: &[&Arc<SigningKey>]) {
        self.lock().published = keys.iter().map(|k| (*k).clone()).collect();
    }

    /// Publishes a raw JWK object after the keys (e.g. `{"kty":"oct",…}`).
    pub fn publish_raw_jwk(&self, jwk: Value) {
        self.lock().extra_jwks.push(jwk);
    }

    /// Serves `body` at the JWKS path instead of the key set (`None`: back to the keys).
    pub fn serve_jwks_body(&self, body: Option<Vec<u8>>) {
        self.lock().jwks_body = body;
    }

    /// Sends `Cache-Control: <value>` with the JWKS (`None`: no such header).
    pub fn set_jwks_cache_control(&self, value: Option<&str>) {
        self.lock().jwks_cache_control = value.map(str::to_owned);
    }

    /// The JWKS document currently published.
    pub fn jwks(&self) -> Value {
        jwks_of(&self.lock())
    }

    /// Accept connections but never answer (true) or answer again (false).
    pub fn set_hang(&self, hang: bool) {
        self.lock().hang = hang;
    }

    /// Requests seen at `path` (exact, query included) so far.
    pub fn hits(&self, path: &str) -> usize {
        self.lock().hits.get(path).copied().unwrap_or(0)
    }

    /// JWKS fetches seen so far.
    pub fn jwks_fetches(&self) -> usize {
        self.hits(JWKS_PATH)
    }

    /// Every request seen so far, on any path.
    pub fn total_hits(&self) -> usize {
        self.lock().hits.values().sum()
    }

    /// Every path requested so far with its count.
    pub fn hit_paths(&self) -> BTreeMap<String, usize> {
        self.lock().hits.clone()
    }

    /// Closes the listener and every open connection: new connections are refused.
    /// Returns once the server task is gone (bounded).
    pub fn go_down(&self) {
        let handle = self.server.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(h) = handle {
            h.abort();
            let gone = crate::poll_until_blocking(
                Duration::from_secs(10),
                Duration::from_millis(5),
                || h.is_finished(),
            );
            assert!(gone, "the authorization server did not stop within 10 s");
        }
    }

    /// Listens again on the same port.
    pub fn come_back(&self) {
        self.go_down();
        let rt = self.rt.as_ref().expect("runtime");
        let mut last = None;
        for _ in 0..100 {
            match bind_on(rt, self.addr) {
                Ok(listener) => {
                    let h = rt.spawn(serve(
                        listener,
                        TlsAcceptor::from(self.tls.clone()),
                        self.shared.clone(),
                    ));
                    *self.server.lock().unwrap_or_else(|e| e.into_inner()) = Some(h);
                    return;
                }
                Err(e) => last = Some(e),
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("cannot rebind {}: {last:?}", self.addr);
    }

    /// A token signed by `key` for `audience`, every default in place.
    pub fn token(&self, key: &Arc<SigningKey>, audience: &str) -> TokenBuilder {
        TokenBuilder::new(key, self.issuer(), audience)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.shared.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Drop for Authz {
    fn drop(&mut self) {
        self.go_down();
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
    }
}

/// The three keys of [`Authz::with_standard_keys`].
pub struct StandardKeys {
    pub rsa: Arc<SigningKey>,
    pub ec: Arc<SigningKey>,
    pub ed: Arc<SigningKey>,
}

fn jwks_of(st: &State) -> Value {
    let mut keys: Vec<Value> = st.published.iter().map(|k| k.jwk()).collect();
    keys.extend(st.extra_jwks.iter().cloned());
    json!({ "keys": keys })
}

async fn serve(listener: TcpListener, acceptor: TlsAcceptor, shared: Arc<Shared>) {
    // Connection tasks live in this set: aborting the server drops them all.
    let mut conns = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let Ok((tcp, _)) = accepted else { continue };
                let acceptor = acceptor.clone();
                let shared = shared.clone();
                conns.spawn(async move {
                    let Ok(tls) = acceptor.accept(tcp).await else { return };
                    let svc = service_fn(move |req| {
                        let shared = shared.clone();
                        async move { Ok::<_, std::convert::Infallible>(answer(&shared, req).await) }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(tls), svc)
                        .await;
                });
            }
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
        }
    }
}

async fn answer(
    shared: &Shared,
    req: hyper::Request<hyper::body::Incoming>,
) -> hyper::Response<Full<Bytes>> {
    let path = req
        .uri()
        .path_and_query()
        .map_or_else(|| req.uri().path().to_owned(), |p| p.as_str().to_owned());
    let (hang, body, cache_control) = {
        let mut st = shared.state.lock().unwrap_or_else(|e| e.into_inner());
        *st.hits.entry(path.clone()).or_default() += 1;
        let issuer = &shared.issuer;
        let metadata = json!({
            "issuer": issuer,
            "jwks_uri": format!("{issuer}{JWKS_PATH}"),
            "authorization_endpoint": format!("{issuer}/authorize"),
            "token_endpoint": format!("{issuer}/token"),
            "response_types_supported": ["code"],
            "grant_types_supported": ["authorization_code", "client_credentials"],
            "code_challenge_methods_supported": ["S256"],
            "scopes_supported": ["mcp"],
        });
        let body = match (req.method() == hyper::Method::GET, path.as_str()) {
            (true, RFC8414_PATH) if shared.discovery == Discovery::Rfc8414 => {
                Some(serde_json::to_vec(&metadata).expect("json"))
            }
            (true, OIDC_PATH) if shared.discovery == Discovery::OidcOnly => {
                let mut oidc = metadata;
                oidc["subject_types_supported"] = json!(["public"]);
                oidc["id_token_signing_alg_values_supported"] = json!(["RS256"]);
                Some(serde_json::to_vec(&oidc).expect("json"))
            }
            (true, JWKS_PATH) => Some(
                st.jwks_body
                    .clone()
                    .unwrap_or_else(|| serde_json::to_vec(&jwks_of(&st)).expect("json")),
            ),
            // A key set an attacker would point `jku`/`x5u` at: served, so that a fetch
            // would succeed and be seen.
            (true, p) if p.starts_with("/attacker") => {
                Some(serde_json::to_vec(&jwks_of(&st)).expect("json"))
            }
            _ => None,
        };
        let cache_control = if path == JWKS_PATH {
            st.jwks_cache_control.clone()
        } else {
            None
        };
        (st.hang, body, cache_control)
    };
    if hang {
        std::future::pending::<()>().await;
    }
    match body {
        Some(b) => {
            let mut r = hyper::Response::builder()
                .status(200)
                .header("content-type", "application/json");
            if let Some(cc) = cache_control {
                r = r.header("cache-control", cc);
            }
            r.body(Full::new(Bytes::from(b))).expect("response")
        }
        None => hyper::Response::builder()
            .status(404)
            .body(Full::new(Bytes::new()))
            .expect("response"),
    }
}
