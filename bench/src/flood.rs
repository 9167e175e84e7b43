//! A flood of bad tokens against the remote carrier, from the same address as a valid
//! client: the valid client's success and latency with and without the flood.
//!
//! The flood sends tokens that name a published key but carry another key's signature:
//! either the same 16 again and again (the daemon checks each once and then remembers the
//! forgery), or a fresh one every request (every one costs a full ES256 verification, in
//! the daemon's lane of one once the address is over budget); after 20 failures in 60 s
//! the address is over budget and the flood gets 429 instead of 401.
//! The carrier verifies before it consults the throttle, so the valid client on the same
//! address must keep getting 200: that is what "100% success" means here, and the
//! statuses of both streams are the evidence.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use http::HeaderValue;

use crate::load::{self, Auth, Pace, PacedResult, Template};
use crate::mcpd::PUBLIC_HOST;
use crate::procfs::CpuMark;

/// Connections the flood is spread over (each bad request gets a new one: the daemon
/// closes the connection after a refusal).
const FLOOD_TASKS: usize = 16;
/// The flood starts this long before the valid client's window, so that the window sees
/// the address throttled from its first request.
const FLOOD_LEAD: Duration = Duration::from_millis(500);

/// The valid client with and without the flood, and the flood itself.
#[derive(Debug, Clone)]
pub struct FloodLevel {
    pub valid_rate: f64,
    /// Every bad request carried a token never sent before.
    pub fresh: bool,
    pub unloaded: PacedResult,
    pub loaded: PacedResult,
    pub flood: PacedResult,
    /// Other processes' share of the machine during the unloaded and the flooded phases.
    pub foreign: (f64, f64),
}

impl FloodLevel {
    /// Every valid request answered 200 with a result, in both phases.
    pub fn all_valid_succeeded(&self) -> bool {
        [&self.unloaded, &self.loaded]
            .iter()
            .all(|r| r.sent > 0 && r.ok == r.sent && r.failed == 0)
    }

    /// Loaded p99 over unloaded p99.
    pub fn p99_ratio(&self) -> f64 {
        let unloaded = self.unloaded.latencies.percentile(99.0).as_secs_f64();
        let loaded = self.loaded.latencies.percentile(99.0).as_secs_f64();
        if unloaded > 0.0 {
            loaded / unloaded
        } else {
            f64::INFINITY
        }
    }
}

/// Alone and flooded phases alternate this many times (each `duration / PAIRS` long), so
/// that a change in the machine's other load does not fall on one phase only.
const PAIRS: u32 = 2;

/// Bad tokens a fresh-forgery level sends at most (each flood phase runs
/// `duration / PAIRS` plus twice the lead), with a tenth to spare.
pub fn tokens_needed(valid_rate: f64, duration: Duration) -> usize {
    let phase = (duration / PAIRS + FLOOD_LEAD * 2).as_secs_f64();
    (valid_rate * 10.0 * phase * f64::from(PAIRS) * 1.1).ceil() as usize
}

/// One level: `valid_rate` requests/s from one keep-alive client with a (cached) valid
/// token, alone and under `10 × valid_rate` bad-token requests/s from the same address,
/// alternating; `duration` is the total per phase.
pub async fn run_level(
    addr: SocketAddr,
    pid: i32,
    valid_token: HeaderValue,
    bad_tokens: Vec<HeaderValue>,
    fresh: bool,
    valid_rate: f64,
    duration: Duration,
) -> FloodLevel {
    let body = load::tools_call_body();
    let valid = Arc::new(Template::new(
        addr,
        PUBLIC_HOST,
        body.clone(),
        Auth::PerClient(Arc::new(vec![valid_token])),
    ));
    let bad_auth = if fresh {
        Auth::Pool(Arc::new(load::TokenPool::new(bad_tokens)))
    } else {
        Auth::PerClient(Arc::new(bad_tokens))
    };
    let bad = Arc::new(Template::new(addr, PUBLIC_HOST, body, bad_auth));
    let valid_pace = Pace {
        rate: valid_rate,
        tasks: 1,
        duration: duration / PAIRS,
        check: true,
        fresh_connections: false,
    };
    let flood_pace = Pace {
        rate: valid_rate * 10.0,
        tasks: FLOOD_TASKS,
        duration: duration / PAIRS + FLOOD_LEAD * 2,
        check: false,
        fresh_connections: true,
    };
    // Warm the connection path and the verified-token cache.
    let _ = load::paced(
        valid.clone(),
        Pace {
            duration: Duration::from_secs(1),
            ..valid_pace
        },
    )
    .await;
    let mut level = FloodLevel {
        valid_rate,
        fresh,
        unloaded: PacedResult::default(),
        loaded: PacedResult::default(),
        flood: PacedResult::default(),
        foreign: (0.0, 0.0),
    };
    for _ in 0..PAIRS {
        let mark = CpuMark::now(Some(pid));
        let alone = load::paced(valid.clone(), valid_pace).await;
        level.foreign.0 += CpuMark::now(Some(pid)).share_since(&mark).foreign / f64::from(PAIRS);
        level.unloaded.merge(alone);

        let flood = tokio::spawn(load::paced(bad.clone(), flood_pace));
        tokio::time::sleep(FLOOD_LEAD).await;
        let mark = CpuMark::now(Some(pid));
        let flooded = load::paced(valid.clone(), valid_pace).await;
        level.foreign.1 += CpuMark::now(Some(pid)).share_since(&mark).foreign / f64::from(PAIRS);
        level.loaded.merge(flooded);
        let flood = flood.await.unwrap_or_else(|e| panic!("flood task: {e}"));
        level.flood.merge(flood);
    }
    level
}
