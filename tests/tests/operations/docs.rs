//! No stale docs: every command shown in `README.md` and `docs/*.md` that can run here is
//! run against a real daemon, every example parses or validates, and the monitoring files
//! agree with `docs/metrics.md`.
//!
//! # The command convention
//!
//! - Only fenced blocks whose info string is `sh` hold commands. `text` (example output,
//!   file contents), `json`, `toml`, `yaml`, `nginx`, `caddyfile` and unlabelled blocks
//!   are not commands; `json`, `toml` and `yaml` blocks are checked by the other tests
//!   here.
//! - In an `sh` block every line is one command (a `\` at the end continues it on the next
//!   line); blank lines and `#` lines are skipped; here-documents are not allowed.
//! - Every command either runs here, or is listed in [`NOT_RUNNABLE`] with the reason it
//!   cannot (it needs systemd, the journal, a package manager, root on a real host, your
//!   authorization server, …). A command that is neither fails the test, and so does an
//!   entry of the list that no doc shows any more. Matching is on the exact command text
//!   (continuation lines joined with one space).
//! - The commands of one file run in order, as a reader would run them, each in its own
//!   `sh -c`, in one private working directory (also `$HOME`), against one daemon started
//!   by the harness (a new one if a command stopped it). Every command must exit 0 within
//!   [`COMMAND_LIMIT`], and print no JSON-RPC error and no tool error (`isError: true`);
//!   a doc that wants to show a failure shows it in a `text` block.
//!
//! # How a doc command meets this machine
//!
//! - `cargo run … -p NAME -- ARGS` is `NAME ARGS`: `robota-mcpd` and `robota-mcpctl` are
//!   the workspace binaries, first on `PATH`.
//! - `robota-mcpd` alone or with `--config FILE` ("start the daemon") is the daemon the
//!   harness runs (ephemeral ports, private directories), started if none runs.
//! - `ROBOTA_MCPD_SOCKET` names that daemon's control socket, and these literals are
//!   rewritten: `/run/robota-mcpd/control.sock` → its socket, `127.0.0.1:8765` → its
//!   loopback address, `127.0.0.1:9464` → its metrics address, `/var/lib/robota-mcpd` →
//!   its state directory, `/etc/robota-mcpd` → a private directory holding a valid
//!   `config.toml` (the embedded default), `/etc/prometheus` → a private directory.
//! - Its remote carrier serves `https://mcp.example.com/mcp` (issuer
//!   `https://auth.example.com`, scope `mcp`, client `ops-agent`) with a certificate from a
//!   test CA and a test signing key as `jwks_file`; `curl` is a wrapper first on `PATH` that
//!   adds `--connect-to mcp.example.com:443:<remote address>` and trusts that CA.
//! - A not-runnable command may have a stand-in that leaves what the reader would have
//!   afterwards: the token request of `remote-oauth.md` leaves `./token`, signed by the
//!   test key with the claims that page requires; the rules install of `prometheus.md`
//!   copies `docs/prometheus/alerts.yml` to the private `/etc/prometheus/rules/` and writes
//!   the `prometheus.yml` the page describes, which the doc's `promtool check config`
//!   (Debian's `prometheus` package) reads with the rules it names.
//!
//! # The other checks
//!
//! Every `json` block parses (one or more values); every `toml` block passes
//! `robota-mcpd check-config`; every `yaml` block and `docs/prometheus/alerts.yml` are
//! well-formed (a strict YAML subset) and the rules complete; `promtool` checks the rules
//! and runs their unit tests (`docs/prometheus/alerts.test.yml`), which cover every alert;
//! every metric and closed-set label value named in the docs, the alert rules, their tests
//! and the Grafana dashboard is in `docs/metrics.md`, and every daemon metric has a panel;
//! every refusal reason of `docs/metrics.md` has a row in the troubleshooting table of
//! `docs/operations.md` and vice versa; the dashboard is a loadable model; relative links
//! and their anchors resolve; and the stdio server entries of `docs/clients.md` start
//! servers that answer `initialize` and `tools/list` while the client keeps its stdin open.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use jsonwebtoken::Algorithm;
use robota_e2e::authz::{SigningKey, TestCa, TokenBuilder};
use robota_e2e::daemon::{CtlOutput, check_config, run_bounded};
use robota_e2e::docs::{
    Block, Yaml, anchors, doc_files, fenced_blocks, link_targets, metric_names, promql_balanced,
    read, repo_root, shell_commands, strip_cargo_run, yaml,
};
use robota_e2e::{Daemon, mcpctl_bin, mcpd_bin};
use robota_proto::Status;
use serde_json::{Value, json};

/// How long one doc command may run (`robota-mcpctl restart` can take about 20 s).
const COMMAND_LIMIT: Duration = Duration::from_secs(30);

/// The token request of `docs/remote-oauth.md` (not runnable; its stand-in writes `./token`).
const TOKEN_REQUEST: &str = "curl -s -K ./client.curlrc https://auth.example.com/oauth2/token -d grant_type=client_credentials -d scope=mcp --data-urlencode resource=https://mcp.example.com/mcp | jq -r .access_token > ./token";

/// The rules install of `docs/prometheus.md` (not runnable: the package's copy of the rules
/// is not installed here; its stand-in copies the rules to the private `/etc/prometheus`
/// and leaves the `prometheus.yml` the page's blocks describe).
const RULES_INSTALL: &str = "install -D -m 0644 /usr/share/doc/robota-mcpd/docs/prometheus/alerts.yml /etc/prometheus/rules/robota-mcpd.yml";

