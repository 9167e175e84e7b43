//! Reading the documentation the way `tests/tests/operations/docs.rs` checks it: fenced blocks of
//! Markdown files, the shell commands of `sh` blocks, a small YAML subset (Prometheus
//! configuration and rule files), metric names in PromQL, headings as link anchors.
//!
//! Pure functions of text: no process, no socket.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// The workspace root (the parent of `tests/`).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ has a parent")
        .to_path_buf()
}

/// `README.md` and every `docs/*.md`, sorted, relative to the workspace root.
pub fn doc_files() -> Vec<PathBuf> {
    let root = repo_root();
    let mut files = vec![PathBuf::from("README.md")];
    let mut docs: Vec<PathBuf> = std::fs::read_dir(root.join("docs"))
        .expect("read docs/")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "md"))
        .map(|p| PathBuf::from("docs").join(p.file_name().expect("file name")))
        .collect();
    docs.sort();
    files.extend(docs);
    files
}

/// Reads a file relative to the workspace root.
pub fn read(rel: &Path) -> String {
    let path = repo_root().join(rel);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// One fenced code block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Block {
    /// The info string's first word (`sh`, `json`, …), empty when there is none.
    pub lang: String,
    /// 1-based line of the opening fence.
    pub line: usize,
    /// The content lines, with the fence's indentation removed.
    pub lines: Vec<String>,
}

impl Block {
    pub fn text(&self) -> String {
        let mut t = self.lines.join("\n");
        t.push('\n');
        t
    }
}

/// Every ```-fenced block of a Markdown text (fences may be indented, as in list items).
pub fn fenced_blocks(markdown: &str) -> Vec<Block> {
    let mut out = Vec::new();
    let mut open: Option<(usize, usize, String, Vec<String>)> = None;
    for (i, raw) in markdown.lines().enumerate() {
        let trimmed = raw.trim_start();
        let indent = raw.len() - trimmed.len();
        match open.take() {
            None => {
                if let Some(info) = trimmed.strip_prefix("```") {
                    let lang = info.split_whitespace().next().unwrap_or("").to_owned();
                    open = Some((i + 1, indent, lang, Vec::new()));
                }
            }
            Some((line, fence_indent, lang, mut lines)) => {
                if trimmed.starts_with("```") && trimmed.trim_end() == "```" {
                    out.push(Block { lang, line, lines });
                } else {
                    let strip = raw
                        .char_indices()
                        .take_while(|(j, c)| *j < fence_indent && *c == ' ')
                        .count();
                    lines.push(raw[strip..].to_owned());
                    open = Some((line, fence_indent, lang, lines));
                }
            }
        }
    }
    assert!(open.is_none(), "unterminated code block: {open:?}");
    out
}

/// Markdown text without its fenced blocks (for links and tables in prose).
pub fn prose(markdown: &str) -> String {
    let mut out = String::new();
    let mut inside = false;
    for line in markdown.lines() {
        if line.trim_start().starts_with("```") {
            inside = !inside;
            out.push('\n');
            continue;
        }
        if !inside {
            out.push_str(line);
        }
        out.push('\n');
    }
    out
}

/// One shell command of an `sh` block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShellCommand {
    /// 1-based line in the file where the command starts.
    pub line: usize,
    /// The command on one line: continuation lines joined, runs of whitespace outside
    /// quotes kept as written except around the joins.
    pub text: String,
}

