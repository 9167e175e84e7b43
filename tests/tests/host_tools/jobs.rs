//! Durable jobs through the real daemon and a real MCP client: templates only, handles at
//! once, cursor paging, owner-only visibility and cancel, operator cancel and listing with
//! `robota-mcpctl`, idempotent starts, and crash recovery (`outcome-unknown`, never re-run,
//! a store that passes `PRAGMA integrity_check`).

use std::path::Path;
use std::time::Duration;

use nix::sys::signal::Signal;
use robota_e2e::mcp::McpClient;
use robota_e2e::{Daemon, DaemonBuilder, procs};
use serde_json::{Value, json};

const ALLOW_JOBS: &str = r#"
[[policy]]
callers = ["bearer:*"]
tools = ["job.start"]
decision = "allow"
"#;

/// Templates: a quick one with output on both streams, a slow one that records each run
/// and its process group, and one with a huge output over its cap.
fn templates(dir: &str) -> String {
    format!(
        r#"
[jobs.hello]
argv = ["/bin/sh", "-c", "echo hello from $GREETING; echo warning >&2; exit 3"]
env = {{ GREETING = "a template" }}
timeout = "30s"

[jobs.slow]
argv = ["/bin/sh", "-c", "echo run >> {dir}/slow.runs; echo $$ > {dir}/slow.pid.tmp && mv {dir}/slow.pid.tmp {dir}/slow.pid; sleep 60 & wait"]
timeout = "5m"

[jobs.chatty]
argv = ["/bin/sh", "-c", "i=0; while [ $i -lt 2000 ]; do echo line $i; i=$((i+1)); done"]
output_cap = "4KiB"
"#
    )
}

fn builder(dir: &Path) -> DaemonBuilder {
    Daemon::builder()
        .state_dir(&dir.join("state"))
        .extra(templates(&dir.display().to_string()))
        .extra(ALLOW_JOBS)
}

