//! `robota-bench`: robota-mcpd's throughput, latency and process figures next to a plain
//! hyper server and a stock rmcp server, all driven by one load generator in one run.
//!
//! The lifecycle: check the daemon binaries, start every server (the baselines as child
//! processes of this binary, robota-mcpd as the real shipped binary), run the throughput
//! matrix, the bad-token flood, the process figures, then print the report and, with
//! `--write-docs`, write it to `docs/benchmarks.md`.

// A benchmark's output is its report, printed on stdout.
#![allow(clippy::print_stdout)]
#![forbid(unsafe_code)]

mod figures;
mod flood;
mod load;
mod matrix;
mod mcp_proxy;
mod mcpd;
mod procfs;
mod report;
mod servers;
mod upstream;

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::{Parser, Subcommand};
use http::HeaderValue;

use crate::flood::FloodLevel;
use crate::load::{Auth, TokenPool};
use crate::matrix::{Call, Server, Target, Timing};
use crate::report::{Figures, MatrixRun, OpaqueRun, Report};
use robota_e2e::oidc::Oidc;

/// Benchmarks robota-mcpd against a plain hyper server and a stock rmcp server.
///
/// Build the shipped daemon first and name its directory (an absolute path):
/// `cargo build --profile dist -p robota-mcpd -p robota-mcpctl`, `cargo build --release -p
/// robota-e2e`, then `ROBOTA_BIN_DIR=$PWD/target/dist`; unset, the test build's daemon is
/// measured. The opaque-token cells need oidc-provider: `npm ci --prefix tests/oidc`.
#[derive(Debug, Parser)]
#[command(name = "robota-bench")]
struct Args {
    /// Also write the report to docs/benchmarks.md (needs the full run: no selection).
    #[arg(long)]
    write_docs: bool,
    /// Measured seconds per cell.
    #[arg(long, default_value_t = 3.0)]
    duration: f64,
    /// Warm-up seconds per cell.
    #[arg(long, default_value_t = 1.0)]
    warmup: f64,
    /// Rounds of the whole matrix (the best round of each cell is reported).
    #[arg(long, default_value_t = 2)]
    rounds: usize,
    /// Servers of the matrix.
    #[arg(long, value_enum, value_delimiter = ',', default_values_t = [Server::Hello, Server::Stock, Server::Loopback, Server::RemoteCached, Server::RemoteUncached, Server::RemoteOpaqueCached, Server::RemoteOpaqueUncached])]
    servers: Vec<Server>,
    /// Requests of the matrix.
    #[arg(long, value_enum, value_delimiter = ',', default_values_t = [Call::Ping, Call::ToolsList, Call::ToolsCall])]
    calls: Vec<Call>,
    /// Concurrent clients of the matrix.
    #[arg(long, value_delimiter = ',', default_values_t = [1, 32])]
    clients: Vec<usize>,
    /// Parts to run.
    #[arg(long, value_enum, value_delimiter = ',', default_values_t = [Part::Matrix, Part::Flood, Part::Figures, Part::Upstream])]
    parts: Vec<Part>,
    /// Valid-client rates (requests/s) of the flood scenario; the flood is ten times each.
    #[arg(long, value_delimiter = ',', default_values_t = [100.0, 500.0])]
    flood_rates: Vec<f64>,
    /// Seconds per phase of the flood scenario.
    #[arg(long, default_value_t = 5.0)]
    flood_duration: f64,
    /// KEY=VALUE added to the environment of every server of the matrix (experiments,
    /// e.g. GLIBC_TUNABLES); not for the documented run.
    #[arg(long = "server-env", value_parser = key_value)]
    server_env: Vec<(String, String)>,
    /// Seconds to wait at most for other processes to quiet down before starting.
    #[arg(long, default_value_t = 120)]
    wait_quiet: u64,
    /// Fresh tokens minted for the uncached remote cells.
    #[arg(long, default_value_t = 100_000)]
    token_pool: usize,
    #[command(subcommand)]
    internal: Option<Internal>,
}

