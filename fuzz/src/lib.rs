//! The checks behind the fuzz targets: each takes arbitrary bytes, feeds them to one parser
//! on the admission path, and asserts an invariant that must hold for *every* input (not
//! only "does not panic"). `fuzz_targets/*.rs` wrap them for libFuzzer; the tests below
//! replay the committed corpus through them on a stable toolchain (in CI as part of the
//! main workspace's `cargo test`, through `daemon/tests/fuzz_corpus.rs`).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::OnceLock;
use std::time::SystemTime;

use http::{HeaderMap, HeaderName, HeaderValue, Uri};
use robota_mcpd::carrier::loopback::admission::{Expected, admit};
use robota_mcpd::carrier::parse_bearer;
use robota_mcpd::carrier::remote::admission::{Credentials, Route, credentials, route};
use robota_mcpd::carrier::remote::forwarded::client_address;
use robota_mcpd::config::KeySource;
use robota_mcpd::config::{Environment, parse};
use robota_mcpd::config::{PublicUrl, parse_net};
use robota_mcpd::metrics::Metrics;
use robota_mcpd::oauth::token::SUPPORTED_ALGORITHMS;
use robota_mcpd::oauth::{Asker, JwtConfig, JwtVerifier, MAX_TOKEN_BYTES, Verifier};
use robota_mcpd::vocab::Reason;
use robota_proto::Request;

/// The one loopback bearer the loopback target's lookup knows.
const SECRET: &str = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

/// `b64token` characters (RFC 6750) and trailing `=`.
fn is_b64token(t: &str) -> bool {
    let body = t.trim_end_matches('=');
    !body.is_empty()
        && body
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-._~+/".contains(&b))
}

/// A request head from bytes: the first line is the request target, every further line
/// `name: value` (lines that are not a valid header are skipped).
fn head(data: &[u8]) -> Option<(Uri, HeaderMap)> {
    let mut lines = data.split(|b| *b == b'\n');
    let uri = Uri::try_from(lines.next()?).ok()?;
    let mut headers = HeaderMap::new();
    for line in lines {
        let Some(colon) = line.iter().position(|b| *b == b':') else {
            continue;
        };
        let (name, value) = line.split_at(colon);
        let value = value[1..].trim_ascii_start();
        if let (Ok(name), Ok(value)) =
            (HeaderName::from_bytes(name), HeaderValue::from_bytes(value))
        {
            headers.append(name, value);
        }
    }
    Some((uri, headers))
}

/// The control protocol: decoding never panics, and whatever decodes re-encodes to a
/// frame that decodes to the same request.
pub fn control_frame(data: &[u8]) {
    if let Ok(request) = Request::decode(data) {
        let again = serde_json::to_vec(&request).expect("a decoded request encodes");
        assert_eq!(
            Request::decode(&again).expect("a re-encoded request decodes"),
            request
        );
    }
}

/// `Authorization: Bearer`: a token comes back only when the value is `Bearer` (any case),
/// spaces and one `b64token`, and it is a slice of the input.
pub fn bearer(data: &[u8]) {
    if let Some(token) = parse_bearer(data) {
        assert!(is_b64token(token), "{token:?}");
        let text = std::str::from_utf8(data).expect("a token comes from UTF-8");
        assert!(text.ends_with(token));
        let scheme = text.split(' ').next().unwrap_or_default();
        assert!(scheme.eq_ignore_ascii_case("bearer"), "{text:?}");
    }
}

