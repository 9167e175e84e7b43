//! Each stdio child in a control group of its own, so that its whole process tree —
//! grandchildren that left its process group with `setsid` included — is bounded by the
//! upstream's `memory` and [`TASKS`] processes and threads, and ends with it.
//!
//! The daemon needs a cgroup it holds alone (the packaged unit's, with `Delegate=yes`; a
//! `systemd-run --scope -p Delegate=yes`; a container's). At start it makes that cgroup
//! its own ([`Tree::adopt`]): it moves itself into `<own>/daemon` and keeps its upstreams'
//! processes beside it,
//!
//! ```text
//! <own>/daemon                  the daemon (and the jobs it runs)
//! <own>/upstreams/<name>        memory.max = the upstream's `memory`, pids.max = TASKS
//! <own>/upstreams/<name>/<n>    one child and everything it starts
//! ```
//!
//! The launcher joins its child's cgroup before it confines itself and executes the
//! command, so nothing the command does happens outside it. When the child exits, is
//! restarted or stopped, its cgroup is killed (`cgroup.kill`) and removed. When the daemon
//! ends, however it ends, its service manager kills the whole tree with its unit.
//!
//! Each bound is the unified hierarchy's controller (memory, pids) where it is delegated
//! to the daemon; on a host that keeps the controller on a cgroup v1 hierarchy, that
//! hierarchy's where the daemon may write it (a daemon run as root), with the same layout.
//! Without a memory controller a bounded upstream does not start; without a pids
//! controller it starts without that bound.

use std::ffi::OsString;
use std::fs;
use std::io::ErrorKind;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Processes and threads one upstream's children may have at once (`pids.max`): more
/// than any MCP server needs, few enough that one cannot take every task the daemon's
/// unit may have (or the host's PIDs) and leave the daemon unable to start a thread.
pub const TASKS: u32 = 1024;

/// The daemon's cgroup, made its own; where its upstreams' processes go.
#[derive(Debug)]
pub struct Tree {
    /// `<own>/upstreams`, in the unified hierarchy.
    upstreams: PathBuf,
    memory: Control,
    pids: Control,
    next: AtomicU64,
}

/// Where one controller is for the upstreams.
#[derive(Debug)]
enum Control {
    /// The unified hierarchy's controller, enabled for `upstreams/`.
    Unified,
    /// A cgroup v1 hierarchy's: `<the daemon's cgroup there>/upstreams`.
    Legacy(PathBuf),
    /// None the daemon may use; why.
    Absent(String),
}

/// One child's cgroup (and, with v1 hierarchies, its upstream's there).
#[derive(Debug)]
pub struct Leaf {
    dir: PathBuf,
    /// The v1 cgroups it also joins.
    legacy: Vec<PathBuf>,
    /// Where the kernel counts the processes it killed at the memory bound, and the count
    /// when the child started.
    oom_count: Option<(PathBuf, u64)>,
}

/// How long a killed cgroup may take to empty before it is left for the next start.
const EMPTY_LIMIT: Duration = Duration::from_secs(2);

impl Tree {
    /// Makes the daemon's cgroup (unified hierarchy) its own: it must hold no process but
    /// the daemon, nor another daemon in `<own>/daemon`; the daemon moves into
    /// `<own>/daemon`, what a former daemon left in `<own>/upstreams` is killed, and the
    /// memory controller is enabled for the upstreams where it is delegated. Called once,
    /// at start, before anything is started.
    pub fn adopt() -> Result<Tree, String> {
        const HOW: &str = "run it under the packaged unit (Delegate=yes) or `systemd-run --scope -p Delegate=yes`";
        let own = own_dir(None).map_err(|e| {
            format!("the kernel offers the daemon no cgroup of its own ({e}); {HOW}")
        })?;
        let procs = fs::read_to_string(own.join("cgroup.procs"))
            .map_err(|e| format!("cannot read {}: {e}", own.join("cgroup.procs").display()))?;
        if let Some(other) = not_mine(&procs) {
            return Err(format!(
                "its cgroup {} holds a process it did not start (pid {other}), so it cannot bound and end its upstreams' process trees; {HOW}",
                own.display()
            ));
        }
        let daemon = own.join("daemon");
        // A daemon already serving from this cgroup: its upstreams are its own, not
        // leftovers to end (it holds the control socket, so this start fails there).
        if let Some(other) =
            not_mine(&fs::read_to_string(daemon.join("cgroup.procs")).unwrap_or_default())
        {
            return Err(format!(
                "another process runs as the daemon of its cgroup {} (pid {other}); its upstreams are left alone",
                own.display()
            ));
        }
        make_dir(&daemon)?;
        fs::write(daemon.join("cgroup.procs"), std::process::id().to_string()).map_err(|e| {
            format!(
                "cannot move the daemon into {} ({e}): its cgroup is not delegated to it; {HOW}",
                daemon.display()
            )
        })?;
        let upstreams = own.join("upstreams");
        if upstreams.exists() {
            // A former daemon's, in the same cgroup (a scope restarted by hand).
            end_tree(&upstreams);
        }
        make_dir(&upstreams)?;
        let controllers = fs::read_to_string(own.join("cgroup.controllers")).unwrap_or_default();
        let control = |name: &str| {
            if !controllers.split_whitespace().any(|c| c == name) {
                return legacy(name);
            }
            let enable =
                |dir: &Path| fs::write(dir.join("cgroup.subtree_control"), format!("+{name}"));
            match enable(&own).and_then(|()| enable(&upstreams)) {
                Ok(()) => Control::Unified,
                Err(e) => Control::Absent(format!(
                    "cannot enable the {name} controller beneath {}: {e}",
                    own.display()
                )),
            }
        };
        let (memory, pids) = (control("memory"), control("pids"));
        if let Control::Absent(why) = &pids {
            tracing::info!("upstreams' process trees are not bounded in number: {why}");
        }
        Ok(Tree {
            upstreams,
            memory,
            pids,
            next: AtomicU64::new(1),
        })
    }

