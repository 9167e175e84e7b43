//! Refusal audit: the record booked for every refusal, and grant events.
//!
//! A record carries a time, a carrier, a reason, the `throttled` flag and an address
//! class — never token text, never the address itself. Records go to the log (journald
//! fields when logging to the journal), to bounded in-memory rings that
//! `robota-mcpctl audit` reads, and to `<state dir>/audit.jsonl`, appended by a writer
//! thread off the request path, compacted to the newest [`KEEP`] records of each class,
//! read back at start so the history survives restarts.
//!
//! Floods stay bounded and honest:
//! - Refusals and every other record (grant requests and decisions) are kept in separate
//!   rings and separate shares of the file: no number of refusals evicts a decision.
//! - Per [`INTERVAL_SECS`], at most [`PER_KEY`] refusals per (carrier, reason) and
//!   [`PER_INTERVAL`] in all get a record and a log line of their own; the rest are
//!   counted and come out, once the interval has ended, as one aggregate record (with
//!   `count`) and one summary line per (carrier, reason, throttled, address class). The
//!   counts of all records add up to the number of refusals.
//! - `status` counts come from per-minute counters per reason ([`Audit::last_hour`]),
//!   which neither folding nor retention reduces.

use std::collections::{BTreeMap, VecDeque};
use std::io::{BufRead, BufReader, BufWriter, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender};
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::health::Health;
use crate::vocab::{AddressClass, Carrier, GrantEvent, Reason, StatePart, UpstreamEvent};
use parking_lot::Mutex;
use robota_proto::AuditRecord;

/// One refusal.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    pub time: SystemTime,
    pub carrier: Carrier,
    pub reason: Reason,
    pub throttled: bool,
    pub address_class: AddressClass,
}

impl Record {
    /// A refusal at `time` of a client of `address_class` on `carrier`, not throttled.
    pub fn refusal(
        time: SystemTime,
        carrier: Carrier,
        reason: Reason,
        address_class: AddressClass,
    ) -> Self {
        Self {
            time,
            carrier,
            reason,
            throttled: false,
            address_class,
        }
    }
}

/// Unix seconds of `t` (0 before the epoch).
fn unix(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// Records of each class kept in memory, and in the file after compaction: refusals and
/// everything else (grant events) are kept apart, so no number of refusals can push a
/// decision out.
pub const KEEP: usize = 10_000;
/// Records queued for the writer before new ones are kept in memory only.
const QUEUE: usize = 4096;
/// The audit file under the state directory.
pub const FILE_NAME: &str = "audit.jsonl";

/// The span of one aggregation interval, in seconds: intervals are unix seconds.
pub const INTERVAL_SECS: u64 = 1;
/// Refusals with the same carrier and reason that get a record (and a log line) of their
/// own in one interval; past it they are folded into an aggregate.
pub const PER_KEY: u32 = 20;
/// Refusals of any kind that get a record of their own in one interval.
pub const PER_INTERVAL: u32 = 100;
/// The span `status` summarises, in per-minute buckets.
const MINUTES: usize = 60;

/// Why the audit store could not be opened.
#[derive(Debug, thiserror::Error)]
#[error("cannot open the audit store {path}")]
pub struct OpenError {
    path: PathBuf,
    #[source]
    source: std::io::Error,
}

/// Filters for [`Audit::query`].
#[derive(Debug, Clone, Default)]
pub struct Query {
    pub since: Option<u64>,
    pub reason: Option<String>,
    pub after_seq: Option<u64>,
    pub limit: usize,
}

/// What the refusals folded in one interval have in common.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct FoldKey {
    carrier: Carrier,
    reason: Reason,
    throttled: bool,
    address_class: AddressClass,
}

/// Refusals past the rate, counted per interval (the interval's first unix second).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Folded {
    interval: u64,
    key: FoldKey,
    count: u64,
}

/// The rate at which refusals get records of their own: per interval, at most
/// [`PER_KEY`] per (carrier, reason) and [`PER_INTERVAL`] in all; the rest are counted by
/// [`FoldKey`] and come out as aggregates when the interval has ended. Pure: time is
/// given, so tests drive it by hand.
#[derive(Debug, Default)]
struct Fold {
    interval: u64,
    own_total: u32,
    own: BTreeMap<(Carrier, Reason), u32>,
    folded: BTreeMap<FoldKey, u64>,
}

impl Fold {
    /// The aggregates of an interval that ended before `now` (unix seconds), once.
    fn due(&mut self, now: u64) -> Vec<Folded> {
        // A clock that went back keeps counting in the open interval.
        if now <= self.interval {
            return Vec::new();
        }
        let ended = self.interval;
        self.interval = now;
        self.own_total = 0;
        self.own.clear();
        std::mem::take(&mut self.folded)
            .into_iter()
            .map(|(key, count)| Folded {
                interval: ended,
                key,
                count,
            })
            .collect()
    }

    /// Every aggregate still open, the current interval's included (at shutdown).
    fn drain(&mut self) -> Vec<Folded> {
        let interval = self.interval;
        self.own_total = 0;
        self.own.clear();
        std::mem::take(&mut self.folded)
            .into_iter()
            .map(|(key, count)| Folded {
                interval,
                key,
                count,
            })
            .collect()
    }

    /// Whether a refusal at `now` (after [`Fold::due`] for `now`) gets its own record;
    /// if not, it is counted.
    fn admit(&mut self, key: FoldKey) -> bool {
        let own = self.own.entry((key.carrier, key.reason)).or_insert(0);
        if *own < PER_KEY && self.own_total < PER_INTERVAL {
            *own += 1;
            self.own_total += 1;
            true
        } else {
            *self.folded.entry(key).or_insert(0) += 1;
            false
        }
    }
}

/// Refusals per reason in each of the last [`MINUTES`] minutes: the counters `status`
/// reads. Records can be folded or evicted; these counts cannot.
#[derive(Debug)]
struct Recent {
    /// (unix minute, count per reason in [`Reason::ALL`] order), indexed by minute.
    buckets: [(u64, [u64; Reason::ALL.len()]); MINUTES],
}

