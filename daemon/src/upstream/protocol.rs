//! The client side of MCP toward a downstream server, whatever carries it: the two
//! revisions (`server/discover` with per-request `_meta` for 2026-07-28, `initialize` for
//! 2025-11-25), JSON-RPC framing, the handshake, the paged tool listing, and how an
//! upstream's answers are classified. Results stay JSON values: nothing here parses them
//! into types that would drop what we do not know.

use std::future::Future;
use std::pin::Pin;
use std::sync::LazyLock;
use std::time::Duration;

use rmcp::model::{ClientCapabilities, Implementation, ProtocolVersion, RequestMetaObject};
use serde_json::{Map, Value, json};
use tokio_util::sync::CancellationToken;

use crate::budget::{self, Budget, Share};
use crate::catalog::{Progress, ProgressUpdate};
use crate::config::UpstreamProtocol;
use crate::jsonrpc;

/// The revision served by `server/discover` and per-request metadata.
pub const MODERN: &str = "2026-07-28";
/// The revision of the `initialize` handshake we offer.
pub const LEGACY: &str = "2025-11-25";
/// How long `auto` waits for an answer to `server/discover` before it tries `initialize`.
const DISCOVER_WAIT: Duration = Duration::from_secs(5);
/// Pages of `tools/list` followed, and tool definitions read, at most.
const MAX_PAGES: usize = 64;
pub const MAX_LISTED: usize = 4096;

/// The revision agreed with one upstream connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Negotiated {
    /// The protocol version in force (`MCP-Protocol-Version`): one of the revisions the
    /// daemon knows, never the upstream's own text.
    pub version: &'static str,
}

impl Negotiated {
    pub fn modern() -> Self {
        Self { version: MODERN }
    }

    /// 2026-07-28 or later: no session, every request carries its own `_meta`.
    pub fn is_modern(&self) -> bool {
        self.version >= MODERN
    }

    /// `params` as sent: with the per-request `_meta` of the modern revision.
    pub fn params(&self, mut params: Map<String, Value>) -> Map<String, Value> {
        if self.is_modern() {
            let meta = params
                .entry("_meta")
                .or_insert_with(|| Value::Object(Map::new()));
            if let Value::Object(meta) = meta {
                meta.extend(MODERN_CONTEXT.iter().map(|(k, v)| (k.clone(), v.clone())));
            }
        }
        params
    }
}

/// The per-request `_meta` members of the modern revision (protocol version, client info
/// and capabilities): the same for every request, so made once.
static MODERN_CONTEXT: LazyLock<Map<String, Value>> = LazyLock::new(|| {
    let context = RequestMetaObject::with_client_context(
        ProtocolVersion::V_2026_07_28,
        client_info(),
        ClientCapabilities::default(),
    );
    match serde_json::to_value(context) {
        Ok(Value::Object(context)) => context,
        _ => Map::new(),
    }
});

pub fn client_info() -> Implementation {
    Implementation::new("robota-mcpd", env!("CARGO_PKG_VERSION"))
}

/// Why a request to an upstream did not bring back a result.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CallError {
    /// Nothing reached the upstream: the call had no effect.
    #[error("{0}")]
    NotSent(String),
    /// Sent, then the link broke before the answer: the effect is unknown.
    #[error("{0}")]
    Lost(String),
    /// The answer is over the response limit.
    #[error("{0}")]
    TooLarge(String),
    /// The upstream answered with a JSON-RPC error.
    #[error("JSON-RPC error {code}: {message}")]
    Rpc { code: i64, message: String },
    /// No answer within the call's time limit (the upstream was told to cancel).
    #[error("no answer within {}", humantime::format_duration(*.0))]
    Timeout(Duration),
    /// The caller cancelled (the upstream was told to cancel).
    #[error("cancelled")]
    Cancelled,
    /// Too many calls in flight toward this upstream.
    #[error("{0}")]
    Busy(String),
}

impl CallError {
    /// A description for the operator (status, log), never shown to a caller as is.
    pub fn describe(&self) -> String {
        self.to_string()
    }

