//! Downstream MCP servers (docs/design.md §13): each `[upstreams.<name>]` is supervised
//! here — a stdio child (shared, or one per call) or an HTTP backend — and is one catalog
//! [`Source`] whose tools are `<name>.<tool>`. When its tool list changes, the catalog is
//! rebuilt into a new generation.
//!
//! Architecture invariants: the session does not know this module (imported tools are
//! catalog entries like any other, behind the same policy); nothing an upstream sends is
//! trusted (names checked, annotations never read by policy, every message bounded);
//! a slow or broken upstream never holds back the daemon's start or any other tool; a
//! call that may have had an effect is never retried.

pub mod cgroup;
pub mod confine;
pub mod http;
pub mod mounts;
pub mod pin;
pub mod protocol;
pub mod stdio;
pub mod tool;

use std::os::unix::fs::DirBuilderExt as _;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant, SystemTime};

use parking_lot::{Mutex, RwLock};
use robota_proto::{RefusedTool, ToolChange, UpstreamDiff, UpstreamStatus};
use serde_json::{Map, Value};
use tokio::sync::{Notify, Semaphore, watch};
use tokio_util::sync::CancellationToken;

use self::http::{HttpBounds, HttpLink};
use self::pin::{Drift, Pinned, Surface};
use self::protocol::{Answer, CallError, Listed, Negotiated, Rpc, Unread};
use self::stdio::{ChildLink, ChildSpec, STOP_GRACE, StderrRate};
pub use self::stdio::{Launcher, exec_child};
use self::tool::Listing;
use crate::audit::Audit;
use crate::bearer::unix_secs;
use crate::budget::Budget;
use crate::catalog::{Catalog, HostTool, Progress, Source};
use crate::config::{Children, UpstreamConfig, UpstreamEndpoint};
use crate::metrics::Metrics;
use crate::vocab::{UpstreamEvent, UpstreamKind, UpstreamState};

/// A child up this long without failing counts as healthy: the backoff starts over.
const HEALTHY: Duration = Duration::from_secs(60);
/// Per-call children of one upstream running at once; one more call is `busy`.
const MAX_PER_CALL: usize = 16;
/// Largest bearer file read.
const MAX_BEARER_FILE: u64 = 4096;

/// What every upstream shares: how children start, where tool lists are kept, metrics.
#[derive(Clone)]
pub struct Context {
    pub launcher: Launcher,
    /// Where the last-known tool lists live (`<state_dir>/upstreams/`); none: kept nowhere
    /// (`check-config`).
    pub state_dir: Option<PathBuf>,
    /// Whether a list read from the upstream is written back there.
    pub persist: bool,
    /// Where a child's caches and home go (`<cache_dir>/<upstream>/`, as HOME,
    /// XDG_CACHE_HOME and npm's cache), unless its `env` says otherwise: not in the state
    /// directory, which is backed up and holds the daemon's own files.
    pub cache_dir: Option<PathBuf>,
    /// What no confined child may reach: the daemon's own directories and secret files
    /// ([`confine`]).
    pub hidden: Vec<PathBuf>,
    pub metrics: Metrics,
    /// What every upstream's answers and tool lists share (`[limits] upstream_memory`).
    pub memory: Budget,
    pub audit: Arc<Audit>,
}

/// Every configured upstream of one session generation.
pub struct Upstreams {
    list: Vec<Arc<Upstream>>,
}

impl Upstreams {
    /// Nothing starts yet; each upstream's last-known tool list (if the state directory
    /// holds one) is what it offers until it is up.
    pub fn new(configs: &[UpstreamConfig], context: Context) -> Self {
        let context = Arc::new(context);
        let list = configs
            .iter()
            .map(|config| Upstream::new(config.clone(), context.clone()))
            .collect();
        Self { list }
    }

    pub fn is_empty(&self) -> bool {
        self.list.is_empty()
    }

    /// One catalog source per upstream.
    pub fn sources(&self) -> Vec<Arc<dyn Source>> {
        self.list
            .iter()
            .map(|u| Arc::new(UpstreamSource(u.clone())) as Arc<dyn Source>)
            .collect()
    }

    /// Starts every upstream at once and waits until each is up or failed, `bound` at most;
    /// those still not ready are `down` (they keep trying in the background).
    pub async fn start(&self, bound: Duration) {
        let deadline = tokio::time::Instant::now() + bound;
        for upstream in &self.list {
            upstream.spawn();
        }
        let waits = self.list.iter().map(|u| async move {
            let mut attempts = u.attempts.subscribe();
            let first = attempts.wait_for(|n| *n > 0);
            if tokio::time::timeout_at(deadline, first).await.is_err() {
                u.not_ready_in_time(bound);
            }
        });
        futures_util::future::join_all(waits).await;
    }

    /// Tool list changes rebuild `catalog` from now on.
    pub fn attach(&self, catalog: &Arc<Catalog>) {
        for upstream in &self.list {
            *upstream.catalog.lock() = Arc::downgrade(catalog);
        }
    }

    pub fn status(&self) -> Vec<UpstreamStatus> {
        self.list.iter().map(|u| u.status()).collect()
    }

