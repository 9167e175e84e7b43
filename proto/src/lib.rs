//! Control-plane wire types shared by `robota-mcpd` and `robota-mcpctl`.
//!
//! The control protocol is newline-delimited JSON over a unix stream socket: the client
//! writes one [`Request`] per line and reads one [`Response`] per line. Every frame carries
//! the protocol version `v`; a peer that sees another version answers
//! [`ErrorCode::UnsupportedVersion`]. `docs/control-protocol.md` documents the schema and a
//! test keeps it in sync with the closed sets below.
//!
//! This crate depends on serde only, so the CLI links neither hyper nor rmcp.

#![forbid(unsafe_code)]

pub mod json;

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

/// The control protocol version spoken by this build.
pub const PROTOCOL_VERSION: u32 = 1;

/// Largest request frame (one line, newline included) the daemon reads.
pub const MAX_REQUEST_BYTES: usize = 64 * 1024;

/// Environment variable naming the control socket (the CLI's `--socket` wins over it).
pub const SOCKET_ENV: &str = "ROBOTA_MCPD_SOCKET";

/// One request frame. Decode untrusted frames with [`Request::decode`], which also refuses
/// unknown fields (serde's `deny_unknown_fields` does not combine with `flatten`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Request {
    pub v: u32,
    #[serde(flatten)]
    pub command: Command,
}

impl Request {
    pub fn new(command: Command) -> Self {
        Self {
            v: PROTOCOL_VERSION,
            command,
        }
    }

    /// Strictly decode one frame: a JSON object whose `v` is [`PROTOCOL_VERSION`], a known
    /// `cmd`, no field the command does not define, and no key twice anywhere.
    pub fn decode(frame: &[u8]) -> Result<Request, (ErrorCode, String)> {
        json::reject_duplicate_keys(frame).map_err(|e| match e {
            json::JsonError::Syntax(_) => (ErrorCode::BadRequest, e.to_string()),
            _ => (ErrorCode::BadRequest, format!("bad request: {e}")),
        })?;
        let value: serde_json::Value = serde_json::from_slice(frame)
            .map_err(|e| (ErrorCode::BadRequest, format!("not JSON: {e}")))?;
        let Some(v) = value.get("v").and_then(serde_json::Value::as_u64) else {
            return Err((
                ErrorCode::BadRequest,
                "expected a JSON object with a numeric `v`".into(),
            ));
        };
        if v != u64::from(PROTOCOL_VERSION) {
            return Err((
                ErrorCode::UnsupportedVersion,
                format!("this daemon speaks control protocol v{PROTOCOL_VERSION}, not v{v}"),
            ));
        }
        let request: Request = serde_json::from_value(value.clone())
            .map_err(|e| (ErrorCode::BadRequest, format!("bad request: {e}")))?;
        if let Some(given) = value.as_object()
            && let Some(extra) = given.keys().find(|k| {
                !matches!(k.as_str(), "v" | "cmd")
                    && !request.command.fields().contains(&k.as_str())
            })
        {
            return Err((
                ErrorCode::BadRequest,
                format!("bad request: unknown field `{extra}`"),
            ));
        }
        Ok(request)
    }
}

