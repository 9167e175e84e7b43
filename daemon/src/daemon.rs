//! The daemon: owns the session and every listener, and runs the lifecycle.
//!
//! Start: bind the control socket and the metrics listener, attach a fresh session to the
//! loopback transport and start it, then announce `READY=1`. Serve until SIGTERM/SIGINT
//! or `stop` (drain, `STOPPING=1`), restarting on SIGHUP or `restart` (`RELOADING=1`,
//! stop, fresh session + bearers, attach, start, `READY=1`).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Instant, SystemTime};

use parking_lot::RwLock;
use robota_proto::{
    BearerInfo, CarrierStatus, Command, ErrorCode, Reply, Response, Secret, Status,
};
use tokio::net::TcpListener;
use tokio::net::unix::OwnedWriteHalf;
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

use crate::audit::{Audit, Carrier as CarrierName};
use crate::bearer::{BearerError, HOST_LABEL, unix_secs};
use crate::carrier::loopback::LoopbackCarrier;
use crate::carrier::remote::RemoteCarrier;
use crate::config::Config;
use crate::control::{self, ControlApi, Peer};
use crate::host::Host;
use crate::metrics::{self, Metrics};
use crate::notify;
use crate::session::{HostView, RuntimeTools, Session, SessionError, TurnSubmission};
use crate::transport::{LifecycleError, McpTransport};

/// How long a reload waits for the key-set fetch it starts.
const RELOAD_KEYS_WAIT: std::time::Duration = std::time::Duration::from_secs(5);
/// How long `keys-refresh` waits (discovery and a fetch may take 3 × 10 s; the CLI's own
/// timeout is 30 s).
const OPERATOR_KEYS_WAIT: std::time::Duration = std::time::Duration::from_secs(25);

type Loopback = McpTransport<Session, LoopbackCarrier>;
type Remote = McpTransport<Session, RemoteCarrier>;

