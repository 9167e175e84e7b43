//! Streamable HTTP for a stateless server, as the HTTP carriers serve every request: the
//! transport's rules and the answer's shape, over rmcp's model types, with rmcp's own
//! request dispatch ([`Service::handle_request`], what rmcp's serve loop runs) called in
//! the request's task — no service, task or channel per request.
//!
//! The rules, in order: `Accept` must take JSON and event streams (406), the body must be
//! JSON (415); an `initialize` whose `MCP-Protocol-Version` differs from its body is
//! refused (400); from revision 2026-07-28 on, the `Mcp-Method`, `Mcp-Name` and annotated
//! `Mcp-Param-*` headers must match the body (400, -32020); a request whose header names
//! 2026-07-28 or later must carry the protocol version in `_meta`, and a version in
//! `_meta` must match the header (400). A request that names its version in `_meta` (or a
//! `server/discover`) is negotiated per request: its errors take the HTTP status the
//! revision gives them (400 for version, capability and header errors and for malformed
//! `_meta`, 404 for an unknown method); every other answer is 200. Notifications are
//! answered 202, a client's response 400 (there is no request of ours to answer).
//!
//! The answer is one JSON message, or — when a call sends progress before its result — an
//! event stream of the progress notifications then the result, driven by the response
//! body: a client that goes away drops the call, which cancels it.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Response, StatusCode, header};
use http_body_util::{BodyExt, Full, StreamBody};
use rmcp::RoleServer;
use rmcp::model::{
    ClientJsonRpcMessage, ClientRequest, ErrorCode, ErrorData, GetExtensions, GetMeta, JsonObject,
    JsonRpcError, JsonRpcRequest, ProgressNotification, ProgressNotificationParam, ProtocolVersion,
    RequestId, ServerJsonRpcMessage, ServerNotification,
};
use rmcp::service::{RequestContext, RunningService, RxJsonRpcMessage, Service, TxJsonRpcMessage};
use rmcp::transport::Transport;
use serde_json::Value;
use tokio::sync::mpsc;

use super::http::Body;
use crate::mcp::{AnswerSlot, McpServer, ProgressSender};
use crate::params::{MCP_METHOD, MCP_NAME, PROTOCOL_VERSION};
use crate::session::{RuntimeTools, TurnSubmission};

const JSON: &str = "application/json";
const EVENT_STREAM: &str = "text/event-stream";
/// Progress notifications a call may have queued ahead of its reader.
const PROGRESS_QUEUE: usize = 16;

/// The refusal, if any: 406 unless `Accept` takes both JSON and event streams (a range
/// weighted exactly zero does not count), 415 unless the (first) `Content-Type` is JSON,
/// 415 for a `Content-Encoding` other than `identity`.
pub fn media_types(headers: &HeaderMap) -> Option<Response<Body>> {
    if !accepts_both(headers) {
        return Some(text(
            StatusCode::NOT_ACCEPTABLE,
            "Not Acceptable: Client must accept both application/json and text/event-stream",
        ));
    }
    let is_json = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| {
            v.split_once(';')
                .map_or(v, |(essence, _)| essence)
                .trim()
                .eq_ignore_ascii_case(JSON)
        });
    if !is_json {
        return Some(text(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "Unsupported Media Type: Content-Type must be application/json",
        ));
    }
    // A body in a content coding would be read as if it were plain JSON (RFC 9110
    // §8.4.1: refuse what is not understood).
    let coded = headers
        .get_all(header::CONTENT_ENCODING)
        .iter()
        .flat_map(|v| v.as_bytes().split(|b| *b == b','))
        .map(<[u8]>::trim_ascii)
        .any(|coding| !coding.is_empty() && !coding.eq_ignore_ascii_case(b"identity"));
    coded.then(|| {
        text(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "Unsupported Media Type: a request body is not content-coded (Content-Encoding must be absent or identity)",
        )
    })
}

