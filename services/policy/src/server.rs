//! The `Policy` gRPC service: decide, record the decision in the ledger, sign allows.
//! `Capabilities` and `Approvals` are part of the contract but not served by this release.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};

use ed25519_dalek::SigningKey;
use serde_json::{Value, json};
use tonic::{Code, Request, Response, Status};
use warden_config::PolicyConfig;
use warden_core::auth::{AuthorizationClaims, CallIdentity, key_id, sign};
use warden_core::canonical::args_digest;
use warden_core::events;
use warden_core::ids::{check_id, check_step_id, check_tool_name};
use warden_grpc::{invalid_field, now_ms};
use warden_proto::v1 as pb;
use warden_proto::v1::ledger_client::LedgerClient;

use crate::cedar::CedarPolicies;
use crate::rules::{self, Verdict};
use crate::store::PolicyStore;
use warden_grpc::keyfile::PublishedKey;

/// Largest accepted argument document.
pub const MAX_ARGS_BYTES: usize = 1 << 20;

#[derive(Clone)]
pub struct PolicyService {
    config: Arc<PolicyConfig>,
    key: Arc<SigningKey>,
    published: Arc<Vec<PublishedKey>>,
    ledger: LedgerClient<warden_grpc::auth::Ch>,
    /// The planner, which asks the model critic (tenants with `approval_mode = "critic"`).
    planner: warden_proto::v1::planner_client::PlannerClient<warden_grpc::auth::Ch>,
    store: PolicyStore,
    /// The live Cedar policy set (None: allowlists decide). Swapped whole on reload.
    cedar: Arc<RwLock<Option<Arc<CedarPolicies>>>>,
    rate: crate::rate::RateLimiter,
    /// Bumped whenever this replica creates or resolves an approval (wakes `Approvals.Watch`).
    approval_changes: Arc<tokio::sync::watch::Sender<u64>>,
    /// Records decisions in the ledger off the hot path.
    recorder: crate::recorder::DecisionRecorder,
    /// Recorded plans, step id → tool, of runs decided on recently (plans do not change once
    /// recorded; a step missing here is looked up again before it is refused).
    plans: Arc<std::sync::Mutex<HashMap<String, PlannedSteps>>>,
    /// Runs → the root run of their frame tree, whose budget they spend (seed 001). A run's
    /// root never changes once it is recorded.
    budget_roots: Arc<std::sync::Mutex<HashMap<String, BudgetRoot>>>,
    /// The ledger's published keys: they verify the run acknowledgements that come with a
    /// run's plan (`AuthorizeRequest.run_ack`).
    ledger_keys: warden_grpc::keyfile::KeyRing,
}

/// A recorded plan's steps: step id → the tools it may call (its own, then its alternatives').
type PlannedSteps = Arc<HashMap<String, Vec<String>>>;

/// The steps of a plan's JSON (none if it does not parse). A plan answered directly runs no
/// step, whatever else it lists.
fn planned_steps(plan_json: &str) -> PlannedSteps {
    let planned = warden_core::plan::Plan::parse(plan_json)
        .ok()
        .filter(|p| p.direct_response.is_none())
        .map(|p| p.steps)
        .unwrap_or_default();
    Arc::new(planned.iter().map(|s| (s.id.clone(), s.tools().map(str::to_string).collect())).collect())
}

/// Steps (over all plans) kept in [`PolicyService::plans`] before it is emptied.
const CACHED_PLAN_STEPS: usize = 100_000;

/// Tools whose effect the ledger itself applies, in the same transaction that records it
/// (`CommitTx` checks the cited allow), so they are not steps of a plan: a commit cannot
/// happen outside the record.
const LEDGER_MEDIATED_TOOLS: &[&str] = &["commit_tx"];

/// A request that passed validation, with its canonical arguments.
pub(crate) struct Checked {
    pub(crate) args_sha256: String,
    args: Value,
    /// Public id of the capability the request presented (resolved from its handle).
    capability_id: String,
    /// The approval gate's state for this call (part of the decision's identity, so the
    /// decision after an approval is a new decision, not a rewrite of the first).
    pub(crate) gate: String,
    /// An approval this decision asks for that does not exist yet: created only once the
    /// decision is recorded, so a refused request leaves nothing behind.
    pub(crate) new_approval: Option<crate::store::ApprovalRow>,
    /// The semantic key this call claims if its decision ends an allow (claimed only then).
    pub(crate) semantic_claim: Option<(String, crate::store::SemanticClaim)>,
}

impl Checked {
    /// The call's arguments, canonicalized.
    pub(crate) fn args(&self) -> &Value {
        &self.args
    }
}

fn id_field(field: &str, v: &str, check: fn(&str) -> Result<(), warden_core::ids::IdError>) -> Result<(), Status> {
    check(v).map_err(|e| invalid_field(field, e.to_string()))
}

fn validate(r: &pb::AuthorizeRequest) -> Result<Checked, Status> {
    id_field("tenant", &r.tenant, check_id)?;
    id_field("run_id", &r.run_id, check_id)?;
    id_field("step_id", &r.step_id, check_step_id)?;
    id_field("tool", &r.tool, check_tool_name)?;
    if !r.agent.is_empty() {
        id_field("agent", &r.agent, check_id)?;
    }
    // K04: every mediated call carries an idempotency key.
    id_field("idempotency_key", &r.idempotency_key, check_id)?;
    if r.capability_handle.len() > 256 {
        return Err(invalid_field("capability_handle", "at most 256 characters"));
    }
    if r.attempt == 0 {
        return Err(invalid_field("attempt", "attempts count from 1"));
    }
    if i64::try_from(r.epoch).is_err() {
        return Err(invalid_field("epoch", format!("{} is over the maximum of {}", r.epoch, i64::MAX)));
    }
    if !r.retry_of.is_empty() {
        id_field("retry_of", &r.retry_of, check_id)?;
        if r.attempt < 2 {
            return Err(invalid_field("retry_of", "only a retry (attempt 2 or later) names the allow it retries"));
        }
    }
    if !r.plan_sha256.is_empty() && r.run_ack.is_none() {
        // A run's first call asked while the run is being created: decided against the plan
        // sent, which must be the one the digest names (the ledger then records the decision
        // only in a run whose recorded plan has that digest).
        if r.plan_json.is_empty() {
            return Err(invalid_field("plan_json", "a plan_sha256 comes with the plan it is the digest of"));
        }
        if warden_core::canonical::sha256_hex(r.plan_json.as_bytes()) != r.plan_sha256 {
            return Err(invalid_field("plan_sha256", "is not the SHA-256 of plan_json"));
        }
    }
    check_args(r)
}

