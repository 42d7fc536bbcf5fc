//! Live updates as Server-Sent Events.
//!
//! The page reads these with `fetch` and a stream reader, not `EventSource`: an `EventSource`
//! cannot send the `Authorization` header, and the console takes the token from nowhere else
//! (no cookie, no token in a URL, where logs and history would keep it).
//!
//! - `GET /api/runs/{run_id}/events?tenant=&since_seq=`: the run's ledger events from
//!   `since_seq` on, following (`Ledger.StreamEvents`), then `end` when the run ends.
//! - `GET /api/approvals/watch?tenant=`: the tenant's approvals as they are, then each change
//!   (`Approvals.Watch`).
//!
//! A failure mid-stream is sent as an `error` event with the API's error body, then the stream
//! ends; the page reconnects from the last seq it saw.

use std::convert::Infallible;
use std::time::Duration;

use axum::extract::rejection::PathRejection;
use axum::extract::{Path, RawQuery, State};
use axum::http::HeaderMap;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures::{Stream, StreamExt};
use serde_json::{Value, json};
use warden_proto::v1 as pb;

use crate::api::{path_id, token};
use crate::error::ApiError;
use crate::input::Query;
use crate::mesh::Mesh;
use crate::views;

/// A comment line this often keeps proxies from closing a quiet stream.
const KEEP_ALIVE: Duration = Duration::from_secs(15);

fn event(name: &str, data: &Value) -> Result<Event, Infallible> {
    Ok(Event::default().event(name).data(data.to_string()))
}

fn error_event(e: ApiError) -> Result<Event, Infallible> {
    let mut body = json!({"code": e.code, "message": e.message, "status": e.status.as_u16()});
    if let Some(f) = e.field {
        body["field"] = json!(f);
    }
    event("error", &body)
}

fn sse(stream: impl Stream<Item = Result<Event, Infallible>> + Send + 'static) -> Response {
    Sse::new(stream).keep_alive(KeepAlive::new().interval(KEEP_ALIVE)).into_response()
}

/// Each item of a gRPC stream as an event named `name`, then `end` (or `error` and stop).
fn relay<T: Send + 'static>(
    stream: tonic::Streaming<T>,
    name: &'static str,
    view: fn(&T) -> Value,
) -> impl Stream<Item = Result<Event, Infallible>> + Send + 'static {
    futures::stream::unfold(Some(stream), move |state| async move {
        let mut s = state?;
        match s.message().await {
            Ok(Some(item)) => Some((event(name, &view(&item)), Some(s))),
            Ok(None) => Some((event("end", &json!({})), None)),
            Err(status) => Some((error_event(status.into()), None)),
        }
    })
}

/// `GET /api/runs/{run_id}/events?tenant=&since_seq=`. The stream is opened before the answer
/// starts, so a refused token or an unknown run is a plain HTTP error, not an event.
pub async fn run_events(
    State(mesh): State<Mesh>,
    headers: HeaderMap,
    path: Result<Path<String>, PathRejection>,
    RawQuery(raw): RawQuery,
) -> Result<Response, ApiError> {
    let token = token(&headers)?;
    let run_id = path_id(path, "run_id")?;
    let q = Query::parse(raw.as_deref(), &["tenant", "since_seq"])?;
    let req = pb::StreamEventsRequest {
        tenant: q.tenant()?,
        run_id,
        since_seq: q.number("since_seq", 0, 0, i64::MAX as u64)?,
        follow: true,
    };
    let stream = mesh.ledger(token)?.stream_events(req).await?.into_inner();
    Ok(sse(relay(stream, "ledger", views::event)))
}

/// `GET /api/approvals/watch?tenant=`.
pub async fn approvals(
    State(mesh): State<Mesh>,
    headers: HeaderMap,
    RawQuery(raw): RawQuery,
) -> Result<Response, ApiError> {
    let token = token(&headers)?;
    let tenant = Query::parse(raw.as_deref(), &["tenant"])?.tenant()?;
    let stream = mesh.approvals(token)?.watch(pb::WatchApprovalsRequest { tenant }).await?.into_inner();
    Ok(sse(relay(stream, "approval", views::approval).boxed()))
}