/// What the client asks for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "cmd", rename_all = "kebab-case")]
pub enum Command {
    /// Daemon status.
    Status,
    /// With no label: return the host bearer (label `default`). With a label: mint an extra
    /// bearer, shown once.
    BearerIssue {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        label: Option<String>,
        /// Lifetime in seconds; absent means no expiry.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        ttl_secs: Option<u64>,
    },
    BearerList,
    BearerRevoke {
        label: String,
    },
    /// Replace the host bearer; the old one stops working at once.
    BearerRotate,
    /// Refusal audit records, oldest first.
    Audit {
        /// Only records at or after this unix time.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        since: Option<u64>,
        /// Only records with this reason (e.g. `bad-bearer`).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        reason: Option<String>,
        /// Only records with a larger `seq` (for following).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        after_seq: Option<u64>,
        /// At most this many records (the newest ones); default and ceiling 1000.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        limit: Option<u32>,
    },
    /// Jobs, newest first.
    JobsList {
        /// Only this caller's jobs (`bearer:ci`, `local:1000`, …).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        owner: Option<String>,
        /// At most this many; default and ceiling 1000.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        limit: Option<u32>,
    },
    /// Cancel a running job as the operator (its process group is killed).
    JobCancel {
        job_id: i64,
    },
    /// Grants, newest first: pending and active ones, or every one with `all`.
    GrantsList {
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        all: bool,
    },
    /// Approve a pending grant; `duration_secs` overrides the requested duration.
    GrantApprove {
        grant_id: i64,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        duration_secs: Option<u64>,
    },
    /// One grant with everything it holds (for a call approval: the arguments).
    GrantShow {
        grant_id: i64,
    },
    GrantDeny {
        grant_id: i64,
    },
    /// End a pending or approved grant now.
    GrantRevoke {
        grant_id: i64,
    },
    /// Switch this connection to MCP: after the `mcp` reply, both directions carry
    /// newline-delimited JSON-RPC for the daemon's session, as caller `local:<peer uid>`.
    Mcp,
    /// Graceful stop of the whole daemon.
    Stop,
    /// Read the configuration file again and serve it (what SIGHUP and `systemctl
    /// reload` do): invalid, nothing changes and the answer is an `invalid-config` error
    /// with every problem; valid, a fresh session on it, the host bearer kept when the
    /// loopback carrier's configuration did not change. Answered once done.
    Reload,
    /// A reload with a new host bearer whatever changed (the labelled bearers without a
    /// lifetime gone), readiness re-announced.
    Restart,
    /// Fetch (or re-read) the remote verifier's signing keys now.
    KeysRefresh,
    /// The downstream MCP servers (`[upstreams.<name>]`) and their tools.
    Upstreams,
    /// Restart one downstream MCP server now: a shared child is stopped and started again,
    /// an HTTP backend reconnected. Answered once that attempt has ended.
    UpstreamRestart {
        name: String,
    },
    /// How an upstream's tool surface differs from the one last approved (or trusted on
    /// first use): tools added, removed or changed, and its executable.
    UpstreamDiff {
        name: String,
    },
    /// Approve an upstream's tool surface as `upstream-diff` showed it (`surface`, its
    /// digest): refused when the upstream listed anything else since. Its held tools are
    /// served.
    UpstreamApprove {
        name: String,
        surface: String,
    },
}

impl Command {
    /// The fields this command may carry besides `v` and `cmd`.
    pub fn fields(&self) -> &'static [&'static str] {
        match self {
            Command::BearerIssue { .. } => &["label", "ttl_secs"],
            Command::BearerRevoke { .. } => &["label"],
            Command::Audit { .. } => &["since", "reason", "after_seq", "limit"],
            Command::JobsList { .. } => &["owner", "limit"],
            Command::JobCancel { .. } => &["job_id"],
            Command::GrantsList { .. } => &["all"],
            Command::GrantApprove { .. } => &["grant_id", "duration_secs"],
            Command::GrantShow { .. } | Command::GrantDeny { .. } | Command::GrantRevoke { .. } => {
                &["grant_id"]
            }
            Command::UpstreamRestart { .. } | Command::UpstreamDiff { .. } => &["name"],
            Command::UpstreamApprove { .. } => &["name", "surface"],
            Command::Status
            | Command::BearerList
            | Command::BearerRotate
            | Command::Mcp
            | Command::Stop
            | Command::Reload
            | Command::Restart
            | Command::KeysRefresh
            | Command::Upstreams => &[],
        }
    }
}

/// One response frame: `{"v":1,"ok":{…}}` or `{"v":1,"error":{…}}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Response {
    pub v: u32,
    #[serde(flatten)]
    pub outcome: Outcome,
}