/// The ledger append recording decision `id` (its signed record `payload_json`) about `r`'s call.
fn decision_record(r: &pb::AuthorizeRequest, id: &str, payload_json: String) -> pb::AppendEventRequest {
    pb::AppendEventRequest {
        tenant: r.tenant.clone(),
        run_id: r.run_id.clone(),
        epoch: r.epoch,
        idempotency_key: events::decision_key(id),
        event_type: events::POLICY_DECISION.into(),
        payload_json,
        step_id: r.step_id.clone(),
    }
}

/// The plan a request asking before its run is recorded carries (see
/// `AuthorizeRequest.plan_sha256`; its digest checked in [`validate`]): the mesh's alone.
fn unrecorded_plan(r: &pb::AuthorizeRequest) -> Option<&str> {
    (r.run_ack.is_none() && !r.plan_sha256.is_empty() && !r.plan_json.is_empty()).then_some(r.plan_json.as_str())
}

/// The arguments of a request whose identity is valid: a refusal here is also recorded
/// as a deny (`malformed_request`), since the call it names is real.
fn check_args(r: &pb::AuthorizeRequest) -> Result<Checked, Status> {
    if r.args_json.len() > MAX_ARGS_BYTES {
        return Err(invalid_field(
            "args_json",
            format!("{} bytes is over the maximum of {MAX_ARGS_BYTES}", r.args_json.len()),
        ));
    }
    let args: Value =
        serde_json::from_str(&r.args_json).map_err(|e| invalid_field("args_json", format!("not valid JSON: {e}")))?;
    if !args.is_object() {
        return Err(invalid_field("args_json", "must be a JSON object"));
    }
    // Resources are matched by prefix (capabilities, Cedar `like`): only normalized paths.
    if let Some(resource) = args.get("resource").and_then(Value::as_str) {
        crate::caps::normalized_resource(resource).map_err(|why| invalid_field("args_json.resource", why))?;
    }
    Ok(Checked {
        args_sha256: args_digest(&args),
        args,
        capability_id: String::new(),
        gate: String::new(),
        new_approval: None,
        semantic_claim: None,
    })
}

/// The run whose budget a run spends (the root of its frame tree) and when it was submitted.
#[derive(Debug, Clone)]
pub struct BudgetRoot {
    pub run_id: String,
    /// The root's `run_submitted` time, by the ledger's clock.
    pub started_ms: i64,
}

/// Same request, same decision id: a retried `Authorize` records nothing twice.
fn decision_id(r: &pb::AuthorizeRequest, c: &Checked) -> String {
    let args_sha256 = c.args_sha256.as_str();
    let call = CallIdentity {
        tenant: &r.tenant,
        run_id: &r.run_id,
        step_id: &r.step_id,
        attempt: r.attempt,
        tool: &r.tool,
        args_sha256,
        idempotency_key: &r.idempotency_key,
    };
    warden_core::auth::decision_id(&call, &format!("{}{}", c.capability_id, c.gate))
}

impl PolicyService {
    pub fn new(
        config: PolicyConfig,
        key: SigningKey,
        previous: Vec<SigningKey>,
        (ledger, planner): (warden_grpc::auth::Ch, warden_grpc::auth::Ch),
        store: PolicyStore,
        rate: crate::rate::RateLimiter,
    ) -> PolicyService {
        let mut published =
            vec![PublishedKey { key_id: key_id(&key.verifying_key()), key: key.verifying_key(), current: true }];
        published.extend(previous.iter().map(|k| PublishedKey {
            key_id: key_id(&k.verifying_key()),
            key: k.verifying_key(),
            current: false,
        }));
        PolicyService {
            // Connected lazily: a planner that is down fails only the critic's reviews (closed).
            planner: warden_proto::v1::planner_client::PlannerClient::new(planner),
            config: Arc::new(config),
            key: Arc::new(key),
            published: Arc::new(published),
            recorder: crate::recorder::DecisionRecorder::start(LedgerClient::new(ledger.clone())),
            ledger: LedgerClient::new(ledger),
            store,
            cedar: Arc::default(),
            rate,
            approval_changes: Arc::new(tokio::sync::watch::Sender::new(0)),
            plans: Arc::default(),
            budget_roots: Arc::default(),
            ledger_keys: Default::default(),
        }
    }

    /// The run whose budget `run_id` spends: the root of its frame tree (a child frame's
    /// `run_submitted` names it), else the run itself, with when the root was submitted (the
    /// start of the tree's time budget). Read from the ledger once per run.
    pub async fn budget_run(&self, tenant: &str, run_id: &str) -> Result<BudgetRoot, Status> {
        if let Some(root) = self.budget_roots.lock().unwrap_or_else(|p| p.into_inner()).get(run_id) {
            return Ok(root.clone());
        }
        let first = self.first_event(tenant, run_id).await?;
        let named = first
            .as_ref()
            .and_then(|e| serde_json::from_str::<serde_json::Value>(&e.payload_json).ok())
            .and_then(|p| p.pointer("/frame/root_run_id").and_then(serde_json::Value::as_str).map(str::to_string))
            .filter(|r| !r.is_empty() && r != run_id);
        // A run with no record yet has spent nothing; it is not remembered until it has one.
        let Some(first) = first else {
            return Ok(BudgetRoot { run_id: run_id.to_string(), started_ms: warden_grpc::now_ms() });
        };
        let root = match named {
            None => BudgetRoot { run_id: run_id.to_string(), started_ms: first.timestamp_ms },
            Some(root) => {
                let Some(root_first) = self.first_event(tenant, &root).await? else {
                    return Err(Status::failed_precondition(format!("the root run {root} has no record")));
                };
                let started_ms = root_first.timestamp_ms;
                BudgetRoot { run_id: root, started_ms }
            }
        };
        let mut roots = self.budget_roots.lock().unwrap_or_else(|p| p.into_inner());
        if roots.len() >= CACHED_PLAN_STEPS {
            roots.clear();
        }
        roots.insert(run_id.to_string(), root.clone());
        Ok(root)
    }

