//! Plans (seed 000 §3): `steps`, `reasoning`, `direct_response`, and their validation.
//!
//! Validation happens before anything is recorded: unknown fields, bad or duplicate ids,
//! unknown tools, missing dependencies, cycles, malformed templates, references to steps that
//! are not dependencies, and more than `max_steps` steps are all refused, each error naming
//! the step and the field. Over-long plans are an error for the planner to fix, never a
//! silent truncation.

use std::collections::{HashMap, HashSet, VecDeque};
use std::fmt;
use std::marker::PhantomData;

use serde::de::value::MapAccessDeserializer;
use serde::de::{MapAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::Value;

use crate::ids::check_step_id;
use crate::template::{self, TemplateError};

/// The step id under which planning round `round`'s model calls are decided and recorded.
pub fn planner_step(round: u32) -> String {
    format!("plan-r{round}")
}

/// Whether `id` is a planner step id (`plan-r<digits>`), which no plan step may take.
pub fn is_planner_step(id: &str) -> bool {
    id.strip_prefix("plan-r").is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
}

/// The step id under which the model critic's calls about plan step `step_id` are decided and
/// recorded: `critic-` and 16 hex digits of the step id's SHA-256 (bounded, whatever the id).
pub fn critic_step(step_id: &str) -> String {
    format!("critic-{}", &crate::sha256_hex(step_id.as_bytes())[..16])
}

/// Whether `id` is a critic step id (`critic-<16 hex digits>`), which no plan step may take.
pub fn is_critic_step(id: &str) -> bool {
    id.strip_prefix("critic-").is_some_and(|h| h.len() == 16 && h.bytes().all(|b| b.is_ascii_hexdigit()))
}

/// Default upper bound on steps in one plan.
pub const DEFAULT_MAX_STEPS: usize = 10;

/// A plan. Its `Deserialize` accepts only a JSON object (serde's derive alone would also take
/// an array of field values); the derived field-by-field code is reached through
/// `remote = "Self"`, behind a visitor that refuses anything but a map.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(remote = "Self", deny_unknown_fields)]
pub struct Plan {
    #[serde(default)]
    pub steps: Vec<PlanStep>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning: Option<String>,
    /// When present the run returns it without executing anything (seed 000 §3).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub direct_response: Option<String>,
    /// How deep child frames may nest below this run (seed 001 `maxDepth`; 1 ..=
    /// [`MAX_FRAME_DEPTH`]); absent: [`DEFAULT_MAX_DEPTH`]. A child frame inherits its parent's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_depth: Option<u32>,
}

/// Frames nest at most this deep below a root run, whatever a plan asks.
pub const MAX_FRAME_DEPTH: u32 = 8;
/// How deep frames nest when a plan does not say.
pub const DEFAULT_MAX_DEPTH: u32 = 2;
/// Longest sub-goal a step may name (bytes).
pub const MAX_SUBGOAL_BYTES: usize = 2048;

/// One step of a plan. Like [`Plan`], it deserializes only from a JSON object.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(remote = "Self", deny_unknown_fields)]
pub struct PlanStep {
    pub id: String,
    /// The tool the step calls; empty for a step with a `subgoal`.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub tool: String,
    /// A sub-goal (seed 001): instead of calling a tool, the step opens a child frame — a
    /// goal run of its own, planned for this sub-goal, bounded by the plan's `max_depth` and
    /// sharing the run's budget — and completes with what the frame produced. May template
    /// from the step's dependencies.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub subgoal: Option<String>,
    #[serde(default = "empty_object")]
    pub params: Value,
    #[serde(default)]
    pub depends_on: Vec<String>,
    /// Branches (seed 001): what the step does instead, in order, when its call fails for
    /// good — denied, refused, or failed after the retries its tool allows. The runtime moves
    /// to the next alternative, never trying the same tool and arguments twice (failure
    /// memory); the step fails when none is left. Alternatives template from the step's
    /// dependencies like its params.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub alternatives: Vec<Alternative>,
}

/// One alternative of a step: another tool call that serves the step's purpose.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Alternative {
    pub tool: String,
    #[serde(default = "empty_object")]
    pub params: Value,
}

/// Most alternatives one step may name.
pub const MAX_ALTERNATIVES: usize = 4;

