//! The control socket: a unix stream socket speaking the `robota-proto` wire schema.
//!
//! Socket hygiene: the runtime directory is created if missing, a lock file next to the
//! socket is held for the daemon's lifetime (a second daemon fails fast), a stale socket
//! is removed only while holding that lock, and the socket is created under the daemon's
//! 0077 umask and then opened to 0660. Every connection is checked with SO_PEERCRED.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use nix::fcntl::{Flock, FlockArg};
use robota_proto::{Command, ErrorCode, MAX_REQUEST_BYTES, Request, Response};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{UnixListener, UnixStream};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::audit::{Audit, Record};
use crate::config::ControlConfig;
use crate::metrics::Metrics;
use crate::vocab::{AddressClass, Carrier, Reason};

/// Most control connections of uids other than root served at once (relayed MCP
/// sessions included).
const MAX_CONNECTIONS: usize = 64;
/// Most connections one uid other than root holds at once (a relayed MCP session of
/// each desktop client, an `audit --follow`, a few commands).
const MAX_PER_UID: usize = 16;
/// Most connections root holds at once. Root's do not count toward [`MAX_CONNECTIONS`], so
/// no allowed peer, nor a few of them, can lock root out.
const ROOT_MAX: usize = 64;
/// How long shutdown waits for open control connections.
const DRAIN_BOUND: Duration = Duration::from_secs(2);
/// How long a connection may sit between requests.
const IDLE_TIMEOUT: Duration = Duration::from_secs(60);
/// How long one request may take to arrive once its first byte has: a frame trickled in
/// slowly does not hold a connection for long.
const FRAME_TIMEOUT: Duration = Duration::from_secs(10);

/// Who is on the other end of a control connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Peer {
    pub uid: u32,
    pub gid: u32,
    pub pid: Option<i32>,
}

/// The read half of a control connection, with whatever it has buffered.
pub type ControlReader = BufReader<OwnedReadHalf>;

/// What the daemon does with an allowed command.
pub trait ControlApi: Send + Sync + 'static {
    fn handle(&self, command: Command, peer: Peer) -> impl Future<Output = Response> + Send;

    /// `mcp`: answer the request (an `mcp` reply, or an error) on `writer`, then serve
    /// MCP on the connection until either side ends it.
    fn serve_mcp(
        &self,
        reader: ControlReader,
        writer: OwnedWriteHalf,
        peer: Peer,
    ) -> impl Future<Output = ()> + Send;
}