    /// A run's first event (`run_submitted`), if it has any.
    async fn first_event(&self, tenant: &str, run_id: &str) -> Result<Option<pb::Event>, Status> {
        let req = pb::StreamEventsRequest { tenant: tenant.into(), run_id: run_id.into(), since_seq: 0, follow: false };
        let mut stream = self.ledger.clone().stream_events(req).await?.into_inner();
        stream.message().await
    }

    /// The live Cedar policy set, if any.
    pub fn cedar(&self) -> Option<Arc<CedarPolicies>> {
        self.cedar.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Installs a validated policy set.
    pub fn set_cedar(&self, policies: CedarPolicies) {
        *self.cedar.write().unwrap_or_else(|p| p.into_inner()) = Some(Arc::new(policies));
    }

    /// Reloads the policy directory whenever its files change. A set that does not validate
    /// is refused (each problem logged with file and line) and the live set stays.
    pub async fn watch_policies(self, dir: std::path::PathBuf, every: std::time::Duration) {
        let mut refused = String::new();
        loop {
            tokio::time::sleep(every).await;
            let Ok(digest) = crate::cedar::dir_digest(&dir) else { continue };
            let live = self.cedar().map(|c| c.digest.clone()).unwrap_or_default();
            if digest == live || digest == refused {
                continue;
            }
            let d = dir.clone();
            match tokio::task::spawn_blocking(move || crate::cedar::load_dir(&d)).await {
                Ok(Ok(policies)) => {
                    tracing::info!(policies = policies.count, dir = %dir.display(), "cedar policies reloaded");
                    self.set_cedar(policies);
                    refused.clear();
                }
                Ok(Err(errors)) => {
                    for e in &errors {
                        tracing::warn!(file = %e.file, line = e.line, reason = %e.reason, "policy change refused; the previous set stays live");
                    }
                    refused = digest;
                }
                Err(e) => tracing::warn!(error = %e, "policy reload failed"),
            }
        }
    }

    /// An explicit Cedar `forbid` for this call. A capability grants what the base rules do
    /// not permit, but never what a policy forbids (Cedar's own rule: forbid wins).
    fn cedar_forbids(&self, r: &pb::AuthorizeRequest, args: &Value) -> Option<rules::RuleDecision> {
        let d = self.cedar()?.decide(&r.tenant, &r.agent, &r.tool, args);
        (d.verdict == Verdict::Deny && d.rule_id.starts_with("cedar:")).then_some(d)
    }

    /// The decision stages in Artana's order: the base rule (Cedar or allowlist, capabilities,
    /// commitments), intent plan, semantic idempotency, limits and rate, approval gates,
    /// invariants.
    async fn stages(&self, r: &pb::AuthorizeRequest, checked: &mut Checked) -> Result<rules::RuleDecision, Status> {
        if let Some(refused) = self.outside_plan(r).await? {
            return Ok(refused);
        }
        if !r.retry_of.is_empty() {
            return self.retry(r, checked).await;
        }
        let rule = self.evaluate(r, checked).await?;
        let rule = crate::intent::check(self, r, rule).await?;
        let (rule, claim) = crate::semantic::check(self, r, &checked.args, &decision_id(r, checked), rule).await?;
        checked.semantic_claim = claim;
        let rule = crate::budgets::limits(self, r, rule).await?;
        let rule = crate::approvals::gate(self, r, checked, rule).await?;
        // The decision's id names its gate (an approval, a critic's verdict): the claim moves to
        // the id that will be recorded, or the key's holder could never be found on record.
        let id = checked.semantic_claim.is_some().then(|| decision_id(r, checked));
        if let (Some((key, claim)), Some(id)) = (&mut checked.semantic_claim, id)
            && claim.decision_id != id
        {
            let moved = crate::store::SemanticClaim { decision_id: id, ..claim.clone() };
            if !self.store().claim_semantic(&r.tenant, key, &moved, Some(claim)).await? {
                return Err(Status::aborted(format!("the semantic key '{key}' changed hands meanwhile; ask again")));
            }
            *claim = moved;
        }
        Ok(crate::invariants::check(&self.config.invariants, &r.tool, &checked.args, rule).await)
    }

    /// An authorization is issued only for a step of the run's recorded plan, calling the
    /// tool that step names: a caller cannot have policy sign a call the run never planned.
    async fn outside_plan(&self, r: &pb::AuthorizeRequest) -> Result<Option<rules::RuleDecision>, Status> {
        if LEDGER_MEDIATED_TOOLS.contains(&r.tool.as_str()) {
            return Ok(None);
        }
        // A model call is planning's, before (or between) plans: it is decided under the
        // planner's own step id, which no plan step may take, and never as a plan step.
        let planner_step =
            warden_core::plan::is_planner_step(&r.step_id) || warden_core::plan::is_critic_step(&r.step_id);
        if r.tool == events::MODEL_CALL_TOOL || planner_step {
            return Ok((r.tool != events::MODEL_CALL_TOOL || !planner_step).then(|| rules::RuleDecision {
                verdict: Verdict::Deny,
                rule_id: "step_not_in_plan".into(),
                reason: format!("'{}' is decided only as a planner step, and a planner step only for it", r.tool),
            }));
        }
        let cached = self.plans.lock().unwrap_or_else(|p| p.into_inner()).get(&r.run_id).cloned();
        let steps = match (cached, unrecorded_plan(r)) {
            // Not recorded yet: decided against the plan sent, and nothing of it is kept (the
            // run's later calls come with the ledger's acknowledgement, or read the plan).
            (_, Some(plan_json)) => planned_steps(plan_json),
            (Some(steps), None) if steps.contains_key(&r.step_id) => steps,
            (cached, None) => {
                // The plan as the ledger acknowledged it, else as the ledger answers for it.
                let plan_json = match self.acknowledged_plan(r, cached.is_some()).await {
                    Some(plan) => plan,
                    None => {
                        self.ledger
                            .clone()
                            .get_run(pb::GetLedgerRunRequest {
                                tenant: r.tenant.clone(),
                                run_id: r.run_id.clone(),
                                with_events: false,
                            })
                            .await?
                            .into_inner()
                            .plan_json
                    }
                };
                let steps = planned_steps(&plan_json);
                let mut plans = self.plans.lock().unwrap_or_else(|p| p.into_inner());
                // Bounded by steps, not runs: plans differ in size.
                if plans.values().map(|p| p.len() + 1).sum::<usize>() + steps.len() > CACHED_PLAN_STEPS {
                    plans.clear();
                }
                plans.insert(r.run_id.clone(), steps.clone());
                steps
            }
        };
        let refuse = |reason: String| {
            Some(rules::RuleDecision { verdict: Verdict::Deny, rule_id: "step_not_in_plan".into(), reason })
        };
        Ok(match steps.get(&r.step_id) {
            None => refuse(format!("step '{}' is not a step of the run's recorded plan", r.step_id)),
            Some(tools) if !tools.contains(&r.tool) => refuse(format!(
                "step '{}' of the recorded plan calls {}, not '{}'",
                r.step_id,
                tools.iter().map(|t| format!("'{t}'")).collect::<Vec<_>>().join(" or "),
                r.tool
            )),
            Some(_) => None,
        })
    }

    /// Why a call cannot be decided before its run is recorded, if it cannot: its decision
    /// would read the run's record (budgets, an intent plan, a semantic key's holder, an
    /// earlier attempt) or write to it first (an approval is asked for by a recorded decision).
    fn needs_record(&self, r: &pb::AuthorizeRequest) -> Option<&'static str> {
        let c = &self.config;
        if !r.caller_records || LEDGER_MEDIATED_TOOLS.contains(&r.tool.as_str()) {
            Some("its decision is recorded before the answer")
        } else if r.attempt != 1 || !r.retry_of.is_empty() {
            Some("only a first attempt is asked before")
        } else if c.tenants.get(&r.tenant).is_some_and(crate::budgets::has_limits) {
            Some("the tenant has budgets, counted per run")
        } else if c
            .tenants
            .get(&r.tenant)
            .is_some_and(|t| t.require_approval.iter().any(|p| crate::rules::matches(p, &r.tool)))
        {
            Some("the tool needs an approval, asked for in the run")
        } else if c.intent_required_tools.iter().any(|p| crate::rules::matches(p, &r.tool)) {
            Some("the tool needs the run's intent plan")
        } else if c.semantic_keys.iter().any(|k| crate::rules::matches(&k.tool, &r.tool)) {
            Some("the tool has a semantic key, whose holder is read from its run")
        } else {
            None
        }
    }

