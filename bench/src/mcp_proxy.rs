//! mcp-proxy 0.6.0 (crates.io, `cargo install`), another MCP proxy in Rust (axum and
//! tower-mcp), in front of the same downstream server as robota-mcpd's HTTP backend: one
//! `[[backends]]` entry with `transport = "http"`, everything else at its defaults (no
//! auth, cache, rate limit or other middleware; the log level its documented default,
//! `info`, set explicitly: see [`config_text`]). It serves MCP at `POST /` and keeps one
//! session per client, so its cells open a session per client ([`Template::with_sessions`]).
//!
//! The binary is `$ROBOTA_BENCH_MCP_PROXY` if set, else `target/bench-tools/bin/mcp-proxy`,
//! installed there from crates.io (`cargo install --locked`, mcp-proxy's own lock file)
//! when it is missing. It runs in a cgroup of its own, as every server here does, bound to
//! 127.0.0.1 on a port that was free a moment before, and is killed (with its cgroup) on
//! drop.
//!
//! [`Template::with_sessions`]: crate::load::Template::with_sessions

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use robota_e2e::cgroup::{Cgroup, Hierarchies};
use tempfile::TempDir;

/// The version measured.
pub const VERSION: &str = "0.6.0";
/// The crate and its binary.
const NAME: &str = "mcp-proxy";
/// The environment variable naming a binary to use instead.
pub const BINARY_ENV: &str = "ROBOTA_BENCH_MCP_PROXY";
/// The MCP endpoint of a standalone mcp-proxy.
pub const PATH: &str = "/";
/// The namespace of the one backend: its tools are `rh/<name>` (mcp-proxy's default
/// separator), as robota-mcpd's HTTP backend's are `rh.<name>`.
pub const BACKEND: &str = "rh";

/// Longest the proxy may take to answer after it was started (it connects to its backend
/// and lists its tools before it binds).
const START_TIMEOUT: Duration = Duration::from_secs(30);

/// Where the binary came from, for the report.
#[derive(Debug, Clone)]
pub struct Binary {
    pub path: PathBuf,
    pub source: String,
}

/// The mcp-proxy binary: `$ROBOTA_BENCH_MCP_PROXY`, or the one under
/// `<workspace>/target/bench-tools`, installed there first if missing.
pub fn binary(workspace: &Path) -> Result<Binary, String> {
    if let Some(path) = std::env::var_os(BINARY_ENV).filter(|p| !p.is_empty()) {
        let path = PathBuf::from(path);
        if !path.is_file() {
            return Err(format!("{BINARY_ENV}={} is not a file", path.display()));
        }
        return Ok(Binary {
            source: format!("`${BINARY_ENV}` ({}), version not checked", path.display()),
            path,
        });
    }
    let root = workspace.join("target").join("bench-tools");
    let path = root.join("bin").join(NAME);
    let source =
        format!("`cargo install {NAME} --version {VERSION} --locked --root target/bench-tools`");
    if path.is_file() {
        if let Some(other) = installed_version(&root).filter(|v| v != VERSION) {
            eprintln!(
                "robota-bench: warning: {} is {NAME} {other}, not {VERSION} (remove it to have {VERSION} installed)",
                path.display()
            );
        }
        return Ok(Binary { path, source });
    }
    install(&root)?;
    if !path.is_file() {
        return Err(format!(
            "cargo install succeeded but {} is not there",
            path.display()
        ));
    }
    Ok(Binary { path, source })
}

/// The version of mcp-proxy that `cargo install` recorded under `root`, if any.
fn installed_version(root: &Path) -> Option<String> {
    let text = std::fs::read_to_string(root.join(".crates.toml")).ok()?;
    // `"mcp-proxy 0.6.0 (registry+…)" = ["mcp-proxy"]`
    text.lines().find_map(|line| {
        let rest = line.trim_start().strip_prefix('"')?.strip_prefix(NAME)?;
        let version = rest.strip_prefix(' ')?.split(' ').next()?;
        Some(version.to_owned())
    })
}

/// `cargo install mcp-proxy --version 0.6.0 --locked --root <root>`, built in
/// `<root>/build` (its own target directory: never the workspace's; removed once the
/// binary is installed, about 1 GB), cargo's output on stderr.
fn install(root: &Path) -> Result<(), String> {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let build_dir = root.join("build");
    eprintln!(
        "robota-bench: {} is missing: installing {NAME} {VERSION} from crates.io \
         (cargo install {NAME} --version {VERSION} --locked --root {}); this takes minutes",
        root.join("bin").join(NAME).display(),
        root.display()
    );
    let status = std::process::Command::new(&cargo)
        .args(["install", NAME, "--version", VERSION, "--locked", "--root"])
        .arg(root)
        .env("CARGO_TARGET_DIR", &build_dir)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .status()
        .map_err(|e| format!("cannot run {}: {e}", Path::new(&cargo).display()))?;
    if status.success() {
        let _ = std::fs::remove_dir_all(&build_dir);
        Ok(())
    } else {
        Err(format!("cargo install {NAME} {VERSION} failed ({status})"))
    }
}

