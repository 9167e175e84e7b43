//! Test double: systemd's D-Bus API (`org.freedesktop.systemd1`) on a private
//! `dbus-daemon`, spoken over the real D-Bus wire.
//!
//! [`PrivateBus`] runs a `dbus-daemon` of type `system` listening on a socket in a temp
//! directory; the daemon under test reaches it through `DBUS_SYSTEM_BUS_ADDRESS`.
//! [`FakeSystemd`] owns the name `org.freedesktop.systemd1` on it and serves what systemd
//! serves, laid out as systemd lays it out: the Manager at `/org/freedesktop/systemd1`
//! (`LoadUnit`, `GetUnit`, `StartUnit`, `StopUnit`, `RestartUnit`, `ReloadUnit`,
//! `Subscribe`, `Unsubscribe`, the `JobRemoved` signal) and one object per unit under
//! `/org/freedesktop/systemd1/unit/<escaped name>` with the `Unit` (and, for services, the
//! `Service`) interface. Jobs end after [`JOB_DELAY`] and change the unit's state as
//! systemd would. Every Manager call is recorded, so tests can tell what reached the bus.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::fs;
use std::io::{BufRead, BufReader};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex, MutexGuard, mpsc};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tokio::task::JoinHandle;
use zbus::message::Header;
use zbus::object_server::SignalEmitter;
use zbus::zvariant::{ObjectPath, OwnedObjectPath};
use zbus::{Connection, ObjectServer};

/// How long a fake systemd job runs before `JobRemoved`.
pub const JOB_DELAY: Duration = Duration::from_millis(150);
/// How long the private bus may take to start listening.
const BUS_START_LIMIT: Duration = Duration::from_secs(10);

const SYSTEMD_NAME: &str = "org.freedesktop.systemd1";
const MANAGER_PATH: &str = "/org/freedesktop/systemd1";

/// A private `dbus-daemon` (bus type `system`) on `<dir>/bus`; killed on drop.
pub struct PrivateBus {
    child: Child,
    address: String,
    socket: PathBuf,
}

fn xml_escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

fn bus_config(socket: &Path) -> String {
    format!(
        r#"<!DOCTYPE busconfig PUBLIC "-//freedesktop//DTD D-Bus Bus Configuration 1.0//EN"
 "http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd">
<busconfig>
  <type>system</type>
  <listen>unix:path={}</listen>
  <auth>EXTERNAL</auth>
  <policy context="default">
    <allow user="*"/>
    <allow own="*"/>
    <allow send_destination="*" eavesdrop="true"/>
    <allow receive_sender="*"/>
    <allow eavesdrop="true"/>
  </policy>
</busconfig>
"#,
        xml_escape(&socket.display().to_string())
    )
}

impl PrivateBus {
    /// Writes a bus config into `dir`, starts `dbus-daemon` on `<dir>/bus` and waits
    /// (bounded) until the socket accepts connections. A stale socket from an earlier bus
    /// in the same directory is replaced, so a bus can be "restarted" at the same address.
    pub fn start(dir: &Path) -> PrivateBus {
        let socket = dir.join("bus");
        let config = dir.join("bus.conf");
        fs::write(&config, bus_config(&socket)).expect("write the bus config");
        let stderr = fs::File::create(dir.join("dbus-daemon.stderr")).expect("stderr file");
        let mut child = Command::new("dbus-daemon")
            .arg(format!("--config-file={}", config.display()))
            .args(["--nofork", "--nopidfile", "--nosyslog", "--print-address=1"])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(stderr)
            .spawn()
            .expect("spawn dbus-daemon (is it installed?)");
        let stdout = child.stdout.take().expect("dbus-daemon stdout");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            let _ = BufReader::new(stdout).read_line(&mut line);
            let _ = tx.send(line);
        });
        let mut bus = PrivateBus {
            child,
            address: String::new(),
            socket,
        };
        let stderr_text = || fs::read_to_string(dir.join("dbus-daemon.stderr")).unwrap_or_default();
        let line = match rx.recv_timeout(BUS_START_LIMIT) {
            Ok(line) if !line.trim().is_empty() => line,
            _ => panic!(
                "dbus-daemon printed no address within {BUS_START_LIMIT:?}; stderr: {}",
                stderr_text()
            ),
        };
        bus.address = line.trim().to_owned();
        let accepts =
            crate::poll_until_blocking(BUS_START_LIMIT, Duration::from_millis(10), || {
                UnixStream::connect(&bus.socket).is_ok()
            });
        assert!(
            accepts,
            "the private bus socket {} does not accept connections; stderr: {}",
            bus.socket.display(),
            stderr_text()
        );
        bus
    }

    /// The bus address as `dbus-daemon` printed it (`unix:path=…,guid=…`).
    pub fn address(&self) -> &str {
        &self.address
    }

    pub fn socket(&self) -> &Path {
        &self.socket
    }
}

