//! Admission of new runs.
//!
//! Without admission, a burst of submissions would each wait for a database connection of
//! their own, and past the pool's acquire timeout some of them would fail UNAVAILABLE. Here
//! they wait in a queue instead. Root runs are written together: whatever has queued up
//! while the previous write was committing goes in the next one, as one statement with one
//! commit, up to `max_batch` runs and a bounded statement size. At most [`WRITERS`] such
//! writes are in flight (one on SQLite, which has a single writer).
//!
//! The queue is bounded twice: by the number of submissions waiting
//! (`ledger.max_pending_runs`) and by their size in bytes (`ledger.max_pending_run_bytes`).
//! A submission past either bound is refused at once with RESOURCE_EXHAUSTED and a
//! `RetryInfo`, before anything is prepared or written. A submission already waiting is not
//! timed out by the ledger; the caller's own deadline bounds its wait. Under light load a
//! write holds a single run, so nothing is added to its latency.
//!
//! A child frame also takes a place in the bounds, but it is written on its own, in a
//! transaction that counts it against its root's limit.

use std::sync::Arc;

use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, oneshot};
use tracing::Instrument;

use crate::error::LedgerError;
use crate::store::{Backend, CreatedRun, LedgerStore, PreparedRun};

/// Writes of queued runs in flight at once on PostgreSQL: one commits while the next one is
/// gathered and sent.
const WRITERS: usize = 2;

/// Most values bound in one write. PostgreSQL's limit is 65,535; this stays well under it.
const MAX_BINDS: usize = 30_000;

/// Most bytes of submissions written together, so that one statement stays small.
const MAX_WRITE_BYTES: usize = 4 << 20;

/// A submission's place in the queue's bounds. It is held until the submission is answered,
/// or until its caller goes away.
pub struct Place {
    _count: OwnedSemaphorePermit,
    _bytes: OwnedSemaphorePermit,
    bytes: usize,
}

struct Job {
    run: PreparedRun,
    place: Place,
    reply: oneshot::Sender<Result<CreatedRun, LedgerError>>,
    span: tracing::Span,
}

#[derive(Clone)]
pub struct Admission {
    store: LedgerStore,
    queue: mpsc::UnboundedSender<Job>,
    count: Arc<Semaphore>,
    bytes: Arc<Semaphore>,
    max_pending: usize,
    max_bytes: usize,
}

impl Admission {
    /// Starts the writer of queued runs. `max_pending` and `max_bytes` bound the queue;
    /// `max_batch` bounds how many runs one write holds.
    pub fn start(store: LedgerStore, max_pending: usize, max_bytes: usize, max_batch: usize) -> Admission {
        let (queue, rx) = mpsc::unbounded_channel();
        let writers = if store.backend() == Backend::Sqlite { 1 } else { WRITERS };
        tokio::spawn(write_queued(store.clone(), rx, writers, max_batch.max(1)));
        let (max_pending, max_bytes) = (max_pending.clamp(1, Semaphore::MAX_PERMITS), max_bytes.max(1));
        Admission {
            store,
            queue,
            count: Arc::new(Semaphore::new(max_pending)),
            bytes: Arc::new(Semaphore::new(max_bytes.min(Semaphore::MAX_PERMITS))),
            max_pending,
            max_bytes,
        }
    }

    /// Takes a place for a submission of `bytes` (its request's encoded size), or refuses it
    /// at once when the queue is full.
    pub fn admit(&self, bytes: usize) -> Result<Place, LedgerError> {
        let full = |what: String| {
            warden_telemetry::metrics::ledger_submission_refused();
            LedgerError::Busy(format!("the ledger has {what} waiting to be recorded: try again shortly"))
        };
        let count = self
            .count
            .clone()
            .try_acquire_owned()
            .map_err(|_| full(format!("{} run submissions (ledger.max_pending_runs)", self.max_pending)))?;
        let n = u32::try_from(bytes.max(1)).unwrap_or(u32::MAX);
        let held = self.bytes.clone().try_acquire_many_owned(n).map_err(|_| {
            full(format!("up to {} bytes of run submissions (ledger.max_pending_run_bytes)", self.max_bytes))
        })?;
        Ok(Place { _count: count, _bytes: held, bytes })
    }

