//! Built-in deterministic invariants (seed 002): checked last, after the rules, capabilities
//! and approval gates allowed a call; the first violated one denies it with its kind as the
//! rule id. `ast_validation_passed` and `linter_passed` are not offered yet.

use serde_json::Value;
use warden_config::InvariantConfig;

use crate::rules::{RuleDecision, Verdict, matches};

fn violated(inv: &InvariantConfig, args: &Value) -> Option<(&'static str, String)> {
    let text = |field: &str| args.get(field).and_then(Value::as_str).map(str::to_string);
    match inv {
        InvariantConfig::RequiredArgTrue { field, .. } => (args.get(field) != Some(&Value::Bool(true)))
            .then(|| ("required_arg_true", format!("'{field}' must be true"))),
        InvariantConfig::EmailDomainAllowlist { field, domains, .. } => {
            let domain = text(field).and_then(|to| to.rsplit_once('@').map(|(_, d)| d.to_ascii_lowercase()));
            let ok = domain.as_ref().is_some_and(|d| domains.iter().any(|x| x.eq_ignore_ascii_case(d)));
            (!ok).then(|| ("email_domain_allowlist", format!("'{field}' must be an address at {}", domains.join(", "))))
        }
        InvariantConfig::RecipientMustBeVerified { field, verified, .. } => {
            let ok = text(field).is_some_and(|to| verified.iter().any(|v| v.eq_ignore_ascii_case(&to)));
            (!ok).then(|| ("recipient_must_be_verified", format!("'{field}' is not a verified recipient")))
        }
        InvariantConfig::CustomJsonRule { field, op, value, .. } => {
            let have = args.get(field);
            let num = |v: Option<&Value>| v.and_then(Value::as_f64);
            let ok = match op.as_str() {
                "eq" => have == Some(value),
                "ne" => have != Some(value),
                "lt" => num(have).zip(value.as_f64()).is_some_and(|(a, b)| a < b),
                "lte" => num(have).zip(value.as_f64()).is_some_and(|(a, b)| a <= b),
                "gt" => num(have).zip(value.as_f64()).is_some_and(|(a, b)| a > b),
                "gte" => num(have).zip(value.as_f64()).is_some_and(|(a, b)| a >= b),
                "in" => value.as_array().is_some_and(|vs| have.is_some_and(|h| vs.contains(h))),
                _ => false,
            };
            (!ok).then(|| ("custom_json_rule", format!("'{field}' {op} {value} does not hold")))
        }
    }
}

fn tool_of(inv: &InvariantConfig) -> &str {
    match inv {
        InvariantConfig::RequiredArgTrue { tool, .. }
        | InvariantConfig::EmailDomainAllowlist { tool, .. }
        | InvariantConfig::RecipientMustBeVerified { tool, .. }
        | InvariantConfig::CustomJsonRule { tool, .. } => tool,
    }
}

/// Applies the invariants of `tool` to an allow; other outcomes pass through unchanged.
pub fn check(invariants: &[InvariantConfig], tool: &str, args: &Value, decision: RuleDecision) -> RuleDecision {
    if decision.verdict != Verdict::Allow {
        return decision;
    }
    for inv in invariants.iter().filter(|i| matches(tool_of(i), tool)) {
        if let Some((rule, reason)) = violated(inv, args) {
            return RuleDecision { verdict: Verdict::Deny, rule_id: rule.into(), reason };
        }
    }
    decision
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn allow() -> RuleDecision {
        RuleDecision { verdict: Verdict::Allow, rule_id: "r".into(), reason: String::new() }
    }

    #[test]
    fn each_invariant_denies_what_it_should() {
        let invs = vec![
            InvariantConfig::RequiredArgTrue { tool: "deploy".into(), field: "tests_passed".into() },
            InvariantConfig::EmailDomainAllowlist {
                tool: "email.*".into(),
                field: "to".into(),
                domains: vec!["example.com".into()],
            },
            InvariantConfig::RecipientMustBeVerified {
                tool: "email.send".into(),
                field: "to".into(),
                verified: vec!["ops@example.com".into()],
            },
            InvariantConfig::CustomJsonRule {
                tool: "pay".into(),
                field: "amount".into(),
                op: "lte".into(),
                value: json!(100),
            },
        ];
        let rule = |tool: &str, args: Value| check(&invs, tool, &args, allow()).rule_id;
        assert_eq!(rule("deploy", json!({"tests_passed": true})), "r");
        assert_eq!(rule("deploy", json!({"tests_passed": "yes"})), "required_arg_true");
        assert_eq!(rule("email.send", json!({"to": "ops@example.com"})), "r");
        assert_eq!(rule("email.send", json!({"to": "x@evil.test"})), "email_domain_allowlist");
        assert_eq!(rule("email.send", json!({"to": "dev@example.com"})), "recipient_must_be_verified");
        assert_eq!(rule("pay", json!({"amount": 99.5})), "r");
        assert_eq!(rule("pay", json!({"amount": 101})), "custom_json_rule");
        assert_eq!(rule("pay", json!({})), "custom_json_rule");
        assert_eq!(rule("echo", json!({})), "r");
        let denied = RuleDecision { verdict: Verdict::Deny, rule_id: "d".into(), reason: String::new() };
        assert_eq!(check(&invs, "pay", &json!({"amount": 1}), denied).rule_id, "d");
    }
}
