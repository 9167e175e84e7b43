//! The remote (OAuth) carrier from a client's side: its `[remote]` config, requests that
//! reach it "through a proxy" (Host of the public URL, sent to the loopback listener),
//! `WWW-Authenticate` challenge parsing, and audit records read with `robota-mcpctl`.

use std::collections::BTreeSet;
use std::path::Path;

use serde_json::Value;

use crate::authz::Authz;
use crate::daemon::{Daemon, DaemonBuilder};
use crate::http::Request;

/// The public URL every remote test configures (unless it tests a path prefix).
pub const PUBLIC_URL: &str = "https://mcp.test.example/mcp";
/// Its authority (the Host a proxy forwards).
pub const PUBLIC_HOST: &str = "mcp.test.example";
/// Its origin.
pub const PUBLIC_ORIGIN: &str = "https://mcp.test.example";

/// The RFC 9728 metadata URL of a public URL: origin + `/.well-known/oauth-protected-resource`
/// + path.
pub fn metadata_url(public_url: &str) -> String {
    let rest = public_url
        .strip_prefix("https://")
        .expect("https public URL");
    let (authority, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
    format!("https://{authority}/.well-known/oauth-protected-resource{path}")
}

/// The request path of a URL (`https://h/a/b` → `/a/b`).
pub fn url_path(url: &str) -> String {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    rest.find('/')
        .map_or_else(|| "/".to_owned(), |i| rest[i..].to_owned())
}

/// The `[remote]` section of a daemon's config.
#[derive(Debug, Clone)]
pub struct RemoteConfig {
    pub public_url: String,
    pub issuer: String,
    pub jwks_uri: Option<String>,
    pub jwks_file: Option<String>,
    pub ca_file: Option<String>,
    pub audiences: Option<Vec<String>>,
    pub scopes: Vec<String>,
    pub allowed_subjects: Vec<String>,
    pub allowed_clients: Vec<String>,
    pub algorithms: Option<Vec<String>>,
    pub trusted_proxies: Option<Vec<String>>,
    pub start_without_keys: Option<bool>,
    /// `[remote.throttle]`: (failures, window), when set.
    pub throttle: Option<(u32, String)>,
    /// `[remote.throttle] max_addresses`, when set.
    pub max_addresses: Option<usize>,
    /// `[remote.throttle] ipv6_prefix`, when set.
    pub ipv6_prefix: Option<u8>,
    /// `[remote.key_refresh]` lines (`min = "1s"`, …).
    pub key_refresh: Vec<String>,
    /// `[remote.tls]`: (cert file, key file), when set.
    pub tls: Option<(String, String)>,
    /// More `key = value` lines for `[remote]`.
    pub lines: Vec<String>,
}

fn toml_str(s: &str) -> String {
    serde_json::to_string(s).expect("string")
}

fn toml_list(v: &[String]) -> String {
    serde_json::to_string(v).expect("list")
}

impl RemoteConfig {
    /// The usual test setup against `authz`: public URL [`PUBLIC_URL`], its CA, scope
    /// `mcp`, subjects `alice`, clients `client-a`.
    pub fn new(authz: &Authz) -> RemoteConfig {
        RemoteConfig::for_issuer(authz.issuer(), Some(authz.ca_file()))
    }

    /// Public URL [`PUBLIC_URL`], `issuer` (its keys discovered, trusted through
    /// `ca_file`), scope `mcp`, subjects `alice`, clients `client-a`, every other key at
    /// its default: the base the other setups change what they need of.
    pub fn for_issuer(issuer: &str, ca_file: Option<&Path>) -> RemoteConfig {
        RemoteConfig {
            public_url: PUBLIC_URL.into(),
            issuer: issuer.into(),
            jwks_uri: None,
            jwks_file: None,
            ca_file: ca_file.map(|p| p.display().to_string()),
            audiences: None,
            scopes: vec!["mcp".into()],
            allowed_subjects: vec!["alice".into()],
            allowed_clients: vec!["client-a".into()],
            algorithms: None,
            trusted_proxies: None,
            start_without_keys: None,
            throttle: None,
            max_addresses: None,
            ipv6_prefix: None,
            key_refresh: Vec::new(),
            tls: None,
            lines: Vec::new(),
        }
    }

    pub fn throttle(mut self, failures: u32, window: &str) -> Self {
        self.throttle = Some((failures, window.into()));
        self
    }

    pub fn max_addresses(mut self, n: usize) -> Self {
        self.max_addresses = Some(n);
        self
    }

    pub fn ipv6_prefix(mut self, bits: u8) -> Self {
        self.ipv6_prefix = Some(bits);
        self
    }

    /// `[remote.key_refresh] <key> = "<duration>"`.
    pub fn key_refresh(mut self, key: &str, duration: &str) -> Self {
        self.key_refresh
            .push(format!("{key} = {}", toml_str(duration)));
        self
    }

    pub fn audiences(mut self, audiences: &[&str]) -> Self {
        self.audiences = Some(audiences.iter().map(|s| s.to_string()).collect());
        self
    }

    pub fn algorithms(mut self, algorithms: &[&str]) -> Self {
        self.algorithms = Some(algorithms.iter().map(|s| s.to_string()).collect());
        self
    }

    pub fn trusted_proxies(mut self, proxies: &[&str]) -> Self {
        self.trusted_proxies = Some(proxies.iter().map(|s| s.to_string()).collect());
        self
    }

    pub fn start_without_keys(mut self, yes: bool) -> Self {
        self.start_without_keys = Some(yes);
        self
    }

    pub fn public_url(mut self, url: &str) -> Self {
        self.public_url = url.into();
        self
    }

    pub fn jwks_uri(mut self, uri: &str) -> Self {
        self.jwks_uri = Some(uri.into());
        self
    }

    pub fn jwks_file(mut self, path: &Path) -> Self {
        self.jwks_file = Some(path.display().to_string());
        self
    }

    pub fn tls(mut self, cert: &Path, key: &Path) -> Self {
        self.tls = Some((cert.display().to_string(), key.display().to_string()));
        self
    }

    pub fn line(mut self, line: &str) -> Self {
        self.lines.push(line.into());
        self
    }

    /// The TOML text.
    pub fn toml(&self) -> String {
        let mut t = String::from("[remote]\nlisten = \"127.0.0.1:0\"\n");
        t.push_str(&format!("public_url = {}\n", toml_str(&self.public_url)));
        t.push_str(&format!("issuer = {}\n", toml_str(&self.issuer)));
        if let Some(u) = &self.jwks_uri {
            t.push_str(&format!("jwks_uri = {}\n", toml_str(u)));
        }
        if let Some(f) = &self.jwks_file {
            t.push_str(&format!("jwks_file = {}\n", toml_str(f)));
        }
        if let Some(f) = &self.ca_file {
            t.push_str(&format!("ca_file = {}\n", toml_str(f)));
        }
        if let Some(a) = &self.audiences {
            t.push_str(&format!("audiences = {}\n", toml_list(a)));
        }
        t.push_str(&format!("scopes = {}\n", toml_list(&self.scopes)));
        t.push_str(&format!(
            "allowed_subjects = {}\n",
            toml_list(&self.allowed_subjects)
        ));
        t.push_str(&format!(
            "allowed_clients = {}\n",
            toml_list(&self.allowed_clients)
        ));
        if let Some(a) = &self.algorithms {
            t.push_str(&format!("algorithms = {}\n", toml_list(a)));
        }
        if let Some(p) = &self.trusted_proxies {
            t.push_str(&format!("trusted_proxies = {}\n", toml_list(p)));
        }
        if let Some(s) = self.start_without_keys {
            t.push_str(&format!("start_without_keys = {s}\n"));
        }
        for l in &self.lines {
            t.push_str(l);
            t.push('\n');
        }
        if self.throttle.is_some() || self.max_addresses.is_some() || self.ipv6_prefix.is_some() {
            t.push_str("\n[remote.throttle]\n");
        }
        if let Some(bits) = self.ipv6_prefix {
            t.push_str(&format!("ipv6_prefix = {bits}\n"));
        }
        if let Some((failures, window)) = &self.throttle {
            t.push_str(&format!(
                "failures = {failures}\nwindow = {}\n",
                toml_str(window)
            ));
        }
        if let Some(n) = self.max_addresses {
            t.push_str(&format!("max_addresses = {n}\n"));
        }
        if !self.key_refresh.is_empty() {
            t.push_str("\n[remote.key_refresh]\n");
            for l in &self.key_refresh {
                t.push_str(l);
                t.push('\n');
            }
        }
        if let Some((cert, key)) = &self.tls {
            t.push_str(&format!(
                "\n[remote.tls]\ncert = {}\nkey = {}\n",
                toml_str(cert),
                toml_str(key)
            ));
        }
        t
    }

    /// A daemon builder with this section.
    pub fn builder(&self) -> DaemonBuilder {
        Daemon::builder().extra(self.toml())
    }
}

/// `POST <path>` as a proxy forwards an MCP 2025-11-25 request for [`PUBLIC_URL`].
pub fn remote_mcp(token: Option<&str>, message: &Value) -> Request {
    remote_mcp_at("/mcp", PUBLIC_HOST, token, message)
}

/// [`remote_mcp`] with another endpoint path and Host.
pub fn remote_mcp_at(path: &str, host: &str, token: Option<&str>, message: &Value) -> Request {
    let mut r = Request::new("POST", path)
        .header("Host", host)
        .header("Content-Type", "application/json")
        .header("Accept", "application/json, text/event-stream")
        .header("MCP-Protocol-Version", crate::V_2025_11_25)
        .header("Connection", "close")
        .body(serde_json::to_vec(message).expect("json"));
    if let Some(t) = token {
        r = r.header("Authorization", &format!("Bearer {t}"));
    }
    r
}

/// A parsed `WWW-Authenticate` challenge: scheme and auth-params in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Challenge {
    pub scheme: String,
    pub params: Vec<(String, String)>,
}

