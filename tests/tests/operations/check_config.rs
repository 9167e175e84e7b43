//! `check-config` catches what would fail in service, naming the key and its line: policy
//! patterns that match nothing, missing job programs, roots the daemon's user cannot use
//! or the unit's sandbox makes read-only; the same problems stop a start.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use robota_e2e::daemon::{check_config, check_config_with};
use robota_e2e::{Daemon, EXIT_CONFIG};

fn write(dir: &Path, name: &str, text: &str) -> std::path::PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, text).expect("write");
    path
}

fn line_of(text: &str, needle: &str) -> usize {
    text.lines()
        .position(|l| l.contains(needle))
        .expect("needle")
        + 1
}

#[test]
fn patterns_that_match_nothing_and_missing_programs_are_named_with_their_line() {
    let dir = tempfile::tempdir().expect("tempdir");
    let text = "[[policy]]\ncallers = [\"bearer:defualt\"]\ntools = [\"file.reed\"]\ndecision = \"deny\"\n\n[jobs.backup]\nargv = [\"/nonexistent/backup\", \"--all\"]\n";
    let path = write(dir.path(), "c.toml", text);
    let out = check_config(&path);
    out.expect_code(EXIT_CONFIG, "check-config of a typo'd policy");
    let tools_line = line_of(text, "file.reed");
    assert!(
        out.stderr
            .contains(&format!("policy[0].tools[0] (line {tools_line}")),
        "{}",
        out.stderr
    );
    assert!(
        out.stderr.contains("did you mean \"file.read\""),
        "{}",
        out.stderr
    );
    assert!(
        out.stderr.contains(&format!(
            "jobs.backup.argv[0] (line {}",
            line_of(text, "argv")
        )),
        "{}",
        out.stderr
    );
    // The caller typo is a warning (bearers come and go), with its suggestion.
    assert!(
        out.stderr.contains("warning") && out.stderr.contains("did you mean \"bearer:default\""),
        "{}",
        out.stderr
    );

    // A start refuses the same file, naming the same problems.
    let d = Daemon::builder()
        .extra("[[policy]]\ncallers = [\"*\"]\ntools = [\"file.reed\"]\ndecision = \"deny\"\n")
        .spawn();
    let status = d
        .wait_exit(std::time::Duration::from_secs(15))
        .expect("the start must fail");
    assert_eq!(status.code(), Some(EXIT_CONFIG));
    assert!(d.stderr_text().contains("file.reed"), "{}", d.stderr_text());
}

#[test]
fn as_user_checks_what_that_user_can_reach() {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let private = dir.path().join("private");
    std::fs::create_dir(&private).expect("mkdir");
    std::fs::set_permissions(&private, std::fs::Permissions::from_mode(0o700)).expect("chmod");
    let open = dir.path().join("open");
    std::fs::create_dir(&open).expect("mkdir");
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let state = dir.path().join("state");
    let text = format!(
        "[daemon]\nstate_dir = \"{}\"\n\n[tools.file]\nread_roots = [\"{}\", \"{}\"]\n",
        state.display(),
        open.display(),
        private.display()
    );
    let path = write(dir.path(), "c.toml", &text);
    // As the user who owns it all (root here), it passes …
    check_config(&path).expect_code(0, "check-config as the owner");
    // … as `nobody` the private root and the state directory are refused, each named.
    let out = check_config_with(&path, &["--as-user", "nobody"]);
    out.expect_code(EXIT_CONFIG, "check-config --as-user nobody");
    assert!(
        out.stderr.contains("tools.file.read_roots[1]")
            && out.stderr.contains("nobody cannot list"),
        "{}",
        out.stderr
    );
    assert!(
        !out.stderr.contains("read_roots[0]"),
        "the open root is fine: {}",
        out.stderr
    );
    assert!(out.stderr.contains("daemon.state_dir"), "{}", out.stderr);
    check_config_with(&path, &["--as-user", "no-such-user-here"])
        .expect_code(2, "an unknown user is a usage error");
}

