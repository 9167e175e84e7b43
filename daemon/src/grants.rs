//! Grants: operator-approved, time-limited permission for one caller to use tools that
//! policy marks `decision = "grant"`.
//!
//! A caller asks with `permissions.request_root_access` (scope defaults to every
//! grant-gated tool) or `permissions.request_elevation` (scope names tool patterns); an
//! operator decides with `robota-mcpctl grants approve|deny|revoke`. A grant is bound to
//! the caller identity that asked, lives in the store (it survives restarts), expires, and
//! is checked on every call it covers. Every request and decision is an audit record.
//!
//! Approvals of one exact call (`decision = "approve-each"`) are grants of kind `call`,
//! bound to the caller, the canonical tool name and the SHA-256 of the call's canonical
//! arguments: the call asks (or finds its pending request), an operator approves, and the
//! identical call uses the approval — once: the use is a single guarded update, so of two
//! identical calls racing for one approval exactly one runs. They share the grant
//! requests' per-caller bounds, store, audit trail and operator commands; an approval
//! never covers a call that policy puts behind `grant`, nor a grant a call behind
//! `approve-each`.
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
/// Largest canonical arguments an approval of one call holds (the operator must be able
/// to read what they approve; larger calls cannot be approved one by one).
pub const MAX_APPROVAL_ARGS: usize = 64 * 1024;

pub use robota_proto::{GrantKind, GrantRecord as Grant, GrantState};

fn parse_kind(text: &str) -> GrantKind {
    GrantKind::ALL
        .into_iter()
        .find(|k| k.as_str() == text)
        .unwrap_or(GrantKind::Elevation)
}

/// Whether an approved grant covers a canonical tool name.
fn covers(grant: &Grant, tool: &str) -> bool {
    grant.state == GrantState::Approved
        && grant.scope.iter().any(|p| glob_match::glob_match(p, tool))
}

const COLUMNS: &str = "id, caller, kind, reason, scope, duration_secs, state, requested_at, \
                       decided_at, decided_by, expires_at, tool, arguments, args_sha256, used_at";

