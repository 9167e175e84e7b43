//! A downstream server as a child process speaking MCP on its stdin and stdout.
//!
//! The child runs in a process group of its own with an empty environment (its configured
//! variables and PATH), stdin and stdout piped, stderr read line by line into the
//! daemon's log under the upstream's name and at a bounded rate. Started through the
//! daemon's own binary (`robota-mcpd exec-upstream`), it is killed by the kernel if the
//! daemon dies, even by SIGKILL. Every line it writes is bounded by the response limit; a
//! line that is not JSON, or too long to belong to any request, ends the child: it is
//! contained (its calls end `outcome_unknown`) and reported, and the supervisor decides
//! what next.

use std::collections::HashMap;
use std::ffi::OsString;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::BytesMut;
use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use parking_lot::Mutex;
use serde_json::{Map, Value};
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, Command};
use tokio::sync::{Notify, mpsc, oneshot};
use tokio_util::sync::CancellationToken;

use super::cgroup::{Leaf, Tree};
use super::protocol::{
    self, Answer, CallError, Incoming, Negotiated, Rpc, RpcFuture, Unread, answer_server_request,
    id_in_prefix,
};
use crate::budget::Budget;
use crate::catalog::Progress;

/// How a child is started.
#[derive(Debug, Clone)]
pub enum Launcher {
    /// Through the daemon's binary (`/proc/self/exe exec-upstream --parent <pid> -- argv`),
    /// which asks the kernel to kill the child when the daemon dies, joins the child's
    /// cgroup, confines itself, then executes it.
    Shim {
        exe: PathBuf,
        /// Where children's process trees are kept, or why the daemon has no such place.
        cgroups: Arc<Result<Tree, String>>,
    },
    /// Directly (in-process tests): the child outlives a killed daemon, and is not
    /// confined.
    Direct,
}

/// What runs: the configured argv, environment and directory.
#[derive(Debug, Clone)]
pub struct ChildSpec {
    pub argv: Vec<String>,
    pub env: Vec<(String, String)>,
    pub cwd: Option<PathBuf>,
    /// What its processes may reach (none: `confine = false`).
    pub confinement: Option<super::confine::Confinement>,
    /// What its whole process tree may use (none: unbounded).
    pub memory: Option<u64>,
}

/// The PATH a child gets when its environment sets none.
pub const DEFAULT_PATH: &str = "/usr/local/bin:/usr/bin:/bin";
/// How long a child gets between SIGTERM and SIGKILL.
pub const STOP_GRACE: Duration = Duration::from_secs(2);
/// Lines of stderr logged per second per child; the rest are counted.
const STDERR_RATE: u32 = 10;
/// Longest stderr line logged (the rest is cut).
const STDERR_LINE: usize = 4096;
/// Requests in flight on one child at once.
const MAX_PENDING: usize = 256;
/// Of an oversize line, the bytes kept to find its id.
const PREFIX: usize = 4096;

/// A request waiting for its answer, and where its progress goes.
struct Waiter {
    answer: oneshot::Sender<Result<Answer, CallError>>,
    progress: Progress,
}

/// A running child and the requests waiting for its answers.
pub struct ChildLink {
    upstream: String,
    pid: u32,
    out: mpsc::Sender<Vec<u8>>,
    pending: Mutex<HashMap<u64, Waiter>>,
    next_id: AtomicU64,
    /// Fired when the link can carry nothing more (the child closed its stdout, exited,
    /// wrote something that is not MCP); `why` says which.
    closed: CancellationToken,
    why: Mutex<Option<String>>,
    /// Fired once the child has been reaped.
    reaped: CancellationToken,
    list_changed: Arc<Notify>,
    /// Its cgroup: what it and everything it started are killed with.
    leaf: Option<Leaf>,
    /// Why the launcher refused to run the command, when its first stderr line says so.
    refused: Mutex<Option<String>>,
    /// Fired when its stderr has ended.
    stderr_ended: CancellationToken,
}

/// How the launcher's one line begins when it cannot run the upstream's command.
pub const LAUNCHER_REFUSAL: &str = "robota-mcpd exec-upstream: ";

/// How long the end of a child's stdout, or its exit, waits for the rest of the news (its
/// exit, the launcher's reason on stderr) before the link is closed with what is known.
const SETTLE: Duration = Duration::from_millis(200);

