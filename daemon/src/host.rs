//! The durable services behind the host tools: the store, jobs and grants.
//!
//! They belong to the daemon process, not to a session: a restart builds a fresh session
//! (new bearers, new transport attach) over the same `Host`, so running jobs, idempotency
//! records and grants carry on.

use std::sync::Arc;

use crate::audit::Audit;
use crate::config::Config;
use crate::grants::Grants;
use crate::jobs::Jobs;
use crate::metrics::Metrics;
use crate::store::{Store, StoreError};

pub struct Host {
    pub store: Arc<Store>,
    pub jobs: Arc<Jobs>,
    pub grants: Arc<Grants>,
    pub audit: Arc<Audit>,
}

impl Host {
    /// Open the store in the state directory, take over its jobs and idempotency records.
    pub fn open(
        config: &Config,
        audit: Arc<Audit>,
        metrics: Metrics,
    ) -> Result<Arc<Self>, StoreError> {
        let store = Store::open(&config.state_dir)?;
        store.prune()?;
        Self::over(Arc::new(store), config, audit, metrics)
    }

    /// Over a store in memory: builds the catalog without touching the state directory
    /// (`check-config`).
    pub fn detached(config: &Config) -> Result<Arc<Self>, StoreError> {
        Self::over(
            Arc::new(Store::memory()?),
            config,
            Arc::new(Audit::new()),
            Metrics::new(),
        )
    }

    fn over(
        store: Arc<Store>,
        config: &Config,
        audit: Arc<Audit>,
        metrics: Metrics,
    ) -> Result<Arc<Self>, StoreError> {
        let interrupted = store.idem_mark_interrupted()?;
        let (jobs, recovered) = Jobs::open(
            Arc::clone(&store),
            config.tools.max_running_jobs,
            metrics.clone(),
        )?;
        metrics.jobs_recovered(recovered);
        if recovered > 0 || interrupted > 0 {
            tracing::warn!(
                jobs = recovered,
                idempotent_calls = interrupted,
                "work cut off by the previous process is marked outcome-unknown; nothing is re-run"
            );
        }
        let grants = Arc::new(Grants::new(
            Arc::clone(&store),
            Arc::clone(&audit),
            metrics,
            config.tools.permissions.clone(),
        ));
        Ok(Arc::new(Self {
            store,
            jobs,
            grants,
            audit,
        }))
    }
}
