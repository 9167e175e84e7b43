//! Configuration: TOML parsed into raw serde types, then validated into [`Config`].
//!
//! Parsing rejects unknown keys and reports the key path of a type error
//! (`loopback.listen: invalid socket address syntax`). Validation then collects every
//! semantic problem at once, each with its key path. Nothing here reads the process
//! environment: the few environment-derived defaults arrive in an [`Environment`] value.

use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

use serde::Deserialize;

mod remote;
mod tools;
mod upstreams;
mod values;
pub use remote::{IntrospectionConfig, RemoteConfig, ThrottleConfig, TlsFiles};
pub use tools::{
    DockerTool, FileTool, JOB_OUTPUT_DEFAULT, JobTemplate, NewFiles, PermissionsTool, ServiceTool,
    ToolsConfig, check_template_name,
};
pub use upstreams::{
    Backoff, Children, Confine, HttpTarget, Network, RESPONSE_LIMIT_CEILING,
    RESPONSE_LIMIT_DEFAULT, STREAM_LIMIT_CEILING, STREAM_LIMIT_DEFAULT, UpstreamConfig,
    UpstreamEndpoint, UpstreamProtocol, check_upstream_name,
};
pub use values::{
    KeyRefresh, KeySource, MAX_NAME_LEN, PublicUrl, caller_matches, check_caller_pattern,
    check_name, holds_public, parse_net,
};

/// The configuration used when neither `--config` nor the system file exists.
pub const EMBEDDED_DEFAULT: &str = include_str!("default-config.toml");

/// Where the packaged daemon looks for its configuration.
pub const SYSTEM_CONFIG_PATH: &str = "/etc/robota-mcpd/config.toml";

/// Hard ceilings (docs/design.md §7); configured values above them are errors.
pub const REQUEST_BODY_CEILING: u64 = 16 * 1024 * 1024;
pub const TOOL_RESULT_CEILING: u64 = 64 * 1024 * 1024;
/// Default and ceiling of `[limits] request_memory`.
pub const REQUEST_MEMORY_DEFAULT: u64 = 128 * 1024 * 1024;
pub const REQUEST_MEMORY_CEILING: u64 = 4 * 1024 * 1024 * 1024;
/// Default and ceiling of `[limits] upstream_memory`.
pub const UPSTREAM_MEMORY_DEFAULT: u64 = 256 * 1024 * 1024;
pub const UPSTREAM_MEMORY_CEILING: u64 = 4 * 1024 * 1024 * 1024;

/// Environment-derived inputs to defaults, captured once by `main`.
#[derive(Debug, Clone, Default)]
pub struct Environment {
    /// `$RUNTIME_DIRECTORY` (set by systemd's `RuntimeDirectory=`).
    pub runtime_directory: Option<PathBuf>,
    /// `$STATE_DIRECTORY` (set by systemd's `StateDirectory=`).
    pub state_directory: Option<PathBuf>,
    /// `$XDG_RUNTIME_DIR`.
    pub xdg_runtime_dir: Option<PathBuf>,
    /// `$XDG_STATE_HOME`, else `$HOME/.local/state`, used only when not root.
    pub xdg_state_home: Option<PathBuf>,
    pub is_root: bool,
}

impl Environment {
    pub fn from_process() -> Self {
        let var = |name: &str| {
            std::env::var_os(name)
                .filter(|v| !v.is_empty())
                .map(PathBuf::from)
        };
        let xdg_state_home =
            var("XDG_STATE_HOME").or_else(|| var("HOME").map(|h| h.join(".local/state")));
        Self {
            runtime_directory: var("RUNTIME_DIRECTORY"),
            state_directory: var("STATE_DIRECTORY"),
            xdg_runtime_dir: var("XDG_RUNTIME_DIR"),
            xdg_state_home,
            is_root: nix::unistd::geteuid().is_root(),
        }
    }

    fn default_runtime_dir(&self) -> PathBuf {
        // systemd may pass several colon-separated directories; the first is ours.
        if let Some(dir) = &self.runtime_directory {
            let first = dir
                .to_string_lossy()
                .split(':')
                .next()
                .unwrap_or_default()
                .to_owned();
            return PathBuf::from(first);
        }
        if let Some(dir) = &self.xdg_runtime_dir {
            return dir.join("robota-mcpd");
        }
        PathBuf::from("/run/robota-mcpd")
    }

    fn default_state_dir(&self) -> PathBuf {
        if let Some(dir) = &self.state_directory {
            let first = dir
                .to_string_lossy()
                .split(':')
                .next()
                .unwrap_or_default()
                .to_owned();
            return PathBuf::from(first);
        }
        match (&self.xdg_state_home, self.is_root) {
            (Some(home), false) => home.join("robota-mcpd"),
            _ => PathBuf::from("/var/lib/robota-mcpd"),
        }
    }
}

/// A validated configuration.
#[derive(Debug, Clone)]
pub struct Config {
    pub state_dir: PathBuf,
    pub runtime_dir: PathBuf,
    pub control: ControlConfig,
    pub session: SessionConfig,
    pub stdio: StdioConfig,
    pub loopback: Option<LoopbackConfig>,
    pub remote: Option<RemoteConfig>,
    pub metrics: Option<SocketAddr>,
    pub limits: Limits,
    pub policy: Vec<PolicyRule>,
    pub tools: ToolsConfig,
    /// Downstream MCP servers, by name (sorted).
    pub upstreams: Vec<UpstreamConfig>,
    /// Settings that are valid but probably not what was meant: `check-config` prints
    /// them and still succeeds, the daemon logs them at start.
    pub warnings: Vec<ConfigIssue>,
}

#[derive(Debug, Clone)]
pub struct ControlConfig {
    pub socket: PathBuf,
    pub allow_uids: Vec<u32>,
    pub allow_gids: Vec<u32>,
}

