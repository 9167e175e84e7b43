//! Property tests for every parser on the admission path: the bearer grammar, loopback
//! admission, remote routing and decisions, the `X-Forwarded-For` walk and CIDRs, the
//! configuration parser and the JWT pre-checks. Each property states an invariant from
//! docs/design.md §5/§6 or docs/ARCHITECTURE.md and is checked against an oracle that does not
//! reuse the code under test (labels known by construction, bit arithmetic, …).

use std::cell::{Cell, RefCell};
use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::time::SystemTime;

use http::{HeaderMap, HeaderValue, StatusCode, Uri};
use proptest::collection::vec;
use proptest::prelude::*;
use proptest::sample::Index;
use proptest::test_runner::{Config as ProptestConfig, TestCaseError, TestRunner};

use robota_mcpd::carrier::loopback::admission::{Expected, Refusal, admit};
use robota_mcpd::carrier::parse_bearer;
use robota_mcpd::carrier::remote::admission::{
    Challenges, Credentials, Failure, Route, credentials, decide, route,
};
use robota_mcpd::carrier::remote::forwarded::client_address;
use robota_mcpd::config::KeySource;
use robota_mcpd::config::{Environment, parse};
use robota_mcpd::config::{PublicUrl, parse_net};
use robota_mcpd::metrics::Metrics;
use robota_mcpd::oauth::token::SUPPORTED_ALGORITHMS;
use robota_mcpd::oauth::{Asker, JwtConfig, JwtVerifier, MAX_TOKEN_BYTES, Principal, Verifier};
use robota_mcpd::vocab::Reason;

