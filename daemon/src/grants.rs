//! Grants: operator-approved, time-limited permission for one caller to use tools that
//! policy marks `decision = "grant"`.
//!
//! A caller asks with `permissions.request_root_access` (scope defaults to every
//! grant-gated tool) or `permissions.request_elevation` (scope names tool patterns); an
//! operator decides with `robota-mcpctl grants approve|deny|revoke`. A grant is bound to
//! the caller identity that asked, lives in the store (it survives restarts), expires, and
//! is checked on every call it covers. Every request and decision is an audit record.
//!
//! Caller- and operator-given durations meet the clock here, so arithmetic is checked:
//! the lint below refuses any operator that could overflow or panic.

#![deny(clippy::arithmetic_side_effects)]

use std::sync::Arc;
use std::time::Duration;

use rusqlite::{OptionalExtension, Row, params};

use crate::audit::Audit;
use crate::config::PermissionsTool;
use crate::metrics::Metrics;
use crate::store::{Store, StoreError, now};
use crate::vocab::GrantEvent;
use crate::vocab::{Caller, GrantId};

/// Longest reason a caller may give.
pub const MAX_REASON: usize = 500;
/// Most tool patterns in one grant's scope.
pub const MAX_SCOPE: usize = 32;
/// Most grant requests one caller may make in an hour, withdrawn ones included.
pub const REQUESTS_PER_HOUR: usize = 30;

pub use robota_proto::{GrantKind, GrantRecord as Grant, GrantState};

fn parse_kind(text: &str) -> GrantKind {
    if text == GrantKind::RootAccess.as_str() {
        GrantKind::RootAccess
    } else {
        GrantKind::Elevation
    }
}

/// Whether an approved grant covers a canonical tool name.
fn covers(grant: &Grant, tool: &str) -> bool {
    grant.state == GrantState::Approved
        && grant.scope.iter().any(|p| glob_match::glob_match(p, tool))
}

const COLUMNS: &str = "id, caller, kind, reason, scope, duration_secs, state, requested_at, \
                       decided_at, decided_by, expires_at";

fn from_row(r: &Row<'_>, now: i64) -> rusqlite::Result<Grant> {
    let state: String = r.get(6)?;
    let expires_at: Option<i64> = r.get(10)?;
    let state = match state.as_str() {
        "approved" if expires_at.is_some_and(|t| t <= now) => GrantState::Expired,
        "approved" => GrantState::Approved,
        "denied" => GrantState::Denied,
        "revoked" => GrantState::Revoked,
        _ => GrantState::Pending,
    };
    let scope: String = r.get(4)?;
    Ok(Grant {
        grant_id: r.get(0)?,
        caller: r.get(1)?,
        kind: parse_kind(&r.get::<_, String>(2)?),
        reason: r.get(3)?,
        scope: serde_json::from_str(&scope).unwrap_or_default(),
        duration_secs: r.get(5)?,
        state,
        requested_at: r.get(7)?,
        decided_at: r.get(8)?,
        decided_by: r.get(9)?,
        expires_at,
    })
}

/// Why an operator's decision was refused.
#[derive(Debug, thiserror::Error)]
pub enum DecideError {
    #[error("there is no grant {0}")]
    NotFound(i64),
    #[error("grant {id} is {state}, not {wanted}")]
    WrongState {
        id: i64,
        state: &'static str,
        wanted: &'static str,
    },
    #[error("{0}")]
    BadDuration(String),
    #[error(transparent)]
    Store(#[from] StoreError),
}

pub struct Grants {
    store: Arc<Store>,
    audit: Arc<Audit>,
    metrics: Metrics,
    limits: parking_lot::RwLock<PermissionsTool>,
}

/// Why a caller's own grant request or revocation was refused.
#[derive(Debug, thiserror::Error)]
pub enum GrantError {
    /// A reason, scope or duration out of bounds.
    #[error("{0}")]
    Invalid(String),
    #[error(
        "you have {max_pending} pending requests or made {per_hour} in the last hour; wait for an operator to decide them"
    )]
    TooMany { max_pending: usize, per_hour: usize },
    /// No such grant, or not the caller's (the two look the same to it).
    #[error("there is no grant {0} of yours")]
    NotYours(GrantId),
    #[error("the grant store failed")]
    Store(#[from] StoreError),
}

fn invalid(message: impl Into<String>) -> GrantError {
    GrantError::Invalid(message.into())
}

impl Grants {
    pub fn new(
        store: Arc<Store>,
        audit: Arc<Audit>,
        metrics: Metrics,
        limits: PermissionsTool,
    ) -> Self {
        Self {
            store,
            audit,
            metrics,
            limits: parking_lot::RwLock::new(limits),
        }
    }

