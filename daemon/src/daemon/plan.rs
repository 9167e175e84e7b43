//! Build, before serving: everything the configuration implies that can be checked
//! without binding a socket or touching the state directory. `check-config` runs exactly
//! this; a start that passed it can still fail to bind, never on the configuration.

use std::sync::Arc;

use crate::catalog::{self, Catalog, CatalogError, Fixed, HostView};
use crate::config::{Config, WireNameProfile};
use crate::host::Host;
use crate::mcp::{WireError, WireNames};
use crate::metrics::Metrics;
use crate::oauth::jwt::{BuildError, JwtConfig, JwtVerifier};
use crate::session::{Idempotency, Parts, Policy, Session, TurnBackend};
use crate::store::StoreError;

/// Why a configuration cannot be served: all configuration errors (exit 78).
#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    #[error("the host tools cannot be built")]
    Tools(#[from] crate::tools::BuildError),
    #[error("the catalog is invalid")]
    Catalog(#[from] CatalogError),
    #[error("{carrier}.aliases")]
    WireNames {
        carrier: &'static str,
        #[source]
        source: WireError,
    },
    /// Named by its section, as every configuration problem names its key.
    #[error("remote")]
    Verifier(#[from] BuildError),
    /// The in-memory store the plan builds the catalog over (never the state directory).
    #[error("cannot build the catalog")]
    Store(#[from] StoreError),
}

/// A validated configuration, ready to bind.
pub struct Plan {
    pub config: Config,
    /// The registry every part reports to (built here; a listener serves it later).
    pub metrics: Metrics,
    /// The remote carrier's verifier: every configuration check done, no key loaded.
    pub verifier: Option<JwtVerifier>,
}

impl Plan {
    /// Check everything: the catalog exactly as it will be served (over a store in
    /// memory), its wire names on every carrier, the verifier.
    pub fn build(config: Config) -> Result<Plan, PlanError> {
        let metrics = Metrics::new();
        let host = Host::detached(&config)?;
        let catalog = catalog_over(&config, &host)?;
        let snapshot = catalog.snapshot();
        let mut carriers = vec![("stdio", config.stdio.wire_names, &config.stdio.aliases)];
        if let Some(l) = &config.loopback {
            carriers.push(("loopback", l.wire_names, &l.aliases));
        }
        if let Some(r) = &config.remote {
            carriers.push(("remote", r.wire_names, &r.aliases));
        }
        for (carrier, profile, aliases) in carriers {
            check_wire_names(&snapshot, carrier, profile, aliases)?;
        }
        let verifier = match &config.remote {
            Some(remote) => Some(JwtVerifier::build(
                jwt_config(remote, &config.state_dir),
                metrics.clone(),
            )?),
            None => None,
        };
        Ok(Plan {
            config,
            metrics,
            verifier,
        })
    }

    /// The catalog over the daemon's own services.
    pub fn catalog(&self, host: &Arc<Host>) -> Result<Arc<Catalog>, PlanError> {
        catalog_over(&self.config, host)
    }

    /// A fresh session over `host`: a new catalog, policy and turn backend.
    pub fn session(&self, host: &Arc<Host>, view: Arc<dyn HostView>) -> Result<Session, PlanError> {
        let config = &self.config;
        Ok(Session::new(Parts {
            catalog: self.catalog(host)?,
            policy: Policy::new(config.policy.clone()),
            turns: TurnBackend::new(config.session.turn.clone(), config.limits.tool_result),
            grants: host.grants.clone(),
            jobs: host.jobs.clone(),
            idempotency: Idempotency::new(host.store.clone(), self.metrics.clone()),
            metrics: self.metrics.clone(),
            view,
        }))
    }
}

/// The first-party tools and the submission extension, validated.
fn catalog_over(config: &Config, host: &Arc<Host>) -> Result<Arc<Catalog>, PlanError> {
    let tools = crate::tools::first_party(config, host)?;
    let catalog = Catalog::new(
        vec![Arc::new(Fixed::new("the first-party tools", tools))],
        catalog::submission_spec(&config.session.submission_tool),
    )?;
    Ok(Arc::new(catalog))
}

fn check_wire_names(
    snapshot: &catalog::Snapshot,
    carrier: &'static str,
    profile: WireNameProfile,
    aliases: &std::collections::BTreeMap<String, String>,
) -> Result<(), PlanError> {
    WireNames::build(snapshot, profile, aliases)
        .check()
        .map_err(|source| PlanError::WireNames { carrier, source })
}

/// What the shipped JWT/JWKS verifier checks, from `[remote]`.
fn jwt_config(remote: &crate::config::RemoteConfig, state_dir: &std::path::Path) -> JwtConfig {
    JwtConfig {
        issuer: remote.issuer.clone(),
        audiences: remote.audiences.clone(),
        algorithms: remote.algorithms.clone(),
        required_scopes: remote.scopes.clone(),
        allowed_subjects: remote.allowed_subjects.clone(),
        allowed_clients: remote.allowed_clients.clone(),
        keys: remote.keys.clone(),
        ca_file: remote.ca_file.clone(),
        cache_path: state_dir.join("jwks-cache.json"),
        start_without_keys: remote.start_without_keys,
        refresh: remote.key_refresh,
        introspection: remote.introspection.as_ref().map(|i| {
            crate::oauth::introspect::IntrospectionSettings {
                endpoint: i.endpoint.clone(),
                client_id: i.client_id.clone(),
                client_secret_file: i.client_secret_file.clone(),
                auth: i.auth,
                cache: i.cache,
            }
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Environment, parse};

    fn plan(text: &str) -> Result<Plan, PlanError> {
        let env = Environment {
            runtime_directory: Some("/run/robota-mcpd".into()),
            state_directory: Some("/nonexistent/robota-mcpd".into()),
            ..Environment::default()
        };
        Plan::build(parse(text, &env).expect("config"))
    }

    #[test]
    fn the_default_configuration_plans_without_touching_the_state_directory() {
        let plan = plan("").expect("plan");
        assert!(plan.verifier.is_none());
        assert!(!std::path::Path::new("/nonexistent/robota-mcpd").exists());
    }

    #[test]
    fn wire_name_problems_name_the_carrier() {
        let err = plan(
            "[session]\nsubmission_tool = \"system_info\"\n[loopback]\nwire_names = \"compat\"\n",
        )
        .err()
        .expect("a compat collision");
        assert!(
            matches!(
                err,
                PlanError::WireNames {
                    carrier: "loopback",
                    ..
                }
            ),
            "{err}"
        );
        let err = plan("[stdio]\naliases = { \"no.such\" = \"x\" }\n")
            .err()
            .unwrap();
        assert_eq!(
            crate::error_chain(&err),
            "stdio.aliases: an alias names \"no.such\", which is not in the catalog"
        );
    }

    #[test]
    fn a_submission_name_colliding_with_a_tool_refuses_the_plan() {
        let err = plan("[session]\nsubmission_tool = \"system.info\"\n")
            .err()
            .unwrap();
        assert!(
            matches!(
                err,
                PlanError::Catalog(CatalogError::SubmissionCollision { .. })
            ),
            "{err}"
        );
    }
}
