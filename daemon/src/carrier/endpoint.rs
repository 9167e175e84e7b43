//! What an HTTP carrier does with an admitted request: the same for loopback and remote.
//!
//! Order: 405 for anything but POST, 413 from `Content-Length` before reading, 503 +
//! `Retry-After` when every in-flight slot is taken or the caller holds its share of them
//! ([`Slots`]), then the body is read under the
//! carrier's memory budget (413 past the size limit, 408 past the body deadline, 503 when
//! the budget stays taken), then looked at strictly ([`crate::jsonrpc`]: 400 with a
//! JSON-RPC error for a parse error, a batch, a bad id or params), then 400 for an
//! unsupported `MCP-Protocol-Version` (with the request's id). Then the Streamable HTTP
//! rules ([`super::streamable`]: media types first, before the body is read); a
//! `notifications/cancelled` cancels the same caller's in-flight request and is answered
//! 202 here; a carrier's gate may answer a call itself (the remote carrier's 403 for a
//! tool that needs scopes the token lacks, before anything runs); every request is then
//! answered by rmcp's dispatch in this task ([`super::streamable::answer`]) — one path for
//! every method. Host and Origin are the carrier's admission's (before this). Every error
//! answer is counted by reason.
//!
//! The memory budget (`[limits] request_memory`, per carrier): a request holds budget
//! for twice its body (ours and the SDK's copy) while it is read, then for
//! [`crate::jsonrpc::VALUE_COST`] per JSON value before it is parsed, until its answer
//! has left (the answer's body keeps it: [`super::streamable::answer`]). A caller not
//! allowed every slot holds at most half of the budget ([`Slots`]). A body whose cost
//! alone would exceed the budget, or its caller's share, is refused 413. A request
//! waits for budget only while it holds none (for a declared body length, before its
//! first byte); any further share must be free at once, or it gives back what it holds
//! and is answered 503 — so no set of requests can hold the budget while waiting on each
//! other. A flood of bodies built to amplify (`[[],[],…]`) costs about the budget,
//! whatever the limits.

use std::collections::HashMap;
use std::hash::BuildHasher;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::{HeaderValue, Method, StatusCode, header};
use http_body_util::{BodyExt, Full};
use hyper::{Request, Response};
use rmcp::ServerHandler;
use rmcp::model::RequestId;
use serde_json::Value;
use tokio::time::Instant;

use super::http::{self as server, Body};
use super::streamable::{self, Checked};
use crate::budget::{Budget, Share, units};
use crate::config::{HttpLimits, Limits};
use crate::jsonrpc::{self, Invalid};
use crate::mcp::{InFlight, McpServer, SUPPORTED_VERSIONS, is_supported_version};
use crate::metrics::Metrics;
use crate::params::PROTOCOL_VERSION;
use crate::session::{RuntimeTools, TurnSubmission};
use crate::vocab::{Admitted, Caller};
use crate::vocab::{CancelOutcome, Listener, Rejection};

/// A carrier's look at a call before it reaches the session: given the canonical tool it
/// would run (`tools/call`; `job.status` / `job.cancel` for `tasks/get` /
/// `tasks/cancel`) and the caller, `None` lets it go on, `Some` is the answer instead.
pub type Gate<'a> = &'a (dyn Fn(&str, &Admitted) -> Option<Response<Body>> + Sync);

/// The MCP endpoint behind admission.
pub struct Endpoint<S> {
    listener: Listener,
    metrics: Metrics,
    slots: Arc<Slots>,
    memory: Budget,
    body_limit: u64,
    body_timeout: Duration,
    inflight: Arc<InFlight>,
    server: McpServer<S>,
    /// The peer every request's context names.
    peer: streamable::Peer,
}

/// Who the endpoint answers for (the `listener` label of its metrics).
pub struct Site {
    pub listener: Listener,
    pub metrics: Metrics,
}

impl<S: RuntimeTools + TurnSubmission> Endpoint<S> {
    /// Needs a Tokio runtime.
    pub fn new(server: McpServer<S>, site: Site, bounds: &HttpLimits, limits: &Limits) -> Self {
        let memory = Budget::new(limits.request_memory);
        Self {
            listener: site.listener,
            metrics: site.metrics,
            slots: Arc::new(Slots::new(bounds, &memory, limits.request_body)),
            memory,
            body_limit: limits.request_body,
            body_timeout: bounds.body_timeout,
            inflight: server.inflight().clone(),
            server,
            peer: streamable::Peer::start(),
        }
    }

