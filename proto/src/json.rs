//! Strict JSON checks that serde's data model cannot express: duplicate object keys.
//!
//! `serde_json` keeps the *last* of two equal keys when it builds a `Value` and a derived
//! struct refuses them only for its own fields (never inside a flattened or untyped part),
//! so `{"cmd":"status","cmd":"stop"}` reads as `stop` to one parser and `status` to another.
//! [`reject_duplicate_keys`] walks a document once, nested objects and arrays included,
//! compares keys after unescaping (`"cmd"` and `"\u0063md"` are the same key) and refuses
//! the first repeat. Use it before decoding any JSON that crosses a trust boundary.

use std::borrow::Cow;
use std::collections::HashSet;
use std::fmt;

use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};

/// Deepest nesting of arrays and objects [`reject_duplicate_keys`] walks; deeper documents
/// are refused. It is serde_json's own parser limit, so nothing a serde_json decoder would
/// accept is refused here for depth, and the walk stays bounded even in a build where
/// that limit is switched off (its `unbounded_depth` feature).
pub const MAX_DEPTH: usize = 127;

/// Longest key an error message quotes; a longer one is cut and marked with `…`.
const QUOTED_KEY: usize = 64;

/// Why [`reject_duplicate_keys`] refused a document.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JsonError {
    /// Not one well-formed JSON value (the parser's message).
    Syntax(String),
    /// An object holds `key` twice; `path` is the JSON Pointer (RFC 6901) of that object
    /// (`""` for the top level).
    DuplicateKey { path: String, key: String },
    /// Arrays and objects nested deeper than [`MAX_DEPTH`].
    TooDeep,
}

impl fmt::Display for JsonError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            JsonError::Syntax(message) => write!(f, "not JSON: {message}"),
            JsonError::DuplicateKey { path, key } if path.is_empty() => {
                write!(f, "duplicate key {}", quoted(key))
            }
            JsonError::DuplicateKey { path, key } => {
                write!(f, "duplicate key {} in {}", quoted(key), quoted(path))
            }
            JsonError::TooDeep => write!(f, "nested deeper than {MAX_DEPTH} levels"),
        }
    }
}

impl std::error::Error for JsonError {}

/// `text` quoted with control and invisible format characters escaped (`\u{202e}`), cut
/// at [`QUOTED_KEY`] characters.
fn quoted(text: &str) -> String {
    let cut: String = text.chars().take(QUOTED_KEY).collect();
    let mark = if cut.len() < text.len() { "…" } else { "" };
    format!("`{cut:?}{mark}`")
}

/// Refuses `bytes` unless it is one JSON value in which no object repeats a key.
pub fn reject_duplicate_keys(bytes: &[u8]) -> Result<(), JsonError> {
    let mut de = serde_json::Deserializer::from_slice(bytes);
    walk(&mut de).and_then(|()| de.end().map_err(|e| JsonError::Syntax(e.to_string())))
}

/// Walks one value from any deserializer.
fn walk<'de, D: Deserializer<'de>>(deserializer: D) -> Result<(), JsonError> {
    let mut problem = None;
    let mut path = Vec::new();
    let walked = Walk {
        depth: 0,
        path: &mut path,
        problem: &mut problem,
    }
    .deserialize(deserializer);
    match (walked, problem) {
        (_, Some(problem)) => Err(problem),
        (Err(e), None) => Err(JsonError::Syntax(e.to_string())),
        (Ok(()), None) => Ok(()),
    }
}

/// One step of the walk: a value at `depth`, inside the containers named by `path`. A
/// refusal of ours is left in `problem` (the serde error only unwinds the parser).
struct Walk<'p, 'de> {
    depth: usize,
    path: &'p mut Vec<Segment<'de>>,
    problem: &'p mut Option<JsonError>,
}

enum Segment<'de> {
    Key(Cow<'de, str>),
    Index(usize),
}