    /// The request's plan when the ledger's run acknowledgement vouches for it: signed by a
    /// published ledger key, for this tenant and run, with the digest of the plan's canonical
    /// JSON. Anything else (no acknowledgement, a forged or foreign one, a plan that is not
    /// the one acknowledged) is ignored: the plan is then read from the ledger. Not taken when
    /// the run's plan was seen already and lacks the step (a revised plan is read).
    async fn acknowledged_plan(&self, r: &pb::AuthorizeRequest, seen: bool) -> Option<String> {
        let ack = r.run_ack.as_ref().filter(|a| !a.key_id.is_empty() && !r.plan_json.is_empty() && !seen)?;
        let signed = warden_grpc::convert::claims_from_wire(Some(ack));
        // An unknown key is asked of the ledger once (shared among concurrent requests).
        let _ = self.ledger_keys.learn(&signed.key_id, || warden_grpc::keyfile::ledger_keys(&self.ledger)).await;
        let claims = warden_core::ack::verify_run_ack(&signed, |id| self.ledger_keys.get(id), &r.tenant, &r.run_id)
            .map_err(|e| tracing::debug!(run_id = %r.run_id, error = %e, "run acknowledgement not taken"))
            .ok()?;
        // The executor sends the plan as the ledger recorded it (canonical JSON): then its
        // bytes have the digest, and it need not be parsed and written out canonically again
        // to see that.
        if warden_core::canonical::sha256_hex(r.plan_json.as_bytes()) == claims.plan_sha256 {
            return Some(r.plan_json.clone());
        }
        let plan: Value = serde_json::from_str(&r.plan_json).ok()?;
        let canonical = warden_core::canonical::canonical_value(&plan);
        (warden_core::canonical::sha256_hex(canonical.as_bytes()) == claims.plan_sha256).then_some(canonical)
    }

