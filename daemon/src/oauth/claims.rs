//! The claim policy: what the claims of a token must say once its signature verified (or
//! once the issuer's introspection called it active) — `iss`, a single `aud` of ours,
//! `exp`/`nbf`/`iat` within [`CLOCK_SKEW`], `sub`, `client_id`, scopes, the principal
//! allow-list — checked against the caller's clock, apart from keys and I/O.

use std::collections::HashSet;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::Deserialize;
use serde_json::{Map, Value};

use super::Principal;
use crate::vocab::Reason;

/// Allowed clock difference for `exp`, `nbf` and `iat`.
pub const CLOCK_SKEW: Duration = Duration::from_secs(60);

/// The claim rules, separate from keys and I/O.
pub(super) struct Policy {
    pub(super) issuer: String,
    pub(super) audiences: Vec<String>,
    pub(super) required_scopes: Vec<String>,
    pub(super) allowed_subjects: HashSet<String>,
    pub(super) allowed_clients: HashSet<String>,
}

/// A JSON object whose parse fails on a duplicate member (at the top level), so that two
/// parsers can never read different values from one token.
pub(super) struct StrictObject(pub(super) Map<String, Value>);

impl<'de> Deserialize<'de> for StrictObject {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl<'de> serde::de::Visitor<'de> for Visitor {
            type Value = StrictObject;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut access: A,
            ) -> Result<StrictObject, A::Error> {
                let mut map = Map::new();
                while let Some(key) = access.next_key::<String>()? {
                    let value: Value = access.next_value()?;
                    if map.contains_key(&key) {
                        return Err(serde::de::Error::custom("duplicate member"));
                    }
                    map.insert(key, value);
                }
                Ok(StrictObject(map))
            }
        }
        deserializer.deserialize_map(Visitor)
    }
}

/// A token whose claims passed.
pub(super) struct Checked {
    pub(super) principal: Principal,
    pub(super) not_before: Option<SystemTime>,
}

/// A JSON NumericDate (non-negative seconds, possibly fractional) as a time.
fn numeric_date(value: &Value) -> Option<SystemTime> {
    let since_epoch = match value.as_u64() {
        Some(secs) => Duration::from_secs(secs),
        None => Duration::try_from_secs_f64(value.as_f64()?).ok()?,
    };
    UNIX_EPOCH.checked_add(since_epoch)
}

/// `exp` has passed, beyond the skew.
pub(super) fn expired(exp: SystemTime, now: SystemTime) -> bool {
    now.checked_sub(CLOCK_SKEW).is_some_and(|limit| exp < limit)
}

/// `nbf` (or `iat`) is in the future, beyond the skew.
pub(super) fn premature(t: SystemTime, now: SystemTime) -> bool {
    now.checked_add(CLOCK_SKEW).is_none_or(|limit| t > limit)
}

