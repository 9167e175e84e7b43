//! `robota-e2e-upstream`: downstream MCP servers for the end-to-end tests and the bench.
//!
//! - `rmcp-stdio` and `rmcp-http [--unix PATH]`: an rmcp server (rmcp's own server code,
//!   stdio and stateless Streamable HTTP) with a few plain tools;
//! - `rogue [--slow-start SECS] [--events FILE] [--linger]`: a misbehaving double speaking
//!   newline-delimited JSON-RPC by hand — it crashes mid-call, hangs, writes garbage,
//!   floods stdout, answers too much, changes its tool list, leaves grandchildren behind
//!   (one in a session of its own), has a grandchild take memory and threads (`hog`: `mib`
//!   MiB, up to `threads` threads),
//!   answers and lists tools built to take far more memory parsed than as text.
//!
//! HTTP servers print `listening <addr>` once bound and exit when stdin closes. Events a
//! test looks for (a cancellation that reached the server) are appended to `--events`.

#![forbid(unsafe_code)]

use std::borrow::Cow;
use std::convert::Infallible;
use std::io::{BufRead, Write};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use hyper::Request;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock, ErrorData,
    Implementation, ListToolsResult, PaginatedRequestParams, ProtocolVersion, ServerCapabilities,
    ServerConfig, Tool,
};
use rmcp::service::RequestContext;
use rmcp::transport::streamable_http_server::session::never::NeverSessionManager;
use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};
use rmcp::{RoleServer, ServerHandler, ServiceExt};
use serde_json::{Value, json};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let flag = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let events = flag("--events").map(PathBuf::from);
    let result = match args.first().map(String::as_str) {
        Some("rmcp-stdio") => rmcp_stdio(events),
        Some("rmcp-http") => rmcp_http(events, flag("--unix").map(PathBuf::from)),
        Some("hog") => {
            // Takes (and touches) that many MiB, starts up to that many threads (saying
            // how many it could), then ends.
            let mib: usize = args.get(1).and_then(|n| n.parse().ok()).unwrap_or(0);
            let threads: usize = args.get(2).and_then(|n| n.parse().ok()).unwrap_or(0);
            let held: Vec<Vec<u8>> = (0..mib)
                .map(|i| vec![(i % 251) as u8 + 1; 1 << 20])
                .collect();
            std::hint::black_box(&held);
            let started = (0..threads)
                .map_while(|_| {
                    std::thread::Builder::new()
                        .stack_size(64 << 10)
                        .spawn(|| std::thread::sleep(Duration::from_secs(3)))
                        .ok()
                })
                .count();
            let _ = writeln!(std::io::stdout(), "{started}");
            std::process::exit(0)
        }
        Some("rogue") => {
            rogue(events, flag("--slow-start").and_then(|s| s.parse().ok()));
            if args.iter().any(|a| a == "--linger") {
                // Stays after its stdin closed: only a signal ends it.
                std::thread::sleep(Duration::from_secs(300));
            }
            Ok(())
        }
        _ => {
            eprintln!(
                "usage: robota-e2e-upstream rmcp-stdio | rmcp-http [--unix PATH] | rogue [--slow-start SECS] [--events FILE] [--linger]"
            );
            std::process::exit(2);
        }
    };
    if let Err(e) = result {
        eprintln!("robota-e2e-upstream: {e}");
        std::process::exit(1);
    }
}

fn record(events: &Option<PathBuf>, line: &str) {
    if let Some(path) = events
        && let Ok(mut file) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
    {
        let _ = writeln!(file, "{line}");
    }
}

// ----- the rmcp server -----

#[derive(Clone)]
struct Fixture {
    events: Arc<Option<PathBuf>>,
}

const VERSIONS: [ProtocolVersion; 2] =
    [ProtocolVersion::V_2025_11_25, ProtocolVersion::V_2026_07_28];

fn tool(name: &'static str, description: &'static str, schema: Value) -> Tool {
    let Value::Object(schema) = schema else {
        unreachable!("schemas are objects")
    };
    Tool::new(name, description, Arc::new(schema))
}

