//! Process lifecycle: readiness (`READY=1` only once every listener is bound), failed
//! binds, `check-config`, SIGTERM, and the control-plane `restart` / `bearer rotate` /
//! `bearer revoke` / `stop` transitions as seen by loopback clients.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use nix::sys::signal::Signal;
use robota_e2e::daemon::check_config;
use robota_e2e::http::{Request, exchange, tool_names, tools_list};
use robota_e2e::{Daemon, EXIT_CONFIG, free_port, poll_until_blocking};
use serde_json::Value;

const EXIT_LIMIT: Duration = Duration::from_secs(15);

/// `tools/list` with `bearer`: the HTTP status (and the names when 200).
async fn list_with(d: &Daemon, bearer: &str) -> (u16, Vec<String>) {
    let addr = d.loopback_addr();
    let resp = exchange(
        addr,
        &Request::mcp(addr.port(), Some(bearer), &tools_list(1)),
    )
    .await;
    if resp.status == 200 {
        let names = tool_names(&resp.expect_rpc(1));
        (200, names)
    } else {
        assert!(
            resp.body.is_empty(),
            "refusal with a body: {}",
            resp.describe()
        );
        (resp.status, Vec::new())
    }
}

async fn assert_served(d: &Daemon, bearer: &str, case: &str) {
    let (status, names) = list_with(d, bearer).await;
    assert_eq!(status, 200, "{case}: tools/list must be served");
    for n in ["system.info", "system.health", "agent_submit"] {
        assert!(
            names.iter().any(|x| x == n),
            "{case}: {n} missing from {names:?}"
        );
    }
}

async fn assert_refused(d: &Daemon, bearer: &str, case: &str) {
    let (status, _) = list_with(d, bearer).await;
    assert_eq!(status, 401, "{case}: the bearer must be refused");
}

/// Every `"label"` string anywhere in a JSON value.
fn labels(v: &Value, out: &mut Vec<String>) {
    match v {
        Value::Object(m) => {
            for (k, x) in m {
                if k == "label"
                    && let Some(s) = x.as_str()
                {
                    out.push(s.to_owned());
                }
                labels(x, out);
            }
        }
        Value::Array(a) => a.iter().for_each(|x| labels(x, out)),
        _ => {}
    }
}

fn bearer_labels(d: &Daemon) -> Vec<String> {
    let out = d.ctl_ok(&["--json", "bearer", "list"]);
    let v: Value = serde_json::from_str(&out.stdout)
        .unwrap_or_else(|e| panic!("`--json bearer list` is not JSON ({e}): {:?}", out.stdout));
    let mut l = Vec::new();
    labels(&v, &mut l);
    l
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ready_means_every_listener_accepts() {
    let lo_port = free_port();
    let metrics_port = free_port();
    let d = Daemon::builder()
        .loopback_listen(format!("127.0.0.1:{lo_port}"))
        .metrics_listen(format!("127.0.0.1:{metrics_port}"))
        .spawn();
    d.wait_ready(0);
    // Immediately after the datagram: every listener must already accept.
    UnixStream::connect(d.socket_path())
        .unwrap_or_else(|e| panic!("control socket not accepting at READY=1: {e}"));
    let lo: SocketAddr = format!("127.0.0.1:{lo_port}").parse().expect("addr");
    TcpStream::connect_timeout(&lo, Duration::from_secs(2))
        .unwrap_or_else(|e| panic!("loopback {lo} not accepting at READY=1: {e}"));
    let metrics: SocketAddr = format!("127.0.0.1:{metrics_port}").parse().expect("addr");
    TcpStream::connect_timeout(&metrics, Duration::from_secs(2))
        .unwrap_or_else(|e| panic!("metrics {metrics} not accepting at READY=1: {e}"));

    let st = d.refresh_addrs();
    assert_eq!(
        d.loopback_addr(),
        lo,
        "status reports the configured loopback address"
    );
    assert_eq!(
        d.metrics_addr(),
        metrics,
        "status reports the configured metrics address"
    );
    assert_eq!(st.state, "serving", "{st:?}");
    assert_eq!(st.pid, d.pid() as u32, "{st:?}");
    assert_eq!(d.notify().count("READY=1"), 1, "{:?}", d.notify().lines());
    assert!(
        poll_until_blocking(Duration::from_secs(5), Duration::from_millis(20), || {
            d.notify().lines().iter().any(|l| l.starts_with("STATUS="))
        }),
        "no STATUS= sent: {:?}",
        d.notify().lines()
    );

    let resp = exchange(
        metrics,
        &Request::new("GET", "/metrics")
            .header("Host", &metrics.to_string())
            .header("Connection", "close"),
    )
    .await;
    assert_eq!(resp.status, 200, "GET /metrics: {}", resp.describe());
    let text = resp.body_text();
    assert!(
        text.contains("# TYPE ") && text.contains("# HELP "),
        "Prometheus text exposition expected: {}",
        resp.describe()
    );
}

fn assert_bind_failure(which: &str, builder: robota_e2e::DaemonBuilder, addr: SocketAddr) {
    let d = builder.spawn();
    let status = d.wait_exit(Duration::from_secs(20)).unwrap_or_else(|| {
        panic!(
            "{which} port {addr} in use: robota-mcpd did not exit within 20 s; notify: {:?}",
            d.notify().lines()
        )
    });
    assert!(
        !status.success(),
        "{which} port in use must fail: {status:?}"
    );
    assert_eq!(
        d.notify().count("READY=1"),
        0,
        "READY=1 must never be sent when a listener cannot bind: {:?}",
        d.notify().lines()
    );
    let stderr = d.stderr_text();
    assert!(
        stderr.contains(&addr.to_string()),
        "stderr must name {addr}: {stderr}"
    );
}

#[test]
fn loopback_port_in_use_fails_without_ready() {
    let taken = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = taken.local_addr().expect("addr");
    assert_bind_failure(
        "loopback",
        Daemon::builder().loopback_listen(addr.to_string()),
        addr,
    );
    drop(taken);
}

#[test]
fn metrics_port_in_use_fails_without_ready() {
    let taken = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = taken.local_addr().expect("addr");
    assert_bind_failure(
        "metrics",
        Daemon::builder().metrics_listen(addr.to_string()),
        addr,
    );
    drop(taken);
}

fn config_file(
    dir: &std::path::Path,
    name: &str,
    builder: robota_e2e::DaemonBuilder,
) -> std::path::PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, builder.config_text(dir)).expect("write config");
    path
}

