//! The runtime session: the canonical tool catalog and the turn-submission entry point.
//!
//! Architecture invariant: the session knows nothing about HTTP, stdio, OAuth or MCP
//! wire names. Carriers reach it only through the two role traits below, with a
//! [`Caller`] they have already admitted and a cancellation token.

pub mod catalog;
pub mod policy;
pub mod turn;

use std::fmt;
use std::sync::Arc;

use serde_json::{Map, Value};
use tokio_util::sync::CancellationToken;

use crate::config::Config;
use crate::host::Host;
use crate::metrics::{Duplicate, Metrics};
use crate::store::IdemRecord;
pub use catalog::{Annotations, Catalog, CatalogError, ToolSpec};
pub use policy::Policy;
pub use turn::TurnBackend;

/// Tool arguments: always a JSON object.
pub type Args = Map<String, Value>;

/// The admitted identity behind a request. Policy, audit and cancellation key on it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Caller {
    /// stdio and `robota-mcpctl stdio`: the peer's uid.
    Local(u32),
    /// Loopback carrier: the bearer's label (`default` for the host bearer).
    Bearer(String),
    /// Remote carrier: OAuth client id and subject.
    OAuth { client_id: String, subject: String },
}

impl fmt::Display for Caller {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Caller::Local(uid) => write!(f, "local:{uid}"),
            Caller::Bearer(label) => write!(f, "bearer:{label}"),
            // `%` and `/` in the client id are escaped, so `oauth:a/b/c` has exactly one
            // reading (client `a`, subject `b/c`): grants, jobs and idempotency keys are
            // keyed by this text.
            Caller::OAuth { client_id, subject } => write!(
                f,
                "oauth:{}/{subject}",
                client_id.replace('%', "%25").replace('/', "%2F")
            ),
        }
    }
}

/// The closed set of visible tool errors (SPEC §2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ToolErrorCode {
    UnknownTool,
    InvalidArguments,
    PermissionDenied,
    InteractivePermissionRequired,
    Busy,
    Cancelled,
    TimedOut,
    ResultTooLarge,
    Unavailable,
    Internal,
}

impl ToolErrorCode {
    pub const ALL: [ToolErrorCode; 10] = [
        ToolErrorCode::UnknownTool,
        ToolErrorCode::InvalidArguments,
        ToolErrorCode::PermissionDenied,
        ToolErrorCode::InteractivePermissionRequired,
        ToolErrorCode::Busy,
        ToolErrorCode::Cancelled,
        ToolErrorCode::TimedOut,
        ToolErrorCode::ResultTooLarge,
        ToolErrorCode::Unavailable,
        ToolErrorCode::Internal,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            ToolErrorCode::UnknownTool => "unknown_tool",
            ToolErrorCode::InvalidArguments => "invalid_arguments",
            ToolErrorCode::PermissionDenied => "permission_denied",
            ToolErrorCode::InteractivePermissionRequired => "interactive_permission_required",
            ToolErrorCode::Busy => "busy",
            ToolErrorCode::Cancelled => "cancelled",
            ToolErrorCode::TimedOut => "timed_out",
            ToolErrorCode::ResultTooLarge => "result_too_large",
            ToolErrorCode::Unavailable => "unavailable",
            ToolErrorCode::Internal => "internal",
        }
    }
}

/// A visible tool error: a closed-set code and a short message for the caller.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolError {
    pub code: ToolErrorCode,
    pub message: String,
}

/// Longest message a visible tool error carries. Messages may quote caller input (a tool
/// name, a path, a schema violation); the cap keeps an answer from growing with it.
pub const MAX_ERROR_MESSAGE: usize = 1024;

impl ToolError {
    pub fn new(code: ToolErrorCode, message: impl Into<String>) -> Self {
        let mut message = message.into();
        if message.len() > MAX_ERROR_MESSAGE {
            let mut end = MAX_ERROR_MESSAGE;
            while !message.is_char_boundary(end) {
                end -= 1;
            }
            message.truncate(end);
            message.push('…');
        }
        Self { code, message }
    }
}

impl fmt::Display for ToolError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.code.as_str(), self.message)
    }
}

