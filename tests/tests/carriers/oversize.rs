//! Oversized everything: request heads, request bodies (HTTP/1.1 and h2c), tool arguments,
//! tool results and control frames each get their documented answer — 431, 413,
//! `invalid_arguments`, `result_too_large` (never a truncated result), `too-large` and a
//! closed connection — the daemon keeps serving, and its memory stays bounded while it
//! refuses hundreds of them.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use base64::Engine as _;
use robota_e2e::http::{
    Conn, Request, Response, exchange, tool_error_code, tools_call, tools_list,
};
use robota_e2e::{Daemon, h2, metric_sum, poll_until, within};
use serde_json::{Value, json};

const QUICK: Duration = Duration::from_secs(5);

const ALLOW_SUBMIT: &str = r#"
[[policy]]
callers = ["bearer:*"]
tools = ["agent_submit", "file.write"]
decision = "allow"
"#;

/// A turn backend that answers with its prompt, byte for byte.
const ECHO_TURN: &str = "[session.turn]\nargv = [\"/bin/cat\"]\ntimeout = \"30s\"\n";

/// `tools/list` padded with trailing whitespace to exactly `len` bytes.
fn padded_tools_list(id: i64, len: usize) -> Vec<u8> {
    let mut body = serde_json::to_vec(&tools_list(id)).expect("json");
    assert!(body.len() <= len);
    body.resize(len, b' ');
    body
}

/// `req` with one more `X-Pad` header sized so that the head is exactly `total` bytes.
fn head_of_exactly(req: &Request, total: usize) -> Request {
    let bare = req.clone().header("X-Pad", "").head_bytes().len();
    assert!(total >= bare, "a head of {total} bytes cannot hold {bare}");
    let padded = req.clone().header("X-Pad", &"a".repeat(total - bare));
    assert_eq!(padded.head_bytes().len(), total);
    padded
}

/// Reads what is left on `conn` and checks the daemon closed it (bounded).
async fn assert_closed(conn: &mut Conn, case: &str) {
    let rest = within(
        QUICK,
        &format!("{case}: the daemon must close the connection"),
        conn.read_to_close(),
    )
    .await;
    assert!(
        rest.is_empty(),
        "{case}: bytes after the refusal: {:?}",
        String::from_utf8_lossy(&rest)
    );
}

fn assert_served(resp: &Response, id: i64, case: &str) {
    assert_eq!(resp.status, 200, "{case}: {}", resp.describe());
    assert!(
        resp.expect_rpc(id).get("result").is_some(),
        "{case}: {}",
        resp.describe()
    );
}

