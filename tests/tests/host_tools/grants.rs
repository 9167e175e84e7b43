//! Grants end to end: a tool behind `decision = "grant"` answers
//! `interactive_permission_required` until an operator approves the caller's request with
//! `robota-mcpctl grants approve`; the grant covers that caller only, survives a restart,
//! and ends on revoke or expiry; every request and decision is an audit record.

use std::time::Duration;

use robota_e2e::mcp::McpClient;
use robota_e2e::{Daemon, poll_until_async};
use serde_json::{Value, json};

const CONFIG: &str = r#"
[jobs.hello]
argv = ["/bin/echo", "hello"]

[[policy]]
callers = ["bearer:*"]
tools = ["job.start"]
decision = "grant"
"#;

fn grant_id(v: &Value) -> String {
    v["grant_id"].as_i64().expect("grant_id").to_string()
}

fn audit_events(d: &Daemon) -> Vec<Value> {
    let out = d.ctl_ok(&["--json", "audit"]);
    out.stdout
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).expect("audit JSON line"))
        .filter(|r| r.get("grant").is_some())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_is_asked_for_approved_bound_to_its_caller_and_revoked() {
    let d = Daemon::builder().extra(CONFIG).start();
    let ci = McpClient::connect(&d, &d.bearer_labeled("ci")).await;
    let other = McpClient::connect(&d, &d.bearer_labeled("other")).await;

    // Before any grant: the refusal names the tool to ask with.
    let msg = ci
        .call("job.start", json!({"template": "hello"}))
        .await
        .err("interactive_permission_required", "before the request");
    assert!(msg.contains("permissions.request_elevation"), "{msg}");

    let request = ci
        .call(
            "permissions.request_elevation",
            json!({"reason": "nightly deploy", "scope": ["job.start"], "duration": "10m"}),
        )
        .await
        .ok("request_elevation");
    assert_eq!(request["state"], "pending");
    assert_eq!(request["caller"], "bearer:ci");
    let id = grant_id(&request);

    // Pending is not approved.
    ci.call("job.start", json!({"template": "hello"}))
        .await
        .err("interactive_permission_required", "while pending");

    let listed = d.ctl_ok(&["grants", "list"]);
    assert!(
        listed.stdout.contains("nightly deploy"),
        "{}",
        listed.stdout
    );
    assert!(listed.stdout.contains("pending"), "{}", listed.stdout);
    let approved = d.ctl_ok(&["grants", "approve", &id]);
    assert!(approved.stdout.contains("approved"), "{}", approved.stdout);
    d.ctl(&["grants", "approve", &id])
        .expect_code(1, "approving twice is a conflict");
    d.ctl(&["grants", "deny", "424242"])
        .expect_code(1, "unknown grant");

    ci.call("job.start", json!({"template": "hello"}))
        .await
        .ok("allowed by the grant");
    // Another caller never benefits from it, and cannot give it back either.
    other
        .call("job.start", json!({"template": "hello"}))
        .await
        .err("interactive_permission_required", "another caller");
    let theirs = other
        .call("permissions.list_root_access", json!({}))
        .await
        .ok("other's list");
    assert_eq!(theirs["grants"].as_array().unwrap().len(), 0, "{theirs}");
    other
        .call(
            "permissions.revoke_root_access",
            json!({"grant_id": request["grant_id"]}),
        )
        .await
        .err("invalid_arguments", "revoking someone else's grant");
    let mine = ci
        .call("permissions.list_root_access", json!({}))
        .await
        .ok("ci's list");
    assert_eq!(mine["grants"][0]["state"], "approved", "{mine}");

    // Durable and bound to the identity: after a restart (new bearers) the caller with the
    // same label is still covered.
    d.ctl_ok(&["restart"]);
    d.refresh_addrs();
    ci.close().await;
    other.close().await;
    let ci = McpClient::connect(&d, &d.bearer_labeled("ci")).await;
    ci.call("job.start", json!({"template": "hello"}))
        .await
        .ok("still allowed after a restart");

    // Revoked by the operator: refused again at once.
    d.ctl_ok(&["grants", "revoke", &id]);
    ci.call("job.start", json!({"template": "hello"}))
        .await
        .err("interactive_permission_required", "after revoke");

    let events: Vec<String> = audit_events(&d)
        .iter()
        .map(|r| r["reason"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(
        events,
        ["grant-requested", "grant-approved", "grant-revoked"],
        "every request and decision is audited"
    );
    let records = audit_events(&d);
    assert_eq!(records[0]["grant"]["by"], "bearer:ci");
    assert_eq!(records[0]["carrier"], "session");
    assert_eq!(records[1]["grant"]["by"], "local:0");
    assert_eq!(records[1]["carrier"], "control");
    // And counted: each event once, and every refusal of the policy wrapper by its code.
    let metrics = d.metrics_text().expect("metrics");
    for event in ["grant-requested", "grant-approved", "grant-revoked"] {
        assert_eq!(
            robota_e2e::metric_sum(
                &metrics,
                &[
                    "robota_mcpd_grant_events_total",
                    &format!("event=\"{event}\"")
                ]
            ),
            1.0,
            "{event}"
        );
    }
    assert!(
        robota_e2e::metric_sum(
            &metrics,
            &[
                "robota_mcpd_policy_denials_total",
                "tool=\"job.start\"",
                "code=\"interactive_permission_required\""
            ]
        ) >= 2.0,
        "{metrics}"
    );
    ci.close().await;
    d.assert_no_secrets();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_ends_at_its_expiry_and_callers_can_give_theirs_back() {
    let d = Daemon::builder().extra(CONFIG).start();
    let ci = McpClient::connect(&d, &d.bearer_labeled("ci")).await;

    // Root access covers every grant-gated tool by default.
    let request = ci
        .call(
            "permissions.request_root_access",
            json!({"reason": "incident 17"}),
        )
        .await
        .ok("request_root_access");
    assert_eq!(request["scope"], json!(["*"]));
    assert_eq!(request["kind"], "root-access");
    let id = grant_id(&request);
    d.ctl_ok(&["grants", "approve", &id, "--duration", "2s"]);
    ci.call("job.start", json!({"template": "hello"}))
        .await
        .ok("allowed while the grant lasts");
    let expired = poll_until_async(
        Duration::from_secs(10),
        Duration::from_millis(200),
        || async {
            ci.call("job.start", json!({"template": "hello"}))
                .await
                .error_code()
                == Some("interactive_permission_required")
        },
    )
    .await;
    assert!(expired, "a 2s grant still covers calls after 10 s");
    let all = d.ctl_ok(&["--json", "grants", "list", "--all"]);
    let reply: Value = serde_json::from_str(&all.stdout).unwrap();
    assert_eq!(reply["grants"][0]["state"], "expired", "{reply}");
    let current = d.ctl_ok(&["--json", "grants", "list"]);
    let reply: Value = serde_json::from_str(&current.stdout).unwrap();
    assert_eq!(reply["grants"].as_array().unwrap().len(), 0, "{reply}");

    // A caller revokes its own grant.
    let second = ci
        .call(
            "permissions.request_elevation",
            json!({"reason": "again", "scope": ["job.*"]}),
        )
        .await
        .ok("second request");
    d.ctl_ok(&["grants", "approve", &grant_id(&second)]);
    ci.call("job.start", json!({"template": "hello"}))
        .await
        .ok("allowed by the second grant");
    let revoked = ci
        .call(
            "permissions.revoke_root_access",
            json!({"grant_id": second["grant_id"]}),
        )
        .await
        .ok("own revoke");
    assert_eq!(revoked["state"], "revoked");
    ci.call("job.start", json!({"template": "hello"}))
        .await
        .err("interactive_permission_required", "after own revoke");

    // A denied request never covers anything.
    let third = ci
        .call(
            "permissions.request_elevation",
            json!({"reason": "x", "scope": ["job.start"]}),
        )
        .await
        .ok("third request");
    d.ctl_ok(&["grants", "deny", &grant_id(&third)]);
    ci.call("job.start", json!({"template": "hello"}))
        .await
        .err("interactive_permission_required", "after deny");
    // Bad requests are visible errors.
    ci.call("permissions.request_elevation", json!({"reason": "x"}))
        .await
        .err("invalid_arguments", "elevation needs a scope");
    ci.call(
        "permissions.request_elevation",
        json!({"reason": "x", "scope": ["job.start"], "duration": "90d"}),
    )
    .await
    .err("invalid_arguments", "over the maximum duration");
    ci.close().await;
}

/// Durations an operator gives meet the clock checked: zero is bad usage in the CLI, one
/// past the maximum or past what a clock can hold (`300000000000y`) is `bad-request` from
/// the daemon, the grant stays pending, and the daemon keeps serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn absurd_approval_durations_are_refused_and_change_nothing() {
    let d = Daemon::builder().extra(CONFIG).start();
    let ci = McpClient::connect(&d, &d.bearer_labeled("ci")).await;
    let request = ci
        .call(
            "permissions.request_elevation",
            json!({"reason": "edge", "scope": ["job.start"], "duration": "10m"}),
        )
        .await
        .ok("request_elevation");
    let id = grant_id(&request);
    d.ctl(&["grants", "approve", &id, "--duration", "0s"])
        .expect_code(2, "a zero duration is bad usage");
    for huge in ["300000000000y", "25h"] {
        let out = d.ctl(&["grants", "approve", &id, "--duration", huge]);
        out.expect_code(1, &format!("approve --duration {huge}"));
        assert!(
            out.stderr.contains("bad-request") && out.stderr.contains("between 1s and"),
            "{}",
            out.stderr
        );
    }
    // The request asked for an absurd duration is refused before it is stored.
    ci.call(
        "permissions.request_elevation",
        json!({"reason": "x", "scope": ["job.start"], "duration": "300000000000y"}),
    )
    .await
    .err("invalid_arguments", "an absurd requested duration");
    let listed = d.ctl_ok(&["--json", "grants", "list"]);
    let reply: Value = serde_json::from_str(&listed.stdout).unwrap();
    let grants = reply["grants"].as_array().unwrap();
    assert_eq!(grants.len(), 1, "{reply}");
    assert_eq!(grants[0]["state"], "pending", "{reply}");
    assert_eq!(d.status().state, "serving");
    d.ctl_ok(&["grants", "approve", &id, "--duration", "24h"]);
    ci.close().await;
}