    fn reject(&self, why: Rejection, response: Response<Body>) -> Response<Body> {
        self.metrics.rejected(self.listener, why);
        response
    }

    /// [`Self::reject`] with the answer a limit or an unreadable body gets ([`refused`]).
    fn refuse(&self, why: Rejection, version: http::Version) -> Response<Body> {
        self.reject(why, refused(why, version))
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
        if let Some(response) = streamable::media_types(&parts.headers) {
            return self.reject(Rejection::Protocol, response);
        }
        let declared = parts
            .headers
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        if declared.is_some_and(|n| n > self.body_limit) {
            return self.refuse(Rejection::BodyTooLarge, parts.version);
        }
        let mut slot = match self.slots.take(&caller.caller) {
            Ok(slot) => slot,
            Err(why) => return self.refuse(why, parts.version),
        };
        // A client that never finishes its body gives up its slot at the deadline.
        let deadline = Instant::now() + self.body_timeout;
        let (bytes, mut held) = match self.read(body, declared, deadline, &mut slot).await {
            Ok(read) => read,
            Err(why) => return self.refuse(why, parts.version),
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
                    streamable::json(
                        StatusCode::BAD_REQUEST,
                        invalid.response().to_string().into(),
                    ),
                );
            }
        };
        // The parse to come: its values, beyond the bytes already held for.
        let parse = units(message.cost.saturating_sub(bytes.len()));
        if held.num_permits() + parse > self.memory.units() {
            return self.refuse(Rejection::BodyTooLarge, parts.version);
        }
        if let Err(why) = slot.reserve(parse) {
            drop(held);
            return self.refuse(why, parts.version);
        }
        // Never wait for more while holding some: a request that cannot have its whole
        // share at once gives back what it holds (503), so holders cannot block each other.
        match self.memory.try_take(parse) {
            Some(more) => held.merge(more),
            None => {
                drop(held);
                return self.refuse(Rejection::MemoryBusy, parts.version);
            }
        }
        if let Err(refused) = protocol_version(&parts.headers) {
            return self.reject(
                Rejection::UnsupportedVersion,
                unsupported_version(message.id.as_ref(), &refused),
            );
        }
        let parsed =
            crate::mcp::read_message(message.method.as_deref(), message.id.is_some(), &bytes);
        let parsed = match parsed {
            Ok(parsed) => parsed,
            Err(e) => {
                let mut response = server::empty(StatusCode::UNSUPPORTED_MEDIA_TYPE);
                *response.body_mut() =
                    Full::new(Bytes::from(format!("fail to deserialize request body {e}"))).boxed();
                return self.reject(Rejection::Protocol, response);
            }
        };
        let checked = streamable::check(&parts.headers, parsed, &bytes, |name| {
            self.server.get_tool(name).map(|tool| tool.input_schema)
        });
        let (request, negotiated, malformed) = match checked {
            Err(response) => return self.reject(Rejection::Protocol, *response),
            Ok(Checked::Notification) => {
                if message.method.as_deref() == Some("notifications/cancelled") {
                    let matched = cancelled_request_id(&bytes)
                        .is_some_and(|id| self.inflight.cancel(&caller.caller, &id));
                    self.metrics.cancellation(if matched {
                        CancelOutcome::Matched
                    } else {
                        CancelOutcome::Unmatched
                    });
                }
                return server::empty(StatusCode::ACCEPTED);
            }
            Ok(Checked::Request {
                request,
                negotiated,
                malformed,
            }) => (request, negotiated, malformed),
        };
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
        parts.extensions.insert(caller);
        // The in-flight slot and the memory share are held until the answer is whole: a
        // call's event stream keeps them.
        let response = streamable::answer(
            &self.server,
            &self.peer,
            parts,
            *request,
            (negotiated, malformed),
            (slot, held),
        )
        .await;
        if response.status().is_client_error() {
            self.metrics.rejected(self.listener, Rejection::Protocol);
        }
        response
    }

    /// Read the body, holding budget for twice what has arrived: for a declared length,
    /// all of it before the first byte (waiting for it, holding nothing); for a body of
    /// unknown length, in steps that must be free at once.
    async fn read<B: hyper::body::Body<Data = Bytes>>(
        &self,
        body: B,
        declared: Option<u64>,
        deadline: Instant,
        slot: &mut Slot,
    ) -> Result<(Bytes, Share), Rejection> {
        let limit = usize::try_from(self.body_limit).unwrap_or(usize::MAX);
        let initial = declared.map_or(0, |n| usize::try_from(n).unwrap_or(limit).min(limit));
        slot.reserve(units(2 * initial))?;
        let mut held = self
            .memory
            .take_until(units(2 * initial), deadline)
            .await
            .ok_or(Rejection::MemoryBusy)?;
        let mut collected = BytesMut::with_capacity(initial);
        let mut body = std::pin::pin!(body);
        loop {
            let frame = tokio::time::timeout_at(deadline, body.frame())
                .await
                .map_err(|_| Rejection::BodyTimeout)?;
            let Some(frame) = frame else { break };
            let frame = frame.map_err(|_| Rejection::BodyError)?;
            let Ok(data) = frame.into_data() else {
                continue;
            };
            if data.len() > limit - collected.len() {
                return Err(Rejection::BodyTooLarge);
            }
            let needed = units(2 * (collected.len() + data.len()));
            if needed > held.num_permits() {
                // Grow in steps of 64 KiB so a trickle of small frames is not a lock each.
                let step = needed
                    .saturating_sub(held.num_permits())
                    .max(64)
                    .min((self.memory.units()).saturating_sub(held.num_permits()));
                slot.reserve(step)?;
                let more = self.memory.try_take(step).ok_or(Rejection::MemoryBusy)?;
                held.merge(more);
            }
            collected.extend_from_slice(&data);
        }
        Ok((collected.freeze(), held))
    }
}

