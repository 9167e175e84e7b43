//! The runtime session: the two roles MCP sees — runtime tools (the catalog and
//! invocation) and turn submission — over the parts it is handed: the catalog, policy,
//! turns, grants, jobs, idempotency.
//!
//! Architecture invariant: the session knows nothing about HTTP, stdio, OAuth or MCP
//! wire names, and does not build its tools. Carriers reach it only through the two role
//! traits below, with a caller they have already admitted ([`Admitted`]: the [`Caller`]
//! and, on the remote carrier, its token's scopes) and a cancellation token.

mod idempotency;
pub mod policy;
pub mod turn;

use std::sync::Arc;

use tokio_util::sync::CancellationToken;

use crate::catalog::{
    Args, Catalog, HostView, Lookup, Progress, Snapshot, ToolContext, ToolError, ToolOutput,
    ToolSpec,
};
use crate::config::Decision;
use crate::grants::{CallApproval, GrantError, Grants};
use crate::jobs::{JobRecord, Jobs};
use crate::metrics::Metrics;
use crate::vocab::{Admitted, JobId, ToolErrorCode};
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

    /// The error for a name no tool answers to (`unknown_tool`, or `unavailable` in the
    /// namespace of an upstream whose tools are not known now).
    fn unknown_tool(&self, name: &str) -> ToolError;

    fn invoke_runtime_tool(
        &self,
        caller: &Admitted,
        name: &str,
        args: Args,
        cancel: CancellationToken,
        progress: Progress,
    ) -> impl Future<Output = Result<ToolOutput, ToolError>> + Send;

    /// The durable job behind an MCP task, read or cancelled with the checks of the job
    /// tools themselves (policy for `job.status` / `job.cancel`, then the owner).
    fn job(
        &self,
        caller: &Admitted,
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
        caller: &Admitted,
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

    /// The permission wrapper: policy's decision for this call, with the covering grant
    /// (`grant`) or an approval of exactly this call (`approve-each`, bound to `args`)
    /// looked up. Every refusal is counted.
    /// Returns the approval of one call it used, if any, so a call that proves it had no
    /// effect (its arguments refused by the tool) gives it back.
    fn permit(
        &self,
        admitted: &Admitted,
        spec: &ToolSpec,
        args: &Args,
    ) -> Result<Option<i64>, ToolError> {
        let caller = &admitted.caller;
        let tool = spec.name.as_str();
        let verdict = match self.policy.decide(
            admitted,
            tool,
            spec.annotations.allowed_by_default(),
        ) {
            Decision::Allow => Ok(None),
            Decision::Deny => Err(policy::denied(caller, tool)),
            // An approved, unexpired grant of this very caller will do.
            Decision::Grant => match self.grants.covering(caller, tool) {
                Ok(Some(grant)) => {
                    tracing::debug!(grant_id = grant.grant_id, %caller, tool, "allowed by grant");
                    Ok(None)
                }
                Ok(None) => Err(policy::needs_grant(caller, tool)),
                Err(store) => Err(ToolError::store(&store, "grant store")),
            },
            // An approval of exactly this call, used now.
            Decision::ApproveEach => {
                let arguments = serde_json::Value::Object(args.clone());
                match self.grants.approve_each(caller, tool, &arguments) {
                    Ok(CallApproval::Used(grant)) => {
                        tracing::info!(grant_id = grant.grant_id, %caller, tool, "allowed by an approval of this call");
                        Ok(Some(grant.grant_id))
                    }
                    Ok(CallApproval::Pending(grant)) => {
                        Err(policy::needs_approval(tool, grant.grant_id))
                    }
                    Err(GrantError::Invalid(why)) => Err(ToolError::new(
                        ToolErrorCode::PermissionDenied,
                        format!(
                            "{tool} needs an operator's approval of each call, and this one cannot be approved: {why}"
                        ),
                    )),
                    Err(e @ GrantError::TooMany { .. }) => {
                        Err(ToolError::new(ToolErrorCode::Busy, e.to_string()))
                    }
                    Err(GrantError::Store(store)) => Err(ToolError::store(&store, "grant store")),
                    Err(e) => {
                        tracing::error!(error = %crate::error_chain(&e), "cannot record an approval request");
                        Err(ToolError::new(
                            ToolErrorCode::Internal,
                            "the grant store failed",
                        ))
                    }
                }
            }
        };
        if let Err(err) = &verdict {
            self.metrics.policy_denial(tool, err.code);
        }
        verdict
    }
}

