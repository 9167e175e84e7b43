//! Reading a compact JWS before any key is chosen: its three base64url segments and its
//! header (`alg` one of the configured, `typ` `at+jwt`, no `crit`, `kid` a string), and
//! the jsonwebtoken `Validation` that then checks its signature and nothing else.

use jsonwebtoken::{Algorithm, Validation};
use serde_json::Value;

use super::b64;
use super::claims::StrictObject;
use crate::vocab::Reason;

/// The algorithms this verifier can be configured with.
pub const SUPPORTED_ALGORITHMS: [Algorithm; 3] =
    [Algorithm::RS256, Algorithm::ES256, Algorithm::EdDSA];

/// A jsonwebtoken `Validation` that checks the signature and nothing else: the claims
/// are checked by [`check_claims`](super::claims::check_claims) against the caller's clock.
pub(super) fn signature_only(alg: Algorithm) -> Validation {
    let mut v = Validation::new(alg);
    v.required_spec_claims.clear();
    v.validate_exp = false;
    v.validate_nbf = false;
    v.validate_aud = false;
    v.leeway = 0;
    v
}

/// The three segments, each base64url (the signature may be empty; it then fails to verify).
pub(super) fn split(token: &str) -> Result<(&str, &str, &str), Reason> {
    let mut parts = token.split('.');
    let (Some(header), Some(payload), Some(signature), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(Reason::Malformed);
    };
    if header.is_empty()
        || payload.is_empty()
        || ![header, payload, signature]
            .iter()
            .all(|s| b64::is_alphabet(s.as_bytes()))
    {
        return Err(Reason::Malformed);
    }
    Ok((header, payload, signature))
}

/// What we use from a JWS header.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct TokenHeader {
    pub(super) alg: Algorithm,
    pub(super) kid: Option<String>,
    /// `typ` is `at+jwt` (RFC 9068 §2.1), in either spelling, any case.
    access_token: bool,
}

/// Read the header of an access token: [`jose_header`], then `typ` must be `at+jwt`.
pub(super) fn parse_header(segment: &str, allowed: &[Algorithm]) -> Result<TokenHeader, Reason> {
    let header = jose_header(segment, allowed)?;
    if !header.access_token {
        return Err(Reason::WrongType);
    }
    Ok(header)
}

/// Read a JWS header ourselves, before choosing a key (jsonwebtoken's `decode_header`
/// cannot tell `alg: none` from a broken header): strict base64url, a JSON object without
/// duplicate members, `alg` one of `allowed`, no `crit`, `kid` a string if present.
fn jose_header(segment: &str, allowed: &[Algorithm]) -> Result<TokenHeader, Reason> {
    let bytes = b64::decode(segment.as_bytes()).ok_or(Reason::Malformed)?;
    let StrictObject(header) = serde_json::from_slice(&bytes).map_err(|_| Reason::Malformed)?;
    let alg = match header.get("alg") {
        Some(Value::String(alg)) => alg.as_str(),
        _ => return Err(Reason::Malformed),
    };
    let alg = SUPPORTED_ALGORITHMS
        .into_iter()
        .find(|a| algorithm_name(*a) == alg && allowed.contains(a))
        .ok_or(Reason::UnsupportedAlgorithm)?;
    let access_token = match header.get("typ") {
        Some(Value::String(typ)) => {
            typ.eq_ignore_ascii_case("at+jwt") || typ.eq_ignore_ascii_case("application/at+jwt")
        }
        _ => false,
    };
    // We implement no JWS extension, so any `crit` is unmet (RFC 7515 §4.1.11).
    if header.contains_key("crit") {
        return Err(Reason::Malformed);
    }
    let kid = match header.get("kid") {
        None => None,
        Some(Value::String(kid)) => Some(kid.clone()),
        Some(_) => return Err(Reason::Malformed),
    };
    // `jku`, `x5u`, `jwk`, `x5c`: deliberately ignored — keys come only from our key set.
    Ok(TokenHeader {
        alg,
        kid,
        access_token,
    })
}

