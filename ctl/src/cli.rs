//! The command-line surface of `robota-mcpctl`: flags, subcommands and their help.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Parser, Subcommand};

const TOP_EXAMPLES: &str = "\
Examples:
  robota-mcpctl status
  robota-mcpctl bearer issue --label ci --ttl 30d --output ci.token
  robota-mcpctl --json bearer list

Exit codes: 0 ok, 1 the daemon refused the command, 2 bad usage, 3 robota-mcpd is not
running, 4 permission denied, 5 protocol error.";

/// Control a running robota-mcpd over its unix control socket.
#[derive(Debug, Parser)]
#[command(name = "robota-mcpctl", version, after_help = TOP_EXAMPLES)]
pub struct Cli {
    /// Control socket [default: $XDG_RUNTIME_DIR/robota-mcpd/control.sock if it exists,
    /// else /run/robota-mcpd/control.sock]
    #[arg(
        long,
        global = true,
        value_name = "PATH",
        env = robota_proto::SOCKET_ENV,
        help_heading = "Global options"
    )]
    pub socket: Option<PathBuf>,

    /// Print the daemon's reply as one JSON line on stdout, for scripts
    #[arg(long, global = true, help_heading = "Global options")]
    pub json: bool,

    #[command(subcommand)]
    pub command: CtlCommand,
}

#[derive(Debug, Subcommand)]
pub enum CtlCommand {
    /// Show version, state, carriers, bearers and refusals in the last hour
    #[command(after_help = "\
Example:
  robota-mcpctl status
  robota-mcpctl --json status | jq .uptime_secs")]
    Status,

    /// Issue, list, revoke or rotate bearers
    #[command(subcommand)]
    Bearer(BearerCommand),

    /// Refusal audit records (never token text or client addresses)
    #[command(after_help = "\
Examples:
  robota-mcpctl audit --since 1h
  robota-mcpctl audit --reason bad-bearer --json
  robota-mcpctl audit --follow

--json prints one JSON record per line:
  {\"seq\":7,\"time\":1796000000,\"carrier\":\"remote\",\"reason\":\"expired\",\"throttled\":false,\"address_class\":\"public\"}

Past 20 a second per carrier and reason, refusals are kept as one record per second with
a \"count\" of the refusals it stands for.")]
    Audit {
        /// Only records newer than a duration ago (90s, 10m, 24h) or since a unix time
        #[arg(long, value_name = "T", value_parser = parse_since)]
        since: Option<Since>,
        /// Only records with this reason (e.g. bad-bearer, expired, wrong-host)
        #[arg(long, value_name = "R")]
        reason: Option<String>,
        /// Keep printing new records as they arrive, until interrupted
        #[arg(long)]
        follow: bool,
    },

    /// List or cancel durable jobs (job.start, service and container actions)
    #[command(subcommand)]
    Jobs(JobsCommand),

    /// List grant requests and decide them: approve, deny, revoke
    #[command(subcommand)]
    Grants(GrantsCommand),

    /// The remote carrier's signing keys
    #[command(subcommand)]
    Keys(KeysCommand),

    /// Downstream MCP servers: list them (the default), or restart one
    #[command(after_help = "\
Examples:
  robota-mcpctl upstreams
  robota-mcpctl --json upstreams | jq '.upstreams[] | {name, state}'
  robota-mcpctl upstreams restart pg
  robota-mcpctl upstreams diff pg
  robota-mcpctl upstreams approve pg SURFACE

States: starting, up, backoff (failed; the next attempt waits), down (not ready within
the start bound, or stopped). A tool that could not be imported is listed with why.")]
    Upstreams {
        #[command(subcommand)]
        command: Option<UpstreamsCommand>,
    },

    /// Serve MCP on stdin/stdout, relayed to the running daemon's session (for desktop
    /// clients that only launch children); the caller is local:<your uid>
    #[command(after_help = "\
Examples:
  robota-mcpctl stdio
  robota-mcpctl --socket /run/robota-mcpd/control.sock stdio

As an MCP client's server entry: {\"command\": \"robota-mcpctl\", \"args\": [\"stdio\"]}

The relay ends when stdin closes (exit 0) or when the daemon ends the session on stop or
restart (exit 1; the client should start it again).")]
    Stdio,

    /// Stop the daemon gracefully (in-flight requests get a bounded grace)
    #[command(after_help = "\
Example:
  robota-mcpctl stop")]
    Stop,

    /// Read the configuration file again and serve it, or say why not (what `systemctl
    /// reload robota-mcpd` runs)
    #[command(after_help = "\
Example:
  robota-mcpctl reload

Answered once the daemon has served the new configuration, or refused it: then every
problem is printed, the running configuration stays, and the exit code is 78. The host
bearer, and the labelled bearers, carry on unless [loopback] changed (then fetch the new
host bearer with `robota-mcpctl bearer issue`).")]
    Reload,

    /// Reload with a fresh attach: new session, new host bearer, readiness re-announced
    #[command(after_help = "\
