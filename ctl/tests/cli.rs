//! Black-box tests of the real `robota-mcpctl` binary against a stand-in daemon that speaks
//! the real wire protocol on a unix socket in a temp dir.

use std::collections::BTreeMap;
use std::fs;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::process::{Command as Process, Output};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use robota_proto::{
    BearerInfo, CarrierStatus, Command, ErrorCode, Reply, Request, Response, SOCKET_ENV, Secret,
    Status, exit,
};
use tempfile::TempDir;

const SECRET: &str = "rbt_test_5ecret_Zq9xT4";

/// A one-shot stand-in daemon: accepts one connection, optionally reads one request line,
/// answers one canned line, and hands back the decoded request.
struct StandIn {
    dir: TempDir,
    socket: PathBuf,
    handle: Option<JoinHandle<Result<Option<Command>, String>>>,
}

impl StandIn {
    fn answering(response: &Response) -> Self {
        let line = serde_json::to_string(response).expect("encode response");
        Self::raw(line, true)
    }

    /// Answers `line` (a newline is appended); with `read_first == false` it answers and
    /// closes without reading, as the daemon does for a refused peer.
    fn raw(line: String, read_first: bool) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let socket = dir.path().join("control.sock");
        let listener = UnixListener::bind(&socket).expect("bind");
        let handle = thread::spawn(move || serve_once(&listener, &line, read_first));
        Self {
            dir,
            socket,
            handle: Some(handle),
        }
    }

    /// The request the CLI sent (None when the stand-in did not read it).
    fn request(&mut self) -> Option<Command> {
        let handle = self.handle.take().expect("request() is called once");
        match handle.join() {
            Ok(Ok(request)) => request,
            Ok(Err(problem)) => panic!("stand-in daemon: {problem}"),
            Err(_) => panic!("stand-in daemon panicked"),
        }
    }
}

fn serve_once(
    listener: &UnixListener,
    answer: &str,
    read_first: bool,
) -> Result<Option<Command>, String> {
    // Poll accept with a deadline so a CLI that never connects fails the test, not hangs it.
    listener.set_nonblocking(true).map_err(|e| e.to_string())?;
    let deadline = Instant::now() + Duration::from_secs(20);
    let stream = loop {
        match listener.accept() {
            Ok((stream, _)) => break stream,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() > deadline {
                    return Err("the CLI never connected".into());
                }
                thread::sleep(Duration::from_millis(5));
            }
            Err(e) => return Err(format!("accept: {e}")),
        }
    };
    stream.set_nonblocking(false).map_err(|e| e.to_string())?;
    stream
        .set_read_timeout(Some(Duration::from_secs(20)))
        .map_err(|e| e.to_string())?;
    let request = if read_first {
        let mut line = String::new();
        BufReader::new(&stream)
            .read_line(&mut line)
            .map_err(|e| format!("read request: {e}"))?;
        let Some(frame) = line.strip_suffix('\n') else {
            return Err(format!("request not newline-terminated: {line:?}"));
        };
        if frame.len() > robota_proto::MAX_REQUEST_BYTES {
            return Err("request frame too large".into());
        }
        Some(decode_request(frame)?)
    } else {
        None
    };
    (&stream)
        .write_all(format!("{answer}\n").as_bytes())
        .map_err(|e| format!("write answer: {e}"))?;
    Ok(request)
}

/// Decodes a request frame the way the daemon does and checks it is the canonical
/// encoding, field for field.
fn decode_request(frame: &str) -> Result<Command, String> {
    let request =
        Request::decode(frame.as_bytes()).map_err(|(code, e)| format!("{code}: {e}: {frame}"))?;
    let canonical = serde_json::to_string(&request).map_err(|e| e.to_string())?;
    let given: serde_json::Value = serde_json::from_str(frame).map_err(|e| e.to_string())?;
    let canonical: serde_json::Value =
        serde_json::from_str(&canonical).map_err(|e| e.to_string())?;
    if canonical != given {
        return Err(format!("request is not canonical: {frame}"));
    }
    Ok(request.command)
}

fn ctl(args: &[&str]) -> Output {
    ctl_with(args, |_| {})
}

