//! A downstream server behind Streamable HTTP on a loopback address or a unix socket:
//! one POST per message over a small pool of HTTP/1.1 connections, answers as one JSON
//! body or a server-sent event stream. Redirects are never followed, every body is
//! bounded (a JSON answer and each event by the response limit, a whole stream by the
//! stream limit), every exchange by the call's time limit. A stateful upstream's
//! `Mcp-Session-Id` is kept and sent back; when it answers 404 for it (it forgot the
//! session), the session is initialised again and the request sent once more — a 404
//! means it never ran it.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::header::{ACCEPT, AUTHORIZATION, CONTENT_TYPE, HOST, USER_AGENT};
use http::{HeaderName, HeaderValue, Method, Request, StatusCode, Uri};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use parking_lot::Mutex;
use serde_json::{Map, Value};
use tokio::net::{TcpStream, UnixStream};
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::protocol::{
    self, CallError, Incoming as Message, Negotiated, Outgoing, Rpc, RpcFuture, Unread,
};
use crate::budget::{Budget, Share};
use crate::catalog::Progress;
use crate::config::HttpTarget;
use crate::params::{MCP_METHOD, MCP_NAME, PROTOCOL_VERSION, SESSION_ID};

/// Idle connections kept for reuse.
const POOL: usize = 32;
/// Longest session id kept.
const MAX_SESSION_ID: usize = 256;

/// The connection's driver task, aborted when the connection is dropped.
struct ConnTask(JoinHandle<()>);

impl Drop for ConnTask {
    fn drop(&mut self) {
        self.0.abort();
    }
}

struct Conn {
    sender: SendRequest<Full<Bytes>>,
    _task: ConnTask,
}

/// Bounds of one backend.
#[derive(Debug, Clone)]
pub struct HttpBounds {
    pub response_limit: usize,
    pub stream_limit: u64,
    pub connect_timeout: Duration,
    /// What every upstream's answers share while they are parsed and passed on.
    pub memory: Budget,
}

pub struct HttpLink {
    me: Weak<HttpLink>,
    upstream: String,
    target: HttpTarget,
    /// The path every message is POSTed to.
    path: Uri,
    host: HeaderValue,
    /// `Authorization: Bearer …` with the daemon's own credential.
    authorization: Option<HeaderValue>,
    session: Mutex<Option<HeaderValue>>,
    /// The revision in force once the handshake is done (for session renewals).
    pool: Mutex<Vec<Conn>>,
    next_id: AtomicU64,
    bounds: HttpBounds,
    /// Fired when the backend could not be reached: the supervisor takes it down.
    broken: CancellationToken,
    list_changed: Arc<Notify>,
    /// Per tool of the backend's listing, the arguments its input schema asks to see as
    /// `Mcp-Param-<header>` headers (`x-mcp-header`, by path): sent with each call on
    /// revision 2026-07-28, as that revision's servers check.
    param_headers: Mutex<std::collections::HashMap<String, Vec<ParamHeader>>>,
}

impl std::fmt::Debug for HttpLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HttpLink")
            .field("upstream", &self.upstream)
            .finish_non_exhaustive()
    }
}

/// An argument sent as a header: its path in the arguments, and its `Mcp-Param-*` header.
type ParamHeader = (Vec<String>, HeaderName);

/// One exchange's answer before its body is read.
enum Answer {
    Json(Incoming),
    Stream(Incoming),
    Accepted,
}

impl HttpLink {
    pub fn new(
        upstream: &str,
        target: HttpTarget,
        path: String,
        bearer: Option<&str>,
        bounds: HttpBounds,
        list_changed: Arc<Notify>,
    ) -> Result<Arc<Self>, String> {
        let host = match &target {
            HttpTarget::Tcp { authority, .. } => HeaderValue::from_str(authority)
                .map_err(|_| format!("{authority:?} is not a Host header value"))?,
            HttpTarget::Unix(_) => HeaderValue::from_static("localhost"),
        };
        let path = Uri::try_from(path.as_str())
            .map_err(|e| format!("{path:?} is not a request path: {e}"))?;
        let authorization = match bearer {
            Some(token) => {
                let mut value = HeaderValue::from_str(&format!("Bearer {token}"))
                    .map_err(|_| "the bearer file holds characters a header cannot carry")?;
                value.set_sensitive(true);
                Some(value)
            }
            None => None,
        };
        Ok(Arc::new_cyclic(|me| Self {
            me: me.clone(),
            upstream: upstream.to_owned(),
            target,
            path,
            host,
            authorization,
            session: Mutex::new(None),
            pool: Mutex::new(Vec::new()),
            next_id: AtomicU64::new(1),
            bounds,
            broken: CancellationToken::new(),
            list_changed,
            param_headers: Mutex::new(std::collections::HashMap::new()),
        }))
    }

