//! `permissions.*`: a caller asks for, lists and gives back its own grants. Operators
//! decide with `robota-mcpctl grants`.

use std::sync::Arc;
use std::time::Duration;

use serde_json::{Value, json};

use super::{arg_str, invalid, schema};
use crate::grants::{GrantKind, Grants};
use crate::host::Host;
use crate::session::catalog::{Annotations, HostTool, ToolFuture, ToolSpec};
use crate::session::{Args, ToolContext, ToolError, ToolOutput};

/// A request's duration when the caller names none.
const DEFAULT_DURATION: Duration = Duration::from_secs(3600);

pub fn tools(host: &Arc<Host>) -> Vec<Box<dyn HostTool>> {
    let g = &host.grants;
    vec![
        Box::new(Request {
            grants: Arc::clone(g),
            kind: GrantKind::RootAccess,
        }),
        Box::new(Request {
            grants: Arc::clone(g),
            kind: GrantKind::Elevation,
        }),
        Box::new(List(Arc::clone(g))),
        Box::new(Revoke(Arc::clone(g))),
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
        .map_err(|e| super::internal("encoding the grant", e))
}

struct Request {
    grants: Arc<Grants>,
    kind: GrantKind,
}

impl HostTool for Request {
    fn spec(&self) -> ToolSpec {
        let max = humantime::format_duration(self.grants.max_duration()).to_string();
        let (name, description, scope_required) = match self.kind {
            GrantKind::RootAccess => (
                "permissions.request_root_access",
                format!(
                    "Ask an operator for root access: a grant covering every tool that policy puts behind a grant (or the tools named in scope), for a limited time (default 1h, at most {max}). Returns a pending grant; calls it covers succeed once an operator approves it."
                ),
                false,
            ),
            GrantKind::Elevation => (
                "permissions.request_elevation",
                format!(
                    "Ask an operator for a grant covering the tools named in scope (patterns like \"file.write\" or \"service.*\") for a limited time (default 1h, at most {max}). Returns a pending grant; calls it covers succeed once an operator approves it."
                ),
                true,
            ),
        };
        let mut input = json!({
            "type": "object",
            "properties": {
                "reason": {"type": "string", "minLength": 1, "maxLength": crate::grants::MAX_REASON,
                           "description": "Why you need it; the operator reads this."},
                "scope": {"type": "array", "minItems": 1, "maxItems": crate::grants::MAX_SCOPE,
                          "items": {"type": "string", "pattern": "^[A-Za-z0-9_.*-]{1,64}$"},
                          "description": "Canonical tool names or patterns the grant should cover."},
                "duration": {"type": "string", "description": "How long, e.g. \"30m\" or \"2h\"."}
            },
            "required": ["reason"],
            "additionalProperties": false
        });
        if scope_required {
            input["required"] = json!(["reason", "scope"]);
        }
        ToolSpec {
            name: name.into(),
            description,
            input_schema: schema(input),
            annotations: SELF_SERVICE,
        }
    }

    fn call<'a>(&'a self, ctx: &'a ToolContext<'a>, args: Args) -> ToolFuture<'a> {
        Box::pin(async move {
            let reason = arg_str(&args, "reason").unwrap_or_default();
            let scope: Vec<String> = match args.get("scope").and_then(Value::as_array) {
                Some(items) => items
                    .iter()
                    .filter_map(Value::as_str)
                    .map(str::to_owned)
                    .collect(),
                None => vec!["*".into()],
            };
            let duration = match arg_str(&args, "duration") {
                Some(text) => humantime::parse_duration(text)
                    .map_err(|e| invalid(format!("duration {text:?}: {e}")))?,
                None => DEFAULT_DURATION.min(self.grants.max_duration()),
            };
            let grant = self
                .grants
                .request(ctx.caller, self.kind, reason, scope, duration)?;
            let mut out = serde_json::to_value(&grant)
                .map_err(|e| super::internal("encoding the grant", e))?;
            out["next"] = json!(format!(
                "an operator approves it with `robota-mcpctl grants approve {}`; check with permissions.list_root_access",
                grant.grant_id
            ));
            Ok(ToolOutput::Structured(out))
        })
    }
}

struct List(Arc<Grants>);

impl HostTool for List {
    fn spec(&self) -> ToolSpec {
        ToolSpec {
            name: "permissions.list_root_access".into(),
            description: "Your grants, newest first: pending, approved (with expiry), denied, revoked and expired.".into(),
            input_schema: schema(json!({"type": "object", "properties": {}, "additionalProperties": false})),
            annotations: Annotations::READ_ONLY,
        }
    }

    fn call<'a>(&'a self, ctx: &'a ToolContext<'a>, _args: Args) -> ToolFuture<'a> {
        Box::pin(async move {
            let grants = self
                .0
                .list(Some(&ctx.caller.to_string()), false)
                .map_err(|e| super::internal("reading grants", e))?;
            structured(&json!({"grants": grants}))
        })
    }
}

struct Revoke(Arc<Grants>);

impl HostTool for Revoke {
    fn spec(&self) -> ToolSpec {
        ToolSpec {
            name: "permissions.revoke_root_access".into(),
            description: "Give back one of your grants (pending or approved) before it expires."
                .into(),
            input_schema: schema(json!({
                "type": "object",
                "properties": {"grant_id": {"type": "integer", "minimum": 1}},
                "required": ["grant_id"],
                "additionalProperties": false
            })),
            annotations: SELF_SERVICE,
        }
    }

    fn call<'a>(&'a self, ctx: &'a ToolContext<'a>, args: Args) -> ToolFuture<'a> {
        Box::pin(async move {
            let id = args
                .get("grant_id")
                .and_then(Value::as_i64)
                .ok_or_else(|| invalid("grant_id must be an integer"))?;
            structured(&self.0.revoke_own(ctx.caller, id)?)
        })
    }
}