fn ctl_with(args: &[&str], tweak: impl FnOnce(&mut Process)) -> Output {
    let mut process = Process::new(env!("CARGO_BIN_EXE_robota-mcpctl"));
    process.args(args).env_remove(SOCKET_ENV);
    tweak(&mut process);
    process.output().expect("run robota-mcpctl")
}

fn socket_arg(path: &Path) -> &str {
    path.to_str().expect("utf-8 temp path")
}

fn code(output: &Output) -> i32 {
    output.status.code().expect("exited, not signalled")
}

fn stdout(output: &Output) -> String {
    String::from_utf8(output.stdout.clone()).expect("utf-8 stdout")
}

fn stderr(output: &Output) -> String {
    String::from_utf8(output.stderr.clone()).expect("utf-8 stderr")
}

fn sample_status() -> Status {
    Status {
        version: "0.1.0".into(),
        pid: 4242,
        uptime_secs: 3723,
        state: "serving".into(),
        generation: 0,
        carriers: vec![
            CarrierStatus {
                name: "loopback".into(),
                address: "127.0.0.1:8765".into(),
                public_url: None,
                admitted: Some(10),
                refused: Some(1),
            },
            CarrierStatus {
                name: "remote".into(),
                address: "0.0.0.0:8443".into(),
                public_url: Some("https://mcp.example.com/mcp".into()),
                admitted: Some(5),
                refused: Some(4),
            },
        ],
        catalog_size: 12,
        submission_tool: "agent_submit".into(),
        active_turn: false,
        running_jobs: 0,
        pending_grants: 0,
        bearer_count: 2,
        refusals_last_hour: BTreeMap::from([("bad-token".into(), 4), ("no-token".into(), 1)]),
        key_set: None,
        config: None,
        state_dir: String::new(),
        last_reload: None,
        health: "ok".into(),
        problems: Vec::new(),
        upstreams: Vec::new(),
    }
}

fn bearer_reply(label: &str) -> Response {
    Response::ok(Reply::Bearer {
        label: label.into(),
        secret: Secret(SECRET.into()),
        expires_at: None,
    })
}

#[test]
fn no_socket_means_not_running() {
    let dir = tempfile::tempdir().expect("tempdir");
    let socket = dir.path().join("absent.sock");
    let out = ctl(&["--socket", socket_arg(&socket), "status"]);
    assert_eq!(code(&out), exit::NOT_RUNNING, "{}", stderr(&out));
    let err = stderr(&out);
    assert!(err.starts_with("robota-mcpctl: "), "{err}");
    assert!(err.contains("not running"), "{err}");
    assert!(err.contains(socket_arg(&socket)), "{err}");
    assert!(out.stdout.is_empty());
}

#[test]
fn a_socket_nobody_listens_on_means_not_running() {
    let dir = tempfile::tempdir().expect("tempdir");
    let socket = dir.path().join("stale.sock");
    drop(UnixListener::bind(&socket).expect("bind"));
    assert!(socket.exists(), "the stale socket file stays behind");
    let out = ctl(&["--socket", socket_arg(&socket), "status"]);
    assert_eq!(code(&out), exit::NOT_RUNNING, "{}", stderr(&out));
}

#[test]
fn a_permission_denied_refusal_exits_4() {
    let refusal = Response::error(ErrorCode::PermissionDenied, "uid 1000 is not allowed");
    let mut daemon = StandIn::raw(serde_json::to_string(&refusal).expect("encode"), false);
    let out = ctl(&["--socket", socket_arg(&daemon.socket), "status"]);
    daemon.request();
    assert_eq!(code(&out), exit::PERMISSION_DENIED, "{}", stderr(&out));
    assert_eq!(
        stderr(&out),
        "robota-mcpctl: permission-denied: uid 1000 is not allowed\n"
    );
}

#[test]
fn bearer_issue_prints_the_secret_alone() {
    let mut daemon = StandIn::answering(&bearer_reply("default"));
    let out = ctl(&["--socket", socket_arg(&daemon.socket), "bearer", "issue"]);
    let request = daemon.request();
    assert_eq!(code(&out), exit::OK, "{}", stderr(&out));
    assert_eq!(stdout(&out), format!("{SECRET}\n"));
    assert!(!stderr(&out).contains(SECRET));
    assert_eq!(
        request,
        Some(Command::BearerIssue {
            label: None,
            ttl_secs: None
        })
    );
}

