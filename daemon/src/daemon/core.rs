//! The running daemon: what was bound, what is served now (the plan and the carriers built
//! from it), and the lifecycle — attach and start, reload (a fresh attach on the
//! configuration as it reads now), stop.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime};

use parking_lot::{Mutex, RwLock};
use robota_proto::Status;
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

use super::{DaemonError, Plan};
use crate::audit::Audit;
use crate::carrier::Sockets;
use crate::carrier::loopback::LoopbackCarrier;
use crate::carrier::remote::throttle::Throttle;
use crate::carrier::remote::{self, RemoteCarrier};
use crate::catalog::HostView;
use crate::config::{Config, ControlConfig};
use crate::health::Health;
use crate::host::Host;
use crate::mcp::Wire;
use crate::metrics::Metrics;
use crate::notify;
use crate::oauth::Verifier;
use crate::session::Session;
use crate::transport::{McpTransport, START_BOUND};
use crate::upstream::Upstreams;
use crate::vocab::{Carrier, Listener, RefreshTrigger};

/// How long a reload waits for the key-set fetch it starts on a verifier it keeps.
const RELOAD_KEYS_WAIT: Duration = Duration::from_secs(5);
/// How long a start or restart waits for the upstreams (each at most its own connect
/// bound): within the carriers' start bound.
pub(super) const UPSTREAM_START_BOUND: Duration = Duration::from_secs(15);

pub(super) type Loopback = McpTransport<Session, LoopbackCarrier>;
pub(super) type Remote = McpTransport<Session, RemoteCarrier>;

/// What the main loop is asked to do by the control plane.
pub(super) enum Op {
    Stop,
    /// A reload (`reload`, or `restart` with `fresh`: a new host bearer even when the
    /// loopback carrier stays as it was).
    Reload {
        fresh: bool,
        reply: oneshot::Sender<Result<Reloaded, RestartFailure>>,
    },
}

/// A reload that served the new configuration.
pub(super) struct Reloaded {
    pub status: Status,
    /// Whether the host bearer (and the labelled bearers without a lifetime) carried on.
    pub host_bearer_kept: bool,
}

/// Why `restart` did not serve a new configuration.
pub(super) enum RestartFailure {
    /// The configuration is invalid: every problem; the running one stays.
    Refused(Vec<String>),
    /// The daemon could not go on serving and stops.
    Failed(String),
}

/// The daemon's state, as `status` names it.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum State {
    Starting,
    Serving,
    Restarting,
    Stopping,
}

impl State {
    pub(super) fn as_str(self) -> &'static str {
        match self {
            State::Starting => "starting",
            State::Serving => "serving",
            State::Restarting => "restarting",
            State::Stopping => "stopping",
        }
    }
}

/// One listener the daemon serves, as `status`, `system.health` and `STATUS=` show it.
pub(super) struct Place {
    pub name: &'static str,
    pub address: String,
    /// The carrier, for its admitted and refused counts (none for `/metrics`).
    pub carrier: Option<Carrier>,
    pub public_url: Option<String>,
}

/// What is served now: the plan and the carriers built from it. Replaced whole by a
/// reload.
pub(super) struct Served {
    pub plan: Plan,
    pub loopback: Option<Arc<Loopback>>,
    pub remote: Option<Arc<Remote>>,
}

/// The `/metrics` listener while it serves.
pub(super) struct Scraper {
    pub configured: SocketAddr,
    pub address: String,
    pub stop: crate::transport::Drain,
    pub task: tokio::task::JoinHandle<()>,
}

/// How the last reload went, for `status`.
#[derive(Clone)]
pub(super) struct ReloadRecord {
    pub at: SystemTime,
    /// Empty when it succeeded; else every problem found, one per line.
    pub problems: Vec<String>,
}