Example:
  robota-mcpctl restart

The host bearer and the labelled bearers without a lifetime stop working; fetch the new
host bearer with `robota-mcpctl bearer issue`. An invalid configuration changes nothing
(exit 78), as with `reload`.")]
    Restart,
}

#[derive(Debug, Subcommand)]
pub enum BearerCommand {
    /// Print the host bearer, or mint an extra bearer with --label (shown once)
    #[command(after_help = "\
Examples:
  robota-mcpctl bearer issue > host.token
  robota-mcpctl bearer issue --label ci --ttl 30d --output ci.token

The secret is printed alone on stdout, or written to a new file created with mode 0600
(an existing file is never overwritten).")]
    Issue {
        /// Mint an extra bearer with this label instead of returning the host bearer
        #[arg(long, value_name = "L")]
        label: Option<String>,

        /// Lifetime of the extra bearer, 1s to 365d, e.g. 90s, 10m, 12h, 30d [default: no
        /// expiry]
        #[arg(long, value_name = "D", requires = "label", value_parser = parse_ttl)]
        ttl: Option<u64>,

        /// Write the secret to this new file (mode 0600) instead of stdout
        #[arg(long, value_name = "FILE")]
        output: Option<PathBuf>,
    },

    /// List live bearers (never their secrets)
    #[command(after_help = "\
Example:
  robota-mcpctl bearer list")]
    List,

    /// Revoke the bearer with this label; it stops working at once
    #[command(after_help = "\
Example:
  robota-mcpctl bearer revoke ci")]
    Revoke {
        /// Label of the bearer to revoke
        #[arg(value_name = "LABEL")]
        label: String,
    },

    /// Replace the host bearer; the old one stops working at once
    #[command(after_help = "\
Examples:
  robota-mcpctl bearer rotate > host.token
  robota-mcpctl bearer rotate --output /etc/myclient/host.token")]
    Rotate {
        /// Write the new secret to this new file (mode 0600) instead of stdout
        #[arg(long, value_name = "FILE")]
        output: Option<PathBuf>,
    },
}

#[derive(Debug, Subcommand)]
pub enum UpstreamsCommand {
    /// Each upstream: kind, state, tools imported and refused, restarts, last error
    #[command(after_help = "\
Example:
  robota-mcpctl upstreams list")]
    List,

    /// Restart one upstream now (a shared child is stopped and started again, an HTTP
    /// backend reconnected); prints it once that attempt has ended
    #[command(after_help = "\
Example:
  robota-mcpctl upstreams restart pg")]
    Restart {
        /// The upstream's name (its `[upstreams.<name>]` table)
        #[arg(value_name = "NAME")]
        name: String,
    },

    /// How an upstream's tool surface differs from the approved one: tools added,
    /// removed and changed (member by member, old and new), and its executable
    #[command(after_help = "\
Example:
  robota-mcpctl upstreams diff fetch")]
    Diff {
        /// The upstream's name (its `[upstreams.<name>]` table)
        #[arg(value_name = "NAME")]
        name: String,
    },

    /// Approve the tool surface `upstreams diff` showed: its held tools are served
    /// (audited as upstream-approved); refused when the upstream listed anything else
    /// since
    #[command(after_help = "\
Example:
  robota-mcpctl upstreams diff fetch
  robota-mcpctl upstreams approve fetch SURFACE   (the current surface diff printed)")]
    Approve {
        /// The upstream's name (its `[upstreams.<name>]` table)
        #[arg(value_name = "NAME")]
        name: String,
        /// The current surface digest `upstreams diff` printed
        #[arg(value_name = "SURFACE")]
        surface: String,
    },
}

#[derive(Debug, Subcommand)]
pub enum KeysCommand {
    /// Fetch (or re-read) the key set now and show it; a key the issuer removed stops
    /// being trusted at once
    #[command(after_help = "\
Examples:
  robota-mcpctl keys refresh
  robota-mcpctl --json keys refresh | jq .keys

Exits 1 when the fetch fails; the keys held stay in use and `robota-mcpctl status` shows
the error.")]
    Refresh,
}

#[derive(Debug, Subcommand)]
pub enum JobsCommand {
    /// Jobs, newest first, with their owner and state
    #[command(after_help = "\
Examples:
  robota-mcpctl jobs list
  robota-mcpctl jobs list --owner bearer:ci --limit 20
  robota-mcpctl --json jobs list

States: running, succeeded, failed, cancelled, timed-out, outcome-unknown (the daemon
stopped while the job ran; it was not re-run).")]
    List {
        /// Only jobs started by this caller (local:<uid>, bearer:<label>, oauth:<client>/<sub>)
        #[arg(long, value_name = "CALLER")]
        owner: Option<String>,
        /// At most this many (the newest)
        #[arg(long, value_name = "N", default_value_t = 50)]
        limit: u32,
    },

