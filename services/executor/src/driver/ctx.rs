//! The per-run context a driver and its step tasks share, and the run's ledger plumbing:
//! appends (with the outcomes that wait for the next one), failures, cancellations and waits.

use serde_json::{Value, json};
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use tonic::{Code, Status};
use tracing::Instrument;
use warden_core::events;
use warden_core::run::RunView;
use warden_grpc::convert::event_from_proto;
use warden_proto::v1 as pb;

use super::DriveError;
use super::step::{StepOutcome, jittered};
use crate::Executor;

/// Adds the W3C ids of `span` to an outcome's payload (unless it names some already): the
/// receipt the ledger derives from the outcome cites them (SPEC-KERN-01 §5), so an auditor
/// can go from a receipt to its trace. Nothing is added when the process exports no traces.
pub(super) fn cite_trace(payload: &mut Value, span: &tracing::Span) {
    if let Some(p) = payload.as_object_mut()
        && !p.contains_key("trace_id")
        && let Some(ids) = warden_telemetry::context::ids(span)
    {
        p.insert("trace_id".into(), Value::String(ids.trace_id));
        p.insert("span_id".into(), Value::String(ids.span_id));
    }
}

/// `payload` citing the current span (see [`cite_trace`]).
pub(super) fn traced(mut payload: Value) -> Value {
    cite_trace(&mut payload, &tracing::Span::current());
    payload
}

/// Most of a callee's error a `run_waiting` event keeps.
pub(super) const MAX_WAIT_ERROR_BYTES: usize = 512;

/// The per-run context a driver and its step tasks share.
#[derive(Clone)]
pub(super) struct RunCtx {
    pub(super) ex: Executor,
    pub(super) run_id: String,
    pub(super) tenant: String,
    /// The agent the run acts for (from `run_submitted`; empty: the tenant itself).
    pub(super) agent: String,
    pub(super) epoch: u64,
    pub(super) lost: CancellationToken,
    /// Fires when someone asked to cancel the run (see `Runs.CancelRun`).
    pub(super) cancel: CancellationToken,
    /// Fires when someone asked to pause the run (see `Runs.PauseRun`): nothing new starts,
    /// the steps in flight settle, the run is recorded paused and the lease released.
    pub(super) pause: CancellationToken,
    /// The run's cancel policy: immediate (also the default) or after the tool call.
    pub(super) cancel_policy: pb::CancelPolicy,
    /// Outcomes waiting to be appended with the run's next append (see [`RunCtx::defer`]).
    pub(super) deferred: std::sync::Arc<std::sync::Mutex<Vec<pb::EventInput>>>,
    /// One append of the run at a time, so what waits is recorded before what follows it.
    pub(super) appending: std::sync::Arc<tokio::sync::Mutex<()>>,
    /// The tools' declarations the run pinned (`tools_pinned`), set by the scheduler.
    pub(super) pinned: std::sync::Arc<std::collections::BTreeMap<String, warden_core::run::PinnedTool>>,
    /// Failure memory (`RunView::failed_calls`) as the scheduler found it: calls that failed
    /// or were denied for good in this run, never attempted again.
    pub(super) failed_calls: std::sync::Arc<std::sync::Mutex<std::collections::BTreeMap<String, String>>>,
    /// Where the run stands among frames, for the child frames its sub-goal steps open.
    pub(super) frame: std::sync::Arc<FrameCtx>,
    /// The ledger's acknowledgement of the run's plan, with the plan, from `CreateRun`: sent
    /// with the run's Authorize requests until one is answered, so the policy need not read
    /// the plan back (`AuthorizeRequest.run_ack`). None for a run this replica did not create.
    pub(super) plan_ack: std::sync::Arc<std::sync::Mutex<Option<PlanAck>>>,
    /// Set while the run is being created by this replica's submission (see `creation`).
    pub(super) creation: Option<super::Creation>,
    /// Whether the acknowledgement the creation brought was taken into `plan_ack`.
    pub(super) ack_adopted: std::sync::Arc<std::sync::atomic::AtomicBool>,
    /// Steps whose call, requested by an earlier holder, was decided while the run was being
    /// created: the recorded plan (canonical JSON) and its digest, by step id. Asked again
    /// with them, the call is decided under the same id, and its request is the one recorded.
    pub(super) decided_early: std::sync::Arc<DecidedEarly>,
    /// What this driver knows of the run's log, for `WaitRun`'s answer (see `known`).
    pub(super) known: std::sync::Arc<std::sync::Mutex<super::known::Known>>,
}

