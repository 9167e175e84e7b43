//! `docker.logs` and `docker.action`: containers through the Docker Engine API on its unix
//! socket, only those whose names `[tools.docker] containers` allows.
//!
//! A container is named by its exact name. The allow-list is checked against the name the
//! caller gives before the engine hears of it; the engine's own answer (`Name` in the
//! inspect) must then be that very name, so an ID, an ID prefix or any other alias the
//! engine resolves cannot reach a container the list does not allow.

mod engine;
mod logs;

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use http::{Method, StatusCode};
use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::{Value, json};

use super::{allowed, invalid};
use crate::catalog::{Annotations, HostTool, ToolFuture, ToolSpec, TypedTool};
use crate::catalog::{ToolContext, ToolError, ToolOutput};
use crate::config::DockerTool;
use crate::host::Host;
use crate::jobs::{Finish, Jobs, OutputSink, Work};
use crate::vocab::ToolErrorCode;
use engine::{Engine, EngineError, Response};
use logs::Collector;

/// Connecting, sending and the engine's response head, for the read tool and the
/// lookups before an action.
const HEAD_LIMIT: Duration = Duration::from_secs(5);
/// Reading a JSON body (an inspect, an error).
const JSON_LIMIT: Duration = Duration::from_secs(5);
/// Reading a log body.
const LOGS_LIMIT: Duration = Duration::from_secs(20);
/// Largest JSON body read (an inspect is a few KiB).
const JSON_CAP: usize = 1024 * 1024;
/// Log text `docker.logs` returns at most; older lines are dropped past it.
const LOG_TEXT_CAP: usize = 1024 * 1024;
/// Log bytes read from the engine at most; past it the read stops (result `truncated`).
const LOG_BODY_CEILING: u64 = 64 * 1024 * 1024;
/// `tail` bounds and default.
const TAIL_MAX: u64 = 10_000;
const TAIL_DEFAULT: u64 = 100;
/// The latest `since` in unix seconds: the engine reads it as a signed 64-bit integer.
const SINCE_MAX: u64 = i64::MAX as u64;
/// Longest container name accepted.
const NAME_MAX: usize = 255;

pub fn tools(config: &DockerTool, host: &Arc<Host>) -> Vec<Arc<dyn HostTool>> {
    let docker = Arc::new(Docker {
        engine: Engine::new(config.socket.clone()),
        containers: config.containers.clone(),
        timeout: config.timeout,
    });
    vec![
        Arc::new(Logs(Arc::clone(&docker))),
        Arc::new(ActionTool {
            docker,
            jobs: Arc::clone(&host.jobs),
        }),
    ]
}

/// What both tools share: the engine and the allow-list.
struct Docker {
    engine: Engine,
    containers: Vec<String>,
    /// How long an action job may take.
    timeout: Duration,
}

/// What the engine says about a container.
#[derive(Debug)]
struct Inspected {
    /// The engine's id of the container the name resolved to: every later request names
    /// it, so a container renamed or recreated in between is never acted on.
    id: String,
    tty: bool,
}

impl Docker {
    fn socket(&self) -> &Path {
        self.engine.socket()
    }

