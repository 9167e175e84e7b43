//! The client address behind a trusted proxy: `X-Forwarded-For` is believed only when
//! the TCP peer is a configured trusted proxy.
//!
//! The header is read as bytes, right to left, and only as far as the walk goes: what a
//! client wrote to the left of the hop a trusted proxy appended (a stray non-ASCII byte, a
//! forged address, garbage) changes nothing.

use std::net::IpAddr;

use http::HeaderMap;
use ipnet::IpNet;

use crate::vocab::canonical;

fn trusted(ip: IpAddr, proxies: &[IpNet]) -> bool {
    proxies.iter().any(|net| net.contains(&ip))
}

/// One `X-Forwarded-For` hop: an IP, optionally `ip:port` or `[v6]:port`, with optional
/// whitespace around it. Anything else, including any byte that is not ASCII, is `None`.
fn parse_hop(hop: &[u8]) -> Option<IpAddr> {
    let hop = std::str::from_utf8(hop.trim_ascii()).ok()?;
    hop.parse::<IpAddr>()
        .ok()
        .or_else(|| hop.parse::<std::net::SocketAddr>().ok().map(|s| s.ip()))
        .map(canonical)
}

/// The client address: the peer, unless the peer is a trusted proxy; then walk the
/// `X-Forwarded-For` hops (every such header in order, comma-separated) right to left and
/// take the first untrusted one. A malformed hop the walk reaches falls back to the peer.
pub fn client_address(peer: IpAddr, headers: &HeaderMap, proxies: &[IpNet]) -> IpAddr {
    let peer = canonical(peer);
    if !trusted(peer, proxies) {
        return peer;
    }
    let values: Vec<&[u8]> = headers
        .get_all("x-forwarded-for")
        .iter()
        .map(|v| v.as_bytes())
        .collect();
    let hops = values
        .iter()
        .rev()
        .flat_map(|value| value.rsplit(|b| *b == b','));
    let mut leftmost = None;
    for hop in hops {
        let Some(ip) = parse_hop(hop) else {
            return peer;
        };
        if !trusted(ip, proxies) {
            return ip;
        }
        leftmost = Some(ip);
    }
    // Every hop is a trusted proxy: the furthest one is the best we know.
    leftmost.unwrap_or(peer)
}

#[cfg(test)]
mod tests {
    use http::HeaderValue;

    use super::*;
    use crate::config::{holds_public, parse_net};

    fn headers(values: &[&'static str]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for v in values {
            h.append("x-forwarded-for", HeaderValue::from_static(v));
        }
        h
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn nets_parse() {
        assert_eq!(parse_net("10.0.0.0/8"), Some("10.0.0.0/8".parse().unwrap()));
        assert_eq!(
            parse_net("127.0.0.1"),
            Some("127.0.0.1/32".parse().unwrap())
        );
        assert_eq!(parse_net("::1"), Some("::1/128".parse().unwrap()));
        assert_eq!(parse_net("10.0.0.0/33"), None);
        assert_eq!(parse_net("proxy.local"), None);
    }

    #[test]
    fn forwarded_walk() {
        let proxies = vec![
            parse_net("127.0.0.1").unwrap(),
            parse_net("10.0.0.0/8").unwrap(),
        ];
        let cases: [(&str, &[&'static str], &str); 11] = [
            ("203.0.113.9", &["198.51.100.1"], "203.0.113.9"),
            ("127.0.0.1", &[], "127.0.0.1"),
            ("127.0.0.1", &["198.51.100.1"], "198.51.100.1"),
            ("127.0.0.1", &["198.51.100.1, 10.1.1.1"], "198.51.100.1"),
            (
                "127.0.0.1",
                &["6.6.6.6, 198.51.100.1, 10.1.1.1"],
                "198.51.100.1",
            ),
            ("127.0.0.1", &["6.6.6.6", "198.51.100.1"], "198.51.100.1"),
            ("127.0.0.1", &["10.2.2.2, 10.1.1.1"], "10.2.2.2"),
            ("127.0.0.1", &["198.51.100.1, garbage"], "127.0.0.1"),
            ("127.0.0.1", &["198.51.100.1:4711"], "198.51.100.1"),
            ("127.0.0.1", &["[2001:db8::1]:443"], "2001:db8::1"),
            ("::ffff:127.0.0.1", &["198.51.100.1"], "198.51.100.1"),
        ];
        for (peer, xff, want) in cases {
            assert_eq!(
                client_address(ip(peer), &headers(xff), &proxies),
                ip(want),
                "{peer} {xff:?}"
            );
        }
        assert_eq!(
            client_address(ip("127.0.0.1"), &headers(&["198.51.100.1"]), &[]),
            ip("127.0.0.1")
        );
    }

    /// The walk reads bytes and stops at the first untrusted hop: whatever a client put to
    /// its left, a non-ASCII byte included, changes nothing; a malformed hop the walk
    /// reaches means the peer.
    #[test]
    fn forwarded_walk_reads_bytes_only_as_far_as_it_goes() {
        let proxies = vec![
            parse_net("127.0.0.1").unwrap(),
            parse_net("10.0.0.0/8").unwrap(),
        ];
        let cases: [(&[&[u8]], &str); 11] = [
            (&[b"\xff\xfe, 203.0.113.9"], "203.0.113.9"),
            (&[b"caf\xc3\xa9, 203.0.113.9, 10.1.1.1"], "203.0.113.9"),
            (&[b"\x80", b"203.0.113.9"], "203.0.113.9"),
            (&[b"198.51.100.1\xff, 203.0.113.9"], "203.0.113.9"),
            (&[b"203.0.113.9\xff"], "127.0.0.1"),
            (&[b"203.0.113.9, \xff"], "127.0.0.1"),
            (&[b"203.0.113.9", b"10.1.1.1, \x80"], "127.0.0.1"),
            (&[b"203.0.113.9, 10.1.\xff.1"], "127.0.0.1"),
            (&[b"\t203.0.113.9 "], "203.0.113.9"),
            (&[b" , 203.0.113.9"], "203.0.113.9"),
            (&[b"203.0.113.9,"], "127.0.0.1"),
        ];
        for (values, want) in cases {
            let mut h = HeaderMap::new();
            for v in values {
                h.append("x-forwarded-for", HeaderValue::from_bytes(v).unwrap());
            }
            assert_eq!(
                client_address(ip("127.0.0.1"), &h, &proxies),
                ip(want),
                "{values:?}"
            );
        }
    }

    #[test]
    fn nets_holding_public_addresses() {
        for (net, public) in [
            ("127.0.0.1", false),
            ("127.0.0.0/8", false),
            ("10.0.0.0/8", false),
            ("172.16.0.0/12", false),
            ("192.168.1.0/24", false),
            ("100.64.0.0/10", false),
            ("169.254.0.0/16", false),
            ("::1", false),
            ("fd00::/8", false),
            ("fe80::/10", false),
            ("10.0.0.0/7", true),
            ("172.0.0.0/11", true),
            ("0.0.0.0/1", true),
            ("203.0.113.7", true),
            ("2001:db8::/32", true),
            ("fc00::/6", true),
            ("::/1", true),
        ] {
            assert_eq!(holds_public(&parse_net(net).unwrap()), public, "{net}");
        }
    }
}
