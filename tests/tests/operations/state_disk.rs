//! A full state disk is never silent: on a real (tmpfs) filesystem filled to the last
//! block, audit records wait in memory and are counted, store writes fail with a clear
//! `unavailable`, `status` says `degraded` with the last error, the failure counter moves;
//! once there is room again everything held lands in the file and health is `ok`.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use robota_e2e::http::{Request, exchange, tools_list};
use robota_e2e::mcp::McpClient;
use robota_e2e::{Daemon, metric_sum, poll_until_async};
use serde_json::json;

/// A small tmpfs mounted on a fresh directory, unmounted when dropped (before the
/// directory is removed).
struct Tmpfs {
    at: PathBuf,
    _dir: tempfile::TempDir,
}

impl Tmpfs {
    fn mount(size: &str) -> Tmpfs {
        let dir = tempfile::tempdir().expect("tempdir");
        let at = dir.path().join("state");
        std::fs::create_dir(&at).expect("mkdir");
        let out = Command::new("mount")
            .args([
                "-t",
                "tmpfs",
                "-o",
                &format!("size={size},mode=0700"),
                "tmpfs",
            ])
            .arg(&at)
            .output()
            .expect("run mount");
        assert!(
            out.status.success(),
            "this test mounts a tmpfs to fill a real filesystem, which needs root (CI runs as root): {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Tmpfs { at, _dir: dir }
    }

    fn path(&self) -> &Path {
        &self.at
    }

    /// Fill all but about `room` bytes with `filler`.
    fn fill_but(&self, room: u64) -> PathBuf {
        let filler = self.fill();
        let len = std::fs::metadata(&filler).expect("filler").len();
        let file = std::fs::OpenOptions::new()
            .write(true)
            .open(&filler)
            .expect("open");
        file.set_len(len.saturating_sub(room)).expect("truncate");
        filler
    }

    /// Fill every free block with `filler`.
    fn fill(&self) -> PathBuf {
        let filler = self.at.join("filler");
        let _ = Command::new("dd")
            .args(["if=/dev/zero", "bs=64k"])
            .arg(format!("of={}", filler.display()))
            .output()
            .expect("run dd");
        filler
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.at).status();
    }
}

