//! Downstream MCP servers through the real daemon: the official Python SDK's server over
//! stdio and over Streamable HTTP, our rmcp server (shared and per-call children, a unix
//! socket backend), and a misbehaving double (crash mid-call, hang, garbage, flood, an
//! answer over the limit, a changed tool list that collides, a child left behind), and
//! collisions an upstream lists, which refuse their names and nothing else. Each
//! test owns its daemon and its servers.

use std::time::Duration;

use nix::sys::signal::Signal;
use robota_e2e::mcp::McpClient;
use robota_e2e::procs::{alive, children, peak_rss_kib};
use robota_e2e::upstream::{
    HttpServer, fixture_command, read_paths_with, sdk_stdio_argv, sdk_stdio_command, toml_array,
};
use robota_e2e::{Daemon, metric_sum, poll_until, poll_until_blocking, within};
use robota_proto::UpstreamStatus;
use serde_json::{Value, json};

const LIMIT: Duration = Duration::from_secs(30);

/// Every bearer may call every tool of the upstreams named `names`.
fn allow(names: &[&str]) -> String {
    let tools: Vec<String> = names.iter().map(|n| format!("{n}.*")).collect();
    format!(
        "[[policy]]\ncallers = [\"bearer:*\"]\ntools = {}\ndecision = \"allow\"\n",
        toml_array(&tools)
    )
}

fn upstream(d: &Daemon, name: &str) -> UpstreamStatus {
    let out = d.ctl_ok(&["--json", "upstreams"]);
    let v: Value = serde_json::from_str(&out.stdout).expect("upstreams JSON");
    let list: Vec<UpstreamStatus> =
        serde_json::from_value(v["upstreams"].clone()).expect("upstreams list");
    list.into_iter()
        .find(|u| u.name == name)
        .unwrap_or_else(|| panic!("no upstream {name} in {}", out.stdout))
}

fn wait_state(d: &Daemon, name: &str, state: &str) -> UpstreamStatus {
    let mut last = None;
    let reached = poll_until_blocking(LIMIT, Duration::from_millis(100), || {
        let u = upstream(d, name);
        let ok = u.state == state;
        last = Some(u);
        ok
    });
    let last = last.expect("polled once");
    assert!(reached, "{name} never became {state}: {last:?}");
    last
}

/// Lists through `client`: canonical name → the tool's `_meta`.
async fn listed(client: &McpClient) -> serde_json::Map<String, Value> {
    let tools = within(LIMIT, "tools/list", client.peer().list_all_tools())
        .await
        .expect("tools/list");
    tools
        .into_iter()
        .map(|t| {
            let meta = t.meta.map_or(Value::Null, |m| json!(m.0));
            (t.name.to_string(), meta)
        })
        .collect()
}

/// The hostile upstream: a stdio server (the official Python SDK) that tries every way out
/// of its confinement and reports each — the daemon's state, configuration and runtime
/// directories and a secret file it reads, all beneath a directory the operator let the
/// upstream read, the secret's directory also bound at a second place and beneath itself,
/// linked to from within, and an overlay's layer; writing there; TCP out and in;
/// signalling the daemon; its environment.
/// Each is denied by the kernel, while what it was allowed to read stays readable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_confined_upstream_reaches_nothing_of_the_daemons() {
    use std::os::unix::fs::PermissionsExt;
    let secrets = tempfile::tempdir().expect("a directory");
    let bearer = secrets.path().join("web.bearer");
    std::fs::write(&bearer, "bearer-of-web-kept-from-upstreams\n").expect("the bearer");
    std::fs::set_permissions(&bearer, std::fs::Permissions::from_mode(0o600)).expect("0600");
    let public = secrets.path().join("public.txt");
    std::fs::write(&public, "readable").expect("a readable file");
    // The same directory bound at a second place, as an operator's mount can make it:
    // what is kept there is kept through that one too.
    let alias = tempfile::tempdir().expect("a directory");
    let _bound = Mounted::bind(secrets.path(), alias.path());
    // Bound beneath itself too, so that it holds itself; and a link to it inside it.
    let looped = secrets.path().join("loop");
    std::fs::create_dir(&looped).expect("a directory");
    let _looped = Mounted::bind(secrets.path(), &looped);
    std::os::unix::fs::symlink(secrets.path(), secrets.path().join("self-link")).expect("a link");
    // And the lower layer of an overlay, named by a path relative to where it was mounted.
    let layers = tempfile::tempdir().expect("a directory");
    for dir in ["upper", "work", "at"] {
        std::fs::create_dir(layers.path().join(dir)).expect("a directory");
    }
    let lower = secrets.path().file_name().expect("a name").to_owned();
    let options = format!(
        "lowerdir={},upperdir={},workdir={}",
        lower.to_string_lossy(),
        layers.path().join("upper").display(),
        layers.path().join("work").display()
    );
    let overlay = layers.path().join("at");
    let _overlay = Mounted::new(
        &[
            "-t".as_ref(),
            "overlay".as_ref(),
            "overlay".as_ref(),
            "-o".as_ref(),
            options.as_ref(),
        ],
        secrets.path().parent().expect("a parent"),
        &overlay,
    );
    // The daemon's own directory and the secrets are beneath the temporary directory,
    // which this upstream may read.
    let tmp = std::env::temp_dir();
    let d = Daemon::start(&format!(
        "[upstreams.py]\ncommand = {}\n{}\n\n[upstreams.web]\nurl = \"http://127.0.0.1:9/mcp\"\nbearer_file = {:?}\nrestart = {{ initial = \"30s\", max = \"60s\" }}\n\n{}",
        sdk_stdio_argv(),
        read_paths_with(&[&tmp]),
        bearer.display().to_string(),
        allow(&["py"])
    ));
    wait_state(&d, "py", "up");
    let state_files: Vec<String> = std::fs::read_dir(d.state_dir())
        .expect("the state directory")
        .flatten()
        .filter(|e| e.path().is_file())
        .map(|e| e.path().display().to_string())
        .collect();
    assert!(
        !state_files.is_empty(),
        "the daemon keeps files in its state directory"
    );
    let show = |p: &std::path::Path| p.display().to_string();
    let mut read = state_files.clone();
    read.extend([
        show(d.config_path()),
        show(&bearer),
        show(&alias.path().join("web.bearer")),
        show(&looped.join("web.bearer")),
        show(&secrets.path().join("self-link/web.bearer")),
        show(&overlay.join("web.bearer")),
        show(&public),
        "/etc/passwd".into(),
    ]);
    let dirs = [show(d.state_dir()), show(&d.runtime_dir())];
    let mut write = dirs.to_vec();
    write.extend([show(secrets.path()), show(alias.path()), show(&tmp)]);
    let client = McpClient::connect(&d, &d.bearer()).await;
    let result = client
        .call(
            "py.escape",
            json!({
                "read": read,
                "listing": dirs,
                "write": write,
                "port": d.loopback_port(),
                "pid": d.pid(),
                "control": show(d.socket_path()),
                "chmod": [show(d.state_dir()), show(&bearer)],
            }),
        )
        .await;
    assert!(!result.is_error, "{result:?}");
    let report = result
        .structured
        .get("result")
        .cloned()
        .unwrap_or(result.structured.clone());
    let report = report
        .as_object()
        .unwrap_or_else(|| panic!("a report: {result:?}"));
    let allowed = [
        format!("read {}", show(&public)),
        "read /etc/passwd".to_owned(),
    ];
    for (attempt, outcome) in report {
        let outcome = outcome.as_str().unwrap_or_default();
        // The test daemon runs as root: its /proc directories belong to the upstream's
        // own uid, so only their mode bits stand (the packaged unit's test denies it).
        if attempt == "list the daemon's descriptors" {
            continue;
        }
        if allowed.contains(attempt) {
            assert_eq!(
                outcome, "allowed",
                "{attempt}: the view the upstream was given"
            );
        } else {
            assert!(
                outcome.starts_with("denied"),
                "{attempt}: {outcome} ({report:?})"
            );
        }
    }
    assert_eq!(
        report.len(),
        read.len() + dirs.len() + write.len() + 2 + 15 + 4,
        "{report:?}"
    );
    // Refused by the mechanism meant for them: the daemon's look at its peer (which
    // fails closed when the connecting process is gone), and the system-call filter
    // (clone3, whose CLONE_INTO_CGROUP Landlock does not govern).
    assert_eq!(
        report["use the control socket from an exited child"],
        "denied (EACCES)"
    );
    assert_eq!(
        report["start a process in the daemon's cgroup"],
        "denied (ENOSYS)"
    );
    assert!(!secrets.path().join("planted-by-upstream").exists());
    assert!(!d.state_dir().join("planted-by-upstream").exists());
    client.close().await;
}

/// A mount made by `mount` (so the test runs as root) at `at`, until dropped.
struct Mounted(std::path::PathBuf);

impl Mounted {
    fn new(args: &[&std::ffi::OsStr], cwd: &std::path::Path, at: &std::path::Path) -> Self {
        let status = std::process::Command::new("mount")
            .args(args)
            .arg(at)
            .current_dir(cwd)
            .status()
            .expect("mount");
        assert!(status.success(), "mount {args:?} {at:?}: {status}");
        Self(at.to_owned())
    }

    /// `from` bound at `to`.
    fn bind(from: &std::path::Path, to: &std::path::Path) -> Self {
        Self::new(
            &["--bind".as_ref(), from.as_os_str()],
            std::path::Path::new("/"),
            to,
        )
    }
}

