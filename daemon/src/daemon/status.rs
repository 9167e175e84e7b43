//! `status`: one snapshot of the daemon for the control plane.

use std::sync::atomic::Ordering;
use std::time::SystemTime;

use robota_proto::{CarrierStatus, ConfigStatus, ReloadStatus, Status};

use super::core::Core;
use crate::bearer::unix_secs;
use crate::session::{RuntimeTools, TurnSubmission};

impl Core {
    pub(super) fn status(&self) -> Status {
        let session = self.session.read().clone();
        let served = self.served();
        let metrics = &self.metrics;
        let carriers = self
            .places()
            .into_iter()
            .map(|place| CarrierStatus {
                name: place.name.to_owned(),
                address: place.address,
                public_url: place.public_url,
                admitted: place.carrier.map(|c| metrics.admitted_count(c)),
                refused: place.carrier.map(|c| metrics.refused_count(c)),
            })
            .collect();
        let config = served.plan.origin.as_ref().map(|origin| {
            let (changed_on_disk, read_error) = match origin.loader.sha256_now() {
                Ok(now) => (Some(now != origin.sha256), None),
                Err(e) => (None, Some(crate::error_chain(&e))),
            };
            ConfigStatus {
                source: origin.source.to_string(),
                sha256: hex::encode(origin.sha256),
                loaded_at: unix_secs(origin.loaded_at),
                changed_on_disk,
                read_error,
            }
        });
        let last_reload = self.last_reload.lock().clone().map(|r| ReloadStatus {
            at: unix_secs(r.at),
            ok: r.problems.is_empty(),
            problems: r.problems,
        });
        let upstreams = self.upstreams_status();
        let mut problems = self.health_problems();
        // An upstream that is not up is a problem of the host's service: its tools answer
        // `unavailable`.
        problems.extend(
            upstreams
                .iter()
                .filter(|u| u.state != crate::vocab::UpstreamState::Up.as_str())
                .map(|u| robota_proto::Problem {
                    part: format!("upstream {}", u.name),
                    error: match &u.last_error {
                        Some(e) => format!("{}: {e}", u.state),
                        None => u.state.clone(),
                    },
                    since: u.since,
                    failures: u.restarts,
                }),
        );
        Status {
            version: env!("CARGO_PKG_VERSION").to_owned(),
            pid: std::process::id(),
            uptime_secs: self.started.elapsed().as_secs(),
            state: self.state.read().as_str().to_owned(),
            generation: self.generation.load(Ordering::Relaxed),
            carriers,
            catalog_size: session.as_ref().map_or(0, |s| s.catalog().len()),
            submission_tool: session.as_ref().map_or_else(
                || served.plan.config.session.submission_tool.clone(),
                |s| s.submission_tool().name.clone(),
            ),
            active_turn: session.as_ref().is_some_and(|s| s.turn_active()),
            running_jobs: self.host.jobs.running_count(),
            pending_grants: self.host.grants.pending_count().unwrap_or(0),
            bearer_count: served
                .loopback
                .as_ref()
                .map_or(0, |_| self.host.bearers.len()),
            refusals_last_hour: self.audit.last_hour(SystemTime::now()),
            key_set: served
                .remote
                .as_ref()
                .map(|r| Box::new(r.carrier().verifier().key_set())),
            config,
            state_dir: served.plan.config.state_dir.display().to_string(),
            last_reload,
            health: if problems.is_empty() {
                "ok"
            } else {
                "degraded"
            }
            .to_owned(),
            problems,
            upstreams,
        }
    }

    /// The parts failing to write to the state directory now.
    fn health_problems(&self) -> Vec<robota_proto::Problem> {
        self.health
            .faults()
            .into_iter()
            .map(|(part, fault)| robota_proto::Problem {
                part: part.as_str().to_owned(),
                error: fault.error,
                since: unix_secs(fault.since),
                failures: fault.failures,
            })
            .collect()
    }

    pub(super) fn upstreams_status(&self) -> Vec<robota_proto::UpstreamStatus> {
        self.upstreams
            .read()
            .as_ref()
            .map(|u| u.status())
            .unwrap_or_default()
    }
}
