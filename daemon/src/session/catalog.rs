//! The canonical tool catalog: entries, start-up validation and argument validation.
//!
//! A first-party tool's arguments are one Rust type, a [`TypedTool::Args`] struct that
//! derives both `Deserialize` and `JsonSchema`: the input schema a client sees is
//! generated from it ([`ToolSpec::typed`]), and a call's arguments are parsed into it
//! ([`parse_args`]) after they passed that schema. So `{"offset": 1.0}` or an integer
//! beyond the field's type is `invalid_arguments`, never a default in disguise.

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;

use schemars::JsonSchema;
use serde::de::DeserializeOwned;
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

/// Its schema: printable ASCII, 1 to 128 characters. [`ToolSpec::typed`] adds it to every
/// replay-safe tool; the session takes the key out before the tool parses its arguments.
fn idempotency_key_schema() -> Value {
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

impl ToolSpec {
    /// A spec whose input schema is generated from the argument type `T`: a plain object
    /// schema (every subschema inlined, no `$schema`, `title` or top-level `description`),
    /// with field doc comments as property descriptions. A replay-safe tool's schema gets
    /// the optional [`IDEMPOTENCY_KEY`] property as well.
    pub fn typed<T: JsonSchema>(
        name: &str,
        description: impl Into<String>,
        annotations: Annotations,
    ) -> ToolSpec {
        let mut settings = schemars::generate::SchemaSettings::draft2020_12();
        settings.inline_subschemas = true;
        settings.meta_schema = None;
        let mut input_schema = match settings.into_generator().into_root_schema_for::<T>().into() {
            Value::Object(map) => map,
            _ => serde_json::Map::new(),
        };
        input_schema.remove("title");
        input_schema.remove("description");
        // Some clients want `properties` on every object schema, even an empty one.
        input_schema
            .entry("properties")
            .or_insert_with(|| Value::Object(serde_json::Map::new()));
        if annotations.replay_safe
            && let Some(Value::Object(properties)) = input_schema.get_mut("properties")
        {
            properties.insert(IDEMPOTENCY_KEY.into(), idempotency_key_schema());
        }
        ToolSpec {
            name: name.to_owned(),
            description: description.into(),
            input_schema,
            annotations,
        }
    }

    /// The schema of one property, to adjust what depends on the configuration (a
    /// description naming the configured units, an `enum` of the configured templates).
    pub fn property_mut(&mut self, name: &str) -> Option<&mut serde_json::Map<String, Value>> {
        self.input_schema
            .get_mut("properties")?
            .get_mut(name)?
            .as_object_mut()
    }

    /// Replaces one property's description.
    pub fn describe(mut self, property: &str, description: impl Into<String>) -> Self {
        if let Some(schema) = self.property_mut(property) {
            schema.insert("description".into(), Value::String(description.into()));
        }
        self
    }
}

/// Parses arguments that passed the tool's schema into its argument type. What the schema
/// cannot say (`1.0` is an integer to JSON Schema, not to a `u64`; a number past the
/// field's type) fails here, as `invalid_arguments` naming the argument.
pub fn parse_args<T: DeserializeOwned>(args: Args) -> Result<T, ToolError> {
    serde_path_to_error::deserialize(Value::Object(args)).map_err(|e| {
        let path = e.path().to_string();
        let problem = e.into_inner().to_string();
        ToolError::new(
            ToolErrorCode::InvalidArguments,
            if path == "." {
                problem
            } else {
                format!("{path}: {problem}")
            },
        )
    })
}

pub type ToolFuture<'a> = Pin<Box<dyn Future<Output = Result<ToolOutput, ToolError>> + Send + 'a>>;

/// A tool implementation as the catalog holds it.
pub trait HostTool: Send + Sync + 'static {
    fn spec(&self) -> ToolSpec;
    fn call<'a>(&'a self, ctx: &'a ToolContext<'a>, args: Args) -> ToolFuture<'a>;
}

/// A tool with typed arguments: every first-party tool. Its [`HostTool`] impl parses the
/// (schema-checked) arguments into [`TypedTool::Args`] once, then runs it.
pub trait TypedTool: Send + Sync + 'static {
    /// `#[derive(Deserialize, JsonSchema)]` with `#[serde(deny_unknown_fields)]`.
    type Args: DeserializeOwned + JsonSchema + Send;

    /// Built with [`ToolSpec::typed`]`::<Self::Args>`.
    fn spec(&self) -> ToolSpec;

    fn run<'a>(&'a self, ctx: &'a ToolContext<'a>, args: Self::Args) -> ToolFuture<'a>;
}

impl<T: TypedTool> HostTool for T {
    fn spec(&self) -> ToolSpec {
        TypedTool::spec(self)
    }

    fn call<'a>(&'a self, ctx: &'a ToolContext<'a>, args: Args) -> ToolFuture<'a> {
        match parse_args::<T::Args>(args) {
            Ok(args) => self.run(ctx, args),
            Err(e) => Box::pin(std::future::ready(Err(e))),
        }
    }
}

