//! A real authorization server for the end-to-end tests: `oidc-provider` from npm (a
//! certified OpenID Provider nobody here wrote), run by `tests/oidc/server.mjs` under Node
//! on `127.0.0.1`, port 0, over HTTPS with a certificate of a test CA.
//!
//! It issues client-credentials access tokens for the daemon's public URL (RFC 8707
//! resource indicators): RFC 9068 JWTs for [`JWT_CLIENT`] and [`STRANGER`], opaque tokens
//! for [`OPAQUE_CLIENT`], which the daemon checks at its introspection endpoint as
//! [`INTROSPECTOR`]. It can be stopped and started again on the same port with the same
//! signing key (its tokens are kept in memory only, so a restart forgets them).
//!
//! `tests/setup.sh oidc` installs the pinned package (`tests/oidc/package-lock.json`) with
//! `npm ci`, on first use.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use serde_json::{Value, json};
use tempfile::TempDir;

use crate::authz::TestCa;
use crate::remote::PUBLIC_URL;

/// A client id and its secret.
#[derive(Debug, Clone, Copy)]
pub struct Client {
    pub id: &'static str,
    pub secret: &'static str,
}

/// Gets JWT access tokens.
pub const JWT_CLIENT: Client = Client {
    id: "jwt-agent",
    secret: "jwt-agent-secret-5b1f",
};
/// Gets opaque access tokens.
pub const OPAQUE_CLIENT: Client = Client {
    id: "opaque-agent",
    secret: "opaque-agent-secret-93ac",
};
/// Gets JWT access tokens, but no daemon allows it.
pub const STRANGER: Client = Client {
    id: "stranger",
    secret: "stranger-secret-0d2e",
};
/// The daemon's own client at the introspection endpoint.
pub const INTROSPECTOR: Client = Client {
    id: "robota-mcpd",
    secret: "introspection-secret-7e4d1c",
};

/// Every scope the resource knows; a client may ask for any of them.
pub const SCOPES: [&str; 4] = ["mcp", "mcp:write", "mcp:admin", "db:read"];

/// How long the server may take to start (about 1.5 s on an idle machine; far longer
/// while the whole suite loads both cores).
const START_LIMIT: Duration = Duration::from_secs(90);

/// The running provider.
pub struct Oidc {
    dir: TempDir,
    ca: TestCa,
    config: PathBuf,
    issuer: String,
    port: u16,
    child: Option<(Child, ChildStdin)>,
    http: reqwest::Client,
    netns: Option<PathBuf>,
}

/// `application/x-www-form-urlencoded` text of `pairs`.
fn form(pairs: &[(&str, &str)]) -> String {
    let encode = |s: &str| {
        s.bytes()
            .map(|b| match b {
                b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => {
                    (b as char).to_string()
                }
                b' ' => "+".to_owned(),
                _ => format!("%{b:02X}"),
            })
            .collect::<String>()
    };
    pairs
        .iter()
        .map(|(k, v)| format!("{}={}", encode(k), encode(v)))
        .collect::<Vec<_>>()
        .join("&")
}

/// The JSON of an answer.
async fn json_of(response: reqwest::Response) -> Value {
    let bytes = response.bytes().await.expect("answer body");
    serde_json::from_slice(&bytes)
        .unwrap_or_else(|_| panic!("not JSON: {}", String::from_utf8_lossy(&bytes)))
}

fn server_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("oidc")
}

/// Where a provider runs and for what: [`Oidc::start_with`].
pub struct Options {
    /// Access-token lifetime.
    pub ttl_secs: u64,
    /// The address it listens on (its issuer is `https://<listen>:<port>`).
    pub listen: String,
    /// The resources (RFC 8707) it issues tokens for, each token for one of them alone.
    pub resources: Vec<String>,
    /// Clients that get JWT access tokens (besides the usual ones).
    pub jwt_clients: Vec<Client>,
    /// A network namespace to run in (`nsenter --net=`), instead of the test's own.
    pub netns: Option<PathBuf>,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            ttl_secs: 300,
            listen: "127.0.0.1".to_owned(),
            resources: vec![PUBLIC_URL.to_owned()],
            jwt_clients: Vec::new(),
            netns: None,
        }
    }
}

