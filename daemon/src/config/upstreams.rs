//! `[upstreams.<name>]`: downstream MCP servers whose tools join the catalog as
//! `<name>.<tool>` (docs/design.md §13). A stdio child (`command`) or a fixed local
//! Streamable HTTP backend (`url`); every key checked with its key path.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

use super::{DurationText, Issues, SizeText, check_name, size_of};

/// Defaults and ceilings of the bounds on what an upstream may send.
pub const RESPONSE_LIMIT_DEFAULT: u64 = 8 * 1024 * 1024;
pub const RESPONSE_LIMIT_CEILING: u64 = 64 * 1024 * 1024;
pub const STREAM_LIMIT_DEFAULT: u64 = 64 * 1024 * 1024;
pub const STREAM_LIMIT_CEILING: u64 = 1024 * 1024 * 1024;
/// Longest an upstream's name may be: `[a-z][a-z0-9-]{0,30}`.
pub const UPSTREAM_NAME_MAX: usize = 31;

/// One downstream MCP server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UpstreamConfig {
    /// `[a-z][a-z0-9-]{0,30}`: the prefix of its tools (`pg` → `pg.query`).
    pub name: String,
    pub endpoint: UpstreamEndpoint,
    pub protocol: UpstreamProtocol,
    /// Globs over the upstream's own tool names; empty imports every tool.
    pub tools: Vec<String>,
    /// Upstream tool name → the part of the canonical name after `<name>.`.
    pub aliases: BTreeMap<String, String>,
    pub call_timeout: Duration,
    /// Connecting, and the handshake with its tool listing.
    pub connect_timeout: Duration,
    pub restart: Backoff,
    /// Largest single message (a stdout line, a JSON body, one SSE event).
    pub response_limit: u64,
    /// Largest streamed (SSE) response, all events together.
    pub stream_limit: u64,
    /// A changed tool surface is held until the operator approves it (default true).
    pub pin: bool,
}

/// How the server is reached.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum UpstreamEndpoint {
    /// A fixed executable, its argv, its whole environment (PATH added when absent).
    Command {
        argv: Vec<String>,
        env: BTreeMap<String, String>,
        cwd: Option<PathBuf>,
        children: Children,
        confine: Confine,
    },
    /// Streamable HTTP on a loopback address or a unix socket.
    Http {
        target: HttpTarget,
        /// The HTTP path of the MCP endpoint (with its query, if any).
        path: String,
        /// A credential of the daemon's own, sent as `Authorization: Bearer`.
        bearer_file: Option<PathBuf>,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HttpTarget {
    /// `http://127.0.0.1:9100/mcp`: the address and the `Host` header value.
    Tcp { addr: SocketAddr, authority: String },
    /// `unix:/run/search.sock`.
    Unix(PathBuf),
}

/// What a stdio upstream's processes may reach (`upstream::confine` enforces it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Confine {
    /// `confine = false`: the child runs with everything the daemon's user has.
    pub enabled: bool,
    pub network: Network,
    /// Beyond the system's read-only view.
    pub read_paths: Vec<PathBuf>,
    /// The only places it may write, besides its own home and private tmp.
    pub write_paths: Vec<PathBuf>,
    /// What its whole process tree may use (`memory = "unbounded"`: none).
    pub memory: Option<u64>,
}

/// A stdio child's process tree's memory unless its table says otherwise.
const CHILD_MEMORY_DEFAULT: u64 = 1 << 30;
/// The least `memory` a stdio child may be given: a process tree needs more.
const MEMORY_FLOOR: u64 = 16 << 20;

/// Whether a confined child may use the network.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Network {
    /// No TCP connection and no TCP listener.
    None,
    Any,
}

impl Network {
    pub fn as_str(self) -> &'static str {
        match self {
            Network::None => "none",
            Network::Any => "any",
        }
    }
}

/// Child processes of a stdio upstream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Children {
    /// One supervised child serves every call.
    Shared,
    /// A fresh child for each `tools/call` (and one to list the tools), no state shared.
    PerCall,
}

