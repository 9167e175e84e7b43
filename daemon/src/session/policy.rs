//! The session permission wrapper's rules: decides every call without prompting.
//!
//! Rules come from `[[policy]]` in order; the first rule whose caller pattern, scope
//! requirement and tool pattern all match decides. With no match, read-only (and
//! self-service) tools are allowed and everything else is denied. A rule with `scopes`
//! matches only a caller admitted with an access token carrying all of them, so callers
//! without a token (stdio, the relay, loopback bearers) never match it. What `grant` and
//! `approve-each` need — a covering grant, an approval of the exact call — is checked by
//! the session (docs/design.md §2.9).

use crate::config::{Decision, PolicyRule};

use super::ToolError;
use crate::vocab::{Admitted, Caller, ToolErrorCode};

/// Ordered policy rules.
#[derive(Debug, Clone, Default)]
pub struct Policy {
    rules: Vec<PolicyRule>,
}

impl Policy {
    pub fn new(rules: Vec<PolicyRule>) -> Self {
        Self { rules }
    }

    /// The decision for `admitted` calling the tool with canonical name `tool`: the first
    /// matching rule's; with none, `allow` when `default_allowed` (read-only and
    /// self-service tools), else `deny`.
    pub fn decide(&self, admitted: &Admitted, tool: &str, default_allowed: bool) -> Decision {
        let caller_text = admitted.caller.to_string();
        self.rules
            .iter()
            .find(|rule| {
                rule.callers
                    .iter()
                    .any(|p| crate::config::caller_matches(p, &caller_text))
                    && (rule.scopes.is_empty() || admitted.holds_scopes(&rule.scopes))
                    && rule.tools.iter().any(|p| glob_match::glob_match(p, tool))
            })
            .map(|rule| rule.decision)
            .unwrap_or(if default_allowed {
                Decision::Allow
            } else {
                Decision::Deny
            })
    }
}

/// `permission_denied` for a call policy does not allow.
pub fn denied(caller: &Caller, tool: &str) -> ToolError {
    ToolError::new(
        ToolErrorCode::PermissionDenied,
        format!("policy does not allow {caller} to call {tool}"),
    )
}

/// `interactive_permission_required` for a call behind `grant` without a covering grant.
pub fn needs_grant(caller: &Caller, tool: &str) -> ToolError {
    ToolError::new(
        ToolErrorCode::InteractivePermissionRequired,
        format!(
            "{tool} needs an operator-approved grant for {caller}: ask with \
             permissions.request_elevation (scope [\"{tool}\"]) or \
             permissions.request_root_access, then wait for an operator to approve it"
        ),
    )
}

