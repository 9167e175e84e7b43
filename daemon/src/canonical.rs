//! Canonical JSON: the one text a JSON value is hashed as, wherever the daemon binds
//! something to a call's arguments (idempotency keys, approvals of one exact call).
//!
//! The form: no whitespace; object members sorted by the UTF-8 bytes of their names
//! (which is code-point order), each name once; strings in serde_json's escaping (`"`,
//! `\` and control characters escaped, everything else as UTF-8); numbers as serde_json
//! writes them (integers exactly, other numbers in the shortest form that reads back to
//! the same `f64`). Two argument objects that are equal as JSON values have one canonical
//! text; the order a client wrote the members in, or its whitespace, changes nothing.
//! (Integers and floats stay apart: `1` and `1.0` are different arguments.)
//!
//! The sort is done here, not left to the map type, so a dependency that switches
//! serde_json to insertion-ordered maps cannot change the digests of approvals and
//! idempotency records already in the store.

use serde_json::Value;
use sha2::{Digest, Sha256};

/// The canonical text of `value`.
pub fn canonical_json(value: &Value) -> String {
    let mut out = String::new();
    write(value, &mut out);
    out
}

/// Hex SHA-256 of the canonical text of `value`.
pub fn canonical_sha256(value: &Value) -> String {
    hex::encode(Sha256::digest(canonical_json(value).as_bytes()))
}

fn write(value: &Value, out: &mut String) {
    match value {
        Value::Object(map) => {
            let mut members: Vec<(&String, &Value)> = map.iter().collect();
            members.sort_unstable_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
            out.push('{');
            for (i, (name, member)) in members.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                string(name, out);
                out.push(':');
                write(member, out);
            }
            out.push('}');
        }
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write(item, out);
            }
            out.push(']');
        }
        Value::String(s) => string(s, out),
        // Null, booleans and numbers: serde_json's own text.
        scalar => out.push_str(&scalar.to_string()),
    }
}

fn string(s: &str, out: &mut String) {
    // serde_json escapes a string the same way whatever its features.
    out.push_str(&Value::String(s.to_owned()).to_string());
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn member_order_and_whitespace_do_not_matter() {
        let a: Value =
            serde_json::from_str(r#"{ "b": [1, {"y": 2, "x": 1}], "a": "é\n" }"#).unwrap();
        let b: Value = serde_json::from_str(r#"{"a":"é\n","b":[1,{"x":1,"y":2}]}"#).unwrap();
        assert_eq!(canonical_json(&a), r#"{"a":"é\n","b":[1,{"x":1,"y":2}]}"#);
        assert_eq!(canonical_json(&a), canonical_json(&b));
        assert_eq!(canonical_sha256(&a), canonical_sha256(&b));
    }

    #[test]
    fn different_values_have_different_texts() {
        let pairs = [
            (json!({"n": 1}), json!({"n": 1.0})),
            (json!({"n": 1}), json!({"n": "1"})),
            (json!({"a": [1, 2]}), json!({"a": [2, 1]})),
            (json!({"a": null}), json!({})),
            (json!({"a": "x"}), json!({"a": "x "})),
        ];
        assert!(!pairs.is_empty());
        for (a, b) in pairs {
            assert_ne!(canonical_json(&a), canonical_json(&b), "{a} vs {b}");
        }
    }

    #[test]
    fn names_sort_by_their_bytes() {
        let v = json!({"é": 1, "z": 2, "Z": 3, "": 4, "a\u{0}": 5, "a": 6});
        assert_eq!(
            canonical_json(&v),
            "{\"\":4,\"Z\":3,\"a\":6,\"a\\u0000\":5,\"z\":2,\"é\":1}"
        );
    }

    #[test]
    fn it_matches_the_text_idempotency_records_were_hashed_as() {
        // Earlier releases hashed `Value::to_string()` of serde_json's sorted maps; the
        // canonical text is that same text, so records already stored keep matching.
        let v = json!({"path": "/etc/x", "content": "a\u{7f}\"b", "mode": "append", "n": [1.5, -2, 1e300]});
        assert_eq!(canonical_json(&v), v.to_string());
    }
}
