//! `robota-docgen OUT_DIR`: the man pages and shell completions of `robota-mcpd` and
//! `robota-mcpctl`, generated from their clap definitions for the Debian package.
//!
//! The two binaries' `cli.rs` files are compiled in here as modules (`#[path]`), so the
//! pages and completions cannot drift from the flags: a new subcommand gets its page and
//! its completion at the next package build. What clap does not know (signals, files,
//! environment) is added here as extra man page sections.
//!
//! Output layout, which `daemon/Cargo.toml`'s `[package.metadata.deb]` assets name:
//! `man/man1/*.1`, `man/man8/*.8` (a tree `MANPATH` can point at), and
//! `completions/{bash,zsh,fish}/…` under the names each shell looks for.

use std::fs;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Command, CommandFactory};
use clap_complete::Shell;
use clap_mangen::Man;
use clap_mangen::roff::{Inline, Roff, bold, italic, roman};

#[allow(dead_code)] // only the clap definitions are used here
#[path = "../../../daemon/src/cli.rs"]
mod mcpd_cli;

#[allow(dead_code)] // only the clap definitions are used here
#[path = "../../../ctl/src/cli.rs"]
mod mcpctl_cli;

const VERSION: &str = env!("CARGO_PKG_VERSION");
const MANUAL: &str = "robota-mcpd Manual";

/// `robota-mcpd`'s exit codes (`robota_mcpd::exit`; a test keeps them in sync).
const DAEMON_EXIT: [(i32, &str); 4] = [
    (0, "clean stop"),
    (
        1,
        "runtime failure: a bind failed, a carrier could not start, a restart failed",
    ),
    (2, "bad command line"),
    (
        78,
        "invalid configuration (EX_CONFIG); the systemd unit does not restart on it",
    ),
];

fn main() -> ExitCode {
    let Some(out) = std::env::args_os().nth(1).map(PathBuf::from) else {
        eprintln!("usage: robota-docgen OUT_DIR");
        return ExitCode::from(2);
    };
    match generate(&out) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("robota-docgen: {}: {e}", out.display());
            ExitCode::FAILURE
        }
    }
}

/// Every page and completion script under `out`.
fn generate(out: &Path) -> io::Result<()> {
    for page in pages() {
        let dir = out.join("man").join(format!("man{}", page.section));
        fs::create_dir_all(&dir)?;
        fs::write(dir.join(&page.file), page.render()?)?;
    }
    for (shell, dir, file) in completion_files() {
        let dir = out.join("completions").join(dir);
        fs::create_dir_all(&dir)?;
        for (bin, mut cmd) in [("robota-mcpd", daemon()), ("robota-mcpctl", ctl())] {
            let mut buf = Vec::new();
            clap_complete::generate(shell, &mut cmd, bin, &mut buf);
            fs::write(dir.join(file(bin)), buf)?;
        }
    }
    Ok(())
}

fn daemon() -> Command {
    mcpd_cli::Args::command()
}

fn ctl() -> Command {
    mcpctl_cli::Cli::command()
}

type FileName = fn(&str) -> String;

