//! The canonical catalog: tools gathered from [`Source`]s (the first-party host tools;
//! each downstream MCP server in time) and the submission extension, validated and merged
//! into an immutable [`Snapshot`] with a generation number. A request works on one
//! snapshot from start to end; a source that changes makes the next generation.
//!
//! Names are never first-wins or last-wins: at start-up any collision (two sources, or a
//! source and the submission tool) or invalid tool is an error naming both; in a later
//! generation the colliding name is recorded as a conflict, listed nowhere and answered
//! `unavailable` until it is resolved, and an invalid tool is refused with its reason.

mod tool;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use parking_lot::RwLock;
use schemars::JsonSchema;
use serde_json::Value;

pub use tool::*;

use crate::vocab::ToolErrorCode;

/// Where tools come from.
pub trait Source: Send + Sync + 'static {
    /// How the source is named when it collides with another (`first-party`, …).
    fn name(&self) -> &str;

    /// The tools it offers now.
    fn tools(&self) -> Vec<Arc<dyn HostTool>>;

    /// The prefix its tools are named under (`pg` for `pg.query`), when they are not known
    /// in advance: an alias may name such a tool before it is offered.
    fn namespace(&self) -> Option<&str> {
        None
    }

    /// Why the tools of its namespace cannot be known now (an upstream that is not up
    /// and has no list kept), if so.
    fn unavailable(&self) -> Option<String> {
        None
    }
}

/// A source whose tools never change (the first-party host tools).
pub struct Fixed {
    name: String,
    tools: Vec<Arc<dyn HostTool>>,
}

impl Fixed {
    pub fn new(name: impl Into<String>, tools: Vec<Arc<dyn HostTool>>) -> Self {
        Self {
            name: name.into(),
            tools,
        }
    }
}

impl Source for Fixed {
    fn name(&self) -> &str {
        &self.name
    }

    fn tools(&self) -> Vec<Arc<dyn HostTool>> {
        self.tools.clone()
    }
}

/// The name the submission extension goes by when it collides with a source's tool.
pub const SUBMISSION_SOURCE: &str = "the submission tool";

/// A validated entry: the spec, its compiled argument validator, the implementation and
/// the source it came from.
pub struct Entry {
    spec: ToolSpec,
    /// None for an imported tool: its server validates its arguments.
    validator: Option<jsonschema::Validator>,
    tool: Arc<dyn HostTool>,
    source: String,
}

impl Entry {
    pub fn spec(&self) -> &ToolSpec {
        &self.spec
    }

    pub fn source(&self) -> &str {
        &self.source
    }

    pub fn call<'a>(&'a self, ctx: &'a ToolContext<'a>, args: Args) -> ToolFuture<'a> {
        self.tool.call(ctx, args)
    }
}

/// Why a catalog was refused at start-up.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum CatalogError {
    #[error("tool name {name:?} is invalid: {problem}")]
    BadName { name: String, problem: String },
    #[error("tool {name:?} is offered by both {first} and {second}; give one an alias")]
    Collision {
        name: String,
        first: String,
        second: String,
    },
    #[error("tool {0:?} has an empty description")]
    EmptyDescription(String),
    #[error("tool {name:?} has an invalid input schema: {problem}")]
    BadSchema { name: String, problem: String },
    #[error("the submission tool {submission:?} collides with the runtime tool {tool:?}")]
    SubmissionCollision { submission: String, tool: String },
}

/// What a name is in a snapshot.
pub enum Lookup<'a> {
    Found(&'a Entry),
    /// Offered by two or more sources (named): served by none of them.
    Conflict(&'a [String]),
    Missing,
}

/// One generation of the catalog: immutable.
pub struct Snapshot {
    generation: u64,
    namespaces: Vec<String>,
    entries: BTreeMap<String, Entry>,
    submission: ToolSpec,
    conflicts: BTreeMap<String, Vec<String>>,
    /// The conflicts an upstream's listing takes part in: refused names, never a reason to
    /// refuse the catalog.
    listed: BTreeSet<String>,
    refused: Vec<Refused>,
}

/// A tool a source offered that the catalog refused, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refused {
    pub source: String,
    pub error: CatalogError,
    /// Offered by an upstream (what it lists), not by the configuration.
    pub upstream: bool,
}