/// Loopback admission admits only the endpoint path with the one known bearer.
pub fn loopback_admission(data: &[u8]) {
    let Some((uri, headers)) = head(data) else {
        return;
    };
    let expected = Expected {
        path: "/mcp".into(),
        authority: "127.0.0.1:8765".into(),
        origin: "http://127.0.0.1:8765".into(),
    };
    let lookup = |token: &str| (token == SECRET).then(|| "default".to_owned());
    if let Ok(label) = admit(&uri, &headers, &expected, lookup) {
        assert_eq!(label, "default");
        assert_eq!(uri.path(), "/mcp");
        let auth = headers.get_all(http::header::AUTHORIZATION);
        assert_eq!(auth.iter().count(), 1, "exactly one Authorization header");
        for origin in headers.get_all(http::header::ORIGIN) {
            assert_eq!(origin, "http://127.0.0.1:8765");
        }
    }
}

/// Remote routing: the endpoint only on its path, a token only from exactly one
/// well-formed `Authorization` header.
pub fn remote_admission(data: &[u8]) {
    let Some((uri, headers)) = head(data) else {
        return;
    };
    let url = PublicUrl::parse("https://mcp.example.com/mcp").expect("valid public URL");
    match route(&uri, &headers, &url) {
        Ok(Route::Endpoint) => assert_eq!(uri.path(), "/mcp"),
        Ok(Route::Metadata) => {
            assert_eq!(uri.path(), "/.well-known/oauth-protected-resource/mcp")
        }
        Ok(Route::NotFound) | Err(_) => {}
    }
    if let Credentials::Token(token) = credentials(&headers) {
        assert_eq!(
            headers.get_all(http::header::AUTHORIZATION).iter().count(),
            1
        );
        assert!(is_b64token(token), "{token:?}");
    }
}

/// The client address behind proxies, from raw header bytes (any byte a header value may
/// carry, non-ASCII included): an untrusted peer is the client; otherwise the client is
/// the peer or a hop of the header, and whenever the rightmost hop is an address no proxy
/// holds, it is the client, whatever the rest of the header says.
pub fn forwarded(data: &[u8]) {
    let Some((&selector, rest)) = data.split_first() else {
        return;
    };
    let peer = match selector % 3 {
        0 => IpAddr::V4(Ipv4Addr::LOCALHOST),
        1 => IpAddr::V4(Ipv4Addr::new(10, 0, 0, 1)),
        _ => IpAddr::V6(Ipv6Addr::LOCALHOST),
    };
    let mut lines = rest.split(|b| *b == b'\n');
    let proxies: Vec<_> = String::from_utf8_lossy(lines.next().unwrap_or_default())
        .split(',')
        .filter_map(parse_net)
        .collect();
    let mut headers = HeaderMap::new();
    for line in lines {
        if let Ok(value) = HeaderValue::from_bytes(line) {
            headers.append("x-forwarded-for", value);
        }
    }
    let trusted = |ip: IpAddr| proxies.iter().any(|net| net.contains(&ip));
    let client = client_address(peer, &headers, &proxies);
    if !trusted(peer) {
        assert_eq!(client, peer, "an untrusted peer is the client");
        return;
    }
    // A hop as an address, the way a proxy writes one (`ip`, `ip:port`, `[v6]:port`).
    let address = |hop: &[u8]| -> Option<IpAddr> {
        let text = std::str::from_utf8(hop).ok()?.trim_matches([' ', '\t']);
        let ip = text
            .parse::<IpAddr>()
            .ok()
            .or_else(|| text.parse::<std::net::SocketAddr>().ok().map(|s| s.ip()))?;
        Some(match ip {
            IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4),
            v4 => v4,
        })
    };
    let hops: Vec<&[u8]> = headers
        .get_all("x-forwarded-for")
        .iter()
        .flat_map(|v| v.as_bytes().split(|b| *b == b','))
        .collect();
    if client != peer {
        assert!(
            hops.iter().any(|hop| address(hop) == Some(client)),
            "{client} is neither the peer nor a hop"
        );
    }
    if let Some(rightmost) = hops.last().and_then(|hop| address(hop))
        && !trusted(rightmost)
    {
        assert_eq!(client, rightmost, "the hop the proxy appended decides");
    }
}

