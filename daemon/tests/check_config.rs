//! `robota-mcpd check-config` and `default-config` on the real binary: exit codes and
//! key paths in messages.

use std::process::{Command, Output};

fn mcpd(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_robota-mcpd"))
        .args(args)
        .env_clear()
        .env("RUNTIME_DIRECTORY", "/run/robota-mcpd-test")
        .env("STATE_DIRECTORY", "/var/lib/robota-mcpd-test")
        .output()
        .expect("run robota-mcpd")
}

fn check(text: &str) -> (i32, String) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("config.toml");
    std::fs::write(&path, text).unwrap();
    let out = mcpd(&["check-config", "--config", path.to_str().unwrap()]);
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn the_embedded_default_prints_and_checks() {
    let printed = mcpd(&["default-config"]);
    assert!(printed.status.success());
    let text = String::from_utf8(printed.stdout).unwrap();
    assert!(text.contains("[loopback]"));
    let (code, err) = check(&text);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("configuration OK"), "{err}");
}

#[test]
fn errors_name_their_key_and_exit_78() {
    let cases = [
        ("[loopback]\nlisten = \"0.0.0.0:8765\"\n", "loopback.listen"),
        (
            "[loopback]\nlisten = \"127.0.0.1:1\"\nlisten_everywhere = true\n",
            "loopback.listen_everywhere",
        ),
        (
            "[limits]\nrequest_body = \"17MiB\"\n",
            "limits.request_body",
        ),
        (
            "[session.turn]\nargv = [\"/bin/true\"]\ntimeout = \"a while\"\n",
            "session.turn.timeout",
        ),
        (
            "[[policy]]\ncallers = [\"root\"]\ntools = [\"x\"]\ndecision = \"allow\"\n",
            "policy[0].callers[0]",
        ),
        (
            "[loopback]\nwire_names = \"compat\"\n[session]\nsubmission_tool = \"system_info\"\n",
            "loopback.aliases",
        ),
        (
            "[session]\nsubmission_tool = \"system.info\"\n",
            "collides with the runtime tool \"system.info\"",
        ),
        ("this is not toml", "syntax: key with no value"),
        (
            "[remote]\npublic_url = \"https://h/mcp\"\nissuer = \"https://a\"\nallowed_subjects = [\"*\"]\n",
            "remote: an allowed subject",
        ),
        (
            "[remote]\npublic_url = \"https://h/mcp\"\nissuer = \"https://a\"\nallowed_clients = [\"c\"]\n\
             wire_names = \"compat\"\n[session]\nsubmission_tool = \"system_info\"\n",
            "aliases",
        ),
        (
            "[remote]\npublic_url = \"https://h/mcp\"\nissuer = \"https://a\"\nallowed_clients = [\"c\"]\n\
             trusted_proxies = [\"0.0.0.0/0\"]\n",
            "remote.trusted_proxies[0]: 0.0.0.0/0 trusts too many addresses",
        ),
        (
            "[remote]\npublic_url = \"https://h/mcp\"\nissuer = \"https://a\"\nallowed_clients = [\"c\"]\n\
             trusted_proxies = [\"::1\", \"::/0\"]\n",
            "remote.trusted_proxies[1]: ::/0 trusts too many addresses",
        ),
        (
            "[remote]\npublic_url = \"https://h/mcp\"\nissuer = \"https://a\"\nallowed_clients = [\"c\"]\n\
             trusted_proxies = [\"0.0.0.0/1\", \"128.0.0.0/1\"]\n",
            "remote.trusted_proxies[0]: 0.0.0.0/1 trusts too many addresses",
        ),
        (
            "[loopback]\nlisten = \"127.0.0.1:9464\"\n",
            "metrics.listen: 127.0.0.1:9464 is also loopback.listen",
        ),
        (
            "[tools.permissions]\nmax_duration = \"18446744073709551615s\"\n",
            "tools.permissions.max_duration: duration",
        ),
    ];
    for (text, needle) in cases {
        let (code, err) = check(text);
        let err = without_places(&err);
        assert_eq!(code, 78, "{text:?} → {err}");
        assert!(
            err.contains(needle),
            "{text:?}: expected {needle:?} in {err:?}"
        );
    }
}

/// `err` without the ` (line L, column C)` after each key, so needles can be `key: problem`.
fn without_places(err: &str) -> String {
    let mut out = String::new();
    let mut rest = err;
    while let Some(at) = rest.find(" (line ") {
        out.push_str(&rest[..at]);
        rest = &rest[at..];
        match rest.find(')') {
            Some(end) => rest = &rest[end + 1..],
            None => break,
        }
    }
    out.push_str(rest);
    out
}

#[test]
fn a_missing_file_is_a_configuration_error() {
    let out = mcpd(&["check-config", "--config", "/nonexistent/robota-mcpd.toml"]);
    assert_eq!(out.status.code(), Some(78));
    assert!(String::from_utf8_lossy(&out.stderr).contains("/nonexistent/robota-mcpd.toml"));
}

#[test]
fn a_trusted_public_net_is_a_warning_not_an_error() {
    let (code, err) = check(
        "[remote]\npublic_url = \"https://h/mcp\"\nissuer = \"https://a\"\nallowed_clients = [\"c\"]\n\
         trusted_proxies = [\"127.0.0.1\", \"198.51.100.0/24\"]\n",
    );
    assert_eq!(code, 0, "{err}");
    assert!(
        err.contains("warning")
            && without_places(&err)
                .contains("remote.trusted_proxies[1]: 198.51.100.0/24 holds public addresses"),
        "{err}"
    );
    assert!(err.contains("configuration OK"), "{err}");
    let (code, err) = check(
        "[remote]\npublic_url = \"https://h/mcp\"\nissuer = \"https://a\"\nallowed_clients = [\"c\"]\n\
         trusted_proxies = [\"127.0.0.1\", \"10.0.0.0/8\"]\n",
    );
    assert_eq!(code, 0, "{err}");
    assert!(!err.contains("warning"), "{err}");
}
