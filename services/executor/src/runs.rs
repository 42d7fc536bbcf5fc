//! The `Runs` gRPC service: the front door clients submit and inspect runs through.

use serde_json::json;
use tonic::{Code, Request, Response, Status};
use warden_core::events;
use warden_core::ids::check_id;
use warden_core::run::StepStatus;
use warden_grpc::invalid_field;
use warden_lease::RunSignal;
use warden_proto::v1 as pb;
use warden_proto::v1::runs_server::Runs;

use crate::Executor;
use crate::driver::{load_run, load_view};

pub struct RunsService {
    ex: Executor,
}

impl RunsService {
    pub fn new(ex: Executor) -> RunsService {
        RunsService { ex }
    }
}

fn id_field(field: &str, v: &str) -> Result<(), Status> {
    check_id(v).map_err(|e| invalid_field(field, e.to_string()))
}

fn step_status(s: StepStatus) -> pb::StepStatus {
    match s {
        StepStatus::Pending => pb::StepStatus::Pending,
        StepStatus::Running => pb::StepStatus::Running,
        StepStatus::Completed => pb::StepStatus::Completed,
        StepStatus::Failed => pb::StepStatus::Failed,
        StepStatus::Cancelled => pb::StepStatus::Cancelled,
        StepStatus::Denied => pb::StepStatus::Denied,
    }
}

/// What `GetRun` answers from a run's ledger row.
pub(crate) struct Head {
    pub status: i32,
    pub reason: String,
    pub created_at_ms: i64,
    pub updated_at_ms: i64,
    pub last_seq: u64,
}

/// `GetRun`'s answer: the run's row (`head`) and its log folded up to `head.last_seq`.
pub(crate) fn run_answer(run_id: String, tenant: String, head: Head, view: warden_core::run::RunView) -> pb::Run {
    let waiting_for = view.waiting_for();
    let steps = view
        .steps
        .iter()
        .map(|s| pb::StepState {
            id: s.id.clone(),
            tool: s.tool.clone(),
            status: step_status(s.status) as i32,
            output_json: s.output.as_ref().map(|o| o.to_string()).unwrap_or_default(),
            error: s.error.clone().unwrap_or_default(),
            attempts: s.attempts,
            output_sha256: s.output_ref.as_ref().map(|(sha, _)| sha.clone()).unwrap_or_default(),
            output_bytes: s.output_ref.as_ref().map(|(_, n)| *n).unwrap_or_default(),
        })
        .collect();
    pb::Run {
        run_id,
        tenant,
        status: head.status,
        reason: head.reason,
        steps,
        direct_response: view.plan.and_then(|p| p.direct_response).unwrap_or_default(),
        created_at_ms: head.created_at_ms,
        updated_at_ms: head.updated_at_ms,
        last_seq: head.last_seq,
        waiting_for,
        agent: view.agent,
    }
}

/// Most capability handles one submission may carry.
const MAX_CAPABILITY_HANDLES: usize = 16;

impl RunsService {
    async fn attach(&self, tenant: &str, run_id: &str, handle: &str, validate_only: bool) -> Result<(), Status> {
        let req = pb::AttachCapabilityRequest {
            tenant: tenant.to_string(),
            run_id: run_id.to_string(),
            capability_handle: handle.to_string(),
            validate_only,
        };
        self.ex.inner.capabilities.clone().attach(req).await.map(|_| ())
    }
}

/// Whether `CreateRun` recorded the run `run_id` this submission picked (not an earlier
/// submission's run under the same idempotency key).
fn created_as(c: &pb::CreateRunResponse, run_id: &str) -> bool {
    !c.deduplicated && c.run.as_ref().is_some_and(|r| r.run_id == run_id)
}

/// A run whose creation's answer was lost, looked up by the id this submission picked: asked
/// again (backing off) while the ledger cannot answer, within the outage grace, since a run
/// recorded with its first request must be driven, not left to a successor. None: not
/// recorded, or not known in time.
async fn lost_creation(
    ledger: &mut warden_proto::v1::ledger_client::LedgerClient<warden_grpc::auth::Ch>,
    tenant: String,
    run_id: &str,
    grace: std::time::Duration,
) -> Option<pb::LedgerRun> {
    let started = tokio::time::Instant::now();
    let mut backoff = std::time::Duration::from_millis(20);
    loop {
        let asked = pb::GetLedgerRunRequest { tenant: tenant.clone(), run_id: run_id.to_string(), with_events: false };
        match ledger.get_run(asked).await {
            Ok(run) => return Some(run.into_inner()),
            Err(s) if unanswered(&s) && started.elapsed() < grace => {
                tracing::debug!(run_id, error = %s, "looking up a run whose creation's answer was lost");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(std::time::Duration::from_secs(2));
            }
            Err(_) => return None,
        }
    }
}

/// Whether a failed call may have been carried out all the same (its answer lost); not one
/// that never reached the ledger (no connection).
fn maybe_committed(s: &Status) -> bool {
    unanswered(s) && !crate::driver::never_sent(s)
}

/// A call the ledger did not answer (it may be down or restarting).
fn unanswered(s: &Status) -> bool {
    matches!(s.code(), Code::Unavailable | Code::Unknown | Code::DeadlineExceeded | Code::Cancelled | Code::Internal)
}

/// The ledger's answer for the first step's `n` events a creation carried: recorded with the
/// run, or why not (an older ledger that ignored them answers none, and they are appended).
fn first_appended(c: &pb::CreateRunResponse, n: usize) -> Result<Vec<pb::AppendEventResponse>, Status> {
    match Code::from(c.first_events_code) {
        Code::Ok if c.first_appended.len() == n => Ok(c.first_appended.clone()),
        Code::Ok => Err(Status::failed_precondition("the ledger did not record the first step with the run")),
        code => Err(Status::new(code, c.first_events_message.clone())),
    }
}

