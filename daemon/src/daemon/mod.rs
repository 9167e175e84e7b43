//! The daemon, in three steps: [`Plan`] (the configuration checked, nothing bound),
//! bind (store, audit, control socket, metrics listener, carriers), serve (until SIGTERM,
//! SIGINT or `stop`; SIGHUP, `reload` or `restart` reload: the configuration read and
//! planned again, then served on a fresh attach — with a new host bearer for `restart` or
//! a changed loopback carrier — or, when it is invalid, nothing changes). `--stdio` is
//! the same plan served on stdin/stdout.

mod api;
pub mod checks;
mod core;
mod plan;
mod status;

use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Instant;

use parking_lot::{Mutex, RwLock};
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use self::api::Api;
use self::core::{Core, Op, Reloaded, RestartFailure, Served, State};
pub use self::plan::{LoadError, Origin, Plan, PlanError};
use crate::audit::Audit;
use crate::carrier::Sockets;
use crate::carrier::stdio::StdioCarrier;
use crate::catalog::HostView;
use crate::control;
use crate::health::Health;
use crate::host::Host;
use crate::mcp::Wire;
use crate::notify;
use crate::transport::{LifecycleError, McpTransport};

#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    #[error(transparent)]
    Plan(#[from] PlanError),
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
    #[error("the remote carrier's verifier has no keys")]
    VerifierKeys(#[source] crate::oauth::jwt::LoadError),
    /// A file of a secret the configuration names is unusable: the configuration's to fix.
    #[error("remote.introspection.client_secret_file")]
    VerifierSecret(#[source] crate::oauth::introspect::SecretFileError),
    #[error("the audit store")]
    Audit(#[source] crate::audit::OpenError),
    #[error("the job, grant and idempotency store")]
    Store(#[source] crate::store::StoreError),
    #[error("cannot install signal handlers")]
    Signals(#[source] std::io::Error),
    /// The state directory is missing, or this process cannot use it or what is in it.
    #[error("the state directory {} {problem}", path.display())]
    StateDir {
        path: std::path::PathBuf,
        problem: String,
    },
    #[error("the stdio carrier failed to start")]
    Stdio {
        #[source]
        source: LifecycleError,
    },
}

impl DaemonError {
    /// Configuration-class errors get the configuration exit code.
    pub fn exit_code(&self) -> i32 {
        match self {
            // TLS files that cannot be read may appear later (a certificate not issued
            // yet): a runtime failure, so the service manager may try again.
            DaemonError::Plan(PlanError::Tls(_)) => crate::exit::RUNTIME,
            DaemonError::Plan(_)
            | DaemonError::Loopback {
                source: LifecycleError::WireNames(_),
                ..
            }
            | DaemonError::Remote {
                source: LifecycleError::WireNames(_),
                ..
            }
            | DaemonError::Stdio {
                source: LifecycleError::WireNames(_),
            }
            | DaemonError::VerifierSecret(_) => crate::exit::CONFIG,

            _ => crate::exit::RUNTIME,
        }
    }
}

/// The `/metrics` listener's bounds: a scraper needs little.
const METRICS_BOUNDS: crate::config::HttpLimits = crate::config::HttpLimits {
    max_connections: 8,
    max_connections_per_address: None,
    max_in_flight: 8,
    max_in_flight_per_caller: 8,
    max_header_bytes: 16 * 1024,
    header_timeout: std::time::Duration::from_secs(5),
    body_timeout: std::time::Duration::from_secs(5),
    idle_timeout: std::time::Duration::from_secs(30),
};

/// Run the daemon until a stop. `shutdown` is an extra stop trigger (tests, embedding).
pub async fn run(plan: Plan, shutdown: CancellationToken) -> Result<(), DaemonError> {
    let bound = bind(plan).await?;
    serve(bound, shutdown).await
}

/// A daemon started in this process (tests, embedding): bound and serving.
pub struct Running {
    /// Every listener, by name (`loopback`, `remote`, `metrics`, `control`) and address.
    pub places: Vec<(String, String)>,
    shutdown: CancellationToken,
    task: tokio::task::JoinHandle<Result<(), DaemonError>>,
}

impl Running {
    /// The address of the listener named `name`.
    pub fn address(&self, name: &str) -> Option<&str> {
        self.places
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, a)| a.as_str())
    }

    /// Stop (as SIGTERM would) and wait for the drain.
    pub async fn stop(self) -> Result<(), DaemonError> {
        self.shutdown.cancel();
        self.task
            .await
            .unwrap_or_else(|e| panic!("the daemon task failed: {e}"))
    }
}

/// Bind everything, then serve in a task; resolves once every listener is bound.
pub async fn start(plan: Plan) -> Result<Running, DaemonError> {
    let bound = bind(plan).await?;
    let shutdown = CancellationToken::new();
    let core = bound.core.clone();
    let task = tokio::spawn(serve(bound, shutdown.clone()));
    let places = core
        .places()
        .into_iter()
        .map(|p| (p.name.to_owned(), p.address))
        .collect();
    Ok(Running {
        places,
        shutdown,
        task,
    })
}

/// What `bind` produced: everything is listening, nothing is served yet.
struct Bound {
    core: Arc<Core>,
    ops: mpsc::Receiver<Op>,
    control: control::ControlSocket,
}

/// Open the store and audit, bind every listener, start the carriers on a fresh session
/// and the metrics listener.
async fn bind(mut plan: Plan) -> Result<Bound, DaemonError> {
    notify::status("starting");
    let verifier = plan.verifier.take();
    let config = &plan.config;
    let metrics = plan.metrics.clone();
    let health = Arc::new(Health::default());
    check_state_dir(&config.state_dir)?;
    let audit =
        Arc::new(Audit::open(&config.state_dir, health.clone()).map_err(DaemonError::Audit)?);
    let host = Host::open(config, audit.clone(), metrics.clone(), health.clone())
        .map_err(DaemonError::Store)?;
    let control_socket = control::bind(&config.control).map_err(DaemonError::Control)?;
    let sockets = Arc::new(Sockets::default());
    if let Some(addr) = config.metrics {
        sockets
            .reserve(crate::vocab::Listener::Metrics, addr)
            .map_err(|source| DaemonError::Metrics { addr, source })?;
    }
    let verifier = match (&config.remote, verifier) {
        (Some(r), Some(verifier)) => {
            verifier
                .read_secrets()
                .map_err(DaemonError::VerifierSecret)?;
            Some(
                core::ready_verifier(verifier, &r.issuer)
                    .await
                    .map_err(DaemonError::VerifierKeys)?,
            )
        }
        _ => None,
    };
    let (loopback, remote) = core::carriers(
        &plan,
        core::Kept {
            audit: &audit,
            host: &host,
            metrics: &metrics,
            sockets: &sockets,
            verifier,
            throttle: None,
        },
    );
    let (ops_tx, ops) = mpsc::channel(4);
    let core = Arc::new(Core {
        control_path: control_socket.path().display().to_string(),
        control: Arc::new(RwLock::new(plan.config.control.clone())),
        metrics,
        started: Instant::now(),
        audit,
        host,
        health,
        state: RwLock::new(State::Starting),
        generation: AtomicU64::new(0),
        session: RwLock::new(None),
        upstreams: RwLock::new(None),
        served: RwLock::new(Arc::new(Served {
            plan,
            loopback,
            remote,
        })),
        sockets,
        scraper: Mutex::new(None),
        handed: Mutex::new(Vec::new()),
        retired: Mutex::new(Vec::new()),
        relays: RwLock::new(CancellationToken::new()),
        ops: ops_tx,
        last_reload: Mutex::new(None),
    });
    core.attach_and_start(true).await?;
    if let Some(addr) = core.served().plan.config.metrics {
        core.serve_metrics(addr)?;
    }
    Ok(Bound {
        core,
        ops,
        control: control_socket,
    })
}

/// Serve until a stop; reload on SIGHUP, `reload` or `restart`.
async fn serve(bound: Bound, shutdown: CancellationToken) -> Result<(), DaemonError> {
    let Bound {
        core,
        mut ops,
        control: control_socket,
    } = bound;
    let mut sigterm = signal(SignalKind::terminate()).map_err(DaemonError::Signals)?;
    let mut sigint = signal(SignalKind::interrupt()).map_err(DaemonError::Signals)?;
    let mut sighup = signal(SignalKind::hangup()).map_err(DaemonError::Signals)?;

    let listeners = CancellationToken::new();
    let mut tasks = Vec::new();
    tracing::info!(path = %core.control_path, "control socket listening");
    tasks.push(tokio::spawn(control::serve(
        control_socket,
        core.control.clone(),
        Arc::new(Api(core.clone())),
        core.audit.clone(),
        core.metrics.clone(),
        listeners.clone(),
    )));
    tasks.push(tokio::spawn(prune(
        core.host.store.clone(),
        listeners.clone(),
    )));
    tasks.push(tokio::spawn(probe_store(
        core.host.store.clone(),
        core.health.clone(),
        listeners.clone(),
    )));

    core.serving();
    tracing::info!(version = env!("CARGO_PKG_VERSION"), "ready");

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
                if let Err(e) = core.reload(false).await {
                    break Err(e);
                }
            }
            op = ops.recv() => match op {
                Some(Op::Stop) | None => break Ok(()),
                Some(Op::Reload { fresh, reply }) => match core.reload(fresh).await {
                    Ok(Ok(host_bearer_kept)) => {
                        let _ = reply.send(Ok(Reloaded { status: core.status(), host_bearer_kept }));
                    }
                    Ok(Err(problems)) => {
                        let _ = reply.send(Err(RestartFailure::Refused(problems)));
                    }
                    Err(e) => {
                        let _ = reply.send(Err(RestartFailure::Failed(crate::error_chain(&e))));
                        break Err(e);
                    }
                },
            },
            () = tick => notify::watchdog(),
        }
    };

    // The drain, in order: relayed sessions, carriers (each drains its connections under
    // its grace), the metrics listener, the other listeners and tasks, jobs, the audit
    // writer.
    *core.state.write() = State::Stopping;
    notify::stopping();
    core.relays.read().cancel();
    core.stop_carriers().await;
    core.stop_upstreams().await;
    core.stop_metrics().await;
    listeners.cancel();
    for task in tasks {
        let _ = task.await;
    }
    core.host.jobs.shutdown().await;
    core.audit.close();
    tracing::info!("stopped");
    result
}

