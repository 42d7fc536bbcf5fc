//! Signature checks of concurrent requests, made together.
//!
//! A service that checks a signature on every request (the tool host two, the ledger one per
//! decision) hands them to its [`Verifier`]. One task takes every signature queued by the
//! requests being handled together (those its process's runtime had ready to run) and checks
//! them as one batch
//! (`warden_core::signature::verify_all`), which under load costs about a third of checking
//! each alone. Nothing waits for company: a batch is whatever was queued when the task ran,
//! never held back for more.
//!
//! A lone request is checked in place. Handing it to the task and back costs two hand-overs
//! between tasks (and, with several worker threads, wake-ups of another thread) for a batch
//! of one, on every call of a chain of calls. So once [`LONE_BATCHES`] batches in a row found
//! their request alone, and while no request is queued, a request checks its own signatures.
//! One request in [`PROBE_EVERY`] is queued all the same, and those arriving while any is
//! queued are queued too, so that company, once there is some, is seen: a batch taken while
//! more than one request waited (in it, or in another task's queue) puts every request back
//! through the tasks, until batches find their requests alone again.
//!
//! Under attack: a batch that fails is checked again one signature at a time, so a forged
//! signature queued with honest ones makes its whole batch cost about a third more than
//! checking each alone would have. An attacker who keeps one forgery in every batch takes the
//! gain of batching away, and at most that third beyond it.
//!
//! The answers are `verify_all`'s: [`warden_core::signature::verify`]'s for every signature a
//! forger or an alteration could produce (see there).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use tokio::sync::{mpsc, oneshot};
use warden_core::signature::{Signed, verify_all};

/// Most signatures checked in one batch: a bound on the time one batch holds its thread
/// (about 8 µs each, up to four times that when a batch fails and each is checked alone).
pub const MAX_BATCH: usize = 256;

/// Requests waiting for a checking task; past this, callers wait for room.
const QUEUE: usize = 4096;

/// While requests come alone, one in this many is queued anyway, to see whether others join.
pub const PROBE_EVERY: usize = 8;

/// Requests are checked in place only after this many batches in a row found theirs alone:
/// under load, where most batches have company, a lone batch now and then does not take the
/// requests after it out of their batches.
pub const LONE_BATCHES: usize = 4;

type Job = (Vec<Signed>, oneshot::Sender<Vec<bool>>);

/// Checks signatures of concurrent callers together. Its checking tasks, one per worker
/// thread of the runtime it is first used on, start on that first use; callers take them in
/// turn, so a process with several cores checks on all of them.
#[derive(Default)]
pub struct Verifier {
    queues: OnceLock<Vec<mpsc::Sender<Job>>>,
    next: AtomicUsize,
    company: Arc<Company>,
}

/// What the verifier knows of its callers' company.
#[derive(Default)]
struct Company {
    /// Batches in a row that found their request alone.
    alone: AtomicUsize,
    /// Requests queued and not answered yet.
    queued: AtomicUsize,
    /// Requests so far (which of them probe).
    calls: AtomicUsize,
    /// Batches the tasks checked.
    batches: AtomicUsize,
}

/// Counts a queued request until it is answered or its caller goes away.
struct Queued<'a>(&'a AtomicUsize);

