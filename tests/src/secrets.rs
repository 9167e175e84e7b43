//! Secret hygiene: every bearer the harness sees is registered, and captured outputs,
//! command lines and files are scanned for them.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;

/// Panics if `text` (found at `place`) contains any of `secrets`.
pub fn assert_no_secrets(secrets: &[String], text: &str, place: &str) {
    for (i, s) in secrets.iter().enumerate() {
        assert!(!s.is_empty(), "empty secret registered");
        assert!(
            !text.contains(s.as_str()),
            "bearer secret #{i} (of {} seen by the harness) appears in {place}",
            secrets.len()
        );
    }
}

/// Panics if a group- or world-readable regular file under `root` contains a secret.
pub fn assert_no_secrets_in_readable_files(secrets: &[String], root: &Path) {
    let Ok(entries) = std::fs::read_dir(root) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let Ok(meta) = std::fs::symlink_metadata(&path) else {
            continue;
        };
        if meta.is_dir() {
            assert_no_secrets_in_readable_files(secrets, &path);
        } else if meta.is_file() && meta.len() <= 64 * 1024 * 1024 {
            if meta.permissions().mode() & 0o044 == 0 {
                continue;
            }
            let Ok(bytes) = std::fs::read(&path) else {
                continue;
            };
            let text = String::from_utf8_lossy(&bytes);
            assert_no_secrets(
                secrets,
                &text,
                &format!(
                    "readable file {} (mode {:o})",
                    path.display(),
                    meta.permissions().mode()
                ),
            );
        }
    }
}

/// True if `s` is exactly a 256-bit bearer: 64 lowercase hex characters.
pub fn is_bearer_text(s: &str) -> bool {
    s.len() == 64
        && s.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}
