//! MCP's own HTTP request headers, both sides: the names of the transport's headers, and
//! SEP-2243's `Mcp-Param-*` headers — which arguments a tool's input schema puts in
//! headers (the `x-mcp-header` annotation), and how a value travels in one (as it is, or
//! wrapped in Base64). The carriers check what a client sends with it; the link to an HTTP
//! upstream sends with it.

use base64::Engine;
use http::{HeaderName, HeaderValue};
use serde_json::{Map, Value};

/// The protocol revision a request is sent in.
pub const PROTOCOL_VERSION: HeaderName = HeaderName::from_static("mcp-protocol-version");
/// SEP-2243: the request's method, and the name (tool, prompt, resource) it is about.
pub const MCP_METHOD: HeaderName = HeaderName::from_static("mcp-method");
pub const MCP_NAME: HeaderName = HeaderName::from_static("mcp-name");
/// The session a server gave, on the revisions that have sessions.
pub const SESSION_ID: HeaderName = HeaderName::from_static("mcp-session-id");

/// The properties of a tool's input `schema` (by path, through nested `properties`)
/// annotated with a non-empty `x-mcp-header` name, and that name: what SEP-2243 puts in an
/// `Mcp-Param-<name>` header. The one reading of the annotation, for what a client sends
/// here and what the daemon sends an upstream.
pub fn annotations(schema: &Map<String, Value>) -> Vec<(Vec<&str>, &str)> {
    fn walk<'a>(
        properties: Option<&'a Value>,
        path: &mut Vec<&'a str>,
        out: &mut Vec<(Vec<&'a str>, &'a str)>,
    ) {
        let Some(Value::Object(properties)) = properties else {
            return;
        };
        for (name, schema) in properties {
            path.push(name);
            if let Some(Value::String(header)) = schema.get("x-mcp-header")
                && !header.is_empty()
            {
                out.push((path.clone(), header));
            }
            walk(schema.get("properties"), path, out);
            path.pop();
        }
    }
    let mut out = Vec::new();
    walk(schema.get("properties"), &mut Vec::new(), &mut out);
    out
}

/// What every `Mcp-Param-*` header's name starts with, lower-cased.
pub const HEADER_PREFIX: &str = "mcp-param-";

/// The header an `x-mcp-header` annotation names, if the name makes one.
pub fn header_name(annotation: &str) -> Option<HeaderName> {
    HeaderName::from_bytes(format!("{HEADER_PREFIX}{annotation}").as_bytes()).ok()
}

/// The argument at `path` of a call's `arguments` as a header carries it: a string as it
/// is, a number or boolean as JSON writes it; anything else (absent, null, an object or an
/// array) travels in no header.
pub fn argument_text(arguments: Option<&Value>, path: &[impl AsRef<str>]) -> Option<String> {
    match arguments.and_then(|a| path.iter().try_fold(a, |v, k| v.get(k.as_ref())))? {
        Value::String(s) => Some(s.clone()),
        Value::Bool(b) => Some(b.to_string()),
        Value::Number(n) => Some(n.to_string()),
        _ => None,
    }
}

/// How SEP-2243 wraps a header value that cannot travel as it is: `=?base64?…?=`.
const BASE64_OPEN: &str = "=?base64?";
const BASE64_CLOSE: &str = "?=";

/// A header value, decoded when it is wrapped in Base64.
pub fn decoded(value: &str) -> Option<String> {
    match value
        .strip_prefix(BASE64_OPEN)
        .and_then(|inner| inner.strip_suffix(BASE64_CLOSE))
    {
        Some(inner) => {
            let bytes = base64::prelude::BASE64_STANDARD.decode(inner).ok()?;
            String::from_utf8(bytes).ok()
        }
        None => Some(value.to_owned()),
    }
}

/// Header text for `value` (what the daemon sends an upstream): as it is when it can
/// travel bare, else wrapped in Base64 — empty, spaces at either end, anything but
/// printable ASCII, or text that would read as wrapped.
pub fn header_text(value: &str) -> HeaderValue {
    let needs_encoding = value.is_empty()
        || value.starts_with([' ', '\t'])
        || value.ends_with([' ', '\t'])
        || value.chars().any(|c| !(' '..='~').contains(&c))
        || (value.starts_with(BASE64_OPEN) && value.ends_with(BASE64_CLOSE));
    let text = if needs_encoding {
        format!(
            "{BASE64_OPEN}{}{BASE64_CLOSE}",
            base64::prelude::BASE64_STANDARD.encode(value)
        )
    } else {
        value.to_owned()
    };
    HeaderValue::from_str(&text).unwrap_or_else(|_| HeaderValue::from_static("invalid"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What the daemon sends an upstream reads back as what it meant, bare when it can be.
    #[test]
    fn header_text_round_trips_through_the_decoder() {
        for value in [
            "plain",
            "",
            " lead",
            "trail\t",
            "naïve",
            "=?base64?abc?=",
            "a?=",
            "~!",
        ] {
            let text = header_text(value);
            let text = text.to_str().expect("visible ASCII");
            assert_eq!(
                decoded(text).as_deref(),
                Some(value),
                "{value:?} as {text:?}"
            );
        }
        assert_eq!(header_text("plain").to_str().unwrap(), "plain");
        assert_eq!(
            header_text("naïve").to_str().unwrap(),
            "=?base64?bmHDr3Zl?="
        );
    }
}
