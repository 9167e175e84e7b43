//! Downstream MCP servers: a trivial tool (`ping`) of our rmcp server (the e2e fixture
//! `robota-e2e-upstream`, rmcp's stateless Streamable HTTP server answering JSON) called
//! directly, and the same tool through robota-mcpd's loopback carrier with that server as
//! an HTTP backend (`rh.ping`) and as a shared stdio child (`rs.ping`), in the same run,
//! by the same load generator.

use std::fmt::Write as _;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use robota_e2e::Daemon;
use robota_e2e::upstream::{HttpServer, fixture_bin, fixture_command};

use crate::load::{self, Auth, CellResult, Plan, Template};
use crate::matrix::{Timing, ms};
use crate::report::Verdict;

/// The three ways the tool is reached, in the order they are measured and printed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Route {
    Direct,
    HttpBackend,
    StdioChild,
}

impl Route {
    pub fn label(self) -> &'static str {
        match self {
            Route::Direct => "rmcp server, direct",
            Route::HttpBackend => "robota-mcpd → HTTP backend",
            Route::StdioChild => "robota-mcpd → shared stdio child",
        }
    }

    fn tool(self) -> &'static str {
        match self {
            Route::Direct => "ping",
            Route::HttpBackend => "rh.ping",
            Route::StdioChild => "rs.ping",
        }
    }

    fn body(self) -> Bytes {
        Bytes::from(format!(
            r#"{{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{{"name":"{}","arguments":{{}}}}}}"#,
            self.tool()
        ))
    }
}

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
}

/// Starts the server and a daemon in front of it, then runs every cell.
pub fn run(rt: &tokio::runtime::Runtime, timing: Timing, clients: &[usize]) -> UpstreamRun {
    eprintln!("robota-bench: downstream MCP servers");
    let mut cmd = std::process::Command::new(fixture_bin());
    cmd.arg("rmcp-http");
    let server = HttpServer::spawn(cmd);
    let d = Daemon::builder()
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
    let bearer = crate::mcpd::host_bearer(&d);
    let direct_addr: std::net::SocketAddr = server
        .addr
        .parse()
        .unwrap_or_else(|e| panic!("{}: {e}", server.addr));
    let targets = [
        (Route::Direct, direct_addr, Auth::None, server.pid()),
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
    for (route, addr, _, pid) in &targets {
        eprintln!("  {:<34} {addr} pid {pid}", route.label());
    }
    let mut rows: Vec<Row> = Vec::new();
    for round in 0..timing.rounds {
        for &n in clients {
            for (route, addr, auth, pid) in &targets {
                let template = Arc::new(Template::local(*addr, route.body(), auth.clone()));
                let plan = Plan {
                    clients: n,
                    warmup: timing.warmup,
                    duration: timing.duration,
                    server_pid: Some(*pid),
                    helper_pid: None,
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
    UpstreamRun { rows }
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
        if let (Some(direct), Some(via)) = (
            self.best(Route::Direct, 1),
            self.best(Route::HttpBackend, 1),
        ) {
            let overhead = via
                .latencies
                .percentile(50.0)
                .saturating_sub(direct.latencies.percentile(50.0));
            out.push(Verdict {
                target: "HTTP backend through robota-mcpd: p50 overhead ≤ 100 µs, 1 client".into(),
                measured: format!("{} µs", overhead.as_micros()),
                met: overhead <= Duration::from_micros(100),
            });
        }
        out
    }

    pub fn markdown(&self) -> String {
        let mut s = String::from(
            "## Downstream MCP servers\n\n\
             A trivial tool (`ping`, answering `pong`) of our rmcp server — the e2e fixture \
             `robota-e2e-upstream rmcp-http`: rmcp's stateless Streamable HTTP service \
             answering JSON, on hyper's HTTP/1.1 server — called directly, and the same tool \
             through the loopback carrier of the same release daemon with that server as an \
             HTTP backend (`[upstreams.rh] url`, `rh.ping`) and as a shared stdio child \
             (`[upstreams.rs] command = [… \"rmcp-stdio\"]`, `rs.ping`); same requests, load \
             generator, cell timing and rounds as above. *Server CPU* is the daemon's alone \
             for the two daemon rows (the upstream process's CPU is not in it) and the rmcp \
             server's for the direct row.\n\n\
             | clients | route | req/s | p50 ms | p99 ms | server CPU µs/req | errors | × direct |\n\
             |---:|---|---:|---:|---:|---:|---:|---:|\n",
        );
        for row in &self.rows {
            let best = row.best();
            let ratio = match (row.route, self.best(Route::Direct, row.clients)) {
                (Route::Direct, _) | (_, None) => "—".to_owned(),
                (_, Some(direct)) => format!(
                    "{:.2}",
                    best.throughput() / direct.throughput().max(f64::MIN_POSITIVE)
                ),
            };
            let _ = writeln!(
                s,
                "| {} | {} | {:.0} | {:.3} | {:.3} | {} | {} | {ratio} |",
                row.clients,
                row.route.label(),
                best.throughput(),
                ms(best.latencies.percentile(50.0)),
                ms(best.latencies.percentile(99.0)),
                best.server_cpu_per_request().as_micros(),
                row.errors(),
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