/// When the ledger recorded a run it created.
fn created_at(c: &pb::CreateRunResponse) -> i64 {
    c.run.as_ref().map_or(0, |r| r.created_at_ms)
}

/// The ledger's acknowledgement of the run's plan with the plan it vouches for, when the plan
/// is sent with the run's first Authorize (`plan_json`; see `driver::PlanAck`).
fn plan_ack(c: &pb::CreateRunResponse, plan_json: Option<std::sync::Arc<str>>) -> Option<crate::driver::PlanAck> {
    Some(crate::driver::PlanAck { ack: c.run_ack.clone()?, plan_json: plan_json? })
}

#[tonic::async_trait]
impl Runs for RunsService {
    async fn submit_run(&self, req: Request<pb::SubmitRunRequest>) -> Result<Response<pb::SubmitRunResponse>, Status> {
        warden_grpc::auth::check(&req, &req.get_ref().tenant)?;
        let agent = warden_grpc::auth::agent(&req, &req.get_ref().agent)?;
        let r = req.into_inner();
        id_field("tenant", &r.tenant)?;
        if !r.idempotency_key.is_empty() {
            id_field("idempotency_key", &r.idempotency_key)?;
            // Keys of child frames are the mesh's own (`frame:<run>:<step>`).
            if r.idempotency_key.starts_with("frame:") {
                return Err(invalid_field(
                    "idempotency_key",
                    "keys starting with 'frame:' are reserved for child frames",
                ));
            }
        }
        if !agent.is_empty() {
            id_field("agent", &agent)?;
        }
        pb::CancelPolicy::try_from(r.cancel_policy)
            .map_err(|_| invalid_field("cancel_policy", format!("{} is not a cancel policy", r.cancel_policy)))?;
        pb::ReplayPolicy::try_from(r.replay_policy)
            .map_err(|_| invalid_field("replay_policy", format!("{} is not a replay policy", r.replay_policy)))?;
        let goal_run = match (r.plan_json.is_empty(), r.goal.is_empty()) {
            (false, true) => false,
            (true, false) => true,
            _ => {
                return Err(invalid_field("plan_json", "exactly one of plan_json and goal must be set"));
            }
        };
        let max = self.ex.inner.config.max_plan_bytes;
        if r.plan_json.len() > max {
            return Err(invalid_field(
                "plan_json",
                format!("{} bytes is over the maximum of {max}", r.plan_json.len()),
            ));
        }
        if r.capability_handles.len() > MAX_CAPABILITY_HANDLES {
            let why = format!("at most {MAX_CAPABILITY_HANDLES} handles");
            return Err(invalid_field("capability_handles", why));
        }
        // Capabilities are checked before anything is written (renamed to the field here).
        for (i, handle) in r.capability_handles.iter().enumerate() {
            self.attach(&r.tenant, "", handle, true).await.map_err(|s| {
                let field = format!("capability_handles[{i}]");
                match s.code() {
                    Code::InvalidArgument => {
                        let why = warden_grpc::field_violations(&s).into_iter().next().map(|(_, why)| why);
                        invalid_field(&field, why.unwrap_or_else(|| s.message().to_string()))
                    }
                    _ => Status::new(s.code(), format!("{field}: {}", s.message())),
                }
            })?;
        }
        let handles = r.capability_handles.clone();
        // A goal is checked (size, a model configured for the tenant) and redacted before it
        // is recorded; the plan comes from planning, once the run is driven.
        let goal = if goal_run {
            let checked = self
                .ex
                .inner
                .planner
                .clone()
                .create_plan(pb::CreatePlanRequest {
                    tenant: r.tenant.clone(),
                    goal: r.goal.clone(),
                    agent: agent.clone(),
                    check_only: true,
                    ..Default::default()
                })
                .await?
                .into_inner();
            checked.goal
        } else {
            String::new()
        };
        // The plan is validated before anything is written: a bad plan leaves no trace.
        let validate = async {
            if goal_run {
                return Ok((pb::ValidatePlanResponse::default(), None));
            }
            let validated = self
                .ex
                .inner
                .planner
                .clone()
                .validate_plan(pb::ValidatePlanRequest { tenant: r.tenant.clone(), plan_json: r.plan_json.clone() })
                .await?
                .into_inner();
            // The executor bounds the plan as it will read it (canonical, defaults filled in).
            let max = self.ex.inner.config.max_plan_bytes;
            if validated.plan_json.len() > max {
                return Err(invalid_field(
                    "plan_json",
                    format!("{} bytes once normalized, over the maximum of {max}", validated.plan_json.len()),
                ));
            }
            let plan: serde_json::Value = serde_json::from_str(&validated.plan_json)
                .map_err(|e| Status::internal(format!("validated plan is not JSON: {e}")))?;
            Ok((validated, Some(plan)))
        };
        let (validated, plan) = validate.await?;
        // A fresh run costs one ledger commit: this replica takes the lease of the id it picks
        // first, so the ledger records `run_started` with `run_submitted`, and the run is driven
        // from the plan in hand without reading anything back. (Taken after the validation:
        // overlapping the two was measured to gain nothing, BENCHMARKS.md.)
        let run_id = uuid::Uuid::now_v7().to_string();
        let ttl = std::time::Duration::from_millis(self.ex.inner.config.lease_ttl_ms);
        // A lease store that cannot answer (Redis restarting) does not refuse the submission:
        // the run is recorded pending, and is driven once a lease can be taken (the sweeper).
        let lease = match self.ex.inner.leases.acquire(&run_id, &self.ex.inner.lease_owner, ttl, 0).await {
            Ok(l) => l,
            Err(e) => {
                tracing::warn!(run_id = %run_id, error = %e, "no lease at submission; the run waits for the sweeper");
                None
            }
        };
        // The plan as the ledger records it (canonical JSON), whose digest it acknowledges.
        let recorded_plan: Option<std::sync::Arc<str>> =
            plan.as_ref().map(|p| std::sync::Arc::from(warden_core::canonical::canonical_value(p)));
        // A plan too large to travel in a request is read by the policy from the ledger.
        let small = validated.plan_json.len() <= crate::driver::PLAN_ACK_MAX_BYTES;
        if lease.is_some() {
            warden_telemetry::metrics::lease_acquired(false);
        }
        let tenant = r.tenant.clone();
        let view = |lease: &warden_lease::RunLease, tenant: &str, cancel_policy: i32| {
            let mut view = warden_core::run::RunView::default();
            let mut submitted = events::submitted_payload(tenant, cancel_policy, plan.as_ref(), &goal, &agent);
            events::add_goal_fields(&mut submitted, if goal_run { r.replay_policy } else { 0 }, "");
            view.apply(1, events::RUN_SUBMITTED, "", &submitted);
            view.apply(2, events::RUN_STARTED, "", &events::started_payload(&self.ex.inner.id, lease.epoch));
            view
        };
        // A fresh run of a submitted plan is driven while the ledger creates it: its first
        // decisions are asked for meanwhile, and its driver writes nothing until the creation
        // is answered (`driver::creation`). Capability handles attach to the recorded run
        // before its first decision, so such runs wait, as goal runs do.
        let creating = match (&lease, &recorded_plan) {
            (Some(l), Some(plan_json)) if handles.is_empty() && small && self.ex.inner.config.decide_while_creating => {
                let (gate, creation) = crate::driver::creation_gate(plan_json.clone());
                let view = view(l, &tenant, r.cancel_policy);
                self.ex.dispatch_submitted(
                    tenant.clone(),
                    l.clone(),
                    view,
                    crate::driver::Submitted::Creating(creation),
                );
                Some(gate)
            }
            _ => None,
        };
        let request = pb::CreateRunRequest {
            tenant: r.tenant,
            plan_json: validated.plan_json.clone(),
            goal: goal.clone(),
            replay_policy: if goal_run { r.replay_policy } else { 0 },
            parent_run_id: String::new(),
            idempotency_key: r.idempotency_key,
            cancel_policy: r.cancel_policy,
            agent: agent.clone(),
            run_id: run_id.clone(),
            started_by: lease.as_ref().map(|_| self.ex.inner.id.clone()).unwrap_or_default(),
            epoch: lease.as_ref().map(|l| l.epoch).unwrap_or_default(),
            frame_json: String::new(),
            first_events: Vec::new(),
        };
        // The plan travels with the run's first Authorize under the ledger's acknowledgement
        // (not a goal run's, which may be revised, nor one too large for a request).
        let sent_plan = recorded_plan.clone().filter(|_| !goal_run && small);
        let driven = creating.is_some();
        let created = match creating {
            Some(mut gate) => {
                let mut ledger = self.ex.inner.ledger.clone();
                let (mine, plan_json) = (run_id.clone(), sent_plan.clone());
                let wait = std::time::Duration::from_millis(self.ex.inner.config.first_step_wait_ms);
                let grace = std::time::Duration::from_millis(self.ex.inner.config.outage_grace_ms);
                // The driver hears how the creation went even if this call is dropped meanwhile
                // (its client gone): a run that was recorded is driven, not left to the sweeper.
                let task_body = async move {
                    // The first step's decision and request, recorded with the run when the
                    // driver has them in time (one commit for both).
                    // (Waiting no time lets the offer go at once.)
                    let mut request = request;
                    let reply = gate.first_step(wait).await.map(|step| {
                        let n = step.events.len();
                        request.first_events = step.events;
                        (step.reply, n)
                    });
                    let tenant = request.tenant.clone();
                    let created = match ledger.create_run(request).await {
                        // The answer may be lost after the commit: a run recorded with its first
                        // request is driven (the request appended again is answered as the one
                        // recorded), not left to a successor that would find the request's
                        // outcome unknown.
                        Err(s) if maybe_committed(&s) => match lost_creation(&mut ledger, tenant, &mine, grace).await {
                            Some(run) => Ok(Response::new(pb::CreateRunResponse {
                                run: Some(run),
                                first_events_code: Code::Unknown as i32,
                                first_events_message: format!("the creation's answer was lost: {}", s.message()),
                                ..Default::default()
                            })),
                            None => Err(s),
                        },
                        other => other,
                    };
                    let ours = created.as_ref().is_ok_and(|c| created_as(c.get_ref(), &mine));
                    match created.as_ref().map(tonic::Response::get_ref) {
                        Ok(c) if ours => gate.created(plan_ack(c, plan_json), created_at(c)),
                        // Failed, or another submission's run: the driver stops and gives the
                        // lease back.
                        _ => gate.abandoned(),
                    }
                    // Answered after the gate: a step whose events were left out appends them
                    // once the run is on record. Not answered when the run is not this
                    // submission's: the step then finds the run not created.
                    if let (Some((reply, n)), Ok(c), true) = (reply, &created, ours) {
                        let _ = reply.send(first_appended(c.get_ref(), n));
                    }
                    created
                };
                let task = tokio::spawn(tracing::Instrument::instrument(task_body, tracing::Span::current()));
                task.await.map_err(|e| Status::internal(format!("creating the run failed: {e}")))?
            }
            None => self.ex.inner.ledger.clone().create_run(request).await,
        };
        let created = match created {
            Ok(c) => c.into_inner(),
            Err(e) => {
                // A driver started with the creation gives the lease back itself.
                if let (Some(l), false) = (&lease, driven) {
                    let _ = self.ex.inner.leases.release(l).await;
                }
                return Err(e);
            }
        };
        let run = created.run.clone().ok_or_else(|| Status::internal("ledger returned no run"))?;
        let ours = created_as(&created, &run_id);
        // Deduplicated (an earlier submission's run), or no lease (the lease store did not
        // answer; then the usual path drives it): this lease is not needed.
        let fresh = match lease {
            _ if driven => None,
            Some(l) if ours => Some(l),
            Some(l) => {
                let _ = self.ex.inner.leases.release(&l).await;
                None
            }
            None => None,
        };
        // Attached before the run is dispatched, so its first step can use them. A handle
        // revoked in between fails to attach: the calls it would have covered are denied and
        // recorded like any other.
        for handle in &handles {
            if let Err(e) = self.attach(&run.tenant, &run.run_id, handle, false).await {
                tracing::warn!(run_id = %run.run_id, error = %e, "capability not attached");
            }
        }
        let status = run.status();
        match fresh {
            Some(lease) => {
                let view = view(&lease, &run.tenant, run.cancel_policy);
                let how = crate::driver::Submitted::Created(plan_ack(&created, sent_plan), run.created_at_ms);
                self.ex.dispatch_submitted(run.tenant.clone(), lease, view, how);
            }
            // Driven since before its creation.
            None if driven && ours => {}
            None if !warden_grpc::convert::status_from_proto(status).is_some_and(|s| s.is_terminal()) => {
                self.ex.dispatch(run.run_id.clone());
            }
            None => {}
        }
        tracing::info!(run_id = %run.run_id, tenant = %run.tenant, deduplicated = created.deduplicated, "run submitted");
        if !created.deduplicated {
            warden_telemetry::metrics::run_submitted();
        }
        Ok(Response::new(pb::SubmitRunResponse {
            run_id: run.run_id,
            status: status as i32,
            deduplicated: created.deduplicated,
        }))
    }