/// By step id: a plan as recorded (canonical JSON) and its digest (see `RunCtx::decided_early`).
pub(super) type DecidedEarly = std::collections::HashMap<String, (std::sync::Arc<str>, std::sync::Arc<str>)>;

/// Largest plan sent with an Authorize request (the policy reads a larger one from the
/// ledger): well inside the 4 MiB a service decodes by default.
pub const PLAN_ACK_MAX_BYTES: usize = 1024 * 1024;

/// A run's plan as submitted, and the ledger's signed statement of its digest.
#[derive(Clone)]
pub struct PlanAck {
    pub ack: pb::SignedAuthorization,
    pub plan_json: std::sync::Arc<str>,
}

/// What a sub-goal step needs to open a child frame (see `frame::open_frame`).
#[derive(Default)]
pub(super) struct FrameCtx {
    pub(super) position: warden_core::run::FramePosition,
    /// The run's own goal (none for a submitted plan).
    pub(super) goal: Option<String>,
    /// The bound on depth: the inherited one, or the root plan's `max_depth`.
    pub(super) max_depth: u32,
    pub(super) replay_policy: i32,
}

/// One event to append, as the ledger takes it.
pub(super) fn event(event_type: &str, step_id: &str, key: String, payload: Value) -> pb::EventInput {
    pb::EventInput {
        idempotency_key: key,
        event_type: event_type.to_string(),
        payload_json: payload.to_string(),
        step_id: step_id.to_string(),
    }
}

/// The policy's signed record of a decision, to append with what the executor does about it.
pub(super) fn decision_event(step_id: &str, decision_id: &str, record_json: &str) -> Option<pb::EventInput> {
    (!record_json.is_empty()).then(|| pb::EventInput {
        idempotency_key: events::decision_key(decision_id),
        event_type: events::POLICY_DECISION.to_string(),
        payload_json: record_json.to_string(),
        step_id: step_id.to_string(),
    })
}

/// Largest tool output whose `tool_completed` may wait for the run's next append (bigger ones
/// are appended at once, so a refusal stays the step's own).
pub(super) const DEFERRABLE_OUTPUT_BYTES: usize = 64 * 1024;

impl RunCtx {
    /// Waits until the run is recorded when it is being created (see `creation`); the plan's
    /// acknowledgement the creation brought is kept for the run's next Authorize.
    pub(super) async fn created(&self) -> Result<(), DriveError> {
        let Some(creation) = &self.creation else { return Ok(()) };
        match creation.wait().await {
            super::creation::Created::Yes(ack, created_at_ms) => {
                self.known().created_at(created_at_ms);
                // Taken once: the step that sends it clears it when the policy has the plan.
                if let Some(ack) = ack
                    && !self.ack_adopted.swap(true, std::sync::atomic::Ordering::Relaxed)
                {
                    *self.plan_ack.lock().unwrap_or_else(|p| p.into_inner()) = Some(ack);
                }
                Ok(())
            }
            super::creation::Created::No => Err(DriveError::NotCreated),
        }
    }

