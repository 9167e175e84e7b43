//! Prometheus metrics: one registry, label values only from closed sets.

use std::sync::Arc;
use std::time::Duration;

use prometheus::{
    Encoder, Histogram, HistogramOpts, HistogramVec, IntCounterVec, IntGauge, IntGaugeVec, Opts,
    Registry, TextEncoder,
};

use crate::vocab::ToolErrorCode;
use crate::vocab::{
    CancelOutcome, ConnOutcome, Duplicate, FetchOutcome, Listener, RefreshTrigger, Rejection,
};
use crate::vocab::{Carrier, GrantEvent, Reason};
use crate::vocab::{IntrospectionOutcome, JobKind, JobState, StatePart};

/// Metric handles; cheap to clone.
#[derive(Clone)]
pub struct Metrics(Arc<Inner>);

struct Inner {
    registry: Registry,
    refusals: IntCounterVec,
    admitted: IntCounterVec,
    tool_calls: IntCounterVec,
    tool_duration: HistogramVec,
    policy_denials: IntCounterVec,
    active_turns: IntGauge,
    throttled: IntCounterVec,
    jwks_fetches: IntCounterVec,
    introspections: IntCounterVec,
    jwks_refresh_failures: IntCounterVec,
    jwks_last_success: IntGauge,
    jobs_started: IntCounterVec,
    jobs_finished: IntCounterVec,
    jobs_running: IntGauge,
    grant_events: IntCounterVec,
    audit_unpersisted: IntGauge,
    state_write_failures: IntCounterVec,
    connections: IntCounterVec,
    connections_open: IntGaugeVec,
    rejections: IntCounterVec,
    duplicates: IntCounterVec,
    cancellations: IntCounterVec,
    jobs_recovered: IntGauge,
    upstream_up: IntGaugeVec,
    upstream_restarts: IntCounterVec,
    upstream_tools: IntGaugeVec,
    upstream_drift: IntGaugeVec,
    /// Tool label values given out so far (bounded: imported names come and go).
    tool_labels: parking_lot::Mutex<std::collections::HashSet<String>>,
}

/// Distinct `tool` label values at most; later new names count as [`OTHER_TOOL_LABEL`].
pub const MAX_TOOL_LABELS: usize = 4096;
/// The `tool` label of calls past [`MAX_TOOL_LABELS`] distinct names.
pub const OTHER_TOOL_LABEL: &str = "(other)";

/// Decrements the open-connections gauge when dropped.
pub struct OpenConnection(IntGauge);

