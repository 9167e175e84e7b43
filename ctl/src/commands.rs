//! One function per subcommand: build the request, check the reply's kind, print it.

use std::io::{self, Write};
use std::path::{Path, PathBuf};

use robota_proto::{Command, Reply, Request, Secret};

use crate::cli::{
    BearerCommand, CtlCommand, GrantsCommand, JobsCommand, KeysCommand, UpstreamsCommand,
};
use crate::client;
use crate::error::CtlError;
use crate::render;
use crate::secret_file::SecretFile;

/// What every command needs: where the daemon is, and how to print.
#[derive(Debug)]
pub struct Ctx {
    pub socket: PathBuf,
    pub json: bool,
}

pub fn run(ctx: &Ctx, command: &CtlCommand) -> Result<(), CtlError> {
    match command {
        CtlCommand::Status => match call(ctx, Command::Status)? {
            Reply::Status(status) if !ctx.json => print(&render::status(&status)),
            reply @ Reply::Status(_) => print_json(&reply),
            other => Err(unexpected("status", &other)),
        },
        CtlCommand::Bearer(BearerCommand::Issue { label, ttl, output }) => {
            let command = Command::BearerIssue {
                label: label.clone(),
                ttl_secs: *ttl,
            };
            bearer_secret(ctx, command, output.as_deref())
        }
        CtlCommand::Bearer(BearerCommand::List) => match call(ctx, Command::BearerList)? {
            Reply::Bearers { bearers } if !ctx.json => print(&render::bearers(&bearers)),
            reply @ Reply::Bearers { .. } => print_json(&reply),
            other => Err(unexpected("bearers", &other)),
        },
        CtlCommand::Bearer(BearerCommand::Revoke { label }) => {
            let command = Command::BearerRevoke {
                label: label.clone(),
            };
            match call(ctx, command)? {
                Reply::Revoked { label } if !ctx.json => {
                    print(&format!("revoked bearer \"{}\"\n", render::clean(&label)))
                }
                reply @ Reply::Revoked { .. } => print_json(&reply),
                other => Err(unexpected("revoked", &other)),
            }
        }
        CtlCommand::Bearer(BearerCommand::Rotate { output }) => {
            bearer_secret(ctx, Command::BearerRotate, output.as_deref())
        }
        CtlCommand::Audit {
            since,
            reason,
            follow,
        } => audit(ctx, *since, reason.clone(), *follow),
        CtlCommand::Jobs(JobsCommand::List { owner, limit }) => {
            let command = Command::JobsList {
                owner: owner.clone(),
                limit: Some(*limit),
            };
            match call(ctx, command)? {
                Reply::Jobs { jobs } if !ctx.json => print(&render::jobs(&jobs)),
                reply @ Reply::Jobs { .. } => print_json(&reply),
                other => Err(unexpected("jobs", &other)),
            }
        }
        CtlCommand::Jobs(JobsCommand::Cancel { job_id }) => {
            match call(ctx, Command::JobCancel { job_id: *job_id })? {
                Reply::Job { job } if !ctx.json => print(&format!(
                    "job {} ({}): cancel requested; it was {}\n",
                    job.job_id,
                    render::clean(&job.target),
                    job.state.as_str()
                )),
                reply @ Reply::Job { .. } => print_json(&reply),
                other => Err(unexpected("job", &other)),
            }
        }
        CtlCommand::Grants(GrantsCommand::List { all }) => {
            match call(ctx, Command::GrantsList { all: *all })? {
                Reply::Grants { grants } if !ctx.json => print(&render::grants(&grants)),
                reply @ Reply::Grants { .. } => print_json(&reply),
                other => Err(unexpected("grants", &other)),
            }
        }
        CtlCommand::Grants(GrantsCommand::Show { grant_id }) => {
            match call(
                ctx,
                Command::GrantShow {
                    grant_id: *grant_id,
                },
            )? {
                Reply::Grant { grant } if !ctx.json => print(&render::grant_details(&grant)),
                reply @ Reply::Grant { .. } => print_json(&reply),
                other => Err(unexpected("grant", &other)),
            }
        }
        CtlCommand::Grants(decision) => {
            let command = match decision {
                GrantsCommand::Approve { grant_id, duration } => Command::GrantApprove {
                    grant_id: *grant_id,
                    duration_secs: *duration,
                },
                GrantsCommand::Deny { grant_id } => Command::GrantDeny {
                    grant_id: *grant_id,
                },
                GrantsCommand::Revoke { grant_id } => Command::GrantRevoke {
                    grant_id: *grant_id,
                },
                GrantsCommand::List { .. } | GrantsCommand::Show { .. } => {
                    unreachable!("handled above")
                }
            };
            match call(ctx, command)? {
                Reply::Grant { grant } if !ctx.json => print(&render::grant_decided(&grant)),
                reply @ Reply::Grant { .. } => print_json(&reply),
                other => Err(unexpected("grant", &other)),
            }
        }
        CtlCommand::Keys(KeysCommand::Refresh) => match call(ctx, Command::KeysRefresh)? {
            Reply::KeySet(keys) if !ctx.json => {
                print(&format!("key set refreshed: {}\n", render::key_set(&keys)))
            }
            reply @ Reply::KeySet(_) => print_json(&reply),
            other => Err(unexpected("key-set", &other)),
        },
        CtlCommand::Upstreams {
            command: None | Some(UpstreamsCommand::List),
        } => match call(ctx, Command::Upstreams)? {
            Reply::Upstreams { upstreams } if !ctx.json => print(&render::upstreams(&upstreams)),
            reply @ Reply::Upstreams { .. } => print_json(&reply),
            other => Err(unexpected("upstreams", &other)),
        },
        CtlCommand::Upstreams {
            command: Some(UpstreamsCommand::Restart { name }),
        } => match call(ctx, Command::UpstreamRestart { name: name.clone() })? {
            Reply::Upstream { upstream } if !ctx.json => print(&format!(
                "upstream {} restarted\n\n{}",
                render::clean(&upstream.name),
                render::upstreams(std::slice::from_ref(&upstream))
            )),
            reply @ Reply::Upstream { .. } => print_json(&reply),
            other => Err(unexpected("upstream", &other)),
        },
        CtlCommand::Upstreams {
            command: Some(UpstreamsCommand::Diff { name }),
        } => match call(ctx, Command::UpstreamDiff { name: name.clone() })? {
            Reply::UpstreamDiff(diff) if !ctx.json => print(&render::upstream_diff(&diff)),
            reply @ Reply::UpstreamDiff(_) => print_json(&reply),
            other => Err(unexpected("upstream-diff", &other)),
        },
        CtlCommand::Upstreams {
            command: Some(UpstreamsCommand::Approve { name, surface }),
        } => match call(
            ctx,
            Command::UpstreamApprove {
                name: name.clone(),
                surface: surface.clone(),
            },
        )? {
            Reply::Upstream { upstream } if !ctx.json => print(&format!(
                "upstream {} approved: surface {}\n\n{}",
                render::clean(&upstream.name),
                upstream.surface.as_deref().unwrap_or("(none)"),
                render::upstreams(std::slice::from_ref(&upstream))
            )),
            reply @ Reply::Upstream { .. } => print_json(&reply),
            other => Err(unexpected("upstream", &other)),
        },
        CtlCommand::Stdio => stdio(ctx),
        CtlCommand::Stop => match call(ctx, Command::Stop)? {
            Reply::Stopping if !ctx.json => print("robota-mcpd is stopping\n"),
            reply @ Reply::Stopping => print_json(&reply),
            other => Err(unexpected("stopping", &other)),
        },
        CtlCommand::Reload => match call(ctx, Command::Reload)? {
            Reply::Reloaded {
                status,
                host_bearer_kept,
            } if !ctx.json => print(&format!(
                "robota-mcpd reloaded (generation {}); {}\n",
                status.generation,
                if host_bearer_kept {
                    "the host bearer is kept"
                } else {
                    "[loopback] changed: a new host bearer (robota-mcpctl bearer issue)"
                },
            )),
            reply @ Reply::Reloaded { .. } => print_json(&reply),
            other => Err(unexpected("reloaded", &other)),
        },
        CtlCommand::Restart => match call(ctx, Command::Restart)? {
            Reply::Restarted { status } if !ctx.json => print(&format!(
                "robota-mcpd restarted (generation {})\n\n{}",
                status.generation,
                render::status(&status)
            )),
            reply @ Reply::Restarted { .. } => print_json(&reply),
            other => Err(unexpected("restarted", &other)),
        },
    }
}

