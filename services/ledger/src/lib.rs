//! The Warden ledger: the system of record. It owns runs and each run's append-only,
//! hash-chained event log (`hash = SHA-256(prev_hash ‖ RFC 8785 JSON of the event)`),
//! refuses writes from stale lease holders (fencing epochs), refuses tool events that cite
//! no recorded allow decision, and deduplicates retried appends by idempotency key.

pub mod admit;
pub mod error;
pub mod follow;
pub mod group;
pub mod server;
pub mod store;

use tonic::service::interceptor::InterceptedService;
use tonic::service::{Routes, RoutesBuilder};
use warden_config::LedgerConfig;
use warden_grpc::auth::Tokens;
use warden_proto::v1::ledger_server::LedgerServer;

pub use error::LedgerError;
pub use server::LedgerService;
pub use store::LedgerStore;

/// Opens the store named by the configuration (running its migrations).
pub async fn open(config: &LedgerConfig) -> Result<LedgerService, LedgerError> {
    let key = warden_grpc::keyfile::load_or_create(std::path::Path::new(&config.key_file))
        .map_err(|e| LedgerError::Unavailable(e.to_string()))?;
    let store = LedgerStore::connect(&config.database_url, config.max_connections, key).await?;
    LedgerService::new(store, config.max_payload_bytes, config.write_lanes, config.max_batch, &config.policy_endpoint)
        .map(|s| {
            s.with_max_output_bytes(config.max_output_bytes)
                .with_max_frames(config.max_frames_per_root)
                .with_admission(config.max_pending_runs, config.max_pending_run_bytes)
        })
        .map_err(|e| LedgerError::Unavailable(e.message().to_string()))
}

/// Adds the ledger's gRPC service to `routes`.
pub fn add_routes(routes: &mut RoutesBuilder, service: LedgerService, tokens: &Tokens) {
    let server = LedgerServer::new(service)
        .max_decoding_message_size(warden_grpc::MAX_MESSAGE_BYTES)
        .max_encoding_message_size(warden_grpc::MAX_MESSAGE_BYTES);
    routes.add_service(InterceptedService::new(server, tokens.clone()));
}

/// Service names reported by the health service.
pub const SERVICES: &[&str] = &["warden.v1.Ledger"];

/// Serves the ledger on `listener` until `shutdown`.
pub async fn serve(
    config: &LedgerConfig,
    tokens: Tokens,
    listener: impl Into<warden_grpc::Listeners>,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> anyhow::Result<()> {
    let service = open(config).await?;
    tracing::info!(backend = service.store().backend().as_str(), "ledger store ready");
    let mut routes = Routes::builder();
    add_routes(&mut routes, service, &tokens);
    warden_grpc::serve(listener, routes.routes(), SERVICES, shutdown).await?;
    Ok(())
}
