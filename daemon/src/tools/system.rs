//! `system.info` and `system.health`: what host this is and how it is doing.

use serde_json::{Value, json};
use std::collections::HashSet;

use super::internal;
use crate::catalog::{Annotations, NoArgs, ToolFuture, ToolSpec, TypedTool};
use crate::catalog::{ToolContext, ToolError, ToolOutput};

/// Filesystems `system.health` reports on (deduplicated by device).
const HEALTH_PATHS: [&str; 3] = ["/", "/var", "/tmp"];

/// Ratios at or above which `system.health` reports `degraded`.
const DISK_PRESSURE: f64 = 0.90;
const MEMORY_PRESSURE: f64 = 0.90;

pub struct Info;

impl TypedTool for Info {
    type Args = NoArgs;

    fn spec(&self) -> ToolSpec {
        ToolSpec::typed::<Self::Args>(
            "system.info",
            "Host identity: hostname, OS release, kernel, architecture, uptime, CPUs, memory and the daemon's version.",
            Annotations::READ_ONLY,
        )
    }

    fn run<'a>(&'a self, _ctx: &'a ToolContext<'a>, _args: NoArgs) -> ToolFuture<'a> {
        Box::pin(async { info().map(ToolOutput::Structured) })
    }
}

/// What `system.info` answers. Public so the benchmark's stock-rmcp baseline does exactly
/// the same work.
pub fn info() -> Result<Value, ToolError> {
    let hostname = nix::unistd::gethostname().map_err(|e| internal("gethostname", e))?;
    let uts = nix::sys::utsname::uname().map_err(|e| internal("uname", e))?;
    let sys = nix::sys::sysinfo::sysinfo().map_err(|e| internal("sysinfo", e))?;
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let os = std::fs::read_to_string("/etc/os-release")
        .or_else(|_| std::fs::read_to_string("/usr/lib/os-release"))
        .unwrap_or_default();
    Ok(json!({
        "hostname": hostname.to_string_lossy(),
        "os_release": os_release(&os),
        "kernel": {
            "name": uts.sysname().to_string_lossy(),
            "release": uts.release().to_string_lossy(),
            "version": uts.version().to_string_lossy(),
        },
        "arch": uts.machine().to_string_lossy(),
        "uptime_secs": sys.uptime().as_secs(),
        "cpus": std::thread::available_parallelism().map_or(1, |n| n.get()),
        "memory": {
            "total_bytes": sys.ram_total(),
            "available_bytes": meminfo_bytes(&meminfo, "MemAvailable").unwrap_or(sys.ram_unused()),
        },
        "daemon_version": env!("CARGO_PKG_VERSION"),
    }))
}

/// The identifying fields of an os-release(5) file.
fn os_release(text: &str) -> Value {
    let mut out = serde_json::Map::new();
    for line in text.lines() {
        let Some((key, value)) = line.split_once('=') else {
            continue;
        };
        let key = match key.trim() {
            "ID" => "id",
            "NAME" => "name",
            "VERSION_ID" => "version_id",
            "PRETTY_NAME" => "pretty_name",
            _ => continue,
        };
        let value = value.trim().trim_matches(|c| c == '"' || c == '\'');
        out.insert(key.into(), Value::String(value.into()));
    }
    Value::Object(out)
}

/// A `Key:  1234 kB` line of /proc/meminfo, in bytes.
fn meminfo_bytes(text: &str, key: &str) -> Option<u64> {
    text.lines().find_map(|line| {
        let rest = line.strip_prefix(key)?.strip_prefix(':')?;
        let kib: u64 = rest.split_whitespace().next()?.parse().ok()?;
        Some(kib * 1024)
    })
}

pub struct Health;

impl TypedTool for Health {
    type Args = NoArgs;

    fn spec(&self) -> ToolSpec {
        ToolSpec::typed::<Self::Args>(
            "system.health",
            "Host health: load, memory and disk pressure, and the daemon's serving carriers; `status` is `ok` or `degraded`.",
            Annotations::READ_ONLY,
        )
    }