impl Oidc {
    /// Start oidc-provider; tokens live `ttl_secs`.
    pub fn start(ttl_secs: u64) -> Oidc {
        Oidc::start_with(Options {
            ttl_secs,
            ..Options::default()
        })
    }

    /// Start oidc-provider as `options` say.
    pub fn start_with(options: Options) -> Oidc {
        // oidc-provider from npm, pinned by tests/oidc/package-lock.json.
        crate::setup::ensure("oidc");
        let dir = tempfile::tempdir().expect("tempdir");
        let ca = TestCa::new();
        let (cert, key) = ca.leaf(&[options.listen.as_str()]);
        let cert_path = dir.path().join("cert.pem");
        let key_path = dir.path().join("key.pem");
        std::fs::write(&cert_path, cert).expect("cert");
        std::fs::write(&key_path, key).expect("key");
        std::fs::write(dir.path().join("ca.pem"), ca.pem()).expect("ca");
        let client = |c: Client, format: &str| json!({"client_id": c.id, "client_secret": c.secret, "format": format});
        let mut clients = vec![
            client(JWT_CLIENT, "jwt"),
            client(OPAQUE_CLIENT, "opaque"),
            client(STRANGER, "jwt"),
        ];
        clients.extend(options.jwt_clients.iter().map(|c| client(*c, "jwt")));
        let config = json!({
            "cert": cert_path,
            "key": key_path,
            "port": 0,
            "listen": options.listen,
            "keys": dir.path().join("signing-key.json"),
            "resources": options.resources,
            "scopes": SCOPES,
            "ttl": options.ttl_secs,
            "clients": clients,
            "introspector": {"client_id": INTROSPECTOR.id, "client_secret": INTROSPECTOR.secret},
            "introspection_delay": dir.path().join("introspection-delay"),
        });
        let config_path = dir.path().join("config.json");
        std::fs::write(&config_path, config.to_string()).expect("config");
        let roots = reqwest::Certificate::from_pem(ca.pem().as_bytes()).expect("CA");
        let http = reqwest::Client::builder()
            .tls_certs_only([roots])
            .no_proxy()
            .timeout(Duration::from_secs(10))
            .build()
            .expect("https client");
        let mut oidc = Oidc {
            dir,
            ca,
            config: config_path,
            issuer: String::new(),
            port: 0,
            child: None,
            http,
            netns: options.netns,
        };
        oidc.spawn();
        oidc
    }

