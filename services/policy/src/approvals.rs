//! Approvals: durable, idempotent, bound to the exact argument digest (K18).
//!
//! A tenant's `require_approval` patterns gate tools: an otherwise allowed call waits for a
//! human. The approval for a call is keyed by (tenant, run, step, tool, SHA-256 of the
//! canonical arguments), so changed arguments need a new approval. The run waits in
//! `blocked` holding no executor; resolving the approval appends `run_resumed`, and any
//! executor picks the run up again: an approved call is allowed, a denied one is a
//! `human_denied` deny (never retried).

use std::collections::HashMap;
use std::time::Duration;

use serde_json::json;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};
use warden_core::events;
use warden_core::ids::check_id;
use warden_grpc::{invalid_field, now_ms};
use warden_proto::v1 as pb;

use crate::rules::{RuleDecision, Verdict};
use crate::server::{Checked, PolicyService};
use crate::store::ApprovalRow;

/// How often a watcher looks for changes it was not woken for (another replica's, expiries).
const RESCAN: Duration = Duration::from_secs(2);
/// Overlap between rescans, for clocks of replicas that disagree a little.
const CLOCK_SKEW_MS: i64 = 5_000;
/// Rows per query of a watcher.
const PAGE: u32 = 1_000;

fn matches(pattern: &str, tool: &str) -> bool {
    match pattern.strip_suffix('*') {
        Some(prefix) => tool.starts_with(prefix),
        None => pattern == tool,
    }
}

/// One approval per call: the idempotency key is part of it, so an approval never covers a
/// second call of the same arguments under a new key.
fn approval_id(r: &pb::AuthorizeRequest, args_sha256: &str) -> String {
    let key =
        warden_core::canonical_json(&json!([r.tenant, r.run_id, r.step_id, r.tool, args_sha256, r.idempotency_key]));
    format!("apr-{}", &warden_core::sha256_hex(key)[..24])
}

/// Applies the approval gate to an allow (other outcomes pass through). Gates are enforced
/// in every mode.
pub(crate) async fn gate(
    svc: &PolicyService,
    r: &pb::AuthorizeRequest,
    c: &mut Checked,
    rule: RuleDecision,
) -> Result<RuleDecision, Status> {
    let tenant = svc.config().tenants.get(&r.tenant);
    let gated = tenant.is_some_and(|t| t.require_approval.iter().any(|p| matches(p, &r.tool)));
    if rule.verdict != Verdict::Allow || !gated {
        return Ok(rule);
    }
    if tenant.is_some_and(|t| t.approval_mode == "critic") {
        return critic(svc, r, c).await;
    }
    let now = now_ms();
    let wanted = ApprovalRow {
        approval_id: approval_id(r, &c.args_sha256),
        tenant: r.tenant.clone(),
        run_id: r.run_id.clone(),
        step_id: r.step_id.clone(),
        tool: r.tool.clone(),
        args_sha256: c.args_sha256.clone(),
        state: "pending".into(),
        approver: String::new(),
        reason: String::new(),
        created_at_ms: now,
        expires_at_ms: now.saturating_add(svc.config().approval_ttl_secs as i64 * 1000),
    };
    // Read only: the approval is created after the decision asking for it is recorded (see
    // `Checked::new_approval`), so a request the ledger refuses — a stale epoch, say — leaves
    // nothing pending behind.
    let a = match svc.store().approval(&wanted.approval_id).await? {
        Some(a) => a,
        None => {
            c.new_approval = Some(wanted.clone());
            wanted
        }
    };
    let state = if a.state == "pending" && now >= a.expires_at_ms { "expired" } else { a.state.as_str() };
    c.gate = format!("|{}:{state}", a.approval_id);
    let decided = |verdict, rule_id: &str, reason: String| RuleDecision { verdict, rule_id: rule_id.into(), reason };
    Ok(match state {
        "approved" => decided(
            Verdict::Allow,
            "approval_gate",
            format!("approved by {} ({}): {}", a.approver, a.approval_id, a.reason),
        ),
        "denied" => decided(
            Verdict::Deny,
            "human_denied",
            format!("denied by {} ({}): {}", a.approver, a.approval_id, a.reason),
        ),
        "expired" => {
            decided(Verdict::Deny, "approval_expired", format!("approval {} expired unanswered", a.approval_id))
        }
        _ => decided(
            Verdict::ApprovalRequired,
            "approval_required",
            format!("'{}' waits for approval {}", r.tool, a.approval_id),
        ),
    })
}

