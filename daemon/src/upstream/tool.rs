//! The bridge: an upstream's tool definitions imported as catalog entries named
//! `<upstream>.<tool>` (or its alias), and a call to one of them forwarded and its result
//! passed back as the JSON value the upstream sent.
//!
//! What an upstream says is data, never trust: its annotations are shown to clients but
//! the entry's own annotations stay the defaults (so policy denies it unless a rule
//! allows it), its schema is shown but never compiled here, and a definition that cannot
//! be imported is refused with its reason, never dropped silently.

use std::sync::{Arc, Weak};

use serde_json::{Map, Value};

use super::Upstream;
use super::pin::Drift;
use super::protocol::{Answer, CallError};
use crate::budget::Share;
use crate::catalog::{
    Annotations, Args, HostTool, Imported, ToolContext, ToolError, ToolFuture, ToolOutput,
    ToolSpec, UPSTREAM_META, is_own_meta,
};
use crate::config::UpstreamConfig;
use crate::vocab::ToolErrorCode;

/// Tools imported from one upstream at most; the rest are refused.
pub const MAX_IMPORTED: usize = 1024;

/// What one tool list of an upstream became.
#[derive(Default)]
pub struct Listing {
    /// By canonical name.
    pub tools: Vec<Arc<ImportedTool>>,
    /// Upstream tool name → why it was not imported.
    pub refused: Vec<(String, String)>,
    /// Tools `tools = [...]` does not select.
    pub excluded: usize,
    /// The share of the upstreams' memory budget the list took when it was read.
    pub held: Option<Share>,
    /// The digest of the surface listed ([`super::pin::Surface::digest`]).
    pub surface: Option<String>,
    /// Whether the surface differs from the approved one (its changes held).
    pub drift: bool,
}

impl Listing {
    pub fn specs(&self) -> Vec<&ToolSpec> {
        self.tools.iter().map(|t| &t.spec).collect()
    }

    /// Holds what `drift` holds: those tools are not served but shown among the refused
    /// with why, and so are approved tools no longer listed.
    pub fn hold(&mut self, drift: &Drift, upstream: &str) {
        let then = format!(
            "held until approved (robota-mcpctl upstreams diff {upstream}, then upstreams approve {upstream} with the surface it shows)"
        );
        let (held, served): (Vec<_>, Vec<_>) = std::mem::take(&mut self.tools)
            .into_iter()
            .partition(|t| drift.holds(&t.original).is_some());
        self.tools = served;
        for tool in held {
            let why = drift.holds(&tool.original).unwrap_or_default();
            self.refused
                .push((tool.original.clone(), format!("{why}; {then}")));
        }
        for gone in &drift.removed {
            self.refused.push((
                gone.clone(),
                "approved, and no longer listed by the upstream".into(),
            ));
        }
    }
}

/// One imported tool.
pub struct ImportedTool {
    pub spec: ToolSpec,
    original: String,
    upstream: Weak<Upstream>,
}

/// Imports `listed` (the upstream's definitions, as sent) under `config`: the same list
/// and configuration always give the same names, whatever the order they came in.
pub fn import(config: &UpstreamConfig, listed: &[Value], upstream: &Weak<Upstream>) -> Listing {
    let mut listing = Listing::default();
    let mut definitions: Vec<(String, Map<String, Value>)> = Vec::new();
    for definition in listed {
        let Some(object) = definition.as_object() else {
            listing.refused.push((
                "(unnamed)".into(),
                "a tool definition that is not a JSON object".into(),
            ));
            continue;
        };
        let Some(name) = object.get("name").and_then(Value::as_str) else {
            listing.refused.push((
                "(unnamed)".into(),
                "a tool definition without a string `name`".into(),
            ));
            continue;
        };
        definitions.push((name.to_owned(), object.clone()));
    }
    definitions.sort_by(|a, b| a.0.cmp(&b.0));
    let mut previous: Option<String> = None;
    for (name, definition) in definitions {
        if previous.as_deref() == Some(name.as_str()) {
            listing
                .refused
                .push((name.clone(), "listed twice by the upstream".into()));
            continue;
        }
        previous = Some(name.clone());
        if !config.tools.is_empty()
            && !config
                .tools
                .iter()
                .any(|g| glob_match::glob_match(g, &name))
        {
            listing.excluded += 1;
            continue;
        }
        match spec_of(config, &name, definition) {
            Ok(spec) if listing.tools.len() < MAX_IMPORTED => {
                listing.tools.push(Arc::new(ImportedTool {
                    spec,
                    original: name,
                    upstream: upstream.clone(),
                }));
            }
            Ok(_) => listing.refused.push((
                name,
                format!("over the {MAX_IMPORTED} tools imported from one upstream"),
            )),
            Err(why) => listing.refused.push((name, why)),
        }
    }
    listing.tools.sort_by(|a, b| a.spec.name.cmp(&b.spec.name));
    listing
}

