//! `service.status` and `service.action`: systemd units through systemd's own D-Bus API
//! (`org.freedesktop.systemd1` on the system bus), only for the units `[tools.service]`
//! allows.
//!
//! The bus is whatever `DBUS_SYSTEM_BUS_ADDRESS` names, else the standard system bus
//! socket; the connection is made on first use and kept (and made again once it breaks).
//! A unit name is checked twice before anything acts on it: its grammar and the allow-list
//! locally, then the unit systemd resolves it to (an alias may name another unit), which
//! must be allowed too. An action is a durable job that follows systemd's own job to its
//! `JobRemoved` signal; it is never retried.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, UNIX_EPOCH};

use futures_util::StreamExt;
use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::{Value, json};
use zbus::Connection;
use zbus::proxy::CacheProperties;
use zbus::zvariant::{ObjectPath, OwnedObjectPath, OwnedValue};

use super::{allowed, invalid};
use crate::catalog::{Annotations, HostTool, ToolFuture, ToolSpec, TypedTool};
use crate::catalog::{ToolContext, ToolError, ToolOutput};
use crate::config::ServiceTool;
use crate::host::Host;
use crate::jobs::{Finish, Jobs, OutputSink, Work};
use crate::vocab::ToolErrorCode;
use crate::vocab::{JobKind, JobState};

const UNIT_IFACE: &str = "org.freedesktop.systemd1.Unit";
const SERVICE_IFACE: &str = "org.freedesktop.systemd1.Service";
const ALREADY_SUBSCRIBED: &str = "org.freedesktop.systemd1.AlreadySubscribed";

/// How long connecting to the bus may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long one method call may wait for its reply (the D-Bus libraries' usual default),
/// and how long one `service.status` may take as a whole.
const CALL_TIMEOUT: Duration = Duration::from_secs(25);
/// Longest unit name systemd accepts (`UNIT_NAME_MAX` less its NUL).
const UNIT_NAME_MAX: usize = 255;
/// Longest piece of a systemd error message shown to a caller.
const MESSAGE_MAX: usize = 200;
/// The unit types systemd knows (the name's suffix).
const UNIT_TYPES: [&str; 11] = [
    "service",
    "socket",
    "target",
    "timer",
    "path",
    "mount",
    "automount",
    "swap",
    "device",
    "slice",
    "scope",
];

#[zbus::proxy(
    interface = "org.freedesktop.systemd1.Manager",
    default_service = "org.freedesktop.systemd1",
    default_path = "/org/freedesktop/systemd1"
)]
trait Manager {
    fn load_unit(&self, name: &str) -> zbus::Result<OwnedObjectPath>;
    fn subscribe(&self) -> zbus::Result<()>;
    fn start_unit(&self, name: &str, mode: &str) -> zbus::Result<OwnedObjectPath>;
    fn stop_unit(&self, name: &str, mode: &str) -> zbus::Result<OwnedObjectPath>;
    fn restart_unit(&self, name: &str, mode: &str) -> zbus::Result<OwnedObjectPath>;
    fn reload_unit(&self, name: &str, mode: &str) -> zbus::Result<OwnedObjectPath>;

    #[zbus(signal)]
    fn job_removed(
        &self,
        id: u32,
        job: ObjectPath<'_>,
        unit: &str,
        result: &str,
    ) -> zbus::Result<()>;
}

/// `org.freedesktop.DBus.Properties` of one unit object.
#[zbus::proxy(
    interface = "org.freedesktop.DBus.Properties",
    default_service = "org.freedesktop.systemd1"
)]
trait UnitProperties {
    fn get_all(&self, interface: &str) -> zbus::Result<HashMap<String, OwnedValue>>;
    fn get(&self, interface: &str, name: &str) -> zbus::Result<OwnedValue>;
}

pub fn tools(config: &ServiceTool, host: &Arc<Host>) -> Vec<Arc<dyn HostTool>> {
    let systemd = Arc::new(Systemd {
        units: config.units.clone(),
        bus: tokio::sync::Mutex::new(None),
    });
    vec![
        Arc::new(Status(Arc::clone(&systemd))),
        Arc::new(Action {
            systemd,
            jobs: Arc::clone(&host.jobs),
            timeout: config.timeout,
        }),
    ]
}

