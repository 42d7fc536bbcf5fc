//! The step pipeline (seed 000 §4.1): for each attempt, arguments against the tool's input
//! schema, the policy's decision, the durable request, the call under the declared timeout,
//! the output vetted and recorded; retries by the tool's declared policy, waits on outages
//! within the grace, and unknown outcomes asked again or handed to an operator.

use std::time::Duration;

use serde_json::{Value, json};
use tonic::{Code, Status};
use tracing::Instrument;
use warden_core::canonical::{args_digest, canonical_value};
use warden_core::events;
use warden_core::plan::PlanStep;
use warden_core::run::call_fingerprint;
use warden_core::template;
use warden_proto::v1 as pb;

use super::ctx::{
    DEFERRABLE_OUTPUT_BYTES, RunCtx, cite_trace, decision_event, event, policy_name, retryable, run_key, traced,
};
use super::{DriveError, PlanAck};

/// Timeout when a tool declares none (seed 000 §7).
pub const FALLBACK_TIMEOUT: Duration = Duration::from_secs(60);

/// What one step came to.
pub(super) enum StepOutcome {
    Completed(Value),
    /// Failed, denied or refused; the reason is recorded in the ledger, `kind` says what
    /// failed (the recorded `kind`: `tool_error`, `policy_denied`, …).
    Failed {
        reason: String,
        kind: String,
    },
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
    pub(super) fn label(&self) -> &'static str {
        match self {
            StepOutcome::Completed(_) => "completed",
            StepOutcome::Failed { .. } => "failed",
            StepOutcome::Unknown(_) => "unknown",
            StepOutcome::Blocked { .. } => "blocked",
            StepOutcome::Cancelled => "cancelled",
            StepOutcome::Retry { .. } => "retry",
        }
    }
}

/// Attempts a tool's declared retry policy allows (seed 000: NONE 1, STANDARD 3, AGGRESSIVE 5).
pub(super) fn max_attempts(policy: i32) -> u32 {
    match pb::RetryPolicy::try_from(policy) {
        Ok(pb::RetryPolicy::Standard) => 3,
        Ok(pb::RetryPolicy::Aggressive) => 5,
        _ => 1,
    }
}

/// How often an idempotent tool is asked before an unknown outcome goes to an operator.
pub(super) const UNKNOWN_OUTCOME_TRIES: usize = 3;

use warden_core::run::branches_on;

