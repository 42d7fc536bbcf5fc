//! The decision rules: enforced mode denies by default; a tenant may call the tools its
//! allowlist names (exact names or a trailing-`*` prefix). Permissive mode records what
//! enforced mode would have decided and allows.

use warden_config::{PolicyConfig, PolicyMode};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Allow,
    Deny,
    /// Allowed once a human approves these exact arguments.
    ApprovalRequired,
}

impl Verdict {
    pub fn as_str(self) -> &'static str {
        match self {
            Verdict::Allow => "allow",
            Verdict::Deny => "deny",
            Verdict::ApprovalRequired => "approval_required",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuleDecision {
    pub verdict: Verdict,
    pub rule_id: String,
    pub reason: String,
}

pub fn matches(pattern: &str, tool: &str) -> bool {
    match pattern.strip_suffix('*') {
        Some(prefix) => tool.starts_with(prefix),
        None => pattern == tool,
    }
}

/// Decides whether `tenant` may call `tool`.
pub fn decide(config: &PolicyConfig, tenant: &str, tool: &str) -> RuleDecision {
    let allowed = config.tenants.get(tenant).and_then(|t| t.allow_tools.iter().find(|p| matches(p, tool)));
    let enforced = match allowed {
        Some(pattern) => RuleDecision {
            verdict: Verdict::Allow,
            rule_id: "tenant_allowlist".into(),
            reason: format!("tenant '{tenant}' may call '{tool}' (allow_tools entry '{pattern}')"),
        },
        None => RuleDecision {
            verdict: Verdict::Deny,
            rule_id: "default_deny".into(),
            reason: format!("no rule allows tenant '{tenant}' to call '{tool}'"),
        },
    };
    apply_mode(config.mode, enforced)
}

/// Permissive mode turns a deny into an allow that says what enforced mode would have done.
pub fn apply_mode(mode: PolicyMode, enforced: RuleDecision) -> RuleDecision {
    match (mode, enforced.verdict) {
        (PolicyMode::Permissive, Verdict::Deny) => RuleDecision {
            verdict: Verdict::Allow,
            rule_id: "permissive_mode".into(),
            reason: format!("permissive mode; enforced mode would deny ({}): {}", enforced.rule_id, enforced.reason),
        },
        _ => enforced,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use warden_config::TenantPolicy;

    fn config(mode: PolicyMode) -> PolicyConfig {
        let mut c = PolicyConfig { mode, ..PolicyConfig::default() };
        c.tenants.insert(
            "acme".into(),
            TenantPolicy { allow_tools: vec!["echo".into(), "kv.*".into()], ..Default::default() },
        );
        c
    }

    #[test]
    fn enforced_mode_denies_by_default() {
        let c = config(PolicyMode::Enforced);
        assert_eq!(decide(&c, "acme", "echo").verdict, Verdict::Allow);
        assert_eq!(decide(&c, "acme", "kv.put").verdict, Verdict::Allow);
        let d = decide(&c, "acme", "email.send");
        assert_eq!((d.verdict, d.rule_id.as_str()), (Verdict::Deny, "default_deny"));
        assert_eq!(decide(&c, "other", "echo").verdict, Verdict::Deny);
        assert_eq!(decide(&c, "acme", "echo2").verdict, Verdict::Deny);
    }

    #[test]
    fn permissive_mode_allows_and_says_so() {
        let d = decide(&config(PolicyMode::Permissive), "other", "echo");
        assert_eq!((d.verdict, d.rule_id.as_str()), (Verdict::Allow, "permissive_mode"));
        assert!(d.reason.contains("would deny"));
    }
}