impl ChildLink {
    /// Starts the child. `list_changed` is notified when it announces a new tool list.
    pub fn spawn(
        upstream: &str,
        spec: &ChildSpec,
        launcher: &Launcher,
        response_limit: usize,
        budget: Budget,
        list_changed: Arc<Notify>,
        stderr_rate: Arc<StderrRate>,
    ) -> Result<Arc<Self>, String> {
        let confined = spec.confinement.is_some();
        let mut leaf = None;
        let mut command = match launcher {
            Launcher::Direct => {
                let mut c = Command::new(&spec.argv[0]);
                c.args(&spec.argv[1..]);
                c
            }
            Launcher::Shim { exe, cgroups } => {
                // Only a confined child needs its cgroup; an unconfined one is put in one
                // where it can be.
                let placed = match &**cgroups {
                    Ok(tree) => tree.leaf(upstream, spec.memory, confined),
                    Err(why) => Err(why.clone()),
                };
                leaf = match placed {
                    Ok(leaf) => Some(leaf),
                    Err(why) if confined => {
                        return Err(format!(
                            "its process tree cannot be bounded and ended with it: {why}; or write confine = false"
                        ));
                    }
                    Err(_) => None,
                };
                let mut c = Command::new(exe);
                c.arg("exec-upstream")
                    .arg("--parent")
                    .arg(std::process::id().to_string());
                if let Some(leaf) = &leaf {
                    c.args(leaf.args());
                }
                if let Some(confinement) = &spec.confinement {
                    c.args(confinement.args());
                }
                c.arg("--").args(&spec.argv);
                c
            }
        };
        command.env_clear();
        if !spec.env.iter().any(|(k, _)| k == "PATH") {
            command.env("PATH", DEFAULT_PATH);
        }
        command
            .envs(spec.env.iter().map(|(k, v)| (k, v)))
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .process_group(0)
            .kill_on_drop(false);
        if let Some(dir) = &spec.cwd {
            command.current_dir(dir);
        }
        // Spawned from a runtime worker thread, which lives as long as the runtime: the
        // parent-death signal is tied to the thread that forked.
        let mut child = match command.spawn() {
            Ok(child) => child,
            Err(e) => {
                if let Some(leaf) = &leaf {
                    leaf.discard();
                }
                return Err(format!("cannot start the command: {e}"));
            }
        };
        let pid = child.id().ok_or("the child exited at once")?;
        let (stdin, stdout, stderr) =
            match (child.stdin.take(), child.stdout.take(), child.stderr.take()) {
                (Some(i), Some(o), Some(e)) => (i, o, e),
                _ => return Err("the child's pipes were not set up".into()),
            };
        let (out, outbound) = mpsc::channel::<Vec<u8>>(64);
        let link = Arc::new(Self {
            upstream: upstream.to_owned(),
            pid,
            out,
            pending: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(1),
            closed: CancellationToken::new(),
            why: Mutex::new(None),
            reaped: CancellationToken::new(),
            list_changed,
            leaf,
            refused: Mutex::new(None),
            stderr_ended: CancellationToken::new(),
        });
        tokio::spawn(write_stdin(link.clone(), stdin, outbound));
        tokio::spawn(read_stdout(link.clone(), stdout, response_limit, budget));
        tokio::spawn(log_stderr(
            upstream.to_owned(),
            Arc::downgrade(&link),
            link.stderr_ended.clone(),
            stderr,
            stderr_rate,
        ));
        tokio::spawn(reap(link.clone(), child));
        Ok(link)
    }

    pub fn pid(&self) -> u32 {
        self.pid
    }

    pub fn is_reaped(&self) -> bool {
        self.reaped.is_cancelled()
    }

    /// Fired when the link is closed; [`ChildLink::why`] says why.
    pub fn closed(&self) -> &CancellationToken {
        &self.closed
    }

    pub fn why(&self) -> Option<String> {
        self.why.lock().clone()
    }

    /// Closes the link for `why` (the first reason sticks); every waiting call learns that
    /// its answer will not come. Whoever closes it first (the child's stdout ending, its
    /// exit), a kill at the memory bound is named: the kernel counted it before the killed
    /// process could end anything.
    fn close(&self, mut why: String) {
        if let Some(refused) = self.refused.lock().as_deref() {
            why.push_str(": ");
            why.push_str(refused);
        }
        if self.leaf.as_ref().is_some_and(Leaf::hit_memory_bound) {
            why.push_str(
                "; the kernel killed a process of this upstream at its memory bound (`memory`)",
            );
        }
        {
            let mut current = self.why.lock();
            if current.is_none() {
                *current = Some(why.clone());
            }
        }
        self.closed.cancel();
        let waiting: Vec<Waiter> = self.pending.lock().drain().map(|(_, w)| w).collect();
        for waiter in waiting {
            let _ = waiter.answer.send(Err(CallError::Lost(format!(
                "the upstream's process ended the exchange mid-call ({why})"
            ))));
        }
    }

    fn group(&self) -> Pid {
        Pid::from_raw(i32::try_from(self.pid).unwrap_or(i32::MAX))
    }

