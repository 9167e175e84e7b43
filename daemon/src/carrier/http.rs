//! A bounded HTTP/1.1 + HTTP/2 (prior knowledge or ALPN) server loop shared by the HTTP
//! listeners (the loopback and remote carriers, `/metrics`).
//!
//! What a peer can hold, and for how long:
//! - **Slots.** At most `max_connections` connections, and at most
//!   `max_connections_per_address` from one client address (IPv6 by its /64; peers in
//!   `shared_peers`, the trusted proxies, are exempt, since every client behind one shares
//!   its address). A connection that has not sent a complete request head — never, or not
//!   since its last answer — and whose every byte so far has been read (we are waiting on
//!   the peer) is *idle*; one whose requests in flight all wait on their own verification
//!   (a token with the issuer, a signature check in the suspects' lane: the handler says
//!   so with [`give_way`]) is as good as unauthenticated. When the listener (or the
//!   address) is full, the oldest connection that is idle or unauthenticated gives way to
//!   the new one — one that never sent a head or whose requests are being verified before
//!   one kept alive after an answer; when none can, the new one is refused at once (`503`
//!   on plain HTTP, a close on TLS) and counted. So a flood of silent or slow sockets, or of
//!   tokens the issuer is slow to judge, keeps each other out, not the clients that hold a
//!   valid credential.
//! - **Deadlines.** Every byte before the first complete request head — the TLS
//!   handshake, HTTP/1-vs-HTTP/2 detection, the HTTP/2 preface and SETTINGS, the head
//!   itself — is under `header_timeout`, counted from accept. After an answer, an HTTP/1.1
//!   connection must start its next head within `header_timeout` (hyper's own timer), an
//!   HTTP/2 connection with no open stream is closed (GOAWAY) after `idle_timeout`; long
//!   requests on HTTP/2 are kept honest by pings.
//! - **Heads.** Header bytes and count are capped on both protocols; an answer of 431 is
//!   booked through [`Handler::head_refused`].
//!
//! Shutdown ([`Drain`]) stops accepting, then each connection finishes what it serves
//! and closes. On a final stop an idle connection is closed at once; on a hand-over (a
//! reload: the socket serves on under the next carrier) an idle one first gets the request
//! its peer may already be sending — closing it under that request would reset it — for
//! at most [`DRAIN_GRACE`]. The transport bounds the wait of a final stop.

use std::cmp::Reverse;
use std::collections::{BTreeSet, HashMap};
use std::convert::Infallible;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::combinators::BoxBody;
use hyper::body::{Frame, Incoming, SizeHint};
use hyper::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use parking_lot::Mutex;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::HttpLimits;
use crate::metrics::Metrics;
use crate::transport::Drain;
use crate::vocab::{ConnOutcome, Listener, address_group};

/// The response body type every carrier answers with.
pub type Body = BoxBody<Bytes, Infallible>;

/// Most headers in one request, on both protocols.
pub const MAX_HEADERS: usize = 64;

/// How long a connection may take to finish its in-flight requests after shutdown
/// starts; then it is closed, which cancels whatever it was still running. Below the
/// transport's stop bound.
pub const DRAIN_GRACE: Duration = Duration::from_secs(4);

/// How long an idle HTTP/2 connection closed by its idle deadline gets to see its GOAWAY.
const GOAWAY_GRACE: Duration = Duration::from_secs(1);

/// HTTP/2 pings on a connection with a request in flight, to notice a vanished peer.
const H2_PING_EVERY: Duration = Duration::from_secs(20);
const H2_PING_TIMEOUT: Duration = Duration::from_secs(10);

/// What a full listener writes to a plain-text peer it cannot make room for.
const BUSY: &[u8] = b"HTTP/1.1 503 Service Unavailable\r\nretry-after: 1\r\ncontent-length: 0\r\nconnection: close\r\n\r\n";

/// Marks a response to a request that was not admitted (a refusal, a 404, metadata): the
/// connection counts as one that has not been served, so it is evicted first and held
/// only to the head deadline — an unauthenticated peer cannot keep slots by asking.
#[derive(Debug, Clone, Copy)]
pub struct Unadmitted;

/// `response`, marked [`Unadmitted`].
pub fn unadmitted(mut response: Response<Body>) -> Response<Body> {
    response.extensions_mut().insert(Unadmitted);
    response
}

/// Why a request was refused on its head, before any handler saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeadRefusal {
    /// 431: more header bytes or more headers than allowed.
    TooLarge,
}

/// Handles one request; gets the TCP peer address.
pub trait Handler: Clone + Send + Sync + 'static {
    fn handle(
        &self,
        req: Request<Incoming>,
        peer: SocketAddr,
    ) -> impl Future<Output = Response<Body>> + Send;

    /// A request refused on its head by the listener itself (it never reached `handle`).
    fn head_refused(&self, _peer: SocketAddr, _why: HeadRefusal) {}
}

/// How a listener is run.
pub struct Options {
    /// The `listener` label of its metrics.
    pub name: Listener,
    pub bounds: HttpLimits,
    /// Terminate TLS here (h2 and http/1.1 by ALPN).
    pub tls: Option<tokio_rustls::TlsAcceptor>,
    /// Peers exempt from the per-address cap (trusted proxies).
    pub shared_peers: Vec<ipnet::IpNet>,
    /// IPv6 peers are counted per address group of this prefix length.
    pub ipv6_prefix: u8,
    pub metrics: Metrics,
}