/// `cases` cases, no regression files written into the tree.
fn config(cases: u32) -> ProptestConfig {
    ProptestConfig {
        cases,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

/// The RFC 6750 `b64token` characters before the padding.
const B64TOKEN_CHARS: &str = "[A-Za-z0-9._~+/-]";

/// Any spelling of the scheme `Bearer`.
fn scheme() -> impl Strategy<Value = String> {
    "[bB][eE][aA][rR][eE][rR]"
}

/// Strings matching a regular expression.
fn re(pattern: &str) -> impl Strategy<Value = String> + use<> {
    proptest::string::string_regex(pattern).expect("a valid pattern")
}

/// A valid `b64token`: 1*( ALPHA / DIGIT / "-" / "." / "_" / "~" / "+" / "/" ) *"=".
fn b64token() -> impl Strategy<Value = String> {
    re(&format!("{B64TOKEN_CHARS}{{1,300}}={{0,3}}"))
}

/// A character no `b64token` may hold inside it: space, controls, other ASCII punctuation,
/// `=` before the end, and non-ASCII.
fn non_token_char() -> impl Strategy<Value = char> {
    prop_oneof![
        Just(' '),
        Just('='),
        (0u8..0x20).prop_map(char::from),
        Just('\x7f'),
        prop::sample::select("!\"#$%&'(),:;<>?@[\\]^`{|}*".chars().collect::<Vec<_>>()),
        any::<char>().prop_filter("non-ASCII", |c| !c.is_ascii()),
    ]
}

fn is_b64token(t: &str) -> bool {
    let body = t.trim_end_matches('=');
    !body.is_empty()
        && body
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-._~+/".contains(&b))
}

proptest! {
    #![proptest_config(config(256))]

    /// Whatever bytes arrive, the parser answers; and when it answers with a token, the
    /// input was exactly `<Bearer in any case> 1*SP <that token>` with a valid token.
    #[test]
    fn bearer_arbitrary_bytes(
        prefix in prop_oneof![Just(b"Bearer ".to_vec()), Just(b"bEaReR   ".to_vec()), Just(vec![])],
        bytes in vec(any::<u8>(), 0..2048),
    ) {
        let input = [prefix, bytes].concat();
        if let Some(token) = parse_bearer(&input) {
            let text = std::str::from_utf8(&input).expect("a token implies UTF-8");
            prop_assert!(is_b64token(token), "{token:?}");
            let head = text.strip_suffix(token).expect("the token is the suffix");
            let (scheme, spaces) = head.split_at(6);
            prop_assert!(scheme.eq_ignore_ascii_case("bearer"));
            prop_assert!(!spaces.is_empty() && spaces.bytes().all(|b| b == b' '), "{head:?}");
        }
    }

    /// `<scheme> 1*SP <t>` gives back exactly `t`, whatever the scheme's case and however
    /// many spaces.
    #[test]
    fn bearer_round_trip(scheme in scheme(), spaces in " {1,8}", token in b64token()) {
        let header = format!("{scheme}{spaces}{token}");
        prop_assert_eq!(parse_bearer(header.as_bytes()), Some(token.as_str()));
    }

    /// One bad character anywhere inside the token (or trailing) makes it no bearer.
    #[test]
    fn bearer_bad_character(
        scheme in scheme(),
        before in re(&format!("{B64TOKEN_CHARS}{{1,40}}")),
        bad in non_token_char(),
        after in re(&format!("{B64TOKEN_CHARS}{{0,40}}")),
    ) {
        // `a=` is valid padding: an `=` is only bad with something after it.
        let after = if bad == '=' && after.is_empty() { "x".to_owned() } else { after };
        let header = format!("{scheme} {before}{bad}{after}");
        prop_assert_eq!(parse_bearer(header.as_bytes()), None, "{:?}", header);
    }

    /// A non-UTF-8 byte anywhere in the token makes it no bearer.
    #[test]
    fn bearer_non_utf8(token in b64token(), at in any::<Index>(), byte in 0x80u8..=0xff) {
        let mut header = format!("Bearer {token}").into_bytes();
        let at = 7 + at.index(token.len() + 1);
        header.insert(at, byte);
        // A lone byte >= 0x80 is never UTF-8 between ASCII characters.
        prop_assert_eq!(parse_bearer(&header), None);
    }

    /// Any other scheme is no bearer.
    #[test]
    fn bearer_other_scheme(scheme in "[A-Za-z]{1,10}", token in b64token()) {
        prop_assume!(!scheme.eq_ignore_ascii_case("bearer"));
        let header = format!("{scheme} {token}");
        prop_assert_eq!(parse_bearer(header.as_bytes()), None);
    }
}

// ---------------------------------------------------------------------------------------
// Loopback admission.

const GOOD_TOKEN: &str = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";
const PATH: &str = "/mcp";

/// Near-miss Host values for `127.0.0.1:<port>`; none of them is the expected authority.
fn near_hosts(port: u16) -> Vec<String> {
    let other = port.wrapping_add(1).max(1);
    vec![
        format!("127.0.0.1:{other}"),
        "127.0.0.1".to_owned(),
        format!("127.0.0.1.:{port}"),
        format!("127.0.0.1:{port}."),
        format!("127.0.0.1.evil.com:{port}"),
        format!("127.0.0.1:{port}.evil.com"),
        format!("evil.com:{port}"),
        format!("localhost:{port}"),
        format!("LOCALHOST:{port}"),
        format!("LocalHost.:{port}"),
        format!("user@127.0.0.1:{port}"),
        format!("user:pw@127.0.0.1:{port}"),
        format!("[::1]:{port}"),
        format!("[::ffff:127.0.0.1]:{port}"),
        format!("[::FFFF:7F00:1]:{port}"),
        format!("127.0.0.01:{port}"),
        format!("127.1:{port}"),
        format!("2130706433:{port}"),
        format!("0x7f.0.0.1:{port}"),
        format!("127.0.0.1:0{port}"),
        format!("127.0.0.2:{port}"),
        format!("0.0.0.0:{port}"),
        format!(" 127.0.0.1:{port}"),
        format!("127.0.0.1:{port} "),
        format!("127.0.0.1:{port}\t"),
        String::new(),
    ]
}

/// Near-miss Origin values for `http://127.0.0.1:<port>`.
fn near_origins(port: u16) -> Vec<String> {
    let other = port.wrapping_add(1).max(1);
    vec![
        format!("https://127.0.0.1:{port}"),
        format!("http://127.0.0.1:{other}"),
        "http://127.0.0.1".to_owned(),
        format!("http://localhost:{port}"),
        format!("http://LOCALHOST:{port}"),
        format!("http://127.0.0.1:{port}/"),
        format!("http://127.0.0.1.:{port}"),
        format!("http://127.0.0.1:{port}.evil.com"),
        format!("http://127.0.0.1.evil.com:{port}"),
        format!("http://[::1]:{port}"),
        format!("http://user@127.0.0.1:{port}"),
        format!("127.0.0.1:{port}"),
        format!("ws://127.0.0.1:{port}"),
        "null".to_owned(),
        String::new(),
    ]
}

/// One header value: the good one, a near miss, or arbitrary bytes (often not UTF-8).
#[derive(Debug, Clone)]
enum Pick {
    Good,
    Near(Index),
    Bytes(Vec<u8>),
}

fn pick() -> impl Strategy<Value = Pick> {
    prop_oneof![
        6 => Just(Pick::Good),
        3 => any::<Index>().prop_map(Pick::Near),
        1 => vec(any::<u8>(), 0..64).prop_map(Pick::Bytes),
    ]
}

/// 0, 1 or 2 copies of a header (1 most often).
fn picks() -> impl Strategy<Value = Vec<Pick>> {
    prop_oneof![
        1 => Just(vec![]),
        8 => pick().prop_map(|p| vec![p]),
        1 => vec(pick(), 2..=2),
    ]
}

fn resolve(p: &Pick, good: &str, near: &[String]) -> Option<HeaderValue> {
    match p {
        Pick::Good => Some(HeaderValue::from_str(good).unwrap()),
        Pick::Near(i) => HeaderValue::from_str(&near[i.index(near.len())]).ok(),
        Pick::Bytes(b) => HeaderValue::from_bytes(b).ok(),
    }
}

#[derive(Debug, Clone)]
enum Target {
    /// Origin-form with this path (and maybe a query).
    Path(Index, bool),
    /// Absolute-form `<scheme>://<authority><path>`.
    Absolute { https: bool, authority: Pick },
}

#[derive(Debug, Clone)]
struct LoopbackHead {
    port: u16,
    target: Target,
    hosts: Vec<Pick>,
    origins: Vec<Pick>,
    auths: Vec<Pick>,
}

fn loopback_head() -> impl Strategy<Value = LoopbackHead> {
    let target = prop_oneof![
        8 => (any::<Index>(), any::<bool>()).prop_map(|(i, q)| Target::Path(i, q)),
        2 => (prop::bool::weighted(0.2), pick())
            .prop_map(|(https, authority)| Target::Absolute { https, authority }),
    ];
    (1u16.., target, picks(), picks(), picks()).prop_map(|(port, target, hosts, origins, auths)| {
        LoopbackHead {
            port,
            target,
            hosts,
            origins,
            auths,
        }
    })
}

/// The oracle: docs/design.md §5.2 written out, with every label known from how the head was built.
fn loopback_oracle(
    h: &LoopbackHead,
    uri: &Uri,
    hosts: &[HeaderValue],
) -> Result<&'static str, Reason> {
    let authority = format!("127.0.0.1:{}", h.port);
    let origin = format!("http://127.0.0.1:{}", h.port);
    if uri.path() != PATH {
        return Err(Reason::WrongPath);
    }
    let uri_authority_ok = match &h.target {
        Target::Path(..) => None,
        Target::Absolute { https, .. } => {
            Some(!https && uri.authority().is_some_and(|a| a.as_str() == authority))
        }
    };
    let host_ok = match (hosts, uri_authority_ok) {
        (_, Some(false)) => false,
        ([], Some(true)) => true,
        ([one], _) => one.as_bytes() == authority.as_bytes(),
        _ => false,
    };
    if !host_ok {
        return Err(Reason::WrongHost);
    }
    let origins = header_values(&h.origins, &origin, &near_origins(h.port));
    match origins.as_slice() {
        [] => {}
        // RFC 6454 §4: the scheme is case-insensitive; browsers send it lower-case.
        [one] if one.as_bytes().eq_ignore_ascii_case(origin.as_bytes()) => {}
        _ => return Err(Reason::WrongOrigin),
    }
    let auths = header_values(&h.auths, &format!("Bearer {GOOD_TOKEN}"), &near_auths());
    match auths.as_slice() {
        [] => Err(Reason::MissingToken),
        [one] if one.as_bytes() == format!("Bearer {GOOD_TOKEN}").as_bytes() => Ok("default"),
        [one]
            if one.len() > 7
                && one.as_bytes()[..7].eq_ignore_ascii_case(b"bearer ")
                && &one.as_bytes()[7..] == GOOD_TOKEN.as_bytes() =>
        {
            Ok("default")
        }
        _ => Err(Reason::BadBearer),
    }
}

fn near_auths() -> Vec<String> {
    vec![
        format!("bearer {GOOD_TOKEN}"),
        format!("Bearer {}", &GOOD_TOKEN[1..]),
        format!("Bearer {GOOD_TOKEN}x"),
        format!("Bearer {GOOD_TOKEN} "),
        format!("Basic {GOOD_TOKEN}"),
        format!("Bearer{GOOD_TOKEN}"),
        format!("Bearer {}", GOOD_TOKEN.to_uppercase()),
        format!("Bearer {}", "a".repeat(257)),
        "Bearer ".to_owned(),
        "Bearer".to_owned(),
    ]
}

fn header_values(picks: &[Pick], good: &str, near: &[String]) -> Vec<HeaderValue> {
    picks
        .iter()
        .filter_map(|p| resolve(p, good, near))
        .collect()
}

fn build_loopback(h: &LoopbackHead) -> Option<(Uri, HeaderMap, Vec<HeaderValue>)> {
    let authority = format!("127.0.0.1:{}", h.port);
    let paths = [
        "/mcp", "/mcp/", "/MCP", "/mcp2", "/", "/x/mcp", "/mcp/x", "//mcp",
    ];
    let uri = match &h.target {
        Target::Path(i, query) => {
            let path = paths[i.index(paths.len())];
            let q = if *query { "?x=1" } else { "" };
            format!("{path}{q}")
        }
        Target::Absolute {
            https,
            authority: a,
        } => {
            let a = match a {
                Pick::Good => authority.clone(),
                Pick::Near(i) => {
                    let near = near_hosts(h.port);
                    near[i.index(near.len())].clone()
                }
                Pick::Bytes(b) => String::from_utf8_lossy(b).into_owned(),
            };
            let scheme = if *https { "https" } else { "http" };
            format!("{scheme}://{a}{PATH}")
        }
    };
    let uri: Uri = uri.parse().ok()?;
    let mut headers = HeaderMap::new();
    let hosts = header_values(&h.hosts, &authority, &near_hosts(h.port));
    for v in &hosts {
        headers.append(http::header::HOST, v.clone());
    }
    for v in header_values(
        &h.origins,
        &format!("http://{authority}"),
        &near_origins(h.port),
    ) {
        headers.append(http::header::ORIGIN, v);
    }
    for v in header_values(&h.auths, &format!("Bearer {GOOD_TOKEN}"), &near_auths()) {
        headers.append(http::header::AUTHORIZATION, v);
    }
    Some((uri, headers, hosts))
}

/// Admission agrees with the oracle on generated heads; the bearer lookup is consulted
/// only once path, Host and Origin passed; refusal reasons come in the documented order. The run
/// must reach every outcome, so the generator cannot silently stop covering one.
#[test]
fn loopback_admission_matches_spec() {
    let mut runner = TestRunner::new(config(256 * 4));
    let seen = RefCell::new(BTreeSet::new());
    runner
        .run(&loopback_head(), |h| {
            let Some((uri, headers, hosts)) = build_loopback(&h) else {
                return Ok(());
            };
            let expected = Expected::new(PATH, h.port);
            let looked_up = Cell::new(false);
            let got = admit(&uri, &headers, &expected, |token| {
                looked_up.set(true);
                (token == GOOD_TOKEN).then(|| "default".to_owned())
            });
            let want = loopback_oracle(&h, &uri, &hosts);
            prop_assert_eq!(
                got.clone(),
                want.map(str::to_owned).map_err(Refusal),
                "uri {:?} headers {:?}",
                uri,
                headers
            );
            let gates_passed =
                matches!(want, Ok(_) | Err(Reason::MissingToken | Reason::BadBearer));
            prop_assert!(!looked_up.get() || gates_passed, "lookup before the gates");
            seen.borrow_mut().insert(format!("{want:?}"));
            Ok(())
        })
        .unwrap();
    let seen = seen.into_inner();
    for outcome in [
        "Ok(\"default\")",
        "Err(WrongPath)",
        "Err(WrongHost)",
        "Err(WrongOrigin)",
        "Err(MissingToken)",
        "Err(BadBearer)",
    ] {
        assert!(
            seen.contains(outcome),
            "{outcome} never generated: {seen:?}"
        );
    }
}

proptest! {
    #![proptest_config(config(256))]

    /// Every near-miss Host alone (the rest of the request good) is `wrong-host`.
    #[test]
    fn loopback_near_miss_hosts(port in 1u16.., i in any::<Index>(), origin in any::<bool>()) {
        let near = near_hosts(port);
        let host = &near[i.index(near.len())];
        prop_assume!(HeaderValue::from_str(host).is_ok());
        let mut headers = HeaderMap::new();
        headers.insert(http::header::HOST, HeaderValue::from_str(host).unwrap());
        if origin {
            // A bad Host is reported before a bad Origin.
            headers.insert(http::header::ORIGIN, HeaderValue::from_static("null"));
        }
        headers.insert(
            http::header::AUTHORIZATION,
            HeaderValue::from_str(&format!("Bearer {GOOD_TOKEN}")).unwrap(),
        );
        let got = admit(&Uri::from_static(PATH), &headers, &Expected::new(PATH, port), |_| {
            Some("default".to_owned())
        });
        prop_assert_eq!(got, Err(Refusal(Reason::WrongHost)), "{:?}", host);
    }

    /// Every near-miss Origin (Host good) is `wrong-origin`, before any bearer check.
    #[test]
    fn loopback_near_miss_origins(port in 1u16.., i in any::<Index>(), auth in any::<bool>()) {
        let near = near_origins(port);
        let origin = &near[i.index(near.len())];
        let mut headers = HeaderMap::new();
        headers.insert(
            http::header::HOST,
            HeaderValue::from_str(&format!("127.0.0.1:{port}")).unwrap(),
        );
        headers.insert(http::header::ORIGIN, HeaderValue::from_str(origin).unwrap());
        if auth {
            headers.insert(
                http::header::AUTHORIZATION,
                HeaderValue::from_str(&format!("Bearer {GOOD_TOKEN}")).unwrap(),
            );
        }
        let got = admit(&Uri::from_static(PATH), &headers, &Expected::new(PATH, port), |_| {
            Some("default".to_owned())
        });
        prop_assert_eq!(got, Err(Refusal(Reason::WrongOrigin)), "{:?}", origin);
    }

    /// Huge and non-UTF-8 header values never panic and are never admitted.
    #[test]
    fn loopback_huge_values(
        port in 1u16..,
        which in 0usize..3,
        body in vec(prop_oneof![0x20u8..0x7f, 0x80u8..=0xff], 0..20_000),
    ) {
        let Ok(junk) = HeaderValue::from_bytes(&body) else { return Ok(()) };
        let mut headers = HeaderMap::new();
        headers.insert(http::header::HOST, HeaderValue::from_str(&format!("127.0.0.1:{port}")).unwrap());
        let name = [http::header::HOST, http::header::ORIGIN, http::header::AUTHORIZATION][which].clone();
        headers.insert(name, junk);
        let got = admit(&Uri::from_static(PATH), &headers, &Expected::new(PATH, port), |t| {
            (t == GOOD_TOKEN).then(|| "default".to_owned())
        });
        prop_assert!(got.is_err());
    }
}

// ---------------------------------------------------------------------------------------
// Remote routing and credentials.

#[derive(Debug, Clone)]
struct RemoteCase {
    host: String,
    port: Option<u16>,
    path: &'static str,
}

fn remote_case() -> impl Strategy<Value = RemoteCase> {
    (
        "[a-z][a-z0-9-]{0,8}(\\.[a-z][a-z0-9]{0,6}){0,2}",
        prop_oneof![Just(None), Just(Some(443)), (1u16..).prop_map(Some)],
        prop::sample::select(vec!["/mcp", "/team/ops/mcp", "/"]),
    )
        .prop_map(|(host, port, path)| RemoteCase { host, port, path })
}

impl RemoteCase {
    fn url(&self) -> PublicUrl {
        let port = self.port.map(|p| format!(":{p}")).unwrap_or_default();
        let path = if self.path == "/" { "" } else { self.path };
        PublicUrl::parse(&format!("https://{}{port}{path}", self.host)).unwrap()
    }

    fn effective_port(&self) -> u16 {
        self.port.unwrap_or(443)
    }
}

/// A Host the route must accept (`good`) or refuse, known by construction.
fn host_variant(case: &RemoteCase, kind: usize, mask: &[bool], other: u16) -> (String, bool) {
    let cased: String = case
        .host
        .chars()
        .zip(mask.iter().cycle())
        .map(|(c, up)| if *up { c.to_ascii_uppercase() } else { c })
        .collect();
    let port = case.effective_port();
    let other = if other == port {
        port.wrapping_add(1).max(1)
    } else {
        other
    };
    match kind {
        0 => (format!("{cased}:{port}"), true),
        1 => (cased, port == 443),
        2 => (format!("{cased}:{other}"), false),
        3 => (format!("{cased}.evil.com:{port}"), false),
        4 => (format!("{cased}.:{port}"), false),
        5 => (format!("a.{cased}:{port}"), false),
        6 => (format!("u@{cased}:{port}"), false),
        7 => (format!("u:p@{cased}"), false),
        8 => (format!("[::1]:{port}"), false),
        9 => (format!("127.0.0.1:{port}"), false),
        10 => (format!("{cased}x:{port}"), false),
        _ => (format!("{cased}:{port}/x"), false),
    }
}

proptest! {
    #![proptest_config(config(256))]

    /// Host is the public host in any case, with the public port (`:443` implied when
    /// absent); every other Host is `wrong-host`; a present Origin must be the public
    /// origin; a path other than the endpoint or metadata path is 404 whatever the
    /// headers.
    #[test]
    fn remote_route(
        case in remote_case(),
        kind in 0usize..12,
        mask in vec(any::<bool>(), 1..8),
        other in 1u16..,
        absolute in any::<bool>(),
        origin in prop_oneof![Just(None), Just(Some(0usize)), (1usize..6).prop_map(Some)],
        path_kind in 0usize..3,
    ) {
        let url = case.url();
        let (host, good_host) = host_variant(&case, kind, &mask, other);
        let path = [url.path().to_owned(), url.metadata_path().to_owned(), format!("{}x", url.path())][path_kind].clone();
        let (uri, mut headers) = if absolute {
            let Ok(uri) = format!("https://{host}{path}").parse::<Uri>() else { return Ok(()) };
            // The URI may carry an authority that `host` spells differently.
            if uri.path() != path { return Ok(()) }
            (uri, HeaderMap::new())
        } else {
            let mut h = HeaderMap::new();
            h.insert(http::header::HOST, HeaderValue::from_str(&host).unwrap());
            (path.parse::<Uri>().unwrap(), h)
        };
        let public_origin = url.origin().to_owned();
        let origin_value = origin.map(|k| match k {
            0 => public_origin.clone(),
            1 => public_origin.replace("https://", "http://"),
            2 => format!("{public_origin}/"),
            3 => format!("{public_origin}.evil.com"),
            4 => format!("https://{}:{}", case.host, case.effective_port().wrapping_add(1).max(1)),
            _ => "null".to_owned(),
        });
        if let Some(o) = &origin_value {
            headers.insert(http::header::ORIGIN, HeaderValue::from_str(o).unwrap());
        }
        let got = route(&uri, &headers, &url);
        let want = match path_kind {
            2 if path != url.metadata_path() => Ok(Route::NotFound),
            _ if !good_host => Err(Reason::WrongHost),
            _ if origin.is_some_and(|k| k != 0) => Err(Reason::WrongOrigin),
            0 => Ok(Route::Endpoint),
            _ => Ok(Route::Metadata),
        };
        prop_assert_eq!(got, want, "url {} uri {} headers {:?}", url.as_str(), uri, headers);
    }

    /// Arbitrary Host, Origin and Authorization bytes never panic the route or the
    /// credential parser; a token, when found, is what `parse_bearer` finds.
    #[test]
    fn remote_arbitrary_headers(
        case in remote_case(),
        host in vec(any::<u8>(), 0..300),
        origin in vec(any::<u8>(), 0..300),
        auth in vec(any::<u8>(), 0..9000),
    ) {
        let url = case.url();
        let mut headers = HeaderMap::new();
        for (name, value) in [
            (http::header::HOST, &host),
            (http::header::ORIGIN, &origin),
            (http::header::AUTHORIZATION, &auth),
        ] {
            if let Ok(v) = HeaderValue::from_bytes(value) {
                headers.insert(name, v);
            }
        }
        let uri: Uri = url.path().parse().unwrap();
        let routed = route(&uri, &headers, &url);
        if routed.is_ok() {
            prop_assert!(headers.get(http::header::HOST).is_some_and(|h| url.is_authority(h.to_str().unwrap())));
        }
        match (credentials(&headers), headers.get(http::header::AUTHORIZATION)) {
            (Credentials::Missing, None) => {}
            (Credentials::Token(t), Some(v)) => prop_assert_eq!(parse_bearer(v.as_bytes()), Some(t)),
            (Credentials::Malformed, Some(v)) => prop_assert_eq!(parse_bearer(v.as_bytes()), None),
            (c, v) => return Err(TestCaseError::fail(format!("{c:?} for {v:?}"))),
        }
    }

    /// A valid principal is admitted whatever the throttle says; a throttled failure is
    /// 429 with `Retry-After >= 1` and no challenge; `keys-unavailable` and
    /// `introspection-unavailable` are 503, never counted nor throttled; otherwise a failure is counted, carries a challenge naming the
    /// metadata URL, and keeps its reason.
    #[test]
    fn remote_decide(
        valid in any::<bool>(),
        failure in 0usize..(Reason::ALL.len() + 2),
        over_budget in prop_oneof![Just(None), Just(Some(0u64)), any::<u64>().prop_map(Some)],
        metadata_url in "[ -~]{0,40}",
        scope in "[a-z ]{0,20}",
        subject in ".{0,10}",
    ) {
        let challenges = Challenges { metadata_url: metadata_url.clone(), scope };
        let principal = Principal {
            client_id: "c".into(),
            subject,
            scopes: vec![],
            expires_at: SystemTime::UNIX_EPOCH,
        };
        let (failure, reason) = match failure {
            0 => (Failure::Missing, Reason::MissingToken),
            1 => (Failure::MalformedHeader, Reason::Malformed),
            i => (Failure::Token(Reason::ALL[i - 2]), Reason::ALL[i - 2]),
        };
        let mut counted = false;
        let fail = || {
            counted = true;
            over_budget
        };
        if valid {
            prop_assert_eq!(decide(Ok(principal.clone()), fail, &challenges), Ok(principal));
            prop_assert!(!counted, "a valid token is never counted");
            return Ok(());
        }
        let r = decide(Err(failure), fail, &challenges).unwrap_err();
        prop_assert_eq!(r.reason, reason);
        if matches!(reason, Reason::KeysUnavailable | Reason::IntrospectionUnavailable) {
            // The issuer's trouble, never the client's: not counted, never throttled.
            prop_assert!(!counted && !r.throttled);
            prop_assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE);
            prop_assert!(r.retry_after.is_some_and(|s| s >= 1));
            prop_assert!(r.challenge.is_none());
        } else if reason == Reason::NotIntrospected {
            // Only ever decided over budget: throttled even if the window just ended.
            prop_assert!(counted && r.throttled);
            prop_assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS);
            prop_assert_eq!(r.retry_after, Some(over_budget.unwrap_or(1).max(1)));
            prop_assert!(r.challenge.is_none());
        } else if let Some(seconds) = over_budget {
            prop_assert!(counted && r.throttled);
            prop_assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS);
            prop_assert_eq!(r.retry_after, Some(seconds.max(1)));
            prop_assert!(r.challenge.is_none());
        } else {
            prop_assert!(counted && !r.throttled && r.retry_after.is_none());
            prop_assert!(matches!(r.status.as_u16(), 400 | 401 | 403), "{}", r.status);
            let challenge = r.challenge.unwrap();
            prop_assert!(challenge.starts_with("Bearer "));
            let quoted = format!("resource_metadata=\"{metadata_url}\"");
            prop_assert!(challenge.contains(&quoted));
        }
    }
}