    /// Stops the child: SIGTERM to its group, SIGKILL after `grace` (at once with a zero
    /// grace); waits until it is reaped (bounded).
    pub async fn stop(&self, grace: Duration) {
        self.close("stopped by the daemon".into());
        if !self.reaped.is_cancelled() {
            if grace.is_zero() {
                let _ = killpg(self.group(), Signal::SIGKILL);
            } else {
                let _ = killpg(self.group(), Signal::SIGTERM);
                if tokio::time::timeout(grace, self.reaped.cancelled())
                    .await
                    .is_err()
                {
                    let _ = killpg(self.group(), Signal::SIGKILL);
                }
            }
        }
        let _ = tokio::time::timeout(Duration::from_secs(5), self.reaped.cancelled()).await;
    }

    fn answer(&self, id: u64, result: Result<Answer, CallError>) {
        if let Some(waiter) = self.pending.lock().remove(&id) {
            let _ = waiter.answer.send(result);
        }
    }

    fn forget(&self, id: u64) -> bool {
        self.pending.lock().remove(&id).is_some()
    }

    /// Tells the child to stop working on `id` (best effort, never waits).
    fn send_cancel(&self, negotiated: &Negotiated, id: u64, reason: &str) {
        let mut params = Map::new();
        params.insert("requestId".into(), Value::from(id));
        params.insert("reason".into(), Value::from(reason));
        let line =
            protocol::notification_bytes("notifications/cancelled", negotiated.params(params));
        let _ = self.out.try_send(line);
    }
}

/// Forwards the cancellation of a call whose future is dropped (the caller went away,
/// or the session raced it against its cancel token).
struct Outstanding<'a> {
    link: &'a ChildLink,
    negotiated: &'a Negotiated,
    id: u64,
    done: bool,
}

impl Drop for Outstanding<'_> {
    fn drop(&mut self) {
        if !self.done && self.link.forget(self.id) {
            self.link
                .send_cancel(self.negotiated, self.id, "the caller cancelled the request");
        }
    }
}

impl Rpc for ChildLink {
    fn request<'a>(
        &'a self,
        negotiated: &'a Negotiated,
        method: &'static str,
        mut params: Map<String, Value>,
        cancel: &'a CancellationToken,
        limit: Duration,
        progress: &'a Progress,
    ) -> RpcFuture<'a, Answer> {
        Box::pin(async move {
            if self.closed.is_cancelled() {
                return Err(CallError::NotSent(self.why().unwrap_or_default()));
            }
            let id = self.next_id.fetch_add(1, Ordering::Relaxed);
            if progress.wanted() {
                protocol::ask_progress(&mut params, id);
            }
            let (tx, rx) = oneshot::channel();
            {
                let mut pending = self.pending.lock();
                if pending.len() >= MAX_PENDING {
                    return Err(CallError::Busy(format!(
                        "{MAX_PENDING} calls are already waiting for this upstream"
                    )));
                }
                pending.insert(
                    id,
                    Waiter {
                        answer: tx,
                        progress: progress.clone(),
                    },
                );
            }
            let mut outstanding = Outstanding {
                link: self,
                negotiated,
                id,
                done: false,
            };
            if self
                .out
                .send(protocol::request_bytes(id, method, params))
                .await
                .is_err()
            {
                outstanding.done = true;
                self.forget(id);
                return Err(CallError::NotSent("the child's stdin is closed".into()));
            }
            let answer = tokio::select! {
                answer = rx => answer.unwrap_or_else(|_| Err(CallError::Lost("the link closed".into()))),
                () = cancel.cancelled() => {
                    outstanding.done = true;
                    if self.forget(id) {
                        self.send_cancel(negotiated, id, "the caller cancelled the request");
                    }
                    Err(CallError::Cancelled)
                }
                () = tokio::time::sleep(limit) => {
                    outstanding.done = true;
                    if self.forget(id) {
                        self.send_cancel(negotiated, id, "the call timed out");
                    }
                    Err(CallError::Timeout(limit))
                }
            };
            outstanding.done = true;
            answer
        })
    }

    fn notify<'a>(
        &'a self,
        _negotiated: &'a Negotiated,
        method: &'static str,
        params: Map<String, Value>,
    ) -> RpcFuture<'a, ()> {
        Box::pin(async move {
            self.out
                .send(protocol::notification_bytes(method, params))
                .await
                .map_err(|_| CallError::NotSent("the child's stdin is closed".into()))
        })
    }
}

