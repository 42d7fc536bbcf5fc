//! A step's exact arguments, derived the way the executor derives them: the plan's params with
//! every `{{step.output…}}` reference resolved against the outputs of finished steps. An
//! approval records only the SHA-256 of the arguments it is bound to; the console recomputes
//! the arguments, digests them and shows them only when the digest matches, so a person
//! approves exactly what will run.

use std::collections::HashMap;

use serde_json::Value;
use warden_core::plan::Plan;

/// The step's arguments as they would be sent now, or why they cannot be derived.
pub fn derive(plan_json: &str, step_id: &str, outputs: &HashMap<String, Value>) -> Result<Value, String> {
    let plan = Plan::parse(plan_json).map_err(|e| format!("the run's plan does not parse: {e}"))?;
    let step = plan.step(step_id).ok_or_else(|| format!("the plan has no step '{step_id}'"))?;
    warden_core::template::resolve(&step.params, outputs).map_err(|e| e.to_string())
}

/// What the page shows for a call bound to `args_sha256`: the arguments when they hash to it.
pub fn bound(plan_json: &str, step_id: &str, outputs: &HashMap<String, Value>, args_sha256: &str) -> Value {
    match derive(plan_json, step_id, outputs) {
        Ok(args) if warden_core::canonical::args_digest(&args) == args_sha256 => {
            serde_json::json!({"args": args, "digest_matches": true})
        }
        Ok(_) => serde_json::json!({
            "args": null,
            "digest_matches": false,
            "note": "the arguments derived from the plan hash differently: only the digest is shown",
        }),
        Err(why) => serde_json::json!({"args": null, "digest_matches": false, "note": why}),
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    const PLAN: &str = r#"{"steps":[
        {"id":"greet","tool":"echo","params":{"message":"hi"}},
        {"id":"mail","tool":"email.send","params":{"to":"ops@example.com","body":"{{greet.output.message}}"},
         "depends_on":["greet"]}]}"#;

    #[test]
    fn arguments_are_shown_only_when_they_hash_to_the_bound_digest() {
        let outputs = HashMap::from([("greet".to_string(), json!({"message": "HI"}))]);
        let args = json!({"to": "ops@example.com", "body": "HI"});
        let digest = warden_core::canonical::args_digest(&args);
        let shown = bound(PLAN, "mail", &outputs, &digest);
        assert_eq!((shown["args"].clone(), shown["digest_matches"].clone()), (args, json!(true)));
        let other = bound(PLAN, "mail", &outputs, &"0".repeat(64));
        assert_eq!((other["args"].clone(), other["digest_matches"].clone()), (Value::Null, json!(false)));
        let unresolved = bound(PLAN, "mail", &HashMap::new(), &digest);
        assert_eq!(unresolved["digest_matches"], json!(false));
        assert!(derive(PLAN, "nope", &outputs).is_err());
        assert!(derive("not json", "mail", &outputs).is_err());
    }
}
