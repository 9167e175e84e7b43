//! The Debian package under the real systemd: each test boots a fresh Debian 12 with
//! systemd as PID 1 (`robota_e2e::machine`), installs the `.deb` with apt as an operator
//! does, and drives it with `systemctl`, `journalctl`, `systemd-analyze` and
//! `robota-mcpctl` inside the machine.
//!
//! Not part of a plain `cargo test` (`test = false` in tests/Cargo.toml): it needs root,
//! `systemd-nspawn` and the package. `tests/run` builds the package and runs it:
//! `cargo test --workspace --release --test system`.

use std::time::Duration;

mod fleet;

use robota_e2e::machine::{Machine, package};
use robota_e2e::{assert_no_secrets, poll_until_blocking};
use serde_json::Value;

const UNIT: &str = "robota-mcpd.service";
/// The packaged configuration's loopback endpoint.
const ENDPOINT: &str = "http://127.0.0.1:8765/mcp";
/// How long systemd gets for a state change the test waits for.
const SETTLE: Duration = Duration::from_secs(30);

/// A booted machine with the package installed by `apt-get install ./….deb`.
fn installed() -> Machine {
    let m = Machine::boot();
    m.install(&package())
        .expect_code(0, "apt-get install ./robota-mcpd_….deb");
    m
}

/// The host bearer, fetched as the docs say (into a 0600 file), and a curl header file
/// holding it; returns the bearer.
fn bearer(m: &Machine) -> String {
    m.ok(
        "rm -f /root/bearer && robota-mcpctl bearer issue --output /root/bearer \
          && { printf 'Authorization: Bearer '; cat /root/bearer; } > /root/auth-header",
    );
    m.read("/root/bearer")
        .expect("the bearer file")
        .trim()
        .to_owned()
}

/// A `tools/call` of `system.info` over the loopback carrier with the header file; the
/// HTTP status and the body.
fn call_system_info(m: &Machine) -> (String, String) {
    let out = m.sh(&format!(
        "curl -s -o /root/body -w '%{{http_code}}' {ENDPOINT} -H @/root/auth-header \
         -H 'Content-Type: application/json' -H 'Accept: application/json, text/event-stream' \
         -H 'MCP-Protocol-Version: 2025-11-25' \
         -d '{{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"tools/call\",\"params\":{{\"name\":\"system.info\",\"arguments\":{{}}}}}}'"
    ));
    (out.stdout, m.read("/root/body").unwrap_or_default())
}

fn assert_serves(m: &Machine, when: &str) {
    bearer(m);
    let (code, body) = call_system_info(m);
    assert_eq!(code, "200", "{when}: system.info over loopback: {body}");
    let v: Value = serde_json::from_str(&body).unwrap_or_else(|e| panic!("{when}: {e}: {body}"));
    assert_eq!(v["result"]["isError"], false, "{when}: {v}");
}

fn main_pid(m: &Machine) -> i64 {
    m.property(UNIT, "MainPID").parse().expect("MainPID")
}

/// Polls a unit property until `want` holds, bounded by [`SETTLE`].
fn wait_for(m: &Machine, property: &str, what: &str, want: impl Fn(&str) -> bool) -> String {
    let mut last = String::new();
    let held = poll_until_blocking(SETTLE, Duration::from_millis(100), || {
        last = m.property(UNIT, property);
        want(&last)
    });
    assert!(
        held,
        "{property} never became {what} (last {last:?}); journal:\n{}",
        m.sh("journalctl -u robota-mcpd --no-pager -n 40").stdout
    );
    last
}

fn write_config(m: &Machine, text: &str) {
    m.write("/etc/robota-mcpd/config.toml", text.as_bytes(), 0o644);
}

/// The packaged configuration file (the embedded default) with `extra` appended.
fn packaged_config_with(m: &Machine, extra: &str) -> String {
    let base = m
        .read("/etc/robota-mcpd/config.toml")
        .expect("packaged config");
    format!("{base}\n{extra}\n")
}

#[test]
fn apt_installs_enables_and_starts_it_and_active_means_serving() {
    let m = installed();
    assert_eq!(m.property(UNIT, "UnitFileState"), "enabled");
    assert_eq!(
        m.property(UNIT, "ActiveState"),
        "active",
        "postinst starts it"
    );
    let user = m.ok("getent passwd robota-mcpd");
    let fields: Vec<&str> = user.trim().split(':').collect();
    let uid: u32 = fields[2].parse().expect("uid");
    assert!(uid < 1000, "a system user: {user}");
    assert!(fields[6].ends_with("nologin"), "{user}");
    assert_eq!(
        m.ok("stat -c '%a %U %G' /var/lib/robota-mcpd").trim(),
        "700 robota-mcpd robota-mcpd"
    );
    // Type=notify: `systemctl restart` returns once READY=1 came, and by then every
    // listener serves — the very next commands succeed without any retry.
    m.ok("systemctl restart robota-mcpd");
    m.ok("robota-mcpctl status >/dev/null");
    assert_serves(&m, "right after systemctl restart");
    m.ok("curl -sf http://127.0.0.1:9464/metrics | grep -q '^robota_mcpd_build_info'");
    let status = m.property(UNIT, "StatusText");
    assert!(
        status.contains("serving"),
        "STATUS= of a serving daemon: {status:?}"
    );
    // That systemd waits for READY=1, and is never active without it, is
    // `a_start_that_cannot_get_ready_is_a_failed_unit_never_active`.
}