/// The model critic reviews the call instead of a person (seed 002): asked through the planner,
/// which records its model call in the run and replays the recorded verdict when the same call
/// is decided again, so this decision is deterministic. No verdict — the critic's model call
/// denied, its provider down, an unreadable answer, the planner unreachable — is a deny:
/// the gate fails closed. A `critic_denied` call is never retried (a denial is a decision).
async fn critic(svc: &PolicyService, r: &pb::AuthorizeRequest, c: &mut Checked) -> Result<RuleDecision, Status> {
    let decided = |verdict, rule_id: &str, reason: String| RuleDecision { verdict, rule_id: rule_id.into(), reason };
    if r.epoch == 0 {
        // Only a driven run (its executor, under its lease epoch) can have the critic's call
        // recorded; anyone else asking gets no verdict.
        return Ok(decided(
            Verdict::Deny,
            "critic_unavailable",
            format!("'{}' is reviewed by the critic, which is asked only for a driven run's call", r.tool),
        ));
    }
    let ask = pb::CritiqueRequest {
        tenant: r.tenant.clone(),
        run_id: r.run_id.clone(),
        step_id: r.step_id.clone(),
        attempt: r.attempt,
        tool: r.tool.clone(),
        args_json: warden_core::canonical_json(c.args()),
        epoch: r.epoch,
        agent: r.agent.clone(),
    };
    let answer = match svc.planner().critique(ask).await {
        Ok(a) => a.into_inner(),
        Err(s) if warden_grpc::is_fenced(&s) => return Err(s),
        Err(s) => {
            let why = format!("the critic could not be asked: {}", s.message());
            return Ok(decided(Verdict::Deny, "critic_unavailable", why));
        }
    };
    // The verdict is part of the decision's identity, as an approval's state is.
    c.gate = format!("|critic:{}", answer.verdict);
    Ok(match answer.verdict.as_str() {
        "approve" => decided(Verdict::Allow, "critic_approved", format!("the critic approved: {}", answer.reason)),
        "deny" => decided(Verdict::Deny, "critic_denied", format!("the critic denied: {}", answer.reason)),
        _ => decided(Verdict::Deny, "critic_unavailable", format!("no verdict from the critic: {}", answer.reason)),
    })
}

/// The wire form of an approval; `approvers` is who may resolve it (the tenant's list).
fn to_proto(a: &ApprovalRow, approvers: &[String]) -> pb::Approval {
    let state = match a.state.as_str() {
        "approved" => pb::ApprovalState::Approved,
        "denied" => pb::ApprovalState::Denied,
        "expired" => pb::ApprovalState::Expired,
        _ if now_ms() >= a.expires_at_ms => pb::ApprovalState::Expired,
        _ => pb::ApprovalState::Pending,
    };
    pb::Approval {
        approval_id: a.approval_id.clone(),
        tenant: a.tenant.clone(),
        run_id: a.run_id.clone(),
        step_id: a.step_id.clone(),
        tool: a.tool.clone(),
        args_sha256: a.args_sha256.clone(),
        state: state as i32,
        approver: a.approver.clone(),
        reason: a.reason.clone(),
        created_at_ms: a.created_at_ms,
        expires_at_ms: a.expires_at_ms,
        approvers: approvers.to_vec(),
    }
}

#[derive(Clone)]
pub struct ApprovalsService {
    policy: PolicyService,
}

impl ApprovalsService {
    pub fn new(policy: PolicyService) -> ApprovalsService {
        ApprovalsService { policy }
    }

    /// Who may resolve the tenant's approvals (empty: the tenant keeps no list).
    fn approvers(&self, tenant: &str) -> Vec<String> {
        self.policy.config().tenants.get(tenant).map(|t| t.approvers.clone()).unwrap_or_default()
    }

    async fn owned(&self, tenant: &str, approval_id: &str) -> Result<ApprovalRow, Status> {
        check_id(tenant).map_err(|e| invalid_field("tenant", e.to_string()))?;
        check_id(approval_id).map_err(|e| invalid_field("approval_id", e.to_string()))?;
        match self.policy.store().approval(approval_id).await? {
            Some(a) if a.tenant == tenant => Ok(a),
            _ => Err(Status::not_found(format!("approval '{approval_id}' not found"))),
        }
    }

