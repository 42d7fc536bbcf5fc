//! What a driver knows of its run's log, so `WaitRun` can be answered from it without reading
//! the log back (docs/write-path.md, "`WaitRun` answered by the driver").
//!
//! The driver of a run submitted here starts from a view that folds the run's log exactly up
//! to its second event (the first two, as the ledger records them). From then on it keeps
//! every event it appended, by the seq the ledger gave it. (A run taken over is not kept so.) When it stops, its run
//! is known exactly if those seqs follow the view's without a gap: then no other writer
//! (a cancel, an approval, an operator, a second driver) appended anything in between, and
//! folding them gives what folding the ledger's log up to the last of them gives. Anything
//! else — a gap, a repeat answered with an event this driver did not keep, too much to keep —
//! and the run is not known: `WaitRun` reads the log as before.
//!
//! A payload is folded as the ledger returns it (its canonical JSON, RFC 8785), so an output's
//! key order and number spelling are the ones `GetRun` answers with.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};

use serde_json::Value;
use warden_core::run::RunView;
use warden_proto::v1 as pb;

/// Most events a driver keeps for its answer; a longer run is read back.
pub const MAX_EVENTS: usize = 4096;
/// Most payload bytes a driver keeps for its answer; a larger run is read back.
pub const MAX_BYTES: usize = 8 << 20;
/// Most payload bytes all of a process's drivers keep together; past it, the runs that would
/// keep more are read back.
pub const MAX_PROCESS_BYTES: usize = 64 << 20;

/// Payload bytes kept by every driver of the process.
static KEPT: AtomicUsize = AtomicUsize::new(0);

/// Takes `n` bytes of the process's budget, if there are that many left.
fn charge(n: usize) -> bool {
    KEPT.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |kept| {
        kept.checked_add(n).filter(|&k| k <= MAX_PROCESS_BYTES)
    })
    .is_ok()
}

/// One event this driver appended, not folded yet.
struct Appended {
    event_type: String,
    step_id: String,
    payload_json: String,
    timestamp_ms: i64,
}

#[derive(Default)]
pub(crate) struct Known {
    state: State,
    /// The run's creation time (the ledger's), once the driver has it.
    created_at_ms: Option<i64>,
}

#[derive(Default)]
enum State {
    /// No exact view yet (the driver has not read or built one).
    #[default]
    Unstarted,
    Tracking {
        /// Folds the log exactly up to `view.last_seq`.
        view: Box<RunView>,
        after: BTreeMap<u64, Appended>,
        bytes: usize,
    },
    /// Something was appended that this driver cannot account for.
    Lost,
}

/// A run as its driver left it: what `Runs.GetRun` would answer from the ledger's log up to
/// `last_seq`.
pub(crate) struct Final {
    pub view: RunView,
    pub last_seq: u64,
    pub created_at_ms: i64,
    pub updated_at_ms: i64,
}

impl Known {
    /// Starts from `view`, which folds the run's log exactly up to `view.last_seq`.
    pub fn start(&mut self, view: &RunView) {
        if matches!(self.state, State::Unstarted) {
            self.state = State::Tracking { view: Box::new(view.clone()), after: BTreeMap::new(), bytes: 0 };
        }
    }

    pub fn created_at(&mut self, ms: i64) {
        self.created_at_ms = Some(ms);
    }

    /// Notes the ledger's answers to an append of `sent` (one answer per event, in order),
    /// keeping what it needs of the events sent (they were the request's: nothing is copied).
    pub fn appended(&mut self, sent: Vec<pb::EventInput>, answers: &[pb::AppendEventResponse]) {
        if sent.len() != answers.len() {
            self.lose();
            return;
        }
        for (input, answer) in sent.into_iter().zip(answers) {
            let State::Tracking { view, after, bytes } = &mut self.state else { return };
            let Some(event) = &answer.event else {
                self.lose();
                return;
            };
            if event.seq <= view.last_seq || after.contains_key(&event.seq) {
                // Folded already, or kept: a repeat of what this driver recorded.
                continue;
            }
            if answer.deduplicated {
                // Recorded first by someone else (its payload is not the one sent).
                self.lose();
                return;
            }
            let n = input.payload_json.len();
            if after.len() >= MAX_EVENTS || *bytes + n > MAX_BYTES || !charge(n) {
                self.lose();
                return;
            }
            *bytes += n;
            after.insert(
                event.seq,
                Appended {
                    event_type: input.event_type,
                    step_id: input.step_id,
                    payload_json: input.payload_json,
                    timestamp_ms: event.timestamp_ms,
                },
            );
        }
    }

    /// The run as of the last event this driver appended, if its log is known without a gap
    /// up to there.
    pub fn finish(&mut self) -> Option<Final> {
        let State::Tracking { mut view, after, bytes } = std::mem::replace(&mut self.state, State::Lost) else {
            return None;
        };
        KEPT.fetch_sub(bytes, Ordering::Relaxed);
        let created_at_ms = self.created_at_ms?;
        let mut updated_at_ms = None;
        for (seq, e) in after {
            if seq != view.last_seq + 1 {
                return None;
            }
            let payload = as_recorded(&e.payload_json)?;
            view.apply(seq, &e.event_type, &e.step_id, &payload);
            updated_at_ms = Some(e.timestamp_ms);
        }
        let last_seq = view.last_seq;
        Some(Final { view: *view, last_seq, created_at_ms, updated_at_ms: updated_at_ms? })
    }
}

impl Known {
    /// Gives up on answering: what was kept is let go.
    fn lose(&mut self) {
        if let State::Tracking { bytes, .. } = std::mem::replace(&mut self.state, State::Lost) {
            KEPT.fetch_sub(bytes, Ordering::Relaxed);
        }
    }
}

