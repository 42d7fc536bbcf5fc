//! Group commit: appends queue per lane (a run always maps to the same lane, so a run's
//! appends never contend across lanes), and each lane writes whatever has queued up while
//! its previous batch was committing as one database transaction — one commit (one WAL
//! flush) for many events. Under light load a batch is a single event: no added latency.

use tokio::sync::{mpsc, oneshot};
use warden_core::chain::ChainedEvent;

use crate::error::LedgerError;
use crate::store::{LedgerStore, OwnedEvent};

/// The answer for a group: every event of it appended (or found already appended), or the
/// refusal that kept the whole group out.
pub type GroupResult = Result<Vec<(ChainedEvent, bool)>, LedgerError>;

type Reply = oneshot::Sender<GroupResult>;

#[derive(Clone)]
pub struct GroupCommit {
    lanes: Vec<mpsc::Sender<(Vec<OwnedEvent>, Reply)>>,
}

impl GroupCommit {
    /// Starts `lanes` writers (one database connection each when busy), batching up to
    /// `max_batch` events per commit.
    pub fn start(store: LedgerStore, lanes: usize, max_batch: usize) -> GroupCommit {
        let lanes = (0..lanes.max(1))
            .map(|_| {
                let (tx, mut rx) = mpsc::channel::<(Vec<OwnedEvent>, Reply)>(max_batch * 8);
                let store = store.clone();
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
                        let (groups, replies): (Vec<Vec<OwnedEvent>>, Vec<Reply>) = jobs.into_iter().unzip();
                        let results = store.append_groups(groups).await;
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

    pub async fn append(&self, event: OwnedEvent) -> Result<(ChainedEvent, bool), LedgerError> {
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
        lane.send((events, tx)).await.map_err(|_| LedgerError::Unavailable("ledger writer stopped".into()))?;
        rx.await.map_err(|_| LedgerError::Unavailable("ledger writer stopped".into()))?
    }
}
