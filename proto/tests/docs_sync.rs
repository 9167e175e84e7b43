//! Keeps `docs/control-protocol.md` in sync with the wire types: every command, reply kind,
//! error code and exit code is documented, and every JSON example decodes.

use std::collections::BTreeSet;
use std::path::Path;

use robota_proto::{
    BearerInfo, Command, ErrorCode, GrantKind, GrantRecord, GrantState, JobRecord, JobState,
    KeySetStatus, KeySourceKind, PROTOCOL_VERSION, Reply, Request, Response, Secret, Status,
    UpstreamDiff, UpstreamStatus, exit,
};
use serde_json::Value;

fn doc() -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/control-protocol.md");
    std::fs::read_to_string(&path).unwrap_or_else(|err| panic!("{}: {err}", path.display()))
}

/// One instance of every [`Command`], chained by an exhaustive `match` (no wildcard): a new
/// variant fails to compile here until it is given an arm and linked into the chain.
fn all_commands() -> Vec<Command> {
    fn next(command: &Command) -> Option<Command> {
        match command {
            Command::Status => Some(Command::BearerIssue {
                label: Some("ci".into()),
                ttl_secs: Some(60),
            }),
            Command::BearerIssue { .. } => Some(Command::BearerList),
            Command::BearerList => Some(Command::BearerRevoke { label: "ci".into() }),
            Command::BearerRevoke { .. } => Some(Command::BearerRotate),
            Command::BearerRotate => Some(Command::Audit {
                since: Some(1),
                reason: Some("expired".into()),
                after_seq: Some(3),
                limit: Some(10),
            }),
            Command::Audit { .. } => Some(Command::JobsList {
                owner: Some("bearer:ci".into()),
                limit: Some(20),
            }),
            Command::JobsList { .. } => Some(Command::JobCancel { job_id: 42 }),
            Command::JobCancel { .. } => Some(Command::GrantsList { all: true }),
            Command::GrantsList { .. } => Some(Command::GrantApprove {
                grant_id: 7,
                duration_secs: Some(900),
            }),
            Command::GrantApprove { .. } => Some(Command::GrantShow { grant_id: 7 }),
            Command::GrantShow { .. } => Some(Command::GrantDeny { grant_id: 7 }),
            Command::GrantDeny { .. } => Some(Command::GrantRevoke { grant_id: 7 }),
            Command::GrantRevoke { .. } => Some(Command::Mcp),
            Command::Mcp => Some(Command::Stop),
            Command::Stop => Some(Command::Reload),
            Command::Reload => Some(Command::Restart),
            Command::Restart => Some(Command::KeysRefresh),
            Command::KeysRefresh => Some(Command::Upstreams),
            Command::Upstreams => Some(Command::UpstreamRestart { name: "pg".into() }),
            Command::UpstreamRestart { .. } => Some(Command::UpstreamDiff { name: "pg".into() }),
            Command::UpstreamDiff { .. } => Some(Command::UpstreamApprove {
                name: "pg".into(),
                surface: "a7d2".into(),
            }),
            Command::UpstreamApprove { .. } => None,
        }
    }
    chain(Command::Status, next)
}

/// One instance of every [`Reply`], chained the same way.
fn all_replies() -> Vec<Reply> {
    fn next(reply: &Reply) -> Option<Reply> {
        match reply {
            Reply::Status(_) => Some(Reply::Bearer {
                label: "default".into(),
                secret: Secret("x".into()),
                expires_at: None,
            }),
            Reply::Bearer { .. } => Some(Reply::Bearers {
                bearers: vec![BearerInfo {
                    label: "default".into(),
                    created_at: 0,
                    expires_at: None,
                    last_used_at: None,
                }],
            }),
            Reply::Bearers { .. } => Some(Reply::Revoked { label: "ci".into() }),
            Reply::Revoked { .. } => Some(Reply::Audit {
                records: Vec::new(),
                last_seq: 0,
            }),
            Reply::Audit { .. } => Some(Reply::Jobs { jobs: vec![job()] }),
            Reply::Jobs { .. } => Some(Reply::Job { job: job() }),
            Reply::Job { .. } => Some(Reply::Grants {
                grants: vec![grant()],
            }),
            Reply::Grants { .. } => Some(Reply::Grant {
                grant: Box::new(grant()),
            }),
            Reply::Grant { .. } => Some(Reply::Mcp),
            Reply::Mcp => Some(Reply::Stopping),
            Reply::Stopping => Some(Reply::Restarted { status: status() }),
            Reply::Restarted { .. } => Some(Reply::Reloaded {
                status: status(),
                host_bearer_kept: true,
            }),
            Reply::Reloaded { .. } => Some(Reply::KeySet(key_set())),
            Reply::KeySet(_) => Some(Reply::Upstreams {
                upstreams: vec![upstream()],
            }),
            Reply::Upstreams { .. } => Some(Reply::Upstream {
                upstream: upstream(),
            }),
            Reply::Upstream { .. } => Some(Reply::UpstreamDiff(UpstreamDiff {
                name: "pg".into(),
                approved: Some("a".into()),
                current: Some("b".into()),
                approved_at: Some(0),
                approved_by: Some("first-use".into()),
                executable_changed: false,
                added: vec!["drop".into()],
                removed: Vec::new(),
                changed: Vec::new(),
            })),
            Reply::UpstreamDiff(_) => None,
        }
    }
    chain(Reply::Status(status()), next)
}

