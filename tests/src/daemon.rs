//! One `robota-mcpd` process in a private temp directory, plus `robota-mcpctl` runs
//! against its control socket.

use std::fs::{self, File};
use std::io::Read;
use std::net::SocketAddr;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use robota_proto::Status;
use tempfile::TempDir;

use crate::cgroup::{Cgroup, Hierarchies};
use crate::notify::NotifyListener;
use crate::secrets;

/// How long the daemon may take to announce `READY=1`.
pub const READY_LIMIT: Duration = Duration::from_secs(20);
/// How long one `robota-mcpctl` run may take.
pub const CTL_LIMIT: Duration = Duration::from_secs(20);

/// Placeholder replaced by the daemon's temp directory in config text.
pub const DIR: &str = "@DIR@";

/// Output of a bounded child run (`robota-mcpctl`, `robota-mcpd check-config`).
#[derive(Debug)]
pub struct CtlOutput {
    pub status: ExitStatus,
    pub stdout: String,
    pub stderr: String,
}

impl CtlOutput {
    pub fn code(&self) -> Option<i32> {
        self.status.code()
    }

    /// Panics (with both streams) unless the exit code is `code`.
    pub fn expect_code(&self, code: i32, what: &str) -> &Self {
        assert_eq!(
            self.code(),
            Some(code),
            "{what}: expected exit code {code}, got {:?}\nstdout: {}\nstderr: {}",
            self.status,
            self.stdout,
            self.stderr
        );
        self
    }
}

/// Runs `cmd` with stdin closed, capturing stdout and stderr, for at most `limit`.
pub fn run_bounded(mut cmd: Command, limit: Duration) -> CtlOutput {
    let desc = format!("{cmd:?}");
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("spawn {desc}: {e}"));
    let reader = |mut pipe: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut buf = Vec::new();
            let _ = pipe.read_to_end(&mut buf);
            String::from_utf8_lossy(&buf).into_owned()
        })
    };
    let out = reader(Box::new(child.stdout.take().expect("stdout")));
    let err = reader(Box::new(child.stderr.take().expect("stderr")));
    let deadline = Instant::now() + limit;
    let status = loop {
        if let Some(st) = child.try_wait().expect("try_wait") {
            break st;
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "{desc} did not finish within {limit:?}; stdout: {:?}; stderr: {:?}",
                out.join().unwrap_or_default(),
                err.join().unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    CtlOutput {
        status,
        stdout: out.join().unwrap_or_default(),
        stderr: err.join().unwrap_or_default(),
    }
}

/// `robota-mcpd check-config --config <path>`.
pub fn check_config(path: &Path) -> CtlOutput {
    check_config_with(path, &[])
}

/// `robota-mcpd check-config --config <path> <args…>`.
pub fn check_config_with(path: &Path, args: &[&str]) -> CtlOutput {
    let mut cmd = Command::new(crate::mcpd_bin());
    cmd.arg("check-config")
        .arg("--config")
        .arg(path)
        .args(args)
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default());
    run_bounded(cmd, CTL_LIMIT)
}

/// Builds a daemon's config. Text may use [`DIR`] for the daemon's temp directory.
#[derive(Debug, Clone)]
pub struct DaemonBuilder {
    loopback_listen: String,
    metrics_listen: String,
    loopback_lines: Vec<String>,
    extra: String,
    env: Vec<(String, String)>,
    watchdog_usec: Option<u64>,
    state_dir: Option<PathBuf>,
    inherited: Option<PathBuf>,
}

impl Default for DaemonBuilder {
    fn default() -> Self {
        DaemonBuilder {
            loopback_listen: "127.0.0.1:0".into(),
            metrics_listen: "127.0.0.1:0".into(),
            loopback_lines: Vec::new(),
            extra: String::new(),
            env: Vec::new(),
            watchdog_usec: None,
            state_dir: None,
            inherited: None,
        }
    }
}

impl DaemonBuilder {
    pub fn loopback_listen(mut self, addr: impl Into<String>) -> Self {
        self.loopback_listen = addr.into();
        self
    }

    pub fn metrics_listen(mut self, addr: impl Into<String>) -> Self {
        self.metrics_listen = addr.into();
        self
    }

    /// One more `key = value` line in the `[loopback]` table.
    pub fn loopback(mut self, line: impl Into<String>) -> Self {
        self.loopback_lines.push(line.into());
        self
    }

