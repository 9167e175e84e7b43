//! Durable jobs: long work returns a handle at once; state and output live in the store.
//!
//! The state machine is ours and canonical (docs/design.md §11.1): `running` → `succeeded` | `failed` |
//! `cancelled` | `timed-out`, or `outcome-unknown` when the process that ran the job died
//! before recording how it ended. A job is never re-run. Two kinds of work exist: a
//! process from a `[jobs.<name>]` template (own process group, killed on cancel or
//! time-out) and an in-process action (a service or container action).

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use parking_lot::Mutex;
use rusqlite::{OptionalExtension, Row, params};
use serde::Serialize;
use tokio::io::{AsyncRead, AsyncReadExt};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::JobTemplate;
use crate::metrics::Metrics;
use crate::store::{Store, StoreError, now, runner};
use crate::vocab::{Caller, JobId};

/// Largest page `job.tail` returns at once.
pub const TAIL_PAGE_MAX: u64 = 256 * 1024;
/// How long a cancelled or timed-out process group gets between SIGTERM and SIGKILL.
const KILL_GRACE: Duration = Duration::from_secs(2);
/// How long daemon shutdown waits for running jobs to record their end.
const SHUTDOWN_WAIT: Duration = Duration::from_secs(3);

use crate::vocab::{JobKind, JobState};
pub use robota_proto::JobRecord;

const JOB_COLUMNS: &str = "id, owner, kind, target, action, state, created_at, finished_at, \
                           exit_code, detail, output_bytes, output_dropped";

fn job_from_row(r: &Row<'_>) -> rusqlite::Result<JobRecord> {
    Ok(JobRecord {
        job_id: r.get(0)?,
        owner: r.get(1)?,
        kind: r.get(2)?,
        target: r.get(3)?,
        action: r.get(4)?,
        state: JobState::parse(&r.get::<_, String>(5)?).unwrap_or(JobState::OutcomeUnknown),
        created_at: r.get(6)?,
        finished_at: r.get(7)?,
        exit_code: r.get(8)?,
        detail: r.get(9)?,
        output_bytes: r.get(10)?,
        output_dropped: r.get(11)?,
    })
}

/// One page of a job's output.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Tail {
    pub job_id: i64,
    pub state: JobState,
    /// Chunks in the order they were written, each tagged with its stream.
    pub chunks: Vec<TailChunk>,
    /// Pass this back as `cursor` for the next page.
    pub next_cursor: u64,
    /// The job has finished and there is no output past `next_cursor`.
    pub complete: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TailChunk {
    pub offset: u64,
    pub stream: String,
    /// UTF-8 text (invalid sequences replaced).
    pub text: String,
}

/// What a finished piece of work reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finish {
    pub state: JobState,
    pub exit_code: Option<i32>,
    pub detail: String,
}

impl Finish {
    pub fn succeeded(detail: impl Into<String>) -> Self {
        Self {
            state: JobState::Succeeded,
            exit_code: None,
            detail: detail.into(),
        }
    }

    pub fn failed(detail: impl Into<String>) -> Self {
        Self {
            state: JobState::Failed,
            exit_code: None,
            detail: detail.into(),
        }
    }
}

pub type ActionFuture = Pin<Box<dyn Future<Output = Finish> + Send>>;

/// The work a job does.
pub enum Work {
    /// A process from a job template.
    Process(JobTemplate),
    /// An in-process action; it may write output through the sink. Dropped (cancelled)
    /// at the time limit or on `job.cancel`.
    Action {
        timeout: Duration,
        run: Box<dyn FnOnce(OutputSink) -> ActionFuture + Send>,
    },
}

/// Appends a job's output to the store, keeping at most `cap` bytes.
#[derive(Clone)]
pub struct OutputSink {
    inner: Arc<Mutex<SinkState>>,
    store: Arc<Store>,
    job_id: i64,
    cap: u64,
}

struct SinkState {
    kept: u64,
    dropped: u64,
}

impl OutputSink {
    fn new(store: Arc<Store>, job_id: i64, cap: u64) -> Self {
        Self {
            inner: Arc::new(Mutex::new(SinkState {
                kept: 0,
                dropped: 0,
            })),
            store,
            job_id,
            cap,
        }
    }