impl Challenge {
    /// Parses one challenge (`Bearer k="v", k2=token`). Panics on syntax errors: a
    /// malformed challenge is a failure in itself.
    pub fn parse(text: &str) -> Challenge {
        let text = text.trim();
        let (scheme, mut rest) = match text.find(' ') {
            Some(i) => (&text[..i], text[i..].trim_start()),
            None => (text, ""),
        };
        let mut params = Vec::new();
        while !rest.is_empty() {
            let eq = rest
                .find('=')
                .unwrap_or_else(|| panic!("auth-param without '=' in {text:?}"));
            let name = rest[..eq].trim().to_ascii_lowercase();
            assert!(
                !name.is_empty() && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_'),
                "bad auth-param name {name:?} in {text:?}"
            );
            rest = rest[eq + 1..].trim_start();
            let value;
            if let Some(q) = rest.strip_prefix('"') {
                let mut v = String::new();
                let mut chars = q.char_indices();
                let mut end = None;
                while let Some((i, c)) = chars.next() {
                    match c {
                        '\\' => {
                            let (_, n) = chars
                                .next()
                                .unwrap_or_else(|| panic!("dangling escape in {text:?}"));
                            v.push(n);
                        }
                        '"' => {
                            end = Some(i);
                            break;
                        }
                        c => v.push(c),
                    }
                }
                let end = end.unwrap_or_else(|| panic!("unterminated quoted string in {text:?}"));
                value = v;
                rest = q[end + 1..].trim_start();
            } else {
                let end = rest.find(',').unwrap_or(rest.len());
                value = rest[..end].trim().to_owned();
                rest = &rest[end..];
            }
            params.push((name, value));
            rest = rest.trim_start();
            if let Some(r) = rest.strip_prefix(',') {
                rest = r.trim_start();
                assert!(!rest.is_empty(), "trailing comma in {text:?}");
            } else {
                assert!(rest.is_empty(), "junk after an auth-param in {text:?}");
            }
        }
        Challenge {
            scheme: scheme.to_owned(),
            params,
        }
    }

