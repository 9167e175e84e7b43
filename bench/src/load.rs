//! The load generator, the same for every server: keep-alive HTTP/1.1 clients on hyper 1's
//! client connection API, either closed-loop (each client sends its next request as soon
//! as the last answer is read: throughput cells) or paced (a fixed request rate: the flood
//! scenario). Every answer is checked: 200 with a JSON-RPC result and no tool error.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::header::{ACCEPT, AUTHORIZATION, CONNECTION, CONTENT_TYPE, HOST};
use http::{HeaderMap, HeaderName, HeaderValue, Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::{self, SendRequest};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

use crate::procfs::{CpuMark, CpuShare};

const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
const MCP_SESSION_ID: HeaderName = HeaderName::from_static("mcp-session-id");

/// The MCP revision every request declares.
pub const PROTOCOL_VERSION: &str = "2025-11-25";

/// A JSON-RPC `tools/list` request body.
pub fn tools_list_body() -> Bytes {
    Bytes::from_static(br#"{"jsonrpc":"2.0","id":1,"method":"tools/list","params":{}}"#)
}

/// A JSON-RPC `tools/call` of `system.info` (no arguments).
pub fn tools_call_body() -> Bytes {
    Bytes::from_static(
        br#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"system.info","arguments":{}}}"#,
    )
}

/// A JSON-RPC `ping` (answered with an empty result, `{}`).
pub fn ping_body() -> Bytes {
    Bytes::from_static(br#"{"jsonrpc":"2.0","id":1,"method":"ping"}"#)
}

/// The `initialize` request that opens a session, at [`PROTOCOL_VERSION`].
fn initialize_body() -> Bytes {
    Bytes::from(format!(
        r#"{{"jsonrpc":"2.0","id":0,"method":"initialize","params":{{"protocolVersion":"{PROTOCOL_VERSION}","capabilities":{{}},"clientInfo":{{"name":"robota-bench","version":"{}"}}}}}}"#,
        env!("CARGO_PKG_VERSION")
    ))
}

/// The `notifications/initialized` notification that completes a session's opening.
fn initialized_body() -> Bytes {
    Bytes::from_static(br#"{"jsonrpc":"2.0","method":"notifications/initialized"}"#)
}

/// Where the credential of each request comes from.
#[derive(Debug, Clone)]
pub enum Auth {
    None,
    /// Client `i` always sends `values[i % len]` (a loopback bearer, a cached JWT).
    PerClient(Arc<Vec<HeaderValue>>),
    /// Every request takes the next value of the pool (a fresh JWT per request).
    Pool(Arc<TokenPool>),
}

/// Credentials handed out one per request, in turn, shared by every cell that uses them
/// so that no value is sent twice until the pool wraps around.
#[derive(Debug)]
pub struct TokenPool {
    values: Vec<HeaderValue>,
    next: AtomicUsize,
}

impl TokenPool {
    pub fn new(values: Vec<HeaderValue>) -> TokenPool {
        TokenPool {
            values,
            next: AtomicUsize::new(0),
        }
    }

    pub fn len(&self) -> usize {
        self.values.len()
    }

    /// How many values were handed out so far.
    pub fn used(&self) -> usize {
        self.next.load(Ordering::Relaxed)
    }

    fn take(&self) -> Option<HeaderValue> {
        let i = self.next.fetch_add(1, Ordering::Relaxed);
        self.values.get(i % self.values.len().max(1)).cloned()
    }
}

impl Auth {
    fn value(&self, client: usize) -> Option<HeaderValue> {
        match self {
            Auth::None => None,
            Auth::PerClient(values) => values.get(client % values.len().max(1)).cloned(),
            Auth::Pool(pool) => pool.take(),
        }
    }
}

/// `Authorization: Bearer <token>` as a header value.
pub fn bearer(token: &str) -> HeaderValue {
    HeaderValue::from_str(&format!("Bearer {token}")).unwrap_or_else(|e| {
        panic!("a bearer token must be header text: {e}");
    })
}

/// The request every client of a cell sends: `POST <path>` with the MCP headers, the same
/// bytes to every server but for `Host` and the credential (and, with sessions, the
/// client's `Mcp-Session-Id`).
#[derive(Debug)]
pub struct Template {
    pub addr: SocketAddr,
    pub host: HeaderValue,
    pub path: &'static str,
    pub body: Bytes,
    pub auth: Auth,
    /// Whether each client opens an MCP session before its first request (see
    /// [`Template::with_sessions`]); else every request stands alone (stateless).
    pub sessions: bool,
    /// `MCP-Protocol-Version` of every request ([`PROTOCOL_VERSION`] unless changed).
    pub revision: &'static str,
    /// Headers sent beside the MCP ones (the 2026-07-28 revision's `Mcp-Method`, say).
    pub extra: Vec<(&'static str, HeaderValue)>,
}

impl Template {
    pub fn new(addr: SocketAddr, host: &str, body: Bytes, auth: Auth) -> Template {
        Template {
            addr,
            host: HeaderValue::from_str(host).unwrap_or_else(|e| panic!("host {host:?}: {e}")),
            path: "/mcp",
            body,
            auth,
            sessions: false,
            revision: PROTOCOL_VERSION,
            extra: Vec::new(),
        }
    }

    /// The loopback form of a host: `127.0.0.1:<port>`.
    pub fn local(addr: SocketAddr, body: Bytes, auth: Auth) -> Template {
        Template::new(addr, &addr.to_string(), body, auth)
    }

    /// The MCP endpoint at `path` instead of `/mcp`.
    pub fn at_path(mut self, path: &'static str) -> Template {
        self.path = path;
        self
    }

    /// Each client opens a session of its own first, for a server that keeps one per
    /// client: `initialize` (at [`PROTOCOL_VERSION`]), whose answer's `Mcp-Session-Id` it
    /// keeps, then `notifications/initialized` and every request with that header. The
    /// opening is not timed; a failed answer ends the session (the client opens a new one
    /// before its next request). [`closed_loop`] and [`one`] speak it; the other drivers
    /// send every request without a session.
    pub fn with_sessions(mut self) -> Template {
        self.sessions = true;
        self
    }

    /// Every request at `revision`, with `extra` headers and `body` instead.
    pub fn in_revision(
        mut self,
        revision: &'static str,
        extra: &[(&'static str, &'static str)],
        body: Bytes,
    ) -> Template {
        self.revision = revision;
        self.extra = extra
            .iter()
            .map(|&(name, value)| (name, HeaderValue::from_static(value)))
            .collect();
        self.body = body;
        self
    }

    /// This template's request, outside any session.
    fn request(&self, client: usize) -> Request<Full<Bytes>> {
        self.request_in(client, None)
    }

    /// This template's request in `session`, if any.
    fn request_in(&self, client: usize, session: Option<&HeaderValue>) -> Request<Full<Bytes>> {
        self.build(client, Method::POST, session, self.body.clone())
    }

    /// Every request a client sends: `method <path>` with the MCP headers, the client's
    /// credential and `session` (as `Mcp-Session-Id`), and `body`.
    fn build(
        &self,
        client: usize,
        method: Method,
        session: Option<&HeaderValue>,
        body: Bytes,
    ) -> Request<Full<Bytes>> {
        let mut builder = Request::builder()
            .method(method)
            .uri(self.path)
            .header(HOST, self.host.clone())
            .header(CONTENT_TYPE, HeaderValue::from_static("application/json"))
            .header(
                ACCEPT,
                HeaderValue::from_static("application/json, text/event-stream"),
            )
            .header(
                "mcp-protocol-version",
                HeaderValue::from_static(self.revision),
            );
        for (name, value) in &self.extra {
            builder = builder.header(*name, value.clone());
        }
        if let Some(v) = self.auth.value(client) {
            builder = builder.header(AUTHORIZATION, v);
        }
        if let Some(id) = session {
            builder = builder.header(MCP_SESSION_ID, id.clone());
        }
        builder
            .body(Full::new(body))
            .unwrap_or_else(|e| panic!("request from the template: {e}"))
    }
}

/// Longest one request may take, connecting included.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// One client connection, re-established when the server closes it, and the client's MCP
/// session when its template has sessions.
struct Client {
    addr: SocketAddr,
    sender: Option<SendRequest<Full<Bytes>>>,
    session: Option<HeaderValue>,
}

/// A whole answer.
struct Answer {
    status: StatusCode,
    headers: HeaderMap,
    body: Bytes,
}

impl Client {
    fn new(addr: SocketAddr) -> Client {
        Client {
            addr,
            sender: None,
            session: None,
        }
    }

    /// The template's request, in this client's session if it has one.
    fn request(&self, template: &Template, client: usize) -> Request<Full<Bytes>> {
        template.request_in(client, self.session.as_ref())
    }

    /// Opens this client's session if its template has sessions and it has none (or the
    /// last failed answer ended it): `initialize`, then `notifications/initialized` with
    /// the answer's `Mcp-Session-Id`.
    async fn ensure_session(&mut self, template: &Template, client: usize) -> Result<(), String> {
        if !template.sessions || self.session.is_some() {
            return Ok(());
        }
        let init = template.build(client, Method::POST, None, initialize_body());
        let answer = self.send_answer(init).await?;
        check(answer.status, &answer.body, true).map_err(|e| format!("initialize: {e}"))?;
        let id = answer
            .headers
            .get(MCP_SESSION_ID)
            .cloned()
            .ok_or("initialize: no Mcp-Session-Id in the answer")?;
        let initialized = template.build(client, Method::POST, Some(&id), initialized_body());
        let answer = self.send_answer(initialized).await?;
        if !answer.status.is_success() {
            return Err(format!(
                "notifications/initialized: status {}: {}",
                answer.status,
                snippet(&answer.body)
            ));
        }
        self.session = Some(id);
        Ok(())
    }

    /// Ends this client's session, if it has one (`DELETE` with its `Mcp-Session-Id`; the
    /// answer is not checked: a server may refuse to end sessions on request).
    async fn close_session(&mut self, template: &Template, client: usize) {
        if let Some(id) = self.session.take() {
            let req = template.build(client, Method::DELETE, Some(&id), Bytes::new());
            let _ = self.send_answer(req).await;
        }
    }

    async fn connect(addr: SocketAddr) -> Result<SendRequest<Full<Bytes>>, String> {
        let stream = TcpStream::connect(addr)
            .await
            .map_err(|e| format!("connect {addr}: {e}"))?;
        stream
            .set_nodelay(true)
            .map_err(|e| format!("nodelay: {e}"))?;
        let (sender, conn) = http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| format!("handshake: {e}"))?;
        tokio::spawn(async move {
            let _ = conn.await;
        });
        Ok(sender)
    }

    /// Opens the connection now if there is none (so that it is idle and open).
    async fn open(&mut self) -> Result<(), String> {
        if self.sender.as_ref().is_none_or(|s| s.is_closed()) {
            self.sender = Some(Self::connect(self.addr).await?);
        }
        Ok(())
    }

    /// Sends `req` and reads the whole answer, within [`REQUEST_TIMEOUT`] (connecting
    /// included; a request without an answer by then is a failure and drops the
    /// connection, so that one stuck request cannot stall a cell).
    async fn send(&mut self, req: Request<Full<Bytes>>) -> Result<(StatusCode, Bytes), String> {
        self.send_answer(req).await.map(|a| (a.status, a.body))
    }

    /// [`Client::send`], with the answer's headers.
    async fn send_answer(&mut self, req: Request<Full<Bytes>>) -> Result<Answer, String> {
        match tokio::time::timeout(REQUEST_TIMEOUT, self.send_unbounded(req)).await {
            Ok(result) => result,
            Err(_) => {
                self.sender = None;
                Err(format!("no answer within {REQUEST_TIMEOUT:?}"))
            }
        }
    }

    async fn send_unbounded(&mut self, req: Request<Full<Bytes>>) -> Result<Answer, String> {
        self.open().await?;
        let Some(sender) = self.sender.as_mut() else {
            return Err("no connection".into());
        };
        if sender.ready().await.is_err() {
            // Closed while idle: one fresh connection.
            self.sender = Some(Self::connect(self.addr).await?);
        }
        let result = self.exchange(req).await;
        if result.is_err() {
            self.sender = None;
        }
        result
    }

    async fn exchange(&mut self, req: Request<Full<Bytes>>) -> Result<Answer, String> {
        let Some(sender) = self.sender.as_mut() else {
            return Err("no connection".into());
        };
        let response = sender
            .send_request(req)
            .await
            .map_err(|e| format!("request: {e}"))?;
        let (parts, body) = response.into_parts();
        let body = body
            .collect()
            .await
            .map_err(|e| format!("response body: {e}"))?
            .to_bytes();
        if parts
            .headers
            .get(CONNECTION)
            .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"close"))
        {
            self.sender = None;
        }
        Ok(Answer {
            status: parts.status,
            headers: parts.headers,
            body,
        })
    }
}

/// Whether an answer is a success: 200, a JSON-RPC result, no tool error. `full` also
/// parses the body as JSON (done on a sample of the answers, to keep the generator's CPU
/// share small; the byte checks run on every answer).
pub fn check(status: StatusCode, body: &[u8], full: bool) -> Result<(), String> {
    if status != StatusCode::OK {
        return Err(format!("status {status}"));
    }
    if memchr::memmem::find(body, b"\"result\":").is_none() {
        return Err(format!("no JSON-RPC result: {}", snippet(body)));
    }
    if memchr::memmem::find(body, b"\"isError\":true").is_some() {
        return Err(format!("tool error: {}", snippet(body)));
    }
    if full {
        let message = json_message(body).ok_or_else(|| format!("not JSON: {}", snippet(body)))?;
        if message.get("jsonrpc").and_then(|v| v.as_str()) != Some("2.0")
            || message.get("error").is_some()
            || !message.get("result").is_some_and(|r| r.is_object())
        {
            return Err(format!("not a JSON-RPC result: {}", snippet(body)));
        }
    }
    Ok(())
}

/// The JSON message of a plain JSON body, or of the first `data:` line of an SSE body.
fn json_message(body: &[u8]) -> Option<serde_json::Value> {
    if let Ok(v) = serde_json::from_slice(body) {
        return Some(v);
    }
    let text = std::str::from_utf8(body).ok()?;
    text.lines()
        .filter_map(|l| l.strip_prefix("data:"))
        .find_map(|d| serde_json::from_str(d.trim()).ok())
}

fn snippet(body: &[u8]) -> String {
    let text = String::from_utf8_lossy(&body[..body.len().min(160)]).into_owned();
    if body.len() > 160 {
        format!("{text}…")
    } else {
        text
    }
}

/// One request on a new connection (in a session of its own, opened first and ended
/// after, if the template has sessions); the answer's JSON-RPC message once it passed
/// [`check`].
pub async fn one(template: Arc<Template>) -> Result<serde_json::Value, String> {
    let mut conn = Client::new(template.addr);
    conn.ensure_session(&template, 0).await?;
    let answer = conn.send(conn.request(&template, 0)).await;
    conn.close_session(&template, 0).await;
    let (status, body) = answer?;
    check(status, &body, true)?;
    json_message(&body).ok_or_else(|| format!("not JSON: {}", snippet(&body)))
}

/// Latency samples of one cell, in nanoseconds, sorted.
#[derive(Debug, Clone, Default)]
pub struct Latencies(Vec<u64>);

impl Latencies {
    pub fn from_unsorted(mut samples: Vec<u64>) -> Latencies {
        samples.sort_unstable();
        Latencies(samples)
    }

    /// Nearest-rank percentile (`p` in 0..=100).
    pub fn percentile(&self, p: f64) -> Duration {
        if self.0.is_empty() {
            return Duration::ZERO;
        }
        let rank = ((p / 100.0) * self.0.len() as f64).ceil() as usize;
        let i = rank.clamp(1, self.0.len()) - 1;
        Duration::from_nanos(self.0[i])
    }

    pub fn max(&self) -> Duration {
        Duration::from_nanos(self.0.last().copied().unwrap_or(0))
    }
}

/// The outcome of one closed-loop cell.
#[derive(Debug, Clone)]
pub struct CellResult {
    /// Successful answers completed inside the measurement window.
    pub completed: u64,
    /// Failed answers over the whole cell, warm-up included.
    pub errors: u64,
    pub first_error: Option<String>,
    pub window: Duration,
    pub latencies: Latencies,
    pub cpu: CpuShare,
}

impl CellResult {
    pub fn throughput(&self) -> f64 {
        self.completed as f64 / self.window.as_secs_f64()
    }

    /// Server CPU time per answered request.
    pub fn server_cpu_per_request(&self) -> Duration {
        self.per_request(self.cpu.server)
    }

    /// Load-generator CPU time per answered request.
    pub fn generator_cpu_per_request(&self) -> Duration {
        self.per_request(self.cpu.generator)
    }

    /// The helper process's CPU time per answered request (the authorization server of
    /// the opaque-token cells; zero without one).
    pub fn helper_cpu_per_request(&self) -> Duration {
        self.per_request(self.cpu.helper)
    }

    fn per_request(&self, cpu: Duration) -> Duration {
        if self.completed == 0 {
            return Duration::ZERO;
        }
        cpu / u32::try_from(self.completed).unwrap_or(u32::MAX)
    }
}

/// How one closed-loop cell runs.
#[derive(Debug, Clone, Copy)]
pub struct Plan {
    pub clients: usize,
    pub warmup: Duration,
    pub duration: Duration,
    /// The server process, for its CPU time.
    pub server_pid: Option<i32>,
    /// A process the server depends on (the authorization server), for its CPU time.
    pub helper_pid: Option<i32>,
}

/// Every 64th answer of a client (and its first) is parsed in full.
const FULL_CHECK_EVERY: u64 = 64;

#[derive(Default)]
struct ClientTally {
    completed: u64,
    errors: u64,
    first_error: Option<String>,
    samples: Vec<u64>,
}

/// `plan.clients` keep-alive clients send `template` back to back for the warm-up and
/// then the measured window; answers completing inside the window count.
pub async fn closed_loop(template: Arc<Template>, plan: Plan) -> CellResult {
    let begin = Instant::now();
    let measure_from = begin + plan.warmup;
    let end = measure_from + plan.duration;
    let monitor = tokio::spawn(async move {
        tokio::time::sleep_until(measure_from.into()).await;
        let first = CpuMark::with_helper(plan.server_pid, plan.helper_pid);
        tokio::time::sleep_until(end.into()).await;
        CpuMark::with_helper(plan.server_pid, plan.helper_pid).share_since(&first)
    });
    let mut tasks = Vec::with_capacity(plan.clients);
    for client in 0..plan.clients {
        let template = template.clone();
        tasks.push(tokio::spawn(async move {
            let mut tally = ClientTally::default();
            let mut conn = Client::new(template.addr);
            let mut n: u64 = 0;
            while Instant::now() < end {
                // With sessions: opened (again) here, outside the timed request.
                let answer = match conn.ensure_session(&template, client).await {
                    Ok(()) => {
                        let req = conn.request(&template, client);
                        let t0 = Instant::now();
                        let answer = conn.send(req).await;
                        answer.map(|a| (a, t0, Instant::now()))
                    }
                    Err(e) => Err(e),
                };
                let full = n.is_multiple_of(FULL_CHECK_EVERY);
                n += 1;
                match answer.and_then(|((status, body), t0, t1)| {
                    check(status, &body, full).map(|()| (t0, t1))
                }) {
                    Ok((t0, t1)) => {
                        if t1 >= measure_from && t1 < end {
                            tally.completed += 1;
                            tally.samples.push(nanos(t1 - t0));
                        }
                    }
                    Err(e) => {
                        tally.errors += 1;
                        tally.first_error.get_or_insert(e);
                        // A failed answer ends the session (a server that forgot it
                        // answers every later request with an error).
                        conn.session = None;
                        // Do not spin on a dead server.
                        tokio::time::sleep(Duration::from_millis(1)).await;
                    }
                }
            }
            conn.close_session(&template, client).await;
            tally
        }));
    }
    let mut samples = Vec::new();
    let mut result = CellResult {
        completed: 0,
        errors: 0,
        first_error: None,
        window: plan.duration,
        latencies: Latencies::default(),
        cpu: CpuShare::default(),
    };
    for task in tasks {
        let tally = task.await.unwrap_or_else(|e| panic!("client task: {e}"));
        result.completed += tally.completed;
        result.errors += tally.errors;
        if result.first_error.is_none() {
            result.first_error = tally.first_error;
        }
        samples.extend(tally.samples);
    }
    result.latencies = Latencies::from_unsorted(samples);
    result.cpu = monitor
        .await
        .unwrap_or_else(|e| panic!("CPU monitor task: {e}"));
    result
}

/// Sends `total` requests from `clients` keep-alive clients as fast as they are answered;
/// returns (successes, failures, first failure).
pub async fn fixed_count(
    template: Arc<Template>,
    clients: usize,
    total: u64,
) -> (u64, u64, Option<String>) {
    let left = Arc::new(AtomicU64::new(total));
    let mut tasks = Vec::new();
    for client in 0..clients {
        let (template, left) = (template.clone(), left.clone());
        tasks.push(tokio::spawn(async move {
            let mut conn = Client::new(template.addr);
            let mut tally = ClientTally::default();
            let mut n = 0u64;
            while left
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| v.checked_sub(1))
                .is_ok()
            {
                let answer = conn.send(template.request(client)).await;
                let full = n.is_multiple_of(FULL_CHECK_EVERY);
                n += 1;
                match answer.and_then(|(status, body)| check(status, &body, full)) {
                    Ok(()) => tally.completed += 1,
                    Err(e) => {
                        tally.errors += 1;
                        tally.first_error.get_or_insert(e);
                    }
                }
            }
            tally
        }));
    }
    let (mut ok, mut failed, mut first) = (0, 0, None);
    for task in tasks {
        let tally = task.await.unwrap_or_else(|e| panic!("client task: {e}"));
        ok += tally.completed;
        failed += tally.errors;
        if first.is_none() {
            first = tally.first_error;
        }
    }
    (ok, failed, first)
}

/// Sends one request per `X-Forwarded-For` value, each on a new connection, from
/// `clients` concurrent clients, and counts the answers by status (for refusals, which
/// close their connection).
pub async fn statuses(
    template: Arc<Template>,
    forwarded_for: Arc<Vec<HeaderValue>>,
    clients: usize,
) -> (BTreeMap<u16, u64>, u64, Option<String>) {
    let next = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for client in 0..clients {
        let (template, forwarded_for, next) =
            (template.clone(), forwarded_for.clone(), next.clone());
        tasks.push(tokio::spawn(async move {
            let mut counts: BTreeMap<u16, u64> = BTreeMap::new();
            let (mut failed, mut first) = (0u64, None);
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(address) = forwarded_for.get(i) else {
                    break;
                };
                let mut req = template.request(client);
                req.headers_mut().insert(X_FORWARDED_FOR, address.clone());
                let mut conn = Client::new(template.addr);
                match conn.send(req).await {
                    Ok((status, _)) => *counts.entry(status.as_u16()).or_default() += 1,
                    Err(e) => {
                        failed += 1;
                        first.get_or_insert(e);
                    }
                }
            }
            (counts, failed, first)
        }));
    }
    let mut counts = BTreeMap::new();
    let (mut failed, mut first) = (0, None);
    for task in tasks {
        let (c, f, e) = task.await.unwrap_or_else(|e| panic!("client task: {e}"));
        for (status, n) in c {
            *counts.entry(status).or_default() += n;
        }
        failed += f;
        if first.is_none() {
            first = e;
        }
    }
    (counts, failed, first)
}