    /// Append bytes of `stream` (`stdout`, `stderr`, `log`).
    pub fn write(&self, stream: &str, bytes: &[u8]) {
        let mut state = self.inner.lock();
        let room = self.cap.saturating_sub(state.kept);
        let keep = bytes.len().min(usize::try_from(room).unwrap_or(usize::MAX));
        let dropped = (bytes.len() - keep) as u64;
        let offset = state.kept;
        state.kept += keep as u64;
        state.dropped += dropped;
        let (kept, total_dropped) = (state.kept, state.dropped);
        let job_id = self.job_id;
        let result = self.store.with(|c| {
            let tx = c.transaction()?;
            if keep > 0 {
                tx.execute(
                    "INSERT INTO job_output (job_id, offset, stream, data) VALUES (?1, ?2, ?3, ?4)",
                    params![job_id, offset, stream, &bytes[..keep]],
                )?;
            }
            tx.execute(
                "UPDATE jobs SET output_bytes = ?2, output_dropped = ?3 WHERE id = ?1",
                params![job_id, kept, total_dropped],
            )?;
            tx.commit()
        });
        drop(state);
        if let Err(e) = result {
            tracing::error!(job_id, error = %e, "cannot store job output");
        }
    }
}

/// The job table's owner for this process.
pub struct Jobs {
    store: Arc<Store>,
    metrics: Metrics,
    running: Mutex<HashMap<i64, CancellationToken>>,
    max_running: std::sync::atomic::AtomicUsize,
    tracker: TaskTracker,
    /// Ends of jobs the store could not take yet (a full disk), with when they ended:
    /// answered from here and written as soon as the store takes them.
    unrecorded: Arc<Mutex<HashMap<i64, (Finish, i64)>>>,
}

/// How often, and for how long, the end of a job the store refused is tried again.
const RECORD_RETRY: Duration = Duration::from_secs(2);
const RECORD_RETRIES: u32 = 1800;

fn record_end(store: &Store, id: i64, finish: &Finish, at: i64) -> Result<usize, StoreError> {
    store.with(|c| {
        c.execute(
            "UPDATE jobs SET state = ?2, finished_at = ?3, exit_code = ?4, detail = ?5 \
             WHERE id = ?1 AND state = 'running'",
            params![
                id,
                finish.state.as_str(),
                at,
                finish.exit_code,
                finish.detail
            ],
        )
    })
}

/// If job `id` is `running` in the store but the process that ran it is gone: kill what is
/// left of its process group and mark it `outcome-unknown` (never re-run). Returns whether
/// it did.
fn settle_orphan(store: &Store, id: i64) -> Result<bool, StoreError> {
    let row: Option<(String, Option<u32>, Option<u64>)> = store.with(|c| {
        c.query_row(
            "SELECT runner, pid, pid_start_time FROM jobs WHERE id = ?1 AND state = 'running'",
            [id],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
        )
        .optional()
    })?;
    let Some((job_runner, pid, pid_start)) = row else {
        return Ok(false);
    };
    if runner::alive(&job_runner) {
        return Ok(false);
    }
    if let (Some(pid), Some(start)) = (pid, pid_start)
        && group_is_the_jobs(pid, start)
    {
        tracing::warn!(
            job_id = id,
            pgid = pid,
            "killing the process group of an orphaned job"
        );
        let _ = killpg(Pid::from_raw(pid as i32), Signal::SIGKILL);
    }
    let changed = store.with(|c| {
        c.execute(
            "UPDATE jobs SET state = 'outcome-unknown', finished_at = ?2, \
             detail = 'the process running this job stopped before it ended; it was not re-run' \
             WHERE id = ?1 AND state = 'running'",
            params![id, now()],
        )
    })?;
    Ok(changed > 0)
}

/// Whether process group `pgid` still holds the job's processes: its leader is the job's
/// (same start time), or the leader is gone and the members all started no earlier than
/// it did (a pid stays allocated while its group exists, so such a group is the job's).
fn group_is_the_jobs(pgid: u32, leader_start: u64) -> bool {
    match runner::start_time(pgid) {
        Some(start) => start == leader_start,
        None => {
            let members = runner::group_members(pgid);
            !members.is_empty() && members.iter().all(|(_, start)| *start >= leader_start)
        }
    }
}