    /// More TOML after the harness's tables (`[control]`, `[session]`, `[limits]`, …).
    pub fn extra(mut self, text: impl AsRef<str>) -> Self {
        self.extra.push('\n');
        self.extra.push_str(text.as_ref());
        self.extra.push('\n');
        self
    }

    /// One more environment variable for the daemon (besides PATH and NOTIFY_SOCKET).
    pub fn env(mut self, key: &str, value: &str) -> Self {
        self.env.push((key.into(), value.into()));
        self
    }

    /// Run as systemd does with `WatchdogSec=`: `WATCHDOG_USEC` and `WATCHDOG_PID` (the
    /// daemon's own pid, set by exec-ing through a shell).
    pub fn watchdog_usec(mut self, usec: u64) -> Self {
        self.watchdog_usec = Some(usec);
        self
    }

    /// Start the daemon with `path` open on descriptor 9 and not close-on-exec, as a
    /// careless supervisor or shell would hand it over.
    pub fn inherit_open(mut self, path: &Path) -> Self {
        self.inherited = Some(path.to_path_buf());
        self
    }

    /// Use `path` as the state directory (created 0700 if missing) instead of one inside
    /// the daemon's temp directory, so that a later daemon can run on the same state.
    pub fn state_dir(mut self, path: &Path) -> Self {
        self.state_dir = Some(path.to_path_buf());
        self
    }

    /// The state directory of a daemon living in `dir`.
    fn state_path(&self, dir: &Path) -> PathBuf {
        self.state_dir.clone().unwrap_or_else(|| dir.join("state"))
    }

    /// The config text for a daemon living in `dir`.
    pub fn config_text(&self, dir: &Path) -> String {
        let d = dir.display().to_string();
        let state = self.state_path(dir).display().to_string();
        let mut text = format!(
            "[daemon]\nstate_dir = \"{state}\"\nruntime_dir = \"{d}/run\"\n\n[loopback]\nlisten = \"{}\"\n",
            self.loopback_listen
        );
        for line in &self.loopback_lines {
            text.push_str(line);
            text.push('\n');
        }
        text.push_str(&format!(
            "\n[metrics]\nlisten = \"{}\"\n",
            self.metrics_listen
        ));
        text.push_str(&self.extra);
        text.replace(DIR, &d)
    }

    /// Spawns the daemon without waiting for readiness.
    pub fn spawn(self) -> Daemon {
        let dir = tempfile::Builder::new()
            .prefix("mcpd-e2e-")
            .tempdir()
            .expect("tempdir");
        fs::set_permissions(dir.path(), fs::Permissions::from_mode(0o755)).expect("chmod tempdir");
        let state = self.state_path(dir.path());
        let run = dir.path().join("run");
        if !state.is_dir() {
            fs::create_dir_all(&state).expect("mkdir state");
            fs::set_permissions(&state, fs::Permissions::from_mode(0o700)).expect("chmod state");
        }
        fs::create_dir(&run).expect("mkdir run");
        fs::set_permissions(&run, fs::Permissions::from_mode(0o755)).expect("chmod run");

        let config_path = dir.path().join("config.toml");
        fs::write(&config_path, self.config_text(dir.path())).expect("write config");
        let notify = NotifyListener::bind(&dir.path().join("notify.sock"));
        let stdout = File::create(dir.path().join("daemon.stdout")).expect("stdout file");
        let stderr = File::create(dir.path().join("daemon.stderr")).expect("stderr file");

        let mut env = self.env.clone();
        // A cgroup of its own, as the packaged unit's Delegate=yes gives it: the daemon keeps
        // its upstreams' process trees there.
        static SEQ: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let cgroup = Cgroup::create(
            &format!(
                "robota-daemon-{}-{}",
                std::process::id(),
                SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            ),
            Hierarchies::Daemon,
        );
        // Through a shell, which joins that cgroup, then becomes the daemon (same pid) as
        // systemd would start it: with `WatchdogSec=` (`WATCHDOG_PID` is the daemon's own
        // pid), with a descriptor left open.
        let mut script = String::from(
            r#"while [ "$1" != -- ]; do echo 0 > "$1" || exit 1; shift; done; shift; "#,
        );
        if let Some(usec) = self.watchdog_usec {
            script.push_str("WATCHDOG_PID=$$ ");
            env.push(("WATCHDOG_USEC".into(), usec.to_string()));
        }
        script.push_str("exec ");
        if let Some(path) = &self.inherited {
            env.push(("ROBOTA_E2E_INHERITED".into(), path.display().to_string()));
            script.push_str("9<\"$ROBOTA_E2E_INHERITED\" ");
        }
        script.push_str("\"$@\"");
        let mut cmd = Command::new("/bin/sh");
        cmd.arg("-c")
            .arg(script)
            .arg("sh")
            .args(cgroup.procs_files())
            .arg("--")
            .arg(crate::mcpd_bin());
        let child = cmd
            .arg("--config")
            .arg(&config_path)
            .env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .env("NOTIFY_SOCKET", notify.path())
            .envs(env.iter().map(|(k, v)| (k, v)))
            .current_dir(dir.path())
            .stdin(Stdio::null())
            .stdout(stdout)
            .stderr(stderr)
            .spawn()
            .expect("spawn robota-mcpd");
        let pid = child.id() as i32;
        let cmdline = fs::read(format!("/proc/{pid}/cmdline"))
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .unwrap_or_default();
        Daemon {
            cgroup,
            socket: run.join("control.sock"),
            state_dir: state,
            dir,
            child: Mutex::new(child),
            exit: Mutex::new(None),
            pid,
            notify,
            config_path,
            cmdline,
            loopback: Mutex::new(None),
            metrics: Mutex::new(None),
            secrets: Mutex::new(Vec::new()),
            ctl_log: Mutex::new(String::new()),
        }
    }

