//! A run driven while it is being created. The submitting executor takes the run's lease,
//! then starts its driver and asks the ledger to create the run at the same time, so the
//! first step's decision is asked for while the run is recorded (docs/write-path.md). Until
//! the creation is answered the driver writes nothing: every append, and the opening of a
//! child frame, waits for it; the only call that goes ahead is `Authorize`, which carries the
//! plan being recorded and its digest (`AuthorizeRequest.plan_sha256`). If the creation
//! fails or finds another run (a repeated submission), the driver stops without a write.
//!
//! The run's first step goes further: once its call is allowed, its decision and request are
//! handed to the creation ([`Creation::offer`]), which records them with the run in one
//! transaction (`CreateRunRequest.first_events`) — the run and its first request cost one
//! commit, not two. The creation waits for them a short while only
//! ([`CreationGate::first_step`]); a driver that waits for the creation instead (any other
//! path: a deny, a call decided only once the run is on record, a child frame) lets it go at
//! once, and an offer made too late, or refused by the ledger, is appended as any other.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{oneshot, watch};
use tonic::Status;
use warden_proto::v1 as pb;

use super::PlanAck;

/// The first step's events, handed to the creation, and where its answer goes.
pub struct FirstStep {
    pub events: Vec<pb::EventInput>,
    pub reply: oneshot::Sender<Result<Vec<pb::AppendEventResponse>, Status>>,
}

#[derive(Clone)]
enum State {
    Pending,
    /// Recorded (at the ledger's time, in ms); with the ledger's acknowledgement of the plan
    /// when it gave one.
    Created(Option<PlanAck>, i64),
    /// Not this run: the creation failed or answered another run.
    Abandoned,
}

/// The submitting side: says once how the creation went. Dropped without saying (the
/// submission's call was cancelled), the driver takes the run as not created; if it was in
/// fact recorded, it is a run without a driver, which the sweeper takes over.
pub struct CreationGate(watch::Sender<State>, Option<oneshot::Receiver<FirstStep>>);

impl CreationGate {
    /// The first step's events, if the driver offers them within `within` (before it waits for
    /// the creation in any other way). Asked once: an offer after this is refused.
    pub async fn first_step(&mut self, within: Duration) -> Option<FirstStep> {
        let offered = self.1.take()?;
        tokio::time::timeout(within, offered).await.ok()?.ok()
    }

    pub fn created(self, ack: Option<PlanAck>, created_at_ms: i64) {
        self.0.send_replace(State::Created(ack, created_at_ms));
    }

    pub fn abandoned(self) {
        self.0.send_replace(State::Abandoned);
    }
}

/// The driving side (see the module's documentation).
#[derive(Clone)]
pub struct Creation {
    state: watch::Receiver<State>,
    /// The plan being recorded, as submitted to the ledger (canonical JSON), and its digest.
    plan_json: Arc<str>,
    plan_sha256: Arc<str>,
    /// Taken by the first offer, or by the first wait for the creation (which declines).
    first: Arc<Mutex<Option<oneshot::Sender<FirstStep>>>>,
}

/// A gate for a run about to be created with `plan_json` (its canonical JSON).
pub fn gate(plan_json: Arc<str>) -> (CreationGate, Creation) {
    let (tx, rx) = watch::channel(State::Pending);
    let (offer, offered) = oneshot::channel();
    let plan_sha256 = Arc::from(warden_core::canonical::sha256_hex(plan_json.as_bytes()));
    let first = Arc::new(Mutex::new(Some(offer)));
    (CreationGate(tx, Some(offered)), Creation { state: rx, plan_json, plan_sha256, first })
}

/// How the creation went, once it is known.
pub enum Created {
    /// With the plan's acknowledgement, if any, and when the ledger recorded the run.
    Yes(Option<PlanAck>, i64),
    No,
}

impl Creation {
    /// The plan and its digest while the creation is not answered yet.
    pub fn pending_plan(&self) -> Option<(Arc<str>, Arc<str>)> {
        matches!(*self.state.borrow(), State::Pending).then(|| (self.plan_json.clone(), self.plan_sha256.clone()))
    }

