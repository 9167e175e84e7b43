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
use std::ffi::{OsStr, OsString};
use std::os::fd::OwnedFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{DirEntryExt, MetadataExt};
use std::path::{Component, Path, PathBuf};

use nix::dir::Dir;
use nix::fcntl::{AT_FDCWD, OFlag, openat};
use nix::sys::stat::{Mode, SFlag, fstat};

use landlock::{
    ABI, Access, AccessFs, AccessNet, BitFlags, CompatLevel, Compatible, PathBeneath, Ruleset,
    RulesetAttr, RulesetCreatedAttr, Scope,
};

use crate::config::Network;
use crate::owners::file_kind;

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

/// The journal: kept from upstreams too, but the system's own, wherever its distribution
/// puts it (who may move it is not the daemon's to judge).
pub const JOURNALS: [&str; 2] = ["/var/log/journal", "/run/log/journal"];

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
        // A kept path that someone else could move aside, or reach through a directory
        // they could swap, would be carved out at the wrong place.
        for kept in &self.hidden {
            if let Some(why) = movable_by_others(kept) {
                return Err(format!(
                    "cannot keep {} from the upstream: {why}",
                    kept.display()
                ));
            }
        }
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
        // Each rule is added as its file is judged, by the descriptor that was judged:
        // what is granted is what was looked at, whatever is renamed meanwhile.
        let mut allow = |grant: Grant, access: BitFlags<AccessFs>| {
            // A file takes only the rights that apply to files.
            let access = if grant.dir {
                access
            } else {
                access & AccessFs::from_file(NEEDED)
            };
            (&mut created)
                .add_rule(PathBeneath::new(grant.fd, access))
                .map(drop)
                .map_err(|e| format!("cannot allow {}: {e}", grant.path.display()))
        };
        let roots = SYSTEM_VIEW
            .iter()
            .map(|p| (canonical(Path::new(p)), read))
            .chain(self.read.iter().map(|p| (canonical(p), read)))
            .chain(DEVICES.iter().map(|p| (PathBuf::from(p), all)))
            .chain(self.write.iter().map(|p| (canonical(p), all)));
        for (root, access) in roots {
            if let Some(fd) = open_unfollowed(&root) {
                carve(fd, &root, access, &kept, &mut HashSet::new(), &mut allow)?;
            }
        }
        // Its own home and tmp, as they are (they lie beneath a kept path).
        for own in &self.own {
            let own = canonical(own);
            if let Some(fd) = open_unfollowed(&own) {
                let dir = fstat(&fd).is_ok_and(|st| file_kind(&st) == SFlag::S_IFDIR);
                allow(Grant { path: own, fd, dir }, all)?;
            }
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
pub fn canonical(path: &Path) -> PathBuf {
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
    /// Device and inode of each kept path itself, however else it is reached.
    ids: HashSet<(u64, u64)>,
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
        let ids = paths
            .iter()
            .filter_map(|p| std::fs::symlink_metadata(p).ok())
            .map(|m| (m.dev(), m.ino()))
            .collect();
        Self {
            paths,
            holders,
            ids,
        }
    }
}

/// Why someone other than root or this process's user could move `kept` aside, or swap
/// anything on the way to it, while a child starts — and so have it granted whole at the
/// place it was moved to (the carving goes by the paths as they are then); `None` when
/// nobody could, or when it is the journal ([`JOURNALS`]). The path is walked as written,
/// from `/`: each directory met, as the holder of the next entry, is judged as those above
/// a file root are ([`crate::owners::guards`]); a symbolic link met on the way must
/// be root's or this user's (in a sticky directory its owner may replace it) and is
/// followed, its target walked the same way; and a kept directory is judged as the holder
/// of its own entries too (whoever may rename them may move them out).
pub fn movable_by_others(kept: &Path) -> Option<String> {
    /// As the kernel: more links than this on one path is a loop.
    const MAX_LINKS: usize = 40;
    if JOURNALS.iter().any(|j| kept.starts_with(j)) {
        return None;
    }
    let what = "a path the daemon keeps from upstreams";
    let euid = nix::unistd::geteuid();
    let flags = OFlag::O_PATH | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
    let mut at = PathBuf::from("/");
    let mut dir = openat(AT_FDCWD, "/", flags | OFlag::O_DIRECTORY, Mode::empty()).ok()?;
    // Owned, so that a link's target can be put in front.
    let owned = |path: &Path| -> Vec<OsString> {
        path.components()
            .map(|c| c.as_os_str().to_owned())
            .collect()
    };
    let mut rest: std::collections::VecDeque<OsString> = owned(kept).into();
    let mut links = 0;
    while let Some(component) = rest.pop_front() {
        let name = match Path::new(&component).components().next() {
            Some(Component::Normal(name)) => name.to_owned(),
            Some(Component::ParentDir) => {
                dir = openat(&dir, "..", flags | OFlag::O_DIRECTORY, Mode::empty()).ok()?;
                at.pop();
                continue;
            }
            Some(Component::RootDir) => {
                dir = openat(AT_FDCWD, "/", flags | OFlag::O_DIRECTORY, Mode::empty()).ok()?;
                at = PathBuf::from("/");
                continue;
            }
            _ => continue,
        };
        let next = at.join(&name);
        let holder = fstat(&dir).ok()?;
        if let Err(why) = crate::owners::guards(&at, &holder, &next, euid, what) {
            return Some(why);
        }
        // Gone: only root or this user could make it (its holder passed).
        let entry = openat(&dir, name.as_os_str(), flags, Mode::empty()).ok()?;
        let stat = fstat(&entry).ok()?;
        match file_kind(&stat) {
            SFlag::S_IFLNK => {
                if stat.st_uid != 0 && stat.st_uid != euid.as_raw() {
                    return Some(format!(
                        "{} is a symbolic link owned by uid {}, who could point it elsewhere; the links on the way to {what} must belong to root or to the daemon's user (uid {euid})",
                        next.display(),
                        stat.st_uid
                    ));
                }
                links += 1;
                if links > MAX_LINKS {
                    return Some(format!(
                        "{} goes through more than {MAX_LINKS} symbolic links",
                        kept.display()
                    ));
                }
                let target = nix::fcntl::readlinkat(&dir, name.as_os_str()).ok()?;
                for component in owned(Path::new(&target)).into_iter().rev() {
                    rest.push_front(component);
                }
            }
            SFlag::S_IFDIR => {
                dir = entry;
                at = next;
                if rest.is_empty() {
                    // The kept directory itself holds what it keeps.
                    let entries = at.join("…");
                    if let Err(why) = crate::owners::guards(&at, &stat, &entries, euid, what) {
                        return Some(why);
                    }
                }
            }
            // A file: the end of the walk.
            _ => return None,
        }
    }
    None
}