    /// Spawns the daemon, waits for `READY=1` and reads its addresses from `status`.
    pub fn start(self) -> Daemon {
        let d = self.spawn();
        d.wait_ready(0);
        d.refresh_addrs();
        d
    }
}

pub struct Daemon {
    /// Its unit's cgroup, killed and removed when dropped — after the daemon has exited
    /// (its fields go after [`Drop::drop`]).
    cgroup: Cgroup,
    dir: TempDir,
    child: Mutex<Child>,
    exit: Mutex<Option<ExitStatus>>,
    pid: i32,
    notify: NotifyListener,
    config_path: PathBuf,
    socket: PathBuf,
    state_dir: PathBuf,
    cmdline: String,
    loopback: Mutex<Option<SocketAddr>>,
    metrics: Mutex<Option<SocketAddr>>,
    secrets: Mutex<Vec<String>>,
    ctl_log: Mutex<String>,
}

impl Daemon {
    pub fn builder() -> DaemonBuilder {
        DaemonBuilder::default()
    }

    /// A ready daemon with the harness config plus `extra` TOML.
    pub fn start(extra: &str) -> Daemon {
        Daemon::builder().extra(extra).start()
    }

    pub fn pid(&self) -> i32 {
        self.pid
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The cgroup it was started in, as its unit's.
    pub fn cgroup(&self) -> &Cgroup {
        &self.cgroup
    }

    pub fn config_path(&self) -> &Path {
        &self.config_path
    }

    pub fn socket_path(&self) -> &Path {
        &self.socket
    }

    pub fn runtime_dir(&self) -> PathBuf {
        self.dir().join("run")
    }

    /// The state directory (inside [`Daemon::dir`] unless the builder named one).
    pub fn state_dir(&self) -> &Path {
        &self.state_dir
    }

    pub fn notify(&self) -> &NotifyListener {
        &self.notify
    }

    pub fn stderr_text(&self) -> String {
        fs::read_to_string(self.dir().join("daemon.stderr")).unwrap_or_default()
    }

    pub fn stdout_text(&self) -> String {
        fs::read_to_string(self.dir().join("daemon.stdout")).unwrap_or_default()
    }

    /// The exit status, if the process has exited.
    pub fn try_exit(&self) -> Option<ExitStatus> {
        let mut exit = self.exit.lock().unwrap_or_else(|e| e.into_inner());
        if exit.is_none() {
            let mut child = self.child.lock().unwrap_or_else(|e| e.into_inner());
            *exit = child.try_wait().ok().flatten();
        }
        *exit
    }

    /// Waits (bounded) for the process to exit.
    pub fn wait_exit(&self, limit: Duration) -> Option<ExitStatus> {
        let mut st = None;
        crate::poll_until_blocking(limit, Duration::from_millis(20), || {
            st = self.try_exit();
            st.is_some()
        });
        st
    }

    pub fn signal(&self, sig: Signal) {
        if self.try_exit().is_none() {
            let _ = kill(Pid::from_raw(self.pid), sig);
        }
    }

    /// Waits (bounded) for a `READY=1` at notify index `>= from`; returns its index.
    /// Panics with the daemon's stderr if it exits first or never gets ready.
    pub fn wait_ready(&self, from: usize) -> usize {
        match self
            .notify
            .wait_for("READY=1", from, READY_LIMIT, || self.try_exit().is_some())
        {
            Some(i) => i,
            None => panic!(
                "robota-mcpd sent no READY=1 (exit: {:?}); notify lines: {:?}\nstderr:\n{}",
                self.try_exit(),
                self.notify.lines(),
                self.stderr_text()
            ),
        }
    }

    /// Re-reads the loopback and metrics addresses from `status`.
    pub fn refresh_addrs(&self) -> Status {
        let st = self.status();
        let find = |name: &str| -> SocketAddr {
            let c = st
                .carriers
                .iter()
                .find(|c| c.name == name)
                .unwrap_or_else(|| panic!("status lists no {name} carrier: {st:?}"));
            c.address
                .parse()
                .unwrap_or_else(|e| panic!("{name} address {:?}: {e}", c.address))
        };
        *self.loopback.lock().expect("lock") = Some(find("loopback"));
        *self.metrics.lock().expect("lock") = Some(find("metrics"));
        st
    }

    /// The bound address of carrier `name` as `status` lists it, if it is listed.
    pub fn carrier_addr(&self, name: &str) -> Option<SocketAddr> {
        let st = self.status();
        let c = st.carriers.iter().find(|c| c.name == name)?;
        Some(
            c.address
                .parse()
                .unwrap_or_else(|e| panic!("{name} address {:?}: {e}", c.address)),
        )
    }

    /// The remote carrier's bound address; panics when `status` lists none.
    pub fn remote_addr(&self) -> SocketAddr {
        self.carrier_addr("remote").unwrap_or_else(|| {
            panic!(
                "status lists no remote carrier: {:?}",
                self.status().carriers
            )
        })
    }

    pub fn loopback_addr(&self) -> SocketAddr {
        self.loopback
            .lock()
            .expect("lock")
            .expect("loopback address unknown: daemon not started with start()")
    }

    pub fn loopback_port(&self) -> u16 {
        self.loopback_addr().port()
    }

    pub fn metrics_addr(&self) -> SocketAddr {
        self.metrics
            .lock()
            .expect("lock")
            .expect("metrics address unknown: daemon not started with start()")
    }

    /// `GET /metrics` on the metrics listener (blocking, bounded), if it answers.
    pub fn metrics_text(&self) -> Option<String> {
        use std::io::Write;
        let addr = (*self.metrics.lock().expect("lock"))?;
        let mut s = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(2)).ok()?;
        s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
        s.set_write_timeout(Some(Duration::from_secs(5))).ok()?;
        write!(
            s,
            "GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
        )
        .ok()?;
        let mut buf = Vec::new();
        let _ = s.read_to_end(&mut buf);
        Some(String::from_utf8_lossy(&buf).into_owned())
    }

