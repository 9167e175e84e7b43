//! A bounded HTTP/1.1 + HTTP/2 (prior knowledge or ALPN) server loop shared by the HTTP
//! listeners (the loopback and remote carriers, `/metrics`).
//!
//! What a peer can hold, and for how long:
//! - **Slots.** At most `max_connections` connections, and at most
//!   `max_connections_per_address` from one client address (IPv6 by its /64; peers in
//!   `shared_peers`, the trusted proxies, are exempt, since every client behind one shares
//!   its address). A connection holds its slot only while a request its handler admitted
//!   ([`admit`]: the credentials are good) is in flight; otherwise it may give way — a
//!   request not yet decided (a token with the issuer, a signature being checked, a
//!   refusal being written) is as good as none, and killing it cancels nothing that ran.
//!   A connection kept alive after an admitted request may give way once every byte its
//!   peer sent has been read (its client's next request may be on its way). When the
//!   listener (or the address) is full, one that may gives way to the new one: from the
//!   address group holding the most connections, those refused (or whose client the
//!   handler knows has failed lately: [`distrust`]) and never admitted first, then those
//!   never admitted (each by when they were accepted, so asking again does not
//!   move a connection back), then those kept alive after an answer (longest idle first);
//!   when none can, the new one is refused at once (`503` on plain HTTP, a close on TLS)
//!   and counted. So a flood of silent or slow sockets, of forged tokens or of tokens the
//!   issuer is slow to judge, from a few addresses or from many, keeps itself out, not the
//!   clients that hold a valid credential.
//! - **Deadlines.** Every byte before the first complete request head — the TLS
//!   handshake, HTTP/1-vs-HTTP/2 detection, the HTTP/2 preface and SETTINGS, the head
//!   itself — is under `header_timeout`, counted from accept. After an answer, an HTTP/1.1
//!   connection must start its next head within `header_timeout` (hyper's own timer), an
//!   HTTP/2 connection with no open stream is closed (GOAWAY) after `idle_timeout`; long
//!   requests on HTTP/2 are kept honest by pings. A write that waits `idle_timeout` for a
//!   peer that takes nothing ends the connection ([`Watched`]): an unread answer does not
//!   keep its slot for ever.
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
use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::repoll::Repoll;
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

    /// Whether the handler knows a connection from `peer` comes from a client that has
    /// failed lately: until a request on it is admitted, it gives way before the others.
    fn distrusts(&self, _peer: IpAddr) -> bool {
        false
    }
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
        let distrusted = handler.distrusts(peer.ip());
        let (ticket, evicted) = admit_once_read(&table, group, distrusted, &drain).await;
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
        let waiting = conn.ticket.waiting.clone();
        tracker.spawn(Repoll::new(
            async move {
                let open = conn.metrics.open_connection(name);
                conn.run(stream, tls, &drain).await;
                drop(open);
            },
            waiting,
        ));
    }
    drop(listener);
    tracker.close();
    tracker.wait().await;
}

/// Longest the accept loop waits for accepted connections to be read when one of them
/// could then make room ([`admit_once_read`]).
const READ_WAIT: Duration = Duration::from_millis(100);

/// [`Table::admit`]; when nothing may give way but a connection accepted earlier has not
/// been read yet, first wait (at most [`READ_WAIT`], accepting nothing meanwhile) for the
/// connections' tasks to read what their peers sent — meanwhile sparing the connections
/// clients keep alive and those whose token is with the issuer, which would otherwise be
/// all that could give way. So the accept loop never outruns the connections it
/// accepted, evicting them before they could be served (or, a newcomer at a time,
/// closing requests the issuer is already working on: each would cost the issuer a
/// request for nothing): a flood of connections waits its turn in the kernel's accept
/// queue with everyone else.
async fn admit_once_read(
    table: &Arc<Table>,
    group: Option<IpAddr>,
    distrusted: bool,
    drain: &Drain,
) -> (Option<Ticket>, bool) {
    let deadline = Instant::now() + READ_WAIT;
    loop {
        // While connections wait to be read, a client's kept-alive one, or one whose token
        // is with the issuer, is not what gives way.
        let patient = Instant::now() < deadline && table.inner.lock().any_unread();
        let (ticket, evicted) = table.admit(group, distrusted, patient, Instant::now());
        if ticket.is_some() || evicted || !patient {
            return (ticket, evicted);
        }
        tokio::select! {
            () = drain.accept.cancelled() => return (None, evicted),
            () = tokio::time::sleep(Duration::from_millis(1)) => {}
        }
    }
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
    /// No request since the last admitted answer within the idle deadline.
    Idle,
}

impl<H: Handler> Conn<H> {
    async fn run(self, stream: TcpStream, tls: Option<tokio_rustls::TlsAcceptor>, drain: &Drain) {
        let stalled_out = Arc::new(AtomicBool::new(false));
        let stream = Watched {
            io: stream,
            waiting: self.ticket.waiting.clone(),
            send_limit: self.bounds.idle_timeout,
            stalled: None,
            stalled_out: stalled_out.clone(),
        };
        self.serve_stream(stream, tls, drain).await;
        if stalled_out.load(Ordering::Relaxed) {
            self.metrics.connection(self.name, ConnOutcome::SendTimeout);
        }
    }

