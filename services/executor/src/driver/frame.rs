//! Child frames (seed 001): a step with a `subgoal` opens a frame of its own — a goal run
//! whose `run_submitted` names this run and step (`frame`), planned for the sub-goal like any
//! goal run and driven by any executor — and completes with what the frame produced.
//!
//! - **Bounded**: a frame opens at most `max_depth` below the root (the root plan's
//!   `max_depth`, inherited by every frame below it); past it the step fails
//!   `frame_depth_exhausted`, a structured failure the run's replanning sees.
//! - **No cycles**: a sub-goal that is the goal of this frame or of one above it fails
//!   `cyclic_subgoal` without opening anything.
//! - **One budget**: the policy counts a frame's calls and cost against the root run's
//!   budget, so a child spends what is left of its parent's.
//! - **Durable**: the child is created under a key of this run and step, so a driver that
//!   picks the step up again after a restart waits on the same child; `frame_opened` and
//!   `frame_closed` are recorded on the step, and the ledger takes `frame_closed` only as the
//!   child run ended. Cancelling the run cancels the frame.

use std::time::Duration;

use serde_json::{Map, Value, json};
use warden_core::events::{self, RunStatus};
use warden_core::plan::PlanStep;
use warden_core::run::StepStatus;
use warden_proto::v1 as pb;

use super::DriveError;
use super::ctx::{RunCtx, event, load_view, traced};
use super::step::StepOutcome;

/// Longest wait between two looks at a child frame.
const MAX_POLL: Duration = Duration::from_millis(500);

/// Opens (or, after a restart, finds again) the child frame of `step` for `goal` and waits for
/// it to end; the step's outcome is the frame's.
pub(super) async fn open_frame(
    ctx: &RunCtx,
    step: &PlanStep,
    goal: Result<String, String>,
) -> Result<StepOutcome, DriveError> {
    let fail = |kind: &str, reason: String| json!({"kind": kind, "reason": reason, "attempt": 1});
    let goal = match goal {
        Ok(g) => g,
        Err(e) => {
            let p = fail("template", format!("template resolution failed: {e}"));
            return ctx.step_failed(events::STEP_FAILED, &step.id, 1, p).await;
        }
    };
    let here = &*ctx.frame;
    let position = here.position.child(&ctx.run_id, &step.id, here.goal.as_deref(), here.max_depth);
    let max = position.max_depth.unwrap_or(here.max_depth);
    if position.depth > max {
        let reason =
            format!("frame depth exhausted: a frame here would be {} deep, the plan allows {max}", position.depth);
        return ctx.step_failed(events::STEP_FAILED, &step.id, 1, fail("frame_depth_exhausted", reason)).await;
    }
    let digest = warden_core::canonical::sha256_hex(goal.as_bytes());
    if position.goals.contains(&digest) {
        let reason = "the subgoal is the goal of this frame or of one above it (a cycle)".to_string();
        return ctx.step_failed(events::STEP_FAILED, &step.id, 1, fail("cyclic_subgoal", reason)).await;
    }
    let create = pb::CreateRunRequest {
        tenant: ctx.tenant.clone(),
        goal: goal.clone(),
        idempotency_key: format!("frame:{}:{}", ctx.run_id, step.id),
        agent: ctx.agent.clone(),
        parent_run_id: ctx.run_id.clone(),
        replay_policy: here.replay_policy,
        frame_json: serde_json::to_string(&position).unwrap_or_default(),
        ..Default::default()
    };
    let created = ctx.ex.inner.ledger.clone().create_run(create).await;
    let child = match created {
        Ok(r) => r.into_inner().run.map(|r| r.run_id).unwrap_or_default(),
        Err(s) if s.code() == tonic::Code::InvalidArgument => {
            let p = fail("frame_refused", format!("the child frame was refused: {}", s.message()));
            return ctx.step_failed(events::STEP_FAILED, &step.id, 1, p).await;
        }
        Err(s) => return Err(DriveError::Ledger(s)),
    };
    let opened = json!({"child_run_id": child, "subgoal": goal, "depth": position.depth});
    ctx.append(events::FRAME_OPENED, &step.id, ctx.step_key(&step.id, 1, "frame_opened"), traced(opened)).await?;
    tracing::info!(run_id = %ctx.run_id, step_id = %step.id, child = %child, depth = position.depth, "child frame opened");
    ctx.ex.dispatch(child.clone());
    let ended = wait(ctx, &child).await?;
    close(ctx, step, &child, ended).await
}

