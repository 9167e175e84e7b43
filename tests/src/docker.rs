//! Test double: the Docker Engine API on a unix socket, served as real HTTP/1.1 by hyper.
//!
//! It holds a table of containers (name, ID, running, TTY, log entries) and answers what
//! `docker.logs` and `docker.action` use, with or without a `/v1.xx` prefix:
//! - `GET /containers/{name-or-id}/json` — the inspect (`Id`, `Name` "/web", `State`,
//!   `Config.Tty`), resolving like the engine: exact ID, then exact name, then a unique ID
//!   prefix;
//! - `GET /containers/{name-or-id}/logs` — `stdout`, `stderr`, `tail`, `since`,
//!   `timestamps`; the multiplexed framing for containers without a TTY, raw bytes for
//!   those with one, sent as a streaming chunked body whose chunk boundaries deliberately
//!   fall inside frame headers and payloads;
//! - `POST /containers/{name-or-id}/start|stop|restart` — 204, 304 (nothing to do) or 404,
//!   with `{"message": …}` bodies on errors, changing the container's state.
//!
//! Every request line is recorded. The server stops (and its socket goes) when the
//! [`FakeEngine`] is dropped.

use std::collections::{HashSet, VecDeque};
use std::convert::Infallible;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::{Body, Frame, Incoming};
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use serde_json::json;
use tokio::task::JoinHandle;

/// Stream types of the multiplexed framing.
pub const STDOUT: u8 = 1;
pub const STDERR: u8 = 2;

/// Sizes of the body chunks a log response is cut into, cycled over its first
/// [`SMALL_CHUNKS_UNTIL`] bytes: they fall inside 8-byte headers and short payloads. Past
/// that, chunks of [`LARGE_CHUNK`] bytes (an odd size, so boundaries keep moving) carry big
/// bodies along.
const CHUNK_SIZES: [usize; 8] = [3, 7, 1, 11, 5, 13, 2, 9];
const SMALL_CHUNKS_UNTIL: usize = 4096;
const LARGE_CHUNK: usize = 4093;

/// One log entry as the engine stores it: a stream, a time and the bytes written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogEntry {
    pub stream: u8,
    /// Unix seconds.
    pub time: i64,
    pub bytes: Vec<u8>,
}

/// One container of the table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Container {
    pub name: String,
    pub id: String,
    pub running: bool,
    pub tty: bool,
    pub logs: Vec<LogEntry>,
}

impl Container {
    /// A running container without a TTY and with no logs.
    pub fn new(name: &str, id: &str) -> Self {
        Container {
            name: name.into(),
            id: id.into(),
            running: true,
            tty: false,
            logs: Vec::new(),
        }
    }

    pub fn tty(mut self) -> Self {
        self.tty = true;
        self
    }

    pub fn stopped(mut self) -> Self {
        self.running = false;
        self
    }

    /// One more log entry (one frame for a container without a TTY).
    pub fn log(mut self, stream: u8, time: i64, bytes: impl AsRef<[u8]>) -> Self {
        self.logs.push(LogEntry {
            stream,
            time,
            bytes: bytes.as_ref().to_vec(),
        });
        self
    }
}

#[derive(Debug, Default)]
struct State {
    containers: Vec<Container>,
    requests: Vec<String>,
    /// Containers removed right after their next inspect is answered.
    vanish_after_inspect: HashSet<String>,
    /// Body chunks of each log response, in order.
    log_chunks: Vec<usize>,
}

/// The fake engine: a hyper server on `<dir>/docker.sock`.
pub struct FakeEngine {
    socket: PathBuf,
    state: Arc<Mutex<State>>,
    server: JoinHandle<()>,
}

