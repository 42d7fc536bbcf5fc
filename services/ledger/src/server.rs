//! Maps the `warden.v1.Ledger` gRPC service onto the store.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::Value;
use tokio::sync::Notify;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};
use warden_core::chain::{ChainBreak, ChainVerifier, ChainedEvent};
use warden_core::events::{self, RunStatus};
use warden_core::head::Head;
use warden_core::ids::{check_id, check_step_id};
use warden_core::receipt::{Receipt, receipt_for};
use warden_grpc::convert::{event_to_proto, status_to_proto, statuses};
use warden_grpc::{invalid_field, now_ms};
use warden_proto::v1 as pb;
use warden_proto::v1::ledger_server::Ledger;

use crate::error::LedgerError;
use crate::store::{LedgerStore, NewEvent, NewRun, RunRow};

/// Events read per page when streaming or verifying (bounded memory per request).
const PAGE: u32 = 1000;
/// Events buffered per stream before the server waits for a slow consumer.
const STREAM_BUFFER: usize = 256;
/// How often a follower re-reads without a local notification (appends made by another
/// ledger replica).
const FOLLOW_POLL: Duration = Duration::from_millis(500);
const STRIPES: usize = 64;

#[derive(Clone)]
pub struct LedgerService {
    store: LedgerStore,
    max_payload_bytes: usize,
    followers: Arc<Mutex<HashMap<String, Arc<Notify>>>>,
    /// Appends to one run queue here instead of on the database row lock.
    stripes: Arc<Vec<tokio::sync::Mutex<()>>>,
}

fn id_field(field: &str, v: &str) -> Result<(), Status> {
    check_id(v).map_err(|e| invalid_field(field, e.to_string()))
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
    }
}

impl LedgerService {
    pub fn new(store: LedgerStore, max_payload_bytes: usize) -> LedgerService {
        let sqlite = store.backend() == crate::store::Backend::Sqlite;
        LedgerService {
            store,
            max_payload_bytes,
            followers: Default::default(),
            // SQLite has one writer: queueing here is cheaper than its busy-wait sleeps.
            stripes: Arc::new(
                (0..if sqlite { 1 } else { STRIPES })
                    .map(|_| tokio::sync::Mutex::new(()))
                    .collect(),
            ),
        }
    }

    pub fn store(&self) -> &LedgerStore {
        &self.store
    }

    /// Drops the run's notifier once no stream holds it any more.
    fn unfollow(&self, run_id: &str) {
        let mut f = self.followers.lock().unwrap_or_else(|p| p.into_inner());
        if f.get(run_id).is_some_and(|n| Arc::strong_count(n) == 1) {
            f.remove(run_id);
        }
    }

    fn follower(&self, run_id: &str) -> Arc<Notify> {
        let mut f = self.followers.lock().unwrap_or_else(|p| p.into_inner());
        f.entry(run_id.to_string()).or_default().clone()
    }

    fn notify(&self, run_id: &str) {
        let f = self.followers.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = f.get(run_id) {
            n.notify_waiters();
        }
    }

    fn stripe(&self, run_id: &str) -> &tokio::sync::Mutex<()> {
        let h = run_id.bytes().fold(0xcbf29ce484222325u64, |h, b| {
            (h ^ b as u64).wrapping_mul(0x100000001b3)
        });
        &self.stripes[(h % self.stripes.len() as u64) as usize]
    }

