//! Plans (seed 000 §3): `steps`, `reasoning`, `direct_response`, and their validation.
//!
//! Validation happens before anything is recorded: unknown fields, bad or duplicate ids,
//! unknown tools, missing dependencies, cycles, malformed templates, references to steps that
//! are not dependencies, and more than `max_steps` steps are all refused, each error naming
//! the step and the field. Over-long plans are an error for the planner to fix, never a
//! silent truncation.

use std::collections::{HashMap, HashSet, VecDeque};

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::ids::check_step_id;
use crate::template::{self, TemplateError};

/// Default upper bound on steps in one plan.
pub const DEFAULT_MAX_STEPS: usize = 10;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Plan {
    #[serde(default)]
    pub steps: Vec<PlanStep>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning: Option<String>,
    /// When present the run returns it without executing anything (seed 000 §3).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub direct_response: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PlanStep {
    pub id: String,
    pub tool: String,
    #[serde(default = "empty_object")]
    pub params: Value,
    #[serde(default)]
    pub depends_on: Vec<String>,
}

fn empty_object() -> Value {
    Value::Object(Default::default())
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
        }
    }
}

impl Plan {
    /// Parses plan JSON strictly (unknown fields are refused).
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
        let mut index: HashMap<&str, usize> = HashMap::with_capacity(self.steps.len());
        for (i, s) in self.steps.iter().enumerate() {
            check_step_id(&s.id).map_err(|e| PlanError::InvalidStepId {
                index: i,
                id: s.id.clone(),
                reason: e.to_string(),
            })?;
            if index.insert(&s.id, i).is_some() {
                return Err(PlanError::DuplicateStep { step_id: s.id.clone() });
            }
        }
        for s in &self.steps {
            if !(limits.known_tool)(&s.tool) {
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
        }
        let order = self.topological_order(&index)?;
        // References must point at ancestors, so their outputs exist when the step runs.
        let mut ancestors: Vec<HashSet<usize>> = vec![HashSet::new(); self.steps.len()];
        for &i in &order {
            let mut mine = HashSet::new();
            for d in &self.steps[i].depends_on {
                let di = index[d.as_str()];
                mine.insert(di);
                mine.extend(ancestors[di].iter().copied());
            }
            ancestors[i] = mine;
        }
        for (i, s) in self.steps.iter().enumerate() {
            let refs = template::references(&s.params)
                .map_err(|error| PlanError::Template { step_id: s.id.clone(), error })?;
            for r in refs {
                let ok = index.get(r.step_id.as_str()).is_some_and(|ri| ancestors[i].contains(ri));
                if !ok {
                    return Err(PlanError::ReferenceNotDependency { step_id: s.id.clone(), referenced: r.step_id });
                }
            }
        }
        Ok(order)
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

#[cfg(test)]
mod tests {
    use super::*;

    fn known(t: &str) -> bool {
        matches!(t, "echo" | "text.upper")
    }

    fn check(json: &str) -> Result<Vec<usize>, PlanError> {
        Plan::parse(json)?.validate(&PlanLimits { max_steps: 10, known_tool: &known })
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
}