/// Everything the control plane and `system.health` read.
pub(super) struct Core {
    pub metrics: Metrics,
    pub started: Instant,
    pub audit: Arc<Audit>,
    pub host: Arc<Host>,
    /// What fails to be written to the state directory now.
    pub health: Arc<Health>,
    pub state: RwLock<State>,
    pub generation: AtomicU64,
    pub session: RwLock<Option<Arc<Session>>>,
    /// The downstream MCP servers of the current session.
    pub upstreams: RwLock<Option<Arc<Upstreams>>>,
    pub served: RwLock<Arc<Served>>,
    pub sockets: Arc<Sockets>,
    pub scraper: Mutex<Option<Scraper>>,
    /// Carriers a reload handed over, still serving what they had accepted.
    pub handed: Mutex<Vec<crate::transport::Handed>>,
    /// The upstreams of sessions a reload replaced, each serving what the carriers handed
    /// over with them still serve until its task stops it ([`Core::retire_upstreams`]).
    pub retired: Mutex<Vec<tokio::task::JoinHandle<()>>>,
    /// Who may use the control socket: a reload changes it for new connections.
    pub control: Arc<RwLock<ControlConfig>>,
    pub control_path: String,
    /// Ends every MCP session relayed over the control socket; replaced at each attach.
    pub relays: RwLock<CancellationToken>,
    pub ops: mpsc::Sender<Op>,
    pub last_reload: Mutex<Option<ReloadRecord>>,
}

/// The carriers `system.health` reports, without holding the daemon alive.
struct Board(std::sync::Weak<Core>);

impl HostView for Board {
    fn carriers(&self) -> Vec<(String, String)> {
        self.0
            .upgrade()
            .map(|core| {
                core.places()
                    .into_iter()
                    .map(|p| (p.name.to_owned(), p.address))
                    .collect()
            })
            .unwrap_or_default()
    }
}

/// What carriers are built from, besides the plan: the parts that outlive a reload.
pub(super) struct Kept<'a> {
    pub audit: &'a Arc<Audit>,
    pub host: &'a Arc<Host>,
    pub metrics: &'a Metrics,
    pub sockets: &'a Arc<Sockets>,
    /// The remote verifier and throttle to keep, when their settings did not change.
    pub verifier: Option<Arc<dyn Verifier>>,
    pub throttle: Option<Arc<Throttle>>,
}

/// The carriers of `plan`, not started. The remote carrier needs `verifier` (the plan's
/// own, loaded, or the one kept).
pub(super) fn carriers(
    plan: &Plan,
    kept: Kept<'_>,
) -> (Option<Arc<Loopback>>, Option<Arc<Remote>>) {
    let config = &plan.config;
    let wire = Wire {
        result_limit: config.limits.tool_result,
        metrics: kept.metrics.clone(),
    };
    let loopback = config.loopback.clone().map(|l| {
        Arc::new(McpTransport::new(
            Arc::new(LoopbackCarrier::new(
                l,
                config.limits,
                kept.audit.clone(),
                kept.metrics.clone(),
                kept.host.bearers.clone(),
                kept.sockets.clone(),
            )),
            wire.clone(),
        ))
    });
    let remote = match (&config.remote, kept.verifier) {
        (Some(r), Some(verifier)) => {
            let throttle = kept
                .throttle
                .unwrap_or_else(|| Arc::new(Throttle::new(r.throttle)));
            Some(Arc::new(McpTransport::new(
                Arc::new(RemoteCarrier::new(
                    r.clone(),
                    remote::Parts {
                        limits: config.limits,
                        verifier,
                        throttle,
                        tls: plan.tls.clone(),
                        audit: kept.audit.clone(),
                        metrics: kept.metrics.clone(),
                        sockets: kept.sockets.clone(),
                    },
                )),
                wire,
            )))
        }
        _ => None,
    };
    (loopback, remote)
}

/// Load a verifier's keys and start its refresh schedule (which ends with it).
pub(super) async fn ready_verifier(
    verifier: crate::oauth::JwtVerifier,
    issuer: &str,
) -> Result<Arc<dyn Verifier>, crate::oauth::LoadError> {
    verifier.load().await?;
    drop(verifier.spawn_schedule());
    let keys = verifier.key_set();
    tracing::info!(
        issuer = %issuer,
        keys = keys.keys,
        from = keys.location.as_deref().unwrap_or("-"),
        cached = keys.from_cache,
        "remote verifier ready"
    );
    Ok(Arc::new(verifier))
}

impl Core {
    pub(super) fn served(&self) -> Arc<Served> {
        self.served.read().clone()
    }

