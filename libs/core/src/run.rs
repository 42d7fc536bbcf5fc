//! The fold of a run's events into its current state: what the executor rebuilds after a
//! takeover (completed outputs are reused, never re-executed) and what `GetRun` reports.

use std::collections::{BTreeMap, HashMap};

use serde_json::Value;

use crate::events::{self, RunStatus};
use crate::plan::Plan;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepStatus {
    Pending,
    /// A decision or tool request is recorded but no outcome yet.
    Running,
    Completed,
    Failed,
    Cancelled,
    Denied,
}

#[derive(Debug, Clone, PartialEq)]
pub struct StepView {
    pub id: String,
    pub tool: String,
    pub status: StepStatus,
    pub output: Option<Value>,
    /// An output stored by reference (`output_ref` of its `tool_completed`): its SHA-256 and
    /// size. `output` is then `None`; the ledger holds it.
    pub output_ref: Option<(String, u64)>,
    pub error: Option<String>,
    pub attempts: u32,
    /// `tool_requested` was recorded for the latest attempt and no outcome followed.
    pub outcome_unknown: bool,
    /// Idempotency key of the latest tool request.
    pub idempotency_key: Option<String>,
    /// Once an attempt failed and another follows: the allow decision of the first attempt,
    /// which every retry names (policy and approval skip on retry).
    pub retry_of: Option<String>,
    /// When the pending retry may start (Unix ms), so a successor keeps the backoff.
    pub retry_not_before_ms: Option<i64>,
    /// The call the step's latest decision or request was about, as [`call_fingerprint`]
    /// gives it.
    pub call: Option<String>,
    /// The branch the step is on (seed 001): 0 its own call, n its n-th alternative.
    pub branch: u32,
    /// A sub-goal step's child frame (its goal run), once opened (`frame_opened`).
    pub frame_run_id: Option<String>,
    /// The first attempt of the branch the step is on (retries count within a branch).
    pub branch_first_attempt: u32,
    /// The attempt of the call `call` names.
    pub call_attempt: u32,
    /// The attempt the step's last final failure was recorded under.
    pub failed_attempt: u32,
    /// How the step's last attempt failed for good (`kind`), while it stands failed: a step
    /// with alternatives left that failed so moves to its next one.
    pub failed_kind: Option<String>,
}

/// Whether a step whose call failed this way moves to its next alternative: any failure for
/// good of the call itself does; an outage of the policy or the catalog, which every
/// alternative would meet too, does not.
pub fn branches_on(kind: &str) -> bool {
    !matches!(kind, "policy_unavailable" | "tool_catalog_unavailable" | "")
}

/// Whether failure memory keeps a call that failed this way: failures of the call itself
/// (its tool's error, a denial, a refusal of its authorization, an unusable output), not an
/// outage the call met.
pub fn memorable_failure(kind: &str) -> bool {
    matches!(
        kind,
        "tool_error"
            | "policy_denied"
            | "authorization_refused"
            | "invalid_output"
            | "output_rejected"
            | "invalid_arguments"
    )
}

/// A call as failure memory knows it: its tool and the SHA-256 of its canonical arguments.
pub fn call_fingerprint(tool: &str, args_sha256: &str) -> String {
    format!("{tool}@{args_sha256}")
}

impl StepView {
    fn pending(id: &str, tool: &str) -> StepView {
        StepView {
            id: id.to_string(),
            tool: tool.to_string(),
            status: StepStatus::Pending,
            output: None,
            output_ref: None,
            error: None,
            attempts: 0,
            outcome_unknown: false,
            idempotency_key: None,
            retry_of: None,
            retry_not_before_ms: None,
            call: None,
            branch: 0,
            frame_run_id: None,
            branch_first_attempt: 1,
            call_attempt: 0,
            failed_attempt: 0,
            failed_kind: None,
        }
    }

    /// The attempt a driver starts this pending step with, and the allow it retries: the
    /// same attempt when its outcome is unknown (asked again with the same key), the next one
    /// after a failure that is retried, else the first.
    pub fn next_attempt(&self) -> (u32, Option<String>) {
        match (&self.retry_of, self.outcome_unknown) {
            (_, true) => (self.attempts.max(1), self.retry_of.clone().filter(|_| self.attempts > 1)),
            (Some(first), false) => (self.attempts + 1, Some(first.clone())),
            // A fresh step starts at 1; one that moved to an alternative goes on counting (its
            // branch's first attempt is recorded with the branch).
            (None, false) => (self.attempts + 1, None),
        }
    }
}