// ---------------------------------------------------------------------------------------
// X-Forwarded-For and CIDRs.

/// Addresses from a few small pools, so that nets and hops collide often.
fn ip() -> impl Strategy<Value = IpAddr> {
    prop_oneof![
        (
            prop::sample::select(vec![10u8, 127, 192, 203]),
            any::<u8>(),
            0u8..4,
            any::<u8>()
        )
            .prop_map(|(a, b, c, d)| IpAddr::V4(Ipv4Addr::new(a, b, c, d))),
        (
            prop::sample::select(vec![0x2001_0db8u32, 0xfd00_0000]),
            0u16..4,
            any::<u16>()
        )
            .prop_map(|(hi, mid, lo)| {
                let bits = (u128::from(hi) << 96) | (u128::from(mid) << 16) | u128::from(lo);
                IpAddr::V6(Ipv6Addr::from(bits))
            }),
        any::<u32>().prop_map(|v| IpAddr::V4(Ipv4Addr::from(v))),
    ]
}

fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4),
        v4 => v4,
    }
}

/// `net` as `<ip>/<len>` text, parsed by the code under test.
fn net() -> impl Strategy<Value = (IpAddr, u8)> {
    ip().prop_flat_map(|a| {
        let max: u8 = if a.is_ipv4() { 32 } else { 128 };
        (Just(a), 0..=max)
    })
}