    async fn wait_run(&self, req: Request<pb::WaitRunRequest>) -> Result<Response<pb::Run>, Status> {
        warden_grpc::auth::check(&req, &req.get_ref().tenant)?;
        let r = req.into_inner();
        id_field("tenant", &r.tenant)?;
        id_field("run_id", &r.run_id)?;
        let timeout = match r.timeout_ms {
            0 => 60_000,
            t if t > 3_600_000 => return Err(invalid_field("timeout_ms", "at most 3600000 (one hour)")),
            t => t,
        };
        // Settled already: answered at once. A run this replica drives is waited for in
        // memory (woken when its driver stops); any other is followed through the ledger (which
        // wakes followers as it commits) until an event leaves it settled. A run submitted
        // here for this tenant and still driven is going: nothing to look at until its driver
        // stops (a driver stops when the run ends, blocks or is handed off).
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_millis(timeout);
        let look = || async {
            let req =
                pb::GetLedgerRunRequest { tenant: r.tenant.clone(), run_id: r.run_id.clone(), with_events: false };
            Ok::<_, Status>(self.ex.inner.ledger.clone().get_run(req).await?.into_inner())
        };
        loop {
            let stopped = self.ex.drives(&r.run_id).then(|| self.ex.stopped_driving(&r.run_id));
            let woken = stopped.as_ref().map(|n| Box::pin(n.notify.notified()));
            let mut woken = woken.map(|mut w| {
                w.as_mut().enable();
                w
            });
            if let Some(ours) = &stopped
                && !(self.ex.drives(&r.run_id) && self.ex.waits_on(&r.run_id, ours))
            {
                // Stopped between the two looks (and perhaps driven again since, under a waker
                // this one is not): forget the waker (unless someone else waits) and look.
                self.ex.forget_stopped_driving(&r.run_id, ours);
                woken = None;
            }
            if let Some(woken) = woken {
                if !self.ex.drives_for(&r.run_id, &r.tenant) && settled(look().await?.status()) {
                    break;
                }
                if tokio::time::Instant::now() >= deadline {
                    break;
                }
                tokio::select! {
                    _ = woken => {
                        // The driver stopped: most often the run settled. A driver that knew
                        // the run's whole log left the answer (no read); otherwise the answer
                        // itself is read (one read fewer than looking first). A run handed off
                        // or still going is waited for again.
                        let left = stopped.as_ref().and_then(|s| s.answer.get());
                        if let Some(run) = left.filter(|run| run.tenant == r.tenant && settled(run.status())) {
                            warden_telemetry::metrics::wait_answered("driver");
                            return Ok(Response::new(run.clone()));
                        }
                        let run = self.get_run(Request::new(pb::GetRunRequest {
                            tenant: r.tenant.clone(),
                            run_id: r.run_id.clone(),
                        }))
                        .await?;
                        if settled(run.get_ref().status()) {
                            warden_telemetry::metrics::wait_answered("ledger");
                            return Ok(run);
                        }
                        continue;
                    }
                    _ = tokio::time::sleep_until(deadline) => break,
                    // This replica is leaving: answer now; the client asks another.
                    _ = self.ex.inner.handoff.cancelled() => break,
                }
            }
            let now = look().await?;
            if settled(now.status()) || tokio::time::Instant::now() >= deadline {
                break;
            }
            let follow = pb::StreamEventsRequest {
                tenant: r.tenant.clone(),
                run_id: r.run_id.clone(),
                since_seq: now.last_seq,
                follow: true,
            };
            let mut stream = self.ex.inner.ledger.clone().stream_events(follow).await?.into_inner();
            let until_settled = async {
                while let Some(e) = stream.message().await? {
                    let waits =
                        matches!(e.event_type.as_str(), events::RUN_BLOCKED | events::RUN_REQUIRES_RECONCILIATION);
                    if waits || events::status_after(&e.event_type).is_some_and(|s| s.is_terminal()) {
                        break;
                    }
                }
                Ok::<(), Status>(())
            };
            tokio::select! {
                r = until_settled => r?,
                _ = tokio::time::sleep_until(deadline) => {}
                _ = self.ex.inner.handoff.cancelled() => {}
            }
            break;
        }
        let run = self.get_run(Request::new(pb::GetRunRequest { tenant: r.tenant, run_id: r.run_id })).await?;
        warden_telemetry::metrics::wait_answered("ledger");
        Ok(run)
    }

