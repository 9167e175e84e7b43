//! rmcp's own client against the daemon: over stdio (`robota-mcpd --stdio` as a child) and
//! over the loopback carrier, with MCP 2026-07-28 (`server/discover`) and 2025-11-25
//! (`initialize`).

use std::process::Stdio;
use std::time::Duration;

use rmcp::RoleClient;
use rmcp::model::{CallToolRequestParams, ClientConfig, JsonObject, ProtocolVersion, Tool};
use rmcp::service::{ClientLifecycleMode, ClientServiceExt, RunningService};
use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
use rmcp::transport::{StreamableHttpClientTransport, TokioChildProcess};
use robota_e2e::{Daemon, mcpd_bin, within};
use serde_json::Value;

type Client = RunningService<RoleClient, ClientConfig>;

const LIMIT: Duration = Duration::from_secs(20);

#[derive(Clone, Copy, Debug)]
enum Lifecycle {
    /// `initialize` handshake, MCP 2025-11-25.
    Initialize,
    /// `server/discover`, MCP 2026-07-28.
    Discover,
}

impl Lifecycle {
    fn expected_version(self) -> ProtocolVersion {
        match self {
            Lifecycle::Initialize => ProtocolVersion::V_2025_11_25,
            Lifecycle::Discover => ProtocolVersion::V_2026_07_28,
        }
    }

    /// The client configuration and lifecycle mode that negotiate this revision.
    fn client_config(self) -> (ClientConfig, ClientLifecycleMode) {
        match self {
            Lifecycle::Initialize => (
                ClientConfig::default().with_protocol_version(ProtocolVersion::V_2025_11_25),
                ClientLifecycleMode::Initialize,
            ),
            Lifecycle::Discover => (
                ClientConfig::default(),
                ClientLifecycleMode::Discover {
                    preferred_versions: vec![ProtocolVersion::V_2026_07_28],
                },
            ),
        }
    }

    async fn connect<T, E, A>(self, transport: T) -> Client
    where
        T: rmcp::transport::IntoTransport<RoleClient, E, A>,
        E: std::error::Error + Send + Sync + 'static,
    {
        let (config, mode) = self.client_config();
        let client = within(
            LIMIT,
            "client lifecycle start",
            config.serve_with_lifecycle(transport, mode),
        )
        .await
        .unwrap_or_else(|e| panic!("{self:?} lifecycle failed: {e}"));
        let info = client.peer_info().expect("server info after the handshake");
        assert_eq!(
            info.protocol_version,
            self.expected_version(),
            "negotiated protocol version"
        );
        client
    }
}

/// Wire names of the catalog under a profile.
struct Names {
    info: &'static str,
    health: &'static str,
    submit: &'static str,
}

const CANONICAL: Names = Names {
    info: "system.info",
    health: "system.health",
    submit: "agent_submit",
};

const COMPAT: Names = Names {
    info: "system_info",
    health: "system_health",
    submit: "agent_submit",
};

fn find<'a>(tools: &'a [Tool], name: &str) -> &'a Tool {
    tools.iter().find(|t| t.name == name).unwrap_or_else(|| {
        panic!(
            "tools/list lacks {name}: {:?}",
            tools.iter().map(|t| t.name.as_ref()).collect::<Vec<_>>()
        )
    })
}

