//! A memory budget: what a set of messages may hold while they are read, parsed and
//! answered, accounted in 1 KiB units. Each HTTP carrier has one for its requests
//! (`[limits] request_memory`); the upstreams share one for what they send
//! (`[limits] upstream_memory`). A share is held as long as its permit lives.

use std::sync::Arc;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

/// The budget's unit.
const UNIT: usize = 1024;

/// A share of a budget, given back when dropped.
pub type Share = OwnedSemaphorePermit;

#[derive(Clone, Debug)]
pub struct Budget {
    memory: Arc<Semaphore>,
    /// The whole budget, in units.
    units: usize,
}

impl Budget {
    pub fn new(bytes: u64) -> Self {
        let units = usize::try_from(bytes)
            .unwrap_or(usize::MAX)
            .div_ceil(UNIT)
            .min(Semaphore::MAX_PERMITS);
        Self {
            memory: Arc::new(Semaphore::new(units)),
            units,
        }
    }

    /// The whole budget, in units.
    pub fn units(&self) -> usize {
        self.units
    }

    /// `units` now, or none.
    pub fn try_take(&self, units: usize) -> Option<Share> {
        let units = u32::try_from(units).ok()?;
        self.memory.clone().try_acquire_many_owned(units).ok()
    }

    /// `units`, waiting at most until `deadline` (only ever while holding none of it, so
    /// holders cannot block each other).
    pub async fn take_until(&self, units: usize, deadline: Instant) -> Option<Share> {
        let units = u32::try_from(units).ok()?;
        tokio::time::timeout_at(deadline, self.memory.clone().acquire_many_owned(units))
            .await
            .ok()?
            .ok()
    }
}

/// The units `bytes` take.
pub fn units(bytes: usize) -> usize {
    bytes.div_ceil(UNIT)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shares_are_given_back_when_dropped() {
        let budget = Budget::new(10 * 1024);
        assert_eq!(budget.units(), 10);
        let a = budget.try_take(units(6 * 1024)).unwrap();
        assert!(budget.try_take(5).is_none(), "only 4 units are left");
        let b = budget.try_take(4).unwrap();
        drop(a);
        assert!(budget.try_take(6).is_some());
        drop(b);
        assert_eq!(units(1), 1);
        assert_eq!(units(2048), 2);
    }
}