/// A tool's declaration as a run pinned it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PinnedTool {
    pub version: String,
    /// SHA-256 of the whole declaration (see `ToolSpec.effect` in the contract).
    pub sha256: String,
    pub effect: String,
}

#[derive(Debug, Clone, PartialEq)]
pub struct RunView {
    pub plan: Option<Plan>,
    /// A goal run's goal (as recorded, redacted), from `run_submitted`; its plan comes from
    /// `plan_created`.
    pub goal: Option<String>,
    /// A goal run's replay policy (the proto enum's number; 0 is strict).
    pub replay_policy: i32,
    /// The agent the run acts for (empty: the tenant itself), from `run_submitted`.
    pub agent: String,
    /// The run's cancel policy (the proto enum's number), from `run_submitted`.
    pub cancel_policy: i64,
    /// Why the run is to be cancelled, once someone asked (`run_cancel_requested`).
    pub cancel_requested: Option<String>,
    /// Replanning rounds recorded (`plan_revised`); 0 while the first plan stands.
    pub round: u32,
    /// The tools' declarations the run pinned (`tools_pinned`), by tool name.
    pub pinned: BTreeMap<String, PinnedTool>,
    /// Why the run is to be paused, while a pause was asked for (`run_pause_requested`) and
    /// has not taken effect yet (`run_paused` clears it).
    pub pause_requested: Option<String>,
    pub status: RunStatus,
    pub reason: String,
    pub steps: Vec<StepView>,
    pub last_seq: u64,
    /// Outages the driver is waiting out, by the step (or planning round) that waits: what
    /// each `run_waiting` said, until that step's next event (or the run's end).
    pub waiting: BTreeMap<String, String>,
    /// Failure memory (seed 001): every call (`call_fingerprint`) that was decided and then
    /// failed or was denied for good in this run, with the step it failed as. The same call is
    /// never attempted again in the run, whatever step a later plan proposes it as.
    pub failed_calls: BTreeMap<String, String>,
    /// Where the run stands among frames (seed 001), from `run_submitted`'s `frame`: a root
    /// run is depth 0; a child frame knows its depth, the bound it inherited and the goals
    /// (SHA-256) of the frames above it.
    pub frame: FramePosition,
}

impl FramePosition {
    /// The position of a child frame opened by a run at `self` (whose own goal is `goal`),
    /// bounded by `max_depth`, from `step_id` of `run_id`.
    pub fn child(&self, run_id: &str, step_id: &str, goal: Option<&str>, max_depth: u32) -> FramePosition {
        let mut goals = self.goals.clone();
        goals.push(crate::sha256_hex(goal.unwrap_or_default().as_bytes()));
        FramePosition {
            depth: self.depth + 1,
            max_depth: Some(self.max_depth.unwrap_or(max_depth)),
            goals,
            root_run_id: if self.root_run_id.is_empty() { run_id.to_string() } else { self.root_run_id.clone() },
            parent_run_id: run_id.to_string(),
            step_id: step_id.to_string(),
        }
    }
}

/// A run's place among frames (see [`RunView::frame`]).
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct FramePosition {
    #[serde(default)]
    pub depth: u32,
    /// The bound inherited from the root (`None` at a root: its plan's `max_depth`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_depth: Option<u32>,
    /// SHA-256 of the goals of the frames above, root first.
    #[serde(default)]
    pub goals: Vec<String>,
    /// The root run of the frame tree: its budget is the whole tree's (seed 001: a child
    /// inherits the remaining budget minus what was spent).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub root_run_id: String,
    /// The run and step that opened this frame.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub parent_run_id: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub step_id: String,
}

impl Default for RunView {
    fn default() -> Self {
        RunView {
            plan: None,
            goal: None,
            replay_policy: 0,
            agent: String::new(),
            cancel_policy: 0,
            cancel_requested: None,
            pause_requested: None,
            round: 0,
            pinned: BTreeMap::new(),
            status: RunStatus::Pending,
            reason: String::new(),
            steps: Vec::new(),
            last_seq: 0,
            waiting: BTreeMap::new(),
            failed_calls: BTreeMap::new(),
            frame: FramePosition::default(),
        }
    }
}

