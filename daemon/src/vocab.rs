//! The ground floor: the daemon's closed sets, each with its one string form (used alike
//! by audit records, metric labels, status and the docs that a test keeps in sync), the
//! admitted [`Caller`], and typed ids. Imports nothing of the crate; every other module
//! may use it.

use std::fmt;
use std::net::IpAddr;

pub use robota_proto::JobState;

/// A closed set: an enum whose every variant has exactly one string form, written once.
/// Gives `ALL`, `as_str`, `parse` and `Display`.
macro_rules! closed_set {
    (@unit $variant:ident) => { () };
    (
        $(#[$meta:meta])*
        pub enum $name:ident {
            $( $(#[$vmeta:meta])* $variant:ident = $text:literal, )+
        }
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub enum $name {
            $( $(#[$vmeta])* $variant, )+
        }

        impl $name {
            /// Every member, in declaration order.
            pub const ALL: [$name; <[()]>::len(&[$(closed_set!(@unit $variant)),+])] =
                [$($name::$variant,)+];

            /// The one string form.
            pub const fn as_str(self) -> &'static str {
                match self {
                    $( $name::$variant => $text, )+
                }
            }

            /// The member whose string form is `text`.
            pub fn parse(text: &str) -> Option<$name> {
                match text {
                    $( $text => Some($name::$variant), )+
                    _ => None,
                }
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }
    };
}

closed_set! {
    /// A place requests arrive.
    pub enum Carrier {
        Stdio = "stdio",
        Loopback = "loopback",
        Remote = "remote",
        Control = "control",
    }
}

closed_set! {
    /// Why a request was refused at admission: the remote carrier's token and name checks,
    /// the loopback carrier's, and the control plane's. Shared by audit and metrics.
    pub enum Reason {
        MissingToken = "missing-token",
        /// A token over 8 KiB, or a request head over the header caps (431).
        Oversize = "oversize",
        Malformed = "malformed",
        WrongType = "wrong-type",
        UnsupportedAlgorithm = "unsupported-algorithm",
        AmbiguousKey = "ambiguous-key",
        UnknownKey = "unknown-key",
        KeyMismatch = "key-mismatch",
        BadSignature = "bad-signature",
        WrongIssuer = "wrong-issuer",
        WrongAudience = "wrong-audience",
        Expired = "expired",
        NotYetValid = "not-yet-valid",
        MissingScope = "missing-scope",
        PrincipalNotAllowed = "principal-not-allowed",
        KeysUnavailable = "keys-unavailable",
        /// Remote: an opaque token could not be checked because the issuer's introspection
        /// endpoint did not answer usefully (503, not counted toward throttling).
        IntrospectionUnavailable = "introspection-unavailable",
        /// Remote: an opaque token the answer cache does not know, from a client over its
        /// failure budget that has used its few introspections of the window (429, counted):
        /// the issuer was not asked.
        NotIntrospected = "not-introspected",
        WrongHost = "wrong-host",
        WrongOrigin = "wrong-origin",
        BadBearer = "bad-bearer",
        /// Loopback: a request for a path other than the endpoint (403).
        WrongPath = "wrong-path",
        /// Control socket: the peer's uid/gid is not allowed.
        PeerNotAllowed = "peer-not-allowed",
    }
}

impl Reason {
    /// Whether `carrier` can refuse a request for this reason: the series the metrics
    /// export (only the remote carrier throttles).
    pub fn given_by(self, carrier: Carrier) -> bool {
        use Reason::*;
        match carrier {
            Carrier::Stdio => false,
            Carrier::Control => self == PeerNotAllowed,
            Carrier::Loopback => matches!(
                self,
                MissingToken
                    | Oversize
                    | Malformed
                    | BadBearer
                    | WrongHost
                    | WrongOrigin
                    | WrongPath
            ),
            Carrier::Remote => !matches!(self, BadBearer | WrongPath | PeerNotAllowed),
        }
    }
}

closed_set! {
    /// Coarse class of a client address; the address itself is never recorded.
    pub enum AddressClass {
        Loopback = "loopback",
        /// RFC 1918, link-local, CGNAT (100.64/10), ULA (fc00::/7).
        Private = "private",
        Public = "public",
        /// Unix sockets, stdio, or no address at all.
        Unknown = "unknown",
    }
}

impl AddressClass {
    pub fn of(ip: IpAddr) -> Self {
        match canonical(ip) {
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
}

/// IPv4-mapped IPv6 (`::ffff:a.b.c.d`) as the IPv4 address it is.
pub fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4),
        v4 => v4,
    }
}

/// The client-address group a peer is counted under (throttling, connection caps): IPv4
/// (also IPv4-mapped IPv6) by address, IPv6 by its `/prefix`.
pub fn address_group(ip: IpAddr, v6_prefix: u8) -> IpAddr {
    match canonical(ip) {
        IpAddr::V6(v6) => {
            let prefix = u32::from(v6_prefix.min(128));
            let mask = u128::MAX.checked_shl(128 - prefix).unwrap_or(0);
            IpAddr::V6((u128::from(v6) & mask).into())
        }
        v4 => v4,
    }
}

closed_set! {
    /// A grant request or decision.
    pub enum GrantEvent {
        Requested = "grant-requested",
        Approved = "grant-approved",
        Denied = "grant-denied",
        Revoked = "grant-revoked",
        /// An approval of one exact call was used by that call (it runs once).
        Used = "grant-used",
    }
}

closed_set! {
    /// An event of an upstream's tool surface (docs/design.md §13.9).
    pub enum UpstreamEvent {
        /// The first listing ever seen, trusted on first use and recorded.
        Pinned = "upstream-pinned",
        /// A listing that differs from the approved surface: its changes are held.
        Drift = "upstream-drift",
        /// The operator approved the surface as listed now.
        Approved = "upstream-approved",
    }
}

closed_set! {
    /// The visible tool errors: every tool failure is one of these, never a hang or a
    /// transport failure.
    pub enum ToolErrorCode {
        UnknownTool = "unknown_tool",
        InvalidArguments = "invalid_arguments",
        PermissionDenied = "permission_denied",
        InteractivePermissionRequired = "interactive_permission_required",
        Busy = "busy",
        Cancelled = "cancelled",
        TimedOut = "timed_out",
        ResultTooLarge = "result_too_large",
        Unavailable = "unavailable",
        /// An interrupted call whose effect is not known (a downstream server that died
        /// or dropped the connection mid-call; a replay of a cut-off idempotent call).
        /// Never retried.
        OutcomeUnknown = "outcome_unknown",
        Internal = "internal",
    }
}

closed_set! {
    /// How a downstream MCP server is reached (`[upstreams.<name>]`).
    pub enum UpstreamKind {
        /// A supervised child speaking MCP on its stdin/stdout (`command`).
        Stdio = "stdio",
        /// A fixed local Streamable HTTP backend (`url`: loopback or `unix:`).
        Http = "http",
    }
}

closed_set! {
    /// Where a downstream MCP server stands (`status`, `robota-mcpctl upstreams`).
    pub enum UpstreamState {
        /// Being started or connected: spawn or connect, handshake, tool listing.
        Starting = "starting",
        /// Ready: its tools answer.
        Up = "up",
        /// Failed; the next attempt waits for the backoff.
        Backoff = "backoff",
        /// Not ready within the start bound, or stopped: its calls answer `unavailable`
        /// (an attempt may still be under way).
        Down = "down",
    }
}

closed_set! {
    /// What kind of work a job is (the `kind` of its record and of the metrics).
    pub enum JobKind {
        /// A `[jobs.<name>]` template (`job.start`).
        Template = "template",
        /// A systemd unit action (`service.action`).
        Service = "service",
        /// A container action (`docker.action`).
        Docker = "docker",
    }
}

closed_set! {
    /// Outcome of one JWKS (or discovery) fetch.
    pub enum FetchOutcome {
        /// Fetched and accepted.
        Ok = "ok",
        /// Network, TLS, HTTP status, timeout or redirect failure.
        Error = "error",
        /// Fetched but refused: over 64 KiB, over 32 keys, not a key set.
        Rejected = "rejected",
    }
}

closed_set! {
    /// What one introspection request (RFC 7662) to the issuer came to.
    pub enum IntrospectionOutcome {
        /// The issuer answered `active: true`.
        Active = "active",
        /// The issuer answered `active: false`.
        Inactive = "inactive",
        /// No usable answer: network, TLS, status, time-out, or a body that is not an
        /// introspection answer.
        Error = "error",
        /// Not sent: no place for it within 1 s (16 in flight in all, or 2 of the same
        /// client's).
        Busy = "busy",
        /// Sent, and the request that asked went away before the answer (its connection
        /// closed, reset or evicted). The issuer's request runs to its end all the same,
        /// holding its place, and is counted again by its answer: cached, and counted as
        /// the client's failure (and audited as a refusal) when it refuses the token.
        Abandoned = "abandoned",
        /// Not sent: less than 1 s before, a request got no usable answer for a reason no
        /// token could cause (unreachable, time-out, a status but 200 or 400), so the
        /// issuer is rested rather than asked again.
        Resting = "resting",
    }
}

closed_set! {
    /// How the daemon authenticates to the issuer's introspection endpoint.
    pub enum ClientAuth {
        /// HTTP Basic with the form-encoded client id and secret (RFC 6749 §2.3.1).
        ClientSecretBasic = "client_secret_basic",
        /// `client_id` and `client_secret` in the form body.
        ClientSecretPost = "client_secret_post",
    }
}

closed_set! {
    /// What started a key-set refresh of the remote verifier.
    pub enum RefreshTrigger {
        /// The start-up load.
        Start = "start",
        /// The refresh schedule (the key server's `max-age`, within bounds).
        Schedule = "schedule",
        /// A token naming a key the set does not hold (or no set held at all).
        Token = "token",
        /// A reload: SIGHUP or `robota-mcpctl restart`.
        Reload = "reload",
        /// `robota-mcpctl keys refresh`.
        Operator = "operator",
    }
}

closed_set! {
    /// A part of the daemon that writes to the state directory (the `part` label, and
    /// `status.problems[].part`).
    pub enum StatePart {
        Audit = "audit",
        Store = "store",
    }
}

closed_set! {
    /// What a `notifications/cancelled` that arrived in its own HTTP request found (the
    /// `outcome` label of cancellations).
    pub enum CancelOutcome {
        /// The same caller's request with that id was in flight: it is cancelled.
        Matched = "matched",
        /// No request of that caller with that id was in flight (ended already, never
        /// sent, or another caller's id): nothing happens.
        Unmatched = "unmatched",
    }
}

closed_set! {
    /// An HTTP listener (the `listener` label).
    pub enum Listener {
        Loopback = "loopback",
        Remote = "remote",
        Metrics = "metrics",
    }
}

closed_set! {
    /// What became of a TCP connection at an HTTP listener.
    pub enum ConnOutcome {
        /// Given a slot.
        Accepted = "accepted",
        /// Listener (or its address) full with nothing idle to make room: refused at once.
        Refused = "refused",
        /// Idle (no complete request head) and the oldest when a newcomer needed its slot.
        Evicted = "evicted",
        /// No complete request head within `header_timeout` of accept.
        HeadTimeout = "head-timeout",
        /// No new request within the idle deadline after an answer.
        IdleTimeout = "idle-timeout",
        /// The peer took no byte of what it was sent for `idle_timeout`: closed.
        SendTimeout = "send-timeout",
        /// HTTP/2 ended it for a flood past its limits (GOAWAY `ENHANCE_YOUR_CALM`): a
        /// header block that never ends, streams reset faster than they are served, …
        Flood = "flood",
    }
}

closed_set! {
    /// Why an admitted request (or a `/metrics` request) got an HTTP error answer.
    /// Admission refusals are not here: they are audited and counted by [`Reason`].
    pub enum Rejection {
        /// 405: not POST (not GET/HEAD on `/metrics`).
        MethodNotAllowed = "method-not-allowed",
        /// 404: another path on the remote carrier or the metrics listener.
        NotFound = "not-found",
        /// 400: an `MCP-Protocol-Version` this daemon does not serve.
        UnsupportedVersion = "unsupported-version",
        /// 413: a body over the request limit, or too costly to parse.
        BodyTooLarge = "body-too-large",
        /// 408: the body did not arrive within `body_timeout`.
        BodyTimeout = "body-timeout",
        /// 400: the body stream broke off.
        BodyError = "body-error",
        /// 400, JSON-RPC -32700: not JSON (or duplicate object keys).
        ParseError = "parse-error",
        /// 400, JSON-RPC -32600: a batch, or not a JSON-RPC message.
        InvalidRequest = "invalid-request",
        /// 400, JSON-RPC -32602: `params` that is not an object.
        InvalidParams = "invalid-params",
        /// 503: every in-flight slot is taken.
        Busy = "busy",
        /// 503: the request-memory share a request needs is not free (at once, or for a
        /// declared body within `body_timeout`).
        MemoryBusy = "memory-busy",
        /// 503: the caller already holds its share of the in-flight slots
        /// (`max_in_flight_per_caller`).
        CallerBusy = "caller-busy",
        /// 431 on `/metrics` (the carriers audit theirs as the refusal `oversize`).
        HeadTooLarge = "head-too-large",
        /// 403 on a loopback `/metrics`: a `Host` that is not the listener's own address
        /// (DNS rebinding: a web page reading the metrics through a name of its own).
        WrongHost = "wrong-host",
        /// A 4xx from the MCP SDK: `Accept`/`Content-Type` (406, 415), protocol headers or
        /// per-request metadata (400), an unknown method (404).
        Protocol = "protocol",
    }
}

closed_set! {
    /// What the idempotency layer decided for a call that carried a key it had seen.
    pub enum Duplicate {
        /// Same key, same arguments, first call finished: its result again, no second effect.
        Replayed = "replayed",
        /// Same key, other arguments: refused (`invalid_arguments`).
        Mismatch = "mismatch",
        /// Same key while the first call still runs: `busy`.
        InProgress = "in-progress",
        /// Same key after the first call was cut off: its outcome is unknown.
        OutcomeUnknown = "outcome-unknown",
    }
}

/// The admitted identity behind a request. Policy, audit, jobs, grants and cancellation
/// key on it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Caller {
    /// stdio and `robota-mcpctl stdio`: the peer's uid.
    Local(u32),
    /// Loopback carrier: the bearer's label (`default` for the host bearer).
    Bearer(String),
    /// Remote carrier: OAuth client id and subject.
    OAuth { client_id: String, subject: String },
}

impl fmt::Display for Caller {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Caller::Local(uid) => write!(f, "local:{uid}"),
            Caller::Bearer(label) => write!(f, "bearer:{label}"),
            // `%` and `/` in the client id are escaped, so `oauth:a/b/c` has exactly one
            // reading (client `a`, subject `b/c`): grants, jobs and idempotency keys are
            // keyed by this text.
            Caller::OAuth { client_id, subject } => write!(
                f,
                "oauth:{}/{subject}",
                client_id.replace('%', "%25").replace('/', "%2F")
            ),
        }
    }
}

/// An admitted request: its caller, and the scopes of the access token it was admitted
/// with. Only the remote carrier admits by access token; every other caller has no token
/// (`scopes` is `None`), so no rule that requires scopes matches it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Admitted {
    pub caller: Caller,
    pub scopes: Option<Vec<String>>,
}

