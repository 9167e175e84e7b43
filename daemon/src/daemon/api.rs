//! The control API: one handler per command group, reached through one exhaustive
//! `match` (a new command does not compile until it is handled here).

use std::sync::Arc;
use std::time::Duration;

use robota_proto::{BearerInfo, Command, ErrorCode, Reply, Response, Secret};
use tokio::net::unix::OwnedWriteHalf;
use tokio::sync::oneshot;

use super::core::{Core, Op, Reloaded, RestartFailure};
use crate::bearer::{BearerError, HOST_LABEL, unix_secs};
use crate::control::{ControlApi, ControlReader, Peer};
use crate::grants::{DecideError, Grant};
use crate::jobs::JobError;
use crate::store::StoreError;
use crate::vocab::JobId;

/// How long `keys-refresh` waits (discovery and a fetch may take 3 × 10 s; the CLI's own
/// timeout is 30 s).
const OPERATOR_KEYS_WAIT: Duration = Duration::from_secs(25);
/// Most records one list answer carries.
const CEILING: u32 = 1000;

/// The control plane's view of the daemon.
pub(super) struct Api(pub Arc<Core>);

impl ControlApi for Api {
    async fn handle(&self, command: Command, peer: Peer) -> Response {
        let core = &self.0;
        tracing::debug!(uid = peer.uid, command = ?command, "control command");
        match command {
            Command::Status => Response::ok(Reply::Status(core.status())),
            Command::Stop => lifecycle::stop(core, peer).await,
            Command::Reload => lifecycle::reload(core, false, peer).await,
            Command::Restart => lifecycle::reload(core, true, peer).await,
            Command::BearerIssue { label, ttl_secs } => bearers::issue(core, label, ttl_secs),
            Command::BearerList => bearers::list(core),
            Command::BearerRevoke { label } => bearers::revoke(core, label),
            Command::BearerRotate => bearers::rotate(core),
            Command::Audit {
                since,
                reason,
                after_seq,
                limit,
            } => audit(core, since, reason, after_seq, limit),
            Command::JobsList { owner, limit } => jobs::list(core, owner, limit),
            Command::JobCancel { job_id } => jobs::cancel(core, JobId(job_id), peer),
            Command::GrantsList { all } => grants::list(core, all),
            Command::GrantApprove {
                grant_id,
                duration_secs,
            } => grants::approve(core, grant_id, duration_secs, peer),
            Command::GrantShow { grant_id } => grants::show(core, grant_id),
            Command::GrantDeny { grant_id } => grants::deny(core, grant_id, peer),
            Command::GrantRevoke { grant_id } => grants::revoke(core, grant_id, peer),
            Command::KeysRefresh => keys::refresh(core).await,
            Command::Upstreams => Response::ok(Reply::Upstreams {
                upstreams: core.upstreams_status(),
            }),
            Command::UpstreamRestart { name } => upstream_restart(core, &name, peer).await,
            Command::UpstreamDiff { name } => upstream_diff(core, &name).await,
            Command::UpstreamApprove { name, surface } => {
                upstream_approve(core, &name, &surface, peer).await
            }
            // The control socket switches the connection over before a handler sees it.
            Command::Mcp => Response::error(
                ErrorCode::BadRequest,
                "`mcp` switches a connection to MCP; it is not answered as a command",
            ),
        }
    }

    async fn serve_mcp(&self, reader: ControlReader, writer: OwnedWriteHalf, peer: Peer) {
        let core = &self.0;
        let session = core.session.read().clone();
        let ended = core.relays.read().child_token();
        let served = core.served();
        crate::carrier::relay::serve(
            session,
            &served.plan.config,
            core.metrics.clone(),
            reader,
            writer,
            peer.uid,
            ended,
        )
        .await;
    }
}

/// The operator behind a control connection.
fn operator(peer: Peer) -> String {
    format!("local:{}", peer.uid)
}