    pub fn get(&self, name: &str) -> Option<&str> {
        self.params
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    /// Asserts the scheme is `Bearer`, no parameter repeats, there is no
    /// `error_description`, and the parameters are exactly `expected`.
    pub fn assert_exactly(&self, expected: &[(&str, &str)], case: &str) {
        assert!(
            self.scheme.eq_ignore_ascii_case("Bearer"),
            "{case}: scheme {:?}, want Bearer",
            self.scheme
        );
        let names: Vec<&str> = self.params.iter().map(|(k, _)| k.as_str()).collect();
        let unique: BTreeSet<&str> = names.iter().copied().collect();
        assert_eq!(
            unique.len(),
            names.len(),
            "{case}: repeated auth-param in {:?}",
            self.params
        );
        assert!(
            self.get("error_description").is_none(),
            "{case}: challenge carries error_description: {:?}",
            self.params
        );
        let mut got: Vec<(String, String)> = self.params.clone();
        got.sort();
        let mut want: Vec<(String, String)> = expected
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        want.sort();
        assert_eq!(got, want, "{case}: challenge parameters");
    }
}

/// The audit record fields, exactly.
pub const AUDIT_FIELDS: [&str; 6] = [
    "seq",
    "time",
    "carrier",
    "reason",
    "throttled",
    "address_class",
];

/// `robota-mcpctl --json audit <args>`: one JSON record per line, each checked for
/// exactly the audit fields with the right types.
pub fn audit(d: &Daemon, args: &[&str]) -> Vec<Value> {
    let mut full = vec!["--json", "audit"];
    full.extend_from_slice(args);
    let out = d.ctl_ok(&full);
    parse_audit_lines(&out.stdout, &format!("robota-mcpctl {}", full.join(" ")))
}

/// Parses `--json audit` output (one record per line).
pub fn parse_audit_lines(stdout: &str, what: &str) -> Vec<Value> {
    stdout
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let v: Value = serde_json::from_str(l)
                .unwrap_or_else(|e| panic!("{what}: line is not JSON ({e}): {l:?}"));
            check_audit_record(&v, what);
            v
        })
        .collect()
}