    /// The bounds from now on (a reload); grants already decided keep theirs.
    pub fn set_limits(&self, limits: PermissionsTool) {
        *self.limits.write() = limits;
    }

    pub fn max_duration(&self) -> Duration {
        self.limits.read().max_duration
    }

    /// When a grant of `duration` starting at `now` ends: `None` unless the duration is
    /// whole seconds from 1s to the configured maximum and the end is representable.
    fn expiry(&self, now: i64, duration: Duration) -> Option<i64> {
        let secs = duration.as_secs();
        if secs == 0 || duration.subsec_nanos() != 0 || duration > self.max_duration() {
            return None;
        }
        now.checked_add(i64::try_from(secs).ok()?)
    }

    fn duration_bounds(&self) -> String {
        format!(
            "duration must be whole seconds between 1s and {}",
            humantime::format_duration(self.max_duration())
        )
    }

    fn event(&self, event: GrantEvent, grant: &Grant, by: &str) {
        self.metrics.grant_event(event);
        self.audit.grant(event, grant.grant_id, &grant.caller, by);
    }

    /// A caller asks for a grant. Pending until an operator decides.
    pub fn request(
        &self,
        caller: &Caller,
        kind: GrantKind,
        reason: &str,
        scope: Vec<String>,
        duration: Duration,
    ) -> Result<Grant, GrantError> {
        let reason = reason.trim();
        if reason.is_empty() || reason.chars().count() > MAX_REASON {
            return Err(invalid(format!(
                "reason must be 1 to {MAX_REASON} characters"
            )));
        }
        if scope.is_empty() || scope.len() > MAX_SCOPE {
            return Err(invalid(format!(
                "scope must list 1 to {MAX_SCOPE} tool patterns"
            )));
        }
        if let Some(bad) = scope.iter().find(|p| {
            p.is_empty()
                || p.len() > 64
                || !p
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "_.-*".contains(c))
        }) {
            return Err(invalid(format!(
                "scope entry {bad:?} is not a tool pattern"
            )));
        }
        let now = now();
        if self.expiry(now, duration).is_none() {
            return Err(invalid(self.duration_bounds()));
        }
        let caller_text = caller.to_string();
        let scope_json = serde_json::to_string(&scope).unwrap_or_else(|_| "[]".into());
        let max_pending = self.limits.read().max_pending;
        let id = self
            .store
            .with(|c| {
                let tx = c.transaction()?;
                let pending: usize = tx.query_row(
                    "SELECT COUNT(*) FROM grants WHERE caller = ?1 AND state = 'pending'",
                    [&caller_text],
                    |r| r.get(0),
                )?;
                // Withdrawn requests count too: request-and-revoke cannot flood the
                // operator's list or the audit trail.
                let recent: usize = tx.query_row(
                    "SELECT COUNT(*) FROM grants WHERE caller = ?1 AND requested_at > ?2",
                    params![caller_text, now.saturating_sub(3600)],
                    |r| r.get(0),
                )?;
                if pending >= max_pending || recent >= REQUESTS_PER_HOUR {
                    return Ok(None);
                }
                tx.execute(
                    "INSERT INTO grants (caller, kind, reason, scope, duration_secs, state, requested_at) \
                     VALUES (?1, ?2, ?3, ?4, ?5, 'pending', ?6)",
                    params![caller_text, kind.as_str(), reason, scope_json, duration.as_secs(), now],
                )?;
                let id = tx.last_insert_rowid();
                tx.commit()?;
                Ok(Some(id))
            })
            ?;
        let Some(id) = id else {
            return Err(GrantError::TooMany {
                max_pending,
                per_hour: REQUESTS_PER_HOUR,
            });
        };
        let grant = self.get(id)?.ok_or(GrantError::NotYours(GrantId(id)))?;
        self.event(GrantEvent::Requested, &grant, &caller_text);
        Ok(grant)
    }

    pub fn get(&self, id: i64) -> Result<Option<Grant>, StoreError> {
        let now = now();
        self.store.with(|c| {
            c.query_row(
                &format!("SELECT {COLUMNS} FROM grants WHERE id = ?1"),
                [id],
                |r| from_row(r, now),
            )
            .optional()
        })
    }

    /// Grants newest first: one caller's (when given), all of them, or only pending and
    /// active ones (`current_only`).
    pub fn list(&self, caller: Option<&str>, current_only: bool) -> Result<Vec<Grant>, StoreError> {
        let now = now();
        // The state filter is in SQL, so old decided grants can never push a pending or
        // live one out of the newest-1000 window.
        self.store.with(|c| {
            let mut stmt = c.prepare(&format!(
                "SELECT {COLUMNS} FROM grants WHERE (?1 IS NULL OR caller = ?1) \
                 AND (?2 = 0 OR state = 'pending' OR (state = 'approved' AND expires_at > ?3)) \
                 ORDER BY id DESC LIMIT 1000"
            ))?;
            stmt.query_map(params![caller, current_only, now], |r| from_row(r, now))?
                .collect()
        })
    }

    /// Requests waiting for an operator.
    pub fn pending_count(&self) -> Result<usize, StoreError> {
        self.store.with(|c| {
            c.query_row(
                "SELECT COUNT(*) FROM grants WHERE state = 'pending'",
                [],
                |r| r.get(0),
            )
        })
    }

    /// An approved, unexpired grant of exactly this caller that covers `tool`.
    pub fn covering(&self, caller: &Caller, tool: &str) -> Result<Option<Grant>, StoreError> {
        let now = now();
        let caller_text = caller.to_string();
        let approved: Vec<Grant> = self.store.with(|c| {
            let mut stmt = c.prepare(&format!(
                "SELECT {COLUMNS} FROM grants WHERE caller = ?1 AND state = 'approved' AND expires_at > ?2"
            ))?;
            stmt.query_map(params![caller_text, now], |r| from_row(r, now))?
                .collect()
        })?;
        Ok(approved.into_iter().find(|g| covers(g, tool)))
    }

    fn transition(
        &self,
        id: i64,
        from: &[GrantState],
        wanted: &'static str,
        update: impl FnOnce(&rusqlite::Transaction<'_>) -> rusqlite::Result<usize>,
    ) -> Result<Grant, DecideError> {
        let grant = self.get(id)?.ok_or(DecideError::NotFound(id))?;
        if !from.contains(&grant.state) {
            return Err(DecideError::WrongState {
                id,
                state: grant.state.as_str(),
                wanted,
            });
        }
        let changed = self.store.with(|c| {
            let tx = c.transaction()?;
            let n = update(&tx)?;
            tx.commit()?;
            Ok(n)
        })?;
        let after = self.get(id)?.ok_or(DecideError::NotFound(id))?;
        if changed == 0 {
            // Raced with another decision: report what it is now.
            return Err(DecideError::WrongState {
                id,
                state: after.state.as_str(),
                wanted,
            });
        }
        Ok(after)
    }

    /// Operator approval; `duration` overrides (never exceeds the maximum).
    pub fn approve(
        &self,
        id: i64,
        operator: &str,
        duration: Option<Duration>,
    ) -> Result<Grant, DecideError> {
        let pending = self.get(id)?.ok_or(DecideError::NotFound(id))?;
        let duration = duration.unwrap_or(Duration::from_secs(pending.duration_secs));
        let now = now();
        let Some(expires) = self.expiry(now, duration) else {
            return Err(DecideError::BadDuration(self.duration_bounds()));
        };
        let grant = self.transition(id, &[GrantState::Pending], "pending", |tx| {
            tx.execute(
                "UPDATE grants SET state = 'approved', decided_at = ?2, decided_by = ?3, \
                 expires_at = ?4, duration_secs = ?5 WHERE id = ?1 AND state = 'pending'",
                params![id, now, operator, expires, duration.as_secs()],
            )
        })?;
        self.event(GrantEvent::Approved, &grant, operator);
        Ok(grant)
    }

    pub fn deny(&self, id: i64, operator: &str) -> Result<Grant, DecideError> {
        let now = now();
        let grant = self.transition(id, &[GrantState::Pending], "pending", |tx| {
            tx.execute(
                "UPDATE grants SET state = 'denied', decided_at = ?2, decided_by = ?3 \
                 WHERE id = ?1 AND state = 'pending'",
                params![id, now, operator],
            )
        })?;
        self.event(GrantEvent::Denied, &grant, operator);
        Ok(grant)
    }

    /// Revoke a pending or approved grant, by an operator or by its own caller.
    pub fn revoke(&self, id: i64, by: &str) -> Result<Grant, DecideError> {
        let now = now();
        let grant = self.transition(
            id,
            &[GrantState::Pending, GrantState::Approved],
            "pending or approved",
            |tx| {
                tx.execute(
                    "UPDATE grants SET state = 'revoked', decided_at = ?2, decided_by = ?3 \
                     WHERE id = ?1 AND state IN ('pending', 'approved')",
                    params![id, now, by],
                )
            },
        )?;
        self.event(GrantEvent::Revoked, &grant, by);
        Ok(grant)
    }

    /// A caller revokes its own grant; someone else's is "not found" to it.
    pub fn revoke_own(&self, caller: &Caller, id: GrantId) -> Result<Grant, GrantError> {
        let caller_text = caller.to_string();
        match self.get(id.0)? {
            Some(g) if g.caller == caller_text => {}
            _ => return Err(GrantError::NotYours(id)),
        }
        self.revoke(id.0, &caller_text).map_err(|e| match e {
            DecideError::Store(e) => GrantError::Store(e),
            other => invalid(other.to_string()),
        })
    }
}

