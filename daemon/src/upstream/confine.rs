//! What a stdio upstream's processes may reach, enforced by the kernel (Landlock) in the
//! launcher (`robota-mcpd exec-upstream`) just before it becomes the upstream's command,
//! so the command and everything it starts inherit it for good:
//!
//! - **Files.** The system's read-only view ([`SYSTEM_VIEW`]), the command's executable and
//!   its `cwd`, and `read_paths`: read and execute. Its home and private tmp
//!   (`<cache>/<name>`), and `write_paths`: everything. Nothing else — no other path can
//!   be read, listed or written. Paths the daemon must keep to itself (its state, runtime
//!   and configuration directories, the other upstreams' homes, every secret file it
//!   reads) are carved out of whatever would hold them, however the operator wrote the
//!   lists and wherever a bind mount makes them reachable ([`super::mounts::aliases`]).
//! - **Network.** `network = "none"`: no TCP connection and no TCP listener (Landlock), and
//!   no IPv4 or IPv6 socket at all (the filter below); unix sockets stay.
//! - **Other processes.** It cannot signal nor trace a process outside its own sandbox
//!   (the daemon, another upstream), nor connect to an abstract unix socket made outside
//!   it; it runs with no new privileges.
//!
//! - **System calls** Landlock does not govern, refused by one more filter
//!   (`robota_sys::confine_system_calls`): another process's limits or I/O priority (an
//!   upstream of the daemon's user could otherwise starve or kill the daemon), a file's
//!   mode, owner, times or extended attributes by path (a path can name a file it may not
//!   open), io_uring, and with `network = "none"` every IPv4 and IPv6 socket (UDP, MPTCP
//!   and TCP Fast Open included).
//! - **The control socket.** That filter cannot be taken away: a peer of the daemon's user
//!   under more filters than the daemon is a confined upstream, and the control socket
//!   refuses it (`control.rs`).
//! - **Privileges.** It keeps no capability (a daemon run as root hands none on), and the
//!   daemon's own `/proc` files — its environment, memory, descriptors — are closed to
//!   processes of its user ([`harden_daemon`]).
//!
//! The kernel must offer all of it (Landlock ABI 6); where it does not, the launcher
//! refuses to run the command, and the upstream's start fails with the reason, unless
//! the operator wrote `confine = false`.

use std::collections::{BTreeSet, HashSet};
use std::ffi::OsString;
use std::os::unix::fs::{DirEntryExt, MetadataExt};
use std::path::{Path, PathBuf};

use landlock::{
    ABI, Access, AccessFs, AccessNet, BitFlags, CompatLevel, Compatible, PathBeneath, PathFd,
    Ruleset, RulesetAttr, RulesetCreatedAttr, Scope,
};

use crate::config::Network;

/// The Landlock ABI the confinement needs: files, TCP (4), signal and abstract unix socket
/// scopes (6).
const NEEDED: ABI = ABI::V6;

/// Read and execute for a confined child, beneath each of these that exists: what
/// programs, interpreters and their libraries need, and nothing that holds users' or
/// services' data (`/home`, `/root`, `/var`, `/srv`, `/run`, `/tmp` are not in it).
pub const SYSTEM_VIEW: &[&str] = &[
    "/usr",
    "/bin",
    "/sbin",
    "/lib",
    "/lib32",
    "/lib64",
    "/libx32",
    "/opt",
    "/etc",
    "/proc",
    "/sys",
    "/dev/zero",
    "/dev/random",
    "/dev/urandom",
];

/// Device files a confined child may also write.
const DEVICES: &[&str] = &["/dev/null", "/dev/full"];

/// One child's confinement, as the daemon hands it to the launcher.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Confinement {
    pub network: Network,
    /// Read and execute, beyond [`SYSTEM_VIEW`].
    pub read: Vec<PathBuf>,
    /// Everything.
    pub write: Vec<PathBuf>,
    /// Everything, granted as they are: its own home and tmp, which lie beneath a hidden
    /// path (the other upstreams' homes).
    pub own: Vec<PathBuf>,
    /// Never reachable, even beneath a path above (but for `own`).
    pub hidden: Vec<PathBuf>,
}

impl Confinement {
    /// The launcher's arguments that carry it (paths only: nothing secret).
    pub fn args(&self) -> Vec<OsString> {
        let mut args: Vec<OsString> = vec!["--network".into(), self.network.as_str().into()];
        for (flag, paths) in [
            ("--read", &self.read),
            ("--write", &self.write),
            ("--own", &self.own),
            ("--hide", &self.hidden),
        ] {
            for p in paths {
                args.push(flag.into());
                args.push(p.into());
            }
        }
        args
    }