impl Default for Recent {
    fn default() -> Self {
        Self {
            buckets: [(u64::MAX, [0; Reason::ALL.len()]); MINUTES],
        }
    }
}

impl Recent {
    fn add(&mut self, time: u64, reason: Reason, n: u64) {
        let minute = time / 60;
        let bucket = &mut self.buckets[(minute % MINUTES as u64) as usize];
        if bucket.0 != minute {
            *bucket = (minute, [0; Reason::ALL.len()]);
        }
        bucket.1[reason as usize] += n;
    }

    /// Counts of the minute of `now` and the 59 before it, by reason (absent when 0).
    fn last_hour(&self, now: u64) -> BTreeMap<String, u64> {
        let minute = now / 60;
        let first = minute.saturating_sub(MINUTES as u64 - 1);
        let mut out = BTreeMap::new();
        for (m, counts) in &self.buckets {
            if (first..=minute).contains(m) {
                for (reason, n) in Reason::ALL.iter().zip(counts) {
                    if *n > 0 {
                        *out.entry(reason.as_str().to_owned()).or_insert(0) += n;
                    }
                }
            }
        }
        out
    }
}

/// Whether a record is a refusal (its reason is one of [`Reason::ALL`]); every other
/// record (grant events, and any kind a later version adds) is kept with the events.
fn is_refusal(r: &AuditRecord) -> bool {
    Reason::parse(&r.reason).is_some()
}

/// The records kept in memory, one bounded ring per class, both in `seq` order.
#[derive(Debug, Default)]
struct Rings {
    refusals: VecDeque<AuditRecord>,
    events: VecDeque<AuditRecord>,
}

impl Rings {
    fn push(&mut self, record: AuditRecord) {
        let ring = if is_refusal(&record) {
            &mut self.refusals
        } else {
            &mut self.events
        };
        if ring.len() == KEEP {
            ring.pop_front();
        }
        ring.push_back(record);
    }

    fn len(&self) -> usize {
        self.refusals.len() + self.events.len()
    }

    /// Both rings merged in `seq` order.
    fn merged(&self) -> Vec<&AuditRecord> {
        let (mut a, mut b) = (
            self.refusals.iter().peekable(),
            self.events.iter().peekable(),
        );
        let mut out = Vec::with_capacity(self.len());
        loop {
            let next = match (a.peek(), b.peek()) {
                (Some(x), Some(y)) if x.seq <= y.seq => a.next(),
                (Some(_), Some(_)) => b.next(),
                (Some(_), None) => a.next(),
                (None, _) => b.next(),
            };
            match next {
                Some(r) => out.push(r),
                None => return out,
            }
        }
    }
}

/// Everything behind the audit's one lock.
#[derive(Debug)]
struct State {
    rings: Rings,
    next_seq: u64,
    fold: Fold,
    recent: Recent,
    /// The writer thread's queue, when there is a file. Records are queued under the lock,
    /// so they reach the file in `seq` order.
    tx: Option<Bounded>,
    /// Records the queue had no room for (kept in memory only).
    dropped: u64,
}

impl State {
    fn take_seq(&mut self) -> u64 {
        let seq = self.next_seq;
        self.next_seq += 1;
        seq
    }

    /// Keep `record` in its ring and queue it for the file; `true` when this is the
    /// first record the queue had no room for.
    fn keep(&mut self, record: AuditRecord) -> bool {
        self.rings.push(record.clone());
        if let Some(tx) = &self.tx
            && !tx.try_send(record)
        {
            self.dropped += 1;
            return self.dropped == 1;
        }
        false
    }

    /// Records (kept in the rings) for folded counts: an aggregate with `count`, or a
    /// plain record when only one refusal was folded.
    fn aggregates(&mut self, folded: Vec<Folded>, log: &mut Log) {
        for f in folded {
            let wire = AuditRecord {
                seq: self.take_seq(),
                time: f.interval,
                carrier: f.key.carrier.as_str().to_owned(),
                reason: f.key.reason.as_str().to_owned(),
                throttled: f.key.throttled,
                address_class: f.key.address_class.as_str().to_owned(),
                grant: None,
                upstream: None,
                count: (f.count > 1).then_some(f.count),
            };
            log.behind |= self.keep(wire);
            log.lines.push(Line::Folded(f));
        }
    }

    /// Close the aggregates of intervals ended before `now`.
    fn flush_due(&mut self, now: u64, log: &mut Log) {
        let due = self.fold.due(now);
        self.aggregates(due, log);
    }
}

/// A log line decided under the lock and written after it is released.
enum Line {
    Refused(Record),
    Folded(Folded),
}

/// What to log once the lock is released.
#[derive(Default)]
struct Log {
    lines: Vec<Line>,
    /// The writer queue has just overflowed.
    behind: bool,
}

impl Log {
    fn write(self) {
        for line in self.lines {
            match line {
                Line::Refused(r) => tracing::warn!(
                    target: crate::logging::AUDIT,
                    carrier = %r.carrier.as_str(),
                    reason = %r.reason.as_str(),
                    throttled = r.throttled,
                    address_class = %r.address_class.as_str(),
                    "request refused"
                ),
                Line::Folded(f) => tracing::warn!(
                    target: crate::logging::AUDIT,
                    carrier = %f.key.carrier.as_str(),
                    reason = %f.key.reason.as_str(),
                    throttled = f.key.throttled,
                    address_class = %f.key.address_class.as_str(),
                    count = f.count,
                    interval = %INTERVAL,
                    "refusals past the rate, counted"
                ),
            }
        }
        if self.behind {
            tracing::error!(
                "the audit writer is behind; records are kept in memory only until it catches up"
            );
        }
    }
}

/// [`INTERVAL_SECS`] as logs show it.
const INTERVAL: &str = "1s";

/// The audit sink shared by every carrier: log line, in-memory rings, and (when opened on
/// a state directory) an append-only JSON-lines file written by its own thread.
pub struct Audit {
    state: Arc<Mutex<State>>,
    writer: Mutex<Option<JoinHandle<()>>>,
    /// Records the writer holds because the file cannot be written now (a full disk).
    waiting: Arc<AtomicU64>,
}