#[derive(Debug, Clone)]
pub struct SessionConfig {
    pub submission_tool: String,
    pub turn: Option<TurnConfig>,
}

#[derive(Debug, Clone)]
pub struct TurnConfig {
    pub argv: Vec<String>,
    pub timeout: Duration,
    pub working_dir: Option<PathBuf>,
}

/// The stdio carrier (`robota-mcpd --stdio`).
#[derive(Debug, Clone)]
pub struct StdioConfig {
    pub wire_names: WireNameProfile,
    /// Explicit wire names: canonical name → wire name.
    pub aliases: BTreeMap<String, String>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct LoopbackConfig {
    pub listen: SocketAddr,
    pub path: String,
    pub wire_names: WireNameProfile,
    /// Explicit wire names: canonical name → wire name.
    pub aliases: BTreeMap<String, String>,
    pub bounds: HttpLimits,
}

/// Connection and request bounds of an HTTP carrier.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HttpLimits {
    pub max_connections: usize,
    /// Connections from one client address (IPv6: one /64); `None`: no per-address cap.
    pub max_connections_per_address: Option<usize>,
    pub max_in_flight: usize,
    /// Of those, what one caller may hold (a bearer's label, an OAuth client and subject).
    pub max_in_flight_per_caller: usize,
    pub max_header_bytes: usize,
    pub header_timeout: Duration,
    /// How long an admitted request may take to deliver its body (then 408).
    pub body_timeout: Duration,
    /// How long an HTTP/2 connection with no open stream is kept after its last answer.
    pub idle_timeout: Duration,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WireNameProfile {
    /// Names as they are (`system.info`).
    Canonical,
    /// `.` replaced by `_` for clients that accept only `[A-Za-z0-9_-]{1,64}`.
    Compat,
}

#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub request_body: u64,
    pub tool_result: u64,
    /// Memory the requests of one HTTP carrier may hold while they are read and parsed
    /// (see `carrier::endpoint`): at least twice `request_body`.
    pub request_memory: u64,
    /// Memory what every upstream sends may hold while it is parsed and passed on, and
    /// their tool lists while they are served (see `upstream`): at least every upstream's
    /// `response_limit`.
    pub upstream_memory: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PolicyRule {
    pub callers: Vec<String>,
    /// Scopes the caller's access token must all carry for the rule to match; empty: no
    /// requirement. A caller without a token never matches a rule that lists some.
    pub scopes: Vec<String>,
    pub tools: Vec<String>,
    pub decision: Decision,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Decision {
    Allow,
    Deny,
    /// Needs an operator-approved grant (`interactive_permission_required` until then).
    Grant,
    /// Every call needs an operator's approval of that exact call (caller, tool,
    /// arguments), used once.
    ApproveEach,
}

/// One problem in a configuration, with the key path it concerns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigIssue {
    pub path: String,
    pub problem: String,
    /// Where in the text (line, column, from 1), when the key or the fault is found there.
    pub at: Option<(usize, usize)>,
}

impl fmt::Display for ConfigIssue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.at {
            Some((line, column)) => write!(
                f,
                "{} (line {line}, column {column}): {}",
                self.path, self.problem
            ),
            None => write!(f, "{}: {}", self.path, self.problem),
        }
    }
}

/// Why a configuration was refused: every problem found, each with its key path.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("invalid configuration ({origin}):{}", render_issues(.issues))]
    Invalid {
        origin: String,
        issues: Vec<ConfigIssue>,
    },
}

fn render_issues(issues: &[ConfigIssue]) -> String {
    issues.iter().map(|i| format!("\n  {i}")).collect()
}

impl ConfigError {
    pub fn issues(&self) -> &[ConfigIssue] {
        match self {
            ConfigError::Invalid { issues, .. } => issues,
            ConfigError::Read { .. } => &[],
        }
    }
}

/// Where a configuration came from, for messages.
#[derive(Debug, Clone)]
pub enum Source {
    Embedded,
    File(PathBuf),
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Source::Embedded => f.write_str("embedded default"),
            Source::File(p) => write!(f, "{}", p.display()),
        }
    }
}

/// How the configuration is found: `--config PATH`, else the system file if it exists,
/// else the embedded default. A reload finds it the same way start did.
#[derive(Debug, Clone)]
pub struct Loader {
    pub explicit: Option<PathBuf>,
    pub env: Environment,
}

/// A configuration as loaded, with where it came from and the SHA-256 of its text.
pub struct Loaded {
    pub config: Config,
    pub source: Source,
    pub sha256: [u8; 32],
    /// The text read, so later checks can say on which line a key is.
    pub text: String,
}

impl Loader {
    /// The text `load` would read now, and where from.
    fn text(&self) -> Result<(String, Source), ConfigError> {
        Ok(match &self.explicit {
            Some(path) => (read(path)?, Source::File(path.to_owned())),
            None if Path::new(SYSTEM_CONFIG_PATH).exists() => {
                let path = PathBuf::from(SYSTEM_CONFIG_PATH);
                (read(&path)?, Source::File(path))
            }
            None => (EMBEDDED_DEFAULT.to_owned(), Source::Embedded),
        })
    }

    pub fn load(&self) -> Result<Loaded, ConfigError> {
        let (text, source) = self.text()?;
        let config = parse(&text, &self.env).map_err(|issues| ConfigError::Invalid {
            origin: source.to_string(),
            issues,
        })?;
        Ok(Loaded {
            config,
            source,
            sha256: sha256(&text),
            text,
        })
    }

    /// The SHA-256 of what `load` would read now, or why it cannot be read.
    pub fn sha256_now(&self) -> Result<[u8; 32], ConfigError> {
        self.text().map(|(text, _)| sha256(&text))
    }
}

fn sha256(text: &str) -> [u8; 32] {
    use sha2::Digest;
    sha2::Sha256::digest(text.as_bytes()).into()
}