/// A carrier's in-flight slots: a request holds one of `limit` until it is answered, and
/// no caller holds more than `per_caller` of them, nor more than `memory` units of the
/// carrier's request memory — a caller keeping every slot and every byte it can get busy
/// (bodies sent slowly, big calls that never end) leaves the rest to the others.
struct Slots {
    limit: usize,
    per_caller: usize,
    memory: usize,
    /// Callers are counted by a keyed hash of who they are: nothing of theirs is kept, and
    /// nothing allocated per request; two callers would share a count only by a 64-bit
    /// collision of a key nobody outside knows.
    keys: std::hash::RandomState,
    taken: Mutex<Taken>,
}

#[derive(Default)]
struct Taken {
    total: usize,
    callers: HashMap<u64, Held>,
}

/// What one caller holds: slots, and memory units.
#[derive(Default)]
struct Held {
    slots: usize,
    units: usize,
}

/// One slot of [`Slots`], and the memory units reserved with it; given back when dropped.
struct Slot {
    slots: Arc<Slots>,
    key: u64,
    units: usize,
}

impl Slots {
    /// The slots of a carrier with `bounds`, whose requests share `memory` (of which a
    /// caller not allowed every slot may hold half, and at least twice `request_body`,
    /// enough for a whole body as it is read).
    fn new(bounds: &HttpLimits, memory: &Budget, request_body: u64) -> Self {
        let all = memory.units();
        let per_caller_memory = if bounds.max_in_flight_per_caller >= bounds.max_in_flight {
            all
        } else {
            let body = usize::try_from(request_body).unwrap_or(usize::MAX / 2);
            (all / 2).max(units(2 * body)).min(all)
        };
        Self {
            limit: bounds.max_in_flight,
            per_caller: bounds.max_in_flight_per_caller,
            memory: per_caller_memory,
            keys: std::hash::RandomState::new(),
            taken: Mutex::default(),
        }
    }

    /// A slot for `caller`, or why not: [`Rejection::Busy`] when all are taken,
    /// [`Rejection::CallerBusy`] when the caller holds its share.
    fn take(self: &Arc<Self>, caller: &Caller) -> Result<Slot, Rejection> {
        let key = self.keys.hash_one(caller);
        let mut taken = self.taken.lock().unwrap_or_else(PoisonError::into_inner);
        if taken.total >= self.limit {
            return Err(Rejection::Busy);
        }
        let held = taken.callers.entry(key).or_default();
        if held.slots >= self.per_caller {
            return Err(Rejection::CallerBusy);
        }
        held.slots += 1;
        taken.total += 1;
        Ok(Slot {
            slots: self.clone(),
            key,
            units: 0,
        })
    }
}

impl Slot {
    /// `units` more of the carrier's request memory for this request, as its caller's
    /// share allows: [`Rejection::BodyTooLarge`] when this request alone would pass the
    /// share, [`Rejection::CallerBusy`] when the caller's other requests hold the rest.
    fn reserve(&mut self, units: usize) -> Result<(), Rejection> {
        let share = self.slots.memory;
        if self.units.saturating_add(units) > share {
            return Err(Rejection::BodyTooLarge);
        }
        let mut taken = self
            .slots
            .taken
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let held = taken.callers.entry(self.key).or_default();
        if held.units.saturating_add(units) > share {
            return Err(Rejection::CallerBusy);
        }
        held.units += units;
        self.units += units;
        Ok(())
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut taken = self
            .slots
            .taken
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        taken.total -= 1;
        if let Some(held) = taken.callers.get_mut(&self.key) {
            held.slots -= 1;
            held.units -= self.units;
            if held.slots == 0 {
                taken.callers.remove(&self.key);
            }
        }
    }
}

