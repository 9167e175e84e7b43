//! `docker.logs` and `docker.action` end to end: the real daemon, a real MCP client, and a
//! fake Docker engine speaking real HTTP/1.1 on a unix socket in the daemon's directory.

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use robota_e2e::docker::{Container, FakeEngine, STDERR, STDOUT};
use robota_e2e::mcp::McpClient;
use robota_e2e::{Daemon, within};
use serde_json::{Value, json};

const DOCKER: &str = r#"
[tools.docker]
socket = "@DIR@/docker.sock"
containers = ["web", "worker-*"]
"#;

const ALLOW_ACTION: &str = r#"
[[policy]]
callers = ["bearer:*"]
tools = ["docker.action"]
decision = "allow"
"#;

/// The ID of `db`, a container the allow-list does not name. Real IDs are 64 hex digits;
/// this one is chosen so that it (and its prefixes) match the glob `worker-*`: the engine
/// resolves IDs and ID prefixes as well as names, so only the engine's `Name` tells which
/// container an argument reached.
const DB_ID: &str = "worker-0db5e7c1a2";

fn now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock after 1970")
        .as_secs() as i64
}

/// The containers the tests use. `web`'s logs cover split frames, a line spanning frames
/// (with a stderr line in between), a UTF-8 sequence split across frames, a NUL and an
/// invalid byte; only its last entry is recent.
fn table(engine: &FakeEngine) {
    let old = now() - 3600;
    engine.add(
        Container::new(
            "web",
            "4f0c1d2e3b4a59687766554433221100ffeeddccbbaa99887766554433221100",
        )
        .log(STDOUT, old, "hello from web\n")
        .log(STDERR, old, "warning: disk almost full\n")
        .log(STDOUT, old, "a line that ")
        .log(STDERR, old, "err two\nerr three\n")
        .log(STDOUT, old, "spans two frames\n")
        .log(STDOUT, old, b"bin \x00\xff caf\xc3")
        .log(STDOUT, old, b"\xa9 done\n")
        .log(STDOUT, now() - 5, "last line\n"),
    );
    engine.add(
        Container::new("worker-1", "77aa")
            .tty()
            // Starts with ESC (27): read as a frame header it would be a bad stream type.
            .log(STDOUT, old, "\u{1b}[32mgreen\u{1b}[0m tty one\r\n")
            .log(STDERR, old, "tty two\r\n"),
    );
    engine.add(
        Container::new("worker-2", "88bb")
            .stopped()
            .log(STDOUT, old, "idle\n"),
    );
    engine.add(Container::new("db", DB_ID).log(STDOUT, old, "secret rows\n"));
    let mut big = Container::new("worker-big", "99cc");
    for i in 0..3000 {
        big = big.log(STDOUT, old, format!("big {i:04} {}\n", "x".repeat(490)));
    }
    engine.add(big);
}

fn web_lines() -> Vec<Value> {
    vec![
        json!({"stream": "stdout", "text": "hello from web"}),
        json!({"stream": "stderr", "text": "warning: disk almost full"}),
        json!({"stream": "stderr", "text": "err two"}),
        json!({"stream": "stderr", "text": "err three"}),
        json!({"stream": "stdout", "text": "a line that spans two frames"}),
        json!({"stream": "stdout", "text": "bin \u{0}\u{fffd} café done"}),
        json!({"stream": "stdout", "text": "last line"}),
    ]
}

fn lines(result: &Value) -> Vec<Value> {
    result["lines"]
        .as_array()
        .expect("lines is an array")
        .clone()
}

fn texts(result: &Value) -> Vec<String> {
    lines(result)
        .iter()
        .map(|l| l["text"].as_str().expect("text").to_owned())
        .collect()
}

async fn logs(client: &McpClient, args: Value) -> Value {
    client
        .call("docker.logs", args.clone())
        .await
        .ok(&format!("docker.logs {args}"))
}