/// Whether `Accept` takes both JSON and event streams. The value the SDKs send is known
/// at a glance; any other is parsed ([`accepted`]).
fn accepts_both(headers: &HeaderMap) -> bool {
    let mut values = headers.get_all(header::ACCEPT).iter();
    if let (Some(only), None) = (values.next(), values.next())
        && [ACCEPT_BOTH, ACCEPT_BOTH_SSE_FIRST]
            .iter()
            .any(|both| only.as_bytes().eq_ignore_ascii_case(both.as_bytes()))
    {
        return true;
    }
    let (mut json, mut sse) = (false, false);
    for essence in accepted(headers) {
        json |= essence.eq_ignore_ascii_case(JSON);
        sse |= essence.eq_ignore_ascii_case(EVENT_STREAM);
    }
    json && sse
}

/// The two ranges alone, in either order, as clients write them.
const ACCEPT_BOTH: &str = "application/json, text/event-stream";
const ACCEPT_BOTH_SSE_FIRST: &str = "text/event-stream, application/json";

/// The media ranges of every `Accept` value, without those weighted `q=0`.
fn accepted(headers: &HeaderMap) -> impl Iterator<Item = &str> {
    headers
        .get_all(header::ACCEPT)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| unquoted(v, b','))
        .filter_map(|entry| {
            let mut parts = unquoted(entry, b';');
            let essence = parts.next()?.trim();
            parts
                .all(|parameter| match parameter.split_once('=') {
                    Some((name, value)) if name.trim().eq_ignore_ascii_case("q") => {
                        weight_counts(value.trim())
                    }
                    _ => true,
                })
                .then_some(essence)
        })
}

/// `value` split at `delimiter` outside quoted strings (a byte walk: the delimiters,
/// quotes and escapes are ASCII, so every cut is at a character boundary).
fn unquoted(value: &str, delimiter: u8) -> impl Iterator<Item = &str> {
    let bytes = value.as_bytes();
    let (mut start, mut at) = (0, 0);
    let (mut quoted, mut escaped, mut done) = (false, false, false);
    std::iter::from_fn(move || {
        if done {
            return None;
        }
        while let Some(&c) = bytes.get(at) {
            at += 1;
            if escaped {
                escaped = false;
            } else if quoted && c == b'\\' {
                escaped = true;
            } else if c == b'"' {
                quoted = !quoted;
            } else if !quoted && c == delimiter {
                let part = &value[start..at - 1];
                start = at;
                return Some(part);
            }
        }
        done = true;
        Some(&value[start..])
    })
}

/// Only an explicit zero weight excludes a range; a malformed one is ignored.
fn weight_counts(weight: &str) -> bool {
    let (whole, fraction) = weight.split_once('.').unwrap_or((weight, ""));
    if fraction.len() > 3 || !fraction.bytes().all(|d| d.is_ascii_digit()) {
        return true;
    }
    whole != "0" || fraction.bytes().any(|d| d != b'0')
}

/// A message checked against the transport's rules: what to do with it.
pub enum Checked {
    /// A request, and whether it negotiates its revision per request (`_meta`), with
    /// `_meta` malformed for that.
    Request {
        request: Box<JsonRpcRequest<ClientRequest>>,
        negotiated: bool,
        malformed: bool,
    },
    Notification,
}