async fn write_stdin(
    link: Arc<ChildLink>,
    mut stdin: tokio::process::ChildStdin,
    mut outbound: mpsc::Receiver<Vec<u8>>,
) {
    loop {
        let line = tokio::select! {
            line = outbound.recv() => line,
            () = link.closed.cancelled() => None,
        };
        let Some(mut line) = line else { break };
        line.push(b'\n');
        if stdin.write_all(&line).await.is_err() || stdin.flush().await.is_err() {
            link.close("its stdin was closed".into());
            break;
        }
    }
    // Closing stdin is how a stdio server is asked to end.
    drop(stdin);
}

/// Longest the reading of a child's stdout waits for room to queue an answer to a request
/// of the child's (it is not reading its stdin); then the child is cut off.
const ANSWER_WAIT: Duration = Duration::from_secs(5);

/// One line of stdout, bounded: a whole line, or the first bytes of one over the limit.
enum Line {
    Whole(BytesMut),
    TooLong(Vec<u8>),
    End,
}

/// Reads lines of at most `limit` bytes. A longer line is reported (with its first
/// [`PREFIX`] bytes) as soon as it passes the limit, whether or not its end has come; the
/// rest of it is then read and dropped.
struct Lines<R> {
    read: R,
    buf: BytesMut,
    limit: usize,
    /// Inside a line already reported too long: drop bytes up to its newline.
    discarding: bool,
}

impl<R: AsyncRead + Unpin> Lines<R> {
    fn new(read: R, limit: usize) -> Self {
        Self {
            read,
            buf: BytesMut::with_capacity(64 * 1024),
            limit,
            discarding: false,
        }
    }

    async fn next(&mut self) -> Line {
        let mut scanned = 0;
        loop {
            if let Some(at) = self.buf[scanned..].iter().position(|&b| b == b'\n') {
                let end = scanned + at;
                let mut line = self.buf.split_to(end + 1);
                if std::mem::take(&mut self.discarding) {
                    scanned = 0;
                    continue;
                }
                line.truncate(end);
                if line.last() == Some(&b'\r') {
                    line.truncate(end - 1);
                }
                return if line.len() > self.limit {
                    Line::TooLong(line[..PREFIX.min(line.len())].to_vec())
                } else {
                    Line::Whole(line)
                };
            }
            scanned = self.buf.len();
            if self.discarding {
                self.buf.clear();
                scanned = 0;
            } else if self.buf.len() > self.limit {
                let prefix = self.buf[..PREFIX.min(self.buf.len())].to_vec();
                self.buf.clear();
                self.discarding = true;
                return Line::TooLong(prefix);
            }
            self.buf.reserve(64 * 1024);
            match self.read.read_buf(&mut self.buf).await {
                Ok(0) | Err(_) => return Line::End,
                Ok(_) => {}
            }
        }
    }
}

async fn read_stdout(
    link: Arc<ChildLink>,
    stdout: tokio::process::ChildStdout,
    limit: usize,
    budget: Budget,
) {
    let mut lines = Lines::new(stdout, limit);
    let why = loop {
        let line = tokio::select! {
            line = lines.next() => line,
            () = link.closed.cancelled() => return,
        };
        match line {
            Line::End => {
                // Its exit, if it is exiting, says more: give it a moment.
                let _ = tokio::time::timeout(SETTLE, link.closed.cancelled()).await;
                break "it closed its stdout".to_owned();
            }
            Line::TooLong(prefix) => match id_in_prefix(&prefix) {
                Some(id) => link.answer(
                    id,
                    Err(CallError::TooLarge(format!(
                        "the upstream's answer is over its {limit} byte response limit"
                    ))),
                ),
                None => break format!("it wrote a line over the {limit} byte response limit"),
            },
            Line::Whole(line) if line.iter().all(u8::is_ascii_whitespace) => {}
            Line::Whole(line) => {
                let (message, held) = match protocol::parse(&line, &budget) {
                    Ok(parsed) => parsed,
                    Err(Unread::NotJson(e)) => {
                        break format!(
                            "it wrote a line that is not JSON ({} bytes: {e}); stdout must carry MCP only",
                            line.len()
                        );
                    }
                    Err(Unread::Unaffordable(why)) => match id_in_prefix(&line) {
                        // An answer too costly to read: its call learns why, the upstream
                        // goes on.
                        Some(id) => {
                            link.answer(
                                id,
                                Err(CallError::TooLarge(format!(
                                    "the upstream's answer cannot be read now: {why}"
                                ))),
                            );
                            continue;
                        }
                        // Anything else may be a request of its own, which must be
                        // answered: it is cut off instead.
                        None => break format!("it sent a message the daemon cannot read: {why}"),
                    },
                };
                if let Some((id, update)) = protocol::progress(&message) {
                    // For a request of ours still waiting; any other is dropped.
                    if let Some(waiter) = link.pending.lock().get(&id) {
                        waiter.progress.report(update);
                    }
                    continue;
                }
                match protocol::classify(message) {
                    Incoming::Response { id, result } => link.answer(
                        id,
                        result.map(|result| Answer {
                            result,
                            held: Some(held),
                        }),
                    ),
                    Incoming::Notification { method } => {
                        if method == "notifications/tools/list_changed" {
                            link.list_changed.notify_one();
                        }
                    }
                    Incoming::Request { id, method } => {
                        // Every request is answered: with 64 answers already waiting on
                        // a child that does not read its stdin, its stdout waits too (up
                        // to ANSWER_WAIT), then the child is cut off — never a request
                        // dropped unanswered.
                        let answer = answer_server_request(id, &method);
                        match tokio::time::timeout(ANSWER_WAIT, link.out.send(answer)).await {
                            Ok(Ok(())) => {}
                            Ok(Err(_)) => return,
                            Err(_) => {
                                break format!(
                                    "it sent requests and read none of their answers for {}",
                                    humantime::format_duration(ANSWER_WAIT)
                                );
                            }
                        }
                    }
                    Incoming::Stray(what) => {
                        tracing::debug!(upstream = %link.upstream, "ignored {what}");
                    }
                }
            }
        }
    };
    link.close(why);
}