    /// Restarts one upstream now (a shared child is stopped and started again; an HTTP
    /// backend reconnected); answers once that attempt has ended, or after its connect
    /// bound. `None`: no upstream of that name.
    pub async fn restart(&self, name: &str) -> Option<UpstreamStatus> {
        let upstream = self.get(name)?;
        let mut attempts = upstream.attempts.subscribe();
        let before = *attempts.borrow_and_update();
        upstream.wake.notify_one();
        let limit = upstream.config.connect_timeout + STOP_GRACE + Duration::from_secs(1);
        let _ = tokio::time::timeout(limit, attempts.wait_for(|n| *n > before)).await;
        Some(upstream.status())
    }

    /// One upstream by name.
    pub fn get(&self, name: &str) -> Option<&Arc<Upstream>> {
        self.list.iter().find(|u| u.config.name == name)
    }

    /// Sets every upstream apart, for a reload: each serves on what its old session
    /// still serves (a shared child or backend its calls; a per-call upstream a child per
    /// call), is not started again when its shared child or backend ends, and leaves its
    /// metrics to the upstream of the same name that replaces it.
    pub fn retire(&self) {
        for upstream in &self.list {
            upstream.retired.store(true, Ordering::Relaxed);
        }
    }

    /// Stops every upstream: children get SIGTERM, then SIGKILL after a grace.
    pub async fn stop(&self) {
        let stops = self.list.iter().map(|u| u.shutdown());
        futures_util::future::join_all(stops).await;
    }
}

impl Drop for Upstreams {
    fn drop(&mut self) {
        // A session generation dropped without `stop` (a failed start): no supervisor
        // outlives it. Children are killed by their links' reapers once stopped.
        for upstream in &self.list {
            upstream.stop.cancel();
        }
    }
}

/// The catalog's view of one upstream.
struct UpstreamSource(Arc<Upstream>);

impl Source for UpstreamSource {
    fn name(&self) -> &str {
        &self.0.source_name
    }

    fn tools(&self) -> Vec<Arc<dyn HostTool>> {
        self.0
            .listing
            .read()
            .tools
            .iter()
            .map(|t| t.clone() as Arc<dyn HostTool>)
            .collect()
    }

    fn namespace(&self) -> Option<&str> {
        Some(&self.0.config.name)
    }

    fn unavailable(&self) -> Option<String> {
        let shown = self.0.shown.lock();
        if shown.state == UpstreamState::Up || !self.0.listing.read().tools.is_empty() {
            return None;
        }
        // Its state only: why it failed (its own error text, paths of the host) is for the
        // operator (`robota-mcpctl upstreams`), not for every caller.
        Some(format!(
            "upstream {} is {} (robota-mcpctl upstreams on the host says why)",
            self.0.config.name,
            shown.state.as_str(),
        ))
    }
}

/// How calls reach the upstream while it is up.
#[derive(Clone)]
enum Live {
    Child(Arc<ChildLink>, Negotiated),
    Http(Arc<HttpLink>, Negotiated),
    /// A fresh child per call; `broken` fires when one cannot be started.
    PerCall(CancellationToken),
}

struct Shown {
    state: UpstreamState,
    since: SystemTime,
    restarts: u64,
    last_error: Option<String>,
    protocol: Option<String>,
    from_cache: bool,
}

pub struct Upstream {
    me: Weak<Upstream>,
    config: UpstreamConfig,
    source_name: String,
    context: Arc<Context>,
    shown: Mutex<Shown>,
    listing: RwLock<Arc<Listing>>,
    live: RwLock<Option<Live>>,
    /// Finished attempts (start, restart), for waiters.
    attempts: watch::Sender<u64>,
    wake: Notify,
    stop: CancellationToken,
    list_changed: Arc<Notify>,
    per_call: Arc<Semaphore>,
    /// What its children may write into the log, all of them together.
    stderr_rate: Arc<StderrRate>,
    catalog: Mutex<Weak<Catalog>>,
    supervisor: Mutex<Option<tokio::task::JoinHandle<()>>>,
    /// Set apart by a reload ([`Upstreams::retire`]).
    retired: AtomicBool,
    pin: Mutex<PinState>,
    /// A stdio upstream's executable: what identifies the file, and its SHA-256.
    executable: Mutex<Option<(ExecutableKey, String)>>,
}

/// Why an approval was not made.
#[derive(Debug)]
pub enum Refusal {
    /// The upstream's surface is not the one the operator reviewed.
    Changed(String),
    /// Nothing to approve, or it could not be kept.
    Unavailable(String),
}

/// The approved surface, the one listed last, and the last drift audited.
#[derive(Default)]
struct PinState {
    approved: Option<Surface>,
    now: Option<Surface>,
    /// The digest of the drift audited last, when, and the drifts seen since and not
    /// audited.
    audited: Option<(String, Instant, u64)>,
}

impl PinState {
    /// Whether a drift to the surface `digest` is audited now: once per distinct surface,
    /// and at most once per [`DRIFT_AUDIT_INTERVAL`] until the next approval — going
    /// back to the approved surface in between starts nothing again, or an upstream
    /// alternating between the two would be audited at every other list. `Some(n)`: audit
    /// it, `n` drifts since the last record were not.
    fn drift_due(&mut self, digest: &str, now: Instant) -> Option<u64> {
        match &mut self.audited {
            Some((last, _, _)) if last == digest => None,
            Some((_, at, skipped)) if now.duration_since(*at) < DRIFT_AUDIT_INTERVAL => {
                *skipped += 1;
                None
            }
            audited => {
                let unaudited = audited.as_ref().map_or(0, |(_, _, skipped)| *skipped);
                *audited = Some((digest.to_owned(), now, 0));
                Some(unaudited)
            }
        }
    }
}