/// A file or directory about to be granted, held open by an `O_PATH` descriptor.
struct Grant {
    path: PathBuf,
    fd: OwnedFd,
    dir: bool,
}

/// `path` (absolute, links resolved) opened one component at a time from `/`, following
/// no link on the way: `None` where a component is gone or has become a link since the
/// path was resolved. The last component may be a link, opened as itself
/// ([`carve`] never grants one).
fn open_unfollowed(path: &Path) -> Option<OwnedFd> {
    let flags = OFlag::O_PATH | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
    let mut components = path.components();
    if components.next() != Some(Component::RootDir) {
        return None;
    }
    let mut fd = openat(AT_FDCWD, "/", flags | OFlag::O_DIRECTORY, Mode::empty()).ok()?;
    for component in components {
        let Component::Normal(name) = component else {
            return None;
        };
        // Beneath a link's own descriptor, the kernel answers ENOTDIR.
        fd = openat(&fd, name, flags, Mode::empty()).ok()?;
    }
    Some(fd)
}

/// Grants `access` beneath `fd` (opened at `path`), except for what is `kept`: where a
/// kept path lies below, `fd` itself gets nothing and each entry of it is granted the
/// same way, opened beneath `fd`. A symbolic link among them is not followed (its target
/// is granted by its own path, or not at all), and each directory is looked into once
/// (through a bind mount a directory can hold itself). Judged and granted by the same
/// descriptor, so an entry renamed or replaced meanwhile cannot slip in its place.
fn carve(
    fd: OwnedFd,
    path: &Path,
    access: BitFlags<AccessFs>,
    kept: &Kept,
    seen: &mut HashSet<(u64, u64)>,
    allow: &mut dyn FnMut(Grant, BitFlags<AccessFs>) -> Result<(), String>,
) -> Result<(), String> {
    if kept.paths.iter().any(|h| path.starts_with(h)) {
        return Ok(());
    }
    let Ok(stat) = fstat(&fd) else {
        return Ok(());
    };
    let kind = file_kind(&stat);
    let id = (stat.st_dev, stat.st_ino);
    if kind == SFlag::S_IFLNK || kept.ids.contains(&id) {
        return Ok(());
    }
    if !kept.paths.iter().any(|h| h.starts_with(path)) && !kept.holders.contains(&id) {
        let dir = kind == SFlag::S_IFDIR;
        let path = path.to_owned();
        return allow(Grant { path, fd, dir }, access);
    }
    if !seen.insert(id) {
        return Ok(());
    }
    let listing = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC;
    let Ok(mut entries) = Dir::openat(&fd, ".", listing, Mode::empty()) else {
        return Ok(());
    };
    let entry_flags = OFlag::O_PATH | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
    for entry in entries.iter().flatten() {
        let name = entry.file_name();
        if name == c"." || name == c".." {
            continue;
        }
        let Ok(child) = openat(&fd, name, entry_flags, Mode::empty()) else {
            continue;
        };
        let child_path = path.join(OsStr::from_bytes(name.to_bytes()));
        carve(child, &child_path, access, kept, seen, allow)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

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
        let granted = |grants: &[Grant]| {
            let mut names: Vec<_> = grants
                .iter()
                .map(|g| g.path.strip_prefix(&root).unwrap().display().to_string())
                .collect();
            names.sort();
            names
        };
        let grants = carved(&root.join("etc"), &kept);
        assert_eq!(
            granted(&grants),
            ["etc/other/deep", "etc/passwd", "etc/ssl"]
        );
        // Hidden itself, or beneath it: nothing.
        assert!(carved(&root.join("etc/robota-mcpd"), &kept).is_empty());
        // A root that is a link, or lies beneath one: nothing.
        assert!(carved(&root.join("etc/state-link"), &kept).is_empty());
        assert!(open_unfollowed(&root.join("etc/other/ssl-link/x")).is_none());

        // What is granted is what was judged: `etc/ssl` swapped for a link to the kept
        // directory after the carving leaves the grant on the directory that was judged.
        let ssl = grants.iter().find(|g| g.path.ends_with("etc/ssl")).unwrap();
        let judged = std::fs::metadata(root.join("etc/ssl")).unwrap();
        std::fs::rename(root.join("etc/ssl"), root.join("etc/ssl.old")).unwrap();
        std::os::unix::fs::symlink(root.join("etc/robota-mcpd"), root.join("etc/ssl")).unwrap();
        let granted_stat = fstat(&ssl.fd).unwrap();
        assert_eq!(
            (granted_stat.st_dev, granted_stat.st_ino),
            (judged.dev(), judged.ino())
        );
        // And carved again now, the swapped entry is a link: not granted.
        assert_eq!(
            granted(&carved(&root.join("etc"), &kept)),
            ["etc/other/deep", "etc/passwd", "etc/ssl.old"]
        );
    }

    #[test]
    fn a_kept_path_another_user_could_move_is_named() {
        // The tests run as root: uid 65534 stands for any other user.
        let dir = tempfile::tempdir().unwrap();
        let base = canonical(dir.path());
        let theirs = base.join("theirs");
        std::fs::create_dir(&theirs).unwrap();
        nix::unistd::chown(&theirs, Some(nix::unistd::Uid::from_raw(65534)), None).unwrap();
        let state = theirs.join("state");
        std::fs::create_dir(&state).unwrap();
        let named = format!(
            "{} is owned by uid 65534, who could replace {}",
            theirs.display(),
            state.display()
        );
        let why = movable_by_others(&state).expect("named");
        assert!(why.starts_with(&named), "{why}");
        // Moved aside already: still named, by the directory that let it be moved.
        std::fs::rename(&state, theirs.join("elsewhere")).unwrap();
        assert!(movable_by_others(&state).unwrap().starts_with(&named));
        // Beneath root's own directories, or the journal wherever it is: nothing to say.
        let ours = base.join("ours/state");
        std::fs::create_dir_all(&ours).unwrap();
        assert_eq!(movable_by_others(&ours), None);
        assert_eq!(movable_by_others(Path::new("/var/log/journal/x")), None);
        // Written through a link in their directory, to root's own: the link's holder is
        // judged, not only where it leads.
        let link = theirs.join("lnk");
        std::os::unix::fs::symlink(base.join("ours"), &link).unwrap();
        let why = movable_by_others(&link.join("state")).expect("named");
        assert!(
            why.starts_with(&format!("{} is owned by uid 65534", theirs.display())),
            "{why}"
        );
        // Their link in a sticky directory of root's: its owner may point it elsewhere.
        let public = base.join("public");
        std::fs::create_dir(&public).unwrap();
        std::fs::set_permissions(&public, std::fs::Permissions::from_mode(0o1777)).unwrap();
        let their_link = public.join("lnk");
        std::os::unix::fs::symlink("../ours", &their_link).unwrap();
        nix::unistd::fchownat(
            AT_FDCWD,
            &their_link,
            Some(nix::unistd::Uid::from_raw(65534)),
            None,
            nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW,
        )
        .unwrap();
        let why = movable_by_others(&their_link.join("state")).expect("named");
        assert!(
            why.starts_with(&format!(
                "{} is a symbolic link owned by uid 65534",
                their_link.display()
            )),
            "{why}"
        );
        // Root's link, relative, through `..`: followed and judged where it leads.
        let root_link = public.join("root-lnk");
        std::os::unix::fs::symlink("../ours", &root_link).unwrap();
        assert_eq!(movable_by_others(&root_link.join("state")), None);
        // A kept directory of theirs: they may move its entries out.
        let own_state = base.join("ours/their-state");
        std::fs::create_dir(&own_state).unwrap();
        nix::unistd::chown(&own_state, Some(nix::unistd::Uid::from_raw(65534)), None).unwrap();
        let why = movable_by_others(&own_state).expect("named");
        assert!(
            why.starts_with(&format!("{} is owned by uid 65534", own_state.display())),
            "{why}"
        );
    }

    /// What [`carve`] grants for reading beneath `root`.
    fn carved(root: &Path, kept: &Kept) -> Vec<Grant> {
        let mut grants = Vec::new();
        if let Some(fd) = open_unfollowed(root) {
            let read = AccessFs::from_read(NEEDED);
            let mut allow = |g, _| {
                grants.push(g);
                Ok(())
            };
            carve(fd, root, read, kept, &mut HashSet::new(), &mut allow).unwrap();
        }
        grants
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
