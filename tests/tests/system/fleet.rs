//! The fleet (docs/fleet.md): three hosts, each a Debian 12 booted with systemd and the
//! `.deb` installed, behind one nginx gateway from Debian, one OpenID provider
//! (oidc-provider) issuing a token per host's route (RFC 8707), one Debian `prometheus`
//! evaluating the shipped alert rules, and one `systemd-journal-remote` collecting the
//! hosts' journals through `systemd-journal-upload`. The gateway's configuration, the
//! scrape targets and each host's configuration come from the package's generator,
//! `/usr/share/robota-mcpd/fleet/robota-mcpd-fleet`.
//!
//! The network is the test's own: an "ops" network namespace holding a bridge (the back
//! network: the hosts, and the gateway's, the provider's, Prometheus's and the collector's
//! address 10.77.0.1) and a link to an "agents" namespace (198.51.100.0/24: the agents,
//! and the gateway's public address 198.51.100.1). The ops namespace does not forward, so the
//! agents reach the daemons only through the gateway. Nothing listens on this machine's
//! own interfaces; every wait is bounded; every machine, process and namespace goes when
//! the test ends, passed or failed.

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use robota_e2e::daemon::{CtlOutput, run_bounded};
use robota_e2e::machine::{Machine, package};
use robota_e2e::oidc::{Client, Oidc, Options};
use robota_e2e::{assert_no_secrets, poll_until_blocking};
use serde_json::Value;

/// The hosts: name (its route, and its host name), back-network address.
const HOSTS: [(&str, &str); 3] = [
    ("mcp-a", "10.77.0.11"),
    ("mcp-b", "10.77.0.12"),
    ("mcp-c", "10.77.0.13"),
];
/// The ops namespace's address on the back network: the gateway as the daemons see it,
/// the provider, Prometheus and the journal collector.
const OPS: &str = "10.77.0.1";
/// The gateway's public address, the name agents use (`https://198.51.100.1/hosts/…`).
/// A public address (TEST-NET-2), as agents on the internet have: the audit's address
/// class tells them from the gateway (private), so it shows whose address the daemons saw.
const GATEWAY: &str = "198.51.100.1";
const AGENT: &str = "198.51.100.2";
const AGENT_CLIENT: Client = Client {
    id: "fleet-agent",
    secret: "fleet-agent-secret-31c7a9",
};
const GENERATOR: &str = "usr/share/robota-mcpd/fleet/robota-mcpd-fleet";
const BOUND: Duration = Duration::from_secs(60);

fn route(host: &str) -> String {
    format!("https://{GATEWAY}/hosts/{host}/mcp")
}

/// A network namespace of the test's own (`ip netns add`), deleted on drop.
struct Netns {
    name: String,
}

impl Netns {
    fn new(role: &str) -> Netns {
        let name = format!("robota-fleet-{}-{role}", std::process::id());
        sh_ok(&format!(
            "ip netns add {name} && ip -n {name} link set lo up"
        ));
        Netns { name }
    }

    fn path(&self) -> PathBuf {
        PathBuf::from(format!("/run/netns/{}", self.name))
    }

    /// `argv` in this namespace (this host's file system otherwise).
    fn command(&self, argv: &[&str]) -> Command {
        let mut cmd = Command::new("nsenter");
        cmd.arg(format!("--net={}", self.path().display()))
            .arg("--")
            .args(argv);
        cmd
    }

    /// `sh -c script` in this namespace, bounded.
    fn sh(&self, script: &str) -> CtlOutput {
        run_bounded(self.command(&["/bin/sh", "-c", script]), BOUND)
    }

    fn ok(&self, script: &str) -> String {
        let out = self.sh(script);
        out.expect_code(0, &format!("in {}: {script}", self.name));
        out.stdout
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .status();
    }
}

/// `sh -c script` on this host, bounded; panics unless it exits 0.
fn sh_ok(script: &str) -> String {
    let mut cmd = Command::new("/bin/sh");
    cmd.arg("-c").arg(script);
    let out = run_bounded(cmd, BOUND);
    out.expect_code(0, script);
    out.stdout
}

/// A server of the fleet run as a process group of its own (nginx's master and workers,
/// Prometheus, the collector): stopped with SIGTERM, then SIGKILL, on drop.
struct Server {
    name: &'static str,
    child: Option<Child>,
    log: PathBuf,
}

impl Server {
    fn spawn(name: &'static str, mut cmd: Command, dir: &Path) -> Server {
        let log = dir.join(format!("{name}.log"));
        let out = fs::File::create(&log).expect("log");
        let child = cmd
            .process_group(0)
            .stdin(Stdio::null())
            .stdout(out.try_clone().expect("log"))
            .stderr(out)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {name}: {e}"));
        Server {
            name,
            child: Some(child),
            log,
        }
    }