fn algorithm_name(alg: Algorithm) -> &'static str {
    match alg {
        Algorithm::RS256 => "RS256",
        Algorithm::ES256 => "ES256",
        Algorithm::EdDSA => "EdDSA",
        _ => "",
    }
}

#[cfg(test)]
mod tests {
    use jsonwebtoken::EncodingKey;
    use serde_json::json;

    use super::*;
    use crate::config::KeySource;
    use crate::oauth::jwks::{self, ParsedKeys};
    use crate::oauth::jwt::ensure_crypto_provider;
    use crate::oauth::keyset::{KeySet, Origin};
    use crate::oauth::testutil::{
        AUDIENCE, ISSUER, Route, TestKey, TestServer, build, claims, config, file_verifier, jwks,
        now, sign_with, testutil_b64, unsigned, verdict,
    };

    #[tokio::test]
    async fn refuses_alg_none_and_hmac_with_the_public_key() {
        let dir = tempfile::tempdir().unwrap();
        let rsa = TestKey::new(Algorithm::RS256, "rsa");
        let v = file_verifier(dir.path(), &[&rsa]).await;
        let none = format!(
            "{}.",
            unsigned(
                &json!({"alg": "none", "typ": "at+jwt", "kid": "rsa"}),
                &claims()
            )
        );
        assert_eq!(verdict(&v, &none).await, Err(Reason::UnsupportedAlgorithm));
        let none_upper = format!(
            "{}.",
            unsigned(&json!({"alg": "NONE", "typ": "at+jwt"}), &claims())
        );
        assert_eq!(
            verdict(&v, &none_upper).await,
            Err(Reason::UnsupportedAlgorithm)
        );
        // The classic key-confusion attack: HS256 keyed with the RSA public key.
        let secret = EncodingKey::from_secret(rsa.public_pem.as_bytes()).unwrap();
        let hs = sign_with(
            &secret,
            Algorithm::HS256,
            &json!({"alg": "HS256", "typ": "at+jwt", "kid": "rsa"}),
            &claims(),
        );
        assert_eq!(verdict(&v, &hs).await, Err(Reason::UnsupportedAlgorithm));
        // An algorithm we support but did not configure.
        let mut cfg = config(
            ISSUER,
            KeySource::JwksFile(dir.path().join("jwks.json")),
            dir.path(),
        );
        cfg.algorithms = vec![Algorithm::RS256];
        let rs_only = build(cfg);
        rs_only.load().await.unwrap();
        let ec = TestKey::new(Algorithm::ES256, "ec");
        assert_eq!(
            verdict(&rs_only, &ec.token()).await,
            Err(Reason::UnsupportedAlgorithm)
        );
        assert_eq!(v.signature_checks() + rs_only.signature_checks(), 0);
    }

    #[tokio::test]
    async fn jku_x5u_and_embedded_jwk_are_never_used() {
        let dir = tempfile::tempdir().unwrap();
        let ours = TestKey::new(Algorithm::ES256, "ours");
        let evil = TestKey::new(Algorithm::ES256, "evil");
        let server = TestServer::start(dir.path()).await;
        server.route("/evil-jwks", Route::json(jwks(&[&evil])));
        let v = file_verifier(dir.path(), &[&ours]).await;
        let mut header = evil.header();
        header["jku"] = json!(server.url("/evil-jwks"));
        header["x5u"] = json!(server.url("/evil-cert"));
        header["jwk"] = evil.jwk.clone();
        assert_eq!(
            verdict(&v, &evil.sign(&header, &claims())).await,
            Err(Reason::UnknownKey)
        );
        // Same attacker headers, but the evil key pretends to be ours.
        header["kid"] = json!("ours");
        assert_eq!(
            verdict(&v, &evil.sign(&header, &claims())).await,
            Err(Reason::BadSignature)
        );
        // Our own token with a `jku` elsewhere is judged against our keys only.
        let mut header = ours.header();
        header["jku"] = json!(server.url("/evil-jwks"));
        assert!(verdict(&v, &ours.sign(&header, &claims())).await.is_ok());
        assert_eq!(server.total_hits(), 0, "nothing was fetched from jku/x5u");
    }