    fn ctl_command(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new(crate::mcpctl_bin());
        cmd.arg("--socket")
            .arg(&self.socket)
            .args(args)
            .env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .current_dir(self.dir());
        cmd
    }

    fn log_ctl(&self, args: &[&str], out: &CtlOutput) {
        // A bearer is printed on stdout by design for these commands; everything else
        // must never show one.
        let prints_secret = matches!(args, ["bearer", "issue", ..] | ["bearer", "rotate", ..])
            && !args.contains(&"--output");
        let mut log = self.ctl_log.lock().expect("lock");
        log.push_str(&format!("$ robota-mcpctl {}\n", args.join(" ")));
        if !prints_secret {
            log.push_str(&out.stdout);
        }
        log.push_str(&out.stderr);
    }

    /// Runs `robota-mcpctl --socket <sock> <args>` (bounded).
    pub fn ctl(&self, args: &[&str]) -> CtlOutput {
        let out = run_bounded(self.ctl_command(args), crate::daemon::CTL_LIMIT);
        self.log_ctl(args, &out);
        out
    }

    /// Like [`Daemon::ctl`], as another uid/gid (tests run as root).
    pub fn ctl_as(&self, uid: u32, gid: u32, args: &[&str]) -> CtlOutput {
        let mut cmd = self.ctl_command(args);
        cmd.uid(uid).gid(gid);
        cmd.current_dir("/");
        let out = run_bounded(cmd, CTL_LIMIT);
        self.log_ctl(args, &out);
        out
    }