    /// Counts an allow against the budgets and records the decision — before the answer, or
    /// off the hot path when the executor carries it into its own append. Returns the ledger
    /// seq of a decision recorded now (0 otherwise).
    async fn count_and_record(
        &self,
        r: &pb::AuthorizeRequest,
        checked: &mut Checked,
        rule: &rules::RuleDecision,
        id: &str,
        record: pb::AppendEventRequest,
        caller_records: bool,
    ) -> Result<u64, Status> {
        // Decisions are whole: an allow is counted against the budgets (once per decision: a
        // retried Authorize of the same call counts nothing) before it is recorded or answered.
        // A retry of an earlier attempt is the same call: never counted again.
        if rule.verdict == Verdict::Allow && rule.rule_id != "retry" {
            crate::budgets::count(self, r, id).await?;
        }
        if rule.verdict != Verdict::ApprovalRequired && caller_records {
            // The executor records the decision with the call's request (nothing can act on an
            // allow before that); the policy records it too, off the hot path.
            self.recorder.record_later(record).await.map_err(|s| {
                Status::unavailable(format!(
                    "decision could not be queued or recorded (failing closed): {}",
                    s.message()
                ))
            })?;
            return Ok(0);
        }
        let appended = self.ledger.clone().append_event(record).await.map_err(|s| match s.code() {
            // Fencing and tenancy refusals pass through unchanged (with their details).
            Code::NotFound | Code::FailedPrecondition => s,
            // The decision id is taken by different content: rules changed since, or a forged
            // record. Never sign on top of it.
            Code::InvalidArgument => Status::failed_precondition(format!(
                "a different decision is already recorded for this call; not signing: {}",
                s.message()
            )),
            _ => Status::unavailable(format!(
                "decision could not be recorded in the ledger (failing closed): {}",
                s.message()
            )),
        })?;
        if let Some(wanted) = checked.new_approval.take() {
            let a = self.store.ensure_approval(&wanted).await?;
            if a.created_at_ms == wanted.created_at_ms {
                self.approvals_changed();
            }
        }
        Ok(appended.into_inner().event.map(|e| e.seq).unwrap_or_default())
    }

    /// The recorded events of the request's run, first to last.
    async fn run_events(&self, r: &pb::AuthorizeRequest) -> Result<tonic::Streaming<pb::Event>, Status> {
        let req =
            pb::StreamEventsRequest { tenant: r.tenant.clone(), run_id: r.run_id.clone(), since_seq: 0, follow: false };
        Ok(self.ledger.clone().stream_events(req).await?.into_inner())
    }

    /// Limits for callers that are not the mesh (a tenant's own orchestrator, an agent): they
    /// hold no lease, so they name no epoch (they could fence out the executor driving the
    /// run); retries are the executor's; and an agent decides only on its own agent's runs.
    async fn outside_caller(&self, r: &pb::AuthorizeRequest, agent_bound: bool) -> Result<(), Status> {
        if r.epoch != 0 {
            return Err(Status::permission_denied("only the mesh's lease holders name an epoch"));
        }
        if !r.retry_of.is_empty() {
            return Err(Status::permission_denied("retries are authorized for the executor only"));
        }
        if agent_bound && self.run_agent(&r.tenant, &r.run_id).await? != r.agent {
            return Err(Status::permission_denied(format!("agent '{}' decides only on its own runs", r.agent)));
        }
        Ok(())
    }

    /// The agent a run acts for (fixed at submission in `run_submitted`; empty: the tenant).
    pub(crate) async fn run_agent(&self, tenant: &str, run_id: &str) -> Result<String, Status> {
        check_id(run_id).map_err(|e| invalid_field("run_id", e.to_string()))?;
        let req = pb::StreamEventsRequest {
            tenant: tenant.to_string(),
            run_id: run_id.to_string(),
            since_seq: 0,
            follow: false,
        };
        let first = self.ledger.clone().stream_events(req).await?.into_inner().message().await?;
        let owner: Value = first.map(|e| serde_json::from_str(&e.payload_json).unwrap_or_default()).unwrap_or_default();
        Ok(owner["agent"].as_str().unwrap_or_default().to_string())
    }

    /// Seed 000: policy and approval skip on retry. A retry is not decided again; it is allowed
    /// when the allow its earlier attempt got is recorded for the same step, tool and
    /// arguments. The new decision is still recorded and signed for this attempt, so each
    /// attempt cites an allow for its own exact call (K01, K03).
    async fn retry(&self, r: &pb::AuthorizeRequest, c: &mut Checked) -> Result<rules::RuleDecision, Status> {
        c.gate = format!("|retry:{}", r.retry_of);
        let deny = |reason: String| rules::RuleDecision {
            verdict: Verdict::Deny,
            rule_id: "retry_unauthorized".into(),
            reason,
        };
        // The first allow, and the executor's record that the attempt before this one failed
        // retryably and is retried as this one (only the mesh's own services write those).
        let mut first: Option<Value> = None;
        let mut retried = false;
        let mut stream = self.run_events(r).await?;
        while let Some(e) = stream.message().await? {
            if e.step_id != r.step_id {
                continue;
            }
            let p: Value = serde_json::from_str(&e.payload_json).unwrap_or_default();
            if e.event_type == events::POLICY_DECISION && p["decision_id"].as_str() == Some(r.retry_of.as_str()) {
                first = Some(p);
            } else if e.event_type == events::TOOL_FAILED
                && p["attempt"].as_u64() == Some(u64::from(r.attempt) - 1)
                && p["retry"]["next_attempt"].as_u64() == Some(u64::from(r.attempt))
                && p["retry"]["retry_of"].as_str() == Some(r.retry_of.as_str())
            {
                retried = true;
            }
        }
        let Some(p) = first else {
            return Ok(deny(format!("decision {} is not recorded for step '{}'", r.retry_of, r.step_id)));
        };
        let text = |k: &str| p[k].as_str().unwrap_or_default().to_string();
        let why = if text("outcome") != "allow" {
            Some("was not an allow")
        } else if text("tool") != r.tool {
            Some("allowed another tool")
        } else if text("args_sha256") != c.args_sha256 {
            Some("allowed other arguments")
        } else if p["attempt"].as_u64().unwrap_or(u64::MAX) >= u64::from(r.attempt) {
            Some("is not for an earlier attempt")
        } else if p["agent"].as_str().unwrap_or_default() != r.agent {
            Some("was for another agent")
        } else if !retried {
            Some("was not followed by a retryable failure of attempt {} that the executor retries")
        } else {
            None
        };
        if let Some(why) = why {
            let why = why.replace("{}", &(r.attempt - 1).to_string());
            return Ok(deny(format!("decision {} {why}", r.retry_of)));
        }
        c.capability_id = text("capability_id");
        Ok(rules::RuleDecision {
            verdict: Verdict::Allow,
            rule_id: "retry".into(),
            reason: format!(
                "attempt {} retries the call decision {} allowed (policy and approval skip on retry)",
                r.attempt, r.retry_of
            ),
        })
    }