/// An upstream's stderr allowance: [`STDERR_RATE`] lines a second over all its children
/// (a per-call upstream's sixteen children share it, so none of them gets the log's
/// per-callsite rate to itself at the other upstreams' cost).
#[derive(Debug, Default)]
pub struct StderrRate(Mutex<RateWindow>);

#[derive(Debug, Default)]
struct RateWindow {
    since: Option<Instant>,
    logged: u32,
    suppressed: u64,
}

impl StderrRate {
    /// Whether a line read at `now` may be logged, and how many lines the window that
    /// `now` ended had to leave out (to be said in one line).
    fn admit(&self, now: Instant) -> (bool, u64) {
        let mut w = self.0.lock();
        let mut ended = 0;
        if w.since
            .is_none_or(|since| now.duration_since(since) >= Duration::from_secs(1))
        {
            ended = std::mem::take(&mut w.suppressed);
            w.since = Some(now);
            w.logged = 0;
        }
        if w.logged >= STDERR_RATE {
            w.suppressed += 1;
            return (false, ended);
        }
        w.logged += 1;
        (true, ended)
    }

    /// Lines left out and not yet said (a child's stderr ended).
    fn take_suppressed(&self) -> u64 {
        std::mem::take(&mut self.0.lock().suppressed)
    }
}

/// stderr into the log, one event per line, cut at [`STDERR_LINE`], within the upstream's
/// [`StderrRate`] (the rest counted in one line).
async fn log_stderr(
    upstream: String,
    link: std::sync::Weak<ChildLink>,
    ended: CancellationToken,
    stderr: tokio::process::ChildStderr,
    rate: Arc<StderrRate>,
) {
    let _ended = ended.drop_guard();
    let mut first = true;
    let mut reader = BufReader::new(stderr);
    let mut buf = Vec::new();
    loop {
        buf.clear();
        let read = (&mut reader)
            .take(STDERR_LINE as u64 + 1)
            .read_until(b'\n', &mut buf)
            .await;
        match read {
            Ok(0) | Err(_) => break,
            Ok(_) => {}
        }
        let whole = buf.last() == Some(&b'\n');
        if !whole {
            // Cut: drop the rest of this line without holding it.
            let mut sink = Vec::new();
            loop {
                sink.clear();
                match (&mut reader)
                    .take(64 * 1024)
                    .read_until(b'\n', &mut sink)
                    .await
                {
                    Ok(0) | Err(_) => break,
                    Ok(_) if sink.last() == Some(&b'\n') => break,
                    Ok(_) => {}
                }
            }
        }
        // Only a first line can be the launcher's (the command writes after it); it is
        // kept whether or not the upstream's allowance lets it into the log (its other
        // children may have used the second up).
        if std::mem::take(&mut first)
            && let Some(reason) = buf.strip_prefix(LAUNCHER_REFUSAL.as_bytes())
            && let Some(link) = link.upgrade()
        {
            let reason = String::from_utf8_lossy(reason);
            *link.refused.lock() = Some(reason.trim_end_matches(['\n', '\r']).to_owned());
        }
        let (admitted, suppressed) = rate.admit(Instant::now());
        if suppressed > 0 {
            tracing::warn!(upstream = %upstream, suppressed, "upstream stderr lines past the rate, not logged");
        }
        if !admitted {
            continue;
        }
        let text = String::from_utf8_lossy(&buf);
        let text = text.trim_end_matches(['\n', '\r']);
        // The line is a quoted field, its control and invisible characters escaped: what
        // an upstream writes can never pass for the daemon's own fields.
        if whole {
            tracing::info!(target: crate::logging::UPSTREAM_STDERR, upstream = %upstream, line = ?text, "upstream stderr");
        } else {
            tracing::info!(target: crate::logging::UPSTREAM_STDERR, upstream = %upstream, line = ?text, "upstream stderr (line cut)");
        }
    }
    let suppressed = rate.take_suppressed();
    if suppressed > 0 {
        tracing::warn!(upstream = %upstream, suppressed, "upstream stderr lines past the rate, not logged");
    }
}

