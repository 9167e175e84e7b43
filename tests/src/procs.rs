//! Process inspection through `/proc`: liveness (zombies count as gone), children and process
//! groups.

use std::path::Path;
use std::time::Duration;

/// (state, pgid) of `pid` from `/proc/<pid>/stat`.
fn stat(pid: i32) -> Option<(char, i32)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &text[text.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace();
    let state = fields.next()?.chars().next()?;
    let _ppid = fields.next()?;
    let pgid = fields.next()?.parse().ok()?;
    Some((state, pgid))
}

/// Is `pid` a live (non-zombie) process?
pub fn alive(pid: i32) -> bool {
    matches!(stat(pid), Some((s, _)) if s != 'Z' && s != 'X')
}

/// Process group of `pid`.
pub fn pgid(pid: i32) -> Option<i32> {
    stat(pid).map(|(_, g)| g)
}

/// Live (non-zombie) children of `pid`, in order.
pub fn children(pid: i32) -> Vec<i32> {
    let mut out: Vec<i32> = std::fs::read_dir(format!("/proc/{pid}/task"))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|task| std::fs::read_to_string(task.path().join("children")).ok())
        .flat_map(|text| {
            text.split_whitespace()
                .filter_map(|p| p.parse().ok())
                .collect::<Vec<i32>>()
        })
        .filter(|&child| alive(child))
        .collect();
    out.sort_unstable();
    out
}

/// Live (non-zombie) members of process group `pgid`.
pub fn group_members(pgid: i32) -> Vec<i32> {
    let mut out = Vec::new();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return out;
    };
    for e in dir.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        if let Some((s, g)) = stat(pid)
            && g == pgid
            && s != 'Z'
            && s != 'X'
        {
            out.push(pid);
        }
    }
    out
}

/// Reads a pid written by a turn script (whole line, trimmed), if the file exists yet.
pub fn read_pid_file(path: &Path) -> Option<i32> {
    let text = std::fs::read_to_string(path).ok()?;
    if !text.ends_with('\n') {
        return None;
    }
    text.trim().parse().ok()
}

/// Waits (bounded, async) for a pid file.
pub async fn wait_pid_file(path: &Path, limit: Duration) -> Option<i32> {
    let mut pid = None;
    crate::poll_until(limit, Duration::from_millis(20), || {
        pid = read_pid_file(path);
        pid.is_some()
    })
    .await;
    pid
}

/// The daemon's resident set size, from `/proc/<pid>/status`.
pub fn rss_kib(pid: i32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("proc status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no VmRSS in /proc/{pid}/status"))
}

/// The highest resident set size a process has had (`VmHWM`), from `/proc/<pid>/status`.
pub fn peak_rss_kib(pid: i32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("proc status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no VmHWM in /proc/{pid}/status"))
}