    /// Whether the link to the upstream failed — the operator's business too — rather
    /// than the upstream answering, the caller cancelling or the daemon's own bound.
    pub fn link_failed(&self) -> bool {
        match self {
            Self::NotSent(_) | Self::Lost(_) | Self::TooLarge(_) | Self::Timeout(_) => true,
            Self::Rpc { .. } | Self::Cancelled | Self::Busy(_) => false,
        }
    }
}

/// A result an upstream sent, with the share of the upstreams' memory budget its parse
/// took: held for as long as the result is in hand.
#[derive(Debug)]
pub struct Answer {
    pub result: Map<String, Value>,
    pub held: Option<Share>,
}

/// Why a message from an upstream was not parsed.
#[derive(Debug)]
pub enum Unread {
    /// Not JSON (or trailing data, or a duplicate key).
    NotJson(String),
    /// Its parse would take more of the upstreams' memory budget than is free now.
    Unaffordable(String),
}

/// Parses one message an upstream sent, under `budget`: what its parse may take (its
/// bytes and [`jsonrpc::VALUE_COST`] per JSON value, counted by the strict pass, which
/// keeps only the keys of the objects it is inside) is taken from the budget first, so a
/// message the budget cannot hold now is never parsed — a few megabytes of `[[],[],…]`
/// would otherwise take gigabytes.
pub fn parse(bytes: &[u8], budget: &Budget) -> Result<(Value, Share), Unread> {
    let not_json = |why: &str| Unread::NotJson(unquoted(why));
    let cost = jsonrpc::parse_cost(bytes).map_err(|e| not_json(&e))?;
    let need = budget::units(cost);
    let Some(held) = budget.try_take(need) else {
        let whole = budget.units();
        return Err(Unread::Unaffordable(if need > whole {
            format!(
                "reading it ({} bytes) would take about {} KiB of memory, more than the {whole} KiB all upstreams share ([limits] upstream_memory)",
                bytes.len(),
                need
            )
        } else {
            format!(
                "reading it ({} bytes) would take about {need} KiB of memory, and the {whole} KiB all upstreams share ([limits] upstream_memory) are held by other answers and tool lists now",
                bytes.len()
            )
        }));
    };
    let value = serde_json::from_slice(bytes).map_err(|e| not_json(&e.to_string()))?;
    Ok((value, held))
}

/// A parser's complaint about an upstream's message without the message's own words:
/// what it quotes (a duplicate key, a string) becomes `"…"`, so the upstream cannot
/// write into the daemon's log, status or callers' errors through it — not even a
/// credential it was sent. What remains is the parser's: the kind of fault and where.
fn unquoted(why: &str) -> String {
    let mut out = String::with_capacity(why.len());
    let mut chars = why.chars();
    while let Some(c) = chars.next() {
        if c != '"' {
            out.push(c);
            continue;
        }
        out.push_str("\"…\"");
        while let Some(c) = chars.next() {
            match c {
                '\\' => {
                    chars.next();
                }
                '"' => break,
                _ => {}
            }
        }
    }
    out
}

pub type RpcFuture<'a, T> = Pin<Box<dyn Future<Output = Result<T, CallError>> + Send + 'a>>;

/// One connection to an upstream, however it is carried.
pub trait Rpc: Send + Sync {
    /// Sends `method` with `params` (as [`Negotiated::params`] made them) and waits for its
    /// result, at most `limit`; `cancel` tells the upstream to stop. When `progress` is
    /// wanted, the request asks for progress ([`ask_progress`]) and the upstream's progress
    /// notifications for it go there.
    fn request<'a>(
        &'a self,
        negotiated: &'a Negotiated,
        method: &'static str,
        params: Map<String, Value>,
        cancel: &'a CancellationToken,
        limit: Duration,
        progress: &'a Progress,
    ) -> RpcFuture<'a, Answer>;

    fn notify<'a>(
        &'a self,
        negotiated: &'a Negotiated,
        method: &'static str,
        params: Map<String, Value>,
    ) -> RpcFuture<'a, ()>;
}

/// Longest progress message passed on (the rest is cut).
const MAX_PROGRESS_MESSAGE: usize = 1024;