/// Why a job could not be started, read or cancelled.
#[derive(Debug, thiserror::Error)]
pub enum JobError {
    /// No such job, or not the caller's (the two look the same to it).
    #[error("there is no job {0} of yours")]
    NotFound(JobId),
    #[error("{0} jobs are running, the most this host allows; try again later")]
    Busy(usize),
    /// Running in another robota-mcpd process (a `--stdio` one) sharing the store.
    #[error("job {0} is run by another robota-mcpd process; cancel it there")]
    Elsewhere(JobId),
    #[error("the job store failed")]
    Store(#[from] StoreError),
}

impl Jobs {
    /// Take over the job table: jobs left `running` by a process that is gone become
    /// `outcome-unknown` (their process groups, if still alive, are killed first).
    pub fn open(
        store: Arc<Store>,
        max_running: usize,
        metrics: Metrics,
    ) -> Result<(Arc<Self>, usize), StoreError> {
        let orphans: Vec<i64> = store.with(|c| {
            let mut stmt = c.prepare("SELECT id FROM jobs WHERE state = 'running'")?;
            stmt.query_map([], |r| r.get(0))?.collect()
        })?;
        let mut recovered = 0;
        for id in orphans {
            if settle_orphan(&store, id)? {
                recovered += 1;
            }
        }
        Ok((
            Arc::new(Self {
                store,
                metrics,
                running: Mutex::new(HashMap::new()),
                max_running: max_running.into(),
                tracker: TaskTracker::new(),
                unrecorded: Arc::default(),
            }),
            recovered,
        ))
    }

    pub fn store(&self) -> &Arc<Store> {
        &self.store
    }

    /// How many jobs may run at once from now on (a reload); running ones carry on.
    pub fn set_max_running(&self, max: usize) {
        self.max_running
            .store(max, std::sync::atomic::Ordering::Relaxed);
    }

    /// Jobs running in this process.
    pub fn running_count(&self) -> usize {
        self.running.lock().len()
    }

    /// Record a new job and start its work. Returns the record at once.
    pub fn start(
        self: &Arc<Self>,
        owner: &Caller,
        kind: JobKind,
        target: &str,
        action: Option<&str>,
        work: Work,
    ) -> Result<JobRecord, JobError> {
        let cancel = CancellationToken::new();
        let id = {
            let mut running = self.running.lock();
            if running.len() >= self.max_running.load(std::sync::atomic::Ordering::Relaxed) {
                return Err(JobError::Busy(running.len()));
            }
            let id = self.store.with(|c| {
                c.execute(
                    "INSERT INTO jobs (owner, kind, target, action, state, created_at, runner) \
                         VALUES (?1, ?2, ?3, ?4, 'running', ?5, ?6)",
                    params![
                        owner.to_string(),
                        kind.as_str(),
                        target,
                        action,
                        now(),
                        runner::this()
                    ],
                )?;
                Ok(c.last_insert_rowid())
            })?;
            running.insert(id, cancel.clone());
            id
        };
        self.metrics.job_started(kind);
        tracing::info!(job_id = id, %owner, kind = kind.as_str(), target, action, "job started");
        let jobs = Arc::clone(self);
        self.tracker.spawn(async move {
            let finish = match work {
                Work::Process(template) => jobs.run_process(id, &template, &cancel).await,
                Work::Action { timeout, run } => {
                    let sink = OutputSink::new(
                        Arc::clone(&jobs.store),
                        id,
                        crate::config::JOB_OUTPUT_DEFAULT,
                    );
                    // An action asks another system (systemd, the Docker engine) to act;
                    // once asked, no longer waiting does not undo it. So a cancel, a
                    // time-out or a daemon stop leaves its outcome unknown, never
                    // "cancelled" (which would invite a blind retry).
                    let gave_up = |why: String| Finish {
                        state: JobState::OutcomeUnknown,
                        exit_code: None,
                        detail: format!(
                            "{why}; the action may still take effect: check before retrying"
                        ),
                    };
                    tokio::select! {
                        biased;
                        () = cancel.cancelled() => gave_up("stopped waiting on cancel".into()),
                        () = tokio::time::sleep(timeout) => gave_up(format!(
                            "no answer within {}",
                            humantime::format_duration(timeout)
                        )),
                        finish = run(sink) => finish,
                    }
                }
            };
            jobs.finish(id, kind, &finish);
        });
        self.get(id)?.ok_or(JobError::NotFound(JobId(id)))
    }

