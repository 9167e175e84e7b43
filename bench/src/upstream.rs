//! Downstream MCP servers: a trivial tool (`ping`) of our rmcp server (the e2e fixture
//! `robota-e2e-upstream`, rmcp's stateless Streamable HTTP server answering JSON) called
//! directly, the same tool through robota-mcpd's loopback carrier with that server as
//! an HTTP backend (`rh.ping`) and as a shared stdio child (`rs.ping`), and through
//! mcp-proxy 0.6.0 with that same server as its HTTP backend (`rh/ping`, one session per
//! client), in the same run, by the same load generator; and one bare HTTP exchange with
//! the hello server, the least any extra hop adds. The server is also called directly
//! with the request the daemon sends it (its own revision, 2026-07-28, whose context
//! every request carries), so the hop's cost can be told from the server's cost of that
//! revision.

use std::fmt::Write as _;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use robota_e2e::Daemon;
use robota_e2e::upstream::{HttpServer, fixture_bin, fixture_command};

use crate::load::{self, Auth, CellResult, Plan, Template};
use crate::matrix::{Timing, ms};
use crate::mcp_proxy::{self, McpProxy};
use crate::report::Verdict;
use crate::servers::ChildServer;

/// The ways the tool is reached, in the order they are measured and printed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Route {
    /// The bench's hello server: one HTTP exchange and nothing else.
    Hello,
    Direct,
    /// Direct, with the request robota-mcpd sends the server ([`HOP_REQUEST`]).
    DirectAsHop,
    HttpBackend,
    StdioChild,
    /// mcp-proxy 0.6.0 with the same server as its HTTP backend.
    McpProxy,
}

impl Route {
    pub fn label(self) -> &'static str {
        match self {
            Route::Hello => "hyper hello (one bare HTTP exchange)",
            Route::Direct => "rmcp server, direct",
            Route::DirectAsHop => "rmcp server, direct, the hop's request",
            Route::HttpBackend => "robota-mcpd → HTTP backend",
            Route::StdioChild => "robota-mcpd → shared stdio child",
            Route::McpProxy => "mcp-proxy 0.6.0 → HTTP backend",
        }
    }

    fn tool(self) -> &'static str {
        match self {
            Route::Hello | Route::Direct | Route::DirectAsHop => "ping",
            Route::HttpBackend => "rh.ping",
            Route::StdioChild => "rs.ping",
            Route::McpProxy => "rh/ping",
        }
    }

    /// The request of this route's cells: `POST /mcp` without a session, but for
    /// mcp-proxy's `POST /` in a session per client.
    fn template(self, addr: std::net::SocketAddr, auth: Auth) -> Template {
        let template = Template::local(addr, self.body(), auth);
        match self {
            Route::McpProxy => template.at_path(mcp_proxy::PATH).with_sessions(),
            Route::DirectAsHop => template.in_revision(
                HOP_REVISION,
                &[("mcp-method", "tools/call"), ("mcp-name", "ping")],
                Bytes::from_static(HOP_REQUEST.as_bytes()),
            ),
            _ => template,
        }
    }

    fn body(self) -> Bytes {
        Bytes::from(format!(
            r#"{{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{{"name":"{}","arguments":{{}}}}}}"#,
            self.tool()
        ))
    }
}

/// The revision robota-mcpd speaks to the server (its newest; [`run`] checks it).
const HOP_REVISION: &str = "2026-07-28";