    /// Run the server (on the port of the first run, if any) and wait for its line.
    fn spawn(&mut self) {
        if self.port != 0 {
            let mut config: Value =
                serde_json::from_slice(&std::fs::read(&self.config).expect("config"))
                    .expect("config json");
            config["port"] = json!(self.port);
            std::fs::write(&self.config, config.to_string()).expect("config");
        }
        let stderr = std::fs::File::create(self.dir.path().join("oidc.stderr")).expect("stderr");
        let mut command = match &self.netns {
            Some(netns) => {
                let mut c = Command::new("nsenter");
                c.arg(format!("--net={}", netns.display()))
                    .args(["--", "node"]);
                c
            }
            None => Command::new("node"),
        };
        let mut child = command
            .arg(server_dir().join("server.mjs"))
            .arg(&self.config)
            .current_dir(server_dir())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(stderr)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run node (Node.js 20 or later is needed): {e}"));
        let stdin = child.stdin.take().expect("stdin");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut reader = BufReader::new(stdout);
            let mut line = String::new();
            let _ = reader.read_line(&mut line);
            let _ = tx.send(line);
            // The provider prints notices on stdout too: keep reading (a closed pipe would
            // kill it with EPIPE) until it exits.
            let _ = std::io::copy(&mut reader, &mut std::io::sink());
        });
        let line = rx.recv_timeout(START_LIMIT).unwrap_or_default();
        let ready: Value = serde_json::from_str(&line).unwrap_or_else(|_| {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "oidc-provider did not start within {START_LIMIT:?}; its stderr:\n{}",
                self.stderr()
            )
        });
        self.issuer = ready["issuer"].as_str().expect("issuer").to_owned();
        self.port = u16::try_from(ready["port"].as_u64().expect("port")).expect("port");
        self.child = Some((child, stdin));
    }

    /// What the server wrote on stderr.
    /// Makes every introspection answer wait `delay` before it is computed (`None`: at
    /// once), from the next request on.
    pub fn set_introspection_delay(&self, delay: Option<Duration>) {
        let ms = delay.map_or(0, |d| d.as_millis());
        std::fs::write(self.dir.path().join("introspection-delay"), ms.to_string())
            .expect("write the introspection delay");
    }

    pub fn stderr(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("oidc.stderr")).unwrap_or_default()
    }

    pub fn issuer(&self) -> &str {
        &self.issuer
    }

    /// The Node process's id while the server runs (for its CPU time).
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|(child, _)| child.id())
    }

    /// The test CA's certificate file (the daemon's `[remote] ca_file`).
    pub fn ca_file(&self) -> PathBuf {
        self.dir.path().join("ca.pem")
    }

    pub fn ca(&self) -> &TestCa {
        &self.ca
    }

    /// A mode-0600 file holding [`INTROSPECTOR`]'s secret (its
    /// `client_secret_file`).
    pub fn secret_file(&self) -> PathBuf {
        use std::os::unix::fs::PermissionsExt;
        let path = self.dir.path().join("introspection.secret");
        std::fs::write(&path, format!("{}\n", INTROSPECTOR.secret)).expect("secret");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).expect("mode");
        path
    }

    /// The lines of a `[remote.introspection]` section that uses this server
    /// (endpoint discovered) with answers cached `cache`.
    pub fn introspection_section(&self, cache: &str) -> String {
        format!(
            "[remote.introspection]\nclient_id = {}\nclient_secret_file = {}\ncache = {}\n",
            serde_json::to_string(INTROSPECTOR.id).expect("id"),
            serde_json::to_string(&self.secret_file()).expect("path"),
            serde_json::to_string(cache).expect("cache"),
        )
    }

    /// The token endpoint's answer for a client-credentials request for `scope` and the
    /// daemon's public URL.
    pub async fn token_response(&self, client: Client, scope: &str) -> Value {
        let response = self
            .post("/token", client)
            .body(form(&[
                ("grant_type", "client_credentials"),
                ("scope", scope),
                ("resource", PUBLIC_URL),
            ]))
            .send()
            .await
            .unwrap_or_else(|e| {
                panic!(
                    "token request: {e:?}; the provider's stderr:\n{}",
                    self.stderr()
                )
            });
        json_of(response).await
    }

    fn post(&self, path: &str, client: Client) -> reqwest::RequestBuilder {
        self.http
            .post(format!("{}{path}", self.issuer))
            .basic_auth(client.id, Some(client.secret))
            .header("Content-Type", "application/x-www-form-urlencoded")
    }

    /// An access token for `client` with `scope`.
    pub async fn token(&self, client: Client, scope: &str) -> String {
        let answer = self.token_response(client, scope).await;
        answer["access_token"]
            .as_str()
            .unwrap_or_else(|| panic!("no access token for {}: {answer}", client.id))
            .to_owned()
    }

    /// Revoke `token` (RFC 7009) as the client it was issued to.
    pub async fn revoke(&self, client: Client, token: &str) {
        let status = self
            .post("/token/revocation", client)
            .body(form(&[
                ("token", token),
                ("token_type_hint", "access_token"),
            ]))
            .send()
            .await
            .expect("revocation request")
            .status();
        assert_eq!(status, 200, "revocation");
    }

    /// What the introspection endpoint says of `token`, asked as the daemon would.
    pub async fn introspect(&self, token: &str) -> Value {
        let response = self
            .post("/token/introspection", INTROSPECTOR)
            .body(form(&[("token", token)]))
            .send()
            .await
            .expect("introspection request");
        json_of(response).await
    }

    /// Stop the server: its port refuses connections until [`Oidc::start_again`].
    pub fn stop(&mut self) {
        if let Some((mut child, stdin)) = self.child.take() {
            drop(stdin);
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Start it again on the same port with the same signing key (no token survives).
    pub fn start_again(&mut self) {
        assert!(self.child.is_none(), "still running");
        self.spawn();
    }
}

impl Drop for Oidc {
    fn drop(&mut self) {
        self.stop();
    }
}
