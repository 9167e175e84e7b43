//! Raw HTTP/1.1 over `tokio::net::TcpStream`: the tests write request bytes themselves
//! (odd Host values, absolute-form targets, missing headers, partial bodies) and read the
//! status line and headers back. Plus JSON-RPC message builders for MCP requests.

use std::io;
use std::net::SocketAddr;
use std::time::Duration;

use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Bound on one request/response exchange.
pub const EXCHANGE_LIMIT: Duration = Duration::from_secs(15);

/// A parsed HTTP response.
#[derive(Debug, Clone)]
pub struct Response {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Response {
    /// The first value of header `name` (case-insensitive).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    pub fn content_length(&self) -> Option<u64> {
        self.header("content-length")
            .and_then(|v| v.trim().parse().ok())
    }

    pub fn is_sse(&self) -> bool {
        self.header("content-type")
            .is_some_and(|v| v.trim_start().starts_with("text/event-stream"))
    }

    pub fn body_text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// Every JSON-RPC message in the body: a JSON body, or the `data:` of each SSE event.
    pub fn messages(&self) -> Vec<Value> {
        messages_of(self.is_sse(), &self.body)
    }

    /// The JSON-RPC response with `id`, if the body holds one.
    pub fn rpc(&self, id: i64) -> Option<Value> {
        self.messages()
            .into_iter()
            .find(|m| m.get("id") == Some(&json!(id)))
    }

    /// The JSON-RPC response with `id`; panics with the whole response otherwise.
    pub fn expect_rpc(&self, id: i64) -> Value {
        self.rpc(id)
            .unwrap_or_else(|| panic!("no JSON-RPC response with id {id} in {}", self.describe()))
    }

    /// Short human description for assertion messages.
    pub fn describe(&self) -> String {
        let body = self.body_text();
        let body: String = body.chars().take(2000).collect();
        format!(
            "HTTP {} headers {:?} body {:?}",
            self.status, self.headers, body
        )
    }

    /// Asserts the status and an empty body announced by `content-length: 0`.
    pub fn assert_empty_refusal(&self, status: u16, case: &str) {
        assert_eq!(self.status, status, "{case}: {}", self.describe());
        assert_eq!(
            self.content_length(),
            Some(0),
            "{case}: refusal must carry content-length: 0: {}",
            self.describe()
        );
        assert!(self.body.is_empty(), "{case}: refusal body must be empty");
    }
}

/// Parses JSON-RPC messages from a body (plain JSON or SSE).
pub fn messages_of(sse: bool, body: &[u8]) -> Vec<Value> {
    let text = String::from_utf8_lossy(body);
    if !sse {
        return match serde_json::from_str::<Value>(&text) {
            Ok(Value::Array(a)) => a,
            Ok(v) => vec![v],
            Err(_) => Vec::new(),
        };
    }
    let mut out = Vec::new();
    let text = text.replace("\r\n", "\n");
    for event in text.split("\n\n") {
        let data: Vec<&str> = event
            .lines()
            .filter_map(|l| l.strip_prefix("data:"))
            .map(|d| d.strip_prefix(' ').unwrap_or(d))
            .collect();
        if data.is_empty() {
            continue;
        }
        if let Ok(v) = serde_json::from_str::<Value>(&data.join("\n")) {
            out.push(v);
        }
    }
    out
}

/// A request written byte by byte as the test wants it.
#[derive(Debug, Clone)]
pub struct Request {
    pub method: String,
    pub target: String,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
    /// Add `Content-Length` from the body when no length header is set.
    pub auto_length: bool,
}

impl Request {
    pub fn new(method: &str, target: &str) -> Request {
        Request {
            method: method.into(),
            target: target.into(),
            headers: Vec::new(),
            body: Vec::new(),
            auto_length: true,
        }
    }

    /// `POST /mcp` as a well-behaved MCP 2025-11-25 client sends it to `127.0.0.1:<port>`.
    pub fn mcp(port: u16, bearer: Option<&str>, message: &Value) -> Request {
        let mut r = Request::new("POST", "/mcp")
            .header("Host", &format!("127.0.0.1:{port}"))
            .header("Content-Type", "application/json")
            .header("Accept", "application/json, text/event-stream")
            .header("MCP-Protocol-Version", crate::V_2025_11_25)
            .header("Connection", "close")
            .body(serde_json::to_vec(message).expect("json"));
        if let Some(b) = bearer {
            r = r.header("Authorization", &format!("Bearer {b}"));
        }
        r
    }

    /// Appends a header.
    pub fn header(mut self, name: &str, value: &str) -> Request {
        self.headers.push((name.into(), value.into()));
        self
    }

    /// Replaces every header `name` by one with `value`.
    pub fn set_header(self, name: &str, value: &str) -> Request {
        self.without(name).header(name, value)
    }