impl FakeEngine {
    /// Serves on `<dir>/docker.sock` with an empty table. Call inside a tokio runtime.
    pub fn start(dir: &Path) -> FakeEngine {
        let socket = dir.join("docker.sock");
        let _ = std::fs::remove_file(&socket);
        let listener = tokio::net::UnixListener::bind(&socket)
            .unwrap_or_else(|e| panic!("bind {}: {e}", socket.display()));
        let state = Arc::new(Mutex::new(State::default()));
        let shared = Arc::clone(&state);
        let server = tokio::spawn(async move {
            // Dropping the set (when this task is aborted) aborts every connection.
            let mut connections = tokio::task::JoinSet::new();
            loop {
                let stream = match listener.accept().await {
                    Ok((stream, _)) => stream,
                    Err(_) => {
                        tokio::time::sleep(Duration::from_millis(10)).await;
                        continue;
                    }
                };
                let state = Arc::clone(&shared);
                connections.spawn(async move {
                    let service = service_fn(move |req: Request<Incoming>| {
                        let response = handle(&state, &req);
                        async move { Ok::<_, Infallible>(response) }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
                while connections.try_join_next().is_some() {}
            }
        });
        FakeEngine {
            socket,
            state,
            server,
        }
    }

    pub fn socket(&self) -> &Path {
        &self.socket
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Adds (or replaces, by name) a container.
    pub fn add(&self, container: Container) {
        let mut state = self.state();
        state.containers.retain(|c| c.name != container.name);
        state.containers.push(container);
    }

    pub fn remove(&self, name: &str) {
        self.state().containers.retain(|c| c.name != name);
    }

    /// The container named `name` disappears right after its next inspect is answered:
    /// the race between looking a container up and acting on it, made deterministic.
    pub fn vanish_after_inspect(&self, name: &str) {
        self.state().vanish_after_inspect.insert(name.into());
    }

    pub fn container(&self, name: &str) -> Option<Container> {
        self.state()
            .containers
            .iter()
            .find(|c| c.name == name)
            .cloned()
    }

    /// Every request line received so far: `METHOD /path?query`.
    pub fn requests(&self) -> Vec<String> {
        self.state().requests.clone()
    }

    /// How many body chunks each log response was sent in.
    pub fn log_chunks(&self) -> Vec<usize> {
        self.state().log_chunks.clone()
    }
}

impl Drop for FakeEngine {
    fn drop(&mut self) {
        self.server.abort();
        let _ = std::fs::remove_file(&self.socket);
    }
}

type Reply = Response<BoxBody<Bytes, Infallible>>;

fn handle(state: &Mutex<State>, req: &Request<Incoming>) -> Reply {
    let mut state = state.lock().unwrap_or_else(|e| e.into_inner());
    state
        .requests
        .push(format!("{} {}", req.method(), req.uri()));
    let path = strip_version(req.uri().path());
    let segments: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    let (target, op) = match segments.as_slice() {
        ["containers", target, op] => (*target, *op),
        _ => return error(StatusCode::NOT_FOUND, "page not found"),
    };
    let Some(index) = resolve(&state.containers, target) else {
        return error(
            StatusCode::NOT_FOUND,
            &format!("No such container: {target}"),
        );
    };
    let query = req.uri().query().unwrap_or_default();
    match (req.method(), op) {
        (&Method::GET, "json") => {
            let c = &state.containers[index];
            let body = json!({
                "Id": c.id,
                "Name": format!("/{}", c.name),
                "State": {"Running": c.running, "Status": if c.running { "running" } else { "exited" }},
                "Config": {"Tty": c.tty, "Image": "example/fake:latest"},
            });
            let name = c.name.clone();
            if state.vanish_after_inspect.remove(&name) {
                state.containers.remove(index);
            }
            json_reply(StatusCode::OK, &body)
        }
        (&Method::GET, "logs") => {
            let c = &state.containers[index];
            match log_body(c, query) {
                Ok(body) => {
                    let content_type = if c.tty {
                        "application/vnd.docker.raw-stream"
                    } else {
                        "application/vnd.docker.multiplexed-stream"
                    };
                    let chunks = split(body);
                    state.log_chunks.push(chunks.len());
                    reply(StatusCode::OK, content_type, Chunks(chunks).boxed())
                }
                Err(message) => error(StatusCode::BAD_REQUEST, &message),
            }
        }
        (&Method::POST, "start" | "stop" | "restart") => {
            let c = &mut state.containers[index];
            let changed = match op {
                "start" => !std::mem::replace(&mut c.running, true),
                "stop" => std::mem::replace(&mut c.running, false),
                _ => {
                    c.running = true;
                    true
                }
            };
            let status = if changed {
                StatusCode::NO_CONTENT
            } else {
                StatusCode::NOT_MODIFIED
            };
            reply(status, "text/plain", Full::new(Bytes::new()).boxed())
        }
        _ => error(StatusCode::NOT_FOUND, "page not found"),
    }
}

/// `/v1.41/containers/…` → `/containers/…`; paths without a version pass unchanged.
fn strip_version(path: &str) -> &str {
    if let Some(rest) = path.strip_prefix("/v")
        && let Some((version, tail)) = rest.split_once('/')
        && !version.is_empty()
        && version.chars().all(|c| c.is_ascii_digit() || c == '.')
    {
        return &path[path.len() - tail.len() - 1..];
    }
    path
}

/// The engine's lookup order: exact ID, exact name, then an unambiguous ID prefix.
fn resolve(containers: &[Container], target: &str) -> Option<usize> {
    if let Some(i) = containers.iter().position(|c| c.id == target) {
        return Some(i);
    }
    if let Some(i) = containers.iter().position(|c| c.name == target) {
        return Some(i);
    }
    let matches: Vec<usize> = containers
        .iter()
        .enumerate()
        .filter(|(_, c)| c.id.starts_with(target))
        .map(|(i, _)| i)
        .collect();
    match matches.as_slice() {
        [one] => Some(*one),
        _ => None,
    }
}

/// The engine's boolean query values: "", "0", "no", "false" and "none" are false.
fn truthy(value: &str) -> bool {
    !matches!(
        value.to_ascii_lowercase().as_str(),
        "" | "0" | "no" | "false" | "none"
    )
}

/// The log body for `query`: entries cut to `tail`, then to `since`, then to the chosen
/// streams; framed unless the container has a TTY.
fn log_body(c: &Container, query: &str) -> Result<Vec<u8>, String> {
    let (mut stdout, mut stderr, mut timestamps) = (false, false, false);
    let (mut tail, mut since) = (None, f64::MIN);
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        match key {
            "stdout" => stdout = truthy(value),
            "stderr" => stderr = truthy(value),
            "timestamps" => timestamps = truthy(value),
            "tail" => tail = value.parse::<usize>().ok(),
            "since" => {
                since = value
                    .parse::<f64>()
                    .map_err(|e| format!("bad since {value:?}: {e}"))?
            }
            _ => {}
        }
    }
    if !stdout && !stderr {
        return Err("Bad parameters: you must choose at least one stream".into());
    }
    let skip = tail.map_or(0, |n| c.logs.len().saturating_sub(n));
    let mut body = Vec::new();
    for entry in &c.logs[skip..] {
        if (entry.time as f64) < since {
            continue;
        }
        let wanted = if entry.stream == STDERR {
            stderr
        } else {
            stdout
        };
        if !wanted {
            continue;
        }
        let mut payload = Vec::new();
        if timestamps {
            payload.extend_from_slice(rfc3339(entry.time).as_bytes());
            payload.push(b' ');
        }
        payload.extend_from_slice(&entry.bytes);
        if !c.tty {
            body.extend_from_slice(&[entry.stream, 0, 0, 0]);
            let len = u32::try_from(payload.len()).expect("a log entry under 4 GiB");
            body.extend_from_slice(&len.to_be_bytes());
        }
        body.extend_from_slice(&payload);
    }
    Ok(body)
}

/// Cuts `body` into chunks: [`CHUNK_SIZES`] cycled at first, then [`LARGE_CHUNK`]s.
fn split(body: Vec<u8>) -> VecDeque<Bytes> {
    let body = Bytes::from(body);
    let mut chunks = VecDeque::new();
    let mut at = 0;
    let mut small = CHUNK_SIZES.iter().cycle();
    while at < body.len() {
        let size = match small.next() {
            Some(&size) if at < SMALL_CHUNKS_UNTIL => size,
            _ => LARGE_CHUNK,
        };
        let end = (at + size).min(body.len());
        chunks.push_back(body.slice(at..end));
        at = end;
    }
    chunks
}

/// A streaming body: one HTTP chunk per element, length unknown (chunked encoding).
struct Chunks(VecDeque<Bytes>);

impl Body for Chunks {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        Poll::Ready(self.get_mut().0.pop_front().map(|b| Ok(Frame::data(b))))
    }
}

fn reply(status: StatusCode, content_type: &str, body: BoxBody<Bytes, Infallible>) -> Reply {
    let mut response = Response::new(body);
    *response.status_mut() = status;
    let headers = response.headers_mut();
    headers.insert("Api-Version", http::HeaderValue::from_static("1.41"));
    headers.insert(
        "Server",
        http::HeaderValue::from_static("Docker/fake-engine"),
    );
    if let Ok(value) = http::HeaderValue::from_str(content_type) {
        headers.insert(http::header::CONTENT_TYPE, value);
    }
    response
}

fn json_reply(status: StatusCode, value: &serde_json::Value) -> Reply {
    reply(
        status,
        "application/json",
        Full::new(Bytes::from(value.to_string())).boxed(),
    )
}

fn error(status: StatusCode, message: &str) -> Reply {
    json_reply(status, &json!({"message": message}))
}

/// Unix seconds as the engine prints log timestamps (RFC 3339, nanoseconds, UTC).
pub fn rfc3339(secs: i64) -> String {
    let days = secs.div_euclid(86_400);
    let rem = secs.rem_euclid(86_400);
    // Civil date from days since 1970-01-01 (H. Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.000000000Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps_are_rfc3339() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00.000000000Z");
        assert_eq!(rfc3339(1_700_000_000), "2023-11-14T22:13:20.000000000Z");
        assert_eq!(rfc3339(951_782_400), "2000-02-29T00:00:00.000000000Z");
    }

    #[test]
    fn versions_are_optional_in_paths() {
        assert_eq!(
            strip_version("/v1.41/containers/web/json"),
            "/containers/web/json"
        );
        assert_eq!(
            strip_version("/containers/web/json"),
            "/containers/web/json"
        );
        assert_eq!(strip_version("/version"), "/version");
    }

    #[test]
    fn lookups_follow_the_engine_order() {
        let table = vec![
            Container::new("web", "aaa111"),
            Container::new("aaa", "bbb222"),
            Container::new("db", "bbb333"),
        ];
        assert_eq!(resolve(&table, "web"), Some(0));
        assert_eq!(resolve(&table, "bbb222"), Some(1), "exact ID");
        assert_eq!(
            resolve(&table, "aaa"),
            Some(1),
            "a name before an ID prefix"
        );
        assert_eq!(resolve(&table, "aaa1"), Some(0), "a unique ID prefix");
        assert_eq!(resolve(&table, "bbb"), None, "an ambiguous prefix");
    }

    #[test]
    fn log_bodies_are_framed_filtered_and_split() {
        let c = Container::new("web", "1")
            .log(STDOUT, 10, b"out one\n")
            .log(STDERR, 20, b"err one\n")
            .log(STDOUT, 30, b"out two\n");
        let body = log_body(&c, "stdout=1&stderr=1").unwrap();
        let mut expected = vec![1, 0, 0, 0, 0, 0, 0, 8];
        expected.extend_from_slice(b"out one\n");
        expected.extend_from_slice(&[2, 0, 0, 0, 0, 0, 0, 8]);
        expected.extend_from_slice(b"err one\n");
        expected.extend_from_slice(&[1, 0, 0, 0, 0, 0, 0, 8]);
        expected.extend_from_slice(b"out two\n");
        assert_eq!(body, expected);

        let chunks = split(body.clone());
        assert!(chunks.len() > 3, "{chunks:?}");
        assert_eq!(
            chunks.front().map(Bytes::len),
            Some(3),
            "the first header is split"
        );
        assert_eq!(chunks.iter().flatten().copied().collect::<Vec<u8>>(), body);

        assert_eq!(
            log_body(&c, "stdout=true&stderr=false&tail=1").unwrap()[8..],
            *b"out two\n"
        );
        assert_eq!(
            log_body(&c, "stderr=true&since=15").unwrap()[8..],
            *b"err one\n"
        );
        assert!(log_body(&c, "stdout=0").is_err());
        let raw = log_body(&c.clone().tty(), "stdout=1&stderr=1&timestamps=1").unwrap();
        assert!(raw.starts_with(b"1970-01-01T00:00:10.000000000Z out one\n"));
    }
}