    /// A fresh cgroup for one child of `upstream`, whose tree is bounded by `memory`
    /// (none: unbounded) and [`TASKS`]. A memory bound the kernel does not offer is an
    /// error when `required` (a confined upstream), and is skipped otherwise; so is the
    /// tasks bound, always.
    pub fn leaf(
        &self,
        upstream: &str,
        memory: Option<u64>,
        required: bool,
    ) -> Result<Leaf, String> {
        let group = self.upstreams.join(upstream);
        make_dir(&group)?;
        let mut legacy = Vec::new();
        let oom_count = match (&self.memory, memory) {
            (Control::Unified, _) => {
                let limit = memory.map_or_else(|| "max".to_owned(), |m| m.to_string());
                write(&group.join("memory.max"), &limit)?;
                // Swap would let the tree grow past its bound.
                if group.join("memory.swap.max").exists() {
                    let swap = if memory.is_some() { "0" } else { "max" };
                    write(&group.join("memory.swap.max"), swap)?;
                }
                Some(group.join("memory.events"))
            }
            (Control::Legacy(base), _) => {
                let dir = base.join(upstream);
                make_dir(&dir)?;
                let limit = memory.map_or_else(|| "-1".to_owned(), |m| m.to_string());
                write(&dir.join("memory.limit_in_bytes"), &limit)?;
                let count = dir.join("memory.oom_control");
                legacy.push(dir);
                Some(count)
            }
            (Control::Absent(why), Some(m)) if required => {
                return Err(format!(
                    "its memory bound ({}) cannot be enforced: {why}; write memory = \"unbounded\" to run it without a bound of its own",
                    bytesize::ByteSize::b(m).display().iec()
                ));
            }
            (Control::Absent(_), _) => None,
        };
        match &self.pids {
            Control::Unified => write(&group.join("pids.max"), &TASKS.to_string())?,
            Control::Legacy(base) => {
                let dir = base.join(upstream);
                make_dir(&dir)?;
                write(&dir.join("pids.max"), &TASKS.to_string())?;
                legacy.push(dir);
            }
            Control::Absent(_) => {}
        }
        let dir = group.join(self.next.fetch_add(1, Ordering::Relaxed).to_string());
        make_dir(&dir)?;
        let oom_count = oom_count.map(|file| {
            let now = oom_kills(&file);
            (file, now)
        });
        Ok(Leaf {
            dir,
            legacy,
            oom_count,
        })
    }
}

impl Leaf {
    /// The launcher's arguments that place it.
    pub fn args(&self) -> Vec<OsString> {
        let mut args = vec!["--cgroup".into(), self.dir.clone().into()];
        for dir in &self.legacy {
            args.push("--cgroup".into());
            args.push(dir.clone().into());
        }
        args
    }

    /// Whether the kernel killed a process of its upstream at the memory bound since the
    /// child started.
    pub fn hit_memory_bound(&self) -> bool {
        self.oom_count
            .as_ref()
            .is_some_and(|(file, before)| oom_kills(file) > *before)
    }

    /// Removes it before anything joined it (the command could not be started).
    pub fn discard(&self) {
        end_tree(&self.dir);
    }

    /// Kills every process in it and removes it, waiting (bounded) until it is empty.
    pub async fn end(&self) {
        let dir = self.dir.clone();
        let _ = tokio::task::spawn_blocking(move || end_tree(&dir)).await;
    }
}

/// A process of a `cgroup.procs` listing other than this one.
fn not_mine(procs: &str) -> Option<&str> {
    let me = std::process::id().to_string();
    procs.lines().map(str::trim).find(|p| *p != me)
}

/// In the launcher, before anything else: this process joins each cgroup in `dirs`.
pub fn join(dirs: &[PathBuf]) -> Result<(), String> {
    for dir in dirs {
        fs::write(dir.join("cgroup.procs"), "0")
            .map_err(|e| format!("cannot join the cgroup {}: {e}", dir.display()))?;
    }
    Ok(())
}

/// Kills everything in `dir` and beneath, then removes it, deepest first.
fn end_tree(dir: &Path) {
    let kill = dir.join("cgroup.kill");
    if kill.exists() {
        let _ = fs::write(&kill, "1");
    } else {
        // Before Linux 5.14: one by one, until none is left.
        kill_each(dir);
    }
    let deadline = std::time::Instant::now() + EMPTY_LIMIT;
    while populated(dir) && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    remove_tree(dir);
}

