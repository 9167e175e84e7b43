//! The MCP face of the session: an rmcp `ServerHandler` over the two session roles, wire
//! names per carrier, and the in-flight table for cross-request cancellation.
//!
//! Invariants: protocol errors and the wire schema are rmcp's; every tool failure is a
//! visible tool error (`isError: true` with a closed-set `code`); only tools are
//! advertised. The handler is generic over a session bounded by exactly the two role
//! traits.

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use parking_lot::Mutex;
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, CancelTaskParams, ContentBlock,
    CreateTaskResult, ErrorData, GetTaskParams, GetTaskResult, Implementation,
    InitializeRequestParams, InitializeResult, ListToolsResult, PaginatedRequestParams,
    ProgressNotificationParam, ProgressToken, ProtocolVersion, RequestId, ServerCapabilities,
    ServerConfig, Tool, ToolAnnotations,
};
use rmcp::service::{Peer, RequestContext};
use rmcp::{RoleServer, ServerHandler};
use serde_json::{Map, Value, json};
use tokio_util::sync::CancellationToken;

use crate::catalog::{
    self, ERROR_META, Progress, ProgressUpdate, Snapshot, ToolError, ToolOutput, ToolSpec,
    UPSTREAM_META, is_own_meta,
};
use crate::config::WireNameProfile;
use crate::metrics::Metrics;
use crate::session::{JobOp, RuntimeTools, TurnSubmission};
use crate::vocab::{Admitted, Caller, JobId, ToolErrorCode};

/// The protocol revisions served, oldest first.
pub const SUPPORTED_VERSIONS: [ProtocolVersion; 2] =
    [ProtocolVersion::V_2025_11_25, ProtocolVersion::V_2026_07_28];

/// Least time between two progress notifications of one call (at most 20 a second); an
/// update that comes sooner replaces the one waiting.
pub const PROGRESS_INTERVAL: std::time::Duration = std::time::Duration::from_millis(50);

/// Whether an `MCP-Protocol-Version` value is one we serve.
pub fn is_supported_version(value: &str) -> bool {
    SUPPORTED_VERSIONS.iter().any(|v| v.as_str() == value)
}

/// What a wire name resolves to.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Target {
    Runtime(String),
    Submission,
    /// A name caught in a collision: answered `unavailable` with this reason.
    Refused(String),
}

/// A carrier's mapping between wire names and canonical names, for one catalog
/// generation.
#[derive(Debug)]
pub struct WireNames {
    generation: u64,
    targets: HashMap<String, Target>,
    tools: Vec<Tool>,
    /// `tools` as JSON, made by the first `tools/list` of this generation.
    listing: std::sync::OnceLock<Option<bytes::Bytes>>,
    /// Problems the configuration alone decides (an alias, a first-party name, the
    /// submission tool): any of them refuses the carrier at start-up, and as the
    /// configuration does not change within a session, no later generation has one.
    problems: Vec<WireError>,
    /// Collisions an upstream's listing takes part in: their names are refused (answered
    /// `unavailable` with why), logged, and nothing else changes.
    refusals: Vec<WireError>,
}

#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum WireError {
    #[error("tools {first:?} and {second:?} both map to the wire name {wire:?}; give one an alias")]
    Collision {
        wire: String,
        first: String,
        second: String,
    },
    #[error("tool {name:?} is offered by {}; give one an alias", .sources.join(" and "))]
    SourceCollision { name: String, sources: Vec<String> },
    #[error("an alias names {0:?}, which is not in the catalog")]
    UnknownAlias(String),
    #[error("alias {wire:?} for {canonical:?} is not a valid tool name: {problem}")]
    BadAlias {
        canonical: String,
        wire: String,
        problem: String,
    },
}

impl WireNames {
    /// Map every canonical name of `snapshot` (runtime tools and the submission tool) to
    /// its wire name. Never first-wins: names that collide — in the catalog or after the
    /// profile — are all refused, and recorded.
    pub fn build(
        snapshot: &Snapshot,
        profile: WireNameProfile,
        aliases: &std::collections::BTreeMap<String, String>,
    ) -> Self {
        let submission = snapshot.submission();
        let mut problems = Vec::new();
        // A name under an upstream's prefix may be an alias for a tool it offers later.
        let known = |name: &str| {
            snapshot.get(name).is_some() || name == submission.name || snapshot.in_namespace(name)
        };
        for alias in aliases.keys().filter(|name| !known(name)) {
            problems.push(WireError::UnknownAlias(alias.clone()));
        }
        let mut targets = HashMap::new();
        let mut refusals = Vec::new();
        for (name, sources) in snapshot.conflicts() {
            let collision = WireError::SourceCollision {
                name: name.clone(),
                sources: sources.clone(),
            };
            let why = collision.to_string();
            if snapshot.listed_conflict(name) {
                refusals.push(collision);
            } else {
                problems.push(collision);
            }
            targets.insert(wire_of(name, profile, aliases), Target::Refused(why));
        }
        let submission_free = !snapshot.conflicts().contains_key(&submission.name);
        let specs = snapshot
            .specs()
            .map(|s| (s, Target::Runtime(s.name.clone())))
            .chain(submission_free.then_some((submission, Target::Submission)));
        // Wire name → the canonical names that map to it.
        let mut by_wire: BTreeMap<String, Vec<(&ToolSpec, Target)>> = BTreeMap::new();
        for (spec, target) in specs {
            let wire = match aliases.get(&spec.name) {
                Some(alias) => match crate::config::check_name(alias) {
                    Ok(()) => alias.clone(),
                    Err(problem) => {
                        problems.push(WireError::BadAlias {
                            canonical: spec.name.clone(),
                            wire: alias.clone(),
                            problem,
                        });
                        continue;
                    }
                },
                None => wire_of(&spec.name, profile, aliases),
            };
            by_wire.entry(wire).or_default().push((spec, target));
        }
        let mut tools = Vec::new();
        for (wire, mut owners) in by_wire {
            if owners.len() > 1 {
                let collision = WireError::Collision {
                    wire: wire.clone(),
                    first: owners[0].0.name.clone(),
                    second: owners[1].0.name.clone(),
                };
                targets.insert(wire, Target::Refused(collision.to_string()));
                if owners.iter().any(|(spec, _)| spec.imported.is_some()) {
                    refusals.push(collision);
                } else {
                    problems.push(collision);
                }
                continue;
            }
            if let Some((spec, target)) = owners.pop() {
                tools.push(wire_tool(&wire, spec));
                targets.insert(wire, target);
            }
        }
        Self {
            generation: snapshot.generation(),
            targets,
            tools,
            listing: std::sync::OnceLock::new(),
            problems,
            refusals,
        }
    }