    async fn get_run(&self, req: Request<pb::GetRunRequest>) -> Result<Response<pb::Run>, Status> {
        warden_grpc::auth::check(&req, &req.get_ref().tenant)?;
        let r = req.into_inner();
        id_field("tenant", &r.tenant)?;
        id_field("run_id", &r.run_id)?;
        let (run, view) = load_run(&self.ex, &r.tenant, &r.run_id).await?;
        let head = Head {
            status: run.status,
            reason: run.reason,
            created_at_ms: run.created_at_ms,
            updated_at_ms: run.updated_at_ms,
            last_seq: run.last_seq,
        };
        Ok(Response::new(run_answer(run.run_id, run.tenant, head, view)))
    }

    async fn list_runs(&self, req: Request<pb::ListRunsRequest>) -> Result<Response<pb::ListRunsResponse>, Status> {
        warden_grpc::auth::check(&req, &req.get_ref().tenant)?;
        let r = req.into_inner();
        id_field("tenant", &r.tenant)?;
        let page = self
            .ex
            .inner
            .ledger
            .clone()
            .list_runs(pb::ListLedgerRunsRequest {
                tenant: r.tenant,
                statuses: r.statuses,
                page_size: r.page_size,
                page_token: r.page_token,
            })
            .await?
            .into_inner();
        let runs = page
            .runs
            .into_iter()
            .map(|l| pb::Run {
                run_id: l.run_id,
                tenant: l.tenant,
                status: l.status,
                reason: l.reason,
                steps: vec![],
                direct_response: String::new(),
                created_at_ms: l.created_at_ms,
                updated_at_ms: l.updated_at_ms,
                last_seq: l.last_seq,
                // A summary: steps, agent and waits come from the run's events (GetRun).
                agent: String::new(),
                waiting_for: Vec::new(),
            })
            .collect();
        Ok(Response::new(pb::ListRunsResponse { runs, next_page_token: page.next_page_token }))
    }

