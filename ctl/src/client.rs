//! The control-socket client: find the socket, send one request line, read one reply line.

use std::fs;
use std::io::{self, BufRead, BufReader, Read, Write};
use std::os::unix::fs::FileTypeExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use robota_proto::{Outcome, PROTOCOL_VERSION, Reply, Request, Response};

use crate::error::CtlError;

/// Read and write timeout on the socket; a restart can take ~20 s.
pub const IO_TIMEOUT: Duration = Duration::from_secs(30);

/// Largest reply line we accept, newline included.
pub const MAX_REPLY_BYTES: usize = 16 * 1024 * 1024;

/// The system-wide socket, used when no per-user socket exists.
pub const SYSTEM_SOCKET: &str = "/run/robota-mcpd/control.sock";

/// The socket to use when neither `--socket` nor `ROBOTA_MCPD_SOCKET` names one:
/// `$XDG_RUNTIME_DIR/robota-mcpd/control.sock` if that exists, else [`SYSTEM_SOCKET`].
pub fn default_socket(xdg_runtime_dir: Option<&Path>) -> PathBuf {
    if let Some(dir) = xdg_runtime_dir.filter(|dir| dir.is_absolute()) {
        let user = dir.join("robota-mcpd").join("control.sock");
        if user.exists() {
            return user;
        }
    }
    PathBuf::from(SYSTEM_SOCKET)
}

/// Sends `request` to the daemon at `socket` and returns its successful reply.
pub fn call(socket: &Path, request: &Request) -> Result<Reply, CtlError> {
    let stream = connect(socket)?;
    let line = exchange(&stream, request).map_err(|err| err.into_ctl(socket))?;
    match decode_reply(&line)?.outcome {
        Outcome::Ok(reply) => Ok(*reply),
        Outcome::Error(error) => Err(CtlError::Daemon(error)),
    }
}

/// Opens an MCP relay: sends `mcp`, checks the reply, and hands back the connection,
/// which from now on carries newline-delimited JSON-RPC (no time-outs: it lives as long
/// as the client's session).
pub fn open_mcp(socket: &Path) -> Result<UnixStream, CtlError> {
    let stream = connect(socket)?;
    let line = exchange(&stream, &Request::new(robota_proto::Command::Mcp))
        .map_err(|err| err.into_ctl(socket))?;
    match decode_reply(&line)?.outcome {
        Outcome::Ok(reply) if matches!(*reply, Reply::Mcp) => {}
        Outcome::Ok(_) => return Err(CtlError::Protocol("expected an \"mcp\" reply".into())),
        Outcome::Error(error) => return Err(CtlError::Daemon(error)),
    }
    let set = |source| CtlError::Connect {
        socket: socket.to_owned(),
        source,
    };
    stream.set_read_timeout(None).map_err(set)?;
    stream.set_write_timeout(None).map_err(set)?;
    Ok(stream)
}

fn connect(socket: &Path) -> Result<UnixStream, CtlError> {
    let stream = UnixStream::connect(socket).map_err(|err| connect_error(socket, err))?;
    let set = |source| CtlError::Connect {
        socket: socket.to_owned(),
        source,
    };
    stream.set_read_timeout(Some(IO_TIMEOUT)).map_err(set)?;
    stream.set_write_timeout(Some(IO_TIMEOUT)).map_err(set)?;
    Ok(stream)
}

fn connect_error(socket: &Path, source: io::Error) -> CtlError {
    let socket = socket.to_owned();
    match source.kind() {
        io::ErrorKind::NotFound => CtlError::NoSocket { socket },
        io::ErrorKind::ConnectionRefused if is_socket(&socket) => CtlError::NotListening { socket },
        io::ErrorKind::ConnectionRefused => CtlError::NotASocket { socket },
        // std maps both EACCES and EPERM here.
        io::ErrorKind::PermissionDenied => CtlError::SocketPermission {
            group: socket_group(&socket),
            socket,
            source,
        },
        _ => CtlError::Connect { socket, source },
    }
}

/// The group owning `socket` (its name from /etc/group, else its number), if it can be
/// read: who may connect besides its owner.
fn socket_group(socket: &Path) -> Option<String> {
    use std::os::unix::fs::MetadataExt as _;
    let gid = fs::metadata(socket).ok()?.gid();
    let named = fs::read_to_string("/etc/group").ok().and_then(|groups| {
        groups.lines().find_map(|line| {
            let mut fields = line.split(':');
            let name = fields.next()?;
            (fields.nth(1)?.parse::<u32>().ok()? == gid).then(|| name.to_owned())
        })
    });
    Some(named.unwrap_or_else(|| format!("gid {gid}")))
}

