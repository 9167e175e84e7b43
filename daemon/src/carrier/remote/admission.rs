//! Remote admission (docs/design.md §6.2, §6.8): pure functions of the request head, the verifier's
//! verdict and the throttle's answer. No socket, no clock, no body.
//!
//! Every name checked comes from the public URL: the endpoint path, the metadata path
//! (`/.well-known/oauth-protected-resource` + endpoint path, RFC 9728 §3.1), the Host
//! (the public authority; the default port is implied) and the Origin.

use http::header::{AUTHORIZATION, HOST, ORIGIN};
use http::{HeaderMap, StatusCode, Uri};

use crate::config::PublicUrl;
use crate::oauth::Principal;
use crate::vocab::Reason;

/// Where a request is going.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    Endpoint,
    Metadata,
    /// Any other path: 404, not audited.
    NotFound,
}

/// Which path the request names, then whether Host and Origin are the public ones.
pub fn route(uri: &Uri, headers: &HeaderMap, url: &PublicUrl) -> Result<Route, Reason> {
    let route = if uri.path() == url.path() {
        Route::Endpoint
    } else if uri.path() == url.metadata_path() {
        Route::Metadata
    } else {
        return Ok(Route::NotFound);
    };
    let mut hosts = headers.get_all(HOST).iter();
    let host = hosts.next();
    if hosts.next().is_some() {
        return Err(Reason::WrongHost);
    }
    let uri_ok = uri.authority().is_none_or(|a| url.is_authority(a.as_str()));
    let host_ok = match host {
        Some(h) => h.to_str().is_ok_and(|h| url.is_authority(h)),
        None => uri.authority().is_some(),
    };
    if !uri_ok || !host_ok {
        return Err(Reason::WrongHost);
    }
    let mut origins = headers.get_all(ORIGIN).iter();
    match (origins.next(), origins.next()) {
        (None, _) => {}
        (Some(o), None) if url.is_origin(o.as_bytes()) => {}
        _ => return Err(Reason::WrongOrigin),
    }
    Ok(route)
}

/// What the `Authorization` header holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Credentials<'a> {
    Missing,
    /// Not exactly one `Bearer <b64token>` header: 400 `invalid_request`.
    Malformed,
    Token(&'a str),
}

pub fn credentials(headers: &HeaderMap) -> Credentials<'_> {
    let mut values = headers.get_all(AUTHORIZATION).iter();
    let Some(value) = values.next() else {
        return Credentials::Missing;
    };
    if values.next().is_some() {
        return Credentials::Malformed;
    }
    match crate::carrier::parse_bearer(value.as_bytes()) {
        Some(token) => Credentials::Token(token),
        None => Credentials::Malformed,
    }
}

/// Why a request with credentials (or without) failed, before throttling is applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    Missing,
    MalformedHeader,
    /// The verifier's refusal.
    Token(Reason),
}

/// A refused request: status, challenge, audit flags.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    pub reason: Reason,
    pub status: StatusCode,
    pub challenge: Option<String>,
    /// Answered 429 because the address was over its budget.
    pub throttled: bool,
    pub retry_after: Option<u64>,
}

/// What challenges say besides the error code.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Challenges {
    pub metadata_url: String,
    /// Space-separated required scopes (empty: none).
    pub scope: String,
}

impl Challenges {
    fn scope_param(&self) -> String {
        if self.scope.is_empty() {
            String::new()
        } else {
            format!(", scope=\"{}\"", self.scope)
        }
    }

    fn missing(&self) -> String {
        format!(
            "Bearer resource_metadata=\"{}\"{}",
            self.metadata_url,
            self.scope_param()
        )
    }

    fn error(&self, code: &str) -> String {
        format!(
            "Bearer error=\"{code}\", resource_metadata=\"{}\"",
            self.metadata_url
        )
    }

    /// `insufficient_scope` naming `scope` (space-separated): what a new token must carry.
    fn insufficient_scope(&self, scope: &str) -> String {
        let scope = if scope.is_empty() {
            String::new()
        } else {
            format!(", scope=\"{scope}\"")
        };
        format!(
            "Bearer error=\"insufficient_scope\"{scope}, resource_metadata=\"{}\"",
            self.metadata_url
        )
    }