fn str_field<'a>(payload: &'a Value, key: &str) -> Option<&'a str> {
    payload.get(key).and_then(Value::as_str)
}

impl RunView {
    /// Applies one event, in seq order.
    pub fn apply(&mut self, seq: u64, event_type: &str, step_id: &str, payload: &Value) {
        self.last_seq = seq;
        if let Some(st) = events::status_after(event_type) {
            self.status = st;
            self.reason = str_field(payload, "reason").unwrap_or_default().to_string();
            // A new driver (or the run's end) has waited for nothing yet.
            self.waiting.clear();
        }
        if event_type == events::RUN_WAITING {
            let on = str_field(payload, "on").unwrap_or("a service").to_string();
            self.waiting.insert(step_id.to_string(), on);
            return;
        }
        // Whatever the waiting step (or planning round) records next ends its wait; a late
        // record of a decision, which the policy writes on its own, says nothing of the driver.
        if event_type != events::POLICY_DECISION {
            self.waiting.remove(step_id);
        }
        if event_type == events::TOOLS_PINNED {
            if let Some(tools) = payload.get("tools").and_then(Value::as_object) {
                for (name, t) in tools {
                    let text = |k: &str| t.get(k).and_then(Value::as_str).unwrap_or_default().to_string();
                    // The first pin of a tool stands.
                    self.pinned.entry(name.clone()).or_insert(PinnedTool {
                        version: text("version"),
                        sha256: text("sha256"),
                        effect: text("effect"),
                    });
                }
            }
            return;
        }
        if event_type == events::PLAN_REVISED {
            if let Some(plan) = payload.get("plan").and_then(|p| serde_json::from_value::<Plan>(p.clone()).ok()) {
                self.revise_plan(plan);
            }
            self.round = payload.get("round").and_then(Value::as_u64).unwrap_or(self.round as u64 + 1) as u32;
            return;
        }
        if event_type == events::PLAN_CREATED {
            self.waiting.clear();
        }
        if event_type == events::RUN_CANCEL_REQUESTED {
            self.cancel_requested.get_or_insert_with(|| str_field(payload, "reason").unwrap_or_default().to_string());
            return;
        }
        if event_type == events::RUN_PAUSE_REQUESTED {
            self.pause_requested = Some(str_field(payload, "reason").unwrap_or_default().to_string());
            return;
        }
        if event_type == events::RUN_PAUSED {
            self.pause_requested = None;
            return;
        }
        if event_type == events::RUN_SUBMITTED {
            self.agent = str_field(payload, "agent").unwrap_or_default().to_string();
            self.cancel_policy = payload.get("cancel_policy").and_then(Value::as_i64).unwrap_or_default();
            self.goal = str_field(payload, "goal").map(str::to_string);
            self.replay_policy = payload.get("replay_policy").and_then(Value::as_i64).unwrap_or_default() as i32;
            if let Some(frame) = payload.get("frame").and_then(|f| serde_json::from_value(f.clone()).ok()) {
                self.frame = frame;
            }
            if let Some(plan) = payload.get("plan").and_then(|p| serde_json::from_value::<Plan>(p.clone()).ok()) {
                self.set_plan(plan);
            }
            return;
        }
        if event_type == events::PLAN_CREATED {
            if self.plan.is_none()
                && let Some(plan) = payload.get("plan").and_then(|p| serde_json::from_value::<Plan>(p.clone()).ok())
            {
                self.set_plan(plan);
            }
            return;
        }
        let Some(step) = self.steps.iter_mut().find(|s| s.id == step_id) else {
            return;
        };
        let mut memorized = None;
        let fingerprint = || Some(call_fingerprint(str_field(payload, "tool")?, str_field(payload, "args_sha256")?));
        match event_type {
            events::POLICY_DECISION => {
                if let Some(call) = fingerprint() {
                    step.call = Some(call);
                    step.call_attempt = payload.get("attempt").and_then(Value::as_u64).unwrap_or(1) as u32;
                }
            }
            events::TOOL_REQUESTED => {
                if let Some(call) = fingerprint() {
                    step.call = Some(call);
                    step.call_attempt = payload.get("attempt").and_then(Value::as_u64).unwrap_or(1) as u32;
                }
                step.status = StepStatus::Running;
                step.attempts = payload.get("attempt").and_then(Value::as_u64).unwrap_or(1) as u32;
                step.outcome_unknown = true;
                step.idempotency_key = str_field(payload, "idempotency_key").map(str::to_string);
            }
            events::TOOL_COMPLETED => {
                step.status = StepStatus::Completed;
                step.output = payload.get("output").cloned();
                step.output_ref = payload.get("output_ref").and_then(|r| {
                    Some((r.get("sha256")?.as_str()?.to_string(), r.get("bytes").and_then(Value::as_u64).unwrap_or(0)))
                });
                step.outcome_unknown = false;
            }
            events::TOOL_FAILED | events::STEP_FAILED => {
                let denied = str_field(payload, "kind") == Some("policy_denied");
                step.status = if denied { StepStatus::Denied } else { StepStatus::Failed };
                step.error = str_field(payload, "reason").map(str::to_string);
                step.outcome_unknown = false;
                // A failed attempt that another follows leaves the step pending.
                if let Some(first) = payload.get("retry").and_then(|r| r.get("retry_of")).and_then(Value::as_str) {
                    step.status = StepStatus::Pending;
                    step.retry_of = Some(first.to_string());
                    step.retry_not_before_ms = payload["retry"].get("not_before_ms").and_then(Value::as_i64);
                } else {
                    let kind = str_field(payload, "kind").unwrap_or_default();
                    step.failed_kind = Some(kind.to_string());
                    // Only the call that failed, by the attempt that failed, and only for a
                    // failure of the call itself.
                    let attempt = payload.get("attempt").and_then(Value::as_u64).unwrap_or(1) as u32;
                    step.failed_attempt = attempt;
                    if memorable_failure(kind)
                        && attempt == step.call_attempt
                        && let Some(call) = step.call.clone()
                    {
                        memorized = Some((call, step.id.clone()));
                    }
                }
            }
            events::FRAME_OPENED => {
                step.status = StepStatus::Running;
                step.frame_run_id = str_field(payload, "child_run_id").map(str::to_string);
            }
            events::FRAME_CLOSED => {
                if str_field(payload, "status") == Some("completed") {
                    step.status = StepStatus::Completed;
                    step.output = payload.get("output").cloned();
                } else {
                    step.status = StepStatus::Failed;
                    step.error = str_field(payload, "reason").map(str::to_string);
                }
            }
            events::STEP_BRANCHED => {
                step.status = StepStatus::Pending;
                step.branch = payload.get("branch").and_then(Value::as_u64).unwrap_or(0) as u32;
                let first = payload.get("attempt").and_then(Value::as_u64).unwrap_or(1) as u32;
                step.attempts = first.saturating_sub(1);
                step.branch_first_attempt = first;
                step.failed_kind = None;
                if let Some(tool) = str_field(payload, "tool") {
                    step.tool = tool.to_string();
                }
                step.retry_of = None;
                step.retry_not_before_ms = None;
                step.outcome_unknown = false;
            }
            events::STEP_CANCELLED => {
                step.status = StepStatus::Cancelled;
                step.error = str_field(payload, "reason").map(str::to_string);
                // Cancelled before its tool was invoked: nothing is left unknown.
                step.outcome_unknown = false;
            }
            _ => {}
        }
        if let Some((call, step_id)) = memorized {
            self.failed_calls.entry(call).or_insert(step_id);
        }
    }