#[test]
fn a_start_that_cannot_get_ready_is_a_failed_unit_never_active() {
    let m = installed();
    m.ok("systemctl stop robota-mcpd");
    // Another process holds the loopback port: the daemon cannot bind, so never READY=1.
    m.ok("systemd-run --unit=squatter python3 -c \
          'import socket,time; s=socket.socket(); s.bind((\"127.0.0.1\",8765)); s.listen(); time.sleep(600)'");
    assert!(
        poll_until_blocking(SETTLE, Duration::from_millis(100), || {
            m.sh("python3 -c 'import socket; socket.create_connection((\"127.0.0.1\",8765))'")
                .status
                .success()
        }),
        "the squatter never listened"
    );
    m.ok("systemctl reset-failed robota-mcpd || true");
    let before: u64 = m
        .property(UNIT, "ActiveEnterTimestampMonotonic")
        .parse()
        .expect("timestamp");
    let out = m.sh("systemctl start robota-mcpd");
    assert_ne!(
        out.code(),
        Some(0),
        "systemctl start of a daemon that cannot bind"
    );
    let after: u64 = m
        .property(UNIT, "ActiveEnterTimestampMonotonic")
        .parse()
        .expect("timestamp");
    assert_eq!(before, after, "the unit was active at some point");
    let log = m.ok("journalctl -u robota-mcpd --no-pager -o cat");
    assert!(
        log.contains("8765"),
        "the journal names the port that failed:\n{log}"
    );
    // Free the port: the next start (by hand, or systemd's own restart) serves.
    m.ok("systemctl stop squatter");
    m.ok("systemctl reset-failed robota-mcpd; systemctl restart robota-mcpd");
    assert_serves(&m, "after the port was freed");

    // An invalid configuration is exit 78: failed, and not restarted by systemd.
    write_config(&m, "[loopback]\nlisten = 8765\n");
    let out = m.sh("systemctl restart robota-mcpd");
    assert_ne!(out.code(), Some(0));
    wait_for(&m, "ActiveState", "failed", |s| s == "failed");
    assert_eq!(m.property(UNIT, "ExecMainStatus"), "78");
    assert_eq!(
        m.property(UNIT, "SubState"),
        "failed",
        "not auto-restarting"
    );
}

/// A `tools/call` of `name` with `arguments` over the loopback carrier with the header
/// file; the HTTP status and the body.
fn call_tool(m: &Machine, name: &str, arguments: Value) -> (String, String) {
    let request = serde_json::json!({
        "jsonrpc": "2.0", "id": 1, "method": "tools/call",
        "params": {"name": name, "arguments": arguments},
    });
    m.write("/root/request.json", request.to_string().as_bytes(), 0o600);
    let out = m.sh(&format!(
        "curl -s -o /root/body -w '%{{http_code}}' {ENDPOINT} -H @/root/auth-header \
         -H 'Content-Type: application/json' -H 'Accept: application/json, text/event-stream' \
         -H 'MCP-Protocol-Version: 2025-11-25' --data-binary @/root/request.json"
    ));
    (out.stdout, m.read("/root/body").unwrap_or_default())
}

/// The `result` of a `tools/call` answered 200.
fn tool_result(m: &Machine, name: &str, arguments: Value) -> Value {
    let (code, body) = call_tool(m, name, arguments);
    assert_eq!(code, "200", "{name}: {body}");
    let v: Value = serde_json::from_str(&body).unwrap_or_else(|e| panic!("{name}: {e}: {body}"));
    v["result"].clone()
}

/// The metrics listener's exposition at `addr`.
fn scrape(m: &Machine, addr: &str) -> String {
    m.ok(&format!("curl -sf http://{addr}/metrics"))
}