impl Response {
    pub fn ok(reply: Reply) -> Self {
        Self {
            v: PROTOCOL_VERSION,
            outcome: Outcome::Ok(Box::new(reply)),
        }
    }

    pub fn error(code: ErrorCode, message: impl Into<String>) -> Self {
        Self {
            v: PROTOCOL_VERSION,
            outcome: Outcome::Error(ErrorReply {
                code,
                message: message.into(),
            }),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// Boxed: a status is large beside an error.
    Ok(Box<Reply>),
    Error(ErrorReply),
}

/// A successful answer, tagged by `kind`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
pub enum Reply {
    Status(Status),
    /// A bearer secret, shown once.
    Bearer {
        label: String,
        secret: Secret,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        expires_at: Option<u64>,
    },
    Bearers {
        bearers: Vec<BearerInfo>,
    },
    Revoked {
        label: String,
    },
    Audit {
        records: Vec<AuditRecord>,
        /// The highest `seq` the daemon has assigned (pass it as `after_seq` to follow).
        last_seq: u64,
    },
    Jobs {
        jobs: Vec<JobRecord>,
    },
    /// The job as it is after the command (a cancel takes effect shortly after).
    Job {
        job: JobRecord,
    },
    Grants {
        grants: Vec<GrantRecord>,
    },
    /// The grant as it is after the decision (or as `grant-show` finds it).
    Grant {
        grant: Box<GrantRecord>,
    },
    /// The connection now carries MCP (see [`Command::Mcp`]).
    Mcp,
    Stopping,
    Restarted {
        status: Status,
    },
    /// The configuration was read again and is served.
    Reloaded {
        status: Status,
        /// Whether the host bearer carried on (the loopback carrier did not change).
        host_bearer_kept: bool,
    },
    /// The key set after a successful `keys-refresh`.
    KeySet(KeySetStatus),
    Upstreams {
        upstreams: Vec<UpstreamStatus>,
    },
    /// The upstream after `upstream-restart` or `upstream-approve`.
    Upstream {
        upstream: UpstreamStatus,
    },
    /// The answer to `upstream-diff`.
    UpstreamDiff(UpstreamDiff),
}

impl Reply {
    /// The `kind` tag this reply carries on the wire.
    pub fn kind(&self) -> &'static str {
        match self {
            Reply::Status(_) => "status",
            Reply::Bearer { .. } => "bearer",
            Reply::Bearers { .. } => "bearers",
            Reply::Revoked { .. } => "revoked",
            Reply::Audit { .. } => "audit",
            Reply::Jobs { .. } => "jobs",
            Reply::Job { .. } => "job",
            Reply::Grants { .. } => "grants",
            Reply::Grant { .. } => "grant",
            Reply::Mcp => "mcp",
            Reply::Stopping => "stopping",
            Reply::Restarted { .. } => "restarted",
            Reply::Reloaded { .. } => "reloaded",
            Reply::KeySet(_) => "key-set",
            Reply::Upstreams { .. } => "upstreams",
            Reply::Upstream { .. } => "upstream",
            Reply::UpstreamDiff(_) => "upstream-diff",
        }
    }
}

/// The canonical job states.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum JobState {
    Running,
    Succeeded,
    Failed,
    Cancelled,
    TimedOut,
    /// The process that ran the job died before recording its end; it was not re-run.
    OutcomeUnknown,
}

impl JobState {
    pub const ALL: [JobState; 6] = [
        JobState::Running,
        JobState::Succeeded,
        JobState::Failed,
        JobState::Cancelled,
        JobState::TimedOut,
        JobState::OutcomeUnknown,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            JobState::Running => "running",
            JobState::Succeeded => "succeeded",
            JobState::Failed => "failed",
            JobState::Cancelled => "cancelled",
            JobState::TimedOut => "timed-out",
            JobState::OutcomeUnknown => "outcome-unknown",
        }
    }

    pub fn parse(text: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|s| s.as_str() == text)
    }

    pub fn finished(self) -> bool {
        self != JobState::Running
    }
}

