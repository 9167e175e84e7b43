//! Property tests for [`Request::decode`], the strict decoder of untrusted control frames:
//! it never panics, what it accepts re-encodes to the same fields, it refuses fields a
//! command does not define and keys given twice, and it answers `unsupported-version` for
//! any other `v`. Also for [`json::reject_duplicate_keys`], which it uses: it accepts
//! exactly the well-formed JSON without repeated keys and names where a repeat is.

use proptest::collection::{btree_map, vec};
use proptest::prelude::*;
use proptest::test_runner::Config as ProptestConfig;
use robota_proto::json::{self, JsonError};
use robota_proto::{Command, ErrorCode, PROTOCOL_VERSION, Request};
use serde_json::{Map, Value, json};

/// `cases` cases, no regression files written into the tree.
fn config(cases: u32) -> ProptestConfig {
    ProptestConfig {
        cases,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

fn command() -> impl Strategy<Value = Command> {
    let opt_u64 = || prop::option::of(any::<u64>());
    let opt_text = || prop::option::of(".{0,12}");
    prop_oneof![
        Just(Command::Status),
        (opt_text(), opt_u64())
            .prop_map(|(label, ttl_secs)| Command::BearerIssue { label, ttl_secs }),
        Just(Command::BearerList),
        ".{0,12}".prop_map(|label| Command::BearerRevoke { label }),
        Just(Command::BearerRotate),
        (
            opt_u64(),
            opt_text(),
            opt_u64(),
            prop::option::of(any::<u32>())
        )
            .prop_map(|(since, reason, after_seq, limit)| Command::Audit {
                since,
                reason,
                after_seq,
                limit,
            }),
        Just(Command::Mcp),
        Just(Command::Stop),
        Just(Command::Restart),
    ]
}

/// Arbitrary JSON, a few levels deep.
fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<f64>()
            .prop_filter("finite", |f| f.is_finite())
            .prop_map(Value::from),
        ".{0,12}".prop_map(Value::from),
    ];
    leaf.prop_recursive(3, 16, 4, |inner| {
        prop_oneof![
            vec(inner.clone(), 0..4).prop_map(Value::from),
            btree_map(".{0,6}", inner, 0..4).prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// Objects that look like frames: `v`, a known or unknown `cmd`, known field names with
/// right or wrong types, and other keys.
fn frame_like() -> impl Strategy<Value = Map<String, Value>> {
    let cmd = prop_oneof![
        4 => prop::sample::select(vec![
            "status", "bearer-issue", "bearer-list", "bearer-revoke", "bearer-rotate", "audit",
            "mcp", "stop", "reload", "restart",
        ])
        .prop_map(Value::from),
        1 => json_value(),
    ];
    let v = prop_oneof![
        6 => Just(json!(1)),
        1 => json_value(),
        1 => any::<u64>().prop_map(Value::from),
    ];
    let key = prop_oneof![
        4 => prop::sample::select(vec![
            "label", "ttl_secs", "since", "reason", "after_seq", "limit",
        ])
        .prop_map(str::to_owned),
        1 => "[a-z_]{1,8}",
    ];
    let field_value = prop_oneof![
        any::<u32>().prop_map(Value::from),
        "[a-z]{0,6}".prop_map(Value::from),
        json_value(),
    ];
    (
        prop::option::of(v),
        prop::option::of(cmd),
        btree_map(key, field_value, 0..4),
    )
        .prop_map(|(v, cmd, fields)| {
            let mut m: Map<String, Value> = fields.into_iter().collect();
            if let Some(v) = v {
                m.insert("v".into(), v);
            }
            if let Some(cmd) = cmd {
                m.insert("cmd".into(), cmd);
            }
            m
        })
}

proptest! {
    #![proptest_config(config(256))]

    /// Arbitrary bytes (and JSON of any shape) never panic the decoder; an error always
    /// carries a message.
    #[test]
    fn decode_never_panics(bytes in vec(any::<u8>(), 0..512), value in json_value()) {
        for frame in [bytes, value.to_string().into_bytes()] {
            if let Err((_, message)) = Request::decode(&frame) {
                prop_assert!(!message.is_empty());
            }
        }
    }

    /// Whatever decodes re-encodes to the same keys (less the `null` ones, which mean
    /// "absent"), and decodes again to the same request.
    #[test]
    fn decoded_frames_round_trip(frame in frame_like()) {
        let text = Value::Object(frame.clone()).to_string();
        let Ok(request) = Request::decode(text.as_bytes()) else { return Ok(()) };
        prop_assert_eq!(request.v, PROTOCOL_VERSION);
        let encoded = serde_json::to_value(&request).unwrap();
        let encoded = encoded.as_object().unwrap();
        let given: Vec<&String> = frame.iter().filter(|(_, v)| !v.is_null()).map(|(k, _)| k).collect();
        let again: Vec<&String> = encoded.keys().collect();
        prop_assert_eq!(given, again, "{}", text);
        let again = Request::decode(serde_json::to_string(&encoded).unwrap().as_bytes());
        prop_assert_eq!(again, Ok(request));
    }

    /// Every request encodes to a frame that decodes to itself.
    #[test]
    fn requests_round_trip(command in command()) {
        let request = Request::new(command);
        let frame = serde_json::to_vec(&request).unwrap();
        prop_assert_eq!(Request::decode(&frame), Ok(request));
    }

    /// A field the command does not define, with any value (null included), is refused as
    /// a bad request — including a field another command defines.
    #[test]
    fn extra_fields_are_refused(
        command in command(),
        key in prop_oneof![
            prop::sample::select(vec!["label", "ttl_secs", "since", "reason", "after_seq", "limit", "V", "Cmd", "ok", "error"]).prop_map(str::to_owned),
            ".{1,12}",
        ],
        value in json_value(),
    ) {
        prop_assume!(key != "v" && key != "cmd" && !command.fields().contains(&key.as_str()));
        let mut frame = serde_json::to_value(Request::new(command)).unwrap();
        frame.as_object_mut().unwrap().insert(key.clone(), value);
        let got = Request::decode(frame.to_string().as_bytes());
        prop_assert!(matches!(got, Err((ErrorCode::BadRequest, _))), "{} gave {:?}", frame, got);
    }

    /// Any `v` other than 1, on an otherwise valid frame, is `unsupported-version`.
    #[test]
    fn other_versions_are_unsupported(command in command(), v in any::<u64>()) {
        prop_assume!(v != u64::from(PROTOCOL_VERSION));
        let mut frame = serde_json::to_value(Request::new(command)).unwrap();
        frame["v"] = v.into();
        let got = Request::decode(frame.to_string().as_bytes());
        prop_assert!(matches!(got, Err((ErrorCode::UnsupportedVersion, _))), "{} gave {:?}", frame, got);
    }
}

/// `key` as a JSON string literal, its first character written as a `\u` escape when
/// `escape` is set (so the repeat differs in bytes but not in meaning).
fn key_literal(key: &str, escape: bool) -> String {
    let mut chars = key.chars();
    match chars.next() {
        Some(first) if escape && first.len_utf16() == 1 => {
            let rest = serde_json::to_string(chars.as_str()).unwrap();
            format!("\"\\u{:04x}{}", u32::from(first), &rest[1..])
        }
        _ => serde_json::to_string(key).unwrap(),
    }
}

/// JSON text of `value` in which the `target`-th non-empty object (in document order)
/// repeats its first key at its end with `extra` as the value. Returns the text and,
/// when some object was the target, its JSON Pointer and the repeated key.
fn with_repeat(
    value: &Value,
    target: usize,
    extra: &Value,
    escape: bool,
) -> (String, Option<(String, String)>) {
    struct Emitter<'a> {
        seen: usize,
        target: usize,
        extra: &'a Value,
        escape: bool,
        out: String,
        found: Option<(String, String)>,
    }
    impl Emitter<'_> {
        fn emit(&mut self, v: &Value, pointer: &str) {
            match v {
                Value::Array(items) => {
                    self.out.push('[');
                    for (i, item) in items.iter().enumerate() {
                        if i > 0 {
                            self.out.push(',');
                        }
                        self.emit(item, &format!("{pointer}/{i}"));
                    }
                    self.out.push(']');
                }
                Value::Object(map) => {
                    let mine = !map.is_empty() && self.seen == self.target;
                    if !map.is_empty() {
                        self.seen += 1;
                    }
                    self.out.push('{');
                    for (i, (k, item)) in map.iter().enumerate() {
                        if i > 0 {
                            self.out.push(',');
                        }
                        self.out.push_str(&serde_json::to_string(k).unwrap());
                        self.out.push(':');
                        let escaped = k.replace('~', "~0").replace('/', "~1");
                        self.emit(item, &format!("{pointer}/{escaped}"));
                    }
                    if mine {
                        let (first, _) = map.iter().next().unwrap();
                        self.out.push(',');
                        self.out.push_str(&key_literal(first, self.escape));
                        self.out.push(':');
                        self.out.push_str(&self.extra.to_string());
                        self.found = Some((pointer.to_owned(), first.clone()));
                    }
                    self.out.push('}');
                }
                leaf => self.out.push_str(&leaf.to_string()),
            }
        }
    }
    let mut e = Emitter {
        seen: 0,
        target,
        extra,
        escape,
        out: String::new(),
        found: None,
    };
    e.emit(value, "");
    (e.out, e.found)
}

proptest! {
    #![proptest_config(config(512))]

    /// Arbitrary bytes never panic the check, and it accepts only what serde_json parses.
    #[test]
    fn the_check_accepts_only_json(bytes in vec(any::<u8>(), 0..256)) {
        if json::reject_duplicate_keys(&bytes).is_ok() {
            prop_assert!(serde_json::from_slice::<Value>(&bytes).is_ok());
        }
    }

    /// Every JSON document serde_json writes (its objects cannot repeat a key) passes.
    #[test]
    fn documents_without_repeats_pass(value in json_value()) {
        prop_assert_eq!(json::reject_duplicate_keys(value.to_string().as_bytes()), Ok(()));
        prop_assert_eq!(json::reject_duplicate_keys(&serde_json::to_vec_pretty(&value).unwrap()), Ok(()));
    }

    /// A key repeated in any object, at any depth, written plainly or escaped, is refused
    /// with that object's pointer and the key.
    #[test]
    fn a_repeat_anywhere_is_found(
        value in json_value(),
        target in 0usize..8,
        extra in json_value(),
        escape in any::<bool>(),
    ) {
        // Wrapped, so there is always an object to repeat a key in.
        let value = json!({"a": value, "b/~": [value.clone()]});
        let (text, expected) = with_repeat(&value, target, &extra, escape);
        let got = json::reject_duplicate_keys(text.as_bytes());
        match expected {
            None => prop_assert_eq!(got, Ok(()), "{}", text),
            Some((path, key)) => {
                prop_assert_eq!(got, Err(JsonError::DuplicateKey { path, key }), "{}", text)
            }
        }
    }

    /// A request frame with any of its keys given twice is a bad request, whichever value
    /// comes last.
    #[test]
    fn frames_with_a_repeated_key_are_refused(command in command(), pick in any::<prop::sample::Index>()) {
        let frame = serde_json::to_value(Request::new(command)).unwrap();
        let object = frame.as_object().unwrap();
        let keys: Vec<&String> = object.keys().collect();
        let key = keys[pick.index(keys.len())];
        for repeat in [object[key].clone(), json!("stop"), json!(1)] {
            let text = frame.to_string();
            let text = format!("{},{}:{}}}", &text[..text.len() - 1], key_literal(key, false), repeat);
            let got = Request::decode(text.as_bytes());
            prop_assert!(matches!(&got, Err((ErrorCode::BadRequest, m)) if m.contains("duplicate key")), "{} gave {:?}", text, got);
        }
    }
}