/// The most a configuration file may hold: far beyond any real one.
pub const MAX_CONFIG_BYTES: u64 = 1024 * 1024;

/// Reads a configuration file: a regular file (a FIFO, a device or a directory is refused
/// without blocking or reading it) of at most [`MAX_CONFIG_BYTES`], in UTF-8. `status`
/// and every reload read it, so it must never stall or exhaust the daemon.
fn read(path: &Path) -> Result<String, ConfigError> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let fail = |source| ConfigError::Read {
        path: path.to_owned(),
        source,
    };
    let refuse = |why: String| fail(std::io::Error::new(std::io::ErrorKind::InvalidData, why));
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(nix::libc::O_NONBLOCK | nix::libc::O_NOCTTY)
        .open(path)
        .map_err(fail)?;
    let meta = file.metadata().map_err(fail)?;
    if !meta.is_file() {
        return Err(refuse("not a regular file".into()));
    }
    if meta.len() > MAX_CONFIG_BYTES {
        return Err(refuse(format!(
            "{} bytes, over the {MAX_CONFIG_BYTES} a configuration may hold",
            meta.len()
        )));
    }
    let mut bytes = Vec::new();
    file.take(MAX_CONFIG_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(fail)?;
    if bytes.len() as u64 > MAX_CONFIG_BYTES {
        return Err(refuse(format!(
            "over the {MAX_CONFIG_BYTES} bytes a configuration may hold"
        )));
    }
    String::from_utf8(bytes).map_err(|_| refuse("not UTF-8 text".into()))
}

/// Parse and validate configuration text. Every syntax error is reported (the parser
/// recovers and goes on); of the errors in the document's shape (an unknown key, a value
/// of the wrong type) the first; of the validation problems every one. Each names its key
/// and, where the text shows it, its line and column.
pub fn parse(text: &str, env: &Environment) -> Result<Config, Vec<ConfigIssue>> {
    let (table, syntax) = toml::de::DeTable::parse_recoverable(text);
    if !syntax.is_empty() {
        let mut issues: Vec<ConfigIssue> = syntax
            .iter()
            .map(|e| ConfigIssue {
                path: "syntax".into(),
                problem: one_line(e.message()),
                at: e.span().map(|span| line_column(text, span.start)),
            })
            .collect();
        issues.sort_by_key(|i| i.at);
        return Err(issues);
    }
    let raw: RawConfig = serde_path_to_error::deserialize(toml::Deserializer::from(table.clone()))
        .map_err(|e| {
            let path = e.path().to_string();
            let path = if path == "." {
                "<document>".to_owned()
            } else {
                path
            };
            vec![ConfigIssue {
                at: e
                    .inner()
                    .span()
                    .map(|span| line_column(text, span.start))
                    .or_else(|| locate(text, table.get_ref(), &path)),
                path,
                problem: one_line(e.inner().message()),
            }]
        })?;
    let located = |mut issue: ConfigIssue| {
        issue.at = issue
            .at
            .or_else(|| locate(text, table.get_ref(), &issue.path));
        issue
    };
    match validate(raw, env) {
        Ok(mut config) => {
            config.warnings = config.warnings.into_iter().map(located).collect();
            Ok(config)
        }
        Err(issues) => Err(issues.into_iter().map(located).collect()),
    }
}

/// Give each of `issues` that has no place yet the line and column of its key in `text`.
pub fn locate_all(text: &str, issues: &mut [ConfigIssue]) {
    let (table, _) = toml::de::DeTable::parse_recoverable(text);
    for issue in issues {
        issue.at = issue
            .at
            .or_else(|| locate(text, table.get_ref(), &issue.path));
    }
}

/// Line and column (from 1, the column in characters) of byte `offset` of `text`.
fn line_column(text: &str, offset: usize) -> (usize, usize) {
    let before = &text[..offset.min(text.len())];
    let line_start = before.rfind('\n').map_or(0, |i| i + 1);
    (
        before.matches('\n').count() + 1,
        before[line_start..].chars().count() + 1,
    )
}

/// Where the key `path` (`a.b`, `policy[0].tools[1]`) is written: the deepest part of it
/// the document has.
fn locate(text: &str, table: &toml::de::DeTable<'_>, path: &str) -> Option<(usize, usize)> {
    use toml::de::DeValue;
    let mut parts = Vec::new();
    for segment in path.split('.') {
        let (key, indexes) = segment.split_once('[').unwrap_or((segment, ""));
        parts.push((key, None));
        for index in indexes.split('[') {
            if let Some(i) = index
                .strip_suffix(']')
                .and_then(|i| i.parse::<usize>().ok())
            {
                parts.push(("", Some(i)));
            }
        }
    }
    let mut found = None;
    let mut value: Option<&DeValue<'_>> = None;
    for (key, index) in parts {
        let next = match (value, index) {
            (None, None) => table
                .iter()
                .find(|(k, _)| k.get_ref() == key)
                .map(|(k, v)| (k.span(), v)),
            (Some(DeValue::Table(t)), None) => t
                .iter()
                .find(|(k, _)| k.get_ref() == key)
                .map(|(k, v)| (k.span(), v)),
            (Some(DeValue::Array(items)), Some(i)) => items.get(i).map(|v| (v.span(), v)),
            _ => None,
        };
        let Some((span, next)) = next else { break };
        found = Some(span.start);
        value = Some(next.get_ref());
    }
    found.map(|offset| line_column(text, offset))
}

fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// The longest duration any key takes: far beyond any sensible timeout or grant, and far
/// from where adding it to a clock could overflow.
pub const DURATION_CEILING: Duration = Duration::from_secs(10 * 365 * 86_400);

/// `"60s"`, `"10m"`, `"1h 30m"`; at most [`DURATION_CEILING`].
#[derive(Debug, Clone, Copy)]
struct DurationText(Duration);

