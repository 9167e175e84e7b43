//! Logging: journald when stderr is the journal (`JOURNAL_STREAM`), readable stderr
//! otherwise. `RUST_LOG` filters. Nothing is ever logged to stdout (the stdio carrier
//! owns it).
//!
//! Log lines can carry request text (rmcp logs an unknown method's name, a JSON-RPC id, a
//! header), so both outputs sit behind [`Guard`], and no caller can make the log big:
//! - An event whose fields render to more than [`FIELD_CAP`] bytes reaches the output as
//!   a copy cut to that size, target `robota_mcpd::logging`, with the original target in
//!   `origin` and the number of bytes cut in `cut_bytes`.
//! - One callsite logs at most [`PER_CALLSITE`] events a second; the rest of that second
//!   is counted, and the next event through the guard after it (from any callsite) is
//!   preceded by one summary event (`origin`, `suppressed`, `interval`). The audit's own
//!   target is exempt: the audit folds refusals past its own rate at the source; so is
//!   [`UPSTREAM_STDERR`], whose lines are bounded per upstream where they are read.
//! - On stderr, every line is also cut at [`MAX_LINE`] bytes (marked) and line breaks
//!   inside it are escaped, so one event is one line.
//! - In the journal, an event's `MESSAGE` is its message followed by its other fields as
//!   `name=value` (the readable format's line), so the reason shows in the one-line view
//!   of `journalctl -u robota-mcpd`; every field is also kept as its own journal field.

use std::borrow::Cow;
use std::collections::HashMap;
use std::fmt::{self, Write as _};
use std::io;
use std::os::fd::AsFd;
use std::sync::Arc;

use parking_lot::Mutex;
use tracing::callsite::{Callsite, Identifier};
use tracing::field::{Field, FieldSet, Visit};
use tracing::metadata::Kind;
use tracing::subscriber::Interest;
use tracing::{Event, Level, Metadata, Subscriber, span};
use tracing_subscriber::EnvFilter;
use tracing_subscriber::layer::{Context, Layer, SubscriberExt};
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::util::SubscriberInitExt;

/// Longest line written to stderr, newline included.
pub const MAX_LINE: usize = 4096;
/// Longest rendering of one event's fields an output is given.
pub const FIELD_CAP: usize = 3072;
/// Events one callsite may log in one second.
pub const PER_CALLSITE: u32 = 20;
/// The audit's target: never suppressed here (the audit folds its own).
pub const AUDIT: &str = "robota_mcpd::audit";
/// The target of an upstream's stderr lines: never suppressed here either, because each
/// upstream's lines are already bounded where they are read (10 a second per upstream, over
/// all its children) — with the callsite's rate on top, one upstream's flood would push
/// the others' lines out.
pub const UPSTREAM_STDERR: &str = "robota_mcpd::upstream::stderr";

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
            .with(
                Guard::new(layer.with_syslog_identifier("robota-mcpd".into())).fields_in_message(),
            )
            .try_init();
        return;
    }
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let _ = registry
        .with(Guard::new(
            tracing_subscriber::fmt::layer()
                .with_writer(|| LineCap(std::io::stderr()))
                .with_ansi(ansi)
                .with_target(false),
        ))
        .try_init();
}

/// The callsite of the events [`Guard`] writes itself, one per level.
struct Site(&'static Metadata<'static>);

impl Callsite for Site {
    fn set_interest(&self, _: Interest) {}

    fn metadata(&self) -> &Metadata<'_> {
        self.0
    }
}

const FIELDS: &[&str] = &["message", "origin", "cut_bytes", "suppressed", "interval"];

macro_rules! sites {
    ($($site:ident, $meta:ident, $level:expr;)*) => {$(
        static $site: Site = Site(&$meta);
        static $meta: Metadata<'static> = Metadata::new(
            "robota_mcpd::logging guard",
            "robota_mcpd::logging",
            $level,
            Some(file!()),
            Some(line!()),
            Some(module_path!()),
            FieldSet::new(FIELDS, Identifier(&$site)),
            Kind::EVENT,
        );
    )*};
}