    /// The container argument, checked: grammar first, then the allow-list. Nothing is
    /// sent to the engine for a name that fails either.
    fn permitted<'a>(&self, name: &'a str) -> Result<&'a str, ToolError> {
        if self.containers.is_empty() {
            return Err(ToolError::new(
                ToolErrorCode::Unavailable,
                "no containers are configured on this host ([tools.docker] containers is empty)",
            ));
        }
        check_name(name).map_err(invalid)?;
        if !allowed(&self.containers, name) {
            return Err(not_allowed(name));
        }
        Ok(name)
    }

    /// Looks the container up and checks the engine resolved `name` as the container's
    /// own name.
    async fn resolve(&self, name: &str) -> Result<Inspected, ToolError> {
        let response = self
            .engine
            .request(Method::GET, &format!("/containers/{name}/json"), HEAD_LIMIT)
            .await
            .map_err(|e| self.engine_error(e))?;
        let response = self.success(response, name).await?;
        let value = response
            .json(JSON_CAP, JSON_LIMIT)
            .await
            .map_err(|e| self.engine_error(e))?;
        let Some(real) = value.get("Name").and_then(Value::as_str) else {
            return Err(
                self.engine_error(EngineError::Json(serde::de::Error::custom(
                    "the inspect has no Name",
                ))),
            );
        };
        let real = real.strip_prefix('/').unwrap_or(real);
        if real != name {
            tracing::warn!(
                requested = name,
                resolved = real,
                "the engine resolved a container argument to another container; refused"
            );
            return Err(not_allowed(name));
        }
        let id = value
            .get("Id")
            .and_then(Value::as_str)
            .filter(|id| {
                !id.is_empty() && id.len() <= 128 && id.bytes().all(|b| b.is_ascii_alphanumeric())
            })
            .ok_or_else(|| {
                self.engine_error(EngineError::Json(serde::de::Error::custom(
                    "the inspect has no usable Id",
                )))
            })?
            .to_owned();
        Ok(Inspected {
            id,
            tty: value
                .pointer("/Config/Tty")
                .and_then(Value::as_bool)
                .unwrap_or(false),
        })
    }

    /// Passes a 2xx answer on; 404 is "no such container", anything else is logged with
    /// the engine's message and answered `internal`.
    async fn success(&self, response: Response, name: &str) -> Result<Response, ToolError> {
        let status = response.status;
        if status.is_success() {
            return Ok(response);
        }
        let message = response.message(JSON_LIMIT).await;
        if status == StatusCode::NOT_FOUND {
            tracing::debug!(container = name, %message, "the engine has no such container");
            return Err(invalid(format!("no such container: {name}")));
        }
        tracing::warn!(container = name, %status, %message, "the Docker engine refused a request");
        Err(ToolError::new(
            ToolErrorCode::Internal,
            format!("the Docker engine answered {status}"),
        ))
    }

    /// A failed exchange as a visible error; the detail goes to the log.
    fn engine_error(&self, e: EngineError) -> ToolError {
        let detail = crate::error_chain(&e);
        tracing::warn!(socket = %self.socket().display(), error = %detail, "Docker Engine API request failed");
        match e {
            EngineError::Unreachable { .. } => ToolError::new(
                ToolErrorCode::Unavailable,
                format!(
                    "the Docker Engine API is not reachable at {}",
                    self.socket().display()
                ),
            ),
            EngineError::NoAnswer(limit) | EngineError::SlowBody(limit) => ToolError::new(
                ToolErrorCode::TimedOut,
                format!(
                    "the Docker engine did not answer within {}",
                    humantime::format_duration(limit)
                ),
            ),
            _ => ToolError::new(
                ToolErrorCode::Internal,
                "the Docker Engine API request failed",
            ),
        }
    }

    async fn logs(&self, args: &LogsArgs) -> Result<Value, ToolError> {
        let name = self.permitted(&args.container)?;
        let tail = args.tail;
        let since = match &args.since {
            None => None,
            Some(Since::Seconds(secs)) => Some(*secs),
            Some(Since::Ago(text)) => Some(since_ago(text, SystemTime::now()).map_err(invalid)?),
        };
        let (stdout, stderr, timestamps) = (args.stdout, args.stderr, args.timestamps);
        if !stdout && !stderr {
            return Err(invalid("at least one of stdout and stderr must be true"));
        }

        let container = self.resolve(name).await?;
        let id = &container.id;
        let mut path = format!(
            "/containers/{id}/logs?stdout={stdout}&stderr={stderr}&tail={tail}&timestamps={timestamps}"
        );
        if let Some(since) = since {
            path.push_str(&format!("&since={since}"));
        }
        let response = self
            .engine
            .request(Method::GET, &path, HEAD_LIMIT)
            .await
            .map_err(|e| self.engine_error(e))?;
        let mut response = self.success(response, name).await?;

        let mut collector = Collector::new(container.tty, LOG_TEXT_CAP);
        let deadline = tokio::time::Instant::now() + LOGS_LIMIT;
        let mut read: u64 = 0;
        let mut broke_off = None;
        loop {
            match response.chunk(deadline, LOGS_LIMIT).await {
                Ok(Some(chunk)) => {
                    read += chunk.len() as u64;
                    collector.feed(&chunk);
                    if read > LOG_BODY_CEILING {
                        tracing::warn!(
                            container = name,
                            read,
                            "log body over the ceiling; stopped reading"
                        );
                        collector.cut_short();
                        break;
                    }
                }
                Ok(None) => break,
                Err(e @ EngineError::SlowBody(_)) => return Err(self.engine_error(e)),
                Err(e) => {
                    tracing::warn!(container = name, error = %crate::error_chain(&e), "the log stream broke off");
                    broke_off = Some("the engine's log stream broke off before its end".to_owned());
                    collector.cut_short();
                    break;
                }
            }
        }
        let collected = collector.finish();
        let stream_error = broke_off.or_else(|| {
            collected.error.as_ref().map(|e| {
                tracing::warn!(container = name, error = %e, "malformed log stream");
                format!("the engine's log stream is malformed: {e}")
            })
        });
        let lines: Vec<Value> = collected
            .lines
            .iter()
            .map(|l| json!({"stream": l.stream.as_str(), "text": l.text}))
            .collect();
        let mut out = json!({"container": name, "lines": lines, "truncated": collected.truncated || stream_error.is_some()});
        if let Some(problem) = stream_error {
            out["stream_error"] = Value::String(problem);
        }
        Ok(out)
    }

    /// The body of an action job: one POST, a line per step.
    async fn act(&self, name: &str, id: &str, action: Action, sink: &OutputSink) -> Finish {
        let step = |text: String| sink.write("log", format!("{text}\n").as_bytes());
        step(format!(
            "asking the Docker engine to {} container {name}",
            action.as_str()
        ));
        // The job's own time limit applies; this one only backs it up.
        let limit = self.timeout + Duration::from_secs(5);
        let path = format!("/containers/{id}/{}", action.as_str());
        let response = match self.engine.request(Method::POST, &path, limit).await {
            Ok(response) => response,
            // Never connected: nothing was asked.
            Err(e @ EngineError::Unreachable { .. }) => {
                let visible = self.engine_error(e);
                step(visible.message.clone());
                return Finish::failed(visible.message);
            }
            // The request may have reached the engine: it may have acted.
            Err(e) => {
                let visible = self.engine_error(e);
                step(visible.message.clone());
                return Finish {
                    state: crate::vocab::JobState::OutcomeUnknown,
                    exit_code: None,
                    detail: format!(
                        "{}; the engine may have acted: check the container before retrying",
                        visible.message
                    ),
                };
            }
        };
        let status = response.status;
        step(format!("the engine answered {status}"));
        let finish = match status {
            StatusCode::NOT_MODIFIED => Finish::succeeded(match action {
                Action::Start => format!("container {name} was already started"),
                Action::Stop => format!("container {name} was already stopped"),
                Action::Restart => format!("container {name}: the engine had nothing to do"),
            }),
            s if s.is_success() => Finish::succeeded(format!("container {name} {}", action.done())),
            StatusCode::NOT_FOUND => {
                let message = response.message(JSON_LIMIT).await;
                tracing::info!(container = name, %message, "container vanished before its action");
                Finish::failed(format!("no such container: {name}"))
            }
            _ => {
                let message = response.message(JSON_LIMIT).await;
                tracing::warn!(container = name, action = action.as_str(), %status, %message, "the Docker engine refused an action");
                Finish::failed(format!(
                    "the Docker engine could not {} container {name}: {message}",
                    action.as_str()
                ))
            }
        };
        step(finish.detail.clone());
        finish
    }
}

