//! Every way a `robota-mcpctl` run can fail, and the exit code each one maps to.
//!
//! No variant ever holds a bearer secret, so no message can show one.

use std::error::Error;
use std::fmt;
use std::io;
use std::path::PathBuf;

use robota_proto::{ErrorCode, ErrorReply, exit};

use crate::render::clean;

#[derive(Debug)]
pub enum CtlError {
    /// No socket file at the path (ENOENT).
    NoSocket { socket: PathBuf },
    /// A socket file, but nobody accepts on it (ECONNREFUSED).
    NotListening { socket: PathBuf },
    /// Something other than a socket sits at the path (also ECONNREFUSED).
    NotASocket { socket: PathBuf },
    /// The socket's mode refused us (EACCES / EPERM).
    SocketPermission {
        socket: PathBuf,
        /// The socket's group, whose members may connect.
        group: Option<String>,
        source: io::Error,
    },
    /// Any other connect failure.
    Connect { socket: PathBuf, source: io::Error },
    /// Sending the request or reading the reply failed.
    Transport {
        socket: PathBuf,
        during: &'static str,
        source: io::Error,
    },
    /// No reply within the I/O timeout.
    Timeout { socket: PathBuf, secs: u64 },
    /// The daemon spoke something we do not understand.
    Protocol(String),
    /// The daemon answered with an error frame.
    Daemon(ErrorReply),
    /// The `--output` file could not be created or written.
    Output {
        path: PathBuf,
        what: &'static str,
        source: io::Error,
    },
    /// Writing to our own stdout failed (e.g. a closed pipe).
    Stdout(io::Error),
}

impl CtlError {
    /// The process exit code for this failure (see [`robota_proto::exit`]).
    pub fn exit_code(&self) -> i32 {
        match self {
            CtlError::NoSocket { .. }
            | CtlError::NotListening { .. }
            | CtlError::NotASocket { .. } => exit::NOT_RUNNING,
            CtlError::SocketPermission { .. } => exit::PERMISSION_DENIED,
            CtlError::Daemon(reply) if reply.code == ErrorCode::PermissionDenied => {
                exit::PERMISSION_DENIED
            }
            CtlError::Daemon(reply) if reply.code == ErrorCode::InvalidConfig => {
                exit::INVALID_CONFIG
            }
            CtlError::Protocol(_) => exit::PROTOCOL,
            CtlError::Connect { .. }
            | CtlError::Transport { .. }
            | CtlError::Timeout { .. }
            | CtlError::Daemon(_)
            | CtlError::Output { .. }
            | CtlError::Stdout(_) => exit::FAILED,
        }
    }

    /// The message and its whole source chain, for the one line printed on stderr.
    pub fn report(&self) -> String {
        let mut text = self.to_string();
        let mut source = self.source();
        while let Some(err) = source {
            text.push_str(": ");
            text.push_str(&err.to_string());
            source = err.source();
        }
        text
    }
}

impl fmt::Display for CtlError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CtlError::NoSocket { socket } => write!(
                f,
                "robota-mcpd is not running (no control socket at {})",
                socket.display()
            ),
            CtlError::NotListening { socket } => write!(
                f,
                "robota-mcpd is not running (nothing listening on {})",
                socket.display()
            ),
            CtlError::NotASocket { socket } => write!(
                f,
                "robota-mcpd is not running ({} is not a socket)",
                socket.display()
            ),
            CtlError::SocketPermission { socket, group, .. } => write!(
                f,
                "permission denied on the control socket {}: only its owner and the members \
                 of its group{} may connect (usermod -aG, then log in again), and the daemon \
                 then admits root, its own user, and [control] allow_uids / allow_gids",
                socket.display(),
                group
                    .as_deref()
                    .map(|g| format!(" ({g})"))
                    .unwrap_or_default()
            ),
            CtlError::Connect { socket, .. } => {
                write!(f, "cannot connect to {}", socket.display())
            }
            CtlError::Transport { socket, during, .. } => {
                write!(f, "{during} on {}", socket.display())
            }
            CtlError::Timeout { socket, secs } => write!(
                f,
                "robota-mcpd did not answer within {secs}s on {}",
                socket.display()
            ),
            CtlError::Protocol(detail) => write!(f, "protocol error: {}", clean(detail)),
            CtlError::Daemon(reply) => write!(f, "{}: {}", reply.code, clean(&reply.message)),
            CtlError::Output { path, what, .. } => write!(f, "{what} {}", path.display()),
            CtlError::Stdout(_) => f.write_str("cannot write to stdout"),
        }
    }
}

impl Error for CtlError {
    fn source(&self) -> Option<&(dyn Error + 'static)> {
        match self {
            CtlError::SocketPermission { source, .. }
            | CtlError::Connect { source, .. }
            | CtlError::Transport { source, .. }
            | CtlError::Output { source, .. }
            | CtlError::Stdout(source) => Some(source),
            CtlError::NoSocket { .. }
            | CtlError::NotListening { .. }
            | CtlError::NotASocket { .. }
            | CtlError::Timeout { .. }
            | CtlError::Protocol(_)
            | CtlError::Daemon(_) => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn daemon(code: ErrorCode) -> CtlError {
        CtlError::Daemon(ErrorReply {
            code,
            message: "nope".into(),
        })
    }

    #[test]
    fn daemon_errors_map_to_failed_except_permission_and_configuration() {
        for code in ErrorCode::ALL {
            let want = match code {
                ErrorCode::PermissionDenied => exit::PERMISSION_DENIED,
                ErrorCode::InvalidConfig => exit::INVALID_CONFIG,
                _ => exit::FAILED,
            };
            assert_eq!(daemon(code).exit_code(), want, "{code}");
        }
        assert_eq!(
            daemon(ErrorCode::NotFound).report(),
            "not-found: nope",
            "daemon errors print as <code>: <message>"
        );
    }

    #[test]
    fn report_prints_the_source_chain_once() {
        let err = CtlError::Output {
            path: "/x/y".into(),
            what: "cannot create",
            source: io::Error::from(io::ErrorKind::AlreadyExists),
        };
        assert_eq!(err.report(), "cannot create /x/y: entity already exists");
        assert_eq!(err.exit_code(), exit::FAILED);
    }
}
