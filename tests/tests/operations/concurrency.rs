//! Concurrency: 64 callers mixing valid calls, refusals, cancellations (of turns and of
//! jobs) while `robota-mcpctl restart` runs four times — no panic, no stuck request, no
//! lost audit record, and the counters (audit, metrics, `status`) add up.
//!
//! Every refusal here is one the test caused, so the audit can be matched per reason: a
//! refusal that was answered is certainly recorded; one whose connection broke (a restart
//! cutting it) may or may not be, which bounds the count from above.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use robota_e2e::http::{
    Request, Response, cancelled, tool_error_code, tools_call, tools_list, try_exchange,
};
use robota_e2e::remote::{audit, refusal_total};
use robota_e2e::{Daemon, metric_sum, procs, within};
use serde_json::{Value, json};

const CALLERS: usize = 64;
const ROUNDS: usize = 30;
const RESTARTS: u64 = 4;

/// Bound on one request of the storm; past it the request counts as stuck.
const REQUEST_LIMIT: Duration = Duration::from_secs(20);

const CONFIG: &str = r#"
[session.turn]
argv = ["/bin/sh", "-c", "sleep 2; echo turned"]
timeout = "30s"

[jobs.slow]
argv = ["/bin/sleep", "30"]
timeout = "5m"

[tools]
max_running_jobs = 256

[[policy]]
callers = ["bearer:*"]
tools = ["agent_submit", "job.start"]
decision = "allow"
"#;

/// The refusals the storm causes on purpose, with the status each must get.
const REFUSALS: [(&str, u16); 5] = [
    ("missing-token", 401),
    ("bad-bearer", 401),
    ("wrong-host", 403),
    ("wrong-origin", 403),
    ("wrong-path", 403),
];

/// Where the daemon is and which bearer is live, as the restarter last published it.
#[derive(Clone)]
struct View {
    addr: SocketAddr,
    bearer: String,
    generation: u64,
}

/// What the storm saw.
#[derive(Default, Debug)]
struct Tally {
    /// Connections reset outside a restart: only a full listener may do that (it resets
    /// what it refuses past its bound on refusals answered); checked against its counter.
    reset_outside_restart: u64,
    /// Refusals answered with their status, by reason.
    refused: BTreeMap<&'static str, u64>,
    /// Requests bound for a refusal whose connection broke first, by reason.
    refused_unanswered: BTreeMap<&'static str, u64>,
    /// Answers that prove admission (200, 202, 503 and the like).
    admitted: u64,
    /// Requests bound for admission whose connection broke first.
    admitted_unanswered: u64,
    /// Outcomes by kind, for the record.
    outcomes: BTreeMap<String, u64>,
    /// Answers no documented behaviour explains.
    unexpected: Vec<String>,
    /// Requests with no answer and no connection error within [`REQUEST_LIMIT`].
    stuck: Vec<String>,
    /// Requests in flight during a restart that got an HTTP 500 instead of their answer
    /// or a connection error.
    restart_500: Vec<String>,
    /// Jobs started, and those whose cancel was answered.
    jobs_started: Vec<i64>,
    jobs_cancelled: Vec<i64>,
    slowest: Duration,
}

struct Storm {
    view: RwLock<View>,
    restarting: AtomicBool,
    /// When the last restart was answered.
    restarted_at: Mutex<Option<Instant>>,
    /// Until when the daemon asked callers to stay away: the `Retry-After` of the latest 503.
    busy_until: Mutex<Option<Instant>>,
    /// The metrics listener (the active-turns gauge).
    metrics: std::net::SocketAddr,
    next_id: AtomicI64,
    ops_done: AtomicU64,
    tally: Mutex<Tally>,
}

impl Storm {
    fn view(&self) -> View {
        self.view.read().expect("view").clone()
    }

    fn id(&self) -> i64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    fn note(&self, what: impl Into<String>) {
        *self
            .tally
            .lock()
            .expect("tally")
            .outcomes
            .entry(what.into())
            .or_default() += 1;
    }

    /// Before a retry: waits out the `Retry-After` of the latest 503, if it has not passed.
    async fn as_told(&self) {
        let until = *self.busy_until.lock().expect("busy_until");
        if let Some(until) = until {
            tokio::time::sleep_until(until.into()).await;
        }
    }

