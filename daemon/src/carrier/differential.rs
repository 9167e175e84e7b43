//! The endpoint against rmcp's stateless service as the oracle (docs/design.md §4.4): for
//! generated bodies and headers on every method the daemon serves, the endpoint answers
//! what the SDK's service answers — status, content type and messages — except where the
//! design says it answers first: the strict look (§4.7: a parse error, a batch, a bad id,
//! bad params, a duplicate key) and the protocol-version check (§3.2), each a 400 with a
//! JSON-RPC error. Any other difference is a bug.

use std::collections::BTreeMap;
use std::sync::Arc;

use bytes::Bytes;
use http::{HeaderValue, Request};
use http_body_util::{BodyExt, Full};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use serde_json::{Map, Value, json};
use tokio_util::sync::CancellationToken;

use rmcp::transport::streamable_http_server::session::never::NeverSessionManager;
use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};

use super::endpoint::{Endpoint, Site};
use crate::config::Limits;
use crate::config::{Environment, WireNameProfile, parse};
use crate::mcp::{InFlight, McpServer, Wire};
use crate::metrics::Metrics;
use crate::session::{RuntimeTools, TurnSubmission};
use crate::vocab::{Admitted, Caller, Listener};

const HOST: &str = "127.0.0.1:8080";
const ORIGIN: &str = "http://127.0.0.1:8080";

/// One generated request.
#[derive(Debug, Clone)]
struct Case {
    body: Vec<u8>,
    headers: Vec<(&'static str, &'static str)>,
}

fn id() -> impl Strategy<Value = Option<Value>> {
    prop_oneof![
        2 => Just(None),
        3 => any::<i64>().prop_map(|n| Some(json!(n))),
        8 => (0i64..100).prop_map(|n| Some(json!(n))),
        4 => "[a-z0-9é ]{0,6}".prop_map(|s| Some(json!(s))),
        1 => Just(Some(json!(i64::MAX))),
        1 => Just(Some(json!(i64::MIN))),
        1 => Just(Some(json!(i64::MAX as u64 + 1))),
        1 => Just(Some(json!(u64::MAX))),
        1 => Just(Some(json!(1.5))),
        1 => Just(Some(json!(1.0))),
        1 => Just(Some(json!(-0.0))),
        1 => Just(Some(json!(1e300))),
        1 => Just(Some(Value::Null)),
        1 => Just(Some(json!(true))),
        1 => Just(Some(json!([1]))),
        1 => Just(Some(json!({"a": 1}))),
    ]
}

fn meta() -> impl Strategy<Value = Option<Value>> {
    prop_oneof![
        3 => Just(None),
        1 => Just(Some(json!({}))),
        1 => Just(Some(json!({"progressToken": "t"}))),
        1 => Just(Some(json!({"io.modelcontextprotocol/protocolVersion": "2026-07-28"}))),
        3 => Just(Some(json!({
            "io.modelcontextprotocol/protocolVersion": "2026-07-28",
            "io.modelcontextprotocol/clientCapabilities": {},
        }))),
        1 => Just(Some(json!({
            "io.modelcontextprotocol/protocolVersion": "2026-07-28",
            "io.modelcontextprotocol/clientCapabilities": {"extensions": {"io.modelcontextprotocol/tasks": {}}},
            "progressToken": 5,
        }))),
        1 => Just(Some(json!({
            "io.modelcontextprotocol/protocolVersion": "2025-11-25",
            "io.modelcontextprotocol/clientCapabilities": {},
        }))),
        1 => Just(Some(json!({
            "io.modelcontextprotocol/protocolVersion": "1999-01-01",
            "io.modelcontextprotocol/clientCapabilities": {},
        }))),
        1 => Just(Some(json!({"x": [1, 2]}))),
        1 => Just(Some(Value::Null)),
        1 => Just(Some(json!(3))),
    ]
}