sites! {
    ERROR_SITE, ERROR_META, Level::ERROR;
    WARN_SITE, WARN_META, Level::WARN;
    INFO_SITE, INFO_META, Level::INFO;
    DEBUG_SITE, DEBUG_META, Level::DEBUG;
    TRACE_SITE, TRACE_META, Level::TRACE;
}

fn guard_meta(level: Level) -> &'static Metadata<'static> {
    match level {
        Level::ERROR => &ERROR_META,
        Level::WARN => &WARN_META,
        Level::INFO => &INFO_META,
        Level::DEBUG => &DEBUG_META,
        _ => &TRACE_META,
    }
}

/// A `fmt::Write` that keeps the first `cap` bytes (whole characters) and counts the
/// rest, with line breaks escaped (`\n`, `\r`) so that the copy stays one line.
struct Bounded {
    text: String,
    cap: usize,
    total: usize,
}

impl fmt::Write for Bounded {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        for piece in s.split_inclusive(['\n', '\r']) {
            let (body, brk) = match piece.as_bytes().last() {
                Some(b'\n') => (&piece[..piece.len() - 1], "\\n"),
                Some(b'\r') => (&piece[..piece.len() - 1], "\\r"),
                _ => (piece, ""),
            };
            for part in [body, brk] {
                self.total = self.total.saturating_add(part.len());
                let room = self.cap.saturating_sub(self.text.len());
                let mut end = room.min(part.len());
                while !part.is_char_boundary(end) {
                    end -= 1;
                }
                self.text.push_str(&part[..end]);
            }
        }
        Ok(())
    }
}

/// Renders an event's fields as the readable format does (message, then `name=value`),
/// into a [`Bounded`] buffer.
struct Render(Bounded);

impl Visit for Render {
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            let _ = self.0.write_str(value);
        } else {
            let _ = write!(self.0, " {}={value:?}", field.name());
        }
    }

    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        if field.name() == "message" {
            let _ = write!(self.0, "{value:?}");
        } else {
            let _ = write!(self.0, " {}={value:?}", field.name());
        }
    }
}

/// One callsite's count in the current second.
struct Window {
    second: u64,
    passed: u32,
    suppressed: u64,
    level: Level,
    target: &'static str,
}

#[derive(Default)]
struct Limiter {
    windows: HashMap<Identifier, Window>,
    swept: u64,
}

impl Limiter {
    /// Whether an event of `meta` at `second` passes, and the summaries (level, target,
    /// count) of seconds that have ended with events suppressed.
    fn admit(
        &mut self,
        meta: &'static Metadata<'static>,
        second: u64,
    ) -> (bool, Vec<(Level, &'static str, u64)>) {
        let mut ended = Vec::new();
        if second != self.swept {
            self.swept = second;
            for w in self.windows.values_mut() {
                if w.second != second {
                    if w.suppressed > 0 {
                        ended.push((w.level, w.target, w.suppressed));
                    }
                    *w = Window {
                        second,
                        passed: 0,
                        suppressed: 0,
                        ..*w
                    };
                }
            }
        }
        let w = self.windows.entry(meta.callsite()).or_insert(Window {
            second,
            passed: 0,
            suppressed: 0,
            level: *meta.level(),
            target: meta.target(),
        });
        if w.passed < PER_CALLSITE {
            w.passed += 1;
            (true, ended)
        } else {
            w.suppressed = w.suppressed.saturating_add(1);
            (false, ended)
        }
    }
}

/// Wraps an output layer: caps what one event can carry and how often one callsite can
/// log (see the module documentation).
pub struct Guard<L> {
    inner: L,
    limiter: Mutex<Limiter>,
    clock: Arc<dyn Fn() -> u64 + Send + Sync>,
    /// Whether the output is given each event with its fields written into its message
    /// too (the journal, whose one-line view shows the message only).
    inline: bool,
}

impl<L> Guard<L> {
    pub fn new(inner: L) -> Self {
        let start = std::time::Instant::now();
        Self::with_clock(inner, Arc::new(move || start.elapsed().as_secs()))
    }