/// Least time between two drift records of one upstream since its last approval: an
/// upstream changing its list without end must not push the audit trail's older records
/// (approvals, grants) out of its retention. Drifts in between are counted, and the
/// next record's log line says how many.
const DRIFT_AUDIT_INTERVAL: Duration = Duration::from_secs(600);

/// The least time between two readings of an upstream's announced tool list.
const RELIST_EVERY: Duration = Duration::from_secs(1);

/// Device, inode, size, modification and change times: the executable is hashed again
/// whenever one of them changed (the change time cannot be set back by its owner).
type ExecutableKey = (u64, u64, u64, i64, i64, i64, i64);

/// Why serving stopped.
enum Ended {
    Stopped,
    Restart,
    Failed(String),
}

impl Upstream {
    fn new(config: UpstreamConfig, context: Arc<Context>) -> Arc<Self> {
        let upstream = Arc::new_cyclic(|me: &Weak<Upstream>| Self {
            me: me.clone(),
            source_name: format!("upstream {}", config.name),
            shown: Mutex::new(Shown {
                state: UpstreamState::Starting,
                since: SystemTime::now(),
                restarts: 0,
                last_error: None,
                protocol: None,
                from_cache: false,
            }),
            listing: RwLock::new(Arc::new(Listing::default())),
            live: RwLock::new(None),
            attempts: watch::channel(0).0,
            wake: Notify::new(),
            stop: CancellationToken::new(),
            list_changed: Arc::new(Notify::new()),
            per_call: Arc::new(Semaphore::new(MAX_PER_CALL)),
            stderr_rate: Arc::default(),
            catalog: Mutex::new(Weak::new()),
            supervisor: Mutex::new(None),
            retired: AtomicBool::new(false),
            pin: Mutex::new(PinState::default()),
            executable: Mutex::new(None),
            config,
            context,
        });
        upstream.pin.lock().approved = upstream.read_pin().map(|p| p.surface());
        if let Some(listed) = upstream.read_known() {
            upstream.set_listing(listed, true);
        }
        upstream
            .context
            .metrics
            .upstream_up(&upstream.config.name, false);
        upstream
    }

    pub fn name(&self) -> &str {
        &self.config.name
    }

    fn kind(&self) -> UpstreamKind {
        match self.config.endpoint {
            UpstreamEndpoint::Command { .. } => UpstreamKind::Stdio,
            UpstreamEndpoint::Http { .. } => UpstreamKind::Http,
        }
    }

    fn spawn(&self) {
        let Some(me) = self.me.upgrade() else { return };
        let mut supervisor = self.supervisor.lock();
        if supervisor.is_none() {
            *supervisor = Some(tokio::spawn(me.supervise()));
        }
    }

    fn set_state(&self, state: UpstreamState, error: Option<String>) {
        let mut shown = self.shown.lock();
        if shown.state != state {
            shown.state = state;
            shown.since = SystemTime::now();
        }
        if let Some(error) = error {
            shown.last_error = Some(error);
        }
        drop(shown);
        // A retired upstream's name is its successor's to report.
        if !self.retired.load(Ordering::Relaxed) {
            self.context
                .metrics
                .upstream_up(&self.config.name, state == UpstreamState::Up);
        }
    }

    fn not_ready_in_time(&self, bound: Duration) {
        let mut shown = self.shown.lock();
        if shown.state == UpstreamState::Starting {
            shown.state = UpstreamState::Down;
            shown.since = SystemTime::now();
            shown.last_error = Some(format!(
                "not ready within the start bound ({}); still trying",
                humantime::format_duration(bound)
            ));
            tracing::warn!(upstream = %self.config.name, "not ready within the start bound; its last-known tools are listed and answer unavailable until it is up");
        }
    }

    /// Start, serve, back off, start again — until stopped.
    async fn supervise(self: Arc<Self>) {
        let backoff = self.config.restart;
        let mut delay = backoff.initial;
        let mut first = true;
        loop {
            // A retired upstream serves its child until it ends, and starts no other.
            if !first && self.retired.load(Ordering::Relaxed) {
                break;
            }
            if !first {
                self.shown.lock().restarts += 1;
                self.context.metrics.upstream_restart(&self.config.name);
                self.set_state(UpstreamState::Starting, None);
            }
            first = false;
            let attempt = tokio::select! {
                attempt = self.attempt() => attempt,
                () = self.stop.cancelled() => break,
            };
            let ended = match attempt {
                Ok((live, negotiated, listed)) => {
                    self.shown.lock().protocol = Some(negotiated.version.to_owned());
                    self.set_listing(listed, false);
                    *self.live.write() = Some(live.clone());
                    self.set_state(UpstreamState::Up, None);
                    self.attempts.send_modify(|n| *n += 1);
                    tracing::info!(upstream = %self.config.name, protocol = %negotiated.version, tools = self.listing.read().tools.len(), "upstream up");
                    let up_at = Instant::now();
                    let ended = self.serve(&live, &negotiated).await;
                    *self.live.write() = None;
                    if up_at.elapsed() >= HEALTHY {
                        delay = backoff.initial;
                    }
                    ended
                }
                Err(why) => {
                    self.attempts.send_modify(|n| *n += 1);
                    Ended::Failed(why)
                }
            };
            if self.retired.load(Ordering::Relaxed) {
                if let Ended::Failed(why) = ended {
                    tracing::info!(upstream = %self.config.name, error = ?why, "a retired upstream (of the session a reload replaced) ended; it is not started again");
                }
                break;
            }
            match ended {
                Ended::Stopped => break,
                Ended::Restart => {
                    tracing::info!(upstream = %self.config.name, "upstream restart requested");
                    delay = backoff.initial;
                    continue;
                }
                Ended::Failed(why) => {
                    tracing::warn!(upstream = %self.config.name, error = ?why, retry_in = %humantime::format_duration(delay), "upstream failed");
                    self.set_state(UpstreamState::Backoff, Some(why));
                }
            }
            tokio::select! {
                () = tokio::time::sleep(delay) => {}
                () = self.wake.notified() => {}
                () = self.stop.cancelled() => break,
            }
            delay = (delay * 2).min(backoff.max);
        }
        *self.live.write() = None;
        self.set_state(UpstreamState::Down, None);
    }

