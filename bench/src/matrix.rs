//! The throughput matrix: every (request, clients) cell run against every server, one
//! server after the other inside a cell group so that the ratios compare numbers taken
//! seconds apart, repeated for a few rounds; the best round of each cell is reported.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;

use crate::load::{self, Auth, CellResult, Plan, Template};

/// The servers of the table, in the order they are measured and printed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, clap::ValueEnum)]
pub enum Server {
    Hello,
    Stock,
    Loopback,
    RemoteCached,
    RemoteUncached,
    RemoteOpaqueCached,
    RemoteOpaqueUncached,
}

impl Server {
    pub fn label(self) -> &'static str {
        match self {
            Server::Hello => "hyper hello",
            Server::Stock => "stock rmcp 3.11",
            Server::Loopback => "robota-mcpd loopback",
            Server::RemoteCached => "robota-mcpd remote, cached JWT",
            Server::RemoteUncached => "robota-mcpd remote, fresh JWT",
            Server::RemoteOpaqueCached => "robota-mcpd remote, opaque cached",
            Server::RemoteOpaqueUncached => "robota-mcpd remote, opaque uncached",
        }
    }

    /// The remote carrier's cells (compared with the loopback carrier).
    pub fn is_remote(self) -> bool {
        matches!(
            self,
            Server::RemoteCached
                | Server::RemoteUncached
                | Server::RemoteOpaqueCached
                | Server::RemoteOpaqueUncached
        )
    }

    /// The cells whose tokens are checked at the authorization server's introspection
    /// endpoint.
    pub fn is_opaque(self) -> bool {
        matches!(
            self,
            Server::RemoteOpaqueCached | Server::RemoteOpaqueUncached
        )
    }
}

/// The JSON-RPC request of a cell.
#[expect(
    clippy::enum_variant_names,
    reason = "named after the JSON-RPC methods: tools/list, tools/call"
)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, clap::ValueEnum)]
pub enum Call {
    Ping,
    #[value(name = "list")]
    ToolsList,
    #[value(name = "call")]
    ToolsCall,
}

impl Call {
    pub fn label(self) -> &'static str {
        match self {
            Call::Ping => "ping",
            Call::ToolsList => "tools/list",
            Call::ToolsCall => "tools/call system.info",
        }
    }

    pub fn body(self) -> Bytes {
        match self {
            Call::Ping => load::ping_body(),
            Call::ToolsList => load::tools_list_body(),
            Call::ToolsCall => load::tools_call_body(),
        }
    }
}

/// A server to send cells to.
#[derive(Debug, Clone)]
pub struct Target {
    pub server: Server,
    pub addr: SocketAddr,
    /// `Host`: `127.0.0.1:<port>`, or the public authority for the remote carrier.
    pub host: String,
    pub auth: Auth,
    pub pid: i32,
    /// The authorization server the server asks (opaque-token cells), for its CPU time.
    pub helper_pid: Option<i32>,
}

/// One cell's rounds.
#[derive(Debug, Clone)]
pub struct Row {
    pub server: Server,
    pub call: Call,
    pub clients: usize,
    pub rounds: Vec<CellResult>,
}

impl Row {
    /// The round with the highest throughput.
    pub fn best(&self) -> &CellResult {
        self.rounds
            .iter()
            .max_by(|a, b| a.throughput().total_cmp(&b.throughput()))
            .unwrap_or_else(|| panic!("a row without rounds"))
    }

    /// Errors over every round.
    pub fn errors(&self) -> u64 {
        self.rounds.iter().map(|r| r.errors).sum()
    }

    pub fn first_error(&self) -> Option<&str> {
        self.rounds.iter().find_map(|r| r.first_error.as_deref())
    }

    /// (lowest − highest) / highest throughput over the rounds, in percent.
    pub fn spread(&self) -> f64 {
        let t: Vec<f64> = self.rounds.iter().map(CellResult::throughput).collect();
        let hi = t.iter().copied().fold(0.0, f64::max);
        let lo = t.iter().copied().fold(f64::INFINITY, f64::min);
        if hi > 0.0 {
            (hi - lo) / hi * 100.0
        } else {
            0.0
        }
    }
}

/// Other processes' share of the machine above which a cell is run again.
pub const NOISY: f64 = 0.15;
/// How many noisy cells are run again, over the whole matrix.
const NOISY_RETRIES: usize = 12;

/// How long each cell runs and how often.
#[derive(Debug, Clone, Copy)]
pub struct Timing {
    pub warmup: Duration,
    pub duration: Duration,
    pub rounds: usize,
}

/// Runs the matrix; prints one progress line per cell on stderr.
pub async fn run(
    targets: &[Target],
    calls: &[Call],
    concurrency: &[usize],
    timing: Timing,
) -> Vec<Row> {
    let mut rows: Vec<Row> = Vec::new();
    let mut retries_left = NOISY_RETRIES;
    for round in 0..timing.rounds {
        for &call in calls {
            for &clients in concurrency {
                for target in targets {
                    let template = Arc::new(Template::new(
                        target.addr,
                        &target.host,
                        call.body(),
                        target.auth.clone(),
                    ));
                    let plan = Plan {
                        clients,
                        warmup: timing.warmup,
                        duration: timing.duration,
                        server_pid: Some(target.pid),
                        helper_pid: target.helper_pid,
                    };
                    let mut result = load::closed_loop(template.clone(), plan).await;
                    // Another process took a large share of the CPUs: try again while the
                    // run's retry budget lasts, keeping the quieter attempt.
                    if result.cpu.foreign > NOISY && retries_left > 0 {
                        retries_left -= 1;
                        eprintln!(
                            "  (other processes used {:.0}% of the machine: again)",
                            result.cpu.foreign * 100.0
                        );
                        let again = load::closed_loop(template.clone(), plan).await;
                        if again.cpu.foreign < result.cpu.foreign {
                            result = again;
                        }
                    }
                    eprintln!(
                        "  round {}  {:<32} {:<24} {:>2} clients  {:>8.0} req/s  p50 {:>7.3} ms  p99 {:>7.3} ms  errors {}{}",
                        round + 1,
                        target.server.label(),
                        call.label(),
                        clients,
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
                    match rows.iter_mut().find(|r| {
                        r.server == target.server && r.call == call && r.clients == clients
                    }) {
                        Some(row) => row.rounds.push(result),
                        None => rows.push(Row {
                            server: target.server,
                            call,
                            clients,
                            rounds: vec![result],
                        }),
                    }
                }
            }
        }
    }
    rows.sort_by_key(|r| (r.call, r.clients, r.server));
    rows
}

/// Milliseconds, for printing.
pub fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}