    /// A valid token whose principal is not admitted: no error code a client could cure
    /// by asking for other scopes, only where the resource's metadata is.
    fn not_admitted(&self) -> String {
        format!("Bearer resource_metadata=\"{}\"", self.metadata_url)
    }
}

/// A refusal for a wrong Host or Origin: 403, audited, never counted.
pub fn wrong_name(reason: Reason) -> Refusal {
    Refusal {
        reason,
        status: StatusCode::FORBIDDEN,
        challenge: None,
        throttled: false,
        retry_after: None,
    }
}

/// Decide on a verification outcome. `fail` counts a failure against the client's budget
/// and answers whether the client was over it before this failure (`Some(seconds left)`:
/// throttled); it is called once for every failure that counts, and for nothing else.
pub fn decide(
    outcome: Result<Principal, Failure>,
    fail: impl FnOnce() -> Option<u64>,
    challenges: &Challenges,
) -> Result<Principal, Refusal> {
    let failure = match outcome {
        // Verified first: a valid token is never throttled.
        Ok(principal) => return Ok(principal),
        Err(f) => f,
    };
    // The keys' or the issuer's absence is not the client's failure: never counted.
    let unavailable = match failure {
        // Keys are asked for again at most once per refetch cooldown.
        Failure::Token(r @ Reason::KeysUnavailable) => {
            Some((r, crate::oauth::keyset::REFETCH_COOLDOWN.as_secs()))
        }
        Failure::Token(r @ Reason::IntrospectionUnavailable) => {
            Some((r, crate::oauth::introspect::RETRY_AFTER_SECS))
        }
        _ => None,
    };
    if let Some((reason, retry)) = unavailable {
        return Err(Refusal {
            reason,
            status: StatusCode::SERVICE_UNAVAILABLE,
            challenge: None,
            throttled: false,
            retry_after: Some(retry),
        });
    }
    let over_budget = fail();
    let (reason, status, challenge) = match failure {
        Failure::Missing => (
            Reason::MissingToken,
            StatusCode::UNAUTHORIZED,
            Some(challenges.missing()),
        ),
        Failure::MalformedHeader => (
            Reason::Malformed,
            StatusCode::BAD_REQUEST,
            Some(challenges.error("invalid_request")),
        ),
        // The issuer was not asked because the client is over its budget: throttled,
        // even if its window has just ended.
        Failure::Token(Reason::NotIntrospected) => {
            return Err(Refusal {
                reason: Reason::NotIntrospected,
                status: StatusCode::TOO_MANY_REQUESTS,
                challenge: None,
                throttled: true,
                retry_after: Some(over_budget.unwrap_or(1).max(1)),
            });
        }
        Failure::Token(Reason::MissingScope) => (
            Reason::MissingScope,
            StatusCode::FORBIDDEN,
            Some(challenges.insufficient_scope(&challenges.scope)),
        ),
        // No new token can cure it: never `insufficient_scope`, which would send an MCP
        // client round the authorization loop again for the same scopes.
        Failure::Token(Reason::PrincipalNotAllowed) => (
            Reason::PrincipalNotAllowed,
            StatusCode::FORBIDDEN,
            Some(challenges.not_admitted()),
        ),
        Failure::Token(r) => (
            r,
            StatusCode::UNAUTHORIZED,
            Some(challenges.error("invalid_token")),
        ),
    };
    if let Some(seconds) = over_budget {
        return Err(Refusal {
            reason,
            status: StatusCode::TOO_MANY_REQUESTS,
            challenge: None,
            throttled: true,
            retry_after: Some(seconds.max(1)),
        });
    }
    Err(Refusal {
        reason,
        status,
        challenge,
        throttled: false,
        retry_after: None,
    })
}

/// The step-up answer for a call of a tool that needs scopes an admitted (valid) token
/// lacks: 403 `insufficient_scope` naming every scope the call needs, so the client can
/// get a token for exactly that. Audited `missing-scope`; never counted toward
/// throttling, because the token is valid.
pub fn step_up(needed: &[String], challenges: &Challenges) -> Refusal {
    Refusal {
        reason: Reason::MissingScope,
        status: StatusCode::FORBIDDEN,
        challenge: Some(challenges.insufficient_scope(&needed.join(" "))),
        throttled: false,
        retry_after: None,
    }
}