impl Drop for Mounted {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg("--lazy")
            .arg(&self.0)
            .status();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_sdk_over_stdio_is_imported_called_and_denied_by_default() {
    let d = Daemon::start(&format!(
        "[upstreams.py]\ncommand = {}\n\n[[policy]]\ncallers = [\"bearer:*\"]\ntools = [\"py.add\"]\ndecision = \"allow\"\n",
        sdk_stdio_command()
    ));
    let u = wait_state(&d, "py", "up");
    assert_eq!(u.kind, "stdio");
    assert_eq!(
        u.tools,
        [
            "py.add",
            "py.count",
            "py.echo",
            "py.escape",
            "py.nap",
            "py.tagged"
        ],
        "{u:?}"
    );
    let client = McpClient::connect(&d, &d.bearer()).await;
    let tools = listed(&client).await;
    assert_eq!(
        tools["py.add"]["io.robota/upstream"],
        json!({"name": "py", "tool": "add"}),
        "{tools:?}"
    );
    assert!(tools.contains_key("system.info"), "first-party tools stay");
    let sum = client.call("py.add", json!({"a": 2, "b": 40})).await;
    assert!(!sum.is_error, "{sum:?}");
    assert!(
        sum.text.contains("42") || sum.structured.to_string().contains("42"),
        "{sum:?}"
    );
    // No rule allows py.echo: imported tools are denied unless a rule allows them,
    // whatever the upstream's annotations.
    client
        .call("py.echo", json!({"text": "hi"}))
        .await
        .err("permission_denied", "py.echo without a rule");
    // The upstream validates the arguments.
    let bad = client.call("py.add", json!({"a": "two"})).await;
    assert!(bad.is_error, "{bad:?}");
    let metrics = d.metrics_text().expect("metrics");
    assert_eq!(
        metric_sum(&metrics, &["robota_mcpd_upstream_up{", "upstream=\"py\""]),
        1.0,
        "{metrics}"
    );
    assert!(
        metric_sum(
            &metrics,
            &[
                "robota_mcpd_tool_calls_total{",
                "tool=\"py.add\"",
                "outcome=\"ok\""
            ]
        ) >= 1.0,
        "{metrics}"
    );
    client.close().await;
    d.assert_no_secrets();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_sdk_over_streamable_http_with_both_revisions() {
    let server = HttpServer::sdk();
    let d = Daemon::start(&format!(
        "[upstreams.web]\nurl = \"{}\"\n\n{}",
        server.url(),
        allow(&["web"])
    ));
    let u = wait_state(&d, "web", "up");
    assert_eq!(u.kind, "http");
    assert!(u.tools.contains(&"web.echo".to_owned()), "{u:?}");
    for client in [
        McpClient::connect(&d, &d.bearer()).await,
        McpClient::connect_with_tasks(&d, &d.bearer()).await,
    ] {
        let echo = client.call("web.echo", json!({"text": "über"})).await;
        assert!(!echo.is_error, "{echo:?}");
        assert!(echo.text.contains("über"), "{echo:?}");
        client.close().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_call_children_leave_no_process_behind() {
    let d = Daemon::start(&format!(
        "[upstreams.rm]\ncommand = {}\nchildren = \"per-call\"\n\n{}",
        fixture_command(&["rmcp-stdio"]),
        allow(&["rm"])
    ));
    let u = wait_state(&d, "rm", "up");
    assert_eq!(u.children.as_deref(), Some("per-call"));
    let client = McpClient::connect(&d, &d.bearer()).await;
    let mut pids = Vec::new();
    for _ in 0..2 {
        let r = client.call("rm.pid", json!({})).await.ok("rm.pid");
        let pid = r["pid"].as_i64().expect("pid") as i32;
        assert!(
            poll_until(LIMIT, Duration::from_millis(20), || !alive(pid)).await,
            "the per-call child {pid} outlived its call"
        );
        pids.push(pid);
    }
    assert_ne!(pids[0], pids[1], "each call gets its own child");
    client.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rmcp_server_on_a_unix_socket_backend() {
    let dir = tempfile::tempdir().expect("tempdir");
    let sock = dir.path().join("rmcp.sock");
    let _server = HttpServer::rmcp(Some(&sock));
    let d = Daemon::start(&format!(
        "[upstreams.sock]\nurl = \"unix:{}\"\n\n{}",
        sock.display(),
        allow(&["sock"])
    ));
    wait_state(&d, "sock", "up");
    let client = McpClient::connect_with_tasks(&d, &d.bearer()).await;
    let r = client.call("sock.add", json!({"a": 1, "b": 2})).await;
    assert!(!r.is_error, "{r:?}");
    client.close().await;
}

/// The rogue double over stdio, with `extra` keys in its table.
fn rogue(extra: &str) -> Daemon {
    Daemon::start(&format!(
        "[upstreams.rogue]\ncommand = {}\ncall_timeout = \"2s\"\nresponse_limit = \"1MiB\"\nrestart = {{ initial = \"100ms\", max = \"1s\" }}\n{extra}\n\n{}",
        fixture_command(&["rogue"]),
        allow(&["rogue"])
    ))
}

/// How the daemon names a directory of uid 65534's above a path it keeps from upstreams.
fn could_replace(theirs: &std::path::Path, kept: &std::path::Path) -> String {
    format!(
        "{} is owned by uid 65534, who could replace {}",
        theirs.display(),
        kept.display()
    )
}

/// A directory above the daemon's state that another user owns: that user could move the
/// state aside while an upstream starts, to where the upstream is granted, and the state
/// would be granted whole there (the attack that found it: 12 reads of the store in 120
/// restarts). No confined upstream starts then, and the reason names the directory and
/// its owner; `check-config` warns about it beforehand.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_confined_upstream_starts_while_another_user_could_move_the_state_into_its_reach() {
    let dir = tempfile::tempdir().expect("a directory");
    let theirs = dir.path().join("theirs");
    std::fs::create_dir(&theirs).expect("a directory");
    // uid 65534 stands for any user but root and the daemon's.
    nix::unistd::chown(&theirs, Some(nix::unistd::Uid::from_raw(65534)), None).expect("chown");
    let state = theirs.join("state");
    let upstream = format!(
        "[upstreams.rogue]\ncommand = {}\nwrite_paths = [\"{}\"]\nrestart = {{ initial = \"100ms\", max = \"1s\" }}\n\n{}",
        fixture_command(&["rogue"]),
        theirs.display(),
        allow(&["rogue"])
    );
    let named = could_replace(&theirs, &state);
    let text = Daemon::builder()
        .state_dir(&state)
        .extra(&upstream)
        .config_text(dir.path());
    let path = dir.path().join("config.toml");
    std::fs::write(&path, text).expect("write config");
    let out = robota_e2e::daemon::check_config(&path);
    out.expect_code(
        0,
        "check-config with the state beneath another user's directory",
    );
    assert!(
        out.stderr.contains("no confined upstream will start") && out.stderr.contains(&named),
        "{}",
        out.stderr
    );

    let d = Daemon::builder().state_dir(&state).extra(&upstream).start();
    let refused = wait_state(&d, "rogue", "backoff");
    let error = refused.last_error.unwrap_or_default();
    // Said once: the handshake's steps each failed only because the launcher refused.
    assert_eq!(error.matches(&named).count(), 1, "{error}");
    assert!(
        error.starts_with("the child ended during the handshake: its process exited"),
        "{error}"
    );
    // Once the directory is root's, the upstream starts.
    nix::unistd::chown(&theirs, Some(nix::unistd::Uid::from_raw(0)), None).expect("chown");
    wait_state(&d, "rogue", "up");
}

/// The same with a child per call: the upstream came up while the directory was root's;
/// once another user owns it, a call's child is refused by the launcher, the call is
/// answered as not sent, and the upstream backs off with the reason (said once) instead
/// of showing `up` with the reason only in the log.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_per_call_child_the_launcher_refuses_backs_the_upstream_off_with_the_reason() {
    let dir = tempfile::tempdir().expect("a directory");
    let theirs = dir.path().join("theirs");
    std::fs::create_dir(&theirs).expect("a directory");
    let state = theirs.join("state");
    let config = format!(
        "[upstreams.rogue]\ncommand = {}\nchildren = \"per-call\"\nrestart = {{ initial = \"100ms\", max = \"1s\" }}\n\n{}",
        fixture_command(&["rogue"]),
        allow(&["rogue"])
    );
    let d = Daemon::builder().state_dir(&state).extra(&config).start();
    wait_state(&d, "rogue", "up");
    let client = McpClient::connect(&d, &d.bearer()).await;
    client
        .call("rogue.echo", json!({"text": "before"}))
        .await
        .ok("a call while the directory is root's");

    nix::unistd::chown(&theirs, Some(nix::unistd::Uid::from_raw(65534)), None).expect("chown");
    let refused = client.call("rogue.echo", json!({"text": "after"})).await;
    assert!(refused.is_error, "{refused:?}");
    let named = could_replace(&theirs, &state);
    let backoff = wait_state(&d, "rogue", "backoff");
    let mut last = backoff.last_error;
    let said = poll_until_blocking(LIMIT, Duration::from_millis(100), || {
        last = upstream(&d, "rogue").last_error;
        last.as_deref()
            .is_some_and(|error| error.matches(&named).count() == 1)
    });
    assert!(said, "the upstream's last error: {last:?}");

    nix::unistd::chown(&theirs, Some(nix::unistd::Uid::from_raw(0)), None).expect("chown");
    wait_state(&d, "rogue", "up");
    client
        .call("rogue.echo", json!({"text": "again"}))
        .await
        .ok("a call once the directory is root's again");
    client.close().await;
}

/// An upstream that announces a new tool list without end is read at most once a second:
/// 150 announcements over 3 s cost a few listings (and catalog rebuilds, and log lines),
/// not one each — and the last announcement is still read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_announcing_new_tool_lists_without_end_is_read_once_a_second() {
    let d = rogue("pin = false\n");
    wait_state(&d, "rogue", "up");
    let client = McpClient::connect(&d, &d.bearer()).await;
    let counts = || async {
        let c = client.call("rogue.lists", json!({})).await.ok("lists");
        (
            c["lists"].as_u64().unwrap(),
            c["announced"].as_u64().unwrap(),
        )
    };
    let (before, _) = counts().await;
    let started = std::time::Instant::now();
    client
        .call("rogue.announce", json!({"count": 150, "every_ms": 20}))
        .await
        .ok("announce");
    let seen = std::cell::Cell::new((before, 0));
    let done = robota_e2e::poll_until_async(LIMIT, Duration::from_millis(200), || async {
        seen.set(counts().await);
        seen.get().1 == 150
    })
    .await;
    assert!(done, "the announcements did not end: {:?}", seen.get());
    let took = started.elapsed().as_secs_f64();
    // Whatever was announced after the last listing is read within a second: the count
    // settles (unchanged for 1.5 s) soon after.
    let last = std::cell::Cell::new((seen.get().0, std::time::Instant::now()));
    let settled = robota_e2e::poll_until_async(LIMIT, Duration::from_millis(100), || async {
        let now = counts().await.0;
        if now != last.get().0 {
            last.set((now, std::time::Instant::now()));
        }
        last.get().1.elapsed() >= Duration::from_millis(1500)
    })
    .await;
    let last = last.get().0;
    assert!(settled, "the listings never settled: {last}");
    let read = last - before;
    assert!(
        read >= 2 && (read as f64) <= took + 3.0,
        "{read} listings for 150 announcements over {took:.1} s"
    );
    assert_eq!(upstream(&d, "rogue").state, "up");
    client.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_mid_call_is_outcome_unknown_and_the_child_comes_back() {
    let d = rogue("");
    wait_state(&d, "rogue", "up");
    let client = McpClient::connect(&d, &d.bearer()).await;
    let first = client.call("rogue.pid", json!({})).await.ok("pid")["pid"]
        .as_i64()
        .expect("pid");
    let msg = client
        .call("rogue.crash", json!({}))
        .await
        .err("outcome_unknown", "a crash mid-call");
    assert!(msg.contains("rogue"), "{msg}");
    assert!(
        poll_until(LIMIT, Duration::from_millis(50), || upstream(&d, "rogue")
            .restarts
            >= 1
            && upstream(&d, "rogue").state == "up")
        .await,
        "not restarted: {:?}",
        upstream(&d, "rogue")
    );
    let second = client.call("rogue.pid", json!({})).await.ok("pid again")["pid"]
        .as_i64()
        .expect("pid");
    assert_ne!(first, second, "a new child");
    let metrics = d.metrics_text().expect("metrics");
    assert!(
        metric_sum(
            &metrics,
            &["robota_mcpd_upstream_restarts_total{", "upstream=\"rogue\""]
        ) >= 1.0,
        "{metrics}"
    );
    assert!(
        metric_sum(
            &metrics,
            &[
                "tool_calls_total{",
                "tool=\"rogue.crash\"",
                "outcome=\"outcome_unknown\""
            ]
        ) >= 1.0,
        "{metrics}"
    );
    client.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hang_times_out_and_garbage_floods_and_huge_answers_are_bounded() {
    let d = rogue("");
    wait_state(&d, "rogue", "up");
    let client = McpClient::connect(&d, &d.bearer()).await;
    client
        .call("rogue.hang", json!({}))
        .await
        .err("timed_out", "a hanging upstream");
    // Still serving after the time-out.
    client.call("rogue.echo", json!({"a": 1})).await.ok("echo");
    client
        .call("rogue.huge", json!({}))
        .await
        .err("result_too_large", "2 MiB over a 1 MiB limit");
    let flood = client.call("rogue.flood", json!({})).await;
    assert!(flood.is_error, "4 MiB without a newline: {flood:?}");
    let garbage = client.call("rogue.garbage", json!({})).await;
    assert!(garbage.is_error, "{garbage:?}");
    // The daemon is still fine, and the double answers again once it is back.
    assert!(
        poll_until_async_ok(&client).await,
        "rogue.echo never answered again: {:?}",
        upstream(&d, "rogue")
    );
    let status = d.status();
    assert_eq!(status.state, "serving");
    client.close().await;
}

/// Answers and tool lists built to take far more memory parsed than as text — a few
/// megabytes of `0,0,0,…` — are parsed only within `[limits] upstream_memory` (the
/// defaults here): an answer the budget cannot hold is `result_too_large`, a list is
/// refused and the old one kept, and the upstream goes on. Without the budget, the answer
/// alone took ~400 MB and 64 such pages gigabytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_an_upstream_sends_is_parsed_within_the_memory_budget() {
    let d = Daemon::start(&format!(
        "[upstreams.rogue]\ncommand = {}\ncall_timeout = \"30s\"\nconnect_timeout = \"30s\"\npin = false\n\n{}",
        fixture_command(&["rogue"]),
        allow(&["rogue"])
    ));
    wait_state(&d, "rogue", "up");
    let client = McpClient::connect(&d, &d.bearer()).await;
    client.call("rogue.echo", json!({})).await.ok("echo");
    let before = peak_rss_kib(d.pid());
    // 4.8 MB, under the 8 MiB response limit; ~485 MB by the budget's count.
    let dense = client
        .call("rogue.dense", json!({"values": 2_400_000}))
        .await
        .err("result_too_large", "an answer of 2.4M values");
    assert!(dense.contains("upstream_memory"), "{dense}");
    client.call("rogue.echo", json!({})).await.ok("echo after");
    // A schema of 2.4M values in a new list: refused, the old list served.
    let refused_lists = |d: &Daemon| {
        d.stderr_text()
            .lines()
            .filter(|l| l.contains("keeping the old one") && l.contains("upstream_memory"))
            .count()
    };
    client
        .call("rogue.amplify", json!({"values": 2_400_000}))
        .await
        .ok("amplify");
    assert!(
        poll_until_blocking(LIMIT, Duration::from_millis(100), || refused_lists(&d) >= 1),
        "the list was not refused: {}",
        d.stderr_text()
    );
    // 64 pages of 7.5 MB of text each (few values): the whole list is over the budget.
    client
        .call("rogue.amplify", json!({"pages": 64, "text": 7_500_000}))
        .await
        .ok("amplify pages");
    assert!(
        poll_until_blocking(LIMIT, Duration::from_millis(100), || refused_lists(&d) >= 2),
        "the 64 pages were not refused: {}",
        d.stderr_text()
    );
    let tools = listed(&client).await;
    assert!(tools.contains_key("rogue.echo"), "{tools:?}");
    assert!(!tools.keys().any(|t| t.contains("bulk")), "{tools:?}");
    client
        .call("rogue.echo", json!({}))
        .await
        .ok("echo after the lists");
    // A list within the budget is taken.
    client
        .call("rogue.amplify", json!({"pages": 2, "values": 100_000}))
        .await
        .ok("amplify within the budget");
    assert!(
        robota_e2e::poll_until_async(LIMIT, Duration::from_millis(100), || async {
            listed(&client).await.contains_key("rogue.bulk1")
        })
        .await,
        "a list within the budget was not taken"
    );
    let grew = peak_rss_kib(d.pid()).saturating_sub(before);
    eprintln!("the daemon's peak resident set grew by {} MiB", grew / 1024);
    // The budget is 256 MiB; what parsing takes stays within it.
    assert!(
        grew < 384 * 1024,
        "the daemon's peak grew by {} MiB",
        grew / 1024
    );
    client.close().await;
}

/// A Node.js server from npm — the MCP project's filesystem server, pinned — runs
/// confined behind the daemon: V8's JIT works (the daemon's W^X is not inherited), it
/// reads and writes the directory it is configured for, and when it is told to serve the
/// daemon's own directory too, the kernel answers it `EACCES`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_server_from_npm_runs_confined() {
    let (node, script, modules) = robota_e2e::upstream::npm_server("server-filesystem");
    let files = tempfile::tempdir().expect("a directory");
    let hello = files.path().join("hello.txt");
    std::fs::write(&hello, "hello from the host").expect("a file");
    let tmp = std::env::temp_dir();
    let show = |p: &std::path::Path| p.display().to_string();
    // It is told it may serve all of the temporary directory, where the daemon lives.
    let d = Daemon::start(&format!(
        "[upstreams.fs]\ncommand = {}\nwrite_paths = {}\n{}\n\n{}",
        toml_array(&[show(&node), show(&script), show(files.path()), show(&tmp)]),
        toml_array(&[show(files.path())]),
        read_paths_with(&[&modules]),
        allow(&["fs"])
    ));
    wait_state(&d, "fs", "up");
    let client = McpClient::connect(&d, &d.bearer()).await;
    let read = client
        .call("fs.read_text_file", json!({"path": show(&hello)}))
        .await;
    assert!(!read.is_error, "{read:?}");
    assert!(read.text.contains("hello from the host"), "{read:?}");
    let written = files.path().join("new.txt");
    let write = client
        .call(
            "fs.write_file",
            json!({"path": show(&written), "content": "written by node"}),
        )
        .await;
    assert!(!write.is_error, "{write:?}");
    assert_eq!(
        std::fs::read_to_string(&written).expect("the file it wrote"),
        "written by node"
    );
    let audit = d.state_dir().join("audit.jsonl");
    for (tool, path) in [
        ("fs.read_text_file", show(&audit)),
        ("fs.list_directory", show(d.state_dir())),
    ] {
        let denied = client.call(tool, json!({"path": path})).await;
        assert!(
            denied.is_error && denied.text.contains("EACCES"),
            "{tool} {path}: {denied:?}"
        );
    }
    client.close().await;
}

fn audited(d: &Daemon, reason: &str) -> Vec<Value> {
    let out = d.ctl_ok(&["--json", "audit", "--reason", reason]);
    out.stdout
        .lines()
        .map(|line| serde_json::from_str(line).expect("an audit record as JSON"))
        .collect()
}

/// Pinned tool surfaces: the first listing is trusted and kept; a changed one is held
/// (new tools not served, removed ones shown), shown by `upstreams diff`, counted by the
/// drift gauge and audited, until `upstreams approve` of the surface reviewed. The
/// approval and the executable's fingerprint outlive the daemon: with the executable
/// changed in place (its modification time set back), every tool is held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_tool_surface_is_held_until_the_operator_approves_it() {
    let dir = tempfile::tempdir().expect("a directory");
    // The executable is a script (a running binary cannot be written in place), with a
    // build number a later build changes in place.
    let exe = dir.path().join("rogue-server");
    {
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::write(
            &exe,
            format!(
                "#!/bin/sh\nexec {} rogue \"$@\"\n# build 0\n",
                robota_e2e::upstream::fixture_bin().display()
            ),
        )
        .expect("the script");
        std::fs::set_permissions(&exe, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    }
    let state = dir.path().join("state");
    std::fs::create_dir(&state).expect("a state directory");
    let config = format!(
        "[upstreams.rogue]\ncommand = {}\n{}\n\n{}",
        toml_array(&[exe.display().to_string()]),
        robota_e2e::upstream::read_paths(),
        allow(&["rogue"])
    );
    let d = Daemon::builder().state_dir(&state).extra(&config).start();
    wait_state(&d, "rogue", "up");
    let first = upstream(&d, "rogue");
    assert!(!first.drift, "{first:?}");
    let surface = first.surface.clone().expect("a surface digest");
    assert!(state.join("upstreams/rogue.pin.json").is_file());
    let pinned = audited(&d, "upstream-pinned");
    assert_eq!(pinned.len(), 1, "{pinned:?}");
    assert_eq!(pinned[0]["upstream"]["surface"], surface.as_str());

    // The list changes: `said` and `run.query` are new, `change` is gone.
    let client = McpClient::connect(&d, &d.bearer()).await;
    client.call("rogue.change", json!({})).await.ok("change");
    assert!(
        poll_until_blocking(LIMIT, Duration::from_millis(100), || upstream(&d, "rogue")
            .drift),
        "no drift: {:?}",
        upstream(&d, "rogue")
    );
    let held = upstream(&d, "rogue");
    let reason = |tool: &str| {
        held.refused
            .iter()
            .find(|r| r.tool == tool)
            .map(|r| r.reason.clone())
            .unwrap_or_default()
    };
    assert!(reason("said").contains("held until approved"), "{held:?}");
    assert!(reason("change").contains("no longer listed"), "{held:?}");
    let tools = listed(&client).await;
    assert!(tools.contains_key("rogue.echo"), "{tools:?}");
    assert!(!tools.contains_key("rogue.said"), "{tools:?}");
    assert!(client.call("rogue.said", json!({})).await.is_error);
    client
        .call("rogue.echo", json!({}))
        .await
        .ok("an unchanged tool");
    let metrics = d.metrics_text().expect("metrics");
    assert_eq!(
        metric_sum(
            &metrics,
            &["robota_mcpd_upstream_drift{", "upstream=\"rogue\""]
        ),
        1.0,
        "{metrics}"
    );
    let diff = d.ctl_ok(&["upstreams", "diff", "rogue"]).stdout;
    assert!(diff.contains("added   said"), "{diff}");
    assert!(diff.contains("removed change"), "{diff}");
    assert!(
        diff.contains("approve with: robota-mcpctl upstreams approve rogue"),
        "{diff}"
    );
    assert_eq!(audited(&d, "upstream-drift").len(), 1);

    // What the operator did not review is not approved: the surface first pinned is not
    // the one listed now.
    let stale = d.ctl(&["upstreams", "approve", "rogue", &surface]);
    assert_eq!(stale.code(), Some(1), "{stale:?}");
    assert!(stale.stderr.contains("nothing was approved"), "{stale:?}");
    assert!(upstream(&d, "rogue").drift);
    // Approved as reviewed: served, the gauge back to 0, the approval audited with who.
    let reviewed = held.surface.clone().expect("the current surface");
    assert!(
        diff.contains(&format!("approve rogue {reviewed}")),
        "{diff}"
    );
    let approved = d
        .ctl_ok(&["upstreams", "approve", "rogue", &reviewed])
        .stdout;
    assert!(approved.contains("approved"), "{approved}");
    let now = upstream(&d, "rogue");
    assert!(
        !now.drift && now.tools.contains(&"rogue.said".to_owned()),
        "{now:?}"
    );
    let tools = listed(&client).await;
    assert!(tools.contains_key("rogue.said"), "{tools:?}");
    client
        .call("rogue.said", json!({"x": 1}))
        .await
        .ok("an approved tool");
    let approvals = audited(&d, "upstream-approved");
    assert_eq!(approvals.len(), 1, "{approvals:?}");
    assert!(
        approvals[0]["upstream"]["by"]
            .as_str()
            .is_some_and(|by| by.starts_with("local:")),
        "{approvals:?}"
    );
    let metrics = d.metrics_text().expect("metrics");
    assert_eq!(
        metric_sum(
            &metrics,
            &["robota_mcpd_upstream_drift{", "upstream=\"rogue\""]
        ),
        0.0
    );
    client.close().await;

    // Another build of the executable, written in place: same inode and size, and its
    // modification time set back. At its next start every tool is held.
    {
        use std::io::{Seek as _, SeekFrom, Write as _};
        let modified = std::fs::metadata(&exe)
            .and_then(|m| m.modified())
            .expect("mtime");
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .open(&exe)
            .expect("the executable");
        file.seek(SeekFrom::End(-2)).expect("seek");
        file.write_all(b"1").expect("a byte changed");
        file.set_modified(modified).expect("mtime set back");
    }
    d.ctl_ok(&["upstreams", "restart", "rogue"]);
    let all_held = |d: &Daemon| {
        let mut last = None;
        let held = poll_until_blocking(LIMIT, Duration::from_millis(100), || {
            let u = upstream(d, "rogue");
            let done = u.state == "up" && u.drift && u.tools.is_empty();
            last = Some(u);
            done
        });
        assert!(held, "{last:?}");
    };
    all_held(&d);
    drop(d);
    // The approval is durable: a new daemon on the same state holds them too.
    let d = Daemon::builder().state_dir(&state).extra(&config).start();
    all_held(&d);
    let out = d.ctl_ok(&["--json", "upstreams", "diff", "rogue"]).stdout;
    let diff: Value = serde_json::from_str(&out).expect("diff JSON");
    assert_eq!(diff["executable_changed"], true, "{diff}");
    assert!(
        d.ctl_ok(&["upstreams", "diff", "rogue"])
            .stdout
            .contains("the executable it starts changed"),
    );
}

async fn poll_until_async_ok(client: &McpClient) -> bool {
    robota_e2e::poll_until_async(LIMIT, Duration::from_millis(100), || async {
        !client.call("rogue.echo", json!({})).await.is_error
    })
    .await
}

/// The reason `robota-mcpctl upstreams` gives for `tool` of `name`, if it refuses it.
fn refusal(d: &Daemon, name: &str, tool: &str) -> Option<String> {
    upstream(d, name)
        .refused
        .into_iter()
        .find(|r| r.tool == tool)
        .map(|r| r.reason)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_tool_list_that_collides_refuses_both_names_and_nothing_else() {
    // `said` is aliased to `echo`: once the list changes, `rogue.echo` is claimed twice.
    let d = rogue("pin = false\n[upstreams.rogue.aliases]\nsaid = \"echo\"\n");
    wait_state(&d, "rogue", "up");
    let client = McpClient::connect(&d, &d.bearer()).await;
    assert!(listed(&client).await.contains_key("rogue.echo"));
    client.call("rogue.change", json!({})).await.ok("change");
    let refused = poll_until_blocking(LIMIT, Duration::from_millis(100), || {
        refusal(&d, "rogue", "rogue.echo").is_some()
    });
    assert!(
        refused,
        "the collision never showed: {:?}",
        upstream(&d, "rogue")
    );
    let why = refusal(&d, "rogue", "rogue.echo").unwrap_or_default();
    assert!(
        why.contains("\"echo\"") && why.contains("\"said\""),
        "{why}"
    );
    // The listing goes on answering, without the name claimed twice.
    let tools = listed(&client).await;
    assert!(!tools.contains_key("rogue.echo"), "{tools:?}");
    for name in ["rogue.pid", "rogue.run_query", "system.info"] {
        assert!(tools.contains_key(name), "{name} missing from {tools:?}");
    }
    let message = client
        .call("rogue.echo", json!({}))
        .await
        .err("unavailable", "a name claimed twice");
    assert!(message.contains("said"), "{message}");
    client.close().await;
    assert!(
        d.stderr_text()
            .contains("names refused, the rest of the catalog is served"),
        "{}",
        d.stderr_text()
    );
}

/// Lists everything but the two colliding names (compat wire names), and says why a call
/// of one is refused.
async fn serves_all_but_the_collisions(d: &Daemon) {
    let client = McpClient::connect(d, &d.bearer()).await;
    let tools = listed(&client).await;
    for name in ["system_info", "rogue_pid", "agent_pid"] {
        assert!(tools.contains_key(name), "{name} missing from {tools:?}");
    }
    for name in ["rogue_echo", "agent_submit"] {
        assert!(!tools.contains_key(name), "{name} listed: {tools:?}");
    }
    let message = client
        .call("agent_submit", json!({"prompt": "x"}))
        .await
        .err("unavailable", "a wire name claimed twice");
    assert!(message.contains("agent.submit"), "{message}");
    client.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn collisions_an_upstream_lists_never_stop_a_start_or_a_reload() {
    // Two of rogue's tools claim `rogue.echo` (`run_query` aliased to `echo`); upstream
    // `agent` offers `agent.submit`, whose compat wire name is the submission tool's.
    let d = Daemon::builder().loopback("wire_names = \"compat\"").extra(format!(
        "[upstreams.rogue]\ncommand = {rogue}\n[upstreams.rogue.aliases]\nrun_query = \"echo\"\n\
         [upstreams.agent]\ncommand = {rogue}\n[upstreams.agent.aliases]\necho = \"submit\"\n{}",
        allow(&["rogue", "agent"]),
        rogue = fixture_command(&["rogue"]),
    )).start();
    wait_state(&d, "rogue", "up");
    wait_state(&d, "agent", "up");
    serves_all_but_the_collisions(&d).await;
    assert!(refusal(&d, "rogue", "rogue.echo").is_some());
    // A reload and a restart with the same upstreams go on too.
    let from = d.notify().lines().len();
    d.signal(Signal::SIGHUP);
    d.wait_ready(from);
    assert!(d.try_exit().is_none(), "{}", d.stderr_text());
    d.ctl_ok(&["restart"]);
    assert!(d.try_exit().is_none(), "{}", d.stderr_text());
    wait_state(&d, "rogue", "up");
    serves_all_but_the_collisions(&d).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_of_the_daemon_leaves_no_child_behind() {
    // The child stays after its stdin closes: only the parent-death signal ends it.
    let d = Daemon::start(&format!(
        "[upstreams.rogue]\ncommand = {}\n\n{}",
        fixture_command(&["rogue", "--linger"]),
        allow(&["rogue"])
    ));
    wait_state(&d, "rogue", "up");
    let client = McpClient::connect(&d, &d.bearer()).await;
    let pid = client.call("rogue.pid", json!({})).await.ok("pid")["pid"]
        .as_i64()
        .expect("pid") as i32;
    assert!(alive(pid));
    client.close().await;
    d.signal(Signal::SIGKILL);
    assert!(d.wait_exit(LIMIT).is_some(), "the daemon did not die");
    assert!(
        poll_until(LIMIT, Duration::from_millis(20), || !alive(pid)).await,
        "the upstream child {pid} outlived the daemon"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_upstream_does_not_hold_back_ready_and_its_last_known_tools_answer_unavailable() {
    let state = tempfile::tempdir().expect("state dir");
    // Its connect bound is past the start bound: it is not ready in time, not failed.
    let config = |args: &[&str]| {
        format!(
            "[upstreams.slow]\ncommand = {}\nconnect_timeout = \"30s\"\n\n{}",
            fixture_command(args),
            allow(&["slow"])
        )
    };
    let first = Daemon::builder()
        .state_dir(state.path())
        .extra(config(&["rogue"]))
        .start();
    wait_state(&first, "slow", "up");
    first.ctl_ok(&["stop"]);
    assert!(
        first.wait_exit(LIMIT).is_some(),
        "the first daemon did not stop"
    );
    assert!(state.path().join("upstreams/slow.json").is_file());

    let started = std::time::Instant::now();
    let d = Daemon::builder()
        .state_dir(state.path())
        .extra(config(&["rogue", "--slow-start", "120"]))
        .start();
    assert!(
        started.elapsed() < Duration::from_secs(19),
        "READY=1 took {:?}",
        started.elapsed()
    );
    let u = upstream(&d, "slow");
    assert_eq!(u.state, "down", "{u:?}");
    assert!(u.listed_from_cache, "{u:?}");
    let client = McpClient::connect(&d, &d.bearer()).await;
    assert!(listed(&client).await.contains_key("slow.echo"));
    client
        .call("slow.echo", json!({}))
        .await
        .err("unavailable", "a known tool of an upstream that is down");
    client.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_carrier_with_compat_names_calls_an_imported_tool() {
    use robota_e2e::authz::Authz;
    use robota_e2e::http::{exchange, tool_names, tools_call, tools_list};
    use robota_e2e::remote::{PUBLIC_URL, RemoteConfig, remote_mcp};
    let (authz, keys) = Authz::with_standard_keys();
    let cfg = RemoteConfig::new(&authz).line("wire_names = \"compat\"");
    let d = cfg
        .builder()
        .extra(format!(
            "[upstreams.rm]\ncommand = {}\n\n[[policy]]\ncallers = [\"oauth:client-a/*\", \"bearer:*\"]\ntools = [\"rm.*\"]\ndecision = \"allow\"\n",
            fixture_command(&["rmcp-stdio"])
        ))
        .start();
    wait_state(&d, "rm", "up");
    let addr = d.remote_addr();
    let token = authz.token(&keys.rsa, PUBLIC_URL).build();
    let resp = exchange(addr, &remote_mcp(Some(&token), &tools_list(1))).await;
    assert_eq!(resp.status, 200, "{}", resp.describe());
    let list = resp.expect_rpc(1);
    let names = tool_names(&list);
    assert!(names.contains(&"rm_add".to_owned()), "{names:?}");
    let add = list["result"]["tools"]
        .as_array()
        .expect("tools")
        .iter()
        .find(|t| t["name"] == "rm_add")
        .expect("rm_add")
        .clone();
    assert_eq!(
        add["_meta"]["io.robota/upstream"],
        json!({"name": "rm", "tool": "add"}),
        "{add}"
    );
    let resp = exchange(
        addr,
        &remote_mcp(
            Some(&token),
            &tools_call(2, "rm_add", json!({"a": 20, "b": 22})),
        ),
    )
    .await;
    let result = resp.expect_rpc(2);
    assert_eq!(result["result"]["isError"], json!(false), "{result}");
    assert!(result["result"].to_string().contains("42"), "{result}");
    assert_eq!(
        result["result"]["_meta"]["io.robota/upstream"],
        json!({"name": "rm", "tool": "add"}),
        "{result}"
    );
    // The loopback carrier keeps canonical names.
    let client = McpClient::connect(&d, &d.bearer()).await;
    assert!(listed(&client).await.contains_key("rm.add"));
    client.close().await;
}

/// A call's event stream holds its in-flight slot until its last event: with one slot, a
/// request sent while a stream runs is answered 503, and served once it ended. A call
/// whose client went away is counted, as cancelled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_call_holds_its_in_flight_slot_and_an_abandoned_one_is_counted() {
    use robota_e2e::http::{Conn, Request, exchange, tools_call};
    let web = HttpServer::sdk();
    let d = Daemon::builder()
        .loopback("max_in_flight = 1")
        .extra(format!(
            "[upstreams.web]\nurl = \"{}\"\n\n{}",
            web.url(),
            allow(&["web"])
        ))
        .start();
    wait_state(&d, "web", "up");
    let bearer = d.bearer();
    let port = d.loopback_port();
    let ping = Request::mcp(
        port,
        Some(&bearer),
        &json!({"jsonrpc": "2.0", "id": 1, "method": "ping"}),
    );
    let streamed = |steps: u32| {
        let mut message = tools_call(2, "web.count", json!({"steps": steps, "ms": 100}));
        message["params"]["_meta"] = json!({"progressToken": 1});
        Request::mcp(port, Some(&bearer), &message).to_bytes()
    };
    let mut conn = Conn::connect(d.loopback_addr()).await.expect("connect");
    conn.write(&streamed(20)).await.expect("send the call");
    let mut head = within(LIMIT, "the stream's head", conn.read_head())
        .await
        .expect("the stream's head");
    assert!(head.is_sse(), "{}", head.describe());
    let busy = exchange(d.loopback_addr(), &ping).await;
    assert_eq!(
        busy.status,
        503,
        "while the stream runs: {}",
        busy.describe()
    );
    within(LIMIT, "the stream's end", conn.read_body(&mut head))
        .await
        .expect("the stream ends");
    assert_eq!(
        text_of(&head.messages().last().expect("the result")["result"]),
        "counted to 20"
    );
    let free = exchange(d.loopback_addr(), &ping).await;
    assert_eq!(free.status, 200, "after the stream: {}", free.describe());
    // A tool whose schema asks for an argument as a header (`x-mcp-header`): the daemon
    // sends it as `Mcp-Param-Tag` (Base64 when it is not plain ASCII), which the SDK's
    // server on 2026-07-28 requires.
    for tag in ["plain", "héllo wörld"] {
        let call = Request::mcp(
            port,
            Some(&bearer),
            &tools_call(3, "web.tagged", json!({"tag": tag})),
        );
        let answer = exchange(d.loopback_addr(), &call).await.expect_rpc(3);
        assert_eq!(text_of(&answer["result"]), format!("tag {tag}"), "{answer}");
    }
    // A client that goes away mid-stream: the call is cancelled and counted.
    let cancelled = || {
        metric_sum(
            &d.metrics_text().unwrap_or_default(),
            &["robota_mcpd_tool_calls_total", "web.count", "cancelled"],
        )
    };
    let before = cancelled();
    let mut conn = Conn::connect(d.loopback_addr()).await.expect("connect");
    conn.write(&streamed(100)).await.expect("send the call");
    let head = within(LIMIT, "the stream's head", conn.read_head())
        .await
        .expect("the stream's head");
    assert!(head.is_sse(), "{}", head.describe());
    drop(conn);
    assert!(
        poll_until(LIMIT, Duration::from_millis(50), || cancelled() > before).await,
        "the abandoned call was not counted: {:?}",
        d.metrics_text()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn results_pass_through_whole_and_cancellation_reaches_the_upstream() {
    let events = tempfile::NamedTempFile::new().expect("events file");
    let path = events.path().display().to_string();
    let d = Daemon::start(&format!(
        "[upstreams.rogue]\ncommand = {}\nwrite_paths = [{path:?}]\ncall_timeout = \"1s\"\n\n{}",
        fixture_command(&["rogue", "--events", &path]),
        allow(&["rogue"])
    ));
    wait_state(&d, "rogue", "up");
    // The raw answer: unknown fields and the upstream's `_meta` kept, ours added.
    use robota_e2e::http::{Request, tools_call};
    let bearer = d.bearer();
    let init = json!({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
        "protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}});
    let post = |body: &Value| {
        Request::new("POST", "/mcp")
            .header("Host", &d.loopback_addr().to_string())
            .header("Content-Type", "application/json")
            .header("Accept", "application/json, text/event-stream")
            .header("MCP-Protocol-Version", robota_e2e::V_2025_11_25)
            .header("Authorization", &format!("Bearer {bearer}"))
            .header("Connection", "close")
            .body(serde_json::to_vec(body).expect("json"))
    };
    let _ = robota_e2e::http::exchange(d.loopback_addr(), &post(&init)).await;
    let resp = robota_e2e::http::exchange(
        d.loopback_addr(),
        &post(&tools_call(5, "rogue.echo", json!({"x": [1, 2]}))),
    )
    .await;
    let answer = resp.expect_rpc(5);
    let result = &answer["result"];
    assert_eq!(result["x-rogue"], json!({"unknown": "kept"}), "{answer}");
    assert_eq!(result["_meta"]["rogue/trace"], json!(7), "{answer}");
    assert_eq!(
        result["_meta"]["io.robota/upstream"],
        json!({"name": "rogue", "tool": "echo"}),
        "{answer}"
    );
    assert_eq!(
        result["structuredContent"]["arguments"],
        json!({"x": [1, 2]}),
        "{answer}"
    );
    // A time-out is forwarded as `notifications/cancelled`.
    let client = McpClient::connect(&d, &bearer).await;
    client
        .call("rogue.hang", json!({}))
        .await
        .err("timed_out", "hang");
    assert!(
        poll_until(LIMIT, Duration::from_millis(50), || {
            std::fs::read_to_string(events.path()).is_ok_and(|t| t.contains("cancelled"))
        })
        .await,
        "no cancellation reached the upstream: {:?}",
        std::fs::read_to_string(events.path())
    );
    client.close().await;
}

/// A daemon with our rmcp server as its shared stdio upstream `name`, up.
fn shared_rmcp(name: &str) -> Daemon {
    let d = Daemon::start(&format!(
        "[upstreams.{name}]\ncommand = {}\n\n{}",
        fixture_command(&["rmcp-stdio"]),
        allow(&[name])
    ));
    wait_state(&d, name, "up");
    d
}

/// `rs.sleep` for `ms` called by `client`, which is closed after its answer.
fn sleeping(client: McpClient, ms: u64) -> tokio::task::JoinHandle<robota_e2e::mcp::ToolResult> {
    tokio::spawn(async move {
        let outcome = client.call("rs.sleep", json!({"ms": ms})).await;
        client.close().await;
        outcome
    })
}

/// A reload lets a call under way on a shared child finish (it was answered
/// `outcome_unknown`, the child stopped under it): the handed-over carrier serves it on
/// the old session's child, which is not started again and is stopped once the carrier
/// has ended; the new session has a child of its own, and `robota_mcpd_upstream_up` is
/// its. A stop right after a reload gives such a call its drain too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_lets_a_call_under_way_on_a_shared_child_finish() {
    let d = shared_rmcp("rs");
    let bearer = d.bearer();
    let pid_of = |v: Value| i32::try_from(v["pid"].as_u64().expect("a pid")).expect("a pid");
    let client = McpClient::connect(&d, &bearer).await;
    let old = pid_of(client.call("rs.pid", json!({})).await.ok("the child's pid"));
    let sleeper = sleeping(client, 2000);
    tokio::time::sleep(Duration::from_millis(500)).await;
    d.ctl_ok(&["reload"]);
    within(LIMIT, "the call under way", sleeper)
        .await
        .expect("the call's task")
        .ok("a call under way across a reload");
    let client = McpClient::connect(&d, &bearer).await;
    let new = pid_of(
        client
            .call("rs.pid", json!({}))
            .await
            .ok("the new child's pid"),
    );
    assert_ne!(old, new, "the new session's child is its own");
    assert!(
        poll_until(LIMIT, Duration::from_millis(50), || !alive(old)).await,
        "the old session's child was not stopped"
    );
    assert!(alive(new), "the new session's child was stopped");
    let metrics = d.metrics_text().unwrap_or_default();
    assert_eq!(
        metric_sum(&metrics, &["robota_mcpd_upstream_up", "upstream=\"rs\""]),
        1.0,
        "{metrics}"
    );
    let sleeper = sleeping(client, 1500);
    tokio::time::sleep(Duration::from_millis(300)).await;
    d.ctl_ok(&["reload"]);
    d.signal(Signal::SIGTERM);
    within(LIMIT, "the call under way at the stop", sleeper)
        .await
        .expect("the call's task")
        .ok("a call under way across a reload and a stop");
    assert!(d.wait_exit(LIMIT).is_some(), "the daemon did not stop");
    assert!(!alive(new), "the stop left the retired child behind");
}

/// A second daemon started in a running one's cgroup (its unit's, by `docker exec` or by
/// hand) fails at the control socket and leaves the running daemon's upstreams alone: it
/// took them for a former daemon's leftovers and killed them first.
#[test]
fn a_second_daemon_in_the_cgroup_leaves_the_running_ones_upstreams_alone() {
    let d = shared_rmcp("rs");
    let before = children(d.pid());
    assert!(!before.is_empty(), "the upstream's child");
    let second = d
        .cgroup()
        .command(&robota_e2e::mcpd_bin())
        .arg("--config")
        .arg(d.config_path())
        .current_dir(d.dir())
        .output()
        .expect("run a second daemon");
    let stderr = String::from_utf8_lossy(&second.stderr);
    assert_eq!(second.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("another robota-mcpd holds"), "{stderr}");
    assert_eq!(children(d.pid()), before, "the running daemon's children");
    assert_eq!(upstream(&d, "rs").restarts, 0, "{:?}", upstream(&d, "rs"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ctl_upstreams_lists_and_restarts_and_a_daemon_restart_rebuilds_them() {
    let d = shared_rmcp("rm");
    let human = d.ctl_ok(&["upstreams"]).stdout;
    for needle in ["UPSTREAM", "rm", "stdio (shared)", "up", "rm.echo"] {
        assert!(human.contains(needle), "{needle:?} in {human}");
    }
    assert!(
        d.ctl_ok(&["status"]).stdout.contains("1 of 1 up"),
        "status shows the upstreams"
    );
    let client = McpClient::connect(&d, &d.bearer()).await;
    let first = rm_pid(&client).await;
    let out = d.ctl_ok(&["--json", "upstreams", "restart", "rm"]).stdout;
    let v: Value = serde_json::from_str(&out).expect("json");
    assert_eq!(v["kind"], "upstream", "{out}");
    assert_eq!(v["upstream"]["restarts"], 1, "{out}");
    assert_eq!(v["upstream"]["state"], "up", "{out}");
    let second = rm_pid(&client).await;
    assert_ne!(first, second, "a new child after upstreams restart");
    assert!(
        poll_until(LIMIT, Duration::from_millis(20), || !alive(first)).await,
        "the old child {first} lives on"
    );
    let missing = d.ctl(&["upstreams", "restart", "nope"]);
    assert_eq!(missing.code(), Some(1), "{missing:?}");
    assert!(missing.stderr.contains("not-found"), "{missing:?}");
    client.close().await;

    // A daemon restart starts the upstreams again from its plan.
    d.ctl_ok(&["restart"]);
    d.refresh_addrs();
    wait_state(&d, "rm", "up");
    let client = McpClient::connect(&d, &d.bearer()).await;
    let third = rm_pid(&client).await;
    assert_ne!(second, third);
    assert!(
        poll_until(LIMIT, Duration::from_millis(20), || !alive(second)).await,
        "the child {second} outlived the restart"
    );
    client.close().await;
}

#[test]
fn upstream_config_errors_are_config_errors_naming_their_key() {
    let dir = tempfile::tempdir().expect("tempdir");
    for (toml, key) in [
        (
            "[upstreams.Bad]\ncommand = [\"/bin/true\"]\n",
            "upstreams.Bad",
        ),
        (
            "[upstreams.far]\nurl = \"http://192.0.2.1:80/mcp\"\n",
            "upstreams.far.url",
        ),
        (
            "[upstreams.system]\ncommand = [\"/bin/true\"]\n",
            "upstreams.system",
        ),
        (
            "[upstreams.x]\ncommand = [\"/bin/true\"]\nwhat = 1\n",
            "upstreams.x",
        ),
    ] {
        let text = Daemon::builder().extra(toml).config_text(dir.path());
        let path = dir.path().join("config.toml");
        std::fs::write(&path, text).expect("write config");
        let out = robota_e2e::daemon::check_config(&path);
        assert_eq!(out.code(), Some(robota_e2e::EXIT_CONFIG), "{toml}: {out:?}");
        assert!(
            out.stderr.contains(key) || out.stdout.contains(key),
            "{toml}: {key} not named: {out:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_bearer_file_of_an_http_backend_never_reaches_any_output() {
    let server = HttpServer::sdk();
    let dir = tempfile::tempdir().expect("tempdir");
    let token = "upstream-bearer-5e3c1d0b9a";
    let file = dir.path().join("web.token");
    std::fs::write(&file, format!("{token}\n")).expect("token file");
    let d = Daemon::start(&format!(
        "[upstreams.web]\nurl = \"{}\"\nbearer_file = \"{}\"\n\n{}",
        server.url(),
        file.display(),
        allow(&["web"])
    ));
    d.register_secret(token);
    wait_state(&d, "web", "up");
    let client = McpClient::connect(&d, &d.bearer()).await;
    client
        .call("web.echo", json!({"text": "x"}))
        .await
        .ok("web.echo");
    client.close().await;
    d.ctl_ok(&["--json", "upstreams"]);
    d.assert_no_secrets();
}

async fn rm_pid(client: &McpClient) -> i32 {
    client.call("rm.pid", json!({})).await.ok("rm.pid")["pid"]
        .as_i64()
        .expect("pid") as i32
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_kills_the_childs_whole_tree_and_a_stop_ends_a_lingering_child() {
    let d = Daemon::start(&format!(
        "[upstreams.rogue]\ncommand = {}\n\n{}",
        fixture_command(&["rogue", "--linger"]),
        allow(&["rogue"])
    ));
    wait_state(&d, "rogue", "up");
    let client = McpClient::connect(&d, &d.bearer()).await;
    let fork = || async {
        let forked = client.call("rogue.fork", json!({})).await.ok("fork");
        let pid = |k: &str| {
            forked[k]
                .as_i64()
                .unwrap_or_else(|| panic!("{k}: {forked}")) as i32
        };
        [pid("pid"), pid("grandchild"), pid("escaped")]
    };
    let tree = fork().await;
    // The daemon made its cgroup its own; each child has one beneath it, which the
    // grandchild that left the process group (setsid) is still in.
    let daemon_cgroup = cgroup_of(d.pid());
    assert!(daemon_cgroup.ends_with("/daemon"), "{daemon_cgroup}");
    let base = daemon_cgroup.trim_end_matches("/daemon");
    for pid in tree {
        assert!(alive(pid));
        let place = cgroup_of(pid);
        assert!(
            place.starts_with(&format!("{base}/upstreams/rogue/")),
            "process {pid} runs in {place}"
        );
    }
    assert_ne!(
        std::fs::read_to_string(format!("/proc/{}/stat", tree[2]))
            .unwrap()
            .rsplit(") ")
            .next()
            .and_then(|rest| rest.split(' ').nth(3))
            .map(str::to_owned),
        Some(tree[0].to_string()),
        "the escaped grandchild has a session of its own"
    );
    d.ctl_ok(&["upstreams", "restart", "rogue"]);
    assert!(
        poll_until(LIMIT, Duration::from_millis(20), || tree
            .iter()
            .all(|p| !alive(*p)))
        .await,
        "a process of {tree:?} outlived the upstream's restart"
    );
    let next = fork().await;
    client.close().await;
    d.ctl_ok(&["stop"]);
    assert!(d.wait_exit(LIMIT).is_some(), "the daemon did not stop");
    assert!(
        poll_until(LIMIT, Duration::from_millis(20), || next
            .iter()
            .all(|p| !alive(*p)))
        .await,
        "a process of the lingering child's tree {next:?} outlived the daemon's stop"
    );
}

/// The unified hierarchy's line of `/proc/<pid>/cgroup`.
fn cgroup_of(pid: i32) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/cgroup"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("0::"))
        .unwrap_or_default()
        .to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstreams_whole_process_tree_is_bounded_by_its_memory_and_tasks() {
    let d = Daemon::start(&format!(
        "[upstreams.rogue]\ncommand = {}\nmemory = \"64MiB\"\n\n{}",
        fixture_command(&["rogue"]),
        allow(&["rogue"])
    ));
    wait_state(&d, "rogue", "up");
    let client = McpClient::connect(&d, &d.bearer()).await;
    let hog = |mib: u64| {
        let client = &client;
        async move {
            let answer = client
                .call("rogue.hog", json!({"mib": mib}))
                .await
                .ok("hog");
            answer["ended"].as_str().unwrap_or_default().to_owned()
        }
    };
    // Within the bound, a grandchild in a session of its own takes what it asks for.
    assert_eq!(hog(16).await, "exit status: 0");
    // Past it, the kernel kills it; the upstream's own process goes on.
    let ended = hog(256).await;
    assert!(ended.contains("SIGKILL"), "the 256 MiB grandchild: {ended}");
    assert_eq!(hog(16).await, "exit status: 0");
    // A grandchild starting thousands of threads gets no more than the upstream's share
    // of tasks (its own process and the fixture's count too), and the daemon goes on.
    let bomb = client
        .call("rogue.hog", json!({"mib": 0, "threads": 5000}))
        .await
        .ok("hog threads");
    let threads = bomb["threads"].as_u64().expect("a count of threads");
    assert!(
        (900..1024).contains(&threads),
        "threads started beneath a bound of 1024 tasks: {bomb}"
    );
    let info = client.call("system.info", json!({})).await;
    assert!(!info.is_error, "{info:?}");
    // Past it in the upstream's own process: the call is lost, and the reason the
    // operator reads names the bound, though the link saw its stdout end first.
    let lost = client
        .call("rogue.hog", json!({"mib": 256, "itself": true}))
        .await;
    lost.err("outcome_unknown", "the upstream's process killed mid-call");
    let mut last = None;
    let named = poll_until_blocking(LIMIT, Duration::from_millis(100), || {
        let error = upstream(&d, "rogue").last_error.unwrap_or_default();
        let named = error.contains("at its memory bound");
        last = Some(error);
        named
    });
    assert!(named, "the upstream's last error: {last:?}");
    client.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstreams_read_only_claim_does_not_let_a_call_past_policy() {
    // No [[policy]] rule: the double marks every tool readOnlyHint, which is shown and
    // never believed.
    let d = Daemon::start(&format!(
        "[upstreams.rogue]\ncommand = {}\n",
        fixture_command(&["rogue"])
    ));
    wait_state(&d, "rogue", "up");
    let client = McpClient::connect(&d, &d.bearer()).await;
    let tools = within(LIMIT, "tools/list", client.peer().list_all_tools())
        .await
        .expect("tools/list");
    let echo = tools
        .iter()
        .find(|t| t.name == "rogue.echo")
        .expect("rogue.echo listed");
    assert_eq!(
        echo.annotations.as_ref().and_then(|a| a.read_only_hint),
        Some(true),
        "the upstream's annotations are shown"
    );
    client
        .call("rogue.echo", json!({}))
        .await
        .err("permission_denied", "an imported tool without a rule");
    let metrics = d.metrics_text().expect("metrics");
    assert!(
        metric_sum(&metrics, &["policy_denials_total{", "tool=\"rogue.echo\""]) >= 1.0,
        "{metrics}"
    );
    client.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_per_call_child_is_killed_when_its_call_times_out() {
    let events = tempfile::NamedTempFile::new().expect("events file");
    let path = events.path().display().to_string();
    let d = Daemon::start(&format!(
        "[upstreams.rogue]\ncommand = {}\nwrite_paths = [{path:?}]\nchildren = \"per-call\"\ncall_timeout = \"1s\"\n\n{}",
        fixture_command(&["rogue", "--linger", "--events", &path]),
        allow(&["rogue"])
    ));
    wait_state(&d, "rogue", "up");
    let client = McpClient::connect(&d, &d.bearer()).await;
    client
        .call("rogue.hang", json!({}))
        .await
        .err("timed_out", "a hanging per-call child");
    let text = std::fs::read_to_string(events.path()).expect("events");
    let pid: i32 = text
        .lines()
        .find_map(|l| {
            l.strip_prefix("hanging ")
                .and_then(|r| r.split(" pid ").nth(1))
        })
        .and_then(|p| p.trim().parse().ok())
        .unwrap_or_else(|| panic!("no hanging pid in {text:?}"));
    assert!(
        poll_until(LIMIT, Duration::from_millis(20), || !alive(pid)).await,
        "the per-call child {pid} outlived its timed-out call"
    );
    client.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http_backend_that_dies_mid_call_is_outcome_unknown_then_unavailable() {
    let events = tempfile::NamedTempFile::new().expect("events file");
    let mut cmd = std::process::Command::new(robota_e2e::upstream::fixture_bin());
    cmd.arg("rmcp-http").arg("--events").arg(events.path());
    let server = HttpServer::spawn(cmd);
    let d = Daemon::start(&format!(
        "[upstreams.web]\nurl = \"{}\"\nconnect_timeout = \"1s\"\n\n{}",
        server.url(),
        allow(&["web"])
    ));
    wait_state(&d, "web", "up");
    let client = McpClient::connect(&d, &d.bearer()).await;
    let call = client.call("web.sleep", json!({"ms": 60000}));
    let kill = async {
        assert!(
            poll_until(LIMIT, Duration::from_millis(20), || {
                std::fs::read_to_string(events.path()).is_ok_and(|t| t.contains("sleeping"))
            })
            .await,
            "the call never reached the backend"
        );
        drop(server);
    };
    let (result, ()) = tokio::join!(call, kill);
    result.err("outcome_unknown", "a backend killed mid-call");
    // Down now: a call answers unavailable at once, nothing sent.
    assert!(
        robota_e2e::poll_until_async(LIMIT, Duration::from_millis(100), || async {
            client.call("web.ping", json!({})).await.error_code() == Some("unavailable")
        })
        .await,
        "never unavailable: {:?}",
        upstream(&d, "web")
    );
    client.close().await;
}

/// A Streamable HTTP backend that initializes and lists like any, then answers every
/// `tools/call` it receives with `status` and, if `error` is given, a JSON-RPC error
/// response with that `(id, error)` (an empty body otherwise; `$AUTH` in
/// the error becomes the request's `Authorization`, as a careless server echoes it); the calls it
/// received are counted. Plain HTTP/1.1 on loopback, one request per connection; bounded:
/// it serves `max` requests, then stops.
async fn refusing_backend(
    status: u16,
    error: Option<(Value, Value)>,
    max: usize,
) -> (String, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!("http://{}/mcp", listener.local_addr().expect("addr"));
    let calls = Arc::new(AtomicUsize::new(0));
    let seen = calls.clone();
    tokio::spawn(async move {
        for _ in 0..max {
            let Ok(Ok((mut s, _))) = tokio::time::timeout(LIMIT, listener.accept()).await else {
                return;
            };
            let mut buf = Vec::new();
            let mut chunk = [0u8; 4096];
            // The head, then a body of Content-Length bytes.
            let body = loop {
                let Ok(Ok(n)) = tokio::time::timeout(LIMIT, s.read(&mut chunk)).await else {
                    break None;
                };
                if n == 0 {
                    break None;
                }
                buf.extend_from_slice(&chunk[..n]);
                let mut headers = [httparse::EMPTY_HEADER; 32];
                let mut req = httparse::Request::new(&mut headers);
                if let Ok(httparse::Status::Complete(head)) = req.parse(&buf) {
                    let length = req
                        .headers
                        .iter()
                        .find(|h| h.name.eq_ignore_ascii_case("content-length"))
                        .and_then(|h| std::str::from_utf8(h.value).ok()?.parse().ok())
                        .unwrap_or(0usize);
                    if buf.len() >= head + length {
                        let authorization = req
                            .headers
                            .iter()
                            .find(|h| h.name.eq_ignore_ascii_case("authorization"))
                            .map(|h| String::from_utf8_lossy(h.value).into_owned())
                            .unwrap_or_default();
                        break Some((buf[head..head + length].to_vec(), authorization));
                    }
                }
            };
            let Some((body, authorization)) = body else {
                continue;
            };
            let msg: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
            let answer = |result: Value| {
                json!({"jsonrpc": "2.0", "id": msg["id"], "result": result}).to_string()
            };
            let (code, text) = match msg["method"].as_str().unwrap_or_default() {
                "initialize" => (
                    200,
                    answer(json!({
                        "protocolVersion": msg["params"]["protocolVersion"],
                        "capabilities": {"tools": {}},
                        "serverInfo": {"name": "refusing", "version": "1"}
                    })),
                ),
                "tools/list" => (
                    200,
                    answer(json!({"tools": [{
                        "name": "act",
                        "description": "acts, then the front says no",
                        "inputSchema": {"type": "object"}
                    }]})),
                ),
                "tools/call" => {
                    seen.fetch_add(1, Ordering::SeqCst);
                    // `$AUTH` in the error is what the request's Authorization said.
                    let text = error.as_ref().map_or_else(String::new, |(id, error)| {
                        json!({"jsonrpc": "2.0", "id": id, "error": error})
                            .to_string()
                            .replace("$AUTH", &authorization)
                    });
                    (status, text)
                }
                _ => (202, String::new()),
            };
            let ctype = if text.is_empty() {
                ""
            } else {
                "Content-Type: application/json\r\n"
            };
            let location = if (300..400).contains(&code) {
                "Location: http://127.0.0.1:9/\r\n"
            } else {
                ""
            };
            let head = format!(
                "HTTP/1.1 {code} X\r\n{ctype}{location}Content-Length: {}\r\nConnection: close\r\n\r\n",
                text.len()
            );
            let _ = s.write_all(head.as_bytes()).await;
            let _ = s.write_all(text.as_bytes()).await;
            let _ = s.shutdown().await;
        }
    });
    (url, calls)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_the_backend_received_is_never_nothing_was_sent() {
    use std::sync::atomic::Ordering;
    for status in [307u16, 403, 404, 429] {
        let (url, calls) = refusing_backend(status, None, 64).await;
        let d = Daemon::start(&format!(
            "[upstreams.web]\nurl = \"{url}\"\n\n{}",
            allow(&["web"])
        ));
        wait_state(&d, "web", "up");
        let client = McpClient::connect(&d, &d.bearer()).await;
        let message = client
            .call("web.act", json!({}))
            .await
            .err("outcome_unknown", &format!("a call answered {status}"));
        assert!(
            calls.load(Ordering::SeqCst) >= 1,
            "{status}: the backend never saw the call"
        );
        assert!(!message.contains("nothing was sent"), "{status}: {message}");
        client.close().await;
        // The operator reads what happened, the status among it.
        let logged = poll_until(LIMIT, Duration::from_millis(20), || {
            d.stderr_text().lines().any(|l| {
                l.contains("an upstream call failed")
                    && l.contains("upstream=web")
                    && l.contains(&format!("{status} "))
            })
        })
        .await;
        assert!(logged, "{status}: not logged: {}", d.stderr_text());
    }
}

/// A backend that cannot accept a call and says why in a JSON-RPC error (the transport's
/// 4xx with an error response whose id is null) is heard: the caller gets its words under
/// its name and a refusal, not "outcome unknown". The same error under a 5xx (the server
/// failed, maybe after acting), or carrying another request's id, stays outcome unknown.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backend_refusing_a_call_in_json_rpc_is_heard() {
    let refused = json!({"code": -32602, "message": "Bad Request: n must be a number"});
    let cases = [
        (400, json!(null), Some("invalid_arguments")),
        (422, json!(null), Some("invalid_arguments")),
        (400, json!(7777), None),
        (500, json!(null), None),
    ];
    for (status, id, heard) in cases {
        let (url, calls) = refusing_backend(status, Some((id.clone(), refused.clone())), 64).await;
        let d = Daemon::start(&format!(
            "[upstreams.web]\nurl = \"{url}\"\n\n{}",
            allow(&["web"])
        ));
        wait_state(&d, "web", "up");
        let client = McpClient::connect(&d, &d.bearer()).await;
        let what = format!("a call answered {status} with a JSON-RPC error of id {id}");
        let outcome = client.call("web.act", json!({})).await;
        match heard {
            Some(code) => {
                let message = outcome.err(code, &what);
                assert!(
                    message.contains("\"web\"") && message.contains("n must be a number"),
                    "{what}: {message}"
                );
            }
            None => {
                let message = outcome.err("outcome_unknown", &what);
                assert!(!message.contains("n must be a number"), "{what}: {message}");
            }
        }
        assert_eq!(
            calls.load(std::sync::atomic::Ordering::SeqCst),
            1,
            "{what}: the backend was called once"
        );
        client.close().await;
    }
    // A backend that echoes the credential it refused: the daemon's token is cut out of
    // its words before they reach the caller, the log or the status.
    let echoed = json!({"code": -32001, "message": "bad token: $AUTH"});
    let (url, _) = refusing_backend(400, Some((json!(null), echoed)), 64).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let token = "upstream-bearer-0d9c8b7a6f";
    let file = dir.path().join("web.token");
    std::fs::write(&file, format!("{token}\n")).expect("token file");
    let d = Daemon::start(&format!(
        "[upstreams.web]\nurl = \"{url}\"\nbearer_file = \"{}\"\n\n{}",
        file.display(),
        allow(&["web"])
    ));
    d.register_secret(token);
    wait_state(&d, "web", "up");
    let client = McpClient::connect(&d, &d.bearer()).await;
    let message = client
        .call("web.act", json!({}))
        .await
        .err("internal", "a refusal echoing the credential");
    assert!(
        message.contains("bad token: Bearer [redacted]") && !message.contains(token),
        "{message}"
    );
    client.close().await;
    d.ctl_ok(&["--json", "upstreams"]);
    d.assert_no_secrets();
}

/// The official Python SDK's client (`tests/fixtures/progress_client.py`) calling `tool`:
/// the progress notifications it received, then the result.
fn python_call(args: &[&str], bearer: Option<&str>) -> (Vec<Value>, Value) {
    python_call_as(args, bearer, None)
}

/// [`python_call`] with a `Host` header (the remote carrier's public name).
fn python_call_as(args: &[&str], bearer: Option<&str>, host: Option<&str>) -> (Vec<Value>, Value) {
    let script =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/progress_client.py");
    let mut cmd = std::process::Command::new(robota_e2e::upstream::sdk_python());
    cmd.arg(script).args(args);
    if let Some(bearer) = bearer {
        cmd.env("ROBOTA_BEARER", bearer);
    }
    if let Some(host) = host {
        cmd.env("ROBOTA_HOST", host);
    }
    let out = robota_e2e::daemon::run_bounded(cmd, LIMIT);
    out.expect_code(0, "progress_client.py");
    let mut lines: Vec<Value> = out
        .stdout
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect();
    let result = lines.pop().expect("the result line")["result"].take();
    (lines, result)
}

fn text_of(result: &Value) -> &str {
    result["content"][0]["text"].as_str().unwrap_or_default()
}

/// A call carrying a progress token gets the upstream's progress for it, its token mapped
/// back, before the result: from a Node server from npm over stdio and from the Python
/// SDK over Streamable HTTP, to the Python SDK's client over the loopback carrier
/// (revisions 2025-11-25 and 2026-07-28), the remote carrier (a signed access token) and
/// the `robota-mcpctl stdio` relay. On
/// HTTP the answer is then an event stream; without a token it stays plain JSON. A call
/// reporting faster than 20 a second is paced, its latest update kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn progress_from_upstreams_reaches_the_caller_paced() {
    let (node, script, modules) = robota_e2e::upstream::npm_server("server-everything");
    let events = tempfile::NamedTempFile::new().expect("events file");
    let web = HttpServer::sdk_with_events(events.path());
    let show = |p: &std::path::Path| p.display().to_string();
    let (authz, keys) = robota_e2e::authz::Authz::with_standard_keys();
    let d = robota_e2e::remote::RemoteConfig::new(&authz)
        .builder()
        .extra(format!(
            "[upstreams.everything]\ncommand = {}\n{}\n\n[upstreams.web]\nurl = \"{}\"\n\n{}\n\
         [[policy]]\ncallers = [\"local:*\", \"oauth:*\"]\ntools = [\"everything.*\", \"web.*\"]\ndecision = \"allow\"\n",
            toml_array(&[show(&node), show(&script), "stdio".into()]),
            read_paths_with(&[&modules]),
            web.url(),
            allow(&["everything", "web"])
        ))
        .start();
    let token = authz
        .token(&keys.rsa, robota_e2e::remote::PUBLIC_URL)
        .build();
    d.register_secret(&token);
    wait_state(&d, "everything", "up");
    wait_state(&d, "web", "up");
    let bearer = d.bearer();
    let url = format!("http://{}/mcp", d.loopback_addr());
    let long = (
        "everything.trigger-long-running-operation",
        r#"{"duration": 1, "steps": 4}"#,
        "Long running operation completed",
    );
    let count = ("web.count", r#"{"steps": 4, "ms": 150}"#, "counted to 4");
    let expect_steps = |notes: &[Value], what: &str| {
        let seen: Vec<(f64, f64)> = notes
            .iter()
            .map(|n| {
                (
                    n["progress"].as_f64().unwrap(),
                    n["total"].as_f64().unwrap(),
                )
            })
            .collect();
        assert_eq!(
            seen,
            [(1., 4.), (2., 4.), (3., 4.), (4., 4.)],
            "{what}: {notes:?}"
        );
    };
    for lifecycle in ["initialize", "discover"] {
        for (tool, args, done) in [long, count] {
            let what = format!("{tool} over loopback, {lifecycle}");
            let (notes, result) = python_call(
                &["http", &url, lifecycle, tool, args, "progress"],
                Some(&bearer),
            );
            expect_steps(&notes, &what);
            assert!(text_of(&result).contains(done), "{what}: {result}");
            assert_eq!(
                result["_meta"]["io.robota/upstream"]["name"],
                tool.split('.').next().unwrap(),
                "{what}: the result passes through whole: {result}"
            );
        }
    }
    let remote = format!("http://{}/mcp", d.remote_addr());
    let public_host = robota_e2e::remote::PUBLIC_URL
        .trim_start_matches("https://")
        .trim_end_matches("/mcp");
    for (tool, args, done) in [long, count] {
        let what = format!("{tool} over the remote carrier");
        let (notes, result) = python_call_as(
            &["http", &remote, "discover", tool, args, "progress"],
            Some(&token),
            Some(public_host),
        );
        expect_steps(&notes, &what);
        assert!(text_of(&result).contains(done), "{what}: {result}");
    }
    let (notes, result) = python_call(
        &["http", &url, "initialize", count.0, count.1, "none"],
        Some(&bearer),
    );
    assert!(
        notes.is_empty() && text_of(&result).contains(count.2),
        "{notes:?} {result}"
    );
    for (tool, args, done) in [long, count] {
        let relay = [
            "stdio",
            "initialize",
            tool,
            args,
            "progress",
            "--",
            &robota_e2e::mcpctl_bin().display().to_string(),
            "--socket",
            &show(d.socket_path()),
            "stdio",
        ]
        .map(str::to_owned);
        let relay: Vec<&str> = relay.iter().map(String::as_str).collect();
        let (notes, result) = python_call(&relay, None);
        expect_steps(&notes, &format!("{tool} over the relay"));
        assert!(
            text_of(&result).contains(done),
            "{tool} over the relay: {result}"
        );
    }
    // On the wire: an event stream with a token, plain JSON without.
    let port = d.loopback_port();
    let call = |token: Option<&str>| {
        let mut message =
            robota_e2e::http::tools_call(7, "web.count", json!({"steps": 2, "ms": 100}));
        if let Some(token) = token {
            message["params"]["_meta"] = json!({"progressToken": token});
        }
        robota_e2e::http::Request::mcp(port, Some(&bearer), &message)
    };
    let plain = robota_e2e::http::exchange(d.loopback_addr(), &call(None)).await;
    assert!(!plain.is_sse(), "{}", plain.describe());
    assert_eq!(plain.messages().len(), 1, "{}", plain.describe());
    let streamed = robota_e2e::http::exchange(d.loopback_addr(), &call(Some("mine"))).await;
    assert!(streamed.is_sse(), "{}", streamed.describe());
    let messages = streamed.messages();
    assert_eq!(messages.len(), 3, "{}", streamed.describe());
    for (i, note) in messages[..2].iter().enumerate() {
        assert_eq!(note["method"], "notifications/progress");
        assert_eq!(note["params"]["progressToken"], "mine");
        assert_eq!(note["params"]["progress"].as_f64(), Some(i as f64 + 1.));
        assert_eq!(note["params"]["message"], format!("step {}", i + 1));
    }
    assert_eq!(messages[2]["id"], 7);
    assert_eq!(text_of(&messages[2]["result"]), "counted to 2");
    // A streamed call cancelled by its caller: the cancellation reaches the upstream (its
    // tool sees it) and the stream ends then, not when the 10 s count would have.
    let mut message =
        robota_e2e::http::tools_call(9, "web.count", json!({"steps": 100, "ms": 100}));
    message["params"]["_meta"] = json!({"progressToken": "cut"});
    let mut conn = robota_e2e::http::Conn::connect(d.loopback_addr())
        .await
        .expect("connect");
    conn.write(&robota_e2e::http::Request::mcp(port, Some(&bearer), &message).to_bytes())
        .await
        .expect("send the call");
    let mut head = within(LIMIT, "the stream's head", conn.read_head())
        .await
        .expect("the stream's head");
    assert!(head.is_sse(), "{}", head.describe());
    let started = std::time::Instant::now();
    let reading = tokio::spawn(async move {
        let read = conn.read_body(&mut head).await;
        (read, head)
    });
    let cancel =
        robota_e2e::http::Request::mcp(port, Some(&bearer), &robota_e2e::http::cancelled(9));
    let answer = robota_e2e::http::exchange(d.loopback_addr(), &cancel).await;
    assert_eq!(answer.status, 202, "{}", answer.describe());
    let (read, ended) = within(Duration::from_secs(5), "the stream's end", reading)
        .await
        .expect("the reader");
    read.expect("the stream ends cleanly");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "the stream ended {:?} after the cancellation",
        started.elapsed()
    );
    for note in ended
        .messages()
        .iter()
        .filter(|m| m.get("method").is_some())
    {
        assert_eq!(
            note["params"]["progressToken"],
            "cut",
            "{}",
            ended.describe()
        );
    }
    assert!(
        poll_until(LIMIT, Duration::from_millis(50), || {
            std::fs::read_to_string(events.path()).is_ok_and(|t| t.contains("cancelled count 100"))
        })
        .await,
        "the cancellation did not reach the upstream's tool: {:?}",
        std::fs::read_to_string(events.path())
    );
    // 200 updates in about a second: paced to at most 20 a second.
    let started = std::time::Instant::now();
    let (notes, result) = python_call(
        &[
            "http",
            &url,
            "initialize",
            "web.count",
            r#"{"steps": 200, "ms": 5}"#,
            "progress",
        ],
        Some(&bearer),
    );
    let took = started.elapsed().as_secs_f64();
    assert!(text_of(&result).contains("counted to 200"), "{result}");
    let bound = (took / 0.05).ceil() as usize + 1;
    assert!(
        !notes.is_empty() && notes.len() <= bound && notes.len() < 200,
        "{} notes in {took:.2} s (at most {bound}): {notes:?}",
        notes.len()
    );
    let values: Vec<f64> = notes
        .iter()
        .map(|n| n["progress"].as_f64().unwrap())
        .collect();
    assert!(
        values.windows(2).all(|w| w[0] < w[1]),
        "in order, coalesced: {values:?}"
    );
    d.assert_no_secrets();
    drop(d);
    // The result limit bounds a call's progress too, and never costs it its result: with
    // 1 KiB, a few notifications of about 150 bytes, then the result.
    let small = Daemon::start(&format!(
        "[limits]\ntool_result = \"1KiB\"\n\n[upstreams.web]\nurl = \"{}\"\n\n{}",
        web.url(),
        allow(&["web"])
    ));
    wait_state(&small, "web", "up");
    let (notes, result) = python_call(
        &[
            "http",
            &format!("http://{}/mcp", small.loopback_addr()),
            "initialize",
            "web.count",
            r#"{"steps": 40, "ms": 60}"#,
            "progress",
        ],
        Some(&small.bearer()),
    );
    assert!(text_of(&result).contains("counted to 40"), "{result}");
    assert!(
        (2..=7).contains(&notes.len()),
        "{} notes within 1 KiB: {notes:?}",
        notes.len()
    );
}

/// Found by an outside attack: upstream stderr went through the log's per-callsite rate
/// (20 lines a second, all upstreams together) on top of each upstream's own 10, so two
/// upstreams flooding stderr pushed a third's lines out of the log. Each upstream's
/// allowance is its own now: the quiet one's ten lines all reach the log.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_upstreams_flooding_stderr_push_no_other_upstreams_lines_out() {
    // About 100 lines a second each, for as long as the daemon waits for their handshake
    // (and again after each restart; so the quiet one's lines may be said more than once).
    let noisy = |name: &str| {
        format!(
            "[upstreams.{name}]\ncommand = [\"/bin/sh\", \"-c\", \"while :; do echo {name}-noise >&2; sleep 0.01; done\"]\nconnect_timeout = \"3s\"\n\n"
        )
    };
    let quiet = "[upstreams.quiet]\ncommand = [\"/bin/sh\", \"-c\", \
                 \"i=0; while [ $i -lt 10 ]; do i=$((i+1)); echo quiet-line-$i >&2; sleep 0.2; done; sleep 60\"]\n\
                 connect_timeout = \"3s\"\n\n";
    let d = Daemon::start(&format!("{}{}{quiet}", noisy("loud"), noisy("louder")));
    let logged = |needle: &str| d.stderr_text().matches(needle).count();
    let all_said = poll_until(LIMIT, Duration::from_millis(100), || {
        (1..=10).all(|i| logged(&format!("\"quiet-line-{i}\"")) >= 1)
    })
    .await;
    let said: Vec<usize> = (1..=10)
        .map(|i| logged(&format!("\"quiet-line-{i}\"")))
        .collect();
    assert!(all_said, "the quiet upstream's lines in the log: {said:?}");
    // The floods were there and were bounded: about 10 lines a second each, the rest
    // counted.
    let (loud, louder) = (logged("\"loud-noise\""), logged("\"louder-noise\""));
    assert!(
        loud >= 10 && louder >= 10,
        "{loud} and {louder} noise lines"
    );
    assert!(
        d.stderr_text()
            .contains("upstream stderr lines past the rate, not logged"),
        "the floods' rest is counted"
    );
}