    /// Records the request (`run_cancel_requested`, once), signals the executor driving the run
    /// and answers the run's status at that moment; the run ends `cancelled` once its cancel
    /// policy lets it (immediate: no tool is invoked after the request; after_tool_call: steps
    /// already authorized finish). A blocked run is resumed to be cancelled. Cancelling a
    /// cancelled run changes nothing; a run that ended otherwise, or one waiting for an unknown
    /// outcome to be reconciled, is FAILED_PRECONDITION.
    async fn cancel_run(&self, req: Request<pb::CancelRunRequest>) -> Result<Response<pb::CancelRunResponse>, Status> {
        warden_grpc::auth::check(&req, &req.get_ref().tenant)?;
        let bound = warden_grpc::auth::bound_agent(&req);
        let r = req.into_inner();
        id_field("tenant", &r.tenant)?;
        id_field("run_id", &r.run_id)?;
        // An agent's token cancels only that agent's runs.
        if let Some(agent) = bound {
            let (view, _) = load_view(&self.ex, &r.tenant, &r.run_id).await?;
            if view.agent != agent {
                return Err(Status::permission_denied(format!("agent '{agent}' may cancel only its own runs")));
            }
        }
        if r.reason.len() > 1024 || r.reason.contains('\0') {
            return Err(invalid_field("reason", "at most 1024 bytes of text"));
        }
        let mut ledger = self.ex.inner.ledger.clone();
        for _ in 0..5 {
            let get =
                pb::GetLedgerRunRequest { tenant: r.tenant.clone(), run_id: r.run_id.clone(), with_events: false };
            let run = ledger.get_run(get).await?.into_inner();
            let status = run.status();
            match status {
                pb::RunStatus::Cancelled => return Ok(Response::new(pb::CancelRunResponse { status: status as i32 })),
                pb::RunStatus::Completed | pb::RunStatus::Failed | pb::RunStatus::EmptyPlan => {
                    let name = warden_grpc::convert::status_name(status as i32);
                    return Err(Status::failed_precondition(format!("run {} already ended {name}", r.run_id)));
                }
                pb::RunStatus::RequiresReconciliation => {
                    return Err(Status::failed_precondition(format!(
                        "run {} has a step whose outcome is unknown; it must be reconciled before the run can end",
                        r.run_id
                    )));
                }
                _ => {}
            }
            // Appended at the run's current epoch: it does not fence out the executor driving it.
            let append = |event_type: &str, key: &str, payload: serde_json::Value| pb::AppendEventRequest {
                tenant: r.tenant.clone(),
                run_id: r.run_id.clone(),
                epoch: run.max_epoch,
                idempotency_key: key.to_string(),
                event_type: event_type.to_string(),
                payload_json: payload.to_string(),
                step_id: String::new(),
            };
            let requested = append(events::RUN_CANCEL_REQUESTED, "cancel_requested", json!({"reason": r.reason}));
            match ledger.append_event(requested).await {
                Ok(_) => {}
                // A new epoch or a status change raced us: look again.
                Err(s) if s.code() == Code::FailedPrecondition => continue,
                Err(s) => return Err(s),
            }
            self.ex.signal_here(&r.run_id, RunSignal::Cancel);
            if let Err(e) = self.ex.inner.leases.signal(&r.run_id, RunSignal::Cancel).await {
                // Recorded, but a driver on another replica would not hear of it until it
                // restarts: say so, and a retry (idempotent) signals again.
                tracing::warn!(run_id = %r.run_id, error = %e, "cancel signal not stored");
                return Err(Status::unavailable(format!(
                    "the cancellation is recorded but could not be signalled to the executor ({e}); try again"
                )));
            }
            // A run no executor holds is resumed to be cancelled by one. Its status is read
            // again: a driver may have paused or blocked the run since it was read above (the
            // ledger refuses a pause after the request, so this reading is the last word on it).
            let get =
                pb::GetLedgerRunRequest { tenant: r.tenant.clone(), run_id: r.run_id.clone(), with_events: false };
            let now = ledger.get_run(get).await?.into_inner().status();
            if matches!(now, pb::RunStatus::Blocked | pb::RunStatus::Paused) {
                let resumed =
                    append(events::RUN_RESUMED, "resumed:cancel", json!({"reason": "resumed to be cancelled"}));
                if let Err(s) = ledger.append_event(resumed).await
                    && s.code() != Code::FailedPrecondition
                {
                    return Err(s);
                }
            }
            self.ex.dispatch(r.run_id.clone());
            tracing::info!(run_id = %r.run_id, "cancellation requested");
            return Ok(Response::new(pb::CancelRunResponse { status: status as i32 }));
        }
        Err(Status::aborted("the run kept changing; try again"))
    }