impl Drop for Known {
    fn drop(&mut self) {
        self.lose();
    }
}

/// `GetRun`'s answer for the run as its driver left it.
pub(crate) fn answer(run_id: &str, tenant: &str, last: Final) -> pb::Run {
    let status = warden_grpc::convert::status_to_proto(last.view.status) as i32;
    // As the ledger's row keeps it (PostgreSQL text holds no NUL; the event has it exactly).
    let reason = last.view.reason.replace('\0', "\u{FFFD}");
    let head = crate::runs::Head {
        status,
        reason,
        created_at_ms: last.created_at_ms,
        updated_at_ms: last.updated_at_ms,
        last_seq: last.last_seq,
    };
    crate::runs::run_answer(run_id.to_string(), tenant.to_string(), head, last.view)
}

/// A payload as the ledger records and returns it: parsed from its canonical JSON.
fn as_recorded(payload_json: &str) -> Option<Value> {
    let sent: Value = serde_json::from_str(payload_json).ok()?;
    let canonical = warden_core::canonical::canonical_value(&sent);
    if canonical == payload_json { Some(sent) } else { serde_json::from_str(&canonical).ok() }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use warden_core::events;

    fn input(event_type: &str, step_id: &str, payload: Value) -> pb::EventInput {
        pb::EventInput {
            idempotency_key: format!("{event_type}:{step_id}"),
            event_type: event_type.into(),
            payload_json: payload.to_string(),
            step_id: step_id.into(),
        }
    }

    fn answer(seq: u64, deduplicated: bool) -> pb::AppendEventResponse {
        pb::AppendEventResponse {
            event: Some(pb::Event { seq, timestamp_ms: 1000 + seq as i64, ..Default::default() }),
            deduplicated,
            request_ack: None,
        }
    }

    /// A run of one step `a` whose view folds seqs 1 and 2 (submitted, started).
    fn started() -> Known {
        let mut view = RunView::default();
        let plan = json!({"steps": [{"id": "a", "tool": "echo", "params": {}}]});
        view.apply(1, events::RUN_SUBMITTED, "", &json!({"tenant": "t", "plan": plan}));
        view.apply(2, events::RUN_STARTED, "", &json!({"executor_id": "x", "epoch": 1}));
        let mut known = Known::default();
        known.start(&view);
        known.created_at(999);
        known
    }

    fn completed_step() -> Vec<pb::EventInput> {
        vec![
            input(events::TOOL_REQUESTED, "a", json!({"tool": "echo", "args_sha256": "x", "attempt": 1})),
            // Keys out of order and a number spelled as the ledger would not: folded as recorded.
            input(events::TOOL_COMPLETED, "a", json!({"output": {"z": 1.0, "a": 2}})),
        ]
    }

    #[test]
    fn a_gapless_log_folds_as_the_ledger_returns_it() {
        let mut known = started();
        let sent = completed_step();
        known.appended(sent, &[answer(3, false), answer(4, false)]);
        let done = vec![input(events::RUN_COMPLETED, "", json!({}))];
        known.appended(done.clone(), &[answer(5, false)]);
        // A repeat of an event kept changes nothing.
        known.appended(done, &[answer(5, true)]);
        let last = known.finish().expect("known");
        assert_eq!((last.last_seq, last.created_at_ms, last.updated_at_ms), (5, 999, 1005));
        assert_eq!(last.view.status, events::RunStatus::Completed);
        let output = last.view.steps[0].output.as_ref().expect("output").to_string();
        assert_eq!(output, r#"{"a":2,"z":1}"#);
    }

    #[test]
    fn answers_out_of_order_still_fold_in_seq_order() {
        let mut known = started();
        let sent = completed_step();
        known.appended(sent[1..].to_vec(), &[answer(4, false)]);
        known.appended(sent[..1].to_vec(), &[answer(3, false)]);
        known.appended(vec![input(events::RUN_COMPLETED, "", json!({}))], &[answer(5, false)]);
        assert_eq!(known.finish().expect("known").view.steps[0].status, warden_core::run::StepStatus::Completed);
    }

    #[test]
    fn another_writers_event_or_a_foreign_repeat_makes_the_run_unknown() {
        // A gap: seq 4 was someone else's.
        let mut known = started();
        known.appended(completed_step()[..1].to_vec(), &[answer(3, false)]);
        known.appended(vec![input(events::RUN_COMPLETED, "", json!({}))], &[answer(5, false)]);
        assert!(known.finish().is_none());

        // Answered with an event someone else recorded first.
        let mut known = started();
        known.appended(completed_step()[..1].to_vec(), &[answer(3, true)]);
        assert!(known.finish().is_none());

        // Nothing appended, no creation time, never started: nothing to answer from.
        assert!(started().finish().is_none());
        let mut known = started();
        known.created_at_ms = None;
        known.appended(vec![input(events::RUN_COMPLETED, "", json!({}))], &[answer(3, false)]);
        assert!(known.finish().is_none());
        let mut known = Known::default();
        known.created_at(1);
        known.appended(vec![input(events::RUN_COMPLETED, "", json!({}))], &[answer(3, false)]);
        assert!(known.finish().is_none());
    }

    #[test]
    fn the_process_budget_is_never_overdrawn() {
        assert!(!charge(MAX_PROCESS_BYTES + 1));
        assert!(charge(0));
    }

    #[test]
    fn a_run_too_large_to_keep_is_not_known() {
        let mut known = started();
        let big = "x".repeat(MAX_BYTES);
        known.appended(vec![input(events::RUN_WAITING, "a", json!({"on": big}))], &[answer(3, false)]);
        known.appended(vec![input(events::RUN_COMPLETED, "", json!({}))], &[answer(4, false)]);
        assert!(known.finish().is_none());
    }
}
