//! The value types configuration is made of, each with its own parser: the remote
//! carrier's public URL, key sources and refresh bounds, IP nets, tool names and caller
//! patterns. Other layers use these types; this module imports nothing above the
//! vocabulary.

use std::net::IpAddr;
use std::path::PathBuf;
use std::time::Duration;

use http::Uri;
use ipnet::IpNet;

use crate::vocab::AddressClass;

const METADATA_PREFIX: &str = "/.well-known/oauth-protected-resource";

/// The https URL clients use to reach the remote carrier.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PublicUrl {
    /// As configured: the RFC 9728 `resource` and default audience, code point by code point.
    text: String,
    host: String,
    port: u16,
    path: String,
    origin: String,
    metadata_path: String,
}

impl PublicUrl {
    /// An `https` URL without user-info, query or fragment; the path may be a prefix.
    pub fn parse(text: &str) -> Result<Self, String> {
        if text.contains('#') || text.contains('?') {
            return Err(format!("must not carry a query or fragment, got {text:?}"));
        }
        let uri: Uri = text.parse().map_err(|_| format!("not a URL: {text:?}"))?;
        if uri.scheme_str() != Some("https") {
            return Err(format!("must be an https URL, got {text:?}"));
        }
        let authority = uri
            .authority()
            .ok_or_else(|| format!("has no host: {text:?}"))?;
        if authority.as_str().contains('@') {
            return Err(format!("must not carry user-info, got {text:?}"));
        }
        let host = authority.host().to_ascii_lowercase();
        if host.is_empty() {
            return Err(format!("has no host: {text:?}"));
        }
        let port = authority.port_u16().unwrap_or(443);
        let path = match uri.path() {
            "" => "/".to_owned(),
            p => p.to_owned(),
        };
        let origin = if port == 443 {
            format!("https://{host}")
        } else {
            format!("https://{host}:{port}")
        };
        // RFC 9728 §3.1: a trailing "/" right after the host is dropped.
        let metadata_path = if path == "/" {
            METADATA_PREFIX.to_owned()
        } else {
            format!("{METADATA_PREFIX}{path}")
        };
        Ok(Self {
            text: text.to_owned(),
            host,
            port,
            path,
            origin,
            metadata_path,
        })
    }

    pub fn as_str(&self) -> &str {
        &self.text
    }

    pub fn path(&self) -> &str {
        &self.path
    }

    pub fn origin(&self) -> &str {
        &self.origin
    }

    /// Whether an `Origin` header's value names the public origin (RFC 6454: scheme, host
    /// and port; ASCII case aside, and the default port 443 either implied or spelled out).
    pub fn is_origin(&self, value: &[u8]) -> bool {
        let origin = self.origin.as_bytes();
        if value.eq_ignore_ascii_case(origin) {
            return true;
        }
        self.port == 443
            && value.len() == origin.len() + 4
            && value[..origin.len()].eq_ignore_ascii_case(origin)
            && &value[origin.len()..] == b":443"
    }

    pub fn metadata_path(&self) -> &str {
        &self.metadata_path
    }

    pub fn metadata_url(&self) -> String {
        format!("{}{}", self.origin, self.metadata_path)
    }

    /// `host` and `host:port` forms clients may send for the public authority.
    pub fn authorities(&self) -> Vec<String> {
        let mut out = vec![format!("{}:{}", self.host, self.port)];
        if self.port == 443 {
            out.push(self.host.clone());
        }
        out
    }

    /// Whether an authority (Host header or URI authority) names the public authority.
    pub fn is_authority(&self, value: &str) -> bool {
        let Ok(authority) = value.parse::<http::uri::Authority>() else {
            return false;
        };
        !authority.as_str().contains('@')
            && authority.host().eq_ignore_ascii_case(&self.host)
            && authority.port_u16().unwrap_or(443) == self.port
    }
}

/// Where the key set comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeySource {
    /// RFC 8414 metadata at the issuer, then OIDC discovery; its `jwks_uri`.
    Discovery,
    /// An explicit `https://` JWKS URL.
    JwksUri(String),
    /// A local JWKS file (never cached: it is already local).
    JwksFile(PathBuf),
}