/// A durable job (docs/design.md §11.1), as `job.status`, `jobs list` and MCP Tasks show it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobRecord {
    pub job_id: i64,
    /// The caller that started it.
    pub owner: String,
    /// `template`, `service` or `docker`.
    pub kind: String,
    /// The template name, unit or container.
    pub target: String,
    /// `start`, `stop`, … for service and container actions.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub action: Option<String>,
    pub state: JobState,
    /// Unix seconds.
    pub created_at: i64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished_at: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i32>,
    /// How it ended, in a sentence.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
    /// Output bytes kept (the `job.tail` cursor range) and bytes over the cap, dropped.
    pub output_bytes: u64,
    pub output_dropped: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum GrantKind {
    RootAccess,
    Elevation,
    /// An approval of one exact call (`decision = "approve-each"`): its tool and
    /// arguments, used once.
    Call,
}

impl GrantKind {
    pub const ALL: [GrantKind; 3] = [GrantKind::RootAccess, GrantKind::Elevation, GrantKind::Call];

    pub fn as_str(self) -> &'static str {
        match self {
            GrantKind::RootAccess => "root-access",
            GrantKind::Elevation => "elevation",
            GrantKind::Call => "call",
        }
    }
}

/// A grant's state as shown: `expired` is an approved grant past its expiry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum GrantState {
    Pending,
    Approved,
    Denied,
    Revoked,
    Expired,
    /// An approval of one call that the call has used.
    Used,
}

impl GrantState {
    pub const ALL: [GrantState; 6] = [
        GrantState::Pending,
        GrantState::Approved,
        GrantState::Denied,
        GrantState::Revoked,
        GrantState::Expired,
        GrantState::Used,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            GrantState::Pending => "pending",
            GrantState::Approved => "approved",
            GrantState::Denied => "denied",
            GrantState::Revoked => "revoked",
            GrantState::Expired => "expired",
            GrantState::Used => "used",
        }
    }
}

/// A grant (docs/design.md §11.6): bound to one caller, time limited, revocable.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GrantRecord {
    pub grant_id: i64,
    /// The caller it belongs to.
    pub caller: String,
    pub kind: GrantKind,
    /// The caller's reason, as given.
    pub reason: String,
    /// Canonical tool-name patterns it covers.
    pub scope: Vec<String>,
    pub duration_secs: u64,
    pub state: GrantState,
    pub requested_at: i64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decided_at: Option<i64>,
    /// `local:<uid>` of the operator, or the caller itself for its own revoke.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decided_by: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_at: Option<i64>,
    /// Kind `call`: the canonical tool name the approval is for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool: Option<String>,
    /// Kind `call`: the call's arguments, exactly as they are bound.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub arguments: Option<serde_json::Value>,
    /// Kind `call`: SHA-256 (hex) of the canonical JSON text of `arguments`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub args_sha256: Option<String>,
    /// Kind `call`: when the call used the approval.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub used_at: Option<i64>,
}

/// One audit record: a refusal, or a grant request or decision. Never token text, never
/// the client address.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AuditRecord {
    /// Increasing across restarts of the daemon with the same state directory.
    pub seq: u64,
    /// Unix seconds.
    pub time: u64,
    /// `loopback`, `remote`, `control` or `stdio`; `session` for a grant event raised by a
    /// tool call.
    pub carrier: String,
    /// The closed-set refusal reason (`wrong-host`, `bad-bearer`, `expired`, …), or the
    /// grant event (`grant-requested`, `grant-approved`, `grant-denied`, `grant-revoked`).
    pub reason: String,
    /// Answered 429 because the client address failed too often.
    pub throttled: bool,
    /// `loopback`, `private`, `public` or `unknown`.
    pub address_class: String,
    /// Grant events only: which grant, whose, and who acted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grant: Option<GrantRef>,
    /// Upstream surface events only (`upstream-pinned`, `upstream-drift`,
    /// `upstream-approved`): which upstream, its surface, and who acted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub upstream: Option<UpstreamRef>,
    /// Aggregates only: this record stands for `count` (2 or more) refusals with these
    /// fields in the one-second interval starting at `time`, past the rate at which each
    /// refusal gets a record of its own. Absent on every other record, which stands for
    /// one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub count: Option<u64>,
}