/// Whether the first `len` bits of `a` and `b` agree (same family only).
fn prefix_match(a: IpAddr, len: u8, b: IpAddr) -> bool {
    let (a, b, width) = match (a, b) {
        (IpAddr::V4(a), IpAddr::V4(b)) => (u128::from(u32::from(a)), u128::from(u32::from(b)), 32),
        (IpAddr::V6(a), IpAddr::V6(b)) => (u128::from(a), u128::from(b), 128),
        _ => return false,
    };
    let len = u32::from(len);
    len == 0 || (a ^ b) >> (width - len) == 0
}

#[derive(Debug, Clone)]
enum Hop {
    Ip(IpAddr, u8),
    Garbage(String),
}

impl Hop {
    fn text(&self) -> String {
        match self {
            Hop::Ip(ip, style) => match (style % 4, ip) {
                (0, _) => ip.to_string(),
                (1, _) => format!(" {ip} "),
                (2, IpAddr::V4(v4)) => format!("{v4}:4711"),
                (2, IpAddr::V6(v6)) => format!("[{v6}]:443"),
                (_, IpAddr::V4(v4)) => v4.to_ipv6_mapped().to_string(),
                (_, v6) => v6.to_string(),
            },
            Hop::Garbage(g) => g.clone(),
        }
    }

