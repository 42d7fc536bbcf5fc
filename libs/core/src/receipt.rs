//! Receipts (SPEC-KERN-01 §5): exactly one per tool call outcome — ok, denied, error or
//! cancelled — derived deterministically from the outcome event in the run's chain, so a
//! receipt can always be recomputed and checked against the chain.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::canonical::{canonical_json, sha256_hex};
use crate::chain::ChainedEvent;
use crate::events;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Receipt {
    pub receipt_id: String,
    pub run_id: String,
    pub step_id: String,
    pub attempt: u32,
    pub seq: u64,
    pub trace_id: String,
    pub span_id: String,
    pub job_id: String,
    pub tx_id: String,
    pub capability_id: String,
    pub policy_decision: String,
    pub action_type: String,
    pub timestamp_ms: i64,
    pub status: String,
    pub reason: String,
    pub event_hash: String,
    /// SHA-256 of the RFC 8785 JSON of every other field.
    #[serde(default)]
    pub hash: String,
}

/// W3C-sized trace id of a run (32 hex chars), stable for the run's whole life: what a
/// receipt cites when its outcome names no trace (the executor exported none).
pub fn trace_id(run_id: &str) -> String {
    sha256_hex(run_id)[..32].to_string()
}

/// W3C-sized span id (16 hex chars) of one call attempt.
pub fn span_id(run_id: &str, step_id: &str, attempt: u32) -> String {
    sha256_hex(format!("{run_id}:{step_id}:{attempt}"))[..16].to_string()
}

fn text(p: &Value, k: &str) -> String {
    p.get(k).and_then(Value::as_str).unwrap_or_default().to_string()
}

/// The W3C ids an outcome names (`trace_id`, `span_id`: the tool call's span, recorded by the
/// executor when it exports traces), if both are well-formed and not all zeros.
fn cited_trace(p: &Value) -> Option<(String, String)> {
    let w3c = |s: &str, len: usize| {
        s.len() == len && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) && s.bytes().any(|b| b != b'0')
    };
    let (t, s) = (text(p, "trace_id"), text(p, "span_id"));
    (w3c(&t, 32) && w3c(&s, 16)).then_some((t, s))
}

fn attempt_of(p: &Value) -> u32 {
    p.get("attempt").and_then(Value::as_u64).unwrap_or(1).max(1) as u32
}

/// The id of the receipt an outcome event yields: a function of the call (run, step,
/// attempt) or of the transaction, so a second outcome for the same call has the same id.
pub fn receipt_id(run_id: &str, event_type: &str, step_id: &str, p: &Value) -> Option<String> {
    let call = match event_type {
        // Distinct prefixes: a step named "tx" can never collide with a transaction.
        events::TX_COMMITTED | events::TX_ROLLED_BACK => format!("{run_id}:tx:{}", text(p, "tx_id")),
        events::TOOL_COMPLETED | events::TOOL_FAILED | events::STEP_FAILED | events::STEP_CANCELLED => {
            format!("{run_id}:call:{step_id}:{}", attempt_of(p))
        }
        _ => return None,
    };
    Some(format!("rcpt-{}", &sha256_hex(call)[..24]))
}

/// The capability a receipt must name: the one of the allow decision its event cites
/// (`decisions`: decision id → capability id), for the outcomes that cite one.
pub fn expected_capability(event: &ChainedEvent, decisions: &std::collections::HashMap<String, String>) -> String {
    match event.body.event_type.as_str() {
        events::TOOL_COMPLETED | events::TX_COMMITTED => {
            decisions.get(&text(&event.body.payload, "decision_id")).cloned().unwrap_or_default()
        }
        _ => String::new(),
    }
}

