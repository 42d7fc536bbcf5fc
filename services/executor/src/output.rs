//! The step pipeline's output half (seed 000 §4.1, §9, §10): every tool output is vetted
//! before it is recorded — against the configured output rules, then against the output
//! schema the tool declares. An output that fails either is never recorded, never templated
//! into a later step and never shown to a planner: it becomes `"[Output sanitized]"`, and the
//! reason goes on record beside it. The step keeps its status (a sanitizer rewrites output,
//! it does not fail a step), and the record keeps the SHA-256 and size of what was withheld,
//! so the host's own records can be matched against the ledger.

use std::collections::BTreeMap;

use serde_json::{Value, json};
use warden_core::canonical::sha256_hex;
use warden_grpc::tool_schema::ToolSchemas;

/// What a sanitized output is recorded as.
pub const SANITIZED: &str = "[Output sanitized]";

/// The configured output rules, compiled once (see `ExecutorConfig::output_rules`).
pub struct OutputRules {
    rules: Vec<(String, regex::Regex)>,
}

impl OutputRules {
    /// Compiles `rules` (name → pattern); an empty pattern is a rule turned off. Patterns were
    /// checked when the configuration was loaded.
    pub fn new(rules: &BTreeMap<String, String>) -> anyhow::Result<OutputRules> {
        let rules = rules
            .iter()
            .filter(|(_, p)| !p.is_empty())
            .map(|(name, p)| Ok((name.clone(), regex::Regex::new(p)?)))
            .collect::<anyhow::Result<Vec<_>>>()?;
        Ok(OutputRules { rules })
    }

    /// The first rule `text` matches, by name.
    fn matched(&self, text: &str) -> Option<&str> {
        self.rules.iter().find(|(_, r)| r.is_match(text)).map(|(name, _)| name.as_str())
    }
}

/// A tool's error message as it may be recorded (and shown to a replanning planner): the
/// output rules apply to it as to an output, so a secret in an error is withheld too. `None`
/// when it may be recorded as it is; else the name of the rule it matched.
pub fn vet_error(rules: &OutputRules, message: &str) -> Option<String> {
    rules.matched(message).map(|name| format!("output_rule:{name}"))
}

/// A message quoted inside a reason of the record (a tool host's status: an unknown outcome, a
/// wait), through the output rules: one that matches a rule is quoted as `[Output sanitized]`
/// with the rule, the message's digest and size instead.
pub fn quote_vetted(rules: &OutputRules, message: &str) -> String {
    match vet_error(rules, message) {
        None => message.to_string(),
        Some(rule) => {
            warden_telemetry::metrics::output_sanitized(&rule);
            let digest = sha256_hex(message.as_bytes());
            format!("{SANITIZED} ({rule}; message sha256 {digest}, {} bytes)", message.len())
        }
    }
}

/// Why an output was withheld; recorded as the `sanitized` field of its `tool_completed`.
#[derive(Debug, PartialEq)]
pub struct Sanitized {
    /// `output_rule:<name>` or `output_schema`.
    pub rule: String,
    /// Where in the output (a JSON pointer under `output`), when a schema names it.
    pub field: Option<String>,
    /// Never quotes the output.
    pub reason: String,
    pub output_sha256: String,
    pub output_bytes: usize,
}

impl Sanitized {
    pub fn to_json(&self) -> Value {
        let mut v = json!({
            "rule": self.rule,
            "reason": self.reason,
            "output_sha256": self.output_sha256,
            "output_bytes": self.output_bytes,
        });
        if let Some(f) = &self.field {
            v["field"] = json!(f);
        }
        v
    }
}

/// Vets `output` of `tool` (`text` is its JSON): `None` when it may be recorded as
/// it is. The rules see the whole output's JSON text (not a prefix: a secret past a cut-off
/// would slip through).
pub fn vet(
    rules: &OutputRules,
    schemas: &ToolSchemas,
    (tool, schema): (&str, &str),
    output: &Value,
    text: &str,
) -> Option<Sanitized> {
    let withheld = |rule: String, field: Option<String>, reason: String| {
        let canonical = warden_core::canonical::canonical_json(output);
        Sanitized {
            rule,
            field,
            reason,
            output_sha256: sha256_hex(canonical.as_bytes()),
            output_bytes: canonical.len(),
        }
    };
    if let Some(name) = rules.matched(text) {
        let reason = format!("the output matches the output rule '{name}'");
        return Some(withheld(format!("output_rule:{name}"), None, reason));
    }
    if let Err(refused) = schemas.check_output(tool, schema, output) {
        return Some(withheld("output_schema".into(), Some(refused.field), refused.reason));
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use warden_core::canonical::canonical_json;

    fn vet(rules: &OutputRules, schemas: &ToolSchemas, tool: &str, schema: &str, output: &Value) -> Option<Sanitized> {
        super::vet(rules, schemas, (tool, schema), output, &canonical_json(output))
    }

    fn rules() -> OutputRules {
        OutputRules::new(&warden_config::default_output_rules()).expect("default rules compile")
    }

    #[test]
    fn a_host_message_quoted_in_a_reason_is_vetted_like_an_output() {
        let secret = "sk-abcdefghijklmnopqrstuvwx0123";
        assert_eq!(quote_vetted(&rules(), "connection reset by peer"), "connection reset by peer");
        let said = format!("in doubt: the call to {secret} was started before");
        let quoted = quote_vetted(&rules(), &said);
        assert!(!quoted.contains(secret), "{quoted}");
        assert!(quoted.starts_with(SANITIZED) && quoted.contains("output_rule:openai_key"), "{quoted}");
        assert!(quoted.contains(&sha256_hex(said.as_bytes())), "{quoted}");
    }

    #[test]
    fn an_output_is_withheld_by_a_rule_or_its_schema_and_never_quoted() {
        let schemas = ToolSchemas::default();
        let schema = json!({"type": "object", "required": ["text"], "properties": {"text": {"type": "string"}}});
        let schema = schema.to_string();
        assert_eq!(vet(&rules(), &schemas, "t", &schema, &json!({"text": "fine"})), None);
        assert_eq!(vet(&rules(), &schemas, "t", "", &json!(["anything", 1])), None, "no schema, no rule matched");

        let leak = json!({"text": "key sk-abcdefghijklmnopqrstuvwx"});
        let s = vet(&rules(), &schemas, "t", &schema, &leak).expect("a credential");
        assert_eq!(s.rule, "output_rule:openai_key");
        assert!(!s.reason.contains("sk-"), "{}", s.reason);
        assert_eq!(s.output_sha256, sha256_hex(canonical_json(&leak).as_bytes()));

        let s = vet(&rules(), &schemas, "t", &schema, &json!({"text": 7})).expect("off schema");
        assert_eq!((s.rule.as_str(), s.field.as_deref()), ("output_schema", Some("output/text")));
        assert!(!s.reason.contains('7'), "{}", s.reason);
        assert_eq!(s.to_json()["field"], "output/text");
    }

    #[test]
    fn an_empty_pattern_turns_a_rule_off() {
        let mut off = warden_config::default_output_rules();
        off.insert("openai_key".into(), String::new());
        let rules = OutputRules::new(&off).expect("compiles");
        let schemas = ToolSchemas::default();
        assert_eq!(vet(&rules, &schemas, "t", "", &json!({"text": "sk-abcdefghijklmnopqrstuvwx"})), None);
    }
}