    fn ip(&self) -> Option<IpAddr> {
        match self {
            Hop::Ip(ip, _) => Some(canonical(*ip)),
            Hop::Garbage(_) => None,
        }
    }
}

fn hop() -> impl Strategy<Value = Hop> {
    prop_oneof![
        9 => (ip(), any::<u8>()).prop_map(|(ip, s)| Hop::Ip(ip, s)),
        1 => prop_oneof![Just("unknown".to_owned()), Just(String::new()), "[a-z:.0-9 ]{1,12}"]
            .prop_filter("not an address", |g| {
                let g = g.trim();
                g.parse::<IpAddr>().is_err() && g.parse::<std::net::SocketAddr>().is_err()
            })
            .prop_map(Hop::Garbage),
    ]
}

fn xff(values: &[String]) -> HeaderMap {
    let mut h = HeaderMap::new();
    for v in values {
        h.append("x-forwarded-for", HeaderValue::from_str(v).unwrap());
    }
    h
}

fn proxies_of(nets: &[(IpAddr, u8)]) -> Vec<ipnet::IpNet> {
    nets.iter()
        .map(|(a, len)| parse_net(&format!("{a}/{len}")).expect("a valid CIDR"))
        .collect()
}

fn trusted(ip: IpAddr, proxies: &[ipnet::IpNet]) -> bool {
    proxies.iter().any(|n| n.contains(&ip))
}

