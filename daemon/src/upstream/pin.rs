//! Pinned tool surfaces (docs/design.md §13.9): what an upstream lists is compared with
//! what the operator approved — or what it listed the first time, trusted on first use —
//! so a package that changes what its tools say or take cannot change what callers are
//! offered without the operator seeing it.
//!
//! A tool's surface is the members of its definition a caller or a model reads (name,
//! title, description, schemas, annotations), fingerprinted member by member as SHA-256
//! of canonical JSON; a stdio upstream's surface also holds the SHA-256 of the executable
//! it starts. In memory only fingerprints are kept; the approved definitions are kept in
//! `<state_dir>/upstreams/<name>.pin.json` (mode 0600) for `upstreams diff`.

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value, json};
use sha2::{Digest, Sha256};

use crate::canonical::{canonical_json, canonical_sha256};

/// The members of a tool definition that are its surface.
pub const MEMBERS: [&str; 6] = [
    "name",
    "title",
    "description",
    "inputSchema",
    "outputSchema",
    "annotations",
];

/// An upstream's surface: each tool's members, fingerprinted, and its executable's.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Surface {
    /// The upstream's own tool name → member → SHA-256.
    pub tools: BTreeMap<String, BTreeMap<String, String>>,
    /// SHA-256 of the executable a stdio upstream starts.
    pub executable: Option<String>,
}

impl Surface {
    /// The surface of `listed` (definitions as sent; one without a string name, or a
    /// name listed again, is refused by the import and left out here).
    pub fn of(listed: &[Value], executable: Option<String>) -> Self {
        let tools = named(listed)
            .map(|(name, object)| (name.to_owned(), fingerprints(object)))
            .collect();
        Self { tools, executable }
    }

    /// One SHA-256 for the whole surface (`robota-mcpctl upstreams` shows it).
    pub fn digest(&self) -> String {
        canonical_sha256(&json!({"tools": self.tools, "executable": self.executable}))
    }
}

/// The definitions of `listed` that are objects with a string name, the first of each
/// name (what the import refuses is left out here too).
fn named(listed: &[Value]) -> impl Iterator<Item = (&str, &Map<String, Value>)> {
    let mut seen = std::collections::HashSet::new();
    listed.iter().filter_map(move |definition| {
        let object = definition.as_object()?;
        let name = object.get("name").and_then(Value::as_str)?;
        seen.insert(name).then_some((name, object))
    })
}

fn fingerprints(object: &Map<String, Value>) -> BTreeMap<String, String> {
    MEMBERS
        .iter()
        .filter_map(|m| {
            object
                .get(*m)
                .map(|v| ((*m).to_owned(), canonical_sha256(v)))
        })
        .collect()
}

/// How a surface differs from the approved one.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Drift {
    pub added: Vec<String>,
    pub removed: Vec<String>,
    /// Tool → the members that changed.
    pub changed: BTreeMap<String, Vec<String>>,
    /// The executable is not the approved one: every tool is held.
    pub executable: bool,
}

impl Drift {
    pub fn between(approved: &Surface, now: &Surface) -> Self {
        let mut drift = Drift {
            executable: matches!((&approved.executable, &now.executable), (Some(a), Some(n)) if a != n),
            ..Drift::default()
        };
        for (name, members) in &now.tools {
            match approved.tools.get(name) {
                None => drift.added.push(name.clone()),
                Some(was) if was != members => {
                    let changed: Vec<String> = MEMBERS
                        .iter()
                        .filter(|m| was.get(**m) != members.get(**m))
                        .map(|m| (*m).to_owned())
                        .collect();
                    drift.changed.insert(name.clone(), changed);
                }
                Some(_) => {}
            }
        }
        drift.removed = approved
            .tools
            .keys()
            .filter(|name| !now.tools.contains_key(*name))
            .cloned()
            .collect();
        drift
    }

    pub fn is_empty(&self) -> bool {
        !self.executable
            && self.added.is_empty()
            && self.removed.is_empty()
            && self.changed.is_empty()
    }

    /// Why `tool` (the upstream's own name) is held, if it is.
    pub fn holds(&self, tool: &str) -> Option<&'static str> {
        if self.executable {
            Some("the upstream's executable changed since its tools were approved")
        } else if self.added.iter().any(|t| t == tool) {
            Some("a new tool, not approved yet")
        } else if self.changed.contains_key(tool) {
            Some("its definition changed since it was approved")
        } else {
            None
        }
    }
}

/// SHA-256 of the file at `path` (the executable a stdio upstream starts).
pub fn file_sha256(path: &Path) -> std::io::Result<String> {
    let mut hasher = Sha256::new();
    std::io::copy(&mut std::fs::File::open(path)?, &mut hasher)?;
    Ok(hex::encode(hasher.finalize()))
}

/// The pin file: the approved definitions (their surface members only, by name), the
/// executable's fingerprint, when and by whom (`first-use` or `local:<uid>`).
#[derive(Debug, Serialize, Deserialize)]
pub struct Pinned {
    pub tools: Map<String, Value>,
    #[serde(default)]
    pub executable: Option<String>,
    #[serde(default)]
    pub approved_at: Option<u64>,
    #[serde(default)]
    pub approved_by: Option<String>,
}