/// One step: its attempts, from `attempt` (a retry names the allow it retries), with the
/// backoff between them. A failure is retried only when the tool reported it retryable and
/// its declared policy allows another attempt; denials are decisions, never retried (K07).
/// A call that failed for good moves the step to its next alternative (seed 001 branches,
/// `step_branched`), if it names one: `args` are the current branch's resolved arguments (or
/// why they could not be resolved), `outputs` what a later branch's templates resolve from.
pub(super) async fn execute_step(
    ctx: &RunCtx,
    step: &PlanStep,
    args: Result<Value, String>,
    from: Resume,
    outputs: Option<std::sync::Arc<std::collections::HashMap<String, Value>>>,
) -> Result<StepOutcome, DriveError> {
    let Resume { mut attempt, mut retry_of, asked_before, not_before_ms, branch, branch_first, branch_after } = from;
    let mut branch_first = branch_first;
    // A move to the next branch that a previous driver did not get to record.
    let mut pending = branch_after.map(|(reason, kind)| StepOutcome::Failed { reason, kind });
    let mut branch = branch as usize;
    let mut args = args;
    // A retry that a previous executor scheduled keeps its backoff.
    let mut wait = not_before_ms
        .map_or(Duration::ZERO, |t| Duration::from_millis(t.saturating_sub(warden_grpc::now_ms()).max(0) as u64));
    let mut asked_before = asked_before;
    loop {
        let Some((tool, params)) = step.branch(branch) else {
            return Err(DriveError::Ledger(Status::internal(format!("step '{}' has no branch {branch}", step.id))));
        };
        // The branch's call as a step of its own (the step itself while it has no alternatives:
        // nothing is copied on the hot path).
        let call: std::borrow::Cow<'_, PlanStep> = if step.alternatives.is_empty() {
            std::borrow::Cow::Borrowed(step)
        } else {
            std::borrow::Cow::Owned(PlanStep {
                tool: tool.to_string(),
                params: params.clone(),
                alternatives: Vec::new(),
                ..step.clone()
            })
        };
        let outcome = match (pending.take(), args) {
            (Some(failed), _) => {
                // The branch failed before; `attempt` is the next branch's first.
                attempt -= 1;
                failed
            }
            (None, Ok(args)) => {
                let from = (attempt, retry_of.take(), asked_before, wait);
                let (outcome, last) = execute_attempts(ctx, &call, args.clone(), from, branch_first).await?;
                if let StepOutcome::Failed { kind, .. } = &outcome
                    && warden_core::run::memorable_failure(kind)
                {
                    let call = call_fingerprint(&call.tool, &args_digest(&args));
                    ctx.failed_calls
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .entry(call)
                        .or_insert_with(|| step.id.clone());
                }
                attempt = last;
                outcome
            }
            (None, Err(reason)) => {
                let reason = format!("template resolution failed: {reason}");
                let p = json!({"kind": "template", "reason": reason, "attempt": attempt, "tool": call.tool});
                ctx.step_failed(events::STEP_FAILED, &step.id, attempt, p).await?
            }
        };
        asked_before = false;
        wait = Duration::ZERO;
        let (reason, kind) = match outcome {
            StepOutcome::Failed { reason, kind } if branches_on(&kind) && step.branch(branch + 1).is_some() => {
                (reason, kind)
            }
            other => return Ok(other),
        };
        // The next branch: recorded before it is tried, so a successor resumes on it.
        branch += 1;
        attempt += 1;
        branch_first = attempt;
        let Some((next, params)) = step.branch(branch) else { unreachable!("checked above") };
        let payload = json!({"branch": branch, "tool": next, "attempt": attempt, "after": reason, "failed_kind": kind});
        let key = ctx.step_key(&step.id, attempt, "branched");
        ctx.append(events::STEP_BRANCHED, &step.id, key, traced(payload)).await?;
        tracing::info!(run_id = %ctx.run_id, step_id = %step.id, branch, tool = %next, "step moved to its next alternative");
        let empty = std::collections::HashMap::new();
        args = template::resolve(params, outputs.as_deref().unwrap_or(&empty)).map_err(|e| e.to_string());
    }
}

/// One branch's attempts, from `attempt` (see [`execute_step`]); returns the outcome and the
/// last attempt made.
async fn execute_attempts(
    ctx: &RunCtx,
    step: &PlanStep,
    args: Value,
    (mut attempt, mut retry_of, asked_before, mut wait): (u32, Option<String>, bool, Duration),
    first: u32,
) -> Result<(StepOutcome, u32), DriveError> {
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
        let outcome = execute_attempt(ctx, step, args.clone(), (attempt, first), retry_of.as_deref(), asked_before)
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
            other => return Ok((other, attempt)),
        }
    }
}

/// Calls `call` until it answers, retrying UNAVAILABLE and transport failures (the callee is
/// restarting, its store had a blip) with jittered exponential backoff for up to the executor's
/// outage grace. Only idempotent calls go through here. Stops early when the lease is lost.
/// The first retry records that `waiter` (a step's attempt, or a planning round) waits on
/// `what` (see [`RunCtx::record_wait`]).
pub(super) async fn within_grace<T, F, Fut>(
    ctx: &RunCtx,
    what: &str,
    waiter: (&str, u32),
    mut call: F,
) -> Result<T, Status>
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
pub(super) fn may_ask_again(spec: &pb::ToolSpec) -> bool {
    spec.idempotent || spec.detects_in_doubt
}

/// A host's answer that the call is in doubt: it was started before and its outcome never
/// recorded (see `ToolSpec.detects_in_doubt`).
pub(super) fn in_doubt(s: &Status) -> bool {
    s.code() == Code::Unknown && s.message().starts_with("in doubt") && std::error::Error::source(s).is_none()
}