    async fn get_step_output(
        &self,
        req: Request<pb::GetStepOutputRequest>,
    ) -> Result<Response<pb::StepOutput>, Status> {
        warden_grpc::auth::check(&req, &req.get_ref().tenant)?;
        let r = req.into_inner();
        id_field("tenant", &r.tenant)?;
        id_field("run_id", &r.run_id)?;
        warden_core::ids::check_step_id(&r.step_id).map_err(|e| invalid_field("step_id", e.to_string()))?;
        let (view, _) = load_view(&self.ex, &r.tenant, &r.run_id).await?;
        let step = view
            .step(&r.step_id)
            .ok_or_else(|| Status::not_found(format!("run {} has no step '{}'", r.run_id, r.step_id)))?;
        if step.status != StepStatus::Completed {
            return Err(Status::failed_precondition(format!("step '{}' has not completed", r.step_id)));
        }
        let Some((sha256, _)) = step.output_ref.clone() else {
            let output_json = step.output.as_ref().map(|o| o.to_string()).unwrap_or_default();
            return Ok(Response::new(pb::StepOutput { step_id: r.step_id, output_json, output_sha256: String::new() }));
        };
        let get = pb::GetOutputRequest { tenant: r.tenant, run_id: r.run_id, sha256: sha256.clone() };
        let stored = self.ex.inner.ledger.clone().get_output(get).await?.into_inner();
        Ok(Response::new(pb::StepOutput { step_id: r.step_id, output_json: stored.output_json, output_sha256: sha256 }))
    }

    async fn pause_run(&self, req: Request<pb::PauseRunRequest>) -> Result<Response<pb::PauseRunResponse>, Status> {
        warden_grpc::auth::check(&req, &req.get_ref().tenant)?;
        let bound = warden_grpc::auth::bound_agent(&req);
        let r = req.into_inner();
        let (status, max_epoch) = self.run_control(&r.tenant, &r.run_id, &r.reason, bound.as_deref(), "pause").await?;
        match status {
            pb::RunStatus::Paused => return Ok(Response::new(pb::PauseRunResponse { status: status as i32 })),
            pb::RunStatus::Pending | pb::RunStatus::Active | pb::RunStatus::Blocked => {}
            other => {
                let name = warden_grpc::convert::status_name(other as i32);
                return Err(Status::failed_precondition(format!(
                    "run {} is {name}: only a pending, active or blocked run can be paused",
                    r.run_id
                )));
            }
        }
        // Recorded at the run's current epoch (it does not fence out the driver), under a key of
        // its own: a run may be paused, resumed and paused again.
        let requested = pb::AppendEventRequest {
            tenant: r.tenant.clone(),
            run_id: r.run_id.clone(),
            epoch: max_epoch,
            idempotency_key: format!("pause_requested:{}", uuid::Uuid::new_v4().simple()),
            event_type: events::RUN_PAUSE_REQUESTED.to_string(),
            payload_json: json!({"reason": r.reason}).to_string(),
            step_id: String::new(),
        };
        match self.ex.inner.ledger.clone().append_event(requested).await {
            Ok(_) => {}
            Err(s) if s.code() == Code::FailedPrecondition => {
                return Err(Status::aborted("the run changed meanwhile (it ended or took a new epoch); try again"));
            }
            Err(s) => return Err(s),
        }
        self.ex.signal_here(&r.run_id, RunSignal::Pause);
        if let Err(e) = self.ex.inner.leases.signal(&r.run_id, RunSignal::Pause).await {
            tracing::warn!(run_id = %r.run_id, error = %e, "pause signal not stored");
            return Err(Status::unavailable(format!(
                "the pause is recorded but could not be signalled to the executor ({e}); try again"
            )));
        }
        tracing::info!(run_id = %r.run_id, "pause requested");
        Ok(Response::new(pb::PauseRunResponse { status: status as i32 }))
    }

