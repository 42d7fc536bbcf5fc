//! Maps the `warden.v1.Ledger` gRPC service onto the store.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{Value, json};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};
use warden_core::chain::{ChainBreak, ChainVerifier, ChainedEvent};
use warden_core::events::{self, RunStatus};
use warden_core::ids::{check_id, check_step_id};
use warden_core::receipt::{Receipt, expected_capability, receipt_for};
use warden_core::run::{RunView, StepStatus};
use warden_grpc::convert::{event_to_proto, event_without_payload, status_to_proto, statuses};
use warden_grpc::{invalid_field, now_ms, prefix_field};
use warden_proto::v1 as pb;
use warden_proto::v1::ledger_server::Ledger;

use crate::admit::Admission;
use crate::error::LedgerError;
use crate::follow::{Feed, Followers};
use crate::group::GroupCommit;
use crate::store::{LedgerStore, NewRun, OwnedEvent, RunRow, SummaryRow};

/// Events read per page when streaming or verifying (bounded memory per request).
const PAGE: u32 = 1000;
/// Events buffered per stream before the server waits for a slow consumer.
const STREAM_BUFFER: usize = 256;
/// Most event bytes `GetRun` carries with its run (`with_events`): well under the gRPC message
/// limit whatever the payload limit; a reader streams whatever did not fit.
const EVENTS_WITH_RUN_BYTES: usize = 1 << 20;
/// How long a caught-up follower waits for a published event before it reads the database
/// (events another ledger replica appended are never published here).
const FOLLOW_POLL: Duration = Duration::from_millis(500);

/// Most events one `AppendEvents` call may carry.
pub const MAX_EVENTS_PER_APPEND: usize = 64;
/// Most decisions one `RecordDecisions` call carries.
pub const MAX_DECISIONS_PER_RECORD: usize = 256;

/// Decisions kept in memory to answer the policy's own (late) records of them.
const RECENT_DECISIONS: usize = 65_536;

/// Decision events this replica committed recently, by (run, idempotency key), with their
/// tenant. The executor carries each decision into its append; the policy records the same
/// decision again a little later, off the hot path. Answering that from memory — the same
/// answer the database would give for an identical retry — saves a transaction per step.
#[derive(Default)]
struct RecentDecisions {
    by_key: HashMap<(String, String), (String, Arc<ChainedEvent>)>,
    order: std::collections::VecDeque<(String, String)>,
}

impl RecentDecisions {
    fn remember(&mut self, tenant: &str, e: &Arc<ChainedEvent>) {
        let key = (e.body.run_id.clone(), e.body.idempotency_key.clone());
        if self.by_key.insert(key.clone(), (tenant.to_string(), Arc::clone(e))).is_none() {
            self.order.push_back(key);
        }
        while self.order.len() > RECENT_DECISIONS {
            if let Some(old) = self.order.pop_front() {
                self.by_key.remove(&old);
            }
        }
    }

    /// The recorded event when `new` repeats it exactly (same tenant, type, step, content).
    fn repeat(&self, tenant: &str, r: &pb::AppendEventRequest, payload: &Value) -> Option<Arc<ChainedEvent>> {
        let (t, e) = self.by_key.get(&(r.run_id.clone(), r.idempotency_key.clone()))?;
        let same = t == tenant
            && e.body.event_type == r.event_type
            && e.body.step_id == r.step_id
            // Equal values are the same content (a value written otherwise — `1.0` for `1` —
            // is not taken for a repeat here and goes the database's way).
            && e.body.payload == *payload;
        same.then(|| Arc::clone(e))
    }
}

#[derive(Clone)]
pub struct LedgerService {
    /// The policy's published keys: every `policy_decision` must be signed by one.
    policy_keys: warden_grpc::keyfile::KeyRing,
    policy: Option<warden_proto::v1::policy_client::PolicyClient<warden_grpc::auth::Ch>>,
    store: LedgerStore,
    max_payload_bytes: usize,
    /// Largest output stored by reference (`PutOutput`).
    max_output_bytes: usize,
    max_frames: u64,
    /// Most runs one write of queued submissions holds (`ledger.max_batch`).
    max_batch: usize,
    /// Runs being followed: the write lanes publish each event as it commits, so a follower
    /// that has caught up reads nothing more from the database.
    followers: Arc<Followers>,
    /// Appends go through group commit.
    writer: GroupCommit,
    /// Run submissions wait here, bounded, and are written together.
    admission: Admission,
    recent: Arc<Mutex<RecentDecisions>>,
    /// Digests of recently created runs' plans (run id → (tenant, hex SHA-256 of the plan as
    /// recorded)): a decision asked for while its run was being created names the plan it was
    /// decided against, and is recorded only in a run whose plan has that digest.
    plan_digests: Arc<Mutex<HashMap<String, (String, String)>>>,
    /// Checks the decisions' signatures of concurrent appends together (see
    /// `warden_grpc::verify`).
    verifier: Arc<warden_grpc::verify::Verifier>,
}

/// Plan digests kept in [`LedgerService::plan_digests`] before it is emptied (the first
/// decision of a run comes within milliseconds of its creation; a miss reads the run).
const CACHED_PLAN_DIGESTS: usize = 10_000;

fn id_field(field: &str, v: &str) -> Result<(), Status> {
    check_id(v).map_err(|e| invalid_field(field, e.to_string()))
}

/// A listing's page size: `default` for 0, at most `max` (`field` names it in the refusal).
fn page_size(field: &str, v: u32, default: u32, max: u32) -> Result<u32, Status> {
    match v {
        0 => Ok(default),
        n if n > max => Err(invalid_field(field, format!("must be at most {max}"))),
        n => Ok(n),
    }
}

fn optional_tenant(v: &str) -> Result<Option<&str>, Status> {
    if v.is_empty() {
        return Ok(None);
    }
    id_field("tenant", v)?;
    Ok(Some(v))
}

fn run_to_proto(r: RunRow) -> pb::LedgerRun {
    pb::LedgerRun {
        run_id: r.run_id,
        tenant: r.tenant,
        status: status_to_proto(r.status) as i32,
        reason: r.reason,
        plan_json: r.plan_json,
        goal: r.goal,
        last_seq: r.last_seq,
        head_hash: r.head_hash,
        max_epoch: r.max_epoch,
        created_at_ms: r.created_at_ms,
        updated_at_ms: r.updated_at_ms,
        cancel_policy: r.cancel_policy,
        events: Vec::new(),
    }
}

impl LedgerService {
    /// A child frame's `frame_json`: its shape and bounds, and a parent of the same tenant
    /// that exists. Returns what `run_submitted` records as `frame`.
    async fn check_frame(&self, r: &pb::CreateRunRequest) -> Result<Option<serde_json::Value>, Status> {
        use warden_core::run::FramePosition;
        if r.frame_json.is_empty() {
            return Ok(None);
        }
        let bad = |why: String| invalid_field("frame_json", why);
        // A position is small (at most 8 goal digests): bounded before it is parsed.
        if r.frame_json.len() > 4096 {
            return Err(bad(format!("{} bytes is over the maximum of 4096", r.frame_json.len())));
        }
        let frame: FramePosition =
            serde_json::from_str(&r.frame_json).map_err(|e| bad(format!("not a frame position: {e}")))?;
        let max = frame.max_depth.unwrap_or(0);
        if frame.depth == 0 || max > warden_core::plan::MAX_FRAME_DEPTH || frame.depth > max {
            return Err(bad(format!(
                "depth {} with max_depth {max}: a child frame is 1 ..= max_depth <= {}",
                frame.depth,
                warden_core::plan::MAX_FRAME_DEPTH
            )));
        }
        if frame.goals.len() != frame.depth as usize || frame.goals.iter().any(|g| g.len() != 64) {
            return Err(bad("goals: one SHA-256 (64 hex digits) per frame above".into()));
        }
        if r.goal.is_empty() || frame.parent_run_id != r.parent_run_id || frame.parent_run_id.is_empty() {
            return Err(bad("a child frame is a goal run naming its parent run (parent_run_id)".into()));
        }
        warden_core::ids::check_step_id(&frame.step_id).map_err(|e| bad(format!("step_id: {e}")))?;
        let parent = match self.store.get_run(&frame.parent_run_id).await? {
            Some(parent) if parent.tenant == r.tenant => parent,
            _ => return Err(Status::not_found(format!("parent run '{}'", frame.parent_run_id))),
        };
        if parent.status.is_terminal() {
            return Err(Status::failed_precondition(format!(
                "parent run '{}' ended {}; it opens no frame",
                parent.run_id,
                parent.status.as_str()
            )));
        }
        // The position follows from the parent's own: depth, bound, goals and root.
        let submitted = self.store.events(&parent.run_id, 0, 1).await?;
        let theirs: FramePosition = submitted
            .first()
            .and_then(|e| e.body.payload.get("frame"))
            .and_then(|f| serde_json::from_value(f.clone()).ok())
            .unwrap_or_default();
        let goal = (!parent.goal.is_empty()).then_some(parent.goal.as_str());
        let expected = theirs.child(&parent.run_id, &frame.step_id, goal, max);
        if frame != expected {
            return Err(bad(format!(
                "does not follow from the parent's position (expected {})",
                serde_json::to_string(&expected).unwrap_or_default()
            )));
        }
        serde_json::to_value(&frame).map(Some).map_err(|e| Status::internal(e.to_string()))
    }

