//! The results as Markdown: printed on stdout, and written to `docs/benchmarks.md` with
//! `--write-docs`. Targets are judged here, from the numbers.

use std::fmt::Write as _;
use std::time::Duration;

use crate::figures::{Memory, StartTimes, ThrottleGrowth};
use crate::flood::FloodLevel;
use crate::load::CellResult;
use crate::matrix::{Call, NOISY, Row, Server, Timing, ms};
use crate::procfs::Machine;

/// The command that produces this page.
pub const COMMAND: &str = "npm ci --prefix tests/oidc\n\
cargo build --profile dist -p robota-mcpd -p robota-mcpctl\n\
cargo build --release -p robota-e2e\n\
ROBOTA_BIN_DIR=$PWD/target/dist cargo run --release -p robota-bench -- --write-docs";

/// Hand-written analysis of the last profiled run (perf evidence for missed targets).
const ANALYSIS: &str = include_str!("../analysis.md");

/// Everything one run measured.
#[derive(Debug)]
pub struct Report {
    pub machine: Machine,
    /// Share of the machine other processes used in the second before the run.
    pub foreign_before: f64,
    pub matrix: Option<MatrixRun>,
    pub flood: Vec<FloodLevel>,
    pub flood_duration: Duration,
    pub figures: Option<Figures>,
    pub upstream: Option<crate::upstream::UpstreamRun>,
    pub elapsed: Duration,
}

/// The throughput matrix and what describes it.
#[derive(Debug)]
pub struct MatrixRun {
    pub timing: Timing,
    pub rows: Vec<Row>,
    /// Tokens in the fresh-token pool and how many were sent.
    pub pool: (usize, usize),
    /// Mean `system.info` duration inside the daemon (its own histogram), if read.
    pub tool_mean: Option<Duration>,
    /// Bytes of the daemon's `tools/list` result.
    pub tools_list_bytes: usize,
    pub tool_count: usize,
    /// The opaque-token cells' setup, when they ran.
    pub opaque: Option<OpaqueRun>,
}

/// What the opaque-token cells ran against.
#[derive(Debug)]
pub struct OpaqueRun {
    /// oidc-provider's version, from `tests/oidc/package-lock.json`.
    pub provider_version: String,
    pub node_version: String,
    /// Opaque tokens the clients keep (one each).
    pub tokens: usize,
    pub token_ttl_secs: u64,
    /// `[remote.introspection] cache` of the cached and the uncached daemon.
    pub cached: &'static str,
    pub uncached: &'static str,
    /// Whether the provider's pid was known (its CPU time read).
    pub provider_cpu_read: bool,
    /// Introspection requests each daemon made over the whole matrix, by outcome.
    pub introspections_cached: Vec<(String, u64)>,
    pub introspections_uncached: Vec<(String, u64)>,
}

