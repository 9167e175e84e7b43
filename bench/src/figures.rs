//! Process figures of robota-mcpd: start to `READY=1`, resident memory idle, after 10k
//! requests and with 64 open idle connections, and the memory each throttle-tracked
//! client address costs.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use http::HeaderValue;
use robota_e2e::{Daemon, DaemonBuilder};

use crate::load::{self, Auth, IdleConnections, Template};
use crate::mcpd::{self, KeySet, PUBLIC_HOST};
use crate::procfs::rss_kib;

/// Starts per configuration for the median.
pub const STARTS: usize = 20;
/// Requests for the "after 10k requests" figure.
const REQUESTS: u64 = 10_000;
/// Idle connections held open (the loopback default `max_connections`).
const IDLE_CONNECTIONS: usize = 64;
/// Refusals sent first so that the in-memory audit ring (10 000 records) is full and
/// stops growing, and the allocator has settled.
const AUDIT_FILL: usize = 30_000;
/// How long memory is left to settle before a reading.
const SETTLE: Duration = Duration::from_millis(500);

/// Start-to-ready times of one configuration.
#[derive(Debug, Clone)]
pub struct StartTimes {
    pub config: &'static str,
    pub samples: Vec<Duration>,
}

impl StartTimes {
    pub fn median(&self) -> Duration {
        let mut s = self.samples.clone();
        s.sort();
        s.get(s.len() / 2).copied().unwrap_or_default()
    }

    pub fn min(&self) -> Duration {
        self.samples.iter().min().copied().unwrap_or_default()
    }

    pub fn max(&self) -> Duration {
        self.samples.iter().max().copied().unwrap_or_default()
    }
}

/// From just before the harness spawns the daemon (temp dir and config written first,
/// well under a millisecond) to the `READY=1` datagram arriving.
pub fn start_times(config: &'static str, builder: impl Fn() -> DaemonBuilder) -> StartTimes {
    let samples = (0..STARTS)
        .map(|_| {
            let b = builder();
            let t0 = Instant::now();
            let d = b.spawn();
            d.wait_ready(0);
            let dt = t0.elapsed();
            drop(d);
            dt
        })
        .collect();
    StartTimes { config, samples }
}

/// Resident memory of one loopback daemon through a sequence of loads, in KiB.
#[derive(Debug, Clone, Default)]
pub struct Memory {
    pub idle: u64,
    pub after_first_request: u64,
    pub with_idle_connections: u64,
    pub after_requests: u64,
    pub with_idle_connections_after: u64,
    pub failures: Vec<String>,
}

/// Memory readings on a fresh loopback daemon: idle; after one request; with 64 idle
/// connections open; after 10k `tools/call` + `tools/list` requests from 32 clients;
/// with 64 idle connections again.
pub fn memory(rt: &tokio::runtime::Runtime) -> Memory {
    let d = mcpd::loopback_daemon();
    let auth = Auth::PerClient(Arc::new(vec![mcpd::host_bearer(&d)]));
    let addr = d.loopback_addr();
    let pid = d.pid();
    let list = Arc::new(Template::local(addr, load::tools_list_body(), auth.clone()));
    let call = Arc::new(Template::local(addr, load::tools_call_body(), auth));
    let mut m = Memory::default();
    std::thread::sleep(SETTLE * 2);
    m.idle = rss_kib(pid).unwrap_or(0);
    let (_, failed, first) = rt.block_on(load::fixed_count(list.clone(), 1, 1));
    note(&mut m.failures, "first request", failed, first);
    std::thread::sleep(SETTLE);
    m.after_first_request = rss_kib(pid).unwrap_or(0);
    m.with_idle_connections = idle_connections(rt, &list, pid, &mut m.failures);
    // The idle connections are closed now; let the daemon notice before the next load.
    std::thread::sleep(SETTLE);
    let (_, failed, first) = rt.block_on(load::fixed_count(call, 32, REQUESTS / 2));
    note(&mut m.failures, "tools/call", failed, first);
    let (_, failed, first) = rt.block_on(load::fixed_count(list.clone(), 32, REQUESTS / 2));
    note(&mut m.failures, "tools/list", failed, first);
    std::thread::sleep(SETTLE);
    m.after_requests = rss_kib(pid).unwrap_or(0);
    m.with_idle_connections_after = idle_connections(rt, &list, pid, &mut m.failures);
    m
}