async fn refuse(d: &Daemon, n: usize) {
    let addr = d.loopback_addr();
    let wrong = "0".repeat(64);
    for i in 0..n {
        let resp = exchange(
            addr,
            &Request::mcp(addr.port(), Some(&wrong), &tools_list(i as i64)),
        )
        .await;
        assert_eq!(resp.status, 401);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_state_disk_is_counted_shown_and_survived() {
    let disk = Tmpfs::mount("4m");
    let d = Daemon::builder().state_dir(disk.path()).start();
    assert_eq!(d.status().health, "ok");
    refuse(&d, 3).await;
    let filler = disk.fill();

    // Audit: records wait, the gauge counts them, the counter moves, status is degraded.
    // (The file's last page may still take a few records: refuse until it is full.)
    let degraded = poll_until_async(
        Duration::from_secs(20),
        Duration::from_millis(10),
        || async {
            refuse(&d, 10).await;
            d.status().problems.iter().any(|p| p.part == "audit")
        },
    )
    .await;
    assert!(
        degraded,
        "status never showed the audit failing: {:?}",
        d.status()
    );
    let st = d.status();
    assert_eq!(st.health, "degraded");
    let audit = st
        .problems
        .iter()
        .find(|p| p.part == "audit")
        .expect("audit");
    assert!(audit.error.contains("No space left"), "{audit:?}");
    assert!(
        audit.error.contains("audit.jsonl"),
        "names the file: {audit:?}"
    );
    let metrics = d.metrics_text().expect("metrics");
    let waiting = metric_sum(&metrics, &["robota_mcpd_audit_unpersisted_records"]);
    assert!(waiting >= 1.0, "no record counted as waiting:\n{metrics}");
    let failures = metric_sum(
        &metrics,
        &["robota_mcpd_state_write_failures_total", "part=\"audit\""],
    );
    assert!(
        failures >= 1.0,
        "no audit write failure counted:\n{metrics}"
    );
    let human = d.ctl_ok(&["status"]).stdout;
    assert!(
        human.contains("DEGRADED") || human.contains("degraded"),
        "{human}"
    );

    // Store: a durable bearer cannot be kept; the answer says why, nothing is issued.
    let out = d.ctl(&["bearer", "issue", "--label", "kept", "--ttl", "1h"]);
    out.expect_code(1, "issuing a durable bearer on a full disk");
    assert!(out.stderr.contains("unavailable"), "{}", out.stderr);
    assert!(out.stdout.is_empty(), "no secret printed: {}", out.stdout);
    let st = d.status();
    assert!(
        st.problems.iter().any(|p| p.part == "store"),
        "the store failure is shown: {st:?}"
    );
    // The request path keeps working meanwhile.
    let bearer = d.bearer();
    let addr = d.loopback_addr();
    let resp = exchange(
        addr,
        &Request::mcp(addr.port(), Some(&bearer), &tools_list(99)),
    )
    .await;
    assert_eq!(resp.status, 200, "{}", resp.describe());

    // Room again: the held records land, in order, and health returns.
    std::fs::remove_file(&filler).expect("remove filler");
    refuse(&d, 1).await;
    let healed = poll_until_async(
        Duration::from_secs(10),
        Duration::from_millis(100),
        || async { d.status().problems.iter().all(|p| p.part != "audit") },
    )
    .await;
    assert!(healed, "the audit never recovered: {:?}", d.status());
    // The store recovers on an idle daemon too (it is probed while it fails).
    let store_ok = poll_until_async(
        Duration::from_secs(20),
        Duration::from_millis(200),
        || async { d.status().health == "ok" },
    )
    .await;
    assert!(store_ok, "still degraded: {:?}", d.status().problems);
    d.bearer_with_ttl("kept", "1h");
    let metrics = d.metrics_text().expect("metrics");
    assert_eq!(
        metric_sum(&metrics, &["robota_mcpd_audit_unpersisted_records"]),
        0.0
    );
    // Every refusal reaches the file, in a record of its own or its interval's aggregate
    // (written once the interval has ended), every line whole, in order.
    let refused: u64 = d.status().refusals_last_hour.values().sum();
    let file = disk.path().join("audit.jsonl");
    let read = || {
        let text = std::fs::read_to_string(&file).expect("audit file");
        let records: Vec<serde_json::Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).expect("every line whole"))
            .collect();
        let counted: u64 = records
            .iter()
            .map(|r| r["count"].as_u64().unwrap_or(1))
            .sum();
        let seqs: Vec<u64> = records
            .iter()
            .map(|r| r["seq"].as_u64().expect("seq"))
            .collect();
        (counted, seqs)
    };
    let landed = poll_until_async(Duration::from_secs(10), Duration::from_millis(100), || {
        std::future::ready(read().0 == refused)
    })
    .await;
    let (counted, seqs) = read();
    assert!(landed, "{counted} of {refused} refusals in the file");
    assert!(
        seqs.windows(2).all(|w| w[0] < w[1]),
        "out of order: {seqs:?}"
    );
    d.assert_no_secrets();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_that_ends_on_a_full_disk_is_answered_ended_and_recorded_once_there_is_room() {
    let disk = Tmpfs::mount("4m");
    let d = Daemon::builder()
        .state_dir(disk.path())
        .extra(
            "[jobs.spew]\nargv = [\"/bin/sh\", \"-c\", \"head -c 3000000 /dev/zero | tr '\\\\000' x; exit 4\"]\noutput_cap = \"8MiB\"\n\n[[policy]]\ncallers = [\"bearer:*\"]\ntools = [\"job.start\"]\ndecision = \"allow\"\n",
        )
        .start();
    let client = McpClient::connect(&d, &d.bearer()).await;
    let filler = disk.fill_but(256 * 1024);
    let job = client
        .call("job.start", json!({"template": "spew"}))
        .await
        .ok("job.start");
    let id = job["job_id"].as_i64().expect("job_id");
    // The job's output fills the disk; its end is still answered.
    let last = std::sync::Mutex::new(json!(null));
    let ended = poll_until_async(
        Duration::from_secs(30),
        Duration::from_millis(200),
        || async {
            let now = client
                .call("job.status", json!({"job_id": id}))
                .await
                .ok("job.status");
            let done = now["state"] != "running";
            *last.lock().expect("last") = now;
            done
        },
    )
    .await;
    let last = last.into_inner().expect("last");
    assert!(ended, "the job never ended: {last}");
    assert_eq!(last["state"], "failed", "{last}");
    assert_eq!(last["exit_code"], 4, "{last}");
    // (Which of its writes the full disk refuses depends on where SQLite's write-ahead
    // log still has room.)
    // Room again: with nothing else going on, the end reaches the store and health is ok.
    std::fs::remove_file(&filler).expect("remove filler");
    let healed = poll_until_async(
        Duration::from_secs(20),
        Duration::from_millis(200),
        || async { d.status().health == "ok" },
    )
    .await;
    assert!(healed, "still degraded: {:?}", d.status().problems);
    let listed = d.ctl_ok(&["--json", "jobs", "list"]);
    let jobs: serde_json::Value = serde_json::from_str(&listed.stdout).expect("json");
    assert_eq!(jobs["jobs"][0]["state"], "failed", "{jobs}");
    d.assert_no_secrets();
}