    async fn resume_run(&self, req: Request<pb::ResumeRunRequest>) -> Result<Response<pb::ResumeRunResponse>, Status> {
        warden_grpc::auth::check(&req, &req.get_ref().tenant)?;
        let bound = warden_grpc::auth::bound_agent(&req);
        let r = req.into_inner();
        let (status, max_epoch) = self.run_control(&r.tenant, &r.run_id, &r.reason, bound.as_deref(), "resume").await?;
        if status != pb::RunStatus::Paused {
            let name = warden_grpc::convert::status_name(status as i32);
            return Err(Status::failed_precondition(format!(
                "run {} is {name}, not paused (a pause takes effect once its steps in flight settle)",
                r.run_id
            )));
        }
        // The signal goes first: the driver the resume dispatches must not pause again.
        self.ex.inner.leases.clear_signal(&r.run_id, RunSignal::Pause).await.map_err(|e| {
            Status::unavailable(format!("the lease store did not answer ({e}); nothing was resumed, try again"))
        })?;
        // Keyed by the paused drive's epoch: a retried resume of the same pause records it once.
        let resumed = pb::AppendEventRequest {
            tenant: r.tenant.clone(),
            run_id: r.run_id.clone(),
            epoch: max_epoch,
            idempotency_key: format!("resumed:pause:e{max_epoch}"),
            event_type: events::RUN_RESUMED.to_string(),
            payload_json: json!({"reason": r.reason, "from": "paused"}).to_string(),
            step_id: String::new(),
        };
        match self.ex.inner.ledger.clone().append_event(resumed).await {
            Ok(_) => {}
            Err(s) if s.code() == Code::FailedPrecondition => {
                return Err(Status::aborted("the run changed meanwhile; try again"));
            }
            Err(s) => return Err(s),
        }
        self.ex.dispatch(r.run_id.clone());
        tracing::info!(run_id = %r.run_id, "run resumed");
        Ok(Response::new(pb::ResumeRunResponse { status: pb::RunStatus::Pending as i32 }))
    }

    async fn get_trace(&self, req: Request<pb::GetRunRequest>) -> Result<Response<pb::RunTrace>, Status> {
        warden_grpc::auth::check(&req, &req.get_ref().tenant)?;
        let r = req.into_inner();
        id_field("tenant", &r.tenant)?;
        id_field("run_id", &r.run_id)?;
        let (trace, mut dag) = trace_of(&self.ex, &r.tenant, &r.run_id).await?;
        // Child frames nest inside the frame nodes that opened them (each a run of its own),
        // as deep as frames go; a frame's run that cannot be read stays a node of its own. Each
        // run is nested once (a record naming a run twice, or the root, nests nothing more), and
        // at most `MAX_TRACE_FRAMES` runs are: past that the frames stay unopened nodes and the
        // trace says it is cut short (`dag_truncated`).
        let mut nested = std::collections::HashSet::from([r.run_id.clone()]);
        let mut frames = std::collections::HashSet::new();
        let mut truncated = false;
        'depth: for _ in 0..=warden_core::plan::MAX_FRAME_DEPTH {
            let open: Vec<(String, String)> =
                dag.open_frames().into_iter().filter(|(frame, _)| frames.insert(frame.clone())).collect();
            if open.is_empty() {
                break;
            }
            for (frame, child) in open {
                if !nested.insert(child.clone()) {
                    continue;
                }
                if nested.len() > MAX_TRACE_FRAMES + 1 {
                    truncated = true;
                    break 'depth;
                }
                match trace_of(&self.ex, &r.tenant, &child).await {
                    Ok((_, child_dag)) => dag.nest(&frame, child_dag),
                    Err(s) => tracing::warn!(run_id = %r.run_id, child = %child, error = %s, "child frame not nested"),
                }
            }
        }
        let mut json = serde_json::to_value(&trace).map_err(|e| Status::internal(e.to_string()))?;
        json["dag"] = serde_json::to_value(&dag).map_err(|e| Status::internal(e.to_string()))?;
        if truncated {
            json["dag_truncated"] = serde_json::Value::Bool(true);
        }
        let trace_json = json.to_string();
        Ok(Response::new(pb::RunTrace { trace_json }))
    }

    async fn replay_run(&self, req: Request<pb::ReplayRunRequest>) -> Result<Response<pb::ReplayRunResponse>, Status> {
        warden_grpc::auth::check(&req, &req.get_ref().tenant)?;
        let bound = warden_grpc::auth::bound_agent(&req);
        let r = req.into_inner();
        id_field("tenant", &r.tenant)?;
        id_field("run_id", &r.run_id)?;
        let policy = pb::ReplayPolicy::try_from(r.policy)
            .map_err(|_| invalid_field("policy", format!("{} is not a replay policy", r.policy)))?;
        Ok(Response::new(crate::replay::replay_run(&self.ex, &r.tenant, &r.run_id, policy, bound).await?))
    }

    async fn reconcile_step(&self, req: Request<pb::ReconcileStepRequest>) -> Result<Response<pb::Run>, Status> {
        warden_grpc::auth::check(&req, &req.get_ref().tenant)?;
        warden_grpc::auth::forbid_agent(&req, "reconcile outcomes")?;
        // A person's token reconciles as that person, whatever name it gives.
        let person = warden_grpc::auth::bound_person(&req);
        let mut r = req.into_inner();
        if let Some(person) = person {
            r.operator = person;
        }
        id_field("tenant", &r.tenant)?;
        id_field("run_id", &r.run_id)?;
        warden_core::ids::check_step_id(&r.step_id).map_err(|e| invalid_field("step_id", e.to_string()))?;
        if r.operator.is_empty() || r.operator.len() > 256 || r.operator.chars().any(char::is_control) {
            return Err(invalid_field("operator", "name who established the outcome (1-256 characters)"));
        }
        let output = match r.outcome.as_str() {
            "completed" if r.output_json.is_empty() => serde_json::Value::Null,
            "completed" => serde_json::from_str(&r.output_json)
                .map_err(|e| invalid_field("output_json", format!("not valid JSON: {e}")))?,
            "failed" => serde_json::Value::Null,
            other => return Err(invalid_field("outcome", format!("'{other}' is neither 'completed' nor 'failed'"))),
        };
        let mut ledger = self.ex.inner.ledger.clone();
        let get = pb::GetLedgerRunRequest { tenant: r.tenant.clone(), run_id: r.run_id.clone(), with_events: false };
        let run = ledger.get_run(get).await?.into_inner();
        if run.status() != pb::RunStatus::RequiresReconciliation {
            let name = warden_grpc::convert::status_name(run.status);
            return Err(Status::failed_precondition(format!(
                "run {} is {name}, not waiting for reconciliation",
                r.run_id
            )));
        }
        let (view, evs) = load_view(&self.ex, &r.tenant, &r.run_id).await?;
        // A reconciliation whose resume did not go through is completed by asking again.
        let latest_outcome = evs.iter().rev().find(|e| {
            e.step_id == r.step_id && (e.event_type == events::TOOL_COMPLETED || e.event_type == events::TOOL_FAILED)
        });
        let half_done = latest_outcome.is_some_and(|e| {
            let p: serde_json::Value = serde_json::from_str(&e.payload_json).unwrap_or_default();
            p.get("reconciled_by").is_some()
        });
        if !half_done && !view.steps.iter().any(|s| s.id == r.step_id && s.outcome_unknown) {
            return Err(Status::failed_precondition(format!(
                "step '{}' has no call with an unknown outcome",
                r.step_id
            )));
        }
        let requested = evs
            .iter()
            .rev()
            .find(|e| e.event_type == events::TOOL_REQUESTED && e.step_id == r.step_id)
            .ok_or_else(|| Status::internal("the step's tool request is missing"))?;
        let req_payload: serde_json::Value = serde_json::from_str(&requested.payload_json).unwrap_or_default();
        let attempt = req_payload["attempt"].as_u64().unwrap_or(1);
        let mut payload = json!({
            "decision_id": req_payload["decision_id"],
            "attempt": attempt,
            "tool": req_payload["tool"],
            "idempotency_key": req_payload["idempotency_key"],
            "reconciled_by": r.operator,
        });
        let event_type = if r.outcome == "completed" {
            payload["output"] = output;
            events::TOOL_COMPLETED
        } else {
            payload["kind"] = json!("reconciled_failed");
            payload["reason"] = json!(format!("{} established that the call failed", r.operator));
            events::TOOL_FAILED
        };
        let append =
            |event_type: &str, step_id: &str, key: String, payload: serde_json::Value| pb::AppendEventRequest {
                tenant: r.tenant.clone(),
                run_id: r.run_id.clone(),
                epoch: run.max_epoch,
                idempotency_key: key,
                event_type: event_type.to_string(),
                payload_json: payload.to_string(),
                step_id: step_id.to_string(),
            };
        let outcome_key = format!("{}:{}:{attempt}:reconciled", r.run_id, r.step_id);
        ledger.append_event(append(event_type, &r.step_id, outcome_key, payload)).await?;
        let resumed = json!({"reason": format!("step '{}' reconciled by {}", r.step_id, r.operator)});
        let key = format!("resumed:reconciled:{}:{attempt}", r.step_id);
        ledger.append_event(append(events::RUN_RESUMED, "", key, resumed)).await?;
        tracing::info!(run_id = %r.run_id, step_id = %r.step_id, operator = %r.operator, "step reconciled");
        self.ex.dispatch(r.run_id.clone());
        let get = pb::GetRunRequest { tenant: r.tenant, run_id: r.run_id };
        self.get_run(Request::new(get)).await
    }
}