fn builder(bounds: &HttpLimits) -> auto::Builder<TokioExecutor> {
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(bounds.header_timeout)
        .max_buf_size(bounds.max_header_bytes.max(8192))
        .max_headers(MAX_HEADERS);
    // HTTP/2's own cap is a backstop at twice ours; up to it a request reaches the
    // listener's check below, which answers 431 and books it.
    let h2_hard = bounds.max_header_bytes.saturating_mul(2) + 32 * MAX_HEADERS;
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_header_list_size(u32::try_from(h2_hard).unwrap_or(u32::MAX))
        .max_concurrent_streams(u32::try_from(bounds.max_in_flight).unwrap_or(u32::MAX))
        .keep_alive_interval(H2_PING_EVERY)
        .keep_alive_timeout(H2_PING_TIMEOUT);
    builder
}

/// Serve `listener` until `drain` says to stop accepting, then drain the open connections.
pub async fn serve<H: Handler>(listener: TcpListener, options: Options, handler: H, drain: Drain) {
    let Options {
        name,
        bounds,
        tls,
        shared_peers,
        ipv6_prefix,
        metrics,
    } = options;
    let builder = Arc::new(builder(&bounds));
    let table = Arc::new(Table::new(
        bounds.max_connections,
        bounds.max_connections_per_address,
    ));
    let tracker = TaskTracker::new();
    let refusals = RefusalLog::default();
    loop {
        let (stream, peer) = tokio::select! {
            biased;
            () = drain.accept.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok(pair) => pair,
                Err(e) => {
                    // EMFILE and friends: back off instead of spinning.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
        };
        let group = (!shared_peers.iter().any(|net| net.contains(&peer.ip())))
            .then(|| address_group(peer.ip(), ipv6_prefix));
        let (ticket, evicted) = table.admit(group, Instant::now());
        if evicted {
            metrics.connection(name, ConnOutcome::Evicted);
        }
        let Some(ticket) = ticket else {
            metrics.connection(name, ConnOutcome::Refused);
            refusals.note(name, &bounds);
            if tls.is_none() {
                refusals.answer(stream, &tracker);
            }
            continue;
        };
        metrics.connection(name, ConnOutcome::Accepted);
        let _ = stream.set_nodelay(true);
        let conn = Conn {
            builder: builder.clone(),
            handler: handler.clone(),
            peer,
            bounds,
            name,
            metrics: metrics.clone(),
            ticket,
        };
        let (drain, tls) = (drain.clone(), tls.clone());
        tracker.spawn(async move {
            let open = conn.metrics.open_connection(name);
            conn.run(stream, tls, &drain).await;
            drop(open);
        });
    }
    drop(listener);
    tracker.close();
    tracker.wait().await;
}

/// One accepted connection.
struct Conn<H> {
    builder: Arc<auto::Builder<TokioExecutor>>,
    handler: H,
    peer: SocketAddr,
    bounds: HttpLimits,
    name: Listener,
    metrics: Metrics,
    ticket: Ticket,
}

/// How a connection's deadline ran out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Expired {
    /// No complete request head within `header_timeout` of accept.
    Head,
    /// No request since the last answer within the idle deadline.
    Idle,
}

impl<H: Handler> Conn<H> {
    async fn run(self, stream: TcpStream, tls: Option<tokio_rustls::TlsAcceptor>, drain: &Drain) {
        let kill = self.ticket.kill.clone();
        let stream = Watched {
            io: stream,
            waiting: self.ticket.waiting.clone(),
        };
        match tls {
            None => {
                tokio::select! {
                    biased;
                    () = kill.cancelled() => {}
                    () = self.serve(TokioIo::new(stream), drain) => {}
                }
            }
            Some(acceptor) => {
                let deadline = self.ticket.deadline(&self.bounds);
                let stream = tokio::select! {
                    biased;
                    () = kill.cancelled() => return,
                    expired = deadline => {
                        self.metrics.connection(self.name, expired.outcome());
                        return;
                    }
                    accepted = acceptor.accept(stream) => match accepted {
                        Ok(stream) => stream,
                        Err(_) => return,
                    },
                };
                tokio::select! {
                    biased;
                    () = kill.cancelled() => {}
                    () = self.serve(TokioIo::new(stream), drain) => {}
                }
            }
        }
    }