use robota_e2e::h2::{H2Conn, TestBody};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_heads_over_max_header_bytes_get_431_and_the_connection_closes() {
    // The default (16 KiB) and a configured limit: a head of exactly the limit is served,
    // one byte more is 431 with an empty body, and the connection is closed.
    for (line, limit) in [
        (None, 16 * 1024),
        (Some("max_header_bytes = \"32KiB\""), 32 * 1024),
    ] {
        let mut builder = Daemon::builder();
        if let Some(line) = line {
            builder = builder.loopback(line);
        }
        let d = builder.start();
        let addr = d.loopback_addr();
        let bearer = d.bearer();
        let good = Request::mcp(addr.port(), Some(&bearer), &tools_list(1));
        let case = format!("max_header_bytes {limit}");

        assert_served(
            &exchange(addr, &head_of_exactly(&good, limit)).await,
            1,
            &format!("{case}: a head of exactly the limit"),
        );
        let over = head_of_exactly(&good, limit + 1);
        let mut conn = Conn::connect(addr).await.expect("connect");
        conn.write(&over.to_bytes()).await.expect("write");
        let resp = within(QUICK, &case, conn.read_response())
            .await
            .unwrap_or_else(|e| panic!("{case}: no answer to a head one byte over: {e}"));
        resp.assert_empty_refusal(431, &format!("{case}: a head one byte over"));
        assert_eq!(
            resp.header("connection").map(str::trim),
            Some("close"),
            "{case}: {}",
            resp.describe()
        );
        assert_closed(&mut conn, &format!("{case}: after 431")).await;

        // A header that never ends (256 KiB sent, no line end) is answered once the limit
        // is read, without waiting for the rest.
        let mut conn = Conn::connect(addr).await.expect("connect");
        let mut head = format!(
            "POST /mcp HTTP/1.1\r\nHost: 127.0.0.1:{}\r\nX-Huge: ",
            addr.port()
        )
        .into_bytes();
        head.resize(256 * 1024, b'h');
        // The daemon may answer and close before it has read all of it.
        let _ = conn.write(&head).await;
        let resp = within(QUICK, &case, conn.read_response())
            .await
            .unwrap_or_else(|e| panic!("{case}: no answer to an endless header: {e}"));
        resp.assert_empty_refusal(431, &format!("{case}: an endless header"));
        assert_closed(&mut conn, &format!("{case}: after an endless header")).await;

        // The daemon keeps serving.
        assert_served(
            &exchange(addr, &good).await,
            1,
            &format!("{case}: after 431s"),
        );
        d.assert_no_secrets();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn header_counts_and_http2_header_lists_over_the_limit_get_431() {
    let d = Daemon::start("");
    let addr = d.loopback_addr();
    let bearer = d.bearer();
    let good = Request::mcp(addr.port(), Some(&bearer), &tools_list(1));
    let with_headers = |total: usize| {
        // `good` carries 7 headers once Content-Length is added.
        let mut r = good.clone();
        for i in 0..total - 7 {
            r = r.header(&format!("X-H{i}"), "v");
        }
        r
    };
    // The carrier's header count cap is 64 (`carrier::http::MAX_HEADERS`), well under
    // the byte limit here.
    assert_served(&exchange(addr, &with_headers(64)).await, 1, "64 headers");
    for total in [65, 1000] {
        let req = with_headers(total);
        assert!(
            req.head_bytes().len() < 16 * 1024,
            "the count, not the bytes"
        );
        let resp = exchange(addr, &req).await;
        resp.assert_empty_refusal(431, &format!("{total} headers"));
    }

    // HTTP/2: the header list is bounded by the same 16 KiB (RFC 9113 sizes: name +
    // value + 32 per field). One big field, or many small ones: 431 on that stream, and
    // the connection keeps serving other streams.
    let mut h2 = H2Conn::connect(addr).await;
    let body = || TestBody::full(serde_json::to_vec(&tools_list(2)).expect("json"));
    let (status, _) = h2
        .post(Some(&bearer), &[("x-pad", "a".repeat(8 * 1024))], body())
        .await
        .expect("h2 with an 8 KiB header");
    assert_eq!(status, 200, "h2 with an 8 KiB header list");
    let (status, resp) = h2
        .post(Some(&bearer), &[("x-pad", "a".repeat(20 * 1024))], body())
        .await
        .expect("h2 with a 20 KiB header");
    assert_eq!(status, 431, "h2 with a 20 KiB header");
    assert!(resp.is_empty(), "431 carries no body");
    let names: Vec<String> = (0..600).map(|i| format!("x-h{i}")).collect();
    let many: Vec<(&str, String)> = names.iter().map(|n| (n.as_str(), "v".into())).collect();
    let (status, _) = h2
        .post(Some(&bearer), &many, body())
        .await
        .expect("h2 with 600 headers");
    assert_eq!(status, 431, "h2 with 600 headers (a 22 KiB header list)");
    let (status, resp) = h2
        .post(Some(&bearer), &[], body())
        .await
        .expect("h2 after two 431s");
    assert_eq!(status, 200, "the h2 connection keeps serving after 431s");
    assert!(
        robota_e2e::http::messages_of(false, &resp)
            .iter()
            .any(|m| m["id"] == 2),
        "{}",
        String::from_utf8_lossy(&resp)
    );
    d.assert_no_secrets();
}

/// Found by an outside attack: a header block sent as CONTINUATION frames that never end
/// was ended by HTTP/2 itself (GOAWAY) and counted nowhere. It is a connection ended for a
/// flood now (no request exists to refuse).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http2_header_block_that_never_ends_is_counted_as_a_flood() {
    let d = Daemon::start("");
    let addr = d.loopback_addr();
    let floods = || {
        metric_sum(
            &d.metrics_text().expect("metrics"),
            &[
                "robota_mcpd_connections_total",
                "listener=\"loopback\"",
                "outcome=\"flood\"",
            ],
        )
    };
    assert_eq!(floods(), 0.0);
    // Literal header fields without indexing (RFC 7541 §6.2.2), 108 bytes each: ten to a
    // frame, so the list stays far under the byte cap and only the frames' count is over.
    let field = {
        let mut f = vec![0x00, 5];
        f.extend_from_slice(b"x-pad");
        f.push(100);
        f.extend_from_slice(&[b'a'; 100]);
        f
    };
    let block = field.repeat(10);
    let mut conn = Conn::connect(addr).await.expect("connect");
    let mut bytes = h2::PREFACE.to_vec();
    bytes.extend(h2::frame(0x4, 0, 0, &[])); // SETTINGS
    bytes.extend(h2::frame(0x1, 0x1, 1, &block)); // HEADERS, END_STREAM, no END_HEADERS
    for _ in 0..40 {
        bytes.extend(h2::frame(0x9, 0, 1, &block)); // CONTINUATION, no END_HEADERS
    }
    // The daemon may close before it has read everything sent.
    let _ = conn.write(&bytes).await;
    let answer = within(
        QUICK,
        "the daemon must end the connection",
        conn.read_to_close(),
    )
    .await;
    // Among the frames it sent, a GOAWAY (type 7) with ENHANCE_YOUR_CALM (0xb).
    let mut frames = Vec::new();
    let mut rest = &answer[..];
    while rest.len() >= 9 {
        let len = usize::from(rest[0]) << 16 | usize::from(rest[1]) << 8 | usize::from(rest[2]);
        let Some(payload) = rest.get(9..9 + len) else {
            break;
        };
        frames.push((rest[3], payload.to_vec()));
        rest = &rest[9 + len..];
    }
    assert!(
        frames
            .iter()
            .any(|(kind, p)| *kind == 0x7 && p.get(4..8) == Some(&[0, 0, 0, 0xb][..])),
        "no GOAWAY with ENHANCE_YOUR_CALM among the frames {:?}",
        frames.iter().map(|(kind, _)| kind).collect::<Vec<_>>()
    );
    assert!(
        poll_until(QUICK, Duration::from_millis(50), || floods() == 1.0).await,
        "connections ended for a flood: {}",
        floods()
    );
    // The listener goes on serving.
    let resp = exchange(
        addr,
        &Request::mcp(addr.port(), Some(&d.bearer()), &tools_list(3)),
    )
    .await;
    assert_served(&resp, 3, "after the flood");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_bodies_over_the_limit_get_413_on_http1_and_http2() {
    const LIMIT: usize = 64 * 1024;
    let d = Daemon::start("[limits]\nrequest_body = \"64KiB\"\n");
    let addr = d.loopback_addr();
    let port = addr.port();
    let bearer = d.bearer();
    let base = || Request::mcp(port, Some(&bearer), &json!(null));

    // HTTP/1.1, declared: absurd lengths are answered from the head, and the connection
    // is closed since the body was never read.
    for length in ["1000000000000", "9223372036854775808"] {
        let req = base().set_header("Content-Length", length).no_auto_length();
        let mut conn = Conn::connect(addr).await.expect("connect");
        conn.write(&req.head_bytes()).await.expect("write head");
        let resp = within(QUICK, length, conn.read_head())
            .await
            .unwrap_or_else(|e| panic!("Content-Length {length}: {e}"));
        assert_eq!(
            resp.status,
            413,
            "Content-Length {length}: {}",
            resp.describe()
        );
        assert_eq!(resp.content_length(), Some(0), "{}", resp.describe());
        assert_closed(&mut conn, &format!("Content-Length {length}")).await;
    }
    // Lengths hyper itself refuses (from 2^64 - 2, its length markers, it answers 431;
    // past u64 or not a number, 400): refused by the HTTP layer, never served.
    for length in [
        "18446744073709551614",
        "18446744073709551615",
        "18446744073709551616",
        "1e9",
    ] {
        let req = base().set_header("Content-Length", length).no_auto_length();
        let mut conn = Conn::connect(addr).await.expect("connect");
        conn.write(&req.head_bytes()).await.expect("write head");
        let resp = within(QUICK, length, conn.read_head())
            .await
            .unwrap_or_else(|e| panic!("Content-Length {length}: {e}"));
        assert!(
            [400, 413, 431].contains(&resp.status),
            "Content-Length {length}: {}",
            resp.describe()
        );
        assert_closed(&mut conn, &format!("Content-Length {length}")).await;
    }

    // HTTP/1.1, chunked: a chunk that announces far more than the limit is counted by
    // what arrives — 413 once the limit is passed, not when the chunk size is read.
    let mut conn = Conn::connect(addr).await.expect("connect");
    let req = base()
        .no_auto_length()
        .header("Transfer-Encoding", "chunked");
    let mut bytes = req.head_bytes();
    bytes.extend_from_slice(b"fffffffffff\r\n");
    bytes.extend_from_slice(&vec![b' '; LIMIT + 1]);
    let _ = conn.write(&bytes).await;
    let resp = within(QUICK, "a huge chunk", conn.read_response())
        .await
        .expect("answer to a huge chunk");
    resp.assert_empty_refusal(413, "a chunk announcing 64 GiB");
    assert_closed(&mut conn, "after a huge chunk").await;

    // HTTP/2 on one connection: the edges, streamed without a length and declared.
    let mut h2 = H2Conn::connect(addr).await;
    let (status, body) = h2
        .post(
            Some(&bearer),
            &[],
            TestBody::full(padded_tools_list(3, LIMIT)),
        )
        .await
        .expect("h2 body at the limit");
    assert_eq!(status, 200, "h2 body of exactly the limit");
    assert!(!body.is_empty());
    let (status, body) = h2
        .post(
            Some(&bearer),
            &[],
            TestBody::streamed(padded_tools_list(4, LIMIT)),
        )
        .await
        .expect("h2 streamed at the limit");
    assert_eq!(
        status, 200,
        "h2 streamed without a length, exactly the limit"
    );
    assert!(!body.is_empty());
    let (status, body) = h2
        .post(
            Some(&bearer),
            &[],
            TestBody::streamed(padded_tools_list(4, LIMIT + 1)),
        )
        .await
        .expect("h2 streamed one byte over");
    assert_eq!(status, 413, "h2 streamed without a length, one byte over");
    assert!(body.is_empty());
    let (status, _) = h2
        .post(Some(&bearer), &[], TestBody::spaces(16 * 1024 * 1024))
        .await
        .expect("h2 streamed 16 MiB");
    assert_eq!(status, 413, "h2 streamed 16 MiB without a length");
    for length in [LIMIT + 1, 1 << 40] {
        // The body never comes: the answer is from the head alone.
        let (status, _) = h2
            .post(
                Some(&bearer),
                &[("content-length", length.to_string())],
                TestBody::Never,
            )
            .await
            .unwrap_or_else(|e| panic!("h2 declaring {length}: {e}"));
        assert_eq!(status, 413, "h2 declaring {length} bytes");
    }
    // A refused request streaming a big body is answered from its head too.
    let (status, _) = h2
        .post(None, &[], TestBody::spaces(2 * 1024 * 1024))
        .await
        .expect("h2 refused with a 2 MiB body");
    assert_eq!(status, 401, "h2 without a bearer, 2 MiB body");
    let (status, body) = h2
        .post(
            Some(&bearer),
            &[],
            TestBody::full(serde_json::to_vec(&tools_list(5)).expect("json")),
        )
        .await
        .expect("h2 after the 413s");
    assert_eq!(status, 200, "the h2 connection keeps serving after 413s");
    assert!(
        robota_e2e::http::messages_of(false, &body)
            .iter()
            .any(|m| m["id"] == 5)
    );
    assert_served(
        &exchange(addr, &Request::mcp(port, Some(&bearer), &tools_list(6))).await,
        6,
        "HTTP/1.1 after the 413s",
    );
    d.assert_no_secrets();
}

/// `tools/call` over raw HTTP; the whole response, which must be a 200 with JSON-RPC id.
async fn call_raw(d: &Daemon, bearer: &str, id: i64, tool: &str, args: Value) -> (Response, Value) {
    let addr = d.loopback_addr();
    let resp = within(
        Duration::from_secs(30),
        "tools/call",
        exchange(
            addr,
            &Request::mcp(addr.port(), Some(bearer), &tools_call(id, tool, args)),
        ),
    )
    .await;
    assert_eq!(resp.status, 200, "tools/call: {}", short(&resp.body_text()));
    let rpc = resp
        .rpc(id)
        .unwrap_or_else(|| panic!("no JSON-RPC response {id}: {}", short(&resp.body_text())));
    (resp, rpc)
}

fn short(s: &str) -> String {
    s.chars().take(600).collect()
}

fn result_text(rpc: &Value) -> String {
    rpc.pointer("/result/content")
        .and_then(Value::as_array)
        .map(|c| {
            c.iter()
                .filter_map(|b| b.get("text").and_then(Value::as_str))
                .collect()
        })
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn huge_tool_arguments_under_the_body_limit_get_their_visible_answers() {
    const HUGE: usize = 900 * 1024;
    let root = tempfile::tempdir().expect("tempdir");
    let rw = root.path().join("rw");
    std::fs::create_dir(&rw).expect("mkdir");
    let d = Daemon::builder()
        .extra(ECHO_TURN)
        .extra(ALLOW_SUBMIT)
        .extra(format!(
            "[tools.file]\nwrite_roots = [\"{}\"]\nmax_write = \"512KiB\"\n",
            rw.display()
        ))
        .start();
    let bearer = d.bearer();
    let huge = "p".repeat(HUGE);

    // The body limit (1 MiB) is the only bound on a prompt: 900 KiB reaches the backend
    // and comes back whole.
    let (_, rpc) = call_raw(&d, &bearer, 1, "agent_submit", json!({"prompt": huge})).await;
    assert_eq!(tool_error_code(&rpc), None, "{}", short(&rpc.to_string()));
    let text = result_text(&rpc);
    assert_eq!(text.len(), HUGE, "the echoed prompt must come back whole");
    assert!(text == huge, "the echoed prompt differs");

    // Over `[tools.file] max_write`: invalid_arguments naming the limit, nothing written.
    let target = rw.join("big.txt");
    let path = target.display().to_string();
    let encoded = base64::engine::general_purpose::STANDARD.encode(vec![7u8; 600 * 1024]);
    assert!(encoded.len() < 1024 * 1024 - 4096, "fits in the body");
    for (case, args) in [
        ("text", json!({"path": path, "content": huge})),
        (
            "base64",
            json!({"path": path, "content": encoded, "encoding": "base64"}),
        ),
    ] {
        let (resp, rpc) = call_raw(&d, &bearer, 2, "file.write", args).await;
        assert_eq!(
            tool_error_code(&rpc).as_deref(),
            Some("invalid_arguments"),
            "file.write of a {case} content over max_write: {}",
            short(&rpc.to_string())
        );
        let message = rpc
            .pointer("/result/structuredContent/message")
            .and_then(Value::as_str)
            .unwrap_or_default();
        assert!(
            message.contains("max_write") && message.contains(&(512 * 1024).to_string()),
            "{case}: {message}"
        );
        assert!(
            resp.body.len() < 4096,
            "{case}: the error does not echo the content"
        );
        assert!(!target.exists(), "{case}: nothing may be written");
    }

    // Unexpected huge arguments: invalid_arguments, and the answer does not carry them.
    for (tool, args) in [
        ("system.info", json!({"junk": huge})),
        ("agent_submit", json!({"prompt": "x", "extra": huge})),
        ("agent_submit", json!({"prompt": 5, "extra": huge})),
    ] {
        let (resp, rpc) = call_raw(&d, &bearer, 3, tool, args).await;
        assert_eq!(
            tool_error_code(&rpc).as_deref(),
            Some("invalid_arguments"),
            "{tool}: {}",
            short(&rpc.to_string())
        );
        assert!(
            resp.body.len() < 4096,
            "{tool}: the error must not echo a 900 KiB argument ({} bytes)",
            resp.body.len()
        );
    }

    // A 900 KiB tool name is an unknown tool.
    let (_, rpc) = call_raw(&d, &bearer, 4, &huge, json!({})).await;
    assert_eq!(
        tool_error_code(&rpc).as_deref(),
        Some("unknown_tool"),
        "{}",
        short(&rpc.to_string())
    );

    // Still serving, and nothing of the above reached the log.
    let (_, rpc) = call_raw(&d, &bearer, 5, "system.info", json!({})).await;
    assert_eq!(tool_error_code(&rpc), None, "{rpc}");
    assert!(
        !d.stderr_text().contains(&"p".repeat(1024)),
        "a huge argument reached the daemon's log"
    );
    d.assert_no_secrets();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn results_over_tool_result_are_result_too_large_never_truncated() {
    const LIMIT: usize = 512 * 1024;
    let root = tempfile::tempdir().expect("tempdir");
    let ro = root.path().join("ro");
    std::fs::create_dir(&ro).expect("mkdir");
    std::fs::write(ro.join("big.txt"), "f".repeat(600 * 1024)).expect("seed");
    let d = Daemon::builder()
        .extra(ECHO_TURN)
        .extra(ALLOW_SUBMIT)
        .extra(format!(
            "[tools.file]\nread_roots = [\"{}\"]\n\n[limits]\ntool_result = \"512KiB\"\n",
            ro.display()
        ))
        .start();
    let bearer = d.bearer();

    // The limit applies to what goes on the wire: the tool result as serialized. A turn
    // output that fits with its envelope is returned whole; one that fits only without
    // it is result_too_large, and that answer holds none of the output.
    let fits = "q".repeat(LIMIT - 100);
    let (resp, rpc) = call_raw(&d, &bearer, 1, "agent_submit", json!({"prompt": fits})).await;
    assert_eq!(tool_error_code(&rpc), None, "{}", short(&rpc.to_string()));
    assert_eq!(
        result_text(&rpc),
        fits,
        "a result within the limit is whole"
    );
    let on_wire = serde_json::to_vec(&rpc["result"]).expect("result").len();
    assert!(on_wire <= LIMIT, "{on_wire} bytes of result on the wire");
    assert!(resp.body.len() <= LIMIT + 100, "{} bytes", resp.body.len());
    for len in [LIMIT - 20, LIMIT + 1, 900 * 1024] {
        let (resp, rpc) = call_raw(
            &d,
            &bearer,
            2,
            "agent_submit",
            json!({"prompt": "q".repeat(len)}),
        )
        .await;
        assert_eq!(
            tool_error_code(&rpc).as_deref(),
            Some("result_too_large"),
            "a turn output of {len} bytes: {}",
            short(&rpc.to_string())
        );
        assert!(
            resp.body.len() < 4096 && !resp.body_text().contains("qqqqqqqq"),
            "result_too_large must carry no part of the result: {}",
            short(&resp.body_text())
        );
    }
    // The turn slot is free again.
    let (_, rpc) = call_raw(&d, &bearer, 3, "agent_submit", json!({"prompt": "small"})).await;
    assert_eq!(result_text(&rpc), "small", "{rpc}");

    // file.read of a file under max_read (4 MiB) whose answer is over tool_result.
    let path = ro.join("big.txt").display().to_string();
    let (resp, rpc) = call_raw(&d, &bearer, 4, "file.read", json!({"path": path})).await;
    assert_eq!(
        tool_error_code(&rpc).as_deref(),
        Some("result_too_large"),
        "file.read of 600 KiB with a 512 KiB result limit: {}",
        short(&rpc.to_string())
    );
    assert!(
        resp.body.len() < 4096 && !resp.body_text().contains("ffffffff"),
        "{}",
        short(&resp.body_text())
    );
    let (_, rpc) = call_raw(
        &d,
        &bearer,
        5,
        "file.read",
        json!({"path": path, "length": 64 * 1024}),
    )
    .await;
    assert_eq!(tool_error_code(&rpc), None, "{}", short(&rpc.to_string()));
    let content = rpc
        .pointer("/result/structuredContent/content")
        .and_then(Value::as_str)
        .unwrap_or_default();
    assert_eq!(content.len(), 64 * 1024, "a read within the limit is whole");
    // A structured result goes on the wire twice (structuredContent and its text copy):
    // 300 KiB read is over a 512 KiB limit there, though its payload alone is not.
    let (resp, rpc) = call_raw(
        &d,
        &bearer,
        6,
        "file.read",
        json!({"path": path, "length": 300 * 1024}),
    )
    .await;
    assert_eq!(
        tool_error_code(&rpc).as_deref(),
        Some("result_too_large"),
        "a 300 KiB structured result doubled on the wire: {}",
        short(&rpc.to_string())
    );
    assert!(resp.body.len() < 4096);

    // Counted by outcome.
    let metrics = d.metrics_text().expect("metrics");
    for (tool, n) in [("agent_submit", 3.0), ("file.read", 2.0)] {
        assert_eq!(
            metric_sum(
                &metrics,
                &[
                    "robota_mcpd_tool_calls_total",
                    &format!("tool=\"{tool}\""),
                    "outcome=\"result_too_large\""
                ]
            ),
            n,
            "{tool} result_too_large calls"
        );
    }
    d.assert_no_secrets();
}

/// A control connection with bounded reads and writes.
fn control_conn(d: &Daemon) -> UnixStream {
    let s = UnixStream::connect(d.socket_path()).expect("connect the control socket");
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    s.set_write_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    s
}

/// Reads one reply frame as JSON.
fn read_frame(reader: &mut BufReader<UnixStream>, case: &str) -> Value {
    let mut line = String::new();
    reader
        .read_line(&mut line)
        .unwrap_or_else(|e| panic!("{case}: no reply frame: {e}"));
    serde_json::from_str(line.trim_end())
        .unwrap_or_else(|e| panic!("{case}: reply is not one JSON frame ({e}): {line:?}"))
}

/// The documented `too-large` frame, then the end of the connection.
fn assert_too_large_then_closed(reader: &mut BufReader<UnixStream>, case: &str) {
    let frame = read_frame(reader, case);
    assert_eq!(frame["v"], 1, "{case}: {frame}");
    assert_eq!(frame["error"]["code"], "too-large", "{case}: {frame}");
    assert!(frame["error"]["message"].is_string(), "{case}: {frame}");
    let mut rest = Vec::new();
    match reader.read_to_end(&mut rest) {
        Ok(_) => assert!(
            rest.is_empty(),
            "{case}: bytes after too-large: {:?}",
            String::from_utf8_lossy(&rest)
        ),
        Err(e) => assert_eq!(
            e.kind(),
            std::io::ErrorKind::ConnectionReset,
            "{case}: the connection must be closed, not left open: {e}"
        ),
    }
}

#[test]
fn control_requests_over_64_kib_get_too_large_and_the_connection_closes() {
    use robota_proto::MAX_REQUEST_BYTES;
    let d = Daemon::start("");

    // A served request, then an oversized one on the same connection.
    let mut s = control_conn(&d);
    let mut bytes = b"{\"v\":1,\"cmd\":\"status\"}\n".to_vec();
    let mut big = br#"{"v":1,"cmd":"status","pad":""#.to_vec();
    big.resize(MAX_REQUEST_BYTES + 4096, b'x');
    big.extend_from_slice(b"\"}\n");
    bytes.extend_from_slice(&big);
    let _ = s.write_all(&bytes);
    let mut reader = BufReader::new(s);
    let first = read_frame(&mut reader, "status before the big frame");
    assert_eq!(first["ok"]["kind"], "status", "{first}");
    assert_too_large_then_closed(&mut reader, "a 68 KiB frame after a served one");

    // A line that never ends: the daemon answers once it has read 64 KiB and closes, so
    // the client cannot write its 4 MiB.
    let s = control_conn(&d);
    let mut writer = s.try_clone().expect("clone");
    let endless = std::thread::spawn(move || writer.write_all(&vec![b' '; 4 * 1024 * 1024]));
    let mut reader = BufReader::new(s);
    assert_too_large_then_closed(&mut reader, "a line that never ends");
    let written = endless.join().expect("writer thread");
    let err = written.expect_err("the daemon read a 4 MiB line instead of cutting it off");
    assert!(
        matches!(
            err.kind(),
            std::io::ErrorKind::BrokenPipe | std::io::ErrorKind::ConnectionReset
        ),
        "the writer must see the connection closed, got {err}"
    );

    // Clients holding half a line do not keep others out.
    let mut held = Vec::new();
    for _ in 0..16 {
        let mut s = control_conn(&d);
        s.write_all(&[b' '; 1024]).expect("write half a line");
        held.push(s);
    }
    let started = Instant::now();
    let st = d.status();
    assert_eq!(st.state, "serving");
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "status took {:?} while 16 clients held half a line",
        started.elapsed()
    );
    let mut s = control_conn(&d);
    s.write_all(b"{\"v\":1,\"cmd\":\"status\"}\n")
        .expect("write");
    let reply = read_frame(&mut BufReader::new(s), "raw status beside held connections");
    assert_eq!(reply["ok"]["kind"], "status", "{reply}");
    drop(held);
    d.ctl_ok(&["status"]);
}

/// Sends one oversized HTTP/1.1 request whole (write errors ignored: the daemon may answer
/// and close first) and reads the answer.
async fn oversize_one(addr: std::net::SocketAddr, req: Request) -> Result<u16, String> {
    let mut conn = Conn::connect(addr).await.map_err(|e| e.to_string())?;
    let _ = conn.write(&req.to_bytes()).await;
    within(QUICK * 2, "oversize answer", conn.read_response())
        .await
        .map(|r| r.status)
        .map_err(|e| e.to_string())
}

/// One round of every oversized request kind; returns the statuses seen, by kind.
async fn oversize_round(
    d: &Daemon,
    bearer: &str,
    n: usize,
    statuses: &mut std::collections::BTreeMap<String, u64>,
) {
    let addr = d.loopback_addr();
    let port = addr.port();
    let two_mib = vec![b' '; 2 * 1024 * 1024];
    let mut chunked = Vec::new();
    for c in two_mib.chunks(64 * 1024) {
        chunked.extend_from_slice(format!("{:x}\r\n", c.len()).as_bytes());
        chunked.extend_from_slice(c);
        chunked.extend_from_slice(b"\r\n");
    }
    chunked.extend_from_slice(b"0\r\n\r\n");
    let base = Request::mcp(port, Some(bearer), &json!(null));
    let kinds = [
        (
            "h1 content-length 2 MiB",
            base.clone().body(two_mib.clone()),
        ),
        (
            "h1 chunked 2 MiB",
            base.clone()
                .no_auto_length()
                .header("Transfer-Encoding", "chunked")
                .body(chunked),
        ),
        (
            "h1 20 KiB header",
            base.clone().header("X-Pad", &"a".repeat(20 * 1024)),
        ),
    ];
    for (kind, req) in &kinds {
        for _ in 0..n {
            let got = oversize_one(addr, req.clone()).await;
            *statuses.entry(format!("{kind}: {got:?}")).or_default() += 1;
        }
    }
    // Bodies the daemon refused keep arriving for a while after its reset; each frame of a
    // reset stream HTTP/2 no longer remembers costs a reset of its own, and past 1024 the
    // stack ends the connection with GOAWAY ENHANCE_YOUR_CALM (its guard against reset
    // floods). A client then does what any does on GOAWAY: a new connection, the request
    // again. How often that happens is bounded and counted.
    let mut h2 = H2Conn::connect(addr).await;
    for i in 0..n {
        let (kind, headers) = if i % 2 == 0 {
            ("h2 streamed 2 MiB", vec![])
        } else {
            (
                "h2 content-length 2 MiB",
                vec![("content-length", (2 * 1024 * 1024).to_string())],
            )
        };
        let mut got = h2
            .post(Some(bearer), &headers, TestBody::spaces(2 * 1024 * 1024))
            .await
            .map(|r| r.0);
        // The request's error can arrive just before the connection's driver ends.
        if got.is_err() && poll_until(QUICK, Duration::from_millis(20), || h2.is_closed()).await {
            *statuses.entry("h2 goaway".to_owned()).or_default() += 1;
            h2 = H2Conn::connect(addr).await;
            got = h2
                .post(Some(bearer), &headers, TestBody::spaces(2 * 1024 * 1024))
                .await
                .map(|r| r.0);
        }
        *statuses.entry(format!("{kind}: {got:?}")).or_default() += 1;
    }
    // Control frames over 64 KiB.
    let socket = d.socket_path().to_path_buf();
    let control = tokio::task::spawn_blocking(move || {
        let mut seen = Vec::new();
        for _ in 0..n {
            let mut s = UnixStream::connect(&socket).expect("connect");
            s.set_read_timeout(Some(Duration::from_secs(10)))
                .expect("timeout");
            s.set_write_timeout(Some(Duration::from_secs(10)))
                .expect("timeout");
            let _ = s.write_all(&vec![b' '; 128 * 1024]);
            let mut line = String::new();
            let _ = BufReader::new(s).read_line(&mut line);
            let v: Value = serde_json::from_str(line.trim_end()).unwrap_or(Value::Null);
            seen.push(v["error"]["code"].as_str().unwrap_or("no frame").to_owned());
        }
        seen
    });
    for code in within(Duration::from_secs(30), "control frames", control)
        .await
        .expect("control task")
    {
        *statuses
            .entry(format!("control 128 KiB: {code}"))
            .or_default() += 1;
    }
    // Concurrent: 16 HTTP/1.1 chunked and 16 HTTP/2 streams at once, over 4 in-flight
    // slots: each is 413, or 503 when no slot was free.
    let mut tasks = Vec::new();
    for _ in 0..16 {
        let req = kinds[1].1.clone();
        tasks.push(tokio::spawn(async move {
            (
                "concurrent h1",
                oversize_one(addr, req).await.map_err(|_| ()),
            )
        }));
    }
    let bearer = bearer.to_owned();
    for _ in 0..2 {
        let bearer = bearer.clone();
        tasks.push(tokio::spawn(async move {
            let mut h2 = H2Conn::connect(addr).await;
            let mut last = Ok(0);
            for _ in 0..8 {
                let got = h2
                    .post(Some(&bearer), &[], TestBody::spaces(2 * 1024 * 1024))
                    .await
                    .map(|r| r.0)
                    .map_err(|_| ());
                if got != Ok(413) && got != Ok(503) {
                    last = got;
                    break;
                }
                last = got;
            }
            ("concurrent h2", last)
        }));
    }
    for t in tasks {
        let (kind, got) = within(Duration::from_secs(30), "concurrent oversize", t)
            .await
            .expect("task");
        let got = match got {
            Ok(413 | 503) => "413 or 503".to_owned(),
            other => format!("{other:?}"),
        };
        *statuses.entry(format!("{kind}: {got}")).or_default() += 1;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_stays_bounded_while_refusing_oversized_requests() {
    const N: usize = 200;
    let d = Daemon::builder().loopback("max_in_flight = 4").start();
    let bearer = d.bearer();
    let started = Instant::now();

    // Warm up (allocator arenas, worker threads, connection buffers), then measure.
    let mut warm = std::collections::BTreeMap::new();
    oversize_round(&d, &bearer, 10, &mut warm).await;
    let before = robota_e2e::procs::rss_kib(d.pid());
    let mut statuses = std::collections::BTreeMap::new();
    oversize_round(&d, &bearer, N, &mut statuses).await;
    let after = robota_e2e::procs::rss_kib(d.pid());
    eprintln!(
        "RSS {before} KiB -> {after} KiB after {N} of each oversized kind in {:?}: {statuses:?}",
        started.elapsed()
    );
    // At most one reconnection per 1024 frames of refused bodies, and a refused body
    // leaves at most one window (1 MiB, 64 frames) in flight: 100 refused streamed bodies
    // and 100 refused declared ones cannot cost more than a dozen.
    let goaways = statuses.remove("h2 goaway").unwrap_or(0);
    assert!(
        goaways <= 12,
        "{goaways} HTTP/2 connections ended by GOAWAY"
    );

    let expected: std::collections::BTreeMap<String, u64> = [
        ("h1 content-length 2 MiB: Ok(413)", N as u64),
        ("h1 chunked 2 MiB: Ok(413)", N as u64),
        ("h1 20 KiB header: Ok(431)", N as u64),
        ("h2 streamed 2 MiB: Ok(413)", N as u64 / 2),
        ("h2 content-length 2 MiB: Ok(413)", N as u64 / 2),
        ("control 128 KiB: too-large", N as u64),
        ("concurrent h1: 413 or 503", 16),
        ("concurrent h2: 413 or 503", 2),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v))
    .collect();
    assert_eq!(
        statuses, expected,
        "every oversized request gets its answer"
    );
    // 200 rejected 2 MiB bodies kept alive would be hundreds of MiB.
    let growth = after.saturating_sub(before);
    assert!(
        growth < 32 * 1024,
        "RSS grew by {growth} KiB ({before} -> {after}) while refusing oversized requests"
    );

    // Still serving on every plane.
    let addr = d.loopback_addr();
    assert_served(
        &exchange(
            addr,
            &Request::mcp(addr.port(), Some(&bearer), &tools_list(9)),
        )
        .await,
        9,
        "after the oversize storm",
    );
    d.ctl_ok(&["status"]);
    assert!(
        !d.stderr_text().contains("panicked"),
        "the daemon panicked: {}",
        d.stderr_text()
    );
    d.assert_no_secrets();
}