impl Default for Audit {
    fn default() -> Self {
        Self::new()
    }
}

impl Audit {
    /// An in-memory store (stdio mode, tests).
    pub fn new() -> Self {
        Self::with_records(Vec::new())
    }

    /// A store holding `records` (read back from the file), rings and counters filled.
    fn with_records(mut records: Vec<AuditRecord>) -> Self {
        records.sort_by_key(|r| r.seq);
        records.dedup_by_key(|r| r.seq);
        let next_seq = records.last().map_or(1, |r| r.seq.saturating_add(1));
        let now = unix(SystemTime::now());
        let mut state = State {
            rings: Rings::default(),
            next_seq,
            fold: Fold {
                interval: now,
                ..Fold::default()
            },
            recent: Recent::default(),
            tx: None,
            dropped: 0,
        };
        for record in records {
            if let Some(reason) = Reason::parse(&record.reason)
                && record.time.saturating_add(60 * MINUTES as u64) > now
            {
                state
                    .recent
                    .add(record.time, reason, record.count.unwrap_or(1));
            }
            state.rings.push(record);
        }
        Self {
            state: Arc::new(Mutex::new(state)),
            writer: Mutex::new(None),
            waiting: Arc::default(),
        }
    }

    /// The persisted store in `state_dir`: earlier records are loaded (a torn last line
    /// from a crash is skipped), new ones appended. Failed writes are reported to
    /// `health`.
    pub fn open(state_dir: &Path, health: Arc<Health>) -> Result<Self, OpenError> {
        let path = state_dir.join(FILE_NAME);
        let fail = |source| OpenError {
            path: path.clone(),
            source,
        };
        std::fs::create_dir_all(state_dir).map_err(fail)?;
        let mut records = Vec::new();
        let mut lines = 0usize;
        match std::fs::File::open(&path) {
            Ok(file) => {
                for line in BufReader::new(file).lines() {
                    let line = line.map_err(fail)?;
                    lines += 1;
                    if let Ok(record) = serde_json::from_str::<AuditRecord>(&line) {
                        records.push(record);
                    }
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(fail(e)),
        }
        let audit = Self::with_records(records);
        let tails = {
            let state = audit.state.lock();
            Rings {
                refusals: state.rings.refusals.clone(),
                events: state.rings.events.clone(),
            }
        };
        if lines > tails.len() {
            // Compact: drop what we no longer keep and any torn line.
            write_atomically(&path, &tails.merged()).map_err(fail)?;
        }
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .mode(0o600)
            .open(&path)
            .map_err(fail)?;
        let (tx, rx) = bounded(QUEUE);
        let thread = std::thread::Builder::new()
            .name("audit-writer".into())
            .spawn({
                let writer = Writer::new(path.clone(), file, audit.state.clone(), tails, health)
                    .map_err(fail)?
                    .counting_into(audit.waiting.clone());
                move || writer.run(rx)
            })
            .map_err(fail)?;
        audit.state.lock().tx = Some(tx);
        *audit.writer.lock() = Some(thread);
        Ok(audit)
    }

    /// Book a refusal: counted for `status`, then a record and a log line of its own up to
    /// the rate, or folded into its interval's aggregate past it.
    pub fn record(&self, record: Record) {
        let time = unix(record.time);
        let key = FoldKey {
            carrier: record.carrier,
            reason: record.reason,
            throttled: record.throttled,
            address_class: record.address_class,
        };
        let mut log = Log::default();
        {
            let mut state = self.state.lock();
            state.recent.add(time, record.reason, 1);
            state.flush_due(time, &mut log);
            if state.fold.admit(key) {
                let wire = AuditRecord {
                    seq: state.take_seq(),
                    time,
                    carrier: record.carrier.as_str().to_owned(),
                    reason: record.reason.as_str().to_owned(),
                    throttled: record.throttled,
                    address_class: record.address_class.as_str().to_owned(),
                    grant: None,
                    upstream: None,
                    count: None,
                };
                log.behind |= state.keep(wire);
                log.lines.push(Line::Refused(record));
            }
        }
        log.write();
    }

    /// Record a grant request or decision. `by` is the caller itself or `local:<uid>` of the
    /// operator (whose events carry `carrier = "control"`).
    pub fn grant(
        &self,
        event: GrantEvent,
        grant_id: i64,
        caller: &str,
        by: &str,
        tool: Option<&str>,
    ) {
        tracing::info!(
            target: crate::logging::AUDIT,
            event = event.as_str(),
            grant_id,
            caller,
            by,
            tool,
            "grant {}",
            event.as_str().trim_start_matches("grant-")
        );
        let carrier = if by == caller { "session" } else { "control" };
        let grant = robota_proto::GrantRef {
            grant_id,
            caller: caller.to_owned(),
            by: by.to_owned(),
            tool: tool.map(str::to_owned),
        };
        self.event(carrier, event.as_str(), Some(grant), None);
    }

    /// Record an event of an upstream's tool surface: trusted on first use, a drift
    /// seen (held), or an approval by the operator (`by` = `local:<uid>`).
    pub fn upstream(&self, event: UpstreamEvent, name: &str, surface: &str, by: &str) {
        tracing::info!(
            target: crate::logging::AUDIT,
            event = event.as_str(),
            upstream = name,
            surface,
            by,
            "upstream surface {}",
            event.as_str().trim_start_matches("upstream-")
        );
        let carrier = if by.starts_with("local:") {
            "control"
        } else {
            "upstream"
        };
        let upstream = robota_proto::UpstreamRef {
            name: name.to_owned(),
            surface: surface.to_owned(),
            by: by.to_owned(),
        };
        self.event(carrier, event.as_str(), None, Some(upstream));
    }

    /// Keeps one event record (never folded into an aggregate).
    fn event(
        &self,
        carrier: &str,
        reason: &str,
        grant: Option<robota_proto::GrantRef>,
        upstream: Option<robota_proto::UpstreamRef>,
    ) {
        let now = unix(SystemTime::now());
        let mut log = Log::default();
        {
            let mut state = self.state.lock();
            state.flush_due(now, &mut log);
            let wire = AuditRecord {
                seq: state.take_seq(),
                time: now,
                carrier: carrier.to_owned(),
                reason: reason.to_owned(),
                throttled: false,
                address_class: AddressClass::Unknown.as_str().to_owned(),
                grant,
                upstream,
                count: None,
            };
            log.behind |= state.keep(wire);
        }
        log.write();
    }

    /// Record a refusal and count it in the metrics: the one place a refusal is booked.
    pub fn refused(&self, metrics: &crate::metrics::Metrics, record: Record) {
        metrics.refused(record.carrier, record.reason);
        if record.throttled {
            metrics.throttled(record.carrier);
        }
        self.record(record);
    }

    /// Records not in the audit file: those the writer queue had no room for and those
    /// dropped while the file could not be written (both kept in memory only), and those
    /// waiting to be written now.
    pub fn unpersisted(&self) -> u64 {
        self.state.lock().dropped + self.waiting.load(Ordering::Relaxed)
    }

    /// Matching records, oldest first (the newest `limit` of them), and the last seq.
    /// Aggregates of intervals that have ended are closed first.
    pub fn query(&self, q: &Query) -> (Vec<AuditRecord>, u64) {
        self.query_at(q, SystemTime::now())
    }

    fn query_at(&self, q: &Query, now: SystemTime) -> (Vec<AuditRecord>, u64) {
        let mut log = Log::default();
        let mut state = self.state.lock();
        state.flush_due(unix(now), &mut log);
        let matching: Vec<&AuditRecord> = state
            .rings
            .merged()
            .into_iter()
            .filter(|r| q.since.is_none_or(|t| r.time >= t))
            .filter(|r| q.reason.as_deref().is_none_or(|reason| r.reason == reason))
            .filter(|r| q.after_seq.is_none_or(|s| r.seq > s))
            .collect();
        let skip = matching.len().saturating_sub(q.limit);
        let out = matching.into_iter().skip(skip).cloned().collect();
        let last = state.next_seq - 1;
        drop(state);
        log.write();
        (out, last)
    }

    /// Refusals within the last hour of `now` (the current minute and the 59 before it),
    /// by reason, from counters that folding and retention never reduce.
    pub fn last_hour(&self, now: SystemTime) -> BTreeMap<String, u64> {
        self.state.lock().recent.last_hour(unix(now))
    }

    /// Write out every open aggregate, flush and stop the writer; later records stay in
    /// memory only.
    pub fn close(&self) {
        let mut log = Log::default();
        {
            let mut state = self.state.lock();
            let open = state.fold.drain();
            state.aggregates(open, &mut log);
            // Dropping the queue's only sender ends the writer once it has written the rest.
            state.tx = None;
        }
        log.write();
        if let Some(thread) = self.writer.lock().take() {
            let _ = thread.join();
        }
    }
}

impl Drop for Audit {
    fn drop(&mut self) {
        // The writer thread ends once the queue has no sender.
        self.state.lock().tx = None;
    }
}

/// The most records the writer holds while the file cannot be written; older ones are
/// then dropped from the file's future (they stay in the rings, and count as unpersisted).
const PENDING_MAX: usize = KEEP;

/// The writer's queue: bounded like `sync_channel`, but its memory grows with what is
/// queued (`sync_channel` writes every slot up front: about 0.8 MiB for [`QUEUE`]
/// records, resident in a daemon that never sends one).
fn bounded(capacity: usize) -> (Bounded, Drain) {
    let (tx, rx) = std::sync::mpsc::channel();
    let queued = Arc::new(AtomicUsize::new(0));
    let sender = Bounded {
        tx,
        queued: queued.clone(),
        capacity,
    };
    (sender, Drain { rx, queued })
}

#[derive(Debug)]
struct Bounded {
    tx: Sender<AuditRecord>,
    queued: Arc<AtomicUsize>,
    capacity: usize,
}

impl Bounded {
    /// Queues `record` unless `capacity` records are waiting or the writer is gone;
    /// whether it was queued. Senders are serialized by the state lock, so the check and
    /// the send cannot race with each other; the writer only ever lowers the count.
    fn try_send(&self, record: AuditRecord) -> bool {
        if self.queued.load(Ordering::Acquire) >= self.capacity {
            return false;
        }
        self.queued.fetch_add(1, Ordering::AcqRel);
        let sent = self.tx.send(record).is_ok();
        if !sent {
            self.queued.fetch_sub(1, Ordering::AcqRel);
        }
        sent
    }
}

struct Drain {
    rx: Receiver<AuditRecord>,
    queued: Arc<AtomicUsize>,
}

impl Drain {
    fn recv_timeout(&self, timeout: Duration) -> Result<AuditRecord, RecvTimeoutError> {
        let record = self.rx.recv_timeout(timeout)?;
        self.queued.fetch_sub(1, Ordering::AcqRel);
        Ok(record)
    }

    fn try_iter(&self) -> impl Iterator<Item = AuditRecord> + '_ {
        self.rx
            .try_iter()
            .inspect(|_| _ = self.queued.fetch_sub(1, Ordering::AcqRel))
    }
}

/// The writer thread's side: append lines, per batch; hold what cannot be written (a full
/// disk) and write it, in order, once the file takes it again; close ended aggregation
/// intervals every [`INTERVAL_SECS`] even when no refusal comes; compact the file to the
/// kept records once it holds more than twice as many lines (and at least `2 * KEEP`).
struct Writer {
    path: PathBuf,
    file: std::fs::File,
    /// The file's length after the last write that worked: a write that fails part-way is
    /// cut back to it, so the file never holds half a record.
    written: u64,
    state: Arc<Mutex<State>>,
    tails: Rings,
    lines: usize,
    /// Lines waiting for the file, oldest first.
    pending: VecDeque<String>,
    /// Lines dropped from `pending` at its bound.
    lost: u64,
    waiting: Arc<AtomicU64>,
    health: Arc<Health>,
}

impl Writer {
    fn new(
        path: PathBuf,
        file: std::fs::File,
        state: Arc<Mutex<State>>,
        tails: Rings,
        health: Arc<Health>,
    ) -> std::io::Result<Self> {
        Ok(Self {
            path,
            written: file.metadata()?.len(),
            file,
            state,
            lines: tails.len(),
            tails,
            pending: VecDeque::new(),
            lost: 0,
            waiting: Arc::default(),
            health,
        })
    }