/// The files an earlier run leaves in the state directory, and whether the daemon writes
/// them in place (the key cache is only read, and replaced by a rename). The package's
/// postinst gives the same files back to the daemon's user.
const STATE_FILES: [(&str, bool); 6] = [
    (crate::audit::FILE_NAME, true),
    ("audit.jsonl.tmp", true),
    (crate::store::FILE_NAME, true),
    ("robota.db-wal", true),
    ("robota.db-shm", true),
    ("jwks-cache.json", false),
];

/// Before the audit and the store open their files: the state directory exists (created
/// 0700 if its parent lets this process), this process may create files in it, and it may
/// read and write what an earlier run left there. Otherwise the error names the cause
/// (missing, someone else's, root-owned left-overs from a run as root) and the fix, not a
/// bare `Permission denied` on the first file opened.
fn check_state_dir(dir: &std::path::Path) -> Result<(), DaemonError> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};

    use nix::fcntl::{AT_FDCWD, AtFlags};
    use nix::unistd::{AccessFlags, Group, Uid, User, faccessat};
    let fail = |problem: String| DaemonError::StateDir {
        path: dir.to_path_buf(),
        problem,
    };
    let uid = nix::unistd::geteuid();
    let user_of = |uid: u32| match User::from_uid(Uid::from_raw(uid)) {
        Ok(Some(user)) => format!("{} (uid {uid})", user.name),
        _ => format!("uid {uid}"),
    };
    let me = user_of(uid.as_raw());
    let name = |found: Option<String>, id: u32| found.unwrap_or_else(|| id.to_string());
    let owner = name(
        User::from_uid(uid).ok().flatten().map(|u| u.name),
        uid.as_raw(),
    );
    let gid = nix::unistd::getegid();
    let group = name(
        Group::from_gid(gid).ok().flatten().map(|g| g.name),
        gid.as_raw(),
    );
    let mode = |meta: &std::fs::Metadata| meta.permissions().mode() & 0o7777;
    let may = |path: &std::path::Path, how| faccessat(AT_FDCWD, path, how, AtFlags::AT_EACCESS);

    let meta = match std::fs::metadata(dir) {
        Ok(meta) => meta,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir)
                .map_err(|e| {
                    fail(format!(
                        "does not exist, and {me}, who runs the daemon, cannot create it ({e}): \
                         install -d -o {owner} -g {group} -m 0700 {} (the package's postinst does), \
                         or set [daemon] state_dir",
                        dir.display()
                    ))
                });
        }
        Err(e) => return Err(fail(format!("cannot be inspected: {e}"))),
    };
    if !meta.is_dir() {
        return Err(fail("is not a directory".into()));
    }
    let chown = format!("chown -R {owner}:{group} {}", dir.display());
    match may(dir, AccessFlags::W_OK | AccessFlags::X_OK) {
        Ok(()) => {}
        Err(nix::errno::Errno::EROFS) => {
            return Err(fail(
                "is on a file system that is read-only for this process (under systemd: \
                 StateDirectory= or ReadWritePaths=)"
                    .into(),
            ));
        }
        Err(_) if meta.uid() != uid.as_raw() => {
            return Err(fail(format!(
                "is owned by {}, not by {me} who runs the daemon, and its mode {:04o} does not \
                 let the daemon create files in it: {chown}",
                user_of(meta.uid()),
                mode(&meta)
            )));
        }
        Err(_) => {
            return Err(fail(format!(
                "has mode {:04o}, which does not let {me} who runs the daemon create files in it: \
                 chmod 0700 {}",
                mode(&meta),
                dir.display()
            )));
        }
    }
    let (mut unusable, mut mine) = (Vec::new(), Vec::new());
    for (file, written) in STATE_FILES {
        let path = dir.join(file);
        let Ok(meta) = std::fs::metadata(&path) else {
            continue; // absent: the daemon creates it
        };
        let how = if written {
            AccessFlags::R_OK | AccessFlags::W_OK
        } else {
            AccessFlags::R_OK
        };
        if may(&path, how).is_ok() {
            continue;
        }
        let hint = if meta.uid() == 0 {
            " (left by a run as root?)"
        } else {
            ""
        };
        unusable.push(format!(
            "{} is owned by {}, mode {:04o}{hint}",
            path.display(),
            user_of(meta.uid()),
            mode(&meta)
        ));
        if meta.uid() == uid.as_raw() {
            mine.push(path.display().to_string());
        }
    }
    if unusable.is_empty() {
        return Ok(());
    }
    let fix = if mine.len() == unusable.len() {
        format!("chmod u+rw {}", mine.join(" "))
    } else {
        chown
    };
    Err(fail(format!(
        "holds files that {me}, who runs the daemon, cannot read and write: {}: {fix}",
        unusable.join("; ")
    )))
}