    pub fn new(
        store: LedgerStore,
        max_payload_bytes: usize,
        write_lanes: usize,
        max_batch: usize,
        policy_endpoint: &str,
    ) -> Result<LedgerService, Status> {
        // SQLite has one writer: more lanes would only queue on its lock.
        let lanes = if store.backend() == crate::store::Backend::Sqlite { 1 } else { write_lanes };
        let policy = (!policy_endpoint.is_empty())
            .then(|| warden_grpc::channel(policy_endpoint).map(warden_proto::v1::policy_client::PolicyClient::new))
            .transpose()?;
        let followers = Arc::new(Followers::default());
        let defaults = warden_config::LedgerConfig::default();
        let admission =
            Admission::start(store.clone(), defaults.max_pending_runs, defaults.max_pending_run_bytes, max_batch);
        Ok(LedgerService {
            admission,
            max_batch,
            policy_keys: Default::default(),
            policy,
            writer: GroupCommit::start(store.clone(), lanes, max_batch, followers.clone()),
            store,
            max_payload_bytes,
            max_output_bytes: 6 << 20,
            max_frames: 100,
            followers,
            recent: Default::default(),
            plan_digests: Default::default(),
            verifier: Default::default(),
        })
    }

    /// Sets the largest output `PutOutput` stores (`ledger.max_output_bytes`).
    pub fn with_max_output_bytes(mut self, max: usize) -> LedgerService {
        self.max_output_bytes = max;
        self
    }

    /// Bounds the submissions waiting to be recorded (`ledger.max_pending_runs`,
    /// `ledger.max_pending_run_bytes`).
    pub fn with_admission(mut self, max_pending: usize, max_bytes: usize) -> LedgerService {
        self.admission = Admission::start(self.store.clone(), max_pending, max_bytes, self.max_batch);
        self
    }

    /// Most child frames one run tree opens (`ledger.max_frames_per_root`).
    pub fn with_max_frames(mut self, max: u64) -> LedgerService {
        self.max_frames = max;
        self
    }