/// Why a unit name is not one systemd would accept; `None` when it is well formed.
fn unit_name_problem(name: &str) -> Option<String> {
    if name.is_empty() {
        return Some("it is empty".into());
    }
    if name.len() > UNIT_NAME_MAX {
        return Some(format!("it is longer than {UNIT_NAME_MAX} characters"));
    }
    if let Some(c) = name
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || ":_.@-".contains(*c)))
    {
        return Some(format!(
            "the character {c:?} is not allowed (only A-Z a-z 0-9 : _ . @ -)"
        ));
    }
    let Some((prefix, kind)) = name.rsplit_once('.') else {
        return Some("it has no type suffix such as .service".into());
    };
    if !UNIT_TYPES.contains(&kind) {
        return Some(format!(
            "\".{kind}\" is not a unit type (.service, .socket, .timer, .target, .path, .mount, …)"
        ));
    }
    if prefix.is_empty() || prefix.starts_with('@') {
        return Some("it has no name before its suffix".into());
    }
    if prefix.matches('@').count() > 1 {
        return Some("it has more than one '@'".into());
    }
    None
}

/// Whether a caller may name `unit` at all: units configured, grammar, allow-list.
fn admit(patterns: &[String], unit: &str) -> Result<(), ToolError> {
    if patterns.is_empty() {
        return Err(ToolError::new(
            ToolErrorCode::Unavailable,
            "no units are configured ([tools.service] units is empty)",
        ));
    }
    if let Some(problem) = unit_name_problem(unit) {
        return Err(invalid(format!("{unit:?} is not a unit name: {problem}")));
    }
    if !allowed(patterns, unit) {
        return Err(denied(unit));
    }
    Ok(())
}

fn denied(unit: &str) -> ToolError {
    ToolError::new(
        ToolErrorCode::PermissionDenied,
        format!("unit {unit} is not among the units [tools.service] allows"),
    )
}

/// The unit systemd resolved `requested` to must be allowed as well: an alias of an
/// allowed name may point at a unit outside the allow-list.
fn admit_resolved(patterns: &[String], requested: &str, id: &str) -> Result<(), ToolError> {
    if id == requested || allowed(patterns, id) {
        Ok(())
    } else {
        Err(ToolError::new(
            ToolErrorCode::PermissionDenied,
            format!(
                "unit {requested} is an alias of {id}, which is not among the units [tools.service] allows"
            ),
        ))
    }
}

fn unreachable(reason: &str) -> ToolError {
    ToolError::new(
        ToolErrorCode::Unavailable,
        format!("systemd's D-Bus API is not reachable: {reason}"),
    )
}

/// A short reason for a connection or transport failure (the whole error goes to the log).
fn short_reason(e: &zbus::Error) -> String {
    match e {
        zbus::Error::InputOutput(io) | zbus::Error::Connection(io, _) => {
            if io.kind() == std::io::ErrorKind::TimedOut {
                "systemd did not answer in time".into()
            } else {
                io.to_string()
            }
        }
        zbus::Error::Address(_) => "the system bus address is not valid".into(),
        zbus::Error::Handshake(_) => "the bus refused the authentication handshake".into(),
        _ => "the connection failed".into(),
    }
}

fn clip(text: &str) -> &str {
    match text.char_indices().nth(MESSAGE_MAX) {
        Some((i, _)) => &text[..i],
        None => text,
    }
}

/// A D-Bus error reply: its name and message.
fn error_reply(e: &zbus::Error) -> Option<(String, String)> {
    match e {
        zbus::Error::MethodError(name, message, _) => Some((
            name.to_string(),
            clip(message.as_deref().unwrap_or_default()).to_owned(),
        )),
        zbus::Error::FDO(fdo) => {
            use zbus::DBusError;
            Some((
                fdo.name().to_string(),
                clip(fdo.description().unwrap_or_default()).to_owned(),
            ))
        }
        _ => None,
    }
}

/// A visible error for a failed read-only call to systemd.
fn read_failure(method: &str, e: &zbus::Error) -> ToolError {
    let Some((name, message)) = error_reply(e) else {
        tracing::warn!(error = %e, method, "a call to systemd failed");
        return unreachable(&short_reason(e));
    };
    let code = match name.as_str() {
        "org.freedesktop.DBus.Error.InvalidArgs" => ToolErrorCode::InvalidArguments,
        "org.freedesktop.DBus.Error.AccessDenied"
        | "org.freedesktop.DBus.Error.InteractiveAuthorizationRequired" => {
            ToolErrorCode::PermissionDenied
        }
        _ => ToolErrorCode::Unavailable,
    };
    ToolError::new(code, format!("systemd refused {method}: {name}: {message}"))
}

