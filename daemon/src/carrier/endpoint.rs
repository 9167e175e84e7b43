//! What an HTTP carrier does with an admitted request: the same for loopback and remote.
//!
//! Order: 405 for anything but POST, 400 for an unsupported `MCP-Protocol-Version`, 413
//! from `Content-Length` before reading, 503 + `Retry-After` when every in-flight slot is
//! taken, then the body is read (bounded; 413 past the limit, 408 past the body deadline). A
//! `notifications/cancelled` body cancels the same caller's in-flight request and is
//! answered 202 here; everything else goes to rmcp's stateless service.

use std::sync::Arc;

use bytes::Bytes;
use http::{HeaderValue, Method, StatusCode, header};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::{Request, Response};
use rmcp::model::RequestId;
use rmcp::transport::streamable_http_server::session::never::NeverSessionManager;
use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

use super::http::{self as server, Body};
use crate::config::HttpLimits;
use crate::mcp::{InFlight, McpServer, SUPPORTED_VERSIONS, is_supported_version};
use crate::session::{Caller, RuntimeTools, TurnSubmission};

const PROTOCOL_VERSION_HEADER: &str = "mcp-protocol-version";

/// The MCP endpoint behind admission.
pub struct Endpoint<S> {
    slots: Semaphore,
    body_limit: u64,
    body_timeout: std::time::Duration,
    inflight: Arc<InFlight>,
    service: StreamableHttpService<McpServer<S>, NeverSessionManager>,
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
        bounds: &HttpLimits,
        body_limit: u64,
        hosts: Vec<String>,
        origin: String,
        drained: &CancellationToken,
    ) -> Self {
        let config = StreamableHttpServerConfig::default()
            .with_legacy_session_mode(false)
            .with_json_response(true)
            .with_sse_keep_alive(None)
            .with_allowed_hosts(hosts)
            .with_allowed_origins([origin])
            .enforce_origin_validation()
            .with_max_request_body_bytes(usize::try_from(body_limit).unwrap_or(usize::MAX))
            .with_cancellation_token(drained.child_token());
        let inflight = server.inflight().clone();
        let service = StreamableHttpService::new(
            move || Ok(server.clone()),
            Arc::new(NeverSessionManager::default()),
            config,
        );
        Self {
            slots: Semaphore::new(bounds.max_in_flight),
            body_limit,
            body_timeout: bounds.body_timeout,
            inflight,
            service,
        }
    }

    /// Serve a request admitted as `caller`.
    pub async fn serve(&self, req: Request<Incoming>, caller: Caller) -> Response<Body> {
        let (mut parts, body) = req.into_parts();
        if parts.method != Method::POST {
            let mut response = server::empty(StatusCode::METHOD_NOT_ALLOWED);
            response
                .headers_mut()
                .insert(header::ALLOW, HeaderValue::from_static("POST"));
            return response;
        }
        if !protocol_version_ok(&parts.headers) {
            return unsupported_version();
        }
        let declared = parts
            .headers
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        if declared.is_some_and(|n| n > self.body_limit) {
            return closing(server::empty(StatusCode::PAYLOAD_TOO_LARGE), parts.version);
        }
        let Ok(_slot) = self.slots.try_acquire() else {
            let mut response = server::empty(StatusCode::SERVICE_UNAVAILABLE);
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
            return response;
        };
        let limit = usize::try_from(self.body_limit).unwrap_or(usize::MAX);
        // A client that never finishes its body gives up its slot at the deadline.
        let read = tokio::time::timeout(self.body_timeout, Limited::new(body, limit).collect());
        let bytes = match read.await {
            Ok(Ok(collected)) => collected.to_bytes(),
            Ok(Err(e)) if e.is::<http_body_util::LengthLimitError>() => {
                return closing(server::empty(StatusCode::PAYLOAD_TOO_LARGE), parts.version);
            }
            Ok(Err(_)) => return server::empty(StatusCode::BAD_REQUEST),
            Err(_) => return closing(server::empty(StatusCode::REQUEST_TIMEOUT), parts.version),
        };
        if let Some(id) = cancelled_request_id(&bytes) {
            self.inflight.cancel(&caller, &id);
            return server::empty(StatusCode::ACCEPTED);
        }
        parts.extensions.insert(caller);
        let response = self
            .service
            .handle(Request::from_parts(parts, Full::new(bytes)))
            .await;
        response.map(|b| b.boxed())
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

/// At most one `MCP-Protocol-Version`, and a supported one. Absent is allowed (a
/// 2025-11-25 `initialize` carries its version in the body).
fn protocol_version_ok(headers: &http::HeaderMap) -> bool {
    let mut values = headers.get_all(PROTOCOL_VERSION_HEADER).iter();
    match (values.next(), values.next()) {
        (None, _) => true,
        (Some(v), None) => v.to_str().is_ok_and(is_supported_version),
        (Some(_), Some(_)) => false,
    }
}

/// 400 with a JSON-RPC error in rmcp's shape (code -32022, as rmcp uses for an
/// unsupported protocol version); the request id is unknown because the body is unread.
fn unsupported_version() -> Response<Body> {
    let supported: Vec<&str> = SUPPORTED_VERSIONS.iter().map(|v| v.as_str()).collect();
    let error = rmcp::model::ErrorData::new(
        rmcp::model::ErrorCode(-32022),
        "Unsupported MCP-Protocol-Version",
        Some(serde_json::json!({"supported": supported})),
    );
    let body = serde_json::json!({"jsonrpc": "2.0", "id": null, "error": error});
    let mut response = Response::new(Full::new(Bytes::from(body.to_string())).boxed());
    *response.status_mut() = StatusCode::BAD_REQUEST;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    response
}

/// The `requestId` of a `notifications/cancelled` message, if the body is one.
fn cancelled_request_id(body: &[u8]) -> Option<RequestId> {
    const METHOD: &[u8] = b"notifications/cancelled";
    // Cheap pre-check so ordinary requests are not parsed twice.
    if !body.windows(METHOD.len()).any(|w| w == METHOD) {
        return None;
    }
    #[derive(serde::Deserialize)]
    struct Params {
        #[serde(rename = "requestId")]
        request_id: RequestId,
    }
    #[derive(serde::Deserialize)]
    struct Notification {
        method: String,
        params: Params,
        #[serde(default)]
        id: Option<serde_json::Value>,
    }
    let n: Notification = serde_json::from_slice(body).ok()?;
    (n.method == "notifications/cancelled" && n.id.is_none()).then_some(n.params.request_id)
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
        assert!(protocol_version_ok(&headers(&[])));
        assert!(protocol_version_ok(&headers(&["2025-11-25"])));
        assert!(protocol_version_ok(&headers(&["2026-07-28"])));
        assert!(!protocol_version_ok(&headers(&["2025-06-18"])));
        assert!(!protocol_version_ok(&headers(&["2025-03-26"])));
        assert!(!protocol_version_ok(&headers(&[
            "2025-11-25",
            "2025-11-25"
        ])));
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
        let call = br#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"x","arguments":{"p":"notifications/cancelled"}}}"#;
        assert_eq!(cancelled_request_id(call), None);
        assert_eq!(cancelled_request_id(b"notifications/cancelled"), None);
    }
}