fn spec_of(
    config: &UpstreamConfig,
    name: &str,
    mut definition: Map<String, Value>,
) -> Result<ToolSpec, String> {
    let local = config.aliases.get(name).map_or(name, String::as_str);
    let canonical = format!("{}.{local}", config.name);
    if let Err(problem) = crate::config::check_name(&canonical) {
        return Err(format!(
            "{canonical:?} is not a valid tool name ({problem}); give it an alias in [upstreams.{}.aliases]",
            config.name
        ));
    }
    let Some(Value::Object(schema)) = definition.get("inputSchema") else {
        return Err("its inputSchema is not a JSON object".into());
    };
    header_annotations(schema)?;
    {
        use serde::Deserialize as _;
        use serde::de::IntoDeserializer as _;
        if let Err(e) = rmcp::model::Tool::deserialize((&definition).into_deserializer()) {
            return Err(format!("not a valid MCP tool definition: {e}"));
        }
    }
    // Held once, in the spec; the listing keeps the rest of the definition.
    let Some(Value::Object(input_schema)) = definition.remove("inputSchema") else {
        unreachable!("looked at above")
    };
    let description = match definition.get("description").and_then(Value::as_str) {
        Some(d) if !d.trim().is_empty() => d.to_owned(),
        _ => format!(
            "Tool {name:?} of the downstream MCP server {:?}.",
            config.name
        ),
    };
    definition.remove("name");
    let spec = ToolSpec {
        name: canonical,
        description,
        input_schema,
        // Whatever the upstream claims, not read-only, not self-service for policy.
        annotations: Annotations::default(),
        imported: Some(Imported {
            upstream: config.name.clone(),
            tool: name.to_owned(),
            listing: definition,
        }),
    };
    crate::catalog::check(&spec).map_err(|e| e.to_string())?;
    Ok(spec)
}

/// The input schema's `x-mcp-header` annotations (SEP-2243) can be honoured: each names
/// a header, and no two the same one (header names have no case). Otherwise the tool
/// would be listed but never callable on 2026-07-28 — its callers asked for a header the
/// daemon cannot send on, or sends twice with different values.
fn header_annotations(schema: &Map<String, Value>) -> Result<(), String> {
    let mut seen = Vec::new();
    for (path, header) in crate::params::annotations(schema) {
        let shown = || header.chars().take(64).collect::<String>();
        let Some(name) = crate::params::header_name(header) else {
            return Err(format!(
                "its inputSchema's x-mcp-header {:?} (on {}) does not make a header name",
                shown(),
                path.join(".")
            ));
        };
        if seen.contains(&name) {
            return Err(format!(
                "two arguments of its inputSchema have x-mcp-header {:?} (header names have no case)",
                shown()
            ));
        }
        seen.push(name);
    }
    Ok(())
}

impl HostTool for ImportedTool {
    fn spec(&self) -> ToolSpec {
        self.spec.clone()
    }

