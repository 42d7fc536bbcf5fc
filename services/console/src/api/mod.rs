//! The console's JSON API under `/api`. Each handler checks its input, calls the mesh as the
//! caller (the bearer token is forwarded, never replaced) and answers JSON; the mesh's refusals
//! come back as HTTP statuses with the same JSON error shape.

mod approvals;
mod capabilities;
mod receipts;
mod runs;

use axum::Router;
use axum::extract::Path;
use axum::extract::rejection::PathRejection;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};

use crate::error::ApiError;
use crate::mesh::Mesh;

pub fn routes(mesh: Mesh) -> Router {
    Router::new()
        .route("/runs", get(runs::list))
        .route("/runs/{run_id}", get(runs::detail))
        .route("/runs/{run_id}/events", get(crate::live::run_events))
        .route("/runs/{run_id}/receipts", get(receipts::list))
        .route("/runs/{run_id}/verify", get(receipts::verify))
        .route("/runs/{run_id}/export", get(receipts::export))
        .route("/approvals", get(approvals::list))
        .route("/approvals/watch", get(crate::live::approvals))
        .route("/approvals/{approval_id}", get(approvals::detail))
        .route("/approvals/{approval_id}/approve", post(approvals::approve))
        .route("/approvals/{approval_id}/deny", post(approvals::deny))
        .route("/capabilities", get(capabilities::list).post(capabilities::issue))
        .route("/capabilities/{capability_id}/revoke", post(capabilities::revoke))
        .fallback(not_found)
        .with_state(mesh)
}

async fn not_found() -> Response {
    ApiError::not_found("no such API route").into_response()
}

/// The caller's token (the security layer already refused requests without one).
pub fn token(headers: &HeaderMap) -> Result<&str, ApiError> {
    crate::guard::bearer(headers).ok_or_else(|| ApiError::unauthenticated("missing 'Authorization: Bearer <token>'"))
}

/// A path segment that must be a Warden id.
pub fn path_id(path: Result<Path<String>, PathRejection>, field: &str) -> Result<String, ApiError> {
    let Path(id) = path.map_err(|e| ApiError::invalid(field, e.body_text()))?;
    crate::input::id(field, &id)?;
    Ok(id)
}