    async fn serve<I>(&self, io: I, drain: &Drain)
    where
        I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
    {
        let service = {
            let (handler, peer, ticket) = (self.handler.clone(), self.peer, self.ticket.clone());
            let max_header_bytes = self.bounds.max_header_bytes;
            hyper::service::service_fn(move |mut req: Request<Incoming>| {
                let busy = ticket.busy();
                req.extensions_mut().insert(ticket.clone());
                let handler = handler.clone();
                async move {
                    let response = if head_too_large(&req, max_header_bytes) {
                        handler.head_refused(peer, HeadRefusal::TooLarge);
                        discard_body(req);
                        unadmitted(empty(http::StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE))
                    } else {
                        handler.handle(req, peer).await
                    };
                    let refusal = response
                        .extensions()
                        .get::<Unadmitted>()
                        .is_some()
                        .then(|| {
                            busy.0.unserve();
                            Yielded::start(&busy.0)
                        });
                    Ok::<_, Infallible>(response.map(|body| Tracked {
                        body,
                        _busy: busy,
                        _refusal: refusal,
                    }))
                }
            })
        };
        let conn = self.builder.serve_connection(io, service);
        tokio::pin!(conn);
        let deadline = self.ticket.deadline(&self.bounds);
        tokio::pin!(deadline);
        tokio::select! {
            result = conn.as_mut() => {
                if let Err(e) = result {
                    self.connection_error(&*e);
                }
            }
            () = drain.accept.cancelled() => {
                // Handed over: an idle connection may have a request on its way (even in
                // the kernel's buffer, unread); serve it before closing. A final stop does
                // not wait.
                if !self.ticket.is_busy() {
                    tokio::select! {
                        biased;
                        () = drain.close_idle.cancelled() => {}
                        () = self.ticket.until_busy() => {}
                        () = tokio::time::sleep(DRAIN_GRACE) => {}
                        result = conn.as_mut() => {
                            if let Err(e) = result {
                                self.connection_error(&*e);
                            }
                            return;
                        }
                    }
                }
                conn.as_mut().graceful_shutdown();
                let _ = tokio::time::timeout(DRAIN_GRACE, conn).await;
            }
            expired = &mut deadline => {
                self.metrics.connection(self.name, expired.outcome());
                if expired == Expired::Idle {
                    conn.as_mut().graceful_shutdown();
                    let _ = tokio::time::timeout(GOAWAY_GRACE, conn).await;
                }
            }
        }
    }

    /// Book what hyper ended a connection for: a head over the caps (hyper answered 431
    /// itself) or hyper's own head deadline.
    fn connection_error(&self, error: &(dyn std::error::Error + 'static)) {
        let Some(e) = error.downcast_ref::<hyper::Error>() else {
            return;
        };
        if e.is_parse_too_large() {
            self.handler.head_refused(self.peer, HeadRefusal::TooLarge);
        } else if e.is_timeout() {
            let expired = if self.ticket.served() == 0 {
                Expired::Head
            } else {
                Expired::Idle
            };
            self.metrics.connection(self.name, expired.outcome());
        }
    }
}

impl Expired {
    fn outcome(self) -> ConnOutcome {
        match self {
            Expired::Head => ConnOutcome::HeadTimeout,
            Expired::Idle => ConnOutcome::IdleTimeout,
        }
    }
}

/// HTTP/2 heads over our caps (HTTP/1.1 heads are capped by hyper's parser).
fn head_too_large(req: &Request<Incoming>, max_header_bytes: usize) -> bool {
    if req.version() != http::Version::HTTP_2 {
        return false;
    }
    let headers = req.headers();
    headers.len() > MAX_HEADERS
        || headers
            .iter()
            .map(|(name, value)| name.as_str().len() + value.len())
            .sum::<usize>()
            > max_header_bytes
}

/// Whether a connection is serving a request, or idle since when.
#[derive(Debug, Clone, Copy)]
enum Phase {
    Busy,
    Idle { since: Instant, served: u64 },
}

struct Slot {
    group: Option<IpAddr>,
    /// Requests in flight.
    active: usize,
    /// Requests in flight that are waiting on their own verification ([`give_way`]).
    yielding: usize,
    served: u64,
    /// Since when the connection has been idle, or serving only requests that are not
    /// admitted yet.
    idle_since: Instant,
    /// Our last read found nothing more to read: we are waiting on the peer.
    waiting: Arc<AtomicBool>,
    kill: CancellationToken,
    phase: watch::Sender<Phase>,
}

impl Slot {
    /// Whether a newcomer may take this slot: every request in flight (if any) is waiting
    /// on its own verification. An idle connection must also have had all its bytes read
    /// ([`Inner::evictable`]); one whose requests wait on their credentials (a token with
    /// the issuer, say) is as good as unauthenticated.
    fn may_give_way(&self) -> bool {
        self.active <= self.yielding
    }

    /// Where a slot that may give way sorts among the candidates for eviction: the
    /// unauthenticated first — never served, or with requests still being verified —
    /// then those kept alive after an answer, oldest first within each.
    fn key(&self, id: u64) -> IdleKey {
        let kept_alive = self.served > 0 && self.active == 0;
        (u8::from(kept_alive), self.idle_since, id)
    }
}

type IdleKey = (u8, Instant, u64);

/// Every open connection of a listener: the caps, and which idle one goes first.
struct Table {
    max: usize,
    per_address: Option<usize>,
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    next: u64,
    slots: HashMap<u64, Slot>,
    /// Connections by address group (`None`: trusted proxies', exempt from the per-address
    /// cap), each with those that may give way in eviction order.
    groups: HashMap<Option<IpAddr>, Group>,
    /// Address groups by how many connections they hold, the most first.
    by_size: BTreeSet<(Reverse<usize>, IpAddr)>,
}

#[derive(Default)]
struct Group {
    open: usize,
    idle: BTreeSet<IdleKey>,
}

impl Inner {
    /// The first connection of `group`, in eviction order, that may give way: one before
    /// admission, or an idle one waiting on its peer.
    fn evictable_in(&self, group: Option<IpAddr>) -> Option<IdleKey> {
        self.evictable_by(group, true)
    }

    /// [`Self::evictable_in`]; a connection whose request is being verified only when
    /// `requests` is set.
    fn evictable_by(&self, group: Option<IpAddr>, requests: bool) -> Option<IdleKey> {
        self.groups
            .get(&group)?
            .idle
            .iter()
            .copied()
            .find(|(_, _, id)| {
                self.slots.get(id).is_some_and(|s| {
                    (s.active > 0 && requests)
                        || (s.active == 0 && s.waiting.load(Ordering::Relaxed))
                })
            })
    }

