//! Loopback carrier admission with raw HTTP/1.1 (bytes written by hand) and HTTP/2 prior
//! knowledge: path, Host/`:authority`, absolute-form targets, Origin, bearer, method,
//! protocol version, body limits, in-flight bound, head bounds — and the status counters.

use std::time::Duration;

use robota_e2e::http::{
    Conn, Request, Response, exchange, h2_exchange, tool_names, tools_call, tools_list,
    try_exchange,
};
use robota_e2e::{Daemon, metric_sum, poll_until, poll_until_async, procs, within};
use serde_json::json;

const QUICK: Duration = Duration::from_secs(5);

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

fn assert_bare_bearer_challenge(resp: &Response, case: &str) {
    resp.assert_empty_refusal(401, case);
    assert_eq!(
        resp.header("www-authenticate").map(str::trim),
        Some("Bearer"),
        "{case}: the challenge must be a bare `Bearer`: {}",
        resp.describe()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn host_origin_path_and_bearer_refusals_are_empty_and_counted() {
    let d = Daemon::start("");
    let addr = d.loopback_addr();
    let port = addr.port();
    let other = if port == 65535 { port - 1 } else { port + 1 };
    let bearer = d.bearer();
    let good = || Request::mcp(port, Some(&bearer), &tools_list(1));

    // Positive controls: the same requests, correct, are served.
    assert_catalog_served(&exchange(addr, &good()).await, 1, "valid request");
    assert_catalog_served(
        &exchange(
            addr,
            &good().header("Origin", &format!("http://127.0.0.1:{port}")),
        )
        .await,
        1,
        "valid request with the loopback Origin",
    );
    assert_catalog_served(
        &exchange(
            addr,
            &good().target(&format!("http://127.0.0.1:{port}/mcp")),
        )
        .await,
        1,
        "absolute-form target agreeing with Host",
    );

    // Wrong path → 403, before the bearer is looked at.
    for path in ["/", "/mcpx", "/mcp/", "/other/mcp", "/MCP"] {
        exchange(addr, &good().target(path))
            .await
            .assert_empty_refusal(403, &format!("path {path}"));
    }
    exchange(addr, &good().target("/").without("Authorization"))
        .await
        .assert_empty_refusal(403, "wrong path without a bearer is 403, not 401");

    // Host → 403 even with a valid bearer.
    let hosts = [
        format!("127.0.0.1.evil.com:{port}"),
        "localhost.".to_owned(),
        format!("localhost:{port}"),
        format!("127.0.0.1:{other}"),
        format!("[::1]:{port}"),
        "127.0.0.1".to_owned(),
        format!("evil.com:{port}"),
    ];
    let mut wrong_host = 0u64;
    for host in &hosts {
        exchange(addr, &good().set_header("Host", host))
            .await
            .assert_empty_refusal(403, &format!("Host {host}"));
        wrong_host += 1;
    }
    exchange(addr, &good().without("Host"))
        .await
        .assert_empty_refusal(403, "missing Host");
    wrong_host += 1;
    exchange(
        addr,
        &good()
            .set_header("Host", &format!("127.0.0.1.evil.com:{port}"))
            .without("Authorization"),
    )
    .await
    .assert_empty_refusal(403, "wrong Host without a bearer is 403, not 401");
    wrong_host += 1;
    exchange(addr, &good().target(&format!("http://evil.com:{port}/mcp")))
        .await
        .assert_empty_refusal(403, "absolute-form target disagreeing with Host");
    wrong_host += 1;

    // Origin → 403.
    let origins = [
        "null".to_owned(),
        "http://evil.com".to_owned(),
        format!("http://127.0.0.1:{other}"),
        format!("http://localhost:{port}"),
        format!("https://127.0.0.1:{port}"),
        format!("http://127.0.0.1.evil.com:{port}"),
    ];
    let mut wrong_origin = 0u64;
    for origin in &origins {
        exchange(addr, &good().header("Origin", origin))
            .await
            .assert_empty_refusal(403, &format!("Origin {origin}"));
        wrong_origin += 1;
    }
    exchange(
        addr,
        &good().header("Origin", "null").without("Authorization"),
    )
    .await
    .assert_empty_refusal(403, "Origin null without a bearer is 403, not 401");
    wrong_origin += 1;

    // Bearer → 401 with a bare challenge.
    let wrong_bearers = [
        "0".repeat(64),
        bearer[..63].to_owned(),
        format!("{bearer}0"),
        bearer.to_uppercase(),
    ];
    let mut bad_bearer = 0u64;
    assert_bare_bearer_challenge(
        &exchange(addr, &good().without("Authorization")).await,
        "missing bearer",
    );
    for wrong in &wrong_bearers {
        assert_bare_bearer_challenge(
            &exchange(
                addr,
                &good().set_header("Authorization", &format!("Bearer {wrong}")),
            )
            .await,
            "wrong bearer",
        );
        bad_bearer += 1;
    }
    assert_bare_bearer_challenge(
        &exchange(
            addr,
            &good().set_header("Authorization", &format!("Basic {bearer}")),
        )
        .await,
        "Basic scheme carrying the bearer",
    );

    // A refused request declaring a huge body is answered from its head alone.
    for (case, req, status) in [
        ("401 before body", good().without("Authorization"), 401),
        (
            "403 before body",
            good().set_header("Host", "evil.com"),
            403,
        ),
    ] {
        let req = req
            .set_header("Content-Length", "10000000")
            .no_auto_length();
        let mut conn = Conn::connect(addr).await.expect("connect");
        conn.write(&req.head_bytes()).await.expect("write head");
        let resp = within(QUICK, case, conn.read_head()).await.expect(case);
        assert_eq!(resp.status, status, "{case}: {}", resp.describe());
        assert_eq!(
            resp.content_length(),
            Some(0),
            "{case}: {}",
            resp.describe()
        );
    }

    // The refusals show up in `status`.
    let st = d.status();
    let lo = st
        .carriers
        .iter()
        .find(|c| c.name == "loopback")
        .expect("loopback carrier");
    let by = |reason: &str| st.refusals_last_hour.get(reason).copied().unwrap_or(0);
    assert!(
        by("wrong-host") >= wrong_host,
        "wrong-host refusals {} < {wrong_host}: {:?}",
        by("wrong-host"),
        st.refusals_last_hour
    );
    assert!(
        by("wrong-origin") >= wrong_origin,
        "wrong-origin refusals {} < {wrong_origin}: {:?}",
        by("wrong-origin"),
        st.refusals_last_hour
    );
    assert!(
        by("bad-bearer") >= bad_bearer,
        "bad-bearer refusals {} < {bad_bearer}: {:?}",
        by("bad-bearer"),
        st.refusals_last_hour
    );
    assert!(
        by("bad-bearer") + by("missing-token") + by("malformed") >= bad_bearer + 3,
        "missing/malformed bearer refusals not counted: {:?}",
        st.refusals_last_hour
    );
    let counted = wrong_host + wrong_origin + bad_bearer + 3;
    let (admitted, refused) = (lo.admitted.unwrap_or(0), lo.refused.unwrap_or(0));
    assert!(
        refused >= counted,
        "loopback refused counter {refused} < {counted}"
    );
    assert!(admitted >= 3, "loopback admitted counter {admitted} < 3");
    let metrics = st.carriers.iter().find(|c| c.name == "metrics");
    assert!(
        metrics.is_none_or(|m| m.admitted.is_none() && m.refused.is_none()),
        "the metrics listener has no admission to count: {metrics:?}"
    );

    // And in the metrics, by carrier and reason.
    let metrics = d.metrics_text().expect("metrics answer");
    for (reason, n) in [
        ("wrong-host", wrong_host),
        ("wrong-origin", wrong_origin),
        ("bad-bearer", bad_bearer),
    ] {
        let got = metric_sum(
            &metrics,
            &["carrier=\"loopback\"", &format!("reason=\"{reason}\"")],
        );
        assert!(
            got >= n as f64,
            "metrics count {got} {reason} refusals on loopback, expected >= {n}"
        );
    }
    d.assert_no_secrets();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http2_prior_knowledge_checks_authority_and_serves() {
    let d = Daemon::start("");
    let addr = d.loopback_addr();
    let port = addr.port();
    let bearer = d.bearer();
    for authority in [
        format!("evil.com:{port}"),
        format!("localhost:{port}"),
        format!("127.0.0.1:{}", port.wrapping_add(1)),
    ] {
        let resp = h2_exchange(addr, &authority, Some(&bearer), &tools_list(1))
            .await
            .unwrap_or_else(|e| panic!("h2 :authority {authority}: {e}"));
        assert_eq!(
            resp.status,
            403,
            ":authority {authority}: {}",
            resp.describe()
        );
        assert!(
            resp.body.is_empty(),
            ":authority {authority}: body must be empty"
        );
        assert!(
            resp.content_length().is_none_or(|n| n == 0),
            ":authority {authority}: {}",
            resp.describe()
        );
    }
    let good = format!("127.0.0.1:{port}");
    let resp = h2_exchange(addr, &good, None, &tools_list(1))
        .await
        .expect("h2 without bearer");
    assert_eq!(resp.status, 401, "h2 without bearer: {}", resp.describe());
    assert_eq!(
        resp.header("www-authenticate").map(str::trim),
        Some("Bearer")
    );
    let resp = h2_exchange(addr, &good, Some(&bearer), &tools_list(2))
        .await
        .expect("h2 with bearer");
    assert_catalog_served(&resp, 2, "h2 with the right :authority and bearer");
    d.assert_no_secrets();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn get_and_delete_get_405_with_allow_post() {
    let d = Daemon::start("");
    let addr = d.loopback_addr();
    let port = addr.port();
    let bearer = d.bearer();
    for method in ["GET", "DELETE", "PUT"] {
        let req = Request::new(method, "/mcp")
            .header("Host", &format!("127.0.0.1:{port}"))
            .header("Accept", "application/json, text/event-stream")
            .header("Authorization", &format!("Bearer {bearer}"))
            .header("Connection", "close");
        let resp = exchange(addr, &req).await;
        resp.assert_empty_refusal(405, method);
        assert_eq!(
            resp.header("allow").map(str::trim),
            Some("POST"),
            "{method}: {}",
            resp.describe()
        );
        // Admission comes first: without a bearer the same request is 401.
        assert_bare_bearer_challenge(
            &exchange(addr, &req.clone().without("Authorization")).await,
            &format!("{method} without a bearer"),
        );
    }
    d.assert_no_secrets();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unsupported_protocol_version_header_is_400() {
    let d = Daemon::start("");
    let addr = d.loopback_addr();
    let bearer = d.bearer();
    let mut answers = Vec::new();
    for version in ["2025-06-18", "2025-03-26", "2024-11-05", "banana"] {
        let req = Request::mcp(addr.port(), Some(&bearer), &tools_list(1))
            .set_header("MCP-Protocol-Version", version);
        let resp = exchange(addr, &req).await;
        assert_eq!(
            resp.status,
            400,
            "MCP-Protocol-Version {version}: {}",
            resp.describe()
        );
        answers.push((version, resp));
    }
    assert_catalog_served(
        &exchange(
            addr,
            &Request::mcp(addr.port(), Some(&bearer), &tools_list(3)),
        )
        .await,
        3,
        "MCP-Protocol-Version 2025-11-25",
    );
    // Not an admission refusal but a protocol error, so it carries rmcp's JSON-RPC
    // shape (code -32022, as rmcp answers an unsupported version) and names what we serve.
    for (version, resp) in answers {
        let body: serde_json::Value = serde_json::from_slice(&resp.body)
            .unwrap_or_else(|e| panic!("MCP-Protocol-Version {version}: body is not JSON: {e}"));
        assert_eq!(body["jsonrpc"], "2.0", "{version}: {body}");
        assert_eq!(body["error"]["code"], -32022, "{version}: {body}");
        assert_eq!(
            body["error"]["data"]["supported"],
            serde_json::json!(["2025-11-25", "2026-07-28"]),
            "{version}: {body}"
        );
    }
    d.assert_no_secrets();
}

/// `tools/list` padded with trailing whitespace to exactly `len` bytes.
fn padded_tools_list(id: i64, len: usize) -> Vec<u8> {
    let mut body = serde_json::to_vec(&tools_list(id)).expect("json");
    assert!(body.len() <= len);
    body.resize(len, b' ');
    body
}

fn chunked(body: &[u8], chunk: usize) -> Vec<u8> {
    let mut out = Vec::new();
    for c in body.chunks(chunk) {
        out.extend_from_slice(format!("{:x}\r\n", c.len()).as_bytes());
        out.extend_from_slice(c);
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"0\r\n\r\n");
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_body_limit_edges() {
    const LIMIT: usize = 4096;
    let d = Daemon::start("[limits]\nrequest_body = \"4KiB\"\n");
    let addr = d.loopback_addr();
    let port = addr.port();
    let bearer = d.bearer();
    let base = || Request::mcp(port, Some(&bearer), &json!(null));

    // Exactly at the limit: served.
    let at = base().body(padded_tools_list(1, LIMIT));
    assert_catalog_served(&exchange(addr, &at).await, 1, "Content-Length at the limit");

    // One byte over, declared: 413 from the head alone, before any body byte is sent.
    let over = base().body(padded_tools_list(2, LIMIT + 1));
    let mut conn = Conn::connect(addr).await.expect("connect");
    conn.write(&over.head_bytes()).await.expect("write head");
    let resp = within(QUICK, "413 before the body", conn.read_head())
        .await
        .expect("413 head");
    assert_eq!(
        resp.status,
        413,
        "declared one byte over: {}",
        resp.describe()
    );
    assert_eq!(resp.content_length(), Some(0), "{}", resp.describe());
    drop(conn);

    // One byte over, sent whole: 413.
    exchange(addr, &over)
        .await
        .assert_empty_refusal(413, "Content-Length one byte over the limit");

    // Chunked exactly at the limit: served; chunked over it: 413 while streaming.
    let chunked_at = base()
        .without("Content-Length")
        .no_auto_length()
        .header("Transfer-Encoding", "chunked")
        .body(chunked(&padded_tools_list(3, LIMIT), 1000));
    assert_catalog_served(
        &exchange(addr, &chunked_at).await,
        3,
        "chunked body at the limit",
    );
    let chunked_over = base()
        .no_auto_length()
        .header("Transfer-Encoding", "chunked")
        .body(chunked(&padded_tools_list(4, 2 * LIMIT), 1000));
    let mut conn = Conn::connect(addr).await.expect("connect");
    conn.write(&chunked_over.head_bytes())
        .await
        .expect("write head");
    // The server may answer and close while the body is still being written.
    let _ = conn.write(&chunked_over.body).await;
    let resp = within(QUICK, "chunked 413", conn.read_response())
        .await
        .expect("chunked over-limit response");
    resp.assert_empty_refusal(413, "chunked body over the limit");
    d.assert_no_secrets();
}

fn slow_turn_config(extra_loopback: &str) -> robota_e2e::DaemonBuilder {
    Daemon::builder().loopback(extra_loopback).extra(
        r#"[session.turn]
argv = ["/bin/sh", "-c", "echo $$ > @DIR@/turn.pid.tmp && mv @DIR@/turn.pid.tmp @DIR@/turn.pid; exec sleep 30"]
timeout = "10m"

[[policy]]
callers = ["bearer:*"]
tools = ["agent_submit"]
decision = "allow"
"#,
    )
}

/// Whether `bearer`'s `tools/list` is answered `status` within 10 s, asked again every
/// 50 ms.
async fn comes_to(addr: std::net::SocketAddr, bearer: &str, status: u16) -> bool {
    poll_until_async(
        Duration::from_secs(10),
        Duration::from_millis(50),
        || async {
            let request = Request::mcp(addr.port(), Some(bearer), &tools_list(9));
            try_exchange(addr, &request)
                .await
                .is_ok_and(|r| r.status == status)
        },
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_in_flight_overflow_gets_503_with_retry_after() {
    let d = slow_turn_config("max_in_flight = 1").start();
    let addr = d.loopback_addr();
    let port = addr.port();
    let bearer = d.bearer();

    // One slow admitted request holds the only slot.
    let slow = Request::mcp(
        port,
        Some(&bearer),
        &tools_call(7, "agent_submit", json!({"prompt": "hold"})),
    );
    let mut slow_conn = Conn::connect(addr).await.expect("connect");
    slow_conn
        .write(&slow.to_bytes())
        .await
        .expect("write slow request");
    let pid_file = d.dir().join("turn.pid");
    let turn = procs::wait_pid_file(&pid_file, Duration::from_secs(15))
        .await
        .expect("the turn never started (no turn.pid)");

    let resp = exchange(addr, &Request::mcp(port, Some(&bearer), &tools_list(8))).await;
    assert_eq!(resp.status, 503, "{}", resp.describe());
    assert!(
        String::from_utf8_lossy(&resp.body).contains("(max_in_flight)"),
        "the 503 does not say which limit: {}",
        resp.describe()
    );
    let retry = resp
        .header("retry-after")
        .unwrap_or_else(|| panic!("503 without Retry-After: {}", resp.describe()));
    assert!(
        retry.trim().parse::<u64>().is_ok_and(|s| s >= 1),
        "Retry-After must be delta-seconds >= 1, got {retry:?}"
    );

    // A client disconnect cancels the slow request: the slot frees and the turn dies.
    drop(slow_conn);
    let ended = poll_until(Duration::from_secs(10), Duration::from_millis(20), || {
        !procs::alive(turn)
    })
    .await;
    assert!(
        ended,
        "disconnecting the client did not end its turn (pid {turn} alive)"
    );
    let served = comes_to(addr, &bearer, 200).await;
    assert!(
        served,
        "the in-flight slot never freed after the client disconnected"
    );
    d.assert_no_secrets();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_stalling_its_bodies_holds_only_its_share_of_the_slots() {
    let d = Daemon::builder()
        .loopback("max_in_flight = 4")
        .loopback("max_in_flight_per_caller = 2")
        .start();
    let addr = d.loopback_addr();
    let port = addr.port();
    let greedy = d.bearer_labeled("greedy");
    let host = d.bearer();

    // The greedy caller sends two heads and never the whole of their bodies, each
    // admitted (and so holding its slot) before anything else is sent.
    let admitted = || {
        metric_sum(
            &d.metrics_text().expect("metrics answer"),
            &[
                "robota_mcpd_admitted_requests_total",
                "carrier=\"loopback\"",
            ],
        )
    };
    let mut stalled = Vec::new();
    for id in 1..=2 {
        let before = admitted();
        let req = Request::mcp(port, Some(&greedy), &tools_list(id));
        let mut conn = Conn::connect(addr).await.expect("connect");
        conn.write(&req.head_bytes()).await.expect("write head");
        conn.write(&req.body[..5])
            .await
            .expect("write some of the body");
        stalled.push(conn);
        let seen = poll_until(Duration::from_secs(10), Duration::from_millis(20), || {
            admitted() > before
        })
        .await;
        assert!(seen, "stalled request {id} was never admitted");
    }
    // Its third request waits for nothing: 503, and the text says why.
    let third = comes_to(addr, &greedy, 503).await;
    assert!(third, "a caller holding its share (2) got a third slot");
    let resp = exchange(addr, &Request::mcp(port, Some(&greedy), &tools_list(4))).await;
    assert_eq!(resp.status, 503, "{}", resp.describe());
    assert!(
        resp.header("retry-after").is_some(),
        "503 without Retry-After: {}",
        resp.describe()
    );
    let text = String::from_utf8_lossy(&resp.body);
    assert!(
        text.contains("max_in_flight_per_caller"),
        "the refusal does not say why: {text:?}"
    );
    // Everyone else still has the other slots.
    for id in 5..=7 {
        let resp = exchange(addr, &Request::mcp(port, Some(&host), &tools_list(id))).await;
        assert_eq!(
            resp.status,
            200,
            "another caller was refused: {}",
            resp.describe()
        );
    }
    let metrics = d.metrics_text().expect("metrics answer");
    let counted = metric_sum(
        &metrics,
        &[
            "robota_mcpd_http_rejections_total",
            "listener=\"loopback\"",
            "cause=\"caller-busy\"",
        ],
    );
    assert!(
        counted >= 2.0,
        "caller-busy refusals counted {counted}, expected >= 2"
    );
    // The stalled bodies give their slots back at the body deadline or when they go.
    drop(stalled);
    let freed = comes_to(addr, &greedy, 200).await;
    assert!(
        freed,
        "the greedy caller's slots never came back after it went"
    );
    d.assert_no_secrets();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_request_head_is_not_served() {
    let d = Daemon::start("");
    let addr = d.loopback_addr();
    let bearer = d.bearer();
    let req = Request::mcp(addr.port(), Some(&bearer), &tools_list(1))
        .header("X-Pad", &"a".repeat(20 * 1024));
    match try_exchange(addr, &req).await {
        Ok(resp) => {
            assert!(
                resp.status == 431 || resp.status == 400,
                "a 20 KiB header must be refused (431), got {}",
                resp.describe()
            );
        }
        Err(e) => assert!(
            e.kind() != std::io::ErrorKind::TimedOut,
            "a 20 KiB header was neither answered nor cut off: {e}"
        ),
    }
    d.assert_no_secrets();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_request_head_is_cut_off() {
    let d = Daemon::builder()
        .loopback("header_timeout = \"1s\"")
        .start();
    let addr = d.loopback_addr();
    let mut conn = Conn::connect(addr).await.expect("connect");
    conn.write(format!("POST /mcp HTTP/1.1\r\nHost: 127.0.0.1:{}\r\n", addr.port()).as_bytes())
        .await
        .expect("write partial head");
    let rest = within(
        Duration::from_secs(8),
        "the daemon must close a connection whose head never completes",
        conn.read_to_close(),
    )
    .await;
    let text = String::from_utf8_lossy(&rest);
    assert!(
        rest.is_empty() || text.starts_with("HTTP/1.1 408"),
        "unexpected answer to an incomplete head: {text:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn initialize_is_stateless_and_advertises_only_tools() {
    let d = Daemon::start("");
    let addr = d.loopback_addr();
    let bearer = d.bearer();
    let init = json!({
        "jsonrpc": "2.0",
        "id": 1,
        "method": "initialize",
        "params": {
            "protocolVersion": "2025-11-25",
            "capabilities": {},
            "clientInfo": {"name": "robota-e2e", "version": "0"}
        }
    });
    let resp = exchange(
        addr,
        &Request::mcp(addr.port(), Some(&bearer), &init).without("MCP-Protocol-Version"),
    )
    .await;
    assert_eq!(resp.status, 200, "initialize: {}", resp.describe());
    assert!(
        resp.header("mcp-session-id").is_none(),
        "stateless carriers issue no Mcp-Session-Id: {}",
        resp.describe()
    );
    let rpc = resp.expect_rpc(1);
    assert_eq!(rpc["result"]["protocolVersion"], "2025-11-25", "{rpc}");
    let caps = &rpc["result"]["capabilities"];
    assert!(caps.get("tools").is_some(), "tools capability: {rpc}");
    assert!(caps.get("resources").is_none(), "no resources: {rpc}");
    assert!(caps.get("prompts").is_none(), "no prompts: {rpc}");
    // No session: the next request stands alone.
    let resp = exchange(
        addr,
        &Request::mcp(addr.port(), Some(&bearer), &tools_list(2)),
    )
    .await;
    assert_catalog_served(&resp, 2, "tools/list without a session");
    assert!(
        resp.header("mcp-session-id").is_none(),
        "{}",
        resp.describe()
    );
    d.assert_no_secrets();
}
