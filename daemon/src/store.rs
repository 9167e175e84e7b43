//! The durable store: one SQLite database in the state directory (`robota.db`).
//!
//! It holds jobs and their output, idempotency records and grants. WAL mode, schema
//! migrations recorded in `schema_migrations`, and `PRAGMA integrity_check` at every open:
//! a store that fails it (or is not a database at all) is a start-up error naming the file,
//! never silently recreated. All access goes through one connection behind a mutex; every
//! statement is short, so callers on the async runtime hold it for microseconds.

use std::fs::OpenOptions;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use parking_lot::Mutex;
use rusqlite::{Connection, OptionalExtension, params};

use crate::health::Health;
use crate::vocab::StatePart;

/// The database file inside the state directory.
pub const FILE_NAME: &str = "robota.db";

/// Schema migrations, applied in order; index + 1 is the version. Never edit one that has
/// shipped: add a new one.
const MIGRATIONS: &[&str] = &[
    // 1: jobs, job output, idempotency records, grants.
    "CREATE TABLE jobs (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        owner TEXT NOT NULL,
        kind TEXT NOT NULL,
        target TEXT NOT NULL,
        action TEXT,
        state TEXT NOT NULL,
        created_at INTEGER NOT NULL,
        finished_at INTEGER,
        exit_code INTEGER,
        detail TEXT,
        output_bytes INTEGER NOT NULL DEFAULT 0,
        output_dropped INTEGER NOT NULL DEFAULT 0,
        pid INTEGER,
        pid_start_time INTEGER,
        runner TEXT NOT NULL
    );
    CREATE INDEX jobs_by_owner ON jobs (owner, id);
    CREATE INDEX jobs_by_state ON jobs (state);
    CREATE TABLE job_output (
        job_id INTEGER NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
        offset INTEGER NOT NULL,
        stream TEXT NOT NULL,
        data BLOB NOT NULL,
        PRIMARY KEY (job_id, offset)
    ) WITHOUT ROWID;
    CREATE TABLE idempotency (
        caller TEXT NOT NULL,
        tool TEXT NOT NULL,
        key TEXT NOT NULL,
        args_sha256 TEXT NOT NULL,
        state TEXT NOT NULL,
        result TEXT,
        runner TEXT NOT NULL,
        created_at INTEGER NOT NULL,
        PRIMARY KEY (caller, tool, key)
    ) WITHOUT ROWID;
    CREATE TABLE grants (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        caller TEXT NOT NULL,
        kind TEXT NOT NULL,
        reason TEXT NOT NULL,
        scope TEXT NOT NULL,
        duration_secs INTEGER NOT NULL,
        state TEXT NOT NULL,
        requested_at INTEGER NOT NULL,
        decided_at INTEGER,
        decided_by TEXT,
        expires_at INTEGER
    );
    CREATE INDEX grants_by_caller ON grants (caller, state);",
    // 2: labelled loopback bearers issued with a lifetime, as digests.
    "CREATE TABLE bearers (
        label TEXT PRIMARY KEY,
        digest BLOB NOT NULL,
        created_at INTEGER NOT NULL,
        expires_at INTEGER NOT NULL
    ) WITHOUT ROWID;",
    // 3: approvals of one exact call (`approve-each`) are grants of kind `call`: the tool,
    // the canonical arguments and their SHA-256, and when the call used the approval.
    "ALTER TABLE grants ADD COLUMN tool TEXT;
    ALTER TABLE grants ADD COLUMN arguments TEXT;
    ALTER TABLE grants ADD COLUMN args_sha256 TEXT;
    ALTER TABLE grants ADD COLUMN used_at INTEGER;
    CREATE INDEX grants_by_call ON grants (caller, tool, args_sha256, state);",
];

/// Finished jobs, idempotency records and ended grants older than this are pruned.
pub const RETENTION: Duration = Duration::from_secs(7 * 24 * 3600);
/// How often a running daemon prunes.
pub const PRUNE_EVERY: Duration = Duration::from_secs(3600);

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("cannot open the store {path}: {source}")]
    Open {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("the store {path} is not a usable SQLite database: {source}")]
    NotADatabase {
        path: PathBuf,
        source: rusqlite::Error,
    },
    #[error(
        "the store {path} failed its integrity check ({detail}); it was left as it is: move it aside to start with an empty store, or restore a backup"
    )]
    Corrupt { path: PathBuf, detail: String },
    #[error(
        "the store {path} has schema version {found}, newer than this robota-mcpd knows ({known})"
    )]
    TooNew {
        path: PathBuf,
        found: usize,
        known: usize,
    },
    #[error("store: {0}")]
    Sql(#[from] rusqlite::Error),
}