fn text<'a>(props: &'a HashMap<String, OwnedValue>, key: &str) -> Option<&'a str> {
    props.get(key).and_then(|v| <&str>::try_from(&**v).ok())
}

fn number(props: &HashMap<String, OwnedValue>, key: &str) -> Option<u64> {
    props.get(key).and_then(|v| u64::try_from(&**v).ok())
}

/// A unit as systemd resolved it.
struct Loaded {
    path: OwnedObjectPath,
    unit: HashMap<String, OwnedValue>,
}

impl Loaded {
    fn id<'a>(&'a self, requested: &'a str) -> &'a str {
        text(&self.unit, "Id")
            .filter(|id| !id.is_empty())
            .unwrap_or(requested)
    }
}

/// The `service.status` result from the unit's properties.
fn status_json(
    requested: &str,
    unit: &HashMap<String, OwnedValue>,
    main_pid: Option<u32>,
) -> Value {
    let id = text(unit, "Id")
        .filter(|id| !id.is_empty())
        .unwrap_or(requested);
    let field = |key| text(unit, key).unwrap_or_default();
    let mut out = json!({
        "unit": id,
        "load_state": field("LoadState"),
        "active_state": field("ActiveState"),
        "sub_state": field("SubState"),
        "description": field("Description"),
        "unit_file_state": text(unit, "UnitFileState").filter(|s| !s.is_empty()),
        "active_enter_timestamp": number(unit, "ActiveEnterTimestamp")
            .filter(|us| *us > 0)
            .map(|us| humantime::format_rfc3339_micros(UNIX_EPOCH + Duration::from_micros(us)).to_string()),
    });
    if id != requested {
        out["requested"] = json!(requested);
    }
    if id.ends_with(".service") {
        out["main_pid"] = json!(main_pid.filter(|pid| *pid > 0));
    }
    out
}

/// The system bus connection, made on first use and kept.
struct Systemd {
    units: Vec<String>,
    bus: tokio::sync::Mutex<Option<Connection>>,
}

impl Systemd {
    async fn connection(&self) -> Result<Connection, ToolError> {
        let mut cached = self.bus.lock().await;
        if let Some(conn) = cached.as_ref().filter(|c| !c.is_closed()) {
            return Ok(conn.clone());
        }
        *cached = None;
        let connect = async {
            zbus::connection::Builder::system()?
                .method_timeout(CALL_TIMEOUT)
                .build()
                .await
        };
        let conn = match tokio::time::timeout(CONNECT_TIMEOUT, connect).await {
            Err(_) => {
                return Err(unreachable(&format!(
                    "the bus did not answer within {}",
                    humantime::format_duration(CONNECT_TIMEOUT)
                )));
            }
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "cannot connect to the system bus");
                return Err(unreachable(&short_reason(&e)));
            }
            Ok(Ok(conn)) => conn,
        };
        tracing::debug!("connected to the system bus");
        *cached = Some(conn.clone());
        Ok(conn)
    }

    /// `LoadUnit` and the unit's properties; refuses an alias of a unit that is not allowed.
    async fn load(&self, conn: &Connection, name: &str) -> Result<Loaded, ToolError> {
        let manager = manager(conn)
            .await
            .map_err(|e| read_failure("LoadUnit", &e))?;
        let path = manager
            .load_unit(name)
            .await
            .map_err(|e| read_failure("LoadUnit", &e))?;
        let props = properties(conn, &path)
            .await
            .map_err(|e| read_failure("GetAll", &e))?;
        let unit = props
            .get_all(UNIT_IFACE)
            .await
            .map_err(|e| read_failure("GetAll", &e))?;
        let loaded = Loaded { path, unit };
        admit_resolved(&self.units, name, loaded.id(name))?;
        Ok(loaded)
    }

    async fn status(&self, name: &str) -> Result<Value, ToolError> {
        admit(&self.units, name)?;
        let conn = self.connection().await?;
        let work = async {
            let loaded = self.load(&conn, name).await?;
            let id = loaded.id(name);
            let main_pid = if id.ends_with(".service") {
                let props = properties(&conn, &loaded.path)
                    .await
                    .map_err(|e| read_failure("Get", &e))?;
                match props.get(SERVICE_IFACE, "MainPID").await {
                    Ok(v) => u32::try_from(&*v).ok(),
                    // A unit systemd could not load may lack the Service interface.
                    Err(e) if error_reply(&e).is_some() => {
                        tracing::debug!(error = %e, unit = id, "no MainPID");
                        None
                    }
                    Err(e) => return Err(read_failure("Get", &e)),
                }
            } else {
                None
            };
            Ok(status_json(name, &loaded.unit, main_pid))
        };
        match tokio::time::timeout(CALL_TIMEOUT, work).await {
            Ok(result) => result,
            Err(_) => Err(unreachable(&format!(
                "systemd did not answer within {}",
                humantime::format_duration(CALL_TIMEOUT)
            ))),
        }
    }
}