fn not_allowed(name: &str) -> ToolError {
    ToolError::new(
        ToolErrorCode::PermissionDenied,
        format!(
            "container {name} is not among the containers [tools.docker] allows (name a container by its exact name)"
        ),
    )
}

/// A container name: `[a-zA-Z0-9][a-zA-Z0-9_.-]*`, at most 255 characters.
fn check_name(name: &str) -> Result<(), String> {
    let Some(first) = name.chars().next() else {
        return Err("the container name is empty".into());
    };
    if name.len() > NAME_MAX {
        return Err(format!(
            "the container name is longer than {NAME_MAX} characters"
        ));
    }
    if !first.is_ascii_alphanumeric() {
        return Err(format!(
            "container name {name:?} must start with a letter or a digit"
        ));
    }
    if let Some(c) = name
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || "_.-".contains(*c)))
    {
        return Err(format!(
            "container name {name:?} has the character {c:?}; names are [a-zA-Z0-9][a-zA-Z0-9_.-]*"
        ));
    }
    Ok(())
}

/// A duration (`"10m"`) meaning that long before `now`, in unix seconds.
fn since_ago(text: &str, now: SystemTime) -> Result<u64, String> {
    let ago = humantime::parse_duration(text.trim()).map_err(|e| {
        format!(
            "since must be unix seconds (an integer) or a duration such as \"10m\"; {text:?}: {e}"
        )
    })?;
    let at = now.checked_sub(ago).unwrap_or(UNIX_EPOCH);
    Ok(at.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs()))
}