fn fixture_tools() -> Vec<Tool> {
    vec![
        tool(
            "echo",
            "Echo the text back.",
            json!({"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}),
        ),
        tool(
            "add",
            "Add two integers.",
            json!({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}),
        ),
        tool(
            "sleep",
            "Sleep for ms milliseconds, or until cancelled.",
            json!({"type": "object", "properties": {"ms": {"type": "integer"}}, "required": ["ms"]}),
        ),
        tool(
            "pid",
            "The server's process id.",
            json!({"type": "object", "properties": {}}),
        ),
        tool(
            "ping",
            "Answer pong.",
            json!({"type": "object", "properties": {}}),
        ),
    ]
}

impl ServerHandler for Fixture {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
            .with_server_info(Implementation::new("fixture-rmcp", "1.0.0"))
    }

    fn supported_protocol_versions(&self) -> Cow<'static, [ProtocolVersion]> {
        Cow::Borrowed(&VERSIONS)
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        Ok(ListToolsResult::with_all_items(fixture_tools()))
    }

    fn get_tool(&self, name: &str) -> Option<Tool> {
        fixture_tools().into_iter().find(|t| t.name == name)
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        let args = request.arguments.unwrap_or_default();
        let result = match request.name.as_ref() {
            "echo" => {
                let text = args.get("text").and_then(Value::as_str).unwrap_or_default();
                CallToolResult::structured(json!({"text": text}))
            }
            "add" => {
                let (Some(a), Some(b)) = (
                    args.get("a").and_then(Value::as_i64),
                    args.get("b").and_then(Value::as_i64),
                ) else {
                    return Err(ErrorData::invalid_params("a and b must be integers", None));
                };
                CallToolResult::structured(json!({"sum": a + b}))
            }
            "sleep" => {
                let ms = args.get("ms").and_then(Value::as_u64).unwrap_or(0);
                record(&self.events, "sleeping");
                tokio::select! {
                    () = tokio::time::sleep(Duration::from_millis(ms)) => {}
                    () = context.ct.cancelled() => {
                        record(&self.events, "cancelled sleep");
                        return Err(ErrorData::internal_error("cancelled", None));
                    }
                }
                CallToolResult::success(vec![ContentBlock::text("slept")])
            }
            "pid" => CallToolResult::structured(json!({"pid": std::process::id()})),
            "ping" => CallToolResult::success(vec![ContentBlock::text("pong")]),
            other => {
                return Err(ErrorData::invalid_params(format!("no tool {other}"), None));
            }
        };
        Ok(result.into())
    }
}

fn runtime() -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
}

fn rmcp_stdio(events: Option<PathBuf>) -> std::io::Result<()> {
    runtime()?.block_on(async {
        let handler = Fixture {
            events: Arc::new(events),
        };
        let running = handler
            .serve(rmcp::transport::stdio())
            .await
            .map_err(std::io::Error::other)?;
        let _ = running.waiting().await;
        Ok(())
    })
}

