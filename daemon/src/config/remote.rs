//! `[remote]`: the remote carrier, an OAuth 2 resource server (docs/design.md §6) — its
//! listener and public URL, the issuer and its keys, audiences, scopes and the principal
//! allow-list, `[remote.introspection]`, `[remote.throttle]`, `[remote.key_refresh]`,
//! `[remote.tls]` and `[remote.tool_scopes]`; every key checked with its key path.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

use super::{
    DurationText, HttpLimits, Issues, KeyRefresh, KeySource, PublicUrl, SizeText, WireNameProfile,
    check_name, check_scope, check_tool_pattern, holds_public, parse_net, validate_bounds, yes,
};

/// The remote carrier: an OAuth 2 resource server (docs/design.md §6).
#[derive(Debug, Clone)]
pub struct RemoteConfig {
    pub listen: SocketAddr,
    pub public_url: PublicUrl,
    pub issuer: String,
    pub keys: KeySource,
    pub ca_file: Option<PathBuf>,
    pub audiences: Vec<String>,
    pub scopes: Vec<String>,
    pub allowed_subjects: Vec<String>,
    pub allowed_clients: Vec<String>,
    pub algorithms: Vec<jsonwebtoken::Algorithm>,
    pub trusted_proxies: Vec<ipnet::IpNet>,
    pub start_without_keys: bool,
    pub key_refresh: KeyRefresh,
    pub throttle: ThrottleConfig,
    pub tls: Option<TlsFiles>,
    pub wire_names: WireNameProfile,
    pub aliases: BTreeMap<String, String>,
    pub bounds: HttpLimits,
    /// `[remote.introspection]`: opaque (non-JWT) access tokens are checked at the
    /// issuer's RFC 7662 endpoint; without it they are `malformed`.
    pub introspection: Option<IntrospectionConfig>,
    /// `[remote.tool_scopes]`: canonical tool-name pattern → scopes a `tools/call` of a
    /// matching tool needs beyond `scopes` (every matching pattern adds its own).
    pub tool_scopes: Vec<(String, Vec<String>)>,
    /// Every scope the configuration names — `scopes`, `tool_scopes`, and the `scopes` of
    /// `[[policy]]` rules — each once: the metadata's `scopes_supported`.
    pub scopes_supported: Vec<String>,
}

impl RemoteConfig {
    /// The scopes a call of canonical tool `tool` needs: `scopes`, then those of every
    /// `[remote.tool_scopes]` pattern that matches, each once, in that order.
    pub fn scopes_for(&self, tool: &str) -> Vec<String> {
        let mut needed = self.scopes.clone();
        for (pattern, scopes) in &self.tool_scopes {
            if glob_match::glob_match(pattern, tool) {
                for scope in scopes {
                    if !needed.contains(scope) {
                        needed.push(scope.clone());
                    }
                }
            }
        }
        needed
    }
}

/// `[remote.introspection]` (RFC 7662).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IntrospectionConfig {
    /// The https endpoint; `None`: the issuer metadata's `introspection_endpoint`.
    pub endpoint: Option<String>,
    pub client_id: String,
    /// A file of mode 0600 (or stricter) holding the client secret; read when the
    /// verifier is built.
    pub client_secret_file: PathBuf,
    pub auth: crate::vocab::ClientAuth,
    /// Longest an answer is reused (never past the token's `exp`); zero: never.
    pub cache: Duration,
}