    pub fn broken(&self) -> &CancellationToken {
        &self.broken
    }

    async fn connect(&self) -> Result<Conn, CallError> {
        let unreachable =
            |e: std::io::Error| CallError::NotSent(format!("cannot connect to the backend: {e}"));
        let connect = async {
            match &self.target {
                HttpTarget::Tcp { addr, .. } => {
                    let stream = TcpStream::connect(addr).await.map_err(unreachable)?;
                    let _ = stream.set_nodelay(true);
                    handshake(TokioIo::new(stream)).await
                }
                HttpTarget::Unix(path) => {
                    let stream = UnixStream::connect(path).await.map_err(unreachable)?;
                    handshake(TokioIo::new(stream)).await
                }
            }
        };
        match tokio::time::timeout(self.bounds.connect_timeout, connect).await {
            Ok(Ok(conn)) => Ok(conn),
            Ok(Err(e)) => {
                self.broken.cancel();
                Err(e)
            }
            Err(_) => {
                self.broken.cancel();
                Err(CallError::NotSent(format!(
                    "the backend did not accept a connection within {}",
                    humantime::format_duration(self.bounds.connect_timeout)
                )))
            }
        }
    }

    /// A pooled connection that is not closed. It may not be ready yet: a connection
    /// whose last answer was just read becomes ready once its task has seen the end.
    fn idle(&self) -> Option<Conn> {
        let mut pool = self.pool.lock();
        while let Some(conn) = pool.pop() {
            if !conn.sender.is_closed() {
                return Some(conn);
            }
        }
        None
    }

    fn give_back(&self, conn: Conn) {
        let mut pool = self.pool.lock();
        if pool.len() < POOL && !conn.sender.is_closed() {
            pool.push(conn);
        }
    }

    fn build(
        &self,
        negotiated: &Negotiated,
        message: &Outgoing<'_>,
        with_session: bool,
    ) -> Result<Request<Full<Bytes>>, CallError> {
        let method = message.method;
        let mut request = Request::builder()
            .method(Method::POST)
            .uri(self.path.clone())
            .header(HOST, self.host.clone())
            .header(CONTENT_TYPE, HeaderValue::from_static("application/json"))
            .header(
                ACCEPT,
                HeaderValue::from_static("application/json, text/event-stream"),
            )
            .header(
                USER_AGENT,
                HeaderValue::from_static(concat!("robota-mcpd/", env!("CARGO_PKG_VERSION"))),
            );
        if method != "initialize" {
            request = request.header(
                PROTOCOL_VERSION,
                HeaderValue::from_static(negotiated.version),
            );
        }
        if negotiated.is_modern() {
            request = request.header(MCP_METHOD, HeaderValue::from_static(method));
            if let Some(name) = message.params.get("name").and_then(Value::as_str)
                && method == "tools/call"
            {
                request = request.header(MCP_NAME, crate::params::header_text(name));
                let arguments = message.params.get("arguments");
                for (path, header) in self.param_headers.lock().get(name).into_iter().flatten() {
                    if let Some(value) = crate::params::argument_text(arguments, path) {
                        request =
                            request.header(header.clone(), crate::params::header_text(&value));
                    }
                }
            }
        }
        if with_session && let Some(session) = self.session.lock().clone() {
            request = request.header(SESSION_ID, session);
        }
        if let Some(auth) = &self.authorization {
            request = request.header(AUTHORIZATION, auth.clone());
        }
        request
            .body(Full::new(Bytes::from(message.to_bytes())))
            .map_err(|e| CallError::NotSent(format!("the request could not be built: {e}")))
    }