/// Commands the docs show that cannot run on a build machine, each with the reason.
/// Review an addition like a code change: a command belongs here only if running it here
/// is impossible, not merely inconvenient.
const NOT_RUNNABLE: &[(&str, &str)] = &[
    // README.md
    (
        "tests/run",
        "the test suite itself: running it from a test would recurse",
    ),
    // docs/operations.md: a Node.js upstream under the packaged unit (what
    // system::a_node_server_from_npm_runs_under_the_packaged_unit does in a booted machine)
    (
        "npm install --prefix /opt/mcp/filesystem @modelcontextprotocol/server-filesystem",
        "installs into /opt from the npm registry; the system test installs the pinned copy",
    ),
    (
        "chown -R robota-mcpd:robota-mcpd /srv/files",
        "needs the package's user and /srv; the system test runs it in the machine",
    ),
    (
        "systemctl edit robota-mcpd     # [Service] ReadWritePaths=/srv/files",
        "an interactive editor on a systemd host; the system test writes the same drop-in",
    ),
    // docs/operations.md: install
    (
        "apt install ./robota-mcpd_*.deb",
        "installs a package system-wide; the package is built by packaging/",
    ),
    (
        "cargo build --profile dist --locked -p robota-mcpd -p robota-mcpctl",
        "the shipped build; this test runs the binaries tests/run already built",
    ),
    (
        "install -m 0755 target/dist/robota-mcpd target/dist/robota-mcpctl /usr/bin/",
        "writes /usr/bin on the build machine",
    ),
    (
        "install -m 0644 systemd/robota-mcpd.service /etc/systemd/system/robota-mcpd.service",
        "installs a unit into the build machine's systemd",
    ),
    (
        "install -m 0644 systemd/robota-mcpd.sysusers /usr/lib/sysusers.d/robota-mcpd.conf",
        "writes /usr/lib on the build machine",
    ),
    (
        "install -m 0644 systemd/robota-mcpd.tmpfile /usr/lib/tmpfiles.d/robota-mcpd.conf",
        "writes /usr/lib on the build machine",
    ),
    (
        "systemd-sysusers robota-mcpd.conf",
        "creates system users on the build machine",
    ),
    (
        "systemd-tmpfiles --create robota-mcpd.conf",
        "creates /var/lib/robota-mcpd owned by a user this machine does not have",
    ),
    ("systemctl daemon-reload", "needs systemd as PID 1"),
    // docs/fuzzing.md
    (
        "cargo +nightly fuzz run control_frame -- -max_total_time=300",
        "runs libFuzzer for five minutes; needs a nightly toolchain and cargo-fuzz",
    ),
    (
        "cargo +nightly fuzz run jwt -- -max_total_time=300",
        "runs libFuzzer for five minutes; needs a nightly toolchain and cargo-fuzz",
    ),
    (
        "cargo test -p robota-mcpd --test fuzz_corpus --locked",
        "a cargo build inside the test suite; the suite runs this test itself",
    ),
    // docs/operations.md: systemd, accounts, journal
    (
        "systemctl status robota-mcpd",
        "needs systemd and the installed unit",
    ),
    (
        "systemctl enable --now robota-mcpd",
        "needs systemd and the installed unit",
    ),
    (
        "systemctl reload robota-mcpd",
        "needs systemd and the installed unit",
    ),
    (
        "systemctl restart robota-mcpd",
        "needs systemd and the installed unit",
    ),
    (
        "systemctl stop robota-mcpd",
        "needs systemd and the installed unit",
    ),
    (
        "systemctl start robota-mcpd",
        "needs systemd and the installed unit",
    ),
    (
        "usermod -aG robota-mcpd alice",
        "changes accounts on the build machine; needs the robota-mcpd group",
    ),
    (
        "rm -f /var/lib/robota-mcpd/robota.db-wal /var/lib/robota-mcpd/robota.db-shm",
        "restores into a stopped daemon's state directory; the harness daemon is running",
    ),
    (
        "install -m 0600 ./robota-db.backup /var/lib/robota-mcpd/robota.db",
        "restores into a stopped daemon's state directory; the harness daemon is running",
    ),
    (
        "chown -R robota-mcpd:robota-mcpd /var/lib/robota-mcpd",
        "needs the robota-mcpd user, which only the package creates",
    ),
    (
        "robota-mcpd check-config --config /etc/robota-mcpd/config.toml --as-user robota-mcpd",
        "needs the robota-mcpd user, which only the package creates (operations::check_config runs --as-user nobody)",
    ),
    (
        "journalctl -u robota-mcpd -f",
        "follows forever; needs the journal",
    ),
    (
        "journalctl -t robota-mcpd TARGET=robota_mcpd::audit --since -1h",
        "needs the journal with a robota-mcpd unit",
    ),
    (
        "journalctl -t robota-mcpd F_REASON=bad-bearer --since today",
        "needs the journal with a robota-mcpd unit",
    ),
    (
        "journalctl -t robota-mcpd F_CARRIER=remote F_THROTTLED=true",
        "needs the journal with a robota-mcpd unit",
    ),
    (
        "journalctl -t robota-mcpd TARGET=robota_mcpd::audit -o json | jq -r '[.F_CARRIER, .F_REASON, .F_THROTTLED, .F_ADDRESS_CLASS] | @tsv'",
        "needs the journal with a robota-mcpd unit",
    ),
    (
        "journalctl -u robota-mcpd -b -p notice",
        "needs the journal with a robota-mcpd unit",
    ),
    (
        "robota-mcpctl audit --follow",
        "streams until interrupted (the same request as `audit`, polled)",
    ),
    // docs/remote-oauth.md: the authorization server, reverse proxies
    (
        "curl -s https://auth.example.com/.well-known/openid-configuration | jq '{issuer, token_endpoint, jwks_uri}'",
        "needs your authorization server",
    ),
    (
        TOKEN_REQUEST,
        "needs your authorization server (stand-in: a test token)",
    ),
    ("nginx -t", "needs nginx and its configuration"),
    ("systemctl reload nginx", "needs systemd and nginx"),
    (
        "caddy validate --config /etc/caddy/Caddyfile",
        "needs Caddy and its configuration",
    ),
    ("systemctl reload caddy", "needs systemd and Caddy"),
    // docs/prometheus.md
    (
        RULES_INSTALL,
        "writes a Prometheus installation's configuration (stand-in: a private copy)",
    ),
    (
        "systemctl reload prometheus",
        "needs systemd and Prometheus",
    ), // docs/fleet.md: commands of the fleet's hosts, gateway and monitoring host
    (
        "/usr/share/robota-mcpd/fleet/robota-mcpd-fleet host --hosts /etc/robota-mcpd/fleet-hosts --gateway gw.example.com --name mcp-a --proxy 10.77.0.1 --issuer https://auth.example.com > /root/config.toml",
        "runs the installed package's generator on a fleet host; system::fleet runs it in each booted host",
    ),
    (
        "robota-mcpd check-config --config /root/config.toml",
        "checks the file the generator wrote on a fleet host; system::fleet runs it in each booted host",
    ),
    (
        "install -m 0644 /root/config.toml /etc/robota-mcpd/config.toml",
        "replaces a fleet host's configuration; system::fleet does it in each booted host",
    ),
    (
        "apt install systemd-journal-remote",
        "installs a package system-wide (Debian's registry)",
    ),
    (
        "systemctl enable --now systemd-journal-upload",
        "needs systemd as PID 1; system::fleet runs it in each booted host",
    ),
    (
        "apt install nginx",
        "installs a package system-wide (Debian's registry)",
    ),
    (
        "./robota-mcpd-fleet nginx --hosts /etc/robota-mcpd/fleet-hosts --gateway gw.example.com --cert /etc/letsencrypt/live/gw.example.com/fullchain.pem --key /etc/letsencrypt/live/gw.example.com/privkey.pem --output /etc/nginx/conf.d/robota-mcpd-fleet.conf",
        "writes the gateway's /etc/nginx with the package's generator; system::fleet runs it from the package with the test's certificate",
    ),
    (
        "apt install prometheus",
        "installs a package system-wide (Debian's registry)",
    ),
    (
        "./robota-mcpd-fleet targets --hosts /etc/robota-mcpd/fleet-hosts --output /etc/prometheus/robota-mcpd-targets.yml",
        "runs the package's generator on the monitoring host; system::fleet runs it from the package",
    ),
    (
        "systemctl enable --now systemd-journal-remote.socket",
        "needs systemd as PID 1 and the collector's certificate",
    ),
    (
        "journalctl -D /var/log/journal/remote _HOSTNAME=mcp-c F_REASON=wrong-audience",
        "reads a collector's journal; system::fleet runs the same query on its collector",
    ),
];

/// The remote carrier's public URL, issuer, scope and client in the docs' examples.
const PUBLIC_URL: &str = "https://mcp.example.com/mcp";
const ISSUER: &str = "https://auth.example.com";
const CLIENT: &str = "ops-agent";