impl Snapshot {
    /// Merge what `sources` offer now with the submission tool.
    fn build(generation: u64, sources: &[Arc<dyn Source>], submission: &ToolSpec) -> Self {
        let mut offered: BTreeMap<String, Vec<Entry>> = BTreeMap::new();
        let mut refused = Vec::new();
        for source in sources {
            for tool in source.tools() {
                let spec = tool.spec();
                // An imported tool names its own tool too, so a collision inside one
                // upstream's list names both of its tools.
                let owner = match &spec.imported {
                    Some(imported) => format!("{} (its tool {:?})", source.name(), imported.tool),
                    None => source.name().to_owned(),
                };
                match check_spec(&spec) {
                    Ok(validator) => offered.entry(spec.name.clone()).or_default().push(Entry {
                        spec,
                        validator,
                        tool,
                        source: owner,
                    }),
                    Err(error) => refused.push(Refused {
                        source: source.name().to_owned(),
                        error,
                        upstream: source.namespace().is_some(),
                    }),
                }
            }
        }
        let mut entries = BTreeMap::new();
        let mut conflicts = BTreeMap::new();
        let mut listed = BTreeSet::new();
        for (name, mut offers) in offered {
            let mut owners: Vec<String> = offers.iter().map(|e| e.source.clone()).collect();
            if name == submission.name {
                owners.push(SUBMISSION_SOURCE.to_owned());
            }
            if owners.len() == 1 {
                if let Some(entry) = offers.pop() {
                    entries.insert(name, entry);
                }
            } else {
                if offers.iter().any(|e| e.spec.imported.is_some()) {
                    listed.insert(name.clone());
                }
                conflicts.insert(name, owners);
            }
        }
        Self {
            generation,
            namespaces: sources
                .iter()
                .filter_map(|s| s.namespace().map(str::to_owned))
                .collect(),
            entries,
            submission: submission.clone(),
            conflicts,
            listed,
            refused,
        }
    }

    /// The first problem the configuration alone decides, as a start-up error. What an
    /// upstream lists is not: its problems are refused names, recorded in the snapshot.
    fn strict(&self) -> Result<(), CatalogError> {
        if let Some(r) = self.refused.iter().find(|r| !r.upstream) {
            return Err(r.error.clone());
        }
        let decided = self
            .conflicts
            .iter()
            .find(|(name, _)| !self.listed.contains(*name));
        if let Some((name, owners)) = decided {
            if owners.iter().any(|o| o == SUBMISSION_SOURCE) {
                return Err(CatalogError::SubmissionCollision {
                    submission: name.clone(),
                    tool: name.clone(),
                });
            }
            return Err(CatalogError::Collision {
                name: name.clone(),
                first: owners[0].clone(),
                second: owners[1].clone(),
            });
        }
        Ok(())
    }

    pub fn generation(&self) -> u64 {
        self.generation
    }

    pub fn lookup(&self, name: &str) -> Lookup<'_> {
        if let Some(entry) = self.entries.get(name) {
            return Lookup::Found(entry);
        }
        match self.conflicts.get(name) {
            Some(owners) => Lookup::Conflict(owners),
            None => Lookup::Missing,
        }
    }

    pub fn get(&self, name: &str) -> Option<&Entry> {
        self.entries.get(name)
    }

    /// Whether `name` lies under a source's namespace (`pg.` for `pg.query`), offered now
    /// or not.
    pub fn in_namespace(&self, name: &str) -> bool {
        self.namespaces.iter().any(|ns| {
            name.strip_prefix(ns.as_str())
                .is_some_and(|rest| rest.starts_with('.'))
        })
    }

    /// Every servable runtime tool, by canonical name.
    pub fn specs(&self) -> impl Iterator<Item = &ToolSpec> {
        self.entries.values().map(|e| &e.spec)
    }

    /// The submission extension (unless a source's tool collides with it).
    pub fn submission(&self) -> &ToolSpec {
        &self.submission
    }

    /// Names offered by more than one source, with those sources.
    pub fn conflicts(&self) -> &BTreeMap<String, Vec<String>> {
        &self.conflicts
    }

    /// Whether an upstream's listing takes part in the conflict over `name`.
    pub fn listed_conflict(&self, name: &str) -> bool {
        self.listed.contains(name)
    }

    pub fn refused(&self) -> &[Refused] {
        &self.refused
    }

    /// Runtime tools served (the submission tool not counted).
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

/// The catalog: its sources and the current snapshot.
pub struct Catalog {
    sources: Vec<Arc<dyn Source>>,
    submission: ToolSpec,
    current: RwLock<Arc<Snapshot>>,
}

