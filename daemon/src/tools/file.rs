//! `file.read` and `file.write`: regular files under the configured roots only.
//!
//! Each root is opened once, when the tools are built, by a walk from `/` that follows no
//! symbolic link in any component, and only if nobody but root or the daemon's user could
//! swap a directory above it: every ancestor must belong to root or to the daemon's euid
//! and must not be writable by group or others unless it is sticky (in a sticky directory
//! only an entry's owner may rename it, and that owner is the next ancestor's, checked in
//! turn). The root itself may be writable by its group (that is what a write root is
//! for) but must be a real directory. A root that fails any of this is a configuration
//! error (`check-config` and start-up name its key). The tools then hold the root's
//! descriptor: renaming a component of the root's path, or putting a symbolic link in its
//! place, after start-up changes nothing; every path resolves beneath the held directory.
//!
//! A path is first checked lexically (absolute, no `..`, no NUL, under one configured root;
//! the longest matching root wins), then the kernel resolves it beneath a descriptor of
//! that root with `openat2(RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS)`. A symbolic link may
//! lead elsewhere inside the root (relative targets only: an absolute target counts as an
//! escape), never out of it. Only regular files are read or written: a FIFO, device,
//! socket or directory is refused, and is looked at through an `O_PATH` descriptor first so
//! that it is never opened.
//!
//! A final path component that is a symbolic link: `file.read` follows it (beneath the
//! root); `file.write` refuses it, so a write always replaces a regular file in the
//! directory the caller named and never re-targets or replaces a link.
//!
//! `file.write` never edits in place. It writes a temp file (`.<name>.<random>.robota-tmp`,
//! created `O_EXCL`) in the target's directory, fsyncs it, renames it over the target (no
//! replace when the target was absent) and fsyncs the directory: a reader, or a crash,
//! sees the old content or the new, never a mix. Every step after resolution is an `*at`
//! call on the directory's descriptor, so a symlink swapped in after the check cannot
//! redirect the write. An overwritten file keeps its owner and its `rwx` permission bits
//! (set-id and sticky bits are not carried over).

use std::fs::File;
use std::io::{self, Read as _, Write as _};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use nix::errno::Errno;
use nix::fcntl::{AtFlags, OFlag, OpenHow, RenameFlags, ResolveFlag};
use nix::sys::stat::{FileStat, Mode, SFlag};
use nix::unistd::{Gid, Uid, UnlinkatFlags};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use super::{internal, invalid};
use crate::catalog::{Annotations, HostTool, ToolFuture, ToolSpec, TypedTool};
use crate::catalog::{ToolContext, ToolError, ToolOutput};
use crate::config::{ConfigIssue, FileTool, NewFiles};
use crate::vocab::ToolErrorCode;

/// Longest path a caller may name (PATH_MAX).
const MAX_PATH: usize = 4096;
/// Every temp file's name ends with this.
const TEMP_SUFFIX: &str = ".robota-tmp";
/// Bytes of the target's name kept in a temp file's name (NAME_MAX is 255).
const TEMP_NAME_KEEP: usize = 200;
/// How often a resolution that `openat2` could not prove safe (`EAGAIN`, a concurrent
/// rename) is retried before the caller is told to retry.
const RESOLVE_RETRIES: usize = 16;
/// Permission bits an overwritten file keeps.
const KEPT_MODE_BITS: u32 = 0o777;
/// Mode of a temp file when it is made: owner only, until its identity is set (before
/// any content is written).
const TEMP_FILE_MODE: u32 = 0o600;

/// The two tools over the configured roots; each problem with a root is an issue naming
/// its key (`tools.file.write_roots[0]`).
pub fn tools(config: &FileTool) -> Result<Vec<Arc<dyn HostTool>>, Vec<ConfigIssue>> {
    let files = Arc::new(Files::new(config)?);
    Ok(vec![
        Arc::new(ReadTool(Arc::clone(&files))),
        Arc::new(WriteTool(files)),
    ])
}

/// A configured root and the directory descriptor opened for it at start-up.
#[derive(Debug, Clone)]
struct Root {
    path: PathBuf,
    /// `O_PATH | O_DIRECTORY`: every resolution starts here, never at `path`.
    dir: Arc<OwnedFd>,
}

impl AsRef<Path> for Root {
    fn as_ref(&self) -> &Path {
        &self.path
    }
}

/// What the two tools share: the roots and the size caps.
#[derive(Debug)]
/// What was kept of a replaced file's identity.
struct Kept {
    owner: bool,
    group: bool,
}

#[derive(Debug)]
struct Files {
    /// Read roots, then write roots (write roots are readable too), without repeats.
    readable: Vec<Root>,
    writable: Vec<Root>,
    max_read: u64,
    max_write: u64,
    new_files: std::collections::BTreeMap<PathBuf, NewFiles>,
}

impl Files {
    /// Opens every root once (a root listed twice shares one descriptor).
    fn new(config: &FileTool) -> Result<Self, Vec<ConfigIssue>> {
        let mut opened: Vec<(&PathBuf, Option<Root>)> = Vec::new();
        let mut issues = Vec::new();
        let (mut readable, mut writable) = (Vec::<Root>::new(), Vec::new());
        let lists = [
            ("tools.file.read_roots", &config.read_roots, false),
            ("tools.file.write_roots", &config.write_roots, true),
        ];
        for (key, paths, write) in lists {
            for (i, path) in paths.iter().enumerate() {
                let root = match opened.iter().find(|(p, _)| *p == path) {
                    Some((_, root)) => root.clone(),
                    None => {
                        let root = match open_root(path) {
                            Ok(dir) => Some(Root {
                                path: path.clone(),
                                dir: Arc::new(dir),
                            }),
                            Err(problem) => {
                                issues.push(ConfigIssue {
                                    path: format!("{key}[{i}]"),
                                    problem: format!("{}: {problem}", path.display()),
                                    at: None,
                                });
                                None
                            }
                        };
                        opened.push((path, root.clone()));
                        root
                    }
                };
                let Some(root) = root else { continue };
                if !readable.iter().any(|r| r.path == root.path) {
                    readable.push(root.clone());
                }
                if write {
                    writable.push(root);
                }
            }
        }
        if !issues.is_empty() {
            return Err(issues);
        }
        Ok(Self {
            readable,
            writable,
            max_read: config.max_read,
            max_write: config.max_write,
            new_files: config.new_files.clone(),
        })
    }
}

/// Opens `root` from `/` one component at a time, following no symbolic link, after
/// checking that nobody but root or the daemon's user could swap the component: the
/// directory holding it belongs to one of them and is not writable by group or others
/// (unless sticky). The answer is the root's `O_PATH` descriptor, or why not.
fn open_root(root: &Path) -> Result<OwnedFd, String> {
    let walk = OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
    let mut at = PathBuf::from("/");
    let mut dir = nix::fcntl::open(&at, walk, Mode::empty())
        .map_err(|e| format!("cannot open /: {}", e.desc()))?;
    let names: Vec<_> = root
        .components()
        .filter_map(|c| match c {
            Component::Normal(name) => Some(name),
            _ => None,
        })
        .collect();
    for (i, name) in names.iter().enumerate() {
        let next = at.join(name);
        // The message is about the root itself ("does not exist") or names the component.
        let which = if i + 1 == names.len() {
            String::new()
        } else {
            format!("{} ", next.display())
        };
        let st = nix::sys::stat::fstat(&dir)
            .map_err(|e| format!("cannot inspect {}: {}", at.display(), e.desc()))?;
        crate::owners::guards(&at, &st, &next, nix::unistd::geteuid(), "a root")?;
        dir = match nix::fcntl::openat(&dir, *name, walk, Mode::empty()) {
            Ok(fd) => fd,
            Err(Errno::ENOENT) => return Err(format!("{which}does not exist")),
            Err(Errno::ENOTDIR | Errno::ELOOP) => {
                let link = nix::sys::stat::fstatat(&dir, *name, AtFlags::AT_SYMLINK_NOFOLLOW)
                    .is_ok_and(|st| crate::owners::file_kind(&st) == SFlag::S_IFLNK);
                return Err(if link {
                    format!(
                        "{which}is a symbolic link; name the directory it leads to (a root and the directories above it are never reached through a link)"
                    )
                } else {
                    format!("{which}is not a directory")
                });
            }
            Err(e) => return Err(format!("cannot open {}: {}", next.display(), e.desc())),
        };
        at = next;
    }
    Ok(dir)
}

fn denied(message: String) -> ToolError {
    ToolError::new(ToolErrorCode::PermissionDenied, message)
}

fn unavailable(message: impl Into<String>) -> ToolError {
    ToolError::new(ToolErrorCode::Unavailable, message)
}

