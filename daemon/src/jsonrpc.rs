//! A strict first look at one JSON-RPC message before the MCP SDK parses it, on every
//! carrier: one pass over the bytes that refuses what the SDK would misreport (a batch,
//! a parse error, a bad `id`, `params` that is not an object, duplicate object keys,
//! which two parsers could read differently), recovers the request id for the error
//! answer, and counts the JSON values so the memory the parse will take can be
//! budgeted before it happens.

use std::borrow::Cow;
use std::collections::HashSet;
use std::fmt;

use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::Value;

/// Bytes of memory one JSON value of a request may take while it is handled, beyond its
/// text: the SDK parses the message through an intermediate tree, so each value is held
/// about twice as a `serde_json::Value` (32 bytes) with its share of a growing `Vec` or
/// map, and allocator overhead. Measured: a 1 MiB body of `[[],[],…]` (350,000 values)
/// raised the daemon's peak RSS by 70 MB.
pub const VALUE_COST: usize = 200;

/// A message that passed: its id (when it is a request) and the memory its parse may take.
#[derive(Debug, Clone, PartialEq)]
pub struct Inspected {
    /// The request's `id`, as given; `None` for notifications and responses.
    pub id: Option<Value>,
    /// The `method`, for requests and notifications.
    pub method: Option<String>,
    /// A `tools/call`'s `name`: the tool's wire name.
    pub tool: Option<String>,
    /// Parsed-memory estimate in bytes: the text plus [`VALUE_COST`] per JSON value.
    pub cost: usize,
}

/// Why a message was refused, as JSON-RPC answers it.
#[derive(Debug, Clone, PartialEq)]
pub enum Invalid {
    /// -32700: not JSON, or an object with a duplicate key.
    Parse(String),
    /// -32600: a batch, or not a JSON-RPC 2.0 message. The id when it could be read.
    Request {
        id: Option<Value>,
        why: &'static str,
    },
    /// -32602: `params` not an object, or not what the method needs.
    Params {
        id: Option<Value>,
        why: &'static str,
    },
}

impl Invalid {
    pub fn code(&self) -> i32 {
        match self {
            Invalid::Parse(_) => -32700,
            Invalid::Request { .. } => -32600,
            Invalid::Params { .. } => -32602,
        }
    }

    pub fn id(&self) -> Option<&Value> {
        match self {
            Invalid::Parse(_) => None,
            Invalid::Request { id, .. } | Invalid::Params { id, .. } => id.as_ref(),
        }
    }

    pub fn message(&self) -> String {
        match self {
            Invalid::Parse(why) => format!("Parse error: {why}"),
            Invalid::Request { why, .. } => format!("Invalid Request: {why}"),
            Invalid::Params { why, .. } => format!("Invalid params: {why}"),
        }
    }

    /// The JSON-RPC error response (the id, when known, echoed as given).
    pub fn response(&self) -> Value {
        serde_json::json!({
            "jsonrpc": "2.0",
            "id": self.id().cloned().unwrap_or(Value::Null),
            "error": {"code": self.code(), "message": self.message()},
        })
    }
}

