//! Human-readable output: the status block, tables, and RFC 3339 times from unix seconds.

use std::borrow::Cow;
use std::time::Duration;

use robota_proto::{
    BearerInfo, GrantKind, GrantRecord, JobRecord, KeySetStatus, Status, UpstreamDiff,
    UpstreamStatus,
};

/// Characters that are invisible or reorder text, beyond the C0/C1 controls and DEL that
/// `char::is_control` covers: Unicode's format characters (bidi embeddings, overrides and
/// isolates, marks, zero-width characters, the BOM, interlinear annotations, tags), the
/// line and paragraph separators, and fillers that render as nothing.
const HIDDEN: &[(u32, u32)] = &[
    (0x00AD, 0x00AD),   // soft hyphen
    (0x034F, 0x034F),   // combining grapheme joiner
    (0x0600, 0x0605),   // Arabic number signs
    (0x061C, 0x061C),   // Arabic letter mark
    (0x06DD, 0x06DD),   // Arabic end of ayah
    (0x070F, 0x070F),   // Syriac abbreviation mark
    (0x0890, 0x0891),   // Arabic pound/piastre marks above
    (0x08E2, 0x08E2),   // Arabic disputed end of ayah
    (0x115F, 0x1160),   // Hangul fillers
    (0x17B4, 0x17B5),   // Khmer inherent vowels
    (0x180B, 0x180F),   // Mongolian variation selectors and vowel separator
    (0x200B, 0x200F),   // zero-width space/non-joiner/joiner, LRM, RLM
    (0x2028, 0x202E),   // line/paragraph separators; LRE, RLE, PDF, LRO, RLO
    (0x2060, 0x206F),   // word joiner, invisible operators; LRI, RLI, FSI, PDI; deprecated
    (0x3164, 0x3164),   // Hangul filler
    (0xFE00, 0xFE0F),   // variation selectors
    (0xFEFF, 0xFEFF),   // zero-width no-break space (BOM)
    (0xFFA0, 0xFFA0),   // halfwidth Hangul filler
    (0xFFF9, 0xFFFB),   // interlinear annotation
    (0x110BD, 0x110BD), // Kaithi number sign
    (0x110CD, 0x110CD), // Kaithi number sign above
    (0x13430, 0x1343F), // Egyptian hieroglyph format controls
    (0x1BCA0, 0x1BCA3), // shorthand format controls
    (0x1D173, 0x1D17A), // musical symbol format controls
    (0xE0000, 0xE0FFF), // tags and variation selectors supplement
];

/// Whether `c` is rendered escaped: a control character, or one of [`HIDDEN`].
fn hidden(c: char) -> bool {
    let u = u32::from(c);
    c.is_control() || HIDDEN.iter().any(|&(lo, hi)| (lo..=hi).contains(&u))
}

/// Daemon-supplied text made safe and unambiguous for a terminal: control characters
/// (C0, DEL, C1), bidi overrides and isolates and other invisible format characters are
/// written as visible escapes (`\n`, `\t`, `\r`, else `\u{202e}`), and a backslash as
/// `\\`, so what is shown can be read back exactly. Text without them is returned as is.
pub fn clean(text: &str) -> Cow<'_, str> {
    if !text.chars().any(|c| c == '\\' || hidden(c)) {
        return Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 16);
    for c in text.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if hidden(c) => out.push_str(&format!("\\u{{{:x}}}", u32::from(c))),
            c => out.push(c),
        }
    }
    Cow::Owned(out)
}

/// Unix seconds as RFC 3339 UTC, e.g. `2023-11-14T22:13:20Z`.
pub fn rfc3339(unix_secs: u64) -> String {
    // u64 seconds fit i64 days many times over; the arithmetic below cannot overflow.
    let days = i64::try_from(unix_secs / 86_400).unwrap_or(i64::MAX / 2);
    let secs_of_day = unix_secs % 86_400;
    let (year, month, day) = civil_from_days(days);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        secs_of_day / 3600,
        secs_of_day / 60 % 60,
        secs_of_day % 60
    )
}

/// An optional time, `-` when absent.
pub fn opt_time(unix_secs: Option<u64>) -> String {
    unix_secs.map_or_else(|| "-".to_owned(), rfc3339)
}