    async fn resolve(
        &self,
        req: Request<pb::ResolveApprovalRequest>,
        state: &str,
    ) -> Result<Response<pb::Approval>, Status> {
        warden_grpc::auth::check(&req, &req.get_ref().tenant)?;
        // An agent never resolves approvals, least of all of its own calls.
        warden_grpc::auth::forbid_agent(&req, "resolve approvals")?;
        let allowed = self.policy.config().tenants.get(&req.get_ref().tenant).map(|t| t.approvers.clone());
        let allowed = allowed.unwrap_or_default();
        // With tokens, the approver is who the token says, not a name the caller types.
        let approver = warden_grpc::auth::approver(&req, &req.get_ref().approver, !allowed.is_empty())?;
        let mut r = req.into_inner();
        r.approver = approver;
        let a = self.owned(&r.tenant, &r.approval_id).await?;
        if r.approver.is_empty() || r.approver.len() > 256 || r.approver.contains('\0') {
            return Err(invalid_field("approver", "name who decides (1-256 characters)"));
        }
        if r.reason.len() > 4096 || r.reason.contains('\0') {
            return Err(invalid_field("reason", "at most 4096 bytes"));
        }
        if !allowed.is_empty() && !allowed.contains(&r.approver) {
            return Err(Status::permission_denied(format!(
                "'{}' may not approve tenant '{}' calls",
                r.approver, r.tenant
            )));
        }
        let changed =
            self.policy.store().resolve_approval(&a.approval_id, state, &r.approver, &r.reason, now_ms()).await?;
        if changed {
            self.policy.approvals_changed();
        }
        let now = self.owned(&r.tenant, &r.approval_id).await?;
        if !changed && now.state != state {
            let shown = if now.state == "pending" { "expired" } else { now.state.as_str() };
            return Err(Status::failed_precondition(format!("approval {} is already {shown}", now.approval_id)));
        }
        // Approving again changes nothing but makes sure the run is resumed.
        tokio::spawn(resume(self.policy.clone(), now.clone()));
        tracing::info!(approval_id = %now.approval_id, state, approver = %r.approver, "approval resolved");
        Ok(Response::new(to_proto(&now, &allowed)))
    }
}

/// Moves runs whose approval expired unanswered: each such run is resumed, so its executor
/// asks again, gets the recorded deny `approval_expired`, and the run continues or fails by its
/// plan instead of staying blocked. The approval is marked `expired` only once its run was
/// resumed (or needs no resuming), so a resume that fails — the ledger down, this replica
/// restarting — is tried again on the next pass, by any replica.
pub async fn expire_approvals(policy: PolicyService, every: Duration) {
    loop {
        tokio::time::sleep(every).await;
        let now = now_ms();
        // The shared store's count, so every replica reports the same figure.
        if let Ok(n) = policy.store().pending_count().await {
            warden_telemetry::metrics::approvals_pending(n);
        }
        let due = match policy.store().expired_pending(now, PAGE).await {
            Ok(due) => due,
            Err(e) => {
                tracing::warn!(error = %e, "expired approvals not read; will retry");
                continue;
            }
        };
        for a in due {
            let expired = ApprovalRow { state: "expired".into(), ..a };
            match resume_once(&policy, &expired).await {
                Ok(true) => {}
                // Not blocked yet (its executor is still settling other steps): next pass.
                Ok(false) => continue,
                Err(e) => {
                    tracing::warn!(approval_id = %expired.approval_id, error = %e, "run of an expired approval not resumed; will retry");
                    continue;
                }
            }
            match policy.store().mark_expired(&expired.approval_id, now).await {
                Ok(true) => {
                    tracing::info!(approval_id = %expired.approval_id, run_id = %expired.run_id, "approval expired; its run resumed");
                    policy.approvals_changed();
                }
                Ok(false) => {}
                Err(e) => tracing::warn!(approval_id = %expired.approval_id, error = %e, "approval not marked expired"),
            }
        }
    }
}

/// One try at resuming the run of approval `a`: `run_resumed` appended (idempotent per
/// approval) if the run is blocked; true when nothing more is needed, false when the run is
/// not blocked yet.
async fn resume_once(policy: &PolicyService, a: &ApprovalRow) -> Result<bool, Status> {
    let mut ledger = policy.ledger();
    let run = ledger
        .get_run(pb::GetLedgerRunRequest { tenant: a.tenant.clone(), run_id: a.run_id.clone(), with_events: false })
        .await?
        .into_inner();
    match run.status() {
        pb::RunStatus::Blocked => {
            ledger
                .append_event(pb::AppendEventRequest {
                    tenant: a.tenant.clone(),
                    run_id: a.run_id.clone(),
                    epoch: run.max_epoch,
                    idempotency_key: format!("resumed:{}", a.approval_id),
                    event_type: events::RUN_RESUMED.into(),
                    payload_json: json!({"approval_id": a.approval_id, "state": a.state, "approver": a.approver})
                        .to_string(),
                    step_id: a.step_id.clone(),
                })
                .await?;
            Ok(true)
        }
        pb::RunStatus::Pending | pb::RunStatus::Active | pb::RunStatus::Paused => Ok(false),
        // Ended, or waiting for an operator: its next decision sees the expiry by itself.
        _ => Ok(true),
    }
}

