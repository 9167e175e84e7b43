//! Carriers: where MCP requests arrive. Each implements [`crate::transport::Carrier`].

pub mod http;
pub mod loopback;
pub mod stdio;
