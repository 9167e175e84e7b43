//! robota-mcpd: an MCP host daemon. See `docs/ARCHITECTURE.md` for the map.

#![forbid(unsafe_code)]

pub mod audit;
pub mod bearer;
pub mod budget;
pub mod canonical;
pub mod carrier;
pub mod catalog;
pub mod config;
pub mod control;
pub mod daemon;
pub mod grants;
pub mod health;
pub mod host;
pub mod jobs;
pub mod jsonrpc;
pub mod logging;
pub mod mcp;
pub mod metrics;
pub mod notify;
pub mod oauth;
pub mod owners;
pub mod params;
pub mod session;
pub mod store;
pub mod tools;
pub mod transport;
pub mod upstream;
pub mod vocab;

/// Process exit codes; the unit's `RestartPreventExitStatus=` names [`exit::CONFIG`].
pub mod exit {
    /// Clean stop.
    pub const OK: i32 = 0;
    /// Runtime failure: a bind failed, a carrier could not start, a restart failed.
    pub const RUNTIME: i32 = 1;
    /// Bad command line (clap's own code).
    pub const USAGE: i32 = 2;
    /// The configuration is invalid (EX_CONFIG from sysexits.h).
    pub const CONFIG: i32 = 78;
}

/// An error and its sources on one line: `outer: inner: root`.
pub fn error_chain(error: &dyn std::error::Error) -> String {
    let mut out = error.to_string();
    let mut source = error.source();
    while let Some(e) = source {
        out.push_str(": ");
        out.push_str(&e.to_string());
        source = e.source();
    }
    out
}