#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    #[error(transparent)]
    Session(SessionError),
    #[error("control socket")]
    Control(#[source] control::ControlError),
    #[error("cannot bind the metrics listener on {addr}")]
    Metrics {
        addr: std::net::SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("the loopback carrier on {addr} failed to start")]
    Loopback {
        addr: std::net::SocketAddr,
        #[source]
        source: LifecycleError,
    },
    #[error("the remote carrier on {addr} failed to start")]
    Remote {
        addr: std::net::SocketAddr,
        #[source]
        source: LifecycleError,
    },
    #[error("the remote carrier's verifier is misconfigured")]
    VerifierConfig(#[source] crate::oauth::jwt::BuildError),
    #[error("the remote carrier's verifier has no keys")]
    VerifierKeys(#[source] crate::oauth::jwt::LoadError),
    #[error("the audit store")]
    Audit(#[source] crate::audit::OpenError),
    #[error("the job, grant and idempotency store")]
    Store(#[source] crate::store::StoreError),
    #[error("cannot install signal handlers")]
    Signals(#[source] std::io::Error),
}

impl DaemonError {
    /// Configuration-class errors get the configuration exit code.
    pub fn exit_code(&self) -> i32 {
        match self {
            DaemonError::Session(_)
            | DaemonError::Loopback {
                source: LifecycleError::WireNames(_),
                ..
            }
            | DaemonError::Remote {
                source: LifecycleError::WireNames(_),
                ..
            } => crate::exit::CONFIG,
            DaemonError::VerifierConfig(_) => crate::exit::CONFIG,
            _ => crate::exit::RUNTIME,
        }
    }
}

/// What the main loop is asked to do by the control plane.
enum Op {
    Stop,
    Restart(oneshot::Sender<Result<Status, String>>),
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum State {
    Starting,
    Serving,
    Restarting,
    Stopping,
}

impl State {
    fn as_str(self) -> &'static str {
        match self {
            State::Starting => "starting",
            State::Serving => "serving",
            State::Restarting => "restarting",
            State::Stopping => "stopping",
        }
    }
}

/// Everything the control plane and `system.health` read.
struct Core {
    config: Config,
    started: Instant,
    audit: Arc<Audit>,
    host: Arc<Host>,
    metrics: Metrics,
    state: RwLock<State>,
    generation: AtomicU64,
    session: RwLock<Option<Arc<Session>>>,
    loopback: Option<Loopback>,
    remote: Option<Remote>,
    metrics_addr: RwLock<Option<String>>,
    control_path: String,
    /// Ends every MCP session relayed over the control socket; replaced at each attach.
    relays: RwLock<CancellationToken>,
    ops: mpsc::Sender<Op>,
}

/// The carriers `system.health` reports, without holding the daemon alive.
struct Board(std::sync::Weak<Core>);

impl HostView for Board {
    fn carriers(&self) -> Vec<(String, String)> {
        self.0
            .upgrade()
            .map(|core| core.carriers())
            .unwrap_or_default()
    }
}

impl Core {
    fn carriers(&self) -> Vec<(String, String)> {
        let mut out = Vec::new();
        if let Some(addr) = self.loopback.as_ref().and_then(|l| l.address()) {
            out.push((CarrierName::Loopback.as_str().to_owned(), addr));
        }
        if let Some(addr) = self.remote.as_ref().and_then(|r| r.address()) {
            out.push((CarrierName::Remote.as_str().to_owned(), addr));
        }
        if let Some(addr) = self.metrics_addr.read().clone() {
            out.push(("metrics".to_owned(), addr));
        }
        out.push((
            CarrierName::Control.as_str().to_owned(),
            self.control_path.clone(),
        ));
        out
    }

    fn status(&self) -> Status {
        let session = self.session.read().clone();
        let carrier = |name: CarrierName, address: String| CarrierStatus {
            name: name.as_str().to_owned(),
            address,
            public_url: None,
            admitted: self.metrics.admitted_count(name),
            refused: self.metrics.refused_count(name),
        };
        let mut carriers = Vec::new();
        if let Some(addr) = self.loopback.as_ref().and_then(|l| l.address()) {
            carriers.push(carrier(CarrierName::Loopback, addr));
        }
        if let Some(remote) = &self.remote
            && let Some(addr) = remote.address()
        {
            carriers.push(CarrierStatus {
                public_url: Some(remote.carrier().public_url().to_owned()),
                ..carrier(CarrierName::Remote, addr)
            });
        }
        if let Some(addr) = self.metrics_addr.read().clone() {
            carriers.push(CarrierStatus {
                name: "metrics".into(),
                address: addr,
                public_url: None,
                admitted: 0,
                refused: 0,
            });
        }
        carriers.push(carrier(CarrierName::Control, self.control_path.clone()));
        Status {
            version: env!("CARGO_PKG_VERSION").to_owned(),
            pid: std::process::id(),
            uptime_secs: self.started.elapsed().as_secs(),
            state: self.state.read().as_str().to_owned(),
            generation: self.generation.load(Ordering::Relaxed),
            carriers,
            catalog_size: session.as_ref().map_or(0, |s| s.catalog().len()),
            submission_tool: session.as_ref().map_or_else(
                || self.config.session.submission_tool.clone(),
                |s| s.submission_tool().name.clone(),
            ),
            active_turn: session.as_ref().is_some_and(|s| s.turn_active()),
            running_jobs: self.host.jobs.running_count(),
            pending_grants: self.host.grants.pending_count().unwrap_or(0),
            bearer_count: self
                .loopback
                .as_ref()
                .map_or(0, |l| l.carrier().bearers().len()),
            refusals_last_hour: self.audit.last_hour(SystemTime::now()),
            key_set: self
                .remote
                .as_ref()
                .map(|r| Box::new(r.carrier().verifier().key_set())),
        }
    }

    fn ready_status(&self) -> String {
        let carriers: Vec<String> = self
            .carriers()
            .into_iter()
            .map(|(n, a)| format!("{n}={a}"))
            .collect();
        format!("serving {}", carriers.join(" "))
    }

    /// Fresh session attached to the loopback transport and started.
    async fn attach_and_start(self: &Arc<Self>) -> Result<(), DaemonError> {
        let session = Arc::new(
            Session::new(
                &self.config,
                Arc::new(Board(Arc::downgrade(self))),
                self.host.clone(),
                self.metrics.clone(),
            )
            .map_err(DaemonError::Session)?,
        );
        if let (Some(loopback), Some(config)) = (&self.loopback, &self.config.loopback) {
            let failed = |source| DaemonError::Loopback {
                addr: config.listen,
                source,
            };
            loopback.attach(session.clone()).map_err(failed)?;
            let addr = loopback.start().await.map_err(failed)?;
            tracing::info!(address = %addr, path = %config.path, "loopback carrier serving");
        }
        if let (Some(remote), Some(config)) = (&self.remote, &self.config.remote) {
            let failed = |source| DaemonError::Remote {
                addr: config.listen,
                source,
            };
            remote.attach(session.clone()).map_err(failed)?;
            let addr = remote.start().await.map_err(failed)?;
            tracing::info!(address = %addr, public_url = %config.public_url.as_str(), "remote carrier serving");
        }
        *self.session.write() = Some(session);
        Ok(())
    }

    async fn restart(self: &Arc<Self>) -> Result<(), DaemonError> {
        *self.state.write() = State::Restarting;
        notify::reloading();
        tracing::info!("restarting: fresh attach, new bearers");
        self.reload_keys().await;
        self.stop_carriers().await;
        *self.session.write() = None;
        // A fresh attach ends the relayed sessions of the old one.
        std::mem::replace(&mut *self.relays.write(), CancellationToken::new()).cancel();
        self.attach_and_start().await?;
        self.generation.fetch_add(1, Ordering::Relaxed);
        *self.state.write() = State::Serving;
        notify::ready(&self.ready_status());
        Ok(())
    }

    /// A reload re-reads the remote verifier's keys (the verifier outlives restarts), while
    /// the old carriers still serve. A slow issuer delays the restart by at most
    /// [`RELOAD_KEYS_WAIT`]; the fetch then goes on and `status` shows how it ends.
    async fn reload_keys(&self) {
        let Some(remote) = &self.remote else { return };
        let refresh = remote
            .carrier()
            .verifier()
            .refresh(metrics::RefreshTrigger::Reload);
        match tokio::time::timeout(RELOAD_KEYS_WAIT, refresh).await {
            Ok(Ok(())) => {}
            // The verifier has logged why; the keys held stay in use.
            Ok(Err(_)) => {}
            Err(_) => tracing::warn!(
                wait = %humantime::format_duration(RELOAD_KEYS_WAIT),
                "the key-set fetch of the reload is still running; restarting without waiting for it"
            ),
        }
    }

    /// `keys-refresh`: fetch now and answer with the key set, or with why the fetch failed.
    async fn keys_reply(&self) -> Response {
        let Some(remote) = &self.remote else {
            return Response::error(ErrorCode::Unavailable, "the remote carrier is disabled");
        };
        let verifier = remote.carrier().verifier();
        let refresh = verifier.refresh(metrics::RefreshTrigger::Operator);
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

    async fn stop_carriers(&self) {
        let loopback = async {
            if let Some(l) = &self.loopback {
                l.stop().await;
            }
        };
        let remote = async {
            if let Some(r) = &self.remote {
                r.stop().await;
            }
        };
        tokio::join!(loopback, remote);
    }

    fn audit_reply(
        &self,
        since: Option<u64>,
        reason: Option<String>,
        after_seq: Option<u64>,
        limit: Option<u32>,
    ) -> Response {
        const CEILING: u32 = 1000;
        let query = crate::audit::Query {
            since,
            reason,
            after_seq,
            limit: limit.unwrap_or(CEILING).min(CEILING) as usize,
        };
        let (records, last_seq) = self.audit.query(&query);
        Response::ok(Reply::Audit { records, last_seq })
    }

    /// Jobs and grants, as the operator (`local:<uid>` of the control peer).
    fn host_reply(&self, command: Command, peer: Peer) -> Response {
        const CEILING: u32 = 1000;
        let operator = format!("local:{}", peer.uid);
        let store_failed = |e: crate::store::StoreError| {
            tracing::error!(error = %e, "store failure");
            Response::error(
                ErrorCode::Internal,
                "the store failed; see the daemon's log",
            )
        };
        let tool_failed = |e: crate::session::ToolError| {
            let code = match e.code {
                crate::session::ToolErrorCode::InvalidArguments => ErrorCode::NotFound,
                crate::session::ToolErrorCode::Unavailable => ErrorCode::Unavailable,
                _ => ErrorCode::Internal,
            };
            Response::error(code, e.message)
        };
        let decided = |r: Result<crate::grants::Grant, crate::grants::DecideError>| match r {
            Ok(grant) => Response::ok(Reply::Grant { grant }),
            Err(crate::grants::DecideError::NotFound(id)) => {
                Response::error(ErrorCode::NotFound, format!("there is no grant {id}"))
            }
            Err(e @ crate::grants::DecideError::WrongState { .. }) => {
                Response::error(ErrorCode::Conflict, e.to_string())
            }
            Err(e @ crate::grants::DecideError::BadDuration(_)) => {
                Response::error(ErrorCode::BadRequest, e.to_string())
            }
            Err(crate::grants::DecideError::Store(e)) => store_failed(e),
        };
        let (jobs, grants) = (&self.host.jobs, &self.host.grants);
        match command {
            Command::JobsList { owner, limit } => {
                let limit = limit.unwrap_or(CEILING).min(CEILING) as usize;
                match jobs.list(owner.as_deref(), limit) {
                    Ok(jobs) => Response::ok(Reply::Jobs { jobs }),
                    Err(e) => store_failed(e),
                }
            }
            Command::JobCancel { job_id } => match jobs.cancel(None, job_id) {
                Ok(job) => {
                    tracing::info!(job_id, by = %operator, "job cancel requested by the operator");
                    Response::ok(Reply::Job { job })
                }
                Err(e) => tool_failed(e),
            },
            Command::GrantsList { all } => match grants.list(None, !all) {
                Ok(grants) => Response::ok(Reply::Grants { grants }),
                Err(e) => store_failed(e),
            },
            Command::GrantApprove {
                grant_id,
                duration_secs,
            } => decided(grants.approve(
                grant_id,
                &operator,
                duration_secs.map(std::time::Duration::from_secs),
            )),
            Command::GrantDeny { grant_id } => decided(grants.deny(grant_id, &operator)),
            Command::GrantRevoke { grant_id } => decided(grants.revoke(grant_id, &operator)),
            _ => Response::error(ErrorCode::Internal, "not a job or grant command"),
        }
    }

    fn bearer_reply(&self, command: Command) -> Response {
        let Some(loopback) = &self.loopback else {
            return Response::error(ErrorCode::Unavailable, "the loopback carrier is disabled");
        };
        let bearers = loopback.carrier().bearers();
        let failed = |e: BearerError| {
            let code = match e {
                BearerError::Exists(_) => ErrorCode::Conflict,
                BearerError::NotFound(_) => ErrorCode::NotFound,
                BearerError::Full => ErrorCode::Unavailable,
                BearerError::BadLabel(_) | BearerError::Reserved | BearerError::BadTtl => {
                    ErrorCode::BadRequest
                }
            };
            Response::error(code, e.to_string())
        };
        match command {
            Command::BearerIssue {
                label: None,
                ttl_secs: None,
            } => Response::ok(Reply::Bearer {
                label: HOST_LABEL.into(),
                secret: Secret(bearers.host_secret()),
                expires_at: None,
            }),
            Command::BearerIssue {
                label: None,
                ttl_secs: Some(_),
            } => Response::error(
                ErrorCode::BadRequest,
                "the host bearer has no expiry; give --label to mint an extra bearer with a TTL",
            ),
            Command::BearerIssue {
                label: Some(label),
                ttl_secs,
            } => match bearers.issue(&label, ttl_secs.map(std::time::Duration::from_secs)) {
                Ok((secret, expires)) => {
                    tracing::info!(label = %label, "bearer issued");
                    Response::ok(Reply::Bearer {
                        label,
                        secret: Secret(secret),
                        expires_at: expires.map(unix_secs),
                    })
                }
                Err(e) => failed(e),
            },
            Command::BearerList => Response::ok(Reply::Bearers {
                bearers: bearers
                    .list()
                    .into_iter()
                    .map(|b| BearerInfo {
                        label: b.label,
                        created_at: unix_secs(b.created),
                        expires_at: b.expires.map(unix_secs),
                        last_used_at: b.last_used.map(unix_secs),
                    })
                    .collect(),
            }),
            Command::BearerRevoke { label } => match bearers.revoke(&label) {
                Ok(()) => {
                    tracing::info!(label = %label, "bearer revoked");
                    Response::ok(Reply::Revoked { label })
                }
                Err(e) => failed(e),
            },
            Command::BearerRotate => {
                let secret = bearers.rotate();
                tracing::info!("host bearer rotated");
                Response::ok(Reply::Bearer {
                    label: HOST_LABEL.into(),
                    secret: Secret(secret),
                    expires_at: None,
                })
            }
            _ => Response::error(ErrorCode::Internal, "not a bearer command"),
        }
    }
}

/// The control plane's view of the daemon.
struct Api(Arc<Core>);

impl ControlApi for Api {
    async fn handle(&self, command: Command, peer: Peer) -> Response {
        let core = &self.0;
        tracing::debug!(uid = peer.uid, command = ?command, "control command");
        match command {
            Command::Status => Response::ok(Reply::Status(core.status())),
            Command::Stop => {
                tracing::info!(uid = peer.uid, "stop requested over the control socket");
                match core.ops.send(Op::Stop).await {
                    Ok(()) => Response::ok(Reply::Stopping),
                    Err(_) => {
                        Response::error(ErrorCode::Unavailable, "the daemon is already stopping")
                    }
                }
            }
            Command::Restart => {
                tracing::info!(uid = peer.uid, "restart requested over the control socket");
                let (tx, rx) = oneshot::channel();
                if core.ops.send(Op::Restart(tx)).await.is_err() {
                    return Response::error(ErrorCode::Unavailable, "the daemon is stopping");
                }
                match rx.await {
                    Ok(Ok(status)) => Response::ok(Reply::Restarted { status }),
                    Ok(Err(message)) => Response::error(ErrorCode::Internal, message),
                    Err(_) => Response::error(
                        ErrorCode::Unavailable,
                        "the daemon stopped during the restart",
                    ),
                }
            }
            Command::Audit {
                since,
                reason,
                after_seq,
                limit,
            } => core.audit_reply(since, reason, after_seq, limit),
            Command::KeysRefresh => {
                tracing::info!(
                    uid = peer.uid,
                    "key-set refresh requested over the control socket"
                );
                core.keys_reply().await
            }
            command @ (Command::JobsList { .. }
            | Command::JobCancel { .. }
            | Command::GrantsList { .. }
            | Command::GrantApprove { .. }
            | Command::GrantDeny { .. }
            | Command::GrantRevoke { .. }) => core.host_reply(command, peer),
            other => core.bearer_reply(other),
        }
    }

    async fn serve_mcp(
        &self,
        reader: control::ControlReader,
        mut writer: OwnedWriteHalf,
        peer: Peer,
    ) {
        let core = &self.0;
        let session = core.session.read().clone();
        let stdio = &core.config.stdio;
        let names = session.as_ref().map(|s| {
            crate::mcp::WireNames::build(
                s.catalog(),
                s.submission_tool(),
                stdio.wire_names,
                &stdio.aliases,
            )
        });
        let (session, names) = match (session, names) {
            (Some(session), Some(Ok(names))) => (session, names),
            (_, Some(Err(e))) => {
                let refusal = Response::error(ErrorCode::Internal, e.to_string());
                let _ = control::write_frame(&mut writer, &refusal).await;
                return;
            }
            _ => {
                let refusal = Response::error(
                    ErrorCode::Unavailable,
                    "no session is attached (the daemon is restarting)",
                );
                let _ = control::write_frame(&mut writer, &refusal).await;
                return;
            }
        };
        if control::write_frame(&mut writer, &Response::ok(Reply::Mcp))
            .await
            .is_err()
        {
            return;
        }
        core.metrics.admitted(CarrierName::Stdio);
        tracing::info!(
            uid = peer.uid,
            "MCP session relayed over the control socket"
        );
        let caller = Some(crate::session::Caller::Local(peer.uid));
        let wire = crate::mcp::Wire {
            result_limit: core.config.limits.tool_result,
            metrics: core.metrics.clone(),
        };
        let server = crate::mcp::McpServer::new(
            session,
            names,
            Arc::new(crate::mcp::InFlight::default()),
            wire,
            caller,
        );
        let ended = core.relays.read().child_token();
        let limit = usize::try_from(core.config.limits.request_body).unwrap_or(usize::MAX);
        let transport = crate::carrier::lines::transport(reader, writer, limit);
        match rmcp::ServiceExt::serve_with_ct(server, transport, ended).await {
            Ok(running) => {
                let _ = running.waiting().await;
            }
            Err(e) => tracing::debug!(error = %e, "relayed MCP session ended during start-up"),
        }
    }
}

/// The shipped JWT/JWKS verifier for `[remote]`, built (every configuration check, no
/// network) but without keys.
pub fn verifier_config(
    remote: &crate::config::RemoteConfig,
    state_dir: &std::path::Path,
    metrics: Metrics,
) -> Result<crate::oauth::jwt::JwtVerifier, crate::oauth::jwt::BuildError> {
    use crate::oauth::jwt::{JwtConfig, JwtVerifier};
    let config = JwtConfig {
        issuer: remote.issuer.clone(),
        audiences: remote.audiences.clone(),
        algorithms: remote.algorithms.clone(),
        required_scopes: remote.scopes.clone(),
        allowed_subjects: remote.allowed_subjects.clone(),
        allowed_clients: remote.allowed_clients.clone(),
        keys: remote.keys.clone(),
        ca_file: remote.ca_file.clone(),
        cache_path: state_dir.join("jwks-cache.json"),
        start_without_keys: remote.start_without_keys,
        refresh: remote.key_refresh,
    };
    JwtVerifier::build(config, metrics)
}

/// The verifier with its keys loaded (or the cache, or nothing when `start_without_keys`)
/// and its refresh schedule running (until the verifier is dropped).
async fn build_verifier(
    remote: &crate::config::RemoteConfig,
    state_dir: &std::path::Path,
    metrics: Metrics,
) -> Result<Arc<dyn crate::oauth::Verifier>, DaemonError> {
    let verifier =
        verifier_config(remote, state_dir, metrics).map_err(DaemonError::VerifierConfig)?;
    verifier.load().await.map_err(DaemonError::VerifierKeys)?;
    drop(verifier.spawn_schedule());
    Ok(Arc::new(verifier))
}

/// Run the daemon until a stop. `shutdown` is an extra stop trigger (tests, embedding).
pub async fn run(config: Config, shutdown: CancellationToken) -> Result<(), DaemonError> {
    notify::status("starting");
    let audit = Arc::new(Audit::open(&config.state_dir).map_err(DaemonError::Audit)?);
    let metrics = Metrics::new();
    let host = Host::open(&config, audit.clone(), metrics.clone()).map_err(DaemonError::Store)?;

    let control_socket = control::bind(&config.control).map_err(DaemonError::Control)?;
    let metrics_listener = match config.metrics {
        Some(addr) => Some(
            TcpListener::bind(addr)
                .await
                .map_err(|source| DaemonError::Metrics { addr, source })?,
        ),
        None => None,
    };
    let wire = crate::mcp::Wire {
        result_limit: config.limits.tool_result,
        metrics: metrics.clone(),
    };
    let loopback = config.loopback.clone().map(|l| {
        McpTransport::new(
            Arc::new(LoopbackCarrier::new(
                l,
                config.limits,
                audit.clone(),
                metrics.clone(),
            )),
            wire.clone(),
        )
    });
    let remote = match &config.remote {
        Some(r) => {
            let verifier = build_verifier(r, &config.state_dir, metrics.clone()).await?;
            let keys = verifier.key_set();
            tracing::info!(
                issuer = %r.issuer,
                keys = keys.keys,
                from = keys.location.as_deref().unwrap_or("-"),
                cached = keys.from_cache,
                "remote verifier ready"
            );
            Some(McpTransport::new(
                Arc::new(RemoteCarrier::new(
                    r.clone(),
                    config.limits,
                    verifier,
                    audit.clone(),
                    metrics.clone(),
                )),
                wire.clone(),
            ))
        }
        None => None,
    };
    let (ops_tx, mut ops) = mpsc::channel(4);
    let core = Arc::new(Core {
        control_path: control_socket.path().display().to_string(),
        config,
        started: Instant::now(),
        audit: audit.clone(),
        host,
        metrics: metrics.clone(),
        state: RwLock::new(State::Starting),
        generation: AtomicU64::new(0),
        session: RwLock::new(None),
        loopback,
        remote,
        metrics_addr: RwLock::new(None),
        relays: RwLock::new(CancellationToken::new()),
        ops: ops_tx,
    });

    let mut sigterm = signal(SignalKind::terminate()).map_err(DaemonError::Signals)?;
    let mut sigint = signal(SignalKind::interrupt()).map_err(DaemonError::Signals)?;
    let mut sighup = signal(SignalKind::hangup()).map_err(DaemonError::Signals)?;

    core.attach_and_start().await?;

    let listeners = CancellationToken::new();
    let mut tasks = Vec::new();
    if let Some(listener) = metrics_listener {
        let addr = listener
            .local_addr()
            .map_or_else(|_| "unknown".into(), |a| a.to_string());
        tracing::info!(address = %addr, "metrics listener serving /metrics");
        *core.metrics_addr.write() = Some(addr);
        let bounds = crate::config::HttpLimits {
            max_connections: 8,
            max_connections_per_address: None,
            max_in_flight: 8,
            max_header_bytes: 16 * 1024,
            header_timeout: std::time::Duration::from_secs(5),
            body_timeout: std::time::Duration::from_secs(5),
            idle_timeout: std::time::Duration::from_secs(30),
        };
        let options = crate::carrier::http::Options {
            name: metrics::Listener::Metrics,
            bounds,
            tls: None,
            shared_peers: Vec::new(),
            ipv6_prefix: 64,
            metrics: metrics.clone(),
        };
        tasks.push(tokio::spawn(crate::carrier::http::serve(
            listener,
            options,
            metrics::Endpoint {
                metrics: metrics.clone(),
                audit: core.audit.clone(),
            },
            listeners.clone(),
        )));
    }
    tracing::info!(path = %core.control_path, "control socket listening");
    tasks.push(tokio::spawn(control::serve(
        control_socket,
        core.config.control.clone(),
        Arc::new(Api(core.clone())),
        audit,
        metrics,
        listeners.clone(),
    )));

    *core.state.write() = State::Serving;
    notify::ready(&core.ready_status());
    tracing::info!(version = env!("CARGO_PKG_VERSION"), "ready");

    // The store forgets what is older than its retention, hourly (also at start).
    tasks.push(tokio::spawn({
        let store = core.host.store.clone();
        let stop = listeners.clone();
        async move {
            let mut hourly = tokio::time::interval(crate::store::PRUNE_EVERY);
            hourly.tick().await;
            loop {
                tokio::select! {
                    () = stop.cancelled() => break,
                    _ = hourly.tick() => {
                        let store = store.clone();
                        match tokio::task::spawn_blocking(move || store.prune()).await {
                            Ok(Err(e)) => tracing::error!(error = %e, "cannot prune the store"),
                            Err(e) => tracing::error!(error = %e, "the store pruner failed"),
                            Ok(Ok(())) => {}
                        }
                    }
                }
            }
        }
    }));

    let mut watchdog = notify::watchdog_interval().map(tokio::time::interval);
    let result = loop {
        let tick = async {
            match watchdog.as_mut() {
                Some(interval) => {
                    interval.tick().await;
                }
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = sigterm.recv() => { tracing::info!("SIGTERM: stopping"); break Ok(()); }
            _ = sigint.recv() => { tracing::info!("SIGINT: stopping"); break Ok(()); }
            () = shutdown.cancelled() => break Ok(()),
            _ = sighup.recv() => {
                if let Err(e) = core.restart().await {
                    break Err(e);
                }
            }
            op = ops.recv() => match op {
                Some(Op::Stop) | None => break Ok(()),
                Some(Op::Restart(reply)) => {
                    let result = core.restart().await;
                    let _ = reply.send(match &result {
                        Ok(()) => Ok(core.status()),
                        Err(e) => Err(crate::error_chain(e)),
                    });
                    if let Err(e) = result {
                        break Err(e);
                    }
                }
            },
            () = tick => notify::watchdog(),
        }
    };

    *core.state.write() = State::Stopping;
    notify::stopping();
    core.relays.read().cancel();
    core.stop_carriers().await;
    listeners.cancel();
    for task in tasks {
        let _ = task.await;
    }
    core.host.jobs.shutdown().await;
    core.audit.close();
    tracing::info!("stopped");
    result
}