    /// Cancel a running job as the operator; its process group is killed
    #[command(after_help = "\
Example:
  robota-mcpctl jobs cancel 42")]
    Cancel {
        /// The job's id (from `jobs list`)
        #[arg(value_name = "ID")]
        job_id: i64,
    },
}

#[derive(Debug, Subcommand)]
pub enum GrantsCommand {
    /// Pending and active grants (all of them with --all)
    #[command(after_help = "\
Examples:
  robota-mcpctl grants list
  robota-mcpctl grants list --all --json")]
    List {
        /// Also denied, revoked and expired grants
        #[arg(long)]
        all: bool,
    },

    /// Everything one grant holds; for an approval of one call, its tool and arguments
    #[command(after_help = "\
Examples:
  robota-mcpctl grants show 7
  robota-mcpctl grants show 7 --json")]
    Show {
        /// The grant's id (from `grants list`, or the call's answer)
        #[arg(value_name = "ID")]
        grant_id: i64,
    },

    /// Approve a pending request; the grant covers only the caller that asked (an
    /// approval of one call: only that call, once)
    #[command(after_help = "\
Examples:
  robota-mcpctl grants approve 7
  robota-mcpctl grants approve 7 --duration 15m")]
    Approve {
        /// The grant's id (from `grants list`)
        #[arg(value_name = "ID")]
        grant_id: i64,
        /// How long it lasts from now [default: the duration the caller asked for]
        #[arg(long, value_name = "D", value_parser = parse_ttl)]
        duration: Option<u64>,
    },

    /// Deny a pending request
    #[command(after_help = "\
Example:
  robota-mcpctl grants deny 7")]
    Deny {
        #[arg(value_name = "ID")]
        grant_id: i64,
    },

    /// End a pending or approved grant now
    #[command(after_help = "\
Example:
  robota-mcpctl grants revoke 7")]
    Revoke {
        #[arg(value_name = "ID")]
        grant_id: i64,
    },
}

/// `--since`: a duration back from now, or an absolute unix time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Since {
    Ago(u64),
    Unix(u64),
}

impl Since {
    /// The unix time this names, given the current one.
    pub fn resolve(self, now: u64) -> u64 {
        match self {
            Since::Ago(secs) => now.saturating_sub(secs),
            Since::Unix(t) => t,
        }
    }
}

pub fn parse_since(text: &str) -> Result<Since, String> {
    if let Ok(unix) = text.parse::<u64>() {
        return Ok(Since::Unix(unix));
    }
    humantime::parse_duration(text)
        .map(|d| Since::Ago(d.as_secs()))
        .map_err(|err| format!("{err}; expected a duration like 10m or 24h, or a unix time"))
}

/// Parses `--ttl` into whole seconds (at least one).
pub fn parse_ttl(text: &str) -> Result<u64, String> {
    let hint = "expected a duration like 90s, 10m, 12h or 30d";
    let duration: Duration =
        humantime::parse_duration(text).map_err(|err| format!("{err}; {hint}"))?;
    if duration.subsec_nanos() != 0 {
        return Err(format!("must be whole seconds; {hint}"));
    }
    match duration.as_secs() {
        0 => Err(format!("must be at least 1s; {hint}")),
        secs => Ok(secs),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn clap_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn since_is_a_duration_or_a_unix_time() {
        assert_eq!(parse_since("10m"), Ok(Since::Ago(600)));
        assert_eq!(parse_since("1796000000"), Ok(Since::Unix(1_796_000_000)));
        assert!(parse_since("yesterday").is_err());
        assert_eq!(Since::Ago(600).resolve(1000), 400);
        assert_eq!(Since::Ago(6000).resolve(1000), 0);
    }

    #[test]
    fn ttl_accepts_human_durations_in_whole_seconds() {
        assert_eq!(parse_ttl("10m"), Ok(600));
        assert_eq!(parse_ttl("90s"), Ok(90));
        assert_eq!(parse_ttl("1h 30m"), Ok(5400));
        assert_eq!(parse_ttl("30d"), Ok(30 * 86_400));
        for bad in ["", "0s", "10", "1500ms", "soon", "-5m"] {
            assert!(parse_ttl(bad).is_err(), "{bad:?} should be refused");
        }
    }

    #[test]
    fn every_command_has_an_example() {
        let mut cli = Cli::command();
        let mut missing = Vec::new();
        let mut seen = 0;
        for sub in cli.get_subcommands_mut() {
            let leaves: Vec<_> = if sub.has_subcommands() {
                sub.get_subcommands().cloned().collect()
            } else {
                vec![sub.clone()]
            };
            for leaf in leaves {
                seen += 1;
                let help = leaf.get_after_help().map(|h| h.to_string());
                if !help.is_some_and(|h| h.contains("robota-mcpctl ")) {
                    missing.push(leaf.get_name().to_owned());
                }
            }
        }
        assert!(seen >= 7, "expected the full command set, saw {seen}");
        assert!(
            missing.is_empty(),
            "commands without an example: {missing:?}"
        );
    }
}