impl IntrospectionConfig {
    /// Default and ceiling of `cache`.
    pub const CACHE_DEFAULT: Duration = Duration::from_secs(60);
    pub const CACHE_CEILING: Duration = Duration::from_secs(3600);
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ThrottleConfig {
    /// Failures per window before an address is answered 429.
    pub failures: u32,
    pub window: Duration,
    pub max_addresses: usize,
    /// IPv6 clients are counted by this prefix of their address (IPv4 by the address).
    pub ipv6_prefix: u8,
}

/// PEM certificate chain and private key for TLS termination.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawRemote {
    #[serde(default = "yes")]
    pub(super) enabled: bool,
    listen: Option<String>,
    public_url: Option<String>,
    issuer: Option<String>,
    jwks_uri: Option<String>,
    jwks_file: Option<PathBuf>,
    ca_file: Option<PathBuf>,
    audiences: Option<Vec<String>>,
    #[serde(default)]
    scopes: Vec<String>,
    #[serde(default)]
    allowed_subjects: Vec<String>,
    #[serde(default)]
    allowed_clients: Vec<String>,
    algorithms: Option<Vec<String>>,
    #[serde(default)]
    trusted_proxies: Vec<String>,
    #[serde(default)]
    start_without_keys: bool,
    #[serde(default)]
    key_refresh: RawKeyRefresh,
    #[serde(default)]
    throttle: RawThrottle,
    tls: Option<RawTls>,
    wire_names: Option<WireNameProfile>,
    #[serde(default)]
    aliases: BTreeMap<String, String>,
    max_connections: Option<usize>,
    max_connections_per_address: Option<usize>,
    max_in_flight: Option<usize>,
    max_in_flight_per_caller: Option<usize>,
    max_header_bytes: Option<SizeText>,
    header_timeout: Option<DurationText>,
    body_timeout: Option<DurationText>,
    idle_timeout: Option<DurationText>,
    introspection: Option<RawIntrospection>,
    #[serde(default)]
    tool_scopes: BTreeMap<String, Vec<String>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawIntrospection {
    endpoint: Option<String>,
    client_id: Option<String>,
    client_secret_file: Option<PathBuf>,
    auth_method: Option<String>,
    cache: Option<DurationText>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawThrottle {
    failures: Option<u32>,
    window: Option<DurationText>,
    max_addresses: Option<usize>,
    ipv6_prefix: Option<u8>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawKeyRefresh {
    default: Option<DurationText>,
    min: Option<DurationText>,
    max: Option<DurationText>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTls {
    cert: PathBuf,
    key: PathBuf,
}

pub(super) fn validate_remote(r: RawRemote, issues: &mut Issues) -> Option<RemoteConfig> {
    let listen_text = r.listen.unwrap_or_else(|| "0.0.0.0:8443".to_owned());
    let listen = listen_text.parse::<SocketAddr>().unwrap_or_else(|_| {
        issues.add(
            "remote.listen",
            format!("not an address:port, got {listen_text:?}"),
        );
        SocketAddr::from(([0, 0, 0, 0], 0))
    });
    let public_url = match r.public_url.as_deref().map(PublicUrl::parse) {
        Some(Ok(url)) => Some(url),
        Some(Err(problem)) => {
            issues.add("remote.public_url", problem);
            None
        }
        None => {
            issues.add(
                "remote.public_url",
                "required: the https URL clients use to reach this carrier",
            );
            None
        }
    };
    let https = |key: &str, value: &str, issues: &mut Issues| match value.parse::<http::Uri>() {
        Ok(uri) if uri.scheme_str() == Some("https") && uri.host().is_some() => {}
        _ => issues.add(key, format!("must be an https URL, got {value:?}")),
    };
    let issuer = r.issuer.unwrap_or_default();
    if issuer.is_empty() {
        issues.add(
            "remote.issuer",
            "required: the authorization server's issuer identifier",
        );
    } else {
        https("remote.issuer", &issuer, issues);
    }
    let keys = match (r.jwks_uri, r.jwks_file) {
        (Some(_), Some(_)) => {
            issues.add("remote.jwks_uri", "give jwks_uri or jwks_file, not both");
            KeySource::Discovery
        }
        (Some(uri), None) => {
            https("remote.jwks_uri", &uri, issues);
            KeySource::JwksUri(uri)
        }
        (None, Some(file)) => KeySource::JwksFile(file),
        (None, None) => KeySource::Discovery,
    };
    if r.allowed_subjects.is_empty() && r.allowed_clients.is_empty() {
        issues.add(
            "remote.allowed_subjects",
            "the remote carrier needs a principal allow-list: allowed_subjects and/or allowed_clients",
        );
    }
    let algorithms = match r.algorithms {
        None => vec![
            jsonwebtoken::Algorithm::RS256,
            jsonwebtoken::Algorithm::ES256,
            jsonwebtoken::Algorithm::EdDSA,
        ],
        Some(names) => {
            let mut out = Vec::new();
            for (i, name) in names.iter().enumerate() {
                match name.as_str() {
                    "RS256" => out.push(jsonwebtoken::Algorithm::RS256),
                    "ES256" => out.push(jsonwebtoken::Algorithm::ES256),
                    "EdDSA" => out.push(jsonwebtoken::Algorithm::EdDSA),
                    other => issues.add(
                        format!("remote.algorithms[{i}]"),
                        format!("{other:?} is not allowed; use RS256, ES256 or EdDSA"),
                    ),
                }
            }
            if names.is_empty() {
                issues.add("remote.algorithms", "must list at least one algorithm");
            }
            out
        }
    };
    let mut trusted_proxies = Vec::new();
    for (i, text) in r.trusted_proxies.iter().enumerate() {
        let key = format!("remote.trusted_proxies[{i}]");
        let Some(net) = parse_net(text) else {
            issues.add(key, format!("not an IP or CIDR: {text:?}"));
            continue;
        };
        // Whoever a trusted net holds may write X-Forwarded-For, so may pick the address it
        // is throttled as; every address is nobody's proxy, and no proxy fleet needs more
        // than a /8 (IPv4) or a /16 (IPv6) — two /1s are /0 again.
        let widest = match net {
            ipnet::IpNet::V4(_) => 8,
            ipnet::IpNet::V6(_) => 16,
        };
        if net.prefix_len() < widest {
            issues.add(
                key,
                format!(
                    "{net} trusts too many addresses (wider than /{widest}): any client there could forge X-Forwarded-For and escape throttling; list only the proxies in front of the daemon"
                ),
            );
            continue;
        }
        if holds_public(&net) {
            issues.warn(
                key,
                format!(
                    "{net} holds public addresses: a client there could forge X-Forwarded-For and pick its own throttling budget; list only the proxies in front of the daemon"
                ),
            );
        }
        trusted_proxies.push(net);
    }
    for (i, scope) in r.scopes.iter().enumerate() {
        if let Err(problem) = check_scope(scope) {
            issues.add(format!("remote.scopes[{i}]"), problem);
        }
    }
    let mut tool_scopes = Vec::with_capacity(r.tool_scopes.len());
    for (pattern, scopes) in r.tool_scopes {
        let key = format!("remote.tool_scopes.{}", toml_key(&pattern));
        if let Err(problem) = check_tool_pattern(&pattern) {
            issues.add(key.clone(), problem);
        }
        if scopes.is_empty() {
            issues.add(key.clone(), "must list at least one scope");
        }
        for (j, scope) in scopes.iter().enumerate() {
            if let Err(problem) = check_scope(scope) {
                issues.add(format!("{key}[{j}]"), problem);
            }
        }
        tool_scopes.push((pattern, scopes));
    }
    let introspection = r
        .introspection
        .and_then(|raw| validate_introspection(raw, issues));
    for (canonical, wire) in &r.aliases {
        if let Err(problem) = check_name(wire) {
            issues.add(format!("remote.aliases.{canonical}"), problem);
        }
    }
    let failures = r.throttle.failures.unwrap_or(20);
    if failures == 0 {
        issues.add("remote.throttle.failures", "must be at least 1");
    }
    let window = r.throttle.window.map_or(Duration::from_secs(60), |d| d.0);
    if window < Duration::from_secs(1) || window > Duration::from_secs(86_400) {
        issues.add("remote.throttle.window", "must be between 1s and 24h");
    }
    let max_addresses = r.throttle.max_addresses.unwrap_or(4096);
    if max_addresses == 0 || max_addresses > 1_048_576 {
        issues.add(
            "remote.throttle.max_addresses",
            "must be between 1 and 1048576",
        );
    }
    let ipv6_prefix = r.throttle.ipv6_prefix.unwrap_or(64);
    if !(32..=128).contains(&ipv6_prefix) {
        issues.add(
            "remote.throttle.ipv6_prefix",
            format!("must be between 32 and 128, got {ipv6_prefix}"),
        );
    }
    let key_refresh = validate_key_refresh(&r.key_refresh, issues);
    let bounds = validate_bounds(
        "remote",
        [
            r.max_connections,
            r.max_in_flight,
            r.max_in_flight_per_caller,
        ],
        (r.max_connections_per_address, Some(16)),
        r.max_header_bytes,
        [r.header_timeout, r.body_timeout, r.idle_timeout],
        issues,
    );
    let public_url = public_url?;
    let audiences = r
        .audiences
        .unwrap_or_else(|| vec![public_url.as_str().to_owned()]);
    if audiences.is_empty() {
        issues.add(
            "remote.audiences",
            "must list at least one audience (default: the public URL)",
        );
    }
    Some(RemoteConfig {
        listen,
        issuer,
        keys,
        ca_file: r.ca_file,
        audiences,
        scopes: r.scopes,
        allowed_subjects: r.allowed_subjects,
        allowed_clients: r.allowed_clients,
        algorithms,
        trusted_proxies,
        start_without_keys: r.start_without_keys,
        key_refresh,
        throttle: ThrottleConfig {
            failures,
            window,
            max_addresses,
            ipv6_prefix,
        },
        tls: r.tls.map(|t| TlsFiles {
            cert: t.cert,
            key: t.key,
        }),
        wire_names: r.wire_names.unwrap_or(WireNameProfile::Canonical),
        aliases: r.aliases,
        bounds,
        public_url,
        scopes_supported: Vec::new(),
        introspection,
        tool_scopes,
    })
}

/// `[remote.introspection]`: an https endpoint (or none: discovered), a client id, an
/// absolute secret file, an authentication method, a cache lifetime of 0s to 1h.
fn validate_introspection(
    raw: RawIntrospection,
    issues: &mut Issues,
) -> Option<IntrospectionConfig> {
    const AT: &str = "remote.introspection";
    if let Some(endpoint) = &raw.endpoint {
        let ok = endpoint.parse::<http::Uri>().is_ok_and(|u| {
            u.scheme_str() == Some("https")
                && u.host().is_some()
                && !u.authority().is_some_and(|a| a.as_str().contains('@'))
        });
        if !ok {
            issues.add(
                format!("{AT}.endpoint"),
                format!("must be an https URL without user-info, got {endpoint:?}"),
            );
        }
    }
    let client_id = raw.client_id.unwrap_or_default();
    if client_id.is_empty() || client_id.chars().any(char::is_control) {
        issues.add(
            format!("{AT}.client_id"),
            "required: the daemon's client id at the authorization server",
        );
    }
    let secret = match raw.client_secret_file {
        Some(path) if path.is_absolute() => Some(path),
        Some(path) => {
            issues.add(
                format!("{AT}.client_secret_file"),
                format!("must be an absolute path, got {}", path.display()),
            );
            None
        }
        None => {
            issues.add(
                format!("{AT}.client_secret_file"),
                "required: a file of mode 0600 holding the client secret",
            );
            None
        }
    };
    let auth = match raw.auth_method.as_deref() {
        None => crate::vocab::ClientAuth::ClientSecretBasic,
        Some(text) => match crate::vocab::ClientAuth::parse(text) {
            Some(auth) => auth,
            None => {
                issues.add(
                    format!("{AT}.auth_method"),
                    format!("{text:?} is not client_secret_basic or client_secret_post"),
                );
                crate::vocab::ClientAuth::ClientSecretBasic
            }
        },
    };
    let cache = raw
        .cache
        .map_or(IntrospectionConfig::CACHE_DEFAULT, |d| d.0);
    if cache > IntrospectionConfig::CACHE_CEILING {
        issues.add(format!("{AT}.cache"), "must be between 0s and 1h");
    }
    Some(IntrospectionConfig {
        endpoint: raw.endpoint,
        client_id,
        client_secret_file: secret?,
        auth,
        cache,
    })
}

/// A key as a TOML path segment: bare when it can be, else quoted.
fn toml_key(key: &str) -> String {
    if !key.is_empty()
        && key
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "_-".contains(c))
    {
        key.to_owned()
    } else {
        format!("{key:?}")
    }
}

/// `[remote.key_refresh]`: each bound 1s to 7d, `min <= default <= max`.
fn validate_key_refresh(raw: &RawKeyRefresh, issues: &mut Issues) -> KeyRefresh {
    let d = KeyRefresh::DEFAULT;
    let refresh = KeyRefresh {
        default: raw.default.map_or(d.default, |t| t.0),
        min: raw.min.map_or(d.min, |t| t.0),
        max: raw.max.map_or(d.max, |t| t.0),
    };
    let mut in_range = true;
    for (key, value) in [
        ("default", refresh.default),
        ("min", refresh.min),
        ("max", refresh.max),
    ] {
        if !KeyRefresh::RANGE.contains(&value) {
            issues.add(
                format!("remote.key_refresh.{key}"),
                format!(
                    "must be between 1s and 7d, got {}",
                    humantime::format_duration(value)
                ),
            );
            in_range = false;
        }
    }
    if in_range && refresh.min > refresh.default {
        issues.add(
            "remote.key_refresh.min",
            format!(
                "must not exceed default ({})",
                humantime::format_duration(refresh.default)
            ),
        );
    }
    if in_range && refresh.default > refresh.max {
        issues.add(
            "remote.key_refresh.max",
            format!(
                "must not be less than default ({})",
                humantime::format_duration(refresh.default)
            ),
        );
    }
    refresh
}

#[cfg(test)]
mod tests {
    use super::super::tests::{env, issues};
    use super::super::{Decision, parse};
    use super::*;

    const REMOTE: &str = "[remote]\nlisten = \"127.0.0.1:0\"\npublic_url = \"https://mcp.example.com/mcp\"\n\
                          issuer = \"https://auth.example.com\"\nallowed_subjects = [\"alice\"]\n";

    #[test]
    fn remote_defaults() {
        let config = parse(REMOTE, &env()).unwrap();
        let r = config.remote.unwrap();
        assert_eq!(r.audiences, ["https://mcp.example.com/mcp"]);
        assert_eq!(r.keys, KeySource::Discovery);
        assert_eq!(r.algorithms.len(), 3);
        assert_eq!(r.throttle.failures, 20);
        assert_eq!(r.throttle.window, Duration::from_secs(60));
        assert_eq!(r.throttle.max_addresses, 4096);
        assert!(r.tls.is_none() && r.trusted_proxies.is_empty() && !r.start_without_keys);
        assert!(
            parse("", &env()).unwrap().remote.is_none(),
            "off unless configured"
        );
    }

    #[test]
    fn remote_refuses_unsafe_settings() {
        let found = issues(
            "[remote]\npublic_url = \"http://mcp.example.com/mcp\"\nissuer = \"http://auth\"\n\
             jwks_uri = \"https://a/jwks\"\njwks_file = \"/x\"\nalgorithms = [\"HS256\"]\n\
             trusted_proxies = [\"10.0.0.0/33\"]\n[remote.throttle]\nfailures = 0\n",
        );
        let paths: Vec<_> = found.iter().map(|i| i.path.as_str()).collect();
        assert_eq!(
            paths,
            [
                "remote.public_url",
                "remote.issuer",
                "remote.jwks_uri",
                "remote.allowed_subjects",
                "remote.algorithms[0]",
                "remote.trusted_proxies[0]",
                "remote.throttle.failures",
            ]
        );
        let found = issues("[remote]\nissuer = \"https://a\"\nallowed_clients = [\"c\"]\n");
        assert_eq!(found[0].path, "remote.public_url");
        assert!(found[0].problem.contains("required"));
    }

    #[test]
    fn authorization_depth_keys() {
        let text = format!(
            "{REMOTE}scopes = [\"mcp\"]\n\
             [remote.introspection]\nclient_id = \"robota-mcpd\"\nclient_secret_file = \"/etc/robota-mcpd/i.secret\"\n\
             [remote.tool_scopes]\n\"file.write\" = [\"mcp:write\"]\n\"pg.*\" = [\"db:read\", \"mcp\"]\n\
             [tools.permissions]\napproval_expiry = \"5m\"\n\
             [[policy]]\ncallers = [\"oauth:*\"]\nscopes = [\"mcp:admin\"]\ntools = [\"service.*\"]\ndecision = \"approve-each\"\n"
        );
        let config = parse(&text, &env()).unwrap();
        let r = config.remote.as_ref().unwrap();
        let i = r.introspection.as_ref().unwrap();
        assert_eq!(i.endpoint, None);
        assert_eq!(i.auth, crate::vocab::ClientAuth::ClientSecretBasic);
        assert_eq!(i.cache, IntrospectionConfig::CACHE_DEFAULT);
        assert_eq!(r.scopes_for("file.write"), ["mcp", "mcp:write"]);
        assert_eq!(r.scopes_for("pg.query"), ["mcp", "db:read"]);
        assert_eq!(r.scopes_for("system.info"), ["mcp"]);
        assert_eq!(
            r.scopes_supported,
            ["mcp", "mcp:write", "db:read", "mcp:admin"],
            "every configured scope, once"
        );
        assert_eq!(config.policy[0].decision, Decision::ApproveEach);
        assert_eq!(config.policy[0].scopes, ["mcp:admin"]);
        assert_eq!(
            config.tools.permissions.approval_expiry,
            Duration::from_secs(300)
        );
        assert!(config.warnings.is_empty(), "{:?}", config.warnings);

        let found: Vec<String> = issues(&format!(
            "{REMOTE}[remote.introspection]\nendpoint = \"http://auth/i\"\nclient_secret_file = \"rel\"\n\
             auth_method = \"private_key_jwt\"\ncache = \"2h\"\n\
             [remote.tool_scopes]\n\"bad name\" = [\"ok\"]\n\"file.write\" = []\n\"x\" = [\"a b\"]\n\
             [tools.permissions]\napproval_expiry = \"2d\"\n\
             [[policy]]\ncallers = [\"*\"]\nscopes = [\"\\\"\"]\ntools = [\"*\"]\ndecision = \"approve-each\"\n"
        ))
        .into_iter()
        .map(|i| i.path)
        .collect();
        for path in [
            "remote.introspection.endpoint",
            "remote.introspection.client_id",
            "remote.introspection.client_secret_file",
            "remote.introspection.auth_method",
            "remote.introspection.cache",
            "remote.tool_scopes.\"bad name\"",
            "remote.tool_scopes.\"file.write\"",
            "remote.tool_scopes.x[0]",
            "tools.permissions.approval_expiry",
            "policy[0].scopes[0]",
        ] {
            assert!(found.iter().any(|p| p == path), "{path} not in {found:?}");
        }
        // A scope rule no token-holding caller can match is a warning.
        let config = parse(
            "[[policy]]\ncallers = [\"local:*\"]\nscopes = [\"x\"]\ntools = [\"*\"]\ndecision = \"deny\"\n",
            &env(),
        )
        .unwrap();
        assert_eq!(config.warnings[0].path, "policy[0].scopes");
    }

    #[test]
    fn remote_throttle_prefix_and_key_refresh() {
        let r = parse(REMOTE, &env()).unwrap().remote.unwrap();
        assert_eq!(r.throttle.ipv6_prefix, 64);
        assert_eq!(r.key_refresh, KeyRefresh::DEFAULT);
        assert_eq!(KeyRefresh::DEFAULT.default, Duration::from_secs(600));
        let r = parse(
            &format!(
                "{REMOTE}[remote.throttle]\nipv6_prefix = 48\n\
                 [remote.key_refresh]\nmin = \"1s\"\ndefault = \"5m\"\nmax = \"1h\"\n"
            ),
            &env(),
        )
        .unwrap()
        .remote
        .unwrap();
        assert_eq!(r.throttle.ipv6_prefix, 48);
        assert_eq!(
            r.key_refresh,
            KeyRefresh {
                default: Duration::from_secs(300),
                min: Duration::from_secs(1),
                max: Duration::from_secs(3600),
            }
        );
        let cases: [(&str, &[&str]); 6] = [
            (
                "[remote.throttle]\nipv6_prefix = 31\n",
                &["remote.throttle.ipv6_prefix"],
            ),
            (
                "[remote.throttle]\nipv6_prefix = 129\n",
                &["remote.throttle.ipv6_prefix"],
            ),
            (
                "[remote.key_refresh]\nmin = \"0s\"\n",
                &["remote.key_refresh.min"],
            ),
            (
                "[remote.key_refresh]\nmax = \"8d\"\n",
                &["remote.key_refresh.max"],
            ),
            (
                "[remote.key_refresh]\nmin = \"20m\"\n",
                &["remote.key_refresh.min"],
            ),
            (
                "[remote.key_refresh]\ndefault = \"2d\"\n",
                &["remote.key_refresh.max"],
            ),
        ];
        for (extra, want) in cases {
            let found = issues(&format!("{REMOTE}{extra}"));
            let paths: Vec<_> = found.iter().map(|i| i.path.as_str()).collect();
            assert_eq!(paths, want, "{extra}");
        }
    }

    #[test]
    fn trusting_every_address_is_refused_and_public_nets_warned_about() {
        for all in [
            "0.0.0.0/0",
            "::/0",
            " 0.0.0.0/0 ",
            "0.0.0.0/1",
            "10.0.0.0/7",
            "2000::/15",
            "::ffff:0.0.0.0/96",
        ] {
            let found = issues(&format!(
                "{REMOTE}trusted_proxies = [\"127.0.0.1\", \"{all}\"]\n"
            ));
            assert_eq!(found.len(), 1, "{all}: {found:?}");
            assert_eq!(found[0].path, "remote.trusted_proxies[1]");
            assert!(found[0].problem.contains("too many addresses"), "{found:?}");
        }
        let config = parse(
            &format!(
                "{REMOTE}trusted_proxies = [\"127.0.0.1\", \"10.0.0.0/8\", \"203.0.113.0/24\", \"::1\", \"2001:db8::/32\", \"fd00::/16\"]\n"
            ),
            &env(),
        )
        .unwrap();
        let warned: Vec<_> = config.warnings.iter().map(|w| w.path.as_str()).collect();
        assert_eq!(
            warned,
            ["remote.trusted_proxies[2]", "remote.trusted_proxies[4]"]
        );
        assert!(config.warnings[0].problem.contains("public"));
        assert_eq!(config.remote.unwrap().trusted_proxies.len(), 6);
        assert!(parse(REMOTE, &env()).unwrap().warnings.is_empty());
    }
}
