//! Runs kept whole in the ledger's memory, so an append to a run it wrote lately reads nothing
//! from the database: the run's head (seq, hash, epoch, status), every event by idempotency
//! key, and the receipts taken, as of `head.last_seq`.
//!
//! The database stays the authority. An entry is only ever used by the write lane that owns
//! its run (runs map to lanes by id), it is taken out of the cache for the length of a batch
//! and put back only after that batch committed, and every head write is conditional on the
//! `last_seq` the entry was built from (`… WHERE run_id = $1 AND last_seq = $prev`). So an
//! entry another writer has moved past — a second ledger replica, an import, a summary written
//! outside the batch path — fails that condition: the batch writes nothing, the entry is
//! dropped, and the batch runs again reading the run under its row lock.
//!
//! Bounded: a run over [`MAX_RUN_EVENTS`] events or [`MAX_RUN_BYTES`] is not kept, nor read
//! whole (its appends look up what they need, as before); a run that ended is dropped; and past
//! [`MAX_RUNS`] runs or [`MAX_BYTES`] in all the least recently used are evicted.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

use serde_json::Value;
use warden_core::chain::ChainedEvent;
use warden_core::events::RunStatus;

use super::checks::RunHead;

pub const MAX_RUN_EVENTS: u64 = 4096;
pub const MAX_RUN_BYTES: usize = 8 << 20;
pub const MAX_RUNS: usize = 20_000;
pub const MAX_BYTES: usize = 256 << 20;

/// What an append needs to know of a run.
#[derive(Debug, Clone)]
pub struct RunState {
    pub head: RunHead,
    /// `last_seq` as stored when this state was built or last committed: the condition of the
    /// next head write.
    pub stored_seq: u64,
    /// Events by idempotency key: every event of the run when `whole`, otherwise only those
    /// an append looked up.
    pub events: HashMap<String, Arc<ChainedEvent>>,
    /// Receipt ids taken: all of the run's when `whole`, otherwise those looked up.
    pub receipts: HashSet<String>,
    pub whole: bool,
    /// Rough size of what `events` holds.
    pub bytes: usize,
}

impl RunState {
    pub fn new(head: RunHead, whole: bool) -> RunState {
        RunState { stored_seq: head.last_seq, head, events: HashMap::new(), receipts: HashSet::new(), whole, bytes: 0 }
    }

    pub fn remember(&mut self, event: impl Into<Arc<ChainedEvent>>) {
        let event = event.into();
        self.bytes += size_of_event(&event);
        self.events.insert(event.body.idempotency_key.clone(), event);
    }

    /// Takes back an event decided but not written (its group was refused).
    pub fn forget(&mut self, key: &str) {
        if let Some(e) = self.events.remove(key) {
            self.bytes = self.bytes.saturating_sub(size_of_event(&e));
        }
    }

    fn ended(&self) -> bool {
        RunStatus::parse(&self.head.status).is_some_and(RunStatus::is_terminal)
    }

    fn keepable(&self) -> bool {
        self.whole && self.head.last_seq <= MAX_RUN_EVENTS && self.bytes <= MAX_RUN_BYTES && !self.ended()
    }
}

#[derive(Default)]
pub struct HotRuns {
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    runs: HashMap<String, (u64, RunState)>,
    tick: u64,
    bytes: usize,
    /// Runs found too large to keep: their appends look up only what they need instead of
    /// reading the whole run each time. Forgotten wholesale past [`MAX_RUNS`] entries.
    unkept: HashSet<String>,
}

impl Inner {
    fn remove(&mut self, run_id: &str) -> Option<RunState> {
        let (_, state) = self.runs.remove(run_id)?;
        self.bytes = self.bytes.saturating_sub(state.bytes);
        Some(state)
    }
}

impl HotRuns {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // The map is left consistent at every point a panic could unwind from.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Takes the states of those of these runs the cache holds out of it (the others are
    /// read from the database by the batch).
    pub fn take_present(&self, run_ids: &[&str]) -> HashMap<String, RunState> {
        let mut inner = self.lock();
        run_ids.iter().filter_map(|r| inner.remove(r).map(|s| (r.to_string(), s))).collect()
    }

    /// Whether the run was found too large to keep (see [`HotRuns::mark_unkept`]).
    pub fn is_unkept(&self, run_id: &str) -> bool {
        self.lock().unkept.contains(run_id)
    }

    /// Marks a run too large to keep.
    pub fn mark_unkept(&self, run_id: &str) {
        let mut inner = self.lock();
        if inner.unkept.len() >= MAX_RUNS {
            inner.unkept.clear();
        }
        inner.unkept.insert(run_id.to_string());
    }

