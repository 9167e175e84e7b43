//! The session permission wrapper: decides every call without prompting.
//!
//! Rules come from `[[policy]]` in order; the first rule whose caller pattern and tool
//! pattern both match decides. With no match, read-only tools are allowed and everything
//! else is denied. `grant` means "needs an operator-approved grant", which is answered
//! `interactive_permission_required` until grants exist for the caller.

use crate::config::{Decision, PolicyRule};

use super::ToolError;
use crate::vocab::{Caller, ToolErrorCode};

/// Ordered policy rules.
#[derive(Debug, Clone, Default)]
pub struct Policy {
    rules: Vec<PolicyRule>,
}

impl Policy {
    pub fn new(rules: Vec<PolicyRule>) -> Self {
        Self { rules }
    }

    /// Decide whether `caller` may call the tool with canonical name `tool`; with no
    /// matching rule, `default_allowed` (read-only and self-service tools) decides.
    pub fn decide(
        &self,
        caller: &Caller,
        tool: &str,
        default_allowed: bool,
    ) -> Result<(), ToolError> {
        let caller_text = caller.to_string();
        let decision = self
            .rules
            .iter()
            .find(|rule| {
                rule.callers
                    .iter()
                    .any(|p| glob_match::glob_match(p, &caller_text))
                    && rule.tools.iter().any(|p| glob_match::glob_match(p, tool))
            })
            .map(|rule| rule.decision)
            .unwrap_or(if default_allowed {
                Decision::Allow
            } else {
                Decision::Deny
            });
        match decision {
            Decision::Allow => Ok(()),
            Decision::Deny => Err(ToolError::new(
                ToolErrorCode::PermissionDenied,
                format!("policy does not allow {caller_text} to call {tool}"),
            )),
            Decision::Grant => Err(ToolError::new(
                ToolErrorCode::InteractivePermissionRequired,
                format!(
                    "{tool} needs an operator-approved grant for {caller_text}: ask with \
                     permissions.request_elevation (scope [\"{tool}\"]) or \
                     permissions.request_root_access, then wait for an operator to approve it"
                ),
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::check_caller_pattern;

    fn rule(callers: &[&str], tools: &[&str], decision: Decision) -> PolicyRule {
        PolicyRule {
            callers: callers.iter().map(|s| s.to_string()).collect(),
            tools: tools.iter().map(|s| s.to_string()).collect(),
            decision,
        }
    }

    fn code(r: Result<(), ToolError>) -> Option<ToolErrorCode> {
        r.err().map(|e| e.code)
    }

    #[test]
    fn defaults_allow_read_only_and_deny_the_rest() {
        let p = Policy::default();
        let c = Caller::Bearer("default".into());
        assert_eq!(code(p.decide(&c, "system.info", true)), None);
        assert_eq!(
            code(p.decide(&c, "file.write", false)),
            Some(ToolErrorCode::PermissionDenied)
        );
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
        assert_eq!(
            code(p.decide(&ci, "file.write", false)),
            Some(ToolErrorCode::PermissionDenied)
        );
        assert_eq!(
            code(p.decide(&other, "file.write", false)),
            Some(ToolErrorCode::InteractivePermissionRequired)
        );
        assert_eq!(
            code(p.decide(&oauth, "service.action", false)),
            Some(ToolErrorCode::InteractivePermissionRequired)
        );
        assert_eq!(
            code(p.decide(&Caller::Local(0), "system.info", true)),
            Some(ToolErrorCode::PermissionDenied)
        );
        assert_eq!(code(p.decide(&Caller::Local(0), "file.write", false)), None);
        assert_eq!(
            code(p.decide(&Caller::Local(1000), "file.write", false)),
            Some(ToolErrorCode::PermissionDenied)
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
