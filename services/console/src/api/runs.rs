//! Runs: the list (by tenant, status and agent, a page at a time) and one run with everything
//! its page draws — status, progress, plan, the trace DAG, each step's derived arguments and
//! the receipts.

use std::collections::HashMap;

use axum::extract::rejection::PathRejection;
use axum::extract::{Path, RawQuery, State};
use axum::http::HeaderMap;
use axum::response::Response;
use futures::{StreamExt, TryFutureExt};
use serde_json::{Value, json};
use warden_core::events::RunStatus;
use warden_grpc::convert::status_to_proto;
use warden_proto::v1 as pb;

use crate::api::{path_id, token};
use crate::error::ApiError;
use crate::input::Query;
use crate::mesh::{Mesh, request};
use crate::views;

/// Runs looked up at once to fill in each listed run's agent and steps.
const LOOKUPS_IN_FLIGHT: usize = 8;

/// `status=blocked,completed` → the wire's statuses.
fn statuses(raw: &str) -> Result<Vec<i32>, ApiError> {
    raw.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| {
            RunStatus::parse(s)
                .map(|st| status_to_proto(st) as i32)
                .ok_or_else(|| ApiError::invalid("status", format!("'{s}' is not a run status")))
        })
        .collect()
}

/// `GET /api/runs?tenant=&status=&agent=&page_size=&page_token=`. An empty tenant lists every
/// tenant's runs (the mesh allows that to operators only). The agent filter applies to the
/// page the ledger returned, so a filtered page may hold fewer runs than its size.
pub async fn list(State(mesh): State<Mesh>, headers: HeaderMap, RawQuery(raw): RawQuery) -> Result<Response, ApiError> {
    let token = token(&headers)?;
    let q = Query::parse(raw.as_deref(), &["tenant", "status", "agent", "page_size", "page_token"])?;
    let tenant = q.optional_id("tenant")?;
    let agent = q.optional_id("agent")?;
    let page = mesh
        .ledger(token)?
        .list_runs(request(pb::ListLedgerRunsRequest {
            tenant,
            statuses: statuses(q.get("status"))?,
            page_size: q.page_size(25, 100)?,
            page_token: q.page_token()?,
        }))
        .await?
        .into_inner();
    let runs_client = mesh.runs(token)?;
    // Each run's agent and steps come from its events (Runs.GetRun); a run that cannot be read
    // now (the executor restarting) is listed with what the ledger knows.
    let wanted: Vec<pb::GetRunRequest> =
        page.runs.iter().map(|r| pb::GetRunRequest { tenant: r.tenant.clone(), run_id: r.run_id.clone() }).collect();
    let lookups = wanted.into_iter().map(|req| {
        let mut client = runs_client.clone();
        async move { client.get_run(request(req)).map_ok(|r| r.into_inner()).await.ok() }
    });
    let details: Vec<Option<pb::Run>> = futures::stream::iter(lookups).buffered(LOOKUPS_IN_FLIGHT).collect().await;
    let runs: Vec<Value> = page
        .runs
        .iter()
        .zip(details)
        .filter_map(|(summary, detail)| {
            let mut v = views::ledger_run(summary);
            if let Some(d) = &detail {
                if !agent.is_empty() && d.agent != agent {
                    return None;
                }
                v["agent"] = json!(d.agent);
                let count = |st: pb::StepStatus| d.steps.iter().filter(|s| s.status == st as i32).count();
                v["steps"] = json!({"total": d.steps.len(), "completed": count(pb::StepStatus::Completed)});
            } else if !agent.is_empty() {
                return None;
            }
            Some(v)
        })
        .collect();
    Ok(views::ok(json!({"runs": runs, "next_page_token": page.next_page_token})))
}

/// `GET /api/runs/{run_id}?tenant=`: the run as its page draws it.
pub async fn detail(
    State(mesh): State<Mesh>,
    headers: HeaderMap,
    path: Result<Path<String>, PathRejection>,
    RawQuery(raw): RawQuery,
) -> Result<Response, ApiError> {
    let token = token(&headers)?;
    let run_id = path_id(path, "run_id")?;
    let tenant = Query::parse(raw.as_deref(), &["tenant"])?.tenant()?;
    let get = pb::GetRunRequest { tenant: tenant.clone(), run_id: run_id.clone() };
    let ledger_get = pb::GetLedgerRunRequest { tenant: tenant.clone(), run_id: run_id.clone(), with_events: false };
    let progress_get = pb::GetRunProgressRequest { tenant: tenant.clone(), run_id: run_id.clone() };
    let receipts_get =
        pb::ListReceiptsRequest { tenant, run_id, step_id: String::new(), page_size: 1000, after_seq: 0 };
    let (mut runs, mut ledger) = (mesh.runs(token)?, mesh.ledger(token)?);
    let (mut runs2, mut ledger2, mut ledger3) = (runs.clone(), ledger.clone(), ledger.clone());
    let (run, stored, trace, progress, receipts) = futures::try_join!(
        runs.get_run(request(get.clone())),
        ledger.get_run(request(ledger_get)),
        runs2.get_trace(request(get)),
        ledger2.get_run_progress(request(progress_get)),
        ledger3.list_receipts(request(receipts_get)),
    )?;
    let (run, stored, trace, progress) =
        (run.into_inner(), stored.into_inner(), trace.into_inner(), progress.into_inner());
    let outputs: HashMap<String, Value> = run
        .steps
        .iter()
        .filter(|s| s.status == pb::StepStatus::Completed as i32)
        .map(|s| (s.id.clone(), views::parsed(&s.output_json)))
        .collect();
    let args: serde_json::Map<String, Value> = run
        .steps
        .iter()
        .map(|s| {
            let shown = match crate::args::derive(&stored.plan_json, &s.id, &outputs) {
                Ok(a) => json!({"args": a, "args_sha256": warden_core::canonical::args_digest(&a)}),
                Err(why) => json!({"args": null, "note": why}),
            };
            (s.id.clone(), shown)
        })
        .collect();
    Ok(views::ok(json!({
        "run": views::run(&run),
        "ledger": views::ledger_run(&stored),
        "plan": views::parsed(&stored.plan_json),
        "progress": {
            "percent": progress.percent,
            "current_stage": progress.current_stage,
            "completed_stages": progress.completed_stages,
        },
        "trace": views::parsed(&trace.trace_json),
        "args": args,
        "receipts": receipts.into_inner().receipts.iter().map(views::receipt).collect::<Vec<_>>(),
    })))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_parse_by_name() {
        assert_eq!(statuses("blocked, completed").expect("valid").len(), 2);
        assert_eq!(statuses("").expect("none"), Vec::<i32>::new());
        assert_eq!(statuses("blocked,nope").expect_err("unknown").field.as_deref(), Some("status"));
    }
}
