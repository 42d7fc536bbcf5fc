//! A run driven while it is being created. The submitting executor takes the run's lease,
//! then starts its driver and asks the ledger to create the run at the same time, so the
//! first step's decision is asked for while the run is recorded (docs/write-path.md). Until
//! the creation is answered the driver writes nothing: every append, and the opening of a
//! child frame, waits for it; the only call that goes ahead is `Authorize`, which carries the
//! plan being recorded and its digest (`AuthorizeRequest.plan_sha256`). If the creation
//! fails or finds another run (a repeated submission), the driver stops without a write.

use std::sync::Arc;

use tokio::sync::watch;

use super::PlanAck;

#[derive(Clone)]
enum State {
    Pending,
    /// Recorded; with the ledger's acknowledgement of the plan when it gave one.
    Created(Option<PlanAck>),
    /// Not this run: the creation failed or answered another run.
    Abandoned,
}

/// The submitting side: says once how the creation went. Dropped without saying (the
/// submission's call was cancelled), the driver takes the run as not created; if it was in
/// fact recorded, it is a run without a driver, which the sweeper takes over.
pub struct CreationGate(watch::Sender<State>);

impl CreationGate {
    pub fn created(self, ack: Option<PlanAck>) {
        self.0.send_replace(State::Created(ack));
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
}

/// A gate for a run about to be created with `plan_json` (its canonical JSON).
pub fn gate(plan_json: Arc<str>) -> (CreationGate, Creation) {
    let (tx, rx) = watch::channel(State::Pending);
    let plan_sha256 = Arc::from(warden_core::canonical::sha256_hex(plan_json.as_bytes()));
    (CreationGate(tx), Creation { state: rx, plan_json, plan_sha256 })
}

/// How the creation went, once it is known.
pub enum Created {
    Yes(Option<PlanAck>),
    No,
}

impl Creation {
    /// The plan and its digest while the creation is not answered yet.
    pub fn pending_plan(&self) -> Option<(Arc<str>, Arc<str>)> {
        matches!(*self.state.borrow(), State::Pending).then(|| (self.plan_json.clone(), self.plan_sha256.clone()))
    }

    /// Waits until the creation is answered.
    pub async fn wait(&self) -> Created {
        let mut state = self.state.clone();
        let settled = state.wait_for(|s| !matches!(s, State::Pending)).await.map(|s| s.clone());
        match settled {
            Ok(State::Created(ack)) => Created::Yes(ack),
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
        gate_a.created(None);
        assert!(a.pending_plan().is_none());
        assert!(matches!(a.wait().await, Created::Yes(None)));

        let (gate_b, b) = gate(Arc::from("{}"));
        gate_b.abandoned();
        assert!(matches!(b.wait().await, Created::No));

        let (gate_c, c) = gate(Arc::from("{}"));
        let waiting = tokio::spawn(async move { matches!(c.wait().await, Created::No) });
        drop(gate_c);
        assert!(waiting.await.expect("joined"));
    }
}