    fn call<'a>(&'a self, ctx: &'a ToolContext<'a>, args: Args) -> ToolFuture<'a> {
        Box::pin(async move {
            let Some(upstream) = self.upstream.upgrade() else {
                return Err(ToolError::new(
                    ToolErrorCode::Unavailable,
                    format!("{} is no longer served", self.spec.name),
                ));
            };
            let name = upstream.name().to_owned();
            let result = upstream
                .call(&self.original, args, &ctx.cancel, &ctx.progress)
                .await;
            let imported = self.spec.imported.as_ref();
            match result {
                // The answer's budget share is given back once it is the caller's output.
                Ok(Answer {
                    result,
                    held: _held,
                }) => passthrough(result, imported),
                Err(e) => {
                    // The text is the daemon's, never the upstream's.
                    if e.link_failed() {
                        tracing::warn!(upstream = %name, tool = %self.original, error = %e.describe(), "an upstream call failed");
                    }
                    Err(tool_error(&name, e))
                }
            }
        })
    }
}

/// `_meta` keys of a result that describe the upstream's own connection, not the result:
/// the daemon is the server its callers talk to.
const HOP_META: [&str; 1] = ["io.modelcontextprotocol/serverInfo"];

/// The upstream's result as the caller gets it: unchanged but for `_meta`, which loses
/// the keys about the upstream's connection ([`HOP_META`]) and gains [`UPSTREAM_META`].
pub fn passthrough(
    mut result: Map<String, Value>,
    imported: Option<&Imported>,
) -> Result<ToolOutput, ToolError> {
    let not_a_result = |why: &str| {
        ToolError::new(
            ToolErrorCode::Internal,
            format!("the upstream's answer is not a tool result: {why}"),
        )
    };
    match result.remove("resultType") {
        None => {}
        Some(Value::String(t)) if t == "complete" => {}
        Some(other) => {
            return Err(ToolError::new(
                ToolErrorCode::Internal,
                format!(
                    "the upstream answered with resultType {other}, which the bridge does not relay (it asks nothing of its own callers)"
                ),
            ));
        }
    }
    if result.get("content").is_some_and(|c| !c.is_array()) {
        return Err(not_a_result("`content` is not an array"));
    }
    if result.get("isError").is_some_and(|e| !e.is_boolean()) {
        return Err(not_a_result("`isError` is not a boolean"));
    }
    let meta = result
        .entry("_meta")
        .or_insert_with(|| Value::Object(Map::new()));
    let Value::Object(meta) = meta else {
        return Err(not_a_result("`_meta` is not an object"));
    };
    // Its connection's keys are not the caller's business, and the daemon's own keys are
    // the daemon's to set: an upstream cannot forge them.
    meta.retain(|k, _| !HOP_META.contains(&k.as_str()) && !is_own_meta(k));
    if let Some(imported) = imported {
        meta.insert(UPSTREAM_META.into(), imported.meta());
    }
    Ok(ToolOutput::Passthrough(result))
}

