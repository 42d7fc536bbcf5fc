//! Group commit: appends queue per lane (a run always maps to the same lane, so a run's
//! appends never contend across lanes), and each lane writes whatever has queued up while
//! its previous batch was committing as one database transaction — one commit (one WAL
//! flush) for many events. Under light load a batch is a single event: no added latency.

use tokio::sync::{mpsc, oneshot};
use warden_core::chain::ChainedEvent;

use crate::error::LedgerError;
use crate::store::{LedgerStore, OwnedEvent};

type Reply = oneshot::Sender<Result<(ChainedEvent, bool), LedgerError>>;

#[derive(Clone)]
pub struct GroupCommit {
    lanes: Vec<mpsc::Sender<(OwnedEvent, Reply)>>,
}

impl GroupCommit {
    /// Starts `lanes` writers (one database connection each when busy), batching up to
    /// `max_batch` events per commit.
    pub fn start(store: LedgerStore, lanes: usize, max_batch: usize) -> GroupCommit {
        let lanes = (0..lanes.max(1))
            .map(|_| {
                let (tx, mut rx) = mpsc::channel::<(OwnedEvent, Reply)>(max_batch * 8);
                let store = store.clone();
                tokio::spawn(async move {
                    while let Some(first) = rx.recv().await {
                        let mut jobs = vec![first];
                        while jobs.len() < max_batch {
                            match rx.try_recv() {
                                Ok(j) => jobs.push(j),
                                Err(_) => break,
                            }
                        }
                        let (events, replies): (Vec<OwnedEvent>, Vec<Reply>) = jobs.into_iter().unzip();
                        let results = store.append_batch(events).await;
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
        let h = event.run_id.bytes().fold(0xcbf29ce484222325u64, |h, b| (h ^ b as u64).wrapping_mul(0x100000001b3));
        let lane = &self.lanes[(h % self.lanes.len() as u64) as usize];
        let (tx, rx) = oneshot::channel();
        lane.send((event, tx)).await.map_err(|_| LedgerError::Unavailable("ledger writer stopped".into()))?;
        rx.await.map_err(|_| LedgerError::Unavailable("ledger writer stopped".into()))?
    }
}
