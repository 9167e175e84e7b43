//! The remote Streamable HTTP carrier: an OAuth 2 resource server (docs/design.md §6).
//!
//! A request is routed by the public URL's names (endpoint, RFC 9728 metadata, 404),
//! checked for the public Host and Origin, then its bearer token is verified by the
//! injected [`Verifier`] *before* the throttle decides, so a valid token is never
//! throttled by failures sharing its address. The verifier is told who asks
//! ([`Asker`]): its client (whose opaque tokens share a few places with the issuer),
//! whether it was over its budget (same verdict, any signature check in a lane of one off
//! the workers, so such a flood cannot take the workers from valid clients), and whether
//! it may still cost the issuer a request (over its budget: a few per window).
//! Failures are counted per client address
//! (`X-Forwarded-For` believed only from trusted proxies). Refusals have empty bodies and
//! RFC 6750 challenges; every refusal is audited. Admitted requests go to the same
//! [`Endpoint`] as the loopback carrier's, as caller `oauth:<client_id>/<sub>`.

pub mod admission;
pub mod forwarded;
pub mod throttle;

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Instant, SystemTime};

use bytes::Bytes;
use http::{HeaderValue, Method, StatusCode, header};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Request, Response};
use tokio::net::TcpListener;

use self::admission::{Challenges, Credentials, Failure, Refusal, Route};
use self::throttle::Throttle;
use super::Sockets;
use super::endpoint::{self, Endpoint, Site};
use super::http::{self as server, Body, HeadRefusal};
use crate::audit::{Audit, Record};
use crate::config::{Limits, RemoteConfig, WireNameProfile};
use crate::mcp::McpServer;
use crate::metrics::Metrics;
use crate::oauth::{Asker, LateFailure, Verifier};
use crate::session::{RuntimeTools, TurnSubmission};
use crate::transport::{Carrier, Drain};
use crate::vocab::{AddressClass, Carrier as CarrierName, Reason};
use crate::vocab::{Admitted, Caller};
use crate::vocab::{Listener, Rejection};

/// The remote carrier. The verifier and throttle are handed in (they outlive reloads
/// whose `[remote]` settings for them did not change), and so is the TLS acceptor, read
/// from the files by the plan, so a reload with bad TLS files fails before anything
/// stops.
pub struct RemoteCarrier {
    config: RemoteConfig,
    limits: Limits,
    verifier: Arc<dyn Verifier>,
    throttle: Arc<Throttle>,
    tls: Option<tokio_rustls::TlsAcceptor>,
    audit: Arc<Audit>,
    metrics: Metrics,
    sockets: Arc<Sockets>,
}

/// What `bind` produced: the listener and, when terminating TLS here, the acceptor.
pub struct Bound {
    listener: TcpListener,
    tls: Option<tokio_rustls::TlsAcceptor>,
}

/// What a remote carrier is built from, besides its configuration.
pub struct Parts {
    pub limits: Limits,
    pub verifier: Arc<dyn Verifier>,
    pub throttle: Arc<Throttle>,
    /// The acceptor from the TLS files, when the carrier terminates TLS.
    pub tls: Option<tokio_rustls::TlsAcceptor>,
    pub audit: Arc<Audit>,
    pub metrics: Metrics,
    pub sockets: Arc<Sockets>,
}

impl RemoteCarrier {
    /// Audits one refusal of `client` (and counts it in `refusals_total`). A failure
    /// against its budget is counted where the refusal is decided, not here.
    fn refused(&self, reason: Reason, throttled: bool, client: IpAddr) {
        let class = AddressClass::of(client);
        let record = Record::refusal(SystemTime::now(), CarrierName::Remote, reason, class);
        self.audit.refused(
            &self.metrics,
            Record {
                throttled,
                ..record
            },
        );
    }

    pub fn new(config: RemoteConfig, parts: Parts) -> Self {
        let Parts {
            limits,
            verifier,
            throttle,
            tls,
            audit,
            metrics,
            sockets,
        } = parts;
        Self {
            config,
            limits,
            verifier,
            throttle,
            tls,
            audit,
            metrics,
            sockets,
        }
    }

