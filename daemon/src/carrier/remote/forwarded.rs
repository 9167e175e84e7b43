//! The client address behind a trusted proxy: `X-Forwarded-For` is believed only when
//! the TCP peer is a configured trusted proxy.

use std::net::IpAddr;

use http::HeaderMap;
use ipnet::IpNet;

/// An IP (`10.0.0.1`, `::1`) or a CIDR (`10.0.0.0/8`).
pub fn parse_net(text: &str) -> Option<IpNet> {
    let text = text.trim();
    text.parse::<IpNet>()
        .ok()
        .or_else(|| text.parse::<IpAddr>().ok().map(IpNet::from))
}

fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4),
        v4 => v4,
    }
}

fn trusted(ip: IpAddr, proxies: &[IpNet]) -> bool {
    proxies.iter().any(|net| net.contains(&ip))
}

/// One `X-Forwarded-For` hop: an IP, optionally `ip:port` or `[v6]:port`.
fn parse_hop(hop: &str) -> Option<IpAddr> {
    let hop = hop.trim();
    hop.parse::<IpAddr>()
        .ok()
        .or_else(|| hop.parse::<std::net::SocketAddr>().ok().map(|s| s.ip()))
        .map(canonical)
}

/// The client address: the peer, unless the peer is a trusted proxy; then walk the
/// `X-Forwarded-For` hops right to left and take the first untrusted one. A malformed hop
/// (or a header that is not text) falls back to the peer.
pub fn client_address(peer: IpAddr, headers: &HeaderMap, proxies: &[IpNet]) -> IpAddr {
    let peer = canonical(peer);
    if !trusted(peer, proxies) {
        return peer;
    }
    let mut hops = Vec::new();
    for value in headers.get_all("x-forwarded-for") {
        let Ok(text) = value.to_str() else {
            return peer;
        };
        hops.extend(text.split(','));
    }
    let mut leftmost = None;
    for hop in hops.iter().rev() {
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
}