proptest! {
    #![proptest_config(config(256))]

    /// `parse_net(ip)` is the host net of `ip`; `parse_net(a/len)` contains exactly the
    /// addresses whose first `len` bits are `a`'s; a longer prefix is refused.
    #[test]
    fn cidr_contains_by_bits((a, len) in net(), b in ip(), spaces in " {0,2}") {
        let single = parse_net(&format!("{spaces}{a}{spaces}")).unwrap();
        prop_assert!(single.contains(&a));
        prop_assert_eq!(single.prefix_len(), if a.is_ipv4() { 32 } else { 128 });
        let net = parse_net(&format!("{a}/{len}")).unwrap();
        prop_assert_eq!(net.contains(&b), prefix_match(a, len, b), "{}/{} vs {}", a, len, b);
        prop_assert!(net.contains(&a));
        let max = if a.is_ipv4() { 32 } else { 128 };
        prop_assert_eq!(parse_net(&format!("{a}/{}", max + 1)), None);
    }

    /// Arbitrary text never panics `parse_net`; what it accepts contains its own address.
    #[test]
    fn cidr_arbitrary_text(text in "[0-9a-fA-F:./ x%\\[\\]-]{0,48}|.{0,48}") {
        if let Some(net) = parse_net(&text) {
            prop_assert!(net.contains(&net.network()));
        }
    }

    /// The client address is the peer or one of the hops; with no trusted proxy it is
    /// always the peer; behind a trusted peer it is trusted only if every hop walked was
    /// trusted or a malformed one was met; a malformed hop with only trusted hops to its
    /// right yields the peer.
    #[test]
    fn forwarded_walk(
        peer in ip(),
        mapped_peer in any::<bool>(),
        nets in vec(net(), 0..4),
        trust_peer in any::<bool>(),
        hops in vec(hop(), 0..6),
        split in any::<Index>(),
    ) {
        let peer_ip = match (peer, mapped_peer) {
            (IpAddr::V4(v4), true) => IpAddr::V6(v4.to_ipv6_mapped()),
            (p, _) => p,
        };
        let mut nets = nets;
        if trust_peer {
            nets.push((canonical(peer_ip), 32 * if peer.is_ipv4() { 1 } else { 4 }));
        }
        let proxies = proxies_of(&nets);
        let texts: Vec<String> = hops.iter().map(Hop::text).collect();
        // The same hops in one header or split over two.
        let at = split.index(texts.len() + 1);
        let one = if texts.is_empty() { vec![] } else { vec![texts.join(",")] };
        let two: Vec<String> = [&texts[..at], &texts[at..]]
            .iter()
            .filter(|part| !part.is_empty())
            .map(|part| part.join(","))
            .collect();
        let got = client_address(peer_ip, &xff(&one), &proxies);
        prop_assert_eq!(got, client_address(peer_ip, &xff(&two), &proxies));

        let peer = canonical(peer_ip);
        prop_assert!(got == peer || hops.iter().any(|h| h.ip() == Some(got)));
        if proxies.is_empty() || !trusted(peer, &proxies) {
            prop_assert_eq!(got, peer);
            return Ok(());
        }
        // Walk right to left: the first hop that is malformed or untrusted decides.
        let deciding = hops.iter().rev().find(|h| h.ip().is_none_or(|ip| !trusted(ip, &proxies)));
        match deciding {
            Some(Hop::Garbage(_)) => prop_assert_eq!(got, peer),
            Some(h) => {
                prop_assert_eq!(Some(got), h.ip());
                prop_assert!(!trusted(got, &proxies));
            }
            None => {
                prop_assert!(trusted(got, &proxies));
                prop_assert_eq!(got, hops.first().and_then(Hop::ip).unwrap_or(peer));
            }
        }
    }

    /// A client cannot move its address by prepending hops: once a trusted proxy appended
    /// an untrusted address, anything to its left is ignored.
    #[test]
    fn forwarded_prefix_is_ignored(
        client in ip(),
        proxy in ip(),
        junk in vec(prop_oneof![hop().prop_map(|h| h.text()), "[ -~]{0,20}"], 0..5),
    ) {
        let proxies = proxies_of(&[(canonical(proxy), if proxy.is_ipv4() { 32 } else { 128 })]);
        prop_assume!(!trusted(canonical(client), &proxies));
        let junk: Vec<String> = junk.into_iter().filter(|j| HeaderValue::from_str(j).is_ok()).collect();
        let mut values = junk.clone();
        values.push(client.to_string());
        let got = client_address(proxy, &xff(&values), &proxies);
        prop_assert_eq!(got, canonical(client), "{:?}", values);
    }

    /// Non-UTF-8 `X-Forwarded-For` behind a trusted peer yields the peer.
    #[test]
    fn forwarded_non_utf8(peer in ip(), before in "[0-9., ]{0,20}", byte in 0x80u8..=0xff) {
        let proxies = proxies_of(&[(peer, if peer.is_ipv4() { 32 } else { 128 })]);
        let mut bytes = before.into_bytes();
        bytes.push(byte);
        let mut h = HeaderMap::new();
        h.insert("x-forwarded-for", HeaderValue::from_bytes(&bytes).unwrap());
        prop_assert_eq!(client_address(peer, &h, &proxies), peer);
    }
}