    fn remember_decisions<'a>(&self, tenant: &str, appended: impl IntoIterator<Item = &'a Arc<ChainedEvent>>) {
        let mut recent = self.recent.lock().unwrap_or_else(|p| p.into_inner());
        for e in appended.into_iter().filter(|e| e.body.event_type == events::POLICY_DECISION) {
            recent.remember(tenant, e);
        }
    }

    /// A decision is recorded only as the policy signed it (see `warden_core::decision`): the
    /// executor carries decisions into its appends, and nobody between may forge or alter one.
    /// `creating` is the digest of the plan of a run being created with the decision.
    async fn check_decision(
        &self,
        (tenant, run_id, step_id): (&str, &str, &str),
        payload: &Value,
        creating: Option<&str>,
    ) -> Result<(), Status> {
        self.check_signed(tenant, run_id, step_id, payload).await?;
        // Decided while the run was being created, against the plan the executor submitted:
        // recorded only in a run whose recorded plan is that one, so a request the ledger
        // acknowledges still proves the call is a step of the recorded plan.
        if let Some(digest) = payload.get("plan_sha256") {
            let recorded = match creating {
                Some(digest) => digest.to_string(),
                None => self.plan_digest(tenant, run_id).await?,
            };
            if digest.as_str() != Some(recorded.as_str()) {
                return Err(Status::permission_denied(
                    "policy_decision refused: decided against a plan that is not the run's recorded plan",
                ));
            }
        }
        Ok(())
    }

    /// A decision record's signature (by a published policy key) and the call it is bound to.
    async fn check_signed(&self, tenant: &str, run_id: &str, step_id: &str, payload: &Value) -> Result<(), Status> {
        let kid = payload.get("key_id").and_then(Value::as_str).unwrap_or_default().to_string();
        if !kid.is_empty() && self.policy_keys.get(&kid).is_none() {
            let Some(policy) = &self.policy else {
                return Err(Status::failed_precondition("no policy endpoint configured: decisions cannot be verified"));
            };
            // A key not seen yet (first decision, or a rotation): ask the policy, once for all
            // the decisions that meet it together.
            self.policy_keys.learn(&kid, || warden_grpc::keyfile::policy_keys(policy)).await.map_err(|e| {
                let why = match e {
                    warden_grpc::keyfile::LearnError::Fetch(s) => s.message().to_string(),
                    other => other.to_string(),
                };
                Status::unavailable(format!("policy keys unavailable; decision not verified: {why}"))
            })?;
        }
        let not_signed =
            |e| Status::permission_denied(format!("policy_decision refused: not as the policy signed it: {e}"));
        let signature =
            warden_core::decision::decision_signature(payload, |id| self.policy_keys.get(id)).map_err(not_signed)?;
        if self.verifier.verify(vec![signature]).await.first() != Some(&true) {
            return Err(not_signed(warden_core::auth::AuthError::BadSignature));
        }
        // The signature covers where the decision belongs: a genuine record of one call cannot
        // be replayed into another run, step or tenant.
        let text = |k: &str| payload.get(k).and_then(Value::as_str).unwrap_or_default();
        if text("tenant") != tenant || text("run_id") != run_id || text("step_id") != step_id {
            return Err(Status::permission_denied(
                "policy_decision refused: the policy signed it for another tenant, run or step",
            ));
        }
        Ok(())
    }

    /// The hex SHA-256 of a run's plan as recorded (of "" for a run with no plan yet).
    async fn plan_digest(&self, tenant: &str, run_id: &str) -> Result<String, Status> {
        if let Some((t, digest)) = self.plan_digests.lock().unwrap_or_else(|p| p.into_inner()).get(run_id)
            && t == tenant
        {
            return Ok(digest.clone());
        }
        let run = self.visible_run(tenant, run_id).await?;
        Ok(warden_core::canonical::sha256_hex(run.plan_json.as_bytes()))
    }

    /// Remembers the digest of a run's plan as recorded (see [`Self::plan_digest`]).
    fn remember_plan(&self, run: &RunRow) {
        // Only a submitted plan: a goal run's plan may be revised.
        if run.plan_json.is_empty() || !run.goal.is_empty() {
            return;
        }
        let digest = warden_core::canonical::sha256_hex(run.plan_json.as_bytes());
        let mut digests = self.plan_digests.lock().unwrap_or_else(|p| p.into_inner());
        if digests.len() >= CACHED_PLAN_DIGESTS {
            digests.clear();
        }
        digests.insert(run.run_id.clone(), (run.tenant.clone(), digest));
    }

    /// Keeps a decision that no run's chain may hold (see `store::unbound`): its run does not
    /// exist, or was recorded with another plan than the one the decision was made against.
    /// Its signature and binding verify as any record's do; anything else is `refused` as it was.
    async fn keep_unbound(&self, d: &pb::AppendEventRequest, refused: Status) -> Result<(), Status> {
        id_field("tenant", &d.tenant)?;
        id_field("run_id", &d.run_id)?;
        check_step_id(&d.step_id).map_err(|e| invalid_field("step_id", e.to_string()))?;
        let payload = self.parse_payload("payload_json", &d.payload_json)?;
        // Signature and binding as for any record; the plan digest it may name has no run
        // to be checked against.
        self.check_signed(&d.tenant, &d.run_id, &d.step_id, &payload).await?;
        let stray = match self.store.get_run(&d.run_id).await? {
            None => true,
            // Not another tenant's run, nor a refusal for any other reason.
            Some(run) => {
                run.tenant == d.tenant
                    && payload
                        .get("plan_sha256")
                        .and_then(Value::as_str)
                        .is_some_and(|digest| digest != warden_core::canonical::sha256_hex(run.plan_json.as_bytes()))
            }
        };
        if !stray {
            return Err(refused);
        }
        let text = |k: &str| payload.get(k).and_then(Value::as_str).unwrap_or_default().to_string();
        let decision_id = text("decision_id");
        id_field("decision_id", &decision_id)?;
        if events::decision_key(&decision_id) != d.idempotency_key {
            return Err(invalid_field("idempotency_key", "a decision's key names its decision id"));
        }
        let kept = crate::store::UnboundDecision {
            seq: 0,
            tenant: d.tenant.clone(),
            run_id: d.run_id.clone(),
            step_id: d.step_id.clone(),
            decision_id,
            payload_json: d.payload_json.clone(),
            recorded_at_ms: now_ms(),
        };
        self.store.put_unbound_decision(&kept).await?;
        tracing::info!(run_id = %d.run_id, decision_id = %kept.decision_id, "decision kept apart: its run was never created");
        Ok(())
    }

    /// Validates one event of an append request (or of a creation: `creating` is the digest of
    /// the plan being recorded); returns its parsed payload.
    async fn check_event(
        &self,
        (tenant, run_id, creating): (&str, &str, Option<&str>),
        key: &str,
        event_type: &str,
        payload_json: &str,
        step_id: &str,
    ) -> Result<Value, Status> {
        id_field("idempotency_key", key)?;
        // Run creation, summaries and transactions have their own RPCs, which validate them.
        let own_rpc = [
            events::RUN_SUBMITTED,
            events::RUN_SUMMARY,
            events::TX_PROPOSED,
            events::TX_COMMITTED,
            events::TX_ROLLED_BACK,
        ];
        if !events::KNOWN.contains(&event_type) || own_rpc.contains(&event_type) {
            return Err(invalid_field(
                "event_type",
                format!("'{event_type}' is not an event type that can be appended"),
            ));
        }
        if !step_id.is_empty() {
            check_step_id(step_id).map_err(|e| invalid_field("step_id", e.to_string()))?;
        }
        let payload = self.parse_payload("payload_json", payload_json)?;
        if event_type == events::POLICY_DECISION {
            self.check_decision((tenant, run_id, step_id), &payload, creating).await?;
        }
        Ok(payload)
    }

    /// The first events a creation carries (`CreateRunRequest.first_events`), checked as an
    /// append checks them. A request that cannot carry them, or an event that is not one the
    /// mesh would send (a malformed payload included), refuses the whole creation
    /// (`INVALID_ARGUMENT`); a refusal of what they say (a decision not as the policy signed it,
    /// its keys unreachable) leaves them out of a run created all the same, saying why.
    async fn first_events(
        &self,
        r: &pb::CreateRunRequest,
        run_id: &str,
        plan: Option<&Value>,
        frame: bool,
        now: i64,
    ) -> Result<Result<Vec<OwnedEvent>, Status>, Status> {
        if r.first_events.is_empty() {
            return Ok(Ok(Vec::new()));
        }
        if r.first_events.len() > MAX_EVENTS_PER_APPEND {
            return Err(invalid_field("first_events", format!("at most {MAX_EVENTS_PER_APPEND} events")));
        }
        let Some(plan) = plan.filter(|_| !r.started_by.is_empty() && !frame) else {
            return Err(invalid_field(
                "first_events",
                "only a run started with its plan (started_by, plan_json, no frame) records its first step with it",
            ));
        };
        let digest = warden_core::canonical::sha256_hex(warden_core::canonical_json(plan).as_bytes());
        let mut group = Vec::with_capacity(r.first_events.len());
        for (i, e) in r.first_events.iter().enumerate() {
            if !crate::store::FIRST_EVENT_TYPES.contains(&e.event_type.as_str()) {
                return Err(invalid_field(
                    format!("first_events[{i}].event_type"),
                    format!("a run's first events are {}", crate::store::FIRST_EVENT_TYPES.join(", ")),
                ));
            }
            let checked = self
                .check_event(
                    (&r.tenant, run_id, Some(&digest)),
                    &e.idempotency_key,
                    &e.event_type,
                    &e.payload_json,
                    &e.step_id,
                )
                .await
                .map_err(|s| prefix_field(s, &format!("first_events[{i}].")));
            let payload = match checked {
                Ok(p) => p,
                Err(s) if s.code() == tonic::Code::InvalidArgument => return Err(s),
                Err(s) => return Ok(Err(s)),
            };
            group.push(OwnedEvent {
                tenant: r.tenant.clone(),
                run_id: run_id.to_string(),
                epoch: r.epoch,
                idempotency_key: e.idempotency_key.clone(),
                event_type: e.event_type.clone(),
                payload,
                step_id: e.step_id.clone(),
                now_ms: now,
            });
        }
        Ok(Ok(group))
    }

    /// The answer for one appended event (with the request acknowledgement of a
    /// `tool_requested`: the tool host's proof that the call is on the record before it acts).
    fn appended(&self, tenant: &str, event: &ChainedEvent, deduplicated: bool) -> pb::AppendEventResponse {
        self.answer(tenant, event, deduplicated, false)
    }

    /// [`Self::appended`], without the event's payload when `brief` (the caller asked so).
    fn answer(&self, tenant: &str, event: &ChainedEvent, deduplicated: bool, brief: bool) -> pb::AppendEventResponse {
        let request_ack = (event.body.event_type == events::TOOL_REQUESTED)
            .then(|| warden_grpc::convert::claims_to_wire(self.store.acknowledge(tenant, event)));
        let event = if brief { event_without_payload(event) } else { event_to_proto(event) };
        pb::AppendEventResponse { event: Some(event), deduplicated, request_ack }
    }

    /// Records one event as `AppendEvent` does; a `policy_decision` this replica committed
    /// lately is answered from memory.
    async fn append_one(&self, r: pb::AppendEventRequest) -> Result<pb::AppendEventResponse, Status> {
        id_field("tenant", &r.tenant)?;
        id_field("run_id", &r.run_id)?;
        if r.event_type == events::POLICY_DECISION {
            // Parsed before the lock: the lock is held only for the lookup.
            let payload: Option<Value> = serde_json::from_str(&r.payload_json).ok();
            let known =
                payload.and_then(|p| self.recent.lock().unwrap_or_else(|x| x.into_inner()).repeat(&r.tenant, &r, &p));
            if let Some(event) = known {
                return Ok(self.appended(&r.tenant, &event, true));
            }
        }
        let payload = self
            .check_event((&r.tenant, &r.run_id, None), &r.idempotency_key, &r.event_type, &r.payload_json, &r.step_id)
            .await?;
        let (event, deduplicated) =
            self.append(&r.tenant, &r.run_id, r.epoch, &r.idempotency_key, &r.event_type, payload, &r.step_id).await?;
        self.remember_decisions(&r.tenant, [&event]);
        Ok(self.appended(&r.tenant, &event, deduplicated))
    }

    pub fn store(&self) -> &LedgerStore {
        &self.store
    }

    /// What a caller that is not the mesh may write: never above the run's current epoch (only
    /// lease holders raise it, or a tenant could fence out the executor driving the run), and
    /// for an agent's token only to its own agent's runs (the agent is fixed at submission).
    async fn caller_may_write<T>(
        &self,
        req: &Request<T>,
        tenant: &str,
        run_id: &str,
        epoch: u64,
    ) -> Result<(), Status> {
        if warden_grpc::auth::is_mesh(req) {
            return Ok(());
        }
        id_field("run_id", run_id)?;
        let run = self.visible_run(tenant, run_id).await?;
        if epoch > run.max_epoch {
            return Err(Status::permission_denied(format!(
                "epoch {epoch} is above the run's {}; only the mesh's lease holders raise it",
                run.max_epoch
            )));
        }
        let Some(agent) = warden_grpc::auth::bound_agent(req) else { return Ok(()) };
        let first = self.store.events(&run.run_id, 0, 1).await?;
        let owner = first.first().and_then(|e| e.body.payload.get("agent")).and_then(Value::as_str).unwrap_or("");
        if owner != agent {
            return Err(Status::permission_denied(format!("agent '{agent}' may write only to its own runs")));
        }
        Ok(())
    }

    fn parse_payload(&self, field: &str, json: &str) -> Result<Value, Status> {
        if json.len() > self.max_payload_bytes {
            return Err(invalid_field(
                field,
                format!("{} bytes is over the maximum of {}", json.len(), self.max_payload_bytes),
            ));
        }
        let v: Value = serde_json::from_str(json).map_err(|e| invalid_field(field, format!("not valid JSON: {e}")))?;
        if !v.is_object() {
            return Err(invalid_field(field, "must be a JSON object"));
        }
        Ok(v)
    }

    /// Appends one event for the RPCs (serialized per run; the lane publishes it to followers).
    #[allow(clippy::too_many_arguments)]
    async fn append(
        &self,
        tenant: &str,
        run_id: &str,
        epoch: u64,
        idempotency_key: &str,
        event_type: &str,
        payload: Value,
        step_id: &str,
    ) -> Result<(Arc<ChainedEvent>, bool), LedgerError> {
        // Epochs are stored as BIGINT: one above i64::MAX would wrap negative and leave the
        // run undrivable for good.
        if i64::try_from(epoch).is_err() {
            return Err(LedgerError::invalid("epoch", format!("{epoch} is over the maximum of {}", i64::MAX)));
        }
        let appended = self
            .writer
            .append(OwnedEvent {
                tenant: tenant.to_string(),
                run_id: run_id.to_string(),
                epoch,
                idempotency_key: idempotency_key.to_string(),
                event_type: event_type.to_string(),
                payload,
                step_id: step_id.to_string(),
                now_ms: now_ms(),
            })
            .await?;
        Ok(appended)
    }

    /// Appends a `run_summary` of `summary_type`.
    async fn summary(
        &self,
        base: (&str, &str, u64, &str),
        summary_type: &str,
        payload: Value,
        step_id: &str,
    ) -> Result<pb::Summary, Status> {
        let (tenant, run_id, epoch, key) = base;
        id_field("tenant", tenant)?;
        id_field("run_id", run_id)?;
        id_field("idempotency_key", key)?;
        let ok = !summary_type.is_empty()
            && summary_type.len() <= 160
            && summary_type.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | ':' | '-'));
        if !ok {
            return Err(invalid_field(
                "summary_type",
                "must be 1-160 characters of letters, digits, '_', '.', ':' or '-'",
            ));
        }
        if !step_id.is_empty() {
            check_step_id(step_id).map_err(|e| invalid_field("step_id", e.to_string()))?;
        }
        let body = json!({"summary_type": summary_type, "payload": payload});
        let (e, _) = self.append(tenant, run_id, epoch, key, events::RUN_SUMMARY, body, step_id).await?;
        Ok(summary_to_proto(&e))
    }

    /// Parses a JSON value of at most `max` bytes.
    fn parse_value(&self, field: &str, json: &str, max: usize) -> Result<Value, Status> {
        if json.len() > max {
            return Err(invalid_field(field, format!("{} bytes is over the maximum of {max}", json.len())));
        }
        serde_json::from_str(json).map_err(|e| invalid_field(field, format!("not valid JSON: {e}")))
    }

    async fn tx_outcome(&self, e: &ChainedEvent, status: &str) -> Result<pb::TxOutcome, Status> {
        let receipt = self
            .store
            .receipts(&e.body.run_id, None, e.body.seq.saturating_sub(1), 1)
            .await?
            .into_iter()
            .find(|r| r.seq == e.body.seq);
        Ok(pb::TxOutcome { status: status.into(), receipt: receipt.map(receipt_to_proto) })
    }

    /// A run visible to `tenant` (any run when `tenant` is empty: internal callers).
    async fn visible_run(&self, tenant: &str, run_id: &str) -> Result<RunRow, Status> {
        let tenant = optional_tenant(tenant)?;
        id_field("run_id", run_id)?;
        match self.store.get_run(run_id).await? {
            Some(r) if tenant.is_none_or(|t| t == r.tenant) => Ok(r),
            _ => Err(LedgerError::NotFound(format!("run '{run_id}'")).into()),
        }
    }

    /// Recomputes the chain of a run page by page and checks the run's recorded head.
    pub async fn verify(&self, run: &RunRow) -> Result<pb::VerifyRunResponse, LedgerError> {
        let invalid = |events: u64, first_bad_seq: u64, reason: String| pb::VerifyRunResponse {
            valid: false,
            events,
            first_bad_seq,
            reason,
            head_hash: String::new(),
        };
        // Receipts are derived from outcome events: each must match its event, once.
        let mut receipts: HashMap<u64, Receipt> = HashMap::new();
        let mut after = 0;
        loop {
            let page = self.store.receipts(&run.run_id, None, after, 10_000).await?;
            let full = page.len() == 10_000;
            after = page.last().map(|r| r.seq).unwrap_or(after);
            for r in page.into_iter().filter(|r| r.seq <= run.last_seq) {
                let seq = r.seq;
                if receipts.insert(seq, r).is_some() {
                    return Ok(invalid(0, seq, "two receipts for one outcome event".into()));
                }
            }
            if !full {
                break;
            }
        }
        let mut v = ChainVerifier::default();
        // Decision id → capability, so each receipt's capability is checked against the
        // decision its event cites (both are in the chain), not taken from the receipt.
        let mut decisions: HashMap<String, String> = HashMap::new();
        let mut since = 0;
        loop {
            // Only up to the head read above: an active run may grow while we verify.
            let mut page = self.store.events(&run.run_id, since, PAGE).await?;
            let n = page.len();
            page.retain(|e| e.body.seq <= run.last_seq);
            // Hashing a long chain is CPU work: keep it off the async workers.
            let (verifier, left, known, result) = tokio::task::spawn_blocking(move || {
                let r = page.iter().try_for_each(|e| {
                    v.push(e)?;
                    note_decision(e, &mut decisions);
                    check_receipt(e, &mut receipts, &decisions)
                });
                (v, receipts, decisions, r)
            })
            .await
            .map_err(|e| LedgerError::Internal(e.to_string()))?;
            (v, receipts, decisions) = (verifier, left, known);
            if let Err(b) = result {
                return Ok(invalid(v.verified(), b.seq, b.reason));
            }
            since = v.verified();
            if n < PAGE as usize {
                break;
            }
        }
        let (count, head) = (v.verified(), v.head().to_string());
        if count != run.last_seq || head != run.head_hash {
            let reason = if count < run.last_seq {
                format!("run records {} events but only {count} are stored", run.last_seq)
            } else {
                "stored events do not end at the run's recorded head".to_string()
            };
            return Ok(invalid(count, count.min(run.last_seq) + 1, reason));
        }
        if let Some(seq) = receipts.keys().min() {
            return Ok(invalid(count, *seq, "a receipt cites no outcome event".into()));
        }
        if !self.store.head_proof_verifies(run) {
            return Ok(invalid(count, count, "the chain head's signature does not verify".into()));
        }
        Ok(pb::VerifyRunResponse {
            valid: true,
            events: count,
            first_bad_seq: 0,
            reason: String::new(),
            head_hash: head,
        })
    }
}