#[test]
fn check_config_accepts_valid_and_names_bad_keys() {
    let dir = tempfile::tempdir().expect("tempdir");
    let valid = config_file(
        dir.path(),
        "valid.toml",
        Daemon::builder().extra(
            "[session]\nsubmission_tool = \"agent_submit\"\n[session.turn]\nargv = [\"/bin/cat\"]\ntimeout = \"10m\"\n\n[limits]\nrequest_body = \"1MiB\"\ntool_result = \"8MiB\"\n\n[[policy]]\ncallers = [\"bearer:*\"]\ntools = [\"agent_submit\"]\ndecision = \"allow\"\n",
        ),
    );
    let out = check_config(&valid);
    out.expect_code(0, "check-config on a valid config");

    let wildcard = config_file(
        dir.path(),
        "wildcard.toml",
        Daemon::builder().loopback_listen("0.0.0.0:1"),
    );
    let out = check_config(&wildcard);
    out.expect_code(EXIT_CONFIG, "check-config with loopback.listen = 0.0.0.0:1");
    let text = format!("{}{}", out.stdout, out.stderr);
    assert!(
        text.contains("loopback.listen"),
        "error must name loopback.listen: {text}"
    );

    let unknown = config_file(
        dir.path(),
        "unknown.toml",
        Daemon::builder().loopback("bogus_knob = true"),
    );
    let out = check_config(&unknown);
    out.expect_code(EXIT_CONFIG, "check-config with an unknown key");
    let text = format!("{}{}", out.stdout, out.stderr);
    assert!(
        text.contains("bogus_knob"),
        "error must name the unknown key: {text}"
    );

    let unknown_table = config_file(
        dir.path(),
        "unknown-table.toml",
        Daemon::builder().extra("[frobnicator]\nlevel = 3\n"),
    );
    let out = check_config(&unknown_table);
    out.expect_code(EXIT_CONFIG, "check-config with an unknown table");
    let text = format!("{}{}", out.stdout, out.stderr);
    assert!(
        text.contains("frobnicator"),
        "error must name the unknown table: {text}"
    );
}