/// A call that never reached its callee: the connection was not established, so nothing was
/// sent and nothing can have happened (unlike a call that broke off once sent).
pub(crate) fn never_sent(s: &Status) -> bool {
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
pub(super) fn transient(s: &Status) -> bool {
    matches!(s.code(), Code::Unavailable | Code::ResourceExhausted | Code::Aborted) || warden_grpc::broke_off(s)
}

/// `d` scaled by a factor in [0.5, 1.5), so callers that failed together do not retry together.
pub(super) fn jittered(d: Duration) -> Duration {
    let r = (uuid::Uuid::new_v4().as_u128() % 1000) as f64 / 1000.0;
    d.mul_f64(0.5 + r)
}

/// Most a single cost record may carry (the policy refuses more): a tool reporting more
/// spends this much, which exhausts any sane budget, rather than nothing.
pub(super) const MAX_COST_PER_RECORD: f64 = 1e9;

/// Spends a step attempt's reported cost against the run's and tenant's budgets (recorded once
/// per attempt, so retrying is safe). A negative or non-finite report counts as nothing.
pub(super) async fn record_cost(ctx: &RunCtx, step_id: &str, attempt: u32, cost: f64) {
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
pub(super) async fn store_output(
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

/// A failure `payload` whose `reason` is a tool's or host's own `message`, through the output
/// rules like an output: a message that matches one is withheld — recorded, templated and
/// shown to a planner nowhere — as `[Output sanitized]`, with the rule and the message's
/// digest beside it.
fn vetted(ctx: &RunCtx, mut payload: Value, message: &str) -> Value {
    match crate::output::vet_error(&ctx.ex.inner.output_rules, message) {
        None => payload["reason"] = json!(message),
        Some(rule) => {
            warden_telemetry::metrics::output_sanitized(&rule);
            payload["reason"] = json!(crate::output::SANITIZED);
            payload["sanitized"] = json!({"rule": rule, "reason": "the error message matched an output rule",
                                          "message_sha256": warden_core::canonical::sha256_hex(message.as_bytes()),
                                          "message_bytes": message.len()});
        }
    }
    payload
}

/// What a tool host said (a status message), quoted in a reason of the step's record — an
/// unknown outcome, a wait, an unreachable host — through the output rules like a tool's own
/// error: a message that matches one is quoted as `[Output sanitized]` with the rule and the
/// message's digest instead.
fn host_said(ctx: &RunCtx, message: &str) -> String {
    crate::output::quote_vetted(&ctx.ex.inner.output_rules, message)
}

/// Where a driver picks a pending step up.
#[derive(Clone)]
pub(super) struct Resume {
    /// The attempt it starts with, and the allow a retry names.
    pub(super) attempt: u32,
    pub(super) retry_of: Option<String>,
    /// Its call was requested before a restart and has no outcome: its effect may have
    /// started, so a cancellation never erases it — it is asked again under the same key (or
    /// goes to reconciliation) and its outcome is recorded.
    pub(super) asked_before: bool,
    /// When a retry a previous executor scheduled may start.
    pub(super) not_before_ms: Option<i64>,
    /// The branch it is on (0: its own call; n: its n-th alternative) and that branch's first
    /// attempt (retries count within a branch).
    pub(super) branch: u32,
    pub(super) branch_first: u32,
    /// The branch failed for good (why, and the failure's kind) but the move to the next one
    /// was not recorded: the step records it first.
    pub(super) branch_after: Option<(String, String)>,
}

impl Default for Resume {
    fn default() -> Self {
        Resume {
            attempt: 1,
            retry_of: None,
            asked_before: false,
            not_before_ms: None,
            branch: 0,
            branch_first: 1,
            branch_after: None,
        }
    }
}

impl Resume {
    pub(super) fn of(s: &warden_core::run::StepView) -> Resume {
        let (attempt, retry_of) = s.next_attempt();
        Resume {
            attempt,
            retry_of,
            asked_before: s.outcome_unknown,
            not_before_ms: s.retry_not_before_ms,
            branch: s.branch,
            branch_first: s.branch_first_attempt.max(1),
            branch_after: None,
        }
    }
}

/// One attempt: authorize (a retry is re-authorized, not decided again), record the request,
/// invoke, record the outcome.
pub(super) async fn execute_attempt(
    ctx: &RunCtx,
    step: &PlanStep,
    args: Value,
    (attempt, first): (u32, u32),
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
        return ctx.step_cancelled(&step.id, attempt, "the run was cancelled before the step started").await;
    }
    let tools = match ctx.ex.inner.catalog.tools().await {
        Ok(t) => t,
        Err(s) => {
            let p = fail("tool_catalog_unavailable", host_said(ctx, s.message()), json!({}));
            return ctx.step_failed(events::STEP_FAILED, &step.id, attempt, p).await;
        }
    };
    let Some(entry) = tools.get(&step.tool) else {
        let p = fail("unknown_tool", format!("no tool host serves '{}'", step.tool), json!({}));
        return ctx.step_failed(events::STEP_FAILED, &step.id, attempt, p).await;
    };
    // The declaration the run pinned stands (seed 000 §15): a host declaring the tool otherwise
    // now (another class, version or schema) gets no call of this run. A call asked before is
    // settled all the same (its host decides; see `check_declaration`).
    let declared = entry.declaration_sha256.clone();
    let pinned = ctx.pinned.get(&step.tool).cloned();
    if let Some(p) = &pinned
        && p.sha256 != declared
        && !asked_before
    {
        let now = warden_grpc::catalog::effect_name(&entry.spec);
        let reason = format!(
            "tool '{}' changed its declaration after the run pinned it (effect {} → {now}, version '{}' → '{}')",
            step.tool, p.effect, p.version, entry.spec.version
        );
        let p = fail("tool_changed", reason, json!({"pinned_sha256": p.sha256, "declared_sha256": declared}));
        return ctx.step_failed(events::STEP_FAILED, &step.id, attempt, p).await;
    }
    let (tool_version, tool_sha256, tool_effect) = match &pinned {
        Some(p) => (p.version.clone(), p.sha256.clone(), warden_grpc::catalog::effect_from_name(&p.effect)),
        None => (
            entry.spec.version.clone(),
            declared.clone(),
            warden_grpc::catalog::effect_from_name(warden_grpc::catalog::effect_name(&entry.spec)),
        ),
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
    let args_json = canonical_value(&args);
    // Failure memory (seed 001): a call that failed or was denied for good in this run — under
    // any step, in any planning round — is never attempted again; the runtime does not try
    // again blindly (a step's own retries, which its tool's retry policy asks for, go on).
    let before = if asked_before || retry_of.is_some() {
        None
    } else {
        let memory = ctx.failed_calls.lock().unwrap_or_else(|p| p.into_inner());
        if memory.is_empty() { None } else { memory.get(&call_fingerprint(&step.tool, &args_digest(&args))).cloned() }
    };
    if let Some(before) = before {
        let reason = format!(
            "the same call ({} with the same arguments) already failed in this run as step '{before}'; it is not attempted again",
            step.tool
        );
        let p = fail("repeated_failure", reason, json!({"failed_as": before}));
        return ctx.step_failed(events::STEP_FAILED, &step.id, attempt, p).await;
    }
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
    let call = || pb::AuthorizeRequest {
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
        tool_version: tool_version.clone(),
        tool_sha256: tool_sha256.clone(),
        tool_effect: tool_effect as i32,
        ..Default::default()
    };
    let ask = |req: pb::AuthorizeRequest| {
        within_grace(ctx, "policy", (&step.id, attempt), move || {
            let mut policy = ctx.ex.inner.policy.clone();
            let req = req.clone();
            async move { policy.authorize(req).await }
        })
        .instrument(authorize_span.clone())
    };
    // While the run is being created, its first calls are asked for against the plan being
    // recorded (the policy decides against it and the ledger checks it on append); after, with
    // the ledger's acknowledgement of the plan until the policy has it.
    // A call asked for so by an earlier holder, which requested it, is asked again the same
    // way: the same decision, and the request recorded is the same.
    let (unrecorded, early_again) = match ctx.unrecorded_plan() {
        _ if retry_of.is_some() || attempt != 1 => (None, false),
        Some(plan) => (Some(plan), false),
        None => match ctx.decided_early.get(&step.id).filter(|_| asked_before) {
            Some(plan) => (Some(plan.clone()), true),
            None => (None, false),
        },
    };
    if unrecorded.is_none() {
        // Answered already (at once): the run is not driven if it was not created, and the
        // acknowledgement its creation brought is taken.
        ctx.created().await?;
    }
    let mut plan_ack =
        if unrecorded.is_some() { None } else { ctx.plan_ack.lock().unwrap_or_else(|p| p.into_inner()).clone() };
    let with_plan = |plan_ack: &Option<PlanAck>| pb::AuthorizeRequest {
        run_ack: plan_ack.as_ref().map(|p| p.ack.clone()),
        plan_json: plan_ack.as_ref().map(|p| p.plan_json.to_string()).unwrap_or_default(),
        ..call()
    };
    let mut authorized = match &unrecorded {
        Some((plan_json, plan_sha256)) => {
            ask(pb::AuthorizeRequest {
                plan_json: plan_json.to_string(),
                plan_sha256: plan_sha256.to_string(),
                ..call()
            })
            .await
        }
        None => ask(with_plan(&plan_ack)).await,
    };
    if early_again && let Err(s) = &authorized {
        // Asked any other way, it would be another decision, whose request could not be the
        // one recorded: an operator settles the call.
        if !warden_grpc::is_fenced(s) {
            return Ok(StepOutcome::Unknown(format!(
                "the call was requested before its outcome was recorded, and policy did not decide it again as \
                 it did while the run was created ({:?}: {})",
                s.code(),
                s.message()
            )));
        }
    }
    if unrecorded.is_some() && !early_again && authorized.as_ref().is_err_and(|s| !warden_grpc::is_fenced(s)) {
        // Decided only once the run is on record (budgets, approvals, …), or not decided: asked
        // again as any call is, once the run is created.
        ctx.created().await?;
        plan_ack = ctx.plan_ack.lock().unwrap_or_else(|p| p.into_inner()).clone();
        authorized = ask(with_plan(&plan_ack)).await;
    }
    if authorized.is_ok() && plan_ack.is_some() {
        // The policy has the plan now (it keeps it while it decides on the run).
        *ctx.plan_ack.lock().unwrap_or_else(|p| p.into_inner()) = None;
    }
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
        return ctx
            .step_cancelled_after(record, &step.id, attempt, "the run was cancelled before the tool was invoked")
            .await;
    }
    // K08: the timeout comes only from the tool's declaration (the 60 s fallback when it
    // declares none); the request records the one that applies.
    let timeout = match entry.spec.timeout_sec {
        0 => FALLBACK_TIMEOUT,
        s => Duration::from_secs(s as u64),
    };
    // One transaction: the outcomes waiting, the policy's signed decision and the request (for
    // the run's first step, the run's creation too). The ledger acknowledges the durable
    // request; the tool host acts only with that proof.
    let mut batch: Vec<pb::EventInput> = record.into_iter().collect();
    batch.push(event(
        events::TOOL_REQUESTED,
        &step.id,
        ctx.step_key(&step.id, attempt, "requested"),
        json!({"decision_id": decision.decision_id, "attempt": attempt, "tool": step.tool, "args": args,
               "args_sha256": args_digest(&args), "idempotency_key": idempotency_key,
               "timeout_ms": timeout.as_millis() as u64, "tool_sha256": tool_sha256}),
    ));
    let request_ack = ctx.append_first(batch).await?.pop().and_then(|a| a.request_ack);
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
    // has received yet because its host could not be reached (the wait below): it is never
    // sent. A call on its way to a reachable host is not held back (it may be acting already).
    let cancels_unsent = ctx.cancel_policy == pb::CancelPolicy::Immediate && !asked_before;
    loop {
        // A holder that lost its lease invokes nothing more: its successor settles the call.
        if ctx.lost.is_cancelled() {
            return Err(DriveError::LeaseLost);
        }
        if cancels_unsent && asked == 0 && said_waiting && ctx.cancel.is_cancelled() {
            let reason =
                format!("the run was cancelled before the tool was invoked ({})", policy_name(ctx.cancel_policy));
            let payload =
                json!({"reason": reason, "decision_id": decision.decision_id, "attempt": attempt, "tool": step.tool});
            let key = ctx.step_key(&step.id, attempt, "cancelled");
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
                            host_said(ctx, s.message())
                        );
                        break;
                    }
                    let said = host_said(ctx, s.message());
                    let reason = format!("tool host unreachable for {} ms: {said}", grace.as_millis());
                    answer = Some(Err(failed("tool_host_unavailable", reason, json!({}))));
                    break;
                }
                if !said_waiting {
                    said_waiting = true;
                    ctx.record_wait("tool_host", (&step.id, attempt), &host_said(ctx, s.message())).await;
                }
            }
            // The host itself says the call may have acted without a recorded outcome: asking
            // again cannot tell more; an operator establishes what happened.
            Ok(Err(s)) if in_doubt(&s) => {
                unknown = format!("the tool host says: {}", host_said(ctx, s.message()));
                break;
            }
            // The connection broke off under the call — a status the host sent for it, or the
            // client's own transport error of any code (an HTTP/2 protocol error while the host
            // shuts down arrives as INTERNAL): the host may have acted.
            Ok(Err(s))
                if matches!(s.code(), Code::Unavailable | Code::Unknown | Code::Cancelled | Code::DeadlineExceeded)
                    || warden_grpc::broke_off(&s) =>
            {
                asked += 1;
                unknown = format!("tool host call broke off: {}", host_said(ctx, s.message()));
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
            _ = ctx.cancel.cancelled(), if cancels_unsent && asked == 0 && said_waiting => {}
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
                host_said(ctx, s.message())
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
            Err(vetted(ctx, failed(kind, String::new(), json!({})), s.message()))
        }
        Ok(resp) => {
            let resp = resp.into_inner();
            match resp.outcome {
                Some(pb::invoke_response::Outcome::OutputJson(text)) => match serde_json::from_str::<Value>(&text) {
                    Ok(out) => Ok((out, resp.replayed)),
                    Err(e) => Err(failed("invalid_output", format!("tool output is not JSON: {e}"), json!({}))),
                },
                Some(pb::invoke_response::Outcome::Error(e)) => {
                    let extra = json!({"code": e.code, "retryable": e.retryable});
                    Err(vetted(ctx, failed("tool_error", String::new(), extra), &e.message))
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
            // Compact JSON, not RFC 8785: the rules and the size limit need the text, not its
            // canonical form (the ledger canonicalizes what it stores; a withheld output's digest
            // is taken canonically).
            let text = output.to_string();
            // What the call cost is spent whether or not its output may be recorded.
            let cost = output.get("cost").and_then(Value::as_f64);
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
                    if let Some(cost) = cost {
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
            // The retries the tool allows count within the branch (its first attempt is `first`).
            let nth = attempt.saturating_sub(first) + 1;
            if !retryable || nth >= max_attempts(entry.spec.retry_policy) {
                return ctx.step_failed(events::TOOL_FAILED, &step.id, attempt, payload).await;
            }
            let first = retry_of.map(str::to_string).unwrap_or_else(|| decision.decision_id.clone());
            let base = ctx.ex.inner.config.retry_backoff_base_ms;
            let backoff = Duration::from_millis(base.saturating_mul(1 << (nth - 1).min(16)));
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
        let reset = Status::internal("h2 protocol error: http2 error");
        assert!(transient(&reset), "an HTTP/2 error under the call (tonic attaches no source) is waited out");
        assert!(!transient(&Status::unknown("the callee's own unknown error")));
        assert!(!transient(&Status::internal("a bug in the callee")));
        assert!(transient(&Status::unavailable("store blip")));
        assert!(!transient(&Status::invalid_argument("bad")));
    }
}