    /// The listing's `tools` array as JSON, serialized once per generation (`None` if it
    /// cannot be: never for tools rmcp's types hold).
    fn listing(&self) -> Option<bytes::Bytes> {
        self.listing
            .get_or_init(|| serde_json::to_vec(&self.tools).ok().map(bytes::Bytes::from))
            .clone()
    }

    /// Log the names an upstream's listing made collide (refused; the rest is served).
    fn log_refusals(&self, carrier_profile: WireNameProfile) {
        for refusal in &self.refusals {
            tracing::warn!(
                generation = self.generation,
                wire_names = ?carrier_profile,
                "names refused, the rest of the catalog is served: {refusal}"
            );
        }
    }

    /// The first problem: at start-up, any of them refuses the carrier.
    pub fn check(&self) -> Result<(), WireError> {
        match self.problems.first() {
            Some(problem) => Err(problem.clone()),
            None => Ok(()),
        }
    }

    fn resolve(&self, wire: &str) -> Option<&Target> {
        self.targets.get(wire)
    }

    fn tool(&self, wire: &str) -> Option<&Tool> {
        self.tools.iter().find(|t| t.name == wire)
    }
}

/// A canonical name under a profile (no alias).
fn wire_of(
    name: &str,
    profile: WireNameProfile,
    aliases: &std::collections::BTreeMap<String, String>,
) -> String {
    if let Some(alias) = aliases.get(name) {
        return alias.clone();
    }
    match profile {
        WireNameProfile::Canonical => name.to_owned(),
        WireNameProfile::Compat => name.replace('.', "_"),
    }
}

fn wire_tool(wire: &str, spec: &ToolSpec) -> Tool {
    if let Some(imported) = &spec.imported {
        // The upstream's own definition (title, annotations, output schema, icons, `_meta`)
        // under the wire name, with its origin in `_meta`.
        let mut definition = imported.listing.clone();
        definition.insert("name".into(), Value::String(wire.to_owned()));
        definition.insert(
            "description".into(),
            Value::String(spec.description.clone()),
        );
        definition.insert(
            "inputSchema".into(),
            Value::Object(spec.input_schema.clone()),
        );
        let meta = definition
            .entry("_meta")
            .or_insert_with(|| Value::Object(Map::new()));
        if !meta.is_object() {
            *meta = Value::Object(Map::new());
        }
        if let Value::Object(meta) = meta {
            meta.retain(|k, _| !is_own_meta(k));
            meta.insert(UPSTREAM_META.into(), imported.meta());
        }
        if let Ok(tool) = serde_json::from_value::<Tool>(Value::Object(definition)) {
            return tool;
        }
    }
    let a = spec.annotations;
    Tool::new(
        wire.to_owned(),
        spec.description.clone(),
        Arc::new(spec.input_schema.clone()),
    )
    .with_annotations(
        ToolAnnotations::new()
            .read_only(a.read_only)
            .destructive(a.destructive)
            .idempotent(a.idempotent)
            .open_world(false),
    )
}

/// In-flight requests keyed by (caller, request id), for cancellation that arrives in
/// another HTTP request.
#[derive(Default)]
pub struct InFlight {
    entries: Mutex<HashMap<(Caller, RequestId), (u64, CancellationToken)>>,
    serial: AtomicU64,
}

/// Removes its entry from the table when the request ends.
pub struct InFlightGuard<'a> {
    table: &'a InFlight,
    key: Option<(Caller, RequestId)>,
    serial: u64,
}

impl Drop for InFlightGuard<'_> {
    fn drop(&mut self) {
        if let Some(key) = self.key.take() {
            let mut entries = self.table.entries.lock();
            if entries
                .get(&key)
                .is_some_and(|(serial, _)| *serial == self.serial)
            {
                entries.remove(&key);
            }
        }
    }
}