impl PlanStep {
    /// The step's branches in order: its own call (branch 0), then its alternatives.
    pub fn branch(&self, n: usize) -> Option<(&str, &Value)> {
        match n {
            0 => Some((self.tool.as_str(), &self.params)),
            n => self.alternatives.get(n - 1).map(|a| (a.tool.as_str(), &a.params)),
        }
    }

    /// Every tool the step may call: its own, then its alternatives' (none for a sub-goal).
    pub fn tools(&self) -> impl Iterator<Item = &str> {
        std::iter::once(self.tool.as_str())
            .filter(|t| !t.is_empty())
            .chain(self.alternatives.iter().map(|a| a.tool.as_str()))
    }
}

fn empty_object() -> Value {
    Value::Object(Default::default())
}

/// A type whose derived (`remote = "Self"`) field decoding may only be fed a JSON object.
///
/// serde's derived struct code also accepts a sequence of field values in declaration order,
/// so `[]` would otherwise be an empty plan and `["a","echo"]` a step. A plan is an object
/// with named fields; anything else is refused before the derived code sees it.
trait ObjectOnly: Sized {
    /// What a refused value was expected to be, for the error message.
    const EXPECTING: &'static str;
    /// The derived field decoding.
    fn from_fields<'de, D: Deserializer<'de>>(d: D) -> Result<Self, D::Error>;
}

impl ObjectOnly for Plan {
    const EXPECTING: &'static str = "a plan as a JSON object";
    fn from_fields<'de, D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        // The inherent function generated by `remote = "Self"`, not the trait method.
        Plan::deserialize(d)
    }
}

impl ObjectOnly for PlanStep {
    const EXPECTING: &'static str = "a plan step as a JSON object";
    fn from_fields<'de, D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        PlanStep::deserialize(d)
    }
}

/// Visits only maps: any other JSON type is an "invalid type" error naming [`ObjectOnly::EXPECTING`].
struct ObjectVisitor<T>(PhantomData<T>);

impl<'de, T: ObjectOnly> Visitor<'de> for ObjectVisitor<T> {
    type Value = T;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(T::EXPECTING)
    }

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<T, A::Error> {
        T::from_fields(MapAccessDeserializer::new(map))
    }
}

impl<'de> Deserialize<'de> for Plan {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_map(ObjectVisitor(PhantomData))
    }
}

impl Serialize for Plan {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        Plan::serialize(self, s)
    }
}

impl<'de> Deserialize<'de> for PlanStep {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_map(ObjectVisitor(PhantomData))
    }
}

impl Serialize for PlanStep {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        PlanStep::serialize(self, s)
    }
}

/// What a plan is checked against.
pub struct PlanLimits<'a> {
    pub max_steps: usize,
    pub known_tool: &'a dyn Fn(&str) -> bool,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    #[error("plan is not valid JSON for a plan: {0}")]
    Json(String),
    #[error("plan has {count} steps, more than the maximum of {max}")]
    TooManySteps { count: usize, max: usize },
    #[error("step #{index} has an invalid id '{id}': {reason}")]
    InvalidStepId { index: usize, id: String, reason: String },
    #[error("step '{step_id}' is defined more than once")]
    DuplicateStep { step_id: String },
    #[error("step '{step_id}' uses unknown tool '{tool}'")]
    UnknownTool { step_id: String, tool: String },
    #[error("step '{step_id}' depends on '{dependency}', which is not a step of this plan")]
    MissingDependency { step_id: String, dependency: String },
    #[error("step '{step_id}' is part of a dependency cycle")]
    Cycle { step_id: String },
    #[error("step '{step_id}' params must be a JSON object")]
    ParamsNotObject { step_id: String },
    #[error("step '{step_id}' params: {error}")]
    Template { step_id: String, error: TemplateError },
    #[error("step '{step_id}' references '{referenced}', which is not among its dependencies")]
    ReferenceNotDependency { step_id: String, referenced: String },
    #[error("step '{step_id}' names {count} alternatives, more than the maximum of {max}")]
    TooManyAlternatives { step_id: String, count: usize, max: usize },
    #[error("step '{step_id}' alternative #{index} uses unknown tool '{tool}'")]
    UnknownAlternativeTool { step_id: String, index: usize, tool: String },
    #[error("step '{step_id}' alternative #{index}: {reason}")]
    BadAlternative { step_id: String, index: usize, reason: String },
    #[error("step '{step_id}' {reason}")]
    BadSubgoal { step_id: String, reason: String },
    #[error("max_depth {0} is out of range: 1 to {MAX_FRAME_DEPTH}")]
    BadMaxDepth(u32),
}