    /// Records a step's decision and request: with the run's creation when the run is still
    /// being created and the creation takes them (one commit for both, `creation`), otherwise
    /// as any append. What waits for the run's next append (the tools the run pinned) goes
    /// first, as in any append. Refused with the creation (the run then recorded without
    /// them), they are appended as any events once the run is on record, and get the ledger's
    /// answer.
    pub(super) async fn append_first(
        &self,
        events: Vec<pb::EventInput>,
    ) -> Result<Vec<pb::AppendEventResponse>, DriveError> {
        let Some(creation) = self.creation.as_ref().filter(|c| c.takes_first_step()) else {
            return self.append_all(events).await;
        };
        {
            let _turn = self.appending.lock().await;
            let mut all: Vec<pb::EventInput> = self.deferred.lock().unwrap_or_else(|p| p.into_inner()).clone();
            let n = all.len();
            all.extend(events.iter().cloned());
            if let Ok(answer) = creation.offer(all) {
                let span = tracing::info_span!(
                    "ledger.append",
                    otel.kind = "client",
                    events = n + events.len(),
                    with_creation = true
                );
                match answer.instrument(span).await {
                    Ok(Ok(mut appended)) => {
                        // Recorded: what waited no longer does (the first `n`: steps may have
                        // deferred more meanwhile).
                        let mut sent: Vec<pb::EventInput> = {
                            let mut waiting = self.deferred.lock().unwrap_or_else(|p| p.into_inner());
                            let taken = n.min(waiting.len());
                            waiting.drain(..taken).collect()
                        };
                        sent.extend(events);
                        self.created().await?;
                        self.known().appended(sent, &appended);
                        return Ok(appended.split_off(n.min(appended.len())));
                    }
                    Ok(Err(s)) => {
                        tracing::debug!(run_id = %self.run_id, error = %s, "first step not recorded with the run");
                    }
                    // The creation went without answering (its task ended): appended as any
                    // events, which waits for how the creation went.
                    Err(_) => {}
                }
            }
        }
        self.append_all(events).await
    }

    /// The plan being recorded and its digest, while the run's creation is not answered.
    pub(super) fn unrecorded_plan(&self) -> Option<(std::sync::Arc<str>, std::sync::Arc<str>)> {
        self.creation.as_ref().and_then(super::Creation::pending_plan)
    }

    /// Appends an event (with any deferred outcomes before it, in the same transaction).
    pub(super) async fn append(
        &self,
        event_type: &str,
        step_id: &str,
        key: String,
        payload: Value,
    ) -> Result<pb::Event, DriveError> {
        // Answered whole: a repeat answers the event recorded first, which callers read.
        let mut appended = self.append_all_as(vec![event(event_type, step_id, key, payload)], false).await?;
        appended
            .pop()
            .and_then(|a| a.event)
            .ok_or_else(|| DriveError::Ledger(Status::internal("ledger returned no event")))
    }

    /// Keeps an outcome to be appended with the run's next append: in a chain, one step's
    /// outcome, the next step's decision and its request become one ledger transaction. Only
    /// outcomes of idempotent tools wait (if the executor dies first, the call is asked again
    /// under the same key and the host replays its outcome); others are appended at once.
    pub(super) fn defer(&self, e: pb::EventInput) {
        self.deferred.lock().unwrap_or_else(|p| p.into_inner()).push(e);
    }

    /// Appends what waits, if anything.
    pub(super) async fn flush(&self) -> Result<(), DriveError> {
        if self.deferred.lock().unwrap_or_else(|p| p.into_inner()).is_empty() {
            return Ok(());
        }
        self.append_all(Vec::new()).await.map(|_| ())
    }

    /// Appends `events` of this run in one ledger transaction — all or nothing — after the
    /// deferred outcomes, retrying transient failures with the same idempotency keys (so a
    /// retry never doubles an event). Answers for `events` only, brief (no payloads: the
    /// step pipeline needs seqs and request acknowledgements, not its own events back).
    pub(super) async fn append_all(
        &self,
        events: Vec<pb::EventInput>,
    ) -> Result<Vec<pb::AppendEventResponse>, DriveError> {
        self.append_all_as(events, true).await
    }