impl Drop for PrivateBus {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = kill(Pid::from_raw(self.child.id() as i32), Signal::SIGTERM);
            let exited = crate::poll_until_blocking(
                Duration::from_secs(3),
                Duration::from_millis(10),
                || !matches!(self.child.try_wait(), Ok(None)),
            );
            if !exited {
                let _ = self.child.kill();
            }
        }
        let _ = self.child.wait();
    }
}

/// systemd's object path for a unit: `bus_label_escape` (every byte outside `[A-Za-z]`,
/// and outside `[0-9]` after the first, becomes `_xx`).
pub fn unit_path(name: &str) -> String {
    let mut path = String::from("/org/freedesktop/systemd1/unit/");
    if name.is_empty() {
        path.push('_');
    }
    for (i, b) in name.bytes().enumerate() {
        if b.is_ascii_alphabetic() || (i > 0 && b.is_ascii_digit()) {
            path.push(char::from(b));
        } else {
            let _ = write!(path, "_{b:02x}");
        }
    }
    path
}

fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

/// One unit in the fake's table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FakeUnit {
    pub name: String,
    pub description: String,
    pub load_state: String,
    pub active_state: String,
    pub sub_state: String,
    pub unit_file_state: String,
    /// Only meaningful for services; 0 when there is no main process.
    pub main_pid: u32,
    /// Microseconds since the epoch; 0 when never active.
    pub active_enter_timestamp: u64,
    /// The `result` every job on this unit ends with (`done` unless configured).
    pub job_result: String,
}

impl FakeUnit {
    /// A loaded, enabled unit that is active and running with `main_pid`.
    pub fn running(name: &str, main_pid: u32) -> Self {
        FakeUnit {
            name: name.into(),
            description: format!("Fake {name}"),
            load_state: "loaded".into(),
            active_state: "active".into(),
            sub_state: "running".into(),
            unit_file_state: "enabled".into(),
            main_pid,
            active_enter_timestamp: now_us(),
            job_result: "done".into(),
        }
    }

    /// A loaded, enabled unit that is inactive (dead).
    pub fn inactive(name: &str) -> Self {
        FakeUnit {
            active_state: "inactive".into(),
            sub_state: "dead".into(),
            main_pid: 0,
            active_enter_timestamp: 0,
            ..FakeUnit::running(name, 0)
        }
    }

    /// What systemd shows for a name it has no unit file for.
    fn not_found(name: &str) -> Self {
        FakeUnit {
            description: name.into(),
            load_state: "not-found".into(),
            unit_file_state: String::new(),
            ..FakeUnit::inactive(name)
        }
    }

    pub fn description(mut self, text: &str) -> Self {
        self.description = text.into();
        self
    }

    /// Every job on this unit ends with `result` (`failed`, `canceled`, `timeout`,
    /// `dependency`, `skipped`, …) instead of `done`.
    pub fn job_result(mut self, result: &str) -> Self {
        self.job_result = result.into();
        self
    }
}

/// One Manager method call as the fake received it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Call {
    /// `LoadUnit`, `RestartUnit`, …
    pub method: String,
    pub args: Vec<String>,
    /// The caller's unique bus name.
    pub sender: String,
}

#[derive(Default)]
struct State {
    units: BTreeMap<String, FakeUnit>,
    /// Names `LoadUnit` was asked for that have no unit (served as `not-found`).
    loaded: BTreeSet<String>,
    calls: Vec<Call>,
    subscribers: BTreeSet<String>,
    next_job: u32,
    next_pid: u32,
    jobs: Vec<JoinHandle<()>>,
}

type Shared = Arc<Mutex<State>>;

fn lock(state: &Shared) -> MutexGuard<'_, State> {
    state.lock().unwrap_or_else(|e| e.into_inner())
}

