//! The remote carrier (OAuth resource server) end to end: a test authorization server in
//! this process (HTTPS, RFC 8414/OIDC discovery, JWKS), the real daemon behind "a proxy"
//! (requests carry the public Host and reach the loopback listener), real clients.
//!
//! Covered: a bad-token corpus reaching every refusal reason with exact status, challenge,
//! empty body, audit record and metric; rmcp clients (2025-11-25 and 2026-07-28) and plain
//! HTTP/1.1 and HTTP/2 clients with RS256/ES256/EdDSA tokens; the RFC 9728 metadata
//! document; Host/Origin checks; throttling per client address with and without trusted
//! proxies, IPv6 clients per /64, `X-Forwarded-For` read as bytes; key rotation with one
//! refetch and a cooldown; key refresh on the key server's `max-age`, by the operator and
//! on reload, and a stalled issuer; key-set edges (32/33 keys, 64 KiB, `oct` keys);
//! discovery variants; start-up with a cached key set, without one, and with
//! `start_without_keys`; TLS terminated by the daemon; and that no token text or client
//! address leaks into metrics, audit output or logs.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use jsonwebtoken::Algorithm;
use rmcp::RoleClient;
use rmcp::model::{CallToolRequestParams, ClientConfig, JsonObject, ProtocolVersion};
use rmcp::service::{ClientLifecycleMode, ClientServiceExt, RunningService};
use rmcp::transport::StreamableHttpClientTransport;
use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
use robota_e2e::authz::{Authz, Discovery, SigningKey, b64, now_secs};
use robota_e2e::http::{
    Conn, Request, Response, exchange, h2_exchange, tool_error_code, tool_names, tools_call,
    tools_list,
};
use robota_e2e::remote::{
    Challenge, PUBLIC_HOST, PUBLIC_ORIGIN, PUBLIC_URL, RemoteConfig, audit, max_seq, metadata_url,
    records_after, remote_mcp, remote_mcp_at, tls_exchange, url_path,
};
use robota_e2e::{Daemon, metric_sum, poll_until, poll_until_async, within};
use serde_json::{Value, json};

const LIMIT: Duration = Duration::from_secs(20);

/// Every token-verification reason of docs/design.md §6.8 plus `missing-token`.
const TOKEN_REASONS: [&str; 15] = [
    "missing-token",
    "oversize",
    "malformed",
    "wrong-type",
    "unsupported-algorithm",
    "ambiguous-key",
    "unknown-key",
    "key-mismatch",
    "bad-signature",
    "wrong-issuer",
    "wrong-audience",
    "expired",
    "not-yet-valid",
    "missing-scope",
    "principal-not-allowed",
];

/// Every reason the remote carrier may record.
const ALL_REMOTE_REASONS: [&str; 18] = [
    "missing-token",
    "oversize",
    "malformed",
    "wrong-type",
    "unsupported-algorithm",
    "ambiguous-key",
    "unknown-key",
    "key-mismatch",
    "bad-signature",
    "wrong-issuer",
    "wrong-audience",
    "expired",
    "not-yet-valid",
    "missing-scope",
    "principal-not-allowed",
    "keys-unavailable",
    "wrong-host",
    "wrong-origin",
];

/// What one request must get.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Expect {
    /// 200 with the catalog (for `tools/list`).
    Admitted,
    /// 401, `Bearer resource_metadata=…, scope=…`, reason `missing-token`.
    MissingToken,
    /// 400, `Bearer error="invalid_request", resource_metadata=…`, reason `malformed`.
    BadHeader,
    /// 401, `Bearer error="invalid_token", resource_metadata=…`, with the reason.
    Invalid(&'static str),
    /// Like `Invalid`, where the design leaves the reason open between a few.
    InvalidOneOf(&'static [&'static str]),
    /// 403, `Bearer error="insufficient_scope", scope=…, resource_metadata=…`.
    Insufficient(&'static str),
    /// 403, `Bearer resource_metadata=…` only (no `error`, no `scope`: no token of this
    /// principal would do), reason `principal-not-allowed`.
    NotAdmitted,
    /// 403 with an empty body (wrong Host / Origin).
    Forbidden(&'static str),
    /// 503, reason `keys-unavailable`.
    Unavailable,
}

impl Expect {
    /// The audit reasons acceptable for this answer (empty: admitted, no record).
    fn reasons(&self) -> &[&'static str] {
        match self {
            Expect::Admitted => &[],
            Expect::MissingToken => &["missing-token"],
            Expect::BadHeader => &["malformed"],
            Expect::Invalid(r) | Expect::Insufficient(r) | Expect::Forbidden(r) => {
                std::slice::from_ref(r)
            }
            Expect::InvalidOneOf(rs) => rs,
            Expect::NotAdmitted => &["principal-not-allowed"],
            Expect::Unavailable => &["keys-unavailable"],
        }
    }
}

fn assert_catalog_served(resp: &Response, id: i64, case: &str) {
    assert_eq!(resp.status, 200, "{case}: {}", resp.describe());
    let names = tool_names(&resp.expect_rpc(id));
    for n in ["system.info", "system.health", "agent_submit"] {
        assert!(
            names.iter().any(|x| x == n),
            "{case}: {n} missing from {names:?}"
        );
    }
}

/// Asserts status, the exact challenge and the empty body of `resp`.
fn check_answer(resp: &Response, expect: Expect, public_url: &str, case: &str) {
    let meta = metadata_url(public_url);
    let challenge = || {
        let h = resp.header("www-authenticate").unwrap_or_else(|| {
            panic!("{case}: no WWW-Authenticate: {}", resp.describe());
        });
        assert_eq!(
            resp.headers
                .iter()
                .filter(|(k, _)| k.eq_ignore_ascii_case("www-authenticate"))
                .count(),
            1,
            "{case}: one challenge header: {}",
            resp.describe()
        );
        Challenge::parse(h)
    };
    match expect {
        Expect::Admitted => assert_catalog_served(resp, 1, case),
        Expect::MissingToken => {
            resp.assert_empty_refusal(401, case);
            challenge().assert_exactly(&[("resource_metadata", &meta), ("scope", "mcp")], case);
        }
        Expect::BadHeader => {
            resp.assert_empty_refusal(400, case);
            challenge().assert_exactly(
                &[("error", "invalid_request"), ("resource_metadata", &meta)],
                case,
            );
        }
        Expect::Invalid(_) | Expect::InvalidOneOf(_) => {
            resp.assert_empty_refusal(401, case);
            challenge().assert_exactly(
                &[("error", "invalid_token"), ("resource_metadata", &meta)],
                case,
            );
        }
        Expect::Insufficient(_) => {
            resp.assert_empty_refusal(403, case);
            challenge().assert_exactly(
                &[
                    ("error", "insufficient_scope"),
                    ("scope", "mcp"),
                    ("resource_metadata", &meta),
                ],
                case,
            );
        }
        Expect::NotAdmitted => {
            resp.assert_empty_refusal(403, case);
            challenge().assert_exactly(&[("resource_metadata", &meta)], case);
        }
        Expect::Forbidden(_) => resp.assert_empty_refusal(403, case),
        Expect::Unavailable => resp.assert_empty_refusal(503, case),
    }
}

/// A daemon with a remote carrier in front of `authz`.
struct Remote {
    d: Daemon,
    addr: SocketAddr,
}

fn start(cfg: &RemoteConfig) -> Remote {
    let d = cfg.builder().start();
    let addr = d.remote_addr();
    Remote { d, addr }
}

/// Follows the audit log: remembers the last `seq` seen.
struct AuditCursor {
    last: u64,
}

impl AuditCursor {
    fn new(d: &Daemon) -> AuditCursor {
        AuditCursor {
            last: max_seq(&audit(d, &[])),
        }
    }

    /// Waits (bounded) for `n` new records and returns exactly the new ones; with `n == 0`
    /// it looks once.
    async fn take(&mut self, d: &Daemon, n: usize) -> Vec<Value> {
        let mut new = Vec::new();
        poll_until_async(Duration::from_secs(5), Duration::from_millis(25), || {
            new = records_after(&audit(d, &[]), self.last);
            std::future::ready(new.len() >= n)
        })
        .await;
        if let Some(m) = new.iter().filter_map(|r| r["seq"].as_u64()).max() {
            self.last = m;
        }
        new
    }

    /// Asserts that exactly one new record arrived, for `reason` on the remote carrier.
    async fn expect_one(
        &mut self,
        d: &Daemon,
        reason: &str,
        throttled: bool,
        class: &str,
        case: &str,
    ) {
        self.expect_one_of(d, &[reason], throttled, class, case)
            .await;
    }

    /// Asserts that exactly one new record arrived on the remote carrier, for one of
    /// `reasons`; returns its reason.
    async fn expect_one_of(
        &mut self,
        d: &Daemon,
        reasons: &[&str],
        throttled: bool,
        class: &str,
        case: &str,
    ) -> String {
        let new = self.take(d, 1).await;
        assert_eq!(
            new.len(),
            1,
            "{case}: expected one audit record ({reasons:?}), got {new:?}"
        );
        let r = &new[0];
        assert_eq!(r["carrier"], "remote", "{case}: {r}");
        let reason = r["reason"].as_str().unwrap_or_default().to_owned();
        assert!(
            reasons.contains(&reason.as_str()),
            "{case}: audit reason {reason:?}, expected {}: {r}",
            reasons.join(" or ")
        );
        assert_eq!(r["throttled"], throttled, "{case}: throttled: {r}");
        assert_eq!(r["address_class"], class, "{case}: address class: {r}");
        let t = r["time"].as_i64().expect("time");
        assert!(
            (t - now_secs()).abs() <= 5,
            "{case}: audit time {t} is not now ({})",
            now_secs()
        );
        reason
    }
}

fn remote_status(d: &Daemon) -> (Value, Value) {
    let out = d.ctl_ok(&["--json", "status"]);
    let st: Value = serde_json::from_str(&out.stdout).expect("status JSON");
    let remote = st["carriers"]
        .as_array()
        .expect("carriers")
        .iter()
        .find(|c| c["name"] == "remote")
        .unwrap_or_else(|| panic!("no remote carrier in status: {st}"))
        .clone();
    (st, remote)
}

fn metrics(d: &Daemon) -> String {
    d.metrics_text().expect("metrics answer")
}

fn refusal_metric(text: &str, reason: &str) -> f64 {
    metric_sum(
        text,
        &[
            "robota_mcpd_refusals_total{",
            "carrier=\"remote\"",
            &format!("reason=\"{reason}\""),
        ],
    )
}

/// Registers a token (and its signature, which stands alone as a secret) for the scans.
fn register_token(d: &Daemon, t: &str) {
    if t.len() >= 40 {
        d.register_secret(t);
    }
    if let Some(sig) = t.rsplit('.').next()
        && sig.len() >= 40
    {
        d.register_secret(sig);
    }
}

// ---------------------------------------------------------------------------------------
// 0. The harness itself: the authorization server's keys verify its own tokens.
// ---------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn authz_harness_serves_discovery_and_keys_that_verify_its_tokens() {
    let (authz, keys) = Authz::with_standard_keys();
    let get = |path: &str| {
        Request::new("GET", path)
            .header("Host", &authz.addr().to_string())
            .header("Connection", "close")
    };
    let client = authz.ca().client_config();
    let meta = tls_exchange(
        client.clone(),
        authz.addr(),
        "127.0.0.1",
        &get("/.well-known/oauth-authorization-server"),
    )
    .await
    .expect("metadata over TLS");
    assert_eq!(meta.status, 200, "{}", meta.describe());
    let meta: Value = serde_json::from_slice(&meta.body).expect("metadata JSON");
    assert_eq!(meta["issuer"], authz.issuer());
    assert_eq!(meta["jwks_uri"], authz.jwks_uri());
    let jwks = tls_exchange(client, authz.addr(), "127.0.0.1", &get("/jwks"))
        .await
        .expect("JWKS over TLS");
    let jwks: jsonwebtoken::jwk::JwkSet = serde_json::from_slice(&jwks.body).expect("JWKS");
    assert_eq!(jwks.keys.len(), 3);
    assert_eq!(authz.jwks_fetches(), 1);
    for key in [&keys.rsa, &keys.ec, &keys.ed] {
        let token = authz.token(key, PUBLIC_URL).build();
        let jwk = jwks.find(&key.kid).expect("kid published");
        let dk = jsonwebtoken::DecodingKey::from_jwk(jwk).expect("decoding key");
        let mut v = jsonwebtoken::Validation::new(key.alg);
        v.set_audience(&[PUBLIC_URL]);
        v.set_issuer(&[authz.issuer()]);
        let data = jsonwebtoken::decode::<Value>(&token, &dk, &v)
            .unwrap_or_else(|e| panic!("{} token does not verify: {e}", key.kid));
        assert_eq!(data.header.typ.as_deref(), Some("at+jwt"));
        assert_eq!(data.claims["sub"], "alice");
        assert_eq!(data.claims["client_id"], "client-a");
    }
    // Length-exact tokens.
    let t = authz.token(&keys.rsa, PUBLIC_URL);
    assert_eq!(t.build_with_len(8192).len(), 8192);
    assert_eq!(t.build_with_len(8193).len(), 8193);
    // Down and back on the same port.
    authz.go_down();
    assert!(std::net::TcpStream::connect(authz.addr()).is_err());
    authz.come_back();
    let again = tls_exchange(
        authz.ca().client_config(),
        authz.addr(),
        "127.0.0.1",
        &get("/jwks"),
    )
    .await
    .expect("JWKS after coming back");
    assert_eq!(again.status, 200);
}