#[test]
fn bearer_issue_sends_label_and_ttl_in_seconds() {
    let mut daemon = StandIn::answering(&bearer_reply("ci"));
    let out = ctl(&[
        "--socket",
        socket_arg(&daemon.socket),
        "bearer",
        "issue",
        "--label",
        "ci",
        "--ttl",
        "10m",
    ]);
    let request = daemon.request();
    assert_eq!(code(&out), exit::OK, "{}", stderr(&out));
    assert_eq!(
        request,
        Some(Command::BearerIssue {
            label: Some("ci".into()),
            ttl_secs: Some(600)
        })
    );
}

#[test]
fn bearer_issue_output_writes_a_new_0600_file_and_never_overwrites() {
    let mut daemon = StandIn::answering(&bearer_reply("ci"));
    let socket = socket_arg(&daemon.socket).to_owned();
    let target = daemon.dir.path().join("ci.token");
    let args = [
        "--socket",
        &socket,
        "bearer",
        "issue",
        "--label",
        "ci",
        "--output",
        socket_arg(&target),
    ];
    let out = ctl(&args);
    daemon.request();
    assert_eq!(code(&out), exit::OK, "{}", stderr(&out));
    assert!(!stdout(&out).contains(SECRET), "secret leaked to stdout");
    let err = stderr(&out);
    assert!(!err.contains(SECRET), "secret leaked to stderr");
    assert!(err.contains("\"ci\""), "{err}");
    assert!(err.contains(socket_arg(&target)), "{err}");
    let mode = fs::metadata(&target)
        .expect("metadata")
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600);
    assert_eq!(
        fs::read_to_string(&target).expect("read"),
        format!("{SECRET}\n")
    );

    // Again: the file exists, so the CLI refuses before contacting the daemon (nobody
    // listens any more, which would be exit 3 had it connected).
    let before = fs::read(&target).expect("read");
    let again = ctl(&args);
    assert_eq!(code(&again), exit::FAILED, "{}", stderr(&again));
    assert!(
        stderr(&again).contains("refusing to overwrite"),
        "{}",
        stderr(&again)
    );
    assert!(!stderr(&again).contains(SECRET));
    assert!(again.stdout.is_empty());
    assert_eq!(fs::read(&target).expect("read"), before);
}

#[test]
fn a_refused_issue_leaves_no_output_file() {
    let mut daemon = StandIn::answering(&Response::error(ErrorCode::Conflict, "label ci exists"));
    let target = daemon.dir.path().join("ci.token");
    let out = ctl(&[
        "--socket",
        socket_arg(&daemon.socket),
        "bearer",
        "issue",
        "--label",
        "ci",
        "--output",
        socket_arg(&target),
    ]);
    daemon.request();
    assert_eq!(code(&out), exit::FAILED, "{}", stderr(&out));
    assert_eq!(stderr(&out), "robota-mcpctl: conflict: label ci exists\n");
    assert!(!target.exists(), "the unused output file must be removed");
}

#[test]
fn bearer_rotate_prints_the_new_secret_alone() {
    let mut daemon = StandIn::answering(&bearer_reply("default"));
    let out = ctl(&["--socket", socket_arg(&daemon.socket), "bearer", "rotate"]);
    assert_eq!(daemon.request(), Some(Command::BearerRotate));
    assert_eq!(code(&out), exit::OK, "{}", stderr(&out));
    assert_eq!(stdout(&out), format!("{SECRET}\n"));
}

#[test]
fn json_bearer_issue_prints_the_reply_with_its_secret() {
    let mut daemon = StandIn::answering(&bearer_reply("default"));
    let out = ctl(&[
        "--socket",
        socket_arg(&daemon.socket),
        "--json",
        "bearer",
        "issue",
    ]);
    daemon.request();
    assert_eq!(code(&out), exit::OK, "{}", stderr(&out));
    let reply: Reply = serde_json::from_str(stdout(&out).trim_end()).expect("reply JSON");
    assert_eq!(
        reply,
        Reply::Bearer {
            label: "default".into(),
            secret: Secret(SECRET.into()),
            expires_at: None
        }
    );
}