    /// One attempt: start or connect, agree on a revision, list the tools.
    async fn attempt(&self) -> Result<(Live, Negotiated, Listed), String> {
        let limit = self.config.connect_timeout;
        let bounded = async {
            match &self.config.endpoint {
                UpstreamEndpoint::Command { children, argv, .. } => {
                    self.fingerprint_executable(argv.first().map(PathBuf::from))
                        .await;
                    let link = self.spawn_child()?;
                    let ready = async {
                        let negotiated =
                            protocol::handshake(&*link, self.config.protocol, limit).await?;
                        let listed =
                            protocol::list_tools(&*link, &negotiated, limit, &self.context.memory)
                                .await?;
                        Ok::<_, String>((negotiated, listed))
                    };
                    match ready.await {
                        Ok((negotiated, listed)) => {
                            if *children == Children::PerCall {
                                // The probe lists the tools; every call gets its own child.
                                link.stop(Duration::ZERO).await;
                                Ok((Live::PerCall(CancellationToken::new()), negotiated, listed))
                            } else {
                                Ok((Live::Child(link, negotiated.clone()), negotiated, listed))
                            }
                        }
                        Err(why) => {
                            let closed = link.why();
                            link.stop(Duration::ZERO).await;
                            Err(match closed {
                                // Each step failed only because the child ended (in auto,
                                // both quote it): its reason, once.
                                Some(closed) if why.contains(&closed) => {
                                    format!("the child ended during the handshake: {closed}")
                                }
                                Some(closed) => format!("{why} ({closed})"),
                                None => why,
                            })
                        }
                    }
                }
                UpstreamEndpoint::Http {
                    target,
                    path,
                    bearer_file,
                } => {
                    let bearer = match bearer_file {
                        Some(file) => Some(read_bearer(file)?),
                        None => None,
                    };
                    let link = HttpLink::new(
                        &self.config.name,
                        target.clone(),
                        path.clone(),
                        bearer.as_deref(),
                        HttpBounds {
                            response_limit: usize::try_from(self.config.response_limit)
                                .unwrap_or(usize::MAX),
                            stream_limit: self.config.stream_limit,
                            connect_timeout: limit,
                            memory: self.context.memory.clone(),
                        },
                        self.list_changed.clone(),
                    )?;
                    let negotiated =
                        protocol::handshake(&*link, self.config.protocol, limit).await?;
                    let listed =
                        protocol::list_tools(&*link, &negotiated, limit, &self.context.memory)
                            .await?;
                    Ok((Live::Http(link, negotiated.clone()), negotiated, listed))
                }
            }
        };
        // Each step is bounded; the whole attempt too (a server trickling its answers).
        match tokio::time::timeout(limit * 3, bounded).await {
            Ok(result) => result,
            Err(_) => Err(format!(
                "not ready within {}",
                humantime::format_duration(limit * 3)
            )),
        }
    }

    fn spawn_child(&self) -> Result<Arc<ChildLink>, String> {
        let UpstreamEndpoint::Command {
            argv,
            env,
            cwd,
            confine,
            ..
        } = &self.config.endpoint
        else {
            return Err("not a stdio upstream".into());
        };
        // The configured environment comes last: a key it sets wins.
        let mut vars = Vec::new();
        let mut home = None;
        if let Some(cache) = &self.context.cache_dir {
            let dir = cache.join(&self.config.name);
            own_private_dir(&dir)?;
            let tmp = dir.join("tmp");
            own_private_dir(&tmp)?;
            let text = dir.display().to_string();
            vars.push(("HOME".to_owned(), text.clone()));
            vars.push(("XDG_CACHE_HOME".to_owned(), format!("{text}/.cache")));
            vars.push(("npm_config_cache".to_owned(), format!("{text}/.npm")));
            vars.push(("TMPDIR".to_owned(), tmp.display().to_string()));
            home = Some(dir);
        }
        vars.extend(env.iter().map(|(k, v)| (k.clone(), v.clone())));
        let confinement = confine.enabled.then(|| confine::Confinement {
            network: confine.network,
            read: confine
                .read_paths
                .iter()
                .cloned()
                .chain(argv.first().map(PathBuf::from))
                .chain(cwd.clone())
                .collect(),
            write: confine.write_paths.clone(),
            own: home.into_iter().collect(),
            hidden: self.context.hidden.clone(),
        });
        let spec = ChildSpec {
            argv: argv.clone(),
            env: vars,
            cwd: cwd.clone(),
            confinement,
            memory: confine.memory,
        };
        ChildLink::spawn(
            &self.config.name,
            &spec,
            &self.context.launcher,
            usize::try_from(self.config.response_limit).unwrap_or(usize::MAX),
            self.context.memory.clone(),
            self.list_changed.clone(),
            self.stderr_rate.clone(),
        )
    }