impl InFlight {
    pub fn register(
        &self,
        caller: Caller,
        id: RequestId,
        token: CancellationToken,
    ) -> InFlightGuard<'_> {
        let serial = self.serial.fetch_add(1, Ordering::Relaxed);
        self.entries
            .lock()
            .insert((caller.clone(), id.clone()), (serial, token));
        InFlightGuard {
            table: self,
            key: Some((caller, id)),
            serial,
        }
    }

    /// Cancel `caller`'s own request `id`. Another caller's request with the same id is
    /// never touched. Returns whether a request was cancelled.
    pub fn cancel(&self, caller: &Caller, id: &RequestId) -> bool {
        let key = (caller.clone(), id.clone());
        match self.entries.lock().get(&key) {
            Some((_, token)) => {
                token.cancel();
                true
            }
            None => false,
        }
    }

    pub fn len(&self) -> usize {
        self.entries.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The rmcp handler. Cheap to clone: rmcp's HTTP service builds one per request.
pub struct McpServer<S> {
    shared: Arc<Shared<S>>,
}

impl<S> Clone for McpServer<S> {
    fn clone(&self) -> Self {
        Self {
            shared: self.shared.clone(),
        }
    }
}

/// Where the handler leaves what rmcp's result types cannot carry, or would only copy and
/// serialize again, for the carrier to put on the wire in place of the placeholder the
/// handler returns: an imported tool's result — already checked against the result limit
/// and shaped for the caller's revision; rmcp's result type has no room for fields it does
/// not know, and an upstream's result keeps them (docs/design.md §13.4) — or the listing's
/// `tools`, serialized once per catalog generation. Every carrier puts one in the request's
/// HTTP parts for each `tools/call` and `tools/list`, and writes the answer with
/// [`AnswerSlot::encode`]; without one (rmcp driving the handler alone) the typed result
/// carries everything.
#[derive(Clone, Default)]
pub struct AnswerSlot(Arc<Mutex<Option<Prepared>>>);

enum Prepared {
    /// A whole `tools/call` result.
    Result(Map<String, Value>),
    /// The `tools` array of a `tools/list` result.
    Tools(bytes::Bytes),
}

/// How a placeholder listing's answer ends, rmcp serializing `tools` last (then the
/// result's and the message's closing braces): the array is put where its `[]` is.
const EMPTY_TOOLS_END: &[u8] = br#""tools":[]}}"#;
const TOOLS_KEY: &[u8] = br#""tools":"#;
const ANSWER_END: &[u8] = b"}}";

impl AnswerSlot {
    fn fill(&self, prepared: Prepared) {
        *self.0.lock() = Some(prepared);
    }

    /// The handler's answer `message` as it goes on the wire: with what the slot holds in
    /// place of the placeholder.
    pub fn encode(
        slot: Option<&Self>,
        message: &rmcp::model::ServerJsonRpcMessage,
    ) -> serde_json::Result<Vec<u8>> {
        let rmcp::model::ServerJsonRpcMessage::Response(response) = message else {
            return serde_json::to_vec(message);
        };
        match slot.and_then(|slot| slot.0.lock().take()) {
            None => serde_json::to_vec(message),
            Some(Prepared::Result(result)) => serde_json::to_vec(&rmcp::model::JsonRpcResponse {
                jsonrpc: rmcp::model::JsonRpcVersion2_0,
                id: response.id.clone(),
                result,
            }),
            Some(Prepared::Tools(tools)) => {
                let mut out = serde_json::to_vec(message)?;
                let Some(kept) = out
                    .strip_suffix(EMPTY_TOOLS_END)
                    .map(|head| head.len() + TOOLS_KEY.len())
                else {
                    return Err(serde::ser::Error::custom(
                        "the listing's placeholder answer does not end with its tools",
                    ));
                };
                out.truncate(kept);
                out.extend_from_slice(&tools);
                out.extend_from_slice(ANSWER_END);
                Ok(out)
            }
        }
    }

    /// Whether a carrier puts a slot in for `request`: the requests whose answer the
    /// handler prepares (`tools/call`, `tools/list`).
    pub fn wanted(request: &rmcp::model::ClientRequest) -> bool {
        use rmcp::model::ClientRequest::{CallToolRequest, ListToolsRequest};
        matches!(request, CallToolRequest(_) | ListToolsRequest(_))
    }

    /// The slot in a handler's request context, if its carrier put one there.
    fn of(context: &RequestContext<RoleServer>) -> Option<&Self> {
        context
            .extensions
            .get::<http::request::Parts>()?
            .extensions
            .get::<Self>()
    }
}

/// Where a `tools/call`'s progress goes, if its caller asked for progress: the token in
/// the request's `_meta` (`meta`), else in its params' own.
pub fn progress_token(
    meta: &rmcp::model::RequestMetaObject,
    params: &CallToolRequestParams,
) -> Option<ProgressToken> {
    meta.get_progress_token()
        .or_else(|| params.meta.as_ref()?.get_progress_token())
}

/// A client's message as rmcp reads it, given the `method` and `id` the strict look
/// ([`crate::jsonrpc::inspect`]) found. rmcp's `ClientRequest` is an untagged union that
/// tries each kind of request in turn, building and dropping an error for every kind before
/// the right one (`tools/list` is the fifteenth); a request of a method the daemon serves
/// is read as its own kind at once. Whatever that refuses, and every other message, is read
/// by rmcp's own union, so the outcome and the reason are rmcp's (the property test in
/// `carrier/differential.rs` holds the two to it).
pub fn read_message(
    method: Option<&str>,
    id: bool,
    bytes: &[u8],
) -> serde_json::Result<rmcp::model::ClientJsonRpcMessage> {
    use rmcp::model::{
        CallToolRequest, CallToolRequestMethod, CancelTaskMethod, CancelTaskRequest,
        ClientJsonRpcMessage, ClientRequest, ConstString, GetTaskMethod, GetTaskRequest,
        JsonRpcRequest, ListToolsRequest, ListToolsRequestMethod, PingRequest, PingRequestMethod,
    };
    type Reader = fn(&[u8]) -> Option<ClientJsonRpcMessage>;
    fn kind<R: serde::de::DeserializeOwned + Into<ClientRequest>>(
        bytes: &[u8],
    ) -> Option<ClientJsonRpcMessage> {
        let read = serde_json::from_slice::<JsonRpcRequest<R>>(bytes).ok()?;
        Some(ClientJsonRpcMessage::Request(JsonRpcRequest::new(
            read.id,
            read.request.into(),
        )))
    }
    const KINDS: [(&str, Reader); 5] = [
        (PingRequestMethod::VALUE, kind::<PingRequest>),
        (ListToolsRequestMethod::VALUE, kind::<ListToolsRequest>),
        (CallToolRequestMethod::VALUE, kind::<CallToolRequest>),
        (GetTaskMethod::VALUE, kind::<GetTaskRequest>),
        (CancelTaskMethod::VALUE, kind::<CancelTaskRequest>),
    ];
    let direct = method
        .filter(|_| id)
        .and_then(|method| KINDS.iter().find(|(name, _)| *name == method))
        .and_then(|(_, read)| read(bytes));
    direct.map_or_else(|| serde_json::from_slice(bytes), Ok)
}

/// A passthrough result shaped for the caller's revision, as rmcp shapes its own results:
/// `resultType: "complete"` for 2026-07-28; for older revisions no `resultType` and only
/// object `structuredContent` (another value moves to the first text block).
fn for_revision(mut raw: Map<String, Value>, modern: bool) -> Map<String, Value> {
    if modern {
        raw.insert("resultType".into(), Value::String("complete".into()));
        return raw;
    }
    raw.remove("resultType");
    if let Some(value) = raw
        .get("structuredContent")
        .filter(|v| !v.is_object())
        .cloned()
    {
        raw.remove("structuredContent");
        let content = raw
            .entry("content")
            .or_insert_with(|| Value::Array(Vec::new()));
        if let Value::Array(blocks) = content {
            let first_holds_it = blocks
                .first()
                .and_then(|b| b.get("text"))
                .and_then(Value::as_str)
                .and_then(|t| serde_json::from_str::<Value>(t).ok())
                .is_some_and(|v| v == value);
            if !first_holds_it {
                blocks.insert(0, json!({"type": "text", "text": value.to_string()}));
            }
        }
    }
    raw
}

/// What the MCP face needs besides the session: the result limit, which applies to what
/// goes on the wire, and where tool calls are counted.
#[derive(Clone)]
pub struct Wire {
    pub result_limit: u64,
    pub metrics: Metrics,
}

/// The `tool` label of calls to a name that is not in the catalog (never the name itself).
pub const UNKNOWN_TOOL_LABEL: &str = "(unknown)";

struct Shared<S> {
    session: Arc<S>,
    profile: WireNameProfile,
    aliases: BTreeMap<String, String>,
    /// The wire names of the catalog generation last seen.
    names: Mutex<Arc<WireNames>>,
    inflight: Arc<InFlight>,
    wire: Wire,
}

/// Who the request is from: every carrier puts the admitted caller (with its token's
/// scopes, if it has one) in the request's HTTP parts (the line carriers build parts for
/// each message), and the handler reads it from there and nowhere else.
pub fn admitted(caller: Admitted) -> http::request::Parts {
    let (mut parts, ()) = http::Request::new(()).into_parts();
    parts.extensions.insert(caller);
    parts
}

impl<S: RuntimeTools + TurnSubmission> McpServer<S> {
    /// A server for one carrier. Fails when the catalog's wire names under `profile` and
    /// `aliases` have a problem (a collision, an unknown or invalid alias): the carrier
    /// must not start.
    pub fn new(
        session: Arc<S>,
        profile: WireNameProfile,
        aliases: BTreeMap<String, String>,
        inflight: Arc<InFlight>,
        wire: Wire,
    ) -> Result<Self, WireError> {
        let names = WireNames::build(&session.catalog(), profile, &aliases);
        names.check()?;
        names.log_refusals(profile);
        Ok(Self {
            shared: Arc::new(Shared {
                session,
                profile,
                aliases,
                names: Mutex::new(Arc::new(names)),
                inflight,
                wire,
            }),
        })
    }

    pub fn inflight(&self) -> &Arc<InFlight> {
        &self.shared.inflight
    }

    /// The wire names of the current catalog generation.
    fn names(&self) -> Arc<WireNames> {
        let snapshot: Arc<Snapshot> = self.shared.session.catalog();
        let mut names = self.shared.names.lock();
        if names.generation != snapshot.generation() {
            *names = Arc::new(WireNames::build(
                &snapshot,
                self.shared.profile,
                &self.shared.aliases,
            ));
            names.log_refusals(self.shared.profile);
        }
        names.clone()
    }

    fn caller(&self, context: &RequestContext<RoleServer>) -> Option<Admitted> {
        context
            .extensions
            .get::<http::request::Parts>()
            .and_then(|parts| parts.extensions.get::<Admitted>())
            .cloned()
    }

    /// The canonical name a `tools/call` of wire name `wire` would run in the current
    /// catalog generation (`None`: no such tool, or one refused for a collision).
    pub fn canonical_name(&self, wire: &str) -> Option<String> {
        match self.names().resolve(wire)? {
            Target::Runtime(name) => Some(name.clone()),
            Target::Submission => Some(self.shared.session.submission_tool().name.clone()),
            Target::Refused(_) => None,
        }
    }

    /// A `tools/call` as the handler runs it: registered in the in-flight table under
    /// (caller, `id`) so that `notifications/cancelled` reaches it, dispatched, bounded,
    /// counted. A job becomes a task only for a client that declared tasks.
    async fn run_call(
        &self,
        caller: &Admitted,
        id: RequestId,
        request: CallToolRequestParams,
        cancel: CancellationToken,
        slot: Option<&AnswerSlot>,
        shape: Shape,
    ) -> CallToolResponse {
        let started = Instant::now();
        let _inflight = self
            .shared
            .inflight
            .register(caller.caller.clone(), id, cancel.clone());
        // A call whose caller went away (the request dropped before its answer) still
        // counts, as cancelled.
        let mut abandoned = Abandoned {
            server: self,
            wire: request.name.to_string(),
            started,
            armed: true,
        };
        let limit = self.shared.wire.result_limit;
        let (tool, result) = match shape.progress {
            None => {
                self.dispatch(caller, request, cancel, Progress::default())
                    .await
            }
            Some((to, token)) => {
                let (sink, mut updates) = Progress::channel();
                let mut out = ProgressOut {
                    sink: to,
                    token,
                    left: limit,
                };
                // The forwarder ends only when the call has dropped its sink, i.e. once
                // the call is over.
                let done = {
                    let call = std::pin::pin!(self.dispatch(caller, request, cancel, sink));
                    let forward = std::pin::pin!(out.forward(&mut updates));
                    match futures_util::future::select(call, forward).await {
                        futures_util::future::Either::Left((done, _)) => done,
                        futures_util::future::Either::Right(((), call)) => call.await,
                    }
                };
                // The latest update not yet sent (the last step, typically) goes before
                // the result rather than never.
                let unsent = {
                    let last = updates.borrow_and_update();
                    last.clone().filter(|_| last.has_changed())
                };
                if let Some(update) = unsent {
                    out.send(update).await;
                }
                done
            }
        };
        abandoned.armed = false;
        let tool = tool.as_deref().unwrap_or(UNKNOWN_TOOL_LABEL);
        let metrics = &self.shared.wire.metrics;
        if let Ok(ToolOutput::Job(job)) = &result
            && shape.tasks
        {
            metrics.tool_call(tool, None, started.elapsed());
            return CallToolResponse::Task(CreateTaskResult::new(tasks::task(job)));
        }
        let (mut rendered, code) = self.bounded(result, slot.map(|s| (s, shape.modern)), limit);
        metrics.tool_call(tool, code, started.elapsed());
        if let Some(code) = code {
            self.mark_own_error(&mut rendered, tool, code);
        }
        rendered.into()
    }

    /// An error the daemon made: marked as its own (an upstream's content never carries
    /// the mark), and for an imported tool, naming its upstream like its results do.
    fn mark_own_error(&self, rendered: &mut CallToolResult, tool: &str, code: ToolErrorCode) {
        let meta = &mut rendered
            .meta
            .get_or_insert_with(|| rmcp::model::MetaObject(Map::new()))
            .0;
        meta.insert(
            ERROR_META.into(),
            json!({"by": "robota-mcpd", "code": code.as_str()}),
        );
        let snapshot = self.shared.session.catalog();
        if let Some(imported) = snapshot.get(tool).and_then(|e| e.spec().imported.as_ref()) {
            meta.insert(UPSTREAM_META.into(), imported.meta());
        }
    }

    /// Run a call; returns the canonical name it resolved to (None: not in the catalog).
    async fn dispatch(
        &self,
        caller: &Admitted,
        request: CallToolRequestParams,
        cancel: CancellationToken,
        progress: Progress,
    ) -> (Option<String>, Result<ToolOutput, ToolError>) {
        let names = self.names();
        let Some(target) = names.resolve(&request.name).cloned() else {
            return (None, Err(self.shared.session.unknown_tool(&request.name)));
        };
        let args = request.arguments.unwrap_or_default();
        let session = &self.shared.session;
        match target {
            Target::Refused(why) => (None, Err(ToolError::new(ToolErrorCode::Unavailable, why))),
            Target::Runtime(name) => {
                let result = session
                    .invoke_runtime_tool(caller, &name, args, cancel, progress)
                    .await;
                (Some(name), result)
            }
            Target::Submission => {
                let name = session.submission_tool().name.clone();
                let result = match catalog::submission_prompt(args) {
                    Ok(prompt) => session.submit_turn(caller, prompt, cancel).await,
                    Err(e) => Err(e),
                };
                (Some(name), result)
            }
        }
    }

    /// The rendered result, or `result_too_large` when what would go on the wire (the
    /// structured content and its text copy; a passthrough result as it will be sent) is
    /// over the result limit. A passthrough result goes into its slot.
    fn bounded(
        &self,
        result: Result<ToolOutput, ToolError>,
        passthrough: Option<(&AnswerSlot, bool)>,
        limit: u64,
    ) -> (CallToolResult, Option<ToolErrorCode>) {
        let result = match (result, passthrough) {
            (Ok(ToolOutput::Passthrough(raw)), Some((slot, modern))) => {
                let raw = for_revision(raw, modern);
                let size = wire_size(&raw);
                if size <= limit {
                    // The slot's result is sent instead of this placeholder.
                    slot.fill(Prepared::Result(raw));
                    return (CallToolResult::success(Vec::new()), None);
                }
                Err(ToolError::new(
                    ToolErrorCode::ResultTooLarge,
                    format!("the result is {size} bytes on the wire, over the {limit} byte limit"),
                ))
            }
            // Without a slot (the handler driven directly), rmcp's own type carries it.
            (other, _) => other,
        };
        let code = result.as_ref().err().map(|e| e.code);
        let rendered = render(result);
        let size = wire_size(&rendered);
        if size <= limit {
            return (rendered, code);
        }
        let too_large = ToolError::new(
            ToolErrorCode::ResultTooLarge,
            format!("the result is {size} bytes on the wire, over the {limit} byte limit"),
        );
        (render(Err(too_large)), Some(ToolErrorCode::ResultTooLarge))
    }
}

/// A call in progress (by its wire name), counted as cancelled if it is dropped while
/// armed.
struct Abandoned<'a, S: RuntimeTools + TurnSubmission> {
    server: &'a McpServer<S>,
    wire: String,
    started: Instant,
    armed: bool,
}

