//! Build, before serving: everything the configuration implies that can be checked
//! without binding a socket or touching the state directory. `check-config` runs exactly
//! this; a start that passed it can still fail to bind, never on the configuration.

use std::sync::Arc;
use std::time::SystemTime;

use sha2::Digest;

use crate::audit::Audit;
use crate::budget::Budget;
use crate::catalog::{self, Catalog, CatalogError, Fixed, HostView, Source};
use crate::config::Source as ConfigSource;
use crate::config::{Config, ConfigError, ConfigIssue, Loader, WireNameProfile};
use crate::host::Host;
use crate::mcp::{WireError, WireNames};
use crate::metrics::Metrics;
use crate::oauth::jwt::{BuildError, JwtConfig, JwtVerifier};
use crate::session::{Idempotency, Parts, Policy, Session, TurnBackend};
use crate::store::StoreError;
use crate::upstream::{self, Launcher, Upstreams};

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
    /// An upstream whose name would put its tools among the first-party tools.
    #[error("{0}")]
    Upstream(ConfigIssue),
    /// The remote carrier's TLS files: a runtime failure at start (they may yet appear),
    /// a failed check for `check-config` and a failed reload.
    #[error("remote.tls")]
    Tls(#[source] crate::carrier::http::TlsError),
    /// What the checks past the configuration's text found (policy patterns, job
    /// executables, write roots); every problem names its key.
    #[error("{}", list(.0, .1))]
    Checks(
        Vec<crate::config::ConfigIssue>,
        Vec<crate::config::ConfigIssue>,
    ),
}

/// One problem on the line, several each on a line of their own; then the warnings.
fn list(errors: &[crate::config::ConfigIssue], warnings: &[crate::config::ConfigIssue]) -> String {
    let mut out = match errors {
        [one] => one.to_string(),
        many => format!(
            "{} problems:{}",
            many.len(),
            many.iter().map(|i| format!("\n  {i}")).collect::<String>()
        ),
    };
    for warning in warnings {
        out.push_str(&format!("\n  warning: {warning}"));
    }
    out
}

/// Where the configuration of a plan came from, so a reload reads it the same way.
#[derive(Clone)]
pub struct Origin {
    pub loader: Loader,
    pub source: ConfigSource,
    pub sha256: [u8; 32],
    pub loaded_at: SystemTime,
    pub text: String,
}

/// What the remote verifier is built from: a reload whose settings are equal keeps the
/// running verifier (its keys, cache and schedule).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VerifierSettings {
    config: JwtConfig,
    /// The SHA-256 of `ca_file` as read when the plan was built.
    ca_file: Option<[u8; 32]>,
}

/// Why a configuration could not be loaded and planned.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("invalid configuration ({origin})")]
    Plan {
        origin: ConfigSource,
        #[source]
        error: PlanError,
    },
}

impl LoadError {
    /// The exit code of a start that failed this way.
    pub fn exit_code(&self) -> i32 {
        match self {
            LoadError::Plan {
                error: PlanError::Tls(_),
                ..
            } => crate::exit::RUNTIME,
            _ => crate::exit::CONFIG,
        }
    }
}

/// A validated configuration, ready to bind.
pub struct Plan {
    pub config: Config,
    /// Where it came from (none for a plan built from a configuration in memory: a
    /// reload then plans the same configuration again).
    pub origin: Option<Origin>,
    /// The registry every part reports to (a listener serves it later).
    pub metrics: Metrics,
    /// The remote carrier's verifier: every configuration check done, no key loaded.
    pub verifier: Option<JwtVerifier>,
    pub verifier_settings: Option<VerifierSettings>,
    /// The remote carrier's TLS acceptor, from its files.
    pub tls: Option<tokio_rustls::TlsAcceptor>,
    /// How upstream children are started: the binary sets this to itself (so a child dies
    /// with the daemon); in-process daemons start them directly.
    pub launcher: Launcher,
}

impl Plan {
    /// Check everything: the catalog exactly as it will be served (over a store in
    /// memory), its wire names on every carrier, the verifier, the TLS files. Parts that
    /// report go to `metrics`.
    pub fn build(config: Config, metrics: Metrics) -> Result<Plan, PlanError> {
        let host = Host::detached(&config)?;
        let catalog = catalog_over(&config, &host, inert_upstreams(&config).sources())?;
        let snapshot = catalog.snapshot();
        check_upstream_names(&config, &snapshot)?;
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
        let mut config = config;
        let found = super::checks::run(&config, &snapshot, None, None);
        if !found.errors.is_empty() {
            let mut warnings = std::mem::take(&mut config.warnings);
            warnings.extend(found.warnings);
            return Err(PlanError::Checks(found.errors, warnings));
        }
        config.warnings.extend(found.warnings);
        let (verifier, verifier_settings) = match &config.remote {
            Some(remote) => {
                let jwt = jwt_config(remote, &config.state_dir);
                let settings = VerifierSettings {
                    config: jwt.clone(),
                    ca_file: remote
                        .ca_file
                        .as_ref()
                        .and_then(|p| std::fs::read(p).ok())
                        .map(|bytes| sha2::Sha256::digest(bytes).into()),
                };
                (
                    Some(JwtVerifier::build(jwt, metrics.clone())?),
                    Some(settings),
                )
            }
            None => (None, None),
        };
        let tls = match config.remote.as_ref().and_then(|r| r.tls.as_ref()) {
            Some(files) => Some(
                crate::carrier::http::tls_acceptor(&files.cert, &files.key)
                    .map_err(PlanError::Tls)?,
            ),
            None => None,
        };
        Ok(Plan {
            config,
            origin: None,
            metrics,
            verifier,
            verifier_settings,
            tls,
            launcher: Launcher::Direct,
        })
    }