#[test]
fn reload_applies_a_valid_configuration_and_a_broken_one_changes_nothing() {
    let m = installed();
    let pid = main_pid(&m);
    let host_bearer = bearer(&m);
    // A valid change that leaves [loopback] as it was: the metrics listener moves, and an
    // upstream that cannot start is added.
    let packaged = packaged_config_with(&m, "");
    let moved = packaged.replace("127.0.0.1:9464", "127.0.0.1:9465");
    let with_upstream = format!("{moved}\n[upstreams.gone]\ncommand = [\"/bin/false\"]\n");
    write_config(&m, &with_upstream);
    // `systemctl reload` waits for the daemon's verdict: when it returns, the new
    // configuration serves.
    let out = m.ok("systemctl reload robota-mcpd && journalctl -u robota-mcpd -o cat --no-pager | grep reloaded");
    assert!(out.contains("host_bearer=kept"), "{out}");
    scrape(&m, "127.0.0.1:9465");
    assert_eq!(main_pid(&m), pid, "a reload is not a restart");
    assert_eq!(m.property(UNIT, "ActiveState"), "active");
    // The loopback client is not logged out: the same bearer file still works.
    let (code, body) = call_system_info(&m);
    assert_eq!(code, "200", "the host bearer after a reload: {body}");
    assert_eq!(
        bearer(&m),
        host_bearer,
        "the host bearer changed though [loopback] did not"
    );

    // An upstream that is not up: status says degraded and why, its names answer
    // `unavailable` (not `unknown_tool`), a restart of it says it did not come up.
    let metrics_up = |text: &str| {
        text.lines()
            .find(|l| l.starts_with("robota_mcpd_upstream_up{upstream=\"gone\"}"))
            .map(str::to_owned)
    };
    assert!(
        poll_until_blocking(SETTLE, Duration::from_millis(200), || {
            metrics_up(&scrape(&m, "127.0.0.1:9465")).is_some()
        }),
        "no upstream_up series for the new upstream"
    );
    let status = m.ok("robota-mcpctl status");
    assert!(status.contains("degraded"), "{status}");
    assert!(status.contains("DEGRADED: upstream gone"), "{status}");
    let v = tool_result(&m, "gone.anything", serde_json::json!({}));
    assert_eq!(v["isError"], true, "{v}");
    assert_eq!(
        v["structuredContent"]["code"], "unavailable",
        "a tool of an upstream that is not up: {v}"
    );
    let restart = m.sh("robota-mcpctl upstreams restart gone");
    assert_eq!(restart.code(), Some(1), "{restart:?}");
    assert!(
        restart.stderr.contains("not up"),
        "says why: {}",
        restart.stderr
    );

    // The upstream removed again: its series go with it.
    write_config(&m, &moved);
    m.ok("systemctl reload robota-mcpd");
    let text = scrape(&m, "127.0.0.1:9465");
    assert!(
        !text.contains("upstream=\"gone\""),
        "a removed upstream's series are still exported:\n{}",
        text.lines()
            .filter(|l| l.contains("gone"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    // Label sets no carrier can produce are not exported.
    assert!(!text.contains("carrier=\"stdio\""), "stdio series exported");
    assert!(
        !text.contains("{carrier=\"control\",reason=\"bad-bearer\"}"),
        "control bad-bearer exported"
    );

    // A broken file: `systemctl reload` fails, the reason is in the journal's text, and
    // the running configuration stays.
    write_config(&m, "[loopback\nlisten = \"127.0.0.1:8765\"\n");
    let out = m.sh("systemctl reload robota-mcpd");
    assert_ne!(
        out.code(),
        Some(0),
        "systemctl reload of a broken file: {out:?}"
    );
    assert_eq!(m.property(UNIT, "ActiveState"), "active");
    let log = m.ok("journalctl -u robota-mcpd -o cat --no-pager -n 30");
    assert!(
        log.contains("reload refused; the running configuration stays problem="),
        "the daemon's line carries the problem:\n{log}"
    );
    assert!(
        log.contains("config.toml"),
        "the problem names the file:\n{log}"
    );
    assert!(
        log.contains("robota-mcpctl: invalid-config"),
        "ExecReload's verdict is in the journal:\n{log}"
    );
    let status = m.ok("robota-mcpctl status");
    assert!(
        status.contains("FAILED"),
        "status shows the refused reload:\n{status}"
    );
    assert_eq!(main_pid(&m), pid);
    scrape(&m, "127.0.0.1:9465");
    let (code, body) = call_system_info(&m);
    assert_eq!(code, "200", "after a refused reload: {body}");

    // `robota-mcpctl restart` stays the fresh attach: a new host bearer.
    write_config(&m, &packaged);
    m.ok("robota-mcpctl restart >/dev/null");
    let (code, _) = call_system_info(&m);
    assert_eq!(code, "401", "the old host bearer after a restart");
    assert_ne!(bearer(&m), host_bearer);
}

/// A hostile stdio upstream (Debian's python3, the standard library only) under the
/// packaged unit, configured as the docs show with the defaults: it comes up confined,
/// and every way out it tries — the daemon's state, configuration and runtime, the
/// journal, TCP, signals, the daemon's /proc files — is denied, while the system's
/// read-only view stays readable.
#[test]
fn a_hostile_upstream_under_the_packaged_unit_reaches_nothing_of_the_daemons() {
    let m = installed();
    let script = include_bytes!("../../fixtures/hostile_stdio.py");
    m.write("/usr/local/lib/hostile_stdio.py", script, 0o644);
    let packaged = packaged_config_with(&m, "");
    let config = |memory: &str| {
        format!(
            "{packaged}{}",
            format!(
                "[upstreams.hostile]\ncommand = [\"/usr/bin/python3\", \"/usr/local/lib/hostile_stdio.py\"]\n{memory}\n\
                 [[policy]]\ncallers = [\"bearer:*\"]\ntools = [\"hostile.*\"]\ndecision = \"allow\"\n"
            )
        )
    };
    write_config(&m, &config(""));
    m.ok("systemctl restart robota-mcpd");
    if !memory_controller(&m) {
        // This host keeps the memory controller on a cgroup v1 hierarchy, which a
        // container sees read-only: the default `memory` bound cannot be enforced, and
        // the upstream's start fails, saying so, until the operator writes it off.
        let refused = poll_until_blocking(SETTLE, Duration::from_millis(500), || {
            m.sh("robota-mcpctl upstreams")
                .stdout
                .contains("memory = \"unbounded\"")
        });
        assert!(
            refused,
            "no visible refusal of the memory bound: {}\n{}",
            m.sh("robota-mcpctl upstreams").stdout,
            m.sh("journalctl -u robota-mcpd -o cat --no-pager | tail -n 20")
                .stdout
        );
        write_config(&m, &config("memory = \"unbounded\"\n"));
        let reload = m.sh("systemctl reload robota-mcpd");
        assert_eq!(
            reload.status.code(),
            Some(0),
            "{reload:?}\n{}",
            m.sh("journalctl -u robota-mcpd -o cat --no-pager | tail -n 30")
                .stdout
        );
    }
    wait_upstream_up(&m, "hostile");
    bearer(&m);
    let pid = main_pid(&m);
    let state: Vec<String> = m
        .ok("find /var/lib/robota-mcpd -maxdepth 1 -type f")
        .lines()
        .map(str::to_owned)
        .collect();
    assert!(
        !state.is_empty(),
        "the daemon keeps files in its state directory"
    );
    let mut read = state.clone();
    read.extend(
        [
            "/etc/robota-mcpd/config.toml",
            "/var/log/journal",
            "/etc/os-release",
        ]
        .map(String::from),
    );
    let listing = [
        "/var/lib/robota-mcpd",
        "/run/robota-mcpd",
        "/var/cache/robota-mcpd",
        "/root",
    ];
    let write = [
        "/var/lib/robota-mcpd",
        "/run/robota-mcpd",
        "/tmp",
        "/var/tmp",
    ];
    let result = tool_result(
        &m,
        "hostile.escape",
        serde_json::json!({
            "read": read, "listing": listing, "write": write,
            "port": 8765, "pid": pid, "control": "/run/robota-mcpd/control.sock",
            "chmod": ["/var/lib/robota-mcpd", "/etc/robota-mcpd/config.toml"],
        }),
    );
    let text = result["content"][0]["text"].as_str().unwrap_or_default();
    let report: serde_json::Map<String, Value> =
        serde_json::from_str(text).unwrap_or_else(|e| panic!("{e}: {result}"));
    for (attempt, outcome) in &report {
        let outcome = outcome.as_str().unwrap_or_default();
        if attempt == "read /etc/os-release" || attempt.starts_with("write own ") {
            assert_eq!(outcome, "allowed", "the system's read-only view");
        } else {
            assert!(
                outcome.starts_with("denied"),
                "{attempt}: {outcome} ({report:?})"
            );
        }
    }
    assert_eq!(
        report.len(),
        read.len() + listing.len() + write.len() + 2 + 15 + 2 + 4,
        "{report:?}"
    );
    assert!(m.read("/var/lib/robota-mcpd/planted-by-upstream").is_none());

    // Its process tree is in a cgroup of its own beneath the unit's, and a process that
    // left its session dies with the daemon when the daemon is killed.
    let left = tool_result(&m, "hostile.fork", serde_json::json!({}));
    let left: i64 = left["content"][0]["text"]
        .as_str()
        .and_then(|t| t.parse().ok())
        .unwrap_or_else(|| panic!("a pid: {left}"));
    let place = m.ok(&format!("grep '^0::' /proc/{left}/cgroup"));
    assert!(
        place.starts_with("0::/system.slice/robota-mcpd.service/upstreams/hostile/"),
        "{place}"
    );
    let daemon = m.ok(&format!("grep '^0::' /proc/{pid}/cgroup"));
    assert_eq!(daemon.trim(), "0::/system.slice/robota-mcpd.service/daemon");
    m.ok(&format!("kill -9 {pid}"));
    wait_for(&m, "MainPID", "a new process", |p| {
        p.parse::<i64>().is_ok_and(|p| p > 0 && p != pid)
    });
    let gone = poll_until_blocking(SETTLE, Duration::from_millis(100), || {
        m.sh(&format!("test -e /proc/{left}")).status.code() != Some(0)
    });
    assert!(gone, "process {left} outlived the killed daemon");
    wait_upstream_up(&m, "hostile");
}

/// Whether the machine's unified cgroup hierarchy offers the memory controller (a host
/// on cgroup v2 alone); where it does not, the package cannot bound an upstream's memory.
fn memory_controller(m: &Machine) -> bool {
    m.sh("cat /sys/fs/cgroup/cgroup.controllers /sys/fs/cgroup/unified/cgroup.controllers 2>/dev/null")
        .stdout
        .split_whitespace()
        .any(|c| c == "memory")
}

/// Waits until `robota-mcpctl upstreams` shows `name` up; panics with the journal's
/// lines about it otherwise.
fn wait_upstream_up(m: &Machine, name: &str) {
    let up = poll_until_blocking(SETTLE, Duration::from_millis(500), || {
        let out = m.sh("robota-mcpctl upstreams");
        out.stdout
            .lines()
            .any(|l| l.starts_with(name) && l.contains(" up "))
    });
    assert!(
        up,
        "upstream {name} never came up: {}\n{}",
        m.sh("robota-mcpctl upstreams").stdout,
        m.sh(&format!(
            "journalctl -u robota-mcpd -o cat --no-pager | grep -e {name} -e exec-upstream | tail -n 20"
        ))
        .stdout
    );
}

/// A Node.js server from npm — the MCP project's filesystem server, pinned — under the
/// packaged unit, configured as docs/operations.md says: the unit unchanged but for the
/// directory it may write (`ReadWritePaths=`), V8's JIT running (the daemon keeps its
/// own W^X), the directory served, and the daemon's state directory, which it is told
/// to serve too, denied by the kernel.
#[test]
fn a_node_server_from_npm_runs_under_the_packaged_unit() {
    let m = installed();
    let (node, _, modules) = robota_e2e::upstream::npm_server("server-filesystem");
    // What `apt install nodejs` and `npm install --prefix /opt/mcp/filesystem …` leave.
    let root = m.root();
    std::fs::create_dir_all(root.join("opt/node/bin")).expect("mkdir");
    std::fs::copy(&node, root.join("opt/node/bin/node")).expect("node in the machine");
    std::fs::create_dir_all(root.join("opt/mcp/filesystem")).expect("mkdir");
    let copied = std::process::Command::new("cp")
        .arg("-a")
        .arg(&modules)
        .arg(root.join("opt/mcp/filesystem/node_modules"))
        .status();
    assert!(copied.is_ok_and(|s| s.success()), "node_modules copied in");
    m.ok(
        "mkdir -p /srv/files && echo 'hello from the host' > /srv/files/hello.txt \
         && chown -R robota-mcpd:robota-mcpd /srv/files",
    );
    m.write(
        "/etc/systemd/system/robota-mcpd.service.d/files.conf",
        b"[Service]\nReadWritePaths=/srv/files\n",
        0o644,
    );
    // As the docs say for a host whose memory controller is on cgroup v1 (this one).
    let memory = if memory_controller(&m) {
        ""
    } else {
        "memory = \"unbounded\"\n"
    };
    write_config(
        &m,
        &packaged_config_with(
            &m,
            &format!(
                "[upstreams.files]\n\
                 command = [\"/opt/node/bin/node\", \"/opt/mcp/filesystem/node_modules/@modelcontextprotocol/server-filesystem/dist/index.js\", \"/srv/files\", \"/var/lib/robota-mcpd\"]\n\
                 write_paths = [\"/srv/files\"]\n{memory}\n\
                 [[policy]]\ncallers = [\"bearer:*\"]\ntools = [\"files.*\"]\ndecision = \"allow\"\n"
            ),
        ),
    );
    m.ok("systemctl daemon-reload && systemctl restart robota-mcpd");
    wait_upstream_up(&m, "files");
    bearer(&m);
    let read = tool_result(
        &m,
        "files.read_text_file",
        serde_json::json!({"path": "/srv/files/hello.txt"}),
    );
    assert!(
        read.to_string().contains("hello from the host") && read["isError"] != true,
        "{read}"
    );
    let write = tool_result(
        &m,
        "files.write_file",
        serde_json::json!({"path": "/srv/files/new.txt", "content": "written by node"}),
    );
    assert_ne!(write["isError"], true, "{write}");
    assert_eq!(
        m.ok("stat -c %U /srv/files/new.txt && cat /srv/files/new.txt"),
        "robota-mcpd\nwritten by node"
    );
    let denied = tool_result(
        &m,
        "files.list_directory",
        serde_json::json!({"path": "/var/lib/robota-mcpd"}),
    );
    assert!(
        denied["isError"] == true && denied.to_string().contains("EACCES"),
        "{denied}"
    );
    // The unit's own hardening is as shipped (check-unit holds it to exposure ≤ 1.5).
    assert_eq!(m.property(UNIT, "NoNewPrivileges"), "yes");
    assert!(
        m.property(UNIT, "SystemCallFilter")
            .contains("landlock_restrict_self")
    );
}

#[test]
fn a_group_member_reaches_the_control_socket_as_the_docs_configure_it() {
    let m = installed();
    // docs/operations.md, "Who may use the control socket": the group, then the uid.
    m.ok("useradd --create-home alice && usermod -aG robota-mcpd alice");
    let uid = m.ok("id -u alice").trim().to_owned();
    let refused = m.sh("runuser -u alice -- robota-mcpctl status");
    assert_eq!(refused.code(), Some(4), "{refused:?}");
    for needed in ["allow_uids", "allow_gids", &format!("uid {uid}")] {
        assert!(
            refused.stderr.contains(needed),
            "the refusal says what admits a peer ({needed}): {}",
            refused.stderr
        );
    }
    let config =
        packaged_config_with(&m, "").replace("allow_uids = []", &format!("allow_uids = [{uid}]"));
    write_config(&m, &config);
    m.ok("systemctl reload robota-mcpd");
    let status = m.ok("runuser -u alice -- robota-mcpctl status");
    assert!(status.contains("serving"), "{status}");
    // Not in the group: the socket file's mode stops it before the daemon sees it.
    m.ok("useradd --create-home bob");
    let bob = m.sh("runuser -u bob -- robota-mcpctl status");
    assert_eq!(bob.code(), Some(4), "{bob:?}");
    assert!(
        bob.stderr.contains("robota-mcpd"),
        "names the group: {}",
        bob.stderr
    );
}

/// The job `service.action` started for `unit`, once it has ended (`robota-mcpctl jobs`).
fn ended_job(m: &Machine, job_id: &Value) -> Value {
    let mut job = Value::Null;
    let ended = poll_until_blocking(SETTLE, Duration::from_millis(200), || {
        let list: Value =
            serde_json::from_str(&m.ok("robota-mcpctl --json jobs list")).expect("jobs list JSON");
        job = list["jobs"]
            .as_array()
            .and_then(|jobs| jobs.iter().find(|j| &j["job_id"] == job_id))
            .cloned()
            .unwrap_or(Value::Null);
        job["state"].as_str().is_some_and(|s| s != "running")
    });
    assert!(ended, "the job did not end: {job}");
    job
}

#[test]
fn service_action_needs_polkitd_and_the_rule_the_docs_give() {
    let m = installed();
    m.write(
        "/etc/systemd/system/demo.service",
        b"[Service]\nExecStart=/bin/sleep 600\n",
        0o644,
    );
    m.ok("systemctl daemon-reload");
    // A minimal Debian has no polkit.
    m.ok("apt-get remove -y polkitd >/dev/null 2>&1");
    write_config(
        &m,
        &packaged_config_with(
            &m,
            "[tools.service]\nunits = [\"demo.service\"]\n\n[[policy]]\ncallers = [\"bearer:default\"]\ntools = [\"service.action\"]\ndecision = \"allow\"\n",
        ),
    );
    let check = m.sh("robota-mcpd check-config");
    assert_eq!(check.code(), Some(0), "{check:?}");
    assert!(
        check.stderr.contains("polkitd is not installed"),
        "check-config warns: {}",
        check.stderr
    );
    m.ok("systemctl reload robota-mcpd");
    bearer(&m);
    let start = serde_json::json!({"unit": "demo.service", "action": "start"});
    let v = tool_result(&m, "service.action", start.clone());
    assert_eq!(v["isError"], false, "{v}");
    let job = ended_job(&m, &v["structuredContent"]["job_id"]);
    assert_eq!(job["state"], "failed", "{job}");
    let detail = job["detail"].as_str().unwrap_or_default();
    assert!(
        detail.contains("AccessDenied") && detail.contains("polkit"),
        "the job says why: {detail}"
    );
    m.sh("systemctl is-active demo.service")
        .expect_code(3, "demo.service stays inactive");

    // polkitd and the rule from packaging/README.md: the same call starts it.
    m.ok("dpkg -i /root/debs/polkitd_*.deb");
    m.write(
        "/etc/polkit-1/rules.d/50-robota-mcpd.rules",
        br#"polkit.addRule(function (action, subject) {
    if (action.id == "org.freedesktop.systemd1.manage-units" &&
        subject.user == "robota-mcpd") {
        var unit = action.lookup("unit");
        if (unit == "demo.service") {
            return polkit.Result.YES;
        }
    }
});
"#,
        0o644,
    );
    let check = m.sh("robota-mcpd check-config");
    assert!(
        !check.stderr.contains("polkitd is not installed"),
        "{}",
        check.stderr
    );
    let v = tool_result(&m, "service.action", start);
    let job = ended_job(&m, &v["structuredContent"]["job_id"]);
    assert_eq!(job["state"], "succeeded", "{job}");
    m.ok("systemctl is-active demo.service");
}

#[test]
fn debian_prometheus_with_the_documented_rules_sees_a_refusal_spike() {
    let m = installed();
    // docs/prometheus.md: the scrape job, then the rules installed as it says.
    let prometheus_yml = m
        .read("/etc/prometheus/prometheus.yml")
        .expect("Debian's prometheus.yml");
    let docs = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../docs/prometheus.md"
    ))
    .expect("docs/prometheus.md");
    let install = docs
        .split("```sh\n")
        .find(|block| block.starts_with("install -D -m 0644 /usr/share/doc/robota-mcpd"))
        .and_then(|block| block.split("```").next())
        .expect("the install commands in docs/prometheus.md");
    // Scraped and evaluated every 2 s, so the test need not wait for Debian's 15 s.
    let config = prometheus_yml
        .replace("evaluation_interval: 15s", "evaluation_interval: 2s")
        .replacen(
            "rule_files:\n",
            "rule_files:\n  - /etc/prometheus/rules/*.yml\n",
            1,
        )
        .replacen(
            "scrape_configs:\n",
            "scrape_configs:\n  - job_name: robota-mcpd\n    scrape_interval: 2s\n    static_configs:\n      - targets: [\"127.0.0.1:9464\"]\n",
            1,
        );
    assert!(config.contains("/etc/prometheus/rules/*.yml"), "{config}");
    m.write("/etc/prometheus/prometheus.yml", config.as_bytes(), 0o644);
    m.ok(&install.replace(
        "systemctl reload prometheus",
        "systemctl restart prometheus",
    ));
    let api = |path: &str| -> Value {
        let out = m.sh(&format!("curl -sf http://127.0.0.1:9090{path}"));
        serde_json::from_str(&out.stdout).unwrap_or(Value::Null)
    };
    let up = poll_until_blocking(Duration::from_secs(60), Duration::from_millis(500), || {
        api("/api/v1/query?query=up%7Bjob%3D%22robota-mcpd%22%7D")["data"]["result"][0]["value"][1]
            == "1"
    });
    assert!(
        up,
        "prometheus never scraped the daemon: {}",
        m.sh("journalctl -u prometheus --no-pager -n 30").stdout
    );
    let rules = api("/api/v1/rules");
    assert!(
        rules.to_string().contains("RobotaMcpdRefusalSpike"),
        "the rules are not loaded: {rules}"
    );
    // An auth-failure flood on the loopback carrier: 40 requests with a wrong bearer.
    m.ok(&format!(
        "for i in $(seq 40); do curl -s -o /dev/null {ENDPOINT} -H 'Authorization: Bearer {}' \
         -H 'Content-Type: application/json' -H 'Accept: application/json, text/event-stream' \
         -d '{{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"ping\"}}'; done",
        "0".repeat(64)
    ));
    let mut alerts = Value::Null;
    let pending = poll_until_blocking(Duration::from_secs(90), Duration::from_millis(500), || {
        alerts = api("/api/v1/alerts");
        alerts["data"]["alerts"].as_array().is_some_and(|list| {
            list.iter().any(|a| {
                a["labels"]["alertname"] == "RobotaMcpdRefusalSpike"
                    && a["labels"]["reason"] == "bad-bearer"
                    && a["labels"]["carrier"] == "loopback"
                    && a["state"] == "pending"
            })
        })
    });
    assert!(
        pending,
        "RobotaMcpdRefusalSpike never went pending: {alerts}"
    );
}

