//! The Warden policy service: the decision point every effectful call passes through.
//! It decides (enforced mode denies by default), records every decision in the ledger with
//! its `rule_id` and `reason` before answering, and signs allows as Ed25519
//! authorizations bound to the exact call, which tool hosts verify before acting.

pub mod approvals;
pub mod budgets;
pub mod caps;
pub mod cedar;
pub mod intent;
pub mod invariants;
pub mod python;
pub mod rate;
pub mod recorder;
pub mod rules;
pub mod semantic;
pub mod server;
pub mod store;

use tonic::service::interceptor::InterceptedService;
use tonic::service::{Routes, RoutesBuilder};
use warden_config::PolicyConfig;
use warden_grpc::auth::Tokens;
use warden_proto::v1::approvals_server::ApprovalsServer;
use warden_proto::v1::capabilities_server::CapabilitiesServer;
use warden_proto::v1::policy_server::PolicyServer;

pub use server::PolicyService;

/// Builds the service from configuration (loading or creating the signing key).
pub async fn build(config: &PolicyConfig) -> anyhow::Result<PolicyService> {
    invariants::validate(&config.invariants).map_err(anyhow::Error::msg)?;
    let key = warden_grpc::keyfile::load_or_create(std::path::Path::new(&config.key_file))?;
    let ledger = warden_grpc::channel(&config.ledger_endpoint)?;
    let planner = warden_grpc::channel(&config.planner_endpoint)?;
    let previous = config
        .previous_key_files
        .iter()
        .map(|f| warden_grpc::keyfile::load_existing(std::path::Path::new(f)))
        .collect::<Result<Vec<_>, _>>()?;
    let store = store::PolicyStore::connect(&config.database_url).await?;
    let rate = rate::RateLimiter::connect(&config.redis_url).await?;
    let service = PolicyService::new(config.clone(), key, previous, (ledger, planner), store, rate);
    tokio::spawn(approvals::expire_approvals(service.clone(), std::time::Duration::from_secs(1)));
    if !config.policy_dir.is_empty() {
        let dir = std::path::PathBuf::from(&config.policy_dir);
        // At start there is no previous set to fall back on: a bad set stops the service.
        let policies = cedar::load_dir(&dir).map_err(|errors| {
            let lines: Vec<String> = errors.iter().map(ToString::to_string).collect();
            anyhow::anyhow!("policy directory {} is invalid:\n{}", dir.display(), lines.join("\n"))
        })?;
        tracing::info!(policies = policies.count, dir = %dir.display(), "cedar policies loaded");
        service.set_cedar(policies);
        let every = std::time::Duration::from_millis(config.reload_interval_ms.max(100));
        tokio::spawn(service.clone().watch_policies(dir, every));
    }
    Ok(service)
}

/// Adds `Policy`, `Capabilities` and `Approvals` to `routes`.
pub fn add_routes(routes: &mut RoutesBuilder, service: PolicyService, tokens: &Tokens) {
    let capabilities = caps::CapabilitiesService::new(service.clone());
    let approvals = approvals::ApprovalsService::new(service.clone());
    routes
        .add_service(InterceptedService::new(PolicyServer::new(service), tokens.clone()))
        .add_service(InterceptedService::new(CapabilitiesServer::new(capabilities), tokens.clone()))
        .add_service(InterceptedService::new(ApprovalsServer::new(approvals), tokens.clone()));
}

pub const SERVICES: &[&str] = &["warden.v1.Policy", "warden.v1.Capabilities", "warden.v1.Approvals"];

pub async fn serve(
    config: &PolicyConfig,
    tokens: Tokens,
    listener: impl Into<warden_grpc::Listeners>,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> anyhow::Result<()> {
    let service = build(config).await?;
    let mut routes = Routes::builder();
    add_routes(&mut routes, service, &tokens);
    warden_grpc::serve(listener, routes.routes(), SERVICES, shutdown).await?;
    Ok(())
}