/// A method and its params (`None`: no `params` member).
fn method_and_params(
    meta: impl Strategy<Value = Option<Value>>,
) -> impl Strategy<Value = (&'static str, Option<Value>)> {
    let method = prop_oneof![
        4 => Just("ping"),
        4 => Just("tools/list"),
        6 => Just("tools/call"),
        1 => Just("initialize"),
        1 => Just("tasks/get"),
        1 => Just("server/discover"),
        1 => Just("nope/nope"),
        1 => Just("notifications/initialized"),
    ];
    // Tools whose answers do not change from one call to the next: an unknown one, bad
    // arguments, a job that is not there.
    let call = prop_oneof![
        Just(json!({"name": "system.nope"})),
        Just(json!({"name": "system.nope", "arguments": {}})),
        Just(json!({"name": "system.info", "arguments": {"x": 1}})),
        Just(json!({"name": "job.status", "arguments": {}})),
        Just(json!({"name": "job.status", "arguments": {"job": 99999}})),
        Just(json!({"name": "", "arguments": {}})),
        Just(json!({"name": 7})),
        Just(json!({"arguments": {}})),
        Just(json!({"name": "system.nope", "arguments": "text"})),
        Just(json!({"name": "system.nope", "task": {}})),
    ];
    let shape = prop_oneof![
        8 => Just(0u8), // an object
        2 => Just(1),   // absent
        1 => Just(2),   // null
        1 => Just(3),   // an array
    ];
    (
        method,
        shape,
        call,
        meta,
        proptest::option::of("[a-z]{1,3}"),
        any::<bool>(),
    )
        .prop_map(|(method, shape, call, meta, cursor, extra)| {
            let mut params = match method {
                "tools/call" => call.as_object().cloned().unwrap_or_default(),
                "initialize" => json!({"protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}})
                    .as_object()
                    .cloned()
                    .unwrap_or_default(),
                "tasks/get" => json!({"taskId": "4242"}).as_object().cloned().unwrap_or_default(),
                _ => Map::new(),
            };
            if let Some(meta) = meta {
                params.insert("_meta".into(), meta);
            }
            if method == "tools/list"
                && let Some(cursor) = cursor
            {
                params.insert("cursor".into(), Value::String(cursor));
            }
            if extra {
                params.insert("extra".into(), json!(1));
            }
            let params = match shape {
                0 => Some(Value::Object(params)),
                1 => None,
                2 => Some(Value::Null),
                _ => Some(json!([1])),
            };
            (method, params)
        })
}

fn body(meta: impl Strategy<Value = Option<Value>>) -> impl Strategy<Value = Vec<u8>> {
    let message = (
        id(),
        method_and_params(meta),
        prop_oneof![20 => Just("2.0"), 1 => Just("1.0")],
        any::<bool>(),
        prop_oneof![12 => Just(0u8), 1 => Just(1), 1 => Just(2)],
    )
        .prop_map(|(id, (method, params), version, extra, twist)| {
            let mut message = Map::new();
            message.insert("jsonrpc".into(), json!(version));
            if let Some(id) = &id {
                message.insert("id".into(), id.clone());
            }
            message.insert("method".into(), json!(method));
            if let Some(params) = params {
                message.insert("params".into(), params);
            }
            if extra {
                message.insert("extra".into(), json!("member"));
            }
            let text = Value::Object(message).to_string();
            match twist {
                // A key twice: the method, then another.
                1 => format!(
                    "{},\"method\":\"ping\"}}",
                    text.strip_suffix('}').unwrap_or(&text)
                ),
                // A batch of one.
                2 => format!("[{text}]"),
                _ => text,
            }
            .into_bytes()
        });
    prop_oneof![
        20 => message,
        1 => Just(b"{".to_vec()),
        1 => Just(b"".to_vec()),
        1 => Just(b"[]".to_vec()),
        1 => Just(b"null".to_vec()),
        1 => Just(b"{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"ping\"} x".to_vec()),
    ]
}

fn headers() -> impl Strategy<Value = Vec<(&'static str, &'static str)>> {
    let accept = prop_oneof![
        40 => Just(vec!["application/json, text/event-stream"]),
        1 => Just(vec!["application/json"]),
        1 => Just(vec!["text/event-stream"]),
        1 => Just(vec!["*/*"]),
        1 => Just(vec![]),
        1 => Just(vec!["application/json;q=0.9, text/event-stream"]),
        1 => Just(vec!["Application/JSON", "TEXT/EVENT-STREAM"]),
    ];
    let kind = prop_oneof![
        40 => Just(vec!["application/json"]),
        1 => Just(vec!["application/json; charset=utf-8"]),
        1 => Just(vec!["text/plain"]),
        1 => Just(vec![]),
        1 => Just(vec!["application/json", "application/json"]),
    ];
    let version = prop_oneof![
        6 => Just(vec!["2025-11-25"]),
        3 => Just(vec![]),
        6 => Just(vec!["2026-07-28"]),
        1 => Just(vec!["2025-06-18"]),
        1 => Just(vec!["2025-11-25", "2025-11-25"]),
        1 => Just(vec!["bogus"]),
    ];
    let origin = prop_oneof![
        10 => Just(vec![]),
        1 => Just(vec![ORIGIN]),
        1 => Just(vec!["http://evil.example"]),
    ];
    let coding = prop_oneof![
        30 => Just(vec![]),
        1 => Just(vec!["identity"]),
        1 => Just(vec!["gzip"]),
    ];
    (accept, kind, coding, version, origin).prop_map(|(accept, kind, coding, version, origin)| {
        let mut all = vec![("host", HOST)];
        all.extend(accept.into_iter().map(|v| ("accept", v)));
        all.extend(kind.into_iter().map(|v| ("content-type", v)));
        all.extend(coding.into_iter().map(|v| ("content-encoding", v)));
        all.extend(version.into_iter().map(|v| ("mcp-protocol-version", v)));
        all.extend(origin.into_iter().map(|v| ("origin", v)));
        all
    })
}

/// The SEP-2243 headers a client on 2026-07-28 sends for `body`: its method, and the
/// name, URI or task id where the method has one (or, now and then, a wrong one).
fn standard_headers(body: &[u8], wrong: bool) -> Vec<(&'static str, &'static str)> {
    fn known(text: &str) -> Option<&'static str> {
        [
            "ping",
            "tools/list",
            "tools/call",
            "initialize",
            "tasks/get",
            "server/discover",
            "nope/nope",
            "notifications/initialized",
            "system.nope",
            "system.info",
            "job.status",
            "4242",
            "",
        ]
        .into_iter()
        .find(|k| *k == text)
    }
    let Ok(message) = serde_json::from_slice::<Value>(body) else {
        return Vec::new();
    };
    let Some(method) = message
        .get("method")
        .and_then(Value::as_str)
        .and_then(known)
    else {
        return Vec::new();
    };
    let mut out = vec![("mcp-method", if wrong { "tools/list" } else { method })];
    let params = message.get("params");
    let name = match method {
        "tools/call" => params.and_then(|p| p.get("name")),
        "tasks/get" => params.and_then(|p| p.get("taskId")),
        _ => None,
    };
    if let Some(name) = name.and_then(Value::as_str).and_then(known) {
        out.push(("mcp-name", name));
    }
    out
}

/// A request of a client on 2026-07-28: the whole per-request `_meta`, the version header.
fn modern() -> impl Strategy<Value = (Vec<u8>, Vec<(&'static str, &'static str)>)> {
    let meta = prop_oneof![
        4 => Just(json!({
            "io.modelcontextprotocol/protocolVersion": "2026-07-28",
            "io.modelcontextprotocol/clientCapabilities": {},
        })),
        1 => Just(json!({
            "io.modelcontextprotocol/protocolVersion": "2026-07-28",
            "io.modelcontextprotocol/clientCapabilities": {"extensions": {"io.modelcontextprotocol/tasks": {}}},
            "io.modelcontextprotocol/clientInfo": {"name": "t", "version": "1"},
            "progressToken": "p",
        })),
    ];
    (body(meta.prop_map(Some)), headers()).prop_map(|(body, mut headers)| {
        headers.retain(|(n, _)| *n != "mcp-protocol-version");
        headers.push(("mcp-protocol-version", "2026-07-28"));
        (body, headers)
    })
}

fn case() -> impl Strategy<Value = Case> {
    (
        prop_oneof![
            3 => (body(meta()), headers()),
            1 => modern(),
        ],
        prop_oneof![6 => Just(0u8), 1 => Just(1), 1 => Just(2)],
    )
        .prop_map(|((body, mut headers), sep)| {
            let modern = headers
                .iter()
                .any(|(n, v)| *n == "mcp-protocol-version" && *v == "2026-07-28");
            // Mostly the headers a 2026-07-28 client sends; sometimes none, or wrong ones.
            if modern && sep != 1 {
                headers.extend(standard_headers(&body, sep == 2));
            }
            Case { body, headers }
        })
}

/// What an answer says: status, content type (essence), and its messages (the JSON body,
/// or each event's data of a stream; the raw text when neither).
#[derive(Debug, PartialEq)]
struct Said {
    status: u16,
    kind: Option<String>,
    messages: Vec<Value>,
}

async fn said(response: http::Response<super::http::Body>) -> Said {
    let status = response.status().as_u16();
    let kind = response
        .headers()
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .map(|v| v.split(';').next().unwrap_or_default().trim().to_owned());
    let body = response
        .into_body()
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    let messages = if kind.as_deref() == Some("text/event-stream") {
        String::from_utf8_lossy(&body)
            .split("\n\n")
            .filter_map(|event| {
                event
                    .lines()
                    .find_map(|l| l.strip_prefix("data:"))
                    .map(str::trim)
                    .filter(|d| !d.is_empty())
                    .map(|d| serde_json::from_str(d).unwrap_or(Value::String(d.into())))
            })
            .collect()
    } else if body.is_empty() {
        Vec::new()
    } else {
        vec![
            serde_json::from_slice(&body)
                .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&body).into_owned())),
        ]
    };
    Said {
        status,
        kind,
        messages,
    }
}