fn no_roots() -> ToolError {
    unavailable("no file roots are configured on this host")
}

fn show_roots<R: AsRef<Path>>(roots: &[R]) -> String {
    roots
        .iter()
        .map(|r| r.as_ref().display().to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

/// `text` (UTF-8) or `base64` (standard alphabet, padded).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
enum Encoding {
    #[default]
    Text,
    Base64,
}

impl Encoding {
    fn as_str(self) -> &'static str {
        match self {
            Encoding::Text => "text",
            Encoding::Base64 => "base64",
        }
    }
}

/// A caller's path placed under the configured root it lies in.
#[derive(Debug)]
struct Target<'r, R = Root> {
    /// As the caller wrote it, for messages.
    shown: String,
    root: &'r R,
    /// The path's components below the root; empty for the root itself.
    rel: PathBuf,
}

/// The lexical checks: absolute, no NUL, no `..`, under one of `roots` (the longest match).
fn locate<'r, R: AsRef<Path>>(
    path: &str,
    roots: &'r [R],
    which: &str,
) -> Result<Target<'r, R>, ToolError> {
    if path.contains('\0') {
        return Err(invalid("path must not contain a NUL character"));
    }
    if path.len() > MAX_PATH {
        return Err(invalid(format!("path is longer than {MAX_PATH} bytes")));
    }
    if path.len() > 1 && (path.ends_with('/') || path.ends_with("/.")) {
        return Err(invalid(format!(
            "{path} ends with a directory separator, so it does not name a regular file"
        )));
    }
    let p = Path::new(path);
    if !p.is_absolute() {
        return Err(invalid(format!("path must be absolute, got {path:?}")));
    }
    if p.components().any(|c| c == Component::ParentDir) {
        return Err(invalid(format!(
            "path must not contain `..` components: {path}"
        )));
    }
    let best = roots
        .iter()
        .filter_map(|root| p.strip_prefix(root).ok().map(|rest| (root, rest)))
        .max_by_key(|(root, _)| root.as_ref().components().count());
    let Some((root, rest)) = best else {
        return Err(denied(format!(
            "{path} is outside the configured {which} roots ({})",
            show_roots(roots)
        )));
    };
    let rel = rest
        .components()
        .filter(|c| matches!(c, Component::Normal(_)))
        .collect();
    Ok(Target {
        shown: path.to_owned(),
        root,
        rel,
    })
}

/// `openat2` beneath `dir`: symbolic links and `..` inside `rel`'s resolution may not
/// leave `dir` (`EXDEV`), magic links (`/proc/*/fd/*`) are not followed.
fn resolve(dir: BorrowedFd<'_>, rel: &Path, flags: OFlag) -> nix::Result<OwnedFd> {
    let rel = if rel.as_os_str().is_empty() {
        Path::new(".")
    } else {
        rel
    };
    let how = OpenHow::new()
        .flags(flags | OFlag::O_CLOEXEC)
        .resolve(ResolveFlag::RESOLVE_BENEATH | ResolveFlag::RESOLVE_NO_MAGICLINKS);
    let mut tries = 0;
    loop {
        match nix::fcntl::openat2(dir, rel, how) {
            Err(Errno::EAGAIN) if tries < RESOLVE_RETRIES => tries += 1,
            other => return other,
        }
    }
}

fn escapes(t: &Target<'_>) -> ToolError {
    denied(format!(
        "{} escapes the root {} through a symbolic link",
        t.shown,
        t.root.path.display()
    ))
}

/// A failed resolution of `t`, as the caller sees it.
fn resolve_error(t: &Target<'_>, e: Errno) -> ToolError {
    match e {
        Errno::ENOENT => invalid(format!("no such file: {}", t.shown)),
        Errno::ENOTDIR => invalid(format!(
            "no such file: {} (a component of the path is not a directory)",
            t.shown
        )),
        Errno::EXDEV => escapes(t),
        Errno::ELOOP => invalid(format!(
            "{} cannot be resolved: too many symbolic links, or a link the daemon does not follow",
            t.shown
        )),
        Errno::EAGAIN => ToolError::new(
            ToolErrorCode::Busy,
            format!("{} kept changing while it was resolved; retry", t.shown),
        ),
        Errno::ENOSYS => {
            unavailable("the file tools need openat2, which this kernel lacks (Linux 5.6 or later)")
        }
        other => host_error(t, other, "open"),
    }
}

/// A failed host operation on `t` (`what` is a verb: "open", "read", "write").
fn host_error(t: &Target<'_>, e: Errno, what: &str) -> ToolError {
    match e {
        Errno::EACCES | Errno::EPERM => denied(format!(
            "the host does not let the daemon {what} {}",
            t.shown
        )),
        Errno::EROFS => denied(format!("{} is on a read-only filesystem", t.shown)),
        Errno::ENOSPC | Errno::EDQUOT => {
            unavailable(format!("no space left on the filesystem of {}", t.shown))
        }
        Errno::EISDIR => not_regular(t, "directory"),
        // The caller's path is not one this filesystem can hold.
        Errno::ENAMETOOLONG => invalid(format!(
            "a component of {} is longer than the filesystem allows (255 bytes on most)",
            t.shown
        )),
        Errno::EILSEQ => invalid(format!("{} is not a valid name on its filesystem", t.shown)),
        other => internal(&format!("file {what}"), other),
    }
}

fn io_error(t: &Target<'_>, e: &io::Error, what: &str) -> ToolError {
    match e.raw_os_error() {
        Some(code) => host_error(t, Errno::from_raw(code), what),
        None => internal(&format!("file {what}"), e),
    }
}

fn not_regular(t: &Target<'_>, kind: &str) -> ToolError {
    invalid(format!(
        "{} is not a regular file (it is a {kind})",
        t.shown
    ))
}

fn ensure_regular(t: &Target<'_>, st: &FileStat) -> Result<(), ToolError> {
    let kind = match crate::owners::file_kind(st) {
        SFlag::S_IFREG => return Ok(()),
        SFlag::S_IFDIR => "directory",
        SFlag::S_IFIFO => "FIFO",
        SFlag::S_IFSOCK => "socket",
        SFlag::S_IFCHR => "character device",
        SFlag::S_IFBLK => "block device",
        SFlag::S_IFLNK => "symbolic link",
        _ => "special file",
    };
    Err(not_regular(t, kind))
}

/// Opens `t` for reading when it is a regular file beneath its root. The kind is checked
/// on an `O_PATH` descriptor first, which opens nothing; the real open then carries
/// `O_NONBLOCK | O_NOCTTY`, so a FIFO or terminal swapped in meanwhile neither blocks nor
/// becomes the daemon's terminal, and is refused by the second check.
fn open_regular(root: BorrowedFd<'_>, t: &Target<'_>) -> Result<(File, FileStat), ToolError> {
    let probe = resolve(root, &t.rel, OFlag::O_PATH).map_err(|e| resolve_error(t, e))?;
    let st = nix::sys::stat::fstat(&probe).map_err(|e| host_error(t, e, "inspect"))?;
    ensure_regular(t, &st)?;
    let fd = resolve(
        root,
        &t.rel,
        OFlag::O_RDONLY | OFlag::O_NONBLOCK | OFlag::O_NOCTTY,
    )
    .map_err(|e| resolve_error(t, e))?;
    let st = nix::sys::stat::fstat(&fd).map_err(|e| host_error(t, e, "inspect"))?;
    ensure_regular(t, &st)?;
    Ok((File::from(fd), st))
}

/// The whole file from its start, if it holds at most `limit` bytes.
fn read_whole(file: &File, limit: u64) -> io::Result<Option<Vec<u8>>> {
    let mut buf = Vec::new();
    file.take(limit.saturating_add(1)).read_to_end(&mut buf)?;
    Ok((buf.len() as u64 <= limit).then_some(buf))
}