/// Inspect one message body.
pub fn inspect(body: &[u8]) -> Result<Inspected, Invalid> {
    let (top, cost) = probe(body).map_err(Invalid::Parse)?;
    let fields = match top {
        Kind::Object(Some(fields)) => fields,
        Kind::Array => {
            return Err(Invalid::Request {
                id: None,
                why: "batches are not supported",
            });
        }
        _ => {
            return Err(Invalid::Request {
                id: None,
                why: "a message is a JSON object",
            });
        }
    };
    let id = match &fields.id {
        None => None,
        Some(Kind::Str(s)) => Some(Value::String(s.clone())),
        // The SDK reads integer ids as i64: a larger one would be refused by it as
        // unparsable (a plain-text 415), not as the JSON-RPC error it is.
        Some(Kind::Int(n)) if n.as_i64().is_none() => {
            return Err(Invalid::Request {
                id: Some(Value::Number(n.clone())),
                why: "an integer `id` must be within the signed 64-bit range",
            });
        }
        Some(Kind::Int(n)) => Some(Value::Number(n.clone())),
        Some(_) => {
            return Err(Invalid::Request {
                id: None,
                why: "`id` must be a string or an integer",
            });
        }
    };
    if !matches!(&fields.jsonrpc, Some(Kind::Str(v)) if v == "2.0") {
        return Err(Invalid::Request {
            id,
            why: "`jsonrpc` must be \"2.0\"",
        });
    }
    match &fields.method {
        Some(Kind::Str(_)) if fields.result || fields.error => Err(Invalid::Request {
            id,
            why: "a request or notification carries no `result` or `error`",
        }),
        Some(Kind::Str(method)) => {
            if fields.params.as_ref().is_some_and(|p| !p.is_object()) {
                return Err(Invalid::Params {
                    id,
                    why: "`params` must be an object",
                });
            }
            if let Some(why) = params_problem(method, fields.params.as_ref()) {
                return Err(Invalid::Params { id, why });
            }
            let tool = match (method.as_str(), fields.params.as_ref()) {
                ("tools/call", Some(Kind::Object(Some(params)))) => match &params.name {
                    Some(Kind::Str(name)) => Some(name.clone()),
                    _ => None,
                },
                _ => None,
            };
            let method = Some(method.clone());
            Ok(Inspected {
                id,
                method,
                tool,
                cost,
            })
        }
        Some(_) => Err(Invalid::Request {
            id,
            why: "`method` must be a string",
        }),
        // A response to a server request: an id and a result or an error.
        None if id.is_some() && (fields.result ^ fields.error) => Ok(Inspected {
            id: None,
            method: None,
            tool: None,
            cost,
        }),
        None => Err(Invalid::Request {
            id,
            why: "a request needs a `method`",
        }),
    }
}

/// The memory parsing `body` may take (its text plus [`VALUE_COST`] per JSON value), for
/// a message whose shape is judged elsewhere (what an upstream sends): the same strict
/// pass, so it is `Err` for what is not JSON, trailing data or a duplicate key.
pub fn parse_cost(body: &[u8]) -> Result<usize, String> {
    probe(body).map(|(_, cost)| cost)
}

/// One strict pass over `body`: its top-level kind and its parse cost.
fn probe(body: &[u8]) -> Result<(Kind, usize), String> {
    let mut values = 0usize;
    let mut de = serde_json::Deserializer::from_slice(body);
    let top = Probe {
        values: &mut values,
        depth: 0,
        params: false,
        keep: false,
    }
    .deserialize(&mut de)
    .and_then(|top| de.end().map(|()| top))
    .map_err(|e| short(&e))?;
    Ok((
        top,
        body.len().saturating_add(values.saturating_mul(VALUE_COST)),
    ))
}

fn short(e: &serde_json::Error) -> String {
    let text = e.to_string();
    match text.char_indices().nth(200) {
        Some((end, _)) => format!("{}…", &text[..end]),
        None => text,
    }
}

/// What a value was, for the few top-level members we read.
#[derive(Debug)]
enum Kind {
    Null,
    Bool,
    Int(serde_json::Number),
    Float,
    Str(String),
    Array,
    /// An object; at the top level, the members we read.
    Object(Option<Box<Fields>>),
}

impl Kind {
    fn is_object(&self) -> bool {
        matches!(self, Kind::Object(_))
    }
}

#[derive(Debug, Default)]
struct Fields {
    jsonrpc: Option<Kind>,
    id: Option<Kind>,
    method: Option<Kind>,
    params: Option<Kind>,
    result: bool,
    error: bool,
    /// How many members the object has (read for `params`).
    members: usize,
    // The members of `params` the methods below require.
    name: Option<Kind>,
    arguments: Option<Kind>,
    task_id: Option<Kind>,
}

/// What a method's `params` must hold, for the methods whose `params` are checked here
/// (elsewhere a wrong shape would reach the SDK and come back as "method not found").
fn params_problem(method: &str, params: Option<&Kind>) -> Option<&'static str> {
    let fields = match params {
        Some(Kind::Object(Some(fields))) => Some(fields),
        _ => None,
    };
    let string = |k: &Option<Kind>| matches!(k, Some(Kind::Str(_)));
    match method {
        "tools/call" => match fields {
            None => Some("tools/call needs `params` with a string `name`"),
            Some(f) if !string(&f.name) => Some("tools/call needs a string `name`"),
            Some(f) if !matches!(f.arguments, None | Some(Kind::Null) | Some(Kind::Object(_))) => {
                Some("tools/call `arguments` must be an object")
            }
            Some(_) => None,
        },
        "tasks/get" | "tasks/cancel" => match fields {
            Some(f) if string(&f.task_id) => None,
            _ => Some("a tasks request needs a string `taskId`"),
        },
        _ => None,
    }
}

