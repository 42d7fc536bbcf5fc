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
        InvariantConfig::EmailDomainAllowlist { field, domains, allow_multiple, .. } => {
            let refused = match args.get(field).and_then(Value::as_str) {
                None => Some("must be a string".to_string()),
                Some(to) => match recipients(to, *allow_multiple) {
                    Err(e) => Some(e.to_string()),
                    Ok(list) => list
                        .iter()
                        .find(|a| !domains.iter().any(|d| d.eq_ignore_ascii_case(&a.domain)))
                        .map(|a| format!("address '{a}' is not at {}", domains.join(", "))),
                },
            };
            refused.map(|why| ("email_domain_allowlist", format!("'{field}' {why}")))
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

/// One addr-spec of a recipient field, as a mail transfer agent would route it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Address {
    local: String,
    domain: String,
}

impl std::fmt::Display for Address {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}@{}", self.local, self.domain)
    }
}

/// Why a recipient field is refused. Raw input is never echoed where it may hold control
/// characters, so a reason cannot carry an injection into logs or the ledger.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
enum AddressError {
    #[error("contains a control character (U+{0:04X}); header injection is refused")]
    ControlCharacter(u32),
    #[error("is not an RFC 5322 address: {0}")]
    Unparsable(String),
    #[error("names no address")]
    Empty,
    #[error("is an address list ({0}); one address is allowed")]
    Multiple(String),
    #[error("address '{0}' is not a plain local@domain address")]
    NotPlain(String),
}

/// RFC 5322 `atext`, less `%` and `!`: those route mail onwards from the named domain (the
/// percent hack, bang paths), so an address using them could leave an allowed domain.
fn local_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || "#$&'*+-/=?^_`{|}~".contains(c)
}

/// A dot-atom local part `@` a domain of letters, digits, `-` and `.`: the only shape whose
/// destination is plainly its domain. Quoted local parts, domain literals (`[1.2.3.4]`),
/// source routes (`@relay:user@host`) and internationalized addresses are refused rather
/// than interpreted.
fn plain(addr: &str) -> Result<Address, AddressError> {
    let not_plain = || AddressError::NotPlain(addr.to_string());
    let (local, domain) = addr.split_once('@').ok_or_else(not_plain)?;
    let atoms_ok =
        |s: &str, ok: fn(char) -> bool| !s.is_empty() && s.split('.').all(|a| !a.is_empty() && a.chars().all(ok));
    if !atoms_ok(local, local_char) || !atoms_ok(domain, |c| c.is_ascii_alphanumeric() || c == '-') {
        return Err(not_plain());
    }
    Ok(Address { local: local.to_string(), domain: domain.to_string() })
}

/// The addresses a recipient field sends to, parsed as an RFC 5322 `address-list` by
/// `mailparse::addrparse` — a long-lived, widely used parser with few dependencies
/// (`lettre` parses strictly too but brings a whole mail stack; `email_address` and
/// `email-address-parser` parse single addresses only, so they cannot see a list). It
/// knows display names (`"Ok" <ok@example.com>` is one address), comments, quoting and
/// groups, and splits lists on `,` (and leniently on `;`).
///
/// Because that parser is lenient, its result is checked, never trusted: control characters
/// (CR/LF header injection included) are refused before parsing, a list or a group is
/// refused unless `allow_multiple`, and every address must be [`plain`] — leftovers of a
/// lenient parse such as `a@x.com b@y.com` or `a@b@c` are not.
fn recipients(text: &str, allow_multiple: bool) -> Result<Vec<Address>, AddressError> {
    // Unicode line and paragraph separators too: some mail software breaks lines on them.
    if let Some(c) = text.chars().find(|c| c.is_control() || matches!(c, '\u{2028}' | '\u{2029}')) {
        return Err(AddressError::ControlCharacter(c.into()));
    }
    let parsed = mailparse::addrparse(text).map_err(|e| AddressError::Unparsable(e.to_string()))?;
    let mut addrs = Vec::new();
    let mut groups = 0;
    for item in parsed.iter() {
        match item {
            mailparse::MailAddr::Single(one) => addrs.push(one.addr.as_str()),
            mailparse::MailAddr::Group(group) => {
                groups += 1;
                addrs.extend(group.addrs.iter().map(|one| one.addr.as_str()));
            }
        }
    }
    if !allow_multiple && (addrs.len() > 1 || groups > 0) {
        let what = if groups > 0 { "a group".to_string() } else { format!("{} addresses", addrs.len()) };
        return Err(AddressError::Multiple(what));
    }
    if addrs.is_empty() {
        return Err(AddressError::Empty);
    }
    addrs.into_iter().map(plain).collect()
}