    pub fn config(&self) -> &RemoteConfig {
        &self.config
    }

    pub fn public_url(&self) -> &str {
        self.config.public_url.as_str()
    }

    pub fn verifier(&self) -> &Arc<dyn Verifier> {
        &self.verifier
    }

    pub fn throttle(&self) -> &Arc<Throttle> {
        &self.throttle
    }
}

impl Carrier for RemoteCarrier {
    type Bound = Bound;

    fn wire_names(&self) -> (WireNameProfile, BTreeMap<String, String>) {
        (self.config.wire_names, self.config.aliases.clone())
    }

    async fn bind(&self) -> std::io::Result<Bound> {
        let listener = self
            .sockets
            .listener(Listener::Remote, self.config.listen)?;
        Ok(Bound {
            listener,
            tls: self.tls.clone(),
        })
    }

    fn address(bound: &Bound) -> String {
        bound
            .listener
            .local_addr()
            .map_or_else(|_| "unknown".into(), |a| a.to_string())
    }

    async fn serve<S: RuntimeTools + TurnSubmission>(
        self: Arc<Self>,
        bound: Bound,
        server: McpServer<S>,
        drain: Drain,
    ) {
        let url = &self.config.public_url;
        let site = Site {
            listener: Listener::Remote,
            metrics: self.metrics.clone(),
        };
        let endpoint = Endpoint::new(server, site, &self.config.bounds, &self.limits);
        let metadata =
            admission::metadata_document(url, &self.config.issuer, &self.config.scopes_supported)
                .to_string();
        let handler = Remote {
            shared: Arc::new(Shared {
                challenges: Challenges {
                    metadata_url: url.metadata_url(),
                    scope: self.config.scopes.join(" "),
                },
                metadata: Bytes::from(metadata),
                carrier: self.clone(),
                endpoint,
            }),
        };
        let options = server::Options {
            name: Listener::Remote,
            bounds: self.config.bounds,
            tls: bound.tls,
            shared_peers: self.config.trusted_proxies.clone(),
            ipv6_prefix: self.config.throttle.ipv6_prefix,
            metrics: self.metrics.clone(),
        };
        server::serve(bound.listener, options, handler, drain).await;
    }
}

struct Shared<S> {
    carrier: Arc<RemoteCarrier>,
    challenges: Challenges,
    metadata: Bytes,
    endpoint: Endpoint<S>,
}

struct Remote<S> {
    shared: Arc<Shared<S>>,
}

impl<S> Clone for Remote<S> {
    fn clone(&self) -> Self {
        Self {
            shared: self.shared.clone(),
        }
    }
}

