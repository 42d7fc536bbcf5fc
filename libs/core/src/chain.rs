//! The per-run hash chain: `hash = SHA-256(prev_hash ‖ RFC 8785 canonical JSON of the event)`.
//!
//! The hashed body includes the event's position (`run_id`, `seq`) so that removing or
//! reordering events breaks the chain even when the payloads are identical.

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

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
        h.update(self.canonical().as_bytes());
        hex::encode(h.finalize())
    }

    /// The body's RFC 8785 JSON: the bytes [`crate::canonical::canonical_json`] gives (a test holds the two
    /// together), written member by member in sorted order instead of through a copy of the
    /// whole body, payload included, as a `serde_json::Value`. Every event appended is hashed.
    pub fn canonical(&self) -> String {
        use crate::canonical::{write_canonical, write_number, write_string};
        let mut out = String::with_capacity(256);
        // Member names in UTF-16 order (all ASCII here).
        out.push_str("{\"epoch\":");
        write_number(&mut out, self.epoch as f64);
        out.push_str(",\"event_type\":");
        write_string(&mut out, &self.event_type);
        out.push_str(",\"idempotency_key\":");
        write_string(&mut out, &self.idempotency_key);
        out.push_str(",\"payload\":");
        write_canonical(&mut out, &self.payload);
        out.push_str(",\"run_id\":");
        write_string(&mut out, &self.run_id);
        out.push_str(",\"seq\":");
        write_number(&mut out, self.seq as f64);
        out.push_str(",\"step_id\":");
        write_string(&mut out, &self.step_id);
        out.push_str(",\"timestamp_ms\":");
        write_number(&mut out, self.timestamp_ms as f64);
        out.push('}');
        out
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

    #[test]
    fn a_body_is_written_as_canonical_json_writes_it() {
        let bodies = [
            EventBody {
                run_id: "r-1".into(),
                seq: 1,
                event_type: "run_submitted".into(),
                payload: json!({}),
                step_id: String::new(),
                epoch: 0,
                idempotency_key: "run_submitted".into(),
                timestamp_ms: 0,
            },
            EventBody {
                run_id: "r\"\\\u{1}é😀".into(),
                seq: u64::MAX,
                event_type: "tool_completed".into(),
                payload: json!({"z": [1, 2.5, -0.0, 1e21, null, true], "a": {"\u{e000}": 1, "😀": "x\n"}, "é": "\u{7f}"}),
                step_id: "s\t1".into(),
                epoch: 9_007_199_254_740_993,
                idempotency_key: "k:1".into(),
                timestamp_ms: -1_700_000_000_123,
            },
        ];
        for b in &bodies {
            assert_eq!(b.canonical(), crate::canonical::canonical_json(b));
        }
    }

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
