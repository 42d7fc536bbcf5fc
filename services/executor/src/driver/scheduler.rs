//! What runs next: the DAG in dependency order under bounded concurrency, the cascade of
//! failures, cancellation and pauses, and the run's end.

use std::collections::HashMap;

use futures::FutureExt;
use serde_json::{Value, json};
use tokio::task::JoinSet;
use tonic::Status;
use tracing::Instrument;
use warden_core::events;
use warden_core::plan::{Plan, PlanLimits};
use warden_core::run::{PinnedTool, RunView, StepStatus};
use warden_core::template;
use warden_proto::v1 as pb;

use super::ctx::{RunCtx, event, load_view, policy_name, run_key, traced};
use super::step::{Resume, StepOutcome, execute_step, within_grace};
use super::{DriveError, finish, pause, pausing};

/// What a step's task comes to: the step's id and its outcome.
type Settled = (String, Result<StepOutcome, DriveError>);

/// A launched step, not yet polled.
type StepTask = std::pin::Pin<Box<dyn std::future::Future<Output = Settled> + Send>>;

/// The steps one pass of the scheduler launched.
///
/// A step is spawned on a task of its own so that several run at once. When a pass launches
/// exactly one and none is running (every step of a chain), it is polled in the driver's task
/// instead: spawning it, and being woken by its end, were two hand-overs between tasks per
/// step, and with several Tokio workers each could wake another worker on another core
/// (`warden dev` runs every service in one process; BENCHMARKS.md, 2026-12-06). A
/// cancellation or pause that arrives meanwhile spawns it where it stands, so the loop
/// handles them as it does beside spawned steps; a lost lease drops it, as the `JoinSet`'s
/// drop aborts spawned ones; a panic fails the drive as a panicked task does.
#[derive(Default)]
struct Launched {
    /// Whether the pass moved any step to running (a sub-goal's frame included).
    started: bool,
    tasks: Vec<StepTask>,
}

impl Launched {
    fn push(&mut self, task: StepTask) {
        self.tasks.push(task);
    }

    fn len(&self) -> usize {
        self.tasks.len()
    }

    /// Hands the launched steps to `running`, or the only one to `inline`.
    fn start(self, running: &mut JoinSet<Settled>, inline: &mut Option<StepTask>) {
        let mut tasks = self.tasks;
        if tasks.len() == 1 && running.is_empty() && inline.is_none() {
            *inline = tasks.pop();
            return;
        }
        for task in tasks {
            running.spawn(task);
        }
    }
}

/// What woke the driver while it polled its one step.
enum Woke {
    Settled(std::thread::Result<Settled>),
    Cancel,
    Pause,
}

/// How a plan ended, when the run did not end with it: its steps failed, and nothing about
/// the run's end is recorded yet (the driver replans, or records the failure).
pub(super) struct PlanFailed {
    pub(super) reason: String,
    pub(super) summary: Value,
}