/// Waits for the child run to end (a frame waiting for an approval or an operator waits with
/// it); cancels it when this run is cancelled.
async fn wait(ctx: &RunCtx, child: &str) -> Result<pb::LedgerRun, DriveError> {
    let mut poll = Duration::from_millis(20);
    let mut cancelled = false;
    loop {
        let get = pb::GetLedgerRunRequest { tenant: ctx.tenant.clone(), run_id: child.to_string() };
        match ctx.ex.inner.ledger.clone().get_run(get).await {
            Ok(run) => {
                let run = run.into_inner();
                let status = pb::RunStatus::try_from(run.status).ok().and_then(warden_grpc::convert::status_from_proto);
                if status.is_some_and(RunStatus::is_terminal) {
                    return Ok(run);
                }
                if ctx.cancel.is_cancelled() && !cancelled {
                    cancel_child(ctx, &run).await?;
                    cancelled = true;
                }
            }
            Err(s) if super::step::transient(&s) => {}
            Err(s) => return Err(DriveError::Ledger(s)),
        }
        tokio::select! {
            _ = tokio::time::sleep(poll) => {}
            _ = ctx.lost.cancelled() => return Err(DriveError::LeaseLost),
            _ = ctx.cancel.cancelled(), if !cancelled => {}
        }
        poll = (poll * 2).min(MAX_POLL);
    }
}

/// Asks the child frame to end as this run does (`run_cancel_requested`, signalled to its
/// driver; a frame no executor holds is resumed to be cancelled).
async fn cancel_child(ctx: &RunCtx, run: &pb::LedgerRun) -> Result<(), DriveError> {
    let append = |event_type: &str, key: &str, payload: Value| pb::AppendEventRequest {
        tenant: ctx.tenant.clone(),
        run_id: run.run_id.clone(),
        epoch: run.max_epoch,
        idempotency_key: key.to_string(),
        event_type: event_type.to_string(),
        payload_json: payload.to_string(),
        step_id: String::new(),
    };
    let mut ledger = ctx.ex.inner.ledger.clone();
    let why = json!({"reason": format!("its parent run {} was cancelled", ctx.run_id)});
    match ledger.append_event(append(events::RUN_CANCEL_REQUESTED, "cancel_requested", why)).await {
        Ok(_) => {}
        // It ended or moved meanwhile: the next look tells.
        Err(s) if s.code() == tonic::Code::FailedPrecondition => return Ok(()),
        Err(s) => return Err(DriveError::Ledger(s)),
    }
    ctx.ex.signal_here(&run.run_id, warden_lease::RunSignal::Cancel);
    let _ = ctx.ex.inner.leases.signal(&run.run_id, warden_lease::RunSignal::Cancel).await;
    if matches!(run.status(), pb::RunStatus::Blocked | pb::RunStatus::Paused) {
        let resumed = append(events::RUN_RESUMED, "resumed:cancel", json!({"reason": "resumed to be cancelled"}));
        let _ = ledger.append_event(resumed).await;
    }
    ctx.ex.dispatch(run.run_id.clone());
    Ok(())
}

/// Records how the frame ended on the step (`frame_closed`): a completed frame's output is
/// every completed step's output (a stored one by reference); any other end fails the step.
async fn close(ctx: &RunCtx, step: &PlanStep, child: &str, run: pb::LedgerRun) -> Result<StepOutcome, DriveError> {
    let status = warden_grpc::convert::status_name(run.status);
    let key = ctx.step_key(&step.id, 1, "frame_closed");
    if run.status() != pb::RunStatus::Completed {
        let reason = format!("child frame {child} ended {status}: {}", run.reason);
        let payload = json!({"child_run_id": child, "status": status, "reason": reason, "kind": "frame_failed"});
        ctx.append_all(vec![event(events::FRAME_CLOSED, &step.id, key, traced(payload))]).await?;
        return Ok(StepOutcome::Failed { reason, kind: "frame_failed".into() });
    }
    let (view, _) = load_view(&ctx.ex, &ctx.tenant, child).await.map_err(DriveError::Ledger)?;
    let mut outputs = Map::new();
    for s in view.steps.iter().filter(|s| s.status == StepStatus::Completed) {
        let shown = match (&s.output, &s.output_ref) {
            (_, Some((sha256, bytes))) => json!({"output_ref": {"run_id": child, "sha256": sha256, "bytes": bytes}}),
            (Some(out), None) => out.clone(),
            (None, None) => Value::Null,
        };
        outputs.insert(s.id.clone(), shown);
    }
    let mut output = json!({"run_id": child, "outputs": outputs});
    if view.status == RunStatus::Completed && !view.reason.is_empty() {
        output["reason"] = json!(view.reason);
    }
    let payload = json!({"child_run_id": child, "status": status, "output": output});
    ctx.append_all(vec![event(events::FRAME_CLOSED, &step.id, key, traced(payload))]).await?;
    tracing::info!(run_id = %ctx.run_id, step_id = %step.id, child = %child, "child frame completed");
    Ok(StepOutcome::Completed(output))
}