fn request(case: &Case) -> Request<Full<Bytes>> {
    let mut request = Request::post("/mcp")
        .body(Full::new(Bytes::from(case.body.clone())))
        .expect("a request");
    for (name, value) in &case.headers {
        request
            .headers_mut()
            .append(*name, HeaderValue::from_static(value));
    }
    request
}

/// A difference the design documents: the endpoint answered first, 400 with a JSON-RPC
/// error, for a request the strict look or the version check refuses; or the request
/// names another Origin, which the carrier's admission refuses (403, audited) before the
/// endpoint sees it, as the SDK's service refuses it (403); or its body is content-coded,
/// which the endpoint refuses (415) where the SDK would read it as plain.
fn documented(case: &Case, ours: &Said, theirs: &Said) -> bool {
    if case
        .headers
        .iter()
        .any(|(n, v)| *n == "content-encoding" && *v != "identity")
        && ours.status == 415
    {
        return true;
    }
    let foreign_origin = case
        .headers
        .iter()
        .any(|(n, v)| *n == "origin" && *v != ORIGIN);
    if foreign_origin {
        return theirs.status == 403;
    }
    let version_refused = {
        let versions: Vec<&str> = case
            .headers
            .iter()
            .filter(|(n, _)| *n == "mcp-protocol-version")
            .map(|(_, v)| *v)
            .collect();
        match versions[..] {
            [] => false,
            [one] => !crate::mcp::is_supported_version(one),
            _ => true,
        }
    };
    let strict_refused = crate::jsonrpc::inspect(&case.body).is_err();
    ours.status == 400
        && ours.messages.len() == 1
        && ours.messages[0].get("error").is_some()
        && (strict_refused || version_refused)
}