async fn manager(conn: &Connection) -> zbus::Result<ManagerProxy<'static>> {
    ManagerProxy::builder(conn)
        .cache_properties(CacheProperties::No)
        .build()
        .await
}

async fn properties(
    conn: &Connection,
    path: &OwnedObjectPath,
) -> zbus::Result<UnitPropertiesProxy<'static>> {
    UnitPropertiesProxy::builder(conn)
        .path(path.clone())?
        .cache_properties(CacheProperties::No)
        .build()
        .await
}

struct Status(Arc<Systemd>);

/// The `unit` description, naming what this host allows.
fn unit_description(patterns: &[String]) -> String {
    if patterns.is_empty() {
        "A systemd unit name. No units are configured on this host.".to_owned()
    } else {
        format!(
            "A systemd unit name with its type suffix (e.g. nginx.service). This host allows units matching: {}.",
            patterns.join(", ")
        )
    }
}

/// `service.status` arguments.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct StatusArgs {
    /// A systemd unit name.
    #[schemars(length(min = 1, max = UNIT_NAME_MAX))]
    unit: String,
}

impl TypedTool for Status {
    type Args = StatusArgs;

    fn spec(&self) -> ToolSpec {
        ToolSpec::typed::<Self::Args>(
            "service.status",
            "The state of a systemd unit this host allows: load, active and sub state, description, unit file state, main PID (services) and when it last became active. A unit that does not exist has load_state \"not-found\".",
            Annotations::READ_ONLY,
        )
        .describe("unit", unit_description(&self.0.units))
    }

    fn run<'a>(&'a self, _ctx: &'a ToolContext<'a>, args: StatusArgs) -> ToolFuture<'a> {
        Box::pin(async move { self.0.status(&args.unit).await.map(ToolOutput::Structured) })
    }
}

/// What `service.action` asks systemd to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
enum Verb {
    Start,
    Stop,
    Restart,
    Reload,
}

impl Verb {
    fn as_str(self) -> &'static str {
        match self {
            Verb::Start => "start",
            Verb::Stop => "stop",
            Verb::Restart => "restart",
            Verb::Reload => "reload",
        }
    }

    fn method(self) -> &'static str {
        match self {
            Verb::Start => "StartUnit",
            Verb::Stop => "StopUnit",
            Verb::Restart => "RestartUnit",
            Verb::Reload => "ReloadUnit",
        }
    }

    /// Queue systemd's job (mode `replace`, as systemctl does); its object path.
    async fn queue(self, manager: &ManagerProxy<'_>, unit: &str) -> zbus::Result<OwnedObjectPath> {
        match self {
            Verb::Start => manager.start_unit(unit, "replace").await,
            Verb::Stop => manager.stop_unit(unit, "replace").await,
            Verb::Restart => manager.restart_unit(unit, "replace").await,
            Verb::Reload => manager.reload_unit(unit, "replace").await,
        }
    }
}

/// `service.action` arguments.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct ActionArgs {
    /// A systemd unit name.
    #[schemars(length(min = 1, max = UNIT_NAME_MAX))]
    unit: String,
    /// What to ask systemd to do.
    action: Verb,
}

struct Action {
    systemd: Arc<Systemd>,
    jobs: Arc<Jobs>,
    timeout: Duration,
}

impl TypedTool for Action {
    type Args = ActionArgs;