/// Waits for the child; once it has exited, closes the link (while its cgroup still
/// counts what the kernel killed) and kills what it left in its cgroup (or, with none, in
/// its process group).
async fn reap(link: Arc<ChildLink>, mut child: Child) {
    let status = child.wait().await;
    // The launcher's reason, if it refused, is on stderr just before the exit.
    let _ = tokio::time::timeout(SETTLE, link.stderr_ended.cancelled()).await;
    link.close(match status {
        Ok(status) => format!("its process exited ({status})"),
        Err(e) => format!("waiting for its process failed: {e}"),
    });
    match &link.leaf {
        Some(leaf) => leaf.end().await,
        None => {
            let _ = killpg(link.group(), Signal::SIGKILL);
        }
    }
    link.reaped.cancel();
}

/// `robota-mcpd exec-upstream --parent <pid> [--cgroup DIR…] [confinement] -- argv…`: asks
/// the kernel to kill this process when its parent dies, checks the parent is still the
/// daemon that started it, joins the child's cgroups, confines itself, then becomes the
/// upstream's command. Returns only on failure.
pub fn exec_child(
    parent: u32,
    cgroups: &[PathBuf],
    confinement: Option<&super::confine::Confinement>,
    argv: &[OsString],
) -> String {
    use std::ffi::CString;
    use std::os::unix::ffi::OsStrExt;
    if let Err(e) = nix::sys::prctl::set_pdeathsig(Signal::SIGKILL) {
        return format!("cannot set the parent-death signal: {e}");
    }
    // The daemon may have died before the signal was set: then the parent is another.
    if nix::unistd::getppid().as_raw() != i32::try_from(parent).unwrap_or(-1) {
        return "the daemon that started this upstream is gone".into();
    }
    if let Err(e) = super::cgroup::join(cgroups) {
        return e;
    }
    if let Some(confinement) = confinement
        && let Err(e) = confinement.apply()
    {
        return e;
    }
    let args: Result<Vec<CString>, _> = argv.iter().map(|a| CString::new(a.as_bytes())).collect();
    let Ok(args) = args else {
        return "an argument holds a NUL byte".into();
    };
    let Some(exe) = args.first() else {
        return "no command given".into();
    };
    match nix::unistd::execv(exe, &args) {
        Ok(never) => match never {},
        Err(e) => format!("cannot execute {}: {e}", exe.to_string_lossy()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn lines_are_bounded_and_an_oversize_one_keeps_its_start() {
        let long = format!(
            "{{\"jsonrpc\":\"2.0\",\"id\":7,\"result\":\"{}\"}}",
            "x".repeat(100_000)
        );
        let input = format!("{{\"a\":1}}\r\n\n{long}\n{{\"b\":2}}\n");
        let mut lines = Lines::new(input.as_bytes(), 1000);
        assert!(matches!(lines.next().await, Line::Whole(l) if &l[..] == b"{\"a\":1}"));
        assert!(matches!(lines.next().await, Line::Whole(l) if l.is_empty()));
        match lines.next().await {
            Line::TooLong(prefix) => {
                assert!(prefix.len() <= PREFIX);
                assert_eq!(id_in_prefix(&prefix), Some(7));
            }
            _ => panic!("expected the long line to be cut"),
        }
        assert!(matches!(lines.next().await, Line::Whole(l) if &l[..] == b"{\"b\":2}"));
        assert!(matches!(lines.next().await, Line::End));
    }

    #[tokio::test]
    async fn a_line_over_the_limit_is_reported_before_its_end_comes() {
        let (mut write, read) = tokio::io::duplex(1 << 20);
        let mut lines = Lines::new(read, 1000);
        let start = format!(
            "{{\"jsonrpc\":\"2.0\",\"id\":9,\"result\":\"{}",
            "x".repeat(5000)
        );
        write.write_all(start.as_bytes()).await.unwrap();
        // No newline yet, and none may ever come: the answer is at the limit.
        let line = tokio::time::timeout(Duration::from_secs(5), lines.next())
            .await
            .expect("reported without waiting for the line's end");
        match line {
            Line::TooLong(prefix) => assert_eq!(id_in_prefix(&prefix), Some(9)),
            _ => panic!("expected the line to be reported too long"),
        }
        // Its rest is dropped; the next line is whole.
        write
            .write_all(format!("{}\"}}\n{{\"b\":2}}\n", "y".repeat(3000)).as_bytes())
            .await
            .unwrap();
        assert!(matches!(lines.next().await, Line::Whole(l) if &l[..] == b"{\"b\":2}"));
    }

    fn sh(script: &str) -> ChildSpec {
        ChildSpec {
            argv: vec!["/bin/sh".into(), "-c".into(), script.into()],
            env: Vec::new(),
            cwd: None,
            confinement: None,
            memory: None,
        }
    }

    /// One allowance for all of an upstream's children: what one of them used is gone for
    /// the others until the second is over, and what was left out is said once.
    #[test]
    fn an_upstreams_children_share_one_stderr_allowance() {
        let rate = Arc::new(StderrRate::default());
        let (a, b) = (rate.clone(), rate.clone());
        let start = Instant::now();
        for _ in 0..STDERR_RATE {
            assert_eq!(a.admit(start), (true, 0));
        }
        assert_eq!(b.admit(start + Duration::from_millis(500)), (false, 0));
        assert_eq!(a.admit(start + Duration::from_millis(999)), (false, 0));
        // The next second: the two left out are said, and lines pass again.
        assert_eq!(b.admit(start + Duration::from_secs(1)), (true, 2));
        assert_eq!(a.admit(start + Duration::from_secs(1)), (true, 0));
        for _ in 2..STDERR_RATE {
            assert!(a.admit(start + Duration::from_secs(1)).0);
        }
        assert!(!b.admit(start + Duration::from_secs(1)).0);
        assert_eq!(a.take_suppressed(), 1);
        assert_eq!(b.take_suppressed(), 0);
    }

    /// The launcher's reason reaches the link's reason even when the upstream's other
    /// children have used up its stderr allowance for this second.
    #[tokio::test]
    async fn the_launchers_reason_is_kept_when_the_allowance_is_used_up() {
        let rate = Arc::new(StderrRate::default());
        while rate.admit(Instant::now()).0 {}
        let link = ChildLink::spawn(
            "t",
            &sh(&format!(
                "echo '{LAUNCHER_REFUSAL}the kernel says no' >&2; exit 1"
            )),
            &Launcher::Direct,
            1024,
            Budget::new(1 << 20),
            Arc::new(Notify::new()),
            rate,
        )
        .unwrap();
        tokio::time::timeout(Duration::from_secs(20), link.closed().cancelled())
            .await
            .expect("the link closes when the child exits");
        let why = link.why().unwrap_or_default();
        assert!(why.ends_with(": the kernel says no"), "{why}");
        link.stop(Duration::ZERO).await;
    }

    #[tokio::test]
    async fn a_child_writing_garbage_is_contained_and_the_reason_kept() {
        let link = ChildLink::spawn(
            "t",
            &sh("read line; echo 'hello, not JSON'; sleep 30"),
            &Launcher::Direct,
            1024,
            Budget::new(1 << 20),
            Arc::new(Notify::new()),
            Arc::default(),
        )
        .unwrap();
        let negotiated = Negotiated::modern();
        let err = link
            .request(
                &negotiated,
                "tools/list",
                Map::new(),
                &CancellationToken::new(),
                Duration::from_secs(20),
                &Progress::default(),
            )
            .await
            .unwrap_err();
        assert!(matches!(err, CallError::Lost(_)), "{err:?}");
        assert!(link.why().unwrap().contains("not JSON"), "{:?}", link.why());
        link.stop(Duration::ZERO).await;
        assert!(link.reaped.is_cancelled());
    }

    #[tokio::test]
    async fn an_answer_the_budget_cannot_hold_is_too_large_and_the_child_goes_on() {
        // 4,000 zeros: 8 KB of text, ~800 KB by the budget's count, over a 256 KiB budget.
        let budget = Budget::new(256 * 1024);
        let link = ChildLink::spawn(
            "t",
            &sh(
                "read line; printf '{\"jsonrpc\":\"2.0\",\"id\":1,\"result\":{\"z\":[0'; \
                 i=0; while [ $i -lt 4000 ]; do printf ',0'; i=$((i+1)); done; printf ']}}\n'; \
                 read line; echo '{\"jsonrpc\":\"2.0\",\"id\":2,\"result\":{\"ok\":true}}'; sleep 30",
            ),
            &Launcher::Direct,
            1 << 20,
            budget.clone(),
            Arc::new(Notify::new()),
            Arc::default(),
        )
        .unwrap();
        let (negotiated, cancel) = (Negotiated::modern(), CancellationToken::new());
        let none = Progress::default();
        let ask = || {
            link.request(
                &negotiated,
                "x",
                Map::new(),
                &cancel,
                Duration::from_secs(20),
                &none,
            )
        };
        let err = ask().await.unwrap_err();
        assert!(
            matches!(&err, CallError::TooLarge(why) if why.contains("upstream_memory")),
            "{err:?}"
        );
        let answer = ask().await.unwrap();
        assert_eq!(answer.result["ok"], true);
        // The answer in hand holds its share; given back with it.
        assert!(budget.try_take(budget.units()).is_none());
        drop(answer);
        assert!(budget.try_take(budget.units()).is_some());
        link.stop(Duration::ZERO).await;
    }

    #[tokio::test]
    async fn every_request_of_a_burst_is_answered() {
        let dir = tempfile::tempdir().unwrap();
        let count = dir.path().join("answered");
        // 1000 requests at once, then the answers read: more answers than the pipe to its
        // stdin holds wait for it, and none may be missing.
        let script = format!(
            "i=0; while [ $i -lt 1000 ]; do echo '{{\"jsonrpc\":\"2.0\",\"id\":'$i',\"method\":\"roots/list\"}}'; i=$((i+1)); done; \
             n=0; while [ $n -lt 1000 ] && read line; do n=$((n+1)); done; echo $n > {}; sleep 30",
            count.display()
        );
        let link = ChildLink::spawn(
            "t",
            &sh(&script),
            &Launcher::Direct,
            1024,
            Budget::new(1 << 20),
            Arc::new(Notify::new()),
            Arc::default(),
        )
        .unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        let answered = loop {
            if let Ok(text) = std::fs::read_to_string(&count)
                && text.ends_with('\n')
            {
                break text.trim().to_owned();
            }
            assert!(
                Instant::now() < deadline,
                "the child never read its answers"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        assert_eq!(answered, "1000");
        assert!(link.why().is_none(), "{:?}", link.why());
        link.stop(Duration::ZERO).await;
    }

    #[tokio::test]
    async fn progress_asked_for_reaches_its_call_and_no_other() {
        // The child answers request 1 with the request it read, after progress for it and
        // for a token that is no request of ours.
        let link = ChildLink::spawn(
            "t",
            &sh(
                "read line; \
                 echo '{\"jsonrpc\":\"2.0\",\"method\":\"notifications/progress\",\"params\":{\"progressToken\":1,\"progress\":5,\"total\":10,\"message\":\"half\"}}'; \
                 echo '{\"jsonrpc\":\"2.0\",\"method\":\"notifications/progress\",\"params\":{\"progressToken\":99,\"progress\":7}}'; \
                 echo \"{\\\"jsonrpc\\\":\\\"2.0\\\",\\\"id\\\":1,\\\"result\\\":{\\\"asked\\\":$line}}\"; sleep 30",
            ),
            &Launcher::Direct,
            1 << 20,
            Budget::new(1 << 20),
            Arc::new(Notify::new()),
            Arc::default(),
        )
        .unwrap();
        let (progress, seen) = Progress::channel();
        let result = link
            .request(
                &Negotiated::modern(),
                "tools/call",
                Map::new(),
                &CancellationToken::new(),
                Duration::from_secs(20),
                &progress,
            )
            .await
            .unwrap()
            .result;
        assert_eq!(result["asked"]["params"]["_meta"]["progressToken"], 1);
        assert_eq!(
            *seen.borrow(),
            Some(crate::catalog::ProgressUpdate {
                progress: 5.0,
                total: Some(10.0),
                message: Some("half".into()),
            })
        );
        link.stop(Duration::ZERO).await;
    }

    #[tokio::test]
    async fn the_environment_is_the_configured_one_and_path() {
        let spec = ChildSpec {
            argv: vec![
                "/bin/sh".into(),
                "-c".into(),
                "read line; printf '{\"jsonrpc\":\"2.0\",\"id\":1,\"result\":{\"env\":\"%s|%s|%s\"}}\\n' \"$PATH\" \"$ONLY\" \"$HOME\"; sleep 30".into(),
            ],
            env: vec![("ONLY".into(), "this".into())],
            cwd: Some("/".into()),
            memory: None,
            confinement: None,
        };
        let link = ChildLink::spawn(
            "t",
            &spec,
            &Launcher::Direct,
            1024,
            Budget::new(1 << 20),
            Arc::new(Notify::new()),
            Arc::default(),
        )
        .unwrap();
        let result = link
            .request(
                &Negotiated::modern(),
                "x",
                Map::new(),
                &CancellationToken::new(),
                Duration::from_secs(20),
                &Progress::default(),
            )
            .await
            .unwrap()
            .result;
        assert_eq!(result["env"], format!("{DEFAULT_PATH}|this|"));
        link.stop(Duration::from_secs(1)).await;
    }
}
