//! A small Docker Engine API client: one HTTP/1.1 connection per request over the unix
//! socket, every step bounded in time and every body read bounded in size.

use std::io;
use std::path::{Path, PathBuf};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::header::{HOST, USER_AGENT};
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, Empty};
use hyper::body::Incoming;
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use serde_json::Value;
use tokio::net::UnixStream;
use tokio::task::JoinHandle;
use tokio::time::Instant;

/// The API version every path is prefixed with (Docker 20.10 and later serve it).
pub const API_PREFIX: &str = "/v1.41";

/// Why an exchange with the engine failed (an engine *answer*, whatever its status, is
/// not an error here).
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("cannot connect to {}", .socket.display())]
    Unreachable {
        socket: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("the engine sent no answer within {}", humantime::format_duration(*.0))]
    NoAnswer(Duration),
    #[error("the engine's body did not arrive within {}", humantime::format_duration(*.0))]
    SlowBody(Duration),
    #[error("the engine's body is over {0} bytes")]
    TooLarge(usize),
    #[error("the request could not be built")]
    Request(#[source] http::Error),
    #[error("the HTTP exchange failed")]
    Http(#[source] hyper::Error),
    #[error("the engine's answer is not the JSON expected")]
    Json(#[source] serde_json::Error),
}

/// The engine behind one unix socket.
#[derive(Debug, Clone)]
pub struct Engine {
    socket: PathBuf,
}

impl Engine {
    pub fn new(socket: PathBuf) -> Self {
        Self { socket }
    }

    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// Sends `method path_and_query` (the version prefix is added) with no body and waits
    /// at most `head_limit` for connecting, sending and the response head.
    pub async fn request(
        &self,
        method: Method,
        path_and_query: &str,
        head_limit: Duration,
    ) -> Result<Response, EngineError> {
        let request = Request::builder()
            .method(method)
            .uri(format!("{API_PREFIX}{path_and_query}"))
            .header(HOST, "docker")
            .header(
                USER_AGENT,
                concat!("robota-mcpd/", env!("CARGO_PKG_VERSION")),
            )
            .body(Empty::<Bytes>::new())
            .map_err(EngineError::Request)?;
        let exchange = async {
            let stream = UnixStream::connect(&self.socket).await.map_err(|source| {
                EngineError::Unreachable {
                    socket: self.socket.clone(),
                    source,
                }
            })?;
            let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
                .await
                .map_err(EngineError::Http)?;
            let conn = ConnTask(tokio::spawn(async move {
                if let Err(e) = conn.await {
                    tracing::debug!(error = %e, "Docker engine connection ended with an error");
                }
            }));
            let response = sender
                .send_request(request)
                .await
                .map_err(EngineError::Http)?;
            Ok(Response {
                status: response.status(),
                body: response.into_body(),
                _sender: sender,
                _conn: conn,
            })
        };
        tokio::time::timeout(head_limit, exchange)
            .await
            .map_err(|_| EngineError::NoAnswer(head_limit))?
    }
}

/// The connection's driver task, aborted when the response is dropped.
struct ConnTask(JoinHandle<()>);

impl Drop for ConnTask {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// An answer from the engine: its status and a body still to be read.
pub struct Response {
    pub status: StatusCode,
    body: Incoming,
    _sender: SendRequest<Empty<Bytes>>,
    _conn: ConnTask,
}

impl Response {
    /// The next piece of body data, `None` at the end; waits until `deadline` at most.
    pub async fn chunk(
        &mut self,
        deadline: Instant,
        limit: Duration,
    ) -> Result<Option<Bytes>, EngineError> {
        loop {
            let frame = tokio::time::timeout_at(deadline, self.body.frame())
                .await
                .map_err(|_| EngineError::SlowBody(limit))?;
            match frame {
                None => return Ok(None),
                Some(Err(e)) => return Err(EngineError::Http(e)),
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        return Ok(Some(data));
                    }
                    // Trailers carry nothing we use.
                }
            }
        }
    }

    /// The whole body, at most `cap` bytes, within `limit`.
    pub async fn bytes(mut self, cap: usize, limit: Duration) -> Result<Bytes, EngineError> {
        let deadline = Instant::now() + limit;
        let mut out = BytesMut::new();
        while let Some(data) = self.chunk(deadline, limit).await? {
            if out.len() + data.len() > cap {
                return Err(EngineError::TooLarge(cap));
            }
            out.extend_from_slice(&data);
        }
        Ok(out.freeze())
    }

    /// The body as JSON (at most `cap` bytes, within `limit`).
    pub async fn json(self, cap: usize, limit: Duration) -> Result<Value, EngineError> {
        let bytes = self.bytes(cap, limit).await?;
        serde_json::from_slice(&bytes).map_err(EngineError::Json)
    }

    /// The engine's explanation of a failure: the `message` of its JSON error body, else
    /// the start of the body as text. Best effort: never fails.
    pub async fn message(self, limit: Duration) -> String {
        const CAP: usize = 64 * 1024;
        let status = self.status;
        match self.bytes(CAP, limit).await {
            Ok(body) => message_of(&body).unwrap_or_else(|| format!("HTTP {status}")),
            Err(e) => format!("HTTP {status} (the body was unreadable: {e})"),
        }
    }
}

/// `{"message": "..."}` → the message; other text → its first 200 characters.
fn message_of(body: &[u8]) -> Option<String> {
    if let Ok(value) = serde_json::from_slice::<Value>(body)
        && let Some(message) = value.get("message").and_then(Value::as_str)
    {
        return Some(message.to_owned());
    }
    let text = String::from_utf8_lossy(body);
    let text = text.trim();
    (!text.is_empty()).then(|| text.chars().take(200).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_messages_come_from_the_json_body() {
        assert_eq!(
            message_of(br#"{"message": "No such container: web"}"#).as_deref(),
            Some("No such container: web")
        );
        assert_eq!(
            message_of(b"  plain failure\n").as_deref(),
            Some("plain failure")
        );
        assert_eq!(message_of(b""), None);
        let long = "x".repeat(1000);
        assert_eq!(message_of(long.as_bytes()).map(|m| m.len()), Some(200));
    }

    #[tokio::test]
    async fn a_missing_socket_is_unreachable_at_once() {
        let dir = tempfile::tempdir().unwrap();
        let engine = Engine::new(dir.path().join("docker.sock"));
        let started = std::time::Instant::now();
        let err = engine
            .request(Method::GET, "/containers/web/json", Duration::from_secs(5))
            .await
            .err()
            .expect("no engine listens");
        assert!(
            matches!(&err, EngineError::Unreachable { source, .. } if source.kind() == io::ErrorKind::NotFound),
            "{err:?}"
        );
        assert!(started.elapsed() < Duration::from_secs(1));
    }

    #[tokio::test(start_paused = true)]
    async fn an_engine_that_never_answers_is_cut_off() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("docker.sock");
        // Bound and listening, so connecting succeeds, but nobody ever reads the request.
        let _listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
        let engine = Engine::new(path);
        let err = engine
            .request(Method::GET, "/containers/web/json", Duration::from_secs(3))
            .await
            .err()
            .expect("no answer comes");
        assert!(
            matches!(err, EngineError::NoAnswer(d) if d == Duration::from_secs(3)),
            "{err:?}"
        );
    }

    /// A one-shot server answering every request on one connection with `reply`, and
    /// handing back the request head it read.
    async fn one_shot(path: &Path, reply: &'static [u8]) -> JoinHandle<String> {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::UnixListener::bind(path).unwrap();
        tokio::spawn(async move {
            let (mut stream, _) = listener.accept().await.unwrap();
            let mut head = Vec::new();
            let mut buf = [0u8; 1024];
            while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                let n = stream.read(&mut buf).await.unwrap();
                assert!(n > 0, "the client closed before sending its request");
                head.extend_from_slice(&buf[..n]);
            }
            stream.write_all(reply).await.unwrap();
            stream.shutdown().await.unwrap();
            String::from_utf8(head).unwrap()
        })
    }

    #[tokio::test]
    async fn requests_carry_the_version_prefix_and_host() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("docker.sock");
        let server = one_shot(
            &path,
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 15\r\n\r\n{\"Name\":\"/web\"}",
        )
        .await;
        let engine = Engine::new(path);
        let response = engine
            .request(Method::GET, "/containers/web/json", Duration::from_secs(5))
            .await
            .unwrap();
        assert_eq!(response.status, StatusCode::OK);
        let value = response.json(1024, Duration::from_secs(5)).await.unwrap();
        assert_eq!(value["Name"], "/web");
        let head = server.await.unwrap();
        assert!(
            head.starts_with("GET /v1.41/containers/web/json HTTP/1.1\r\n"),
            "{head}"
        );
        assert!(
            head.to_ascii_lowercase().contains("\r\nhost: docker\r\n"),
            "{head}"
        );
    }

    #[tokio::test]
    async fn bodies_over_the_cap_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("docker.sock");
        let _server = one_shot(
            &path,
            b"HTTP/1.1 200 OK\r\nContent-Length: 20\r\n\r\n01234567890123456789",
        )
        .await;
        let response = Engine::new(path)
            .request(Method::GET, "/info", Duration::from_secs(5))
            .await
            .unwrap();
        let err = response
            .bytes(10, Duration::from_secs(5))
            .await
            .unwrap_err();
        assert!(matches!(err, EngineError::TooLarge(10)), "{err:?}");
    }
}