/// The `container` description, naming what this host allows.
fn container_description(containers: &[String]) -> String {
    if containers.is_empty() {
        "A container's exact name. No containers are configured on this host.".to_owned()
    } else {
        format!(
            "A container's exact name (not an ID); allowed on this host: {}.",
            containers.join(", ")
        )
    }
}

/// `since`: unix seconds, or a duration meaning that long ago.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(
    untagged,
    expecting = "unix seconds (an integer) or a duration such as \"10m\""
)]
enum Since {
    Seconds(u64),
    Ago(String),
}

/// Written out rather than derived: the derive would nest an `anyOf` in another, where one
/// schema with two types says the same to every client.
impl JsonSchema for Since {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "Since".into()
    }

    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({
            "type": ["integer", "string"],
            "minimum": 0,
            "maximum": SINCE_MAX,
            "maxLength": 64
        })
    }
}

/// `docker.logs` arguments.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct LogsArgs {
    /// A container's exact name.
    #[schemars(length(min = 1, max = NAME_MAX))]
    container: String,
    /// How many of the newest lines.
    #[serde(default = "tail_default")]
    #[schemars(range(min = 1, max = TAIL_MAX))]
    tail: u64,
    /// Only lines from then on: unix seconds, or a duration such as "10m" meaning that long ago.
    since: Option<Since>,
    /// Include stdout.
    #[serde(default = "yes")]
    stdout: bool,
    /// Include stderr.
    #[serde(default = "yes")]
    stderr: bool,
    /// Prefix each line with the engine's RFC 3339 timestamp.
    #[serde(default)]
    timestamps: bool,
}

fn tail_default() -> u64 {
    TAIL_DEFAULT
}

fn yes() -> bool {
    true
}

struct Logs(Arc<Docker>);

impl TypedTool for Logs {
    type Args = LogsArgs;

    fn spec(&self) -> ToolSpec {
        ToolSpec::typed::<Self::Args>(
            "docker.logs",
            "Recent log lines of a container this host allows, from the Docker engine: each line with its stream (stdout or stderr). At most 1 MiB of text; past it the oldest lines are dropped and truncated is true.",
            Annotations::READ_ONLY,
        )
        .describe("container", container_description(&self.0.containers))
    }

