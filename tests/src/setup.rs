//! What a test needs beyond the Rust toolchain, set up on first use by `tests/setup.sh`,
//! the one definition of it (`tests/run` runs every part before the suite; a narrow
//! `cargo test` gets here instead). Each part runs at most once per test binary; the
//! script itself holds a lock, so parallel test binaries wait for each other.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use crate::daemon::run_bounded;

/// The longest any part may take (the image: a debootstrap from Debian's registry).
const LIMIT: Duration = Duration::from_secs(1200);

/// The script, beside this crate's manifest.
fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("setup.sh")
}

/// Runs `tests/setup.sh PART` once per process; panics with its message when it fails.
/// Returns what the part printed on stdout (for `image-dir`, the image's directory).
pub fn ensure(part: &str) -> String {
    static DONE: OnceLock<Mutex<HashMap<String, String>>> = OnceLock::new();
    let done = DONE.get_or_init(Default::default);
    let mut done = done.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(out) = done.get(part) {
        return out.clone();
    }
    let mut cmd = Command::new("bash");
    cmd.arg(script()).arg(part);
    // The script's target directory is this test's: `target/<profile>/..`.
    cmd.env("CARGO_TARGET_DIR", target_dir());
    let out = run_bounded(cmd, LIMIT);
    assert!(
        out.status.success(),
        "tests/setup.sh {part} failed ({:?}):\n{}",
        out.status,
        out.stderr
    );
    let stdout = out.stdout.trim().to_owned();
    done.insert(part.to_owned(), stdout.clone());
    stdout
}

/// The target directory the test binaries were built into.
pub fn target_dir() -> PathBuf {
    crate::bin_dir()
        .parent()
        .expect("target/<profile> has a parent")
        .to_path_buf()
}
