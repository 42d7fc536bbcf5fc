//! Capabilities: list, issue (the mesh allows only what the token may delegate) and revoke.

use axum::body::Bytes;
use axum::extract::rejection::PathRejection;
use axum::extract::{Path, RawQuery, State};
use axum::http::HeaderMap;
use axum::response::Response;
use serde_json::json;
use warden_proto::v1 as pb;

use crate::api::{path_id, token};
use crate::error::ApiError;
use crate::input::{Body, Query};
use crate::mesh::{Mesh, request};
use crate::views;

/// Longest revocation reason (the policy service's bound).
const MAX_REVOKE_REASON_BYTES: usize = 1024;

/// Longest lifetime the console asks for (the policy service applies its own, lower, bound).
const MAX_TTL_SECONDS: u64 = 365 * 24 * 3600;

/// `GET /api/capabilities?tenant=&page_size=&page_token=`.
pub async fn list(State(mesh): State<Mesh>, headers: HeaderMap, RawQuery(raw): RawQuery) -> Result<Response, ApiError> {
    let token = token(&headers)?;
    let q = Query::parse(raw.as_deref(), &["tenant", "page_size", "page_token"])?;
    let page = mesh
        .capabilities(token)?
        .list(request(pb::ListCapabilitiesRequest {
            tenant: q.tenant()?,
            page_size: q.page_size(50, 200)?,
            page_token: q.page_token()?,
        }))
        .await?
        .into_inner();
    let caps: Vec<_> = page.capabilities.iter().map(views::capability).collect();
    Ok(views::ok(json!({"capabilities": caps, "next_page_token": page.next_page_token})))
}

fn issue_request(body: &[u8]) -> Result<pb::IssueCapabilityRequest, ApiError> {
    let b = Body::parse(
        body,
        &["tenant", "tool_patterns", "action_patterns", "resource_patterns", "ttl_seconds", "run_id"],
    )?;
    let tool_patterns = b.patterns("tool_patterns")?;
    if tool_patterns.is_empty() {
        return Err(ApiError::invalid("tool_patterns", "name at least one tool pattern"));
    }
    let run_id = b.string("run_id")?;
    if !run_id.is_empty() {
        crate::input::id("run_id", &run_id)?;
    }
    Ok(pb::IssueCapabilityRequest {
        tenant: b.tenant()?,
        tool_patterns,
        action_patterns: b.patterns("action_patterns")?,
        resource_patterns: b.patterns("resource_patterns")?,
        ttl_seconds: b.number("ttl_seconds", 3600, 1, MAX_TTL_SECONDS)?,
        run_id,
    })
}

/// `POST /api/capabilities`: the answer carries the handle, shown once and never again.
pub async fn issue(State(mesh): State<Mesh>, headers: HeaderMap, body: Bytes) -> Result<Response, ApiError> {
    let token = token(&headers)?;
    let cap = mesh.capabilities(token)?.issue(request(issue_request(&body)?)).await?.into_inner();
    Ok(views::ok(views::capability(&cap)))
}

/// `POST /api/capabilities/{capability_id}/revoke` with `{"tenant", "reason"}`.
pub async fn revoke(
    State(mesh): State<Mesh>,
    headers: HeaderMap,
    path: Result<Path<String>, PathRejection>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let token = token(&headers)?;
    let capability_id = path_id(path, "capability_id")?;
    let b = Body::parse(&body, &["tenant", "reason"])?;
    let reason = b.text("reason", MAX_REVOKE_REASON_BYTES)?;
    if reason.trim().is_empty() {
        return Err(ApiError::invalid("reason", "say why (it is recorded with the revocation)"));
    }
    let r = pb::RevokeCapabilityRequest { tenant: b.tenant()?, capability_id, reason };
    let cap = mesh.capabilities(token)?.revoke(request(r)).await?.into_inner();
    Ok(views::ok(views::capability(&cap)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_issue_names_tools_and_a_bounded_lifetime() {
        let ok = issue_request(br#"{"tenant":"acme","tool_patterns":["kv.*"],"ttl_seconds":60}"#).expect("valid");
        assert_eq!((ok.tool_patterns.clone(), ok.ttl_seconds), (vec!["kv.*".to_string()], 60));
        let e = issue_request(br#"{"tenant":"acme","tool_patterns":[]}"#).expect_err("no tools");
        assert_eq!(e.field.as_deref(), Some("tool_patterns"));
        let e = issue_request(br#"{"tenant":"acme","tool_patterns":["a"],"ttl_seconds":0}"#).expect_err("ttl");
        assert_eq!(e.field.as_deref(), Some("ttl_seconds"));
        let e = issue_request(br#"{"tenant":"acme","tool_patterns":["a"],"run_id":"../x"}"#).expect_err("run");
        assert_eq!(e.field.as_deref(), Some("run_id"));
    }
}