    /// Confines this process (and what it executes) for good. Called by the launcher,
    /// single-threaded, just before it executes the command.
    pub fn apply(&self) -> Result<(), String> {
        // A kept path is kept wherever it can be reached: through a bind mount of it, or
        // of a directory above or below it, too.
        let mounts = super::mounts::read()
            .map_err(|e| format!("cannot see where the daemon's own paths are mounted: {e}"))?;
        let kept = Kept::new(
            self.hidden
                .iter()
                .flat_map(|p| super::mounts::aliases(&canonical(p), &mounts))
                .collect(),
        );
        let read = AccessFs::from_read(NEEDED);
        let all = AccessFs::from_all(NEEDED);
        let mut grants = Vec::new();
        for root in SYSTEM_VIEW
            .iter()
            .map(Path::new)
            .chain(self.read.iter().map(PathBuf::as_path))
        {
            carve(
                &canonical(root),
                read,
                &kept,
                &mut HashSet::new(),
                &mut grants,
            );
        }
        for device in DEVICES {
            carve(
                Path::new(device),
                all,
                &kept,
                &mut HashSet::new(),
                &mut grants,
            );
        }
        for path in &self.write {
            carve(
                &canonical(path),
                all,
                &kept,
                &mut HashSet::new(),
                &mut grants,
            );
        }
        grants.extend(self.own.iter().map(|p| (canonical(p), all)));
        let mut ruleset = Ruleset::default()
            .set_compatibility(CompatLevel::HardRequirement)
            .handle_access(all)
            .map_err(unsupported)?;
        if self.network == Network::None {
            ruleset = ruleset
                .handle_access(AccessNet::from_all(NEEDED))
                .map_err(unsupported)?;
        }
        let mut created = ruleset
            .scope(Scope::from_all(NEEDED))
            .map_err(unsupported)?
            .create()
            .map_err(unsupported)?;
        for (path, access) in grants {
            let Ok(fd) = PathFd::new(&path) else {
                continue;
            };
            // A file takes only the rights that apply to files.
            let access = if path.is_dir() {
                access
            } else {
                access & AccessFs::from_file(NEEDED)
            };
            created = created
                .add_rule(PathBeneath::new(fd, access))
                .map_err(|e| format!("cannot allow {}: {e}", path.display()))?;
        }
        drop_capabilities()?;
        created.restrict_self().map_err(unsupported)?;
        // What Landlock does not govern; also the mark the control socket knows a confined
        // process by (one more filter than the daemon).
        robota_sys::confine_system_calls(robota_sys::Refusals {
            non_unix_sockets: self.network == Network::None,
        })
        .map_err(|e| format!("cannot install the upstream's system-call filter: {e}"))?;
        Ok(())
    }
}

/// Gives up every capability, for this process and whatever it executes (a daemon run as
/// root would otherwise hand its children the power to read any process's memory).
fn drop_capabilities() -> Result<(), String> {
    // An unprivileged process (the packaged unit's) holds none, and its system-call filter
    // refuses capset: nothing to do.
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let holds_none = ["CapInh:", "CapPrm:", "CapEff:", "CapAmb:"]
        .iter()
        .all(|set| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(set))
                .is_some_and(|v| v.trim().chars().all(|c| c == '0'))
        });
    if holds_none {
        return Ok(());
    }
    robota_sys::drop_capabilities().map_err(|e| format!("cannot drop the capabilities: {e}"))
}

/// The daemon's own hardening against what it starts: its `/proc` files (environment,
/// memory, descriptors) become root's, so a process of the daemon's user — an upstream —
/// cannot read them; and, where the kernel offers it (Linux 6.6), memory that was
/// writable never becomes executable in the daemon (W^X), without being handed on to the
/// children (a JIT such as Node's needs it). Returns what could not be done.
pub fn harden_daemon() -> Vec<String> {
    let mut missing = Vec::new();
    if let Err(e) = robota_sys::not_dumpable() {
        missing.push(format!(
            "cannot close the daemon's /proc files to its own user (PR_SET_DUMPABLE): {e}"
        ));
    }
    if let Err(e) = robota_sys::deny_write_execute_here() {
        missing.push(format!(
            "this kernel cannot keep the daemon's memory W^X without imposing it on upstreams (PR_SET_MDWE with PR_MDWE_NO_INHERIT needs Linux 6.6): {e}; with no JIT upstream (Node.js), a drop-in with MemoryDenyWriteExecute=yes restores it"
        ));
    }
    missing
}

fn unsupported(e: impl std::fmt::Display) -> String {
    format!(
        "the kernel cannot confine the upstream as configured (Landlock ABI {} needed: files, TCP, signals): {e}; set `confine = false` for this upstream to run it unconfined",
        NEEDED as i32
    )
}

/// `path` with its symbolic links resolved, when it exists.
fn canonical(path: &Path) -> PathBuf {
    std::fs::canonicalize(path).unwrap_or_else(|_| path.to_owned())
}

