//! `service.status` and `service.action` end to end: the real daemon reaches a fake
//! systemd over a private `dbus-daemon` (`DBUS_SYSTEM_BUS_ADDRESS`), driven by a real MCP
//! client. Allow-list, name grammar, policy, jobs following systemd's `JobRemoved`, an
//! unreachable bus and reconnection after the bus comes back.

use std::time::{Duration, Instant};

use robota_e2e::mcp::McpClient;
use robota_e2e::systemd::{FakeSystemd, FakeUnit, PrivateBus};
use robota_e2e::{Daemon, within};
use serde_json::{Value, json};
use tempfile::TempDir;

const SERVICES: &str = r#"
[tools.service]
units = ["nginx.service", "myapp-*.service"]
timeout = "30s"
"#;

const ALLOW_ACTION: &str = r#"
[[policy]]
callers = ["bearer:*"]
tools = ["service.action"]
decision = "allow"
"#;

/// How long a service job may take to end here (the fake's jobs take 150 ms).
const JOB_LIMIT: Duration = Duration::from_secs(15);

/// A private bus with a fake systemd on it and a daemon pointed at that bus.
struct World {
    d: Daemon,
    client: McpClient,
    systemd: FakeSystemd,
    _bus: PrivateBus,
    _dir: TempDir,
}

async fn world(units: Vec<FakeUnit>, policy: &str) -> World {
    let dir = tempfile::Builder::new()
        .prefix("mcpd-bus-")
        .tempdir()
        .expect("tempdir");
    let bus = PrivateBus::start(dir.path());
    let systemd = FakeSystemd::serve(bus.address(), units).await;
    let d = Daemon::builder()
        .env("DBUS_SYSTEM_BUS_ADDRESS", bus.address())
        .extra(SERVICES)
        .extra(policy)
        .start();
    let bearer = d.bearer();
    let client = McpClient::connect(&d, &bearer).await;
    World {
        d,
        client,
        systemd,
        _bus: bus,
        _dir: dir,
    }
}

async fn status(client: &McpClient, unit: &str) -> Value {
    client
        .call("service.status", json!({"unit": unit}))
        .await
        .ok(&format!("service.status {unit}"))
}

/// Starts an action, checks the handle came back at once, waits (bounded) for the end.
async fn act(client: &McpClient, unit: &str, action: &str) -> (Value, Value) {
    let started = Instant::now();
    let job = client
        .call("service.action", json!({"unit": unit, "action": action}))
        .await
        .ok(&format!("service.action {action} {unit}"));
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "the job handle must come back at once, took {:?}",
        started.elapsed()
    );
    assert_eq!(job["state"], "running", "a fresh handle: {job}");
    assert_eq!(job["kind"], "service", "{job}");
    assert_eq!(job["target"], unit, "{job}");
    assert_eq!(job["action"], action, "{job}");
    let id = job["job_id"].as_i64().expect("job_id");
    let done = wait_job(client, id).await;
    (job, done)
}