/// `interactive_permission_required` for a call behind `approve-each`: approval `id`
/// waits for an operator.
pub fn needs_approval(tool: &str, id: i64) -> ToolError {
    ToolError::new(
        ToolErrorCode::InteractivePermissionRequired,
        format!(
            "{tool} needs an operator's approval of this exact call: approval {id} is \
             pending (an operator runs `robota-mcpctl grants show {id}`, then `robota-mcpctl \
             grants approve {id}`); once it is approved, send the identical call again — \
             same tool, same arguments — and it runs once"
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::check_caller_pattern;

    fn rule(callers: &[&str], tools: &[&str], decision: Decision) -> PolicyRule {
        PolicyRule {
            callers: callers.iter().map(|s| s.to_string()).collect(),
            scopes: Vec::new(),
            tools: tools.iter().map(|s| s.to_string()).collect(),
            decision,
        }
    }

    /// The decision for a caller without a token.
    fn of(p: &Policy, caller: &Caller, tool: &str, default_allowed: bool) -> Decision {
        p.decide(&Admitted::from(caller.clone()), tool, default_allowed)
    }

    #[test]
    fn defaults_allow_read_only_and_deny_the_rest() {
        let p = Policy::default();
        let c = Caller::Bearer("default".into());
        assert_eq!(of(&p, &c, "system.info", true), Decision::Allow);
        assert_eq!(of(&p, &c, "file.write", false), Decision::Deny);
    }

    #[test]
    fn first_matching_rule_wins() {
        let p = Policy::new(vec![
            rule(&["bearer:ci"], &["file.write"], Decision::Deny),
            rule(
                &["bearer:*", "oauth:client-a/*"],
                &["file.write", "service.*"],
                Decision::Grant,
            ),
            rule(&["*"], &["system.*"], Decision::Deny),
            rule(&["local:0"], &["*"], Decision::Allow),
        ]);
        let ci = Caller::Bearer("ci".into());
        let other = Caller::Bearer("other".into());
        let oauth = Caller::OAuth {
            client_id: "client-a".into(),
            subject: "alice".into(),
        };
        assert_eq!(of(&p, &ci, "file.write", false), Decision::Deny);
        assert_eq!(of(&p, &other, "file.write", false), Decision::Grant);
        assert_eq!(of(&p, &oauth, "service.action", false), Decision::Grant);
        assert_eq!(
            of(&p, &Caller::Local(0), "system.info", true),
            Decision::Deny
        );
        assert_eq!(
            of(&p, &Caller::Local(0), "file.write", false),
            Decision::Allow
        );
        assert_eq!(
            of(&p, &Caller::Local(1000), "file.write", false),
            Decision::Deny
        );
        // `*` is every caller, remote ones (whose text holds a `/`) included.
        let deny_all = Policy::new(vec![rule(&["*"], &["system.info"], Decision::Deny)]);
        assert_eq!(of(&deny_all, &oauth, "system.info", true), Decision::Deny);
        let deny_oauth = Policy::new(vec![rule(&["oauth:*"], &["system.info"], Decision::Deny)]);
        assert_eq!(of(&deny_oauth, &oauth, "system.info", true), Decision::Deny);
        assert_eq!(of(&deny_oauth, &ci, "system.info", true), Decision::Allow);
    }

    #[test]
    fn scope_rules_match_only_tokens_that_carry_every_scope() {
        let mut admin = rule(&["*"], &["service.*"], Decision::ApproveEach);
        admin.scopes = vec!["mcp:admin".into(), "mcp:ops".into()];
        let p = Policy::new(vec![admin, rule(&["*"], &["service.*"], Decision::Deny)]);
        let alice = Caller::OAuth {
            client_id: "client-a".into(),
            subject: "alice".into(),
        };
        let with = |scopes: &[&str]| {
            Admitted::with_token(
                alice.clone(),
                scopes.iter().map(|s| s.to_string()).collect(),
            )
        };
        assert_eq!(
            p.decide(
                &with(&["mcp:admin", "mcp:ops", "x"]),
                "service.action",
                false
            ),
            Decision::ApproveEach
        );
        assert_eq!(
            p.decide(&with(&["mcp:admin"]), "service.action", false),
            Decision::Deny,
            "one scope of two is not enough"
        );
        assert_eq!(
            p.decide(&with(&[]), "service.action", false),
            Decision::Deny
        );
        // Without a token, whatever the identity: never.
        for caller in [
            Caller::Local(0),
            Caller::Bearer("default".into()),
            alice.clone(),
        ] {
            assert_eq!(of(&p, &caller, "service.action", false), Decision::Deny);
        }
        assert_eq!(
            p.decide(&with(&["mcp:admin", "mcp:ops"]), "system.info", true),
            Decision::Allow,
            "the tool pattern must match too"
        );
    }

    #[test]
    fn caller_patterns_are_checked() {
        for ok in [
            "*",
            "local:0",
            "local:*",
            "bearer:ci",
            "bearer:*",
            "oauth:client-a/*",
            "oauth:*",
        ] {
            assert!(check_caller_pattern(ok).is_ok(), "{ok}");
        }
        for bad in ["root", "local:alice", "bearer:", "oauth:client-a", "unix:0"] {
            assert!(check_caller_pattern(bad).is_err(), "{bad}");
        }
    }
}