    fn counting_into(mut self, waiting: Arc<AtomicU64>) -> Self {
        self.waiting = waiting;
        self
    }

    fn run(mut self, rx: Drain) {
        let tick = Duration::from_secs(INTERVAL_SECS);
        loop {
            match rx.recv_timeout(tick) {
                Ok(first) => {
                    // What is queued now is one batch: taken first, then serialized, so
                    // a fast sender cannot make a batch (and the file past compaction)
                    // grow without end.
                    let batch: Vec<AuditRecord> =
                        std::iter::once(first).chain(rx.try_iter()).collect();
                    for record in batch {
                        self.queue(record);
                    }
                }
                Err(RecvTimeoutError::Timeout) => {
                    // Ended intervals nobody asked about are closed here, so their
                    // aggregates (and summary lines) appear within about one interval; they
                    // arrive through the queue like every other record.
                    let mut log = Log::default();
                    self.state
                        .lock()
                        .flush_due(unix(SystemTime::now()), &mut log);
                    log.write();
                }
                Err(RecvTimeoutError::Disconnected) => break,
            }
            self.write_pending();
            self.compact();
        }
        self.write_pending();
        if !self.pending.is_empty() {
            tracing::error!(
                path = %self.path.display(),
                records = self.pending.len(),
                "audit records could not be written before the stop and are lost"
            );
        }
    }