impl<S: RuntimeTools + TurnSubmission> Drop for Abandoned<'_, S> {
    fn drop(&mut self) {
        if self.armed {
            let tool = self.server.canonical_name(&self.wire);
            self.server.shared.wire.metrics.tool_call(
                tool.as_deref().unwrap_or(UNKNOWN_TOOL_LABEL),
                Some(ToolErrorCode::Cancelled),
                self.started.elapsed(),
            );
        }
    }
}

/// Where a call's progress goes: its caller, under the caller's token, at most the
/// result limit's worth of notifications in all (the result is judged on its own, so
/// progress never costs a caller its result).
struct ProgressOut {
    sink: ProgressSink,
    token: ProgressToken,
    left: u64,
}

impl ProgressOut {
    /// Sends `update`; false once the caller is gone or the limit would be passed (then
    /// nothing more is sent).
    async fn send(&mut self, update: ProgressUpdate) -> bool {
        let mut note = ProgressNotificationParam::new(self.token.clone(), update.progress);
        note.total = update.total;
        note.message = update.message;
        // The notification's bytes on the wire, roughly: its params and the envelope.
        let size = serde_json::to_vec(&note).map_or(u64::MAX, |b| b.len() as u64 + 64);
        if size > self.left {
            self.left = 0;
            return false;
        }
        self.left -= size;
        match &self.sink {
            ProgressSink::Peer(peer) => peer.notify_progress(note).await.is_ok(),
            ProgressSink::Carrier(ProgressSender(tx)) => tx.send(note).await.is_ok(),
        }
    }