    /// While up: until the link breaks, a restart is asked for, or the daemon stops. A
    /// new tool list announced meanwhile is read and replaces the old one — at most once
    /// per [`RELIST_EVERY`]: announcements in between are read as one, so an upstream
    /// that announces without end costs one listing, rebuild and log line a second.
    async fn serve(&self, live: &Live, negotiated: &Negotiated) -> Ended {
        let mut next_listing = tokio::time::Instant::now();
        loop {
            let broken = async {
                match live {
                    Live::Child(link, _) => link.closed().cancelled().await,
                    Live::Http(link, _) => link.broken().cancelled().await,
                    Live::PerCall(broken) => broken.cancelled().await,
                }
            };
            tokio::select! {
                () = broken => {
                    let why = match live {
                        Live::Child(link, _) => {
                            let why = link.why().unwrap_or_default();
                            link.stop(STOP_GRACE).await;
                            why
                        }
                        Live::Http(..) => "the backend could not be reached".into(),
                        Live::PerCall(_) => "a child could not be started for a call".into(),
                    };
                    return Ended::Failed(why);
                }
                () = async {
                    tokio::time::sleep_until(next_listing).await;
                    self.list_changed.notified().await;
                } => {
                    next_listing = tokio::time::Instant::now() + RELIST_EVERY;
                    let rpc: Option<&dyn Rpc> = match live {
                        Live::Child(link, _) => Some(&**link),
                        Live::Http(link, _) => Some(&**link),
                        Live::PerCall(_) => None,
                    };
                    if let Some(rpc) = rpc {
                        match protocol::list_tools(rpc, negotiated, self.config.connect_timeout, &self.context.memory).await {
                            Ok(listed) => {
                                tracing::info!(upstream = %self.config.name, "upstream announced a new tool list");
                                self.set_listing(listed, false);
                            }
                            Err(why) => tracing::warn!(upstream = %self.config.name, error = ?why, "cannot read the upstream's new tool list; keeping the old one"),
                        }
                    }
                }
                () = self.wake.notified() => {
                    self.stop_live(live).await;
                    return Ended::Restart;
                }
                () = self.stop.cancelled() => {
                    self.stop_live(live).await;
                    return Ended::Stopped;
                }
            }
        }
    }

    async fn stop_live(&self, live: &Live) {
        if let Live::Child(link, _) = live {
            link.stop(STOP_GRACE).await;
        }
    }

    async fn shutdown(&self) {
        self.stop.cancel();
        let task = self.supervisor.lock().take();
        if let Some(task) = task {
            let _ = tokio::time::timeout(STOP_GRACE + Duration::from_secs(6), task).await;
        }
    }

    /// Calls the upstream's own tool `original`.
    pub async fn call(
        &self,
        original: &str,
        args: Map<String, Value>,
        cancel: &CancellationToken,
        progress: &Progress,
    ) -> Result<Answer, CallError> {
        let live = self.live.read().clone();
        let Some(live) = live else {
            let state = self.shown.lock().state;
            return Err(CallError::NotSent(format!("the upstream is {state}")));
        };
        let mut params = Map::new();
        params.insert("name".into(), Value::String(original.to_owned()));
        params.insert("arguments".into(), Value::Object(args));
        let limit = self.config.call_timeout;
        match live {
            Live::Child(link, negotiated) => {
                link.request(
                    &negotiated,
                    "tools/call",
                    negotiated.params(params),
                    cancel,
                    limit,
                    progress,
                )
                .await
            }
            Live::Http(link, negotiated) => {
                link.request(
                    &negotiated,
                    "tools/call",
                    negotiated.params(params),
                    cancel,
                    limit,
                    progress,
                )
                .await
            }
            Live::PerCall(broken) => self.call_in_child(params, cancel, progress, &broken).await,
        }
    }

    /// A per-call child: started, agreed with, called once, and killed with its group
    /// however the call ends (the future dropped included).
    async fn call_in_child(
        &self,
        params: Map<String, Value>,
        cancel: &CancellationToken,
        progress: &Progress,
        broken: &CancellationToken,
    ) -> Result<Answer, CallError> {
        let Ok(_permit) = self.per_call.clone().try_acquire_owned() else {
            return Err(CallError::Busy(format!(
                "{MAX_PER_CALL} per-call children of this upstream are running"
            )));
        };
        let link = match self.spawn_child() {
            Ok(link) => link,
            Err(why) => {
                tracing::warn!(upstream = %self.config.name, error = ?why, "cannot start a per-call child");
                broken.cancel();
                return Err(CallError::NotSent(why));
            }
        };
        let _kill = KillOnDrop(link.clone());
        let negotiated = tokio::select! {
            n = protocol::handshake(&*link, self.config.protocol, self.config.connect_timeout) => {
                match n {
                    Ok(negotiated) => negotiated,
                    Err(why) => {
                        // A child that ended before it could be agreed with (the
                        // launcher refused it, say) ends so for the next call too: the
                        // upstream backs off, and its probe's reason is the operator's.
                        if let Some(ended) = link.why() {
                            tracing::warn!(upstream = %self.config.name, error = ?ended, "a per-call child ended during the handshake");
                            broken.cancel();
                        }
                        return Err(CallError::NotSent(why));
                    }
                }
            }
            () = cancel.cancelled() => return Err(CallError::Cancelled),
        };
        let params = negotiated.params(params);
        let result = link
            .request(
                &negotiated,
                "tools/call",
                params,
                cancel,
                self.config.call_timeout,
                progress,
            )
            .await;
        link.stop(Duration::ZERO).await;
        result
    }