fn store_failed(e: StoreError) -> Response {
    tracing::error!(error = %e, "store failure");
    if crate::store::is_write_failure(&e) {
        Response::error(
            ErrorCode::Unavailable,
            "the daemon cannot write its store now (is the state directory's disk full?); see `robota-mcpctl status`",
        )
    } else {
        Response::error(
            ErrorCode::Internal,
            "the store failed; see the daemon's log",
        )
    }
}

/// `audit`: the newest matching records.
fn audit(
    core: &Core,
    since: Option<u64>,
    reason: Option<String>,
    after_seq: Option<u64>,
    limit: Option<u32>,
) -> Response {
    use crate::vocab::{GrantEvent, Reason, UpstreamEvent};
    if let Some(r) = reason.as_deref()
        && Reason::parse(r).is_none()
        && GrantEvent::parse(r).is_none()
        && UpstreamEvent::parse(r).is_none()
    {
        let known: Vec<&str> = Reason::ALL
            .iter()
            .map(|r| r.as_str())
            .chain(GrantEvent::ALL.iter().map(|e| e.as_str()))
            .chain(UpstreamEvent::ALL.iter().map(|e| e.as_str()))
            .collect();
        return Response::error(
            ErrorCode::BadRequest,
            format!(
                "\"{r}\" is not an audit reason; use one of: {}",
                known.join(", ")
            ),
        );
    }
    let query = crate::audit::Query {
        since,
        reason,
        after_seq,
        limit: limit.unwrap_or(CEILING).min(CEILING) as usize,
    };
    let (records, last_seq) = core.audit.query(&query);
    Response::ok(Reply::Audit { records, last_seq })
}

/// `upstream-restart NAME`: that upstream of the current session, now.
async fn upstream_restart(core: &Core, name: &str, peer: Peer) -> Response {
    let upstreams = core.upstreams.read().clone();
    let Some(upstreams) = upstreams else {
        return Response::error(
            ErrorCode::Unavailable,
            "no session is attached (restarting?)",
        );
    };
    tracing::info!(uid = peer.uid, upstream = %name, "upstream restart requested over the control socket");
    match upstreams.restart(name).await {
        Some(upstream) if upstream.state == crate::vocab::UpstreamState::Up.as_str() => {
            Response::ok(Reply::Upstream { upstream })
        }
        Some(upstream) => Response::error(
            ErrorCode::Unavailable,
            format!(
                "upstream {name} was started again but is not up: {}{}; it keeps trying \
                 (robota-mcpctl upstreams shows when)",
                upstream.state,
                upstream
                    .last_error
                    .map(|e| format!(" ({e})"))
                    .unwrap_or_default()
            ),
        ),
        None => Response::error(ErrorCode::NotFound, format!("no upstream named {name:?}")),
    }
}

/// The upstream named `name` of the current session, or the error to answer.
fn upstream_named(core: &Core, name: &str) -> Result<Arc<crate::upstream::Upstream>, Response> {
    let upstreams = core.upstreams.read().clone();
    let Some(upstreams) = upstreams else {
        return Err(Response::error(
            ErrorCode::Unavailable,
            "no session is attached (restarting?)",
        ));
    };
    upstreams
        .get(name)
        .cloned()
        .ok_or_else(|| Response::error(ErrorCode::NotFound, format!("no upstream named {name:?}")))
}

/// `upstream-diff NAME`: how its surface differs from the approved one.
async fn upstream_diff(core: &Core, name: &str) -> Response {
    let upstream = match upstream_named(core, name) {
        Ok(upstream) => upstream,
        Err(refused) => return refused,
    };
    // Reads the pin and the kept list: off the async workers, like an approval.
    match tokio::task::spawn_blocking(move || upstream.diff()).await {
        Ok(diff) => Response::ok(Reply::UpstreamDiff(diff)),
        Err(_) => Response::error(ErrorCode::Internal, "the diff did not finish"),
    }
}