impl PlanError {
    /// The request field the error concerns, in `steps[<id>].<field>` form.
    pub fn field(&self) -> String {
        match self {
            PlanError::Json(_) => "plan_json".into(),
            PlanError::TooManySteps { .. } => "plan_json.steps".into(),
            PlanError::InvalidStepId { index, .. } => format!("plan_json.steps[{index}].id"),
            PlanError::DuplicateStep { step_id } => format!("plan_json.steps[{step_id}].id"),
            PlanError::UnknownTool { step_id, .. } => format!("plan_json.steps[{step_id}].tool"),
            PlanError::MissingDependency { step_id, .. } | PlanError::Cycle { step_id } => {
                format!("plan_json.steps[{step_id}].depends_on")
            }
            PlanError::ParamsNotObject { step_id }
            | PlanError::Template { step_id, .. }
            | PlanError::ReferenceNotDependency { step_id, .. } => {
                format!("plan_json.steps[{step_id}].params")
            }
            PlanError::TooManyAlternatives { step_id, .. } => format!("plan_json.steps[{step_id}].alternatives"),
            PlanError::UnknownAlternativeTool { step_id, index, .. } => {
                format!("plan_json.steps[{step_id}].alternatives[{index}].tool")
            }
            PlanError::BadAlternative { step_id, index, .. } => {
                format!("plan_json.steps[{step_id}].alternatives[{index}].params")
            }
            PlanError::BadSubgoal { step_id, .. } => format!("plan_json.steps[{step_id}].subgoal"),
            PlanError::BadMaxDepth(_) => "plan_json.max_depth".into(),
        }
    }
}

impl Plan {
    /// Parses plan JSON strictly: unknown fields are refused, and so is a plan or step that
    /// is not a JSON object (serde would otherwise read `[]` as an empty plan).
    pub fn parse(json: &str) -> Result<Plan, PlanError> {
        serde_json::from_str(json).map_err(|e| PlanError::Json(e.to_string()))
    }

    /// Checks the plan and returns its steps in a dependency order.
    pub fn validate(&self, limits: &PlanLimits<'_>) -> Result<Vec<usize>, PlanError> {
        if self.direct_response.is_some() {
            return Ok(Vec::new());
        }
        if self.steps.len() > limits.max_steps {
            return Err(PlanError::TooManySteps { count: self.steps.len(), max: limits.max_steps });
        }
        if let Some(d) = self.max_depth
            && !(1..=MAX_FRAME_DEPTH).contains(&d)
        {
            return Err(PlanError::BadMaxDepth(d));
        }
        let mut index: HashMap<&str, usize> = HashMap::with_capacity(self.steps.len());
        for (i, s) in self.steps.iter().enumerate() {
            check_step_id(&s.id).map_err(|e| PlanError::InvalidStepId {
                index: i,
                id: s.id.clone(),
                reason: e.to_string(),
            })?;
            if is_planner_step(&s.id) || is_critic_step(&s.id) {
                return Err(PlanError::InvalidStepId {
                    index: i,
                    id: s.id.clone(),
                    reason: "ids 'plan-r<round>' and 'critic-<hex>' are reserved for the planner's and the critic's \
                             model calls"
                        .into(),
                });
            }
            if index.insert(&s.id, i).is_some() {
                return Err(PlanError::DuplicateStep { step_id: s.id.clone() });
            }
        }
        for s in &self.steps {
            if s.subgoal.is_some() {
                check_subgoal(s)?;
            } else if !(limits.known_tool)(&s.tool) {
                return Err(PlanError::UnknownTool { step_id: s.id.clone(), tool: s.tool.clone() });
            }
            if !s.params.is_object() {
                return Err(PlanError::ParamsNotObject { step_id: s.id.clone() });
            }
            for d in &s.depends_on {
                if !index.contains_key(d.as_str()) {
                    return Err(PlanError::MissingDependency { step_id: s.id.clone(), dependency: d.clone() });
                }
            }
            check_alternatives(s, limits)?;
        }
        let order = self.topological_order(&index)?;
        self.check_references(&index)?;
        Ok(order)
    }