#[test]
fn json_status_prints_the_status_object_on_one_line() {
    let mut daemon = StandIn::answering(&Response::ok(Reply::Status(sample_status())));
    let out = ctl(&["--json", "--socket", socket_arg(&daemon.socket), "status"]);
    assert_eq!(daemon.request(), Some(Command::Status));
    assert_eq!(code(&out), exit::OK, "{}", stderr(&out));
    let text = stdout(&out);
    assert_eq!(text.lines().count(), 1, "{text}");
    let status: Status = serde_json::from_str(&text).expect("Status JSON");
    assert_eq!(status, sample_status());
    let value: serde_json::Value = serde_json::from_str(&text).expect("JSON");
    assert_eq!(value["kind"], "status");
}

#[test]
fn human_status_shows_carriers_and_refusals() {
    let mut daemon = StandIn::answering(&Response::ok(Reply::Status(sample_status())));
    let out = ctl(&["--socket", socket_arg(&daemon.socket), "status"]);
    daemon.request();
    assert_eq!(code(&out), exit::OK, "{}", stderr(&out));
    let text = stdout(&out);
    for needle in [
        "4242",
        "serving",
        "1h 2m 3s",
        "agent_submit",
        "127.0.0.1:8765",
        "https://mcp.example.com/mcp",
        "bad-token",
        "no-token",
    ] {
        assert!(text.contains(needle), "{needle:?} missing from\n{text}");
    }
}

#[test]
fn bearer_list_is_a_table_with_rfc3339_times() {
    let mut daemon = StandIn::answering(&Response::ok(Reply::Bearers {
        bearers: vec![
            BearerInfo {
                label: "default".into(),
                created_at: 1_700_000_000,
                expires_at: None,
                last_used_at: None,
            },
            BearerInfo {
                label: "ci".into(),
                created_at: 1_700_000_000,
                expires_at: Some(1_700_086_400),
                last_used_at: Some(1_700_000_060),
            },
        ],
    }));
    let out = ctl(&["--socket", socket_arg(&daemon.socket), "bearer", "list"]);
    assert_eq!(daemon.request(), Some(Command::BearerList));
    assert_eq!(code(&out), exit::OK, "{}", stderr(&out));
    let text = stdout(&out);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 3, "{text}");
    assert!(lines[0].starts_with("LABEL"), "{text}");
    assert!(
        lines[1].starts_with("default  2023-11-14T22:13:20Z  -"),
        "{text}"
    );
    assert!(lines[2].contains("2023-11-15T22:13:20Z"), "{text}");
    assert!(lines[2].ends_with("2023-11-14T22:14:20Z"), "{text}");
}

#[test]
fn bearer_revoke_of_an_unknown_label_exits_1() {
    let mut daemon = StandIn::answering(&Response::error(ErrorCode::NotFound, "no bearer \"ci\""));
    let out = ctl(&[
        "--socket",
        socket_arg(&daemon.socket),
        "bearer",
        "revoke",
        "ci",
    ]);
    assert_eq!(
        daemon.request(),
        Some(Command::BearerRevoke { label: "ci".into() })
    );
    assert_eq!(code(&out), exit::FAILED, "{}", stderr(&out));
    assert_eq!(stderr(&out), "robota-mcpctl: not-found: no bearer \"ci\"\n");
    assert!(out.stdout.is_empty());
}

#[test]
fn stop_and_restart_send_their_commands() {
    let mut daemon = StandIn::answering(&Response::ok(Reply::Stopping));
    let out = ctl(&["--socket", socket_arg(&daemon.socket), "stop"]);
    assert_eq!(daemon.request(), Some(Command::Stop));
    assert_eq!(code(&out), exit::OK, "{}", stderr(&out));

    let mut status = sample_status();
    status.generation = 1;
    let mut daemon = StandIn::answering(&Response::ok(Reply::Restarted { status }));
    let out = ctl(&["--socket", socket_arg(&daemon.socket), "restart"]);
    assert_eq!(daemon.request(), Some(Command::Restart));
    assert_eq!(code(&out), exit::OK, "{}", stderr(&out));
    assert!(stdout(&out).contains("generation 1"), "{}", stdout(&out));
}