    async fn serve_stream(
        &self,
        stream: Watched<TcpStream>,
        tls: Option<tokio_rustls::TlsAcceptor>,
        drain: &Drain,
    ) {
        let kill = self.ticket.kill.clone();
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
                req.extensions_mut().insert(busy.clone());
                let handler = handler.clone();
                async move {
                    let response = if head_too_large(&req, max_header_bytes) {
                        handler.head_refused(peer, HeadRefusal::TooLarge);
                        discard_body(req);
                        empty(http::StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE)
                    } else {
                        handler.handle(req, peer).await
                    };
                    Ok::<_, Infallible>(response.map(|body| Tracked { body, _busy: busy }))
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
    /// itself), hyper's own head deadline, or an HTTP/2 flood.
    fn connection_error(&self, error: &(dyn std::error::Error + 'static)) {
        let Some(e) = error.downcast_ref::<hyper::Error>() else {
            return;
        };
        if h2_flood(e) {
            self.metrics.connection(self.name, ConnOutcome::Flood);
        } else if e.is_parse_too_large() {
            self.handler.head_refused(self.peer, HeadRefusal::TooLarge);
        } else if e.is_timeout() {
            let expired = if self.ticket.admitted() == 0 {
                Expired::Head
            } else {
                Expired::Idle
            };
            self.metrics.connection(self.name, expired.outcome());
        }
    }
}

/// Whether HTTP/2 ended the connection for a flood past its own limits (GOAWAY
/// `ENHANCE_YOUR_CALM`): a header block that never ends or decodes far past the cap,
/// streams reset faster than they are served, a stream of empty DATA frames. (Which one,
/// h2 does not say in the error it returns.)
fn h2_flood(e: &hyper::Error) -> bool {
    std::error::Error::source(e)
        .and_then(|s| s.downcast_ref::<h2::Error>())
        .is_some_and(|h2| {
            h2.is_go_away() && h2.is_library() && h2.reason() == Some(h2::Reason::ENHANCE_YOUR_CALM)
        })
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
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Busy,
    Idle { since: Instant, admitted: u64 },
}

/// One open connection, as its listener sees it.
///
/// A connection holds its slot only while a request the handler admitted is in flight
/// ([`admit`]); otherwise it may give way to a newcomer. So a request nobody has
/// authenticated yet — its token with the issuer, its signature being checked, its
/// refusal being written — never holds a slot a newcomer cannot take, and killing it
/// cancels nothing that ran.
struct Slot {
    group: Option<IpAddr>,
    /// Requests in flight.
    active: usize,
    /// Requests in flight that the handler admitted.
    held: usize,
    /// Requests ever admitted on this connection.
    admitted: u64,
    /// Requests in flight whose token is with the issuer now ([`asking_issuer`]): at most
    /// the verifier's places with the issuer, across the listener.
    asking: usize,
    /// A request ended without being admitted (refused, 404, metadata), or its handler
    /// knew its client had failed lately ([`distrust`]).
    distrusted: bool,
    accepted: Instant,
    /// When its last admitted request was answered (or accept): the idle deadline and
    /// the eviction order of a connection kept alive count from it.
    idle_since: Instant,
    /// Our last read found nothing more to read, and nothing has woken the connection's
    /// task since (cleared by [`Repoll`]: a wake-up may be the peer's bytes): we are
    /// waiting on the peer.
    waiting: Arc<AtomicBool>,
    kill: CancellationToken,
    phase: Phase,
    /// Told when `phase` changes (to whoever waits on it: the drain waiting for a
    /// request, the deadline waiting for a busy connection to go idle).
    changed: Arc<Notify>,
}

impl Slot {
    /// Whether a newcomer may take this slot: no admitted request is in flight. A
    /// kept-alive connection must also have had all its bytes read
    /// ([`Inner::evictable_in`]).
    fn may_give_way(&self) -> bool {
        self.held == 0
    }

    /// Where a slot that may give way sorts among the candidates for eviction: first
    /// those distrusted and never admitted, then those never admitted (silent, or with a
    /// request not yet decided), then those never admitted whose token the issuer is
    /// judging, each oldest accepted first — so a peer cannot move its connections back
    /// by sending more requests — then those admitted before, longest idle first.
    ///
    /// A request whose token is with the issuer goes after the other undecided ones: the
    /// issuer's places are few ([`crate::oauth::introspect::MAX_IN_FLIGHT`]), so those
    /// connections are few, and a newcomer that closed one would throw away the issuer's
    /// work and the place the request waited for — a churning flood of unjudged tokens
    /// from many addresses, each evicting the oldest undecided connection, would otherwise
    /// never let a request live as long as the issuer takes to answer.
    fn key(&self, id: u64) -> IdleKey {
        match (self.admitted, self.distrusted) {
            (0, true) => (0, self.accepted, id),
            (0, false) if self.asking == 0 => (1, self.accepted, id),
            (0, false) => (WITH_ISSUER, self.accepted, id),
            _ => (KEPT_ALIVE, self.idle_since, id),
        }
    }

    /// Accepted, and nothing read from it yet: its task has not run, or its peer's bytes
    /// are on their way. It cannot give way — a valid client's whole request may be in the
    /// kernel's buffer — until it has been read.
    fn unread(&self) -> bool {
        self.admitted == 0
            && self.active == 0
            && !self.distrusted
            && !self.waiting.load(Ordering::Relaxed)
    }
}

/// Where a connection sorts among those that may give way: its rank (distrusted, never
/// admitted, [`WITH_ISSUER`], [`KEPT_ALIVE`]), then when it was accepted or went idle,
/// then its id.
type IdleKey = (u8, Instant, u64);

/// The rank of connections never admitted whose request's token is with the issuer.
const WITH_ISSUER: u8 = 2;

/// The rank of connections kept alive after an admitted request: they give way last.
const KEPT_ALIVE: u8 = 3;

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
    /// The first connection of `group`, in eviction order, that may give way now: one
    /// whose requests in flight are all undecided, one distrusted and never admitted, or
    /// an idle one waiting on its peer (one whose bytes are not all read may have a
    /// request on its way).
    fn evictable_in(&self, group: Option<IpAddr>) -> Option<IdleKey> {
        self.evictable_among(group, false)
    }

    /// [`Self::evictable_in`]; with `spare`, sparing connections kept alive after an
    /// admitted request and those whose token is with the issuer.
    fn evictable_among(&self, group: Option<IpAddr>, spare: bool) -> Option<IdleKey> {
        self.groups
            .get(&group)?
            .idle
            .iter()
            .copied()
            .take_while(|(rank, _, _)| !spare || *rank < WITH_ISSUER)
            .find(|(_, _, id)| {
                self.slots.get(id).is_some_and(|s| {
                    s.active > 0
                        || s.waiting.load(Ordering::Relaxed)
                        || (s.admitted == 0 && s.distrusted)
                })
            })
    }

    /// Whether some connection may give way once it has been read ([`Slot::unread`]).
    fn any_unread(&self) -> bool {
        self.slots.values().any(Slot::unread)
    }

    /// The connection that gives way when the listener is full: the first, among the
    /// address groups that may give way to the newcomer, by what kind of connection it is
    /// (distrusted, never admitted, kept alive after an admitted request: [`Slot::key`]),
    /// then from the group holding the most connections, then by age; trusted proxies'
    /// last. So a connection that never passed admission never outlives one that did, and
    /// among each kind, peers that fill the listener from a few addresses make room from
    /// their own connections; peers on many addresses holding one each make room from
    /// each other, never from a served client holding two.
    ///
    /// Only a group at least as big as the newcomer's would be gives way to it (its own
    /// always may): a client holding one connection never loses it to a peer that holds
    /// more. With `spare`, connections kept alive after an admitted request and those
    /// whose token is with the issuer do not give way.
    fn evictable(&self, newcomer: Option<IpAddr>, spare: bool) -> Option<u64> {
        let theirs = newcomer.map_or(0, |g| self.groups.get(&Some(g)).map_or(0, |g| g.open) + 1);
        let mut best: Option<(u8, Reverse<usize>, Instant, u64)> = None;
        for &(Reverse(open), group) in &self.by_size {
            // Groups come biggest first: a smaller one cannot beat a first-kind candidate.
            if best.is_some_and(|(rank, Reverse(size), ..)| rank == 0 && open < size) {
                break;
            }
            if newcomer != Some(group) && open < theirs {
                continue;
            }
            if let Some((rank, since, id)) = self.evictable_among(Some(group), spare) {
                let candidate = (rank, Reverse(open), since, id);
                if best.is_none_or(|b| candidate < b) {
                    best = Some(candidate);
                }
            }
        }
        best.map(|(.., id)| id)
            .or_else(|| self.evictable_among(None, spare).map(|(_, _, id)| id))
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

    /// A request head arrived on `id`.
    fn start_request(&mut self, id: u64) {
        if let Some(slot) = self.slots.get_mut(&id) {
            if slot.active == 0 {
                slot.phase = Phase::Busy;
                slot.changed.notify_waiters();
            }
            slot.active += 1;
        }
    }

    /// The handler admitted a request on `id` (`was_asking`: its token was with the
    /// issuer): the connection holds its slot until the request's answer has been sent.
    fn admit_request(&mut self, id: u64, was_asking: bool) {
        self.rekey(id, |slot| {
            slot.held += 1;
            slot.admitted += 1;
            slot.asking = slot.asking.saturating_sub(usize::from(was_asking));
        });
    }

    /// The token of a request on `id` went to the issuer.
    fn ask_issuer(&mut self, id: u64) {
        self.rekey(id, |slot| slot.asking += 1);
    }

    /// `id`'s handler knows the client of a request on it has failed lately.
    fn distrust(&mut self, id: u64) {
        self.rekey(id, |slot| slot.distrusted = true);
    }

    /// A request on `id` was answered (or dropped); `admitted` if the handler admitted it,
    /// `was_asking` if (not admitted) its token went to the issuer.
    fn end_request(&mut self, id: u64, admitted: bool, was_asking: bool, now: Instant) {
        self.rekey(id, |slot| {
            slot.active = slot.active.saturating_sub(1);
            slot.asking = slot.asking.saturating_sub(usize::from(was_asking));
            // Only an admitted request's answer counts as the connection's last: a refused
            // one moves neither its idle deadline nor its place in the eviction order.
            if admitted {
                slot.held = slot.held.saturating_sub(1);
                slot.idle_since = now;
            } else {
                slot.distrusted = true;
            }
            if slot.active == 0 {
                // A connection never admitted is held to the head deadline from accept,
                // however many requests it has had refused.
                slot.phase = Phase::Idle {
                    since: if slot.admitted == 0 {
                        slot.accepted
                    } else {
                        slot.idle_since
                    },
                    admitted: slot.admitted,
                };
                slot.changed.notify_waiters();
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

    /// A slot for a new connection from `group` (None: exempt from the per-address cap;
    /// `distrusted`: its client has failed lately), making room by evicting a connection
    /// that may give way when full. Returns the ticket (None: refused, nothing could give
    /// way) and whether a connection was evicted.
    /// With `spare`, a full listener makes no room from connections kept alive after an
    /// admitted request, nor from those whose token is with the issuer.
    fn admit(
        self: &Arc<Self>,
        group: Option<IpAddr>,
        distrusted: bool,
        spare: bool,
        now: Instant,
    ) -> (Option<Ticket>, bool) {
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
            match inner.evictable(group, spare) {
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
        let changed = Arc::new(Notify::new());
        let slot = Slot {
            group,
            active: 0,
            held: 0,
            admitted: 0,
            asking: 0,
            distrusted,
            accepted: now,
            idle_since: now,
            waiting: waiting.clone(),
            kill: kill.clone(),
            phase: Phase::Idle {
                since: now,
                admitted: 0,
            },
            changed: changed.clone(),
        };
        let key = slot.key(id);
        inner.slots.insert(id, slot);
        inner.resize(group, |open| *open += 1);
        if let Some(g) = inner.groups.get_mut(&group) {
            g.idle.insert(key);
        }
        let ticket = Ticket(Arc::new(TicketInner {
            table: self.clone(),
            id,
            kill,
            waiting,
            changed,
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
    changed: Arc<Notify>,
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
        Busy(Arc::new(InFlight {
            ticket: self.clone(),
            admitted: AtomicBool::new(false),
            asking: AtomicBool::new(false),
        }))
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

    /// The connection's phase now (`None`: evicted already).
    fn phase(&self) -> Option<Phase> {
        phase_of(&self.table, self.id)
    }

    /// Resolves once a request is in flight on this connection.
    async fn until_busy(&self) {
        let mut now = self.phase();
        loop {
            match now {
                None => return std::future::pending().await,
                Some(Phase::Busy) => return,
                idle => now = phase_change(&self.table, self.id, &self.changed, idle).await,
            }
        }
    }

    /// Requests admitted on this connection so far.
    fn admitted(&self) -> u64 {
        self.table
            .inner
            .lock()
            .slots
            .get(&self.id)
            .map_or(0, |s| s.admitted)
    }

    /// Resolves when the connection has been idle too long: until a request of it is
    /// admitted, `header_timeout` from accept; after that, `idle_timeout` from the last
    /// admitted request's answer (a refused request's does not count).
    ///
    /// Once a request has been admitted, requests coming and going do not wake it: it
    /// sleeps until the idle deadline it last saw and then looks again (a later admitted
    /// answer only moves the deadline later), so a connection kept busy costs one timer
    /// per idle deadline, not one per request. Before that it also wakes at every change, since
    /// the first admitted answer may bring the deadline forward (an `idle_timeout`
    /// shorter than `header_timeout`).
    fn deadline(&self, bounds: &HttpLimits) -> impl Future<Output = Expired> + Send + 'static {
        let (table, id, changed) = (self.table.clone(), self.id, self.changed.clone());
        let (head, idle) = (bounds.header_timeout, bounds.idle_timeout);
        async move {
            let mut seen = phase_of(&table, id);
            loop {
                match seen {
                    // Evicted: the kill token ends the connection.
                    None => return std::future::pending().await,
                    Some(Phase::Busy) => seen = phase_change(&table, id, &changed, seen).await,
                    Some(Phase::Idle { since, admitted: 0 }) => {
                        tokio::select! {
                            biased;
                            now = phase_change(&table, id, &changed, seen) => seen = now,
                            () = tokio::time::sleep_until(since + head) => return Expired::Head,
                        }
                    }
                    Some(Phase::Idle { since, .. }) => {
                        tokio::time::sleep_until(since + idle).await;
                        let now = phase_of(&table, id);
                        if now == seen {
                            return Expired::Idle;
                        }
                        seen = now;
                    }
                }
            }
        }
    }
}

/// The phase of connection `id` of `table` (`None`: gone).
fn phase_of(table: &Table, id: u64) -> Option<Phase> {
    table.inner.lock().slots.get(&id).map(|s| s.phase)
}

/// Resolves with connection `id`'s phase once it is no longer `seen`, told by `changed`
/// (armed before each look, so no change is missed between looking and waiting).
async fn phase_change(
    table: &Table,
    id: u64,
    changed: &Notify,
    seen: Option<Phase>,
) -> Option<Phase> {
    loop {
        let next = changed.notified();
        tokio::pin!(next);
        next.as_mut().enable();
        let now = phase_of(table, id);
        if now != seen {
            return now;
        }
        next.await;
    }
}

/// A connection's stream, noting whether our last read found nothing more to read, and
/// ending the connection when its peer takes no byte of what it is sent for `send_limit`
/// (`stalled_out` says so afterwards): an answer nobody reads would otherwise keep its
/// request's slot and memory share for ever. The timer exists only while a write waits.
struct Watched<T> {
    io: T,
    waiting: Arc<AtomicBool>,
    send_limit: Duration,
    stalled: Option<Stall>,
    stalled_out: Arc<AtomicBool>,
}

/// A write waiting on the peer: when its window ends, and how much the peer had not yet
/// taken when it began.
struct Stall {
    timer: Pin<Box<tokio::time::Sleep>>,
    queued: Option<usize>,
}

/// What the peer of `socket` has not taken of what was written (`None`: the kernel would
/// not say).
fn queued(socket: &impl std::os::fd::AsFd) -> Option<usize> {
    robota_sys::unsent_bytes(socket.as_fd()).ok()
}

impl<T: std::os::fd::AsFd> Watched<T> {
    /// `polled`, a write's outcome, judged against the send limit: a write fails once it
    /// has waited `send_limit` during which the peer took no byte. Progress is the
    /// kernel's send queue shrinking, not our writes coming back: the kernel wakes a
    /// writer only once a good part of its buffer is free, which a slow but steady reader
    /// may take longer than the limit to free.
    fn judge<R>(
        &mut self,
        cx: &mut Context<'_>,
        polled: Poll<std::io::Result<R>>,
    ) -> Poll<std::io::Result<R>> {
        if polled.is_ready() {
            self.stalled = None;
            return polled;
        }
        let limit = self.send_limit;
        let Self { io, stalled, .. } = self;
        let stall = stalled.get_or_insert_with(|| Stall {
            timer: Box::pin(tokio::time::sleep(limit)),
            queued: queued(io),
        });
        loop {
            if stall.timer.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
            match (stall.queued, queued(io)) {
                // The peer took something during the window: a new window starts.
                (Some(before), Some(after)) if after < before => {
                    stall.queued = Some(after);
                    stall
                        .timer
                        .as_mut()
                        .reset(tokio::time::Instant::now() + limit);
                }
                _ => break,
            }
        }
        self.stalled_out.store(true, Ordering::Relaxed);
        Poll::Ready(Err(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            format!(
                "the peer took nothing of its answer for {}",
                humantime::format_duration(limit)
            ),
        )))
    }
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

impl<T: tokio::io::AsyncWrite + std::os::fd::AsFd + Unpin> tokio::io::AsyncWrite for Watched<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let polled = Pin::new(&mut self.io).poll_write(cx, buf);
        self.judge(cx, polled)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let polled = Pin::new(&mut self.io).poll_flush(cx);
        self.judge(cx, polled)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let polled = Pin::new(&mut self.io).poll_write_vectored(cx, bufs);
        self.judge(cx, polled)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}

/// One request in flight; marks its connection busy while it lives (in the request's
/// extensions, then in its response body).
#[derive(Clone)]
struct Busy(Arc<InFlight>);

struct InFlight {
    ticket: Ticket,
    admitted: AtomicBool,
    /// Its token is with the issuer, and it has not been admitted.
    asking: AtomicBool,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let admitted = self.admitted.load(Ordering::Relaxed);
        let asking = self.asking.load(Ordering::Relaxed);
        let id = self.ticket.id;
        self.ticket
            .table
            .inner
            .lock()
            .end_request(id, admitted, asking, Instant::now());
    }
}

/// The handler admitted `req` (come through [`serve`]): its credentials are good, and its
/// connection holds its slot until the answer has been sent. Until then — a token with the
/// issuer, a refusal being written — the connection counts as unauthenticated and gives
/// way to a newcomer.
pub fn admit<B>(req: &http::Request<B>) {
    if let Some(Busy(request)) = req.extensions().get::<Busy>()
        && !request.admitted.swap(true, Ordering::Relaxed)
    {
        let was_asking = request.asking.swap(false, Ordering::Relaxed);
        request
            .ticket
            .table
            .inner
            .lock()
            .admit_request(request.ticket.id, was_asking);
    }
}

/// For `req` (come through [`serve`]): what to call when its token goes to the issuer.
/// Until it is decided, its connection gives way after the other undecided ones
/// ([`Slot::key`]); at most the issuer's places are such connections at once.
pub fn asking_issuer<B>(req: &http::Request<B>) -> impl Fn() + Send + Sync + 'static {
    let request = req
        .extensions()
        .get::<Busy>()
        .map(|Busy(request)| Arc::downgrade(request));
    move || {
        if let Some(request) = request.as_ref().and_then(std::sync::Weak::upgrade)
            && !request.admitted.load(Ordering::Relaxed)
            && !request.asking.swap(true, Ordering::Relaxed)
        {
            request
                .ticket
                .table
                .inner
                .lock()
                .ask_issuer(request.ticket.id);
        }
    }
}

/// The handler knows `req`'s client has failed lately (bad tokens, say): until it is
/// admitted, its connection gives way before those of clients that have not.
pub fn distrust<B>(req: &http::Request<B>) {
    if let Some(Busy(request)) = req.extensions().get::<Busy>() {
        let id = request.ticket.id;
        request.ticket.table.inner.lock().distrust(id);
    }
}

/// A response body that keeps its request in flight until it has been sent (or dropped).
struct Tracked {
    body: Body,
    _busy: Busy,
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

    /// A listener's limits with these head and idle deadlines, in seconds.
    fn limits(header: u64, idle: u64) -> HttpLimits {
        HttpLimits {
            max_connections: 4,
            max_connections_per_address: None,
            max_in_flight: 4,
            max_in_flight_per_caller: 4,
            max_header_bytes: 16 * 1024,
            header_timeout: Duration::from_secs(header),
            body_timeout: Duration::from_secs(30),
            idle_timeout: Duration::from_secs(idle),
        }
    }

    /// Admit, and mark the connection as waiting on its peer (as its task would once it
    /// has read everything the peer sent).
    fn admit(t: &Arc<Table>, group: Option<&str>, now: Instant) -> (Option<Ticket>, bool) {
        let (ticket, evicted) = t.admit(group.map(ip), false, false, now);
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
        let t = Arc::new(Table::new(3, None));
        let now = Instant::now() - Duration::from_secs(60);
        // Admitted and answered; its peer's next request may be in the kernel buffer.
        let (kept, _) = t.admit(None, false, false, now);
        let kept = kept.unwrap();
        drop(serving(&kept));
        // Accepted, its task not yet run: it may have a whole head in the kernel buffer.
        let (unread, _) = t.admit(None, false, false, now + Duration::from_secs(1));
        let (waiting, _) = admit(&t, None, now + Duration::from_secs(2));
        let (newcomer, evicted) = t.admit(None, false, false, now + Duration::from_secs(3));
        assert!(newcomer.is_some() && evicted);
        assert!(
            waiting.unwrap().kill.is_cancelled(),
            "the younger one, waiting on its peer"
        );
        let unread = unread.unwrap();
        assert!(!unread.kill.is_cancelled() && !kept.kill.is_cancelled());
        // Nothing may give way now, but some could once read.
        assert!(
            t.admit(None, false, false, now + Duration::from_secs(4))
                .0
                .is_none()
        );
        assert!(t.inner.lock().any_unread());
        // Once read and refused, the unread one goes first.
        drop(unread.busy());
        let (_next, evicted) = t.admit(None, false, false, now + Duration::from_secs(5));
        assert!(evicted && unread.kill.is_cancelled() && !kept.kill.is_cancelled());
    }

    #[test]
    fn while_connections_wait_to_be_read_kept_alive_and_asking_ones_are_spared() {
        for kept_alive in [true, false] {
            let t = Arc::new(Table::new(2, None));
            let now = Instant::now() - Duration::from_secs(60);
            let (spared, _) = admit(&t, None, now);
            let spared = spared.unwrap();
            // Kept alive after an admitted request, or its token with the issuer.
            let _asking = if kept_alive {
                drop(serving(&spared));
                None
            } else {
                let req = pending(&spared);
                asking_issuer(&req)();
                Some(req)
            };
            let (_unread, _) = t.admit(None, false, false, now + Duration::from_secs(1));
            let later = now + Duration::from_secs(2);
            assert!(t.admit(None, false, true, later).0.is_none());
            assert!(!spared.kill.is_cancelled(), "kept alive: {kept_alive}");
            // Once the wait is over, it gives way.
            let (newcomer, evicted) = t.admit(None, false, false, later);
            assert!(newcomer.is_some() && evicted && spared.kill.is_cancelled());
        }
    }

    /// A request on `ticket` that its handler has not decided on yet.
    fn pending(ticket: &Ticket) -> http::Request<()> {
        let mut req = http::Request::new(());
        req.extensions_mut().insert(ticket.busy());
        req
    }

    /// A request on `ticket` that its handler admitted (the connection holds its slot).
    fn serving(ticket: &Ticket) -> Busy {
        let req = pending(ticket);
        super::admit(&req);
        req.extensions().get::<Busy>().cloned().expect("in flight")
    }

    #[test]
    fn only_an_admitted_request_holds_its_slot() {
        let t = Arc::new(Table::new(2, None));
        let now = Instant::now() - Duration::from_secs(60);
        let (verifying, _) = admit(&t, None, now);
        let (served, _) = admit(&t, None, now + Duration::from_secs(1));
        let (verifying, served) = (verifying.unwrap(), served.unwrap());
        // Both have a request in flight; one is admitted, the other is not decided yet
        // (its token with the issuer, say).
        let undecided = verifying.busy();
        let _s = serving(&served);
        let (newcomer, evicted) = admit(&t, None, Instant::now());
        assert!(newcomer.is_some() && evicted);
        assert!(
            verifying.kill.is_cancelled(),
            "the undecided request gave way"
        );
        assert!(!served.kill.is_cancelled());
        drop(undecided);
        // The newcomer's request: undecided, it may give way; admitted, it holds until
        // answered; then idle, it may again.
        let newcomer = newcomer.unwrap();
        let req = pending(&newcomer);
        assert!(t.inner.lock().idle_ids().contains(&newcomer.id));
        super::admit(&req);
        super::admit(&req);
        assert!(!t.inner.lock().idle_ids().contains(&newcomer.id));
        drop(req);
        assert!(t.inner.lock().idle_ids().contains(&newcomer.id));
        let slot = &t.inner.lock().slots[&newcomer.id];
        assert_eq!((slot.held, slot.admitted, slot.distrusted), (0, 1, false));
    }

    #[test]
    fn the_refused_go_first_however_often_they_ask_then_the_undecided_by_age() {
        let t = Arc::new(Table::new(3, None));
        let t0 = Instant::now() - Duration::from_secs(60);
        let at = |s| t0 + Duration::from_secs(s);
        let (silent, _) = admit(&t, None, at(0));
        let (undecided, _) = admit(&t, None, at(1));
        let (refused, _) = admit(&t, None, at(2));
        let (silent, undecided, refused) = (silent.unwrap(), undecided.unwrap(), refused.unwrap());
        // Refused again and again, the last time just now: it still goes first.
        for _ in 0..3 {
            drop(refused.busy());
        }
        let (_a, evicted) = admit(&t, None, at(3));
        assert!(evicted && refused.kill.is_cancelled());
        assert!(!silent.kill.is_cancelled() && !undecided.kill.is_cancelled());
        // Then the never-admitted by when they came, unless their handler distrusts them.
        let req = pending(&undecided);
        distrust(&req);
        let (_b, evicted) = admit(&t, None, at(4));
        assert!(evicted && undecided.kill.is_cancelled() && !silent.kill.is_cancelled());
        let (_c, evicted) = admit(&t, None, at(5));
        assert!(evicted && silent.kill.is_cancelled());
        // A connection distrusted from its accept goes before the older undecided ones.
        let (doubted, _) = t.admit(None, true, false, at(6));
        let (_d, evicted) = admit(&t, None, at(7));
        assert!(evicted && doubted.unwrap().kill.is_cancelled());
    }

    #[test]
    fn a_request_whose_token_is_with_the_issuer_outlasts_younger_undecided_ones() {
        let t = Arc::new(Table::new(3, None));
        let t0 = Instant::now() - Duration::from_secs(60);
        let at = |s| t0 + Duration::from_secs(s);
        let (asking, _) = admit(&t, None, at(0));
        let (kept, _) = admit(&t, None, at(1));
        let (undecided, _) = admit(&t, None, at(2));
        let (asking, kept, undecided) = (asking.unwrap(), kept.unwrap(), undecided.unwrap());
        // One admitted and answered before: kept alive.
        super::admit(&pending(&kept));
        let _undecided = pending(&undecided);
        let with_issuer = pending(&asking);
        let sending = asking_issuer(&with_issuer);
        sending();
        sending();
        assert_eq!(t.inner.lock().slots[&asking.id].asking, 1);
        // The oldest, but its token is with the issuer: the younger undecided one goes.
        let (newcomer, evicted) = admit(&t, None, at(3));
        assert!(evicted && undecided.kill.is_cancelled() && !asking.kill.is_cancelled());
        // Without younger undecided ones, it goes before the connection kept alive.
        drop(newcomer);
        assert_eq!(t.inner.lock().evictable(None, false), Some(asking.id));
        // Admitted once the issuer answers, the mark is gone with the request.
        let t = Arc::new(Table::new(3, None));
        let (conn, _) = admit(&t, None, at(6));
        let conn = conn.unwrap();
        let req = pending(&conn);
        asking_issuer(&req)();
        super::admit(&req);
        drop(req);
        let slot = &t.inner.lock().slots[&conn.id];
        assert_eq!((slot.asking, slot.admitted, slot.held), (0, 1, 0));
    }

    #[test]
    fn peers_on_many_addresses_make_room_from_each_others_undecided_requests() {
        let t = Arc::new(Table::new(4, Some(4)));
        let t0 = Instant::now() - Duration::from_secs(60);
        let at = |s| t0 + Duration::from_secs(s);
        // Four addresses with one connection each, every one with a token being checked.
        let flood: Vec<_> = (1..=4)
            .map(|i| admit(&t, Some(&format!("203.0.113.{i}")), at(i)).0.unwrap())
            .collect();
        let _pending: Vec<_> = flood.iter().map(Ticket::busy).collect();
        // A client on a fifth address holds one as well: it gets in.
        let (client, evicted) = admit(&t, Some("198.51.100.9"), at(10));
        assert!(
            evicted && flood[0].kill.is_cancelled(),
            "the oldest undecided"
        );
        let client = client.unwrap();
        // Served and kept alive, it goes after every undecided connection of its size.
        drop(serving(&client));
        let (_next, evicted) = admit(&t, Some("203.0.113.9"), at(11));
        assert!(evicted && flood[1].kill.is_cancelled() && !client.kill.is_cancelled());
        // An admitted request in flight holds against a newcomer of the same size.
        let _held = serving(&client);
        for i in 20..26 {
            let _ = admit(&t, Some(&format!("192.0.2.{i}")), at(i));
        }
        assert!(!client.kill.is_cancelled());
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
        let bounds = limits(5, 60);
        let t = Arc::new(Table::new(4, None));
        let started = tokio::time::Instant::now();
        let (ticket, _) = t.admit(None, false, false, started);
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
        // A deadline already asleep in an idle phase: a request that comes and goes
        // meanwhile moves it to the new answer, without waking it.
        let first = tokio::time::Instant::now();
        drop(serving(&ticket));
        let waiting = tokio::spawn(ticket.deadline(&bounds));
        tokio::time::sleep(Duration::from_secs(40)).await;
        let again = serving(&ticket);
        tokio::time::sleep(Duration::from_secs(10)).await;
        let answered = tokio::time::Instant::now();
        drop(again);
        tokio::time::sleep(Duration::from_secs(30)).await;
        assert!(
            !waiting.is_finished(),
            "expired {:?} after the first answer, though another came since",
            first.elapsed()
        );
        assert_eq!(waiting.await.unwrap(), Expired::Idle);
        assert_eq!(answered.elapsed(), Duration::from_secs(60));
    }

    #[tokio::test(start_paused = true)]
    async fn refused_requests_keep_the_head_deadline_and_an_answer_can_bring_it_forward() {
        let t = Arc::new(Table::new(4, None));
        // Requests refused (never admitted) one after another: still closed at the head
        // deadline from accept.
        let accepted = tokio::time::Instant::now();
        let ticket = t.admit(None, false, false, accepted).0.unwrap();
        let waiting = tokio::spawn(ticket.deadline(&limits(5, 60)));
        for _ in 0..4 {
            tokio::time::sleep(Duration::from_secs(1)).await;
            drop(ticket.busy());
        }
        assert_eq!(waiting.await.unwrap(), Expired::Head);
        assert_eq!(accepted.elapsed(), Duration::from_secs(5));
        // An idle deadline shorter than the head deadline the future sleeps on: the first
        // admitted answer brings it forward.
        let accepted = tokio::time::Instant::now();
        let ticket = t.admit(None, false, false, accepted).0.unwrap();
        let waiting = tokio::spawn(ticket.deadline(&limits(30, 1)));
        tokio::time::sleep(Duration::from_millis(500)).await;
        let answered = tokio::time::Instant::now();
        drop(serving(&ticket));
        assert_eq!(waiting.await.unwrap(), Expired::Idle);
        assert_eq!(answered.elapsed(), Duration::from_secs(1));
    }

    #[tokio::test(start_paused = true)]
    async fn refused_requests_after_an_answer_do_not_move_the_idle_deadline() {
        let bounds = limits(5, 30);
        let t = Arc::new(Table::new(4, None));
        let ticket = t.admit(None, false, false, Instant::now()).0.unwrap();
        let answered = tokio::time::Instant::now();
        drop(serving(&ticket));
        let waiting = tokio::spawn(ticket.deadline(&bounds));
        // An HTTP/2 peer (say) whose token has expired: a refused request every 5 s.
        for _ in 0..5 {
            tokio::time::sleep(Duration::from_secs(5)).await;
            drop(ticket.busy());
        }
        assert_eq!(waiting.await.unwrap(), Expired::Idle);
        assert_eq!(answered.elapsed(), Duration::from_secs(30));
    }

    #[test]
    fn a_served_client_holding_two_keeps_them_while_strangers_have_not_been_admitted() {
        let t = Arc::new(Table::new(6, None));
        let now = Instant::now() - Duration::from_secs(60);
        let at = |s| now + Duration::from_secs(s);
        // A client holding two connections, each answered and kept alive.
        let client: Vec<Ticket> = (0..2)
            .map(|i| admit(&t, Some("198.51.100.9"), at(i)).0.unwrap())
            .collect();
        for ticket in &client {
            drop(serving(ticket));
        }
        // Silent strangers, one connection per address, fill the listener.
        let strangers: Vec<Ticket> = (1..=4)
            .map(|i| {
                let addr = format!("203.0.113.{i}");
                admit(&t, Some(&addr), at(10 + i)).0.unwrap()
            })
            .collect();
        let mut newcomers = Vec::new();
        for i in 5..=8 {
            let addr = format!("203.0.113.{i}");
            let (newcomer, evicted) = admit(&t, Some(&addr), at(20 + i));
            assert!(evicted);
            newcomers.push(newcomer.unwrap());
            assert!(
                client.iter().all(|c| !c.kill.is_cancelled()),
                "a served client's connection gave way to stranger {i}"
            );
        }
        assert!(strangers.iter().all(|s| s.kill.is_cancelled()));
    }
}