/// A successful tool result: structured data, rendered as text for clients that show text.
#[derive(Debug, Clone, PartialEq)]
pub enum ToolOutput {
    Structured(Value),
    Text(String),
    /// Long work started: a durable job handle. Structured data for every client; an MCP
    /// Task for 2026-07-28 clients that declared the Tasks extension.
    Job(crate::jobs::JobRecord),
}

/// Runtime tools role: the catalog and invocation.
pub trait RuntimeTools: Send + Sync + 'static {
    fn catalog(&self) -> &Catalog;

    fn invoke_runtime_tool(
        &self,
        caller: &Caller,
        name: &str,
        args: Args,
        cancel: CancellationToken,
    ) -> impl Future<Output = Result<ToolOutput, ToolError>> + Send;
}

/// Turn submission role: the submission extension tool.
pub trait TurnSubmission: Send + Sync + 'static {
    /// The submission tool's identity and schema.
    fn submission_tool(&self) -> &ToolSpec;

    fn submit_turn(
        &self,
        caller: &Caller,
        prompt: String,
        cancel: CancellationToken,
    ) -> impl Future<Output = Result<ToolOutput, ToolError>> + Send;
}

/// Read-only facts about the daemon that tools may report (`system.health`).
pub trait HostView: Send + Sync + 'static {
    /// Carrier name → bound address, for the carriers currently serving.
    fn carriers(&self) -> Vec<(String, String)>;
}

/// What a tool implementation gets besides its arguments.
pub struct ToolContext<'a> {
    pub caller: &'a Caller,
    pub cancel: CancellationToken,
    pub host: &'a dyn HostView,
}