impl Walk<'_, '_> {
    fn pointer(&self) -> String {
        let mut out = String::new();
        for segment in self.path.iter() {
            out.push('/');
            match segment {
                Segment::Key(key) => out.push_str(&key.replace('~', "~0").replace('/', "~1")),
                Segment::Index(i) => out.push_str(&i.to_string()),
            }
        }
        out
    }

    fn refuse<E: de::Error>(&mut self, problem: JsonError) -> E {
        *self.problem = Some(problem);
        E::custom("refused")
    }

    fn enter<E: de::Error>(&mut self) -> Result<usize, E> {
        if self.depth >= MAX_DEPTH {
            return Err(self.refuse(JsonError::TooDeep));
        }
        Ok(self.depth + 1)
    }
}

impl<'de> DeserializeSeed<'de> for Walk<'_, 'de> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Walk<'_, 'de> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_bool<E>(self, _: bool) -> Result<(), E> {
        Ok(())
    }

    fn visit_i64<E>(self, _: i64) -> Result<(), E> {
        Ok(())
    }

    fn visit_u64<E>(self, _: u64) -> Result<(), E> {
        Ok(())
    }

    fn visit_i128<E>(self, _: i128) -> Result<(), E> {
        Ok(())
    }

    fn visit_u128<E>(self, _: u128) -> Result<(), E> {
        Ok(())
    }

    fn visit_f64<E>(self, _: f64) -> Result<(), E> {
        Ok(())
    }

    fn visit_str<E>(self, _: &str) -> Result<(), E> {
        Ok(())
    }

    fn visit_unit<E>(self) -> Result<(), E> {
        Ok(())
    }

    fn visit_seq<A: SeqAccess<'de>>(mut self, mut seq: A) -> Result<(), A::Error> {
        let depth = self.enter()?;
        let mut index = 0;
        loop {
            self.path.push(Segment::Index(index));
            let next = seq.next_element_seed(Walk {
                depth,
                path: self.path,
                problem: self.problem,
            });
            self.path.pop();
            if next?.is_none() {
                return Ok(());
            }
            index += 1;
        }
    }

    fn visit_map<A: MapAccess<'de>>(mut self, mut map: A) -> Result<(), A::Error> {
        let depth = self.enter()?;
        let mut seen: HashSet<Cow<'de, str>> = HashSet::new();
        while let Some(Key(key)) = map.next_key()? {
            if seen.contains(&key) {
                let problem = JsonError::DuplicateKey {
                    path: self.pointer(),
                    key: key.into_owned(),
                };
                return Err(self.refuse(problem));
            }
            seen.insert(key.clone());
            self.path.push(Segment::Key(key));
            let value = map.next_value_seed(Walk {
                depth,
                path: self.path,
                problem: self.problem,
            });
            self.path.pop();
            value?;
        }
        Ok(())
    }
}

/// An object key, borrowed from the input unless it had escapes.
struct Key<'de>(Cow<'de, str>);

