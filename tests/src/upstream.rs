//! Downstream MCP servers for the upstream tests: the official Python SDK's server
//! (`tests/fixtures/sdk_server.py` in a venv under `target/` holding a pinned `mcp`),
//! our rmcp server and the misbehaving double (`robota-e2e-upstream`), started over
//! stdio by the daemon or as Streamable HTTP servers by the test.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use crate::daemon::run_bounded;

/// The `mcp` release the tests pin (PyPI).
pub const MCP_VERSION: &str = "2.3.0";
/// Creating the venv and installing `mcp` into it, at most.
const VENV_LIMIT: Duration = Duration::from_secs(300);

/// The venv holding the Python SDK: `target/py-mcp`.
pub fn venv_dir() -> PathBuf {
    crate::bin_dir()
        .parent()
        .expect("target/<profile> has a parent")
        .join("py-mcp")
}

/// The venv's python, with `mcp` at [`MCP_VERSION`]: created on first use (bounded),
/// once per test binary. `.ci/run` creates it the same way before the tests; by hand:
/// `python3 -m venv target/py-mcp && target/py-mcp/bin/pip install mcp==2.3.0`.
pub fn sdk_python() -> PathBuf {
    static READY: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    READY
        .get_or_init(|| ensure_venv(&venv_dir()))
        .clone()
        .unwrap_or_else(|e| panic!("the Python MCP SDK is not available: {e}"))
}

fn sdk_installed(python: &Path) -> bool {
    let mut cmd = Command::new(python);
    cmd.args([
        "-c",
        "import importlib.metadata as m, mcp.server.mcpserver; print(m.version('mcp'))",
    ]);
    let out = run_bounded(cmd, Duration::from_secs(60));
    out.code() == Some(0) && out.stdout.trim() == MCP_VERSION
}

fn ensure_venv(dir: &Path) -> Result<PathBuf, String> {
    let python = dir.join("bin/python");
    if python.is_file() && sdk_installed(&python) {
        return Ok(python);
    }
    // Built beside the final place and renamed in, so a concurrent test binary never
    // sees half a venv.
    let temp = dir.with_extension(format!("tmp{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&temp);
    let started = Instant::now();
    let mut venv = Command::new("python3");
    venv.args(["-m", "venv"]).arg(&temp);
    let out = run_bounded(venv, VENV_LIMIT);
    if out.code() != Some(0) {
        return Err(format!("python3 -m venv failed: {}", out.stderr));
    }
    let mut pip = Command::new(temp.join("bin/pip"));
    pip.args([
        "install",
        "--quiet",
        "--disable-pip-version-check",
        &format!("mcp=={MCP_VERSION}"),
    ]);
    let out = run_bounded(pip, VENV_LIMIT.saturating_sub(started.elapsed()));
    if out.code() != Some(0) {
        return Err(format!(
            "pip install mcp=={MCP_VERSION} failed (needs PyPI): {}",
            out.stderr
        ));
    }
    let _ = std::fs::remove_dir_all(dir);
    if std::fs::rename(&temp, dir).is_err() && !dir.join("bin/python").is_file() {
        return Err(format!("cannot move the venv to {}", dir.display()));
    }
    let _ = std::fs::remove_dir_all(&temp);
    if !sdk_installed(&python) {
        return Err(format!(
            "{} does not import mcp {MCP_VERSION}",
            python.display()
        ));
    }
    Ok(python)
}

/// The Python SDK server script.
pub fn sdk_script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/sdk_server.py")
}

/// `command = [...]` for the Python SDK server over stdio, as TOML.
pub fn sdk_stdio_command() -> String {
    toml_array(&[
        sdk_python().display().to_string(),
        sdk_script().display().to_string(),
        "stdio".into(),
    ])
}

/// Our fixture binary (an rmcp server, the misbehaving double).
pub fn fixture_bin() -> PathBuf {
    crate::bin("robota-e2e-upstream")
}

/// `command = [...]` for the fixture binary with `args`, as TOML.
pub fn fixture_command(args: &[&str]) -> String {
    let mut argv = vec![fixture_bin().display().to_string()];
    argv.extend(args.iter().map(|a| (*a).to_owned()));
    toml_array(&argv)
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