    /// Whether the daemon runs a turn now (its `robota_mcpd_active_turns` gauge).
    async fn turn_running(&self) -> bool {
        let req = Request::new("GET", "/metrics").header("Host", &self.metrics.to_string());
        match tokio::time::timeout(REQUEST_LIMIT, try_exchange(self.metrics, &req)).await {
            Ok(Ok(resp)) => {
                robota_e2e::metric_sum(
                    &String::from_utf8_lossy(&resp.body),
                    &["robota_mcpd_active_turns "],
                ) >= 1.0
            }
            _ => false,
        }
    }

    /// Was the bearer of `view` possibly invalidated by a restart since it was read?
    fn maybe_stale(&self, view: &View) -> bool {
        self.restarting.load(Ordering::SeqCst) || self.view().generation != view.generation
    }

    /// Connections that queued on the kept listening socket while a restart switched
    /// carriers are accepted together once the new carrier serves; past its connection
    /// cap they are refused (a 503, or a reset past the bound on refusals answered), for a
    /// moment after the restart has been answered.
    fn just_restarted(&self) -> bool {
        self.restarted_at
            .lock()
            .expect("restarted_at")
            .is_some_and(|at| at.elapsed() < Duration::from_secs(2))
    }

    /// One bounded exchange as `v` saw the daemon: the response, or `None` after a
    /// connection error (only a restart may cause one; then wait for it to end, as a
    /// client reconnecting would). Timeouts are recorded as stuck.
    async fn send(&self, v: &View, req: &Request, what: &str) -> Option<Response> {
        let started = Instant::now();
        // A connection made while a restart was under way or just after it can be cut
        // by that restart later than the window, when the machine is slow.
        let near_restart = self.restarting.load(Ordering::SeqCst) || self.just_restarted();
        let out = tokio::time::timeout(REQUEST_LIMIT, try_exchange(v.addr, req)).await;
        let took = started.elapsed();
        let stale = self.maybe_stale(v) || near_restart;
        {
            let mut t = self.tally.lock().expect("tally");
            t.slowest = t.slowest.max(took);
            match out {
                Ok(Ok(resp)) => return Some(resp),
                Ok(Err(e)) if e.kind() != std::io::ErrorKind::TimedOut => {
                    let how = if e.kind() == std::io::ErrorKind::ConnectionRefused {
                        "connection refused (old port)"
                    } else {
                        "connection cut"
                    };
                    *t.outcomes.entry(format!("{what}: {how}")).or_default() += 1;
                    if stale || self.just_restarted() {
                    } else if e.kind() == std::io::ErrorKind::ConnectionReset {
                        t.reset_outside_restart += 1;
                    } else {
                        t.unexpected
                            .push(format!("{what}: connection error outside a restart: {e}"));
                    }
                }
                Ok(Err(e)) => t.stuck.push(format!("{what}: {e} after {took:?}")),
                Err(_) => t
                    .stuck
                    .push(format!("{what}: no answer within {REQUEST_LIMIT:?}")),
            }
        }
        robota_e2e::poll_until(REQUEST_LIMIT, Duration::from_millis(10), || {
            !self.restarting.load(Ordering::SeqCst)
        })
        .await;
        None
    }

    /// A request meant to be refused for `reason`.
    async fn refusal(&self, reason: &'static str) {
        let v = self.view();
        let port = v.addr.port();
        let base = Request::mcp(port, Some(&v.bearer), &tools_list(self.id()));
        let (req, status) = match reason {
            "missing-token" => (base.without("Authorization"), 401),
            "bad-bearer" => (
                base.set_header("Authorization", &format!("Bearer {}", "0".repeat(64))),
                401,
            ),
            "wrong-host" => (base.set_header("Host", "evil.example"), 403),
            "wrong-origin" => (base.header("Origin", "http://evil.example"), 403),
            "wrong-path" => (base.target("/not-mcp"), 403),
            other => panic!("no refusal {other}"),
        };
        let Some(resp) = self.send(&v, &req, reason).await else {
            *self
                .tally
                .lock()
                .expect("tally")
                .refused_unanswered
                .entry(reason)
                .or_default() += 1;
            return;
        };
        let mut t = self.tally.lock().expect("tally");
        if resp.status == 503 && resp.header("retry-after").is_some() {
            // Every connection slot was taken (the burst queued on the listening socket
            // while a restart switched carriers): the listener's own answer, before any
            // admission, so no refusal is booked for it.
            *t.refused_unanswered.entry(reason).or_default() += 1;
            *t.outcomes
                .entry(format!("{reason}: 503 (listener full)"))
                .or_default() += 1;
        } else if resp.status == status && resp.body.is_empty() {
            *t.refused.entry(reason).or_default() += 1;
            *t.outcomes.entry(format!("{reason}: {status}")).or_default() += 1;
        } else {
            t.unexpected.push(format!(
                "{reason}: expected {status}, got {}",
                resp.describe()
            ));
        }
    }

