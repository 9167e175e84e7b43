//! Failure-only throttling per client, in fixed windows.
//!
//! The carrier verifies first and records only failures; a client that has failed
//! `failures` times in the current window gets 429 for its failing requests until the
//! window ends. A valid token is never throttled. A client is an IPv4 address (IPv4-mapped
//! IPv6 included) or an IPv6 prefix of `ipv6_prefix` bits (a /64 by default: one host
//! commonly holds a whole /64, so counting its addresses apart would hand it 2^64 budgets
//! and let it evict every other client). At most `max_addresses` windows are tracked:
//! expired ones are dropped first, then the oldest.
//!
//! A client over its budget still has its tokens verified (a valid JWT, or an opaque
//! token whose answer is cached, is admitted), but only [`INTROSPECTIONS_OVER_BUDGET`] of
//! its opaque tokens per window go to the issuer: a flood of random tokens from one
//! client costs the authorization server its budget and those few requests, no more.

use std::collections::HashMap;
use std::net::IpAddr;
use std::time::Instant;

use parking_lot::Mutex;

use crate::config::ThrottleConfig;

/// Opaque tokens of a client over its failure budget that are still introspected per
/// window (so a valid new token behind that address can get in).
pub const INTROSPECTIONS_OVER_BUDGET: u32 = 2;

/// Failures in a window after which a client counts as failing ([`Throttle::failing`]).
pub const FAILING_AFTER: u32 = 3;

#[derive(Debug, Clone, Copy)]
struct Window {
    start: Instant,
    failures: u32,
    /// Introspections granted while over budget.
    introspections: u32,
}

impl Window {
    fn new(start: Instant) -> Self {
        Self {
            start,
            failures: 1,
            introspections: 0,
        }
    }
}

pub struct Throttle {
    config: ThrottleConfig,
    windows: Mutex<HashMap<IpAddr, Window>>,
}

impl Throttle {
    pub fn new(config: ThrottleConfig) -> Self {
        Self {
            config,
            windows: Mutex::new(HashMap::new()),
        }
    }

    /// The client an address is counted as: the IPv4 address, or the IPv6 prefix.
    pub fn client(&self, addr: IpAddr) -> IpAddr {
        crate::vocab::address_group(addr, self.config.ipv6_prefix)
    }

    fn live(&self, w: &Window, now: Instant) -> bool {
        now.saturating_duration_since(w.start) < self.config.window
    }

    /// Seconds until the window ends (at least 1) if `addr` is over its failure budget.
    pub fn check(&self, addr: IpAddr, now: Instant) -> Option<u64> {
        let client = self.client(addr);
        self.left(self.windows.lock().get(&client)?, now)
    }

    /// Seconds until `w` ends (at least 1) if it is live and over the budget.
    fn left(&self, w: &Window, now: Instant) -> Option<u64> {
        if !self.live(w, now) || w.failures < self.config.failures {
            return None;
        }
        let left = self
            .config
            .window
            .saturating_sub(now.saturating_duration_since(w.start));
        Some(left.as_secs_f64().ceil().max(1.0) as u64)
    }

    /// Whether `addr` has failed at least [`FAILING_AFTER`] times in the current window:
    /// its connections give way first and its requests to the issuer wait behind those of
    /// clients that have not. (One refused token — a client's stale one — is not enough.)
    pub fn failing(&self, addr: IpAddr, now: Instant) -> bool {
        let client = self.client(addr);
        self.windows
            .lock()
            .get(&client)
            .is_some_and(|w| self.live(w, now) && w.failures >= FAILING_AFTER)
    }

    /// Whether one more of `addr`'s opaque tokens may go to the issuer now: always under
    /// the budget; over it, [`INTROSPECTIONS_OVER_BUDGET`] times per window (a `true`
    /// uses one).
    pub fn may_introspect(&self, addr: IpAddr, now: Instant) -> bool {
        let client = self.client(addr);
        let mut windows = self.windows.lock();
        let Some(w) = windows.get_mut(&client) else {
            return true;
        };
        if self.left(w, now).is_none() {
            return true;
        }
        if w.introspections < INTROSPECTIONS_OVER_BUDGET {
            w.introspections += 1;
            return true;
        }
        false
    }