// ---------------------------------------------------------------------------------------
// Configuration.

const TOP_LEVEL: [&str; 9] = [
    "daemon", "control", "session", "stdio", "loopback", "remote", "metrics", "limits", "policy",
];

/// Lines that look like our configuration: known tables and keys, plausible and wrong
/// values, and noise.
fn toml_line() -> impl Strategy<Value = String> {
    let table = prop::sample::select(vec![
        "[daemon]",
        "[control]",
        "[session]",
        "[session.turn]",
        "[stdio]",
        "[loopback]",
        "[remote]",
        "[remote.throttle]",
        "[remote.tls]",
        "[metrics]",
        "[limits]",
        "[[policy]]",
        "[bogus]",
    ])
    .prop_map(str::to_owned);
    let key = prop::sample::select(vec![
        "listen",
        "path",
        "state_dir",
        "runtime_dir",
        "socket",
        "timeout",
        "argv",
        "request_body",
        "tool_result",
        "public_url",
        "issuer",
        "audiences",
        "trusted_proxies",
        "failures",
        "window",
        "wire_names",
        "enabled",
        "allowed_subjects",
        "tool",
        "decision",
        "x",
    ]);
    let value = prop_oneof![
        Just("\"127.0.0.1:0\"".to_owned()),
        Just("\"60s\"".to_owned()),
        Just("\"1MiB\"".to_owned()),
        Just("[\"/bin/true\"]".to_owned()),
        Just("true".to_owned()),
        Just("\"10.0.0.0/8\"".to_owned()),
        Just("\"https://a.example/mcp\"".to_owned()),
        any::<i64>().prop_map(|i| i.to_string()),
        "\"[ -~]{0,20}\"",
        "[ -~]{0,20}",
    ];
    prop_oneof![
        2 => table,
        6 => (key, value).prop_map(|(k, v)| format!("{k} = {v}")),
        1 => ".{0,30}",
    ]
}