/// Up to `length` bytes from `offset` (fewer at the end of the file).
fn read_range(file: &File, offset: u64, length: u64) -> io::Result<Vec<u8>> {
    let mut buf = vec![0; usize::try_from(length).unwrap_or(usize::MAX)];
    let mut filled = 0;
    while filled < buf.len() {
        match file.read_at(&mut buf[filled..], offset + filled as u64) {
            Ok(0) => break,
            Ok(n) => filled += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    buf.truncate(filled);
    Ok(buf)
}

fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

/// `file.read` arguments.
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct ReadArgs {
    /// Absolute path under one of this host's file roots; no `..` components.
    #[schemars(length(min = 1, max = MAX_PATH))]
    path: String,
    /// Byte offset to start at.
    #[serde(default)]
    offset: u64,
    /// Bytes to return at most (default and ceiling: the read limit).
    length: Option<u64>,
    /// How to return the content: `text` (UTF-8) or `base64`.
    #[serde(default)]
    encoding: Encoding,
}

impl Files {
    fn read(&self, req: &ReadArgs) -> Result<Value, ToolError> {
        if self.readable.is_empty() {
            return Err(no_roots());
        }
        let length = match req.length {
            Some(n) if n > self.max_read => {
                return Err(invalid(format!(
                    "length {n} is over the read limit of {} bytes (tools.file.max_read); read in pieces with offset",
                    self.max_read
                )));
            }
            Some(n) => n,
            None => self.max_read,
        };
        let t = locate(&req.path, &self.readable, "read")?;
        let (file, st) = open_regular(t.root.dir.as_fd(), &t)?;
        let stat_size = u64::try_from(st.st_size).unwrap_or(0);
        // A file that fits the read limit is read whole: its hash describes exactly the
        // bytes the range is cut from, even if it changes meanwhile.
        let whole = if stat_size <= self.max_read {
            read_whole(&file, self.max_read).map_err(|e| io_error(&t, &e, "read"))?
        } else {
            None
        };
        let (size, sha256, content) = match whole {
            Some(bytes) => {
                let start = usize::try_from(req.offset)
                    .unwrap_or(usize::MAX)
                    .min(bytes.len());
                let end = start
                    .saturating_add(usize::try_from(length).unwrap_or(usize::MAX))
                    .min(bytes.len());
                let content = bytes[start..end].to_vec();
                (bytes.len() as u64, Some(sha256_hex(&bytes)), content)
            }
            None if req.offset >= stat_size => (stat_size, None, Vec::new()),
            None => {
                let content =
                    read_range(&file, req.offset, length).map_err(|e| io_error(&t, &e, "read"))?;
                (stat_size, None, content)
            }
        };
        let returned = content.len() as u64;
        let content = match req.encoding {
            Encoding::Base64 => BASE64.encode(&content),
            Encoding::Text => String::from_utf8(content).map_err(|e| {
                invalid(format!(
                    "{} is not UTF-8 text (at byte {}); read it with encoding \"base64\"",
                    t.shown,
                    req.offset + e.utf8_error().valid_up_to() as u64
                ))
            })?,
        };
        Ok(json!({
            "path": t.shown,
            "size": size,
            "offset": req.offset,
            "length": returned,
            "encoding": req.encoding.as_str(),
            "content": content,
            "sha256": sha256,
            "eof": req.offset.saturating_add(returned) >= size,
        }))
    }
}

/// What `file.write` does with an existing file.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
enum WriteMode {
    // (Plain comments: doc comments on the variants would turn the schema's `enum` into a
    // `oneOf` of constants.)
    // Only a new file; an existing one is refused.
    #[default]
    Create,
    // Replace the content (a missing file is created).
    Overwrite,
    // Old content followed by the new, replaced atomically (a missing file is created).
    Append,
}

impl WriteMode {
    fn as_str(self) -> &'static str {
        match self {
            WriteMode::Create => "create",
            WriteMode::Overwrite => "overwrite",
            WriteMode::Append => "append",
        }
    }
}

/// `file.write` arguments (the session has taken the idempotency key out).
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct WriteArgs {
    /// Absolute path under one of this host's write roots; no `..` components.
    #[schemars(length(min = 1, max = MAX_PATH))]
    path: String,
    /// The bytes to write, encoded as `encoding` says.
    content: String,
    /// How `content` is encoded: `text` (UTF-8) or `base64`.
    #[serde(default)]
    encoding: Encoding,
    /// `create` (the file must not exist), `overwrite` or `append` (both create a missing file).
    #[serde(default)]
    mode: WriteMode,
    /// Hex SHA-256 the file's current content must have (as file.read reports it); otherwise nothing is written.
    #[schemars(regex(pattern = r"^[0-9a-fA-F]{64}$"))]
    expected_sha256: Option<String>,
}

/// The file a write is about to replace.
struct Current {
    stat: FileStat,
    /// Its bytes, when appending.
    content: Option<Vec<u8>>,
    /// Its SHA-256, when a precondition names one.
    sha256: Option<String>,
}

/// A write refused because the final component is a symbolic link: an escape if the link
/// leaves the root, else a plain refusal.
fn symlink_refusal(root: BorrowedFd<'_>, t: &Target<'_>) -> ToolError {
    match resolve(root, &t.rel, OFlag::O_PATH) {
        Err(Errno::EXDEV) => escapes(t),
        _ => invalid(format!(
            "{} is a symbolic link; file.write replaces regular files only, so name the link's target",
            t.shown
        )),
    }
}

/// A temp file beside the target; removed on drop unless it was renamed into place.
struct TempFile<'d> {
    dir: BorrowedFd<'d>,
    name: String,
    file: File,
    renamed: bool,
}

/// Held from reading a file's current content to renaming its replacement in place.
static WRITES: parking_lot::Mutex<()> = parking_lot::Mutex::new(());

/// `.<target name>.<16 hex>.robota-tmp`, at most 255 bytes.
fn temp_name(target: &str) -> String {
    let mut keep = target.len().min(TEMP_NAME_KEEP);
    while !target.is_char_boundary(keep) {
        keep -= 1;
    }
    let mut random = [0u8; 8];
    if getrandom::fill(&mut random).is_err() {
        // O_EXCL still refuses a collision; this only makes one unlikely.
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        random = (nanos ^ u64::from(std::process::id())).to_le_bytes();
    }
    format!(".{}.{}{TEMP_SUFFIX}", &target[..keep], hex::encode(random))
}

impl<'d> TempFile<'d> {
    fn create(dir: BorrowedFd<'d>, target: &str) -> nix::Result<Self> {
        let mut last = Errno::EEXIST;
        for _ in 0..8 {
            let name = temp_name(target);
            match nix::fcntl::openat(
                dir,
                name.as_str(),
                OFlag::O_WRONLY
                    | OFlag::O_CREAT
                    | OFlag::O_EXCL
                    | OFlag::O_NOFOLLOW
                    | OFlag::O_CLOEXEC,
                Mode::from_bits_truncate(TEMP_FILE_MODE),
            ) {
                Ok(fd) => {
                    return Ok(Self {
                        dir,
                        name,
                        file: File::from(fd),
                        renamed: false,
                    });
                }
                Err(Errno::EEXIST) => last = Errno::EEXIST,
                Err(e) => return Err(e),
            }
        }
        Err(last)
    }

    /// Gives the (still empty) temp file the overwritten file's owner, group and
    /// permission bits. The bits are always kept; the owner and group as far as the
    /// daemon may (an unprivileged daemon cannot give a file away, but can give it a
    /// group it is a member of), and the caller is told which.
    fn keep_identity(&self, old: &FileStat) -> nix::Result<Kept> {
        let (uid, gid) = (Uid::from_raw(old.st_uid), Gid::from_raw(old.st_gid));
        let mut kept = Kept {
            owner: true,
            group: true,
        };
        if (uid != nix::unistd::geteuid() || gid != nix::unistd::getegid())
            && let Err(e) = nix::unistd::fchown(&self.file, Some(uid), Some(gid))
        {
            kept.owner = uid == nix::unistd::geteuid();
            kept.group = nix::unistd::fchown(&self.file, None, Some(gid)).is_ok();
            tracing::warn!(error = %e, owner_kept = kept.owner, group_kept = kept.group, "cannot keep the owner of an overwritten file");
        }
        nix::sys::stat::fchmod(
            &self.file,
            Mode::from_bits_truncate(old.st_mode & KEPT_MODE_BITS),
        )?;
        Ok(kept)
    }

    /// Gives the (still empty) temp file of a new file the mode and group `made` names;
    /// with no group named, the group of `dir` when the daemon may give it. Returns the
    /// group the file has. A group that was named but cannot be given fails the write.
    fn new_identity(&self, made: &NewFiles, dir: &FileStat) -> Result<u32, String> {
        let mine = nix::unistd::getegid().as_raw();
        let gid = match made.gid {
            Some(gid) if gid != mine => {
                nix::unistd::fchown(&self.file, None, Some(Gid::from_raw(gid))).map_err(|e| {
                    format!(
                        "the new file cannot be given group {gid} (tools.file.new_files): {}; the daemon's user must be a member of it",
                        e.desc()
                    )
                })?;
                gid
            }
            Some(gid) => gid,
            None if dir.st_gid != mine => {
                match nix::unistd::fchown(&self.file, None, Some(Gid::from_raw(dir.st_gid))) {
                    Ok(()) => dir.st_gid,
                    Err(_) => mine,
                }
            }
            None => mine,
        };
        // Not subject to the umask: the root's settings are what the operator asked for.
        nix::sys::stat::fchmod(&self.file, Mode::from_bits_truncate(made.mode))
            .map_err(|e| format!("cannot set the new file's mode: {}", e.desc()))?;
        Ok(gid)
    }

