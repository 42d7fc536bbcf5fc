//! The intent-plan stage (seed 002), first in Artana's order: calls of configured tools need
//! a recorded intent plan — a `policy::intent_plan` run summary in the ledger — that is not
//! older than `policy.intent_max_age_secs`; otherwise `missing_intent_plan`.

use tonic::Status;
use warden_grpc::now_ms;
use warden_proto::v1 as pb;

use crate::rules::{RuleDecision, Verdict, matches};
use crate::server::PolicyService;

/// Summary type under which intent plans are recorded.
pub const INTENT_PLAN: &str = "policy::intent_plan";

pub async fn check(svc: &PolicyService, r: &pb::AuthorizeRequest, rule: RuleDecision) -> Result<RuleDecision, Status> {
    if rule.verdict != Verdict::Allow || !svc.config().intent_required_tools.iter().any(|p| matches(p, &r.tool)) {
        return Ok(rule);
    }
    let latest = svc
        .ledger()
        .list_summaries(pb::ListSummariesRequest {
            tenant: r.tenant.clone(),
            run_id: r.run_id.clone(),
            summary_type: INTENT_PLAN.into(),
            limit: 1,
        })
        .await?
        .into_inner()
        .summaries
        .into_iter()
        .next();
    let max_age = svc.config().intent_max_age_secs as i64 * 1000;
    let deny = |reason: String| RuleDecision { verdict: Verdict::Deny, rule_id: "missing_intent_plan".into(), reason };
    Ok(match latest {
        None => deny(format!("'{}' needs an intent plan recorded for this run", r.tool)),
        Some(p) if max_age > 0 && now_ms() - p.timestamp_ms > max_age => {
            deny(format!("the run's intent plan is older than {} s", svc.config().intent_max_age_secs))
        }
        Some(_) => rule,
    })
}
