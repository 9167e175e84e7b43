//! End-to-end tests of one area, in one test binary (one link instead of one per file).

mod adversarial;
mod authz_depth;
mod ctl_stdio;
mod loopback_admission;
mod mcp_clients;
mod oversize;
mod remote;
mod request_path;