#[test]
fn daemon_with_invalid_config_exits_78_without_ready() {
    let d = Daemon::builder().loopback_listen("0.0.0.0:1").spawn();
    let status = d
        .wait_exit(Duration::from_secs(20))
        .expect("robota-mcpd with an invalid config did not exit");
    assert_eq!(
        status.code(),
        Some(EXIT_CONFIG),
        "config errors exit 78: {status:?}"
    );
    assert_eq!(d.notify().count("READY=1"), 0, "{:?}", d.notify().lines());
    assert!(
        d.stderr_text().contains("loopback.listen"),
        "{}",
        d.stderr_text()
    );
}

#[test]
fn sigterm_sends_stopping_and_exits_zero() {
    let d = Daemon::start("");
    d.signal(Signal::SIGTERM);
    let status = d
        .wait_exit(EXIT_LIMIT)
        .expect("no exit within 15 s of SIGTERM");
    assert_eq!(
        status.code(),
        Some(0),
        "exit code after SIGTERM: {status:?}"
    );
    let lines = d.notify().lines();
    let ready = lines.iter().position(|l| l == "READY=1").expect("READY=1");
    let stopping = lines
        .iter()
        .position(|l| l == "STOPPING=1")
        .unwrap_or_else(|| panic!("no STOPPING=1 on SIGTERM: {lines:?}"));
    assert!(stopping > ready, "STOPPING=1 after READY=1: {lines:?}");
}