/// `n` connections that each carried one successful request and now sit idle, open.
pub struct IdleConnections {
    clients: Vec<Client>,
    template: Arc<Template>,
}

impl IdleConnections {
    pub async fn open(template: Arc<Template>, n: usize) -> Result<IdleConnections, String> {
        let mut clients = Vec::with_capacity(n);
        for i in 0..n {
            let mut c = Client::new(template.addr);
            let (status, body) = c.send(template.request(i)).await?;
            check(status, &body, true)?;
            clients.push(c);
        }
        Ok(IdleConnections { clients, template })
    }

    /// One more request on every connection; fails unless each is still open (a closed
    /// one would be replaced by a new connection, which is what this detects).
    pub async fn still_open(&mut self) -> Result<(), String> {
        for (i, c) in self.clients.iter_mut().enumerate() {
            if c.sender.as_ref().is_none_or(|s| s.is_closed()) {
                return Err(format!("connection {i} was closed while idle"));
            }
            let Some(sender) = c.sender.as_mut() else {
                return Err(format!("connection {i} is gone"));
            };
            sender
                .ready()
                .await
                .map_err(|e| format!("connection {i} was closed while idle: {e}"))?;
            let answer = c.exchange(self.template.request(i)).await?;
            check(answer.status, &answer.body, true)?;
        }
        Ok(())
    }
}