    fn log(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn stop(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        let group = Pid::from_raw(-(child.id() as i32));
        let _ = kill(group, Signal::SIGTERM);
        let gone = poll_until_blocking(Duration::from_secs(10), Duration::from_millis(50), || {
            matches!(child.try_wait(), Ok(Some(_)))
        });
        let _ = kill(group, Signal::SIGKILL);
        if !gone {
            let _ = child.kill();
        }
        let _ = child.wait();
    }

    fn assert_running(&mut self) {
        let child = self.child.as_mut().expect("started");
        assert!(
            matches!(child.try_wait(), Ok(None)),
            "{} exited:\n{}",
            self.name,
            self.log()
        );
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A booted host with the package, on the back network at `address`, named `name`.
fn host(name: &str, address: &str, ops: &Netns, deb: &Path) -> Machine {
    let m = Machine::boot();
    m.install(deb)
        .expect_code(0, "apt-get install ./robota-mcpd_….deb");
    // A veth pair: one end on the ops bridge, the other the machine's host0.
    let veth = format!("v{}", &name[name.len() - 1..]);
    ops.ok(&format!(
        "ip link add {veth} type veth peer name host0 netns {} && ip link set {veth} master br0 up",
        m.leader()
    ));
    m.ok(&format!(
        "ip addr add {address}/24 dev host0 && ip link set host0 up \
         && ip route add default via {OPS} && hostnamectl hostname {name}"
    ));
    m
}

/// The Prometheus HTTP API's answer to `path` (GET, `args` url-encoded).
fn prometheus(ops: &Netns, path: &str, args: &[&str]) -> Value {
    let mut script = format!("curl -s -G --max-time 10 http://{OPS}:9090{path}");
    for a in args {
        script.push_str(&format!(" --data-urlencode '{a}'"));
    }
    let out = ops.sh(&script);
    serde_json::from_str(&out.stdout).unwrap_or(Value::Null)
}

/// The value of a one-series instant query per `instance`.
fn by_instance(ops: &Netns, query: &str) -> BTreeMap<String, f64> {
    let v = prometheus(ops, "/api/v1/query", &[&format!("query={query}")]);
    v["data"]["result"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|r| {
            Some((
                r["metric"]["instance"].as_str()?.to_owned(),
                r["value"][1].as_str()?.parse().ok()?,
            ))
        })
        .collect()
}

/// An HTTP request from the agents' network: `curl` with a header file; the status code
/// (000 when no connection was made) and the response headers.
fn agent_curl(
    agents: &Netns,
    dir: &Path,
    url: &str,
    header_file: Option<&Path>,
) -> (String, String) {
    let auth = header_file
        .map(|f| format!("-H @{}", f.display()))
        .unwrap_or_default();
    let headers = dir.join("agent-response-headers");
    let out = agents.sh(&format!(
        "curl -s --max-time 10 --cacert {ca} -o /dev/null -D {h} -w '%{{http_code}}' {auth} \
         -H 'Content-Type: application/json' -H 'Accept: application/json, text/event-stream' \
         -H 'MCP-Protocol-Version: 2025-11-25' \
         -d '{{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"ping\"}}' {url}",
        ca = dir.join("ca.pem").display(),
        h = headers.display(),
    ));
    (
        out.stdout.trim().to_owned(),
        fs::read_to_string(&headers).unwrap_or_default(),
    )
}

/// A curl header file (mode 0600) carrying `token`: tokens never go on a command line.
fn header_file(dir: &Path, name: &str, token: &str) -> PathBuf {
    let path = dir.join(name);
    fs::write(&path, format!("Authorization: Bearer {token}\n")).expect("header file");
    fs::set_permissions(&path, fs::Permissions::from_mode(0o600)).expect("mode");
    path
}

/// The agent (`tests/fixtures/fleet_agent.py`, the official Python SDK) in the agents'
/// network: a token per host from the provider, then `system.info` on each through the
/// gateway. Its answer per host, and the tokens it got.
fn agent(
    agents: &Netns,
    dir: &Path,
    issuer: &str,
    hosts: &[&str],
) -> (BTreeMap<String, Value>, BTreeMap<String, String>) {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/fleet_agent.py");
    let tokens = dir.join("agent-tokens.json");
    let _ = fs::remove_file(&tokens);
    let mut cmd = agents.command(&[robota_e2e::upstream::sdk_python().to_str().expect("path")]);
    cmd.arg(script).arg(format!("{issuer}/token"));
    for h in hosts {
        cmd.arg(format!("{h}={}", route(h)));
    }
    cmd.env("FLEET_CLIENT_FILE", dir.join("agent-client"))
        .env("FLEET_CA", dir.join("ca.pem"))
        .env("FLEET_TOKENS_OUT", &tokens);
    let out = run_bounded(cmd, Duration::from_secs(120));
    out.expect_code(0, "fleet_agent.py");
    let answers = out
        .stdout
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter_map(|v| Some((v["host"].as_str()?.to_owned(), v)))
        .collect();
    let tokens = fs::read(&tokens)
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or_default();
    (answers, tokens)
}

fn assert_system_info(answers: &BTreeMap<String, Value>, host: &str, when: &str) {
    let answer = &answers[host];
    assert_eq!(
        answer["result"]["isError"], false,
        "{when}: system.info on {host} through the gateway: {answer}"
    );
    let info = &answer["result"]["structuredContent"];
    assert_eq!(
        info["hostname"], host,
        "{when}: the gateway's route for {host} reached another host: {info}"
    );
}

fn by_name<'a>(machines: &'a [Machine], name: &str) -> &'a Machine {
    &machines[HOSTS.iter().position(|(h, _)| *h == name).expect("host")]
}

/// The collector's records (JSON) matching `matches` (`FIELD=VALUE` each).
fn collected(dir: &Path, matches: &[&str]) -> Vec<Value> {
    let mut cmd = Command::new("journalctl");
    cmd.arg("--no-pager")
        .arg("-o")
        .arg("json")
        .arg("-D")
        .arg(dir.join("collector"))
        .args(matches);
    run_bounded(cmd, BOUND)
        .stdout
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

#[test]
fn a_fleet_of_three_behind_one_gateway_one_provider_one_prometheus_one_journal() {
    let started = Instant::now();
    let deb = package();
    let dir = tempfile::Builder::new()
        .prefix("robota-fleet-")
        .tempdir()
        .expect("tempdir");
    let dir = dir.path();
    // What the package ships, as the gateway and the monitoring host get it.
    let unpacked = dir.join("package");
    sh_ok(&format!(
        "dpkg-deb -x {} {}",
        deb.display(),
        unpacked.display()
    ));
    let generator = unpacked.join(GENERATOR);
    assert!(generator.is_file(), "the package ships no {GENERATOR}");
    let hosts_file = dir.join("fleet-hosts");
    let host_list: String = HOSTS
        .iter()
        .map(|(name, address)| format!("{name} {address}\n"))
        .collect();
    fs::write(&hosts_file, format!("# name  address\n{host_list}")).expect("host list");

    // The networks.
    let ops = Netns::new("ops");
    let agents = Netns::new("agents");
    ops.ok(&format!(
        "sysctl -q -w net.ipv4.ip_forward=0 \
         && ip link add br0 type bridge && ip addr add {OPS}/24 dev br0 && ip link set br0 up \
         && ip link add edge0 type veth peer name agent0 netns {agents} \
         && ip addr add {GATEWAY}/24 dev edge0 && ip link set edge0 up",
        agents = agents.name
    ));
    agents.ok(&format!(
        "ip addr add {AGENT}/24 dev agent0 && ip link set agent0 up \
         && ip route add default via {GATEWAY}"
    ));

    // The provider: one audience per host's route.
    let mut oidc = Oidc::start_with(Options {
        ttl_secs: 600,
        listen: OPS.to_owned(),
        resources: HOSTS.iter().map(|(h, _)| route(h)).collect(),
        jwt_clients: vec![AGENT_CLIENT],
        netns: Some(ops.path()),
    });
    let issuer = oidc.issuer().to_owned();
    let ca = oidc.ca();
    fs::write(dir.join("ca.pem"), ca.pem()).expect("ca");
    let client_file = dir.join("agent-client");
    fs::write(
        &client_file,
        format!("{}:{}\n", AGENT_CLIENT.id, AGENT_CLIENT.secret),
    )
    .expect("client file");
    fs::set_permissions(&client_file, fs::Permissions::from_mode(0o600)).expect("mode");

    // The hosts, booted and installed side by side.
    let booted = Instant::now();
    let machines: Vec<Machine> = std::thread::scope(|s| {
        let handles: Vec<_> = HOSTS
            .iter()
            .map(|(name, address)| {
                let (ops, deb) = (&ops, &deb);
                s.spawn(move || host(name, address, ops, deb))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a host did not come up"))
            .collect()
    });
    let boot_time = booted.elapsed();
    let by_name = |name: &str| by_name(&machines, name);

    // Each host's configuration from the shipped generator, run on the host.
    let ca_pem = ca.pem();
    for (m, (name, _)) in machines.iter().zip(HOSTS) {
        m.write("/etc/robota-mcpd/fleet-hosts", host_list.as_bytes(), 0o644);
        m.write("/etc/robota-mcpd/fleet-ca.pem", ca_pem.as_bytes(), 0o644);
        m.ok(&format!(
            "set -e; /{GENERATOR} host --hosts /etc/robota-mcpd/fleet-hosts --gateway {GATEWAY} \
               --name {name} --proxy {OPS} --issuer {issuer} > /root/config.toml
             cat >> /root/config.toml <<'EOF'
ca_file = \"/etc/robota-mcpd/fleet-ca.pem\"
scopes = [\"mcp\"]
allowed_clients = [\"{client}\"]
EOF
             robota-mcpd check-config --config /root/config.toml
             install -m 0644 /root/config.toml /etc/robota-mcpd/config.toml
             systemctl restart robota-mcpd",
            client = AGENT_CLIENT.id
        ));
        // The journal goes to the collector (TLS, the collector's certificate checked).
        let (cert, key) = ca.leaf(&[name]);
        m.write("/etc/robota-fleet/ca.pem", ca_pem.as_bytes(), 0o644);
        m.write("/etc/robota-fleet/upload.pem", cert.as_bytes(), 0o644);
        m.write("/etc/robota-fleet/upload.key", key.as_bytes(), 0o600);
        m.write(
            "/etc/systemd/journal-upload.conf.d/fleet.conf",
            format!(
                "[Upload]\nURL=https://{OPS}:19532\n\
                 ServerKeyFile=/run/credentials/systemd-journal-upload.service/upload.key\n\
                 ServerCertificateFile=/etc/robota-fleet/upload.pem\n\
                 TrustedCertificateFile=/etc/robota-fleet/ca.pem\n"
            )
            .as_bytes(),
            0o644,
        );
        m.write(
            "/etc/systemd/system/systemd-journal-upload.service.d/fleet.conf",
            b"[Service]\nLoadCredential=upload.key:/etc/robota-fleet/upload.key\n",
            0o644,
        );
    }

    // The collector, on the back network.
    let (cert, key) = ca.leaf(&[OPS]);
    fs::write(dir.join("collector.pem"), cert).expect("cert");
    fs::write(dir.join("collector.key"), key).expect("key");
    fs::create_dir(dir.join("collector")).expect("mkdir");
    let mut collector = Server::spawn(
        "journal-remote",
        {
            let mut c = ops.command(&["/lib/systemd/systemd-journal-remote"]);
            c.arg(format!("--listen-https={OPS}:19532"))
                .arg(format!("--key={}", dir.join("collector.key").display()))
                .arg(format!("--cert={}", dir.join("collector.pem").display()))
                .arg(format!("--output={}/", dir.join("collector").display()))
                .arg("--split-mode=host");
            c
        },
        dir,
    );
    for m in &machines {
        m.ok("systemctl daemon-reload && systemctl enable --now systemd-journal-upload");
    }

    // The gateway, from the shipped generator.
    let (cert, key) = ca.leaf(&[GATEWAY]);
    fs::write(dir.join("gateway.pem"), cert).expect("cert");
    fs::write(dir.join("gateway.key"), key).expect("key");
    fs::create_dir(dir.join("nginx-tmp")).expect("mkdir");
    sh_ok(&format!(
        "{gen} nginx --hosts {hosts} --gateway {GATEWAY} --listen {GATEWAY}:443 \
           --cert {d}/gateway.pem --key {d}/gateway.key --output {d}/robota-mcpd-fleet.conf",
        gen = generator.display(),
        hosts = hosts_file.display(),
        d = dir.display()
    ));
    fs::write(
        dir.join("nginx.conf"),
        format!(
            "worker_processes 1;\npid {d}/nginx.pid;\nerror_log {d}/nginx-error.log;\n\
             events {{ worker_connections 1024; }}\n\
             http {{\n    access_log {d}/nginx-access.log;\n    client_body_temp_path {d}/nginx-tmp;\n    \
             proxy_temp_path {d}/nginx-tmp;\n    include {d}/robota-mcpd-fleet.conf;\n}}\n",
            d = dir.display()
        ),
    )
    .expect("nginx.conf");
    // The seed's edge, in the generated file: only the routes, no buffering either way,
    // timeouts longer than a turn (behaviour is checked below: routes, 404, TLS only).
    let generated = fs::read_to_string(dir.join("robota-mcpd-fleet.conf")).expect("generated");
    for directive in [
        "proxy_buffering off;",
        "proxy_request_buffering off;",
        "proxy_cache off;",
        "proxy_read_timeout 15m;",
        "proxy_send_timeout 15m;",
        "proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;",
        "proxy_http_version 1.1;",
    ] {
        assert!(
            generated.contains(directive),
            "the generated gateway lacks `{directive}`:\n{generated}"
        );
    }
    assert_eq!(
        generated.matches("location ").count(),
        2 * HOSTS.len() + 1,
        "the generated gateway exposes more than each host's route and metadata:\n{generated}"
    );
    let nginx_command = || {
        let mut c = ops.command(&["nginx", "-e"]);
        c.arg(dir.join("nginx-error.log"))
            .arg("-c")
            .arg(dir.join("nginx.conf"))
            .args(["-g", "daemon off;"]);
        c
    };
    {
        let mut test = nginx_command();
        test.arg("-t");
        run_bounded(test, BOUND).expect_code(0, "nginx -t of the generated configuration");
    }
    let mut gateway = Server::spawn("nginx", nginx_command(), dir);

    // Prometheus, scraping the hosts' metrics listeners on the back network, with the
    // package's alert rules and the generator's targets.
    sh_ok(&format!(
        "{gen} targets --hosts {hosts} > {d}/robota-mcpd-targets.yml",
        gen = generator.display(),
        hosts = hosts_file.display(),
        d = dir.display()
    ));
    let rules = unpacked.join("usr/share/doc/robota-mcpd/docs/prometheus/alerts.yml");
    // Every alert names its host in its summary — all but the one about the job having no
    // target at all, where there is no host to name.
    let rules_text = fs::read_to_string(&rules).expect("the package's alert rules");
    for rule in rules_text.split("- alert: ").skip(1) {
        let name = rule.lines().next().unwrap_or_default().trim();
        let summary = rule
            .lines()
            .find(|l| l.trim_start().starts_with("summary:"))
            .unwrap_or_default();
        assert!(
            name == "RobotaMcpdTargetMissing" || summary.contains("{{ $labels.instance }}"),
            "alert {name} does not name its host: {summary}"
        );
    }
    fs::write(
        dir.join("prometheus.yml"),
        format!(
            "global:\n  scrape_interval: 2s\n  evaluation_interval: 2s\n\
             rule_files:\n  - {rules}\n\
             scrape_configs:\n  - job_name: robota-mcpd\n    file_sd_configs:\n      - files: [\"{d}/robota-mcpd-targets.yml\"]\n",
            rules = rules.display(),
            d = dir.display()
        ),
    )
    .expect("prometheus.yml");
    sh_ok(&format!(
        "promtool check config {}/prometheus.yml",
        dir.display()
    ));
    let mut prom = Server::spawn(
        "prometheus",
        {
            let mut c = ops.command(&["prometheus"]);
            c.arg(format!("--config.file={}/prometheus.yml", dir.display()))
                .arg(format!("--storage.tsdb.path={}/tsdb", dir.display()))
                .arg(format!("--web.listen-address={OPS}:9090"));
            c
        },
        dir,
    );
    let ready = started.elapsed();

    // 1. The agent, with a token per host, calls system.info on each through the gateway.
    let names: Vec<&str> = HOSTS.iter().map(|(h, _)| *h).collect();
    let (answers, tokens) = agent(&agents, dir, &issuer, &names);
    for h in &names {
        assert_system_info(&answers, h, "the whole fleet up");
    }
    assert_eq!(tokens.len(), 3, "a token per host");
    let mut secrets: Vec<String> = tokens.values().cloned().collect();
    secrets.push(AGENT_CLIENT.secret.to_owned());

    // 2. The daemons' listeners are reachable from the gateway's network only.
    for (name, address) in HOSTS {
        let direct = agents.sh(&format!(
            "curl -s --max-time 3 -o /dev/null http://{address}:8443/hosts/{name}/mcp; echo $?; \
             curl -s --max-time 3 -o /dev/null http://{address}:9464/metrics; echo $?"
        ));
        assert!(
            direct.stdout.lines().all(|code| code != "0"),
            "an agent reached {name}'s listeners without the gateway: {direct:?}"
        );
        ops.ok(&format!(
            "curl -sf --max-time 5 -o /dev/null http://{address}:9464/metrics"
        ));
    }
    // Only the routes: anything else at the gateway is 404, and TLS only there.
    let (code, _) = agent_curl(&agents, dir, &format!("https://{GATEWAY}/mcp"), None);
    assert_eq!(code, "404", "the gateway exposes more than the routes");
    let (code, _) = agent_curl(
        &agents,
        dir,
        &format!("http://{GATEWAY}/hosts/mcp-a/mcp"),
        None,
    );
    assert_eq!(code, "000", "the gateway answers plain HTTP");
    let (code, headers) = agent_curl(&agents, dir, &route("mcp-a"), None);
    assert_eq!(code, "401", "no token at mcp-a: {headers}");
    assert!(
        headers.contains(&format!(
            "resource_metadata=\"https://{GATEWAY}/.well-known/oauth-protected-resource/hosts/mcp-a/mcp\""
        )),
        "the challenge names the host's metadata on the gateway: {headers}"
    );
    let metadata = agents.ok(&format!(
        "curl -sf --max-time 10 --cacert {}/ca.pem https://{GATEWAY}/.well-known/oauth-protected-resource/hosts/mcp-b/mcp",
        dir.display()
    ));
    let metadata: Value = serde_json::from_str(&metadata).expect("metadata JSON");
    assert_eq!(metadata["resource"], route("mcp-b"), "{metadata}");
    assert_eq!(metadata["authorization_servers"][0], issuer, "{metadata}");

    // 3. A token for mcp-a is refused by mcp-b and mcp-c: 401, audited there, not on mcp-a.
    let token_a = header_file(dir, "token-a.header", &tokens["mcp-a"]);
    for other in ["mcp-b", "mcp-c"] {
        let (code, headers) = agent_curl(&agents, dir, &route(other), Some(token_a.as_path()));
        assert_eq!(code, "401", "mcp-a's token at {other}: {headers}");
        assert!(
            headers.contains("error=\"invalid_token\""),
            "{other}'s challenge: {headers}"
        );
    }
    // An agent that writes its own X-Forwarded-For does not choose its address: the
    // gateway appends the real one, and the daemon believes only the hop it appended.
    let spoofed = dir.join("token-a-spoofed.header");
    fs::write(
        &spoofed,
        format!(
            "{}X-Forwarded-For: 10.9.9.9\n",
            fs::read_to_string(&token_a).expect("header file")
        ),
    )
    .expect("header file");
    fs::set_permissions(&spoofed, fs::Permissions::from_mode(0o600)).expect("mode");
    let (code, _) = agent_curl(&agents, dir, &route("mcp-c"), Some(spoofed.as_path()));
    assert_eq!(
        code, "401",
        "mcp-a's token at mcp-c, with a forged X-Forwarded-For"
    );
    let (code, _) = agent_curl(&agents, dir, &route("mcp-a"), Some(token_a.as_path()));
    assert_eq!(code, "200", "mcp-a's token at mcp-a");
    for (name, _) in HOSTS {
        let audit = by_name(name).ok("robota-mcpctl audit --reason wrong-audience --json");
        let records: Vec<Value> = audit
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect();
        if name == "mcp-a" {
            assert!(records.is_empty(), "mcp-a refused its own token: {audit}");
        } else {
            // The agent's public address, from the gateway's X-Forwarded-For (never the
            // gateway's private one, nor the private one the agent forged).
            let want = if name == "mcp-c" { 2 } else { 1 };
            assert!(
                records.len() == want
                    && records.iter().all(|r| r["carrier"] == "remote"
                        && r["reason"] == "wrong-audience"
                        && r["address_class"] == "public"),
                "{name}'s wrong-audience records, {want} from the agent's public address: {audit}"
            );
        }
    }

    // 4. The collector has mcp-c's refusal, found by its reason and host.
    let mut found = Vec::new();
    let arrived = poll_until_blocking(BOUND, Duration::from_millis(500), || {
        found = collected(dir, &["_HOSTNAME=mcp-c", "F_REASON=wrong-audience"]);
        !found.is_empty()
    });
    assert!(
        arrived,
        "the collector has no refusal of mcp-c; collector log:\n{}\nmcp-c's uploader:\n{}",
        collector.log(),
        by_name("mcp-c")
            .sh("journalctl -u systemd-journal-upload --no-pager -n 20")
            .stdout
    );
    let record = &found[0];
    assert_eq!(record["SYSLOG_IDENTIFIER"], "robota-mcpd", "{record}");
    assert_eq!(record["F_CARRIER"], "remote", "{record}");
    assert!(
        collected(dir, &["_HOSTNAME=mcp-a", "F_REASON=wrong-audience"]).is_empty(),
        "a refusal of mcp-a's that mcp-a never made"
    );

    // 5. Prometheus: every host up, the rules loaded; a flood of mcp-a's token at mcp-b
    // makes the refusal alert of mcp-b, and of no other host.
    let mut up = BTreeMap::new();
    let all_up = poll_until_blocking(BOUND, Duration::from_millis(500), || {
        up = by_instance(&ops, "up{job=\"robota-mcpd\"}");
        up.len() == 3 && up.values().all(|v| *v == 1.0)
    });
    assert!(
        all_up,
        "not every host is up in Prometheus: {up:?}\n{}",
        prom.log()
    );
    let flood = dir.join("flood.sh");
    fs::write(
        &flood,
        format!(
            "for i in $(seq 40); do curl -s --max-time 5 --cacert {d}/ca.pem -o /dev/null -H @{h} \
             -H 'Content-Type: application/json' -H 'Accept: application/json, text/event-stream' \
             -d '{{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"ping\"}}' {url}; done",
            d = dir.display(),
            h = token_a.display(),
            url = route("mcp-b")
        ),
    )
    .expect("flood script");
    agents.ok(&format!("sh {}", flood.display()));
    let mut alerts = Value::Null;
    let spike = |alerts: &Value, instance: &str| {
        alerts["data"]["alerts"].as_array().is_some_and(|list| {
            list.iter().any(|a| {
                a["labels"]["alertname"] == "RobotaMcpdRefusalSpike"
                    && a["labels"]["instance"] == instance
                    && a["labels"]["reason"] == "wrong-audience"
                    && a["labels"]["carrier"] == "remote"
            })
        })
    };
    let raised = poll_until_blocking(Duration::from_secs(90), Duration::from_millis(500), || {
        alerts = prometheus(&ops, "/api/v1/alerts", &[]);
        spike(&alerts, "mcp-b")
            && alerts["data"]["alerts"].as_array().is_some_and(|list| {
                list.iter().any(|a| {
                    a["labels"]["alertname"] == "RobotaMcpdThrottling"
                        && a["labels"]["instance"] == "mcp-b"
                        && a["state"] == "firing"
                })
            })
    });
    assert!(
        raised,
        "RobotaMcpdRefusalSpike and RobotaMcpdThrottling never came for mcp-b: {alerts}"
    );
    let list = alerts["data"]["alerts"].as_array().expect("alerts");
    for a in list {
        let instance = a["labels"]["instance"].as_str().unwrap_or_default();
        assert_eq!(
            instance, "mcp-b",
            "an alert of a host nobody flooded (or of no host): {a}"
        );
        let summary = a["annotations"]["summary"].as_str().unwrap_or_default();
        assert!(
            summary.contains("mcp-b"),
            "the alert's text does not name its host: {a}"
        );
    }
    // The throttle saw it too: past 20 failures the agent's address is answered 429.
    let throttled = by_instance(
        &ops,
        "sum by (instance) (robota_mcpd_throttled_total{carrier=\"remote\"})",
    );
    assert!(
        throttled.get("mcp-b").is_some_and(|v| *v > 0.0)
            && throttled.get("mcp-a") == Some(&0.0)
            && throttled.get("mcp-c") == Some(&0.0),
        "throttling by host: {throttled:?}"
    );

    // 6. The measurements docs/fleet.md reports.
    let window = started.elapsed();
    let open_to_hosts = ops.ok("ss -Htn state established '( dport = :8443 )' | wc -l");
    let accepted = by_instance(
        &ops,
        "sum by (instance) (robota_mcpd_connections_total{listener=\"remote\", outcome=\"accepted\"})",
    );
    let admitted = by_instance(
        &ops,
        "sum by (instance) (robota_mcpd_admitted_requests_total{carrier=\"remote\"})",
    );
    let proxied = fs::read_to_string(dir.join("nginx-access.log"))
        .unwrap_or_default()
        .lines()
        .count();
    let samples = by_instance(&ops, "scrape_samples_scraped{job=\"robota-mcpd\"}");
    let scrape_seconds = by_instance(&ops, "scrape_duration_seconds{job=\"robota-mcpd\"}");
    let exposition_bytes = ops.ok(&format!(
        "curl -s --max-time 5 http://{}:9464/metrics | wc -c",
        HOSTS[1].1
    ));
    let export_bytes = |matches: &[&str]| -> usize {
        let mut cmd = Command::new("journalctl");
        cmd.args(["--no-pager", "-o", "export", "-D"])
            .arg(dir.join("collector"))
            .args(matches);
        run_bounded(cmd, BOUND).stdout.len()
    };
    for (h, _) in HOSTS {
        let host = format!("_HOSTNAME={h}");
        let unit = "_SYSTEMD_UNIT=robota-mcpd.service";
        eprintln!(
            "fleet measurement {h}: journal entries {} ({} bytes exported), of robota-mcpd {} ({} bytes), \
             audit records {}; remote connections accepted {:?}, requests admitted {:?}",
            collected(dir, &[&host]).len(),
            export_bytes(&[&host]),
            collected(dir, &[&host, unit]).len(),
            export_bytes(&[&host, unit]),
            collected(
                dir,
                &[&host, "SYSLOG_IDENTIFIER=robota-mcpd", "F_CARRIER=remote"]
            )
            .len(),
            accepted.get(h),
            admitted.get(h),
        );
    }
    eprintln!(
        "fleet measurements: hosts booted and installed in {boot_time:?}, fleet ready after {ready:?}, \
         measured after {window:?}; gateway→host connections open now: {}; requests through the gateway: \
         {proxied}; samples per scrape: {samples:?}; scrape seconds: {scrape_seconds:?}; exposition \
         bytes (mcp-b): {}; collector directory bytes: {}",
        open_to_hosts.trim(),
        exposition_bytes.trim(),
        sh_ok(&format!("du -sb {}/collector | cut -f1", dir.display())).trim(),
    );

    // 7. Failure: the gateway down. Agents reach no host; Prometheus and the collector,
    // which do not go through it, still see every host and get every journal.
    gateway.stop();
    let (code, _) = agent_curl(&agents, dir, &route("mcp-a"), Some(token_a.as_path()));
    assert_eq!(code, "000", "a host answered with the gateway down");
    let up_now = by_instance(&ops, "up{job=\"robota-mcpd\"}");
    assert!(
        poll_until_blocking(Duration::from_secs(10), Duration::from_millis(500), || {
            by_instance(&ops, "up{job=\"robota-mcpd\"}")
                .values()
                .all(|v| *v == 1.0)
        }),
        "hosts looked down to Prometheus with the gateway down: {up_now:?}"
    );
    by_name("mcp-a").ok("logger -t fleet-test 'written while the gateway is down'");
    let heard = poll_until_blocking(BOUND, Duration::from_millis(500), || {
        !collected(dir, &["_HOSTNAME=mcp-a", "SYSLOG_IDENTIFIER=fleet-test"]).is_empty()
    });
    assert!(heard, "the journal stopped flowing with the gateway down");
    gateway = Server::spawn("nginx", nginx_command(), dir);
    let back = poll_until_blocking(Duration::from_secs(20), Duration::from_millis(200), || {
        agent_curl(&agents, dir, &route("mcp-a"), Some(token_a.as_path())).0 == "200"
    });
    assert!(
        back,
        "the gateway came back but mcp-a is not reached:\n{}",
        gateway.log()
    );

    // 8. Failure: one host down. Its route answers 502; the others serve; Prometheus sees
    // exactly that host down; its journal says it stopped.
    let b = by_name("mcp-b");
    b.ok("systemctl stop robota-mcpd");
    let (code, _) = agent_curl(&agents, dir, &route("mcp-b"), Some(token_a.as_path()));
    assert_eq!(code, "502", "mcp-b's route with mcp-b's daemon stopped");
    let (answers, more) = agent(&agents, dir, &issuer, &["mcp-a", "mcp-c"]);
    secrets.extend(more.into_values());
    assert_system_info(&answers, "mcp-a", "mcp-b down");
    assert_system_info(&answers, "mcp-c", "mcp-b down");
    let mut up = BTreeMap::new();
    let seen_down =
        poll_until_blocking(Duration::from_secs(30), Duration::from_millis(500), || {
            up = by_instance(&ops, "up{job=\"robota-mcpd\"}");
            up.get("mcp-b") == Some(&0.0)
                && up.get("mcp-a") == Some(&1.0)
                && up.get("mcp-c") == Some(&1.0)
        });
    assert!(seen_down, "Prometheus's view with mcp-b down: {up:?}");
    let mut alerts = Value::Null;
    let down_alert =
        poll_until_blocking(Duration::from_secs(30), Duration::from_millis(500), || {
            alerts = prometheus(&ops, "/api/v1/alerts", &[]);
            alerts["data"]["alerts"].as_array().is_some_and(|list| {
                list.iter().any(|a| {
                    a["labels"]["alertname"] == "RobotaMcpdDown"
                        && a["labels"]["instance"] == "mcp-b"
                })
            })
        });
    assert!(down_alert, "no RobotaMcpdDown for mcp-b: {alerts}");
    assert!(
        alerts["data"]["alerts"].as_array().is_some_and(|list| {
            list.iter().all(|a| {
                a["labels"]["alertname"] != "RobotaMcpdDown" || a["labels"]["instance"] == "mcp-b"
            })
        }),
        "RobotaMcpdDown for a host that is up: {alerts}"
    );
    let stopped = poll_until_blocking(BOUND, Duration::from_millis(500), || {
        collected(dir, &["_HOSTNAME=mcp-b", "_SYSTEMD_UNIT=init.scope"])
            .iter()
            .any(|r| {
                r["MESSAGE"]
                    .as_str()
                    .is_some_and(|m| m.contains("Stopped robota-mcpd.service"))
            })
    });
    assert!(
        stopped,
        "the collector never heard that mcp-b's daemon stopped"
    );
    b.ok("systemctl start robota-mcpd");
    let (answers, more) = agent(&agents, dir, &issuer, &["mcp-b"]);
    secrets.extend(more.into_values());
    assert_system_info(&answers, "mcp-b", "mcp-b started again");

    // 9. Failure: the provider down. No new token; the tokens agents hold still work on
    // every host (each holds the key set); a key refresh fails and says why.
    oidc.stop();
    let (answers, _) = agent(&agents, dir, &issuer, &["mcp-c"]);
    assert!(
        answers
            .get("mcp-c")
            .is_none_or(|a| a.get("result").is_none()),
        "a call with the provider down got a new token: {answers:?}"
    );
    let (code, _) = agent_curl(&agents, dir, &route("mcp-a"), Some(token_a.as_path()));
    assert_eq!(code, "200", "a held token with the provider down");
    let refresh = by_name("mcp-a").sh("robota-mcpctl keys refresh");
    assert_eq!(
        refresh.code(),
        Some(1),
        "keys refresh with the provider down: {refresh:?}"
    );
    assert!(
        !refresh.stderr.trim().is_empty(),
        "keys refresh fails without saying why: {refresh:?}"
    );
    eprintln!(
        "keys refresh with the provider down: {}",
        refresh.stderr.trim()
    );
    let mut alerts = Value::Null;
    let fetch_alert =
        poll_until_blocking(Duration::from_secs(30), Duration::from_millis(500), || {
            alerts = prometheus(&ops, "/api/v1/alerts", &[]);
            alerts["data"]["alerts"].as_array().is_some_and(|list| {
                list.iter().any(|a| {
                    a["labels"]["alertname"] == "RobotaMcpdJwksFetchErrors"
                        && a["labels"]["instance"] == "mcp-a"
                })
            })
        });
    assert!(
        fetch_alert,
        "no RobotaMcpdJwksFetchErrors for mcp-a: {alerts}"
    );
    // A daemon restarted while the provider is down starts on the key set it cached.
    let c = by_name("mcp-c");
    c.ok("systemctl restart robota-mcpd");
    let token_c = header_file(dir, "token-c.header", &tokens["mcp-c"]);
    let (code, _) = agent_curl(&agents, dir, &route("mcp-c"), Some(token_c.as_path()));
    assert_eq!(
        code, "200",
        "mcp-c restarted with the provider down, its held token"
    );
    oidc.start_again();
    let (answers, new_tokens) = agent(&agents, dir, &issuer, &names);
    for h in &names {
        assert_system_info(&answers, h, "the provider back");
    }
    secrets.extend(new_tokens.into_values());

    // No secret went anywhere: the collector's journal (every field), each host's
    // journal and audit file, the gateway's and Prometheus's logs.
    let mut export = Command::new("journalctl");
    export
        .args(["--no-pager", "-o", "export", "-D"])
        .arg(dir.join("collector"));
    let everything = run_bounded(export, BOUND).stdout;
    assert!(everything.len() > 1000, "the collector's journal is empty");
    assert_no_secrets(&secrets, &everything, "the collector's journal");
    for (m, (name, _)) in machines.iter().zip(HOSTS) {
        assert_no_secrets(
            &secrets,
            &m.ok("journalctl --no-pager -o export"),
            &format!("{name}'s journal"),
        );
        assert_no_secrets(
            &secrets,
            &m.ok("cat /var/lib/robota-mcpd/audit.jsonl"),
            &format!("{name}'s audit file"),
        );
    }
    for server in [&gateway, &prom, &collector] {
        assert_no_secrets(&secrets, &server.log(), server.name);
    }
    for log in ["nginx-access.log", "nginx-error.log"] {
        let text = fs::read_to_string(dir.join(log)).unwrap_or_default();
        assert_no_secrets(&secrets, &text, log);
    }
    gateway.assert_running();
    prom.assert_running();
    collector.assert_running();
    eprintln!("the fleet test took {:?}", started.elapsed());
}