    /// POSTs one message and reads the answer's head. `Ok(None)` is a 404 for the session
    /// id we sent (the upstream forgot it).
    async fn post(
        &self,
        negotiated: &Negotiated,
        message: &Outgoing<'_>,
        with_session: bool,
    ) -> Result<Option<(Answer, Conn)>, CallError> {
        let method = message.method;
        let sent_session = with_session && self.session.lock().is_some();
        let mut request = self.build(negotiated, message, with_session)?;
        // A pooled connection the server has closed hands the request back unsent; then
        // (and only then) it goes out on a fresh one.
        let (response, conn) = loop {
            let (mut conn, fresh) = match self.idle() {
                Some(conn) => (conn, false),
                None => (self.connect().await?, true),
            };
            if !fresh {
                let ready = tokio::time::timeout(self.bounds.connect_timeout, conn.sender.ready());
                if !matches!(ready.await, Ok(Ok(()))) {
                    continue;
                }
            }
            match conn.sender.try_send_request(request).await {
                Ok(response) => break (response, conn),
                Err(mut e) => match e.take_message() {
                    Some(unsent) if !fresh => request = unsent,
                    Some(_) => {
                        return Err(CallError::NotSent(format!(
                            "the backend closed the connection: {}",
                            e.error()
                        )));
                    }
                    None => {
                        return Err(CallError::Lost(format!(
                            "the connection broke mid-request: {}",
                            e.error()
                        )));
                    }
                },
            }
        };
        let status = response.status();
        if method == "initialize"
            && let Some(id) = response.headers().get(SESSION_ID)
        {
            let ok = id.len() <= MAX_SESSION_ID
                && id.as_bytes().iter().all(|b| (0x21..=0x7e).contains(b));
            if !ok {
                return Err(CallError::Lost(
                    "the backend sent an Mcp-Session-Id that is not visible ASCII of at most 256 bytes"
                        .into(),
                ));
            }
            *self.session.lock() = Some(id.clone());
        }
        let kind = response
            .headers()
            .get(CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_ascii_lowercase();
        // Keeping the connection for reuse only once its body has been read.
        let body = response.into_body();
        let answer = match status {
            StatusCode::OK if kind.starts_with("text/event-stream") => Answer::Stream(body),
            StatusCode::OK if kind.starts_with("application/json") => Answer::Json(body),
            StatusCode::OK => {
                // Not its value: what a backend writes stays out of the log.
                return Err(CallError::Lost(
                    "the backend answered 200 with a Content-Type that is neither application/json nor text/event-stream".into(),
                ));
            }
            StatusCode::ACCEPTED => Answer::Accepted,
            StatusCode::NOT_FOUND if sent_session => return Ok(None),
            // The request reached the backend: whatever it says now, it may have acted
            // on it, so none of these is "nothing was sent".
            s if s.is_redirection() => {
                return Err(CallError::Lost(format!(
                    "the backend answered {s} (redirects are not followed); it may have acted on the request"
                )));
            }
            s if s == StatusCode::UNAUTHORIZED || s == StatusCode::FORBIDDEN => {
                return Err(CallError::Lost(format!(
                    "the backend refused the daemon's credential ({s}) after receiving the request"
                )));
            }
            // A server that could not accept the request may say why in a JSON-RPC
            // error: that is its answer, as it would be under a 200. Without one, the
            // status may come from a front that let the request through first.
            s if s.is_client_error() => {
                let said = match message.id {
                    Some(id) if kind.starts_with("application/json") => {
                        self.refusal(body, id).await
                    }
                    _ => None,
                };
                return Err(said.unwrap_or_else(|| {
                    CallError::Lost(format!(
                        "the backend refused the request ({s}) after receiving it"
                    ))
                }));
            }
            s => return Err(CallError::Lost(format!("the backend failed ({s})"))),
        };
        Ok(Some((answer, conn)))
    }

    /// [`Self::exchange_as_said`], with the daemon's credential cut out of whatever the
    /// backend said in an error (a backend that echoes the `Authorization` it refused
    /// would hand it to the caller, the log and the status).
    async fn exchange(
        &self,
        negotiated: &Negotiated,
        message: &Outgoing<'_>,
        progress: &Progress,
    ) -> Result<protocol::Answer, CallError> {
        let answer = self.exchange_as_said(negotiated, message, progress).await;
        answer.map_err(|e| match (e, &self.authorization) {
            (CallError::Rpc { code, message }, Some(auth)) => {
                let token = auth.as_bytes().strip_prefix(b"Bearer ").unwrap_or_default();
                let token = std::str::from_utf8(token).unwrap_or_default();
                CallError::Rpc {
                    code,
                    message: if token.is_empty() {
                        message
                    } else {
                        message.replace(token, "[redacted]")
                    },
                }
            }
            (e, _) => e,
        })
    }

    /// One request and its answer (JSON or the event that answers it), renewing a
    /// forgotten session once; `id` is the request's (none for a notification) with where
    /// its progress goes.
    async fn exchange_as_said(
        &self,
        negotiated: &Negotiated,
        message: &Outgoing<'_>,
        progress: &Progress,
    ) -> Result<protocol::Answer, CallError> {
        let method = message.method;
        let mut renewed = false;
        loop {
            let Some((answer, conn)) = self.post(negotiated, message, true).await? else {
                if renewed || negotiated.is_modern() {
                    // Sent twice, answered 404 twice: the backend may have acted on it.
                    return Err(CallError::Lost(
                        "the backend does not know the session it just created".into(),
                    ));
                }
                tracing::info!(upstream = %self.upstream, "the backend forgot its session; initialising a new one");
                self.renew(negotiated).await?;
                renewed = true;
                continue;
            };
            let Some(id) = message.id else {
                // A notification: any 2xx will do; the body is not read.
                return Ok(protocol::Answer {
                    result: Map::new(),
                    held: None,
                });
            };
            let result = match answer {
                Answer::Accepted => Err(CallError::Lost(
                    "the backend answered 202 to a request".into(),
                )),
                Answer::Json(body) => {
                    let bytes = read_body(body, self.bounds.response_limit).await?;
                    self.give_back(conn);
                    let (message, held) = self.parse(&bytes)?;
                    match protocol::classify(message) {
                        Message::Response { id: got, result } if got == id => {
                            result.map(|result| protocol::Answer {
                                result,
                                held: Some(held),
                            })
                        }
                        _ => Err(CallError::Lost(
                            "the backend's answer is not the response to the request".into(),
                        )),
                    }
                }
                Answer::Stream(body) => {
                    let result = self.read_stream(body, id, progress).await;
                    // A stream read to its answer may still be open: the connection is not
                    // reused.
                    drop(conn);
                    result
                }
            };
            if method == "tools/list"
                && let Ok(answer) = &result
            {
                self.learn_param_headers(&answer.result);
            }
            return result;
        }
    }

    /// Notes, for each tool of a `tools/list` page, the arguments its input schema
    /// annotates with `x-mcp-header` (through nested `properties`; a name that is not a
    /// header token is left out).
    fn learn_param_headers(&self, page: &Map<String, Value>) {
        let Some(Value::Array(tools)) = page.get("tools") else {
            return;
        };
        let mut known = self.param_headers.lock();
        for tool in tools {
            let Some(name) = tool.get("name").and_then(Value::as_str) else {
                continue;
            };
            // A tool with a name that makes no header is not imported (`tool::import`):
            // what is left out here is never called.
            let found: Vec<ParamHeader> = tool
                .get("inputSchema")
                .and_then(Value::as_object)
                .map(crate::params::annotations)
                .unwrap_or_default()
                .into_iter()
                .filter_map(|(path, header)| {
                    let header = crate::params::header_name(header)?;
                    Some((path.into_iter().map(str::to_owned).collect(), header))
                })
                .collect();
            if found.is_empty() {
                known.remove(name);
            } else {
                known.insert(name.to_owned(), found);
            }
        }
    }

    /// One JSON body or event of the backend's, parsed under the upstreams' budget.
    fn parse(&self, bytes: &[u8]) -> Result<(Value, Share), CallError> {
        protocol::parse(bytes, &self.bounds.memory).map_err(|unread| match unread {
            Unread::NotJson(e) => CallError::Lost(format!("the backend's answer is not JSON: {e}")),
            Unread::Unaffordable(why) => {
                CallError::TooLarge(format!("the backend's answer cannot be read now: {why}"))
            }
        })
    }

    /// The JSON-RPC error in the body of an HTTP error status answering our request
    /// `id` ([`protocol::refusal`]), read within the response limit and the memory budget;
    /// `None` if there is none (or it cannot be read).
    async fn refusal(&self, body: Incoming, id: u64) -> Option<CallError> {
        let bytes = read_body(body, self.bounds.response_limit).await.ok()?;
        let (message, _held) = self.parse(&bytes).ok()?;
        protocol::refusal(message, id)
    }

    /// A new session for a stateful backend that forgot its own: `initialize` again.
    async fn renew(&self, negotiated: &Negotiated) -> Result<(), CallError> {
        *self.session.lock() = None;
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let mut params = Map::new();
        params.insert("protocolVersion".into(), negotiated.version.into());
        params.insert("capabilities".into(), Value::Object(Map::new()));
        params.insert(
            "clientInfo".into(),
            serde_json::to_value(protocol::client_info()).unwrap_or_default(),
        );
        let none = Progress::default();
        let initialize = Outgoing::request(id, "initialize", &params);
        Box::pin(self.exchange(negotiated, &initialize, &none)).await?;
        let empty = Map::new();
        let note = Outgoing::notification("notifications/initialized", &empty);
        Box::pin(self.exchange(negotiated, &note, &none))
            .await
            .map(drop)
    }

    /// Reads events until the one answering `id`; notifications on the way are looked at,
    /// its progress passed on.
    async fn read_stream(
        &self,
        mut body: Incoming,
        id: u64,
        progress: &Progress,
    ) -> Result<protocol::Answer, CallError> {
        let mut events = Events::new(self.bounds.response_limit, self.bounds.stream_limit);
        loop {
            while let Some(data) = events.next_event()? {
                let (message, held) = self.parse(&data)?;
                if let Some((token, update)) = protocol::progress(&message) {
                    if token == id {
                        progress.report(update);
                    }
                    continue;
                }
                match protocol::classify(message) {
                    Message::Response { id: got, result } if got == id => {
                        return result.map(|result| protocol::Answer {
                            result,
                            held: Some(held),
                        });
                    }
                    Message::Notification { method } => {
                        if method == "notifications/tools/list_changed" {
                            self.list_changed.notify_one();
                        }
                    }
                    other => {
                        tracing::debug!(upstream = %self.upstream, "ignored an event: {other:?}");
                    }
                }
            }
            match body.frame().await {
                None => {
                    return Err(CallError::Lost(
                        "the backend's event stream ended without the answer".into(),
                    ));
                }
                Some(Err(e)) => {
                    return Err(CallError::Lost(format!("the event stream broke: {e}")));
                }
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        events.push(&data)?;
                    }
                }
            }
        }
    }

    /// Tells the backend to stop working on `id`; best effort, bounded, never awaited by
    /// the caller.
    fn send_cancel(&self, negotiated: &Negotiated, id: u64, reason: &'static str) {
        let Some(me) = self.me.upgrade() else { return };
        let negotiated = negotiated.clone();
        tokio::spawn(async move {
            let mut params = Map::new();
            params.insert("requestId".into(), Value::from(id));
            params.insert("reason".into(), Value::from(reason));
            let params = negotiated.params(params);
            let note = Outgoing::notification("notifications/cancelled", &params);
            let none = Progress::default();
            let send = me.exchange(&negotiated, &note, &none);
            let _ = tokio::time::timeout(Duration::from_secs(5), send).await;
        });
    }
}