impl AuditRecord {
    /// How many refusals or events this record stands for: `count`, else 1.
    pub fn events(&self) -> u64 {
        self.count.unwrap_or(1)
    }
}

/// The grant an audit record is about.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GrantRef {
    pub grant_id: i64,
    /// The caller the grant belongs to (`bearer:ci`, `oauth:client/sub`, `local:1000`).
    pub caller: String,
    /// Who acted: the caller itself, or the operator as `local:<uid>`.
    pub by: String,
    /// An approval of one call: the tool it is for (never the arguments).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorReply {
    pub code: ErrorCode,
    pub message: String,
}

/// The closed set of control-plane error codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ErrorCode {
    /// The peer's uid is not allowed on the control socket.
    PermissionDenied,
    /// The frame did not parse or named an unknown command.
    BadRequest,
    /// The frame's `v` is not [`PROTOCOL_VERSION`].
    UnsupportedVersion,
    /// The frame exceeded [`MAX_REQUEST_BYTES`].
    TooLarge,
    /// A named object (e.g. a bearer label) does not exist.
    NotFound,
    /// A named object already exists.
    Conflict,
    /// The daemon cannot do this now (e.g. it is stopping).
    Unavailable,
    /// A reload found the configuration invalid; the running one stays.
    InvalidConfig,
    Internal,
}

impl ErrorCode {
    pub const ALL: [ErrorCode; 9] = [
        ErrorCode::PermissionDenied,
        ErrorCode::BadRequest,
        ErrorCode::UnsupportedVersion,
        ErrorCode::TooLarge,
        ErrorCode::NotFound,
        ErrorCode::Conflict,
        ErrorCode::Unavailable,
        ErrorCode::InvalidConfig,
        ErrorCode::Internal,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            ErrorCode::PermissionDenied => "permission-denied",
            ErrorCode::BadRequest => "bad-request",
            ErrorCode::UnsupportedVersion => "unsupported-version",
            ErrorCode::TooLarge => "too-large",
            ErrorCode::NotFound => "not-found",
            ErrorCode::Conflict => "conflict",
            ErrorCode::Unavailable => "unavailable",
            ErrorCode::InvalidConfig => "invalid-config",
            ErrorCode::Internal => "internal",
        }
    }
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A bearer secret on the wire. Its `Debug` never shows the value.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Secret(pub String);

impl Secret {
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}

/// Metadata of one live bearer; never the secret.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BearerInfo {
    pub label: String,
    /// Unix seconds.
    pub created_at: u64,
    pub expires_at: Option<u64>,
    pub last_used_at: Option<u64>,
}

/// Daemon status.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Status {
    pub version: String,
    pub pid: u32,
    pub uptime_secs: u64,
    /// `starting`, `serving`, `restarting` or `stopping`.
    pub state: String,
    /// Reloads and restarts (fresh attaches) since the process started.
    pub generation: u64,
    pub carriers: Vec<CarrierStatus>,
    pub catalog_size: usize,
    pub submission_tool: String,
    pub active_turn: bool,
    /// Jobs running in the daemon process.
    #[serde(default)]
    pub running_jobs: usize,
    /// Grant requests waiting for an operator.
    #[serde(default)]
    pub pending_grants: usize,
    pub bearer_count: usize,
    /// Refusals in the last hour, by audit reason.
    pub refusals_last_hour: BTreeMap<String, u64>,
    /// The remote carrier's key set, when it is enabled.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key_set: Option<Box<KeySetStatus>>,
    /// The configuration served now, and whether its file reads differently.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config: Option<ConfigStatus>,
    /// The state directory (store, audit, key cache).
    #[serde(default)]
    pub state_dir: String,
    /// How the last reload went; none since the process started.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_reload: Option<ReloadStatus>,
    /// `ok`, or `degraded` while a part fails (see `problems`).
    #[serde(default = "ok")]
    pub health: String,
    /// What is failing now, when `health` is `degraded`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub problems: Vec<Problem>,
    /// The downstream MCP servers, by name.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub upstreams: Vec<UpstreamStatus>,
}