impl RunsService {
    /// What pausing and resuming check first: the fields, the caller's hold on the run (an
    /// agent's token controls only that agent's runs; another tenant's run is NOT_FOUND), and
    /// the run's status and highest epoch as the ledger has them.
    async fn run_control(
        &self,
        tenant: &str,
        run_id: &str,
        reason: &str,
        bound_agent: Option<&str>,
        what: &str,
    ) -> Result<(pb::RunStatus, u64), Status> {
        id_field("tenant", tenant)?;
        id_field("run_id", run_id)?;
        if reason.len() > 1024 || reason.contains('\0') {
            return Err(invalid_field("reason", "at most 1024 bytes of text"));
        }
        if let Some(agent) = bound_agent {
            let (view, _) = load_view(&self.ex, tenant, run_id).await?;
            if view.agent != agent {
                return Err(Status::permission_denied(format!("agent '{agent}' may {what} only its own runs")));
            }
        }
        let get =
            pb::GetLedgerRunRequest { tenant: tenant.to_string(), run_id: run_id.to_string(), with_events: false };
        let run = self.ex.inner.ledger.clone().get_run(get).await?.into_inner();
        Ok((run.status(), run.max_epoch))
    }
}

/// Whether a run waits for nobody but an operator, an approver, whoever resumes it or nothing
/// at all: what `WaitRun` waits for.
fn settled(status: pb::RunStatus) -> bool {
    matches!(status, pb::RunStatus::Blocked | pb::RunStatus::RequiresReconciliation | pb::RunStatus::Paused)
        || warden_grpc::convert::status_from_proto(status).is_some_and(|s| s.is_terminal())
}

/// How many child frames' runs one trace nests at most (each is read whole).
const MAX_TRACE_FRAMES: usize = 100;

/// A run's trace and its execution DAG (its purpose: the goal, or the submitted plan), from
/// its events.
async fn trace_of(
    ex: &crate::Executor,
    tenant: &str,
    run_id: &str,
) -> Result<(warden_core::trace::RunTrace, warden_core::dag::Dag), Status> {
    let (view, evs) = load_view(ex, tenant, run_id).await?;
    let payloads: Vec<serde_json::Value> =
        evs.iter().map(|e| serde_json::from_str(&e.payload_json).unwrap_or_default()).collect();
    let trace_events: Vec<warden_core::trace::TraceEvent<'_>> = evs
        .iter()
        .zip(&payloads)
        .map(|(e, payload)| warden_core::trace::TraceEvent {
            seq: e.seq,
            event_type: &e.event_type,
            step_id: &e.step_id,
            payload,
            timestamp_ms: e.timestamp_ms,
        })
        .collect();
    let trace = warden_core::trace::build(run_id, &trace_events);
    let dag = warden_core::dag::of(&trace, view.goal.as_deref().unwrap_or("the submitted plan"));
    Ok((trace, dag))
}
