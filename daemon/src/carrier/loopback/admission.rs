//! Loopback admission: a pure function of the request head (docs/design.md §5.2).
//!
//! Order: endpoint path, Host (or HTTP/2 `:authority`, and an absolute-form URI must
//! agree), Origin if present → 403; then `Authorization: Bearer <token>` matching a live
//! bearer → else 401 with a bare `WWW-Authenticate: Bearer`. Nothing here reads a body,
//! touches a socket or a clock; the bearer lookup is passed in.

use http::header::{AUTHORIZATION, HOST, ORIGIN};
use http::{HeaderMap, StatusCode, Uri};

use crate::vocab::Reason;

/// What the loopback carrier expects, derived from its bound address and endpoint path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Expected {
    pub path: String,
    /// `127.0.0.1:<bound port>`.
    pub authority: String,
    /// `http://127.0.0.1:<bound port>`.
    pub origin: String,
}

impl Expected {
    pub fn new(path: &str, port: u16) -> Self {
        let authority = format!("127.0.0.1:{port}");
        Self {
            path: path.to_owned(),
            origin: format!("http://{authority}"),
            authority,
        }
    }
}

/// A refused request: the reason decides status and challenge.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Refusal(pub Reason);

impl Refusal {
    pub fn status(self) -> StatusCode {
        match self.0 {
            Reason::WrongPath | Reason::WrongHost | Reason::WrongOrigin => StatusCode::FORBIDDEN,
            Reason::MissingToken | Reason::BadBearer | Reason::Malformed => {
                StatusCode::UNAUTHORIZED
            }
            // Remote-only reasons never come out of loopback admission.
            _ => StatusCode::FORBIDDEN,
        }
    }

    /// The `WWW-Authenticate` value, if the status carries one.
    pub fn challenge(self) -> Option<&'static str> {
        (self.status() == StatusCode::UNAUTHORIZED).then_some("Bearer")
    }
}

/// Longest credential we look at; ours are 64 hex characters.
const MAX_TOKEN_LEN: usize = 256;

/// Admit a request head. `lookup` maps a presented token to the label of a live bearer.
pub fn admit(
    uri: &Uri,
    headers: &HeaderMap,
    expected: &Expected,
    lookup: impl FnOnce(&str) -> Option<String>,
) -> Result<String, Refusal> {
    if uri.path() != expected.path {
        return Err(Refusal(Reason::WrongPath));
    }
    check_authority(uri, headers, &expected.authority)?;
    check_origin(headers, &expected.origin)?;
    let token = bearer_token(headers)?;
    lookup(token).ok_or(Refusal(Reason::BadBearer))
}

fn check_authority(uri: &Uri, headers: &HeaderMap, expected: &str) -> Result<(), Refusal> {
    let wrong = Refusal(Reason::WrongHost);
    let mut hosts = headers.get_all(HOST).iter();
    let host = hosts.next();
    if hosts.next().is_some() {
        return Err(wrong);
    }
    // Absolute-form (HTTP/1.1) or `:authority` (HTTP/2): it must be ours too.
    if let Some(authority) = uri.authority()
        && !authority.as_str().eq_ignore_ascii_case(expected)
    {
        return Err(wrong);
    }
    if uri.scheme().is_some_and(|s| s != &http::uri::Scheme::HTTP) {
        return Err(wrong);
    }
    match host {
        Some(value) if value.as_bytes().eq_ignore_ascii_case(expected.as_bytes()) => Ok(()),
        Some(_) => Err(wrong),
        None if uri.authority().is_some() => Ok(()),
        None => Err(wrong),
    }
}

fn check_origin(headers: &HeaderMap, expected: &str) -> Result<(), Refusal> {
    let mut origins = headers.get_all(ORIGIN).iter();
    match (origins.next(), origins.next()) {
        (None, _) => Ok(()),
        (Some(origin), None) if origin.as_bytes().eq_ignore_ascii_case(expected.as_bytes()) => {
            Ok(())
        }
        _ => Err(Refusal(Reason::WrongOrigin)),
    }
}

/// The token of exactly one `Authorization: Bearer <b64token>` header.
fn bearer_token(headers: &HeaderMap) -> Result<&str, Refusal> {
    let mut values = headers.get_all(AUTHORIZATION).iter();
    let value = values.next().ok_or(Refusal(Reason::MissingToken))?;
    if values.next().is_some() {
        return Err(Refusal(Reason::BadBearer));
    }
    crate::carrier::parse_bearer(value.as_bytes())
        .filter(|token| token.len() <= MAX_TOKEN_LEN)
        .ok_or(Refusal(Reason::BadBearer))
}