    /// A request meant to be admitted, as `view`'s bearer; the JSON-RPC response with
    /// `id` when it was answered 200. Refusals of a bearer a restart invalidated are
    /// counted as `bad-bearer`.
    async fn admitted(
        &self,
        v: &View,
        message: &Value,
        id: Option<i64>,
        what: &str,
    ) -> Option<Response> {
        let req = Request::mcp(v.addr.port(), Some(&v.bearer), message);
        let Some(resp) = self.send(v, &req, what).await else {
            self.tally.lock().expect("tally").admitted_unanswered += 1;
            return None;
        };
        let stale = self.maybe_stale(v);
        let mut t = self.tally.lock().expect("tally");
        match resp.status {
            200 if id.is_none_or(|id| resp.rpc(id).is_some()) => {
                t.admitted += 1;
                return Some(resp);
            }
            202 if id.is_none() => {
                t.admitted += 1;
                *t.outcomes.entry(format!("{what}: 202")).or_default() += 1;
                return Some(resp);
            }
            503 if resp.header("retry-after").is_some() => {
                let secs: u64 = resp
                    .header("retry-after")
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(1);
                *self.busy_until.lock().expect("busy_until") =
                    Some(Instant::now() + Duration::from_secs(secs));
                t.admitted += 1;
                *t.outcomes.entry(format!("{what}: 503")).or_default() += 1;
            }
            401 if stale && resp.body.is_empty() => {
                *t.refused.entry("bad-bearer").or_default() += 1;
                *t.outcomes
                    .entry(format!("{what}: 401 (bearer of a restarted attach)"))
                    .or_default() += 1;
            }
            500 if stale => {
                t.admitted += 1;
                t.restart_500.push(format!("{what}: {}", resp.describe()));
            }
            _ => t.unexpected.push(format!(
                "{what} (restart in progress: {stale}): {}",
                resp.describe()
            )),
        }
        None
    }

    /// A tool call that must succeed when answered; its result.
    async fn call(&self, v: &View, tool: &str, args: Value) -> Option<Value> {
        let id = self.id();
        let resp = self
            .admitted(v, &tools_call(id, tool, args), Some(id), tool)
            .await?;
        let rpc = resp.expect_rpc(id);
        match tool_error_code(&rpc) {
            None => {
                self.note(format!("{tool}: ok"));
                Some(rpc)
            }
            Some(code) => {
                self.tally
                    .lock()
                    .expect("tally")
                    .unexpected
                    .push(format!("{tool}: tool error {code}: {rpc}"));
                None
            }
        }
    }

    async fn valid_info(&self) {
        let v = self.view();
        if let Some(rpc) = self.call(&v, "system.info", json!({})).await {
            let ok = rpc.pointer("/result/structuredContent").is_some();
            if !ok {
                self.tally
                    .lock()
                    .expect("tally")
                    .unexpected
                    .push(format!("system.info without a structured result: {rpc}"));
            }
        }
    }

    async fn valid_list(&self) {
        let v = self.view();
        let id = self.id();
        if let Some(resp) = self
            .admitted(&v, &tools_list(id), Some(id), "tools/list")
            .await
        {
            let rpc = resp.expect_rpc(id);
            let listed = rpc
                .pointer("/result/tools")
                .and_then(Value::as_array)
                .is_some_and(|t| t.iter().any(|t| t["name"] == "system.info"));
            if listed {
                self.note("tools/list: ok");
            } else {
                self.tally
                    .lock()
                    .expect("tally")
                    .unexpected
                    .push(format!("tools/list: {rpc}"));
            }
        }
    }

