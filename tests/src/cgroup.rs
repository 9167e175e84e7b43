//! A cgroup of its own for what a test starts, as a service manager would give it: a
//! booted machine (in every process-tracking hierarchy, for systemd-nspawn) or a daemon
//! (in the unified hierarchy, which it makes its own and keeps its upstreams' process
//! trees in, and, on a host that keeps memory or pids on cgroup v1 hierarchies, in those
//! too, where it bounds their memory and number). Made under the cgroup the tests run in; killed and
//! removed, with whatever was made beneath it, on [`Cgroup::remove`] or drop.

use std::fs;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::poll_until_blocking;

/// Which hierarchies a cgroup is made in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hierarchies {
    /// The unified one and, on a hybrid host, the named `systemd` one.
    Tracking,
    /// The unified one and the v1 `memory` and `pids` ones, where mounted.
    Daemon,
}

/// One directory per hierarchy.
#[derive(Debug)]
pub struct Cgroup {
    dirs: Vec<PathBuf>,
}

impl Cgroup {
    /// Makes `name` in each hierarchy `which` names that this host mounts; panics when it
    /// cannot (the tests run as root).
    pub fn create(name: &str, which: Hierarchies) -> Cgroup {
        let mounts = fs::read_to_string("/proc/self/mounts").expect("/proc/self/mounts");
        let ours = fs::read_to_string("/proc/self/cgroup").expect("/proc/self/cgroup");
        let mut dirs = Vec::new();
        for line in mounts.lines() {
            let fields: Vec<&str> = line.split(' ').collect();
            let [_, at, kind, options, ..] = fields[..] else {
                continue;
            };
            let has = |o: &str| options.split(',').any(|x| x == o);
            // Which controller (or name) names our place in this hierarchy, in
            // /proc/self/cgroup; empty: the unified one.
            let key = match (kind, which) {
                ("cgroup2", _) => "",
                ("cgroup", Hierarchies::Tracking) if has("name=systemd") => "name=systemd",
                ("cgroup", Hierarchies::Daemon) if has("memory") => "memory",
                ("cgroup", Hierarchies::Daemon) if has("pids") => "pids",
                _ => continue,
            };
            let place = ours
                .lines()
                .find_map(|l| {
                    let mut parts = l.splitn(3, ':');
                    let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
                    let found = if key.is_empty() {
                        controllers.is_empty()
                    } else {
                        controllers.split(',').any(|c| c == key)
                    };
                    found.then_some(path)
                })
                .unwrap_or("/");
            let mut dir = Path::new(at).join(place.trim_start_matches('/'));
            if !dir.is_dir() {
                dir = PathBuf::from(at);
            }
            let dir = dir.join(name);
            fs::create_dir(&dir)
                .unwrap_or_else(|e| panic!("create the cgroup {}: {e}", dir.display()));
            dirs.push(dir);
        }
        assert!(
            !dirs.is_empty(),
            "this host mounts no cgroup hierarchy to give {name} a cgroup of its own in"
        );
        Cgroup { dirs }
    }

    /// Each hierarchy's `cgroup.procs`: a process that writes `0` (or its pid) to each
    /// joins the cgroup.
    pub fn procs_files(&self) -> Vec<PathBuf> {
        self.dirs.iter().map(|d| d.join("cgroup.procs")).collect()
    }

    /// A command that runs `program` in this cgroup: a shell joins it, then becomes the
    /// program (same pid), as a service manager starts a unit's process.
    pub fn command(&self, program: &Path) -> std::process::Command {
        let mut cmd = std::process::Command::new("/bin/sh");
        cmd.arg("-c")
            .arg(r#"while [ "$1" != -- ]; do echo 0 > "$1" || exit 1; shift; done; shift; exec "$@""#)
            .arg("sh")
            .args(self.procs_files())
            .arg("--")
            .arg(program);
        cmd
    }

    /// Kills whatever is left in it, then removes it and what was made beneath it.
    pub fn remove(&mut self) {
        for dir in self.dirs.drain(..) {
            let kill = dir.join("cgroup.kill");
            if kill.exists() {
                let _ = fs::write(&kill, "1");
            }
            let _ =
                poll_until_blocking(Duration::from_secs(10), Duration::from_millis(100), || {
                    for sub in descendants(&dir).iter().rev() {
                        let _ = fs::remove_dir(sub);
                    }
                    !dir.exists()
                });
        }
    }
}

impl Drop for Cgroup {
    fn drop(&mut self) {
        self.remove();
    }
}

/// `dir` and every cgroup beneath it, parents first.
fn descendants(dir: &Path) -> Vec<PathBuf> {
    let mut all = vec![dir.to_owned()];
    let mut i = 0;
    while i < all.len() {
        for entry in fs::read_dir(&all[i]).into_iter().flatten().flatten() {
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                all.push(entry.path());
            }
        }
        i += 1;
    }
    all
}
