//! The control plane as `robota-mcpctl` users see it: SO_PEERCRED checks, exit codes,
//! `status`, bearer issue/list/ttl/--output, socket mode.

use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::time::Duration;

use robota_e2e::http::{Request, exchange, tools_list};
use robota_e2e::secrets::is_bearer_text;
use robota_e2e::{Daemon, poll_until_async};
use serde_json::Value;

const NOBODY: u32 = 65534;

/// Opens the socket (and its directory) to everyone, so only SO_PEERCRED decides.
fn open_socket_to_all(d: &Daemon) {
    fs::set_permissions(d.runtime_dir(), fs::Permissions::from_mode(0o755)).expect("chmod run dir");
    fs::set_permissions(d.socket_path(), fs::Permissions::from_mode(0o666)).expect("chmod socket");
}

#[test]
fn peer_uid_not_allowed_gets_exit_4() {
    let d = Daemon::start("");
    open_socket_to_all(&d);
    let out = d.ctl_as(NOBODY, NOBODY, &["status"]);
    out.expect_code(4, "status as uid 65534 without allow_uids");
    assert!(
        out.stdout.is_empty() || !out.stdout.contains("uptime"),
        "{}",
        out.stdout
    );
    // The refused peer got nothing; root still gets served, and sees the refusal.
    let st = d.status();
    let control = st
        .carriers
        .iter()
        .find(|c| c.name == "control")
        .expect("control");
    assert_eq!(control.refused, Some(1), "{control:?}");
    let out = d.ctl_as(NOBODY, NOBODY, &["bearer", "issue"]);
    out.expect_code(4, "bearer issue as uid 65534 without allow_uids");
    assert!(
        !out.stdout.lines().any(is_bearer_text),
        "a refused peer must not receive a bearer"
    );
}

#[test]
fn allow_uids_admits_that_uid() {
    let d = Daemon::start("[control]\nallow_uids = [65534]\n");
    open_socket_to_all(&d);
    d.ctl_as(NOBODY, NOBODY, &["status"])
        .expect_code(0, "status as uid 65534 with allow_uids = [65534]");
}

#[test]
fn allow_gids_admits_that_gid() {
    let d = Daemon::start("[control]\nallow_gids = [65534]\n");
    open_socket_to_all(&d);
    d.ctl_as(NOBODY, NOBODY, &["status"])
        .expect_code(0, "status as gid 65534 with allow_gids = [65534]");
    // Another uid in another group stays out.
    d.ctl_as(NOBODY - 1, NOBODY - 1, &["status"])
        .expect_code(4, "status as uid/gid 65533 with allow_gids = [65534]");
}

#[test]
fn control_socket_is_mode_0660() {
    let d = Daemon::start("");
    let meta = fs::metadata(d.socket_path()).expect("socket exists");
    assert_eq!(
        meta.mode() & 0o777,
        0o660,
        "control socket mode {:o}",
        meta.mode() & 0o777
    );
}

#[test]
fn ctl_exit_codes_distinguish_failures() {
    let d = Daemon::start("");
    // Not running: a socket path nobody listens on.
    let mut cmd = std::process::Command::new(robota_e2e::mcpctl_bin());
    cmd.arg("--socket")
        .arg(d.dir().join("nope.sock"))
        .arg("status")
        .env_clear();
    robota_e2e::daemon::run_bounded(cmd, Duration::from_secs(20))
        .expect_code(3, "status against a socket nobody listens on");
    d.ctl(&["frobnicate"]).expect_code(2, "unknown subcommand");
    d.ctl(&["bearer", "issue", "--ttl", "soon"])
        .expect_code(2, "unparseable --ttl");
    d.ctl(&["bearer", "revoke", "never-issued"])
        .expect_code(1, "revoke of an unknown label");
    // An audit filter naming no reason is an error that lists the reasons, not an empty
    // answer that reads as "nothing was refused".
    let out = d.ctl(&["audit", "--reason", "no-such-reason"]);
    out.expect_code(1, "audit --reason with an unknown reason");
    assert!(
        out.stderr.contains("no-such-reason") && out.stderr.contains("bad-bearer"),
        "{}",
        out.stderr
    );
}