async fn wait_finished(client: &McpClient, job_id: i64) -> Value {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let job = client
            .call("job.status", json!({"job_id": job_id}))
            .await
            .ok("job.status");
        if job["state"] != "running" {
            return job;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "job {job_id} still running after 30 s: {job}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn read_pid(path: &Path) -> Option<i32> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_template_job_runs_to_its_end_and_its_output_pages_by_cursor() {
    let tmp = tempfile::tempdir().unwrap();
    let d = builder(tmp.path()).start();
    let client = McpClient::connect(&d, &d.bearer()).await;
    let names = client.tool_names().await;
    for tool in ["job.start", "job.status", "job.tail", "job.cancel"] {
        assert!(
            names.iter().any(|n| n == tool),
            "{tool} not listed: {names:?}"
        );
    }

    let job = client
        .call("job.start", json!({"template": "hello"}))
        .await
        .ok("job.start");
    let id = job["job_id"].as_i64().expect("job_id");
    assert_eq!(job["owner"], "bearer:default");
    assert_eq!(job["kind"], "template");
    assert_eq!(job["target"], "hello");

    let done = wait_finished(&client, id).await;
    assert_eq!(done["state"], "failed", "{done}");
    assert_eq!(done["exit_code"], 3, "{done}");
    assert_eq!(
        robota_e2e::metric_sum(
            &d.metrics_text().expect("metrics"),
            &[
                "robota_mcpd_jobs_finished_total",
                "kind=\"template\"",
                "state=\"failed\""
            ]
        ),
        1.0
    );

    // Page through the output five bytes at a time.
    let mut text = String::new();
    let mut streams = std::collections::BTreeSet::new();
    let mut cursor = 0;
    for _ in 0..100 {
        let page = client
            .call(
                "job.tail",
                json!({"job_id": id, "cursor": cursor, "max_bytes": 5}),
            )
            .await
            .ok("job.tail");
        for chunk in page["chunks"].as_array().unwrap() {
            text.push_str(chunk["text"].as_str().unwrap());
            streams.insert(chunk["stream"].as_str().unwrap().to_owned());
        }
        cursor = page["next_cursor"].as_u64().unwrap();
        if page["complete"] == true {
            break;
        }
    }
    assert!(text.contains("hello from a template\n"), "{text:?}");
    assert!(text.contains("warning\n"), "{text:?}");
    assert_eq!(text.len() as u64, done["output_bytes"].as_u64().unwrap());
    assert_eq!(
        streams.len(),
        2,
        "stdout and stderr are both tagged: {streams:?}"
    );

    // Output over the cap is counted, not kept.
    let chatty = client
        .call("job.start", json!({"template": "chatty"}))
        .await
        .ok("job.start chatty");
    let done = wait_finished(&client, chatty["job_id"].as_i64().unwrap()).await;
    assert_eq!(done["state"], "succeeded");
    assert_eq!(done["output_bytes"], 4096);
    assert!(done["output_dropped"].as_u64().unwrap() > 10_000, "{done}");

    // Only configured templates exist; there is no way to pass a command.
    let msg = client
        .call("job.start", json!({"template": "rm-rf"}))
        .await
        .err("invalid_arguments", "unknown template");
    assert!(msg.contains("rm-rf"), "{msg}");
    client
        .call(
            "job.start",
            json!({"template": "hello", "argv": ["/bin/true"]}),
        )
        .await
        .err("invalid_arguments", "extra argument");

    // Numbers are what the schema promises: a cursor past what the store can hold (2^63),
    // or a number that is no integer of the argument's type, is the caller's mistake,
    // never a page from 0.
    for (args, name) in [
        (
            json!({"job_id": id, "cursor": 9_223_372_036_854_775_808u64}),
            "cursor",
        ),
        (json!({"job_id": id, "cursor": 1.0}), "cursor"),
        (json!({"job_id": id, "max_bytes": 5.0}), "max_bytes"),
        (json!({"job_id": 1.0}), "job_id"),
    ] {
        let msg = client
            .call("job.tail", args.clone())
            .await
            .err("invalid_arguments", &args.to_string());
        assert!(msg.contains(name), "{args}: {msg}");
    }
    let end = client
        .call(
            "job.tail",
            json!({"job_id": id, "cursor": 9_223_372_036_854_775_807u64}),
        )
        .await
        .ok("the largest cursor");
    let hello = wait_finished(&client, id).await;
    assert_eq!(end["next_cursor"], hello["output_bytes"], "{end}");
    client.close().await;
    d.assert_no_secrets();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_belong_to_their_caller_and_cancel_kills_the_process_group() {
    let tmp = tempfile::tempdir().unwrap();
    let d = builder(tmp.path()).start();
    let owner = McpClient::connect(&d, &d.bearer_labeled("ci")).await;
    let other = McpClient::connect(&d, &d.bearer_labeled("other")).await;

    let job = owner
        .call("job.start", json!({"template": "slow"}))
        .await
        .ok("job.start slow");
    let id = job["job_id"].as_i64().unwrap();
    assert_eq!(job["state"], "running");
    assert_eq!(job["owner"], "bearer:ci");
    let pid_file = tmp.path().join("slow.pid");
    assert!(
        robota_e2e::poll_until(Duration::from_secs(10), Duration::from_millis(20), || {
            read_pid(&pid_file).is_some()
        })
        .await,
        "the slow job never started"
    );
    let pgid = read_pid(&pid_file).unwrap();

    // Another caller sees nothing and cancels nothing.
    for tool in ["job.status", "job.tail", "job.cancel"] {
        other
            .call(tool, json!({"job_id": id}))
            .await
            .err("invalid_arguments", tool);
    }
    assert!(
        procs::alive(pgid),
        "the job died from another caller's cancel"
    );

    let cancelled = owner
        .call("job.cancel", json!({"job_id": id}))
        .await
        .ok("job.cancel");
    assert_eq!(cancelled["job_id"], id);
    let done = wait_finished(&owner, id).await;
    assert_eq!(done["state"], "cancelled", "{done}");
    let gone = robota_e2e::poll_until(Duration::from_secs(10), Duration::from_millis(20), || {
        procs::group_members(pgid).is_empty()
    })
    .await;
    assert!(gone, "job processes left: {:?}", procs::group_members(pgid));

    // The operator lists every caller's jobs and cancels any.
    let second = other
        .call("job.start", json!({"template": "slow"}))
        .await
        .ok("job.start by other");
    let second_id = second["job_id"].as_i64().unwrap().to_string();
    let listed = d.ctl_ok(&["--json", "jobs", "list"]);
    let reply: Value = serde_json::from_str(&listed.stdout).unwrap();
    let owners: Vec<&str> = reply["jobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|j| j["owner"].as_str().unwrap())
        .collect();
    assert_eq!(owners, ["bearer:other", "bearer:ci"], "{reply}");
    let table = d.ctl_ok(&["jobs", "list", "--owner", "bearer:ci"]);
    assert!(table.stdout.contains("cancelled"), "{}", table.stdout);
    assert!(!table.stdout.contains("bearer:other"), "{}", table.stdout);
    d.ctl_ok(&["jobs", "cancel", &second_id]);
    let done = wait_finished(&other, second["job_id"].as_i64().unwrap()).await;
    assert_eq!(done["state"], "cancelled");
    // Cancelling it again is a conflict that names its end, not a success.
    let again = d.ctl(&["jobs", "cancel", &second_id]);
    again.expect_code(1, "cancel of a finished job");
    assert!(
        again.stderr.contains("conflict") && again.stderr.contains("already ended (cancelled)"),
        "{}",
        again.stderr
    );
    d.ctl(&["jobs", "cancel", "999999"])
        .expect_code(1, "unknown job");

    owner.close().await;
    other.close().await;
    d.assert_no_secrets();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_idempotency_key_starts_one_job() {
    let tmp = tempfile::tempdir().unwrap();
    let d = builder(tmp.path()).start();
    let ci = McpClient::connect(&d, &d.bearer_labeled("ci")).await;
    let other = McpClient::connect(&d, &d.bearer_labeled("other")).await;

    let first = ci
        .call(
            "job.start",
            json!({"template": "hello", "idempotency_key": "deploy-1"}),
        )
        .await
        .ok("first start");
    let again = ci
        .call(
            "job.start",
            json!({"template": "hello", "idempotency_key": "deploy-1"}),
        )
        .await
        .ok("replayed start");
    assert_eq!(first, again, "a replay returns the first result");
    let msg = ci
        .call(
            "job.start",
            json!({"template": "chatty", "idempotency_key": "deploy-1"}),
        )
        .await
        .err("invalid_arguments", "same key, other arguments");
    assert!(msg.contains("idempotency key"), "{msg}");
    // Keys are per caller: the same key from another caller is its own first call.
    let others = other
        .call(
            "job.start",
            json!({"template": "hello", "idempotency_key": "deploy-1"}),
        )
        .await
        .ok("other caller's start");
    assert_ne!(others["job_id"], first["job_id"]);

    let listed = d.ctl_ok(&["--json", "jobs", "list", "--owner", "bearer:ci"]);
    let reply: Value = serde_json::from_str(&listed.stdout).unwrap();
    assert_eq!(
        reply["jobs"].as_array().unwrap().len(),
        1,
        "one effect: {reply}"
    );
    // Each duplicate decision is counted, and the starts by kind.
    let metrics = d.metrics_text().expect("metrics");
    for (decision, n) in [("replayed", 1.0), ("mismatch", 1.0)] {
        assert_eq!(
            robota_e2e::metric_sum(
                &metrics,
                &[
                    "robota_mcpd_idempotency_decisions_total",
                    "tool=\"job.start\"",
                    &format!("decision=\"{decision}\"")
                ]
            ),
            n,
            "{decision}"
        );
    }
    assert_eq!(
        robota_e2e::metric_sum(
            &metrics,
            &["robota_mcpd_jobs_started_total", "kind=\"template\""]
        ),
        2.0,
        "two jobs started (one per caller)"
    );
    ci.close().await;
    other.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn job_start_is_denied_without_a_policy_rule() {
    let tmp = tempfile::tempdir().unwrap();
    let d = Daemon::builder()
        .extra(templates(&tmp.path().display().to_string()))
        .start();
    let client = McpClient::connect(&d, &d.bearer()).await;
    client
        .call("job.start", json!({"template": "hello"}))
        .await
        .err("permission_denied", "default policy");
    assert_eq!(
        robota_e2e::metric_sum(
            &d.metrics_text().expect("metrics"),
            &[
                "robota_mcpd_policy_denials_total",
                "tool=\"job.start\"",
                "code=\"permission_denied\""
            ]
        ),
        1.0
    );
    // Status and tail of one's own jobs are read-only and allowed.
    client
        .call("job.status", json!({"job_id": 1}))
        .await
        .err("invalid_arguments", "no such job");
    client.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_cut_off_by_a_crash_is_outcome_unknown_and_never_rerun() {
    let tmp = tempfile::tempdir().unwrap();
    let first = builder(tmp.path()).start();
    let client = McpClient::connect(&first, &first.bearer()).await;
    let job = client
        .call("job.start", json!({"template": "slow"}))
        .await
        .ok("job.start slow");
    let id = job["job_id"].as_i64().unwrap();
    let pid_file = tmp.path().join("slow.pid");
    assert!(
        robota_e2e::poll_until(Duration::from_secs(10), Duration::from_millis(20), || {
            read_pid(&pid_file).is_some()
        })
        .await,
        "the slow job never started"
    );
    let pgid = read_pid(&pid_file).unwrap();
    client.close().await;
    // The daemon records the job's process group just after it spawned it; wait for that
    // record (a crash in between leaves a group the next start cannot know about).
    let recorded =
        robota_e2e::poll_until(Duration::from_secs(10), Duration::from_millis(20), || {
            rusqlite::Connection::open_with_flags(
                tmp.path().join("state/robota.db"),
                rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY,
            )
            .and_then(|db| {
                db.query_row("SELECT pid FROM jobs WHERE id = ?1", [id], |r| {
                    r.get::<_, Option<i64>>(0)
                })
            })
            .is_ok_and(|pid| pid == Some(i64::from(pgid)))
        })
        .await;
    assert!(
        recorded,
        "the daemon never recorded the job's process group"
    );

    first.signal(Signal::SIGKILL);
    assert!(first.wait_exit(Duration::from_secs(10)).is_some());
    // The job's processes outlive a SIGKILLed daemon (no systemd cgroup here) ...
    assert!(
        procs::alive(pgid),
        "expected the orphaned job to be alive before restart"
    );
    first.assert_no_secrets();
    drop(first);

    // ... until the next start takes over the store: it kills the orphaned group (same pid
    // and start time) and marks the job outcome-unknown.
    let second = builder(tmp.path()).start();
    let listed = second.ctl_ok(&["--json", "jobs", "list"]);
    let reply: Value = serde_json::from_str(&listed.stdout).unwrap();
    let jobs = reply["jobs"].as_array().unwrap();
    assert_eq!(jobs.len(), 1, "{reply}");
    assert_eq!(jobs[0]["job_id"], id);
    assert_eq!(jobs[0]["state"], "outcome-unknown", "{reply}");
    assert!(jobs[0]["detail"].as_str().unwrap().contains("not re-run"));
    let gone = robota_e2e::poll_until(Duration::from_secs(10), Duration::from_millis(20), || {
        procs::group_members(pgid).is_empty()
    })
    .await;
    assert!(
        gone,
        "orphaned job processes left: {:?}",
        procs::group_members(pgid)
    );
    // Never re-run: recovery ends before READY=1, and it left one job, outcome-unknown and
    // with no new process recorded (a re-run would be a new row or the same one running
    // again); the template's own record says it ran once.
    let db = rusqlite::Connection::open_with_flags(
        tmp.path().join("state/robota.db"),
        rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY,
    )
    .unwrap();
    let rows: Vec<(i64, String, Option<i64>)> = db
        .prepare("SELECT id, state, pid FROM jobs")
        .unwrap()
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    assert_eq!(
        rows,
        [(id, "outcome-unknown".to_owned(), Some(i64::from(pgid)))]
    );
    let runs = std::fs::read_to_string(tmp.path().join("slow.runs")).unwrap();
    assert_eq!(runs.lines().count(), 1, "{runs:?}");
    let table = second.ctl_ok(&["jobs", "list"]);
    assert!(table.stdout.contains("outcome-unknown"), "{}", table.stdout);
    // The start that found it says so in its metrics (the shipped alert reads this).
    assert_eq!(
        robota_e2e::metric_sum(
            &second.metrics_text().expect("metrics"),
            &["robota_mcpd_jobs_recovered_at_start"]
        ),
        1.0
    );

    // The store is sound, checked by SQLite itself from outside the daemon.
    let db = rusqlite::Connection::open_with_flags(
        tmp.path().join("state/robota.db"),
        rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY,
    )
    .unwrap();
    let check: String = db
        .query_row("PRAGMA integrity_check", [], |r| r.get(0))
        .unwrap();
    assert_eq!(check, "ok");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_store_is_a_clear_start_up_error_and_is_left_alone() {
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    std::fs::create_dir_all(&state).unwrap();
    let junk = b"definitely not an SQLite database ".repeat(100);
    std::fs::write(state.join("robota.db"), &junk).unwrap();
    let d = Daemon::builder().state_dir(&state).spawn();
    let status = d
        .wait_exit(Duration::from_secs(15))
        .expect("the daemon must refuse to start");
    assert_eq!(status.code(), Some(1), "runtime error exit code");
    let stderr = d.stderr_text();
    assert!(
        stderr.contains("robota.db"),
        "stderr names the store: {stderr}"
    );
    assert!(
        std::fs::read(state.join("robota.db")).unwrap() == junk,
        "the corrupt store was modified"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_are_mcp_tasks_for_clients_that_declare_the_extension() {
    use rmcp::model::{
        CallToolRequestParams, CallToolResponse, CancelTaskParams, GetTaskParams, TaskPayload,
        TaskStatus,
    };

    let tmp = tempfile::tempdir().unwrap();
    let d = builder(tmp.path()).start();
    let client = McpClient::connect_with_tasks(&d, &d.bearer_labeled("ci")).await;
    let peer = client.peer();
    let start = |template: &str| {
        let mut args = serde_json::Map::new();
        args.insert("template".into(), template.into());
        CallToolRequestParams::new("job.start").with_arguments(args)
    };

    // A job-starting call answers with a task handle; tasks/get follows the same job.
    let response = peer
        .call_tool_once(start("hello"))
        .await
        .expect("tools/call");
    let CallToolResponse::Task(created) = response else {
        panic!("expected a task handle, got {response:?}");
    };
    let task_id = created.task.task_id.clone();
    assert_eq!(created.task.status, TaskStatus::Working);
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let finished = loop {
        let got = peer
            .get_task(GetTaskParams::new(task_id.clone()))
            .await
            .expect("tasks/get");
        if got.task.status() != TaskStatus::Working {
            break got;
        }
        assert!(std::time::Instant::now() < deadline, "task still working");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    // `hello` exits 3: a completed task whose result is an error carrying the job record.
    let TaskPayload::Completed { result } = &finished.task.payload else {
        panic!("expected completed, got {finished:?}");
    };
    assert_eq!(result["isError"], true, "{result:?}");
    assert_eq!(result["structuredContent"]["state"], "failed");
    assert_eq!(result["structuredContent"]["exit_code"], 3);
    // The same job, seen through the canonical tools.
    let status = client
        .call(
            "job.status",
            json!({"job_id": task_id.parse::<i64>().unwrap()}),
        )
        .await
        .ok("job.status");
    assert_eq!(status["state"], "failed");

    // tasks/cancel cancels the job.
    let CallToolResponse::Task(slow) = peer.call_tool_once(start("slow")).await.unwrap() else {
        panic!("expected a task handle");
    };
    peer.cancel_task(CancelTaskParams::new(slow.task.task_id.clone()))
        .await
        .expect("tasks/cancel");
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let got = peer
            .get_task(GetTaskParams::new(slow.task.task_id.clone()))
            .await
            .unwrap();
        if got.task.status() == TaskStatus::Cancelled {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "task not cancelled: {got:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // Another caller's task does not exist for it; neither does garbage.
    let other = McpClient::connect_with_tasks(&d, &d.bearer_labeled("other")).await;
    assert!(
        other
            .peer()
            .get_task(GetTaskParams::new(task_id.clone()))
            .await
            .is_err()
    );
    assert!(
        other
            .peer()
            .cancel_task(CancelTaskParams::new(slow.task.task_id.clone()))
            .await
            .is_err()
    );
    assert!(
        peer.get_task(GetTaskParams::new("not-a-job"))
            .await
            .is_err()
    );

    // A client that did not declare the extension gets the plain structured result.
    let plain = McpClient::connect(&d, &d.bearer_labeled("plain")).await;
    let job = plain
        .call("job.start", json!({"template": "hello"}))
        .await
        .ok("plain start");
    assert!(job["job_id"].as_i64().is_some(), "{job}");
    other.close().await;
    plain.close().await;
    client.close().await;
    d.assert_no_secrets();
}
