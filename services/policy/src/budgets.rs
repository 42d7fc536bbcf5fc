//! Budgets (seed 000 §13, K15): per run and per tenant, calls, cost and time, monotonic. The
//! limits stage runs before approval gates and invariants (Artana's order); a breach denies
//! every further call, so a run over budget stops scheduling.

use tonic::Status;
use warden_core::ids::{check_id, check_step_id};
use warden_grpc::invalid_field;
use warden_proto::v1 as pb;

use crate::rules::{RuleDecision, Verdict};
use crate::server::PolicyService;

/// Applies the tenant's limits to an allow, and counts the call when it stays allowed.
pub async fn limits(svc: &PolicyService, r: &pb::AuthorizeRequest, rule: RuleDecision) -> Result<RuleDecision, Status> {
    if rule.verdict != Verdict::Allow {
        return Ok(rule);
    }
    let Some(t) = svc.config().tenants.get(&r.tenant).cloned() else { return Ok(rule) };
    if t.max_cost_per_call > 0.0 {
        let amount = serde_json::from_str::<serde_json::Value>(&r.args_json)
            .ok()
            .and_then(|a| a.get("amount_usd").and_then(serde_json::Value::as_f64))
            .unwrap_or(0.0);
        if amount > t.max_cost_per_call {
            return Ok(RuleDecision {
                verdict: Verdict::Deny,
                rule_id: "call_cost_limit".into(),
                reason: format!("amount_usd {amount} is over the {} allowed per call", t.max_cost_per_call),
            });
        }
    }
    // No limits configured: nothing to read on the hot path.
    if !has_limits(&t) {
        return Ok(rule);
    }
    // A child frame spends its root run's budget: what is left of it (seed 001).
    let root = svc.budget_run(&r.tenant, &r.run_id).await?;
    let run = svc.store().usage(&format!("run:{}", root.run_id)).await?;
    let tenant = svc.store().usage(&format!("tenant:{}", r.tenant)).await?;
    let deny =
        |rule_id: &str, reason: String| Ok(RuleDecision { verdict: Verdict::Deny, rule_id: rule_id.into(), reason });
    if t.max_calls_per_run > 0 && run.calls >= t.max_calls_per_run {
        return deny(
            "run_call_limit",
            format!("the run made {} calls, its limit is {}", run.calls, t.max_calls_per_run),
        );
    }
    // The tree's time, from the root's submission: a frame has what is left of it.
    let elapsed = warden_grpc::now_ms().saturating_sub(root.started_ms).max(0) as u64;
    if t.max_run_ms > 0 && elapsed >= t.max_run_ms {
        return deny(
            "run_time_limit",
            format!("the run has been going {elapsed} ms, its limit is {} ms", t.max_run_ms),
        );
    }
    if t.max_cost_per_run > 0.0 && run.cost >= t.max_cost_per_run {
        return deny("run_budget_exhausted", format!("the run spent {:.4} of its {:.4}", run.cost, t.max_cost_per_run));
    }
    if t.max_cost_per_tenant > 0.0 && tenant.cost >= t.max_cost_per_tenant {
        return deny(
            "tenant_budget_exhausted",
            format!("tenant '{}' spent {:.4} of its {:.4}", r.tenant, tenant.cost, t.max_cost_per_tenant),
        );
    }
    if t.rate_limit_per_minute > 0 {
        match svc.rate().hit(&r.tenant, warden_grpc::now_ms()).await {
            Ok(n) if n > t.rate_limit_per_minute => {
                return deny(
                    "tenant_rate_limit",
                    format!("tenant '{}' is over {} calls this minute", r.tenant, t.rate_limit_per_minute),
                );
            }
            Ok(_) => {}
            // Fail closed without deciding: a window that cannot be counted allows nothing, and
            // the caller asks again (a Redis blip is not a recorded deny).
            Err(e) => return Err(Status::unavailable(format!("the rate window could not be counted: {e}"))),
        }
    }
    Ok(rule)
}

pub(crate) fn has_limits(t: &warden_config::TenantPolicy) -> bool {
    t.max_calls_per_run > 0
        || t.max_cost_per_run > 0.0
        || t.max_cost_per_tenant > 0.0
        || t.rate_limit_per_minute > 0
        || t.max_run_ms > 0
}

/// Counts an allowed call once per decision (a retried Authorize of the same call is not
/// counted again), for tenants with limits.
pub async fn count(svc: &PolicyService, r: &pb::AuthorizeRequest, decision_id: &str) -> Result<(), Status> {
    if !svc.config().tenants.get(&r.tenant).is_some_and(has_limits) {
        return Ok(());
    }
    let root = svc.budget_run(&r.tenant, &r.run_id).await?;
    svc.store().count_call(&r.tenant, &root.run_id, decision_id).await?;
    Ok(())
}

/// Largest cost one record may carry: far above any real call, far below what would make the
/// sums lose precision.
const MAX_COST_PER_RECORD: f64 = 1e9;

/// `RecordCost`: adds a step attempt's cost once per (run, step, attempt); costs are never
/// negative. Only the mesh records cost (the server checks the caller).
pub async fn record_cost(svc: &PolicyService, r: pb::RecordCostRequest) -> Result<(), Status> {
    check_id(&r.tenant).map_err(|e| invalid_field("tenant", e.to_string()))?;
    check_id(&r.run_id).map_err(|e| invalid_field("run_id", e.to_string()))?;
    check_step_id(&r.step_id).map_err(|e| invalid_field("step_id", e.to_string()))?;
    if r.attempt == 0 {
        return Err(invalid_field("attempt", "attempts count from 1"));
    }
    if !r.cost.is_finite() || !(0.0..=MAX_COST_PER_RECORD).contains(&r.cost) {
        return Err(invalid_field(
            "cost",
            format!("must be a finite number from 0 to {MAX_COST_PER_RECORD} (budgets only grow)"),
        ));
    }
    let key = format!("{}:{}:{}", r.run_id, r.step_id, r.attempt);
    let root = svc.budget_run(&r.tenant, &r.run_id).await?;
    svc.store().record_cost(&r.tenant, &root.run_id, &key, r.cost).await?;
    Ok(())
}
