//! `robota-mcpd`: load the configuration, set up logging, then run the daemon (or the
//! stdio carrier) and turn the outcome into an exit code.

mod cli;

use std::process::ExitCode;
use std::sync::Arc;

use clap::Parser;
use robota_mcpd::config::{self, Environment};
use robota_mcpd::session::{HostView, Session};
use robota_mcpd::transport::McpTransport;
use robota_mcpd::{carrier, daemon, error_chain, exit, logging, metrics};
use tokio_util::sync::CancellationToken;

use crate::cli::{Args, Sub};

fn main() -> ExitCode {
    let args = Args::parse();
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
    let (config, source) = match config::load(args.config.as_deref(), &env) {
        Ok(loaded) => loaded,
        Err(e) => {
            eprintln!("robota-mcpd: {}", error_chain(&e));
            return code(exit::CONFIG);
        }
    };
    if let Some(Sub::CheckConfig) = args.command {
        for warning in &config.warnings {
            eprintln!("robota-mcpd: warning ({source}): {warning}");
        }
        return match check(&config) {
            Ok(()) => {
                eprintln!("robota-mcpd: configuration OK ({source})");
                ExitCode::SUCCESS
            }
            Err(message) => {
                eprintln!("robota-mcpd: invalid configuration ({source}): {message}");
                code(exit::CONFIG)
            }
        };
    }
    for warning in &config.warnings {
        tracing::warn!(config = %source, key = %warning.path, "{}", warning.problem);
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
        runtime.block_on(stdio(config))
    } else {
        tracing::info!(config = %source, "starting");
        runtime
            .block_on(daemon::run(config, CancellationToken::new()))
            .map_err(|e| (e.exit_code(), error_chain(&e)))
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err((status, message)) => {
            tracing::error!("{message}");
            if journal {
                // Also on plain stderr, so `systemctl status` shows it whatever the log level.
                eprintln!("robota-mcpd: {message}");
            }
            code(status)
        }
    }
}

fn code(status: i32) -> ExitCode {
    ExitCode::from(u8::try_from(status).unwrap_or(1))
}

struct NoCarriers;
impl HostView for NoCarriers {
    fn carriers(&self) -> Vec<(String, String)> {
        vec![("stdio".into(), "stdio".into())]
    }
}

/// Everything start-up would validate, without binding anything.
fn check(config: &config::Config) -> Result<(), String> {
    use robota_mcpd::session::{RuntimeTools, TurnSubmission};
    let host = robota_mcpd::host::Host::detached(config).map_err(|e| e.to_string())?;
    let session = Session::new(config, Arc::new(NoCarriers), host, metrics::Metrics::new())
        .map_err(|e| error_chain(&e))?;
    let build = |profile, aliases| {
        robota_mcpd::mcp::WireNames::build(
            session.catalog(),
            session.submission_tool(),
            profile,
            aliases,
        )
    };
    build(config.stdio.wire_names, &config.stdio.aliases)
        .map_err(|e| format!("stdio.aliases: {e}"))?;
    if let Some(loopback) = &config.loopback {
        build(loopback.wire_names, &loopback.aliases)
            .map_err(|e| format!("loopback.aliases: {e}"))?;
    }
    if let Some(remote) = &config.remote {
        build(remote.wire_names, &remote.aliases).map_err(|e| format!("remote.aliases: {e}"))?;
        // Everything the verifier checks before it fetches a key.
        daemon::verifier_config(remote, &config.state_dir, metrics::Metrics::new())
            .map_err(|e| format!("remote: {}", error_chain(&e)))?;
    }
    Ok(())
}

/// The stdio carrier alone: no control socket, no HTTP.
async fn stdio(config: config::Config) -> Result<(), (i32, String)> {
    // The stdio process shares the store with a daemon on the same state directory (SQLite
    // locking makes that safe); its refusals and grant events are logged, not persisted.
    std::fs::create_dir_all(&config.state_dir).map_err(|e| {
        (
            exit::RUNTIME,
            format!(
                "cannot create the state directory {}: {e}",
                config.state_dir.display()
            ),
        )
    })?;
    let audit = Arc::new(robota_mcpd::audit::Audit::new());
    let metrics = metrics::Metrics::new();
    let host = robota_mcpd::host::Host::open(&config, audit, metrics.clone())
        .map_err(|e| (exit::RUNTIME, error_chain(&e)))?;
    let session = Session::new(&config, Arc::new(NoCarriers), host.clone(), metrics.clone())
        .map_err(|e| (exit::CONFIG, error_chain(&e)))?;
    let wire = robota_mcpd::mcp::Wire {
        result_limit: config.limits.tool_result,
        metrics: metrics.clone(),
    };
    let transport = McpTransport::new(
        Arc::new(carrier::stdio::StdioCarrier {
            config: config.stdio.clone(),
            request_limit: config.limits.request_body,
        }),
        wire,
    );
    transport
        .attach(Arc::new(session))
        .map_err(|e| (exit::RUNTIME, error_chain(&e)))?;
    transport
        .start()
        .await
        .map_err(|e| (exit::RUNTIME, error_chain(&e)))?;
    let ended = transport.ended().unwrap_or_default();
    let mut sigterm = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .map_err(|e| (exit::RUNTIME, e.to_string()))?;
    tokio::select! {
        () = ended.cancelled() => {}
        _ = sigterm.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
    transport.stop().await;
    // Jobs this process started end with it and record how (else they would wait as
    // `running` until some process settles them as `outcome-unknown`).
    host.jobs.shutdown().await;
    Ok(())
}
