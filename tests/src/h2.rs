//! HTTP/2 with prior knowledge (h2c), with request bodies the tests shape themselves.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::{Body, Frame, SizeHint};
use hyper::client::conn::http2::SendRequest;
use hyper_util::rt::{TokioExecutor, TokioIo};

/// How long one HTTP/2 exchange may take.
pub const EXCHANGE_LIMIT: std::time::Duration = std::time::Duration::from_secs(10);

/// The client's connection preface (RFC 9113 §3.4), for tests that write raw frames.
pub const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// One raw HTTP/2 frame: its 9-byte header (`payload`'s length, `kind`, `flags`, `stream`)
/// and `payload`, which must be under 16 MiB.
pub fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = u32::try_from(payload.len())
        .ok()
        .filter(|n| *n < 1 << 24)
        .expect("an HTTP/2 frame's payload is under 16 MiB")
        .to_be_bytes();
    let mut frame = vec![len[1], len[2], len[3], kind, flags];
    frame.extend_from_slice(&stream.to_be_bytes());
    frame.extend_from_slice(payload);
    frame
}

/// A request body: whole (its length declared), given chunks or `left` bytes of JSON
/// whitespace with no length declared, or one that never sends a byte.
pub enum TestBody {
    Full(Option<Bytes>),
    Chunks(VecDeque<Bytes>),
    Spaces { left: usize, chunk: Bytes },
    Never,
}

impl TestBody {
    pub fn full(bytes: Vec<u8>) -> TestBody {
        TestBody::Full(Some(Bytes::from(bytes)))
    }

    /// `bytes` in 4 KiB data frames, no length declared.
    pub fn streamed(bytes: Vec<u8>) -> TestBody {
        let bytes = Bytes::from(bytes);
        let chunks = (0..bytes.len())
            .step_by(4096)
            .map(|i| bytes.slice(i..(i + 4096).min(bytes.len())))
            .collect();
        TestBody::Chunks(chunks)
    }

    /// `len` bytes of whitespace in 16 KiB data frames, no length declared.
    pub fn spaces(len: usize) -> TestBody {
        TestBody::Spaces {
            left: len,
            chunk: Bytes::from(vec![b' '; 16 * 1024]),
        }
    }
}

impl Body for TestBody {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        match self.get_mut() {
            TestBody::Full(bytes) => Poll::Ready(bytes.take().map(|b| Ok(Frame::data(b)))),
            TestBody::Chunks(chunks) => Poll::Ready(chunks.pop_front().map(|b| Ok(Frame::data(b)))),
            TestBody::Spaces { left, chunk } => {
                if *left == 0 {
                    return Poll::Ready(None);
                }
                let n = (*left).min(chunk.len());
                *left -= n;
                Poll::Ready(Some(Ok(Frame::data(chunk.slice(..n)))))
            }
            // Never woken: the request stays open until the stream is answered.
            TestBody::Never => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            TestBody::Full(b) => b.is_none(),
            TestBody::Chunks(c) => c.is_empty(),
            TestBody::Spaces { left, .. } => *left == 0,
            TestBody::Never => false,
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            TestBody::Full(Some(b)) => SizeHint::with_exact(b.len() as u64),
            TestBody::Full(None) => SizeHint::with_exact(0),
            _ => SizeHint::default(),
        }
    }
}

/// One h2c connection carrying any number of requests.
pub struct H2Conn {
    addr: SocketAddr,
    send: SendRequest<TestBody>,
    driver: tokio::task::JoinHandle<()>,
}

impl H2Conn {
    pub async fn connect(addr: SocketAddr) -> H2Conn {
        let tcp = tokio::net::TcpStream::connect(addr).await.expect("connect");
        let (send, conn) =
            hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tcp))
                .await
                .expect("h2 handshake");
        let driver = tokio::spawn(async move {
            let _ = conn.await;
        });
        H2Conn { addr, send, driver }
    }

    /// `POST /mcp` (bounded); the status and the whole response body.
    pub async fn post(
        &mut self,
        bearer: Option<&str>,
        headers: &[(&str, String)],
        body: TestBody,
    ) -> Result<(u16, Vec<u8>), String> {
        let mut req = http::Request::builder()
            .method("POST")
            .uri(format!("http://{}/mcp", self.addr))
            .header("content-type", "application/json")
            .header("accept", "application/json, text/event-stream")
            .header("mcp-protocol-version", crate::V_2025_11_25);
        if let Some(b) = bearer {
            req = req.header("authorization", format!("Bearer {b}"));
        }
        for (k, v) in headers {
            req = req.header(*k, v);
        }
        let req = req.body(body).map_err(|e| e.to_string())?;
        let fut = async {
            self.send
                .ready()
                .await
                .map_err(|e| format!("h2 connection: {e}"))?;
            let resp = self
                .send
                .send_request(req)
                .await
                .map_err(|e| format!("h2 request: {e}"))?;
            let status = resp.status().as_u16();
            let body = resp
                .into_body()
                .collect()
                .await
                .map_err(|e| format!("h2 response body: {e}"))?
                .to_bytes()
                .to_vec();
            Ok((status, body))
        };
        match tokio::time::timeout(EXCHANGE_LIMIT, fut).await {
            Ok(r) => r,
            Err(_) => Err(format!("no h2 response within {:?}", EXCHANGE_LIMIT)),
        }
    }
}

impl H2Conn {
    /// Whether the server has closed the connection (the client's driver has ended).
    pub fn is_closed(&self) -> bool {
        self.driver.is_finished()
    }
}

impl Drop for H2Conn {
    fn drop(&mut self) {
        self.driver.abort();
    }
}