    /// Removes every header `name`.
    pub fn without(mut self, name: &str) -> Request {
        self.headers.retain(|(k, _)| !k.eq_ignore_ascii_case(name));
        self
    }

    pub fn target(mut self, target: &str) -> Request {
        self.target = target.into();
        self
    }

    pub fn method(mut self, method: &str) -> Request {
        self.method = method.into();
        self
    }

    pub fn body(mut self, body: Vec<u8>) -> Request {
        self.body = body;
        self
    }

    pub fn no_auto_length(mut self) -> Request {
        self.auto_length = false;
        self
    }

    fn has(&self, name: &str) -> bool {
        self.headers
            .iter()
            .any(|(k, _)| k.eq_ignore_ascii_case(name))
    }

    /// The request line and headers, ending with the blank line.
    pub fn head_bytes(&self) -> Vec<u8> {
        let mut s = format!("{} {} HTTP/1.1\r\n", self.method, self.target);
        for (k, v) in &self.headers {
            s.push_str(&format!("{k}: {v}\r\n"));
        }
        if self.auto_length
            && !self.has("content-length")
            && !self.has("transfer-encoding")
            && (!self.body.is_empty() || self.method == "POST")
        {
            s.push_str(&format!("Content-Length: {}\r\n", self.body.len()));
        }
        s.push_str("\r\n");
        s.into_bytes()
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        let mut b = self.head_bytes();
        b.extend_from_slice(&self.body);
        b
    }
}

/// One client connection with a read buffer.
pub struct Conn {
    stream: TcpStream,
    buf: Vec<u8>,
}

impl Conn {
    pub async fn connect(addr: SocketAddr) -> io::Result<Conn> {
        Conn::over(TcpStream::connect(addr).await?)
    }

    fn over(stream: TcpStream) -> io::Result<Conn> {
        stream.set_nodelay(true)?;
        Ok(Conn {
            stream,
            buf: Vec::new(),
        })
    }

    /// A connection from the loopback address `from` (127.0.0.0/8 holds many: one client
    /// address per test client).
    pub async fn connect_from(from: std::net::IpAddr, addr: SocketAddr) -> io::Result<Conn> {
        let socket = tokio::net::TcpSocket::new_v4()?;
        socket.bind(SocketAddr::new(from, 0))?;
        Conn::over(socket.connect(addr).await?)
    }

    /// A connection whose receive buffer is `bytes` (the kernel's least if smaller): a
    /// peer that does not read fills it fast.
    pub async fn connect_small_window(addr: SocketAddr, bytes: u32) -> io::Result<Conn> {
        let socket = tokio::net::TcpSocket::new_v4()?;
        socket.set_recv_buffer_size(bytes)?;
        Conn::over(socket.connect(addr).await?)
    }

    pub async fn write(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.stream.write_all(bytes).await?;
        self.stream.flush().await
    }

    /// Half-closes the write side.
    pub async fn shutdown_write(&mut self) -> io::Result<()> {
        self.stream.shutdown().await
    }

    async fn fill(&mut self) -> io::Result<usize> {
        let mut chunk = [0u8; 16 * 1024];
        let n = self.stream.read(&mut chunk).await?;
        self.buf.extend_from_slice(&chunk[..n]);
        Ok(n)
    }

    /// Reads until the connection is closed by the peer (or reset); returns what arrived.
    pub async fn read_to_close(&mut self) -> Vec<u8> {
        loop {
            match self.fill().await {
                Ok(0) | Err(_) => return std::mem::take(&mut self.buf),
                Ok(_) => {}
            }
        }
    }

    /// [`Self::read_to_close`] at a steady pace: about `bytes` every `every`.
    pub async fn read_to_close_slowly(&mut self, bytes: usize, every: Duration) -> Vec<u8> {
        let mut tick = tokio::time::interval(every);
        loop {
            tick.tick().await;
            let mut took = 0;
            while took < bytes {
                match self.fill().await {
                    Ok(0) | Err(_) => return std::mem::take(&mut self.buf),
                    Ok(n) => took += n,
                }
            }
        }
    }

