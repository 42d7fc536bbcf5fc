//! The run export format (JSON Lines) and its offline verification.
//!
//! ```text
//! {"kind":"header","data":{"format":"warden-run-export/1","run_id":…,"tenant":…}}
//! {"kind":"event","data":{…event body…,"prev_hash":…,"hash":…}}      one per event, in seq order
//! {"kind":"receipt","data":{…receipt…}}                              one per tool call outcome
//! {"kind":"head","data":{"head":{"run_id","seq","hash"},"signature":hex,"key_id","public_key":hex}}
//! ```
//!
//! Verification needs no server: the chain is recomputed, every receipt is re-derived from
//! its event, and the head signature is checked (against a pinned key when one is given).

use std::collections::HashMap;

use ed25519_dalek::VerifyingKey;
use serde::{Deserialize, Serialize};

use crate::chain::{ChainVerifier, ChainedEvent};
use crate::head::Head;
use crate::receipt::{Receipt, receipt_for};

pub const FORMAT: &str = "warden-run-export/1";

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Header {
    pub format: String,
    pub run_id: String,
    pub tenant: String,
    pub status: String,
    pub exported_at_ms: i64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SignedHeadLine {
    pub head: Head,
    pub signature: String,
    pub key_id: String,
    pub public_key: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", content = "data", rename_all = "snake_case")]
pub enum Line {
    Header(Header),
    Event(ChainedEvent),
    Receipt(Receipt),
    Head(SignedHeadLine),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Report {
    pub run_id: String,
    pub events: u64,
    pub receipts: u64,
    pub key_id: String,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("line {line}{}: {reason}", seq.map(|s| format!(" (seq {s})")).unwrap_or_default())]
pub struct ExportError {
    pub line: usize,
    pub seq: Option<u64>,
    pub reason: String,
}

/// Verifies an export read line by line. `pinned` is the ledger key the auditor trusts; without
/// it the embedded key is used and the report names its id for comparison.
pub fn verify<I, S>(lines: I, pinned: Option<&VerifyingKey>) -> Result<Report, ExportError>
where
    I: IntoIterator<Item = S>,
    S: AsRef<str>,
{
    let err = |line: usize, seq: Option<u64>, reason: String| Err(ExportError { line, seq, reason });
    let mut header: Option<Header> = None;
    let mut chain = ChainVerifier::default();
    let mut outcome_events: HashMap<u64, ChainedEvent> = HashMap::new();
    // Decision id → capability: a receipt's capability must be its cited decision's.
    let mut decisions: HashMap<String, String> = HashMap::new();
    let mut receipts: Vec<(usize, Receipt)> = Vec::new();
    let mut head: Option<(usize, SignedHeadLine)> = None;
    let mut n = 0;
    for (i, raw) in lines.into_iter().enumerate() {
        let no = i + 1;
        n = no;
        let raw = raw.as_ref().trim();
        if raw.is_empty() {
            continue;
        }
        let line: Line = match serde_json::from_str(raw) {
            Ok(l) => l,
            Err(e) => return err(no, None, format!("not an export line: {e}")),
        };
        if head.is_some() {
            return err(no, None, "content after the signed head".into());
        }
        match line {
            Line::Header(h) if header.is_none() && no == 1 => {
                if h.format != FORMAT {
                    return err(no, None, format!("unknown format '{}'", h.format));
                }
                header = Some(h);
            }
            Line::Header(_) => return err(no, None, "header must be the first line, once".into()),
            _ if header.is_none() => return err(no, None, "missing header".into()),
            Line::Event(e) => {
                let run_id = header.as_ref().map(|h| h.run_id.as_str()).unwrap_or_default();
                if e.body.run_id != run_id {
                    return err(
                        no,
                        Some(e.body.seq),
                        format!("event of run {} in an export of {run_id}", e.body.run_id),
                    );
                }
                if let Err(b) = chain.push(&e) {
                    return err(no, Some(b.seq), b.reason);
                }
                if e.body.event_type == crate::events::POLICY_DECISION {
                    let field = |k: &str| {
                        e.body.payload.get(k).and_then(serde_json::Value::as_str).unwrap_or_default().to_string()
                    };
                    decisions.insert(field("decision_id"), field("capability_id"));
                }
                if receipt_for(&e, "").is_some() {
                    outcome_events.insert(e.body.seq, e);
                }
            }
            Line::Receipt(r) => receipts.push((no, r)),
            Line::Head(h) => head = Some((no, h)),
        }
    }
    let Some(header) = header else {
        return err(n.max(1), None, "empty export".into());
    };
    for (no, r) in &receipts {
        let Some(e) = outcome_events.remove(&r.seq) else {
            return err(*no, Some(r.seq), "receipt cites no outcome event (or a second receipt for one)".into());
        };
        if receipt_for(&e, &crate::receipt::expected_capability(&e, &decisions)).as_ref() != Some(r) {
            return err(*no, Some(r.seq), "receipt does not match its event".into());
        }
    }
    if let Some(seq) = outcome_events.keys().min() {
        return err(n, Some(*seq), "tool call outcome without its receipt".into());
    }
    let Some((no, h)) = head else {
        return err(n, None, "missing signed head".into());
    };
    if h.head.run_id != header.run_id || h.head.seq != chain.verified() || h.head.hash != chain.head() {
        return err(
            no,
            Some(h.head.seq),
            format!("signed head does not match the events (they end at seq {})", chain.verified()),
        );
    }
    let key_bytes: [u8; 32] = match hex::decode(&h.public_key).ok().and_then(|b| b.try_into().ok()) {
        Some(b) => b,
        None => return err(no, None, "public key is not 32 hex bytes".into()),
    };
    let Ok(embedded) = VerifyingKey::from_bytes(&key_bytes) else {
        return err(no, None, "public key is invalid".into());
    };
    let key = pinned.unwrap_or(&embedded);
    if crate::auth::key_id(key) != h.key_id {
        return err(
            no,
            None,
            format!("head is signed by key {}, not the pinned key {}", h.key_id, crate::auth::key_id(key)),
        );
    }
    let sig = hex::decode(&h.signature).unwrap_or_default();
    if !h.head.verify(&sig, key) {
        return err(no, Some(h.head.seq), "head signature does not verify".into());
    }
    Ok(Report { run_id: header.run_id, events: chain.verified(), receipts: receipts.len() as u64, key_id: h.key_id })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chain::{EventBody, GENESIS_HASH, link};
    use ed25519_dalek::SigningKey;
    use serde_json::json;

    fn export(key: &SigningKey) -> Vec<String> {
        let mut lines = vec![
            serde_json::to_string(&Line::Header(Header {
                format: FORMAT.into(),
                run_id: "r".into(),
                tenant: "t".into(),
                status: "completed".into(),
                exported_at_ms: 1,
            }))
            .unwrap(),
        ];
        let mut prev = GENESIS_HASH.to_string();
        let mut receipts = vec![];
        for (seq, t) in [(1, "run_submitted"), (2, "tool_completed"), (3, "run_completed")] {
            let body = EventBody {
                run_id: "r".into(),
                seq,
                event_type: t.into(),
                payload: json!({"tool": "echo", "attempt": 1}),
                step_id: if t == "tool_completed" { "s".into() } else { String::new() },
                epoch: 1,
                idempotency_key: format!("k{seq}"),
                timestamp_ms: seq as i64,
            };
            let e = link(body, &prev);
            prev = e.hash.clone();
            if let Some(r) = receipt_for(&e, "") {
                receipts.push(r);
            }
            lines.push(serde_json::to_string(&Line::Event(e)).unwrap());
        }
        for r in receipts {
            lines.push(serde_json::to_string(&Line::Receipt(r)).unwrap());
        }
        let head = Head { run_id: "r".into(), seq: 3, hash: prev };
        let (sig, key_id) = head.sign(key);
        lines.push(
            serde_json::to_string(&Line::Head(SignedHeadLine {
                head,
                signature: hex::encode(sig),
                key_id,
                public_key: hex::encode(key.verifying_key().as_bytes()),
            }))
            .unwrap(),
        );
        lines
    }

    #[test]
    fn k13_an_intact_export_verifies_offline() {
        let key = SigningKey::from_bytes(&[3u8; 32]);
        let r = verify(export(&key), Some(&key.verifying_key())).unwrap();
        assert_eq!((r.events, r.receipts), (3, 1));
    }

    #[test]
    fn k13_tampered_exports_are_refused_with_the_line() {
        let key = SigningKey::from_bytes(&[3u8; 32]);
        let good = export(&key);
        let mut altered = good.clone();
        altered[2] = altered[2].replace("\"echo\"", "\"rm\"");
        assert_eq!(verify(&altered, None).unwrap_err().seq, Some(2));
        let mut dropped = good.clone();
        dropped.remove(2);
        assert_eq!(verify(&dropped, None).unwrap_err().seq, Some(2));
        let mut no_receipt = good.clone();
        no_receipt.remove(4);
        assert!(verify(&no_receipt, None).unwrap_err().reason.contains("without its receipt"));
        let other = SigningKey::from_bytes(&[4u8; 32]);
        assert!(verify(&good, Some(&other.verifying_key())).unwrap_err().reason.contains("pinned key"));
        // A head signed by another key but claiming the ledger's key.
        let mut forged = good.clone();
        let Ok(Line::Head(mut h)) = serde_json::from_str::<Line>(forged.last().unwrap()) else { panic!("head line") };
        h.signature = hex::encode(h.head.sign(&other).0);
        *forged.last_mut().unwrap() = serde_json::to_string(&Line::Head(h)).unwrap();
        assert!(verify(&forged, None).unwrap_err().reason.contains("signature"));
    }
}
