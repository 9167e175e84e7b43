//! The `--output FILE` target for a bearer secret: a new file, mode 0600, never overwritten.
//!
//! The file is created *before* the daemon is asked for a secret, so an existing file
//! refuses the command without minting or rotating anything. If no secret gets written
//! (the daemon refused, the write failed), the file is removed again.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use robota_proto::Secret;

use crate::error::CtlError;

#[derive(Debug)]
pub struct SecretFile {
    path: PathBuf,
    file: Option<File>,
}

impl SecretFile {
    /// Creates `path` with O_CREAT|O_EXCL and mode 0600; refuses an existing path.
    pub fn create(path: &Path) -> Result<Self, CtlError> {
        let file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(path)
            .map_err(|source| CtlError::Output {
                path: path.to_owned(),
                what: if source.kind() == io::ErrorKind::AlreadyExists {
                    "refusing to overwrite"
                } else {
                    "cannot create"
                },
                source,
            })?;
        Ok(Self {
            path: path.to_owned(),
            file: Some(file),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Writes the secret and a newline and syncs it to disk; keeps the file.
    pub fn write(mut self, secret: &Secret) -> Result<(), CtlError> {
        let Some(mut file) = self.file.take() else {
            return Ok(());
        };
        let written = file
            .write_all(secret.expose().as_bytes())
            .and_then(|()| file.write_all(b"\n"))
            .and_then(|()| file.sync_all());
        match written {
            Ok(()) => Ok(()),
            Err(source) => {
                // Dropping `self` now would find no file handle; remove explicitly.
                let _ = fs::remove_file(&self.path);
                Err(CtlError::Output {
                    path: self.path.clone(),
                    what: "the bearer was issued but could not be written to",
                    source,
                })
            }
        }
    }
}

impl Drop for SecretFile {
    /// A file that never received its secret is removed, so a retry can use the same path.
    fn drop(&mut self) {
        if self.file.take().is_some() {
            let _ = fs::remove_file(&self.path);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn new_file_is_0600_and_holds_the_secret() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("token");
        let out = SecretFile::create(&path).expect("create");
        out.write(&Secret("abc".into())).expect("write");
        let meta = fs::metadata(&path).expect("metadata");
        assert_eq!(meta.permissions().mode() & 0o777, 0o600);
        assert_eq!(fs::read_to_string(&path).expect("read"), "abc\n");
    }

    #[test]
    fn existing_files_are_refused_and_left_alone() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("token");
        fs::write(&path, "keep").expect("seed");
        let err = SecretFile::create(&path).expect_err("must refuse");
        assert!(err.report().starts_with("refusing to overwrite"), "{err:?}");
        assert_eq!(fs::read_to_string(&path).expect("read"), "keep");
    }

    #[test]
    fn an_unused_file_is_removed() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("token");
        drop(SecretFile::create(&path).expect("create"));
        assert!(!path.exists());
    }
}