/// The answer to a request refused by a limit or a body that could not be read:
/// `BodyError` 400, `BodyTimeout` 408, `Busy`, `MemoryBusy` and `CallerBusy` 503 each
/// naming its limit, anything else (`BodyTooLarge`) 413. On HTTP/1 the connection is closed
/// after it (the body may be unread), except after a broken body.
fn refused(why: Rejection, version: http::Version) -> Response<Body> {
    let response = match why {
        Rejection::BodyError => return server::empty(StatusCode::BAD_REQUEST),
        Rejection::BodyTimeout => server::empty(StatusCode::REQUEST_TIMEOUT),
        Rejection::Busy => unavailable(BUSY),
        Rejection::MemoryBusy => unavailable(MEMORY_BUSY),
        Rejection::CallerBusy => unavailable(CALLER_BUSY),
        _ => server::empty(StatusCode::PAYLOAD_TOO_LARGE),
    };
    closing(response, version)
}

/// Why a request is answered 503, as its text says it.
const BUSY: &str = "Service Unavailable: every in-flight slot of this carrier is taken (max_in_flight); retry when one of the requests in flight is answered";
const MEMORY_BUSY: &str = "Service Unavailable: the memory this carrier's requests may hold (request_memory) is in use; retry when one of the requests in flight is answered";
const CALLER_BUSY: &str = "Service Unavailable: this caller already has its share of the carrier's requests in flight (max_in_flight_per_caller) or of their memory (half of request_memory); retry when one of them is answered";