/// The paths a child must never reach, at every place they can be reached, and the
/// directories that hold one of them on some way to it.
struct Kept {
    paths: Vec<PathBuf>,
    /// Device and inode of every directory on a way to a kept path: each ancestor of
    /// each of its paths, as seen there and, for a mount point, the directory the mount
    /// covers (seen, without the mount, through another mount of its file system).
    /// Landlock grants a directory by its inode, wherever it is reached, so a grant of
    /// any of these would grant the kept path beneath it.
    holders: HashSet<(u64, u64)>,
}

impl Kept {
    fn new(paths: Vec<PathBuf>) -> Self {
        let ancestors: BTreeSet<&Path> = paths.iter().flat_map(|p| p.ancestors().skip(1)).collect();
        let mut holders = HashSet::new();
        for dir in ancestors {
            if let Ok(seen) = std::fs::metadata(dir) {
                holders.insert((seen.dev(), seen.ino()));
            }
            let (Some(parent), Some(name)) = (dir.parent(), dir.file_name()) else {
                continue;
            };
            // A directory's entry names the inode beneath any mount on it.
            let covered = std::fs::metadata(parent).ok().and_then(|p| {
                std::fs::read_dir(parent)
                    .ok()?
                    .flatten()
                    .find(|e| e.file_name() == name)
                    .map(|e| (p.dev(), e.ino()))
            });
            holders.extend(covered);
        }
        Self { paths, holders }
    }
}

/// Grants `access` beneath `path`, except for what is `kept`: where a kept path lies
/// below, `path` itself gets nothing and each entry of it is granted the same way. A
/// symbolic link among them is not followed (its target is granted by its own path, or
/// not at all), and each directory is looked into once (through a bind mount a
/// directory can hold itself).
fn carve(
    path: &Path,
    access: BitFlags<AccessFs>,
    kept: &Kept,
    seen: &mut HashSet<(u64, u64)>,
    grants: &mut Vec<(PathBuf, BitFlags<AccessFs>)>,
) {
    if kept.paths.iter().any(|h| path.starts_with(h)) {
        return;
    }
    let Ok(meta) = std::fs::symlink_metadata(path) else {
        return;
    };
    if meta.file_type().is_symlink() {
        return;
    }
    let id = (meta.dev(), meta.ino());
    if !kept.paths.iter().any(|h| h.starts_with(path)) && !kept.holders.contains(&id) {
        grants.push((path.to_owned(), access));
        return;
    }
    if !seen.insert(id) {
        return;
    }
    let Ok(entries) = std::fs::read_dir(path) else {
        return;
    };
    for entry in entries.flatten() {
        carve(&entry.path(), access, kept, seen, grants);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hidden_path_is_carved_out_of_what_holds_it() {
        let dir = tempfile::tempdir().unwrap();
        let root = canonical(dir.path());
        for d in ["etc/robota-mcpd", "etc/ssl", "etc/other/deep"] {
            std::fs::create_dir_all(root.join(d)).unwrap();
        }
        std::fs::write(root.join("etc/passwd"), "").unwrap();
        std::fs::write(root.join("etc/other/secret.key"), "").unwrap();
        // Links to what is kept, and to what is not: neither is followed.
        std::os::unix::fs::symlink(root.join("etc/robota-mcpd"), root.join("etc/state-link"))
            .unwrap();
        std::os::unix::fs::symlink(root.join("etc/ssl"), root.join("etc/other/ssl-link")).unwrap();
        let kept = Kept::new(vec![
            root.join("etc/robota-mcpd"),
            root.join("etc/other/secret.key"),
        ]);
        let mut grants = Vec::new();
        let read = AccessFs::from_read(NEEDED);
        carve(
            &root.join("etc"),
            read,
            &kept,
            &mut HashSet::new(),
            &mut grants,
        );
        let mut granted: Vec<_> = grants
            .iter()
            .map(|(p, _)| p.strip_prefix(&root).unwrap().display().to_string())
            .collect();
        granted.sort();
        assert_eq!(granted, ["etc/other/deep", "etc/passwd", "etc/ssl"]);
        // Hidden itself, or beneath it: nothing.
        let mut none = Vec::new();
        carve(
            &root.join("etc/robota-mcpd"),
            read,
            &kept,
            &mut HashSet::new(),
            &mut none,
        );
        assert!(none.is_empty());
    }

    #[test]
    fn the_launcher_arguments_carry_every_path() {
        let c = Confinement {
            network: Network::Any,
            read: vec!["/srv/docs".into()],
            write: vec!["/var/cache/x".into()],
            own: vec!["/var/cache/robota-mcpd/x".into()],
            hidden: vec!["/var/lib/robota-mcpd".into()],
        };
        let args: Vec<String> = c
            .args()
            .into_iter()
            .map(|a| a.into_string().unwrap())
            .collect();
        assert_eq!(
            args,
            [
                "--network",
                "any",
                "--read",
                "/srv/docs",
                "--write",
                "/var/cache/x",
                "--own",
                "/var/cache/robota-mcpd/x",
                "--hide",
                "/var/lib/robota-mcpd"
            ]
        );
    }
}