    /// Replaces the tool list (and keeps it in the state directory); the catalog gets a
    /// new generation when the tools changed. The new listing holds the budget share its
    /// pages took for as long as it is served. Tools the pin holds are not served.
    fn set_listing(&self, listed: Listed, from_cache: bool) {
        let surface = Surface::of(&listed.tools, self.executable_sha());
        let drift = self.judge(&surface, &listed.tools);
        let mut listing = tool::import(&self.config, &listed.tools, &self.me);
        listing.hold(&drift, &self.config.name);
        listing.surface = Some(surface.digest());
        listing.drift = !drift.is_empty();
        let changed = {
            let current = self.listing.read();
            current.specs() != listing.specs()
                || current.refused != listing.refused
                || current.surface != listing.surface
        };
        self.shown.lock().from_cache = from_cache;
        if !changed {
            return;
        }
        for (tool, why) in &listing.refused {
            // What the upstream named and why, quoted: its text never becomes log syntax.
            tracing::warn!(upstream = %self.config.name, tool = ?tool, why = ?why, "tool not imported");
        }
        self.context
            .metrics
            .upstream_tools(&self.config.name, listing.tools.len());
        if !from_cache {
            self.write_known(&listed.tools);
        }
        listing.held = listed.held;
        *self.listing.write() = Arc::new(listing);
        if let Some(catalog) = self.catalog.lock().upgrade() {
            let snapshot = catalog.rebuild();
            tracing::info!(upstream = %self.config.name, generation = snapshot.generation(), "catalog rebuilt with the upstream's new tools");
        }
    }

    /// Compares `surface` with the approved one: the first surface ever listed is
    /// trusted and kept; a different one is a drift, audited once, counted in the drift
    /// gauge and — with `pin = true` — held.
    fn judge(&self, surface: &Surface, listed: &[Value]) -> Drift {
        let mut pin = self.pin.lock();
        pin.now = Some(surface.clone());
        let Some(approved) = &pin.approved else {
            let digest = surface.digest();
            if self.context.persist {
                self.write_pin(listed, surface.executable.as_deref(), "first-use");
                self.context.audit.upstream(
                    UpstreamEvent::Pinned,
                    &self.config.name,
                    &digest,
                    "first-use",
                );
            }
            pin.approved = Some(surface.clone());
            self.context
                .metrics
                .upstream_drift(&self.config.name, false);
            return Drift::default();
        };
        let drift = Drift::between(approved, surface);
        let held = self.config.pin && !drift.is_empty();
        self.context.metrics.upstream_drift(&self.config.name, held);
        if drift.is_empty() {
            return drift;
        }
        let digest = surface.digest();
        if let Some(unaudited) = pin.drift_due(&digest, Instant::now())
            && self.context.persist
        {
            tracing::warn!(
                upstream = %self.config.name,
                added = drift.added.len(),
                removed = drift.removed.len(),
                changed = drift.changed.len(),
                executable_changed = drift.executable,
                held,
                unaudited,
                "the upstream's tool surface differs from the approved one ({unaudited} other surfaces it listed since the last record were not audited); see robota-mcpctl upstreams diff {}",
                self.config.name
            );
            self.context.audit.upstream(
                UpstreamEvent::Drift,
                &self.config.name,
                &digest,
                "the daemon",
            );
        }
        if held { drift } else { Drift::default() }
    }

    /// Approves the surface as last listed (`by`: `local:<uid>`) when it is `reviewed`
    /// (the digest `diff` showed): kept in the pin file, audited, and the held tools
    /// served. Anything listed since is not approved.
    pub fn approve(&self, reviewed: &str, by: &str) -> Result<UpstreamStatus, Refusal> {
        let name = &self.config.name;
        let Some(listed) = self.read_known() else {
            return Err(Refusal::Unavailable(format!(
                "upstream {name} has not listed its tools yet; there is nothing to approve"
            )));
        };
        let surface = Surface::of(&listed.tools, self.executable_sha());
        let digest = surface.digest();
        if digest != reviewed {
            return Err(Refusal::Changed(format!(
                "upstream {name} lists surface {digest} now, not the {reviewed} given; nothing was approved: run robota-mcpctl upstreams diff {name} again"
            )));
        }
        if !self.write_pin(&listed.tools, surface.executable.as_deref(), by) {
            return Err(Refusal::Unavailable(format!(
                "cannot keep the approval of upstream {name} in the state directory (the log says why); nothing changed"
            )));
        }
        {
            let mut pin = self.pin.lock();
            pin.approved = Some(surface);
            pin.audited = None;
        }
        self.context
            .audit
            .upstream(UpstreamEvent::Approved, &self.config.name, &digest, by);
        let from_cache = self.shown.lock().from_cache;
        self.set_listing(listed, from_cache);
        Ok(self.status())
    }