/// The transport's rules for a parsed `message` with `headers` (see the module's
/// documentation); `body` is the message's JSON (SEP-2243's headers are compared with it)
/// and `schema` gives a tool's input schema (for its `Mcp-Param-*` annotations).
pub fn check(
    headers: &HeaderMap,
    message: ClientJsonRpcMessage,
    body: &[u8],
    schema: impl Fn(&str) -> Option<std::sync::Arc<JsonObject>>,
) -> Result<Checked, Box<Response<Body>>> {
    let request = match message {
        ClientJsonRpcMessage::Request(request) => Some(request),
        ClientJsonRpcMessage::Notification(_) => None,
        ClientJsonRpcMessage::Response(_) | ClientJsonRpcMessage::Error(_) => {
            return Err(refusal(
                None,
                ErrorData::invalid_request(
                    "stateless server does not accept JSON-RPC responses",
                    None,
                ),
            ));
        }
    };
    let id = request.as_ref().map(|r| r.id.clone());
    let header = headers.get(&PROTOCOL_VERSION).and_then(|v| v.to_str().ok());
    if let Some(request) = &request
        && let ClientRequest::InitializeRequest(init) = &request.request
    {
        let body_version = init.params.protocol_version.as_str();
        if let Some(value) = headers.get(&PROTOCOL_VERSION) {
            let Ok(text) = value.to_str() else {
                return Err(refusal(
                    id,
                    ErrorData::invalid_request(
                        "Invalid Request: MCP-Protocol-Version header is not valid UTF-8",
                        None,
                    ),
                ));
            };
            if text != body_version {
                return Err(refusal(
                    id,
                    ErrorData::invalid_request(
                        format!(
                            "Invalid Request: MCP-Protocol-Version header ({text}) does not match initialize params.protocolVersion ({body_version})"
                        ),
                        None,
                    ),
                ));
            }
        }
    }
    if header.is_some_and(|v| v >= ProtocolVersion::STANDARD_HEADERS.as_str()) {
        let initialize = request
            .as_ref()
            .is_some_and(|r| matches!(r.request, ClientRequest::InitializeRequest(_)));
        let checked = if initialize {
            initialize_method_header(headers)
        } else {
            serde_json::from_slice::<Value>(body)
                .map_err(|e| e.to_string())
                .and_then(|message| standard_headers(headers, &message, &schema))
        };
        if let Err(reason) = checked {
            return Err(refusal(id, ErrorData::header_mismatch(reason, None)));
        }
    }
    let Some(request) = request else {
        return Ok(Checked::Notification);
    };
    let initialize = matches!(request.request, ClientRequest::InitializeRequest(_));
    let discover = matches!(request.request, ClientRequest::DiscoverRequest(_));
    let meta = request.request.get_meta();
    let missing = meta.missing_required_keys(&ProtocolVersion::V_2026_07_28);
    if !initialize {
        match (meta.protocol_version(), header) {
            (None, header) => {
                if discover || header.is_some_and(|v| v >= ProtocolVersion::V_2026_07_28.as_str()) {
                    return Err(refusal(
                        id,
                        ErrorData::invalid_params(
                            format!(
                                "Invalid params: request _meta is missing or has malformed required fields: {}",
                                missing.join(", ")
                            ),
                            None,
                        ),
                    ));
                }
            }
            (Some(_), None) => {
                return Err(refusal(
                    id,
                    ErrorData::header_mismatch(
                        "request _meta protocolVersion requires MCP-Protocol-Version header",
                        None,
                    ),
                ));
            }
            (Some(inner), Some(header)) if inner.as_str() != header => {
                return Err(refusal(
                    id,
                    ErrorData::header_mismatch(
                        format!(
                            "MCP-Protocol-Version header ({header}) does not match request _meta protocolVersion ({inner})"
                        ),
                        None,
                    ),
                ));
            }
            (Some(_), Some(_)) => {}
        }
    }
    let negotiated = !initialize && (discover || meta.protocol_version().is_some());
    let malformed = !missing.is_empty();
    Ok(Checked::Request {
        request: Box::new(request),
        negotiated,
        malformed,
    })
}

/// An `initialize` needs no SEP-2243 headers, but an `Mcp-Method` it carries must be
/// exactly one `initialize`.
fn initialize_method_header(headers: &HeaderMap) -> Result<(), String> {
    let mut values = headers.get_all(&MCP_METHOD).iter();
    let Some(first) = values.next() else {
        return Ok(());
    };
    if values.next().is_some() {
        return Err(
            "multiple Mcp-Method header values supplied; initialize requires exactly one".into(),
        );
    }
    if first != "initialize" {
        return Err(format!(
            "Mcp-Method header `{}` does not match body method `initialize`",
            String::from_utf8_lossy(first.as_bytes())
        ));
    }
    Ok(())
}