async fn wait_job(client: &McpClient, id: i64) -> Value {
    let deadline = Instant::now() + JOB_LIMIT;
    loop {
        let st = client
            .call("job.status", json!({"job_id": id}))
            .await
            .ok("job.status");
        if st["state"] != "running" {
            return st;
        }
        assert!(
            Instant::now() < deadline,
            "job {id} still running after {JOB_LIMIT:?}: {st}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn tail_text(client: &McpClient, id: i64) -> String {
    let page = client
        .call("job.tail", json!({"job_id": id}))
        .await
        .ok("job.tail");
    assert_eq!(
        page["complete"], true,
        "a finished job's whole output: {page}"
    );
    page["chunks"]
        .as_array()
        .expect("chunks")
        .iter()
        .filter_map(|c| c["text"].as_str())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_shows_running_and_missing_units() {
    let w = world(
        vec![
            FakeUnit::running("nginx.service", 4242).description("nginx web server"),
            FakeUnit::inactive("myapp-worker.service"),
        ],
        "",
    )
    .await;

    let st = status(&w.client, "nginx.service").await;
    assert_eq!(st["unit"], "nginx.service", "{st}");
    assert_eq!(st["load_state"], "loaded", "{st}");
    assert_eq!(st["active_state"], "active", "{st}");
    assert_eq!(st["sub_state"], "running", "{st}");
    assert_eq!(st["main_pid"], 4242, "{st}");
    assert_eq!(st["description"], "nginx web server", "{st}");
    assert_eq!(st["unit_file_state"], "enabled", "{st}");
    let since = st["active_enter_timestamp"]
        .as_str()
        .expect("an RFC 3339 timestamp");
    assert!(
        since.len() >= 20 && since.ends_with('Z') && since.as_bytes()[10] == b'T',
        "{since}"
    );

    let st = status(&w.client, "myapp-worker.service").await;
    assert_eq!(
        (st["active_state"].as_str(), st["sub_state"].as_str()),
        (Some("inactive"), Some("dead")),
        "{st}"
    );
    assert_eq!(st["main_pid"], Value::Null, "no main process: {st}");
    assert_eq!(st["active_enter_timestamp"], Value::Null, "{st}");

    // Allowed by the glob, unknown to systemd: reported, not an error.
    let st = status(&w.client, "myapp-missing.service").await;
    assert_eq!(st["unit"], "myapp-missing.service", "{st}");
    assert_eq!(st["load_state"], "not-found", "{st}");
    assert_eq!(st["active_state"], "inactive", "{st}");

    let loads: Vec<String> = w
        .systemd
        .calls_of("LoadUnit")
        .into_iter()
        .map(|c| c.args[0].clone())
        .collect();
    assert_eq!(
        loads,
        [
            "nginx.service",
            "myapp-worker.service",
            "myapp-missing.service"
        ]
    );
    w.client.close().await;
    w.d.assert_no_secrets();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_and_malformed_units_never_reach_the_bus() {
    let w = world(vec![FakeUnit::running("nginx.service", 10)], ALLOW_ACTION).await;

    let msg = w
        .client
        .call("service.status", json!({"unit": "sshd.service"}))
        .await
        .err("permission_denied", "a unit outside the allow-list");
    assert_eq!(
        msg,
        "unit sshd.service is not among the units [tools.service] allows"
    );
    w.client
        .call(
            "service.action",
            json!({"unit": "sshd.service", "action": "restart"}),
        )
        .await
        .err(
            "permission_denied",
            "acting on a unit outside the allow-list",
        );
    // Matches no glob once the type suffix is checked.
    w.client
        .call("service.status", json!({"unit": "nginx.socket"}))
        .await
        .err("permission_denied", "another type of an allowed name");

    for bad in [
        "../nginx.service",
        "nginx",
        "nginx.service;reboot",
        "myapp-/etc/passwd.service",
        "nginx.exe",
    ] {
        let msg = w
            .client
            .call("service.status", json!({"unit": bad}))
            .await
            .err("invalid_arguments", &format!("malformed unit {bad:?}"));
        assert!(msg.contains("is not a unit name"), "{bad:?}: {msg}");
        w.client
            .call("service.action", json!({"unit": bad, "action": "stop"}))
            .await
            .err(
                "invalid_arguments",
                &format!("action on malformed unit {bad:?}"),
            );
    }
    w.client
        .call(
            "service.action",
            json!({"unit": "nginx.service", "action": "kill"}),
        )
        .await
        .err("invalid_arguments", "an action outside the enum");

    assert!(
        w.systemd.calls().is_empty(),
        "nothing refused may reach the bus: {:?}",
        w.systemd.calls()
    );
    // The double does see what is allowed (so the emptiness above means something).
    status(&w.client, "nginx.service").await;
    assert!(w.systemd.saw_unit("nginx.service"));
    assert!(!w.systemd.saw_unit("sshd"), "{:?}", w.systemd.calls());
    assert!(w.systemd.calls_of("RestartUnit").is_empty());
    assert!(w.systemd.calls_of("StopUnit").is_empty());
    w.client.close().await;
    w.d.assert_no_secrets();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn actions_are_jobs_that_follow_systemd_jobs() {
    let w = world(
        vec![
            FakeUnit::running("nginx.service", 4242),
            FakeUnit::inactive("myapp-web.service"),
        ],
        ALLOW_ACTION,
    )
    .await;

    // restart: a new main process.
    let (job, done) = act(&w.client, "nginx.service", "restart").await;
    assert_eq!(done["state"], "succeeded", "{done}");
    assert!(
        done["detail"].as_str().is_some_and(|d| d.contains("done")),
        "{done}"
    );
    let id = job["job_id"].as_i64().expect("job_id");
    let log = tail_text(&w.client, id).await;
    assert!(
        log.contains("systemd job /org/freedesktop/systemd1/job/") && log.contains(" queued"),
        "{log}"
    );
    assert!(log.contains("finished: done"), "{log}");
    let st = status(&w.client, "nginx.service").await;
    assert_eq!(
        (st["active_state"].as_str(), st["sub_state"].as_str()),
        (Some("active"), Some("running")),
        "{st}"
    );
    let pid = st["main_pid"].as_u64().expect("a main pid after restart");
    assert_ne!(pid, 4242, "a restart starts a new main process: {st}");

    let restarts = w.systemd.calls_of("RestartUnit");
    assert_eq!(
        restarts.len(),
        1,
        "exactly one RestartUnit, never retried: {restarts:?}"
    );
    assert_eq!(restarts[0].args, ["nginx.service", "replace"]);
    let subscribe = w.systemd.calls_of("Subscribe");
    assert!(
        !subscribe.is_empty(),
        "the daemon subscribes to job signals"
    );
    assert_eq!(subscribe[0].sender, restarts[0].sender);

    // start an inactive unit, then stop the running one.
    let (_, done) = act(&w.client, "myapp-web.service", "start").await;
    assert_eq!(done["state"], "succeeded", "{done}");
    let st = status(&w.client, "myapp-web.service").await;
    assert_eq!(st["active_state"], "active", "{st}");
    assert!(st["main_pid"].as_u64().is_some_and(|p| p > 0), "{st}");

    let (_, done) = act(&w.client, "nginx.service", "stop").await;
    assert_eq!(done["state"], "succeeded", "{done}");
    let st = status(&w.client, "nginx.service").await;
    assert_eq!(
        (st["active_state"].as_str(), st["sub_state"].as_str()),
        (Some("inactive"), Some("dead")),
        "{st}"
    );
    assert_eq!(st["main_pid"], Value::Null, "{st}");
    assert_eq!(w.systemd.unit("nginx.service").expect("unit").main_pid, 0);

    // A second action on the cached connection: systemd says AlreadySubscribed; fine.
    let (_, done) = act(&w.client, "myapp-web.service", "reload").await;
    assert_eq!(done["state"], "succeeded", "{done}");
    assert_eq!(w.systemd.calls_of("StartUnit").len(), 1);
    assert_eq!(w.systemd.calls_of("StopUnit").len(), 1);
    assert_eq!(w.systemd.calls_of("ReloadUnit").len(), 1);
    assert_eq!(w.systemd.calls_of("RestartUnit").len(), 1);
    w.client.close().await;
    w.d.assert_no_secrets();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_systemd_jobs_and_refusals_fail_the_job() {
    let w = world(
        vec![FakeUnit::inactive("myapp-broken.service").job_result("failed")],
        ALLOW_ACTION,
    )
    .await;

    let (job, done) = act(&w.client, "myapp-broken.service", "start").await;
    assert_eq!(done["state"], "failed", "{done}");
    let detail = done["detail"].as_str().unwrap_or_default();
    assert!(
        detail.contains("\"failed\""),
        "the result is in the detail: {done}"
    );
    let log = tail_text(&w.client, job["job_id"].as_i64().expect("job_id")).await;
    assert!(log.contains("finished: failed"), "{log}");
    let st = status(&w.client, "myapp-broken.service").await;
    assert_eq!(
        (st["active_state"].as_str(), st["sub_state"].as_str()),
        (Some("failed"), Some("failed")),
        "{st}"
    );

    // Allowed, but systemd has no such unit: the D-Bus error ends the job.
    let (_, done) = act(&w.client, "myapp-ghost.service", "start").await;
    assert_eq!(done["state"], "failed", "{done}");
    let detail = done["detail"].as_str().unwrap_or_default();
    assert!(
        detail.starts_with("org.freedesktop.systemd1.NoSuchUnit: ")
            && detail.contains("myapp-ghost.service"),
        "{done}"
    );
    assert_eq!(w.systemd.calls_of("StartUnit").len(), 2);
    w.client.close().await;
    w.d.assert_no_secrets();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_bus_is_unavailable_and_the_daemon_reconnects() {
    let dir = tempfile::Builder::new()
        .prefix("mcpd-bus-")
        .tempdir()
        .expect("tempdir");
    let address = format!("unix:path={}", dir.path().join("bus").display());
    let d = Daemon::builder()
        .env("DBUS_SYSTEM_BUS_ADDRESS", &address)
        .extra(SERVICES)
        .extra(ALLOW_ACTION)
        .start();
    let bearer = d.bearer();
    let client = McpClient::connect(&d, &bearer).await;

    // Nothing listens there yet.
    let started = Instant::now();
    let msg = client
        .call("service.status", json!({"unit": "nginx.service"}))
        .await
        .err("unavailable", "no bus");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "unavailable must come quickly, took {:?}",
        started.elapsed()
    );
    assert!(
        msg.starts_with("systemd's D-Bus API is not reachable: "),
        "{msg}"
    );
    assert!(
        !msg.contains(dir.path().to_str().unwrap_or("/")),
        "no paths in the message: {msg}"
    );
    client
        .call(
            "service.action",
            json!({"unit": "nginx.service", "action": "restart"}),
        )
        .await
        .err("unavailable", "no bus for an action either");

    // The bus comes up: the next call connects.
    {
        let bus = PrivateBus::start(dir.path());
        let systemd =
            FakeSystemd::serve(bus.address(), vec![FakeUnit::running("nginx.service", 7)]).await;
        let st = status(&client, "nginx.service").await;
        assert_eq!(st["main_pid"], 7, "{st}");
        assert_eq!(systemd.calls_of("LoadUnit").len(), 1);
    }
    // It goes away: the cached connection is found broken.
    let msg = within(
        Duration::from_secs(10),
        "status after the bus went away",
        client.call("service.status", json!({"unit": "nginx.service"})),
    )
    .await
    .err("unavailable", "bus gone");
    assert!(
        msg.starts_with("systemd's D-Bus API is not reachable"),
        "{msg}"
    );

    // A new bus at the same address: the daemon reconnects.
    let bus = PrivateBus::start(dir.path());
    let systemd =
        FakeSystemd::serve(bus.address(), vec![FakeUnit::running("nginx.service", 8)]).await;
    let st = status(&client, "nginx.service").await;
    assert_eq!(st["main_pid"], 8, "{st}");
    let (_, done) = act(&client, "nginx.service", "restart").await;
    assert_eq!(done["state"], "succeeded", "{done}");
    assert_eq!(systemd.calls_of("RestartUnit").len(), 1);
    client.close().await;
    d.assert_no_secrets();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn actions_are_denied_by_default_while_status_is_allowed() {
    let w = world(vec![FakeUnit::running("nginx.service", 99)], "").await;

    let names = w.client.tool_names().await;
    assert!(
        names.iter().any(|n| n == "service.action") && names.iter().any(|n| n == "service.status"),
        "{names:?}"
    );
    w.client
        .call(
            "service.action",
            json!({"unit": "nginx.service", "action": "restart"}),
        )
        .await
        .err("permission_denied", "no policy rule for service.action");
    let st = status(&w.client, "nginx.service").await;
    assert_eq!(st["active_state"], "active", "{st}");
    assert!(
        w.systemd.calls_of("RestartUnit").is_empty(),
        "a denied action never reaches systemd: {:?}",
        w.systemd.calls()
    );
    assert_eq!(w.systemd.unit("nginx.service").expect("unit").main_pid, 99);
    w.client.close().await;
    w.d.assert_no_secrets();
}