/// `upstream-approve NAME`: its surface as listed now becomes the approved one.
async fn upstream_approve(core: &Core, name: &str, surface: &str, peer: Peer) -> Response {
    use crate::upstream::Refusal;
    let upstream = match upstream_named(core, name) {
        Ok(upstream) => upstream,
        Err(refused) => return refused,
    };
    let by = format!("local:{}", peer.uid);
    let reviewed = surface.to_owned();
    // Reads and writes files and may rebuild the catalog: off the async workers.
    match tokio::task::spawn_blocking(move || upstream.approve(&reviewed, &by)).await {
        Ok(Ok(upstream)) => Response::ok(Reply::Upstream { upstream }),
        Ok(Err(Refusal::Changed(why))) => Response::error(ErrorCode::Conflict, why),
        Ok(Err(Refusal::Unavailable(why))) => Response::error(ErrorCode::Unavailable, why),
        Err(_) => Response::error(ErrorCode::Internal, "the approval did not finish"),
    }
}

/// `stop`, `reload`, `restart`: asked of the main loop, which owns the lifecycle.
mod lifecycle {
    use super::*;

    pub(super) async fn stop(core: &Core, peer: Peer) -> Response {
        tracing::info!(uid = peer.uid, "stop requested over the control socket");
        match core.ops.send(Op::Stop).await {
            Ok(()) => Response::ok(Reply::Stopping),
            Err(_) => Response::error(ErrorCode::Unavailable, "the daemon is already stopping"),
        }
    }

    /// `reload`, or `restart` (`fresh`: a new host bearer whatever changed).
    pub(super) async fn reload(core: &Core, fresh: bool, peer: Peer) -> Response {
        let what = if fresh { "restart" } else { "reload" };
        tracing::info!(uid = peer.uid, "{what} requested over the control socket");
        let (reply, rx) = oneshot::channel();
        if core.ops.send(Op::Reload { fresh, reply }).await.is_err() {
            return Response::error(ErrorCode::Unavailable, "the daemon is stopping");
        }
        match rx.await {
            Ok(Ok(Reloaded { status, .. })) if fresh => Response::ok(Reply::Restarted { status }),
            Ok(Ok(Reloaded {
                status,
                host_bearer_kept,
            })) => Response::ok(Reply::Reloaded {
                status,
                host_bearer_kept,
            }),
            Ok(Err(RestartFailure::Refused(problems))) => Response::error(
                ErrorCode::InvalidConfig,
                format!(
                    "the configuration{} was not reloaded (the running one stays):\n  {}",
                    core.served()
                        .plan
                        .origin
                        .as_ref()
                        .map(|o| format!(" {}", o.source))
                        .unwrap_or_default(),
                    problems.join("\n  ")
                ),
            ),
            Ok(Err(RestartFailure::Failed(message))) => {
                Response::error(ErrorCode::Internal, message)
            }
            Err(_) => Response::error(
                ErrorCode::Unavailable,
                format!("the daemon stopped during the {what}"),
            ),
        }
    }
}

/// `bearer issue|list|revoke|rotate`: the loopback carrier's bearers.
mod bearers {
    use super::*;
    use crate::host::BearerOpError;

    /// The answer when the loopback carrier is disabled.
    fn disabled(core: &Core) -> Option<Response> {
        core.served()
            .loopback
            .is_none()
            .then(|| Response::error(ErrorCode::Unavailable, "the loopback carrier is disabled"))
    }

    fn failed(e: BearerOpError) -> Response {
        let code = match &e {
            BearerOpError::Bearer(BearerError::Exists(_)) => ErrorCode::Conflict,
            BearerOpError::Bearer(BearerError::NotFound(_)) => ErrorCode::NotFound,
            BearerOpError::Bearer(BearerError::Full) => ErrorCode::Unavailable,
            BearerOpError::Bearer(
                BearerError::BadLabel(_) | BearerError::Reserved | BearerError::BadTtl,
            ) => ErrorCode::BadRequest,
            BearerOpError::Store(store) => {
                tracing::error!(error = %store, "cannot keep a bearer in the store");
                if crate::store::is_write_failure(store) {
                    ErrorCode::Unavailable
                } else {
                    ErrorCode::Internal
                }
            }
        };
        Response::error(code, e.to_string())
    }