/// Panics unless `v` has exactly the audit fields with the right types and closed-set
/// values (plus `count`, of 2 or more, on an aggregate).
pub fn check_audit_record(v: &Value, what: &str) {
    let obj = v
        .as_object()
        .unwrap_or_else(|| panic!("{what}: audit record is not an object: {v}"));
    let mut keys: BTreeSet<&str> = obj.keys().map(String::as_str).collect();
    if keys.remove("count") {
        assert!(
            v["count"].as_u64().is_some_and(|n| n >= 2),
            "{what}: count: {v}"
        );
    }
    let want: BTreeSet<&str> = AUDIT_FIELDS.into_iter().collect();
    assert_eq!(keys, want, "{what}: audit record fields: {v}");
    assert!(v["seq"].is_u64(), "{what}: seq: {v}");
    assert!(v["time"].is_u64(), "{what}: time: {v}");
    assert!(v["throttled"].is_boolean(), "{what}: throttled: {v}");
    assert!(
        matches!(
            v["carrier"].as_str(),
            Some("remote" | "loopback" | "control" | "stdio")
        ),
        "{what}: carrier: {v}"
    );
    assert!(
        matches!(
            v["address_class"].as_str(),
            Some("loopback" | "private" | "public" | "unknown")
        ),
        "{what}: address_class: {v}"
    );
    assert!(v["reason"].is_string(), "{what}: reason: {v}");
}

/// How many refusals the records stand for: an aggregate's `count`, else one each.
pub fn refusal_total(records: &[Value]) -> u64 {
    records
        .iter()
        .map(|r| r["count"].as_u64().unwrap_or(1))
        .sum()
}

/// The largest `seq` in `records` (0 when empty).
pub fn max_seq(records: &[Value]) -> u64 {
    records
        .iter()
        .filter_map(|r| r["seq"].as_u64())
        .max()
        .unwrap_or(0)
}