/// SEP-2243: `Mcp-Method` is the body's method; `Mcp-Name` its name, URI or task id
/// where it has one; for `tools/call`, each `Mcp-Param-<header>` the tool's input schema
/// annotates (`x-mcp-header`) is the argument's value, and present exactly when it is.
fn standard_headers(
    headers: &HeaderMap,
    message: &Value,
    schema: impl Fn(&str) -> Option<std::sync::Arc<JsonObject>>,
) -> Result<(), String> {
    let Some(method) = message.get("method").and_then(Value::as_str) else {
        return Ok(());
    };
    let params = message.get("params");
    match single(headers, &MCP_METHOD)? {
        None => return Err("missing required Mcp-Method header".into()),
        Some(value) if value != method => {
            return Err(format!(
                "Mcp-Method header `{value}` does not match body method `{method}`"
            ));
        }
        Some(_) => {}
    }
    let key = match method {
        "tools/call" | "prompts/get" => Some("name"),
        "resources/read" | "resources/subscribe" | "resources/unsubscribe" => Some("uri"),
        "tasks/get" | "tasks/update" | "tasks/cancel" => Some("taskId"),
        _ => None,
    };
    if let Some(expected) = key.and_then(|k| params?.get(k)?.as_str()) {
        match single(headers, &MCP_NAME)? {
            None => return Err(format!("missing required Mcp-Name header for `{method}`")),
            Some(raw) => {
                let decoded = crate::params::decoded(raw)
                    .ok_or_else(|| "Mcp-Name header is not valid Base64".to_owned())?;
                if decoded != expected {
                    return Err(format!(
                        "Mcp-Name header `{decoded}` does not match body value `{expected}`"
                    ));
                }
            }
        }
    }
    let tool = (method == "tools/call")
        .then(|| params?.get("name")?.as_str())
        .flatten();
    let Some(schema) = tool.and_then(schema) else {
        return Ok(());
    };
    let arguments = params.and_then(|p| p.get("arguments"));
    for (path, name) in crate::params::annotations(&schema) {
        let property = path.join(".");
        let full = format!("{}{name}", crate::params::HEADER_PREFIX);
        let sent = single(headers, &full)?;
        let value = crate::params::argument_text(arguments, &path);
        match (sent, value) {
            (None, None) => {}
            (Some(_), None) => {
                return Err(format!(
                    "unexpected {full} header for absent or null `{property}`"
                ));
            }
            (None, Some(_)) => return Err(format!("missing {full} header for `{property}`")),
            (Some(raw), Some(expected)) => {
                let decoded = crate::params::decoded(raw)
                    .ok_or_else(|| format!("{full} header is not valid Base64"))?;
                if decoded != expected {
                    return Err(format!(
                        "{full} header `{decoded}` does not match body value `{expected}`"
                    ));
                }
            }
        }
    }
    Ok(())
}

/// The one value of header `name`; an error when it is there twice or not text.
fn single<K>(headers: &HeaderMap, name: K) -> Result<Option<&str>, String>
where
    K: http::header::AsHeaderName + std::fmt::Display + Copy,
{
    let mut values = headers.get_all(name).iter();
    let Some(value) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err(format!("duplicate {name} header"));
    }
    value
        .to_str()
        .map(Some)
        .map_err(|_| format!("{name} header contains invalid characters"))
}

/// The HTTP status of a negotiated request's answer.
fn status(message: &ServerJsonRpcMessage, malformed: bool) -> StatusCode {
    let ServerJsonRpcMessage::Error(error) = message else {
        return StatusCode::OK;
    };
    match error.error.code {
        ErrorCode::UNSUPPORTED_PROTOCOL_VERSION
        | ErrorCode::MISSING_REQUIRED_CLIENT_CAPABILITY
        | ErrorCode::HEADER_MISMATCH => StatusCode::BAD_REQUEST,
        ErrorCode::INVALID_PARAMS if malformed => StatusCode::BAD_REQUEST,
        ErrorCode::METHOD_NOT_FOUND => StatusCode::NOT_FOUND,
        _ => StatusCode::OK,
    }
}

/// The peer every request's context names. Handlers here never talk to it (a call's
/// progress goes through [`ProgressSender`]); its fixed client information (revision
/// 2025-03-26, no capabilities) is what a request without `_meta` falls back to, as rmcp's
/// stateless service gives such a request, so no request can change what another sees.
pub struct Peer {
    peer: rmcp::service::Peer<RoleServer>,
    _service: RunningService<RoleServer, Idle>,
}

impl Peer {
    /// Needs a Tokio runtime (the peer's service idles on it until dropped).
    pub fn start() -> Self {
        let info = rmcp::model::InitializeRequestParams::new(
            rmcp::model::ClientCapabilities::default(),
            rmcp::model::Implementation::default(),
        )
        .with_protocol_version(ProtocolVersion::V_2025_03_26);
        let service = rmcp::service::serve_directly(Idle, Nothing, Some(info));
        Self {
            peer: service.peer().clone(),
            _service: service,
        }
    }
}