/// Polls `job.status` until the job has ended (bounded); returns the final record.
async fn wait_job(client: &McpClient, job_id: i64) -> Value {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let status = client
            .call("job.status", json!({"job_id": job_id}))
            .await
            .ok("job.status");
        if status["state"] != "running" {
            return status;
        }
        assert!(
            Instant::now() < deadline,
            "job {job_id} still running after 20 s: {status}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Every output line of a job, joined.
async fn job_output(client: &McpClient, job_id: i64) -> String {
    let page = client
        .call("job.tail", json!({"job_id": job_id, "cursor": 0}))
        .await
        .ok("job.tail");
    assert_eq!(page["complete"], true, "{page}");
    page["chunks"]
        .as_array()
        .expect("chunks")
        .iter()
        .map(|c| c["text"].as_str().unwrap_or_default())
        .collect()
}

/// Starts an action; checks the job handle it returns; waits for the job's end.
async fn action(client: &McpClient, container: &str, action: &str) -> (Value, String) {
    let job = client
        .call(
            "docker.action",
            json!({"container": container, "action": action}),
        )
        .await
        .ok(&format!("docker.action {action} {container}"));
    assert_eq!(job["kind"], "docker", "{job}");
    assert_eq!(job["target"], container, "{job}");
    assert_eq!(job["action"], action, "{job}");
    let id = job["job_id"].as_i64().expect("job_id");
    let done = wait_job(client, id).await;
    let output = job_output(client, id).await;
    (done, output)
}

fn posts(engine: &FakeEngine) -> Vec<String> {
    engine
        .requests()
        .into_iter()
        .filter(|r| r.starts_with("POST "))
        .collect()
}

/// The engine's id of a container in the fake's table.
fn id_of(engine: &FakeEngine, name: &str) -> String {
    engine
        .container(name)
        .unwrap_or_else(|| panic!("no container {name}"))
        .id
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logs_are_demultiplexed_by_stream_and_line() {
    let d = Daemon::builder().extra(DOCKER).start();
    let engine = FakeEngine::start(d.dir());
    table(&engine);
    let client = McpClient::connect(&d, &d.bearer()).await;

    let all = logs(&client, json!({"container": "web"})).await;
    assert_eq!(all["container"], "web");
    assert_eq!(all["truncated"], false, "{all}");
    assert!(all.get("stream_error").is_none(), "{all}");
    assert_eq!(lines(&all), web_lines());
    let chunks = engine.log_chunks();
    assert!(
        chunks.len() == 1 && chunks[0] > 2 * 8,
        "the 8 frames must have gone out split, more than twice each: {chunks:?}"
    );
    let requests = engine.requests();
    assert!(
        requests.contains(&"GET /v1.41/containers/web/json".to_owned()),
        "{requests:?}"
    );
    assert!(
        requests.iter().any(|r| r.starts_with(&format!(
            "GET /v1.41/containers/{}/logs?",
            id_of(&engine, "web")
        )) && r.contains("stdout=true")
            && r.contains("stderr=true")
            && r.contains("tail=100")
            && r.contains("timestamps=false")
            && !r.contains("since=")),
        "{requests:?}"
    );

    // tail: the engine sends the last three entries (frames); the first is a fragment
    // whose line began earlier, so two lines come back.
    let tail = logs(&client, json!({"container": "web", "tail": 3})).await;
    assert_eq!(lines(&tail), web_lines()[5..].to_vec());
    assert!(engine.requests().iter().any(|r| r.contains("tail=3")));

    let stderr_only = logs(&client, json!({"container": "web", "stdout": false})).await;
    assert_eq!(
        texts(&stderr_only),
        ["warning: disk almost full", "err two", "err three"]
    );
    assert!(lines(&stderr_only).iter().all(|l| l["stream"] == "stderr"));
    let stdout_only = logs(&client, json!({"container": "web", "stderr": false})).await;
    assert_eq!(
        lines(&stdout_only),
        web_lines()
            .into_iter()
            .filter(|l| l["stream"] == "stdout")
            .collect::<Vec<_>>()
    );
    let neither = client
        .call(
            "docker.logs",
            json!({"container": "web", "stdout": false, "stderr": false}),
        )
        .await
        .err("invalid_arguments", "no stream chosen");
    assert!(neither.contains("stdout"), "{neither}");

    // since: a duration ago, or unix seconds.
    let recent = logs(&client, json!({"container": "web", "since": "10m"})).await;
    assert_eq!(texts(&recent), ["last line"]);
    let recent = logs(&client, json!({"container": "web", "since": now() - 60})).await;
    assert_eq!(texts(&recent), ["last line"]);
    let bad_since = client
        .call(
            "docker.logs",
            json!({"container": "web", "since": "yesterday-ish"}),
        )
        .await
        .err("invalid_arguments", "an unreadable since");
    assert!(bad_since.contains("since"), "{bad_since}");

    let stamped = logs(
        &client,
        json!({"container": "web", "timestamps": true, "tail": 1}),
    )
    .await;
    let text = texts(&stamped).remove(0);
    let (stamp, rest) = text
        .split_once(' ')
        .expect("a timestamp, a space, the line");
    assert_eq!(rest, "last line");
    assert!(
        stamp.len() == 30 && stamp.ends_with('Z') && stamp.as_bytes()[10] == b'T',
        "{stamp}"
    );

    // A TTY container's stream is raw: everything is stdout.
    let tty = logs(&client, json!({"container": "worker-1"})).await;
    assert_eq!(
        lines(&tty),
        vec![
            json!({"stream": "stdout", "text": "\u{1b}[32mgreen\u{1b}[0m tty one"}),
            json!({"stream": "stdout", "text": "tty two"}),
        ]
    );
    assert_eq!(tty["truncated"], false);

    // Past 1 MiB of text the oldest lines go and the newest stay.
    let big = logs(&client, json!({"container": "worker-big", "tail": 5000})).await;
    assert_eq!(big["truncated"], true);
    let big_texts = texts(&big);
    let total: usize = big_texts.iter().map(String::len).sum();
    assert!(total <= 1024 * 1024, "{total} bytes of text");
    assert!(total > 1000 * 1024, "only {total} bytes of text kept");
    assert!(big_texts.last().expect("lines").starts_with("big 2999 "));
    assert!(big_texts.len() < 3000);
    let first: usize = big_texts[0][4..8].parse().expect("a line number");
    assert_eq!(
        first + big_texts.len(),
        3000,
        "the kept lines are the newest, in order"
    );

    client.close().await;
    d.assert_no_secrets();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn containers_outside_the_allow_list_never_reach_the_engine() {
    let d = Daemon::builder().extra(DOCKER).extra(ALLOW_ACTION).start();
    let engine = FakeEngine::start(d.dir());
    table(&engine);
    let client = McpClient::connect(&d, &d.bearer()).await;

    let message = client
        .call("docker.logs", json!({"container": "db"}))
        .await
        .err("permission_denied", "a container outside the list");
    assert!(message.contains("container db is not among"), "{message}");
    client
        .call(
            "docker.action",
            json!({"container": "db", "action": "stop"}),
        )
        .await
        .err("permission_denied", "an action outside the list");
    assert!(engine.requests().is_empty(), "{:?}", engine.requests());

    for bad in [
        "../web",
        "web/../db",
        "-web",
        "web?all=1",
        "web db",
        "wéb",
        "",
    ] {
        client
            .call("docker.logs", json!({"container": bad}))
            .await
            .err("invalid_arguments", &format!("docker.logs {bad:?}"));
        client
            .call(
                "docker.action",
                json!({"container": bad, "action": "restart"}),
            )
            .await
            .err("invalid_arguments", &format!("docker.action {bad:?}"));
    }
    assert!(engine.requests().is_empty(), "{:?}", engine.requests());
    assert_eq!(engine.container("db").map(|c| c.running), Some(true));

    // An ID (or ID prefix) that matches the allow-list resolves to `db`: refused, and
    // nothing past the lookup is asked.
    for alias in [DB_ID, &DB_ID[..10]] {
        let message = client
            .call("docker.logs", json!({"container": alias}))
            .await
            .err("permission_denied", &format!("docker.logs by ID {alias}"));
        assert!(message.contains(alias), "{message}");
        client
            .call(
                "docker.action",
                json!({"container": alias, "action": "stop"}),
            )
            .await
            .err("permission_denied", &format!("docker.action by ID {alias}"));
    }
    let requests = engine.requests();
    assert_eq!(requests.len(), 4, "{requests:?}");
    assert!(
        requests
            .iter()
            .all(|r| r.starts_with("GET ") && r.ends_with("/json")),
        "{requests:?}"
    );
    assert_eq!(engine.container("db").map(|c| c.running), Some(true));

    // Allowed but unknown to the engine.
    let message = client
        .call("docker.logs", json!({"container": "worker-9"}))
        .await
        .err("invalid_arguments", "an unknown container");
    assert!(message.contains("no such container"), "{message}");
    client
        .call(
            "docker.action",
            json!({"container": "worker-9", "action": "start"}),
        )
        .await
        .err("invalid_arguments", "an action on an unknown container");

    client.close().await;
    d.assert_no_secrets();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn actions_are_jobs_with_the_engine_answer() {
    let d = Daemon::builder().extra(DOCKER).extra(ALLOW_ACTION).start();
    let engine = FakeEngine::start(d.dir());
    table(&engine);
    let client = McpClient::connect(&d, &d.bearer()).await;

    let (done, output) = action(&client, "web", "restart").await;
    assert_eq!(done["state"], "succeeded", "{done}");
    assert_eq!(done["detail"], "container web restarted", "{done}");
    assert!(output.contains("restart container web"), "{output}");
    assert!(output.contains("204"), "{output}");
    assert!(output.contains("container web restarted"), "{output}");
    // After the by-name lookup every request names the container's id, so a container
    // renamed or recreated in between is never the one acted on.
    let web = id_of(&engine, "web");
    assert_eq!(
        posts(&engine),
        [format!("POST /v1.41/containers/{web}/restart")]
    );

    // Already running: the engine answers 304.
    let (done, output) = action(&client, "web", "start").await;
    assert_eq!(done["state"], "succeeded", "{done}");
    assert!(
        done["detail"]
            .as_str()
            .unwrap_or_default()
            .contains("already started"),
        "{done}"
    );
    assert!(output.contains("304"), "{output}");

    let (done, _) = action(&client, "worker-2", "start").await;
    assert_eq!(done["state"], "succeeded", "{done}");
    assert_eq!(engine.container("worker-2").map(|c| c.running), Some(true));
    let (done, _) = action(&client, "worker-2", "stop").await;
    assert_eq!(done["detail"], "container worker-2 stopped", "{done}");
    assert_eq!(engine.container("worker-2").map(|c| c.running), Some(false));
    let (done, _) = action(&client, "worker-2", "stop").await;
    assert_eq!(done["state"], "succeeded", "{done}");
    assert!(
        done["detail"]
            .as_str()
            .unwrap_or_default()
            .contains("already stopped"),
        "{done}"
    );

    // The container goes between the lookup and the action: the job fails.
    engine.add(Container::new("worker-3", "aa33").stopped());
    engine.vanish_after_inspect("worker-3");
    let (done, output) = action(&client, "worker-3", "start").await;
    assert_eq!(done["state"], "failed", "{done}");
    assert_eq!(done["detail"], "no such container: worker-3", "{done}");
    assert!(output.contains("404"), "{output}");
    assert_eq!(
        posts(&engine),
        [
            format!("POST /v1.41/containers/{web}/restart"),
            format!("POST /v1.41/containers/{web}/start"),
            format!(
                "POST /v1.41/containers/{}/start",
                id_of(&engine, "worker-2")
            ),
            format!("POST /v1.41/containers/{}/stop", id_of(&engine, "worker-2")),
            format!("POST /v1.41/containers/{}/stop", id_of(&engine, "worker-2")),
            "POST /v1.41/containers/aa33/start".to_owned(),
        ],
        "one POST per action, never retried"
    );

    client.close().await;
    d.assert_no_secrets();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_engine_is_unavailable_at_once() {
    let d = Daemon::builder().extra(DOCKER).extra(ALLOW_ACTION).start();
    let client = McpClient::connect(&d, &d.bearer()).await;
    let socket = d.dir().join("docker.sock");
    assert!(!socket.exists());

    let started = Instant::now();
    let message = client
        .call("docker.logs", json!({"container": "web"}))
        .await
        .err("unavailable", "docker.logs with no engine");
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(
        message,
        format!(
            "the Docker Engine API is not reachable at {}",
            socket.display()
        )
    );
    client
        .call(
            "docker.action",
            json!({"container": "web", "action": "restart"}),
        )
        .await
        .err("unavailable", "docker.action with no engine");
    client.close().await;
    d.assert_no_secrets();

    // No containers configured: the tools are listed and answer `unavailable`.
    let d = Daemon::builder()
        .extra("[tools.docker]\nsocket = \"@DIR@/docker.sock\"\n")
        .extra(ALLOW_ACTION)
        .start();
    let engine = FakeEngine::start(d.dir());
    table(&engine);
    let client = McpClient::connect(&d, &d.bearer()).await;
    let names = client.tool_names().await;
    assert!(names.iter().any(|n| n == "docker.logs"), "{names:?}");
    assert!(names.iter().any(|n| n == "docker.action"), "{names:?}");
    client
        .call("docker.logs", json!({"container": "web"}))
        .await
        .err("unavailable", "docker.logs with no containers configured");
    client
        .call(
            "docker.action",
            json!({"container": "web", "action": "start"}),
        )
        .await
        .err("unavailable", "docker.action with no containers configured");
    assert!(engine.requests().is_empty(), "{:?}", engine.requests());
    client.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn actions_need_a_policy_rule_and_logs_do_not() {
    let d = Daemon::builder().extra(DOCKER).start();
    let engine = FakeEngine::start(d.dir());
    table(&engine);
    let client = McpClient::connect(&d, &d.bearer()).await;

    client
        .call(
            "docker.action",
            json!({"container": "web", "action": "restart"}),
        )
        .await
        .err("permission_denied", "docker.action without a policy rule");
    assert!(engine.requests().is_empty(), "{:?}", engine.requests());

    let all = within(
        Duration::from_secs(30),
        "docker.logs",
        logs(&client, json!({"container": "web"})),
    )
    .await;
    assert_eq!(lines(&all), web_lines());
    assert!(posts(&engine).is_empty());

    client.close().await;
    d.assert_no_secrets();
}
