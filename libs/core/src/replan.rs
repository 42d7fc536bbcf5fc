//! What a replanning round is told (seed 000 §12): the executor builds it from the run's
//! record when a goal run's plan ends with failed steps, the planner shows it to the model and
//! fits the answer to it (`plan::revise`). It travels as `CreatePlanRequest.failure_context_json`.

use std::collections::{BTreeMap, HashSet};

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::plan::PlanStep;

/// Most of one step's output or error shown to the model (the rest is elided: it is on record).
pub const MAX_SHOWN_BYTES: usize = 2048;

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReplanContext {
    /// The completed steps, kept as they are (never run again).
    pub kept: Vec<PlanStep>,
    /// Their outputs as shown to the model (bounded; a stored one is named by its digest).
    pub outputs: BTreeMap<String, Value>,
    /// The steps that failed (or were cancelled behind a failure), with why.
    pub failed: Vec<FailedStep>,
    /// Every step id the run has used in any round: a proposed step taking one is renamed.
    pub taken: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FailedStep {
    pub id: String,
    pub tool: String,
    pub params: Value,
    pub error: String,
}

impl ReplanContext {
    pub fn taken(&self) -> HashSet<String> {
        self.taken.iter().cloned().collect()
    }

    /// Checks what a caller sent: kept and failed ids among the taken ones, sizes bounded.
    pub fn check(&self, max_steps: usize) -> Result<(), String> {
        let taken = self.taken();
        if self.taken.len() > 64 * max_steps.max(1) {
            return Err(format!("taken: {} ids is more than a run's rounds can have used", self.taken.len()));
        }
        if let Some(s) = self.kept.iter().find(|s| !taken.contains(&s.id)) {
            return Err(format!("kept: step '{}' is not among the taken ids", s.id));
        }
        if let Some(s) = self.failed.iter().find(|s| !taken.contains(&s.id)) {
            return Err(format!("failed: step '{}' is not among the taken ids", s.id));
        }
        if let Some(id) = self.outputs.keys().find(|id| !self.kept.iter().any(|k| &k.id == *id)) {
            return Err(format!("outputs: '{id}' is not a kept step"));
        }
        Ok(())
    }
}

/// `v` as shown to the model: whole when its JSON is small, else its first bytes as a string
/// saying how much was elided.
pub fn shown(v: &Value) -> Value {
    let text = v.to_string();
    if text.len() <= MAX_SHOWN_BYTES {
        return v.clone();
    }
    let cut = text.floor_char_boundary(MAX_SHOWN_BYTES);
    Value::String(format!("{}… ({} bytes elided)", &text[..cut], text.len() - cut))
}

/// `s` bounded like [`shown`].
pub fn shown_text(s: &str) -> String {
    if s.len() <= MAX_SHOWN_BYTES {
        return s.to_string();
    }
    let cut = s.floor_char_boundary(MAX_SHOWN_BYTES);
    format!("{}… ({} bytes elided)", &s[..cut], s.len() - cut)
}