/// Check the claims of a token whose signature verified.
///
/// `aud` must be a single value — a string or a one-element array — equal to one of our
/// audiences. A multi-valued `aud` is refused even when it contains ours: such a token is
/// also good at another resource server, which could replay it to us (the confused-deputy
/// problem; RFC 8707 audience restriction, RFC 9068 §4).
pub(super) fn check_claims(
    claims: &Map<String, Value>,
    policy: &Policy,
    now: SystemTime,
) -> Result<Checked, Reason> {
    match claims.get("iss") {
        Some(Value::String(iss)) if *iss == policy.issuer => {}
        _ => return Err(Reason::WrongIssuer),
    }
    let aud = match claims.get("aud") {
        Some(Value::String(aud)) => Some(aud),
        Some(Value::Array(values)) => match values.as_slice() {
            [Value::String(aud)] => Some(aud),
            _ => None,
        },
        _ => None,
    };
    if !aud.is_some_and(|aud| policy.audiences.iter().any(|a| a == aud)) {
        return Err(Reason::WrongAudience);
    }
    let exp = claims
        .get("exp")
        .and_then(numeric_date)
        .ok_or(Reason::Malformed)?;
    if expired(exp, now) {
        return Err(Reason::Expired);
    }
    let not_before = match claims.get("nbf") {
        None => None,
        Some(nbf) => Some(numeric_date(nbf).ok_or(Reason::Malformed)?),
    };
    if not_before.is_some_and(|nbf| premature(nbf, now)) {
        return Err(Reason::NotYetValid);
    }
    // Issued in the future (beyond the skew): not valid yet either.
    if let Some(iat) = claims.get("iat") {
        let iat = numeric_date(iat).ok_or(Reason::Malformed)?;
        if premature(iat, now) {
            return Err(Reason::NotYetValid);
        }
    }
    let string_claim = |name: &str| match claims.get(name) {
        Some(Value::String(s)) => Ok(s.clone()),
        _ => Err(Reason::Malformed),
    };
    let subject = string_claim("sub")?;
    let client_id = string_claim("client_id")?;
    let scopes = scopes(claims)?;
    if !policy
        .required_scopes
        .iter()
        .all(|required| scopes.contains(required))
    {
        return Err(Reason::MissingScope);
    }
    if !policy.allowed_subjects.contains(&subject) && !policy.allowed_clients.contains(&client_id) {
        return Err(Reason::PrincipalNotAllowed);
    }
    Ok(Checked {
        principal: Principal {
            client_id,
            subject,
            scopes,
            expires_at: exp,
        },
        not_before,
    })
}

/// Scopes from `scope` (space-separated, RFC 9068 §2.2.3) or else `scp` (an array of
/// strings, or a space-separated string).
fn scopes(claims: &Map<String, Value>) -> Result<Vec<String>, Reason> {
    let split = |s: &str| -> Vec<String> {
        s.split(' ')
            .filter(|s| !s.is_empty())
            .map(str::to_owned)
            .collect()
    };
    match (claims.get("scope"), claims.get("scp")) {
        (Some(Value::String(s)), _) => Ok(split(s)),
        (Some(_), _) => Err(Reason::Malformed),
        (None, Some(Value::String(s))) => Ok(split(s)),
        (None, Some(Value::Array(values))) => values
            .iter()
            .map(|v| v.as_str().map(str::to_owned))
            .collect::<Option<Vec<_>>>()
            .ok_or(Reason::Malformed),
        (None, Some(_)) => Err(Reason::Malformed),
        (None, None) => Ok(Vec::new()),
    }
}

#[cfg(test)]
mod tests {
    use jsonwebtoken::Algorithm;
    use serde_json::json;

    use super::*;
    use crate::oauth::testutil::{
        self, AUDIENCE, ISSUER, TestKey, claims, file_verifier, now, unix, verdict, with,
    };

