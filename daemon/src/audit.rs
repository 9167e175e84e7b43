//! Refusal audit: the closed sets (carriers, refusal reasons, address classes) and the
//! record emitted for every refusal.
//!
//! A record carries a time, a carrier, a reason, the `throttled` flag and an address
//! class — never token text, never the address itself. Records go to the log (journald
//! fields when logging to the journal) and to a one-hour in-memory window that `status`
//! summarises. The persisted, queryable store arrives with the remote carrier.

use std::collections::{BTreeMap, VecDeque};
use std::net::IpAddr;
use std::time::{Duration, SystemTime};

use parking_lot::Mutex;

/// How long refusals are kept for `status`.
const WINDOW: Duration = Duration::from_secs(3600);
/// Most records kept in the window; older ones are folded into nothing.
const WINDOW_CAP: usize = 65_536;

/// A place requests arrive.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Carrier {
    Stdio,
    Loopback,
    Remote,
    Control,
}

impl Carrier {
    pub const ALL: [Carrier; 4] = [
        Carrier::Stdio,
        Carrier::Loopback,
        Carrier::Remote,
        Carrier::Control,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Carrier::Stdio => "stdio",
            Carrier::Loopback => "loopback",
            Carrier::Remote => "remote",
            Carrier::Control => "control",
        }
    }
}

/// Why a request was refused (SPEC §5's closed set, plus the control plane's and the
/// loopback endpoint-path case).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Reason {
    MissingToken,
    Oversize,
    Malformed,
    WrongType,
    UnsupportedAlgorithm,
    AmbiguousKey,
    UnknownKey,
    KeyMismatch,
    BadSignature,
    WrongIssuer,
    WrongAudience,
    Expired,
    NotYetValid,
    MissingScope,
    PrincipalNotAllowed,
    KeysUnavailable,
    WrongHost,
    WrongOrigin,
    BadBearer,
    /// Loopback: a request for a path other than the endpoint (403).
    WrongPath,
    /// Control socket: the peer's uid/gid is not allowed.
    PeerNotAllowed,
}

impl Reason {
    pub const ALL: [Reason; 21] = [
        Reason::MissingToken,
        Reason::Oversize,
        Reason::Malformed,
        Reason::WrongType,
        Reason::UnsupportedAlgorithm,
        Reason::AmbiguousKey,
        Reason::UnknownKey,
        Reason::KeyMismatch,
        Reason::BadSignature,
        Reason::WrongIssuer,
        Reason::WrongAudience,
        Reason::Expired,
        Reason::NotYetValid,
        Reason::MissingScope,
        Reason::PrincipalNotAllowed,
        Reason::KeysUnavailable,
        Reason::WrongHost,
        Reason::WrongOrigin,
        Reason::BadBearer,
        Reason::WrongPath,
        Reason::PeerNotAllowed,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Reason::MissingToken => "missing-token",
            Reason::Oversize => "oversize",
            Reason::Malformed => "malformed",
            Reason::WrongType => "wrong-type",
            Reason::UnsupportedAlgorithm => "unsupported-algorithm",
            Reason::AmbiguousKey => "ambiguous-key",
            Reason::UnknownKey => "unknown-key",
            Reason::KeyMismatch => "key-mismatch",
            Reason::BadSignature => "bad-signature",
            Reason::WrongIssuer => "wrong-issuer",
            Reason::WrongAudience => "wrong-audience",
            Reason::Expired => "expired",
            Reason::NotYetValid => "not-yet-valid",
            Reason::MissingScope => "missing-scope",
            Reason::PrincipalNotAllowed => "principal-not-allowed",
            Reason::KeysUnavailable => "keys-unavailable",
            Reason::WrongHost => "wrong-host",
            Reason::WrongOrigin => "wrong-origin",
            Reason::BadBearer => "bad-bearer",
            Reason::WrongPath => "wrong-path",
            Reason::PeerNotAllowed => "peer-not-allowed",
        }
    }
}

/// Coarse class of a client address; the address itself is never recorded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AddressClass {
    Loopback,
    /// RFC 1918, link-local, CGNAT (100.64/10), ULA (fc00::/7).
    Private,
    Public,
    /// Unix sockets, stdio, or no address at all.
    Unknown,
}

impl AddressClass {
    pub const ALL: [AddressClass; 4] = [
        AddressClass::Loopback,
        AddressClass::Private,
        AddressClass::Public,
        AddressClass::Unknown,
    ];