/// TLS, signing key and the `[remote]` section of the daemons the doc commands run against.
struct Fixtures {
    dir: tempfile::TempDir,
    key: Arc<SigningKey>,
    remote_toml: String,
}

impl Fixtures {
    fn new() -> Fixtures {
        let dir = tempfile::Builder::new()
            .prefix("docs-fixtures-")
            .tempdir()
            .expect("tempdir");
        let ca = TestCa::new();
        let (cert, key_pem) = ca.leaf(&["mcp.example.com"]);
        let path = |name: &str| dir.path().join(name);
        std::fs::write(path("ca.pem"), ca.pem()).expect("ca.pem");
        std::fs::write(path("cert.pem"), cert).expect("cert.pem");
        std::fs::write(path("key.pem"), key_pem).expect("key.pem");
        let key = SigningKey::generate(Algorithm::ES256, "docs-1");
        std::fs::write(path("jwks.json"), json!({"keys": [key.jwk()]}).to_string())
            .expect("jwks.json");
        let remote_toml = format!(
            "[remote]\nlisten = \"127.0.0.1:0\"\npublic_url = \"{PUBLIC_URL}\"\n\
             issuer = \"{ISSUER}\"\njwks_file = \"{}\"\nscopes = [\"mcp\"]\n\
             allowed_clients = [\"{CLIENT}\"]\n\n[remote.tls]\ncert = \"{}\"\nkey = \"{}\"\n",
            path("jwks.json").display(),
            path("cert.pem").display(),
            path("key.pem").display(),
        );
        Fixtures {
            dir,
            key,
            remote_toml,
        }
    }

    fn ca_file(&self) -> PathBuf {
        self.dir.path().join("ca.pem")
    }

    /// An access token the doc daemon admits, as `remote-oauth.md` describes it.
    fn token(&self) -> String {
        TokenBuilder::new(&self.key, ISSUER, PUBLIC_URL)
            .claim("sub", CLIENT)
            .claim("client_id", CLIENT)
            .claim("scope", "mcp")
            .build()
    }
}

/// The embedded default configuration, as `robota-mcpd default-config` prints it.
fn default_config() -> String {
    let mut cmd = Command::new(mcpd_bin());
    cmd.arg("default-config")
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default());
    let out = run_bounded(cmd, COMMAND_LIMIT);
    out.expect_code(0, "robota-mcpd default-config");
    out.stdout
}

/// A program on the inherited PATH.
fn on_path(name: &str) -> Option<PathBuf> {
    std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())
        .map(|dir| dir.join(name))
        .find(|p| p.is_file())
}

/// A Debian tool on the inherited PATH, installed by `tests/setup.sh debian` if missing.
fn debian_tool(name: &str) -> PathBuf {
    if let Some(path) = on_path(name) {
        return path;
    }
    robota_e2e::setup::ensure("debian");
    on_path(name).unwrap_or_else(|| panic!("tests/setup.sh debian did not install {name}"))
}

/// The real `curl`.
fn real_curl() -> PathBuf {
    debian_tool("curl")
}

/// Prometheus's `promtool` (Debian's `prometheus` package).
fn promtool() -> PathBuf {
    debian_tool("promtool")
}

/// Where the current doc daemon listens.
struct Addrs {
    socket: PathBuf,
    state: PathBuf,
    loopback: String,
    metrics: String,
    remote: String,
}

/// The commands of one doc file, run in order.
struct Scenario<'a> {
    file: &'a Path,
    fixtures: &'a Fixtures,
    work: tempfile::TempDir,
    bin: PathBuf,
    etc: PathBuf,
    state: PathBuf,
    curl: PathBuf,
    daemon: Option<Daemon>,
    ran: usize,
    skipped: BTreeSet<&'static str>,
    failures: Vec<String>,
}

impl<'a> Scenario<'a> {
    fn new(file: &'a Path, fixtures: &'a Fixtures, default_config: &str) -> Scenario<'a> {
        let work = tempfile::Builder::new()
            .prefix("docs-run-")
            .tempdir()
            .expect("tempdir");
        std::fs::set_permissions(work.path(), std::fs::Permissions::from_mode(0o755))
            .expect("chmod");
        let bin = work.path().join(".bin");
        std::fs::create_dir(&bin).expect("mkdir bin");
        std::os::unix::fs::symlink(mcpd_bin(), bin.join("robota-mcpd")).expect("symlink");
        std::os::unix::fs::symlink(mcpctl_bin(), bin.join("robota-mcpctl")).expect("symlink");
        let etc = work.path().join(".etc/robota-mcpd");
        std::fs::create_dir_all(&etc).expect("mkdir etc");
        std::fs::write(etc.join("config.toml"), default_config).expect("config.toml");
        let state = work.path().join(".state");
        Scenario {
            file,
            fixtures,
            bin,
            etc,
            state,
            work,
            curl: real_curl(),
            daemon: None,
            ran: 0,
            skipped: BTreeSet::new(),
            failures: Vec::new(),
        }
    }

    /// The running doc daemon's addresses, starting a daemon if none serves.
    fn live_daemon(&mut self) -> Addrs {
        if let Some(d) = &self.daemon
            && d.try_exit().is_none()
        {
            let out = d.ctl(&["--json", "status"]);
            let status = serde_json::from_str::<Status>(&out.stdout).ok();
            match status {
                Some(st) if out.code() == Some(0) && st.state == "serving" => {
                    return addrs(d, &st);
                }
                // Stopping (a doc command stopped it): let it go, then start another.
                _ => {
                    d.wait_exit(Duration::from_secs(15));
                }
            }
        }
        self.daemon = None;
        let d = Daemon::builder()
            .state_dir(&self.state)
            .extra(&self.fixtures.remote_toml)
            .start();
        let st = d.status();
        let a = addrs(&d, &st);
        self.daemon = Some(d);
        a
    }

    fn rewrite(&self, command: &str, a: &Addrs) -> String {
        command
            .replace(
                "/run/robota-mcpd/control.sock",
                &a.socket.display().to_string(),
            )
            .replace("127.0.0.1:8765", &a.loopback)
            .replace("127.0.0.1:9464", &a.metrics)
            .replace("/var/lib/robota-mcpd", &a.state.display().to_string())
            .replace("/etc/robota-mcpd", &self.etc.display().to_string())
            .replace("/etc/prometheus", &self.prometheus().display().to_string())
    }

    /// The private `/etc/prometheus`.
    fn prometheus(&self) -> PathBuf {
        self.work.path().join(".etc/prometheus")
    }

    fn write_curl_wrapper(&self, a: &Addrs) {
        let script = format!(
            "#!/bin/sh\nexec '{}' --connect-to 'mcp.example.com:443:{}' --cacert '{}' \"$@\"\n",
            self.curl.display(),
            a.remote,
            self.fixtures.ca_file().display()
        );
        let path = self.bin.join("curl");
        std::fs::write(&path, script).expect("curl wrapper");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    }

    fn fail(&mut self, line: usize, text: &str, why: String) {
        self.failures.push(format!(
            "{}:{line}: `{text}`\n    {why}",
            self.file.display()
        ));
    }

    fn run(&mut self, line: usize, text: &str) {
        if let Some((entry, _)) = NOT_RUNNABLE.iter().find(|(c, _)| *c == text) {
            self.skipped.insert(entry);
            if text == TOKEN_REQUEST {
                let token = self.fixtures.token();
                let path = self.work.path().join("token");
                std::fs::write(&path, format!("{token}\n")).expect("token");
                std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))
                    .expect("chmod token");
            }
            if text == RULES_INSTALL {
                let rules = self.prometheus().join("rules");
                std::fs::create_dir_all(&rules).expect("mkdir prometheus rules");
                std::fs::copy(
                    repo_root().join("docs/prometheus/alerts.yml"),
                    rules.join("robota-mcpd.yml"),
                )
                .expect("copy the alert rules");
                // The scrape job and `rule_files:` as the page shows them.
                let config = format!(
                    "rule_files:\n  - {}/*.yml\n\nscrape_configs:\n  - job_name: robota-mcpd\n    scrape_interval: 30s\n    static_configs:\n      - targets: [\"127.0.0.1:9464\"]\n",
                    rules.display()
                );
                std::fs::write(self.prometheus().join("prometheus.yml"), config)
                    .expect("write prometheus.yml");
            }
            return;
        }
        let command = strip_cargo_run(text);
        let a = self.live_daemon();
        let words: Vec<&str> = command.split_whitespace().collect();
        if matches!(
            words.as_slice(),
            ["robota-mcpd"] | ["robota-mcpd", "--config", _]
        ) {
            // "Start the daemon": the harness's daemon is that daemon.
            self.ran += 1;
            return;
        }
        self.write_curl_wrapper(&a);
        let shell_text = self.rewrite(&command, &a);
        let path = std::env::join_paths(std::iter::once(self.bin.clone()).chain(
            std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default()),
        ))
        .expect("PATH");
        let mut cmd = Command::new("/bin/sh");
        cmd.arg("-c")
            .arg(&shell_text)
            .env_clear()
            .env("PATH", path)
            .env("HOME", self.work.path())
            .env("LC_ALL", "C")
            .env("ROBOTA_MCPD_SOCKET", &a.socket)
            .current_dir(self.work.path());
        let started = Instant::now();
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            run_bounded(cmd, COMMAND_LIMIT)
        }));
        self.ran += 1;
        match outcome {
            Ok(out) if out.code() == Some(0) && mcp_error(&out.stdout).is_none() => {}
            Ok(out) if out.code() == Some(0) => {
                let why = format!(
                    "{}\n    {}",
                    mcp_error(&out.stdout).unwrap_or_default(),
                    describe(&shell_text, &out, started)
                );
                self.fail(line, text, why);
            }
            Ok(out) => self.fail(line, text, describe(&shell_text, &out, started)),
            Err(panic) => self.fail(
                line,
                text,
                format!("as `{shell_text}`: {}", panic_text(&panic)),
            ),
        }
    }
}