    /// Refuses a template reference to a step that is not a (transitive) dependency, so every
    /// referenced output exists when the step runs.
    ///
    /// Memory stays linear in the plan (O(steps + edges)): instead of materializing every
    /// step's ancestor set (quadratic for a long chain — 19,000 chained steps exhausted
    /// 2 GiB), each step that has references gets one walk over its dependencies, marking a
    /// visited array that is reused across steps by stamping it with the step's number. The
    /// walk stops as soon as every referenced step has been reached. Errors come in plan
    /// order, then reference order, as before. Runs after the cycle check, so walks end.
    fn check_references(&self, index: &HashMap<&str, usize>) -> Result<(), PlanError> {
        let deps: Vec<Vec<usize>> = self
            .steps
            .iter()
            .map(|s| s.depends_on.iter().filter_map(|d| index.get(d.as_str()).copied()).collect())
            .collect();
        // visited[j] == i + 1 means "reached from step i"; 0 is never a stamp.
        let mut visited = vec![0usize; self.steps.len()];
        let mut stack: Vec<usize> = Vec::new();
        for (i, s) in self.steps.iter().enumerate() {
            let mut refs = template::references(&s.params)
                .map_err(|error| PlanError::Template { step_id: s.id.clone(), error })?;
            if let Some(goal) = &s.subgoal {
                // Its template parsed in `check_subgoal`.
                refs.extend(template::references(&Value::String(goal.clone())).unwrap_or_default());
            }
            for a in &s.alternatives {
                // Their templates parsed in `check_alternatives`.
                refs.extend(template::references(&a.params).unwrap_or_default());
            }
            if refs.is_empty() {
                continue;
            }
            let stamp = i + 1;
            let mut targets: HashSet<usize> =
                refs.iter().filter_map(|r| index.get(r.step_id.as_str()).copied()).collect();
            stack.clear();
            stack.extend(deps[i].iter().copied());
            while let Some(j) = stack.pop() {
                if targets.is_empty() {
                    break;
                }
                if visited[j] == stamp {
                    continue;
                }
                visited[j] = stamp;
                targets.remove(&j);
                stack.extend(deps[j].iter().copied().filter(|&k| visited[k] != stamp));
            }
            for r in refs {
                let ok = index.get(r.step_id.as_str()).is_some_and(|&ri| visited[ri] == stamp);
                if !ok {
                    return Err(PlanError::ReferenceNotDependency { step_id: s.id.clone(), referenced: r.step_id });
                }
            }
        }
        Ok(())
    }

    /// Kahn's algorithm, stable in plan order; a leftover step is in (or behind) a cycle.
    fn topological_order(&self, index: &HashMap<&str, usize>) -> Result<Vec<usize>, PlanError> {
        let n = self.steps.len();
        let mut indegree = vec![0usize; n];
        let mut dependents: Vec<Vec<usize>> = vec![Vec::new(); n];
        for (i, s) in self.steps.iter().enumerate() {
            let deps: HashSet<&str> = s.depends_on.iter().map(String::as_str).collect();
            indegree[i] = deps.len();
            for d in deps {
                dependents[index[d]].push(i);
            }
        }
        let mut ready: VecDeque<usize> = (0..n).filter(|&i| indegree[i] == 0).collect();
        let mut order = Vec::with_capacity(n);
        while let Some(i) = ready.pop_front() {
            order.push(i);
            for &j in &dependents[i] {
                indegree[j] -= 1;
                if indegree[j] == 0 {
                    ready.push_back(j);
                }
            }
        }
        if order.len() < n {
            let stuck = (0..n).find(|&i| indegree[i] > 0).unwrap_or(0);
            return Err(PlanError::Cycle { step_id: self.steps[stuck].id.clone() });
        }
        Ok(order)
    }

    /// The step with this id.
    pub fn step(&self, id: &str) -> Option<&PlanStep> {
        self.steps.iter().find(|s| s.id == id)
    }
}

/// A step's alternatives: at most [`MAX_ALTERNATIVES`], each a known tool with object params
/// whose templates parse, and none the same call as the step's own or an earlier alternative
/// (failure memory would never attempt it).
fn check_alternatives(s: &PlanStep, limits: &PlanLimits<'_>) -> Result<(), PlanError> {
    if s.alternatives.len() > MAX_ALTERNATIVES {
        return Err(PlanError::TooManyAlternatives {
            step_id: s.id.clone(),
            count: s.alternatives.len(),
            max: MAX_ALTERNATIVES,
        });
    }
    for (index, a) in s.alternatives.iter().enumerate() {
        let bad = |reason: String| PlanError::BadAlternative { step_id: s.id.clone(), index, reason };
        if !(limits.known_tool)(&a.tool) {
            return Err(PlanError::UnknownAlternativeTool { step_id: s.id.clone(), index, tool: a.tool.clone() });
        }
        if !a.params.is_object() {
            return Err(bad("params must be a JSON object".into()));
        }
        template::references(&a.params).map_err(|e| bad(e.to_string()))?;
        if (0..=index).any(|b| s.branch(b) == Some((a.tool.as_str(), &a.params))) {
            return Err(bad("repeats a call the step makes before it".into()));
        }
    }
    Ok(())
}