/// Runs `plan` until the run ends, blocks, pauses, waits for an operator or is handed off
/// (all recorded here: `None`), or the plan ends with failed steps (`Some`, nothing recorded).
pub(super) async fn run_dag(ctx: &RunCtx, plan: &Plan, view: RunView) -> Result<Option<PlanFailed>, DriveError> {
    let all_tools = |_: &str| true;
    let order = plan
        .validate(&PlanLimits { max_steps: usize::MAX, known_tool: &all_tools })
        .map_err(|e| DriveError::Ledger(Status::internal(format!("recorded plan no longer validates: {e}"))))?;
    let status: HashMap<String, StepStatus> = view
        .steps
        .iter()
        // A call whose outcome is unknown is asked again; a child frame still open is waited
        // on again.
        .map(|s| {
            let again = s.outcome_unknown
                || (s.frame_run_id.is_some() && s.status == StepStatus::Running)
                || unbranched(plan, s);
            (s.id.clone(), if again { StepStatus::Pending } else { s.status })
        })
        .collect();
    let (mut status, deps) = Statuses::new(plan, status)?;
    let mut outputs = view.outputs();
    // The child frames sub-goal steps opened and may still wait on.
    let view_frames: HashMap<String, String> = view
        .steps
        .iter()
        .filter(|s| s.status == StepStatus::Running)
        .filter_map(|s| Some((s.id.clone(), s.frame_run_id.clone()?)))
        .collect();
    // Steps to run (those whose outcome is unknown are asked again) may template from stored
    // outputs.
    if status.values().any(|s| s == StepStatus::Pending) {
        stored_outputs(ctx, &view, &mut outputs).await?;
    }
    let resume: HashMap<String, Resume> = view
        .steps
        .iter()
        .map(|s| {
            let mut from = Resume::of(s);
            // Failed for good with an alternative left, and its branch never recorded (the
            // driver stopped in between, or an operator reconciled the call as failed): it
            // moves to that alternative now.
            if unbranched(plan, s) {
                from.attempt = s.attempts.max(s.call_attempt).max(s.failed_attempt) + 1;
                from.retry_of = None;
                from.branch_after =
                    Some((s.error.clone().unwrap_or_default(), s.failed_kind.clone().unwrap_or_default()));
            }
            (s.id.clone(), from)
        })
        .collect();
    let mut first_failure: Option<String> = view
        .steps
        .iter()
        .find(|s| {
            matches!(s.status, StepStatus::Failed | StepStatus::Denied) && view.in_plan(&s.id) && !unbranched(plan, s)
        })
        .map(|s| format!("step '{}' failed: {}", s.id, s.error.clone().unwrap_or_default()));
    let pinned = pin_tools(ctx, plan, &view).await?;
    let frame = super::ctx::FrameCtx {
        position: view.frame.clone(),
        goal: view.goal.clone(),
        max_depth: plan.max_depth.unwrap_or(warden_core::plan::DEFAULT_MAX_DEPTH),
        replay_policy: view.replay_policy,
    };
    let ctx = &RunCtx {
        pinned: std::sync::Arc::new(pinned),
        failed_calls: std::sync::Arc::new(std::sync::Mutex::new(view.failed_calls.clone())),
        frame: std::sync::Arc::new(frame),
        ..ctx.clone()
    };
    let limit = ctx.ex.inner.config.max_concurrency;
    let mut reconcile: Option<(String, String)> = None;
    // A step waiting for an approval: nothing new starts, the run blocks once the rest settles.
    let mut blocked: Option<(String, String, String)> = None;
    let mut cancel_seen = false;
    let mut pause_seen = false;
    let mut running: JoinSet<Settled> = JoinSet::new();
    // The one step a pass launched while no other was running (every step of a chain) is
    // polled here, in the driver's own task, rather than spawned: see [`Launched`].
    let mut inline: Option<StepTask> = None;
    loop {
        if ctx.lost.is_cancelled() {
            return Err(DriveError::LeaseLost);
        }
        // Cancelled: nothing new starts; steps already running settle by the cancel policy.
        if ctx.cancel.is_cancelled() {
            for &i in &order {
                let step = &plan.steps[i];
                if status.at(i) == StepStatus::Pending && !resume[&step.id].asked_before {
                    // A frame it opened before a restart ends with the run.
                    if let Some(child) = view_frames.get(&step.id) {
                        super::frame::cancel_open_frame(ctx, child).await?;
                    }
                    // Receipted by the attempt it would have made (an earlier one may have one).
                    let attempt = resume[&step.id].attempt;
                    let reason = format!("the run was cancelled ({})", policy_name(ctx.cancel_policy));
                    ctx.append(
                        events::STEP_CANCELLED,
                        &step.id,
                        ctx.step_key(&step.id, attempt, "cancelled"),
                        traced(json!({"reason": reason, "attempt": attempt})),
                    )
                    .await?;
                    warden_telemetry::metrics::step_settled("cancelled");
                    status.set(i, StepStatus::Cancelled);
                }
            }
        }
        let mut launched = Launched::default();
        // Dependents of a failed, denied or cancelled step are cancelled (in dependency order,
        // so the cancellation cascades in one pass).
        for &i in &order {
            let step = &plan.steps[i];
            if status.at(i) != StepStatus::Pending {
                continue;
            }
            let blocked = deps[i]
                .iter()
                .find(|&&d| matches!(status.at(d), StepStatus::Failed | StepStatus::Denied | StepStatus::Cancelled));
            if let Some(&dep) = blocked {
                let dep = &plan.steps[dep].id;
                let reason = format!("dependency '{dep}' did not complete");
                let attempt = resume[&step.id].attempt;
                ctx.append(
                    events::STEP_CANCELLED,
                    &step.id,
                    ctx.step_key(&step.id, attempt, "cancelled"),
                    traced(json!({"reason": reason, "attempt": attempt})),
                )
                .await?;
                warden_telemetry::metrics::step_settled("cancelled");
                status.set(i, StepStatus::Cancelled);
            }
        }
        let handing_off = ctx.ex.inner.handoff.is_cancelled();
        for &i in &order {
            // After an unknown outcome nothing new starts: an operator decides first. Nor while
            // this replica hands its runs off.
            if running.len() + launched.len() >= limit
                || reconcile.is_some()
                || blocked.is_some()
                || handing_off
                || pausing(ctx)
            {
                break;
            }
            let step = &plan.steps[i];
            let ready =
                status.at(i) == StepStatus::Pending && deps[i].iter().all(|&d| status.at(d) == StepStatus::Completed);
            if !ready {
                continue;
            }
            status.set(i, StepStatus::Running);
            launched.started = true;
            if let Some(goal) = &step.subgoal {
                let goal = match template::resolve(&Value::String(goal.clone()), &outputs) {
                    Ok(Value::String(g)) => Ok(g),
                    Ok(other) => Ok(other.to_string()),
                    Err(e) => Err(e.to_string()),
                };
                let (c, s) = (ctx.clone(), step.clone());
                let span = tracing::info_span!("frame", step_id = %s.id);
                launched.push(Box::pin(
                    async move {
                        let id = s.id.clone();
                        (id, super::frame::open_frame(&c, &s, goal).await)
                    }
                    .instrument(span),
                ));
                continue;
            }
            let from = resume.get(&step.id).cloned().unwrap_or_default();
            let (tool, params) = step.branch(from.branch as usize).unwrap_or((&step.tool, &step.params));
            // A step with alternatives left resolves them later, from the outputs as they are
            // now (its dependencies completed); its own template failure is a branch failure.
            let later = (from.branch as usize) < step.alternatives.len();
            // A step whose branch is still to be recorded resolves its next branch's arguments
            // itself (after recording it).
            let params = if from.branch_after.is_some() { &Value::Null } else { params };
            match template::resolve(params, &outputs) {
                Err(e) if !later => {
                    let reason = format!("template resolution failed: {e}");
                    ctx.append(
                        events::STEP_FAILED,
                        &step.id,
                        ctx.step_key(&step.id, from.attempt, "failed"),
                        traced(json!({"kind": "template", "reason": reason, "attempt": from.attempt, "tool": tool})),
                    )
                    .await?;
                    warden_telemetry::metrics::step_settled("failed");
                    first_failure.get_or_insert(format!("step '{}' failed: {reason}", step.id));
                    status.set(i, StepStatus::Failed);
                }
                resolved => {
                    let (c, s) = (ctx.clone(), step.clone());
                    let span = tracing::info_span!("step", step_id = %s.id, tool = %tool);
                    let args = resolved.map_err(|e| e.to_string());
                    let outputs = later.then(|| std::sync::Arc::new(outputs.clone()));
                    launched.push(Box::pin(
                        async move {
                            let id = s.id.clone();
                            (id, execute_step(&c, &s, args, from, outputs).await)
                        }
                        .instrument(span),
                    ));
                }
            }
        }
        let started = launched.started;
        launched.start(&mut running, &mut inline);
        // Outcomes wait for the next append of the run: a step launched now carries them;
        // if none was, append them before waiting on the steps still running.
        if !started && !running.is_empty() {
            ctx.flush().await?;
        }
        if running.is_empty() && inline.is_none() && handing_off {
            // What settled is recorded; the rest is the next holder's (the lease is released
            // on the way out, so it is taken over at once).
            ctx.flush().await?;
            tracing::info!(run_id = %ctx.run_id, "run handed off");
            return Ok(None);
        }
        if running.is_empty() && inline.is_none() {
            let settled = status.values().all(|s| s != StepStatus::Pending && s != StepStatus::Running);
            if settled || reconcile.is_some() || blocked.is_some() {
                break;
            }
            if pausing(ctx) {
                if pause(ctx).await? {
                    return Ok(None);
                }
                // A cancellation overtook the pause: the next pass cancels what has not run.
                continue;
            }
            // Every pending step is either ready or cancelled by the passes above, so an idle
            // loop here would be a scheduler bug: stop rather than spin.
            if !started {
                return Err(DriveError::Ledger(Status::internal("scheduler found no runnable step")));
            }
            continue;
        }
        // The step polled here, or whichever spawned step settles first.
        let (step_id, outcome) = if let Some(step) = inline.as_mut() {
            let woke = tokio::select! {
                settled = std::panic::AssertUnwindSafe(step).catch_unwind() => Woke::Settled(settled),
                _ = ctx.lost.cancelled() => return Err(DriveError::LeaseLost),
                _ = ctx.cancel.cancelled(), if !cancel_seen => Woke::Cancel,
                _ = ctx.pause.cancelled(), if !pause_seen => Woke::Pause,
            };
            match woke {
                Woke::Settled(Ok(settled)) => {
                    inline = None;
                    settled
                }
                Woke::Settled(Err(panic)) => {
                    let why = panic
                        .downcast_ref::<&str>()
                        .map(|s| s.to_string())
                        .or_else(|| panic.downcast_ref::<String>().cloned())
                        .unwrap_or_default();
                    return Err(DriveError::Ledger(Status::internal(format!("step task failed: it panicked: {why}"))));
                }
                // Handled while the step goes on, as beside a spawned step: it is spawned now,
                // where it stands, and the loop goes round.
                Woke::Cancel | Woke::Pause => {
                    if matches!(woke, Woke::Cancel) {
                        cancel_seen = true;
                    } else {
                        pause_seen = true;
                    }
                    if let Some(step) = inline.take() {
                        running.spawn(step);
                    }
                    continue;
                }
            }
        } else {
            let joined = tokio::select! {
                j = running.join_next() => j,
                _ = ctx.lost.cancelled() => return Err(DriveError::LeaseLost),
                // Wake up to cancel the steps that have not started (once).
                _ = ctx.cancel.cancelled(), if !cancel_seen => {
                    cancel_seen = true;
                    continue;
                }
                // A pause starts nothing new; the loop waits for the running steps to settle.
                _ = ctx.pause.cancelled(), if !pause_seen => {
                    pause_seen = true;
                    continue;
                }
            };
            let Some(joined) = joined else { continue };
            joined.map_err(|e| DriveError::Ledger(Status::internal(format!("step task failed: {e}"))))?
        };
        let outcome = outcome?;
        warden_telemetry::metrics::step_settled(outcome.label());
        match outcome {
            StepOutcome::Completed(out) => {
                status.set_id(&step_id, StepStatus::Completed);
                outputs.insert(step_id, out);
            }
            StepOutcome::Failed { reason: why, .. } => {
                first_failure.get_or_insert(format!("step '{step_id}' failed: {why}"));
                status.set_id(&step_id, StepStatus::Failed);
            }
            StepOutcome::Unknown(why) => {
                status.set_id(&step_id, StepStatus::Running);
                reconcile.get_or_insert((step_id, why));
            }
            StepOutcome::Blocked { decision_id, reason } => {
                status.set_id(&step_id, StepStatus::Pending);
                blocked.get_or_insert((step_id, decision_id, reason));
            }
            StepOutcome::Cancelled => {
                status.set_id(&step_id, StepStatus::Cancelled);
            }
            // `execute_step` runs a step's retries itself.
            StepOutcome::Retry { .. } => {
                first_failure.get_or_insert(format!("step '{step_id}' stopped between attempts"));
                status.set_id(&step_id, StepStatus::Failed);
            }
        }
    }
    let count = |st: StepStatus| status.values().filter(|s| *s == st).count();
    let summary = json!({
        "completed": count(StepStatus::Completed),
        "failed": count(StepStatus::Failed) + count(StepStatus::Denied),
        "cancelled": count(StepStatus::Cancelled),
    });
    if ctx.cancel.is_cancelled() && reconcile.is_none() {
        let (view, _) = load_view(&ctx.ex, &ctx.tenant, &ctx.run_id).await.map_err(DriveError::Ledger)?;
        let why = view.cancel_requested.unwrap_or_default();
        let reason = if why.is_empty() { "cancelled on request".to_string() } else { format!("cancelled: {why}") };
        return finish(ctx, events::RUN_CANCELLED, json!({"reason": reason, "summary": summary})).await.map(|_| None);
    }
    if let Some((step_id, decision_id, reason)) = blocked {
        let payload = json!({"reason": reason, "step_id": step_id, "decision_id": decision_id});
        // One block per drive: blocking again on the same decision after a resume is a new
        // block (keyed by this drive's epoch), never deduplicated into an `active` run that
        // the sweeper would restart forever.
        let key = format!("run_blocked:{decision_id}:{}", ctx.epoch);
        match ctx.append(events::RUN_BLOCKED, "", key, payload).await {
            Ok(_) => {}
            // A cancellation requested meanwhile wins (the ledger blocks no run after one):
            // the scheduler runs again, cancelled, and ends the run so.
            Err(DriveError::Ledger(s)) if s.code() == tonic::Code::FailedPrecondition => {
                let (view, _) = load_view(&ctx.ex, &ctx.tenant, &ctx.run_id).await.map_err(DriveError::Ledger)?;
                if view.cancel_requested.is_none() {
                    return Err(DriveError::Ledger(s));
                }
                ctx.cancel.cancel();
                return Box::pin(run_dag(ctx, plan, view)).await;
            }
            Err(e) => return Err(e),
        }
        tracing::info!(run_id = %ctx.run_id, step_id = %step_id, "run blocked on an approval");
        warden_telemetry::metrics::run_reached("blocked");
        tracing::Span::current().record("run.status", "blocked");
        return Ok(None);
    }
    if let Some((step_id, why)) = reconcile {
        let reason = format!("step '{step_id}' has an unknown outcome: {why}");
        return finish(ctx, events::RUN_REQUIRES_RECONCILIATION, json!({"reason": reason, "step_id": step_id}))
            .await
            .map(|_| None);
    }
    match first_failure {
        None => finish(ctx, events::RUN_COMPLETED, json!({"reason": "", "summary": summary})).await.map(|_| None),
        Some(reason) => Ok(Some(PlanFailed { reason, summary })),
    }
}