/// The parts of a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Part {
    Matrix,
    Flood,
    Figures,
    /// A trivial tool of an rmcp server, directly, through the daemon and through
    /// mcp-proxy 0.6.0 (binary: $ROBOTA_BENCH_MCP_PROXY, else target/bench-tools/bin/mcp-proxy,
    /// installed there by `cargo install --locked` when missing; the row is skipped if that
    /// fails).
    Upstream,
}

impl Args {
    /// Whether this is the full run the docs describe.
    fn is_full(&self) -> bool {
        use clap::ValueEnum as _;
        Server::value_variants()
            .iter()
            .all(|s| self.servers.contains(s))
            && Call::value_variants()
                .iter()
                .all(|c| self.calls.contains(c))
            && self.clients.contains(&1)
            && self.clients.contains(&32)
            && self.parts.len() == 4
            && self.server_env.is_empty()
    }
}

/// The baselines, run by the harness as its own child processes.
#[derive(Debug, Subcommand)]
enum Internal {
    /// Serve the plain hyper baseline on 127.0.0.1:0.
    #[command(hide = true)]
    ServeHello,
    /// Serve the stock rmcp baseline on 127.0.0.1:0 with the tools in FILE.
    #[command(hide = true)]
    ServeRmcp {
        #[arg(long)]
        tools: PathBuf,
    },
}

/// Tokens kept by the clients of the cached remote cells (one each), and the opaque
/// tokens the clients of the opaque cells keep (one each, cached or not).
const CACHED_TOKENS: usize = 32;
/// `[remote.introspection] cache` of the two opaque-token daemons.
const OPAQUE_CACHED: &str = "60s";
const OPAQUE_UNCACHED: &str = "0s";

