//! The MCP face of the session: an rmcp `ServerHandler` over the two session roles, wire
//! names per carrier, and the in-flight table for cross-request cancellation.
//!
//! Invariants: protocol errors and the wire schema are rmcp's; every tool failure is a
//! visible tool error (`isError: true` with a closed-set `code`); only tools are
//! advertised. The handler is generic over a session bounded by exactly the two role
//! traits.

use std::borrow::Cow;
use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use parking_lot::Mutex;
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, CancelTaskParams, ContentBlock,
    CreateTaskResult, ErrorData, GetTaskParams, GetTaskResult, Implementation, ListToolsResult,
    PaginatedRequestParams, ProtocolVersion, RequestId, ServerCapabilities, ServerConfig, Tool,
    ToolAnnotations,
};
use rmcp::service::RequestContext;
use rmcp::{RoleServer, ServerHandler};
use serde_json::json;
use tokio_util::sync::CancellationToken;

use crate::config::WireNameProfile;
use crate::metrics::Metrics;
use crate::session::catalog::{self, ToolSpec};
use crate::session::{Caller, RuntimeTools, ToolError, ToolErrorCode, ToolOutput, TurnSubmission};

/// The protocol revisions served, oldest first.
pub const SUPPORTED_VERSIONS: [ProtocolVersion; 2] =
    [ProtocolVersion::V_2025_11_25, ProtocolVersion::V_2026_07_28];

/// Whether an `MCP-Protocol-Version` value is one we serve.
pub fn is_supported_version(value: &str) -> bool {
    SUPPORTED_VERSIONS.iter().any(|v| v.as_str() == value)
}

/// What a wire name resolves to.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Target {
    Runtime(String),
    Submission,
}

/// A carrier's mapping between wire names and canonical names.
#[derive(Debug)]
pub struct WireNames {
    targets: HashMap<String, Target>,
    tools: Vec<Tool>,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum WireError {
    #[error("tools {first:?} and {second:?} both map to the wire name {wire:?}; give one an alias")]
    Collision {
        wire: String,
        first: String,
        second: String,
    },
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
    /// Map every canonical name (runtime tools and the submission tool) to its wire name.
    pub fn build(
        runtime: &catalog::Catalog,
        submission: &ToolSpec,
        profile: WireNameProfile,
        aliases: &std::collections::BTreeMap<String, String>,
    ) -> Result<Self, WireError> {
        let known = |name: &str| runtime.get(name).is_some() || name == submission.name;
        if let Some(alias) = aliases.keys().find(|name| !known(name)) {
            return Err(WireError::UnknownAlias(alias.clone()));
        }
        let mut targets = HashMap::new();
        let mut owners: HashMap<String, String> = HashMap::new();
        let mut tools = Vec::new();
        let specs = runtime
            .specs()
            .map(|s| (s, Target::Runtime(s.name.clone())))
            .chain(std::iter::once((submission, Target::Submission)));
        for (spec, target) in specs {
            let wire = match aliases.get(&spec.name) {
                Some(alias) => {
                    catalog::check_name(alias).map_err(|problem| WireError::BadAlias {
                        canonical: spec.name.clone(),
                        wire: alias.clone(),
                        problem,
                    })?;
                    alias.clone()
                }
                None => match profile {
                    WireNameProfile::Canonical => spec.name.clone(),
                    WireNameProfile::Compat => spec.name.replace('.', "_"),
                },
            };
            match owners.entry(wire.clone()) {
                Entry::Occupied(first) => {
                    return Err(WireError::Collision {
                        wire,
                        first: first.get().clone(),
                        second: spec.name.clone(),
                    });
                }
                Entry::Vacant(slot) => {
                    slot.insert(spec.name.clone());
                }
            }
            tools.push(wire_tool(&wire, spec));
            targets.insert(wire, target);
        }
        tools.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(Self { targets, tools })
    }

    fn resolve(&self, wire: &str) -> Option<&Target> {
        self.targets.get(wire)
    }

    fn tool(&self, wire: &str) -> Option<&Tool> {
        self.tools.iter().find(|t| t.name == wire)
    }
}

fn wire_tool(wire: &str, spec: &ToolSpec) -> Tool {
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
    names: WireNames,
    inflight: Arc<InFlight>,
    wire: Wire,
    /// The caller for carriers with one fixed identity (stdio); HTTP carriers put an
    /// admitted [`Caller`] in each request's extensions instead.
    fixed_caller: Option<Caller>,
}

impl<S: RuntimeTools + TurnSubmission> McpServer<S> {
    pub fn new(
        session: Arc<S>,
        names: WireNames,
        inflight: Arc<InFlight>,
        wire: Wire,
        fixed_caller: Option<Caller>,
    ) -> Self {
        Self {
            shared: Arc::new(Shared {
                session,
                names,
                inflight,
                wire,
                fixed_caller,
            }),
        }
    }

    pub fn inflight(&self) -> &Arc<InFlight> {
        &self.shared.inflight
    }

    fn caller(&self, context: &RequestContext<RoleServer>) -> Option<Caller> {
        context
            .extensions
            .get::<http::request::Parts>()
            .and_then(|parts| parts.extensions.get::<Caller>())
            .cloned()
            .or_else(|| self.shared.fixed_caller.clone())
    }