    fn finish(&self, id: i64, kind: JobKind, finish: &Finish) {
        self.running.lock().remove(&id);
        self.metrics.job_finished(kind, finish.state);
        if finish.state == JobState::Succeeded {
            tracing::info!(job_id = id, state = finish.state.as_str(), detail = %finish.detail, "job finished");
        } else {
            // Failed, timed out, cancelled or of unknown outcome: what an operator looks for.
            tracing::warn!(job_id = id, state = finish.state.as_str(), detail = %finish.detail, "job finished without success");
        }
        let at = now();
        if let Err(e) = record_end(&self.store, id, finish, at) {
            tracing::error!(job_id = id, error = %e, "cannot record the end of a job; it is answered from memory and recorded once the store takes it");
            self.unrecorded.lock().insert(id, (finish.clone(), at));
            let (store, unrecorded, finish) =
                (self.store.clone(), self.unrecorded.clone(), finish.clone());
            let _ = std::thread::Builder::new()
                .name("job-end-retry".into())
                .spawn(move || {
                    for _ in 0..RECORD_RETRIES {
                        std::thread::sleep(RECORD_RETRY);
                        if record_end(&store, id, &finish, at).is_ok() {
                            unrecorded.lock().remove(&id);
                            tracing::info!(job_id = id, "the end of the job is recorded now");
                            return;
                        }
                    }
                    tracing::error!(job_id = id, "the end of the job could not be recorded; the next start settles it as outcome-unknown");
                });
        }
    }

    /// `job` as it is: an end the store has not taken yet is part of it.
    fn with_unrecorded(&self, mut job: JobRecord) -> JobRecord {
        if let Some((finish, at)) = self.unrecorded.lock().get(&job.job_id) {
            job.state = finish.state;
            job.finished_at = Some(*at);
            job.exit_code = finish.exit_code;
            job.detail = Some(finish.detail.clone());
        }
        job
    }

