//! The in-process ring: the daemon planned and started inside the test process
//! (`daemon::start`), on port 0 and temp-dir sockets, stopped through its shutdown token —
//! for the many cases that need real sockets but no separate process. The black-box ring
//! (tests/tests, the real binaries) keeps what needs one: exit codes, signals, readiness,
//! the CLI, crashes.

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use robota_mcpd::config::{Environment, parse};
use robota_mcpd::daemon::{self, Plan, Running};
use robota_proto::{Command, Outcome, Reply, Request, Response};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpStream, UnixStream};

const LIMIT: Duration = Duration::from_secs(10);

/// A daemon in this process with its own directories, serving `extra` configuration.
struct Ring {
    running: Running,
    _dir: tempfile::TempDir,
}

impl Ring {
    async fn start(extra: &str) -> Ring {
        let dir = tempfile::tempdir().expect("tempdir");
        let d = dir.path().display();
        let text = format!(
            "[daemon]\nstate_dir = \"{d}/state\"\nruntime_dir = \"{d}/run\"\n\
             [loopback]\nlisten = \"127.0.0.1:0\"\n[metrics]\nlisten = \"127.0.0.1:0\"\n{extra}"
        );
        let config = parse(&text, &Environment::default()).expect("config");
        let plan = Plan::build(config, robota_mcpd::metrics::Metrics::new()).expect("plan");
        let running = tokio::time::timeout(LIMIT, daemon::start(plan))
            .await
            .expect("start within the bound")
            .expect("start");
        Ring { running, _dir: dir }
    }

    fn addr(&self, name: &str) -> SocketAddr {
        self.running
            .address(name)
            .and_then(|a| a.parse().ok())
            .unwrap_or_else(|| panic!("no {name} listener: {:?}", self.running.places))
    }

    /// One control command over the control socket.
    async fn control(&self, command: Command) -> Reply {
        let path = self.running.address("control").expect("control socket");
        let stream = UnixStream::connect(Path::new(path)).await.expect("connect");
        let (read, mut write) = stream.into_split();
        let mut line = serde_json::to_vec(&Request::new(command)).expect("encode");
        line.push(b'\n');
        write.write_all(&line).await.expect("write");
        let mut answer = String::new();
        tokio::time::timeout(LIMIT, BufReader::new(read).read_line(&mut answer))
            .await
            .expect("an answer")
            .expect("read");
        let response: Response = serde_json::from_str(&answer).expect("a response");
        match response.outcome {
            Outcome::Ok(reply) => *reply,
            Outcome::Error(e) => panic!("control error: {e:?}"),
        }
    }

    async fn bearer(&self) -> String {
        match self
            .control(Command::BearerIssue {
                label: None,
                ttl_secs: None,
            })
            .await
        {
            Reply::Bearer { secret, .. } => secret.expose().to_owned(),
            other => panic!("{other:?}"),
        }
    }
}

