//! A run's receipts, "verify this run" (`Ledger.VerifyRun`: valid, or the first bad seq) and
//! "export": the offline-verifiable file `warden run export` writes and `warden ledger
//! verify-file` checks (events, receipts and the ledger-signed head, as JSON Lines).

use axum::extract::rejection::PathRejection;
use axum::extract::{Path, RawQuery, State};
use axum::http::{HeaderMap, HeaderValue, header};
use axum::response::{IntoResponse, Response};
use serde_json::json;
use warden_core::export::{FORMAT, Header, Line, SignedHeadLine};
use warden_grpc::convert::{event_from_proto, status_name};
use warden_proto::v1 as pb;

use crate::api::{path_id, token};
use crate::error::ApiError;
use crate::input::Query;
use crate::mesh::{Mesh, request};
use crate::views;

/// Largest export the console builds (a run's chain beyond this is exported with the CLI).
const MAX_EXPORT_BYTES: usize = 64 << 20;

struct RunRef {
    tenant: String,
    run_id: String,
}

fn run_ref(
    path: Result<Path<String>, PathRejection>,
    raw: Option<&str>,
    extra: &[&str],
) -> Result<(RunRef, Query), ApiError> {
    let run_id = path_id(path, "run_id")?;
    let mut known = vec!["tenant"];
    known.extend_from_slice(extra);
    let q = Query::parse(raw, &known)?;
    Ok((RunRef { tenant: q.tenant()?, run_id }, q))
}

/// `GET /api/runs/{run_id}/receipts?tenant=&step_id=&after_seq=`.
pub async fn list(
    State(mesh): State<Mesh>,
    headers: HeaderMap,
    path: Result<Path<String>, PathRejection>,
    RawQuery(raw): RawQuery,
) -> Result<Response, ApiError> {
    let token = token(&headers)?;
    let (run, q) = run_ref(path, raw.as_deref(), &["step_id", "after_seq"])?;
    let page = mesh
        .ledger(token)?
        .list_receipts(request(pb::ListReceiptsRequest {
            tenant: run.tenant,
            run_id: run.run_id,
            step_id: q.optional_id("step_id")?,
            page_size: 1000,
            after_seq: q.number("after_seq", 0, 0, i64::MAX as u64)?,
        }))
        .await?
        .into_inner();
    let receipts: Vec<_> = page.receipts.iter().map(views::receipt).collect();
    Ok(views::ok(json!({"receipts": receipts, "next_after_seq": page.next_after_seq})))
}

/// `GET /api/runs/{run_id}/verify?tenant=`: the ledger recomputes the run's chain.
pub async fn verify(
    State(mesh): State<Mesh>,
    headers: HeaderMap,
    path: Result<Path<String>, PathRejection>,
    RawQuery(raw): RawQuery,
) -> Result<Response, ApiError> {
    let token = token(&headers)?;
    let (run, _) = run_ref(path, raw.as_deref(), &[])?;
    let v = mesh
        .ledger(token)?
        .verify_run(request(pb::VerifyRunRequest { tenant: run.tenant, run_id: run.run_id }))
        .await?
        .into_inner();
    Ok(views::ok(views::verification(&v)))
}

/// `GET /api/runs/{run_id}/export?tenant=`: the run as `warden-run-export/1` JSON Lines, up to
/// the signed head (events appended after it are left for a later export).
pub async fn export(
    State(mesh): State<Mesh>,
    headers: HeaderMap,
    path: Result<Path<String>, PathRejection>,
    RawQuery(raw): RawQuery,
) -> Result<Response, ApiError> {
    let token = token(&headers)?;
    let (run, _) = run_ref(path, raw.as_deref(), &[])?;
    let mut ledger = mesh.ledger(token)?;
    let head = ledger
        .get_signed_head(request(pb::GetSignedHeadRequest { tenant: run.tenant.clone(), run_id: run.run_id.clone() }))
        .await?
        .into_inner();
    let stored = ledger
        .get_run(request(pb::GetLedgerRunRequest {
            tenant: run.tenant.clone(),
            run_id: run.run_id.clone(),
            with_events: false,
        }))
        .await?
        .into_inner();
    let mut out = String::new();
    let mut emit = |line: &Line| -> Result<(), ApiError> {
        let text = serde_json::to_string(line).map_err(|e| ApiError::bad_gateway(format!("export line: {e}")))?;
        if out.len() + text.len() > MAX_EXPORT_BYTES {
            return Err(ApiError::new(
                axum::http::StatusCode::PAYLOAD_TOO_LARGE,
                "too_large",
                "this run is too large to export here: use `warden run export`",
            ));
        }
        out.push_str(&text);
        out.push('\n');
        Ok(())
    };
    emit(&Line::Header(Header {
        format: FORMAT.into(),
        run_id: stored.run_id.clone(),
        tenant: stored.tenant.clone(),
        status: status_name(stored.status).into(),
        exported_at_ms: warden_grpc::now_ms(),
    }))?;
    let events =
        pb::StreamEventsRequest { tenant: run.tenant.clone(), run_id: run.run_id.clone(), since_seq: 0, follow: false };
    let mut stream = ledger.stream_events(request(events)).await?.into_inner();
    while let Some(e) = stream.message().await? {
        if e.seq > head.seq {
            break;
        }
        emit(&Line::Event(event_from_proto(&e)))?;
    }
    let mut after_seq = 0;
    loop {
        let page = ledger
            .list_receipts(request(pb::ListReceiptsRequest {
                tenant: run.tenant.clone(),
                run_id: run.run_id.clone(),
                step_id: String::new(),
                page_size: 5000,
                after_seq,
            }))
            .await?
            .into_inner();
        for r in page.receipts.into_iter().filter(|r| r.seq <= head.seq) {
            emit(&Line::Receipt(receipt(r)))?;
        }
        if page.next_after_seq == 0 {
            break;
        }
        after_seq = page.next_after_seq;
    }
    emit(&Line::Head(SignedHeadLine {
        head: warden_core::head::Head { run_id: head.run_id, seq: head.seq, hash: head.hash },
        signature: hex::encode(head.signature),
        key_id: head.key_id,
        public_key: hex::encode(head.public_key),
    }))?;
    let mut response = out.into_response();
    let h = response.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/x-ndjson"));
    // The run id is a checked id (letters, digits, `-_:.`), safe inside the quoted file name.
    if let Ok(v) = HeaderValue::from_str(&format!("attachment; filename=\"run-{}.jsonl\"", run.run_id)) {
        h.insert(header::CONTENT_DISPOSITION, v);
    }
    Ok(response)
}

fn receipt(r: pb::Receipt) -> warden_core::receipt::Receipt {
    warden_core::receipt::Receipt {
        receipt_id: r.receipt_id,
        run_id: r.run_id,
        step_id: r.step_id,
        attempt: r.attempt,
        seq: r.seq,
        trace_id: r.trace_id,
        span_id: r.span_id,
        job_id: r.job_id,
        tx_id: r.tx_id,
        capability_id: r.capability_id,
        policy_decision: r.policy_decision,
        action_type: r.action_type,
        timestamp_ms: r.timestamp_ms,
        status: r.status,
        reason: r.reason,
        event_hash: r.event_hash,
        hash: r.hash,
    }
}