    /// Writes a prepared submission in its place: a root run through the queue, a frame on its
    /// own.
    pub async fn create(&self, place: Place, run: PreparedRun) -> Result<CreatedRun, LedgerError> {
        if run.is_frame() {
            let answer = self.store.create_runs(vec![run]).await.pop();
            drop(place);
            return answer.unwrap_or_else(|| Err(LedgerError::Internal("the creation was not answered".into())));
        }
        let (reply, answer) = oneshot::channel();
        let job = Job { run, place, reply, span: tracing::Span::current() };
        let stopped = || LedgerError::Unavailable("the ledger's run writer stopped".into());
        self.queue.send(job).map_err(|_| stopped())?;
        answer.await.map_err(|_| stopped())?
    }
}

/// The jobs of one write: `first` and whatever is queued behind it, within a write's bounds,
/// and the job that did not fit, if any. A job whose caller went away is left out unwritten,
/// and its place freed. Its caller learns nothing more of it (a lost answer is read as a
/// creation that may have been recorded, and looked up). The ledger writes no run its
/// submitter stopped waiting for while it was queued.
fn gather(first: Job, rx: &mut mpsc::UnboundedReceiver<Job>, max_batch: usize) -> (Vec<Job>, Option<Job>) {
    let (mut binds, mut bytes) = (0, 0);
    let mut jobs = Vec::new();
    let mut next = Some(first);
    while let Some(job) = next.take().or_else(|| if jobs.len() < max_batch { rx.try_recv().ok() } else { None }) {
        if job.reply.is_closed() {
            continue;
        }
        let fits = binds + job.run.binds() <= MAX_BINDS && bytes + job.place.bytes <= MAX_WRITE_BYTES;
        if !fits && !jobs.is_empty() {
            return (jobs, Some(job));
        }
        binds += job.run.binds();
        bytes += job.place.bytes;
        jobs.push(job);
    }
    (jobs, None)
}

