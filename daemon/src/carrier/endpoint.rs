//! What an HTTP carrier does with an admitted request: the same for loopback and remote.
//!
//! Order: 405 for anything but POST, 413 from `Content-Length` before reading, 503 +
//! `Retry-After` when every in-flight slot is taken, then the body is read under the
//! carrier's memory budget (413 past the size limit, 408 past the body deadline, 503 when
//! the budget stays taken), then looked at strictly ([`crate::jsonrpc`]: 400 with a
//! JSON-RPC error for a parse error, a batch, a bad id or params), then 400 for an
//! unsupported `MCP-Protocol-Version` (with the request's id). A
//! `notifications/cancelled` cancels the same caller's in-flight request and is answered
//! 202 here; a carrier's gate may answer a call itself (the remote carrier's 403 for a
//! tool that needs scopes the token lacks, before anything runs); everything else goes to
//! rmcp's stateless service. Every error answer is counted by reason.
//!
//! The memory budget (`[limits] request_memory`, per carrier): a request holds budget
//! for twice its body (ours and the SDK's copy) while it is read, then for
//! [`crate::jsonrpc::VALUE_COST`] per JSON value before it is parsed, until it is
//! answered. A body whose cost alone would exceed the budget is refused 413. A request
//! waits for budget only while it holds none (for a declared body length, before its
//! first byte); any further share must be free at once, or it gives back what it holds
//! and is answered 503 — so no set of requests can hold the budget while waiting on each
//! other. A flood of bodies built to amplify (`[[],[],…]`) costs about the budget,
//! whatever the limits.

use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::{HeaderValue, Method, StatusCode, header};
use http_body_util::{BodyExt, Full};
use hyper::{Request, Response};
use rmcp::model::RequestId;
use rmcp::transport::streamable_http_server::session::never::NeverSessionManager;
use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};
use serde_json::Value;
use tokio::sync::Semaphore;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::http::{self as server, Body};
use crate::budget::{Budget, Share, units};
use crate::config::{HttpLimits, Limits};
use crate::jsonrpc::{self, Invalid};
use crate::mcp::{InFlight, McpServer, PassthroughSlot, SUPPORTED_VERSIONS, is_supported_version};
use crate::metrics::Metrics;
use crate::session::{RuntimeTools, TurnSubmission};
use crate::vocab::Admitted;
use crate::vocab::{CancelOutcome, Listener, Rejection};

/// A carrier's look at a call before it reaches the session: given the canonical tool it
/// would run (`tools/call`; `job.status` / `job.cancel` for `tasks/get` /
/// `tasks/cancel`) and the caller, `None` lets it go on, `Some` is the answer instead.
pub type Gate<'a> = &'a (dyn Fn(&str, &Admitted) -> Option<Response<Body>> + Sync);

const PROTOCOL_VERSION_HEADER: &str = "mcp-protocol-version";

/// The MCP endpoint behind admission.
pub struct Endpoint<S> {
    listener: Listener,
    metrics: Metrics,
    slots: Semaphore,
    memory: Budget,
    body_limit: u64,
    body_timeout: Duration,
    inflight: Arc<InFlight>,
    /// For the canonical names of calls (the gate's input) and the carrier's own answers
    /// ([`Self::direct`]).
    server: McpServer<S>,
    service: StreamableHttpService<McpServer<S>, NeverSessionManager>,
}

/// Who the endpoint answers for (the `listener` label of its metrics).
pub struct Site {
    pub listener: Listener,
    pub metrics: Metrics,
}

impl<S: RuntimeTools + TurnSubmission> Endpoint<S> {
    /// `hosts` and `origin` configure rmcp's own checks consistently with our admission.
    ///
    /// `drained` must fire only once the carrier's drain is over: rmcp answers every
    /// request still in its hands 500 the moment its token fires, which would take the
    /// drain grace away from in-flight requests (a drain that runs out drops the
    /// connections, and that cancels their handlers anyway).
    pub fn new(
        server: McpServer<S>,
        site: Site,
        bounds: &HttpLimits,
        limits: &Limits,
        hosts: Vec<String>,
        origin: String,
        drained: &CancellationToken,
    ) -> Self {
        let inflight = server.inflight().clone();
        let names = server.clone();
        let service = sdk_service(server, limits, hosts, origin, drained);
        Self {
            listener: site.listener,
            metrics: site.metrics,
            slots: Semaphore::new(bounds.max_in_flight),
            memory: Budget::new(limits.request_memory),
            body_limit: limits.request_body,
            body_timeout: bounds.body_timeout,
            inflight,
            server: names,
            service,
        }
    }