impl<'de> de::Deserialize<'de> for Key<'de> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct KeyVisitor;
        impl<'de> Visitor<'de> for KeyVisitor {
            type Value = Key<'de>;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an object key")
            }

            fn visit_borrowed_str<E>(self, key: &'de str) -> Result<Key<'de>, E> {
                Ok(Key(Cow::Borrowed(key)))
            }

            fn visit_str<E>(self, key: &str) -> Result<Key<'de>, E> {
                Ok(Key(Cow::Owned(key.to_owned())))
            }

            fn visit_string<E>(self, key: String) -> Result<Key<'de>, E> {
                Ok(Key(Cow::Owned(key)))
            }
        }
        deserializer.deserialize_str(KeyVisitor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(text: &str) -> Result<(), JsonError> {
        reject_duplicate_keys(text.as_bytes())
    }

    fn duplicate(path: &str, key: &str) -> Result<(), JsonError> {
        Err(JsonError::DuplicateKey {
            path: path.into(),
            key: key.into(),
        })
    }

    #[test]
    fn distinct_keys_pass() {
        for ok in [
            r#"{"v":1,"cmd":"status"}"#,
            r#"{}"#,
            r#"[]"#,
            r#"1"#,
            r#""x""#,
            r#"null"#,
            r#"{"a":{"a":{"a":1}},"b":[{"a":1},{"a":2}]}"#,
            r#"{"a":1,"A":2,"a ":3}"#,
            " {\"a\" : [1, 2.5e3, -7, true, false, null, \"s\"]} \n",
        ] {
            assert_eq!(check(ok), Ok(()), "{ok}");
        }
    }

    #[test]
    fn repeats_are_refused_where_they_are() {
        assert_eq!(
            check(r#"{"v":1,"cmd":"status","cmd":"stop"}"#),
            duplicate("", "cmd")
        );
        assert_eq!(
            check(r#"{"a":{"b":[0,{"c":1,"c":2}]}}"#),
            duplicate("/a/b/1", "c")
        );
        // The same key after unescaping; an empty key twice.
        assert_eq!(check(r#"{"cmd":1,"\u0063md":2}"#), duplicate("", "cmd"));
        assert_eq!(check(r#"{"":1,"":2}"#), duplicate("", ""));
        // Pointer escaping of `~` and `/`.
        assert_eq!(
            check(r#"{"a/b~c":{"k":1,"k":1}}"#),
            duplicate("/a~1b~0c", "k")
        );
    }

    #[test]
    fn bad_json_and_deep_nesting_are_refused() {
        for bad in [
            "",
            "{",
            r#"{"a":1}{"#,
            r#"{"a":1} x"#,
            "[1,]",
            "{\"a\"}",
            "\u{1}",
        ] {
            assert!(
                matches!(check(bad), Err(JsonError::Syntax(_))),
                "{bad:?} gave {:?}",
                check(bad)
            );
        }
        let deep = |n: usize| format!("{}{}", "[".repeat(n), "]".repeat(n));
        assert_eq!(check(&deep(MAX_DEPTH)), Ok(()));
        assert!(check(&deep(MAX_DEPTH + 1)).is_err());
        // Far deeper than any stack would survive if the walk were unbounded.
        assert!(check(&deep(1_000_000)).is_err());
        let objects = |n: usize| format!("{}1{}", "{\"a\":".repeat(n), "}".repeat(n));
        assert_eq!(check(&objects(MAX_DEPTH)), Ok(()));
        assert!(check(&objects(MAX_DEPTH + 1)).is_err());
    }

    #[test]
    fn the_walk_is_bounded_without_the_parsers_limit() {
        // A `Value` deserializes with no depth limit of its own.
        let nested = |n: usize| {
            let mut v = serde_json::Value::Null;
            for _ in 0..n {
                v = serde_json::Value::Array(vec![v]);
            }
            v
        };
        assert_eq!(walk(nested(MAX_DEPTH)), Ok(()));
        assert_eq!(walk(nested(MAX_DEPTH + 1)), Err(JsonError::TooDeep));
        assert_eq!(walk(nested(10 * MAX_DEPTH)), Err(JsonError::TooDeep));
    }

    #[test]
    fn messages_quote_keys_visibly_and_briefly() {
        let long = "k".repeat(10_000);
        let text = format!(r#"{{"{long}":1,"{long}":2}}"#);
        let message = check(&text).unwrap_err().to_string();
        assert!(message.len() < 100, "{message}");
        assert!(message.ends_with("…`"), "{message}");
        let message = check(r#"{"\u202e\n":1,"\u202e\n":2}"#)
            .unwrap_err()
            .to_string();
        assert_eq!(message, r#"duplicate key `"\u{202e}\n"`"#);
        let nested = check(r#"{"a":{"b":1,"b":1}}"#).unwrap_err().to_string();
        assert_eq!(nested, r#"duplicate key `"b"` in `"/a"`"#);
    }
}