/// Why a session could not be built; a configuration error, reported before serving.
#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    #[error("the catalog is invalid")]
    Catalog(#[from] CatalogError),
    #[error("the host tools cannot be built")]
    Tools(#[from] crate::tools::BuildError),
}

/// The daemon's session: first-party tools behind the permission wrapper, plus turns.
pub struct Session {
    catalog: Catalog,
    submission: ToolSpec,
    policy: Policy,
    turns: TurnBackend,
    view: Arc<dyn HostView>,
    host: Arc<Host>,
    metrics: Metrics,
}

impl Session {
    /// Build and validate the session. Fails on a file root that cannot be opened safely,
    /// an invalid catalog or a submission-tool name that collides with a runtime tool.
    pub fn new(
        config: &Config,
        view: Arc<dyn HostView>,
        host: Arc<Host>,
        metrics: Metrics,
    ) -> Result<Self, SessionError> {
        let catalog = Catalog::new(crate::tools::first_party(config, &host)?)?;
        let submission = catalog::submission_spec(&config.session.submission_tool);
        catalog.check_submission(&submission)?;
        Ok(Self {
            catalog,
            submission,
            policy: Policy::new(config.policy.clone()),
            turns: TurnBackend::new(config.session.turn.clone(), config.limits.tool_result),
            view,
            host,
            metrics,
        })
    }

    pub fn turn_active(&self) -> bool {
        self.turns.active()
    }

    fn permit(&self, caller: &Caller, spec: &ToolSpec) -> Result<(), ToolError> {
        let verdict = match self.policy.decide(
            caller,
            &spec.name,
            spec.annotations.allowed_by_default(),
        ) {
            // Policy wants a grant: an approved, unexpired one of this very caller will do.
            Err(e) if e.code == ToolErrorCode::InteractivePermissionRequired => {
                match self.host.grants.covering(caller, &spec.name) {
                    Ok(Some(grant)) => {
                        tracing::debug!(grant_id = grant.grant_id, %caller, tool = %spec.name, "allowed by grant");
                        Ok(())
                    }
                    Ok(None) => Err(e),
                    Err(store) => {
                        tracing::error!(error = %store, "cannot read grants");
                        Err(ToolError::new(
                            ToolErrorCode::Internal,
                            "the grant store failed",
                        ))
                    }
                }
            }
            other => other,
        };
        if let Err(err) = &verdict {
            self.metrics.policy_denial(&spec.name, err.code);
        }
        verdict
    }
}

impl RuntimeTools for Session {
    fn catalog(&self) -> &Catalog {
        &self.catalog
    }

    async fn invoke_runtime_tool(
        &self,
        caller: &Caller,
        name: &str,
        args: Args,
        cancel: CancellationToken,
    ) -> Result<ToolOutput, ToolError> {
        let Some(entry) = self.catalog.get(name) else {
            return Err(ToolError::new(
                ToolErrorCode::UnknownTool,
                format!("no tool named {name:?}"),
            ));
        };
        let spec = entry.spec();
        async {
            let args = catalog::validate_args(entry, args)?;
            self.permit(caller, spec)?;
            let ctx = ToolContext {
                caller,
                cancel: cancel.clone(),
                host: self.view.as_ref(),
            };
            if spec.annotations.replay_safe {
                // Not raced against the cancel token: a replay-safe write that was already
                // under way would land anyway, and its key must record what really
                // happened. (A dropped request future marks the key's outcome unknown.)
                return self
                    .replay_safe(caller, &spec.name, args, |args| entry.call(&ctx, args))
                    .await;
            }
            tokio::select! {
                biased;
                () = cancel.cancelled() => Err(ToolError::new(ToolErrorCode::Cancelled, "the call was cancelled")),
                result = entry.call(&ctx, args) => result,
            }
        }
        .await
    }
}

/// Error codes that guarantee a call had no effect: its idempotency key is released, so a
/// retry with the same key runs again. Every other outcome is kept as the key's result.
const NO_EFFECT: [ToolErrorCode; 5] = [
    ToolErrorCode::InvalidArguments,
    ToolErrorCode::PermissionDenied,
    ToolErrorCode::InteractivePermissionRequired,
    ToolErrorCode::Busy,
    ToolErrorCode::Unavailable,
];

fn encode_outcome(result: &Result<ToolOutput, ToolError>) -> String {
    let value = match result {
        Ok(ToolOutput::Structured(v)) => serde_json::json!({"structured": v}),
        Ok(ToolOutput::Text(t)) => serde_json::json!({"text": t}),
        Ok(ToolOutput::Job(job)) => serde_json::json!({"job": job}),
        Err(e) => serde_json::json!({"error": {"code": e.code.as_str(), "message": e.message}}),
    };
    value.to_string()
}

fn decode_outcome(text: &str) -> Result<ToolOutput, ToolError> {
    let corrupt = || ToolError::new(ToolErrorCode::Internal, "a stored result could not be read");
    let value: Value = serde_json::from_str(text).map_err(|_| corrupt())?;
    if let Some(v) = value.get("structured") {
        return Ok(ToolOutput::Structured(v.clone()));
    }
    if let Some(t) = value.get("text").and_then(Value::as_str) {
        return Ok(ToolOutput::Text(t.to_owned()));
    }
    if let Some(job) = value.get("job") {
        return serde_json::from_value(job.clone())
            .map(ToolOutput::Job)
            .map_err(|_| corrupt());
    }
    let code = value["error"]["code"].as_str().unwrap_or_default();
    let code = ToolErrorCode::ALL
        .into_iter()
        .find(|c| c.as_str() == code)
        .ok_or_else(corrupt)?;
    Err(ToolError::new(
        code,
        value["error"]["message"].as_str().unwrap_or_default(),
    ))
}

/// SHA-256 of the arguments without the key (serde_json maps are sorted, so the text is
/// canonical for equal arguments).
fn args_digest(args: &Args) -> String {
    use sha2::Digest;
    hex::encode(sha2::Sha256::digest(
        Value::Object(args.clone()).to_string(),
    ))
}

impl Session {
    /// Run a replay-safe tool under its idempotency key, if the caller gave one.
    async fn replay_safe<F, Fut>(
        &self,
        caller: &Caller,
        tool: &str,
        mut args: Args,
        call: F,
    ) -> Result<ToolOutput, ToolError>
    where
        F: FnOnce(Args) -> Fut,
        Fut: Future<Output = Result<ToolOutput, ToolError>>,
    {
        let Some(key) = args.remove(catalog::IDEMPOTENCY_KEY) else {
            return call(args).await;
        };
        let key = key.as_str().unwrap_or_default().to_owned();
        let digest = args_digest(&args);
        let caller_text = caller.to_string();
        let store = &self.host.store;
        let internal = |e: crate::store::StoreError| {
            tracing::error!(error = %e, "idempotency store failure");
            ToolError::new(ToolErrorCode::Internal, "the idempotency store failed")
        };
        let mismatch = || {
            ToolError::new(
                ToolErrorCode::InvalidArguments,
                "this idempotency key was first used with different arguments; use a new key for a different call",
            )
        };
        match store
            .idem_reserve(&caller_text, tool, &key, &digest)
            .map_err(internal)?
        {
            IdemRecord::Reserved => {}
            IdemRecord::Done { args_sha256, .. }
            | IdemRecord::InProgress { args_sha256 }
            | IdemRecord::Unknown { args_sha256 }
                if args_sha256 != digest =>
            {
                self.metrics.duplicate(tool, Duplicate::Mismatch);
                return Err(mismatch());
            }
            IdemRecord::Done { result, .. } => {
                tracing::debug!(%caller, tool, "replayed a result by idempotency key");
                self.metrics.duplicate(tool, Duplicate::Replayed);
                return decode_outcome(&result);
            }
            IdemRecord::InProgress { .. } => {
                self.metrics.duplicate(tool, Duplicate::InProgress);
                return Err(ToolError::new(
                    ToolErrorCode::Busy,
                    "a call with this idempotency key is still running; retry later for its result",
                ));
            }
            IdemRecord::Unknown { .. } => {
                self.metrics.duplicate(tool, Duplicate::OutcomeUnknown);
                return Err(ToolError::new(
                    ToolErrorCode::Internal,
                    "outcome unknown: the first call with this idempotency key was cut off by a daemon restart; check the target and retry with a new key",
                ));
            }
        }
        let mut interrupted = Interrupted {
            store,
            key: Some((caller_text.clone(), tool.to_owned(), key.clone())),
        };
        let result = call(args).await;
        interrupted.key = None;
        let kept = match &result {
            Err(e) if NO_EFFECT.contains(&e.code) => store.idem_release(&caller_text, tool, &key),
            outcome => store.idem_finish(&caller_text, tool, &key, &encode_outcome(outcome)),
        };
        if let Err(e) = kept {
            tracing::error!(error = %e, "cannot record an idempotent call's outcome");
        }
        result
    }
}

/// Marks a reserved idempotency key's outcome unknown if the call's future is dropped
/// before it finished (the client went away mid-call; the effect may still land).
struct Interrupted<'a> {
    store: &'a crate::store::Store,
    key: Option<(String, String, String)>,
}