#[test]
fn a_killed_daemon_is_restarted_by_systemd() {
    let m = installed();
    let pid = main_pid(&m);
    assert!(pid > 0);
    m.ok(&format!("kill -9 {pid}"));
    let new = wait_for(&m, "MainPID", "a new process", |p| {
        p.parse::<i64>().is_ok_and(|p| p > 0 && p != pid)
    });
    wait_for(&m, "ActiveState", "active", |s| s == "active");
    assert_eq!(m.property(UNIT, "NRestarts"), "1");
    let log = m.ok("journalctl -u robota-mcpd --no-pager -o cat");
    assert!(log.contains("status=9/KILL"), "{log}");
    assert!(new != pid.to_string());
    assert_serves(&m, "after systemd restarted it");
}

#[test]
fn systemd_sees_the_watchdog_and_acts_when_it_stops() {
    let m = installed();
    m.write(
        "/etc/systemd/system/robota-mcpd.service.d/watchdog.conf",
        b"[Service]\nWatchdogSec=2\nTimeoutAbortSec=2\n",
        0o644,
    );
    m.ok("systemctl daemon-reload && systemctl restart robota-mcpd");
    // The daemon pings at half of WatchdogSec: systemd records each ping.
    let first = m.property(UNIT, "WatchdogTimestampMonotonic");
    let mut seen = vec![first];
    let pinged = poll_until_blocking(Duration::from_secs(10), Duration::from_millis(200), || {
        let now = m.property(UNIT, "WatchdogTimestampMonotonic");
        if seen.last() != Some(&now) {
            seen.push(now);
        }
        seen.len() >= 4
    });
    assert!(pinged, "systemd saw too few watchdog pings: {seen:?}");
    assert_eq!(
        m.property(UNIT, "NRestarts"),
        "0",
        "restarted while pinging"
    );
    // A daemon that stops pinging (frozen) is killed and restarted by systemd.
    let pid = main_pid(&m);
    m.ok(&format!("kill -STOP {pid}"));
    wait_for(&m, "NRestarts", "1", |n| n == "1");
    wait_for(&m, "ActiveState", "active", |s| s == "active");
    let log = m.ok("journalctl -u robota-mcpd --no-pager -o cat");
    assert!(log.contains("Watchdog timeout"), "{log}");
    assert_ne!(main_pid(&m), pid);
}

