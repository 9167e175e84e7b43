//! The command line of `robota-mcpd`: flags and subcommands. Also compiled into
//! `packaging/docgen` (man pages, shell completions), so it uses nothing but clap and std.

use std::path::PathBuf;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "robota-mcpd",
    version,
    about = "MCP host daemon: host tools for AI agents over stdio, loopback and remote HTTP"
)]
pub struct Args {
    /// Configuration file (default: /etc/robota-mcpd/config.toml if present, else the embedded default).
    #[arg(long, global = true, value_name = "PATH")]
    pub config: Option<PathBuf>,
    /// Serve the catalog on stdin/stdout for the client that launched us (logs go to stderr).
    #[arg(long)]
    pub stdio: bool,
    #[command(subcommand)]
    pub command: Option<Sub>,
}

#[derive(Subcommand)]
pub enum Sub {
    /// Validate the configuration (and the catalog it implies) and exit: 0 valid, 78 invalid.
    CheckConfig {
        /// Check what this user (name or uid) can read and write, as the daemon will run
        /// (default: the installed unit's user when a unit is installed and we are root).
        #[arg(long, value_name = "USER")]
        as_user: Option<String>,
        /// Check against this systemd unit's sandbox (ProtectSystem=, ReadWritePaths=, ...)
        /// instead of the installed robota-mcpd.service and its drop-ins.
        #[arg(long, value_name = "FILE")]
        unit: Option<PathBuf>,
    },
    /// Print the embedded default configuration.
    DefaultConfig,
    /// Internal: how the daemon starts an upstream's command, so the kernel kills it when
    /// the daemon dies. Not for use by hand.
    #[command(hide = true)]
    ExecUpstream {
        /// The daemon's pid: the command is not run if its parent is another process.
        #[arg(long)]
        parent: u32,
        /// Join this cgroup first (the child's own; a v1 memory hierarchy's too).
        #[arg(long)]
        cgroup: Vec<std::path::PathBuf>,
        /// Confined: whether it may use the network ("none" or "any").
        #[arg(long)]
        network: Option<String>,
        /// Confined: read and execute beneath this path too.
        #[arg(long)]
        read: Vec<std::path::PathBuf>,
        /// Confined: write beneath this path.
        #[arg(long)]
        write: Vec<std::path::PathBuf>,
        /// Confined: read and write beneath this path, hidden or not (its own home).
        #[arg(long)]
        own: Vec<std::path::PathBuf>,
        /// Confined: never reach this path.
        #[arg(long)]
        hide: Vec<std::path::PathBuf>,
        /// The command and its arguments.
        #[arg(last = true, required = true)]
        argv: Vec<std::ffi::OsString>,
    },
}
