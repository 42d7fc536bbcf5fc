//! Semantic idempotency (seed 002): a configured template turns a call's arguments into a
//! semantic key ("pay:{to}:{amount}"). The first allowed call claims the key; a later call
//! with the same key is a `semantic_duplicate` when that call succeeded, and
//! `semantic_requires_reconciliation` while its outcome is unknown. A failed holder frees
//! the key. Outcomes are read from the ledger, the system of record.

use serde_json::Value;
use tonic::Status;
use warden_core::events;
use warden_proto::v1 as pb;

use crate::rules::{RuleDecision, Verdict, matches};
use crate::server::PolicyService;
use crate::store::SemanticClaim;

/// Fills `{field}` placeholders from the arguments (strings as they are, other values as
/// JSON); None when a field is missing.
pub fn render(template: &str, args: &Value) -> Option<String> {
    let mut out = String::new();
    let mut rest = template;
    while let Some(start) = rest.find('{') {
        out.push_str(&rest[..start]);
        let end = rest[start..].find('}')? + start;
        let v = args.get(&rest[start + 1..end])?;
        match v {
            Value::String(s) => out.push_str(s),
            other => out.push_str(&other.to_string()),
        }
        rest = &rest[end + 1..];
    }
    out.push_str(rest);
    Some(out)
}

enum Outcome {
    Succeeded,
    Failed,
    /// Neither yet; `recorded` says whether the claiming decision is on record.
    Unknown {
        recorded: bool,
    },
}

/// What the ledger says became of the call holding a key — the claiming step, over all the
/// attempts of the claiming call's branch: completed in any attempt is a success; a final
/// failure (no retry follows), a denial, a cancellation or a move to another alternative frees
/// the key; a request without an outcome is unknown. A call never requested within an
/// authorization's lifetime can no longer act (the host refuses an expired authorization, and
/// nothing acts unrecorded): it frees the key too. Until the claiming decision is on record
/// nothing of the step's history is that call's, so the answer is unknown until it lapses.
async fn outcome(svc: &PolicyService, tenant: &str, claim: &SemanticClaim) -> Result<Outcome, Status> {
    let mut stream = svc
        .ledger()
        .stream_events(pb::StreamEventsRequest {
            tenant: tenant.into(),
            run_id: claim.run_id.clone(),
            since_seq: 0,
            follow: false,
        })
        .await?
        .into_inner();
    // The claiming step's events, from the claiming decision on (when it is on record): a step
    // that moved to another alternative (`step_branched`) ended the claiming call's branch —
    // what a later branch does is not that call's outcome.
    let mut mine = Vec::new();
    while let Some(e) = stream.message().await? {
        if e.step_id == claim.step_id {
            mine.push(e);
        }
    }
    let claimed_at = mine.iter().position(|e| {
        e.event_type == events::POLICY_DECISION
            && serde_json::from_str::<Value>(&e.payload_json)
                .ok()
                .is_some_and(|p| p.get("decision_id").and_then(Value::as_str) == Some(claim.decision_id.as_str()))
    });
    let lapsed = warden_grpc::now_ms() > claim.claimed_at_ms.saturating_add(svc.config().authorization_ttl_ms as i64);
    let Some(claimed_at) = claimed_at else {
        return Ok(if lapsed { Outcome::Failed } else { Outcome::Unknown { recorded: false } });
    };
    let (mut requested, mut failed) = (false, false);
    for e in mine.into_iter().skip(claimed_at) {
        match e.event_type.as_str() {
            events::STEP_BRANCHED => {
                failed = true;
                break;
            }
            events::TOOL_COMPLETED => return Ok(Outcome::Succeeded),
            events::TOOL_REQUESTED => requested = true,
            events::TOOL_FAILED => {
                let retried =
                    serde_json::from_str::<Value>(&e.payload_json).ok().is_some_and(|p| p.get("retry").is_some());
                failed = !retried;
            }
            events::STEP_FAILED | events::STEP_CANCELLED => failed = true,
            _ => {}
        }
    }
    Ok(match (failed, requested) {
        (true, _) => Outcome::Failed,
        (false, false) if lapsed => Outcome::Failed,
        _ => Outcome::Unknown { recorded: true },
    })
}

