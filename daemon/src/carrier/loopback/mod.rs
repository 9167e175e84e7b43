//! The loopback Streamable HTTP carrier (docs/design.md §5): 127.0.0.1 only, Host/Origin checks,
//! a daemon-minted bearer, stateless rmcp behind it.
//!
//! Invariant: admission never reads the body; what happens after admission is
//! [`super::endpoint`], shared with the remote carrier.

pub mod admission;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::SystemTime;

use http::{HeaderValue, header};
use hyper::body::Incoming;
use hyper::{Request, Response};
use tokio::net::TcpListener;

use self::admission::{Expected, Refusal};
use super::Sockets;
use super::endpoint::{self, Endpoint, Site};
use super::http::{self as server, Body, HeadRefusal};
use crate::audit::{Audit, Record};
use crate::bearer::BearerStore;
use crate::config::{Limits, LoopbackConfig, WireNameProfile};
use crate::mcp::McpServer;
use crate::metrics::Metrics;
use crate::session::{RuntimeTools, TurnSubmission};
use crate::transport::{Carrier, Drain};
use crate::vocab::Caller;
use crate::vocab::Listener;
use crate::vocab::{AddressClass, Carrier as CarrierName, Reason};

/// The loopback carrier, over the daemon's bearers (the host bearer is minted at each
/// attach, by the daemon) and its kept sockets.
pub struct LoopbackCarrier {
    config: LoopbackConfig,
    limits: Limits,
    audit: Arc<Audit>,
    metrics: Metrics,
    bearers: Arc<BearerStore>,
    sockets: Arc<Sockets>,
}

impl LoopbackCarrier {
    pub fn new(
        config: LoopbackConfig,
        limits: Limits,
        audit: Arc<Audit>,
        metrics: Metrics,
        bearers: Arc<BearerStore>,
        sockets: Arc<Sockets>,
    ) -> Self {
        Self {
            config,
            limits,
            audit,
            metrics,
            bearers,
            sockets,
        }
    }
}

impl Carrier for LoopbackCarrier {
    type Bound = TcpListener;

    fn wire_names(&self) -> (WireNameProfile, BTreeMap<String, String>) {
        (self.config.wire_names, self.config.aliases.clone())
    }

    async fn bind(&self) -> std::io::Result<TcpListener> {
        if !self.config.listen.ip().is_loopback() || !self.config.listen.is_ipv4() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!(
                    "the loopback carrier binds 127.0.0.1 only, not {}",
                    self.config.listen
                ),
            ));
        }
        self.sockets
            .listener(Listener::Loopback, self.config.listen)
    }

    fn address(bound: &TcpListener) -> String {
        bound
            .local_addr()
            .map_or_else(|_| "unknown".into(), |a| a.to_string())
    }

    async fn serve<S: RuntimeTools + TurnSubmission>(
        self: Arc<Self>,
        listener: TcpListener,
        server: McpServer<S>,
        drain: Drain,
    ) {
        let port = listener.local_addr().map(|a| a.port()).unwrap_or(0);
        let expected = Expected::new(&self.config.path, port);
        let site = Site {
            listener: Listener::Loopback,
            metrics: self.metrics.clone(),
        };
        let endpoint = Endpoint::new(server, site, &self.config.bounds, &self.limits);
        let handler = Loopback {
            shared: Arc::new(Shared {
                expected,
                bearers: self.bearers.clone(),
                audit: self.audit.clone(),
                metrics: self.metrics.clone(),
                endpoint,
            }),
        };
        let options = server::Options {
            name: Listener::Loopback,
            bounds: self.config.bounds,
            tls: None,
            shared_peers: Vec::new(),
            ipv6_prefix: 64,
            metrics: self.metrics.clone(),
        };
        server::serve(listener, options, handler, drain).await;
    }
}

struct Shared<S> {
    expected: Expected,
    bearers: Arc<BearerStore>,
    audit: Arc<Audit>,
    metrics: Metrics,
    endpoint: Endpoint<S>,
}

struct Loopback<S> {
    shared: Arc<Shared<S>>,
}

impl<S> Clone for Loopback<S> {
    fn clone(&self) -> Self {
        Self {
            shared: self.shared.clone(),
        }
    }
}

impl<S: RuntimeTools + TurnSubmission> server::Handler for Loopback<S> {
    async fn handle(&self, req: Request<Incoming>, peer: SocketAddr) -> Response<Body> {
        let s = &self.shared;
        let now = SystemTime::now();
        let admitted = admission::admit(req.uri(), req.headers(), &s.expected, |token| {
            s.bearers.check(token, now)
        });
        match admitted {
            Ok(label) => {
                server::admit(&req);
                s.metrics.admitted(CarrierName::Loopback);
                s.endpoint
                    .serve(req, Caller::Bearer(label).into(), None)
                    .await
            }
            Err(refusal) => {
                let response = self.refuse(refusal, peer, req.version(), now);
                server::discard_body(req);
                response
            }
        }
    }

    fn head_refused(&self, peer: SocketAddr, why: HeadRefusal) {
        let HeadRefusal::TooLarge = why;
        let s = &self.shared;
        let class = AddressClass::of(peer.ip());
        let record = Record::refusal(
            SystemTime::now(),
            CarrierName::Loopback,
            Reason::Oversize,
            class,
        );
        s.audit.refused(&s.metrics, record);
    }
}

impl<S> Loopback<S> {
    fn refuse(
        &self,
        refusal: Refusal,
        peer: SocketAddr,
        version: http::Version,
        now: SystemTime,
    ) -> Response<Body> {
        let s = &self.shared;
        let class = AddressClass::of(peer.ip());
        let record = Record::refusal(now, CarrierName::Loopback, refusal.0, class);
        s.audit.refused(&s.metrics, record);
        let mut response = server::empty(refusal.status());
        if let Some(challenge) = refusal.challenge() {
            response.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                HeaderValue::from_static(challenge),
            );
        }
        endpoint::closing(response, version)
    }
}