impl KeySource {
    /// Its name in `status`.
    pub fn kind(&self) -> robota_proto::KeySourceKind {
        match self {
            KeySource::Discovery => robota_proto::KeySourceKind::Discovery,
            KeySource::JwksUri(_) => robota_proto::KeySourceKind::JwksUri,
            KeySource::JwksFile(_) => robota_proto::KeySourceKind::JwksFile,
        }
    }
}

/// How often the key set is refreshed on schedule (`[remote.key_refresh]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyRefresh {
    /// When the key server gives no `max-age` (Envoy's jwt_authn caches a remote key set
    /// for 10 minutes by default; so do we).
    pub default: Duration,
    /// The least time between scheduled refreshes: a smaller `max-age` (or `no-cache`) is
    /// raised to it. Also the wait before retrying a failed refresh, and how often a key
    /// file is checked for changes.
    pub min: Duration,
    /// The most: a larger `max-age` is lowered to it.
    pub max: Duration,
}

impl KeyRefresh {
    pub const DEFAULT: KeyRefresh = KeyRefresh {
        default: Duration::from_secs(600),
        min: Duration::from_secs(60),
        max: Duration::from_secs(86_400),
    };
    /// The range each bound may be configured in.
    pub const RANGE: std::ops::RangeInclusive<Duration> =
        Duration::from_secs(1)..=Duration::from_secs(7 * 86_400);
}

impl Default for KeyRefresh {
    fn default() -> Self {
        Self::DEFAULT
    }
}

/// An IP (`10.0.0.1`, `::1`) or a CIDR (`10.0.0.0/8`).
pub fn parse_net(text: &str) -> Option<IpNet> {
    let text = text.trim();
    let net = text
        .parse::<IpNet>()
        .ok()
        .or_else(|| text.parse::<IpAddr>().ok().map(IpNet::from))?;
    // Peers are compared as IPv4 when they are IPv4-mapped, so a mapped net is the IPv4
    // net it maps (else it would never match).
    match net {
        IpNet::V6(v6) if v6.prefix_len() >= 96 => match v6.network().to_ipv4_mapped() {
            Some(v4) => ipnet::Ipv4Net::new(v4, v6.prefix_len() - 96)
                .ok()
                .map(IpNet::V4),
            None => Some(net),
        },
        _ => Some(net),
    }
}

/// Whether `net` holds an address that is neither loopback nor private (RFC 1918,
/// link-local, CGNAT, ULA). Every such range is a CIDR block, so a net lies inside one of
/// them exactly when both of its ends are loopback or private.
pub fn holds_public(net: &IpNet) -> bool {
    let inside = |ip: IpAddr| {
        matches!(
            AddressClass::of(ip),
            AddressClass::Loopback | AddressClass::Private
        )
    };
    !(inside(net.network()) && inside(net.broadcast()))
}

/// Longest tool name (docs/design.md §2.3: grammar `[A-Za-z0-9_.-]{1,64}`).
pub const MAX_NAME_LEN: usize = 64;

/// Check a tool name against the grammar `[A-Za-z0-9_.-]{1,64}`.
pub fn check_name(name: &str) -> Result<(), String> {
    if name.is_empty() || name.len() > MAX_NAME_LEN {
        return Err(format!("must be 1 to {MAX_NAME_LEN} characters long"));
    }
    if let Some(c) = name
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || "_.-".contains(*c)))
    {
        return Err(format!("character {c:?} is outside [A-Za-z0-9_.-]"));
    }
    Ok(())
}

/// Check a caller pattern's shape: `*`, or `local:…`, `bearer:…`, `oauth:…/…` with `*` globs.
pub fn check_caller_pattern(pattern: &str) -> Result<(), String> {
    if pattern == "*" {
        return Ok(());
    }
    let Some((kind, rest)) = pattern.split_once(':') else {
        return Err(format!(
            "{pattern:?} is not `*`, `local:<uid>`, `bearer:<label>` or `oauth:<client_id>/<sub>`"
        ));
    };
    if rest.is_empty() {
        return Err(format!("{pattern:?} has nothing after `{kind}:`"));
    }
    match kind {
        "local" if rest == "*" || rest.parse::<u32>().is_ok() => Ok(()),
        "local" => Err(format!(
            "{pattern:?}: a local caller is a numeric uid or `*`"
        )),
        "bearer" => Ok(()),
        "oauth" if rest.contains('/') || rest == "*" => Ok(()),
        "oauth" => Err(format!(
            "{pattern:?}: write `oauth:<client_id>/<sub>` (globs allowed)"
        )),
        _ => Err(format!(
            "{pattern:?}: unknown caller kind {kind:?} (local, bearer or oauth)"
        )),
    }
}