/// Each shell, its directory under `completions/`, and the file name it looks for.
fn completion_files() -> [(Shell, &'static str, FileName); 3] {
    [
        (Shell::Bash, "bash", |bin| bin.to_owned()),
        (Shell::Zsh, "zsh", |bin| format!("_{bin}")),
        (Shell::Fish, "fish", |bin| format!("{bin}.fish")),
    ]
}

/// One man page: a clap command plus the sections clap cannot know.
struct Page {
    file: String,
    cmd: Command,
    section: &'static str,
    extra: Roff,
}

impl Page {
    fn render(&self) -> io::Result<Vec<u8>> {
        let man = Man::new(self.cmd.clone())
            .section(self.section)
            .source(format!("robota-mcpd {VERSION}"))
            .manual(MANUAL);
        let mut w = Vec::new();
        man.render_title(&mut w)?;
        man.render_name_section(&mut w)?;
        man.render_synopsis_section(&mut w)?;
        man.render_description_section(&mut w)?;
        if self.cmd.get_arguments().any(|a| !a.is_hide_set()) {
            man.render_options_section(&mut w)?;
        }
        if self.cmd.has_subcommands() {
            man.render_subcommands_section(&mut w)?;
        }
        if let Some(after) = self.cmd.get_after_help() {
            after_help(&after.to_string()).to_writer(&mut w)?;
        }
        self.extra.to_writer(&mut w)?;
        w.flush()?;
        Ok(w)
    }
}

/// Every page: each command and each of its subcommands, recursively, as
/// `robota-mcpctl-bearer-issue.1` (git's convention, clap_mangen's too).
fn pages() -> Vec<Page> {
    let mut pages = Vec::new();
    collect(daemon(), "8", &mut pages);
    collect(ctl(), "1", &mut pages);
    pages
}

fn collect(cmd: Command, section: &'static str, pages: &mut Vec<Page>) {
    let mut cmd = cmd.disable_help_subcommand(true);
    cmd.build();
    walk(&cmd, None, section, pages);
}

fn walk(cmd: &Command, parent: Option<&str>, section: &'static str, pages: &mut Vec<Page>) {
    let name = cmd
        .get_display_name()
        .unwrap_or_else(|| cmd.get_name())
        .to_owned();
    for sub in cmd.get_subcommands().filter(|s| !s.is_hide_set()) {
        walk(sub, Some(&name), section, pages);
    }
    let extra = match (name.as_str(), parent) {
        ("robota-mcpd", _) => daemon_sections(),
        ("robota-mcpctl", _) => ctl_sections(),
        (_, Some(parent)) => see_also(&[(parent, section)]),
        (_, None) => Roff::new(),
    };
    pages.push(Page {
        file: format!("{name}.{section}"),
        cmd: cmd.clone(),
        section,
        extra,
    });
}

/// The `after_help` text of the ctl commands as man sections: an "Example(s):" paragraph
/// becomes EXAMPLES, "Exit codes:" becomes EXIT STATUS, anything else NOTES. Indented
/// lines (commands, JSON) keep their line breaks; prose is filled.
fn after_help(text: &str) -> Roff {
    let mut roff = Roff::new();
    let mut notes_open = false;
    for paragraph in text.split("\n\n") {
        let mut lines = paragraph.lines().peekable();
        let Some(first) = lines.peek().copied() else {
            continue;
        };
        if first.starts_with("Example") && first.ends_with(':') {
            lines.next();
            roff.control("SH", ["EXAMPLES"]);
        } else if let Some(rest) = first.strip_prefix("Exit codes:") {
            lines.next();
            roff.control("SH", ["EXIT STATUS"]);
            roff.text([roman(rest.trim())]);
        } else if !notes_open {
            roff.control("SH", ["NOTES"]);
            notes_open = true;
        } else {
            roff.control("PP", []);
        }
        let mut literal = false;
        for line in lines {
            let indented = line.starts_with("  ");
            if indented && !literal {
                roff.control("RS", ["4"]).control("nf", []);
            } else if !indented && literal {
                roff.control("fi", []).control("RE", []);
            }
            literal = indented;
            roff.text([roman(line.trim())]);
        }
        if literal {
            roff.control("fi", []).control("RE", []);
        }
    }
    roff
}

fn daemon_sections() -> Roff {
    let mut r = Roff::new();
    r.control("SH", ["OPERATION"]);
    r.text([roman(
        "Without --stdio, robota-mcpd runs as a daemon: it validates the configuration and \
         the tool catalog, binds the control socket, the metrics listener and every enabled \
         carrier (loopback Streamable HTTP with a bearer minted at each start; remote \
         Streamable HTTP as an OAuth 2 resource server), and only then reports readiness to \
         systemd (Type=notify). It is managed with ",
    )]);
    r.text([bold("robota-mcpctl"), roman("(1).")]);
    r.control("PP", []);
    r.text([roman(
        "It can also front MCP servers already on the host: each [upstreams.<name>] table of \
         the configuration (a command to start, or the URL of a local Streamable HTTP \
         server) has its tools served as <name>.<tool>, behind the same policy, audit and \
         metrics; robota-mcpctl upstreams shows them.",
    )]);
    r.control("PP", []);
    r.text([roman(
        "With --stdio it serves the catalog to the client that launched it, on stdin and \
         stdout, with no control socket and no HTTP listener; logs go to stderr.",
    )]);

    r.control("SH", ["SIGNALS"]);
    for (signal, meaning) in [
        (
            "SIGTERM, SIGINT",
            "Graceful stop: in-flight requests get a bounded grace, then the daemon exits 0.",
        ),
        (
            "SIGHUP",
            "Reload: the configuration file is read and checked again. Valid, it is served \
             on a fresh session (RELOADING=1, then READY=1); listeners whose address did not \
             change keep their sockets, and the host bearer and every labelled bearer carry \
             on unless [loopback] changed. Invalid, nothing changes: every problem is logged \
             and shown by robota-mcpctl status. systemctl reload robota-mcpd runs \
             robota-mcpctl reload, which does the same and fails (exit 78, the problems in \
             the journal) when the file is refused. robota-mcpctl restart is the reload with \
             a new host bearer. daemon.state_dir, daemon.runtime_dir and [control] socket \
             take a new process (systemctl restart robota-mcpd).",
        ),
    ] {
        tagged(&mut r, bold(signal), meaning);
    }

    r.control("SH", ["EXIT STATUS"]);
    for (code, meaning) in DAEMON_EXIT {
        tagged(&mut r, bold(code.to_string()), meaning);
    }

    r.control("SH", ["ENVIRONMENT"]);
    for (var, meaning) in [
        (
            "RUNTIME_DIRECTORY",
            "The runtime directory (set by systemd's RuntimeDirectory=); else \
             $XDG_RUNTIME_DIR/robota-mcpd, else /run/robota-mcpd.",
        ),
        (
            "STATE_DIRECTORY",
            "The state directory (set by systemd's StateDirectory=); else \
             /var/lib/robota-mcpd (or $XDG_STATE_HOME/robota-mcpd when not root).",
        ),
        (
            "JOURNAL_STREAM",
            "When it names stderr, logs go to the journal with structured fields.",
        ),
        (
            "NOTIFY_SOCKET, WATCHDOG_USEC",
            "systemd readiness and watchdog (READY=1, STOPPING=1, WATCHDOG=1).",
        ),
        ("RUST_LOG", "Log filter, e.g. info or robota_mcpd=debug."),
    ] {
        tagged(&mut r, bold(var), meaning);
    }

    r.control("SH", ["FILES"]);
    for (path, meaning) in [
        (
            "/etc/robota-mcpd/config.toml",
            "The configuration, when present and no --config is given; else the embedded \
             default (robota-mcpd default-config prints it). Read at start and at every \
             reload: validate edits with robota-mcpd check-config, then systemctl reload \
             robota-mcpd.",
        ),
        (
            "/run/robota-mcpd/control.sock",
            "The control socket (mode 0660), next to its lock file control.lock.",
        ),
        (
            "/var/lib/robota-mcpd/audit.jsonl",
            "Refusal audit records; read them with robota-mcpctl audit.",
        ),
        (
            "/var/lib/robota-mcpd/jwks-cache.json",
            "The last good key set of the OAuth issuer (remote carrier).",
        ),
        (
            "/usr/share/doc/robota-mcpd/",
            "README, architecture, control protocol, metrics, operations and packaging notes.",
        ),
    ] {
        tagged(&mut r, italic(path), meaning);
    }
    r.extend([see_also(&[
        ("robota-mcpctl", "1"),
        ("systemd.service", "5"),
        ("systemd.exec", "5"),
    ])]);
    r
}

fn ctl_sections() -> Roff {
    let mut r = Roff::new();
    r.control("SH", ["ENVIRONMENT"]);
    tagged(
        &mut r,
        bold(robota_proto::SOCKET_ENV),
        "The control socket, as --socket.",
    );
    tagged(
        &mut r,
        bold("XDG_RUNTIME_DIR"),
        "When set and $XDG_RUNTIME_DIR/robota-mcpd/control.sock exists, that is the \
         default socket (a daemon run by a user); else /run/robota-mcpd/control.sock.",
    );
    r.control("SH", ["PERMISSIONS"]);
    r.text([roman(
        "The daemon accepts root, its own user, and the uids and gids listed in [control] \
         allow_uids and allow_gids of its configuration (a gid matches the peer's primary \
         group, as SO_PEERCRED reports it, or any of its supplementary groups, as id -G \
         shows them). The packaged socket is mode 0660, group robota-mcpd. Refused peers \
         get exit status 4 and leave an audit record.",
    )]);
    r.extend([see_also(&[("robota-mcpd", "8")])]);
    r
}

/// A `.TP` item: a term, then its description indented below it.
fn tagged(r: &mut Roff, term: Inline, text: &str) {
    r.control("TP", []).text([term]).text([roman(text)]);
}

fn see_also(pages: &[(&str, &str)]) -> Roff {
    let mut r = Roff::new();
    r.control("SH", ["SEE ALSO"]);
    let mut line = Vec::new();
    for (i, (name, section)) in pages.iter().enumerate() {
        if i > 0 {
            line.push(roman(", "));
        }
        line.push(bold(*name));
        line.push(roman(format!("({section})")));
    }
    r.text(line);
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clap_definitions_are_consistent() {
        daemon().debug_assert();
        ctl().debug_assert();
    }

    #[test]
    fn daemon_exit_codes_match_the_daemon() {
        use robota_mcpd::exit;
        let codes: Vec<i32> = DAEMON_EXIT.iter().map(|(code, _)| *code).collect();
        assert_eq!(codes, [exit::OK, exit::RUNTIME, exit::USAGE, exit::CONFIG]);
    }

    #[test]
    fn a_page_per_command_and_subcommand() {
        let pages = pages();
        let names: Vec<&str> = pages.iter().map(|p| p.file.as_str()).collect();
        for expected in [
            "robota-mcpd.8",
            "robota-mcpd-check-config.8",
            "robota-mcpd-default-config.8",
            "robota-mcpctl.1",
            "robota-mcpctl-status.1",
            "robota-mcpctl-bearer.1",
            "robota-mcpctl-bearer-issue.1",
            "robota-mcpctl-audit.1",
        ] {
            assert!(
                names.contains(&expected),
                "{expected} missing from {names:?}"
            );
        }
        // Every ctl subcommand and leaf has its page.
        let mut ctl = ctl().disable_help_subcommand(true);
        ctl.build();
        let mut leaves = 0;
        for sub in ctl.get_subcommands() {
            let page = format!("robota-mcpctl-{}.1", sub.get_name());
            assert!(names.contains(&page.as_str()), "{page} missing");
            for leaf in sub.get_subcommands() {
                leaves += 1;
                let page = format!("robota-mcpctl-{}-{}.1", sub.get_name(), leaf.get_name());
                assert!(names.contains(&page.as_str()), "{page} missing");
            }
        }
        assert!(leaves > 0, "expected nested subcommands (bearer …)");
    }

    #[test]
    fn pages_carry_examples_and_the_extra_sections() {
        let text = |file: &str| {
            let page = pages().into_iter().find(|p| p.file == file).unwrap();
            String::from_utf8(page.render().unwrap()).unwrap()
        };
        let top = text("robota-mcpctl.1");
        for needle in [".TH robota-mcpctl 1", ".SH EXAMPLES", ".SH \"EXIT STATUS\""] {
            assert!(top.contains(needle), "robota-mcpctl.1 lacks {needle}");
        }
        assert!(top.contains("ROBOTA_MCPD_SOCKET"));
        let issue = text("robota-mcpctl-bearer-issue.1");
        assert!(issue.contains(".SH EXAMPLES") && issue.contains(".nf"));
        assert!(issue.contains(".SH \"SEE ALSO\"\n\\fBrobota\\-mcpctl\\-bearer\\fR(1)"));
        let daemon = text("robota-mcpd.8");
        for needle in [".TH robota-mcpd 8", ".SH SIGNALS", ".SH FILES", "78"] {
            assert!(daemon.contains(needle), "robota-mcpd.8 lacks {needle}");
        }
    }

    #[test]
    fn writes_pages_and_completions() {
        let dir = tempfile::tempdir().unwrap();
        generate(dir.path()).unwrap();
        for file in [
            "man/man8/robota-mcpd.8",
            "man/man1/robota-mcpctl.1",
            "completions/bash/robota-mcpctl",
            "completions/bash/robota-mcpd",
            "completions/zsh/_robota-mcpctl",
            "completions/zsh/_robota-mcpd",
            "completions/fish/robota-mcpctl.fish",
            "completions/fish/robota-mcpd.fish",
        ] {
            let text = fs::read_to_string(dir.path().join(file)).unwrap();
            assert!(!text.is_empty(), "{file} is empty");
        }
        let bash = fs::read_to_string(dir.path().join("completions/bash/robota-mcpctl")).unwrap();
        for word in ["status", "bearer", "audit", "--socket", "--json"] {
            assert!(bash.contains(word), "bash completion lacks {word}");
        }
    }
}
