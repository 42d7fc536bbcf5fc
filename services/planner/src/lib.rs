//! The Warden planner: turns goals into plans through a model (see [`planning`]) and checks
//! explicit plans against the tool catalog (the union of every configured tool host's
//! `ListTools`).
//!
//! Validation refuses, naming the step and field: unknown fields, bad or duplicate ids,
//! unknown tools, missing dependencies, cycles, malformed or non-dependency template
//! references, and more than `max_steps` steps (an error to fix, never a truncation).

pub mod critic;
pub mod goal;
pub mod model;
pub mod planning;
pub mod prompt;
pub mod schema;

use std::collections::HashMap;
use std::sync::Arc;

use tonic::service::interceptor::InterceptedService;
use tonic::service::{Routes, RoutesBuilder};
use tonic::{Request, Response, Status};
use warden_config::PlannerConfig;
use warden_core::ids::check_id;
use warden_core::plan::{Plan, PlanLimits};
use warden_grpc::auth::Tokens;
use warden_grpc::catalog::ToolCatalog;
use warden_grpc::invalid_field;
use warden_proto::v1 as pb;
use warden_proto::v1::ledger_client::LedgerClient;
use warden_proto::v1::planner_server::{Planner, PlannerServer};
use warden_proto::v1::policy_client::PolicyClient;

use crate::model::ModelClient;
use crate::schema::{AllowedTool, Offer};

/// What a goal run answers when no model is configured for its tenant.
pub const NO_MODEL: &str = "no model is configured for planning: set [planner.model] provider = \"openai\" \
     (any OpenAI-compatible server: OpenAI, llama.cpp's llama-server, vLLM, Ollama) or \"anthropic\", with \
     base_url and model (see the README, \"Goal runs\"); or submit an explicit plan_json";

/// Largest plan document accepted.
pub const MAX_PLAN_BYTES: usize = 1 << 20;

#[derive(Clone)]
pub struct PlannerService {
    max_steps: usize,
    catalog: ToolCatalog,
    redactor: goal::Redactor,
    ledger: LedgerClient<warden_grpc::auth::Ch>,
    policy: PolicyClient<warden_grpc::auth::Ch>,
    /// The default model (key "") and tenants' own.
    models: Arc<HashMap<String, ModelClient>>,
    prices: Arc<std::collections::BTreeMap<String, warden_config::ModelPrice>>,
    known_tenants: Arc<std::collections::BTreeSet<String>>,
    /// Tools' compiled input schemas, for the literal params of submitted plans.
    input_schemas: Arc<warden_grpc::tool_schema::ToolSchemas>,
}

impl PlannerService {
    pub fn new(config: &PlannerConfig) -> anyhow::Result<PlannerService> {
        let mut models = HashMap::new();
        if config.model.is_configured() {
            models.insert(String::new(), ModelClient::new(&config.model)?);
        }
        for (tenant, t) in &config.tenants {
            if t.model.is_configured() {
                models.insert(tenant.clone(), ModelClient::new(&t.model)?);
            }
        }
        let max = warden_grpc::MAX_MESSAGE_BYTES;
        Ok(PlannerService {
            max_steps: config.max_steps,
            catalog: ToolCatalog::new(&config.tool_hosts)?,
            redactor: goal::Redactor::new(config)?,
            ledger: LedgerClient::new(warden_grpc::channel(&config.ledger_endpoint)?).max_decoding_message_size(max),
            policy: PolicyClient::new(warden_grpc::channel(&config.policy_endpoint)?),
            models: Arc::new(models),
            prices: Arc::new(config.prices.clone()),
            known_tenants: Arc::new(config.tenants.keys().cloned().collect()),
            input_schemas: Arc::default(),
        })
    }

    fn model_for(&self, tenant: &str) -> Option<&ModelClient> {
        self.models.get(tenant).or_else(|| self.models.get(""))
    }