/// A raw HTTP/1.1 exchange; the status and the body.
async fn exchange(addr: SocketAddr, head: &str, body: &str) -> (u16, String) {
    let mut stream = TcpStream::connect(addr).await.expect("connect");
    let request = format!(
        "{head}Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes()).await.expect("write");
    let mut answer = Vec::new();
    tokio::time::timeout(LIMIT, stream.read_to_end(&mut answer))
        .await
        .expect("an answer")
        .expect("read");
    let text = String::from_utf8_lossy(&answer).into_owned();
    let status = text
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status in {text:?}"));
    let body = text
        .split_once("\r\n\r\n")
        .map_or(String::new(), |(_, b)| b.to_owned());
    (status, body)
}

fn mcp_head(_addr: SocketAddr, host: &str, bearer: Option<&str>, origin: Option<&str>) -> String {
    let mut head = format!(
        "POST /mcp HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n\
         Accept: application/json, text/event-stream\r\nMCP-Protocol-Version: 2025-11-25\r\n"
    );
    if let Some(b) = bearer {
        head.push_str(&format!("Authorization: Bearer {b}\r\n"));
    }
    if let Some(o) = origin {
        head.push_str(&format!("Origin: {o}\r\n"));
    }
    head
}

const LIST: &str = r#"{"jsonrpc":"2.0","id":1,"method":"tools/list"}"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loopback_admission_answers_each_case_and_books_it() {
    let ring = Ring::start("").await;
    let addr = ring.addr("loopback");
    let bearer = ring.bearer().await;
    let host = format!("127.0.0.1:{}", addr.port());
    let origin = format!("http://{host}");
    let wrong = "ab".repeat(32);
    // (case, Host, bearer, Origin, status)
    type Case<'a> = (&'a str, &'a str, Option<&'a str>, Option<&'a str>, u16);
    let cases: [Case; 6] = [
        ("served", &host, Some(&bearer), Some(&origin), 200),
        ("no origin is fine", &host, Some(&bearer), None, 200),
        ("wrong host", "localhost", Some(&bearer), None, 403),
        (
            "wrong origin",
            &host,
            Some(&bearer),
            Some("http://evil"),
            403,
        ),
        ("no bearer", &host, None, None, 401),
        ("wrong bearer", &host, Some(&wrong), None, 401),
    ];
    for (case, host, bearer, origin, want) in cases {
        let (status, body) = exchange(addr, &mcp_head(addr, host, bearer, origin), LIST).await;
        assert_eq!(status, want, "{case}: {body}");
        if want != 200 {
            assert!(body.is_empty(), "{case}: a refusal has an empty body");
        }
    }
    // Each refusal is booked once (audit and counters agree in status).
    let Reply::Status(status) = ring.control(Command::Status).await else {
        panic!("no status")
    };
    let counts = &status.refusals_last_hour;
    assert_eq!(counts.get("wrong-host"), Some(&1), "{counts:?}");
    assert_eq!(counts.get("wrong-origin"), Some(&1), "{counts:?}");
    assert_eq!(counts.get("missing-token"), Some(&1), "{counts:?}");
    assert_eq!(counts.get("bad-bearer"), Some(&1), "{counts:?}");
    let loopback = status
        .carriers
        .iter()
        .find(|c| c.name == "loopback")
        .expect("loopback");
    assert_eq!(
        (loopback.admitted, loopback.refused),
        (Some(2), Some(4)),
        "{loopback:?}"
    );
    ring.running.stop().await.expect("a clean stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_daemons_share_a_process_and_stop_cleanly() {
    let (a, b) = tokio::join!(Ring::start(""), Ring::start(""));
    assert_ne!(a.addr("loopback"), b.addr("loopback"));
    let (bearer_a, bearer_b) = tokio::join!(a.bearer(), b.bearer());
    assert_ne!(bearer_a, bearer_b, "each attach mints its own host bearer");
    // A's bearer is nothing to B.
    let addr = b.addr("loopback");
    let host = format!("127.0.0.1:{}", addr.port());
    let (status, _) = exchange(addr, &mcp_head(addr, &host, Some(&bearer_a), None), LIST).await;
    assert_eq!(status, 401);
    let (status, body) = exchange(addr, &mcp_head(addr, &host, Some(&bearer_b), None), LIST).await;
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("system.info"), "{body}");
    let (ra, rb) = tokio::join!(a.running.stop(), b.running.stop());
    ra.expect("a stops");
    rb.expect("b stops");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_attaches_a_fresh_session_with_new_bearers() {
    let ring = Ring::start("").await;
    let before = ring.bearer().await;
    let Reply::Restarted { status } = ring.control(Command::Restart).await else {
        panic!("no restart")
    };
    assert_eq!(status.generation, 1);
    let after = ring.bearer().await;
    assert_ne!(before, after);
    // The listening socket is kept across the restart, even on port 0.
    let addr: SocketAddr = status
        .carriers
        .iter()
        .find(|c| c.name == "loopback")
        .and_then(|c| c.address.parse().ok())
        .expect("loopback address");
    assert_eq!(addr, ring.addr("loopback"), "the same socket serves on");
    let host = format!("127.0.0.1:{}", addr.port());
    let (status, _) = exchange(addr, &mcp_head(addr, &host, Some(&before), None), LIST).await;
    assert_eq!(status, 401, "the old host bearer died with its attach");
    ring.running.stop().await.expect("a clean stop");
}
