//! The canonical tool catalog: entries, start-up validation and argument validation.

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;

use serde_json::{Value, json};

use super::{Args, ToolContext, ToolError, ToolErrorCode, ToolOutput};

/// Longest tool name (SPEC §2 grammar `[A-Za-z0-9_.-]{1,64}`).
pub const MAX_NAME_LEN: usize = 64;

/// MCP annotations of a tool (hints to clients; `read_only` also drives default policy),
/// and two properties only the daemon reads.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Annotations {
    pub read_only: bool,
    pub destructive: bool,
    pub idempotent: bool,
    /// Acts only on the caller's own records (its jobs, its grants): allowed by default
    /// like a read-only tool.
    pub self_service: bool,
    /// Takes an optional `idempotency_key` argument: the same key from the same caller
    /// returns the first result without a second effect (SPEC §10).
    pub replay_safe: bool,
}

impl Annotations {
    pub const READ_ONLY: Annotations = Annotations {
        read_only: true,
        destructive: false,
        idempotent: true,
        self_service: false,
        replay_safe: false,
    };

    /// Allowed when no policy rule matches.
    pub fn allowed_by_default(&self) -> bool {
        self.read_only || self.self_service
    }
}

/// The argument every replay-safe tool accepts.
pub const IDEMPOTENCY_KEY: &str = "idempotency_key";

/// Its schema: printable ASCII, 1 to 128 characters.
pub fn idempotency_key_schema() -> Value {
    json!({
        "type": "string",
        "minLength": 1,
        "maxLength": 128,
        "pattern": "^[\\x21-\\x7e]+$",
        "description": "Optional. Retrying with the same key returns the first result without a second effect; the same key with different arguments is an error."
    })
}

/// What a catalog entry declares.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolSpec {
    pub name: String,
    pub description: String,
    /// An object schema (`"type": "object"`).
    pub input_schema: serde_json::Map<String, Value>,
    pub annotations: Annotations,
}

pub type ToolFuture<'a> = Pin<Box<dyn Future<Output = Result<ToolOutput, ToolError>> + Send + 'a>>;

/// A first-party tool implementation.
pub trait HostTool: Send + Sync + 'static {
    fn spec(&self) -> ToolSpec;
    fn call<'a>(&'a self, ctx: &'a ToolContext<'a>, args: Args) -> ToolFuture<'a>;
}

/// A validated entry: the spec, its compiled argument validator and the implementation.
pub struct Entry {
    spec: ToolSpec,
    validator: jsonschema::Validator,
    tool: Box<dyn HostTool>,
}

impl Entry {
    pub fn spec(&self) -> &ToolSpec {
        &self.spec
    }

    pub fn call<'a>(&'a self, ctx: &'a ToolContext<'a>, args: Args) -> ToolFuture<'a> {
        self.tool.call(ctx, args)
    }
}

/// Why a catalog (or the submission tool next to it) was refused at start-up.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum CatalogError {
    #[error("tool name {name:?} is invalid: {problem}")]
    BadName { name: String, problem: String },
    #[error("tool {0:?} is listed twice")]
    Duplicate(String),
    #[error("tool {0:?} has an empty description")]
    EmptyDescription(String),
    #[error("tool {name:?} has an invalid input schema: {problem}")]
    BadSchema { name: String, problem: String },
    #[error("the submission tool {submission:?} collides with the runtime tool {tool:?}")]
    SubmissionCollision { submission: String, tool: String },
}

/// Check a tool name against the grammar `[A-Za-z0-9_.-]{1,64}`.
pub fn check_name(name: &str) -> Result<(), String> {
    if name.is_empty() || name.len() > MAX_NAME_LEN {
        return Err(format!("must be 1 to {MAX_NAME_LEN} characters long"));
    }
    if let Some(c) = name
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || "_.-".contains(*c)))
    {
        return Err(format!("character {c:?} is outside [A-Za-z0-9_.-]"));
    }
    Ok(())
}

/// The catalog, sorted by canonical name.
pub struct Catalog {
    entries: BTreeMap<String, Entry>,
}

impl Catalog {
    /// Validate every tool: name grammar, uniqueness, description, object schema that compiles.
    pub fn new(tools: Vec<Box<dyn HostTool>>) -> Result<Self, CatalogError> {
        let mut entries = BTreeMap::new();
        for tool in tools {
            let spec = tool.spec();
            let validator = check_spec(&spec)?;
            if entries.contains_key(&spec.name) {
                return Err(CatalogError::Duplicate(spec.name));
            }
            entries.insert(
                spec.name.clone(),
                Entry {
                    spec,
                    validator,
                    tool,
                },
            );
        }
        Ok(Self { entries })
    }

    /// Fail if the submission tool's name is also a runtime tool's.
    pub fn check_submission(&self, submission: &ToolSpec) -> Result<(), CatalogError> {
        check_spec(submission)?;
        if let Some(existing) = self.entries.get(&submission.name) {
            return Err(CatalogError::SubmissionCollision {
                submission: submission.name.clone(),
                tool: existing.spec.name.clone(),
            });
        }
        Ok(())
    }

    pub fn get(&self, name: &str) -> Option<&Entry> {
        self.entries.get(name)
    }

