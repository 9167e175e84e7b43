//! The runtime session: the two roles MCP sees — runtime tools (the catalog and
//! invocation) and turn submission — over the parts it is handed: the catalog, policy,
//! turns, grants, jobs, idempotency.
//!
//! Architecture invariant: the session knows nothing about HTTP, stdio, OAuth or MCP
//! wire names, and does not build its tools. Carriers reach it only through the two role
//! traits below, with a [`Caller`] they have already admitted and a cancellation token.

mod idempotency;
pub mod policy;
pub mod turn;

use std::sync::Arc;

use tokio_util::sync::CancellationToken;

use crate::catalog::{
    Args, Catalog, HostView, Lookup, Snapshot, ToolContext, ToolError, ToolOutput, ToolSpec,
};
use crate::grants::Grants;
use crate::jobs::{JobRecord, Jobs};
use crate::metrics::Metrics;
use crate::vocab::{Caller, JobId, ToolErrorCode};
pub use idempotency::Idempotency;
pub use policy::Policy;
pub use turn::TurnBackend;

/// What `tasks/get` and `tasks/cancel` do to the job behind a task.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JobOp {
    /// As `job.status`.
    Status,
    /// As `job.cancel`.
    Cancel,
}

/// Runtime tools role: the catalog and invocation.
pub trait RuntimeTools: Send + Sync + 'static {
    /// The catalog as it is now; a request keeps the snapshot it took.
    fn catalog(&self) -> Arc<Snapshot>;

    fn invoke_runtime_tool(
        &self,
        caller: &Caller,
        name: &str,
        args: Args,
        cancel: CancellationToken,
    ) -> impl Future<Output = Result<ToolOutput, ToolError>> + Send;

    /// The durable job behind an MCP task, read or cancelled with the checks of the job
    /// tools themselves (policy for `job.status` / `job.cancel`, then the owner).
    fn job(
        &self,
        caller: &Caller,
        job: JobId,
        op: JobOp,
    ) -> impl Future<Output = Result<JobRecord, ToolError>> + Send;
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

/// What a session is made of.
pub struct Parts {
    pub catalog: Arc<Catalog>,
    pub policy: Policy,
    pub turns: TurnBackend,
    pub grants: Arc<Grants>,
    pub jobs: Arc<Jobs>,
    pub idempotency: Idempotency,
    pub metrics: Metrics,
    pub view: Arc<dyn HostView>,
}

/// The daemon's session: the catalog's tools behind the permission wrapper, plus turns.
pub struct Session {
    catalog: Arc<Catalog>,
    submission: ToolSpec,
    policy: Policy,
    turns: TurnBackend,
    grants: Arc<Grants>,
    jobs: Arc<Jobs>,
    idempotency: Idempotency,
    metrics: Metrics,
    view: Arc<dyn HostView>,
}

impl Session {
    pub fn new(parts: Parts) -> Self {
        let Parts {
            catalog,
            policy,
            turns,
            grants,
            jobs,
            idempotency,
            metrics,
            view,
        } = parts;
        Self {
            submission: catalog.snapshot().submission().clone(),
            catalog,
            policy,
            turns,
            grants,
            jobs,
            idempotency,
            metrics,
            view,
        }
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
                match self.grants.covering(caller, &spec.name) {
                    Ok(Some(grant)) => {
                        tracing::debug!(grant_id = grant.grant_id, %caller, tool = %spec.name, "allowed by grant");
                        Ok(())
                    }
                    Ok(None) => Err(e),
                    Err(store) => Err(ToolError::store(&store, "grant store")),
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
    fn catalog(&self) -> Arc<Snapshot> {
        self.catalog.snapshot()
    }

    async fn invoke_runtime_tool(
        &self,
        caller: &Caller,
        name: &str,
        args: Args,
        cancel: CancellationToken,
    ) -> Result<ToolOutput, ToolError> {
        let snapshot = self.catalog.snapshot();
        let entry = match snapshot.lookup(name) {
            Lookup::Found(entry) => entry,
            Lookup::Conflict(sources) => {
                return Err(ToolError::new(
                    ToolErrorCode::Unavailable,
                    format!(
                        "{name:?} is offered by {}; it is not served until an alias resolves the collision",
                        sources.join(" and ")
                    ),
                ));
            }
            Lookup::Missing => {
                return Err(ToolError::new(
                    ToolErrorCode::UnknownTool,
                    format!("no tool named {name:?}"),
                ));
            }
        };
        let spec = entry.spec();
        let args = crate::catalog::validate_args(entry, args)?;
        self.permit(caller, spec)?;
        let ctx = ToolContext {
            caller,
            cancel: cancel.clone(),
            host: self.view.as_ref(),
        };
        if spec.annotations.replay_safe {
            // Not raced against the cancel token: a replay-safe write that was already
            // under way would land anyway, and its key must record what really happened.
            // (A dropped request future marks the key's outcome unknown.)
            return self
                .idempotency
                .run(caller, &spec.name, args, |args| entry.call(&ctx, args))
                .await;
        }
        tokio::select! {
            biased;
            () = cancel.cancelled() => Err(ToolError::new(ToolErrorCode::Cancelled, "the call was cancelled")),
            result = entry.call(&ctx, args) => result,
        }
    }

    async fn job(&self, caller: &Caller, job: JobId, op: JobOp) -> Result<JobRecord, ToolError> {
        let tool = match op {
            JobOp::Status => "job.status",
            JobOp::Cancel => "job.cancel",
        };
        let snapshot = self.catalog.snapshot();
        let Some(entry) = snapshot.get(tool) else {
            return Err(ToolError::new(
                ToolErrorCode::Unavailable,
                format!("{tool} is not in the catalog"),
            ));
        };
        self.permit(caller, entry.spec())?;
        let record = match op {
            JobOp::Status => self.jobs.visible(Some(caller), job),
            JobOp::Cancel => self.jobs.cancel(Some(caller), job),
        };
        record.map_err(ToolError::from)
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
    use serde_json::Value;

    use super::*;
    use crate::catalog::MAX_ERROR_MESSAGE;
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
        let host = crate::host::Host::detached(&config).expect("host");
        let tools = crate::tools::first_party(&config, &host).expect("tools");
        let catalog = Catalog::new(
            vec![Arc::new(crate::catalog::Fixed::new("first-party", tools))],
            crate::catalog::submission_spec(&config.session.submission_tool),
        )
        .expect("catalog");
        Session::new(Parts {
            catalog: Arc::new(catalog),
            policy: Policy::new(config.policy.clone()),
            turns: TurnBackend::new(config.session.turn.clone(), config.limits.tool_result),
            grants: host.grants.clone(),
            jobs: host.jobs.clone(),
            idempotency: Idempotency::new(host.store.clone(), Metrics::new()),
            metrics: Metrics::new(),
            view: Arc::new(NoCarriers),
        })
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
}