/// Lists the tools and calls `system.info`; asserts what the spec fixes about both.
async fn exercise(client: &Client, names: &Names, compat: bool) {
    let tools = within(LIMIT, "tools/list", client.list_all_tools())
        .await
        .expect("tools/list");
    let listed: Vec<&str> = tools.iter().map(|t| t.name.as_ref()).collect();
    let mut unique = listed.clone();
    unique.sort_unstable();
    unique.dedup();
    assert_eq!(
        unique.len(),
        listed.len(),
        "duplicate tool names: {listed:?}"
    );
    for name in &listed {
        let ok =
            |c: char| c.is_ascii_alphanumeric() || c == '_' || c == '-' || (!compat && c == '.');
        assert!(
            !name.is_empty() && name.len() <= 64 && name.chars().all(ok),
            "tool name {name:?} breaks the {} grammar",
            if compat { "compat" } else { "canonical" }
        );
    }
    if compat {
        assert!(
            listed.iter().all(|n| !n.contains('.')),
            "compat names must have no dots: {listed:?}"
        );
        assert!(
            !listed.contains(&"system.info"),
            "canonical name leaked: {listed:?}"
        );
    } else {
        assert!(
            !listed.contains(&"system_info"),
            "compat name in canonical mode: {listed:?}"
        );
    }

    for ro in [names.info, names.health] {
        let t = find(&tools, ro);
        assert!(
            t.description.as_deref().is_some_and(|d| !d.is_empty()),
            "{ro} needs a description"
        );
        assert_eq!(
            t.annotations.as_ref().and_then(|a| a.read_only_hint),
            Some(true),
            "{ro} must be annotated read-only"
        );
        assert_eq!(
            t.input_schema.get("type"),
            Some(&Value::from("object")),
            "{ro} schema"
        );
    }
    let submit = find(&tools, names.submit);
    let schema = Value::Object((*submit.input_schema).clone());
    assert_eq!(schema["type"], "object", "{}: {schema}", names.submit);
    assert_eq!(schema["properties"]["prompt"]["type"], "string", "{schema}");
    assert!(
        schema["required"]
            .as_array()
            .is_some_and(|r| r.contains(&Value::from("prompt"))),
        "prompt must be required: {schema}"
    );
    assert_eq!(schema["additionalProperties"], false, "{schema}");

    let result = within(
        LIMIT,
        "tools/call system.info",
        client.call_tool(CallToolRequestParams::new(names.info).with_arguments(JsonObject::new())),
    )
    .await
    .expect("tools/call system.info");
    assert_ne!(
        result.is_error,
        Some(true),
        "system.info failed: {result:?}"
    );
    let sc = result
        .structured_content
        .as_ref()
        .unwrap_or_else(|| panic!("system.info returned no structured content: {result:?}"));
    let hostname = sc["hostname"].as_str().unwrap_or_default();
    assert!(!hostname.is_empty(), "system.info hostname: {sc}");
    let real = nix::unistd::gethostname().expect("gethostname");
    assert_eq!(
        hostname,
        real.to_string_lossy(),
        "system.info hostname is the host's"
    );
    assert!(
        sc["daemon_version"].as_str().is_some_and(|v| !v.is_empty()),
        "system.info daemon_version: {sc}"
    );
}

async fn stdio_run(lifecycle: Lifecycle) {
    let dir = tempfile::tempdir().expect("tempdir");
    let stderr = std::fs::File::create(dir.path().join("stdio.stderr")).expect("stderr file");
    let mut cmd = tokio::process::Command::new(mcpd_bin());
    cmd.arg("--stdio")
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .current_dir(dir.path());
    let (transport, _) = TokioChildProcess::builder(cmd)
        .stderr(Stdio::from(stderr))
        .spawn()
        .expect("spawn robota-mcpd --stdio");
    let client = lifecycle.connect(transport).await;
    exercise(&client, &CANONICAL, false).await;
    let _ = within(LIMIT, "client close", client.cancel()).await;
}

fn http_transport(
    d: &Daemon,
    bearer: Option<&str>,
) -> StreamableHttpClientTransport<reqwest::Client> {
    let mut config =
        StreamableHttpClientTransportConfig::with_uri(format!("http://{}/mcp", d.loopback_addr()));
    if let Some(b) = bearer {
        config = config.auth_header(b);
    }
    // No proxy from the environment: the carrier is on this host's loopback.
    let http = reqwest::Client::builder()
        .no_proxy()
        .timeout(LIMIT)
        .build()
        .expect("reqwest client");
    StreamableHttpClientTransport::with_client(http, config)
}

