//! The two baselines, each run as a child process of the harness (as robota-mcpd is), so
//! every server under test is a separate process with its own multi-threaded runtime:
//!
//! - `serve-hello`: plain hyper 1.x HTTP/1.1, reads the body, answers a fixed JSON-RPC
//!   result — the ceiling for any HTTP server on this machine;
//! - `serve-rmcp`: rmcp's stateless Streamable HTTP service, configured as the daemon
//!   configures it, with the daemon's own tool list and a `system.info` that does the
//!   daemon tool's work — the ceiling for the SDK. No admission, no policy, no metrics.
//!
//! A child prints `listening <addr>` once bound and exits when its stdin closes.

use std::borrow::Cow;
use std::convert::Infallible;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, ChildStdin, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ErrorData, Implementation,
    ListToolsResult, PaginatedRequestParams, ProtocolVersion, ServerCapabilities, ServerConfig,
    Tool,
};
use rmcp::service::RequestContext;
use rmcp::transport::streamable_http_server::session::never::NeverSessionManager;
use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};
use rmcp::{RoleServer, ServerHandler};
use robota_e2e::cgroup::{Cgroup, Hierarchies};
use serde_json::Value;
use tokio::net::TcpListener;

/// The hello server's answer: shaped like a JSON-RPC result so that the generator's check
/// is the same for every server.
const HELLO: &[u8] = br#"{"jsonrpc":"2.0","id":1,"result":{"hello":"world"}}"#;

/// `robota-bench serve-hello`.
pub fn serve_hello() -> std::io::Result<()> {
    run_child(|listener| async move {
        let service = service_fn(|req: Request<Incoming>| async move {
            // Read the request as a real server would.
            let _ = req.into_body().collect().await;
            let mut response = Response::new(Full::new(Bytes::from_static(HELLO)));
            response.headers_mut().insert(
                http::header::CONTENT_TYPE,
                http::HeaderValue::from_static("application/json"),
            );
            Ok::<_, Infallible>(response)
        });
        accept_loop(listener, service).await
    })
}

/// `robota-bench serve-rmcp --tools FILE`: FILE holds the daemon's `tools/list` result
/// (`{"tools": [...]}`).
pub fn serve_rmcp(tools_file: &Path) -> std::io::Result<()> {
    let text = std::fs::read_to_string(tools_file)?;
    let list: ListToolsResult = serde_json::from_str(&text).map_err(std::io::Error::other)?;
    let handler = Stock {
        tools: Arc::new(list.tools),
    };
    run_child(|listener| async move {
        // As daemon/src/carrier/endpoint.rs configures rmcp, minus our admission: the
        // default allowed hosts (loopback names) and no Origin enforcement.
        let config = StreamableHttpServerConfig::default()
            .with_legacy_session_mode(false)
            .with_json_response(true)
            .with_sse_keep_alive(None);
        let service = Arc::new(StreamableHttpService::new(
            move || Ok(handler.clone()),
            Arc::new(NeverSessionManager::default()),
            config,
        ));
        let service = service_fn(move |req: Request<Incoming>| {
            let service = service.clone();
            async move { Ok::<_, Infallible>(service.handle(req).await) }
        });
        accept_loop(listener, service).await
    })
}

/// Binds `127.0.0.1:0`, prints the address, serves until stdin closes.
fn run_child<F, Fut>(serve: F) -> std::io::Result<()>
where
    F: FnOnce(TcpListener) -> Fut,
    Fut: Future<Output = std::io::Result<()>>,
{
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        {
            use std::io::Write;
            let mut out = std::io::stdout().lock();
            writeln!(out, "listening {addr}")?;
            out.flush()?;
        }
        let stdin_closed = async {
            use tokio::io::AsyncReadExt;
            let mut stdin = tokio::io::stdin();
            let mut buf = [0u8; 64];
            while stdin.read(&mut buf).await.is_ok_and(|n| n > 0) {}
        };
        tokio::select! {
            served = serve(listener) => served,
            () = stdin_closed => Ok(()),
        }
    })
}