/// Forwards the cancellation of a call whose future is dropped.
struct Outstanding<'a> {
    link: &'a HttpLink,
    negotiated: &'a Negotiated,
    id: u64,
    done: bool,
}

impl Drop for Outstanding<'_> {
    fn drop(&mut self) {
        if !self.done {
            self.link
                .send_cancel(self.negotiated, self.id, "the caller cancelled the request");
        }
    }
}

impl Rpc for HttpLink {
    fn request<'a>(
        &'a self,
        negotiated: &'a Negotiated,
        method: &'static str,
        mut params: Map<String, Value>,
        cancel: &'a CancellationToken,
        limit: Duration,
        progress: &'a Progress,
    ) -> RpcFuture<'a, protocol::Answer> {
        Box::pin(async move {
            let id = self.next_id.fetch_add(1, Ordering::Relaxed);
            if progress.wanted() {
                protocol::ask_progress(&mut params, id);
            }
            let message = Outgoing::request(id, method, &params);
            let mut outstanding = Outstanding {
                link: self,
                negotiated,
                id,
                done: false,
            };
            let answer = tokio::select! {
                answer = self.exchange(negotiated, &message, progress) => answer,
                () = cancel.cancelled() => {
                    self.send_cancel(negotiated, id, "the caller cancelled the request");
                    Err(CallError::Cancelled)
                }
                () = tokio::time::sleep(limit) => {
                    self.send_cancel(negotiated, id, "the call timed out");
                    Err(CallError::Timeout(limit))
                }
            };
            outstanding.done = true;
            answer
        })
    }

    fn notify<'a>(
        &'a self,
        negotiated: &'a Negotiated,
        method: &'static str,
        params: Map<String, Value>,
    ) -> RpcFuture<'a, ()> {
        Box::pin(async move {
            let message = Outgoing::notification(method, &params);
            let none = Progress::default();
            let send = self.exchange(negotiated, &message, &none);
            match tokio::time::timeout(self.bounds.connect_timeout * 2, send).await {
                Ok(result) => result.map(drop),
                Err(_) => Err(CallError::Lost("the notification was not taken".into())),
            }
        })
    }
}