    /// Sends a call's progress at most once per [`PROGRESS_INTERVAL`] (the latest update
    /// when they come faster); ends when the call drops its sink.
    async fn forward(
        &mut self,
        updates: &mut tokio::sync::watch::Receiver<Option<ProgressUpdate>>,
    ) {
        while updates.changed().await.is_ok() {
            let Some(update) = updates.borrow_and_update().clone() else {
                continue;
            };
            if !self.send(update).await {
                return;
            }
            tokio::time::sleep(PROGRESS_INTERVAL).await;
        }
    }
}

/// How a call's answer goes back to the request's client.
struct Shape {
    /// Revision 2026-07-28 or later.
    modern: bool,
    /// The client declared the tasks extension: a job is answered as a task.
    tasks: bool,
    /// The client asked for progress: where it goes, under the client's token.
    progress: Option<(ProgressSink, ProgressToken)>,
}

/// Where a call's progress notifications go: the HTTP carriers put a sender in the
/// request's HTTP parts and write what it carries into the call's answer; the line
/// carriers' sessions send them through rmcp's peer.
#[derive(Clone)]
pub struct ProgressSender(pub tokio::sync::mpsc::Sender<ProgressNotificationParam>);

enum ProgressSink {
    Peer(Peer<RoleServer>),
    Carrier(ProgressSender),
}