impl Pinned {
    /// What `listed` approves (`at`, `by`).
    pub fn of(listed: &[Value], executable: Option<&str>, at: u64, by: &str) -> Self {
        let tools = named(listed)
            .map(|(name, object)| {
                let kept: Map<String, Value> = MEMBERS
                    .iter()
                    .filter_map(|m| object.get(*m).map(|v| ((*m).to_owned(), v.clone())))
                    .collect();
                (name.to_owned(), Value::Object(kept))
            })
            .collect();
        Self {
            tools,
            executable: executable.map(str::to_owned),
            approved_at: Some(at),
            approved_by: Some(by.to_owned()),
        }
    }

    /// The approved definitions, as a list.
    pub fn definitions(&self) -> Vec<Value> {
        self.tools.values().cloned().collect()
    }

    pub fn surface(&self) -> Surface {
        Surface::of(&self.definitions(), self.executable.clone())
    }
}

/// The member-by-member changes of `tool` between two lists of definitions, as canonical
/// JSON text, whole: an approval covers every byte, so the review shows every byte.
pub fn member_changes(
    tool: &str,
    approved: &[Value],
    current: &[Value],
) -> Vec<robota_proto::MemberChange> {
    let find = |list: &[Value]| {
        list.iter()
            .filter_map(Value::as_object)
            .find(|d| d.get("name").and_then(Value::as_str) == Some(tool))
            .cloned()
    };
    let (was, now) = (find(approved), find(current));
    let text = |d: &Option<Map<String, Value>>, m: &str| {
        d.as_ref().and_then(|d| d.get(m)).map(canonical_json)
    };
    MEMBERS
        .iter()
        .filter_map(|m| {
            let (a, c) = (text(&was, m), text(&now, m));
            (a != c).then(|| robota_proto::MemberChange {
                member: (*m).to_owned(),
                approved: a,
                current: c,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tool(name: &str, description: &str) -> Value {
        json!({"name": name, "description": description, "inputSchema": {"type": "object"},
               "_meta": {"ignored": true}})
    }

    #[test]
    fn a_surface_is_the_same_in_any_order_and_whatever_is_not_part_of_it() {
        let a = Surface::of(&[tool("a", "x"), tool("b", "y")], None);
        let mut b_tool = tool("b", "y");
        b_tool["_meta"] = json!({"other": 1});
        let b = Surface::of(&[b_tool, tool("a", "x")], None);
        assert_eq!(a.digest(), b.digest());
        assert!(Drift::between(&a, &b).is_empty());
        let c = Surface::of(&[tool("a", "x")], Some("e".into()));
        assert_ne!(a.digest(), c.digest());
    }

    #[test]
    fn drift_names_what_was_added_removed_and_changed_and_holds_those() {
        let approved = Surface::of(&[tool("a", "x"), tool("b", "y")], Some("1".into()));
        let now = Surface::of(&[tool("a", "changed"), tool("c", "z")], Some("1".into()));
        let drift = Drift::between(&approved, &now);
        assert_eq!(drift.added, ["c"]);
        assert_eq!(drift.removed, ["b"]);
        assert_eq!(drift.changed["a"], ["description"]);
        assert!(drift.holds("a").is_some() && drift.holds("c").is_some());
        let unchanged = Drift::between(&approved, &approved.clone());
        assert!(unchanged.is_empty() && unchanged.holds("a").is_none());
        let swapped = Surface::of(&[tool("a", "x"), tool("b", "y")], Some("2".into()));
        let drift = Drift::between(&approved, &swapped);
        assert!(drift.executable && drift.holds("a").is_some(), "{drift:?}");
    }

    #[test]
    fn a_pin_file_reads_back_as_the_surface_it_was_made_from() {
        let listed = [tool("a", "x"), tool("b", "y")];
        let text = serde_json::to_string(&Pinned::of(&listed, Some("e"), 7, "first-use")).unwrap();
        let pinned: Pinned = serde_json::from_str(&text).unwrap();
        assert_eq!(pinned.surface(), Surface::of(&listed, Some("e".into())));
        assert_eq!(pinned.approved_by.as_deref(), Some("first-use"));
        let changes = member_changes("a", &pinned.definitions(), &[tool("a", "new")]);
        assert_eq!(changes.len(), 1);
        assert_eq!(changes[0].member, "description");
        assert_eq!(changes[0].approved.as_deref(), Some("\"x\""));
        assert_eq!(changes[0].current.as_deref(), Some("\"new\""));
    }

    #[test]
    fn a_change_far_into_a_member_is_shown_whole() {
        let long = "routine text. ".repeat(400);
        let hidden = format!("{long} and one more sentence");
        let changes = member_changes("a", &[tool("a", &long)], &[tool("a", &hidden)]);
        assert_eq!(changes.len(), 1, "{changes:?}");
        let current = changes[0].current.as_deref().unwrap_or_default();
        assert!(current.ends_with("and one more sentence\""), "{current}");
        assert_eq!(current.len(), hidden.len() + 2);
    }
}