    /// The connection that gives way when the listener is full: from the address group
    /// holding the most connections that has one that may (the first in eviction order
    /// among groups of that size), trusted proxies' last. So peers that fill the listener
    /// from a few addresses make room from their own connections, never from a client
    /// holding one.
    ///
    /// Only a group at least as big as the newcomer's would be gives way to it (its own
    /// always may), and a connection whose request is being verified only to a newcomer
    /// whose group would then hold fewer: a client holding one connection never loses it
    /// to a peer that holds more, and its request with the issuer is never abandoned for
    /// a peer that holds as many.
    fn evictable(&self, newcomer: Option<IpAddr>) -> Option<u64> {
        let theirs = newcomer.map_or(0, |g| self.groups.get(&Some(g)).map_or(0, |g| g.open) + 1);
        let mut best: Option<(usize, IdleKey)> = None;
        for &(Reverse(open), group) in &self.by_size {
            if best.is_some_and(|(size, _)| open < size) {
                break;
            }
            // Its own group, or a bigger one: anything that may give way. One of the
            // newcomer's size: only an idle connection. A smaller one: nothing.
            let own = newcomer == Some(group);
            if !own && open < theirs {
                continue;
            }
            if let Some(key) = self.evictable_by(Some(group), own || open > theirs)
                && best.is_none_or(|(_, b)| key < b)
            {
                best = Some((open, key));
            }
        }
        best.map(|(_, key)| key)
            .or_else(|| self.evictable_in(None))
            .map(|(_, _, id)| id)
    }

    fn resize(&mut self, group: Option<IpAddr>, change: impl FnOnce(&mut usize)) {
        let entry = self.groups.entry(group).or_default();
        let before = entry.open;
        change(&mut entry.open);
        let after = entry.open;
        if after == 0 {
            self.groups.remove(&group);
        }
        if let Some(g) = group {
            self.by_size.remove(&(Reverse(before), g));
            if after > 0 {
                self.by_size.insert((Reverse(after), g));
            }
        }
    }

    /// Takes `id` out of the eviction order, applies `change`, and puts it back where it
    /// now belongs (if it may give way).
    fn rekey(&mut self, id: u64, change: impl FnOnce(&mut Slot)) {
        let Some(slot) = self.slots.get_mut(&id) else {
            return;
        };
        let before = slot.may_give_way().then(|| slot.key(id));
        change(slot);
        let after = slot.may_give_way().then(|| slot.key(id));
        let group = slot.group;
        if before == after {
            return;
        }
        if let Some(group) = self.groups.get_mut(&group) {
            if let Some(key) = before {
                group.idle.remove(&key);
            }
            if let Some(key) = after {
                group.idle.insert(key);
            }
        }
    }

    fn remove(&mut self, id: u64) -> Option<Slot> {
        let slot = self.slots.remove(&id)?;
        if slot.may_give_way()
            && let Some(group) = self.groups.get_mut(&slot.group)
        {
            group.idle.remove(&slot.key(id));
        }
        self.resize(slot.group, |open| *open -= 1);
        Some(slot)
    }

    /// Every connection that may give way, in no particular order.
    #[cfg(test)]
    fn idle_ids(&self) -> Vec<u64> {
        self.groups
            .values()
            .flat_map(|g| g.idle.iter().map(|&(_, _, id)| id))
            .collect()
    }

    /// A request head arrived on `id`: the connection holds its slot.
    fn start_request(&mut self, id: u64) {
        self.rekey(id, |slot| {
            if slot.active == 0 {
                slot.phase.send_replace(Phase::Busy);
            }
            slot.active += 1;
            slot.served += 1;
        });
    }

    /// A request on `id` waits on its own verification (`true`), or no longer does.
    fn yielding(&mut self, id: u64, starts: bool, now: Instant) {
        self.rekey(id, |slot| {
            if starts {
                slot.yielding += 1;
                slot.idle_since = now;
            } else {
                slot.yielding = slot.yielding.saturating_sub(1);
            }
        });
    }

    /// A request on `id` was answered (or dropped).
    fn end_request(&mut self, id: u64, now: Instant) {
        self.rekey(id, |slot| {
            slot.active = slot.active.saturating_sub(1);
            if slot.active == 0 {
                slot.idle_since = now;
                slot.phase.send_replace(Phase::Idle {
                    since: now,
                    served: slot.served,
                });
            }
        });
    }
}

impl Table {
    fn new(max: usize, per_address: Option<usize>) -> Self {
        Self {
            max,
            per_address,
            inner: Mutex::new(Inner::default()),
        }
    }