    fn run<'a>(&'a self, _ctx: &'a ToolContext<'a>, args: LogsArgs) -> ToolFuture<'a> {
        Box::pin(async move { self.0.logs(&args).await.map(ToolOutput::Structured) })
    }
}

/// What `docker.action` asks the engine to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
enum Action {
    Start,
    Stop,
    Restart,
}

impl Action {
    fn as_str(self) -> &'static str {
        match self {
            Action::Start => "start",
            Action::Stop => "stop",
            Action::Restart => "restart",
        }
    }

    fn done(self) -> &'static str {
        match self {
            Action::Start => "started",
            Action::Stop => "stopped",
            Action::Restart => "restarted",
        }
    }
}

/// `docker.action` arguments.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct ActionArgs {
    /// A container's exact name.
    #[schemars(length(min = 1, max = NAME_MAX))]
    container: String,
    /// What to ask the engine to do.
    action: Action,
}

struct ActionTool {
    docker: Arc<Docker>,
    jobs: Arc<Jobs>,
}

impl TypedTool for ActionTool {
    type Args = ActionArgs;

    fn spec(&self) -> ToolSpec {
        ToolSpec::typed::<Self::Args>(
            "docker.action",
            format!(
                "Start, stop or restart a container this host allows. Returns a job handle at once; follow it with job.status and job.tail. Not retried: if you lose the answer, check job.status or docker.logs before acting again. A job may take up to {}.",
                humantime::format_duration(self.docker.timeout)
            ),
            Annotations {
                read_only: false,
                destructive: true,
                idempotent: false,
                self_service: false,
                replay_safe: false,
            },
        )
        .describe("container", container_description(&self.docker.containers))
    }