// ---------------------------------------------------------------------------------------
// 1 + 7. The bad-token corpus, then metrics, status and the secret scan.
// ---------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_token_corpus_reaches_every_reason_with_exact_answers() {
    let (authz, keys) = Authz::with_standard_keys();
    let rsa2 = SigningKey::generate(Algorithm::RS256, "rsa-2");
    authz.publish(&rsa2);
    let attacker = SigningKey::generate(Algorithm::RS256, "attacker-1");
    let unpublished = SigningKey::generate(Algorithm::RS256, "nope");
    // The corpus fails far more than 20 times from one address: no throttling here.
    let cfg = RemoteConfig::new(&authz).throttle(100_000, "60s");
    let Remote { d, addr } = start(&cfg);
    let iss = authz.issuer().to_owned();
    let tok = |key: &Arc<SigningKey>| authz.token(key, PUBLIC_URL);
    let now = now_secs();
    let msg = tools_list(1);
    let with = |t: &str| remote_mcp(Some(t), &msg);
    let mut cases: Vec<(String, Request, Expect)> = Vec::new();
    let mut add = |name: &str, req: Request, e: Expect| cases.push((name.to_owned(), req, e));

    // Positive controls first.
    let good = tok(&keys.rsa).build();
    add("valid RS256", with(&good), Expect::Admitted);
    add(
        "valid ES256",
        with(&tok(&keys.ec).build()),
        Expect::Admitted,
    );
    add(
        "valid EdDSA",
        with(&tok(&keys.ed).build()),
        Expect::Admitted,
    );

    // The Authorization header.
    add(
        "no Authorization",
        remote_mcp(None, &msg),
        Expect::MissingToken,
    );
    add(
        "Basic scheme",
        remote_mcp(None, &msg).header("Authorization", "Basic YWxpY2U6c2VjcmV0"),
        Expect::BadHeader,
    );
    add(
        "two Authorization headers",
        with(&good).header("Authorization", &format!("Bearer {good}")),
        Expect::BadHeader,
    );
    add(
        "Bearer without a token",
        remote_mcp(None, &msg).header("Authorization", "Bearer"),
        Expect::BadHeader,
    );
    add(
        "bad characters in the token",
        remote_mcp(None, &msg).header("Authorization", "Bearer ab$cd!ef"),
        Expect::BadHeader,
    );
    add(
        "space inside the token",
        remote_mcp(None, &msg).header("Authorization", &format!("Bearer {good} x")),
        Expect::BadHeader,
    );

    // Algorithms.
    add(
        "alg none",
        with(
            &tok(&keys.rsa)
                .header("alg", "none")
                .raw_signature("")
                .build(),
        ),
        Expect::Invalid("unsupported-algorithm"),
    );
    add(
        "HS256 signed with the RSA public key",
        with(
            &tok(&keys.rsa)
                .header("alg", "HS256")
                .hmac(keys.rsa.public_pem(), Algorithm::HS256)
                .build(),
        ),
        Expect::Invalid("unsupported-algorithm"),
    );
    add(
        "RS384 (not in the allow-list)",
        with(
            &tok(&keys.rsa)
                .header("alg", "RS384")
                .signed_by_as(&keys.rsa, Algorithm::RS384)
                .build(),
        ),
        Expect::Invalid("unsupported-algorithm"),
    );
    add(
        "PS256 (not in the allow-list)",
        with(
            &tok(&keys.rsa)
                .header("alg", "PS256")
                .signed_by_as(&keys.rsa, Algorithm::PS256)
                .build(),
        ),
        Expect::Invalid("unsupported-algorithm"),
    );

    // Keys.
    add(
        "unknown kid",
        with(&tok(&unpublished).build()),
        Expect::Invalid("unknown-key"),
    );
    add(
        "no kid, two RS256 keys published",
        with(&tok(&keys.rsa).no_header("kid").build()),
        Expect::Invalid("ambiguous-key"),
    );
    add(
        "no kid, one ES256 key published",
        with(&tok(&keys.ec).no_header("kid").build()),
        Expect::Admitted,
    );
    add(
        "ES256 token naming the RSA key",
        with(&tok(&keys.ec).header("kid", "rsa-1").build()),
        Expect::Invalid("key-mismatch"),
    );
    add(
        "RS256 token naming the EdDSA key",
        with(&tok(&keys.rsa).header("kid", "ed-1").build()),
        Expect::Invalid("key-mismatch"),
    );
    add(
        "our kid, another RSA key's signature",
        with(&tok(&keys.rsa).signed_by(&attacker).build()),
        Expect::Invalid("bad-signature"),
    );
    let tampered = {
        let t = tok(&keys.rsa).build();
        let mut parts: Vec<&str> = t.split('.').collect();
        let evil = b64(tok(&keys.rsa).claim("sub", "root").claims_json());
        parts[1] = &evil;
        parts.join(".")
    };
    add(
        "claims changed after signing",
        with(&tampered),
        Expect::Invalid("bad-signature"),
    );
    // Signatures that are valid base64url but wrong: one bit flipped, three bytes short.
    let resigned = |t: String, f: &dyn Fn(&mut Vec<u8>)| {
        let (input, sig) = t.rsplit_once('.').expect("three segments");
        let mut raw =
            base64::Engine::decode(&base64::engine::general_purpose::URL_SAFE_NO_PAD, sig)
                .expect("signature base64url");
        f(&mut raw);
        format!("{input}.{}", b64(raw))
    };
    add(
        "ES256 signature with one bit flipped",
        with(&resigned(tok(&keys.ec).build(), &|r| r[10] ^= 1)),
        Expect::Invalid("bad-signature"),
    );
    add(
        "EdDSA signature three bytes short",
        with(&resigned(tok(&keys.ed).build(), &|r| {
            r.truncate(r.len() - 3)
        })),
        Expect::Invalid("bad-signature"),
    );
    let jku = format!("{iss}/attacker-jku");
    let x5u = format!("{iss}/attacker-x5u");
    add(
        "jku pointing at an attacker key set",
        with(
            &tok(&keys.rsa)
                .header("jku", jku.as_str())
                .signed_by(&attacker)
                .build(),
        ),
        Expect::Invalid("bad-signature"),
    );
    add(
        "x5u pointing at an attacker certificate",
        with(
            &tok(&keys.rsa)
                .header("x5u", x5u.as_str())
                .signed_by(&attacker)
                .build(),
        ),
        Expect::Invalid("bad-signature"),
    );
    add(
        "jku and x5u on an otherwise valid token (ignored)",
        with(
            &tok(&keys.rsa)
                .header("jku", jku.as_str())
                .header("x5u", x5u.as_str())
                .build(),
        ),
        Expect::Admitted,
    );
    add(
        "jku with the attacker's own kid",
        with(&tok(&attacker).header("jku", jku.as_str()).build()),
        Expect::Invalid("unknown-key"),
    );

    // Header extensions the crate must refuse.
    add(
        "unknown crit header",
        with(
            &tok(&keys.rsa)
                .header("crit", json!(["x-must-understand"]))
                .header("x-must-understand", true)
                .build(),
        ),
        Expect::Invalid("malformed"),
    );

    // Header type.
    add(
        "typ JWT",
        with(&tok(&keys.rsa).header("typ", "JWT").build()),
        Expect::Invalid("wrong-type"),
    );
    add(
        "no typ",
        with(&tok(&keys.rsa).no_header("typ").build()),
        Expect::Invalid("wrong-type"),
    );

    // Issuer and audience.
    add(
        "wrong iss",
        with(&tok(&keys.rsa).claim("iss", "https://evil.example").build()),
        Expect::Invalid("wrong-issuer"),
    );
    add(
        "iss with a trailing slash",
        with(&tok(&keys.rsa).claim("iss", format!("{iss}/")).build()),
        Expect::Invalid("wrong-issuer"),
    );
    add(
        "iss as an array holding ours",
        with(&tok(&keys.rsa).claim("iss", json!([iss])).build()),
        Expect::Invalid("wrong-issuer"),
    );
    add(
        "wrong aud",
        with(
            &tok(&keys.rsa)
                .claim("aud", "https://other.example/mcp")
                .build(),
        ),
        Expect::Invalid("wrong-audience"),
    );
    add(
        "aud with a trailing slash",
        with(
            &tok(&keys.rsa)
                .claim("aud", format!("{PUBLIC_URL}/"))
                .build(),
        ),
        Expect::Invalid("wrong-audience"),
    );
    add(
        "two audiences, neither ours",
        with(
            &tok(&keys.rsa)
                .claim("aud", json!(["https://a.example", "https://b.example"]))
                .build(),
        ),
        Expect::Invalid("wrong-audience"),
    );
    add(
        "two audiences, one ours",
        with(
            &tok(&keys.rsa)
                .claim("aud", json!([PUBLIC_URL, "https://b.example"]))
                .build(),
        ),
        Expect::Invalid("wrong-audience"),
    );

    add(
        "no iss",
        with(&tok(&keys.rsa).no_claim("iss").build()),
        Expect::InvalidOneOf(&["malformed", "wrong-issuer"]),
    );
    add(
        "no aud",
        with(&tok(&keys.rsa).no_claim("aud").build()),
        Expect::InvalidOneOf(&["malformed", "wrong-audience"]),
    );
    let dup_sub = {
        let claims = String::from_utf8(tok(&keys.rsa).claims_json()).expect("utf8");
        claims.replacen('{', "{\"sub\":\"mallory\",", 1)
    };
    assert!(dup_sub.matches("\"sub\"").count() == 2, "{dup_sub}");
    add(
        "duplicate sub claim",
        with(&tok(&keys.rsa).raw_claims(&dup_sub).build()),
        Expect::Invalid("malformed"),
    );

    // Time, with 60 s of skew.
    add(
        "expired two minutes ago",
        with(&tok(&keys.rsa).claim("exp", now - 120).build()),
        Expect::Invalid("expired"),
    );
    add(
        "expired 20 s ago (within skew)",
        with(&tok(&keys.rsa).claim("exp", now - 20).build()),
        Expect::Admitted,
    );
    add(
        "nbf in two minutes",
        with(&tok(&keys.rsa).claim("nbf", now + 120).build()),
        Expect::Invalid("not-yet-valid"),
    );
    add(
        "nbf in 20 s (within skew)",
        with(&tok(&keys.rsa).claim("nbf", now + 20).build()),
        Expect::Admitted,
    );

    // Required claims.
    for claim in ["exp", "sub", "client_id"] {
        add(
            &format!("missing {claim}"),
            with(&tok(&keys.rsa).no_claim(claim).build()),
            Expect::Invalid("malformed"),
        );
    }

    // Scopes and principals.
    add(
        "scope without mcp",
        with(&tok(&keys.rsa).claim("scope", "other mcp:read").build()),
        Expect::Insufficient("missing-scope"),
    );
    add(
        "no scope claim",
        with(&tok(&keys.rsa).no_claim("scope").build()),
        Expect::Insufficient("missing-scope"),
    );
    add(
        "mcp among other scopes",
        with(&tok(&keys.rsa).claim("scope", "other mcp").build()),
        Expect::Admitted,
    );
    add(
        "subject and client not allowed",
        with(
            &tok(&keys.rsa)
                .claim("sub", "mallory")
                .claim("client_id", "client-x")
                .build(),
        ),
        Expect::NotAdmitted,
    );
    add(
        "allowed subject, other client",
        with(&tok(&keys.rsa).claim("client_id", "client-x").build()),
        Expect::Admitted,
    );
    add(
        "other subject, allowed client",
        with(&tok(&keys.rsa).claim("sub", "bob").build()),
        Expect::Admitted,
    );

    // Size: 8192 bytes are verified, 8193 are not.
    add(
        "8192-byte valid token",
        with(&tok(&keys.rsa).build_with_len(8192)),
        Expect::Admitted,
    );
    add(
        "8193-byte token",
        with(&tok(&keys.rsa).build_with_len(8193)),
        Expect::Invalid("oversize"),
    );

    // Structure.
    add(
        "segments not base64url",
        with("ab+c/d.ef~gh/i.jk+l"),
        Expect::Invalid("malformed"),
    );
    add(
        "header not JSON",
        with(&tok(&keys.rsa).raw_header("not json").build()),
        Expect::Invalid("malformed"),
    );
    add(
        "claims not an object",
        with(&tok(&keys.rsa).raw_claims("[1,2]").build()),
        Expect::Invalid("malformed"),
    );
    add(
        "two segments",
        with(good.rsplit_once('.').expect("three segments").0),
        Expect::Invalid("malformed"),
    );
    add(
        "four segments",
        with(&format!("{good}.{}", b64("x"))),
        Expect::Invalid("malformed"),
    );

    assert!(cases.len() > 40, "corpus too small: {}", cases.len());
    let fetches_before = authz.jwks_fetches();
    let mut cursor = AuditCursor::new(&d);
    let mut tally: BTreeMap<String, u64> = BTreeMap::new();
    let mut admitted = 0u64;
    for (name, req, expect) in &cases {
        for (k, v) in &req.headers {
            if k.eq_ignore_ascii_case("authorization") {
                register_token(&d, v.trim_start_matches("Bearer ").trim());
            }
        }
        let resp = exchange(addr, req).await;
        check_answer(&resp, *expect, PUBLIC_URL, name);
        let reasons = expect.reasons();
        if reasons.is_empty() {
            admitted += 1;
            let new = cursor.take(&d, 0).await;
            assert!(new.is_empty(), "{name}: admitted but audited: {new:?}");
        } else {
            let got = cursor
                .expect_one_of(&d, reasons, false, "loopback", name)
                .await;
            *tally.entry(got).or_default() += 1;
        }
    }
    for reason in TOKEN_REASONS {
        assert!(
            tally.get(reason).is_some_and(|n| *n > 0),
            "the corpus never reached {reason}"
        );
    }

    // jku/x5u were never fetched; only the one unknown-kid refetch reached the issuer.
    assert_eq!(authz.hits("/attacker-jku"), 0, "jku was fetched");
    assert_eq!(authz.hits("/attacker-x5u"), 0, "x5u was fetched");
    let paths = authz.hit_paths();
    assert!(
        paths
            .keys()
            .all(|p| p == "/jwks" || p.starts_with("/.well-known/")),
        "unexpected fetches at the issuer: {paths:?}"
    );
    assert!(
        authz.jwks_fetches() <= fetches_before + 1,
        "{} JWKS fetches during the corpus (at most one refetch allowed)",
        authz.jwks_fetches() - fetches_before
    );

    // 7. Metrics per reason, admitted requests, fetches.
    let text = metrics(&d);
    for reason in ALL_REMOTE_REASONS {
        let want = tally.get(reason).copied().unwrap_or(0) as f64;
        assert_eq!(
            refusal_metric(&text, reason),
            want,
            "robota_mcpd_refusals_total{{carrier=\"remote\",reason=\"{reason}\"}}"
        );
    }
    assert_eq!(
        metric_sum(
            &text,
            &["robota_mcpd_admitted_requests_total{", "carrier=\"remote\""]
        ),
        admitted as f64,
        "admitted_requests_total{{carrier=\"remote\"}}"
    );
    assert_eq!(
        metric_sum(
            &text,
            &["robota_mcpd_throttled_total{", "carrier=\"remote\""]
        ),
        0.0,
        "throttled_total{{carrier=\"remote\"}}"
    );
    let ok_fetches = metric_sum(
        &text,
        &["robota_mcpd_jwks_fetches_total{", "outcome=\"ok\""],
    );
    assert!(
        ok_fetches >= authz.jwks_fetches() as f64 && ok_fetches <= authz.total_hits() as f64,
        "jwks_fetches_total{{outcome=\"ok\"}} = {ok_fetches}, authorization server saw {} JWKS fetches of {} requests",
        authz.jwks_fetches(),
        authz.total_hits()
    );
    for outcome in ["error", "rejected"] {
        assert_eq!(
            metric_sum(
                &text,
                &[
                    "robota_mcpd_jwks_fetches_total{",
                    &format!("outcome=\"{outcome}\"")
                ]
            ),
            0.0,
            "jwks_fetches_total{{outcome=\"{outcome}\"}}"
        );
    }

    // Status: the remote carrier, its counters, the key set, refusals by reason.
    let (st, remote) = remote_status(&d);
    assert_eq!(remote["address"], addr.to_string(), "{remote}");
    assert_eq!(remote["public_url"], PUBLIC_URL, "{remote}");
    assert_eq!(remote["admitted"], admitted, "{remote}");
    let refused: u64 = tally.values().sum();
    assert_eq!(remote["refused"], refused, "{remote}");
    let keys = &st["key_set"];
    assert_eq!(keys["source"], "discovery", "{st}");
    assert!(keys["keys"].as_u64().is_some_and(|n| n >= 3), "{st}");
    assert_eq!(
        keys["location"].as_str(),
        Some(authz.jwks_uri().as_str()),
        "{st}"
    );
    assert!(
        keys["last_error"].is_null() && keys["next_refresh_at"].is_u64(),
        "{st}"
    );
    for (reason, n) in &tally {
        assert_eq!(
            st["refusals_last_hour"][reason.as_str()],
            *n,
            "refusals_last_hour.{reason}: {st}"
        );
    }

    // No token text anywhere: logs, audit and status output, metrics, state files.
    assert!(
        !d.stderr_text().is_empty(),
        "the daemon logged nothing: the log scan would prove nothing"
    );
    robota_e2e::assert_no_secrets(&d.secrets(), &text, "metrics");
    let all_audit = d.ctl_ok(&["--json", "audit"]).stdout;
    robota_e2e::assert_no_secrets(&d.secrets(), &all_audit, "audit output");
    d.assert_no_secrets();
}