    /// Renames the temp file to `target`; without `replace`, an existing `target` is kept
    /// and the rename fails with `EEXIST`.
    fn install(&mut self, target: &str, replace: bool) -> nix::Result<()> {
        let flags = if replace {
            RenameFlags::empty()
        } else {
            RenameFlags::RENAME_NOREPLACE
        };
        match nix::fcntl::renameat2(self.dir, self.name.as_str(), self.dir, target, flags) {
            Ok(()) => {
                self.renamed = true;
                Ok(())
            }
            // A filesystem without RENAME_NOREPLACE: link(2) never replaces either; the
            // temp name is then removed on drop.
            Err(Errno::EINVAL) if !replace => nix::unistd::linkat(
                self.dir,
                self.name.as_str(),
                self.dir,
                target,
                AtFlags::empty(),
            ),
            Err(e) => Err(e),
        }
    }
}

impl Drop for TempFile<'_> {
    fn drop(&mut self) {
        if !self.renamed
            && let Err(e) =
                nix::unistd::unlinkat(self.dir, self.name.as_str(), UnlinkatFlags::NoRemoveDir)
        {
            tracing::warn!(error = %e, temp = %self.name, "cannot remove a temp file");
        }
    }
}

impl Files {
    fn write(&self, req: &WriteArgs) -> Result<Value, ToolError> {
        if self.writable.is_empty() {
            return Err(if self.readable.is_empty() {
                no_roots()
            } else {
                unavailable("no file write roots are configured on this host")
            });
        }
        let t = locate(&req.path, &self.writable, "write")?;
        let data = match req.encoding {
            Encoding::Text => req.content.as_bytes().to_vec(),
            Encoding::Base64 => BASE64
                .decode(req.content.as_bytes())
                .map_err(|e| invalid(format!("content is not valid base64: {e}")))?,
        };
        if data.len() as u64 > self.max_write {
            return Err(invalid(format!(
                "content is {} bytes, over the write limit of {} bytes (tools.file.max_write)",
                data.len(),
                self.max_write
            )));
        }
        let (Some(name), Some(parent)) =
            (t.rel.file_name().and_then(|n| n.to_str()), t.rel.parent())
        else {
            return Err(not_regular(&t, "directory"));
        };
        let root = t.root.dir.as_fd();
        let dir =
            resolve(root, parent, OFlag::O_RDONLY | OFlag::O_DIRECTORY).map_err(|e| match e {
                Errno::ENOENT | Errno::ENOTDIR => {
                    invalid(format!("the directory of {} does not exist", t.shown))
                }
                other => resolve_error(&t, other),
            })?;

        // From reading the current file to the rename, writes are serialized: two appends,
        // or two writes with the same expected_sha256, must not both win.
        let _serial = WRITES.lock();
        let current = self.current(root, dir.as_fd(), &t, name, req, data.len())?;
        if req.mode == WriteMode::Create && current.is_some() {
            return Err(invalid(format!(
                "{} already exists; use mode \"overwrite\" or \"append\" to change it",
                t.shown
            )));
        }
        if let Some(expected) = req.expected_sha256.as_deref().map(str::to_ascii_lowercase) {
            match &current {
                None => {
                    return Err(invalid(format!(
                        "{} does not exist, so it cannot have the expected_sha256 {expected}; nothing was written",
                        t.shown
                    )));
                }
                Some(c) if c.sha256.as_deref() != Some(expected.as_str()) => {
                    return Err(invalid(format!(
                        "{} has sha256 {}, not the expected {expected}; nothing was written",
                        t.shown,
                        c.sha256.as_deref().unwrap_or("unknown")
                    )));
                }
                Some(_) => {}
            }
        }
        let new = match current.as_ref().and_then(|c| c.content.as_ref()) {
            Some(old) => [old.as_slice(), &data].concat(),
            None => data,
        };

        let mut temp =
            TempFile::create(dir.as_fd(), name).map_err(|e| host_error(&t, e, "write"))?;
        // Owner and mode before the content: the bytes never sit in a file more open than
        // the one they replace, or than its root's settings ask for.
        let identity = match &current {
            Some(c) => {
                let kept = temp
                    .keep_identity(&c.stat)
                    .map_err(|e| host_error(&t, e, "write"))?;
                json!({
                    "owner_kept": kept.owner && kept.group,
                    "kept": {"owner": kept.owner, "group": kept.group, "mode": true},
                })
            }
            None => {
                let made = self
                    .new_files
                    .get(&t.root.path)
                    .cloned()
                    .unwrap_or_default();
                let dir_stat =
                    nix::sys::stat::fstat(&dir).map_err(|e| host_error(&t, e, "write"))?;
                let gid = temp
                    .new_identity(&made, &dir_stat)
                    .map_err(|m| unavailable(format!("{}: {m}", t.shown)))?;
                json!({"created": {"mode": format!("{:04o}", made.mode), "gid": gid}})
            }
        };
        temp.file
            .write_all(&new)
            .map_err(|e| io_error(&t, &e, "write"))?;
        temp.file
            .sync_all()
            .map_err(|e| io_error(&t, &e, "write"))?;
        temp.install(name, current.is_some()).map_err(|e| match e {
            Errno::EEXIST if req.mode == WriteMode::Create => invalid(format!(
                "{} already exists; use mode \"overwrite\" or \"append\" to change it",
                t.shown
            )),
            Errno::EEXIST => invalid(format!(
                "{} was created by someone else during this write; nothing was written, retry",
                t.shown
            )),
            Errno::EISDIR | Errno::ENOTEMPTY => not_regular(&t, "directory"),
            Errno::EBUSY => invalid(format!(
                "{} is a mount point and cannot be replaced",
                t.shown
            )),
            other => host_error(&t, other, "write"),
        })?;
        // The new content is in place: a failure from here on is not "no effect".
        nix::unistd::fsync(&dir).map_err(|e| {
            tracing::error!(error = %e, path = %t.shown, "directory fsync failed after the rename");
            ToolError::new(
                ToolErrorCode::Internal,
                format!("{} was written, but its directory could not be synced: durability is not confirmed", t.shown),
            )
        })?;
        drop(temp);
        let mut answer = json!({
            "path": t.shown,
            "size": new.len(),
            "sha256": sha256_hex(&new),
            "mode": req.mode.as_str(),
        });
        if let (Some(out), Some(extra)) = (answer.as_object_mut(), identity.as_object()) {
            out.extend(extra.clone());
        }
        Ok(answer)
    }

    /// The regular file `name` in `dir` as it is now, `None` when there is none. Reads its
    /// content when appending (bounded by the write limit) and hashes it when a
    /// precondition needs that.
    fn current(
        &self,
        root: BorrowedFd<'_>,
        dir: BorrowedFd<'_>,
        t: &Target<'_>,
        name: &str,
        req: &WriteArgs,
        adding: usize,
    ) -> Result<Option<Current>, ToolError> {
        let st = match nix::sys::stat::fstatat(dir, name, AtFlags::AT_SYMLINK_NOFOLLOW) {
            Ok(st) => st,
            Err(Errno::ENOENT) => return Ok(None),
            Err(e) => return Err(host_error(t, e, "inspect")),
        };
        if crate::owners::file_kind(&st) == SFlag::S_IFLNK {
            return Err(symlink_refusal(root, t));
        }
        ensure_regular(t, &st)?;
        let needs_bytes = req.mode == WriteMode::Append
            || (req.mode == WriteMode::Overwrite && req.expected_sha256.is_some());
        if !needs_bytes {
            return Ok(Some(Current {
                stat: st,
                content: None,
                sha256: None,
            }));
        }
        let fd = match nix::fcntl::openat(
            dir,
            name,
            OFlag::O_RDONLY
                | OFlag::O_NOFOLLOW
                | OFlag::O_NONBLOCK
                | OFlag::O_NOCTTY
                | OFlag::O_CLOEXEC,
            Mode::empty(),
        ) {
            Ok(fd) => fd,
            Err(Errno::ENOENT) => return Ok(None),
            Err(Errno::ELOOP) => return Err(symlink_refusal(root, t)),
            Err(e) => return Err(host_error(t, e, "open")),
        };
        let st = nix::sys::stat::fstat(&fd).map_err(|e| host_error(t, e, "inspect"))?;
        ensure_regular(t, &st)?;
        let file = File::from(fd);
        let mut current = Current {
            stat: st,
            content: None,
            sha256: None,
        };
        if req.mode == WriteMode::Append {
            let room = self.max_write.saturating_sub(adding as u64);
            let Some(old) = read_whole(&file, room).map_err(|e| io_error(t, &e, "read"))? else {
                return Err(invalid(format!(
                    "appending {adding} bytes to {} ({} bytes) would go over the write limit of {} bytes (tools.file.max_write)",
                    t.shown, st.st_size, self.max_write
                )));
            };
            current.sha256 = Some(sha256_hex(&old));
            current.content = Some(old);
        } else if req.expected_sha256.is_some() {
            let mut hasher = Sha256::new();
            io::copy(&mut &file, &mut hasher).map_err(|e| io_error(t, &e, "read"))?;
            current.sha256 = Some(hex::encode(hasher.finalize()));
        }
        Ok(Some(current))
    }
}

