//! Refusal audit: the closed sets (carriers, refusal reasons, address classes) and the
//! record emitted for every refusal.
//!
//! A record carries a time, a carrier, a reason, the `throttled` flag and an address
//! class — never token text, never the address itself. Records go to the log (journald
//! fields when logging to the journal), to a bounded in-memory ring that `status` and
//! `robota-mcpctl audit` read, and to `<state dir>/audit.jsonl`, appended by a writer
//! thread off the request path, compacted to the newest [`KEEP`] records, read back at
//! start so the history survives restarts.

use std::collections::{BTreeMap, VecDeque};
use std::io::{BufRead, BufReader, BufWriter, Write};
use std::net::IpAddr;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, SyncSender};
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use parking_lot::Mutex;
use robota_proto::AuditRecord;

/// The span `status` summarises.
const WINDOW: Duration = Duration::from_secs(3600);

/// A place requests arrive.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Carrier {
    Stdio,
    Loopback,
    Remote,
    Control,
}

impl Carrier {
    pub const ALL: [Carrier; 4] = [
        Carrier::Stdio,
        Carrier::Loopback,
        Carrier::Remote,
        Carrier::Control,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Carrier::Stdio => "stdio",
            Carrier::Loopback => "loopback",
            Carrier::Remote => "remote",
            Carrier::Control => "control",
        }
    }
}

/// Why a request was refused (SPEC §5's closed set, plus the control plane's and the
/// loopback endpoint-path case).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Reason {
    MissingToken,
    Oversize,
    Malformed,
    WrongType,
    UnsupportedAlgorithm,
    AmbiguousKey,
    UnknownKey,
    KeyMismatch,
    BadSignature,
    WrongIssuer,
    WrongAudience,
    Expired,
    NotYetValid,
    MissingScope,
    PrincipalNotAllowed,
    KeysUnavailable,
    WrongHost,
    WrongOrigin,
    BadBearer,
    /// Loopback: a request for a path other than the endpoint (403).
    WrongPath,
    /// Control socket: the peer's uid/gid is not allowed.
    PeerNotAllowed,
}

impl Reason {
    pub const ALL: [Reason; 21] = [
        Reason::MissingToken,
        Reason::Oversize,
        Reason::Malformed,
        Reason::WrongType,
        Reason::UnsupportedAlgorithm,
        Reason::AmbiguousKey,
        Reason::UnknownKey,
        Reason::KeyMismatch,
        Reason::BadSignature,
        Reason::WrongIssuer,
        Reason::WrongAudience,
        Reason::Expired,
        Reason::NotYetValid,
        Reason::MissingScope,
        Reason::PrincipalNotAllowed,
        Reason::KeysUnavailable,
        Reason::WrongHost,
        Reason::WrongOrigin,
        Reason::BadBearer,
        Reason::WrongPath,
        Reason::PeerNotAllowed,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Reason::MissingToken => "missing-token",
            Reason::Oversize => "oversize",
            Reason::Malformed => "malformed",
            Reason::WrongType => "wrong-type",
            Reason::UnsupportedAlgorithm => "unsupported-algorithm",
            Reason::AmbiguousKey => "ambiguous-key",
            Reason::UnknownKey => "unknown-key",
            Reason::KeyMismatch => "key-mismatch",
            Reason::BadSignature => "bad-signature",
            Reason::WrongIssuer => "wrong-issuer",
            Reason::WrongAudience => "wrong-audience",
            Reason::Expired => "expired",
            Reason::NotYetValid => "not-yet-valid",
            Reason::MissingScope => "missing-scope",
            Reason::PrincipalNotAllowed => "principal-not-allowed",
            Reason::KeysUnavailable => "keys-unavailable",
            Reason::WrongHost => "wrong-host",
            Reason::WrongOrigin => "wrong-origin",
            Reason::BadBearer => "bad-bearer",
            Reason::WrongPath => "wrong-path",
            Reason::PeerNotAllowed => "peer-not-allowed",
        }
    }
}

/// Coarse class of a client address; the address itself is never recorded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AddressClass {
    Loopback,
    /// RFC 1918, link-local, CGNAT (100.64/10), ULA (fc00::/7).
    Private,
    Public,
    /// Unix sockets, stdio, or no address at all.
    Unknown,
}

impl AddressClass {
    pub const ALL: [AddressClass; 4] = [
        AddressClass::Loopback,
        AddressClass::Private,
        AddressClass::Public,
        AddressClass::Unknown,
    ];

