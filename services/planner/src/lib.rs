//! The Warden planner: turns goals into plans and checks explicit plans against the tool
//! catalog (the union of every configured tool host's `ListTools`).
//!
//! Validation refuses, naming the step and field: unknown fields, bad or duplicate ids,
//! unknown tools, missing dependencies, cycles, malformed or non-dependency template
//! references, and more than `max_steps` steps (an error to fix, never a truncation).

use tokio::net::TcpListener;
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
use warden_proto::v1::planner_server::{Planner, PlannerServer};

/// Largest plan document accepted.
pub const MAX_PLAN_BYTES: usize = 1 << 20;

#[derive(Clone)]
pub struct PlannerService {
    max_steps: usize,
    catalog: ToolCatalog,
}

impl PlannerService {
    pub fn new(config: &PlannerConfig) -> anyhow::Result<PlannerService> {
        Ok(PlannerService { max_steps: config.max_steps, catalog: ToolCatalog::new(&config.tool_hosts)? })
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

    async fn create_plan(&self, _: Request<pb::CreatePlanRequest>) -> Result<Response<pb::CreatePlanResponse>, Status> {
        Err(Status::unimplemented(
            "Planner.CreatePlan (model-backed planning from a goal) is not available in this Warden release; submit an explicit plan",
        ))
    }

    async fn list_tools(&self, _: Request<pb::ListToolsRequest>) -> Result<Response<pb::ListToolsResponse>, Status> {
        let catalog = self.catalog.tools().await?;
        let mut tools: Vec<pb::ToolSpec> = catalog.values().map(|e| e.spec.clone()).collect();
        tools.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(Response::new(pb::ListToolsResponse { tools }))
    }
}

/// Adds the planner's gRPC service to `routes`.
pub fn add_routes(routes: &mut RoutesBuilder, service: PlannerService, tokens: &Tokens) {
    routes.add_service(InterceptedService::new(PlannerServer::new(service), tokens.clone()));
}

pub const SERVICES: &[&str] = &["warden.v1.Planner"];

pub async fn serve(
    config: &PlannerConfig,
    tokens: Tokens,
    listener: TcpListener,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> anyhow::Result<()> {
    let mut routes = Routes::builder();
    add_routes(&mut routes, PlannerService::new(config)?, &tokens);
    warden_grpc::serve(listener, routes.routes(), SERVICES, shutdown).await?;
    Ok(())
}