    /// The tools this run may call: the catalog, less what the policy's base rules refuse the
    /// run's principal (Cedar or allowlist, capabilities, commitments). Arguments are not
    /// known yet; their invariants are checked when each call is authorized.
    async fn offer(&self, tenant: &str, agent: &str, run_id: &str) -> Result<Offer, Status> {
        let catalog = self.catalog.tools().await?;
        let mut names: Vec<&String> = catalog.keys().collect();
        names.sort();
        let mut allowed = Vec::new();
        for name in names {
            let d = self
                .policy
                .clone()
                .check(pb::AuthorizeRequest {
                    tenant: tenant.to_string(),
                    run_id: run_id.to_string(),
                    step_id: warden_core::plan::planner_step(0),
                    attempt: 1,
                    tool: name.clone(),
                    args_json: "{}".into(),
                    idempotency_key: "catalog".into(),
                    agent: agent.to_string(),
                    base_rules_only: true,
                    ..Default::default()
                })
                .await?
                .into_inner();
            // Without arguments Cedar may be unable to build a tool's context: that is not a
            // refusal of the tool (its arguments are judged when the step is authorized).
            if d.outcome() != pb::Outcome::Deny || d.rule_id == "cedar_context" {
                allowed.push(AllowedTool::from_spec(&catalog[name].spec));
            }
        }
        Ok(Offer::new(allowed))
    }

    /// Parses and validates plan JSON; returns the plan and its canonical JSON.
    pub async fn validate(&self, plan_json: &str) -> Result<(Plan, String), Status> {
        if plan_json.len() > MAX_PLAN_BYTES {
            return Err(invalid_field(
                "plan_json",
                format!("{} bytes is over the maximum of {MAX_PLAN_BYTES}", plan_json.len()),
            ));
        }
        let plan = Plan::parse(plan_json).map_err(|e| invalid_field(e.field(), e.to_string()))?;
        let catalog = self.catalog.tools().await?;
        let known = |t: &str| catalog.contains_key(t);
        plan.validate(&PlanLimits { max_steps: self.max_steps, known_tool: &known })
            .map_err(|e| invalid_field(e.field(), e.to_string()))?;
        // Literal params against the tool's input schema now, so a plan that cannot run is
        // refused before anything of it runs; a step with templates is checked by the
        // executor once its values are known.
        for (i, step) in plan.steps.iter().enumerate() {
            // The step's own call, then its alternatives'.
            for b in 0..=step.alternatives.len() {
                let Some((tool, params)) = step.branch(b) else { continue };
                if params.to_string().contains("{{") {
                    continue;
                }
                let Some(entry) = catalog.get(tool) else { continue };
                if let Err(refused) = self.input_schemas.check(tool, &entry.spec.input_schema_json, params) {
                    let at = if b == 0 { format!("steps[{i}]") } else { format!("steps[{i}].alternatives[{}]", b - 1) };
                    return Err(invalid_field(format!("{at}.{}", refused.field), refused.reason));
                }
            }
        }
        let canonical = warden_core::canonical_json(&plan);
        Ok((plan, canonical))
    }
}

#[tonic::async_trait]
impl Planner for PlannerService {
    async fn validate_plan(
        &self,
        req: Request<pb::ValidatePlanRequest>,
    ) -> Result<Response<pb::ValidatePlanResponse>, Status> {
        warden_grpc::auth::check(&req, &req.get_ref().tenant)?;
        let r = req.into_inner();
        check_id(&r.tenant).map_err(|e| invalid_field("tenant", e.to_string()))?;
        let (plan, plan_json) = self.validate(&r.plan_json).await?;
        Ok(Response::new(pb::ValidatePlanResponse { plan_json, step_count: plan.steps.len() as u32 }))
    }