    /// Whether the creation may still take the first step (nobody offered or waited yet).
    pub fn takes_first_step(&self) -> bool {
        self.first.lock().unwrap_or_else(|p| p.into_inner()).as_ref().is_some_and(|offer| !offer.is_closed())
    }

    /// Hands the run's first step's events to the creation, to be recorded with the run; the
    /// answer is the ledger's for them. Given back if the creation no longer takes them (it
    /// was sent already, or another step offered or waited first).
    #[allow(clippy::result_large_err)]
    pub fn offer(
        &self,
        events: Vec<pb::EventInput>,
    ) -> Result<oneshot::Receiver<Result<Vec<pb::AppendEventResponse>, Status>>, Vec<pb::EventInput>> {
        let Some(offer) = self.first.lock().unwrap_or_else(|p| p.into_inner()).take() else { return Err(events) };
        let (reply, answer) = oneshot::channel();
        offer.send(FirstStep { events, reply }).map(|()| answer).map_err(|step| step.events)
    }

    /// Waits until the creation is answered (and lets it go without a first step).
    pub async fn wait(&self) -> Created {
        drop(self.first.lock().unwrap_or_else(|p| p.into_inner()).take());
        let mut state = self.state.clone();
        let settled = state.wait_for(|s| !matches!(s, State::Pending)).await.map(|s| s.clone());
        match settled {
            Ok(State::Created(ack, at)) => Created::Yes(ack, at),
            // Abandoned, or the gate dropped unanswered.
            _ => Created::No,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_gate_tells_its_driver_once_and_a_dropped_gate_means_not_created() {
        let (gate_a, a) = gate(Arc::from("{\"steps\":[]}"));
        let (plan, digest) = a.pending_plan().expect("pending");
        assert_eq!(&*plan, "{\"steps\":[]}");
        assert_eq!(&*digest, warden_core::canonical::sha256_hex(b"{\"steps\":[]}"));
        gate_a.created(None, 7);
        assert!(a.pending_plan().is_none());
        assert!(matches!(a.wait().await, Created::Yes(None, 7)));

        let (gate_b, b) = gate(Arc::from("{}"));
        gate_b.abandoned();
        assert!(matches!(b.wait().await, Created::No));

        let (gate_c, c) = gate(Arc::from("{}"));
        let waiting = tokio::spawn(async move { matches!(c.wait().await, Created::No) });
        drop(gate_c);
        assert!(waiting.await.expect("joined"));
    }

    fn events(n: usize) -> Vec<pb::EventInput> {
        (0..n).map(|i| pb::EventInput { idempotency_key: format!("k{i}"), ..Default::default() }).collect()
    }

    #[tokio::test]
    async fn the_first_step_is_taken_once_and_given_back_when_the_creation_went_without_it() {
        // Offered in time: the creation takes it and answers it.
        let (mut gate_a, a) = gate(Arc::from("{}"));
        assert!(a.takes_first_step());
        let answer = a.offer(events(2)).expect("taken");
        assert!(!a.takes_first_step());
        let step = gate_a.first_step(Duration::from_secs(5)).await.expect("offered");
        assert_eq!(step.events.len(), 2);
        step.reply.send(Ok(Vec::new())).expect("answered");
        assert!(answer.await.expect("answer").is_ok());
        // A second offer is given back.
        assert_eq!(a.offer(events(1)).expect_err("taken already").len(), 1);

        // A wait for the creation lets it go at once; a later offer is given back.
        let (mut gate_b, b) = gate(Arc::from("{}"));
        let waiting = tokio::spawn({
            let b = b.clone();
            async move { matches!(b.wait().await, Created::Yes(None, 7)) }
        });
        // Not the timeout: the declined offer ends the wait.
        assert!(gate_b.first_step(Duration::from_secs(3600)).await.is_none());
        gate_b.created(None, 7);
        assert!(waiting.await.expect("joined"));
        assert_eq!(b.offer(events(3)).expect_err("declined").len(), 3);

        // The creation stopped waiting: the offer is given back whole.
        let (mut gate_c, c) = gate(Arc::from("{}"));
        assert!(gate_c.first_step(Duration::ZERO).await.is_none());
        assert!(!c.takes_first_step());
        assert_eq!(c.offer(events(2)).expect_err("too late").len(), 2);
    }
}