/// A JSON body of at most `limit` bytes.
async fn read_body(mut body: Incoming, limit: usize) -> Result<Bytes, CallError> {
    let mut out = BytesMut::new();
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| CallError::Lost(format!("the answer's body broke: {e}")))?;
        if let Ok(data) = frame.into_data() {
            if out.len() + data.len() > limit {
                return Err(CallError::TooLarge(format!(
                    "the backend's answer is over its {limit} byte response limit"
                )));
            }
            out.extend_from_slice(&data);
        }
    }
    Ok(out.freeze())
}

/// A server-sent event stream, read incrementally: each event's `data` at most
/// `event_limit` bytes, everything at most `stream_limit`.
struct Events {
    buf: BytesMut,
    data: Vec<u8>,
    event_limit: usize,
    stream_limit: u64,
    seen: u64,
}

impl Events {
    fn new(event_limit: usize, stream_limit: u64) -> Self {
        Self {
            buf: BytesMut::new(),
            data: Vec::new(),
            event_limit,
            stream_limit,
            seen: 0,
        }
    }

    fn push(&mut self, bytes: &[u8]) -> Result<(), CallError> {
        self.seen += bytes.len() as u64;
        if self.seen > self.stream_limit {
            return Err(CallError::TooLarge(format!(
                "the backend's event stream is over its {} byte stream limit",
                self.stream_limit
            )));
        }
        self.buf.extend_from_slice(bytes);
        if self.buf.len() > self.event_limit + 1024 && !self.buf.contains(&b'\n') {
            return Err(CallError::TooLarge(format!(
                "an event line is over the {} byte response limit",
                self.event_limit
            )));
        }
        Ok(())
    }

