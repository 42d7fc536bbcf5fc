//! Driving one run: lease, rebuild from the ledger, schedule the DAG, finish.

use std::collections::HashMap;
use std::time::Duration;

use serde_json::{Value, json};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tonic::{Code, Status};
use tracing::Instrument;
use warden_core::canonical::{args_digest, canonical_json};
use warden_core::events::{self, RunStatus};
use warden_core::plan::{Plan, PlanLimits, PlanStep};
use warden_core::run::{RunView, StepStatus};
use warden_core::template;
use warden_grpc::convert::event_from_proto;
use warden_lease::{LeaseError, RunLease};
use warden_proto::v1 as pb;

use crate::Executor;

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

/// Adds the W3C ids of `span` to an outcome's payload (unless it names some already): the
/// receipt the ledger derives from the outcome cites them (SPEC-KERN-01 §5), so an auditor
/// can go from a receipt to its trace. Nothing is added when the process exports no traces.
fn cite_trace(payload: &mut Value, span: &tracing::Span) {
    if let Some(p) = payload.as_object_mut()
        && !p.contains_key("trace_id")
        && let Some(ids) = warden_telemetry::context::ids(span)
    {
        p.insert("trace_id".into(), Value::String(ids.trace_id));
        p.insert("span_id".into(), Value::String(ids.span_id));
    }
}

/// `payload` citing the current span (see [`cite_trace`]).
fn traced(mut payload: Value) -> Value {
    cite_trace(&mut payload, &tracing::Span::current());
    payload
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

/// Timeout when a tool declares none (seed 000 §7).
pub const FALLBACK_TIMEOUT: Duration = Duration::from_secs(60);

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
}

/// What one step came to.
enum StepOutcome {
    Completed(Value),
    /// Failed, denied or refused; the reason is recorded in the ledger.
    Failed(String),
    /// The tool may or may not have acted; nothing more can be known from here.
    Unknown(String),
    /// Policy wants a human approval first.
    Blocked {
        decision_id: String,
        reason: String,
    },
    /// The run is being cancelled and the step's tool was never invoked.
    Cancelled,
    /// The attempt failed, is recorded, and the tool's retry policy allows another after
    /// `backoff` (internal to a step: the scheduler never sees it).
    Retry {
        retry_of: String,
        backoff: Duration,
    },
}

impl StepOutcome {
    /// The `warden_steps_total` / `warden_attempts_total` outcome label.
    fn label(&self) -> &'static str {
        match self {
            StepOutcome::Completed(_) => "completed",
            StepOutcome::Failed(_) => "failed",
            StepOutcome::Unknown(_) => "unknown",
            StepOutcome::Blocked { .. } => "blocked",
            StepOutcome::Cancelled => "cancelled",
            StepOutcome::Retry { .. } => "retry",
        }
    }
}

/// Attempts a tool's declared retry policy allows (seed 000: NONE 1, STANDARD 3, AGGRESSIVE 5).
fn max_attempts(policy: i32) -> u32 {
    match pb::RetryPolicy::try_from(policy) {
        Ok(pb::RetryPolicy::Standard) => 3,
        Ok(pb::RetryPolicy::Aggressive) => 5,
        _ => 1,
    }
}

/// Most of a callee's error a `run_waiting` event keeps.
const MAX_WAIT_ERROR_BYTES: usize = 512;

/// How often an idempotent tool is asked before an unknown outcome goes to an operator.
const UNKNOWN_OUTCOME_TRIES: usize = 3;

/// The per-run context a driver and its step tasks share.
#[derive(Clone)]
struct RunCtx {
    ex: Executor,
    run_id: String,
    tenant: String,
    /// The agent the run acts for (from `run_submitted`; empty: the tenant itself).
    agent: String,
    epoch: u64,
    lost: CancellationToken,
    /// Fires when someone asked to cancel the run (see `Runs.CancelRun`).
    cancel: CancellationToken,
    /// Fires when someone asked to pause the run (see `Runs.PauseRun`): nothing new starts,
    /// the steps in flight settle, the run is recorded paused and the lease released.
    pause: CancellationToken,
    /// The run's cancel policy: immediate (also the default) or after the tool call.
    cancel_policy: pb::CancelPolicy,
    /// Outcomes waiting to be appended with the run's next append (see [`RunCtx::defer`]).
    deferred: std::sync::Arc<std::sync::Mutex<Vec<pb::EventInput>>>,
    /// One append of the run at a time, so what waits is recorded before what follows it.
    appending: std::sync::Arc<tokio::sync::Mutex<()>>,
}

/// One event to append, as the ledger takes it.
fn event(event_type: &str, step_id: &str, key: String, payload: Value) -> pb::EventInput {
    pb::EventInput {
        idempotency_key: key,
        event_type: event_type.to_string(),
        payload_json: payload.to_string(),
        step_id: step_id.to_string(),
    }
}

/// The policy's signed record of a decision, to append with what the executor does about it.
fn decision_event(step_id: &str, decision_id: &str, record_json: &str) -> Option<pb::EventInput> {
    (!record_json.is_empty()).then(|| pb::EventInput {
        idempotency_key: events::decision_key(decision_id),
        event_type: events::POLICY_DECISION.to_string(),
        payload_json: record_json.to_string(),
        step_id: step_id.to_string(),
    })
}

/// Largest tool output whose `tool_completed` may wait for the run's next append (bigger ones
/// are appended at once, so a refusal stays the step's own).
const DEFERRABLE_OUTPUT_BYTES: usize = 64 * 1024;

impl RunCtx {
    /// Appends an event (with any deferred outcomes before it, in the same transaction).
    async fn append(
        &self,
        event_type: &str,
        step_id: &str,
        key: String,
        payload: Value,
    ) -> Result<pb::Event, DriveError> {
        let mut appended = self.append_all(vec![event(event_type, step_id, key, payload)]).await?;
        appended
            .pop()
            .and_then(|a| a.event)
            .ok_or_else(|| DriveError::Ledger(Status::internal("ledger returned no event")))
    }

    /// Keeps an outcome to be appended with the run's next append: in a chain, one step's
    /// outcome, the next step's decision and its request become one ledger transaction. Only
    /// outcomes of idempotent tools wait (if the executor dies first, the call is asked again
    /// under the same key and the host replays its outcome); others are appended at once.
    fn defer(&self, e: pb::EventInput) {
        self.deferred.lock().unwrap_or_else(|p| p.into_inner()).push(e);
    }

    /// Appends what waits, if anything.
    async fn flush(&self) -> Result<(), DriveError> {
        if self.deferred.lock().unwrap_or_else(|p| p.into_inner()).is_empty() {
            return Ok(());
        }
        self.append_all(Vec::new()).await.map(|_| ())
    }

