//! Logging: journald when stderr is the journal (`JOURNAL_STREAM`), readable stderr
//! otherwise. `RUST_LOG` filters. Nothing is ever logged to stdout (the stdio carrier
//! owns it).

use std::os::fd::AsFd;

use tracing_subscriber::EnvFilter;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

/// Whether `JOURNAL_STREAM` (`<dev>:<ino>`) names our stderr.
pub fn stderr_is_journal(journal_stream: Option<&str>) -> bool {
    let Some((dev, ino)) = journal_stream.and_then(|v| v.split_once(':')) else {
        return false;
    };
    let Ok(stat) = nix::sys::stat::fstat(std::io::stderr().as_fd()) else {
        return false;
    };
    dev.parse::<u64>().ok() == Some(stat.st_dev) && ino.parse::<u64>().ok() == Some(stat.st_ino)
}

/// Install the global subscriber. `journal` picks journald; `filter` is `RUST_LOG`.
pub fn init(journal: bool, filter: Option<&str>) {
    let filter = EnvFilter::try_new(filter.unwrap_or("info,rmcp=warn"))
        .unwrap_or_else(|_| EnvFilter::new("info,rmcp=warn"));
    let registry = tracing_subscriber::registry().with(filter);
    if journal && let Ok(layer) = tracing_journald::layer() {
        let _ = registry
            .with(layer.with_syslog_identifier("robota-mcpd".into()))
            .try_init();
        return;
    }
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let _ = registry
        .with(
            tracing_subscriber::fmt::layer()
                .with_writer(std::io::stderr)
                .with_ansi(ansi)
                .with_target(false),
        )
        .try_init();
}