/// The service behind [`Peer`]: it is never sent anything.
pub struct Idle;

impl rmcp::ServerHandler for Idle {}

/// A transport that never receives and drops what is sent.
struct Nothing;

impl Transport<RoleServer> for Nothing {
    type Error = std::io::Error;

    fn send(
        &mut self,
        _item: TxJsonRpcMessage<RoleServer>,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send + 'static {
        std::future::ready(Ok(()))
    }

    async fn receive(&mut self) -> Option<RxJsonRpcMessage<RoleServer>> {
        std::future::pending().await
    }

    async fn close(&mut self) -> Result<(), Self::Error> {
        Ok(())
    }
}

/// Answers a checked request: rmcp's dispatch over `server`, as `parts`' caller (the
/// request's HTTP parts go into the context's extensions as rmcp's service puts them);
/// `(negotiated, malformed)` as [`Checked::Request`] says; `held` is kept until the
/// connection has taken the whole answer, or dropped it ([`holding`]).
pub async fn answer<S: RuntimeTools + TurnSubmission, H: Send + Sync + Unpin + 'static>(
    server: &McpServer<S>,
    peer: &Peer,
    mut parts: http::request::Parts,
    request: JsonRpcRequest<ClientRequest>,
    (negotiated, malformed): (bool, bool),
    held: H,
) -> Response<Body> {
    let JsonRpcRequest {
        id, mut request, ..
    } = request;
    // Progress can come only for a call that carries a token (where the handler looks).
    let progress = match &request {
        ClientRequest::CallToolRequest(call) => {
            crate::mcp::progress_token(request.get_meta(), &call.params).is_some()
        }
        _ => false,
    };
    let slot = AnswerSlot::wanted(&request).then(|| {
        let slot = AnswerSlot::default();
        parts.extensions.insert(slot.clone());
        slot
    });
    let notes = progress.then(|| {
        let (tx, rx) = mpsc::channel(PROGRESS_QUEUE);
        parts.extensions.insert(ProgressSender(tx));
        rx
    });
    let mut context = RequestContext::new(id.clone(), peer.peer.clone());
    let cancel = context.ct.clone();
    context.meta = std::mem::take(request.get_meta_mut());
    context.extensions = std::mem::take(request.extensions_mut());
    context.extensions.insert(parts);
    let server = server.clone();
    let id_for_call = id.clone();
    let handled = async move {
        let result = Service::<RoleServer>::handle_request(&server, request, context).await;
        let message = match result {
            Ok(result) => ServerJsonRpcMessage::response(result, id_for_call),
            Err(error) => ServerJsonRpcMessage::error(error, Some(id_for_call)),
        };
        Finished(message)
    };
    // Dropping the call (the client went away) cancels it.
    let guard = cancel.drop_guard();
    let mut handled: Pin<Box<dyn Future<Output = Finished> + Send>> = Box::pin(handled);
    let Some(mut notes) = notes else {
        let Finished(message) = handled.await;
        guard.disarm();
        return holding(
            single_answer(message, slot.as_ref(), &id, negotiated, malformed),
            held,
        );
    };
    // The answer is a stream once progress comes before the result.
    let first = tokio::select! {
        biased;
        Finished(message) = &mut handled => Err(message),
        Some(note) = notes.recv() => Ok(note),
    };
    let first = match first {
        Err(message) => match notes.try_recv() {
            // Progress the call sent before it ended still goes first.
            Ok(note) => {
                let mut queued = VecDeque::from([note]);
                while let Ok(more) = notes.try_recv() {
                    queued.push_back(more);
                }
                guard.disarm();
                let result = final_message(message, slot.as_ref(), &id);
                let events = queued
                    .into_iter()
                    .map(progress_event)
                    .chain(std::iter::once(event(&result)))
                    .map(|bytes| Ok::<_, Infallible>(hyper::body::Frame::data(bytes)));
                let events = StreamBody::new(futures_util::stream::iter(events)).boxed();
                return holding(event_stream(events), held);
            }
            Err(_) => {
                guard.disarm();
                return holding(
                    single_answer(message, slot.as_ref(), &id, negotiated, malformed),
                    held,
                );
            }
        },
        Ok(note) => note,
    };
    let stream = Streamed {
        first: Some(first),
        notes: Some(notes),
        handled: Some(std::sync::Mutex::new(handled)),
        slot,
        id,
        guard: Some(guard),
    };
    holding(event_stream(StreamBody::new(stream).boxed()), held)
}