    /// With `clock` giving whole seconds (tests drive it by hand).
    fn with_clock(inner: L, clock: Arc<dyn Fn() -> u64 + Send + Sync>) -> Self {
        Self {
            inner,
            limiter: Mutex::new(Limiter::default()),
            clock,
            inline: false,
        }
    }

    /// The output is given each event with its message followed by its other fields.
    pub fn fields_in_message(mut self) -> Self {
        self.inline = true;
        self
    }
}

impl<L> Guard<L> {
    /// Hands `inner` an event of our own at `level`.
    fn write<S>(&self, level: Level, values: GuardFields<'_>, ctx: Context<'_, S>)
    where
        L: Layer<S>,
        S: Subscriber + for<'a> LookupSpan<'a>,
    {
        let meta = guard_meta(level);
        let fields = meta.fields();
        let field = |name| fields.field(name).expect("a guard field");
        let (message, origin, cut, suppressed) = (
            field("message"),
            field("origin"),
            field("cut_bytes"),
            field("suppressed"),
        );
        let interval = field("interval");
        let pairs = [
            (&message, Some(&values.message as &dyn tracing::Value)),
            (&origin, Some(&values.origin as &dyn tracing::Value)),
            (
                &cut,
                values.cut_bytes.as_ref().map(|v| v as &dyn tracing::Value),
            ),
            (
                &suppressed,
                values.suppressed.as_ref().map(|v| v as &dyn tracing::Value),
            ),
            (
                &interval,
                values.suppressed.map(|_| &"1s" as &dyn tracing::Value),
            ),
        ];
        let set = fields.value_set(&pairs);
        let event = Event::new(meta, &set);
        if !self.inline || !self.inline_fields(&event, ctx.clone()) {
            self.inner.on_event(&event, ctx);
        }
    }
}

/// Most fields an event may have for [`Guard::inline_fields`] to rewrite it (more is
/// handed on as it is).
const INLINE_MAX: usize = 32;

/// An event's fields as text, in order: the message apart.
#[derive(Default)]
struct Texts {
    message: Option<String>,
    others: Vec<(Field, String)>,
}

impl Visit for Texts {
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            self.message = Some(value.to_owned());
        } else {
            self.others.push((field.clone(), value.to_owned()));
        }
    }

    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.record_str(field, &format!("{value:?}"));
    }
}

impl<L> Guard<L> {
    /// Hands `inner` the event again with the same callsite and fields, its message being
    /// the message followed by ` name=value` for each other field (a value with spaces,
    /// quotes or nothing in it quoted). False when there is nothing to add, or the event
    /// cannot be rewritten (no message field, or more than [`INLINE_MAX`] fields).
    fn inline_fields<S>(&self, event: &Event<'_>, ctx: Context<'_, S>) -> bool
    where
        L: Layer<S>,
        S: Subscriber + for<'a> LookupSpan<'a>,
    {
        let meta = event.metadata();
        let fields = meta.fields();
        let Some(message_field) = fields.field("message") else {
            return false;
        };
        let mut texts = Texts::default();
        event.record(&mut texts);
        if texts.others.is_empty() || texts.others.len() >= INLINE_MAX {
            return false;
        }
        let mut message = texts.message.unwrap_or_default();
        for (field, value) in &texts.others {
            let plain = !value.is_empty() && !value.contains([' ', '"', '=', '\\']);
            if plain {
                let _ = write!(message, " {}={value}", field.name());
            } else {
                let _ = write!(message, " {}={value:?}", field.name());
            }
        }
        let message = message.as_str();
        let values: Vec<&str> = texts.others.iter().map(|(_, v)| v.as_str()).collect();
        // Unused entries repeat the message field with no value: a value set records the
        // entries that carry one.
        let mut pairs: [(&Field, Option<&dyn tracing::Value>); INLINE_MAX] =
            [(&message_field, None); INLINE_MAX];
        pairs[0] = (&message_field, Some(&message as &dyn tracing::Value));
        for (i, (field, _)) in texts.others.iter().enumerate() {
            pairs[i + 1] = (field, Some(&values[i] as &dyn tracing::Value));
        }
        let set = fields.value_set(&pairs);
        let copy = if event.is_root() {
            Event::new_child_of(None::<span::Id>, meta, &set)
        } else if let Some(parent) = event.parent() {
            Event::new_child_of(parent.clone(), meta, &set)
        } else {
            Event::new(meta, &set)
        };
        self.inner.on_event(&copy, ctx);
        true
    }
}