impl Drop for Queued<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Verifier {
    /// Whether each signature verifies, in order. Checked in place when there is no Tokio
    /// runtime to queue on. Every answer is false when the checking task ended with the request
    /// in it (its runtime is shutting down): refused, not acted on.
    pub async fn verify(&self, items: Vec<Signed>) -> Vec<bool> {
        let n = items.len();
        if n == 0 {
            return Vec::new();
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else { return verify_all(&items) };
        let company = &self.company;
        let probe = company.calls.fetch_add(1, Ordering::Relaxed).is_multiple_of(PROBE_EVERY);
        if !probe
            && company.alone.load(Ordering::Relaxed) >= LONE_BATCHES
            && company.queued.load(Ordering::Relaxed) == 0
        {
            return verify_all(&items);
        }
        let queues = self.queues.get_or_init(|| {
            (0..runtime.metrics().num_workers().max(1)).map(|_| start(&runtime, company.clone())).collect::<Vec<_>>()
        });
        let queue = &queues[self.next.fetch_add(1, Ordering::Relaxed) % queues.len()];
        company.queued.fetch_add(1, Ordering::Relaxed);
        let _queued = Queued(&company.queued);
        let (tx, rx) = oneshot::channel();
        match queue.send((items, tx)).await {
            Ok(()) => rx.await.unwrap_or_else(|_| vec![false; n]),
            Err(mpsc::error::SendError((items, _))) => verify_all(&items),
        }
    }
}

fn start(runtime: &tokio::runtime::Handle, company: Arc<Company>) -> mpsc::Sender<Job> {
    let (tx, mut rx) = mpsc::channel::<Job>(QUEUE);
    runtime.spawn(async move {
        while let Some(first) = rx.recv().await {
            // Woken by the first caller, this task may run next (the multi-threaded scheduler
            // runs a task woken by the running one before the others; the current-thread one
            // queues it behind them): yielding lets the tasks already runnable run first, so
            // that those with signatures queue them for this batch.
            tokio::task::yield_now().await;
            let mut count = first.0.len();
            let mut jobs = vec![first];
            while count < MAX_BATCH {
                match rx.try_recv() {
                    Ok(job) => {
                        count += job.0.len();
                        jobs.push(job);
                    }
                    Err(_) => break,
                }
            }
            // Company: more than one request waiting for a check at once, in this batch or in
            // another task's queue (callers take the tasks in turn).
            let waiting = company.queued.load(Ordering::Relaxed);
            if jobs.len() > 1 || waiting > jobs.len() {
                company.alone.store(0, Ordering::Relaxed);
            } else {
                company.alone.fetch_add(1, Ordering::Relaxed);
            }
            company.batches.fetch_add(1, Ordering::Relaxed);
            let mut all = Vec::with_capacity(count);
            let mut replies = Vec::with_capacity(jobs.len());
            for (items, reply) in jobs {
                replies.push((items.len(), reply));
                all.extend(items);
            }
            let mut answers = verify_all(&all).into_iter();
            for (n, reply) in replies {
                // A caller that went away has no use for its answers.
                let _ = reply.send(answers.by_ref().take(n).collect());
            }
        }
    });
    tx
}

#[cfg(test)]
mod tests {
    use ed25519_dalek::{Signer, SigningKey};

    use super::*;

    fn signed(key: u8, message: &str) -> Signed {
        let key = SigningKey::from_bytes(&[key; 32]);
        Signed { key: key.verifying_key(), signature: key.sign(message.as_bytes()), message: message.into() }
    }

    #[tokio::test(flavor = "current_thread")]
    async fn concurrent_callers_are_answered_each_for_their_own_signatures() {
        let verifier = Verifier::default();
        // Queued together while the checking task waits for its turn on this one thread.
        let calls = (0..40u8).map(|i| {
            let mut items = vec![signed(1, &format!("a{i}")), signed(2, &format!("b{i}"))];
            if i % 5 == 0 {
                items[1].message.push(b'!'); // altered after signing
            }
            let verifier = &verifier;
            async move { (i, verifier.verify(items).await) }
        });
        for (i, answers) in futures::future::join_all(calls).await {
            assert_eq!(answers, [true, i % 5 != 0], "caller {i}");
        }
        assert!(verifier.verify(Vec::new()).await.is_empty());
    }

    /// Callers alone check their signatures themselves once a few batches in a row found
    /// them alone, but for one in [`PROBE_EVERY`]; callers together are checked as one batch,
    /// and after it callers go through the task again until batches find them alone again.
    #[tokio::test(flavor = "current_thread")]
    async fn lone_callers_check_in_place_and_callers_together_in_one_batch() {
        let verifier = Verifier::default();
        let batches = || verifier.company.batches.load(Ordering::Relaxed);
        for i in 0..2 * PROBE_EVERY {
            let mut item = signed(1, &format!("lone{i}"));
            if i % 3 == 0 {
                item.message.push(b'!');
            }
            assert_eq!(verifier.verify(vec![item]).await, [i % 3 != 0], "lone caller {i}");
        }
        assert_eq!(batches(), LONE_BATCHES + 1, "the first callers and a probe went through the task");
        // The next caller probes; those queued after it join its batch.
        let calls = (0..10u8).map(|i| {
            let verifier = &verifier;
            async move { verifier.verify(vec![signed(2, &format!("c{i}"))]).await }
        });
        for answers in futures::future::join_all(calls).await {
            assert_eq!(answers, [true]);
        }
        let together = batches();
        assert_eq!(together, LONE_BATCHES + 2, "ten callers together, one batch");
        for i in 0..LONE_BATCHES {
            assert_eq!(verifier.verify(vec![signed(3, &format!("after{i}"))]).await, [true]);
        }
        assert_eq!(batches(), together + LONE_BATCHES, "company was seen: through the task");
        let mut bad = signed(3, "alone again");
        bad.message.push(b'!');
        assert_eq!(verifier.verify(vec![signed(3, "alone"), bad]).await, [true, false]);
        assert_eq!(batches(), together + LONE_BATCHES, "batches found their callers alone: in place");
    }

    #[test]
    fn without_a_runtime_to_queue_on_signatures_are_checked_in_place() {
        let verifier = Verifier::default();
        let mut bad = signed(1, "b");
        bad.message.push(b'!');
        let answers = futures::executor::block_on(verifier.verify(vec![signed(1, "a"), bad]));
        assert_eq!(answers, [true, false]);
    }
}
