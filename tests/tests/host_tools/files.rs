//! `file.read` and `file.write` through the real daemon and a real MCP client: round trips,
//! path escapes (`..`, outside paths, symlinks, FIFOs, devices, directories), symlink-swap
//! races, roots another user could swap (refused by `check-config` and at start), a root's
//! path swapped after start, idempotent retries, crash safety of the atomic replace under
//! SIGKILL, the no-roots answer, the size limits and names too long for the filesystem.

use std::io::Write as _;
use std::os::unix::fs::{MetadataExt, PermissionsExt, symlink};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use nix::sys::signal::Signal;
use nix::sys::stat::{Mode, SFlag};
use robota_e2e::daemon::{READY_LIMIT, check_config};
use robota_e2e::http::{Request, tools_call};
use robota_e2e::mcp::{McpClient, ToolResult};
use robota_e2e::{Daemon, EXIT_CONFIG, within};
use serde_json::{Value, json};
use tokio::io::AsyncWriteExt;

/// What lives outside the roots; no response may ever carry it.
const SECRET: &str = "TOP-SECRET-outside-the-roots-7f3a";

const ALLOW_WRITE: &str = r#"
[[policy]]
callers = ["bearer:*"]
tools = ["file.write"]
decision = "allow"
"#;

/// `base/rw` (write root), `base/ro` (read root) and `base/outside` (holding `secret`),
/// in a temp directory of the test's own.
struct Tree {
    _dir: tempfile::TempDir,
    rw: PathBuf,
    ro: PathBuf,
    outside: PathBuf,
}

impl Tree {
    fn new() -> Tree {
        let dir = tempfile::Builder::new()
            .prefix("files-e2e-")
            .tempdir()
            .expect("tempdir");
        let base = dir.path().to_path_buf();
        let (rw, ro, outside) = (base.join("rw"), base.join("ro"), base.join("outside"));
        for d in [&rw, &ro, &outside] {
            std::fs::create_dir(d).expect("mkdir");
        }
        std::fs::write(outside.join("secret"), SECRET).expect("write secret");
        Tree {
            _dir: dir,
            rw,
            ro,
            outside,
        }
    }

    /// `[tools.file]` with these roots and `limits` lines, plus the write policy.
    fn config(&self, limits: &str) -> String {
        format!(
            "[tools.file]\nread_roots = [\"{}\"]\nwrite_roots = [\"{}\"]\n{limits}\n{ALLOW_WRITE}",
            self.ro.display(),
            self.rw.display()
        )
    }

    fn rw(&self, rel: &str) -> String {
        self.rw.join(rel).display().to_string()
    }

    /// Names in `outside/`, sorted.
    fn outside_names(&self) -> Vec<String> {
        names(&self.outside)
    }

    fn assert_outside_untouched(&self, what: &str) {
        assert_eq!(
            self.outside_names(),
            vec!["secret".to_owned()],
            "{what}: nothing may appear outside the roots"
        );
        assert_eq!(
            std::fs::read_to_string(self.outside.join("secret")).expect("read secret"),
            SECRET,
            "{what}: the outside file must be unchanged"
        );
    }
}

fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .expect("read_dir")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

fn temp_files(dir: &Path) -> Vec<String> {
    names(dir)
        .into_iter()
        .filter(|n| n.ends_with(".robota-tmp"))
        .collect()
}

/// SHA-256 (lowercase hex) computed by coreutils' `sha256sum`, independently of the daemon.
fn sha256(bytes: &[u8]) -> String {
    let mut child = Command::new("sha256sum")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn sha256sum");
    let mut stdin = child.stdin.take().expect("stdin");
    let data = bytes.to_vec();
    let feeder = std::thread::spawn(move || stdin.write_all(&data));
    let out = child.wait_with_output().expect("sha256sum output");
    feeder.join().expect("feeder").expect("feed sha256sum");
    assert!(out.status.success(), "sha256sum failed");
    let text = String::from_utf8(out.stdout).expect("utf8");
    let hex = text.split_whitespace().next().expect("a digest").to_owned();
    assert_eq!(hex.len(), 64, "sha256sum printed {text:?}");
    hex
}

fn assert_no_secret(r: &ToolResult, what: &str) {
    assert!(
        !r.text.contains(SECRET) && !r.structured.to_string().contains(SECRET),
        "{what}: a response carried the outside content: {r:?}"
    );
}

