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

/// The response body type every carrier answers with.
pub type Body = BoxBody<Bytes, Infallible>;

/// Most headers in one request.
const MAX_HEADERS: usize = 64;

/// How long a connection may take to finish its in-flight requests after shutdown
/// starts; then it is closed, which cancels whatever it was still running. Below the
/// transport's stop bound.
pub const DRAIN_GRACE: Duration = Duration::from_secs(4);

/// Connection-level bounds.
#[derive(Debug, Clone, Copy)]
pub struct Bounds {
    pub max_connections: usize,
    pub header_timeout: Duration,
    pub max_header_bytes: usize,
    /// Concurrent HTTP/2 streams per connection.
    pub max_streams: u32,
}

/// Handles one request; gets the TCP peer address.
pub trait Handler: Clone + Send + Sync + 'static {
    fn handle(
        &self,
        req: Request<Incoming>,
        peer: SocketAddr,
    ) -> impl Future<Output = Response<Body>> + Send;
}

fn builder(bounds: &Bounds) -> auto::Builder<TokioExecutor> {
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
        .max_concurrent_streams(bounds.max_streams);
    builder
}

/// Serve `listener` until `shutdown` fires, then drain the open connections.
pub async fn serve<H: Handler>(
    listener: TcpListener,
    bounds: Bounds,
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
        let (builder, handler, shutdown) = (builder.clone(), handler.clone(), shutdown.clone());
        tracker.spawn(async move {
            let _permit = permit;
            // A client that connects and sends nothing is cut at the head deadline; the
            // protocol sniffing below would otherwise wait for it forever.
            let mut first = [0u8; 1];
            match tokio::time::timeout(bounds.header_timeout, stream.peek(&mut first)).await {
                Ok(Ok(n)) if n > 0 => {}
                _ => return,
            }
            let service = hyper::service::service_fn(move |req| {
                let handler = handler.clone();
                async move { Ok::<_, Infallible>(handler.handle(req, peer).await) }
            });
            let conn = builder.serve_connection(TokioIo::new(stream), service);
            tokio::pin!(conn);
            tokio::select! {
                _ = conn.as_mut() => {}
                () = shutdown.cancelled() => {
                    conn.as_mut().graceful_shutdown();
                    let _ = tokio::time::timeout(DRAIN_GRACE, conn).await;
                }
            }
        });
    }
    drop(listener);
    tracker.close();
    tracker.wait().await;
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