/// The scopes `needed` that the token's `held` scopes lack (empty: none).
pub fn lacking<'a>(needed: &'a [String], held: &[String]) -> Vec<&'a String> {
    needed.iter().filter(|s| !held.contains(s)).collect()
}

/// The RFC 9728 protected-resource metadata document; `scopes` lists every scope the
/// configuration names.
pub fn metadata_document(url: &PublicUrl, issuer: &str, scopes: &[String]) -> serde_json::Value {
    serde_json::json!({
        "resource": url.as_str(),
        "authorization_servers": [issuer],
        "scopes_supported": scopes,
        "bearer_methods_supported": ["header"],
    })
}

#[cfg(test)]
mod tests {
    use std::time::SystemTime;

    use http::HeaderValue;

    use super::*;

    fn head(uri: &str, headers: &[(&'static str, &'static str)]) -> (Uri, HeaderMap) {
        let mut h = HeaderMap::new();
        for (k, v) in headers {
            h.append(*k, HeaderValue::from_static(v));
        }
        (uri.parse().unwrap(), h)
    }

    fn url() -> PublicUrl {
        PublicUrl::parse("https://mcp.example.com/team/ops/mcp").unwrap()
    }

    #[test]
    fn routing_table() {
        let u = url();
        let host = ("host", "mcp.example.com");
        type Case = (
            &'static str,
            &'static str,
            Vec<(&'static str, &'static str)>,
            Result<Route, Reason>,
        );
        let cases: Vec<Case> = vec![
            ("endpoint", "/team/ops/mcp", vec![host], Ok(Route::Endpoint)),
            (
                "endpoint with :443",
                "/team/ops/mcp",
                vec![("host", "mcp.example.com:443")],
                Ok(Route::Endpoint),
            ),
            (
                "endpoint host case",
                "/team/ops/mcp",
                vec![("host", "MCP.Example.COM")],
                Ok(Route::Endpoint),
            ),
            (
                "metadata",
                "/.well-known/oauth-protected-resource/team/ops/mcp",
                vec![host],
                Ok(Route::Metadata),
            ),
            (
                "bare metadata path is another path",
                "/.well-known/oauth-protected-resource",
                vec![host],
                Ok(Route::NotFound),
            ),
            (
                "listener path is not ours",
                "/mcp",
                vec![host],
                Ok(Route::NotFound),
            ),
            (
                "other path",
                "/",
                vec![("host", "evil.com")],
                Ok(Route::NotFound),
            ),
            (
                "wrong host",
                "/team/ops/mcp",
                vec![("host", "evil.com")],
                Err(Reason::WrongHost),
            ),
            (
                "listener authority",
                "/team/ops/mcp",
                vec![("host", "127.0.0.1:8443")],
                Err(Reason::WrongHost),
            ),
            (
                "other port",
                "/team/ops/mcp",
                vec![("host", "mcp.example.com:8443")],
                Err(Reason::WrongHost),
            ),
            (
                "suffix",
                "/team/ops/mcp",
                vec![("host", "mcp.example.com.evil.com")],
                Err(Reason::WrongHost),
            ),
            (
                "userinfo",
                "/team/ops/mcp",
                vec![("host", "a@mcp.example.com")],
                Err(Reason::WrongHost),
            ),
            ("no host", "/team/ops/mcp", vec![], Err(Reason::WrongHost)),
            (
                "two hosts",
                "/team/ops/mcp",
                vec![host, host],
                Err(Reason::WrongHost),
            ),
            (
                "h2 authority",
                "https://mcp.example.com/team/ops/mcp",
                vec![],
                Ok(Route::Endpoint),
            ),
            (
                "h2 wrong authority",
                "https://evil.com/team/ops/mcp",
                vec![],
                Err(Reason::WrongHost),
            ),
            (
                "absolute-form disagrees",
                "https://evil.com/team/ops/mcp",
                vec![host],
                Err(Reason::WrongHost),
            ),
            (
                "origin ok",
                "/team/ops/mcp",
                vec![host, ("origin", "https://mcp.example.com")],
                Ok(Route::Endpoint),
            ),
            (
                "origin with its default port spelled out",
                "/team/ops/mcp",
                vec![host, ("origin", "https://MCP.example.com:443")],
                Ok(Route::Endpoint),
            ),
            (
                "origin with another port",
                "/team/ops/mcp",
                vec![host, ("origin", "https://mcp.example.com:8443")],
                Err(Reason::WrongOrigin),
            ),
            (
                "origin with a port that only starts as the default",
                "/team/ops/mcp",
                vec![host, ("origin", "https://mcp.example.com:4430")],
                Err(Reason::WrongOrigin),
            ),
            (
                "origin with a path",
                "/team/ops/mcp",
                vec![host, ("origin", "https://mcp.example.com:443/")],
                Err(Reason::WrongOrigin),
            ),
            (
                "origin null",
                "/team/ops/mcp",
                vec![host, ("origin", "null")],
                Err(Reason::WrongOrigin),
            ),
            (
                "origin http",
                "/team/ops/mcp",
                vec![host, ("origin", "http://mcp.example.com")],
                Err(Reason::WrongOrigin),
            ),
            (
                "origin other",
                "/team/ops/mcp",
                vec![host, ("origin", "https://evil.com")],
                Err(Reason::WrongOrigin),
            ),
            (
                "metadata wrong host",
                "/.well-known/oauth-protected-resource/team/ops/mcp",
                vec![("host", "x")],
                Err(Reason::WrongHost),
            ),
        ];
        assert!(!cases.is_empty());
        for (name, uri, headers, want) in cases {
            let (uri, h) = head(uri, &headers);
            assert_eq!(route(&uri, &h, &u), want, "{name}");
        }
    }