    /// Every listener serving now, in one order for every view of them.
    pub(super) fn places(&self) -> Vec<Place> {
        let served = self.served();
        let mut out = Vec::new();
        if let Some(address) = served.loopback.as_ref().and_then(|l| l.address()) {
            out.push(Place {
                name: Carrier::Loopback.as_str(),
                address,
                carrier: Some(Carrier::Loopback),
                public_url: None,
            });
        }
        if let Some(remote) = &served.remote
            && let Some(address) = remote.address()
        {
            out.push(Place {
                name: Carrier::Remote.as_str(),
                address,
                carrier: Some(Carrier::Remote),
                public_url: Some(remote.carrier().public_url().to_owned()),
            });
        }
        if let Some(scraper) = &*self.scraper.lock() {
            out.push(Place {
                name: "metrics",
                address: scraper.address.clone(),
                carrier: None,
                public_url: None,
            });
        }
        out.push(Place {
            name: Carrier::Control.as_str(),
            address: self.control_path.clone(),
            carrier: Some(Carrier::Control),
            public_url: None,
        });
        out
    }

    /// Serving (at start, and again after a reload or restart): the state, `READY=1` with
    /// the serving status, and start-up's code given back ([`release_start_up_code`]).
    pub(super) fn serving(&self) {
        *self.state.write() = State::Serving;
        notify::ready(&self.ready_status());
        release_start_up_code();
    }

    /// `STATUS=` once serving.
    fn ready_status(&self) -> String {
        let places: Vec<String> = self
            .places()
            .into_iter()
            .map(|p| format!("{}={}", p.name, p.address))
            .collect();
        let mut status = format!("serving {}", places.join(" "));
        if self
            .last_reload
            .lock()
            .as_ref()
            .is_some_and(|r| !r.problems.is_empty())
        {
            status.push_str("; the last reload failed (see `robota-mcpctl status`)");
        }
        status
    }

    /// A fresh session, attached to every HTTP carrier and started; with `new_bearer`,
    /// a new host bearer too (the labelled bearers without a lifetime gone).
    pub(super) async fn attach_and_start(
        self: &Arc<Self>,
        new_bearer: bool,
    ) -> Result<(), DaemonError> {
        let served = self.served();
        let view = Arc::new(Board(Arc::downgrade(self)));
        let (session, upstreams) = start_session(&served.plan, &self.host, view).await?;
        *self.upstreams.write() = Some(upstreams);
        let config = &served.plan.config;
        if new_bearer {
            self.host.bearers.fresh_attach();
        }
        if let (Some(loopback), Some(l)) = (&served.loopback, &config.loopback) {
            let failed = |source| DaemonError::Loopback {
                addr: l.listen,
                source,
            };
            loopback.attach(session.clone()).map_err(failed)?;
            let addr = loopback.start().await.map_err(failed)?;
            tracing::info!(address = %addr, path = %l.path, "loopback carrier serving");
        }
        if let (Some(remote), Some(r)) = (&served.remote, &config.remote) {
            let failed = |source| DaemonError::Remote {
                addr: r.listen,
                source,
            };
            remote.attach(session.clone()).map_err(failed)?;
            let addr = remote.start().await.map_err(failed)?;
            tracing::info!(address = %addr, public_url = %r.public_url.as_str(), "remote carrier serving");
        }
        *self.session.write() = Some(session);
        Ok(())
    }

    /// A reload: the configuration read and checked again first. An invalid one changes
    /// nothing (every problem is logged and kept for `status`); a valid one is served
    /// with a fresh attach, on the sockets of the carriers whose address did not change.
    /// The host bearer is kept unless `fresh` asks for a new one or the loopback
    /// carrier's configuration changed. An error is returned only when the daemon cannot
    /// go on serving; else whether the host bearer was kept, or every problem.
    pub(super) async fn reload(
        self: &Arc<Self>,
        fresh: bool,
    ) -> Result<Result<bool, Vec<String>>, DaemonError> {
        *self.state.write() = State::Restarting;
        notify::reloading();
        tracing::info!("reloading: reading the configuration again");
        let outcome = match self.prepare().await {
            Err(problems) => {
                let source = self
                    .served()
                    .plan
                    .origin
                    .as_ref()
                    .map(|o| o.source.to_string())
                    .unwrap_or_else(|| "the embedded default".to_owned());
                for problem in &problems {
                    tracing::error!(problem = %problem, config = %source, "reload refused; the running configuration stays");
                }
                // Sockets bound for the refused file's new addresses close again.
                let running: Vec<_> = listens(&self.served().plan.config)
                    .into_iter()
                    .map(|(_, name, addr)| (name, addr))
                    .collect();
                self.sockets.retain(&running);
                Err(problems)
            }
            Ok(next) => Ok(self.switch(next, fresh).await?),
        };
        *self.last_reload.lock() = Some(ReloadRecord {
            at: SystemTime::now(),
            problems: outcome.clone().err().unwrap_or_default(),
        });
        self.serving();
        Ok(outcome)
    }