/// Whether `e` says the file cannot take a write (rather than a statement being wrong).
fn cannot_write(e: &rusqlite::Error) -> bool {
    use rusqlite::ErrorCode as Code;
    matches!(
        e.sqlite_error_code(),
        Some(Code::DiskFull | Code::SystemIoFailure | Code::ReadOnly | Code::CannotOpen)
    )
}

/// Whether `e` is the store failing to take a write: what a tool answers `unavailable`
/// for rather than `internal`.
pub fn is_write_failure(e: &StoreError) -> bool {
    matches!(e, StoreError::Sql(e) if cannot_write(e))
}

/// Unix seconds now.
pub fn now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
}

pub struct Store {
    conn: Mutex<Connection>,
    path: PathBuf,
    /// Where failed writes are reported.
    health: Arc<Health>,
}

impl Store {
    /// Open (creating if absent, mode 0600) and check `<state_dir>/robota.db`.
    pub fn open(state_dir: &Path) -> Result<Self, StoreError> {
        let path = state_dir.join(FILE_NAME);
        OpenOptions::new()
            .create(true)
            .append(true)
            .mode(0o600)
            .open(&path)
            .map_err(|source| StoreError::Open {
                path: path.clone(),
                source,
            })?;
        let not_db = |source| StoreError::NotADatabase {
            path: path.clone(),
            source,
        };
        let conn = Connection::open(&path).map_err(not_db)?;
        conn.busy_timeout(Duration::from_secs(5)).map_err(not_db)?;
        // The first statement that reads the header tells a non-database file apart.
        let detail: Vec<String> = {
            let mut stmt = conn.prepare("PRAGMA integrity_check").map_err(not_db)?;
            stmt.query_map([], |r| r.get::<_, String>(0))
                .and_then(|rows| rows.collect::<Result<_, _>>())
                .map_err(not_db)?
        };
        if detail != ["ok"] {
            return Err(StoreError::Corrupt {
                path,
                detail: detail.join("; "),
            });
        }
        // Only a store that passed the check is written to (switching to WAL rewrites the
        // header).
        let mode: String = conn
            .query_row("PRAGMA journal_mode = WAL", [], |r| r.get(0))
            .map_err(not_db)?;
        if !mode.eq_ignore_ascii_case("wal") {
            return Err(StoreError::Corrupt {
                path,
                detail: format!("journal mode is {mode}, WAL could not be set"),
            });
        }
        conn.execute_batch(
            "PRAGMA synchronous = NORMAL; PRAGMA foreign_keys = ON; \
             CREATE TABLE IF NOT EXISTS schema_migrations \
             (version INTEGER PRIMARY KEY, applied_at INTEGER NOT NULL);",
        )?;
        let store = Self {
            conn: Mutex::new(conn),
            path,
            health: Arc::default(),
        };
        store.migrate()?;
        Ok(store)
    }

    /// A store in memory, for validating a configuration without touching the state
    /// directory (`robota-mcpd check-config`).
    pub fn memory() -> Result<Self, StoreError> {
        let conn = Connection::open_in_memory()?;
        conn.execute_batch(
            "PRAGMA foreign_keys = ON; CREATE TABLE schema_migrations \
             (version INTEGER PRIMARY KEY, applied_at INTEGER NOT NULL);",
        )?;
        let store = Self {
            conn: Mutex::new(conn),
            path: PathBuf::from(":memory:"),
            health: Arc::default(),
        };
        store.migrate()?;
        Ok(store)
    }