    /// Appends `events` of this run in one ledger transaction — all or nothing — after the
    /// deferred outcomes, retrying transient failures with the same idempotency keys (so a
    /// retry never doubles an event). Answers for `events` only.
    async fn append_all(&self, events: Vec<pb::EventInput>) -> Result<Vec<pb::AppendEventResponse>, DriveError> {
        let _turn = self.appending.lock().await;
        let deferred: Vec<pb::EventInput> =
            std::mem::take(&mut *self.deferred.lock().unwrap_or_else(|p| p.into_inner()));
        if deferred.is_empty() {
            return self.append_group(events).await;
        }
        let n = deferred.len();
        let mut all = deferred.clone();
        all.extend(events.iter().cloned());
        match self.append_group(all).await {
            Ok(mut appended) => Ok(appended.split_off(n.min(appended.len()))),
            // Refused as a whole: keep the outcomes apart from whatever was refused.
            Err(DriveError::Ledger(s)) if !retryable(&s) => {
                self.append_group(deferred).await?;
                if events.is_empty() { Ok(Vec::new()) } else { self.append_group(events).await }
            }
            Err(e) => {
                // Not written (or not known to be): they wait for the next try.
                let mut waiting = self.deferred.lock().unwrap_or_else(|p| p.into_inner());
                let later = std::mem::take(&mut *waiting);
                *waiting = deferred;
                waiting.extend(later);
                Err(e)
            }
        }
    }

    async fn append_group(&self, events: Vec<pb::EventInput>) -> Result<Vec<pb::AppendEventResponse>, DriveError> {
        if events.is_empty() {
            return Ok(Vec::new());
        }
        let span = tracing::info_span!("ledger.append", otel.kind = "client", events = events.len());
        self.append_group_traced(events).instrument(span).await
    }

    async fn append_group_traced(
        &self,
        events: Vec<pb::EventInput>,
    ) -> Result<Vec<pb::AppendEventResponse>, DriveError> {
        let req = pb::AppendEventsRequest {
            tenant: self.tenant.clone(),
            run_id: self.run_id.clone(),
            epoch: self.epoch,
            events,
        };
        // Appends are idempotent by key: a ledger restart or a database blip is waited out
        // within the outage grace.
        let grace = Duration::from_millis(self.ex.inner.config.outage_grace_ms);
        let started = tokio::time::Instant::now();
        let mut backoff = Duration::from_millis(20);
        loop {
            match self.ex.inner.ledger.clone().append_events(req.clone()).await {
                Ok(r) => return Ok(r.into_inner().appended),
                Err(s) if warden_grpc::is_fenced(&s) => return Err(DriveError::Fenced),
                Err(s) if retryable(&s) && started.elapsed() < grace && !self.lost.is_cancelled() => {
                    tracing::debug!(run_id = %self.run_id, error = %s, "ledger append retried");
                    tokio::time::sleep(jittered(backoff)).await;
                    backoff = (backoff * 2).min(Duration::from_secs(2));
                }
                Err(s) => return Err(DriveError::Ledger(s)),
            }
        }
    }

    /// Records a step's failure (after the decision it follows, when there is one to record)
    /// and returns it as the step's outcome.
    async fn step_failed(
        &self,
        event_type: &str,
        step_id: &str,
        attempt: u32,
        payload: Value,
    ) -> Result<StepOutcome, DriveError> {
        self.step_failed_after(None, event_type, step_id, attempt, payload).await
    }

    async fn step_failed_after(
        &self,
        decision: Option<pb::EventInput>,
        event_type: &str,
        step_id: &str,
        attempt: u32,
        payload: Value,
    ) -> Result<StepOutcome, DriveError> {
        let reason = payload.get("reason").and_then(Value::as_str).unwrap_or_default().to_string();
        let payload = traced(payload);
        let mut events: Vec<pb::EventInput> = decision.into_iter().collect();
        events.push(event(event_type, step_id, self.step_key(step_id, attempt, "failed"), payload));
        self.append_all(events).await?;
        Ok(StepOutcome::Failed(reason))
    }

    async fn step_cancelled(&self, step_id: &str, reason: &str) -> Result<StepOutcome, DriveError> {
        self.step_cancelled_after(None, step_id, reason).await
    }

    /// A step cancelled after its decision: the decision is recorded with the cancellation.
    async fn step_cancelled_after(
        &self,
        decision: Option<pb::EventInput>,
        step_id: &str,
        reason: &str,
    ) -> Result<StepOutcome, DriveError> {
        let key = self.step_key(step_id, 0, "cancelled");
        let reason = format!("{reason} ({})", policy_name(self.cancel_policy));
        let mut events: Vec<pb::EventInput> = decision.into_iter().collect();
        events.push(event(events::STEP_CANCELLED, step_id, key, traced(json!({"reason": reason}))));
        self.append_all(events).await?;
        Ok(StepOutcome::Cancelled)
    }

    /// Says on the record that `step_id`'s attempt waits out an outage of `on` (`run_waiting`;
    /// `GetRun` reports it as `waiting_for` until the step's next event). Appending also
    /// records the outcomes still waiting, so they need not wait out the outage. Best effort:
    /// a ledger that cannot take it now changes nothing about the wait.
    async fn record_wait(&self, on: &str, (step_id, attempt): (&str, u32), error: &str) {
        // One wait per driver (epoch): a successor's wait is a new one.
        let key = self.step_key(step_id, attempt, &format!("waiting:{on}:e{}", self.epoch));
        // What the callee said, bounded: a host's status message is its own to size.
        let error = &error[..error.floor_char_boundary(MAX_WAIT_ERROR_BYTES)];
        let payload = json!({"on": on, "attempt": attempt, "error": error});
        let appended = tokio::time::timeout(
            Duration::from_secs(5),
            self.append_group_once(vec![event(events::RUN_WAITING, step_id, key, payload)]),
        )
        .await;
        if !matches!(appended, Ok(Ok(_))) {
            tracing::debug!(run_id = %self.run_id, on, "the wait could not be recorded");
        }
    }

    /// One try at appending `events` after what is deferred (no waiting out a ledger outage).
    async fn append_group_once(&self, events: Vec<pb::EventInput>) -> Result<(), Status> {
        let _turn = self.appending.lock().await;
        let mut all: Vec<pb::EventInput> = self.deferred.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let n = all.len();
        all.extend(events);
        let req = pb::AppendEventsRequest {
            tenant: self.tenant.clone(),
            run_id: self.run_id.clone(),
            epoch: self.epoch,
            events: all,
        };
        self.ex.inner.ledger.clone().append_events(req).await?;
        // Recorded: the outcomes taken no longer wait (the first `n`: steps may have deferred
        // more meanwhile).
        self.deferred.lock().unwrap_or_else(|p| p.into_inner()).drain(..n);
        Ok(())
    }

    fn step_key(&self, step_id: &str, attempt: u32, what: &str) -> String {
        run_key(&self.run_id, &format!("{step_id}:{attempt}:{what}"))
    }
}

/// `{run_id}:{rest}`: a key scoped to the run. Keys are per run; a long run id (a fork's)
/// with a long step id would pass the id limit: the run's part is then a 16-hex-digit digest.
fn run_key(run_id: &str, rest: &str) -> String {
    let key = format!("{run_id}:{rest}");
    if key.len() <= warden_core::ids::MAX_ID_LEN {
        return key;
    }
    format!("{}:{rest}", &warden_core::canonical::sha256_hex(run_id.as_bytes())[..16])
}

/// How a cancel policy reads in a step's reason (and so in its receipt).
fn policy_name(p: pb::CancelPolicy) -> &'static str {
    match p {
        pb::CancelPolicy::AfterToolCall | pb::CancelPolicy::AfterToken => "cancel policy after_tool_call",
        _ => "cancel policy immediate",
    }
}

fn retryable(s: &Status) -> bool {
    matches!(
        s.code(),
        Code::Unavailable | Code::Unknown | Code::DeadlineExceeded | Code::Aborted | Code::ResourceExhausted
    )
}