impl Drop for OpenConnection {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// Decrements the active-turns gauge when dropped.
pub struct ActiveTurn(IntGauge);

impl Drop for ActiveTurn {
    fn drop(&mut self) {
        self.0.dec();
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let registry =
            Registry::new_custom(Some("robota_mcpd".into()), None).expect("valid registry prefix");
        let counter = |name: &str, help: &str, labels: &[&str]| {
            let c = IntCounterVec::new(Opts::new(name, help), labels).expect("valid counter");
            registry
                .register(Box::new(c.clone()))
                .expect("unique counter");
            c
        };
        let refusals = counter(
            "refusals_total",
            "Requests refused at admission, by carrier and reason.",
            &["carrier", "reason"],
        );
        let admitted = counter(
            "admitted_requests_total",
            "Requests admitted, by carrier.",
            &["carrier"],
        );
        let tool_calls = counter(
            "tool_calls_total",
            "Tool calls by canonical tool and outcome (ok or a tool error code).",
            &["tool", "outcome"],
        );
        let policy_denials = counter(
            "policy_denials_total",
            "Calls the permission wrapper refused, by canonical tool and code.",
            &["tool", "code"],
        );
        let throttled = counter(
            "throttled_total",
            "Refusals answered 429 because the client address failed too often, by carrier.",
            &["carrier"],
        );
        let jwks_fetches = counter(
            "jwks_fetches_total",
            "Key-set and discovery fetches by outcome (ok, error, rejected).",
            &["outcome"],
        );
        let introspections = counter(
            "introspection_requests_total",
            "Token introspection requests to the issuer by outcome (active, inactive, error).",
            &["outcome"],
        );
        let jwks_refresh_failures = counter(
            "jwks_refresh_failures_total",
            "Key-set refreshes that failed (the previous set stays in use), by trigger.",
            &["trigger"],
        );
        let jobs_started = counter(
            "jobs_started_total",
            "Jobs started, by kind (template, service, docker).",
            &["kind"],
        );
        let jobs_finished = counter(
            "jobs_finished_total",
            "Jobs that ended, by kind and final state.",
            &["kind", "state"],
        );
        let grant_events = counter(
            "grant_events_total",
            "Grant requests and decisions, by event.",
            &["event"],
        );
        let connections = counter(
            "connections_total",
            "TCP connections at the HTTP listeners, by listener and outcome.",
            &["listener", "outcome"],
        );
        let rejections = counter(
            "http_rejections_total",
            "Requests answered with an HTTP error that is not an admission refusal, by listener and cause.",
            &["listener", "cause"],
        );
        let duplicates = counter(
            "idempotency_decisions_total",
            "Calls with an idempotency key seen before, by canonical tool and decision.",
            &["tool", "decision"],
        );
        let cancellations = counter(
            "cancellations_total",
            "notifications/cancelled that arrived in their own HTTP request, by whether they found the caller's request in flight.",
            &["outcome"],
        );
        let upstream_restarts = counter(
            "upstream_restarts_total",
            "Restarts of a downstream MCP server (a shared child started again, an HTTP backend reconnected), by upstream.",
            &["upstream"],
        );
        let gauge_vec = |name: &str, help: &str, labels: &[&str]| {
            let g = IntGaugeVec::new(Opts::new(name, help), labels).expect("valid gauge");
            registry
                .register(Box::new(g.clone()))
                .expect("unique gauge");
            g
        };
        let upstream_up = gauge_vec(
            "upstream_up",
            "Whether a downstream MCP server is up (1) or not (0), by upstream.",
            &["upstream"],
        );
        let upstream_tools = gauge_vec(
            "upstream_tools",
            "Tools imported from a downstream MCP server, by upstream.",
            &["upstream"],
        );
        let upstream_drift = gauge_vec(
            "upstream_drift",
            "Whether a downstream MCP server's tool surface differs from the approved one and its changes are held (1) or not (0), by upstream.",
            &["upstream"],
        );
        let state_write_failures = counter(
            "state_write_failures_total",
            "Writes to the state directory that failed (a full disk, an I/O error), by part (audit, store).",
            &["part"],
        );
        let jobs_recovered = IntGauge::new(
            "jobs_recovered_at_start",
            "Jobs found running from a process that had died, marked outcome-unknown at this start.",
        )
        .expect("valid gauge");
        registry
            .register(Box::new(jobs_recovered.clone()))
            .expect("unique gauge");
        let connections_open = IntGaugeVec::new(
            Opts::new("connections_open", "Connections open now, by listener."),
            &["listener"],
        )
        .expect("valid gauge");
        registry
            .register(Box::new(connections_open.clone()))
            .expect("unique gauge");
        let tool_duration = HistogramVec::new(
            HistogramOpts::new(
                "tool_call_duration_seconds",
                "Tool call duration by canonical tool.",
            )
            .buckets(vec![0.001, 0.005, 0.025, 0.1, 0.5, 2.5, 10.0, 60.0, 600.0]),
            &["tool"],
        )
        .expect("valid histogram");
        registry
            .register(Box::new(tool_duration.clone()))
            .expect("unique histogram");
        let active_turns =
            IntGauge::new("active_turns", "Turns running now (0 or 1).").expect("valid gauge");
        registry
            .register(Box::new(active_turns.clone()))
            .expect("unique gauge");
        let jobs_running = IntGauge::new("jobs_running", "Jobs running in this process now.")
            .expect("valid gauge");
        registry
            .register(Box::new(jobs_running.clone()))
            .expect("unique gauge");
        let jwks_last_success = IntGauge::new(
            "jwks_last_success_timestamp_seconds",
            "When the remote verifier last fetched or read its key set successfully (unix seconds; 0: not yet).",
        )
        .expect("valid gauge");
        registry
            .register(Box::new(jwks_last_success.clone()))
            .expect("unique gauge");
        let audit_unpersisted = IntGauge::new(
            "audit_unpersisted_records",
            "Audit records not in the audit file: waiting because it cannot be written now, or kept in memory only because the writer fell behind or its backlog bound was reached.",
        )
        .expect("valid gauge");
        registry
            .register(Box::new(audit_unpersisted.clone()))
            .expect("unique gauge");
        let build = IntGaugeVec::new(
            Opts::new("build_info", "Build information; always 1."),
            &["version"],
        )
        .expect("valid gauge");
        build.with_label_values(&[env!("CARGO_PKG_VERSION")]).set(1);
        registry
            .register(Box::new(build))
            .expect("unique build_info");
        #[cfg(target_os = "linux")]
        {
            let process = prometheus::process_collector::ProcessCollector::for_self();
            // The process collector adds its own `process_` names without our prefix.
            let _ = prometheus::default_registry().register(Box::new(process));
        }
        // Every series of a closed label set exists from the start, at 0: a rule's
        // `increase()` then sees the first event too (a series born at 1 shows none).
        // Only the label sets that can happen: a carrier's own refusal reasons, and the
        // remote carrier's throttling.
        throttled.with_label_values(&[Carrier::Remote.as_str()]);
        for carrier in Carrier::ALL {
            for reason in Reason::ALL.into_iter().filter(|r| r.given_by(carrier)) {
                refusals.with_label_values(&[carrier.as_str(), reason.as_str()]);
            }
        }
        for outcome in FetchOutcome::ALL {
            jwks_fetches.with_label_values(&[outcome.as_str()]);
        }
        for kind in JobKind::ALL {
            for state in JobState::ALL
                .into_iter()
                .filter(|s| *s != JobState::Running)
            {
                jobs_finished.with_label_values(&[kind.as_str(), state.as_str()]);
            }
        }
        for event in GrantEvent::ALL {
            grant_events.with_label_values(&[event.as_str()]);
        }
        for part in StatePart::ALL {
            state_write_failures.with_label_values(&[part.as_str()]);
        }
        Self(Arc::new(Inner {
            registry,
            refusals,
            admitted,
            tool_calls,
            tool_duration,
            policy_denials,
            active_turns,
            throttled,
            jwks_fetches,
            introspections,
            jwks_refresh_failures,
            jwks_last_success,
            jobs_started,
            jobs_finished,
            jobs_running,
            grant_events,
            audit_unpersisted,
            state_write_failures,
            connections,
            connections_open,
            rejections,
            duplicates,
            cancellations,
            jobs_recovered,
            upstream_up,
            upstream_restarts,
            upstream_tools,
            upstream_drift,
            tool_labels: parking_lot::Mutex::new(std::collections::HashSet::new()),
        }))
    }