#[derive(Debug, zbus::DBusError)]
#[zbus(prefix = "org.freedesktop")]
enum SystemdError {
    #[zbus(error)]
    ZBus(zbus::Error),
    #[zbus(name = "systemd1.NoSuchUnit")]
    NoSuchUnit(String),
    #[zbus(name = "systemd1.AlreadySubscribed")]
    AlreadySubscribed(String),
    #[zbus(name = "systemd1.NotSubscribed")]
    NotSubscribed(String),
    #[zbus(name = "DBus.Error.InvalidArgs")]
    InvalidArgs(String),
}

/// systemd's `unit_name_is_valid`, roughly: a name, a dot, a type; no '/'.
fn valid_unit_name(name: &str) -> bool {
    name.len() <= 255
        && name
            .rsplit_once('.')
            .is_some_and(|(prefix, kind)| !prefix.is_empty() && !kind.is_empty())
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || ":_.@-\\".contains(c))
}

#[derive(Debug, Clone, Copy)]
enum Verb {
    Start,
    Stop,
    Restart,
    Reload,
}

struct Manager {
    state: Shared,
}

impl Manager {
    fn record(&self, header: &Header<'_>, method: &str, args: &[&str]) {
        lock(&self.state).calls.push(Call {
            method: method.into(),
            args: args.iter().map(|a| (*a).to_owned()).collect(),
            sender: header.sender().map(|s| s.to_string()).unwrap_or_default(),
        });
    }

    /// Queue a job as systemd does: the unit goes to its transitional state now and to
    /// its end state after [`JOB_DELAY`], when `JobRemoved` goes to subscribers.
    fn queue(
        &self,
        emitter: SignalEmitter<'_>,
        verb: Verb,
        name: &str,
        mode: &str,
    ) -> Result<OwnedObjectPath, SystemdError> {
        const MODES: [&str; 6] = [
            "replace",
            "fail",
            "isolate",
            "ignore-dependencies",
            "ignore-requirements",
            "flush",
        ];
        if !MODES.contains(&mode) {
            return Err(SystemdError::InvalidArgs(format!(
                "Job mode {mode} invalid."
            )));
        }
        let mut state = lock(&self.state);
        if !state.units.contains_key(name) {
            return Err(SystemdError::NoSuchUnit(format!("Unit {name} not found.")));
        }
        state.next_job += 1;
        let id = state.next_job;
        let job = OwnedObjectPath::try_from(format!("{MANAGER_PATH}/job/{id}"))
            .map_err(zbus::Error::from)?;
        let Some(unit) = state.units.get_mut(name) else {
            return Err(SystemdError::NoSuchUnit(format!("Unit {name} not found.")));
        };
        let before = (unit.active_state.clone(), unit.sub_state.clone());
        let (active, sub) = match verb {
            Verb::Start | Verb::Restart => ("activating", "start"),
            Verb::Stop => ("deactivating", "stop"),
            Verb::Reload => ("reloading", "reload"),
        };
        unit.active_state = active.into();
        unit.sub_state = sub.into();
        let result = unit.job_result.clone();
        let emitter = emitter.to_owned();
        let shared = Arc::clone(&self.state);
        let (unit_name, job_path) = (name.to_owned(), job.clone());
        let task = tokio::spawn(async move {
            tokio::time::sleep(JOB_DELAY).await;
            let subscribed = {
                let mut state = lock(&shared);
                state.next_pid += 1;
                let pid = state.next_pid;
                if let Some(unit) = state.units.get_mut(&unit_name) {
                    end_state(unit, verb, &result, before, pid);
                }
                !state.subscribers.is_empty()
            };
            // Like systemd on the system bus: job signals only while someone subscribed.
            if subscribed {
                let _ = Manager::job_removed(&emitter, id, job_path.as_ref(), &unit_name, &result)
                    .await;
            }
        });
        state.jobs.retain(|t| !t.is_finished());
        state.jobs.push(task);
        Ok(job)
    }
}

fn end_state(unit: &mut FakeUnit, verb: Verb, result: &str, before: (String, String), pid: u32) {
    let (active, sub) = match (verb, result) {
        (Verb::Start | Verb::Restart, "done") => {
            unit.main_pid = pid;
            unit.active_enter_timestamp = now_us();
            ("active", "running")
        }
        (Verb::Reload, "done") => ("active", "running"),
        (Verb::Stop, "done") => {
            unit.main_pid = 0;
            ("inactive", "dead")
        }
        (_, "failed" | "timeout") => {
            unit.main_pid = 0;
            ("failed", "failed")
        }
        _ => {
            unit.active_state = before.0;
            unit.sub_state = before.1;
            return;
        }
    };
    unit.active_state = active.into();
    unit.sub_state = sub.into();
}