/// The arguments of a tool that takes none.
#[derive(Debug, serde::Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct NoArgs {}

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
/// Validate arguments against the entry's schema; they are handed back (never copied:
/// a large argument is held once).
pub fn validate_args(entry: &Entry, args: Args) -> Result<Args, ToolError> {
    validate_with(&entry.validator, args)
}

fn validate_with(validator: &jsonschema::Validator, args: Args) -> Result<Args, ToolError> {
    let value = Value::Object(args);
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
    if !problems.is_empty() {
        return Err(ToolError::new(
            ToolErrorCode::InvalidArguments,
            problems.join("; "),
        ));
    }
    match value {
        Value::Object(args) => Ok(args),
        _ => unreachable!("built as an object above"),
    }
}

/// The submission extension's arguments: `{prompt: string, minLength 1}`, nothing else.
#[derive(Debug, serde::Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct SubmissionArgs {
    /// The turn's input, given to the host's agent.
    #[schemars(length(min = 1))]
    prompt: String,
}

/// The submission extension's spec.
pub fn submission_spec(name: &str) -> ToolSpec {
    ToolSpec::typed::<SubmissionArgs>(
        name,
        "Submit one turn to the host's agent. One turn runs at a time; while one runs, this answers `busy`.",
        Annotations::default(),
    )
}

/// Parse submission arguments (validated against [`submission_spec`]'s schema).
pub fn submission_prompt(args: Args) -> Result<String, ToolError> {
    static VALIDATOR: std::sync::LazyLock<jsonschema::Validator> = std::sync::LazyLock::new(|| {
        jsonschema::validator_for(&Value::Object(submission_spec("agent_submit").input_schema))
            .expect("the submission schema compiles")
    });
    let args = validate_with(&VALIDATOR, args)?;
    parse_args::<SubmissionArgs>(args).map(|a| a.prompt)
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

    /// Arguments of a made-up replay-safe tool.
    #[derive(Debug, PartialEq, serde::Deserialize, JsonSchema)]
    #[serde(deny_unknown_fields)]
    struct Sample {
        /// How many.
        #[schemars(range(min = 1, max = 10))]
        count: u64,
        /// Where from.
        #[serde(default)]
        offset: u64,
    }

    #[test]
    fn a_typed_spec_is_a_plain_object_schema_of_its_type() {
        let replay_safe = Annotations {
            replay_safe: true,
            ..Annotations::default()
        };
        let spec = ToolSpec::typed::<Sample>("sample.tool", "A sample.", replay_safe)
            .describe("offset", "Where to start.");
        assert_eq!(
            Value::Object(spec.input_schema.clone()),
            json!({
                "type": "object",
                "properties": {
                    "count": {"type": "integer", "format": "uint64", "minimum": 1, "maximum": 10, "description": "How many."},
                    "offset": {"type": "integer", "format": "uint64", "minimum": 0, "default": 0, "description": "Where to start."},
                    IDEMPOTENCY_KEY: idempotency_key_schema(),
                },
                "required": ["count"],
                "additionalProperties": false
            })
        );
        Catalog::new(vec![Box::new(Fake(spec))]).expect("the schema compiles");
        let plain = ToolSpec::typed::<NoArgs>("none", "Nothing.", Annotations::READ_ONLY);
        assert_eq!(
            Value::Object(plain.input_schema),
            json!({"type": "object", "properties": {}, "additionalProperties": false})
        );
    }

    #[test]
    fn parsing_refuses_what_the_type_cannot_hold_naming_the_argument() {
        let parse = |v: Value| parse_args::<Sample>(v.as_object().cloned().unwrap());
        assert_eq!(
            parse(json!({"count": 3})).unwrap(),
            Sample {
                count: 3,
                offset: 0
            }
        );
        for (args, message) in [
            (
                json!({"count": 1.0}),
                "count: invalid type: floating point `1.0`, expected u64",
            ),
            (
                json!({"count": 1, "offset": -1}),
                "offset: invalid value: integer `-1`, expected u64",
            ),
            (
                serde_json::from_str(r#"{"count": 1, "offset": 18446744073709551616}"#).unwrap(),
                "offset: invalid type: floating point `1.8446744073709552e+19`, expected u64",
            ),
            (json!({}), "missing field `count`"),
            (
                json!({"count": 1, "more": true}),
                "more: unknown field `more`, expected `count` or `offset`",
            ),
        ] {
            let err = parse(args.clone()).unwrap_err();
            assert_eq!(err.code, ToolErrorCode::InvalidArguments, "{args}");
            assert_eq!(err.message, message, "{args}");
        }
    }

    #[test]
    fn submission_arguments_are_checked() {
        let ok = json!({"prompt": "hello"});
        assert_eq!(
            submission_prompt(ok.as_object().unwrap().clone()).unwrap(),
            "hello"
        );
        for bad in [
            json!({}),
            json!({"prompt": ""}),
            json!({"prompt": 3}),
            json!({"prompt": "x", "more": 1}),
        ] {
            let err = submission_prompt(bad.as_object().unwrap().clone()).unwrap_err();
            assert_eq!(err.code, ToolErrorCode::InvalidArguments, "{bad}");
        }
    }
}