    /// A slot for a new connection from `group` (None: exempt from the per-address cap),
    /// making room by evicting the oldest idle connection when full. Returns the ticket
    /// (None: refused, nothing could give way) and whether a connection was evicted.
    fn admit(self: &Arc<Self>, group: Option<IpAddr>, now: Instant) -> (Option<Ticket>, bool) {
        let mut inner = self.inner.lock();
        let mut evicted = false;
        let group_full = match (group, self.per_address) {
            (Some(_), Some(cap)) => inner.groups.get(&group).is_some_and(|g| g.open >= cap),
            _ => false,
        };
        if group_full {
            match inner.evictable_in(group).map(|(_, _, id)| id) {
                Some(id) => {
                    evict(&mut inner, id);
                    evicted = true;
                }
                None => return (None, evicted),
            }
        }
        if inner.slots.len() >= self.max {
            match inner.evictable(group) {
                Some(id) => {
                    evict(&mut inner, id);
                    evicted = true;
                }
                None => return (None, evicted),
            }
        }
        let id = inner.next;
        inner.next += 1;
        let kill = CancellationToken::new();
        let waiting = Arc::new(AtomicBool::new(false));
        let (phase, _) = watch::channel(Phase::Idle {
            since: now,
            served: 0,
        });
        inner.slots.insert(
            id,
            Slot {
                group,
                active: 0,
                yielding: 0,
                served: 0,
                idle_since: now,
                waiting: waiting.clone(),
                kill: kill.clone(),
                phase,
            },
        );
        inner.resize(group, |open| *open += 1);
        if let Some(g) = inner.groups.get_mut(&group) {
            g.idle.insert((0, now, id));
        }
        let ticket = Ticket(Arc::new(TicketInner {
            table: self.clone(),
            id,
            kill,
            waiting,
        }));
        (Some(ticket), evicted)
    }
}

fn evict(inner: &mut Inner, id: u64) {
    if let Some(slot) = inner.remove(id) {
        slot.kill.cancel();
    }
}

/// A connection's hold on its slot; released when the connection task ends.
#[derive(Clone)]
struct Ticket(Arc<TicketInner>);

struct TicketInner {
    table: Arc<Table>,
    id: u64,
    kill: CancellationToken,
    waiting: Arc<AtomicBool>,
}

impl std::ops::Deref for Ticket {
    type Target = TicketInner;
    fn deref(&self) -> &TicketInner {
        &self.0
    }
}

impl Drop for TicketInner {
    fn drop(&mut self) {
        self.table.inner.lock().remove(self.id);
    }
}

impl Ticket {
    /// A request head arrived: the connection is busy until the guard (moved into the
    /// response body) is dropped.
    fn busy(&self) -> Busy {
        self.table.inner.lock().start_request(self.id);
        Busy(self.clone())
    }

    /// Whether a request is in flight on this connection.
    fn is_busy(&self) -> bool {
        self.table
            .inner
            .lock()
            .slots
            .get(&self.id)
            .is_some_and(|s| s.active > 0)
    }

    /// The connection's phase as it changes (`None`: evicted already).
    fn phase(&self) -> Option<watch::Receiver<Phase>> {
        self.table
            .inner
            .lock()
            .slots
            .get(&self.id)
            .map(|s| s.phase.subscribe())
    }

    /// Resolves once a request is in flight on this connection.
    async fn until_busy(&self) {
        let Some(mut rx) = self.phase() else {
            return std::future::pending().await;
        };
        if rx.wait_for(|p| matches!(p, Phase::Busy)).await.is_err() {
            std::future::pending::<()>().await;
        }
    }

    /// The request just answered was not admitted: it does not count as served.
    fn unserve(&self) {
        if let Some(slot) = self.table.inner.lock().slots.get_mut(&self.id) {
            slot.served = slot.served.saturating_sub(1);
        }
    }

    fn served(&self) -> u64 {
        self.table
            .inner
            .lock()
            .slots
            .get(&self.id)
            .map_or(0, |s| s.served)
    }

    /// Resolves when the connection has been idle too long: before its first request,
    /// `header_timeout` from accept; after one, `idle_timeout` from the last answer.
    fn deadline(&self, bounds: &HttpLimits) -> impl Future<Output = Expired> + Send + 'static {
        let rx = self.phase();
        let (head, idle) = (bounds.header_timeout, bounds.idle_timeout);
        async move {
            // Evicted before we looked: the kill token ends the connection.
            let Some(mut rx) = rx else {
                return std::future::pending().await;
            };
            loop {
                let phase = *rx.borrow_and_update();
                match phase {
                    Phase::Busy => {
                        if rx.changed().await.is_err() {
                            return std::future::pending().await;
                        }
                    }
                    Phase::Idle { since, served } => {
                        let (limit, expired) = if served == 0 {
                            (head, Expired::Head)
                        } else {
                            (idle, Expired::Idle)
                        };
                        tokio::select! {
                            () = tokio::time::sleep_until(since + limit) => return expired,
                            changed = rx.changed() => if changed.is_err() {
                                return std::future::pending().await;
                            },
                        }
                    }
                }
            }
        }
    }
}

/// A connection's stream, noting whether our last read found nothing more to read.
struct Watched<T> {
    io: T,
    waiting: Arc<AtomicBool>,
}

impl<T: tokio::io::AsyncRead + Unpin> tokio::io::AsyncRead for Watched<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.io).poll_read(cx, buf);
        match &polled {
            Poll::Pending => self.waiting.store(true, Ordering::Relaxed),
            Poll::Ready(Ok(())) if buf.filled().len() > before => {
                self.waiting.store(false, Ordering::Relaxed);
            }
            Poll::Ready(_) => {}
        }
        polled
    }
}

impl<T: tokio::io::AsyncWrite + Unpin> tokio::io::AsyncWrite for Watched<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}

/// Marks its connection busy while it lives.
struct Busy(Ticket);

impl Drop for Busy {
    fn drop(&mut self) {
        let id = self.0.id;
        self.0.table.inner.lock().end_request(id, Instant::now());
    }
}

