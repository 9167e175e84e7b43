//! Carriers: where MCP requests arrive. Each implements [`crate::transport::Carrier`].

#[cfg(test)]
mod differential;
pub mod endpoint;
pub mod http;
pub mod lines;
pub mod loopback;
pub mod relay;
pub mod remote;
mod repoll;
pub mod scrape;
pub mod stdio;
pub mod streamable;

use std::net::SocketAddr;

use crate::vocab::Listener;

/// The TCP sockets of the daemon's listeners, by configured address, kept across
/// restarts: a carrier whose address did not change serves on the same socket again, so
/// its port stays and a client connecting during a restart waits in the backlog instead of
/// being refused.
#[derive(Default)]
/// Keyed by listener and configured address: two listeners configured on port 0 are two
/// sockets, and each keeps its port across reloads.
pub struct Sockets {
    kept: parking_lot::Mutex<
        std::collections::HashMap<(Listener, SocketAddr), std::net::TcpListener>,
    >,
}

impl Sockets {
    /// A listener on `addr`: the kept socket if there is one, else a new one (kept).
    pub fn listener(
        &self,
        name: Listener,
        addr: SocketAddr,
    ) -> std::io::Result<tokio::net::TcpListener> {
        let mut kept = self.kept.lock();
        tokio::net::TcpListener::from_std(kept_socket(&mut kept, name, addr)?.try_clone()?)
    }

    /// Bind `addr` now unless it is kept already, so a restart fails before it stops
    /// anything.
    pub fn reserve(&self, name: Listener, addr: SocketAddr) -> std::io::Result<()> {
        kept_socket(&mut self.kept.lock(), name, addr).map(|_| ())
    }

    /// Close every kept socket but those of `addrs`.
    pub fn retain(&self, keep: &[(Listener, SocketAddr)]) {
        self.kept.lock().retain(|key, _| keep.contains(key));
    }
}

fn kept_socket(
    kept: &mut std::collections::HashMap<(Listener, SocketAddr), std::net::TcpListener>,
    name: Listener,
    addr: SocketAddr,
) -> std::io::Result<&std::net::TcpListener> {
    match kept.entry((name, addr)) {
        std::collections::hash_map::Entry::Occupied(e) => Ok(e.into_mut()),
        std::collections::hash_map::Entry::Vacant(e) => {
            // As `tokio::net::TcpListener::bind` does: SO_REUSEADDR, a backlog of 1024.
            let socket = match addr {
                SocketAddr::V4(_) => tokio::net::TcpSocket::new_v4()?,
                SocketAddr::V6(_) => tokio::net::TcpSocket::new_v6()?,
            };
            socket.set_reuseaddr(true)?;
            socket.bind(addr)?;
            Ok(e.insert(socket.listen(1024)?.into_std()?))
        }
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