/// Checks the stored receipt of an outcome event (and that a non-outcome event has none).
fn note_decision(e: &ChainedEvent, decisions: &mut HashMap<String, String>) {
    if e.body.event_type == events::POLICY_DECISION {
        let field = |k: &str| e.body.payload.get(k).and_then(Value::as_str).unwrap_or_default().to_string();
        decisions.insert(field("decision_id"), field("capability_id"));
    }
}

fn check_receipt(
    e: &ChainedEvent,
    receipts: &mut HashMap<u64, Receipt>,
    decisions: &HashMap<String, String>,
) -> Result<(), ChainBreak> {
    let seq = e.body.seq;
    let stored = receipts.remove(&seq);
    let expected = receipt_for(e, &expected_capability(e, decisions));
    match (expected, stored) {
        (None, None) => Ok(()),
        (Some(x), Some(s)) if x == s => Ok(()),
        (Some(_), None) => Err(ChainBreak { seq, reason: "tool call outcome has no receipt".into() }),
        (None, Some(_)) => Err(ChainBreak { seq, reason: "receipt for an event that is no outcome".into() }),
        (Some(_), Some(_)) => Err(ChainBreak { seq, reason: "receipt does not match its event".into() }),
    }
}

fn summary_to_proto(e: &ChainedEvent) -> pb::Summary {
    let p = &e.body.payload;
    pb::Summary {
        run_id: e.body.run_id.clone(),
        seq: e.body.seq,
        summary_type: p.get("summary_type").and_then(Value::as_str).unwrap_or_default().to_string(),
        payload_json: warden_core::canonical_json(p.get("payload").unwrap_or(&Value::Null)),
        timestamp_ms: e.body.timestamp_ms,
        step_id: e.body.step_id.clone(),
    }
}

fn row_to_summary(run_id: &str, r: SummaryRow) -> pb::Summary {
    pb::Summary {
        run_id: run_id.to_string(),
        seq: r.seq,
        summary_type: r.summary_type,
        payload_json: r.payload_json,
        timestamp_ms: r.timestamp_ms,
        step_id: r.step_id,
    }
}

/// Largest artifact value accepted.
pub const MAX_ARTIFACT_BYTES: usize = 256 * 1024;

fn receipt_to_proto(r: Receipt) -> pb::Receipt {
    pb::Receipt {
        receipt_id: r.receipt_id,
        run_id: r.run_id,
        trace_id: r.trace_id,
        span_id: r.span_id,
        job_id: r.job_id,
        tx_id: r.tx_id,
        capability_id: r.capability_id,
        policy_decision: r.policy_decision,
        action_type: r.action_type,
        timestamp_ms: r.timestamp_ms,
        status: r.status,
        hash: r.hash,
        step_id: r.step_id,
        attempt: r.attempt,
        seq: r.seq,
        event_hash: r.event_hash,
        reason: r.reason,
    }
}