/// While it lives, its request waits on its own verification (a token with the issuer, a
/// signature check in the suspects' lane), and its connection counts as unauthenticated:
/// it gives way to a newcomer like one that never sent a request, so a request nobody has
/// authenticated yet never holds a slot a newcomer cannot take.
pub struct Yielded(Ticket);

impl Yielded {
    fn start(ticket: &Ticket) -> Self {
        ticket
            .table
            .inner
            .lock()
            .yielding(ticket.id, true, Instant::now());
        Yielded(ticket.clone())
    }
}

impl Drop for Yielded {
    fn drop(&mut self) {
        let id = self.0.id;
        self.0
            .table
            .inner
            .lock()
            .yielding(id, false, Instant::now());
    }
}

/// Marks `req` (come through [`serve`]) as waiting on its own verification until the
/// returned guard is dropped.
pub fn give_way<B>(req: &Request<B>) -> Option<Yielded> {
    req.extensions().get::<Ticket>().map(Yielded::start)
}

/// A response body that keeps its connection busy until it has been sent (or dropped).
struct Tracked {
    body: Body,
    _busy: Busy,
    /// A refusal being written: its connection counts as unauthenticated meanwhile.
    _refusal: Option<Yielded>,
}

impl hyper::body::Body for Tracked {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

/// Refusals of a full listener: logged at most once per interval with how many, and
/// answered `503` on plain HTTP.
struct RefusalLog {
    refused: AtomicU64,
    last: Mutex<Option<Instant>>,
    /// Refused connections being closed gracefully now.
    lingering: Arc<tokio::sync::Semaphore>,
}

impl Default for RefusalLog {
    fn default() -> Self {
        Self {
            refused: AtomicU64::new(0),
            last: Mutex::new(None),
            lingering: Arc::new(tokio::sync::Semaphore::new(LINGERING)),
        }
    }
}

/// Refused connections closed gracefully at once; past that they are just closed.
const LINGERING: usize = 64;
/// How long a refused peer has to read our answer.
const LINGER: Duration = Duration::from_millis(500);

impl RefusalLog {
    const EVERY: Duration = Duration::from_secs(10);

    /// Write `503` without waiting, then close so the peer can read it: stop writing and
    /// drop what it sends for a moment, since closing with its request unread would reset
    /// the connection before the answer is seen. Bounded in number and time.
    fn answer(&self, stream: TcpStream, tracker: &TaskTracker) {
        let _ = stream.try_write(BUSY);
        let Ok(permit) = self.lingering.clone().try_acquire_owned() else {
            return;
        };
        tracker.spawn(async move {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            let _permit = permit;
            let mut stream = stream;
            let _ = stream.shutdown().await;
            let mut sink = [0u8; 4096];
            let _ = tokio::time::timeout(LINGER, async {
                while matches!(stream.read(&mut sink).await, Ok(n) if n > 0) {}
            })
            .await;
        });
    }

    fn note(&self, name: Listener, bounds: &HttpLimits) {
        let refused = self.refused.fetch_add(1, Ordering::Relaxed) + 1;
        let now = Instant::now();
        let mut last = self.last.lock();
        if last.is_some_and(|t| now.duration_since(t) < Self::EVERY) {
            return;
        }
        *last = Some(now);
        self.refused.store(0, Ordering::Relaxed);
        tracing::warn!(
            listener = name.as_str(),
            refused,
            max_connections = bounds.max_connections,
            "listener full: refusing connections that nothing idle can make room for"
        );
    }
}

/// A TLS acceptor from PEM files (certificate chain, private key), offering h2 and
/// http/1.1 by ALPN.
/// Why the TLS files cannot be served: the message names the file and the problem.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct TlsError(String);

pub fn tls_acceptor(
    cert: &std::path::Path,
    key: &std::path::Path,
) -> Result<tokio_rustls::TlsAcceptor, TlsError> {
    tls_config(cert, key).map_err(TlsError)
}

fn tls_config(
    cert: &std::path::Path,
    key: &std::path::Path,
) -> Result<tokio_rustls::TlsAcceptor, String> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert)
        .and_then(|it| it.collect::<Result<_, _>>())
        .map_err(|e| format!("cannot read certificates from {}: {e}", cert.display()))?;
    if certs.is_empty() {
        return Err(format!("{} holds no certificate", cert.display()));
    }
    let key = PrivateKeyDer::from_pem_file(key)
        .map_err(|e| format!("cannot read the private key {}: {e}", key.display()))?;
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .map_err(|e| format!("certificate and key do not form a usable pair: {e}"))?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(tokio_rustls::TlsAcceptor::from(Arc::new(config)))
}

/// Most of a refused HTTP/2 request's body read (and thrown away) after the answer.
const DISCARD_BYTES: usize = 64 * 1024;
/// How long that may take.
const DISCARD_TIME: Duration = Duration::from_secs(2);

/// Let go of a request whose body we will not use, after answering it from its head.
///
/// HTTP/1: nothing to do; the refusal carries `Connection: close`. HTTP/2: dropping the
/// body at once resets a stream the client may still be sending on, which some clients
/// (curl: "Stream error in the HTTP/2 framing layer") report instead of our answer. So a
/// small body is read to its end in the background, bounded in bytes and time; the
/// decision was already made on the head, and nothing read here is looked at.
pub fn discard_body(req: Request<Incoming>) {
    use http_body_util::BodyExt;
    if req.version() != http::Version::HTTP_2 || hyper::body::Body::is_end_stream(req.body()) {
        return;
    }
    let body = http_body_util::Limited::new(req.into_body(), DISCARD_BYTES);
    tokio::spawn(async move {
        let _ = tokio::time::timeout(DISCARD_TIME, body.collect()).await;
    });
}