/// One downstream MCP server (docs/design.md §13).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UpstreamStatus {
    /// Its configured name, the prefix of its tools.
    pub name: String,
    /// `stdio` (a child process) or `http` (a local backend).
    pub kind: String,
    /// A stdio upstream's children: `shared` or `per-call`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub children: Option<String>,
    /// `starting`, `up`, `backoff` or `down`.
    pub state: String,
    /// Since when (unix seconds) it has been in that state.
    pub since: u64,
    /// The MCP revision agreed with it last.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub protocol: Option<String>,
    /// Canonical names of its imported tools (listed even while it is not up: its
    /// last-known list; they answer `unavailable` until it is up).
    pub tools: Vec<String>,
    /// Its tools that were not imported, and why.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub refused: Vec<RefusedTool>,
    /// Its tools that `tools = [...]` does not select.
    #[serde(default)]
    pub excluded: usize,
    /// The tools come from the list kept in the state directory (it has not been up yet).
    #[serde(default)]
    pub listed_from_cache: bool,
    /// Times it was started again since this session began.
    pub restarts: u64,
    /// Why it last failed, for the operator.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
    /// SHA-256 of its tool surface as it lists it now (every tool's name, title,
    /// description, schemas and annotations, and a stdio upstream's executable).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub surface: Option<String>,
    /// Its surface differs from the approved one: changed and new tools are held (among
    /// `refused`) until `upstream-approve`.
    #[serde(default)]
    pub drift: bool,
}

/// How an upstream's tool surface differs from the approved one.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UpstreamDiff {
    pub name: String,
    /// The approved surface's digest; none before the first listing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approved: Option<String>,
    /// The surface's digest as listed now; none before the first listing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub current: Option<String>,
    /// When and by whom the approved surface was approved (`first-use` for the first
    /// listing, else `local:<uid>`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approved_at: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approved_by: Option<String>,
    /// A stdio upstream's executable is not the one approved (every tool is held).
    #[serde(default)]
    pub executable_changed: bool,
    /// Tools (the upstream's own names) listed now and not approved.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub added: Vec<String>,
    /// Tools approved and no longer listed.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub removed: Vec<String>,
    /// Tools listed both times whose surface changed, member by member.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub changed: Vec<ToolChange>,
}

/// One changed tool of an [`UpstreamDiff`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ToolChange {
    pub tool: String,
    pub members: Vec<MemberChange>,
}

/// One member of a tool definition (`description`, `inputSchema`, …), as canonical JSON
/// text (absent: the member was not there; cut at 4 KiB with `…`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemberChange {
    pub member: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approved: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub current: Option<String>,
}

/// The upstream an audit record is about.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UpstreamRef {
    pub name: String,
    /// The surface digest the event is about (pinned, seen, or approved).
    pub surface: String,
    /// `first-use`, `the daemon` (drift) or `local:<uid>` (an approval).
    pub by: String,
}

/// A tool an upstream offers that was not imported.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RefusedTool {
    /// The upstream's own name for it.
    pub tool: String,
    pub reason: String,
}

fn ok() -> String {
    "ok".into()
}