async fn connect(d: &Daemon) -> McpClient {
    let bearer = d.bearer();
    McpClient::connect(d, &bearer).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn write_then_read_back_in_every_mode() {
    let t = Tree::new();
    let d = Daemon::start(&t.config(""));
    let c = connect(&d).await;
    let listed = c.tool_names().await;
    assert!(
        listed.iter().any(|n| n == "file.read") && listed.iter().any(|n| n == "file.write"),
        "{listed:?}"
    );
    let path = t.rw("notes.txt");
    let text = "first line — ünïcode\n";

    let w = c
        .call("file.write", json!({"path": path, "content": text}))
        .await
        .ok("create");
    assert_eq!(w["mode"], "create");
    assert_eq!(w["size"], text.len());
    assert_eq!(
        w["sha256"],
        sha256(text.as_bytes()),
        "sha256 as computed locally"
    );
    assert_eq!(std::fs::read_to_string(&path).expect("read"), text);

    let r = c
        .call("file.read", json!({"path": path}))
        .await
        .ok("read text");
    assert_eq!(r["content"], text);
    assert_eq!(r["encoding"], "text");
    assert_eq!(
        (r["size"].as_u64(), r["eof"].as_bool()),
        (Some(text.len() as u64), Some(true))
    );
    assert_eq!(r["sha256"], sha256(text.as_bytes()));
    let r = c
        .call("file.read", json!({"path": path, "encoding": "base64"}))
        .await
        .ok("read base64");
    assert_eq!(r["encoding"], "base64");
    let decoded = BASE64
        .decode(r["content"].as_str().expect("content"))
        .expect("base64");
    assert_eq!(decoded, text.as_bytes());
    let r = c
        .call("file.read", json!({"path": path, "offset": 6, "length": 4}))
        .await
        .ok("read a range");
    assert_eq!(
        (r["content"].as_str(), r["eof"].as_bool()),
        (Some("line"), Some(false))
    );

    // Binary content goes both ways as base64; as text it is refused with a pointer to base64.
    let bytes: Vec<u8> = (0..=255u8).rev().collect();
    let bin = t.rw("blob.bin");
    c.call(
        "file.write",
        json!({"path": bin, "content": BASE64.encode(&bytes), "encoding": "base64"}),
    )
    .await
    .ok("write binary");
    assert_eq!(std::fs::read(&bin).expect("read blob"), bytes);
    let r = c
        .call("file.read", json!({"path": bin, "encoding": "base64"}))
        .await
        .ok("read binary");
    assert_eq!(
        BASE64
            .decode(r["content"].as_str().expect("content"))
            .expect("b64"),
        bytes
    );
    assert_eq!(r["sha256"], sha256(&bytes));
    let msg = c
        .call("file.read", json!({"path": bin}))
        .await
        .err("invalid_arguments", "binary as text");
    assert!(msg.contains("base64"), "{msg}");

    // Overwrite under a precondition: a stale digest changes nothing and names the actual one.
    let stale = sha256(b"something else");
    let msg = c
        .call(
            "file.write",
            json!({"path": path, "content": "second\n", "mode": "overwrite", "expected_sha256": stale}),
        )
        .await
        .err("invalid_arguments", "stale expected_sha256");
    assert!(
        msg.contains(&sha256(text.as_bytes())),
        "names the actual sha256: {msg}"
    );
    assert_eq!(std::fs::read_to_string(&path).expect("read"), text);
    let w = c
        .call(
            "file.write",
            json!({"path": path, "content": "second\n", "mode": "overwrite", "expected_sha256": sha256(text.as_bytes())}),
        )
        .await
        .ok("overwrite");
    assert_eq!(w["mode"], "overwrite");
    assert_eq!(std::fs::read_to_string(&path).expect("read"), "second\n");

    let w = c
        .call(
            "file.write",
            json!({"path": path, "content": "third\n", "mode": "append"}),
        )
        .await
        .ok("append");
    assert_eq!(w["sha256"], sha256(b"second\nthird\n"));
    assert_eq!(
        std::fs::read_to_string(&path).expect("read"),
        "second\nthird\n"
    );
    let r = c
        .call("file.read", json!({"path": path}))
        .await
        .ok("read back");
    assert_eq!(r["content"], "second\nthird\n");

    let msg = c
        .call(
            "file.write",
            json!({"path": path, "content": "clobber", "mode": "create"}),
        )
        .await
        .err("invalid_arguments", "create on an existing file");
    assert!(msg.contains("already exists"), "{msg}");
    assert_eq!(
        std::fs::read_to_string(&path).expect("read"),
        "second\nthird\n"
    );

    // Read roots are readable, not writable.
    std::fs::write(t.ro.join("ro.txt"), "read only").expect("write ro");
    let ro = t.ro.join("ro.txt").display().to_string();
    assert_eq!(
        c.call("file.read", json!({"path": ro})).await.ok("read ro")["content"],
        "read only"
    );
    let msg = c
        .call(
            "file.write",
            json!({"path": ro, "content": "x", "mode": "overwrite"}),
        )
        .await
        .err("permission_denied", "write in a read root");
    assert!(msg.contains("outside the configured write roots"), "{msg}");
    assert_eq!(
        std::fs::read_to_string(t.ro.join("ro.txt")).expect("read"),
        "read only"
    );

    assert!(
        temp_files(&t.rw).is_empty(),
        "no temp file left: {:?}",
        names(&t.rw)
    );
    c.close().await;
    d.assert_no_secrets();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn written_files_keep_their_identity_and_new_ones_get_their_roots() {
    let t = Tree::new();
    let shared = t.rw.join("shared");
    std::fs::create_dir(&shared).expect("mkdir");
    std::os::unix::fs::chown(&shared, None, Some(4321)).expect("chgrp");
    // The daemon runs with umask 0077 (as its unit sets); new files must not end 0600.
    let d = Daemon::start(&t.config(&format!(
        "[tools.file.new_files.\"{}\"]\nmode = \"0640\"\ngroup = \"65534\"\n",
        t.rw.display()
    )));
    let c = connect(&d).await;

    // A new file: the root's mode and group, and the answer says so.
    let path = t.rw("made.txt");
    let w = c
        .call("file.write", json!({"path": path, "content": "new\n"}))
        .await
        .ok("create");
    let meta = std::fs::metadata(&path).expect("stat");
    assert_eq!(meta.mode() & 0o7777, 0o640, "{w}");
    assert_eq!(meta.gid(), 65534, "{w}");
    assert_eq!(w["created"], json!({"mode": "0640", "gid": 65534}), "{w}");
    assert!(
        w.get("owner_kept").is_none(),
        "a new file kept nothing: {w}"
    );

    // A replaced file keeps owner, group and mode (the daemon runs as root here).
    let owned = t.rw("owned.txt");
    std::fs::write(&owned, "old\n").expect("write");
    std::os::unix::fs::chown(&owned, Some(1234), Some(4321)).expect("chown");
    std::fs::set_permissions(&owned, std::fs::Permissions::from_mode(0o604)).expect("chmod");
    let w = c
        .call(
            "file.write",
            json!({"path": owned, "content": "new\n", "mode": "overwrite"}),
        )
        .await
        .ok("overwrite");
    let meta = std::fs::metadata(&owned).expect("stat");
    assert_eq!(
        (meta.uid(), meta.gid(), meta.mode() & 0o7777),
        (1234, 4321, 0o604)
    );
    assert_eq!(
        w["kept"],
        json!({"owner": true, "group": true, "mode": true}),
        "{w}"
    );
    assert_eq!(w["owner_kept"], true);
    d.assert_no_secrets();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_file_without_root_settings_is_0644_in_its_directorys_group() {
    let t = Tree::new();
    let shared = t.rw.join("shared");
    std::fs::create_dir(&shared).expect("mkdir");
    std::os::unix::fs::chown(&shared, None, Some(4321)).expect("chgrp");
    let d = Daemon::start(&t.config(""));
    let c = connect(&d).await;
    let path = shared.join("made.txt").display().to_string();
    let w = c
        .call("file.write", json!({"path": path, "content": "x"}))
        .await
        .ok("create");
    let meta = std::fs::metadata(&path).expect("stat");
    assert_eq!((meta.mode() & 0o7777, meta.gid()), (0o644, 4321), "{w}");
    assert_eq!(w["created"], json!({"mode": "0644", "gid": 4321}), "{w}");
    // A settings table for a path that is not a write root is refused.
    let dir = tempfile::tempdir().expect("tempdir");
    let bad = dir.path().join("c.toml");
    std::fs::write(
        &bad,
        format!(
            "{}\n[tools.file.new_files.\"/elsewhere\"]\nmode = \"0666\"\n",
            t.config("")
        ),
    )
    .expect("write");
    let out = check_config(&bad);
    out.expect_code(EXIT_CONFIG, "new_files of a path that is no write root");
    assert!(
        out.stderr.contains("is not one of tools.file.write_roots"),
        "{}",
        out.stderr
    );
    assert!(
        out.stderr.contains("must not be writable by every user"),
        "{}",
        out.stderr
    );
    d.assert_no_secrets();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn escapes_and_special_files_are_refused() {
    let t = Tree::new();
    let secret = t.outside.join("secret").display().to_string();
    symlink("../outside/secret", t.rw.join("link-file")).expect("symlink");
    symlink(&secret, t.rw.join("link-file-abs")).expect("symlink");
    symlink("../outside", t.rw.join("link-dir")).expect("symlink");
    std::fs::create_dir(t.rw.join("subdir")).expect("mkdir");
    nix::unistd::mkfifo(&t.rw.join("fifo"), Mode::from_bits_truncate(0o600)).expect("mkfifo");
    let null_rdev = std::fs::metadata("/dev/null")
        .expect("stat /dev/null")
        .rdev();
    let device = match nix::sys::stat::mknod(
        &t.rw.join("null-dev"),
        SFlag::S_IFCHR,
        Mode::from_bits_truncate(0o600),
        null_rdev,
    ) {
        Ok(()) => true,
        Err(nix::errno::Errno::EPERM) => {
            eprintln!("note: mknod is not permitted here (EPERM); skipping the device-file case");
            false
        }
        Err(e) => panic!("mknod: {e}"),
    };

    let d = Daemon::start(&t.config(""));
    let c = connect(&d).await;
    let dotdot = format!("{}/../outside/secret", t.rw.display());
    let mut cases: Vec<(String, &str, &str)> = vec![
        (dotdot, "invalid_arguments", "`..`"),
        (
            secret.clone(),
            "permission_denied",
            "outside the configured",
        ),
        (
            "/etc/hostname".into(),
            "permission_denied",
            "outside the configured",
        ),
        (t.rw("link-file"), "permission_denied", "escapes the root"),
        (
            t.rw("link-file-abs"),
            "permission_denied",
            "escapes the root",
        ),
        (
            t.rw("link-dir/secret"),
            "permission_denied",
            "escapes the root",
        ),
        (t.rw("fifo"), "invalid_arguments", "not a regular file"),
        (t.rw("subdir"), "invalid_arguments", "not a regular file"),
    ];
    if device {
        cases.push((t.rw("null-dev"), "invalid_arguments", "not a regular file"));
    }
    for (path, code, needle) in &cases {
        let what = format!("file.read {path}");
        // A FIFO must not block the call: bounded well under the client's own limit.
        let r = within(
            Duration::from_secs(10),
            &what,
            c.call("file.read", json!({"path": path})),
        )
        .await;
        assert_no_secret(&r, &what);
        let msg = r.err(code, &what);
        assert!(
            msg.contains(needle),
            "{what}: {msg:?} should say {needle:?}"
        );
        assert!(
            !msg.is_empty() && msg.len() < 300,
            "{what}: short message: {msg:?}"
        );
    }

    let new_dotdot = format!("{}/../outside/new", t.rw.display());
    let new_outside = t.outside.join("new").display().to_string();
    let mut writes: Vec<(String, &str, &str)> = vec![
        (new_dotdot, "invalid_arguments", "`..`"),
        (new_outside, "permission_denied", "outside the configured"),
        (
            secret.clone(),
            "permission_denied",
            "outside the configured",
        ),
        (t.rw("link-file"), "permission_denied", "escapes the root"),
        (
            t.rw("link-file-abs"),
            "permission_denied",
            "escapes the root",
        ),
        (
            t.rw("link-dir/new"),
            "permission_denied",
            "escapes the root",
        ),
        (
            t.rw("link-dir/secret"),
            "permission_denied",
            "escapes the root",
        ),
        (t.rw("fifo"), "invalid_arguments", "not a regular file"),
        (t.rw("subdir"), "invalid_arguments", "not a regular file"),
    ];
    if device {
        writes.push((t.rw("null-dev"), "invalid_arguments", "not a regular file"));
    }
    for mode in ["create", "overwrite", "append"] {
        for (path, code, needle) in &writes {
            let what = format!("file.write {mode} {path}");
            let r = within(
                Duration::from_secs(10),
                &what,
                c.call(
                    "file.write",
                    json!({"path": path, "content": "PWNED", "mode": mode}),
                ),
            )
            .await;
            assert_no_secret(&r, &what);
            let msg = r.err(code, &what);
            assert!(
                msg.contains(needle),
                "{what}: {msg:?} should say {needle:?}"
            );
        }
    }
    t.assert_outside_untouched("after the escape attempts");
    assert!(
        names(&t.rw.join("subdir")).is_empty(),
        "nothing written into the directory"
    );
    assert!(
        std::fs::symlink_metadata(t.rw.join("link-file"))
            .expect("lstat")
            .file_type()
            .is_symlink(),
        "the link itself is left alone"
    );
    assert!(
        temp_files(&t.rw).is_empty(),
        "no temp file left: {:?}",
        names(&t.rw)
    );
    c.close().await;
    d.assert_no_secrets();
}

/// Flips `link` between symlinks to each of `targets` in turn, atomically (a fresh symlink
/// renamed over it), until `stop`; returns how many flips it made.
fn flipper(
    dir: PathBuf,
    link: &'static str,
    targets: Vec<PathBuf>,
    stop: Arc<AtomicBool>,
) -> std::thread::JoinHandle<u64> {
    std::thread::spawn(move || {
        let flips = AtomicU64::new(0);
        let staged = dir.join(format!(".{link}.staged"));
        while !stop.load(Ordering::Relaxed) {
            for target in &targets {
                let _ = std::fs::remove_file(&staged);
                symlink(target, &staged).expect("stage symlink");
                std::fs::rename(&staged, dir.join(link)).expect("swap symlink");
                flips.fetch_add(1, Ordering::Relaxed);
            }
        }
        flips.load(Ordering::Relaxed)
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn symlink_swaps_never_leak_or_redirect() {
    let t = Tree::new();
    std::fs::write(t.rw.join("inside.txt"), "inside content").expect("write inside");
    std::fs::create_dir(t.rw.join("sub")).expect("mkdir sub");
    let wdir = t.outside.join("wdir");
    std::fs::create_dir(&wdir).expect("mkdir wdir");
    symlink("inside.txt", t.rw.join("flip")).expect("symlink");
    symlink("sub", t.rw.join("dflip")).expect("symlink");
    let d = Daemon::start(&t.config(""));
    let c = connect(&d).await;

    // Reads while `flip` alternates between an inside file and the outside secret (by a
    // relative and by an absolute link).
    let stop = Arc::new(AtomicBool::new(false));
    let flips = flipper(
        t.rw.clone(),
        "flip",
        vec![
            PathBuf::from("inside.txt"),
            PathBuf::from("../outside/secret"),
            PathBuf::from("inside.txt"),
            t.outside.join("secret"),
        ],
        Arc::clone(&stop),
    );
    let (mut read_ok, mut read_refused) = (0, 0);
    for i in 0..300 {
        let r = c.call("file.read", json!({"path": t.rw("flip")})).await;
        assert_no_secret(&r, &format!("read {i}"));
        if r.is_error {
            let msg = r.err("permission_denied", &format!("read {i}"));
            assert!(msg.contains("escapes the root"), "read {i}: {msg}");
            read_refused += 1;
        } else {
            assert_eq!(r.structured["content"], "inside content", "read {i}");
            read_ok += 1;
        }
    }
    stop.store(true, Ordering::Relaxed);
    let read_flips = flips.join().expect("flipper");

    // Writes below `dflip` while it alternates between an inside and an outside directory.
    let stop = Arc::new(AtomicBool::new(false));
    let flips = flipper(
        t.rw.clone(),
        "dflip",
        vec![
            PathBuf::from("sub"),
            PathBuf::from("../outside/wdir"),
            PathBuf::from("sub"),
            wdir.clone(),
        ],
        Arc::clone(&stop),
    );
    let (mut write_ok, mut write_refused) = (0, 0);
    for i in 0..300 {
        let r = c
            .call(
                "file.write",
                json!({"path": t.rw("dflip/f.txt"), "content": format!("write {i}"), "mode": "overwrite"}),
            )
            .await;
        if r.is_error {
            let msg = r.err("permission_denied", &format!("write {i}"));
            assert!(msg.contains("escapes the root"), "write {i}: {msg}");
            write_refused += 1;
        } else {
            write_ok += 1;
        }
        assert!(
            names(&wdir).is_empty(),
            "write {i}: a file appeared outside: {:?}",
            names(&wdir)
        );
    }
    stop.store(true, Ordering::Relaxed);
    let write_flips = flips.join().expect("flipper");

    eprintln!(
        "symlink race: reads {read_ok} served / {read_refused} refused over {read_flips} flips; \
         writes {write_ok} done / {write_refused} refused over {write_flips} flips"
    );
    assert!(
        read_ok > 0 && read_refused > 0,
        "the read race must hit both states"
    );
    assert!(
        write_ok > 0 && write_refused > 0,
        "the write race must hit both states"
    );
    assert!(
        names(&wdir).is_empty(),
        "the outside directory never gets a file"
    );
    assert!(
        std::fs::read_to_string(t.rw.join("sub/f.txt"))
            .expect("the inside target was written")
            .starts_with("write "),
    );
    t.assert_outside_untouched_but(&["wdir"]);
    assert!(temp_files(&t.rw.join("sub")).is_empty());
    c.close().await;
    d.assert_no_secrets();
}

impl Tree {
    /// Like [`Tree::assert_outside_untouched`], with `extra` names the test made itself.
    fn assert_outside_untouched_but(&self, extra: &[&str]) {
        let mut expected: Vec<String> = extra.iter().map(|s| (*s).to_owned()).collect();
        expected.push("secret".into());
        expected.sort();
        assert_eq!(self.outside_names(), expected);
        assert_eq!(
            std::fs::read_to_string(self.outside.join("secret")).expect("read secret"),
            SECRET
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idempotency_key_makes_a_retry_have_one_effect() {
    let t = Tree::new();
    let path = t.rw("log.txt");
    std::fs::write(&path, "start\n").expect("seed");
    let d = Daemon::start(&t.config(""));
    let c = connect(&d).await;
    let args =
        json!({"path": path, "content": "line\n", "mode": "append", "idempotency_key": "append-1"});
    let first = c.call("file.write", args.clone()).await.ok("first append");
    let again = c.call("file.write", args).await.ok("retried append");
    assert_eq!(first, again, "the retry returns the first result");
    assert_eq!(
        std::fs::read_to_string(&path).expect("read"),
        "start\nline\n",
        "one effect"
    );

    let msg = c
        .call(
            "file.write",
            json!({"path": path, "content": "other\n", "mode": "append", "idempotency_key": "append-1"}),
        )
        .await
        .err("invalid_arguments", "same key, different content");
    assert!(msg.contains("different arguments"), "{msg}");
    assert_eq!(
        std::fs::read_to_string(&path).expect("read"),
        "start\nline\n"
    );

    // A new key is a new call: a second effect is visible, so the first check could fail.
    c.call(
        "file.write",
        json!({"path": path, "content": "line\n", "mode": "append", "idempotency_key": "append-2"}),
    )
    .await
    .ok("append under a new key");
    assert_eq!(
        std::fs::read_to_string(&path).expect("read"),
        "start\nline\nline\n"
    );
    c.close().await;
    d.assert_no_secrets();
}

/// What one crash iteration found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Landed {
    /// Old content, no temp file: killed before the write started its temp file.
    BeforeWrite,
    /// Old content and a leftover temp file: killed mid-write, before the rename.
    MidWrite,
    /// New content: killed after the rename (or the write had finished).
    AfterRename,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_during_overwrite_leaves_old_or_new_content() {
    const SIZE: usize = 4 * 1024 * 1024;
    const ITERATIONS: usize = 50;
    let t = Tree::new();
    let state = t.rw.parent().expect("base").join("state");
    let target = t.rw.join("big.dat");
    let a = vec![b'A'; SIZE];
    let b: Vec<u8> = b"0123456789abcdef"
        .iter()
        .copied()
        .cycle()
        .take(SIZE)
        .collect();
    let (sha_a, sha_b) = (sha256(&a), sha256(&b));
    let config = t.config("max_write = \"5MiB\"\n[limits]\nrequest_body = \"6MiB\"");
    let message = tools_call(
        1,
        "file.write",
        json!({
            "path": target.display().to_string(),
            "content": String::from_utf8(b.clone()).expect("ascii"),
            "mode": "overwrite"
        }),
    );

    let started = Instant::now();
    // Calibrate: how long one whole overwrite takes here, to spread the kills over it.
    std::fs::write(&target, &a).expect("seed A");
    let d = Daemon::builder().state_dir(&state).extra(&config).start();
    let bearer = d.bearer();
    let addr = d.loopback_addr();
    let t0 = Instant::now();
    let resp =
        robota_e2e::http::exchange(addr, &Request::mcp(addr.port(), Some(&bearer), &message)).await;
    let full = t0.elapsed();
    let rpc = resp.expect_rpc(1);
    assert_ne!(
        rpc["result"]["isError"],
        json!(true),
        "calibration write: {rpc}"
    );
    assert_eq!(sha256(&std::fs::read(&target).expect("read")), sha_b);
    d.signal(Signal::SIGKILL);
    assert!(
        d.wait_exit(Duration::from_secs(10)).is_some(),
        "daemon killed"
    );
    drop(d);
    // Kills spread over 0 .. 1.5× that, so some land before, during and after the write.
    let span = (full * 3 / 2)
        .max(Duration::from_millis(30))
        .min(Duration::from_millis(500));

    let mut landed = Vec::new();
    for i in 0..ITERATIONS {
        std::fs::write(&target, &a).expect("reset to A");
        let d = Daemon::builder().state_dir(&state).extra(&config).start();
        let bearer = d.bearer();
        let addr = d.loopback_addr();
        let request = Request::mcp(addr.port(), Some(&bearer), &message).to_bytes();
        let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
        within(
            Duration::from_secs(10),
            "send the write",
            stream.write_all(&request),
        )
        .await
        .expect("send the write");
        // 0 .. span, spread evenly (with a stride, so neighbours differ).
        let delay = span * ((i * 17) % ITERATIONS) as u32 / ITERATIONS as u32;
        tokio::time::sleep(delay).await;
        d.signal(Signal::SIGKILL);
        assert!(
            d.wait_exit(Duration::from_secs(10)).is_some(),
            "iteration {i}: the daemon did not die"
        );
        drop(stream);

        let meta = std::fs::symlink_metadata(&target).expect("the target still exists");
        assert!(
            meta.file_type().is_file(),
            "iteration {i}: the target is a regular file"
        );
        let digest = sha256(&std::fs::read(&target).expect("read target"));
        let temps = temp_files(&t.rw);
        let outcome = if digest == sha_b {
            Landed::AfterRename
        } else {
            assert_eq!(
                digest, sha_a,
                "iteration {i}: the target is neither A nor B"
            );
            if temps.is_empty() {
                Landed::BeforeWrite
            } else {
                Landed::MidWrite
            }
        };
        assert!(
            names(&t.rw)
                .iter()
                .all(|n| n == "big.dat" || n.ends_with(".robota-tmp")),
            "iteration {i}: only the target and hidden temp files: {:?}",
            names(&t.rw)
        );
        for temp in temps {
            assert!(temp.starts_with('.'), "a temp file is hidden: {temp}");
            std::fs::remove_file(t.rw.join(temp)).expect("remove leftover temp");
        }
        landed.push(outcome);
        drop(d);
    }
    let count = |l: Landed| landed.iter().filter(|x| **x == l).count();
    eprintln!(
        "crash safety: {ITERATIONS} SIGKILLs spread over {span:?} (one overwrite takes {full:?}): \
         {} before the write, {} mid-write (temp file left, target still A), {} after the rename; {:?} in all",
        count(Landed::BeforeWrite),
        count(Landed::MidWrite),
        count(Landed::AfterRename),
        started.elapsed()
    );
    assert_eq!(landed.len(), ITERATIONS);
    // The kills must span the write: some before it finished (old content) and some after
    // the rename (new content), or the loop proved nothing about the window in between.
    assert!(
        count(Landed::AfterRename) > 0,
        "no kill landed after the rename: the delays never reached the end of the write"
    );
    assert!(
        count(Landed::BeforeWrite) + count(Landed::MidWrite) > 0,
        "no kill landed before the rename: the delays never hit the write"
    );
    t.assert_outside_untouched("after the crash loop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_roots_the_tools_answer_unavailable() {
    let d = Daemon::start(ALLOW_WRITE);
    let c = connect(&d).await;
    let listed = c.tool_names().await;
    assert!(
        listed.iter().any(|n| n == "file.read") && listed.iter().any(|n| n == "file.write"),
        "both tools are listed: {listed:?}"
    );
    let msg = c
        .call("file.read", json!({"path": "/etc/hostname"}))
        .await
        .err("unavailable", "file.read without roots");
    assert!(msg.contains("no file roots are configured"), "{msg}");
    let target = d.dir().join("never.txt");
    let msg = c
        .call(
            "file.write",
            json!({"path": target.display().to_string(), "content": "x"}),
        )
        .await
        .err("unavailable", "file.write without roots");
    assert!(msg.contains("no file roots are configured"), "{msg}");
    assert!(!target.exists());
    c.close().await;
    d.assert_no_secrets();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn size_limits_are_enforced_and_named() {
    let t = Tree::new();
    let d = Daemon::start(&t.config("max_read = \"1KiB\"\nmax_write = \"1KiB\""));
    let c = connect(&d).await;
    let path = t.rw("sized.txt");
    std::fs::write(&path, "x".repeat(3000)).expect("seed");

    let msg = c
        .call("file.read", json!({"path": path, "length": 2048}))
        .await
        .err("invalid_arguments", "read over max_read");
    assert!(msg.contains("1024") && msg.contains("max_read"), "{msg}");
    let r = c
        .call("file.read", json!({"path": path}))
        .await
        .ok("default length");
    assert_eq!(r["length"], 1024, "the default length is max_read");
    assert_eq!(r["size"], 3000);
    assert_eq!(r["sha256"], Value::Null, "no hash of a file over max_read");
    assert_eq!(r["eof"], false);

    let big = t.rw("big.txt");
    let msg = c
        .call(
            "file.write",
            json!({"path": big, "content": "y".repeat(1025)}),
        )
        .await
        .err("invalid_arguments", "write over max_write");
    assert!(msg.contains("1024") && msg.contains("max_write"), "{msg}");
    assert!(!Path::new(&big).exists(), "nothing written");
    c.call(
        "file.write",
        json!({"path": big, "content": "y".repeat(1000)}),
    )
    .await
    .ok("write within max_write");
    let msg = c
        .call(
            "file.write",
            json!({"path": big, "content": "z".repeat(100), "mode": "append"}),
        )
        .await
        .err("invalid_arguments", "append past max_write");
    assert!(msg.contains("1024"), "{msg}");
    assert_eq!(std::fs::read(&big).expect("read").len(), 1000);
    c.close().await;
    d.assert_no_secrets();
}

/// A client that goes away in the middle of an idempotent append, then retries with the
/// same key: the retry never reports `cancelled` (that would invite a retry with a new key
/// and a second append); it gets the first call's real result, or "outcome unknown" when
/// the call was cut off. Either way the content was appended at most once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_interrupted_idempotent_write_is_never_reported_cancelled() {
    let t = Tree::new();
    let d = Daemon::start(&t.config("max_write = \"16MiB\"\n[limits]\nrequest_body = \"16MiB\"\n"));
    let bearer = d.bearer();
    let chunk = "y".repeat(4 * 1024 * 1024);
    let c = McpClient::connect(&d, &bearer).await;
    let addr = d.loopback_addr();
    let mut outcomes = Vec::new();
    for i in 0..6u32 {
        let key = format!("append-{i}");
        let target = t.rw(&format!("log-{i}.txt"));
        std::fs::write(&target, "start\n").expect("seed");
        let args =
            json!({"path": target, "content": chunk, "mode": "append", "idempotency_key": key});
        let message = tools_call(1, "file.write", args.clone());
        let request = Request::mcp(addr.port(), Some(&bearer), &message).to_bytes();
        let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
        within(Duration::from_secs(10), "send", stream.write_all(&request))
            .await
            .expect("send");
        // Hang up at a varying moment: before, during or after the write.
        tokio::time::sleep(Duration::from_millis(u64::from(i) * 15)).await;
        drop(stream);
        // Retry until the first call is settled (a running call answers `busy`).
        let deadline = Instant::now() + Duration::from_secs(20);
        let retry = loop {
            let r = c.call("file.write", args.clone()).await;
            if r.error_code() != Some("busy") {
                break r;
            }
            assert!(Instant::now() < deadline, "the first call never settled");
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        assert_ne!(retry.error_code(), Some("cancelled"), "{retry:?}");
        match retry.error_code() {
            None => outcomes.push("replayed"),
            Some("outcome_unknown") => {
                let message = retry.structured["message"].as_str().unwrap_or_default();
                assert!(message.contains("outcome unknown"), "{message}");
                outcomes.push("unknown");
            }
            Some(other) => panic!("unexpected retry answer {other}: {retry:?}"),
        }
        // One effect at most: the retry under the same key never appended again.
        let size = std::fs::metadata(&target).expect("target").len() as usize;
        assert!(
            size == "start\n".len() || size == "start\n".len() + chunk.len(),
            "iteration {i}: {size} bytes is not zero or one append"
        );
        if outcomes.last() == Some(&"replayed") {
            assert_eq!(
                size,
                "start\n".len() + chunk.len(),
                "a replayed success landed once"
            );
        }
    }
    eprintln!("interrupted idempotent appends: {outcomes:?}");
    c.close().await;
}

/// `[tools.file]` with one write root.
fn write_root_config(root: &Path) -> String {
    format!(
        "[tools.file]\nwrite_roots = [\"{}\"]\n{ALLOW_WRITE}",
        root.display()
    )
}

/// `check-config` and a start with `config` both fail with the configuration exit code,
/// naming `key` and saying `problem`; the daemon never gets ready.
fn refused_by_check_and_start(config: &str, key: &str, problem: &str) {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("config.toml");
    std::fs::write(&path, config).expect("write config");
    let out = check_config(&path);
    out.expect_code(EXIT_CONFIG, "check-config");
    assert!(
        out.stderr.contains(key) && out.stderr.contains(problem),
        "check-config must name {key} and say {problem:?}: {}",
        out.stderr
    );

    let d = Daemon::builder().extra(config).spawn();
    let status = d
        .wait_exit(READY_LIMIT)
        .expect("the daemon did not exit on an unsafe root");
    assert_eq!(status.code(), Some(EXIT_CONFIG), "{}", d.stderr_text());
    assert_eq!(d.notify().count("READY=1"), 0, "{:?}", d.notify().lines());
    let stderr = d.stderr_text();
    assert!(
        stderr.contains(key) && stderr.contains(problem),
        "start must name {key} and say {problem:?}: {stderr}"
    );
}

/// The reported attack: a write root below a world-writable sticky directory, whose middle
/// component belongs to another user (uid 65534). That user could swap the root for a
/// link to anywhere, so the root is refused before anything is served.
#[test]
fn a_root_another_user_could_swap_is_refused_at_start_and_by_check_config() {
    let dir = tempfile::Builder::new()
        .prefix("files-e2e-")
        .tempdir()
        .expect("tempdir");
    let public = dir.path().join("public");
    std::fs::create_dir(&public).expect("mkdir");
    std::fs::set_permissions(&public, std::fs::Permissions::from_mode(0o1777)).expect("chmod");
    let theirs = public.join("app");
    std::fs::create_dir(&theirs).expect("mkdir");
    nix::unistd::chown(&theirs, Some(nix::unistd::Uid::from_raw(65534)), None).expect("chown");
    let root = theirs.join("conf");
    std::fs::create_dir(&root).expect("mkdir");
    refused_by_check_and_start(
        &write_root_config(&root),
        "tools.file.write_roots[0]",
        &format!("{} is owned by uid 65534", theirs.display()),
    );

    // A root that is itself a link, and one that does not exist, are refused the same way.
    let link = dir.path().join("link");
    symlink(&root, &link).expect("symlink");
    refused_by_check_and_start(
        &write_root_config(&link),
        "tools.file.write_roots[0]",
        "is a symbolic link",
    );
    refused_by_check_and_start(
        &format!(
            "[tools.file]\nread_roots = [\"{}\"]\n",
            dir.path().join("missing").display()
        ),
        "tools.file.read_roots[0]",
        "does not exist",
    );
}

/// After start, the write root's parent is renamed away and a link to a directory outside
/// every root takes its name: a write to the root's path lands in the directory the daemon
/// opened at start, and the outside file is untouched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_root_swapped_after_start_still_means_the_directory_opened_at_start() {
    let dir = tempfile::Builder::new()
        .prefix("files-e2e-")
        .tempdir()
        .expect("tempdir");
    let base = dir.path();
    let parent = base.join("app");
    let root = parent.join("conf");
    std::fs::create_dir_all(&root).expect("mkdir");
    std::fs::write(root.join("settings"), "original").expect("seed");
    // The decoy: `decoy/conf` leads to `outside`, which holds the file to protect.
    let outside = base.join("outside");
    std::fs::create_dir(&outside).expect("mkdir");
    std::fs::write(outside.join("settings"), SECRET).expect("secret");
    std::fs::create_dir(base.join("decoy")).expect("mkdir");
    symlink(&outside, base.join("decoy/conf")).expect("symlink");

    let d = Daemon::start(&write_root_config(&root));
    let c = connect(&d).await;
    let path = root.join("settings").display().to_string();
    c.call("file.read", json!({"path": path}))
        .await
        .ok("read before the swap");

    std::fs::rename(&parent, base.join("app-moved")).expect("rename the parent away");
    symlink(base.join("decoy"), &parent).expect("link in its place");
    assert_eq!(
        std::fs::read_to_string(&path).expect("by path"),
        SECRET,
        "by path, the root now leads outside"
    );

    let r = c
        .call(
            "file.write",
            json!({"path": path, "content": "written", "mode": "overwrite"}),
        )
        .await;
    assert_no_secret(&r, "write after the swap");
    r.ok("write after the swap");
    assert_eq!(
        std::fs::read_to_string(base.join("app-moved/conf/settings")).expect("moved"),
        "written",
        "the write lands in the directory opened at start"
    );
    let r = c.call("file.read", json!({"path": path})).await;
    assert_no_secret(&r, "read after the swap");
    assert_eq!(
        std::fs::read_to_string(outside.join("settings")).expect("outside"),
        SECRET,
        "the outside file is untouched"
    );
    assert_eq!(names(&outside), vec!["settings".to_owned()]);
    c.close().await;
}

/// A name longer than the filesystem allows is the caller's mistake, on both tools.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_name_too_long_for_the_filesystem_is_invalid_arguments() {
    let t = Tree::new();
    let d = Daemon::start(&t.config(""));
    let c = connect(&d).await;
    let long = t.rw(&"n".repeat(256));
    for mode in ["create", "overwrite", "append"] {
        let msg = c
            .call(
                "file.write",
                json!({"path": long, "content": "x", "mode": mode}),
            )
            .await
            .err("invalid_arguments", "a 256-byte name");
        assert!(msg.contains("longer than the filesystem allows"), "{msg}");
    }
    let msg = c
        .call("file.read", json!({"path": long}))
        .await
        .err("invalid_arguments", "a 256-byte name");
    assert!(msg.contains("longer than the filesystem allows"), "{msg}");
    assert!(temp_files(&t.rw).is_empty());
    c.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_approved_call_whose_arguments_are_refused_keeps_its_approval() {
    let t = Tree::new();
    let d = Daemon::start(&format!(
        "[tools.file]\nwrite_roots = [\"{}\"]\n\n[[policy]]\ncallers = [\"bearer:*\"]\ntools = [\"file.write\"]\ndecision = \"approve-each\"\n",
        t.rw.display()
    ));
    let c = connect(&d).await;
    let call = json!({"path": "relative.txt", "content": "x"});
    let asked = c
        .call("file.write", call.clone())
        .await
        .err("interactive_permission_required", "first call");
    let id: String = asked
        .split("approval ")
        .filter_map(|rest| rest.split_whitespace().next())
        .find(|word| word.chars().all(|c| c.is_ascii_digit()))
        .unwrap_or_else(|| panic!("no approval id in {asked}"))
        .to_owned();
    d.ctl_ok(&["grants", "approve", &id]);
    // Approved, it runs and the tool refuses its path: the call had no effect.
    let refused = c
        .call("file.write", call.clone())
        .await
        .err("invalid_arguments", "the approved call");
    assert!(refused.contains("absolute"), "{refused}");
    // So the approval is not spent: it is still approved, not used.
    let listed = d.ctl_ok(&["--json", "grants", "list", "--all"]);
    let grants: Value = serde_json::from_str(&listed.stdout).expect("json");
    let grant = grants["grants"]
        .as_array()
        .expect("grants")
        .iter()
        .find(|g| g["grant_id"].as_i64().map(|n| n.to_string()).as_deref() == Some(id.as_str()))
        .unwrap_or_else(|| panic!("no grant {id}: {grants}"))
        .clone();
    assert_eq!(grant["state"], "approved", "{grant}");
    d.assert_no_secrets();
}