    /// A replanning round's plan: the steps the run knows keep what they came to (a kept step
    /// completed; the failed ones it replaces stay on record, out of the plan), its new steps
    /// start pending.
    fn revise_plan(&mut self, plan: Plan) {
        for s in &plan.steps {
            if self.steps.iter().all(|v| v.id != s.id) {
                self.steps.push(StepView::pending(&s.id, &s.tool));
            }
        }
        self.plan = Some(plan);
    }

    /// Whether step `id` belongs to the plan the run follows now (a replanning round drops the
    /// failed steps it replaces).
    pub fn in_plan(&self, id: &str) -> bool {
        self.plan.as_ref().is_some_and(|p| p.step(id).is_some())
    }

    fn set_plan(&mut self, plan: Plan) {
        self.steps = plan.steps.iter().map(|s| StepView::pending(&s.id, &s.tool)).collect();
        self.plan = Some(plan);
    }

    /// Outputs of completed steps, by step id.
    pub fn outputs(&self) -> HashMap<String, Value> {
        self.steps
            .iter()
            .filter(|s| s.status == StepStatus::Completed)
            .map(|s| (s.id.clone(), s.output.clone().unwrap_or(Value::Null)))
            .collect()
    }

    pub fn step(&self, id: &str) -> Option<&StepView> {
        self.steps.iter().find(|s| s.id == id)
    }