/// A JSON-RPC error or a tool error in a command's output: a doc example must show the
/// call working (HTTP 200 and exit 0 are not enough for MCP).
fn mcp_error(stdout: &str) -> Option<String> {
    let compact: String = stdout.split_whitespace().collect();
    if compact.contains("\"jsonrpc\":\"2.0\"") && compact.contains("\"error\":{") {
        return Some("the output holds a JSON-RPC error".into());
    }
    compact
        .contains("\"isError\":true")
        .then(|| "the output holds a tool error (isError: true)".into())
}

fn addrs(d: &Daemon, st: &Status) -> Addrs {
    let find = |name: &str| {
        st.carriers
            .iter()
            .find(|c| c.name == name)
            .map(|c| c.address.clone())
            .unwrap_or_else(|| panic!("the doc daemon has no {name} carrier: {st:?}"))
    };
    Addrs {
        socket: d.socket_path().to_path_buf(),
        state: d.state_dir().to_path_buf(),
        loopback: find("loopback"),
        metrics: find("metrics"),
        remote: find("remote"),
    }
}

fn describe(shell_text: &str, out: &CtlOutput, started: Instant) -> String {
    let cut = |s: &str| s.chars().take(2000).collect::<String>();
    format!(
        "as `{shell_text}`: exit {:?} after {:?}\n    stdout: {}\n    stderr: {}",
        out.code(),
        started.elapsed(),
        cut(&out.stdout),
        cut(&out.stderr)
    )
}

fn panic_text(panic: &Box<dyn std::any::Any + Send>) -> String {
    panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| (*s).to_owned()))
        .unwrap_or_else(|| "panic".into())
}

/// Every fenced block of every doc file, with its file.
fn all_blocks() -> Vec<(PathBuf, Block)> {
    doc_files()
        .into_iter()
        .flat_map(|f| {
            let text = read(&f);
            fenced_blocks(&text)
                .into_iter()
                .map(move |b| (f.clone(), b))
        })
        .collect()
}