    /// Report failed writes (a full disk, an I/O error, a read-only file) to `health`.
    pub fn reporting_to(mut self, health: Arc<Health>) -> Self {
        self.health = health;
        self
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    fn migrate(&self) -> Result<(), StoreError> {
        let mut conn = self.conn.lock();
        let found: usize = conn.query_row(
            "SELECT COALESCE(MAX(version), 0) FROM schema_migrations",
            [],
            |r| r.get(0),
        )?;
        if found > MIGRATIONS.len() {
            return Err(StoreError::TooNew {
                path: self.path.clone(),
                found,
                known: MIGRATIONS.len(),
            });
        }
        for (i, sql) in MIGRATIONS.iter().enumerate().skip(found) {
            let tx = conn.transaction()?;
            tx.execute_batch(sql)?;
            tx.execute(
                "INSERT INTO schema_migrations (version, applied_at) VALUES (?1, ?2)",
                params![i + 1, now()],
            )?;
            tx.commit()?;
        }
        Ok(())
    }

    /// The schema version in use.
    pub fn schema_version(&self) -> Result<usize, StoreError> {
        Ok(self.conn.lock().query_row(
            "SELECT COALESCE(MAX(version), 0) FROM schema_migrations",
            [],
            |r| r.get(0),
        )?)
    }

    /// Run `f` with the connection (one statement or one transaction).
    pub fn with<T>(
        &self,
        f: impl FnOnce(&mut Connection) -> rusqlite::Result<T>,
    ) -> Result<T, StoreError> {
        let mut conn = self.conn.lock();
        let before = conn.total_changes();
        match f(&mut conn) {
            Ok(value) => {
                if conn.total_changes() != before
                    && let Some(fault) = self.health.recovered(StatePart::Store)
                {
                    tracing::warn!(path = %self.path.display(), failures = fault.failures, "the store is written again");
                }
                Ok(value)
            }
            Err(e) => {
                if cannot_write(&e) {
                    let error = format!("cannot write {}: {e}", self.path.display());
                    if self.health.failed(StatePart::Store, &error) {
                        tracing::error!(error = %e, path = %self.path.display(), "cannot write the store; jobs, grants and idempotency keys cannot be recorded until it works again");
                    }
                }
                Err(e.into())
            }
        }
    }

    /// A write that changes nothing the daemon keeps (it rewrites the newest migration's
    /// record with itself): whether the store takes writes again.
    pub fn probe(&self) -> Result<(), StoreError> {
        self.with(|c| {
            c.execute(
                "UPDATE schema_migrations SET applied_at = applied_at \
                 WHERE version = (SELECT MAX(version) FROM schema_migrations)",
                [],
            )
            .map(|_| ())
        })
    }

    /// Drop finished jobs (and their output), idempotency records and decided or expired
    /// grants older than [`RETENTION`]. Run at start and hourly.
    pub fn prune(&self) -> Result<(), StoreError> {
        let cutoff = now() - i64::try_from(RETENTION.as_secs()).unwrap_or(i64::MAX);
        self.with(|c| {
            c.execute(
                "DELETE FROM jobs WHERE finished_at IS NOT NULL AND finished_at < ?1",
                [cutoff],
            )?;
            c.execute(
                "DELETE FROM idempotency WHERE created_at < ?1 AND state != 'pending'",
                [cutoff],
            )?;
            // Decided grants, approvals used and grants expired before the cutoff; pending
            // ones stay for the operator.
            c.execute(
                "DELETE FROM grants WHERE (state IN ('denied', 'revoked') AND decided_at < ?1) \
                 OR (state = 'approved' AND expires_at < ?1) OR (state = 'used' AND used_at < ?1)",
                [cutoff],
            )?;
            Ok(())
        })
    }
}

// ---- bearers ----------------------------------------------------------------------

/// A labelled bearer kept across restarts: its digest, never its secret.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeptBearer {
    pub label: String,
    pub digest: [u8; 32],
    pub created_at: i64,
    pub expires_at: i64,
}

impl Store {
    /// Keep `bearer` (replacing one of the same label).
    pub fn bearer_keep(&self, bearer: &KeptBearer) -> Result<(), StoreError> {
        self.with(|c| {
            c.execute(
                "INSERT OR REPLACE INTO bearers (label, digest, created_at, expires_at) \
                 VALUES (?1, ?2, ?3, ?4)",
                params![
                    bearer.label,
                    &bearer.digest[..],
                    bearer.created_at,
                    bearer.expires_at
                ],
            )
            .map(|_| ())
        })
    }

    /// Forget the bearer labelled `label`; whether there was one.
    pub fn bearer_forget(&self, label: &str) -> Result<bool, StoreError> {
        self.with(|c| c.execute("DELETE FROM bearers WHERE label = ?1", [label]))
            .map(|n| n > 0)
    }

    /// Forget every kept bearer.
    pub fn bearers_forget_all(&self) -> Result<(), StoreError> {
        self.with(|c| c.execute("DELETE FROM bearers", []).map(|_| ()))
    }