/// An empty-bodied response with `status` (refusals, 202, 405, …).
pub fn empty(status: http::StatusCode) -> Response<Body> {
    use http_body_util::BodyExt;
    let mut response = Response::new(http_body_util::Empty::new().boxed());
    *response.status_mut() = status;
    response.headers_mut().insert(
        http::header::CONTENT_LENGTH,
        http::HeaderValue::from_static("0"),
    );
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    /// Admit, and mark the connection as waiting on its peer (as its task would once it
    /// has read everything the peer sent).
    fn admit(t: &Arc<Table>, group: Option<&str>, now: Instant) -> (Option<Ticket>, bool) {
        let (ticket, evicted) = t.admit(group.map(ip), now);
        if let Some(ticket) = &ticket {
            ticket.waiting.store(true, Ordering::Relaxed);
        }
        (ticket, evicted)
    }

    #[test]
    fn a_full_listener_makes_room_from_the_group_holding_the_most() {
        let t = Arc::new(Table::new(6, Some(4)));
        let now = Instant::now() - Duration::from_secs(60);
        let at = |s| now + Duration::from_secs(s);
        // The lone client came first: the oldest waiting of all.
        let lone = admit(&t, Some("198.51.100.9"), at(0)).0.unwrap();
        let mut flood = Vec::new();
        for (i, addr) in [
            "203.0.113.1",
            "203.0.113.1",
            "203.0.113.1",
            "203.0.113.2",
            "203.0.113.2",
        ]
        .into_iter()
        .enumerate()
        {
            flood.push(admit(&t, Some(addr), at(1 + i as u64)).0.unwrap());
        }
        let (_newcomer, evicted) = admit(&t, Some("203.0.113.2"), at(10));
        assert!(evicted);
        assert!(!lone.kill.is_cancelled(), "the lone client keeps its slot");
        assert!(
            flood[0].kill.is_cancelled(),
            "the oldest of the biggest group gives way"
        );
        assert!(flood[1..].iter().all(|f| !f.kill.is_cancelled()));
        // 203.0.113.2 holds three now (its newcomer among them), 203.0.113.1 two.
        let (_next, evicted) = admit(&t, Some("192.0.2.7"), at(11));
        assert!(evicted && flood[3].kill.is_cancelled());
        // Two groups of two: the older candidate of the two goes.
        let (_last, evicted) = admit(&t, Some("192.0.2.8"), at(12));
        assert!(evicted && flood[1].kill.is_cancelled());
        assert!(!flood[4].kill.is_cancelled() && !lone.kill.is_cancelled());
    }

    #[test]
    fn a_connection_whose_bytes_are_not_read_yet_is_never_evicted() {
        let t = Arc::new(Table::new(2, None));
        let now = Instant::now() - Duration::from_secs(60);
        // Accepted, its task not yet run: it may have a whole head in the kernel buffer.
        let (unread, _) = t.admit(None, now);
        let (waiting, _) = admit(&t, None, now + Duration::from_secs(1));
        let (newcomer, evicted) = admit(&t, None, now + Duration::from_secs(2));
        assert!(newcomer.is_some() && evicted);
        assert!(
            waiting.unwrap().kill.is_cancelled(),
            "the younger one, waiting on its peer"
        );
        assert!(!unread.as_ref().unwrap().kill.is_cancelled());
    }

    /// A request on `ticket` (the connection holds its slot).
    fn serving(ticket: &Ticket) -> Busy {
        ticket.busy()
    }

    #[test]
    fn a_request_waiting_on_its_verification_gives_way_to_a_newcomer() {
        let t = Arc::new(Table::new(2, None));
        let now = Instant::now() - Duration::from_secs(60);
        let (verifying, _) = admit(&t, None, now);
        let (served, _) = admit(&t, None, now + Duration::from_secs(1));
        let (verifying, served) = (verifying.unwrap(), served.unwrap());
        // Both have a request in flight; one of them waits on its token.
        let _v = serving(&verifying);
        let waiting_on_token = Yielded::start(&verifying);
        let _s = serving(&served);
        let (newcomer, evicted) = admit(&t, None, Instant::now());
        assert!(newcomer.is_some() && evicted);
        assert!(
            verifying.kill.is_cancelled(),
            "the request being verified gave way"
        );
        assert!(!served.kill.is_cancelled());
        drop(waiting_on_token);
        // Verified, then answered: the newcomer's connection holds its slot while busy,
        // and gives way again only once idle.
        let newcomer = newcomer.unwrap();
        let busy = newcomer.busy();
        t.inner.lock().yielding(newcomer.id, true, Instant::now());
        assert!(t.inner.lock().idle_ids().contains(&newcomer.id));
        t.inner.lock().yielding(newcomer.id, false, Instant::now());
        assert!(!t.inner.lock().idle_ids().contains(&newcomer.id));
        drop(busy);
        assert!(t.inner.lock().idle_ids().contains(&newcomer.id));
        assert_eq!(t.inner.lock().slots[&newcomer.id].yielding, 0);
    }

    #[test]
    fn connections_that_never_sent_a_head_go_before_those_kept_alive() {
        let t = Arc::new(Table::new(2, None));
        let t0 = Instant::now() - Duration::from_secs(60);
        let (kept, _) = admit(&t, None, t0);
        let kept = kept.unwrap();
        drop(serving(&kept));
        // `silent` arrives long after `kept` went idle, and still goes first.
        let (silent, _) = admit(&t, None, Instant::now() + Duration::from_secs(30));
        let (_newcomer, evicted) = admit(&t, None, Instant::now() + Duration::from_secs(31));
        assert!(evicted && silent.unwrap().kill.is_cancelled() && !kept.kill.is_cancelled());
    }

    #[test]
    fn a_full_table_gives_the_oldest_idle_slot_to_the_newcomer() {
        let t = Arc::new(Table::new(3, None));
        // Admissions in the past, so a connection that goes idle now is the newest.
        let t0 = Instant::now() - Duration::from_secs(3600);
        let at = |s| t0 + Duration::from_millis(s);
        let (a, _) = admit(&t, None, at(0));
        let (b, _) = admit(&t, None, at(1));
        let (c, _) = admit(&t, None, at(2));
        let (a, b, c) = (a.unwrap(), b.unwrap(), c.unwrap());
        // `a` sends a request: it is busy, so `b` is now the oldest idle one.
        let busy = serving(&a);
        let (d, evicted) = admit(&t, None, at(3));
        assert!(d.is_some() && evicted);
        assert!(b.kill.is_cancelled() && !a.kill.is_cancelled() && !c.kill.is_cancelled());
        // `a` finishes: idle again, and now newer than `c`.
        drop(busy);
        let (_e, evicted) = admit(&t, None, at(4));
        assert!(evicted && c.kill.is_cancelled() && !a.kill.is_cancelled());
        // Everyone busy: a newcomer is refused.
        let d = d.unwrap();
        let _busy = (serving(&a), serving(&d));
        let still_idle = t.inner.lock().idle_ids().len();
        assert_eq!(still_idle, 1);
    }

    #[test]
    fn when_nothing_is_idle_a_newcomer_is_refused() {
        let t = Arc::new(Table::new(2, None));
        let now = Instant::now();
        let (a, _) = admit(&t, None, now);
        let (b, _) = admit(&t, None, now);
        let _busy = (serving(a.as_ref().unwrap()), serving(b.as_ref().unwrap()));
        let (c, evicted) = admit(&t, None, now);
        assert!(c.is_none() && !evicted);
        // A connection that ends frees its slot.
        drop(_busy);
        drop(a);
        assert!(admit(&t, None, now).0.is_some());
    }

    #[test]
    fn per_address_caps_evict_only_that_address() {
        let t = Arc::new(Table::new(10, Some(2)));
        let now = Instant::now();
        let (x1, _) = admit(&t, Some("198.51.100.1"), now);
        let (y1, _) = admit(&t, Some("198.51.100.2"), now);
        let (x2, _) = admit(&t, Some("198.51.100.1"), now + Duration::from_millis(1));
        let (x3, evicted) = admit(&t, Some("198.51.100.1"), now + Duration::from_millis(2));
        assert!(x3.is_some() && evicted);
        assert!(x1.as_ref().unwrap().kill.is_cancelled(), "x's oldest went");
        assert!(!y1.as_ref().unwrap().kill.is_cancelled(), "y is untouched");
        assert!(!x2.as_ref().unwrap().kill.is_cancelled());
        // Both of x's slots busy: x is refused while y still gets in.
        let _busy = (serving(x2.as_ref().unwrap()), serving(x3.as_ref().unwrap()));
        assert!(admit(&t, Some("198.51.100.1"), now).0.is_none());
        assert!(admit(&t, Some("198.51.100.2"), now).0.is_some());
        // Exempt peers (trusted proxies) are held to the global cap only.
        for _ in 0..5 {
            assert!(admit(&t, None, now).0.is_some());
        }
    }

    #[test]
    fn slots_are_released_when_tickets_drop() {
        let t = Arc::new(Table::new(4, Some(4)));
        let now = Instant::now();
        let tickets: Vec<_> = (0..4)
            .map(|_| admit(&t, Some("203.0.113.1"), now).0.unwrap())
            .collect();
        drop(tickets);
        let inner = t.inner.lock();
        assert!(inner.slots.is_empty() && inner.groups.is_empty() && inner.by_size.is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn deadlines_count_from_accept_then_from_the_last_answer() {
        let bounds = HttpLimits {
            max_connections: 4,
            max_connections_per_address: None,
            max_in_flight: 4,
            max_header_bytes: 16 * 1024,
            header_timeout: Duration::from_secs(5),
            body_timeout: Duration::from_secs(30),
            idle_timeout: Duration::from_secs(60),
        };
        let t = Arc::new(Table::new(4, None));
        let started = tokio::time::Instant::now();
        let (ticket, _) = t.admit(None, started);
        let ticket = ticket.unwrap();
        assert_eq!(ticket.deadline(&bounds).await, Expired::Head);
        assert_eq!(started.elapsed(), Duration::from_secs(5));
        // A request, then an answer: the idle deadline counts from the answer.
        let busy = serving(&ticket);
        let waiting = tokio::spawn(ticket.deadline(&bounds));
        tokio::time::sleep(Duration::from_secs(100)).await;
        assert!(!waiting.is_finished(), "a busy connection has no deadline");
        let answered = tokio::time::Instant::now();
        drop(busy);
        assert_eq!(waiting.await.unwrap(), Expired::Idle);
        assert_eq!(answered.elapsed(), Duration::from_secs(60));
    }
}
