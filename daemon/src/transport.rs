//! The MCP transport service lifecycle (docs/design.md §3), one object per carrier.
//!
//! `attach(session)` then `start()`. Start validates the catalog's wire names, binds the
//! carrier and resolves only when it can serve; it is cancellable (by `stop()`) and
//! bounded to [`START_BOUND`]. Start before attach is `not-attached`, a second start is
//! `already-started`. `stop()` is idempotent and bounded to [`STOP_BOUND`]; afterwards
//! the session is detached, so a restart needs a fresh `attach`. `hand_over()` is the
//! stop of a reload: the carrier stops accepting at once (its socket, kept, is the next
//! carrier's), and what it accepted already is served on in the background — a request
//! under way is finished, and an idle connection gets the request its peer may be sending
//! at this very moment — then closed; the [`Handed`] it returns finishes that for good.

use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::config::WireNameProfile;
use crate::mcp::{InFlight, McpServer, Wire, WireError};
use crate::session::{RuntimeTools, TurnSubmission};

/// How long `start()` may take before it fails.
pub const START_BOUND: Duration = Duration::from_secs(15);
/// How long `stop()` waits for the carrier to close before aborting it.
pub const STOP_BOUND: Duration = Duration::from_secs(5);

/// How a carrier stops: `accept` ends its accept loop; `close_idle` also closes the
/// connections that are not serving a request (a final stop). `accept` alone is a hand-over
/// (a reload): an idle connection is given the request its peer may be sending before it
/// is closed, so a client that connected before the switch sees no difference.
#[derive(Clone, Default)]
pub struct Drain {
    pub accept: CancellationToken,
    pub close_idle: CancellationToken,
}

impl Drain {
    /// Stop for good: accept nothing more, close what is idle, finish what is under way.
    pub fn stop(&self) {
        self.accept.cancel();
        self.close_idle.cancel();
    }
}

/// A carrier handed over by a reload, still serving what it had accepted.
pub struct Handed {
    drain: Drain,
    ended: CancellationToken,
    task: JoinHandle<()>,
}

impl Handed {
    /// Fires once it has served everything it had, or was finished.
    pub fn ended(&self) -> CancellationToken {
        self.ended.clone()
    }

    /// Whether it has [ended](Self::ended).
    pub fn is_finished(&self) -> bool {
        self.ended.is_cancelled()
    }

    /// Close what is idle, wait (bounded by [`STOP_BOUND`]) for what is under way.
    pub async fn finish(mut self) {
        self.drain.stop();
        if tokio::time::timeout(STOP_BOUND, &mut self.task)
            .await
            .is_err()
        {
            self.task.abort();
        }
    }
}

/// A place MCP requests arrive: binds in `bind`, serves in `serve`.
pub trait Carrier: Send + Sync + 'static {
    /// What `bind` produced (a listener, a pipe). Dropping it releases the resource.
    type Bound: Send + 'static;

    /// The wire-name profile and aliases this carrier exposes.
    fn wire_names(&self) -> (WireNameProfile, std::collections::BTreeMap<String, String>);

    fn bind(&self) -> impl Future<Output = std::io::Result<Self::Bound>> + Send;

    /// A human-readable address of what was bound.
    fn address(bound: &Self::Bound) -> String;

    /// Serve until `drain` says to stop (then drain) or the carrier ends by itself.
    fn serve<S: RuntimeTools + TurnSubmission>(
        self: Arc<Self>,
        bound: Self::Bound,
        server: McpServer<S>,
        drain: Drain,
    ) -> impl Future<Output = ()> + Send + 'static;
}

