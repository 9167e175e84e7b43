//! `status`: one snapshot of the daemon for the control plane.

use std::sync::atomic::Ordering;
use std::time::SystemTime;

use robota_proto::{CarrierStatus, Status};

use super::core::Core;
use crate::session::{RuntimeTools, TurnSubmission};

impl Core {
    pub(super) fn status(&self) -> Status {
        let session = self.session.read().clone();
        let metrics = &self.plan.metrics;
        let carriers = self
            .places()
            .into_iter()
            .map(|place| CarrierStatus {
                name: place.name.to_owned(),
                address: place.address,
                public_url: place.public_url,
                admitted: place.carrier.map_or(0, |c| metrics.admitted_count(c)),
                refused: place.carrier.map_or(0, |c| metrics.refused_count(c)),
            })
            .collect();
        Status {
            version: env!("CARGO_PKG_VERSION").to_owned(),
            pid: std::process::id(),
            uptime_secs: self.started.elapsed().as_secs(),
            state: self.state.read().as_str().to_owned(),
            generation: self.generation.load(Ordering::Relaxed),
            carriers,
            catalog_size: session.as_ref().map_or(0, |s| s.catalog().len()),
            submission_tool: session.as_ref().map_or_else(
                || self.plan.config.session.submission_tool.clone(),
                |s| s.submission_tool().name.clone(),
            ),
            active_turn: session.as_ref().is_some_and(|s| s.turn_active()),
            running_jobs: self.host.jobs.running_count(),
            pending_grants: self.host.grants.pending_count().unwrap_or(0),
            bearer_count: self
                .loopback
                .as_ref()
                .map_or(0, |l| l.carrier().bearers().len()),
            refusals_last_hour: self.audit.last_hour(SystemTime::now()),
            key_set: self
                .remote
                .as_ref()
                .map(|r| Box::new(r.carrier().verifier().key_set())),
            upstreams: self.upstreams_status(),
        }
    }

    pub(super) fn upstreams_status(&self) -> Vec<robota_proto::UpstreamStatus> {
        self.upstreams
            .read()
            .as_ref()
            .map(|u| u.status())
            .unwrap_or_default()
    }
}