#[test]
fn bad_usage_exits_2_without_contacting_anyone() {
    let dir = tempfile::tempdir().expect("tempdir");
    let socket = dir.path().join("absent.sock");
    let socket = socket_arg(&socket);
    for args in [
        &["--socket", socket, "frobnicate"][..],
        &["--socket", socket, "bearer"],
        &["--socket", socket, "bearer", "revoke"],
        &[
            "--socket", socket, "bearer", "issue", "--label", "ci", "--ttl", "soon",
        ],
        &["--socket", socket, "bearer", "issue", "--ttl", "10m"],
        &["--socket", socket, "status", "--secret", "x"],
    ] {
        let out = ctl(args);
        assert_eq!(code(&out), exit::USAGE, "{args:?}: {}", stderr(&out));
        assert!(out.stdout.is_empty(), "{args:?}");
    }
}

#[test]
fn replies_we_do_not_understand_exit_5() {
    for answer in [
        r#"{"v":2,"ok":{"kind":"stopping"}}"#.to_owned(),
        "hello".to_owned(),
        // The wrong kind for the command.
        serde_json::to_string(&Response::ok(Reply::Stopping)).expect("encode"),
    ] {
        let mut daemon = StandIn::raw(answer.clone(), true);
        let out = ctl(&["--socket", socket_arg(&daemon.socket), "status"]);
        daemon.request();
        assert_eq!(code(&out), exit::PROTOCOL, "{answer}: {}", stderr(&out));
        assert!(out.stdout.is_empty());
    }
}

#[test]
fn the_socket_comes_from_the_environment_or_the_runtime_dir() {
    let mut daemon = StandIn::answering(&Response::ok(Reply::Stopping));
    let socket = daemon.socket.clone();
    let out = ctl_with(&["stop"], |p| {
        p.env(SOCKET_ENV, &socket);
    });
    daemon.request();
    assert_eq!(code(&out), exit::OK, "{}", stderr(&out));

    // $XDG_RUNTIME_DIR/robota-mcpd/control.sock when it exists.
    let runtime = tempfile::tempdir().expect("tempdir");
    fs::create_dir(runtime.path().join("robota-mcpd")).expect("mkdir");
    let socket = runtime.path().join("robota-mcpd").join("control.sock");
    let listener = UnixListener::bind(&socket).expect("bind");
    let answer = serde_json::to_string(&Response::ok(Reply::Stopping)).expect("encode");
    let server = thread::spawn(move || serve_once(&listener, &answer, true));
    let out = ctl_with(&["stop"], |p| {
        p.env("XDG_RUNTIME_DIR", runtime.path());
    });
    let request = server.join().expect("join").expect("stand-in");
    assert_eq!(request, Some(Command::Stop));
    assert_eq!(code(&out), exit::OK, "{}", stderr(&out));
}

#[test]
fn every_command_has_help_with_an_example() {
    let commands: [&[&str]; 8] = [
        &[],
        &["status"],
        &["bearer", "issue"],
        &["bearer", "list"],
        &["bearer", "revoke"],
        &["bearer", "rotate"],
        &["stop"],
        &["restart"],
    ];
    for command in commands {
        let mut args = command.to_vec();
        args.push("--help");
        let out = ctl(&args);
        assert_eq!(code(&out), exit::OK, "{args:?}");
        let text = stdout(&out);
        assert!(text.contains("Example"), "{args:?}:\n{text}");
    }
}

/// Text a hostile caller can put into what the daemon reports: a right-to-left override
/// that reverses the rest of the line, isolates and marks, zero-width characters, a BOM,
/// an ANSI sequence that clears the screen, a C1 CSI, a bell, a line break and a tab.
const HOSTILE: &str =
    "ok\u{202e}txt.exe\u{2066}\u{2069}\u{200f}\u{200b}\u{feff}\x1b[2J\u{9b}31m\x07\nFAKE LINE\t\\";

/// What [`HOSTILE`] must look like in human output.
const SHOWN: &str = r"ok\u{202e}txt.exe\u{2066}\u{2069}\u{200f}\u{200b}\u{feff}\u{1b}[2J\u{9b}31m\u{7}\nFAKE LINE\t\\";

/// Characters of [`HOSTILE`] that must never reach the terminal raw.
fn raw_hostile(text: &str) -> Vec<char> {
    text.chars()
        .filter(|&c| {
            c != '\n'
                && (c.is_control()
                    || "\u{202e}\u{2066}\u{2069}\u{200f}\u{200b}\u{feff}".contains(c))
        })
        .collect()
}