/// Serve the unit object for `name` (once).
async fn export(
    server: &ObjectServer,
    state: &Shared,
    name: &str,
) -> zbus::Result<OwnedObjectPath> {
    let path = OwnedObjectPath::try_from(unit_path(name))?;
    let unit = UnitObject {
        name: name.to_owned(),
        state: Arc::clone(state),
    };
    server.at(path.as_ref(), unit).await?;
    if name.ends_with(".service") {
        let service = ServiceObject {
            name: name.to_owned(),
            state: Arc::clone(state),
        };
        server.at(path.as_ref(), service).await?;
    }
    Ok(path)
}

#[zbus::interface(name = "org.freedesktop.systemd1.Manager")]
impl Manager {
    async fn load_unit(
        &self,
        #[zbus(header)] header: Header<'_>,
        #[zbus(object_server)] server: &ObjectServer,
        name: String,
    ) -> Result<OwnedObjectPath, SystemdError> {
        self.record(&header, "LoadUnit", &[&name]);
        if !valid_unit_name(&name) {
            return Err(SystemdError::InvalidArgs(format!(
                "Unit name {name} is not valid."
            )));
        }
        {
            let mut state = lock(&self.state);
            if !state.units.contains_key(&name) {
                state.loaded.insert(name.clone());
            }
        }
        Ok(export(server, &self.state, &name).await?)
    }

    async fn get_unit(
        &self,
        #[zbus(header)] header: Header<'_>,
        name: String,
    ) -> Result<OwnedObjectPath, SystemdError> {
        self.record(&header, "GetUnit", &[&name]);
        let state = lock(&self.state);
        if state.units.contains_key(&name) || state.loaded.contains(&name) {
            Ok(OwnedObjectPath::try_from(unit_path(&name)).map_err(zbus::Error::from)?)
        } else {
            Err(SystemdError::NoSuchUnit(format!("Unit {name} not loaded.")))
        }
    }

    async fn start_unit(
        &self,
        #[zbus(header)] header: Header<'_>,
        #[zbus(signal_emitter)] emitter: SignalEmitter<'_>,
        name: String,
        mode: String,
    ) -> Result<OwnedObjectPath, SystemdError> {
        self.record(&header, "StartUnit", &[&name, &mode]);
        self.queue(emitter, Verb::Start, &name, &mode)
    }

    async fn stop_unit(
        &self,
        #[zbus(header)] header: Header<'_>,
        #[zbus(signal_emitter)] emitter: SignalEmitter<'_>,
        name: String,
        mode: String,
    ) -> Result<OwnedObjectPath, SystemdError> {
        self.record(&header, "StopUnit", &[&name, &mode]);
        self.queue(emitter, Verb::Stop, &name, &mode)
    }

    async fn restart_unit(
        &self,
        #[zbus(header)] header: Header<'_>,
        #[zbus(signal_emitter)] emitter: SignalEmitter<'_>,
        name: String,
        mode: String,
    ) -> Result<OwnedObjectPath, SystemdError> {
        self.record(&header, "RestartUnit", &[&name, &mode]);
        self.queue(emitter, Verb::Restart, &name, &mode)
    }

    async fn reload_unit(
        &self,
        #[zbus(header)] header: Header<'_>,
        #[zbus(signal_emitter)] emitter: SignalEmitter<'_>,
        name: String,
        mode: String,
    ) -> Result<OwnedObjectPath, SystemdError> {
        self.record(&header, "ReloadUnit", &[&name, &mode]);
        self.queue(emitter, Verb::Reload, &name, &mode)
    }

    async fn subscribe(&self, #[zbus(header)] header: Header<'_>) -> Result<(), SystemdError> {
        self.record(&header, "Subscribe", &[]);
        let sender = header.sender().map(|s| s.to_string()).unwrap_or_default();
        if lock(&self.state).subscribers.insert(sender) {
            Ok(())
        } else {
            Err(SystemdError::AlreadySubscribed(
                "Client is already subscribed.".into(),
            ))
        }
    }

    async fn unsubscribe(&self, #[zbus(header)] header: Header<'_>) -> Result<(), SystemdError> {
        self.record(&header, "Unsubscribe", &[]);
        let sender = header.sender().map(|s| s.to_string()).unwrap_or_default();
        if lock(&self.state).subscribers.remove(&sender) {
            Ok(())
        } else {
            Err(SystemdError::NotSubscribed(
                "Client is not subscribed.".into(),
            ))
        }
    }