impl Admitted {
    /// A caller admitted with an access token carrying `scopes`.
    pub fn with_token(caller: Caller, scopes: Vec<String>) -> Self {
        Self {
            caller,
            scopes: Some(scopes),
        }
    }

    /// Whether the request's token carries every one of `required` (never, without a
    /// token).
    pub fn holds_scopes(&self, required: &[String]) -> bool {
        self.scopes
            .as_ref()
            .is_some_and(|held| required.iter().all(|r| held.contains(r)))
    }
}

impl From<Caller> for Admitted {
    /// A caller admitted without an access token (stdio, relay, loopback).
    fn from(caller: Caller) -> Self {
        Self {
            caller,
            scopes: None,
        }
    }
}

/// A durable job's id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct JobId(pub i64);

impl fmt::Display for JobId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// A grant's id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct GrantId(pub i64);

impl fmt::Display for GrantId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;

    /// Every closed set: members, their strings, and that the strings parse back.
    fn sets() -> Vec<Vec<(&'static str, bool)>> {
        fn of<T: Copy + PartialEq, const N: usize>(
            all: [T; N],
            name: fn(T) -> &'static str,
            parse: fn(&str) -> Option<T>,
        ) -> Vec<(&'static str, bool)> {
            all.into_iter()
                .map(|v| (name(v), parse(name(v)) == Some(v)))
                .collect()
        }
        vec![
            of(Carrier::ALL, Carrier::as_str, Carrier::parse),
            of(Reason::ALL, Reason::as_str, Reason::parse),
            of(AddressClass::ALL, AddressClass::as_str, AddressClass::parse),
            of(GrantEvent::ALL, GrantEvent::as_str, GrantEvent::parse),
            of(
                UpstreamEvent::ALL,
                UpstreamEvent::as_str,
                UpstreamEvent::parse,
            ),
            of(
                ToolErrorCode::ALL,
                ToolErrorCode::as_str,
                ToolErrorCode::parse,
            ),
            of(JobKind::ALL, JobKind::as_str, JobKind::parse),
            of(FetchOutcome::ALL, FetchOutcome::as_str, FetchOutcome::parse),
            of(
                IntrospectionOutcome::ALL,
                IntrospectionOutcome::as_str,
                IntrospectionOutcome::parse,
            ),
            of(ClientAuth::ALL, ClientAuth::as_str, ClientAuth::parse),
            of(
                RefreshTrigger::ALL,
                RefreshTrigger::as_str,
                RefreshTrigger::parse,
            ),
            of(Listener::ALL, Listener::as_str, Listener::parse),
            of(ConnOutcome::ALL, ConnOutcome::as_str, ConnOutcome::parse),
            of(Rejection::ALL, Rejection::as_str, Rejection::parse),
            of(Duplicate::ALL, Duplicate::as_str, Duplicate::parse),
            of(UpstreamKind::ALL, UpstreamKind::as_str, UpstreamKind::parse),
            of(
                UpstreamState::ALL,
                UpstreamState::as_str,
                UpstreamState::parse,
            ),
        ]
    }

    #[test]
    fn each_member_has_one_unique_string_that_parses_back() {
        for set in sets() {
            assert!(!set.is_empty());
            let strings: HashSet<_> = set.iter().map(|(s, _)| *s).collect();
            assert_eq!(strings.len(), set.len(), "{set:?}");
            assert!(set.iter().all(|(_, back)| *back), "{set:?}");
        }
        assert_eq!(Reason::parse("no-such-reason"), None);
    }

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
    fn ipv6_clients_are_grouped_by_their_prefix() {
        let ip = |s: &str| -> IpAddr { s.parse().unwrap() };
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
    fn caller_identities_render_as_policy_writes_them() {
        assert_eq!(Caller::Local(1000).to_string(), "local:1000");
        assert_eq!(
            Caller::Bearer("default".into()).to_string(),
            "bearer:default"
        );
        let c = Caller::OAuth {
            client_id: "client-a".into(),
            subject: "alice".into(),
        };
        assert_eq!(c.to_string(), "oauth:client-a/alice");
        // A `/` in the client id cannot make two principals one identity.
        let a = Caller::OAuth {
            client_id: "a/b".into(),
            subject: "c".into(),
        };
        let b = Caller::OAuth {
            client_id: "a".into(),
            subject: "b/c".into(),
        };
        assert_ne!(a.to_string(), b.to_string());
        assert_eq!(a.to_string(), "oauth:a%2Fb/c");
    }
}