    /// Run a call; returns the canonical name it resolved to (None: not in the catalog).
    async fn dispatch(
        &self,
        caller: &Caller,
        request: CallToolRequestParams,
        cancel: CancellationToken,
    ) -> (Option<&str>, Result<ToolOutput, ToolError>) {
        let Some(target) = self.shared.names.resolve(&request.name) else {
            let unknown = ToolError::new(
                ToolErrorCode::UnknownTool,
                format!("no tool named {:?}", request.name),
            );
            return (None, Err(unknown));
        };
        let args = request.arguments.unwrap_or_default();
        let session = &self.shared.session;
        match target {
            Target::Runtime(name) => (
                Some(name),
                session
                    .invoke_runtime_tool(caller, name, args, cancel)
                    .await,
            ),
            Target::Submission => {
                let name = session.submission_tool().name.as_str();
                let result = match catalog::submission_prompt(args) {
                    Ok(prompt) => session.submit_turn(caller, prompt, cancel).await,
                    Err(e) => Err(e),
                };
                (Some(name), result)
            }
        }
    }

    /// The rendered result, or `result_too_large` when what would go on the wire (the
    /// structured content and its text copy) is over the result limit.
    fn bounded(
        &self,
        result: Result<ToolOutput, ToolError>,
    ) -> (CallToolResult, Option<ToolErrorCode>) {
        let code = result.as_ref().err().map(|e| e.code);
        let rendered = render(result);
        let size = wire_size(&rendered);
        let limit = self.shared.wire.result_limit;
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

/// Bytes of a result's JSON serialization, without building it.
fn wire_size(result: &CallToolResult) -> u64 {
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

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        Ok(ListToolsResult::with_all_items(
            self.shared.names.tools.clone(),
        ))
    }

    fn get_tool(&self, name: &str) -> Option<Tool> {
        self.shared.names.tool(name).cloned()
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
        let started = Instant::now();
        let cancel = context.ct.clone();
        let _inflight =
            self.shared
                .inflight
                .register(caller.clone(), context.id.clone(), cancel.clone());
        let (tool, result) = self.dispatch(&caller, request, cancel).await;
        let tool = tool.unwrap_or(UNKNOWN_TOOL_LABEL);
        let metrics = &self.shared.wire.metrics;
        if let Ok(ToolOutput::Job(job)) = &result
            && context
                .client_capabilities()
                .is_some_and(|c| c.supports_tasks())
        {
            metrics.tool_call(tool, None, started.elapsed());
            return Ok(CallToolResponse::Task(CreateTaskResult::new(tasks::task(
                job,
            ))));
        }
        let (rendered, code) = self.bounded(result);
        metrics.tool_call(tool, code, started.elapsed());
        Ok(rendered.into())
    }

    /// `tasks/get`: the job behind the task, read through the canonical `job.status` tool
    /// (same store, same owner check, same policy).
    async fn get_task(
        &self,
        request: GetTaskParams,
        context: RequestContext<RoleServer>,
    ) -> Result<GetTaskResult, ErrorData> {
        let job = self
            .job_tool("job.status", &request.task_id, &context)
            .await?;
        Ok(GetTaskResult::new(tasks::detailed(&job)))
    }

    /// `tasks/cancel`: `job.cancel` on the task's job; the state change shows in the next
    /// `tasks/get`.
    async fn cancel_task(
        &self,
        request: CancelTaskParams,
        context: RequestContext<RoleServer>,
    ) -> Result<(), ErrorData> {
        self.job_tool("job.cancel", &request.task_id, &context)
            .await
            .map(drop)
    }
}

impl<S: RuntimeTools + TurnSubmission> McpServer<S> {
    /// Run a job tool for the task `task_id` as the request's caller.
    async fn job_tool(
        &self,
        tool: &str,
        task_id: &str,
        context: &RequestContext<RoleServer>,
    ) -> Result<crate::jobs::JobRecord, ErrorData> {
        let Some(caller) = self.caller(context) else {
            tracing::error!("a tasks request reached the handler without an admitted caller");
            return Err(ErrorData::internal_error("no admitted caller", None));
        };
        let unknown = || ErrorData::invalid_params(format!("no task {task_id:?} of yours"), None);
        let job_id: i64 = task_id.parse().map_err(|_| unknown())?;
        let mut args = crate::session::Args::new();
        args.insert("job_id".into(), job_id.into());
        let result = self
            .shared
            .session
            .invoke_runtime_tool(&caller, tool, args, context.ct.clone())
            .await;
        match result {
            Ok(ToolOutput::Structured(value)) => serde_json::from_value(value)
                .map_err(|_| ErrorData::internal_error("the job record could not be read", None)),
            Ok(_) => Err(ErrorData::internal_error(
                "unexpected job tool result",
                None,
            )),
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

    use crate::jobs::{JobRecord, JobState};

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
    use crate::session::catalog::submission_spec;
    use crate::session::tests::session;

    fn names(
        profile: WireNameProfile,
        aliases: &[(&str, &str)],
        submission: &str,
    ) -> Result<WireNames, WireError> {
        let s = session("");
        let aliases: BTreeMap<_, _> = aliases
            .iter()
            .map(|(a, b)| (a.to_string(), b.to_string()))
            .collect();
        WireNames::build(s.catalog(), &submission_spec(submission), profile, &aliases)
    }

    fn wire_list(n: &WireNames) -> Vec<String> {
        n.tools.iter().map(|t| t.name.to_string()).collect()
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
