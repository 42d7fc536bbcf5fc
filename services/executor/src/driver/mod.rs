//! Driving one run: the lease and its renewal, rebuilding from the ledger (recovery), planning a
//! goal, then the scheduler; the run's end, block or pause is recorded here.
//!
//! - [`ctx`]: the per-run context and its ledger plumbing (appends, deferred outcomes, waits);
//! - [`scheduler`]: what runs next (the DAG, cancellation, pauses, the run's end);
//! - [`step`]: the step pipeline (validate → authorize → record → invoke → vet → record).

mod creation;
mod ctx;
mod frame;
mod known;
mod scheduler;
mod step;

use std::time::Duration;

use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;
use tonic::{Code, Status};
use warden_core::canonical::canonical_json;
use warden_core::events::{self, RunStatus};
use warden_core::plan::Plan;
use warden_core::run::RunView;
use warden_lease::{LeaseError, RunLease};
use warden_proto::v1 as pb;

use crate::Executor;
pub use creation::{Creation, CreationGate, gate as creation_gate};
use ctx::RunCtx;
pub use ctx::{PLAN_ACK_MAX_BYTES, PlanAck};
pub(crate) use ctx::{load_run, load_view};
use scheduler::{PlanFailed, run_dag};
pub use step::FALLBACK_TIMEOUT;
pub(crate) use step::never_sent;
use step::{may_ask_again, transient, within_grace};
use warden_core::replan::{FailedStep, ReplanContext};
use warden_core::run::StepStatus;

/// The span a run is driven in (its steps' spans are its children). Its parent is the span
/// current where the run is dispatched: the SubmitRun request's, whose parent is the client's
/// `traceparent` when it sent one.
pub(crate) fn run_span(run_id: &str) -> tracing::Span {
    let span = tracing::info_span!(
        "run",
        run_id = %run_id,
        run.status = tracing::field::Empty,
        trace_id = tracing::field::Empty,
    );
    warden_telemetry::context::record_trace_id(&span);
    span
}

/// The `warden_runs_total` status of a run event.
fn run_status_label(event_type: &str) -> &'static str {
    match event_type {
        events::RUN_COMPLETED => "completed",
        events::RUN_FAILED => "failed",
        events::RUN_CANCELLED => "cancelled",
        events::RUN_EMPTY_PLAN => "empty_plan",
        events::RUN_BLOCKED => "blocked",
        events::RUN_REQUIRES_RECONCILIATION => "requires_reconciliation",
        _ => "other",
    }
}