/// Runs blocking file work off the async threads.
async fn blocking<F>(work: F) -> Result<ToolOutput, ToolError>
where
    F: FnOnce() -> Result<Value, ToolError> + Send + 'static,
{
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|e| internal("the file task", e))?
        .map(ToolOutput::Structured)
}

struct ReadTool(Arc<Files>);

impl TypedTool for ReadTool {
    type Args = ReadArgs;

    fn spec(&self) -> ToolSpec {
        let f = &self.0;
        let roots = if f.readable.is_empty() {
            "No file roots are configured on this host, so calls answer `unavailable`.".to_owned()
        } else {
            format!("Readable roots: {}.", show_roots(&f.readable))
        };
        ToolSpec::typed::<Self::Args>(
            "file.read",
            format!(
                "Read a regular file under this host's file roots. {roots} Returns up to `length` bytes (default and ceiling {max} bytes) from `offset` as UTF-8 text or base64, the file's `size`, `eof`, and `sha256` of the whole file when it is at most {max} bytes (pass it to file.write as expected_sha256). Symbolic links are followed only while they stay inside the root (relative link targets only).",
                max = f.max_read
            ),
            Annotations::READ_ONLY,
        )
        .describe(
            "length",
            format!(
                "Bytes to return at most (default and ceiling {}).",
                f.max_read
            ),
        )
    }

    fn run<'a>(&'a self, _ctx: &'a ToolContext<'a>, args: ReadArgs) -> ToolFuture<'a> {
        let files = Arc::clone(&self.0);
        Box::pin(blocking(move || files.read(&args)))
    }
}

struct WriteTool(Arc<Files>);

impl TypedTool for WriteTool {
    type Args = WriteArgs;

    fn spec(&self) -> ToolSpec {
        let f = &self.0;
        let roots = if f.writable.is_empty() {
            "No write roots are configured on this host, so calls answer `unavailable`.".to_owned()
        } else {
            format!("Write roots: {}.", show_roots(&f.writable))
        };
        ToolSpec::typed::<Self::Args>(
            "file.write",
            format!(
                "Write a regular file under this host's write roots, atomically: readers see the old or the new content, never a mix. {roots} `mode` is `create` (default; the file must not exist), `overwrite` or `append` (both create a missing file). At most {max} bytes of content, and of the file after an append. `expected_sha256` makes the write conditional on the current content. Symbolic links as the last path component are refused. A replaced file keeps its permission bits, and its owner and group as far as the daemon may (the answer's `kept` says which); a new file gets its root's configured mode and group (the answer's `created`).",
                max = f.max_write
            ),
            Annotations {
                read_only: false,
                destructive: true,
                idempotent: false,
                self_service: false,
                replay_safe: true,
            },
        )
    }