/// What robota-mcpd sends the server for `rh.ping` at [`HOP_REVISION`] — every request
/// carries the client's context in `_meta` — but for the id; with the headers that
/// revision adds (`Mcp-Method`, `Mcp-Name`) and without the daemon's `User-Agent`.
const HOP_REQUEST: &str = concat!(
    r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"_meta":{"#,
    r#""io.modelcontextprotocol/clientCapabilities":{},"#,
    r#""io.modelcontextprotocol/clientInfo":{"name":"robota-mcpd","version":""#,
    env!("CARGO_PKG_VERSION"),
    r#""},"io.modelcontextprotocol/protocolVersion":"2026-07-28"},"#,
    r#""arguments":{},"name":"ping"}}"#
);

#[derive(Debug)]
pub struct Row {
    pub route: Route,
    pub clients: usize,
    pub rounds: Vec<CellResult>,
}

impl Row {
    pub fn best(&self) -> &CellResult {
        self.rounds
            .iter()
            .max_by(|a, b| a.throughput().total_cmp(&b.throughput()))
            .unwrap_or_else(|| panic!("a row without rounds"))
    }

    fn errors(&self) -> u64 {
        self.rounds.iter().map(|r| r.errors).sum()
    }
}

#[derive(Debug)]
pub struct UpstreamRun {
    pub rows: Vec<Row>,
    /// How the mcp-proxy binary was had, or why its row was skipped.
    pub mcp_proxy: Result<String, String>,
}

/// Starts the server and a daemon in front of it, then runs every cell.
pub fn run(rt: &tokio::runtime::Runtime, timing: Timing, clients: &[usize]) -> UpstreamRun {
    eprintln!("robota-bench: downstream MCP servers");
    let mut cmd = std::process::Command::new(fixture_bin());
    cmd.arg("rmcp-http");
    let server = HttpServer::spawn(cmd);
    let hello = ChildServer::spawn("hello", &["serve-hello"], &[]);
    let d = Daemon::builder()
        .loopback(crate::mcpd::MATRIX_PER_CALLER)
        .extra(format!(
            "[upstreams.rh]\nurl = \"{}\"\n\n[upstreams.rs]\ncommand = {}\n\n\
             [[policy]]\ncallers = [\"bearer:*\"]\ntools = [\"rh.*\", \"rs.*\"]\ndecision = \"allow\"\n",
            server.url(),
            fixture_command(&["rmcp-stdio"])
        ))
        .start();
    let ready =
        robota_e2e::poll_until_blocking(Duration::from_secs(30), Duration::from_millis(50), || {
            d.status()
                .upstreams
                .iter()
                .filter(|u| u.state == "up")
                .count()
                == 2
        });
    assert!(
        ready,
        "the upstreams did not come up: {:?}",
        d.status().upstreams
    );
    let spoken = d
        .status()
        .upstreams
        .into_iter()
        .find(|u| u.name == "rh")
        .and_then(|u| u.protocol);
    assert_eq!(
        spoken.as_deref(),
        Some(HOP_REVISION),
        "the daemon speaks another revision to the server than the direct row of its \
         request sends"
    );
    let bearer = crate::mcpd::host_bearer(&d);
    let direct_addr: std::net::SocketAddr = server
        .addr
        .parse()
        .unwrap_or_else(|e| panic!("{}: {e}", server.addr));
    let mut targets = vec![
        (Route::Hello, hello.addr, Auth::None, hello.pid()),
        (Route::Direct, direct_addr, Auth::None, server.pid()),
        (Route::DirectAsHop, direct_addr, Auth::None, server.pid()),
        (
            Route::HttpBackend,
            d.loopback_addr(),
            Auth::PerClient(Arc::new(vec![bearer.clone()])),
            d.pid(),
        ),
        (
            Route::StdioChild,
            d.loopback_addr(),
            Auth::PerClient(Arc::new(vec![bearer])),
            d.pid(),
        ),
    ];
    // Declared after the server, so dropped (killed) before it.
    let proxy = start_mcp_proxy(rt, &server.url());
    let mcp_proxy = match &proxy {
        Ok((source, p)) => {
            targets.push((Route::McpProxy, p.addr, Auth::None, p.pid()));
            Ok(source.clone())
        }
        Err(reason) => {
            eprintln!("robota-bench: skipping the mcp-proxy row: {reason}");
            Err(reason.clone())
        }
    };
    for (route, addr, _, pid) in &targets {
        eprintln!("  {:<34} {addr} pid {pid}", route.label());
    }
    let mut rows: Vec<Row> = Vec::new();
    for round in 0..timing.rounds {
        for &n in clients {
            for (route, addr, auth, pid) in &targets {
                let template = Arc::new(route.template(*addr, auth.clone()));
                let plan = Plan {
                    clients: n,
                    warmup: timing.warmup,
                    duration: timing.duration,
                    server_pid: Some(*pid),
                    // Through the hop, the server's CPU too.
                    helper_pid: (*route == Route::HttpBackend).then(|| server.pid()),
                };
                let result = rt.block_on(load::closed_loop(template, plan));
                eprintln!(
                    "  round {}  {:<34} {n:>2} clients  {:>8.0} req/s  p50 {:>7.3} ms  p99 {:>7.3} ms  errors {}{}",
                    round + 1,
                    route.label(),
                    result.throughput(),
                    ms(result.latencies.percentile(50.0)),
                    ms(result.latencies.percentile(99.0)),
                    result.errors,
                    result
                        .first_error
                        .as_deref()
                        .map(|e| format!(" (first: {e})"))
                        .unwrap_or_default(),
                );
                match rows
                    .iter_mut()
                    .find(|r| r.route == *route && r.clients == n)
                {
                    Some(row) => row.rounds.push(result),
                    None => rows.push(Row {
                        route: *route,
                        clients: n,
                        rounds: vec![result],
                    }),
                }
            }
        }
    }
    rows.sort_by_key(|r| (r.clients, r.route));
    UpstreamRun { rows, mcp_proxy }
}

/// mcp-proxy in front of the server at `backend_url`, answering its `rh/ping` in a session:
/// where its binary came from and the running proxy, or why there is none.
fn start_mcp_proxy(
    rt: &tokio::runtime::Runtime,
    backend_url: &str,
) -> Result<(String, McpProxy), String> {
    let binary = mcp_proxy::binary(&crate::workspace_root())?;
    eprintln!("  mcp-proxy binary: {}", binary.path.display());
    let proxy = McpProxy::start(&binary.path, backend_url)?;
    let probe = Arc::new(Route::McpProxy.template(proxy.addr, Auth::None));
    rt.block_on(load::one(probe))
        .map_err(|e| format!("{} answered no `rh/ping`: {e}", proxy.addr))?;
    Ok((binary.source, proxy))
}

impl UpstreamRun {
    fn best(&self, route: Route, clients: usize) -> Option<&CellResult> {
        self.rows
            .iter()
            .find(|r| r.route == route && r.clients == clients)
            .map(Row::best)
    }

    /// ≥ 0.7× direct throughput through the HTTP backend; p50 overhead ≤ 100 µs.
    pub fn verdicts(&self) -> Vec<Verdict> {
        let mut out = Vec::new();
        for clients in [1, 32] {
            if let (Some(direct), Some(via)) = (
                self.best(Route::Direct, clients),
                self.best(Route::HttpBackend, clients),
            ) {
                let ratio = via.throughput() / direct.throughput().max(f64::MIN_POSITIVE);
                out.push(Verdict {
                    target: format!(
                        "HTTP backend through robota-mcpd ≥ 0.7× direct, trivial tool, {clients} client{}",
                        if clients == 1 { "" } else { "s" }
                    ),
                    measured: format!("{ratio:.2}×"),
                    met: ratio >= 0.7,
                });
            }
        }
        if let Some(overhead) = self.p50_overhead() {
            out.push(Verdict {
                target: "HTTP backend through robota-mcpd: p50 overhead ≤ 100 µs, 1 client".into(),
                measured: format!("{} µs", overhead.as_micros()),
                met: overhead <= Duration::from_micros(100),
            });
        }
        if let Some(overhead) = self.p50_over(Route::DirectAsHop) {
            out.push(Verdict {
                target: "HTTP backend through robota-mcpd: p50 overhead ≤ 100 µs, 1 client, \
                         against the direct call of the request it sends"
                    .into(),
                measured: format!("{} µs", overhead.as_micros()),
                met: overhead <= Duration::from_micros(100),
            });
        }
        out
    }

    /// The p50 of `route` at one client.
    fn p50(&self, route: Route) -> Option<Duration> {
        Some(self.best(route, 1)?.latencies.percentile(50.0))
    }

    /// What the hop through the HTTP backend adds to the direct route's p50, one client.
    fn p50_overhead(&self) -> Option<Duration> {
        self.p50_over(Route::Direct)
    }

    /// What the hop through the HTTP backend adds to `direct`'s p50, one client.
    fn p50_over(&self, direct: Route) -> Option<Duration> {
        Some(
            self.p50(Route::HttpBackend)?
                .saturating_sub(self.p50(direct)?),
        )
    }

    /// The p50 of one bare HTTP exchange at one client, the least an extra hop adds; and
    /// the HTTP-backend route's p50 overhead beyond it.
    fn floor(&self) -> Option<(Duration, Duration)> {
        let hello = self.p50(Route::Hello)?;
        Some((hello, self.p50_overhead()?.saturating_sub(hello)))
    }

    pub fn markdown(&self) -> String {
        let mut s = String::from(
            "## Downstream MCP servers\n\n\
             A trivial tool (`ping`, answering `pong`) of our rmcp server — the e2e fixture \
             `robota-e2e-upstream rmcp-http`: rmcp's stateless Streamable HTTP service \
             answering JSON, on hyper's HTTP/1.1 server — called directly, and the same tool \
             through the loopback carrier of the same daemon binary with that server as an \
             HTTP backend (`[upstreams.rh] url`, `rh.ping`) and as a shared stdio child \
             (`[upstreams.rs] command = [… \"rmcp-stdio\"]`, `rs.ping`); same requests, load \
             generator, cell timing and rounds as above. *Server CPU* is the daemon's alone \
             for the two daemon rows (the upstream process's CPU is not in it) and the rmcp \
             server's for the direct rows. The *hyper hello* row is the matrix's hello server \
             (a fixed answer, nothing parsed) sent the same request. *The hop's request* is \
             the direct call of what the daemon sends the server for `rh.ping` (revision \
             2026-07-28, with its `_meta` context, `Mcp-Method` and `Mcp-Name`), but for \
             the id.\n\n",
        );
        match &self.mcp_proxy {
            Ok(source) => {
                let _ = writeln!(
                    s,
                    "The same tool through [mcp-proxy](https://crates.io/crates/mcp-proxy) \
                     {version} (axum and tower-mcp; binary from {source}), run as \
                     `mcp-proxy --config proxy.toml` in a cgroup of its own, with the same \
                     server instance as its one backend (`[[backends]] name = \"rh\"`, \
                     `transport = \"http\"`, the server's URL; `rh/ping`) and its defaults \
                     otherwise (listening on 127.0.0.1; no auth, cache, rate limit, retry or \
                     other middleware; log level `info`, its documented default, which logs \
                     nothing per request — said explicitly, because without an \
                     `[observability]` section 0.6.0 logs two DEBUG lines per call). It \
                     serves MCP at `POST /` and keeps a session per client, so each of its \
                     clients first opens one — `initialize` (protocol {protocol}), \
                     `notifications/initialized` with the answer's `Mcp-Session-Id` — and \
                     then sends every request with `Mcp-Session-Id` and \
                     `MCP-Protocol-Version`; the opening is not timed. *Server CPU* is \
                     mcp-proxy's alone. *× robota-mcpd HTTP backend* is a row's throughput \
                     over robota-mcpd's HTTP-backend row with as many clients.\n",
                    version = mcp_proxy::VERSION,
                    protocol = load::PROTOCOL_VERSION,
                );
            }
            Err(reason) => {
                let _ = writeln!(
                    s,
                    "No mcp-proxy {} row in this run: {reason}.\n",
                    mcp_proxy::VERSION
                );
            }
        }
        s.push_str(
            "| clients | route | req/s | p50 ms | p99 ms | server CPU µs/req | errors | × direct | × robota-mcpd HTTP backend |\n\
             |---:|---|---:|---:|---:|---:|---:|---:|---:|\n",
        );
        let ratio = |a: &CellResult, b: Option<&CellResult>| {
            b.map_or_else(
                || "—".to_owned(),
                |b| {
                    format!(
                        "{:.2}",
                        a.throughput() / b.throughput().max(f64::MIN_POSITIVE)
                    )
                },
            )
        };
        for row in &self.rows {
            let best = row.best();
            let vs_direct = match row.route {
                Route::Hello | Route::Direct => "—".to_owned(),
                _ => ratio(best, self.best(Route::Direct, row.clients)),
            };
            let vs_http = match row.route {
                Route::HttpBackend => "1".to_owned(),
                Route::McpProxy => ratio(best, self.best(Route::HttpBackend, row.clients)),
                Route::Hello | Route::Direct | Route::DirectAsHop | Route::StdioChild => {
                    "—".to_owned()
                }
            };
            let _ = writeln!(
                s,
                "| {} | {} | {:.0} | {:.3} | {:.3} | {} | {} | {vs_direct} | {vs_http} |",
                row.clients,
                row.route.label(),
                best.throughput(),
                ms(best.latencies.percentile(50.0)),
                ms(best.latencies.percentile(99.0)),
                best.server_cpu_per_request().as_micros(),
                row.errors(),
            );
        }
        let as_hop: Vec<String> = [1, 32]
            .into_iter()
            .filter_map(|n| {
                let via = self.best(Route::HttpBackend, n)?;
                let direct = self.best(Route::DirectAsHop, n)?;
                Some(format!(
                    "{:.2}× its throughput at {n} client{}, the server's CPU {} µs per call \
                     through the hop and {} µs direct",
                    via.throughput() / direct.throughput().max(f64::MIN_POSITIVE),
                    if n == 1 { "" } else { "s" },
                    via.helper_cpu_per_request().as_micros(),
                    direct.server_cpu_per_request().as_micros(),
                ))
            })
            .collect();
        if let Some(overhead) = self.p50_over(Route::DirectAsHop) {
            let _ = writeln!(
                s,
                "\nThe daemon speaks {HOP_REVISION} to the server (its newest revision), whose \
                 requests each carry the client's context, so the server does more per call \
                 through the hop than for the direct row's {} request. Against the direct \
                 call of the daemon's own request (*the hop's request*): the HTTP-backend \
                 route's p50 overhead {} µs at one client; {}.",
                load::PROTOCOL_VERSION,
                overhead.as_micros(),
                as_hop.join("; ")
            );
        }
        if let Some((hello, beyond)) = self.floor() {
            let _ = writeln!(
                s,
                "\nThe hop sends each call over one more loopback HTTP exchange than the direct \
                 route, each end of it a process woken from sleep: one bare exchange with the \
                 hyper hello server at one client takes {} µs at p50 in this run, the least \
                 any extra hop can add here. The HTTP-backend route's p50 overhead beyond \
                 that (information, not a target): {} µs.",
                hello.as_micros(),
                beyond.as_micros()
            );
        }
        let against: Vec<String> = self
            .rows
            .iter()
            .filter(|r| r.route == Route::McpProxy)
            .filter_map(|r| {
                let ours = self.best(Route::HttpBackend, r.clients)?;
                let theirs = r.best().throughput();
                (theirs > 0.0).then(|| {
                    format!(
                        "{:.1}× at {} client{}",
                        ours.throughput() / theirs,
                        r.clients,
                        if r.clients == 1 { "" } else { "s" }
                    )
                })
            })
            .collect();
        if !against.is_empty() {
            let _ = writeln!(
                s,
                "\nrobota-mcpd → HTTP backend over mcp-proxy {} → HTTP backend, throughput \
                 (information, not a target): {}.",
                mcp_proxy::VERSION,
                against.join(", ")
            );
        }
        let verdicts = self.verdicts();
        if !verdicts.is_empty() {
            s.push('\n');
            s.push_str(&crate::report::verdict_table(
                "target of this section",
                &verdicts,
            ));
        }
        s.push('\n');
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The direct call of the hop's request speaks the daemon's revision: its header, the
    /// headers that revision adds, and the client's context in `_meta` at that revision.
    #[test]
    fn the_hops_request_is_sent_at_the_daemons_revision() {
        let addr = std::net::SocketAddr::from(([127, 0, 0, 1], 9));
        let template = Route::DirectAsHop.template(addr, Auth::None);
        assert_eq!(template.revision, HOP_REVISION);
        let extra: Vec<(&str, &str)> = template
            .extra
            .iter()
            .map(|(name, value)| (*name, value.to_str().unwrap_or_default()))
            .collect();
        assert_eq!(extra, [("mcp-method", "tools/call"), ("mcp-name", "ping")]);
        let body: serde_json::Value =
            serde_json::from_slice(&template.body).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(body["params"]["name"], "ping");
        let meta = &body["params"]["_meta"];
        assert_eq!(
            meta["io.modelcontextprotocol/protocolVersion"],
            HOP_REVISION
        );
        assert_eq!(
            meta["io.modelcontextprotocol/clientInfo"]["name"],
            "robota-mcpd"
        );
        let plain = Route::Direct.template(addr, Auth::None);
        assert_eq!(plain.revision, load::PROTOCOL_VERSION);
        assert!(plain.extra.is_empty());
    }
}