    /// `upstream` is a configured upstream's name (a closed set of the configuration).
    pub fn upstream_up(&self, upstream: &str, up: bool) {
        self.0
            .upstream_up
            .with_label_values(&[upstream])
            .set(i64::from(up));
    }

    pub fn upstream_drift(&self, upstream: &str, held: bool) {
        self.0
            .upstream_drift
            .with_label_values(&[upstream])
            .set(i64::from(held));
    }

    pub fn upstream_restart(&self, upstream: &str) {
        self.0
            .upstream_restarts
            .with_label_values(&[upstream])
            .inc();
    }

    /// Drops the series of upstreams that are no longer configured (a reload removed
    /// them): an alert on `upstream_up == 0` must not fire for what is gone.
    pub fn retain_upstreams(&self, configured: &[&str]) {
        let inner = &self.0;
        drop_gone(&inner.upstream_up, configured);
        drop_gone(&inner.upstream_tools, configured);
        drop_gone(&inner.upstream_drift, configured);
        drop_gone(&inner.upstream_restarts, configured);
    }

    pub fn upstream_tools(&self, upstream: &str, tools: usize) {
        self.0
            .upstream_tools
            .with_label_values(&[upstream])
            .set(i64::try_from(tools).unwrap_or(i64::MAX));
    }