fn kill_each(dir: &Path) {
    use nix::sys::signal::{Signal, kill};
    for _ in 0..100 {
        let mut any = false;
        for sub in descendants(dir) {
            for pid in fs::read_to_string(sub.join("cgroup.procs"))
                .unwrap_or_default()
                .lines()
            {
                if let Ok(pid) = pid.trim().parse::<i32>() {
                    any = true;
                    let _ = kill(nix::unistd::Pid::from_raw(pid), Signal::SIGKILL);
                }
            }
        }
        if !any {
            return;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn populated(dir: &Path) -> bool {
    fs::read_to_string(dir.join("cgroup.events"))
        .map(|events| events.lines().any(|l| l == "populated 1"))
        .unwrap_or(false)
}

/// `dir` and every cgroup beneath it, deepest last.
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

/// Cgroups go with rmdir only, children first.
fn remove_tree(dir: &Path) {
    for sub in descendants(dir).iter().rev() {
        let _ = fs::remove_dir(sub);
    }
}

/// The daemon's cgroup in the v1 hierarchy of `controller`, when it may make `upstreams`
/// there.
fn legacy(controller: &str) -> Control {
    let none = |e: String| {
        Control::Absent(format!(
            "the kernel offers the daemon no {controller} controller: none is delegated to its cgroup on the unified hierarchy (cgroup v2, a unit with Delegate=yes), nor may it make cgroups in a v1 {controller} hierarchy ({e})"
        ))
    };
    let base = match own_dir(Some(controller)) {
        Ok(own) => own.join("upstreams"),
        Err(e) => return none(e),
    };
    if base.exists() {
        // A former daemon's; its processes were killed in the unified hierarchy.
        remove_tree(&base);
    }
    match make_dir(&base) {
        Ok(()) => Control::Legacy(base),
        Err(e) => none(e),
    }
}

/// The daemon's own cgroup directory in the unified hierarchy (`None`) or in the v1
/// hierarchy of `controller`.
fn own_dir(controller: Option<&str>) -> Result<PathBuf, String> {
    let has = |list: &str, name: &str| list.split(',').any(|c| c == name);
    let ours =
        fs::read_to_string("/proc/self/cgroup").map_err(|e| format!("/proc/self/cgroup: {e}"))?;
    // hierarchy-id:controllers:path; the unified hierarchy's line is `0::path`.
    let path = ours
        .lines()
        .find_map(|l| {
            let mut parts = l.splitn(3, ':');
            let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
            let ours = match controller {
                None => controllers.is_empty(),
                Some(name) => has(controllers, name),
            };
            ours.then_some(path)
        })
        .ok_or_else(|| {
            format!(
                "the process is in no {} hierarchy",
                controller.unwrap_or("unified")
            )
        })?;
    let (root, at) = super::mounts::read()?
        .into_iter()
        .find_map(|m| {
            let ours = match controller {
                None => m.fstype == "cgroup2",
                Some(name) => m.fstype == "cgroup" && has(&m.super_options, name),
            };
            ours.then(|| (m.root.display().to_string(), m.at))
        })
        .ok_or("the hierarchy is not mounted")?;
    let relative = path
        .strip_prefix(root.trim_end_matches('/'))
        .filter(|p| p.is_empty() || p.starts_with('/'))
        .ok_or_else(|| format!("its cgroup {path} is outside the mounted part {root}"))?
        .trim_start_matches('/');
    if relative.is_empty() {
        return Err("the daemon's cgroup there is the hierarchy's root".into());
    }
    Ok(Path::new(&at).join(relative))
}

fn make_dir(dir: &Path) -> Result<(), String> {
    match fs::create_dir(dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == ErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(format!("cannot make the cgroup {}: {e}", dir.display())),
    }
}

fn write(file: &Path, value: &str) -> Result<(), String> {
    fs::write(file, value).map_err(|e| format!("cannot write {value} to {}: {e}", file.display()))
}

/// The `oom_kill N` line of `memory.events` (v2) or `memory.oom_control` (v1).
fn oom_kills(file: &Path) -> u64 {
    fs::read_to_string(file)
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("oom_kill ")?.trim().parse().ok())
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_kernels_count_of_kills_at_the_bound_is_read_from_either_hierarchys_file() {
        let dir = tempfile::tempdir().unwrap();
        let v2 = dir.path().join("memory.events");
        fs::write(
            &v2,
            "low 0\nhigh 0\nmax 12\noom 3\noom_kill 2\noom_group_kill 0\n",
        )
        .unwrap();
        assert_eq!(oom_kills(&v2), 2);
        let v1 = dir.path().join("memory.oom_control");
        fs::write(&v1, "oom_kill_disable 0\nunder_oom 0\noom_kill 7\n").unwrap();
        assert_eq!(oom_kills(&v1), 7);
        assert_eq!(oom_kills(&dir.path().join("absent")), 0);
    }
}