// ---------------------------------------------------------------------------------------
// 2. Real clients with valid tokens.
// ---------------------------------------------------------------------------------------

type Client = RunningService<RoleClient, ClientConfig>;

#[derive(Clone, Copy, Debug)]
enum Lifecycle {
    Initialize,
    Discover,
}

impl Lifecycle {
    fn client_config(self) -> (ClientConfig, ClientLifecycleMode, ProtocolVersion) {
        match self {
            Lifecycle::Initialize => (
                ClientConfig::default().with_protocol_version(ProtocolVersion::V_2025_11_25),
                ClientLifecycleMode::Initialize,
                ProtocolVersion::V_2025_11_25,
            ),
            Lifecycle::Discover => (
                ClientConfig::default(),
                ClientLifecycleMode::Discover {
                    preferred_versions: vec![ProtocolVersion::V_2026_07_28],
                },
                ProtocolVersion::V_2026_07_28,
            ),
        }
    }
}

/// rmcp's HTTP transport to the remote listener, as behind a proxy: the URL names the
/// listener, a `Host` header names the public authority (reqwest/hyper keep a Host the
/// caller set), the token rides in `Authorization`.
fn rmcp_transport(addr: SocketAddr, token: &str) -> StreamableHttpClientTransport<reqwest::Client> {
    let mut headers = HashMap::new();
    headers.insert(
        http::header::HOST,
        http::HeaderValue::from_static(PUBLIC_HOST),
    );
    let config = StreamableHttpClientTransportConfig::with_uri(format!("http://{addr}/mcp"))
        .auth_header(token)
        .custom_headers(headers);
    let http = reqwest::Client::builder()
        .no_proxy()
        .timeout(LIMIT)
        .build()
        .expect("reqwest client");
    StreamableHttpClientTransport::with_client(http, config)
}

async fn rmcp_session(lifecycle: Lifecycle, addr: SocketAddr, token: &str) -> Client {
    let (config, mode, version) = lifecycle.client_config();
    let client = within(
        LIMIT,
        "rmcp lifecycle over the remote carrier",
        config.serve_with_lifecycle(rmcp_transport(addr, token), mode),
    )
    .await
    .unwrap_or_else(|e| panic!("{lifecycle:?} over the remote carrier failed: {e}"));
    let info = client.peer_info().expect("server info");
    assert_eq!(info.protocol_version, version, "{lifecycle:?}");
    client
}

const CALLER_TURN: &str = r#"
[session.turn]
argv = ["/bin/sh", "-c", "cat >/dev/null; printf 'caller=%s' \"$ROBOTA_MCPD_CALLER\""]
timeout = "30s"

[[policy]]
callers = ["oauth:client-a/*"]
tools = ["agent_submit"]
decision = "allow"
"#;