/// Largest piece of an answer's body handed to the connection at a time.
const PIECE: usize = 64 * 1024;

/// `response`, its body keeping `held` (the request's in-flight slot and memory share)
/// until the connection has taken the last of it: an answer is counted against its caller
/// and the carrier until it has left, not just until it is made. The body is given out in
/// pieces of at most [`PIECE`] bytes, as the connection asks for more — so a peer that
/// does not read (an HTTP/2 window left at zero, an HTTP/1.1 socket never drained) leaves
/// the rest here, still held, instead of in the connection's buffers, free of any count.
fn holding<H: Send + Sync + Unpin + 'static>(response: Response<Body>, held: H) -> Response<Body> {
    response.map(|body| {
        Holding {
            body,
            rest: Bytes::new(),
            held: Some(held),
        }
        .boxed()
    })
}

struct Holding<H> {
    body: Body,
    /// What the body gave and the connection has not taken yet.
    rest: Bytes,
    held: Option<H>,
}

impl<H: Unpin> hyper::body::Body for Holding<H> {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<hyper::body::Frame<Bytes>, Infallible>>> {
        let this = &mut *self;
        loop {
            if !this.rest.is_empty() {
                let piece = this.rest.split_to(this.rest.len().min(PIECE));
                return Poll::Ready(Some(Ok(hyper::body::Frame::data(piece))));
            }
            match std::task::ready!(Pin::new(&mut this.body).poll_frame(cx)) {
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(data) => this.rest = data,
                    Err(frame) => return Poll::Ready(Some(Ok(frame))),
                },
                Some(Err(never)) => match never {},
                None => {
                    this.held = None;
                    return Poll::Ready(None);
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.rest.is_empty() && self.body.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        let inner = self.body.size_hint();
        let rest = self.rest.len() as u64;
        let mut hint = hyper::body::SizeHint::new();
        if let Some(upper) = inner.upper() {
            hint.set_upper(upper + rest);
        }
        hint.set_lower(inner.lower() + rest);
        hint
    }
}

/// The handler's answer to a request.
struct Finished(ServerJsonRpcMessage);

/// The one message answering a request, serialized with what the handler left in `slot`.
fn final_message(
    message: ServerJsonRpcMessage,
    slot: Option<&AnswerSlot>,
    id: &RequestId,
) -> Bytes {
    AnswerSlot::encode(slot, &message)
        .map(Bytes::from)
        .unwrap_or_else(|e| {
            encode(&JsonRpcError::new(
                Some(id.clone()),
                ErrorData::internal_error(format!("the answer cannot be serialized: {e}"), None),
            ))
        })
}

/// `message` as JSON (`null` if it cannot be: never for the daemon's own messages).
fn encode(message: &impl serde::Serialize) -> Bytes {
    serde_json::to_vec(message).map_or(Bytes::from_static(b"null"), Bytes::from)
}

fn single_answer(
    message: ServerJsonRpcMessage,
    slot: Option<&AnswerSlot>,
    id: &RequestId,
    negotiated: bool,
    malformed: bool,
) -> Response<Body> {
    let code = if negotiated {
        status(&message, malformed)
    } else {
        StatusCode::OK
    };
    json(code, final_message(message, slot, id))
}

/// A call's event stream: its progress as it comes, then its answer; the call runs as the
/// stream is read.
struct Streamed {
    first: Option<ProgressNotificationParam>,
    notes: Option<mpsc::Receiver<ProgressNotificationParam>>,
    /// In a mutex only to be `Sync`, as a response body must: it is only ever reached
    /// through `&mut` (`get_mut`), never locked.
    handled: Option<std::sync::Mutex<Pin<Box<dyn Future<Output = Finished> + Send>>>>,
    slot: Option<AnswerSlot>,
    id: RequestId,
    guard: Option<tokio_util::sync::DropGuard>,
}

impl futures_util::Stream for Streamed {
    type Item = Result<hyper::body::Frame<Bytes>, Infallible>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = &mut *self;
        if let Some(note) = this.first.take() {
            return Poll::Ready(Some(Ok(hyper::body::Frame::data(progress_event(note)))));
        }
        if let Some(notes) = &mut this.notes
            && let Poll::Ready(Some(note)) = notes.poll_recv(cx)
        {
            return Poll::Ready(Some(Ok(hyper::body::Frame::data(progress_event(note)))));
        }
        let Some(handled) = &mut this.handled else {
            return Poll::Ready(None);
        };
        let handled = handled
            .get_mut()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let Poll::Ready(Finished(message)) = handled.as_mut().poll(cx) else {
            return Poll::Pending;
        };
        this.handled = None;
        if let Some(guard) = this.guard.take() {
            guard.disarm();
        }
        // Progress sent just before the end goes before the answer.
        let mut data = Vec::new();
        if let Some(mut notes) = this.notes.take() {
            while let Ok(note) = notes.try_recv() {
                data.extend_from_slice(&progress_event(note));
            }
        }
        let result = final_message(message, this.slot.as_ref(), &this.id);
        data.extend_from_slice(&event(&result));
        Poll::Ready(Some(Ok(hyper::body::Frame::data(Bytes::from(data)))))
    }
}

fn progress_event(note: ProgressNotificationParam) -> Bytes {
    let message = ServerJsonRpcMessage::notification(ServerNotification::ProgressNotification(
        ProgressNotification::new(note),
    ));
    event(&encode(&message))
}

/// One event of a stream: `data: <message>`.
fn event(message: &[u8]) -> Bytes {
    let mut event = Vec::with_capacity(message.len() + 8);
    event.extend_from_slice(b"data: ");
    event.extend_from_slice(message);
    event.extend_from_slice(b"\n\n");
    Bytes::from(event)
}

fn event_stream(body: Body) -> Response<Body> {
    let mut response = Response::new(body);
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(EVENT_STREAM));
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    headers.insert("x-accel-buffering", HeaderValue::from_static("no"));
    response
}

