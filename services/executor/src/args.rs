//! The step pipeline's argument check (seed 000 §4.1): after template resolution, a call's
//! arguments are validated against the input JSON Schema its tool declares, before policy is
//! asked and before the tool is invoked. Explicit plans are checked at submission too, but a
//! templated value is known only now.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use serde_json::Value;

/// Compiled input schemas by tool, recompiled when a host declares another schema.
#[derive(Default)]
pub struct InputSchemas {
    compiled: Mutex<HashMap<String, (String, Arc<Result<jsonschema::Validator, String>>)>>,
}

/// Why arguments were refused: the field (a JSON pointer under `params`) and the reason.
#[derive(Debug, PartialEq)]
pub struct Refused {
    pub field: String,
    pub reason: String,
}

impl InputSchemas {
    /// Checks `args` against `schema_json`, the input schema `tool` declares. A schema that is
    /// not JSON Schema refuses every call: the host's declaration is broken, and nothing
    /// unchecked reaches policy or the tool.
    pub fn check(&self, tool: &str, schema_json: &str, args: &Value) -> Result<(), Refused> {
        if schema_json.trim().is_empty() {
            return Ok(());
        }
        let validator = {
            let mut compiled = self.compiled.lock().unwrap_or_else(|p| p.into_inner());
            match compiled.get(tool) {
                Some((schema, v)) if schema == schema_json => v.clone(),
                _ => {
                    let v = Arc::new(
                        serde_json::from_str::<Value>(schema_json)
                            .map_err(|e| e.to_string())
                            .and_then(|s| jsonschema::validator_for(&s).map_err(|e| e.to_string())),
                    );
                    compiled.insert(tool.to_string(), (schema_json.to_string(), v.clone()));
                    v
                }
            }
        };
        match validator.as_ref() {
            Err(e) => Err(Refused {
                field: "params".into(),
                reason: format!("tool '{tool}' declares an input schema that is not JSON Schema: {e}"),
            }),
            Ok(v) => match v.iter_errors(args).next() {
                None => Ok(()),
                Some(err) => {
                    let field = format!("params{}", err.instance_path);
                    Err(Refused { reason: format!("{field}: {err} (input schema of '{tool}')"), field })
                }
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn arguments_are_checked_against_the_declared_schema_naming_the_field() {
        let schemas = InputSchemas::default();
        let schema =
            json!({"type": "object", "required": ["to"], "properties": {"to": {"type": "string"}}}).to_string();
        assert_eq!(schemas.check("email.send", &schema, &json!({"to": "a@b"})), Ok(()));
        let refused = schemas.check("email.send", &schema, &json!({"to": {"x": 1}})).expect_err("an object");
        assert_eq!(refused.field, "params/to");
        assert!(refused.reason.contains("not of type"), "{}", refused.reason);
        let missing = schemas.check("email.send", &schema, &json!({})).expect_err("missing");
        assert_eq!(missing.field, "params");
        // Another schema for the tool is compiled anew.
        let any = json!({"type": "object"}).to_string();
        assert_eq!(schemas.check("email.send", &any, &json!({"to": {"x": 1}})), Ok(()));
        let broken = schemas.check("t", "{\"type\": 12}", &json!({})).expect_err("not JSON Schema");
        assert!(broken.reason.contains("not JSON Schema"), "{}", broken.reason);
        assert_eq!(schemas.check("t", "", &json!({"a": 1})), Ok(()), "no schema declared");
    }
}
