//! Event types of a run's log and the run status each one implies.

use serde::{Deserialize, Serialize};

pub const RUN_SUBMITTED: &str = "run_submitted";
pub const RUN_STARTED: &str = "run_started";
pub const POLICY_DECISION: &str = "policy_decision";
pub const TOOL_REQUESTED: &str = "tool_requested";
pub const TOOL_COMPLETED: &str = "tool_completed";
pub const TOOL_FAILED: &str = "tool_failed";
pub const STEP_FAILED: &str = "step_failed";
pub const STEP_CANCELLED: &str = "step_cancelled";
pub const RUN_COMPLETED: &str = "run_completed";
pub const RUN_FAILED: &str = "run_failed";
pub const RUN_CANCELLED: &str = "run_cancelled";
pub const RUN_EMPTY_PLAN: &str = "run_empty_plan";
pub const RUN_BLOCKED: &str = "run_blocked";
pub const RUN_REQUIRES_RECONCILIATION: &str = "run_requires_reconciliation";
/// A typed summary (Artana's `run_summary`): progress, checkpoints, artifacts, …
pub const RUN_SUMMARY: &str = "run_summary";
/// A blocked or paused run may go on (its approval was resolved, someone resumed it): back to
/// pending for any executor.
pub const RUN_RESUMED: &str = "run_resumed";
/// Someone asked to cancel the run; the executor driving it applies the run's cancel policy
/// and ends it `run_cancelled`. Changes no status by itself.
pub const RUN_CANCEL_REQUESTED: &str = "run_cancel_requested";
/// Someone asked to pause the run: the driver starts nothing new, lets the steps in flight
/// settle and records `run_paused`. Changes no status by itself.
pub const RUN_PAUSE_REQUESTED: &str = "run_pause_requested";
/// The run is paused: nothing of it runs and no executor holds it until `run_resumed`.
pub const RUN_PAUSED: &str = "run_paused";
/// The run's driver is waiting out an outage of a service it needs (`on`: `policy`,
/// `planner` or `tool_host`) within its outage grace; nothing of the step runs meanwhile.
/// The step's next event ends the wait. Changes no status by itself.
pub const RUN_WAITING: &str = "run_waiting";
/// A goal run's plan, as planning produced it (model, replay or fallback). Sets the run's
/// plan once; a run submitted with a plan never takes one.
pub const PLAN_CREATED: &str = "plan_created";
/// A replanning round's plan (seed 000 §12): after a goal run's plan ended with failed steps,
/// the planner was asked again with the failures and the completed steps' outputs. `plan` is
/// the run's plan from here on — the completed steps kept (never run again), then the round's
/// new steps (`steps`, renamed `<id>_r<round>` where an id was taken: `renamed`).
pub const PLAN_REVISED: &str = "plan_revised";
/// The tools' declarations a run pinned when it first used them (seed 000 §15: metadata is
/// immutable once registered): `{"tools": {name: {"version", "sha256", "effect"}}}`. A call of a
/// tool whose host now declares it otherwise fails `tool_changed`; authorizations bind the
/// pinned declaration.
pub const TOOLS_PINNED: &str = "tools_pinned";
/// A step whose call failed for good moves to its next alternative (seed 001 branches):
/// `{"branch": n, "tool", "after": why the previous branch failed, "failed_kind"}`. The step is
/// pending again under branch `n`; the failed branch stays on record.
pub const STEP_BRANCHED: &str = "step_branched";
/// A sub-goal step opened its child frame (seed 001): `{"child_run_id", "subgoal", "depth"}`.
/// The child is a goal run of its own whose `run_submitted` names this run and step.
pub const FRAME_OPENED: &str = "frame_opened";
/// The child frame ended: `{"child_run_id", "status"}` and, when it completed, the step's
/// `output` (`{"run_id", "outputs": {step: output}}`), else `reason`. The ledger takes it only
/// when the child run is this step's frame and ended so.
pub const FRAME_CLOSED: &str = "frame_closed";
/// A model call about to be made: cites the policy's allow for `model.call` (seed 002 fields).
pub const MODEL_REQUESTED: &str = "model_requested";
/// What the model answered: raw output, parsed plan or why it was refused, usage, cost.
pub const MODEL_COMPLETED: &str = "model_completed";
/// The call failed (provider down, timeout, unreadable answer).
pub const MODEL_FAILED: &str = "model_failed";
/// A recorded completion was used again instead of asking the model (planning driven again).
pub const MODEL_REPLAYED: &str = "model_replayed";
/// A recorded completion was replayed although the request drifted (`allow_prompt_drift`).
pub const REPLAYED_WITH_DRIFT: &str = "replayed_with_drift";
pub const TX_PROPOSED: &str = "tx_proposed";
pub const TX_COMMITTED: &str = "tx_committed";
pub const TX_ROLLED_BACK: &str = "tx_rolled_back";

/// Events a terminal run still accepts: they record, they do not act.
/// Events a terminal run still takes: summaries, and decisions — a decision is a fact that
/// must be on the record (K03) even when the run ended before it was written down; it acts
/// on nothing by itself.
/// Replays of a finished run's planning (`Runs.ReplayRun`) are recorded in its chain too.
pub const AFTER_END: &[&str] = &[RUN_SUMMARY, POLICY_DECISION, MODEL_REPLAYED, REPLAYED_WITH_DRIFT];

pub const CHECKPOINT_PREFIX: &str = "checkpoint::";
pub const ARTIFACT_PREFIX: &str = "artifact::";