    /// Runs ctl and panics unless it exits 0.
    pub fn ctl_ok(&self, args: &[&str]) -> CtlOutput {
        let out = self.ctl(args);
        out.expect_code(0, &format!("robota-mcpctl {}", args.join(" ")));
        out
    }

    pub fn status(&self) -> Status {
        let out = self.ctl_ok(&["--json", "status"]);
        serde_json::from_str(&out.stdout).unwrap_or_else(|e| {
            panic!(
                "`robota-mcpctl --json status` printed no Status JSON ({e}): {:?}",
                out.stdout
            )
        })
    }

    pub fn register_secret(&self, s: &str) {
        self.secrets.lock().expect("lock").push(s.to_owned());
    }

    pub fn secrets(&self) -> Vec<String> {
        self.secrets.lock().expect("lock").clone()
    }

    fn take_bearer(&self, args: &[&str]) -> String {
        let out = self.ctl_ok(args);
        let secret = out
            .stdout
            .strip_suffix('\n')
            .filter(|s| secrets::is_bearer_text(s))
            .unwrap_or_else(|| {
                panic!(
                    "`robota-mcpctl {}` must print exactly 64 lowercase hex characters and a newline, got {} bytes",
                    args.join(" "),
                    out.stdout.len()
                )
            })
            .to_owned();
        self.register_secret(&secret);
        secret
    }

    /// The host bearer (`bearer issue`).
    pub fn bearer(&self) -> String {
        self.take_bearer(&["bearer", "issue"])
    }

    /// A new extra bearer with `label`.
    pub fn bearer_labeled(&self, label: &str) -> String {
        self.take_bearer(&["bearer", "issue", "--label", label])
    }

    /// An extra bearer with a lifetime (`--ttl`): kept across reloads and restarts.
    pub fn bearer_with_ttl(&self, label: &str, ttl: &str) -> String {
        self.take_bearer(&["bearer", "issue", "--label", label, "--ttl", ttl])
    }

    /// Scans every output the harness captured, the daemon's command line, its notify
    /// messages, its metrics and the readable files under its directories (audit file,
    /// store, key cache) for any registered secret. Every daemon is also scanned when it
    /// is dropped, so a test that forgets to call this is still covered.
    pub fn assert_no_secrets(&self) {
        let secrets = self.secrets();
        assert!(
            !secrets.is_empty(),
            "no secret registered: nothing to scan for"
        );
        self.scan(&secrets, self.metrics_text());
    }

    fn scan(&self, secrets: &[String], metrics: Option<String>) {
        if let Some(metrics) = metrics {
            secrets::assert_no_secrets(secrets, &metrics, "metrics exposition");
        }
        let secrets = secrets.to_vec();
        secrets::assert_no_secrets(&secrets, &self.stderr_text(), "daemon stderr");
        secrets::assert_no_secrets(&secrets, &self.stdout_text(), "daemon stdout");
        secrets::assert_no_secrets(
            &secrets,
            &self.ctl_log.lock().expect("lock"),
            "robota-mcpctl stderr/non-secret stdout",
        );
        secrets::assert_no_secrets(&secrets, &self.cmdline, "daemon cmdline at start");
        if let Ok(b) = fs::read(format!("/proc/{}/cmdline", self.pid)) {
            secrets::assert_no_secrets(&secrets, &String::from_utf8_lossy(&b), "daemon cmdline");
        }
        secrets::assert_no_secrets(
            &secrets,
            &self.notify.lines().join("\n"),
            "sd-notify messages",
        );
        secrets::assert_no_secrets_in_readable_files(&secrets, &self.state_dir);
        secrets::assert_no_secrets_in_readable_files(&secrets, &self.dir().join("run"));
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        // The suite-wide secret scan: every daemon a test ran, whatever the test checked.
        let secrets = self.secrets();
        let scan = !std::thread::panicking() && !secrets.is_empty();
        let metrics = if scan && self.try_exit().is_none() {
            self.metrics_text()
        } else {
            None
        };
        if self.try_exit().is_none() {
            let _ = kill(Pid::from_raw(self.pid), Signal::SIGTERM);
            if self.wait_exit(Duration::from_secs(10)).is_none() {
                let mut child = self.child.lock().unwrap_or_else(|e| e.into_inner());
                let _ = child.kill();
                let _ = child.wait();
            }
        }
        if scan {
            // After the stop: the last log lines and files are written.
            self.scan(&secrets, metrics);
        }
    }
}