/// What an event of the guard's own carries.
struct GuardFields<'a> {
    message: &'a str,
    origin: &'a str,
    cut_bytes: Option<u64>,
    suppressed: Option<u64>,
}

impl<S, L> Layer<S> for Guard<L>
where
    L: Layer<S>,
    S: Subscriber + for<'a> LookupSpan<'a>,
{
    fn on_register_dispatch(&self, subscriber: &tracing::Dispatch) {
        self.inner.on_register_dispatch(subscriber);
    }

    fn on_layer(&mut self, subscriber: &mut S) {
        self.inner.on_layer(subscriber);
    }

    fn register_callsite(&self, metadata: &'static Metadata<'static>) -> Interest {
        self.inner.register_callsite(metadata)
    }

    fn enabled(&self, metadata: &Metadata<'_>, ctx: Context<'_, S>) -> bool {
        self.inner.enabled(metadata, ctx)
    }

    fn on_new_span(&self, attrs: &span::Attributes<'_>, id: &span::Id, ctx: Context<'_, S>) {
        self.inner.on_new_span(attrs, id, ctx);
    }

    fn on_record(&self, span: &span::Id, values: &span::Record<'_>, ctx: Context<'_, S>) {
        self.inner.on_record(span, values, ctx);
    }

    fn on_follows_from(&self, span: &span::Id, follows: &span::Id, ctx: Context<'_, S>) {
        self.inner.on_follows_from(span, follows, ctx);
    }

    fn event_enabled(&self, event: &Event<'_>, ctx: Context<'_, S>) -> bool {
        self.inner.event_enabled(event, ctx)
    }

    fn on_event(&self, event: &Event<'_>, ctx: Context<'_, S>) {
        let meta = event.metadata();
        let (pass, ended) = if matches!(meta.target(), AUDIT | UPSTREAM_STDERR) {
            (true, Vec::new())
        } else {
            self.limiter.lock().admit(meta, (self.clock)())
        };
        for (level, origin, count) in ended {
            let values = GuardFields {
                message: "log events past the rate of one callsite, suppressed",
                origin,
                cut_bytes: None,
                suppressed: Some(count),
            };
            self.write(level, values, ctx.clone());
        }
        if !pass {
            return;
        }
        // Measure without keeping anything; render the copy only when it is needed.
        let rendered = |cap| {
            let mut render = Render(Bounded {
                text: String::new(),
                cap,
                total: 0,
            });
            event.record(&mut render);
            render.0
        };
        if rendered(0).total <= FIELD_CAP {
            if !self.inline || !self.inline_fields(event, ctx.clone()) {
                self.inner.on_event(event, ctx);
            }
            return;
        }
        let Bounded { text, total, .. } = rendered(FIELD_CAP);
        let cut = u64::try_from(total - text.len()).unwrap_or(u64::MAX);
        let message = format!("{text}… [cut]");
        let values = GuardFields {
            message: &message,
            origin: meta.target(),
            cut_bytes: Some(cut),
            suppressed: None,
        };
        self.write(*meta.level(), values, ctx);
    }

    fn on_enter(&self, id: &span::Id, ctx: Context<'_, S>) {
        self.inner.on_enter(id, ctx);
    }

    fn on_exit(&self, id: &span::Id, ctx: Context<'_, S>) {
        self.inner.on_exit(id, ctx);
    }

    fn on_close(&self, id: span::Id, ctx: Context<'_, S>) {
        self.inner.on_close(id, ctx);
    }

    fn on_id_change(&self, old: &span::Id, new: &span::Id, ctx: Context<'_, S>) {
        self.inner.on_id_change(old, new, ctx);
    }
}