/// How many introspection requests, by outcome: `1234 times, all \`active\`` or
/// `1234 times (1200 \`active\`, 34 \`error\`)`.
fn outcomes(counts: &[(String, u64)]) -> String {
    let total: u64 = counts.iter().map(|(_, n)| n).sum();
    match counts {
        [] => "0 times".into(),
        [(outcome, _)] => format!("{total} times, all `{outcome}`"),
        _ => format!(
            "{total} times ({})",
            counts
                .iter()
                .map(|(outcome, n)| format!("{n} `{outcome}`"))
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}

/// The process figures.
#[derive(Debug)]
pub struct Figures {
    pub starts: Vec<StartTimes>,
    pub memory: Memory,
    pub growth: ThrottleGrowth,
}

/// One target and whether it was met.
#[derive(Debug, Clone)]
pub struct Verdict {
    pub target: String,
    pub measured: String,
    pub met: bool,
}

/// A table of `verdicts` under `heading` (the first column's title).
pub fn verdict_table(heading: &str, verdicts: &[Verdict]) -> String {
    let mut s = format!("| {heading} | measured | met |\n|---|---|---|\n");
    for v in verdicts {
        let met = if v.met { "yes" } else { "**no**" };
        let _ = writeln!(s, "| {} | {} | {met} |", v.target, v.measured);
    }
    s
}

impl Report {
    fn row(&self, server: Server, call: Call, clients: usize) -> Option<&Row> {
        self.matrix
            .as_ref()?
            .rows
            .iter()
            .find(|r| r.server == server && r.call == call && r.clients == clients)
    }

    fn throughput(&self, server: Server, call: Call, clients: usize) -> Option<f64> {
        self.row(server, call, clients)
            .map(|r| r.best().throughput())
    }

    fn ratio(&self, server: Server, base: Server, call: Call, clients: usize) -> Option<f64> {
        let a = self.throughput(server, call, clients)?;
        let b = self.throughput(base, call, clients)?;
        (b > 0.0).then(|| a / b)
    }

    /// Every target, judged from this run's numbers.
    pub fn verdicts(&self) -> Vec<Verdict> {
        let mut out = Vec::new();
        let plural = |clients: usize| if clients == 1 { "" } else { "s" };
        let clean = |call, clients| {
            [Server::Loopback, Server::Stock].iter().all(|s| {
                // A server left out of this run has no errors to count.
                self.row(*s, call, clients)
                    .is_none_or(|row| row.errors() == 0)
            })
        };
        let with_errors = |call, clients| {
            if clean(call, clients) {
                ""
            } else {
                " (with errors)"
            }
        };
        let ratio_target = |call: Call, clients: usize, min: f64| {
            let r = self.ratio(Server::Loopback, Server::Stock, call, clients)?;
            Some(Verdict {
                target: format!(
                    "loopback ≥ {min}× stock rmcp, {}, {clients} client{}",
                    call.label(),
                    plural(clients)
                ),
                measured: format!("{r:.2}×{}", with_errors(call, clients)),
                met: r >= min && clean(call, clients),
            })
        };
        // Server CPU per request, the matrix's column: loopback minus stock.
        let cpu = |server, call, clients| {
            self.row(server, call, clients)
                .map(|r| r.best().server_cpu_per_request().as_secs_f64() * 1e6)
        };
        let cpu_target = |call: Call, clients: usize| {
            let ours = cpu(Server::Loopback, call, clients)?;
            let stock = cpu(Server::Stock, call, clients)?;
            let extra = ours - stock;
            Some(Verdict {
                target: format!(
                    "loopback server CPU per request − stock rmcp's ≤ 2 µs, {}, {clients} client{}",
                    call.label(),
                    plural(clients)
                ),
                measured: format!(
                    "{ours:.1} − {stock:.1} = {extra:+.1} µs{}",
                    with_errors(call, clients)
                ),
                met: extra <= 2.0 && clean(call, clients),
            })
        };
        let cells = [
            (Call::Ping, 1),
            (Call::Ping, 32),
            (Call::ToolsCall, 1),
            (Call::ToolsCall, 32),
        ];
        out.extend(cells.iter().filter_map(|&(c, n)| ratio_target(c, n, 0.95)));
        // The physical limit here: a bare hyper server answering a fixed body.
        out.extend([1, 32].iter().filter_map(|&n| {
            let r = self.ratio(Server::Loopback, Server::Hello, Call::Ping, n)?;
            Some(Verdict {
                target: format!("loopback ≥ 0.8× hyper hello, ping, {n} client{}", plural(n)),
                measured: format!("{r:.2}×{}", with_errors(Call::Ping, n)),
                met: r >= 0.8 && clean(Call::Ping, n),
            })
        }));
        out.extend(cells.iter().filter_map(|&(c, n)| cpu_target(c, n)));
        out.extend(
            [1, 32]
                .iter()
                .filter_map(|&n| ratio_target(Call::ToolsList, n, 1.5)),
        );
        for level in self
            .flood
            .iter()
            .filter(|l| (l.valid_rate - 500.0).abs() < 0.5)
        {
            let flood = level.valid_rate * 10.0;
            let kind = forgeries(level);
            out.push(Verdict {
                target: format!(
                    "bad-token flood at {flood:.0}/s ({kind}): valid p99 ≤ 2× unloaded p99 (valid client {:.0}/s, same address)",
                    level.valid_rate
                ),
                measured: format!(
                    "{:.3} ms vs {:.3} ms: {:.2}×",
                    ms(level.loaded.latencies.percentile(99.0)),
                    ms(level.unloaded.latencies.percentile(99.0)),
                    level.p99_ratio()
                ),
                met: level.p99_ratio() <= 2.0,
            });
            out.push(Verdict {
                target: format!(
                    "bad-token flood at {flood:.0}/s ({kind}): the valid client keeps 100% success"
                ),
                measured: format!(
                    "{}/{} and {}/{} answered 200 with a result (unloaded, flooded)",
                    level.unloaded.ok, level.unloaded.sent, level.loaded.ok, level.loaded.sent
                ),
                met: level.all_valid_succeeded(),
            });
        }
        if let Some(f) = &self.figures {
            let mib = |kib: u64| kib as f64 / 1024.0;
            let memory = |name: &str, kib: u64, max: f64| Verdict {
                target: format!("{name} ≤ {max:.0} MiB"),
                measured: if kib == 0 {
                    "(not read)".into()
                } else {
                    format!("{:.1} MiB", mib(kib))
                },
                met: kib > 0 && mib(kib) <= max,
            };
            out.push(memory(
                "idle RSS (loopback daemon, just started)",
                f.memory.idle,
                16.0,
            ));
            out.push(memory(
                "RSS after 10 000 requests",
                f.memory.after_requests,
                20.0,
            ));
            if let Some(st) = f.starts.first() {
                let median = st.median();
                out.push(Verdict {
                    target: format!("start to `READY=1` median ≤ 30 ms ({})", st.config),
                    measured: format!("{:.1} ms", ms(median)),
                    met: !st.samples.is_empty() && median <= Duration::from_millis(30),
                });
            }
        }
        out
    }

    /// The whole page.
    pub fn markdown(&self) -> String {
        let mut s = String::new();
        let m = &self.machine;
        let _ = writeln!(
            s,
            "# Benchmarks\n\n\
             Throughput, latency and process figures of robota-mcpd next to two baselines, \
             all driven by the same load generator in the same run. This page is written by \
             `robota-bench` (crate `bench/`); the numbers below are from its last run.\n\n\
             ## Command\n\n\
             ```text\n{COMMAND}\n```\n\n\
             The whole run took {:.0} s. `robota-bench --help` lists the knobs (cell duration, \
             warm-up, rounds, flood rates) and a selection of servers, requests and parts for \
             profiling one cell (`--servers loopback --calls list --clients 32 --parts matrix \
             --duration 20`; the server pids are printed on stderr for `perf record -p`).\n\n\
             ## Machine\n\n\
             | | |\n|---|---|\n\
             | CPUs (`nproc`) | {} |\n| CPU model | {} |\n| memory | {} |\n| kernel | {} |\n\
             | rustc | {} |\n| daemon source | {} |\n| date | {} |\n\
             | other processes' CPU use just before the run | {:.0}% of the machine |\n",
            self.elapsed.as_secs_f64(),
            m.nproc,
            m.cpu_model,
            m.memory,
            m.kernel,
            m.rustc,
            m.source,
            m.date,
            self.foreign_before * 100.0
        );
        if let Some(matrix) = &self.matrix {
            s.push_str(&self.method(matrix));
            s.push_str("## Throughput and latency\n\n");
            s.push_str(&self.table(matrix));
            if let Some(opaque) = &matrix.opaque {
                s.push_str(&self.opaque_table(matrix, opaque));
            }
        }
        if let Some(upstream) = &self.upstream {
            s.push_str(&upstream.markdown());
        }
        let verdicts = self.verdicts();
        if !verdicts.is_empty() {
            s.push_str("\n## Targets\n\n");
            s.push_str(&verdict_table("target", &verdicts));
            s.push('\n');
        }
        if !self.flood.is_empty() {
            s.push_str(&self.flood_section());
        }
        if let Some(f) = &self.figures {
            s.push_str(&figures_section(f));
        }
        s.push_str("## Where the time goes\n\n");
        s.push_str(ANALYSIS.trim());
        s.push('\n');
        s
    }

    fn method(&self, matrix: &MatrixRun) -> String {
        let t = &matrix.timing;
        format!(
            "## Method\n\n\
             - **Servers**, each its own process with tokio's default multi-threaded runtime, each in a cgroup of its own (the unified hierarchy, and the v1 memory and pids ones where the host keeps them there — where the daemon must run to bound its upstreams, and whose memory controller then accounts every process's kernel allocations):\n\
             \x20 - *hyper hello*: plain hyper 1.x HTTP/1.1 that reads the body and answers a \
             fixed 50-byte JSON-RPC result — the ceiling for any HTTP server here;\n\
             \x20 - *stock rmcp 3.11*: rmcp's stateless Streamable HTTP service \
             (`StreamableHttpService`, `NeverSessionManager`, `with_legacy_session_mode(false)`, \
             `with_json_response(true)`) on hyper's plain HTTP/1.1 server (the daemon uses \
             hyper-util's HTTP/1.1 + h2c builder with head deadlines), no admission; its tool list \
             is the daemon's own `tools/list` result ({} tools, {} bytes) and its `system.info` \
             does the daemon tool's work — the ceiling for the SDK;\n\
             \x20 - *robota-mcpd loopback*: the shipped binary (the `dist` build; *daemon source* above \
             says which build this run measured) with the default loopback \
             configuration, started as the end-to-end tests start it, host bearer from \
             `robota-mcpctl bearer issue`;\n\
             \x20 - *robota-mcpd remote*: the same binary with a plain-HTTP `[remote]` listener \
             (as behind a TLS-terminating proxy), `public_url = \"https://mcp.example.com/mcp\"`, \
             `max_connections_per_address = 64` (every client connects from 127.0.0.1, as \
             every client behind one proxy would; the default cap of 16 would have the \
             32-client cells' connections evict each other), \
             `jwks_file` with four ES256 keys, requests carrying `Host: mcp.example.com` and \
             ES256 access tokens signed in turn by the four keys. *cached JWT*: each client \
             keeps one token, so after its first request the daemon's verified-token cache \
             answers; *fresh JWT*: every request carries the next token of a pool of {} \
             distinct tokens ({} sent in all), so a token comes back only after {} others, \
             far more than the 10 000 the verified-token cache holds (oldest evicted first): \
             every request is verified in full.\n\
             {}\
             - **Requests**: `POST /mcp` with `Content-Type: application/json`, `Accept: \
             application/json, text/event-stream`, `MCP-Protocol-Version: 2025-11-25` and the \
             JSON-RPC body `ping` (answered with an empty result, `{{}}`; hyper hello answers \
             its fixed result), `tools/list` or `tools/call` of `system.info` — the same bytes to \
             every server except `Host` and `Authorization`. `system.info` needs no store, \
             D-Bus or Docker, but it is not free: a hostname, `uname`, `sysinfo`, \
             `available_parallelism()` (which reads cgroup files) and two small file reads, \
             5 `openat` and 17 `read` calls in all; the daemon's own \
             `robota_mcpd_tool_call_duration_seconds` histogram puts it at {} on average \
             (session, policy and argument validation included).\n\
             - **Load generator** (`bench/src/load.rs`): tokio + hyper 1 client connections, \
             keep-alive HTTP/1.1, TCP_NODELAY, each client sending its next request when the \
             previous answer is read. Every answer must be 200 with a JSON-RPC `result` and no \
             `isError: true` (byte checks on every answer, a full JSON parse of every 64th); \
             anything else is an error and is counted.\n\
             - **Cells**: {:.0} s warm-up, then {:.0} s measured, per (server, request, clients); \
             all servers of one (request, clients) group run back to back; {} rounds, the best \
             round is shown and *spread* is how far the other round fell below it; a cell \
             during which other processes used more than 15% of the machine is run once more \
             (for at most 12 cells per run) and the quieter attempt kept. Latency is \
             per request (send to whole answer read), exact percentiles of every sample in the \
             window. *Server CPU* is the server process's user + system time over the window \
             divided by answers; the load generator shares the {} CPUs with the server, so a \
             server that needs less CPU per request leaves more for the generator and the \
             throughput ratios understate CPU-cost ratios.\n\n",
            matrix.tool_count,
            matrix.tools_list_bytes,
            matrix.pool.0,
            matrix.pool.1,
            matrix.pool.0.saturating_sub(1),
            matrix
                .opaque
                .as_ref()
                .map(|o| self.opaque_method(o))
                .unwrap_or_default(),
            matrix.tool_mean.map_or_else(
                || "(not read)".into(),
                |d| format!("{:.1} µs", d.as_secs_f64() * 1e6)
            ),
            t.warmup.as_secs_f64(),
            t.duration.as_secs_f64(),
            t.rounds,
            self.machine.nproc,
        )
    }

    fn table(&self, matrix: &MatrixRun) -> String {
        let mut s = String::from(
            "| request | clients | server | req/s | p50 ms | p99 ms | server CPU µs/req | generator CPU µs/req | errors | spread | other CPU (steal) | × stock rmcp | × hyper hello | × loopback |\n\
             |---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
        );
        let fmt_ratio = |r: Option<f64>| r.map_or_else(|| "—".into(), |r| format!("{r:.2}"));
        for row in &matrix.rows {
            let b: &CellResult = row.best();
            let (call, clients) = (row.call, row.clients);
            let vs_stock = match row.server {
                Server::Hello | Server::Stock => None,
                s => self.ratio(s, Server::Stock, call, clients),
            };
            let vs_hello = match row.server {
                Server::Hello => None,
                s => self.ratio(s, Server::Hello, call, clients),
            };
            let vs_loopback = row
                .server
                .is_remote()
                .then(|| self.ratio(row.server, Server::Loopback, call, clients))
                .flatten();
            let errors = row.errors();
            let _ = writeln!(
                s,
                "| {} | {} | {} | {:.0} | {:.3} | {:.3} | {:.0} | {:.0} | {} | {:.0}% | {:.0}% ({:.0}%) | {} | {} | {} |",
                call.label(),
                clients,
                row.server.label(),
                b.throughput(),
                ms(b.latencies.percentile(50.0)),
                ms(b.latencies.percentile(99.0)),
                b.server_cpu_per_request().as_secs_f64() * 1e6,
                b.generator_cpu_per_request().as_secs_f64() * 1e6,
                if errors == 0 {
                    "0".to_owned()
                } else {
                    format!("**{errors}**")
                },
                row.spread(),
                b.cpu.foreign * 100.0,
                b.cpu.steal * 100.0,
                fmt_ratio(vs_stock),
                fmt_ratio(vs_hello),
                fmt_ratio(vs_loopback),
            );
        }
        let errors: Vec<String> = matrix
            .rows
            .iter()
            .filter_map(|r| {
                r.first_error().map(|e| {
                    format!(
                        "- {} {} {} clients: {e}",
                        r.server.label(),
                        r.call.label(),
                        r.clients
                    )
                })
            })
            .collect();
        let noisy = matrix
            .rows
            .iter()
            .filter(|r| r.best().cpu.foreign > NOISY)
            .count();
        if noisy > 0 {
            let _ = writeln!(
                s,
                "\n**{noisy} of {} cells ran while other processes used more than {:.0}% of the \
                 machine: their numbers are pessimistic.**",
                matrix.rows.len(),
                NOISY * 100.0
            );
        }
        if errors.is_empty() {
            s.push_str("\nEvery answer of every cell was 200 with a JSON-RPC result.\n");
        } else {
            s.push_str("\n**This run had errors** (first of each cell):\n\n");
            s.push_str(&errors.join("\n"));
            s.push('\n');
        }
        s.push_str(
            "\n*other CPU*: CPU time used by processes other than the server and the load \
             generator during the window, as a share of the machine (a CI run, for instance); \
             *steal*: time the hypervisor gave our vCPUs to someone else. A high value of either \
             makes that cell pessimistic.\n",
        );
        s
    }

    /// The bullet of the Method list for the opaque-token servers.
    fn opaque_method(&self, o: &OpaqueRun) -> String {
        format!(
            "\x20 - *robota-mcpd remote, opaque*: the same binary and listener settings, its \
             `[remote]` issuer the \
             end-to-end tests' authorization server: oidc-provider {} (npm, pinned by \
             `tests/oidc/package-lock.json`) run by `tests/oidc/server.mjs` under Node {} on \
             127.0.0.1, HTTPS with a test CA, on the same {} CPUs as the daemon and the load \
             generator. The daemon discovers its keys and introspection endpoint from its \
             metadata; `public_url = \"https://mcp.test.example/mcp\"` (requests carry `Host: \
             mcp.test.example`) and `[remote.introspection]` with the daemon's own client \
             credentials (`client_secret_basic`). Each client of a cell keeps its own opaque \
             access token, one of {} got from the provider before the matrix (client \
             credentials, scope `mcp`, resource the public URL, lifetime {:.0} h), and the \
             daemon asks the introspection endpoint about it (an HTTPS POST on a pooled \
             keep-alive connection, at most 16 at once). *opaque cached*: `cache = \"{}\"`, so \
             a token is introspected on its first request and the answer reused for that long \
             (over the whole matrix, this daemon asked the endpoint {}); *opaque \
             uncached*: `cache = \"{}\"`, so every request waits for one introspection round \
             trip before it is admitted (this daemon asked {}). The uncached cells are \
             bounded by the provider's introspection — one Node process, competing for the \
             same CPUs with the daemon and the generator — not by the daemon alone. {}\n",
            o.provider_version,
            o.node_version,
            self.machine.nproc,
            o.tokens,
            o.token_ttl_secs as f64 / 3600.0,
            o.cached,
            outcomes(&o.introspections_cached),
            o.uncached,
            outcomes(&o.introspections_uncached),
            if o.provider_cpu_read {
                "*Provider CPU* (the table after the main one) is the Node process's user + \
                 system time over the window divided by answers; it is neither in *server CPU* \
                 nor in *other CPU*."
            } else {
                "The provider's pid was not known: its CPU time was not read, and counts as \
                 *other CPU*."
            },
        )
    }

    /// The opaque-token cells next to the JWT cells of the same (request, clients).
    fn opaque_table(&self, matrix: &MatrixRun, o: &OpaqueRun) -> String {
        let mut s = String::from(
            "\n### Opaque tokens next to JWTs\n\n\
             The remote rows of the table above, with ratios to the cached-JWT cell of the \
             same request and clients. *provider CPU* is oidc-provider's (Node) per answered \
             request; *server + provider* is what one admitted request costs both.\n\n\
             | request | clients | server | req/s | × cached JWT | p50 ms | p99 ms | server CPU µs/req | provider CPU µs/req | server + provider µs/req | errors |\n\
             |---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|\n",
        );
        let order = [
            Server::RemoteCached,
            Server::RemoteUncached,
            Server::RemoteOpaqueCached,
            Server::RemoteOpaqueUncached,
        ];
        let mut groups: Vec<(Call, usize)> = matrix
            .rows
            .iter()
            .filter(|r| r.server.is_opaque())
            .map(|r| (r.call, r.clients))
            .collect();
        groups.dedup();
        for (call, clients) in groups {
            for server in order {
                let Some(row) = self.row(server, call, clients) else {
                    continue;
                };
                let b = row.best();
                let us = |d: Duration| d.as_secs_f64() * 1e6;
                let provider = (server.is_opaque() && o.provider_cpu_read)
                    .then(|| us(b.helper_cpu_per_request()));
                let vs_jwt = match server {
                    Server::RemoteCached => "1".to_owned(),
                    s => self
                        .ratio(s, Server::RemoteCached, call, clients)
                        .map_or_else(|| "—".into(), |r| format!("{r:.2}")),
                };
                let errors = row.errors();
                let _ = writeln!(
                    s,
                    "| {} | {} | {} | {:.0} | {} | {:.3} | {:.3} | {:.0} | {} | {:.0} | {} |",
                    call.label(),
                    clients,
                    server.label(),
                    b.throughput(),
                    vs_jwt,
                    ms(b.latencies.percentile(50.0)),
                    ms(b.latencies.percentile(99.0)),
                    us(b.server_cpu_per_request()),
                    provider.map_or_else(|| "—".into(), |p| format!("{p:.0}")),
                    us(b.server_cpu_per_request()) + provider.unwrap_or(0.0),
                    if errors == 0 {
                        "0".to_owned()
                    } else {
                        format!("**{errors}**")
                    },
                );
            }
        }
        s.push('\n');
        s
    }

    fn flood_section(&self) -> String {
        let mut s = String::from("## A flood of bad tokens\n\n");
        let _ = writeln!(
            s,
            "One keep-alive client sends `tools/call` with a valid (cached) token at a fixed \
             rate for {:.0} s alone and {:.0} s flooded (two alone and two flooded phases, \
             alternating, so that a change in the machine's other load does not fall on one \
             phase only): while flooded, 16 other connections from the same address \
             (127.0.0.1, no proxy) send ten times as many requests whose token names a \
             published key but carries another key's signature, and the daemon closes the \
             connection after each refusal. *16 replayed*: the flood cycles through 16 such \
             tokens, so the daemon does the full ES256 check of each once and then knows it as \
             a forgery (its digest); *fresh*: every bad request carries a forgery never sent \
             before, so every one costs a full ES256 check — in the daemon's lane of one, off \
             the request workers, once the address is over its budget. The daemon runs the \
             remote listener's defaults except `max_connections_per_address = 64` (the \
             flood's 16 connections and the valid client's all come from 127.0.0.1; with the \
             default 16, a full cap makes the oldest idle connection give way, which can be \
             the valid client's between two of its requests — the cap is not what this \
             measures). The default \
             throttle (20 failures per 60 s per address) answers the flood 429 after its 20th \
             failure; valid tokens are verified before the throttle is consulted and are never \
             throttled, so \"100% success\" means every valid request is answered 200 with a \
             result while the same address is being throttled. A slot the valid client could \
             not keep because its previous answer was still outstanding is skipped, so *valid \
             sent* may fall short of rate × time.\n",
            self.flood_duration.as_secs_f64(),
            self.flood_duration.as_secs_f64()
        );
        s.push_str(
            "| valid rate | forgeries | phase | valid sent | valid OK | p50 ms | p99 ms | max ms | flood sent (rate) | flood 401 | flood 429 | flood other | other CPU |\n\
             |---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
        );
        for level in &self.flood {
            let phases = [
                ("alone", &level.unloaded, level.foreign.0),
                ("flooded", &level.loaded, level.foreign.1),
            ];
            for (phase, r, foreign) in phases {
                let flood = (phase == "flooded").then_some(&level.flood);
                let count = |status: u16| {
                    flood.map_or_else(
                        || "—".into(),
                        |f| f.statuses.get(&status).copied().unwrap_or(0).to_string(),
                    )
                };
                let other = flood.map_or_else(
                    || "—".into(),
                    |f| {
                        let other: u64 = f
                            .statuses
                            .iter()
                            .filter(|(s, _)| **s != 401 && **s != 429)
                            .map(|(_, n)| n)
                            .sum();
                        (other + f.failed).to_string()
                    },
                );
                let _ = writeln!(
                    s,
                    "| {:.0}/s | {} | {} | {} | {} | {:.3} | {:.3} | {:.3} | {} | {} | {} | {} | {:.0}% |",
                    level.valid_rate,
                    forgeries(level),
                    phase,
                    r.sent,
                    r.ok,
                    ms(r.latencies.percentile(50.0)),
                    ms(r.latencies.percentile(99.0)),
                    ms(r.latencies.max()),
                    flood.map_or_else(|| "—".into(), |f| format!("{} ({:.0}/s)", f.sent, f.rate())),
                    count(401),
                    count(429),
                    other,
                    foreign * 100.0,
                );
            }
        }
        let problems: Vec<String> = self
            .flood
            .iter()
            .flat_map(|l| [&l.unloaded, &l.loaded, &l.flood])
            .filter_map(|r| r.first_error.clone())
            .collect();
        if !problems.is_empty() {
            let _ = writeln!(s, "\nFirst problems seen: {}", problems.join("; "));
        }
        s.push('\n');
        s
    }
}

/// How a flood level's bad tokens were made.
fn forgeries(level: &FloodLevel) -> &'static str {
    if level.fresh { "fresh" } else { "16 replayed" }
}

fn figures_section(f: &Figures) -> String {
    let mut s = String::from("## Process figures\n\n");
    s.push_str(
        "Start to `READY=1`: from just before the harness spawns the daemon (its temp \
         directory and config written first) to the `READY=1` datagram on the notify \
         socket; each start is a fresh state directory (new SQLite store).\n\n\
         | configuration | median | min | max | starts |\n|---|---:|---:|---:|---:|\n",
    );
    for st in &f.starts {
        let _ = writeln!(
            s,
            "| {} | {:.1} ms | {:.1} ms | {:.1} ms | {} |",
            st.config,
            ms(st.median()),
            ms(st.min()),
            ms(st.max()),
            st.samples.len()
        );
    }
    let m = &f.memory;
    let mib = |kib: u64| format!("{:.1} MiB", kib as f64 / 1024.0);
    let _ = writeln!(
        s,
        "\nResident memory (`VmRSS`) of one loopback daemon through a sequence:\n\n\
         | state | RSS |\n|---|---:|\n\
         | idle, just started | {} |\n\
         | after its first request | {} |\n\
         | with 64 open idle connections (one request each) | {} |\n\
         | after 10 000 more requests (5 000 `tools/call`, 5 000 `tools/list`, 32 clients) | {} |\n\
         | with 64 open idle connections again | {} |\n\n\
         64 idle connections cost {:.1} KiB each on the daemon warmed by one request (the \
         difference to the row above them, divided by 64); after the 10 000 requests they \
         cost {:.1} KiB each, the memory of the load's 32 connections being reused. The \
         connections are read while idle, then each sends one more request on the same \
         connection to prove it was still open. The loopback default `max_connections = 64` \
         is exactly this many, and the head deadline (`header_timeout`, 5 s) closes a \
         keep-alive connection idle for longer.\n",
        mib(m.idle),
        mib(m.after_first_request),
        mib(m.with_idle_connections),
        mib(m.after_requests),
        mib(m.with_idle_connections_after),
        (m.with_idle_connections as f64 - m.after_first_request as f64) / 64.0,
        (m.with_idle_connections_after as f64 - m.after_requests as f64) / 64.0,
    );
    if !m.failures.is_empty() {
        let _ = writeln!(s, "Problems: {}\n", m.failures.join("; "));
    }
    let g = &f.growth;
    let statuses = |i: usize| {
        g.statuses[i]
            .iter()
            .map(|(k, v)| format!("{v}× {k}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let per = g.bytes_per_address();
    let _ = writeln!(
        s,
        "Memory per throttle-tracked address, by difference, on a remote daemon that trusts \
         127.0.0.1 as a proxy, with `[remote.throttle] max_addresses = {max}` so that no \
         address is evicted: requests without a token (each a counted failure of its \
         `X-Forwarded-For` address, refused 401, or 429 once that address is over budget), \
         RSS read after each step:\n\n\
         | step | answers | RSS |\n|---|---|---:|\n\
         | 30 000 from one address (fills the 10 000-record in-memory audit ring, lets \
         the allocator settle) | {} | {} |\n\
         | {n} more from that same address (control) | {} | {} |\n\
         | {n} from {n} distinct addresses | {} | {} |\n\
         | {n} more from the first address (control) | {} | {} |\n\n\
         Growth per tracked address = (step 3's growth − the control steps' mean growth) / \
         {n} = ({:.0} KiB − {:.0} KiB) / {n} = **{:.0} bytes** (the hash-table entry — \
         address, window start, count — and the table's spare capacity; it grows by \
         doubling, so this is an average). The default `max_addresses = 4096` bounds the \
         table at about {:.0} KiB.\n",
        statuses(0),
        mib(g.rss[0]),
        statuses(1),
        mib(g.rss[1]),
        statuses(2),
        mib(g.rss[2]),
        statuses(3),
        mib(g.rss[3]),
        g.distinct_kib(),
        g.control_kib(),
        per,
        per * 4096.0 / 1024.0,
        n = g.addresses,
        max = g.max_addresses,
    );
    if !g.failures.is_empty() {
        let _ = writeln!(s, "Problems: {}\n", g.failures.join("; "));
    }
    s
}