#[test]
fn a_descriptor_left_open_by_whoever_started_the_daemon_is_not_kept() {
    // Started with a file open on descriptor 9 and not close-on-exec: the daemon lets
    // go of it before it opens anything, so no job or turn process it starts holds it.
    let tmp = tempfile::tempdir().expect("tempdir");
    let marker = tmp.path().join("left-open");
    std::fs::write(&marker, b"held by the supervisor").expect("marker");
    let d = Daemon::builder().inherit_open(&marker).start();
    let held: Vec<_> = std::fs::read_dir(format!("/proc/{}/fd", d.pid()))
        .expect("the daemon's descriptors")
        .flatten()
        .filter_map(|e| std::fs::read_link(e.path()).ok())
        .collect();
    assert!(
        !held.iter().any(|p| p == &marker),
        "the daemon still holds the inherited descriptor: {held:?}"
    );
    assert!(
        held.iter().any(|p| p.to_string_lossy().contains("socket:")),
        "no sockets among {held:?}: not the daemon's table"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_keeps_only_bearers_with_a_lifetime_and_the_socket() {
    let d = Daemon::start("");
    let host = d.bearer();
    let ci = d.bearer_labeled("ci");
    let kept = d.bearer_with_ttl("kept", "30d");
    assert_served(&d, &host, "host bearer before restart").await;
    assert_served(&d, &ci, "ci bearer before restart").await;
    let before = d.status();
    let addr = d.loopback_addr();

    let from = d.notify().lines().len();
    d.ctl_ok(&["restart"]);
    let reloading = d
        .notify()
        .wait_for("RELOADING=1", from, Duration::from_secs(20), || {
            d.try_exit().is_some()
        })
        .unwrap_or_else(|| panic!("no RELOADING=1 after restart: {:?}", d.notify().lines()));
    d.wait_ready(reloading + 1);
    let after = d.refresh_addrs();
    assert_eq!(
        after.pid, before.pid,
        "restart is a fresh attach, not a new process"
    );
    assert_eq!(
        after.generation,
        before.generation + 1,
        "generation after restart"
    );
    assert_eq!(after.state, "serving");
    assert_eq!(
        d.loopback_addr(),
        addr,
        "the loopback socket is kept across a restart"
    );

    assert_refused(&d, &host, "old host bearer after restart").await;
    assert_refused(&d, &ci, "extra bearer after restart").await;
    assert_served(&d, &kept, "a bearer issued with a lifetime lives on").await;
    let labels = bearer_labels(&d);
    assert!(
        !labels.iter().any(|l| l == "ci") && labels.iter().any(|l| l == "kept"),
        "`bearer list` after restart: {labels:?}"
    );
    let fresh = d.bearer();
    assert_ne!(fresh, host, "restart must mint a new host bearer");
    assert_served(&d, &fresh, "new host bearer after restart").await;
    d.assert_no_secrets();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bearer_rotate_replaces_every_bearer() {
    let d = Daemon::start("");
    let old = d.bearer();
    let ci = d.bearer_labeled("ci");
    let kept = d.bearer_with_ttl("kept", "1h");
    assert_served(&d, &old, "host bearer before rotate").await;
    assert_served(&d, &kept, "durable bearer before rotate").await;
    let out = d.ctl_ok(&["bearer", "rotate"]);
    if let Some(s) = out.stdout.strip_suffix('\n') {
        d.register_secret(s);
    }
    let new = d.bearer();
    assert_ne!(new, old, "rotate must replace the host bearer");
    assert_eq!(
        out.stdout.trim_end(),
        new,
        "`bearer rotate` prints the new host bearer, the one `bearer issue` returns"
    );
    assert_refused(&d, &old, "old host bearer after rotate").await;
    assert_served(&d, &new, "new host bearer after rotate").await;
    assert_refused(&d, &ci, "extra bearer after rotate").await;
    assert_refused(&d, &kept, "durable bearer after rotate").await;
    assert_eq!(
        bearer_labels(&d),
        ["default"],
        "only the new host bearer is listed"
    );
    // Nor does the durable one come back with the next attach.
    d.ctl_ok(&["restart"]);
    assert_refused(&d, &kept, "durable bearer after rotate and restart").await;
    d.assert_no_secrets();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bearer_revoke_refuses_only_that_bearer() {
    let d = Daemon::start("");
    let host = d.bearer();
    let ci = d.bearer_labeled("ci");
    let other = d.bearer_labeled("other");
    assert_served(&d, &ci, "ci before revoke").await;
    let listed = bearer_labels(&d);
    assert!(listed.iter().any(|l| l == "ci"), "bearer list: {listed:?}");
    d.ctl_ok(&["bearer", "revoke", "ci"]);
    assert_refused(&d, &ci, "revoked ci bearer").await;
    assert_served(&d, &host, "host bearer after revoking ci").await;
    assert_served(&d, &other, "other extra bearer after revoking ci").await;
    assert!(
        !bearer_labels(&d).iter().any(|l| l == "ci"),
        "`bearer list` still shows ci after revoke"
    );
    d.ctl(&["bearer", "revoke", "ci"])
        .expect_code(1, "revoking an unknown label is a daemon error");
    d.assert_no_secrets();
}

#[test]
fn ctl_stop_exits_zero() {
    let d = Daemon::start("");
    let _ = d.bearer();
    d.ctl_ok(&["stop"]);
    let status = d
        .wait_exit(EXIT_LIMIT)
        .expect("no exit within 15 s of `stop`");
    assert_eq!(status.code(), Some(0), "exit code after `stop`: {status:?}");
    assert!(
        d.notify().lines().iter().any(|l| l == "STOPPING=1"),
        "no STOPPING=1 on stop: {:?}",
        d.notify().lines()
    );
    d.ctl(&["status"])
        .expect_code(3, "status once the daemon has stopped");
    d.assert_no_secrets();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_reloads_and_keeps_the_host_bearer() {
    let d = Daemon::start("");
    let host = d.bearer();
    assert_served(&d, &host, "host bearer before SIGHUP").await;
    let before = d.status();
    let from = d.notify().lines().len();
    d.signal(Signal::SIGHUP);
    let reloading = d
        .notify()
        .wait_for("RELOADING=1", from, Duration::from_secs(20), || {
            d.try_exit().is_some()
        })
        .unwrap_or_else(|| panic!("no RELOADING=1 after SIGHUP: {:?}", d.notify().lines()));
    d.wait_ready(reloading + 1);
    let after = d.refresh_addrs();
    assert_eq!(after.pid, before.pid, "SIGHUP keeps the process");
    assert_eq!(
        after.generation,
        before.generation + 1,
        "generation after SIGHUP"
    );
    // [loopback] is as it was: loopback clients stay logged in.
    assert_served(&d, &host, "host bearer after SIGHUP").await;
    assert_eq!(d.bearer(), host, "the host bearer after SIGHUP");
    d.assert_no_secrets();
}

#[test]
fn watchdog_pings_when_the_manager_asks() {
    // WatchdogSec=0.4s → a ping at least every 0.2 s.
    let d = Daemon::builder().watchdog_usec(400_000).start();
    let pinged = poll_until_blocking(Duration::from_secs(5), Duration::from_millis(20), || {
        d.notify().count("WATCHDOG=1") >= 3
    });
    assert!(
        pinged,
        "fewer than 3 WATCHDOG=1 within 5 s with WATCHDOG_USEC=400000: {:?}",
        d.notify().lines()
    );
}