/// `stdio`: relay our stdin/stdout to an MCP session on the control socket. Ends when the
/// daemon closes the session; that is an error unless our stdin ended first.
fn stdio(ctx: &Ctx) -> Result<(), CtlError> {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    let from_daemon = client::open_mcp(&ctx.socket)?;
    let mut to_daemon = from_daemon
        .try_clone()
        .map_err(|source| CtlError::Transport {
            socket: ctx.socket.clone(),
            during: "opening the relay",
            source,
        })?;
    let stdin_done = Arc::new(AtomicBool::new(false));
    std::thread::spawn({
        let stdin_done = stdin_done.clone();
        move || {
            let _ = pump(&mut io::stdin().lock(), &mut to_daemon);
            stdin_done.store(true, Ordering::SeqCst);
            // Tell the daemon we are done; it ends the session and closes its side.
            let _ = to_daemon.shutdown(std::net::Shutdown::Write);
        }
    });
    let mut from_daemon = from_daemon;
    let copied = pump(&mut from_daemon, &mut io::stdout().lock());
    if stdin_done.load(Ordering::SeqCst) {
        return copied.map(|_| ()).map_err(CtlError::Stdout);
    }
    Err(CtlError::Transport {
        socket: ctx.socket.clone(),
        during: "relaying MCP",
        source: io::Error::new(
            io::ErrorKind::ConnectionAborted,
            "robota-mcpd ended the session (stopped or restarted); start the relay again",
        ),
    })
}