    #[tokio::test]
    async fn typ_must_be_at_jwt() {
        let dir = tempfile::tempdir().unwrap();
        let key = TestKey::new(Algorithm::EdDSA, "ed");
        let v = file_verifier(dir.path(), &[&key]).await;
        for (typ, expected) in [
            (json!("JWT"), Err(Reason::WrongType)),
            (json!("at+JWT"), Ok(())),
            (json!("application/AT+jwt"), Ok(())),
            (json!("at+jwt; x"), Err(Reason::WrongType)),
            (json!(["at+jwt"]), Err(Reason::WrongType)),
            (Value::Null, Err(Reason::WrongType)),
        ] {
            let mut header = key.header();
            if typ.is_null() {
                header.as_object_mut().unwrap().remove("typ");
            } else {
                header["typ"] = typ.clone();
            }
            let got = verdict(&v, &key.sign(&header, &claims())).await.map(|_| ());
            assert_eq!(got, expected, "typ {typ}");
        }
    }

    #[tokio::test]
    async fn shape_refusals() {
        let dir = tempfile::tempdir().unwrap();
        let key = TestKey::new(Algorithm::ES256, "ec");
        let v = file_verifier(dir.path(), &[&key]).await;
        let good = key.token();
        let parts: Vec<&str> = good.split('.').collect();
        let header_of =
            |h: &str| format!("{}.{}.{}", testutil_b64(h.as_bytes()), parts[1], parts[2]);
        let cases = [
            ("empty", String::new()),
            ("two segments", format!("{}.{}", parts[0], parts[1])),
            ("four segments", format!("{good}.{}", parts[2])),
            ("padded", format!("{}=.{}.{}", parts[0], parts[1], parts[2])),
            (
                "standard alphabet",
                format!("{}.{}+/.{}", parts[0], parts[1], parts[2]),
            ),
            ("not base64", format!("{}.*.{}", parts[0], parts[2])),
            ("empty header", format!(".{}.{}", parts[1], parts[2])),
            ("empty payload", format!("{}..{}", parts[0], parts[2])),
            (
                "header 4n+1",
                format!("{}a.{}.{}", parts[0], parts[1], parts[2]),
            ),
            ("header not JSON", header_of("not json")),
            ("header array", header_of("[1,2]")),
            (
                "header without alg",
                header_of(r#"{"typ":"at+jwt","kid":"ec"}"#),
            ),
            ("alg not a string", header_of(r#"{"alg":5,"typ":"at+jwt"}"#)),
            (
                "duplicate alg",
                header_of(r#"{"alg":"ES256","alg":"none","typ":"at+jwt","kid":"ec"}"#),
            ),
            (
                "crit",
                header_of(r#"{"alg":"ES256","typ":"at+jwt","kid":"ec","crit":["exp"]}"#),
            ),
            (
                "kid not a string",
                header_of(r#"{"alg":"ES256","typ":"at+jwt","kid":7}"#),
            ),
        ];
        for (name, token) in cases {
            assert_eq!(verdict(&v, &token).await, Err(Reason::Malformed), "{name}");
        }
        // A signed payload that is not a JSON object, or has a duplicate claim.
        let signed_payload = |payload: &str| {
            let message = format!("{}.{}", parts[0], testutil_b64(payload.as_bytes()));
            let sig =
                jsonwebtoken::crypto::sign(message.as_bytes(), &key.encoding, key.alg).unwrap();
            format!("{message}.{sig}")
        };
        let c = claims();
        let dup = format!(
            r#"{{"iss":"{ISSUER}","aud":"{AUDIENCE}","exp":{},"sub":"bob","sub":"alice","client_id":"client-a","scope":"mcp:tools"}}"#,
            c["exp"]
        );
        assert_eq!(
            verdict(&v, &signed_payload(&dup)).await,
            Err(Reason::Malformed)
        );
        assert_eq!(
            verdict(&v, &signed_payload("[1]")).await,
            Err(Reason::Malformed)
        );
        assert_eq!(
            verdict(&v, &signed_payload("nope")).await,
            Err(Reason::Malformed)
        );
    }

    /// Run a Wycheproof corpus through our key import, token split, header parse and key
    /// choice, then jsonwebtoken's signature check. Their tokens carry no `typ` or claims,
    /// so the access-token layer is left out. A vector is expected to pass when Wycheproof
    /// calls it valid, its keys are RS256 or ES256 (never `oct`: we do not verify HMAC),
    /// and its payload is not empty (no claims: we refuse it before any crypto).
    /// Returns (vectors run, vectors accepted).
    fn run_wycheproof(corpus: &str) -> (usize, usize) {
        ensure_crypto_provider().unwrap();
        let corpus: Value = serde_json::from_str(corpus).unwrap();
        let signature_stage = |token: &str, keys: Option<&ParsedKeys>| -> bool {
            let Ok((header, payload, signature)) = split(token) else {
                return false;
            };
            let Ok(header_fields) = jose_header(header, &SUPPORTED_ALGORITHMS) else {
                return false;
            };
            let Some(keys) = keys else { return false };
            let set = KeySet {
                keys: keys.keys.clone(),
                raw: Vec::new(),
                origin: Origin::Cache(String::new()),
                at: now(),
            };
            let Ok(index) = set.select(header_fields.kid.as_deref(), header_fields.alg) else {
                return false;
            };
            let message = &token[..header.len() + 1 + payload.len()];
            jsonwebtoken::crypto::verify(
                signature,
                message.as_bytes(),
                &set.keys[index].key,
                header_fields.alg,
            )
            .unwrap_or(false)
        };
        let (mut checked, mut accepted) = (0, 0);
        let mut mismatches = Vec::new();
        for group in corpus["groups"].as_array().unwrap() {
            let keys = jwks::parse_key_set(
                json!({"keys": group["keys"]}).to_string().as_bytes(),
                &SUPPORTED_ALGORITHMS,
                "wycheproof",
            )
            .ok();
            let asymmetric = group["keys"]
                .as_array()
                .unwrap()
                .iter()
                .all(|k| matches!(k["alg"].as_str(), Some("RS256" | "ES256")));
            for test in group["tests"].as_array().unwrap() {
                let token = test["jws"].as_str().unwrap();
                let empty_payload = token.split('.').nth(1) == Some("");
                let expected = test["result"] == "valid" && asymmetric && !empty_payload;
                let got = signature_stage(token, keys.as_ref());
                if got != expected {
                    mismatches.push(format!(
                        "tcId {} ({}, {}): got {got}",
                        test["tcId"], group["comment"], test["comment"]
                    ));
                }
                checked += 1;
                accepted += usize::from(got);
            }
        }
        assert!(mismatches.is_empty(), "{mismatches:#?}");
        (checked, accepted)
    }

    #[test]
    fn wycheproof_jws_vectors() {
        let (checked, accepted) = run_wycheproof(include_str!("testdata/wycheproof_jws.json"));
        assert_eq!(checked, 316, "every vector of the corpus ran");
        assert_eq!(accepted, 9, "the valid RS256 and ES256 vectors");
    }

    /// Key-set vectors: mixed and duplicate sets, wrong `use`, ROCA, 1024-bit RSA,
    /// exponent 1, HMAC keys of any length, mismatched algorithm and curve, bad points.
    #[test]
    fn wycheproof_jwk_vectors() {
        let (checked, accepted) = run_wycheproof(include_str!("testdata/wycheproof_jwk.json"));
        assert_eq!(checked, 26, "every vector of the corpus ran");
        assert_eq!(accepted, 1, "only the valid RS256 vector");
    }
}