    fn reject(&self, why: Rejection, response: Response<Body>) -> Response<Body> {
        self.metrics.rejected(self.listener, why);
        response
    }

    /// Serve a request admitted as `caller`, with the carrier's `gate` (if any) asked
    /// about every call before it runs.
    pub async fn serve<B>(
        &self,
        req: Request<B>,
        caller: Admitted,
        gate: Option<Gate<'_>>,
    ) -> Response<Body>
    where
        B: hyper::body::Body<Data = Bytes> + Send,
    {
        let (mut parts, body) = req.into_parts();
        if parts.method != Method::POST {
            let mut response = server::empty(StatusCode::METHOD_NOT_ALLOWED);
            response
                .headers_mut()
                .insert(header::ALLOW, HeaderValue::from_static("POST"));
            return self.reject(Rejection::MethodNotAllowed, response);
        }
        let declared = parts
            .headers
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        if declared.is_some_and(|n| n > self.body_limit) {
            let response = closing(server::empty(StatusCode::PAYLOAD_TOO_LARGE), parts.version);
            return self.reject(Rejection::BodyTooLarge, response);
        }
        let Ok(_slot) = self.slots.try_acquire() else {
            return self.reject(Rejection::Busy, busy());
        };
        // A client that never finishes its body gives up its slot at the deadline.
        let deadline = Instant::now() + self.body_timeout;
        let (bytes, mut held) = match self.read(body, declared, deadline).await {
            Ok(read) => read,
            Err(failure) => {
                let (why, response) = failure.answer(parts.version);
                return self.reject(why, response);
            }
        };
        let message = match jsonrpc::inspect(&bytes) {
            Ok(message) => message,
            Err(invalid) => {
                let why = match invalid {
                    Invalid::Parse(_) => Rejection::ParseError,
                    Invalid::Request { .. } => Rejection::InvalidRequest,
                    Invalid::Params { .. } => Rejection::InvalidParams,
                };
                return self.reject(
                    why,
                    json_response(StatusCode::BAD_REQUEST, &invalid.response()),
                );
            }
        };
        // The parse to come: its values, beyond the bytes already held for.
        let parse = units(message.cost.saturating_sub(bytes.len()));
        if held.num_permits() + parse > self.memory.units() {
            let response = closing(server::empty(StatusCode::PAYLOAD_TOO_LARGE), parts.version);
            return self.reject(Rejection::BodyTooLarge, response);
        }
        // Never wait for more while holding some: a request that cannot have its whole
        // share at once gives back what it holds (503), so holders cannot block each other.
        match self.memory.try_take(parse) {
            Some(more) => held.merge(more),
            None => {
                drop(held);
                return self.reject(Rejection::Busy, busy());
            }
        }
        if let Err(requested) = protocol_version(&parts.headers) {
            return self.reject(
                Rejection::UnsupportedVersion,
                unsupported_version(message.id.as_ref(), &requested),
            );
        }
        if message.method.as_deref() == Some("notifications/cancelled") {
            let matched = cancelled_request_id(&bytes)
                .is_some_and(|id| self.inflight.cancel(&caller.caller, &id));
            self.metrics.cancellation(if matched {
                CancelOutcome::Matched
            } else {
                CancelOutcome::Unmatched
            });
            return server::empty(StatusCode::ACCEPTED);
        }
        if let Some(gate) = gate {
            let tool = match message.method.as_deref() {
                Some("tools/call") => message
                    .tool
                    .as_deref()
                    .and_then(|wire| self.server.canonical_name(wire)),
                Some("tasks/get") => Some("job.status".to_owned()),
                Some("tasks/cancel") => Some("job.cancel".to_owned()),
                _ => None,
            };
            if let Some(answer) = tool.and_then(|tool| gate(&tool, &caller)) {
                return answer;
            }
        }
        if let Some(answer) = self.direct(&parts.headers, &message, &bytes, &caller).await {
            drop(held);
            return answer;
        }
        parts.extensions.insert(caller);
        let passthrough = (message.method.as_deref() == Some("tools/call")).then(|| {
            let slot = PassthroughSlot::default();
            parts.extensions.insert(slot.clone());
            slot
        });
        let response = self
            .service
            .handle(Request::from_parts(parts, Full::new(bytes)))
            .await;
        drop(held);
        // An imported tool's result goes out whole, instead of rmcp's rendering of it: as
        // the answer, or as the answer's event when progress made the answer a stream.
        if let Some(slot) = passthrough {
            let id = message.id.unwrap_or(Value::Null);
            if let Some(answer) = slot.response(&id) {
                return json_response(StatusCode::OK, &answer);
            }
            if is_event_stream(&response) {
                return response.map(|body| {
                    body.map_frame(move |frame| whole_event(frame, &slot, &id))
                        .boxed()
                });
            }
        }
        if response.status().is_client_error() {
            self.metrics.rejected(self.listener, Rejection::Protocol);
        }
        response.map(|b| b.boxed())
    }

