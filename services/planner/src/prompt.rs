//! The prompt builder: the messages a planning call sends, deterministic for the same goal,
//! offer and earlier answers, so a replay can tell an exact repeat from drift. Its version is
//! recorded (`context_version.context_builder_version`); change it whenever the text changes.

use serde_json::{Value, json};
use warden_core::canonical::sha256_hex;

use crate::schema::Offer;

/// Recorded with every call; bump on any change to the text below.
pub const CONTEXT_BUILDER_VERSION: &str = "warden-planner-prompt/2";
/// Planning sends the whole conversation; nothing is compacted.
pub const COMPACTION_VERSION: &str = "none";

/// One chat message, as recorded and sent.
pub fn message(role: &str, content: &str) -> Value {
    json!({"role": role, "content": content})
}

/// The system prompt for an offer: the task, the rules and the tools the run may call.
pub fn system_prompt(offer: &Offer, max_steps: usize) -> String {
    let mut s = String::from(
        "You are the planner of an agent runtime. Turn the user's goal into an execution plan: a JSON object \
         with \"reasoning\" (a short explanation), \"steps\" (tool calls) and \"direct_response\".\n\
         Rules:\n\
         - Use only the tools listed below, with parameters that match each tool's schema.\n\
         - Each step has a unique \"id\" (letters, digits, '-' or '_'), a \"tool\", \"params\" and \"depends_on\" \
         (ids of earlier steps it needs; [] for none).\n\
         - A step may use an earlier step's output in a string parameter as {{<id>.output}} or \
         {{<id>.output.<field>}}, and must then list that step in depends_on.\n\
         - \"alternatives\" lists other calls ({\"tool\", \"params\"}) that serve the step's purpose, tried in order \
         if its call fails; [] for none.\n\
         - A part of the goal no listed tool does in one call may be a step with a \"subgoal\" (a smaller goal, \
         planned on its own) instead of a tool; later steps use its result as {{<id>.output}}.\n",
    );
    s.push_str(&format!("- At most {max_steps} steps.\n"));
    s.push_str(
        "- If the goal needs no tool, or no listed tool can do it safely, return \"steps\": [] and answer in \
         \"direct_response\"; otherwise set \"direct_response\" to null.\n\
         Answer with the JSON object only.\n\nTools:\n",
    );
    if offer.tools.is_empty() {
        s.push_str("(none: answer in direct_response)\n");
    }
    for t in &offer.tools {
        s.push_str(&format!("- {}: {}\n  params schema: {}\n", t.name, t.description, t.schema));
    }
    s
}

/// The first call's messages.
pub fn initial(system: &str, goal: &str) -> Vec<Value> {
    vec![message("system", system), message("user", goal)]
}

/// A replanning round's messages: the goal, then what the earlier plan came to — the kept
/// steps with their outputs, the failures — and the request for a plan of what remains.
pub fn replan(system: &str, goal: &str, round: u32, context: &warden_core::replan::ReplanContext) -> Vec<Value> {
    let kept: Vec<Value> = context
        .kept
        .iter()
        .map(|s| json!({"id": s.id, "tool": s.tool, "output": context.outputs.get(&s.id).cloned().unwrap_or(Value::Null)}))
        .collect();
    let failed: Vec<Value> = context
        .failed
        .iter()
        .map(|f| json!({"id": f.id, "tool": f.tool, "params": f.params, "error": f.error}))
        .collect();
    let text = format!(
        "Replanning round {round}: the plan for this goal did not succeed.\n\
         Completed steps (they are kept and never run again; new steps may use their outputs as \
         {{{{<id>.output}}}} and list them in depends_on): {}\n\
         Failed steps: {}\n\
         Plan only what remains to reach the goal, avoiding what failed. If it cannot be reached safely, \
         return \"steps\": [] and say why in \"direct_response\".",
        Value::Array(kept),
        Value::Array(failed),
    );
    vec![message("system", system), message("user", goal), message("user", &text)]
}

/// A repair pass: the refused answer and the exact error, with the request to answer again.
pub fn repair(messages: &mut Vec<Value>, answer: &str, error: &str) {
    messages.push(message("assistant", answer));
    messages.push(message(
        "user",
        &format!(
            "Your answer was refused: {error}\nAnswer again with a corrected plan (the JSON object only) that \
             follows the rules and uses only the listed tools."
        ),
    ));
}

/// The `context_version` recorded with a call.
pub fn context_version(system: &str) -> Value {
    json!({
        "system_prompt_hash": sha256_hex(system.as_bytes()),
        "context_builder_version": CONTEXT_BUILDER_VERSION,
        "compaction_version": COMPACTION_VERSION,
    })
}
