//! The loopback Streamable HTTP carrier (SPEC §4): 127.0.0.1 only, Host/Origin checks,
//! a daemon-minted bearer, stateless rmcp behind it.
//!
//! Invariant: admission never reads the body. Only after a request is admitted, is a
//! POST, names a supported protocol version, declares an acceptable length and gets an
//! in-flight slot, is its body read (bounded) and handed to rmcp. A
//! `notifications/cancelled` body is answered here: it cancels the same caller's
//! in-flight request with that id and nothing else.

pub mod admission;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::SystemTime;

use bytes::Bytes;
use http::{HeaderValue, Method, StatusCode, header};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::{Request, Response};
use parking_lot::Mutex;
use rmcp::model::RequestId;
use rmcp::transport::streamable_http_server::session::never::NeverSessionManager;
use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

use self::admission::{Expected, Refusal};
use super::http::{self as server, Body, Bounds};
use crate::audit::{AddressClass, Audit, Carrier as CarrierName, Record};
use crate::bearer::BearerStore;
use crate::config::{Limits, LoopbackConfig, WireNameProfile};
use crate::mcp::{InFlight, McpServer, is_supported_version};
use crate::metrics::Metrics;
use crate::session::{Caller, RuntimeTools, TurnSubmission};
use crate::transport::Carrier;

const PROTOCOL_VERSION_HEADER: &str = "mcp-protocol-version";

/// The loopback carrier. Each bind mints a fresh bearer store: a restart (fresh attach)
/// invalidates every bearer.
pub struct LoopbackCarrier {
    config: LoopbackConfig,
    limits: Limits,
    audit: Arc<Audit>,
    metrics: Metrics,
    bearers: Mutex<Arc<BearerStore>>,
}

impl LoopbackCarrier {
    pub fn new(
        config: LoopbackConfig,
        limits: Limits,
        audit: Arc<Audit>,
        metrics: Metrics,
    ) -> Self {
        Self {
            config,
            limits,
            audit,
            metrics,
            bearers: Mutex::new(Arc::new(BearerStore::new())),
        }
    }

    /// The bearers of the current attach.
    pub fn bearers(&self) -> Arc<BearerStore> {
        self.bearers.lock().clone()
    }
}

impl Carrier for LoopbackCarrier {
    type Bound = TcpListener;

    fn wire_names(&self) -> (WireNameProfile, BTreeMap<String, String>) {
        (self.config.wire_names, self.config.aliases.clone())
    }

    async fn bind(&self) -> std::io::Result<TcpListener> {
        if !self.config.listen.ip().is_loopback() || !self.config.listen.is_ipv4() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!(
                    "the loopback carrier binds 127.0.0.1 only, not {}",
                    self.config.listen
                ),
            ));
        }
        let listener = TcpListener::bind(self.config.listen).await?;
        *self.bearers.lock() = Arc::new(BearerStore::new());
        Ok(listener)
    }

    fn address(bound: &TcpListener) -> String {
        bound
            .local_addr()
            .map_or_else(|_| "unknown".into(), |a| a.to_string())
    }

    async fn serve<S: RuntimeTools + TurnSubmission>(
        self: Arc<Self>,
        listener: TcpListener,
        server: McpServer<S>,
        shutdown: CancellationToken,
    ) {
        let port = listener.local_addr().map(|a| a.port()).unwrap_or(0);
        let bounds = Bounds {
            max_connections: self.config.max_connections,
            header_timeout: self.config.header_timeout,
            max_header_bytes: self.config.max_header_bytes,
            max_streams: u32::try_from(self.config.max_in_flight).unwrap_or(u32::MAX),
        };
        let authority = format!("127.0.0.1:{port}");
        let rmcp_config = StreamableHttpServerConfig::default()
            .with_legacy_session_mode(false)
            .with_json_response(true)
            .with_sse_keep_alive(None)
            .with_allowed_hosts([authority.clone()])
            .with_allowed_origins([format!("http://{authority}")])
            .enforce_origin_validation()
            .with_max_request_body_bytes(
                usize::try_from(self.limits.request_body).unwrap_or(usize::MAX),
            )
            .with_cancellation_token(shutdown.child_token());
        let inflight = server.inflight().clone();
        let service = StreamableHttpService::new(
            move || Ok(server.clone()),
            Arc::new(NeverSessionManager::default()),
            rmcp_config,
        );
        let handler = Loopback {
            shared: Arc::new(Shared {
                expected: Expected::new(&self.config.path, port),
                bearers: self.bearers(),
                slots: Semaphore::new(self.config.max_in_flight),
                body_limit: self.limits.request_body,
                audit: self.audit.clone(),
                metrics: self.metrics.clone(),
                inflight,
                service,
            }),
        };
        server::serve(listener, bounds, handler, shutdown).await;
    }
}