    fn spec(&self) -> ToolSpec {
        ToolSpec::typed::<Self::Args>(
            "service.action",
            "Start, stop, restart or reload a systemd unit this host allows. Returns a durable job handle at once; follow it with job.status and job.tail. The job succeeds when systemd's job ends with result \"done\". Never retried: calling twice acts twice.",
            Annotations {
                read_only: false,
                destructive: true,
                idempotent: false,
                self_service: false,
                replay_safe: false,
            },
        )
        .describe("unit", unit_description(&self.systemd.units))
    }

    fn run<'a>(&'a self, ctx: &'a ToolContext<'a>, args: ActionArgs) -> ToolFuture<'a> {
        Box::pin(async move {
            let ActionArgs { unit, action: verb } = args;
            admit(&self.systemd.units, &unit)?;
            let conn = self.systemd.connection().await?;
            // Resolve first, so that an alias of a unit outside the allow-list is refused
            // before anything is queued.
            match tokio::time::timeout(CALL_TIMEOUT, self.systemd.load(&conn, &unit)).await {
                Ok(loaded) => loaded?,
                Err(_) => {
                    return Err(unreachable(&format!(
                        "systemd did not answer within {}",
                        humantime::format_duration(CALL_TIMEOUT)
                    )));
                }
            };
            let target = unit.clone();
            let job = self.jobs.start(
                ctx.caller,
                JobKind::Service,
                &unit,
                Some(verb.as_str()),
                Work::Action {
                    timeout: self.timeout,
                    run: Box::new(move |sink| Box::pin(run_action(conn, target, verb, sink))),
                },
            )?;
            Ok(ToolOutput::Job(job))
        })
    }
}

fn outcome_unknown(detail: String) -> Finish {
    Finish {
        state: JobState::OutcomeUnknown,
        exit_code: None,
        detail,
    }
}

fn log(sink: &OutputSink, line: &str) {
    sink.write("log", format!("{line}\n").as_bytes());
}