/// rmcp's stateless Streamable HTTP service over `server`, the oracle: JSON answers (a stream only when the handler sends a message
/// before its response), no session, no keep-alive events, rmcp's own host and origin
/// checks set to the carrier's names.
fn sdk_service<S: RuntimeTools + TurnSubmission>(
    server: McpServer<S>,
    limits: &Limits,
    hosts: Vec<String>,
    origin: String,
    drained: &CancellationToken,
) -> StreamableHttpService<McpServer<S>, NeverSessionManager> {
    let config = StreamableHttpServerConfig::default()
        .with_legacy_session_mode(false)
        .with_json_response(true)
        .with_sse_keep_alive(None)
        .with_allowed_hosts(hosts)
        .with_allowed_origins([origin])
        .enforce_origin_validation()
        .with_max_request_body_bytes(usize::try_from(limits.request_body).unwrap_or(usize::MAX))
        .with_cancellation_token(drained.child_token());
    StreamableHttpService::new(
        move || Ok(server.clone()),
        Arc::new(NeverSessionManager::default()),
        config,
    )
}

#[test]
fn the_endpoint_answers_as_the_sdks_service_but_where_documented() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a runtime");
    let _entered = runtime.enter();
    let env = Environment {
        runtime_directory: Some("/run/robota-mcpd".into()),
        state_directory: Some("/var/lib/robota-mcpd".into()),
        ..Environment::default()
    };
    let config = parse("[loopback]\n", &env).expect("a configuration");
    let bounds = config.loopback.as_ref().expect("a loopback carrier").bounds;
    let metrics = Metrics::new();
    let session = Arc::new(crate::session::tests::session(""));
    let server = McpServer::new(
        session,
        WireNameProfile::Canonical,
        BTreeMap::new(),
        Arc::new(InFlight::default()),
        Wire {
            result_limit: config.limits.tool_result,
            metrics: metrics.clone(),
        },
    )
    .expect("a server");
    let drained = CancellationToken::new();
    let endpoint = Endpoint::new(
        server.clone(),
        Site {
            listener: Listener::Loopback,
            metrics,
        },
        &bounds,
        &config.limits,
    );
    let oracle = sdk_service(
        server,
        &config.limits,
        vec![HOST.into()],
        ORIGIN.into(),
        &drained,
    );
    let caller: Admitted = Caller::Bearer("default".into()).into();
    let mut runner = TestRunner::new(Config {
        cases: 5000,
        failure_persistence: None,
        ..Config::default()
    });
    let seen = std::cell::RefCell::new(std::collections::HashMap::<u16, usize>::new());
    let negotiated = std::cell::RefCell::new(0usize);
    let listings = std::cell::RefCell::new(0usize);
    let result = runner.run(&case(), |case| {
        let (ours, theirs) = runtime.block_on(async {
            let ours = said(endpoint.serve(request(&case), caller.clone(), None).await).await;
            let mut to_oracle = request(&case);
            to_oracle.extensions_mut().insert(caller.clone());
            let theirs = said(oracle.handle(to_oracle).await.map(|b| b.boxed())).await;
            (ours, theirs)
        });
        *seen.borrow_mut().entry(ours.status).or_default() += 1;
        if ours.status == 200
            && case
                .headers
                .iter()
                .any(|(n, v)| *n == "mcp-protocol-version" && *v == "2026-07-28")
        {
            *negotiated.borrow_mut() += 1;
        }
        if ours.messages.iter().any(|m| {
            m.pointer("/result/tools")
                .and_then(Value::as_array)
                .is_some_and(|tools| !tools.is_empty())
        }) {
            *listings.borrow_mut() += 1;
        }
        prop_assert!(
            ours == theirs || documented(&case, &ours, &theirs),
            "{}\n{:?}\nours: {ours:?}\nthe SDK's: {theirs:?}",
            String::from_utf8_lossy(&case.body),
            case.headers
        );
        Ok(())
    });
    if let Err(e) = result {
        panic!("{e}");
    }
    // The generator reaches answers of every kind.
    let seen = seen.into_inner();
    for status in [200, 202, 400, 404, 406, 415] {
        assert!(seen.get(&status).is_some_and(|n| *n >= 10), "{seen:?}");
    }
    // Listings answered whole (the cached `tools` spliced into rmcp's shaped answer).
    let listings = listings.into_inner();
    assert!(listings >= 50, "{listings} whole tools/list answers");
    let negotiated = negotiated.into_inner();
    assert!(
        negotiated >= 100,
        "{negotiated} answers to requests negotiated per request"
    );

    // No request changes how another is answered: an `initialize` naming 2026-07-28 and
    // the tasks extension, then another caller's plain call, still answered in the
    // 2025-11-25 shape (no `resultType`).
    let post = |body: Value| Case {
        body: body.to_string().into_bytes(),
        headers: vec![
            ("host", HOST),
            ("accept", "application/json, text/event-stream"),
            ("content-type", "application/json"),
        ],
    };
    let initialize = post(
        json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2026-07-28",
        "capabilities": {"extensions": {"io.modelcontextprotocol/tasks": {}}},
        "clientInfo": {"name": "t", "version": "1"}}}),
    );
    let call = post(json!({"jsonrpc": "2.0", "id": 2, "method": "tools/call",
        "params": {"name": "system.info", "arguments": {}}}));
    let other: Admitted = Caller::Bearer("other".into()).into();
    runtime.block_on(async {
        let answered = said(
            endpoint
                .serve(request(&initialize), caller.clone(), None)
                .await,
        )
        .await;
        assert_eq!(answered.status, 200, "{answered:?}");
        let after = said(endpoint.serve(request(&call), other.clone(), None).await).await;
        let result = &after.messages[0]["result"];
        assert!(result.get("resultType").is_none(), "{after:?}");
        assert_eq!(result["isError"], false, "{after:?}");
    });
}
