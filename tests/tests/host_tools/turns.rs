//! Turn submission over the loopback carrier: results, visible tool errors, policy, busy,
//! per-caller cancellation across requests, time limits and process-group cleanup.

use std::time::{Duration, Instant};

use robota_e2e::http::{Conn, Request, Response, cancelled, exchange, tool_error_code, tools_call};
use robota_e2e::{Daemon, DaemonBuilder, poll_until, procs, within};
use serde_json::{Value, json};

const ALLOW_SUBMIT: &str = r#"
[[policy]]
callers = ["bearer:*"]
tools = ["agent_submit"]
decision = "allow"
"#;

/// A turn script that records its pid and a background child's pid, then waits.
const SLOW_TURN: &str = r#"
[session.turn]
argv = ["/bin/sh", "-c", "sleep 30 & echo $! > @DIR@/turn-child.pid; echo $$ > @DIR@/turn.pid.tmp && mv @DIR@/turn.pid.tmp @DIR@/turn.pid; wait"]
timeout = "10m"
"#;

fn turn_config(turn: &str, extra: &str) -> DaemonBuilder {
    Daemon::builder().extra(turn).extra(extra)
}

/// Calls a tool over raw HTTP as `bearer`; returns the JSON-RPC response with `id`.
async fn call(d: &Daemon, bearer: &str, id: i64, tool: &str, args: Value) -> Value {
    let addr = d.loopback_addr();
    let resp = exchange(
        addr,
        &Request::mcp(addr.port(), Some(bearer), &tools_call(id, tool, args)),
    )
    .await;
    assert_eq!(resp.status, 200, "tools/call {tool}: {}", resp.describe());
    resp.expect_rpc(id)
}

fn result_text(rpc: &Value) -> String {
    rpc.pointer("/result/content")
        .and_then(Value::as_array)
        .map(|c| {
            c.iter()
                .filter_map(|b| b.get("text").and_then(Value::as_str))
                .collect::<String>()
        })
        .unwrap_or_default()
}

/// Waits until no live process is left in `pgid` and `pids` are gone.
async fn assert_gone(pgid: i32, pids: &[i32], case: &str) {
    let gone = poll_until(Duration::from_secs(10), Duration::from_millis(20), || {
        procs::group_members(pgid).is_empty() && pids.iter().all(|p| !procs::alive(*p))
    })
    .await;
    assert!(
        gone,
        "{case}: turn processes still alive after 10 s: group {pgid} = {:?}",
        procs::group_members(pgid)
    );
}

/// Reads the turn's pids once the script has started, and checks it has its own group.
async fn turn_pids(d: &Daemon) -> (i32, i32, i32) {
    let turn = procs::wait_pid_file(&d.dir().join("turn.pid"), Duration::from_secs(15))
        .await
        .expect("the turn never started (no turn.pid)");
    let child = procs::read_pid_file(&d.dir().join("turn-child.pid")).expect("turn-child.pid");
    let pgid = procs::pgid(turn).expect("turn pgid");
    let daemon_pgid = procs::pgid(d.pid()).expect("daemon pgid");
    assert_ne!(
        pgid, daemon_pgid,
        "the turn must run in its own process group"
    );
    assert_eq!(
        procs::pgid(child),
        Some(pgid),
        "the turn's child shares its group"
    );
    (turn, child, pgid)
}