    /// Records a deny for a request that names a valid call but carries malformed arguments
    /// (the caller still gets INVALID_ARGUMENT). Identity errors are not recordable: no run.
    async fn record_malformed(&self, r: &pb::AuthorizeRequest, status: &Status) {
        let ids_ok = check_id(&r.tenant).is_ok()
            && check_id(&r.run_id).is_ok()
            && check_step_id(&r.step_id).is_ok()
            && check_tool_name(&r.tool).is_ok()
            && check_id(&r.idempotency_key).is_ok()
            && r.attempt > 0;
        if !ids_ok {
            return;
        }
        let digest = warden_core::sha256_hex(r.args_json.as_bytes());
        let call = CallIdentity {
            tenant: &r.tenant,
            run_id: &r.run_id,
            step_id: &r.step_id,
            attempt: r.attempt,
            tool: &r.tool,
            args_sha256: &digest,
            idempotency_key: &r.idempotency_key,
        };
        let id = warden_core::auth::decision_id(&call, "|malformed");
        let payload = json!({
            "decision_id": id, "tenant": r.tenant, "run_id": r.run_id, "step_id": r.step_id,
            "attempt": r.attempt, "tool": r.tool, "args_sha256": digest,
            "fingerprint": format!("{}@{}", r.tool, &digest[..16]), "capability_id": "",
            "idempotency_key": r.idempotency_key, "outcome": "deny", "rule_id": "malformed_request",
            "reason": status.message(),
        });
        // Through `RecordDecisions`: a request about a run being created may find none yet.
        let record = decision_record(r, &id, warden_core::decision::sign_decision(payload, &self.key).to_string());
        let recorded = crate::recorder::record_now(&mut self.ledger.clone(), record).await;
        if let Err(e) = recorded {
            tracing::warn!(run_id = %r.run_id, error = %e, "malformed request not recorded");
        }
    }

    pub fn store(&self) -> &PolicyStore {
        &self.store
    }

    /// Tells approval watchers that something changed.
    pub(crate) fn approvals_changed(&self) {
        self.approval_changes.send_modify(|v| *v = v.wrapping_add(1));
    }

    /// Wakes when an approval changes on this replica.
    pub(crate) fn approval_changes(&self) -> tokio::sync::watch::Receiver<u64> {
        self.approval_changes.subscribe()
    }

    pub fn rate(&self) -> &crate::rate::RateLimiter {
        &self.rate
    }

    pub fn config(&self) -> &PolicyConfig {
        &self.config
    }

    pub fn ledger(&self) -> LedgerClient<warden_grpc::auth::Ch> {
        self.ledger.clone()
    }

    pub fn planner(&self) -> warden_proto::v1::planner_client::PlannerClient<warden_grpc::auth::Ch> {
        self.planner.clone()
    }

    pub fn max_capability_ttl_secs(&self) -> u64 {
        self.config.max_capability_ttl_secs
    }

    /// The rule decision for a request. A presented capability handle is the authority when
    /// it is valid for this call (and a recorded deny when it is not); without one, the
    /// tenant's allowlist decides. Capability refusals are enforced in every mode.
    async fn evaluate(&self, r: &pb::AuthorizeRequest, c: &mut Checked) -> Result<rules::RuleDecision, Status> {
        if r.capability_handle.is_empty() {
            let ruled = match self.cedar() {
                Some(cedar) => rules::apply_mode(self.config.mode, cedar.decide(&r.tenant, &r.agent, &r.tool, &c.args)),
                None => rules::decide(&self.config, &r.tenant, &r.tool),
            };
            // Consequential by the operator's list or by the declaration the run pinned: a
            // declaration can add the need for a commitment, never lift the operator's.
            let consequential = self.config.consequential_tools.iter().any(|p| crate::rules::matches(p, &r.tool))
                || r.tool_effect == pb::Effect::Consequential as i32;
            // The hot path: the rules allow a safe tool; no capability lookup needed.
            if ruled.verdict == Verdict::Allow && !consequential {
                return Ok(ruled);
            }
            // A capability issued for this run is the run's explicit commitment: it grants
            // what the rules do not, and it is what a consequential tool needs.
            let bound = self.store.bound_to_run(&r.tenant, &r.run_id, now_ms()).await?;
            if let Some(cap) = bound.into_iter().find(|cap| crate::caps::grants(cap, &r.tool, &c.args).is_ok()) {
                if let Some(forbidden) = self.cedar_forbids(r, &c.args) {
                    return Ok(forbidden);
                }
                c.capability_id = cap.capability_id.clone();
                return Ok(rules::RuleDecision {
                    verdict: Verdict::Allow,
                    rule_id: "capability".into(),
                    reason: format!("capability {} (bound to this run) grants '{}'", cap.capability_id, r.tool),
                });
            }
            // Maple: a consequential tool needs an explicit commitment.
            if consequential {
                return Ok(rules::RuleDecision {
                    verdict: Verdict::Deny,
                    rule_id: "missing_commitment".into(),
                    reason: format!(
                        "'{}' is consequential: it needs an explicit commitment (a capability handle)",
                        r.tool
                    ),
                });
            }
            return Ok(ruled);
        }
        let deny =
            |rule: &str, reason: String| rules::RuleDecision { verdict: Verdict::Deny, rule_id: rule.into(), reason };
        let Some(sha) = crate::caps::handle_sha256(&r.capability_handle) else {
            return Ok(deny("capability_invalid", "the capability handle is not one Warden issued".into()));
        };
        let Some(cap) = self.store.by_handle(&sha).await? else {
            return Ok(deny("capability_invalid", "the capability handle is not one Warden issued".into()));
        };
        c.capability_id = cap.capability_id.clone();
        if cap.tenant != r.tenant {
            return Ok(deny(
                "capability_tenant",
                format!("capability {} belongs to another tenant", cap.capability_id),
            ));
        }
        if cap.revoked {
            return Ok(deny(
                "capability_revoked",
                format!("capability {} was revoked: {}", cap.capability_id, cap.revoke_reason),
            ));
        }
        if now_ms() >= cap.expires_at_ms {
            return Ok(deny(
                "capability_expired",
                format!("capability {} expired at {}", cap.capability_id, cap.expires_at_ms),
            ));
        }
        // A capability bound to a run is that run's commitment, nobody else's.
        if !cap.run_id.is_empty() && cap.run_id != r.run_id {
            return Ok(deny(
                "capability_run",
                format!("capability {} is bound to run {}, not this one", cap.capability_id, cap.run_id),
            ));
        }
        if let Err(why) = crate::caps::grants(&cap, &r.tool, &c.args) {
            return Ok(deny(
                "capability_scope",
                format!("capability {} does not cover this call: {why}", cap.capability_id),
            ));
        }
        if let Some(forbidden) = self.cedar_forbids(r, &c.args) {
            return Ok(forbidden);
        }
        Ok(rules::RuleDecision {
            verdict: Verdict::Allow,
            rule_id: "capability".into(),
            reason: format!("capability {} grants '{}'", cap.capability_id, r.tool),
        })
    }