#[test]
fn the_units_sandbox_decides_what_a_write_root_may_be() {
    // Not under /tmp, /var/tmp or a home, which the unit hides (checked below), wherever
    // the checkout is: /run is none of them.
    let dir = tempfile::Builder::new()
        .prefix("robota-e2e-")
        .tempdir_in("/run")
        .expect("a directory under /run (the e2e tests run as root)");
    let root = dir.path().join("data");
    std::fs::create_dir(&root).expect("mkdir");
    let text = format!("[tools.file]\nwrite_roots = [\"{}\"]\n", root.display());
    let path = write(dir.path(), "c.toml", &text);
    let shipped = Path::new(env!("CARGO_MANIFEST_DIR")).join("../systemd/robota-mcpd.service");
    let unit = shipped.display().to_string();
    let out = check_config_with(&path, &["--unit", &unit]);
    out.expect_code(EXIT_CONFIG, "a write root the shipped unit makes read-only");
    assert!(
        out.stderr.contains("tools.file.write_roots[0]")
            && out
                .stderr
                .contains(&format!("ReadWritePaths={}", root.display())),
        "{}",
        out.stderr
    );
    // The drop-in the message asks for makes it pass.
    let mut relaxed = std::fs::read_to_string(&shipped).expect("unit");
    relaxed.push_str(&format!("\n[Service]\nReadWritePaths={}\n", root.display()));
    let relaxed_unit = write(dir.path(), "robota-mcpd.service", &relaxed);
    let out = check_config_with(&path, &["--unit", &relaxed_unit.display().to_string()]);
    assert!(
        !out.stderr.contains("is read-only for the service"),
        "{}",
        out.stderr
    );
    // Under /tmp the root is not what the service sees at all.
    let tmp = tempfile::tempdir().expect("tempdir");
    let text = format!(
        "[tools.file]\nwrite_roots = [\"{}\"]\n",
        tmp.path().display()
    );
    let path = write(tmp.path(), "c.toml", &text);
    let out = check_config_with(&path, &["--unit", &unit]);
    out.expect_code(EXIT_CONFIG, "a write root under the unit's private /tmp");
    assert!(out.stderr.contains("PrivateTmp=yes"), "{}", out.stderr);
}

#[test]
fn the_introspection_secret_is_read_as_the_start_reads_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let jwks = write(dir.path(), "jwks.json", r#"{"keys":[]}"#);
    let secret = write(dir.path(), "secret", "s3cr3t-for-the-issuer\n");
    let text = format!(
        "[daemon]\nstate_dir = \"{state}\"\n\n[remote]\nlisten = \"127.0.0.1:0\"\npublic_url = \"https://mcp.example.com/mcp\"\nissuer = \"https://auth.example.com\"\njwks_file = \"{jwks}\"\nallowed_clients = [\"client-a\"]\n\n[remote.introspection]\nclient_id = \"robota-mcpd\"\nclient_secret_file = \"{secret}\"\n",
        state = dir.path().join("state").display(),
        jwks = jwks.display(),
        secret = secret.display(),
    );
    let path = write(dir.path(), "c.toml", &text);
    let key = "remote.introspection.client_secret_file";
    // Readable by others: the start would refuse it, so check-config does.
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o644)).expect("chmod");
    let out = check_config(&path);
    out.expect_code(EXIT_CONFIG, "check-config with a world-readable secret");
    assert!(out.stderr.contains(key), "{}", out.stderr);
    assert!(
        !out.stderr.contains("s3cr3t"),
        "the secret is shown: {}",
        out.stderr
    );
    // Private and root's: as root it passes; as nobody it cannot be read at all.
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600)).expect("chmod");
    check_config(&path).expect_code(0, "check-config with a private secret");
    let out = check_config_with(&path, &["--as-user", "nobody"]);
    out.expect_code(EXIT_CONFIG, "check-config --as-user nobody");
    assert!(
        out.stderr.contains(key) && out.stderr.contains("nobody cannot read"),
        "{}",
        out.stderr
    );
    // Empty: not a secret.
    std::fs::write(&secret, "").expect("truncate");
    let out = check_config(&path);
    out.expect_code(EXIT_CONFIG, "check-config with an empty secret file");
    assert!(out.stderr.contains(key), "{}", out.stderr);
}

#[test]
fn a_grant_that_meets_the_daemons_own_paths_is_a_warning_naming_them() {
    let dir = tempfile::tempdir().expect("tempdir");
    let state = dir.path().join("state");
    std::fs::create_dir_all(&state).expect("state dir");
    let link = dir.path().join("looks-harmless");
    std::os::unix::fs::symlink(&state, &link).expect("link");
    let beside = dir.path().join("data");
    std::fs::create_dir_all(&beside).expect("data dir");
    let upstream = format!(
        "[upstreams.x]\ncommand = [\"/bin/true\"]\nread_paths = [\"{}\", \"{}\"]\nwrite_paths = [\"{}\"]\n",
        link.display(),
        beside.display(),
        dir.path().display()
    );
    let text = Daemon::builder().extra(&upstream).config_text(dir.path());
    let path = write(dir.path(), "c.toml", &text);
    let out = check_config(&path);
    out.expect_code(0, "check-config with grants meeting the state directory");
    let state = std::fs::canonicalize(&state).expect("canonical");
    let warning = |key: &str| {
        out.stderr
            .lines()
            .find(|l| l.contains("warning") && l.contains(key))
            .unwrap_or_else(|| panic!("no warning for {key}: {}", out.stderr))
            .to_owned()
    };
    let read = warning("upstreams.x.read_paths[0]");
    assert!(
        read.contains(&format!("a link to {}", state.display()))
            && read.contains("the upstream is given nothing of it"),
        "{read}"
    );
    let write_ = warning("upstreams.x.write_paths[0]");
    assert!(
        write_.contains(&format!("holds {}", state.display()))
            && write_.contains("grant a directory beside the daemon's"),
        "{write_}"
    );
    assert!(
        !out.stderr.contains("read_paths[1]"),
        "a directory beside the daemon's is fine: {}",
        out.stderr
    );
}