/// Asks the upstream for progress on request `id`: `_meta.progressToken` is the id itself,
/// which is how its notifications find their call (the caller's own token never leaves
/// the daemon).
pub fn ask_progress(params: &mut Map<String, Value>, id: u64) {
    let meta = params
        .entry("_meta")
        .or_insert_with(|| Value::Object(Map::new()));
    if let Value::Object(meta) = meta {
        meta.insert("progressToken".into(), Value::from(id));
    }
}

/// A `notifications/progress` message: the request id its token names and the update.
/// Anything else (another method, a token that is not one of our ids, a progress that is
/// not a number) is `None`.
pub fn progress(message: &Value) -> Option<(u64, ProgressUpdate)> {
    if message.get("method").and_then(Value::as_str) != Some("notifications/progress")
        || message.get("id").is_some()
    {
        return None;
    }
    let params = message.get("params")?;
    let id = params.get("progressToken")?.as_u64()?;
    let update = ProgressUpdate {
        progress: params.get("progress")?.as_f64()?,
        total: params.get("total").and_then(Value::as_f64),
        message: params
            .get("message")
            .and_then(Value::as_str)
            .map(|m| m.chars().take(MAX_PROGRESS_MESSAGE).collect()),
    };
    Some((id, update))
}

/// A JSON-RPC request or notification toward an upstream, written straight from its
/// parts: its `params` are serialized where they are, never copied into a message value.
#[derive(Debug, serde::Serialize)]
pub struct Outgoing<'a> {
    jsonrpc: &'static str,
    /// `None`: a notification.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<u64>,
    pub method: &'static str,
    pub params: &'a Map<String, Value>,
}

impl<'a> Outgoing<'a> {
    pub fn request(id: u64, method: &'static str, params: &'a Map<String, Value>) -> Self {
        Self {
            jsonrpc: "2.0",
            id: Some(id),
            method,
            params,
        }
    }

    pub fn notification(method: &'static str, params: &'a Map<String, Value>) -> Self {
        Self {
            jsonrpc: "2.0",
            id: None,
            method,
            params,
        }
    }

    /// The message as JSON text (no newline).
    pub fn to_bytes(&self) -> Vec<u8> {
        // A map with string keys and JSON values always serializes.
        serde_json::to_vec(self).unwrap_or_default()
    }
}

/// A JSON-RPC request line (no newline).
pub fn request_bytes(id: u64, method: &'static str, params: Map<String, Value>) -> Vec<u8> {
    Outgoing::request(id, method, &params).to_bytes()
}

pub fn notification_bytes(method: &'static str, params: Map<String, Value>) -> Vec<u8> {
    Outgoing::notification(method, &params).to_bytes()
}

/// What one message from an upstream is.
#[derive(Debug, PartialEq)]
pub enum Incoming {
    /// An answer to our request `id` (ours are numbers).
    Response {
        id: u64,
        result: Result<Map<String, Value>, CallError>,
    },
    /// A notification (`notifications/tools/list_changed`, progress, log messages).
    Notification { method: String },
    /// A request of the server's (`ping`, `roots/list`, …), to be answered.
    Request { id: Value, method: String },
    /// An answer to an id we never used, or not JSON-RPC at all.
    Stray(String),
}

pub fn classify(message: Value) -> Incoming {
    let Value::Object(mut message) = message else {
        return Incoming::Stray("a message that is not a JSON object".into());
    };
    let method = message
        .get("method")
        .and_then(Value::as_str)
        .map(str::to_owned);
    match (message.remove("id"), method) {
        (Some(id), Some(method)) if !id.is_null() => Incoming::Request { id, method },
        (None, Some(method)) => Incoming::Notification { method },
        (Some(id), None) => {
            let Some(id) = id.as_u64() else {
                return Incoming::Stray(format!("an answer to an id we never sent ({id})"));
            };
            let result = match (message.remove("result"), message.remove("error")) {
                (Some(Value::Object(result)), None) => Ok(result),
                (None, Some(error)) => Err(CallError::Rpc {
                    code: error.get("code").and_then(Value::as_i64).unwrap_or(0),
                    message: error
                        .get("message")
                        .and_then(Value::as_str)
                        .unwrap_or_default()
                        .chars()
                        .take(1024)
                        .collect(),
                }),
                _ => Err(CallError::Lost(
                    "the upstream answered with neither a result object nor an error".into(),
                )),
            };
            Incoming::Response { id, result }
        }
        _ => Incoming::Stray("a JSON-RPC message without an id or a method".into()),
    }
}