    fn queue(&mut self, record: AuditRecord) {
        if let Ok(line) = serde_json::to_string(&record) {
            self.pending.push_back(line);
            if self.pending.len() > PENDING_MAX {
                self.pending.pop_front();
                self.lost += 1;
                self.state.lock().dropped += 1;
            }
        }
        self.tails.push(record);
    }

    /// Write every waiting line, or none of them.
    fn write_pending(&mut self) {
        if !self.pending.is_empty() {
            let mut text = String::new();
            for line in &self.pending {
                text.push_str(line);
                text.push('\n');
            }
            match self.file.write_all(text.as_bytes()) {
                Ok(()) => {
                    self.written += text.len() as u64;
                    self.lines += self.pending.len();
                    self.pending.clear();
                    if let Some(fault) = self.health.recovered(StatePart::Audit) {
                        tracing::warn!(
                            path = %self.path.display(),
                            failures = fault.failures,
                            lost = self.lost,
                            "the audit file is written again; the records held meanwhile are in it"
                        );
                    }
                }
                Err(e) => {
                    // Cut off what part of the batch landed; it is written whole later.
                    let _ = self.file.set_len(self.written);
                    let error = format!("cannot write {}: {e}", self.path.display());
                    if self.health.failed(StatePart::Audit, &error) {
                        tracing::error!(
                            error = %e,
                            path = %self.path.display(),
                            "cannot write the audit file; records are held in memory (up to {PENDING_MAX}) and written once it works again"
                        );
                    }
                }
            }
        }
        self.waiting
            .store(self.pending.len() as u64, Ordering::Relaxed);
    }

    fn compact(&mut self) {
        if !self.pending.is_empty()
            || self.lines < 2 * KEEP
            || self.lines <= 2 * self.tails.len()
            || write_atomically(&self.path, &self.tails.merged()).is_err()
        {
            return;
        }
        let reopened = std::fs::OpenOptions::new()
            .append(true)
            .open(&self.path)
            .and_then(|file| Ok((file.metadata()?.len(), file)));
        match reopened {
            Ok((len, file)) => {
                self.file = file;
                self.written = len;
                self.lines = self.tails.len();
            }
            Err(e) => {
                tracing::error!(error = %e, "cannot reopen the audit file after compaction")
            }
        }
    }
}

/// Replace `path` with `records`: temp file, fsync, rename, fsync the directory. A
/// failure (a full disk) leaves `path` as it was and no temp file behind.
fn write_atomically(path: &Path, records: &[&AuditRecord]) -> std::io::Result<()> {
    let tmp = path.with_extension("jsonl.tmp");
    let written = replace(path, &tmp, records);
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

fn replace(path: &Path, tmp: &Path, records: &[&AuditRecord]) -> std::io::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(true)
            .write(true)
            .mode(0o600)
            .open(tmp)?;
        let mut out = BufWriter::new(file);
        for r in records {
            serde_json::to_writer(&mut out, r)?;
            out.write_all(b"\n")?;
        }
        out.into_inner().map_err(|e| e.into_error())?.sync_all()?;
    }
    std::fs::rename(tmp, path)?;
    std::fs::File::open(dir)?.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reasons_index_their_minute_buckets_and_grant_events_are_not_reasons() {
        for (i, reason) in Reason::ALL.into_iter().enumerate() {
            assert_eq!(reason as usize, i, "{reason:?}");
        }
        for event in GrantEvent::ALL {
            assert_eq!(Reason::parse(event.as_str()), None, "{event:?}");
        }
    }

    /// A time after the store's creation, so intervals only move forward in a test.
    fn base() -> u64 {
        unix(SystemTime::now()) + 100
    }

    fn at(secs: u64) -> SystemTime {
        UNIX_EPOCH + Duration::from_secs(secs)
    }

    fn rec(time: SystemTime, reason: Reason) -> Record {
        Record {
            time,
            carrier: Carrier::Loopback,
            reason,
            throttled: false,
            address_class: AddressClass::Loopback,
        }
    }

    fn all(audit: &Audit, now: u64) -> Vec<AuditRecord> {
        let q = Query {
            limit: usize::MAX,
            ..Query::default()
        };
        audit.query_at(&q, at(now)).0
    }