    async fn run_process(&self, id: i64, t: &JobTemplate, cancel: &CancellationToken) -> Finish {
        let mut command = tokio::process::Command::new(&t.argv[0]);
        command
            .args(&t.argv[1..])
            .env_clear()
            .envs(&t.env)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0)
            .kill_on_drop(true);
        if !t.env.contains_key("PATH") {
            command.env("PATH", "/usr/local/bin:/usr/bin:/bin");
        }
        if let Some(dir) = &t.working_dir {
            command.current_dir(dir);
        }
        let mut child = match command.spawn() {
            Ok(child) => child,
            Err(e) => {
                return Finish::failed(format!("could not start {}: {e}", t.argv[0]));
            }
        };
        let pid = child.id();
        if let Some(pid) = pid {
            let start = runner::start_time(pid);
            if let Err(e) = self.store.with(|c| {
                c.execute(
                    "UPDATE jobs SET pid = ?2, pid_start_time = ?3 WHERE id = ?1",
                    params![id, pid, start],
                )
            }) {
                tracing::error!(job_id = id, error = %e, "cannot record a job's pid");
            }
        }
        let sink = OutputSink::new(Arc::clone(&self.store), id, t.output_cap);
        let pump = |stream: Option<Box<dyn AsyncRead + Send + Unpin>>, name: &'static str| {
            let sink = sink.clone();
            async move {
                let Some(mut stream) = stream else { return };
                let mut buf = vec![0u8; 16 * 1024];
                while let Ok(n) = stream.read(&mut buf).await {
                    if n == 0 {
                        break;
                    }
                    sink.write(name, &buf[..n]);
                }
            }
        };
        let stdout = pump(
            child
                .stdout
                .take()
                .map(|s| Box::new(s) as Box<dyn AsyncRead + Send + Unpin>),
            "stdout",
        );
        let stderr = pump(
            child
                .stderr
                .take()
                .map(|s| Box::new(s) as Box<dyn AsyncRead + Send + Unpin>),
            "stderr",
        );
        let group = pid.map(|p| Pid::from_raw(p as i32));
        let run = async {
            let mut pumps = std::pin::pin!(async {
                let ((), ()) = tokio::join!(stdout, stderr);
            });
            let mut drained = false;
            let status = tokio::select! {
                status = child.wait() => status,
                () = &mut pumps => {
                    drained = true;
                    child.wait().await
                }
            };
            // The job is its leader: once it exits, anything it left behind in its group
            // goes with it, and the output is drained (bounded: a process that left the
            // group may hold the pipe open).
            if let Some(group) = group {
                let _ = killpg(group, Signal::SIGKILL);
            }
            if !drained {
                let _ = tokio::time::timeout(KILL_GRACE, pumps).await;
            }
            status
        };
        let ended = tokio::select! {
            biased;
            () = cancel.cancelled() => Err(Finish { state: JobState::Cancelled, exit_code: None, detail: "cancelled; its process group was killed".into() }),
            () = tokio::time::sleep(t.timeout) => Err(Finish {
                state: JobState::TimedOut,
                exit_code: None,
                detail: format!("ran longer than {}; its process group was killed", humantime::format_duration(t.timeout)),
            }),
            status = run => Ok(status),
        };
        match ended {
            Ok(Ok(status)) => match status.code() {
                Some(0) => Finish {
                    state: JobState::Succeeded,
                    exit_code: Some(0),
                    detail: "exited with status 0".into(),
                },
                Some(code) => Finish {
                    state: JobState::Failed,
                    exit_code: Some(code),
                    detail: format!("exited with status {code}"),
                },
                None => Finish::failed("was killed by a signal"),
            },
            Ok(Err(e)) => Finish::failed(format!("waiting for the job failed: {e}")),
            Err(finish) => {
                if let Some(group) = group {
                    let _ = killpg(group, Signal::SIGTERM);
                    if tokio::time::timeout(KILL_GRACE, child.wait())
                        .await
                        .is_err()
                    {
                        let _ = killpg(group, Signal::SIGKILL);
                    }
                    let _ = killpg(group, Signal::SIGKILL);
                }
                let _ = child.wait().await;
                finish
            }
        }
    }

    pub fn get(&self, id: i64) -> Result<Option<JobRecord>, StoreError> {
        // A job another process ran, and that process is gone (a `--stdio` process that
        // ended, or a crashed daemon sharing the store): settle it now.
        if !self.running.lock().contains_key(&id) {
            settle_orphan(&self.store, id)?;
        }
        let job = self.store.with(|c| {
            c.query_row(
                &format!("SELECT {JOB_COLUMNS} FROM jobs WHERE id = ?1"),
                [id],
                job_from_row,
            )
            .optional()
        })?;
        Ok(job.map(|j| self.with_unrecorded(j)))
    }

    /// The job, if `caller` may see it: its owner, or the operator (`None`).
    pub fn visible(&self, caller: Option<&Caller>, id: JobId) -> Result<JobRecord, JobError> {
        match self.get(id.0)? {
            Some(job) if caller.is_none_or(|c| c.to_string() == job.owner) => Ok(job),
            _ => Err(JobError::NotFound(id)),
        }
    }

    /// A page of output from `cursor` (a byte offset), at most `max_bytes`.
    pub fn tail(
        &self,
        caller: Option<&Caller>,
        id: JobId,
        cursor: u64,
        max_bytes: u64,
    ) -> Result<Tail, JobError> {
        let job = self.visible(caller, id)?;
        let JobId(id) = id;
        let max_bytes = max_bytes.clamp(1, TAIL_PAGE_MAX);
        let rows: Vec<(u64, String, Vec<u8>)> = self.store.with(|c| {
            // The chunk containing the cursor, then the ones after it.
            // Starts at the chunk holding the cursor, found through the primary key
            // (no scan of the job's earlier output).
            let mut stmt = c.prepare(
                "SELECT offset, stream, data FROM job_output WHERE job_id = ?1 \
                     AND offset >= COALESCE((SELECT MAX(offset) FROM job_output \
                                             WHERE job_id = ?1 AND offset <= ?2), 0) \
                     AND offset + length(data) > ?2 ORDER BY offset LIMIT 256",
            )?;
            stmt.query_map(params![id, cursor], |r| {
                Ok((r.get(0)?, r.get(1)?, r.get(2)?))
            })?
            .collect()
        })?;
        let mut chunks = Vec::new();
        let mut next = cursor.min(job.output_bytes);
        let mut budget = max_bytes;
        for (offset, stream, data) in rows {
            if budget == 0 {
                break;
            }
            let skip = usize::try_from(next.saturating_sub(offset)).unwrap_or(usize::MAX);
            let data = data.get(skip..).unwrap_or_default();
            let take = data
                .len()
                .min(usize::try_from(budget).unwrap_or(usize::MAX));
            let piece = &data[..take];
            chunks.push(TailChunk {
                offset: offset + skip as u64,
                stream,
                text: String::from_utf8_lossy(piece).into_owned(),
            });
            next = offset + (skip + take) as u64;
            budget -= take as u64;
        }
        Ok(Tail {
            job_id: id,
            state: job.state,
            chunks,
            next_cursor: next,
            complete: job.state.finished() && next >= job.output_bytes,
        })
    }

    /// Cancel a running job: its owner, or the operator (`None`).
    pub fn cancel(&self, caller: Option<&Caller>, id: JobId) -> Result<JobRecord, JobError> {
        let job = self.visible(caller, id)?;
        if job.state.finished() {
            return Ok(job);
        }
        let token = self.running.lock().get(&id.0).cloned();
        match token {
            Some(token) => token.cancel(),
            None => {
                // It may have ended since it was read; else another live process runs it.
                let now = self.visible(caller, id)?;
                if now.state.finished() {
                    return Ok(now);
                }
                return Err(JobError::Elsewhere(id));
            }
        }
        Ok(job)
    }

    /// The most recent jobs, newest first; only `owner`'s when given.
    pub fn list(&self, owner: Option<&str>, limit: usize) -> Result<Vec<JobRecord>, StoreError> {
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        self.store
            .with(|c| {
                let mut stmt = c.prepare(&format!(
                    "SELECT {JOB_COLUMNS} FROM jobs WHERE (?1 IS NULL OR owner = ?1) \
                 ORDER BY id DESC LIMIT ?2"
                ))?;
                stmt.query_map(params![owner, limit], job_from_row)?
                    .collect::<Result<Vec<_>, _>>()
            })
            .map(|jobs| jobs.into_iter().map(|j| self.with_unrecorded(j)).collect())
    }

    /// Daemon shutdown: cancel what runs here and give it a moment to record its end.
    /// Whatever has not recorded its end by then is `outcome-unknown` at the next start.
    pub async fn shutdown(&self) {
        for token in self.running.lock().values() {
            token.cancel();
        }
        self.tracker.close();
        let _ = tokio::time::timeout(SHUTDOWN_WAIT, self.tracker.wait()).await;
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::os::unix::process::CommandExt;

    use super::*;

    fn template(script: &str, timeout: Duration, cap: u64) -> JobTemplate {
        JobTemplate {
            name: "t".into(),
            argv: vec!["/bin/sh".into(), "-c".into(), script.into()],
            env: BTreeMap::new(),
            working_dir: None,
            timeout,
            output_cap: cap,
            description: None,
        }
    }

    async fn wait_done(jobs: &Jobs, id: i64) -> JobRecord {
        for _ in 0..200 {
            let job = jobs.get(id).unwrap().unwrap();
            if job.state.finished() {
                return job;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        panic!("job {id} did not finish");
    }

    fn jobs(dir: &std::path::Path, max: usize) -> Arc<Jobs> {
        Jobs::open(Arc::new(Store::open(dir).unwrap()), max, Metrics::new())
            .unwrap()
            .0
    }

    #[tokio::test]
    async fn a_job_runs_records_output_and_pages_by_cursor() {
        let dir = tempfile::tempdir().unwrap();
        let jobs = jobs(dir.path(), 4);
        let owner = Caller::Local(1000);
        let job = jobs
            .start(
                &owner,
                JobKind::Template,
                "t",
                None,
                Work::Process(template(
                    "printf 0123456789; printf oops >&2; exit 3",
                    Duration::from_secs(10),
                    1024,
                )),
            )
            .unwrap();
        assert_eq!(job.state, JobState::Running);
        let done = wait_done(&jobs, job.job_id).await;
        assert_eq!(done.state, JobState::Failed);
        assert_eq!(done.exit_code, Some(3));
        assert_eq!(done.output_bytes, 14);
        let page = jobs.tail(Some(&owner), JobId(job.job_id), 0, 4).unwrap();
        let text: String = page.chunks.iter().map(|c| c.text.as_str()).collect();
        assert_eq!(text.len(), 4);
        assert_eq!(page.next_cursor, 4);
        assert!(!page.complete);
        let mut all = text;
        let mut cursor = page.next_cursor;
        loop {
            let page = jobs
                .tail(Some(&owner), JobId(job.job_id), cursor, 3)
                .unwrap();
            all.extend(page.chunks.iter().map(|c| c.text.as_str()));
            cursor = page.next_cursor;
            if page.complete {
                break;
            }
        }
        assert_eq!(all.len(), 14);
        assert!(all.contains("0123456789") || all.contains("oops"));
        // Another caller cannot see it.
        let err = jobs
            .tail(Some(&Caller::Local(1)), JobId(job.job_id), 0, 10)
            .unwrap_err();
        assert!(matches!(err, JobError::NotFound(_)), "{err}");
    }

    #[tokio::test]
    async fn a_job_ends_with_its_leader_even_when_a_child_holds_its_output() {
        let dir = tempfile::tempdir().unwrap();
        let jobs = jobs(dir.path(), 4);
        let started = std::time::Instant::now();
        let job = jobs
            .start(
                &Caller::Local(0),
                JobKind::Template,
                "t",
                None,
                Work::Process(template(
                    "sleep 60 & echo started; exit 0",
                    Duration::from_secs(30),
                    1024,
                )),
            )
            .unwrap();
        let done = wait_done(&jobs, job.job_id).await;
        assert_eq!(done.state, JobState::Succeeded, "{done:?}");
        assert_eq!(done.output_bytes, 8);
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{:?}",
            started.elapsed()
        );
    }

    #[tokio::test]
    async fn an_orphaned_group_whose_leader_died_is_killed_at_recovery() {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(Store::open(dir.path()).unwrap());
        // A "job" whose leader exits at once, leaving a member in its group.
        let mut leader = std::process::Command::new("/bin/sh")
            .args(["-c", "sleep 60 & echo $!"])
            .process_group(0)
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let pgid = leader.id();
        let start = runner::start_time(pgid).unwrap();
        let mut line = String::new();
        std::io::BufRead::read_line(
            &mut std::io::BufReader::new(leader.stdout.take().unwrap()),
            &mut line,
        )
        .unwrap();
        let member: i32 = line.trim().parse().unwrap();
        leader.wait().unwrap();
        assert_eq!(
            runner::group_members(pgid).len(),
            1,
            "the member outlives its leader"
        );
        store
            .with(|c| {
                c.execute(
                    "INSERT INTO jobs (owner, kind, target, state, created_at, runner, pid, pid_start_time) \
                     VALUES ('local:0', 'template', 't', 'running', 0, '1:1', ?1, ?2)",
                    params![pgid, start],
                )
            })
            .unwrap();
        let (jobs, recovered) = Jobs::open(store, 4, Metrics::new()).unwrap();
        assert_eq!(recovered, 1);
        assert_eq!(
            jobs.list(None, 1).unwrap()[0].state,
            JobState::OutcomeUnknown
        );
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while nix::sys::signal::kill(Pid::from_raw(member), None).is_ok()
            && std::fs::read_to_string(format!("/proc/{member}/stat"))
                .is_ok_and(|s| !s.contains(") Z"))
        {
            assert!(
                std::time::Instant::now() < deadline,
                "the orphaned member survived"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    #[tokio::test]
    async fn output_over_the_cap_is_counted_not_kept() {
        let dir = tempfile::tempdir().unwrap();
        let jobs = jobs(dir.path(), 4);
        let job = jobs
            .start(
                &Caller::Local(0),
                JobKind::Template,
                "t",
                None,
                Work::Process(template(
                    "head -c 5000 /dev/zero",
                    Duration::from_secs(10),
                    1000,
                )),
            )
            .unwrap();
        let done = wait_done(&jobs, job.job_id).await;
        assert_eq!(done.state, JobState::Succeeded);
        assert_eq!(done.output_bytes, 1000);
        assert_eq!(done.output_dropped, 4000);
    }

    #[tokio::test]
    async fn cancel_and_time_out_kill_the_process_group() {
        let dir = tempfile::tempdir().unwrap();
        let jobs = jobs(dir.path(), 4);
        let owner = Caller::Bearer("ci".into());
        let marker = dir.path().join("grandchild-ran");
        let script = format!("(sleep 1; touch {}) & sleep 30", marker.display());
        let job = jobs
            .start(
                &owner,
                JobKind::Template,
                "t",
                None,
                Work::Process(template(&script, Duration::from_secs(30), 1024)),
            )
            .unwrap();
        // Another caller cannot cancel it.
        assert!(
            jobs.cancel(Some(&Caller::Local(5)), JobId(job.job_id))
                .is_err()
        );
        jobs.cancel(Some(&owner), JobId(job.job_id)).unwrap();
        let done = wait_done(&jobs, job.job_id).await;
        assert_eq!(done.state, JobState::Cancelled);
        tokio::time::sleep(Duration::from_millis(1500)).await;
        assert!(
            !marker.exists(),
            "the background grandchild survived the cancel"
        );

        let job = jobs
            .start(
                &owner,
                JobKind::Template,
                "t",
                None,
                Work::Process(template("sleep 30", Duration::from_millis(200), 1024)),
            )
            .unwrap();
        let done = wait_done(&jobs, job.job_id).await;
        assert_eq!(done.state, JobState::TimedOut);
    }

    #[tokio::test]
    async fn the_running_job_limit_answers_busy() {
        let dir = tempfile::tempdir().unwrap();
        let jobs = jobs(dir.path(), 1);
        let owner = Caller::Local(0);
        let first = jobs
            .start(
                &owner,
                JobKind::Template,
                "t",
                None,
                Work::Process(template("sleep 30", Duration::from_secs(30), 10)),
            )
            .unwrap();
        let err = jobs
            .start(
                &owner,
                JobKind::Template,
                "t",
                None,
                Work::Process(template("true", Duration::from_secs(30), 10)),
            )
            .unwrap_err();
        assert!(matches!(err, JobError::Busy(_)), "{err}");
        jobs.cancel(None, JobId(first.job_id)).unwrap();
        wait_done(&jobs, first.job_id).await;
    }

    #[tokio::test]
    async fn jobs_of_a_dead_process_become_outcome_unknown_and_are_not_rerun() {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(Store::open(dir.path()).unwrap());
        store
            .with(|c| {
                c.execute(
                    "INSERT INTO jobs (owner, kind, target, state, created_at, runner) \
                     VALUES ('local:0', 'template', 't', 'running', 0, '1:1')",
                    [],
                )?;
                // A job of this (live) process is left alone.
                c.execute(
                    "INSERT INTO jobs (owner, kind, target, state, created_at, runner) \
                     VALUES ('local:0', 'template', 't', 'running', 0, ?1)",
                    [runner::this()],
                )
            })
            .unwrap();
        let (jobs, recovered) = Jobs::open(store, 4, Metrics::new()).unwrap();
        assert_eq!(recovered, 1);
        let list = jobs.list(None, 10).unwrap();
        assert_eq!(list.len(), 2);
        assert_eq!(list[1].state, JobState::OutcomeUnknown);
        assert_eq!(list[0].state, JobState::Running);
    }

    #[tokio::test]
    async fn actions_finish_time_out_and_write_output() {
        let dir = tempfile::tempdir().unwrap();
        let jobs = jobs(dir.path(), 4);
        let owner = Caller::Local(0);
        let job = jobs
            .start(
                &owner,
                JobKind::Service,
                "nginx.service",
                Some("restart"),
                Work::Action {
                    timeout: Duration::from_secs(5),
                    run: Box::new(|sink| {
                        Box::pin(async move {
                            sink.write("log", b"restarting");
                            Finish::succeeded("done")
                        })
                    }),
                },
            )
            .unwrap();
        let done = wait_done(&jobs, job.job_id).await;
        assert_eq!(done.state, JobState::Succeeded);
        assert_eq!(done.action.as_deref(), Some("restart"));
        assert_eq!(done.output_bytes, 10);
        let job = jobs
            .start(
                &owner,
                JobKind::Service,
                "x",
                Some("stop"),
                Work::Action {
                    timeout: Duration::from_millis(100),
                    run: Box::new(|_| {
                        Box::pin(async {
                            // An action whose answer never comes.
                            std::future::pending::<Finish>().await
                        })
                    }),
                },
            )
            .unwrap();
        // Nobody knows whether the stop happened: never "timed-out" or "cancelled".
        let done = wait_done(&jobs, job.job_id).await;
        assert_eq!(done.state, JobState::OutcomeUnknown);
        assert!(done.detail.unwrap().contains("may still take effect"));
        let job = jobs
            .start(
                &owner,
                JobKind::Docker,
                "web",
                Some("restart"),
                Work::Action {
                    timeout: Duration::from_secs(30),
                    run: Box::new(|_| {
                        Box::pin(async {
                            // An action whose answer never comes.
                            std::future::pending::<Finish>().await
                        })
                    }),
                },
            )
            .unwrap();
        jobs.cancel(Some(&owner), JobId(job.job_id)).unwrap();
        assert_eq!(
            wait_done(&jobs, job.job_id).await.state,
            JobState::OutcomeUnknown
        );
    }
}