fn chain<T>(first: T, next: fn(&T) -> Option<T>) -> Vec<T> {
    let mut all = vec![first];
    while let Some(item) = all.last().and_then(next) {
        assert!(all.len() < 100, "the variant chain loops");
        all.push(item);
    }
    all
}

fn job() -> JobRecord {
    JobRecord {
        job_id: 42,
        owner: "bearer:ci".into(),
        kind: "template".into(),
        target: "backup".into(),
        action: None,
        state: JobState::Running,
        created_at: 0,
        finished_at: None,
        exit_code: None,
        detail: None,
        output_bytes: 0,
        output_dropped: 0,
    }
}

fn grant() -> GrantRecord {
    GrantRecord {
        grant_id: 7,
        caller: "bearer:ci".into(),
        kind: GrantKind::Elevation,
        reason: "deploy".into(),
        scope: vec!["file.write".into()],
        duration_secs: 3600,
        state: GrantState::Pending,
        requested_at: 0,
        decided_at: None,
        decided_by: None,
        expires_at: None,
        tool: None,
        arguments: None,
        args_sha256: None,
        used_at: None,
    }
}

fn key_set() -> KeySetStatus {
    KeySetStatus {
        source: KeySourceKind::Discovery,
        location: Some("https://auth.example.com/jwks".into()),
        keys: 2,
        from_cache: false,
        fetched_at: Some(0),
        last_attempt_at: Some(0),
        last_error: None,
        next_refresh_at: Some(600),
        refreshing: false,
    }
}

fn status() -> Status {
    Status {
        version: "0.1.0".into(),
        pid: 1,
        uptime_secs: 0,
        state: "serving".into(),
        generation: 0,
        carriers: Vec::new(),
        catalog_size: 0,
        submission_tool: "agent_submit".into(),
        active_turn: false,
        running_jobs: 0,
        pending_grants: 0,
        bearer_count: 1,
        refusals_last_hour: Default::default(),
        key_set: None,
        config: None,
        state_dir: "/var/lib/robota-mcpd".into(),
        last_reload: None,
        health: "ok".into(),
        problems: Vec::new(),
        upstreams: Vec::new(),
    }
}

fn upstream() -> UpstreamStatus {
    UpstreamStatus {
        name: "pg".into(),
        kind: "stdio".into(),
        children: Some("shared".into()),
        state: "up".into(),
        since: 0,
        protocol: Some("2026-07-28".into()),
        tools: vec!["pg.query".into()],
        refused: Vec::new(),
        excluded: 0,
        listed_from_cache: false,
        restarts: 0,
        last_error: None,
        surface: Some("ab12".into()),
        drift: false,
    }
}

/// The `tag` string a value serializes with (`cmd` or `kind`).
fn tag_of(value: &impl serde::Serialize, tag: &str) -> String {
    let value = serde_json::to_value(value).expect("serialize");
    value[tag]
        .as_str()
        .unwrap_or_else(|| panic!("no string `{tag}` in {value}"))
        .to_owned()
}

/// Every JSON value in the doc's ```json blocks (a block may hold several, one per line).
fn json_examples(doc: &str) -> Vec<Value> {
    let mut values = Vec::new();
    let mut block: Option<String> = None;
    for line in doc.lines() {
        match (&mut block, line.trim_end()) {
            (None, "```json") => block = Some(String::new()),
            (Some(text), "```") => {
                let stream = serde_json::Deserializer::from_str(text).into_iter::<Value>();
                for value in stream {
                    values.push(
                        value.unwrap_or_else(|err| panic!("bad JSON example: {err}\n{text}")),
                    );
                }
                block = None;
            }
            (Some(text), line) => {
                text.push_str(line);
                text.push('\n');
            }
            (None, _) => {}
        }
    }
    assert!(block.is_none(), "unterminated ```json block");
    values
}

/// Decodes a request example the way the daemon does, and requires it to be canonical.
fn decode_request(value: &Value) -> Command {
    let frame = serde_json::to_vec(value).expect("encode");
    let request = Request::decode(&frame).unwrap_or_else(|(code, err)| {
        panic!("request example does not decode: {code}: {err}: {value}")
    });
    let canonical = serde_json::to_value(&request).expect("encode");
    assert_eq!(&canonical, value, "request example is not canonical");
    request.command
}

#[derive(Default)]
struct Examples {
    cmds: BTreeSet<String>,
    ok_kinds: BTreeSet<String>,
    error_codes: BTreeSet<String>,
    bare_replies: usize,
}

