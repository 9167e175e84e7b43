//! The refusal audit as operators see it through `robota-mcpctl audit`: one record per
//! refusal on every carrier (loopback, control, remote), persisted in the state
//! directory across `restart` and a full stop/start, filtered by `--reason` and
//! `--since`, streamed by `--follow`.

use std::io::{BufRead, BufReader};
use std::os::unix::fs::PermissionsExt;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use robota_e2e::authz::{Authz, now_secs};
use robota_e2e::daemon::Daemon;
use robota_e2e::http::{Request, exchange, tools_list};
use robota_e2e::remote::{
    PUBLIC_URL, RemoteConfig, audit, check_audit_record, max_seq, records_after, remote_mcp,
};
use robota_e2e::{mcpctl_bin, poll_until, poll_until_blocking};
use serde_json::Value;

const NOBODY: u32 = 65534;

/// One loopback refusal with a wrong bearer (`bad-bearer`).
async fn bad_bearer(d: &Daemon) {
    let addr = d.loopback_addr();
    let resp = exchange(
        addr,
        &Request::mcp(addr.port(), Some(&"0".repeat(64)), &tools_list(1)),
    )
    .await;
    assert_eq!(resp.status, 401, "{}", resp.describe());
}

/// One loopback refusal for a wrong Host (`wrong-host`).
async fn wrong_host(d: &Daemon) {
    let addr = d.loopback_addr();
    let bearer = d.bearer();
    let resp = exchange(
        addr,
        &Request::mcp(addr.port(), Some(&bearer), &tools_list(1))
            .set_header("Host", "evil.example"),
    )
    .await;
    assert_eq!(resp.status, 403, "{}", resp.describe());
}

/// Waits (bounded) until `audit` lists at least `n` records; returns them.
async fn wait_records(d: &Daemon, args: &[&str], n: usize) -> Vec<Value> {
    let mut records = Vec::new();
    poll_until(Duration::from_secs(5), Duration::from_millis(25), || {
        records = audit(d, args);
        records.len() >= n
    })
    .await;
    records
}

fn reasons(records: &[Value]) -> Vec<&str> {
    records
        .iter()
        .map(|r| r["reason"].as_str().unwrap_or_default())
        .collect()
}