/// Walks one value: counts it and everything inside, refuses duplicate keys, and
/// reports its kind (and, at the top level, the members that matter). `depth` 0 is the
/// message, 1 its members (whose strings are kept), deeper values are only counted.
struct Probe<'a> {
    values: &'a mut usize,
    depth: u8,
    /// This value is the message's `params`: note the members methods require.
    params: bool,
    /// This value is a member of `params`: a string is kept (a tool name, a task id).
    keep: bool,
}

impl Probe<'_> {
    fn inner(&mut self) -> Probe<'_> {
        Probe {
            values: &mut *self.values,
            depth: self.depth.saturating_add(1),
            params: false,
            keep: false,
        }
    }
}

impl<'de> DeserializeSeed<'de> for Probe<'_> {
    type Value = Kind;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Kind, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Probe<'_> {
    type Value = Kind;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_unit<E: de::Error>(self) -> Result<Kind, E> {
        *self.values += 1;
        Ok(Kind::Null)
    }

    fn visit_bool<E: de::Error>(self, _: bool) -> Result<Kind, E> {
        *self.values += 1;
        Ok(Kind::Bool)
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Kind, E> {
        *self.values += 1;
        Ok(Kind::Int(v.into()))
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Kind, E> {
        *self.values += 1;
        Ok(Kind::Int(v.into()))
    }

    fn visit_f64<E: de::Error>(self, _: f64) -> Result<Kind, E> {
        *self.values += 1;
        Ok(Kind::Float)
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Kind, E> {
        *self.values += 1;
        // Only the message's own members (`jsonrpc`, `id`, `method`) and those of its
        // `params` (`name`, `taskId`) are kept; strings deeper down (arguments, content)
        // are counted, never copied.
        Ok(Kind::Str(
            if (self.depth == 1 && !self.params) || self.keep {
                v.to_owned()
            } else {
                String::new()
            },
        ))
    }

    fn visit_seq<A: SeqAccess<'de>>(mut self, mut seq: A) -> Result<Kind, A::Error> {
        *self.values += 1;
        while seq.next_element_seed(self.inner())?.is_some() {}
        Ok(Kind::Array)
    }

    fn visit_map<A: MapAccess<'de>>(mut self, mut map: A) -> Result<Kind, A::Error> {
        *self.values += 1;
        let mut seen = Seen::default();
        let mut fields = (self.depth == 0 || self.params).then(Box::<Fields>::default);
        let top = self.depth == 0;
        while let Some(key) = map.next_key_seed(Key)? {
            *self.values += 1;
            if seen.has(&key) {
                return Err(de::Error::custom(format_args!(
                    "duplicate object key {:?}",
                    Shorten(&key)
                )));
            }
            let in_params = self.params;
            let mut inner = self.inner();
            inner.params = top && key == "params";
            inner.keep = in_params;
            let value = map.next_value_seed(inner)?;
            if let Some(f) = fields.as_mut() {
                f.members += 1;
                match (top, key.as_ref()) {
                    (true, "jsonrpc") => f.jsonrpc = Some(value),
                    (true, "id") => f.id = Some(value),
                    (true, "method") => f.method = Some(value),
                    (true, "params") => f.params = Some(value),
                    (true, "result") => f.result = true,
                    (true, "error") => f.error = true,
                    (false, "name") => f.name = Some(value),
                    (false, "arguments") => f.arguments = Some(value),
                    (false, "taskId") => f.task_id = Some(value),
                    _ => {}
                }
            }
            seen.add(key);
        }
        Ok(Kind::Object(fields))
    }
}

/// The keys of one object so far: looked through in order while they are few (most
/// objects; kept in place, no hasher to seed), hashed once they are many (no quadratic
/// walk for an object built with thousands of keys).
#[derive(Default)]
struct Seen<'de> {
    few: [Cow<'de, str>; FEW_KEYS],
    count: usize,
    many: HashSet<Cow<'de, str>>,
}

/// Keys looked through in order before they are hashed.
const FEW_KEYS: usize = 16;

