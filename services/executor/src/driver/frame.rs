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
    // The sub-goal may carry what an earlier step output: bounded and redacted by the planner
    // like any submitted goal before it is recorded or shown to a model.
    let goal = if goal.len() > warden_core::plan::MAX_SUBGOAL_BYTES {
        let reason = format!(
            "the resolved subgoal is {} bytes, over the maximum of {}",
            goal.len(),
            warden_core::plan::MAX_SUBGOAL_BYTES
        );
        return ctx.step_failed(events::STEP_FAILED, &step.id, 1, fail("invalid_subgoal", reason)).await;
    } else {
        let check = pb::CreatePlanRequest {
            tenant: ctx.tenant.clone(),
            goal: goal.clone(),
            agent: ctx.agent.clone(),
            check_only: true,
            ..Default::default()
        };
        match ctx.ex.inner.planner.clone().create_plan(check).await {
            Ok(checked) => checked.into_inner().goal,
            Err(s) if matches!(s.code(), tonic::Code::InvalidArgument | tonic::Code::FailedPrecondition) => {
                let p = fail("invalid_subgoal", format!("the subgoal was refused: {}", s.message()));
                return ctx.step_failed(events::STEP_FAILED, &step.id, 1, p).await;
            }
            Err(s) => return Err(DriveError::Ledger(s)),
        }
    };
    // Compared as recorded: the goals above are digests of their recorded (redacted) goals.
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
    // A child names its parent, which must be on record first.
    ctx.created().await?;
    let created = ctx.ex.inner.ledger.clone().create_run(create).await;
    let child = match created {
        Ok(r) => r.into_inner().run.map(|r| r.run_id).unwrap_or_default(),
        Err(s)
            if matches!(
                s.code(),
                tonic::Code::InvalidArgument | tonic::Code::FailedPrecondition | tonic::Code::NotFound
            ) =>
        {
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
        let get = pb::GetLedgerRunRequest { tenant: ctx.tenant.clone(), run_id: child.to_string(), with_events: false };
        match ctx.ex.inner.ledger.clone().get_run(get).await {
            Ok(run) => {
                let run = run.into_inner();
                let status = pb::RunStatus::try_from(run.status).ok().and_then(warden_grpc::convert::status_from_proto);
                if status.is_some_and(RunStatus::is_terminal) {
                    return Ok(run);
                }
                // Asked until the request is on the child's record (a stale epoch is read again).
                if ctx.cancel.is_cancelled() && !cancelled {
                    cancelled = cancel_child(ctx, &run).await?;
                }
            }
            Err(s) if super::step::transient(&s) => {}
            Err(s) => return Err(DriveError::Ledger(s)),
        }
        tokio::select! {
            _ = tokio::time::sleep(poll) => {}
            _ = ctx.lost.cancelled() => return Err(DriveError::LeaseLost),
            _ = ctx.cancel.cancelled(), if !ctx.cancel.is_cancelled() => {}
        }
        poll = (poll * 2).min(MAX_POLL);
    }
}

/// Asks the child frame to end as this run does (`run_cancel_requested`, signalled to its
/// driver; a frame no executor holds is resumed to be cancelled). `false` when the request
/// could not be recorded yet (the child moved on meanwhile): the caller asks again.
pub(super) async fn cancel_child(ctx: &RunCtx, run: &pb::LedgerRun) -> Result<bool, DriveError> {
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
    // A key of its own: a person's `CancelRun` of the child (`cancel_requested`, another reason)
    // is no conflict, and asking again repeats this very request.
    let key = "cancel_requested:parent";
    match ledger.append_event(append(events::RUN_CANCEL_REQUESTED, key, why)).await {
        Ok(_) => {}
        // It ended or moved to a new epoch meanwhile: the next look tells, and asks again.
        Err(s) if s.code() == tonic::Code::FailedPrecondition || warden_grpc::is_fenced(&s) => return Ok(false),
        Err(s) if super::step::transient(&s) => return Ok(false),
        Err(s) => return Err(DriveError::Ledger(s)),
    }
    ctx.ex.signal_here(&run.run_id, warden_lease::RunSignal::Cancel);
    let _ = ctx.ex.inner.leases.signal(&run.run_id, warden_lease::RunSignal::Cancel).await;
    // Read again: a frame paused or blocked by now (the ledger takes neither after the
    // request, so this reading stands) is resumed to be cancelled.
    let get = pb::GetLedgerRunRequest { tenant: ctx.tenant.clone(), run_id: run.run_id.clone(), with_events: false };
    if let Ok(now) = ledger.get_run(get).await.map(|r| r.into_inner())
        && matches!(now.status(), pb::RunStatus::Blocked | pb::RunStatus::Paused)
    {
        let resumed = append(events::RUN_RESUMED, "resumed:cancel", json!({"reason": "resumed to be cancelled"}));
        let _ = ledger.append_event(pb::AppendEventRequest { epoch: now.max_epoch, ..resumed }).await;
    }
    ctx.ex.dispatch(run.run_id.clone());
    Ok(true)
}

/// Cancels the frame a sub-goal step opened, when the run is cancelled before the step is
/// waited on again (after a restart): the frame does not go on acting for a cancelled run.
/// Waits for nothing; the frame ends on its own driver.
pub(super) async fn cancel_open_frame(ctx: &RunCtx, child: &str) -> Result<(), DriveError> {
    for _ in 0..5 {
        let get = pb::GetLedgerRunRequest { tenant: ctx.tenant.clone(), run_id: child.to_string(), with_events: false };
        let run = ctx.ex.inner.ledger.clone().get_run(get).await.map_err(DriveError::Ledger)?.into_inner();
        let ended = pb::RunStatus::try_from(run.status)
            .ok()
            .and_then(warden_grpc::convert::status_from_proto)
            .is_some_and(RunStatus::is_terminal);
        if ended || cancel_child(ctx, &run).await? {
            return Ok(());
        }
    }
    Err(DriveError::Ledger(tonic::Status::aborted(format!(
        "child frame {child} kept changing; cancelled on the next drive"
    ))))
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
    // Steps whose output is stored (cited by reference already): an inline output that merely
    // has an `output_ref` member of its own is bounded like any other.
    let mut stored = std::collections::HashSet::new();
    for s in view.steps.iter().filter(|s| s.status == StepStatus::Completed) {
        let shown = match (&s.output, &s.output_ref) {
            (_, Some((sha256, bytes))) => {
                stored.insert(s.id.clone());
                json!({"output_ref": {"run_id": child, "sha256": sha256, "bytes": bytes}})
            }
            (Some(out), None) => out.clone(),
            (None, None) => Value::Null,
        };
        outputs.insert(s.id.clone(), shown);
    }
    // Bounded like an inline output: past the limit each output is cited by its digest and
    // size instead (read with `GetStepOutput` on the child run).
    let inline = Value::Object(outputs.clone()).to_string().len() <= ctx.ex.inner.config.inline_output_max_bytes;
    if !inline {
        for (id, out) in outputs.iter_mut() {
            if !stored.contains(id) {
                let text = warden_core::canonical::canonical_json(out);
                *out = json!({"output_ref": {"run_id": child, "step_id": id,
                    "sha256": warden_core::canonical::sha256_hex(text.as_bytes()), "bytes": text.len()}});
            }
        }
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
