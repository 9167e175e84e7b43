//! The crate's layers point one way: every top-level module of `daemon/src` has a level,
//! and code may name (`crate::x`) only modules of a lower level. This test reads the
//! sources and fails on the first reference that points sideways or up, naming the file.
//! Test modules (`#[cfg(test)] mod …` at the end of a file) may reach anywhere.
//!
//! The levels, bottom first (docs/ARCHITECTURE.md draws them):

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

const LEVELS: &[&[&str]] = &[
    // The vocabulary: closed sets, the caller, ids.
    &["vocab"],
    // Values and sinks that know only the vocabulary.
    &[
        "config",
        "metrics",
        "bearer",
        "canonical",
        "jsonrpc",
        "params",
        "budget",
        "notify",
        "logging",
        "health",
        "owners",
    ],
    // Durable state and the audit trail; the remote verifier.
    &["store", "audit", "oauth"],
    // Services over the store, and the control socket.
    &["jobs", "grants", "control"],
    &["host"],
    // The tool contract and the catalog of sources.
    &["catalog"],
    // Tools (implementations), downstream MCP servers (sources of imported tools) and the
    // session (roles over the catalog): none knows another.
    &["tools", "upstream", "session"],
    // MCP: the rmcp handler, then the transport lifecycle.
    &["mcp"],
    &["transport"],
    // Where requests arrive.
    &["carrier"],
    // Plan, bind, serve.
    &["daemon"],
];

/// Items of the crate root that any layer may use.
const ROOT_ITEMS: &[&str] = &["error_chain", "exit"];

fn level_of(module: &str) -> Option<usize> {
    LEVELS.iter().position(|level| level.contains(&module))
}

/// The code of a file, without comments, string contents and its trailing test module.
fn code(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let bytes = text.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        if text[i..].starts_with("//") {
            while i < bytes.len() && bytes[i] != b'\n' {
                i += 1;
            }
        } else if text[i..].starts_with("/*") {
            match text[i + 2..].find("*/") {
                Some(end) => i += end + 4,
                None => break,
            }
        } else if text[i..].starts_with("'\"'") || text[i..].starts_with("'\\\"'") {
            // A quote as a char literal does not open a string.
            i += if bytes[i + 1] == b'\\' { 4 } else { 3 };
        } else if bytes[i] == b'"' {
            out.push('"');
            i += 1;
            while i < bytes.len() && bytes[i] != b'"' {
                i += if bytes[i] == b'\\' { 2 } else { 1 };
            }
            out.push('"');
            i += 1;
        } else {
            let c = text[i..].chars().next().expect("a char");
            out.push(c);
            i += c.len_utf8();
        }
    }
    let test_module = out.find("#[cfg(test)]").filter(|&at| {
        let rest = out[at + "#[cfg(test)]".len()..].trim_start();
        rest.starts_with("mod ") || rest.starts_with("pub(crate) mod ") || rest.starts_with("#[")
    });
    match test_module {
        Some(at) => out[..at].to_owned(),
        None => out,
    }
}

/// The top-level modules a piece of code names through `crate::`.
fn references(code: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = code;
    while let Some(at) = rest.find("crate::") {
        let before = rest[..at].chars().next_back();
        rest = &rest[at + "crate::".len()..];
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
            continue; // `robota_mcpd_crate::…` or similar, not a path of ours
        }
        if let Some(group) = rest.strip_prefix('{') {
            let end = group.find('}').unwrap_or(group.len());
            for item in group[..end].split(',') {
                let name: String = item
                    .trim()
                    .chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_')
                    .collect();
                if !name.is_empty() {
                    out.push(name);
                }
            }
            continue;
        }
        let name: String = rest
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        if !name.is_empty() {
            out.push(name);
        }
    }
    out
}

fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("read_dir") {
        let path = entry.expect("entry").path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// Every violation: (file, its module, the module it names).
fn violations(root: &Path) -> (Vec<(String, String, String)>, usize) {
    let mut files = Vec::new();
    sources(root, &mut files);
    let mut found = Vec::new();
    let mut edges = 0;
    for file in files {
        let rel = file.strip_prefix(root).expect("under src");
        let first = rel
            .components()
            .next()
            .and_then(|c| c.as_os_str().to_str())
            .expect("a component");
        let module = first.trim_end_matches(".rs");
        if module == "lib" || module == "main" || module == "cli" {
            continue;
        }
        let Some(level) = level_of(module) else {
            found.push((
                rel.display().to_string(),
                module.to_owned(),
                "(no level)".into(),
            ));
            continue;
        };
        let text = std::fs::read_to_string(&file).expect("read");
        for named in references(&code(&text)) {
            if named == module || ROOT_ITEMS.contains(&named.as_str()) {
                continue;
            }
            edges += 1;
            match level_of(&named) {
                Some(l) if l < level => {}
                _ => found.push((rel.display().to_string(), module.to_owned(), named)),
            }
        }
    }
    (found, edges)
}

#[test]
fn every_reference_points_down() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let (found, edges) = violations(&root);
    assert!(
        edges > 100,
        "only {edges} references found: is the reader broken?"
    );
    let mut by_file: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (file, module, named) in found {
        by_file
            .entry(file)
            .or_default()
            .push(format!("{module} -> {named}"));
    }
    assert!(
        by_file.is_empty(),
        "references that point sideways or up (see LEVELS in this file):\n{by_file:#?}"
    );
}

#[test]
fn every_top_level_module_has_a_level() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let lib = std::fs::read_to_string(root.join("lib.rs")).expect("lib.rs");
    let declared: Vec<&str> = lib
        .lines()
        .filter_map(|l| l.trim().strip_prefix("pub mod "))
        .map(|l| l.trim_end_matches(" {").trim_end_matches(';'))
        .filter(|m| *m != "exit")
        .collect();
    assert!(declared.len() > 10, "{declared:?}");
    for module in declared {
        assert!(
            level_of(module).is_some(),
            "{module} has no level in LEVELS"
        );
    }
}

#[test]
fn the_reader_sees_paths_and_ignores_comments_strings_and_tests() {
    let text = r#"
        use crate::vocab::Caller;
        use crate::{config::Config, metrics};
        // crate::daemon in a comment
        let s = "crate::daemon in a string";
        let q = '"';
        fn f() { crate::tools::first_party(); }
        #[cfg(test)]
        mod tests { use crate::daemon::Plan; }
    "#;
    let found = references(&code(text));
    assert_eq!(found, ["vocab", "config", "metrics", "tools"]);
}