    /// The upstreams of a new session generation (not started yet).
    pub fn upstreams(&self, audit: Arc<Audit>) -> Upstreams {
        Upstreams::new(
            &self.config.upstreams,
            upstream::Context {
                launcher: self.launcher.clone(),
                state_dir: Some(self.config.state_dir.clone()),
                persist: true,
                // systemd's CacheDirectory= (the packaged unit sets it).
                cache_dir: std::env::var_os("CACHE_DIRECTORY")
                    .map(std::path::PathBuf::from)
                    .filter(|p| p.is_absolute()),
                hidden: self.kept_from_upstreams(),
                metrics: self.metrics.clone(),
                memory: Budget::new(self.config.limits.upstream_memory),
                audit,
            },
        )
    }

    /// What no confined upstream may reach: the daemon's state, runtime and configuration
    /// directories, its configuration file, the upstreams' homes, and every secret file it
    /// reads (systemd's directories by their environment variables, when it set them).
    fn kept_from_upstreams(&self) -> Vec<std::path::PathBuf> {
        use std::path::PathBuf;
        let c = &self.config;
        let mut kept = vec![c.state_dir.clone()];
        kept.extend(c.control.socket.parent().map(PathBuf::from));
        for var in [
            "STATE_DIRECTORY",
            "RUNTIME_DIRECTORY",
            "CACHE_DIRECTORY",
            "CONFIGURATION_DIRECTORY",
            "LOGS_DIRECTORY",
        ] {
            // systemd sets a colon-separated list.
            if let Some(dirs) = std::env::var_os(var) {
                kept.extend(std::env::split_paths(&dirs).filter(|p| p.is_absolute()));
            }
        }
        if let Some(Origin {
            source: ConfigSource::File(file),
            ..
        }) = &self.origin
        {
            kept.push(file.clone());
        }
        if let Some(remote) = &c.remote {
            if let Some(tls) = &remote.tls {
                kept.push(tls.key.clone());
            }
            if let Some(i) = &remote.introspection {
                kept.push(i.client_secret_file.clone());
            }
        }
        for u in &c.upstreams {
            if let crate::config::UpstreamEndpoint::Http {
                bearer_file: Some(file),
                ..
            } = &u.endpoint
            {
                kept.push(file.clone());
            }
        }
        // The journal, which holds every daemon's and upstream's lines.
        kept.extend(upstream::confine::JOURNALS.map(PathBuf::from));
        // A path given relative (`--config c.toml`) is the daemon's working directory's,
        // not the launcher's (which starts in the upstream's `cwd`).
        kept.into_iter()
            .map(|p| std::path::absolute(&p).unwrap_or(p))
            .collect()
    }

    /// The plan of what `origin` names, as it reads now.
    pub fn load(loader: &Loader, metrics: Metrics) -> Result<Plan, LoadError> {
        let loaded = loader.load()?;
        let mut plan = Plan::build(loaded.config, metrics).map_err(|mut error| {
            if let PlanError::Checks(errors, warnings) = &mut error {
                crate::config::locate_all(&loaded.text, errors);
                crate::config::locate_all(&loaded.text, warnings);
            }
            LoadError::Plan {
                origin: loaded.source.clone(),
                error,
            }
        })?;
        crate::config::locate_all(&loaded.text, &mut plan.config.warnings);
        plan.origin = Some(Origin {
            loader: loader.clone(),
            source: loaded.source,
            sha256: loaded.sha256,
            loaded_at: SystemTime::now(),
            text: loaded.text,
        });
        // Known once the configuration file is (it is kept too).
        let mut found = super::checks::Findings::default();
        super::checks::kept_out_of_grants(&plan.config, &plan.kept_from_upstreams(), &mut found);
        if let Some(origin) = &plan.origin {
            crate::config::locate_all(&origin.text, &mut found.warnings);
        }
        plan.config.warnings.extend(found.warnings);
        Ok(plan)
    }

