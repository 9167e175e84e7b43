//! First-party host tools (SPEC §10). Each tool is a [`HostTool`]: a spec and an async call.
//! Tools that need daemon services (jobs, grants, the store) hold them from construction.

mod docker;
mod file;
mod job;
mod permissions;
mod service;
mod system;

pub use system::info as host_info;

use std::sync::Arc;

use serde_json::{Map, Value};

use crate::config::Config;
use crate::host::Host;
use crate::session::catalog::HostTool;
use crate::session::{Args, ToolError, ToolErrorCode};

/// Every first-party tool, in no particular order (the catalog sorts and validates).
pub fn first_party(config: &Config, host: &Arc<Host>) -> Vec<Box<dyn HostTool>> {
    let mut tools: Vec<Box<dyn HostTool>> = vec![Box::new(system::Info), Box::new(system::Health)];
    tools.extend(file::tools(&config.tools.file));
    tools.extend(service::tools(&config.tools.service, host));
    tools.extend(docker::tools(&config.tools.docker, host));
    tools.extend(job::tools(&config.tools.jobs, host));
    tools.extend(permissions::tools(host));
    tools
}

/// An input schema from a `json!` object literal.
pub(crate) fn schema(value: Value) -> Map<String, Value> {
    match value {
        Value::Object(map) => map,
        _ => Map::new(),
    }
}

/// A visible `invalid_arguments` error.
pub(crate) fn invalid(message: impl Into<String>) -> ToolError {
    ToolError::new(ToolErrorCode::InvalidArguments, message)
}

/// A visible `internal` error; the detail goes to the log, not to the caller.
pub(crate) fn internal(what: &str, e: impl std::fmt::Display) -> ToolError {
    tracing::warn!(error = %e, "{what} failed");
    ToolError::new(ToolErrorCode::Internal, format!("{what} failed"))
}

/// A string argument (the schema has already checked its type).
pub(crate) fn arg_str<'a>(args: &'a Args, key: &str) -> Option<&'a str> {
    args.get(key).and_then(Value::as_str)
}

/// An integer argument (the schema has already checked its type and range).
pub(crate) fn arg_u64(args: &Args, key: &str) -> Option<u64> {
    args.get(key).and_then(Value::as_u64)
}

/// Whether `name` matches one of the configured globs (units, containers).
pub(crate) fn allowed(patterns: &[String], name: &str) -> bool {
    patterns.iter().any(|p| glob_match::glob_match(p, name))
}