    pub fn specs(&self) -> impl Iterator<Item = &ToolSpec> {
        self.entries.values().map(|e| &e.spec)
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

fn check_spec(spec: &ToolSpec) -> Result<jsonschema::Validator, CatalogError> {
    check_name(&spec.name).map_err(|problem| CatalogError::BadName {
        name: spec.name.clone(),
        problem,
    })?;
    if spec.description.trim().is_empty() {
        return Err(CatalogError::EmptyDescription(spec.name.clone()));
    }
    let bad = |problem: String| CatalogError::BadSchema {
        name: spec.name.clone(),
        problem,
    };
    if spec.input_schema.get("type") != Some(&Value::String("object".into())) {
        return Err(bad("the top level must be `\"type\": \"object\"`".into()));
    }
    jsonschema::validator_for(&Value::Object(spec.input_schema.clone()))
        .map_err(|e| bad(e.to_string()))
}

/// Validate arguments against the entry's schema.
pub fn validate_args(entry: &Entry, args: &Args) -> Result<(), ToolError> {
    validate_with(&entry.validator, args)
}

fn validate_with(validator: &jsonschema::Validator, args: &Args) -> Result<(), ToolError> {
    let value = Value::Object(args.clone());
    let problems: Vec<String> = validator
        .iter_errors(&value)
        .take(3)
        .map(|e| {
            let at = e.instance_path.to_string();
            if at.is_empty() {
                e.to_string()
            } else {
                format!("{at}: {e}")
            }
        })
        .collect();
    if problems.is_empty() {
        Ok(())
    } else {
        Err(ToolError::new(
            ToolErrorCode::InvalidArguments,
            problems.join("; "),
        ))
    }
}

/// The submission extension's spec: `{prompt: string, minLength 1}`, nothing else.
pub fn submission_spec(name: &str) -> ToolSpec {
    let schema = json!({
        "type": "object",
        "properties": {
            "prompt": {"type": "string", "minLength": 1, "description": "The turn's input, given to the host's agent."}
        },
        "required": ["prompt"],
        "additionalProperties": false
    });
    ToolSpec {
        name: name.to_owned(),
        description: "Submit one turn to the host's agent. One turn runs at a time; while one runs, this answers `busy`.".into(),
        input_schema: schema.as_object().cloned().unwrap_or_default(),
        annotations: Annotations::default(),
    }
}

/// Parse submission arguments (validated against [`submission_spec`]'s schema).
pub fn submission_prompt(args: &Args) -> Result<String, ToolError> {
    static VALIDATOR: std::sync::LazyLock<jsonschema::Validator> = std::sync::LazyLock::new(|| {
        jsonschema::validator_for(&Value::Object(submission_spec("agent_submit").input_schema))
            .expect("the submission schema compiles")
    });
    validate_with(&VALIDATOR, args)?;
    Ok(args
        .get("prompt")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Fake(ToolSpec);
    impl HostTool for Fake {
        fn spec(&self) -> ToolSpec {
            self.0.clone()
        }
        fn call<'a>(&'a self, _ctx: &'a ToolContext<'a>, _args: Args) -> ToolFuture<'a> {
            Box::pin(async { Ok(ToolOutput::Text("ok".into())) })
        }
    }

    fn spec(name: &str, schema: Value) -> Box<dyn HostTool> {
        Box::new(Fake(ToolSpec {
            name: name.into(),
            description: "a tool".into(),
            input_schema: schema.as_object().cloned().unwrap_or_default(),
            annotations: Annotations::default(),
        }))
    }

    fn obj() -> Value {
        json!({"type": "object"})
    }

    #[test]
    fn names_follow_the_grammar() {
        assert!(check_name("system.info").is_ok());
        assert!(check_name("a-b_c.D9").is_ok());
        assert!(check_name(&"x".repeat(64)).is_ok());
        assert!(check_name(&"x".repeat(65)).is_err());
        assert!(check_name("").is_err());
        assert!(check_name("a b").is_err());
        assert!(check_name("a/b").is_err());
        assert!(check_name("é").is_err());
    }

    #[test]
    fn start_up_validation_refuses_each_defect() {
        let err = |tools| {
            Catalog::new(tools)
                .err()
                .expect("catalog should be refused")
        };
        assert!(matches!(
            err(vec![spec("a b", obj())]),
            CatalogError::BadName { .. }
        ));
        assert_eq!(
            err(vec![spec("a", obj()), spec("a", obj())]),
            CatalogError::Duplicate("a".into())
        );
        let mut empty = spec("a", obj()).spec();
        empty.description = "  ".into();
        assert_eq!(
            err(vec![Box::new(Fake(empty))]),
            CatalogError::EmptyDescription("a".into())
        );
        assert!(matches!(
            err(vec![spec("a", json!({"type": "string"}))]),
            CatalogError::BadSchema { .. }
        ));
        assert!(matches!(
            err(vec![spec(
                "a",
                json!({"type": "object", "properties": {"x": {"type": 12}}})
            )]),
            CatalogError::BadSchema { .. }
        ));
    }

    #[test]
    fn submission_collision_names_both() {
        let catalog = Catalog::new(vec![spec("agent_submit", obj())]).unwrap();
        let err = catalog
            .check_submission(&submission_spec("agent_submit"))
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "the submission tool \"agent_submit\" collides with the runtime tool \"agent_submit\""
        );
        assert!(catalog.check_submission(&submission_spec("turn")).is_ok());
    }

    #[test]
    fn submission_arguments_are_checked() {
        let ok = json!({"prompt": "hello"});
        assert_eq!(submission_prompt(ok.as_object().unwrap()).unwrap(), "hello");
        for bad in [
            json!({}),
            json!({"prompt": ""}),
            json!({"prompt": 3}),
            json!({"prompt": "x", "more": 1}),
        ] {
            let err = submission_prompt(bad.as_object().unwrap()).unwrap_err();
            assert_eq!(err.code, ToolErrorCode::InvalidArguments, "{bad}");
        }
    }
}
