//! The durable services: the store, jobs, grants and the loopback bearers.
//!
//! They belong to the daemon process, not to a session: a restart builds a fresh session
//! (a new host bearer, a new transport attach) over the same `Host`, so running jobs,
//! idempotency records, grants and labelled bearers with a lifetime carry on.

use std::sync::Arc;

use std::time::{Duration, SystemTime};

use crate::audit::Audit;
use crate::bearer::{BearerError, BearerStore, Durable};
use crate::config::Config;
use crate::grants::Grants;
use crate::jobs::Jobs;
use crate::metrics::Metrics;
use crate::store::{KeptBearer, Store, StoreError};

pub struct Host {
    pub store: Arc<Store>,
    pub jobs: Arc<Jobs>,
    pub grants: Arc<Grants>,
    pub audit: Arc<Audit>,
    pub bearers: Arc<BearerStore>,
}

/// Why a bearer operation failed.
#[derive(Debug, thiserror::Error)]
pub enum BearerOpError {
    #[error(transparent)]
    Bearer(#[from] BearerError),
    /// The bearer could not be kept (or forgotten) in the store; nothing changed.
    #[error("cannot keep the bearer in the store: {0}")]
    Store(#[from] StoreError),
}

impl Host {
    /// Open the store in the state directory, take over its jobs and idempotency records.
    pub fn open(
        config: &Config,
        audit: Arc<Audit>,
        metrics: Metrics,
        health: Arc<crate::health::Health>,
    ) -> Result<Arc<Self>, StoreError> {
        let store = Store::open(&config.state_dir)?.reporting_to(health);
        store.prune()?;
        let host = Self::over(Arc::new(store), config, audit, metrics)?;
        let kept = host.store.bearers_kept(crate::store::now())?;
        let restored = host.bearers.restore(kept.into_iter().map(durable));
        if restored > 0 {
            tracing::info!(
                bearers = restored,
                "labelled bearers kept from before are live again"
            );
        }
        Ok(host)
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
            bearers: Arc::new(BearerStore::new()),
        }))
    }

    /// Mint a labelled bearer; one with a lifetime is kept in the store first, so what is
    /// answered survives a restart (or nothing is minted).
    pub fn issue_bearer(
        &self,
        label: &str,
        ttl: Option<Duration>,
    ) -> Result<crate::bearer::Issued, BearerOpError> {
        let issued = self.bearers.issue(label, ttl)?;
        if let Some(d) = &issued.durable
            && let Err(e) = self.store.bearer_keep(&kept(d))
        {
            let _ = self.bearers.revoke(label);
            return Err(e.into());
        }
        Ok(issued)
    }

    /// Revoke a labelled bearer, here and in the store.
    pub fn revoke_bearer(&self, label: &str) -> Result<(), BearerOpError> {
        self.store.bearer_forget(label)?;
        self.bearers.revoke(label)?;
        Ok(())
    }

    /// Replace the host bearer and revoke every labelled one. Returns the new host secret
    /// and the labels revoked.
    pub fn rotate_bearers(&self) -> Result<(String, Vec<String>), BearerOpError> {
        self.store.bearers_forget_all()?;
        Ok(self.bearers.rotate_all())
    }
}

fn kept(d: &Durable) -> KeptBearer {
    KeptBearer {
        label: d.label.clone(),
        digest: d.digest,
        created_at: secs(d.created),
        expires_at: secs(d.expires),
    }
}

fn durable(k: KeptBearer) -> Durable {
    // A time no clock can hold reads as the epoch: long expired, so never restored.
    let at = |secs: i64| {
        SystemTime::UNIX_EPOCH
            .checked_add(Duration::from_secs(u64::try_from(secs).unwrap_or(0)))
            .unwrap_or(SystemTime::UNIX_EPOCH)
    };
    Durable {
        label: k.label,
        digest: k.digest,
        created: at(k.created_at),
        expires: at(k.expires_at),
    }
}

fn secs(t: SystemTime) -> i64 {
    i64::try_from(crate::bearer::unix_secs(t)).unwrap_or(i64::MAX)
}
