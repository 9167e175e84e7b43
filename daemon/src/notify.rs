//! systemd readiness protocol (sd_notify): a no-op when `NOTIFY_SOCKET` is unset.

use std::time::Duration;

use sd_notify::NotifyState;

/// Send states to the service manager; failures are logged, never fatal.
fn send(states: &[NotifyState<'_>]) {
    if let Err(e) = sd_notify::notify(false, states) {
        tracing::warn!(error = %e, "sd_notify failed");
    }
}

pub fn ready(status: &str) {
    send(&[NotifyState::Ready, NotifyState::Status(status)]);
}

pub fn status(status: &str) {
    send(&[NotifyState::Status(status)]);
}

pub fn stopping() {
    send(&[NotifyState::Stopping, NotifyState::Status("stopping")]);
}

/// `RELOADING=1` with the `MONOTONIC_USEC=` systemd ≥ 253 requires next to it.
pub fn reloading() {
    match NotifyState::monotonic_usec_now() {
        Ok(now) => send(&[
            NotifyState::Reloading,
            now,
            NotifyState::Status("restarting"),
        ]),
        Err(_) => send(&[NotifyState::Reloading, NotifyState::Status("restarting")]),
    }
}

pub fn watchdog() {
    send(&[NotifyState::Watchdog]);
}

/// Half the watchdog interval, if the service manager asked for pings.
pub fn watchdog_interval() -> Option<Duration> {
    let mut usec = 0;
    sd_notify::watchdog_enabled(false, &mut usec).then(|| Duration::from_micros(usec / 2))
}