    /// Everything of a reload that can fail, done while the old carriers still serve.
    async fn prepare(&self) -> Result<Next, Vec<String>> {
        let served = self.served();
        let old = &served.plan;
        let plan = match &old.origin {
            Some(origin) => Plan::load(&origin.loader, self.metrics.clone()),
            None => Plan::build(old.config.clone(), self.metrics.clone()).map_err(|error| {
                super::plan::LoadError::Plan {
                    origin: crate::config::Source::Embedded,
                    error,
                }
            }),
        };
        let mut plan = plan.map_err(|e| problems_of(&e))?;
        // Upstream children start the way the process was set up to start them.
        plan.launcher = old.launcher.clone();
        for warning in &plan.config.warnings {
            tracing::warn!(key = %warning.path, "{}", warning.problem);
        }
        let mut problems = fixed_keys(&old.config, &plan.config);
        // The sockets of new addresses, bound now: a port taken elsewhere fails the reload
        // here, before anything stops.
        for (key, name, addr) in listens(&plan.config) {
            if let Err(e) = self.sockets.reserve(name, addr) {
                problems.push(format!("{key}: cannot bind {addr}: {e}"));
            }
        }
        if !problems.is_empty() {
            return Err(problems);
        }
        // The remote verifier and throttle: kept when their settings are the same.
        let running = served.remote.as_ref().map(|r| r.carrier().clone());
        let (verifier, throttle) = match (&plan.config.remote, running) {
            (None, _) => (None, None),
            (Some(r), Some(running)) if plan.verifier_settings == old.verifier_settings => {
                plan.verifier = None;
                let kept = running.verifier().clone();
                let refresh = kept.refresh(RefreshTrigger::Reload);
                match tokio::time::timeout(RELOAD_KEYS_WAIT, refresh).await {
                    // On failure the verifier has logged why; the keys held stay in use.
                    Ok(_) => {}
                    Err(_) => tracing::warn!(
                        wait = %humantime::format_duration(RELOAD_KEYS_WAIT),
                        "the key-set fetch of the reload is still running; reloading without waiting for it"
                    ),
                }
                let throttle =
                    (running.config().throttle == r.throttle).then(|| running.throttle().clone());
                (Some(kept), throttle)
            }
            (Some(r), _) => {
                let Some(verifier) = plan.verifier.take() else {
                    return Err(vec!["remote: no verifier was planned".into()]);
                };
                if let Err(e) = verifier.read_secrets() {
                    return Err(vec![format!(
                        "remote.introspection.client_secret_file: {}",
                        crate::error_chain(&e)
                    )]);
                }
                match tokio::time::timeout(START_BOUND, ready_verifier(verifier, &r.issuer)).await {
                    Ok(Ok(v)) => (Some(v), None),
                    Ok(Err(e)) => {
                        return Err(vec![format!(
                            "remote: the new verifier settings have no keys: {}",
                            crate::error_chain(&e)
                        )]);
                    }
                    Err(_) => {
                        return Err(vec![format!(
                            "remote: the new verifier's keys did not load within {}",
                            humantime::format_duration(START_BOUND)
                        )]);
                    }
                }
            }
        };
        let (loopback, remote) = carriers(
            &plan,
            Kept {
                audit: &self.audit,
                host: &self.host,
                metrics: &self.metrics,
                sockets: &self.sockets,
                verifier,
                throttle,
            },
        );
        Ok(Next {
            served: Served {
                plan,
                loopback,
                remote,
            },
        })
    }

    /// Hand the old carriers over, serve `next` on a fresh attach (with a new host
    /// bearer when `fresh` or when the loopback carrier changed); whether it was kept.
    async fn switch(self: &Arc<Self>, next: Next, fresh: bool) -> Result<bool, DaemonError> {
        let config = next.served.plan.config.clone();
        let new_bearer = fresh || self.served().plan.config.loopback != config.loopback;
        let handed = self.hand_over_carriers().await;
        *self.session.write() = None;
        self.retire_upstreams(handed);
        std::mem::replace(&mut *self.relays.write(), CancellationToken::new()).cancel();
        *self.served.write() = Arc::new(next.served);
        self.settle(&config).await?;
        self.attach_and_start(new_bearer).await?;
        let names: Vec<&str> = config.upstreams.iter().map(|u| u.name.as_str()).collect();
        self.metrics.retain_upstreams(&names);
        let keep: Vec<_> = listens(&config)
            .into_iter()
            .map(|(_, name, addr)| (name, addr))
            .collect();
        self.sockets.retain(&keep);
        self.generation.fetch_add(1, Ordering::Relaxed);
        tracing::info!(
            generation = self.generation.load(Ordering::Relaxed),
            host_bearer = if new_bearer { "new" } else { "kept" },
            "reloaded"
        );
        Ok(!new_bearer)
    }