#[tonic::async_trait]
impl Ledger for LedgerService {
    async fn create_run(&self, req: Request<pb::CreateRunRequest>) -> Result<Response<pb::CreateRunResponse>, Status> {
        warden_grpc::auth::check(&req, &req.get_ref().tenant)?;
        // Runs enter the ledger only through `Runs.SubmitRun`, whose executor has the planner
        // validate the plan (steps, size, tools) first: a tenant writing here directly could
        // record a plan the planner would refuse and have the executor run it.
        warden_grpc::auth::require_mesh(&req, "CreateRun (submit runs through Runs.SubmitRun)")?;
        let agent = warden_grpc::auth::agent(&req, &req.get_ref().agent)?;
        let r = req.into_inner();
        let size = prost::Message::encoded_len(&r);
        id_field("tenant", &r.tenant)?;
        if !r.idempotency_key.is_empty() {
            id_field("idempotency_key", &r.idempotency_key)?;
        }
        if !agent.is_empty() {
            id_field("agent", &agent)?;
        }
        let plan = match (r.plan_json.is_empty(), r.goal.is_empty()) {
            (false, true) => {
                let plan = self.parse_payload("plan_json", &r.plan_json)?;
                // Even the mesh records only something that is a plan.
                warden_core::plan::Plan::parse(&r.plan_json).map_err(|e| invalid_field(e.field(), e.to_string()))?;
                Some(plan)
            }
            (true, false) => None,
            _ => {
                return Err(invalid_field("plan_json", "exactly one of plan_json and goal must be set"));
            }
        };
        if r.goal.len() > self.max_payload_bytes {
            return Err(invalid_field("goal", format!("over the maximum of {} bytes", self.max_payload_bytes)));
        }
        pb::CancelPolicy::try_from(r.cancel_policy)
            .map_err(|_| invalid_field("cancel_policy", "unknown cancel policy"))?;
        pb::ReplayPolicy::try_from(r.replay_policy)
            .map_err(|_| invalid_field("replay_policy", "unknown replay policy"))?;
        if !r.parent_run_id.is_empty() {
            id_field("parent_run_id", &r.parent_run_id)?;
        }
        // A place in the queue of submissions first, before anything is read or prepared: a
        // full queue refuses at once, having done nothing.
        let place = self.admission.admit(size)?;
        let frame = self.check_frame(&r).await?;
        let run_id = if r.run_id.is_empty() {
            uuid::Uuid::now_v7().to_string()
        } else {
            id_field("run_id", &r.run_id)?;
            r.run_id.clone()
        };
        if !r.started_by.is_empty() {
            id_field("started_by", &r.started_by)?;
            if r.epoch == 0 || i64::try_from(r.epoch).is_err() {
                return Err(invalid_field("epoch", "a lease's epoch, from 1 to 2^63-1"));
            }
        }
        let now = now_ms();
        let (first, unchecked) = match self.first_events(&r, &run_id, plan.as_ref(), frame.is_some(), now).await? {
            Ok(group) => (group, None),
            Err(refused) => (Vec::new(), Some(refused)),
        };
        let prepared = self.store.prepare_run(NewRun {
            run_id: &run_id,
            tenant: &r.tenant,
            agent: &agent,
            plan: plan.as_ref(),
            goal: &r.goal,
            idempotency_key: &r.idempotency_key,
            cancel_policy: r.cancel_policy,
            now_ms: now,
            started_by: (!r.started_by.is_empty()).then_some((r.started_by.as_str(), r.epoch)),
            replay_policy: r.replay_policy,
            parent_run_id: &r.parent_run_id,
            frame: frame.clone(),
            max_frames: self.max_frames,
            first,
        });
        let created = self.admission.create(place, prepared).await?;
        let (run, deduplicated) = (created.run, created.deduplicated);
        let (first_appended, first_refused): (Vec<_>, _) = match created.first {
            _ if deduplicated => (Vec::new(), None),
            _ if unchecked.is_some() => (Vec::new(), unchecked),
            Ok(appended) => {
                self.remember_decisions(&run.tenant, &appended);
                (appended.iter().map(|e| self.answer(&run.tenant, e, false, true)).collect(), None)
            }
            Err(e) => (Vec::new(), Some(Status::from(e))),
        };
        if !deduplicated {
            warden_telemetry::metrics::ledger_run_created(match (&first_refused, first_appended.is_empty()) {
                (Some(_), _) => "refused",
                (None, false) => "recorded",
                (None, true) => "none",
            });
        }
        // A frame's key found another run: it is that frame only if it was created as it.
        if deduplicated && let Some(frame) = &frame {
            let first = self.store.events(&run.run_id, 0, 1).await?;
            if first.first().and_then(|e| e.body.payload.get("frame")) != Some(frame) {
                return Err(Status::failed_precondition(format!(
                    "idempotency key '{}' names run {}, which is not this frame",
                    r.idempotency_key, run.run_id
                )));
            }
        }
        // Only a run submitted with its plan: a goal run's plan may be revised, and an
        // acknowledgement never expires.
        self.remember_plan(&run);
        let run_ack = (!run.plan_json.is_empty() && run.goal.is_empty()).then(|| {
            warden_grpc::convert::claims_to_wire(self.store.acknowledge_run(&run.tenant, &run.run_id, &run.plan_json))
        });
        Ok(Response::new(pb::CreateRunResponse {
            run: Some(run_to_proto(run)),
            deduplicated,
            run_ack,
            first_appended,
            first_events_code: first_refused.as_ref().map(|s| s.code() as i32).unwrap_or_default(),
            first_events_message: first_refused.map(|s| s.message().to_string()).unwrap_or_default(),
        }))
    }

    async fn append_event(
        &self,
        req: Request<pb::AppendEventRequest>,
    ) -> Result<Response<pb::AppendEventResponse>, Status> {
        warden_grpc::auth::check(&req, &req.get_ref().tenant)?;
        // Decisions, tool outcomes and run transitions record what the mesh decided and did:
        // only its services (and operators) write them, never a tenant's or an agent's token.
        warden_grpc::auth::require_mesh(&req, "AppendEvent")?;
        self.append_one(req.into_inner()).await.map(Response::new)
    }

    async fn record_decisions(
        &self,
        req: Request<pb::RecordDecisionsRequest>,
    ) -> Result<Response<pb::RecordDecisionsResponse>, Status> {
        // Decisions of any tenant: the policy's (and operators') alone.
        warden_grpc::auth::require_mesh(&req, "RecordDecisions")?;
        let r = req.into_inner();
        if r.decisions.is_empty() || r.decisions.len() > MAX_DECISIONS_PER_RECORD {
            return Err(invalid_field("decisions", format!("1 to {MAX_DECISIONS_PER_RECORD} decisions")));
        }
        for (i, d) in r.decisions.iter().enumerate() {
            if d.event_type != events::POLICY_DECISION {
                return Err(invalid_field(
                    format!("decisions[{i}].event_type"),
                    format!("must be '{}'", events::POLICY_DECISION),
                ));
            }
        }
        // Each on its own (one refused decision refuses no other), all at once: those not
        // answered from memory share the write lanes' commits.
        let results = futures::future::join_all(r.decisions.into_iter().map(|d| async move {
            match self.append_one(d.clone()).await {
                // No such run (its creation failed after its first decision was asked for), or
                // not with the plan it was decided against: kept apart, so the decision is in
                // the ledger all the same (K03).
                Err(s) if matches!(s.code(), tonic::Code::NotFound | tonic::Code::PermissionDenied) => {
                    self.keep_unbound(&d, s).await
                }
                other => other.map(|_| ()),
            }
        }))
        .await;
        let results = results
            .into_iter()
            .map(|r| match r {
                Ok(_) => pb::DecisionRecorded { code: tonic::Code::Ok as i32, message: String::new(), fenced: false },
                Err(s) => pb::DecisionRecorded {
                    code: s.code() as i32,
                    fenced: warden_grpc::is_fenced(&s),
                    message: s.message().to_string(),
                },
            })
            .collect();
        Ok(Response::new(pb::RecordDecisionsResponse { results }))
    }

    async fn list_unbound_decisions(
        &self,
        req: Request<pb::ListUnboundDecisionsRequest>,
    ) -> Result<Response<pb::ListUnboundDecisionsResponse>, Status> {
        warden_grpc::auth::check(&req, &req.get_ref().tenant)?;
        let r = req.into_inner();
        let tenant = optional_tenant(&r.tenant)?;
        let size = page_size("page_size", r.page_size, 100, 1000)?;
        // The cursor is the order number of the last decision of a page.
        let after = match r.page_token.as_str() {
            "" => 0,
            t => t.parse::<u64>().map_err(|_| invalid_field("page_token", "not a page token this ledger gave"))?,
        };
        let decisions = self.store.unbound_decisions(tenant, after, size).await?;
        let next_page_token = match decisions.last() {
            Some(d) if decisions.len() == size as usize => d.seq.to_string(),
            _ => String::new(),
        };
        Ok(Response::new(pb::ListUnboundDecisionsResponse {
            decisions: decisions
                .into_iter()
                .map(|d| pb::UnboundDecision {
                    tenant: d.tenant,
                    run_id: d.run_id,
                    step_id: d.step_id,
                    decision_id: d.decision_id,
                    payload_json: d.payload_json,
                    recorded_at_ms: d.recorded_at_ms,
                })
                .collect(),
            next_page_token,
        }))
    }