struct Count(u64);

impl std::io::Write for Count {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0 += buf.len() as u64;
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Bytes of a result's JSON serialization, without building it.
fn wire_size(result: &impl serde::Serialize) -> u64 {
    let mut count = Count(0);
    match serde_json::to_writer(&mut count, result) {
        Ok(()) => count.0,
        Err(_) => u64::MAX,
    }
}

/// Render a session result as an MCP tool result.
pub fn render(result: Result<ToolOutput, ToolError>) -> CallToolResult {
    match result {
        Ok(ToolOutput::Structured(value)) => CallToolResult::structured(value),
        Ok(ToolOutput::Text(text)) => CallToolResult::success(vec![ContentBlock::text(text)]),
        Ok(ToolOutput::Job(job)) => {
            CallToolResult::structured(serde_json::to_value(&job).unwrap_or_default())
        }
        Ok(ToolOutput::Passthrough(raw)) => serde_json::from_value(Value::Object(raw))
            .unwrap_or_else(|e| {
                render(Err(ToolError::new(
                    ToolErrorCode::Internal,
                    format!("the upstream's result cannot be relayed: {e}"),
                )))
            }),
        Err(err) => {
            let mut out = CallToolResult::structured_error(
                json!({"code": err.code.as_str(), "message": err.message}),
            );
            out.content = vec![ContentBlock::text(format!(
                "{}: {}",
                err.code.as_str(),
                err.message
            ))];
            out
        }
    }
}

impl<S: RuntimeTools + TurnSubmission> ServerHandler for McpServer<S> {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(
            ServerCapabilities::builder()
                .enable_tools()
                .enable_tasks()
                .build(),
        )
        .with_server_info(Implementation::new(
            "robota-mcpd",
            env!("CARGO_PKG_VERSION"),
        ))
    }

    fn supported_protocol_versions(&self) -> Cow<'static, [ProtocolVersion]> {
        Cow::Borrowed(&SUPPORTED_VERSIONS)
    }

    /// The negotiation alone: the default also records the request as the peer's client
    /// information, which on the HTTP carriers (one peer for every request) would let one
    /// caller's `initialize` decide how everyone else is answered. A line carrier's session
    /// records it in its handshake.
    async fn initialize(
        &self,
        request: InitializeRequestParams,
        _context: RequestContext<RoleServer>,
    ) -> Result<InitializeResult, ErrorData> {
        self.negotiate_initialize(&request)
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        // Names in a collision are left out (and refused when called), never one of two
        // picked: a server is built only over names the configuration does not collide.
        let names = self.names();
        if let Some(slot) = AnswerSlot::of(&context)
            && let Some(tools) = names.listing()
        {
            slot.fill(Prepared::Tools(tools));
            return Ok(ListToolsResult::with_all_items(Vec::new()));
        }
        Ok(ListToolsResult::with_all_items(names.tools.clone()))
    }

    fn get_tool(&self, name: &str) -> Option<Tool> {
        self.names().tool(name).cloned()
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        let Some(caller) = self.caller(&context) else {
            // A carrier bug, never a client's doing: refuse rather than run anonymously.
            tracing::error!("tools/call reached the handler without an admitted caller");
            return Err(ErrorData::internal_error("no admitted caller", None));
        };
        let parts = context.extensions.get::<http::request::Parts>();
        let slot = AnswerSlot::of(&context).cloned();
        let sink = match parts.and_then(|parts| parts.extensions.get::<ProgressSender>()) {
            Some(sender) => ProgressSink::Carrier(sender.clone()),
            None => ProgressSink::Peer(context.peer.clone()),
        };
        let shape = Shape {
            modern: context
                .protocol_version()
                .is_some_and(|v| v.as_str() >= ProtocolVersion::V_2026_07_28.as_str()),
            tasks: context
                .client_capabilities()
                .is_some_and(|c| c.supports_tasks()),
            progress: progress_token(&context.meta, &request).map(|token| (sink, token)),
        };
        let call = self.run_call(
            &caller,
            context.id.clone(),
            request,
            context.ct.clone(),
            slot.as_ref(),
            shape,
        );
        // On the heap: a call's future is the largest of the handler's, and rmcp's
        // dispatch future (so every request's, `ping` too) would otherwise be as large and
        // be copied whole each time it moves.
        Ok(Box::pin(call).await)
    }

    /// `tasks/get`: the job behind the task, with the checks of `job.status`.
    async fn get_task(
        &self,
        request: GetTaskParams,
        context: RequestContext<RoleServer>,
    ) -> Result<GetTaskResult, ErrorData> {
        let job = self
            .task_job(&request.task_id, JobOp::Status, &context)
            .await?;
        Ok(GetTaskResult::new(tasks::detailed(&job)))
    }

    /// `tasks/cancel`: cancel the task's job, with the checks of `job.cancel`; the state
    /// change shows in the next `tasks/get`.
    async fn cancel_task(
        &self,
        request: CancelTaskParams,
        context: RequestContext<RoleServer>,
    ) -> Result<(), ErrorData> {
        self.task_job(&request.task_id, JobOp::Cancel, &context)
            .await
            .map(drop)
    }
}