    /// Reads a response head (skipping 1xx interim responses); the body is left unread.
    pub async fn read_head(&mut self) -> io::Result<Response> {
        loop {
            let (status, headers, used) = loop {
                let mut hs = [httparse::EMPTY_HEADER; 128];
                let mut resp = httparse::Response::new(&mut hs);
                match resp.parse(&self.buf) {
                    Ok(httparse::Status::Complete(used)) => {
                        let headers = resp
                            .headers
                            .iter()
                            .map(|h| {
                                (
                                    h.name.to_owned(),
                                    String::from_utf8_lossy(h.value).into_owned(),
                                )
                            })
                            .collect::<Vec<_>>();
                        break (resp.code.unwrap_or(0), headers, used);
                    }
                    Ok(httparse::Status::Partial) => {
                        if self.fill().await? == 0 {
                            return Err(io::Error::new(
                                io::ErrorKind::UnexpectedEof,
                                format!(
                                    "connection closed before a complete response head ({} bytes: {:?})",
                                    self.buf.len(),
                                    String::from_utf8_lossy(&self.buf)
                                ),
                            ));
                        }
                    }
                    Err(e) => {
                        return Err(io::Error::new(
                            io::ErrorKind::InvalidData,
                            format!(
                                "bad response head: {e}: {:?}",
                                String::from_utf8_lossy(&self.buf)
                            ),
                        ));
                    }
                }
            };
            self.buf.drain(..used);
            if (100..200).contains(&status) && status != 101 {
                continue;
            }
            return Ok(Response {
                status,
                headers,
                body: Vec::new(),
            });
        }
    }

    async fn read_exact_buf(&mut self, n: usize) -> io::Result<Vec<u8>> {
        while self.buf.len() < n {
            if self.fill().await? == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "connection closed inside a body",
                ));
            }
        }
        Ok(self.buf.drain(..n).collect())
    }

    async fn read_line(&mut self) -> io::Result<String> {
        loop {
            if let Some(i) = self.buf.windows(2).position(|w| w == b"\r\n") {
                let line: Vec<u8> = self.buf.drain(..i + 2).collect();
                return Ok(String::from_utf8_lossy(&line[..i]).into_owned());
            }
            if self.fill().await? == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "connection closed inside a chunked body",
                ));
            }
        }
    }

    /// Reads the body of `resp` (content-length, chunked, or to close).
    pub async fn read_body(&mut self, resp: &mut Response) -> io::Result<()> {
        if resp.status == 204 || resp.status == 304 {
            return Ok(());
        }
        let chunked = resp
            .header("transfer-encoding")
            .is_some_and(|v| v.to_ascii_lowercase().contains("chunked"));
        if chunked {
            loop {
                let line = self.read_line().await?;
                let size_text = line.split(';').next().unwrap_or("").trim();
                let size = usize::from_str_radix(size_text, 16).map_err(|e| {
                    io::Error::new(
                        io::ErrorKind::InvalidData,
                        format!("chunk size {line:?}: {e}"),
                    )
                })?;
                if size == 0 {
                    while !self.read_line().await?.is_empty() {}
                    return Ok(());
                }
                let data = self.read_exact_buf(size).await?;
                resp.body.extend_from_slice(&data);
                self.read_line().await?;
            }
        } else if let Some(n) = resp.content_length() {
            let n = usize::try_from(n).expect("content-length fits usize");
            resp.body = self.read_exact_buf(n).await?;
            Ok(())
        } else {
            resp.body = self.read_to_close().await;
            Ok(())
        }
    }

    pub async fn read_response(&mut self) -> io::Result<Response> {
        let mut resp = self.read_head().await?;
        self.read_body(&mut resp).await?;
        Ok(resp)
    }
}

/// Sends `req` on a new connection and reads the whole response (bounded).
pub async fn try_exchange(addr: SocketAddr, req: &Request) -> io::Result<Response> {
    exchange_on(Conn::connect(addr), req).await
}

/// [`try_exchange`] on a connection from the loopback address `from`.
pub async fn try_exchange_from(
    from: std::net::IpAddr,
    addr: SocketAddr,
    req: &Request,
) -> io::Result<Response> {
    exchange_on(Conn::connect_from(from, addr), req).await
}

/// [`try_exchange_from`] on a thread and runtime of its own, as from another machine: a
/// client measured under a flood this test's own tasks send. Sharing their runtime, it
/// would wait behind them between its handshake and its request — tens of milliseconds
/// under load, silent, which is what a full listener closes first.
pub async fn try_exchange_apart(
    from: std::net::IpAddr,
    addr: SocketAddr,
    req: &Request,
) -> io::Result<Response> {
    let req = req.clone();
    tokio::task::spawn_blocking(move || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?
            .block_on(try_exchange_from(from, addr, &req))
    })
    .await
    .map_err(io::Error::other)?
}

/// `req` on the connection `connect` makes, and the whole response, within
/// [`EXCHANGE_LIMIT`].
async fn exchange_on(
    connect: impl Future<Output = io::Result<Conn>>,
    req: &Request,
) -> io::Result<Response> {
    let fut = async {
        let mut c = connect.await?;
        c.write(&req.to_bytes()).await?;
        c.read_response().await
    };
    match tokio::time::timeout(EXCHANGE_LIMIT, fut).await {
        Ok(r) => r,
        Err(_) => Err(io::Error::new(
            io::ErrorKind::TimedOut,
            format!("no complete response within {EXCHANGE_LIMIT:?}"),
        )),
    }
}

