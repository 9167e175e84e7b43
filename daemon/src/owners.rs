//! Who could replace a path: the rule the daemon holds the directories above its own
//! paths to (the file tools' roots, the paths it keeps from upstreams); and what kind of
//! file a look at one found.

use std::path::Path;

use nix::sys::stat::{FileStat, Mode, SFlag};
use nix::unistd::Uid;

/// Why `dir` (at `at`, holding `next`) would let someone other than root or `euid` replace
/// `next`; `Ok` when it would not. `what` names what lies beneath, for the message ("a
/// root").
pub fn guards(at: &Path, dir: &FileStat, next: &Path, euid: Uid, what: &str) -> Result<(), String> {
    if dir.st_uid != 0 && dir.st_uid != euid.as_raw() {
        return Err(format!(
            "{} is owned by uid {}, who could replace {} (with a symbolic link, say); the directories above {what} must belong to root or to the daemon's user (uid {euid})",
            at.display(),
            dir.st_uid,
            next.display()
        ));
    }
    let mode = dir.st_mode;
    let sticky = mode & Mode::S_ISVTX.bits() != 0;
    let (group, others) = (mode & 0o020 != 0, mode & 0o002 != 0);
    if (group || others) && !sticky {
        let who = match (group, others) {
            (true, true) => format!("its group (gid {}) and by others", dir.st_gid),
            (true, false) => format!("its group (gid {})", dir.st_gid),
            _ => "others".to_owned(),
        };
        return Err(format!(
            "{} is writable by {who} (mode {:04o}) and not sticky, so another user could replace {}; the directories above {what} must not be",
            at.display(),
            mode & 0o7777,
            next.display()
        ));
    }
    Ok(())
}

/// The kind of file `st` describes (`S_IFDIR`, `S_IFLNK`, `S_IFREG`, …).
pub fn file_kind(st: &FileStat) -> SFlag {
    SFlag::from_bits_truncate(st.st_mode & SFlag::S_IFMT.bits())
}
