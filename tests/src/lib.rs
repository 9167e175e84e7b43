//! Harness for the end-to-end tests: runs the real `robota-mcpd` and `robota-mcpctl`
//! binaries in private temp directories and talks to them the way clients do.
//!
//! Every test owns its daemon (ephemeral ports, its own control socket), so tests run in
//! parallel. Every wait is bounded: a misbehaving daemon fails a test, it never hangs one.

#![forbid(unsafe_code)]

pub mod authz;
pub mod cgroup;
pub mod daemon;
pub mod docker;
pub mod docs;
pub mod h2;
pub mod http;
pub mod machine;
pub mod mcp;
pub mod notify;
pub mod oidc;
pub mod procs;
pub mod remote;
pub mod secrets;
pub mod setup;
pub mod systemd;
pub mod upstream;

use std::future::Future;
use std::path::PathBuf;
use std::time::{Duration, Instant};

pub use daemon::{CtlOutput, Daemon, DaemonBuilder};
pub use secrets::assert_no_secrets;

/// The MCP protocol revisions the daemon serves.
pub const V_2025_11_25: &str = "2025-11-25";
pub const V_2026_07_28: &str = "2026-07-28";

/// Exit code of `robota-mcpd` for configuration errors (EX_CONFIG).
pub const EXIT_CONFIG: i32 = 78;

/// Directory holding the workspace binaries (`target/<profile>/`), found from the test
/// executable (`target/<profile>/deps/<name>`).
pub fn bin_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    let deps = exe
        .parent()
        .expect("test executable has a parent directory");
    if deps.file_name().is_some_and(|n| n == "deps") {
        deps.parent().expect("deps has a parent").to_path_buf()
    } else {
        deps.to_path_buf()
    }
}

/// Path of a workspace binary; panics with a clear message when it has not been built.
pub fn bin(name: &str) -> PathBuf {
    built(bin_dir().join(name))
}

/// The environment variable naming the directory of the robota-mcpd and robota-mcpctl
/// under test: tests/run sets it to the shipped build's (`target/dist/`).
pub const BIN_DIR_ENV: &str = "ROBOTA_BIN_DIR";

/// Directory holding the robota-mcpd and robota-mcpctl under test: [`BIN_DIR_ENV`] when set
/// (the `dist` build, which the package ships; an absolute path, since cargo runs each
/// test in its package's directory), else [`bin_dir`] (the build cargo made with the
/// tests).
pub fn daemon_bin_dir() -> PathBuf {
    let Some(dir) = std::env::var_os(BIN_DIR_ENV).filter(|dir| !dir.is_empty()) else {
        return bin_dir();
    };
    let dir = PathBuf::from(dir);
    assert!(
        dir.is_absolute(),
        "{BIN_DIR_ENV}={} is relative: give an absolute path (cargo runs each test in its package's directory)",
        dir.display()
    );
    dir
}

fn built(path: PathBuf) -> PathBuf {
    assert!(
        path.is_file(),
        "{} not found: build the workspace first (cargo build --release --workspace), or the \
         shipped binaries into {BIN_DIR_ENV} (cargo build --profile dist -p robota-mcpd -p \
         robota-mcpctl; {BIN_DIR_ENV}=$PWD/target/dist)",
        path.display()
    );
    path
}

pub fn mcpd_bin() -> PathBuf {
    built(daemon_bin_dir().join("robota-mcpd"))
}

pub fn mcpctl_bin() -> PathBuf {
    built(daemon_bin_dir().join("robota-mcpctl"))
}

/// Awaits `fut` for at most `limit`; panics naming `what` on timeout.
pub async fn within<F: Future>(limit: Duration, what: &str, fut: F) -> F::Output {
    match tokio::time::timeout(limit, fut).await {
        Ok(v) => v,
        Err(_) => panic!("timed out after {limit:?}: {what}"),
    }
}

/// Polls `cond` every `every` until it holds or `limit` passes; returns whether it held.
pub async fn poll_until<F: FnMut() -> bool>(limit: Duration, every: Duration, mut cond: F) -> bool {
    poll_until_async(limit, every, || std::future::ready(cond())).await
}

/// [`poll_until`] with an async condition.
pub async fn poll_until_async<F, Fut>(limit: Duration, every: Duration, mut cond: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + limit;
    loop {
        if cond().await {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(every).await;
    }
}

/// Blocking twin of [`poll_until`].
pub fn poll_until_blocking<F: FnMut() -> bool>(
    limit: Duration,
    every: Duration,
    mut cond: F,
) -> bool {
    let deadline = Instant::now() + limit;
    loop {
        if cond() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(every);
    }
}

/// Picks a currently free loopback port (bind port 0, read it, release it).
pub fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
    l.local_addr().expect("local_addr").port()
}

/// Sum of the samples in a Prometheus text exposition whose line contains every one of
/// `parts` (e.g. `carrier="loopback"`, `reason="wrong-host"`), whatever the metric name.
pub fn metric_sum(text: &str, parts: &[&str]) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#') && parts.iter().all(|p| l.contains(p)))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metric_sum_matches_labels_not_names() {
        let text = "# HELP x y\n# TYPE x counter\n\
            a_total{carrier=\"loopback\",reason=\"wrong-host\"} 3\n\
            a_total{carrier=\"remote\",reason=\"wrong-host\"} 5\n\
            b_total{carrier=\"loopback\",reason=\"wrong-origin\"} 7\n";
        assert_eq!(
            metric_sum(text, &["carrier=\"loopback\"", "reason=\"wrong-host\""]),
            3.0
        );
        assert_eq!(metric_sum(text, &["reason=\"wrong-host\""]), 8.0);
        assert_eq!(metric_sum(text, &["reason=\"bad-bearer\""]), 0.0);
    }

    #[test]
    fn secrets_are_found_and_bearer_text_is_strict() {
        let s = "ab".repeat(32);
        assert!(secrets::is_bearer_text(&s));
        assert!(!secrets::is_bearer_text(&s.to_uppercase()));
        assert!(!secrets::is_bearer_text(&s[..63]));
        let caught = std::panic::catch_unwind(|| {
            assert_no_secrets(
                std::slice::from_ref(&s),
                &format!("log line {s} end"),
                "test",
            )
        });
        assert!(caught.is_err(), "a secret in the text must be reported");
        assert_no_secrets(std::slice::from_ref(&s), "clean text", "test");
    }

    #[test]
    fn sse_and_json_bodies_yield_messages() {
        let sse = b"event: message\r\nid: 1\r\ndata: {\"jsonrpc\":\"2.0\",\"id\":7,\"result\":{}}\r\n\r\n";
        let m = http::messages_of(true, sse);
        assert_eq!(m.len(), 1);
        assert_eq!(m[0]["id"], 7);
        let m = http::messages_of(false, br#"{"jsonrpc":"2.0","id":1,"result":{}}"#);
        assert_eq!(m[0]["id"], 1);
        assert!(http::messages_of(false, b"").is_empty());
    }

    #[test]
    fn request_bytes_carry_exact_length() {
        let r = http::Request::new("POST", "/mcp").body(b"abc".to_vec());
        let text = String::from_utf8(r.to_bytes()).expect("utf8");
        assert!(text.starts_with("POST /mcp HTTP/1.1\r\n"));
        assert!(text.contains("Content-Length: 3\r\n\r\nabc"));
        let r = http::Request::new("GET", "/mcp");
        assert!(
            !String::from_utf8(r.to_bytes())
                .expect("utf8")
                .contains("Content-Length")
        );
    }
}