    /// The process-wide parts a configuration sets: who may use the control socket, the
    /// job and grant limits, the metrics listener.
    async fn settle(self: &Arc<Self>, config: &Config) -> Result<(), DaemonError> {
        *self.control.write() = config.control.clone();
        self.host
            .jobs
            .set_max_running(config.tools.max_running_jobs);
        self.host
            .grants
            .set_limits(config.tools.permissions.clone());
        let current = self.scraper.lock().as_ref().map(|s| s.configured);
        if current != config.metrics {
            self.stop_metrics().await;
            if let Some(addr) = config.metrics {
                self.serve_metrics(addr)?;
            }
        }
        Ok(())
    }

    /// Serve `/metrics` on the socket kept for `addr`.
    pub(super) fn serve_metrics(self: &Arc<Self>, addr: SocketAddr) -> Result<(), DaemonError> {
        let listener = self
            .sockets
            .listener(Listener::Metrics, addr)
            .map_err(|source| DaemonError::Metrics { addr, source })?;
        let local = listener
            .local_addr()
            .map_err(|source| DaemonError::Metrics { addr, source })?;
        tracing::info!(address = %local, "metrics listener serving /metrics");
        let options = crate::carrier::http::Options {
            name: Listener::Metrics,
            bounds: super::METRICS_BOUNDS,
            tls: None,
            shared_peers: Vec::new(),
            ipv6_prefix: 64,
            metrics: self.metrics.clone(),
        };
        let stop = crate::transport::Drain::default();
        let task = tokio::spawn(crate::carrier::http::serve(
            listener,
            options,
            crate::carrier::scrape::Scrape::new(
                self.metrics.clone(),
                self.audit.clone(),
                self.health.clone(),
                local,
            ),
            stop.clone(),
        ));
        *self.scraper.lock() = Some(Scraper {
            configured: addr,
            address: local.to_string(),
            stop,
            task,
        });
        Ok(())
    }

    /// Stops the current session's upstreams (their children get SIGTERM, then SIGKILL),
    /// and waits for those a reload retired to be stopped.
    pub(super) async fn stop_upstreams(&self) {
        let current = self.upstreams.write().take();
        let retired = std::mem::take(&mut *self.retired.lock());
        let current = async {
            if let Some(upstreams) = current {
                upstreams.stop().await;
            }
        };
        tokio::join!(current, futures_util::future::join_all(retired));
    }

    /// A reload's end of the current session's upstreams: what the carriers handed over
    /// with them still serve (within their drain, §4.6) may call them, so they serve on
    /// ([`Upstreams::retire`]) until every one of those carriers has `ended`, and are
    /// stopped then.
    fn retire_upstreams(self: &Arc<Self>, ended: Vec<CancellationToken>) {
        let Some(upstreams) = self.upstreams.write().take() else {
            return;
        };
        upstreams.retire();
        let task = tokio::spawn(async move {
            futures_util::future::join_all(ended.iter().map(CancellationToken::cancelled)).await;
            upstreams.stop().await;
        });
        let mut retired = self.retired.lock();
        retired.retain(|t| !t.is_finished());
        retired.push(task);
    }

    /// The carriers' stop of a reload: they accept nothing more at once, and serve what
    /// they had accepted in the background (kept in `handed`, finished by a final stop).
    /// Returns what fires when each has ended.
    async fn hand_over_carriers(&self) -> Vec<CancellationToken> {
        let served = self.served();
        let mut handed = Vec::new();
        if let Some(l) = &served.loopback {
            handed.extend(l.hand_over().await);
        }
        if let Some(r) = &served.remote {
            handed.extend(r.hand_over().await);
        }
        let ended = handed.iter().map(crate::transport::Handed::ended).collect();
        let mut kept = self.handed.lock();
        kept.retain(|h| !h.is_finished());
        kept.extend(handed);
        ended
    }