    #[zbus(signal)]
    async fn job_removed(
        emitter: &SignalEmitter<'_>,
        id: u32,
        job: ObjectPath<'_>,
        unit: &str,
        result: &str,
    ) -> zbus::Result<()>;
}

/// `org.freedesktop.systemd1.Unit` of one unit object; reads the shared table.
struct UnitObject {
    name: String,
    state: Shared,
}

fn snapshot(state: &Shared, name: &str) -> FakeUnit {
    lock(state)
        .units
        .get(name)
        .cloned()
        .unwrap_or_else(|| FakeUnit::not_found(name))
}

#[zbus::interface(name = "org.freedesktop.systemd1.Unit")]
impl UnitObject {
    #[zbus(property, name = "Id")]
    fn id(&self) -> String {
        self.name.clone()
    }

    #[zbus(property, name = "Description")]
    fn description(&self) -> String {
        snapshot(&self.state, &self.name).description
    }

    #[zbus(property, name = "LoadState")]
    fn load_state(&self) -> String {
        snapshot(&self.state, &self.name).load_state
    }

    #[zbus(property, name = "ActiveState")]
    fn active_state(&self) -> String {
        snapshot(&self.state, &self.name).active_state
    }

    #[zbus(property, name = "SubState")]
    fn sub_state(&self) -> String {
        snapshot(&self.state, &self.name).sub_state
    }

    #[zbus(property, name = "UnitFileState")]
    fn unit_file_state(&self) -> String {
        snapshot(&self.state, &self.name).unit_file_state
    }

    #[zbus(property, name = "ActiveEnterTimestamp")]
    fn active_enter_timestamp(&self) -> u64 {
        snapshot(&self.state, &self.name).active_enter_timestamp
    }
}

/// `org.freedesktop.systemd1.Service` of a `.service` unit object.
struct ServiceObject {
    name: String,
    state: Shared,
}

#[zbus::interface(name = "org.freedesktop.systemd1.Service")]
impl ServiceObject {
    #[zbus(property, name = "MainPID")]
    fn main_pid(&self) -> u32 {
        snapshot(&self.state, &self.name).main_pid
    }
}

/// systemd on a private bus. Stops serving when dropped.
pub struct FakeSystemd {
    conn: Connection,
    state: Shared,
}

impl FakeSystemd {
    /// Connects to the bus at `address`, serves the Manager and `units`, then takes the
    /// name `org.freedesktop.systemd1`.
    pub async fn serve(address: &str, units: Vec<FakeUnit>) -> FakeSystemd {
        assert!(!units.is_empty(), "a fake systemd needs at least one unit");
        let state: Shared = Arc::new(Mutex::new(State {
            units: units.iter().map(|u| (u.name.clone(), u.clone())).collect(),
            next_pid: 40_000,
            ..State::default()
        }));
        let conn = crate::within(Duration::from_secs(10), "connect the fake systemd", async {
            zbus::connection::Builder::address(address)?
                .serve_at(
                    MANAGER_PATH,
                    Manager {
                        state: Arc::clone(&state),
                    },
                )?
                .build()
                .await
        })
        .await
        .expect("the fake systemd connects to the private bus");
        for unit in &units {
            export(conn.object_server(), &state, &unit.name)
                .await
                .expect("serve a unit object");
        }
        crate::within(
            Duration::from_secs(10),
            "request org.freedesktop.systemd1",
            conn.request_name(SYSTEMD_NAME),
        )
        .await
        .expect("own org.freedesktop.systemd1");
        FakeSystemd { conn, state }
    }

    /// Every Manager call so far, in order.
    pub fn calls(&self) -> Vec<Call> {
        lock(&self.state).calls.clone()
    }

    /// The calls of one method (`RestartUnit`, …).
    pub fn calls_of(&self, method: &str) -> Vec<Call> {
        lock(&self.state)
            .calls
            .iter()
            .filter(|c| c.method == method)
            .cloned()
            .collect()
    }

    /// Whether any call named `unit` (in any argument).
    pub fn saw_unit(&self, unit: &str) -> bool {
        lock(&self.state)
            .calls
            .iter()
            .any(|c| c.args.iter().any(|a| a.contains(unit)))
    }

