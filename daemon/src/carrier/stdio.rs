//! The stdio carrier: the catalog on stdin/stdout for a client that launched us.
//!
//! No admission: whoever writes our stdin already runs as our user, so every request's
//! caller is `local:<our uid>`. rmcp's own cancellation (`notifications/cancelled`)
//! applies. Logs never go to stdout.

use std::collections::BTreeMap;
use std::sync::Arc;

use rmcp::ServiceExt;

use crate::config::{StdioConfig, WireNameProfile};
use crate::mcp::McpServer;
use crate::session::{RuntimeTools, TurnSubmission};
use crate::transport::{Carrier, Drain};
use crate::vocab::Caller;

pub struct StdioCarrier {
    pub config: StdioConfig,
    /// Longest message (line) accepted: the request body limit.
    pub request_limit: u64,
}

impl Carrier for StdioCarrier {
    type Bound = (tokio::io::Stdin, tokio::io::Stdout);

    fn wire_names(&self) -> (WireNameProfile, BTreeMap<String, String>) {
        (self.config.wire_names, self.config.aliases.clone())
    }

    async fn bind(&self) -> std::io::Result<Self::Bound> {
        Ok((tokio::io::stdin(), tokio::io::stdout()))
    }

    fn address(_bound: &Self::Bound) -> String {
        "stdio".into()
    }

    async fn serve<S: RuntimeTools + TurnSubmission>(
        self: Arc<Self>,
        bound: Self::Bound,
        server: McpServer<S>,
        drain: Drain,
    ) {
        let (stdin, stdout) = bound;
        let limit = usize::try_from(self.request_limit).unwrap_or(usize::MAX);
        let caller = Caller::Local(nix::unistd::geteuid().as_raw());
        let transport = super::lines::transport(stdin, stdout, limit, caller);
        match server.serve_with_ct(transport, drain.accept).await {
            Ok(running) => {
                if let Err(e) = running.waiting().await {
                    tracing::warn!(error = %e, "stdio session ended abnormally");
                }
            }
            Err(e) => tracing::warn!(error = %e, "stdio session did not start"),
        }
    }
}
