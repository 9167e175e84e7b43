//! `robota-mcpd`, as a lifecycle script: parse the command line, set up logging, load the
//! configuration and plan it (nothing bound), then check it, serve it on stdio, or run
//! the daemon; every outcome becomes an exit code.

mod cli;

use std::process::ExitCode;

use clap::Parser;
use robota_mcpd::config::{self, Environment};
use robota_mcpd::daemon::{self, Plan};
use robota_mcpd::metrics::Metrics;
use robota_mcpd::{error_chain, exit, logging, upstream};
use tokio_util::sync::CancellationToken;

use crate::cli::{Args, Sub};

fn main() -> ExitCode {
    close_inherited_fds();
    let args = Args::parse();
    if let Some(Sub::ExecUpstream {
        parent,
        cgroup,
        network,
        read,
        write,
        own,
        hide,
        argv,
    }) = &args.command
    {
        let confinement = match network.as_deref() {
            None => None,
            Some(text) => match text {
                "none" | "any" => Some(upstream::confine::Confinement {
                    network: if text == "none" {
                        config::Network::None
                    } else {
                        config::Network::Any
                    },
                    read: read.clone(),
                    write: write.clone(),
                    own: own.clone(),
                    hidden: hide.clone(),
                }),
                other => {
                    eprintln!("robota-mcpd exec-upstream: --network is none or any, got {other:?}");
                    return code(exit::USAGE);
                }
            },
        };
        // Returns only if the command could not be executed.
        eprintln!(
            "{}{}",
            upstream::stdio::LAUNCHER_REFUSAL,
            upstream::exec_child(*parent, cgroup, confinement.as_ref(), argv)
        );
        return code(exit::RUNTIME);
    }
    let env = Environment::from_process();
    let journal =
        !args.stdio && logging::stderr_is_journal(std::env::var("JOURNAL_STREAM").ok().as_deref());
    logging::init(journal, std::env::var("RUST_LOG").ok().as_deref());

    if let Some(Sub::DefaultConfig) = args.command {
        use std::io::Write;
        return match std::io::stdout().write_all(config::EMBEDDED_DEFAULT.as_bytes()) {
            Ok(()) => ExitCode::SUCCESS,
            Err(_) => code(exit::RUNTIME),
        };
    }
    let loader = config::Loader {
        explicit: args.config.clone(),
        env,
    };
    let checking = matches!(args.command, Some(Sub::CheckConfig { .. }));
    let mut plan = match Plan::load(&loader, Metrics::new()) {
        Ok(plan) => plan,
        Err(e) => {
            eprintln!("robota-mcpd: {}", error_chain(&e));
            // For `check-config` anything that stops a start is the configuration's fault.
            return code(if checking {
                exit::CONFIG
            } else {
                e.exit_code()
            });
        }
    };
    let source = plan
        .origin
        .as_ref()
        .map_or_else(String::new, |o| o.source.to_string());
    for warning in &plan.config.warnings {
        if checking {
            eprintln!("robota-mcpd: warning ({source}): {warning}");
        } else {
            tracing::warn!(config = %source, key = %warning.path, "{}", warning.problem);
        }
    }
    if let Some(Sub::CheckConfig { as_user, unit }) = &args.command {
        return deep_check(&plan, as_user.as_deref(), unit.as_deref(), &source);
    }
    // Upstream children start through this very binary, which has the kernel kill them
    // when the daemon dies, and each child's process tree is kept in a cgroup of its own
    // beneath the daemon's, which the daemon makes its own before it starts anything.
    let cgroups = upstream::cgroup::Tree::adopt();
    match &cgroups {
        Ok(_) => {}
        Err(why)
            if plan.config.upstreams.iter().any(|u| {
                matches!(&u.endpoint, config::UpstreamEndpoint::Command { confine, .. } if confine.enabled)
            }) =>
        {
            tracing::warn!("confined stdio upstreams cannot start: {why}");
        }
        Err(why) => tracing::debug!("no cgroup for upstreams: {why}"),
    }
    plan.launcher = upstream::Launcher::Shim {
        exe: "/proc/self/exe".into(),
        cgroups: std::sync::Arc::new(cgroups),
    };

    robota_sys::no_fast_bins();
    for problem in upstream::confine::harden_daemon() {
        tracing::warn!("{problem}");
    }
    // Sockets and files we create are private unless we open them up on purpose.
    nix::sys::stat::umask(nix::sys::stat::Mode::from_bits_truncate(0o077));
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("robota-mcpd: cannot start the async runtime: {e}");
            return code(exit::RUNTIME);
        }
    };
    let result = if args.stdio {
        runtime.block_on(daemon::run_stdio(plan))
    } else {
        tracing::info!(config = %source, "starting");
        runtime.block_on(daemon::run(plan, CancellationToken::new()))
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let message = error_chain(&e);
            tracing::error!("{message}");
            if journal {
                // Also on plain stderr, so `systemctl status` shows it whatever the log level.
                eprintln!("robota-mcpd: {message}");
            }
            code(e.exit_code())
        }
    }
}