    fn run<'a>(&'a self, ctx: &'a ToolContext<'a>, args: ActionArgs) -> ToolFuture<'a> {
        Box::pin(async move {
            let name = self.docker.permitted(&args.container)?.to_owned();
            let action = args.action;
            // The engine must know the container, under this very name, before a job exists.
            let id = self.docker.resolve(&name).await?.id;
            let docker = Arc::clone(&self.docker);
            let target = name.clone();
            let job = self.jobs.start(
                ctx.caller,
                crate::vocab::JobKind::Docker,
                &target,
                Some(action.as_str()),
                Work::Action {
                    timeout: self.docker.timeout,
                    run: Box::new(move |sink| {
                        Box::pin(async move { docker.act(&name, &id, action, &sink).await })
                    }),
                },
            )?;
            Ok(ToolOutput::Job(job))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_the_engine_grammar() {
        for good in ["web", "worker-1", "a", "9lives", "svc_v1.2", "A-b_c.d"] {
            assert_eq!(check_name(good), Ok(()), "{good}");
        }
        let cases = [
            ("", "empty"),
            ("/web", "start with"),
            ("-web", "start with"),
            (".web", "start with"),
            ("web/../db", "'/'"),
            ("web db", "' '"),
            ("web?x=1", "'?'"),
            ("wéb", "'é'"),
            ("web\n", "'\\n'"),
        ];
        for (bad, why) in cases {
            let problem = check_name(bad).expect_err(bad);
            assert!(problem.contains(why), "{bad:?}: {problem}");
        }
        assert!(check_name(&"a".repeat(NAME_MAX)).is_ok());
        assert!(
            check_name(&"a".repeat(NAME_MAX + 1))
                .unwrap_err()
                .contains("longer")
        );
    }

    fn docker(containers: &[&str]) -> Docker {
        Docker {
            engine: Engine::new("/nonexistent/docker.sock".into()),
            containers: containers.iter().map(|s| s.to_string()).collect(),
            timeout: Duration::from_secs(60),
        }
    }

    fn logs_args(args: Value) -> LogsArgs {
        crate::catalog::parse_args(args.as_object().cloned().unwrap()).unwrap()
    }

    #[test]
    fn the_allow_list_is_checked_after_the_grammar() {
        let d = docker(&["web", "worker-*"]);
        assert_eq!(d.permitted("web"), Ok("web"));
        assert_eq!(d.permitted("worker-7"), Ok("worker-7"));
        let denied = d.permitted("db").unwrap_err();
        assert_eq!(denied.code, ToolErrorCode::PermissionDenied);
        assert!(
            denied.message.contains("container db is not among"),
            "{}",
            denied.message
        );
        assert_eq!(
            d.permitted("webx").unwrap_err().code,
            ToolErrorCode::PermissionDenied
        );
        assert_eq!(
            d.permitted("worker-/x").unwrap_err().code,
            ToolErrorCode::InvalidArguments
        );
        assert_eq!(
            d.permitted("").unwrap_err().code,
            ToolErrorCode::InvalidArguments
        );

        let none = docker(&[]).permitted("web").unwrap_err();
        assert_eq!(none.code, ToolErrorCode::Unavailable);
    }

    #[test]
    fn since_takes_seconds_or_a_duration_ago() {
        let now = UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        assert_eq!(since_ago("10m", now), Ok(1_700_000_000 - 600));
        assert_eq!(since_ago("1h 30m", now), Ok(1_700_000_000 - 5400));
        assert_eq!(since_ago("100years", now), Ok(0));
        assert!(since_ago("10", now).is_err());
        assert!(since_ago("soon", now).unwrap_err().contains("duration"));
        let since = |v: Value| logs_args(json!({"container": "web", "since": v})).since;
        assert_eq!(
            since(json!(1_600_000_000)),
            Some(Since::Seconds(1_600_000_000))
        );
        assert_eq!(since(json!("10m")), Some(Since::Ago("10m".into())));
        let defaults = logs_args(json!({"container": "web"}));
        assert_eq!(
            (
                defaults.tail,
                defaults.stdout,
                defaults.stderr,
                defaults.timestamps
            ),
            (TAIL_DEFAULT, true, true, false)
        );
        for bad in [json!(-5), json!(true), json!(1.0), json!(1e300)] {
            let args = json!({"container": "web", "since": bad});
            let err = crate::catalog::parse_args::<LogsArgs>(args.as_object().cloned().unwrap())
                .unwrap_err();
            assert_eq!(err.code, ToolErrorCode::InvalidArguments, "{bad}");
            assert_eq!(
                err.message, "since: unix seconds (an integer) or a duration such as \"10m\"",
                "{bad}"
            );
        }
    }

    #[test]
    fn specs_declare_what_they_are() {
        let host_free = docker(&["web"]);
        let shared = Arc::new(host_free);
        let logs = TypedTool::spec(&Logs(Arc::clone(&shared)));
        assert_eq!(logs.annotations, Annotations::READ_ONLY);
        assert!(
            logs.input_schema["properties"]["container"]["description"]
                .as_str()
                .unwrap()
                .contains("web")
        );
        for (text, action) in [
            ("start", Action::Start),
            ("stop", Action::Stop),
            ("restart", Action::Restart),
        ] {
            assert_eq!(
                serde_json::from_value::<Action>(json!(text)).unwrap(),
                action
            );
            assert_eq!(action.as_str(), text);
        }
        assert!(serde_json::from_value::<Action>(json!("kill")).is_err());
    }

    #[tokio::test]
    async fn an_absent_engine_is_unavailable() {
        let dir = tempfile::tempdir().unwrap();
        let d = Docker {
            engine: Engine::new(dir.path().join("docker.sock")),
            containers: vec!["web".into()],
            timeout: Duration::from_secs(60),
        };
        let err = d
            .logs(&logs_args(json!({"container": "web"})))
            .await
            .unwrap_err();
        assert_eq!(err.code, ToolErrorCode::Unavailable);
        assert!(err.message.contains("docker.sock"), "{}", err.message);
    }
}