    async fn append_events(
        &self,
        req: Request<pb::AppendEventsRequest>,
    ) -> Result<Response<pb::AppendEventsResponse>, Status> {
        warden_grpc::auth::check(&req, &req.get_ref().tenant)?;
        warden_grpc::auth::require_mesh(&req, "AppendEvents")?;
        let r = req.into_inner();
        id_field("tenant", &r.tenant)?;
        id_field("run_id", &r.run_id)?;
        if r.events.is_empty() || r.events.len() > MAX_EVENTS_PER_APPEND {
            return Err(invalid_field("events", format!("1 to {MAX_EVENTS_PER_APPEND} events")));
        }
        if i64::try_from(r.epoch).is_err() {
            return Err(invalid_field("epoch", format!("{} is over the maximum of {}", r.epoch, i64::MAX)));
        }
        let now = now_ms();
        let mut group = Vec::with_capacity(r.events.len());
        for (i, e) in r.events.into_iter().enumerate() {
            let payload = self
                .check_event(
                    (&r.tenant, &r.run_id, None),
                    &e.idempotency_key,
                    &e.event_type,
                    &e.payload_json,
                    &e.step_id,
                )
                .await
                .map_err(|s| prefix_field(s, &format!("events[{i}].")))?;
            group.push(OwnedEvent {
                tenant: r.tenant.clone(),
                run_id: r.run_id.clone(),
                epoch: r.epoch,
                idempotency_key: e.idempotency_key,
                event_type: e.event_type,
                payload,
                step_id: e.step_id,
                now_ms: now,
            });
        }
        let appended = self.writer.append_group(group).await?;
        self.remember_decisions(&r.tenant, appended.iter().map(|(e, _)| e));
        Ok(Response::new(pb::AppendEventsResponse {
            appended: appended.iter().map(|(e, dup)| self.answer(&r.tenant, e, *dup, r.brief)).collect(),
        }))
    }

    async fn get_run(&self, req: Request<pb::GetLedgerRunRequest>) -> Result<Response<pb::LedgerRun>, Status> {
        warden_grpc::auth::check(&req, &req.get_ref().tenant)?;
        let r = req.into_inner();
        let run = self.visible_run(&r.tenant, &r.run_id).await?;
        if !r.with_events {
            return Ok(Response::new(run_to_proto(run)));
        }
        // Read after the row, whose last_seq the events reach (a batch commits its events and
        // the head together); a later append may show too, as on a stream.
        let page = self.store.events(&run.run_id, 0, PAGE).await?;
        let mut answer = run_to_proto(run);
        // The row counts too (its plan and goal are each up to the payload limit), so the
        // reply stays under the message limit whatever that limit is configured to.
        let budget = EVENTS_WITH_RUN_BYTES
            .min(warden_grpc::MAX_MESSAGE_BYTES.saturating_sub(prost::Message::encoded_len(&answer) + (64 << 10)));
        let mut bytes = 0;
        for e in &page {
            let e = event_to_proto(e);
            // Each element's tag and length prefix included.
            bytes += prost::Message::encoded_len(&e) + 8;
            if bytes > budget {
                break;
            }
            answer.events.push(e);
        }
        Ok(Response::new(answer))
    }

    async fn list_runs(
        &self,
        req: Request<pb::ListLedgerRunsRequest>,
    ) -> Result<Response<pb::ListLedgerRunsResponse>, Status> {
        warden_grpc::auth::check(&req, &req.get_ref().tenant)?;
        let r = req.into_inner();
        let tenant = optional_tenant(&r.tenant)?;
        let wanted = statuses("statuses", &r.statuses)?;
        if !r.page_token.is_empty() {
            id_field("page_token", &r.page_token)?;
        }
        let size = page_size("page_size", r.page_size, 100, 1000)?;
        let runs = self.store.list_runs(tenant, &wanted, &r.page_token, size).await?;
        let next_page_token = if runs.len() == size as usize {
            runs.last().map(|r| r.run_id.clone()).unwrap_or_default()
        } else {
            String::new()
        };
        Ok(Response::new(pb::ListLedgerRunsResponse {
            runs: runs.into_iter().map(run_to_proto).collect(),
            next_page_token,
        }))
    }

    type StreamEventsStream = ReceiverStream<Result<pb::Event, Status>>;