#[test]
fn every_doc_command_runs_or_is_listed_as_not_runnable() {
    let fixtures = Fixtures::new();
    let default_config = default_config();
    let files: Vec<PathBuf> = doc_files()
        .into_iter()
        .filter(|f| fenced_blocks(&read(f)).iter().any(|b| b.lang == "sh"))
        .collect();
    let results: Vec<(PathBuf, usize, BTreeSet<&'static str>, Vec<String>)> =
        std::thread::scope(|s| {
            let handles: Vec<_> = files
                .iter()
                .map(|file| {
                    let fixtures = &fixtures;
                    let default_config = &default_config;
                    s.spawn(move || {
                        let mut sc = Scenario::new(file, fixtures, default_config);
                        for block in fenced_blocks(&read(file)).iter().filter(|b| b.lang == "sh") {
                            for c in shell_commands(block) {
                                sc.run(c.line, &c.text);
                            }
                        }
                        (sc.ran, sc.skipped.clone(), std::mem::take(&mut sc.failures))
                    })
                })
                .collect();
            files
                .iter()
                .zip(handles)
                .map(|(file, h)| match h.join() {
                    Ok((ran, skipped, failures)) => (file.clone(), ran, skipped, failures),
                    Err(panic) => (
                        file.clone(),
                        0,
                        BTreeSet::new(),
                        vec![format!("{}: {}", file.display(), panic_text(&panic))],
                    ),
                })
                .collect()
        });

    let mut failures = Vec::new();
    let mut used = BTreeSet::new();
    let mut ran_total = 0;
    for (file, ran, skipped, errs) in results {
        eprintln!(
            "{}: {ran} commands run, {} not runnable",
            file.display(),
            skipped.len()
        );
        ran_total += ran;
        used.extend(skipped);
        failures.extend(errs);
    }
    for (command, _) in NOT_RUNNABLE {
        if !used.contains(command) {
            failures.push(format!(
                "NOT_RUNNABLE lists `{command}`, which no doc shows any more: remove it"
            ));
        }
    }
    assert!(
        ran_total >= 30,
        "only {ran_total} doc commands ran: is the sh-block convention still followed?"
    );
    assert!(
        failures.is_empty(),
        "{} doc command problem(s):\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn every_json_block_parses() {
    let mut failures = Vec::new();
    let mut count = 0;
    for (file, block) in all_blocks().into_iter().filter(|(_, b)| b.lang == "json") {
        count += 1;
        let text = block.text();
        let mut values = serde_json::Deserializer::from_str(&text).into_iter::<Value>();
        let mut n = 0;
        loop {
            match values.next() {
                Some(Ok(_)) => n += 1,
                Some(Err(e)) => {
                    failures.push(format!("{}:{}: {e}", file.display(), block.line));
                    break;
                }
                None => break,
            }
        }
        if n == 0 && failures.is_empty() {
            failures.push(format!(
                "{}:{}: empty JSON block",
                file.display(),
                block.line
            ));
        }
    }
    assert!(count >= 10, "only {count} JSON blocks found");
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The docs name files where an operator keeps them (TLS files, a job's program, the
/// introspection secret);
/// check-config reads them, so the snippet is checked with real ones put in their place.
fn with_tls_files(text: &str, dir: &std::path::Path) -> String {
    const CERT: &str = "/etc/robota-mcpd/tls/fullchain.pem";
    const KEY: &str = "/etc/robota-mcpd/tls/privkey.pem";
    const PROGRAM: &str = "/usr/local/bin/backup";
    const SECRET: &str = "/etc/robota-mcpd/introspection.secret";
    let mut text = text.to_owned();
    if text.contains(SECRET) {
        use std::os::unix::fs::PermissionsExt;
        let secret = dir.join("introspection.secret");
        std::fs::write(&secret, "a-client-secret\n").expect("secret");
        std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600)).expect("chmod");
        text = text.replace(SECRET, &secret.display().to_string());
    }
    if text.contains(PROGRAM) {
        use std::os::unix::fs::PermissionsExt;
        let program = dir.join("backup");
        std::fs::write(&program, "#!/bin/sh\nexit 0\n").expect("program");
        std::fs::set_permissions(&program, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        text = text.replace(PROGRAM, &program.display().to_string());
    }
    if !text.contains(CERT) {
        return text;
    }
    let (cert, key) = robota_e2e::authz::TestCa::new().leaf(&["mcp.example.com"]);
    let (cert_file, key_file) = (dir.join("fullchain.pem"), dir.join("privkey.pem"));
    std::fs::write(&cert_file, cert).expect("cert");
    std::fs::write(&key_file, key).expect("key");
    text.replace(CERT, &cert_file.display().to_string())
        .replace(KEY, &key_file.display().to_string())
}

#[test]
fn every_toml_block_passes_check_config() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut failures = Vec::new();
    let mut count = 0;
    for (file, block) in all_blocks().into_iter().filter(|(_, b)| b.lang == "toml") {
        count += 1;
        let path = dir.path().join(format!("snippet-{count}.toml"));
        std::fs::write(&path, with_tls_files(&block.text(), dir.path())).expect("write snippet");
        let out = check_config(&path);
        if out.code() != Some(0) {
            failures.push(format!(
                "{}:{}: robota-mcpd check-config exited {:?}:\n{}",
                file.display(),
                block.line,
                out.code(),
                out.stderr
            ));
        }
    }
    assert!(count >= 6, "only {count} TOML blocks found");
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Closed label sets from `docs/metrics.md` ("Label values"): label → values. `outcome`
/// collects both of its bullets (tool calls and JWKS fetches).
fn label_values() -> BTreeMap<String, BTreeSet<String>> {
    let text = read(Path::new("docs/metrics.md"));
    let section = text
        .split("## Label values")
        .nth(1)
        .expect("metrics.md has a Label values section");
    let mut out: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut bullets: Vec<String> = Vec::new();
    for line in section.lines() {
        if line.starts_with("- ") {
            bullets.push(line.to_owned());
        } else if line.starts_with("  ")
            && let Some(last) = bullets.last_mut()
        {
            last.push(' ');
            last.push_str(line.trim());
        }
    }
    for bullet in bullets {
        let ticks: Vec<&str> = bullet.split('`').skip(1).step_by(2).collect();
        let Some((label, values)) = ticks.split_first() else {
            continue;
        };
        out.entry((*label).to_owned())
            .or_default()
            .extend(values.iter().map(|v| (*v).to_owned()));
    }
    out
}

/// Documented metric names from `docs/metrics.md` with their types (`process` for the
/// process collector's).
fn documented_metrics() -> BTreeMap<String, String> {
    let text = read(Path::new("docs/metrics.md"));
    let mut out = BTreeMap::new();
    for line in text.lines() {
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        if cells.len() > 3 && cells[1].starts_with("`robota_mcpd_") {
            out.insert(cells[1].trim_matches('`').to_owned(), cells[2].to_owned());
        }
    }
    let process = text
        .split("## Process metrics")
        .nth(1)
        .and_then(|s| s.split("\n## ").next())
        .expect("metrics.md has a Process metrics section");
    for name in process.split('`').skip(1).step_by(2) {
        if name.starts_with("process_") {
            out.insert(name.to_owned(), "process".to_owned());
        }
    }
    out
}

/// Whether a metric name (possibly a histogram series) is documented.
fn is_documented(name: &str, documented: &BTreeMap<String, String>) -> bool {
    documented.contains_key(name)
        || ["_bucket", "_sum", "_count"].iter().any(|suffix| {
            name.strip_suffix(suffix)
                .and_then(|base| documented.get(base))
                .is_some_and(|t| t == "histogram")
        })
}

/// Label matchers on closed-set labels (`reason="x"`, `outcome=~"a|b"`, …) whose values
/// are not documented.
fn unknown_label_values(expr: &str, labels: &BTreeMap<String, BTreeSet<String>>) -> Vec<String> {
    let mut out = Vec::new();
    for label in ["carrier", "reason", "outcome", "code"] {
        let known = &labels[label];
        for op in ["=~\"", "!~\"", "!=\"", "=\""] {
            let pattern = format!("{label}{op}");
            let mut rest = expr;
            while let Some(i) = rest.find(&pattern) {
                let preceded = i > 0
                    && rest[..i]
                        .chars()
                        .last()
                        .is_some_and(|c| c.is_alphanumeric() || c == '_');
                let after = &rest[i + pattern.len()..];
                let end = after.find('"').unwrap_or(after.len());
                if !preceded {
                    for value in after[..end].split('|') {
                        if !known.contains(value) {
                            out.push(format!("{label}: {value:?}"));
                        }
                    }
                }
                rest = &after[end..];
            }
        }
    }
    out
}

fn alert_rules() -> Vec<Yaml> {
    let text = read(Path::new("docs/prometheus/alerts.yml"));
    let doc = yaml(&text).unwrap_or_else(|e| panic!("docs/prometheus/alerts.yml: {e}"));
    let mut rules = Vec::new();
    for group in doc
        .get("groups")
        .and_then(Yaml::as_seq)
        .expect("alerts.yml: groups is a list")
    {
        assert!(
            group.get("name").and_then(Yaml::as_str).is_some(),
            "alerts.yml: every group has a name"
        );
        rules.extend(
            group
                .get("rules")
                .and_then(Yaml::as_seq)
                .expect("alerts.yml: every group has a list of rules")
                .iter()
                .cloned(),
        );
    }
    rules
}

fn grafana() -> Value {
    serde_json::from_str(&read(Path::new("docs/grafana/robota-mcpd.json")))
        .expect("docs/grafana/robota-mcpd.json is JSON")
}

/// Every PromQL expression of the Grafana dashboard (targets and variable queries).
fn grafana_exprs(dashboard: &Value) -> Vec<String> {
    let mut out = Vec::new();
    for panel in dashboard["panels"].as_array().into_iter().flatten() {
        for target in panel["targets"].as_array().into_iter().flatten() {
            if let Some(e) = target["expr"].as_str() {
                out.push(e.to_owned());
            }
        }
    }
    for var in dashboard["templating"]["list"]
        .as_array()
        .into_iter()
        .flatten()
    {
        if let Some(q) = var["query"]["query"].as_str().or(var["query"].as_str()) {
            out.push(q.to_owned());
        }
    }
    out
}

#[test]
fn yaml_blocks_and_alert_rules_are_well_formed() {
    let mut failures = Vec::new();
    let mut scrape_jobs = Vec::new();
    for (file, block) in all_blocks().into_iter().filter(|(_, b)| b.lang == "yaml") {
        match yaml(&block.text()) {
            Ok(doc) => {
                for job in doc
                    .get("scrape_configs")
                    .and_then(Yaml::as_seq)
                    .into_iter()
                    .flatten()
                {
                    scrape_jobs.extend(
                        job.get("job_name")
                            .and_then(Yaml::as_str)
                            .map(str::to_owned),
                    );
                }
            }
            Err(e) => failures.push(format!("{}:{}: {e}", file.display(), block.line)),
        }
    }
    // prometheus.md's job for one host, fleet.md's for many: one name, the one the alerts
    // and the dashboard expect.
    assert!(
        !scrape_jobs.is_empty() && scrape_jobs.iter().all(|j| j == "robota-mcpd"),
        "the docs' scrape jobs are all named robota-mcpd, as the alerts and dashboard expect: {scrape_jobs:?}"
    );

    let rules = alert_rules();
    assert!(rules.len() >= 8, "only {} alert rules", rules.len());
    let mut names = BTreeSet::new();
    let mut exprs = String::new();
    for rule in &rules {
        let name = rule.get("alert").and_then(Yaml::as_str).unwrap_or_default();
        if name.is_empty() || !names.insert(name.to_owned()) {
            failures.push(format!("alert name missing or repeated: {name:?}"));
        }
        for key in rule.keys() {
            if ![
                "alert",
                "expr",
                "for",
                "keep_firing_for",
                "labels",
                "annotations",
            ]
            .contains(&key)
            {
                failures.push(format!("{name}: unknown rule key {key:?}"));
            }
        }
        let expr = rule.get("expr").and_then(Yaml::as_str).unwrap_or_default();
        if expr.is_empty() || !promql_balanced(expr) {
            failures.push(format!("{name}: missing or unbalanced expr {expr:?}"));
        }
        if expr.contains("job=") && !expr.contains("job=\"robota-mcpd\"") {
            failures.push(format!("{name}: selects another job: {expr}"));
        }
        exprs.push_str(expr);
        exprs.push('\n');
        if let Some(d) = rule.get("for") {
            let ok = d.as_str().is_some_and(|d| {
                d.len() > 1
                    && d[..d.len() - 1].chars().all(|c| c.is_ascii_digit())
                    && d.ends_with(['s', 'm', 'h'])
            });
            if !ok {
                failures.push(format!("{name}: `for` is not a duration: {d:?}"));
            }
        }
        let severity = rule
            .get("labels")
            .and_then(|l| l.get("severity"))
            .and_then(Yaml::as_str);
        if !matches!(severity, Some("critical" | "warning" | "info")) {
            failures.push(format!("{name}: severity is {severity:?}"));
        }
        for key in ["summary", "description"] {
            let text = rule
                .get("annotations")
                .and_then(|a| a.get(key))
                .and_then(Yaml::as_str)
                .unwrap_or_default();
            if text.is_empty() || text.matches("{{").count() != text.matches("}}").count() {
                failures.push(format!("{name}: annotation {key} is empty or unbalanced"));
            }
        }
    }
    // The alerts the operations guide promises.
    for needed in [
        "robota_mcpd_refusals_total",
        "robota_mcpd_throttled_total",
        "keys-unavailable",
        "robota_mcpd_jwks_fetches_total",
        "up{job=\"robota-mcpd\"} == 0",
    ] {
        if !exprs.contains(needed) {
            failures.push(format!("no alert expression uses {needed}"));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn the_alert_rules_pass_promtool() {
    let promtool = promtool();
    for args in [
        ["check", "rules", "docs/prometheus/alerts.yml"],
        ["test", "rules", "docs/prometheus/alerts.test.yml"],
    ] {
        let mut cmd = Command::new(&promtool);
        cmd.args(args).current_dir(repo_root());
        let out = run_bounded(cmd, COMMAND_LIMIT);
        assert_eq!(
            out.code(),
            Some(0),
            "promtool {}: {:?}\nstdout: {}\nstderr: {}",
            args.join(" "),
            out.status,
            out.stdout,
            out.stderr
        );
    }

    // The unit tests load the shipped rules and cover every alert, each with a case that
    // expects it firing; a case for a name that is no alert would pass unnoticed.
    let text = read(Path::new("docs/prometheus/alerts.test.yml"));
    let doc = yaml(&text).unwrap_or_else(|e| panic!("docs/prometheus/alerts.test.yml: {e}"));
    let rule_files: Vec<_> = doc
        .get("rule_files")
        .and_then(Yaml::as_seq)
        .unwrap_or_default()
        .iter()
        .map(Yaml::as_str)
        .collect();
    assert_eq!(
        rule_files,
        [Some("alerts.yml")],
        "alerts.test.yml: rule_files"
    );
    let alerts: BTreeSet<String> = alert_rules()
        .iter()
        .filter_map(|r| r.get("alert")?.as_str().map(str::to_owned))
        .collect();
    let mut tested = BTreeSet::new();
    let mut firing = BTreeSet::new();
    for case in doc
        .get("tests")
        .and_then(Yaml::as_seq)
        .expect("alerts.test.yml: tests is a list")
        .iter()
        .flat_map(|t| {
            t.get("alert_rule_test")
                .and_then(Yaml::as_seq)
                .unwrap_or_default()
        })
    {
        let name = case
            .get("alertname")
            .and_then(Yaml::as_str)
            .expect("alerts.test.yml: every alert_rule_test case has an alertname")
            .to_owned();
        if case
            .get("exp_alerts")
            .and_then(Yaml::as_seq)
            .is_some_and(|a| !a.is_empty())
        {
            firing.insert(name.clone());
        }
        tested.insert(name);
    }
    let untested: Vec<_> = alerts.difference(&tested).collect();
    let never_firing: Vec<_> = alerts.difference(&firing).collect();
    let unknown: Vec<_> = tested.difference(&alerts).collect();
    assert!(
        untested.is_empty() && never_firing.is_empty() && unknown.is_empty(),
        "docs/prometheus/alerts.test.yml: alerts without a test {untested:?}, \
         alerts no case expects firing {never_firing:?}, \
         alertnames that are no alert of alerts.yml {unknown:?}"
    );
}

#[test]
fn metrics_named_in_docs_and_monitoring_files_are_documented() {
    let documented = documented_metrics();
    assert!(
        documented.len() >= 9,
        "metrics.md lists too few metrics: {documented:?}"
    );
    let labels = label_values();
    for label in ["carrier", "reason", "outcome", "code"] {
        assert!(
            labels.get(label).is_some_and(|v| !v.is_empty()),
            "metrics.md lists no values for {label}"
        );
    }
    let dashboard = grafana();
    let mut sources: Vec<(String, String)> = doc_files()
        .into_iter()
        .filter(|f| f != Path::new("docs/metrics.md"))
        .map(|f| (f.display().to_string(), read(&f)))
        .collect();
    for file in [
        "docs/prometheus/alerts.yml",
        "docs/prometheus/alerts.test.yml",
    ] {
        sources.push((file.into(), read(Path::new(file))));
    }
    sources.push((
        "docs/grafana/robota-mcpd.json".into(),
        grafana_exprs(&dashboard).join("\n"),
    ));
    let mut failures = Vec::new();
    for (name, text) in &sources {
        for metric in metric_names(text) {
            if !is_documented(&metric, &documented) {
                failures.push(format!("{name}: {metric} is not in docs/metrics.md"));
            }
        }
    }
    // Label values in PromQL: the alert rules, the dashboard, the queries on prometheus.md.
    let mut exprs: Vec<(String, String)> = alert_rules()
        .iter()
        .filter_map(|r| {
            Some((
                format!("alert {}", r.get("alert")?.as_str()?),
                r.get("expr")?.as_str()?.to_owned(),
            ))
        })
        .collect();
    exprs.extend(
        grafana_exprs(&dashboard)
            .into_iter()
            .map(|e| ("grafana".to_owned(), e)),
    );
    exprs.extend(sources.iter().cloned());
    for (what, expr) in &exprs {
        for bad in unknown_label_values(expr, &labels) {
            failures.push(format!("{what}: undocumented label value {bad}"));
        }
    }
    // Every daemon metric has a place on the dashboard.
    let all = grafana_exprs(&dashboard).join("\n");
    let shown = metric_names(&all);
    for (metric, kind) in &documented {
        let on_dashboard = shown.contains(metric)
            || (kind == "histogram" && shown.contains(&format!("{metric}_bucket")));
        if metric.starts_with("robota_mcpd_") && !on_dashboard {
            failures.push(format!("{metric} has no panel on the Grafana dashboard"));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn every_refusal_reason_is_in_the_troubleshooting_table() {
    let reasons = label_values()
        .remove("reason")
        .expect("metrics.md lists the reason values");
    assert!(reasons.len() >= 21, "too few reasons: {reasons:?}");
    let ops = read(Path::new("docs/operations.md"));
    let section = ops
        .split("### By audit reason")
        .nth(1)
        .expect("operations.md has a `### By audit reason` section");
    let section = section.split("\n#").next().unwrap_or(section);
    let rows: BTreeSet<String> = section
        .lines()
        .filter_map(|l| {
            let first = l.strip_prefix('|')?.split('|').next()?.trim();
            let name = first.strip_prefix('`')?.strip_suffix('`')?;
            Some(name.to_owned())
        })
        .collect();
    let missing: Vec<_> = reasons.difference(&rows).collect();
    let unknown: Vec<_> = rows.difference(&reasons).collect();
    assert!(
        missing.is_empty() && unknown.is_empty(),
        "operations.md troubleshooting table: missing reasons {missing:?}, reasons not in metrics.md {unknown:?}"
    );
}

#[test]
fn grafana_dashboard_is_a_loadable_model() {
    let d = grafana();
    let mut failures = Vec::new();
    for key in ["title", "uid"] {
        if d[key].as_str().is_none_or(str::is_empty) {
            failures.push(format!("dashboard {key} missing"));
        }
    }
    if d["schemaVersion"].as_u64().is_none_or(|v| v < 30) {
        failures.push(format!("schemaVersion {:?}", d["schemaVersion"]));
    }
    // The data source: an import input (or a datasource variable) every query points at.
    let input = d["__inputs"]
        .as_array()
        .into_iter()
        .flatten()
        .any(|i| i["name"] == "DS_PROMETHEUS" && i["pluginId"] == "prometheus");
    let variable = d["templating"]["list"]
        .as_array()
        .into_iter()
        .flatten()
        .any(|v| v["type"] == "datasource" && v["query"] == "prometheus");
    if !input && !variable {
        failures.push("no DS_PROMETHEUS input and no prometheus datasource variable".into());
    }
    let ds_ok = |ds: &Value| {
        let uid = ds["uid"].as_str().or(ds.as_str()).unwrap_or_default();
        uid == "${DS_PROMETHEUS}" || uid.starts_with('$')
    };
    let vars: BTreeSet<String> = d["templating"]["list"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|v| v["name"].as_str().map(str::to_owned))
        .collect();
    for v in d["templating"]["list"].as_array().into_iter().flatten() {
        if v["type"] == "query" && !ds_ok(&v["datasource"]) {
            failures.push(format!(
                "variable {} has datasource {}",
                v["name"], v["datasource"]
            ));
        }
    }
    let panels = d["panels"].as_array().cloned().unwrap_or_default();
    if panels.len() < 8 {
        failures.push(format!("only {} panels", panels.len()));
    }
    let mut ids = BTreeSet::new();
    let mut cells: BTreeSet<(u64, u64)> = BTreeSet::new();
    for p in &panels {
        let title = p["title"].as_str().unwrap_or_default().to_owned();
        if title.is_empty() {
            failures.push(format!("a panel without title: {}", p["id"]));
        }
        if p["type"].as_str().is_none_or(str::is_empty) {
            failures.push(format!("{title}: no type"));
        }
        if p["type"] == "row" {
            failures.push(format!("{title}: row panels are not used (flat layout)"));
        }
        match p["id"].as_u64() {
            Some(id) if ids.insert(id) => {}
            other => failures.push(format!("{title}: id {other:?} missing or repeated")),
        }
        if !ds_ok(&p["datasource"]) {
            failures.push(format!("{title}: datasource {}", p["datasource"]));
        }
        let g = &p["gridPos"];
        let [h, w, x, y] = ["h", "w", "x", "y"].map(|k| g[k].as_u64());
        match (h, w, x, y) {
            (Some(h), Some(w), Some(x), Some(y)) if h > 0 && w > 0 && x + w <= 24 => {
                for cx in x..x + w {
                    for cy in y..y + h {
                        if !cells.insert((cx, cy)) {
                            failures.push(format!("{title}: overlaps another panel at {cx},{cy}"));
                        }
                    }
                }
            }
            _ => failures.push(format!("{title}: bad gridPos {g}")),
        }
        let targets = p["targets"].as_array().cloned().unwrap_or_default();
        if targets.is_empty() {
            failures.push(format!("{title}: no targets"));
        }
        let mut refs = BTreeSet::new();
        for t in &targets {
            let expr = t["expr"].as_str().unwrap_or_default();
            if expr.is_empty() || !promql_balanced(expr) {
                failures.push(format!("{title}: empty or unbalanced expr {expr:?}"));
            }
            if !refs.insert(t["refId"].as_str().unwrap_or_default().to_owned()) {
                failures.push(format!("{title}: refId missing or repeated"));
            }
            if !t["datasource"].is_null() && !ds_ok(&t["datasource"]) {
                failures.push(format!("{title}: target datasource {}", t["datasource"]));
            }
            // `$var` references name variables of the dashboard (or Grafana's own `$__…`).
            for piece in expr.split('$').skip(1) {
                let name: String = piece
                    .trim_start_matches('{')
                    .chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_')
                    .collect();
                if !name.starts_with("__") && !vars.contains(&name) {
                    failures.push(format!("{title}: unknown variable ${name}"));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn relative_links_and_anchors_resolve() {
    let root = repo_root();
    let mut failures = Vec::new();
    for file in doc_files() {
        let text = read(&file);
        let dir = file.parent().unwrap_or(Path::new(""));
        for target in link_targets(&text) {
            if target.starts_with("http://")
                || target.starts_with("https://")
                || target.starts_with("mailto:")
            {
                continue;
            }
            let (path, anchor) = target.split_once('#').unwrap_or((&target, ""));
            let resolved = if path.is_empty() {
                file.clone()
            } else {
                dir.join(path)
            };
            let full = root.join(&resolved);
            if !full.exists() {
                failures.push(format!("{}: link to missing {target}", file.display()));
                continue;
            }
            if !anchor.is_empty()
                && resolved.extension().is_some_and(|x| x == "md")
                && !anchors(&std::fs::read_to_string(&full).unwrap_or_default()).contains(anchor)
            {
                failures.push(format!(
                    "{}: no heading for #{anchor} in {}",
                    file.display(),
                    resolved.display()
                ));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Speaks MCP 2025-11-25 over a child's stdin/stdout: initialize, then `tools/list`.
/// Returns the tool names; stdin is closed afterwards and the child must exit 0.
fn stdio_tools(mut cmd: Command, what: &str) -> Result<Vec<String>, String> {
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("{what}: spawn: {e}"))?;
    let stdout = child.stdout.take().expect("stdout");
    let stderr = child.stderr.take().expect("stderr");
    let (tx, rx) = mpsc::channel::<String>();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let err_reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = std::io::Read::read_to_string(&mut BufReader::new(stderr), &mut s);
        s
    });
    let mut stdin = child.stdin.take().expect("stdin");
    let messages = [
        json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
            "protocolVersion": "2025-11-25", "capabilities": {},
            "clientInfo": {"name": "docs-test", "version": "0"}}}),
        json!({"jsonrpc": "2.0", "method": "notifications/initialized"}),
        json!({"jsonrpc": "2.0", "id": 2, "method": "tools/list"}),
    ];
    for m in &messages {
        writeln!(stdin, "{m}").map_err(|e| format!("{what}: write: {e}"))?;
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut tools = None;
    while tools.is_none() {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(line) => {
                let v: Value = serde_json::from_str(&line)
                    .map_err(|e| format!("{what}: not JSON on stdout ({e}): {line}"))?;
                if v["id"] == 2 {
                    tools = Some(
                        v["result"]["tools"]
                            .as_array()
                            .ok_or_else(|| format!("{what}: tools/list answered {v}"))?
                            .iter()
                            .filter_map(|t| t["name"].as_str().map(str::to_owned))
                            .collect::<Vec<_>>(),
                    );
                }
            }
            Err(_) => break,
        }
    }
    drop(stdin);
    let exit_deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(st) = child.try_wait().map_err(|e| e.to_string())? {
            break Some(st);
        }
        if Instant::now() >= exit_deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let stderr_text = err_reader.join().unwrap_or_default();
    let tools =
        tools.ok_or_else(|| format!("{what}: no tools/list answer; stderr: {stderr_text}"))?;
    match status {
        Some(st) if st.success() => Ok(tools),
        other => Err(format!(
            "{what}: after stdin closed: {other:?}; stderr: {stderr_text}"
        )),
    }
}

#[test]
fn client_config_snippets_start_working_servers() {
    let d = Daemon::start("");
    let etc = tempfile::tempdir().expect("tempdir");
    let config = etc.path().join("config.toml");
    std::fs::write(&config, default_config()).expect("config.toml");
    let text = read(Path::new("docs/clients.md"));
    let mut failures = Vec::new();
    let mut launched = 0;
    for block in fenced_blocks(&text).iter().filter(|b| b.lang == "json") {
        let v: Value = serde_json::from_str(&block.text())
            .unwrap_or_else(|e| panic!("docs/clients.md:{}: {e}", block.line));
        let Some(servers) = v["mcpServers"].as_object() else {
            continue;
        };
        for (name, entry) in servers {
            let what = format!("docs/clients.md:{} server {name:?}", block.line);
            if let Some(command) = entry["command"].as_str() {
                let bin = match command {
                    "/usr/bin/robota-mcpctl" => mcpctl_bin(),
                    "/usr/bin/robota-mcpd" => mcpd_bin(),
                    other => {
                        failures.push(format!("{what}: unexpected command {other}"));
                        continue;
                    }
                };
                let args: Vec<String> = entry["args"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|a| a.as_str())
                    .map(|a| match a {
                        "/run/robota-mcpd/control.sock" => d.socket_path().display().to_string(),
                        "/etc/robota-mcpd/config.toml" => config.display().to_string(),
                        other => other.to_owned(),
                    })
                    .collect();
                let mut cmd = Command::new(bin);
                cmd.args(&args)
                    .env_clear()
                    .env("PATH", std::env::var_os("PATH").unwrap_or_default())
                    // Where a client's environment finds the daemon by default.
                    .env("ROBOTA_MCPD_SOCKET", d.socket_path());
                match stdio_tools(cmd, &what) {
                    Ok(tools) if tools.iter().any(|t| t == "system.info") => launched += 1,
                    Ok(tools) => failures.push(format!("{what}: tools {tools:?}")),
                    Err(e) => failures.push(e),
                }
            } else if let Some(url) = entry["url"].as_str() {
                let ok = url == "http://127.0.0.1:8765/mcp"
                    || (url.starts_with("https://") && !url.contains("localhost"));
                if !ok {
                    failures.push(format!("{what}: url {url}"));
                }
                if let Some(auth) = entry["headers"]["Authorization"].as_str()
                    && !auth.starts_with("Bearer ")
                {
                    failures.push(format!("{what}: Authorization {auth:?}"));
                }
            } else {
                failures.push(format!("{what}: neither command nor url"));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    assert!(
        launched >= 3,
        "only {launched} stdio client entries launched"
    );
}

/// docs/fleet.svg is what Debian's graphviz makes of docs/fleet.dot: the picture is never
/// edited by hand, and a change of the source without the picture fails here.
#[test]
fn the_fleet_picture_is_made_from_its_source() {
    let has_dot = Command::new("sh")
        .args(["-c", "command -v dot"])
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !has_dot {
        // graphviz, from Debian's registry (tests/setup.sh debian).
        robota_e2e::setup::ensure("debian");
    }
    let root = repo_root();
    let mut dot = Command::new("dot");
    dot.arg("-Tsvg").arg(root.join("docs/fleet.dot"));
    let out = run_bounded(dot, COMMAND_LIMIT);
    out.expect_code(0, "dot -Tsvg docs/fleet.dot");
    let committed = read(Path::new("docs/fleet.svg"));
    assert!(
        out.stdout == committed,
        "docs/fleet.svg is not what `dot -Tsvg docs/fleet.dot -o docs/fleet.svg` makes: run it and commit both"
    );
}
