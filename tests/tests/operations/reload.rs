//! Reload (SIGHUP, `robota-mcpctl reload`, `robota-mcpctl restart`) reads the
//! configuration again: a valid file is served on a fresh session, an invalid one changes
//! nothing and says why everywhere an operator looks; a reload keeps the host bearer unless
//! `[loopback]` changed, `restart` never does; bearers issued with a lifetime outlive
//! reloads and the process.

use std::time::Duration;

use nix::sys::signal::Signal;
use robota_e2e::http::{Request, exchange, tool_names, tools_list};
use robota_e2e::{Daemon, EXIT_CONFIG, poll_until_async};

/// `tools/list` with `bearer`: the status and the tool names.
async fn list(d: &Daemon, bearer: &str) -> (u16, Vec<String>) {
    let addr = d.loopback_addr();
    let resp = exchange(
        addr,
        &Request::mcp(addr.port(), Some(bearer), &tools_list(1)),
    )
    .await;
    let names = if resp.status == 200 {
        tool_names(&resp.expect_rpc(1))
    } else {
        Vec::new()
    };
    (resp.status, names)
}

fn write_config(d: &Daemon, text: &str) {
    // As an editor saves: a new file renamed over the old one.
    let tmp = d.config_path().with_extension("new");
    std::fs::write(&tmp, text).expect("write config");
    std::fs::rename(&tmp, d.config_path()).expect("rename config");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_valid_edit_is_served_after_restart_and_an_invalid_one_changes_nothing() {
    let d = Daemon::start("");
    let original = std::fs::read_to_string(d.config_path()).expect("config");
    let host = d.bearer();
    let (status, names) = list(&d, &host).await;
    assert_eq!(status, 200);
    assert!(names.iter().any(|n| n == "agent_submit"), "{names:?}");
    let before = d.status();
    let config = before
        .config
        .clone()
        .expect("status shows the configuration");
    assert_eq!(config.source, d.config_path().display().to_string());
    assert_eq!(config.changed_on_disk, Some(false));
    assert_eq!(before.state_dir, d.state_dir().display().to_string());
    assert_eq!(before.health, "ok");
    assert!(before.last_reload.is_none());

    // A valid edit: status says the file differs until a restart applies it.
    write_config(
        &d,
        &format!("{original}\n[session]\nsubmission_tool = \"host_submit\"\n"),
    );
    assert_eq!(
        d.status().config.and_then(|c| c.changed_on_disk),
        Some(true)
    );
    d.ctl_ok(&["restart"]);
    let after = d.refresh_addrs();
    assert_eq!(after.generation, before.generation + 1);
    assert_eq!(after.submission_tool, "host_submit");
    let reload = after.last_reload.expect("the reload is recorded");
    assert!(reload.ok && reload.problems.is_empty(), "{reload:?}");
    let config = after.config.expect("config");
    assert_eq!(config.changed_on_disk, Some(false));
    assert_ne!(config.sha256, before.config.expect("config").sha256);
    let host = d.bearer();
    let (_, names) = list(&d, &host).await;
    assert!(names.iter().any(|n| n == "host_submit"), "{names:?}");

    // An invalid edit (two problems): `restart` exits 78 naming each with its line, the
    // running configuration and its bearer stay, status shows the failed reload.
    let bad = format!(
        "{original}\n[session]\nsubmission_tool = \"host_submit\"\n\n[limits]\nrequest_body = \"0\"\ntool_result = \"0\"\n"
    );
    write_config(&d, &bad);
    let line = bad
        .lines()
        .position(|l| l.starts_with("request_body"))
        .expect("line")
        + 1;
    let out = d.ctl(&["restart"]);
    out.expect_code(EXIT_CONFIG, "restart with an invalid configuration");
    assert!(out.stderr.contains("invalid-config"), "{}", out.stderr);
    assert!(out.stderr.contains("limits.request_body"), "{}", out.stderr);
    assert!(out.stderr.contains("limits.tool_result"), "{}", out.stderr);
    assert!(
        out.stderr.contains(&format!("line {line}")),
        "{}",
        out.stderr
    );
    let (status, names) = list(&d, &host).await;
    assert_eq!(status, 200, "the running attach was not touched");
    assert!(names.iter().any(|n| n == "host_submit"), "{names:?}");
    let st = d.status();
    assert_eq!(st.generation, after.generation, "nothing restarted");
    assert_eq!(st.state, "serving");
    let reload = st.last_reload.expect("the failed reload is recorded");
    assert!(!reload.ok);
    assert_eq!(reload.problems.len(), 2, "{:?}", reload.problems);
    assert_eq!(st.config.and_then(|c| c.changed_on_disk), Some(true));
    let human = d.ctl_ok(&["status"]).stdout;
    assert!(
        human.contains("last reload") && human.contains("refused"),
        "{human}"
    );
    assert!(
        d.stderr_text().contains("limits.request_body"),
        "every problem is logged"
    );

    // SIGHUP with the same file: the daemon stays up and serving, READY=1 again.
    let from = d.notify().lines().len();
    d.signal(Signal::SIGHUP);
    d.wait_ready(from);
    assert!(
        d.try_exit().is_none(),
        "SIGHUP with an invalid file ended the daemon"
    );
    let (status, _) = list(&d, &host).await;
    assert_eq!(status, 200);

    // Keys that belong to the process cannot change on a reload.
    write_config(
        &d,
        &original
            .replace("[daemon]\n", "[daemon]\n# moved\n")
            .replace(
                &format!("state_dir = \"{}\"", d.state_dir().display()),
                &format!("state_dir = \"{}/elsewhere\"", d.dir().display()),
            ),
    );
    let out = d.ctl(&["restart"]);
    out.expect_code(EXIT_CONFIG, "restart changing state_dir");
    assert!(out.stderr.contains("daemon.state_dir"), "{}", out.stderr);
    // Back to a valid file: the next restart works.
    write_config(&d, &original);
    d.ctl_ok(&["restart"]);
    assert!(d.status().last_reload.expect("reload").ok);
    d.assert_no_secrets();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bearer_with_a_lifetime_outlives_the_process_until_revoked() {
    let state = tempfile::tempdir().expect("tempdir");
    let (kept, short, plain) = {
        let d = Daemon::builder().state_dir(state.path()).start();
        let kept = d.bearer_with_ttl("kept", "30d");
        let short = d.bearer_with_ttl("short", "2s");
        let plain = d.bearer_labeled("plain");
        d.ctl_ok(&["stop"]);
        assert_eq!(
            d.wait_exit(Duration::from_secs(15)).and_then(|s| s.code()),
            Some(0)
        );
        (kept, short, plain)
    };
    // The store holds digests only: the harness scans every file of the state directory
    // for the secrets when each daemon is dropped.
    let d = Daemon::builder().state_dir(state.path()).start();
    for secret in [&kept, &short, &plain] {
        d.register_secret(secret);
    }
    assert_eq!(
        list(&d, &kept).await.0,
        200,
        "a durable bearer survives a new process"
    );
    assert_eq!(
        list(&d, &plain).await.0,
        401,
        "a bearer without a lifetime does not"
    );
    // The short one expires on time, whatever the restarts.
    let expired = poll_until_async(
        Duration::from_secs(10),
        Duration::from_millis(200),
        || async { list(&d, &short).await.0 == 401 },
    )
    .await;
    assert!(expired, "the 2 s bearer kept working");
    d.ctl_ok(&["bearer", "revoke", "kept"]);
    assert_eq!(list(&d, &kept).await.0, 401);
    d.ctl_ok(&["stop"]);
    assert_eq!(
        d.wait_exit(Duration::from_secs(15)).and_then(|s| s.code()),
        Some(0)
    );
    let d = Daemon::builder().state_dir(state.path()).start();
    d.register_secret(&kept);
    assert_eq!(
        list(&d, &kept).await.0,
        401,
        "a revoked bearer stays revoked"
    );
    d.assert_no_secrets();
}

/// Reloads that keep the listener's address keep its socket, and the carrier handed over
/// serves what it had accepted: a client sees no difference — no refused connect, no
/// reset, no request left unanswered — whether it opens a connection per request or keeps
/// one alive (reconnecting when an answer says `Connection: close`, as HTTP/1.1 asks).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_across_reloads_see_no_difference() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

    use robota_e2e::http::{Conn, try_exchange};

    const RELOADS: u64 = 30;
    let d = Arc::new(Daemon::start(""));
    // A bearer with a lifetime: every reload keeps it.
    let bearer = d.bearer_with_ttl("steady", "1h");
    let addr = d.loopback_addr();
    let done = Arc::new(AtomicBool::new(false));
    let answered = Arc::new(AtomicU64::new(0));
    let failures = Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let request = Request::mcp(addr.port(), Some(&bearer), &tools_list(1));
    let mut clients = Vec::new();
    for i in 0..8 {
        let (done, answered, failures, request) = (
            done.clone(),
            answered.clone(),
            failures.clone(),
            request.clone(),
        );
        clients.push(tokio::spawn(async move {
            let keep_alive = i % 4 == 0;
            let mut conn: Option<Conn> = None;
            while !done.load(Ordering::Relaxed) {
                let outcome = if keep_alive {
                    let c = match conn.as_mut() {
                        Some(c) => c,
                        None => match Conn::connect(addr).await {
                            Ok(c) => conn.insert(c),
                            Err(e) => {
                                failures.lock().unwrap().push(format!("connect: {e}"));
                                continue;
                            }
                        },
                    };
                    let exchanged = async {
                        c.write(&request.to_bytes()).await?;
                        c.read_response().await
                    };
                    match tokio::time::timeout(Duration::from_secs(20), exchanged).await {
                        Ok(result) => result,
                        Err(_) => Err(std::io::Error::other("no answer within 20 s")),
                    }
                } else {
                    try_exchange(addr, &request).await
                };
                match outcome {
                    Ok(resp) if resp.status == 200 => {
                        answered.fetch_add(1, Ordering::Relaxed);
                        if resp
                            .header("connection")
                            .is_some_and(|v| v.eq_ignore_ascii_case("close"))
                        {
                            conn = None;
                        }
                    }
                    Ok(resp) => {
                        failures.lock().unwrap().push(resp.describe());
                        conn = None;
                    }
                    Err(e) => {
                        let how = if keep_alive { "kept-alive" } else { "fresh" };
                        failures
                            .lock()
                            .unwrap()
                            .push(format!("{how} connection: {e}"));
                        conn = None;
                    }
                }
            }
        }));
    }
    for k in 1..=RELOADS {
        d.signal(Signal::SIGHUP);
        let d = d.clone();
        let reloaded = tokio::task::spawn_blocking(move || {
            robota_e2e::poll_until_blocking(
                Duration::from_secs(20),
                Duration::from_millis(20),
                || d.status().generation >= k,
            )
        })
        .await
        .expect("status poll");
        assert!(reloaded, "reload {k} did not complete");
    }
    done.store(true, Ordering::Relaxed);
    for c in clients {
        c.await.expect("client");
    }
    let failures = failures.lock().unwrap().clone();
    let answered = answered.load(Ordering::Relaxed);
    eprintln!("{answered} requests answered across {RELOADS} reloads");
    assert!(
        answered > RELOADS * 8,
        "too few requests to tell: {answered}"
    );
    assert!(
        failures.is_empty(),
        "{} of {} requests failed across {RELOADS} reloads: {failures:?}",
        failures.len(),
        answered + failures.len() as u64
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_keeps_the_bearers_unless_loopback_changed() {
    let d = Daemon::start("");
    let original = std::fs::read_to_string(d.config_path()).expect("config");
    let host = d.bearer();
    let ci = d.bearer_labeled("ci");
    let generation = d.status().generation;

    // A change elsewhere: the same bearers go on working.
    write_config(
        &d,
        &format!("{original}\n[session]\nsubmission_tool = \"host_submit\"\n"),
    );
    let out = d.ctl_ok(&["reload"]);
    assert!(
        out.stdout.contains("the host bearer is kept"),
        "{}",
        out.stdout
    );
    let after = d.refresh_addrs();
    assert_eq!(after.generation, generation + 1);
    assert_eq!(after.submission_tool, "host_submit");
    for (bearer, which) in [(&host, "host"), (&ci, "labelled without a lifetime")] {
        let (status, names) = list(&d, bearer).await;
        assert_eq!(status, 200, "the {which} bearer after a reload");
        assert!(names.iter().any(|n| n == "host_submit"), "{names:?}");
    }
    assert_eq!(d.bearer(), host, "bearer issue prints the same host bearer");

    // A refused file: `reload` exits 78 with every problem; the bearers stay.
    write_config(&d, "[loopback\n");
    let out = d.ctl(&["reload"]);
    out.expect_code(EXIT_CONFIG, "reload of a file that is not TOML");
    assert!(out.stderr.contains("invalid-config"), "{}", out.stderr);
    assert_eq!(list(&d, &host).await.0, 200);

    // [loopback] changed: a new host bearer, and the labelled bearer without a lifetime ends.
    write_config(
        &d,
        &original.replacen("[loopback]\n", "[loopback]\nwire_names = \"compat\"\n", 1),
    );
    let out = d.ctl_ok(&["--json", "reload"]);
    let reply: serde_json::Value = serde_json::from_str(&out.stdout).expect("JSON");
    assert_eq!(reply["host_bearer_kept"], false, "{reply}");
    d.refresh_addrs();
    assert_eq!(list(&d, &host).await.0, 401, "the old host bearer");
    assert_eq!(
        list(&d, &ci).await.0,
        401,
        "the labelled bearer without a lifetime"
    );
    let fresh = d.bearer();
    assert_ne!(fresh, host);
    assert_eq!(list(&d, &fresh).await.0, 200);

    // `restart` with nothing changed: still a new host bearer.
    d.ctl_ok(&["restart"]);
    d.refresh_addrs();
    assert_eq!(
        list(&d, &fresh).await.0,
        401,
        "the host bearer after restart"
    );
    d.assert_no_secrets();
}