#[cfg(test)]
#[allow(
    clippy::arithmetic_side_effects,
    reason = "tests step clocks by known amounts"
)]
mod tests {
    use super::*;

    fn grants(dir: &std::path::Path) -> Grants {
        Grants::new(
            Arc::new(Store::open(dir).unwrap()),
            Arc::new(Audit::new()),
            Metrics::new(),
            PermissionsTool::default(),
        )
    }

    #[test]
    fn request_approve_cover_and_revoke() {
        let dir = tempfile::tempdir().unwrap();
        let g = grants(dir.path());
        let ci = Caller::Bearer("ci".into());
        let other = Caller::Bearer("other".into());
        let req = g
            .request(
                &ci,
                GrantKind::Elevation,
                "deploy",
                vec!["file.write".into()],
                Duration::from_secs(600),
            )
            .unwrap();
        assert_eq!(req.state, GrantState::Pending);
        assert!(g.covering(&ci, "file.write").unwrap().is_none());
        let ok = g.approve(req.grant_id, "local:0", None).unwrap();
        assert_eq!(ok.state, GrantState::Approved);
        assert!(g.covering(&ci, "file.write").unwrap().is_some());
        assert!(g.covering(&ci, "file.read").unwrap().is_none());
        assert!(g.covering(&other, "file.write").unwrap().is_none());
        // Deciding twice is refused with the current state named.
        let err = g.deny(req.grant_id, "local:0").unwrap_err();
        assert!(err.to_string().contains("approved"), "{err}");
        // Another caller cannot revoke it; its owner can.
        assert!(g.revoke_own(&other, GrantId(req.grant_id)).is_err());
        g.revoke_own(&ci, GrantId(req.grant_id)).unwrap();
        assert!(g.covering(&ci, "file.write").unwrap().is_none());
    }