    pub fn of(ip: IpAddr) -> Self {
        let ip = match ip {
            IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4),
            v4 => v4,
        };
        match ip {
            IpAddr::V4(v4) if v4.is_loopback() => AddressClass::Loopback,
            IpAddr::V4(v4) => {
                let [a, b, ..] = v4.octets();
                if v4.is_private() || v4.is_link_local() || (a == 100 && (64..128).contains(&b)) {
                    AddressClass::Private
                } else if v4.is_unspecified() {
                    AddressClass::Unknown
                } else {
                    AddressClass::Public
                }
            }
            IpAddr::V6(v6) if v6.is_loopback() => AddressClass::Loopback,
            IpAddr::V6(v6) => {
                let first = v6.segments()[0];
                if (first & 0xfe00) == 0xfc00 || (first & 0xffc0) == 0xfe80 {
                    AddressClass::Private
                } else if v6.is_unspecified() {
                    AddressClass::Unknown
                } else {
                    AddressClass::Public
                }
            }
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            AddressClass::Loopback => "loopback",
            AddressClass::Private => "private",
            AddressClass::Public => "public",
            AddressClass::Unknown => "unknown",
        }
    }
}

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
    fn wire(&self, seq: u64) -> AuditRecord {
        AuditRecord {
            seq,
            time: self
                .time
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            carrier: self.carrier.as_str().to_owned(),
            reason: self.reason.as_str().to_owned(),
            throttled: self.throttled,
            address_class: self.address_class.as_str().to_owned(),
            grant: None,
        }
    }
}

/// A grant request or decision (`robota_mcpd::grants`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GrantEvent {
    Requested,
    Approved,
    Denied,
    Revoked,
}

impl GrantEvent {
    pub const ALL: [GrantEvent; 4] = [
        GrantEvent::Requested,
        GrantEvent::Approved,
        GrantEvent::Denied,
        GrantEvent::Revoked,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            GrantEvent::Requested => "grant-requested",
            GrantEvent::Approved => "grant-approved",
            GrantEvent::Denied => "grant-denied",
            GrantEvent::Revoked => "grant-revoked",
        }
    }
}

/// Records kept in memory (and the most the file is compacted down to).
pub const KEEP: usize = 10_000;
/// Records queued for the writer before new ones are kept in memory only.
const QUEUE: usize = 4096;
/// The audit file under the state directory.
pub const FILE_NAME: &str = "audit.jsonl";

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

struct Ring {
    records: VecDeque<AuditRecord>,
    next_seq: u64,
}

/// The audit sink shared by every carrier: log line, in-memory ring, and (when opened on
/// a state directory) an append-only JSON-lines file written by its own thread.
pub struct Audit {
    ring: Mutex<Ring>,
    writer: Mutex<Option<(SyncSender<AuditRecord>, JoinHandle<()>)>>,
    dropped: AtomicU64,
}

impl Default for Audit {
    fn default() -> Self {
        Self::new()
    }
}

impl Audit {
    /// An in-memory store (stdio mode, tests).
    pub fn new() -> Self {
        Self {
            ring: Mutex::new(Ring {
                records: VecDeque::new(),
                next_seq: 1,
            }),
            writer: Mutex::new(None),
            dropped: AtomicU64::new(0),
        }
    }