async fn accept_loop<S, B>(listener: TcpListener, service: S) -> std::io::Result<()>
where
    S: hyper::service::Service<Request<Incoming>, Response = Response<B>, Error = Infallible>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    B: hyper::body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    loop {
        let (stream, _) = listener.accept().await?;
        let _ = stream.set_nodelay(true);
        let service = service.clone();
        tokio::spawn(async move {
            let _ = http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

/// The stock rmcp handler: the same tools as the daemon advertises, `system.info` doing
/// the daemon tool's work; nothing else.
#[derive(Clone)]
struct Stock {
    tools: Arc<Vec<Tool>>,
}

const VERSIONS: [ProtocolVersion; 2] =
    [ProtocolVersion::V_2025_11_25, ProtocolVersion::V_2026_07_28];

impl ServerHandler for Stock {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
            .with_server_info(Implementation::new("stock-rmcp", env!("CARGO_PKG_VERSION")))
    }

    fn supported_protocol_versions(&self) -> Cow<'static, [ProtocolVersion]> {
        Cow::Borrowed(&VERSIONS)
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        Ok(ListToolsResult::with_all_items(self.tools.as_ref().clone()))
    }

    fn get_tool(&self, name: &str) -> Option<Tool> {
        self.tools.iter().find(|t| t.name == name).cloned()
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        _context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        if request.name != "system.info" {
            return Err(ErrorData::invalid_params("only system.info here", None));
        }
        Ok(CallToolResult::structured(host_info()).into())
    }
}

/// The daemon's own `system.info` body: the same syscalls and files.
fn host_info() -> Value {
    robota_mcpd::tools::host_info().unwrap_or_default()
}

/// A baseline server running as a child process of the harness.
pub struct ChildServer {
    pub addr: SocketAddr,
    child: Child,
    stdin: Option<ChildStdin>,
    _cgroup: Cgroup,
}

impl ChildServer {
    /// Runs this executable with `args` (and `env` added) and waits (bounded) for its
    /// address.
    pub fn spawn(name: &'static str, args: &[&str], env: &[(String, String)]) -> ChildServer {
        let exe = std::env::current_exe().unwrap_or_else(|e| panic!("current_exe: {e}"));
        // In a cgroup of its own, as the daemon it is measured against runs (whose memory
        // controller then accounts its kernel allocations too).
        let cgroup = Cgroup::create(
            &format!(
                "robota-bench-{}-{}",
                name.replace(|c: char| !c.is_ascii_alphanumeric(), "-"),
                std::process::id()
            ),
            Hierarchies::Daemon,
        );
        let mut child = cgroup
            .command(&exe)
            .args(args)
            .envs(env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap_or_else(|e| panic!("spawn the {name} server: {e}"));
        let stdin = child.stdin.take();
        let stdout = child
            .stdout
            .take()
            .unwrap_or_else(|| panic!("{name}: no stdout pipe"));
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            let _ = BufReader::new(stdout).read_line(&mut line);
            let _ = tx.send(line);
        });
        let line = rx
            .recv_timeout(Duration::from_secs(10))
            .unwrap_or_else(|e| panic!("the {name} server did not report its address: {e}"));
        let addr = line
            .trim()
            .strip_prefix("listening ")
            .and_then(|a| a.parse().ok())
            .unwrap_or_else(|| panic!("the {name} server printed {line:?}"));
        ChildServer {
            addr,
            child,
            stdin,
            _cgroup: cgroup,
        }
    }

    pub fn pid(&self) -> i32 {
        i32::try_from(self.child.id()).unwrap_or(i32::MAX)
    }
}

impl Drop for ChildServer {
    fn drop(&mut self) {
        // Closing stdin asks the child to exit; kill it if it does not within 5 s.
        drop(self.stdin.take());
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