/// Refuses an allowlist entry that no address could match as intended: domains are compared
/// exactly (ASCII case-insensitive), so they must be written as plain host names.
fn check_domains(domains: &[String]) -> Result<(), String> {
    if domains.is_empty() {
        return Err("policy.invariants email_domain_allowlist: domains must not be empty".into());
    }
    for d in domains {
        if plain(&format!("x@{d}")).is_err() {
            return Err(format!(
                "policy.invariants email_domain_allowlist: '{d}' is not a plain domain name \
                 (letters, digits, '-' and '.'; IDNs in punycode; no '@')"
            ));
        }
    }
    Ok(())
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
        if let InvariantConfig::EmailDomainAllowlist { domains, .. } = inv {
            check_domains(domains)?;
        }
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
                allow_multiple: false,
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

    fn allowlist(allow_multiple: bool) -> Vec<InvariantConfig> {
        vec![InvariantConfig::EmailDomainAllowlist {
            tool: "email.send".into(),
            field: "to".into(),
            domains: vec!["example.com".into(), "Example.ORG".into()],
            allow_multiple,
        }]
    }

    async fn mail_decision(invs: &[InvariantConfig], to: Value) -> RuleDecision {
        check(invs, "email.send", &json!({"to": to, "subject": "s", "body": "b"}), allow()).await
    }

    #[track_caller]
    fn assert_denied(d: &RuleDecision, mentions: &str) {
        assert_eq!(d.rule_id, "email_domain_allowlist", "{d:?}");
        assert_eq!(d.verdict, Verdict::Deny);
        assert!(d.reason.contains(mentions), "reason should mention {mentions:?}: {}", d.reason);
    }

    #[tokio::test]
    async fn email_domain_allowlist_refuses_a_comma_list_hiding_a_foreign_address() {
        let single = allowlist(false);
        let d = mail_decision(&single, json!("evil@evil.com,ok@example.com")).await;
        assert_denied(&d, "address list (2 addresses)");
        // Allowed lists are still checked address by address, whichever comes last.
        let d = mail_decision(&allowlist(true), json!("evil@evil.com,ok@example.com")).await;
        assert_denied(&d, "'evil@evil.com' is not at example.com");
    }

    #[tokio::test]
    async fn email_domain_allowlist_refuses_a_semicolon_list_hiding_a_foreign_address() {
        assert_denied(&mail_decision(&allowlist(false), json!("evil@evil.com;ok@example.com")).await, "address list");
        let d = mail_decision(&allowlist(true), json!("ok@example.com; evil@evil.com")).await;
        assert_denied(&d, "'evil@evil.com'");
    }

    #[tokio::test]
    async fn email_domain_allowlist_refuses_crlf_header_injection() {
        // Each ends at an allowed domain, as a bypass of a last-'@' check would.
        for to in [
            "evil@evil.com\r\nBcc: ok@example.com",
            "ok@example.com\r\nBcc: evil@evil.com\r\nX-Note: ok@example.com",
            "evil@evil.com\nBcc: ok@example.com",
            "evil@evil.com\rBcc: ok@example.com",
            "evil@evil.com\u{0}ok@example.com",
            "evil@evil.com\tok@example.com",
            "evil@evil.com\u{2028}Bcc: ok@example.com",
        ] {
            for multiple in [false, true] {
                assert_denied(&mail_decision(&allowlist(multiple), json!(to)).await, "control character");
            }
        }
    }

    #[tokio::test]
    async fn email_domain_allowlist_refuses_groups_unless_lists_are_allowed() {
        let group = json!("team: a@example.com, b@example.org;");
        assert_denied(&mail_decision(&allowlist(false), group.clone()).await, "a group");
        assert_eq!(mail_decision(&allowlist(true), group).await.rule_id, "r");
        let d = mail_decision(&allowlist(true), json!("team: a@example.com, x@evil.com;")).await;
        assert_denied(&d, "'x@evil.com'");
        assert_denied(&mail_decision(&allowlist(true), json!("undisclosed:;")).await, "names no address");
    }

    #[tokio::test]
    async fn email_domain_allowlist_matches_domains_exactly_and_refuses_odd_addresses() {
        let single = allowlist(false);
        for (to, mentions) in [
            ("ok@sub.example.com", "'ok@sub.example.com' is not at"),
            ("ok@example.com.evil.com", "is not at"),
            ("ok@example.com.", "not a plain"),
            ("ok@evil-example.com", "is not at"),
            ("ok@example.com evil@evil.com", "not a plain"),
            ("a@evil.com@example.com", "not a plain"),
            ("<@evil.com:ok@example.com>", "not a plain"),
            ("evil%evil.com@example.com", "not a plain"),
            ("ok@[192.0.2.1]", "not a plain"),
            ("ok@example.com>", "not a plain"),
            ("\"evil@evil.com\"@example.com", "not an RFC 5322 address"),
            ("ok@example.com <evil@evil.com>", "'evil@evil.com' is not at"),
            ("", "names no address"),
            ("example.com", "not an RFC 5322 address"),
        ] {
            assert_denied(&mail_decision(&single, json!(to)).await, mentions);
        }
        assert_denied(&mail_decision(&single, json!(["ok@example.com"])).await, "must be a string");
        assert_denied(&mail_decision(&single, json!(null)).await, "must be a string");
    }

    #[tokio::test]
    async fn email_domain_allowlist_allows_a_valid_single_address() {
        let single = allowlist(false);
        for to in [
            "ok@example.com",
            "OK@EXAMPLE.COM",
            "first.last+tag@example.org",
            "\"Ok\" <ok@example.com>",
            "Ok Person <ok@example.com>",
            "\"evil@evil.com\" <ok@example.com>",
            "ok@example.com (the on-call)",
        ] {
            assert_eq!(mail_decision(&single, json!(to)).await.rule_id, "r", "{to}");
        }
    }

    #[tokio::test]
    async fn email_domain_allowlist_allows_valid_multiple_addresses_when_configured() {
        let to = json!("\"Ops\" <ops@example.com>, dev@EXAMPLE.org, team: a@example.com;");
        assert_eq!(mail_decision(&allowlist(true), to.clone()).await.rule_id, "r");
        assert_denied(&mail_decision(&allowlist(false), to).await, "address list");
    }

    #[test]
    fn email_domain_allowlist_domains_must_be_plain_host_names() {
        let inv = |domains: &[&str]| {
            validate(&[InvariantConfig::EmailDomainAllowlist {
                tool: "email.send".into(),
                field: "to".into(),
                domains: domains.iter().map(|s| s.to_string()).collect(),
                allow_multiple: false,
            }])
        };
        assert!(inv(&["example.com", "xn--bcher-kva.de"]).is_ok());
        for bad in [&[][..], &["@example.com"], &["example.com."], &[""], &["ex ample.com"]] {
            assert!(inv(bad).is_err(), "{bad:?}");
        }
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
