//! The checks every append passes, shared by the single-event and the batched paths. They
//! read nothing themselves: callers hand them the run's locked head and the rows they need,
//! so every refusal is decided before anything is written.

use serde_json::Value;
use warden_core::chain::ChainedEvent;
use warden_core::events::{self, RunStatus};

use super::NewEvent;
use crate::error::LedgerError;

/// The run row as locked for an append, updated in memory as events are added.
#[derive(Debug, Clone)]
pub struct RunHead {
    pub run_id: String,
    pub tenant: String,
    pub status: String,
    pub reason: String,
    pub last_seq: u64,
    pub head_hash: String,
    pub max_epoch: u64,
    pub updated_at_ms: i64,
}

impl RunHead {
    /// Moves the head past `event`.
    pub fn advance(&mut self, event: &ChainedEvent) {
        self.last_seq = event.body.seq;
        self.head_hash = event.hash.clone();
        self.max_epoch = self.max_epoch.max(event.body.epoch);
        self.updated_at_ms = event.body.timestamp_ms;
        if let Some(st) = events::status_after(&event.body.event_type) {
            self.status = st.as_str().to_string();
            // PostgreSQL TEXT cannot hold NUL; the event keeps the exact reason.
            self.reason =
                event.body.payload.get("reason").and_then(Value::as_str).unwrap_or_default().replace('\0', "\u{FFFD}");
        }
    }
}

/// Tenancy: another tenant's run does not exist for the caller.
pub fn check_tenant(head: &RunHead, new: &NewEvent<'_>) -> Result<(), LedgerError> {
    if head.tenant != new.tenant {
        return Err(LedgerError::NotFound(format!("run '{}'", new.run_id)));
    }
    Ok(())
}

/// An idempotency key already used: the same content is a retry (returned as is), anything
/// else is refused, so nobody can pre-record an event another writer will be handed back.
pub fn check_duplicate(existing: &ChainedEvent, new: &NewEvent<'_>) -> Result<(), LedgerError> {
    let same = existing.body.event_type == new.event_type
        && existing.body.step_id == new.step_id
        && warden_core::canonical::canonical_value(&existing.body.payload)
            == warden_core::canonical::canonical_value(&new.payload);
    if !same {
        return Err(LedgerError::invalid(
            "idempotency_key",
            format!(
                "already used by a different {} event of step '{}'",
                existing.body.event_type, existing.body.step_id
            ),
        ));
    }
    Ok(())
}

/// A request repeated by a holder the run has moved past gets no answer that would let it act:
/// the repeat would be handed the request's acknowledgement, and a stale executor must not
/// invoke a tool (its successor may already have settled the call otherwise).
pub fn check_stale_repeat(head: &RunHead, new: &NewEvent<'_>) -> Result<(), LedgerError> {
    // A model request too: the repeat would let a stale planner call the model.
    if matches!(new.event_type, events::TOOL_REQUESTED | events::MODEL_REQUESTED) && new.epoch < head.max_epoch {
        return Err(LedgerError::Fenced { epoch: new.epoch, max_epoch: head.max_epoch });
    }
    Ok(())
}