impl<'de> Seen<'de> {
    fn has(&self, key: &str) -> bool {
        self.few[..self.count].iter().any(|k| k == key) || self.many.contains(key)
    }

    fn add(&mut self, key: Cow<'de, str>) {
        if self.count < FEW_KEYS {
            self.few[self.count] = key;
            self.count += 1;
        } else {
            self.many.insert(key);
        }
    }
}

/// An object key, borrowed from the input when it has no escapes.
struct Key;

impl<'de> DeserializeSeed<'de> for Key {
    type Value = Cow<'de, str>;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for Key {
    type Value = Cow<'de, str>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an object key")
    }

    fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
        Ok(Cow::Borrowed(v))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
        Ok(Cow::Owned(v.to_owned()))
    }
}

/// A key in an error message, at most 64 characters of it.
struct Shorten<'a>(&'a str);

impl fmt::Debug for Shorten<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0.char_indices().nth(64) {
            Some((end, _)) => write!(f, "{:?}…", &self.0[..end]),
            None => write!(f, "{:?}", self.0),
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn ok(body: &str) -> Inspected {
        inspect(body.as_bytes()).unwrap_or_else(|e| panic!("{body}: {e:?}"))
    }

    fn err(body: &str) -> Invalid {
        inspect(body.as_bytes()).expect_err(body)
    }

