//! First-party host tools (SPEC §10). Each tool is a [`HostTool`]: a spec and an async call.

mod system;

use crate::session::catalog::HostTool;

/// Every first-party tool, in no particular order (the catalog sorts and validates).
pub fn first_party() -> Vec<Box<dyn HostTool>> {
    vec![Box::new(system::Info), Box::new(system::Health)]
}