    pub(super) fn issue(core: &Core, label: Option<String>, ttl_secs: Option<u64>) -> Response {
        if let Some(refusal) = disabled(core) {
            return refusal;
        }
        match (label, ttl_secs) {
            (None, None) => Response::ok(Reply::Bearer {
                label: HOST_LABEL.into(),
                secret: Secret(core.host.bearers.host_secret()),
                expires_at: None,
            }),
            (None, Some(_)) => Response::error(
                ErrorCode::BadRequest,
                "the host bearer has no expiry; give --label to mint an extra bearer with a TTL",
            ),
            (Some(label), ttl_secs) => {
                match core
                    .host
                    .issue_bearer(&label, ttl_secs.map(Duration::from_secs))
                {
                    Ok(issued) => {
                        tracing::info!(label = %label, kept = issued.durable.is_some(), "bearer issued");
                        Response::ok(Reply::Bearer {
                            label,
                            secret: Secret(issued.secret),
                            expires_at: issued.expires.map(unix_secs),
                        })
                    }
                    Err(e) => failed(e),
                }
            }
        }
    }

    pub(super) fn list(core: &Core) -> Response {
        if let Some(refusal) = disabled(core) {
            return refusal;
        }
        Response::ok(Reply::Bearers {
            bearers: core
                .host
                .bearers
                .list()
                .into_iter()
                .map(|b| BearerInfo {
                    label: b.label,
                    created_at: unix_secs(b.created),
                    expires_at: b.expires.map(unix_secs),
                    last_used_at: b.last_used.map(unix_secs),
                })
                .collect(),
        })
    }

    pub(super) fn revoke(core: &Core, label: String) -> Response {
        if let Some(refusal) = disabled(core) {
            return refusal;
        }
        match core.host.revoke_bearer(&label) {
            Ok(()) => {
                tracing::info!(label = %label, "bearer revoked");
                Response::ok(Reply::Revoked { label })
            }
            Err(e) => failed(e),
        }
    }

    pub(super) fn rotate(core: &Core) -> Response {
        if let Some(refusal) = disabled(core) {
            return refusal;
        }
        match core.host.rotate_bearers() {
            Ok((secret, revoked)) => {
                tracing::info!(
                    revoked = revoked.len(),
                    "bearers rotated: a new host bearer, every labelled one revoked"
                );
                Response::ok(Reply::Bearer {
                    label: HOST_LABEL.into(),
                    secret: Secret(secret),
                    expires_at: None,
                })
            }
            Err(e) => failed(e),
        }
    }
}

/// `jobs list|cancel`, as the operator.
mod jobs {
    use super::*;

    /// The control-protocol edge of the job service.
    fn failed(e: JobError) -> Response {
        match e {
            JobError::NotFound(id) => {
                Response::error(ErrorCode::NotFound, format!("there is no job {id}"))
            }
            JobError::Busy(_) | JobError::Elsewhere(_) => {
                Response::error(ErrorCode::Unavailable, e.to_string())
            }
            JobError::Store(e) => store_failed(e),
        }
    }

    pub(super) fn list(core: &Core, owner: Option<String>, limit: Option<u32>) -> Response {
        let limit = limit.unwrap_or(CEILING).min(CEILING) as usize;
        match core.host.jobs.list(owner.as_deref(), limit) {
            Ok(jobs) => Response::ok(Reply::Jobs { jobs }),
            Err(e) => store_failed(e),
        }
    }

    pub(super) fn cancel(core: &Core, job_id: JobId, peer: Peer) -> Response {
        match core.host.jobs.cancel(None, job_id) {
            // The state read before the cancel: it had ended already, nothing was done.
            Ok(job) if job.state.finished() => Response::error(
                ErrorCode::Conflict,
                format!(
                    "job {} already ended ({}); nothing to cancel",
                    job_id.0,
                    job.state.as_str()
                ),
            ),
            Ok(job) => {
                tracing::info!(job_id = job_id.0, by = %operator(peer), "job cancel requested by the operator");
                Response::ok(Reply::Job { job })
            }
            Err(e) => failed(e),
        }
    }
}