impl<S: RuntimeTools + TurnSubmission> server::Handler for Remote<S> {
    async fn handle(&self, req: Request<Incoming>, peer: SocketAddr) -> Response<Body> {
        let s = &self.shared;
        let c = &s.carrier;
        let client = forwarded::client_address(peer.ip(), req.headers(), &c.config.trusted_proxies);
        let version = req.version();
        let route = match admission::route(req.uri(), req.headers(), &c.config.public_url) {
            Ok(route) => route,
            Err(reason) => {
                let response = self.refuse(admission::wrong_name(reason), client, version);
                server::discard_body(req);
                return response;
            }
        };
        match route {
            Route::NotFound => {
                c.metrics.rejected(Listener::Remote, Rejection::NotFound);
                return server::empty(StatusCode::NOT_FOUND);
            }
            Route::Metadata => return self.metadata(req.method()),
            Route::Endpoint => {}
        }
        let outcome = match admission::credentials(req.headers()) {
            Credentials::Missing => Err(Failure::Missing),
            Credentials::Malformed => Err(Failure::MalformedHeader),
            Credentials::Token(token) => {
                let now = Instant::now();
                let suspect = c.throttle.check(client, now).is_some();
                // A client that failed lately: until its token proves good, its connection
                // gives way before those of clients that have not.
                let failing = c.throttle.failing(client, now);
                if failing {
                    server::distrust(&req);
                }
                // Asked when the token is about to go to the issuer, not now: a request
                // that waited for its place sees the failures counted meanwhile.
                let may_introspect = || c.throttle.may_introspect(client, Instant::now());
                // A token the issuer refuses after the request went away is a refusal all
                // the same: counted and audited (nothing was answered, so not throttled).
                let late_failure = || -> LateFailure {
                    let c = Arc::clone(c);
                    Box::new(move |reason| {
                        c.throttle.fail(client, Instant::now());
                        c.refused(reason, false, client)
                    })
                };
                // Its connection outlasts undecided ones while the issuer judges its token.
                let sending = server::asking_issuer(&req);
                let asker = Asker {
                    client: c.throttle.client(client),
                    suspect,
                    failing,
                    may_introspect: &may_introspect,
                    sending: &sending,
                    late_failure: &late_failure,
                };
                c.verifier
                    .verify(token, SystemTime::now(), asker)
                    .await
                    .map_err(Failure::Token)
            }
        };
        // Counted and judged in one step: concurrent failures of one client are each
        // judged against those counted before them.
        let fail = || c.throttle.fail(client, Instant::now());
        match admission::decide(outcome, fail, &s.challenges) {
            Ok(principal) => {
                server::admit(&req);
                c.metrics.admitted(CarrierName::Remote);
                let caller = Caller::OAuth {
                    client_id: principal.client_id,
                    subject: principal.subject,
                };
                // Step-up: a call whose tool needs scopes this token lacks is answered
                // 403 with every scope it needs, before it reaches the session.
                let gate = |tool: &str, admitted: &Admitted| {
                    let needed = c.config.scopes_for(tool);
                    let held = admitted.scopes.as_deref().unwrap_or_default();
                    if admission::lacking(&needed, held).is_empty() {
                        return None;
                    }
                    let refusal = admission::step_up(&needed, &s.challenges);
                    Some(self.refuse(refusal, client, version))
                };
                let admitted = Admitted::with_token(caller, principal.scopes);
                s.endpoint.serve(req, admitted, Some(&gate)).await
            }
            Err(refusal) => {
                let response = self.refuse(refusal, client, version);
                server::discard_body(req);
                response
            }
        }
    }

    /// A connection from an address that failed in its current throttle window (the TCP
    /// peer: behind a trusted proxy, the proxy, which the throttle does not count).
    fn distrusts(&self, peer: std::net::IpAddr) -> bool {
        self.shared.carrier.throttle.failing(peer, Instant::now())
    }

    fn head_refused(&self, peer: SocketAddr, why: HeadRefusal) {
        let HeadRefusal::TooLarge = why;
        let c = &self.shared.carrier;
        // The head was not read, so the peer is all we know of the client.
        c.refused(Reason::Oversize, false, peer.ip());
    }
}

impl<S> Remote<S> {
    fn metadata(&self, method: &Method) -> Response<Body> {
        if method != Method::GET && method != Method::HEAD {
            let metrics = &self.shared.carrier.metrics;
            metrics.rejected(Listener::Remote, Rejection::MethodNotAllowed);
            let mut response = server::empty(StatusCode::METHOD_NOT_ALLOWED);
            response
                .headers_mut()
                .insert(header::ALLOW, HeaderValue::from_static("GET, HEAD"));
            return response;
        }
        let mut response = Response::new(Full::new(self.shared.metadata.clone()).boxed());
        response.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        response
    }

    fn refuse(
        &self,
        refusal: Refusal,
        client: std::net::IpAddr,
        version: http::Version,
    ) -> Response<Body> {
        let c = &self.shared.carrier;
        c.refused(refusal.reason, refusal.throttled, client);
        let mut response = server::empty(refusal.status);
        let headers = response.headers_mut();
        if let Some(challenge) = refusal
            .challenge
            .as_deref()
            .and_then(|c| HeaderValue::from_str(c).ok())
        {
            headers.insert(header::WWW_AUTHENTICATE, challenge);
        }
        if let Some(seconds) = refusal.retry_after {
            headers.insert(header::RETRY_AFTER, HeaderValue::from(seconds));
        }
        endpoint::closing(response, version)
    }
}