    fn run<'a>(&'a self, ctx: &'a ToolContext<'a>, _args: NoArgs) -> ToolFuture<'a> {
        Box::pin(async move { health(ctx).map(ToolOutput::Structured) })
    }
}

fn health(ctx: &ToolContext<'_>) -> Result<Value, ToolError> {
    let sys = nix::sys::sysinfo::sysinfo().map_err(|e| internal("sysinfo", e))?;
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let (l1, l5, l15) = sys.load_average();
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let total = sys.ram_total().max(1);
    let available = meminfo_bytes(&meminfo, "MemAvailable").unwrap_or(sys.ram_unused());
    let memory_used = 1.0 - available as f64 / total as f64;
    let mut degraded = Vec::new();
    if memory_used >= MEMORY_PRESSURE {
        degraded.push("memory".to_owned());
    }
    if l5 / cpus as f64 >= 2.0 {
        degraded.push("load".to_owned());
    }

    let mut seen = HashSet::new();
    let mut disks = Vec::new();
    for path in HEALTH_PATHS {
        let Ok(meta) = std::fs::metadata(path) else {
            continue;
        };
        if !seen.insert(std::os::unix::fs::MetadataExt::dev(&meta)) {
            continue;
        }
        let Ok(st) = nix::sys::statvfs::statvfs(path) else {
            continue;
        };
        let block = st.fragment_size();
        let total = st.blocks() * block;
        let available = st.blocks_available() * block;
        let used = if total == 0 {
            0.0
        } else {
            1.0 - available as f64 / total as f64
        };
        if used >= DISK_PRESSURE {
            degraded.push(format!("disk:{path}"));
        }
        disks.push(json!({"path": path, "total_bytes": total, "available_bytes": available, "used_ratio": round(used)}));
    }

    let carriers: Vec<Value> = ctx
        .host
        .carriers()
        .into_iter()
        .map(|(name, address)| json!({"name": name, "address": address}))
        .collect();
    Ok(json!({
        "status": if degraded.is_empty() { "ok" } else { "degraded" },
        "degraded": degraded,
        "load": {"1m": l1, "5m": l5, "15m": l15, "cpus": cpus},
        "memory": {
            "total_bytes": sys.ram_total(),
            "available_bytes": available,
            "used_ratio": round(memory_used),
            "psi_some_avg10": psi_some_avg10("/proc/pressure/memory"),
        },
        "disks": disks,
        "carriers": carriers,
        "uptime_secs": sys.uptime().as_secs(),
    }))
}

fn round(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

/// The `some avg10=` figure of a pressure-stall file, if the kernel has PSI.
fn psi_some_avg10(path: &str) -> Option<f64> {
    let text = std::fs::read_to_string(path).ok()?;
    let line = text.lines().find(|l| l.starts_with("some "))?;
    line.split_whitespace()
        .find_map(|kv| kv.strip_prefix("avg10="))
        .and_then(|v| v.parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn os_release_fields_are_unquoted() {
        let v = os_release("NAME=\"Debian GNU/Linux\"\nID=debian\nVERSION_ID=\"12\"\nHOME_URL=x\n");
        assert_eq!(
            v,
            json!({"name": "Debian GNU/Linux", "id": "debian", "version_id": "12"})
        );
    }

    #[test]
    fn meminfo_is_read_in_bytes() {
        let text = "MemTotal:       16384 kB\nMemAvailable:    2048 kB\n";
        assert_eq!(meminfo_bytes(text, "MemAvailable"), Some(2048 * 1024));
        assert_eq!(meminfo_bytes(text, "Mem"), None);
    }

    #[test]
    fn health_reports_real_numbers() {
        let ctx = ToolContext {
            caller: &crate::vocab::Caller::Local(0),
            cancel: Default::default(),
            progress: Default::default(),
            host: &crate::session::tests::NoCarriers,
        };
        let v = health(&ctx).unwrap();
        assert!(v["memory"]["total_bytes"].as_u64().unwrap() > 0);
        assert!(!v["disks"].as_array().unwrap().is_empty());
        assert!(matches!(v["status"].as_str(), Some("ok" | "degraded")));
    }
}