impl Catalog {
    /// The first generation; a collision or invalid tool the configuration alone decides
    /// refuses the catalog (one an upstream's listing causes is recorded, its names
    /// refused).
    pub fn new(sources: Vec<Arc<dyn Source>>, submission: ToolSpec) -> Result<Self, CatalogError> {
        check_spec(&submission)?;
        let first = Snapshot::build(1, &sources, &submission);
        first.strict()?;
        Ok(Self {
            sources,
            submission,
            current: RwLock::new(Arc::new(first)),
        })
    }

    /// The error for a name no tool answers to: `unavailable` when it lies in the
    /// namespace (`pg.` or, as a compat wire name, `pg_`) of a source whose tools cannot
    /// be known now, with why; else `unknown_tool`.
    pub fn unknown(&self, name: &str) -> ToolError {
        for source in &self.sources {
            let (Some(ns), Some(why)) = (source.namespace(), source.unavailable()) else {
                continue;
            };
            if name
                .strip_prefix(ns)
                .is_some_and(|rest| rest.starts_with(['.', '_']))
            {
                return ToolError::new(
                    ToolErrorCode::Unavailable,
                    format!("no tool named {name:?} is known now: {why}"),
                );
            }
        }
        ToolError::new(
            ToolErrorCode::UnknownTool,
            format!("no tool named {name:?}"),
        )
    }

    /// The current snapshot.
    pub fn snapshot(&self) -> Arc<Snapshot> {
        self.current.read().clone()
    }

    /// Re-read every source into the next generation (a source changed). Conflicts and
    /// invalid tools never refuse the catalog here: they are recorded in the snapshot.
    pub fn rebuild(&self) -> Arc<Snapshot> {
        let mut current = self.current.write();
        let next = Arc::new(Snapshot::build(
            current.generation + 1,
            &self.sources,
            &self.submission,
        ));
        *current = next.clone();
        next
    }
}

/// The tool-error edge of the job service: what a caller is told.
impl From<crate::jobs::JobError> for ToolError {
    fn from(e: crate::jobs::JobError) -> Self {
        use crate::jobs::JobError;
        let code = match &e {
            JobError::NotFound(_) => ToolErrorCode::InvalidArguments,
            JobError::Busy(_) => ToolErrorCode::Busy,
            JobError::Elsewhere(_) => ToolErrorCode::Unavailable,
            JobError::Store(store) => return ToolError::store(store, "job store"),
        };
        ToolError::new(code, e.to_string())
    }
}

/// The tool-error edge of the grant service.
impl From<crate::grants::GrantError> for ToolError {
    fn from(e: crate::grants::GrantError) -> Self {
        use crate::grants::GrantError;
        let code = match &e {
            GrantError::Invalid(_) | GrantError::NotYours(_) => ToolErrorCode::InvalidArguments,
            GrantError::TooMany { .. } => ToolErrorCode::Busy,
            GrantError::Store(store) => return ToolError::store(store, "grant store"),
        };
        ToolError::new(code, e.to_string())
    }
}

/// Whether `spec` can join a catalog: what a source checks before it offers a tool it
/// did not write (an upstream's), so a bad one is refused with its reason, not at start-up.
pub fn check(spec: &ToolSpec) -> Result<(), CatalogError> {
    check_spec(spec).map(drop)
}