    #[test]
    fn expiry_ends_a_grant() {
        let dir = tempfile::tempdir().unwrap();
        let g = grants(dir.path());
        let ci = Caller::Local(1000);
        let req = g
            .request(
                &ci,
                GrantKind::RootAccess,
                "fix",
                vec!["*".into()],
                Duration::from_secs(60),
            )
            .unwrap();
        g.approve(req.grant_id, "local:0", None).unwrap();
        assert!(g.covering(&ci, "service.action").unwrap().is_some());
        g.store
            .with(|c| c.execute("UPDATE grants SET expires_at = ?1", [now() - 1]))
            .unwrap();
        assert!(g.covering(&ci, "service.action").unwrap().is_none());
        assert_eq!(
            g.get(req.grant_id).unwrap().unwrap().state,
            GrantState::Expired
        );
        assert!(g.list(None, true).unwrap().is_empty());
    }

    #[test]
    fn requests_are_validated_and_bounded() {
        let dir = tempfile::tempdir().unwrap();
        let g = grants(dir.path());
        let c = Caller::Local(1);
        let d = Duration::from_secs(60);
        assert!(
            g.request(&c, GrantKind::Elevation, " ", vec!["x".into()], d)
                .is_err()
        );
        assert!(g.request(&c, GrantKind::Elevation, "r", vec![], d).is_err());
        assert!(
            g.request(&c, GrantKind::Elevation, "r", vec!["a b".into()], d)
                .is_err()
        );
        assert!(
            g.request(
                &c,
                GrantKind::Elevation,
                "r",
                vec!["x".into()],
                Duration::from_secs(90 * 24 * 3600)
            )
            .is_err()
        );
        for _ in 0..PermissionsTool::default().max_pending {
            g.request(&c, GrantKind::Elevation, "r", vec!["x".into()], d)
                .unwrap();
        }
        let err = g
            .request(&c, GrantKind::Elevation, "r", vec!["x".into()], d)
            .unwrap_err();
        assert!(matches!(err, GrantError::TooMany { .. }), "{err}");
        // Request-and-withdraw is bounded too.
        let other = Caller::Local(2);
        for _ in 0..REQUESTS_PER_HOUR {
            let req = g
                .request(&other, GrantKind::Elevation, "r", vec!["x".into()], d)
                .unwrap();
            g.revoke_own(&other, GrantId(req.grant_id)).unwrap();
        }
        let err = g
            .request(&other, GrantKind::Elevation, "r", vec!["x".into()], d)
            .unwrap_err();
        assert!(matches!(err, GrantError::TooMany { .. }), "{err}");
    }