    pub fn of(ip: IpAddr) -> Self {
        let ip = match ip {
            IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4),
            v4 => v4,
        };
        match ip {
            IpAddr::V4(v4) if v4.is_loopback() => AddressClass::Loopback,
            IpAddr::V4(v4) => {
                let [a, b, ..] = v4.octets();
                if v4.is_private() || v4.is_link_local() || (a == 100 && (64..128).contains(&b)) {
                    AddressClass::Private
                } else if v4.is_unspecified() {
                    AddressClass::Unknown
                } else {
                    AddressClass::Public
                }
            }
            IpAddr::V6(v6) if v6.is_loopback() => AddressClass::Loopback,
            IpAddr::V6(v6) => {
                let first = v6.segments()[0];
                if (first & 0xfe00) == 0xfc00 || (first & 0xffc0) == 0xfe80 {
                    AddressClass::Private
                } else if v6.is_unspecified() {
                    AddressClass::Unknown
                } else {
                    AddressClass::Public
                }
            }
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            AddressClass::Loopback => "loopback",
            AddressClass::Private => "private",
            AddressClass::Public => "public",
            AddressClass::Unknown => "unknown",
        }
    }
}

/// One refusal.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    pub time: SystemTime,
    pub carrier: Carrier,
    pub reason: Reason,
    pub throttled: bool,
    pub address_class: AddressClass,
}

/// The audit sink shared by every carrier.
#[derive(Default)]
pub struct Audit {
    recent: Mutex<VecDeque<(SystemTime, Reason)>>,
}

impl Audit {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn record(&self, record: Record) {
        tracing::warn!(
            target: "robota_mcpd::audit",
            carrier = record.carrier.as_str(),
            reason = record.reason.as_str(),
            throttled = record.throttled,
            address_class = record.address_class.as_str(),
            "request refused"
        );
        let mut recent = self.recent.lock();
        if recent.len() == WINDOW_CAP {
            recent.pop_front();
        }
        recent.push_back((record.time, record.reason));
    }

    /// Refusals within the last hour of `now`, by reason.
    pub fn last_hour(&self, now: SystemTime) -> BTreeMap<String, u64> {
        let mut recent = self.recent.lock();
        let cutoff = now.checked_sub(WINDOW).unwrap_or(SystemTime::UNIX_EPOCH);
        while recent.front().is_some_and(|(t, _)| *t < cutoff) {
            recent.pop_front();
        }
        let mut out = BTreeMap::new();
        for (_, reason) in recent.iter() {
            *out.entry(reason.as_str().to_owned()).or_insert(0) += 1;
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn address_classes() {
        let class = |s: &str| AddressClass::of(s.parse().unwrap());
        assert_eq!(class("127.0.0.1"), AddressClass::Loopback);
        assert_eq!(class("::1"), AddressClass::Loopback);
        assert_eq!(class("::ffff:127.0.0.1"), AddressClass::Loopback);
        for private in [
            "10.1.2.3",
            "172.16.0.1",
            "192.168.1.1",
            "169.254.0.1",
            "100.64.0.1",
            "100.127.255.255",
            "fd00::1",
            "fe80::1",
        ] {
            assert_eq!(class(private), AddressClass::Private, "{private}");
        }
        for public in ["100.128.0.1", "8.8.8.8", "2001:db8::1", "172.32.0.1"] {
            assert_eq!(class(public), AddressClass::Public, "{public}");
        }
    }

    #[test]
    fn closed_sets_have_unique_strings() {
        let reasons: std::collections::HashSet<_> =
            Reason::ALL.iter().map(|r| r.as_str()).collect();
        assert_eq!(reasons.len(), Reason::ALL.len());
        let carriers: std::collections::HashSet<_> =
            Carrier::ALL.iter().map(|c| c.as_str()).collect();
        assert_eq!(carriers.len(), Carrier::ALL.len());
    }

    #[test]
    fn last_hour_drops_old_records() {
        let audit = Audit::new();
        let now = SystemTime::now();
        let rec = |time, reason| Record {
            time,
            carrier: Carrier::Loopback,
            reason,
            throttled: false,
            address_class: AddressClass::Loopback,
        };
        audit.record(rec(now - Duration::from_secs(7200), Reason::BadBearer));
        audit.record(rec(now - Duration::from_secs(10), Reason::BadBearer));
        audit.record(rec(now, Reason::WrongHost));
        let counts = audit.last_hour(now);
        assert_eq!(counts.get("bad-bearer"), Some(&1));
        assert_eq!(counts.get("wrong-host"), Some(&1));
    }
}
