//! The turn backend: one fixed local executable from config, one turn at a time.
//!
//! The prompt goes to the child's stdin; its stdout (up to the result limit) and exit
//! status become the result. The child runs in its own process group, so a time-out or a
//! cancellation kills everything it started.

use std::process::Stdio;
use std::sync::atomic::{AtomicBool, Ordering};

use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::process::{Child, Command};
use tokio_util::sync::CancellationToken;

use super::{ToolError, ToolOutput};
use crate::config::TurnConfig;
use crate::vocab::{Caller, ToolErrorCode};

/// Runs turns; at most one at a time.
pub struct TurnBackend {
    config: Option<TurnConfig>,
    result_limit: u64,
    active: AtomicBool,
}

/// Clears the active flag when the turn ends, however it ends.
struct ActiveGuard<'a>(&'a AtomicBool);

impl Drop for ActiveGuard<'_> {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

/// Kills the child's process group unless disarmed (the child exited by itself).
struct GroupKill {
    pgid: Option<Pid>,
}

impl GroupKill {
    fn kill(&mut self) {
        if let Some(pgid) = self.pgid.take() {
            // ESRCH just means everything in the group is gone already.
            let _ = killpg(pgid, Signal::SIGKILL);
        }
    }
}

impl Drop for GroupKill {
    fn drop(&mut self) {
        self.kill();
    }
}

impl TurnBackend {
    pub fn new(config: Option<TurnConfig>, result_limit: u64) -> Self {
        Self {
            config,
            result_limit,
            active: AtomicBool::new(false),
        }
    }

    pub fn active(&self) -> bool {
        self.active.load(Ordering::Acquire)
    }

    /// Run one turn. `started` is called once the turn holds the single slot; what it
    /// returns is dropped when the turn ends (the active-turns gauge).
    pub async fn run<G>(
        &self,
        caller: &Caller,
        prompt: String,
        cancel: CancellationToken,
        started: impl FnOnce() -> G,
    ) -> Result<ToolOutput, ToolError> {
        let Some(config) = &self.config else {
            return Err(ToolError::new(
                ToolErrorCode::Unavailable,
                "no turn backend is configured on this host",
            ));
        };
        if self
            .active
            .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            return Err(ToolError::new(
                ToolErrorCode::Busy,
                "a turn is already running; try again later",
            ));
        }
        let _active = ActiveGuard(&self.active);
        let _started = started();

        let mut command = Command::new(&config.argv[0]);
        command
            .args(&config.argv[1..])
            .env_clear()
            .env("PATH", "/usr/local/bin:/usr/bin:/bin")
            .env("ROBOTA_MCPD_CALLER", caller.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .process_group(0)
            .kill_on_drop(true);
        if let Some(dir) = &config.working_dir {
            command.current_dir(dir);
        }
        let mut child = command.spawn().map_err(|e| {
            tracing::error!(executable = %config.argv[0], error = %e, "cannot start the turn backend");
            ToolError::new(ToolErrorCode::Unavailable, "the turn backend could not be started")
        })?;
        let mut group = GroupKill {
            pgid: child.id().map(|id| Pid::from_raw(id as i32)),
        };

        let outcome = tokio::select! {
            biased;
            () = cancel.cancelled() => Err(ToolError::new(ToolErrorCode::Cancelled, "the turn was cancelled")),
            () = tokio::time::sleep(config.timeout) => Err(ToolError::new(
                ToolErrorCode::TimedOut,
                format!("the turn ran longer than {}", humantime::format_duration(config.timeout)),
            )),
            result = self.drive(&mut child, prompt) => result,
        };
        // Whatever happened, nothing of the turn outlives it.
        group.kill();
        let _ = child.wait().await;
        outcome
    }