    /// Refusals the records stand for, by reason.
    fn totals(records: &[AuditRecord]) -> BTreeMap<String, u64> {
        let mut out = BTreeMap::new();
        for r in records.iter().filter(|r| is_refusal(r)) {
            *out.entry(r.reason.clone()).or_insert(0) += r.events();
        }
        out
    }

    #[test]
    fn last_hour_counts_recent_refusals() {
        let audit = Audit::new();
        let now = base();
        audit.record(rec(at(now - 7200), Reason::BadBearer));
        audit.record(rec(at(now - 3540), Reason::BadBearer));
        audit.record(rec(at(now - 10), Reason::BadBearer));
        audit.record(rec(at(now), Reason::WrongHost));
        audit.grant(GrantEvent::Requested, 1, "local:1", "local:1", None);
        let counts = audit.last_hour(at(now));
        assert_eq!(
            counts,
            BTreeMap::from([("bad-bearer".into(), 2), ("wrong-host".into(), 1)])
        );
        // An hour later, only what happened since.
        assert!(audit.last_hour(at(now + 3600)).is_empty());
    }

    #[test]
    fn up_to_the_rate_each_refusal_is_a_record_past_it_they_are_counted() {
        let audit = Audit::new();
        let t = base();
        let flood = 5_000;
        for _ in 0..flood {
            audit.record(rec(at(t), Reason::BadBearer));
        }
        for _ in 0..3 {
            audit.record(rec(at(t), Reason::WrongHost));
        }
        // Inside the interval: only the records of their own.
        let during = all(&audit, t);
        assert_eq!(during.len(), PER_KEY as usize + 3, "{during:?}");
        assert!(during.iter().all(|r| r.count.is_none()));
        // Once it has ended, one aggregate carries the rest.
        let after = all(&audit, t + 1);
        assert_eq!(after.len(), PER_KEY as usize + 4, "{after:?}");
        let aggregate = after.last().unwrap();
        assert_eq!(
            (
                aggregate.reason.as_str(),
                aggregate.time,
                aggregate.count,
                aggregate.carrier.as_str()
            ),
            (
                "bad-bearer",
                t,
                Some(flood - u64::from(PER_KEY)),
                "loopback"
            )
        );
        assert_eq!(
            totals(&after),
            BTreeMap::from([("bad-bearer".into(), flood), ("wrong-host".into(), 3)])
        );
        // Asking again changes nothing; a new interval has a fresh allowance.
        assert_eq!(all(&audit, t + 5), after);
        audit.record(rec(at(t + 5), Reason::BadBearer));
        let later = all(&audit, t + 5);
        assert_eq!(later.len(), after.len() + 1);
        assert_eq!(later.last().unwrap().count, None);
        // The status counters saw every one.
        assert_eq!(
            audit.last_hour(at(t + 5)),
            BTreeMap::from([("bad-bearer".into(), flood + 1), ("wrong-host".into(), 3)])
        );
    }

    #[test]
    fn folded_refusals_are_grouped_and_a_single_one_is_a_plain_record() {
        let audit = Audit::new();
        let t = base();
        for _ in 0..PER_KEY {
            audit.record(rec(at(t), Reason::Malformed));
        }
        // Past the allowance: one more, three throttled, two from a public address.
        audit.record(rec(at(t), Reason::Malformed));
        for _ in 0..3 {
            audit.record(Record {
                throttled: true,
                ..rec(at(t), Reason::Malformed)
            });
        }
        for _ in 0..2 {
            audit.record(Record {
                address_class: AddressClass::Public,
                ..rec(at(t), Reason::Malformed)
            });
        }
        // A later refusal closes the interval without a query.
        audit.record(rec(at(t + 1), Reason::Expired));
        let records = all(&audit, t + 1);
        let folded: Vec<_> = records[PER_KEY as usize..].iter().collect();
        let shape: Vec<_> = folded
            .iter()
            .map(|r| {
                (
                    r.carrier.as_str(),
                    r.reason.as_str(),
                    r.throttled,
                    r.address_class.as_str(),
                    r.count,
                    r.time,
                )
            })
            .collect();
        assert_eq!(
            shape,
            [
                ("loopback", "malformed", false, "loopback", None, t),
                ("loopback", "malformed", false, "public", Some(2), t),
                ("loopback", "malformed", true, "loopback", Some(3), t),
                ("loopback", "expired", false, "loopback", None, t + 1),
            ],
            "{records:#?}"
        );
        // Seq numbers keep increasing through aggregates.
        assert!(records.windows(2).all(|w| w[0].seq < w[1].seq));
    }

    #[test]
    fn the_allowance_is_per_carrier_and_reason_and_capped_in_all() {
        let audit = Audit::new();
        let t = base();
        // Every reason on every carrier, past both rates at once.
        for carrier in Carrier::ALL {
            for reason in Reason::ALL {
                for _ in 0..PER_KEY + 5 {
                    audit.record(Record {
                        carrier,
                        ..rec(at(t), reason)
                    });
                }
            }
        }
        let during = all(&audit, t);
        assert_eq!(during.len(), PER_INTERVAL as usize);
        let mut per_key: BTreeMap<(String, String), u32> = BTreeMap::new();
        for r in &during {
            *per_key
                .entry((r.carrier.clone(), r.reason.clone()))
                .or_default() += 1;
        }
        assert!(per_key.values().all(|n| *n <= PER_KEY), "{per_key:?}");
        let after = all(&audit, t + 1);
        let keys = Carrier::ALL.len() * Reason::ALL.len();
        let sum: u64 = after.iter().map(AuditRecord::events).sum();
        assert_eq!(sum, u64::from(PER_KEY + 5) * keys as u64);
        assert_eq!(
            after.len(),
            PER_INTERVAL as usize + keys,
            "one more record per (carrier, reason), for what was counted"
        );
    }

    /// `PER_INTERVAL` refusals with records of their own in each of `seconds` seconds
    /// from `t`, spread over five reasons.
    fn flood(audit: &Audit, t: u64, seconds: u64) -> u64 {
        let reasons = [
            Reason::BadBearer,
            Reason::WrongHost,
            Reason::WrongOrigin,
            Reason::WrongPath,
            Reason::MissingToken,
        ];
        for s in 0..seconds {
            for i in 0..PER_INTERVAL {
                audit.record(rec(at(t + s), reasons[i as usize % reasons.len()]));
            }
        }
        seconds * u64::from(PER_INTERVAL)
    }

