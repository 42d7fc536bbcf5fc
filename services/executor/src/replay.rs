//! Replaying a goal run's planning (seed 002): `Runs.ReplayRun` walks a finished run's
//! recorded model calls again under a replay policy, and `fork_on_drift` starts a new run
//! `<run>::fork::<hash>`, linked to its parent, that asks the model again.

use serde_json::Value;
use tonic::Status;
use warden_core::events;
use warden_proto::v1 as pb;

use crate::Executor;

/// The parent's `run_submitted` payload (agent, cancel and replay policy).
async fn submitted(ex: &Executor, tenant: &str, run_id: &str) -> Result<Value, Status> {
    let req =
        pb::StreamEventsRequest { tenant: tenant.to_string(), run_id: run_id.to_string(), since_seq: 0, follow: false };
    let first = ex.inner.ledger.clone().stream_events(req).await?.into_inner().message().await?;
    let first = first.ok_or_else(|| Status::not_found(format!("run '{run_id}'")))?;
    if first.event_type != events::RUN_SUBMITTED {
        return Err(Status::internal(format!("run '{run_id}' does not start with run_submitted")));
    }
    serde_json::from_str(&first.payload_json).map_err(|e| Status::internal(format!("run_submitted: {e}")))
}

/// The fork's id: the parent's id, `::fork::` and the drifted request's hash (16 hex digits).
pub fn fork_id(parent: &str, hash: &str) -> String {
    // A fork of a fork keeps the root's id short: ids are at most 128 characters.
    let root = parent.split("::fork::").next().unwrap_or(parent);
    format!("{root}::fork::{hash}")
}

/// Creates (once: the fork id is its idempotency key) and dispatches the fork of `parent`.
pub async fn fork(ex: &Executor, tenant: &str, parent: &str, hash: &str) -> Result<String, Status> {
    if hash.len() != 16 || !hash.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(Status::internal("the planner named no valid fork hash"));
    }
    let first = submitted(ex, tenant, parent).await?;
    let text = |k: &str| first.get(k).and_then(Value::as_str).unwrap_or_default().to_string();
    let goal = text("goal");
    if goal.is_empty() {
        return Err(Status::failed_precondition(format!("run '{parent}' is not a goal run")));
    }
    let id = fork_id(parent, hash);
    let created = ex
        .inner
        .ledger
        .clone()
        .create_run(pb::CreateRunRequest {
            tenant: tenant.to_string(),
            goal,
            idempotency_key: id.clone(),
            cancel_policy: first.get("cancel_policy").and_then(Value::as_i64).unwrap_or_default() as i32,
            agent: text("agent"),
            run_id: id.clone(),
            parent_run_id: parent.to_string(),
            replay_policy: first.get("replay_policy").and_then(Value::as_i64).unwrap_or_default() as i32,
            ..Default::default()
        })
        .await?
        .into_inner();
    let run = created.run.ok_or_else(|| Status::internal("ledger returned no run"))?;
    // The fork id is also its submission key: a run submitted earlier under that key is not
    // this fork.
    if run.run_id != id {
        return Err(Status::failed_precondition(format!(
            "idempotency key '{id}' is taken by run '{}'; the fork was not created",
            run.run_id
        )));
    }
    tracing::info!(parent = %parent, fork = %run.run_id, "planning drifted; forked");
    ex.dispatch(run.run_id.clone());
    Ok(run.run_id)
}

/// `Runs.ReplayRun` for a caller already authorized for `tenant` (and, when its token is bound
/// to an agent, `bound_agent`).
pub async fn replay_run(
    ex: &Executor,
    tenant: &str,
    run_id: &str,
    policy: pb::ReplayPolicy,
    bound_agent: Option<String>,
) -> Result<pb::ReplayRunResponse, Status> {
    let run = ex
        .inner
        .ledger
        .clone()
        .get_run(pb::GetLedgerRunRequest { tenant: tenant.to_string(), run_id: run_id.to_string(), with_events: false })
        .await?
        .into_inner();
    let first = submitted(ex, tenant, run_id).await?;
    let agent = first.get("agent").and_then(Value::as_str).unwrap_or_default().to_string();
    if let Some(bound) = bound_agent
        && bound != agent
    {
        return Err(Status::permission_denied(format!("agent '{bound}' replays only its own runs")));
    }
    if run.goal.is_empty() {
        return Err(Status::failed_precondition(format!(
            "run '{run_id}' was submitted with a plan: nothing to replay"
        )));
    }
    if !warden_grpc::convert::status_from_proto(run.status()).is_some_and(|s| s.is_terminal()) {
        return Err(Status::failed_precondition(format!(
            "run '{run_id}' is {}; only a finished run's planning is replayed",
            warden_grpc::convert::status_name(run.status)
        )));
    }
    let policy = match policy {
        pb::ReplayPolicy::Unspecified => {
            let recorded = first.get("replay_policy").and_then(Value::as_i64).unwrap_or_default() as i32;
            pb::ReplayPolicy::try_from(recorded).unwrap_or(pb::ReplayPolicy::Strict)
        }
        p => p,
    };
    let ask = |round: u32, failure_context_json: String| pb::CreatePlanRequest {
        tenant: tenant.to_string(),
        run_id: run_id.to_string(),
        goal: run.goal.clone(),
        epoch: run.max_epoch.max(1),
        agent: first.get("agent").and_then(Value::as_str).unwrap_or_default().to_string(),
        replay_policy: policy as i32,
        replay_only: true,
        round,
        failure_context_json,
        ..Default::default()
    };
    // Every replanning round is replayed after the first, each told what it was told then.
    let (_, evs) = crate::driver::load_view(ex, tenant, run_id).await?;
    let mut rounds = vec![ask(0, String::new())];
    for e in evs.iter().filter(|e| e.event_type == events::PLAN_REVISED) {
        let p: Value = serde_json::from_str(&e.payload_json).unwrap_or_default();
        let round = p.get("round").and_then(Value::as_u64).unwrap_or_default() as u32;
        let context = p.get("context").map(Value::to_string).unwrap_or_default();
        rounds.push(ask(round, context));
    }
    let mut answer = pb::ReplayRunResponse::default();
    for req in rounds {
        let planned = ex.inner.planner.clone().create_plan(req).await?.into_inner();
        answer.replayed_calls += planned.replayed_calls;
        answer.differences.extend(planned.differences);
        if planned.source == "fork" {
            answer.forked_run_id = fork(ex, tenant, run_id, &planned.fork_hash).await?;
            answer.outcome = "forked".into();
            return Ok(answer);
        }
        answer.plan_json = planned.plan_json;
    }
    answer.outcome = if answer.differences.is_empty() { "replayed" } else { "replayed_with_drift" }.into();
    Ok(answer)
}