    /// Submit a turn, and cancel it by `notifications/cancelled` while it runs.
    async fn turn_then_cancel(self: &Arc<Self>) {
        let v = self.view();
        let id = self.id();
        let storm = self.clone();
        let submit_view = v.clone();
        let submit = tokio::spawn(async move {
            let message = tools_call(id, "agent_submit", json!({"prompt": "storm"}));
            storm
                .admitted(&submit_view, &message, Some(id), "agent_submit")
                .await
        });
        // Cancel once the daemon runs a turn (ours, or another caller's that makes ours
        // busy) or the submission has been answered.
        robota_e2e::poll_until_async(REQUEST_LIMIT, Duration::from_millis(10), || async {
            submit.is_finished() || self.turn_running().await
        })
        .await;
        self.admitted(&v, &cancelled(id), None, "notifications/cancelled")
            .await;
        let Ok(resp) = within(REQUEST_LIMIT * 2, "a submission", submit).await else {
            panic!("the submission task panicked");
        };
        let Some(resp) = resp else { return };
        let rpc = resp.expect_rpc(id);
        match tool_error_code(&rpc).as_deref() {
            None if rpc.to_string().contains("turned") => self.note("agent_submit: ok"),
            Some(code @ ("cancelled" | "busy")) => self.note(format!("agent_submit: {code}")),
            other => self
                .tally
                .lock()
                .expect("tally")
                .unexpected
                .push(format!("agent_submit: {other:?}: {rpc}")),
        }
    }

    /// Start a slow job and cancel it (retrying the cancel across restarts).
    async fn job_then_cancel(&self) {
        let v = self.view();
        let Some(rpc) = self
            .call(&v, "job.start", json!({"template": "slow"}))
            .await
        else {
            return;
        };
        let Some(job_id) = rpc
            .pointer("/result/structuredContent/job_id")
            .and_then(Value::as_i64)
        else {
            self.tally
                .lock()
                .expect("tally")
                .unexpected
                .push(format!("job.start without a job_id: {rpc}"));
            return;
        };
        self.tally.lock().expect("tally").jobs_started.push(job_id);
        for _ in 0..5 {
            let v = self.view();
            if self
                .call(&v, "job.cancel", json!({"job_id": job_id}))
                .await
                .is_some()
            {
                self.tally
                    .lock()
                    .expect("tally")
                    .jobs_cancelled
                    .push(job_id);
                return;
            }
            self.as_told().await;
        }
    }
}

/// Runs a blocking harness call (robota-mcpctl) off the async workers.
async fn blocking<T: Send + 'static>(
    d: &Arc<Daemon>,
    f: impl FnOnce(&Daemon) -> T + Send + 'static,
) -> T {
    let d = d.clone();
    within(
        Duration::from_secs(60),
        "robota-mcpctl",
        tokio::task::spawn_blocking(move || f(&d)),
    )
    .await
    .expect("blocking task")
}

/// Restart `RESTARTS` times, spread over the storm; after each, publish the new address
/// and bearer and check that the new bearer works and the old ones are refused.
async fn restarter(d: Arc<Daemon>, storm: Arc<Storm>, total_ops: u64) {
    for k in 0..RESTARTS {
        let due = total_ops * (k + 1) / (RESTARTS + 1);
        robota_e2e::poll_until(Duration::from_secs(30), Duration::from_millis(10), || {
            storm.ops_done.load(Ordering::Relaxed) >= due
        })
        .await;
        let label = format!("storm{k}");
        let extra = blocking(&d, move |d| d.bearer_labeled(&label)).await;
        let old = storm.view();

        storm.restarting.store(true, Ordering::SeqCst);
        let out = blocking(&d, |d| d.ctl(&["restart"])).await;
        out.expect_code(0, "robota-mcpctl restart during the storm");
        let (st, bearer) = blocking(&d, |d| (d.refresh_addrs(), d.bearer())).await;
        assert_eq!(st.generation, k + 1, "generation after restart {k}");
        let addr = d.loopback_addr();
        *storm.view.write().expect("view") = View {
            addr,
            bearer: bearer.clone(),
            generation: k + 1,
        };
        *storm.restarted_at.lock().expect("restarted_at") = Some(Instant::now());
        storm.restarting.store(false, Ordering::SeqCst);

        // The new bearer works (retrying while the in-flight slots are all taken).
        let new = storm.view();
        let mut served = false;
        for _ in 0..50 {
            let id = storm.id();
            if let Some(resp) = storm
                .admitted(&new, &tools_list(id), Some(id), "new bearer after restart")
                .await
            {
                assert!(resp.expect_rpc(id).get("result").is_some());
                served = true;
                break;
            }
            storm.as_told().await;
        }
        assert!(
            served,
            "the bearer minted after restart {k} was never served"
        );
        // Every bearer of the old attach is refused: the host bearer and an extra one.
        for (which, secret) in [("host", &old.bearer), ("extra", &extra)] {
            let req = Request::mcp(addr.port(), Some(secret), &tools_list(storm.id()));
            let resp = storm
                .send(&new, &req, "old bearer after restart")
                .await
                .unwrap_or_else(|| {
                    panic!("the old {which} bearer got no answer after restart {k}")
                });
            resp.assert_empty_refusal(401, &format!("the old {which} bearer after restart {k}"));
            *storm
                .tally
                .lock()
                .expect("tally")
                .refused
                .entry("bad-bearer")
                .or_default() += 1;
        }
    }
}