/// The JSON-RPC error a server sent with an HTTP error status for our request `sent`: the
/// transport lets a server that cannot accept a message answer with an error response
/// whose id is null or absent; ours is accepted too. Anything else — a well-formed error
/// object (an integer `code`, a text `message`) is needed — is not its refusal.
pub fn refusal(message: Value, sent: u64) -> Option<CallError> {
    let Value::Object(mut message) = message else {
        return None;
    };
    let error = message.get("error")?;
    if error.get("code").and_then(Value::as_i64).is_none()
        || !error.get("message").is_some_and(Value::is_string)
    {
        return None;
    }
    match message.get("id") {
        None | Some(Value::Null) => {
            message.insert("id".into(), sent.into());
        }
        Some(id) if id.as_u64() == Some(sent) => {}
        Some(_) => return None,
    }
    match classify(Value::Object(message)) {
        Incoming::Response {
            result: Err(error @ CallError::Rpc { .. }),
            ..
        } => Some(error),
        _ => None,
    }
}

/// The answer we give to a server's own request: `ping` is answered, nothing else is
/// offered (we declare no client capabilities).
pub fn answer_server_request(id: Value, method: &str) -> Vec<u8> {
    let answer = if method == "ping" {
        json!({"jsonrpc": "2.0", "id": id, "result": {}})
    } else {
        json!({"jsonrpc": "2.0", "id": id, "error": {
            "code": -32601,
            "message": "robota-mcpd offers no client features to its upstreams"
        }})
    };
    answer.to_string().into_bytes()
}

/// The `id` of a message we could not read whole (over the size limit), from its first
/// bytes: a top-level `"id"` member with a number. Our own ids are numbers.
pub fn id_in_prefix(prefix: &[u8]) -> Option<u64> {
    let mut depth = 0usize;
    let mut i = 0;
    let mut key_start: Option<usize> = None;
    let mut last_key: Option<(usize, usize)> = None;
    while i < prefix.len() {
        match prefix[i] {
            b'"' => {
                let start = i + 1;
                i += 1;
                while i < prefix.len() && prefix[i] != b'"' {
                    i += if prefix[i] == b'\\' { 2 } else { 1 };
                }
                if depth == 1 && key_start.is_none() {
                    key_start = Some(start);
                    last_key = Some((start, i.min(prefix.len())));
                }
            }
            b'{' | b'[' => {
                depth += 1;
                key_start = None;
            }
            b'}' | b']' => depth = depth.saturating_sub(1),
            b',' if depth == 1 => key_start = None,
            b':' if depth == 1 => {
                if let Some((s, e)) = last_key
                    && &prefix[s..e] == b"id"
                {
                    let rest = &prefix[i + 1..];
                    let digits: Vec<u8> = rest
                        .iter()
                        .copied()
                        .skip_while(u8::is_ascii_whitespace)
                        .take_while(u8::is_ascii_digit)
                        .collect();
                    return std::str::from_utf8(&digits).ok()?.parse().ok();
                }
            }
            _ => {}
        }
        i += 1;
    }
    None
}

/// Agrees on a revision with the upstream behind `rpc`.
pub async fn handshake(
    rpc: &dyn Rpc,
    protocol: UpstreamProtocol,
    limit: Duration,
) -> Result<Negotiated, String> {
    let cancel = CancellationToken::new();
    match protocol {
        UpstreamProtocol::V2026_07_28 => discover(rpc, &cancel, limit).await,
        UpstreamProtocol::V2025_11_25 => initialize(rpc, &cancel, limit).await,
        UpstreamProtocol::Auto => match discover(rpc, &cancel, limit.min(DISCOVER_WAIT)).await {
            Ok(negotiated) => Ok(negotiated),
            Err(modern_failure) => initialize(rpc, &cancel, limit)
                .await
                .map_err(|legacy| format!("{modern_failure}; then {legacy}")),
        },
    }
}