    /// The kept bearers that have not expired by `now` (the expired ones are dropped).
    pub fn bearers_kept(&self, now: i64) -> Result<Vec<KeptBearer>, StoreError> {
        self.with(|c| {
            c.execute("DELETE FROM bearers WHERE expires_at <= ?1", [now])?;
            let mut stmt = c.prepare(
                "SELECT label, digest, created_at, expires_at FROM bearers ORDER BY label",
            )?;
            let rows = stmt.query_map([], |r| {
                let digest: Vec<u8> = r.get(1)?;
                Ok((r.get(0)?, digest, r.get(2)?, r.get(3)?))
            })?;
            let mut out = Vec::new();
            for row in rows {
                let (label, digest, created_at, expires_at) = row?;
                // A digest of another length is not ours: skip it rather than trust it.
                if let Ok(digest) = <[u8; 32]>::try_from(digest.as_slice()) {
                    out.push(KeptBearer {
                        label,
                        digest,
                        created_at,
                        expires_at,
                    });
                }
            }
            Ok(out)
        })
    }
}

// ---- idempotency -------------------------------------------------------------------

/// What the store knows about an idempotency key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IdemRecord {
    /// First use: the key is now reserved for this call.
    Reserved,
    /// A call with this key is running now (or was, when the daemon died: see `Unknown`).
    InProgress { args_sha256: String },
    /// The first call finished; its result as stored.
    Done { args_sha256: String, result: String },
    /// The first call was cut off by a crash or restart; its effect is unknown.
    Unknown { args_sha256: String },
}

impl Store {
    /// Reserve `(caller, tool, key)` for a call with these arguments, or report what the
    /// key already stands for.
    pub fn idem_reserve(
        &self,
        caller: &str,
        tool: &str,
        key: &str,
        args_sha256: &str,
    ) -> Result<IdemRecord, StoreError> {
        self.with(|c| {
            let tx = c.transaction()?;
            let existing: Option<(String, String, Option<String>, String)> = tx
                .query_row(
                    "SELECT args_sha256, state, result, runner FROM idempotency \
                     WHERE caller = ?1 AND tool = ?2 AND key = ?3",
                    params![caller, tool, key],
                    |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)),
                )
                .optional()?;
            let record = match existing {
                None => {
                    tx.execute(
                        "INSERT INTO idempotency (caller, tool, key, args_sha256, state, runner, created_at) \
                         VALUES (?1, ?2, ?3, ?4, 'pending', ?5, ?6)",
                        params![caller, tool, key, args_sha256, runner::this(), now()],
                    )?;
                    IdemRecord::Reserved
                }
                Some((args_sha256, state, result, owner)) => match (state.as_str(), result) {
                    ("done", Some(result)) => IdemRecord::Done {
                        args_sha256,
                        result,
                    },
                    // Pending in a process that is gone (a --stdio process that ended):
                    // cut off, not in progress.
                    ("pending", _) if runner::alive(&owner) => {
                        IdemRecord::InProgress { args_sha256 }
                    }
                    _ => IdemRecord::Unknown { args_sha256 },
                },
            };
            tx.commit()?;
            Ok(record)
        })
    }

    /// Record the outcome of a reserved call.
    pub fn idem_finish(
        &self,
        caller: &str,
        tool: &str,
        key: &str,
        result: &str,
    ) -> Result<(), StoreError> {
        self.with(|c| {
            c.execute(
                "UPDATE idempotency SET state = 'done', result = ?4 \
                 WHERE caller = ?1 AND tool = ?2 AND key = ?3",
                params![caller, tool, key, result],
            )
            .map(drop)
        })
    }

    /// Forget a reservation whose call had no effect (refused before it ran).
    pub fn idem_release(&self, caller: &str, tool: &str, key: &str) -> Result<(), StoreError> {
        self.with(|c| {
            c.execute(
                "DELETE FROM idempotency WHERE caller = ?1 AND tool = ?2 AND key = ?3 AND state = 'pending'",
                params![caller, tool, key],
            )
            .map(drop)
        })
    }

    /// A reserved call was cut off (its future dropped): its outcome is unknown.
    pub fn idem_mark_unknown(&self, caller: &str, tool: &str, key: &str) -> Result<(), StoreError> {
        self.with(|c| {
            c.execute(
                "UPDATE idempotency SET state = 'unknown' \
                 WHERE caller = ?1 AND tool = ?2 AND key = ?3 AND state = 'pending'",
                params![caller, tool, key],
            )
            .map(drop)
        })
    }

    /// At start-up: reservations left pending by a process that is gone have unknown
    /// outcomes. (A `robota-mcpd --stdio` process may share the store with the daemon; its
    /// live reservations are left alone.)
    pub fn idem_mark_interrupted(&self) -> Result<usize, StoreError> {
        self.with(|c| {
            let runners: Vec<String> = {
                let mut stmt = c.prepare(
                    "SELECT DISTINCT runner FROM idempotency WHERE state = 'pending'",
                )?;
                stmt.query_map([], |r| r.get(0))?.collect::<Result<_, _>>()?
            };
            let mut marked = 0;
            for dead in runners.iter().filter(|r| !runner::alive(r)) {
                marked += c.execute(
                    "UPDATE idempotency SET state = 'unknown' WHERE state = 'pending' AND runner = ?1",
                    [dead],
                )?;
            }
            Ok(marked)
        })
    }
}