/// A sub-goal step: a bounded, non-empty goal whose templates parse, and nothing of a tool
/// call beside it (no tool, params or alternatives).
fn check_subgoal(s: &PlanStep) -> Result<(), PlanError> {
    let bad = |reason: &str| Err(PlanError::BadSubgoal { step_id: s.id.clone(), reason: reason.into() });
    let goal = s.subgoal.as_deref().unwrap_or_default();
    if goal.trim().is_empty() {
        return bad("has an empty subgoal");
    }
    if goal.len() > MAX_SUBGOAL_BYTES {
        return bad(&format!("has a subgoal of {} bytes, over the maximum of {MAX_SUBGOAL_BYTES}", goal.len()));
    }
    if goal.contains('\0') {
        return bad("has a subgoal with a NUL character");
    }
    if !s.tool.is_empty() || !s.alternatives.is_empty() || s.params.as_object().is_some_and(|p| !p.is_empty()) {
        return bad("names a subgoal and a tool call: a step does one or the other");
    }
    template::references(&Value::String(goal.to_string()))
        .map_err(|e| PlanError::BadSubgoal { step_id: s.id.clone(), reason: format!("subgoal: {e}") })?;
    Ok(())
}

/// A replanning round's proposal made to fit the run (seed 000 §12).
#[derive(Debug, Clone, PartialEq)]
pub struct Revision {
    /// The round's steps, renamed where their id was taken.
    pub steps: Vec<PlanStep>,
    /// Proposed id → the id it runs under (`<id>_r<round>`), for the ids that were taken.
    pub renamed: std::collections::BTreeMap<String, String>,
    /// The run's plan from here on: the kept steps, then the round's.
    pub plan: Plan,
}