    fn decision(
        &self,
        r: &pb::AuthorizeRequest,
        c: &Checked,
        ledger_seq: u64,
        d: &rules::RuleDecision,
    ) -> pb::Decision {
        pb::Decision {
            decision_id: decision_id(r, c),
            outcome: match d.verdict {
                Verdict::Allow => pb::Outcome::Allow,
                Verdict::Deny => pb::Outcome::Deny,
                Verdict::ApprovalRequired => pb::Outcome::ApprovalRequired,
            } as i32,
            rule_id: d.rule_id.clone(),
            reason: d.reason.clone(),
            args_sha256: c.args_sha256.clone(),
            ledger_seq,
        }
    }
}

#[tonic::async_trait]
impl pb::policy_server::Policy for PolicyService {
    #[tracing::instrument(name = "authorize", skip_all, fields(
        tool = %req.get_ref().tool, rule_id = tracing::field::Empty, outcome = tracing::field::Empty,
    ))]
    async fn authorize(&self, req: Request<pb::AuthorizeRequest>) -> Result<Response<pb::AuthorizeResponse>, Status> {
        warden_grpc::auth::check(&req, &req.get_ref().tenant)?;
        let agent = warden_grpc::auth::agent(&req, &req.get_ref().agent)?;
        let (mesh, bound) = (warden_grpc::auth::is_mesh(&req), warden_grpc::auth::bound_agent(&req));
        let mut r = pb::AuthorizeRequest { agent, ..req.into_inner() };
        if !mesh {
            // A plan under the ledger's acknowledgement is the submitting executor's shortcut;
            // from anyone else it is ignored (no key is fetched for it, the plan is read).
            (r.run_ack, r.plan_json, r.plan_sha256) = (None, String::new(), String::new());
            self.outside_caller(&r, bound.is_some()).await?;
            // Model calls are the planner's: a tenant asking for one could have policy sign a
            // call no run's planning made.
            if r.tool == events::MODEL_CALL_TOOL {
                return Err(Status::permission_denied("model calls are authorized for the mesh's planner only"));
            }
        }
        let mut checked = match validate(&r) {
            Ok(c) => c,
            Err(status) => {
                self.record_malformed(&r, &status).await;
                return Err(status);
            }
        };
        if let Some(digest) = unrecorded_plan(&r).map(|_| r.plan_sha256.clone()) {
            if let Some(why) = self.needs_record(&r) {
                // Nothing decided, counted or claimed: the executor asks again once the run exists.
                return Err(Status::failed_precondition(format!(
                    "this call is decided only once its run is recorded: {why}"
                )));
            }
            // A decision of its own: the same call asked again once the run is recorded (after
            // a takeover, say) is decided against the recorded plan, and its record — without
            // the digest — must not meet this one under the same id.
            checked.gate = format!("|plan:{}", &digest[..16]);
        }
        // A stage that cannot reach its store (or the ledger) has decided nothing: the caller
        // gets UNAVAILABLE, nothing is recorded, and it asks again — a blip is not a decision.
        // So is a call whose connection broke off under it (the ledger killed mid-answer:
        // tonic makes that UNKNOWN). A stage that fails otherwise is a deny with its own rule
        // id, recorded like any other decision — never an allow.
        let rule = match self.stages(&r, &mut checked).await {
            Ok(rule) => rule,
            Err(e)
                if matches!(e.code(), Code::Unavailable | Code::DeadlineExceeded | Code::Aborted | Code::Cancelled)
                    || warden_grpc::broke_off(&e) =>
            {
                tracing::warn!(run_id = %r.run_id, step_id = %r.step_id, error = %e, "policy stage unavailable; not deciding");
                if let Some((key, claim)) = checked.semantic_claim.take() {
                    let _ = self.store.release_semantic(&r.tenant, &key, &claim).await;
                }
                return Err(Status::unavailable(format!("policy cannot decide now: {}", e.message())));
            }
            Err(e) => {
                tracing::warn!(run_id = %r.run_id, step_id = %r.step_id, error = %e, "policy stage failed; denying");
                checked.gate = "|policy_error".into();
                rules::RuleDecision {
                    verdict: Verdict::Deny,
                    rule_id: "policy_error".into(),
                    reason: format!("policy evaluation failed ({:?}): {}", e.code(), e.message()),
                }
            }
        };
        let id = decision_id(&r, &checked);
        let mut payload = json!({
            "decision_id": id,
            // Bound into what is signed: the record is this call's only, in this run.
            "tenant": r.tenant,
            "run_id": r.run_id,
            "step_id": r.step_id,
            "attempt": r.attempt,
            "tool": r.tool,
            "fingerprint": format!("{}@{}", r.tool, &checked.args_sha256[..16]),
            "args_sha256": checked.args_sha256,
            "capability_id": checked.capability_id,
            "idempotency_key": r.idempotency_key,
            "outcome": rule.verdict.as_str(),
            "rule_id": rule.rule_id,
            "reason": rule.reason,
        });
        if !r.agent.is_empty() {
            payload["agent"] = Value::String(r.agent.clone());
        }
        if unrecorded_plan(&r).is_some() {
            // Decided against a plan the ledger had not recorded yet: the ledger takes this
            // record only into a run whose recorded plan has this digest.
            payload["plan_sha256"] = Value::String(r.plan_sha256.clone());
        }
        // Signed, so the record can travel with the executor's append and the ledger can tell
        // it is the policy's own (see `warden_core::decision`).
        let payload = warden_core::decision::sign_decision(payload, &self.key);
        let decision_event_json = payload.to_string();
        let record = decision_record(&r, &id, decision_event_json.clone());
        // Recorded before the answer unless the mesh's executor carries it into its own append
        // (and never for approvals: one comes into being only once the decision asking for it
        // is recorded; nor for ledger-mediated tools, whose effect the ledger applies on sight
        // of a recorded allow).
        let caller_records = r.caller_records && mesh && !LEDGER_MEDIATED_TOOLS.contains(&r.tool.as_str());
        // Decisions are whole: an allow is counted against the budgets (once per decision: a
        // retried Authorize of the same call counts nothing) before it is recorded or answered.
        // A retry of an earlier attempt is the same call: never counted again.
        let recorded = self.count_and_record(&r, &mut checked, &rule, &id, record, caller_records).await;
        // A semantic key this request claimed stays claimed only by a recorded (or handed
        // over) allow; refused or decided otherwise, it is given back.
        if let Some((key, claim)) = checked.semantic_claim.take()
            && (recorded.is_err() || rule.verdict != Verdict::Allow)
        {
            self.store.release_semantic(&r.tenant, &key, &claim).await?;
        }
        let ledger_seq = recorded?;
        let decision = self.decision(&r, &checked, ledger_seq, &rule);
        // Every decision is in the ledger with its rule and reason; the log names the ones an
        // operator looks for (denials, approvals asked for) at INFO and allows, one per call,
        // at DEBUG: formatting and writing a line per call was a twentieth of the service's CPU
        // in a chain of calls.
        if rule.verdict == Verdict::Allow {
            tracing::debug!(run_id = %r.run_id, step_id = %r.step_id, tool = %r.tool, outcome = rule.verdict.as_str(), rule_id = %rule.rule_id, "policy decision");
        } else {
            tracing::info!(run_id = %r.run_id, step_id = %r.step_id, tool = %r.tool, outcome = rule.verdict.as_str(), rule_id = %rule.rule_id, "policy decision");
        }
        warden_telemetry::metrics::policy_decision(rule.verdict.as_str(), &rule.rule_id);
        let span = tracing::Span::current();
        span.record("rule_id", rule.rule_id.as_str());
        span.record("outcome", rule.verdict.as_str());
        let authorization = (rule.verdict == Verdict::Allow).then(|| {
            let now = now_ms();
            let signed = sign(
                AuthorizationClaims {
                    v: 1,
                    key_id: String::new(),
                    decision_id: decision.decision_id.clone(),
                    tenant: r.tenant.clone(),
                    run_id: r.run_id.clone(),
                    step_id: r.step_id.clone(),
                    attempt: r.attempt,
                    tool: r.tool.clone(),
                    args_sha256: checked.args_sha256.clone(),
                    idempotency_key: r.idempotency_key.clone(),
                    capability_id: checked.capability_id.clone(),
                    issued_at_ms: now,
                    expires_at_ms: now + self.config.authorization_ttl_ms as i64,
                    tool_version: r.tool_version.clone(),
                    tool_sha256: r.tool_sha256.clone(),
                    effect: match pb::Effect::try_from(r.tool_effect).unwrap_or(pb::Effect::Unspecified) {
                        pb::Effect::Unspecified => String::new(),
                        e => e.as_str_name().trim_start_matches("EFFECT_").to_ascii_lowercase(),
                    },
                },
                &self.key,
            );
            warden_grpc::convert::claims_to_wire(signed)
        });
        Ok(Response::new(pb::AuthorizeResponse { decision: Some(decision), authorization, decision_event_json }))
    }

    async fn get_verification_keys(
        &self,
        _: Request<pb::GetVerificationKeysRequest>,
    ) -> Result<Response<pb::GetVerificationKeysResponse>, Status> {
        let keys = self
            .published
            .iter()
            .map(|k| pb::VerificationKey {
                key_id: k.key_id.clone(),
                public_key: k.key.as_bytes().to_vec(),
                current: k.current,
            })
            .collect();
        Ok(Response::new(pb::GetVerificationKeysResponse { keys }))
    }

    async fn record_cost(
        &self,
        req: Request<pb::RecordCostRequest>,
    ) -> Result<Response<pb::RecordCostResponse>, Status> {
        warden_grpc::auth::check(&req, &req.get_ref().tenant)?;
        // Cost is the mesh's own record of what its calls spent: a tenant recording it could
        // exhaust another run's budget or pre-record 0 for its own steps to evade its budget.
        warden_grpc::auth::require_mesh(&req, "RecordCost")?;
        crate::budgets::record_cost(self, req.into_inner()).await?;
        Ok(Response::new(pb::RecordCostResponse {}))
    }

    async fn check(&self, req: Request<pb::AuthorizeRequest>) -> Result<Response<pb::Decision>, Status> {
        warden_grpc::auth::check(&req, &req.get_ref().tenant)?;
        let agent = warden_grpc::auth::agent(&req, &req.get_ref().agent)?;
        let r = pb::AuthorizeRequest { agent, ..req.into_inner() };
        let mut checked = validate(&r)?;
        let rule = self.evaluate(&r, &mut checked).await?;
        let rule = if r.base_rules_only {
            rule
        } else {
            crate::invariants::check(&self.config.invariants, &r.tool, &checked.args, rule).await
        };
        Ok(Response::new(self.decision(&r, &checked, 0, &rule)))
    }
}