/// Fencing and lifecycle: stale epochs, restarts of waiting runs, events after the end.
pub fn check_writable(head: &RunHead, new: &NewEvent<'_>) -> Result<(), LedgerError> {
    if let Some(a) = new.payload.get("attempt")
        && !a.as_u64().is_some_and(|a| (1..=u32::MAX as u64).contains(&a))
    {
        return Err(LedgerError::invalid("payload_json.attempt", "attempts are whole numbers from 1 to 4294967295"));
    }
    // An output stored by reference is cited by its digest and size, in place of the output.
    if new.event_type == events::TOOL_COMPLETED
        && let Some(r) = new.payload.get("output_ref")
    {
        let hex = r.get("sha256").and_then(Value::as_str).unwrap_or_default();
        let well_formed = hex.len() == 64
            && hex.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
            && r.get("bytes").is_some_and(Value::is_u64)
            && new.payload.get("output").is_none();
        if !well_formed {
            return Err(LedgerError::invalid(
                "payload_json.output_ref",
                "cites a stored output as {\"sha256\": 64 hex digits, \"bytes\": n}, with no inline output",
            ));
        }
    }
    if new.epoch < head.max_epoch {
        return Err(LedgerError::Fenced { epoch: new.epoch, max_epoch: head.max_epoch });
    }
    let current = RunStatus::parse(&head.status);
    // A run waiting for an operator, an approval or a resume is not picked up again by an
    // executor.
    if new.event_type == events::RUN_STARTED
        && matches!(current, Some(RunStatus::RequiresReconciliation | RunStatus::Blocked | RunStatus::Paused))
    {
        return Err(LedgerError::Precondition(format!(
            "run '{}' is {}; it cannot be started",
            new.run_id, head.status
        )));
    }
    // Resumed after an approval was resolved, after an operator reconciled a step, or on
    // request after a pause.
    if new.event_type == events::RUN_RESUMED
        && !matches!(current, Some(RunStatus::Blocked | RunStatus::RequiresReconciliation | RunStatus::Paused))
    {
        return Err(LedgerError::Precondition(format!(
            "run '{}' is {}, neither blocked, paused nor waiting for reconciliation; nothing to resume",
            new.run_id, head.status
        )));
    }
    // Only the run's driver pauses it.
    if new.event_type == events::RUN_PAUSED && current != Some(RunStatus::Active) {
        return Err(LedgerError::Precondition(format!(
            "run '{}' is {}; only an active run can be paused",
            new.run_id, head.status
        )));
    }
    if current.is_some_and(RunStatus::is_terminal) && !events::AFTER_END.contains(&new.event_type) {
        return Err(LedgerError::Precondition(format!(
            "run '{}' is {}; it accepts no more events",
            new.run_id, head.status
        )));
    }
    Ok(())
}

/// The decision a tool event cites (its ledger idempotency key), if it must cite one.
pub fn cited_decision_key(new: &NewEvent<'_>) -> Result<Option<String>, LedgerError> {
    if !events::NEEDS_ALLOW.contains(&new.event_type) {
        return Ok(None);
    }
    match new.payload.get("decision_id").and_then(Value::as_str).filter(|d| !d.is_empty()) {
        Some(id) => Ok(Some(events::decision_key(id))),
        None => Err(LedgerError::invalid(
            "payload_json.decision_id",
            format!("a {} event must cite the allow decision it acts on", new.event_type),
        )),
    }
}

/// A tool event must cite a recorded allow for the very call it records (same step,
/// attempt, tool, idempotency key and, for a request, arguments). Returns the capability.
pub fn check_allow(decision: Option<&ChainedEvent>, new: &NewEvent<'_>) -> Result<String, LedgerError> {
    let id = new.payload.get("decision_id").and_then(Value::as_str).unwrap_or_default();
    let refused = |why: &str| {
        Err(LedgerError::Precondition(format!(
            "{} for step '{}' cites decision '{id}', {why}",
            new.event_type, new.step_id
        )))
    };
    let Some(d) = decision else { return refused("which is not recorded for this run") };
    let field = |k: &str| d.body.payload.get(k).and_then(Value::as_str).unwrap_or_default().to_string();
    if d.body.event_type != events::POLICY_DECISION || d.body.step_id != new.step_id {
        return refused("which is not a decision for this step");
    }
    if field("outcome") != "allow" {
        return refused("which is not an allow");
    }
    for key in ["attempt", "tool", "idempotency_key"] {
        if new.payload.get(key) != d.body.payload.get(key) {
            return refused(&format!("which allowed a different {key}"));
        }
    }
    if matches!(new.event_type, events::TOOL_REQUESTED | events::MODEL_REQUESTED) {
        let args = new.payload.get("args").ok_or_else(|| {
            LedgerError::invalid(
                "payload_json.args",
                format!("a {} event records the arguments it was allowed for", new.event_type),
            )
        })?;
        if warden_core::canonical::args_digest(args) != field("args_sha256") {
            return refused("which allowed different arguments");
        }
    }
    Ok(field("capability_id"))
}