    #[test]
    fn durations_are_checked_at_both_edges() {
        let dir = tempfile::tempdir().unwrap();
        let g = grants(dir.path());
        let max = PermissionsTool::default().max_duration;
        let c = Caller::Local(7);
        let ask = |d: Duration| g.request(&c, GrantKind::Elevation, "r", vec!["x".into()], d);
        for bad in [
            Duration::ZERO,
            Duration::from_millis(500),
            Duration::from_millis(1500),
            max + Duration::from_secs(1),
            Duration::from_secs(u64::MAX),
        ] {
            let err = ask(bad).unwrap_err();
            assert!(matches!(err, GrantError::Invalid(_)), "{bad:?}: {err}");
            assert!(err.to_string().contains("between 1s and 1day"), "{}", err);
        }
        let one = ask(Duration::from_secs(1)).unwrap();
        let top = ask(max).unwrap();
        // Approval: the caller's duration, or the operator's, under the same bounds.
        for bad in [
            Duration::ZERO,
            max + Duration::from_secs(1),
            Duration::from_secs(300_000_000_000 * 31_557_600),
            Duration::from_secs(u64::MAX),
        ] {
            assert!(
                matches!(
                    g.approve(one.grant_id, "local:0", Some(bad)),
                    Err(DecideError::BadDuration(_))
                ),
                "{bad:?}"
            );
        }
        assert_eq!(
            g.get(one.grant_id).unwrap().unwrap().state,
            GrantState::Pending
        );
        let approved = g.approve(top.grant_id, "local:0", None).unwrap();
        let (decided, expires) = (approved.decided_at.unwrap(), approved.expires_at.unwrap());
        assert_eq!(expires - decided, i64::try_from(max.as_secs()).unwrap());
        let approved = g
            .approve(one.grant_id, "local:0", Some(Duration::from_secs(1)))
            .unwrap();
        assert_eq!(
            approved.expires_at.unwrap() - approved.decided_at.unwrap(),
            1
        );
    }

    #[test]
    fn an_unbounded_maximum_cannot_overflow_the_clock() {
        let dir = tempfile::tempdir().unwrap();
        let g = Grants::new(
            Arc::new(Store::open(dir.path()).unwrap()),
            Arc::new(Audit::new()),
            Metrics::new(),
            PermissionsTool {
                max_duration: Duration::MAX,
                ..PermissionsTool::default()
            },
        );
        let c = Caller::Local(7);
        let huge = Duration::from_secs(u64::MAX);
        let err = g
            .request(&c, GrantKind::Elevation, "r", vec!["x".into()], huge)
            .unwrap_err();
        assert!(
            matches!(err, GrantError::Invalid(_) | GrantError::NotYours(_)),
            "{err}"
        );
        let near = Duration::from_secs(u64::try_from(i64::MAX).unwrap() - 10);
        assert!(matches!(
            g.request(&c, GrantKind::Elevation, "r", vec!["x".into()], near),
            Err(GrantError::Invalid(_))
        ));
        let ok = g
            .request(
                &c,
                GrantKind::Elevation,
                "r",
                vec!["x".into()],
                Duration::from_secs(60),
            )
            .unwrap();
        assert!(matches!(
            g.approve(ok.grant_id, "local:0", Some(near)),
            Err(DecideError::BadDuration(_))
        ));
    }

    #[test]
    fn current_grants_are_listed_however_many_old_ones_exist() {
        let dir = tempfile::tempdir().unwrap();
        let g = grants(dir.path());
        let c = Caller::Local(1);
        let live = g
            .request(
                &c,
                GrantKind::Elevation,
                "keep",
                vec!["x".into()],
                Duration::from_secs(600),
            )
            .unwrap();
        g.approve(live.grant_id, "local:0", None).unwrap();
        g.store
            .with(|conn| {
                let tx = conn.transaction()?;
                for _ in 0..1500 {
                    tx.execute(
                        "INSERT INTO grants (caller, kind, reason, scope, duration_secs, state, requested_at) \
                         VALUES ('local:9', 'elevation', 'old', '[]', 60, 'denied', 0)",
                        [],
                    )?;
                }
                tx.commit()
            })
            .unwrap();
        let current = g.list(None, true).unwrap();
        assert_eq!(current.len(), 1);
        assert_eq!(current[0].grant_id, live.grant_id);
    }
}