    /// The data of the next complete event, if one is complete.
    fn next_event(&mut self) -> Result<Option<Vec<u8>>, CallError> {
        while let Some(at) = self.buf.iter().position(|&b| b == b'\n') {
            let mut line = self.buf.split_to(at + 1);
            line.truncate(at);
            if line.last() == Some(&b'\r') {
                line.truncate(at - 1);
            }
            if line.is_empty() {
                if !self.data.is_empty() {
                    return Ok(Some(std::mem::take(&mut self.data)));
                }
                continue;
            }
            let (field, value) = match line.iter().position(|&b| b == b':') {
                Some(0) => continue, // a comment
                Some(i) => {
                    let mut v = &line[i + 1..];
                    if v.first() == Some(&b' ') {
                        v = &v[1..];
                    }
                    (&line[..i], v)
                }
                None => (&line[..], &b""[..]),
            };
            if field == b"data" {
                if !self.data.is_empty() {
                    self.data.push(b'\n');
                }
                if self.data.len() + value.len() > self.event_limit {
                    return Err(CallError::TooLarge(format!(
                        "an event is over the {} byte response limit",
                        self.event_limit
                    )));
                }
                self.data.extend_from_slice(value);
            }
        }
        Ok(None)
    }
}

async fn handshake<I>(io: I) -> Result<Conn, CallError>
where
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    let (sender, conn) = hyper::client::conn::http1::Builder::new()
        .max_buf_size(64 * 1024)
        .handshake(io)
        .await
        .map_err(|e| CallError::NotSent(format!("HTTP handshake with the backend failed: {e}")))?;
    let task = ConnTask(tokio::spawn(async move {
        let _ = conn.await;
    }));
    Ok(Conn {
        sender,
        _task: task,
    })
}