/// Days since 1970-01-01 to a proleptic Gregorian (year, month, day); Howard Hinnant's
/// `civil_from_days`.
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097); // [0, 146096]
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365; // [0, 399]
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100); // [0, 365]
    let mp = (5 * doy + 2) / 153; // [0, 11], March-based
    let day = doy - (153 * mp + 2) / 5 + 1; // [1, 31]
    let month = if mp < 10 { mp + 3 } else { mp - 9 }; // [1, 12]
    let year = yoe + era * 400 + i64::from(month <= 2);
    // Both are in small ranges by construction.
    (
        year,
        u32::try_from(month).unwrap_or(1),
        u32::try_from(day).unwrap_or(1),
    )
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Align {
    Left,
    Right,
}

/// Columns separated by two spaces, padded to the widest cell, no trailing blanks.
pub fn table(columns: &[(&str, Align)], rows: &[Vec<String>]) -> String {
    let header: Vec<String> = columns.iter().map(|(name, _)| (*name).to_owned()).collect();
    let all: Vec<&Vec<String>> = std::iter::once(&header)
        .filter(|h| h.iter().any(|cell| !cell.is_empty()))
        .chain(rows)
        .collect();
    let widths: Vec<usize> = (0..columns.len())
        .map(|i| {
            all.iter()
                .map(|row| row.get(i).map_or(0, |cell| cell.chars().count()))
                .max()
                .unwrap_or(0)
        })
        .collect();
    let mut out = String::new();
    for row in all {
        let mut line = String::new();
        for (i, (_, align)) in columns.iter().enumerate() {
            let cell = row.get(i).map_or("", String::as_str);
            let pad = widths[i].saturating_sub(cell.chars().count());
            if i > 0 {
                line.push_str("  ");
            }
            match align {
                Align::Left => {
                    line.push_str(cell);
                    line.extend(std::iter::repeat_n(' ', pad));
                }
                Align::Right => {
                    line.extend(std::iter::repeat_n(' ', pad));
                    line.push_str(cell);
                }
            }
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

/// The `status` block: key/values, the carriers table, refusals by reason.
/// Where the served configuration came from, and whether the file now reads otherwise.
fn config_line(config: &robota_proto::ConfigStatus) -> String {
    let mut line = format!(
        "{} (sha256 {}, read {})",
        clean(&config.source),
        config.sha256.get(..12).unwrap_or(&config.sha256),
        rfc3339(config.loaded_at)
    );
    match (config.changed_on_disk, &config.read_error) {
        (Some(true), _) => line.push_str("; CHANGED on disk since: reload to apply"),
        (_, Some(e)) => line.push_str(&format!("; cannot read it now: {}", clean(e))),
        _ => {}
    }
    line
}

pub fn status(status: &Status) -> String {
    let yes_no = |b: bool| if b { "yes" } else { "no" }.to_owned();
    let facts = [
        ("version", clean(&status.version).into_owned()),
        ("pid", status.pid.to_string()),
        ("state", clean(&status.state).into_owned()),
        (
            "uptime",
            humantime::format_duration(Duration::from_secs(status.uptime_secs)).to_string(),
        ),
        ("generation", status.generation.to_string()),
        ("catalog size", status.catalog_size.to_string()),
        (
            "submission tool",
            clean(&status.submission_tool).into_owned(),
        ),
        ("active turn", yes_no(status.active_turn)),
        ("running jobs", status.running_jobs.to_string()),
        ("pending grants", status.pending_grants.to_string()),
        ("bearers", status.bearer_count.to_string()),
    ];
    let mut facts = facts.to_vec();
    if let Some(keys) = &status.key_set {
        facts.push(("key set", key_set(keys)));
    }
    facts.push(("health", clean(&status.health).into_owned()));
    if let Some(config) = &status.config {
        facts.push(("config", config_line(config)));
    }
    if !status.state_dir.is_empty() {
        facts.push(("state dir", clean(&status.state_dir).into_owned()));
    }
    if let Some(reload) = &status.last_reload {
        let outcome = if reload.ok { "ok" } else { "FAILED" };
        facts.push((
            "last reload",
            format!("{outcome} at {}", rfc3339(reload.at)),
        ));
    }
    if !status.upstreams.is_empty() {
        let up = status.upstreams.iter().filter(|u| u.state == "up").count();
        facts.push((
            "upstreams",
            format!(
                "{up} of {} up (robota-mcpctl upstreams)",
                status.upstreams.len()
            ),
        ));
    }
    let rows: Vec<Vec<String>> = facts
        .into_iter()
        .map(|(key, value)| vec![format!("{key}:"), value])
        .collect();
    let mut out = table(&[("", Align::Left), ("", Align::Left)], &rows);

    for problem in &status.problems {
        let counted = if problem.part.starts_with("upstream ") {
            "restarts"
        } else {
            "failed writes"
        };
        out.push_str(&format!(
            "DEGRADED: {}: {} ({} {counted} since {})\n",
            clean(&problem.part),
            clean(&problem.error),
            problem.failures,
            rfc3339(problem.since)
        ));
    }
    if let Some(reload) = status.last_reload.as_ref().filter(|r| !r.ok) {
        out.push_str("the last reload was refused; the running configuration stays:\n");
        for problem in &reload.problems {
            out.push_str(&format!("  {}\n", clean(problem)));
        }
    }

    out.push('\n');
    if status.carriers.is_empty() {
        out.push_str("no carriers\n");
    } else {
        let rows: Vec<Vec<String>> = status
            .carriers
            .iter()
            .map(|c| {
                vec![
                    clean(&c.name).into_owned(),
                    clean(&c.address).into_owned(),
                    c.public_url
                        .as_deref()
                        .map_or_else(|| "-".to_owned(), |url| clean(url).into_owned()),
                    c.admitted.map_or_else(|| "-".to_owned(), |n| n.to_string()),
                    c.refused.map_or_else(|| "-".to_owned(), |n| n.to_string()),
                ]
            })
            .collect();
        out.push_str(&table(
            &[
                ("CARRIER", Align::Left),
                ("ADDRESS", Align::Left),
                ("PUBLIC URL", Align::Left),
                ("ADMITTED", Align::Right),
                ("REFUSED", Align::Right),
            ],
            &rows,
        ));
    }

    out.push('\n');
    if status.refusals_last_hour.is_empty() {
        out.push_str("no refusals in the last hour\n");
    } else {
        let rows: Vec<Vec<String>> = status
            .refusals_last_hour
            .iter()
            .map(|(reason, count)| vec![clean(reason).into_owned(), count.to_string()])
            .collect();
        out.push_str(&table(
            &[
                ("REFUSED (LAST HOUR)", Align::Left),
                ("COUNT", Align::Right),
            ],
            &rows,
        ));
    }
    out
}

/// The upstreams table, then each upstream's refused tools and last error.
pub fn upstreams(upstreams: &[UpstreamStatus]) -> String {
    if upstreams.is_empty() {
        return "no upstreams configured\n".into();
    }
    let rows: Vec<Vec<String>> = upstreams
        .iter()
        .map(|u| {
            let kind = match &u.children {
                Some(children) => format!("{} ({})", clean(&u.kind), clean(children)),
                None => clean(&u.kind).into_owned(),
            };
            let mut tools = u.tools.len().to_string();
            if u.listed_from_cache {
                tools.push_str(" (last known)");
            }
            vec![
                clean(&u.name).into_owned(),
                kind,
                clean(&u.state).into_owned(),
                rfc3339(u.since),
                u.protocol
                    .as_deref()
                    .map_or_else(|| "-".to_owned(), |p| clean(p).into_owned()),
                tools,
                u.refused.len().to_string(),
                u.restarts.to_string(),
            ]
        })
        .collect();
    let mut out = table(
        &[
            ("UPSTREAM", Align::Left),
            ("KIND", Align::Left),
            ("STATE", Align::Left),
            ("SINCE", Align::Left),
            ("PROTOCOL", Align::Left),
            ("TOOLS", Align::Right),
            ("REFUSED", Align::Right),
            ("RESTARTS", Align::Right),
        ],
        &rows,
    );
    for u in upstreams {
        if !u.tools.is_empty() {
            let names: Vec<String> = u.tools.iter().map(|t| clean(t).into_owned()).collect();
            out.push_str(&format!(
                "\n{} tools: {}\n",
                clean(&u.name),
                names.join(", ")
            ));
        }
        for refused in &u.refused {
            out.push_str(&format!(
                "{} refused \"{}\": {}\n",
                clean(&u.name),
                clean(&refused.tool),
                clean(&refused.reason)
            ));
        }
        if let Some(error) = &u.last_error {
            out.push_str(&format!(
                "{} last error: {}\n",
                clean(&u.name),
                clean(error)
            ));
        }
        if let Some(surface) = &u.surface {
            out.push_str(&format!(
                "{} surface {}{}\n",
                clean(&u.name),
                clean(surface),
                if u.drift {
                    format!(
                        " — changed since approved, changes held (robota-mcpctl upstreams diff {})",
                        clean(&u.name)
                    )
                } else {
                    String::new()
                }
            ));
        }
    }
    out
}

/// What `upstreams diff NAME` shows: the approved and current surfaces, then each tool
/// added, removed or changed, member by member (approved `-`, current `+`).
pub fn upstream_diff(d: &UpstreamDiff) -> String {
    let name = clean(&d.name);
    let mut out = format!(
        "upstream {name}\napproved surface {}{}\ncurrent surface  {}\n",
        d.approved.as_deref().map_or(Cow::Borrowed("(none)"), clean),
        match (&d.approved_by, d.approved_at) {
            (Some(by), Some(at)) => format!(" (by {}, {})", clean(by), rfc3339(at)),
            _ => String::new(),
        },
        d.current.as_deref().map_or(Cow::Borrowed("(none)"), clean),
    );
    if d.approved == d.current
        && d.added.is_empty()
        && d.removed.is_empty()
        && d.changed.is_empty()
        && !d.executable_changed
    {
        out.push_str("no changes: every tool it lists is approved\n");
        return out;
    }
    if d.executable_changed {
        out.push_str("the executable it starts changed: every tool is held\n");
    }
    for tool in &d.added {
        out.push_str(&format!("added   {}\n", clean(tool)));
    }
    for tool in &d.removed {
        out.push_str(&format!("removed {}\n", clean(tool)));
    }
    for change in &d.changed {
        out.push_str(&format!("changed {}\n", clean(&change.tool)));
        for member in &change.members {
            out.push_str(&format!("  {}\n", clean(&member.member)));
            if let Some(approved) = &member.approved {
                out.push_str(&format!("    - {}\n", clean(approved)));
            }
            if let Some(current) = &member.current {
                out.push_str(&format!("    + {}\n", clean(current)));
            }
        }
    }
    if let Some(current) = &d.current {
        out.push_str(&format!(
            "approve with: robota-mcpctl upstreams approve {name} {}\n",
            clean(current)
        ));
    }
    out
}

/// The remote verifier's key set in one line: what is held, when it was fetched, when it
/// is refreshed next, and the last failure.
pub fn key_set(k: &KeySetStatus) -> String {
    let mut out = match (k.keys, &k.location) {
        (0, _) | (_, None) => format!(
            "no keys ({}): tokens are refused with keys-unavailable",
            k.source.as_str()
        ),
        (n, Some(location)) => format!(
            "{n} key{} from {}{}, fetched {}",
            if n == 1 { "" } else { "s" },
            if k.from_cache { "the cache of " } else { "" },
            clean(location),
            opt_time(k.fetched_at)
        ),
    };
    if let Some(next) = k.next_refresh_at {
        out.push_str(&format!("; next refresh {}", rfc3339(next)));
    }
    if k.refreshing {
        out.push_str("; refreshing now");
    }
    if let Some(error) = &k.last_error {
        out.push_str(&format!(
            "; the last refresh ({}) failed: {}",
            opt_time(k.last_attempt_at),
            clean(error)
        ));
    }
    out
}

/// Audit records, one line each (no header, so `--follow` output reads as one stream).
pub fn audit(records: &[robota_proto::AuditRecord]) -> String {
    records
        .iter()
        .map(|r| {
            let mut notes = Vec::new();
            if r.throttled {
                notes.push("throttled".to_owned());
            }
            if let Some(count) = r.count {
                notes.push(format!("×{count} in that second (past the rate)"));
            }
            if let Some(g) = &r.grant {
                let tool = g
                    .tool
                    .as_deref()
                    .map(|t| format!(" for {}", clean(t)))
                    .unwrap_or_default();
                notes.push(format!(
                    "grant {} of {}{tool} by {}",
                    g.grant_id,
                    clean(&g.caller),
                    clean(&g.by)
                ));
            }
            if let Some(u) = &r.upstream {
                notes.push(format!(
                    "upstream {} surface {} by {}",
                    clean(&u.name),
                    clean(&u.surface),
                    clean(&u.by)
                ));
            }
            let line = format!(
                "{}  #{:<6} {:<9} {:<22} {:<8} {}",
                rfc3339(r.time),
                r.seq,
                clean(&r.carrier),
                clean(&r.reason),
                clean(&r.address_class),
                notes.join("  ")
            );
            format!("{}\n", line.trim_end())
        })
        .collect()
}

/// The `bearer list` table.
pub fn bearers(bearers: &[BearerInfo]) -> String {
    if bearers.is_empty() {
        return "no live bearers\n".to_owned();
    }
    let rows: Vec<Vec<String>> = bearers
        .iter()
        .map(|b| {
            vec![
                clean(&b.label).into_owned(),
                rfc3339(b.created_at),
                opt_time(b.expires_at),
                opt_time(b.last_used_at),
            ]
        })
        .collect();
    table(
        &[
            ("LABEL", Align::Left),
            ("CREATED", Align::Left),
            ("EXPIRES", Align::Left),
            ("LAST USED", Align::Left),
        ],
        &rows,
    )
}

/// Signed unix seconds (the store's) as RFC 3339; `-` when absent or before 1970.
fn time_i64(unix_secs: Option<i64>) -> String {
    opt_time(unix_secs.and_then(|t| u64::try_from(t).ok()))
}

/// The `jobs list` table.
pub fn jobs(jobs: &[JobRecord]) -> String {
    if jobs.is_empty() {
        return "no jobs\n".to_owned();
    }
    let rows: Vec<Vec<String>> = jobs
        .iter()
        .map(|j| {
            let what = match &j.action {
                Some(action) => format!("{} {} {}", j.kind, action, j.target),
                None => format!("{} {}", j.kind, j.target),
            };
            vec![
                j.job_id.to_string(),
                j.state.as_str().to_owned(),
                clean(&j.owner).into_owned(),
                clean(&what).into_owned(),
                time_i64(Some(j.created_at)),
                time_i64(j.finished_at),
                clean(j.detail.as_deref().unwrap_or("-")).into_owned(),
            ]
        })
        .collect();
    table(
        &[
            ("ID", Align::Right),
            ("STATE", Align::Left),
            ("OWNER", Align::Left),
            ("WHAT", Align::Left),
            ("STARTED", Align::Left),
            ("FINISHED", Align::Left),
            ("DETAIL", Align::Left),
        ],
        &rows,
    )
}

/// The `grants list` table.
pub fn grants(grants: &[GrantRecord]) -> String {
    if grants.is_empty() {
        return "no grants\n".to_owned();
    }
    let rows: Vec<Vec<String>> = grants
        .iter()
        .map(|g| {
            // An approval of one call shows its tool and (the start of) its arguments.
            let (scope, reason) = match (g.kind, &g.tool) {
                (GrantKind::Call, Some(tool)) => (tool.clone(), arguments_preview(g)),
                _ => (g.scope.join(","), g.reason.clone()),
            };
            vec![
                g.grant_id.to_string(),
                g.state.as_str().to_owned(),
                clean(&g.caller).into_owned(),
                g.kind.as_str().to_owned(),
                clean(&scope).into_owned(),
                humantime::format_duration(Duration::from_secs(g.duration_secs)).to_string(),
                time_i64(g.expires_at),
                clean(&reason).into_owned(),
            ]
        })
        .collect();
    table(
        &[
            ("ID", Align::Right),
            ("STATE", Align::Left),
            ("CALLER", Align::Left),
            ("KIND", Align::Left),
            ("SCOPE", Align::Left),
            ("DURATION", Align::Left),
            ("EXPIRES", Align::Left),
            ("REASON", Align::Left),
        ],
        &rows,
    )
}

/// Longest arguments text the `grants list` table shows of an approval of one call.
const ARGUMENTS_PREVIEW: usize = 60;

/// `args {…}`, cut at [`ARGUMENTS_PREVIEW`] characters, or a pointer to `grants show`.
fn arguments_preview(g: &GrantRecord) -> String {
    match &g.arguments {
        Some(arguments) => {
            let text = arguments.to_string();
            match text.char_indices().nth(ARGUMENTS_PREVIEW) {
                Some((end, _)) => format!("args {}… (grants show {})", &text[..end], g.grant_id),
                None => format!("args {text}"),
            }
        }
        None => format!("args: see grants show {}", g.grant_id),
    }
}

/// `grants show`: every field of one grant, one per line; an approval of one call with
/// its arguments as indented JSON. Every caller-given string is escaped for the terminal.
pub fn grant_details(g: &GrantRecord) -> String {
    let mut rows: Vec<(&str, String)> = vec![
        ("grant", g.grant_id.to_string()),
        ("state", g.state.as_str().to_owned()),
        ("caller", clean(&g.caller).into_owned()),
        ("kind", g.kind.as_str().to_owned()),
    ];
    match (g.kind, &g.tool) {
        (GrantKind::Call, Some(tool)) => {
            rows.push(("tool", clean(tool).into_owned()));
            rows.push((
                "args sha256",
                clean(g.args_sha256.as_deref().unwrap_or("-")).into_owned(),
            ));
        }
        _ => {
            rows.push(("scope", clean(&g.scope.join(", ")).into_owned()));
            rows.push(("reason", clean(&g.reason).into_owned()));
        }
    }
    rows.push((
        "duration",
        humantime::format_duration(Duration::from_secs(g.duration_secs)).to_string(),
    ));
    rows.push(("requested", time_i64(Some(g.requested_at))));
    if g.decided_at.is_some() {
        rows.push(("decided", time_i64(g.decided_at)));
        rows.push((
            "decided by",
            clean(g.decided_by.as_deref().unwrap_or("-")).into_owned(),
        ));
    }
    if g.expires_at.is_some() {
        rows.push(("expires", time_i64(g.expires_at)));
    }
    if g.used_at.is_some() {
        rows.push(("used", time_i64(g.used_at)));
    }
    let width = rows.iter().map(|(k, _)| k.len()).max().unwrap_or(0) + 1;
    let mut out = String::new();
    for (key, value) in rows {
        out.push_str(&format!("{:<width$} {value}\n", format!("{key}:")));
    }
    if g.kind == GrantKind::Call {
        out.push_str("arguments:\n");
        match &g.arguments {
            Some(arguments) => {
                let pretty = serde_json::to_string_pretty(arguments).unwrap_or_default();
                for line in pretty.lines() {
                    out.push_str(&format!("  {}\n", clean(line)));
                }
            }
            None => out.push_str("  (not stored)\n"),
        }
    }
    out
}

/// One line confirming a grant decision.
pub fn grant_decided(g: &GrantRecord) -> String {
    let until = g
        .expires_at
        .filter(|_| g.state == robota_proto::GrantState::Approved)
        .map(|t| format!(" until {}", time_i64(Some(t))))
        .unwrap_or_default();
    let what = match (g.kind, &g.tool) {
        (GrantKind::Call, Some(tool)) => format!("one call of {tool}"),
        _ => g.scope.join(","),
    };
    format!(
        "grant {} for {} ({}) is {}{until}\n",
        g.grant_id,
        clean(&g.caller),
        clean(&what),
        g.state.as_str()
    )
}

/// `, expires <time>` or nothing, for confirmation lines.
pub fn expiry_suffix(expires_at: Option<u64>) -> String {
    expires_at
        .map(|at| format!(", expires {}", rfc3339(at)))
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use robota_proto::CarrierStatus;
    use std::collections::BTreeMap;

    #[test]
    fn rfc3339_matches_known_instants() {
        let cases = [
            (0, "1970-01-01T00:00:00Z"),
            (59, "1970-01-01T00:00:59Z"),
            (86_399, "1970-01-01T23:59:59Z"),
            (951_782_400, "2000-02-29T00:00:00Z"),
            (951_868_800, "2000-03-01T00:00:00Z"),
            (1_700_000_000, "2023-11-14T22:13:20Z"),
            (4_107_542_400, "2100-03-01T00:00:00Z"),
            (253_402_300_799, "9999-12-31T23:59:59Z"),
        ];
        for (secs, want) in cases {
            assert_eq!(rfc3339(secs), want, "{secs}");
        }
        // Absurd values format without panicking.
        assert!(rfc3339(u64::MAX).ends_with('Z'));
        assert_eq!(opt_time(None), "-");
    }

    #[test]
    fn tables_align_and_trim() {
        let text = table(
            &[("NAME", Align::Left), ("N", Align::Right)],
            &[
                vec!["a".into(), "1".into()],
                vec!["long-name".into(), "123".into()],
            ],
        );
        assert_eq!(text, "NAME         N\na            1\nlong-name  123\n");
    }

    #[test]
    fn status_shows_carriers_and_refusals() {
        let status = Status {
            version: "0.1.0".into(),
            pid: 42,
            uptime_secs: 3723,
            state: "serving".into(),
            generation: 1,
            carriers: vec![CarrierStatus {
                name: "remote".into(),
                address: "0.0.0.0:8443".into(),
                public_url: Some("https://mcp.example.com/mcp".into()),
                admitted: Some(7),
                refused: Some(3),
            }],
            catalog_size: 12,
            submission_tool: "agent_submit".into(),
            active_turn: false,
            running_jobs: 1,
            pending_grants: 2,
            bearer_count: 2,
            refusals_last_hour: BTreeMap::from([("bad-token".into(), 3)]),
            key_set: None,
            config: None,
            state_dir: String::new(),
            last_reload: None,
            health: "ok".into(),
            problems: Vec::new(),
            upstreams: Vec::new(),
        };
        let text = super::status(&status);
        for needle in [
            "pid:              42",
            "uptime:           1h 2m 3s",
            "active turn:      no",
            "running jobs:     1",
            "pending grants:   2",
            "https://mcp.example.com/mcp",
            "remote   0.0.0.0:8443  https://mcp.example.com/mcp         7        3",
            "bad-token                3",
        ] {
            assert!(text.contains(needle), "{needle:?} missing from\n{text}");
        }
    }

    #[test]
    fn job_and_grant_tables_show_state_owner_and_scope() {
        let job = JobRecord {
            job_id: 42,
            owner: "bearer:ci".into(),
            kind: "service".into(),
            target: "nginx.service".into(),
            action: Some("restart".into()),
            state: robota_proto::JobState::OutcomeUnknown,
            created_at: 1_700_000_000,
            finished_at: None,
            exit_code: None,
            detail: Some("cut\u{1b}[31m off".into()),
            output_bytes: 0,
            output_dropped: 0,
        };
        let text = jobs(&[job]);
        assert!(text.starts_with("ID"), "{text}");
        for needle in [
            "outcome-unknown",
            "bearer:ci",
            "service restart nginx.service",
            "2023-11-14T22:13:20Z",
        ] {
            assert!(text.contains(needle), "{needle:?} missing from\n{text}");
        }
        assert!(
            !text.contains('\u{1b}'),
            "control characters must not reach the terminal"
        );
        assert_eq!(jobs(&[]), "no jobs\n");

        let grant = GrantRecord {
            grant_id: 7,
            caller: "oauth:client-a/alice".into(),
            kind: robota_proto::GrantKind::Elevation,
            reason: "rotate certs".into(),
            scope: vec!["file.write".into(), "service.*".into()],
            duration_secs: 1800,
            state: robota_proto::GrantState::Approved,
            requested_at: 0,
            decided_at: Some(1),
            decided_by: Some("local:0".into()),
            expires_at: Some(1_700_000_000),
            tool: None,
            arguments: None,
            args_sha256: None,
            used_at: None,
        };
        let text = grants(std::slice::from_ref(&grant));
        for needle in [
            "approved",
            "oauth:client-a/alice",
            "file.write,service.*",
            "30m",
            "rotate certs",
        ] {
            assert!(text.contains(needle), "{needle:?} missing from\n{text}");
        }
        assert_eq!(
            grant_decided(&grant),
            "grant 7 for oauth:client-a/alice (file.write,service.*) is approved until 2023-11-14T22:13:20Z\n"
        );
    }

    #[test]
    fn upstream_table_shows_state_tools_refusals_and_neutralises_upstream_text() {
        let u = UpstreamStatus {
            name: "pg".into(),
            kind: "stdio".into(),
            children: Some("shared".into()),
            state: "backoff".into(),
            since: 0,
            protocol: Some("2025-11-25".into()),
            tools: vec!["pg.query".into()],
            refused: vec![robota_proto::RefusedTool {
                tool: "evil\u{202e}name\nFAKE".into(),
                reason: "bad\rname".into(),
            }],
            excluded: 2,
            listed_from_cache: true,
            restarts: 3,
            last_error: Some("it closed its stdout\n\u{1b}[31m".into()),
            surface: Some("ab12".into()),
            drift: true,
        };
        let text = upstreams(std::slice::from_ref(&u));
        for needle in [
            "UPSTREAM",
            "stdio (shared)",
            "backoff",
            "1 (last known)",
            "pg tools: pg.query",
            "evil\\u{202e}name\\nFAKE",
            "bad\\rname",
            "last error: it closed its stdout\\n\\u{1b}[31m",
        ] {
            assert!(text.contains(needle), "{needle:?} in {text}");
        }
        assert!(
            !text.contains('\u{202e}') && !text.contains('\u{1b}'),
            "{text}"
        );
        assert_eq!(upstreams(&[]), "no upstreams configured\n");
    }

    #[test]
    fn bearer_table_uses_dashes_for_absent_times() {
        let text = bearers(&[BearerInfo {
            label: "ci".into(),
            created_at: 0,
            expires_at: None,
            last_used_at: Some(1_700_000_000),
        }]);
        assert!(text.starts_with("LABEL"), "{text}");
        assert!(
            text.contains("ci     1970-01-01T00:00:00Z  -        2023-11-14T22:13:20Z"),
            "{text}"
        );
        assert_eq!(bearers(&[]), "no live bearers\n");
    }

    #[test]
    fn control_characters_are_neutralised() {
        assert_eq!(clean("plain"), "plain");
        assert!(matches!(clean("plain — ünïcödé 日本"), Cow::Borrowed(_)));
        assert_eq!(clean("a\x1b[2Jb\n"), "a\\u{1b}[2Jb\\n");
        assert_eq!(clean("\t\r\0\x7f"), "\\t\\r\\u{0}\\u{7f}");
        // C1 controls, e.g. NEL and CSI.
        assert_eq!(clean("x\u{85}\u{9b}y"), "x\\u{85}\\u{9b}y");
        // Bidi overrides, embeddings and isolates, marks.
        assert_eq!(
            clean("txt.\u{202e}exe\u{202c}"),
            "txt.\\u{202e}exe\\u{202c}"
        );
        for c in (0x202A..=0x202E)
            .chain(0x2066..=0x2069)
            .chain([0x200E, 0x200F, 0x061C])
        {
            let c = char::from_u32(c).unwrap();
            assert_eq!(clean(&c.to_string()), format!("\\u{{{:x}}}", u32::from(c)));
        }
        // Zero-width and other invisible characters, separators, tags.
        for c in [
            '\u{200b}',
            '\u{200d}',
            '\u{2060}',
            '\u{feff}',
            '\u{ad}',
            '\u{2028}',
            '\u{e0041}',
            '\u{3164}',
        ] {
            assert!(
                clean(&c.to_string()).starts_with("\\u{"),
                "{:x}",
                u32::from(c)
            );
        }
        // A backslash is doubled, so escapes in the input cannot pass for ours.
        assert_eq!(clean("a\\u{202e}b"), "a\\\\u{202e}b");
        // Nothing hidden survives, whatever the input.
        let all: String = (0..=0x10FFFF).filter_map(char::from_u32).collect();
        let shown = clean(&all);
        assert!(!shown.chars().any(hidden), "a hidden character got through");
    }

    #[test]
    fn key_set_line_says_what_is_held_and_what_failed() {
        use robota_proto::KeySourceKind;
        let held = KeySetStatus {
            source: KeySourceKind::Discovery,
            location: Some("https://auth.example.com/jwks".into()),
            keys: 3,
            from_cache: false,
            fetched_at: Some(1_700_000_000),
            last_attempt_at: Some(1_700_000_600),
            last_error: None,
            next_refresh_at: Some(1_700_000_600),
            refreshing: false,
        };
        assert_eq!(
            key_set(&held),
            "3 keys from https://auth.example.com/jwks, fetched 2023-11-14T22:13:20Z; \
             next refresh 2023-11-14T22:23:20Z"
        );
        let failing = KeySetStatus {
            keys: 1,
            from_cache: true,
            refreshing: true,
            last_error: Some("GET https://auth.example.com/jwks answered 503\x1b[2J".into()),
            ..held.clone()
        };
        assert_eq!(
            key_set(&failing),
            "1 key from the cache of https://auth.example.com/jwks, fetched 2023-11-14T22:13:20Z; \
             next refresh 2023-11-14T22:23:20Z; refreshing now; the last refresh \
             (2023-11-14T22:23:20Z) failed: GET https://auth.example.com/jwks answered 503\\u{1b}[2J"
        );
        let none = KeySetStatus {
            source: KeySourceKind::JwksFile,
            location: None,
            keys: 0,
            next_refresh_at: None,
            ..held
        };
        assert_eq!(
            key_set(&none),
            "no keys (jwks-file): tokens are refused with keys-unavailable"
        );
    }
}
