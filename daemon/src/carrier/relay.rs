//! The `robota-mcpctl stdio` carrier: a control connection switched to newline-delimited
//! JSON-RPC (`mcp`), served by the attached session as the peer's uid, with the `[stdio]`
//! wire names and the same line bounds as `robota-mcpd --stdio`. A fresh attach (restart)
//! ends every relayed session.

use std::sync::Arc;

use robota_proto::{ErrorCode, Reply, Response};
use tokio::net::unix::OwnedWriteHalf;
use tokio_util::sync::CancellationToken;

use crate::config::Config;
use crate::control::{self, ControlReader};
use crate::mcp::{InFlight, McpServer, Wire};
use crate::metrics::Metrics;
use crate::session::Session;
use crate::vocab::{Caller, Carrier};

/// Serve one relayed session until the peer closes it or `ended` fires.
pub async fn serve(
    session: Option<Arc<Session>>,
    config: &Config,
    metrics: Metrics,
    reader: ControlReader,
    mut writer: OwnedWriteHalf,
    uid: u32,
    ended: CancellationToken,
) {
    let Some(session) = session else {
        let refusal = Response::error(
            ErrorCode::Unavailable,
            "no session is attached (the daemon is restarting)",
        );
        let _ = control::write_frame(&mut writer, &refusal).await;
        return;
    };
    let wire = Wire {
        result_limit: config.limits.tool_result,
        metrics: metrics.clone(),
    };
    let server = match McpServer::new(
        session,
        config.stdio.wire_names,
        config.stdio.aliases.clone(),
        Arc::new(InFlight::default()),
        wire,
    ) {
        Ok(server) => server,
        Err(e) => {
            let refusal = Response::error(ErrorCode::Internal, e.to_string());
            let _ = control::write_frame(&mut writer, &refusal).await;
            return;
        }
    };
    if control::write_frame(&mut writer, &Response::ok(Reply::Mcp))
        .await
        .is_err()
    {
        return;
    }
    metrics.admitted(Carrier::Stdio);
    tracing::info!(uid, "MCP session relayed over the control socket");
    let limit = usize::try_from(config.limits.request_body).unwrap_or(usize::MAX);
    let transport = super::lines::transport(reader, writer, limit, Caller::Local(uid));
    match rmcp::ServiceExt::serve_with_ct(server, transport, ended).await {
        Ok(running) => {
            let _ = running.waiting().await;
        }
        Err(e) => tracing::debug!(error = %e, "relayed MCP session ended during start-up"),
    }
}
