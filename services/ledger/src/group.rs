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
    lanes: Vec<Lane>,
    store: LedgerStore,
    followers: Arc<Followers>,
    /// Groups committed in their caller's task, since start.
    in_caller: Arc<std::sync::atomic::AtomicU64>,
}

/// A lane's queue, and the lock its writer holds while it commits: an append that finds the
/// queue empty and the lock free commits in its own task instead ([`GroupCommit::append_group`]).
#[derive(Clone)]
struct Lane {
    queue: mpsc::Sender<Job>,
    committing: Arc<tokio::sync::Mutex<()>>,
}

impl GroupCommit {
    /// Starts `lanes` writers (one database connection each when busy), batching up to
    /// `max_batch` events per commit. Each commit's new events are published to the runs'
    /// `followers` before anyone is answered.
    pub fn start(store: LedgerStore, lanes: usize, max_batch: usize, followers: Arc<Followers>) -> GroupCommit {
        let lanes = (0..lanes.max(1))
            .map(|_| {
                let (tx, mut rx) = mpsc::channel::<Job>(max_batch * 8);
                let committing = Arc::new(tokio::sync::Mutex::new(()));
                let (store, followers, lock) = (store.clone(), followers.clone(), committing.clone());
                tokio::spawn(async move {
                    while let Some(first) = rx.recv().await {
                        let _committing = lock.lock().await;
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
                Lane { queue: tx, committing }
            })
            .collect();
        GroupCommit { lanes, store, followers, in_caller: Arc::default() }
    }

    /// The lane's lock, when its queue is empty and its writer is not committing (and the
    /// store commits in place at all).
    fn idle<'a>(&self, lane: &'a Lane) -> Option<tokio::sync::MutexGuard<'a, ()>> {
        if !self.store.commits_in_place() || lane.queue.capacity() != lane.queue.max_capacity() {
            return None;
        }
        lane.committing.try_lock().ok()
    }

    /// Groups committed in their caller's task (an idle lane, in place), since start.
    pub fn committed_in_caller(&self) -> u64 {
        self.in_caller.load(std::sync::atomic::Ordering::Relaxed)
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
        let started = std::time::Instant::now();
        // An idle lane (nothing queued, its writer not committing) on SQLite: committed here,
        // in this task, when it can be in place; the lane's writer waits for the lock meanwhile.
        // One run's appends that wait for each other's answers (a driver's) stay in order;
        // appends made at once are in the order they commit, as in the lane (a job the writer
        // took but has not yet locked for can be passed).
        let events = match self.idle(lane) {
            // Traced as the lane traces a batch: under the request that brought it.
            Some(_committing) => {
                match tracing::info_span!("ledger.batch_commit", batch.events = events.len(), batch.groups = 1)
                    .in_scope(|| self.store.append_in_place_now(events))
                {
                    Ok(result) => {
                        self.in_caller.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let events = result.as_ref().map_or(0, Vec::len);
                        warden_telemetry::metrics::ledger_batch_committed(events, started.elapsed());
                        for appended in result.iter() {
                            self.followers.publish(appended);
                        }
                        warden_telemetry::metrics::ledger_appended(started.elapsed());
                        return result;
                    }
                    Err(events) => events,
                }
            }
            None => events,
        };
        let (tx, rx) = oneshot::channel();
        let job = (events, tx, tracing::Span::current());
        lane.queue.send(job).await.map_err(|_| LedgerError::Unavailable("ledger writer stopped".into()))?;
        let result = rx.await.map_err(|_| LedgerError::Unavailable("ledger writer stopped".into()))?;
        warden_telemetry::metrics::ledger_appended(started.elapsed());
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn note(key: &str) -> OwnedEvent {
        crate::store::test_note("a", key)
    }

    async fn appended(writer: &GroupCommit, key: &str) -> Vec<bool> {
        writer.append_group(vec![note(key)]).await.expect("appended").into_iter().map(|(_, repeat)| repeat).collect()
    }

    /// On SQLite an idle lane's append is committed in the caller's task; a repeat, or an
    /// append that finds the file's lock held, goes to the lane's writer, which answers it as
    /// before (the held lock waited out); the run's next appends are in the caller's again, and
    /// the chain is one, in order, linked.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_idle_lane_commits_in_the_callers_task_and_hands_the_rest_to_its_writer() {
        let (dir, store) = crate::store::test_sqlite().await;
        let plan = json!({ "steps": [] });
        store.create_run(crate::store::test_run("a", "", &plan)).await.expect("created");
        let writer = GroupCommit::start(store.clone(), 1, 64, Arc::new(Followers::default()));

        assert_eq!(appended(&writer, "n1").await, [false]);
        assert_eq!(writer.committed_in_caller(), 1, "in the caller's task");
        assert_eq!(appended(&writer, "n1").await, [true], "a repeat is answered as one");
        assert_eq!(writer.committed_in_caller(), 1, "the repeat went to the lane");

        let other = rusqlite::Connection::open(dir.path().join("ledger.db")).expect("second connection");
        other.execute_batch("BEGIN IMMEDIATE").expect("the lock");
        let appending = {
            let writer = writer.clone();
            tokio::spawn(async move { appended(&writer, "n2").await })
        };
        // Tried in the caller's task first: deferred there (nothing written), then queued.
        let waited = std::time::Instant::now();
        while store.in_place_counts().1 == 0 {
            assert!(waited.elapsed() < std::time::Duration::from_secs(30), "the append never met the lock");
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        assert!(!appending.is_finished(), "written while another writer held the lock");
        other.execute_batch("COMMIT").expect("released");
        assert_eq!(appending.await.expect("joined"), [false]);
        assert_eq!(writer.committed_in_caller(), 1, "the lane's writer waited the lock out");

        // The lane read the run back for n2 and holds it in memory again.
        assert_eq!(appended(&writer, "n3").await, [false]);
        assert_eq!(appended(&writer, "n4").await, [false]);
        assert_eq!(writer.committed_in_caller(), 3, "in the caller's task again");

        let events = store.events("a", 0, 100).await.expect("events");
        let keys: Vec<&str> =
            events.iter().map(|e| e.body.idempotency_key.as_str()).filter(|k| k.starts_with('n')).collect();
        assert_eq!(keys, ["n1", "n2", "n3", "n4"]);
        for (i, pair) in events.windows(2).enumerate() {
            assert_eq!(pair[1].body.seq, pair[0].body.seq + 1, "contiguous at {i}");
            assert_eq!(pair[1].prev_hash, pair[0].hash, "linked at {i}");
        }
        let head = store.get_run("a").await.expect("read").expect("the run");
        let last = events.last().expect("events");
        assert_eq!((head.last_seq, head.head_hash.as_str()), (last.body.seq, last.hash.as_str()));
    }
}