    #[test]
    fn credential_parsing() {
        let (_, h) = head("/", &[]);
        assert_eq!(credentials(&h), Credentials::Missing);
        let (_, h) = head("/", &[("authorization", "Bearer abc.def.ghi")]);
        assert_eq!(credentials(&h), Credentials::Token("abc.def.ghi"));
        for bad in [
            &[("authorization", "Basic YTpi")][..],
            &[("authorization", "Bearer a b")],
            &[("authorization", "Bearer x"), ("authorization", "Bearer x")],
        ] {
            let (_, h) = head("/", bad);
            assert_eq!(credentials(&h), Credentials::Malformed, "{bad:?}");
        }
    }

    fn challenges() -> Challenges {
        Challenges {
            metadata_url: "https://h/.well-known/oauth-protected-resource/mcp".into(),
            scope: "mcp tools".into(),
        }
    }

    /// `decide` with a throttle that answers `over`: the decision and whether the failure
    /// was counted.
    fn decided(
        outcome: Result<Principal, Failure>,
        over: Option<u64>,
        c: &Challenges,
    ) -> (Result<Principal, Refusal>, bool) {
        let mut counted = false;
        let decision = decide(
            outcome,
            || {
                counted = true;
                over
            },
            c,
        );
        (decision, counted)
    }