/// The MCP revision spoken toward the upstream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub enum UpstreamProtocol {
    /// `server/discover` first; `initialize` (2025-11-25) when the server does not know it.
    #[serde(rename = "auto")]
    Auto,
    #[serde(rename = "2025-11-25")]
    V2025_11_25,
    #[serde(rename = "2026-07-28")]
    V2026_07_28,
}

impl UpstreamProtocol {
    pub fn as_str(self) -> &'static str {
        match self {
            UpstreamProtocol::Auto => "auto",
            UpstreamProtocol::V2025_11_25 => "2025-11-25",
            UpstreamProtocol::V2026_07_28 => "2026-07-28",
        }
    }
}

/// Exponential backoff of a shared child or an HTTP backend: `initial`, doubling up to
/// `max`; back to `initial` after a healthy minute.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    pub initial: Duration,
    pub max: Duration,
}

impl Backoff {
    pub const DEFAULT: Backoff = Backoff {
        initial: Duration::from_secs(1),
        max: Duration::from_secs(60),
    };
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawUpstream {
    command: Option<Vec<String>>,
    env: Option<BTreeMap<String, String>>,
    cwd: Option<PathBuf>,
    children: Option<Children>,
    confine: Option<bool>,
    network: Option<Network>,
    read_paths: Option<Vec<PathBuf>>,
    write_paths: Option<Vec<PathBuf>>,
    memory: Option<MemoryText>,
    url: Option<String>,
    path: Option<String>,
    bearer_file: Option<PathBuf>,
    protocol: Option<UpstreamProtocol>,
    tools: Option<Vec<String>>,
    call_timeout: Option<DurationText>,
    connect_timeout: Option<DurationText>,
    restart: Option<RawBackoff>,
    response_limit: Option<SizeText>,
    stream_limit: Option<SizeText>,
    pin: Option<bool>,
    #[serde(default)]
    aliases: BTreeMap<String, String>,
}

/// `memory = "512MiB"`, or `"unbounded"`.
#[derive(Debug, Clone, Copy)]
struct MemoryText(Option<u64>);

impl<'de> Deserialize<'de> for MemoryText {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        if s.trim() == "unbounded" {
            return Ok(MemoryText(None));
        }
        size_of(&s).map(|m| MemoryText(Some(m))).map_err(|e| {
            serde::de::Error::custom(format!("{e}; write e.g. \"512MiB\", or \"unbounded\""))
        })
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawBackoff {
    initial: Option<DurationText>,
    max: Option<DurationText>,
}

/// `[a-z][a-z0-9-]{0,30}`.
pub fn check_upstream_name(name: &str) -> Result<(), String> {
    let mut chars = name.chars();
    let first_ok = chars.next().is_some_and(|c| c.is_ascii_lowercase());
    if !first_ok
        || name.len() > UPSTREAM_NAME_MAX
        || !chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
    {
        return Err(format!(
            "an upstream name is a lower-case letter, then at most 30 of [a-z0-9-]; got {name:?}"
        ));
    }
    Ok(())
}

fn within(
    key: &str,
    value: Option<DurationText>,
    default: Duration,
    range: (Duration, Duration),
    issues: &mut Issues,
) -> Duration {
    let d = value.map_or(default, |d| d.0);
    if d < range.0 || d > range.1 {
        issues.add(
            key,
            format!(
                "must be between {} and {}, got {}",
                humantime::format_duration(range.0),
                humantime::format_duration(range.1),
                humantime::format_duration(d)
            ),
        );
    }
    d
}

fn size(
    key: &str,
    value: Option<SizeText>,
    default: u64,
    ceiling: u64,
    issues: &mut Issues,
) -> u64 {
    let v = value.map_or(default, |s| s.0);
    if v == 0 || v > ceiling {
        issues.add(
            key,
            format!("must be between 1 byte and {ceiling} bytes, got {v} bytes"),
        );
    }
    v
}

/// Parses `url`: `http://<loopback address>:<port>/<path>` or `unix:/<socket path>`.
fn parse_url(text: &str) -> Result<(HttpTarget, Option<String>), String> {
    if let Some(path) = text.strip_prefix("unix:") {
        let path = Path::new(path);
        if !path.is_absolute() {
            return Err(format!(
                "a unix socket URL names an absolute path (unix:/run/x.sock), got {text:?}"
            ));
        }
        if path.as_os_str().len() > 107 {
            return Err("the socket path is longer than a unix socket address allows".into());
        }
        return Ok((HttpTarget::Unix(path.to_owned()), None));
    }
    let uri: http::Uri = text.parse().map_err(|_| format!("not a URL: {text:?}"))?;
    if uri.scheme_str() != Some("http") {
        return Err(format!(
            "must be http:// on a loopback address, or unix:/path; got {text:?} (the daemon never sends an upstream request off the host)"
        ));
    }
    let authority = uri
        .authority()
        .ok_or_else(|| format!("has no host: {text:?}"))?;
    if authority.as_str().contains('@') {
        return Err(format!("must not carry user-info, got {text:?}"));
    }
    if text.contains('#') {
        return Err(format!("must not carry a fragment, got {text:?}"));
    }
    let host = authority.host();
    let ip: IpAddr = if host.eq_ignore_ascii_case("localhost") {
        IpAddr::V4(Ipv4Addr::LOCALHOST)
    } else {
        host.trim_start_matches('[')
            .trim_end_matches(']')
            .parse()
            .map_err(|_| {
                format!("the host must be a loopback address (127.0.0.1, [::1]) or localhost, got {host:?}")
            })?
    };
    if !ip.is_loopback() {
        return Err(format!(
            "the host must be a loopback address, got {host:?}: upstream servers are reached on this host only"
        ));
    }
    let port = authority
        .port_u16()
        .ok_or_else(|| format!("must name a port, got {text:?}"))?;
    let path = uri
        .path_and_query()
        .map_or("/".to_owned(), |p| p.as_str().to_owned());
    let path = if path.is_empty() {
        "/".to_owned()
    } else {
        path
    };
    Ok((
        HttpTarget::Tcp {
            addr: SocketAddr::new(ip, port),
            authority: authority.as_str().to_owned(),
        },
        Some(path),
    ))
}

pub(super) fn validate(
    raw: BTreeMap<String, RawUpstream>,
    issues: &mut Issues,
) -> Vec<UpstreamConfig> {
    let mut out = Vec::new();
    for (name, u) in raw {
        let key = |k: &str| format!("upstreams.{name}.{k}");
        if let Err(problem) = check_upstream_name(&name) {
            issues.add(format!("upstreams.{name}"), problem);
        }
        let endpoint = match (u.command, u.url) {
            (Some(_), Some(_)) => {
                issues.add(
                    format!("upstreams.{name}"),
                    "give either `command` (a stdio child) or `url` (an HTTP backend), not both",
                );
                continue;
            }
            (None, None) => {
                issues.add(
                    format!("upstreams.{name}"),
                    "needs `command` (a stdio child) or `url` (an HTTP backend)",
                );
                continue;
            }
            (Some(argv), None) => {
                match argv.first() {
                    None => issues.add(key("command"), "must name an executable"),
                    Some(exe) if !Path::new(exe).is_absolute() => issues.add(
                        key("command"),
                        format!("the executable must be an absolute path, got {exe:?}"),
                    ),
                    Some(_) => {}
                }
                if argv.iter().any(|a| a.contains('\0')) {
                    issues.add(key("command"), "an argument holds a NUL byte");
                }
                let env = u.env.unwrap_or_default();
                for (k, v) in &env {
                    if k.is_empty() || k.contains('=') || k.contains('\0') || v.contains('\0') {
                        issues.add(key("env"), format!("bad variable {k:?}"));
                    }
                }
                if let Some(dir) = &u.cwd
                    && !dir.is_absolute()
                {
                    issues.add(
                        key("cwd"),
                        format!("must be an absolute path, got {}", dir.display()),
                    );
                }
                for (k, given) in [
                    ("path", u.path.is_some()),
                    ("bearer_file", u.bearer_file.is_some()),
                    ("stream_limit", u.stream_limit.is_some()),
                ] {
                    if given {
                        issues.add(key(k), "applies to an HTTP backend (`url`) only");
                    }
                }
                for (k, paths) in [
                    ("read_paths", &u.read_paths),
                    ("write_paths", &u.write_paths),
                ] {
                    for p in paths.iter().flatten() {
                        if !p.is_absolute() {
                            issues.add(
                                key(k),
                                format!("must hold absolute paths, got {}", p.display()),
                            );
                        }
                    }
                }
                let memory = u.memory.map_or(Some(CHILD_MEMORY_DEFAULT), |m| m.0);
                match memory {
                    Some(m) if m < MEMORY_FLOOR => issues.add(
                        key("memory"),
                        format!(
                            "must be at least {} MiB (a process tree needs more), got {m} bytes; or \"unbounded\"",
                            MEMORY_FLOOR >> 20
                        ),
                    ),
                    Some(_) => {}
                    None => issues.warn(
                        key("memory"),
                        "the server's process tree may use all the memory the daemon's unit allows",
                    ),
                }
                if u.confine == Some(false) {
                    issues.warn(
                        key("confine"),
                        "the server runs unconfined, with everything the daemon's user may read, write and reach: the daemon's store, audit, configuration, secrets and control socket included",
                    );
                }
                UpstreamEndpoint::Command {
                    argv,
                    env,
                    cwd: u.cwd,
                    children: u.children.unwrap_or(Children::Shared),
                    confine: Confine {
                        enabled: u.confine.unwrap_or(true),
                        network: u.network.unwrap_or(Network::None),
                        read_paths: u.read_paths.unwrap_or_default(),
                        write_paths: u.write_paths.unwrap_or_default(),
                        memory,
                    },
                }
            }
            (None, Some(url)) => {
                for (k, given) in [
                    ("env", u.env.is_some()),
                    ("cwd", u.cwd.is_some()),
                    ("children", u.children.is_some()),
                    ("confine", u.confine.is_some()),
                    ("network", u.network.is_some()),
                    ("read_paths", u.read_paths.is_some()),
                    ("write_paths", u.write_paths.is_some()),
                    ("memory", u.memory.is_some()),
                ] {
                    if given {
                        issues.add(key(k), "applies to a stdio child (`command`) only");
                    }
                }
                let (target, url_path) = match parse_url(&url) {
                    Ok(parsed) => parsed,
                    Err(problem) => {
                        issues.add(key("url"), problem);
                        continue;
                    }
                };
                let path = match (url_path, u.path) {
                    (Some(_), Some(_)) => {
                        issues.add(
                            key("path"),
                            "an http:// URL carries its own path; `path` is for unix: URLs",
                        );
                        "/mcp".to_owned()
                    }
                    (Some(p), None) => p,
                    (None, Some(p)) => {
                        if !p.starts_with('/') || p.parse::<http::uri::PathAndQuery>().is_err() {
                            issues.add(
                                key("path"),
                                format!("must be an absolute HTTP path, got {p:?}"),
                            );
                        }
                        p
                    }
                    (None, None) => "/mcp".to_owned(),
                };
                if let Some(file) = &u.bearer_file
                    && !file.is_absolute()
                {
                    issues.add(
                        key("bearer_file"),
                        format!("must be an absolute path, got {}", file.display()),
                    );
                }
                UpstreamEndpoint::Http {
                    target,
                    path,
                    bearer_file: u.bearer_file,
                }
            }
        };
        let tools = u.tools.unwrap_or_default();
        for (i, glob) in tools.iter().enumerate() {
            if glob.is_empty() || glob.chars().any(char::is_control) {
                issues.add(
                    format!("upstreams.{name}.tools[{i}]"),
                    format!("not a tool name pattern: {glob:?}"),
                );
            }
        }
        let mut targets: BTreeMap<&str, &str> = BTreeMap::new();
        for (tool, alias) in &u.aliases {
            let at = format!("upstreams.{name}.aliases.{tool:?}");
            if let Err(problem) = check_name(&format!("{name}.{alias}")) {
                issues.add(
                    &at,
                    format!("{name}.{alias} is not a valid tool name: {problem}"),
                );
            }
            if let Some(other) = targets.insert(alias.as_str(), tool.as_str()) {
                issues.add(
                    &at,
                    format!("{other:?} and {tool:?} would both be imported as {name}.{alias}"),
                );
            }
        }
        let hour = Duration::from_secs(3600);
        let call_timeout = within(
            &key("call_timeout"),
            u.call_timeout,
            Duration::from_secs(60),
            (Duration::from_millis(1), 24 * hour),
            issues,
        );
        let connect_timeout = within(
            &key("connect_timeout"),
            u.connect_timeout,
            Duration::from_secs(10),
            (Duration::from_millis(1), Duration::from_secs(300)),
            issues,
        );
        let restart = u.restart.map_or(Backoff::DEFAULT, |r| {
            let initial = within(
                &key("restart.initial"),
                r.initial,
                Backoff::DEFAULT.initial,
                (Duration::from_millis(10), hour),
                issues,
            );
            let max = within(
                &key("restart.max"),
                r.max,
                Backoff::DEFAULT.max.max(initial),
                (Duration::from_millis(10), 24 * hour),
                issues,
            );
            if max < initial {
                issues.add(key("restart.max"), "must not be less than restart.initial");
            }
            Backoff { initial, max }
        });
        let response_limit = size(
            &key("response_limit"),
            u.response_limit,
            RESPONSE_LIMIT_DEFAULT,
            RESPONSE_LIMIT_CEILING,
            issues,
        );
        let stream_limit = size(
            &key("stream_limit"),
            u.stream_limit,
            STREAM_LIMIT_DEFAULT.max(response_limit),
            STREAM_LIMIT_CEILING,
            issues,
        );
        out.push(UpstreamConfig {
            name,
            endpoint,
            protocol: u.protocol.unwrap_or(UpstreamProtocol::Auto),
            tools,
            aliases: u.aliases,
            call_timeout,
            connect_timeout,
            restart,
            response_limit,
            stream_limit,
            pin: u.pin.unwrap_or(true),
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::super::{Environment, parse};
    use super::*;

    fn env() -> Environment {
        Environment {
            runtime_directory: Some("/run/robota-mcpd".into()),
            state_directory: Some("/var/lib/robota-mcpd".into()),
            ..Environment::default()
        }
    }

    fn paths(text: &str) -> Vec<String> {
        parse(text, &env())
            .expect_err("refused")
            .into_iter()
            .map(|i| i.path)
            .collect()
    }

    #[test]
    fn the_spec_example_parses_with_its_defaults() {
        let config = parse(
            r#"
[upstreams.pg]
command = ["/usr/local/bin/pg-mcp", "--read-only"]
env = { PGHOST = "/run/postgresql" }
cwd = "/var/lib/robota-mcpd"
children = "shared"
protocol = "auto"
tools = ["query", "list_*"]
call_timeout = "60s"
restart = { initial = "1s", max = "60s" }
[upstreams.pg.aliases]
"run query" = "run_query"

[upstreams.search]
url = "http://127.0.0.1:9100/mcp"
bearer_file = "/etc/robota-mcpd/search.token"

[upstreams.local]
url = "unix:/run/local-mcp.sock"
protocol = "2026-07-28"
"#,
            &env(),
        )
        .expect("valid");
        let u = &config.upstreams;
        assert_eq!(u.len(), 3);
        let local = &u[0];
        assert_eq!(local.name, "local");
        assert_eq!(
            local.endpoint,
            UpstreamEndpoint::Http {
                target: HttpTarget::Unix("/run/local-mcp.sock".into()),
                path: "/mcp".into(),
                bearer_file: None
            }
        );
        assert_eq!(local.protocol, UpstreamProtocol::V2026_07_28);
        let pg = &u[1];
        assert!(matches!(
            &pg.endpoint,
            UpstreamEndpoint::Command { children: Children::Shared, env, .. } if env["PGHOST"] == "/run/postgresql"
        ));
        assert_eq!(pg.aliases["run query"], "run_query");
        assert_eq!(pg.restart, Backoff::DEFAULT);
        assert_eq!(pg.response_limit, RESPONSE_LIMIT_DEFAULT);
        let search = &u[2];
        assert!(matches!(
            &search.endpoint,
            UpstreamEndpoint::Http { target: HttpTarget::Tcp { addr, authority }, path, .. }
                if addr.port() == 9100 && authority == "127.0.0.1:9100" && path == "/mcp"
        ));
        assert_eq!(search.call_timeout, Duration::from_secs(60));
        assert_eq!(search.stream_limit, STREAM_LIMIT_DEFAULT);
    }

    #[test]
    fn every_bad_key_is_named() {
        let found = paths(
            r#"
[upstreams.Bad_Name]
command = ["/bin/true"]
[upstreams.both]
command = ["/bin/true"]
url = "http://127.0.0.1:1/mcp"
[upstreams.none]
protocol = "auto"
[upstreams.rel]
command = ["true"]
cwd = "tmp"
env = { "A=B" = "x" }
bearer_file = "/x"
[upstreams.remote]
url = "http://10.0.0.1:80/mcp"
children = "per-call"
[upstreams.dns]
url = "http://example.com:80/mcp"
[upstreams.tls]
url = "https://127.0.0.1:443/mcp"
[upstreams.sock]
url = "unix:run/x.sock"
[upstreams.lim]
url = "unix:/run/x.sock"
path = "mcp"
call_timeout = "0s"
response_limit = "65MiB"
stream_limit = "2GiB"
restart = { initial = "10s", max = "1s" }
[upstreams.lim.aliases]
"a" = "same"
"b" = "same"
"c" = "bad name"
"#,
        );
        assert_eq!(
            found,
            [
                "upstreams.Bad_Name",
                "upstreams.both",
                "upstreams.dns.url",
                "upstreams.lim.path",
                "upstreams.lim.aliases.\"b\"",
                "upstreams.lim.aliases.\"c\"",
                "upstreams.lim.call_timeout",
                "upstreams.lim.restart.max",
                "upstreams.lim.response_limit",
                "upstreams.lim.stream_limit",
                "upstreams.none",
                "upstreams.rel.command",
                "upstreams.rel.env",
                "upstreams.rel.cwd",
                "upstreams.rel.bearer_file",
                "upstreams.remote.children",
                "upstreams.remote.url",
                "upstreams.sock.url",
                "upstreams.tls.url",
            ]
        );
    }

    #[test]
    fn confinement_is_the_default_and_its_keys_are_checked() {
        let config = parse(
            "[upstreams.a]\ncommand = [\"/bin/true\"]\n\n[upstreams.b]\ncommand = [\"/bin/true\"]\n\
             network = \"any\"\nread_paths = [\"/srv/docs\"]\nwrite_paths = [\"/var/lib/b\"]\n\
             memory = \"512MiB\"\n\n\
             [upstreams.c]\ncommand = [\"/bin/true\"]\nconfine = false\n\n\
             [upstreams.d]\ncommand = [\"/bin/true\"]\nmemory = \"unbounded\"\n",
            &env(),
        )
        .expect("valid");
        let confine = |i: usize| match &config.upstreams[i].endpoint {
            UpstreamEndpoint::Command { confine, .. } => confine.clone(),
            other => panic!("{other:?}"),
        };
        assert_eq!(
            confine(0),
            Confine {
                enabled: true,
                network: Network::None,
                read_paths: Vec::new(),
                write_paths: Vec::new(),
                memory: Some(1 << 30),
            }
        );
        assert_eq!(confine(1).network, Network::Any);
        assert_eq!(confine(1).memory, Some(512 << 20));
        assert_eq!(confine(3).memory, None);
        assert_eq!(confine(1).read_paths, [PathBuf::from("/srv/docs")]);
        assert_eq!(confine(1).write_paths, [PathBuf::from("/var/lib/b")]);
        assert!(!confine(2).enabled);
        // An unconfined server, or one without a memory bound, is a warning, with why.
        let warned: Vec<_> = config.warnings.iter().map(|w| w.path.as_str()).collect();
        assert_eq!(warned, ["upstreams.c.confine", "upstreams.d.memory"]);
        assert!(config.warnings[0].problem.contains("unconfined"));
        assert!(config.warnings[1].problem.contains("all the memory"));
        let found = paths(
            "[upstreams.a]\ncommand = [\"/bin/true\"]\nread_paths = [\"srv\"]\nwrite_paths = [\"x\"]\n\
             memory = \"4MiB\"\n\
             [upstreams.h]\nurl = \"http://127.0.0.1:1/mcp\"\nnetwork = \"none\"\nmemory = \"1GiB\"\n",
        );
        assert_eq!(
            found,
            [
                "upstreams.a.read_paths",
                "upstreams.a.write_paths",
                "upstreams.a.memory",
                "upstreams.h.network",
                "upstreams.h.memory",
            ]
        );
        let found = paths("[upstreams.i]\ncommand = [\"/bin/true\"]\nmemory = \"lots\"\n");
        assert_eq!(found, ["upstreams.i.memory"]);
        let found = paths("[upstreams.n]\ncommand = [\"/bin/true\"]\nnetwork = \"some\"\n");
        assert_eq!(found, ["upstreams.n.network"]);
    }

    #[test]
    fn unknown_keys_and_values_name_their_path() {
        let found = paths("[upstreams.pg]\ncommand = [\"/bin/true\"]\nchildren = \"pooled\"\n");
        assert_eq!(found, ["upstreams.pg.children"]);
        let found = paths("[upstreams.pg]\ncommand = [\"/bin/true\"]\nprotocol = \"2024-11-05\"\n");
        assert_eq!(found, ["upstreams.pg.protocol"]);
        let found = paths("[upstreams.pg]\ncommand = [\"/bin/true\"]\nretries = 3\n");
        assert_eq!(found, ["upstreams.pg.retries"]);
    }

    #[test]
    fn names_and_loopback_urls() {
        for ok in ["a", "pg", "my-search", &format!("a{}", "b".repeat(30))] {
            assert!(check_upstream_name(ok).is_ok(), "{ok}");
        }
        for bad in [
            "",
            "1pg",
            "-a",
            "Pg",
            "p_g",
            "p.g",
            &format!("a{}", "b".repeat(31)),
        ] {
            assert!(check_upstream_name(bad).is_err(), "{bad}");
        }
        for ok in [
            "http://127.0.0.1:9/mcp",
            "http://127.1.2.3:9/",
            "http://[::1]:9/mcp?x=1",
            "http://localhost:9/mcp",
        ] {
            assert!(parse_url(ok).is_ok(), "{ok}");
        }
        assert_eq!(
            parse_url("http://[::1]:9/a?x=1").unwrap().1.as_deref(),
            Some("/a?x=1")
        );
        for bad in [
            "http://127.0.0.1/mcp",
            "http://u:p@127.0.0.1:9/mcp",
            "http://0.0.0.0:9/mcp",
            "http://192.168.1.1:9/mcp",
            "ftp://127.0.0.1:9/",
            "unix:",
        ] {
            assert!(parse_url(bad).is_err(), "{bad}");
        }
    }
}