    fn run<'a>(&'a self, _ctx: &'a ToolContext<'a>, args: WriteArgs) -> ToolFuture<'a> {
        let files = Arc::clone(&self.0);
        Box::pin(blocking(move || files.write(&args)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{PermissionsExt, symlink};
    use std::time::{Duration, Instant};

    /// A temp tree: `rw/` (write root), `ro/` (read root), `outside/secret`.
    struct Tree {
        dir: tempfile::TempDir,
        files: Files,
    }

    const SECRET: &str = "outside secret";

    impl Tree {
        fn new() -> Self {
            Self::with_limits(1024, 1024)
        }

        fn with_limits(max_read: u64, max_write: u64) -> Self {
            let dir = tempfile::tempdir().unwrap();
            for sub in ["rw", "ro", "outside"] {
                std::fs::create_dir(dir.path().join(sub)).unwrap();
            }
            std::fs::write(dir.path().join("outside/secret"), SECRET).unwrap();
            let files = Files::new(&FileTool {
                read_roots: vec![dir.path().join("ro")],
                write_roots: vec![dir.path().join("rw")],
                max_read,
                max_write,
                new_files: Default::default(),
            })
            .expect("the roots open");
            Tree { dir, files }
        }

        fn path(&self, rel: &str) -> String {
            self.dir.path().join(rel).display().to_string()
        }

        fn read(&self, rel: &str, extra: Value) -> Result<Value, ToolError> {
            let mut args = json!({"path": self.path(rel)});
            merge(&mut args, extra);
            self.files.read(&parsed(args)?)
        }

        fn write(&self, rel: &str, content: &str, extra: Value) -> Result<Value, ToolError> {
            let mut args = json!({"path": self.path(rel), "content": content});
            merge(&mut args, extra);
            self.files.write(&parsed(args)?)
        }

        fn temp_files(&self, rel: &str) -> Vec<String> {
            std::fs::read_dir(self.dir.path().join(rel))
                .unwrap()
                .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .filter(|n| n.ends_with(TEMP_SUFFIX))
                .collect()
        }
    }

    fn parsed<T: serde::de::DeserializeOwned>(args: Value) -> Result<T, ToolError> {
        crate::catalog::parse_args(args.as_object().cloned().unwrap())
    }

    fn merge(args: &mut Value, extra: Value) {
        if let Value::Object(extra) = extra {
            args.as_object_mut().unwrap().extend(extra);
        }
    }

    #[track_caller]
    fn refused(result: Result<Value, ToolError>, code: ToolErrorCode, needle: &str) -> String {
        let e = result.expect_err("expected a refusal");
        assert_eq!(e.code, code, "{e}");
        assert!(
            e.message.contains(needle),
            "{e:?} should mention {needle:?}"
        );
        e.message
    }

    #[test]
    fn text_round_trip() {
        let t = Tree::new();
        let w = t.write("rw/a.txt", "héllo\n", json!({})).unwrap();
        assert_eq!(w["size"], "héllo\n".len());
        assert_eq!(w["sha256"], sha256_hex("héllo\n".as_bytes()));
        assert_eq!(w["mode"], "create");
        let r = t.read("rw/a.txt", json!({})).unwrap();
        assert_eq!(r["content"], "héllo\n");
        assert_eq!(r["encoding"], "text");
        assert_eq!(r["size"], "héllo\n".len());
        assert_eq!(r["length"], "héllo\n".len());
        assert_eq!(r["offset"], 0);
        assert_eq!(r["eof"], true);
        assert_eq!(r["sha256"], w["sha256"]);
        assert_eq!(
            std::fs::read_to_string(t.path("rw/a.txt")).unwrap(),
            "héllo\n"
        );
        assert!(t.temp_files("rw").is_empty());
    }

    #[test]
    fn base64_round_trip_and_non_utf8_text_is_refused() {
        let t = Tree::new();
        let bytes = [0xff, 0x00, 0x80, b'a'];
        t.write(
            "rw/bin",
            &BASE64.encode(bytes),
            json!({"encoding": "base64"}),
        )
        .unwrap();
        assert_eq!(std::fs::read(t.path("rw/bin")).unwrap(), bytes);
        let r = t.read("rw/bin", json!({"encoding": "base64"})).unwrap();
        assert_eq!(
            BASE64.decode(r["content"].as_str().unwrap()).unwrap(),
            bytes
        );
        assert_eq!(r["sha256"], sha256_hex(&bytes));
        refused(
            t.read("rw/bin", json!({})),
            ToolErrorCode::InvalidArguments,
            "base64",
        );
        refused(
            t.write("rw/bad", "not base64!", json!({"encoding": "base64"})),
            ToolErrorCode::InvalidArguments,
            "not valid base64",
        );
        assert!(!Path::new(&t.path("rw/bad")).exists());
    }

    #[test]
    fn ranges_report_eof_and_hash_the_whole_file() {
        let t = Tree::new();
        std::fs::write(t.path("ro/r.txt"), "0123456789").unwrap();
        let r = t
            .read("ro/r.txt", json!({"offset": 2, "length": 3}))
            .unwrap();
        assert_eq!(r["content"], "234");
        assert_eq!(r["length"], 3);
        assert_eq!(r["size"], 10);
        assert_eq!(r["eof"], false);
        assert_eq!(r["sha256"], sha256_hex(b"0123456789"));
        let r = t
            .read("ro/r.txt", json!({"offset": 7, "length": 30}))
            .unwrap();
        assert_eq!(
            (r["content"].as_str(), r["eof"].as_bool()),
            (Some("789"), Some(true))
        );
        let r = t.read("ro/r.txt", json!({"offset": 50})).unwrap();
        assert_eq!(
            (r["length"].as_u64(), r["eof"].as_bool()),
            (Some(0), Some(true))
        );
    }

    #[test]
    fn a_file_over_the_read_limit_is_read_in_ranges_without_a_hash() {
        let t = Tree::with_limits(16, 1024);
        let text: String = (0..40).map(|i| char::from(b'a' + (i % 26) as u8)).collect();
        std::fs::write(t.path("ro/big"), &text).unwrap();
        let r = t.read("ro/big", json!({})).unwrap();
        assert_eq!(r["content"], text[..16]);
        assert_eq!(r["size"], 40);
        assert_eq!(r["sha256"], Value::Null);
        assert_eq!(r["eof"], false);
        let r = t.read("ro/big", json!({"offset": 32})).unwrap();
        assert_eq!(r["content"], text[32..]);
        assert_eq!(r["eof"], true);
        let r = t.read("ro/big", json!({"offset": 40})).unwrap();
        assert_eq!(
            (r["length"].as_u64(), r["eof"].as_bool()),
            (Some(0), Some(true))
        );
    }

    #[test]
    fn create_overwrite_append() {
        let t = Tree::new();
        t.write("rw/f", "one\n", json!({})).unwrap();
        refused(
            t.write("rw/f", "again\n", json!({"mode": "create"})),
            ToolErrorCode::InvalidArguments,
            "already exists",
        );
        assert_eq!(std::fs::read_to_string(t.path("rw/f")).unwrap(), "one\n");

        std::fs::set_permissions(t.path("rw/f"), std::fs::Permissions::from_mode(0o640)).unwrap();
        let w = t
            .write("rw/f", "two\n", json!({"mode": "overwrite"}))
            .unwrap();
        assert_eq!(w["mode"], "overwrite");
        assert_eq!(std::fs::read_to_string(t.path("rw/f")).unwrap(), "two\n");
        let mode = std::fs::metadata(t.path("rw/f"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o7777, 0o640, "overwrite keeps the permission bits");

        let w = t
            .write("rw/f", "three\n", json!({"mode": "append"}))
            .unwrap();
        assert_eq!(w["size"], 10);
        assert_eq!(w["sha256"], sha256_hex(b"two\nthree\n"));
        assert_eq!(
            std::fs::read_to_string(t.path("rw/f")).unwrap(),
            "two\nthree\n"
        );
        let mode = std::fs::metadata(t.path("rw/f"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o7777, 0o640, "append keeps the permission bits");

        t.write("rw/new-by-append", "x", json!({"mode": "append"}))
            .unwrap();
        t.write("rw/new-by-overwrite", "y", json!({"mode": "overwrite"}))
            .unwrap();
        assert_eq!(
            std::fs::read_to_string(t.path("rw/new-by-append")).unwrap(),
            "x"
        );
        assert_eq!(
            std::fs::read_to_string(t.path("rw/new-by-overwrite")).unwrap(),
            "y"
        );
        std::fs::create_dir(t.path("rw/sub")).unwrap();
        t.write("rw/sub/nested", "z", json!({})).unwrap();
        assert!(t.temp_files("rw").is_empty() && t.temp_files("rw/sub").is_empty());
    }

    #[test]
    fn expected_sha256_is_a_precondition() {
        let t = Tree::new();
        t.write("rw/c", "v1", json!({})).unwrap();
        let wrong = "0".repeat(64);
        let msg = refused(
            t.write(
                "rw/c",
                "v2",
                json!({"mode": "overwrite", "expected_sha256": wrong}),
            ),
            ToolErrorCode::InvalidArguments,
            &sha256_hex(b"v1"),
        );
        assert!(msg.contains("nothing was written"), "{msg}");
        assert_eq!(std::fs::read_to_string(t.path("rw/c")).unwrap(), "v1");
        // Upper-case hex is the same digest.
        let good = sha256_hex(b"v1").to_ascii_uppercase();
        t.write(
            "rw/c",
            "v2",
            json!({"mode": "overwrite", "expected_sha256": good}),
        )
        .unwrap();
        assert_eq!(std::fs::read_to_string(t.path("rw/c")).unwrap(), "v2");
        t.write(
            "rw/c",
            "+",
            json!({"mode": "append", "expected_sha256": sha256_hex(b"v2")}),
        )
        .unwrap();
        assert_eq!(std::fs::read_to_string(t.path("rw/c")).unwrap(), "v2+");
        refused(
            t.write(
                "rw/absent",
                "x",
                json!({"mode": "overwrite", "expected_sha256": sha256_hex(b"")}),
            ),
            ToolErrorCode::InvalidArguments,
            "does not exist",
        );
        assert!(!Path::new(&t.path("rw/absent")).exists());
    }

    #[test]
    fn paths_must_be_absolute_plain_and_under_a_root() {
        let t = Tree::new();
        refused(
            t.read("rw/../outside/secret", json!({})),
            ToolErrorCode::InvalidArguments,
            "`..`",
        );
        refused(
            t.write("rw/../outside/new", "x", json!({})),
            ToolErrorCode::InvalidArguments,
            "`..`",
        );
        let req = |path: &str| ReadArgs {
            path: path.into(),
            offset: 0,
            length: None,
            encoding: Encoding::Text,
        };
        let e = t.files.read(&req("rw/a")).unwrap_err();
        assert!(e.message.contains("absolute"), "{e}");
        let e = t
            .files
            .read(&req(&format!("{}\0x", t.path("rw/a"))))
            .unwrap_err();
        assert!(e.message.contains("NUL"), "{e}");
        let msg = refused(
            t.read("outside/secret", json!({})),
            ToolErrorCode::PermissionDenied,
            "outside the configured read roots",
        );
        assert!(msg.contains(&t.path("outside/secret")), "{msg}");
        refused(
            t.write("ro/x", "x", json!({})),
            ToolErrorCode::PermissionDenied,
            "outside the configured write roots",
        );
        refused(
            t.write("outside/new", "x", json!({})),
            ToolErrorCode::PermissionDenied,
            "outside",
        );
        assert!(!Path::new(&t.path("ro/x")).exists());
        assert!(!Path::new(&t.path("outside/new")).exists());
        // A sibling whose name merely starts like a root is not under it.
        std::fs::create_dir(t.path("rw-sibling")).unwrap();
        refused(
            t.read("rw-sibling/x", json!({})),
            ToolErrorCode::PermissionDenied,
            "outside",
        );
    }

    #[test]
    fn the_longest_root_wins() {
        let roots = vec![PathBuf::from("/srv"), PathBuf::from("/srv/app/")];
        let t = locate("/srv/app/./conf/x.toml", &roots, "read").unwrap();
        assert_eq!(t.root, Path::new("/srv/app/"));
        assert_eq!(t.rel, Path::new("conf/x.toml"));
        let t = locate("/srv/application", &roots, "read").unwrap();
        assert_eq!(
            (t.root.as_path(), t.rel.as_path()),
            (Path::new("/srv"), Path::new("application"))
        );
        let t = locate("/srv", &roots, "read").unwrap();
        assert!(t.rel.as_os_str().is_empty());
    }

    fn chown(path: &Path, uid: u32) {
        nix::unistd::chown(path, Some(Uid::from_raw(uid)), None).unwrap();
    }

    fn mkdir(path: &Path, mode: u32) {
        std::fs::create_dir(path).unwrap();
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
    }

    fn write_root(root: &Path) -> Result<Files, Vec<ConfigIssue>> {
        Files::new(&FileTool {
            write_roots: vec![root.to_path_buf()],
            ..FileTool::default()
        })
    }

    /// The one problem with `root` as `tools.file.write_roots[0]`, without the path prefix.
    #[track_caller]
    fn root_problem(root: &Path) -> String {
        let issues = write_root(root).expect_err("the root should be refused");
        assert_eq!(issues.len(), 1, "{issues:?}");
        assert_eq!(issues[0].path, "tools.file.write_roots[0]");
        let prefix = format!("{}: ", root.display());
        issues[0]
            .problem
            .strip_prefix(&prefix)
            .unwrap_or_else(|| panic!("{:?} should start with {prefix:?}", issues[0].problem))
            .to_owned()
    }

    #[test]
    fn roots_below_a_directory_another_user_could_swap_are_refused() {
        // The tests run as root: uid 65534 stands for any other user.
        let dir = tempfile::tempdir().unwrap();
        let base = dir.path();
        // Sticky and world-writable, like /tmp: only an entry's owner may rename it.
        let public = base.join("public");
        mkdir(&public, 0o1777);
        let theirs = public.join("theirs");
        mkdir(&theirs, 0o755);
        chown(&theirs, 65534);
        mkdir(&theirs.join("conf"), 0o755);
        let problem = root_problem(&theirs.join("conf"));
        assert!(
            problem.starts_with(&format!(
                "{} is owned by uid 65534, who could replace {}",
                theirs.display(),
                theirs.join("conf").display()
            )),
            "{problem}"
        );
        // The same place with a directory of root's in the middle is fine.
        let ours = public.join("ours");
        mkdir(&ours, 0o755);
        mkdir(&ours.join("conf"), 0o755);
        write_root(&ours.join("conf")).expect("a root below root's own directories");

        for (mode, who) in [
            (0o775, "its group (gid 0)"),
            (0o757, "others"),
            (0o777, "its group (gid 0) and by others"),
        ] {
            let open = base.join(format!("open-{mode:o}"));
            mkdir(&open, mode);
            mkdir(&open.join("conf"), 0o755);
            let problem = root_problem(&open.join("conf"));
            assert_eq!(
                problem,
                format!(
                    "{} is writable by {who} (mode {mode:04o}) and not sticky, so another user could replace {}; the directories above a root must not be",
                    open.display(),
                    open.join("conf").display()
                )
            );
        }

        // The root itself may be anyone's and writable by its group: that is what a
        // write root is for. Only what is above it must be safe.
        let app = base.join("app");
        mkdir(&app, 0o2775);
        chown(&app, 65534);
        write_root(&app).expect("a group-writable root of another user");
    }

    #[test]
    fn a_root_must_be_a_directory_reached_without_links() {
        let dir = tempfile::tempdir().unwrap();
        let base = dir.path();
        mkdir(&base.join("real"), 0o755);
        mkdir(&base.join("real/conf"), 0o755);
        std::fs::write(base.join("file"), "x").unwrap();
        symlink(base.join("real"), base.join("link")).unwrap();

        let missing = base.join("missing/conf");
        assert_eq!(
            root_problem(&missing),
            format!("{} does not exist", base.join("missing").display())
        );
        assert_eq!(root_problem(&base.join("missing")), "does not exist");
        assert!(
            root_problem(&base.join("link")).starts_with("is a symbolic link; name the directory"),
            "{}",
            root_problem(&base.join("link"))
        );
        let problem = root_problem(&base.join("link/conf"));
        assert!(
            problem.starts_with(&format!(
                "{} is a symbolic link",
                base.join("link").display()
            )),
            "{problem}"
        );
        assert_eq!(root_problem(&base.join("file")), "is not a directory");
        assert_eq!(
            root_problem(&base.join("file/conf")),
            format!("{} is not a directory", base.join("file").display())
        );

        // Every bad root is reported, once, under the first key that names it.
        let issues = Files::new(&FileTool {
            read_roots: vec![missing.clone(), base.join("real")],
            write_roots: vec![base.join("real/conf"), missing.clone(), base.join("link")],
            ..FileTool::default()
        })
        .unwrap_err();
        let keys: Vec<&str> = issues.iter().map(|i| i.path.as_str()).collect();
        assert_eq!(
            keys,
            ["tools.file.read_roots[0]", "tools.file.write_roots[2]"]
        );
    }

    #[test]
    fn the_held_root_is_used_after_its_path_is_swapped() {
        let dir = tempfile::tempdir().unwrap();
        let base = dir.path();
        mkdir(&base.join("p"), 0o755);
        mkdir(&base.join("p/rw"), 0o755);
        std::fs::write(base.join("p/rw/in-root"), "root content").unwrap();
        mkdir(&base.join("decoy"), 0o755);
        mkdir(&base.join("decoy/rw"), 0o755);
        std::fs::write(base.join("decoy/rw/in-root"), SECRET).unwrap();
        let files = write_root(&base.join("p/rw")).unwrap();

        // The root's parent goes away; a link to the decoy takes its name.
        std::fs::rename(base.join("p"), base.join("p-moved")).unwrap();
        symlink(base.join("decoy"), base.join("p")).unwrap();

        let path = base.join("p/rw/in-root").display().to_string();
        let read = files.read(&parsed(json!({"path": path})).unwrap()).unwrap();
        assert_eq!(read["content"], "root content");
        files
            .write(&parsed(json!({"path": path, "content": "new", "mode": "overwrite"})).unwrap())
            .unwrap();
        assert_eq!(
            std::fs::read_to_string(base.join("p-moved/rw/in-root")).unwrap(),
            "new"
        );
        assert_eq!(
            std::fs::read_to_string(base.join("decoy/rw/in-root")).unwrap(),
            SECRET
        );
        assert_eq!(std::fs::read_dir(base.join("decoy/rw")).unwrap().count(), 1);
    }

    #[test]
    fn a_name_too_long_for_the_filesystem_is_the_callers_mistake() {
        let t = Tree::new();
        let long = format!("rw/{}", "n".repeat(256));
        for mode in ["create", "overwrite", "append"] {
            refused(
                t.write(&long, "x", json!({"mode": mode})),
                ToolErrorCode::InvalidArguments,
                "longer than the filesystem allows",
            );
        }
        refused(
            t.read(&long, json!({})),
            ToolErrorCode::InvalidArguments,
            "longer than the filesystem allows",
        );
        refused(
            t.write(&format!("{long}/x"), "x", json!({})),
            ToolErrorCode::InvalidArguments,
            "longer than the filesystem allows",
        );
        assert!(t.temp_files("rw").is_empty());
    }

    #[test]
    fn symlinks_may_not_leave_the_root() {
        let t = Tree::new();
        symlink(t.path("outside/secret"), t.path("rw/abs-out")).unwrap();
        symlink("../outside/secret", t.path("rw/rel-out")).unwrap();
        symlink("../outside", t.path("rw/dir-out")).unwrap();
        for link in ["rw/abs-out", "rw/rel-out", "rw/dir-out/secret"] {
            refused(
                t.read(link, json!({})),
                ToolErrorCode::PermissionDenied,
                "escapes the root",
            );
        }
        refused(
            t.write("rw/dir-out/new", "x", json!({})),
            ToolErrorCode::PermissionDenied,
            "escapes the root",
        );
        refused(
            t.write("rw/rel-out", "x", json!({"mode": "overwrite"})),
            ToolErrorCode::PermissionDenied,
            "escapes the root",
        );
        assert_eq!(
            std::fs::read_to_string(t.path("outside/secret")).unwrap(),
            SECRET
        );
        let outside: Vec<_> = std::fs::read_dir(t.path("outside")).unwrap().collect();
        assert_eq!(outside.len(), 1, "nothing new outside the root");
        // An absolute link to a file inside the root counts as an escape too.
        std::fs::write(t.path("rw/in.txt"), "inside").unwrap();
        symlink(t.path("rw/in.txt"), t.path("rw/abs-in")).unwrap();
        refused(
            t.read("rw/abs-in", json!({})),
            ToolErrorCode::PermissionDenied,
            "escapes",
        );
    }

    #[test]
    fn relative_links_inside_the_root_are_read_but_never_written_through() {
        let t = Tree::new();
        std::fs::create_dir(t.path("rw/d")).unwrap();
        std::fs::write(t.path("rw/d/in.txt"), "inside").unwrap();
        symlink("d/in.txt", t.path("rw/link")).unwrap();
        symlink("d", t.path("rw/dlink")).unwrap();
        assert_eq!(t.read("rw/link", json!({})).unwrap()["content"], "inside");
        assert_eq!(
            t.read("rw/dlink/in.txt", json!({})).unwrap()["content"],
            "inside"
        );
        refused(
            t.write("rw/link", "x", json!({"mode": "overwrite"})),
            ToolErrorCode::InvalidArguments,
            "symbolic link",
        );
        refused(
            t.write("rw/link", "x", json!({})),
            ToolErrorCode::InvalidArguments,
            "symbolic link",
        );
        assert!(
            std::fs::symlink_metadata(t.path("rw/link"))
                .unwrap()
                .file_type()
                .is_symlink()
        );
        assert_eq!(
            std::fs::read_to_string(t.path("rw/d/in.txt")).unwrap(),
            "inside"
        );
        // A directory link inside the root is a fine parent.
        t.write("rw/dlink/new.txt", "via link", json!({})).unwrap();
        assert_eq!(
            std::fs::read_to_string(t.path("rw/d/new.txt")).unwrap(),
            "via link"
        );
    }

    #[test]
    fn only_regular_files() {
        let t = Tree::new();
        nix::unistd::mkfifo(t.path("rw/fifo").as_str(), Mode::from_bits_truncate(0o600)).unwrap();
        std::fs::create_dir(t.path("rw/dir")).unwrap();
        let started = Instant::now();
        refused(
            t.read("rw/fifo", json!({})),
            ToolErrorCode::InvalidArguments,
            "not a regular file (it is a FIFO)",
        );
        refused(
            t.write("rw/fifo", "x", json!({"mode": "overwrite"})),
            ToolErrorCode::InvalidArguments,
            "not a regular file",
        );
        refused(
            t.write("rw/fifo", "x", json!({"mode": "append"})),
            ToolErrorCode::InvalidArguments,
            "FIFO",
        );
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "a FIFO must not block"
        );
        refused(
            t.read("rw/dir", json!({})),
            ToolErrorCode::InvalidArguments,
            "directory",
        );
        refused(
            t.write("rw/dir", "x", json!({"mode": "overwrite"})),
            ToolErrorCode::InvalidArguments,
            "directory",
        );
        refused(
            t.read("rw", json!({})),
            ToolErrorCode::InvalidArguments,
            "directory",
        );
        refused(
            t.write("rw", "x", json!({"mode": "overwrite"})),
            ToolErrorCode::InvalidArguments,
            "directory",
        );
        std::fs::write(t.path("rw/file"), "x").unwrap();
        for slashed in ["rw/file/", "rw/file/.", "rw/"] {
            refused(
                t.read(slashed, json!({})),
                ToolErrorCode::InvalidArguments,
                "directory separator",
            );
            refused(
                t.write(slashed, "y", json!({"mode": "overwrite"})),
                ToolErrorCode::InvalidArguments,
                "directory separator",
            );
        }
        assert_eq!(std::fs::read_to_string(t.path("rw/file")).unwrap(), "x");
        let sock = std::os::unix::net::UnixListener::bind(t.path("rw/sock")).unwrap();
        refused(
            t.read("rw/sock", json!({})),
            ToolErrorCode::InvalidArguments,
            "socket",
        );
        drop(sock);
        assert!(
            std::fs::read_dir(t.path("rw/dir"))
                .unwrap()
                .next()
                .is_none()
        );
        assert!(t.temp_files("rw").is_empty());
    }

    #[test]
    fn missing_files_and_directories() {
        let t = Tree::new();
        refused(
            t.read("rw/nope", json!({})),
            ToolErrorCode::InvalidArguments,
            "no such file",
        );
        refused(
            t.read("rw/nope/deeper", json!({})),
            ToolErrorCode::InvalidArguments,
            "no such file",
        );
        std::fs::write(t.path("rw/plain"), "x").unwrap();
        refused(
            t.read("rw/plain/x", json!({})),
            ToolErrorCode::InvalidArguments,
            "no such file",
        );
        refused(
            t.write("rw/nodir/f", "x", json!({})),
            ToolErrorCode::InvalidArguments,
            "directory of",
        );
        refused(
            t.write("rw/plain/f", "x", json!({})),
            ToolErrorCode::InvalidArguments,
            "directory of",
        );
    }

    #[test]
    fn size_limits_are_named() {
        let t = Tree::with_limits(8, 8);
        std::fs::write(t.path("rw/s"), "12345").unwrap();
        refused(
            t.read("rw/s", json!({"length": 9})),
            ToolErrorCode::InvalidArguments,
            "read limit of 8 bytes",
        );
        assert_eq!(
            t.read("rw/s", json!({"length": 8})).unwrap()["content"],
            "12345"
        );
        refused(
            t.write("rw/big", "123456789", json!({})),
            ToolErrorCode::InvalidArguments,
            "write limit of 8 bytes",
        );
        assert!(!Path::new(&t.path("rw/big")).exists());
        refused(
            t.write("rw/s", "6789", json!({"mode": "append"})),
            ToolErrorCode::InvalidArguments,
            "write limit of 8 bytes",
        );
        assert_eq!(std::fs::read_to_string(t.path("rw/s")).unwrap(), "12345");
        t.write("rw/s", "678", json!({"mode": "append"})).unwrap();
        assert_eq!(std::fs::read_to_string(t.path("rw/s")).unwrap(), "12345678");
    }

    #[test]
    fn without_roots_the_tools_are_unavailable() {
        let files = Files::new(&FileTool::default()).unwrap();
        let e = files
            .read(&parsed(json!({"path": "/etc/hostname"})).unwrap())
            .unwrap_err();
        assert_eq!(e.code, ToolErrorCode::Unavailable);
        assert!(e.message.contains("no file roots are configured"), "{e}");
        let e = files
            .write(&parsed(json!({"path": "/tmp/x", "content": ""})).unwrap())
            .unwrap_err();
        assert_eq!(e.code, ToolErrorCode::Unavailable);
        // With read roots only, writes are unavailable and reads work.
        let t = Tree::new();
        let ro = Files::new(&FileTool {
            read_roots: vec![t.dir.path().join("ro")],
            ..FileTool::default()
        })
        .unwrap();
        let e = ro
            .write(&parsed(json!({"path": t.path("ro/x"), "content": ""})).unwrap())
            .unwrap_err();
        assert_eq!(e.code, ToolErrorCode::Unavailable);
        assert!(e.message.contains("write roots"), "{e}");
    }

    #[test]
    fn temp_names_are_hidden_bounded_and_removed_on_failure() {
        let name = temp_name("config.toml");
        assert!(
            name.starts_with(".config.toml.") && name.ends_with(TEMP_SUFFIX),
            "{name}"
        );
        assert_ne!(name, temp_name("config.toml"));
        let long = "é".repeat(127);
        assert!(temp_name(&long).len() <= 255);
        let t = Tree::new();
        let dir = nix::fcntl::open(
            t.dir.path().join("rw").as_path(),
            OFlag::O_RDONLY | OFlag::O_DIRECTORY,
            Mode::empty(),
        )
        .unwrap();
        let temp = TempFile::create(dir.as_fd(), "x").unwrap();
        assert_eq!(t.temp_files("rw"), vec![temp.name.clone()]);
        drop(temp);
        assert!(
            t.temp_files("rw").is_empty(),
            "an abandoned temp file is removed"
        );
        // A no-replace install onto an existing name fails and leaves both files intact.
        std::fs::write(t.path("rw/x"), "racer").unwrap();
        let mut temp = TempFile::create(dir.as_fd(), "x").unwrap();
        temp.file.write_all(b"mine").unwrap();
        assert_eq!(temp.install("x", false), Err(Errno::EEXIST));
        drop(temp);
        assert_eq!(std::fs::read_to_string(t.path("rw/x")).unwrap(), "racer");
        assert!(t.temp_files("rw").is_empty());
    }

    #[test]
    fn specs_pass_the_catalog() {
        let t = Tree::new();
        let tools = tools(&FileTool {
            read_roots: vec![t.dir.path().join("ro")],
            write_roots: vec![t.dir.path().join("rw")],
            ..FileTool::default()
        })
        .unwrap();
        let specs: Vec<ToolSpec> = tools.iter().map(|t| t.spec()).collect();
        assert_eq!(specs[0].name, "file.read");
        assert_eq!(specs[0].annotations, Annotations::READ_ONLY);
        assert_eq!(specs[1].name, "file.write");
        assert!(specs[1].annotations.replay_safe && specs[1].annotations.destructive);
        assert!(!specs[1].annotations.read_only);
        assert!(
            specs[1].input_schema["properties"]
                .get(crate::catalog::IDEMPOTENCY_KEY)
                .is_some()
        );
        assert!(specs[0].description.contains(&t.path("ro")));
        crate::catalog::Catalog::new(
            vec![Arc::new(crate::catalog::Fixed::new("first-party", tools))],
            crate::catalog::submission_spec("agent_submit"),
        )
        .expect("the file tools pass catalog validation");
    }

    #[tokio::test]
    async fn calls_run_through_the_host_tool() {
        let t = Tree::new();
        let tools = tools(&FileTool {
            write_roots: vec![t.dir.path().join("rw")],
            ..FileTool::default()
        })
        .unwrap();
        let caller = crate::vocab::Caller::Local(0);
        let ctx = ToolContext {
            caller: &caller,
            cancel: Default::default(),
            progress: Default::default(),
            host: &crate::session::tests::NoCarriers,
        };
        let args = json!({"path": t.path("rw/h"), "content": "hi"});
        let out = tools[1]
            .call(&ctx, args.as_object().unwrap().clone())
            .await
            .unwrap();
        let ToolOutput::Structured(w) = out else {
            panic!("structured output expected")
        };
        let args = json!({"path": t.path("rw/h")});
        let ToolOutput::Structured(r) = tools[0]
            .call(&ctx, args.as_object().unwrap().clone())
            .await
            .unwrap()
        else {
            panic!("structured output expected")
        };
        assert_eq!(r["content"], "hi");
        assert_eq!(r["sha256"], w["sha256"]);
    }
}
