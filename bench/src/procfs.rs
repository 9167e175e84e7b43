//! What `/proc` says about this machine and the processes under test: resident memory,
//! CPU time per process and for the whole machine, and the facts printed with the results.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

/// Kernel clock ticks per second for `/proc/*/stat` times (`getconf CLK_TCK`; 100 on
/// every Linux this runs on).
const TICKS_PER_SEC: f64 = 100.0;

/// Resident set size of `pid` in KiB (`VmRSS` of `/proc/<pid>/status`).
pub fn rss_kib(pid: i32) -> Option<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
}

/// User + system CPU time `pid` has used (all its threads).
pub fn process_cpu(pid: i32) -> Duration {
    let Ok(text) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return Duration::ZERO;
    };
    // The command name is in parentheses and may hold spaces: count fields after it.
    let Some(rest) = text.rfind(')').map(|i| &text[i + 1..]) else {
        return Duration::ZERO;
    };
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // After ")": state is field 3 of the man page, utime 14 and stime 15.
    let tick = |i: usize| {
        fields
            .get(i)
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0)
    };
    let ticks = tick(11) + tick(12);
    Duration::from_secs_f64(ticks as f64 / TICKS_PER_SEC)
}

/// Whole-machine CPU time from the `cpu` line of `/proc/stat`.
#[derive(Debug, Clone, Copy, Default)]
pub struct MachineCpu {
    /// Time some CPU was running anything (user, nice, system, irq, softirq).
    pub busy: Duration,
    /// Time the hypervisor ran someone else while we wanted a CPU.
    pub steal: Duration,
    /// All time of all CPUs (busy + idle + iowait + steal).
    pub total: Duration,
}

impl MachineCpu {
    pub fn now() -> MachineCpu {
        let text = std::fs::read_to_string("/proc/stat").unwrap_or_default();
        let Some(line) = text.lines().find(|l| l.starts_with("cpu ")) else {
            return MachineCpu::default();
        };
        let v: Vec<u64> = line
            .split_whitespace()
            .skip(1)
            .filter_map(|x| x.parse().ok())
            .collect();
        let at = |i: usize| v.get(i).copied().unwrap_or(0);
        // user nice system idle iowait irq softirq steal (guest time is inside user).
        let busy = at(0) + at(1) + at(2) + at(5) + at(6);
        let ticks = |t: u64| Duration::from_secs_f64(t as f64 / TICKS_PER_SEC);
        MachineCpu {
            busy: ticks(busy),
            steal: ticks(at(7)),
            total: ticks(busy + at(3) + at(4) + at(7)),
        }
    }

    pub fn since(self, earlier: MachineCpu) -> MachineCpu {
        MachineCpu {
            busy: self.busy.saturating_sub(earlier.busy),
            steal: self.steal.saturating_sub(earlier.steal),
            total: self.total.saturating_sub(earlier.total),
        }
    }
}

/// CPU use over one measurement window: the server's, the load generator's, a helper
/// process's the server depends on (the authorization server of the opaque-token cells),
/// and the rest of the machine's (other processes, e.g. a CI run), as shares of all CPUs.
#[derive(Debug, Clone, Copy, Default)]
pub struct CpuShare {
    pub server: Duration,
    pub generator: Duration,
    /// The helper's CPU time (zero without one).
    pub helper: Duration,
    /// Busy time of everything else, as a fraction of the machine (0..1).
    pub foreign: f64,
    /// Stolen time, as a fraction of the machine (0..1).
    pub steal: f64,
}

/// A snapshot to diff against at the end of a window.
#[derive(Debug, Clone, Copy)]
pub struct CpuMark {
    machine: MachineCpu,
    server: Duration,
    generator: Duration,
    helper: Duration,
}

impl CpuMark {
    pub fn now(server_pid: Option<i32>) -> CpuMark {
        CpuMark::with_helper(server_pid, None)
    }

    /// [`CpuMark::now`] that also reads `helper_pid`'s CPU time, which then does not
    /// count as other processes' use.
    pub fn with_helper(server_pid: Option<i32>, helper_pid: Option<i32>) -> CpuMark {
        CpuMark {
            machine: MachineCpu::now(),
            server: server_pid.map_or(Duration::ZERO, process_cpu),
            generator: process_cpu(std::process::id() as i32),
            helper: helper_pid.map_or(Duration::ZERO, process_cpu),
        }
    }

    pub fn share_since(&self, earlier: &CpuMark) -> CpuShare {
        let machine = self.machine.since(earlier.machine);
        let server = self.server.saturating_sub(earlier.server);
        let generator = self.generator.saturating_sub(earlier.generator);
        let helper = self.helper.saturating_sub(earlier.helper);
        let total = machine.total.as_secs_f64().max(1e-9);
        let ours = server.as_secs_f64() + generator.as_secs_f64() + helper.as_secs_f64();
        let foreign = (machine.busy.as_secs_f64() - ours).max(0.0);
        CpuShare {
            server,
            generator,
            helper,
            foreign: (foreign / total).clamp(0.0, 1.0),
            steal: machine.steal.as_secs_f64() / total,
        }
    }
}