/// Every event type the ledger accepts.
pub const KNOWN: &[&str] = &[
    RUN_SUBMITTED,
    RUN_STARTED,
    POLICY_DECISION,
    TOOL_REQUESTED,
    TOOL_COMPLETED,
    TOOL_FAILED,
    STEP_FAILED,
    STEP_CANCELLED,
    RUN_COMPLETED,
    RUN_FAILED,
    RUN_CANCELLED,
    RUN_EMPTY_PLAN,
    RUN_BLOCKED,
    RUN_REQUIRES_RECONCILIATION,
    RUN_SUMMARY,
    RUN_RESUMED,
    RUN_CANCEL_REQUESTED,
    RUN_PAUSE_REQUESTED,
    RUN_PAUSED,
    RUN_WAITING,
    TX_PROPOSED,
    TX_COMMITTED,
    TX_ROLLED_BACK,
    PLAN_CREATED,
    PLAN_REVISED,
    TOOLS_PINNED,
    STEP_BRANCHED,
    FRAME_OPENED,
    FRAME_CLOSED,
    MODEL_REQUESTED,
    MODEL_COMPLETED,
    MODEL_FAILED,
    MODEL_REPLAYED,
    REPLAYED_WITH_DRIFT,
];

/// Event types that must cite a recorded allow decision (`decision_id` in the payload).
/// A model call is an effect like a tool call: its request cites the allow for `model.call`.
pub const NEEDS_ALLOW: &[&str] = &[TOOL_REQUESTED, TOOL_COMPLETED, MODEL_REQUESTED];

/// The policy's name for a model call (Cedar action, allowlist entry).
pub const MODEL_CALL_TOOL: &str = "model.call";

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RunStatus {
    Pending,
    Active,
    Paused,
    Blocked,
    RequiresReconciliation,
    Completed,
    Failed,
    Cancelled,
    EmptyPlan,
}

impl RunStatus {
    pub fn is_terminal(self) -> bool {
        matches!(self, RunStatus::Completed | RunStatus::Failed | RunStatus::Cancelled | RunStatus::EmptyPlan)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            RunStatus::Pending => "pending",
            RunStatus::Active => "active",
            RunStatus::Paused => "paused",
            RunStatus::Blocked => "blocked",
            RunStatus::RequiresReconciliation => "requires_reconciliation",
            RunStatus::Completed => "completed",
            RunStatus::Failed => "failed",
            RunStatus::Cancelled => "cancelled",
            RunStatus::EmptyPlan => "empty_plan",
        }
    }

    pub fn parse(s: &str) -> Option<RunStatus> {
        ALL_STATUSES.iter().copied().find(|st| st.as_str() == s)
    }
}

pub const ALL_STATUSES: [RunStatus; 9] = [
    RunStatus::Pending,
    RunStatus::Active,
    RunStatus::Paused,
    RunStatus::Blocked,
    RunStatus::RequiresReconciliation,
    RunStatus::Completed,
    RunStatus::Failed,
    RunStatus::Cancelled,
    RunStatus::EmptyPlan,
];

/// The status a run enters when `event_type` is appended, if it changes it.
pub fn status_after(event_type: &str) -> Option<RunStatus> {
    Some(match event_type {
        RUN_SUBMITTED => RunStatus::Pending,
        RUN_STARTED => RunStatus::Active,
        RUN_COMPLETED => RunStatus::Completed,
        RUN_FAILED => RunStatus::Failed,
        RUN_CANCELLED => RunStatus::Cancelled,
        RUN_EMPTY_PLAN => RunStatus::EmptyPlan,
        RUN_BLOCKED => RunStatus::Blocked,
        RUN_REQUIRES_RECONCILIATION => RunStatus::RequiresReconciliation,
        RUN_RESUMED => RunStatus::Pending,
        RUN_PAUSED => RunStatus::Paused,
        _ => return None,
    })
}

/// Ledger idempotency key under which the policy service records decision `decision_id`;
/// the ledger looks cited decisions up by it.
/// The payload of a run's `run_submitted` event. The ledger records it; an executor that
/// submitted the run folds the same payload instead of reading it back.
pub fn submitted_payload(
    tenant: &str,
    cancel_policy: i32,
    plan: Option<&serde_json::Value>,
    goal: &str,
    agent: &str,
) -> serde_json::Value {
    let mut payload = serde_json::json!({"tenant": tenant, "cancel_policy": cancel_policy});
    if let Some(plan) = plan {
        payload["plan"] = plan.clone();
    }
    if !goal.is_empty() {
        payload["goal"] = serde_json::Value::String(goal.to_string());
    }
    if !agent.is_empty() {
        payload["agent"] = serde_json::Value::String(agent.to_string());
    }
    payload
}

/// A goal run's fields of `run_submitted`: its replay policy (the proto enum's number; 0, the
/// default strict, is not written) and, for a fork, its parent run.
pub fn add_goal_fields(payload: &mut serde_json::Value, replay_policy: i32, parent_run_id: &str) {
    if replay_policy != 0 {
        payload["replay_policy"] = serde_json::Value::from(replay_policy);
    }
    if !parent_run_id.is_empty() {
        payload["parent_run_id"] = serde_json::Value::String(parent_run_id.to_string());
    }
}

/// The payload of `run_started`.
pub fn started_payload(executor: &str, epoch: u64) -> serde_json::Value {
    serde_json::json!({"executor": executor, "epoch": epoch})
}

pub fn decision_key(decision_id: &str) -> String {
    format!("decision:{decision_id}")
}