/// Fits the steps a replanning round proposes to a run whose earlier plan failed: a proposed
/// id that the run has used already (`taken`: every step id of every earlier round, kept or
/// not) is renamed `<id>_r<round>`, and the proposal's own references to it (`depends_on`,
/// templates) follow; a reference to an id the proposal does not define reaches the kept step
/// of that id. The result — the `kept` steps (completed, never run again) followed by the
/// round's — is validated like any plan, with at most `max_steps` new steps, so new steps may
/// depend on and template from the outputs of kept ones. The proposal's `reasoning` is kept.
pub fn revise(
    kept: &[PlanStep],
    taken: &HashSet<String>,
    proposal: &Plan,
    round: u32,
    limits: &PlanLimits<'_>,
) -> Result<Revision, PlanError> {
    if proposal.steps.len() > limits.max_steps {
        return Err(PlanError::TooManySteps { count: proposal.steps.len(), max: limits.max_steps });
    }
    let mut renamed = std::collections::BTreeMap::new();
    for s in &proposal.steps {
        if taken.contains(&s.id) {
            renamed.insert(s.id.clone(), format!("{}_r{round}", s.id));
        }
    }
    let lookup: HashMap<String, String> = renamed.iter().map(|(a, b)| (a.clone(), b.clone())).collect();
    let mut steps = Vec::with_capacity(proposal.steps.len());
    for s in &proposal.steps {
        let params = template::rename(&s.params, &lookup)
            .map_err(|error| PlanError::Template { step_id: s.id.clone(), error })?;
        let depends_on = s.depends_on.iter().map(|d| lookup.get(d).cloned().unwrap_or_else(|| d.clone())).collect();
        let id = lookup.get(&s.id).cloned().unwrap_or_else(|| s.id.clone());
        let mut alternatives = Vec::with_capacity(s.alternatives.len());
        for a in &s.alternatives {
            let params = template::rename(&a.params, &lookup)
                .map_err(|error| PlanError::Template { step_id: s.id.clone(), error })?;
            alternatives.push(Alternative { tool: a.tool.clone(), params });
        }
        let subgoal = match &s.subgoal {
            Some(goal) => match template::rename(&Value::String(goal.clone()), &lookup) {
                Ok(Value::String(renamed)) => Some(renamed),
                Ok(_) => Some(goal.clone()),
                Err(error) => return Err(PlanError::Template { step_id: s.id.clone(), error }),
            },
            None => None,
        };
        steps.push(PlanStep { id, tool: s.tool.clone(), subgoal, params, depends_on, alternatives });
    }
    let plan = Plan {
        steps: kept.iter().cloned().chain(steps.iter().cloned()).collect(),
        reasoning: proposal.reasoning.clone(),
        direct_response: None,
        max_depth: None,
    };
    let known_kept: HashSet<&str> = kept.iter().map(|s| s.id.as_str()).collect();
    // Kept steps were checked when they were planned; their tools may since have left the offer.
    let known = |t: &str| {
        (limits.known_tool)(t) || kept.iter().any(|k| k.tools().any(|kt| kt == t) && known_kept.contains(k.id.as_str()))
    };
    plan.validate(&PlanLimits { max_steps: kept.len() + limits.max_steps, known_tool: &known })?;
    Ok(Revision { steps, renamed, plan })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::canonical::canonical_json;

    fn known(t: &str) -> bool {
        matches!(t, "echo" | "text.upper")
    }

    fn check(json: &str) -> Result<Vec<usize>, PlanError> {
        Plan::parse(json)?.validate(&PlanLimits { max_steps: 10, known_tool: &known })
    }

    #[test]
    fn a_replanning_round_renames_taken_ids_and_may_build_on_kept_steps() {
        let kept = Plan::parse(r#"{"steps": [{"id": "fetch", "tool": "echo", "params": {"v": 1}}]}"#).unwrap().steps;
        let taken: HashSet<String> = ["fetch", "send"].iter().map(|s| s.to_string()).collect();
        let proposal = Plan::parse(
            r#"{"steps": [
                {"id": "send", "tool": "text.upper", "params": {"text": "{{fetch.output.v}}"}, "depends_on": ["fetch"]},
                {"id": "after", "tool": "echo", "params": {"t": "{{send.output.text}}"}, "depends_on": ["send"]}
            ]}"#,
        )
        .unwrap();
        let limits = PlanLimits { max_steps: 10, known_tool: &known };
        let r = revise(&kept, &taken, &proposal, 1, &limits).unwrap();
        assert_eq!(r.renamed.get("send").map(String::as_str), Some("send_r1"));
        let ids: Vec<&str> = r.plan.steps.iter().map(|s| s.id.as_str()).collect();
        assert_eq!(ids, ["fetch", "send_r1", "after"]);
        let after = r.plan.step("after").unwrap();
        assert_eq!(
            (after.depends_on.clone(), after.params.clone()),
            (vec!["send_r1".to_string()], serde_json::json!({"t": "{{send_r1.output.text}}"}))
        );
        assert_eq!(
            r.plan.step("send_r1").unwrap().params,
            serde_json::json!({"text": "{{fetch.output.v}}"}),
            "kept steps keep their ids"
        );

        // A reference to a step neither kept nor proposed is refused, as in any plan.
        let dangling = Plan::parse(
            r#"{"steps": [{"id": "x", "tool": "echo", "params": {"a": "{{gone.output}}"}, "depends_on": ["gone"]}]}"#,
        )
        .unwrap();
        assert!(matches!(revise(&kept, &taken, &dangling, 2, &limits), Err(PlanError::MissingDependency { .. })));
        let small = PlanLimits { max_steps: 1, known_tool: &known };
        assert!(matches!(revise(&kept, &taken, &proposal, 1, &small), Err(PlanError::TooManySteps { .. })));
    }

    #[test]
    fn valid_plan_orders_dependencies_first() {
        let order = check(
            r#"{"steps":[{"id":"b","tool":"echo","params":{"x":"{{a.output}}"},"depends_on":["a"]},
                         {"id":"a","tool":"echo"}],"reasoning":"r"}"#,
        )
        .unwrap();
        assert_eq!(order, vec![1, 0]);
    }

    #[test]
    fn unknown_fields_are_refused_with_their_name() {
        let e = check(r#"{"steps":[{"id":"a","tool":"echo","paramz":{}}]}"#).unwrap_err();
        assert!(e.to_string().contains("paramz"), "{e}");
        assert_eq!(e.field(), "plan_json");
    }

    #[test]
    fn each_structural_error_names_the_step() {
        let cases = [
            (r#"{"steps":[{"id":"a","tool":"nope"}]}"#, "plan_json.steps[a].tool"),
            (r#"{"steps":[{"id":"a","tool":"echo"},{"id":"a","tool":"echo"}]}"#, "plan_json.steps[a].id"),
            (r#"{"steps":[{"id":"a","tool":"echo","depends_on":["x"]}]}"#, "plan_json.steps[a].depends_on"),
            (
                r#"{"steps":[{"id":"a","tool":"echo","depends_on":["b"]},{"id":"b","tool":"echo","depends_on":["a"]}]}"#,
                "plan_json.steps[a].depends_on",
            ),
            (r#"{"steps":[{"id":"a","tool":"echo","depends_on":["a"]}]}"#, "plan_json.steps[a].depends_on"),
            (r#"{"steps":[{"id":"a.b","tool":"echo"}]}"#, "plan_json.steps[0].id"),
            (r#"{"steps":[{"id":"a","tool":"echo","params":[1]}]}"#, "plan_json.steps[a].params"),
            (
                r#"{"steps":[{"id":"a","tool":"echo"},{"id":"b","tool":"echo","params":{"x":"{{a.output}}"}}]}"#,
                "plan_json.steps[b].params",
            ),
            (r#"{"steps":[{"id":"a","tool":"echo","params":{"x":"{{ rm -rf }}"}}]}"#, "plan_json.steps[a].params"),
        ];
        for (json, field) in cases {
            let e = check(json).unwrap_err();
            assert_eq!(e.field(), field, "{json}: {e}");
        }
    }

    #[test]
    fn alternatives_are_checked_like_steps_and_name_their_field() {
        let ok = r#"{"steps":[{"id":"a","tool":"echo"},
            {"id":"b","tool":"text.upper","params":{"text":"x"},"depends_on":["a"],
             "alternatives":[{"tool":"echo","params":{"v":"{{a.output}}"}},{"tool":"text.upper","params":{"text":"y"}}]}]}"#;
        check(ok).unwrap();
        let plan = Plan::parse(ok).unwrap();
        assert_eq!(plan.steps[1].branch(2), Some(("text.upper", &serde_json::json!({"text": "y"}))));
        assert_eq!(plan.steps[1].tools().collect::<Vec<_>>(), ["text.upper", "echo", "text.upper"]);
        // A plan without alternatives serializes as before (its digests do not change).
        assert!(
            !canonical_json(&Plan::parse(r#"{"steps":[{"id":"a","tool":"echo"}]}"#).unwrap()).contains("alternatives")
        );
        let alt = |alts: &str| {
            format!(
                r#"{{"steps":[{{"id":"a","tool":"echo"}},{{"id":"b","tool":"echo","params":{{"n":1}},"alternatives":{alts}}}]}}"#
            )
        };
        for (alts, field) in [
            (r#"[{"tool":"rm.rf"}]"#.to_string(), "plan_json.steps[b].alternatives[0].tool"),
            (r#"[{"tool":"echo","params":[1]}]"#.into(), "plan_json.steps[b].alternatives[0].params"),
            (
                r#"[{"tool":"echo","params":{"n":2}},{"tool":"echo","params":{"n":1}}]"#.into(),
                "plan_json.steps[b].alternatives[1].params",
            ),
            (r#"[{"tool":"echo","params":{"v":"{{a.output"}}]"#.into(), "plan_json.steps[b].alternatives[0].params"),
            (r#"[{"tool":"echo","params":{"v":"{{a.output}}"}}]"#.into(), "plan_json.steps[b].params"),
            (format!("[{}]", [r#"{"tool":"echo"}"#; 5].join(",")), "plan_json.steps[b].alternatives"),
        ] {
            let e = check(&alt(&alts)).unwrap_err();
            assert_eq!(e.field(), field, "{alts}: {e}");
        }
        let e = Plan::parse(&alt(r#"[{"tool":"echo","extra":1}]"#)).unwrap_err();
        assert!(matches!(e, PlanError::Json(_)), "unknown fields are refused: {e}");
    }

    #[test]
    fn too_many_steps_is_an_error_not_a_truncation() {
        let steps: Vec<String> = (0..11).map(|i| format!(r#"{{"id":"s{i}","tool":"echo"}}"#)).collect();
        let e = check(&format!(r#"{{"steps":[{}]}}"#, steps.join(","))).unwrap_err();
        assert_eq!(e, PlanError::TooManySteps { count: 11, max: 10 });
    }

    #[test]
    fn transitive_dependencies_may_be_referenced() {
        check(
            r#"{"steps":[{"id":"a","tool":"echo"},{"id":"b","tool":"echo","depends_on":["a"]},
                         {"id":"c","tool":"echo","depends_on":["b"],"params":{"v":"{{a.output}}"}}]}"#,
        )
        .unwrap();
    }

    #[test]
    fn direct_response_and_empty_plans_validate() {
        assert_eq!(check(r#"{"direct_response":"hello"}"#).unwrap(), Vec::<usize>::new());
        assert_eq!(check(r#"{"steps":[]}"#).unwrap(), Vec::<usize>::new());
    }

    #[test]
    fn a_plan_or_step_that_is_not_a_json_object_is_refused() {
        for json in [
            "[]",
            "[[]]",
            r#"[[{"id":"a","tool":"echo"}]]"#,
            "null",
            "1",
            r#""plan""#,
            r#"{"steps":[["a","echo"]]}"#,
            r#"{"steps":[["a","echo",{},[]]]}"#,
            r#"{"steps":["a"]}"#,
        ] {
            let e = Plan::parse(json).unwrap_err();
            assert!(matches!(e, PlanError::Json(_)), "{json}: {e}");
            assert_eq!(e.field(), "plan_json", "{json}");
        }
        let e = Plan::parse("[]").unwrap_err();
        assert!(e.to_string().contains("a plan as a JSON object"), "{e}");
        let e = Plan::parse(r#"{"steps":[["a","echo"]]}"#).unwrap_err();
        assert!(e.to_string().contains("a plan step as a JSON object"), "{e}");
        // Ledger payloads are read back through `from_value`; objects still round-trip.
        let plan = Plan::parse(r#"{"steps":[{"id":"a","tool":"echo","depends_on":[]}],"reasoning":"r"}"#).unwrap();
        let back: Plan = serde_json::from_value(serde_json::to_value(&plan).unwrap()).unwrap();
        assert_eq!(back, plan);
        assert!(serde_json::from_value::<Plan>(serde_json::json!([])).is_err());
    }

    #[test]
    fn a_20000_step_chain_referencing_its_first_step_validates_in_linear_memory() {
        let n = 20_000;
        let mut steps: Vec<PlanStep> = (0..n)
            .map(|i| PlanStep {
                id: format!("s{i}"),
                tool: "echo".into(),
                subgoal: None,
                params: empty_object(),
                depends_on: if i == 0 { Vec::new() } else { vec![format!("s{}", i - 1)] },
                alternatives: Vec::new(),
            })
            .collect();
        if let Some(last) = steps.last_mut() {
            last.params = serde_json::json!({"v": "{{s0.output}}"});
        }
        let plan = Plan { steps, reasoning: None, direct_response: None, max_depth: None };
        let order = plan.validate(&PlanLimits { max_steps: n, known_tool: &known }).unwrap();
        assert_eq!(order, (0..n).collect::<Vec<_>>());
    }

    #[test]
    fn a_reference_to_a_step_beside_the_dependency_chain_is_refused() {
        // `c` depends on `b`, which depends on `a`; `x` is reachable from nothing `c` needs.
        let e = check(
            r#"{"steps":[{"id":"a","tool":"echo"},{"id":"x","tool":"echo"},
                         {"id":"b","tool":"echo","depends_on":["a"]},
                         {"id":"c","tool":"echo","depends_on":["b"],
                          "params":{"v":"{{a.output}} {{b.output}} {{x.output}}"}}]}"#,
        )
        .unwrap_err();
        assert_eq!(e, PlanError::ReferenceNotDependency { step_id: "c".into(), referenced: "x".into() });
        // A diamond: both branches lead to `a`, visited once each walk.
        check(
            r#"{"steps":[{"id":"a","tool":"echo"},
                         {"id":"b","tool":"echo","depends_on":["a"],"params":{"v":"{{a.output}}"}},
                         {"id":"c","tool":"echo","depends_on":["a"]},
                         {"id":"d","tool":"echo","depends_on":["b","c"],"params":{"v":"{{a.output}}{{c.output}}"}}]}"#,
        )
        .unwrap();
        let e = check(r#"{"steps":[{"id":"a","tool":"echo","params":{"v":"{{a.output}}"}}]}"#).unwrap_err();
        assert_eq!(e, PlanError::ReferenceNotDependency { step_id: "a".into(), referenced: "a".into() });
    }
}