/// How busy the machine is without us: the share of all CPUs used by other processes
/// over `window` (this process sleeps meanwhile).
pub fn foreign_load(window: Duration) -> f64 {
    let before = CpuMark::now(None);
    std::thread::sleep(window);
    CpuMark::now(None).share_since(&before).foreign
}

/// Waits (at most `limit`) until other processes use at most `threshold` of the machine
/// over two consecutive seconds; returns the last reading.
pub fn wait_quiet(threshold: f64, limit: Duration) -> f64 {
    let deadline = std::time::Instant::now() + limit;
    let mut last = foreign_load(Duration::from_secs(1));
    let mut quiet = 0;
    while std::time::Instant::now() < deadline {
        if last <= threshold {
            quiet += 1;
            if quiet == 2 {
                break;
            }
        } else {
            quiet = 0;
        }
        last = foreign_load(Duration::from_secs(1));
    }
    last
}

/// Facts printed with the results.
#[derive(Debug, Clone)]
pub struct Machine {
    pub nproc: usize,
    pub cpu_model: String,
    pub kernel: String,
    pub rustc: String,
    pub date: String,
    pub memory: String,
    /// The daemon's source: commit and whether `daemon/` had uncommitted changes.
    pub source: String,
}

impl Machine {
    pub fn describe(workspace: &Path, binary: &Path) -> Machine {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let cpu_model = cpuinfo
            .lines()
            .find_map(|l| l.strip_prefix("model name"))
            .and_then(|l| l.split_once(':'))
            .map_or_else(|| "unknown".into(), |(_, m)| m.trim().to_owned());
        let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
        let memory = meminfo
            .lines()
            .find_map(|l| l.strip_prefix("MemTotal:"))
            .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
            .map_or_else(
                || "unknown".into(),
                |kib| format!("{:.1} GiB", kib as f64 / 1024.0 / 1024.0),
            );
        Machine {
            nproc: std::thread::available_parallelism().map_or(1, |n| n.get()),
            cpu_model,
            kernel: command_line("uname", &["-sr"]),
            rustc: command_line("rustc", &["--version"]),
            date: command_line("date", &["-u", "+%Y-%m-%d %H:%M UTC"]),
            memory,
            source: source(workspace, binary),
        }
    }
}

/// `commit <short hash>`, plus a note when `daemon/` differs from it (read-only git) or
/// when the daemon binary is older than its sources.
fn source(workspace: &Path, binary: &Path) -> String {
    let dir = workspace.display().to_string();
    let commit = command_line("git", &["-C", &dir, "rev-parse", "--short", "HEAD"]);
    let dirty = Command::new("git")
        .args(["-C", &dir, "status", "--porcelain", "--", "daemon", "proto"])
        .output()
        .is_ok_and(|o| !o.stdout.is_empty());
    let mut text = format!("commit {commit}");
    if dirty {
        text.push_str(" with uncommitted changes under daemon/");
    }
    // target/<profile>/robota-mcpd: which build was measured.
    let build = binary
        .parent()
        .and_then(Path::file_name)
        .map_or_else(|| "?".to_owned(), |p| p.to_string_lossy().into_owned());
    text.push_str(&format!(", the `{build}` build"));
    if build != "dist" {
        text.push_str(" (**not the shipped `dist` build**: set ROBOTA_BIN_DIR)");
    }
    if binary_is_stale(workspace, binary) {
        text.push_str("; **the robota-mcpd binary is older than its sources** (rebuild it)");
    }
    text
}

/// Whether a file under `daemon/` or `proto/` changed after `binary` was written.
pub fn binary_is_stale(workspace: &Path, binary: &Path) -> bool {
    let Some(built) = std::fs::metadata(binary).and_then(|m| m.modified()).ok() else {
        return true;
    };
    let mut dirs: Vec<PathBuf> = vec![workspace.join("daemon"), workspace.join("proto")];
    while let Some(dir) = dirs.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            let Ok(meta) = entry.metadata() else {
                continue;
            };
            if meta.is_dir() {
                dirs.push(path);
            } else if meta.modified().is_ok_and(|m| m > built) {
                return true;
            }
        }
    }
    false
}

/// The first line a command prints, or `unknown`.
fn command_line(program: &str, args: &[&str]) -> String {
    Command::new(program)
        .args(args)
        .output()
        .ok()
        .filter(|o| o.status.success())
        .and_then(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .next()
                .map(str::to_owned)
        })
        .unwrap_or_else(|| "unknown".into())
}