struct Shared<S> {
    expected: Expected,
    bearers: Arc<BearerStore>,
    slots: Semaphore,
    body_limit: u64,
    audit: Arc<Audit>,
    metrics: Metrics,
    inflight: Arc<InFlight>,
    service: StreamableHttpService<McpServer<S>, NeverSessionManager>,
}

struct Loopback<S> {
    shared: Arc<Shared<S>>,
}

impl<S> Clone for Loopback<S> {
    fn clone(&self) -> Self {
        Self {
            shared: self.shared.clone(),
        }
    }
}

impl<S: RuntimeTools + TurnSubmission> server::Handler for Loopback<S> {
    async fn handle(&self, req: Request<Incoming>, peer: SocketAddr) -> Response<Body> {
        let s = &self.shared;
        let (mut parts, body) = req.into_parts();
        let now = SystemTime::now();
        let admitted = admission::admit(&parts.uri, &parts.headers, &s.expected, |token| {
            s.bearers.check(token, now)
        });
        let label = match admitted {
            Ok(label) => label,
            Err(refusal) => return self.refuse(refusal, peer, parts.version, now),
        };
        s.metrics.admitted(CarrierName::Loopback);

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
        if declared.is_some_and(|n| n > s.body_limit) {
            return closing(server::empty(StatusCode::PAYLOAD_TOO_LARGE), parts.version);
        }
        let Ok(_slot) = s.slots.try_acquire() else {
            let mut response = server::empty(StatusCode::SERVICE_UNAVAILABLE);
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
            return response;
        };
        let limit = usize::try_from(s.body_limit).unwrap_or(usize::MAX);
        let bytes = match Limited::new(body, limit).collect().await {
            Ok(collected) => collected.to_bytes(),
            Err(e) if e.is::<http_body_util::LengthLimitError>() => {
                return closing(server::empty(StatusCode::PAYLOAD_TOO_LARGE), parts.version);
            }
            Err(_) => return server::empty(StatusCode::BAD_REQUEST),
        };
        let caller = Caller::Bearer(label);
        if let Some(id) = cancelled_request_id(&bytes) {
            s.inflight.cancel(&caller, &id);
            return server::empty(StatusCode::ACCEPTED);
        }
        parts.extensions.insert(caller);
        let response = s
            .service
            .handle(Request::from_parts(parts, Full::new(bytes)))
            .await;
        response.map(|b| b.boxed())
    }
}

impl<S> Loopback<S> {
    fn refuse(
        &self,
        refusal: Refusal,
        peer: SocketAddr,
        version: http::Version,
        now: SystemTime,
    ) -> Response<Body> {
        let s = &self.shared;
        s.metrics.refused(CarrierName::Loopback, refusal.0);
        s.audit.record(Record {
            time: now,
            carrier: CarrierName::Loopback,
            reason: refusal.0,
            throttled: false,
            address_class: AddressClass::of(peer.ip()),
        });
        let mut response = server::empty(refusal.status());
        if let Some(challenge) = refusal.challenge() {
            response.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                HeaderValue::from_static(challenge),
            );
        }
        closing(response, version)
    }
}

/// On HTTP/1, close after a response sent without reading the request body.
fn closing(mut response: Response<Body>, version: http::Version) -> Response<Body> {
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
    let supported: Vec<&str> = crate::mcp::SUPPORTED_VERSIONS
        .iter()
        .map(|v| v.as_str())
        .collect();
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