    /// Stop every carrier: the current ones and those a reload handed over.
    pub(super) async fn stop_carriers(&self) {
        let handed = std::mem::take(&mut *self.handed.lock());
        futures_util::future::join_all(handed.into_iter().map(crate::transport::Handed::finish))
            .await;
        let served = self.served();
        let loopback = async {
            if let Some(l) = &served.loopback {
                l.stop().await;
            }
        };
        let remote = async {
            if let Some(r) = &served.remote {
                r.stop().await;
            }
        };
        tokio::join!(loopback, remote);
    }

    /// Stop the metrics listener (at the end of a stop).
    pub(super) async fn stop_metrics(&self) {
        let scraper = self.scraper.lock().take();
        if let Some(s) = scraper {
            s.stop.stop();
            let _ = s.task.await;
        }
    }
}

/// A reload's next state, ready to switch to.
struct Next {
    served: Served,
}

/// Every TCP address a configuration listens on, with its key.
/// The TCP listeners a configuration asks for, each with the key that sets it.
pub(super) fn listens(config: &Config) -> Vec<(&'static str, Listener, SocketAddr)> {
    let mut out = Vec::new();
    if let Some(l) = &config.loopback {
        out.push(("loopback.listen", Listener::Loopback, l.listen));
    }
    if let Some(r) = &config.remote {
        out.push(("remote.listen", Listener::Remote, r.listen));
    }
    if let Some(m) = config.metrics {
        out.push(("metrics.listen", Listener::Metrics, m));
    }
    out
}

/// Keys that belong to the process: a reload cannot change them.
fn fixed_keys(old: &Config, new: &Config) -> Vec<String> {
    let mut out = Vec::new();
    let mut fixed = |key: &str, a: &std::path::Path, b: &std::path::Path| {
        if a != b {
            out.push(format!(
                "{key}: changed from {} to {}; it takes effect only when the daemon starts again (systemctl restart robota-mcpd)",
                a.display(),
                b.display()
            ));
        }
    };
    fixed("daemon.state_dir", &old.state_dir, &new.state_dir);
    fixed("daemon.runtime_dir", &old.runtime_dir, &new.runtime_dir);
    fixed("control.socket", &old.control.socket, &new.control.socket);
    out
}

/// Every problem of a configuration that cannot be loaded or planned, one per entry.
fn problems_of(e: &super::plan::LoadError) -> Vec<String> {
    use super::plan::LoadError;
    match e {
        LoadError::Config(c) if !c.issues().is_empty() => {
            c.issues().iter().map(ToString::to_string).collect()
        }
        LoadError::Plan { error, .. } => vec![crate::error_chain(error)],
        LoadError::Config(_) => vec![crate::error_chain(e)],
    }
}

/// A new session generation: its upstreams started (in parallel, each within its connect
/// bound and all within [`UPSTREAM_START_BOUND`]; those not ready keep trying), then its
/// catalog (a collision their listings take part in refuses those names only) and the
/// session over it. The upstreams rebuild the catalog when their tools change.
pub(super) async fn start_session(
    plan: &Plan,
    host: &Arc<Host>,
    view: Arc<dyn HostView>,
) -> Result<(Arc<Session>, Arc<Upstreams>), DaemonError> {
    let upstreams = Arc::new(plan.upstreams(host.audit.clone()));
    if !upstreams.is_empty() {
        upstreams.start(UPSTREAM_START_BOUND).await;
    }
    let catalog = match plan.catalog(host, &upstreams) {
        Ok(catalog) => catalog,
        Err(e) => {
            upstreams.stop().await;
            return Err(e.into());
        }
    };
    upstreams.attach(&catalog);
    let session = Arc::new(plan.session(host, catalog, view));
    Ok((session, upstreams))
}

/// Start-up (and a reload or restart) runs code serving never runs again — the
/// configuration's checks, schema compilation, the store's migrations, the D-Bus handshake
/// — and the kernel maps an executable's pages 64 KiB around each page touched. Once ready,
/// the executable's resident pages that hold exactly its file's bytes are unmapped: the
/// page cache keeps them (a restart finds them there), what serving uses is mapped again on
/// first use, and the rest no longer counts as the daemon's memory. On a blocking thread:
/// reading `/proc/self/smaps` and advising each mapping is no work for a request worker.
fn release_start_up_code() {
    tokio::task::spawn_blocking(|| match robota_sys::unmap_clean_own_code() {
        Ok(bytes) => tracing::debug!(bytes, "the executable's start-up pages unmapped"),
        Err(e) => tracing::debug!(error = %e, "the executable's pages stay mapped"),
    });
}