fn check_spec(spec: &ToolSpec) -> Result<Option<jsonschema::Validator>, CatalogError> {
    crate::config::check_name(&spec.name).map_err(|problem| CatalogError::BadName {
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
    // An imported schema is the upstream's data: it is shown, never compiled here (its
    // server checks its own arguments), so a hostile schema costs nothing to hold.
    if spec.imported.is_some() {
        return Ok(None);
    }
    jsonschema::validator_for(&Value::Object(spec.input_schema.clone()))
        .map(Some)
        .map_err(|e| bad(e.to_string()))
}

/// Validate arguments against the entry's schema; they are handed back (never copied:
/// a large argument is held once).
pub fn validate_args(entry: &Entry, args: Args) -> Result<Args, ToolError> {
    match &entry.validator {
        Some(validator) => validate_with(validator, args),
        None => Ok(args),
    }
}

fn validate_with(validator: &jsonschema::Validator, args: Args) -> Result<Args, ToolError> {
    let value = Value::Object(args);
    let problems: Vec<String> = validator
        .iter_errors(&value)
        .take(3)
        .map(|e| {
            let at = e.instance_path().to_string();
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
    use serde_json::json;

    use super::*;
    use crate::config::check_name;

    struct Fake(ToolSpec);
    impl HostTool for Fake {
        fn spec(&self) -> ToolSpec {
            self.0.clone()
        }
        fn call<'a>(&'a self, _ctx: &'a ToolContext<'a>, _args: Args) -> ToolFuture<'a> {
            Box::pin(async { Ok(ToolOutput::Text("ok".into())) })
        }
    }

    fn spec(name: &str, schema: Value) -> Arc<dyn HostTool> {
        Arc::new(Fake(ToolSpec {
            name: name.into(),
            description: "a tool".into(),
            input_schema: schema.as_object().cloned().unwrap_or_default(),
            annotations: Annotations::default(),
            imported: None,
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

    fn catalog(tools: Vec<Arc<dyn HostTool>>) -> Result<Catalog, CatalogError> {
        Catalog::new(
            vec![Arc::new(Fixed::new("first-party", tools))],
            submission_spec("agent_submit"),
        )
    }

    #[test]
    fn start_up_validation_refuses_each_defect() {
        let err = |tools| catalog(tools).err().expect("catalog should be refused");
        assert!(matches!(
            err(vec![spec("a b", obj())]),
            CatalogError::BadName { .. }
        ));
        assert_eq!(
            err(vec![spec("a", obj()), spec("a", obj())]),
            CatalogError::Collision {
                name: "a".into(),
                first: "first-party".into(),
                second: "first-party".into()
            }
        );
        let mut empty = spec("a", obj()).spec();
        empty.description = "  ".into();
        assert_eq!(
            err(vec![Arc::new(Fake(empty))]),
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
        let err = catalog(vec![spec("agent_submit", obj())]).err().unwrap();
        assert_eq!(
            err.to_string(),
            "the submission tool \"agent_submit\" collides with the runtime tool \"agent_submit\""
        );
        assert!(catalog(vec![spec("turn", obj())]).is_ok());
    }

    /// A source whose tools the test changes.
    struct Changing {
        name: &'static str,
        tools: parking_lot::Mutex<Vec<Arc<dyn HostTool>>>,
    }

    impl Source for Changing {
        fn name(&self) -> &str {
            self.name
        }
        fn tools(&self) -> Vec<Arc<dyn HostTool>> {
            self.tools.lock().clone()
        }
    }

    #[test]
    fn two_sources_offering_one_name_refuse_the_start_and_name_both() {
        let a = Arc::new(Fixed::new("first-party", vec![spec("x.one", obj())]));
        let b = Arc::new(Fixed::new("upstream pg", vec![spec("x.one", obj())]));
        let err = Catalog::new(vec![a, b], submission_spec("agent_submit"))
            .err()
            .unwrap();
        assert_eq!(
            err.to_string(),
            "tool \"x.one\" is offered by both first-party and upstream pg; give one an alias"
        );
    }

    #[test]
    fn a_later_collision_is_a_conflict_never_first_or_last_wins() {
        let fixed = Arc::new(Fixed::new("first-party", vec![spec("x.one", obj())]));
        let changing = Arc::new(Changing {
            name: "upstream pg",
            tools: parking_lot::Mutex::new(vec![spec("pg.query", obj())]),
        });
        let c = Catalog::new(
            vec![fixed, changing.clone()],
            submission_spec("agent_submit"),
        )
        .unwrap();
        let first = c.snapshot();
        assert_eq!((first.generation(), first.len()), (1, 2));
        // The upstream now also offers x.one, and a tool with a bad name.
        *changing.tools.lock() = vec![
            spec("pg.query", obj()),
            spec("x.one", obj()),
            spec("bad name", obj()),
        ];
        let next = c.rebuild();
        assert_eq!(next.generation(), 2);
        assert!(matches!(
            next.lookup("x.one"),
            Lookup::Conflict(owners) if owners == ["first-party", "upstream pg"]
        ));
        assert!(matches!(next.lookup("pg.query"), Lookup::Found(_)));
        assert!(next.specs().all(|s| s.name != "x.one"));
        assert_eq!(next.refused().len(), 1);
        assert_eq!(next.refused()[0].source, "upstream pg");
        // A request that took the first snapshot keeps it whole.
        assert!(matches!(first.lookup("x.one"), Lookup::Found(e) if e.source() == "first-party"));
        // Taking the tool away resolves the conflict.
        *changing.tools.lock() = vec![spec("pg.query", obj())];
        assert!(matches!(c.rebuild().lookup("x.one"), Lookup::Found(_)));
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
        catalog(vec![Arc::new(Fake(spec))]).expect("the schema compiles");
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