    /// How the surface listed last differs from the approved one, member by member.
    pub fn diff(&self) -> UpstreamDiff {
        let pinned = self.read_pin();
        let current = self.read_known();
        let pin = self.pin.lock();
        let mut diff = UpstreamDiff {
            name: self.config.name.clone(),
            approved: pin.approved.as_ref().map(Surface::digest),
            current: pin.now.as_ref().map(Surface::digest),
            approved_at: pinned.as_ref().and_then(|p| p.approved_at),
            approved_by: pinned.as_ref().and_then(|p| p.approved_by.clone()),
            executable_changed: false,
            added: Vec::new(),
            removed: Vec::new(),
            changed: Vec::new(),
        };
        if let (Some(approved), Some(now)) = (&pin.approved, &pin.now) {
            let drift = Drift::between(approved, now);
            let approved_definitions = pinned.map(|p| p.definitions()).unwrap_or_default();
            let current_definitions = current.map(|c| c.tools).unwrap_or_default();
            diff.executable_changed = drift.executable;
            diff.added = drift.added;
            diff.removed = drift.removed;
            diff.changed = drift
                .changed
                .keys()
                .map(|tool| ToolChange {
                    tool: tool.clone(),
                    members: pin::member_changes(tool, &approved_definitions, &current_definitions),
                })
                .collect();
        }
        diff
    }

    /// The approved surface kept in the state directory, read under the budget.
    fn read_pin(&self) -> Option<Pinned> {
        let path = self.state_file(".pin.json")?;
        let text = std::fs::read(&path).ok()?;
        let pinned = protocol::parse(&text, &self.context.memory)
            .ok()
            .and_then(|(value, _held)| serde_json::from_value::<Pinned>(value).ok());
        if pinned.is_none() {
            tracing::warn!(path = %path.display(), upstream = %self.config.name, "the approved tool surface is unreadable; the next listing is trusted as on first use");
        }
        pinned
    }

    /// Keeps the approved surface; `false` when it could not be written (logged).
    fn write_pin(&self, listed: &[Value], executable: Option<&str>, by: &str) -> bool {
        let Some(path) = self.state_file(".pin.json") else {
            return false;
        };
        let pinned = Pinned::of(listed, executable, unix_secs(SystemTime::now()), by);
        let written = serde_json::to_vec(&pinned)
            .map_err(std::io::Error::other)
            .and_then(|text| write_atomically(&path, &text));
        match written {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "cannot keep the upstream's approved tool surface");
                false
            }
        }
    }

    /// SHA-256 of the executable of a stdio upstream, as last fingerprinted.
    fn executable_sha(&self) -> Option<String> {
        self.executable.lock().as_ref().map(|(_, sha)| sha.clone())
    }

    /// Fingerprints the executable it is about to start (again only when the file
    /// changed); one that cannot be read is not fingerprinted.
    async fn fingerprint_executable(&self, path: Option<PathBuf>) {
        use std::os::unix::fs::MetadataExt as _;
        let Some(path) = path else { return };
        let Ok(meta) = std::fs::metadata(&path) else {
            return;
        };
        let key = (
            meta.dev(),
            meta.ino(),
            meta.size(),
            meta.mtime(),
            meta.mtime_nsec(),
            meta.ctime(),
            meta.ctime_nsec(),
        );
        if matches!(&*self.executable.lock(), Some((k, _)) if *k == key) {
            return;
        }
        let hashed = tokio::task::spawn_blocking(move || pin::file_sha256(&path)).await;
        if let Ok(Ok(sha)) = hashed {
            *self.executable.lock() = Some((key, sha));
        }
    }

    /// `<state_dir>/upstreams/<name><suffix>`: the kept list (`.json`), the approved
    /// surface (`.pin.json`).
    fn state_file(&self, suffix: &str) -> Option<PathBuf> {
        let dir = self.context.state_dir.as_ref()?;
        Some(
            dir.join("upstreams")
                .join(format!("{}{suffix}", self.config.name)),
        )
    }

    /// The last list kept, read under the budget like a list the upstream sends.
    fn read_known(&self) -> Option<Listed> {
        let path = self.state_file(".json")?;
        let text = std::fs::read(&path).ok()?;
        match protocol::parse(&text, &self.context.memory) {
            Ok((Value::Object(mut known), held)) => match known.remove("tools") {
                Some(Value::Array(tools)) => Some(Listed {
                    tools,
                    held: Some(held),
                }),
                _ => None,
            },
            Ok(_) | Err(Unread::NotJson(_)) => {
                tracing::warn!(path = %path.display(), "the last-known tool list is unreadable; ignored");
                None
            }
            Err(Unread::Unaffordable(why)) => {
                tracing::warn!(path = %path.display(), "the last-known tool list is not read: {why}");
                None
            }
        }
    }

    fn write_known(&self, listed: &[Value]) {
        if !self.context.persist {
            return;
        }
        let Some(path) = self.state_file(".json") else {
            return;
        };
        let text = serde_json::json!({"tools": listed, "listed_at": unix_secs(SystemTime::now())})
            .to_string();
        if let Err(e) = write_atomically(&path, text.as_bytes()) {
            tracing::warn!(path = %path.display(), error = %e, "cannot keep the upstream's tool list");
        }
    }

    /// Its tools whose canonical names another tool claims too (refused, both).
    fn collisions(&self) -> Vec<RefusedTool> {
        let Some(catalog) = self.catalog.lock().upgrade() else {
            return Vec::new();
        };
        let snapshot = catalog.snapshot();
        let prefix = format!("{}.", self.config.name);
        snapshot
            .conflicts()
            .iter()
            .filter(|(name, _)| name.starts_with(&prefix))
            .map(|(name, owners)| RefusedTool {
                tool: name.clone(),
                reason: format!(
                    "refused: the name is claimed by {}; give one an alias",
                    owners.join(" and ")
                ),
            })
            .collect()
    }

    fn status(&self) -> UpstreamStatus {
        // Before its own locks: a catalog rebuild holds the catalog's while it reads them.
        let collisions = self.collisions();
        let shown = self.shown.lock();
        let listing = self.listing.read();
        UpstreamStatus {
            name: self.config.name.clone(),
            kind: self.kind().as_str().to_owned(),
            children: match &self.config.endpoint {
                UpstreamEndpoint::Command { children, .. } => Some(
                    match children {
                        Children::Shared => "shared",
                        Children::PerCall => "per-call",
                    }
                    .to_owned(),
                ),
                UpstreamEndpoint::Http { .. } => None,
            },
            state: shown.state.as_str().to_owned(),
            since: unix_secs(shown.since),
            protocol: shown.protocol.clone(),
            tools: listing.tools.iter().map(|t| t.spec.name.clone()).collect(),
            refused: listing
                .refused
                .iter()
                .map(|(tool, reason)| RefusedTool {
                    tool: tool.clone(),
                    reason: reason.clone(),
                })
                .chain(collisions)
                .collect(),
            excluded: listing.excluded,
            listed_from_cache: shown.from_cache,
            restarts: shown.restarts,
            last_error: shown.last_error.clone(),
            surface: listing.surface.clone(),
            drift: listing.drift,
        }
    }
}