/// Applies semantic idempotency to an allow. When the call may go ahead it claims the key
/// (atomically) and returns the claim, which the caller gives back unless the whole decision
/// ends as an allow that is recorded (or handed to the executor): a refused or denied request
/// holds no key. A claim left by a crash in between lapses (never requested).
pub async fn check(
    svc: &PolicyService,
    r: &pb::AuthorizeRequest,
    args: &Value,
    decision_id: &str,
    rule: RuleDecision,
) -> Result<(RuleDecision, Option<(String, SemanticClaim)>), Status> {
    if rule.verdict != Verdict::Allow {
        return Ok((rule, None));
    }
    let Some(key) =
        svc.config().semantic_keys.iter().filter(|k| matches(&k.tool, &r.tool)).find_map(|k| render(&k.template, args))
    else {
        return Ok((rule, None));
    };
    let deny = |rule_id: &str, reason: String| RuleDecision { verdict: Verdict::Deny, rule_id: rule_id.into(), reason };
    if key.contains('\0') || key.len() > 1024 {
        return Ok((
            deny("semantic_key_invalid", "the semantic key must be at most 1024 bytes, without NUL".into()),
            None,
        ));
    }
    let mine = SemanticClaim {
        run_id: r.run_id.clone(),
        step_id: r.step_id.clone(),
        decision_id: decision_id.to_string(),
        claimed_at_ms: warden_grpc::now_ms(),
    };
    let held = svc.store().semantic_claim(&r.tenant, &key).await?;
    let replacing = match &held {
        Some(h) if h.run_id == mine.run_id && h.step_id == mine.step_id => match outcome(svc, &r.tenant, h).await? {
            // This very call (another attempt of its branch, or asked again after an approval)
            // holds it already; its history from the claiming decision on is this call's.
            Outcome::Succeeded | Outcome::Unknown { recorded: true } => return Ok((rule, None)),
            Outcome::Unknown { recorded: false } if h.decision_id == mine.decision_id => return Ok((rule, None)),
            // The step moved on — another alternative, or a call after the holder failed — or
            // the holder's decision never reached the record (its executor was fenced before
            // recording it): the claim moves to this decision, so what this call comes to is
            // what the key's holder comes to.
            Outcome::Failed | Outcome::Unknown { recorded: false } => Some(h),
        },
        Some(h) => match outcome(svc, &r.tenant, h).await? {
            Outcome::Succeeded => {
                let why = format!("'{key}' already succeeded (run {}, step {})", h.run_id, h.step_id);
                return Ok((deny("semantic_duplicate", why), None));
            }
            Outcome::Unknown { .. } => {
                let why = format!("'{key}' has an unresolved earlier call (run {}, step {})", h.run_id, h.step_id);
                return Ok((deny("semantic_requires_reconciliation", why), None));
            }
            Outcome::Failed => Some(h),
        },
        None => None,
    };
    // Claimed atomically now, so two calls with one key never both go ahead; given back if this
    // request ends as anything but a recorded allow.
    if !svc.store().claim_semantic(&r.tenant, &key, &mine, replacing).await? {
        let why = format!("'{key}' was just claimed by another call");
        return Ok((deny("semantic_requires_reconciliation", why), None));
    }
    Ok((rule, Some((key, mine))))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn templates_render_from_arguments() {
        assert_eq!(render("pay:{to}:{amount}", &json!({"to": "bob", "amount": 5})), Some("pay:bob:5".into()));
        assert_eq!(render("pay:{to}", &json!({})), None);
        assert_eq!(render("plain", &json!({})), Some("plain".into()));
    }
}