/// The commands of an `sh` block starting at `block.line`: one per line, `\` at the end
/// of a line continues it, blank lines and `#` comment lines are skipped. Here-documents
/// are not supported (panics), so that no command can hide in one.
pub fn shell_commands(block: &Block) -> Vec<ShellCommand> {
    let mut out = Vec::new();
    let mut current: Option<(usize, String)> = None;
    for (i, line) in block.lines.iter().enumerate() {
        let file_line = block.line + 1 + i;
        assert!(
            !line.contains("<<"),
            "line {file_line}: here-documents are not supported in sh blocks: {line}"
        );
        let (start, mut text) = match current.take() {
            Some((start, text)) => (start, text),
            None => {
                let t = line.trim();
                if t.is_empty() || t.starts_with('#') {
                    continue;
                }
                (file_line, String::new())
            }
        };
        let piece = line.trim();
        let (piece, continues) = match piece.strip_suffix('\\') {
            Some(p) => (p.trim_end(), true),
            None => (piece, false),
        };
        if !text.is_empty() {
            text.push(' ');
        }
        text.push_str(piece);
        if continues {
            current = Some((start, text));
        } else {
            out.push(ShellCommand { line: start, text });
        }
    }
    assert!(
        current.is_none(),
        "block at line {}: the last command ends with a continuation",
        block.line
    );
    out
}

/// `cargo run [-q|--quiet|--release|--locked]… -p NAME [-- ARGS]` → `NAME ARGS`, the
/// binary the README runs through cargo; any other text unchanged.
pub fn strip_cargo_run(command: &str) -> String {
    let Some(mut rest) = command.strip_prefix("cargo run ") else {
        return command.to_owned();
    };
    loop {
        rest = rest.trim_start();
        let flag = ["-q ", "--quiet ", "--release ", "--locked "]
            .iter()
            .find_map(|f| rest.strip_prefix(f));
        match flag {
            Some(r) => rest = r,
            None => break,
        }
    }
    let Some(r) = rest.strip_prefix("-p ") else {
        return command.to_owned();
    };
    let (name, after) = r.trim_start().split_once(' ').unwrap_or((r.trim(), ""));
    let after = after.trim_start();
    let after = if after == "--" {
        ""
    } else {
        after.strip_prefix("-- ").unwrap_or(after)
    };
    format!("{name} {after}").trim_end().to_owned()
}

/// GitHub's anchor for a heading: lower case, spaces to `-`, punctuation other than `-`
/// and `_` dropped.
pub fn anchor(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

/// The anchors of every heading of a Markdown text (outside code blocks).
pub fn anchors(markdown: &str) -> BTreeSet<String> {
    prose(markdown)
        .lines()
        .filter_map(|l| {
            let hashes = l.chars().take_while(|c| *c == '#').count();
            (1..=6).contains(&hashes).then(|| &l[hashes..])
        })
        .filter(|rest| rest.starts_with(' '))
        .map(anchor)
        .collect()
}

/// The targets of inline Markdown links `[text](target)` in prose.
pub fn link_targets(markdown: &str) -> Vec<String> {
    let text = prose(markdown);
    let mut out = Vec::new();
    let mut rest = text.as_str();
    while let Some(i) = rest.find("](") {
        let after = &rest[i + 2..];
        match after.find(')') {
            Some(end) => {
                out.push(after[..end].to_owned());
                rest = &after[end..];
            }
            None => break,
        }
    }
    out
}

/// Identifiers in a PromQL expression that name metrics of ours (`robota_mcpd_…`) or of
/// the process collector (`process_…`), with histogram suffixes (`_bucket`, `_sum`,
/// `_count`) kept: the caller decides what a suffix means.
pub fn metric_names(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let bytes = text.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        let c = bytes[i];
        if c.is_ascii_alphabetic() || c == b'_' {
            let start = i;
            while i < bytes.len() && (bytes[i].is_ascii_alphanumeric() || bytes[i] == b'_') {
                i += 1;
            }
            let preceded = start > 0 && (bytes[start - 1] == b'$' || bytes[start - 1] == b'.');
            let word = &text[start..i];
            // A bare prefix (`robota_mcpd_` in `grep '^robota_mcpd_'`) names no metric.
            let prefix_only = word.ends_with('_');
            if !preceded
                && !prefix_only
                && (word.starts_with("robota_mcpd_") || word.starts_with("process_"))
            {
                out.insert(word.to_owned());
            }
        } else {
            i += 1;
        }
    }
    out
}