/// Opens 64 connections (one request each), reads RSS while they idle, checks that all
/// are still open, closes them.
fn idle_connections(
    rt: &tokio::runtime::Runtime,
    template: &Arc<Template>,
    pid: i32,
    failures: &mut Vec<String>,
) -> u64 {
    rt.block_on(async {
        let opened = tokio::time::timeout(
            Duration::from_secs(10),
            IdleConnections::open(template.clone(), IDLE_CONNECTIONS),
        )
        .await;
        let mut conns = match opened {
            Ok(Ok(c)) => c,
            Ok(Err(e)) => {
                failures.push(format!("opening {IDLE_CONNECTIONS} connections: {e}"));
                return 0;
            }
            Err(_) => {
                failures.push(format!("opening {IDLE_CONNECTIONS} connections timed out"));
                return 0;
            }
        };
        tokio::time::sleep(SETTLE).await;
        let rss = rss_kib(pid).unwrap_or(0);
        if let Err(e) = conns.still_open().await {
            failures.push(e);
        }
        rss
    })
}

fn note(failures: &mut Vec<String>, what: &str, failed: u64, first: Option<String>) {
    if failed > 0 {
        failures.push(format!(
            "{what}: {failed} failed ({})",
            first.unwrap_or_default()
        ));
    }
}

/// Memory per throttle-tracked address, by difference: as many refusals from one address
/// (control, before and after) as from distinct addresses, after the audit ring is full.
#[derive(Debug, Clone, Default)]
pub struct ThrottleGrowth {
    /// RSS (KiB) after each step: audit ring filled, control, distinct addresses, control.
    pub rss: [u64; 4],
    pub addresses: usize,
    /// The `max_addresses` the daemon ran with (raised so that no address is evicted).
    pub max_addresses: usize,
    /// Statuses of each step.
    pub statuses: [BTreeMap<u16, u64>; 4],
    pub failures: Vec<String>,
}

impl ThrottleGrowth {
    fn kib(&self, step: usize) -> f64 {
        self.rss[step] as f64 - self.rss[step - 1] as f64
    }

    /// KiB the control steps added, on average.
    pub fn control_kib(&self) -> f64 {
        (self.kib(1) + self.kib(3)) / 2.0
    }

    /// KiB the distinct addresses added.
    pub fn distinct_kib(&self) -> f64 {
        self.kib(2)
    }

    /// Bytes per tracked address: (distinct − mean control) / addresses.
    pub fn bytes_per_address(&self) -> f64 {
        (self.distinct_kib() - self.control_kib()) * 1024.0 / self.addresses.max(1) as f64
    }
}

/// Distinct addresses in the measured step.
const ADDRESSES: usize = 20_000;
/// `[remote.throttle] max_addresses` for the measurement: above [`ADDRESSES`].
const MAX_ADDRESSES: usize = 65_536;

/// A remote daemon trusting `127.0.0.1` as a proxy, `max_addresses` raised above the
/// number of addresses sent; refusals without a token carry `X-Forwarded-For` addresses,
/// each counted as a failure of that address.
pub fn throttle_growth(rt: &tokio::runtime::Runtime, keys: &KeySet) -> ThrottleGrowth {
    let d: Daemon = keys
        .remote_config(&["127.0.0.1"])
        .max_addresses(MAX_ADDRESSES)
        .builder()
        .start();
    let pid = d.pid();
    let template = Arc::new(Template::new(
        d.remote_addr(),
        PUBLIC_HOST,
        load::tools_call_body(),
        Auth::None,
    ));
    let one = |n: usize| -> Vec<HeaderValue> { vec![HeaderValue::from_static("198.51.100.7"); n] };
    let distinct: Vec<HeaderValue> = (0..ADDRESSES)
        .map(|i| {
            let text = format!("10.{}.{}.{}", i / 65_536, (i / 256) % 256, i % 256);
            HeaderValue::from_str(&text).unwrap_or_else(|e| panic!("{text}: {e}"))
        })
        .collect();
    let steps = [one(AUDIT_FILL), one(ADDRESSES), distinct, one(ADDRESSES)];
    let mut g = ThrottleGrowth {
        addresses: ADDRESSES,
        max_addresses: MAX_ADDRESSES,
        ..ThrottleGrowth::default()
    };
    for (i, addresses) in steps.into_iter().enumerate() {
        let t0 = Instant::now();
        let n = addresses.len();
        let (statuses, failed, first) =
            rt.block_on(load::statuses(template.clone(), Arc::new(addresses), 8));
        eprintln!(
            "  throttle step {}: {n} refusals in {:.1} s",
            i + 1,
            t0.elapsed().as_secs_f64()
        );
        note(&mut g.failures, &format!("step {}", i + 1), failed, first);
        std::thread::sleep(SETTLE);
        g.rss[i] = rss_kib(pid).unwrap_or(0);
        g.statuses[i] = statuses;
    }
    g
}
