//! The execution trace of a run (seed 000's trace contract, DESIGN's trace DAG), derived from
//! its ledger events: one node per step — appended once per `step_id`, never overwritten —
//! with every attempt in the order it happened (its decision, request and outcome), the
//! step's policy and approval events, and the plan's dependency edges.
//!
//! A step that names alternatives moves along its branches (seed 001): each attempt says which
//! branch it belongs to, and `branches` when each began and why. [`crate::dag`] turns the
//! trace into seed 001's execution DAG (frames, branches, attempts, results).

use serde::Serialize;
use serde_json::Value;

use crate::events;
use crate::plan::Plan;

/// One ledger event, as the trace needs it.
pub struct TraceEvent<'a> {
    pub seq: u64,
    pub event_type: &'a str,
    pub step_id: &'a str,
    pub payload: &'a Value,
    pub timestamp_ms: i64,
}

impl<'a> TraceEvent<'a> {
    /// `events` as `(event_type, step_id, payload)`, numbered from seq 1 at time 0 (a trace
    /// built from literal events, as tests and tools write them).
    pub fn numbered(events: &'a [(&'a str, &'a str, Value)]) -> Vec<TraceEvent<'a>> {
        events
            .iter()
            .enumerate()
            .map(|(i, (t, s, p))| TraceEvent {
                seq: i as u64 + 1,
                event_type: t,
                step_id: s,
                payload: p,
                timestamp_ms: 0,
            })
            .collect()
    }
}

#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Decision {
    pub seq: u64,
    pub decision_id: String,
    pub outcome: String,
    pub rule_id: String,
    pub reason: String,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Attempt {
    pub attempt: u32,
    /// The branch the attempt belongs to (0: the step's own call; n: its n-th alternative).
    #[serde(skip_serializing_if = "is_zero")]
    pub branch: u32,
    /// The tool the attempt called (its branch's).
    #[serde(skip_serializing_if = "String::is_empty")]
    pub tool: String,
    /// The allow this attempt ran under (its last decision).
    pub decision: Option<Decision>,
    pub requested_at_ms: Option<i64>,
    pub ended_at_ms: Option<i64>,
    /// ok, error, denied, cancelled, blocked, or unknown (requested, no outcome yet).
    pub outcome: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub output: Option<Value>,
    /// An output stored by reference: `{"sha256", "bytes"}` (`Runs.GetStepOutput` reads it).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub output_ref: Option<Value>,
    /// Why the output was withheld (`[Output sanitized]`): the rule, field, reason, digest.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sanitized: Option<Value>,
    /// Present when another attempt follows (`next_attempt`, `backoff_ms`, `retry_of`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub retry: Option<Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reconciled_by: Option<String>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct StepNode {
    pub step_id: String,
    pub tool: String,
    pub input_params: Value,
    /// pending, running, completed, failed, denied, cancelled (the last attempt's verdict).
    pub status: String,
    /// The planning round that planned the step (0: the first plan; N: replanning round N).
    #[serde(skip_serializing_if = "is_zero")]
    pub round: u32,
    pub attempts: Vec<Attempt>,
    /// Every decision on this step, in order (including approval waits and retries).
    pub policy_events: Vec<Decision>,
    /// Approval waits and their resolutions.
    pub approval_events: Vec<Value>,
    /// The step's alternatives it moved to, in order (`step_branched`): `{"branch", "tool",
    /// "attempt", "after", "failed_kind", "seq"}`. Empty while it stays on its own call.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub branches: Vec<Value>,
    /// A sub-goal step's child frame: `{"child_run_id", "subgoal", "depth", "status"}`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub frame: Option<Value>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Edge {
    pub from: String,
    pub to: String,
    pub kind: &'static str,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct RunTrace {
    pub run_id: String,
    pub status: String,
    pub reason: String,
    pub started_at_ms: Option<i64>,
    pub ended_at_ms: Option<i64>,
    pub steps: Vec<StepNode>,
    pub edges: Vec<Edge>,
    /// Run-level events in order: `seq`, `event_type`, `timestamp_ms`.
    pub run_events: Vec<Value>,
    /// The run's model calls (seed 000 §14), in order: each recorded call once, with the
    /// replays of it marked on it.
    pub llm_calls: Vec<LlmCall>,
    /// Planning rounds: which plan each produced and how (model, replay, fallback).
    pub plan_rounds: Vec<Value>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct LlmCall {
    pub seq: u64,
    pub step_key: String,
    pub provider: String,
    pub model: String,
    /// ok (an answer, valid or not), failed, or pending (requested, no answer recorded).
    pub outcome: String,
    pub input_tokens: u64,
    pub output_tokens: u64,
    pub cost: f64,
    pub latency_ms: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub validation_error: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Times the recorded answer was used again instead of asking (replays, drift replays).
    pub replayed: u32,
    pub replayed_with_drift: bool,
}

fn text(p: &Value, k: &str) -> String {
    p.get(k).and_then(Value::as_str).unwrap_or_default().to_string()
}

fn attempt_of(p: &Value) -> u32 {
    p.get("attempt").and_then(Value::as_u64).map_or(1, |a| a.clamp(1, u32::MAX as u64) as u32)
}

impl StepNode {
    /// The branch the step is on and its tool.
    fn current_branch(&self) -> (u32, String) {
        match self.branches.last() {
            Some(b) => (b.get("branch").and_then(Value::as_u64).unwrap_or(0) as u32, text(b, "tool")),
            None => (0, self.tool.clone()),
        }
    }

    /// The node's attempt `n`, appended in order on first mention (on the current branch).
    fn attempt(&mut self, n: u32) -> &mut Attempt {
        let i = match self.attempts.iter().position(|a| a.attempt == n) {
            Some(i) => i,
            None => {
                let (branch, tool) = self.current_branch();
                self.attempts.push(Attempt {
                    attempt: n,
                    branch,
                    tool,
                    outcome: "pending".into(),
                    ..Attempt::default()
                });
                self.attempts.len() - 1
            }
        };
        &mut self.attempts[i]
    }
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// One node per step of `plan` (of planning round `round`) and its dependency edges; a step
/// already in the trace (kept from an earlier round) keeps its node.
fn add_plan(t: &mut RunTrace, plan: &Plan, round: u32) {
    for s in &plan.steps {
        if t.steps.iter().any(|n| n.step_id == s.id) {
            continue;
        }
        t.steps.push(StepNode {
            step_id: s.id.clone(),
            tool: s.tool.clone(),
            input_params: s.params.clone(),
            status: "pending".into(),
            round,
            ..StepNode::default()
        });
        t.edges.extend(s.depends_on.iter().map(|d| Edge { from: d.clone(), to: s.id.clone(), kind: "depends_on" }));
    }
}

/// Folds a model event into `llm_calls`; true when `e` was one.
fn model_event(t: &mut RunTrace, e: &TraceEvent<'_>) -> bool {
    let p = e.payload;
    let key = text(p, "step_key");
    let call = |t: &mut RunTrace| t.llm_calls.iter().rposition(|c| c.step_key == key);
    match e.event_type {
        events::MODEL_REQUESTED => t.llm_calls.push(LlmCall {
            seq: e.seq,
            step_key: key.clone(),
            provider: text(p, "provider"),
            model: text(p, "model"),
            outcome: "pending".into(),
            ..LlmCall::default()
        }),
        events::MODEL_COMPLETED | events::MODEL_FAILED => {
            if let Some(i) = call(t) {
                let c = &mut t.llm_calls[i];
                c.outcome = if e.event_type == events::MODEL_COMPLETED { "ok" } else { "failed" }.into();
                c.input_tokens = p["usage"]["input_tokens"].as_u64().unwrap_or_default();
                c.output_tokens = p["usage"]["output_tokens"].as_u64().unwrap_or_default();
                c.cost = p.get("cost").and_then(Value::as_f64).unwrap_or_default();
                c.latency_ms = p.get("latency_ms").and_then(Value::as_u64).unwrap_or_default();
                c.validation_error = p.get("validation_error").and_then(Value::as_str).map(str::to_string);
                c.error = p.get("error").and_then(Value::as_str).map(str::to_string);
            }
        }
        events::MODEL_REPLAYED | events::REPLAYED_WITH_DRIFT => {
            if let Some(i) = call(t) {
                t.llm_calls[i].replayed += 1;
                t.llm_calls[i].replayed_with_drift |= e.event_type == events::REPLAYED_WITH_DRIFT;
            }
        }
        _ => return false,
    }
    true
}

/// Builds the trace of `run_id` from its events, in seq order.
pub fn build(run_id: &str, events_in_order: &[TraceEvent<'_>]) -> RunTrace {
    let mut t = RunTrace { run_id: run_id.to_string(), status: "pending".into(), ..RunTrace::default() };
    for e in events_in_order {
        let p = e.payload;
        if let Some(st) = events::status_after(e.event_type) {
            t.status = st.as_str().to_string();
            t.reason = text(p, "reason");
            if st.is_terminal() {
                t.ended_at_ms = Some(e.timestamp_ms);
            }
        }
        if e.event_type == events::RUN_SUBMITTED
            && let Some(plan) = p.get("plan").and_then(|v| serde_json::from_value::<Plan>(v.clone()).ok())
        {
            add_plan(&mut t, &plan, 0);
        }
        if e.event_type == events::RUN_STARTED && t.started_at_ms.is_none() {
            t.started_at_ms = Some(e.timestamp_ms);
        }
        if model_event(&mut t, e) {
            continue;
        }
        if e.event_type == events::PLAN_CREATED
            && let Some(plan) = p.get("plan").and_then(|v| serde_json::from_value::<Plan>(v.clone()).ok())
        {
            t.plan_rounds.push(serde_json::json!({
                "seq": e.seq, "round": t.plan_rounds.len(), "source": text(p, "source"), "steps": plan.steps.len(),
                "direct_response": plan.direct_response.is_some(), "reason": text(p, "reason"),
            }));
            add_plan(&mut t, &plan, 0);
        }
        if e.event_type == events::PLAN_REVISED
            && let Some(plan) = p.get("plan").and_then(|v| serde_json::from_value::<Plan>(v.clone()).ok())
        {
            let round = p.get("round").and_then(Value::as_u64).unwrap_or_default() as u32;
            t.plan_rounds.push(serde_json::json!({
                "seq": e.seq, "round": round, "source": text(p, "source"),
                "steps": p.get("steps").cloned().unwrap_or_default(),
                "replaces": p.get("replaces").cloned().unwrap_or_default(),
                "renamed": p.get("renamed").cloned().unwrap_or_default(),
                "after": text(p, "after"),
            }));
            // The failed steps a round replaces lead to it: an edge from each to its new steps.
            let new_steps: Vec<String> =
                p.get("steps").and_then(|v| serde_json::from_value(v.clone()).ok()).unwrap_or_default();
            let replaces: Vec<String> =
                p.get("replaces").and_then(|v| serde_json::from_value(v.clone()).ok()).unwrap_or_default();
            add_plan(&mut t, &plan, round);
            for from in &replaces {
                for to in &new_steps {
                    t.edges.push(Edge { from: from.clone(), to: to.clone(), kind: "replanned_as" });
                }
            }
        }
        let node = (!e.step_id.is_empty()).then(|| t.steps.iter_mut().find(|s| s.step_id == e.step_id)).flatten();
        let Some(node) = node else {
            t.run_events.push(serde_json::json!({
                "seq": e.seq, "event_type": e.event_type, "timestamp_ms": e.timestamp_ms,
            }));
            continue;
        };
        let n = attempt_of(p);
        match e.event_type {
            events::POLICY_DECISION => {
                let d = Decision {
                    seq: e.seq,
                    decision_id: text(p, "decision_id"),
                    outcome: text(p, "outcome"),
                    rule_id: text(p, "rule_id"),
                    reason: text(p, "reason"),
                };
                if d.outcome == "approval_required" {
                    node.approval_events.push(serde_json::json!({
                        "seq": e.seq, "kind": "requested", "decision_id": d.decision_id, "reason": d.reason,
                    }));
                    node.status = "blocked".into();
                }
                node.policy_events.push(d.clone());
                let a = node.attempt(n);
                if d.outcome == "approval_required" {
                    a.outcome = "blocked".into();
                }
                a.decision = Some(d);
            }
            events::RUN_RESUMED => {
                node.approval_events.push(serde_json::json!({
                    "seq": e.seq, "kind": "resolved", "approval_id": text(p, "approval_id"),
                    "state": text(p, "state"), "approver": text(p, "approver"),
                }));
            }
            events::TOOL_REQUESTED => {
                node.status = "running".into();
                let a = node.attempt(n);
                a.requested_at_ms = Some(e.timestamp_ms);
                a.outcome = "unknown".into();
            }
            events::TOOL_COMPLETED => {
                node.status = "completed".into();
                let a = node.attempt(n);
                a.ended_at_ms = Some(e.timestamp_ms);
                a.outcome = "ok".into();
                a.output = p.get("output").cloned();
                a.output_ref = p.get("output_ref").cloned();
                a.sanitized = p.get("sanitized").cloned();
                a.reconciled_by = p.get("reconciled_by").and_then(Value::as_str).map(str::to_string);
            }
            events::TOOL_FAILED | events::STEP_FAILED => {
                let denied = text(p, "kind") == "policy_denied";
                let retry = p.get("retry").cloned();
                node.status = match (&retry, denied) {
                    (Some(_), _) => "pending",
                    (None, true) => "denied",
                    (None, false) => "failed",
                }
                .into();
                let a = node.attempt(n);
                a.ended_at_ms = Some(e.timestamp_ms);
                a.outcome = if denied { "denied" } else { "error" }.into();
                a.error = Some(text(p, "reason"));
                a.retry = retry;
                a.reconciled_by = p.get("reconciled_by").and_then(Value::as_str).map(str::to_string);
            }
            events::FRAME_OPENED => {
                node.status = "running".into();
                let mut f = p.clone();
                f["status"] = Value::from("running");
                f["opened_at_ms"] = Value::from(e.timestamp_ms);
                node.frame = Some(f);
            }
            events::FRAME_CLOSED => {
                let status = text(p, "status");
                node.status = if status == "completed" { "completed" } else { "failed" }.into();
                if let Some(f) = node.frame.as_mut() {
                    f["status"] = Value::from(status);
                    f["closed_at_ms"] = Value::from(e.timestamp_ms);
                    if let Some(reason) = p.get("reason") {
                        f["reason"] = reason.clone();
                    }
                }
            }
            events::STEP_BRANCHED => {
                node.status = "pending".into();
                let mut b = p.clone();
                b["seq"] = Value::from(e.seq);
                node.branches.push(b);
            }
            events::STEP_CANCELLED => {
                node.status = "cancelled".into();
                // The attempt that was cancelled: the open one, else the next (a finished
                // attempt — a failure waiting for its retry — is never overwritten).
                let n = match node.attempts.last() {
                    None => 1,
                    Some(a) if a.ended_at_ms.is_none() => a.attempt,
                    Some(a) => a.attempt + 1,
                };
                let a = node.attempt(n);
                a.ended_at_ms = Some(e.timestamp_ms);
                a.outcome = "cancelled".into();
                a.error = Some(text(p, "reason"));
            }
            _ => {}
        }
    }
    t
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn one_node_per_step_and_every_attempt_in_order() {
        let plan = json!({"plan": {"steps": [
            {"id": "a", "tool": "flaky", "params": {"n": 1}},
            {"id": "b", "tool": "echo", "depends_on": ["a"]}
        ]}});
        let evs = [
            (events::RUN_SUBMITTED, "", plan),
            (events::RUN_STARTED, "", json!({})),
            (
                events::POLICY_DECISION,
                "a",
                json!({"attempt": 1, "decision_id": "d1", "outcome": "allow", "rule_id": "r"}),
            ),
            (events::TOOL_REQUESTED, "a", json!({"attempt": 1})),
            (events::TOOL_FAILED, "a", json!({"attempt": 1, "reason": "boom", "retry": {"next_attempt": 2}})),
            (
                events::POLICY_DECISION,
                "a",
                json!({"attempt": 2, "decision_id": "d2", "outcome": "allow", "rule_id": "retry"}),
            ),
            (events::TOOL_REQUESTED, "a", json!({"attempt": 2})),
            (events::TOOL_COMPLETED, "a", json!({"attempt": 2, "output": {"ok": true}})),
            (events::STEP_CANCELLED, "b", json!({"reason": "the run was cancelled"})),
            (events::RUN_CANCELLED, "", json!({"reason": "stop"})),
        ];
        let owned: Vec<TraceEvent<'_>> = evs
            .iter()
            .enumerate()
            .map(|(i, (t, s, p))| TraceEvent {
                seq: i as u64 + 1,
                event_type: t,
                step_id: s,
                payload: p,
                timestamp_ms: i as i64,
            })
            .collect();
        let t = build("r1", &owned);
        assert_eq!((t.status.as_str(), t.reason.as_str()), ("cancelled", "stop"));
        assert_eq!(t.steps.len(), 2, "one node per step");
        let a = &t.steps[0];
        assert_eq!(a.status, "completed");
        let outcomes: Vec<(u32, &str)> = a.attempts.iter().map(|x| (x.attempt, x.outcome.as_str())).collect();
        assert_eq!(outcomes, [(1, "error"), (2, "ok")]);
        assert_eq!(a.attempts[1].decision.as_ref().map(|d| d.rule_id.as_str()), Some("retry"));
        assert_eq!(a.policy_events.len(), 2);
        assert_eq!(t.steps[1].status, "cancelled");
        assert_eq!(t.edges, [Edge { from: "a".into(), to: "b".into(), kind: "depends_on" }]);
        assert_eq!((t.started_at_ms, t.ended_at_ms), (Some(1), Some(9)));

        // Cancelled while waiting to retry: the failed attempt stays as it was.
        let more = [
            (events::POLICY_DECISION, "a", json!({"attempt": 1, "decision_id": "d1", "outcome": "allow"})),
            (events::TOOL_REQUESTED, "a", json!({"attempt": 1})),
            (events::TOOL_FAILED, "a", json!({"attempt": 1, "reason": "boom", "retry": {"next_attempt": 2}})),
            (events::STEP_CANCELLED, "a", json!({"reason": "the run was cancelled"})),
        ];
        let mut all: Vec<TraceEvent<'_>> = owned.into_iter().take(2).collect();
        all.extend(more.iter().enumerate().map(|(i, (t, s, p))| TraceEvent {
            seq: i as u64 + 3,
            event_type: t,
            step_id: s,
            payload: p,
            timestamp_ms: 0,
        }));
        let t = build("r1", &all);
        let outcomes: Vec<(u32, &str)> = t.steps[0].attempts.iter().map(|x| (x.attempt, x.outcome.as_str())).collect();
        assert_eq!(outcomes, [(1, "error"), (2, "cancelled")]);
    }

    #[test]
    fn model_calls_and_plan_rounds_of_a_goal_run() {
        let raw = [
            (events::RUN_SUBMITTED, "", json!({"goal": "say hi"})),
            (events::MODEL_REQUESTED, "plan-r0", json!({"step_key": "plan:r0:a1", "provider": "openai", "model": "m"})),
            (
                events::MODEL_COMPLETED,
                "plan-r0",
                json!({"step_key": "plan:r0:a1", "usage": {"input_tokens": 7, "output_tokens": 3}, "cost": 0.5, "latency_ms": 40, "validation_error": "bad"}),
            ),
            (events::MODEL_REQUESTED, "plan-r0", json!({"step_key": "plan:r0:a2", "provider": "openai", "model": "m"})),
            (
                events::MODEL_COMPLETED,
                "plan-r0",
                json!({"step_key": "plan:r0:a2", "usage": {"input_tokens": 9, "output_tokens": 4}}),
            ),
            (events::PLAN_CREATED, "", json!({"source": "model", "plan": {"steps": [{"id": "a", "tool": "echo"}]}})),
            (events::MODEL_REPLAYED, "plan-r0", json!({"step_key": "plan:r0:a2"})),
        ];
        let evs = TraceEvent::numbered(&raw);
        let t = build("r", &evs);
        let calls: Vec<(&str, &str, u64, u32)> =
            t.llm_calls.iter().map(|c| (c.step_key.as_str(), c.outcome.as_str(), c.input_tokens, c.replayed)).collect();
        assert_eq!(calls, [("plan:r0:a1", "ok", 7, 0), ("plan:r0:a2", "ok", 9, 1)]);
        assert_eq!(t.llm_calls[0].validation_error.as_deref(), Some("bad"));
        assert_eq!(t.plan_rounds.len(), 1);
        assert_eq!(t.plan_rounds[0]["source"], "model");
        assert_eq!(t.steps.len(), 1, "the plan's steps become nodes");
        assert!(t.steps.iter().all(|s| s.step_id != "plan-r0"), "model events are no step");
    }
}