    #[test]
    fn refusals_never_evict_grant_events_and_status_counts_survive_eviction() {
        let audit = Audit::new();
        let t = base();
        audit.grant(GrantEvent::Requested, 7, "bearer:ci", "bearer:ci", None);
        audit.grant(GrantEvent::Approved, 7, "bearer:ci", "local:0", None);
        let n = flood(&audit, t, 3 * KEEP as u64 / u64::from(PER_INTERVAL));
        let records = all(&audit, t + 3600);
        assert_eq!(records.len(), KEEP + 2, "each ring holds its own KEEP");
        let events: Vec<&str> = records
            .iter()
            .filter(|r| r.grant.is_some())
            .map(|r| r.reason.as_str())
            .collect();
        assert_eq!(events, ["grant-requested", "grant-approved"]);
        // The oldest refusals are gone from the records, not from the counters.
        let now = t + 3 * KEEP as u64 / u64::from(PER_INTERVAL);
        assert_eq!(audit.last_hour(at(now)).values().sum::<u64>(), n);
        // And events have their own bound.
        for i in 0..KEEP + 5 {
            audit.grant(GrantEvent::Denied, i as i64, "local:1", "local:0", None);
        }
        let records = all(&audit, now);
        assert_eq!(records.iter().filter(|r| is_refusal(r)).count(), KEEP);
        assert_eq!(records.iter().filter(|r| !is_refusal(r)).count(), KEEP);
    }

    #[test]
    fn queries_filter_and_limit() {
        let audit = Audit::new();
        let now = base() + 100;
        for i in 0..5 {
            audit.record(rec(at(now - 100 + i), Reason::BadBearer));
        }
        audit.record(rec(at(now), Reason::WrongHost));
        audit.grant(GrantEvent::Requested, 1, "local:1", "local:1", None);
        let q = |q: Query| audit.query_at(&Query { limit: 1000, ..q }, at(now));
        let (records, last) = q(Query::default());
        assert_eq!((records.len(), last), (7, 7));
        assert_eq!(
            records.iter().map(|r| r.seq).collect::<Vec<_>>(),
            [1, 2, 3, 4, 5, 6, 7]
        );
        let (records, _) = q(Query {
            reason: Some("wrong-host".into()),
            ..Query::default()
        });
        assert_eq!(records.len(), 1);
        let (records, _) = q(Query {
            after_seq: Some(4),
            ..Query::default()
        });
        assert_eq!(records.iter().map(|r| r.seq).collect::<Vec<_>>(), [5, 6, 7]);
        let (records, _) = q(Query {
            since: Some(now - 97),
            ..Query::default()
        });
        assert_eq!(records.first().map(|r| r.seq), Some(4));
        let (records, _) = audit.query_at(
            &Query {
                limit: 2,
                ..Query::default()
            },
            at(now),
        );
        assert_eq!(
            records.iter().map(|r| r.seq).collect::<Vec<_>>(),
            [6, 7],
            "the newest ones"
        );
    }

    fn file_records(dir: &Path) -> Vec<AuditRecord> {
        let text = std::fs::read_to_string(dir.join(FILE_NAME)).unwrap();
        text.lines()
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
            .collect()
    }

    #[test]
    fn the_store_survives_reopening_and_torn_lines() {
        let dir = tempfile::tempdir().unwrap();
        let audit = Audit::open(dir.path(), Default::default()).unwrap();
        audit.record(rec(SystemTime::now(), Reason::Expired));
        audit.record(rec(SystemTime::now(), Reason::WrongOrigin));
        audit.close();
        let path = dir.path().join(FILE_NAME);
        let mode = std::os::unix::fs::PermissionsExt::mode(
            &std::fs::metadata(&path).unwrap().permissions(),
        );
        assert_eq!(mode & 0o777, 0o600);
        // A crash mid-append leaves a torn last line.
        std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .unwrap()
            .write_all(b"{\"seq\":3,\"ti")
            .unwrap();

        let reopened = Audit::open(dir.path(), Default::default()).unwrap();
        let (records, last) = reopened.query(&Query {
            limit: 100,
            ..Query::default()
        });
        assert_eq!(
            records
                .iter()
                .map(|r| r.reason.as_str())
                .collect::<Vec<_>>(),
            ["expired", "wrong-origin"]
        );
        assert_eq!(last, 2);
        // The counters behind `status` are read back too.
        let counts = reopened.last_hour(SystemTime::now());
        assert_eq!(counts.values().sum::<u64>(), 2, "{counts:?}");
        reopened.record(rec(SystemTime::now(), Reason::BadBearer));
        reopened.close();
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(text.lines().count(), 3, "{text}");
        assert!(text.lines().last().unwrap().contains("\"seq\":3"));
        assert!(
            text.lines()
                .all(|l| serde_json::from_str::<AuditRecord>(l).is_ok())
        );
    }

    #[test]
    fn records_that_cannot_be_written_wait_and_land_whole_once_the_file_takes_them() {
        let health = Arc::new(Health::default());
        let full = std::fs::OpenOptions::new()
            .append(true)
            .open("/dev/full")
            .unwrap();
        let state = Audit::new().state.clone();
        let mut writer = Writer::new(
            "/dev/full".into(),
            full,
            state,
            Rings::default(),
            health.clone(),
        )
        .unwrap();
        for seq in 1..=3 {
            writer.queue(wire(seq));
            writer.write_pending();
        }
        assert_eq!(writer.waiting.load(Ordering::Relaxed), 3, "all three wait");
        let fault = &health.faults()[&StatePart::Audit];
        assert_eq!(fault.failures, 3);
        assert!(fault.error.contains("No space left"), "{}", fault.error);
        // The disk has room again: the waiting records land, in order, whole.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(FILE_NAME);
        writer.file = std::fs::File::create(&path).unwrap();
        writer.written = 0;
        writer.queue(wire(4));
        writer.write_pending();
        assert_eq!(writer.waiting.load(Ordering::Relaxed), 0);
        assert!(health.faults().is_empty(), "healthy again");
        assert_eq!(health.failures_total(StatePart::Audit), 3);
        let text = std::fs::read_to_string(&path).unwrap();
        let seqs: Vec<u64> = text
            .lines()
            .map(|l| serde_json::from_str::<AuditRecord>(l).unwrap().seq)
            .collect();
        assert_eq!(seqs, [1, 2, 3, 4]);
    }