impl<'de> Deserialize<'de> for DurationText {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        let d = humantime::parse_duration(&s).map_err(|e| {
            serde::de::Error::custom(format!(
                "invalid duration {s:?} ({e}); write e.g. \"60s\" or \"10m\""
            ))
        })?;
        if d > DURATION_CEILING {
            return Err(serde::de::Error::custom(format!(
                "duration {s:?} is over the most any key takes (10 years)"
            )));
        }
        Ok(DurationText(d))
    }
}

/// `"1MiB"`, `"16 KiB"`, `"4096"`.
#[derive(Debug, Clone, Copy)]
struct SizeText(u64);

impl<'de> Deserialize<'de> for SizeText {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        size_of(&s)
            .map(SizeText)
            .map_err(|e| serde::de::Error::custom(format!("{e}; write e.g. \"1MiB\"")))
    }
}

/// The bytes a size text such as `"1MiB"` names.
fn size_of(text: &str) -> Result<u64, String> {
    bytesize::ByteSize::from_str(text.trim())
        .map(|b| b.as_u64())
        .map_err(|e| format!("invalid size {text:?} ({e})"))
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    #[serde(default)]
    daemon: RawDaemon,
    #[serde(default)]
    control: RawControl,
    #[serde(default)]
    session: RawSession,
    #[serde(default)]
    stdio: RawStdio,
    #[serde(default)]
    loopback: RawLoopback,
    remote: Option<remote::RawRemote>,
    #[serde(default)]
    metrics: RawMetrics,
    #[serde(default)]
    limits: RawLimits,
    #[serde(default)]
    policy: Vec<RawPolicy>,
    #[serde(default)]
    tools: tools::RawTools,
    #[serde(default)]
    jobs: BTreeMap<String, tools::RawJob>,
    #[serde(default)]
    upstreams: BTreeMap<String, upstreams::RawUpstream>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawDaemon {
    state_dir: Option<PathBuf>,
    runtime_dir: Option<PathBuf>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawControl {
    socket: Option<PathBuf>,
    #[serde(default)]
    allow_uids: Vec<u32>,
    #[serde(default)]
    allow_gids: Vec<u32>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawSession {
    submission_tool: Option<String>,
    turn: Option<RawTurn>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTurn {
    argv: Vec<String>,
    timeout: Option<DurationText>,
    working_dir: Option<PathBuf>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawStdio {
    wire_names: Option<WireNameProfile>,
    #[serde(default)]
    aliases: BTreeMap<String, String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawLoopback {
    #[serde(default = "yes")]
    enabled: bool,
    listen: Option<String>,
    path: Option<String>,
    wire_names: Option<WireNameProfile>,
    #[serde(default)]
    aliases: BTreeMap<String, String>,
    max_connections: Option<usize>,
    max_connections_per_address: Option<usize>,
    max_in_flight: Option<usize>,
    max_in_flight_per_caller: Option<usize>,
    max_header_bytes: Option<SizeText>,
    header_timeout: Option<DurationText>,
    body_timeout: Option<DurationText>,
    idle_timeout: Option<DurationText>,
}

impl Default for RawLoopback {
    fn default() -> Self {
        Self {
            enabled: true,
            listen: None,
            path: None,
            wire_names: None,
            aliases: BTreeMap::new(),
            max_connections: None,
            max_connections_per_address: None,
            max_in_flight: None,
            max_in_flight_per_caller: None,
            max_header_bytes: None,
            header_timeout: None,
            body_timeout: None,
            idle_timeout: None,
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawMetrics {
    #[serde(default = "yes")]
    enabled: bool,
    listen: Option<String>,
}

impl Default for RawMetrics {
    fn default() -> Self {
        Self {
            enabled: true,
            listen: None,
        }
    }
}

fn yes() -> bool {
    true
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawLimits {
    request_body: Option<SizeText>,
    tool_result: Option<SizeText>,
    request_memory: Option<SizeText>,
    upstream_memory: Option<SizeText>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPolicy {
    callers: Vec<String>,
    #[serde(default)]
    scopes: Vec<String>,
    tools: Vec<String>,
    decision: Decision,
}

/// Collects issues (errors) and warnings during validation.
#[derive(Default)]
struct Issues(Vec<ConfigIssue>, Vec<ConfigIssue>);

impl Issues {
    fn add(&mut self, path: impl Into<String>, problem: impl Into<String>) {
        self.0.push(ConfigIssue {
            path: path.into(),
            problem: problem.into(),
            at: None,
        });
    }

    fn warn(&mut self, path: impl Into<String>, problem: impl Into<String>) {
        self.1.push(ConfigIssue {
            path: path.into(),
            problem: problem.into(),
            at: None,
        });
    }
}

fn validate(raw: RawConfig, env: &Environment) -> Result<Config, Vec<ConfigIssue>> {
    let mut issues = Issues::default();

    let runtime_dir = raw
        .daemon
        .runtime_dir
        .unwrap_or_else(|| env.default_runtime_dir());
    let state_dir = raw
        .daemon
        .state_dir
        .unwrap_or_else(|| env.default_state_dir());
    for (key, dir) in [
        ("daemon.runtime_dir", &runtime_dir),
        ("daemon.state_dir", &state_dir),
    ] {
        if !dir.is_absolute() {
            issues.add(
                key,
                format!("must be an absolute path, got {}", dir.display()),
            );
        }
    }

    let socket = raw
        .control
        .socket
        .unwrap_or_else(|| runtime_dir.join("control.sock"));
    if !socket.is_absolute() {
        issues.add(
            "control.socket",
            format!("must be an absolute path, got {}", socket.display()),
        );
    }
    // sockaddr_un holds 108 bytes including the terminating NUL.
    if socket.as_os_str().len() > 107 {
        issues.add(
            "control.socket",
            "path is longer than a unix socket address allows (107 bytes)",
        );
    }

    let submission_tool = raw
        .session
        .submission_tool
        .unwrap_or_else(|| "agent_submit".to_owned());
    if let Err(problem) = check_name(&submission_tool) {
        issues.add("session.submission_tool", problem);
    }
    let turn = raw.session.turn.and_then(|t| {
        if t.argv.is_empty() || t.argv[0].is_empty() {
            issues.add("session.turn.argv", "must name an executable");
            return None;
        }
        if !Path::new(&t.argv[0]).is_absolute() {
            issues.add(
                "session.turn.argv",
                format!(
                    "the executable must be an absolute path, got {:?}",
                    t.argv[0]
                ),
            );
        }
        let timeout = t.timeout.map_or(Duration::from_secs(600), |d| d.0);
        if timeout.is_zero() {
            issues.add("session.turn.timeout", "must be greater than zero");
        }
        Some(TurnConfig {
            argv: t.argv,
            timeout,
            working_dir: t.working_dir,
        })
    });

    for (canonical, wire) in &raw.stdio.aliases {
        if let Err(problem) = check_name(wire) {
            issues.add(format!("stdio.aliases.{canonical}"), problem);
        }
    }
    let stdio = StdioConfig {
        wire_names: raw.stdio.wire_names.unwrap_or(WireNameProfile::Canonical),
        aliases: raw.stdio.aliases,
    };

    let loopback = if raw.loopback.enabled {
        let l = raw.loopback;
        let listen_text = l.listen.unwrap_or_else(|| "127.0.0.1:8765".to_owned());
        let listen = match listen_text.parse::<SocketAddr>() {
            Ok(addr) if addr.ip() != std::net::Ipv4Addr::LOCALHOST => {
                issues.add(
                    "loopback.listen",
                    format!("the loopback carrier binds 127.0.0.1 only, got {addr}"),
                );
                addr
            }
            Ok(addr) => addr,
            Err(_) => {
                issues.add(
                    "loopback.listen",
                    format!("not an address:port, got {listen_text:?}"),
                );
                SocketAddr::from(([127, 0, 0, 1], 0))
            }
        };
        let path = l.path.unwrap_or_else(|| "/mcp".to_owned());
        if !is_endpoint_path(&path) {
            issues.add(
                "loopback.path",
                format!("must be an absolute path without query or fragment, got {path:?}"),
            );
        }
        for (canonical, wire) in &l.aliases {
            if let Err(problem) = check_name(wire) {
                issues.add(format!("loopback.aliases.{canonical}"), problem);
            }
        }
        let bounds = validate_bounds(
            "loopback",
            [
                l.max_connections,
                l.max_in_flight,
                l.max_in_flight_per_caller,
            ],
            (l.max_connections_per_address, None),
            l.max_header_bytes,
            [l.header_timeout, l.body_timeout, l.idle_timeout],
            &mut issues,
        );
        Some(LoopbackConfig {
            listen,
            path,
            wire_names: l.wire_names.unwrap_or(WireNameProfile::Canonical),
            aliases: l.aliases,
            bounds,
        })
    } else {
        None
    };

    let remote = match raw.remote {
        Some(r) if r.enabled => remote::validate_remote(r, &mut issues),
        _ => None,
    };

    let metrics = if raw.metrics.enabled {
        let text = raw
            .metrics
            .listen
            .unwrap_or_else(|| "127.0.0.1:9464".to_owned());
        match text.parse::<SocketAddr>() {
            Ok(addr) => Some(addr),
            Err(_) => {
                issues.add(
                    "metrics.listen",
                    format!("not an address:port, got {text:?}"),
                );
                None
            }
        }
    } else {
        None
    };

    // Two listeners on one port cannot both bind (an unspecified address takes the port
    // on every address).
    let mut listens: Vec<(&str, SocketAddr)> = Vec::new();
    if let Some(l) = &loopback {
        listens.push(("loopback.listen", l.listen));
    }
    if let Some(r) = &remote {
        listens.push(("remote.listen", r.listen));
    }
    if let Some(m) = metrics {
        listens.push(("metrics.listen", m));
    }
    for (i, (key, addr)) in listens.iter().enumerate() {
        for (other, theirs) in &listens[..i] {
            let overlap = addr.port() == theirs.port()
                && addr.port() != 0
                && (addr.ip() == theirs.ip()
                    || addr.ip().is_unspecified()
                    || theirs.ip().is_unspecified());
            if overlap {
                issues.add(
                    *key,
                    format!("{addr} is also {other} ({theirs}): two listeners cannot share a port"),
                );
            }
        }
    }

    let request_body = raw.limits.request_body.map_or(1024 * 1024, |s| s.0);
    if request_body == 0 || request_body > REQUEST_BODY_CEILING {
        issues.add(
            "limits.request_body",
            format!("must be between 1 byte and 16MiB, got {request_body} bytes"),
        );
    }
    let tool_result = raw.limits.tool_result.map_or(8 * 1024 * 1024, |s| s.0);
    if tool_result == 0 || tool_result > TOOL_RESULT_CEILING {
        issues.add(
            "limits.tool_result",
            format!("must be between 1 byte and 64MiB, got {tool_result} bytes"),
        );
    }
    let request_memory = raw
        .limits
        .request_memory
        .map_or(REQUEST_MEMORY_DEFAULT, |s| s.0);
    if request_memory < 2 * request_body || request_memory > REQUEST_MEMORY_CEILING {
        issues.add(
            "limits.request_memory",
            format!(
                "must be between twice limits.request_body ({} bytes) and 4GiB, got {request_memory} bytes",
                2 * request_body
            ),
        );
    }

    let mut policy = Vec::with_capacity(raw.policy.len());
    for (i, rule) in raw.policy.into_iter().enumerate() {
        if rule.callers.is_empty() {
            issues.add(
                format!("policy[{i}].callers"),
                "must list at least one caller pattern",
            );
        }
        for (j, caller) in rule.callers.iter().enumerate() {
            if let Err(problem) = check_caller_pattern(caller) {
                issues.add(format!("policy[{i}].callers[{j}]"), problem);
            }
        }
        if rule.tools.is_empty() {
            issues.add(
                format!("policy[{i}].tools"),
                "must list at least one tool pattern",
            );
        }
        for (j, tool) in rule.tools.iter().enumerate() {
            if let Err(problem) = check_tool_pattern(tool) {
                issues.add(format!("policy[{i}].tools[{j}]"), problem);
            }
        }
        for (j, scope) in rule.scopes.iter().enumerate() {
            if let Err(problem) = check_scope(scope) {
                issues.add(format!("policy[{i}].scopes[{j}]"), problem);
            }
        }
        if !rule.scopes.is_empty()
            && !rule
                .callers
                .iter()
                .any(|c| c == "*" || c.starts_with("oauth:"))
        {
            issues.warn(
                format!("policy[{i}].scopes"),
                "only remote callers (oauth:…) hold a token with scopes: this rule never matches",
            );
        }
        policy.push(PolicyRule {
            callers: rule.callers,
            scopes: rule.scopes,
            tools: rule.tools,
            decision: rule.decision,
        });
    }

    let tools = tools::validate(raw.tools, raw.jobs, &mut issues);
    let upstreams = upstreams::validate(raw.upstreams, &mut issues);
    let upstream_memory = raw
        .limits
        .upstream_memory
        .map_or(UPSTREAM_MEMORY_DEFAULT, |s| s.0);
    let floor = upstreams
        .iter()
        .map(|u| u.response_limit)
        .fold(1024 * 1024, u64::max);
    if upstream_memory < floor || upstream_memory > UPSTREAM_MEMORY_CEILING {
        issues.add(
            "limits.upstream_memory",
            format!(
                "must be between {floor} bytes (1MiB, and every upstream's response_limit) and 4GiB, got {upstream_memory} bytes"
            ),
        );
    }

    let mut remote = remote;
    if let Some(r) = &mut remote {
        let named = r
            .scopes
            .iter()
            .chain(r.tool_scopes.iter().flat_map(|(_, scopes)| scopes))
            .chain(policy.iter().flat_map(|rule| &rule.scopes));
        for scope in named {
            if !r.scopes_supported.contains(scope) {
                r.scopes_supported.push(scope.clone());
            }
        }
    }

    if !issues.0.is_empty() {
        return Err(issues.0);
    }
    Ok(Config {
        state_dir,
        runtime_dir,
        control: ControlConfig {
            socket,
            allow_uids: raw.control.allow_uids,
            allow_gids: raw.control.allow_gids,
        },
        session: SessionConfig {
            submission_tool,
            turn,
        },
        stdio,
        loopback,
        remote,
        metrics,
        limits: Limits {
            request_body,
            tool_result,
            request_memory,
            upstream_memory,
        },
        policy,
        tools,
        upstreams,
        warnings: issues.1,
    })
}

/// Bounds shared by the HTTP carriers: `[max_connections, max_in_flight,
/// max_in_flight_per_caller]`, the
/// per-address cap (given, default), header bytes, and the head, body and idle deadlines,
/// each checked against its range.
fn validate_bounds(
    section: &str,
    counts: [Option<usize>; 3],
    (per_address, per_address_default): (Option<usize>, Option<usize>),
    max_header_bytes: Option<SizeText>,
    [header_timeout, body_timeout, idle_timeout]: [Option<DurationText>; 3],
    issues: &mut Issues,
) -> HttpLimits {
    let mut count = |key: &str, value: Option<usize>, default: usize| {
        let v = value.unwrap_or(default);
        if v == 0 || v > 65_536 {
            issues.add(
                format!("{section}.{key}"),
                format!("must be between 1 and 65536, got {v}"),
            );
        }
        v
    };
    let max_connections = count("max_connections", counts[0], 64);
    let max_in_flight = count("max_in_flight", counts[1], 32);
    // A share of another bound, 1 to all of it: the value given, if it is one.
    let mut share = |key: &str, value: Option<usize>, of: &str, bound: usize| {
        let n = value?;
        if n == 0 || n > bound {
            issues.add(
                format!("{section}.{key}"),
                format!("must be between 1 and {of} ({bound}), got {n}"),
            );
            return None;
        }
        Some(n)
    };
    // Half by default: a caller that keeps every slot it can get busy (bodies sent
    // slowly, calls that never end) leaves the other half to everyone else.
    let max_in_flight_per_caller = share(
        "max_in_flight_per_caller",
        counts[2],
        "max_in_flight",
        max_in_flight,
    )
    .unwrap_or(max_in_flight.div_ceil(2));
    let max_connections_per_address = share(
        "max_connections_per_address",
        per_address,
        "max_connections",
        max_connections,
    )
    .or(per_address_default.map(|n| n.min(max_connections)));
    let max_header_bytes = max_header_bytes.map_or(16 * 1024, |s| s.0);
    if !(8 * 1024..=1024 * 1024).contains(&max_header_bytes) {
        issues.add(
            format!("{section}.max_header_bytes"),
            format!("must be between 8KiB and 1MiB, got {max_header_bytes} bytes"),
        );
    }
    let mut deadline = |key: &str, value: Option<DurationText>, default: u64| {
        let d = value.map_or(Duration::from_secs(default), |d| d.0);
        if d.is_zero() || d > Duration::from_secs(300) {
            issues.add(format!("{section}.{key}"), "must be between 1ms and 300s");
        }
        d
    };
    let header_timeout = deadline("header_timeout", header_timeout, 5);
    let body_timeout = deadline("body_timeout", body_timeout, 30);
    let idle_timeout = deadline("idle_timeout", idle_timeout, 30);
    HttpLimits {
        max_connections,
        max_connections_per_address,
        max_in_flight,
        max_in_flight_per_caller,
        max_header_bytes: usize::try_from(max_header_bytes).unwrap_or(usize::MAX),
        header_timeout,
        body_timeout,
        idle_timeout,
    }
}

/// A scope token as RFC 6749 §3.3 allows (printable ASCII without space, `"` or `\`).
pub fn check_scope(scope: &str) -> Result<(), String> {
    let ok = !scope.is_empty()
        && scope
            .chars()
            .all(|c| c.is_ascii_graphic() && c != '"' && c != '\\');
    if ok {
        Ok(())
    } else {
        Err(format!("not a scope token: {scope:?}"))
    }
}

/// A canonical tool-name pattern: letters, digits and `_ . - *`.
pub fn check_tool_pattern(pattern: &str) -> Result<(), String> {
    if pattern.is_empty()
        || pattern.len() > MAX_NAME_LEN
        || !pattern
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "_.-*".contains(c))
    {
        return Err(format!("not a tool name pattern: {pattern:?}"));
    }
    Ok(())
}

fn is_endpoint_path(path: &str) -> bool {
    path.starts_with('/')
        && !path.contains(['?', '#', ' '])
        && path.parse::<http::uri::PathAndQuery>().is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(super) fn env() -> Environment {
        Environment {
            runtime_directory: Some("/run/robota-mcpd".into()),
            state_directory: Some("/var/lib/robota-mcpd".into()),
            ..Environment::default()
        }
    }

    pub(super) fn issues(text: &str) -> Vec<ConfigIssue> {
        parse(text, &env()).expect_err("config should be refused")
    }

    #[test]
    fn a_configuration_path_that_is_no_small_regular_file_is_refused_at_once() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("fifo");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        let big = dir.path().join("big.toml");
        std::fs::write(&big, vec![b'#'; MAX_CONFIG_BYTES as usize + 1]).unwrap();
        for (path, want) in [
            (fifo.as_path(), "not a regular file"),
            (Path::new("/dev/zero"), "not a regular file"),
            (dir.path(), "not a regular file"),
            (big.as_path(), "over the"),
        ] {
            let started = std::time::Instant::now();
            let e = read(path).expect_err("refused");
            assert!(
                crate::error_chain(&e).contains(want),
                "{path:?}: {}",
                crate::error_chain(&e)
            );
            assert!(
                started.elapsed() < std::time::Duration::from_secs(1),
                "{path:?} blocked"
            );
        }
    }

    #[test]
    fn every_syntax_error_is_reported_with_its_line_and_column() {
        let found = issues("[loopback]\nlisten = 127.0.0.1\n\n[remote\nx = 1\n");
        assert!(found.len() >= 2, "{found:?}");
        assert_eq!(found[0].at, Some((2, 15)), "{found:?}");
        assert_eq!(found[1].at.map(|(line, _)| line), Some(4), "{found:?}");
        assert!(
            found[0]
                .to_string()
                .starts_with("syntax (line 2, column 15): "),
            "{}",
            found[0]
        );
    }

    #[test]
    fn an_unknown_key_and_a_bad_value_name_their_line() {
        let found = issues("[loopback]\nlisten = \"127.0.0.1:1\"\n\nbogus = 1\n");
        assert_eq!(found.len(), 1, "{found:?}");
        assert_eq!(found[0].path, "loopback.bogus");
        assert_eq!(found[0].at.map(|(line, _)| line), Some(4), "{found:?}");
        let found = issues(
            "[[policy]]\ncallers = [\"*\"]\ntools = [\"x\"]\ndecision = \"allow\"\n\n[[policy]]\ncallers = [\"*\"]\ntools = [\"\"]\ndecision = \"allow\"\n",
        );
        let issue = found
            .iter()
            .find(|i| i.path == "policy[1].tools[0]")
            .unwrap_or_else(|| panic!("{found:?}"));
        assert_eq!(issue.at.map(|(line, _)| line), Some(8), "{found:?}");
    }

    #[test]
    fn every_section_the_embedded_default_shows_in_comments_is_valid() {
        // Uncomment every `# [section]` and `# key = value` line.
        let text: String = EMBEDDED_DEFAULT
            .lines()
            .map(|line| match line.strip_prefix("# ") {
                Some(rest)
                    if rest.starts_with('[')
                        || rest.split_once(" = ").is_some_and(|(k, _)| {
                            !k.is_empty() && k.chars().all(|c| c.is_ascii_lowercase() || c == '_')
                        }) =>
                {
                    rest.replace("group = \"app\"", "group = \"0\"")
                }
                _ => line.to_owned(),
            })
            .map(|line| line + "\n")
            .collect();
        for section in [
            "[tools.file]",
            "[tools.service]",
            "[tools.docker]",
            "[tools.permissions]",
            "[jobs.backup]",
            "[remote]",
            "[session.turn]",
        ] {
            assert!(
                text.contains(&format!("\n{section}")),
                "{section} is not shown"
            );
        }
        let config = parse(&text, &env()).unwrap_or_else(|issues| panic!("{issues:?}\n{text}"));
        assert_eq!(config.tools.jobs["backup"].argv[0], "/usr/local/bin/backup");
        assert_eq!(config.tools.file.write_roots, [PathBuf::from("/srv/app")]);
        assert!(config.remote.is_some());
    }

    #[test]
    fn embedded_default_is_valid() {
        let config = parse(EMBEDDED_DEFAULT, &env()).unwrap();
        let loopback = config.loopback.unwrap();
        assert_eq!(loopback.listen, "127.0.0.1:8765".parse().unwrap());
        assert_eq!(loopback.path, "/mcp");
        assert_eq!(config.metrics, Some("127.0.0.1:9464".parse().unwrap()));
        assert_eq!(
            config.control.socket,
            PathBuf::from("/run/robota-mcpd/control.sock")
        );
        assert_eq!(config.session.submission_tool, "agent_submit");
        assert_eq!(config.limits.request_body, 1024 * 1024);
        assert_eq!(config.limits.tool_result, 8 * 1024 * 1024);
    }

    #[test]
    fn runtime_dir_falls_back_through_the_environment() {
        let mut e = Environment::default();
        assert_eq!(e.default_runtime_dir(), PathBuf::from("/run/robota-mcpd"));
        e.xdg_runtime_dir = Some("/run/user/1000".into());
        assert_eq!(
            e.default_runtime_dir(),
            PathBuf::from("/run/user/1000/robota-mcpd")
        );
        e.runtime_directory = Some("/run/a:/run/b".into());
        assert_eq!(e.default_runtime_dir(), PathBuf::from("/run/a"));
    }

    #[test]
    fn unknown_keys_name_their_path() {
        let found = issues("[loopback]\nlisten = \"127.0.0.1:1\"\nlisten_all = true\n");
        assert_eq!(found.len(), 1);
        assert_eq!(found[0].path, "loopback.listen_all");
        assert!(found[0].problem.contains("unknown field"), "{found:?}");
        let found = issues("[bogus]\nx = 1\n");
        assert!(found[0].problem.contains("bogus"), "{found:?}");
    }

    #[test]
    fn type_errors_name_their_path() {
        let found = issues("[limits]\nrequest_body = \"lots\"\n");
        assert_eq!(found[0].path, "limits.request_body");
        let found = issues("[session.turn]\nargv = [\"/bin/true\"]\ntimeout = \"soon\"\n");
        assert_eq!(found[0].path, "session.turn.timeout");
        let found = issues("[loopback]\nwire_names = \"dotted\"\n");
        assert_eq!(found[0].path, "loopback.wire_names");
    }

    #[test]
    fn a_callers_share_of_the_slots_is_half_by_default_and_never_more_than_all() {
        let share = |text: &str| {
            let config = parse(text, &env()).unwrap();
            config.loopback.unwrap().bounds.max_in_flight_per_caller
        };
        assert_eq!(share("[loopback]\nmax_in_flight = 7\n"), 4);
        assert_eq!(share("[loopback]\nmax_in_flight_per_caller = 32\n"), 32);
        let found = issues("[loopback]\nmax_in_flight = 8\nmax_in_flight_per_caller = 9\n");
        assert_eq!(found.len(), 1, "{found:?}");
        assert_eq!(found[0].path, "loopback.max_in_flight_per_caller");
        assert!(
            found[0]
                .problem
                .contains("between 1 and max_in_flight (8), got 9"),
            "{}",
            found[0].problem
        );
        // The per-address cap is such a share of the connections.
        let found = issues("[loopback]\nmax_connections = 8\nmax_connections_per_address = 9\n");
        assert_eq!(found[0].path, "loopback.max_connections_per_address");
        assert!(
            found[0]
                .problem
                .contains("between 1 and max_connections (8), got 9")
        );
        assert_eq!(
            issues("[loopback]\nmax_in_flight_per_caller = 0\n").len(),
            1
        );
    }

    #[test]
    fn every_semantic_problem_is_reported_at_once() {
        let found = issues(
            "[loopback]\nlisten = \"0.0.0.0:8765\"\npath = \"mcp\"\nmax_in_flight = 0\n\
             [limits]\nrequest_body = \"17MiB\"\ntool_result = \"65MiB\"\n\
             [session]\nsubmission_tool = \"bad name\"\n\
             [[policy]]\ncallers = [\"root\"]\ntools = []\ndecision = \"allow\"\n",
        );
        let paths: Vec<_> = found.iter().map(|i| i.path.as_str()).collect();
        assert_eq!(
            paths,
            [
                "session.submission_tool",
                "loopback.listen",
                "loopback.path",
                "loopback.max_in_flight",
                "limits.request_body",
                "limits.tool_result",
                "policy[0].callers[0]",
                "policy[0].tools",
            ]
        );
    }

    #[test]
    fn limits_accept_their_ceilings_exactly() {
        let config = parse(
            "[limits]\nrequest_body = \"16MiB\"\ntool_result = \"64MiB\"\n",
            &env(),
        )
        .unwrap();
        assert_eq!(config.limits.request_body, REQUEST_BODY_CEILING);
        assert_eq!(config.limits.tool_result, TOOL_RESULT_CEILING);
    }

    #[test]
    fn the_upstreams_budget_holds_at_least_each_of_their_largest_answers() {
        let config = parse("", &env()).unwrap();
        assert_eq!(config.limits.upstream_memory, UPSTREAM_MEMORY_DEFAULT);
        let found = issues(
            "[limits]\nupstream_memory = \"16MiB\"\n\
             [upstreams.big]\ncommand = [\"/bin/true\"]\nresponse_limit = \"32MiB\"\n",
        );
        assert_eq!(found.len(), 1, "{found:?}");
        assert_eq!(found[0].path, "limits.upstream_memory");
        assert!(found[0].problem.contains("33554432 bytes"), "{found:?}");
        let found = issues("[limits]\nupstream_memory = \"5GiB\"\n");
        assert_eq!(found[0].path, "limits.upstream_memory");
    }

    #[test]
    fn turn_backend_must_be_an_absolute_executable() {
        let found = issues("[session.turn]\nargv = [\"host-agent\"]\n");
        assert_eq!(found[0].path, "session.turn.argv");
        let config = parse(
            "[session.turn]\nargv = [\"/bin/cat\"]\ntimeout = \"2s\"\n",
            &env(),
        )
        .unwrap();
        assert_eq!(config.session.turn.unwrap().timeout, Duration::from_secs(2));
    }

    #[test]
    fn disabled_listeners_are_absent() {
        let config = parse(
            "[loopback]\nenabled = false\n[metrics]\nenabled = false\n",
            &env(),
        )
        .unwrap();
        assert!(config.loopback.is_none());
        assert!(config.metrics.is_none());
    }
}