/// [`try_exchange`], panicking on I/O errors and timeouts.
pub async fn exchange(addr: SocketAddr, req: &Request) -> Response {
    try_exchange(addr, req).await.unwrap_or_else(|e| {
        panic!(
            "{} {} (Host {:?}): {e}",
            req.method,
            req.target,
            req.headers
                .iter()
                .find(|(k, _)| k.eq_ignore_ascii_case("host"))
                .map(|(_, v)| v)
        )
    })
}

/// JSON-RPC `tools/list`.
pub fn tools_list(id: i64) -> Value {
    json!({"jsonrpc": "2.0", "id": id, "method": "tools/list", "params": {}})
}

/// JSON-RPC `tools/call`.
pub fn tools_call(id: i64, name: &str, arguments: Value) -> Value {
    json!({
        "jsonrpc": "2.0",
        "id": id,
        "method": "tools/call",
        "params": {"name": name, "arguments": arguments}
    })
}

/// JSON-RPC `notifications/cancelled` for `request_id`.
pub fn cancelled(request_id: i64) -> Value {
    json!({
        "jsonrpc": "2.0",
        "method": "notifications/cancelled",
        "params": {"requestId": request_id, "reason": "e2e test"}
    })
}

/// The closed-set `code` of a visible tool error in a JSON-RPC `tools/call` response, or
/// `None` when the call succeeded. Panics when the message is not a tool result at all.
pub fn tool_error_code(rpc_response: &Value) -> Option<String> {
    let result = rpc_response.get("result").unwrap_or_else(|| {
        panic!("expected a CallToolResult, got JSON-RPC message {rpc_response}")
    });
    if result.get("isError") != Some(&Value::Bool(true)) {
        return None;
    }
    let code = result
        .pointer("/structuredContent/code")
        .and_then(Value::as_str)
        .unwrap_or_else(|| panic!("tool error without structuredContent.code: {result}"));
    let message = result.pointer("/structuredContent/message");
    assert!(
        message.is_some_and(Value::is_string),
        "tool error without a string structuredContent.message: {result}"
    );
    Some(code.to_owned())
}

/// The `name`s of a JSON-RPC `tools/list` response.
pub fn tool_names(rpc_response: &Value) -> Vec<String> {
    rpc_response
        .pointer("/result/tools")
        .and_then(Value::as_array)
        .unwrap_or_else(|| panic!("not a tools/list result: {rpc_response}"))
        .iter()
        .map(|t| t["name"].as_str().expect("tool name").to_owned())
        .collect()
}

/// One HTTP/2 request with prior knowledge (h2c) on a fresh connection to `addr`, with
/// `:authority` taken from `authority` (bounded).
pub async fn h2_exchange(
    addr: SocketAddr,
    authority: &str,
    bearer: Option<&str>,
    message: &Value,
) -> Result<Response, String> {
    use http_body_util::{BodyExt, Full};
    use hyper_util::rt::{TokioExecutor, TokioIo};

    let fut = async {
        let tcp = TcpStream::connect(addr).await.map_err(|e| e.to_string())?;
        let (mut send, conn) =
            hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tcp))
                .await
                .map_err(|e| format!("h2 handshake: {e}"))?;
        let driver = tokio::spawn(conn);
        let mut req = http::Request::builder()
            .method("POST")
            .uri(format!("http://{authority}/mcp"))
            .header("content-type", "application/json")
            .header("accept", "application/json, text/event-stream")
            .header("mcp-protocol-version", crate::V_2025_11_25);
        if let Some(b) = bearer {
            req = req.header("authorization", format!("Bearer {b}"));
        }
        let body = serde_json::to_vec(message).expect("json");
        let req = req
            .body(Full::new(bytes::Bytes::from(body)))
            .map_err(|e| e.to_string())?;
        let resp = send
            .send_request(req)
            .await
            .map_err(|e| format!("h2 request: {e}"))?;
        let status = resp.status().as_u16();
        let headers = resp
            .headers()
            .iter()
            .map(|(k, v)| {
                (
                    k.as_str().to_owned(),
                    String::from_utf8_lossy(v.as_bytes()).into_owned(),
                )
            })
            .collect();
        let body = resp
            .into_body()
            .collect()
            .await
            .map_err(|e| format!("h2 body: {e}"))?
            .to_bytes()
            .to_vec();
        driver.abort();
        Ok(Response {
            status,
            headers,
            body,
        })
    };
    match tokio::time::timeout(EXCHANGE_LIMIT, fut).await {
        Ok(r) => r,
        Err(_) => Err(format!("no h2 response within {EXCHANGE_LIMIT:?}")),
    }
}
