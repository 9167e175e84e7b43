//! The Debian package under the real systemd: each test boots a fresh Debian 12 with
//! systemd as PID 1 (`robota_e2e::machine`), installs the `.deb` with apt as an operator
//! does, and drives it with `systemctl`, `journalctl`, `systemd-analyze` and
//! `robota-mcpctl` inside the machine.
//!
//! Not part of a plain `cargo test` (`test = false` in tests/Cargo.toml): it needs root,
//! `systemd-nspawn` and the package. `tests/run` builds the package and runs it:
//! `cargo test --workspace --release --test system`.

use std::time::Duration;

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

#[test]
fn reload_applies_a_valid_configuration_and_a_broken_one_changes_nothing() {
    let m = installed();
    let pid = main_pid(&m);
    bearer(&m);
    // A valid change: the metrics listener moves.
    write_config(
        &m,
        &packaged_config_with(&m, "").replace("127.0.0.1:9464", "127.0.0.1:9465"),
    );
    m.ok("systemctl reload robota-mcpd");
    assert!(
        poll_until_blocking(SETTLE, Duration::from_millis(100), || {
            m.sh("curl -sf http://127.0.0.1:9465/metrics >/dev/null")
                .status
                .success()
        }),
        "the reloaded metrics listener does not answer"
    );
    assert_eq!(main_pid(&m), pid, "a reload is not a restart");
    wait_for(&m, "ActiveState", "active", |s| s == "active");

    // A broken file: the running configuration stays, and says so.
    write_config(&m, "[loopback\nlisten = \"127.0.0.1:8765\"\n");
    m.sh("systemctl reload robota-mcpd");
    wait_for(&m, "ActiveState", "active", |s| s == "active");
    let status = m.ok("robota-mcpctl status");
    assert!(
        status.contains("FAILED"),
        "status shows the refused reload:\n{status}"
    );
    assert_eq!(main_pid(&m), pid);
    m.ok("curl -sf http://127.0.0.1:9465/metrics >/dev/null");
    assert_serves(&m, "after a refused reload");
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
