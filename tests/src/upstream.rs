//! Downstream MCP servers for the upstream tests: the official Python SDK's server
//! (`tests/fixtures/sdk_server.py` in a venv under `target/` holding a pinned `mcp`),
//! our rmcp server and the misbehaving double (`robota-e2e-upstream`), started over
//! stdio by the daemon or as Streamable HTTP servers by the test.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::Mutex;
use std::time::Duration;

/// The venv holding the Python SDK at the pinned release (`target/py-mcp`), made on first
/// use by `tests/setup.sh py`.
pub fn sdk_python() -> PathBuf {
    crate::setup::ensure("py");
    crate::setup::target_dir().join("py-mcp/bin/python")
}

/// The Python SDK server script.
pub fn sdk_script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/sdk_server.py")
}

/// `command = [...]` for the Python SDK server over stdio, as TOML (with the
/// [`read_paths`] it needs).
pub fn sdk_stdio_command() -> String {
    format!("{}\n{}", sdk_stdio_argv(), read_paths())
}

/// The Python SDK server's `command` array alone.
pub fn sdk_stdio_argv() -> String {
    toml_array(&[
        sdk_python().display().to_string(),
        sdk_script().display().to_string(),
        "stdio".into(),
    ])
}

/// `read_paths = [...]`: what a confined test upstream reads beyond the system's view —
/// the repository and the build directory (scripts, the fixture binary, the venv) and
/// the Python installation the venv links to, wherever the machine keeps it.
pub fn read_paths() -> String {
    read_paths_with(&[])
}

/// [`read_paths`] with `extra` paths too.
pub fn read_paths_with(extra: &[&Path]) -> String {
    let mut paths = vec![
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .parent()
            .expect("the repository")
            .to_owned(),
        crate::setup::target_dir(),
    ];
    if let Ok(python) = std::fs::canonicalize(sdk_python())
        && let Some(prefix) = python.parent().and_then(Path::parent)
    {
        paths.push(prefix.to_owned());
    }
    paths.extend(extra.iter().map(|p| p.to_path_buf()));
    let paths: Vec<String> = paths.iter().map(|p| p.display().to_string()).collect();
    format!("read_paths = {}", toml_array(&paths))
}

/// `node` and the entry script of an MCP server from npm (`server-filesystem`,
/// `server-everything`; pinned in `tests/npm-mcp`, installed on first use), and the
/// directory they live beneath (for `read_paths`).
pub fn npm_server(package: &str) -> (PathBuf, PathBuf, PathBuf) {
    crate::setup::ensure("npm");
    let modules = Path::new(env!("CARGO_MANIFEST_DIR")).join("npm-mcp/node_modules");
    let script = modules
        .join("@modelcontextprotocol")
        .join(package)
        .join("dist/index.js");
    assert!(script.is_file(), "{} is missing", script.display());
    let node = std::env::var_os("PATH")
        .into_iter()
        .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .map(|dir| dir.join("node"))
        .find(|p| p.is_file())
        .expect("node on PATH (tests/setup.sh debian installs it)");
    (node, script, modules)
}

/// Our fixture binary (an rmcp server, the misbehaving double).
pub fn fixture_bin() -> PathBuf {
    crate::bin("robota-e2e-upstream")
}

/// `command = [...]` for the fixture binary with `args`, as TOML (with the
/// [`read_paths`] it needs).
pub fn fixture_command(args: &[&str]) -> String {
    let mut argv = vec![fixture_bin().display().to_string()];
    argv.extend(args.iter().map(|a| (*a).to_owned()));
    format!("{}\n{}", toml_array(&argv), read_paths())
}

pub fn toml_array(items: &[String]) -> String {
    let quoted: Vec<String> = items
        .iter()
        .map(|s| serde_json::Value::String(s.clone()).to_string())
        .collect();
    format!("[{}]", quoted.join(", "))
}

/// A Streamable HTTP server the test started; killed (with its stdin closed) on drop.
pub struct HttpServer {
    child: Mutex<Child>,
    _stdin: ChildStdin,
    /// `127.0.0.1:<port>`, or the socket path.
    pub addr: String,
}

impl HttpServer {
    /// The Python SDK server (`http`).
    pub fn sdk() -> HttpServer {
        let mut cmd = Command::new(sdk_python());
        cmd.arg(sdk_script()).arg("http");
        Self::spawn(cmd)
    }

    /// The Python SDK server, appending what happened to its calls (a cancelled `count`)
    /// to `events`.
    pub fn sdk_with_events(events: &Path) -> HttpServer {
        let mut cmd = Command::new(sdk_python());
        cmd.arg(sdk_script())
            .arg("http")
            .env("SDK_FIXTURE_EVENTS", events);
        Self::spawn(cmd)
    }

    /// Our rmcp server (`rmcp-http`), on TCP or on `unix`.
    pub fn rmcp(unix: Option<&Path>) -> HttpServer {
        let mut cmd = Command::new(fixture_bin());
        cmd.arg("rmcp-http");
        if let Some(path) = unix {
            cmd.arg("--unix").arg(path);
        }
        Self::spawn(cmd)
    }

    /// Starts `cmd` and waits (bounded) for its `listening <addr>` line.
    pub fn spawn(mut cmd: Command) -> HttpServer {
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn an upstream HTTP server");
        let stdin = child.stdin.take().expect("stdin");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut lines = BufReader::new(stdout).lines();
            while let Some(Ok(line)) = lines.next() {
                if let Some(addr) = line.strip_prefix("listening ") {
                    let _ = tx.send(addr.to_owned());
                    break;
                }
            }
            // Keep draining so the server never blocks on a full pipe.
            for _ in lines {}
        });
        let addr = match rx.recv_timeout(Duration::from_secs(60)) {
            Ok(addr) => addr,
            Err(_) => {
                let _ = child.kill();
                let _ = child.wait();
                panic!("the upstream HTTP server did not say where it listens within 60 s");
            }
        };
        HttpServer {
            child: Mutex::new(child),
            _stdin: stdin,
            addr,
        }
    }

    pub fn pid(&self) -> i32 {
        self.child.lock().expect("child lock").id() as i32
    }

    /// `http://<addr>/mcp`.
    pub fn url(&self) -> String {
        format!("http://{}/mcp", self.addr)
    }
}

impl Drop for HttpServer {
    fn drop(&mut self) {
        let mut child = self.child.lock().unwrap_or_else(|e| e.into_inner());
        let _ = child.kill();
        let _ = child.wait();
    }
}