/// The configuration parser never panics, and every problem it reports names a key path.
pub fn config(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let env = Environment {
        runtime_directory: Some("/run/robota-mcpd".into()),
        state_directory: Some("/var/lib/robota-mcpd".into()),
        ..Environment::default()
    };
    if let Err(issues) = parse(text, &env) {
        assert!(!issues.is_empty());
        for issue in issues {
            assert!(!issue.problem.is_empty(), "{issue}");
        }
    }
}

/// A verifier holding one Ed25519 key, built once per process.
fn verifier() -> &'static (tokio::runtime::Runtime, JwtVerifier) {
    static VERIFIER: OnceLock<(tokio::runtime::Runtime, JwtVerifier)> = OnceLock::new();
    VERIFIER.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("robota-fuzz-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let jwks = dir.join("jwks.json");
        std::fs::write(
            &jwks,
            r#"{"keys":[{"kty":"OKP","crv":"Ed25519","kid":"k1","x":"11qYAYKxCrfVS_7TyWQHOg7hcvPapiMlrwIaaPcHURo"}]}"#,
        )
        .expect("jwks");
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .expect("runtime");
        let verifier = JwtVerifier::build(
            JwtConfig {
                issuer: "https://issuer.example".into(),
                audiences: vec!["https://mcp.example/mcp".into()],
                algorithms: SUPPORTED_ALGORITHMS.to_vec(),
                required_scopes: vec![],
                allowed_subjects: vec!["alice".into()],
                allowed_clients: vec![],
                keys: KeySource::JwksFile(jwks),
                ca_file: None,
                cache_path: dir.join("jwks-cache.json"),
                start_without_keys: false,
                refresh: robota_mcpd::config::KeyRefresh::DEFAULT,
                introspection: None,
            },
            Metrics::new(),
        )
        .expect("verifier");
        runtime.block_on(verifier.load()).expect("key set");
        (runtime, verifier)
    })
}

/// JWT pre-checks and verification: nothing without the private key is ever accepted;
/// over 8192 bytes is `oversize`, without exactly two dots `malformed`.
pub fn jwt(data: &[u8]) {
    let Ok(token) = std::str::from_utf8(data) else {
        return;
    };
    let (runtime, verifier) = verifier();
    let got = runtime.block_on(verifier.verify(token, SystemTime::now(), Asker::anyone()));
    assert!(got.is_err(), "accepted {token:?}");
    if token.len() > MAX_TOKEN_BYTES {
        assert_eq!(got.err(), Some(Reason::Oversize));
    } else if token.matches('.').count() != 2 {
        assert_eq!(got.err(), Some(Reason::Malformed));
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    /// Every committed corpus file through its check (the CI run of the fuzz targets). The
    /// corpus is found from either crate that compiles this file: the fuzz crate, or the
    /// daemon's `tests/fuzz_corpus.rs`.
    fn replay(target: &str, check: fn(&[u8])) {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../fuzz/corpus")
            .join(target);
        let mut seen = 0;
        for entry in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
            let path = entry.expect("corpus entry").path();
            let data = std::fs::read(&path).expect("corpus file");
            check(&data);
            seen += 1;
        }
        assert!(seen > 0, "the {target} corpus is empty");
    }

    #[test]
    fn control_frame_corpus() {
        replay("control_frame", super::control_frame);
    }

    #[test]
    fn bearer_corpus() {
        replay("bearer", super::bearer);
    }

    #[test]
    fn loopback_admission_corpus() {
        replay("loopback_admission", super::loopback_admission);
    }

    #[test]
    fn remote_admission_corpus() {
        replay("remote_admission", super::remote_admission);
    }

    #[test]
    fn forwarded_corpus() {
        replay("forwarded", super::forwarded);
    }

    #[test]
    fn config_corpus() {
        replay("config", super::config);
    }

    #[test]
    fn jwt_corpus() {
        replay("jwt", super::jwt);
    }
}