/// Marks a line [`cap_line`] had to cut.
const CUT_MARK: &str = "… [line cut]";

/// One formatted line, as written: line breaks before its end escaped (`\n`, `\r`), cut
/// to [`MAX_LINE`] bytes (newline included) and marked with [`CUT_MARK`] when longer,
/// newline-terminated.
fn cap_line(buf: &[u8]) -> Cow<'_, [u8]> {
    let body = buf.strip_suffix(b"\n").unwrap_or(buf);
    let breaks = body.iter().any(|b| matches!(b, b'\n' | b'\r'));
    if !breaks && body.len() < MAX_LINE && body.len() < buf.len() {
        return Cow::Borrowed(buf);
    }
    let room = MAX_LINE - 1;
    let mut out = Vec::with_capacity(body.len().min(room) + 1);
    let mut cut = false;
    for &b in body {
        let piece: &[u8] = match b {
            b'\n' => b"\\n",
            b'\r' => b"\\r",
            _ => std::slice::from_ref(&b),
        };
        if out.len() + piece.len() > room {
            cut = true;
            break;
        }
        out.extend_from_slice(piece);
    }
    if cut {
        out.truncate(room - CUT_MARK.len());
        // Never end inside a UTF-8 sequence.
        if let Err(e) = std::str::from_utf8(&out) {
            out.truncate(e.valid_up_to());
        }
        out.extend_from_slice(CUT_MARK.as_bytes());
    }
    out.push(b'\n');
    Cow::Owned(out)
}

/// The stderr writer behind the readable format: every write is one formatted event,
/// passed through [`cap_line`].
pub struct LineCap<W>(pub W);