/// Whether caller text (`oauth:client-a/alice`) matches a caller pattern: `*` stands for
/// any run of characters — `/` included, so `*` and `oauth:*` match every remote caller
/// and `oauth:client-a/*` every subject of that client, whatever its subject holds — and
/// `?` for one character; everything else stands for itself.
pub fn caller_matches(pattern: &str, caller: &str) -> bool {
    // Asked on every call: a pattern without wildcards is the name itself.
    if !pattern.contains(['*', '?']) {
        return pattern == caller;
    }
    let (p, c): (Vec<char>, Vec<char>) = (pattern.chars().collect(), caller.chars().collect());
    // Iterative wildcard match: remember the last `*` and where it resumed.
    let (mut pi, mut ci) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while ci < c.len() {
        if pi < p.len() && (p[pi] == '?' || p[pi] == c[ci]) {
            pi += 1;
            ci += 1;
        } else if pi < p.len() && p[pi] == '*' {
            star = Some((pi, ci));
            pi += 1;
        } else if let Some((sp, sc)) = star {
            pi = sp + 1;
            ci = sc + 1;
            star = Some((sp, sc + 1));
        } else {
            return false;
        }
    }
    p[pi..].iter().all(|&ch| ch == '*')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn caller_patterns_match_across_slashes() {
        for (pattern, caller) in [
            ("*", "oauth:client-a/alice"),
            ("*", "local:0"),
            ("oauth:*", "oauth:client-a/alice"),
            ("oauth:*", "oauth:c/a/b"),
            ("oauth:client-a/*", "oauth:client-a/alice"),
            ("oauth:client-a/*", "oauth:client-a/team/alice"),
            ("oauth:*/alice", "oauth:client-a/alice"),
            ("bearer:ci-*", "bearer:ci-7"),
            ("local:1?00", "local:1000"),
            ("local:0", "local:0"),
        ] {
            assert!(caller_matches(pattern, caller), "{pattern} {caller}");
        }
        for (pattern, caller) in [
            ("oauth:*", "bearer:x"),
            ("oauth:client-a/*", "oauth:client-ab/alice"),
            ("local:0", "local:00"),
            ("bearer:ci", "bearer:ci2"),
            ("oauth:*/alice", "oauth:client-a/alice2"),
        ] {
            assert!(!caller_matches(pattern, caller), "{pattern} {caller}");
        }
    }

    #[test]
    fn public_urls() {
        let u = PublicUrl::parse("https://mcp.example.com/team/ops/mcp").unwrap();
        assert_eq!(u.path(), "/team/ops/mcp");
        assert_eq!(
            u.metadata_path(),
            "/.well-known/oauth-protected-resource/team/ops/mcp"
        );
        assert_eq!(
            u.metadata_url(),
            "https://mcp.example.com/.well-known/oauth-protected-resource/team/ops/mcp"
        );
        assert_eq!(u.origin(), "https://mcp.example.com");
        let root = PublicUrl::parse("https://mcp.example.com").unwrap();
        assert_eq!(root.path(), "/");
        assert_eq!(
            root.metadata_path(),
            "/.well-known/oauth-protected-resource"
        );
        let port = PublicUrl::parse("https://MCP.example.com:8443/mcp").unwrap();
        assert_eq!(port.origin(), "https://mcp.example.com:8443");
        assert!(port.is_authority("mcp.example.com:8443"));
        assert!(!port.is_authority("mcp.example.com"));
        for bad in [
            "http://mcp.example.com/mcp",
            "https://user:pw@mcp.example.com/mcp",
            "https://mcp.example.com/mcp?x=1",
            "https://mcp.example.com/mcp#frag",
            "mcp.example.com/mcp",
            "https:///mcp",
        ] {
            assert!(PublicUrl::parse(bad).is_err(), "{bad}");
        }
    }
}