    /// Count one failure for `addr` and say whether it was over its budget *before* this
    /// failure: `Some(seconds until the window ends)` when it is to be answered 429. One
    /// step under one lock: concurrent failures of one client are each judged against the
    /// ones counted before them, so no more than `failures` of them per window go unthrottled.
    pub fn fail(&self, addr: IpAddr, now: Instant) -> Option<u64> {
        let client = self.client(addr);
        let mut windows = self.windows.lock();
        if let Some(w) = windows.get_mut(&client) {
            if !self.live(w, now) {
                *w = Window::new(now);
                return None;
            }
            let over = self.left(w, now);
            w.failures = w.failures.saturating_add(1);
            return over;
        }
        if windows.len() >= self.config.max_addresses {
            windows.retain(|_, w| self.live(w, now));
        }
        if windows.len() >= self.config.max_addresses
            && let Some(oldest) = windows.iter().min_by_key(|(_, w)| w.start).map(|(a, _)| *a)
        {
            windows.remove(&oldest);
        }
        windows.insert(client, Window::new(now));
        None
    }

    pub fn tracked(&self) -> usize {
        self.windows.lock().len()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn throttle(max_addresses: usize) -> Throttle {
        Throttle::new(ThrottleConfig {
            failures: 3,
            window: Duration::from_secs(60),
            max_addresses,
            ipv6_prefix: 64,
        })
    }

    fn ip(n: u8) -> IpAddr {
        IpAddr::from([198, 51, 100, n])
    }

    #[test]
    fn over_budget_until_the_window_ends() {
        let t = throttle(16);
        let t0 = Instant::now();
        for n in 0..3 {
            assert_eq!(t.check(ip(1), t0), None);
            assert_eq!(
                t.fail(ip(1), t0),
                None,
                "failure {} is within the budget",
                n + 1
            );
        }
        assert_eq!(t.check(ip(1), t0), Some(60));
        assert_eq!(t.fail(ip(1), t0 + Duration::from_secs(15)), Some(45));
        assert_eq!(t.check(ip(1), t0 + Duration::from_millis(59_500)), Some(1));
        assert_eq!(t.check(ip(1), t0 + Duration::from_secs(45)), Some(15));
        assert_eq!(t.check(ip(2), t0), None, "another address is not affected");
        assert_eq!(
            t.check(ip(1), t0 + Duration::from_secs(60)),
            None,
            "a new window"
        );
        assert_eq!(
            t.fail(ip(1), t0 + Duration::from_secs(61)),
            None,
            "the first failure of a new window"
        );
        assert_eq!(t.check(ip(1), t0 + Duration::from_secs(61)), None);
    }

    #[test]
    fn concurrent_failures_are_judged_one_after_another() {
        // Many failures of one client at once: exactly the budget's worth go unthrottled,
        // however they interleave (judging before counting let them all through).
        let t = Throttle::new(ThrottleConfig {
            failures: 20,
            window: Duration::from_secs(60),
            max_addresses: 16,
            ipv6_prefix: 64,
        });
        let t0 = Instant::now();
        let barrier = std::sync::Barrier::new(8);
        let unthrottled: usize = std::thread::scope(|s| {
            let workers: Vec<_> = (0..8)
                .map(|_| {
                    s.spawn(|| {
                        barrier.wait();
                        (0..50).filter(|_| t.fail(ip(1), t0).is_none()).count()
                    })
                })
                .collect();
            workers.into_iter().map(|w| w.join().unwrap()).sum()
        });
        assert_eq!(unthrottled, 20);
    }

    #[test]
    fn failing_takes_a_few_failures_in_the_window() {
        let t = throttle(16);
        let t0 = Instant::now();
        for n in 1..=FAILING_AFTER {
            assert!(!t.failing(ip(1), t0), "after {} failures", n - 1);
            t.fail(ip(1), t0);
        }
        assert!(t.failing(ip(1), t0));
        assert!(
            !t.failing(ip(1), t0 + Duration::from_secs(60)),
            "a new window"
        );
        assert!(!t.failing(ip(2), t0));
    }

    #[test]
    fn tracking_is_bounded_expired_first_then_oldest() {
        let t = throttle(3);
        let t0 = Instant::now();
        t.fail(ip(1), t0);
        t.fail(ip(2), t0 + Duration::from_secs(10));
        t.fail(ip(3), t0 + Duration::from_secs(20));
        // ip(1)'s window has expired by t0+65: it goes first.
        t.fail(ip(4), t0 + Duration::from_secs(65));
        assert_eq!(t.tracked(), 3);
        for _ in 0..3 {
            t.fail(ip(3), t0 + Duration::from_secs(66));
        }
        // Nothing expired: the oldest (ip(2)) is evicted, ip(3)'s budget is kept.
        t.fail(ip(5), t0 + Duration::from_secs(66));
        assert_eq!(t.tracked(), 3);
        assert!(t.check(ip(3), t0 + Duration::from_secs(66)).is_some());
    }

    #[test]
    fn over_budget_a_few_introspections_per_window() {
        let t = throttle(16);
        let t0 = Instant::now();
        for _ in 0..3 {
            assert!(t.may_introspect(ip(1), t0), "under the budget: always");
            t.fail(ip(1), t0);
        }
        let granted = (0..10).filter(|_| t.may_introspect(ip(1), t0)).count();
        assert_eq!(granted, INTROSPECTIONS_OVER_BUDGET as usize);
        assert!(
            t.may_introspect(ip(2), t0),
            "another client is not affected"
        );
        let next = t0 + Duration::from_secs(60);
        assert!(t.may_introspect(ip(1), next), "a new window");
        // Over budget again in the new window: the allowance is new too.
        for _ in 0..3 {
            t.fail(ip(1), next);
        }
        let granted = (0..10).filter(|_| t.may_introspect(ip(1), next)).count();
        assert_eq!(granted, INTROSPECTIONS_OVER_BUDGET as usize);
    }

    fn ip6(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn ipv6_clients_are_counted_by_prefix() {
        let t0 = Instant::now();
        // (prefix, two addresses, counted as one client?)
        let cases: [(u8, &str, &str, bool); 9] = [
            (
                64,
                "2001:db8:1:2::1",
                "2001:db8:1:2:ffff:ffff:ffff:ffff",
                true,
            ),
            (64, "2001:db8:1:2::1", "2001:db8:1:3::1", false),
            (56, "2001:db8:1:2::1", "2001:db8:1:ff::1", true),
            (56, "2001:db8:1:2::1", "2001:db8:1:100::1", false),
            (128, "2001:db8::1", "2001:db8::2", false),
            (32, "2001:db8:1::1", "2001:db8:ffff::1", true),
            // IPv4 by the address, whatever the prefix; mapped IPv6 is IPv4.
            (32, "198.51.100.1", "198.51.100.2", false),
            (64, "198.51.100.1", "::ffff:198.51.100.1", true),
            (64, "::ffff:198.51.100.1", "::ffff:198.51.100.2", false),
        ];
        for (prefix, a, b, same) in cases {
            let t = Throttle::new(ThrottleConfig {
                failures: 3,
                window: Duration::from_secs(60),
                max_addresses: 16,
                ipv6_prefix: prefix,
            });
            for _ in 0..3 {
                t.fail(ip6(a), t0);
            }
            assert!(t.check(ip6(a), t0).is_some(), "/{prefix} {a}");
            assert_eq!(t.check(ip6(b), t0).is_some(), same, "/{prefix} {a} {b}");
        }
    }

    #[test]
    fn one_prefix_cannot_evict_the_table() {
        let t = throttle(4);
        let t0 = Instant::now();
        for _ in 0..3 {
            t.fail(ip(1), t0);
        }
        // 5000 addresses of one /64: one tracked client.
        for i in 0..5000u128 {
            let addr = std::net::Ipv6Addr::from(0x2001_0db8_0001_0002_0000_0000_0000_0000u128 + i);
            t.fail(IpAddr::V6(addr), t0 + Duration::from_secs(1));
        }
        assert_eq!(t.tracked(), 2);
        assert!(t.check(ip(1), t0 + Duration::from_secs(2)).is_some());
    }
}