    async fn create_plan(
        &self,
        req: Request<pb::CreatePlanRequest>,
    ) -> Result<Response<pb::CreatePlanResponse>, Status> {
        warden_grpc::auth::check(&req, &req.get_ref().tenant)?;
        // Planning records into runs and spends money: the executor (the mesh) asks, for a run
        // it holds; everyone else submits goal runs through Runs.SubmitRun.
        warden_grpc::auth::require_mesh(&req, "CreatePlan (submit goal runs through Runs.SubmitRun)")?;
        let r = req.into_inner();
        check_id(&r.tenant).map_err(|e| invalid_field("tenant", e.to_string()))?;
        if !r.agent.is_empty() {
            check_id(&r.agent).map_err(|e| invalid_field("agent", e.to_string()))?;
        }
        let policy = pb::ReplayPolicy::try_from(r.replay_policy)
            .map_err(|_| invalid_field("replay_policy", format!("{} is not a replay policy", r.replay_policy)))?;
        // A submission's goal is bounded and redacted here once; planning takes the goal as the
        // run recorded it (already redacted: doing it again could only lengthen it).
        let checked = if r.check_only {
            Some(self.redactor.check(&r.goal)?)
        } else if r.goal.trim().is_empty() {
            return Err(invalid_field("goal", "must not be empty"));
        } else {
            None
        };
        let Some(model) = self.model_for(&r.tenant) else {
            return Err(Status::failed_precondition(NO_MODEL));
        };
        if let Some(checked) = checked {
            return Ok(Response::new(pb::CreatePlanResponse {
                goal: checked.text,
                redacted: checked.redacted,
                ..Default::default()
            }));
        }
        check_id(&r.run_id).map_err(|e| invalid_field("run_id", e.to_string()))?;
        if r.epoch == 0 || i64::try_from(r.epoch).is_err() {
            return Err(invalid_field("epoch", "the run's lease epoch, from 1 to 2^63-1"));
        }
        let context = if r.round > 0 {
            if r.round > MAX_ROUND {
                return Err(invalid_field("round", format!("from 0 to {MAX_ROUND}")));
            }
            if r.failure_context_json.len() > MAX_CONTEXT_BYTES {
                return Err(invalid_field("failure_context_json", format!("at most {MAX_CONTEXT_BYTES} bytes")));
            }
            let context: warden_core::replan::ReplanContext = serde_json::from_str(&r.failure_context_json)
                .map_err(|e| invalid_field("failure_context_json", format!("not a replanning context: {e}")))?;
            context.check(self.max_steps).map_err(|e| invalid_field("failure_context_json", e))?;
            Some(context)
        } else if !r.failure_context_json.is_empty() {
            return Err(invalid_field("failure_context_json", "only a replanning round (round > 0) takes one"));
        } else {
            None
        };
        let offer = self.offer(&r.tenant, &r.agent, &r.run_id).await?;
        let planning = planning::Planning {
            ledger: &self.ledger,
            policy: &self.policy,
            model,
            prices: &self.prices,
            max_steps: self.max_steps,
            round: r.round,
            context: context.as_ref(),
            known_tenants: &self.known_tenants,
        };
        let ask = planning::Ask {
            tenant: &r.tenant,
            run_id: &r.run_id,
            agent: &r.agent,
            goal: &r.goal,
            epoch: r.epoch,
            policy: match policy {
                pb::ReplayPolicy::Unspecified => pb::ReplayPolicy::Strict,
                p => p,
            },
            replay_only: r.replay_only,
        };
        let out = planning.run(&ask, &offer).await?;
        tracing::info!(run_id = %r.run_id, round = r.round, source = out.source, calls = out.model_calls, replayed = out.replayed_calls, "planned");
        // A replanning round answers the run's whole plan: the kept steps, then the round's.
        let (mut new_steps, mut renamed) = (Vec::new(), std::collections::HashMap::new());
        let plan = match (out.plan, &context) {
            (Some(round_plan), Some(context)) if round_plan.direct_response.is_none() => {
                let taken = context.taken();
                let suffix = format!("_r{}", r.round);
                for s in &round_plan.steps {
                    new_steps.push(s.id.clone());
                    if let Some(proposed) = s.id.strip_suffix(&suffix).filter(|p| taken.contains(*p)) {
                        renamed.insert(proposed.to_string(), s.id.clone());
                    }
                }
                let steps = context.kept.iter().cloned().chain(round_plan.steps).collect();
                Some(warden_core::plan::Plan {
                    steps,
                    reasoning: round_plan.reasoning,
                    direct_response: None,
                    max_depth: None,
                })
            }
            (plan, _) => plan,
        };
        Ok(Response::new(pb::CreatePlanResponse {
            new_steps,
            renamed,
            plan_json: plan.as_ref().map(warden_core::canonical_json).unwrap_or_default(),
            source: out.source.to_string(),
            goal: String::new(),
            model_calls: out.model_calls,
            replayed_calls: out.replayed_calls,
            differences: out.differences,
            fork_hash: out.fork_hash,
            redacted: Vec::new(),
            rule_id: out.rule_id,
            reason: out.reason,
        }))
    }

