//! A start on a state directory the daemon's user cannot use — missing where that user
//! cannot create it, someone else's, holding the files a run as root left — fails (exit 1)
//! naming the cause and the fix, not with a bare `Permission denied` on `audit.jsonl`;
//! once the fix is applied the same start serves. The daemon runs as uid 65534, as the
//! package's system user would be; setting that up needs root (CI runs as root). The
//! maintainer scripts that prevent all this are checked by `packaging/check-deb.sh`.

use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use nix::sys::signal::{Signal, kill};
use nix::unistd::{Gid, Pid, Uid, chown};
use robota_e2e::daemon::run_bounded;
use robota_e2e::{Daemon, poll_until_blocking};

const NOBODY: u32 = 65534;
const LIMIT: Duration = Duration::from_secs(20);

/// A private directory (0755, so that uid 65534 reaches its configuration) with a
/// configuration whose state directory is `state` and whose runtime directory is 65534's.
struct Place {
    dir: tempfile::TempDir,
}

impl Place {
    fn new() -> Place {
        assert!(
            nix::unistd::geteuid().is_root(),
            "this test sets up directories for uid 65534, which needs root (CI runs as root)"
        );
        let dir = tempfile::Builder::new()
            .prefix("mcpd-pkgstart-")
            .tempdir()
            .expect("tempdir");
        fs::set_permissions(dir.path(), fs::Permissions::from_mode(0o755)).expect("chmod");
        let run = dir.path().join("run");
        fs::create_dir(&run).expect("mkdir run");
        give(&run);
        Place { dir }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// The configuration file for a daemon on `state`.
    fn config(&self, state: &Path) -> PathBuf {
        let path = self.path("config.toml");
        fs::write(
            &path,
            format!(
                "[daemon]\nstate_dir = \"{}\"\nruntime_dir = \"{}\"\n\n[loopback]\nlisten = \"127.0.0.1:0\"\n\n[metrics]\nlisten = \"127.0.0.1:0\"\n",
                state.display(),
                self.path("run").display()
            ),
        )
        .expect("write config");
        fs::set_permissions(&path, fs::Permissions::from_mode(0o644)).expect("chmod config");
        path
    }
}

/// `path` (not followed) is uid and gid 65534's.
fn give(path: &Path) {
    chown(
        path,
        Some(Uid::from_raw(NOBODY)),
        Some(Gid::from_raw(NOBODY)),
    )
    .expect("chown");
}

fn mkdir(path: &Path, mode: u32) {
    fs::create_dir(path).expect("mkdir");
    fs::set_permissions(path, fs::Permissions::from_mode(mode)).expect("chmod");
}

fn as_nobody(config: &Path) -> Command {
    let mut cmd = Command::new(robota_e2e::mcpd_bin());
    cmd.arg("--config")
        .arg(config)
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .uid(NOBODY)
        .gid(NOBODY);
    cmd
}

/// A start as uid 65534 that must fail: exit 1; its stderr.
fn refused(config: &Path) -> String {
    let out = run_bounded(as_nobody(config), LIMIT);
    out.expect_code(1, "a start as uid 65534 on an unusable state directory");
    assert!(
        !out.stderr.contains("the audit store"),
        "the bare open error instead of the cause: {}",
        out.stderr
    );
    out.stderr
}

/// A start as uid 65534 that must serve: it logs `ready`, then stops on SIGTERM, exit 0.
fn serves(place: &Place, config: &Path) {
    let log = place.path("nobody.log");
    let mut child = as_nobody(config)
        .stdin(Stdio::null())
        .stdout(fs::File::create(&log).expect("log"))
        .stderr(fs::File::create(&log).expect("log"))
        .spawn()
        .expect("spawn robota-mcpd");
    let text = || fs::read_to_string(&log).unwrap_or_default();
    let ready = poll_until_blocking(LIMIT, Duration::from_millis(20), || {
        text().contains("ready") || child.try_wait().ok().flatten().is_some()
    });
    let pid = Pid::from_raw(child.id() as i32);
    if !ready || !text().contains("ready") {
        let _ = child.kill();
        let _ = child.wait();
        panic!("the daemon as uid 65534 did not get ready:\n{}", text());
    }
    kill(pid, Signal::SIGTERM).expect("SIGTERM");
    let mut status = None;
    poll_until_blocking(LIMIT, Duration::from_millis(20), || {
        status = child.try_wait().ok().flatten();
        status.is_some()
    });
    let Some(status) = status else {
        let _ = child.kill();
        let _ = child.wait();
        panic!(
            "the daemon as uid 65534 did not stop on SIGTERM:\n{}",
            text()
        );
    };
    assert!(status.success(), "stopped with {status}:\n{}", text());
}

#[test]
fn a_missing_state_directory_its_user_cannot_create_is_named_with_the_fix() {
    let place = Place::new();
    // /var/lib as a container without the package's tmpfiles step has it: root's.
    let lib = place.path("lib");
    mkdir(&lib, 0o755);
    let state = lib.join("robota-mcpd");
    let config = place.config(&state);

    let err = refused(&config);
    // (The user's name is this machine's for uid 65534: nobody on Debian.)
    let want = format!(
        "the state directory {} does not exist, and ",
        state.display()
    );
    assert!(err.contains(&want), "{err}");
    assert!(
        err.contains("(uid 65534), who runs the daemon, cannot create it (Permission denied"),
        "{err}"
    );
    assert!(
        err.contains("install -d -o ") && err.contains(&format!("-m 0700 {}", state.display())),
        "names the fix: {err}"
    );

    // Where the user may create it, the daemon does, private.
    give(&lib);
    serves(&place, &config);
    let meta = fs::metadata(&state).expect("state directory made");
    assert_eq!(meta.permissions().mode() & 0o7777, 0o700);
    assert_eq!(meta.uid(), NOBODY);
}

#[test]
fn a_state_directory_owned_by_root_is_named_with_its_owner_and_the_fix() {
    let place = Place::new();
    let state = place.path("state");
    mkdir(&state, 0o700);
    let config = place.config(&state);

    let err = refused(&config);
    let want = format!(
        "the state directory {} is owned by root (uid 0), not by ",
        state.display()
    );
    assert!(err.contains(&want), "{err}");
    assert!(err.contains("(uid 65534) who runs the daemon"), "{err}");
    assert!(
        err.contains("chown -R ") && err.contains(&format!(" {}", state.display())),
        "names the fix: {err}"
    );

    give(&state);
    serves(&place, &config);
}

#[test]
fn files_a_run_as_root_left_are_named_and_once_given_back_the_daemon_starts() {
    let place = Place::new();
    let state = place.path("state");
    mkdir(&state, 0o700);
    // A run as root, as an operator in a container would start it: its files are root's.
    let root_run = Daemon::builder().state_dir(&state).start();
    root_run.signal(Signal::SIGTERM);
    let exit = root_run.wait_exit(LIMIT).expect("the root run stopped");
    assert!(exit.success(), "{exit}\n{}", root_run.stderr_text());
    drop(root_run);
    give(&state);
    let left: Vec<String> = fs::read_dir(&state)
        .expect("read state")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    assert!(
        left.iter().any(|f| f == "audit.jsonl") && left.iter().any(|f| f == "robota.db"),
        "the root run left {left:?}"
    );
    let config = place.config(&state);

    let err = refused(&config);
    assert!(
        err.contains(&format!(
            "the state directory {} holds files that ",
            state.display()
        )),
        "{err}"
    );
    for file in ["audit.jsonl", "robota.db"] {
        let want = format!(
            "{} is owned by root (uid 0), mode 0600 (left by a run as root?)",
            state.join(file).display()
        );
        assert!(err.contains(&want), "{want:?} not in: {err}");
    }
    assert!(
        err.contains("chown -R ") && err.contains(&format!(" {}", state.display())),
        "names the fix: {err}"
    );

    // The fix it names.
    for entry in fs::read_dir(&state).expect("read state") {
        give(&entry.expect("entry").path());
    }
    serves(&place, &config);
}