fn text_of(result: &rmcp::model::CallToolResult) -> String {
    let v = serde_json::to_value(result).expect("result JSON");
    v["content"]
        .as_array()
        .map(|c| {
            c.iter()
                .filter_map(|b| b["text"].as_str())
                .collect::<String>()
        })
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rmcp_and_plain_clients_are_admitted_with_each_algorithm() {
    let (authz, keys) = Authz::with_standard_keys();
    let cfg = RemoteConfig::new(&authz);
    let d = cfg.builder().extra(CALLER_TURN).start();
    let addr = d.remote_addr();
    let mut admitted = 0u64;

    // rmcp, both revisions, one algorithm each way round.
    for (lifecycle, key) in [
        (Lifecycle::Initialize, &keys.rsa),
        (Lifecycle::Discover, &keys.ed),
        (Lifecycle::Initialize, &keys.ec),
    ] {
        let token = authz.token(key, PUBLIC_URL).build();
        register_token(&d, &token);
        let client = rmcp_session(lifecycle, addr, &token).await;
        let tools = within(LIMIT, "tools/list", client.list_all_tools())
            .await
            .expect("tools/list");
        let names: Vec<&str> = tools.iter().map(|t| t.name.as_ref()).collect();
        for n in ["system.info", "system.health", "agent_submit"] {
            assert!(names.contains(&n), "{lifecycle:?}: {n} missing: {names:?}");
        }
        let info = within(
            LIMIT,
            "system.info",
            client.call_tool(
                CallToolRequestParams::new("system.info").with_arguments(JsonObject::new()),
            ),
        )
        .await
        .expect("system.info");
        assert_ne!(info.is_error, Some(true), "{info:?}");
        let sc = info
            .structured_content
            .as_ref()
            .expect("structured content");
        assert_eq!(
            sc["hostname"].as_str(),
            Some(
                nix::unistd::gethostname()
                    .expect("hostname")
                    .to_string_lossy()
                    .as_ref()
            ),
            "{sc}"
        );
        let mut args = JsonObject::new();
        args.insert("prompt".into(), Value::from("who am I"));
        let submit = within(
            LIMIT,
            "agent_submit",
            client.call_tool(CallToolRequestParams::new("agent_submit").with_arguments(args)),
        )
        .await
        .expect("agent_submit");
        assert_ne!(submit.is_error, Some(true), "{submit:?}");
        assert_eq!(
            text_of(&submit),
            "caller=oauth:client-a/alice",
            "{lifecycle:?} with {}: the caller identity",
            key.kid
        );
        let _ = within(LIMIT, "client close", client.cancel()).await;
    }
    let (_, remote) = remote_status(&d);
    let rmcp_admitted = remote["admitted"].as_u64().expect("admitted");
    assert!(
        rmcp_admitted >= 9,
        "three rmcp sessions of >= 3 requests each: {remote}"
    );
    admitted += rmcp_admitted;

    // A plain HTTP/1.1 client (bytes written by hand) with each algorithm, and the caller.
    for (key, id) in [(&keys.rsa, 11), (&keys.ec, 12), (&keys.ed, 13)] {
        let token = authz.token(key, PUBLIC_URL).claim("sub", "bob").build();
        register_token(&d, &token);
        let resp = exchange(
            addr,
            &remote_mcp(Some(&token), &tools_call(id, "system.info", json!({}))),
        )
        .await;
        assert_eq!(resp.status, 200, "{}: {}", key.kid, resp.describe());
        assert_eq!(tool_error_code(&resp.expect_rpc(id)), None, "{}", key.kid);
        let resp = exchange(
            addr,
            &remote_mcp(
                Some(&token),
                &tools_call(id + 10, "agent_submit", json!({"prompt": "x"})),
            ),
        )
        .await;
        let rpc = resp.expect_rpc(id + 10);
        assert_eq!(tool_error_code(&rpc), None, "{rpc}");
        let text: String = rpc["result"]["content"]
            .as_array()
            .expect("content")
            .iter()
            .filter_map(|c| c["text"].as_str())
            .collect();
        assert_eq!(text, "caller=oauth:client-a/bob", "{}", key.kid);
        admitted += 2;
    }

    // reqwest as a plain client: a Host header set by the caller is kept.
    let token = authz.token(&keys.rsa, PUBLIC_URL).build();
    register_token(&d, &token);
    let http = reqwest::Client::builder()
        .no_proxy()
        .timeout(LIMIT)
        .build()
        .expect("reqwest");
    let resp = within(
        LIMIT,
        "reqwest POST",
        http.post(format!("http://{addr}/mcp"))
            .header("Host", PUBLIC_HOST)
            .header("Authorization", format!("Bearer {token}"))
            .header("Content-Type", "application/json")
            .header("Accept", "application/json, text/event-stream")
            .header("MCP-Protocol-Version", "2025-11-25")
            .body(serde_json::to_vec(&tools_list(21)).expect("json"))
            .send(),
    )
    .await
    .expect("reqwest send");
    assert_eq!(resp.status().as_u16(), 200, "reqwest with Host override");
    admitted += 1;
    let without_host = within(
        LIMIT,
        "reqwest POST without Host override",
        http.post(format!("http://{addr}/mcp"))
            .header("Authorization", format!("Bearer {token}"))
            .header("Content-Type", "application/json")
            .header("Accept", "application/json, text/event-stream")
            .body(serde_json::to_vec(&tools_list(22)).expect("json"))
            .send(),
    )
    .await
    .expect("reqwest send");
    assert_eq!(
        without_host.status().as_u16(),
        403,
        "Host = the listener's address is not the public authority"
    );

    // HTTP/2 prior knowledge: `:authority` is the Host.
    let resp = h2_exchange(addr, PUBLIC_HOST, Some(&token), &tools_list(31))
        .await
        .expect("h2 with the public authority");
    assert_catalog_served(&resp, 31, "HTTP/2 :authority mcp.test.example");
    admitted += 1;
    let resp = h2_exchange(addr, "evil.example", Some(&token), &tools_list(32))
        .await
        .expect("h2 with another authority");
    assert_eq!(
        resp.status,
        403,
        "h2 :authority evil.example: {}",
        resp.describe()
    );
    assert!(resp.body.is_empty(), "{}", resp.describe());

    // GET and DELETE with a valid token: 405.
    for method in ["GET", "DELETE"] {
        let req = Request::new(method, "/mcp")
            .header("Host", PUBLIC_HOST)
            .header("Accept", "application/json, text/event-stream")
            .header("Authorization", &format!("Bearer {token}"))
            .header("Connection", "close");
        exchange(addr, &req)
            .await
            .assert_empty_refusal(405, &format!("{method} with a valid token"));
    }

    let (_, remote) = remote_status(&d);
    assert!(
        remote["admitted"].as_u64().expect("admitted") >= admitted,
        "admitted {remote} < {admitted}"
    );
    d.assert_no_secrets();
}

// ---------------------------------------------------------------------------------------
// 3. Metadata, paths, Host and Origin.
// ---------------------------------------------------------------------------------------

fn get(path: &str, host: &str) -> Request {
    Request::new("GET", path)
        .header("Host", host)
        .header("Accept", "application/json")
        .header("Connection", "close")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metadata_document_paths_host_and_origin() {
    let (authz, keys) = Authz::with_standard_keys();
    let cfg = RemoteConfig::new(&authz);
    let Remote { d, addr } = start(&cfg);
    let token = authz.token(&keys.rsa, PUBLIC_URL).build();
    register_token(&d, &token);
    let meta_path = "/.well-known/oauth-protected-resource/mcp";
    let expected = json!({
        "resource": PUBLIC_URL,
        "authorization_servers": [authz.issuer()],
        "scopes_supported": ["mcp"],
        "bearer_methods_supported": ["header"],
    });
    for host in [PUBLIC_HOST, "mcp.test.example:443"] {
        let resp = exchange(addr, &get(meta_path, host)).await;
        assert_eq!(
            resp.status,
            200,
            "metadata, Host {host}: {}",
            resp.describe()
        );
        assert!(
            resp.header("content-type")
                .is_some_and(|c| c.starts_with("application/json")),
            "{}",
            resp.describe()
        );
        let doc: Value = serde_json::from_slice(&resp.body).expect("metadata JSON");
        assert_eq!(doc, expected, "metadata document");
    }
    for method in ["POST", "PUT", "DELETE"] {
        let resp = exchange(addr, &get(meta_path, PUBLIC_HOST).method(method)).await;
        resp.assert_empty_refusal(405, &format!("{method} on the metadata path"));
    }
    for path in [
        "/",
        "/mcp/",
        "/mcpx",
        "/other",
        "/.well-known/oauth-protected-resource",
        "/.well-known/oauth-protected-resource/mcp/x",
        "/.well-known/oauth-authorization-server",
    ] {
        exchange(addr, &get(path, PUBLIC_HOST))
            .await
            .assert_empty_refusal(404, &format!("GET {path}"));
        exchange(
            addr,
            &remote_mcp_at(path, PUBLIC_HOST, Some(&token), &tools_list(1)),
        )
        .await
        .assert_empty_refusal(404, &format!("POST {path}"));
    }

    // The endpoint with Host and Origin variants.
    let mut cursor = AuditCursor::new(&d);
    let ok = |host: &str| remote_mcp_at("/mcp", host, Some(&token), &tools_list(1));
    assert_catalog_served(&exchange(addr, &ok(PUBLIC_HOST)).await, 1, "public Host");
    assert_catalog_served(
        &exchange(addr, &ok("mcp.test.example:443")).await,
        1,
        "public Host with :443",
    );
    assert_catalog_served(
        &exchange(addr, &ok(PUBLIC_HOST).header("Origin", PUBLIC_ORIGIN)).await,
        1,
        "public Origin",
    );
    let port = addr.port();
    let wrong_hosts = [
        "evil.example".to_owned(),
        "mcp.test.example:8443".to_owned(),
        "mcp.test.example.evil.example".to_owned(),
        format!("127.0.0.1:{port}"),
        format!("localhost:{port}"),
    ];
    for host in &wrong_hosts {
        let resp = exchange(addr, &ok(host)).await;
        check_answer(&resp, Expect::Forbidden("wrong-host"), PUBLIC_URL, host);
        cursor
            .expect_one(&d, "wrong-host", false, "loopback", host)
            .await;
    }
    let resp = exchange(
        addr,
        &remote_mcp_at("/mcp", "evil.example", None, &tools_list(1)),
    )
    .await;
    check_answer(
        &resp,
        Expect::Forbidden("wrong-host"),
        PUBLIC_URL,
        "wrong Host without a token is 403, not 401",
    );
    cursor
        .expect_one(&d, "wrong-host", false, "loopback", "wrong Host, no token")
        .await;
    let resp = exchange(addr, &get(meta_path, "evil.example")).await;
    check_answer(
        &resp,
        Expect::Forbidden("wrong-host"),
        PUBLIC_URL,
        "metadata with a wrong Host",
    );
    cursor
        .expect_one(&d, "wrong-host", false, "loopback", "metadata, wrong Host")
        .await;
    for origin in [
        "https://evil.example",
        "null",
        "http://mcp.test.example",
        "https://mcp.test.example:8443",
        "https://mcp.test.example.evil.example",
    ] {
        let resp = exchange(addr, &ok(PUBLIC_HOST).header("Origin", origin)).await;
        check_answer(&resp, Expect::Forbidden("wrong-origin"), PUBLIC_URL, origin);
        cursor
            .expect_one(&d, "wrong-origin", false, "loopback", origin)
            .await;
    }

    // Wrong Host/Origin refusals are not counted for throttling: 30 of them, then a bad
    // token is still a 401 under the default 20-failure window.
    for i in 0..30 {
        let req = if i % 2 == 0 {
            ok("evil.example")
        } else {
            ok(PUBLIC_HOST).header("Origin", "https://evil.example")
        };
        assert_eq!(exchange(addr, &req).await.status, 403);
    }
    let bad = authz
        .token(&keys.rsa, PUBLIC_URL)
        .claim("iss", "https://evil.example")
        .build();
    let resp = exchange(addr, &remote_mcp(Some(&bad), &tools_list(1))).await;
    check_answer(
        &resp,
        Expect::Invalid("wrong-issuer"),
        PUBLIC_URL,
        "after 30 wrong-host/origin refusals",
    );
    let text = metrics(&d);
    assert_eq!(
        refusal_metric(&text, "wrong-host"),
        (wrong_hosts.len() + 2 + 15) as f64,
        "wrong-host refusals"
    );
    assert_eq!(refusal_metric(&text, "wrong-origin"), (5 + 15) as f64);
    d.assert_no_secrets();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn public_url_with_a_path_prefix_names_every_path() {
    let (authz, keys) = Authz::with_standard_keys();
    let public = "https://mcp.test.example/team/ops/mcp";
    let cfg = RemoteConfig::new(&authz).public_url(public);
    let Remote { d, addr } = start(&cfg);
    let endpoint = url_path(public);
    assert_eq!(endpoint, "/team/ops/mcp");
    let token = authz.token(&keys.rsa, public).build();
    register_token(&d, &token);
    let resp = exchange(
        addr,
        &remote_mcp_at(&endpoint, PUBLIC_HOST, Some(&token), &tools_list(1)),
    )
    .await;
    assert_catalog_served(&resp, 1, "the prefixed endpoint");
    let resp = exchange(
        addr,
        &remote_mcp_at(&endpoint, PUBLIC_HOST, None, &tools_list(1)),
    )
    .await;
    check_answer(&resp, Expect::MissingToken, public, "prefixed, no token");
    assert_eq!(
        metadata_url(public),
        "https://mcp.test.example/.well-known/oauth-protected-resource/team/ops/mcp"
    );
    let resp = exchange(
        addr,
        &get(
            "/.well-known/oauth-protected-resource/team/ops/mcp",
            PUBLIC_HOST,
        ),
    )
    .await;
    assert_eq!(resp.status, 200, "{}", resp.describe());
    let doc: Value = serde_json::from_slice(&resp.body).expect("metadata JSON");
    assert_eq!(doc["resource"], public, "{doc}");
    for path in ["/mcp", "/.well-known/oauth-protected-resource/mcp"] {
        exchange(addr, &get(path, PUBLIC_HOST))
            .await
            .assert_empty_refusal(404, path);
    }
    // The audience is the prefixed URL, not the bare one.
    let other = authz.token(&keys.rsa, PUBLIC_URL).build();
    let resp = exchange(
        addr,
        &remote_mcp_at(&endpoint, PUBLIC_HOST, Some(&other), &tools_list(1)),
    )
    .await;
    check_answer(
        &resp,
        Expect::Invalid("wrong-audience"),
        public,
        "aud without the prefix",
    );
}

// ---------------------------------------------------------------------------------------
// 4. Throttling.
// ---------------------------------------------------------------------------------------

fn assert_429(resp: &Response, case: &str) {
    resp.assert_empty_refusal(429, case);
    let retry = resp
        .header("retry-after")
        .unwrap_or_else(|| panic!("{case}: 429 without Retry-After: {}", resp.describe()));
    let secs: u64 = retry
        .trim()
        .parse()
        .unwrap_or_else(|e| panic!("{case}: Retry-After {retry:?}: {e}"));
    assert!(
        (1..=60).contains(&secs),
        "{case}: Retry-After {secs} outside 1..=60"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn throttle_after_twenty_failures_but_never_a_valid_token() {
    let (authz, keys) = Authz::with_standard_keys();
    let Remote { d, addr } = start(&RemoteConfig::new(&authz));
    let attacker = SigningKey::generate(Algorithm::RS256, "rsa-1");
    let bad = authz.token(&attacker, PUBLIC_URL).build();
    let good = authz.token(&keys.rsa, PUBLIC_URL).build();
    register_token(&d, &bad);
    register_token(&d, &good);
    let mut cursor = AuditCursor::new(&d);
    for i in 0..20 {
        let resp = exchange(addr, &remote_mcp(Some(&bad), &tools_list(1))).await;
        check_answer(
            &resp,
            Expect::Invalid("bad-signature"),
            PUBLIC_URL,
            &format!("failure {}", i + 1),
        );
    }
    let new = cursor.take(&d, 20).await;
    assert_eq!(new.len(), 20, "{new:?}");
    assert!(new.iter().all(|r| r["throttled"] == false), "{new:?}");
    let mut throttled = 0;
    for i in 0..3 {
        let resp = exchange(addr, &remote_mcp(Some(&bad), &tools_list(1))).await;
        assert_429(&resp, &format!("failure {} in the window", 21 + i));
        cursor
            .expect_one(&d, "bad-signature", true, "loopback", "throttled failure")
            .await;
        throttled += 1;
    }
    // A request without a token from the same address is a failure too: throttled.
    assert_429(
        &exchange(addr, &remote_mcp(None, &tools_list(1))).await,
        "missing token from a throttled address",
    );
    throttled += 1;
    // A valid token from the same address is served.
    assert_catalog_served(
        &exchange(addr, &remote_mcp(Some(&good), &tools_list(1))).await,
        1,
        "valid token from a throttled address",
    );
    let text = metrics(&d);
    assert_eq!(
        metric_sum(
            &text,
            &["robota_mcpd_throttled_total{", "carrier=\"remote\""]
        ),
        f64::from(throttled),
        "throttled_total"
    );
    d.assert_no_secrets();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forwarded_for_from_a_trusted_proxy_throttles_each_client_separately() {
    let (authz, keys) = Authz::with_standard_keys();
    let cfg = RemoteConfig::new(&authz).trusted_proxies(&["127.0.0.1"]);
    let Remote { d, addr } = start(&cfg);
    let attacker = SigningKey::generate(Algorithm::RS256, "rsa-1");
    let bad = authz.token(&attacker, PUBLIC_URL).build();
    let good = authz.token(&keys.rsa, PUBLIC_URL).build();
    register_token(&d, &bad);
    register_token(&d, &good);
    // Client addresses must never show up anywhere: register them as secrets.
    let (a, b, private) = ("203.0.113.7", "198.51.100.9", "10.1.2.3");
    for ip in [a, b, private] {
        d.register_secret(ip);
    }
    let from =
        |xff: &str, t: &str| remote_mcp(Some(t), &tools_list(1)).header("X-Forwarded-For", xff);
    let mut cursor = AuditCursor::new(&d);

    for i in 0..20 {
        let resp = exchange(addr, &from(a, &bad)).await;
        check_answer(
            &resp,
            Expect::Invalid("bad-signature"),
            PUBLIC_URL,
            &format!("client A failure {}", i + 1),
        );
    }
    let new = cursor.take(&d, 20).await;
    assert!(
        new.len() == 20 && new.iter().all(|r| r["address_class"] == "public"),
        "client A's records must be 20, class public: {new:?}"
    );
    assert_429(
        &exchange(addr, &from(a, &bad)).await,
        "client A, 21st failure",
    );
    cursor
        .expect_one(&d, "bad-signature", true, "public", "client A throttled")
        .await;
    // The rightmost untrusted hop is the client: a trusted proxy hop after A is skipped.
    assert_429(
        &exchange(addr, &from(&format!("{a}, 127.0.0.1"), &bad)).await,
        "A behind two trusted hops",
    );
    assert_429(
        &exchange(addr, &from(&format!("{b}, {a}"), &bad)).await,
        "B spoofed before A: A is the client",
    );
    // Client B is another address: not throttled.
    check_answer(
        &exchange(addr, &from(b, &bad)).await,
        Expect::Invalid("bad-signature"),
        PUBLIC_URL,
        "client B's first failure",
    );
    // The proxy itself (no X-Forwarded-For) is another address too.
    check_answer(
        &exchange(addr, &remote_mcp(Some(&bad), &tools_list(1))).await,
        Expect::Invalid("bad-signature"),
        PUBLIC_URL,
        "the proxy's own failure",
    );
    // Valid tokens are served for both.
    for (xff, case) in [(a, "client A valid"), (b, "client B valid")] {
        assert_catalog_served(&exchange(addr, &from(xff, &good)).await, 1, case);
    }
    // A private client is classed private.
    cursor.take(&d, 4).await;
    check_answer(
        &exchange(addr, &from(private, &bad)).await,
        Expect::Invalid("bad-signature"),
        PUBLIC_URL,
        "private client",
    );
    cursor
        .expect_one(&d, "bad-signature", false, "private", "private client")
        .await;
    // A malformed hop falls back to the peer: 19 more such failures exhaust the peer
    // (one proxy failure above), then the peer itself is throttled.
    for i in 0..19 {
        check_answer(
            &exchange(addr, &from(&format!("{b}, not-an-ip"), &bad)).await,
            Expect::Invalid("bad-signature"),
            PUBLIC_URL,
            &format!("malformed hop failure {}", i + 1),
        );
    }
    assert_429(
        &exchange(addr, &remote_mcp(Some(&bad), &tools_list(1))).await,
        "the peer after malformed-hop failures counted against it",
    );
    check_answer(
        &exchange(addr, &from(b, &bad)).await,
        Expect::Invalid("bad-signature"),
        PUBLIC_URL,
        "client B still not throttled",
    );

    let text = metrics(&d);
    assert!(
        !d.stderr_text().is_empty(),
        "the daemon logged nothing: the log scan would prove nothing"
    );
    robota_e2e::assert_no_secrets(&d.secrets(), &text, "metrics");
    let all = d.ctl_ok(&["--json", "audit"]).stdout;
    robota_e2e::assert_no_secrets(&d.secrets(), &all, "audit output");
    let human = d.ctl_ok(&["audit"]).stdout;
    robota_e2e::assert_no_secrets(&d.secrets(), &human, "audit table");
    d.assert_no_secrets();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forwarded_for_is_ignored_without_trusted_proxies() {
    let (authz, keys) = Authz::with_standard_keys();
    let Remote { d, addr } = start(&RemoteConfig::new(&authz));
    let attacker = SigningKey::generate(Algorithm::RS256, "rsa-1");
    let bad = authz.token(&attacker, PUBLIC_URL).build();
    register_token(&d, &bad);
    let mut cursor = AuditCursor::new(&d);
    for i in 0..20 {
        let xff = format!("203.0.113.{}", i + 1);
        d.register_secret(&xff);
        let req = remote_mcp(Some(&bad), &tools_list(1)).header("X-Forwarded-For", &xff);
        check_answer(
            &exchange(addr, &req).await,
            Expect::Invalid("bad-signature"),
            PUBLIC_URL,
            &format!("failure {} claiming {xff}", i + 1),
        );
    }
    let new = cursor.take(&d, 20).await;
    assert!(
        new.len() == 20 && new.iter().all(|r| r["address_class"] == "loopback"),
        "X-Forwarded-For must be ignored: {new:?}"
    );
    let req = remote_mcp(Some(&bad), &tools_list(1)).header("X-Forwarded-For", "198.51.100.77");
    d.register_secret("198.51.100.77");
    assert_429(
        &exchange(addr, &req).await,
        "21st failure from the same peer, new X-Forwarded-For",
    );
    let good = authz.token(&keys.ec, PUBLIC_URL).build();
    register_token(&d, &good);
    assert_catalog_served(
        &exchange(addr, &remote_mcp(Some(&good), &tools_list(1))).await,
        1,
        "valid token",
    );
    d.assert_no_secrets();
}

// ---------------------------------------------------------------------------------------
// 5. Key rotation.
// ---------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn new_kid_is_fetched_once_and_refetches_are_rate_limited() {
    let (authz, keys) = Authz::with_standard_keys();
    let cfg = RemoteConfig::new(&authz).throttle(1000, "60s");
    let Remote { d, addr } = start(&cfg);
    let f0 = authz.jwks_fetches();
    assert!(f0 >= 1, "the daemon fetched no JWKS at start");
    let good = authz.token(&keys.rsa, PUBLIC_URL).build();
    register_token(&d, &good);
    assert_catalog_served(
        &exchange(addr, &remote_mcp(Some(&good), &tools_list(1))).await,
        1,
        "start-up key",
    );
    assert_eq!(authz.jwks_fetches(), f0, "a known kid caused a fetch");

    // A key published right after start: the start-up load does not start the refetch
    // cooldown, so the first unknown kid is fetched at once.
    let new_key = SigningKey::generate(Algorithm::ES256, "ec-2");
    authz.publish(&new_key);
    let t = authz.token(&new_key, PUBLIC_URL).build();
    register_token(&d, &t);
    assert_catalog_served(
        &exchange(addr, &remote_mcp(Some(&t), &tools_list(1))).await,
        1,
        "a kid published after start",
    );
    assert_eq!(
        authz.jwks_fetches(),
        f0 + 1,
        "exactly one refetch for the new kid"
    );
    // The same kid again: no fetch.
    assert_catalog_served(
        &exchange(addr, &remote_mcp(Some(&t), &tools_list(1))).await,
        1,
        "the new kid again",
    );
    assert_eq!(authz.jwks_fetches(), f0 + 1);

    // A second unknown kid right after: unknown-key, no second fetch.
    let newer = SigningKey::generate(Algorithm::RS256, "rsa-3");
    authz.publish(&newer);
    let t2 = authz.token(&newer, PUBLIC_URL).build();
    register_token(&d, &t2);
    let mut cursor = AuditCursor::new(&d);
    check_answer(
        &exchange(addr, &remote_mcp(Some(&t2), &tools_list(1))).await,
        Expect::Invalid("unknown-key"),
        PUBLIC_URL,
        "second new kid within the cooldown",
    );
    cursor
        .expect_one(&d, "unknown-key", false, "loopback", "second new kid")
        .await;
    // A burst of random kids: still no fetch.
    let mut burst = Vec::new();
    for i in 0..10 {
        let k = authz
            .token(&newer, PUBLIC_URL)
            .header("kid", format!("random-{i}-{}", now_secs()))
            .build();
        burst.push(tokio::spawn(async move {
            exchange(addr, &remote_mcp(Some(&k), &tools_list(1)))
                .await
                .status
        }));
    }
    for h in burst {
        assert_eq!(h.await.expect("burst task"), 401);
    }
    assert_eq!(
        authz.jwks_fetches(),
        f0 + 1,
        "a second unknown kid or a burst caused a fetch inside the cooldown"
    );

    // The operator's refresh fetches at once, cooldown or not, and the second kid is
    // admitted. (That the next unknown kid after the cooldown refetches by itself is the
    // verifier's unit test, on a manual clock.)
    let out = d.ctl_ok(&["keys", "refresh"]);
    assert!(
        out.stdout.starts_with("key set refreshed: 5 keys from "),
        "{}",
        out.stdout
    );
    assert_eq!(authz.jwks_fetches(), f0 + 2);
    assert_catalog_served(
        &exchange(addr, &remote_mcp(Some(&t2), &tools_list(1))).await,
        1,
        "second new kid after the operator's refresh",
    );
    assert_eq!(authz.jwks_fetches(), f0 + 2);
    // The metric agrees with the issuer.
    let text = metrics(&d);
    let ok = metric_sum(
        &text,
        &["robota_mcpd_jwks_fetches_total{", "outcome=\"ok\""],
    );
    assert!(
        ok >= (f0 + 2) as f64,
        "jwks_fetches_total{{outcome=\"ok\"}} = {ok}, issuer saw {}",
        f0 + 2
    );
    d.assert_no_secrets();
}

// ---------------------------------------------------------------------------------------
// Key-set edges and sources.
// ---------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oct_keys_are_ignored_and_hs256_never_verifies() {
    let (authz, keys) = Authz::with_standard_keys();
    let secret = b"an-hmac-secret-published-as-an-oct-key".to_vec();
    authz.publish_raw_jwk(json!({
        "kty": "oct", "kid": "hs-1", "use": "sig", "alg": "HS256", "k": b64(&secret)
    }));
    let cfg = RemoteConfig::new(&authz).throttle(1000, "60s");
    let Remote { d, addr } = start(&cfg);
    let good = authz.token(&keys.rsa, PUBLIC_URL).build();
    assert_catalog_served(
        &exchange(addr, &remote_mcp(Some(&good), &tools_list(1))).await,
        1,
        "RSA key next to an oct key",
    );
    let hs = authz
        .token(&keys.rsa, PUBLIC_URL)
        .header("alg", "HS256")
        .header("kid", "hs-1")
        .hmac(&secret, Algorithm::HS256)
        .build();
    let mut cursor = AuditCursor::new(&d);
    check_answer(
        &exchange(addr, &remote_mcp(Some(&hs), &tools_list(1))).await,
        Expect::Invalid("unsupported-algorithm"),
        PUBLIC_URL,
        "HS256 with the published oct key",
    );
    cursor
        .expect_one(&d, "unsupported-algorithm", false, "loopback", "HS256 oct")
        .await;
}

/// `n` fresh ES256 keys `ec-0` ….
fn many_keys(n: usize) -> Vec<Arc<SigningKey>> {
    (0..n)
        .map(|i| SigningKey::generate(Algorithm::ES256, &format!("ec-{i}")))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn key_set_of_32_keys_is_accepted_and_33_rejected() {
    let authz = Authz::start();
    let keys = many_keys(33);
    for k in &keys[..32] {
        authz.publish(k);
    }
    let cfg = RemoteConfig::new(&authz);
    let Remote { d, addr } = start(&cfg);
    let t = authz.token(&keys[31], PUBLIC_URL).build();
    assert_catalog_served(
        &exchange(addr, &remote_mcp(Some(&t), &tools_list(1))).await,
        1,
        "32 keys",
    );
    drop(d);

    let authz = Authz::start();
    for k in &keys {
        authz.publish(k);
    }
    let cfg = RemoteConfig::new(&authz).start_without_keys(true);
    let Remote { d, addr } = start(&cfg);
    let t = authz.token(&keys[0], PUBLIC_URL).build();
    let mut cursor = AuditCursor::new(&d);
    check_answer(
        &exchange(addr, &remote_mcp(Some(&t), &tools_list(1))).await,
        Expect::Unavailable,
        PUBLIC_URL,
        "33 keys: the set is refused",
    );
    cursor
        .expect_one(&d, "keys-unavailable", false, "loopback", "33 keys")
        .await;
    let text = metrics(&d);
    assert!(
        metric_sum(
            &text,
            &["robota_mcpd_jwks_fetches_total{", "outcome=\"rejected\""]
        ) >= 1.0,
        "a 33-key set must count as a rejected fetch"
    );
}

/// A JWKS body of exactly `len` bytes holding `key`, padded with whitespace.
fn padded_jwks(key: &SigningKey, len: usize) -> Vec<u8> {
    let mut body = serde_json::to_vec(&json!({"keys": [key.jwk()]})).expect("json");
    assert!(body.len() < len);
    let close = body.pop().expect("}");
    body.resize(len - 1, b' ');
    body.push(close);
    assert_eq!(body.len(), len);
    body
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn key_set_body_cap_is_64_kib() {
    let key = SigningKey::generate(Algorithm::EdDSA, "ed-cap");
    let authz = Authz::start();
    authz.serve_jwks_body(Some(padded_jwks(&key, 64 * 1024)));
    let Remote { d, addr } = start(&RemoteConfig::new(&authz));
    let t = authz.token(&key, PUBLIC_URL).build();
    assert_catalog_served(
        &exchange(addr, &remote_mcp(Some(&t), &tools_list(1))).await,
        1,
        "a 64 KiB key set",
    );
    drop(d);

    let authz = Authz::start();
    authz.serve_jwks_body(Some(padded_jwks(&key, 64 * 1024 + 1)));
    let Remote { d, addr } = start(&RemoteConfig::new(&authz).start_without_keys(true));
    let t = authz.token(&key, PUBLIC_URL).build();
    check_answer(
        &exchange(addr, &remote_mcp(Some(&t), &tools_list(1))).await,
        Expect::Unavailable,
        PUBLIC_URL,
        "a key set one byte over 64 KiB",
    );
    let text = metrics(&d);
    assert!(
        metric_sum(
            &text,
            &["robota_mcpd_jwks_fetches_total{", "outcome=\"rejected\""]
        ) >= 1.0,
        "an oversized key set must count as a rejected fetch"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oidc_discovery_is_the_fallback() {
    let authz = Authz::start_with(Discovery::OidcOnly);
    let key = SigningKey::generate(Algorithm::RS256, "rsa-oidc");
    authz.publish(&key);
    let Remote { d: _d, addr } = start(&RemoteConfig::new(&authz));
    assert!(
        authz.hits("/.well-known/openid-configuration") >= 1,
        "{:?}",
        authz.hit_paths()
    );
    let t = authz.token(&key, PUBLIC_URL).build();
    assert_catalog_served(
        &exchange(addr, &remote_mcp(Some(&t), &tools_list(1))).await,
        1,
        "keys found through OIDC discovery",
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explicit_jwks_uri_skips_discovery() {
    let (authz, keys) = Authz::with_standard_keys();
    let cfg = RemoteConfig::new(&authz).jwks_uri(&authz.jwks_uri());
    let Remote { d: _d, addr } = start(&cfg);
    let t = authz.token(&keys.ed, PUBLIC_URL).build();
    assert_catalog_served(
        &exchange(addr, &remote_mcp(Some(&t), &tools_list(1))).await,
        1,
        "explicit jwks_uri",
    );
    let paths = authz.hit_paths();
    assert!(
        paths.keys().all(|p| p == "/jwks"),
        "only the JWKS may be fetched: {paths:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_jwks_file_needs_no_issuer() {
    let (authz, keys) = Authz::with_standard_keys();
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("jwks.json");
    std::fs::write(&file, serde_json::to_vec(&authz.jwks()).expect("json")).expect("write");
    authz.go_down();
    let cfg = RemoteConfig::new(&authz).jwks_file(&file);
    let Remote { d: _d, addr } = start(&cfg);
    let t = authz.token(&keys.ec, PUBLIC_URL).build();
    assert_catalog_served(
        &exchange(addr, &remote_mcp(Some(&t), &tools_list(1))).await,
        1,
        "keys from a local file",
    );
    assert_eq!(authz.total_hits(), 0, "{:?}", authz.hit_paths());
}

// ---------------------------------------------------------------------------------------
// 6. Start-up with and without keys.
// ---------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issuer_down_at_start_uses_the_cached_key_set() {
    let (authz, keys) = Authz::with_standard_keys();
    let state = tempfile::tempdir().expect("state dir");
    let state_dir = state.path().join("state");
    let cfg = RemoteConfig::new(&authz);
    let token = authz.token(&keys.rsa, PUBLIC_URL).build();
    {
        let d = cfg.builder().state_dir(&state_dir).start();
        let addr = d.remote_addr();
        assert_catalog_served(
            &exchange(addr, &remote_mcp(Some(&token), &tools_list(1))).await,
            1,
            "first run",
        );
        assert!(
            state_dir.join("jwks-cache.json").is_file(),
            "no jwks-cache.json in the state directory"
        );
        d.ctl_ok(&["stop"]);
        let st = d.wait_exit(Duration::from_secs(20));
        assert!(st.is_some_and(|s| s.success()), "clean stop: {st:?}");
    }
    authz.go_down();
    let d = cfg.builder().state_dir(&state_dir).start();
    let addr = d.remote_addr();
    for key in [&keys.rsa, &keys.ec, &keys.ed] {
        let t = authz.token(key, PUBLIC_URL).build();
        register_token(&d, &t);
        assert_catalog_served(
            &exchange(addr, &remote_mcp(Some(&t), &tools_list(1))).await,
            1,
            &format!("{} from the cache, issuer down", key.kid),
        );
    }
    let (st, _) = remote_status(&d);
    let keys = &st["key_set"];
    assert_eq!(keys["from_cache"], true, "{st}");
    assert_eq!(keys["keys"], 3, "{st}");
    assert!(keys["last_error"].is_string(), "{st}");
    let human = d.ctl_ok(&["status"]).stdout;
    assert!(
        human.contains("3 keys from the cache of") && human.contains("failed"),
        "{human}"
    );
    d.assert_no_secrets();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_cache_and_no_issuer_fails_start_naming_the_issuer() {
    let (authz, _keys) = Authz::with_standard_keys();
    authz.go_down();
    let cfg = RemoteConfig::new(&authz);
    let d = cfg.builder().spawn();
    let st = d
        .wait_exit(Duration::from_secs(40))
        .unwrap_or_else(|| panic!("the daemon kept running without keys: {}", d.stderr_text()));
    assert!(
        st.code().is_some_and(|c| c != 0),
        "start without keys must exit non-zero, got {st:?}"
    );
    assert_eq!(
        d.notify().count("READY=1"),
        0,
        "READY=1 sent without keys: {:?}",
        d.notify().lines()
    );
    let stderr = d.stderr_text();
    assert!(
        stderr.contains(authz.issuer()),
        "stderr must name the issuer {}: {stderr}",
        authz.issuer()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn start_without_keys_answers_503_until_keys_load() {
    let (authz, keys) = Authz::with_standard_keys();
    authz.go_down();
    // A failed load is retried on schedule after `min`.
    let cfg = RemoteConfig::new(&authz)
        .start_without_keys(true)
        .key_refresh("min", "1s");
    let Remote { d, addr } = start(&cfg);
    let token = authz.token(&keys.rsa, PUBLIC_URL).build();
    register_token(&d, &token);
    let mut cursor = AuditCursor::new(&d);
    check_answer(
        &exchange(addr, &remote_mcp(Some(&token), &tools_list(1))).await,
        Expect::Unavailable,
        PUBLIC_URL,
        "valid token, no keys",
    );
    cursor
        .expect_one(&d, "keys-unavailable", false, "loopback", "no keys")
        .await;
    // Not counted for throttling: 25 more are still 503, never 429.
    for i in 0..25 {
        let resp = exchange(addr, &remote_mcp(Some(&token), &tools_list(1))).await;
        assert_eq!(
            resp.status,
            503,
            "keys-unavailable #{}: {}",
            i + 2,
            resp.describe()
        );
    }
    let text = metrics(&d);
    assert_eq!(refusal_metric(&text, "keys-unavailable"), 26.0);
    assert!(
        metric_sum(
            &text,
            &["robota_mcpd_jwks_fetches_total{", "outcome=\"error\""]
        ) >= 1.0,
        "failed fetches must be counted as errors"
    );
    let (st, _) = remote_status(&d);
    let keys = &st["key_set"];
    assert!(
        keys["keys"] == 0 && keys["location"].is_null() && keys["last_error"].is_string(),
        "{st}"
    );

    // The issuer comes back: the schedule retries every second; keys load without a
    // token having to wait for the 30 s refetch cooldown.
    authz.come_back();
    let loaded = poll_until_async(
        Duration::from_secs(15),
        Duration::from_millis(250),
        || async {
            exchange(addr, &remote_mcp(Some(&token), &tools_list(1)))
                .await
                .status
                == 200
        },
    )
    .await;
    assert!(
        loaded,
        "keys never loaded after the issuer came back (fetches: {:?}) {}\n{}",
        authz.hit_paths(),
        key_set(&d),
        d.stderr_text()
    );
    d.assert_no_secrets();
}

// ---------------------------------------------------------------------------------------
// TLS terminated by the daemon.
// ---------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_terminated_by_the_daemon() {
    let (authz, keys) = Authz::with_standard_keys();
    let dir = tempfile::tempdir().expect("tempdir");
    let (cert, key) = authz.ca().leaf(&[PUBLIC_HOST]);
    let (cert_file, key_file) = (dir.path().join("cert.pem"), dir.path().join("key.pem"));
    std::fs::write(&cert_file, cert).expect("cert");
    std::fs::write(&key_file, key).expect("key");
    let cfg = RemoteConfig::new(&authz).tls(&cert_file, &key_file);
    let Remote { d, addr } = start(&cfg);
    let token = authz.token(&keys.rsa, PUBLIC_URL).build();
    register_token(&d, &token);
    let client = authz.ca().client_config();
    let resp = tls_exchange(
        client.clone(),
        addr,
        PUBLIC_HOST,
        &remote_mcp(Some(&token), &tools_list(1)),
    )
    .await
    .expect("TLS exchange");
    assert_catalog_served(&resp, 1, "over TLS");
    let resp = tls_exchange(client, addr, PUBLIC_HOST, &remote_mcp(None, &tools_list(1)))
        .await
        .expect("TLS exchange");
    check_answer(&resp, Expect::MissingToken, PUBLIC_URL, "TLS, no token");
    // Plain HTTP on a TLS listener is not served.
    let plain =
        robota_e2e::http::try_exchange(addr, &remote_mcp(Some(&token), &tools_list(1))).await;
    assert!(
        !matches!(plain, Ok(ref r) if r.status == 200),
        "plain HTTP was served on the TLS listener: {:?}",
        plain.map(|r| r.describe())
    );
    d.assert_no_secrets();
}

// ---------------------------------------------------------------------------------------
// Tokens anywhere but the Authorization header.
// ---------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_in_the_query_string_are_never_accepted_nor_logged() {
    let (authz, keys) = Authz::with_standard_keys();
    let Remote { d, addr } = start(&RemoteConfig::new(&authz));
    let token = authz.token(&keys.rsa, PUBLIC_URL).build();
    register_token(&d, &token);
    let target = format!("/mcp?access_token={token}");
    let resp = exchange(
        addr,
        &remote_mcp_at(&target, PUBLIC_HOST, None, &tools_list(1)),
    )
    .await;
    assert!(
        matches!(resp.status, 400 | 401 | 404),
        "a token in the query string must not be honoured: {}",
        resp.describe()
    );
    assert!(resp.body.is_empty(), "{}", resp.describe());
    // The header is the only bearer method: the metadata says so.
    let meta = exchange(
        addr,
        &get("/.well-known/oauth-protected-resource/mcp", PUBLIC_HOST),
    )
    .await;
    let doc: Value = serde_json::from_slice(&meta.body).expect("metadata JSON");
    assert_eq!(doc["bearer_methods_supported"], json!(["header"]));
    let text = metrics(&d);
    robota_e2e::assert_no_secrets(&d.secrets(), &text, "metrics");
    d.assert_no_secrets();
}

// ---------------------------------------------------------------------------------------
// Configuration knobs: tracked-address cap, audiences, algorithms, wire names, errors.
// ---------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tracked_address_cap_evicts_the_oldest_address() {
    let (authz, _keys) = Authz::with_standard_keys();
    let cfg = RemoteConfig::new(&authz)
        .trusted_proxies(&["127.0.0.1"])
        .max_addresses(2);
    let Remote { d, addr } = start(&cfg);
    let attacker = SigningKey::generate(Algorithm::RS256, "rsa-1");
    let bad = authz.token(&attacker, PUBLIC_URL).build();
    let (a, b, c) = ("203.0.113.21", "203.0.113.22", "203.0.113.23");
    for ip in [a, b, c] {
        d.register_secret(ip);
    }
    let from = |xff: &str| remote_mcp(Some(&bad), &tools_list(1)).header("X-Forwarded-For", xff);
    for _ in 0..20 {
        assert_eq!(exchange(addr, &from(a)).await.status, 401);
    }
    assert_429(&exchange(addr, &from(a)).await, "A throttled");
    // B is the second tracked address: within the cap.
    assert_eq!(exchange(addr, &from(b)).await.status, 401, "B");
    // C is a third: the oldest (A) is evicted, so A starts afresh.
    assert_eq!(exchange(addr, &from(c)).await.status, 401, "C");
    assert_eq!(
        exchange(addr, &from(a)).await.status,
        401,
        "A after eviction by a third address (max_addresses = 2)"
    );
    d.assert_no_secrets();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn configured_audiences_and_algorithms_are_exact() {
    let (authz, keys) = Authz::with_standard_keys();
    let cfg = RemoteConfig::new(&authz)
        .audiences(&[PUBLIC_URL, "urn:robota:mcp"])
        .algorithms(&["ES256", "EdDSA"]);
    let Remote { d, addr } = start(&cfg);
    for (case, token, expect) in [
        (
            "ES256, aud the public URL",
            authz.token(&keys.ec, PUBLIC_URL).build(),
            Expect::Admitted,
        ),
        (
            "EdDSA, aud the second audience",
            authz.token(&keys.ed, "urn:robota:mcp").build(),
            Expect::Admitted,
        ),
        (
            "ES256, another audience",
            authz.token(&keys.ec, "urn:other").build(),
            Expect::Invalid("wrong-audience"),
        ),
        (
            "ES256, both configured audiences at once",
            authz
                .token(&keys.ec, PUBLIC_URL)
                .claim("aud", json!([PUBLIC_URL, "urn:robota:mcp"]))
                .build(),
            Expect::Invalid("wrong-audience"),
        ),
        (
            "RS256 with RS256 left out of the allow-list",
            authz.token(&keys.rsa, PUBLIC_URL).build(),
            Expect::Invalid("unsupported-algorithm"),
        ),
    ] {
        let mut cursor = AuditCursor::new(&d);
        let resp = exchange(addr, &remote_mcp(Some(&token), &tools_list(1))).await;
        check_answer(&resp, expect, PUBLIC_URL, case);
        match expect.reasons() {
            [] => assert!(cursor.take(&d, 0).await.is_empty(), "{case}"),
            [reason] => cursor.expect_one(&d, reason, false, "loopback", case).await,
            more => panic!("{case}: one reason expected, not {more:?}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compat_wire_names_on_the_remote_carrier() {
    let (authz, keys) = Authz::with_standard_keys();
    let cfg = RemoteConfig::new(&authz).line("wire_names = \"compat\"");
    let Remote { d: _d, addr } = start(&cfg);
    let token = authz.token(&keys.rsa, PUBLIC_URL).build();
    let resp = exchange(addr, &remote_mcp(Some(&token), &tools_list(1))).await;
    assert_eq!(resp.status, 200, "{}", resp.describe());
    let names = tool_names(&resp.expect_rpc(1));
    assert!(
        names.iter().any(|n| n == "system_info") && names.iter().all(|n| !n.contains('.')),
        "compat names on the remote carrier: {names:?}"
    );
}

#[test]
fn remote_config_errors_name_their_key() {
    let authz = Authz::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let base = RemoteConfig::new(&authz);
    let cases: Vec<(&str, RemoteConfig, &str)> = vec![
        (
            "http public URL",
            base.clone().public_url("http://mcp.test.example/mcp"),
            "remote.public_url",
        ),
        (
            "public URL with user-info",
            base.clone().public_url("https://u:p@mcp.test.example/mcp"),
            "remote.public_url",
        ),
        (
            "public URL with a query",
            base.clone().public_url("https://mcp.test.example/mcp?x=1"),
            "remote.public_url",
        ),
        (
            "public URL with a fragment",
            base.clone().public_url("https://mcp.test.example/mcp#f"),
            "remote.public_url",
        ),
        (
            "no principal allow-list",
            RemoteConfig {
                allowed_subjects: Vec::new(),
                allowed_clients: Vec::new(),
                ..base.clone()
            },
            "remote",
        ),
        (
            "HS256 in the algorithm list",
            base.clone().algorithms(&["RS256", "HS256"]),
            "remote.algorithms",
        ),
        (
            "a trusted proxy that is not an address",
            base.clone().trusted_proxies(&["proxy.example"]),
            "remote.trusted_proxies",
        ),
        ("an unknown key", base.clone().line("bogus = 1"), "bogus"),
    ];
    let good = Daemon::builder().extra(base.toml()).config_text(dir.path());
    let path = dir.path().join("good.toml");
    std::fs::write(&path, good).expect("write");
    robota_e2e::daemon::check_config(&path).expect_code(0, "the base remote config");
    for (i, (case, cfg, key)) in cases.into_iter().enumerate() {
        let path = dir.path().join(format!("bad-{i}.toml"));
        std::fs::write(
            &path,
            Daemon::builder().extra(cfg.toml()).config_text(dir.path()),
        )
        .expect("write");
        let out = robota_e2e::daemon::check_config(&path);
        out.expect_code(robota_e2e::EXIT_CONFIG, case);
        assert!(
            out.stderr.contains(key),
            "{case}: the error must name {key}: {}",
            out.stderr
        );
    }
}

// ---------------------------------------------------------------------------------------
// Key refresh: on schedule, by the operator, on reload; a stalled issuer.
// ---------------------------------------------------------------------------------------

/// `status.key_set`, as JSON.
fn key_set(d: &Daemon) -> Value {
    remote_status(d).0["key_set"].clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removed_key_stops_verifying_at_the_scheduled_refresh() {
    let (authz, keys) = Authz::with_standard_keys();
    // The key server says: fresh for 2 s. The default lower bound (1 min) is lowered for
    // the test.
    authz.set_jwks_cache_control(Some("public, max-age=2"));
    let cfg = RemoteConfig::new(&authz).key_refresh("min", "1s");
    let Remote { d, addr } = start(&cfg);
    let st = key_set(&d);
    let period = st["next_refresh_at"].as_u64().unwrap() - st["last_attempt_at"].as_u64().unwrap();
    assert!((2..=3).contains(&period), "max-age 2 s honoured: {st}");
    let removed = authz.token(&keys.ec, PUBLIC_URL).build();
    let kept = authz.token(&keys.rsa, PUBLIC_URL).build();
    register_token(&d, &removed);
    register_token(&d, &kept);
    assert_catalog_served(
        &exchange(addr, &remote_mcp(Some(&removed), &tools_list(1))).await,
        1,
        "before the issuer removes ec-1",
    );

    authz.withdraw(&keys.ec.kid);
    let fetches = authz.jwks_fetches();
    let last = std::sync::atomic::AtomicU16::new(0);
    let refused = poll_until_async(
        Duration::from_secs(10),
        Duration::from_millis(100),
        || async {
            let status = exchange(addr, &remote_mcp(Some(&removed), &tools_list(1)))
                .await
                .status;
            last.store(status, std::sync::atomic::Ordering::Relaxed);
            status == 401
        },
    )
    .await;
    assert!(
        refused,
        "a token of the removed key still answered {} (JWKS fetches: {:?})",
        last.into_inner(),
        authz.hit_paths()
    );
    assert!(authz.jwks_fetches() > fetches, "refreshed by the schedule");
    check_answer(
        &exchange(addr, &remote_mcp(Some(&removed), &tools_list(1))).await,
        Expect::Invalid("unknown-key"),
        PUBLIC_URL,
        "the removed key",
    );
    assert_catalog_served(
        &exchange(addr, &remote_mcp(Some(&kept), &tools_list(1))).await,
        1,
        "a key still published",
    );
    assert_eq!(key_set(&d)["keys"], 2);
    d.assert_no_secrets();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operator_refresh_drops_a_removed_key_and_a_failed_one_keeps_the_set() {
    let (authz, keys) = Authz::with_standard_keys();
    let Remote { d, addr } = start(&RemoteConfig::new(&authz));
    let removed = authz.token(&keys.ec, PUBLIC_URL).build();
    let kept = authz.token(&keys.ed, PUBLIC_URL).build();
    register_token(&d, &removed);
    register_token(&d, &kept);
    assert_catalog_served(
        &exchange(addr, &remote_mcp(Some(&removed), &tools_list(1))).await,
        1,
        "ec-1 published",
    );
    authz.withdraw(&keys.ec.kid);
    // The schedule (10 minutes) has not come round: still trusted.
    assert_catalog_served(
        &exchange(addr, &remote_mcp(Some(&removed), &tools_list(1))).await,
        1,
        "ec-1 withdrawn, not refreshed yet",
    );
    let fetches = authz.jwks_fetches();
    let out = d.ctl_ok(&["--json", "keys", "refresh"]);
    let reply: Value = serde_json::from_str(&out.stdout).expect("key-set JSON");
    assert_eq!(reply["kind"], "key-set", "{reply}");
    assert_eq!(reply["keys"], 2, "{reply}");
    assert_eq!(authz.jwks_fetches(), fetches + 1);
    check_answer(
        &exchange(addr, &remote_mcp(Some(&removed), &tools_list(1))).await,
        Expect::Invalid("unknown-key"),
        PUBLIC_URL,
        "ec-1 after the operator's refresh",
    );

    // The issuer serves garbage: the refresh fails, says why, and the set held stays.
    authz.serve_jwks_body(Some(b"<html>maintenance</html>".to_vec()));
    let out = d.ctl(&["keys", "refresh"]);
    out.expect_code(1, "a failed key refresh");
    assert!(
        out.stderr.contains("unavailable") && out.stderr.contains("not a JWK set"),
        "{}",
        out.stderr
    );
    assert_catalog_served(
        &exchange(addr, &remote_mcp(Some(&kept), &tools_list(1))).await,
        1,
        "ed-1 after a failed refresh",
    );
    let st = key_set(&d);
    assert_eq!(st["keys"], 2, "{st}");
    assert!(
        st["last_error"]
            .as_str()
            .is_some_and(|e| e.contains("not a JWK set")),
        "{st}"
    );
    let human = d.ctl_ok(&["status"]).stdout;
    assert!(
        human.contains("the last refresh") && human.contains("failed"),
        "{human}"
    );
    let text = metrics(&d);
    assert_eq!(
        metric_sum(
            &text,
            &[
                "robota_mcpd_jwks_refresh_failures_total{",
                "trigger=\"operator\""
            ]
        ),
        1.0,
        "refresh failures"
    );
    let last_ok = metric_sum(&text, &["robota_mcpd_jwks_last_success_timestamp_seconds "]);
    assert!(
        (last_ok - now_secs() as f64).abs() < 60.0,
        "last success {last_ok}, now {}",
        now_secs()
    );
    assert_eq!(
        metric_sum(
            &text,
            &["robota_mcpd_jwks_fetches_total{", "outcome=\"rejected\""]
        ),
        1.0
    );
    // Mended: the next refresh clears the error.
    authz.serve_jwks_body(None);
    d.ctl_ok(&["keys", "refresh"]);
    assert!(key_set(&d)["last_error"].is_null());
    d.assert_no_secrets();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reload_rereads_a_changed_jwks_file() {
    let (authz, keys) = Authz::with_standard_keys();
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("jwks.json");
    let write = |keys: &[&Arc<SigningKey>]| {
        let doc = json!({"keys": keys.iter().map(|k| k.jwk()).collect::<Vec<_>>()});
        std::fs::write(&file, serde_json::to_vec(&doc).expect("json")).expect("write");
    };
    write(&[&keys.rsa, &keys.ec, &keys.ed]);
    authz.go_down();
    let Remote { d, addr } = start(&RemoteConfig::new(&authz).jwks_file(&file));
    let (rsa, ec) = (
        authz.token(&keys.rsa, PUBLIC_URL).build(),
        authz.token(&keys.ec, PUBLIC_URL).build(),
    );
    for (t, case) in [(&rsa, "rsa-1"), (&ec, "ec-1")] {
        register_token(&d, t);
        assert_catalog_served(
            &exchange(addr, &remote_mcp(Some(t), &tools_list(1))).await,
            1,
            case,
        );
    }
    // Each reload re-reads the file at once (the schedule would take a minute).
    for (signal, gone, token) in [(true, &keys.ec, &ec), (false, &keys.rsa, &rsa)] {
        let remaining: Vec<&Arc<SigningKey>> = [&keys.rsa, &keys.ec, &keys.ed]
            .into_iter()
            .filter(|k| k.kid != gone.kid && (signal || k.kid != keys.ec.kid))
            .collect();
        write(&remaining);
        let generation = d.status().generation;
        if signal {
            d.signal(nix::sys::signal::Signal::SIGHUP);
            let restarted = poll_until_async(LIMIT, Duration::from_millis(50), || async {
                let st = d.status();
                st.generation > generation && st.state == "serving"
            })
            .await;
            assert!(restarted, "SIGHUP did not restart: {}", d.stderr_text());
        } else {
            d.ctl_ok(&["restart"]);
        }
        let addr = d.remote_addr();
        check_answer(
            &exchange(addr, &remote_mcp(Some(token), &tools_list(1))).await,
            Expect::Invalid("unknown-key"),
            PUBLIC_URL,
            &format!("{} after the reload", gone.kid),
        );
        assert_eq!(key_set(&d)["keys"], remaining.len());
    }
    d.assert_no_secrets();
}

/// 70 requests with unknown kids against an issuer that accepts and never answers: one
/// fetch, each request answered 503 within about the bounded wait, and a valid token
/// served meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_kids_against_a_stalled_issuer_are_answered_fast() {
    let (authz, keys) = Authz::with_standard_keys();
    // 71 connections from one address: room for all of them, so the key wait is what
    // is measured (the per-address connection cap has tests of its own).
    let Remote { d, addr } = start(
        &RemoteConfig::new(&authz)
            .throttle(1000, "60s")
            .line("max_connections = 128")
            .line("max_connections_per_address = 128"),
    );
    let f0 = authz.jwks_fetches();
    authz.set_hang(true);
    let mut burst = tokio::task::JoinSet::new();
    for i in 0..70 {
        let t = authz
            .token(&keys.ec, PUBLIC_URL)
            .header("kid", format!("rotated-{i}"))
            .build();
        burst.spawn(async move {
            let started = Instant::now();
            let resp = exchange(addr, &remote_mcp(Some(&t), &tools_list(1))).await;
            (resp, started.elapsed())
        });
    }
    // A valid token (never seen before, a held key) while the burst waits.
    let good = authz
        .token(&keys.rsa, PUBLIC_URL)
        .claim("jti", "during-the-stall")
        .build();
    register_token(&d, &good);
    let started = Instant::now();
    assert_catalog_served(
        &exchange(addr, &remote_mcp(Some(&good), &tools_list(1))).await,
        1,
        "a valid token during the stall",
    );
    let good_took = started.elapsed();
    let mut slowest = Duration::ZERO;
    while let Some(joined) = burst.join_next().await {
        let (resp, took) = joined.expect("burst task");
        check_answer(
            &resp,
            Expect::Unavailable,
            PUBLIC_URL,
            "an unknown kid, stalled issuer",
        );
        let retry = resp.header("retry-after").unwrap_or_default();
        assert!(
            retry.parse::<u64>().is_ok_and(|s| s >= 1),
            "Retry-After {retry:?}"
        );
        slowest = slowest.max(took);
    }
    eprintln!("stalled issuer: slowest unknown-kid answer {slowest:?}, valid token {good_took:?}");
    assert!(
        slowest < Duration::from_secs(2),
        "slowest answer {slowest:?}"
    );
    assert!(
        good_took < Duration::from_secs(2),
        "valid token {good_took:?}"
    );
    assert!(
        poll_until(Duration::from_secs(5), Duration::from_millis(20), || authz
            .jwks_fetches()
            == f0 + 1)
        .await,
        "one fetch for the whole burst, saw {}",
        authz.jwks_fetches() - f0
    );
    assert!(key_set(&d)["refreshing"] == true);
    // Not counted toward throttling, and visible.
    let text = metrics(&d);
    assert_eq!(refusal_metric(&text, "keys-unavailable"), 70.0);
    assert_eq!(
        metric_sum(
            &text,
            &["robota_mcpd_throttled_total{", "carrier=\"remote\""]
        ),
        0.0
    );
    authz.set_hang(false);
    d.assert_no_secrets();
}

// ---------------------------------------------------------------------------------------
// Throttling by IPv6 prefix, and X-Forwarded-For read as bytes.
// ---------------------------------------------------------------------------------------

/// A request whose `X-Forwarded-For` is `xff`, verbatim bytes.
async fn raw_exchange_with_xff(addr: SocketAddr, xff: &[u8]) -> Response {
    let req = remote_mcp(None, &tools_list(1)).header("X-Forwarded-For", "@XFF@");
    let bytes = req.to_bytes();
    let at = bytes
        .windows(5)
        .position(|w| w == b"@XFF@")
        .expect("placeholder");
    let mut raw = bytes[..at].to_vec();
    raw.extend_from_slice(xff);
    raw.extend_from_slice(&bytes[at + 5..]);
    let mut c = Conn::connect(addr).await.expect("connect");
    c.write(&raw).await.expect("write");
    tokio::time::timeout(LIMIT, c.read_response())
        .await
        .expect("answer in time")
        .expect("a response")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_ipv6_prefix_cannot_evict_another_clients_window() {
    let (authz, _keys) = Authz::with_standard_keys();
    let cfg = RemoteConfig::new(&authz).trusted_proxies(&["127.0.0.1"]);
    let Remote { d, addr } = start(&cfg);
    let from = |xff: String| remote_mcp(None, &tools_list(1)).header("X-Forwarded-For", &xff);
    let victim = "203.0.113.7".to_owned();
    d.register_secret(&victim);
    for i in 0..20 {
        let resp = exchange(addr, &from(victim.clone())).await;
        assert_eq!(
            resp.status,
            401,
            "victim failure {}: {}",
            i + 1,
            resp.describe()
        );
    }
    assert_429(
        &exchange(addr, &from(victim.clone())).await,
        "the victim over its budget",
    );

    // 5000 addresses of one /64, more than the 4096 tracked clients.
    let started = Instant::now();
    let mut statuses: BTreeMap<u16, usize> = BTreeMap::new();
    let mut tasks = tokio::task::JoinSet::new();
    for worker in 0..8u32 {
        tasks.spawn(async move {
            let mut seen = Vec::new();
            for i in (worker..5000).step_by(8) {
                let xff = format!("2001:db8:1:2:{:x}:{:x}::1", i >> 8, i & 0xff);
                let req = remote_mcp(None, &tools_list(1)).header("X-Forwarded-For", &xff);
                seen.push(exchange(addr, &req).await.status);
            }
            seen
        });
    }
    while let Some(seen) = tasks.join_next().await {
        for status in seen.expect("worker") {
            *statuses.entry(status).or_default() += 1;
        }
    }
    eprintln!(
        "5000 failures from one /64 in {:?}: {statuses:?}",
        started.elapsed()
    );
    assert_eq!(
        statuses,
        BTreeMap::from([(401, 20), (429, 4980)]),
        "one /64 is one client with one budget"
    );
    assert_429(
        &exchange(addr, &from(victim.clone())).await,
        "the victim's window survived the /64",
    );
    // Another /64 is another client.
    let resp = exchange(addr, &from("2001:db8:1:3::1".into())).await;
    assert_eq!(resp.status, 401, "another /64: {}", resp.describe());
    d.assert_no_secrets();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stray_byte_left_of_the_appended_hop_changes_nothing() {
    let (authz, _keys) = Authz::with_standard_keys();
    let cfg = RemoteConfig::new(&authz)
        .trusted_proxies(&["127.0.0.1"])
        .throttle(3, "60s");
    let Remote { d, addr } = start(&cfg);
    for ip in ["203.0.113.7", "203.0.113.8", "198.51.100.9"] {
        d.register_secret(ip);
    }
    // Client A writes a non-ASCII byte into its own X-Forwarded-For; the proxy appends A.
    for i in 0..3 {
        let resp = raw_exchange_with_xff(addr, b"caf\xc3\xa9 \xff, 203.0.113.7").await;
        assert_eq!(
            resp.status,
            401,
            "A's failure {}: {}",
            i + 1,
            resp.describe()
        );
    }
    assert_429(
        &raw_exchange_with_xff(addr, b"\xfe, 203.0.113.7").await,
        "A is throttled as A",
    );
    // The proxy's own budget (and every other client's) is untouched.
    assert_eq!(
        raw_exchange_with_xff(addr, b"198.51.100.9").await.status,
        401,
        "client B"
    );
    assert_eq!(
        exchange(addr, &remote_mcp(None, &tools_list(1)))
            .await
            .status,
        401,
        "the proxy itself"
    );
    // A malformed hop the walk reaches still falls back to the peer.
    for _ in 0..2 {
        assert_eq!(
            raw_exchange_with_xff(addr, b"203.0.113.8\xff").await.status,
            401
        );
    }
    assert_429(
        &exchange(addr, &remote_mcp(None, &tools_list(1))).await,
        "the peer, charged for the malformed hops",
    );
    d.assert_no_secrets();
}