proptest! {
    #![proptest_config(config(256))]

    /// TOML-ish text, or anything at all, never panics the parser; every reported issue
    /// names a path.
    #[test]
    fn config_never_panics(lines in vec(toml_line(), 0..16), raw in ".{0,200}") {
        for text in [lines.join("\n"), raw] {
            if let Err(issues) = parse(&text, &Environment::default()) {
                prop_assert!(!issues.is_empty());
                prop_assert!(issues.iter().all(|i| !i.path.is_empty()), "{:?}", issues);
            }
        }
    }

    /// An unknown top-level key is reported with the key itself as the path.
    #[test]
    fn config_unknown_top_level_key(key in "[a-z_][a-z0-9_]{0,15}", value in prop_oneof![Just("1"), Just("\"x\""), Just("{}")]) {
        prop_assume!(!TOP_LEVEL.contains(&key.as_str()));
        let text = format!("{key} = {value}\n[loopback]\nlisten = \"127.0.0.1:0\"\n");
        let issues = parse(&text, &Environment::default()).expect_err("an unknown key is an error");
        prop_assert!(issues.iter().any(|i| i.path == key), "{:?}", issues);
    }
}

// ---------------------------------------------------------------------------------------
// JWT pre-checks, through the shipped verifier with a local key set.

/// RFC 8037 A.2's Ed25519 public key.
const JWKS: &str = r#"{"keys":[{"kty":"OKP","crv":"Ed25519","kid":"k1","x":"11qYAYKxCrfVS_7TyWQHOg7hcvPapiMlrwIaaPcHURo"}]}"#;

/// Unpadded base64url, for building headers.
fn b64url(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, b)| n | u32::from(*b) << (16 - 8 * i));
        for i in 0..=chunk.len() {
            out.push(char::from(ALPHABET[(n >> (18 - 6 * i) & 63) as usize]));
        }
    }
    out
}

/// Strings up to 9000 bytes never panic the verifier; over 8192 bytes is `oversize`,
/// anything else without exactly two dots is `malformed`; a token with a well-formed
/// header for our key but an arbitrary payload and signature is never accepted.
#[test]
fn jwt_pre_checks() {
    let dir = tempfile::tempdir().unwrap();
    let jwks = dir.path().join("jwks.json");
    std::fs::write(&jwks, JWKS).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
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
            cache_path: dir.path().join("jwks-cache.json"),
            start_without_keys: false,
            refresh: robota_mcpd::config::KeyRefresh::DEFAULT,
            introspection: None,
        },
        Metrics::new(),
    )
    .unwrap();
    rt.block_on(verifier.load()).unwrap();
    let verify =
        |token: &str| rt.block_on(verifier.verify(token, SystemTime::now(), Asker::anyone()));

    let mut runner = TestRunner::new(config(256));
    let text = prop_oneof![
        ".{0,64}",
        "[A-Za-z0-9_.=-]{0,200}",
        (8000usize..9000, "[A-Za-z0-9_.-]").prop_map(|(n, c)| c.repeat(n)),
        vec(any::<char>(), 0..9000).prop_map(|cs| cs.into_iter().collect::<String>()),
    ];
    runner
        .run(&text, |token| {
            let got = verify(&token);
            prop_assert!(got.is_err(), "accepted {token:?}");
            if token.len() > MAX_TOKEN_BYTES {
                prop_assert_eq!(got, Err(Reason::Oversize));
            } else if token.matches('.').count() != 2 {
                prop_assert_eq!(got, Err(Reason::Malformed));
            }
            Ok(())
        })
        .unwrap();

    let mut runner = TestRunner::new(config(256));
    let structured = (
        prop::sample::select(vec!["EdDSA", "ES256", "RS256", "HS256", "none", "edDSA"]),
        prop_oneof![
            Just(Some("k1".to_owned())),
            Just(None),
            "[a-z0-9]{0,4}".prop_map(Some)
        ],
        prop_oneof![
            Just(None),
            Just(Some("JWT")),
            Just(Some("at+jwt")),
            Just(Some("x"))
        ],
        vec(any::<u8>(), 0..200),
        prop_oneof![vec(any::<u8>(), 64..=64), vec(any::<u8>(), 0..100)],
    );
    runner
        .run(&structured, |(alg, kid, typ, payload, signature)| {
            let mut header = serde_json::json!({ "alg": alg });
            if let Some(kid) = kid {
                header["kid"] = kid.into();
            }
            if let Some(typ) = typ {
                header["typ"] = typ.into();
            }
            let token = format!(
                "{}.{}.{}",
                b64url(header.to_string().as_bytes()),
                b64url(&payload),
                b64url(&signature)
            );
            let got = verify(&token);
            prop_assert!(got.is_err(), "accepted {token:?}");
            prop_assert_ne!(got, Err(Reason::KeysUnavailable));
            Ok(())
        })
        .unwrap();
}
