//! Recording decisions off the hot path. The executor carries each signed decision into the
//! same ledger transaction as the call's request, so the common case needs nothing from the
//! policy service. So that no decision is ever lost — a deny the executor never records, an
//! allow whose executor died before acting — the policy also records every decision itself,
//! a little later and idempotently (the event's key is the decision id, its content the
//! signed record): by then the executor's copy is usually there and the append is a no-op.
//!
//! Decisions due are recorded together: every 100 ms, one `Ledger.RecordDecisions` call for
//! all of them (at most 256 a call). The ledger answers each decision it committed itself
//! from memory, so the steady state costs a call per tenth of a second, not one per decision. A decision the call did
//! not record is then recorded on its own, with retries, as before.
//!
//! The queue is bounded; when it is full the decision is recorded before answering instead
//! (backpressure, never loss). A decision the ledger refuses as stale (a newer executor
//! holds the run) is recorded at the run's current epoch: the decision is a fact whoever
//! asked for it.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};
use tonic::Status;
use warden_proto::v1 as pb;
use warden_proto::v1::ledger_client::LedgerClient;

/// How long a decision waits before the policy records it itself.
const DELAY: Duration = Duration::from_millis(500);
/// How often the decisions due are sent (so a decision waits DELAY to DELAY + FLUSH).
const FLUSH: Duration = Duration::from_millis(100);
/// Decisions waiting at most; beyond, `Authorize` records before answering.
const QUEUE: usize = 65_536;
/// Appends in flight at once.
const IN_FLIGHT: usize = 32;
/// How long a decision is retried before it is given up (logged).
const GIVE_UP: Duration = Duration::from_secs(600);

/// Decisions one `Ledger.RecordDecisions` call carries at most (the ledger's limit).
const BATCH: usize = 256;

type Queued = (tokio::time::Instant, pb::AppendEventRequest);

#[derive(Clone)]
pub struct DecisionRecorder {
    queue: mpsc::Sender<Queued>,
    ledger: LedgerClient<warden_grpc::auth::Ch>,
}

impl DecisionRecorder {
    pub fn start(ledger: LedgerClient<warden_grpc::auth::Ch>) -> DecisionRecorder {
        let (queue, mut rx) = mpsc::channel::<Queued>(QUEUE);
        let writer = ledger.clone();
        tokio::spawn(async move {
            let permits = Arc::new(Semaphore::new(IN_FLIGHT));
            // Taken from the channel, in the order they were queued, until due. Bounded like
            // the channel: nothing more is taken while it holds QUEUE, so a full channel
            // makes `Authorize` record before answering.
            let mut waiting: VecDeque<Queued> = VecDeque::new();
            let mut tick = tokio::time::interval(FLUSH);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    got = rx.recv(), if waiting.len() < QUEUE => match got {
                        Some(q) => waiting.push_back(q),
                        None if waiting.is_empty() => return,
                        None => tokio::time::sleep(FLUSH).await,
                    },
                    _ = tick.tick() => {
                        // Every decision due goes out now, BATCH to a call.
                        let now = tokio::time::Instant::now();
                        while waiting.front().is_some_and(|(at, _)| *at + DELAY <= now) {
                            let mut batch = Vec::new();
                            while batch.len() < BATCH && waiting.front().is_some_and(|(at, _)| *at + DELAY <= now) {
                                if let Some((_, req)) = waiting.pop_front() {
                                    batch.push(req);
                                }
                            }
                            let Ok(permit) = permits.clone().acquire_owned().await else { return };
                            let (ledger, permits) = (writer.clone(), permits.clone());
                            tokio::spawn(record_batch(ledger, batch, permit, permits));
                        }
                    }
                }
            }
        });
        DecisionRecorder { queue, ledger }
    }

    /// Queues `req` to be recorded; records it now when the queue is full.
    pub async fn record_later(&self, req: pb::AppendEventRequest) -> Result<(), Status> {
        match self.queue.try_send((tokio::time::Instant::now(), req)) {
            Ok(()) => Ok(()),
            Err(mpsc::error::TrySendError::Full((_, req)) | mpsc::error::TrySendError::Closed((_, req))) => {
                record_now(&mut self.ledger.clone(), req).await
            }
        }
    }
}

