//! A real MCP client (rmcp, Streamable HTTP, MCP 2025-11-25) on the loopback carrier, and
//! the shape of a tool result as the host tools' tests read it.

use std::time::Duration;

use rmcp::RoleClient;
use rmcp::model::{CallToolRequestParams, ClientConfig, JsonObject, ProtocolVersion};
use rmcp::service::{ClientLifecycleMode, ClientServiceExt, RunningService};
use rmcp::transport::StreamableHttpClientTransport;
use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
use serde_json::Value;

use crate::{Daemon, within};

const LIMIT: Duration = Duration::from_secs(30);

/// A connected rmcp client acting as one bearer.
pub struct McpClient {
    inner: RunningService<RoleClient, ClientConfig>,
}

/// What a `tools/call` came back with.
#[derive(Debug, Clone)]
pub struct ToolResult {
    pub is_error: bool,
    /// `structuredContent` (for errors: `{code, message}`).
    pub structured: Value,
    /// The text blocks, joined.
    pub text: String,
}

impl ToolResult {
    /// The closed-set error code of a visible tool error, if this is one.
    pub fn error_code(&self) -> Option<&str> {
        if self.is_error {
            self.structured.get("code").and_then(Value::as_str)
        } else {
            None
        }
    }

    /// Panics with the whole result unless the call succeeded.
    pub fn ok(self, what: &str) -> Value {
        assert!(!self.is_error, "{what}: expected success, got {self:?}");
        self.structured
    }

    /// Panics unless the call failed with `code`; returns the message.
    pub fn err(self, code: &str, what: &str) -> String {
        assert_eq!(self.error_code(), Some(code), "{what}: {self:?}");
        self.structured["message"]
            .as_str()
            .unwrap_or_default()
            .to_owned()
    }
}

impl McpClient {
    /// Connect to `d`'s loopback carrier with `bearer` (initialize, 2025-11-25).
    pub async fn connect(d: &Daemon, bearer: &str) -> McpClient {
        Self::connect_as(
            d,
            bearer,
            ClientConfig::default().with_protocol_version(ProtocolVersion::V_2025_11_25),
            ClientLifecycleMode::Initialize,
        )
        .await
    }

    /// Connect as a 2026-07-28 client (`server/discover`) that declares the Tasks
    /// extension (`io.modelcontextprotocol/tasks`).
    pub async fn connect_with_tasks(d: &Daemon, bearer: &str) -> McpClient {
        let mut config = ClientConfig::default();
        config.capabilities = serde_json::from_value(serde_json::json!({
            "extensions": {"io.modelcontextprotocol/tasks": {}}
        }))
        .expect("client capabilities");
        Self::connect_as(
            d,
            bearer,
            config,
            ClientLifecycleMode::Discover {
                preferred_versions: vec![ProtocolVersion::V_2026_07_28],
            },
        )
        .await
    }

    /// The rmcp peer, for requests the helpers here do not wrap (tasks).
    pub fn peer(&self) -> &RunningService<RoleClient, ClientConfig> {
        &self.inner
    }

    async fn connect_as(
        d: &Daemon,
        bearer: &str,
        client_config: ClientConfig,
        mode: ClientLifecycleMode,
    ) -> McpClient {
        let config = StreamableHttpClientTransportConfig::with_uri(format!(
            "http://{}/mcp",
            d.loopback_addr()
        ))
        .auth_header(bearer);
        let http = reqwest::Client::builder()
            .no_proxy()
            .timeout(LIMIT)
            .build()
            .expect("reqwest client");
        let transport = StreamableHttpClientTransport::with_client(http, config);
        let inner = within(
            LIMIT,
            "MCP client start",
            client_config.serve_with_lifecycle(transport, mode),
        )
        .await
        .expect("MCP client lifecycle");
        McpClient { inner }
    }

    /// Canonical names of the listed tools.
    pub async fn tool_names(&self) -> Vec<String> {
        within(LIMIT, "tools/list", self.inner.list_all_tools())
            .await
            .expect("tools/list")
            .into_iter()
            .map(|t| t.name.to_string())
            .collect()
    }

    /// `tools/call`; a JSON-RPC error panics (host tools answer with visible tool errors).
    pub async fn call(&self, tool: &str, args: Value) -> ToolResult {
        let args: JsonObject = match args {
            Value::Object(map) => map,
            other => panic!("tool arguments must be an object, got {other}"),
        };
        let result = within(
            LIMIT,
            "tools/call",
            self.inner
                .call_tool(CallToolRequestParams::new(tool.to_owned()).with_arguments(args)),
        )
        .await
        .unwrap_or_else(|e| panic!("tools/call {tool}: JSON-RPC error {e}"));
        let text = result
            .content
            .iter()
            .filter_map(|c| c.as_text().map(|t| t.text.clone()))
            .collect::<String>();
        ToolResult {
            is_error: result.is_error.unwrap_or(false),
            structured: result.structured_content.clone().unwrap_or(Value::Null),
            text,
        }
    }

    pub async fn close(self) {
        let _ = within(LIMIT, "client close", self.inner.cancel()).await;
    }
}
