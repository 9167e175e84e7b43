//! The request path under attack, with real sockets against the real binaries: what a peer
//! can hold and for how long (every byte before a request head under the head deadline,
//! idle HTTP/2 closed, a full listener that gives its oldest idle slot to a newcomer, caps
//! per client address, fast refusals at the cap), the memory a body may cost, strict
//! JSON-RPC answers with the request's id, request limits on the line carriers, HTTP/2
//! header caps, and the counters that show each of them.

use std::net::SocketAddr;
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use robota_e2e::h2::{self, H2Conn, TestBody};
use robota_e2e::http::{
    Conn, Request, Response, exchange, tool_error_code, tools_call, tools_list, try_exchange,
};
use robota_e2e::{
    Daemon, mcpctl_bin, mcpd_bin, metric_sum, poll_until, poll_until_async, procs, within,
};
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

const QUICK: Duration = Duration::from_secs(5);
/// What "served promptly" means while a flood runs.
const PROMPT: Duration = Duration::from_secs(1);

/// A connection that sent `bytes` and then nothing.
async fn stall(addr: SocketAddr, bytes: &[u8]) -> Conn {
    let mut conn = Conn::connect(addr).await.expect("connect");
    if !bytes.is_empty() {
        conn.write(bytes).await.expect("write");
    }
    conn
}

/// Whether the daemon closes `conn` within `limit`.
async fn closed_within(conn: &mut Conn, limit: Duration) -> bool {
    tokio::time::timeout(limit, conn.read_to_close())
        .await
        .is_ok()
}

fn metric(d: &Daemon, parts: &[&str]) -> f64 {
    metric_sum(&d.metrics_text().expect("metrics"), parts)
}