impl RuntimeTools for Session {
    fn catalog(&self) -> Arc<Snapshot> {
        self.catalog.snapshot()
    }

    fn unknown_tool(&self, name: &str) -> ToolError {
        self.catalog.unknown(name)
    }

    async fn invoke_runtime_tool(
        &self,
        admitted: &Admitted,
        name: &str,
        args: Args,
        cancel: CancellationToken,
        progress: Progress,
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
            Lookup::Missing => return Err(self.catalog.unknown(name)),
        };
        let spec = entry.spec();
        let args = crate::catalog::validate_args(entry, args)?;
        let approval = self.permit(admitted, spec, &args)?;
        let caller = &admitted.caller;
        let ctx = ToolContext {
            caller,
            cancel: cancel.clone(),
            progress,
            host: self.view.as_ref(),
        };
        let result = if spec.annotations.replay_safe {
            // Not raced against the cancel token: a replay-safe write that was already
            // under way would land anyway, and its key must record what really happened.
            // (A dropped request future marks the key's outcome unknown.)
            self.idempotency
                .run(caller, &spec.name, args, |args| entry.call(&ctx, args))
                .await
        } else {
            tokio::select! {
                biased;
                () = cancel.cancelled() => Err(ToolError::new(ToolErrorCode::Cancelled, "the call was cancelled")),
                result = entry.call(&ctx, args) => result,
            }
        };
        // Arguments the tool refused prove the call had no effect: the approval of it is
        // not spent on a call that could never run.
        if let (Some(grant_id), Err(e)) = (approval, &result)
            && e.code == ToolErrorCode::InvalidArguments
        {
            match self.grants.give_back(grant_id) {
                Ok(true) => tracing::info!(
                    grant_id,
                    "the approval is unused again: the call's arguments were refused"
                ),
                Ok(false) => {}
                Err(e) => tracing::error!(grant_id, error = %e, "cannot give an approval back"),
            }
        }
        result
    }

    async fn job(
        &self,
        admitted: &Admitted,
        job: JobId,
        op: JobOp,
    ) -> Result<JobRecord, ToolError> {
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
        // The arguments the job tool itself would be called with.
        let mut args = Args::new();
        args.insert("job_id".into(), job.0.into());
        self.permit(admitted, entry.spec(), &args)?;
        let caller = &admitted.caller;
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
        admitted: &Admitted,
        prompt: String,
        cancel: CancellationToken,
    ) -> Result<ToolOutput, ToolError> {
        let mut args = Args::new();
        args.insert("prompt".into(), prompt.into());
        self.permit(admitted, &self.submission, &args)?;
        let Some(serde_json::Value::String(prompt)) = args.remove("prompt") else {
            unreachable!("inserted above")
        };
        self.turns
            .run(&admitted.caller, prompt, cancel, || {
                self.metrics.turn_started()
            })
            .await
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use serde_json::Value;

    use super::*;
    use crate::catalog::MAX_ERROR_MESSAGE;
    use crate::config::{Environment, parse};
    use crate::vocab::Caller;

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
                &Caller::Bearer("default".into()).into(),
                "system.info",
                Args::new(),
                CancellationToken::new(),
                Default::default(),
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
        let caller: Admitted = Caller::Local(0).into();
        let err = s
            .invoke_runtime_tool(
                &caller,
                "system.nope",
                Args::new(),
                CancellationToken::new(),
                Default::default(),
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
                Default::default(),
            )
            .await
            .unwrap_err();
        assert_eq!(err.code, ToolErrorCode::InvalidArguments);
    }

    #[tokio::test]
    async fn submission_is_denied_by_default_and_unavailable_without_backend() {
        let s = session("");
        let caller: Admitted = Caller::Bearer("default".into()).into();
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
                &Caller::Local(0).into(),
                "0123456789".into(),
                CancellationToken::new(),
            )
            .await
            .unwrap();
        assert_eq!(ok, ToolOutput::Text("0123456789".into()));
        let err = s
            .submit_turn(
                &Caller::Local(0).into(),
                "0123456789A".into(),
                CancellationToken::new(),
            )
            .await
            .unwrap_err();
        assert_eq!(err.code, ToolErrorCode::ResultTooLarge);
    }

    /// The approval id a refusal names (`approval N is pending`).
    fn approval_id(err: &ToolError) -> i64 {
        assert_eq!(
            err.code,
            ToolErrorCode::InteractivePermissionRequired,
            "{err}"
        );
        err.message
            .split("approval ")
            .skip(1)
            .find_map(|rest| rest.split(' ').next()?.parse().ok())
            .unwrap_or_else(|| panic!("no approval id in {err}"))
    }

    #[tokio::test]
    async fn approve_each_runs_the_identical_call_once_after_approval() {
        let s = session(
            "[[policy]]\ncallers = [\"*\"]\ntools = [\"agent_submit\"]\ndecision = \"approve-each\"\n\
             [session.turn]\nargv = [\"/bin/cat\"]\n",
        );
        let caller: Admitted = Caller::Bearer("ci".into()).into();
        let ask = |prompt: &str| s.submit_turn(&caller, prompt.into(), CancellationToken::new());
        let first = ask("deploy v2").await.unwrap_err();
        let id = approval_id(&first);
        assert!(
            first.message.contains("robota-mcpctl grants show"),
            "{first}"
        );
        // Until an operator approves, the same call finds the same request.
        assert_eq!(approval_id(&ask("deploy v2").await.unwrap_err()), id);
        s.grants.approve(id, "local:0", None).unwrap();
        // Other arguments are another call.
        assert_ne!(approval_id(&ask("deploy v3").await.unwrap_err()), id);
        assert_eq!(
            ask("deploy v2").await.unwrap(),
            ToolOutput::Text("deploy v2".into())
        );
        // Used: the next identical call needs a new approval.
        assert_ne!(approval_id(&ask("deploy v2").await.unwrap_err()), id);
        // Another caller never uses this caller's approval.
        let other: Admitted = Caller::Bearer("other".into()).into();
        let theirs = approval_id(
            &s.submit_turn(&other, "x".into(), CancellationToken::new())
                .await
                .unwrap_err(),
        );
        s.grants.approve(theirs, "local:0", None).unwrap();
        assert!(ask("x").await.is_err());
    }

    #[tokio::test]
    async fn scope_rules_apply_only_to_callers_with_a_token() {
        let s = session(
            "[[policy]]\ncallers = [\"*\"]\nscopes = [\"mcp:admin\"]\ntools = [\"system.*\"]\ndecision = \"deny\"\n",
        );
        let alice = Caller::OAuth {
            client_id: "c".into(),
            subject: "alice".into(),
        };
        let s = &s;
        let call = |who: Admitted| async move {
            s.invoke_runtime_tool(
                &who,
                "system.info",
                Args::new(),
                CancellationToken::new(),
                Default::default(),
            )
            .await
            .map(drop)
            .map_err(|e| e.code)
        };
        assert_eq!(
            call(Admitted::with_token(
                alice.clone(),
                vec!["mcp:admin".into()]
            ))
            .await,
            Err(ToolErrorCode::PermissionDenied)
        );
        assert_eq!(
            call(Admitted::with_token(alice.clone(), vec![])).await,
            Ok(())
        );
        assert_eq!(call(Caller::Local(0).into()).await, Ok(()));
        assert_eq!(call(alice.into()).await, Ok(()));
    }

    #[tokio::test]
    async fn error_messages_quoting_caller_input_are_capped() {
        let s = session("");
        let name = "\u{e9}".repeat(300 * 1024);
        let err = s
            .invoke_runtime_tool(
                &Caller::Local(0).into(),
                &name,
                Args::new(),
                CancellationToken::new(),
                Default::default(),
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
                &Caller::Local(0).into(),
                "system.info",
                args(serde_json::json!({"\"".repeat(100_000): 1})),
                CancellationToken::new(),
                Default::default(),
            )
            .await
            .unwrap_err();
        assert_eq!(err.code, ToolErrorCode::InvalidArguments);
        assert!(err.message.len() <= MAX_ERROR_MESSAGE + '…'.len_utf8());
    }
}
