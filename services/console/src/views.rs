//! The API's JSON shapes: the mesh's messages as the page reads them — enum values as lower-case
//! names, JSON carried in strings parsed into JSON, secrets only where the mesh returned them.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use warden_grpc::convert::status_name;
use warden_proto::v1 as pb;

/// A JSON answer.
pub fn json_response(status: StatusCode, body: &Value) -> Response {
    let mut r = (status, body.to_string()).into_response();
    r.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    r
}

/// `200` with `body`.
pub fn ok(body: Value) -> Response {
    json_response(StatusCode::OK, &body)
}

/// JSON carried as a string, parsed (a string that is not JSON stays a string).
pub fn parsed(raw: &str) -> Value {
    if raw.is_empty() {
        return Value::Null;
    }
    serde_json::from_str(raw).unwrap_or_else(|_| Value::String(raw.to_string()))
}

/// `STEP_STATUS_UNKNOWN_OUTCOME` → `unknown_outcome`.
fn enum_name(name: &str, prefix: &str) -> String {
    name.strip_prefix(prefix).unwrap_or(name).to_ascii_lowercase()
}

pub fn step_status(n: i32) -> String {
    pb::StepStatus::try_from(n).map_or("unspecified".into(), |s| enum_name(s.as_str_name(), "STEP_STATUS_"))
}

pub fn approval_state(n: i32) -> String {
    pb::ApprovalState::try_from(n).map_or("unspecified".into(), |s| enum_name(s.as_str_name(), "APPROVAL_STATE_"))
}

pub fn run(r: &pb::Run) -> Value {
    json!({
        "run_id": r.run_id,
        "tenant": r.tenant,
        "agent": r.agent,
        "status": status_name(r.status),
        "reason": r.reason,
        "waiting_for": r.waiting_for,
        "direct_response": r.direct_response,
        "created_at_ms": r.created_at_ms,
        "updated_at_ms": r.updated_at_ms,
        "last_seq": r.last_seq,
        "steps": r.steps.iter().map(|s| json!({
            "id": s.id,
            "tool": s.tool,
            "status": step_status(s.status),
            "output": parsed(&s.output_json),
            "error": s.error,
            "attempts": s.attempts,
        })).collect::<Vec<_>>(),
    })
}

pub fn ledger_run(r: &pb::LedgerRun) -> Value {
    json!({
        "run_id": r.run_id,
        "tenant": r.tenant,
        "status": status_name(r.status),
        "reason": r.reason,
        "goal": r.goal,
        "created_at_ms": r.created_at_ms,
        "updated_at_ms": r.updated_at_ms,
        "last_seq": r.last_seq,
        "head_hash": r.head_hash,
    })
}

pub fn approval(a: &pb::Approval) -> Value {
    json!({
        "approval_id": a.approval_id,
        "tenant": a.tenant,
        "run_id": a.run_id,
        "step_id": a.step_id,
        "tool": a.tool,
        "args_sha256": a.args_sha256,
        "state": approval_state(a.state),
        "approver": a.approver,
        "reason": a.reason,
        "created_at_ms": a.created_at_ms,
        "expires_at_ms": a.expires_at_ms,
        "approvers": a.approvers,
    })
}

pub fn capability(c: &pb::Capability) -> Value {
    let mut v = json!({
        "capability_id": c.capability_id,
        "tenant": c.tenant,
        "tool_patterns": c.tool_patterns,
        "action_patterns": c.action_patterns,
        "resource_patterns": c.resource_patterns,
        "issued_at_ms": c.issued_at_ms,
        "expires_at_ms": c.expires_at_ms,
        "revoked": c.revoked,
        "revoke_reason": c.revoke_reason,
        "run_id": c.run_id,
    });
    // The handle is authority: present only in the answer to Issue, which shows it once.
    if !c.handle.is_empty() {
        v["handle"] = json!(c.handle);
    }
    v
}

pub fn receipt(r: &pb::Receipt) -> Value {
    json!({
        "receipt_id": r.receipt_id,
        "run_id": r.run_id,
        "step_id": r.step_id,
        "attempt": r.attempt,
        "seq": r.seq,
        "status": r.status,
        "reason": r.reason,
        "action_type": r.action_type,
        "policy_decision": r.policy_decision,
        "capability_id": r.capability_id,
        "trace_id": r.trace_id,
        "span_id": r.span_id,
        "job_id": r.job_id,
        "tx_id": r.tx_id,
        "timestamp_ms": r.timestamp_ms,
        "event_hash": r.event_hash,
        "hash": r.hash,
    })
}

pub fn event(e: &pb::Event) -> Value {
    json!({
        "seq": e.seq,
        "event_type": e.event_type,
        "step_id": e.step_id,
        "timestamp_ms": e.timestamp_ms,
        "payload": parsed(&e.payload_json),
        "hash": e.hash,
    })
}

pub fn verification(v: &pb::VerifyRunResponse) -> Value {
    json!({
        "valid": v.valid,
        "events": v.events,
        "first_bad_seq": v.first_bad_seq,
        "reason": v.reason,
        "head_hash": v.head_hash,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn enums_read_as_lower_case_names() {
        assert_eq!(step_status(pb::StepStatus::UnknownOutcome as i32), "unknown_outcome");
        assert_eq!(approval_state(pb::ApprovalState::Pending as i32), "pending");
        assert_eq!(step_status(99), "unspecified");
    }

    #[test]
    fn a_handle_appears_only_when_the_mesh_returned_one() {
        let c = pb::Capability { capability_id: "cap-1".into(), ..Default::default() };
        assert!(capability(&c).get("handle").is_none());
        let issued = pb::Capability { handle: "wcap_x".into(), ..c };
        assert_eq!(capability(&issued)["handle"], "wcap_x");
    }
}