    /// The persisted store in `state_dir`: earlier records are loaded (a torn last line
    /// from a crash is skipped), new ones appended.
    pub fn open(state_dir: &Path) -> Result<Self, OpenError> {
        let path = state_dir.join(FILE_NAME);
        let fail = |source| OpenError {
            path: path.clone(),
            source,
        };
        std::fs::create_dir_all(state_dir).map_err(fail)?;
        let mut records = VecDeque::new();
        let mut lines = 0usize;
        match std::fs::File::open(&path) {
            Ok(file) => {
                for line in BufReader::new(file).lines() {
                    let line = line.map_err(fail)?;
                    lines += 1;
                    if let Ok(record) = serde_json::from_str::<AuditRecord>(&line) {
                        if records.len() == KEEP {
                            records.pop_front();
                        }
                        records.push_back(record);
                    }
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(fail(e)),
        }
        let next_seq = records.back().map_or(1, |r: &AuditRecord| r.seq + 1);
        if lines > records.len() {
            // Compact: drop what we no longer keep and any torn line.
            write_atomically(&path, &records).map_err(fail)?;
        }
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .mode(0o600)
            .open(&path)
            .map_err(fail)?;
        let kept = records.len();
        let (tx, rx) = std::sync::mpsc::sync_channel(QUEUE);
        let thread = std::thread::Builder::new()
            .name("audit-writer".into())
            .spawn({
                let path = path.clone();
                move || writer(path, file, rx, kept)
            })
            .map_err(fail)?;
        let audit = Self::new();
        *audit.ring.lock() = Ring { records, next_seq };
        *audit.writer.lock() = Some((tx, thread));
        Ok(audit)
    }

    pub fn record(&self, record: Record) {
        tracing::warn!(
            target: "robota_mcpd::audit",
            carrier = record.carrier.as_str(),
            reason = record.reason.as_str(),
            throttled = record.throttled,
            address_class = record.address_class.as_str(),
            "request refused"
        );
        self.append(|seq| record.wire(seq));
    }

    /// Record a grant request or decision. `by` is the caller itself or `local:<uid>` of the
    /// operator (whose events carry `carrier = "control"`).
    pub fn grant(&self, event: GrantEvent, grant_id: i64, caller: &str, by: &str) {
        tracing::info!(
            target: "robota_mcpd::audit",
            event = event.as_str(),
            grant_id,
            caller,
            by,
            "grant {}",
            event.as_str().trim_start_matches("grant-")
        );
        let carrier = if by == caller { "session" } else { "control" };
        let time = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        self.append(|seq| AuditRecord {
            seq,
            time,
            carrier: carrier.to_owned(),
            reason: event.as_str().to_owned(),
            throttled: false,
            address_class: AddressClass::Unknown.as_str().to_owned(),
            grant: Some(robota_proto::GrantRef {
                grant_id,
                caller: caller.to_owned(),
                by: by.to_owned(),
            }),
        });
    }

    fn append(&self, make: impl FnOnce(u64) -> AuditRecord) {
        let wire = {
            let mut ring = self.ring.lock();
            let wire = make(ring.next_seq);
            ring.next_seq += 1;
            if ring.records.len() == KEEP {
                ring.records.pop_front();
            }
            ring.records.push_back(wire.clone());
            wire
        };
        if let Some((tx, _)) = self.writer.lock().as_ref()
            && tx.try_send(wire).is_err()
            && self.dropped.fetch_add(1, Ordering::Relaxed) == 0
        {
            tracing::error!(
                "the audit writer is behind; records are kept in memory only until it catches up"
            );
        }
    }

    /// Record a refusal and count it in the metrics: the one place a refusal is booked.
    pub fn refused(&self, metrics: &crate::metrics::Metrics, record: Record) {
        metrics.refused(record.carrier, record.reason);
        if record.throttled {
            metrics.throttled(record.carrier);
        }
        self.record(record);
    }

    /// Records written to memory only because the writer queue was full.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }

    /// Matching records, oldest first (the newest `limit` of them), and the last seq.
    pub fn query(&self, q: &Query) -> (Vec<AuditRecord>, u64) {
        let ring = self.ring.lock();
        let matching: Vec<&AuditRecord> = ring
            .records
            .iter()
            .filter(|r| q.since.is_none_or(|t| r.time >= t))
            .filter(|r| q.reason.as_deref().is_none_or(|reason| r.reason == reason))
            .filter(|r| q.after_seq.is_none_or(|s| r.seq > s))
            .collect();
        let skip = matching.len().saturating_sub(q.limit);
        let out = matching.into_iter().skip(skip).cloned().collect();
        (out, ring.next_seq - 1)
    }

    /// Refusals within the last hour of `now`, by reason.
    pub fn last_hour(&self, now: SystemTime) -> BTreeMap<String, u64> {
        let cutoff = now
            .checked_sub(WINDOW)
            .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
            .map_or(0, |d| d.as_secs());
        let ring = self.ring.lock();
        let mut out = BTreeMap::new();
        for r in ring
            .records
            .iter()
            .rev()
            .take_while(|r| r.time >= cutoff)
            .filter(|r| r.grant.is_none())
        {
            *out.entry(r.reason.clone()).or_insert(0) += 1;
        }
        out
    }

    /// Flush and stop the writer; later records stay in memory only.
    pub fn close(&self) {
        let writer = self.writer.lock().take();
        if let Some((tx, thread)) = writer {
            drop(tx);
            let _ = thread.join();
        }
    }
}

/// The writer thread: append lines, flush per batch, compact past twice [`KEEP`].
fn writer(path: PathBuf, file: std::fs::File, rx: Receiver<AuditRecord>, mut lines: usize) {
    let mut out = BufWriter::new(file);
    let mut tail: VecDeque<AuditRecord> = VecDeque::new();
    while let Ok(first) = rx.recv() {
        let mut batch = vec![first];
        batch.extend(rx.try_iter());
        for record in batch {
            if let Ok(line) = serde_json::to_string(&record) {
                let _ = writeln!(out, "{line}");
                lines += 1;
            }
            if tail.len() == KEEP {
                tail.pop_front();
            }
            tail.push_back(record);
        }
        if let Err(e) = out.flush() {
            tracing::error!(error = %e, path = %path.display(), "cannot write the audit store");
        }
        if lines > 2 * KEEP && tail.len() == KEEP && write_atomically(&path, &tail).is_ok() {
            match std::fs::OpenOptions::new().append(true).open(&path) {
                Ok(file) => {
                    out = BufWriter::new(file);
                    lines = KEEP;
                }
                Err(e) => {
                    tracing::error!(error = %e, "cannot reopen the audit store after compaction")
                }
            }
        }
    }
    let _ = out.flush();
}

/// Replace `path` with `records`: temp file, fsync, rename, fsync the directory.
fn write_atomically(path: &Path, records: &VecDeque<AuditRecord>) -> std::io::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let tmp = path.with_extension("jsonl.tmp");
    {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(true)
            .write(true)
            .mode(0o600)
            .open(&tmp)?;
        let mut out = BufWriter::new(file);
        for r in records {
            serde_json::to_writer(&mut out, r)?;
            out.write_all(b"\n")?;
        }
        out.into_inner().map_err(|e| e.into_error())?.sync_all()?;
    }
    std::fs::rename(&tmp, path)?;
    std::fs::File::open(dir)?.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn address_classes() {
        let class = |s: &str| AddressClass::of(s.parse().unwrap());
        assert_eq!(class("127.0.0.1"), AddressClass::Loopback);
        assert_eq!(class("::1"), AddressClass::Loopback);
        assert_eq!(class("::ffff:127.0.0.1"), AddressClass::Loopback);
        for private in [
            "10.1.2.3",
            "172.16.0.1",
            "192.168.1.1",
            "169.254.0.1",
            "100.64.0.1",
            "100.127.255.255",
            "fd00::1",
            "fe80::1",
        ] {
            assert_eq!(class(private), AddressClass::Private, "{private}");
        }
        for public in ["100.128.0.1", "8.8.8.8", "2001:db8::1", "172.32.0.1"] {
            assert_eq!(class(public), AddressClass::Public, "{public}");
        }
    }

    #[test]
    fn closed_sets_have_unique_strings() {
        let reasons: std::collections::HashSet<_> =
            Reason::ALL.iter().map(|r| r.as_str()).collect();
        assert_eq!(reasons.len(), Reason::ALL.len());
        let carriers: std::collections::HashSet<_> =
            Carrier::ALL.iter().map(|c| c.as_str()).collect();
        assert_eq!(carriers.len(), Carrier::ALL.len());
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

    #[test]
    fn last_hour_counts_recent_records() {
        let audit = Audit::new();
        let now = SystemTime::now();
        audit.record(rec(now - Duration::from_secs(7200), Reason::BadBearer));
        audit.record(rec(now - Duration::from_secs(10), Reason::BadBearer));
        audit.record(rec(now, Reason::WrongHost));
        let counts = audit.last_hour(now);
        assert_eq!(counts.get("bad-bearer"), Some(&1));
        assert_eq!(counts.get("wrong-host"), Some(&1));
    }

    #[test]
    fn queries_filter_and_limit() {
        let audit = Audit::new();
        let now = SystemTime::now();
        for i in 0..5 {
            audit.record(rec(now - Duration::from_secs(100 - i), Reason::BadBearer));
        }
        audit.record(rec(now, Reason::WrongHost));
        let all = |q: Query| audit.query(&Query { limit: 1000, ..q });
        let (records, last) = all(Query::default());
        assert_eq!((records.len(), last), (6, 6));
        assert_eq!(
            records.iter().map(|r| r.seq).collect::<Vec<_>>(),
            [1, 2, 3, 4, 5, 6]
        );
        let (records, _) = all(Query {
            reason: Some("wrong-host".into()),
            ..Query::default()
        });
        assert_eq!(records.len(), 1);
        let (records, _) = all(Query {
            after_seq: Some(4),
            ..Query::default()
        });
        assert_eq!(records.iter().map(|r| r.seq).collect::<Vec<_>>(), [5, 6]);
        let since = now.duration_since(UNIX_EPOCH).unwrap().as_secs() - 97;
        let (records, _) = all(Query {
            since: Some(since),
            ..Query::default()
        });
        assert_eq!(records.first().map(|r| r.seq), Some(4));
        let (records, _) = audit.query(&Query {
            limit: 2,
            ..Query::default()
        });
        assert_eq!(
            records.iter().map(|r| r.seq).collect::<Vec<_>>(),
            [5, 6],
            "the newest ones"
        );
    }

    #[test]
    fn the_store_survives_reopening_and_torn_lines() {
        let dir = tempfile::tempdir().unwrap();
        let audit = Audit::open(dir.path()).unwrap();
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

        let reopened = Audit::open(dir.path()).unwrap();
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
}
