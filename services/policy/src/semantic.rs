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
    Unknown,
}

/// What the ledger says became of the call a decision allowed.
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
    let mut result = Outcome::Unknown;
    while let Some(e) = stream.message().await? {
        if e.step_id != claim.step_id {
            continue;
        }
        let cites = serde_json::from_str::<Value>(&e.payload_json)
            .ok()
            .is_some_and(|p| p.get("decision_id").and_then(Value::as_str) == Some(claim.decision_id.as_str()));
        if !cites {
            continue;
        }
        match e.event_type.as_str() {
            events::TOOL_COMPLETED => result = Outcome::Succeeded,
            events::TOOL_FAILED | events::STEP_FAILED => result = Outcome::Failed,
            _ => {}
        }
    }
    Ok(result)
}

/// Applies semantic idempotency to an allow; claims the key for this call when it stays one.
pub async fn check(
    svc: &PolicyService,
    r: &pb::AuthorizeRequest,
    args: &Value,
    decision_id: &str,
    rule: RuleDecision,
) -> Result<RuleDecision, Status> {
    if rule.verdict != Verdict::Allow {
        return Ok(rule);
    }
    let Some(key) =
        svc.config().semantic_keys.iter().filter(|k| matches(&k.tool, &r.tool)).find_map(|k| render(&k.template, args))
    else {
        return Ok(rule);
    };
    let mine =
        SemanticClaim { run_id: r.run_id.clone(), step_id: r.step_id.clone(), decision_id: decision_id.to_string() };
    if let Some(held) = svc.store().semantic_claim(&r.tenant, &key).await?
        && held != mine
    {
        let deny =
            |rule_id: &str, reason: String| RuleDecision { verdict: Verdict::Deny, rule_id: rule_id.into(), reason };
        match outcome(svc, &r.tenant, &held).await? {
            Outcome::Succeeded => {
                return Ok(deny(
                    "semantic_duplicate",
                    format!("'{key}' already succeeded (run {}, step {})", held.run_id, held.step_id),
                ));
            }
            Outcome::Unknown => {
                return Ok(deny(
                    "semantic_requires_reconciliation",
                    format!("'{key}' has an unresolved earlier call (run {}, step {})", held.run_id, held.step_id),
                ));
            }
            Outcome::Failed => {}
        }
    }
    svc.store().claim_semantic(&r.tenant, &key, &mine).await?;
    Ok(rule)
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