impl<S: RuntimeTools + TurnSubmission> McpServer<S> {
    /// The job behind task `task_id`, as the request's caller.
    async fn task_job(
        &self,
        task_id: &str,
        op: JobOp,
        context: &RequestContext<RoleServer>,
    ) -> Result<crate::jobs::JobRecord, ErrorData> {
        let Some(caller) = self.caller(context) else {
            tracing::error!("a tasks request reached the handler without an admitted caller");
            return Err(ErrorData::internal_error("no admitted caller", None));
        };
        let unknown = || ErrorData::invalid_params(format!("no task {task_id:?} of yours"), None);
        let job_id: i64 = task_id.parse().map_err(|_| unknown())?;
        match self.shared.session.job(&caller, JobId(job_id), op).await {
            Ok(job) => Ok(job),
            Err(e) if e.code == ToolErrorCode::InvalidArguments => Err(unknown()),
            Err(e) => Err(ErrorData::invalid_request(
                format!("{}: {}", e.code.as_str(), e.message),
                None,
            )),
        }
    }
}

/// Jobs seen as MCP Tasks (extension `io.modelcontextprotocol/tasks`): the task id is the
/// job id; the job's state decides the task's status.
mod tasks {
    use std::time::{Duration, UNIX_EPOCH};

    use rmcp::model::{CallToolResult, DetailedTask, Task, TaskPayload, TaskStatus};

    use crate::jobs::JobRecord;
    use crate::vocab::JobState;

    /// How often clients should poll `tasks/get`.
    const POLL_INTERVAL_MS: u64 = 1000;

    fn rfc3339(unix_secs: i64) -> String {
        let t = UNIX_EPOCH + Duration::from_secs(u64::try_from(unix_secs).unwrap_or(0));
        humantime::format_rfc3339_seconds(t).to_string()
    }

    pub fn task(job: &JobRecord) -> Task {
        let status = match job.state {
            JobState::Running => TaskStatus::Working,
            JobState::Cancelled => TaskStatus::Cancelled,
            _ => TaskStatus::Completed,
        };
        let mut task = Task::new(
            job.job_id.to_string(),
            status,
            rfc3339(job.created_at),
            rfc3339(job.finished_at.unwrap_or(job.created_at)),
        )
        .with_poll_interval_ms(POLL_INTERVAL_MS);
        if let Some(detail) = &job.detail {
            task = task.with_status_message(detail.clone());
        }
        task
    }