impl<W: io::Write> io::Write for LineCap<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0.write_all(&cap_line(buf))?;
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        self.0.flush()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU64, Ordering};

    use tracing_subscriber::layer::SubscriberExt;

    use super::*;

    /// One event as an output layer saw it.
    #[derive(Debug, Clone)]
    struct Seen {
        level: Level,
        target: String,
        fields: Vec<(String, String)>,
    }

    impl Seen {
        fn field(&self, name: &str) -> Option<&str> {
            self.fields
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, v)| v.as_str())
        }
    }

    #[derive(Clone, Default)]
    struct Recorder(Arc<Mutex<Vec<Seen>>>);

    struct Fields(Vec<(String, String)>);

    impl Visit for Fields {
        fn record_str(&mut self, field: &Field, value: &str) {
            self.0.push((field.name().into(), value.into()));
        }

        fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
            self.0.push((field.name().into(), format!("{value:?}")));
        }
    }

    impl<S: Subscriber> Layer<S> for Recorder {
        fn on_event(&self, event: &Event<'_>, _: Context<'_, S>) {
            let mut fields = Fields(Vec::new());
            event.record(&mut fields);
            self.0.lock().push(Seen {
                level: *event.metadata().level(),
                target: event.metadata().target().into(),
                fields: fields.0,
            });
        }
    }

    /// Runs `f` under a guard around a recorder, with a clock the test sets.
    fn guarded(f: impl FnOnce(&AtomicU64)) -> Vec<Seen> {
        let recorder = Recorder::default();
        let clock = Arc::new(AtomicU64::new(0));
        let guard = Guard::with_clock(recorder.clone(), {
            let clock = clock.clone();
            Arc::new(move || clock.load(Ordering::SeqCst))
        });
        let subscriber = tracing_subscriber::registry().with(guard);
        tracing::subscriber::with_default(subscriber, || f(&clock));
        recorder.0.lock().clone()
    }

    #[test]
    fn in_the_journal_the_message_carries_the_fields_and_they_stay() {
        let recorder = Recorder::default();
        let subscriber =
            tracing_subscriber::registry().with(Guard::new(recorder.clone()).fields_in_message());
        tracing::subscriber::with_default(subscriber, || {
            let problem = "upstreams.fs.command: no such file";
            tracing::error!(problem, "reload refused; the running configuration stays");
            tracing::warn!(target: AUDIT, reason = "bad-bearer", carrier = %"loopback", "request refused");
            tracing::info!("ready");
        });
        let seen = recorder.0.lock().clone();
        assert_eq!(seen.len(), 3);
        assert_eq!(
            seen[0].field("message"),
            Some(
                "reload refused; the running configuration stays \
                 problem=\"upstreams.fs.command: no such file\""
            )
        );
        assert_eq!(
            seen[0].field("problem"),
            Some("upstreams.fs.command: no such file")
        );
        assert_eq!(seen[0].level, Level::ERROR);
        assert_eq!(
            seen[1].field("message"),
            Some("request refused reason=bad-bearer carrier=loopback")
        );
        assert_eq!(seen[1].target, AUDIT);
        assert_eq!(seen[1].field("reason"), Some("bad-bearer"));
        assert_eq!(seen[2].field("message"), Some("ready"));
        assert_eq!(seen[2].fields.len(), 1);
    }

    #[test]
    fn small_events_pass_unchanged() {
        let seen = guarded(|_| {
            tracing::warn!(target: "rmcp::service", id = 7, "rejected peer request");
        });
        assert_eq!(seen.len(), 1);
        assert_eq!(seen[0].target, "rmcp::service");
        assert_eq!(seen[0].field("message"), Some("rejected peer request"));
        assert_eq!(seen[0].field("id"), Some("7"));
    }

    #[test]
    fn an_event_over_the_cap_is_cut_and_marked() {
        let huge = "m".repeat(1 << 20);
        let seen = guarded(|_| {
            tracing::warn!(target: "rmcp::service", "unknown method {huge}");
            tracing::error!(target: "rmcp::service", id = %huge, "rejected peer request");
            tracing::info!(target: "robota_mcpd::x", method = huge.as_str(), "ok");
        });
        assert_eq!(seen.len(), 3, "{seen:?}");
        for (e, level) in seen.iter().zip([Level::WARN, Level::ERROR, Level::INFO]) {
            assert_eq!(e.level, level, "the level is kept");
            assert_eq!(e.target, "robota_mcpd::logging");
            let message = e.field("message").unwrap();
            assert!(message.len() <= FIELD_CAP + 32, "{}", message.len());
            assert!(
                message.ends_with("… [cut]"),
                "{}",
                &message[message.len() - 20..]
            );
            let cut: usize = e.field("cut_bytes").unwrap().parse().unwrap();
            assert!(
                cut > huge.len() - FIELD_CAP && cut <= huge.len() + 64,
                "{cut}"
            );
        }
        assert_eq!(seen[0].field("origin"), Some("rmcp::service"));
        assert!(
            seen[1]
                .field("message")
                .unwrap()
                .starts_with("rejected peer request id=")
        );
        assert_eq!(seen[2].field("origin"), Some("robota_mcpd::x"));
    }

    #[test]
    fn a_busy_callsite_is_suppressed_and_summarised() {
        let seen = guarded(|clock| {
            for second in 0..2 {
                clock.store(second, Ordering::SeqCst);
                for _ in 0..100 {
                    tracing::warn!(target: "rmcp::service", "response error");
                }
            }
            // The audit's and the upstreams' stderr targets are never suppressed here.
            for _ in 0..100 {
                tracing::warn!(target: AUDIT, "request refused");
                tracing::info!(target: UPSTREAM_STDERR, "upstream stderr");
            }
            clock.store(5, Ordering::SeqCst);
            tracing::info!(target: "robota_mcpd::daemon", "stopped");
        });
        let count = |target: &str, message: &str| {
            seen.iter()
                .filter(|e| e.target == target && e.field("message") == Some(message))
                .count()
        };
        assert_eq!(
            count("rmcp::service", "response error"),
            2 * PER_CALLSITE as usize
        );
        assert_eq!(count(AUDIT, "request refused"), 100);
        assert_eq!(count(UPSTREAM_STDERR, "upstream stderr"), 100);
        assert_eq!(count("robota_mcpd::daemon", "stopped"), 1);
        let summaries: Vec<&Seen> = seen
            .iter()
            .filter(|e| e.field("suppressed").is_some())
            .collect();
        assert_eq!(
            summaries.len(),
            2,
            "one per second that suppressed: {summaries:?}"
        );
        for s in &summaries {
            assert_eq!(s.level, Level::WARN);
            assert_eq!(s.target, "robota_mcpd::logging");
            assert_eq!(s.field("origin"), Some("rmcp::service"));
            assert_eq!(s.field("suppressed"), Some("80"));
            assert_eq!(s.field("interval"), Some("1s"));
        }
        // The first summary comes before the second second's first event.
        let first = seen
            .iter()
            .position(|e| e.field("suppressed").is_some())
            .unwrap();
        assert_eq!(first, PER_CALLSITE as usize);
    }

    #[test]
    fn stderr_lines_are_capped_and_stay_one_line() {
        assert_eq!(cap_line(b"short line\n"), &b"short line\n"[..]);
        assert_eq!(
            cap_line(b"a\nforged line\r\n"),
            &b"a\\nforged line\\r\n"[..]
        );
        assert_eq!(cap_line(b"no newline"), &b"no newline\n"[..]);
        let long = format!("{}\n", "é".repeat(MAX_LINE));
        let capped = cap_line(long.as_bytes());
        assert!(capped.len() <= MAX_LINE, "{}", capped.len());
        let text = std::str::from_utf8(&capped).expect("whole characters");
        assert!(
            text.ends_with("… [line cut]\n"),
            "{}",
            &text[text.len() - 30..]
        );
        assert_eq!(text.matches('\n').count(), 1);
        // Exactly at the cap is kept whole.
        let exact = format!("{}\n", "x".repeat(MAX_LINE - 1));
        assert_eq!(cap_line(exact.as_bytes()), exact.as_bytes());
        let over = format!("{}\n", "x".repeat(MAX_LINE));
        assert!(cap_line(over.as_bytes()).ends_with(b"[line cut]\n"));
    }

    #[test]
    fn the_readable_output_never_writes_a_line_over_the_cap() {
        let out = Arc::new(Mutex::new(Vec::<u8>::new()));
        #[derive(Clone)]
        struct Buffer(Arc<Mutex<Vec<u8>>>);
        impl io::Write for Buffer {
            fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
                self.0.lock().extend_from_slice(buf);
                Ok(buf.len())
            }
            fn flush(&mut self) -> io::Result<()> {
                Ok(())
            }
        }
        let writer = {
            let out = out.clone();
            move || LineCap(Buffer(out.clone()))
        };
        let layer = tracing_subscriber::fmt::layer()
            .with_writer(writer)
            .with_ansi(false)
            .with_target(false);
        let subscriber = tracing_subscriber::registry().with(Guard::new(layer));
        let huge = "é\n".repeat(1 << 19);
        tracing::subscriber::with_default(subscriber, || {
            tracing::warn!(target: "rmcp::service", "method not found: {huge}");
            let span = tracing::info_span!("request", id = %huge);
            let _entered = span.enter();
            tracing::warn!(target: "rmcp::service", "inside a big span");
        });
        let text = String::from_utf8(out.lock().clone()).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 2, "{}", &text[..200.min(text.len())]);
        for line in lines {
            assert!(line.len() < MAX_LINE, "{}", line.len());
        }
        assert!(text.contains("cut_bytes="), "{}", &text[..200]);
        assert!(
            text.contains("[line cut]"),
            "the span's fields are cut on the line"
        );
    }
}