#[derive(Debug, thiserror::Error)]
pub enum LifecycleError {
    #[error("not-attached: start() before attach()")]
    NotAttached,
    #[error("already-started: the transport is starting or serving")]
    AlreadyStarted,
    #[error("stopped during startup")]
    StoppedDuringStartup,
    #[error("start did not complete within {}s", START_BOUND.as_secs())]
    StartTimedOut,
    #[error("invalid wire names")]
    WireNames(#[source] WireError),
    #[error("cannot bind")]
    Bind(#[source] std::io::Error),
}

enum Phase<S> {
    Idle,
    Attached(Arc<S>),
    Starting { cancel: CancellationToken },
    Running(Running),
}

struct Running {
    drain: Drain,
    ended: CancellationToken,
    task: JoinHandle<()>,
    address: String,
}

/// One carrier's transport object.
pub struct McpTransport<S, C> {
    carrier: Arc<C>,
    wire: Wire,
    phase: Mutex<Phase<S>>,
}

impl<S: RuntimeTools + TurnSubmission, C: Carrier> McpTransport<S, C> {
    pub fn new(carrier: Arc<C>, wire: Wire) -> Self {
        Self {
            carrier,
            wire,
            phase: Mutex::new(Phase::Idle),
        }
    }

    pub fn carrier(&self) -> &Arc<C> {
        &self.carrier
    }

    /// Attach a session. Refused while starting or serving.
    pub fn attach(&self, session: Arc<S>) -> Result<(), LifecycleError> {
        let mut phase = self.phase.lock();
        match &*phase {
            Phase::Idle | Phase::Attached(_) => {
                *phase = Phase::Attached(session);
                Ok(())
            }
            Phase::Starting { .. } | Phase::Running(_) => Err(LifecycleError::AlreadyStarted),
        }
    }

    /// Validate, bind and begin serving; resolves with the bound address.
    pub async fn start(&self) -> Result<String, LifecycleError> {
        let cancel = CancellationToken::new();
        let session = {
            let mut phase = self.phase.lock();
            match std::mem::replace(
                &mut *phase,
                Phase::Starting {
                    cancel: cancel.clone(),
                },
            ) {
                Phase::Attached(session) => session,
                other => {
                    let err = match other {
                        Phase::Idle => LifecycleError::NotAttached,
                        _ => LifecycleError::AlreadyStarted,
                    };
                    *phase = other;
                    return Err(err);
                }
            }
        };
        let result = self.bring_up(session, &cancel).await;
        let mut phase = self.phase.lock();
        let still_ours = matches!(&*phase, Phase::Starting { cancel: c } if !c.is_cancelled());
        match result {
            Ok(running) if still_ours => {
                let address = running.address.clone();
                *phase = Phase::Running(running);
                Ok(address)
            }
            Ok(running) => {
                // stop() ran while we were binding: release what we bound.
                running.drain.stop();
                running.task.abort();
                Err(LifecycleError::StoppedDuringStartup)
            }
            Err(err) => {
                if still_ours {
                    *phase = Phase::Idle;
                }
                Err(err)
            }
        }
    }

    async fn bring_up(
        &self,
        session: Arc<S>,
        cancel: &CancellationToken,
    ) -> Result<Running, LifecycleError> {
        let (profile, aliases) = self.carrier.wire_names();
        let server = McpServer::new(
            session,
            profile,
            aliases,
            Arc::new(InFlight::default()),
            self.wire.clone(),
        )
        .map_err(LifecycleError::WireNames)?;
        let bound = tokio::select! {
            biased;
            () = cancel.cancelled() => return Err(LifecycleError::StoppedDuringStartup),
            bound = tokio::time::timeout(START_BOUND, self.carrier.bind()) => match bound {
                Err(_) => return Err(LifecycleError::StartTimedOut),
                Ok(Err(e)) => return Err(LifecycleError::Bind(e)),
                Ok(Ok(bound)) => bound,
            },
        };
        let address = C::address(&bound);
        let drain = Drain::default();
        let ended = CancellationToken::new();
        let serve = self.carrier.clone().serve(bound, server, drain.clone());
        let task = tokio::spawn({
            // Fired when serving ends, and when the task is aborted.
            let ended = ended.clone().drop_guard();
            async move {
                serve.await;
                drop(ended);
            }
        });
        Ok(Running {
            drain,
            ended,
            task,
            address,
        })
    }

    /// Stop serving and detach. Idempotent; bounded to [`STOP_BOUND`].
    pub async fn stop(&self) {
        let running = {
            let mut phase = self.phase.lock();
            match std::mem::replace(&mut *phase, Phase::Idle) {
                Phase::Starting { cancel } => {
                    cancel.cancel();
                    None
                }
                Phase::Running(running) => Some(running),
                Phase::Idle | Phase::Attached(_) => None,
            }
        };
        if let Some(mut running) = running {
            running.drain.stop();
            if tokio::time::timeout(STOP_BOUND, &mut running.task)
                .await
                .is_err()
            {
                tracing::warn!(address = %running.address, "carrier did not close within the stop bound; aborting it");
                running.task.abort();
            }
        }
    }

    /// The stop of a reload: accept nothing more and detach, at once; what was accepted is
    /// served on by the returned [`Handed`] until it ends or is finished. (Starting or
    /// idle: as `stop()`.)
    pub async fn hand_over(&self) -> Option<Handed> {
        let running = {
            let mut phase = self.phase.lock();
            match std::mem::replace(&mut *phase, Phase::Idle) {
                Phase::Running(running) => Some(running),
                other => {
                    *phase = other;
                    None
                }
            }
        };
        let Some(running) = running else {
            self.stop().await;
            return None;
        };
        running.drain.accept.cancel();
        Some(Handed {
            drain: running.drain,
            ended: running.ended,
            task: running.task,
        })
    }

    /// The bound address while serving.
    pub fn address(&self) -> Option<String> {
        match &*self.phase.lock() {
            Phase::Running(r) => Some(r.address.clone()),
            _ => None,
        }
    }

    /// Fires when the carrier stops serving by itself (stdin closed) or after `stop()`.
    pub fn ended(&self) -> Option<CancellationToken> {
        match &*self.phase.lock() {
            Phase::Running(r) => Some(r.ended.clone()),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;
    use crate::session::Session;
    use crate::session::tests::session;

    /// A carrier whose bind waits for the test to release it, so start-up can be observed.
    struct Gate {
        release: tokio::sync::Semaphore,
        released: AtomicUsize,
        profile: WireNameProfile,
    }

    impl Gate {
        fn new(permits: usize) -> Arc<Self> {
            Arc::new(Self {
                release: tokio::sync::Semaphore::new(permits),
                released: AtomicUsize::new(0),
                profile: WireNameProfile::Canonical,
            })
        }
    }

    impl Carrier for Gate {
        type Bound = Arc<AtomicUsize>;

        fn wire_names(&self) -> (WireNameProfile, BTreeMap<String, String>) {
            (self.profile, BTreeMap::new())
        }

        async fn bind(&self) -> std::io::Result<Self::Bound> {
            self.release.acquire().await.expect("open").forget();
            Ok(Arc::new(AtomicUsize::new(0)))
        }

        fn address(_bound: &Self::Bound) -> String {
            "gate".into()
        }

        async fn serve<S: RuntimeTools + TurnSubmission>(
            self: Arc<Self>,
            _bound: Self::Bound,
            _server: McpServer<S>,
            drain: Drain,
        ) {
            drain.accept.cancelled().await;
            self.released.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn transport(gate: &Arc<Gate>) -> Arc<McpTransport<Session, Gate>> {
        let wire = Wire {
            result_limit: 1024,
            metrics: crate::metrics::Metrics::new(),
        };
        Arc::new(McpTransport::new(gate.clone(), wire))
    }

    #[tokio::test]
    async fn start_before_attach_is_not_attached() {
        let t = transport(&Gate::new(1));
        assert!(matches!(t.start().await, Err(LifecycleError::NotAttached)));
    }

    #[tokio::test]
    async fn second_start_is_already_started() {
        let gate = Gate::new(2);
        let t = transport(&gate);
        t.attach(Arc::new(session(""))).unwrap();
        assert_eq!(t.start().await.unwrap(), "gate");
        assert!(matches!(
            t.start().await,
            Err(LifecycleError::AlreadyStarted)
        ));
        assert!(matches!(
            t.attach(Arc::new(session(""))),
            Err(LifecycleError::AlreadyStarted)
        ));
        t.stop().await;
        assert_eq!(gate.released.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn stop_is_idempotent_and_detaches() {
        let gate = Gate::new(2);
        let t = transport(&gate);
        t.stop().await;
        t.attach(Arc::new(session(""))).unwrap();
        t.start().await.unwrap();
        t.stop().await;
        t.stop().await;
        assert!(t.address().is_none());
        // A restart needs a fresh attach.
        assert!(matches!(t.start().await, Err(LifecycleError::NotAttached)));
        t.attach(Arc::new(session(""))).unwrap();
        t.start().await.unwrap();
        t.stop().await;
        assert_eq!(gate.released.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn stop_during_startup_fails_the_start() {
        let gate = Gate::new(0);
        let t = transport(&gate);
        t.attach(Arc::new(session(""))).unwrap();
        let starting = tokio::spawn({
            let t = t.clone();
            async move { t.start().await }
        });
        // Wait until start() is parked in bind.
        while !matches!(&*t.phase.lock(), Phase::Starting { .. }) {
            tokio::task::yield_now().await;
        }
        t.stop().await;
        assert!(matches!(
            starting.await.unwrap(),
            Err(LifecycleError::StoppedDuringStartup)
        ));
        gate.release.add_permits(1);
        assert!(matches!(t.start().await, Err(LifecycleError::NotAttached)));
    }

    #[tokio::test(start_paused = true)]
    async fn start_is_bounded() {
        let gate = Gate::new(0);
        let t = transport(&gate);
        t.attach(Arc::new(session(""))).unwrap();
        let started = tokio::time::Instant::now();
        assert!(matches!(
            t.start().await,
            Err(LifecycleError::StartTimedOut)
        ));
        assert_eq!(started.elapsed(), START_BOUND);
        // A failed start leaves the transport detached.
        assert!(matches!(t.start().await, Err(LifecycleError::NotAttached)));
    }

    #[tokio::test]
    async fn wire_name_collisions_fail_start() {
        let gate = Arc::new(Gate {
            release: tokio::sync::Semaphore::new(1),
            released: AtomicUsize::new(0),
            profile: WireNameProfile::Compat,
        });
        let t = transport(&gate);
        t.attach(Arc::new(session(
            "[session]\nsubmission_tool = \"system_info\"\n",
        )))
        .unwrap();
        let err = t.start().await.unwrap_err();
        assert!(
            matches!(err, LifecycleError::WireNames(WireError::Collision { .. })),
            "{err}"
        );
    }
}