    #[test]
    fn a_tool_calls_name_is_read_and_nothing_deeper() {
        let r = ok(
            r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"arguments":{"name":"inner","x":"y"},"name":"file.write"}}"#,
        );
        assert_eq!(r.tool.as_deref(), Some("file.write"));
        let r = ok(r#"{"jsonrpc":"2.0","id":1,"method":"tools/list","params":{"name":"x"}}"#);
        assert_eq!(r.tool, None);
        let r =
            ok(r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"a\u002eb"}}"#);
        assert_eq!(r.tool.as_deref(), Some("a.b"), "the name is read unescaped");
    }

    /// A duplicate is found among few keys, among many, and across the two.
    #[test]
    fn duplicate_keys_are_refused_however_many_keys_an_object_has() {
        let object = |keys: &[usize]| {
            let members: Vec<String> = keys.iter().map(|k| format!("\"k{k}\":{k}")).collect();
            format!(
                r#"{{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{{"name":"x","arguments":{{{}}}}}}}"#,
                members.join(",")
            )
        };
        let distinct: Vec<usize> = (0..3 * FEW_KEYS).collect();
        ok(&object(&distinct));
        for (first, again) in [(1, 2), (2, FEW_KEYS + 3), (FEW_KEYS + 1, 2 * FEW_KEYS + 5)] {
            let mut keys = distinct.clone();
            keys[again] = keys[first];
            assert!(
                matches!(err(&object(&keys)), Invalid::Parse(why) if why.contains("duplicate object key")),
                "key {first} again at {again}"
            );
        }
    }

    #[test]
    fn requests_notifications_and_responses_pass_with_their_id() {
        let r = ok(r#"{"jsonrpc":"2.0","id":7,"method":"tools/list","params":{}}"#);
        assert_eq!(
            (r.id, r.method.as_deref()),
            (Some(json!(7)), Some("tools/list"))
        );
        let r = ok(r#"{"jsonrpc":"2.0","id":"a\"b","method":"ping"}"#);
        assert_eq!(r.id, Some(json!("a\"b")));
        let n =
            ok(r#"{"jsonrpc":"2.0","method":"notifications/cancelled","params":{"requestId":1}}"#);
        assert_eq!(n.id, None);
        let resp = ok(r#"{"jsonrpc":"2.0","id":3,"result":{}}"#);
        assert_eq!((resp.id, resp.method), (None, None));
        let edge = ok(r#"{"jsonrpc":"2.0","id":9223372036854775807,"method":"ping"}"#);
        assert_eq!(edge.id, Some(json!(i64::MAX)));
        let edge = ok(r#"{"jsonrpc":"2.0","id":-9223372036854775808,"method":"ping"}"#);
        assert_eq!(edge.id, Some(json!(i64::MIN)));
    }

    #[test]
    fn each_defect_gets_its_json_rpc_code_and_the_id_where_known() {
        let cases: [(&str, i32, Value); 22] = [
            (
                r#"{"jsonrpc":"2.0","id":9223372036854775808,"method":"ping"}"#,
                -32600,
                json!(9_223_372_036_854_775_808_u64),
            ),
            (
                r#"{"jsonrpc":"2.0","id":18446744073709551615,"method":"tools/list"}"#,
                -32600,
                json!(u64::MAX),
            ),
            (
                r#"{"jsonrpc":"2.0","id":1,"result":{},"method":"ping"}"#,
                -32600,
                json!(1),
            ),
            (
                r#"{"jsonrpc":"2.0","id":2,"error":null,"method":"tools/call","params":{"name":"a"}}"#,
                -32600,
                json!(2),
            ),
            ("", -32700, Value::Null),
            ("{", -32700, Value::Null),
            (
                r#"{"jsonrpc":"2.0","id":1,"method":"a"} x"#,
                -32700,
                Value::Null,
            ),
            (
                r#"{"jsonrpc":"2.0","id":1,"id":2,"method":"a"}"#,
                -32700,
                Value::Null,
            ),
            (
                r#"{"jsonrpc":"2.0","id":1,"method":"a","params":{"k":1,"k":2}}"#,
                -32700,
                Value::Null,
            ),
            (
                r#"[{"jsonrpc":"2.0","id":1,"method":"a"}]"#,
                -32600,
                Value::Null,
            ),
            ("3", -32600, Value::Null),
            (
                r#"{"jsonrpc":"2.0","id":1.5,"method":"a"}"#,
                -32600,
                Value::Null,
            ),
            (
                r#"{"jsonrpc":"2.0","id":null,"method":"a"}"#,
                -32600,
                Value::Null,
            ),
            (r#"{"jsonrpc":"1.0","id":4,"method":"a"}"#, -32600, json!(4)),
            (r#"{"jsonrpc":"2.0","id":5,"method":7}"#, -32600, json!(5)),
            (
                r#"{"jsonrpc":"2.0","id":6,"method":"tools/call","params":null}"#,
                -32602,
                json!(6),
            ),
            (
                r#"{"jsonrpc":"2.0","id":8,"result":{},"error":{}}"#,
                -32600,
                json!(8),
            ),
            (
                r#"{"jsonrpc":"2.0","id":9,"method":"tools/call"}"#,
                -32602,
                json!(9),
            ),
            (
                r#"{"jsonrpc":"2.0","id":10,"method":"tools/call","params":{}}"#,
                -32602,
                json!(10),
            ),
            (
                r#"{"jsonrpc":"2.0","id":11,"method":"tools/call","params":{"name":"x","arguments":[]}}"#,
                -32602,
                json!(11),
            ),
            (
                r#"{"jsonrpc":"2.0","id":12,"method":"tasks/get","params":{"taskId":3}}"#,
                -32602,
                json!(12),
            ),
            (
                r#"{"jsonrpc":"2.0","id":13,"method":"tools/call","params":{"name":7}}"#,
                -32602,
                json!(13),
            ),
        ];
        for (body, code, id) in cases {
            let e = err(body);
            assert_eq!(e.code(), code, "{body}: {e:?}");
            let response = e.response();
            assert_eq!(response["id"], id, "{body}");
            assert_eq!(response["error"]["code"], code);
            assert!(
                response["error"]["message"]
                    .as_str()
                    .is_some_and(|m| m.len() < 400)
            );
        }
    }

    #[test]
    fn cost_counts_every_value() {
        let text = r#"{"jsonrpc":"2.0","id":1,"method":"a","params":{"x":[1,2,3]}}"#;
        // top object + 4 keys + 3 scalars + params object + key + array + 3 numbers
        assert_eq!(ok(text).cost, text.len() + 14 * VALUE_COST);
        let nested = format!(
            r#"{{"jsonrpc":"2.0","id":1,"method":"a","params":{{"a":[{}]}}}}"#,
            vec!["[]"; 10_000].join(",")
        );
        let r = ok(&nested);
        assert!(r.cost >= 10_000 * VALUE_COST, "{}", r.cost);
    }

    #[test]
    fn deep_nesting_is_a_parse_error_not_a_stack_overflow() {
        let deep = format!("{}{}", "[".repeat(100_000), "]".repeat(100_000));
        assert_eq!(err(&deep).code(), -32700);
    }
}