/// A JSON-RPC error answered 400 before dispatch.
fn refusal(id: Option<RequestId>, error: ErrorData) -> Box<Response<Body>> {
    Box::new(json(
        StatusCode::BAD_REQUEST,
        encode(&JsonRpcError::new(id, error)),
    ))
}

pub fn json(status: StatusCode, body: Bytes) -> Response<Body> {
    let mut response = Response::new(Full::new(body).boxed());
    *response.status_mut() = status;
    response
        .headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(JSON));
    response
}

pub fn text(status: StatusCode, message: &'static str) -> Response<Body> {
    let mut response = Response::new(Full::new(Bytes::from_static(message.as_bytes())).boxed());
    *response.status_mut() = status;
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_answer_keeps_what_its_request_holds_until_the_connection_took_all_of_it() {
        use hyper::body::Body as _;
        let held = std::sync::Arc::new(());
        let answer = Bytes::from(vec![b'x'; 2 * PIECE + 10]);
        let response = holding(json(StatusCode::OK, answer.clone()), held.clone());
        let mut body = response.into_body();
        assert_eq!(body.size_hint().exact(), Some(answer.len() as u64));
        let waker = futures_util::task::noop_waker();
        let mut cx = Context::from_waker(&waker);
        let mut taken = Vec::new();
        loop {
            let Poll::Ready(frame) = Pin::new(&mut body).poll_frame(&mut cx) else {
                panic!("a whole answer is never pending");
            };
            let Some(frame) = frame else { break };
            let data = frame.unwrap().into_data().unwrap();
            assert!(data.len() <= PIECE, "a piece of {} bytes", data.len());
            assert_eq!(
                std::sync::Arc::strong_count(&held),
                2,
                "released with {} of {} bytes taken",
                taken.len() + data.len(),
                answer.len()
            );
            taken.extend_from_slice(&data);
            assert_eq!(
                body.size_hint().exact(),
                Some((answer.len() - taken.len()) as u64)
            );
        }
        assert_eq!(taken, answer);
        assert_eq!(std::sync::Arc::strong_count(&held), 1, "kept after the end");
        // A connection that goes away gives it back too.
        let response = holding(json(StatusCode::OK, answer), held.clone());
        drop(response);
        assert_eq!(std::sync::Arc::strong_count(&held), 1);
    }

    fn ranges(values: &[&'static str]) -> Vec<String> {
        let mut headers = HeaderMap::new();
        for v in values {
            headers.append(header::ACCEPT, HeaderValue::from_static(v));
        }
        accepted(&headers).map(str::to_owned).collect()
    }

    #[test]
    fn accept_ranges_are_split_outside_quotes_and_zero_weights_dropped() {
        assert_eq!(
            ranges(&["application/json, text/event-stream"]),
            ["application/json", "text/event-stream"]
        );
        assert_eq!(
            ranges(&["application/json", "TEXT/EVENT-STREAM;q=0.5"]),
            ["application/json", "TEXT/EVENT-STREAM"]
        );
        // A comma or semicolon inside a quoted parameter (escaped quotes too) cuts nothing.
        assert_eq!(
            ranges(&[r#"application/json;x="a,b;\"c,d", text/event-stream"#]),
            ["application/json", "text/event-stream"]
        );
        assert_eq!(
            ranges(&["application/json;q=0, text/event-stream;Q=0.000, */*;q=0.001"]),
            ["*/*"]
        );
        // A malformed weight is ignored; empty members stay empty.
        assert_eq!(
            ranges(&["text/event-stream;q=zero,,"]),
            ["text/event-stream", "", ""]
        );
        assert!(ranges(&[]).is_empty());
    }

    /// The values known at a glance are the ones the parse takes too, and a value only
    /// like them (another range, a weight of zero, a second `Accept`) is parsed.
    #[test]
    fn the_accept_known_at_a_glance_is_what_the_parse_takes() {
        let parsed = |values: &[&'static str]| {
            let ranges = ranges(values);
            let has = |kind: &str| ranges.iter().any(|r| r.eq_ignore_ascii_case(kind));
            has(JSON) && has(EVENT_STREAM)
        };
        let both = |values: &[&'static str]| {
            let mut headers = HeaderMap::new();
            for v in values {
                headers.append(header::ACCEPT, HeaderValue::from_static(v));
            }
            accepts_both(&headers)
        };
        for values in [
            &[ACCEPT_BOTH][..],
            &[ACCEPT_BOTH_SSE_FIRST],
            &["Application/JSON, Text/Event-Stream"],
            &["application/json,text/event-stream"],
            &["application/json", "text/event-stream"],
            &["application/json, text/event-stream;q=0"],
            &["application/json, text/event-streams"],
            &["application/json"],
            &[ACCEPT_BOTH, "text/plain"],
            &[],
        ] {
            assert_eq!(both(values), parsed(values), "{values:?}");
        }
    }

    #[test]
    fn both_media_types_are_needed_and_the_body_must_be_json() {
        let headers = |accept: &'static str, kind: &'static str| {
            let mut h = HeaderMap::new();
            h.insert(header::ACCEPT, HeaderValue::from_static(accept));
            h.insert(header::CONTENT_TYPE, HeaderValue::from_static(kind));
            h
        };
        let status = |h: &HeaderMap| media_types(h).map(|r| r.status());
        let both = "application/json, text/event-stream";
        assert_eq!(
            status(&headers(both, "application/json; charset=utf-8")),
            None
        );
        assert_eq!(
            status(&headers("application/json", "application/json")),
            Some(StatusCode::NOT_ACCEPTABLE)
        );
        assert_eq!(
            status(&headers(
                "application/json;q=0, text/event-stream",
                "application/json"
            )),
            Some(StatusCode::NOT_ACCEPTABLE)
        );
        assert_eq!(
            status(&headers(both, "text/plain")),
            Some(StatusCode::UNSUPPORTED_MEDIA_TYPE)
        );
        let coded = |coding: &'static str| {
            let mut h = headers(both, "application/json");
            h.append(header::CONTENT_ENCODING, HeaderValue::from_static(coding));
            status(&h)
        };
        assert_eq!(coded("identity"), None);
        assert_eq!(coded(" Identity ,"), None);
        assert_eq!(coded("gzip"), Some(StatusCode::UNSUPPORTED_MEDIA_TYPE));
        assert_eq!(
            coded("identity, br"),
            Some(StatusCode::UNSUPPORTED_MEDIA_TYPE)
        );
    }
}