fn main() -> ExitCode {
    let args = Args::parse();
    match &args.internal {
        Some(Internal::ServeHello) => return child_exit(servers::serve_hello()),
        Some(Internal::ServeRmcp { tools }) => return child_exit(servers::serve_rmcp(tools)),
        None => {}
    }
    if args.write_docs && !args.is_full() {
        eprintln!(
            "robota-bench: --write-docs needs the full run (no --servers/--calls/--clients/--parts selection)"
        );
        return ExitCode::from(2);
    }
    if let Err(e) = mcpd::check_binaries() {
        eprintln!("robota-bench: {e}");
        return ExitCode::from(2);
    }
    let opaque_cells =
        args.parts.contains(&Part::Matrix) && args.servers.iter().any(|s| s.is_opaque());
    if let Err(e) = opaque_cells.then(mcpd::check_provider).transpose() {
        eprintln!("robota-bench: {e}");
        return ExitCode::from(2);
    }
    let started = Instant::now();
    let daemon_binary = mcpd::binary_dir().join("robota-mcpd");
    if procfs::binary_is_stale(&workspace_root(), &daemon_binary) {
        eprintln!(
            "robota-bench: warning: {} is older than daemon/ or proto/: rebuild it with `cargo build --profile dist -p robota-mcpd -p robota-mcpctl`",
            daemon_binary.display()
        );
    }
    let machine = procfs::Machine::describe(&workspace_root(), &daemon_binary);
    // A CI run sharing the machine makes every number pessimistic: wait for a lull.
    let foreign_before = procfs::wait_quiet(0.10, Duration::from_secs(args.wait_quiet));
    eprintln!(
        "robota-bench: daemon binaries from {}; other processes use {:.0}% of the machine",
        mcpd::binary_dir().display(),
        foreign_before * 100.0
    );
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("robota-bench: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let keys = mcpd::KeySet::generate();

    let matrix = if args.parts.contains(&Part::Matrix) {
        match throughput(&rt, &args, &keys) {
            Ok(m) => Some(m),
            Err(e) => {
                eprintln!("robota-bench: {e}");
                return ExitCode::FAILURE;
            }
        }
    } else {
        None
    };
    let flood_duration = Duration::from_secs_f64(args.flood_duration);
    let flood = if args.parts.contains(&Part::Flood) {
        bad_token_flood(&rt, &keys, &args.flood_rates, flood_duration)
    } else {
        Vec::new()
    };
    let figures = args
        .parts
        .contains(&Part::Figures)
        .then(|| process_figures(&rt, &keys));

    let upstream = args.parts.contains(&Part::Upstream).then(|| {
        let timing = Timing {
            warmup: Duration::from_secs_f64(args.warmup),
            duration: Duration::from_secs_f64(args.duration),
            rounds: args.rounds.max(1),
        };
        upstream::run(&rt, timing, &args.clients)
    });

    let report = Report {
        machine,
        foreign_before,
        matrix,
        flood,
        flood_duration,
        figures,
        upstream,
        elapsed: started.elapsed(),
    };
    let text = report.markdown();
    println!("{text}");
    if args.write_docs {
        let path = docs_path();
        if let Err(e) = std::fs::write(&path, &text) {
            eprintln!("robota-bench: write {}: {e}", path.display());
            return ExitCode::FAILURE;
        }
        eprintln!("robota-bench: wrote {}", path.display());
    }
    ExitCode::SUCCESS
}

/// Starts the selected servers and runs the matrix over them.
fn throughput(
    rt: &tokio::runtime::Runtime,
    args: &Args,
    keys: &mcpd::KeySet,
) -> Result<MatrixRun, String> {
    let timing = Timing {
        warmup: Duration::from_secs_f64(args.warmup),
        duration: Duration::from_secs_f64(args.duration),
        rounds: args.rounds.max(1),
    };
    eprintln!("robota-bench: starting the servers");
    // The loopback daemon always runs: its tool list is the stock server's.
    let env = &args.server_env;
    let loopback = mcpd::loopback_daemon_with(env);
    let host_bearer = mcpd::host_bearer(&loopback);
    let tools = rt
        .block_on(tools_list(loopback.loopback_addr(), host_bearer.clone()))
        .map_err(|e| format!("the daemon's tools/list failed: {e}"))?;
    let tool_count = tools["tools"].as_array().map_or(0, Vec::len);
    let tools_dir = tempfile::Builder::new()
        .prefix("robota-bench-tools-")
        .tempdir()
        .map_err(|e| format!("tempdir: {e}"))?;
    let tools_file = tools_dir.path().join("tools.json");
    let tools_text = tools.to_string();
    std::fs::write(&tools_file, &tools_text)
        .map_err(|e| format!("write {}: {e}", tools_file.display()))?;
    let wants = |s: Server| args.servers.contains(&s);
    let hello =
        wants(Server::Hello).then(|| servers::ChildServer::spawn("hello", &["serve-hello"], env));
    let tools_arg = tools_file.display().to_string();
    let stock = wants(Server::Stock).then(|| {
        servers::ChildServer::spawn("stock rmcp", &["serve-rmcp", "--tools", &tools_arg], env)
    });
    let remote = (wants(Server::RemoteCached) || wants(Server::RemoteUncached))
        .then(|| keys.matrix_remote_daemon(env));
    // The opaque-token cells: oidc-provider under Node, and one daemon per cache setting
    // asking its introspection endpoint (declared after the provider, so dropped first).
    let provider = if wants(Server::RemoteOpaqueCached) || wants(Server::RemoteOpaqueUncached) {
        eprintln!("robota-bench: starting oidc-provider");
        Some(mcpd::start_provider()?)
    } else {
        None
    };
    let opaque_daemon = |server, cache| {
        provider
            .as_ref()
            .filter(|_| wants(server))
            .map(|p| mcpd::opaque_daemon(p, cache, env))
    };
    let opaque_cached = opaque_daemon(Server::RemoteOpaqueCached, OPAQUE_CACHED);
    let opaque_uncached = opaque_daemon(Server::RemoteOpaqueUncached, OPAQUE_UNCACHED);
    let opaque_tokens = match &provider {
        Some(p) => Arc::new(rt.block_on(mcpd::opaque_tokens(p, CACHED_TOKENS))?),
        None => Arc::new(Vec::new()),
    };
    let cached: Vec<HeaderValue> = (0..CACHED_TOKENS)
        .map(|n| load::bearer(&keys.token(n)))
        .collect();
    let pool_size = if wants(Server::RemoteUncached) {
        args.token_pool
    } else {
        0
    };
    eprintln!("robota-bench: minting {pool_size} ES256 tokens");
    // Pool tokens are numbered after the cached ones: distinct `jti`, distinct digests.
    let pool = Arc::new(TokenPool::new(
        keys.tokens(pool_size + CACHED_TOKENS)
            .split_off(CACHED_TOKENS),
    ));
    let mut targets = Vec::new();
    let local = |server, addr: std::net::SocketAddr, auth, pid| Target {
        server,
        addr,
        host: addr.to_string(),
        auth,
        pid,
        helper_pid: None,
    };
    if let Some(h) = &hello {
        targets.push(local(Server::Hello, h.addr, Auth::None, h.pid()));
    }
    if let Some(s) = &stock {
        targets.push(local(Server::Stock, s.addr, Auth::None, s.pid()));
    }
    if wants(Server::Loopback) {
        targets.push(local(
            Server::Loopback,
            loopback.loopback_addr(),
            Auth::PerClient(Arc::new(vec![host_bearer])),
            loopback.pid(),
        ));
    }
    if let Some(r) = &remote {
        let remote = |server, auth| Target {
            server,
            addr: r.remote_addr(),
            host: mcpd::PUBLIC_HOST.into(),
            auth,
            pid: r.pid(),
            helper_pid: None,
        };
        if wants(Server::RemoteCached) {
            targets.push(remote(
                Server::RemoteCached,
                Auth::PerClient(Arc::new(cached)),
            ));
        }
        if wants(Server::RemoteUncached) {
            targets.push(remote(Server::RemoteUncached, Auth::Pool(pool.clone())));
        }
    }
    let provider_pid = provider
        .as_ref()
        .and_then(Oidc::pid)
        .and_then(|p| i32::try_from(p).ok());
    for (server, d) in [
        (Server::RemoteOpaqueCached, &opaque_cached),
        (Server::RemoteOpaqueUncached, &opaque_uncached),
    ] {
        if let Some(d) = d {
            targets.push(Target {
                server,
                addr: d.remote_addr(),
                host: robota_e2e::remote::PUBLIC_HOST.into(),
                auth: Auth::PerClient(opaque_tokens.clone()),
                pid: d.pid(),
                helper_pid: provider_pid,
            });
        }
    }
    for t in &targets {
        eprintln!("  {:<36} {} pid {}", t.server.label(), t.addr, t.pid);
    }
    if let Some(pid) = provider_pid {
        eprintln!("  {:<36} pid {pid}", "oidc-provider (Node)");
    }
    eprintln!("robota-bench: throughput matrix");
    let rows = rt.block_on(matrix::run(&targets, &args.calls, &args.clients, timing));
    let opaque = provider.as_ref().map(|_| OpaqueRun {
        provider_version: mcpd::provider_version().unwrap_or_else(|| "(version unknown)".into()),
        node_version: node_version(),
        tokens: opaque_tokens.len(),
        token_ttl_secs: mcpd::OPAQUE_TOKEN_TTL_SECS,
        cached: OPAQUE_CACHED,
        uncached: OPAQUE_UNCACHED,
        provider_cpu_read: provider_pid.is_some(),
        introspections_cached: opaque_cached
            .as_ref()
            .map(mcpd::introspections)
            .unwrap_or_default(),
        introspections_uncached: opaque_uncached
            .as_ref()
            .map(mcpd::introspections)
            .unwrap_or_default(),
    });
    Ok(MatrixRun {
        timing,
        rows,
        pool: (pool.len(), pool.used()),
        tool_mean: tool_mean(&loopback),
        tools_list_bytes: tools_text.len(),
        tool_count,
        opaque,
    })
}

/// One flood level per rate, each on a fresh remote daemon (an empty throttle).
fn bad_token_flood(
    rt: &tokio::runtime::Runtime,
    keys: &mcpd::KeySet,
    rates: &[f64],
    duration: Duration,
) -> Vec<FloodLevel> {
    eprintln!("robota-bench: bad-token flood");
    let mut levels = Vec::new();
    // Each rate with the same 16 forgeries replayed; the highest also with a fresh
    // forgery per request (enough for the whole flood, never one twice).
    let highest = rates.iter().copied().fold(0.0, f64::max);
    let runs = rates
        .iter()
        .map(|&rate| (rate, false))
        .chain(rates.iter().any(|&r| r > 0.0).then_some((highest, true)));
    for (rate, fresh) in runs {
        let d = keys.flood_daemon();
        eprintln!(
            "  valid {rate}/s (fresh forgeries: {fresh}) against robota-mcpd pid {}",
            d.pid()
        );
        let valid = load::bearer(&keys.token(1_000_000));
        let count = if fresh {
            flood::tokens_needed(rate, duration)
        } else {
            16
        };
        let bad = keys.bad_signature_tokens(count);
        let level = rt.block_on(flood::run_level(
            d.remote_addr(),
            d.pid(),
            valid,
            bad,
            fresh,
            rate,
            duration,
        ));
        eprintln!(
            "  valid {rate}/s: alone p99 {:.3} ms, flooded p99 {:.3} ms ({}/{} ok), flood {:?} at {:.0}/s",
            matrix::ms(level.unloaded.latencies.percentile(99.0)),
            matrix::ms(level.loaded.latencies.percentile(99.0)),
            level.loaded.ok,
            level.loaded.sent,
            level.flood.statuses,
            level.flood.rate(),
        );
        levels.push(level);
    }
    levels
}

fn process_figures(rt: &tokio::runtime::Runtime, keys: &mcpd::KeySet) -> Figures {
    eprintln!("robota-bench: process figures");
    let starts = vec![
        figures::start_times(
            "loopback only (harness default)",
            robota_e2e::Daemon::builder,
        ),
        figures::start_times("with the remote carrier (jwks_file, 4 keys)", || {
            keys.remote_config(&[]).builder()
        }),
    ];
    let memory = figures::memory(rt);
    let growth = figures::throttle_growth(rt, keys);
    Figures {
        starts,
        memory,
        growth,
    }
}

/// `KEY=VALUE` → (KEY, VALUE).
fn key_value(text: &str) -> Result<(String, String), String> {
    text.split_once('=')
        .filter(|(k, _)| !k.is_empty())
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .ok_or_else(|| format!("expected KEY=VALUE, got {text:?}"))
}

fn child_exit(result: std::io::Result<()>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("robota-bench: baseline server: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The workspace root (the parent of `bench/`).
pub(crate) fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map_or_else(|| PathBuf::from("."), Path::to_path_buf)
}

/// `docs/benchmarks.md` of this workspace.
fn docs_path() -> PathBuf {
    workspace_root().join("docs").join("benchmarks.md")
}

/// The daemon's `tools/list` result, to give the stock server the same tools.
async fn tools_list(
    addr: std::net::SocketAddr,
    bearer: HeaderValue,
) -> Result<serde_json::Value, String> {
    let template = Arc::new(load::Template::local(
        addr,
        load::tools_list_body(),
        Auth::PerClient(Arc::new(vec![bearer])),
    ));
    let mut answer = load::one(template).await?;
    match answer.get_mut("result") {
        Some(result) => Ok(result.take()),
        None => Err(format!("no result in {answer}")),
    }
}

/// `node --version`, the runtime of the authorization server.
fn node_version() -> String {
    std::process::Command::new("node")
        .arg("--version")
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_else(|| "unknown".into())
}

/// Mean duration of `system.info` in the daemon, from its own histogram.
fn tool_mean(d: &robota_e2e::Daemon) -> Option<Duration> {
    let text = d.metrics_text()?;
    let label = "tool=\"system.info\"";
    let sum = robota_e2e::metric_sum(
        &text,
        &["robota_mcpd_tool_call_duration_seconds_sum", label],
    );
    let count = robota_e2e::metric_sum(
        &text,
        &["robota_mcpd_tool_call_duration_seconds_count", label],
    );
    (count > 0.0).then(|| Duration::from_secs_f64(sum / count))
}