/// Records one decision now, through `RecordDecisions` as every decision the policy records
/// itself goes: there, a decision whose run was never created is kept apart instead of
/// refused. The decision's own refusal, if any, comes back as the call's.
pub async fn record_now(
    ledger: &mut LedgerClient<warden_grpc::auth::Ch>,
    req: pb::AppendEventRequest,
) -> Result<(), Status> {
    record_one(ledger, req).await.map_err(|(s, _)| s)
}

/// [`record_now`], telling also whether a refusal was fencing.
async fn record_one(
    ledger: &mut LedgerClient<warden_grpc::auth::Ch>,
    req: pb::AppendEventRequest,
) -> Result<(), (Status, bool)> {
    let answered = ledger.record_decisions(pb::RecordDecisionsRequest { decisions: vec![req] }).await;
    let answered = answered.map_err(|s| {
        let fenced = warden_grpc::is_fenced(&s);
        (s, fenced)
    })?;
    match answered.into_inner().results.into_iter().next() {
        Some(d) if d.code == tonic::Code::Ok as i32 => Ok(()),
        Some(d) => Err((Status::new(tonic::Code::from(d.code), d.message), d.fenced)),
        None => Err((Status::internal("the ledger answered no result"), false)),
    }
}

/// Records `batch` in one call, holding `permit`; a decision the call could not record (the
/// call failed, or its answer for that decision is an error) is then recorded on its own, with
/// retries, each on its own task under a permit of `permits` (as many at once as before).
async fn record_batch(
    mut ledger: LedgerClient<warden_grpc::auth::Ch>,
    batch: Vec<pb::AppendEventRequest>,
    permit: OwnedSemaphorePermit,
    permits: Arc<Semaphore>,
) {
    let answered = ledger.record_decisions(pb::RecordDecisionsRequest { decisions: batch.clone() }).await;
    let left: Vec<pb::AppendEventRequest> = match answered {
        Ok(r) => {
            let results = r.into_inner().results;
            batch
                .into_iter()
                .enumerate()
                .filter(|(i, _)| results.get(*i).is_none_or(|d| d.code != tonic::Code::Ok as i32))
                .map(|(_, req)| req)
                .collect()
        }
        Err(s) => {
            tracing::debug!(error = %s, decisions = batch.len(), "decision batch not recorded; recording one by one");
            batch
        }
    };
    // Given back first: this task waits for permits below, and must not hold one meanwhile.
    drop(permit);
    for req in left {
        let Ok(permit) = permits.clone().acquire_owned().await else { return };
        let ledger = ledger.clone();
        tokio::spawn(async move {
            record_with_retries(ledger, req).await;
            drop(permit);
        });
    }
}

async fn record_with_retries(mut ledger: LedgerClient<warden_grpc::auth::Ch>, mut req: pb::AppendEventRequest) {
    let started = tokio::time::Instant::now();
    let mut backoff = Duration::from_millis(100);
    loop {
        // Through `RecordDecisions`, as the batches go: a decision whose run was never created
        // is kept apart there instead of refused (see `Ledger.ListUnboundDecisions`).
        let (code, fenced, message) = match record_one(&mut ledger, req.clone()).await {
            Ok(()) => return,
            Err((s, fenced)) => (s.code(), fenced, s.message().to_string()),
        };
        match code {
            _ if fenced => {
                let run = ledger
                    .get_run(pb::GetLedgerRunRequest {
                        tenant: req.tenant.clone(),
                        run_id: req.run_id.clone(),
                        with_events: false,
                    })
                    .await;
                if let Ok(run) = run {
                    req.epoch = run.into_inner().max_epoch;
                    continue;
                }
            }
            // Refusals other than fencing (a terminal run, a different record under the id)
            // cannot be helped by retrying.
            tonic::Code::InvalidArgument
            | tonic::Code::FailedPrecondition
            | tonic::Code::NotFound
            | tonic::Code::PermissionDenied => {
                tracing::debug!(run_id = %req.run_id, error = %message, "decision not recorded by the policy");
                return;
            }
            _ if started.elapsed() > GIVE_UP => {
                tracing::error!(run_id = %req.run_id, key = %req.idempotency_key, error = %message, "decision could not be recorded; giving up");
                return;
            }
            _ => tracing::debug!(run_id = %req.run_id, error = %message, "decision record retried"),
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(5));
    }
}