/// Records with `seq > after`.
pub fn records_after(records: &[Value], after: u64) -> Vec<Value> {
    records
        .iter()
        .filter(|r| r["seq"].as_u64().is_some_and(|s| s > after))
        .cloned()
        .collect()
}

/// Sends `req` (which should carry `Connection: close`) over TLS to `addr`, verifying the
/// server as `server_name` with `config`, and reads the whole response (bounded).
pub async fn tls_exchange(
    config: std::sync::Arc<tokio_rustls::rustls::ClientConfig>,
    addr: std::net::SocketAddr,
    server_name: &str,
    req: &Request,
) -> Result<crate::http::Response, String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio_rustls::rustls::pki_types::ServerName;

    let name = ServerName::try_from(server_name.to_owned()).map_err(|e| e.to_string())?;
    let fut = async {
        let tcp = tokio::net::TcpStream::connect(addr)
            .await
            .map_err(|e| format!("connect {addr}: {e}"))?;
        let mut tls = tokio_rustls::TlsConnector::from(config)
            .connect(name, tcp)
            .await
            .map_err(|e| format!("TLS handshake with {addr} as {server_name}: {e}"))?;
        tls.write_all(&req.to_bytes())
            .await
            .map_err(|e| format!("write: {e}"))?;
        tls.flush().await.map_err(|e| format!("flush: {e}"))?;
        let mut buf = Vec::new();
        // A peer closing without close_notify is fine here: we have what arrived.
        let _ = tls.read_to_end(&mut buf).await;
        parse_response(&buf)
    };
    match tokio::time::timeout(crate::http::EXCHANGE_LIMIT, fut).await {
        Ok(r) => r,
        Err(_) => Err(format!(
            "no TLS response within {:?}",
            crate::http::EXCHANGE_LIMIT
        )),
    }
}

/// Parses a complete HTTP/1.1 response (head and a content-length, chunked or to-close
/// body) from `buf`.
pub fn parse_response(buf: &[u8]) -> Result<crate::http::Response, String> {
    let mut hs = [httparse::EMPTY_HEADER; 128];
    let mut resp = httparse::Response::new(&mut hs);
    let used = match resp.parse(buf) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) => {
            return Err(format!(
                "incomplete response head: {:?}",
                String::from_utf8_lossy(buf)
            ));
        }
        Err(e) => return Err(format!("bad response head: {e}")),
    };
    let headers: Vec<(String, String)> = resp
        .headers
        .iter()
        .map(|h| {
            (
                h.name.to_owned(),
                String::from_utf8_lossy(h.value).into_owned(),
            )
        })
        .collect();
    let mut out = crate::http::Response {
        status: resp.code.unwrap_or(0),
        headers,
        body: Vec::new(),
    };
    let rest = &buf[used..];
    let chunked = out
        .header("transfer-encoding")
        .is_some_and(|v| v.to_ascii_lowercase().contains("chunked"));
    if chunked {
        let mut rest = rest;
        loop {
            let i = rest
                .windows(2)
                .position(|w| w == b"\r\n")
                .ok_or("truncated chunk size")?;
            let size_text = String::from_utf8_lossy(&rest[..i]).into_owned();
            let size = usize::from_str_radix(size_text.split(';').next().unwrap_or("").trim(), 16)
                .map_err(|e| format!("chunk size {size_text:?}: {e}"))?;
            rest = &rest[i + 2..];
            if size == 0 {
                break;
            }
            if rest.len() < size + 2 {
                return Err("truncated chunk".into());
            }
            out.body.extend_from_slice(&rest[..size]);
            rest = &rest[size + 2..];
        }
    } else if let Some(n) = out.content_length() {
        let n = usize::try_from(n).map_err(|e| e.to_string())?;
        if rest.len() < n {
            return Err(format!("body has {} of {n} bytes", rest.len()));
        }
        out.body = rest[..n].to_vec();
    } else {
        out.body = rest.to_vec();
    }
    Ok(out)
}
