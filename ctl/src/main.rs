//! `robota-mcpctl`: control a running `robota-mcpd` over its unix control socket.
//!
//! Parse the command line (clap exits 2 on bad usage), resolve the socket, run one
//! command, and turn its failure into one stderr line and a distinct exit code
//! (`robota_proto::exit`).

#![forbid(unsafe_code)]

mod cli;
mod client;
mod commands;
mod error;
mod render;
mod secret_file;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;

use crate::cli::Cli;
use crate::commands::Ctx;

fn main() -> ExitCode {
    let cli = Cli::parse();
    let socket = cli.socket.clone().unwrap_or_else(|| {
        let xdg = std::env::var_os("XDG_RUNTIME_DIR").map(PathBuf::from);
        client::default_socket(xdg.as_deref())
    });
    let ctx = Ctx {
        socket,
        json: cli.json,
    };
    match commands::run(&ctx, &cli.command) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("robota-mcpctl: {}", err.report());
            ExitCode::from(u8::try_from(err.exit_code()).unwrap_or(1))
        }
    }
}