/// Starts a submission on its own connection; the task yields the whole response.
fn spawn_submission(
    d: &Daemon,
    bearer: &str,
    id: i64,
) -> tokio::task::JoinHandle<std::io::Result<Response>> {
    let addr = d.loopback_addr();
    let req = Request::mcp(
        addr.port(),
        Some(bearer),
        &tools_call(id, "agent_submit", json!({"prompt": "long work"})),
    );
    tokio::spawn(async move {
        let mut conn = Conn::connect(addr).await?;
        conn.write(&req.to_bytes()).await?;
        match tokio::time::timeout(Duration::from_secs(120), conn.read_response()).await {
            Ok(r) => r,
            Err(_) => Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "submission hung",
            )),
        }
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn busy_and_cancellation_are_per_caller() {
    let d = turn_config(SLOW_TURN, ALLOW_SUBMIT).start();
    let addr = d.loopback_addr();
    let port = addr.port();
    let a = d.bearer();
    let b = d.bearer_labeled("b");

    // Caller A (bearer:default) starts a turn with JSON-RPC id 7.
    let a_call = spawn_submission(&d, &a, 7);
    let (turn, child, pgid) = turn_pids(&d).await;
    assert!(
        poll_until(Duration::from_secs(5), Duration::from_millis(20), || {
            d_status_active(&d)
        })
        .await,
        "status.active_turn stays false while a turn runs"
    );

    // Caller B submits too: `busy`, promptly.
    let started = Instant::now();
    let rpc = within(
        Duration::from_secs(5),
        "B's submission must be answered promptly",
        call(&d, &b, 1, "agent_submit", json!({"prompt": "me too"})),
    )
    .await;
    assert_eq!(
        tool_error_code(&rpc).as_deref(),
        Some("busy"),
        "B while A's turn runs: {rpc}"
    );
    assert!(started.elapsed() < Duration::from_secs(5));

    // B cancels request id 7: that is A's id, not B's request, so nothing happens.
    let resp = exchange(addr, &Request::mcp(port, Some(&b), &cancelled(7))).await;
    assert_eq!(
        resp.status,
        202,
        "B's cancellation POST: {}",
        resp.describe()
    );
    // The endpoint handles a cancellation before it answers 202, and counts what it found:
    // B's found nothing of B's in flight, so nothing was cancelled.
    let cancellations = |outcome: &str| {
        let text = d.metrics_text().expect("metrics");
        robota_e2e::metric_sum(
            &text,
            &[
                "robota_mcpd_cancellations_total",
                &format!("outcome=\"{outcome}\""),
            ],
        )
    };
    assert_eq!(cancellations("unmatched"), 1.0, "B's cancellation");
    assert_eq!(
        cancellations("matched"),
        0.0,
        "B's cancellation matched A's request"
    );
    assert!(procs::alive(turn), "B's cancellation killed A's turn");
    assert!(
        procs::alive(child),
        "B's cancellation killed A's turn child"
    );
    assert!(!a_call.is_finished(), "B's cancellation ended A's request");

    // A cancels its own request: it ends, and the whole turn group is gone.
    let resp = exchange(addr, &Request::mcp(port, Some(&a), &cancelled(7))).await;
    assert_eq!(
        resp.status,
        202,
        "A's cancellation POST: {}",
        resp.describe()
    );
    assert_eq!(cancellations("matched"), 1.0, "A's own cancellation");
    let outcome = within(
        Duration::from_secs(10),
        "A's request must end after its cancellation",
        a_call,
    )
    .await
    .expect("join");
    eprintln!(
        "A's request after its cancellation: {:?}",
        outcome.as_ref().map(Response::describe)
    );
    match outcome {
        Ok(resp) => {
            assert_eq!(resp.status, 200, "A's submission: {}", resp.describe());
            if let Some(rpc) = resp.rpc(7) {
                assert!(
                    rpc.get("error").is_none(),
                    "a cancelled call is a visible tool error, not a JSON-RPC error: {rpc}"
                );
                assert_eq!(
                    tool_error_code(&rpc).as_deref(),
                    Some("cancelled"),
                    "A after cancel: {rpc}"
                );
            }
        }
        Err(e) => assert_ne!(
            e.kind(),
            std::io::ErrorKind::TimedOut,
            "A's request hung: {e}"
        ),
    }
    assert_gone(pgid, &[turn, child], "after A's cancellation").await;
    assert!(
        poll_until(Duration::from_secs(5), Duration::from_millis(20), || {
            !d_status_active(&d)
        })
        .await,
        "status.active_turn stays true after the turn ended"
    );
    d.assert_no_secrets();
}

fn d_status_active(d: &Daemon) -> bool {
    d.status().active_turn
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn turn_gets_prompt_on_stdin_and_returns_stdout() {
    let d = turn_config(
        "[session.turn]\nargv = [\"/usr/bin/tr\", \"a-z\", \"A-Z\"]\ntimeout = \"30s\"\n",
        ALLOW_SUBMIT,
    )
    .start();
    let bearer = d.bearer();
    let rpc = call(
        &d,
        &bearer,
        3,
        "agent_submit",
        json!({"prompt": "hello turn"}),
    )
    .await;
    assert_eq!(tool_error_code(&rpc), None, "turn failed: {rpc}");
    assert_eq!(result_text(&rpc).trim_end(), "HELLO TURN", "{rpc}");
    d.assert_no_secrets();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn default_policy_denies_submission() {
    let d = turn_config("[session.turn]\nargv = [\"/bin/cat\"]\n", "").start();
    let bearer = d.bearer();
    let rpc = call(&d, &bearer, 4, "agent_submit", json!({"prompt": "x"})).await;
    assert_eq!(
        tool_error_code(&rpc).as_deref(),
        Some("permission_denied"),
        "{rpc}"
    );
    let rpc = call(&d, &bearer, 5, "system.info", json!({})).await;
    assert_eq!(
        tool_error_code(&rpc),
        None,
        "read-only tools are allowed by default: {rpc}"
    );
    d.assert_no_secrets();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn submission_without_backend_is_unavailable() {
    let d = Daemon::start(ALLOW_SUBMIT);
    let bearer = d.bearer();
    let rpc = call(&d, &bearer, 6, "agent_submit", json!({"prompt": "x"})).await;
    assert_eq!(
        tool_error_code(&rpc).as_deref(),
        Some("unavailable"),
        "{rpc}"
    );
    d.assert_no_secrets();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn policy_rules_match_caller_and_tool() {
    let d = Daemon::start(
        r#"
[[policy]]
callers = ["bearer:ci"]
tools = ["agent_submit"]
decision = "allow"

[[policy]]
callers = ["bearer:ci"]
tools = ["system.info"]
decision = "deny"

[[policy]]
callers = ["bearer:*"]
tools = ["system.health"]
decision = "grant"
"#,
    );
    let host = d.bearer();
    let ci = d.bearer_labeled("ci");
    let code = |rpc: &Value| tool_error_code(rpc);
    let r = call(&d, &host, 1, "agent_submit", json!({"prompt": "x"})).await;
    assert_eq!(
        code(&r).as_deref(),
        Some("permission_denied"),
        "default caller: {r}"
    );
    let r = call(&d, &ci, 2, "agent_submit", json!({"prompt": "x"})).await;
    assert_eq!(
        code(&r).as_deref(),
        Some("unavailable"),
        "ci is allowed, no backend: {r}"
    );
    let r = call(&d, &ci, 3, "system.info", json!({})).await;
    assert_eq!(
        code(&r).as_deref(),
        Some("permission_denied"),
        "deny rule for ci: {r}"
    );
    let r = call(&d, &host, 4, "system.info", json!({})).await;
    assert_eq!(code(&r), None, "default caller keeps system.info: {r}");
    let r = call(&d, &host, 5, "system.health", json!({})).await;
    assert_eq!(
        code(&r).as_deref(),
        Some("interactive_permission_required"),
        "grant rule without an approved grant: {r}"
    );
    d.assert_no_secrets();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_arguments_and_unknown_tools_are_visible_errors() {
    let d = turn_config("[session.turn]\nargv = [\"/bin/cat\"]\n", ALLOW_SUBMIT).start();
    let bearer = d.bearer();
    for (i, args) in [
        json!({}),
        json!({"prompt": ""}),
        json!({"prompt": 5}),
        json!({"prompt": "x", "extra": true}),
    ]
    .into_iter()
    .enumerate()
    {
        let rpc = call(&d, &bearer, 10 + i as i64, "agent_submit", args.clone()).await;
        assert_eq!(
            tool_error_code(&rpc).as_deref(),
            Some("invalid_arguments"),
            "agent_submit {args}: {rpc}"
        );
    }
    let rpc = call(&d, &bearer, 20, "no.such.tool", json!({})).await;
    assert_eq!(
        tool_error_code(&rpc).as_deref(),
        Some("unknown_tool"),
        "{rpc}"
    );
    d.assert_no_secrets();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn turn_time_limit_is_timed_out_and_kills_the_group() {
    let turn = SLOW_TURN.replace("timeout = \"10m\"", "timeout = \"2s\"");
    let d = turn_config(&turn, ALLOW_SUBMIT).start();
    let bearer = d.bearer();
    let call = spawn_submission(&d, &bearer, 9);
    let (turn, child, pgid) = turn_pids(&d).await;
    let resp = within(
        Duration::from_secs(20),
        "a turn past its time limit must end",
        call,
    )
    .await
    .expect("join")
    .expect("response to a timed-out turn");
    assert_eq!(resp.status, 200, "{}", resp.describe());
    let rpc = resp.expect_rpc(9);
    assert_eq!(tool_error_code(&rpc).as_deref(), Some("timed_out"), "{rpc}");
    assert_gone(pgid, &[turn, child], "after the time limit").await;
    d.assert_no_secrets();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_turn_result_is_result_too_large() {
    let d = turn_config(
        "[session.turn]\nargv = [\"/bin/sh\", \"-c\", \"head -c 20000 /dev/zero | tr '\\\\0' a\"]\n",
        &format!("{ALLOW_SUBMIT}\n[limits]\ntool_result = \"4KiB\"\n"),
    )
    .start();
    let bearer = d.bearer();
    let rpc = call(&d, &bearer, 11, "agent_submit", json!({"prompt": "x"})).await;
    assert_eq!(
        tool_error_code(&rpc).as_deref(),
        Some("result_too_large"),
        "{}",
        truncate(&rpc)
    );
    d.assert_no_secrets();
}

fn truncate(v: &Value) -> String {
    v.to_string().chars().take(500).collect()
}
