//! Carriers: where MCP requests arrive. Each implements [`crate::transport::Carrier`].

pub mod endpoint;
pub mod http;
pub mod jsonrpc;
pub mod lines;
pub mod loopback;
pub mod remote;
pub mod stdio;

use std::net::IpAddr;

/// The client-address group a peer is counted under: IPv4 (also IPv4-mapped IPv6) by
/// address, IPv6 by its `/prefix`.
pub fn address_group(ip: IpAddr, v6_prefix: u8) -> IpAddr {
    match ip {
        IpAddr::V4(_) => ip,
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => {
                let bits = u128::from(v6);
                let prefix = u32::from(v6_prefix.min(128));
                let mask = u128::MAX.checked_shl(128 - prefix).unwrap_or(0);
                IpAddr::V6((bits & mask).into())
            }
        },
    }
}

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
    use std::net::IpAddr;

    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn ipv6_clients_are_grouped_by_their_prefix() {
        assert_eq!(address_group(ip("192.0.2.7"), 64), ip("192.0.2.7"));
        assert_eq!(address_group(ip("::ffff:192.0.2.7"), 64), ip("192.0.2.7"));
        assert_eq!(
            address_group(ip("2001:db8:1:2:aaaa:bbbb:cccc:dddd"), 64),
            ip("2001:db8:1:2::")
        );
        assert_eq!(
            address_group(ip("2001:db8:1:2:aaaa::1"), 48),
            ip("2001:db8:1::")
        );
        assert_eq!(address_group(ip("2001:db8::1"), 128), ip("2001:db8::1"));
        assert_eq!(address_group(ip("2001:db8::1"), 0), ip("::"));
    }

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