/// Whether `(`/`)`, `[`/`]`, `{`/`}` nest properly and quotes close in a PromQL
/// expression (a cheap sanity check; Prometheus itself is not available here).
pub fn promql_balanced(expr: &str) -> bool {
    let mut stack = Vec::new();
    let mut quote: Option<char> = None;
    let mut escaped = false;
    for c in expr.chars() {
        if let Some(q) = quote {
            if escaped {
                escaped = false;
            } else if c == '\\' {
                escaped = true;
            } else if c == q {
                quote = None;
            }
            continue;
        }
        match c {
            '"' | '\'' | '`' => quote = Some(c),
            '(' | '[' | '{' => stack.push(c),
            ')' | ']' | '}' => {
                let open = match c {
                    ')' => '(',
                    ']' => '[',
                    _ => '{',
                };
                if stack.pop() != Some(open) {
                    return false;
                }
            }
            _ => {}
        }
    }
    stack.is_empty() && quote.is_none()
}

/// A value of the YAML subset [`yaml`] reads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Yaml {
    Map(Vec<(String, Yaml)>),
    Seq(Vec<Yaml>),
    Str(String),
    /// A key with nothing after it and nothing nested.
    Null,
}

impl Yaml {
    pub fn get(&self, key: &str) -> Option<&Yaml> {
        match self {
            Yaml::Map(entries) => entries.iter().find(|(k, _)| k == key).map(|(_, v)| v),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Yaml::Str(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_seq(&self) -> Option<&[Yaml]> {
        match self {
            Yaml::Seq(items) => Some(items),
            _ => None,
        }
    }

    pub fn keys(&self) -> Vec<&str> {
        match self {
            Yaml::Map(entries) => entries.iter().map(|(k, _)| k.as_str()).collect(),
            _ => Vec::new(),
        }
    }
}

/// Parses the YAML subset Prometheus configuration and rule files need: block mappings
/// and sequences (`- ` items, also `- key: value`), plain, single- and double-quoted
/// scalars, flow sequences of scalars (`["a", b]`), `#` comments. Anything else — tabs,
/// anchors, tags, block scalars (`|`, `>`), flow mappings, duplicate keys, a plain scalar
/// holding `: ` — is an error, so that what passes here is read the same way by any YAML
/// parser.
pub fn yaml(text: &str) -> Result<Yaml, String> {
    let mut lines = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        if raw.contains('\t') {
            return Err(format!("line {}: tab character", i + 1));
        }
        let content = strip_comment(raw);
        if content.trim().is_empty() {
            continue;
        }
        let indent = content.len() - content.trim_start().len();
        lines.push(YamlLine {
            number: i + 1,
            indent,
            text: content.trim().to_owned(),
        });
    }
    if lines.is_empty() {
        return Ok(Yaml::Null);
    }
    let mut pos = 0;
    let indent = lines[0].indent;
    let value = yaml_node(&mut lines, &mut pos, indent)?;
    if pos != lines.len() {
        return Err(format!(
            "line {}: unexpected indentation",
            lines[pos].number
        ));
    }
    Ok(value)
}

struct YamlLine {
    number: usize,
    indent: usize,
    text: String,
}

/// The line without a `#` comment (a `#` at the start or after a space, outside quotes).
fn strip_comment(line: &str) -> &str {
    let mut quote: Option<char> = None;
    let mut prev = ' ';
    for (i, c) in line.char_indices() {
        match quote {
            Some(q) if c == q => quote = None,
            Some(_) => {}
            None if c == '"' || c == '\'' => quote = Some(c),
            None if c == '#' && prev == ' ' => return line[..i].trim_end(),
            None => {}
        }
        prev = c;
    }
    line.trim_end()
}

fn yaml_node(lines: &mut [YamlLine], pos: &mut usize, indent: usize) -> Result<Yaml, String> {
    let first = &lines[*pos];
    if first.text == "-" || first.text.starts_with("- ") {
        let mut items = Vec::new();
        while *pos < lines.len() && lines[*pos].indent == indent {
            let line = &mut lines[*pos];
            if !(line.text == "-" || line.text.starts_with("- ")) {
                return Err(format!("line {}: expected a `- ` item", line.number));
            }
            let rest = line.text[1..].trim_start().to_owned();
            if rest.is_empty() {
                *pos += 1;
                match lines.get(*pos) {
                    Some(next) if next.indent > indent => {
                        let inner = next.indent;
                        items.push(yaml_node(lines, pos, inner)?);
                    }
                    _ => items.push(Yaml::Null),
                }
            } else {
                // `- key: value` opens a mapping (or `- scalar`): re-read the rest of the
                // line as if it stood two columns further in.
                line.indent = indent + 2;
                line.text = rest;
                items.push(yaml_node(lines, pos, indent + 2)?);
            }
        }
        return Ok(Yaml::Seq(items));
    }
    if !looks_like_entry(&first.text) {
        let value = scalar(&first.text).map_err(|e| format!("line {}: {e}", first.number))?;
        *pos += 1;
        return Ok(value);
    }
    let mut entries: Vec<(String, Yaml)> = Vec::new();
    while *pos < lines.len() && lines[*pos].indent == indent {
        let line = &lines[*pos];
        let number = line.number;
        let (key, rest) = split_entry(&line.text)
            .ok_or_else(|| format!("line {number}: expected `key: value`"))?;
        if entries.iter().any(|(k, _)| *k == key) {
            return Err(format!("line {number}: duplicate key {key:?}"));
        }
        *pos += 1;
        let value = if rest.is_empty() {
            match lines.get(*pos) {
                Some(next) if next.indent > indent => {
                    let inner = next.indent;
                    yaml_node(lines, pos, inner)?
                }
                // A sequence may sit at the key's own indentation.
                Some(next)
                    if next.indent == indent
                        && (next.text == "-" || next.text.starts_with("- ")) =>
                {
                    yaml_node(lines, pos, indent)?
                }
                _ => Yaml::Null,
            }
        } else {
            scalar(&rest).map_err(|e| format!("line {number}: {e}"))?
        };
        entries.push((key, value));
    }
    if *pos < lines.len() && lines[*pos].indent > indent {
        return Err(format!(
            "line {}: unexpected indentation",
            lines[*pos].number
        ));
    }
    Ok(Yaml::Map(entries))
}

fn looks_like_entry(text: &str) -> bool {
    split_entry(text).is_some()
}

/// `key: value` or `key:` (the key plain or quoted).
fn split_entry(text: &str) -> Option<(String, String)> {
    if let Some(q) = text.chars().next().filter(|c| *c == '"' || *c == '\'') {
        let end = text[1..].find(q)? + 1;
        let key = text[1..end].to_owned();
        let rest = text[end + 1..].strip_prefix(':')?;
        if !(rest.is_empty() || rest.starts_with(' ')) {
            return None;
        }
        return Some((key, rest.trim().to_owned()));
    }
    let (key, rest) = match text.find(": ") {
        Some(i) => (&text[..i], &text[i + 2..]),
        None => (text.strip_suffix(':')?, ""),
    };
    // Keys of this subset are plain words: no spaces, no quotes, no indicators.
    if key.is_empty()
        || key.contains([' ', '"', '\''])
        || key.starts_with(['[', '{', '-', '&', '*', '!', '|', '>', '%', '@', '`'])
    {
        return None;
    }
    Some((key.to_owned(), rest.trim().to_owned()))
}

fn scalar(text: &str) -> Result<Yaml, String> {
    let text = text.trim();
    if let Some(inner) = text.strip_prefix('"') {
        let inner = inner
            .strip_suffix('"')
            .ok_or_else(|| format!("unterminated double-quoted scalar: {text}"))?;
        let mut out = String::new();
        let mut chars = inner.chars();
        while let Some(c) = chars.next() {
            match c {
                '\\' => match chars.next() {
                    Some('"') => out.push('"'),
                    Some('\\') => out.push('\\'),
                    Some('n') => out.push('\n'),
                    Some('t') => out.push('\t'),
                    other => return Err(format!("unsupported escape \\{other:?} in {text}")),
                },
                '"' => return Err(format!("unescaped quote inside {text}")),
                c => out.push(c),
            }
        }
        return Ok(Yaml::Str(out));
    }
    if let Some(inner) = text.strip_prefix('\'') {
        let inner = inner
            .strip_suffix('\'')
            .ok_or_else(|| format!("unterminated single-quoted scalar: {text}"))?;
        if inner.replace("''", "").contains('\'') {
            return Err(format!("unescaped quote inside {text}"));
        }
        return Ok(Yaml::Str(inner.replace("''", "'")));
    }
    if let Some(inner) = text.strip_prefix('[') {
        let inner = inner
            .strip_suffix(']')
            .ok_or_else(|| format!("unterminated flow sequence: {text}"))?;
        let mut items = Vec::new();
        for item in split_flow(inner)? {
            if !item.trim().is_empty() {
                items.push(scalar(&item)?);
            }
        }
        return Ok(Yaml::Seq(items));
    }
    if text.starts_with(['{', '&', '*', '!', '|', '>', '%', '@', '`', ']', '}', ',']) {
        return Err(format!("unsupported plain scalar: {text}"));
    }
    if text.contains(": ") || text.ends_with(':') {
        return Err(format!("a plain scalar must not hold `: `: {text}"));
    }
    Ok(Yaml::Str(text.to_owned()))
}

/// Splits the inside of a flow sequence at top-level commas.
fn split_flow(inner: &str) -> Result<Vec<String>, String> {
    let mut items = Vec::new();
    let mut current = String::new();
    let mut quote: Option<char> = None;
    for c in inner.chars() {
        match quote {
            Some(q) if c == q => {
                quote = None;
                current.push(c);
            }
            Some(_) => current.push(c),
            None if c == '"' || c == '\'' => {
                quote = Some(c);
                current.push(c);
            }
            None if c == ',' => items.push(std::mem::take(&mut current)),
            None if c == '[' || c == '{' => {
                return Err(format!(
                    "nested flow collections are not supported: [{inner}]"
                ));
            }
            None => current.push(c),
        }
    }
    if quote.is_some() {
        return Err(format!("unterminated quote in [{inner}]"));
    }
    items.push(current);
    Ok(items)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fenced_blocks_keep_language_line_and_indentation() {
        let md = "text\n```sh\necho a\n```\n1. step\n\n   ```toml\n   [x]\n   y = 1\n   ```\n```\nplain\n```\n";
        let b = fenced_blocks(md);
        assert_eq!(b.len(), 3);
        assert_eq!((b[0].lang.as_str(), b[0].line), ("sh", 2));
        assert_eq!(b[0].lines, ["echo a"]);
        assert_eq!(b[1].lang, "toml");
        assert_eq!(b[1].lines, ["[x]", "y = 1"]);
        assert_eq!(b[2].lang, "");
        assert!(!prose(md).contains("echo a"));
    }

    #[test]
    fn shell_commands_join_continuations_and_skip_comments() {
        let block = Block {
            lang: "sh".into(),
            line: 10,
            lines: vec![
                "# a comment".into(),
                "curl -s http://x \\".into(),
                "  -H 'A: b' \\".into(),
                "  -d '{}'".into(),
                "".into(),
                "robota-mcpctl status   # trailing".into(),
            ],
        };
        let c = shell_commands(&block);
        assert_eq!(c.len(), 2);
        assert_eq!(c[0].line, 12);
        assert_eq!(c[0].text, "curl -s http://x -H 'A: b' -d '{}'");
        assert_eq!(c[1].line, 16);
        assert_eq!(c[1].text, "robota-mcpctl status   # trailing");
    }

    #[test]
    fn cargo_run_becomes_the_binary() {
        assert_eq!(
            strip_cargo_run("cargo run -q -p robota-mcpctl -- bearer issue --output ./b"),
            "robota-mcpctl bearer issue --output ./b"
        );
        assert_eq!(
            strip_cargo_run("cargo run --release -p robota-mcpd"),
            "robota-mcpd"
        );
        assert_eq!(
            strip_cargo_run("cargo test --workspace"),
            "cargo test --workspace"
        );
    }

    #[test]
    fn anchors_follow_github() {
        assert_eq!(
            anchor("`robota-mcpctl stdio`: the running daemon's session"),
            "robota-mcpctl-stdio-the-running-daemons-session"
        );
        assert_eq!(anchor("By audit reason"), "by-audit-reason");
        let a = anchors("# Title\n```sh\n# not a heading\n```\n## Sub part\n#nope\n");
        assert_eq!(a.into_iter().collect::<Vec<_>>(), ["sub-part", "title"]);
        assert_eq!(
            link_targets("see [a](b.md#c) and [d](https://e)\n```\n[x](y)\n```\n"),
            ["b.md#c", "https://e"]
        );
    }

    #[test]
    fn metric_names_and_balance() {
        let e = r#"histogram_quantile(0.9, sum by (le) (rate(robota_mcpd_tool_call_duration_seconds_bucket{job="$job"}[5m]))) / process_open_fds"#;
        assert_eq!(
            metric_names(e).into_iter().collect::<Vec<_>>(),
            [
                "process_open_fds",
                "robota_mcpd_tool_call_duration_seconds_bucket"
            ]
        );
        assert!(metric_names("{{ $labels.process_x }}").is_empty());
        assert!(promql_balanced(e));
        assert!(!promql_balanced("sum(rate(x[5m])"));
        assert!(!promql_balanced(r#"x{a="b}"#));
    }

    #[test]
    fn yaml_subset() {
        let text = r#"
# comment
groups:
  - name: g
    rules:
      - alert: A
        expr: up{job="x"} == 0   # trailing comment
        labels:
          severity: critical
        annotations:
          summary: "it is {{ $labels.instance }}: down"
targets: ["127.0.0.1:9464", 'b']
empty:
list:
- a
- b
"#;
        let y = yaml(text).unwrap();
        let rule = &y.get("groups").unwrap().as_seq().unwrap()[0]
            .get("rules")
            .unwrap()
            .as_seq()
            .unwrap()[0];
        assert_eq!(
            rule.get("expr").unwrap().as_str(),
            Some(r#"up{job="x"} == 0"#)
        );
        assert_eq!(
            rule.get("annotations")
                .unwrap()
                .get("summary")
                .unwrap()
                .as_str(),
            Some("it is {{ $labels.instance }}: down")
        );
        assert_eq!(
            y.get("targets"),
            Some(&Yaml::Seq(vec![
                Yaml::Str("127.0.0.1:9464".into()),
                Yaml::Str("b".into())
            ]))
        );
        assert_eq!(y.get("empty"), Some(&Yaml::Null));
        assert_eq!(y.get("list").unwrap().as_seq().unwrap().len(), 2);
        for bad in [
            "a: 1\na: 2\n",
            "a:\n\tb: 1\n",
            "a: |\n  text\n",
            "a: {b: 1}\n",
            "a: b: c\n",
            "a: \"open\n",
            "a:\n  b: 1\n    c: 2\n",
        ] {
            assert!(yaml(bad).is_err(), "{bad:?} should be refused");
        }
    }
}