/// Sequence numbers strictly increase in listing order.
fn assert_ordered(records: &[Value], what: &str) {
    let seqs: Vec<u64> = records.iter().filter_map(|r| r["seq"].as_u64()).collect();
    assert!(
        seqs.windows(2).all(|w| w[0] < w[1]),
        "{what}: seq not strictly increasing: {seqs:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_on_every_carrier_are_recorded_and_filterable() {
    let d = Daemon::start("");
    let t0 = now_secs();
    for _ in 0..3 {
        bad_bearer(&d).await;
    }
    for _ in 0..2 {
        wrong_host(&d).await;
    }
    // A control-socket peer that is not allowed.
    std::fs::set_permissions(d.runtime_dir(), std::fs::Permissions::from_mode(0o755))
        .expect("chmod run dir");
    std::fs::set_permissions(d.socket_path(), std::fs::Permissions::from_mode(0o666))
        .expect("chmod socket");
    d.ctl_as(NOBODY, NOBODY, &["status"])
        .expect_code(4, "status as uid 65534");

    let all = wait_records(&d, &[], 6).await;
    assert_eq!(all.len(), 6, "exactly our six refusals: {all:?}");
    assert_ordered(&all, "audit");
    let t1 = now_secs();
    for r in &all {
        let t = r["time"].as_i64().expect("time");
        assert!(
            t0 - 1 <= t && t <= t1 + 1,
            "time {t} outside [{t0}, {t1}]: {r}"
        );
        assert_eq!(r["throttled"], false, "{r}");
    }
    let mut got = reasons(&all);
    got.sort_unstable();
    assert_eq!(
        got,
        [
            "bad-bearer",
            "bad-bearer",
            "bad-bearer",
            "peer-not-allowed",
            "wrong-host",
            "wrong-host"
        ]
    );
    for r in &all {
        let (carrier, class) = if r["reason"] == "peer-not-allowed" {
            ("control", "unknown")
        } else {
            ("loopback", "loopback")
        };
        assert_eq!(r["carrier"], carrier, "{r}");
        assert_eq!(r["address_class"], class, "{r}");
    }

    // --reason
    let bb = audit(&d, &["--reason", "bad-bearer"]);
    assert_eq!(reasons(&bb), ["bad-bearer"; 3], "{bb:?}");
    let wh = audit(&d, &["--reason", "wrong-host"]);
    assert_eq!(reasons(&wh), ["wrong-host"; 2], "{wh:?}");
    let pn = audit(&d, &["--reason", "peer-not-allowed"]);
    assert_eq!(pn.len(), 1, "{pn:?}");
    assert!(audit(&d, &["--reason", "expired"]).is_empty());

    // --since as a duration and as unix seconds.
    assert_eq!(audit(&d, &["--since", "10m"]).len(), 6);
    let future = (now_secs() + 3600).to_string();
    assert!(audit(&d, &["--since", &future]).is_empty());
    // A record strictly after a second boundary: --since that second lists only it.
    let boundary = now_secs() + 1;
    assert!(
        poll_until(Duration::from_secs(3), Duration::from_millis(20), || {
            now_secs() >= boundary
        })
        .await
    );
    bad_bearer(&d).await;
    let later = wait_records(&d, &["--since", &boundary.to_string()], 1).await;
    assert_eq!(later.len(), 1, "--since {boundary}: {later:?}");
    assert_eq!(later[0]["reason"], "bad-bearer");
    assert!(later[0]["seq"].as_u64() > Some(max_seq(&all)), "{later:?}");
    // Filters combine.
    let both = audit(&d, &["--since", "10m", "--reason", "wrong-host"]);
    assert_eq!(both.len(), 2, "{both:?}");

    // The human table works and names the reasons.
    let table = d.ctl_ok(&["audit"]).stdout;
    for reason in ["bad-bearer", "wrong-host", "peer-not-allowed"] {
        assert!(
            table.contains(reason),
            "audit table lacks {reason}: {table}"
        );
    }
    // A bad --since is bad usage.
    d.ctl(&["audit", "--since", "yesterday-ish"])
        .expect_code(2, "audit --since with a bad value");
    d.assert_no_secrets();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn audit_survives_restart_and_a_new_daemon_on_the_same_state() {
    let state_root = tempfile::tempdir().expect("state dir");
    let state = state_root.path().join("state");
    let first: Vec<Value>;
    {
        let d = Daemon::builder().state_dir(&state).start();
        bad_bearer(&d).await;
        wrong_host(&d).await;
        first = wait_records(&d, &[], 2).await;
        assert_eq!(first.len(), 2, "{first:?}");

        // restart: a fresh attach, the same audit.
        let from = d.notify().lines().len();
        d.ctl_ok(&["restart"]);
        d.wait_ready(from);
        d.refresh_addrs();
        let after_restart = audit(&d, &[]);
        assert_eq!(
            after_restart, first,
            "records changed across restart: {after_restart:?}"
        );
        bad_bearer(&d).await;
        let now = wait_records(&d, &[], 3).await;
        assert_eq!(now.len(), 3, "{now:?}");
        assert_eq!(&now[..2], &first[..], "{now:?}");
        assert!(now[2]["seq"].as_u64() > Some(max_seq(&first)), "{now:?}");
        assert_ordered(&now, "after restart");

        d.ctl_ok(&["stop"]);
        let st = d.wait_exit(Duration::from_secs(20));
        assert!(st.is_some_and(|s| s.success()), "clean stop: {st:?}");
    }
    let d = Daemon::builder().state_dir(&state).start();
    let carried = audit(&d, &[]);
    assert_eq!(
        carried.len(),
        3,
        "a new daemon on the same state must list the old records: {carried:?}"
    );
    assert_eq!(&carried[..2], &first[..]);
    assert_eq!(
        audit(&d, &["--reason", "wrong-host"]).len(),
        1,
        "--reason over persisted records"
    );
    assert_eq!(audit(&d, &["--since", "10m"]).len(), 3);
    wrong_host(&d).await;
    let all = wait_records(&d, &[], 4).await;
    assert_eq!(all.len(), 4, "{all:?}");
    assert_ordered(&all, "after a new daemon");
    assert_eq!(all[3]["reason"], "wrong-host");
    d.assert_no_secrets();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn follow_prints_records_produced_after_it_started() {
    let d = Daemon::start("");
    bad_bearer(&d).await;
    let before = wait_records(&d, &[], 1).await;
    let baseline = max_seq(&before);

    let mut child = Command::new(mcpctl_bin())
        .arg("--socket")
        .arg(d.socket_path())
        .args(["--json", "audit", "--follow"])
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn robota-mcpctl audit --follow");
    let stdout = child.stdout.take().expect("stdout");
    let (tx, rx) = mpsc::channel::<String>();
    let reader = std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });

    // Produce a refusal on each round until one newer than the baseline is printed: at
    // least one of them is produced after `--follow` subscribed, however long that takes.
    let mut lines = Vec::new();
    let mut newer = None;
    for _ in 0..50 {
        bad_bearer(&d).await;
        let got = poll_until_blocking(
            Duration::from_millis(300),
            Duration::from_millis(10),
            || {
                while let Ok(l) = rx.try_recv() {
                    lines.push(l);
                }
                lines.iter().any(|l| {
                    serde_json::from_str::<Value>(l)
                        .ok()
                        .and_then(|v| v["seq"].as_u64())
                        .is_some_and(|s| s > baseline)
                })
            },
        );
        if got {
            newer = lines
                .iter()
                .filter_map(|l| serde_json::from_str::<Value>(l).ok())
                .find(|v| v["seq"].as_u64().is_some_and(|s| s > baseline));
            break;
        }
        assert!(
            child.try_wait().expect("try_wait").is_none(),
            "audit --follow exited early; printed {lines:?}"
        );
    }
    let still_running = child.try_wait().expect("try_wait").is_none();
    let _ = child.kill();
    let _ = child.wait();
    let _ = reader.join();
    let record = newer.unwrap_or_else(|| {
        panic!("audit --follow printed no record newer than seq {baseline} within 15 s: {lines:?}")
    });
    check_audit_record(&record, "audit --follow");
    assert_eq!(record["reason"], "bad-bearer", "{record}");
    assert_eq!(record["carrier"], "loopback", "{record}");
    assert!(
        still_running,
        "audit --follow must keep running until killed"
    );
    for l in &lines {
        let v: Value = serde_json::from_str(l)
            .unwrap_or_else(|e| panic!("--follow --json printed a non-JSON line ({e}): {l:?}"));
        check_audit_record(&v, "audit --follow");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_refusals_are_audited_and_persist() {
    let (authz, keys) = Authz::with_standard_keys();
    let state_root = tempfile::tempdir().expect("state dir");
    let state = state_root.path().join("state");
    let cfg = RemoteConfig::new(&authz);
    let expired = authz
        .token(&keys.rsa, PUBLIC_URL)
        .claim("exp", now_secs() - 3600)
        .build();
    let first;
    {
        let d = cfg.builder().state_dir(&state).start();
        d.register_secret(&expired);
        let addr = d.remote_addr();
        let resp = exchange(addr, &remote_mcp(Some(&expired), &tools_list(1))).await;
        assert_eq!(resp.status, 401, "{}", resp.describe());
        let resp = exchange(addr, &remote_mcp(None, &tools_list(1))).await;
        assert_eq!(resp.status, 401, "{}", resp.describe());
        first = wait_records(&d, &["--reason", "expired"], 1).await;
        assert_eq!(first.len(), 1, "{first:?}");
        assert_eq!(first[0]["carrier"], "remote");
        assert_eq!(
            audit(&d, &["--reason", "missing-token"]).len(),
            1,
            "missing-token"
        );
        d.ctl_ok(&["stop"]);
        assert!(d.wait_exit(Duration::from_secs(20)).is_some());
        d.assert_no_secrets();
    }
    let d = cfg.builder().state_dir(&state).start();
    d.register_secret(&expired);
    let again = audit(&d, &["--reason", "expired"]);
    assert_eq!(again, first, "remote records after a stop/start");
    let all = records_after(&audit(&d, &[]), 0);
    assert_eq!(all.len(), 2, "{all:?}");
    // Record text never holds the token.
    let text = d.ctl_ok(&["--json", "audit"]).stdout;
    robota_e2e::assert_no_secrets(&d.secrets(), &text, "audit output");
    d.assert_no_secrets();
}

/// The daemon's per-interval rate of refusals with records of their own, per carrier and
/// reason (`audit::PER_KEY`).
const PER_KEY: u64 = 20;
/// The longest line the daemon writes to stderr (`logging::MAX_LINE`).
const MAX_LINE: usize = 4096;

const GRANTS: &str = r#"
[jobs.hello]
argv = ["/bin/echo", "hello"]

[[policy]]
callers = ["bearer:*"]
tools = ["job.start"]
decision = "grant"
"#;

/// `robota_mcpd_refusals_total` for a loopback reason.
fn refusals_metric(d: &Daemon, reason: &str) -> u64 {
    let text = d.metrics_text().expect("metrics");
    robota_e2e::metric_sum(
        &text,
        &[
            "robota_mcpd_refusals_total",
            "carrier=\"loopback\"",
            &format!("reason=\"{reason}\""),
        ],
    ) as u64
}

/// The records of `audit.jsonl` as they are now.
fn file_records(d: &Daemon) -> Vec<Value> {
    std::fs::read_to_string(d.state_dir().join("audit.jsonl"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

/// A flood of bad bearers from many connections: grant records made before survive, the
/// log stays a few lines a second, the audit folds the flood into aggregates whose counts
/// add up to the metric, and `status` counts every refusal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_bad_bearers_is_folded_and_adds_up() {
    use robota_e2e::http::try_exchange;
    use robota_e2e::mcp::McpClient;
    use robota_e2e::remote::refusal_total;
    use serde_json::json;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU64, Ordering};

    let d = Daemon::builder().extra(GRANTS).start();
    let ci = McpClient::connect(&d, &d.bearer_labeled("ci")).await;
    let request = ci
        .call(
            "permissions.request_elevation",
            json!({"reason": "before the flood", "scope": ["job.start"]}),
        )
        .await
        .ok("request_elevation");
    let id = request["grant_id"].as_i64().expect("grant_id").to_string();
    d.ctl_ok(&["grants", "approve", &id]);
    ci.close().await;
    let lines_before = d.stderr_text().lines().count();

    // 32 connections at a time, for three seconds.
    let addr = d.loopback_addr();
    let sent = Arc::new(AtomicU64::new(0));
    let deadline = std::time::Instant::now() + Duration::from_secs(3);
    let workers: Vec<_> = (0..32)
        .map(|_| {
            let sent = sent.clone();
            tokio::spawn(async move {
                let req = Request::mcp(addr.port(), Some(&"0".repeat(64)), &tools_list(1));
                while std::time::Instant::now() < deadline {
                    if let Ok(resp) = try_exchange(addr, &req).await {
                        assert_eq!(resp.status, 401, "{}", resp.describe());
                        sent.fetch_add(1, Ordering::Relaxed);
                    }
                }
            })
        })
        .collect();
    for w in workers {
        w.await.expect("a flood worker panicked");
    }
    let answered = sent.load(Ordering::Relaxed);
    eprintln!("flood: {answered} refusals answered in 3 s from 32 connections");
    let flood_secs = 3 + 2;
    assert!(
        answered > 3 * flood_secs * PER_KEY,
        "the flood must exceed the rate to test it: {answered} refusals"
    );

    // Every refusal is counted; the audit's records add up to the same number once the
    // last interval has closed (within about a second).
    let total = refusals_metric(&d, "bad-bearer");
    assert!(total >= answered, "{total} counted, {answered} answered");
    let mut records = Vec::new();
    let settled = poll_until(Duration::from_secs(10), Duration::from_millis(100), || {
        records = audit(&d, &["--reason", "bad-bearer"]);
        refusal_total(&records) == total
    })
    .await;
    assert!(
        settled,
        "audit records stand for {} refusals, the metric says {total}",
        refusal_total(&records)
    );
    let aggregates: Vec<&Value> = records
        .iter()
        .filter(|r| r.get("count").is_some())
        .collect();
    assert!(
        !aggregates.is_empty(),
        "no aggregate after {total} refusals"
    );
    // Bounded: at most the rate per second plus one aggregate per second.
    let bound = (flood_secs * (PER_KEY + 1)) as usize;
    assert!(
        records.len() <= bound,
        "{} records for {total} refusals",
        records.len()
    );

    // `status` counts from counters, equal to the metric.
    let st = d.status();
    assert_eq!(
        st.refusals_last_hour.get("bad-bearer").copied(),
        Some(total),
        "{:?}",
        st.refusals_last_hour
    );

    // The grant's request and approval are still there.
    let all = d.ctl_ok(&["--json", "audit"]).stdout;
    let events: Vec<Value> = all
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).expect("audit JSON line"))
        .filter(|r| r.get("grant").is_some())
        .collect();
    let reasons: Vec<&str> = events.iter().filter_map(|r| r["reason"].as_str()).collect();
    assert_eq!(reasons, ["grant-requested", "grant-approved"]);

    // The file holds the same bounded, honest account.
    let mut file = Vec::new();
    let persisted = poll_until(Duration::from_secs(10), Duration::from_millis(100), || {
        file = file_records(&d);
        let bad: Vec<Value> = file
            .iter()
            .filter(|r| r["reason"] == "bad-bearer")
            .cloned()
            .collect();
        refusal_total(&bad) == total
    })
    .await;
    assert!(persisted, "audit.jsonl does not add up to {total}");
    assert!(
        file.len() <= bound + 8,
        "{} lines in audit.jsonl",
        file.len()
    );
    assert!(
        file.iter().any(|r| r["reason"] == "grant-approved"),
        "the approval is persisted"
    );

    // The log: a bounded number of lines, each refusal past the rate summarised.
    let stderr = d.stderr_text();
    let new: Vec<&str> = stderr.lines().skip(lines_before).collect();
    let refused = new.iter().filter(|l| l.contains("request refused")).count();
    let summaries: Vec<&&str> = new
        .iter()
        .filter(|l| l.contains("refusals past the rate"))
        .collect();
    eprintln!(
        "flood: {total} refusals, {} audit records ({} aggregates), {} lines in audit.jsonl, {} log lines ({refused} refusal lines, {} summaries)",
        records.len(),
        aggregates.len(),
        file.len(),
        new.len(),
        summaries.len()
    );
    assert!(
        new.len() <= bound + 50,
        "{} log lines for {total} refusals",
        new.len()
    );
    assert!(
        refused as u64 <= flood_secs * PER_KEY,
        "{refused} refusal lines"
    );
    assert!(!summaries.is_empty());
    let summed: u64 = summaries
        .iter()
        .filter_map(|l| {
            l.split("count=")
                .nth(1)?
                .split(' ')
                .next()?
                .parse::<u64>()
                .ok()
        })
        .sum();
    assert_eq!(
        summed + refused as u64,
        total,
        "log lines and summaries account for every refusal"
    );
    assert!(
        summaries
            .iter()
            .all(|l| l.contains("interval=1s") && l.contains("reason=bad-bearer")),
        "{summaries:?}"
    );
    d.assert_no_secrets();
}

/// rmcp logs an unknown method's name; a request with a method of about 1 MiB leaves no
/// line over the cap, and the whole log stays small.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_huge_method_name_leaves_no_log_line_over_the_cap() {
    use serde_json::json;
    let d = Daemon::start("[limits]\nrequest_body = \"2MiB\"\n");
    let bearer = d.bearer();
    let addr = d.loopback_addr();
    let before = d.stderr_text().len();
    let method = format!("x/{}", "\u{202e}m\n".repeat(300_000));
    for id in 1..=3 {
        let message = json!({"jsonrpc": "2.0", "id": id, "method": method, "params": {}});
        let resp = exchange(addr, &Request::mcp(addr.port(), Some(&bearer), &message)).await;
        assert!(resp.status < 500, "{}", resp.describe());
        // Also as the request id.
        let message = json!({"jsonrpc": "2.0", "id": method, "method": "nope"});
        let resp = exchange(addr, &Request::mcp(addr.port(), Some(&bearer), &message)).await;
        assert!(resp.status < 500, "{}", resp.describe());
    }
    d.ctl_ok(&["status"]);
    let stderr = d.stderr_text();
    let written = &stderr[before..];
    for line in stderr.lines() {
        assert!(line.len() < MAX_LINE, "a log line of {} bytes", line.len());
    }
    assert!(
        written.len() < 64 * 1024,
        "{} bytes of log for six requests",
        written.len()
    );
}