/// Reads a run's whole log and folds it.
pub(crate) async fn load_view(ex: &Executor, tenant: &str, run_id: &str) -> Result<(RunView, Vec<pb::Event>), Status> {
    let mut stream = ex
        .inner
        .ledger
        .clone()
        .stream_events(pb::StreamEventsRequest {
            tenant: tenant.to_string(),
            run_id: run_id.to_string(),
            since_seq: 0,
            follow: false,
        })
        .await?
        .into_inner();
    let mut view = RunView::default();
    let mut all = Vec::new();
    while let Some(e) = stream.message().await? {
        let ce = event_from_proto(&e);
        view.apply(ce.body.seq, &ce.body.event_type, &ce.body.step_id, &ce.body.payload);
        all.push(e);
    }
    Ok((view, all))
}

/// Drives `run_id` to a terminal status (or until its lease is lost): the recovery path,
/// which takes the lease, raises the epoch in the ledger and rebuilds the run from it.
pub async fn drive(ex: &Executor, run_id: &str) -> Result<(), DriveError> {
    let run = ex
        .inner
        .ledger
        .clone()
        .get_run(pb::GetLedgerRunRequest { tenant: String::new(), run_id: run_id.to_string() })
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
pub async fn drive_submitted(ex: &Executor, tenant: &str, lease: RunLease, view: RunView) -> Result<(), DriveError> {
    with_lease(ex, tenant, lease, Some(view)).await
}

async fn with_lease(ex: &Executor, tenant: &str, lease: RunLease, view: Option<RunView>) -> Result<(), DriveError> {
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
    };
    let mut result = match view {
        Some(view) => drive_view(&ctx, view).await,
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
    let (view, _) = load_view(&ctx.ex, &ctx.tenant, &ctx.run_id).await.map_err(DriveError::Ledger)?;
    drive_view(ctx, view).await
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
    run_dag(ctx, &plan, view).await
}

/// Plans a goal run (the planner asks the model, or replays what the run recorded) and
/// records the plan (`plan_created`, returned); `None` when the run ended instead (the model
/// call was denied, the provider stayed down, a strict replay was refused, or planning forked).
async fn plan_goal(ctx: &RunCtx, goal: &str, view: &RunView) -> Result<Option<pb::Event>, DriveError> {
    let req = pb::CreatePlanRequest {
        tenant: ctx.tenant.clone(),
        run_id: ctx.run_id.clone(),
        goal: goal.to_string(),
        epoch: ctx.epoch,
        agent: view.agent.clone(),
        replay_policy: view.replay_policy,
        ..Default::default()
    };
    let round = warden_core::plan::planner_step(0);
    let planning = within_grace(ctx, "planner", (&round, 1), || {
        let mut planner = ctx.ex.inner.planner.clone();
        let req = req.clone();
        async move { planner.create_plan(req).await }
    });
    // A lost lease stops waiting (the planner's own writes are fenced by the epoch).
    let planned = tokio::select! {
        p = planning => p,
        _ = ctx.lost.cancelled() => return Err(DriveError::LeaseLost),
    };
    let failed = |kind: &str, reason: String| json!({"reason": reason, "kind": kind});
    let planned = match planned {
        Ok(p) => p,
        Err(s) if warden_grpc::is_fenced(&s) => return Err(DriveError::Fenced),
        Err(s) if s.code() == Code::FailedPrecondition => {
            finish(ctx, events::RUN_FAILED, failed("planning_refused", format!("planning refused: {}", s.message())))
                .await?;
            return Ok(None);
        }
        Err(s) if transient(&s) => {
            let reason = format!("planner_unavailable: {}", s.message());
            finish(ctx, events::RUN_FAILED, failed("planner_unavailable", reason)).await?;
            return Ok(None);
        }
        Err(s) => return Err(DriveError::Ledger(s)),
    };
    match planned.source.as_str() {
        "denied" => {
            let reason = format!("model call denied by {}: {}", planned.rule_id, planned.reason);
            let mut payload = failed("model_call_denied", reason);
            payload["rule_id"] = json!(planned.rule_id);
            finish(ctx, events::RUN_FAILED, payload).await?;
            Ok(None)
        }
        "unavailable" => {
            let reason = format!("planner_unavailable: {}", planned.reason);
            finish(ctx, events::RUN_FAILED, failed("planner_unavailable", reason)).await?;
            Ok(None)
        }
        "fork" => {
            let fork = crate::replay::fork(&ctx.ex, &ctx.tenant, &ctx.run_id, &planned.fork_hash)
                .await
                .map_err(DriveError::Ledger)?;
            let mut payload = failed("forked_on_drift", format!("planning drifted from the record; forked to {fork}"));
            payload["forked_run_id"] = json!(fork);
            payload["differences"] = json!(planned.differences);
            finish(ctx, events::RUN_FAILED, payload).await?;
            Ok(None)
        }
        source => {
            let plan = Plan::parse(&planned.plan_json)
                .map_err(|e| DriveError::Ledger(Status::internal(format!("the planner's plan does not parse: {e}"))))?;
            let mut payload = json!({
                "plan": plan,
                "source": source,
                "model_calls": planned.model_calls,
                "replayed_calls": planned.replayed_calls,
            });
            if !planned.reason.is_empty() {
                payload["reason"] = json!(planned.reason);
            }
            if !planned.differences.is_empty() {
                payload["differences"] = json!(planned.differences);
            }
            let created =
                ctx.append(events::PLAN_CREATED, "", format!("{}:plan_created:r0", ctx.run_id), payload).await?;
            Ok(Some(created))
        }
    }
}

async fn finish(ctx: &RunCtx, event_type: &str, payload: Value) -> Result<(), DriveError> {
    ctx.append(event_type, "", event_type.to_string(), payload).await?;
    tracing::info!(run_id = %ctx.run_id, outcome = event_type, "run finished");
    let status = run_status_label(event_type);
    warden_telemetry::metrics::run_reached(status);
    tracing::Span::current().record("run.status", status);
    Ok(())
}

async fn run_dag(ctx: &RunCtx, plan: &Plan, view: RunView) -> Result<(), DriveError> {
    let all_tools = |_: &str| true;
    let order = plan
        .validate(&PlanLimits { max_steps: usize::MAX, known_tool: &all_tools })
        .map_err(|e| DriveError::Ledger(Status::internal(format!("recorded plan no longer validates: {e}"))))?;
    let mut status: HashMap<String, StepStatus> = view
        .steps
        .iter()
        .map(|s| (s.id.clone(), if s.outcome_unknown { StepStatus::Pending } else { s.status }))
        .collect();
    let mut outputs = view.outputs();
    if view.steps.iter().any(|s| s.status == StepStatus::Pending) {
        stored_outputs(ctx, &view, &mut outputs).await?;
    }
    let resume: HashMap<String, Resume> = view.steps.iter().map(|s| (s.id.clone(), Resume::of(s))).collect();
    let mut first_failure: Option<String> = view
        .steps
        .iter()
        .find(|s| matches!(s.status, StepStatus::Failed | StepStatus::Denied))
        .map(|s| format!("step '{}' failed: {}", s.id, s.error.clone().unwrap_or_default()));
    let limit = ctx.ex.inner.config.max_concurrency;
    let mut reconcile: Option<(String, String)> = None;
    // A step waiting for an approval: nothing new starts, the run blocks once the rest settles.
    let mut blocked: Option<(String, String, String)> = None;
    let mut cancel_seen = false;
    let mut pause_seen = false;
    let mut running: JoinSet<(String, Result<StepOutcome, DriveError>)> = JoinSet::new();
    loop {
        if ctx.lost.is_cancelled() {
            return Err(DriveError::LeaseLost);
        }
        // Cancelled: nothing new starts; steps already running settle by the cancel policy.
        if ctx.cancel.is_cancelled() {
            for &i in &order {
                let step = &plan.steps[i];
                if status[&step.id] == StepStatus::Pending && !resume[&step.id].asked_before {
                    ctx.append(
                        events::STEP_CANCELLED,
                        &step.id,
                        ctx.step_key(&step.id, 0, "cancelled"),
                        traced(
                            json!({"reason": format!("the run was cancelled ({})", policy_name(ctx.cancel_policy))}),
                        ),
                    )
                    .await?;
                    warden_telemetry::metrics::step_settled("cancelled");
                    status.insert(step.id.clone(), StepStatus::Cancelled);
                }
            }
        }
        let mut launched = false;
        // Dependents of a failed, denied or cancelled step are cancelled (in dependency order,
        // so the cancellation cascades in one pass).
        for &i in &order {
            let step = &plan.steps[i];
            if status[&step.id] != StepStatus::Pending {
                continue;
            }
            let blocked = step.depends_on.iter().find(|d| {
                matches!(status[d.as_str()], StepStatus::Failed | StepStatus::Denied | StepStatus::Cancelled)
            });
            if let Some(dep) = blocked {
                let reason = format!("dependency '{dep}' did not complete");
                ctx.append(
                    events::STEP_CANCELLED,
                    &step.id,
                    ctx.step_key(&step.id, 0, "cancelled"),
                    traced(json!({"reason": reason})),
                )
                .await?;
                warden_telemetry::metrics::step_settled("cancelled");
                status.insert(step.id.clone(), StepStatus::Cancelled);
            }
        }
        let handing_off = ctx.ex.inner.handoff.is_cancelled();
        for &i in &order {
            // After an unknown outcome nothing new starts: an operator decides first. Nor while
            // this replica hands its runs off.
            if running.len() >= limit || reconcile.is_some() || blocked.is_some() || handing_off || pausing(ctx) {
                break;
            }
            let step = &plan.steps[i];
            let ready = status[&step.id] == StepStatus::Pending
                && step.depends_on.iter().all(|d| status[d.as_str()] == StepStatus::Completed);
            if !ready {
                continue;
            }
            status.insert(step.id.clone(), StepStatus::Running);
            launched = true;
            match template::resolve(&step.params, &outputs) {
                Ok(args) => {
                    let (c, s) = (ctx.clone(), step.clone());
                    let from = resume.get(&step.id).cloned().unwrap_or_default();
                    let span = tracing::info_span!("step", step_id = %s.id, tool = %s.tool);
                    running.spawn(
                        async move {
                            let id = s.id.clone();
                            (id, execute_step(&c, &s, args, from).await)
                        }
                        .instrument(span),
                    );
                }
                Err(e) => {
                    let reason = format!("template resolution failed: {e}");
                    ctx.append(
                        events::STEP_FAILED,
                        &step.id,
                        ctx.step_key(&step.id, 1, "failed"),
                        traced(json!({"kind": "template", "reason": reason})),
                    )
                    .await?;
                    warden_telemetry::metrics::step_settled("failed");
                    first_failure.get_or_insert(format!("step '{}' failed: {reason}", step.id));
                    status.insert(step.id.clone(), StepStatus::Failed);
                }
            }
        }
        // Outcomes wait for the next append of the run: a step launched now carries them;
        // if none was, append them before waiting on the steps still running.
        if !launched && !running.is_empty() {
            ctx.flush().await?;
        }
        if running.is_empty() && handing_off {
            // What settled is recorded; the rest is the next holder's (the lease is released
            // on the way out, so it is taken over at once).
            ctx.flush().await?;
            tracing::info!(run_id = %ctx.run_id, "run handed off");
            return Ok(());
        }
        if running.is_empty() {
            let settled = status.values().all(|s| *s != StepStatus::Pending && *s != StepStatus::Running);
            if settled || reconcile.is_some() || blocked.is_some() {
                break;
            }
            if pausing(ctx) {
                return pause(ctx).await;
            }
            // Every pending step is either ready or cancelled by the passes above, so an idle
            // loop here would be a scheduler bug: stop rather than spin.
            if !launched {
                return Err(DriveError::Ledger(Status::internal("scheduler found no runnable step")));
            }
            continue;
        }
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
        let (step_id, outcome) =
            joined.map_err(|e| DriveError::Ledger(Status::internal(format!("step task failed: {e}"))))?;
        let outcome = outcome?;
        warden_telemetry::metrics::step_settled(outcome.label());
        match outcome {
            StepOutcome::Completed(out) => {
                outputs.insert(step_id.clone(), out);
                status.insert(step_id, StepStatus::Completed);
            }
            StepOutcome::Failed(why) => {
                first_failure.get_or_insert(format!("step '{step_id}' failed: {why}"));
                status.insert(step_id, StepStatus::Failed);
            }
            StepOutcome::Unknown(why) => {
                status.insert(step_id.clone(), StepStatus::Running);
                reconcile.get_or_insert((step_id, why));
            }
            StepOutcome::Blocked { decision_id, reason } => {
                status.insert(step_id.clone(), StepStatus::Pending);
                blocked.get_or_insert((step_id, decision_id, reason));
            }
            StepOutcome::Cancelled => {
                status.insert(step_id, StepStatus::Cancelled);
            }
            // `execute_step` runs a step's retries itself.
            StepOutcome::Retry { .. } => {
                first_failure.get_or_insert(format!("step '{step_id}' stopped between attempts"));
                status.insert(step_id, StepStatus::Failed);
            }
        }
    }
    let count = |st: StepStatus| status.values().filter(|s| **s == st).count();
    let summary = json!({
        "completed": count(StepStatus::Completed),
        "failed": count(StepStatus::Failed) + count(StepStatus::Denied),
        "cancelled": count(StepStatus::Cancelled),
    });
    if ctx.cancel.is_cancelled() && reconcile.is_none() {
        let (view, _) = load_view(&ctx.ex, &ctx.tenant, &ctx.run_id).await.map_err(DriveError::Ledger)?;
        let why = view.cancel_requested.unwrap_or_default();
        let reason = if why.is_empty() { "cancelled on request".to_string() } else { format!("cancelled: {why}") };
        return finish(ctx, events::RUN_CANCELLED, json!({"reason": reason, "summary": summary})).await;
    }
    if let Some((step_id, decision_id, reason)) = blocked {
        let payload = json!({"reason": reason, "step_id": step_id, "decision_id": decision_id});
        // One block per drive: blocking again on the same decision after a resume is a new
        // block (keyed by this drive's epoch), never deduplicated into an `active` run that
        // the sweeper would restart forever.
        let key = format!("run_blocked:{decision_id}:{}", ctx.epoch);
        ctx.append(events::RUN_BLOCKED, "", key, payload).await?;
        tracing::info!(run_id = %ctx.run_id, step_id = %step_id, "run blocked on an approval");
        warden_telemetry::metrics::run_reached("blocked");
        tracing::Span::current().record("run.status", "blocked");
        return Ok(());
    }
    if let Some((step_id, why)) = reconcile {
        let reason = format!("step '{step_id}' has an unknown outcome: {why}");
        return finish(ctx, events::RUN_REQUIRES_RECONCILIATION, json!({"reason": reason, "step_id": step_id})).await;
    }
    match first_failure {
        None => finish(ctx, events::RUN_COMPLETED, json!({"reason": "", "summary": summary})).await,
        Some(reason) => finish(ctx, events::RUN_FAILED, json!({"reason": reason, "summary": summary})).await,
    }
}

/// Whether the run is to pause: asked for, and not overtaken by a cancellation (which ends
/// the run instead).
fn pausing(ctx: &RunCtx) -> bool {
    ctx.pause.is_cancelled() && !ctx.cancel.is_cancelled()
}

/// Records that the run is paused, once the steps in flight settled: what waits is recorded
/// with it, and the lease is released on the way out (`with_lease`), so no executor holds the
/// run until it is resumed.
async fn pause(ctx: &RunCtx) -> Result<(), DriveError> {
    let (view, _) = load_view(&ctx.ex, &ctx.tenant, &ctx.run_id).await.map_err(DriveError::Ledger)?;
    let why = view.pause_requested.unwrap_or_default();
    let reason = if why.is_empty() { "paused on request".to_string() } else { format!("paused: {why}") };
    // One pause per drive: a run paused again after a resume is driven under a new epoch.
    ctx.append(events::RUN_PAUSED, "", format!("run_paused:e{}", ctx.epoch), json!({"reason": reason})).await?;
    tracing::info!(run_id = %ctx.run_id, "run paused");
    warden_telemetry::metrics::run_reached("paused");
    tracing::Span::current().record("run.status", "paused");
    Ok(())
}

/// One step: its attempts, from `attempt` (a retry names the allow it retries), with the
/// backoff between them. A failure is retried only when the tool reported it retryable and
/// its declared policy allows another attempt; denials are decisions, never retried (K07).
async fn execute_step(ctx: &RunCtx, step: &PlanStep, args: Value, from: Resume) -> Result<StepOutcome, DriveError> {
    let Resume { mut attempt, mut retry_of, asked_before, not_before_ms } = from;
    // A retry that a previous executor scheduled keeps its backoff.
    let mut wait = not_before_ms
        .map_or(Duration::ZERO, |t| Duration::from_millis(t.saturating_sub(warden_grpc::now_ms()).max(0) as u64));
    let mut asked_before = asked_before;
    loop {
        if !wait.is_zero() {
            tokio::select! {
                _ = tokio::time::sleep(wait) => {}
                _ = ctx.lost.cancelled() => return Err(DriveError::LeaseLost),
                // The next attempt sees the cancellation before it starts.
                _ = ctx.cancel.cancelled() => {}
            }
        }
        let span = tracing::info_span!("attempt", attempt, outcome = tracing::field::Empty);
        let outcome = execute_attempt(ctx, step, args.clone(), attempt, retry_of.as_deref(), asked_before)
            .instrument(span.clone())
            .await?;
        warden_telemetry::metrics::attempt_settled(outcome.label());
        span.record("outcome", outcome.label());
        asked_before = false;
        match outcome {
            StepOutcome::Retry { retry_of: first, backoff } => {
                wait = backoff;
                retry_of = Some(first);
                attempt += 1;
            }
            other => return Ok(other),
        }
    }
}

/// Calls `call` until it answers, retrying UNAVAILABLE and transport failures (the callee is
/// restarting, its store had a blip) with jittered exponential backoff for up to the executor's
/// outage grace. Only idempotent calls go through here. Stops early when the lease is lost.
/// The first retry records that `waiter` (a step's attempt, or a planning round) waits on
/// `what` (see [`RunCtx::record_wait`]).
async fn within_grace<T, F, Fut>(ctx: &RunCtx, what: &str, waiter: (&str, u32), mut call: F) -> Result<T, Status>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<tonic::Response<T>, Status>>,
{
    let grace = Duration::from_millis(ctx.ex.inner.config.outage_grace_ms);
    let started = tokio::time::Instant::now();
    let mut backoff = Duration::from_millis(20);
    let mut said = false;
    loop {
        match call().await {
            Ok(r) => return Ok(r.into_inner()),
            Err(s) if transient(&s) && started.elapsed() < grace && !ctx.lost.is_cancelled() => {
                tracing::debug!(run_id = %ctx.run_id, callee = what, error = %s, "waiting out an outage");
                if !said {
                    said = true;
                    ctx.record_wait(what, waiter, s.message()).await;
                }
                tokio::time::sleep(jittered(backoff)).await;
                backoff = (backoff * 2).min(Duration::from_secs(2));
            }
            Err(s) => return Err(s),
        }
    }
}

/// Whether a call of this tool whose answer was lost may be asked again under its key: the
/// tool is idempotent, or its host tells a call in doubt from one it finished (it replays the
/// outcome, or says it is in doubt, and never acts twice).
fn may_ask_again(spec: &pb::ToolSpec) -> bool {
    spec.idempotent || spec.detects_in_doubt
}

/// A host's answer that the call is in doubt: it was started before and its outcome never
/// recorded (see `ToolSpec.detects_in_doubt`).
fn in_doubt(s: &Status) -> bool {
    s.code() == Code::Unknown && s.message().starts_with("in doubt") && std::error::Error::source(s).is_none()
}

/// A call that never reached its callee: the connection was not established, so nothing was
/// sent and nothing can have happened (unlike a call that broke off once sent).
fn never_sent(s: &Status) -> bool {
    if s.code() != Code::Unavailable {
        return false;
    }
    // Only the client's own transport error says so: a status a host sent (whatever its
    // message) came over an established connection, and the host may have acted.
    let mut source = std::error::Error::source(s);
    let mut text = String::new();
    while let Some(e) = source {
        text.push_str(&format!(" {e:?}"));
        source = e.source();
    }
    let text = text.to_ascii_lowercase();
    text.contains("connecterror") || text.contains("connection refused")
}

/// An error of an idempotent call that asking again may cure: the callee could not be
/// reached, said it cannot answer now, or the connection broke off under the call (a callee
/// killed mid-request: the client's own transport error, whatever code tonic gives it).
fn transient(s: &Status) -> bool {
    matches!(s.code(), Code::Unavailable | Code::ResourceExhausted | Code::Aborted) || broke_off(s)
}

/// The client's transport failed under the call: a status the callee sent has no source
/// error, one the client made of a broken connection (reset, broken pipe, stream closed)
/// carries the transport error.
fn broke_off(s: &Status) -> bool {
    matches!(s.code(), Code::Unknown | Code::Cancelled | Code::Internal | Code::Unavailable)
        && std::error::Error::source(s).is_some()
}

/// `d` scaled by a factor in [0.5, 1.5), so callers that failed together do not retry together.
fn jittered(d: Duration) -> Duration {
    let r = (uuid::Uuid::new_v4().as_u128() % 1000) as f64 / 1000.0;
    d.mul_f64(0.5 + r)
}

/// Most a single cost record may carry (the policy refuses more): a tool reporting more
/// spends this much, which exhausts any sane budget, rather than nothing.
const MAX_COST_PER_RECORD: f64 = 1e9;

/// Spends a step attempt's reported cost against the run's and tenant's budgets (recorded once
/// per attempt, so retrying is safe). A negative or non-finite report counts as nothing.
async fn record_cost(ctx: &RunCtx, step_id: &str, attempt: u32, cost: f64) {
    let cost = if cost.is_finite() { cost.clamp(0.0, MAX_COST_PER_RECORD) } else { 0.0 };
    let req = pb::RecordCostRequest {
        tenant: ctx.tenant.clone(),
        run_id: ctx.run_id.clone(),
        step_id: step_id.to_string(),
        cost,
        attempt,
    };
    let mut backoff = Duration::from_millis(50);
    for _ in 0..8 {
        match ctx.ex.inner.policy.clone().record_cost(req.clone()).await {
            Ok(_) => return,
            Err(s) if retryable(&s) && !ctx.lost.is_cancelled() => {
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(1));
            }
            Err(s) => {
                tracing::warn!(run_id = %ctx.run_id, step_id, error = %s, "cost not recorded");
                return;
            }
        }
    }
    tracing::warn!(run_id = %ctx.run_id, step_id, "cost not recorded: policy unavailable");
}