/// The outcome of one paced stream.
#[derive(Debug, Clone, Default)]
pub struct PacedResult {
    /// Requests sent.
    pub sent: u64,
    /// Answers that passed [`check`] (when the stream checks answers).
    pub ok: u64,
    /// Answers by status.
    pub statuses: BTreeMap<u16, u64>,
    /// Transport failures (no answer).
    pub failed: u64,
    pub first_error: Option<String>,
    /// Send slots dropped because the task was behind its schedule.
    pub skipped: u64,
    pub latencies: Latencies,
    pub window: Duration,
}

impl PacedResult {
    pub fn rate(&self) -> f64 {
        self.sent as f64 / self.window.as_secs_f64()
    }

    /// Adds `other`'s counts, samples and window to these.
    pub fn merge(&mut self, other: PacedResult) {
        self.sent += other.sent;
        self.ok += other.ok;
        self.failed += other.failed;
        self.skipped += other.skipped;
        for (status, n) in other.statuses {
            *self.statuses.entry(status).or_default() += n;
        }
        if self.first_error.is_none() {
            self.first_error = other.first_error;
        }
        let mut samples = std::mem::take(&mut self.latencies.0);
        samples.extend(other.latencies.0);
        self.latencies = Latencies::from_unsorted(samples);
        self.window += other.window;
    }
}

