//! The step pipeline's schema checks (seed 000 §4.1): a call's arguments against the input
//! JSON Schema its tool declares, and its output against the declared output schema. The
//! planner checks a plan's literal params at submission; the executor checks resolved
//! arguments (templated values are known only then) before policy is asked and before the tool
//! is invoked, and every output before it is recorded.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use serde_json::Value;

/// A declared schema and what it compiled to (`None`: it does not compile here).
type Compiled = (String, Arc<Option<jsonschema::Validator>>);

/// Compiled input and output schemas by tool, compiled anew when a host declares another
/// schema.
#[derive(Default)]
pub struct ToolSchemas {
    compiled: Mutex<HashMap<String, Compiled>>,
}

/// Why arguments were refused: the field (a JSON pointer under `params`) and the reason,
/// which never quotes the argument's value (it may be large, or secret).
#[derive(Debug, PartialEq)]
pub struct Refused {
    pub field: String,
    pub reason: String,
}

impl ToolSchemas {
    /// Checks `args` against `schema_json`, the input schema `tool` declares. A declaration
    /// this validator cannot compile (an unknown `$schema`, a remote `$ref`, an old draft's
    /// forms) is not checked here: the host, which declared it, still validates its calls.
    pub fn check(&self, tool: &str, schema_json: &str, args: &Value) -> Result<(), Refused> {
        self.check_at(tool, "params", schema_json, args)
    }

    /// Checks a call's `output` against the output schema `tool` declares; a refusal names the
    /// field under `output`. As with arguments, a schema this validator cannot compile is not
    /// checked.
    pub fn check_output(&self, tool: &str, schema_json: &str, output: &Value) -> Result<(), Refused> {
        self.check_at(tool, "output", schema_json, output)
    }

    /// Checks `value` (the `root` of a call: its `params` or its `output`) against `schema_json`.
    fn check_at(&self, tool: &str, root: &str, schema_json: &str, value: &Value) -> Result<(), Refused> {
        if schema_json.trim().is_empty() {
            return Ok(());
        }
        let key = format!("{root}:{tool}");
        let known = {
            let compiled = self.compiled.lock().unwrap_or_else(|p| p.into_inner());
            compiled.get(&key).filter(|(schema, _)| schema == schema_json).map(|(_, v)| v.clone())
        };
        let validator = match known {
            Some(v) => v,
            None => {
                // Compiled outside the lock: a large schema must not hold up other calls.
                let v = Arc::new(match serde_json::from_str::<Value>(schema_json) {
                    Ok(schema) => match jsonschema::validator_for(&schema) {
                        Ok(v) => Some(v),
                        Err(e) => {
                            tracing::warn!(tool, root, error = %e, "schema not checked: it does not compile here");
                            None
                        }
                    },
                    Err(e) => {
                        tracing::warn!(tool, root, error = %e, "schema not checked: it is not JSON");
                        None
                    }
                });
                let mut compiled = self.compiled.lock().unwrap_or_else(|p| p.into_inner());
                compiled.insert(key, (schema_json.to_string(), v.clone()));
                v
            }
        };
        let Some(v) = validator.as_ref() else { return Ok(()) };
        match v.iter_errors(value).next() {
            None => Ok(()),
            Some(err) => {
                let mut field = format!("{root}{}", err.instance_path);
                if let jsonschema::error::ValidationErrorKind::Required { property } = &err.kind {
                    field.push('/');
                    field.push_str(property.as_str().unwrap_or_default());
                }
                let which = if root == "params" { "input" } else { root };
                let reason = format!("{field}: {} ({which} schema of '{tool}')", err.masked());
                Err(Refused { field, reason })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn arguments_are_checked_against_the_declared_schema_naming_the_field() {
        let schemas = ToolSchemas::default();
        let schema =
            json!({"type": "object", "required": ["to"], "properties": {"to": {"type": "string"}}}).to_string();
        assert_eq!(schemas.check("email.send", &schema, &json!({"to": "a@b"})), Ok(()));
        let refused = schemas.check("email.send", &schema, &json!({"to": {"secret": 1}})).expect_err("an object");
        assert_eq!(refused.field, "params/to");
        assert!(!refused.reason.contains("secret"), "the value is not quoted: {}", refused.reason);
        let missing = schemas.check("email.send", &schema, &json!({})).expect_err("missing");
        assert_eq!(missing.field, "params/to", "{}", missing.reason);
        // Another schema for the tool is compiled anew.
        let any = json!({"type": "object"}).to_string();
        assert_eq!(schemas.check("email.send", &any, &json!({"to": {"x": 1}})), Ok(()));
        // What does not compile here is left to the host; no schema, nothing to check.
        assert_eq!(schemas.check("t", "{\"type\": 12}", &json!({})), Ok(()));
        assert_eq!(schemas.check("t", "not json", &json!({})), Ok(()));
        assert_eq!(schemas.check("t", "", &json!({"a": 1})), Ok(()));
    }

    #[test]
    fn outputs_are_checked_apart_from_arguments() {
        let schemas = ToolSchemas::default();
        let input = json!({"type": "object"}).to_string();
        let output =
            json!({"type": "object", "required": ["text"], "properties": {"text": {"type": "string"}}}).to_string();
        assert_eq!(schemas.check("text.upper", &input, &json!({"x": 1})), Ok(()));
        assert_eq!(schemas.check_output("text.upper", &output, &json!({"text": "HI"})), Ok(()));
        let refused = schemas.check_output("text.upper", &output, &json!({"text": 42})).expect_err("a number");
        assert_eq!(refused.field, "output/text");
        assert!(refused.reason.contains("output schema of 'text.upper'"), "{}", refused.reason);
        assert!(!refused.reason.contains("42"), "the value is not quoted: {}", refused.reason);
        assert_eq!(schemas.check_output("text.upper", &output, &json!({})).expect_err("missing").field, "output/text");
        // The input schema of the same tool is still its own.
        assert_eq!(schemas.check("text.upper", &input, &json!({"y": 2})), Ok(()));
    }
}