    /// Keeps a new run's state unless the run is there already (a lane's later state wins).
    pub fn put_new(&self, state: RunState) {
        if self.lock().runs.contains_key(&state.head.run_id) {
            return;
        }
        self.put([state]);
    }

    /// Drops a run (its next append reads it from the database).
    pub fn forget(&self, run_id: &str) {
        self.lock().remove(run_id);
    }

    /// Puts back the states of a committed batch; states that are not whole, too large, or of
    /// runs that ended are dropped. Evicts the least recently used past the bounds.
    pub fn put(&self, states: impl IntoIterator<Item = RunState>) {
        let mut inner = self.lock();
        for mut state in states {
            inner.remove(&state.head.run_id);
            if !state.keepable() {
                if state.whole && !state.ended() {
                    if inner.unkept.len() >= MAX_RUNS {
                        inner.unkept.clear();
                    }
                    inner.unkept.insert(state.head.run_id.clone());
                }
                continue;
            }
            state.stored_seq = state.head.last_seq;
            inner.tick += 1;
            inner.bytes += state.bytes;
            let tick = inner.tick;
            inner.runs.insert(state.head.run_id.clone(), (tick, state));
        }
        if inner.runs.len() > MAX_RUNS || inner.bytes > MAX_BYTES {
            // Down to seven eighths of each bound at once, so eviction is rare.
            let mut ticks: Vec<(u64, String)> = inner.runs.iter().map(|(id, (t, _))| (*t, id.clone())).collect();
            ticks.sort_unstable();
            for (_, id) in ticks {
                if inner.runs.len() <= MAX_RUNS / 8 * 7 && inner.bytes <= MAX_BYTES / 8 * 7 {
                    break;
                }
                inner.remove(&id);
            }
        }
    }

    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.lock().runs.len()
    }
}

/// Roughly what an event occupies in memory (its strings and its payload's text).
fn size_of_event(e: &ChainedEvent) -> usize {
    fn value(v: &Value) -> usize {
        match v {
            Value::String(s) => s.len() + 24,
            Value::Array(a) => 24 + a.iter().map(value).sum::<usize>(),
            Value::Object(o) => 48 + o.iter().map(|(k, v)| k.len() + 32 + value(v)).sum::<usize>(),
            _ => 16,
        }
    }
    let b = &e.body;
    160 + b.run_id.len()
        + b.event_type.len()
        + b.step_id.len()
        + 2 * b.idempotency_key.len()
        + e.prev_hash.len()
        + e.hash.len()
        + value(&b.payload)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn head(run: &str, seq: u64, status: &str) -> RunHead {
        RunHead {
            run_id: run.into(),
            tenant: "t".into(),
            status: status.into(),
            reason: String::new(),
            last_seq: seq,
            head_hash: "h".into(),
            max_epoch: 1,
            updated_at_ms: 0,
        }
    }

    #[test]
    fn only_whole_live_runs_are_kept_and_a_batch_takes_those_held() {
        let hot = HotRuns::default();
        hot.put([
            RunState::new(head("a", 2, "active"), true),
            RunState::new(head("b", 2, "active"), false),
            RunState::new(head("c", 9, "completed"), true),
            RunState::new(head("d", MAX_RUN_EVENTS + 1, "active"), true),
        ]);
        assert_eq!(hot.len(), 1);
        assert!(hot.is_unkept("d") && !hot.is_unkept("c") && !hot.is_unkept("b"), "only a live whole run is too large");
        let taken = hot.take_present(&["a", "b"]);
        assert_eq!(taken.keys().collect::<Vec<_>>(), ["a"], "b is read by the batch");
        assert_eq!(taken["a"].stored_seq, 2);
        assert_eq!(hot.len(), 0, "taken out for the batch");
        let mut a = taken.into_values().next().unwrap();
        a.head.last_seq = 5;
        hot.put([a]);
        assert_eq!(hot.take_present(&["a"])["a"].stored_seq, 5, "the committed head is the next condition");
    }

    #[test]
    fn the_least_recently_used_go_first() {
        let hot = HotRuns::default();
        for i in 0..MAX_RUNS + 1 {
            hot.put([RunState::new(head(&format!("r{i}"), 2, "active"), true)]);
        }
        assert!(hot.len() <= MAX_RUNS / 8 * 7);
        assert!(hot.take_present(&["r0"]).is_empty());
        assert_eq!(hot.take_present(&[&format!("r{MAX_RUNS}")]).len(), 1);
    }
}