fn hostile_grant() -> robota_proto::GrantRecord {
    robota_proto::GrantRecord {
        grant_id: 7,
        caller: format!("bearer:{HOSTILE}"),
        kind: robota_proto::GrantKind::Elevation,
        reason: HOSTILE.into(),
        scope: vec![format!("file.{HOSTILE}")],
        duration_secs: 60,
        state: robota_proto::GrantState::Pending,
        requested_at: 1_700_000_000,
        decided_at: None,
        decided_by: Some(HOSTILE.into()),
        expires_at: None,
        tool: None,
        arguments: None,
        args_sha256: None,
        used_at: None,
    }
}

/// An approval of one call whose tool and arguments are hostile too.
fn hostile_call() -> robota_proto::GrantRecord {
    robota_proto::GrantRecord {
        kind: robota_proto::GrantKind::Call,
        tool: Some(format!("file.{HOSTILE}")),
        arguments: Some(serde_json::json!({"content": HOSTILE, HOSTILE: [HOSTILE]})),
        args_sha256: Some(HOSTILE.into()),
        ..hostile_grant()
    }
}

fn hostile_job() -> robota_proto::JobRecord {
    robota_proto::JobRecord {
        job_id: 3,
        owner: format!("oauth:{HOSTILE}"),
        kind: HOSTILE.into(),
        target: HOSTILE.into(),
        action: Some(HOSTILE.into()),
        state: robota_proto::JobState::Failed,
        created_at: 1_700_000_000,
        finished_at: None,
        exit_code: Some(1),
        detail: Some(HOSTILE.into()),
        output_bytes: 0,
        output_dropped: 0,
    }
}

/// Runs `args` against a stand-in answering `reply`; returns stdout and stderr.
fn against(reply: &Response, args: &[&str]) -> (i32, String, String) {
    let mut daemon = StandIn::answering(reply);
    let mut full = vec!["--socket", socket_arg(&daemon.socket)];
    full.extend_from_slice(args);
    let out = ctl(&full);
    daemon.request();
    (code(&out), stdout(&out), stderr(&out))
}

