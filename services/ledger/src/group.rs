//! Group commit: appends queue per lane (a run always maps to the same lane, so a run's
//! appends never contend across lanes), and each lane writes whatever has queued up while
//! its previous batch was committing as one database transaction — one commit (one WAL
//! flush) for many events. Under light load a batch is a single event: no added latency.

use std::sync::Arc;

use tokio::sync::{mpsc, oneshot};
use tracing::Instrument;
use warden_core::chain::ChainedEvent;

use crate::error::LedgerError;
use crate::follow::Followers;
use crate::store::{LedgerStore, OwnedEvent};

/// The answer for a group: every event of it appended (or found already appended), or the
/// refusal that kept the whole group out.
///
/// Events are shared (`Arc`): the run's state in memory, the batch's rows, the answers, the
/// runs' followers and the recent decisions hold the same event, not a copy each.
pub type GroupResult = Result<Vec<(Arc<ChainedEvent>, bool)>, LedgerError>;

type Reply = oneshot::Sender<GroupResult>;

/// A group waiting for its lane: its events, who to answer, and the span of the request that
/// brought it (the batch it is committed in is traced under the first one, linked to the rest).
type Job = (Vec<OwnedEvent>, Reply, tracing::Span);

#[derive(Clone)]
pub struct GroupCommit {
    lanes: Vec<mpsc::Sender<Job>>,
}

impl GroupCommit {
    /// Starts `lanes` writers (one database connection each when busy), batching up to
    /// `max_batch` events per commit. Each commit's new events are published to the runs'
    /// `followers` before anyone is answered.
    pub fn start(store: LedgerStore, lanes: usize, max_batch: usize, followers: Arc<Followers>) -> GroupCommit {
        let lanes = (0..lanes.max(1))
            .map(|_| {
                let (tx, mut rx) = mpsc::channel::<Job>(max_batch * 8);
                let (store, followers) = (store.clone(), followers.clone());
                tokio::spawn(async move {
                    while let Some(first) = rx.recv().await {
                        let mut events = first.0.len();
                        let mut jobs = vec![first];
                        while events < max_batch {
                            match rx.try_recv() {
                                Ok(j) => {
                                    events += j.0.len();
                                    jobs.push(j);
                                }
                                Err(_) => break,
                            }
                        }
                        let span = tracing::info_span!(
                            parent: &jobs[0].2,
                            "ledger.batch_commit",
                            batch.events = events,
                            batch.groups = jobs.len(),
                        );
                        for (_, _, other) in &jobs[1..] {
                            warden_telemetry::context::link(&span, other);
                        }
                        let (groups, replies): (Vec<Vec<OwnedEvent>>, Vec<Reply>) =
                            jobs.into_iter().map(|(g, r, _)| (g, r)).unzip();
                        let started = std::time::Instant::now();
                        let results = store.append_groups(groups).instrument(span).await;
                        warden_telemetry::metrics::ledger_batch_committed(events, started.elapsed());
                        // In commit order per run (a run's groups are in this lane, in order).
                        for appended in results.iter().flatten() {
                            followers.publish(appended);
                        }
                        for (reply, result) in replies.into_iter().zip(results) {
                            // A caller that went away still had its event written (or not):
                            // its retry, with the same key, finds out which.
                            let _ = reply.send(result);
                        }
                    }
                });
                tx
            })
            .collect();
        GroupCommit { lanes }
    }

    pub async fn append(&self, event: OwnedEvent) -> Result<(Arc<ChainedEvent>, bool), LedgerError> {
        let mut appended = self.append_group(vec![event]).await?;
        appended.pop().ok_or_else(|| LedgerError::Internal("the writer answered no event".into()))
    }

    /// Appends events of one run all or nothing (in one database transaction with whatever
    /// else the lane commits).
    pub async fn append_group(&self, events: Vec<OwnedEvent>) -> GroupResult {
        let Some(first) = events.first() else { return Ok(Vec::new()) };
        let h = first.run_id.bytes().fold(0xcbf29ce484222325u64, |h, b| (h ^ b as u64).wrapping_mul(0x100000001b3));
        let lane = &self.lanes[(h % self.lanes.len() as u64) as usize];
        let (tx, rx) = oneshot::channel();
        let started = std::time::Instant::now();
        let job = (events, tx, tracing::Span::current());
        lane.send(job).await.map_err(|_| LedgerError::Unavailable("ledger writer stopped".into()))?;
        let result = rx.await.map_err(|_| LedgerError::Unavailable("ledger writer stopped".into()))?;
        warden_telemetry::metrics::ledger_appended(started.elapsed());
        result
    }
}