    /// The checks that need to know who the daemon runs as and in which sandbox
    /// (`check-config --as-user`, the installed unit): problems and warnings.
    pub fn deep_check(
        &self,
        subject: Option<&super::checks::Subject>,
        sandbox: Option<&super::checks::Sandbox>,
    ) -> Result<super::checks::Findings, PlanError> {
        let host = Host::detached(&self.config)?;
        let snapshot = self
            .catalog(&host, &inert_upstreams(&self.config))?
            .snapshot();
        let mut found = super::checks::run(&self.config, &snapshot, subject, sandbox);
        // Those of the build are in the plan already.
        let built = super::checks::run(&self.config, &snapshot, None, None);
        found.errors.retain(|e| !built.errors.contains(e));
        found.warnings.retain(|w| !built.warnings.contains(w));
        super::checks::secret_files(&self.config, subject, &mut found);
        if let Some(origin) = &self.origin {
            crate::config::locate_all(&origin.text, &mut found.errors);
            crate::config::locate_all(&origin.text, &mut found.warnings);
        }
        Ok(found)
    }

    /// The catalog over the daemon's own services and `upstreams`' tools as they are now.
    pub fn catalog(
        &self,
        host: &Arc<Host>,
        upstreams: &Upstreams,
    ) -> Result<Arc<Catalog>, PlanError> {
        catalog_over(&self.config, host, upstreams.sources())
    }

    /// A fresh session over `host` and `catalog`: a new policy and turn backend.
    pub fn session(
        &self,
        host: &Arc<Host>,
        catalog: Arc<Catalog>,
        view: Arc<dyn HostView>,
    ) -> Session {
        let config = &self.config;
        let snapshot = catalog.snapshot();
        self.metrics.prime_tools(
            snapshot
                .specs()
                .map(|s| s.name.as_str())
                .chain([snapshot.submission().name.as_str()]),
        );
        Session::new(Parts {
            catalog,
            policy: Policy::new(config.policy.clone()),
            turns: TurnBackend::new(config.session.turn.clone(), config.limits.tool_result),
            grants: host.grants.clone(),
            jobs: host.jobs.clone(),
            idempotency: Idempotency::new(host.store.clone(), self.metrics.clone()),
            metrics: self.metrics.clone(),
            view,
        })
    }
}

/// The upstreams as sources without tools (none is started, nothing is read): their
/// names are checked, and aliases may name their tools.
fn inert_upstreams(config: &Config) -> Upstreams {
    Upstreams::new(
        &config.upstreams,
        upstream::Context {
            launcher: Launcher::Direct,
            state_dir: None,
            persist: false,
            cache_dir: None,
            hidden: Vec::new(),
            metrics: Metrics::new(),
            memory: Budget::new(config.limits.upstream_memory),
            audit: Arc::new(Audit::new()),
        },
    )
}

/// The first-party tools, the upstreams' and the submission extension, validated.
fn catalog_over(
    config: &Config,
    host: &Arc<Host>,
    upstreams: Vec<Arc<dyn Source>>,
) -> Result<Arc<Catalog>, PlanError> {
    let tools = crate::tools::first_party(config, host)?;
    let mut sources: Vec<Arc<dyn Source>> =
        vec![Arc::new(Fixed::new("the first-party tools", tools))];
    sources.extend(upstreams);
    let catalog = Catalog::new(
        sources,
        catalog::submission_spec(&config.session.submission_tool),
    )?;
    Ok(Arc::new(catalog))
}

/// An upstream may not be named like the prefix of a first-party tool (`system`,
/// `file`, …): its tools would meet theirs.
fn check_upstream_names(config: &Config, snapshot: &catalog::Snapshot) -> Result<(), PlanError> {
    for upstream in &config.upstreams {
        let prefix = format!("{}.", upstream.name);
        let first_party = snapshot
            .specs()
            .find(|s| s.imported.is_none() && s.name.starts_with(&prefix));
        if let Some(tool) = first_party {
            return Err(PlanError::Upstream(ConfigIssue {
                path: format!("upstreams.{}", upstream.name),
                problem: format!(
                    "the name is taken by the first-party tools ({} and its kin); choose another",
                    tool.name
                ),
                at: None,
            }));
        }
    }
    Ok(())
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
        Plan::build(parse(text, &env).expect("config"), Metrics::new())
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
    fn upstreams_are_checked_and_aliases_may_name_their_tools() {
        let err = plan("[upstreams.system]\ncommand = [\"/bin/true\"]\n")
            .err()
            .unwrap();
        assert_eq!(
            err.to_string(),
            "upstreams.system: the name is taken by the first-party tools (system.health and its kin); choose another"
        );
        // An alias for a tool the upstream will offer is not unknown.
        let ok = plan(
            "[upstreams.pg]\ncommand = [\"/bin/true\"]\n[loopback]\nwire_names = \"compat\"\n[loopback.aliases]\n\"pg.run_query\" = \"q\"\n",
        );
        assert!(ok.is_ok(), "{:?}", ok.err().map(|e| crate::error_chain(&e)));
        let err =
            plan("[upstreams.pg]\ncommand = [\"/bin/true\"]\n[stdio.aliases]\n\"pgx.q\" = \"q\"\n")
                .err()
                .unwrap();
        assert!(
            crate::error_chain(&err).contains("not in the catalog"),
            "{err}"
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