    fn parse_payload(&self, field: &str, json: &str) -> Result<Value, Status> {
        if json.len() > self.max_payload_bytes {
            return Err(invalid_field(
                field,
                format!(
                    "{} bytes is over the maximum of {}",
                    json.len(),
                    self.max_payload_bytes
                ),
            ));
        }
        let v: Value = serde_json::from_str(json)
            .map_err(|e| invalid_field(field, format!("not valid JSON: {e}")))?;
        if !v.is_object() {
            return Err(invalid_field(field, "must be a JSON object"));
        }
        Ok(v)
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
        let mut receipts: HashMap<u64, Receipt> = self
            .store
            .receipts(&run.run_id, None)
            .await?
            .into_iter()
            .filter(|r| r.seq <= run.last_seq)
            .map(|r| (r.seq, r))
            .collect();
        let mut v = ChainVerifier::default();
        let mut since = 0;
        loop {
            // Only up to the head read above: an active run may grow while we verify.
            let mut page = self.store.events(&run.run_id, since, PAGE).await?;
            let n = page.len();
            page.retain(|e| e.body.seq <= run.last_seq);
            // Hashing a long chain is CPU work: keep it off the async workers.
            let (verifier, left, result) = tokio::task::spawn_blocking(move || {
                let r = page.iter().try_for_each(|e| {
                    v.push(e)?;
                    check_receipt(e, &mut receipts)
                });
                (v, receipts, r)
            })
            .await
            .map_err(|e| LedgerError::Internal(e.to_string()))?;
            (v, receipts) = (verifier, left);
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
                format!(
                    "run records {} events but only {count} are stored",
                    run.last_seq
                )
            } else {
                "stored events do not end at the run's recorded head".to_string()
            };
            return Ok(invalid(count, count.min(run.last_seq) + 1, reason));
        }
        if let Some(seq) = receipts.keys().min() {
            return Ok(invalid(
                count,
                *seq,
                "a receipt cites no outcome event".into(),
            ));
        }
        let signed = Head {
            run_id: run.run_id.clone(),
            seq: count,
            hash: head.clone(),
        };
        let signature = hex::decode(&run.head_signature).unwrap_or_default();
        if !signed.verify(&signature, &self.store.verifying_key()) {
            return Ok(invalid(
                count,
                count,
                "the chain head's signature does not verify".into(),
            ));
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
fn check_receipt(e: &ChainedEvent, receipts: &mut HashMap<u64, Receipt>) -> Result<(), ChainBreak> {
    let seq = e.body.seq;
    let stored = receipts.remove(&seq);
    let expected = receipt_for(
        e,
        stored
            .as_ref()
            .map(|r| r.capability_id.as_str())
            .unwrap_or_default(),
    );
    match (expected, stored) {
        (None, None) => Ok(()),
        (Some(x), Some(s)) if x == s => Ok(()),
        (Some(_), None) => Err(ChainBreak {
            seq,
            reason: "tool call outcome has no receipt".into(),
        }),
        (None, Some(_)) => Err(ChainBreak {
            seq,
            reason: "receipt for an event that is no outcome".into(),
        }),
        (Some(_), Some(_)) => Err(ChainBreak {
            seq,
            reason: "receipt does not match its event".into(),
        }),
    }
}

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

fn unimplemented(what: &str) -> Status {
    Status::unimplemented(format!("{what} is not available in this Warden release"))
}

#[tonic::async_trait]
impl Ledger for LedgerService {
    async fn create_run(
        &self,
        req: Request<pb::CreateRunRequest>,
    ) -> Result<Response<pb::CreateRunResponse>, Status> {
        let r = req.into_inner();
        id_field("tenant", &r.tenant)?;
        if !r.idempotency_key.is_empty() {
            id_field("idempotency_key", &r.idempotency_key)?;
        }
        let plan = match (r.plan_json.is_empty(), r.goal.is_empty()) {
            (false, true) => Some(self.parse_payload("plan_json", &r.plan_json)?),
            (true, false) => None,
            _ => {
                return Err(invalid_field(
                    "plan_json",
                    "exactly one of plan_json and goal must be set",
                ));
            }
        };
        if r.goal.len() > self.max_payload_bytes {
            return Err(invalid_field(
                "goal",
                format!("over the maximum of {} bytes", self.max_payload_bytes),
            ));
        }
        pb::CancelPolicy::try_from(r.cancel_policy)
            .map_err(|_| invalid_field("cancel_policy", "unknown cancel policy"))?;
        let run_id = uuid::Uuid::now_v7().to_string();
        let (run, deduplicated) = self
            .store
            .create_run(NewRun {
                run_id: &run_id,
                tenant: &r.tenant,
                plan: plan.as_ref(),
                goal: &r.goal,
                idempotency_key: &r.idempotency_key,
                cancel_policy: r.cancel_policy,
                now_ms: now_ms(),
            })
            .await?;
        Ok(Response::new(pb::CreateRunResponse {
            run: Some(run_to_proto(run)),
            deduplicated,
        }))
    }

    async fn append_event(
        &self,
        req: Request<pb::AppendEventRequest>,
    ) -> Result<Response<pb::AppendEventResponse>, Status> {
        let r = req.into_inner();
        id_field("tenant", &r.tenant)?;
        id_field("run_id", &r.run_id)?;
        id_field("idempotency_key", &r.idempotency_key)?;
        if !events::KNOWN.contains(&r.event_type.as_str()) || r.event_type == events::RUN_SUBMITTED
        {
            return Err(invalid_field(
                "event_type",
                format!(
                    "'{}' is not an event type that can be appended",
                    r.event_type
                ),
            ));
        }
        if !r.step_id.is_empty() {
            check_step_id(&r.step_id).map_err(|e| invalid_field("step_id", e.to_string()))?;
        }
        let payload = self.parse_payload("payload_json", &r.payload_json)?;
        let _serial = self.stripe(&r.run_id).lock().await;
        let (event, deduplicated) = self
            .store
            .append(NewEvent {
                tenant: &r.tenant,
                run_id: &r.run_id,
                epoch: r.epoch,
                idempotency_key: &r.idempotency_key,
                event_type: &r.event_type,
                payload,
                step_id: &r.step_id,
                now_ms: now_ms(),
            })
            .await?;
        drop(_serial);
        if !deduplicated {
            self.notify(&r.run_id);
        }
        Ok(Response::new(pb::AppendEventResponse {
            event: Some(event_to_proto(&event)),
            deduplicated,
        }))
    }

    async fn get_run(
        &self,
        req: Request<pb::GetLedgerRunRequest>,
    ) -> Result<Response<pb::LedgerRun>, Status> {
        let r = req.into_inner();
        Ok(Response::new(run_to_proto(
            self.visible_run(&r.tenant, &r.run_id).await?,
        )))
    }

    async fn list_runs(
        &self,
        req: Request<pb::ListLedgerRunsRequest>,
    ) -> Result<Response<pb::ListLedgerRunsResponse>, Status> {
        let r = req.into_inner();
        let tenant = optional_tenant(&r.tenant)?;
        let wanted = statuses("statuses", &r.statuses)?;
        if !r.page_token.is_empty() {
            id_field("page_token", &r.page_token)?;
        }
        let size = match r.page_size {
            0 => 100,
            n if n > 1000 => return Err(invalid_field("page_size", "must be at most 1000")),
            n => n,
        };
        let runs = self
            .store
            .list_runs(tenant, &wanted, &r.page_token, size)
            .await?;
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
        let r = req.into_inner();
        let run = self.visible_run(&r.tenant, &r.run_id).await?;
        let (tx, rx) = tokio::sync::mpsc::channel(STREAM_BUFFER);
        let this = self.clone();
        tokio::spawn(async move {
            let notify = this.follower(&run.run_id);
            let mut since = r.since_seq;
            let stream = async {
                loop {
                    // Register interest before reading so an append in between is not missed.
                    let notified = notify.notified();
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
                    tokio::select! {
                        _ = notified => {}
                        _ = tokio::time::sleep(FOLLOW_POLL) => {}
                        _ = tx.closed() => return,
                    }
                }
            };
            stream.await;
            drop(notify);
            this.unfollow(&run.run_id);
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn verify_run(
        &self,
        req: Request<pb::VerifyRunRequest>,
    ) -> Result<Response<pb::VerifyRunResponse>, Status> {
        let r = req.into_inner();
        let run = self.visible_run(&r.tenant, &r.run_id).await?;
        Ok(Response::new(self.verify(&run).await?))
    }

    async fn get_schema_info(
        &self,
        _: Request<pb::GetSchemaInfoRequest>,
    ) -> Result<Response<pb::SchemaInfo>, Status> {
        Ok(Response::new(pb::SchemaInfo {
            backend: self.store.backend().as_str().into(),
            schema_version: crate::store::SCHEMA_VERSION.into(),
        }))
    }

    async fn list_receipts(
        &self,
        req: Request<pb::ListReceiptsRequest>,
    ) -> Result<Response<pb::ListReceiptsResponse>, Status> {
        let r = req.into_inner();
        let run = self.visible_run(&r.tenant, &r.run_id).await?;
        let step = if r.step_id.is_empty() {
            None
        } else {
            check_step_id(&r.step_id).map_err(|e| invalid_field("step_id", e.to_string()))?;
            Some(r.step_id.as_str())
        };
        let receipts = self.store.receipts(&run.run_id, step).await?;
        Ok(Response::new(pb::ListReceiptsResponse {
            receipts: receipts.into_iter().map(receipt_to_proto).collect(),
        }))
    }

    async fn get_signed_head(
        &self,
        req: Request<pb::GetSignedHeadRequest>,
    ) -> Result<Response<pb::SignedHead>, Status> {
        let r = req.into_inner();
        let run = self.visible_run(&r.tenant, &r.run_id).await?;
        Ok(Response::new(pb::SignedHead {
            run_id: run.run_id,
            seq: run.last_seq,
            hash: run.head_hash,
            signature: hex::decode(&run.head_signature).unwrap_or_default(),
            key_id: run.head_key_id,
            public_key: self.store.verifying_key().as_bytes().to_vec(),
        }))
    }

    async fn propose_state_delta(
        &self,
        _: Request<pb::ProposeStateDeltaRequest>,
    ) -> Result<Response<pb::ProposeStateDeltaResponse>, Status> {
        Err(unimplemented("Ledger.ProposeStateDelta"))
    }

    async fn commit_tx(
        &self,
        _: Request<pb::CommitTxRequest>,
    ) -> Result<Response<pb::TxOutcome>, Status> {
        Err(unimplemented("Ledger.CommitTx"))
    }

    async fn rollback_tx(
        &self,
        _: Request<pb::RollbackTxRequest>,
    ) -> Result<Response<pb::TxOutcome>, Status> {
        Err(unimplemented("Ledger.RollbackTx"))
    }
}