/// `grants list|show|approve|deny|revoke`, as the operator.
mod grants {
    use super::*;

    /// Arguments of a call approval larger than this (as canonical JSON) are left out of
    /// `grants-list` (`grant-show` has them), so a list of many stays small.
    pub(super) const LIST_ARGUMENTS_BYTES: usize = 1024;

    /// The control-protocol edge of operator decisions.
    fn decided(result: Result<Grant, DecideError>) -> Response {
        match result {
            Ok(grant) => Response::ok(Reply::Grant {
                grant: Box::new(grant),
            }),
            Err(DecideError::NotFound(id)) => {
                Response::error(ErrorCode::NotFound, format!("there is no grant {id}"))
            }
            Err(e @ DecideError::WrongState { .. }) => {
                Response::error(ErrorCode::Conflict, e.to_string())
            }
            Err(e @ DecideError::BadDuration(_)) => {
                Response::error(ErrorCode::BadRequest, e.to_string())
            }
            Err(DecideError::Store(e)) => store_failed(e),
        }
    }

    pub(super) fn list(core: &Core, all: bool) -> Response {
        match core.host.grants.list(None, !all) {
            Ok(mut grants) => {
                for grant in &mut grants {
                    if grant.arguments.as_ref().is_some_and(|a| {
                        crate::canonical::canonical_json(a).len() > LIST_ARGUMENTS_BYTES
                    }) {
                        grant.arguments = None;
                    }
                }
                Response::ok(Reply::Grants { grants })
            }
            Err(e) => store_failed(e),
        }
    }

    pub(super) fn show(core: &Core, grant_id: i64) -> Response {
        match core.host.grants.get(grant_id) {
            Ok(Some(grant)) => Response::ok(Reply::Grant {
                grant: Box::new(grant),
            }),
            Ok(None) => {
                Response::error(ErrorCode::NotFound, format!("there is no grant {grant_id}"))
            }
            Err(e) => store_failed(e),
        }
    }

    pub(super) fn approve(
        core: &Core,
        grant_id: i64,
        duration_secs: Option<u64>,
        peer: Peer,
    ) -> Response {
        decided(core.host.grants.approve(
            grant_id,
            &operator(peer),
            duration_secs.map(Duration::from_secs),
        ))
    }

    pub(super) fn deny(core: &Core, grant_id: i64, peer: Peer) -> Response {
        decided(core.host.grants.deny(grant_id, &operator(peer)))
    }

    pub(super) fn revoke(core: &Core, grant_id: i64, peer: Peer) -> Response {
        decided(core.host.grants.revoke(grant_id, &operator(peer)))
    }
}

/// `keys-refresh`: fetch the remote verifier's keys now.
mod keys {
    use super::*;
    use crate::vocab::RefreshTrigger;

    pub(super) async fn refresh(core: &Core) -> Response {
        let served = core.served();
        let Some(remote) = &served.remote else {
            return Response::error(ErrorCode::Unavailable, "the remote carrier is disabled");
        };
        let verifier = remote.carrier().verifier();
        let refresh = verifier.refresh(RefreshTrigger::Operator);
        match tokio::time::timeout(OPERATOR_KEYS_WAIT, refresh).await {
            Ok(Ok(())) => Response::ok(Reply::KeySet(verifier.key_set())),
            Ok(Err(error)) => {
                let held = verifier.key_set().keys;
                Response::error(
                    ErrorCode::Unavailable,
                    format!(
                        "the key-set refresh failed: {error}; the {held} keys held stay in use"
                    ),
                )
            }
            Err(_) => Response::error(
                ErrorCode::Unavailable,
                format!(
                    "the key-set fetch did not end within {}; it goes on, and `robota-mcpctl status` shows how it ends",
                    humantime::format_duration(OPERATOR_KEYS_WAIT)
                ),
            ),
        }
    }
}
