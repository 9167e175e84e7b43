//! `robota-mcpctl stdio`: a real rmcp client launches the relay as its child and reaches
//! the running daemon's session over the control socket — the same catalog and the same
//! single turn as a loopback client, with the peer uid as caller.

use std::process::Stdio;
use std::time::Duration;

use rmcp::ServiceExt;
use rmcp::model::{CallToolRequestParams, ClientConfig, ProtocolVersion};
use rmcp::service::RunningService;
use rmcp::transport::TokioChildProcess;
use rmcp::{ClientLifecycleMode, ClientServiceExt, RoleClient};
use robota_e2e::http::{Request, exchange, tool_error_code, tools_call};
use robota_e2e::{Daemon, mcpctl_bin, poll_until, within};
use serde_json::json;

const LIMIT: Duration = Duration::from_secs(20);

/// A turn that prints its caller and waits for `<dir>/release`.
const WAITING_TURN: &str = r#"
[session.turn]
argv = ["/bin/sh", "-c", "echo \"$ROBOTA_MCPD_CALLER\"; while [ ! -e @DIR@/release ]; do sleep 0.05; done"]
timeout = "1m"

[[policy]]
callers = ["local:*", "bearer:*"]
tools = ["agent_submit"]
decision = "allow"
"#;

fn relay(d: &Daemon) -> tokio::process::Command {
    let mut cmd = tokio::process::Command::new(mcpctl_bin());
    cmd.arg("--socket")
        .arg(d.socket_path())
        .arg("stdio")
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default());
    cmd
}

async fn connect(d: &Daemon, discover: bool) -> RunningService<RoleClient, ClientConfig> {
    let (transport, _) = TokioChildProcess::builder(relay(d))
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn robota-mcpctl stdio");
    let started = if discover {
        let mode = ClientLifecycleMode::Discover {
            preferred_versions: vec![ProtocolVersion::V_2026_07_28],
        };
        ClientConfig::default()
            .serve_with_lifecycle(transport, mode)
            .await
    } else {
        ClientConfig::default()
            .with_protocol_version(ProtocolVersion::V_2025_11_25)
            .serve(transport)
            .await
    };
    started.expect("MCP session over robota-mcpctl stdio")
}

async fn lists_and_calls(discover: bool) {
    let d = Daemon::start("");
    let client = within(LIMIT, "relay start", connect(&d, discover)).await;
    let tools = within(LIMIT, "tools/list", client.list_all_tools())
        .await
        .expect("tools/list");
    let mut names: Vec<&str> = tools.iter().map(|t| t.name.as_ref()).collect();
    names.sort_unstable();
    // The whole canonical catalog of docs/design.md §11, plus the submission tool.
    assert_eq!(
        names,
        [
            "agent_submit",
            "docker.action",
            "docker.logs",
            "file.read",
            "file.write",
            "job.cancel",
            "job.start",
            "job.status",
            "job.tail",
            "permissions.list_root_access",
            "permissions.request_elevation",
            "permissions.request_root_access",
            "permissions.revoke_root_access",
            "service.action",
            "service.status",
            "system.health",
            "system.info",
        ]
    );
    let result = within(
        LIMIT,
        "system.info",
        client.call_tool(CallToolRequestParams::new("system.info")),
    )
    .await
    .expect("tools/call");
    assert_eq!(result.is_error, Some(false));
    let info = result.structured_content.expect("structured content");
    assert_eq!(info["daemon_version"], d.status().version);
    let _ = within(LIMIT, "close", client.cancel()).await;
    // The relay is counted as the stdio carrier.
    let text = d.metrics_text().expect("metrics");
    assert!(
        robota_e2e::metric_sum(
            &text,
            &["robota_mcpd_admitted_requests_total{", "carrier=\"stdio\""]
        ) >= 1.0,
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_serves_the_catalog_on_2025_11_25() {
    lists_and_calls(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_serves_the_catalog_on_2026_07_28() {
    lists_and_calls(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_shares_the_busy_turn_and_calls_as_the_peer_uid() {
    let d = Daemon::builder().extra(WAITING_TURN).start();
    let client = within(LIMIT, "relay start", connect(&d, false)).await;
    let submit = {
        let peer = client.peer().clone();
        tokio::spawn(async move {
            let args = json!({"prompt": "hello"}).as_object().cloned().unwrap();
            peer.call_tool(CallToolRequestParams::new("agent_submit").with_arguments(args))
                .await
        })
    };
    let running = poll_until(LIMIT, Duration::from_millis(20), || d.status().active_turn).await;
    assert!(running, "the relayed turn never started");

    // A loopback caller meets the same single turn.
    let bearer = d.bearer();
    let addr = d.loopback_addr();
    let other = exchange(
        addr,
        &Request::mcp(
            addr.port(),
            Some(&bearer),
            &tools_call(9, "agent_submit", json!({"prompt": "x"})),
        ),
    )
    .await;
    assert_eq!(
        tool_error_code(&other.expect_rpc(9)).as_deref(),
        Some("busy")
    );

    std::fs::write(d.dir().join("release"), b"").unwrap();
    let result = within(LIMIT, "relayed turn", submit)
        .await
        .unwrap()
        .expect("agent_submit");
    assert_eq!(result.is_error, Some(false), "{result:?}");
    let text: String = result
        .content
        .iter()
        .filter_map(|c| c.as_text().map(|t| t.text.clone()))
        .collect();
    let uid = nix::unistd::getuid().as_raw();
    assert_eq!(
        text.trim(),
        format!("local:{uid}"),
        "the caller is the peer uid"
    );
    let _ = within(LIMIT, "close", client.cancel()).await;
    d.assert_no_secrets();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_ends_on_restart_and_stdin_eof_ends_it_cleanly() {
    let d = Daemon::start("");
    // stdin closed at once: the relay ends the session and exits 0.
    let out = within(
        LIMIT,
        "relay with empty stdin",
        relay(&d).stdin(Stdio::null()).output(),
    )
    .await
    .expect("run relay");
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // A relay that is still open when the daemon restarts exits 1 with a clear message.
    let child = relay(&d)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn relay");
    let relays = poll_until(LIMIT, Duration::from_millis(20), || {
        robota_e2e::metric_sum(
            &d.metrics_text().unwrap_or_default(),
            &["robota_mcpd_admitted_requests_total{", "carrier=\"stdio\""],
        ) >= 2.0
    })
    .await;
    assert!(relays, "the second relay never reached the daemon");
    let restart = d.ctl(&["restart"]);
    assert!(restart.status.success(), "{restart:?}");
    let out = within(LIMIT, "relay after restart", child.wait_with_output())
        .await
        .expect("relay exit");
    assert_eq!(out.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("ended the session"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_is_refused_for_a_peer_that_is_not_allowed() {
    use std::os::unix::fs::PermissionsExt;
    let d = Daemon::start("");
    std::fs::set_permissions(d.socket_path(), std::fs::Permissions::from_mode(0o666)).unwrap();
    let out = within(
        LIMIT,
        "relay as nobody",
        relay(&d)
            .uid(65534)
            .gid(65534)
            .stdin(Stdio::null())
            .output(),
    )
    .await
    .expect("run relay");
    assert_eq!(
        out.status.code(),
        Some(4),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