impl Drop for Interrupted<'_> {
    fn drop(&mut self) {
        if let Some((caller, tool, key)) = self.key.take()
            && let Err(e) = self.store.idem_mark_unknown(&caller, &tool, &key)
        {
            tracing::error!(error = %e, "cannot mark an interrupted call's key");
        }
    }
}

impl TurnSubmission for Session {
    fn submission_tool(&self) -> &ToolSpec {
        &self.submission
    }

    async fn submit_turn(
        &self,
        caller: &Caller,
        prompt: String,
        cancel: CancellationToken,
    ) -> Result<ToolOutput, ToolError> {
        self.permit(caller, &self.submission)?;
        self.turns
            .run(caller, prompt, cancel, || self.metrics.turn_started())
            .await
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::config::{Environment, parse};

    pub(crate) struct NoCarriers;
    impl HostView for NoCarriers {
        fn carriers(&self) -> Vec<(String, String)> {
            Vec::new()
        }
    }

    pub(crate) fn session(extra_config: &str) -> Session {
        let env = Environment {
            runtime_directory: Some("/run/robota-mcpd".into()),
            state_directory: Some("/var/lib/robota-mcpd".into()),
            ..Environment::default()
        };
        let config = parse(extra_config, &env).expect("test config");
        let host = Host::detached(&config).expect("host");
        Session::new(&config, Arc::new(NoCarriers), host, Metrics::new()).expect("session")
    }

    fn args(v: Value) -> Args {
        v.as_object().cloned().unwrap()
    }

    #[tokio::test]
    async fn read_only_tools_are_allowed_by_default() {
        let s = session("");
        let out = s
            .invoke_runtime_tool(
                &Caller::Bearer("default".into()),
                "system.info",
                Args::new(),
                CancellationToken::new(),
            )
            .await
            .unwrap();
        let ToolOutput::Structured(v) = out else {
            panic!("structured expected")
        };
        assert!(v["hostname"].as_str().is_some_and(|h| !h.is_empty()));
        assert_eq!(v["daemon_version"], env!("CARGO_PKG_VERSION"));
    }

    #[tokio::test]
    async fn unknown_tools_and_bad_arguments_are_visible_errors() {
        let s = session("");
        let caller = Caller::Local(0);
        let err = s
            .invoke_runtime_tool(
                &caller,
                "system.nope",
                Args::new(),
                CancellationToken::new(),
            )
            .await
            .unwrap_err();
        assert_eq!(err.code, ToolErrorCode::UnknownTool);
        let err = s
            .invoke_runtime_tool(
                &caller,
                "system.info",
                args(serde_json::json!({"x": 1})),
                CancellationToken::new(),
            )
            .await
            .unwrap_err();
        assert_eq!(err.code, ToolErrorCode::InvalidArguments);
    }

    #[tokio::test]
    async fn submission_is_denied_by_default_and_unavailable_without_backend() {
        let s = session("");
        let caller = Caller::Bearer("default".into());
        let err = s
            .submit_turn(&caller, "hi".into(), CancellationToken::new())
            .await
            .unwrap_err();
        assert_eq!(err.code, ToolErrorCode::PermissionDenied);
        let s = session(
            "[[policy]]\ncallers = [\"bearer:*\"]\ntools = [\"agent_submit\"]\ndecision = \"allow\"\n",
        );
        let err = s
            .submit_turn(&caller, "hi".into(), CancellationToken::new())
            .await
            .unwrap_err();
        assert_eq!(err.code, ToolErrorCode::Unavailable);
    }

    #[tokio::test]
    async fn results_over_the_limit_are_refused_not_truncated() {
        let s = session(
            "[limits]\ntool_result = \"10\"\n[[policy]]\ncallers = [\"*\"]\ntools = [\"agent_submit\"]\ndecision = \"allow\"\n\
             [session.turn]\nargv = [\"/bin/cat\"]\n",
        );
        let ok = s
            .submit_turn(
                &Caller::Local(0),
                "0123456789".into(),
                CancellationToken::new(),
            )
            .await
            .unwrap();
        assert_eq!(ok, ToolOutput::Text("0123456789".into()));
        let err = s
            .submit_turn(
                &Caller::Local(0),
                "0123456789A".into(),
                CancellationToken::new(),
            )
            .await
            .unwrap_err();
        assert_eq!(err.code, ToolErrorCode::ResultTooLarge);
    }

    #[tokio::test]
    async fn error_messages_quoting_caller_input_are_capped() {
        let s = session("");
        let name = "\u{e9}".repeat(300 * 1024);
        let err = s
            .invoke_runtime_tool(
                &Caller::Local(0),
                &name,
                Args::new(),
                CancellationToken::new(),
            )
            .await
            .unwrap_err();
        assert_eq!(err.code, ToolErrorCode::UnknownTool);
        assert!(
            err.message.len() <= MAX_ERROR_MESSAGE + '…'.len_utf8(),
            "{}",
            err.message.len()
        );
        assert!(err.message.ends_with('…'));
        let err = s
            .invoke_runtime_tool(
                &Caller::Local(0),
                "system.info",
                args(serde_json::json!({"\"".repeat(100_000): 1})),
                CancellationToken::new(),
            )
            .await
            .unwrap_err();
        assert_eq!(err.code, ToolErrorCode::InvalidArguments);
        assert!(err.message.len() <= MAX_ERROR_MESSAGE + '…'.len_utf8());
    }

    #[test]
    fn caller_identities_render_as_the_spec_writes_them() {
        assert_eq!(Caller::Local(1000).to_string(), "local:1000");
        assert_eq!(
            Caller::Bearer("default".into()).to_string(),
            "bearer:default"
        );
        let c = Caller::OAuth {
            client_id: "client-a".into(),
            subject: "alice".into(),
        };
        assert_eq!(c.to_string(), "oauth:client-a/alice");
        // A `/` in the client id cannot make two principals one identity.
        let a = Caller::OAuth {
            client_id: "a/b".into(),
            subject: "c".into(),
        };
        let b = Caller::OAuth {
            client_id: "a".into(),
            subject: "b/c".into(),
        };
        assert_ne!(a.to_string(), b.to_string());
        assert_eq!(a.to_string(), "oauth:a%2Fb/c");
    }
}
