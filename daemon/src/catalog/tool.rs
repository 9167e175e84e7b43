//! The tool contract: what a tool is (its spec, typed arguments and call), what it gets
//! (the caller, a cancel token, read-only facts about the daemon) and what it answers (a
//! result, or a visible tool error from the closed set). Sources of tools implement it;
//! the session calls it; nothing here knows about carriers or MCP.

use std::fmt;
use std::future::Future;
use std::pin::Pin;

use schemars::JsonSchema;
use serde::de::DeserializeOwned;
use serde_json::{Map, Value, json};
use tokio_util::sync::CancellationToken;

use crate::vocab::{Caller, ToolErrorCode};

/// Tool arguments: always a JSON object.
pub type Args = Map<String, Value>;

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
    /// A store failure as a caller sees it: `unavailable` while the state directory cannot
    /// take a write (it may work again soon), `internal` otherwise. The detail is logged.
    pub fn store(e: &crate::store::StoreError, what: &str) -> Self {
        tracing::error!(error = %e, "{what} failure");
        if crate::store::is_write_failure(e) {
            ToolError::new(
                ToolErrorCode::Unavailable,
                "the daemon cannot write its state directory now (is its disk full?); try again later",
            )
        } else {
            ToolError::new(ToolErrorCode::Internal, format!("the {what} failed"))
        }
    }

    pub fn new(code: ToolErrorCode, message: impl Into<String>) -> Self {
        let mut message = message.into();
        cut(&mut message, MAX_ERROR_MESSAGE);
        Self { code, message }
    }
}

/// Cuts `text` to at most `max` bytes on a character boundary, marked with `…`.
pub fn cut(text: &mut String, max: usize) {
    if text.len() > max {
        let mut end = max;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
        text.push('…');
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
    Job(robota_proto::JobRecord),
    /// A downstream server's `tools/call` result, as the JSON object it sent (content,
    /// `structuredContent`, `isError`, `_meta` and fields unknown to us alike), passed on
    /// as it is (docs/design.md §13.4).
    Passthrough(Map<String, Value>),
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
    /// Where the call's progress goes, if its caller asked for it.
    pub progress: Progress,
    pub host: &'a dyn HostView,
}

/// How far a call has come: the fields of MCP's `notifications/progress`.
#[derive(Debug, Clone, PartialEq)]
pub struct ProgressUpdate {
    pub progress: f64,
    pub total: Option<f64>,
    pub message: Option<String>,
}

/// Where a call reports its progress: to its caller when the caller asked for progress,
/// nowhere otherwise. An update replaces one not yet sent, so a tool may report as often
/// as it likes and the caller gets the latest at the pace the carrier sends them.
#[derive(Debug, Clone, Default)]
pub struct Progress(Option<tokio::sync::watch::Sender<Option<ProgressUpdate>>>);

impl Progress {
    /// A sink and the receiver its updates reach (the latest one, once read).
    pub fn channel() -> (Self, tokio::sync::watch::Receiver<Option<ProgressUpdate>>) {
        let (tx, rx) = tokio::sync::watch::channel(None);
        (Self(Some(tx)), rx)
    }

    /// Whether the caller asked for progress (otherwise reporting is a no-op).
    pub fn wanted(&self) -> bool {
        self.0.is_some()
    }

    pub fn report(&self, update: ProgressUpdate) {
        if let Some(tx) = &self.0 {
            tx.send_replace(Some(update));
        }
    }
}

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
    /// returns the first result without a second effect (docs/design.md §11.2).
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
pub(super) fn idempotency_key_schema() -> Value {
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
    /// What policy reads (and, for first-party tools, what clients are shown). An imported
    /// tool's are always the defaults: nothing an upstream claims makes it read-only.
    pub annotations: Annotations,
    /// Set for a tool imported from a downstream MCP server.
    pub imported: Option<Imported>,
}

/// Where an imported tool comes from, and how its server described it.
#[derive(Debug, Clone, PartialEq)]
pub struct Imported {
    /// The upstream's configured name (the prefix of the canonical name).
    pub upstream: String,
    /// The tool's own name on the upstream.
    pub tool: String,
    /// The upstream's definition as it listed it (`title`, `annotations`, `outputSchema`,
    /// `icons`, `_meta`, …) but its name and input schema, which the spec holds: shown to
    /// clients under the wire name, never read by policy.
    pub listing: Map<String, Value>,
}

/// The `_meta` key naming an imported tool's upstream and original name, on `tools/list`
/// and on its results: `{"name": <upstream>, "tool": <its own name>}`.
pub const UPSTREAM_META: &str = "io.robota/upstream";

/// The `_meta` key of a tool error the daemon made itself (`{"by": "robota-mcpd", "code"}`),
/// never of content an upstream made: the daemon's `io.robota/` keys are taken out of
/// everything an upstream sends, so an upstream cannot pass its content off as the
/// daemon's error.
pub const ERROR_META: &str = "io.robota/error";

/// The prefix of the daemon's own `_meta` keys.
const OWN_META_PREFIX: &str = "io.robota/";

/// Whether `key` is in the daemon's own `_meta` namespace, in any case: such keys are
/// taken out of what an upstream sends (a result's `_meta`, a listed tool's), so that
/// nothing an upstream made reads as the daemon's, to a client that compares keys
/// without regard to case either.
pub fn is_own_meta(key: &str) -> bool {
    key.get(..OWN_META_PREFIX.len())
        .is_some_and(|head| head.eq_ignore_ascii_case(OWN_META_PREFIX))
}

impl Imported {
    /// The value of [`UPSTREAM_META`].
    pub fn meta(&self) -> Value {
        json!({"name": self.upstream, "tool": self.tool})
    }
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
            imported: None,
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