/// Which process ran something: `<pid>:<start time in clock ticks>`, so a pid reused by an
/// unrelated process is not mistaken for the one that wrote the record.
pub mod runner {
    /// A process's start time (field 22 of `/proc/<pid>/stat`), if it exists.
    pub fn start_time(pid: u32) -> Option<u64> {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        // The command name (field 2) may contain spaces and parentheses: skip past its end.
        let rest = &stat[stat.rfind(')')? + 1..];
        rest.split_ascii_whitespace().nth(19)?.parse().ok()
    }

    /// Processes in process group `pgid` (pid, start time), from `/proc/*/stat`.
    pub fn group_members(pgid: u32) -> Vec<(u32, u64)> {
        let Ok(dir) = std::fs::read_dir("/proc") else {
            return Vec::new();
        };
        dir.filter_map(|entry| entry.ok()?.file_name().to_str()?.parse::<u32>().ok())
            .filter_map(|pid| {
                let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
                let fields: Vec<&str> = stat[stat.rfind(')')? + 1..]
                    .split_ascii_whitespace()
                    .collect();
                // After the command name: state (3), ppid (4), pgrp (5), … starttime (22).
                let pgrp: u32 = fields.get(2)?.parse().ok()?;
                let start: u64 = fields.get(19)?.parse().ok()?;
                (pgrp == pgid).then_some((pid, start))
            })
            .collect()
    }

    /// This process.
    pub fn this() -> String {
        let pid = std::process::id();
        format!("{pid}:{}", start_time(pid).unwrap_or(0))
    }

    /// Whether the process named by a runner string still exists.
    pub fn alive(runner: &str) -> bool {
        let Some((pid, start)) = runner.split_once(':') else {
            return false;
        };
        match (pid.parse::<u32>(), start.parse::<u64>()) {
            (Ok(pid), Ok(start)) => start_time(pid) == Some(start),
            _ => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runner_strings_tell_live_processes_from_dead_ones() {
        assert!(runner::alive(&runner::this()));
        assert!(!runner::alive("1:1"));
        assert!(!runner::alive(&format!("{}:0", std::process::id())));
        assert!(!runner::alive("garbage"));
    }

    #[test]
    fn opens_migrates_and_reopens() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        assert_eq!(store.schema_version().unwrap(), MIGRATIONS.len());
        drop(store);
        let store = Store::open(dir.path()).unwrap();
        assert_eq!(store.schema_version().unwrap(), MIGRATIONS.len());
        let mode = std::fs::metadata(dir.path().join(FILE_NAME)).unwrap();
        assert_eq!(
            std::os::unix::fs::PermissionsExt::mode(&mode.permissions()) & 0o777,
            0o600
        );
    }

    #[test]
    fn kept_bearers_survive_reopening_until_they_expire() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        let bearer = |label: &str, expires_at| KeptBearer {
            label: label.into(),
            digest: [7; 32],
            created_at: 100,
            expires_at,
        };
        store.bearer_keep(&bearer("ci", 1_000)).unwrap();
        store.bearer_keep(&bearer("old", 200)).unwrap();
        store.bearer_keep(&bearer("gone", 1_000)).unwrap();
        assert!(store.bearer_forget("gone").unwrap());
        assert!(!store.bearer_forget("gone").unwrap());
        drop(store);
        let store = Store::open(dir.path()).unwrap();
        assert_eq!(store.bearers_kept(500).unwrap(), [bearer("ci", 1_000)]);
        assert_eq!(store.bearers_kept(1_000).unwrap(), []);
        store.bearer_keep(&bearer("a", 2_000)).unwrap();
        store.bearers_forget_all().unwrap();
        assert_eq!(store.bearers_kept(0).unwrap(), []);
    }

