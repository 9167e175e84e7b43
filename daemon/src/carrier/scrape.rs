//! The `/metrics` listener: the Prometheus text exposition, `GET`/`HEAD` only, on the
//! same bounded HTTP loop as the carriers.

use std::sync::Arc;

use http_body_util::BodyExt;

use super::http::{self as server, Body, HeadRefusal};
use crate::audit::Audit;
use crate::metrics::Metrics;
use crate::vocab::{Listener, Rejection};

/// The `/metrics` listener's request handler.
#[derive(Clone)]
pub struct Scrape {
    pub metrics: Metrics,
    pub audit: Arc<Audit>,
}

impl server::Handler for Scrape {
    async fn handle(
        &self,
        req: hyper::Request<hyper::body::Incoming>,
        _peer: std::net::SocketAddr,
    ) -> hyper::Response<Body> {
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
        self.metrics.audit_unpersisted(self.audit.dropped());
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
