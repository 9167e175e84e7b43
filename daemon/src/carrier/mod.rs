//! Carriers: where MCP requests arrive. Each implements [`crate::transport::Carrier`].

pub mod endpoint;
pub mod http;
pub mod jsonrpc;
pub mod lines;
pub mod loopback;
pub mod relay;
pub mod remote;
pub mod scrape;
pub mod stdio;

/// RFC 6750 §2.1 credentials: `Bearer 1*SP b64token`, the scheme case-insensitive.
/// Returns the token; length limits are each carrier's own.
pub fn parse_bearer(value: &[u8]) -> Option<&str> {
    let value = std::str::from_utf8(value).ok()?;
    let (scheme, rest) = value.split_once(' ')?;
    if !scheme.eq_ignore_ascii_case("bearer") {
        return None;
    }
    let token = rest.trim_start_matches(' ');
    let b64token = |c: char| c.is_ascii_alphanumeric() || "-._~+/".contains(c);
    let body = token.trim_end_matches('=');
    (!body.is_empty() && body.chars().all(b64token)).then_some(token)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bearer_grammar() {
        assert_eq!(parse_bearer(b"Bearer abc"), Some("abc"));
        assert_eq!(parse_bearer(b"Bearer   abc=="), Some("abc=="));
        assert_eq!(parse_bearer(b"BEARER a.b-c_d~e+f/g"), Some("a.b-c_d~e+f/g"));
        let long = format!("Bearer {}", "a".repeat(9000));
        assert_eq!(parse_bearer(long.as_bytes()).map(str::len), Some(9000));
        for bad in [
            &b"Bearer"[..],
            b"Bearer =",
            b"Bearerabc",
            b"Bearer a=b",
            b"Bearer \xff",
            b"Token abc",
            b"Bearer a b",
        ] {
            assert_eq!(
                parse_bearer(bad),
                None,
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
    }
}