    /// `tool` as a label value: itself while fewer than [`MAX_TOOL_LABELS`] names have
    /// been seen, else [`OTHER_TOOL_LABEL`] for a name not seen before.
    fn tool_label<'a>(&self, tool: &'a str) -> &'a str {
        let mut seen = self.0.tool_labels.lock();
        if seen.contains(tool) {
            return tool;
        }
        if seen.len() >= MAX_TOOL_LABELS {
            return OTHER_TOOL_LABEL;
        }
        seen.insert(tool.to_owned());
        tool
    }

    pub fn duplicate(&self, tool: &str, decision: Duplicate) {
        self.0
            .duplicates
            .with_label_values(&[tool, decision.as_str()])
            .inc();
    }

    pub fn cancellation(&self, outcome: CancelOutcome) {
        self.0
            .cancellations
            .with_label_values(&[outcome.as_str()])
            .inc();
    }

    /// Jobs this start found cut off by a dead process (set once, at start).
    pub fn jobs_recovered(&self, count: usize) {
        self.0
            .jobs_recovered
            .set(i64::try_from(count).unwrap_or(i64::MAX));
    }

    pub fn connection(&self, listener: Listener, outcome: ConnOutcome) {
        self.0
            .connections
            .with_label_values(&[listener.as_str(), outcome.as_str()])
            .inc();
    }

    /// Counts an open connection until the guard is dropped.
    pub fn open_connection(&self, listener: Listener) -> OpenConnection {
        let gauge = self
            .0
            .connections_open
            .with_label_values(&[listener.as_str()]);
        gauge.inc();
        OpenConnection(gauge)
    }

    pub fn rejected(&self, listener: Listener, why: Rejection) {
        self.0
            .rejections
            .with_label_values(&[listener.as_str(), why.as_str()])
            .inc();
    }

    /// Audit records that never reached the audit file (read at every scrape).
    pub fn audit_unpersisted(&self, records: u64) {
        self.0
            .audit_unpersisted
            .set(i64::try_from(records).unwrap_or(i64::MAX));
    }

    /// Failed writes of `part` since the process started (read at every scrape).
    pub fn state_write_failures(&self, part: StatePart, total: u64) {
        let counter = self
            .0
            .state_write_failures
            .with_label_values(&[part.as_str()]);
        counter.inc_by(total.saturating_sub(counter.get()));
    }

    pub fn job_started(&self, kind: JobKind) {
        self.0
            .jobs_started
            .with_label_values(&[kind.as_str()])
            .inc();
        self.0.jobs_running.inc();
    }

    pub fn job_finished(&self, kind: JobKind, state: JobState) {
        self.0
            .jobs_finished
            .with_label_values(&[kind.as_str(), state.as_str()])
            .inc();
        self.0.jobs_running.dec();
    }

    pub fn grant_event(&self, event: GrantEvent) {
        self.0
            .grant_events
            .with_label_values(&[event.as_str()])
            .inc();
    }

    pub fn refused(&self, carrier: Carrier, reason: Reason) {
        self.0
            .refusals
            .with_label_values(&[carrier.as_str(), reason.as_str()])
            .inc();
    }

    pub fn throttled(&self, carrier: Carrier) {
        self.0
            .throttled
            .with_label_values(&[carrier.as_str()])
            .inc();
    }

    pub fn jwks_fetch(&self, outcome: FetchOutcome) {
        self.0
            .jwks_fetches
            .with_label_values(&[outcome.as_str()])
            .inc();
    }

    pub fn introspection(&self, outcome: IntrospectionOutcome) {
        self.0
            .introspections
            .with_label_values(&[outcome.as_str()])
            .inc();
    }

    pub fn jwks_refreshed(&self, at: std::time::SystemTime) {
        let secs = at
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        self.0
            .jwks_last_success
            .set(i64::try_from(secs).unwrap_or(i64::MAX));
    }

    pub fn jwks_refresh_failed(&self, trigger: RefreshTrigger) {
        self.0
            .jwks_refresh_failures
            .with_label_values(&[trigger.as_str()])
            .inc();
    }

    pub fn admitted(&self, carrier: Carrier) {
        self.0.admitted.with_label_values(&[carrier.as_str()]).inc();
    }

    pub fn admitted_count(&self, carrier: Carrier) -> u64 {
        self.0.admitted.with_label_values(&[carrier.as_str()]).get()
    }

    pub fn refused_count(&self, carrier: Carrier) -> u64 {
        Reason::ALL
            .iter()
            .filter(|r| r.given_by(carrier))
            .map(|r| {
                self.0
                    .refusals
                    .with_label_values(&[carrier.as_str(), r.as_str()])
                    .get()
            })
            .sum()
    }

    /// `tool` must be a canonical catalog name (a closed set), never caller text.
    pub fn tool_call(&self, tool: &str, error: Option<ToolErrorCode>, took: Duration) {
        let outcome = error.map_or("ok", ToolErrorCode::as_str);
        let tool = self.tool_label(tool);
        self.0.tool_calls.with_label_values(&[tool, outcome]).inc();
        let h: Histogram = self.0.tool_duration.with_label_values(&[tool]);
        h.observe(took.as_secs_f64());
    }

    /// Export the `ok` and `internal` tool-call series of `tools` at 0, so a rule's
    /// `increase()` sees their first call too.
    pub fn prime_tools<'a>(&self, tools: impl IntoIterator<Item = &'a str>) {
        for tool in tools {
            for outcome in ["ok", ToolErrorCode::Internal.as_str()] {
                self.0.tool_calls.with_label_values(&[tool, outcome]);
            }
        }
    }

    pub fn policy_denial(&self, tool: &str, code: ToolErrorCode) {
        let tool = self.tool_label(tool);
        self.0
            .policy_denials
            .with_label_values(&[tool, code.as_str()])
            .inc();
    }

    pub fn turn_started(&self) -> ActiveTurn {
        self.0.active_turns.inc();
        ActiveTurn(self.0.active_turns.clone())
    }

    /// The text exposition of every metric, ours and the process collector's.
    pub fn render(&self) -> String {
        let mut families = self.0.registry.gather();
        families.extend(prometheus::default_registry().gather());
        let mut out = Vec::new();
        // Encoding into a Vec cannot fail for well-formed families.
        let _ = TextEncoder::new().encode(&families, &mut out);
        String::from_utf8(out).unwrap_or_default()
    }
}