#[test]
fn the_journal_holds_structured_fields_and_no_secret() {
    let m = installed();
    let secret = bearer(&m);
    let (code, _) = call_system_info(&m);
    assert_eq!(code, "200");
    // A refusal, with a token that looks like a bearer.
    let forged = "5".repeat(64);
    let out = m.sh(&format!(
        "curl -s -o /dev/null -w '%{{http_code}}' {ENDPOINT} -H 'Authorization: Bearer {forged}' \
         -H 'Content-Type: application/json' -H 'Accept: application/json, text/event-stream' \
         -d '{{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"ping\"}}'"
    ));
    assert_eq!(out.stdout, "401");
    m.ok("systemctl reload robota-mcpd");
    let refusal = || {
        m.journal(UNIT)
            .into_iter()
            .find(|r| r["F_REASON"] == "bad-bearer")
    };
    assert!(
        poll_until_blocking(SETTLE, Duration::from_millis(200), || refusal().is_some()),
        "no refusal record in the journal"
    );
    let record = refusal().expect("record");
    assert_eq!(record["SYSLOG_IDENTIFIER"], "robota-mcpd", "{record}");
    assert_eq!(record["_SYSTEMD_UNIT"], UNIT, "{record}");
    assert_eq!(record["F_CARRIER"], "loopback", "{record}");
    assert_eq!(record["F_ADDRESS_CLASS"], "loopback", "{record}");
    assert!(record["PRIORITY"].is_string(), "{record}");
    // Everything the machine logged, every field, and the audit file.
    let everything = m.ok("journalctl --no-pager -o export");
    let audit = m.ok("cat /var/lib/robota-mcpd/audit.jsonl");
    let cmdlines = m.ok("cat /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' ' '");
    let secrets = [secret, forged];
    assert_no_secrets(&secrets, &everything, "the machine's journal");
    assert_no_secrets(&secrets, &audit, "the audit file");
    assert_no_secrets(&secrets, &cmdlines, "the machine's command lines");
}