fn classify(values: &[Value]) -> Examples {
    let mut seen = Examples::default();
    for value in values {
        if value.get("cmd").is_some() {
            seen.cmds.insert(tag_of(&decode_request(value), "cmd"));
        } else if value.get("ok").is_some() || value.get("error").is_some() {
            let response: Response = serde_json::from_value(value.clone())
                .unwrap_or_else(|err| panic!("response example does not decode: {err}: {value}"));
            assert_eq!(response.v, PROTOCOL_VERSION, "{value}");
            match response.outcome {
                robota_proto::Outcome::Ok(reply) => {
                    let reply = *reply;
                    seen.ok_kinds.insert(tag_of(&reply, "kind"));
                }
                robota_proto::Outcome::Error(error) => {
                    seen.error_codes.insert(error.code.as_str().to_owned());
                }
            }
        } else if value.get("seq").is_some() && value.get("reason").is_some() {
            // `robota-mcpctl --json audit` output: one bare record per line, each field
            // one the record defines (it re-encodes to exactly the example).
            let record = serde_json::from_value::<robota_proto::AuditRecord>(value.clone())
                .unwrap_or_else(|err| {
                    panic!("audit record example does not decode: {err}: {value}")
                });
            assert_eq!(
                serde_json::to_value(&record).unwrap(),
                *value,
                "audit record example with fields the record does not have"
            );
        } else if value.get("kind").is_some() {
            // `robota-mcpctl --json` output: a bare reply object. With `--output` the bearer
            // reply is printed without its secret; put one back to decode the rest.
            let mut value = value.clone();
            if value["kind"] == "bearer" && value.get("secret").is_none() {
                value["secret"] = Value::from("");
            }
            serde_json::from_value::<Reply>(value.clone())
                .unwrap_or_else(|err| panic!("reply example does not decode: {err}: {value}"));
            seen.bare_replies += 1;
        } else {
            panic!("JSON example is neither a request, a response nor a reply: {value}");
        }
    }
    seen
}

#[test]
fn every_json_example_decodes_and_every_command_and_reply_has_one() {
    let doc = doc();
    let values = json_examples(&doc);
    assert!(
        values.len() >= 10,
        "expected many JSON examples, found {}",
        values.len()
    );
    let seen = classify(&values);
    assert!(seen.bare_replies > 0, "no --json output example");
    assert!(!seen.error_codes.is_empty(), "no error frame example");

    let commands = all_commands();
    assert_eq!(commands.len(), 22, "the command chain lost a link");
    for command in &commands {
        let cmd = tag_of(command, "cmd");
        assert!(seen.cmds.contains(&cmd), "no request example for `{cmd}`");
        assert!(
            doc.contains(&format!("### `{cmd}`")),
            "no section for `{cmd}`"
        );
        assert!(
            doc.contains(&format!("| `{cmd}` |")),
            "`{cmd}` missing from the table"
        );
    }
    let replies = all_replies();
    assert_eq!(replies.len(), 17, "the reply chain lost a link");
    for reply in &replies {
        let kind = tag_of(reply, "kind");
        assert!(
            seen.ok_kinds.contains(&kind),
            "no response example of kind `{kind}`"
        );
    }
}

#[test]
fn every_error_code_is_documented() {
    let doc = doc();
    assert!(!ErrorCode::ALL.is_empty());
    for code in ErrorCode::ALL {
        let row = format!("| `{}` |", code.as_str());
        assert!(
            doc.contains(&row),
            "error code {code} missing from the table"
        );
    }
}

#[test]
fn every_exit_code_is_documented() {
    let doc = doc();
    let codes = [
        (exit::OK, "OK"),
        (exit::FAILED, "FAILED"),
        (exit::USAGE, "USAGE"),
        (exit::NOT_RUNNING, "NOT_RUNNING"),
        (exit::PERMISSION_DENIED, "PERMISSION_DENIED"),
        (exit::PROTOCOL, "PROTOCOL"),
        (exit::INVALID_CONFIG, "INVALID_CONFIG"),
    ];
    let distinct: BTreeSet<i32> = codes.iter().map(|(code, _)| *code).collect();
    assert_eq!(distinct.len(), codes.len(), "exit codes must be distinct");
    for (code, name) in codes {
        let row = format!("| {code} | `{name}` |");
        assert!(
            doc.contains(&row),
            "exit code {code} ({name}) missing: want a row `{row}`"
        );
    }
}

#[test]
fn the_limits_and_version_match_the_code() {
    let doc = doc();
    let max = robota_proto::MAX_REQUEST_BYTES;
    assert!(
        doc.contains(&format!("**{} KiB**", max / 1024)),
        "request limit"
    );
    assert!(
        doc.contains(&format!("({max} bytes")),
        "request limit in bytes"
    );
    assert!(doc.contains(&format!("**version {PROTOCOL_VERSION}**")));
    assert!(doc.contains(robota_proto::SOCKET_ENV));
}