/// The store forgets what is older than its retention, hourly (also at start).
async fn prune(store: Arc<crate::store::Store>, stop: CancellationToken) {
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

/// While the store fails, a small write every few seconds finds out when it works again,
/// so `status` is not left `degraded` on an idle daemon.
async fn probe_store(
    store: Arc<crate::store::Store>,
    health: Arc<Health>,
    stop: CancellationToken,
) {
    let mut every = tokio::time::interval(std::time::Duration::from_secs(5));
    loop {
        tokio::select! {
            () = stop.cancelled() => break,
            _ = every.tick() => {
                if health.faults().contains_key(&crate::vocab::StatePart::Store) {
                    let store = store.clone();
                    let _ = tokio::task::spawn_blocking(move || store.probe()).await;
                }
            }
        }
    }
}

/// `system.health` on stdio: the one carrier.
struct StdioOnly;

impl HostView for StdioOnly {
    fn carriers(&self) -> Vec<(String, String)> {
        vec![("stdio".into(), "stdio".into())]
    }
}

/// The plan served on stdin/stdout for the client that launched us: no control socket,
/// no HTTP. The store is shared with a daemon on the same state directory (SQLite
/// locking makes that safe); refusals and grant events are logged, not persisted.
pub async fn run_stdio(plan: Plan) -> Result<(), DaemonError> {
    let config = &plan.config;
    check_state_dir(&config.state_dir)?;
    let audit = Arc::new(Audit::new());
    let host = Host::open(config, audit, plan.metrics.clone(), Default::default())
        .map_err(DaemonError::Store)?;
    let (session, upstreams) = core::start_session(&plan, &host, Arc::new(StdioOnly)).await?;
    let transport = McpTransport::new(
        Arc::new(StdioCarrier {
            config: config.stdio.clone(),
            request_limit: config.limits.request_body,
        }),
        Wire {
            result_limit: config.limits.tool_result,
            metrics: plan.metrics.clone(),
        },
    );
    let failed = |source| DaemonError::Stdio { source };
    transport.attach(session).map_err(failed)?;
    transport.start().await.map_err(failed)?;
    let ended = transport.ended().unwrap_or_default();
    let mut sigterm = signal(SignalKind::terminate()).map_err(DaemonError::Signals)?;
    tokio::select! {
        () = ended.cancelled() => {}
        _ = sigterm.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
    transport.stop().await;
    upstreams.stop().await;
    // Jobs this process started end with it and record how (else they would wait as
    // `running` until some process settles them as `outcome-unknown`).
    host.jobs.shutdown().await;
    Ok(())
}