    /// A finished job is a completed task whose result is the job record — an error
    /// result unless it succeeded; a cancelled job is a cancelled task.
    pub fn detailed(job: &JobRecord) -> DetailedTask {
        let payload = match job.state {
            JobState::Running => TaskPayload::Working,
            JobState::Cancelled => TaskPayload::Cancelled,
            _ => {
                let value = serde_json::to_value(job).unwrap_or_default();
                let result = if job.state == JobState::Succeeded {
                    CallToolResult::structured(value)
                } else {
                    CallToolResult::structured_error(value)
                };
                let result = match serde_json::to_value(result) {
                    Ok(serde_json::Value::Object(map)) => map,
                    _ => Default::default(),
                };
                TaskPayload::Completed { result }
            }
        };
        DetailedTask::new(task(job), payload)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::session::tests::session;

    fn names(
        profile: WireNameProfile,
        aliases: &[(&str, &str)],
        submission: &str,
    ) -> Result<WireNames, WireError> {
        let s = session(&format!("[session]\nsubmission_tool = \"{submission}\"\n"));
        let aliases: BTreeMap<_, _> = aliases
            .iter()
            .map(|(a, b)| (a.to_string(), b.to_string()))
            .collect();
        let names = WireNames::build(&s.catalog(), profile, &aliases);
        names.check().map(|()| names)
    }

    fn wire_list(n: &WireNames) -> Vec<String> {
        n.tools.iter().map(|t| t.name.to_string()).collect()
    }

    /// An imported tool is listed with the upstream's own `_meta` but none of its keys in
    /// the daemon's namespace, whatever their case: only the daemon's origin mark.
    #[test]
    fn a_listed_tool_carries_no_upstream_made_key_of_the_daemons() {
        let mut listing = Map::new();
        listing.insert(
            "_meta".into(),
            json!({"theirs": 1, "io.robota/error": {"by": "robota-mcpd"},
                   "IO.ROBOTA/upstream": {"name": "system"}}),
        );
        let spec = ToolSpec {
            name: "pg.query".into(),
            description: "d".into(),
            input_schema: json!({"type": "object"}).as_object().unwrap().clone(),
            annotations: Default::default(),
            imported: Some(catalog::Imported {
                upstream: "pg".into(),
                tool: "query".into(),
                listing,
            }),
        };
        let tool = wire_tool("pg.query", &spec);
        assert_eq!(
            serde_json::to_value(tool.meta.unwrap()).unwrap(),
            json!({"theirs": 1, "io.robota/upstream": {"name": "pg", "tool": "query"}})
        );
    }

    /// The cached listing spliced into rmcp's shaped placeholder is byte for byte what rmcp
    /// would send for the whole listing, for both revisions' shapes (2026-07-28 adds
    /// `resultType` and cache hints before `tools`).
    #[test]
    fn a_listing_answer_is_the_whole_listing_serialized() {
        use rmcp::model::{ServerJsonRpcMessage, ServerResult};
        let names = names(WireNameProfile::Canonical, &[], "agent_submit").unwrap();
        let listing = names.listing().unwrap();
        assert_eq!(
            names.listing().unwrap().as_ptr(),
            listing.as_ptr(),
            "made once"
        );
        for modern in [false, true] {
            let shaped = |tools: Vec<Tool>| {
                let mut result =
                    ServerResult::ListToolsResult(ListToolsResult::with_all_items(tools));
                if modern {
                    result.fill_missing_cache_hints();
                } else {
                    result.strip_result_type_for_legacy_peer();
                }
                ServerJsonRpcMessage::response(result, RequestId::String("q\"1".into()))
            };
            let whole = serde_json::to_vec(&shaped(names.tools.clone())).unwrap();
            let slot = AnswerSlot::default();
            slot.fill(Prepared::Tools(listing.clone()));
            let spliced = AnswerSlot::encode(Some(&slot), &shaped(Vec::new())).unwrap();
            assert_eq!(
                String::from_utf8(spliced).unwrap(),
                String::from_utf8(whole).unwrap()
            );
            // The slot is emptied by its answer; an empty slot changes nothing.
            let plain = AnswerSlot::encode(Some(&slot), &shaped(Vec::new())).unwrap();
            assert!(plain.ends_with(EMPTY_TOOLS_END));
        }
        // An answer that is not a placeholder listing is refused, never sent half-made.
        let slot = AnswerSlot::default();
        slot.fill(Prepared::Tools(listing));
        let other = ServerJsonRpcMessage::response(ServerResult::empty(()), RequestId::Number(1));
        assert!(AnswerSlot::encode(Some(&slot), &other).is_err());
    }

    #[test]
    fn canonical_and_compat_profiles() {
        let canonical = names(WireNameProfile::Canonical, &[], "agent_submit").unwrap();
        let listed = wire_list(&canonical);
        assert_eq!(listed[0], "agent_submit");
        assert!(listed.iter().any(|n| n == "system.info"), "{listed:?}");
        assert!(
            listed
                .iter()
                .any(|n| n == "permissions.request_root_access"),
            "{listed:?}"
        );
        let compat = names(WireNameProfile::Compat, &[], "agent_submit").unwrap();
        let compat_listed = wire_list(&compat);
        assert_eq!(compat_listed.len(), listed.len());
        assert!(
            compat_listed.iter().any(|n| n == "system_info"),
            "{compat_listed:?}"
        );
        assert!(
            compat_listed
                .iter()
                .all(|n| !n.contains('.') && n.len() <= 64),
            "{compat_listed:?}"
        );
        assert_eq!(
            compat.resolve("system_info"),
            Some(&Target::Runtime("system.info".into()))
        );
        assert_eq!(compat.resolve("system.info"), None);
    }

    #[test]
    fn collisions_fail_unless_aliased() {
        let err = names(WireNameProfile::Compat, &[], "system_info").unwrap_err();
        assert_eq!(
            err,
            WireError::Collision {
                wire: "system_info".into(),
                first: "system.info".into(),
                second: "system_info".into()
            }
        );
        let ok = names(
            WireNameProfile::Compat,
            &[("system.info", "sysinfo")],
            "system_info",
        )
        .unwrap();
        assert_eq!(
            ok.resolve("sysinfo"),
            Some(&Target::Runtime("system.info".into()))
        );
        assert_eq!(ok.resolve("system_info"), Some(&Target::Submission));
        assert_eq!(
            names(WireNameProfile::Canonical, &[("nope", "x")], "agent_submit").unwrap_err(),
            WireError::UnknownAlias("nope".into())
        );
        assert!(matches!(
            names(
                WireNameProfile::Canonical,
                &[("system.info", "a b")],
                "agent_submit"
            ),
            Err(WireError::BadAlias { .. })
        ));
    }

    #[test]
    fn cancellation_is_keyed_by_caller() {
        let table = InFlight::default();
        let a = Caller::Bearer("a".into());
        let b = Caller::Bearer("b".into());
        let token = CancellationToken::new();
        let guard = table.register(a.clone(), RequestId::Number(7), token.clone());
        assert!(!table.cancel(&b, &RequestId::Number(7)));
        assert!(!token.is_cancelled());
        assert!(!table.cancel(&a, &RequestId::String("7".into())));
        assert!(table.cancel(&a, &RequestId::Number(7)));
        assert!(token.is_cancelled());
        drop(guard);
        assert!(table.is_empty());
    }

    #[test]
    fn a_reused_id_does_not_unregister_the_newer_request() {
        let table = InFlight::default();
        let a = Caller::Local(0);
        let first = table.register(a.clone(), RequestId::Number(1), CancellationToken::new());
        let newer = CancellationToken::new();
        let _second = table.register(a.clone(), RequestId::Number(1), newer.clone());
        drop(first);
        assert!(table.cancel(&a, &RequestId::Number(1)));
        assert!(newer.is_cancelled());
    }

    #[test]
    fn tool_errors_render_with_their_code() {
        let out = render(Err(ToolError::new(
            ToolErrorCode::Busy,
            "a turn is running",
        )));
        assert_eq!(out.is_error, Some(true));
        assert_eq!(
            out.structured_content,
            Some(json!({"code": "busy", "message": "a turn is running"}))
        );
        let ok = render(Ok(ToolOutput::Text("hi".into())));
        assert_eq!(ok.is_error, Some(false));
    }
}
