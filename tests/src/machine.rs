//! A Debian 12 host booted with systemd as PID 1, for the tests of the package under the
//! real systemd: `systemd-nspawn --boot` on a fresh copy of an image made once with
//! `debootstrap` (`tests/setup.sh image`, kept under `target/systemd-image/`).
//!
//! The copy is an overlay mount (the image read-only below, a private upper directory
//! above), so every [`Machine`] starts from the same clean root in milliseconds and leaves
//! the image untouched. Each machine has a private network namespace holding only its
//! own loopback, so the package's default ports never meet another test's, and its own
//! cgroup in every process-tracking hierarchy: with `--keep-unit` systemd-nspawn runs the
//! machine in the cgroup it was started in, and machines sharing one would share
//! `system.slice/robota-mcpd.service` — one machine's `systemctl stop` would kill the
//! other's daemon. Commands run inside with `nsenter` into every namespace of the
//! machine's PID 1, with a clean environment. Every wait is bounded; dropping a machine
//! powers it off (then kills what is left in its cgroup), unmounts the copy and removes it.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use crate::cgroup::{Cgroup, Hierarchies};
use crate::daemon::{CtlOutput, run_bounded};
use crate::poll_until_blocking;

/// Booting: from `systemd-nspawn` to `systemctl is-system-running` saying it is up.
const BOOT_LIMIT: Duration = Duration::from_secs(90);
/// One command inside, unless the caller gives its own bound.
const COMMAND_LIMIT: Duration = Duration::from_secs(120);
/// Power-off before the machine is killed.
const POWEROFF_LIMIT: Duration = Duration::from_secs(20);

/// The environment every command inside gets, and nothing else.
const ENV: &[&str] = &[
    "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME=/root",
    "LANG=C.UTF-8",
    "SYSTEMD_PAGER=",
    "SYSTEMD_COLORS=0",
    "DEBIAN_FRONTEND=noninteractive",
];

/// A booted machine; powered off and removed on drop.
pub struct Machine {
    name: String,
    /// Holds `upper/`, `work/`, `root/` (the overlay's mount point) and `console.log`.
    dir: tempfile::TempDir,
    nspawn: Option<Child>,
    /// The machine's PID 1, as this host numbers it.
    leader: i32,
    mounted: bool,
    cgroup: Cgroup,
}