#[test]
fn status_reports_carriers_and_session() {
    let d = Daemon::start("");
    let _ = d.bearer();
    let st = d.status();
    assert_eq!(st.pid, d.pid() as u32);
    assert_eq!(st.state, "serving");
    assert_eq!(st.generation, 0);
    assert_eq!(st.submission_tool, "agent_submit");
    assert!(st.catalog_size >= 2, "catalog_size {}", st.catalog_size);
    assert!(!st.active_turn);
    assert!(st.bearer_count >= 1, "bearer_count {}", st.bearer_count);
    assert!(!st.version.is_empty());
    for name in ["loopback", "metrics", "control"] {
        assert!(
            st.carriers.iter().any(|c| c.name == name),
            "status lacks the {name} carrier: {:?}",
            st.carriers
        );
    }
    let control = st
        .carriers
        .iter()
        .find(|c| c.name == "control")
        .expect("control");
    assert_eq!(control.address, d.socket_path().display().to_string());
    // Control requests are counted: at least this `status` and the harness's own.
    assert!(control.admitted.is_some_and(|n| n >= 2), "{control:?}");
    assert_eq!(control.refused, Some(0), "{control:?}");
    let lo = st
        .carriers
        .iter()
        .find(|c| c.name == "loopback")
        .expect("loopback");
    assert!(lo.address.starts_with("127.0.0.1:"), "{lo:?}");
    // The human form names the loopback address too.
    let human = d.ctl_ok(&["status"]);
    assert!(human.stdout.contains(&lo.address), "{}", human.stdout);
    d.assert_no_secrets();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bearer_issue_output_writes_a_new_0600_file() {
    let d = Daemon::start("");
    let path = d.dir().join("ci.token");
    let path_s = path.display().to_string();
    let out = d.ctl_ok(&["bearer", "issue", "--label", "ci", "--output", &path_s]);
    let content = fs::read_to_string(&path).expect("--output file");
    let secret = content.trim_end_matches('\n').to_owned();
    assert!(is_bearer_text(&secret), "--output file holds no bearer");
    d.register_secret(&secret);
    assert!(
        !out.stdout.contains(&secret),
        "--output must keep the bearer off stdout"
    );
    let mode = fs::metadata(&path).expect("meta").mode() & 0o777;
    assert_eq!(mode, 0o600, "--output file mode {mode:o}");
    let addr = d.loopback_addr();
    let resp = exchange(
        addr,
        &Request::mcp(addr.port(), Some(&secret), &tools_list(1)),
    )
    .await;
    assert_eq!(
        resp.status,
        200,
        "bearer from --output: {}",
        resp.describe()
    );

    // An existing file is never overwritten.
    let out = d.ctl(&["bearer", "issue", "--label", "ci2", "--output", &path_s]);
    assert_ne!(
        out.code(),
        Some(0),
        "--output onto an existing file must fail"
    );
    assert_eq!(
        fs::read_to_string(&path).expect("file"),
        content,
        "existing file changed"
    );
    d.assert_no_secrets();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bearer_list_shows_metadata_never_secrets() {
    let d = Daemon::start("");
    let _host = d.bearer();
    let _ci = d.bearer_labeled("ci");
    let _ttl = d.take_ttl_bearer("short", "10m");
    let out = d.ctl_ok(&["--json", "bearer", "list"]);
    let v: Value = serde_json::from_str(&out.stdout).expect("bearer list JSON");
    let bearers = v
        .get("bearers")
        .and_then(Value::as_array)
        .unwrap_or_else(|| panic!("no bearers array: {v}"));
    let find = |label: &str| {
        bearers
            .iter()
            .find(|b| b["label"] == label)
            .unwrap_or_else(|| panic!("{label} not listed: {v}"))
    };
    assert!(find("ci")["expires_at"].is_null(), "{v}");
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_secs();
    let exp = find("short")["expires_at"]
        .as_u64()
        .unwrap_or_else(|| panic!("{v}"));
    assert!(
        (now + 500..=now + 700).contains(&exp),
        "--ttl 10m gives expires_at about now + 600: {exp} vs {now}"
    );
    let human = d.ctl_ok(&["bearer", "list"]);
    assert!(
        human.stdout.contains("ci") && human.stdout.contains("short"),
        "{}",
        human.stdout
    );
    d.assert_no_secrets();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bearer_with_ttl_expires() {
    let d = Daemon::start("");
    let short = d.take_ttl_bearer("short", "2s");
    let addr = d.loopback_addr();
    let status = || async {
        exchange(
            addr,
            &Request::mcp(addr.port(), Some(&short), &tools_list(1)),
        )
        .await
        .status
    };
    assert_eq!(status().await, 200, "a fresh ttl bearer works");
    let expired = poll_until_async(
        Duration::from_secs(15),
        Duration::from_millis(200),
        || async { status().await == 401 },
    )
    .await;
    assert!(expired, "a bearer with --ttl 2s still works after 15 s");
    d.assert_no_secrets();
}

/// Extension used by these tests: a labelled bearer with a ttl.
trait TtlBearer {
    fn take_ttl_bearer(&self, label: &str, ttl: &str) -> String;
}

impl TtlBearer for Daemon {
    fn take_ttl_bearer(&self, label: &str, ttl: &str) -> String {
        let out = self.ctl_ok(&["bearer", "issue", "--label", label, "--ttl", ttl]);
        let secret = out.stdout.strip_suffix('\n').unwrap_or_default().to_owned();
        assert!(
            is_bearer_text(&secret),
            "bearer issue --ttl printed no bearer"
        );
        self.register_secret(&secret);
        secret
    }
}

/// Sends raw bytes on the control socket and reads one reply line (bounded).
fn control_exchange(d: &Daemon, bytes: &[u8]) -> String {
    use std::io::{BufRead, BufReader, Write};
    let mut s = std::os::unix::net::UnixStream::connect(d.socket_path()).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    s.set_write_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    // The daemon may answer and close before reading everything.
    let _ = s.write_all(bytes);
    let mut line = String::new();
    let _ = BufReader::new(s).read_line(&mut line);
    line
}

#[test]
fn control_frames_are_limited_to_64_kib() {
    use robota_proto::{ErrorCode, MAX_REQUEST_BYTES, Outcome, Reply, Response};
    let d = Daemon::start("");
    let frame = |len: usize| {
        let mut f = br#"{"v":1,"cmd":"status"}"#.to_vec();
        f.resize(len - 1, b' ');
        f.push(b'\n');
        f
    };
    let at = control_exchange(&d, &frame(MAX_REQUEST_BYTES));
    let resp: Response = serde_json::from_str(at.trim())
        .unwrap_or_else(|e| panic!("reply to a 64 KiB frame ({e}): {at:?}"));
    assert!(
        matches!(&resp.outcome, Outcome::Ok(reply) if matches!(**reply, Reply::Status(_))),
        "a frame of exactly 64 KiB is served: {resp:?}"
    );
    let over = control_exchange(&d, &frame(MAX_REQUEST_BYTES + 1));
    let resp: Response = serde_json::from_str(over.trim())
        .unwrap_or_else(|e| panic!("reply to a 64 KiB + 1 frame ({e}): {over:?}"));
    match resp.outcome {
        Outcome::Error(e) => assert_eq!(e.code, ErrorCode::TooLarge, "{e:?}"),
        other => panic!("a frame over 64 KiB must be refused: {other:?}"),
    }
    d.ctl_ok(&["status"]);
}

/// A frame that names a key twice (`cmd` here) is refused as a bad request and does
/// nothing: JSON parsers disagree on which of the two wins.
#[test]
fn control_frames_with_a_repeated_key_are_refused() {
    use robota_proto::{ErrorCode, Outcome, Response};
    let d = Daemon::start("");
    for frame in [
        &br#"{"v":1,"cmd":"status","cmd":"stop"}"#[..],
        br#"{"v":1,"cmd":"stop","cmd":"status"}"#,
        br#"{"v":1,"cmd":"status","\u0063md":"stop"}"#,
    ] {
        let mut line = frame.to_vec();
        line.push(b'\n');
        let answer = control_exchange(&d, &line);
        let resp: Response = serde_json::from_str(answer.trim())
            .unwrap_or_else(|e| panic!("reply to {frame:?} ({e}): {answer:?}"));
        match resp.outcome {
            Outcome::Error(e) => {
                assert_eq!(e.code, ErrorCode::BadRequest, "{e:?}");
                assert!(e.message.contains("duplicate key"), "{e:?}");
            }
            other => panic!("a frame with a repeated key must be refused: {other:?}"),
        }
    }
    // Nothing stopped: the daemon still answers, as the same process.
    assert!(d.try_exit().is_none(), "the daemon exited");
    let st = d.status();
    assert_eq!(st.pid, d.pid() as u32);
    assert_eq!(st.state, "serving");
}

/// A TTL meets the clock checked: `--ttl 0` is bad usage in the CLI and `ttl_secs: 0` a
/// bad request from the daemon; a TTL past the documented maximum, or past what a clock
/// can hold (`300000000000y`), is `bad-request` instead of a panic. Nothing is minted and
/// the daemon keeps answering.
#[test]
fn absurd_bearer_ttls_are_refused_and_the_daemon_keeps_serving() {
    use robota_proto::{ErrorCode, Outcome, Response};
    let d = Daemon::start("");
    d.ctl(&["bearer", "issue", "--label", "zero", "--ttl", "0s"])
        .expect_code(2, "--ttl 0s");
    for ttl in ["300000000000y", "366d"] {
        let out = d.ctl(&["bearer", "issue", "--label", "huge", "--ttl", ttl]);
        out.expect_code(1, &format!("bearer issue --ttl {ttl}"));
        assert!(
            out.stderr
                .contains("bad-request: a bearer's ttl must be between 1s and 365d"),
            "{}",
            out.stderr
        );
        assert!(!out.stdout.lines().any(is_bearer_text), "{}", out.stdout);
    }
    for ttl in [0, u64::MAX] {
        let frame =
            format!("{{\"v\":1,\"cmd\":\"bearer-issue\",\"label\":\"raw\",\"ttl_secs\":{ttl}}}\n");
        let answer = control_exchange(&d, frame.as_bytes());
        let resp: Response = serde_json::from_str(answer.trim())
            .unwrap_or_else(|e| panic!("reply to ttl_secs {ttl} ({e}): {answer:?}"));
        match resp.outcome {
            Outcome::Error(e) => assert_eq!(e.code, ErrorCode::BadRequest, "{e:?}"),
            other => panic!("ttl_secs {ttl} must be refused: {other:?}"),
        }
    }
    assert!(d.try_exit().is_none(), "the daemon exited");
    let st = d.status();
    assert_eq!(st.state, "serving");
    assert_eq!(st.bearer_count, 1, "only the host bearer: {st:?}");
    // The edge itself is fine.
    let year = d.take_ttl_bearer("year", "365d");
    assert!(is_bearer_text(&year));
    let out = d.ctl_ok(&["--json", "bearer", "list"]);
    let reply: Value = serde_json::from_str(&out.stdout).expect("bearers JSON");
    let entry = reply["bearers"]
        .as_array()
        .and_then(|b| b.iter().find(|b| b["label"] == "year"))
        .unwrap_or_else(|| panic!("no bearer \"year\": {reply}"));
    assert!(entry["expires_at"].as_u64().is_some(), "{reply}");
}

/// An allowed peer that holds connections with requests that never end (a frame trickled
/// in) gets at most its own share; root and other allowed uids are still served.
#[test]
fn one_allowed_peer_holding_connections_cannot_lock_others_out() {
    use std::io::BufRead;
    use std::os::unix::process::CommandExt;
    let d = Daemon::start("[control]\nallow_uids = [65534, 65533]\n");
    open_socket_to_all(&d);
    // uid 65534 opens 70 connections, each with a request begun and never finished.
    let script = r#"
import socket, sys, time
held, refused, said = [], 0, ""
for _ in range(70):
    s = socket.socket(socket.AF_UNIX)
    s.connect(sys.argv[1])
    try:
        s.sendall(b'{"v":1,"command"')
    except (BrokenPipeError, ConnectionResetError):
        pass  # refused and closed before the frame began: its refusal is still there to read
    held.append(s)
for s in held:
    s.settimeout(0.5)
    try:
        data = s.recv(4096)
    except socket.timeout:
        continue
    if data:
        refused += 1
        said = data.decode()
print(f"held {70 - refused} refused {refused} {said.strip()}", flush=True)
time.sleep(60)
"#;
    let mut holder = std::process::Command::new("python3")
        .arg("-c")
        .arg(script)
        .arg(d.socket_path())
        .uid(NOBODY)
        .gid(NOBODY)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("python3");
    let mut line = String::new();
    std::io::BufReader::new(holder.stdout.take().expect("stdout"))
        .read_line(&mut line)
        .expect("the holder's report");
    // Root and another allowed uid are served while the holder holds what it got.
    let root = d.ctl(&["status"]);
    let other = d.ctl_as(NOBODY - 1, NOBODY - 1, &["status"]);
    let _ = holder.kill();
    let _ = holder.wait();
    assert!(line.starts_with("held 16 refused 54 "), "{line}");
    assert!(
        line.contains("uid 65534 holds 16"),
        "the refusal says which bound: {line}"
    );
    root.expect_code(0, "status as root while uid 65534 holds its connections");
    other.expect_code(
        0,
        "status as uid 65533 while uid 65534 holds its connections",
    );
}

/// A reload that removes a uid from `allow_uids` ends what that uid can do on a control
/// connection it opened before: its next request is refused, and the connection closed.
#[test]
fn a_reload_that_removes_a_peer_refuses_its_open_connection() {
    use std::io::{BufRead, Write};
    use std::os::unix::process::CommandExt;
    let d = Daemon::start("[control]\nallow_uids = [65534]\n");
    open_socket_to_all(&d);
    let script = r#"
import socket, sys
s = socket.socket(socket.AF_UNIX)
s.connect(sys.argv[1])
f = s.makefile("rwb")
def ask():
    f.write(b'{"v":1,"cmd":"status"}\n'); f.flush()
    return f.readline().decode().strip()
print(ask()[:40], flush=True)
sys.stdin.readline()
print(ask(), flush=True)
"#;
    let mut holder = std::process::Command::new("python3")
        .arg("-c")
        .arg(script)
        .arg(d.socket_path())
        .uid(NOBODY)
        .gid(NOBODY)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("python3");
    let mut out = std::io::BufReader::new(holder.stdout.take().expect("stdout"));
    let mut first = String::new();
    out.read_line(&mut first).expect("the first answer");
    assert!(first.contains("\"ok\""), "allowed at first: {first}");
    let config = fs::read_to_string(d.config_path()).expect("config");
    fs::write(
        d.config_path(),
        config.replace("allow_uids = [65534]", "allow_uids = []"),
    )
    .expect("write config");
    d.ctl_ok(&["reload"]);
    holder
        .stdin
        .take()
        .expect("stdin")
        .write_all(b"go\n")
        .expect("go");
    let mut second = String::new();
    out.read_line(&mut second).expect("the second answer");
    let _ = holder.wait();
    assert!(
        second.contains("permission-denied") && second.contains("uid 65534"),
        "the removed peer's open connection: {second}"
    );
}
