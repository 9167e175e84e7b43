//! A bounded HTTP/1.1 + HTTP/2 (prior knowledge) server loop shared by the HTTP carriers.
//!
//! Bounds: a connection cap (the accept loop waits for a free slot, so extra clients wait
//! in the kernel backlog), a deadline for the first byte and for the whole request head
//! (hyper's header-read timeout, which is off unless a timer is given), a cap on header
//! bytes and count. Shutdown stops accepting, asks each connection to finish gracefully,
//! and waits for them; the transport bounds that wait.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::combinators::BoxBody;
use hyper::body::Incoming;
use hyper::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::HttpLimits;

/// The response body type every carrier answers with.
pub type Body = BoxBody<Bytes, Infallible>;

/// Most headers in one request.
const MAX_HEADERS: usize = 64;

/// How long a connection may take to finish its in-flight requests after shutdown
/// starts; then it is closed, which cancels whatever it was still running. Below the
/// transport's stop bound.
pub const DRAIN_GRACE: Duration = Duration::from_secs(4);

/// Handles one request; gets the TCP peer address.
pub trait Handler: Clone + Send + Sync + 'static {
    fn handle(
        &self,
        req: Request<Incoming>,
        peer: SocketAddr,
    ) -> impl Future<Output = Response<Body>> + Send;
}

fn builder(bounds: &HttpLimits) -> auto::Builder<TokioExecutor> {
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(bounds.header_timeout)
        .max_buf_size(bounds.max_header_bytes.max(8192))
        .max_headers(MAX_HEADERS);
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_header_list_size(u32::try_from(bounds.max_header_bytes).unwrap_or(u32::MAX))
        .max_concurrent_streams(u32::try_from(bounds.max_in_flight).unwrap_or(u32::MAX));
    builder
}

/// Serve `listener` until `shutdown` fires, then drain the open connections.
pub async fn serve<H: Handler>(
    listener: TcpListener,
    bounds: HttpLimits,
    tls: Option<tokio_rustls::TlsAcceptor>,
    handler: H,
    shutdown: CancellationToken,
) {
    let builder = Arc::new(builder(&bounds));
    let slots = Arc::new(Semaphore::new(bounds.max_connections));
    let tracker = TaskTracker::new();
    loop {
        let permit = tokio::select! {
            biased;
            () = shutdown.cancelled() => break,
            permit = slots.clone().acquire_owned() => match permit {
                Ok(p) => p,
                Err(_) => break,
            },
        };
        let (stream, peer) = tokio::select! {
            biased;
            () = shutdown.cancelled() => break,
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
        let _ = stream.set_nodelay(true);
        let (builder, handler, shutdown, tls) = (
            builder.clone(),
            handler.clone(),
            shutdown.clone(),
            tls.clone(),
        );
        tracker.spawn(async move {
            let _permit = permit;
            // A client that connects and sends nothing is cut at the head deadline; the
            // protocol sniffing below would otherwise wait for it forever.
            let mut first = [0u8; 1];
            match tokio::time::timeout(bounds.header_timeout, stream.peek(&mut first)).await {
                Ok(Ok(n)) if n > 0 => {}
                _ => return,
            }
            match tls {
                None => connection(&builder, TokioIo::new(stream), handler, peer, &shutdown).await,
                Some(acceptor) => {
                    // The handshake runs here, in the connection's task, under the head deadline.
                    let Ok(Ok(stream)) =
                        tokio::time::timeout(bounds.header_timeout, acceptor.accept(stream)).await
                    else {
                        return;
                    };
                    connection(&builder, TokioIo::new(stream), handler, peer, &shutdown).await;
                }
            }
        });
    }
    drop(listener);
    tracker.close();
    tracker.wait().await;
}

async fn connection<H, I>(
    builder: &auto::Builder<TokioExecutor>,
    io: I,
    handler: H,
    peer: SocketAddr,
    shutdown: &CancellationToken,
) where
    H: Handler,
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    let service = hyper::service::service_fn(move |req| {
        let handler = handler.clone();
        async move { Ok::<_, Infallible>(handler.handle(req, peer).await) }
    });
    let conn = builder.serve_connection(io, service);
    tokio::pin!(conn);
    tokio::select! {
        _ = conn.as_mut() => {}
        () = shutdown.cancelled() => {
            conn.as_mut().graceful_shutdown();
            let _ = tokio::time::timeout(DRAIN_GRACE, conn).await;
        }
    }
}

/// A TLS acceptor from PEM files (certificate chain, private key), offering h2 and
/// http/1.1 by ALPN.
pub fn tls_acceptor(
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
