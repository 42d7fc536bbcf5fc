//! Built-in deterministic invariants (seed 002): checked last, after the rules, capabilities
//! and approval gates allowed a call; the first violated one denies it with its kind as the
//! rule id. `ast_validation_passed` and `linter_passed` check Python source (see
//! [`crate::python`]); a finding names its line and rule code in the reason.

use serde_json::Value;
use warden_config::InvariantConfig;

use crate::python::Lint;
use crate::rules::{RuleDecision, Verdict, matches};

/// Findings listed in a reason; the rest are counted.
const LISTED: usize = 5;

/// `parsed`: fields already found to parse in this decision (each is parsed once).
async fn python(
    field: &str,
    args: &Value,
    lint: Option<Lint>,
    parsed: &mut Vec<String>,
) -> Option<(&'static str, String)> {
    let rule = if lint.is_some() { "linter_passed" } else { "ast_validation_passed" };
    let Some(src) = args.get(field).and_then(Value::as_str) else {
        return Some((rule, format!("'{field}' must be a string of Python source")));
    };
    let known = parsed.iter().any(|f| f == field);
    let found = match crate::python::analyze(src.to_string(), lint, known).await {
        Ok(found) => found,
        Err(e) => return Some((rule, format!("'{field}' could not be checked: {e}"))),
    };
    if !found.iter().any(|f| f.code == "E999") && !known {
        parsed.push(field.to_string());
    }
    let first = found.first()?;
    if first.code == "E999" {
        return Some((rule, format!("'{field}' is not valid Python: {first}")));
    }
    let mut listed: Vec<String> = found.iter().take(LISTED).map(ToString::to_string).collect();
    if found.len() > LISTED {
        listed.push(format!("and {} more", found.len() - LISTED));
    }
    Some((rule, format!("'{field}' fails lint: {}", listed.join("; "))))
}

async fn violated(inv: &InvariantConfig, args: &Value, parsed: &mut Vec<String>) -> Option<(&'static str, String)> {
    let text = |field: &str| args.get(field).and_then(Value::as_str).map(str::to_string);
    match inv {
        InvariantConfig::AstValidationPassed { field, .. } => python(field, args, None, parsed).await,
        InvariantConfig::LinterPassed { field, select, max_line_length, .. } => {
            python(field, args, Some(Lint { select: select.clone(), max_line_length: *max_line_length }), parsed).await
        }
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
        | InvariantConfig::CustomJsonRule { tool, .. }
        | InvariantConfig::AstValidationPassed { tool, .. }
        | InvariantConfig::LinterPassed { tool, .. } => tool,
    }
}

/// Refuses a configuration the invariants cannot apply (an unknown lint rule).
pub fn validate(invariants: &[InvariantConfig]) -> Result<(), String> {
    for inv in invariants {
        if let InvariantConfig::LinterPassed { select, max_line_length, .. } = inv {
            crate::python::check_select(select).map_err(|e| format!("policy.invariants linter_passed: {e}"))?;
            if *max_line_length == 0 {
                return Err("policy.invariants linter_passed: max_line_length must be greater than zero".into());
            }
        }
    }
    Ok(())
}

/// Applies the invariants of `tool` to an allow; other outcomes pass through unchanged.
pub async fn check(invariants: &[InvariantConfig], tool: &str, args: &Value, decision: RuleDecision) -> RuleDecision {
    if decision.verdict != Verdict::Allow {
        return decision;
    }
    let mut parsed = Vec::new();
    for inv in invariants.iter().filter(|i| matches(tool_of(i), tool)) {
        if let Some((rule, reason)) = violated(inv, args, &mut parsed).await {
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

    #[tokio::test]
    async fn each_invariant_denies_what_it_should() {
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
            InvariantConfig::AstValidationPassed { tool: "py.*".into(), field: "code".into() },
            InvariantConfig::LinterPassed {
                tool: "py.run".into(),
                field: "code".into(),
                select: vec![],
                max_line_length: 79,
            },
        ];
        let decide = async |tool: &str, args: Value| check(&invs, tool, &args, allow()).await;
        let rule = async |tool: &str, args: Value| decide(tool, args).await.rule_id;
        assert_eq!(rule("deploy", json!({"tests_passed": true})).await, "r");
        assert_eq!(rule("deploy", json!({"tests_passed": "yes"})).await, "required_arg_true");
        assert_eq!(rule("email.send", json!({"to": "ops@example.com"})).await, "r");
        assert_eq!(rule("email.send", json!({"to": "x@evil.test"})).await, "email_domain_allowlist");
        assert_eq!(rule("email.send", json!({"to": "dev@example.com"})).await, "recipient_must_be_verified");
        assert_eq!(rule("pay", json!({"amount": 99.5})).await, "r");
        assert_eq!(rule("pay", json!({"amount": 101})).await, "custom_json_rule");
        assert_eq!(rule("pay", json!({})).await, "custom_json_rule");
        assert_eq!(rule("echo", json!({})).await, "r");
        let denied = RuleDecision { verdict: Verdict::Deny, rule_id: "d".into(), reason: String::new() };
        assert_eq!(check(&invs, "pay", &json!({"amount": 1}), denied).await.rule_id, "d");
        assert_eq!(rule("py.lint", json!({"code": "x = eval(s)\n"})).await, "r", "syntax only");
        assert_eq!(rule("py.lint", json!({"code": 7})).await, "ast_validation_passed");
        let d = decide("py.lint", json!({"code": "x = 1\nprint 'a'\n"})).await;
        assert_eq!(d.rule_id, "ast_validation_passed");
        assert!(d.reason.contains("line 2: E999"), "{}", d.reason);
        assert_eq!(rule("py.run", json!({"code": "def f():\n    return 1\n"})).await, "r");
        let d = decide("py.run", json!({"code": "try:\n    x = eval(s)\nexcept:\n    pass\n"})).await;
        assert_eq!(d.rule_id, "linter_passed");
        assert!(d.reason.contains("line 2: S307") && d.reason.contains("line 3: E722"), "{}", d.reason);
        let many = "x = 1 \n".repeat(8);
        let d = decide("py.run", json!({"code": many})).await;
        assert!(d.reason.ends_with("and 3 more"), "{}", d.reason);
    }

    #[test]
    fn unknown_lint_rules_are_refused_at_load() {
        let inv = |select: &[&str]| InvariantConfig::LinterPassed {
            tool: "py".into(),
            field: "code".into(),
            select: select.iter().map(|s| s.to_string()).collect(),
            max_line_length: 80,
        };
        assert!(validate(&[inv(&["E722"])]).is_ok());
        assert!(validate(&[inv(&["E7"])]).unwrap_err().contains("unknown lint rule 'E7'"));
    }
}