    /// Queue `record`, waiting while the queue is full (as the real sender never does:
    /// a test that must not drop a record feeds the writer no faster than it writes).
    fn send_waiting(tx: &Bounded, record: AuditRecord) {
        while !tx.try_send(record.clone()) {
            std::thread::sleep(Duration::from_micros(50));
        }
    }

    /// A `bad-bearer` refusal record with `seq`, as the writer gets it.
    fn wire(seq: u64) -> AuditRecord {
        AuditRecord {
            seq,
            time: 1,
            carrier: "loopback".into(),
            reason: "bad-bearer".into(),
            throttled: false,
            address_class: "loopback".into(),
            grant: None,
            upstream: None,
            count: None,
        }
    }

    #[test]
    fn the_writer_queue_holds_its_capacity_and_no_more() {
        let (tx, rx) = bounded(2);
        assert!(tx.try_send(wire(1)));
        assert!(tx.try_send(wire(2)));
        assert!(!tx.try_send(wire(3)), "full");
        assert_eq!(rx.recv_timeout(Duration::ZERO).unwrap().seq, 1);
        assert!(tx.try_send(wire(4)));
        let rest: Vec<u64> = rx.try_iter().map(|r| r.seq).collect();
        assert_eq!(rest, [2, 4]);
        assert!(tx.try_send(wire(5)));
        drop(rx);
        assert!(!tx.try_send(wire(7)), "the writer is gone");
    }

    #[test]
    fn the_file_is_compacted_per_class() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(FILE_NAME);
        let file = std::fs::File::create(&path).unwrap();
        let state = Audit::new().state.clone();
        // The writer as the store runs it, fed without ever dropping a record.
        let (tx, rx) = bounded(16);
        let thread = std::thread::spawn({
            let writer = Writer::new(
                path.clone(),
                file,
                state,
                Rings::default(),
                Default::default(),
            )
            .unwrap();
            move || writer.run(rx)
        });
        let wire = |seq: u64, reason: &str| AuditRecord {
            seq,
            time: 1,
            carrier: "loopback".into(),
            reason: reason.into(),
            throttled: false,
            address_class: "loopback".into(),
            grant: None,
            upstream: None,
            count: None,
        };
        send_waiting(&tx, wire(1, "grant-requested"));
        let last = 6 * KEEP as u64 + 1;
        let mut longest = 0;
        for seq in 2..=last {
            send_waiting(&tx, wire(seq, "bad-bearer"));
            if seq % 997 == 0 {
                longest = longest.max(std::fs::read(&path).unwrap().len());
            }
        }
        send_waiting(&tx, wire(last + 1, "grant-approved"));
        drop(tx);
        thread.join().unwrap();
        let records = file_records(dir.path());
        assert!(records.len() <= 2 * KEEP + 4, "{} lines", records.len());
        let line = serde_json::to_string(&wire(last, "bad-bearer"))
            .unwrap()
            .len()
            + 1;
        assert!(
            longest <= (2 * KEEP + 4) * line,
            "the file grew to {longest} bytes"
        );
        let refusals: Vec<u64> = records
            .iter()
            .filter(|r| is_refusal(r))
            .map(|r| r.seq)
            .collect();
        assert!(refusals.len() >= KEEP, "{}", refusals.len());
        assert_eq!(refusals.last(), Some(&last));
        let events: Vec<&str> = records
            .iter()
            .filter(|r| !is_refusal(r))
            .map(|r| r.reason.as_str())
            .collect();
        assert_eq!(events, ["grant-requested", "grant-approved"]);
    }

    #[test]
    fn a_flood_is_persisted_in_a_few_records_that_add_up() {
        let t = base();
        let dir = tempfile::tempdir().unwrap();
        let audit = Audit::open(dir.path(), Default::default()).unwrap();
        audit.grant(GrantEvent::Requested, 7, "bearer:ci", "bearer:ci", None);
        for s in 0..3 {
            for _ in 0..7_000 {
                audit.record(rec(at(t + s), Reason::WrongHost));
            }
        }
        // The last interval is still open at close; closing writes its aggregate.
        audit.close();
        assert_eq!(audit.unpersisted(), 0);
        let records = file_records(dir.path());
        assert_eq!(records.len(), 1 + 3 * (PER_KEY as usize + 1), "{records:?}");
        assert_eq!(
            totals(&records),
            BTreeMap::from([("wrong-host".into(), 21_000)])
        );
        assert_eq!(records[0].reason, "grant-requested");
    }

    #[test]
    fn a_file_out_of_order_is_read_back_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let line = |seq: u64, reason: &str| {
            format!(
                r#"{{"seq":{seq},"time":1,"carrier":"loopback","reason":"{reason}","throttled":false,"address_class":"loopback"}}"#
            )
        };
        let text = [
            line(5, "bad-bearer"),
            line(2, "wrong-host"),
            line(9, "grant-denied"),
            line(5, "bad-bearer"),
        ]
        .join("\n");
        std::fs::write(dir.path().join(FILE_NAME), text + "\n").unwrap();
        let audit = Audit::open(dir.path(), Default::default()).unwrap();
        let (records, last) = audit.query(&Query {
            limit: 100,
            ..Query::default()
        });
        assert_eq!(records.iter().map(|r| r.seq).collect::<Vec<_>>(), [2, 5, 9]);
        assert_eq!(last, 9);
        audit.record(rec(SystemTime::now(), Reason::Expired));
        assert_eq!(
            audit
                .query(&Query {
                    limit: 100,
                    ..Query::default()
                })
                .1,
            10
        );
        audit.close();
    }
}