/// What the caller is told when an upstream call fails: the class of failure and the
/// upstream's name, never its command, address or credential.
pub fn tool_error(upstream: &str, e: CallError) -> ToolError {
    match e {
        CallError::NotSent(_) => ToolError::new(
            ToolErrorCode::Unavailable,
            format!("the upstream {upstream:?} cannot be reached now; nothing was sent"),
        ),
        CallError::Lost(_) => ToolError::new(
            ToolErrorCode::OutcomeUnknown,
            format!(
                "the upstream {upstream:?} received the call but gave no usable answer (it failed, refused it without saying why, or broke off): whether the call took effect is unknown, and it is not retried"
            ),
        ),
        CallError::TooLarge(why) => ToolError::new(ToolErrorCode::ResultTooLarge, why),
        CallError::Rpc {
            code: -32602,
            message,
        } => ToolError::new(
            ToolErrorCode::InvalidArguments,
            // Its words, always under its name: never the daemon's own voice.
            format!("the upstream {upstream:?} refused the arguments: {message}"),
        ),
        CallError::Rpc {
            code: -32601,
            message,
        } => ToolError::new(
            ToolErrorCode::Unavailable,
            format!("the upstream {upstream:?} does not serve this tool now: {message}"),
        ),
        CallError::Rpc { code, message } => ToolError::new(
            ToolErrorCode::Internal,
            format!("the upstream {upstream:?} answered with JSON-RPC error {code}: {message}"),
        ),
        CallError::Timeout(limit) => ToolError::new(
            ToolErrorCode::TimedOut,
            format!(
                "the upstream {upstream:?} did not answer within {} (it was told to cancel)",
                humantime::format_duration(limit)
            ),
        ),
        CallError::Cancelled => ToolError::new(ToolErrorCode::Cancelled, "the call was cancelled"),
        CallError::Busy(why) => ToolError::new(ToolErrorCode::Busy, why),
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::time::Duration;

    use serde_json::json;

    use super::*;
    use crate::config::{Backoff, UpstreamEndpoint, UpstreamProtocol};

    fn config(tools: &[&str], aliases: &[(&str, &str)]) -> UpstreamConfig {
        UpstreamConfig {
            name: "pg".into(),
            endpoint: UpstreamEndpoint::Command {
                argv: vec!["/bin/true".into()],
                env: BTreeMap::new(),
                cwd: None,
                children: crate::config::Children::Shared,
                confine: crate::config::Confine {
                    enabled: true,
                    network: crate::config::Network::None,
                    read_paths: Vec::new(),
                    write_paths: Vec::new(),
                    memory: None,
                },
            },
            protocol: UpstreamProtocol::Auto,
            tools: tools.iter().map(|s| s.to_string()).collect(),
            aliases: aliases
                .iter()
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .collect(),
            call_timeout: Duration::from_secs(60),
            connect_timeout: Duration::from_secs(10),
            restart: Backoff::DEFAULT,
            response_limit: 1024,
            stream_limit: 4096,
            pin: true,
        }
    }

    fn tool(name: &str) -> Value {
        json!({
            "name": name,
            "description": format!("does {name}"),
            "inputSchema": {"type": "object"},
            "annotations": {"readOnlyHint": true},
            "title": "A title",
            "x-unknown": 1
        })
    }

    fn names(l: &Listing) -> Vec<&str> {
        l.tools.iter().map(|t| t.spec.name.as_str()).collect()
    }

    #[test]
    fn names_are_prefixed_aliased_and_the_same_in_any_order() {
        let listed = vec![
            tool("query"),
            tool("run query"),
            tool("list_tables"),
            tool("drop"),
        ];
        let cfg = config(&["query", "list_*", "run*"], &[("run query", "run_query")]);
        let a = import(&cfg, &listed, &Weak::new());
        let mut reversed = listed.clone();
        reversed.reverse();
        let b = import(&cfg, &reversed, &Weak::new());
        assert_eq!(names(&a), ["pg.list_tables", "pg.query", "pg.run_query"]);
        assert_eq!(names(&a), names(&b));
        assert_eq!(a.excluded, 1);
        assert!(a.refused.is_empty());
        let imported = a.tools[2].spec.imported.as_ref().unwrap();
        assert_eq!(imported.tool, "run query");
        assert_eq!(imported.meta(), json!({"name": "pg", "tool": "run query"}));
        // Shown as the upstream said, but never read-only for policy.
        assert_eq!(imported.listing["annotations"]["readOnlyHint"], true);
        assert_eq!(imported.listing["x-unknown"], 1);
        assert!(!a.tools[2].spec.annotations.allowed_by_default());
    }

    #[test]
    fn what_cannot_be_imported_is_refused_with_its_reason() {
        let listed = vec![
            tool("run query"),
            json!({"name": "s", "inputSchema": {"type": "string"}}),
            json!({"name": "n", "inputSchema": "object"}),
            json!({"description": "no name", "inputSchema": {"type": "object"}}),
            json!(3),
            tool(&"x".repeat(70)),
            tool("twice"),
            tool("twice"),
            json!({"name": "bare", "inputSchema": {"type": "object"}}),
            json!({"name": "crlf", "inputSchema": {"type": "object", "properties": {
                "v": {"type": "string", "x-mcp-header": "Bad\r\nX-Injected: 1"}}}}),
            json!({"name": "cased", "inputSchema": {"type": "object", "properties": {
                "a": {"type": "string", "x-mcp-header": "Val"},
                "b": {"type": "object", "properties": {
                    "c": {"type": "string", "x-mcp-header": "val"}}}}}}),
        ];
        let l = import(&config(&[], &[]), &listed, &Weak::new());
        assert_eq!(names(&l), ["pg.bare", "pg.twice"]);
        assert_eq!(
            l.tools[0].spec.description,
            "Tool \"bare\" of the downstream MCP server \"pg\"."
        );
        let refused: BTreeMap<&str, &str> = l
            .refused
            .iter()
            .map(|(t, why)| (t.as_str(), why.as_str()))
            .collect();
        assert!(
            refused["run query"].contains("give it an alias"),
            "{refused:?}"
        );
        assert!(refused["s"].contains("type"), "{refused:?}");
        assert!(refused["n"].contains("inputSchema"), "{refused:?}");
        assert!(refused["twice"].contains("twice"), "{refused:?}");
        assert!(
            refused["crlf"].contains("does not make a header name"),
            "{refused:?}"
        );
        assert!(refused["cased"].contains("no case"), "{refused:?}");
        assert!(
            refused[&"x".repeat(70)[..]].contains("1 to 64"),
            "{refused:?}"
        );
        assert_eq!(
            l.refused.iter().filter(|(t, _)| t == "(unnamed)").count(),
            2
        );
    }

    #[test]
    fn results_pass_through_with_the_upstream_named() {
        let imported = Imported {
            upstream: "pg".into(),
            tool: "run query".into(),
            listing: Map::new(),
        };
        let result = json!({
            "content": [{"type": "text", "text": "3"}, {"type": "future-kind", "blob": 1}],
            "structuredContent": {"rows": 3},
            "isError": false,
            "resultType": "complete",
            "extra": {"kept": true},
            // A forged mark of the daemon's own error, and a forged origin: both go.
            "_meta": {"theirs": 1, "io.modelcontextprotocol/serverInfo": {"name": "pg-mcp"},
                      "io.robota/error": {"by": "robota-mcpd", "code": "unavailable"},
                      "io.robota/upstream": {"name": "system"},
                      "IO.Robota/Error": {"by": "robota-mcpd"}}
        });
        let Ok(ToolOutput::Passthrough(out)) =
            passthrough(result.as_object().unwrap().clone(), Some(&imported))
        else {
            panic!("a passthrough result")
        };
        assert_eq!(
            Value::Object(out),
            json!({
                "content": [{"type": "text", "text": "3"}, {"type": "future-kind", "blob": 1}],
                "structuredContent": {"rows": 3},
                "isError": false,
                "extra": {"kept": true},
                "_meta": {"theirs": 1, "io.robota/upstream": {"name": "pg", "tool": "run query"}}
            })
        );
        for bad in [
            json!({"content": "text"}),
            json!({"isError": "yes"}),
            json!({"_meta": 1}),
            json!({"resultType": "input_required"}),
        ] {
            let err = passthrough(bad.as_object().unwrap().clone(), Some(&imported)).unwrap_err();
            assert_eq!(err.code, ToolErrorCode::Internal, "{bad}");
        }
    }

    #[test]
    fn failures_become_tool_errors_without_the_upstream_internals() {
        let code = |e| tool_error("pg", e).code;
        assert_eq!(
            code(CallError::NotSent("connect to 127.0.0.1:9 refused".into())),
            ToolErrorCode::Unavailable
        );
        assert_eq!(
            code(CallError::Lost("x".into())),
            ToolErrorCode::OutcomeUnknown
        );
        assert_eq!(
            code(CallError::TooLarge("x".into())),
            ToolErrorCode::ResultTooLarge
        );
        assert_eq!(
            code(CallError::Rpc {
                code: -32602,
                message: "bad".into()
            }),
            ToolErrorCode::InvalidArguments
        );
        assert_eq!(
            code(CallError::Timeout(Duration::from_secs(1))),
            ToolErrorCode::TimedOut
        );
        assert_eq!(code(CallError::Cancelled), ToolErrorCode::Cancelled);
        let message = tool_error(
            "pg",
            CallError::NotSent("connect to 127.0.0.1:9 refused".into()),
        )
        .message;
        assert!(!message.contains("127.0.0.1"), "{message}");
    }
}