#[derive(Debug, thiserror::Error)]
pub enum DriveError {
    #[error("another executor holds a newer lease (fenced)")]
    Fenced,
    #[error("lease lost")]
    LeaseLost,
    #[error("ledger: {0}")]
    Ledger(Status),
    #[error("lease store: {0}")]
    Lease(#[from] LeaseError),
    /// Driven while being created, and the creation failed or found another run.
    #[error("the run was not created")]
    NotCreated,
}

/// Drives `run_id` to a terminal status (or until its lease is lost): the recovery path,
/// which takes the lease, raises the epoch in the ledger and rebuilds the run from it.
pub async fn drive(ex: &Executor, run_id: &str) -> Result<(), DriveError> {
    let run = ex
        .inner
        .ledger
        .clone()
        .get_run(pb::GetLedgerRunRequest { tenant: String::new(), run_id: run_id.to_string(), with_events: false })
        .await
        .map_err(DriveError::Ledger)?
        .into_inner();
    // Only pending and active runs are driven: blocked and requires_reconciliation runs wait
    // for someone outside the run, terminal runs are done.
    if !matches!(run.status(), pb::RunStatus::Pending | pb::RunStatus::Active) {
        return Ok(());
    }
    let ttl = Duration::from_millis(ex.inner.config.lease_ttl_ms);
    let Some(lease) = ex.inner.leases.acquire(run_id, &ex.inner.lease_owner, ttl, run.max_epoch).await? else {
        return Ok(()); // another replica drives it
    };
    warden_telemetry::metrics::lease_acquired(run.max_epoch > 0);
    with_lease(ex, &run.tenant, lease, None).await
}

/// Drives a run this replica just submitted: it took the lease before the run was created
/// and the ledger recorded `run_started` with `run_submitted`, so nothing is read back —
/// the run starts from the plan in hand (`view`, as the ledger's first events fold).
/// With `Submitted::Creating`, the run is still being created (see `creation`).
pub async fn drive_submitted(
    ex: &Executor,
    tenant: &str,
    lease: RunLease,
    view: RunView,
    how: Submitted,
) -> Result<(), DriveError> {
    with_lease(ex, tenant, lease, Some((view, how))).await
}

/// How a run this replica submitted stands when its driver starts.
pub enum Submitted {
    /// Recorded (at the ledger's time, in ms), with the ledger's acknowledgement of its plan
    /// (if it is sent with the run's first Authorize).
    Created(Option<PlanAck>, i64),
    /// Being created meanwhile.
    Creating(Creation),
}

/// Drives a run under `lease`: from `view` when the run was submitted here, otherwise from
/// its log.
async fn with_lease(
    ex: &Executor,
    tenant: &str,
    lease: RunLease,
    view: Option<(RunView, Submitted)>,
) -> Result<(), DriveError> {
    let run_id = lease.run_id.clone();
    let run_id = run_id.as_str();
    let ttl = Duration::from_millis(ex.inner.config.lease_ttl_ms);
    let lost = CancellationToken::new();
    let tokens = ex.run_tokens(run_id);
    let renewal = tokio::spawn(renew(ex.clone(), lease.clone(), ttl, lost.clone(), tokens.clone()));
    let ctx = RunCtx {
        ex: ex.clone(),
        run_id: run_id.to_string(),
        tenant: tenant.to_string(),
        agent: String::new(),
        epoch: lease.epoch,
        lost: lost.clone(),
        cancel: tokens.cancel,
        pause: tokens.pause,
        cancel_policy: pb::CancelPolicy::Immediate,
        deferred: Default::default(),
        appending: Default::default(),
        pinned: Default::default(),
        failed_calls: Default::default(),
        frame: Default::default(),
        plan_ack: Default::default(),
        creation: match &view {
            Some((_, Submitted::Creating(c))) => Some(c.clone()),
            _ => None,
        },
        ack_adopted: Default::default(),
        decided_early: Default::default(),
        known: Default::default(),
    };
    let mut result = match view {
        Some((view, how)) => {
            if let Submitted::Created(plan_ack, created_at_ms) = how {
                *ctx.plan_ack.lock().unwrap_or_else(|p| p.into_inner()) = plan_ack;
                ctx.known().created_at(created_at_ms);
            }
            // The run's first two events as the ledger folds them: what `WaitRun` answers
            // from starts here. (A run taken over is not kept so: its view holds every output
            // so far, a second copy of which is not worth a read saved.)
            ctx.known().start(&view);
            drive_view(&ctx, view).await
        }
        None => drive_leased(&ctx).await,
    };
    if let Err(DriveError::Ledger(s)) = &result
        && matches!(
            s.code(),
            Code::InvalidArgument | Code::FailedPrecondition | Code::Internal | Code::PermissionDenied | Code::NotFound
        )
        && !lost.is_cancelled()
    {
        // Retrying cannot help: record why and end the run instead of re-driving it forever.
        let reason = format!("the ledger refused an event of this run: {}", s.message());
        tracing::warn!(run_id, %reason, "failing run");
        result = finish(&ctx, events::RUN_FAILED, json!({"reason": reason})).await;
    }
    renewal.abort();
    ex.forget_run_tokens(run_id);
    if let Err(e) = ex.inner.leases.release(&lease).await {
        tracing::warn!(run_id, error = %e, "lease release failed; it will expire");
    }
    // Whoever waits for the run hears how it stands from what this driver knows, when that
    // is the whole log up to its last event (no read of the log back). Looked at last, so a
    // waiter that came while the lease was given back hears it too.
    let mut known = std::mem::take(&mut *ctx.known());
    if result.is_ok()
        && ex.waited_for(run_id)
        && let Some(last) = known.finish()
    {
        ex.left(run_id, known::answer(run_id, tenant, last));
    }
    result
}

/// Keeps the lease alive. The holder stops (`lost`) as soon as a renewal fails, and also when
/// no renewal has succeeded for a whole TTL (a hung lease store must not let it run on past
/// the point where another executor may take over). Each round also looks for a cancellation
/// or a pause signalled through the lease store by another replica.
async fn renew(ex: Executor, lease: RunLease, ttl: Duration, lost: CancellationToken, tokens: crate::RunTokens) {
    let mut valid_until = tokio::time::Instant::now() + ttl;
    loop {
        tokio::time::sleep(ttl / 3).await;
        if !(tokens.cancel.is_cancelled() && tokens.pause.is_cancelled())
            && let Ok(signals) = ex.inner.leases.signals(&lease.run_id).await
        {
            if signals.cancel {
                tokens.cancel.cancel();
            }
            if signals.pause {
                tokens.pause.cancel();
            }
        }
        let attempt_started = tokio::time::Instant::now();
        let budget = valid_until.saturating_duration_since(attempt_started);
        let renewed = tokio::time::timeout(budget, ex.inner.leases.renew(&lease, ttl)).await;
        let why = match renewed {
            Ok(Ok(true)) => {
                valid_until = attempt_started + ttl;
                continue;
            }
            Ok(Ok(false)) => "lease lost".to_string(),
            Ok(Err(e)) => format!("lease renewal failed: {e}"),
            Err(_) => "lease renewal did not answer before the lease ran out".to_string(),
        };
        tracing::warn!(run_id = %lease.run_id, epoch = lease.epoch, reason = %why, "stopping");
        lost.cancel();
        return;
    }
}

async fn drive_leased(ctx: &RunCtx) -> Result<(), DriveError> {
    // Raise the run's epoch in the ledger first: from here on a previous holder's writes
    // are refused, so the log read next cannot change under us.
    let started = ctx
        .append(
            events::RUN_STARTED,
            "",
            format!("run_started:{}", ctx.epoch),
            events::started_payload(&ctx.ex.inner.id, ctx.epoch),
        )
        .await;
    match started {
        Ok(_) => {}
        // Ended meanwhile (terminal runs take no events).
        Err(DriveError::Ledger(s)) if s.code() == Code::FailedPrecondition => return Ok(()),
        Err(e) => return Err(e),
    }
    let (view, recorded) = load_view(&ctx.ex, &ctx.tenant, &ctx.run_id).await.map_err(DriveError::Ledger)?;
    let ctx = &RunCtx { decided_early: std::sync::Arc::new(decided_early(&view, &recorded)), ..ctx.clone() };
    drive_view(ctx, view).await
}

/// The calls an earlier holder requested, without an outcome, whose decision — the one the
/// request cites — was asked for while the run was being created (its record names
/// `plan_sha256`): by step id, the recorded plan (canonical JSON, from `run_submitted`) and
/// its digest, when it is the one that decision names.
fn decided_early(view: &RunView, recorded: &[pb::Event]) -> ctx::DecidedEarly {
    let unknown: Vec<&str> = view.steps.iter().filter(|s| s.outcome_unknown).map(|s| s.id.as_str()).collect();
    if unknown.is_empty() {
        return Default::default();
    }
    let payload = |e: &pb::Event| serde_json::from_str::<Value>(&e.payload_json).ok();
    let text = |p: &Value, k: &str| p.get(k).and_then(Value::as_str).map(str::to_string);
    let mut early = Vec::new();
    for step in unknown {
        let requested = recorded.iter().rev().find(|e| e.event_type == events::TOOL_REQUESTED && e.step_id == step);
        let Some(cited) = requested.and_then(payload).and_then(|p| text(&p, "decision_id")) else { continue };
        let decision = recorded
            .iter()
            .filter(|e| e.event_type == events::POLICY_DECISION && e.step_id == step)
            .filter_map(payload)
            .find(|p| text(p, "decision_id").as_deref() == Some(cited.as_str()));
        if let Some(digest) = decision.and_then(|p| text(&p, "plan_sha256")) {
            early.push((step, digest));
        }
    }
    let submitted = recorded.iter().find(|e| e.event_type == events::RUN_SUBMITTED);
    let plan =
        submitted.filter(|_| !early.is_empty()).and_then(payload).and_then(|p| p.get("plan").map(canonical_json));
    let Some(plan) = plan else { return Default::default() };
    let digest = warden_core::canonical::sha256_hex(plan.as_bytes());
    let (plan, shared): (std::sync::Arc<str>, std::sync::Arc<str>) = (plan.into(), digest.as_str().into());
    early
        .into_iter()
        .filter(|(_, named)| *named == digest)
        .map(|(step, _)| (step.to_string(), (plan.clone(), shared.clone())))
        .collect()
}

/// Drives a run from its folded state: settles unknown outcomes, then schedules the DAG.
async fn drive_view(ctx: &RunCtx, mut view: RunView) -> Result<(), DriveError> {
    if !matches!(view.status, RunStatus::Pending | RunStatus::Active) {
        return Ok(());
    }
    let cancel_policy = match pb::CancelPolicy::try_from(view.cancel_policy as i32) {
        Ok(pb::CancelPolicy::AfterToolCall | pb::CancelPolicy::AfterToken) => pb::CancelPolicy::AfterToolCall,
        _ => pb::CancelPolicy::Immediate,
    };
    let ctx = &RunCtx { agent: view.agent.clone(), cancel_policy, ..ctx.clone() };
    if view.cancel_requested.is_some() {
        ctx.cancel.cancel();
    }
    if view.pause_requested.is_some() {
        ctx.pause.cancel();
    }
    let plan = match (view.plan.clone(), view.goal.clone()) {
        (Some(plan), _) => plan,
        (None, Some(goal)) => match plan_goal(ctx, &goal, &view).await? {
            Some(created) => {
                view.apply(
                    created.seq,
                    events::PLAN_CREATED,
                    "",
                    &serde_json::from_str(&created.payload_json).unwrap_or_default(),
                );
                match view.plan.clone() {
                    Some(plan) => plan,
                    None => return Err(DriveError::Ledger(Status::internal("plan_created recorded no plan"))),
                }
            }
            None => return Ok(()),
        },
        (None, None) => {
            return finish(ctx, events::RUN_FAILED, json!({"reason": "run has neither a plan nor a goal"})).await;
        }
    };
    if let Some(text) = &plan.direct_response {
        return finish(ctx, events::RUN_COMPLETED, json!({"reason": "", "direct_response": text})).await;
    }
    if plan.steps.is_empty() {
        return finish(ctx, events::RUN_EMPTY_PLAN, json!({"reason": "the plan has no steps"})).await;
    }
    // Plans reach the ledger only through the planner's validation, but the executor bounds
    // what it reads all the same: a plan over the submission limit is not driven.
    let max = ctx.ex.inner.config.max_plan_bytes;
    let size = canonical_json(&plan).len();
    if size > max {
        let reason = format!("the recorded plan is {size} bytes, over executor.max_plan_bytes ({max})");
        return finish(ctx, events::RUN_FAILED, json!({"reason": reason})).await;
    }
    let tools = ctx.ex.inner.catalog.tools().await.map_err(DriveError::Ledger)?;
    // Unknown outcomes (tool_requested with no result) from an earlier holder.
    // A tool that is idempotent, or whose host tells a call in doubt from one it finished
    // (it then replays the outcome), is asked again under the same key; any other goes to an
    // operator.
    for s in view.steps.iter().filter(|s| s.outcome_unknown) {
        let asked_again = tools.get(&s.tool).is_some_and(|t| may_ask_again(&t.spec));
        if !asked_again {
            let reason = format!("step '{}' ({}) may or may not have run and the tool is not idempotent", s.id, s.tool);
            return finish(ctx, events::RUN_REQUIRES_RECONCILIATION, json!({"reason": reason, "step_id": s.id})).await;
        }
        tracing::info!(run_id = %ctx.run_id, step_id = %s.id, "asking again a call whose outcome is unknown");
    }
    let (mut plan, mut view) = (plan, view);
    // A goal run whose plan fails is replanned (up to `executor.max_replan_rounds`); the
    // round's plan runs like the first, its completed steps kept.
    while let Some(failed) = run_dag(ctx, &plan, view).await? {
        match replan(ctx, failed).await? {
            Some((revised, revised_view)) => (plan, view) = (revised, revised_view),
            None => break,
        }
    }
    Ok(())
}

/// Plans a goal run (the planner asks the model, or replays what the run recorded) and
/// records the plan (`plan_created`, returned); `None` when the run ended instead (the model
/// call was denied, the provider stayed down, a strict replay was refused, or planning forked).
async fn plan_goal(ctx: &RunCtx, goal: &str, view: &RunView) -> Result<Option<pb::Event>, DriveError> {
    let Some(planned) = ask_planner(ctx, goal, view, 0, None).await? else { return Ok(None) };
    let plan = Plan::parse(&planned.plan_json)
        .map_err(|e| DriveError::Ledger(Status::internal(format!("the planner's plan does not parse: {e}"))))?;
    let mut payload = json!({
        "plan": plan,
        "source": planned.source,
        "model_calls": planned.model_calls,
        "replayed_calls": planned.replayed_calls,
    });
    if !planned.reason.is_empty() {
        payload["reason"] = json!(planned.reason);
    }
    if !planned.differences.is_empty() {
        payload["differences"] = json!(planned.differences);
    }
    let created = ctx.append(events::PLAN_CREATED, "", format!("{}:plan_created:r0", ctx.run_id), payload).await?;
    Ok(Some(created))
}

/// Asks the planner for planning round `round` of a goal run (0: its first plan; N > 0: the
/// N-th replanning round, told what the plan came to in `failed`). Returns the answer when it
/// has a plan; otherwise the run's end is recorded here (the model call was denied, the
/// provider stayed down, a strict replay was refused, planning forked) and `None` returned.
async fn ask_planner(
    ctx: &RunCtx,
    goal: &str,
    view: &RunView,
    round: u32,
    failed: Option<(&PlanFailed, &ReplanContext)>,
) -> Result<Option<pb::CreatePlanResponse>, DriveError> {
    let req = pb::CreatePlanRequest {
        tenant: ctx.tenant.clone(),
        run_id: ctx.run_id.clone(),
        goal: goal.to_string(),
        epoch: ctx.epoch,
        agent: view.agent.clone(),
        replay_policy: view.replay_policy,
        round,
        failure_context_json: failed.map(|(_, c)| serde_json::to_string(c).unwrap_or_default()).unwrap_or_default(),
        ..Default::default()
    };
    let planner_step = warden_core::plan::planner_step(round);
    let planning = within_grace(ctx, "planner", (&planner_step, 1), || {
        let mut planner = ctx.ex.inner.planner.clone();
        let req = req.clone();
        async move { planner.create_plan(req).await }
    });
    // A lost lease stops waiting (the planner's own writes are fenced by the epoch).
    let planned = tokio::select! {
        p = planning => p,
        _ = ctx.lost.cancelled() => return Err(DriveError::LeaseLost),
    };
    // The run's end, saying what failed first when this was a replanning round.
    let failed_run = |kind: &str, reason: String| {
        let mut payload = json!({"reason": reason, "kind": kind});
        if let Some((f, _)) = failed {
            payload["reason"] = json!(format!("{}; replanning round {round}: {reason}", f.reason));
            payload["summary"] = f.summary.clone();
            payload["replan_round"] = json!(round);
        }
        payload
    };
    let planned = match planned {
        Ok(p) => p,
        Err(s) if warden_grpc::is_fenced(&s) => return Err(DriveError::Fenced),
        Err(s) if s.code() == Code::FailedPrecondition => {
            let payload = failed_run("planning_refused", format!("planning refused: {}", s.message()));
            finish(ctx, events::RUN_FAILED, payload).await?;
            return Ok(None);
        }
        Err(s) if transient(&s) => {
            let payload = failed_run("planner_unavailable", format!("planner_unavailable: {}", s.message()));
            finish(ctx, events::RUN_FAILED, payload).await?;
            return Ok(None);
        }
        Err(s) => return Err(DriveError::Ledger(s)),
    };
    match planned.source.as_str() {
        "denied" => {
            let reason = format!("model call denied by {}: {}", planned.rule_id, planned.reason);
            let mut payload = failed_run("model_call_denied", reason);
            payload["rule_id"] = json!(planned.rule_id);
            finish(ctx, events::RUN_FAILED, payload).await?;
            Ok(None)
        }
        "unavailable" => {
            let payload = failed_run("planner_unavailable", format!("planner_unavailable: {}", planned.reason));
            finish(ctx, events::RUN_FAILED, payload).await?;
            Ok(None)
        }
        "fork" => {
            let fork = crate::replay::fork(&ctx.ex, &ctx.tenant, &ctx.run_id, &planned.fork_hash)
                .await
                .map_err(DriveError::Ledger)?;
            let mut payload =
                failed_run("forked_on_drift", format!("planning drifted from the record; forked to {fork}"));
            payload["forked_run_id"] = json!(fork);
            payload["differences"] = json!(planned.differences);
            finish(ctx, events::RUN_FAILED, payload).await?;
            Ok(None)
        }
        _ => Ok(Some(planned)),
    }
}

/// The replanning round after `failed` (seed 000 §12), when the run may have one: a goal run
/// under `executor.max_replan_rounds`. The planner is told the goal, the completed steps
/// (kept: never run again) with their outputs, and the failures; the round's plan is recorded
/// (`plan_revised`) and becomes the run's plan. `None` when the run ended instead (recorded).
async fn replan(ctx: &RunCtx, failed: PlanFailed) -> Result<Option<(Plan, RunView)>, DriveError> {
    let (view, _) = load_view(&ctx.ex, &ctx.tenant, &ctx.run_id).await.map_err(DriveError::Ledger)?;
    let (Some(goal), Some(plan)) = (view.goal.clone(), view.plan.clone()) else {
        finish(ctx, events::RUN_FAILED, json!({"reason": failed.reason, "summary": failed.summary})).await?;
        return Ok(None);
    };
    let round = view.round + 1;
    let max = ctx.ex.inner.config.max_replan_rounds;
    if round > max {
        let reason = if max == 0 {
            failed.reason.clone()
        } else {
            format!("{}; no replanning: the run used its {max} replanning rounds", failed.reason)
        };
        finish(ctx, events::RUN_FAILED, json!({"reason": reason, "summary": failed.summary})).await?;
        return Ok(None);
    }
    let context = replan_context(&view, &plan);
    let Some(planned) = ask_planner(ctx, &goal, &view, round, Some((&failed, &context))).await? else {
        return Ok(None);
    };
    let revised = Plan::parse(&planned.plan_json)
        .map_err(|e| DriveError::Ledger(Status::internal(format!("the planner's plan does not parse: {e}"))))?;
    // A round that answers directly (or proposes nothing) gives up: the run fails, saying why.
    if revised.direct_response.is_some() || planned.new_steps.is_empty() {
        let said = revised.direct_response.clone().unwrap_or_else(|| "it proposed no step".into());
        let reason = format!("{}; replanning round {round} gave up: {said}", failed.reason);
        let mut payload = json!({"reason": reason, "summary": failed.summary, "replan_round": round,
                                 "source": planned.source});
        if let Some(text) = &revised.direct_response {
            payload["direct_response"] = json!(text);
        }
        finish(ctx, events::RUN_FAILED, payload).await?;
        return Ok(None);
    }
    let replaces: Vec<&str> = context.failed.iter().map(|f| f.id.as_str()).collect();
    let payload = json!({
        "round": round,
        "plan": revised,
        "steps": planned.new_steps,
        "renamed": planned.renamed,
        "replaces": replaces,
        "after": failed.reason,
        // What the round was told, so `Runs.ReplayRun` asks the planner exactly as it was asked.
        "context": context,
        "source": planned.source,
        "model_calls": planned.model_calls,
        "replayed_calls": planned.replayed_calls,
    });
    let key = format!("{}:plan_revised:r{round}", ctx.run_id);
    let recorded = ctx.append(events::PLAN_REVISED, "", key, payload).await?;
    tracing::info!(run_id = %ctx.run_id, round, steps = planned.new_steps.len(), "replanned");
    let mut view = view;
    view.apply(
        recorded.seq,
        events::PLAN_REVISED,
        "",
        &serde_json::from_str(&recorded.payload_json).unwrap_or_default(),
    );
    Ok(Some((revised, view)))
}

/// What a replanning round is told: the plan's completed steps and their outputs (bounded; a
/// stored output by its digest), its failed and cancelled steps with why, and every id taken.
fn replan_context(view: &RunView, plan: &Plan) -> ReplanContext {
    let mut context = ReplanContext { taken: view.steps.iter().map(|s| s.id.clone()).collect(), ..Default::default() };
    for step in &plan.steps {
        let Some(s) = view.step(&step.id) else { continue };
        match s.status {
            StepStatus::Completed => {
                context.kept.push(step.clone());
                let shown = match (&s.output, &s.output_ref) {
                    (_, Some((sha256, bytes))) => json!({"output_ref": {"sha256": sha256, "bytes": bytes}}),
                    (Some(out), None) => warden_core::replan::shown(out),
                    (None, None) => Value::Null,
                };
                context.outputs.insert(step.id.clone(), shown);
            }
            StepStatus::Failed | StepStatus::Denied | StepStatus::Cancelled => {
                context.failed.push(FailedStep {
                    id: step.id.clone(),
                    tool: step.tool.clone(),
                    params: warden_core::replan::shown(&step.params),
                    error: warden_core::replan::shown_text(s.error.as_deref().unwrap_or_default()),
                });
            }
            StepStatus::Pending | StepStatus::Running => {}
        }
    }
    context
}

async fn finish(ctx: &RunCtx, event_type: &str, payload: Value) -> Result<(), DriveError> {
    ctx.append(event_type, "", event_type.to_string(), payload).await?;
    tracing::info!(run_id = %ctx.run_id, outcome = event_type, "run finished");
    let status = run_status_label(event_type);
    warden_telemetry::metrics::run_reached(status);
    tracing::Span::current().record("run.status", status);
    Ok(())
}

/// Whether the run is to pause: asked for, and not overtaken by a cancellation (which ends
/// the run instead).
fn pausing(ctx: &RunCtx) -> bool {
    ctx.pause.is_cancelled() && !ctx.cancel.is_cancelled()
}

/// Records that the run is paused, once the steps in flight settled: what waits is recorded
/// with it, and the lease is released on the way out (`with_lease`), so no executor holds the
/// run until it is resumed. A cancellation requested meanwhile wins: the run is not paused
/// (the ledger refuses `run_paused` after a cancel request, so a request that raced this one
/// is never left behind a pause) and `false` is returned with `ctx.cancel` fired, for the
/// scheduler to cancel the run instead.
async fn pause(ctx: &RunCtx) -> Result<bool, DriveError> {
    let (view, _) = load_view(&ctx.ex, &ctx.tenant, &ctx.run_id).await.map_err(DriveError::Ledger)?;
    if view.cancel_requested.is_some() {
        ctx.cancel.cancel();
        return Ok(false);
    }
    let why = view.pause_requested.unwrap_or_default();
    let reason = if why.is_empty() { "paused on request".to_string() } else { format!("paused: {why}") };
    // One pause per drive: a run paused again after a resume is driven under a new epoch.
    let paused = ctx.append(events::RUN_PAUSED, "", format!("run_paused:e{}", ctx.epoch), json!({"reason": reason}));
    match paused.await {
        Ok(_) => {}
        Err(DriveError::Ledger(s)) if s.code() == Code::FailedPrecondition => {
            let (view, _) = load_view(&ctx.ex, &ctx.tenant, &ctx.run_id).await.map_err(DriveError::Ledger)?;
            if view.cancel_requested.is_none() {
                return Err(DriveError::Ledger(s));
            }
            tracing::info!(run_id = %ctx.run_id, "a cancellation overtook the pause");
            ctx.cancel.cancel();
            return Ok(false);
        }
        Err(e) => return Err(e),
    }
    tracing::info!(run_id = %ctx.run_id, "run paused");
    warden_telemetry::metrics::run_reached("paused");
    tracing::Span::current().record("run.status", "paused");
    Ok(true)
}