async fn discover(
    rpc: &dyn Rpc,
    cancel: &CancellationToken,
    limit: Duration,
) -> Result<Negotiated, String> {
    let modern = Negotiated::modern();
    let result = rpc
        .request(
            &modern,
            "server/discover",
            modern.params(Map::new()),
            cancel,
            limit,
            &Progress::default(),
        )
        .await
        .map_err(|e| format!("server/discover failed: {}", e.describe()))?
        .result;
    let supported = result
        .get("supportedVersions")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    if supported.iter().any(|v| v.as_str() == Some(MODERN)) {
        Ok(modern)
    } else {
        Err(format!(
            "server/discover offers {} but not {MODERN}",
            Value::Array(supported)
        ))
    }
}

async fn initialize(
    rpc: &dyn Rpc,
    cancel: &CancellationToken,
    limit: Duration,
) -> Result<Negotiated, String> {
    let legacy = Negotiated { version: LEGACY };
    let params = json!({
        "protocolVersion": LEGACY,
        "capabilities": {},
        "clientInfo": client_info(),
    });
    let Value::Object(params) = params else {
        unreachable!("an object literal")
    };
    let result = rpc
        .request(
            &legacy,
            "initialize",
            params,
            cancel,
            limit,
            &Progress::default(),
        )
        .await
        .map_err(|e| format!("initialize failed: {}", e.describe()))?
        .result;
    let negotiated = Negotiated {
        version: initialize_version(result.get("protocolVersion"))?,
    };
    rpc.notify(&negotiated, "notifications/initialized", Map::new())
        .await
        .map_err(|e| format!("notifications/initialized failed: {}", e.describe()))?;
    Ok(negotiated)
}

/// The revision an `initialize` answer agreed to, if it is one that is agreed that way
/// (2024-11-05 to 2025-11-25): the server answers with the version we offered or another
/// of its own, and one we do not know — or a later revision, which has no `initialize`
/// — ends the handshake, whatever the configuration asked for.
fn initialize_version(answered: Option<&Value>) -> Result<&'static str, String> {
    let known = ProtocolVersion::known_up_to(&ProtocolVersion::LATEST_WITH_INITIALIZE);
    let Some(answered) = answered.and_then(Value::as_str) else {
        return Err("the initialize answer names no protocol version".into());
    };
    match known.iter().find(|v| v.as_str() == answered) {
        Some(version) => Ok(version.as_str()),
        None => Err(format!(
            "the initialize answer names protocol version {:?}, which is not one agreed by initialize ({})",
            answered.chars().take(40).collect::<String>(),
            known
                .iter()
                .map(ProtocolVersion::as_str)
                .collect::<Vec<_>>()
                .join(", ")
        )),
    }
}

/// Every tool definition an upstream listed, as sent, with the share of the upstreams'
/// memory budget its pages took: held for as long as the list is served.
#[derive(Debug)]
pub struct Listed {
    pub tools: Vec<Value>,
    pub held: Option<Share>,
}

/// Every tool definition the upstream lists (following `nextCursor`), as sent. One
/// upstream's list may hold at most a quarter of the upstreams' `budget`, so one cannot
/// keep what the others need for their answers and lists.
pub async fn list_tools(
    rpc: &dyn Rpc,
    negotiated: &Negotiated,
    limit: Duration,
    budget: &Budget,
) -> Result<Listed, String> {
    let share = budget.units() / 4;
    let cancel = CancellationToken::new();
    let mut listed = Listed {
        tools: Vec::new(),
        held: None,
    };
    let mut cursor: Option<String> = None;
    for _ in 0..MAX_PAGES {
        let mut params = Map::new();
        if let Some(c) = cursor.take() {
            params.insert("cursor".into(), Value::String(c));
        }
        let Answer {
            mut result, held, ..
        } = rpc
            .request(
                negotiated,
                "tools/list",
                negotiated.params(params),
                &cancel,
                limit,
                &Progress::default(),
            )
            .await
            .map_err(|e| format!("tools/list failed: {}", e.describe()))?;
        listed.hold(held);
        let holds = listed.held.as_ref().map_or(0, |h| h.num_permits());
        if holds > share {
            return Err(format!(
                "the upstream's tool list would take about {holds} KiB of memory, more than one upstream's share ({share} KiB, a quarter of [limits] upstream_memory)"
            ));
        }
        match result.remove("tools") {
            Some(Value::Array(page)) => listed.tools.extend(page),
            _ => return Err("the tools/list answer holds no `tools` array".into()),
        }
        if listed.tools.len() > MAX_LISTED {
            return Err(format!("the upstream lists more than {MAX_LISTED} tools"));
        }
        match result.remove("nextCursor") {
            Some(Value::String(next)) if !next.is_empty() => cursor = Some(next),
            _ => return Ok(listed),
        }
    }
    Err(format!("tools/list gave more than {MAX_PAGES} pages"))
}