    async fn append_all_as(
        &self,
        events: Vec<pb::EventInput>,
        brief: bool,
    ) -> Result<Vec<pb::AppendEventResponse>, DriveError> {
        let _turn = self.appending.lock().await;
        let deferred: Vec<pb::EventInput> =
            std::mem::take(&mut *self.deferred.lock().unwrap_or_else(|p| p.into_inner()));
        if deferred.is_empty() {
            return self.append_group(events, brief).await;
        }
        let n = deferred.len();
        let mut all = deferred.clone();
        all.extend(events.iter().cloned());
        match self.append_group(all, brief).await {
            Ok(mut appended) => Ok(appended.split_off(n.min(appended.len()))),
            // Refused as a whole: keep the outcomes apart from whatever was refused.
            Err(DriveError::Ledger(s)) if !retryable(&s) => {
                self.append_group(deferred, true).await?;
                if events.is_empty() { Ok(Vec::new()) } else { self.append_group(events, brief).await }
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

    pub(super) async fn append_group(
        &self,
        events: Vec<pb::EventInput>,
        brief: bool,
    ) -> Result<Vec<pb::AppendEventResponse>, DriveError> {
        if events.is_empty() {
            return Ok(Vec::new());
        }
        let span = tracing::info_span!("ledger.append", otel.kind = "client", events = events.len());
        self.append_group_traced(events, brief).instrument(span).await
    }

    pub(super) async fn append_group_traced(
        &self,
        events: Vec<pb::EventInput>,
        brief: bool,
    ) -> Result<Vec<pb::AppendEventResponse>, DriveError> {
        self.created().await?;
        let req = pb::AppendEventsRequest {
            tenant: self.tenant.clone(),
            run_id: self.run_id.clone(),
            epoch: self.epoch,
            events,
            brief,
        };
        // Appends are idempotent by key: a ledger restart or a database blip is waited out
        // within the outage grace.
        let grace = Duration::from_millis(self.ex.inner.config.outage_grace_ms);
        let started = tokio::time::Instant::now();
        let mut backoff = Duration::from_millis(20);
        loop {
            match self.ex.inner.ledger.clone().append_events(req.clone()).await {
                Ok(r) => {
                    let appended = r.into_inner().appended;
                    self.known().appended(req.events, &appended);
                    return Ok(appended);
                }
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
    pub(super) async fn step_failed(
        &self,
        event_type: &str,
        step_id: &str,
        attempt: u32,
        payload: Value,
    ) -> Result<StepOutcome, DriveError> {
        self.step_failed_after(None, event_type, step_id, attempt, payload).await
    }

    pub(super) async fn step_failed_after(
        &self,
        decision: Option<pb::EventInput>,
        event_type: &str,
        step_id: &str,
        attempt: u32,
        payload: Value,
    ) -> Result<StepOutcome, DriveError> {
        let reason = payload.get("reason").and_then(Value::as_str).unwrap_or_default().to_string();
        let kind = payload.get("kind").and_then(Value::as_str).unwrap_or_default().to_string();
        let payload = traced(payload);
        let mut events: Vec<pb::EventInput> = decision.into_iter().collect();
        events.push(event(event_type, step_id, self.step_key(step_id, attempt, "failed"), payload));
        self.append_all(events).await?;
        Ok(StepOutcome::Failed { reason, kind })
    }

    pub(super) async fn step_cancelled(
        &self,
        step_id: &str,
        attempt: u32,
        reason: &str,
    ) -> Result<StepOutcome, DriveError> {
        self.step_cancelled_after(None, step_id, attempt, reason).await
    }

    /// A step cancelled after its decision: the decision is recorded with the cancellation.
    pub(super) async fn step_cancelled_after(
        &self,
        decision: Option<pb::EventInput>,
        step_id: &str,
        attempt: u32,
        reason: &str,
    ) -> Result<StepOutcome, DriveError> {
        // Keyed and receipted by the attempt it cancels: an earlier attempt (or branch) of the
        // step may have a receipt already.
        let key = self.step_key(step_id, attempt, "cancelled");
        let reason = format!("{reason} ({})", policy_name(self.cancel_policy));
        let mut events: Vec<pb::EventInput> = decision.into_iter().collect();
        let payload = json!({"reason": reason, "attempt": attempt});
        events.push(event(events::STEP_CANCELLED, step_id, key, traced(payload)));
        self.append_all(events).await?;
        Ok(StepOutcome::Cancelled)
    }

    /// Says on the record that `step_id`'s attempt waits out an outage of `on` (`run_waiting`;
    /// `GetRun` reports it as `waiting_for` until the step's next event). Appending also
    /// records the outcomes still waiting, so they need not wait out the outage. Best effort:
    /// a ledger that cannot take it now changes nothing about the wait.
    pub(super) async fn record_wait(&self, on: &str, (step_id, attempt): (&str, u32), error: &str) {
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
    pub(super) async fn append_group_once(&self, events: Vec<pb::EventInput>) -> Result<(), Status> {
        self.created().await.map_err(|e| Status::failed_precondition(e.to_string()))?;
        let _turn = self.appending.lock().await;
        let mut all: Vec<pb::EventInput> = self.deferred.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let n = all.len();
        all.extend(events);
        let req = pb::AppendEventsRequest {
            tenant: self.tenant.clone(),
            run_id: self.run_id.clone(),
            epoch: self.epoch,
            events: all,
            brief: true,
        };
        self.ex.inner.ledger.clone().append_events(req).await?;
        // Recorded: the outcomes taken no longer wait (the first `n`: steps may have deferred
        // more meanwhile).
        self.deferred.lock().unwrap_or_else(|p| p.into_inner()).drain(..n);
        Ok(())
    }

    pub(super) fn known(&self) -> std::sync::MutexGuard<'_, super::known::Known> {
        self.known.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(super) fn step_key(&self, step_id: &str, attempt: u32, what: &str) -> String {
        run_key(&self.run_id, &format!("{step_id}:{attempt}:{what}"))
    }
}

/// `{run_id}:{rest}`: a key scoped to the run. Keys are per run; a long run id (a fork's)
/// with a long step id would pass the id limit: the run's part is then a 16-hex-digit digest.
pub(super) fn run_key(run_id: &str, rest: &str) -> String {
    let key = format!("{run_id}:{rest}");
    if key.len() <= warden_core::ids::MAX_ID_LEN {
        return key;
    }
    format!("{}:{rest}", &warden_core::canonical::sha256_hex(run_id.as_bytes())[..16])
}

/// How a cancel policy reads in a step's reason (and so in its receipt).
pub(super) fn policy_name(p: pb::CancelPolicy) -> &'static str {
    match p {
        pb::CancelPolicy::AfterToolCall | pb::CancelPolicy::AfterToken => "cancel policy after_tool_call",
        _ => "cancel policy immediate",
    }
}

pub(super) fn retryable(s: &Status) -> bool {
    matches!(
        s.code(),
        Code::Unavailable | Code::Unknown | Code::DeadlineExceeded | Code::Aborted | Code::ResourceExhausted
    )
}

/// Reads a run's whole log and folds it.
pub(crate) async fn load_view(ex: &Executor, tenant: &str, run_id: &str) -> Result<(RunView, Vec<pb::Event>), Status> {
    let mut view = RunView::default();
    let mut all = Vec::new();
    fold_log(ex, tenant, run_id, 0, &mut view, Some(&mut all)).await?;
    Ok((view, all))
}

/// A run's ledger row and its whole log folded: one request to the ledger, which answers the
/// log with the row (`with_events`) unless it is too large to carry, when the rest is
/// streamed after what the answer carried.
pub(crate) async fn load_run(ex: &Executor, tenant: &str, run_id: &str) -> Result<(pb::LedgerRun, RunView), Status> {
    let mut run = ex
        .inner
        .ledger
        .clone()
        .get_run(pb::GetLedgerRunRequest { tenant: tenant.to_string(), run_id: run_id.to_string(), with_events: true })
        .await?
        .into_inner();
    let mut view = RunView::default();
    let mut since = 0;
    for e in std::mem::take(&mut run.events) {
        apply(&mut view, &e);
        since = e.seq;
    }
    if since < run.last_seq {
        fold_log(ex, tenant, run_id, since, &mut view, None).await?;
    }
    Ok((run, view))
}

/// Folds a run's events after `since` into `view`, keeping them in `all` when given.
async fn fold_log(
    ex: &Executor,
    tenant: &str,
    run_id: &str,
    since: u64,
    view: &mut RunView,
    mut all: Option<&mut Vec<pb::Event>>,
) -> Result<(), Status> {
    let mut stream = ex
        .inner
        .ledger
        .clone()
        .stream_events(pb::StreamEventsRequest {
            tenant: tenant.to_string(),
            run_id: run_id.to_string(),
            since_seq: since,
            follow: false,
        })
        .await?
        .into_inner();
    while let Some(e) = stream.message().await? {
        apply(view, &e);
        if let Some(all) = all.as_deref_mut() {
            all.push(e);
        }
    }
    Ok(())
}

/// Folds one event of the log into `view`.
fn apply(view: &mut RunView, e: &pb::Event) {
    let ce = event_from_proto(e);
    view.apply(ce.body.seq, &ce.body.event_type, &ce.body.step_id, &ce.body.payload);
}
