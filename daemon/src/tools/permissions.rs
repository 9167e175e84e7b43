//! `permissions.*`: a caller asks for, lists and gives back its own grants. Operators
//! decide with `robota-mcpctl grants`.

use std::sync::Arc;
use std::time::Duration;

use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::json;

use super::{internal, invalid};
use crate::catalog::{Annotations, HostTool, NoArgs, ToolFuture, ToolSpec, TypedTool};
use crate::catalog::{ToolContext, ToolError, ToolOutput};
use crate::grants::{GrantKind, Grants, MAX_REASON, MAX_SCOPE};
use crate::host::Host;
use crate::vocab::{Caller, GrantId};

/// A request's duration when the caller names none.
const DEFAULT_DURATION: Duration = Duration::from_secs(3600);

pub fn tools(host: &Arc<Host>) -> Vec<Arc<dyn HostTool>> {
    let g = &host.grants;
    vec![
        Arc::new(RootAccess(Arc::clone(g))),
        Arc::new(Elevation(Arc::clone(g))),
        Arc::new(List(Arc::clone(g))),
        Arc::new(Revoke(Arc::clone(g))),
    ]
}

const SELF_SERVICE: Annotations = Annotations {
    read_only: false,
    destructive: false,
    idempotent: false,
    self_service: true,
    replay_safe: false,
};

fn structured<T: serde::Serialize>(value: &T) -> Result<ToolOutput, ToolError> {
    serde_json::to_value(value)
        .map(ToolOutput::Structured)
        .map_err(|e| internal("encoding the grant", e))
}

/// `permissions.request_root_access` arguments.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct RootAccessArgs {
    /// Why you need it; the operator reads this.
    #[schemars(length(min = 1, max = MAX_REASON))]
    reason: String,
    /// Canonical tool names or patterns the grant should cover (default: every tool that policy puts behind a grant).
    #[schemars(length(min = 1, max = MAX_SCOPE), inner(regex(pattern = r"^[A-Za-z0-9_.*-]{1,64}$")))]
    scope: Option<Vec<String>>,
    /// How long, e.g. "30m" or "2h".
    duration: Option<String>,
}

/// `permissions.request_elevation` arguments: as for root access, with a scope required.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct ElevationArgs {
    /// Why you need it; the operator reads this.
    #[schemars(length(min = 1, max = MAX_REASON))]
    reason: String,
    /// Canonical tool names or patterns the grant should cover.
    #[schemars(length(min = 1, max = MAX_SCOPE), inner(regex(pattern = r"^[A-Za-z0-9_.*-]{1,64}$")))]
    scope: Vec<String>,
    /// How long, e.g. "30m" or "2h".
    duration: Option<String>,
}

fn max_duration(grants: &Grants) -> String {
    humantime::format_duration(grants.max_duration()).to_string()
}

/// Files a pending request; the answer tells the caller what happens next.
fn request(
    grants: &Grants,
    caller: &Caller,
    kind: GrantKind,
    reason: &str,
    scope: Vec<String>,
    duration: Option<&str>,
) -> Result<ToolOutput, ToolError> {
    let duration = match duration {
        Some(text) => humantime::parse_duration(text)
            .map_err(|e| invalid(format!("duration {text:?}: {e}")))?,
        None => DEFAULT_DURATION.min(grants.max_duration()),
    };
    let grant = grants.request(caller, kind, reason, scope, duration)?;
    let mut out = serde_json::to_value(&grant).map_err(|e| internal("encoding the grant", e))?;
    out["next"] = json!(format!(
        "an operator approves it with `robota-mcpctl grants approve {}`; check with permissions.list_root_access",
        grant.grant_id
    ));
    Ok(ToolOutput::Structured(out))
}

struct RootAccess(Arc<Grants>);

impl TypedTool for RootAccess {
    type Args = RootAccessArgs;

    fn spec(&self) -> ToolSpec {
        ToolSpec::typed::<Self::Args>(
            "permissions.request_root_access",
            format!(
                "Ask an operator for root access: a grant covering every tool that policy puts behind a grant (or the tools named in scope), for a limited time (default 1h, at most {}). Returns a pending grant; calls it covers succeed once an operator approves it.",
                max_duration(&self.0)
            ),
            SELF_SERVICE,
        )
    }

    fn run<'a>(&'a self, ctx: &'a ToolContext<'a>, args: RootAccessArgs) -> ToolFuture<'a> {
        Box::pin(async move {
            let scope = args.scope.unwrap_or_else(|| vec!["*".into()]);
            request(
                &self.0,
                ctx.caller,
                GrantKind::RootAccess,
                &args.reason,
                scope,
                args.duration.as_deref(),
            )
        })
    }
}

struct Elevation(Arc<Grants>);

impl TypedTool for Elevation {
    type Args = ElevationArgs;

    fn spec(&self) -> ToolSpec {
        ToolSpec::typed::<Self::Args>(
            "permissions.request_elevation",
            format!(
                "Ask an operator for a grant covering the tools named in scope (patterns like \"file.write\" or \"service.*\") for a limited time (default 1h, at most {}). Returns a pending grant; calls it covers succeed once an operator approves it.",
                max_duration(&self.0)
            ),
            SELF_SERVICE,
        )
    }

    fn run<'a>(&'a self, ctx: &'a ToolContext<'a>, args: ElevationArgs) -> ToolFuture<'a> {
        Box::pin(async move {
            request(
                &self.0,
                ctx.caller,
                GrantKind::Elevation,
                &args.reason,
                args.scope,
                args.duration.as_deref(),
            )
        })
    }
}

struct List(Arc<Grants>);

impl TypedTool for List {
    type Args = NoArgs;

    fn spec(&self) -> ToolSpec {
        ToolSpec::typed::<Self::Args>(
            "permissions.list_root_access",
            "Your grants, newest first: pending, approved (with expiry), denied, revoked and expired.",
            Annotations::READ_ONLY,
        )
    }

    fn run<'a>(&'a self, ctx: &'a ToolContext<'a>, _args: NoArgs) -> ToolFuture<'a> {
        Box::pin(async move {
            let grants = self
                .0
                .list(Some(&ctx.caller.to_string()), false)
                .map_err(|e| internal("reading grants", e))?;
            structured(&json!({"grants": grants}))
        })
    }
}

/// `permissions.revoke_root_access` arguments.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct RevokeArgs {
    /// The grant to give back (its grant_id).
    #[schemars(range(min = 1))]
    grant_id: i64,
}

struct Revoke(Arc<Grants>);

impl TypedTool for Revoke {
    type Args = RevokeArgs;

    fn spec(&self) -> ToolSpec {
        ToolSpec::typed::<Self::Args>(
            "permissions.revoke_root_access",
            "Give back one of your grants (pending or approved) before it expires.",
            SELF_SERVICE,
        )
    }

    fn run<'a>(&'a self, ctx: &'a ToolContext<'a>, args: RevokeArgs) -> ToolFuture<'a> {
        Box::pin(async move { structured(&self.0.revoke_own(ctx.caller, GrantId(args.grant_id))?) })
    }
}