    /// What the run is waiting out, each service once (`policy`, `tool_host`, …; empty: none).
    pub fn waiting_for(&self) -> Vec<String> {
        let mut on: Vec<String> = self.waiting.values().cloned().collect();
        on.sort();
        on.dedup();
        on
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// A run of two echo steps `a` and `b`, submitted and started (seq 1 and 2).
    fn started_two_step_run() -> RunView {
        let mut v = RunView::default();
        let plan = json!({"plan": {"steps": [{"id": "a", "tool": "echo"}, {"id": "b", "tool": "echo"}]}});
        v.apply(1, events::RUN_SUBMITTED, "", &plan);
        v.apply(2, events::RUN_STARTED, "", &json!({}));
        v
    }

    #[test]
    fn a_step_that_moved_to_an_alternative_resumes_on_it_counting_on() {
        let mut v = started_two_step_run();
        v.apply(3, events::TOOL_REQUESTED, "a", &json!({"attempt": 1, "tool": "echo", "args_sha256": "aa"}));
        v.apply(4, events::TOOL_FAILED, "a", &json!({"attempt": 1, "kind": "tool_error", "reason": "x"}));
        v.apply(5, events::STEP_BRANCHED, "a", &json!({"branch": 1, "tool": "text.upper", "attempt": 2}));
        let a = v.step("a").expect("a");
        assert_eq!((a.status, a.branch, a.tool.as_str()), (StepStatus::Pending, 1, "text.upper"));
        assert_eq!(a.next_attempt(), (2, None), "the branch's first attempt, not attempt 1 again");
        v.apply(6, events::TOOL_REQUESTED, "a", &json!({"attempt": 2, "tool": "text.upper", "args_sha256": "bb"}));
        assert_eq!(v.step("a").expect("a").next_attempt(), (2, None), "asked again under the same attempt");
    }

    #[test]
    fn failure_memory_keeps_each_call_that_failed_or_was_denied_for_good() {
        let mut v = started_two_step_run();
        let call = |tool: &str, sha: &str| json!({"tool": tool, "args_sha256": sha, "attempt": 1});
        v.apply(3, events::POLICY_DECISION, "a", &call("echo", "aa"));
        v.apply(4, events::TOOL_REQUESTED, "a", &call("echo", "aa"));
        // A failure another attempt follows is not memorized; the final one is.
        v.apply(5, events::TOOL_FAILED, "a", &json!({"kind": "tool_error", "retry": {"retry_of": "d1"}}));
        assert!(v.failed_calls.is_empty());
        v.apply(6, events::TOOL_FAILED, "a", &json!({"kind": "tool_error", "reason": "boom"}));
        v.apply(7, events::POLICY_DECISION, "b", &call("echo", "bb"));
        v.apply(8, events::STEP_FAILED, "b", &json!({"kind": "policy_denied", "reason": "no"}));
        let memorized: Vec<(&str, &str)> = v.failed_calls.iter().map(|(c, s)| (c.as_str(), s.as_str())).collect();
        assert_eq!(memorized, [("echo@aa", "a"), ("echo@bb", "b")]);
    }

    #[test]
    fn a_wait_lasts_until_the_waiting_step_records_again() {
        let mut v = started_two_step_run();
        v.apply(3, events::RUN_WAITING, "a", &json!({"on": "policy"}));
        v.apply(4, events::RUN_WAITING, "b", &json!({"on": "policy"}));
        assert_eq!(v.waiting_for(), vec!["policy".to_string()], "each service once");
        v.apply(5, events::POLICY_DECISION, "a", &json!({}));
        assert_eq!(v.waiting_for().len(), 1, "the policy's own record of a decision ends no wait");
        v.apply(6, events::TOOL_REQUESTED, "a", &json!({"attempt": 1}));
        assert_eq!(v.waiting.len(), 1, "b still waits");
        v.apply(7, events::RUN_WAITING, "a", &json!({"on": "tool_host"}));
        assert_eq!(v.waiting_for(), vec!["policy".to_string(), "tool_host".to_string()]);
        v.apply(8, events::RUN_STARTED, "", &json!({}));
        assert!(v.waiting_for().is_empty(), "a new driver has waited for nothing yet");
        v.apply(9, events::RUN_WAITING, "b", &json!({"on": "policy"}));
        v.apply(10, events::RUN_FAILED, "", &json!({"reason": "x"}));
        assert!(v.waiting_for().is_empty());
    }

    #[test]
    fn a_pause_is_pending_until_it_takes_effect_and_a_resume_makes_the_run_pending() {
        let mut v = started_two_step_run();
        v.apply(3, events::RUN_PAUSE_REQUESTED, "", &json!({"reason": "lunch"}));
        assert_eq!((v.status, v.pause_requested.as_deref()), (RunStatus::Active, Some("lunch")));
        v.apply(4, events::RUN_PAUSED, "", &json!({"reason": "paused: lunch"}));
        assert_eq!((v.status, v.pause_requested.as_deref()), (RunStatus::Paused, None));
        v.apply(5, events::RUN_RESUMED, "", &json!({"reason": ""}));
        assert_eq!(v.status, RunStatus::Pending);
        v.apply(6, events::RUN_STARTED, "", &json!({}));
        assert_eq!((v.status, v.pause_requested.as_deref()), (RunStatus::Active, None), "the pause is not asked again");
    }

    #[test]
    fn a_driver_resumes_a_step_at_the_right_attempt() {
        let mut v = RunView::default();
        v.apply(1, events::RUN_SUBMITTED, "", &json!({"plan": {"steps": [{"id": "a", "tool": "flaky"}]}}));
        assert_eq!(v.steps[0].next_attempt(), (1, None));
        v.apply(2, events::TOOL_REQUESTED, "a", &json!({"attempt": 1, "idempotency_key": "r:a:1"}));
        assert_eq!(v.steps[0].next_attempt(), (1, None), "unknown outcome: ask attempt 1 again");
        let retry =
            json!({"attempt": 1, "reason": "x", "retry": {"next_attempt": 2, "retry_of": "d1", "not_before_ms": 77}});
        v.apply(3, events::TOOL_FAILED, "a", &retry);
        assert_eq!(v.steps[0].status, StepStatus::Pending, "a retry follows");
        assert_eq!(v.steps[0].retry_not_before_ms, Some(77), "a successor keeps the backoff");
        assert_eq!(v.steps[0].next_attempt(), (2, Some("d1".into())));
        v.apply(4, events::TOOL_REQUESTED, "a", &json!({"attempt": 2, "idempotency_key": "r:a:2"}));
        assert_eq!(v.steps[0].next_attempt(), (2, Some("d1".into())), "attempt 2 asked again, still a retry");
        v.apply(5, events::TOOL_FAILED, "a", &json!({"attempt": 2, "reason": "final"}));
        assert_eq!(v.steps[0].status, StepStatus::Failed);
    }

    #[test]
    fn fold_tracks_steps_and_unknown_outcomes() {
        let mut v = started_two_step_run();
        v.apply(3, events::TOOL_REQUESTED, "a", &json!({"attempt": 1, "idempotency_key": "k"}));
        v.apply(4, events::TOOL_COMPLETED, "a", &json!({"output": {"x": 1}}));
        v.apply(5, events::TOOL_REQUESTED, "b", &json!({"attempt": 1}));
        assert_eq!(v.status, RunStatus::Active);
        assert_eq!(v.outputs()["a"], json!({"x": 1}));
        assert!(v.step("b").unwrap().outcome_unknown);
        v.apply(6, events::RUN_FAILED, "", &json!({"reason": "boom"}));
        assert_eq!((v.status, v.reason.as_str(), v.last_seq), (RunStatus::Failed, "boom", 6));
    }
}