    /// The unit's current state as the fake holds it.
    pub fn unit(&self, name: &str) -> Option<FakeUnit> {
        lock(&self.state).units.get(name).cloned()
    }

    /// The fake's own unique name on the bus.
    pub fn unique_name(&self) -> String {
        self.conn
            .unique_name()
            .map(|n| n.to_string())
            .unwrap_or_default()
    }
}

impl Drop for FakeSystemd {
    fn drop(&mut self) {
        for job in lock(&self.state).jobs.drain(..) {
            job.abort();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unit_paths_are_escaped_like_systemd() {
        assert_eq!(
            unit_path("nginx.service"),
            "/org/freedesktop/systemd1/unit/nginx_2eservice"
        );
        assert_eq!(
            unit_path("myapp-web.service"),
            "/org/freedesktop/systemd1/unit/myapp_2dweb_2eservice"
        );
        assert_eq!(
            unit_path("getty@tty1.service"),
            "/org/freedesktop/systemd1/unit/getty_40tty1_2eservice"
        );
        assert_eq!(
            unit_path("1x.timer"),
            "/org/freedesktop/systemd1/unit/_31x_2etimer"
        );
    }

    #[test]
    fn jobs_end_in_systemd_states() {
        let mut u = FakeUnit::running("a.service", 7);
        end_state(
            &mut u,
            Verb::Stop,
            "done",
            ("active".into(), "running".into()),
            9,
        );
        assert_eq!(
            (u.active_state.as_str(), u.sub_state.as_str(), u.main_pid),
            ("inactive", "dead", 0)
        );
        end_state(
            &mut u,
            Verb::Start,
            "done",
            ("inactive".into(), "dead".into()),
            9,
        );
        assert_eq!((u.active_state.as_str(), u.main_pid), ("active", 9));
        end_state(
            &mut u,
            Verb::Restart,
            "failed",
            ("active".into(), "running".into()),
            10,
        );
        assert_eq!(
            (u.active_state.as_str(), u.sub_state.as_str(), u.main_pid),
            ("failed", "failed", 0)
        );
        end_state(
            &mut u,
            Verb::Start,
            "canceled",
            ("failed".into(), "failed".into()),
            11,
        );
        assert_eq!(u.active_state, "failed");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_fake_answers_over_a_real_bus() {
        let dir = tempfile::tempdir().expect("tempdir");
        let bus = PrivateBus::start(dir.path());
        let fake =
            FakeSystemd::serve(bus.address(), vec![FakeUnit::running("nginx.service", 42)]).await;
        let client = zbus::connection::Builder::address(bus.address())
            .expect("address")
            .build()
            .await
            .expect("client connects");
        let reply = client
            .call_method(
                Some(SYSTEMD_NAME),
                MANAGER_PATH,
                Some("org.freedesktop.systemd1.Manager"),
                "LoadUnit",
                &("nginx.service",),
            )
            .await
            .expect("LoadUnit");
        let path: OwnedObjectPath = reply.body().deserialize().expect("an object path");
        assert_eq!(
            path.as_str(),
            "/org/freedesktop/systemd1/unit/nginx_2eservice"
        );
        let reply = client
            .call_method(
                Some(SYSTEMD_NAME),
                path.as_str(),
                Some("org.freedesktop.DBus.Properties"),
                "Get",
                &("org.freedesktop.systemd1.Service", "MainPID"),
            )
            .await
            .expect("Get MainPID");
        let pid: zbus::zvariant::OwnedValue = reply.body().deserialize().expect("a variant");
        assert_eq!(u32::try_from(&*pid).expect("u32"), 42);
        let err = client
            .call_method(
                Some(SYSTEMD_NAME),
                MANAGER_PATH,
                Some("org.freedesktop.systemd1.Manager"),
                "StartUnit",
                &("nope.service", "replace"),
            )
            .await
            .expect_err("an unknown unit cannot be started");
        match err {
            zbus::Error::MethodError(name, _, _) => {
                assert_eq!(name.as_str(), "org.freedesktop.systemd1.NoSuchUnit")
            }
            other => panic!("expected a D-Bus error reply, got {other}"),
        }
        let calls = fake.calls();
        assert_eq!(calls.len(), 2, "{calls:?}");
        assert_eq!(calls[0].args, ["nginx.service"]);
        assert_eq!(calls[1].method, "StartUnit");
        assert!(!fake.unique_name().is_empty());
    }
}