async fn caller(storm: Arc<Storm>, index: usize) {
    for round in 0..ROUNDS {
        match index % 8 {
            0..=2 => storm.valid_info().await,
            3 | 4 => {
                storm
                    .refusal(REFUSALS[(index + round) % REFUSALS.len()].0)
                    .await
            }
            5 => storm.turn_then_cancel().await,
            6 => storm.job_then_cancel().await,
            _ => storm.valid_list().await,
        }
        storm.ops_done.fetch_add(1, Ordering::Relaxed);
    }
}

/// `--json jobs list`: (job_id, state) of every job.
fn job_states(d: &Daemon) -> BTreeMap<i64, String> {
    let out = d.ctl_ok(&["--json", "jobs", "list", "--limit", "1000"]);
    let v: Value = serde_json::from_str(&out.stdout).expect("jobs list JSON");
    v["jobs"]
        .as_array()
        .expect("jobs array")
        .iter()
        .map(|j| {
            (
                j["job_id"].as_i64().expect("job_id"),
                j["state"].as_str().expect("state").to_owned(),
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn callers_refusals_cancellations_and_restarts_add_up() {
    let d = Arc::new(Daemon::start(CONFIG));
    let started = Instant::now();
    let storm = Arc::new(Storm {
        view: RwLock::new(View {
            addr: d.loopback_addr(),
            bearer: d.bearer(),
            generation: 0,
        }),
        restarting: AtomicBool::new(false),
        restarted_at: Mutex::new(None),
        busy_until: Mutex::new(None),
        metrics: d.metrics_addr(),
        next_id: AtomicI64::new(1),
        ops_done: AtomicU64::new(0),
        tally: Mutex::new(Tally::default()),
    });

    let total = (CALLERS * ROUNDS) as u64;
    let restarts = tokio::spawn(restarter(d.clone(), storm.clone(), total));
    let callers: Vec<_> = (0..CALLERS)
        .map(|i| tokio::spawn(caller(storm.clone(), i)))
        .collect();
    for c in callers {
        within(Duration::from_secs(120), "a caller", c)
            .await
            .expect("a caller panicked");
    }
    within(Duration::from_secs(120), "the restarts", restarts)
        .await
        .expect("the restarter panicked");
    let storm_took = started.elapsed();

    // Jobs whose cancel was lost with a connection are cancelled by the operator, so
    // nothing outlives the test; then every job of the storm has ended.
    for (id, state) in blocking(&d, job_states).await {
        if state == "running" {
            blocking(&d, move |d| d.ctl_ok(&["jobs", "cancel", &id.to_string()])).await;
        }
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    let states = loop {
        let states = blocking(&d, job_states).await;
        if states.values().all(|s| s != "running") || Instant::now() >= deadline {
            break states;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let ended = states.values().all(|s| s != "running");
    assert!(ended, "jobs still running after their cancel: {states:?}");

    let tally = std::mem::take(&mut *storm.tally.lock().expect("tally"));
    eprintln!(
        "storm of {total} operations and {RESTARTS} restarts took {storm_took:?} (slowest request {:?}); outcomes: {:#?}; refused {:?}, unanswered refusals {:?}, admitted {} (+{} unanswered), jobs {} started / {} cancelled",
        tally.slowest,
        tally.outcomes,
        tally.refused,
        tally.refused_unanswered,
        tally.admitted,
        tally.admitted_unanswered,
        tally.jobs_started.len(),
        tally.jobs_cancelled.len()
    );

    // No stuck request, nothing unexplained, no panic.
    assert!(tally.stuck.is_empty(), "stuck requests: {:#?}", tally.stuck);
    assert!(
        tally.unexpected.is_empty(),
        "unexpected answers: {:#?}",
        tally.unexpected
    );
    let stderr = d.stderr_text();
    assert!(
        !stderr.contains("panicked"),
        "the daemon panicked:\n{stderr}"
    );
    for id in &tally.jobs_cancelled {
        assert_eq!(
            states.get(id).map(String::as_str),
            Some("cancelled"),
            "job {id} was cancelled by its owner"
        );
    }

    // Still serving, with the last bearer.
    let v = storm.view();
    let resp = try_exchange(
        v.addr,
        &Request::mcp(v.addr.port(), Some(&v.bearer), &tools_list(1)),
    )
    .await
    .expect("a request after the storm");
    assert_eq!(resp.status, 200, "{}", resp.describe());
    let st = blocking(&d, |d| d.status()).await;
    assert_eq!(st.state, "serving");
    assert_eq!(st.generation, RESTARTS);

    // No lost audit record: per reason, at least every answered refusal, at most those
    // plus the ones whose connection broke; and metrics and status agree exactly.
    // Refusals past the rate are folded into their one-second interval's aggregate, which
    // becomes a record once that interval has ended: wait until the records hold every
    // refusal the metrics counted.
    let metrics = d.metrics_text().expect("metrics");
    let counted = metric_sum(
        &metrics,
        &["robota_mcpd_refusals_total", "carrier=\"loopback\""],
    ) as u64;
    let settled =
        robota_e2e::poll_until_async(Duration::from_secs(10), Duration::from_millis(100), || {
            let d = d.clone();
            async move { refusal_total(&blocking(&d, |d| audit(d, &[])).await) >= counted }
        })
        .await;
    assert!(
        settled,
        "the audit records never added up to the {counted} refusals counted"
    );
    let mut audited_total = 0;
    for (reason, _) in REFUSALS {
        let records = blocking(&d, move |d| audit(d, &["--reason", reason])).await;
        assert!(
            records.len() < 1000,
            "{reason}: the audit listing is capped at 1000"
        );
        // Past the rate, refusals are folded into aggregates that carry their count.
        let n = refusal_total(&records);
        for r in &records {
            assert_eq!(r["carrier"], "loopback", "{r}");
            assert_eq!(r["address_class"], "loopback", "{r}");
            assert_eq!(r["throttled"], false, "{r}");
        }
        let answered = tally.refused.get(reason).copied().unwrap_or(0);
        let unanswered = tally.refused_unanswered.get(reason).copied().unwrap_or(0);
        assert!(
            answered <= n && n <= answered + unanswered,
            "{reason}: {n} audit records for {answered} answered refusals (+{unanswered} cut off)"
        );
        assert!(answered > 0, "{reason}: the storm caused no such refusal");
        let counted = metric_sum(
            &metrics,
            &[
                "robota_mcpd_refusals_total",
                "carrier=\"loopback\"",
                &format!("reason=\"{reason}\""),
            ],
        );
        assert_eq!(counted, n as f64, "{reason}: metrics vs audit");
        assert_eq!(
            st.refusals_last_hour.get(reason).copied().unwrap_or(0),
            n,
            "{reason}: status refusals_last_hour vs audit: {:?}",
            st.refusals_last_hour
        );
        audited_total += n;
    }
    let all = blocking(&d, |d| audit(d, &[])).await;
    assert_eq!(
        refusal_total(&all),
        audited_total,
        "records other than the storm's refusals"
    );
    assert_eq!(
        st.refusals_last_hour.values().sum::<u64>(),
        audited_total,
        "{:?}",
        st.refusals_last_hour
    );
    let lo = st
        .carriers
        .iter()
        .find(|c| c.name == "loopback")
        .expect("loopback carrier");
    assert_eq!(
        lo.refused,
        Some(audited_total),
        "status loopback refused count"
    );

    // Admitted: at least every answer that proves admission (the storm's, and the one
    // request after it), at most those plus the admission-bound requests cut off.
    let admitted = metric_sum(
        &metrics,
        &[
            "robota_mcpd_admitted_requests_total",
            "carrier=\"loopback\"",
        ],
    ) as u64;
    // A 503 with Retry-After is an in-flight (admitted) refusal or, when every
    // connection slot was taken, the listener's own (not admitted, counted as a refused
    // connection).
    let answered = tally.admitted + 1;
    let full = metric_sum(
        &metrics,
        &[
            "robota_mcpd_connections_total",
            "listener=\"loopback\"",
            "outcome=\"refused\"",
        ],
    ) as u64;
    // A connection evicted to make room for a newcomer (the table is full: the storm's 64
    // callers also open a second connection to cancel) is reset if its request was on its
    // way: eviction takes only connections whose bytes were all read, but the peer may be
    // sending at that moment.
    let evicted = metric_sum(
        &metrics,
        &[
            "robota_mcpd_connections_total",
            "listener=\"loopback\"",
            "outcome=\"evicted\"",
        ],
    ) as u64;
    assert!(
        tally.reset_outside_restart <= full + evicted,
        "{} connections reset outside a restart, but the listener refused only {full} and evicted {evicted}",
        tally.reset_outside_restart
    );
    assert!(
        answered <= admitted + full && admitted <= answered + tally.admitted_unanswered,
        "admitted counter {admitted} vs {answered} admitted answers (+{} cut off, {full} refused by a full listener)",
        tally.admitted_unanswered
    );
    assert_eq!(
        lo.admitted,
        Some(admitted),
        "status vs metrics admitted count"
    );

    // A request in flight during a restart gets its answer or a connection error.
    assert!(
        tally.restart_500.is_empty(),
        "requests in flight during a restart were answered 500 instead of their answer or a connection error: {:#?}",
        tally.restart_500
    );
    d.assert_no_secrets();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_in_flight_during_restart_gets_its_answer_or_a_connection_error() {
    let d = Arc::new(Daemon::start(
        r#"
[session.turn]
argv = ["/bin/sh", "-c", "echo $$ > @DIR@/turn.pid.tmp && mv @DIR@/turn.pid.tmp @DIR@/turn.pid; sleep 1; echo turned"]
timeout = "30s"

[[policy]]
callers = ["bearer:*"]
tools = ["agent_submit"]
decision = "allow"
"#,
    ));
    let addr = d.loopback_addr();
    let bearer = d.bearer();
    let req = Request::mcp(
        addr.port(),
        Some(&bearer),
        &tools_call(7, "agent_submit", json!({"prompt": "in flight"})),
    );
    let call = tokio::spawn(async move { try_exchange(addr, &req).await });
    procs::wait_pid_file(&d.dir().join("turn.pid"), Duration::from_secs(15))
        .await
        .expect("the turn never started");

    // The turn (1 s) is running: restart now, well within the drain grace.
    let restart = blocking(&d, |d| d.ctl(&["restart"])).await;
    restart.expect_code(0, "robota-mcpctl restart with a request in flight");
    let outcome = within(Duration::from_secs(20), "the in-flight request", call)
        .await
        .expect("join");
    match outcome {
        Ok(resp) => {
            assert_eq!(
                resp.status,
                200,
                "a request in flight during a restart must get its answer or a connection error, not {}",
                resp.describe()
            );
            let rpc = resp.expect_rpc(7);
            assert_eq!(tool_error_code(&rpc), None, "{rpc}");
            assert!(rpc.to_string().contains("turned"), "{rpc}");
        }
        Err(e) => assert_ne!(
            e.kind(),
            std::io::ErrorKind::TimedOut,
            "the in-flight request hung across the restart: {e}"
        ),
    }
    // And the restarted daemon serves its new bearer.
    d.refresh_addrs();
    let addr = d.loopback_addr();
    let bearer = d.bearer();
    let resp = try_exchange(
        addr,
        &Request::mcp(addr.port(), Some(&bearer), &tools_list(8)),
    )
    .await
    .expect("after the restart");
    assert_eq!(resp.status, 200, "{}", resp.describe());
    d.assert_no_secrets();
}