#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    #[error("cannot create the runtime directory {path}")]
    RuntimeDir {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot open the lock file {path}")]
    Lock {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("another robota-mcpd holds {path}; is the daemon already running?")]
    Locked { path: PathBuf },
    #[error("cannot bind the control socket {path}")]
    Bind {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// A bound control socket and the lock that guards its path.
pub struct ControlSocket {
    listener: UnixListener,
    path: PathBuf,
    _lock: Flock<File>,
}

impl ControlSocket {
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for ControlSocket {
    fn drop(&mut self) {
        // Still holding the lock, so the path is ours to remove.
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Create the directory, take the lock, clear a stale socket and bind.
pub fn bind(config: &ControlConfig) -> Result<ControlSocket, ControlError> {
    let path = config.socket.clone();
    if let Some(dir) = path.parent()
        && !dir.is_dir()
    {
        std::fs::create_dir_all(dir).map_err(|source| ControlError::RuntimeDir {
            path: dir.to_owned(),
            source,
        })?;
        // Peers need to traverse the directory we made to reach the 0660 socket. One that
        // was there is left as it is (a shared 1777 directory keeps its sticky bit).
        let _ = std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755));
    }
    let lock_path = path.with_extension("lock");
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(&lock_path)
        .map_err(|source| ControlError::Lock {
            path: lock_path.clone(),
            source,
        })?;
    let lock =
        Flock::lock(file, FlockArg::LockExclusiveNonblock).map_err(|_| ControlError::Locked {
            path: lock_path.clone(),
        })?;
    match std::fs::remove_file(&path) {
        Ok(()) => tracing::info!(path = %path.display(), "removed a stale control socket"),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(source) => return Err(ControlError::Bind { path, source }),
    }
    let listener = UnixListener::bind(&path).map_err(|source| ControlError::Bind {
        path: path.clone(),
        source,
    })?;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o660)).map_err(|source| {
        ControlError::Bind {
            path: path.clone(),
            source,
        }
    })?;
    Ok(ControlSocket {
        listener,
        path,
        _lock: lock,
    })
}

/// Why `peer` is refused as one of the daemon's confined upstreams (or a process one
/// started), if it is or may be one. A confined upstream runs as the daemon's user under
/// more system-call filters than the daemon, which only the upstream launcher's added
/// filter gives it (`upstream/confine.rs`); filters cannot be removed, so neither can the
/// mark. A peer of the daemon's own user must therefore be shown to run under no more
/// filters than the daemon, and what cannot be shown is refused: a connecting process
/// that has exited since (its socket handed to its parent), one whose `/proc` status
/// cannot be read, one in another PID namespace. The status is read between taking a
/// pidfd of the connecting process from the socket and seeing through it that the
/// process is still alive, so it is that process's status and not one that reused its
/// pid (on kernels before 6.5, which have no `SO_PEERPIDFD`, only the pid is read).
fn confined_upstream(stream: &UnixStream, peer: &Peer, own_uid: u32) -> Option<&'static str> {
    use nix::errno::Errno;
    use nix::sys::socket::{getsockopt, sockopt::PeerPidfd};
    use robota_sys::seccomp_filters as filters_of;
    if peer.uid != own_uid {
        return None;
    }
    let Some(pid) = peer.pid.filter(|pid| *pid > 0) else {
        return Some("the connecting process is in another PID namespace");
    };
    if pid == std::process::id() as i32 {
        return None;
    }
    let pidfd = match getsockopt(stream, PeerPidfd) {
        Ok(fd) => Some(fd),
        Err(Errno::ENOPROTOOPT) => None,
        Err(_) => return Some("the connecting process has exited"),
    };
    let theirs = filters_of(&pid.to_string());
    let exited = pidfd.is_some_and(|fd| {
        use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
        use std::os::fd::AsFd;
        // A pidfd is readable once its process has exited.
        let mut fds = [PollFd::new(fd.as_fd(), PollFlags::POLLIN)];
        poll(&mut fds, PollTimeout::ZERO).map_or(true, |ready| ready > 0)
    });
    match (theirs, filters_of("self")) {
        _ if exited => Some("the connecting process has exited"),
        (None, _) => Some("the connecting process has exited or its status cannot be read"),
        (Some(theirs), ours) if theirs > ours.unwrap_or(0) => {
            Some("it runs under the system-call filter the daemon gives its upstreams")
        }
        _ => None,
    }
}

/// The SO_PEERCRED rule: root, the daemon's own uid, a configured uid, or a configured
/// gid that is the peer's primary group (from SO_PEERCRED) or one of its supplementary
/// groups (`groups_of`, consulted only when a gid rule could decide).
pub fn peer_allowed(
    peer: Peer,
    own_uid: u32,
    config: &ControlConfig,
    groups_of: impl FnOnce(u32) -> Vec<u32>,
) -> bool {
    if peer.uid == 0 || peer.uid == own_uid || config.allow_uids.contains(&peer.uid) {
        return true;
    }
    if config.allow_gids.is_empty() {
        return false;
    }
    config.allow_gids.contains(&peer.gid)
        || groups_of(peer.uid)
            .iter()
            .any(|g| config.allow_gids.contains(g))
}

/// The group memberships of `uid` from the user and group databases (empty if unknown).
pub fn user_groups(uid: u32) -> Vec<u32> {
    use nix::unistd::{Uid, User, getgrouplist};
    let Ok(Some(user)) = User::from_uid(Uid::from_raw(uid)) else {
        return Vec::new();
    };
    let Ok(name) = std::ffi::CString::new(user.name) else {
        return Vec::new();
    };
    getgrouplist(&name, user.gid)
        .map(|groups| groups.into_iter().map(|g| g.as_raw()).collect())
        .unwrap_or_default()
}