#[test]
fn the_running_unit_is_rated_at_most_1_5_by_systemd_analyze_security() {
    let m = installed();
    let report = m.ok("systemd-analyze security --no-pager robota-mcpd.service");
    let exposure: f64 = report
        .lines()
        .find_map(|l| {
            l.split_once("Overall exposure level for robota-mcpd.service: ")?
                .1
                .split_whitespace()
                .next()?
                .parse()
                .ok()
        })
        .unwrap_or_else(|| panic!("no overall exposure:\n{report}"));
    assert!(exposure <= 1.5, "exposure {exposure}:\n{report}");
}

#[test]
fn remove_and_purge_leave_nothing_running_and_nothing_behind() {
    let m = installed();
    let pid = main_pid(&m);
    assert!(pid > 0);
    m.ok("robota-mcpctl bearer issue --label ci --ttl 1h --output /root/ci-bearer");
    m.ok("apt-get remove -y robota-mcpd");
    let running = m.sh("pgrep -u robota-mcpd -a").stdout;
    assert!(
        running.trim().is_empty(),
        "left running after remove: {running}"
    );
    assert!(m.read("/usr/bin/robota-mcpd").is_none());
    assert_ne!(m.property(UNIT, "ActiveState"), "active");
    // Remove keeps what the operator made: the configuration and the state.
    assert!(
        m.read("/etc/robota-mcpd/config.toml").is_some(),
        "remove took the conffile"
    );
    m.ok("test -f /var/lib/robota-mcpd/robota.db");

    m.ok("apt-get purge -y robota-mcpd");
    for path in [
        "/etc/robota-mcpd",
        "/var/lib/robota-mcpd",
        "/var/cache/robota-mcpd",
        "/run/robota-mcpd",
        "/etc/systemd/system/multi-user.target.wants/robota-mcpd.service",
        "/var/lib/systemd/deb-systemd-helper-enabled/robota-mcpd.service.dsh-also",
        "/var/lib/systemd/deb-systemd-helper-enabled/multi-user.target.wants/robota-mcpd.service",
        "/usr/lib/systemd/system/robota-mcpd.service",
    ] {
        m.sh(&format!("test ! -e {path}"))
            .expect_code(0, &format!("{path} is left after purge"));
    }
    let left = m.sh("dpkg -s robota-mcpd").code();
    assert_ne!(left, Some(0), "dpkg still knows the package");
    let units = m.ok("systemctl list-units --all --no-legend 'robota-mcpd*'");
    assert!(units.trim().is_empty(), "units left: {units}");
    // Debian policy keeps the system user (files it owned may remain elsewhere).
    m.ok("getent passwd robota-mcpd >/dev/null");
}