/// Descriptors inherited beyond stdin, stdout and stderr (a shell's, a supervisor's) are
/// closed before anything opens its own, so no job or turn process is handed them.
fn close_inherited_fds() {
    let Ok(dir) = std::fs::read_dir("/proc/self/fd") else {
        return;
    };
    let inherited: Vec<i32> = dir
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse().ok())
        .filter(|&fd| fd > 2)
        .collect();
    // The listing's own descriptor is among them and already closed: EBADF, ignored.
    for fd in inherited {
        let _ = nix::unistd::close(fd);
    }
}

fn code(status: i32) -> ExitCode {
    ExitCode::from(u8::try_from(status).unwrap_or(1))
}

/// `check-config` past the plan: as the daemon's user, in the unit's sandbox.
fn deep_check(
    plan: &Plan,
    as_user: Option<&str>,
    unit: Option<&std::path::Path>,
    source: &str,
) -> ExitCode {
    use robota_mcpd::daemon::checks::{Sandbox, Subject};
    let sandbox = match unit {
        Some(path) => match Sandbox::read(path) {
            Ok(s) => Some(s),
            Err(e) => {
                eprintln!("robota-mcpd: --unit: {e}");
                return code(exit::USAGE);
            }
        },
        None => Sandbox::installed(),
    };
    // Root approves anything: check as the unit's user when a unit is installed.
    let implicit = (as_user.is_none() && nix::unistd::geteuid().is_root())
        .then(|| sandbox.as_ref().and_then(|s| s.user.clone()))
        .flatten();
    let subject = match (as_user, implicit) {
        (Some(name), _) => match Subject::lookup(name) {
            Ok(s) => Some(s),
            Err(e) => {
                eprintln!("robota-mcpd: --as-user: {e}");
                return code(exit::USAGE);
            }
        },
        (None, Some(name)) => match Subject::lookup(&name) {
            Ok(s) => Some(s),
            Err(e) => {
                eprintln!(
                    "robota-mcpd: warning: the unit runs as {name:?}, but {e}; access is not checked as that user (give --as-user)"
                );
                None
            }
        },
        (None, None) => None,
    };
    let found = match plan.deep_check(subject.as_ref(), sandbox.as_ref()) {
        Ok(found) => found,
        Err(e) => {
            eprintln!("robota-mcpd: {}", error_chain(&e));
            return code(exit::CONFIG);
        }
    };
    for warning in &found.warnings {
        eprintln!("robota-mcpd: warning ({source}): {warning}");
    }
    let whom = subject
        .as_ref()
        .map(|s| format!(", as user {} (uid {})", s.name, s.uid))
        .unwrap_or_default();
    let unit = sandbox
        .as_ref()
        .map(|s| {
            format!(
                ", in the sandbox of {}",
                s.from
                    .first()
                    .map_or(String::new(), |p| p.display().to_string())
            )
        })
        .unwrap_or_default();
    if !found.errors.is_empty() {
        eprintln!("robota-mcpd: invalid configuration ({source}){whom}{unit}:");
        for problem in &found.errors {
            eprintln!("  {problem}");
        }
        return code(exit::CONFIG);
    }
    eprintln!("robota-mcpd: configuration OK ({source}){whom}{unit}");
    ExitCode::SUCCESS
}