/// Serve control connections until `shutdown` fires.
pub async fn serve<A: ControlApi>(
    socket: ControlSocket,
    config: Arc<parking_lot::RwLock<ControlConfig>>,
    api: Arc<A>,
    audit: Arc<Audit>,
    metrics: Metrics,
    shutdown: CancellationToken,
) {
    let own_uid = nix::unistd::geteuid().as_raw();
    let slots = Arc::new(Slots::default());
    let tracker = TaskTracker::new();
    loop {
        let stream = tokio::select! {
            biased;
            () = shutdown.cancelled() => break,
            accepted = socket.listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    tracing::warn!(error = %e, "control accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
        };
        // Who may connect is read at the connection and again at each of its requests: a
        // reload that removes a peer ends what it can do on connections it already holds.
        let (api, audit, metrics, slots, config) = (
            api.clone(),
            audit.clone(),
            metrics.clone(),
            slots.clone(),
            config.clone(),
        );
        tracker.spawn(async move {
            connection(
                stream,
                own_uid,
                &config,
                &slots,
                api.as_ref(),
                &audit,
                &metrics,
            )
            .await;
        });
    }
    tracker.close();
    // Let a `stop` reply reach its client; idle connections are cut at the bound.
    let _ = tokio::time::timeout(DRAIN_BOUND, tracker.wait()).await;
    drop(socket);
}

/// The control connections open now, by uid.
#[derive(Default)]
struct Slots(parking_lot::Mutex<SlotCounts>);

#[derive(Default)]
struct SlotCounts {
    by_uid: std::collections::HashMap<u32, usize>,
    /// Those of every uid but root.
    shared: usize,
}

/// A connection's place in [`Slots`], given back when dropped.
struct Slot {
    slots: Arc<Slots>,
    uid: u32,
}

impl Slots {
    /// A place for one more connection of `uid`, or why there is none.
    fn take(self: &Arc<Self>, uid: u32) -> Result<Slot, String> {
        let mut counts = self.0.lock();
        let held = counts.by_uid.get(&uid).copied().unwrap_or(0);
        if held >= if uid == 0 { ROOT_MAX } else { MAX_PER_UID } {
            return Err(format!(
                "too many control connections: uid {uid} holds {held}, the most one uid may hold at once"
            ));
        }
        if uid != 0 && counts.shared >= MAX_CONNECTIONS {
            return Err(format!(
                "too many control connections: {MAX_CONNECTIONS} are open (root can still connect)"
            ));
        }
        *counts.by_uid.entry(uid).or_default() += 1;
        if uid != 0 {
            counts.shared += 1;
        }
        Ok(Slot {
            slots: self.clone(),
            uid,
        })
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut counts = self.slots.0.lock();
        if let Some(n) = counts.by_uid.get_mut(&self.uid) {
            *n -= 1;
            if *n == 0 {
                counts.by_uid.remove(&self.uid);
            }
        }
        if self.uid != 0 {
            counts.shared -= 1;
        }
    }
}

async fn connection<A: ControlApi>(
    mut stream: UnixStream,
    own_uid: u32,
    config: &parking_lot::RwLock<ControlConfig>,
    slots: &Arc<Slots>,
    api: &A,
    audit: &Audit,
    metrics: &Metrics,
) {
    let peer = match stream.peer_cred() {
        Ok(cred) => Peer {
            uid: cred.uid(),
            gid: cred.gid(),
            pid: cred.pid(),
        },
        Err(e) => {
            tracing::warn!(error = %e, "SO_PEERCRED failed; dropping the control connection");
            return;
        }
    };
    // Fixed for the connection's life: its peer and the filters it runs under (which only
    // ever grow) were settled at connect, so /proc is read once, not at every request.
    let confined = confined_upstream(&stream, &peer, own_uid);
    let refusal = |peer: Peer| {
        let reply = if let Some(why) = confined {
            tracing::warn!(
                uid = peer.uid,
                pid = peer.pid,
                "control connection refused: the peer may be an upstream the daemon confined: {why}"
            );
            Response::error(
                ErrorCode::PermissionDenied,
                format!(
                    "a process the daemon started confined (an upstream, or what it started) may not use the control socket, and a peer running as the daemon's own user must be shown not to be one: {why}"
                ),
            )
        } else if peer_allowed(peer, own_uid, &config.read(), user_groups) {
            return None;
        } else {
            tracing::warn!(uid = peer.uid, gid = peer.gid, "control connection refused");
            Response::error(
                ErrorCode::PermissionDenied,
                format!(
                    "uid {} is not allowed on the control socket: the daemon admits root, its own \
                     user, and the uids in [control] allow_uids or members of the groups in \
                     [control] allow_gids of its configuration",
                    peer.uid
                ),
            )
        };
        let record = Record::refusal(
            SystemTime::now(),
            Carrier::Control,
            Reason::PeerNotAllowed,
            AddressClass::Unknown,
        );
        audit.refused(metrics, record);
        Some(reply)
    };
    if let Some(reply) = refusal(peer) {
        let _ = write_frame(&mut stream, &reply).await;
        return;
    }
    let _slot = match slots.take(peer.uid) {
        Ok(slot) => slot,
        Err(why) => {
            tracing::warn!(uid = peer.uid, "control connection refused: {why}");
            let _ = write_frame(&mut stream, &Response::error(ErrorCode::Unavailable, why)).await;
            return;
        }
    };
    let (reader, mut writer) = stream.into_split();
    let mut reader = BufReader::new(reader);
    loop {
        // Between requests a connection may idle; once a request has begun, it must
        // arrive whole within FRAME_TIMEOUT.
        match tokio::time::timeout(IDLE_TIMEOUT, reader.fill_buf()).await {
            Ok(Ok([])) | Err(_) => return,
            Ok(Ok(_)) => {}
            Ok(Err(e)) => {
                tracing::debug!(error = %e, "control read failed");
                return;
            }
        }
        let mut line = Vec::new();
        let mut limited = (&mut reader).take(MAX_REQUEST_BYTES as u64);
        let read = limited.read_until(b'\n', &mut line);
        match tokio::time::timeout(FRAME_TIMEOUT, read).await {
            Ok(Ok(_)) => {}
            Err(_) => {
                let reply = Response::error(
                    ErrorCode::BadRequest,
                    format!(
                        "a request must arrive whole within {} s of its first byte",
                        FRAME_TIMEOUT.as_secs()
                    ),
                );
                let _ = write_frame(&mut writer, &reply).await;
                return;
            }
            Ok(Err(e)) => {
                tracing::debug!(error = %e, "control read failed");
                return;
            }
        }
        if line.last() != Some(&b'\n') {
            let reply = Response::error(
                ErrorCode::TooLarge,
                format!("a request is at most {MAX_REQUEST_BYTES} bytes"),
            );
            let _ = write_frame(&mut writer, &reply).await;
            return;
        }
        // The allow lists may have changed since the connection was accepted.
        if let Some(reply) = refusal(peer) {
            let _ = write_frame(&mut writer, &reply).await;
            return;
        }
        let request = Request::decode(&line);
        if request.is_ok() {
            // Every well-formed request of an allowed peer counts as admitted (a relayed MCP
            // session counts once here, and its MCP requests under `stdio`).
            metrics.admitted(Carrier::Control);
        }
        let reply = match request {
            Ok(Request {
                command: Command::Mcp,
                ..
            }) => return api.serve_mcp(reader, writer, peer).await,
            Ok(request) => api.handle(request.command, peer).await,
            Err((code, message)) => Response::error(code, message),
        };
        if write_frame(&mut writer, &reply).await.is_err() {
            return;
        }
    }
}

/// Write one response line.
pub async fn write_frame<W: AsyncWriteExt + Unpin>(
    writer: &mut W,
    response: &Response,
) -> std::io::Result<()> {
    let mut text = serde_json::to_vec(response).map_err(std::io::Error::other)?;
    text.push(b'\n');
    writer.write_all(&text).await?;
    writer.flush().await
}

#[cfg(test)]
mod tests {
    use robota_proto::Outcome;

    use super::*;

    #[tokio::test]
    async fn binding_opens_up_only_a_directory_it_made() {
        let base = tempfile::tempdir().unwrap();
        let shared = base.path().join("shared");
        std::fs::create_dir(&shared).unwrap();
        std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o1777)).unwrap();
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o7777;
        let at = |socket: PathBuf| ControlConfig {
            socket,
            allow_uids: Vec::new(),
            allow_gids: Vec::new(),
        };
        let socket = bind(&at(shared.join("control.sock"))).unwrap();
        assert_eq!(
            mode(&shared),
            0o1777,
            "a shared directory keeps its sticky bit"
        );
        drop(socket);
        let made = base.path().join("made");
        let socket = bind(&at(made.join("control.sock"))).unwrap();
        assert_eq!(
            mode(&made),
            0o755,
            "peers can reach the socket in a directory we made"
        );
        drop(socket);
    }

    fn config(uids: &[u32], gids: &[u32]) -> ControlConfig {
        ControlConfig {
            socket: "/tmp/x.sock".into(),
            allow_uids: uids.to_vec(),
            allow_gids: gids.to_vec(),
        }
    }

    #[test]
    fn peer_rule() {
        let peer = |uid, gid| Peer {
            uid,
            gid,
            pid: None,
        };
        let c = config(&[1000], &[998]);
        let none = |_| Vec::new();
        assert!(peer_allowed(peer(0, 0), 500, &c, none));
        assert!(peer_allowed(peer(500, 500), 500, &c, none));
        assert!(peer_allowed(peer(1000, 1000), 500, &c, none));
        assert!(peer_allowed(peer(1001, 998), 500, &c, none));
        assert!(!peer_allowed(peer(1001, 1001), 500, &c, none));
        // A supplementary member of an allowed group passes; the lookup is for that uid.
        assert!(peer_allowed(peer(1001, 1001), 500, &c, |uid| {
            if uid == 1001 { vec![1001, 998] } else { vec![] }
        }));
        assert!(!peer_allowed(peer(1001, 1001), 500, &c, |_| vec![1001, 27]));
        // No gid rule: the databases are not consulted.
        assert!(!peer_allowed(
            peer(65534, 65534),
            500,
            &config(&[], &[]),
            |_| panic!("looked up")
        ));
        // Root's groups, from the real databases, include its primary group 0.
        assert!(user_groups(0).contains(&0));
    }

    struct Echo;
    impl ControlApi for Echo {
        async fn handle(&self, command: Command, peer: Peer) -> Response {
            Response::error(
                ErrorCode::Internal,
                format!("{command:?} from {}", peer.uid),
            )
        }

        async fn serve_mcp(&self, _reader: ControlReader, mut writer: OwnedWriteHalf, _peer: Peer) {
            let refusal = Response::error(ErrorCode::Unavailable, "no MCP here");
            let _ = write_frame(&mut writer, &refusal).await;
        }
    }

    async fn roundtrip(stream: &mut UnixStream, line: &[u8]) -> Response {
        stream.write_all(line).await.unwrap();
        let mut reader = BufReader::new(stream);
        let mut out = String::new();
        reader.read_line(&mut out).await.unwrap();
        serde_json::from_str(&out).unwrap()
    }

    #[tokio::test]
    async fn socket_lock_mode_and_limits() {
        let dir = tempfile::tempdir().unwrap();
        let mut c = config(&[], &[]);
        c.socket = dir.path().join("run/control.sock");
        let socket = bind(&c).unwrap();
        let mode = std::fs::metadata(&c.socket).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o660);
        // A second daemon cannot take the same socket.
        assert!(matches!(bind(&c), Err(ControlError::Locked { .. })));

        let (shutdown, server) = serve_echo(socket, &c);
        let mut stream = UnixStream::connect(&c.socket).await.unwrap();
        let reply = roundtrip(&mut stream, b"{\"v\":1,\"cmd\":\"status\"}\n").await;
        assert!(
            matches!(reply.outcome, Outcome::Error(ref e) if e.message == "Status from 0"),
            "{reply:?}"
        );
        // A second request on the same connection is served too.
        let reply = roundtrip(&mut stream, b"{\"v\":1,\"cmd\":\"stop\"}\n").await;
        assert!(
            matches!(reply.outcome, Outcome::Error(ref e) if e.message == "Stop from 0"),
            "{reply:?}"
        );

        // One byte under the limit is read whole; at the limit without a newline it is refused.
        let mut big = UnixStream::connect(&c.socket).await.unwrap();
        let mut line = vec![b' '; MAX_REQUEST_BYTES];
        *line.last_mut().unwrap() = b'\n';
        let reply = roundtrip(&mut big, &line).await;
        assert!(
            matches!(reply.outcome, Outcome::Error(ref e) if e.code == ErrorCode::BadRequest),
            "{reply:?}"
        );
        let mut big = UnixStream::connect(&c.socket).await.unwrap();
        let reply = roundtrip(&mut big, &vec![b' '; MAX_REQUEST_BYTES + 1]).await;
        assert!(
            matches!(reply.outcome, Outcome::Error(ref e) if e.code == ErrorCode::TooLarge),
            "{reply:?}"
        );

        shutdown.cancel();
        server.await.unwrap();
        assert!(!c.socket.exists(), "the socket is removed on shutdown");
        // With the first daemon gone, the lock is free again.
        drop(bind(&c).unwrap());
    }

    /// The control server over `socket`, answering with [`Echo`]; its stop token and task.
    fn serve_echo(
        socket: ControlSocket,
        c: &ControlConfig,
    ) -> (CancellationToken, tokio::task::JoinHandle<()>) {
        let shutdown = CancellationToken::new();
        let server = tokio::spawn(serve(
            socket,
            Arc::new(parking_lot::RwLock::new(c.clone())),
            Arc::new(Echo),
            Arc::new(Audit::new()),
            Metrics::new(),
            shutdown.clone(),
        ));
        (shutdown, server)
    }

    #[tokio::test]
    async fn one_uid_holds_at_most_its_share_and_a_trickled_frame_is_cut() {
        let dir = tempfile::tempdir().unwrap();
        let mut c = config(&[], &[]);
        c.socket = dir.path().join("control.sock");
        let socket = bind(&c).unwrap();
        let (shutdown, server) = serve_echo(socket, &c);
        // Each holds a request begun and not finished.
        let mut held = Vec::new();
        for _ in 0..ROOT_MAX {
            let mut stream = UnixStream::connect(&c.socket).await.unwrap();
            stream.write_all(b"{\"v\":1").await.unwrap();
            held.push(stream);
        }
        let mut one_more = UnixStream::connect(&c.socket).await.unwrap();
        let reply = roundtrip(&mut one_more, b"{\"v\":1,\"cmd\":\"status\"}\n").await;
        assert!(
            matches!(reply.outcome, Outcome::Error(ref e) if e.code == ErrorCode::Unavailable
                && e.message.contains(&format!("uid 0 holds {ROOT_MAX}"))),
            "{reply:?}"
        );
        // The held ones are cut FRAME_TIMEOUT after their first byte, saying why.
        let started = std::time::Instant::now();
        let mut reader = BufReader::new(&mut held[0]);
        let mut out = String::new();
        reader.read_line(&mut out).await.unwrap();
        let reply: Response = serde_json::from_str(&out).unwrap();
        assert!(
            matches!(reply.outcome, Outcome::Error(ref e) if e.code == ErrorCode::BadRequest
                && e.message.contains("whole within")),
            "{reply:?}"
        );
        assert!(started.elapsed() < FRAME_TIMEOUT + Duration::from_secs(5));
        // Their slots are given back as the server sees them end.
        drop(held);
        let mut served = false;
        for _ in 0..100 {
            let mut again = UnixStream::connect(&c.socket).await.unwrap();
            let reply = roundtrip(&mut again, b"{\"v\":1,\"cmd\":\"status\"}\n").await;
            if matches!(reply.outcome, Outcome::Error(ref e) if e.message == "Status from 0") {
                served = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(served, "the slots were never given back");
        shutdown.cancel();
        server.await.unwrap();
    }
}