/// How a paced stream runs.
#[derive(Debug, Clone, Copy)]
pub struct Pace {
    /// Requests per second over all tasks.
    pub rate: f64,
    pub tasks: usize,
    pub duration: Duration,
    /// Check every answer as a success ([`check`]); else only count statuses.
    pub check: bool,
    /// Open a new connection for every request (refusals close theirs anyway).
    pub fresh_connections: bool,
}

/// `pace.tasks` clients together send `pace.rate` requests per second for
/// `pace.duration`. A client behind its schedule skips slots rather than bursting.
pub async fn paced(template: Arc<Template>, pace: Pace) -> PacedResult {
    let start = Instant::now() + Duration::from_millis(5);
    let end = start + pace.duration;
    let interval = Duration::from_secs_f64(pace.tasks as f64 / pace.rate);
    let mut tasks = Vec::new();
    for client in 0..pace.tasks {
        let template = template.clone();
        // Spread the tasks' schedules over one interval.
        let offset = interval.mul_f64(client as f64 / pace.tasks as f64);
        tasks.push(tokio::spawn(async move {
            let mut r = PacedResult::default();
            let mut samples = Vec::new();
            let mut conn = Client::new(template.addr);
            let mut n: u64 = 0;
            let mut slot = start + offset;
            while slot < end {
                tokio::time::sleep_until(slot.into()).await;
                let now = Instant::now();
                if now > slot + interval {
                    // Behind by a whole slot: drop the missed ones.
                    let behind = (now - slot).as_nanos() / interval.as_nanos().max(1);
                    r.skipped += u64::try_from(behind).unwrap_or(u64::MAX);
                    slot += interval * u32::try_from(behind).unwrap_or(u32::MAX);
                    continue;
                }
                if pace.fresh_connections {
                    conn = Client::new(template.addr);
                }
                let req = template.request(client);
                let t0 = Instant::now();
                let answer = conn.send(req).await;
                let t1 = Instant::now();
                r.sent += 1;
                match answer {
                    Ok((status, body)) => {
                        *r.statuses.entry(status.as_u16()).or_default() += 1;
                        if pace.check {
                            match check(status, &body, n.is_multiple_of(FULL_CHECK_EVERY)) {
                                Ok(()) => r.ok += 1,
                                Err(e) => {
                                    r.first_error.get_or_insert(e);
                                }
                            }
                        }
                        samples.push(nanos(t1 - t0));
                    }
                    Err(e) => {
                        r.failed += 1;
                        r.first_error.get_or_insert(e);
                    }
                }
                n += 1;
                slot += interval;
            }
            (r, samples)
        }));
    }
    let mut total = PacedResult {
        window: pace.duration,
        ..PacedResult::default()
    };
    let mut samples = Vec::new();
    for task in tasks {
        let (r, s) = task.await.unwrap_or_else(|e| panic!("paced task: {e}"));
        total.sent += r.sent;
        total.ok += r.ok;
        total.failed += r.failed;
        total.skipped += r.skipped;
        for (status, n) in r.statuses {
            *total.statuses.entry(status).or_default() += n;
        }
        if total.first_error.is_none() {
            total.first_error = r.first_error;
        }
        samples.extend(s);
    }
    total.latencies = Latencies::from_unsorted(samples);
    total
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_are_checked() {
        let ok = br#"{"jsonrpc":"2.0","id":1,"result":{"tools":[]}}"#;
        assert!(check(StatusCode::OK, ok, true).is_ok());
        assert!(check(StatusCode::UNAUTHORIZED, ok, true).is_err());
        let tool_error = br#"{"jsonrpc":"2.0","id":1,"result":{"isError":true,"content":[]}}"#;
        assert!(check(StatusCode::OK, tool_error, false).is_err());
        let rpc_error = br#"{"jsonrpc":"2.0","id":1,"error":{"code":-32601,"message":"x"}}"#;
        assert!(check(StatusCode::OK, rpc_error, false).is_err());
        let sse = b"event: message\ndata: {\"jsonrpc\":\"2.0\",\"id\":1,\"result\":{}}\n\n";
        assert!(check(StatusCode::OK, sse, true).is_ok());
        // `ping`'s answer: an empty result.
        let pong = br#"{"jsonrpc":"2.0","id":1,"result":{}}"#;
        assert!(check(StatusCode::OK, pong, true).is_ok());
        let null = br#"{"jsonrpc":"2.0","id":1,"result":null}"#;
        assert!(check(StatusCode::OK, null, true).is_err());
    }

    #[test]
    fn requests_in_a_session_carry_its_id() {
        let addr = SocketAddr::from(([127, 0, 0, 1], 9));
        let template = Template::local(addr, ping_body(), Auth::None)
            .at_path("/")
            .with_sessions();
        let outside = template.request(0);
        assert_eq!(outside.uri(), "/");
        assert!(outside.headers().get(MCP_SESSION_ID).is_none());
        let id = HeaderValue::from_static("abc");
        let inside = template.request_in(0, Some(&id));
        assert_eq!(inside.headers().get(MCP_SESSION_ID), Some(&id));
        assert_eq!(
            inside.headers().get("mcp-protocol-version"),
            Some(&HeaderValue::from_static(PROTOCOL_VERSION))
        );
        let init: serde_json::Value =
            serde_json::from_slice(&initialize_body()).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(init["params"]["protocolVersion"], PROTOCOL_VERSION);
    }

    /// A server that keeps sessions: `initialize` opens one (its id in the answer's
    /// header), `notifications/initialized` with it is answered 202, and any other request
    /// is answered only in an initialized session; `DELETE` ends one.
    async fn session_server() -> (SocketAddr, Arc<std::sync::Mutex<Vec<String>>>) {
        use hyper::body::Incoming;
        use hyper::service::service_fn;

        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let addr = listener.local_addr().unwrap_or_else(|e| panic!("{e}"));
        let log = Arc::new(std::sync::Mutex::new(Vec::new()));
        let sessions = Arc::new(std::sync::Mutex::new(BTreeMap::<String, bool>::new()));
        let (log2, next) = (log.clone(), Arc::new(AtomicUsize::new(0)));
        tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    return;
                };
                let (log, sessions, next) = (log2.clone(), sessions.clone(), next.clone());
                let service = service_fn(move |req: Request<Incoming>| {
                    let (log, sessions, next) = (log.clone(), sessions.clone(), next.clone());
                    async move {
                        let method = req.method().clone();
                        let id = req
                            .headers()
                            .get(MCP_SESSION_ID)
                            .and_then(|v| v.to_str().ok())
                            .map(str::to_owned);
                        let body = req.into_body().collect().await.map(|b| b.to_bytes());
                        let body = body.unwrap_or_default();
                        let text = String::from_utf8_lossy(&body).into_owned();
                        let mut sessions = sessions.lock().unwrap_or_else(|e| e.into_inner());
                        let answer = |status: u16, body: &'static str| {
                            http::Response::builder()
                                .status(status)
                                .body(Full::new(Bytes::from_static(body.as_bytes())))
                        };
                        let ok = r#"{"jsonrpc":"2.0","id":1,"result":{}}"#;
                        if method == Method::DELETE {
                            let gone = id.and_then(|id| sessions.remove(&id));
                            log.lock()
                                .unwrap_or_else(|e| e.into_inner())
                                .push("delete".into());
                            answer(if gone.is_some() { 200 } else { 404 }, "")
                        } else if text.contains("\"initialize\"") {
                            let id = format!("s{}", next.fetch_add(1, Ordering::Relaxed));
                            sessions.insert(id.clone(), false);
                            log.lock()
                                .unwrap_or_else(|e| e.into_inner())
                                .push("initialize".into());
                            answer(200, ok).map(|mut r| {
                                r.headers_mut().insert(
                                    MCP_SESSION_ID,
                                    HeaderValue::from_str(&id).unwrap_or_else(|e| panic!("{e}")),
                                );
                                r
                            })
                        } else if text.contains("notifications/initialized") {
                            match id.and_then(|id| sessions.get_mut(&id)) {
                                Some(ready) => {
                                    *ready = true;
                                    answer(202, "")
                                }
                                None => answer(404, ""),
                            }
                        } else {
                            match id.and_then(|id| sessions.get(&id).copied()) {
                                Some(true) => answer(200, ok),
                                _ => answer(404, r#"{"jsonrpc":"2.0","id":1,"error":{}}"#),
                            }
                        }
                    }
                });
                tokio::spawn(async move {
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        (addr, log)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn each_client_opens_a_session_and_ends_it() {
        let (addr, log) = session_server().await;
        let stateless = Arc::new(Template::local(addr, ping_body(), Auth::None));
        assert!(one(stateless).await.is_err(), "no session, no answer");
        let template = Arc::new(Template::local(addr, ping_body(), Auth::None).with_sessions());
        one(template.clone())
            .await
            .unwrap_or_else(|e| panic!("one in a session: {e}"));
        let plan = Plan {
            clients: 3,
            warmup: Duration::from_millis(50),
            duration: Duration::from_millis(200),
            server_pid: None,
            helper_pid: None,
        };
        let result = closed_loop(template, plan).await;
        assert_eq!(result.errors, 0, "{:?}", result.first_error);
        assert!(result.completed > 0);
        let log = log.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let count = |what: &str| log.iter().filter(|l| *l == what).count();
        assert_eq!(count("initialize"), 4, "{log:?}");
        assert_eq!(count("delete"), 4, "{log:?}");
    }

    #[test]
    fn percentiles_are_nearest_rank() {
        let l = Latencies::from_unsorted((1..=100).rev().collect());
        assert_eq!(l.percentile(50.0), Duration::from_nanos(50));
        assert_eq!(l.percentile(99.0), Duration::from_nanos(99));
        assert_eq!(l.max(), Duration::from_nanos(100));
        assert_eq!(Latencies::default().percentile(99.0), Duration::ZERO);
    }
}