#[cfg(test)]
mod tests {
    use http::HeaderValue;

    use super::*;

    const GOOD: &str = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

    struct Case {
        name: &'static str,
        uri: &'static str,
        headers: &'static [(&'static str, &'static str)],
        expect: Result<&'static str, Reason>,
    }

    fn lookup(token: &str) -> Option<String> {
        (token == GOOD).then(|| "default".to_owned())
    }

    const AUTH: (&str, &str) = (
        "authorization",
        "Bearer 0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
    );
    const HOST_OK: (&str, &str) = ("host", "127.0.0.1:8765");

    #[test]
    fn admission_table() {
        let cases = [
            Case {
                name: "valid",
                uri: "/mcp",
                headers: &[HOST_OK, AUTH],
                expect: Ok("default"),
            },
            Case {
                name: "valid with origin",
                uri: "/mcp",
                headers: &[HOST_OK, ("origin", "http://127.0.0.1:8765"), AUTH],
                expect: Ok("default"),
            },
            Case {
                name: "scheme is case-insensitive",
                uri: "/mcp",
                headers: &[
                    HOST_OK,
                    (
                        "authorization",
                        "bearer 0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
                    ),
                ],
                expect: Ok("default"),
            },
            Case {
                name: "query does not change the path",
                uri: "/mcp?x=1",
                headers: &[HOST_OK, AUTH],
                expect: Ok("default"),
            },
            Case {
                name: "wrong path",
                uri: "/other",
                headers: &[HOST_OK, AUTH],
                expect: Err(Reason::WrongPath),
            },
            Case {
                name: "path prefix",
                uri: "/mcp/",
                headers: &[HOST_OK, AUTH],
                expect: Err(Reason::WrongPath),
            },
            Case {
                name: "wrong path before bad host",
                uri: "/x",
                headers: &[("host", "evil.com")],
                expect: Err(Reason::WrongPath),
            },
            Case {
                name: "missing host",
                uri: "/mcp",
                headers: &[AUTH],
                expect: Err(Reason::WrongHost),
            },
            Case {
                name: "suffix attack",
                uri: "/mcp",
                headers: &[("host", "127.0.0.1.evil.com:8765"), AUTH],
                expect: Err(Reason::WrongHost),
            },
            Case {
                name: "trailing dot",
                uri: "/mcp",
                headers: &[("host", "localhost."), AUTH],
                expect: Err(Reason::WrongHost),
            },
            Case {
                name: "localhost",
                uri: "/mcp",
                headers: &[("host", "localhost:8765"), AUTH],
                expect: Err(Reason::WrongHost),
            },
            Case {
                name: "ipv6 loopback",
                uri: "/mcp",
                headers: &[("host", "[::1]:8765"), AUTH],
                expect: Err(Reason::WrongHost),
            },
            Case {
                name: "another port",
                uri: "/mcp",
                headers: &[("host", "127.0.0.1:8766"), AUTH],
                expect: Err(Reason::WrongHost),
            },
            Case {
                name: "no port",
                uri: "/mcp",
                headers: &[("host", "127.0.0.1"), AUTH],
                expect: Err(Reason::WrongHost),
            },
            Case {
                name: "two hosts",
                uri: "/mcp",
                headers: &[HOST_OK, ("host", "evil.com"), AUTH],
                expect: Err(Reason::WrongHost),
            },
            Case {
                name: "absolute-form disagrees",
                uri: "http://evil.com:8765/mcp",
                headers: &[HOST_OK, AUTH],
                expect: Err(Reason::WrongHost),
            },
            Case {
                name: "absolute-form agrees",
                uri: "http://127.0.0.1:8765/mcp",
                headers: &[HOST_OK, AUTH],
                expect: Ok("default"),
            },
            Case {
                name: "h2 authority only",
                uri: "http://127.0.0.1:8765/mcp",
                headers: &[AUTH],
                expect: Ok("default"),
            },
            Case {
                name: "h2 wrong authority",
                uri: "http://evil.com/mcp",
                headers: &[AUTH],
                expect: Err(Reason::WrongHost),
            },
            Case {
                name: "https scheme",
                uri: "https://127.0.0.1:8765/mcp",
                headers: &[AUTH],
                expect: Err(Reason::WrongHost),
            },
            Case {
                name: "null origin",
                uri: "/mcp",
                headers: &[HOST_OK, ("origin", "null"), AUTH],
                expect: Err(Reason::WrongOrigin),
            },
            Case {
                name: "foreign origin",
                uri: "/mcp",
                headers: &[HOST_OK, ("origin", "http://evil.com"), AUTH],
                expect: Err(Reason::WrongOrigin),
            },
            Case {
                name: "origin other port",
                uri: "/mcp",
                headers: &[HOST_OK, ("origin", "http://127.0.0.1:8766"), AUTH],
                expect: Err(Reason::WrongOrigin),
            },
            Case {
                name: "origin https",
                uri: "/mcp",
                headers: &[HOST_OK, ("origin", "https://127.0.0.1:8765"), AUTH],
                expect: Err(Reason::WrongOrigin),
            },
            Case {
                name: "origin localhost",
                uri: "/mcp",
                headers: &[HOST_OK, ("origin", "http://localhost:8765"), AUTH],
                expect: Err(Reason::WrongOrigin),
            },
            Case {
                name: "two origins",
                uri: "/mcp",
                headers: &[
                    HOST_OK,
                    ("origin", "http://127.0.0.1:8765"),
                    ("origin", "http://127.0.0.1:8765"),
                    AUTH,
                ],
                expect: Err(Reason::WrongOrigin),
            },
            Case {
                name: "bad origin before missing token",
                uri: "/mcp",
                headers: &[HOST_OK, ("origin", "null")],
                expect: Err(Reason::WrongOrigin),
            },
            Case {
                name: "missing token",
                uri: "/mcp",
                headers: &[HOST_OK],
                expect: Err(Reason::MissingToken),
            },
            Case {
                name: "wrong token",
                uri: "/mcp",
                headers: &[HOST_OK, ("authorization", "Bearer 00")],
                expect: Err(Reason::BadBearer),
            },
            Case {
                name: "basic scheme",
                uri: "/mcp",
                headers: &[HOST_OK, ("authorization", "Basic YTpi")],
                expect: Err(Reason::BadBearer),
            },
            Case {
                name: "empty bearer",
                uri: "/mcp",
                headers: &[HOST_OK, ("authorization", "Bearer ")],
                expect: Err(Reason::BadBearer),
            },
            Case {
                name: "token with space",
                uri: "/mcp",
                headers: &[HOST_OK, ("authorization", "Bearer a b")],
                expect: Err(Reason::BadBearer),
            },
            Case {
                name: "two authorizations",
                uri: "/mcp",
                headers: &[HOST_OK, AUTH, AUTH],
                expect: Err(Reason::BadBearer),
            },
        ];
        assert!(!cases.is_empty());
        let expected = Expected::new("/mcp", 8765);
        for case in &cases {
            let uri: Uri = case.uri.parse().unwrap();
            let mut headers = HeaderMap::new();
            for (k, v) in case.headers {
                headers.append(*k, HeaderValue::from_static(v));
            }
            let got = admit(&uri, &headers, &expected, lookup);
            let want = case.expect.map(str::to_owned).map_err(Refusal);
            assert_eq!(got, want, "case {:?}", case.name);
        }
    }

    #[test]
    fn statuses_and_challenges() {
        assert_eq!(Refusal(Reason::WrongPath).status(), StatusCode::FORBIDDEN);
        assert_eq!(Refusal(Reason::WrongHost).status(), StatusCode::FORBIDDEN);
        assert_eq!(Refusal(Reason::WrongOrigin).challenge(), None);
        assert_eq!(
            Refusal(Reason::MissingToken).status(),
            StatusCode::UNAUTHORIZED
        );
        assert_eq!(Refusal(Reason::BadBearer).challenge(), Some("Bearer"));
    }

    #[test]
    fn overlong_tokens_are_refused_unhashed() {
        let long = format!("Bearer {}", "a".repeat(MAX_TOKEN_LEN + 1));
        let mut headers = HeaderMap::new();
        headers.insert(AUTHORIZATION, HeaderValue::from_str(&long).unwrap());
        assert_eq!(bearer_token(&headers), Err(Refusal(Reason::BadBearer)));
    }
}