fn is_socket(path: &Path) -> bool {
    fs::metadata(path).is_ok_and(|meta| meta.file_type().is_socket())
}

/// Why one request/reply exchange failed, before we know the socket path.
#[derive(Debug)]
enum ExchangeError {
    Io(&'static str, io::Error),
    Timeout,
    Protocol(String),
}

impl ExchangeError {
    fn from_io(during: &'static str, err: io::Error) -> Self {
        match err.kind() {
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => ExchangeError::Timeout,
            _ => ExchangeError::Io(during, err),
        }
    }

    fn into_ctl(self, socket: &Path) -> CtlError {
        let socket = socket.to_owned();
        match self {
            ExchangeError::Io(during, source) => CtlError::Transport {
                socket,
                during,
                source,
            },
            ExchangeError::Timeout => CtlError::Timeout {
                socket,
                secs: IO_TIMEOUT.as_secs(),
            },
            ExchangeError::Protocol(detail) => CtlError::Protocol(detail),
        }
    }
}

/// Writes one request line and reads one reply line (without its newline).
///
/// A daemon that refuses the peer answers and closes without reading; then our write may
/// fail with EPIPE while its refusal is already waiting in our receive buffer, so a failed
/// write still tries to read the reply before reporting the write error.
fn exchange<S>(stream: S, request: &Request) -> Result<Vec<u8>, ExchangeError>
where
    S: Read + Write,
{
    let mut stream = stream;
    let mut frame = serde_json::to_vec(request)
        .map_err(|err| ExchangeError::Protocol(format!("cannot encode the request: {err}")))?;
    frame.push(b'\n');
    let written = stream.write_all(&frame).and_then(|()| stream.flush());

    let limit = u64::try_from(MAX_REPLY_BYTES).unwrap_or(u64::MAX);
    let mut reader = BufReader::new(stream.take(limit));
    let mut line = Vec::new();
    let read = reader.read_until(b'\n', &mut line);

    if line.last() == Some(&b'\n') {
        line.pop();
        return Ok(line);
    }
    if let Err(err) = written {
        return Err(ExchangeError::from_io("cannot send the request", err));
    }
    match read {
        Err(err) if line.is_empty() => Err(ExchangeError::from_io("cannot read the reply", err)),
        Ok(0) => Err(ExchangeError::Protocol(
            "robota-mcpd closed the connection without answering".into(),
        )),
        _ if line.len() >= MAX_REPLY_BYTES => Err(ExchangeError::Protocol(format!(
            "reply longer than {MAX_REPLY_BYTES} bytes"
        ))),
        _ => Err(ExchangeError::Protocol(
            "reply ended before its newline".into(),
        )),
    }
}

/// Parses one reply line, refusing any protocol version but ours.
///
/// When the line carries a bearer secret, the parse error is reduced to its position so
/// that no part of the secret can end up on stderr.
pub fn decode_reply(line: &[u8]) -> Result<Response, CtlError> {
    let value: serde_json::Value = serde_json::from_slice(line)
        .map_err(|err| CtlError::Protocol(format!("reply is not JSON: {err}")))?;
    match value.get("v").map(serde_json::Value::as_u64) {
        Some(Some(v)) if v == u64::from(PROTOCOL_VERSION) => {}
        Some(Some(v)) => {
            return Err(CtlError::Protocol(format!(
                "robota-mcpd speaks control protocol v{v}, this robota-mcpctl speaks \
                 v{PROTOCOL_VERSION}"
            )));
        }
        _ => {
            return Err(CtlError::Protocol(
                "reply has no protocol version `v`".into(),
            ));
        }
    }
    let carries_secret = value.pointer("/ok/secret").is_some();
    serde_json::from_value(value).map_err(|err| {
        CtlError::Protocol(if carries_secret {
            "malformed bearer reply".to_owned()
        } else {
            format!("malformed reply: {err}")
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use robota_proto::{Command, ErrorCode, Secret};
    use std::thread;

    fn serve(answer: &'static [u8], read_first: bool) -> UnixStream {
        let (client, mut server) = UnixStream::pair().expect("socketpair");
        thread::spawn(move || {
            if read_first {
                let mut line = String::new();
                BufReader::new(&server).read_line(&mut line).expect("read");
                assert!(line.ends_with('\n'), "request must be newline-terminated");
            }
            server.write_all(answer).expect("write");
        });
        client
    }

    #[test]
    fn one_line_each_way() {
        let client = serve(b"{\"v\":1,\"ok\":{\"kind\":\"stopping\"}}\n", true);
        let line = exchange(&client, &Request::new(Command::Stop)).expect("exchange");
        let response = decode_reply(&line).expect("decode");
        assert_eq!(response, robota_proto::Response::ok(Reply::Stopping));
    }

    #[test]
    fn a_refusal_sent_before_reading_is_still_seen() {
        let client = serve(
            b"{\"v\":1,\"error\":{\"code\":\"permission-denied\",\"message\":\"uid 7\"}}\n",
            false,
        );
        let line = exchange(&client, &Request::new(Command::Status)).expect("exchange");
        let response = decode_reply(&line).expect("decode");
        assert_eq!(
            response,
            Response::error(ErrorCode::PermissionDenied, "uid 7")
        );
    }

    #[test]
    fn silence_and_truncation_are_protocol_errors() {
        let closed = serve(b"", true);
        assert!(matches!(
            exchange(&closed, &Request::new(Command::Status)),
            Err(ExchangeError::Protocol(_))
        ));
        let truncated = serve(b"{\"v\":1,", true);
        assert!(matches!(
            exchange(&truncated, &Request::new(Command::Status)),
            Err(ExchangeError::Protocol(_))
        ));
    }

    #[test]
    fn other_versions_and_garbage_are_refused() {
        for line in [
            &b"{\"v\":2,\"ok\":{\"kind\":\"stopping\"}}"[..],
            b"{\"ok\":{\"kind\":\"stopping\"}}",
            b"{\"v\":\"1\",\"ok\":{\"kind\":\"stopping\"}}",
            b"not json",
            b"{\"v\":1,\"ok\":{\"kind\":\"launch-missiles\"}}",
            b"{\"v\":1,\"error\":{\"code\":\"teapot\",\"message\":\"x\"}}",
        ] {
            let err = decode_reply(line).expect_err("must be refused");
            assert!(matches!(err, CtlError::Protocol(_)), "{err:?}");
        }
    }

    #[test]
    fn malformed_bearer_replies_do_not_echo_the_secret() {
        let line = br#"{"v":1,"ok":{"kind":"bearer","label":"x","secret":"TOPSECRET","expires_at":"TOPSECRET"}}"#;
        let err = decode_reply(line).expect_err("must be refused");
        assert!(!err.report().contains("TOPSECRET"), "{}", err.report());
        let good = br#"{"v":1,"ok":{"kind":"bearer","label":"x","secret":"s"}}"#;
        let ok = decode_reply(good).expect("decode");
        assert_eq!(
            ok,
            Response::ok(Reply::Bearer {
                label: "x".into(),
                secret: Secret("s".into()),
                expires_at: None
            })
        );
    }

    #[test]
    fn connect_failures_map_to_distinct_exit_codes() {
        use robota_proto::exit;
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("control.sock");
        let code = |errno| connect_error(&path, io::Error::from_raw_os_error(errno)).exit_code();
        // ENOENT, ECONNREFUSED (no file at all here), EACCES, EPERM, ENOTDIR.
        assert_eq!(code(2), exit::NOT_RUNNING);
        assert_eq!(code(111), exit::NOT_RUNNING);
        assert_eq!(code(13), exit::PERMISSION_DENIED);
        assert_eq!(code(1), exit::PERMISSION_DENIED);
        assert_eq!(code(20), exit::FAILED);
    }

    #[test]
    fn default_socket_prefers_an_existing_user_socket() {
        let dir = tempfile::tempdir().expect("tempdir");
        assert_eq!(default_socket(None), PathBuf::from(SYSTEM_SOCKET));
        assert_eq!(
            default_socket(Some(dir.path())),
            PathBuf::from(SYSTEM_SOCKET)
        );
        assert_eq!(
            default_socket(Some(Path::new("relative"))),
            PathBuf::from(SYSTEM_SOCKET)
        );
        let user = dir.path().join("robota-mcpd").join("control.sock");
        std::fs::create_dir(dir.path().join("robota-mcpd")).expect("mkdir");
        std::fs::write(&user, b"").expect("touch");
        assert_eq!(default_socket(Some(dir.path())), user);
    }
}
