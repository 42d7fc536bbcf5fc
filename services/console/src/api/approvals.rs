//! The approval inbox: pending (and resolved) approvals with the exact arguments each is bound
//! to, and approving or denying one as the token's person.

use std::collections::HashMap;

use axum::body::Bytes;
use axum::extract::rejection::PathRejection;
use axum::extract::{Path, RawQuery, State};
use axum::http::HeaderMap;
use axum::response::Response;
use serde_json::{Value, json};
use warden_proto::v1 as pb;

use crate::api::{path_id, token};
use crate::error::ApiError;
use crate::input::{Body, MAX_REASON_BYTES, Query};
use crate::mesh::{Mesh, request};
use crate::views;

fn state(raw: &str) -> Result<pb::ApprovalState, ApiError> {
    Ok(match raw {
        "" | "all" => pb::ApprovalState::Unspecified,
        "pending" => pb::ApprovalState::Pending,
        "approved" => pb::ApprovalState::Approved,
        "denied" => pb::ApprovalState::Denied,
        "expired" => pb::ApprovalState::Expired,
        other => {
            return Err(ApiError::invalid("state", format!("'{other}' is not pending, approved, denied or expired")));
        }
    })
}

/// A run's plan (JSON) and the outputs of its completed steps, by step id.
type PlanAndOutputs = (String, HashMap<String, Value>);

/// Each approval's view, with the arguments it is bound to for those still pending (one lookup
/// of plan and outputs per run).
async fn with_arguments(mesh: &Mesh, token: &str, approvals: &[pb::Approval]) -> Result<Vec<Value>, ApiError> {
    let mut runs: HashMap<String, Option<PlanAndOutputs>> = HashMap::new();
    let mut out = Vec::with_capacity(approvals.len());
    for a in approvals {
        let mut v = views::approval(a);
        if a.state == pb::ApprovalState::Pending as i32 {
            if !runs.contains_key(&a.run_id) {
                let found = plan_and_outputs(mesh, token, &a.tenant, &a.run_id).await.ok();
                runs.insert(a.run_id.clone(), found);
            }
            v["bound"] = match runs.get(&a.run_id).and_then(Option::as_ref) {
                Some((plan, outputs)) => crate::args::bound(plan, &a.step_id, outputs, &a.args_sha256),
                None => json!({"args": null, "digest_matches": false, "note": "the run could not be read"}),
            };
        }
        out.push(v);
    }
    Ok(out)
}

/// The run's plan and the outputs of its completed steps.
async fn plan_and_outputs(mesh: &Mesh, token: &str, tenant: &str, run_id: &str) -> Result<PlanAndOutputs, ApiError> {
    let stored = mesh
        .ledger(token)?
        .get_run(request(pb::GetLedgerRunRequest { tenant: tenant.into(), run_id: run_id.into(), with_events: false }))
        .await?
        .into_inner();
    let run = mesh
        .runs(token)?
        .get_run(request(pb::GetRunRequest { tenant: tenant.into(), run_id: run_id.into() }))
        .await?
        .into_inner();
    let outputs = run
        .steps
        .iter()
        .filter(|s| s.status == pb::StepStatus::Completed as i32)
        .map(|s| (s.id.clone(), views::parsed(&s.output_json)))
        .collect();
    Ok((stored.plan_json, outputs))
}

/// `GET /api/approvals?tenant=&state=pending&page_size=&page_token=`.
pub async fn list(State(mesh): State<Mesh>, headers: HeaderMap, RawQuery(raw): RawQuery) -> Result<Response, ApiError> {
    let token = token(&headers)?;
    let q = Query::parse(raw.as_deref(), &["tenant", "state", "page_size", "page_token"])?;
    let page = mesh
        .approvals(token)?
        .list(request(pb::ListApprovalsRequest {
            tenant: q.tenant()?,
            state: state(q.get("state"))? as i32,
            page_size: q.page_size(50, 200)?,
            page_token: q.optional_id("page_token")?,
        }))
        .await?
        .into_inner();
    let approvals = with_arguments(&mesh, token, &page.approvals).await?;
    Ok(views::ok(json!({"approvals": approvals, "next_page_token": page.next_page_token})))
}

/// `GET /api/approvals/{approval_id}?tenant=`.
pub async fn detail(
    State(mesh): State<Mesh>,
    headers: HeaderMap,
    path: Result<Path<String>, PathRejection>,
    RawQuery(raw): RawQuery,
) -> Result<Response, ApiError> {
    let token = token(&headers)?;
    let approval_id = path_id(path, "approval_id")?;
    let tenant = Query::parse(raw.as_deref(), &["tenant"])?.tenant()?;
    let a = mesh.approvals(token)?.get(request(pb::GetApprovalRequest { tenant, approval_id })).await?.into_inner();
    let mut shown = with_arguments(&mesh, token, std::slice::from_ref(&a)).await?;
    Ok(views::ok(shown.pop().unwrap_or(Value::Null)))
}

/// The resolution a body asks for: `{"tenant", "reason", "approver"?}`. The approver is
/// normally empty — a person's token resolves as that person — and named only by operators.
fn resolution(approval_id: String, body: &[u8]) -> Result<pb::ResolveApprovalRequest, ApiError> {
    let b = Body::parse(body, &["tenant", "reason", "approver"])?;
    let reason = b.text("reason", MAX_REASON_BYTES)?;
    if reason.trim().is_empty() {
        return Err(ApiError::invalid("reason", "say why (it is recorded with the decision)"));
    }
    let approver = b.text("approver", 256)?;
    Ok(pb::ResolveApprovalRequest { tenant: b.tenant()?, approval_id, approver: approver.trim().into(), reason })
}

/// `POST /api/approvals/{approval_id}/approve`.
pub async fn approve(
    State(mesh): State<Mesh>,
    headers: HeaderMap,
    path: Result<Path<String>, PathRejection>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let token = token(&headers)?;
    let r = resolution(path_id(path, "approval_id")?, &body)?;
    let a = mesh.approvals(token)?.approve(request(r)).await?.into_inner();
    Ok(views::ok(views::approval(&a)))
}

/// `POST /api/approvals/{approval_id}/deny`.
pub async fn deny(
    State(mesh): State<Mesh>,
    headers: HeaderMap,
    path: Result<Path<String>, PathRejection>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let token = token(&headers)?;
    let r = resolution(path_id(path, "approval_id")?, &body)?;
    let a = mesh.approvals(token)?.deny(request(r)).await?.into_inner();
    Ok(views::ok(views::approval(&a)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_resolution_needs_a_tenant_and_a_reason() {
        let ok = resolution("apr-1".into(), br#"{"tenant":"acme","reason":"looks right"}"#).expect("valid");
        assert_eq!((ok.tenant.as_str(), ok.approver.as_str()), ("acme", ""));
        let e = resolution("apr-1".into(), br#"{"tenant":"acme","reason":"  "}"#).expect_err("no reason");
        assert_eq!(e.field.as_deref(), Some("reason"));
        let e = resolution("apr-1".into(), br#"{"reason":"x"}"#).expect_err("no tenant");
        assert_eq!(e.field.as_deref(), Some("tenant"));
        let long = format!(r#"{{"tenant":"acme","reason":"{}"}}"#, "x".repeat(MAX_REASON_BYTES + 1));
        assert!(resolution("apr-1".into(), long.as_bytes()).is_err());
        assert_eq!(state("bogus").expect_err("state").field.as_deref(), Some("state"));
    }
}
