//! The per-run hash chain: `hash = SHA-256(prev_hash ‖ RFC 8785 canonical JSON of the event)`.
//!
//! The hashed body includes the event's position (`run_id`, `seq`) so that removing or
//! reordering events breaks the chain even when the payloads are identical.

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::canonical::canonical_json;

/// `prev_hash` of the first event of every run.
pub const GENESIS_HASH: &str = "0000000000000000000000000000000000000000000000000000000000000000";

/// The hashed content of one ledger event.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EventBody {
    pub run_id: String,
    pub seq: u64,
    pub event_type: String,
    pub payload: serde_json::Value,
    pub step_id: String,
    pub epoch: u64,
    pub idempotency_key: String,
    pub timestamp_ms: i64,
}

impl EventBody {
    /// The chained hash of this body after `prev_hash`.
    pub fn chain_hash(&self, prev_hash: &str) -> String {
        let mut h = Sha256::new();
        h.update(prev_hash.as_bytes());
        h.update(canonical_json(self).as_bytes());
        hex::encode(h.finalize())
    }
}

/// An event as stored: its body plus the links.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChainedEvent {
    #[serde(flatten)]
    pub body: EventBody,
    pub prev_hash: String,
    pub hash: String,
}

/// Where and why a chain stops verifying.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("chain breaks at seq {seq}: {reason}")]
pub struct ChainBreak {
    pub seq: u64,
    pub reason: String,
}

/// Incremental verifier: feed events in stored order; the first break is reported.
#[derive(Debug)]
pub struct ChainVerifier {
    run_id: Option<String>,
    expected_seq: u64,
    prev_hash: String,
}

impl Default for ChainVerifier {
    fn default() -> Self {
        Self { run_id: None, expected_seq: 1, prev_hash: GENESIS_HASH.to_string() }
    }
}

impl ChainVerifier {
    pub fn push(&mut self, event: &ChainedEvent) -> Result<(), ChainBreak> {
        let seq = self.expected_seq;
        let fail = |reason: String| Err(ChainBreak { seq, reason });
        let run_id = self.run_id.get_or_insert_with(|| event.body.run_id.clone());
        if event.body.run_id != *run_id {
            return fail(format!("event belongs to run {}", event.body.run_id));
        }
        if event.body.seq != seq {
            return fail(format!("expected seq {seq}, found seq {}", event.body.seq));
        }
        if event.prev_hash != self.prev_hash {
            return fail("prev_hash does not link to the previous event".into());
        }
        if event.body.chain_hash(&self.prev_hash) != event.hash {
            return fail("hash does not match the event's content".into());
        }
        self.prev_hash = event.hash.clone();
        self.expected_seq += 1;
        Ok(())
    }

    /// Number of events verified so far.
    pub fn verified(&self) -> u64 {
        self.expected_seq - 1
    }

    /// Hash of the last verified event.
    pub fn head(&self) -> &str {
        &self.prev_hash
    }
}

/// Verifies a whole run's events in stored order.
pub fn verify_chain<'a>(events: impl IntoIterator<Item = &'a ChainedEvent>) -> Result<u64, ChainBreak> {
    let mut v = ChainVerifier::default();
    for e in events {
        v.push(e)?;
    }
    Ok(v.verified())
}

/// Builds the next event of a chain (used by the ledger and by tests).
pub fn link(body: EventBody, prev_hash: &str) -> ChainedEvent {
    let hash = body.chain_hash(prev_hash);
    ChainedEvent { body, prev_hash: prev_hash.to_string(), hash }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn chain(n: u64) -> Vec<ChainedEvent> {
        let mut prev = GENESIS_HASH.to_string();
        (1..=n)
            .map(|seq| {
                let e = link(
                    EventBody {
                        run_id: "r1".into(),
                        seq,
                        event_type: "tool_completed".into(),
                        payload: json!({"n": seq % 2}),
                        step_id: format!("s{seq}"),
                        epoch: 1,
                        idempotency_key: format!("k{seq}"),
                        timestamp_ms: 1_700_000_000_000 + seq as i64,
                    },
                    &prev,
                );
                prev = e.hash.clone();
                e
            })
            .collect()
    }

    #[test]
    fn k13_intact_chain_verifies() {
        assert_eq!(verify_chain(&chain(10)), Ok(10));
    }

    #[test]
    fn k13_altered_payload_is_detected() {
        let mut c = chain(5);
        c[2].body.payload = json!({"n": 42});
        assert_eq!(verify_chain(&c).unwrap_err().seq, 3);
    }

    #[test]
    fn k13_removed_event_is_detected() {
        let mut c = chain(5);
        c.remove(1);
        assert_eq!(verify_chain(&c).unwrap_err().seq, 2);
    }

    #[test]
    fn k13_reordered_events_are_detected() {
        let mut c = chain(5);
        c.swap(3, 4);
        assert_eq!(verify_chain(&c).unwrap_err().seq, 4);
    }

    #[test]
    fn k13_rehashed_forgery_breaks_the_next_link() {
        let mut c = chain(5);
        c[1].body.payload = json!({"forged": true});
        c[1].hash = c[1].body.chain_hash(&c[1].prev_hash);
        assert_eq!(verify_chain(&c).unwrap_err().seq, 3);
    }
}