    #[test]
    fn decisions() {
        let c = challenges();
        let principal = Principal {
            client_id: "c".into(),
            subject: "s".into(),
            scopes: vec![],
            expires_at: SystemTime::UNIX_EPOCH,
        };
        assert_eq!(
            decided(Ok(principal.clone()), Some(30), &c),
            (Ok(principal), false),
            "valid is never throttled, nor counted"
        );

        let (r, counted) = decided(Err(Failure::Missing), None, &c);
        let r = r.unwrap_err();
        assert_eq!(
            (r.reason, r.status, counted),
            (Reason::MissingToken, StatusCode::UNAUTHORIZED, true)
        );
        assert_eq!(
            r.challenge.as_deref(),
            Some(
                r#"Bearer resource_metadata="https://h/.well-known/oauth-protected-resource/mcp", scope="mcp tools""#
            )
        );
        let r = decide(Err(Failure::MalformedHeader), || None, &c).unwrap_err();
        assert_eq!(
            (r.reason, r.status),
            (Reason::Malformed, StatusCode::BAD_REQUEST)
        );
        assert_eq!(
            r.challenge.as_deref(),
            Some(
                r#"Bearer error="invalid_request", resource_metadata="https://h/.well-known/oauth-protected-resource/mcp""#
            )
        );
        for reason in [
            Reason::Expired,
            Reason::BadSignature,
            Reason::Oversize,
            Reason::UnknownKey,
            Reason::WrongAudience,
        ] {
            let r = decide(Err(Failure::Token(reason)), || None, &c).unwrap_err();
            assert_eq!((r.reason, r.status), (reason, StatusCode::UNAUTHORIZED));
            assert!(
                r.challenge
                    .unwrap()
                    .starts_with(r#"Bearer error="invalid_token""#)
            );
        }
        let r = decide(Err(Failure::Token(Reason::MissingScope)), || None, &c).unwrap_err();
        assert_eq!(r.status, StatusCode::FORBIDDEN);
        assert_eq!(
            r.challenge.as_deref(),
            Some(
                r#"Bearer error="insufficient_scope", scope="mcp tools", resource_metadata="https://h/.well-known/oauth-protected-resource/mcp""#
            )
        );
        // A principal no token can make acceptable: 403, and nothing to step up to.
        let (r, counted) = decided(Err(Failure::Token(Reason::PrincipalNotAllowed)), None, &c);
        let r = r.unwrap_err();
        assert_eq!((r.status, counted), (StatusCode::FORBIDDEN, true));
        assert_eq!(
            r.challenge.as_deref(),
            Some(
                r#"Bearer resource_metadata="https://h/.well-known/oauth-protected-resource/mcp""#
            )
        );
        for reason in [Reason::KeysUnavailable, Reason::IntrospectionUnavailable] {
            let (r, counted) = decided(Err(Failure::Token(reason)), Some(5), &c);
            let r = r.unwrap_err();
            assert_eq!(
                (r.reason, r.status, counted, r.throttled, r.challenge),
                (reason, StatusCode::SERVICE_UNAVAILABLE, false, false, None)
            );
            assert!(r.retry_after.is_some_and(|s| s >= 1));
        }

        let r = decide(Err(Failure::Token(Reason::Expired)), || Some(17), &c).unwrap_err();
        assert_eq!(
            (r.status, r.reason, r.throttled, r.retry_after),
            (
                StatusCode::TOO_MANY_REQUESTS,
                Reason::Expired,
                true,
                Some(17)
            )
        );
        assert_eq!(
            decide(Err(Failure::Missing), || Some(0), &c)
                .unwrap_err()
                .retry_after,
            Some(1)
        );

        let w = wrong_name(Reason::WrongHost);
        assert_eq!((w.status, w.throttled), (StatusCode::FORBIDDEN, false));
    }

    #[test]
    fn step_up_names_every_scope_the_call_needs() {
        let c = challenges();
        let needed: Vec<String> = vec!["mcp".into(), "mcp:write".into(), "db:read".into()];
        let held: Vec<String> = vec!["mcp".into()];
        assert_eq!(lacking(&needed, &held), vec!["mcp:write", "db:read"]);
        assert!(lacking(&needed, &needed).is_empty());
        let r = step_up(&needed, &c);
        assert_eq!(
            (r.reason, r.status, r.throttled),
            (Reason::MissingScope, StatusCode::FORBIDDEN, false)
        );
        assert_eq!(
            r.challenge.as_deref(),
            Some(
                r#"Bearer error="insufficient_scope", scope="mcp mcp:write db:read", resource_metadata="https://h/.well-known/oauth-protected-resource/mcp""#
            )
        );
    }

    #[test]
    fn challenges_never_describe() {
        let c = challenges();
        for f in [
            Failure::Missing,
            Failure::MalformedHeader,
            Failure::Token(Reason::Expired),
            Failure::Token(Reason::MissingScope),
        ] {
            let r = decide(Err(f), || None, &c).unwrap_err();
            assert!(!r.challenge.unwrap().contains("error_description"));
        }
    }

    #[test]
    fn metadata() {
        let doc = metadata_document(&url(), "https://auth.example.com", &["mcp".into()]);
        assert_eq!(
            doc,
            serde_json::json!({
                "resource": "https://mcp.example.com/team/ops/mcp",
                "authorization_servers": ["https://auth.example.com"],
                "scopes_supported": ["mcp"],
                "bearer_methods_supported": ["header"],
            })
        );
    }
}