/// Appends `run_resumed` once the run is blocked (the executor may still be blocking it),
/// retrying for a while; the event is idempotent per approval. Expired approvals are resumed
/// by [`expire_approvals`], which retries for as long as it takes.
async fn resume(policy: PolicyService, a: ApprovalRow) {
    for _ in 0..240 {
        if let Ok(true) = resume_once(&policy, &a).await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    tracing::warn!(approval_id = %a.approval_id, run_id = %a.run_id, "run not resumed: it never blocked on this approval");
}

#[tonic::async_trait]
impl pb::approvals_server::Approvals for ApprovalsService {
    async fn list(
        &self,
        req: Request<pb::ListApprovalsRequest>,
    ) -> Result<Response<pb::ListApprovalsResponse>, Status> {
        warden_grpc::auth::check(&req, &req.get_ref().tenant)?;
        let r = req.into_inner();
        check_id(&r.tenant).map_err(|e| invalid_field("tenant", e.to_string()))?;
        let state =
            match pb::ApprovalState::try_from(r.state).map_err(|_| invalid_field("state", "unknown approval state"))? {
                pb::ApprovalState::Unspecified | pb::ApprovalState::Expired => None,
                pb::ApprovalState::Pending => Some("pending"),
                pb::ApprovalState::Approved => Some("approved"),
                pb::ApprovalState::Denied => Some("denied"),
            };
        if !r.page_token.is_empty() {
            check_id(&r.page_token).map_err(|e| invalid_field("page_token", e.to_string()))?;
        }
        let size = match r.page_size {
            0 => 100,
            n if n > 1000 => return Err(invalid_field("page_size", "must be at most 1000")),
            n => n,
        };
        let rows = self.policy.store().approvals(&r.tenant, state, &r.page_token, size).await?;
        let next_page_token = if rows.len() == size as usize {
            rows.last().map(|a| a.approval_id.clone()).unwrap_or_default()
        } else {
            String::new()
        };
        let approvers = self.approvers(&r.tenant);
        let mut approvals: Vec<pb::Approval> = rows.iter().map(|a| to_proto(a, &approvers)).collect();
        if r.state == pb::ApprovalState::Expired as i32 {
            approvals.retain(|a| a.state == pb::ApprovalState::Expired as i32);
        }
        Ok(Response::new(pb::ListApprovalsResponse { approvals, next_page_token }))
    }

    async fn get(&self, req: Request<pb::GetApprovalRequest>) -> Result<Response<pb::Approval>, Status> {
        warden_grpc::auth::check(&req, &req.get_ref().tenant)?;
        let r = req.into_inner();
        Ok(Response::new(to_proto(&self.owned(&r.tenant, &r.approval_id).await?, &self.approvers(&r.tenant))))
    }

    async fn approve(&self, req: Request<pb::ResolveApprovalRequest>) -> Result<Response<pb::Approval>, Status> {
        self.resolve(req, "approved").await
    }

    async fn deny(&self, req: Request<pb::ResolveApprovalRequest>) -> Result<Response<pb::Approval>, Status> {
        self.resolve(req, "denied").await
    }

    type WatchStream = ReceiverStream<Result<pb::Approval, Status>>;

    /// Every approval of the tenant as it is now, then each change as it happens: woken at once
    /// by changes made through this replica, and every [`RESCAN`] for changes made through
    /// another replica and for expiries.
    async fn watch(&self, req: Request<pb::WatchApprovalsRequest>) -> Result<Response<Self::WatchStream>, Status> {
        warden_grpc::auth::check(&req, &req.get_ref().tenant)?;
        let r = req.into_inner();
        check_id(&r.tenant).map_err(|e| invalid_field("tenant", e.to_string()))?;
        let (tx, rx) = tokio::sync::mpsc::channel(64);
        let approvers = self.approvers(&r.tenant);
        let store = self.policy.store().clone();
        let mut changes = self.policy.approval_changes();
        tokio::spawn(async move {
            let mut seen: HashMap<String, i32> = HashMap::new();
            let mut since: Option<i64> = None;
            loop {
                let started = now_ms();
                let mut after = String::new();
                loop {
                    let page = match since {
                        None => store.approvals(&r.tenant, None, &after, PAGE).await,
                        Some(t) => {
                            store.approvals_touched_since(&r.tenant, t - CLOCK_SKEW_MS, started, &after, PAGE).await
                        }
                    };
                    let rows = match page {
                        Ok(rows) => rows,
                        Err(e) => {
                            let _ = tx.send(Err(e.into())).await;
                            return;
                        }
                    };
                    for a in rows.iter().map(|a| to_proto(a, &approvers)) {
                        if seen.get(&a.approval_id) != Some(&a.state) {
                            seen.insert(a.approval_id.clone(), a.state);
                            if tx.send(Ok(a)).await.is_err() {
                                return;
                            }
                        }
                    }
                    match rows.last() {
                        Some(last) if rows.len() == PAGE as usize => after = last.approval_id.clone(),
                        _ => break,
                    }
                }
                since = Some(started);
                tokio::select! {
                    woke = changes.changed() => if woke.is_err() { return },
                    _ = tokio::time::sleep(RESCAN) => {}
                    _ = tx.closed() => return,
                }
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}