    #[test]
    fn a_file_that_is_not_a_database_is_an_error_and_is_left_alone() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(FILE_NAME);
        let junk =
            b"this is not a sqlite database, and it is long enough to have a header".repeat(20);
        std::fs::write(&path, &junk).unwrap();
        let err = Store::open(dir.path()).err().expect("must fail");
        let text = err.to_string();
        assert!(text.contains(FILE_NAME), "{text}");
        assert!(
            std::fs::read(&path).unwrap() == junk,
            "the file was modified"
        );
    }

    #[test]
    fn a_newer_schema_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        drop(Store::open(dir.path()).unwrap());
        let conn = Connection::open(dir.path().join(FILE_NAME)).unwrap();
        conn.execute(
            "INSERT INTO schema_migrations (version, applied_at) VALUES (99, 0)",
            [],
        )
        .unwrap();
        drop(conn);
        let err = Store::open(dir.path()).err().expect("must fail");
        assert!(matches!(err, StoreError::TooNew { found: 99, .. }), "{err}");
    }

    #[test]
    fn a_corrupted_page_fails_the_integrity_check() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        store
            .with(|c| {
                c.execute_batch("PRAGMA journal_mode = DELETE;")?;
                let tx = c.transaction()?;
                for i in 0..2000 {
                    tx.execute(
                        "INSERT INTO grants (caller, kind, reason, scope, duration_secs, state, requested_at) \
                         VALUES ('local:0', 'elevation', ?1, '[]', 60, 'pending', 0)",
                        [format!("reason number {i} with some padding to fill pages")],
                    )?;
                }
                tx.commit()
            })
            .unwrap();
        drop(store);
        // Overwrite the middle of the file (index and table pages) with garbage.
        let path = dir.path().join(FILE_NAME);
        let mut bytes = std::fs::read(&path).unwrap();
        let mid = bytes.len() / 2;
        for b in &mut bytes[mid..mid + 8192] {
            *b = 0x5a;
        }
        std::fs::write(&path, &bytes).unwrap();
        let err = Store::open(dir.path()).err().expect("must fail");
        assert!(
            matches!(
                err,
                StoreError::Corrupt { .. } | StoreError::NotADatabase { .. }
            ),
            "{err}"
        );
        assert!(
            std::fs::read(&path).unwrap() == bytes,
            "the file was modified"
        );
    }

    #[test]
    fn idempotency_reserve_finish_and_interrupt() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        assert_eq!(
            store
                .idem_reserve("local:0", "file.write", "k", "h1")
                .unwrap(),
            IdemRecord::Reserved
        );
        assert_eq!(
            store
                .idem_reserve("local:0", "file.write", "k", "h1")
                .unwrap(),
            IdemRecord::InProgress {
                args_sha256: "h1".into()
            }
        );
        // Another caller's key space is separate.
        assert_eq!(
            store
                .idem_reserve("local:1", "file.write", "k", "h1")
                .unwrap(),
            IdemRecord::Reserved
        );
        store
            .idem_finish("local:0", "file.write", "k", "{\"ok\":1}")
            .unwrap();
        assert_eq!(
            store
                .idem_reserve("local:0", "file.write", "k", "h2")
                .unwrap(),
            IdemRecord::Done {
                args_sha256: "h1".into(),
                result: "{\"ok\":1}".into()
            }
        );
        // Our own pending reservation is left alone; a dead process's is marked.
        assert_eq!(store.idem_mark_interrupted().unwrap(), 0);
        store
            .with(|c| {
                c.execute(
                    "UPDATE idempotency SET runner = '1:1' WHERE state = 'pending'",
                    [],
                )
            })
            .unwrap();
        assert_eq!(store.idem_mark_interrupted().unwrap(), 1);
        assert_eq!(
            store
                .idem_reserve("local:1", "file.write", "k", "h1")
                .unwrap(),
            IdemRecord::Unknown {
                args_sha256: "h1".into()
            }
        );
    }
}