/// The configuration the daemon serves.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConfigStatus {
    /// The file's path, or `embedded default`.
    pub source: String,
    /// SHA-256 (hex) of the text served.
    pub sha256: String,
    /// When it was read (Unix seconds).
    pub loaded_at: u64,
    /// Whether what would be read now differs from what is served (a reload would change
    /// something); absent when that cannot be read (`read_error`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub changed_on_disk: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub read_error: Option<String>,
}

/// The last reload (SIGHUP or `restart`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReloadStatus {
    /// When it ended (Unix seconds).
    pub at: u64,
    pub ok: bool,
    /// Why it was refused: every problem, each naming its key.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub problems: Vec<String>,
}

/// A part of the daemon that is failing now.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Problem {
    /// `audit` (the audit file), `store` (the job, grant and idempotency store), or
    /// `upstream <name>` (a downstream MCP server that is not up).
    pub part: String,
    /// The last error (for an upstream: its state, then why it last failed).
    pub error: String,
    /// Since when it fails (Unix seconds).
    pub since: u64,
    /// Failed writes since then (for an upstream: its restarts in this session).
    pub failures: u64,
}

/// Where the remote verifier's keys come from (`[remote]` `jwks_uri`, `jwks_file`, or
/// neither).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum KeySourceKind {
    /// The issuer's RFC 8414 (then OpenID) metadata names the key set's URL.
    Discovery,
    /// An explicit `https` URL.
    JwksUri,
    /// A local JWKS file.
    JwksFile,
}

impl KeySourceKind {
    pub const ALL: [KeySourceKind; 3] = [
        KeySourceKind::Discovery,
        KeySourceKind::JwksUri,
        KeySourceKind::JwksFile,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            KeySourceKind::Discovery => "discovery",
            KeySourceKind::JwksUri => "jwks-uri",
            KeySourceKind::JwksFile => "jwks-file",
        }
    }
}

/// The remote verifier's signing keys: what it holds, and how refreshing them goes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeySetStatus {
    pub source: KeySourceKind,
    /// The URL or file the held keys were read from; absent while none are held.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub location: Option<String>,
    /// Usable keys held; 0 means every token is refused with `keys-unavailable`.
    pub keys: usize,
    /// The held keys were read back from the state directory's cache at start-up because
    /// the issuer could not be reached.
    #[serde(default)]
    pub from_cache: bool,
    /// When the held keys were fetched (for cached keys: originally), unix seconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fetched_at: Option<u64>,
    /// When the last fetch or read ended, successful or not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_attempt_at: Option<u64>,
    /// Why the last attempt failed; absent when it succeeded. The held keys stay in use.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
    /// When the schedule refreshes the keys next.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_refresh_at: Option<u64>,
    /// A fetch is running now.
    #[serde(default)]
    pub refreshing: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CarrierStatus {
    /// `loopback`, `remote`, `metrics` or `control`.
    pub name: String,
    /// The bound address (`127.0.0.1:8765`, or a socket path).
    pub address: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub public_url: Option<String>,
    /// Requests admitted and refused at admission; none for `metrics` (a scrape is not
    /// admitted: the listener has no admission).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub admitted: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refused: Option<u64>,
}

