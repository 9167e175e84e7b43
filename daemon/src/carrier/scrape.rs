//! The `/metrics` listener: the Prometheus text exposition, `GET`/`HEAD` only, on the
//! same bounded HTTP loop as the carriers.

use std::sync::Arc;

use http_body_util::BodyExt;

use super::http::{self as server, Body, HeadRefusal};
use crate::audit::Audit;
use crate::health::Health;
use crate::metrics::Metrics;
use crate::vocab::{Listener, Rejection, StatePart};

/// The `/metrics` listener's request handler.
#[derive(Clone)]
pub struct Scrape {
    pub metrics: Metrics,
    pub audit: Arc<Audit>,
    pub health: Arc<Health>,
    /// On a loopback listener, the `Host` values a scrape may carry (its own address, or
    /// `localhost`, with the port); any other name is a page that rebound a name of its
    /// own to this host. `None`: any `Host` (a listener the operator put on a network).
    pub hosts: Option<Arc<[String]>>,
}

impl Scrape {
    /// The handler for a listener bound at `local`.
    pub fn new(
        metrics: Metrics,
        audit: Arc<Audit>,
        health: Arc<Health>,
        local: std::net::SocketAddr,
    ) -> Self {
        let hosts = local.ip().is_loopback().then(|| {
            let port = local.port();
            let own = match local {
                std::net::SocketAddr::V4(a) => format!("{}:{port}", a.ip()),
                std::net::SocketAddr::V6(a) => format!("[{}]:{port}", a.ip()),
            };
            let mut hosts = vec![format!("localhost:{port}")];
            // On port 80 a client may leave the port out.
            if port == 80 {
                hosts.push("localhost".into());
                hosts.push(own.trim_end_matches(":80").to_owned());
            }
            hosts.push(own);
            hosts.into()
        });
        Self {
            metrics,
            audit,
            health,
            hosts,
        }
    }

    fn host_allowed(&self, req: &hyper::Request<hyper::body::Incoming>) -> bool {
        let Some(hosts) = &self.hosts else {
            return true;
        };
        let host = req
            .headers()
            .get(http::header::HOST)
            .and_then(|h| h.to_str().ok())
            .or_else(|| req.uri().authority().map(|a| a.as_str()));
        host.is_some_and(|h| hosts.iter().any(|ok| ok.eq_ignore_ascii_case(h)))
    }
}

impl server::Handler for Scrape {
    async fn handle(
        &self,
        req: hyper::Request<hyper::body::Incoming>,
        _peer: std::net::SocketAddr,
    ) -> hyper::Response<Body> {
        if !self.host_allowed(&req) {
            self.metrics
                .rejected(Listener::Metrics, Rejection::WrongHost);
            return server::empty(http::StatusCode::FORBIDDEN);
        }
        if req.uri().path() != "/metrics" {
            self.metrics
                .rejected(Listener::Metrics, Rejection::NotFound);
            return server::empty(http::StatusCode::NOT_FOUND);
        }
        if req.method() != http::Method::GET && req.method() != http::Method::HEAD {
            self.metrics
                .rejected(Listener::Metrics, Rejection::MethodNotAllowed);
            let mut response = server::empty(http::StatusCode::METHOD_NOT_ALLOWED);
            response.headers_mut().insert(
                http::header::ALLOW,
                http::HeaderValue::from_static("GET, HEAD"),
            );
            return response;
        }
        server::admit(&req);
        self.metrics.audit_unpersisted(self.audit.unpersisted());
        for part in StatePart::ALL {
            self.metrics
                .state_write_failures(part, self.health.failures_total(part));
        }
        let mut response = hyper::Response::new(
            http_body_util::Full::new(bytes::Bytes::from(self.metrics.render())).boxed(),
        );
        response.headers_mut().insert(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
        );
        response
    }

    fn head_refused(&self, _peer: std::net::SocketAddr, _why: HeadRefusal) {
        self.metrics
            .rejected(Listener::Metrics, Rejection::HeadTooLarge);
    }
}