/// 503 with `Retry-After: 1` and `why`.
fn unavailable(why: &'static str) -> Response<Body> {
    let mut response = streamable::text(StatusCode::SERVICE_UNAVAILABLE, why);
    response
        .headers_mut()
        .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    response
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

/// Why a request's `MCP-Protocol-Version` is refused: the (first) text it named, and
/// whether it named one more than once.
#[derive(Debug, PartialEq)]
struct VersionRefused {
    requested: String,
    repeated: bool,
}

/// At most one `MCP-Protocol-Version`, and a supported one.
/// Absent is allowed (a 2025-11-25 `initialize` carries its version in the body).
fn protocol_version(headers: &http::HeaderMap) -> Result<(), VersionRefused> {
    let mut values = headers.get_all(&PROTOCOL_VERSION).iter();
    let refused = |v: &HeaderValue, repeated| {
        let text = String::from_utf8_lossy(v.as_bytes());
        VersionRefused {
            requested: text.chars().take(64).collect(),
            repeated,
        }
    };
    match (values.next(), values.next()) {
        (None, _) => Ok(()),
        (Some(v), None) if v.to_str().is_ok_and(is_supported_version) => Ok(()),
        (Some(v), None) => Err(refused(v, false)),
        (Some(v), Some(_)) => Err(refused(v, true)),
    }
}

/// 400 with the JSON-RPC error rmcp uses for an unsupported protocol version (-32022),
/// naming what was requested and what is supported, for the request's id.
fn unsupported_version(id: Option<&Value>, refused: &VersionRefused) -> Response<Body> {
    let message = if refused.repeated {
        "Unsupported protocol version: the MCP-Protocol-Version header is sent more than once"
    } else {
        "Unsupported protocol version"
    };
    let error = rmcp::model::ErrorData::new(
        rmcp::model::ErrorCode::UNSUPPORTED_PROTOCOL_VERSION,
        message,
        Some(serde_json::json!({"requested": refused.requested, "supported": SUPPORTED_VERSIONS})),
    );
    let body = serde_json::json!({"jsonrpc": "2.0", "id": id, "error": error});
    streamable::json(StatusCode::BAD_REQUEST, body.to_string().into())
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

    fn slots(limit: usize, per_caller: usize, memory: u64, request_body: u64) -> Arc<Slots> {
        let bounds = HttpLimits {
            max_connections: 64,
            max_connections_per_address: None,
            max_in_flight: limit,
            max_in_flight_per_caller: per_caller,
            max_header_bytes: 16 * 1024,
            header_timeout: Duration::from_secs(5),
            body_timeout: Duration::from_secs(5),
            idle_timeout: Duration::from_secs(5),
        };
        Arc::new(Slots::new(&bounds, &Budget::new(memory), request_body))
    }

    #[test]
    fn a_caller_holds_at_most_half_the_memory_and_never_more_than_its_requests_reserved() {
        const MIB: u64 = 1024 * 1024;
        let slots = slots(8, 4, 128 * MIB, MIB);
        assert_eq!(slots.memory, units(64 * 1024 * 1024));
        let a = Caller::Bearer("a".into());
        let b = Caller::Bearer("b".into());
        let mut a1 = slots.take(&a).unwrap();
        let mut a2 = slots.take(&a).unwrap();
        assert_eq!(a1.reserve(slots.memory + 1), Err(Rejection::BodyTooLarge));
        a1.reserve(slots.memory - 10).unwrap();
        assert_eq!(a2.reserve(11), Err(Rejection::CallerBusy));
        a2.reserve(10).unwrap();
        // Another caller has its own half.
        let mut b1 = slots.take(&b).unwrap();
        b1.reserve(slots.memory).unwrap();
        drop(a1);
        a2.reserve(slots.memory - 10).unwrap();
        drop((a2, b1));
        assert!(slots.taken.lock().unwrap().callers.is_empty());
        // Every slot to one caller: every byte too; never less than two bodies.
        assert_eq!(slots_memory(8, 8, 128 * MIB, MIB), units(128 * 1024 * 1024));
        assert_eq!(
            slots_memory(8, 4, 4 * MIB, 3 * MIB / 2),
            units(3 * 1024 * 1024)
        );
        assert_eq!(slots_memory(8, 4, 2 * MIB, MIB), units(2 * 1024 * 1024));
    }

    fn slots_memory(limit: usize, per_caller: usize, memory: u64, body: u64) -> usize {
        slots(limit, per_caller, memory, body).memory
    }

    #[test]
    fn a_caller_holds_at_most_its_share_of_the_slots_and_the_rest_stay_free() {
        let slots = slots(4, 2, 1 << 20, 1 << 10);
        let a = Caller::Bearer("a".into());
        let b = Caller::Bearer("b".into());
        let c = Caller::Bearer("c".into());
        let a1 = slots.take(&a).unwrap();
        let a2 = slots.take(&a).unwrap();
        assert_eq!(slots.take(&a).err(), Some(Rejection::CallerBusy));
        let b1 = slots.take(&b).unwrap();
        let _b2 = slots.take(&b).unwrap();
        // Every slot taken: anyone is refused, and as busy, not as over their share.
        assert_eq!(slots.take(&c).err(), Some(Rejection::Busy));
        drop(a1);
        assert_eq!(slots.take(&b).err(), Some(Rejection::CallerBusy));
        let c1 = slots.take(&c).unwrap();
        drop((a2, b1, c1));
        // Given back: a caller that held its share may take it again.
        let _a = (slots.take(&a).unwrap(), slots.take(&a).unwrap());
        let taken = slots.taken.lock().unwrap();
        assert_eq!(taken.total, 3);
        assert_eq!(
            taken.callers.len(),
            2,
            "a caller holding nothing is not kept"
        );
    }

    #[test]
    fn protocol_versions() {
        let headers = |values: &[&'static str]| {
            let mut h = http::HeaderMap::new();
            for v in values {
                h.append(PROTOCOL_VERSION, HeaderValue::from_static(v));
            }
            h
        };
        let refused = |requested: &str, repeated| {
            Err(VersionRefused {
                requested: requested.into(),
                repeated,
            })
        };
        assert_eq!(protocol_version(&headers(&[])), Ok(()));
        assert_eq!(protocol_version(&headers(&["2025-11-25"])), Ok(()));
        assert_eq!(protocol_version(&headers(&["2026-07-28"])), Ok(()));
        assert_eq!(
            protocol_version(&headers(&["2025-06-18"])),
            refused("2025-06-18", false)
        );
        assert!(protocol_version(&headers(&["2025-03-26"])).is_err());
        assert_eq!(protocol_version(&headers(&[""])), refused("", false));
        assert_eq!(
            protocol_version(&headers(&["2025-11-25", "2025-11-25"])),
            refused("2025-11-25", true)
        );
    }

    #[test]
    fn unsupported_versions_answer_with_the_id_and_both_lists() {
        let refused = VersionRefused {
            requested: "1999-01-01".into(),
            repeated: false,
        };
        let response = unsupported_version(Some(&serde_json::json!(42)), &refused);
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