/// Exit codes of `robota-mcpctl`, distinct per failure class.
pub mod exit {
    /// The command succeeded.
    pub const OK: i32 = 0;
    /// The daemon answered with an error (not found, conflict, unavailable, …).
    pub const FAILED: i32 = 1;
    /// Bad usage: unknown command, bad flag value (also clap's own code).
    pub const USAGE: i32 = 2;
    /// The daemon is not running: no socket, or nobody listening on it.
    pub const NOT_RUNNING: i32 = 3;
    /// The daemon refused us (SO_PEERCRED check) or the socket's mode did.
    pub const PERMISSION_DENIED: i32 = 4;
    /// The daemon spoke something we do not understand.
    pub const PROTOCOL: i32 = 5;
    /// `restart`: the daemon found its configuration invalid and kept the running one
    /// (the code `robota-mcpd check-config` uses for an invalid configuration).
    pub const INVALID_CONFIG: i32 = 78;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_frames_are_flat_and_versioned() {
        let req = Request::new(Command::BearerIssue {
            label: Some("ci".into()),
            ttl_secs: Some(60),
        });
        let text = serde_json::to_string(&req).unwrap();
        assert_eq!(
            text,
            r#"{"v":1,"cmd":"bearer-issue","label":"ci","ttl_secs":60}"#
        );
        assert_eq!(serde_json::from_str::<Request>(&text).unwrap(), req);
        let bare: Request = serde_json::from_str(r#"{"v":1,"cmd":"status"}"#).unwrap();
        assert_eq!(bare.command, Command::Status);
    }

    #[test]
    fn unknown_commands_and_fields_are_refused() {
        let code = |frame: &str| Request::decode(frame.as_bytes()).map_err(|(code, _)| code);
        assert_eq!(
            code(r#"{"v":1,"cmd":"status"}"#),
            Ok(Request::new(Command::Status))
        );
        assert_eq!(
            code(r#"{"v":1,"cmd":"format-disk"}"#),
            Err(ErrorCode::BadRequest)
        );
        assert_eq!(
            code(r#"{"v":1,"cmd":"status","x":1}"#),
            Err(ErrorCode::BadRequest)
        );
        assert_eq!(
            code(r#"{"v":1,"cmd":"bearer-revoke"}"#),
            Err(ErrorCode::BadRequest)
        );
        assert_eq!(
            code(r#"{"v":2,"cmd":"status"}"#),
            Err(ErrorCode::UnsupportedVersion)
        );
        assert_eq!(code(r#"{"cmd":"status"}"#), Err(ErrorCode::BadRequest));
        assert_eq!(code("[1]"), Err(ErrorCode::BadRequest));
        assert_eq!(code("not json"), Err(ErrorCode::BadRequest));
    }

    #[test]
    fn duplicate_keys_are_refused_whichever_comes_last() {
        for frame in [
            r#"{"v":1,"cmd":"status","cmd":"stop"}"#,
            r#"{"v":1,"cmd":"stop","cmd":"status"}"#,
            r#"{"v":1,"v":1,"cmd":"status"}"#,
            r#"{"v":1,"cmd":"bearer-revoke","label":"a","label":"b"}"#,
            r#"{"v":1,"cmd":"status","\u0063md":"stop"}"#,
        ] {
            let got = Request::decode(frame.as_bytes());
            match got {
                Err((ErrorCode::BadRequest, message)) => {
                    assert!(
                        message.starts_with("bad request: duplicate key"),
                        "{message}"
                    )
                }
                other => panic!("{frame} gave {other:?}"),
            }
        }
        // Each key once still decodes.
        assert_eq!(
            Request::decode(br#"{"v":1,"cmd":"stop"}"#),
            Ok(Request::new(Command::Stop))
        );
    }

    #[test]
    fn responses_round_trip_and_errors_use_kebab_codes() {
        let err = Response::error(ErrorCode::PermissionDenied, "uid 1000 is not allowed");
        let text = serde_json::to_string(&err).unwrap();
        assert_eq!(
            text,
            r#"{"v":1,"error":{"code":"permission-denied","message":"uid 1000 is not allowed"}}"#
        );
        assert_eq!(serde_json::from_str::<Response>(&text).unwrap(), err);
        for code in ErrorCode::ALL {
            let json = serde_json::to_string(&code).unwrap();
            assert_eq!(json, format!("\"{}\"", code.as_str()));
        }
    }

    #[test]
    fn secret_debug_is_redacted() {
        let reply = Reply::Bearer {
            label: "default".into(),
            secret: Secret("deadbeef".into()),
            expires_at: None,
        };
        assert!(!format!("{reply:?}").contains("deadbeef"));
        assert!(serde_json::to_string(&reply).unwrap().contains("deadbeef"));
    }
}