    async fn drive(&self, child: &mut Child, prompt: String) -> Result<ToolOutput, ToolError> {
        let mut stdin = child.stdin.take();
        let feed = async move {
            if let Some(stdin) = stdin.as_mut() {
                // A child that does not read its input is not an error of ours.
                let _ = stdin.write_all(prompt.as_bytes()).await;
                let _ = stdin.shutdown().await;
            }
            drop(stdin);
        };
        let stdout = child.stdout.take();
        let read = async move {
            let mut out = Vec::new();
            if let Some(stdout) = stdout {
                stdout
                    .take(self.result_limit + 1)
                    .read_to_end(&mut out)
                    .await?;
            }
            Ok::<_, std::io::Error>(out)
        };
        let ((), out) = tokio::join!(feed, read);
        let out = out.map_err(|_| {
            ToolError::new(ToolErrorCode::Internal, "reading the turn's output failed")
        })?;
        if out.len() as u64 > self.result_limit {
            return Err(ToolError::new(
                ToolErrorCode::ResultTooLarge,
                format!(
                    "the turn wrote more than the {} byte result limit",
                    self.result_limit
                ),
            ));
        }
        let status = child
            .wait()
            .await
            .map_err(|_| ToolError::new(ToolErrorCode::Internal, "waiting for the turn failed"))?;
        if !status.success() {
            let how = status.code().map_or_else(
                || "was killed by a signal".to_owned(),
                |c| format!("exited with status {c}"),
            );
            return Err(ToolError::new(
                ToolErrorCode::Internal,
                format!("the turn backend {how}"),
            ));
        }
        Ok(ToolOutput::Text(String::from_utf8_lossy(&out).into_owned()))
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn backend(script: &str, timeout: Duration) -> TurnBackend {
        TurnBackend::new(
            Some(TurnConfig {
                argv: vec!["/bin/sh".into(), "-c".into(), script.into()],
                timeout,
                working_dir: None,
            }),
            1024,
        )
    }

    /// Running, not a zombie waiting for whoever inherited it.
    fn alive(pid: i32) -> bool {
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .map(|stat| {
                stat.rsplit(')')
                    .next()
                    .is_some_and(|rest| !rest.trim_start().starts_with('Z'))
            })
            .unwrap_or(false)
    }

    async fn wait_for_file(path: &std::path::Path) -> String {
        for _ in 0..500 {
            if let Ok(text) = std::fs::read_to_string(path)
                && text.ends_with('\n')
            {
                return text;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("{} never appeared", path.display());
    }

    #[tokio::test]
    async fn prompt_in_stdout_out() {
        let b = backend(
            "tr a-z A-Z; echo \" by $ROBOTA_MCPD_CALLER\"",
            Duration::from_secs(10),
        );
        let out = b
            .run(
                &Caller::Local(7),
                "hello".into(),
                CancellationToken::new(),
                || (),
            )
            .await
            .unwrap();
        assert_eq!(out, ToolOutput::Text("HELLO by local:7\n".into()));
        assert!(!b.active());
    }

    #[tokio::test]
    async fn failing_backend_is_a_visible_error() {
        let b = backend("exit 3", Duration::from_secs(10));
        let err = b
            .run(
                &Caller::Local(0),
                "x".into(),
                CancellationToken::new(),
                || (),
            )
            .await
            .unwrap_err();
        assert_eq!(err.code, ToolErrorCode::Internal);
        assert!(err.message.contains("status 3"), "{err}");
    }

    #[tokio::test]
    async fn one_turn_at_a_time_and_cancel_kills_the_group() {
        let dir = tempfile::tempdir().unwrap();
        let pids = dir.path().join("pids");
        let script = format!("sleep 30 & echo $$ $! > {}; wait", pids.display());
        let b = std::sync::Arc::new(backend(&script, Duration::from_secs(60)));
        let cancel = CancellationToken::new();
        let first = tokio::spawn({
            let (b, cancel) = (b.clone(), cancel.clone());
            async move {
                b.run(&Caller::Bearer("a".into()), "x".into(), cancel, || ())
                    .await
            }
        });
        let text = wait_for_file(&pids).await;
        let pids: Vec<i32> = text
            .split_whitespace()
            .map(|p| p.parse().unwrap())
            .collect();
        assert!(pids.iter().all(|p| alive(*p)));

        let err = b
            .run(
                &Caller::Bearer("b".into()),
                "y".into(),
                CancellationToken::new(),
                || (),
            )
            .await
            .unwrap_err();
        assert_eq!(err.code, ToolErrorCode::Busy);

        cancel.cancel();
        let err = first.await.unwrap().unwrap_err();
        assert_eq!(err.code, ToolErrorCode::Cancelled);
        // Both the shell and its background sleep (same process group) are gone.
        for _ in 0..200 {
            if !pids.iter().any(|p| alive(*p)) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(
            !pids.iter().any(|p| alive(*p)),
            "turn processes survived the cancel"
        );
        assert!(!b.active());
    }

    #[tokio::test]
    async fn time_limit_applies() {
        let b = backend("exec sleep 30", Duration::from_millis(200));
        let err = b
            .run(
                &Caller::Local(0),
                "x".into(),
                CancellationToken::new(),
                || (),
            )
            .await
            .unwrap_err();
        assert_eq!(err.code, ToolErrorCode::TimedOut);
    }
}
