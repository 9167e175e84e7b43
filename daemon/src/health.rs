//! What is failing now: the parts that write to the state directory report each failed
//! write and each write that works again, so `status` can say `degraded` with the last
//! error and the metrics can count the failures (docs/design.md §8.9).

use std::collections::BTreeMap;
use std::time::SystemTime;

use parking_lot::Mutex;

use crate::vocab::StatePart;

/// A part failing since `since`: its last error and the failed writes since then.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fault {
    pub error: String,
    pub since: SystemTime,
    pub failures: u64,
}

#[derive(Default)]
pub struct Health {
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    faults: BTreeMap<StatePart, Fault>,
    /// Failed writes since the process started, by part (for the counter).
    totals: BTreeMap<StatePart, u64>,
}

impl Health {
    /// A write of `part` failed. Returns whether the part was healthy until now (so the
    /// caller logs the first failure of a run at ERROR, not every one).
    pub fn failed(&self, part: StatePart, error: &dyn std::fmt::Display) -> bool {
        let mut inner = self.inner.lock();
        *inner.totals.entry(part).or_default() += 1;
        let error = error.to_string();
        match inner.faults.get_mut(&part) {
            Some(fault) => {
                fault.error = error;
                fault.failures += 1;
                false
            }
            None => {
                inner.faults.insert(
                    part,
                    Fault {
                        error,
                        since: SystemTime::now(),
                        failures: 1,
                    },
                );
                true
            }
        }
    }

    /// A write of `part` worked. Returns the fault it ends, if it was failing.
    pub fn recovered(&self, part: StatePart) -> Option<Fault> {
        self.inner.lock().faults.remove(&part)
    }

    /// The parts failing now.
    pub fn faults(&self) -> BTreeMap<StatePart, Fault> {
        self.inner.lock().faults.clone()
    }

    /// Failed writes of `part` since the process started.
    pub fn failures_total(&self, part: StatePart) -> u64 {
        self.inner.lock().totals.get(&part).copied().unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fault_keeps_its_start_and_last_error_until_a_write_works() {
        let health = Health::default();
        assert!(health.faults().is_empty());
        assert!(health.failed(StatePart::Audit, &"disk full"));
        assert!(!health.failed(StatePart::Audit, &"still full"));
        let fault = &health.faults()[&StatePart::Audit];
        assert_eq!((fault.error.as_str(), fault.failures), ("still full", 2));
        assert!(!health.faults().contains_key(&StatePart::Store));
        let ended = health.recovered(StatePart::Audit).expect("it was failing");
        assert_eq!(ended.failures, 2);
        assert!(health.faults().is_empty());
        assert_eq!(health.recovered(StatePart::Audit), None);
        // The total never goes down: it feeds a counter.
        assert_eq!(health.failures_total(StatePart::Audit), 2);
        assert!(health.failed(StatePart::Audit, &"full again"));
        assert_eq!(health.failures_total(StatePart::Audit), 3);
    }
}