#[test]
fn human_output_escapes_every_caller_controlled_string() {
    let mut status = sample_status();
    status.submission_tool = HOSTILE.into();
    status.key_set = Some(Box::new(robota_proto::KeySetStatus {
        source: robota_proto::KeySourceKind::JwksUri,
        location: Some(HOSTILE.into()),
        keys: 1,
        from_cache: false,
        fetched_at: None,
        last_attempt_at: None,
        last_error: None,
        next_refresh_at: None,
        refreshing: false,
    }));
    status.refusals_last_hour = BTreeMap::from([(HOSTILE.to_owned(), 1)]);
    let record = robota_proto::AuditRecord {
        seq: 1,
        time: 1_700_000_000,
        carrier: "session".into(),
        reason: "grant-requested".into(),
        throttled: false,
        address_class: "unknown".into(),
        grant: Some(robota_proto::GrantRef {
            grant_id: 7,
            caller: HOSTILE.into(),
            by: HOSTILE.into(),
            tool: Some(HOSTILE.into()),
        }),
        upstream: None,
        count: None,
    };
    let cases: Vec<(Response, Vec<&str>, usize)> = vec![
        (
            Response::ok(Reply::Grants {
                grants: vec![hostile_grant()],
            }),
            vec!["grants", "list"],
            2,
        ),
        (
            Response::ok(Reply::Grant {
                grant: Box::new(hostile_grant()),
            }),
            vec!["grants", "deny", "7"],
            1,
        ),
        (
            Response::ok(Reply::Grants {
                grants: vec![hostile_call()],
            }),
            vec!["grants", "list"],
            2,
        ),
        (
            Response::ok(Reply::Grant {
                grant: Box::new(hostile_call()),
            }),
            // Eight fields, `arguments:` and the arguments' six lines of indented JSON.
            vec!["grants", "show", "7"],
            15,
        ),
        (
            Response::ok(Reply::Jobs {
                jobs: vec![hostile_job()],
            }),
            vec!["jobs", "list"],
            2,
        ),
        (
            Response::ok(Reply::Job { job: hostile_job() }),
            vec!["jobs", "cancel", "3"],
            1,
        ),
        (
            Response::ok(Reply::Bearers {
                bearers: vec![BearerInfo {
                    label: HOSTILE.into(),
                    created_at: 0,
                    expires_at: None,
                    last_used_at: None,
                }],
            }),
            vec!["bearer", "list"],
            2,
        ),
        (
            Response::ok(Reply::Revoked {
                label: HOSTILE.into(),
            }),
            vec!["bearer", "revoke", "x"],
            1,
        ),
        (
            Response::ok(Reply::Audit {
                records: vec![record],
                last_seq: 1,
            }),
            vec!["audit"],
            1,
        ),
    ];
    for (reply, args, lines) in cases {
        let (exit_code, out, err) = against(&reply, &args);
        assert_eq!(exit_code, exit::OK, "{args:?}: {err}");
        assert_eq!(
            raw_hostile(&out),
            Vec::<char>::new(),
            "{args:?} printed raw:\n{out}"
        );
        assert!(
            out.contains(SHOWN),
            "{args:?} does not show the text escaped:\n{out}"
        );
        assert_eq!(out.lines().count(), lines, "{args:?} split a line:\n{out}");
    }
    let (exit_code, out, _) = against(&Response::ok(Reply::Status(status)), &["status"]);
    assert_eq!(exit_code, exit::OK);
    assert_eq!(
        raw_hostile(&out),
        Vec::<char>::new(),
        "status printed raw:\n{out}"
    );
    assert_eq!(out.matches(SHOWN).count(), 3, "{out}");

    // Errors from the daemon, and replies that do not parse, reach stderr escaped too.
    let (exit_code, out, err) = against(&Response::error(ErrorCode::NotFound, HOSTILE), &["stop"]);
    assert_eq!(exit_code, exit::FAILED);
    assert!(out.is_empty());
    assert_eq!(err, format!("robota-mcpctl: not-found: {SHOWN}\n"));
    let mut daemon = StandIn::raw(
        format!(
            r#"{{"v":1,"ok":{{"kind":{}}}}}"#,
            serde_json::to_string(HOSTILE).unwrap()
        ),
        true,
    );
    let out = ctl(&["--socket", socket_arg(&daemon.socket), "stop"]);
    daemon.request();
    assert_eq!(code(&out), exit::PROTOCOL);
    assert_eq!(
        raw_hostile(&stderr(&out)),
        Vec::<char>::new(),
        "{}",
        stderr(&out)
    );
    assert_eq!(stderr(&out).lines().count(), 1, "{}", stderr(&out));
}

#[test]
fn json_output_stays_exact() {
    let reply = Reply::Grants {
        grants: vec![hostile_grant()],
    };
    let (exit_code, out, err) =
        against(&Response::ok(reply.clone()), &["--json", "grants", "list"]);
    assert_eq!(exit_code, exit::OK, "{err}");
    assert_eq!(out.lines().count(), 1, "{out}");
    let back: Reply = serde_json::from_str(&out).expect("JSON reply");
    assert_eq!(back, reply, "--json must carry the text exactly");
    assert!(
        out.contains('\u{202e}'),
        "JSON keeps non-control characters as they are"
    );
}

#[test]
fn audit_shows_an_aggregate_with_its_count() {
    let record = |seq, count| robota_proto::AuditRecord {
        seq,
        time: 1_700_000_000,
        carrier: "loopback".into(),
        reason: "bad-bearer".into(),
        throttled: false,
        address_class: "loopback".into(),
        grant: None,
        upstream: None,
        count,
    };
    let reply = Reply::Audit {
        records: vec![record(41, None), record(42, Some(19_873))],
        last_seq: 42,
    };
    let (exit_code, out, err) = against(&Response::ok(reply.clone()), &["audit"]);
    assert_eq!(exit_code, exit::OK, "{err}");
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 2, "{out}");
    assert!(!lines[0].contains('×'), "{out}");
    assert!(
        lines[1].contains("#42") && lines[1].contains("×19873"),
        "{out}"
    );
    let (_, out, _) = against(&Response::ok(reply), &["--json", "audit"]);
    let lines: Vec<serde_json::Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).expect("one JSON record per line"))
        .collect();
    assert_eq!(lines[0].get("count"), None, "a plain record has no count");
    assert_eq!(lines[1]["count"], 19_873);
}