    async fn stream_events(
        &self,
        req: Request<pb::StreamEventsRequest>,
    ) -> Result<Response<Self::StreamEventsStream>, Status> {
        warden_grpc::auth::check(&req, &req.get_ref().tenant)?;
        let r = req.into_inner();
        let run = self.visible_run(&r.tenant, &r.run_id).await?;
        let (tx, rx) = tokio::sync::mpsc::channel(STREAM_BUFFER);
        let this = self.clone();
        tokio::spawn(async move {
            // Subscribed once caught up (then read once more, so nothing committed in between
            // is missed): a stream that only reads, or is still catching up, holds no feed.
            let mut feed: Option<Feed> = None;
            let mut since = r.since_seq;
            let stream = async {
                loop {
                    let page = match this.store.events(&run.run_id, since, PAGE).await {
                        Ok(p) => p,
                        Err(e) => {
                            let _ = tx.send(Err(e.into())).await;
                            return;
                        }
                    };
                    let full = page.len() == PAGE as usize;
                    for e in &page {
                        since = e.body.seq;
                        // `send` waits while the client is slow: memory stays bounded.
                        if tx.send(Ok(event_to_proto(e))).await.is_err() {
                            return;
                        }
                    }
                    if full {
                        continue;
                    }
                    if !r.follow {
                        return;
                    }
                    let ended = page
                        .last()
                        .and_then(|e| events::status_after(&e.body.event_type))
                        .is_some_and(RunStatus::is_terminal);
                    if ended {
                        return;
                    }
                    if page.is_empty() {
                        match this.store.get_run(&run.run_id).await {
                            Ok(Some(cur)) if cur.status.is_terminal() && cur.last_seq <= since => {
                                return;
                            }
                            Err(e) => {
                                let _ = tx.send(Err(e.into())).await;
                                return;
                            }
                            _ => {}
                        }
                    }
                    let Some(live) = feed.as_mut() else {
                        feed = Some(this.followers.follow(&run.run_id));
                        continue;
                    };
                    // Caught up: follow from memory, in order, until something is missing — a
                    // gap (events another replica wrote, never published here), a follower
                    // fallen behind the feed, or a quiet spell — then read the database again.
                    // (The feed cannot close: its sender stays while this receiver exists.)
                    loop {
                        tokio::select! {
                            got = live.recv() => match got {
                                Ok(e) if e.body.seq <= since => {}
                                Ok(e) if e.body.seq == since + 1 => {
                                    since = e.body.seq;
                                    if tx.send(Ok(event_to_proto(&e))).await.is_err() {
                                        return;
                                    }
                                    if events::status_after(&e.body.event_type).is_some_and(RunStatus::is_terminal) {
                                        return;
                                    }
                                }
                                Ok(_) | Err(_) => break,
                            },
                            _ = tokio::time::sleep(FOLLOW_POLL) => break,
                            _ = tx.closed() => return,
                        }
                    }
                }
            };
            stream.await;
            if feed.take().is_some() {
                this.followers.unfollow(&run.run_id);
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn verify_run(&self, req: Request<pb::VerifyRunRequest>) -> Result<Response<pb::VerifyRunResponse>, Status> {
        warden_grpc::auth::check(&req, &req.get_ref().tenant)?;
        let r = req.into_inner();
        let run = self.visible_run(&r.tenant, &r.run_id).await?;
        Ok(Response::new(self.verify(&run).await?))
    }

    async fn get_schema_info(&self, _: Request<pb::GetSchemaInfoRequest>) -> Result<Response<pb::SchemaInfo>, Status> {
        Ok(Response::new(pb::SchemaInfo {
            backend: self.store.backend().as_str().into(),
            schema_version: crate::store::SCHEMA_VERSION.into(),
        }))
    }

    async fn list_receipts(
        &self,
        req: Request<pb::ListReceiptsRequest>,
    ) -> Result<Response<pb::ListReceiptsResponse>, Status> {
        warden_grpc::auth::check(&req, &req.get_ref().tenant)?;
        let r = req.into_inner();
        let run = self.visible_run(&r.tenant, &r.run_id).await?;
        let step = if r.step_id.is_empty() {
            None
        } else {
            check_step_id(&r.step_id).map_err(|e| invalid_field("step_id", e.to_string()))?;
            Some(r.step_id.as_str())
        };
        let size = page_size("page_size", r.page_size, 1000, 5000)?;
        let receipts = self.store.receipts(&run.run_id, step, r.after_seq, size).await?;
        let next_after_seq =
            if receipts.len() == size as usize { receipts.last().map(|r| r.seq).unwrap_or(0) } else { 0 };
        Ok(Response::new(pb::ListReceiptsResponse {
            receipts: receipts.into_iter().map(receipt_to_proto).collect(),
            next_after_seq,
        }))
    }

    async fn get_signed_head(
        &self,
        req: Request<pb::GetSignedHeadRequest>,
    ) -> Result<Response<pb::SignedHead>, Status> {
        warden_grpc::auth::check(&req, &req.get_ref().tenant)?;
        let r = req.into_inner();
        let run = self.visible_run(&r.tenant, &r.run_id).await?;
        // A head stored with the ledger's MAC is signed here, once the MAC verified
        // (`LedgerStore::signed_head`): what a client gets is the same either way.
        let (signature, key_id) = self.store.signed_head(&run)?;
        Ok(Response::new(pb::SignedHead {
            run_id: run.run_id,
            seq: run.last_seq,
            hash: run.head_hash,
            signature: hex::decode(signature).unwrap_or_default(),
            key_id,
            public_key: self.store.verifying_key().as_bytes().to_vec(),
        }))
    }

    async fn get_run_progress(
        &self,
        req: Request<pb::GetRunProgressRequest>,
    ) -> Result<Response<pb::RunProgress>, Status> {
        warden_grpc::auth::check(&req, &req.get_ref().tenant)?;
        let r = req.into_inner();
        let run = self.visible_run(&r.tenant, &r.run_id).await?;
        let mut view = RunView::default();
        let mut completed = Vec::new();
        let mut since = 0;
        loop {
            let page = self.store.events(&run.run_id, since, PAGE).await?;
            for e in &page {
                view.apply(e.body.seq, &e.body.event_type, &e.body.step_id, &e.body.payload);
                if e.body.event_type == events::TOOL_COMPLETED {
                    completed.push(e.body.step_id.clone());
                }
                since = e.body.seq;
            }
            if page.len() < PAGE as usize {
                break;
            }
        }
        // Explicit `task_progress` summaries win over what the steps say (Artana).
        let progress = self.store.summaries(&run.run_id, Some("task_progress"), None, 1).await?;
        let latest: Option<Value> = progress.first().and_then(|s| serde_json::from_str(&s.payload_json).ok());
        let total = view.steps.len();
        let percent = match (&latest, run.status.is_terminal()) {
            (Some(p), _) if p.get("percent").is_some() => p["percent"].as_u64().unwrap_or(0).min(100) as u32,
            (_, true) => 100,
            _ if total == 0 => 0,
            _ => (completed.len() * 100 / total) as u32,
        };
        let current_stage = latest
            .as_ref()
            .and_then(|p| p.get("stage").and_then(Value::as_str).map(str::to_string))
            .or_else(|| view.steps.iter().find(|s| s.status == StepStatus::Running).map(|s| s.id.clone()))
            .unwrap_or_default();
        Ok(Response::new(pb::RunProgress {
            run_id: run.run_id,
            status: status_to_proto(run.status) as i32,
            percent,
            current_stage,
            completed_stages: completed,
        }))
    }

    async fn put_summary(&self, req: Request<pb::PutSummaryRequest>) -> Result<Response<pb::Summary>, Status> {
        warden_grpc::auth::check(&req, &req.get_ref().tenant)?;
        let w = req.get_ref();
        self.caller_may_write(&req, &w.tenant, &w.run_id, w.epoch).await?;
        let r = req.into_inner();
        let payload = self.parse_value("payload_json", &r.payload_json, self.max_payload_bytes)?;
        let base = (r.tenant.as_str(), r.run_id.as_str(), r.epoch, r.idempotency_key.as_str());
        Ok(Response::new(self.summary(base, &r.summary_type, payload, &r.step_id).await?))
    }

    async fn put_checkpoint(&self, req: Request<pb::PutCheckpointRequest>) -> Result<Response<pb::Summary>, Status> {
        warden_grpc::auth::check(&req, &req.get_ref().tenant)?;
        let w = req.get_ref();
        self.caller_may_write(&req, &w.tenant, &w.run_id, w.epoch).await?;
        let r = req.into_inner();
        id_field("name", &r.name)?;
        let payload = self.parse_value("payload_json", &r.payload_json, self.max_payload_bytes)?;
        let base = (r.tenant.as_str(), r.run_id.as_str(), r.epoch, r.idempotency_key.as_str());
        let kind = format!("{}{}", events::CHECKPOINT_PREFIX, r.name);
        Ok(Response::new(self.summary(base, &kind, payload, "").await?))
    }

    async fn put_artifact(&self, req: Request<pb::PutArtifactRequest>) -> Result<Response<pb::Summary>, Status> {
        warden_grpc::auth::check(&req, &req.get_ref().tenant)?;
        let w = req.get_ref();
        self.caller_may_write(&req, &w.tenant, &w.run_id, w.epoch).await?;
        let r = req.into_inner();
        id_field("key", &r.key)?;
        let value = self.parse_value("value_json", &r.value_json, MAX_ARTIFACT_BYTES.min(self.max_payload_bytes))?;
        let base = (r.tenant.as_str(), r.run_id.as_str(), r.epoch, r.idempotency_key.as_str());
        let kind = format!("{}{}", events::ARTIFACT_PREFIX, r.key);
        Ok(Response::new(self.summary(base, &kind, json!({"value": value}), "").await?))
    }

    async fn list_summaries(
        &self,
        req: Request<pb::ListSummariesRequest>,
    ) -> Result<Response<pb::ListSummariesResponse>, Status> {
        warden_grpc::auth::check(&req, &req.get_ref().tenant)?;
        let r = req.into_inner();
        let run = self.visible_run(&r.tenant, &r.run_id).await?;
        let limit = page_size("limit", r.limit, 100, 1000)?;
        let kind = (!r.summary_type.is_empty()).then_some(r.summary_type.as_str());
        let rows = self.store.summaries(&run.run_id, kind, None, limit).await?;
        Ok(Response::new(pb::ListSummariesResponse {
            summaries: rows.into_iter().map(|s| row_to_summary(&run.run_id, s)).collect(),
        }))
    }

    async fn list_artifacts(
        &self,
        req: Request<pb::ListArtifactsRequest>,
    ) -> Result<Response<pb::ListArtifactsResponse>, Status> {
        warden_grpc::auth::check(&req, &req.get_ref().tenant)?;
        let r = req.into_inner();
        let run = self.visible_run(&r.tenant, &r.run_id).await?;
        if r.history && r.key.is_empty() {
            return Err(invalid_field("key", "history needs the artifact key"));
        }
        let rows = if r.key.is_empty() {
            self.store.summaries(&run.run_id, None, Some(events::ARTIFACT_PREFIX), u32::MAX).await?
        } else {
            id_field("key", &r.key)?;
            let kind = format!("{}{}", events::ARTIFACT_PREFIX, r.key);
            self.store.summaries(&run.run_id, Some(&kind), None, if r.history { u32::MAX } else { 1 }).await?
        };
        let mut seen = std::collections::HashSet::new();
        let mut artifacts: Vec<pb::Artifact> = rows
            .into_iter()
            .filter(|s| r.history || seen.insert(s.summary_type.clone()))
            .map(|s| {
                let value = serde_json::from_str::<Value>(&s.payload_json)
                    .ok()
                    .and_then(|p| p.get("value").cloned())
                    .unwrap_or(Value::Null);
                pb::Artifact {
                    key: s.summary_type.trim_start_matches(events::ARTIFACT_PREFIX).to_string(),
                    value_json: warden_core::canonical_json(&value),
                    seq: s.seq,
                    timestamp_ms: s.timestamp_ms,
                }
            })
            .collect();
        // Newest first from the store; history reads oldest first, snapshots by key.
        if r.history {
            artifacts.reverse();
        } else {
            artifacts.sort_by(|a, b| a.key.cmp(&b.key));
        }
        Ok(Response::new(pb::ListArtifactsResponse { artifacts }))
    }

    async fn propose_state_delta(
        &self,
        req: Request<pb::ProposeStateDeltaRequest>,
    ) -> Result<Response<pb::ProposeStateDeltaResponse>, Status> {
        warden_grpc::auth::check(&req, &req.get_ref().tenant)?;
        let w = req.get_ref();
        self.caller_may_write(&req, &w.tenant, &w.run_id, w.epoch).await?;
        let r = req.into_inner();
        id_field("tenant", &r.tenant)?;
        id_field("run_id", &r.run_id)?;
        id_field("tx_id", &r.tx_id)?;
        let delta = self.parse_value("delta_json", &r.delta_json, self.max_payload_bytes)?;
        check_delta(&delta)?;
        let provenance = if r.provenance_json.is_empty() {
            Value::Null
        } else {
            self.parse_value("provenance_json", &r.provenance_json, self.max_payload_bytes)?
        };
        let body = json!({"tx_id": r.tx_id, "delta": delta, "provenance": provenance});
        // Retrying the same proposal is idempotent; a different one stages another delta.
        let key =
            format!("tx:{}:proposed:{}", r.tx_id, &warden_core::sha256_hex(warden_core::canonical_json(&body))[..16]);
        let (e, _) = self.append(&r.tenant, &r.run_id, r.epoch, &key, events::TX_PROPOSED, body, "").await?;
        let staged = self.store.staged_deltas(&r.run_id, &r.tx_id).await?;
        Ok(Response::new(pb::ProposeStateDeltaResponse {
            proposal_id: format!("{}#{}", r.tx_id, e.body.seq),
            staged_sha256: warden_core::canonical::staged_deltas_sha256(&staged),
        }))
    }

    async fn commit_tx(&self, req: Request<pb::CommitTxRequest>) -> Result<Response<pb::TxOutcome>, Status> {
        warden_grpc::auth::check(&req, &req.get_ref().tenant)?;
        let w = req.get_ref();
        self.caller_may_write(&req, &w.tenant, &w.run_id, w.epoch).await?;
        let r = req.into_inner();
        id_field("tenant", &r.tenant)?;
        id_field("run_id", &r.run_id)?;
        id_field("tx_id", &r.tx_id)?;
        id_field("decision_id", &r.decision_id)?;
        let body = json!({"tx_id": r.tx_id, "decision_id": r.decision_id});
        let key = format!("tx:{}:commit", r.tx_id);
        let (e, _) = self.append(&r.tenant, &r.run_id, r.epoch, &key, events::TX_COMMITTED, body, "").await?;
        Ok(Response::new(self.tx_outcome(&e, "committed").await?))
    }

    async fn rollback_tx(&self, req: Request<pb::RollbackTxRequest>) -> Result<Response<pb::TxOutcome>, Status> {
        warden_grpc::auth::check(&req, &req.get_ref().tenant)?;
        let w = req.get_ref();
        self.caller_may_write(&req, &w.tenant, &w.run_id, w.epoch).await?;
        let r = req.into_inner();
        id_field("tenant", &r.tenant)?;
        id_field("run_id", &r.run_id)?;
        id_field("tx_id", &r.tx_id)?;
        if r.reason.is_empty() || r.reason.len() > 4096 || r.reason.contains('\0') {
            return Err(invalid_field("reason", "say why, in at most 4096 bytes, without NUL"));
        }
        let body = json!({"tx_id": r.tx_id, "reason": r.reason});
        let key = format!("tx:{}:rollback", r.tx_id);
        let (e, _) = self.append(&r.tenant, &r.run_id, r.epoch, &key, events::TX_ROLLED_BACK, body, "").await?;
        Ok(Response::new(self.tx_outcome(&e, "rolled_back").await?))
    }

    async fn get_ledger_keys(
        &self,
        _: Request<pb::GetLedgerKeysRequest>,
    ) -> Result<Response<pb::GetLedgerKeysResponse>, Status> {
        let key = self.store.verifying_key();
        Ok(Response::new(pb::GetLedgerKeysResponse {
            keys: vec![pb::LedgerKey { key_id: warden_core::auth::key_id(&key), public_key: key.as_bytes().to_vec() }],
        }))
    }

    async fn put_output(&self, req: Request<pb::PutOutputRequest>) -> Result<Response<pb::StoredOutputRef>, Status> {
        warden_grpc::auth::require_mesh(&req, "storing a tool output")?;
        let r = req.into_inner();
        id_field("tenant", &r.tenant)?;
        let run = self.visible_run(&r.tenant, &r.run_id).await?;
        if r.epoch < run.max_epoch {
            return Err(LedgerError::Fenced { epoch: r.epoch, max_epoch: run.max_epoch }.into());
        }
        if run.status.is_terminal() {
            let why = format!("run '{}' is {}; it takes no more outputs", run.run_id, run.status.as_str());
            return Err(LedgerError::Precondition(why).into());
        }
        let max = self.max_output_bytes;
        if r.output_json.len() > max {
            let why = format!("{} bytes is over the maximum of {max}", r.output_json.len());
            return Err(invalid_field("output_json", why));
        }
        // Parsing, canonicalizing and hashing megabytes is blocking work.
        let (canonical, sha256) = tokio::task::spawn_blocking(move || {
            let value: Value = serde_json::from_str(&r.output_json)
                .map_err(|e| invalid_field("output_json", format!("not valid JSON: {e}")))?;
            let canonical = warden_core::canonical_json(&value);
            let sha256 = warden_core::sha256_hex(canonical.as_bytes());
            Ok::<_, Status>((canonical, sha256))
        })
        .await
        .map_err(|e| Status::internal(format!("output digest failed: {e}")))??;
        if canonical.len() > max {
            let why = format!("{} bytes (canonical) is over the maximum of {max}", canonical.len());
            return Err(invalid_field("output_json", why));
        }
        self.store.put_output(&run.tenant, &run.run_id, &sha256, &canonical, warden_grpc::now_ms()).await?;
        Ok(Response::new(pb::StoredOutputRef { sha256, bytes: canonical.len() as u64 }))
    }

    async fn get_output(&self, req: Request<pb::GetOutputRequest>) -> Result<Response<pb::StoredOutput>, Status> {
        warden_grpc::auth::check(&req, &req.get_ref().tenant)?;
        let r = req.into_inner();
        let run = self.visible_run(&r.tenant, &r.run_id).await?;
        if r.sha256.len() != 64 || !r.sha256.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)) {
            return Err(invalid_field("sha256", "64 lowercase hex digits"));
        }
        match self.store.output(&run.run_id, &r.sha256).await? {
            Some(output_json) => Ok(Response::new(pb::StoredOutput { sha256: r.sha256, output_json })),
            None => Err(LedgerError::NotFound(format!("output {} of run '{}'", r.sha256, run.run_id)).into()),
        }
    }

    async fn get_state(&self, req: Request<pb::GetStateRequest>) -> Result<Response<pb::StateEntry>, Status> {
        warden_grpc::auth::check(&req, &req.get_ref().tenant)?;
        let r = req.into_inner();
        id_field("tenant", &r.tenant)?;
        if r.key.is_empty() || r.key.len() > 512 {
            return Err(invalid_field("key", "must be 1-512 bytes"));
        }
        let entry = match self.store.state(&r.tenant, &r.key).await? {
            Some((value_json, version, tx_id)) => {
                pb::StateEntry { key: r.key, found: true, value_json, version, tx_id }
            }
            None => {
                pb::StateEntry { key: r.key, found: false, value_json: String::new(), version: 0, tx_id: String::new() }
            }
        };
        Ok(Response::new(entry))
    }
}

/// A delta is an object of `set` (object), `delete` (array of strings) and `expect`
/// (object of non-negative integer versions); nothing else.
fn check_delta(d: &Value) -> Result<(), Status> {
    let obj = d.as_object().ok_or_else(|| invalid_field("delta_json", "must be a JSON object"))?;
    for (k, v) in obj {
        let ok = match k.as_str() {
            "set" => v.is_object(),
            "delete" => v.as_array().is_some_and(|a| a.iter().all(Value::is_string)),
            "expect" => v.as_object().is_some_and(|m| m.values().all(|x| x.as_u64().is_some())),
            _ => return Err(invalid_field(format!("delta_json.{k}"), "unknown field (set, delete, expect)")),
        };
        if !ok {
            return Err(invalid_field(format!("delta_json.{k}"), "has the wrong shape"));
        }
    }
    let keys =
        obj.get("set").and_then(Value::as_object).map(|m| m.keys().cloned().collect::<Vec<_>>()).unwrap_or_default();
    let expected =
        obj.get("expect").and_then(Value::as_object).map(|m| m.keys().cloned().collect::<Vec<_>>()).unwrap_or_default();
    let deletes = obj
        .get("delete")
        .and_then(Value::as_array)
        .map(|a| a.iter().filter_map(Value::as_str).map(str::to_string).collect::<Vec<_>>())
        .unwrap_or_default();
    if keys.is_empty() && deletes.is_empty() {
        return Err(invalid_field("delta_json", "changes nothing (no set, no delete)"));
    }
    if let Some(k) = keys
        .iter()
        .chain(deletes.iter())
        .chain(expected.iter())
        .find(|k| k.is_empty() || k.len() > 512 || k.contains('\0'))
    {
        return Err(invalid_field(
            "delta_json",
            format!("state key '{}' must be 1-512 bytes without NUL", k.escape_debug()),
        ));
    }
    Ok(())
}