/// Removes the series of `vec` whose `upstream` label names none of `configured`.
fn drop_gone<P: prometheus::core::MetricVecBuilder>(
    vec: &prometheus::core::MetricVec<P>,
    configured: &[&str],
) {
    use prometheus::core::Collector as _;
    let gone: Vec<String> = vec
        .collect()
        .iter()
        .flat_map(|family| family.get_metric())
        .flat_map(|m| m.get_label())
        .filter(|l| l.name() == "upstream" && !configured.contains(&l.value()))
        .map(|l| l.value().to_owned())
        .collect();
    for name in gone {
        let _ = vec.remove_label_values(&[&name]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_label_sets_a_carrier_can_produce_are_exported() {
        let m = Metrics::new();
        for carrier in Carrier::ALL {
            // `status` reads every carrier's counts.
            m.refused_count(carrier);
        }
        m.upstream_up("pg", false);
        m.upstream_tools("pg", 3);
        m.upstream_restart("pg");
        m.upstream_up("fs", true);
        m.retain_upstreams(&["fs"]);
        let text = m.render();
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            assert!(!line.contains("carrier=\"stdio\""), "{line}");
            assert!(
                !line.contains("carrier=\"control\"") || line.contains("peer-not-allowed"),
                "{line}"
            );
            assert!(
                !line.contains("upstream=\"pg\""),
                "a removed upstream: {line}"
            );
        }
        assert!(
            text.contains("robota_mcpd_upstream_up{upstream=\"fs\"} 1"),
            "{text}"
        );
        assert!(
            text.contains(
                "robota_mcpd_refusals_total{carrier=\"loopback\",reason=\"wrong-path\"} 0"
            ),
            "{text}"
        );
        assert!(
            !text.contains("{carrier=\"loopback\",reason=\"expired\"}"),
            "a reason only the remote carrier gives: {text}"
        );
    }

    #[test]
    fn counters_render_with_closed_set_labels() {
        let m = Metrics::new();
        m.refused(Carrier::Loopback, Reason::BadBearer);
        m.admitted(Carrier::Loopback);
        m.tool_call("system.info", None, Duration::from_millis(3));
        m.tool_call(
            "agent_submit",
            Some(ToolErrorCode::Busy),
            Duration::from_millis(1),
        );
        let text = m.render();
        assert!(
            text.contains(
                r#"robota_mcpd_refusals_total{carrier="loopback",reason="bad-bearer"} 1"#
            ),
            "{text}"
        );
        assert!(text.contains(r#"robota_mcpd_admitted_requests_total{carrier="loopback"} 1"#));
        assert!(
            text.contains(r#"robota_mcpd_tool_calls_total{outcome="busy",tool="agent_submit"} 1"#)
        );
        assert!(text.contains("robota_mcpd_build_info{version="));
        assert_eq!(m.refused_count(Carrier::Loopback), 1);
    }

    #[test]
    fn tool_labels_are_bounded() {
        let m = Metrics::new();
        for i in 0..MAX_TOOL_LABELS + 10 {
            m.tool_call(&format!("pg.t{i}"), None, Duration::from_millis(1));
        }
        m.tool_call("pg.t0", None, Duration::from_millis(1));
        let text = m.render();
        assert!(text.contains(r#"robota_mcpd_tool_calls_total{outcome="ok",tool="pg.t0"} 2"#));
        assert!(text.contains(r#"robota_mcpd_tool_calls_total{outcome="ok",tool="(other)"} 10"#));
    }

    /// docs/metrics.md lists every metric the code registers, and every closed-set value
    /// a label can take; no documented metric is missing from the code.
    #[test]
    fn docs_list_every_metric_and_label_value() {
        let doc =
            std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/metrics.md"))
                .unwrap();
        let m = Metrics::new();
        // Touch every vector so it appears in the exposition.
        m.refused(Carrier::Remote, Reason::Expired);
        m.admitted(Carrier::Remote);
        m.throttled(Carrier::Remote);
        m.tool_call("system.info", None, Duration::from_millis(1));
        m.policy_denial("system.info", ToolErrorCode::PermissionDenied);
        m.jwks_fetch(FetchOutcome::Ok);
        m.introspection(IntrospectionOutcome::Active);
        m.jwks_refresh_failed(RefreshTrigger::Schedule);
        m.job_started(JobKind::Template);
        m.job_finished(JobKind::Template, JobState::Succeeded);
        m.grant_event(GrantEvent::Approved);
        m.duplicate("file.write", Duplicate::Replayed);
        m.cancellation(CancelOutcome::Matched);
        m.connection(Listener::Loopback, ConnOutcome::Accepted);
        drop(m.open_connection(Listener::Loopback));
        m.rejected(Listener::Loopback, Rejection::Busy);
        m.upstream_up("pg", true);
        m.upstream_restart("pg");
        m.upstream_tools("pg", 2);
        m.upstream_drift("pg", true);
        let families = m.0.registry.gather();
        assert!(families.len() >= 9);
        for family in &families {
            assert!(
                doc.contains(&format!("`{}`", family.name())),
                "{} is not documented",
                family.name()
            );
        }
        let documented: Vec<&str> = doc
            .lines()
            .filter_map(|l| l.strip_prefix("| `robota_mcpd_"))
            .filter_map(|l| l.split('`').next())
            .collect();
        assert!(!documented.is_empty());
        for name in documented {
            let full = format!("robota_mcpd_{name}");
            assert!(
                families.iter().any(|f| f.name() == full),
                "{full} is documented but not registered"
            );
        }
        for carrier in Carrier::ALL {
            assert!(
                doc.contains(&format!("`{}`", carrier.as_str())),
                "carrier {}",
                carrier.as_str()
            );
        }
        for reason in Reason::ALL {
            assert!(
                doc.contains(&format!("`{}`", reason.as_str())),
                "reason {}",
                reason.as_str()
            );
        }
        for code in ToolErrorCode::ALL {
            assert!(
                doc.contains(&format!("`{}`", code.as_str())),
                "tool error {}",
                code.as_str()
            );
        }
        for kind in JobKind::ALL {
            assert!(
                doc.contains(&format!("`{}`", kind.as_str())),
                "job kind {}",
                kind.as_str()
            );
        }
        for state in JobState::ALL {
            assert!(
                doc.contains(&format!("`{}`", state.as_str())),
                "job state {}",
                state.as_str()
            );
        }
        for event in GrantEvent::ALL {
            assert!(
                doc.contains(&format!("`{}`", event.as_str())),
                "grant event {}",
                event.as_str()
            );
        }
        for outcome in IntrospectionOutcome::ALL {
            assert!(
                doc.contains(&format!("`{}`", outcome.as_str())),
                "introspection outcome {}",
                outcome.as_str()
            );
        }
        for decision in Duplicate::ALL {
            assert!(
                doc.contains(&format!("`{}`", decision.as_str())),
                "idempotency decision {}",
                decision.as_str()
            );
        }
        for outcome in CancelOutcome::ALL {
            assert!(
                doc.contains(&format!("`{}`", outcome.as_str())),
                "cancellation outcome {}",
                outcome.as_str()
            );
        }
        for listener in Listener::ALL {
            assert!(doc.contains(&format!("`{}`", listener.as_str())));
        }
        for outcome in ConnOutcome::ALL {
            assert!(
                doc.contains(&format!("`{}`", outcome.as_str())),
                "connection outcome {}",
                outcome.as_str()
            );
        }
        for reason in Rejection::ALL {
            assert!(
                doc.contains(&format!("`{}`", reason.as_str())),
                "rejection {}",
                reason.as_str()
            );
        }
        for outcome in FetchOutcome::ALL {
            assert!(
                doc.contains(&format!("`{}`", outcome.as_str())),
                "fetch outcome {}",
                outcome.as_str()
            );
        }
        for trigger in RefreshTrigger::ALL {
            assert!(
                doc.contains(&format!("`{}`", trigger.as_str())),
                "refresh trigger {}",
                trigger.as_str()
            );
        }
    }
}
