//! The running daemon: what was bound, the current session, and the lifecycle — attach
//! and start, restart (a fresh attach), stop.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::RwLock;
use robota_proto::Status;
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

use super::{DaemonError, Plan};
use crate::audit::Audit;
use crate::carrier::loopback::LoopbackCarrier;
use crate::carrier::remote::RemoteCarrier;
use crate::catalog::HostView;
use crate::host::Host;
use crate::notify;
use crate::session::Session;
use crate::transport::McpTransport;
use crate::upstream::Upstreams;
use crate::vocab::{Carrier, RefreshTrigger};

/// How long a reload waits for the key-set fetch it starts.
const RELOAD_KEYS_WAIT: Duration = Duration::from_secs(5);
/// How long a start or restart waits for the upstreams (each at most its own connect
/// bound): within the carriers' start bound.
pub(super) const UPSTREAM_START_BOUND: Duration = Duration::from_secs(15);

pub(super) type Loopback = McpTransport<Session, LoopbackCarrier>;
pub(super) type Remote = McpTransport<Session, RemoteCarrier>;

/// What the main loop is asked to do by the control plane.
pub(super) enum Op {
    Stop,
    Restart(oneshot::Sender<Result<Status, String>>),
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

/// Everything the control plane and `system.health` read.
pub(super) struct Core {
    pub plan: Plan,
    pub started: Instant,
    pub audit: Arc<Audit>,
    pub host: Arc<Host>,
    pub state: RwLock<State>,
    pub generation: AtomicU64,
    pub session: RwLock<Option<Arc<Session>>>,
    /// The downstream MCP servers of the current session.
    pub upstreams: RwLock<Option<Arc<Upstreams>>>,
    pub loopback: Option<Loopback>,
    pub remote: Option<Remote>,
    pub metrics_addr: RwLock<Option<String>>,
    pub control_path: String,
    /// Ends every MCP session relayed over the control socket; replaced at each attach.
    pub relays: RwLock<CancellationToken>,
    pub ops: mpsc::Sender<Op>,
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

impl Core {
    /// Every listener serving now, in one order for every view of them.
    pub(super) fn places(&self) -> Vec<Place> {
        let mut out = Vec::new();
        if let Some(address) = self.loopback.as_ref().and_then(|l| l.address()) {
            out.push(Place {
                name: Carrier::Loopback.as_str(),
                address,
                carrier: Some(Carrier::Loopback),
                public_url: None,
            });
        }
        if let Some(remote) = &self.remote
            && let Some(address) = remote.address()
        {
            out.push(Place {
                name: Carrier::Remote.as_str(),
                address,
                carrier: Some(Carrier::Remote),
                public_url: Some(remote.carrier().public_url().to_owned()),
            });
        }
        if let Some(address) = self.metrics_addr.read().clone() {
            out.push(Place {
                name: "metrics",
                address,
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

    /// `STATUS=` once serving.
    pub(super) fn ready_status(&self) -> String {
        let places: Vec<String> = self
            .places()
            .into_iter()
            .map(|p| format!("{}={}", p.name, p.address))
            .collect();
        format!("serving {}", places.join(" "))
    }

    /// A fresh session, attached to every HTTP carrier and started.
    pub(super) async fn attach_and_start(self: &Arc<Self>) -> Result<(), DaemonError> {
        let view = Arc::new(Board(Arc::downgrade(self)));
        let (session, upstreams) = start_session(&self.plan, &self.host, view).await?;
        *self.upstreams.write() = Some(upstreams);
        let config = &self.plan.config;
        if let (Some(loopback), Some(l)) = (&self.loopback, &config.loopback) {
            let failed = |source| DaemonError::Loopback {
                addr: l.listen,
                source,
            };
            loopback.attach(session.clone()).map_err(failed)?;
            let addr = loopback.start().await.map_err(failed)?;
            tracing::info!(address = %addr, path = %l.path, "loopback carrier serving");
        }
        if let (Some(remote), Some(r)) = (&self.remote, &config.remote) {
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

    /// A fresh attach: new session, new bearers, relayed sessions ended.
    pub(super) async fn restart(self: &Arc<Self>) -> Result<(), DaemonError> {
        *self.state.write() = State::Restarting;
        notify::reloading();
        tracing::info!("restarting: fresh attach, new bearers");
        self.reload_keys().await;
        self.stop_carriers().await;
        *self.session.write() = None;
        self.stop_upstreams().await;
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
        let refresh = remote.carrier().verifier().refresh(RefreshTrigger::Reload);
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

    /// Stops the current session's upstreams (their children get SIGTERM, then SIGKILL).
    pub(super) async fn stop_upstreams(&self) {
        let upstreams = self.upstreams.write().take();
        if let Some(upstreams) = upstreams {
            upstreams.stop().await;
        }
    }

    pub(super) async fn stop_carriers(&self) {
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
}

/// A new session generation: its upstreams started (in parallel, each within its connect
/// bound and all within [`UPSTREAM_START_BOUND`]; those not ready keep trying), then its
/// catalog — so a collision of names that can be seen now refuses the start — and the
/// session over it. The upstreams rebuild the catalog when their tools change.
pub(super) async fn start_session(
    plan: &Plan,
    host: &Arc<Host>,
    view: Arc<dyn HostView>,
) -> Result<(Arc<Session>, Arc<Upstreams>), DaemonError> {
    let upstreams = Arc::new(plan.upstreams());
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