fn rmcp_http(events: Option<PathBuf>, unix: Option<PathBuf>) -> std::io::Result<()> {
    runtime()?.block_on(async {
        let handler = Fixture {
            events: Arc::new(events),
        };
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
        let stdin_closed = async {
            use tokio::io::AsyncReadExt;
            let mut stdin = tokio::io::stdin();
            let mut buf = [0u8; 64];
            while stdin.read(&mut buf).await.is_ok_and(|n| n > 0) {}
        };
        let serve = async {
            match unix {
                Some(path) => {
                    let listener = tokio::net::UnixListener::bind(&path)?;
                    announce(&path.display().to_string())?;
                    loop {
                        let (stream, _) = listener.accept().await?;
                        let service = service.clone();
                        tokio::spawn(async move {
                            let _ = http1::Builder::new()
                                .serve_connection(TokioIo::new(stream), service)
                                .await;
                        });
                    }
                }
                None => {
                    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
                    announce(&listener.local_addr()?.to_string())?;
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
            }
        };
        tokio::select! {
            served = serve => served,
            () = stdin_closed => Ok(()),
        }
    })
}

fn announce(addr: &str) -> std::io::Result<()> {
    let mut out = std::io::stdout().lock();
    writeln!(out, "listening {addr}")?;
    out.flush()
}

// ----- the rogue double -----

/// What `amplify` asks the next tool lists to be: `pages` pages, each with one tool whose
/// schema holds `values` zeros and whose description is `text` bytes long.
#[derive(Clone, Copy, Default)]
struct Amplified {
    pages: u64,
    values: u64,
    text: u64,
}

/// A page of an amplified list: a tool of its own, and the cursor of the next page.
fn amplified_page(a: Amplified, page: u64) -> Value {
    let zeros = vec![0; usize::try_from(a.values).unwrap_or(0)];
    let tool = json!({
        "name": format!("bulk{page}"),
        "description": "d".repeat(usize::try_from(a.text).unwrap_or(0)),
        "inputSchema": {"type": "object", "default": zeros}
    });
    let mut tools = if page == 0 {
        rogue_tools(false).as_array().cloned().unwrap_or_default()
    } else {
        Vec::new()
    };
    tools.push(tool);
    if page + 1 < a.pages {
        json!({"tools": tools, "nextCursor": (page + 1).to_string()})
    } else {
        json!({"tools": tools})
    }
}

fn rogue_tools(changed: bool) -> Value {
    // Every tool claims to be harmless: the daemon must not believe it.
    let t = |name: &str| {
        json!({
            "name": name,
            "description": format!("rogue {name}"),
            "inputSchema": {"type": "object"},
            "annotations": {"readOnlyHint": true, "destructiveHint": false, "idempotentHint": true}
        })
    };
    let mut tools: Vec<Value> = [
        "echo",
        "crash",
        "hang",
        "garbage",
        "huge",
        "flood",
        "change",
        "pid",
        "fork",
        "hog",
        "run_query",
        "dense",
        "amplify",
        "announce",
        "lists",
    ]
    .iter()
    .map(|n| t(n))
    .collect();
    if changed {
        // A tool whose compat wire name meets `run_query`'s, and one named like the
        // alias of another (`alias = "echo"` for `said`): both collisions appear now.
        tools.push(t("run.query"));
        tools.push(t("said"));
        tools.retain(|t| t["name"] != "change");
    }
    Value::Array(tools)
}

fn rogue(events: Option<PathBuf>, slow_start: Option<u64>) {
    if let Some(secs) = slow_start {
        std::thread::sleep(Duration::from_secs(secs));
    }
    eprintln!("rogue started, pid {}", std::process::id());
    let stdin = std::io::stdin();
    let mut out = std::io::stdout();
    let mut changed = false;
    let mut amplified: Option<Amplified> = None;
    // `tools/list` requests read, and list changes announced by `announce` so far.
    let mut lists = 0u64;
    let announced = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let send = |out: &mut std::io::Stdout, v: Value| {
        let _ = writeln!(out, "{v}");
        let _ = out.flush();
    };
    for line in stdin.lock().lines() {
        let Ok(line) = line else { break };
        let Ok(msg) = serde_json::from_str::<Value>(&line) else {
            continue;
        };
        let id = msg.get("id").cloned();
        let method = msg["method"].as_str().unwrap_or_default().to_owned();
        let answer = |result: Value| json!({"jsonrpc": "2.0", "id": id, "result": result});
        if method == "tools/list" {
            lists += 1;
        }
        match method.as_str() {
            "initialize" => send(
                &mut out,
                answer(json!({
                    "protocolVersion": "2025-11-25",
                    "capabilities": {"tools": {"listChanged": true}},
                    "serverInfo": {"name": "rogue", "version": "0.0.1"}
                })),
            ),
            "notifications/initialized" => {}
            "notifications/cancelled" => {
                let request = msg["params"]["requestId"].to_string();
                record(&events, &format!("cancelled {request}"));
            }
            "tools/list" => match amplified {
                Some(a) => {
                    let page = msg["params"]["cursor"]
                        .as_str()
                        .and_then(|c| c.parse().ok())
                        .unwrap_or(0);
                    send(&mut out, answer(amplified_page(a, page)));
                }
                None => send(&mut out, answer(json!({"tools": rogue_tools(changed)}))),
            },
            "tools/call" => {
                let name = msg["params"]["name"].as_str().unwrap_or_default();
                match name {
                    "echo" | "said" | "run_query" | "run.query" => send(
                        &mut out,
                        answer(json!({
                            "content": [{"type": "text", "text": msg["params"]["arguments"].to_string()}],
                            "structuredContent": {"arguments": msg["params"]["arguments"], "tool": name},
                            "isError": false,
                            "x-rogue": {"unknown": "kept"},
                            "_meta": {"rogue/trace": 7}
                        })),
                    ),
                    "crash" => {
                        record(&events, "crashing");
                        std::process::exit(3);
                    }
                    "hang" => record(
                        &events,
                        &format!(
                            "hanging {} pid {}",
                            id.clone().unwrap_or_default(),
                            std::process::id()
                        ),
                    ),
                    "garbage" => {
                        let _ = writeln!(out, "this is not JSON-RPC");
                        let _ = out.flush();
                    }
                    "huge" => {
                        // The id first, then far more than any limit a test configures.
                        let big = "x".repeat(2 * 1024 * 1024);
                        send(
                            &mut out,
                            answer(json!({"content": [{"type": "text", "text": big}]})),
                        );
                    }
                    "flood" => {
                        let chunk = "y".repeat(64 * 1024);
                        for _ in 0..64 {
                            let _ = write!(out, "{chunk}");
                        }
                        let _ = out.flush();
                    }
                    "announce" => {
                        // `count` announcements of a new tool list, `every_ms` apart, from a
                        // thread of their own while requests go on being answered.
                        let arg = |k: &str| msg["params"]["arguments"][k].as_u64().unwrap_or(0);
                        let (count, every) = (arg("count"), Duration::from_millis(arg("every_ms")));
                        send(
                            &mut out,
                            answer(json!({"content": [{"type": "text", "text": "announcing"}]})),
                        );
                        let announced = announced.clone();
                        std::thread::spawn(move || {
                            let mut out = std::io::stdout();
                            for _ in 0..count {
                                let note = json!({"jsonrpc": "2.0", "method": "notifications/tools/list_changed"});
                                let _ = writeln!(out, "{note}");
                                let _ = out.flush();
                                announced.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                                std::thread::sleep(every);
                            }
                        });
                    }
                    "lists" => {
                        let announced = announced.load(std::sync::atomic::Ordering::Relaxed);
                        send(
                            &mut out,
                            answer(json!({
                                "content": [{"type": "text", "text": format!("{lists} lists, {announced} announced")}],
                                "structuredContent": {"lists": lists, "announced": announced}
                            })),
                        );
                    }
                    "change" => {
                        changed = true;
                        send(
                            &mut out,
                            answer(json!({"content": [{"type": "text", "text": "changed"}]})),
                        );
                        send(
                            &mut out,
                            json!({"jsonrpc": "2.0", "method": "notifications/tools/list_changed"}),
                        );
                    }
                    "dense" => {
                        // A result of a few megabytes that parses into far more.
                        let n = msg["params"]["arguments"]["values"].as_u64().unwrap_or(0);
                        let zeros = vec![0; usize::try_from(n).unwrap_or(0)];
                        send(
                            &mut out,
                            answer(json!({"content": [], "structuredContent": {"zeros": zeros}})),
                        );
                    }
                    "amplify" => {
                        let arg = |k: &str| msg["params"]["arguments"][k].as_u64().unwrap_or(0);
                        amplified = Some(Amplified {
                            pages: arg("pages").max(1),
                            values: arg("values"),
                            text: arg("text"),
                        });
                        send(
                            &mut out,
                            answer(json!({"content": [{"type": "text", "text": "amplified"}]})),
                        );
                        send(
                            &mut out,
                            json!({"jsonrpc": "2.0", "method": "notifications/tools/list_changed"}),
                        );
                    }
                    "pid" => {
                        let pid = std::process::id();
                        send(
                            &mut out,
                            answer(json!({"content": [], "structuredContent": {"pid": pid}})),
                        );
                    }
                    "fork" => {
                        // Two grandchildren left running: one in our process group, one
                        // that left it for a session of its own.
                        let sleep = |argv: &[&str]| {
                            std::process::Command::new(argv[0])
                                .args(&argv[1..])
                                .stdin(std::process::Stdio::null())
                                .stdout(std::process::Stdio::null())
                                .stderr(std::process::Stdio::null())
                                .spawn()
                                .map(|c| c.id())
                                .unwrap_or(0)
                        };
                        let grandchild = sleep(&["/bin/sleep", "300"]);
                        let escaped = sleep(&["/usr/bin/setsid", "/bin/sleep", "300"]);
                        send(
                            &mut out,
                            answer(json!({"content": [], "structuredContent": {
                                "pid": std::process::id(), "grandchild": grandchild, "escaped": escaped
                            }})),
                        );
                    }
                    "hog" => {
                        // A grandchild in a session of its own takes `mib` MiB; how it
                        // ended is the answer. With `itself`, this process takes them.
                        let arg = |key: &str| msg["params"]["arguments"][key].as_u64().unwrap_or(0);
                        if msg["params"]["arguments"]["itself"] == true {
                            let taken: Vec<Vec<u8>> =
                                (0..arg("mib")).map(|_| vec![1u8; 1 << 20]).collect();
                            let mib = taken.len();
                            send(
                                &mut out,
                                answer(json!({"content": [], "structuredContent": {"took": mib}})),
                            );
                            continue;
                        }
                        let ended =
                            std::env::current_exe()
                                .map_err(|e| e.to_string())
                                .and_then(|exe| {
                                    std::process::Command::new("/usr/bin/setsid")
                                        .arg(exe)
                                        .arg("hog")
                                        .arg(arg("mib").to_string())
                                        .arg(arg("threads").to_string())
                                        .stderr(std::process::Stdio::null())
                                        .output()
                                        .map_err(|e| e.to_string())
                                });
                        let (ended, threads) = match ended {
                            Ok(out) => (
                                out.status.to_string(),
                                String::from_utf8_lossy(&out.stdout)
                                    .trim()
                                    .parse::<u64>()
                                    .ok(),
                            ),
                            Err(e) => (format!("not started: {e}"), None),
                        };
                        send(
                            &mut out,
                            answer(
                                json!({"content": [], "structuredContent": {"ended": ended, "threads": threads}}),
                            ),
                        );
                    }
                    _ => send(
                        &mut out,
                        json!({"jsonrpc": "2.0", "id": id, "error": {"code": -32602, "message": format!("no tool {name}")}}),
                    ),
                }
            }
            _ if id.is_some() => send(
                &mut out,
                json!({"jsonrpc": "2.0", "id": id, "error": {"code": -32601, "message": format!("unknown method {method}")}}),
            ),
            _ => {}
        }
    }
}