/// Takes queued runs and writes them, gathering into each write whatever queued up while
/// the writes before it were in flight.
async fn write_queued(store: LedgerStore, mut rx: mpsc::UnboundedReceiver<Job>, writers: usize, max_batch: usize) {
    let in_flight = Arc::new(Semaphore::new(writers));
    let mut held: Option<Job> = None;
    loop {
        let first = match held.take() {
            Some(job) => job,
            None => match rx.recv().await {
                Some(job) => job,
                None => return,
            },
        };
        // A write slot first: what queues while waiting for it joins this write.
        let Ok(slot) = in_flight.clone().acquire_owned().await else { return };
        let jobs;
        (jobs, held) = gather(first, &mut rx, max_batch);
        if jobs.is_empty() {
            continue;
        }
        let span = tracing::info_span!(parent: &jobs[0].span, "ledger.create_runs", batch.runs = jobs.len());
        for other in &jobs[1..] {
            warden_telemetry::context::link(&span, &other.span);
        }
        let store = store.clone();
        tokio::spawn(
            async move {
                let mut runs = Vec::with_capacity(jobs.len());
                let mut waiting = Vec::with_capacity(jobs.len());
                for job in jobs {
                    runs.push(job.run);
                    waiting.push((job.reply, job.place));
                }
                let answers = store.create_runs(runs).await;
                drop(slot);
                for ((reply, place), answer) in waiting.into_iter().zip(answers) {
                    // Its place is free once it is answered. A caller that went away had its
                    // run written (or not): a retry with the same key finds out which.
                    drop(place);
                    let _ = reply.send(answer);
                }
            }
            .instrument(span),
        );
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;
    use tonic_types::StatusExt;

    use super::*;
    use crate::store::test_sqlite as store;

    fn refused(place: Result<Place, LedgerError>) -> tonic::Status {
        let Err(e) = place else { panic!("admitted past the bound") };
        let status = tonic::Status::from(e);
        assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status:?}");
        assert!(status.get_details_retry_info().and_then(|r| r.retry_delay).is_some(), "a retry hint");
        status
    }

    #[tokio::test]
    async fn a_full_queue_refuses_at_once_and_frees_its_places() {
        let (_dir, store) = store().await;
        let admission = Admission::start(store, 2, 100, 16);
        let (first, second) = (admission.admit(10).expect("first"), admission.admit(10).expect("second"));
        assert!(refused(admission.admit(10)).message().contains("ledger.max_pending_runs"));
        drop(first);
        let third = admission.admit(70).expect("a place freed");
        drop(second);
        assert!(refused(admission.admit(31)).message().contains("ledger.max_pending_run_bytes"));
        drop(third);
        admission.admit(100).expect("every byte free again");
    }

    #[tokio::test]
    async fn a_write_leaves_out_submissions_whose_callers_went_away() {
        let (_dir, store) = store().await;
        let admission = Admission::start(store.clone(), 5, 16 << 20, 8);
        let plan = json!({ "steps": [] });
        let job = |id: &str, bytes: usize| {
            let (reply, answer) = oneshot::channel();
            let run = store.prepare_run(crate::store::test_run(id, "", &plan));
            let place = admission.admit(bytes).expect("a place");
            (Job { run, place, reply, span: tracing::Span::none() }, answer)
        };
        let (gone, answer) = job("gone", 10);
        drop(answer);
        let (kept, _kept) = job("kept", 3 << 20);
        let (also_gone, answer) = job("also-gone", 10);
        drop(answer);
        let (too_big, _too_big) = job("too-big", 3 << 20);
        let (queue, mut rx) = mpsc::unbounded_channel();
        for queued in [kept, also_gone, too_big] {
            queue.send(queued).map_err(|_| "queued").expect("queued");
        }
        let (jobs, held) = gather(gone, &mut rx, 8);
        let ids: Vec<&str> = jobs.iter().map(|j| j.run.run_id()).collect();
        assert_eq!(ids, ["kept"], "those whose callers went away are left out");
        assert_eq!(held.as_ref().map(|j| j.run.run_id()), Some("too-big"), "past the write's bytes: the next write");
        // The places left out are free again: two held (kept, too-big), three free.
        for _ in 0..3 {
            std::mem::forget(admission.admit(1).expect("a place freed"));
        }
        assert!(admission.admit(1).is_err(), "the two kept still hold theirs");
    }

    #[tokio::test]
    async fn queued_submissions_are_each_answered() {
        let (_dir, store) = store().await;
        let admission = Admission::start(store.clone(), 64, 1 << 20, 8);
        let plan = json!({ "steps": [] });
        let ids: Vec<String> = (0..40).map(|i| format!("r{i}")).collect();
        let created = futures::future::join_all(ids.iter().map(|id| {
            let (admission, store, plan) = (admission.clone(), store.clone(), &plan);
            async move {
                let place = admission.admit(100).expect("admitted");
                let run = store.prepare_run(crate::store::test_run(id, "", plan));
                admission.create(place, run).await.map(|c| c.run.run_id)
            }
        }))
        .await;
        let created: Vec<String> = created.into_iter().map(|r| r.expect("created")).collect();
        assert_eq!(created, ids);
        for id in &ids {
            let events = store.events(id, 0, 10).await.expect("events");
            assert_eq!(events.len(), 2, "{id}");
        }
        // Every place was given back.
        for _ in 0..64 {
            std::mem::forget(admission.admit(1).expect("a place"));
        }
    }
}