/// The status of every step the run's view knows: the plan's steps by their position in the
/// plan, which every pass of the scheduler reads (a pass reads each step and its
/// dependencies, so by id a 100-step chain hashed and compared step ids some 20,000 times
/// per run), and the steps a replanning round dropped by id (they count in the run's
/// summary only).
struct Statuses {
    plan: Vec<StepStatus>,
    position: HashMap<String, usize>,
    dropped: HashMap<String, StepStatus>,
}

impl Statuses {
    /// `known` by step id; also each plan step's dependencies by position.
    fn new(plan: &Plan, mut known: HashMap<String, StepStatus>) -> Result<(Statuses, Vec<Vec<usize>>), DriveError> {
        let position: HashMap<String, usize> = plan.steps.iter().enumerate().map(|(i, s)| (s.id.clone(), i)).collect();
        let deps = plan
            .steps
            .iter()
            .map(|s| {
                s.depends_on
                    .iter()
                    .map(|d| {
                        position.get(d).copied().ok_or_else(|| {
                            DriveError::Ledger(Status::internal(format!(
                                "step '{}' depends on unknown step '{d}'",
                                s.id
                            )))
                        })
                    })
                    .collect::<Result<Vec<usize>, DriveError>>()
            })
            .collect::<Result<Vec<_>, _>>()?;
        let statuses = plan.steps.iter().map(|s| known.remove(&s.id).unwrap_or(StepStatus::Pending)).collect();
        Ok((Statuses { plan: statuses, position, dropped: known }, deps))
    }