/// The job: queue systemd's job and follow it to its `JobRemoved`.
async fn run_action(conn: Connection, unit: String, verb: Verb, sink: OutputSink) -> Finish {
    let method = verb.method();
    let manager = match manager(&conn).await {
        Ok(m) => m,
        Err(e) => {
            tracing::warn!(error = %e, "cannot reach systemd");
            return Finish::failed(format!(
                "systemd's D-Bus API is not reachable: {}",
                short_reason(&e)
            ));
        }
    };
    // Listen before queueing, so that a job that ends at once is not missed; and ask
    // systemd to send its job signals at all, as systemctl does.
    let mut removed = match manager.receive_job_removed().await {
        Ok(stream) => stream,
        Err(e) => {
            tracing::warn!(error = %e, "cannot listen for systemd's JobRemoved");
            return Finish::failed(format!(
                "systemd's D-Bus API is not reachable: {}",
                short_reason(&e)
            ));
        }
    };
    match manager.subscribe().await {
        Ok(()) => {}
        Err(e) if error_reply(&e).is_some_and(|(name, _)| name == ALREADY_SUBSCRIBED) => {}
        Err(e) => {
            tracing::warn!(error = %e, "systemd Subscribe failed");
            let reason = match error_reply(&e) {
                Some((name, message)) => format!("systemd refused Subscribe: {name}: {message}"),
                None => format!("systemd's D-Bus API is not reachable: {}", short_reason(&e)),
            };
            return Finish::failed(reason);
        }
    }
    let job = match verb.queue(&manager, &unit).await {
        Ok(job) => job,
        Err(e) => {
            return match error_reply(&e) {
                Some((name, message)) => {
                    // Without polkitd, or without a rule for the daemon's user, systemd
                    // refuses every job of an unprivileged caller.
                    let hint = if name == "org.freedesktop.DBus.Error.AccessDenied" {
                        " (the daemon's user may start jobs only through polkit: polkitd \
                         installed and a rule allowing it this unit, see the packaging README)"
                    } else {
                        ""
                    };
                    log(
                        &sink,
                        &format!("systemd refused {method} {unit}: {name}: {message}{hint}"),
                    );
                    Finish::failed(format!("{name}: {message}{hint}"))
                }
                None => {
                    tracing::warn!(error = %e, unit, method, "a systemd job request was interrupted");
                    let detail = format!(
                        "the {method} request was interrupted ({}); systemd may or may not have queued it",
                        short_reason(&e)
                    );
                    log(&sink, &detail);
                    outcome_unknown(detail)
                }
            };
        }
    };
    log(&sink, &format!("systemd job {} queued", job.as_str()));
    loop {
        let signal = tokio::select! {
            signal = removed.next() => signal,
            () = conn.closed() => None,
        };
        let Some(signal) = signal else {
            let detail = format!(
                "lost the connection to systemd while job {} ran; its outcome is unknown",
                job.as_str()
            );
            log(&sink, &detail);
            return outcome_unknown(detail);
        };
        let args = match signal.args() {
            Ok(args) => args,
            Err(e) => {
                tracing::debug!(error = %e, "ignoring a malformed JobRemoved");
                continue;
            }
        };
        if args.job.as_str() != job.as_str() {
            continue;
        }
        let result = args.result;
        log(
            &sink,
            &format!("systemd job {} finished: {result}", job.as_str()),
        );
        return if result == "done" {
            Finish::succeeded(format!("{} of {unit}: done", verb.as_str()))
        } else {
            Finish::failed(format!(
                "systemd's {} job for {unit} ended with result \"{result}\"",
                verb.as_str()
            ))
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::session::RuntimeTools;
    use crate::session::tests::session;
    use crate::vocab::Caller;
    use tokio_util::sync::CancellationToken;

    fn patterns() -> Vec<String> {
        vec!["nginx.service".into(), "myapp-*.service".into()]
    }

    #[test]
    fn unit_names_follow_systemd_grammar() {
        for good in [
            "nginx.service",
            "myapp-web.service",
            "getty@tty1.service",
            "backup.timer",
            "dbus.socket",
            "multi-user.target",
            "-.mount",
            "sys-kernel-debug.mount",
            "a:b_c.path",
        ] {
            assert_eq!(unit_name_problem(good), None, "{good}");
        }
        for (bad, why) in [
            ("", "empty"),
            ("nginx", "type suffix"),
            ("nginx.exe", "not a unit type"),
            ("nginx.", "not a unit type"),
            (".service", "no name"),
            ("@x.service", "no name"),
            ("a@b@c.service", "more than one"),
            ("../nginx.service", "'/'"),
            ("/etc/nginx.service", "'/'"),
            ("nginx service", "' '"),
            ("nginx.service;reboot", "';'"),
            ("ngïnx.service", "'ï'"),
            ("x\\x2dy.service", "'\\\\'"),
        ] {
            let problem = unit_name_problem(bad).unwrap_or_else(|| panic!("{bad:?} accepted"));
            assert!(problem.contains(why), "{bad:?}: {problem}");
        }
        let long = format!("{}.service", "a".repeat(250));
        assert!(
            unit_name_problem(&long)
                .unwrap()
                .contains("longer than 255")
        );
    }

    #[test]
    fn allow_list_decisions() {
        let p = patterns();
        assert_eq!(admit(&p, "nginx.service"), Ok(()));
        assert_eq!(admit(&p, "myapp-api.service"), Ok(()));
        let refusals = [
            ("sshd.service", ToolErrorCode::PermissionDenied),
            ("nginx.socket", ToolErrorCode::PermissionDenied),
            ("myapp.service", ToolErrorCode::PermissionDenied),
            ("nginx.service.d", ToolErrorCode::InvalidArguments),
            ("myapp-../x.service", ToolErrorCode::InvalidArguments),
            ("nginx", ToolErrorCode::InvalidArguments),
        ];
        for (unit, code) in refusals {
            let err = admit(&p, unit).unwrap_err();
            assert_eq!(err.code, code, "{unit}: {err}");
        }
        let err = admit(&p, "sshd.service").unwrap_err();
        assert_eq!(
            err.message,
            "unit sshd.service is not among the units [tools.service] allows"
        );
        // Nothing configured: unavailable whatever the name.
        let err = admit(&[], "nginx.service").unwrap_err();
        assert_eq!(err.code, ToolErrorCode::Unavailable);
        assert!(err.message.contains("no units are configured"));
    }

    #[test]
    fn an_alias_must_resolve_to_an_allowed_unit() {
        let p = patterns();
        assert_eq!(admit_resolved(&p, "nginx.service", "nginx.service"), Ok(()));
        assert_eq!(
            admit_resolved(&p, "myapp-a.service", "myapp-b.service"),
            Ok(())
        );
        let err = admit_resolved(&p, "myapp-shell.service", "sshd.service").unwrap_err();
        assert_eq!(err.code, ToolErrorCode::PermissionDenied);
        assert!(err.message.contains("alias of sshd.service"), "{err}");
    }

    #[test]
    fn status_reads_unit_properties() {
        let props: HashMap<String, OwnedValue> = [
            (
                "Id",
                OwnedValue::from(zbus::zvariant::Str::from("nginx.service")),
            ),
            (
                "LoadState",
                OwnedValue::from(zbus::zvariant::Str::from("loaded")),
            ),
            (
                "ActiveState",
                OwnedValue::from(zbus::zvariant::Str::from("active")),
            ),
            (
                "SubState",
                OwnedValue::from(zbus::zvariant::Str::from("running")),
            ),
            (
                "Description",
                OwnedValue::from(zbus::zvariant::Str::from("web")),
            ),
            (
                "UnitFileState",
                OwnedValue::from(zbus::zvariant::Str::from("")),
            ),
            (
                "ActiveEnterTimestamp",
                OwnedValue::from(1_700_000_000_123_456u64),
            ),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect();
        let v = status_json("nginx.service", &props, Some(4242));
        assert_eq!(
            v,
            json!({
                "unit": "nginx.service",
                "load_state": "loaded",
                "active_state": "active",
                "sub_state": "running",
                "description": "web",
                "unit_file_state": null,
                "active_enter_timestamp": "2023-11-14T22:13:20.123456Z",
                "main_pid": 4242,
            })
        );
        // No main process, never active.
        let mut props = props;
        props.insert("ActiveEnterTimestamp".into(), OwnedValue::from(0u64));
        let v = status_json("nginx.service", &props, Some(0));
        assert_eq!(v["main_pid"], Value::Null);
        assert_eq!(v["active_enter_timestamp"], Value::Null);
        // Not a service: no main_pid at all; an alias names what was asked for.
        props.insert(
            "Id".into(),
            OwnedValue::from(zbus::zvariant::Str::from("backup.timer")),
        );
        let v = status_json("nightly.timer", &props, None);
        assert_eq!(v["unit"], "backup.timer");
        assert_eq!(v["requested"], "nightly.timer");
        assert!(v.get("main_pid").is_none());
    }

    #[test]
    fn verbs_map_to_manager_methods() {
        for (text, verb, method) in [
            ("start", Verb::Start, "StartUnit"),
            ("stop", Verb::Stop, "StopUnit"),
            ("restart", Verb::Restart, "RestartUnit"),
            ("reload", Verb::Reload, "ReloadUnit"),
        ] {
            assert_eq!(serde_json::from_value::<Verb>(json!(text)).unwrap(), verb);
            assert_eq!((verb.as_str(), verb.method()), (text, method));
        }
        assert!(serde_json::from_value::<Verb>(json!("kill")).is_err());
    }

    #[tokio::test]
    async fn without_units_the_tools_are_listed_and_unavailable() {
        let s = session("");
        let catalog = s.catalog();
        let names: Vec<&str> = catalog.specs().map(|spec| spec.name.as_str()).collect();
        assert!(names.contains(&"service.status") && names.contains(&"service.action"));
        let err = s
            .invoke_runtime_tool(
                &Caller::Bearer("default".into()).into(),
                "service.status",
                json!({"unit": "nginx.service"})
                    .as_object()
                    .cloned()
                    .unwrap(),
                CancellationToken::new(),
                Default::default(),
            )
            .await
            .unwrap_err();
        assert_eq!(err.code, ToolErrorCode::Unavailable);
        assert!(err.message.contains("no units are configured"), "{err}");
    }

    #[tokio::test]
    async fn an_unreachable_bus_is_unavailable_not_an_error_of_the_caller() {
        // A bus address with no socket behind it (zbus reads it through Builder::address,
        // the same code path as DBUS_SYSTEM_BUS_ADDRESS).
        let dir = tempfile::tempdir().unwrap();
        let address = format!("unix:path={}", dir.path().join("none").display());
        let e = zbus::connection::Builder::address(address.as_str())
            .unwrap()
            .build()
            .await
            .unwrap_err();
        let message = unreachable(&short_reason(&e)).message;
        assert!(
            message.starts_with("systemd's D-Bus API is not reachable: ")
                && message.contains("No such file or directory"),
            "{message}"
        );
        assert!(!message.contains(&address), "{message}");
    }
}
