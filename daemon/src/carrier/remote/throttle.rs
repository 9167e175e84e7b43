//! Failure-only throttling per client address, in fixed windows.
//!
//! The carrier verifies first and records only failures; an address that has failed
//! `failures` times in the current window gets 429 for its failing requests until the
//! window ends. A valid token is never throttled. At most `max_addresses` windows are
//! tracked: expired ones are dropped first, then the oldest.

use std::collections::HashMap;
use std::net::IpAddr;
use std::time::Instant;

use parking_lot::Mutex;

use crate::config::ThrottleConfig;

#[derive(Debug, Clone, Copy)]
struct Window {
    start: Instant,
    failures: u32,
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

    fn live(&self, w: &Window, now: Instant) -> bool {
        now.saturating_duration_since(w.start) < self.config.window
    }

    /// Seconds until the window ends (at least 1) if `addr` is over its failure budget.
    pub fn check(&self, addr: IpAddr, now: Instant) -> Option<u64> {
        let windows = self.windows.lock();
        let w = windows.get(&addr)?;
        if !self.live(w, now) || w.failures < self.config.failures {
            return None;
        }
        let left = self
            .config
            .window
            .saturating_sub(now.saturating_duration_since(w.start));
        Some(left.as_secs_f64().ceil().max(1.0) as u64)
    }

    /// Count one failure for `addr`.
    pub fn record_failure(&self, addr: IpAddr, now: Instant) {
        let mut windows = self.windows.lock();
        if let Some(w) = windows.get_mut(&addr) {
            if self.live(w, now) {
                w.failures = w.failures.saturating_add(1);
            } else {
                *w = Window {
                    start: now,
                    failures: 1,
                };
            }
            return;
        }
        if windows.len() >= self.config.max_addresses {
            windows.retain(|_, w| now.saturating_duration_since(w.start) < self.config.window);
        }
        if windows.len() >= self.config.max_addresses
            && let Some(oldest) = windows.iter().min_by_key(|(_, w)| w.start).map(|(a, _)| *a)
        {
            windows.remove(&oldest);
        }
        windows.insert(
            addr,
            Window {
                start: now,
                failures: 1,
            },
        );
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
        })
    }

    fn ip(n: u8) -> IpAddr {
        IpAddr::from([198, 51, 100, n])
    }

    #[test]
    fn over_budget_until_the_window_ends() {
        let t = throttle(16);
        let t0 = Instant::now();
        for _ in 0..3 {
            assert_eq!(t.check(ip(1), t0), None);
            t.record_failure(ip(1), t0);
        }
        assert_eq!(t.check(ip(1), t0), Some(60));
        assert_eq!(t.check(ip(1), t0 + Duration::from_millis(59_500)), Some(1));
        assert_eq!(t.check(ip(1), t0 + Duration::from_secs(45)), Some(15));
        assert_eq!(t.check(ip(2), t0), None, "another address is not affected");
        assert_eq!(
            t.check(ip(1), t0 + Duration::from_secs(60)),
            None,
            "a new window"
        );
        t.record_failure(ip(1), t0 + Duration::from_secs(61));
        assert_eq!(t.check(ip(1), t0 + Duration::from_secs(61)), None);
    }

    #[test]
    fn tracking_is_bounded_expired_first_then_oldest() {
        let t = throttle(3);
        let t0 = Instant::now();
        t.record_failure(ip(1), t0);
        t.record_failure(ip(2), t0 + Duration::from_secs(10));
        t.record_failure(ip(3), t0 + Duration::from_secs(20));
        // ip(1)'s window has expired by t0+65: it goes first.
        t.record_failure(ip(4), t0 + Duration::from_secs(65));
        assert_eq!(t.tracked(), 3);
        for _ in 0..3 {
            t.record_failure(ip(3), t0 + Duration::from_secs(66));
        }
        // Nothing expired: the oldest (ip(2)) is evicted, ip(3)'s budget is kept.
        t.record_failure(ip(5), t0 + Duration::from_secs(66));
        assert_eq!(t.tracked(), 3);
        assert!(t.check(ip(3), t0 + Duration::from_secs(66)).is_some());
    }
}
