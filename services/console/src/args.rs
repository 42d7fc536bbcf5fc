//! A step's exact arguments, derived the way the executor derives them: the plan's params with
//! every `{{step.output…}}` reference resolved against the outputs of finished steps. An
//! approval records only the SHA-256 of the arguments it is bound to; the console recomputes
//! the arguments, digests them and shows them only when the digest matches, so a person
//! approves exactly what will run.

use std::collections::HashMap;

use serde_json::Value;
use warden_core::plan::Plan;
use warden_core::template::TemplateError;

/// The step's parameters resolved against `outputs`: the outer error when the plan or the step
/// cannot be read, the inner one when a reference does not resolve.
fn resolve(
    plan_json: &str,
    step_id: &str,
    outputs: &HashMap<String, Value>,
) -> Result<Result<Value, TemplateError>, String> {
    let plan = Plan::parse(plan_json).map_err(|e| format!("the run's plan does not parse: {e}"))?;
    let step = plan.step(step_id).ok_or_else(|| format!("the plan has no step '{step_id}'"))?;
    Ok(warden_core::template::resolve(&step.params, outputs))
}

/// The step's arguments as they would be sent now, or why they cannot be derived.
pub fn derive(plan_json: &str, step_id: &str, outputs: &HashMap<String, Value>) -> Result<Value, String> {
    resolve(plan_json, step_id, outputs)?.map_err(|e| e.to_string())
}

/// What the page shows for a call bound to `args_sha256`: the arguments when they hash to it.
///
/// A call is decided before the outcome of the step before it is recorded (one append carries
/// that outcome, the decision and the request), so an approval can be seen a moment before
/// the outputs its arguments are built from can be read. Then the view says `waiting` and the
/// page asks again shortly; it is never left showing an unresolved reference.
pub fn bound(plan_json: &str, step_id: &str, outputs: &HashMap<String, Value>, args_sha256: &str) -> Value {
    match resolve(plan_json, step_id, outputs) {
        Ok(Ok(args)) if warden_core::canonical::args_digest(&args) == args_sha256 => {
            serde_json::json!({"args": args, "digest_matches": true})
        }
        Ok(Ok(_)) => {
            unbound("the arguments derived from the plan hash differently: only the digest is shown".into(), false)
        }
        // The plan's references name only its own steps (checked when it was parsed): a step
        // without output here has not had its outcome recorded yet.
        Ok(Err(TemplateError::UnknownStep { step_id: before, .. })) => {
            unbound(format!("waiting for the outcome of step '{before}' to be recorded"), true)
        }
        Ok(Err(why)) => unbound(why.to_string(), false),
        Err(why) => unbound(why, false),
    }
}

fn unbound(note: String, waiting: bool) -> Value {
    serde_json::json!({"args": null, "digest_matches": false, "note": note, "waiting": waiting})
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
        assert_eq!(
            (unresolved["digest_matches"].clone(), unresolved["waiting"].clone()),
            (json!(false), json!(true)),
            "greet's outcome is not recorded yet: the page asks again"
        );
        let missing = HashMap::from([("greet".to_string(), json!({"other": 1}))]);
        assert_eq!(bound(PLAN, "mail", &missing, &digest)["waiting"], json!(false), "no value there: it never will be");
        assert_eq!(bound("not json", "mail", &outputs, &digest)["waiting"], json!(false));
        assert!(derive(PLAN, "nope", &outputs).is_err());
        assert!(derive("not json", "mail", &outputs).is_err());
    }
}