impl Machine {
    /// Boots a fresh copy of the image; panics, with the console's last lines, when it
    /// does not come up within the bound.
    pub fn boot() -> Machine {
        assert!(
            nix::unistd::geteuid().is_root(),
            "booting a machine with systemd-nspawn needs root (tests/run runs as root)"
        );
        let image_dir = PathBuf::from(crate::setup::ensure("image-dir"));
        if !image_dir.join("ready").is_file() {
            crate::setup::ensure("image");
        }
        let image = image_dir.join("root");
        static SEQ: AtomicU32 = AtomicU32::new(0);
        let name = format!(
            "robota-{}-{}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        );
        let dir = tempfile::Builder::new()
            .prefix("robota-machine-")
            .tempdir()
            .expect("tempdir");
        for sub in ["upper", "work", "root"] {
            fs::create_dir(dir.path().join(sub)).expect("mkdir");
        }
        let root = dir.path().join("root");
        let mut mount = Command::new("mount");
        mount.args(["-t", "overlay", "overlay", "-o"]).arg(format!(
            "lowerdir={},upperdir={},workdir={}",
            image.display(),
            dir.path().join("upper").display(),
            dir.path().join("work").display()
        ));
        mount.arg(&root);
        run_bounded(mount, COMMAND_LIMIT).expect_code(0, "mount the machine's overlay");
        // The overlay's root is the upper directory's: the machine's / must be 0755.
        fs::set_permissions(&root, fs::Permissions::from_mode(0o755)).expect("chmod root");
        let cgroup = Cgroup::create(&format!("robota-machine-{name}"), Hierarchies::Tracking);
        let mut machine = Machine {
            name,
            dir,
            nspawn: None,
            leader: 0,
            mounted: true,
            cgroup,
        };
        let console = fs::File::create(machine.dir.path().join("console.log")).expect("log");
        // The shell joins the machine's cgroups, then becomes systemd-nspawn (same pid).
        let child = Command::new("/bin/sh")
            .arg("-c")
            .arg(r#"while [ "$1" != -- ]; do echo $$ > "$1" || exit 1; shift; done; shift; exec "$@""#)
            .arg("sh")
            .args(machine.cgroup.procs_files())
            .args(["--", "systemd-nspawn"])
            .arg("--quiet")
            .arg(format!("--directory={}", root.display()))
            .arg(format!("--machine={}", machine.name))
            .args([
                "--boot",
                "--register=no",
                "--keep-unit",
                "--private-network",
                "--console=pipe",
                "--link-journal=no",
                "--timezone=off",
                "--resolv-conf=off",
                // systemd-nspawn's own system-call filter (252) lacks Landlock, which a
                // host's systemd offers services: the machine gets it as a host would.
                "--system-call-filter=landlock_create_ruleset landlock_add_rule landlock_restrict_self",
            ])
            .stdin(Stdio::null())
            .stdout(console.try_clone().expect("log"))
            .stderr(console)
            .spawn()
            .expect("spawn systemd-nspawn (Debian's systemd-container)");
        let nspawn = child.id() as i32;
        machine.nspawn = Some(child);
        let found = poll_until_blocking(BOOT_LIMIT, Duration::from_millis(50), || {
            match init_of(nspawn) {
                Some(pid) => {
                    machine.leader = pid;
                    true
                }
                None => false,
            }
        });
        assert!(
            found,
            "systemd-nspawn started no init within {BOOT_LIMIT:?}:\n{}",
            machine.console()
        );
        let placed =
            fs::read_to_string(format!("/proc/{}/cgroup", machine.leader)).unwrap_or_default();
        assert!(
            placed.contains(&format!("/robota-machine-{}/", machine.name)),
            "the machine's init runs outside the machine's own cgroup:\n{placed}"
        );
        let deadline = Instant::now() + BOOT_LIMIT;
        loop {
            let state = machine.run(
                &["systemctl", "is-system-running", "--wait"],
                deadline.saturating_duration_since(Instant::now()),
            );
            match state.stdout.trim() {
                "running" => break,
                "degraded" => panic!(
                    "the machine booted degraded:\n{}",
                    machine.sh("systemctl --failed --no-legend").stdout
                ),
                // The bus is not up yet, or the manager is still starting.
                _ if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(100)),
                other => panic!(
                    "the machine did not finish booting within {BOOT_LIMIT:?} (state {other:?}):\n{}",
                    machine.console()
                ),
            }
        }
        machine
    }

    /// The machine's root as this host sees it: files written here are the machine's.
    pub fn root(&self) -> PathBuf {
        self.dir.path().join("root")
    }

    /// The machine's name (its host name inside).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The machine's PID 1, as this host numbers it (for `nsenter -t`).
    pub fn leader(&self) -> i32 {
        self.leader
    }

    /// What systemd-nspawn and the machine's console printed.
    pub fn console(&self) -> String {
        fs::read_to_string(self.dir.path().join("console.log")).unwrap_or_default()
    }

    /// `argv` inside the machine (every namespace of its PID 1, its root and a clean
    /// environment), bounded by `limit`.
    pub fn run(&self, argv: &[&str], limit: Duration) -> CtlOutput {
        let mut cmd = Command::new("nsenter");
        cmd.arg("--target")
            .arg(self.leader.to_string())
            .args(["--all", "--root", "--wd", "--", "/usr/bin/env", "-i"])
            .args(ENV)
            .args(argv);
        cmd.env_clear();
        run_bounded(cmd, limit)
    }

    /// `sh -c script` inside the machine, bounded.
    pub fn sh(&self, script: &str) -> CtlOutput {
        self.run(&["/bin/sh", "-c", script], COMMAND_LIMIT)
    }

    /// `sh -c script` inside the machine; panics unless it exits 0; its stdout.
    pub fn ok(&self, script: &str) -> String {
        let out = self.sh(script);
        out.expect_code(0, &format!("in the machine: {script}"));
        out.stdout
    }

    /// `argv` on this host's file system but in the machine's network namespace: a host
    /// client (curl, prometheus, a test program) reaching the machine's loopback.
    pub fn on_its_network(&self, argv: &[&str]) -> Command {
        let mut cmd = Command::new("nsenter");
        cmd.arg("--target")
            .arg(self.leader.to_string())
            .args(["--net", "--"])
            .args(argv);
        cmd
    }

    /// Writes `contents` at `path` inside the machine (created with its parents), `mode`.
    pub fn write(&self, path: &str, contents: &[u8], mode: u32) {
        let at = self.root().join(path.trim_start_matches('/'));
        if let Some(parent) = at.parent() {
            fs::create_dir_all(parent).expect("mkdir in the machine");
        }
        fs::write(&at, contents).unwrap_or_else(|e| panic!("write {path} in the machine: {e}"));
        fs::set_permissions(&at, fs::Permissions::from_mode(mode)).expect("chmod");
    }

    /// Reads `path` inside the machine, if it is there.
    pub fn read(&self, path: &str) -> Option<String> {
        fs::read_to_string(self.root().join(path.trim_start_matches('/'))).ok()
    }

    /// Installs the package with apt, as an operator does (`apt-get install ./….deb`);
    /// returns apt's output.
    pub fn install(&self, deb: &Path) -> CtlOutput {
        let name = deb.file_name().expect("a .deb file name").to_string_lossy();
        let inside = format!("/root/{name}");
        fs::copy(deb, self.root().join(inside.trim_start_matches('/'))).expect("copy the .deb");
        self.run(
            &[
                "apt-get",
                "install",
                "-y",
                "--no-install-recommends",
                &inside,
            ],
            COMMAND_LIMIT,
        )
    }

    /// `systemctl show -p PROPERTY --value UNIT`.
    pub fn property(&self, unit: &str, property: &str) -> String {
        self.ok(&format!("systemctl show -p {property} --value {unit}"))
            .trim()
            .to_owned()
    }

    /// The journal of `unit` as JSON records (`journalctl -o json`), oldest first.
    pub fn journal(&self, unit: &str) -> Vec<serde_json::Value> {
        self.ok(&format!("journalctl --no-pager -o json -u {unit}"))
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("journal line {l}: {e}")))
            .collect()
    }

    fn poweroff(&mut self) {
        let Some(mut child) = self.nspawn.take() else {
            return;
        };
        // SIGTERM asks systemd-nspawn for an orderly power-off of the machine.
        let _ = kill(Pid::from_raw(child.id() as i32), Signal::SIGTERM);
        let gone = poll_until_blocking(POWEROFF_LIMIT, Duration::from_millis(50), || {
            matches!(child.try_wait(), Ok(Some(_)))
        });
        if !gone {
            // Killing PID 1 ends every process of its namespace.
            if self.leader > 0 {
                let _ = kill(Pid::from_raw(self.leader), Signal::SIGKILL);
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for Machine {
    fn drop(&mut self) {
        self.poweroff();
        self.cgroup.remove();
        if self.mounted {
            let root = self.root();
            let unmounted =
                poll_until_blocking(Duration::from_secs(10), Duration::from_millis(100), || {
                    Command::new("umount")
                        .arg(&root)
                        .stderr(Stdio::null())
                        .status()
                        .is_ok_and(|s| s.success())
                });
            if !unmounted {
                // Still busy: detach it, so the directory can go.
                let _ = Command::new("umount").arg("--lazy").arg(&root).status();
            }
            self.mounted = false;
        }
    }
}

/// The process systemd-nspawn started as the machine's init: its child running systemd.
fn init_of(nspawn: i32) -> Option<i32> {
    fs::read_dir("/proc").ok()?.flatten().find_map(|entry| {
        let pid: i32 = entry.file_name().to_str()?.parse().ok()?;
        let stat = fs::read_to_string(entry.path().join("stat")).ok()?;
        // pid (comm) state ppid …; comm may hold spaces and parentheses.
        let (comm, rest) = stat.split_once(" (")?.1.rsplit_once(") ")?;
        let ppid: i32 = rest.split(' ').nth(1)?.parse().ok()?;
        (ppid == nspawn && comm == "systemd").then_some(pid)
    })
}

/// The package to test: `$ROBOTA_DEB`, else the newest `target/debian/robota-mcpd_*.deb`
/// (`packaging/build-deb.sh` makes it; `tests/run` builds it before these tests).
pub fn package() -> PathBuf {
    if let Some(path) = std::env::var_os("ROBOTA_DEB") {
        let path = PathBuf::from(path);
        assert!(
            path.is_file(),
            "ROBOTA_DEB={} is not a file",
            path.display()
        );
        return path;
    }
    let dir = crate::setup::target_dir().join("debian");
    fs::read_dir(&dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("robota-mcpd_") && n.ends_with(".deb"))
        })
        .max_by_key(|p| fs::metadata(p).and_then(|m| m.modified()).ok())
        .unwrap_or_else(|| {
            panic!(
                "no robota-mcpd .deb in {}: build it with packaging/build-deb.sh (tests/run does)",
                dir.display()
            )
        })
}