/// Copy until end of input, passing on each read at once. (`io::copy` may splice between
/// file descriptors and hold data back until a pipe fills; an MCP client waits for each
/// response, so every message must go through as soon as it arrives.)
fn pump(from: &mut impl io::Read, to: &mut impl Write) -> io::Result<u64> {
    let mut buf = [0u8; 64 * 1024];
    let mut total = 0;
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) => return Ok(total),
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        to.write_all(&buf[..n])?;
        to.flush()?;
        total += n as u64;
    }
}

/// How often `audit --follow` asks for new records.
const FOLLOW_EVERY: std::time::Duration = std::time::Duration::from_secs(1);

/// `audit`: print matching records; with `--follow`, keep polling for newer ones.
fn audit(
    ctx: &Ctx,
    since: Option<crate::cli::Since>,
    reason: Option<String>,
    follow: bool,
) -> Result<(), CtlError> {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let mut after_seq = None;
    let mut first = true;
    loop {
        let command = Command::Audit {
            since: since.map(|s| s.resolve(now)),
            reason: reason.clone(),
            after_seq,
            limit: None,
        };
        let (records, last_seq) = match call(ctx, command)? {
            Reply::Audit { records, last_seq } => (records, last_seq),
            other => return Err(unexpected("audit", &other)),
        };
        let text = if ctx.json {
            records
                .iter()
                .map(|r| serde_json::to_string(r).map(|line| line + "\n"))
                .collect::<Result<String, _>>()
                .map_err(json_error)?
        } else if first && records.is_empty() && !follow {
            "no matching refusals\n".to_owned()
        } else {
            render::audit(&records)
        };
        print(&text)?;
        if !follow {
            return Ok(());
        }
        first = false;
        after_seq = Some(last_seq);
        std::thread::sleep(FOLLOW_EVERY);
    }
}

/// `bearer issue` and `bearer rotate`: the secret goes alone to stdout, or to a new file.
fn bearer_secret(ctx: &Ctx, command: Command, output: Option<&Path>) -> Result<(), CtlError> {
    // Claim the file first: an existing file must refuse before anything is minted.
    let file = output.map(SecretFile::create).transpose()?;
    let reply = call(ctx, command)?;
    let Reply::Bearer {
        label,
        secret,
        expires_at,
    } = &reply
    else {
        return Err(unexpected("bearer", &reply));
    };
    let Some(file) = file else {
        return if ctx.json {
            print_json(&reply)
        } else {
            print_secret(secret)
        };
    };
    let path = file.path().to_owned();
    file.write(secret)?;
    if ctx.json {
        let mut value = serde_json::to_value(&reply).map_err(json_error)?;
        if let Some(object) = value.as_object_mut() {
            object.remove("secret");
        }
        print(&format!("{value}\n"))?;
    }
    eprintln!(
        "robota-mcpctl: wrote bearer \"{}\" to {} (mode 0600{})",
        render::clean(label),
        render::clean(&path.display().to_string()),
        render::expiry_suffix(*expires_at)
    );
    Ok(())
}

fn call(ctx: &Ctx, command: Command) -> Result<Reply, CtlError> {
    client::call(&ctx.socket, &Request::new(command))
}

/// A reply of the wrong kind for the command we sent.
fn unexpected(wanted: &str, got: &Reply) -> CtlError {
    let kind = got.kind();
    CtlError::Protocol(format!("expected a {wanted:?} reply, got {kind:?}"))
}

fn json_error(err: serde_json::Error) -> CtlError {
    CtlError::Protocol(format!("cannot encode the reply: {err}"))
}

/// The reply object (the value inside `ok`) as one JSON line.
fn print_json(reply: &Reply) -> Result<(), CtlError> {
    let text = serde_json::to_string(reply).map_err(json_error)?;
    print(&format!("{text}\n"))
}

fn print_secret(secret: &Secret) -> Result<(), CtlError> {
    let mut out = io::stdout().lock();
    out.write_all(secret.expose().as_bytes())
        .and_then(|()| out.write_all(b"\n"))
        .and_then(|()| out.flush())
        .map_err(CtlError::Stdout)
}

fn print(text: &str) -> Result<(), CtlError> {
    let mut out = io::stdout().lock();
    out.write_all(text.as_bytes())
        .and_then(|()| out.flush())
        .map_err(CtlError::Stdout)
}