#[test]
fn an_upgrade_restarts_it_and_gives_back_what_a_run_as_root_left() {
    let m = installed();
    let deb = package();
    let name = deb
        .file_name()
        .expect("name")
        .to_string_lossy()
        .into_owned();
    let reinstall = format!("apt-get install -y --reinstall /root/{name}");
    // An upgrade of a running daemon restarts it (the configuration passes check-config).
    let pid = main_pid(&m);
    m.sh(&reinstall)
        .expect_code(0, "apt-get install --reinstall");
    wait_for(&m, "ActiveState", "active", |s| s == "active");
    assert_ne!(main_pid(&m), pid, "the upgrade restarted the daemon");
    assert_serves(&m, "after the upgrade");

    // A run by hand as root left a file the daemon's user cannot open: the unit cannot
    // start (the journal says why and how to fix it); the upgrade gives the file back and
    // starts it. A symbolic link there is never followed: its target stays root's.
    m.ok("systemctl stop robota-mcpd \
          && install -m 0600 -o root -g root /dev/null /var/lib/robota-mcpd/jwks-cache.json \
          && install -m 0600 /dev/null /root/victim \
          && ln -s /root/victim /var/lib/robota-mcpd/audit.jsonl.tmp");
    assert_ne!(m.sh("systemctl start robota-mcpd").code(), Some(0));
    let log = m.ok("journalctl -u robota-mcpd --no-pager -o cat");
    assert!(
        log.contains("jwks-cache.json"),
        "the journal names the file: {log}"
    );
    let out = m.sh(&reinstall);
    out.expect_code(0, "apt-get install --reinstall over root's left-overs");
    let said = format!("{}{}", out.stdout, out.stderr);
    assert!(
        said.contains("jwks-cache.json was owned by uid:gid 0:0"),
        "postinst says what it gave back: {said}"
    );
    assert_eq!(
        m.ok("stat -c '%U:%G' /var/lib/robota-mcpd/jwks-cache.json")
            .trim(),
        "robota-mcpd:robota-mcpd"
    );
    assert_eq!(m.ok("stat -c '%U' /root/victim").trim(), "root");
    wait_for(&m, "ActiveState", "active", |s| s == "active");
    assert_serves(&m, "after the upgrade gave the files back");

    // With an invalid configuration the upgrade does not restart it: the running daemon
    // keeps serving its old configuration, and postinst says why.
    let pid = main_pid(&m);
    write_config(&m, "[loopback]\nlisten = 8765\n");
    let out = m.sh(&reinstall);
    out.expect_code(
        0,
        "apt-get install --reinstall with an invalid configuration",
    );
    let said = format!("{}{}", out.stdout, out.stderr);
    assert!(
        said.contains("not starting robota-mcpd.service with an invalid configuration"),
        "{said}"
    );
    assert_eq!(main_pid(&m), pid, "restarted onto an invalid configuration");
    assert_serves(&m, "after an upgrade that kept the old configuration");
}