    fn at(&self, i: usize) -> StepStatus {
        self.plan[i]
    }

    fn set(&mut self, i: usize, st: StepStatus) {
        self.plan[i] = st;
    }

    /// Sets a plan step's status by id (a step the plan does not hold has none to set).
    fn set_id(&mut self, id: &str, st: StepStatus) {
        if let Some(&i) = self.position.get(id) {
            self.plan[i] = st;
        }
    }

    fn values(&self) -> impl Iterator<Item = StepStatus> + '_ {
        self.plan.iter().chain(self.dropped.values()).copied()
    }
}

/// Whether `s` failed for good in a way that moves it to an alternative it has left, without
/// the move recorded.
fn unbranched(plan: &Plan, s: &warden_core::run::StepView) -> bool {
    matches!(s.status, StepStatus::Failed | StepStatus::Denied)
        && s.failed_kind.as_deref().is_some_and(warden_core::run::branches_on)
        && plan.step(&s.id).is_some_and(|p| p.alternatives.len() > s.branch as usize)
}

/// The declarations of the plan's tools as the run pinned them, pinning (`tools_pinned`) those
/// it uses for the first time as the catalog declares them now (seed 000 §15: metadata is
/// immutable for a run once it started). A tool no host serves now is pinned when it is.
async fn pin_tools(
    ctx: &RunCtx,
    plan: &Plan,
    view: &RunView,
) -> Result<std::collections::BTreeMap<String, PinnedTool>, DriveError> {
    let mut pinned = view.pinned.clone();
    let unpinned: std::collections::BTreeSet<&str> =
        plan.steps.iter().flat_map(|s| s.tools()).filter(|t| !pinned.contains_key(*t)).collect();
    if unpinned.is_empty() {
        return Ok(pinned);
    }
    let Ok(catalog) = ctx.ex.inner.catalog.tools().await else { return Ok(pinned) };
    let mut tools = serde_json::Map::new();
    for name in unpinned {
        let Some(entry) = catalog.get(name) else { continue };
        let p = PinnedTool {
            version: entry.spec.version.clone(),
            sha256: entry.declaration_sha256.clone(),
            effect: warden_grpc::catalog::effect_name(&entry.spec).to_string(),
        };
        tools.insert(name.to_string(), json!({"version": p.version, "sha256": p.sha256, "effect": p.effect}));
        pinned.insert(name.to_string(), p);
    }
    if tools.is_empty() {
        return Ok(pinned);
    }
    let names: Vec<&String> = tools.keys().collect();
    let digest = warden_core::sha256_hex(serde_json::to_string(&names).unwrap_or_default());
    let key = run_key(&ctx.run_id, &format!("tools_pinned:{}", &digest[..16]));
    // Recorded with the run's next append — the first call's request at the latest — so it
    // costs no round trip of its own and is durable before any pinned tool acts.
    ctx.defer(event(events::TOOLS_PINNED, "", key, json!({"tools": tools})));
    Ok(pinned)
}

/// The outputs of completed steps that are stored by reference, read back from the ledger
/// (a driver that did not run them needs them for the templates of the steps to come).
pub(super) async fn stored_outputs(
    ctx: &RunCtx,
    view: &RunView,
    outputs: &mut HashMap<String, Value>,
) -> Result<(), DriveError> {
    for s in view.steps.iter().filter(|s| s.status == StepStatus::Completed) {
        let Some((sha256, _)) = &s.output_ref else { continue };
        let req =
            pb::GetOutputRequest { tenant: ctx.tenant.clone(), run_id: ctx.run_id.clone(), sha256: sha256.clone() };
        let stored = within_grace(ctx, "ledger", (&s.id, s.attempts.max(1)), || {
            let mut ledger = ctx.ex.inner.ledger.clone();
            let req = req.clone();
            async move { ledger.get_output(req).await }
        })
        .await
        .map_err(DriveError::Ledger)?;
        let value: Value = serde_json::from_str(&stored.output_json).map_err(|e| {
            DriveError::Ledger(Status::internal(format!("stored output of step '{}' is not JSON: {e}", s.id)))
        })?;
        outputs.insert(s.id.clone(), value);
    }
    Ok(())
}