impl Listed {
    /// Keeps `more` with what the list already holds.
    pub fn hold(&mut self, more: Option<Share>) {
        match (&mut self.held, more) {
            (Some(held), Some(more)) => held.merge(more),
            (held @ None, more) => *held = more,
            (Some(_), None) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modern_params_carry_the_request_metadata() {
        let p = Negotiated::modern().params(Map::new());
        let meta = &p["_meta"];
        assert_eq!(meta["io.modelcontextprotocol/protocolVersion"], MODERN);
        assert!(meta["io.modelcontextprotocol/clientCapabilities"].is_object());
        let legacy = Negotiated { version: LEGACY };
        assert!(legacy.params(Map::new()).is_empty());
        // A `_meta` the request already has keeps its own members beside the context.
        let mut params = Map::new();
        ask_progress(&mut params, 9);
        let p = Negotiated::modern().params(params);
        assert_eq!(p["_meta"]["progressToken"], 9);
        assert_eq!(
            p["_meta"]["io.modelcontextprotocol/protocolVersion"],
            MODERN
        );
        assert_eq!(
            p["_meta"]["io.modelcontextprotocol/clientInfo"]["name"],
            "robota-mcpd"
        );
    }

    #[test]
    fn initialize_agrees_only_to_revisions_that_have_it() {
        for known in ["2024-11-05", "2025-03-26", "2025-06-18", LEGACY] {
            assert_eq!(
                initialize_version(Some(&json!(known))).as_deref(),
                Ok(known)
            );
        }
        for other in [
            json!(MODERN),
            json!("2025-11-25\"x=y"),
            json!("a\"b"),
            json!("2024-01-01"),
            json!(""),
            json!(20251125),
        ] {
            let refused = initialize_version(Some(&other)).unwrap_err();
            assert!(refused.contains("protocol version"), "{other}: {refused}");
        }
        assert!(initialize_version(None).is_err());
    }

    #[test]
    fn outgoing_messages_are_json_rpc_with_their_params_as_given() {
        let mut params = Map::new();
        params.insert("name".into(), json!("q \"x\""));
        params.insert("arguments".into(), json!({"n": [1, 2.5, null]}));
        let request: Value =
            serde_json::from_slice(&request_bytes(7, "tools/call", params.clone())).unwrap();
        assert_eq!(
            request,
            json!({"jsonrpc": "2.0", "id": 7, "method": "tools/call", "params": params})
        );
        let note: Value =
            serde_json::from_slice(&notification_bytes("notifications/cancelled", Map::new()))
                .unwrap();
        assert_eq!(
            note,
            json!({"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {}})
        );
        assert!(note.get("id").is_none());
    }

    #[test]
    fn a_parse_error_keeps_none_of_the_upstreams_words() {
        let budget = Budget::new(1 << 20);
        let secret = "tok-9f8e7d6c";
        for bytes in [
            format!(r#"{{"{secret}": 1, "{secret}": 2}}"#),
            format!(r#"{{"a\"{secret}": 1, "a\"{secret}": 2}}"#),
            format!(r#"{{"a": "{secret}" x}}"#),
            format!(r#"{{"a": 1}} "{secret}""#),
        ] {
            let Err(Unread::NotJson(why)) = parse(bytes.as_bytes(), &budget) else {
                panic!("{bytes} was read");
            };
            assert!(
                !why.contains(secret) && !why.contains("tok-"),
                "{bytes}: {why}"
            );
            assert!(why.contains("line 1"), "{bytes}: {why}");
        }
        assert_eq!(
            unquoted(r#"duplicate object key "a\"b" at line 1"#),
            r#"duplicate object key "…" at line 1"#
        );
    }

    #[test]
    fn a_refusal_is_a_json_rpc_error_for_our_request_or_for_none() {
        let error = json!({"code": -32602, "message": "n is not a number"});
        let heard = |v: Value| refusal(v, 9);
        for id in [json!(null), json!(9)] {
            assert_eq!(
                heard(json!({"jsonrpc": "2.0", "id": id, "error": error})),
                Some(CallError::Rpc {
                    code: -32602,
                    message: "n is not a number".into()
                }),
                "id {id}"
            );
        }
        assert!(heard(json!({"jsonrpc": "2.0", "error": error})).is_some());
        // Someone else's id, a result, a request, or no JSON-RPC at all: not a refusal.
        for not in [
            json!({"jsonrpc": "2.0", "id": 8, "error": error}),
            json!({"jsonrpc": "2.0", "id": "9", "error": error}),
            json!({"jsonrpc": "2.0", "id": null, "result": {}}),
            json!({"jsonrpc": "2.0", "id": null, "method": "x", "error": error}),
            json!({"error": "Bad Request"}),
            json!({"id": null, "error": {"message": "no code"}}),
            json!({"id": null, "error": {"code": 1.5, "message": "not an integer"}}),
            json!(["error"]),
        ] {
            assert_eq!(heard(not.clone()), None, "{not}");
        }
    }

    #[test]
    fn messages_are_classified() {
        let c = |v: Value| classify(v);
        assert!(matches!(
            c(json!({"jsonrpc":"2.0","id":3,"result":{"x":1}})),
            Incoming::Response { id: 3, result: Ok(r) } if r["x"] == 1
        ));
        assert!(matches!(
            c(json!({"jsonrpc":"2.0","id":4,"error":{"code":-32602,"message":"bad"}})),
            Incoming::Response {
                id: 4,
                result: Err(CallError::Rpc { code: -32602, .. })
            }
        ));
        assert!(matches!(
            c(json!({"jsonrpc":"2.0","method":"notifications/tools/list_changed"})),
            Incoming::Notification { method } if method == "notifications/tools/list_changed"
        ));
        assert!(matches!(
            c(json!({"jsonrpc":"2.0","id":"s1","method":"ping"})),
            Incoming::Request { method, .. } if method == "ping"
        ));
        assert!(matches!(
            c(json!({"jsonrpc":"2.0","id":"x","result":{}})),
            Incoming::Stray(_)
        ));
        assert!(matches!(c(json!([1])), Incoming::Stray(_)));
        assert!(matches!(
            c(json!({"jsonrpc":"2.0","id":5,"result":[1]})),
            Incoming::Response {
                id: 5,
                result: Err(CallError::Lost(_))
            }
        ));
    }

    #[test]
    fn the_id_of_an_oversize_message_is_found_in_its_first_bytes() {
        assert_eq!(
            id_in_prefix(br#"{"jsonrpc":"2.0","id":17,"result":{"content":[{"#),
            Some(17)
        );
        assert_eq!(id_in_prefix(br#"{"result":{"id":5,"x":"#), None);
        assert_eq!(id_in_prefix(br#"{"result":{"id":5},"id": 9,"#), Some(9));
        assert_eq!(
            id_in_prefix(br#"{"jsonrpc":"2.0","note":"\"id\":4","id":8"#),
            Some(8)
        );
        assert_eq!(id_in_prefix(br#"{"id":"abc""#), None);
        assert_eq!(id_in_prefix(b"garbage"), None);
    }

    #[test]
    fn server_requests_get_ping_answered_and_nothing_else() {
        let ping: Value = serde_json::from_slice(&answer_server_request(json!(1), "ping")).unwrap();
        assert_eq!(ping["result"], json!({}));
        let other: Value =
            serde_json::from_slice(&answer_server_request(json!("a"), "sampling/createMessage"))
                .unwrap();
        assert_eq!(other["error"]["code"], -32601);
        assert_eq!(other["id"], "a");
    }
}