/// Makes `dir` (and its parents) when missing; it must then be a directory of the
/// daemon's own user, not a symlink, and is made 0700 (a child's home, readable by no one
/// else).
fn own_private_dir(dir: &Path) -> Result<(), String> {
    use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _};
    let shown = dir.display();
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(|e| format!("cannot make its cache directory {shown}: {e}"))?;
    let meta = std::fs::symlink_metadata(dir)
        .map_err(|e| format!("cannot read its cache directory {shown}: {e}"))?;
    if !meta.is_dir() || meta.uid() != nix::unistd::geteuid().as_raw() {
        return Err(format!(
            "its cache directory {shown} is not a directory of the daemon's own user (a symlink, or another owner); remove it"
        ));
    }
    if meta.mode() & 0o777 != 0o700 {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
            .map_err(|e| format!("cannot make its cache directory {shown} private: {e}"))?;
    }
    Ok(())
}

/// Kills a per-call child's group when its call's future ends, however it ends.
struct KillOnDrop(Arc<ChildLink>);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        // Not yet reaped, so its group id cannot belong to anyone else yet.
        if !self.0.is_reaped() {
            let pid = nix::unistd::Pid::from_raw(i32::try_from(self.0.pid()).unwrap_or(i32::MAX));
            let _ = nix::sys::signal::killpg(pid, nix::sys::signal::Signal::SIGKILL);
        }
    }
}

/// The bearer file's token: at most 4 KiB, trimmed, visible ASCII. Its content never
/// reaches a log line or an error message.
fn read_bearer(path: &Path) -> Result<String, String> {
    use std::io::Read;
    let file = std::fs::File::open(path)
        .map_err(|e| format!("cannot read the bearer file {}: {e}", path.display()))?;
    let mut text = String::new();
    file.take(MAX_BEARER_FILE + 1)
        .read_to_string(&mut text)
        .map_err(|e| format!("cannot read the bearer file {}: {e}", path.display()))?;
    if text.len() as u64 > MAX_BEARER_FILE {
        return Err(format!("the bearer file {} is over 4 KiB", path.display()));
    }
    let token = text.trim();
    if token.is_empty() || !token.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(format!(
            "the bearer file {} must hold one token of visible ASCII characters",
            path.display()
        ));
    }
    Ok(token.to_owned())
}

/// Temporary file, fsync, rename over `path`, fsync of the directory; mode 0600.
fn write_atomically(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
    let dir = path.parent().ok_or(std::io::ErrorKind::InvalidInput)?;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)?;
    // Named by process: a `--stdio` process and the daemon may keep the same list.
    let temp = dir.join(format!(
        ".{}.{}.tmp",
        path.file_name().and_then(|n| n.to_str()).unwrap_or("tools"),
        std::process::id()
    ));
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&temp)?;
    file.write_all(bytes)?;
    file.sync_all()?;
    drop(file);
    std::fs::rename(&temp, path)?;
    std::fs::File::open(dir)?.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drifts_are_audited_once_a_surface_and_once_an_interval_until_an_approval() {
        let mut pin = PinState::default();
        let t0 = Instant::now();
        let later = |secs| t0 + Duration::from_secs(secs);
        assert_eq!(pin.drift_due("a", t0), Some(0));
        assert_eq!(pin.drift_due("a", later(1)), None, "the same surface again");
        // Back to the approved surface (no drift: not asked), then a new one: still within
        // the interval of the last record.
        assert_eq!(pin.drift_due("b", later(2)), None);
        assert_eq!(pin.drift_due("c", later(3)), None);
        let next = DRIFT_AUDIT_INTERVAL.as_secs() + 1;
        assert_eq!(pin.drift_due("d", later(next)), Some(2), "two not audited");
        assert_eq!(pin.drift_due("e", later(next + 1)), None);
        // An approval starts afresh.
        pin.audited = None;
        assert_eq!(pin.drift_due("e", later(next + 2)), Some(0));
    }
}