fn served(resp: &Response, case: &str) {
    assert_eq!(resp.status, 200, "{case}: {}", resp.describe());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_byte_before_a_head_is_under_the_head_deadline() {
    let d = Daemon::builder()
        .loopback("header_timeout = \"1s\"")
        .start();
    let addr = d.loopback_addr();
    let bearer = d.bearer();
    // The preface, then an empty SETTINGS frame.
    let preface_and_settings = [h2::PREFACE, &h2::frame(0x4, 0, 0, &[])].concat();
    let kinds: [&[u8]; 4] = [b"", b"P", h2::PREFACE, &preface_and_settings];
    // Every slot (64) held by a peer that is silent, sent one byte, the HTTP/2 preface, or
    // the preface and its SETTINGS.
    let mut stalled = Vec::new();
    for i in 0..64 {
        stalled.push(stall(addr, kinds[i % 4]).await);
    }
    let started = Instant::now();
    let resp = within(
        QUICK,
        "a request while every slot is held",
        exchange(
            addr,
            &Request::mcp(addr.port(), Some(&bearer), &tools_list(1)),
        ),
    )
    .await;
    served(&resp, "while every slot is held by stalled peers");
    assert!(
        started.elapsed() < PROMPT,
        "a legitimate client waited {:?}",
        started.elapsed()
    );
    // Each of them is closed by its head deadline (1 s from accept), whatever it sent.
    for (i, conn) in stalled.iter_mut().enumerate() {
        assert!(
            closed_within(conn, Duration::from_secs(3)).await,
            "stalled peer {i} (sent {:?}) still open",
            String::from_utf8_lossy(kinds[i % 4])
        );
    }
    let cut = metric(
        &d,
        &[
            "robota_mcpd_connections_total",
            "listener=\"loopback\"",
            "outcome=\"head-timeout\"",
        ],
    ) + metric(
        &d,
        &[
            "robota_mcpd_connections_total",
            "listener=\"loopback\"",
            "outcome=\"evicted\"",
        ],
    );
    assert!(cut >= 64.0, "{cut} stalled connections counted");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_http2_connection_is_closed_and_an_open_stream_keeps_it() {
    let d = Daemon::builder()
        .loopback("idle_timeout = \"1s\"")
        .loopback("body_timeout = \"3s\"")
        .start();
    let addr = d.loopback_addr();
    let bearer = d.bearer();
    let list = serde_json::to_vec(&tools_list(1)).expect("json");
    let mut h2 = H2Conn::connect(addr).await;
    let (status, _) = h2
        .post(Some(&bearer), &[], TestBody::full(list.clone()))
        .await
        .expect("h2 tools/list");
    assert_eq!(status, 200);
    assert!(
        poll_until(QUICK, Duration::from_millis(50), || h2.is_closed()).await,
        "an HTTP/2 connection with no open stream was kept past its idle time"
    );
    assert!(
        metric(
            &d,
            &["robota_mcpd_connections_total", "outcome=\"idle-timeout\""]
        ) >= 1.0
    );
    // A stream that stays open (a body that never comes) keeps its connection past the
    // idle time: it is answered 408 at the body deadline, 3 s in.
    let mut h2 = H2Conn::connect(addr).await;
    let started = Instant::now();
    let (status, _) = h2
        .post(Some(&bearer), &[], TestBody::Never)
        .await
        .expect("h2 request with a body that never comes");
    assert_eq!(status, 408);
    assert!(
        started.elapsed() >= Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
}

/// A daemon with `loopback` lines whose `file.read` of a 4 MiB file gives an answer of
/// about 8.4 MB (the text twice: content and structured content) — more than the
/// daemon's send buffer (at most 4 MiB here) and a small window together — and a peer
/// with a 4096-byte window that has asked for it with the daemon's bearer and `headers`.
async fn big_answer_asked(
    loopback: &[&str],
    headers: &[(&str, &str)],
) -> (Daemon, tempfile::TempDir, Conn) {
    let root = tempfile::tempdir().expect("tempdir");
    std::fs::write(
        root.path().join("big.txt"),
        "f".repeat(4 * 1024 * 1024 - 1024),
    )
    .expect("seed");
    let mut builder = Daemon::builder();
    for line in loopback {
        builder = builder.loopback(*line);
    }
    let d = builder
        .extra(format!(
            "[tools.file]\nread_roots = [\"{}\"]\n\n[limits]\ntool_result = \"16MiB\"\n",
            root.path().display()
        ))
        .start();
    let addr = d.loopback_addr();
    let path = root.path().join("big.txt").display().to_string();
    let read = tools_call(1, "file.read", json!({"path": path}));
    let mut request = Request::mcp(addr.port(), Some(&d.bearer()), &read);
    for (name, value) in headers {
        request = request.header(name, value);
    }
    let mut conn = Conn::connect_small_window(addr, 4096)
        .await
        .expect("connect");
    conn.write(&request.to_bytes())
        .await
        .expect("write the request");
    (d, root, conn)
}

/// A peer that asks for a large answer and never reads it loses its connection once the
/// daemon's writes have waited `idle_timeout` for it, and with it the slot it held: its
/// caller, at its share of one, is served again. The stall is booked `send-timeout`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_nobody_reads_gives_its_slot_back_at_the_idle_deadline() {
    let (d, _root, mut stalled) = big_answer_asked(
        &["idle_timeout = \"1s\"", "max_in_flight_per_caller = 1"],
        &[],
    )
    .await;
    let addr = d.loopback_addr();
    let bearer = d.bearer();
    // While the answer waits for its reader, the caller's one slot is taken.
    let probe = Request::mcp(addr.port(), Some(&bearer), &tools_list(2));
    let held = poll_until_async(QUICK, Duration::from_millis(20), || {
        let probe = &probe;
        async move { exchange(addr, probe).await.status == 503 }
    })
    .await;
    assert!(held, "the unread answer never held its caller's slot");
    let started = Instant::now();
    let freed = poll_until_async(QUICK, Duration::from_millis(50), || {
        let probe = &probe;
        async move { exchange(addr, probe).await.status == 200 }
    })
    .await;
    assert!(
        freed,
        "the slot of an answer nobody reads was never given back"
    );
    assert!(
        started.elapsed() >= Duration::from_millis(500),
        "given back after {:?}, before the idle deadline",
        started.elapsed()
    );
    assert_eq!(
        metric(
            &d,
            &[
                "robota_mcpd_connections_total",
                "listener=\"loopback\"",
                "outcome=\"send-timeout\""
            ]
        ),
        1.0
    );
    // What the peer gets is a cut answer, never a whole one.
    let got = tokio::time::timeout(QUICK, stalled.read_to_close())
        .await
        .expect("the stalled connection was closed");
    assert!(got.len() < 8 * 1024 * 1024, "{} bytes", got.len());
}

/// A peer that reads its large answer slowly but steadily is never cut by the send limit,
/// however long the kernel lets the daemon's writes wait between wake-ups (it wakes a
/// writer only once a good part of a send buffer of up to 4 MiB is free: here about once
/// a second, twice the limit).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_steady_reader_gets_its_whole_answer() {
    let (d, _root, mut reader) =
        big_answer_asked(&["idle_timeout = \"500ms\""], &[("Connection", "close")]).await;
    // About 1.3 MB/s: the 8 MiB answer takes about six seconds.
    let got = tokio::time::timeout(
        Duration::from_secs(60),
        reader.read_to_close_slowly(128 * 1024, Duration::from_millis(100)),
    )
    .await
    .expect("the answer ended");
    let text = String::from_utf8_lossy(&got);
    let body = text.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    let rpc: Value = serde_json::from_str(body).unwrap_or_else(|e| {
        panic!(
            "the slow reader got {} bytes, not a whole answer: {e}",
            got.len()
        )
    });
    assert_eq!(
        tool_error_code(&rpc),
        None,
        "{}",
        &text[..text.len().min(300)]
    );
    assert_eq!(
        metric(
            &d,
            &["robota_mcpd_connections_total", "outcome=\"send-timeout\""]
        ),
        0.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_peers_cannot_lock_out_a_scrape() {
    let d = Daemon::start("");
    let addr = d.metrics_addr();
    // The metrics listener has 8 slots; 16 peers send `P` and stop. A connection whose
    // bytes the daemon has not read yet is never evicted (it may hold a whole head), so
    // the first eight are opened and read before the next eight come.
    let mut stalled = Vec::new();
    for _ in 0..8 {
        stalled.push(stall(addr, b"P").await);
    }
    assert!(
        poll_until(QUICK, Duration::from_millis(10), || read_by_server(
            addr.port()
        ) == 8)
        .await,
        "the daemon never read the first eight peers' byte"
    );
    for _ in 0..8 {
        stalled.push(stall(addr, b"P").await);
    }
    // The later eight took the first eight's slots, oldest first.
    for (i, conn) in stalled.iter_mut().take(8).enumerate() {
        assert!(
            closed_within(conn, QUICK).await,
            "stalled peer {i} kept its slot"
        );
    }
    assert!(
        poll_until(QUICK, Duration::from_millis(10), || read_by_server(
            addr.port()
        ) == 8)
        .await,
        "the daemon never read the later eight peers' byte"
    );
    let started = Instant::now();
    let text = d
        .metrics_text()
        .expect("a scrape while stalled peers hold the slots");
    assert!(text.contains("robota_mcpd_build_info"));
    assert!(started.elapsed() < PROMPT, "{:?}", started.elapsed());
    assert!(
        metric_sum(
            &text,
            &[
                "robota_mcpd_connections_total",
                "listener=\"metrics\"",
                "outcome=\"evicted\""
            ]
        ) >= 8.0,
        "{text}"
    );
}

/// Established connections the server accepted on 127.0.0.1:`port` with nothing left
/// unread in their receive queue (from /proc/net/tcp: the server side's local port).
fn read_by_server(port: u16) -> usize {
    let table = std::fs::read_to_string("/proc/net/tcp").unwrap_or_default();
    table
        .lines()
        .skip(1)
        .filter(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            f.len() > 4
                && f[1] == format!("0100007F:{port:04X}")
                && f[3] == "01"
                && f[4]
                    .split_once(':')
                    .is_some_and(|(_, rx)| rx.trim_start_matches('0').is_empty())
        })
        .count()
}

/// Keeps opening connections to `addr` until `stop`: silent ones and ones that send one
/// byte of a request head a second. Counts how many it opened.
fn flood(addr: SocketAddr, stop: Arc<AtomicBool>, opened: Arc<AtomicUsize>) {
    tokio::spawn(async move {
        let head = format!("POST /mcp HTTP/1.1\r\nHost: 127.0.0.1:{}\r\n", addr.port());
        let mut tasks = tokio::task::JoinSet::new();
        while !stop.load(Ordering::Relaxed) && opened.load(Ordering::Relaxed) < 1200 {
            let Ok(mut conn) = Conn::connect(addr).await else {
                continue;
            };
            let n = opened.fetch_add(1, Ordering::Relaxed);
            let head = head.clone().into_bytes();
            let stop = stop.clone();
            tasks.spawn(async move {
                if n.is_multiple_of(2) {
                    // Silent: held until the daemon drops it.
                    let _ = tokio::time::timeout(QUICK, conn.read_to_close()).await;
                    return;
                }
                for byte in head.iter().cycle().take(10) {
                    if stop.load(Ordering::Relaxed)
                        || conn.write(std::slice::from_ref(byte)).await.is_err()
                    {
                        return;
                    }
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
            });
            // About 300 new connections a second.
            tokio::time::sleep(Duration::from_millis(3)).await;
        }
        while tasks.join_next().await.is_some() {}
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slowloris_flood_from_the_same_address_does_not_delay_a_client() {
    let d = Daemon::start("");
    let addr = d.loopback_addr();
    let bearer = d.bearer();
    let (stop, opened) = (
        Arc::new(AtomicBool::new(false)),
        Arc::new(AtomicUsize::new(0)),
    );
    flood(addr, stop.clone(), opened.clone());
    // Let the flood fill every slot first.
    assert!(
        poll_until(QUICK, Duration::from_millis(20), || opened
            .load(Ordering::Relaxed)
            >= 200)
        .await
    );
    // Requests, one after another, until the flood has opened 1,200 connections.
    let mut slowest = Duration::ZERO;
    let mut requests = 0;
    let flood_ends = Instant::now() + Duration::from_secs(30);
    while opened.load(Ordering::Relaxed) < 1200 && Instant::now() < flood_ends {
        let started = Instant::now();
        let resp = within(
            QUICK,
            "a request during the flood",
            exchange(
                addr,
                &Request::mcp(addr.port(), Some(&bearer), &tools_list(requests)),
            ),
        )
        .await;
        served(&resp, "during a slowloris flood");
        slowest = slowest.max(started.elapsed());
        requests += 1;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stop.store(true, Ordering::Relaxed);
    eprintln!(
        "slowest of {requests} requests during a flood of {} connections: {slowest:?}",
        opened.load(Ordering::Relaxed)
    );
    assert!(requests >= 20, "only {requests} requests during the flood");
    assert!(
        slowest < PROMPT,
        "a client waited {slowest:?} during the flood"
    );
    assert!(
        metric(
            &d,
            &[
                "robota_mcpd_connections_total",
                "listener=\"loopback\"",
                "outcome=\"evicted\""
            ]
        ) > 0.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_listener_refuses_at_once_and_says_so() {
    let d = Daemon::builder()
        .loopback("max_connections = 4")
        .loopback("body_timeout = \"10s\"")
        .start();
    let addr = d.loopback_addr();
    let bearer = d.bearer();
    // Four admitted requests whose bodies never come: every slot busy, nothing idle.
    let head = Request::mcp(addr.port(), Some(&bearer), &tools_list(1))
        .no_auto_length()
        .header("Content-Length", "1000")
        .head_bytes();
    let mut busy = Vec::new();
    for _ in 0..4 {
        busy.push(stall(addr, &head).await);
    }
    // Wait until all four are being served (their heads were read).
    let served_heads = poll_until(QUICK, Duration::from_millis(20), || {
        metric(
            &d,
            &[
                "robota_mcpd_admitted_requests_total",
                "carrier=\"loopback\"",
            ],
        ) >= 4.0
    })
    .await;
    assert!(served_heads, "the four requests were never admitted");
    let started = Instant::now();
    let resp = within(
        QUICK,
        "a fifth connection",
        try_exchange(
            addr,
            &Request::mcp(addr.port(), Some(&bearer), &tools_list(2)),
        ),
    )
    .await
    .expect("a fifth connection gets an answer");
    assert_eq!(resp.status, 503, "{}", resp.describe());
    assert_eq!(resp.header("retry-after"), Some("1"));
    assert!(started.elapsed() < PROMPT, "{:?}", started.elapsed());
    assert!(
        metric(
            &d,
            &[
                "robota_mcpd_connections_total",
                "listener=\"loopback\"",
                "outcome=\"refused\""
            ]
        ) >= 1.0
    );
    drop(busy);
}

mod remote {
    //! The remote carrier, TLS terminated by the daemon: silent peers after a finished
    //! handshake are cut at the head deadline, and one address cannot hold more than its
    //! share of the connection slots.

    use std::net::SocketAddr;
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use robota_e2e::authz::{Authz, StandardKeys};
    use robota_e2e::http::{Response, tools_list};
    use robota_e2e::remote::{PUBLIC_HOST, PUBLIC_URL, RemoteConfig, parse_response, remote_mcp};
    use robota_e2e::{Daemon, metric_sum, within};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio_rustls::rustls::pki_types::ServerName;

    use super::{PROMPT, QUICK};

    pub struct Tls {
        pub d: Daemon,
        pub addr: SocketAddr,
        pub token: String,
        pub client: Arc<tokio_rustls::rustls::ClientConfig>,
        _authz: Authz,
        _dir: tempfile::TempDir,
    }

    /// A remote carrier with TLS, `lines` more `[remote]` keys (a 1 s head deadline
    /// unless they give one), and a valid token.
    pub fn start(lines: &[&str]) -> Tls {
        let (authz, keys): (Authz, StandardKeys) = Authz::with_standard_keys();
        let dir = tempfile::tempdir().expect("tempdir");
        let (cert, key) = authz.ca().leaf(&[PUBLIC_HOST]);
        let (cert_file, key_file) = (dir.path().join("cert.pem"), dir.path().join("key.pem"));
        std::fs::write(&cert_file, cert).expect("cert");
        std::fs::write(&key_file, key).expect("key");
        let mut cfg = RemoteConfig::new(&authz).tls(&cert_file, &key_file);
        if !lines.iter().any(|l| l.starts_with("header_timeout")) {
            cfg = cfg.line("header_timeout = \"1s\"");
        }
        for line in lines {
            cfg = cfg.line(line);
        }
        let d = cfg.builder().start();
        let addr = d.remote_addr();
        let token = authz.token(&keys.rsa, PUBLIC_URL).build();
        d.register_secret(&token);
        let client = authz.ca().client_config();
        Tls {
            d,
            addr,
            token,
            client,
            _authz: authz,
            _dir: dir,
        }
    }

    /// A TLS connection from `from` (a loopback address) whose handshake is done.
    pub async fn handshake(
        t: &Tls,
        from: &str,
    ) -> tokio_rustls::client::TlsStream<tokio::net::TcpStream> {
        let socket = tokio::net::TcpSocket::new_v4().expect("socket");
        socket
            .bind(format!("{from}:0").parse().expect("address"))
            .expect("bind");
        let tcp = socket.connect(t.addr).await.expect("connect");
        let name = ServerName::try_from(PUBLIC_HOST.to_owned()).expect("name");
        within(
            QUICK,
            "TLS handshake",
            tokio_rustls::TlsConnector::from(t.client.clone()).connect(name, tcp),
        )
        .await
        .expect("TLS handshake")
    }

    /// A valid request from `from`, answered.
    pub async fn request(t: &Tls, from: &str) -> Response {
        let mut tls = handshake(t, from).await;
        let req = remote_mcp(Some(&t.token), &tools_list(1));
        tls.write_all(&req.to_bytes()).await.expect("write");
        let mut buf = Vec::new();
        let _ = within(QUICK, "a TLS response", tls.read_to_end(&mut buf)).await;
        parse_response(&buf).expect("an HTTP response")
    }

    /// Whether the daemon closes a TLS connection within `limit`.
    pub async fn closed_within(
        tls: &mut tokio_rustls::client::TlsStream<tokio::net::TcpStream>,
        limit: Duration,
    ) -> bool {
        let mut sink = [0u8; 1024];
        tokio::time::timeout(limit, async {
            while matches!(tls.read(&mut sink).await, Ok(n) if n > 0) {}
        })
        .await
        .is_ok()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn silence_after_a_tls_handshake_is_cut_and_holds_no_slot() {
        let t = start(&[]);
        // 64 peers (the default cap) finish their handshakes from four addresses, then
        // send nothing; a valid token is still served promptly, from a fifth address and
        // from one of theirs.
        let mut silent = Vec::new();
        for i in 0..64 {
            silent.push(handshake(&t, &format!("127.0.0.{}", 2 + i % 4)).await);
        }
        for from in ["127.0.0.9", "127.0.0.2"] {
            let started = Instant::now();
            let resp = request(&t, from).await;
            assert_eq!(resp.status, 200, "from {from}: {}", resp.describe());
            assert!(
                started.elapsed() < PROMPT,
                "from {from}: {:?}",
                started.elapsed()
            );
        }
        for (i, tls) in silent.iter_mut().enumerate() {
            assert!(
                closed_within(tls, Duration::from_secs(3)).await,
                "silent TLS peer {i} still open"
            );
        }
        let text = t.d.metrics_text().expect("metrics");
        let gone = metric_sum(
            &text,
            &[
                "robota_mcpd_connections_total",
                "listener=\"remote\"",
                "outcome=\"head-timeout\"",
            ],
        ) + metric_sum(
            &text,
            &[
                "robota_mcpd_connections_total",
                "listener=\"remote\"",
                "outcome=\"evicted\"",
            ],
        );
        assert!(gone >= 64.0, "{gone}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn one_address_holds_at_most_its_share_of_the_slots() {
        let t = start(&[
            "max_connections_per_address = 8",
            "header_timeout = \"30s\"",
        ]);
        // 600 silent handshakes from one address: it keeps at most 8 slots (the newest).
        let mut silent = Vec::new();
        for _ in 0..600 {
            silent.push(handshake(&t, "127.0.0.2").await);
        }
        let text = t.d.metrics_text().expect("metrics");
        let open = metric_sum(
            &text,
            &["robota_mcpd_connections_open", "listener=\"remote\""],
        );
        assert!(open <= 8.0, "{open} connections open for one address");
        // Another address is served at once, and so is that one.
        for from in ["127.0.0.3", "127.0.0.2"] {
            let started = Instant::now();
            let resp = request(&t, from).await;
            assert_eq!(resp.status, 200, "from {from}: {}", resp.describe());
            assert!(
                started.elapsed() < PROMPT,
                "from {from}: {:?}",
                started.elapsed()
            );
        }
        drop(silent);
    }
}

/// `{"jsonrpc":"2.0","id":id,"method":"tools/call",…"arguments":{"x":[[],[],…]}}` of
/// about `len` bytes: cheap to send, costly to parse.
fn amplifying_body(id: i64, len: usize) -> Vec<u8> {
    let mut body =
        format!(r#"{{"jsonrpc":"2.0","id":{id},"method":"tools/call","params":{{"name":"system.info","arguments":{{"x":["#)
            .into_bytes();
    while body.len() + 6 < len {
        body.extend_from_slice(b"[],");
    }
    body.extend_from_slice(b"[]]}}}");
    body
}

/// One POST of `body`, allowed a minute: requests queue for the memory budget.
async fn post_raw(addr: SocketAddr, bearer: &str, body: Vec<u8>) -> Response {
    let req = Request::mcp(addr.port(), Some(bearer), &json!({})).body(body);
    within(Duration::from_secs(60), "an amplifying request", async {
        let mut conn = Conn::connect(addr).await.expect("connect");
        conn.write(&req.to_bytes()).await.expect("write");
        conn.read_response().await.expect("response")
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_built_to_amplify_cost_at_most_the_memory_budget() {
    // One caller sends them all: it is allowed the whole carrier (the budget is what is
    // tested here, not a caller's share of it).
    let d = Daemon::builder()
        .loopback("max_in_flight = 64")
        .loopback("max_in_flight_per_caller = 64")
        .start();
    let addr = d.loopback_addr();
    let bearer = d.bearer();
    let before = procs::rss_kib(d.pid());
    // 16 at once, 1 MiB each: about 350,000 JSON values per body, ~70 MB to hold each,
    // so the budget holds one parse at a time.
    let mut calls = tokio::task::JoinSet::new();
    for i in 0..16 {
        let bearer = bearer.clone();
        calls.spawn(
            async move { post_raw(addr, &bearer, amplifying_body(i, 1024 * 1024 - 64)).await },
        );
    }
    // Each is served, or answered 503 at once when the share it needs is not free.
    let mut statuses = Vec::new();
    while let Some(resp) = calls.join_next().await {
        let resp = resp.expect("task");
        statuses.push(resp.status);
        if resp.status == 503 {
            assert_eq!(resp.header("retry-after"), Some("1"), "{}", resp.describe());
        }
        if resp.status == 200 {
            let rpc = resp.messages().into_iter().next().expect("an answer");
            assert_eq!(
                rpc.pointer("/result/structuredContent/code")
                    .and_then(Value::as_str),
                Some("invalid_arguments"),
                "{rpc}"
            );
        }
    }
    assert!(
        statuses.iter().all(|s| matches!(s, 200 | 503)) && statuses.contains(&200),
        "{statuses:?}"
    );
    let peak = procs::peak_rss_kib(d.pid());
    let after = procs::rss_kib(d.pid());
    eprintln!(
        "16 × 1 MiB amplifying bodies: RSS {before} KiB before, peak {peak} KiB, {after} KiB after"
    );
    // The budget is 128 MiB; without it 32 such bodies peaked at 428 MB.
    assert!(
        peak.saturating_sub(before) < 160 * 1024,
        "peak RSS grew by {} KiB",
        peak - before
    );
    let resp = exchange(
        addr,
        &Request::mcp(addr.port(), Some(&bearer), &tools_list(99)),
    )
    .await;
    served(&resp, "after the amplifying bodies");
}

/// `{"jsonrpc":"2.0","id":id,"method":"tools/call",…"arguments":{"x":[0,0,…]}}` of about
/// `len` bytes: each 1 MiB costs most of the default budget to parse.
fn number_array_body(id: i64, len: usize) -> Vec<u8> {
    let mut body =
        format!(r#"{{"jsonrpc":"2.0","id":{id},"method":"tools/call","params":{{"name":"system.info","arguments":{{"x":["#)
            .into_bytes();
    while body.len() + 5 < len {
        body.extend_from_slice(b"0,");
    }
    body.extend_from_slice(b"0]}}}");
    body
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_never_hold_the_memory_budget_waiting_for_each_other() {
    // Twenty bodies of 1 MiB, each costing ~100 MiB of the 128 MiB budget to parse: each
    // holds budget for its bytes, and none may then wait for its parse share while others
    // hold theirs. Every one is answered at once (served, or 503 with Retry-After), never
    // at the body deadline; a small request meanwhile is served.
    let d = Daemon::builder()
        .loopback("max_in_flight = 64")
        .loopback("max_in_flight_per_caller = 64")
        .loopback("body_timeout = \"20s\"")
        .start();
    let addr = d.loopback_addr();
    let bearer = d.bearer();
    let started = Instant::now();
    let mut calls = tokio::task::JoinSet::new();
    for i in 0..20 {
        let bearer = bearer.clone();
        calls.spawn(async move {
            let resp = post_raw(addr, &bearer, number_array_body(i, 1024 * 1024 - 64)).await;
            (resp, started.elapsed())
        });
    }
    let small = within(PROMPT * 3, "a small request beside the big ones", async {
        exchange(
            addr,
            &Request::mcp(addr.port(), Some(&bearer), &tools_list(99)),
        )
        .await
    })
    .await;
    served(&small, "a small request beside the big ones");
    let mut answers = Vec::new();
    while let Some(answer) = calls.join_next().await {
        let (resp, took) = answer.expect("task");
        assert!(
            matches!(resp.status, 200 | 503),
            "a big body: {}",
            resp.describe()
        );
        if resp.status == 503 {
            assert_eq!(resp.header("retry-after"), Some("1"), "{}", resp.describe());
        }
        answers.push((resp.status, took));
    }
    eprintln!("20 × 1 MiB number arrays: {answers:?}");
    let slowest = answers.iter().map(|(_, t)| *t).max().expect("answers");
    assert!(
        slowest < Duration::from_secs(10),
        "a big body waited {slowest:?} (the body deadline is 20 s): {answers:?}"
    );
    // Alone, one such body is within the budget and is served.
    let resp = post_raw(addr, &bearer, number_array_body(100, 1024 * 1024 - 64)).await;
    served(&resp, "one 1 MiB number array alone");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_http2_peers_cannot_evict_a_served_connection() {
    // The loopback listener has 64 slots. A client's HTTP/2 connection is served once;
    // then 70 connections each make one request without a bearer (401). Refused
    // requests do not count as service, so the full listener evicts those, never the
    // client's connection.
    let d = Daemon::start("");
    let addr = d.loopback_addr();
    let bearer = d.bearer();
    let list = serde_json::to_vec(&tools_list(1)).expect("json");
    let mut client = H2Conn::connect(addr).await;
    let (status, _) = client
        .post(Some(&bearer), &[], TestBody::full(list.clone()))
        .await
        .expect("the client's first request");
    assert_eq!(status, 200);
    let mut refused = Vec::new();
    for i in 0..70 {
        let mut h2 = H2Conn::connect(addr).await;
        // A connection evicted before it is answered has no status to show.
        if let Ok((status, _)) = h2.post(None, &[], TestBody::full(list.clone())).await {
            assert_eq!(status, 401, "refused peer {i}");
        }
        refused.push(h2);
    }
    assert!(
        !client.is_closed(),
        "the served client's connection was evicted"
    );
    let (status, _) = client
        .post(Some(&bearer), &[], TestBody::full(list))
        .await
        .expect("the client's second request on the same connection");
    assert_eq!(status, 200);
    assert!(
        metric(
            &d,
            &[
                "robota_mcpd_connections_total",
                "listener=\"loopback\"",
                "outcome=\"evicted\""
            ]
        ) >= 6.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scrape_under_a_foreign_host_name_is_refused() {
    // A page that rebinds its own name to 127.0.0.1 reaches the loopback metrics
    // listener with its name in `Host`; only the listener's own address and `localhost`
    // are scraped.
    let d = Daemon::start("");
    let addr = d.metrics_addr();
    let port = addr.port();
    let get = |host: String| {
        format!("GET /metrics HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n")
    };
    for host in [
        format!("attacker.example:{port}"),
        "127.0.0.1".into(),
        String::new(),
    ] {
        let mut conn = Conn::connect(addr).await.expect("connect");
        conn.write(get(host.clone()).as_bytes())
            .await
            .expect("write");
        let resp = conn.read_response().await.expect("response");
        assert_eq!(resp.status, 403, "Host {host:?}: {}", resp.describe());
        assert!(!String::from_utf8_lossy(&resp.body).contains("robota_mcpd"));
    }
    for host in [
        format!("localhost:{port}"),
        format!("LOCALHOST:{port}"),
        addr.to_string(),
    ] {
        let mut conn = Conn::connect(addr).await.expect("connect");
        conn.write(get(host.clone()).as_bytes())
            .await
            .expect("write");
        let resp = conn.read_response().await.expect("response");
        assert_eq!(resp.status, 200, "Host {host:?}: {}", resp.describe());
    }
    assert_eq!(
        metric(
            &d,
            &[
                "robota_mcpd_http_rejections_total",
                "listener=\"metrics\"",
                "cause=\"wrong-host\""
            ]
        ),
        3.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_the_16_mib_ceiling_an_amplifying_body_is_refused_not_parsed() {
    let d = Daemon::builder()
        .loopback("max_in_flight_per_caller = 32")
        .extra("[limits]\nrequest_body = \"16MiB\"\n")
        .start();
    let addr = d.loopback_addr();
    let bearer = d.bearer();
    let before = procs::rss_kib(d.pid());
    let mut calls = tokio::task::JoinSet::new();
    for i in 0..4 {
        let bearer = bearer.clone();
        calls.spawn(async move {
            post_raw(addr, &bearer, amplifying_body(i, 16 * 1024 * 1024 - 64)).await
        });
    }
    while let Some(resp) = calls.join_next().await {
        let resp = resp.expect("task");
        assert_eq!(resp.status, 413, "{}", resp.describe());
    }
    let peak = procs::peak_rss_kib(d.pid());
    eprintln!("4 × 16 MiB amplifying bodies: RSS {before} KiB before, peak {peak} KiB");
    assert!(
        peak.saturating_sub(before) < 200 * 1024,
        "peak RSS grew by {} KiB",
        peak - before
    );
    // A plain 15 MiB body (few values) is within the budget and is served.
    let mut big = serde_json::to_vec(&tools_list(7)).expect("json");
    big.resize(15 * 1024 * 1024, b' ');
    let resp = post_raw(addr, &bearer, big).await;
    served(&resp, "a 15 MiB body of few values");
    assert!(
        metric(
            &d,
            &[
                "robota_mcpd_http_rejections_total",
                "cause=\"body-too-large\""
            ]
        ) >= 4.0
    );
}

/// A raw POST of `body` with `version` as `MCP-Protocol-Version`.
fn raw(addr: SocketAddr, bearer: &str, version: &str, body: &[u8]) -> Request {
    Request::mcp(addr.port(), Some(bearer), &json!({}))
        .set_header("MCP-Protocol-Version", version)
        .body(body.to_vec())
}

/// The one JSON-RPC error of a 400 answer.
fn rpc_error(resp: &Response, case: &str) -> Value {
    assert_eq!(resp.status, 400, "{case}: {}", resp.describe());
    assert_eq!(
        resp.header("content-type"),
        Some("application/json"),
        "{case}"
    );
    serde_json::from_slice(&resp.body).unwrap_or_else(|e| panic!("{case}: {e}"))
}

/// Every malformed message and the JSON-RPC answer it must get: (body, code, id).
fn malformed_cases() -> Vec<(&'static str, i64, Value)> {
    vec![
        ("{", -32700, Value::Null),
        ("not json", -32700, Value::Null),
        (
            r#"{"jsonrpc":"2.0","id":1,"id":2,"method":"tools/list"}"#,
            -32700,
            Value::Null,
        ),
        (
            r#"[{"jsonrpc":"2.0","id":1,"method":"tools/list"}]"#,
            -32600,
            Value::Null,
        ),
        (
            r#"{"jsonrpc":"2.0","id":null,"method":"tools/list"}"#,
            -32600,
            Value::Null,
        ),
        (
            r#"{"jsonrpc":"2.0","id":1.5,"method":"tools/list"}"#,
            -32600,
            Value::Null,
        ),
        (
            r#"{"jsonrpc":"2.0","id":{"a":1},"method":"tools/list"}"#,
            -32600,
            Value::Null,
        ),
        (
            r#"{"jsonrpc":"1.0","id":3,"method":"tools/list"}"#,
            -32600,
            json!(3),
        ),
        (
            r#"{"jsonrpc":"2.0","id":7,"method":"tools/call","params":null}"#,
            -32602,
            json!(7),
        ),
        (
            r#"{"jsonrpc":"2.0","id":"s","method":"tools/call","params":[1]}"#,
            -32602,
            json!("s"),
        ),
        (
            r#"{"jsonrpc":"2.0","id":8,"method":"tools/call"}"#,
            -32602,
            json!(8),
        ),
        (
            r#"{"jsonrpc":"2.0","id":9,"method":"tools/call","params":{"arguments":{}}}"#,
            -32602,
            json!(9),
        ),
        (
            r#"{"jsonrpc":"2.0","id":10,"method":"tasks/get","params":{}}"#,
            -32602,
            json!(10),
        ),
        // An integer id past i64 (the SDK's ids) and a request that also carries `result`
        // or `error` are JSON-RPC errors, on every method, never the SDK's plain text.
        (
            r#"{"jsonrpc":"2.0","id":9223372036854775808,"method":"ping"}"#,
            -32600,
            json!(9_223_372_036_854_775_808_u64),
        ),
        (
            r#"{"jsonrpc":"2.0","id":18446744073709551615,"method":"tools/call","params":{"name":"system.info"}}"#,
            -32600,
            json!(u64::MAX),
        ),
        (
            r#"{"jsonrpc":"2.0","id":11,"result":{},"method":"ping"}"#,
            -32600,
            json!(11),
        ),
        (
            r#"{"jsonrpc":"2.0","id":12,"error":null,"method":"tools/call","params":{"name":"system.info"}}"#,
            -32600,
            json!(12),
        ),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn protocol_errors_are_answered_as_json_rpc_with_the_request_id() {
    let d = Daemon::start("");
    let addr = d.loopback_addr();
    let bearer = d.bearer();
    // An unsupported MCP-Protocol-Version: 400, the request's id, what was asked for and
    // what is served.
    let body = br#"{"jsonrpc":"2.0","id":42,"method":"tools/list"}"#;
    let v = rpc_error(
        &exchange(addr, &raw(addr, &bearer, "2024-01-01", body)).await,
        "unsupported version",
    );
    assert_eq!(v["id"], 42, "{v}");
    assert_eq!(v["error"]["code"], -32022, "{v}");
    assert_eq!(v["error"]["data"]["requested"], "2024-01-01", "{v}");
    assert_eq!(
        v["error"]["data"]["supported"],
        json!(["2025-11-25", "2026-07-28"]),
        "{v}"
    );
    // An empty one is no version either.
    let v = rpc_error(
        &exchange(addr, &raw(addr, &bearer, "", body)).await,
        "empty version",
    );
    assert_eq!(
        (v["id"].clone(), v["error"]["code"].clone()),
        (json!(42), json!(-32022)),
        "{v}"
    );
    for (body, code, id) in malformed_cases() {
        let v = rpc_error(
            &exchange(addr, &raw(addr, &bearer, "2025-11-25", body.as_bytes())).await,
            body,
        );
        assert_eq!(
            (v["error"]["code"].clone(), v["id"].clone()),
            (json!(code), id),
            "{body}: {v}"
        );
        assert_eq!(v["jsonrpc"], "2.0");
    }
    // Each is counted by cause.
    let text = d.metrics_text().expect("metrics");
    for (cause, n) in [
        ("unsupported-version", 2.0),
        ("parse-error", 3.0),
        ("invalid-request", 9.0),
        ("invalid-params", 5.0),
    ] {
        assert_eq!(
            metric_sum(
                &text,
                &[
                    "robota_mcpd_http_rejections_total",
                    "listener=\"loopback\"",
                    &format!("cause=\"{cause}\"")
                ]
            ),
            n,
            "{cause}"
        );
    }
    // The endpoint's other error answers are counted too.
    let get = Request::mcp(addr.port(), Some(&bearer), &tools_list(1)).method("GET");
    assert_eq!(exchange(addr, &get).await.status, 405);
    let text = d.metrics_text().expect("metrics");
    assert_eq!(
        metric_sum(
            &text,
            &[
                "robota_mcpd_http_rejections_total",
                "cause=\"method-not-allowed\""
            ]
        ),
        1.0
    );
    // Unknown tool names are counted under one label, never their own.
    let resp = exchange(
        addr,
        &Request::mcp(
            addr.port(),
            Some(&bearer),
            &tools_call(5, "no.such.tool", json!({})),
        ),
    )
    .await;
    served(&resp, "an unknown tool");
    assert!(
        metric(
            &d,
            &[
                "robota_mcpd_tool_calls_total",
                "tool=\"(unknown)\"",
                "outcome=\"unknown_tool\""
            ]
        ) >= 1.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http2_heads_with_too_many_headers_get_431_and_are_counted() {
    let d = Daemon::start("");
    let addr = d.loopback_addr();
    let bearer = d.bearer();
    let list = serde_json::to_vec(&tools_list(1)).expect("json");
    let mut h2 = H2Conn::connect(addr).await;
    let many: Vec<(&str, String)> = (0..409).map(|_| ("x-many", "1".to_owned())).collect();
    let (status, _) = h2
        .post(Some(&bearer), &many, TestBody::full(list.clone()))
        .await
        .expect("h2 with 409 headers");
    assert_eq!(status, 431, "409 headers over HTTP/2");
    // The connection stays usable, and 60 headers are fine.
    let fine: Vec<(&str, String)> = (0..50).map(|_| ("x-some", "1".to_owned())).collect();
    let (status, _) = h2
        .post(Some(&bearer), &fine, TestBody::full(list))
        .await
        .expect("h2 with 50 headers");
    assert_eq!(status, 200);
    assert_eq!(
        metric(
            &d,
            &[
                "robota_mcpd_refusals_total",
                "carrier=\"loopback\"",
                "reason=\"oversize\""
            ]
        ),
        1.0
    );
}

/// Writes `lines` to a child speaking newline-delimited JSON-RPC and collects what it
/// answers until every id in `ids` (and `errors` id-less errors) has an answer.
async fn line_exchange(
    mut cmd: tokio::process::Command,
    lines: &[Vec<u8>],
    ids: &[Value],
    errors: usize,
) -> Vec<Value> {
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn");
    let mut stdin = child.stdin.take().expect("stdin");
    let stdout = child.stdout.take().expect("stdout");
    for line in lines {
        stdin.write_all(line).await.expect("write");
        stdin.write_all(b"\n").await.expect("newline");
    }
    stdin.flush().await.expect("flush");
    let mut answers = Vec::new();
    let mut reader = BufReader::new(stdout).lines();
    let done = |answers: &[Value]| {
        ids.iter().all(|id| answers.iter().any(|a| &a["id"] == id))
            && answers
                .iter()
                .filter(|a| a["id"].is_null() && a.get("error").is_some())
                .count()
                >= errors
    };
    while !done(&answers) {
        let line = within(QUICK, "an answer on the line carrier", reader.next_line())
            .await
            .expect("read")
            .unwrap_or_else(|| panic!("the line carrier closed; got {answers:?}"));
        answers.push(serde_json::from_str(&line).expect("a JSON answer"));
    }
    drop(stdin);
    let _ = within(QUICK, "the line carrier ends", child.wait()).await;
    answers
}

fn initialize_lines() -> Vec<Vec<u8>> {
    vec![
        json!({"jsonrpc":"2.0","id":"init","method":"initialize","params":{
            "protocolVersion":"2025-11-25","capabilities":{},
            "clientInfo":{"name":"request-path","version":"1"}}})
        .to_string()
        .into_bytes(),
        br#"{"jsonrpc":"2.0","method":"notifications/initialized"}"#.to_vec(),
    ]
}

/// What every line carrier must do: an oversized line is answered and skipped, malformed
/// lines get their JSON-RPC errors, and the session carries on.
async fn line_carrier_holds(cmd: impl Fn() -> tokio::process::Command) {
    let mut lines = initialize_lines();
    let oversized = format!(
        r#"{{"jsonrpc":"2.0","id":"big","method":"tools/call","params":{{"name":"system.info","arguments":{{"x":"{}"}}}}}}"#,
        "a".repeat(100 * 1024)
    );
    lines.push(oversized.into_bytes());
    lines.push(
        json!({"jsonrpc":"2.0","id":"after","method":"tools/list"})
            .to_string()
            .into_bytes(),
    );
    let answers = line_exchange(cmd(), &lines, &[json!("init"), json!("after")], 1).await;
    let too_large = answers
        .iter()
        .find(|a| a["id"].is_null())
        .expect("an answer to the oversized line");
    assert_eq!(too_large["error"]["code"], -32600, "{too_large}");
    assert!(
        too_large["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("65536")),
        "{too_large}"
    );
    let listed = answers
        .iter()
        .find(|a| a["id"] == "after")
        .expect("tools/list after the oversized line");
    assert!(
        listed["result"]["tools"]
            .as_array()
            .is_some_and(|t| !t.is_empty()),
        "{listed}"
    );

    let mut lines = initialize_lines();
    let cases = malformed_cases();
    lines.extend(cases.iter().map(|(body, _, _)| body.as_bytes().to_vec()));
    let with_ids: Vec<Value> = cases
        .iter()
        .map(|(_, _, id)| id.clone())
        .filter(|id| !id.is_null())
        .chain([json!("init")])
        .collect();
    let id_less = cases.iter().filter(|(_, _, id)| id.is_null()).count();
    let answers = line_exchange(cmd(), &lines, &with_ids, id_less).await;
    for (body, code, id) in cases.iter().filter(|(_, _, id)| !id.is_null()) {
        let a = answers
            .iter()
            .find(|a| &a["id"] == id)
            .unwrap_or_else(|| panic!("{body}: no answer in {answers:?}"));
        assert_eq!(a["error"]["code"], *code, "{body}: {a}");
    }
    let null_codes: Vec<i64> = answers
        .iter()
        .filter(|a| a["id"].is_null())
        .filter_map(|a| a["error"]["code"].as_i64())
        .collect();
    assert_eq!(null_codes.len(), id_less, "{answers:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_request_limit_and_strict_parsing_hold_on_stdio() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = dir.path().join("config.toml");
    std::fs::write(
        &config,
        format!(
            "[daemon]\nstate_dir = \"{0}/state\"\nruntime_dir = \"{0}/run\"\n[loopback]\nenabled = false\n[metrics]\nenabled = false\n[limits]\nrequest_body = \"64KiB\"\n",
            dir.path().display()
        ),
    )
    .expect("config");
    line_carrier_holds(|| {
        let mut cmd = tokio::process::Command::new(mcpd_bin());
        cmd.arg("--stdio")
            .arg("--config")
            .arg(&config)
            .env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default());
        cmd
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_request_limit_and_strict_parsing_hold_on_the_relay() {
    let d = Daemon::builder()
        .extra("[limits]\nrequest_body = \"64KiB\"\n")
        .start();
    line_carrier_holds(|| {
        let mut cmd = tokio::process::Command::new(mcpctl_bin());
        cmd.arg("--socket")
            .arg(d.socket_path())
            .arg("stdio")
            .env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default());
        cmd
    })
    .await;
}