    #[tokio::test]
    async fn claim_refusals() {
        let dir = tempfile::tempdir().unwrap();
        let key = TestKey::new(Algorithm::ES256, "ec");
        let v = file_verifier(dir.path(), &[&key]).await;
        let t = unix(now());
        let cases = [
            (
                "wrong iss",
                json!({"iss": "https://other.example"}),
                Err(Reason::WrongIssuer),
            ),
            (
                "iss with slash",
                json!({"iss": format!("{ISSUER}/")}),
                Err(Reason::WrongIssuer),
            ),
            (
                "iss array",
                json!({"iss": [ISSUER]}),
                Err(Reason::WrongIssuer),
            ),
            ("no iss", json!({"iss": null}), Err(Reason::WrongIssuer)),
            (
                "wrong aud",
                json!({"aud": "https://other.example/mcp"}),
                Err(Reason::WrongAudience),
            ),
            (
                "aud others",
                json!({"aud": ["https://a.example", "https://b.example"]}),
                Err(Reason::WrongAudience),
            ),
            (
                "aud ours and another",
                json!({"aud": [AUDIENCE, "https://b.example"]}),
                Err(Reason::WrongAudience),
            ),
            (
                "aud ours twice",
                json!({"aud": [AUDIENCE, AUDIENCE]}),
                Err(Reason::WrongAudience),
            ),
            ("aud one-element array", json!({"aud": [AUDIENCE]}), Ok(())),
            ("no aud", json!({"aud": null}), Err(Reason::WrongAudience)),
            ("aud number", json!({"aud": 5}), Err(Reason::WrongAudience)),
            (
                "expired beyond skew",
                json!({"exp": t - 61}),
                Err(Reason::Expired),
            ),
            ("expired within skew", json!({"exp": t - 59}), Ok(())),
            (
                "fractional exp",
                json!({"exp": (t + 10) as f64 + 0.5}),
                Ok(()),
            ),
            (
                "nbf beyond skew",
                json!({"nbf": t + 61}),
                Err(Reason::NotYetValid),
            ),
            ("nbf within skew", json!({"nbf": t + 59}), Ok(())),
            (
                "iat in the future",
                json!({"iat": t + 3600}),
                Err(Reason::NotYetValid),
            ),
            ("no exp", json!({"exp": null}), Err(Reason::Malformed)),
            ("exp string", json!({"exp": "soon"}), Err(Reason::Malformed)),
            ("exp negative", json!({"exp": -1}), Err(Reason::Malformed)),
            (
                "exp absurd",
                json!({"exp": u64::MAX}),
                Err(Reason::Malformed),
            ),
            (
                "exp huge float",
                json!({"exp": 1e300}),
                Err(Reason::Malformed),
            ),
            ("nbf string", json!({"nbf": "now"}), Err(Reason::Malformed)),
            ("no sub", json!({"sub": null}), Err(Reason::Malformed)),
            ("sub number", json!({"sub": 7}), Err(Reason::Malformed)),
            (
                "no client_id",
                json!({"client_id": null}),
                Err(Reason::Malformed),
            ),
            (
                "missing scope",
                json!({"scope": "other"}),
                Err(Reason::MissingScope),
            ),
            (
                "no scope at all",
                json!({"scope": null}),
                Err(Reason::MissingScope),
            ),
            (
                "scope prefix only",
                json!({"scope": "mcp:tools:read"}),
                Err(Reason::MissingScope),
            ),
            (
                "scope array",
                json!({"scope": ["mcp:tools"]}),
                Err(Reason::Malformed),
            ),
            (
                "scp array",
                json!({"scope": null, "scp": ["mcp:tools"]}),
                Ok(()),
            ),
            (
                "scp string",
                json!({"scope": null, "scp": "x mcp:tools"}),
                Ok(()),
            ),
            (
                "subject not allowed",
                json!({"sub": "mallory"}),
                Err(Reason::PrincipalNotAllowed),
            ),
            (
                "allowed client",
                json!({"sub": "mallory", "client_id": "client-b"}),
                Ok(()),
            ),
            (
                "client not allowed",
                json!({"sub": "mallory", "client_id": "client-c"}),
                Err(Reason::PrincipalNotAllowed),
            ),
        ];
        assert!(!cases.is_empty());
        for (name, changes, expected) in cases {
            let token = key.sign(&key.header(), &with(changes));
            let got = verdict(&v, &token).await.map(|_| ());
            assert_eq!(got, expected, "{name}");
        }
    }

    #[test]
    fn testutil_fixtures_are_consistent() {
        // The fixtures' claims pass the standard policy directly.
        let policy = Policy {
            issuer: ISSUER.into(),
            audiences: vec![AUDIENCE.into()],
            required_scopes: vec![testutil::SCOPE.into()],
            allowed_subjects: ["alice".to_owned()].into(),
            allowed_clients: HashSet::new(),
        };
        let Value::Object(c) = claims() else { panic!() };
        assert!(check_claims(&c, &policy, now()).is_ok());
    }
}