fn from_row(r: &Row<'_>, now: i64) -> rusqlite::Result<Grant> {
    let state: String = r.get(6)?;
    let expires_at: Option<i64> = r.get(10)?;
    let state = match state.as_str() {
        "approved" if expires_at.is_some_and(|t| t <= now) => GrantState::Expired,
        "approved" => GrantState::Approved,
        "denied" => GrantState::Denied,
        "revoked" => GrantState::Revoked,
        "used" => GrantState::Used,
        _ => GrantState::Pending,
    };
    let arguments: Option<String> = r.get(12)?;
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
        tool: r.get(11)?,
        arguments: arguments.and_then(|text| serde_json::from_str(&text).ok()),
        args_sha256: r.get(13)?,
        used_at: r.get(14)?,
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

/// What a call behind `approve-each` found.
#[derive(Debug)]
pub enum CallApproval {
    /// An approval of exactly this call, now used: the call runs.
    Used(Grant),
    /// The request waiting for an operator (made now, or by an identical call before).
    Pending(Grant),
}

/// What the approval transaction did.
enum Found {
    Used,
    Pending,
    Requested,
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
        self.audit.grant(
            event,
            grant.grant_id,
            &grant.caller,
            by,
            grant.tool.as_deref(),
        );
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

    /// A call that policy puts behind `approve-each`: use an approved, unexpired, unused
    /// approval of exactly this caller, tool and arguments if there is one (one
    /// transaction: of two identical calls, one uses it and the other does not see it);
    /// else the pending request for it, made now if there is none (within the caller's
    /// bounds, as a grant request).
    /// Make the used approval of one call `id` approved again (its call proved it had no
    /// effect); whether it was used.
    pub fn give_back(&self, id: i64) -> Result<bool, StoreError> {
        self.store
            .with(|c| {
                c.execute(
                    "UPDATE grants SET state = 'approved', used_at = NULL \
                     WHERE id = ?1 AND state = 'used'",
                    [id],
                )
            })
            .map(|n| n == 1)
    }

    pub fn approve_each(
        &self,
        caller: &Caller,
        tool: &str,
        arguments: &serde_json::Value,
    ) -> Result<CallApproval, GrantError> {
        let canonical = crate::canonical::canonical_json(arguments);
        if canonical.len() > MAX_APPROVAL_ARGS {
            return Err(invalid(format!(
                "the arguments are {} bytes as canonical JSON; an approval of one call can show \
                 an operator at most {MAX_APPROVAL_ARGS}",
                canonical.len()
            )));
        }
        let digest = crate::canonical::canonical_sha256(arguments);
        let caller_text = caller.to_string();
        let now = now();
        let (expiry, max_pending) = {
            let limits = self.limits.read();
            (limits.approval_expiry.as_secs(), limits.max_pending)
        };
        let scope_json = serde_json::to_string(&[tool]).unwrap_or_else(|_| "[]".into());
        let found = self.store.with(|c| {
            let tx = c.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
            let matching = |state: &str| -> rusqlite::Result<Option<i64>> {
                tx.query_row(
                    "SELECT id FROM grants WHERE caller = ?1 AND kind = 'call' AND tool = ?2 \
                     AND args_sha256 = ?3 AND state = ?4 AND (?4 != 'approved' OR expires_at > ?5) \
                     ORDER BY id LIMIT 1",
                    params![caller_text, tool, digest, state, now],
                    |r| r.get(0),
                )
                .optional()
            };
            if let Some(id) = matching("approved")? {
                let used = tx.execute(
                    "UPDATE grants SET state = 'used', used_at = ?2 \
                     WHERE id = ?1 AND state = 'approved' AND expires_at > ?2",
                    params![id, now],
                )?;
                if used == 1 {
                    tx.commit()?;
                    return Ok(Some((id, Found::Used)));
                }
            }
            if let Some(id) = matching("pending")? {
                return Ok(Some((id, Found::Pending)));
            }
            let pending: usize = tx.query_row(
                "SELECT COUNT(*) FROM grants WHERE caller = ?1 AND state = 'pending'",
                [&caller_text],
                |r| r.get(0),
            )?;
            let recent: usize = tx.query_row(
                "SELECT COUNT(*) FROM grants WHERE caller = ?1 AND requested_at > ?2",
                params![caller_text, now.saturating_sub(3600)],
                |r| r.get(0),
            )?;
            if pending >= max_pending || recent >= REQUESTS_PER_HOUR {
                return Ok(None);
            }
            tx.execute(
                "INSERT INTO grants (caller, kind, reason, scope, duration_secs, state, requested_at, \
                 tool, arguments, args_sha256) VALUES (?1, 'call', ?2, ?3, ?4, 'pending', ?5, ?6, ?7, ?8)",
                params![
                    caller_text,
                    format!("one call of {tool}"),
                    scope_json,
                    expiry,
                    now,
                    tool,
                    canonical,
                    digest
                ],
            )?;
            let id = tx.last_insert_rowid();
            tx.commit()?;
            Ok(Some((id, Found::Requested)))
        })?;
        let Some((id, found)) = found else {
            return Err(GrantError::TooMany {
                max_pending,
                per_hour: REQUESTS_PER_HOUR,
            });
        };
        let grant = self.get(id)?.ok_or(GrantError::NotYours(GrantId(id)))?;
        match found {
            Found::Used => {
                self.event(GrantEvent::Used, &grant, &caller_text);
                Ok(CallApproval::Used(grant))
            }
            Found::Requested => {
                self.event(GrantEvent::Requested, &grant, &caller_text);
                Ok(CallApproval::Pending(grant))
            }
            Found::Pending => Ok(CallApproval::Pending(grant)),
        }
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
                "SELECT {COLUMNS} FROM grants WHERE caller = ?1 AND kind != 'call' \
                 AND state = 'approved' AND expires_at > ?2"
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

    fn pending_id(found: CallApproval) -> i64 {
        match found {
            CallApproval::Pending(g) => g.grant_id,
            CallApproval::Used(g) => panic!("used {g:?}"),
        }
    }

    #[test]
    fn an_approval_is_bound_to_caller_tool_and_arguments_and_used_once() {
        let dir = tempfile::tempdir().unwrap();
        let g = grants(dir.path());
        let alice = Caller::OAuth {
            client_id: "client-a".into(),
            subject: "alice".into(),
        };
        let args = serde_json::json!({"unit": "nginx.service", "action": "restart"});
        let id = pending_id(g.approve_each(&alice, "service.action", &args).unwrap());
        // Asking again for the same call finds the same request: no second one.
        let same: serde_json::Value =
            serde_json::from_str(r#"{ "action": "restart", "unit": "nginx.service" }"#).unwrap();
        assert_eq!(
            pending_id(g.approve_each(&alice, "service.action", &same).unwrap()),
            id
        );
        let shown = g.get(id).unwrap().unwrap();
        assert_eq!(shown.kind, GrantKind::Call);
        assert_eq!(shown.tool.as_deref(), Some("service.action"));
        assert_eq!(shown.arguments.as_ref(), Some(&args));
        assert_eq!(
            shown.args_sha256.as_deref(),
            Some(crate::canonical::canonical_sha256(&args).as_str())
        );
        assert_eq!(shown.duration_secs, 15 * 60);
        g.approve(id, "local:0", None).unwrap();
        // Other arguments, another tool, another caller: each needs its own approval.
        let other_args = serde_json::json!({"unit": "nginx.service", "action": "stop"});
        assert_ne!(
            pending_id(
                g.approve_each(&alice, "service.action", &other_args)
                    .unwrap()
            ),
            id
        );
        assert_ne!(
            pending_id(g.approve_each(&alice, "docker.action", &args).unwrap()),
            id
        );
        let bob = Caller::OAuth {
            client_id: "client-a".into(),
            subject: "bob".into(),
        };
        assert_ne!(
            pending_id(g.approve_each(&bob, "service.action", &args).unwrap()),
            id
        );
        // An approval is no grant: it covers nothing behind `grant`.
        assert!(g.covering(&alice, "service.action").unwrap().is_none());
        // The identical call uses it, once.
        match g.approve_each(&alice, "service.action", &same).unwrap() {
            CallApproval::Used(used) => {
                assert_eq!(used.grant_id, id);
                assert_eq!(used.state, GrantState::Used);
                assert!(used.used_at.is_some());
            }
            other => panic!("{other:?}"),
        }
        let again = pending_id(g.approve_each(&alice, "service.action", &args).unwrap());
        assert_ne!(again, id, "a used approval is not used twice");
        // Used approvals are history, not current.
        assert!(g.list(None, true).unwrap().iter().all(|x| x.grant_id != id));
    }

    #[test]
    fn a_grant_never_stands_in_for_an_approval_of_one_call() {
        let dir = tempfile::tempdir().unwrap();
        let g = grants(dir.path());
        let ci = Caller::Bearer("ci".into());
        let grant = g
            .request(
                &ci,
                GrantKind::RootAccess,
                "x",
                vec!["*".into()],
                Duration::from_secs(60),
            )
            .unwrap();
        g.approve(grant.grant_id, "local:0", None).unwrap();
        let args = serde_json::json!({});
        assert!(matches!(
            g.approve_each(&ci, "file.write", &args).unwrap(),
            CallApproval::Pending(_)
        ));
    }

    #[test]
    fn two_identical_calls_racing_for_one_approval_run_once() {
        let dir = tempfile::tempdir().unwrap();
        let g = Arc::new(grants(dir.path()));
        // A second process on the same store races too (a `robota-mcpd --stdio`).
        let other = Arc::new(grants(dir.path()));
        let args = serde_json::json!({"path": "/etc/x", "content": "y"});
        for round in 0..20 {
            // A caller per round: each round makes requests, within the hourly bound.
            let c = Caller::Local(round);
            let id = pending_id(g.approve_each(&c, "file.write", &args).unwrap());
            g.approve(id, "local:0", None).unwrap();
            let barrier = Arc::new(std::sync::Barrier::new(8));
            let handles: Vec<_> = (0..8)
                .map(|i| {
                    let g = if i % 2 == 0 { g.clone() } else { other.clone() };
                    let (c, args, barrier) = (c.clone(), args.clone(), barrier.clone());
                    std::thread::spawn(move || {
                        barrier.wait();
                        matches!(
                            g.approve_each(&c, "file.write", &args).unwrap(),
                            CallApproval::Used(_)
                        )
                    })
                })
                .collect();
            let used = handles
                .into_iter()
                .map(|h| h.join().unwrap())
                .filter(|&used| used)
                .count();
            assert_eq!(used, 1, "round {round}");
            // The losers made one new pending request between them; withdraw it.
            for grant in g.list(None, true).unwrap() {
                g.revoke(grant.grant_id, "local:0").unwrap();
            }
        }
    }

    #[test]
    fn approvals_expire_and_share_the_request_bounds() {
        let dir = tempfile::tempdir().unwrap();
        let g = grants(dir.path());
        let c = Caller::Local(1);
        let args = serde_json::json!({"n": 1});
        let id = pending_id(g.approve_each(&c, "job.start", &args).unwrap());
        g.approve(id, "local:0", Some(Duration::from_secs(60)))
            .unwrap();
        g.store
            .with(|conn| conn.execute("UPDATE grants SET expires_at = ?1", [now() - 1]))
            .unwrap();
        assert_eq!(g.get(id).unwrap().unwrap().state, GrantState::Expired);
        assert_ne!(
            pending_id(g.approve_each(&c, "job.start", &args).unwrap()),
            id,
            "an expired approval is not used"
        );
        // Pending requests of both kinds count toward one bound.
        for n in 2..=8 {
            g.approve_each(&c, "job.start", &serde_json::json!({"n": n}))
                .unwrap();
        }
        assert!(matches!(
            g.approve_each(&c, "job.start", &serde_json::json!({"n": 99})),
            Err(GrantError::TooMany { .. })
        ));
        assert!(matches!(
            g.request(
                &c,
                GrantKind::Elevation,
                "x",
                vec!["a".into()],
                Duration::from_secs(60)
            ),
            Err(GrantError::TooMany { .. })
        ));
        // Arguments too large to show an operator cannot be approved one by one.
        let c2 = Caller::Local(2);
        let huge = serde_json::json!({"content": "x".repeat(MAX_APPROVAL_ARGS)});
        assert!(matches!(
            g.approve_each(&c2, "file.write", &huge),
            Err(GrantError::Invalid(_))
        ));
    }

    #[test]
    fn approvals_survive_a_reopened_store() {
        let dir = tempfile::tempdir().unwrap();
        let c = Caller::Local(3);
        let args = serde_json::json!({"a": [1, 2]});
        let id = {
            let g = grants(dir.path());
            let id = pending_id(g.approve_each(&c, "file.write", &args).unwrap());
            g.approve(id, "local:0", None).unwrap();
            id
        };
        let g = grants(dir.path());
        match g.approve_each(&c, "file.write", &args).unwrap() {
            CallApproval::Used(used) => assert_eq!(used.grant_id, id),
            other => panic!("{other:?}"),
        }
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