/// A running mcp-proxy.
pub struct McpProxy {
    pub addr: SocketAddr,
    child: Child,
    _cgroup: Cgroup,
    _dir: TempDir,
}

impl McpProxy {
    /// Starts `binary` with `backend_url` as its one HTTP backend and waits (bounded) until
    /// it answers; tries three ports (another process may take a port between our finding
    /// it free and the proxy binding it).
    pub fn start(binary: &Path, backend_url: &str) -> Result<McpProxy, String> {
        let mut last = String::new();
        for _ in 0..3 {
            match Self::start_once(binary, backend_url) {
                Ok(proxy) => return Ok(proxy),
                Err(e) => last = e,
            }
        }
        Err(last)
    }

    fn start_once(binary: &Path, backend_url: &str) -> Result<McpProxy, String> {
        let dir = tempfile::Builder::new()
            .prefix("robota-bench-mcp-proxy-")
            .tempdir()
            .map_err(|e| format!("tempdir: {e}"))?;
        let port = free_port()?;
        let config = dir.path().join("proxy.toml");
        std::fs::write(&config, config_text(port, backend_url))
            .map_err(|e| format!("write {}: {e}", config.display()))?;
        let log_path = dir.path().join("stderr.log");
        let log = std::fs::File::create(&log_path)
            .map_err(|e| format!("create {}: {e}", log_path.display()))?;
        let cgroup = Cgroup::create(
            &format!("robota-bench-mcp-proxy-{}-{port}", std::process::id()),
            Hierarchies::Daemon,
        );
        let child = cgroup
            .command(binary)
            .arg("--config")
            .arg(&config)
            .current_dir(dir.path())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .map_err(|e| format!("spawn {}: {e}", binary.display()))?;
        let mut proxy = McpProxy {
            addr: SocketAddr::from(([127, 0, 0, 1], port)),
            child,
            _cgroup: cgroup,
            _dir: dir,
        };
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if let Ok(Some(status)) = proxy.child.try_wait() {
                return Err(format!(
                    "{NAME} exited ({status}) before answering: {}",
                    log_tail(&log_path)
                ));
            }
            if live(proxy.addr) {
                return Ok(proxy);
            }
            if Instant::now() > deadline {
                return Err(format!(
                    "{NAME} did not answer GET /livez on {} within {START_TIMEOUT:?}: {}",
                    proxy.addr,
                    log_tail(&log_path)
                ));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn pid(&self) -> i32 {
        i32::try_from(self.child.id()).unwrap_or(i32::MAX)
    }
}

impl Drop for McpProxy {
    fn drop(&mut self) {
        // Nothing to flush: killed, reaped; the cgroup's drop then kills anything left.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// mcp-proxy's configuration: the listener and one HTTP backend, defaults otherwise.
///
/// The log level is its documented default, `info`, said explicitly: without an
/// `[observability]` section 0.6.0 takes an empty level (the section's `Default`, not the
/// field's serde default), which its filter reads as "everything" — two DEBUG lines on
/// stderr per proxied call, which `info` does not write.
fn config_text(port: u16, backend_url: &str) -> String {
    let quote = |s: &str| serde_json::Value::String(s.to_owned()).to_string();
    format!(
        "[proxy]\nname = \"robota-bench\"\n\n[proxy.listen]\nhost = \"127.0.0.1\"\nport = {port}\n\n\
         [observability]\nlog_level = \"info\"\n\n\
         [[backends]]\nname = {}\ntransport = \"http\"\nurl = {}\n",
        quote(BACKEND),
        quote(backend_url)
    )
}

/// A loopback port free right now.
fn free_port() -> Result<u16, String> {
    let listener =
        TcpListener::bind("127.0.0.1:0").map_err(|e| format!("bind 127.0.0.1:0: {e}"))?;
    listener
        .local_addr()
        .map(|a| a.port())
        .map_err(|e| format!("local_addr: {e}"))
}

/// Whether `GET /livez` is answered 200 (mcp-proxy binds only once it has connected to
/// its backends).
fn live(addr: SocketAddr) -> bool {
    let Ok(mut stream) = TcpStream::connect_timeout(&addr, Duration::from_millis(500)) else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(Duration::from_secs(2)));
    let request = format!("GET /livez HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    if stream.write_all(request.as_bytes()).is_err() {
        return false;
    }
    let mut answer = Vec::new();
    let _ = stream.read_to_end(&mut answer);
    answer.starts_with(b"HTTP/1.1 200")
}

/// The last lines of the proxy's stderr, for a failure message.
fn log_tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().rev().take(5).collect();
    if lines.is_empty() {
        "(nothing on stderr)".into()
    } else {
        lines.into_iter().rev().collect::<Vec<_>>().join(" | ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_installed_version_is_read_from_cargo_s_record() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(installed_version(dir.path()), None);
        std::fs::write(
            dir.path().join(".crates.toml"),
            "[v1]\n\"mcp-proxy 0.6.0 (registry+https://github.com/rust-lang/crates.io-index)\" = [\"mcp-proxy\"]\n",
        )
        .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(installed_version(dir.path()).as_deref(), Some("0.6.0"));
    }
}