/// The receipt an outcome event yields, if it is one. `capability_id` comes from the cited
/// decision when the event itself does not carry one.
pub fn receipt_for(event: &ChainedEvent, capability_id: &str) -> Option<Receipt> {
    let b = &event.body;
    let p = &b.payload;
    let status = match b.event_type.as_str() {
        events::TOOL_COMPLETED => "ok",
        events::TOOL_FAILED => "error",
        events::STEP_FAILED if text(p, "kind") == "policy_denied" => "denied",
        events::STEP_FAILED => "error",
        events::STEP_CANCELLED => "cancelled",
        events::TX_COMMITTED => "ok",
        events::TX_ROLLED_BACK => "cancelled",
        _ => return None,
    };
    let tx_id = text(p, "tx_id");
    let attempt = attempt_of(p);
    let mut cap = text(p, "capability_id");
    if cap.is_empty() {
        cap = capability_id.to_string();
    }
    let receipt_id = receipt_id(&b.run_id, &b.event_type, &b.step_id, p)?;
    // SPEC-KERN-01 §5: the trace the call belonged to; without one, ids derived from the call.
    let (trace_id, span_id) =
        cited_trace(p).unwrap_or_else(|| (trace_id(&b.run_id), span_id(&b.run_id, &b.step_id, attempt)));
    let action_type = match b.event_type.as_str() {
        events::TX_COMMITTED => "commit_tx".to_string(),
        events::TX_ROLLED_BACK => "rollback_tx".to_string(),
        _ => text(p, "tool"),
    };
    let mut r = Receipt {
        receipt_id,
        run_id: b.run_id.clone(),
        step_id: b.step_id.clone(),
        attempt,
        seq: b.seq,
        trace_id,
        span_id,
        job_id: b.run_id.clone(),
        tx_id,
        capability_id: cap,
        policy_decision: text(p, "decision_id"),
        action_type,
        timestamp_ms: b.timestamp_ms,
        status: status.to_string(),
        reason: text(p, "reason"),
        event_hash: event.hash.clone(),
        hash: String::new(),
    };
    r.hash = sha256_hex(canonical_json(&r));
    Some(r)
}

impl Receipt {
    /// Whether `hash` matches the other fields.
    pub fn hash_is_valid(&self) -> bool {
        let mut unsigned = self.clone();
        unsigned.hash = String::new();
        sha256_hex(canonical_json(&unsigned)) == self.hash
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chain::{EventBody, GENESIS_HASH, link};
    use serde_json::json;

    fn ev(event_type: &str, payload: Value) -> ChainedEvent {
        link(
            EventBody {
                run_id: "r".into(),
                seq: 7,
                event_type: event_type.into(),
                payload,
                step_id: "s".into(),
                epoch: 1,
                idempotency_key: "k".into(),
                timestamp_ms: 5,
            },
            GENESIS_HASH,
        )
    }

    #[test]
    fn k02_each_outcome_kind_yields_one_receipt_with_its_status() {
        let cases = [
            (events::TOOL_COMPLETED, json!({"tool": "echo", "attempt": 1, "decision_id": "d"}), "ok"),
            (events::TOOL_FAILED, json!({"tool": "echo", "attempt": 2, "reason": "boom"}), "error"),
            (events::STEP_FAILED, json!({"kind": "policy_denied", "reason": "no"}), "denied"),
            (events::STEP_FAILED, json!({"kind": "policy_unavailable"}), "error"),
            (events::STEP_CANCELLED, json!({"reason": "dep"}), "cancelled"),
        ];
        for (t, p, status) in cases {
            let r = receipt_for(&ev(t, p), "cap-1").expect("an outcome");
            assert_eq!(r.status, status);
            assert_eq!(r.capability_id, "cap-1");
            assert!(r.hash_is_valid());
            assert_eq!((r.trace_id.len(), r.span_id.len()), (32, 16));
        }
        assert!(receipt_for(&ev(events::TOOL_REQUESTED, json!({})), "").is_none());
        assert!(receipt_for(&ev(events::POLICY_DECISION, json!({})), "").is_none());
    }

    #[test]
    fn a_receipt_cites_the_trace_its_outcome_names() {
        let (t, s) = ("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7");
        let p = json!({"tool": "echo", "attempt": 1, "trace_id": t, "span_id": s});
        let r = receipt_for(&ev(events::TOOL_COMPLETED, p), "").expect("receipt");
        assert_eq!((r.trace_id.as_str(), r.span_id.as_str()), (t, s));
        // Malformed or absent ids: the ids derived from the call.
        let p = json!({"tool": "echo", "trace_id": "nope", "span_id": s});
        let r = receipt_for(&ev(events::TOOL_COMPLETED, p), "").expect("receipt");
        assert_eq!(r.trace_id, trace_id("r"));
    }

    #[test]
    fn a_changed_receipt_field_breaks_its_hash() {
        let mut r = receipt_for(&ev(events::TOOL_COMPLETED, json!({"tool": "echo"})), "").expect("receipt");
        r.status = "error".into();
        assert!(!r.hash_is_valid());
    }
}