async fn loopback_run(lifecycle: Lifecycle, compat: bool) {
    let d = if compat {
        Daemon::builder()
            .loopback("wire_names = \"compat\"")
            .start()
    } else {
        Daemon::start("")
    };
    let bearer = d.bearer();
    let client = lifecycle.connect(http_transport(&d, Some(&bearer))).await;
    exercise(&client, if compat { &COMPAT } else { &CANONICAL }, compat).await;
    let _ = within(LIMIT, "client close", client.cancel()).await;
    let st = d.status();
    let lo = st
        .carriers
        .iter()
        .find(|c| c.name == "loopback")
        .expect("loopback");
    assert!(
        lo.admitted.is_some_and(|n| n >= 2),
        "admitted counter after a session: {lo:?}"
    );
    d.assert_no_secrets();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stdio_initialize_2025_11_25_lists_and_calls_system_info() {
    stdio_run(Lifecycle::Initialize).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stdio_discover_2026_07_28_lists_and_calls_system_info() {
    stdio_run(Lifecycle::Discover).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loopback_initialize_2025_11_25_lists_and_calls_system_info() {
    loopback_run(Lifecycle::Initialize, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loopback_discover_2026_07_28_lists_and_calls_system_info() {
    loopback_run(Lifecycle::Discover, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loopback_compat_wire_names_have_no_dots_initialize() {
    loopback_run(Lifecycle::Initialize, true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loopback_compat_wire_names_have_no_dots_discover() {
    loopback_run(Lifecycle::Discover, true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loopback_rmcp_client_without_or_with_wrong_bearer_cannot_start() {
    let d = Daemon::start("");
    let real = d.bearer();
    for bearer in [None, Some("0".repeat(64))] {
        for lifecycle in [Lifecycle::Initialize, Lifecycle::Discover] {
            let (config, mode) = lifecycle.client_config();
            let started = within(
                LIMIT,
                "unauthenticated lifecycle start",
                config.serve_with_lifecycle(http_transport(&d, bearer.as_deref()), mode),
            )
            .await;
            assert!(
                started.is_err(),
                "{lifecycle:?} with bearer {:?} must not start a session",
                bearer.as_ref().map(|_| "<wrong>")
            );
        }
    }
    let st = d.status();
    let lo = st
        .carriers
        .iter()
        .find(|c| c.name == "loopback")
        .expect("loopback");
    assert!(
        lo.refused.is_some_and(|n| n >= 4),
        "four refused starts must be counted: {lo:?}"
    );
    assert_ne!(real, "0".repeat(64));
    d.assert_no_secrets();
}

/// One path answers every request shape: a `ping`, a `tools/list` and a `tools/call`
/// answer alike bare and with an empty cursor, `_meta` or an `Origin`, ids are echoed as
/// sent, and what the SDK refuses (media types, a request carrying a result) is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_variants_answer_alike() {
    use robota_e2e::http::{Request, exchange};
    use serde_json::json;

    let d = Daemon::start("");
    let port = d.loopback_port();
    let bearer = d.bearer();
    let ask = |message: Value| Request::mcp(port, Some(&bearer), &message);
    let answer = |resp: robota_e2e::http::Response, case: &str| -> Value {
        assert_eq!(resp.status, 200, "{case}: {}", resp.describe());
        assert_eq!(
            resp.header("content-type"),
            Some("application/json"),
            "{case}"
        );
        serde_json::from_slice(&resp.body).unwrap_or_else(|e| panic!("{case}: {e}"))
    };
    let addr = d.loopback_addr();

    // The listing, asked twice, with an explicit `cursor: null` and with an `Origin`.
    let direct = json!({"jsonrpc": "2.0", "id": "list-1", "method": "tools/list"});
    let first = answer(
        exchange(addr, &ask(direct.clone())).await,
        "bare tools/list",
    );
    let again = answer(exchange(addr, &ask(direct)).await, "bare tools/list again");
    assert_eq!(first, again);
    let via_sdk = json!({"jsonrpc": "2.0", "id": "list-1", "method": "tools/list", "params": {"cursor": null}});
    let sdk = answer(
        exchange(addr, &ask(via_sdk)).await,
        "tools/list with a cursor",
    );
    assert_eq!(first, sdk, "a null cursor lists the same");
    assert!(
        first["result"]["tools"]
            .as_array()
            .is_some_and(|t| t.len() > 5),
        "{first}"
    );
    let with_origin =
        ask(json!({"jsonrpc": "2.0", "id": "list-1", "method": "tools/list", "params": {}}))
            .header("Origin", &format!("http://127.0.0.1:{port}"));
    assert_eq!(
        first,
        answer(exchange(addr, &with_origin).await, "with Origin")
    );

    // ping: `{}` for the request's own id, with `_meta` or without.
    for (case, message) in [
        (
            "bare ping",
            json!({"jsonrpc": "2.0", "id": 7, "method": "ping"}),
        ),
        (
            "ping with _meta",
            json!({"jsonrpc": "2.0", "id": 7, "method": "ping", "params": {"_meta": {}}}),
        ),
    ] {
        let v = answer(exchange(addr, &ask(message)).await, case);
        assert_eq!(
            v,
            json!({"jsonrpc": "2.0", "id": 7, "result": {}}),
            "{case}"
        );
    }
    let escaped = json!({"jsonrpc": "2.0", "id": "a\"b\\c\u{1}", "method": "ping"});
    let v = answer(
        exchange(addr, &ask(escaped)).await,
        "an id that needs escapes",
    );
    assert_eq!(v["id"], "a\"b\\c\u{1}");

    // tools/call with and without an empty `_meta`: deterministic answers compared whole.
    for (case, params) in [
        (
            "an unknown tool",
            json!({"name": "no.such.tool", "arguments": {}}),
        ),
        (
            "invalid arguments",
            json!({"name": "system.info", "arguments": {"x": 1}}),
        ),
        (
            "a job that is not there",
            json!({"name": "job.status", "arguments": {"job_id": 424242}}),
        ),
        (
            "no grants yet",
            json!({"name": "permissions.list_root_access"}),
        ),
    ] {
        let plain = json!({"jsonrpc": "2.0", "id": 9, "method": "tools/call", "params": params});
        let mut meta = plain.clone();
        meta["params"]["_meta"] = json!({});
        let direct = answer(exchange(addr, &ask(plain)).await, case);
        let sdk = answer(exchange(addr, &ask(meta)).await, case);
        assert_eq!(direct, sdk, "{case}");
        assert!(
            direct["result"].get("resultType").is_none(),
            "{case}: {direct}"
        );
    }
    let info = json!({"jsonrpc": "2.0", "id": "i", "method": "tools/call", "params": {"name": "system.info", "arguments": {}}});
    let v = answer(exchange(addr, &ask(info)).await, "system.info");
    assert_eq!(v["id"], "i");
    assert_eq!(v["result"]["isError"], false, "{v}");
    assert!(
        v["result"]["structuredContent"]["hostname"].is_string(),
        "{v}"
    );

    // What Streamable HTTP refuses is refused.
    let refused = [
        ("no event-stream", "Accept", "application/json", 406),
        (
            "zero-weighted json",
            "Accept",
            "application/json;q=0, text/event-stream",
            406,
        ),
        ("a text body", "Content-Type", "text/plain", 415),
    ];
    for (case, name, value, status) in refused {
        let req = ask(json!({"jsonrpc": "2.0", "id": 1, "method": "ping"})).set_header(name, value);
        let resp = exchange(addr, &req).await;
        assert_eq!(resp.status, status, "{case}: {}", resp.describe());
    }
    // A request that also carries a `result` or an `error` is refused, and
    // nothing runs: the write root would hold the file if the call had run.
    for extra in [json!({"result": {}}), json!({"error": null})] {
        for method in ["ping", "tools/list"] {
            let mut message = json!({"jsonrpc": "2.0", "id": 3, "method": method});
            message
                .as_object_mut()
                .unwrap()
                .extend(extra.as_object().unwrap().clone());
            let mut with_origin = message.clone();
            with_origin["params"] = json!({"_meta": {}});
            let direct = exchange(addr, &ask(message)).await;
            let sdk = exchange(addr, &ask(with_origin)).await;
            assert_eq!(direct.status, sdk.status, "{method} with {extra}");
            assert_ne!(
                direct.status,
                200,
                "{method} with {extra}: {}",
                direct.describe()
            );
        }
    }
    let calls = || {
        robota_e2e::metric_sum(
            &d.metrics_text().unwrap_or_default(),
            &["robota_mcpd_tool_calls_total"],
        )
    };
    let before = calls();
    let hybrid = json!({"jsonrpc": "2.0", "id": 4, "result": {}, "method": "tools/call", "params": {"name": "system.info", "arguments": {}}});
    assert_ne!(exchange(addr, &ask(hybrid)).await.status, 200);
    assert_eq!(calls(), before, "no call ran");

    // A quoted parameter that only looks like a list entry is not one.
    let quoted = ask(json!({"jsonrpc": "2.0", "id": 1, "method": "ping"})).set_header(
        "Accept",
        "text/x;p=\"a, application/json, text/event-stream\"",
    );
    assert_eq!(exchange(addr, &quoted).await.status, 406);
}