    async fn critique(&self, req: Request<pb::CritiqueRequest>) -> Result<Response<pb::CritiqueResponse>, Status> {
        warden_grpc::auth::check(&req, &req.get_ref().tenant)?;
        // The policy service asks, while it decides a call; nobody else.
        warden_grpc::auth::require_mesh(&req, "Critique (the policy service asks the critic)")?;
        let r = req.into_inner();
        check_id(&r.tenant).map_err(|e| invalid_field("tenant", e.to_string()))?;
        check_id(&r.run_id).map_err(|e| invalid_field("run_id", e.to_string()))?;
        warden_core::ids::check_step_id(&r.step_id).map_err(|e| invalid_field("step_id", e.to_string()))?;
        warden_core::ids::check_tool_name(&r.tool).map_err(|e| invalid_field("tool", e.to_string()))?;
        if !r.agent.is_empty() {
            check_id(&r.agent).map_err(|e| invalid_field("agent", e.to_string()))?;
        }
        if r.epoch == 0 || i64::try_from(r.epoch).is_err() {
            return Err(invalid_field("epoch", "the run's lease epoch, from 1 to 2^63-1"));
        }
        if r.args_json.len() > MAX_PLAN_BYTES {
            return Err(invalid_field("args_json", format!("at most {MAX_PLAN_BYTES} bytes")));
        }
        let Some(model) = self.model_for(&r.tenant) else {
            return Ok(Response::new(pb::CritiqueResponse {
                verdict: "unavailable".into(),
                reason: "no model is configured for the critic (see [planner.model])".into(),
                ..Default::default()
            }));
        };
        let description = match self.catalog.tools().await {
            Ok(tools) => tools.get(&r.tool).map(|t| t.spec.description.clone()).unwrap_or_default(),
            Err(_) => String::new(),
        };
        let critic = critic::Critic { ledger: &self.ledger, policy: &self.policy, model, prices: &self.prices };
        let answer = critic.critique(&r, &description).await?;
        tracing::info!(run_id = %r.run_id, step_id = %r.step_id, tool = %r.tool, verdict = %answer.verdict, replayed = answer.replayed, "critic");
        Ok(Response::new(answer))
    }

    async fn list_tools(&self, _: Request<pb::ListToolsRequest>) -> Result<Response<pb::ListToolsResponse>, Status> {
        let catalog = self.catalog.tools().await?;
        let mut tools: Vec<pb::ToolSpec> = catalog.values().map(|e| e.spec.clone()).collect();
        tools.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(Response::new(pb::ListToolsResponse { tools }))
    }
}

/// The most replanning rounds a run may ask for (`executor.max_replan_rounds` is smaller).
const MAX_ROUND: u32 = 16;
/// Largest replanning context (its outputs and errors are bounded when built).
const MAX_CONTEXT_BYTES: usize = 256 * 1024;

/// Adds the planner's gRPC service to `routes`.
pub fn add_routes(routes: &mut RoutesBuilder, service: PlannerService, tokens: &Tokens) {
    routes.add_service(InterceptedService::new(PlannerServer::new(service), tokens.clone()));
}

pub const SERVICES: &[&str] = &["warden.v1.Planner"];

pub async fn serve(
    config: &PlannerConfig,
    tokens: Tokens,
    listener: impl Into<warden_grpc::Listeners>,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> anyhow::Result<()> {
    let mut routes = Routes::builder();
    add_routes(&mut routes, PlannerService::new(config)?, &tokens);
    warden_grpc::serve(listener, routes.routes(), SERVICES, shutdown).await?;
    Ok(())
}