    /// The answer to a `ping`, a `tools/list` of the whole catalog or a `tools/call`,
    /// given here rather than by the SDK's per-request service: the same handler code
    /// runs (`tools/call` through [`McpServer::call_legacy`]) and the answer is shaped as
    /// the SDK shapes it; the listing depends only on the catalog generation, so it is
    /// serialized once per generation and only the request id is spliced in. Only for a
    /// request the SDK would answer exactly so — plain (no cursor, `_meta` or `task`), on
    /// revision 2025-11-25, with plain `Accept` and `Content-Type` values and no `Origin`;
    /// anything else, and a listing broken by a collision, goes to the SDK.
    async fn direct(
        &self,
        headers: &http::HeaderMap,
        message: &jsonrpc::Inspected,
        body: &Bytes,
        caller: &Admitted,
    ) -> Option<Response<Body>> {
        let id = message.id.as_ref().filter(|_| message.plain)?;
        let method = message.method.as_deref()?;
        if !matches!(method, "ping" | "tools/list" | "tools/call") || !plain_2025_request(headers) {
            return None;
        }
        let result = match method {
            "ping" => Bytes::from_static(b"{}"),
            "tools/list" => self.server.encoded_listing()?,
            _ => {
                #[derive(serde::Deserialize)]
                struct Call {
                    params: rmcp::model::CallToolRequestParams,
                }
                let call: Call = serde_json::from_slice(body).ok()?;
                let request_id: RequestId = serde_json::from_value(id.clone()).ok()?;
                let slot = PassthroughSlot::default();
                let result = self
                    .server
                    .call_legacy(caller, request_id, call.params, Some(&slot))
                    .await;
                // The tool has run: whatever happens now, the SDK must not run it again.
                let Some(result) = result else {
                    let error = rmcp::model::ErrorData::internal_error(
                        "the tool's result cannot be serialized",
                        None,
                    );
                    let body = serde_json::json!({"jsonrpc": "2.0", "id": id, "error": error});
                    return Some(json_response(StatusCode::OK, &body));
                };
                // An imported tool's result goes out whole, instead of the rendering.
                if let Some(answer) = slot.response(id) {
                    return Some(json_response(StatusCode::OK, &answer));
                }
                result
            }
        };
        let id = serde_json::to_vec(id).ok()?;
        let mut body = Vec::with_capacity(result.len() + id.len() + 36);
        body.extend_from_slice(br#"{"jsonrpc":"2.0","id":"#);
        body.extend_from_slice(&id);
        body.extend_from_slice(br#","result":"#);
        body.extend_from_slice(&result);
        body.push(b'}');
        let mut response = Response::new(Full::new(Bytes::from(body)).boxed());
        response.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        Some(response)
    }

    /// Read the body, holding budget for twice what has arrived: for a declared length,
    /// all of it before the first byte (waiting for it, holding nothing); for a body of
    /// unknown length, in steps that must be free at once.
    async fn read<B: hyper::body::Body<Data = Bytes>>(
        &self,
        body: B,
        declared: Option<u64>,
        deadline: Instant,
    ) -> Result<(Bytes, Share), ReadFailure> {
        let limit = usize::try_from(self.body_limit).unwrap_or(usize::MAX);
        let initial = declared.map_or(0, |n| usize::try_from(n).unwrap_or(limit).min(limit));
        let mut held = self
            .memory
            .take_until(units(2 * initial), deadline)
            .await
            .ok_or(ReadFailure::Busy)?;
        let mut collected = BytesMut::with_capacity(initial);
        let mut body = std::pin::pin!(body);
        loop {
            let frame = tokio::time::timeout_at(deadline, body.frame())
                .await
                .map_err(|_| ReadFailure::Timeout)?;
            let Some(frame) = frame else { break };
            let frame = frame.map_err(|_| ReadFailure::Broken)?;
            let Ok(data) = frame.into_data() else {
                continue;
            };
            if data.len() > limit - collected.len() {
                return Err(ReadFailure::TooLarge);
            }
            let needed = units(2 * (collected.len() + data.len()));
            if needed > held.num_permits() {
                // Grow in steps of 64 KiB so a trickle of small frames is not a lock each.
                let step = needed
                    .saturating_sub(held.num_permits())
                    .max(64)
                    .min((self.memory.units()).saturating_sub(held.num_permits()));
                let more = self.memory.try_take(step).ok_or(ReadFailure::Busy)?;
                held.merge(more);
            }
            collected.extend_from_slice(&data);
        }
        Ok((collected.freeze(), held))
    }
}

/// rmcp's stateless Streamable HTTP service over `server`, as every HTTP carrier runs it
/// behind its endpoint: JSON answers (a stream only when the handler sends a message
/// before its response), no session, no keep-alive events, rmcp's own host and origin
/// checks set to the carrier's names.
pub(super) fn sdk_service<S: RuntimeTools + TurnSubmission>(
    server: McpServer<S>,
    limits: &Limits,
    hosts: Vec<String>,
    origin: String,
    drained: &CancellationToken,
) -> StreamableHttpService<McpServer<S>, NeverSessionManager> {
    let config = StreamableHttpServerConfig::default()
        .with_legacy_session_mode(false)
        .with_json_response(true)
        .with_sse_keep_alive(None)
        .with_allowed_hosts(hosts)
        .with_allowed_origins([origin])
        .enforce_origin_validation()
        .with_max_request_body_bytes(usize::try_from(limits.request_body).unwrap_or(usize::MAX))
        .with_cancellation_token(drained.child_token());
    StreamableHttpService::new(
        move || Ok(server.clone()),
        Arc::new(NeverSessionManager::default()),
        config,
    )
}

/// Why a body could not be read.
enum ReadFailure {
    TooLarge,
    Timeout,
    Broken,
    Busy,
}

impl ReadFailure {
    fn answer(self, version: http::Version) -> (Rejection, Response<Body>) {
        match self {
            ReadFailure::TooLarge => (
                Rejection::BodyTooLarge,
                closing(server::empty(StatusCode::PAYLOAD_TOO_LARGE), version),
            ),
            ReadFailure::Timeout => (
                Rejection::BodyTimeout,
                closing(server::empty(StatusCode::REQUEST_TIMEOUT), version),
            ),
            ReadFailure::Broken => (Rejection::BodyError, server::empty(StatusCode::BAD_REQUEST)),
            ReadFailure::Busy => (Rejection::Busy, closing(busy(), version)),
        }
    }
}

fn busy() -> Response<Body> {
    let mut response = server::empty(StatusCode::SERVICE_UNAVAILABLE);
    response
        .headers_mut()
        .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    response
}

fn is_event_stream<B>(response: &Response<B>) -> bool {
    response
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"))
}

/// One event of a call's stream (rmcp writes one `data: <message>` event per frame): the
/// event answering the call, once the slot holds the whole result, becomes that result;
/// every other event (progress) goes as it is.
fn whole_event(
    frame: hyper::body::Frame<Bytes>,
    slot: &PassthroughSlot,
    id: &Value,
) -> hyper::body::Frame<Bytes> {
    let answers = slot.is_filled()
        && frame
            .data_ref()
            .and_then(|data| data.strip_prefix(b"data: "))
            .and_then(|json| serde_json::from_slice::<Value>(json).ok())
            .is_some_and(|message| message.get("result").is_some() && message.get("id").is_some());
    match answers.then(|| slot.response(id)).flatten() {
        Some(answer) => hyper::body::Frame::data(Bytes::from(format!("data: {answer}\n\n"))),
        None => frame,
    }
}

/// On HTTP/1, close after a response sent without reading the request body.
pub fn closing(mut response: Response<Body>, version: http::Version) -> Response<Body> {
    if version <= http::Version::HTTP_11 {
        response
            .headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
    }
    response
}

/// At most one `MCP-Protocol-Version`, and a supported one; the offending text if not.
/// Absent is allowed (a 2025-11-25 `initialize` carries its version in the body).
fn protocol_version(headers: &http::HeaderMap) -> Result<(), String> {
    let mut values = headers.get_all(PROTOCOL_VERSION_HEADER).iter();
    let requested = |v: &HeaderValue| {
        let text = String::from_utf8_lossy(v.as_bytes());
        text.chars().take(64).collect::<String>()
    };
    match (values.next(), values.next()) {
        (None, _) => Ok(()),
        (Some(v), None) if v.to_str().is_ok_and(is_supported_version) => Ok(()),
        (Some(v), None) => Err(requested(v)),
        (Some(v), Some(_)) => Err(requested(v)),
    }
}

/// Headers of a request that the SDK would serve without any question: exactly one
/// `MCP-Protocol-Version: 2025-11-25` (later revisions negotiate per request), an
/// `Accept` naming `application/json` and `text/event-stream` without parameters or
/// quotes, exactly one `Content-Type` of `application/json` (parameters allowed), and no
/// `Origin` (a browser's request takes the SDK's origin checks as well as ours).
fn plain_2025_request(headers: &http::HeaderMap) -> bool {
    let mut versions = headers.get_all(PROTOCOL_VERSION_HEADER).iter();
    let version_ok = matches!(
        (versions.next(), versions.next()),
        (Some(v), None) if v.as_bytes() == rmcp::model::ProtocolVersion::V_2025_11_25.as_str().as_bytes()
    );
    if !version_ok || headers.contains_key(header::ORIGIN) {
        return false;
    }
    let (mut json, mut sse) = (false, false);
    for value in headers.get_all(header::ACCEPT) {
        let Ok(text) = value.to_str() else {
            return false;
        };
        if text.contains('"') {
            return false;
        }
        for entry in text.split(',').map(str::trim) {
            json |= entry.eq_ignore_ascii_case("application/json");
            sse |= entry.eq_ignore_ascii_case("text/event-stream");
        }
    }
    let mut types = headers.get_all(header::CONTENT_TYPE).iter();
    let type_ok = match (types.next(), types.next()) {
        (Some(v), None) => v.to_str().is_ok_and(|t| {
            t.split(';')
                .next()
                .is_some_and(|essence| essence.trim().eq_ignore_ascii_case("application/json"))
        }),
        _ => false,
    };
    json && sse && type_ok
}

/// 400 with the JSON-RPC error rmcp uses for an unsupported protocol version (-32022),
/// naming what was requested and what is supported, for the request's id.
fn unsupported_version(id: Option<&Value>, requested: &str) -> Response<Body> {
    let error = rmcp::model::ErrorData::new(
        rmcp::model::ErrorCode::UNSUPPORTED_PROTOCOL_VERSION,
        "Unsupported protocol version",
        Some(serde_json::json!({"requested": requested, "supported": SUPPORTED_VERSIONS})),
    );
    let body = serde_json::json!({"jsonrpc": "2.0", "id": id, "error": error});
    json_response(StatusCode::BAD_REQUEST, &body)
}

fn json_response(status: StatusCode, body: &Value) -> Response<Body> {
    let mut response = Response::new(Full::new(Bytes::from(body.to_string())).boxed());
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    response
}

/// The `requestId` of a `notifications/cancelled` message.
fn cancelled_request_id(body: &[u8]) -> Option<RequestId> {
    #[derive(serde::Deserialize)]
    struct Params {
        #[serde(rename = "requestId")]
        request_id: RequestId,
    }
    #[derive(serde::Deserialize)]
    struct Notification {
        params: Params,
    }
    let n: Notification = serde_json::from_slice(body).ok()?;
    Some(n.params.request_id)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn protocol_versions() {
        let headers = |values: &[&'static str]| {
            let mut h = http::HeaderMap::new();
            for v in values {
                h.append(PROTOCOL_VERSION_HEADER, HeaderValue::from_static(v));
            }
            h
        };
        assert_eq!(protocol_version(&headers(&[])), Ok(()));
        assert_eq!(protocol_version(&headers(&["2025-11-25"])), Ok(()));
        assert_eq!(protocol_version(&headers(&["2026-07-28"])), Ok(()));
        assert_eq!(
            protocol_version(&headers(&["2025-06-18"])),
            Err("2025-06-18".into())
        );
        assert!(protocol_version(&headers(&["2025-03-26"])).is_err());
        assert_eq!(protocol_version(&headers(&[""])), Err(String::new()));
        assert!(protocol_version(&headers(&["2025-11-25", "2025-11-25"])).is_err());
    }

    #[test]
    fn only_plain_2025_requests_are_answered_without_the_sdk() {
        let headers = |pairs: &[(&'static str, &'static str)]| {
            let mut h = http::HeaderMap::new();
            for (name, value) in pairs {
                h.append(*name, HeaderValue::from_static(value));
            }
            h
        };
        const VERSION: (&str, &str) = (PROTOCOL_VERSION_HEADER, "2025-11-25");
        const ACCEPT: (&str, &str) = ("accept", "application/json, text/event-stream");
        const JSON: (&str, &str) = ("content-type", "application/json");
        assert!(plain_2025_request(&headers(&[VERSION, ACCEPT, JSON])));
        assert!(plain_2025_request(&headers(&[
            VERSION,
            ("accept", "text/event-stream"),
            ("accept", "Application/JSON"),
            ("content-type", "application/json; charset=utf-8"),
        ])));
        for (case, h) in [
            ("no version", headers(&[ACCEPT, JSON])),
            (
                "2026-07-28",
                headers(&[(PROTOCOL_VERSION_HEADER, "2026-07-28"), ACCEPT, JSON]),
            ),
            ("two versions", headers(&[VERSION, VERSION, ACCEPT, JSON])),
            (
                "an origin",
                headers(&[VERSION, ACCEPT, JSON, ("origin", "http://127.0.0.1:1")]),
            ),
            (
                "json only",
                headers(&[VERSION, ("accept", "application/json"), JSON]),
            ),
            (
                "a weight",
                headers(&[
                    VERSION,
                    ("accept", "application/json;q=1, text/event-stream"),
                    JSON,
                ]),
            ),
            (
                "quotes",
                headers(&[
                    VERSION,
                    ("accept", "a/b;x=\"application/json\", text/event-stream"),
                    JSON,
                ]),
            ),
            ("no type", headers(&[VERSION, ACCEPT])),
            ("two types", headers(&[VERSION, ACCEPT, JSON, JSON])),
            (
                "text",
                headers(&[VERSION, ACCEPT, ("content-type", "text/plain")]),
            ),
        ] {
            assert!(!plain_2025_request(&h), "{case}");
        }
    }

    #[test]
    fn unsupported_versions_answer_with_the_id_and_both_lists() {
        let response = unsupported_version(Some(&serde_json::json!(42)), "1999-01-01");
        assert_eq!(response.status(), StatusCode::BAD_REQUEST);
        let body = futures_util::FutureExt::now_or_never(response.into_body().collect())
            .unwrap()
            .unwrap()
            .to_bytes();
        let v: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["id"], 42);
        assert_eq!(v["error"]["code"], -32022);
        assert_eq!(v["error"]["data"]["requested"], "1999-01-01");
        assert_eq!(
            v["error"]["data"]["supported"],
            serde_json::json!(["2025-11-25", "2026-07-28"])
        );
    }

    #[test]
    fn cancellation_bodies_are_recognised() {
        let body = br#"{"jsonrpc":"2.0","method":"notifications/cancelled","params":{"requestId":7,"reason":"x"}}"#;
        assert_eq!(cancelled_request_id(body), Some(RequestId::Number(7)));
        let body =
            br#"{"jsonrpc":"2.0","method":"notifications/cancelled","params":{"requestId":"a"}}"#;
        assert_eq!(
            cancelled_request_id(body),
            Some(RequestId::String("a".into()))
        );
    }
}