/// Stores an output too large to record inline (`Ledger.PutOutput`, idempotent), waiting out
/// a ledger outage within the grace.
async fn store_output(
    ctx: &RunCtx,
    waiter: (&str, u32),
    output_json: String,
) -> Result<pb::StoredOutputRef, DriveError> {
    let req =
        pb::PutOutputRequest { tenant: ctx.tenant.clone(), run_id: ctx.run_id.clone(), epoch: ctx.epoch, output_json };
    let stored = within_grace(ctx, "ledger", waiter, || {
        let mut ledger = ctx.ex.inner.ledger.clone();
        let req = req.clone();
        async move { ledger.put_output(req).await }
    })
    .await;
    match stored {
        Ok(r) => Ok(r),
        Err(s) if warden_grpc::is_fenced(&s) => Err(DriveError::Fenced),
        Err(s) => Err(DriveError::Ledger(s)),
    }
}

/// The outputs of completed steps that are stored by reference, read back from the ledger
/// (a driver that did not run them needs them for the templates of the steps to come).
async fn stored_outputs(ctx: &RunCtx, view: &RunView, outputs: &mut HashMap<String, Value>) -> Result<(), DriveError> {
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

/// Where a driver picks a pending step up.
#[derive(Clone)]
struct Resume {
    /// The attempt it starts with, and the allow a retry names.
    attempt: u32,
    retry_of: Option<String>,
    /// Its call was requested before a restart and has no outcome: its effect may have
    /// started, so a cancellation never erases it — it is asked again under the same key (or
    /// goes to reconciliation) and its outcome is recorded.
    asked_before: bool,
    /// When a retry a previous executor scheduled may start.
    not_before_ms: Option<i64>,
}

impl Default for Resume {
    fn default() -> Self {
        Resume { attempt: 1, retry_of: None, asked_before: false, not_before_ms: None }
    }
}

impl Resume {
    fn of(s: &warden_core::run::StepView) -> Resume {
        let (attempt, retry_of) = s.next_attempt();
        Resume { attempt, retry_of, asked_before: s.outcome_unknown, not_before_ms: s.retry_not_before_ms }
    }
}

/// One attempt: authorize (a retry is re-authorized, not decided again), record the request,
/// invoke, record the outcome.
async fn execute_attempt(
    ctx: &RunCtx,
    step: &PlanStep,
    args: Value,
    attempt: u32,
    retry_of: Option<&str>,
    asked_before: bool,
) -> Result<StepOutcome, DriveError> {
    let started = std::time::Instant::now();
    let idempotency_key = run_key(&ctx.run_id, &format!("{}:{attempt}", step.id));
    let fail = |kind: &str, reason: String, extra: Value| {
        let mut payload = json!({"kind": kind, "reason": reason, "attempt": attempt, "tool": step.tool});
        if let (Some(p), Value::Object(x)) = (payload.as_object_mut(), extra) {
            p.extend(x);
        }
        payload
    };
    // A call asked before (its outcome unknown) is finished, not cancelled: see `run_dag`.
    if ctx.cancel.is_cancelled() && !asked_before {
        return ctx.step_cancelled(&step.id, "the run was cancelled before the step started").await;
    }
    let tools = match ctx.ex.inner.catalog.tools().await {
        Ok(t) => t,
        Err(s) => {
            let p = fail("tool_catalog_unavailable", s.message().to_string(), json!({}));
            return ctx.step_failed(events::STEP_FAILED, &step.id, attempt, p).await;
        }
    };
    let Some(entry) = tools.get(&step.tool) else {
        let p = fail("unknown_tool", format!("no tool host serves '{}'", step.tool), json!({}));
        return ctx.step_failed(events::STEP_FAILED, &step.id, attempt, p).await;
    };
    // The step pipeline: resolved arguments must match the tool's declared input schema
    // before policy is asked or the tool invoked (literal params were checked at submission).
    // A call asked before is not checked again (it may have acted; its host's schema may have
    // changed since).
    if !asked_before
        && let Err(refused) = ctx.ex.inner.tool_schemas.check(&step.tool, &entry.spec.input_schema_json, &args)
    {
        let p = fail("invalid_arguments", refused.reason, json!({"field": refused.field}));
        return ctx.step_failed(events::STEP_FAILED, &step.id, attempt, p).await;
    }
    let args_json = canonical_json(&args);
    // K01/K19: without a recorded allow decision and its signed authorization, nothing runs.
    // Authorize is idempotent per call: a policy restart or a store blip is waited out (within
    // the outage grace), not turned into a failure; nothing runs meanwhile.
    let authorize_span = tracing::info_span!(
        "policy.authorize",
        otel.kind = "client",
        tool = %step.tool,
        rule_id = tracing::field::Empty,
        outcome = tracing::field::Empty,
    );
    let authorized = within_grace(ctx, "policy", (&step.id, attempt), || {
        let mut policy = ctx.ex.inner.policy.clone();
        let req = pb::AuthorizeRequest {
            tenant: ctx.tenant.clone(),
            run_id: ctx.run_id.clone(),
            step_id: step.id.clone(),
            attempt,
            tool: step.tool.clone(),
            args_json: args_json.clone(),
            capability_handle: String::new(),
            idempotency_key: idempotency_key.clone(),
            epoch: ctx.epoch,
            agent: ctx.agent.clone(),
            retry_of: retry_of.unwrap_or_default().to_string(),
            // The decision goes into this step's own append (with the request or the failure).
            caller_records: true,
            base_rules_only: false,
        };
        async move { policy.authorize(req).await }
    })
    .instrument(authorize_span.clone())
    .await;
    let authorized = match authorized {
        Ok(r) => r,
        Err(s) if warden_grpc::is_fenced(&s) => return Err(DriveError::Fenced),
        Err(s) if s.code() == Code::InvalidArgument => {
            let p = fail("invalid_arguments", s.message().to_string(), json!({}));
            return ctx.step_failed(events::STEP_FAILED, &step.id, attempt, p).await;
        }
        Err(s) => {
            let reason = format!("policy unavailable, failing closed: {}", s.message());
            tracing::warn!(run_id = %ctx.run_id, step_id = %step.id, error = %s, "no policy decision; step not executed");
            let p = fail("policy_unavailable", reason, json!({}));
            return ctx.step_failed(events::STEP_FAILED, &step.id, attempt, p).await;
        }
    };
    let decision = authorized.decision.unwrap_or_default();
    authorize_span.record("rule_id", decision.rule_id.as_str());
    let outcome = match decision.outcome() {
        pb::Outcome::Allow => "allow",
        pb::Outcome::Deny => "deny",
        pb::Outcome::ApprovalRequired => "approval_required",
        _ => "unspecified",
    };
    authorize_span.record("outcome", outcome);
    let record = decision_event(&step.id, &decision.decision_id, &authorized.decision_event_json);
    // A call requested before (its outcome unknown) may have acted: a decision that no longer
    // allows asking again cannot make it a failure or a cancellation — an operator settles it.
    if asked_before && decision.outcome() != pb::Outcome::Allow {
        return Ok(StepOutcome::Unknown(format!(
            "the call was requested before its outcome was recorded, and policy no longer allows asking again \
             ({}: {})",
            decision.rule_id, decision.reason
        )));
    }
    if decision.outcome() == pb::Outcome::ApprovalRequired {
        // Nothing runs and nothing fails: the run will wait, holding no executor.
        return Ok(StepOutcome::Blocked { decision_id: decision.decision_id, reason: decision.reason });
    }
    let (Some(auth), pb::Outcome::Allow) = (authorized.authorization, decision.outcome()) else {
        let p = fail(
            "policy_denied",
            format!("denied by policy rule '{}': {}", decision.rule_id, decision.reason),
            json!({"decision_id": decision.decision_id, "rule_id": decision.rule_id}),
        );
        return ctx.step_failed_after(record, events::STEP_FAILED, &step.id, attempt, p).await;
    };
    // Immediate cancellation: an allowed call whose tool was not invoked yet never is.
    if ctx.cancel.is_cancelled() && ctx.cancel_policy == pb::CancelPolicy::Immediate && !asked_before {
        return ctx.step_cancelled_after(record, &step.id, "the run was cancelled before the tool was invoked").await;
    }
    // K08: the timeout comes only from the tool's declaration (the 60 s fallback when it
    // declares none); the request records the one that applies.
    let timeout = match entry.spec.timeout_sec {
        0 => FALLBACK_TIMEOUT,
        s => Duration::from_secs(s as u64),
    };
    // One transaction: the outcomes waiting, the policy's signed decision and the request.
    // The ledger acknowledges the durable request; the tool host acts only with that proof.
    let mut batch: Vec<pb::EventInput> = record.into_iter().collect();
    batch.push(event(
        events::TOOL_REQUESTED,
        &step.id,
        ctx.step_key(&step.id, attempt, "requested"),
        json!({"decision_id": decision.decision_id, "attempt": attempt, "tool": step.tool, "args": args,
               "args_sha256": args_digest(&args), "idempotency_key": idempotency_key,
               "timeout_ms": timeout.as_millis() as u64}),
    ));
    let request_ack = ctx.append_all(batch).await?.pop().and_then(|a| a.request_ack);
    let request = pb::InvokeRequest {
        tenant: ctx.tenant.clone(),
        run_id: ctx.run_id.clone(),
        step_id: step.id.clone(),
        attempt,
        tool: step.tool.clone(),
        args_json,
        idempotency_key: idempotency_key.clone(),
        authorization: Some(auth),
        request_ack,
    };
    let cite = json!({"decision_id": decision.decision_id});
    let failed = |kind: &str, reason: String, extra: Value| {
        let mut p = fail(kind, reason, cite.clone());
        if let (Some(p), Value::Object(x)) = (p.as_object_mut(), extra) {
            p.extend(x);
        }
        p
    };
    // A timeout or a broken connection leaves the outcome unknown: the tool may have acted.
    // An idempotent tool is asked again with the same key (the host returns the first
    // outcome), backing off between asks; otherwise, or if it stays unknown, an operator must
    // reconcile the step. A host that could not be reached at all was never asked: that is
    // waited out within the outage grace, then a failure — never an unknown outcome.
    // The tool call's span: its W3C ids are the ones the call's receipt cites.
    let invoke_span = tracing::info_span!(
        "tool.invoke",
        otel.kind = "client",
        tool = %step.tool,
        attempt,
        rpc.system = "grpc",
        rpc.service = "warden.v1.ToolHost",
        rpc.method = "Invoke",
    );
    let tries = if may_ask_again(&entry.spec) { UNKNOWN_OUTCOME_TRIES } else { 1 };
    let grace = Duration::from_millis(ctx.ex.inner.config.outage_grace_ms);
    let since = tokio::time::Instant::now();
    let mut backoff = Duration::from_millis(50);
    let (mut answer, mut unknown, mut asked) = (None, String::new(), 0);
    let mut said_waiting = false;
    // Immediate cancellation reaches a call that is authorized and requested but that no host
    // has received yet (its host was unreachable so far): it is never sent.
    let cancels_unsent = ctx.cancel_policy == pb::CancelPolicy::Immediate && !asked_before;
    loop {
        // A holder that lost its lease invokes nothing more: its successor settles the call.
        if ctx.lost.is_cancelled() {
            return Err(DriveError::LeaseLost);
        }
        if cancels_unsent && asked == 0 && ctx.cancel.is_cancelled() {
            let reason =
                format!("the run was cancelled before the tool was invoked ({})", policy_name(ctx.cancel_policy));
            let payload =
                json!({"reason": reason, "decision_id": decision.decision_id, "attempt": attempt, "tool": step.tool});
            let key = ctx.step_key(&step.id, 0, "cancelled");
            ctx.append_all(vec![event(events::STEP_CANCELLED, &step.id, key, traced(payload))]).await?;
            return Ok(StepOutcome::Cancelled);
        }
        let mut host = ctx.ex.inner.catalog.host(entry.host);
        match tokio::time::timeout(timeout, host.invoke(request.clone()).instrument(invoke_span.clone())).await {
            Err(_) => {
                asked += 1;
                unknown = format!("no answer within {}s (the tool's timeout_sec)", timeout.as_secs());
            }
            Ok(Err(s)) if never_sent(&s) => {
                if since.elapsed() >= grace || ctx.lost.is_cancelled() {
                    // An earlier ask (this driver's or its predecessor's) may have reached the
                    // host before it went away: that call's outcome is unknown, not a failure.
                    if asked > 0 || asked_before {
                        unknown = format!(
                            "the call was asked before and the tool host stayed unreachable for {} ms: {}",
                            grace.as_millis(),
                            s.message()
                        );
                        break;
                    }
                    let reason = format!("tool host unreachable for {} ms: {}", grace.as_millis(), s.message());
                    answer = Some(Err(failed("tool_host_unavailable", reason, json!({}))));
                    break;
                }
                if !said_waiting {
                    said_waiting = true;
                    ctx.record_wait("tool_host", (&step.id, attempt), s.message()).await;
                }
            }
            // The host itself says the call may have acted without a recorded outcome: asking
            // again cannot tell more; an operator establishes what happened.
            Ok(Err(s)) if in_doubt(&s) => {
                unknown = format!("the tool host says: {}", s.message());
                break;
            }
            Ok(Err(s))
                if matches!(s.code(), Code::Unavailable | Code::Unknown | Code::Cancelled | Code::DeadlineExceeded) =>
            {
                asked += 1;
                unknown = format!("tool host call broke off: {}", s.message());
            }
            Ok(r) => {
                answer = Some(Ok(r));
                break;
            }
        }
        if asked >= tries {
            break;
        }
        tokio::select! {
            _ = tokio::time::sleep(jittered(backoff)) => {}
            // Checked at the top of the loop.
            _ = ctx.cancel.cancelled(), if cancels_unsent && asked == 0 => {}
        }
        backoff = (backoff * 2).min(Duration::from_secs(2));
    }
    let answer = match answer {
        None => return Ok(StepOutcome::Unknown(unknown)),
        // A refusal of a repeat says nothing about the earlier ask, which may have acted.
        Some(Ok(Err(s))) if asked > 0 || asked_before => {
            return Ok(StepOutcome::Unknown(format!(
                "the call was asked before; asked again, the tool host answers {:?}: {}",
                s.code(),
                s.message()
            )));
        }
        Some(Err(mut not_sent)) => {
            cite_trace(&mut not_sent, &invoke_span);
            return ctx.step_failed(events::TOOL_FAILED, &step.id, attempt, not_sent).await;
        }
        Some(Ok(answer)) => answer,
    };
    let outcome = match answer {
        Err(s) => {
            let kind = if s.code() == Code::PermissionDenied { "authorization_refused" } else { "tool_host_error" };
            Err(failed(kind, s.message().to_string(), json!({})))
        }
        Ok(resp) => {
            let resp = resp.into_inner();
            match resp.outcome {
                Some(pb::invoke_response::Outcome::OutputJson(text)) => match serde_json::from_str::<Value>(&text) {
                    Ok(out) => Ok((out, resp.replayed)),
                    Err(e) => Err(failed("invalid_output", format!("tool output is not JSON: {e}"), json!({}))),
                },
                Some(pb::invoke_response::Outcome::Error(e)) => {
                    Err(failed("tool_error", e.message, json!({"code": e.code, "retryable": e.retryable})))
                }
                None => Err(failed("invalid_output", "tool host returned no outcome".into(), json!({}))),
            }
        }
    };
    match outcome {
        Ok((output, replayed)) => {
            // The output half of the pipeline: what fails the output rules or the declared
            // output schema is withheld; the step completes all the same (seed 000 §9).
            let inner = &ctx.ex.inner;
            let text = canonical_json(&output);
            let declared = (step.tool.as_str(), entry.spec.output_schema_json.as_str());
            let withheld = crate::output::vet(&inner.output_rules, &inner.tool_schemas, declared, &output, &text);
            let output = match &withheld {
                Some(why) => {
                    tracing::warn!(run_id = %ctx.run_id, step_id = %step.id, rule = %why.rule, "tool output sanitized");
                    warden_telemetry::metrics::output_sanitized(&why.rule);
                    Value::String(crate::output::SANITIZED.into())
                }
                None => output,
            };
            let mut payload = json!({"decision_id": decision.decision_id, "attempt": attempt, "tool": step.tool, "output": output, "replayed": replayed,
                       "idempotency_key": idempotency_key,
                       "elapsed_us": started.elapsed().as_micros() as u64});
            if let Some(why) = &withheld {
                payload["sanitized"] = why.to_json();
            } else if text.len() > inner.config.inline_output_max_bytes {
                // Too large to record inline: stored by reference, the event cites its digest.
                match store_output(ctx, (&step.id, attempt), text).await {
                    Ok(stored) => {
                        if let Some(p) = payload.as_object_mut() {
                            p.remove("output");
                            p.insert("output_ref".into(), json!({"sha256": stored.sha256, "bytes": stored.bytes}));
                        }
                    }
                    Err(DriveError::Ledger(s)) if s.code() == Code::InvalidArgument => {
                        let reason = format!("the ledger refused to store the tool's output: {}", s.message());
                        let mut payload = failed("output_rejected", reason, json!({}));
                        cite_trace(&mut payload, &invoke_span);
                        return ctx.step_failed(events::TOOL_FAILED, &step.id, attempt, payload).await;
                    }
                    Err(e) => return Err(e),
                }
            }
            cite_trace(&mut payload, &invoke_span);
            let completed =
                event(events::TOOL_COMPLETED, &step.id, ctx.step_key(&step.id, attempt, "completed"), payload);
            let recorded = if entry.spec.idempotent && completed.payload_json.len() <= DEFERRABLE_OUTPUT_BYTES {
                ctx.defer(completed);
                Ok(())
            } else {
                ctx.append_all(vec![completed]).await.map(|_| ())
            };
            match recorded {
                Ok(_) => {
                    // A tool that reports what it cost (`"cost": n` in its output) spends the
                    // run's and tenant's budgets; later calls are judged against them.
                    if let Some(cost) = output.get("cost").and_then(Value::as_f64) {
                        record_cost(ctx, &step.id, attempt, cost).await;
                    }
                    Ok(StepOutcome::Completed(output))
                }
                // The ledger will not take this output (too large, say): the step fails.
                Err(DriveError::Ledger(s)) if s.code() == Code::InvalidArgument => {
                    let reason = format!("the ledger refused the tool's output: {}", s.message());
                    let mut payload = failed("output_rejected", reason, json!({}));
                    cite_trace(&mut payload, &invoke_span);
                    ctx.step_failed(events::TOOL_FAILED, &step.id, attempt, payload).await
                }
                Err(e) => Err(e),
            }
        }
        Err(mut payload) => {
            cite_trace(&mut payload, &invoke_span);
            let retryable = payload.get("retryable") == Some(&Value::Bool(true));
            if !retryable || attempt >= max_attempts(entry.spec.retry_policy) {
                return ctx.step_failed(events::TOOL_FAILED, &step.id, attempt, payload).await;
            }
            let first = retry_of.map(str::to_string).unwrap_or_else(|| decision.decision_id.clone());
            let base = ctx.ex.inner.config.retry_backoff_base_ms;
            let backoff = Duration::from_millis(base.saturating_mul(1 << (attempt - 1).min(16)));
            let not_before_ms = warden_grpc::now_ms().saturating_add(backoff.as_millis() as i64);
            payload["retry"] = json!({"next_attempt": attempt + 1, "backoff_ms": backoff.as_millis() as u64,
                                      "not_before_ms": not_before_ms, "retry_of": first});
            let key = ctx.step_key(&step.id, attempt, "failed");
            ctx.append(events::TOOL_FAILED, &step.id, key, payload).await?;
            Ok(StepOutcome::Retry { retry_of: first, backoff })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_connection_broken_under_a_call_is_transient_and_a_callees_own_error_is_not() {
        let broken = Status::from_error(Box::new(std::io::Error::new(std::io::ErrorKind::BrokenPipe, "broken pipe")));
        assert_eq!(broken.code(), Code::Unknown);
        assert!(transient(&broken), "a policy killed mid-request is waited out");
        assert!(!transient(&Status::unknown("the callee's own unknown error")));
        assert!(!transient(&Status::internal("a bug in the callee")));
        assert!(transient(&Status::unavailable("store blip")));
        assert!(!transient(&Status::invalid_argument("bad")));
    }
}
