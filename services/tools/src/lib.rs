//! The demo tool host: `echo`, `text.upper`, `kv.put`, `kv.get`, `email.send` (appends to
//! an outbox file) and `fail`. It shows what every Warden tool host must do: verify the
//! policy's signed authorization — signature, expiry, and that it names this tool, these
//! exact canonical arguments and this idempotency key — before doing anything, and return
//! the first outcome for a repeated idempotency key instead of acting twice.

pub mod tools;

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, RwLock};

use ed25519_dalek::VerifyingKey;
use serde_json::Value;
use tokio::net::TcpListener;
use tonic::service::{Routes, RoutesBuilder};
use tonic::{Request, Response, Status};
use warden_config::ToolsConfig;
use warden_core::auth::{self, CallIdentity, SignedClaims};
use warden_core::canonical::args_digest;
use warden_core::ids::{check_id, check_step_id};
use warden_grpc::{invalid_field, now_ms};
use warden_proto::v1 as pb;
use warden_proto::v1::policy_client::PolicyClient;
use warden_proto::v1::tool_host_server::{ToolHost, ToolHostServer};

/// Outcomes remembered for idempotent replay.
const REMEMBERED_OUTCOMES: usize = 100_000;

type Slot = Arc<tokio::sync::OnceCell<pb::InvokeResponse>>;

/// One slot per (tenant, idempotency key): the first call runs the tool inside the slot and
/// every concurrent or later call with the key waits for, then returns, that outcome.
/// Kept in memory (bounded): a real tool host with external side effects persists them.
#[derive(Default)]
struct Outcomes {
    by_key: HashMap<String, Slot>,
    order: VecDeque<String>,
}

#[derive(Clone)]
pub struct ToolHostService {
    state: Arc<tools::ToolState>,
    keys: Arc<RwLock<HashMap<String, VerifyingKey>>>,
    policy: PolicyClient<warden_grpc::auth::Ch>,
    outcomes: Arc<Mutex<Outcomes>>,
    /// What `ListTools` declares (timeouts as configured).
    specs: Arc<Vec<pb::ToolSpec>>,
}

impl ToolHostService {
    pub fn new(config: &ToolsConfig) -> anyhow::Result<ToolHostService> {
        Ok(ToolHostService {
            state: Arc::new(tools::ToolState::new(&config.outbox_path)),
            keys: Default::default(),
            policy: PolicyClient::new(warden_grpc::channel(&config.policy_endpoint)?),
            outcomes: Default::default(),
            specs: Arc::new(
                tools::specs()
                    .into_iter()
                    .map(|mut s| {
                        if let Some(t) = config.timeout_secs.get(&s.name) {
                            s.timeout_sec = *t;
                        }
                        s
                    })
                    .collect(),
            ),
        })
    }

    fn key(&self, id: &str) -> Option<VerifyingKey> {
        self.keys.read().unwrap_or_else(|p| p.into_inner()).get(id).copied()
    }

    /// Fetches the policy's verification keys (on start and when an unknown key id shows up).
    pub async fn refresh_keys(&self) -> Result<(), Status> {
        let keys =
            self.policy.clone().get_verification_keys(pb::GetVerificationKeysRequest {}).await?.into_inner().keys;
        let mut map = self.keys.write().unwrap_or_else(|p| p.into_inner());
        for k in keys {
            if let Ok(bytes) = <[u8; 32]>::try_from(k.public_key.as_slice())
                && let Ok(vk) = VerifyingKey::from_bytes(&bytes)
            {
                map.insert(k.key_id, vk);
            }
        }
        Ok(())
    }

    fn slot(&self, key: String) -> Slot {
        let mut o = self.outcomes.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(slot) = o.by_key.get(&key) {
            return slot.clone();
        }
        let slot = Slot::default();
        o.by_key.insert(key.clone(), slot.clone());
        o.order.push_back(key);
        while o.order.len() > REMEMBERED_OUTCOMES {
            if let Some(old) = o.order.pop_front() {
                o.by_key.remove(&old);
            }
        }
        slot
    }
}

#[tonic::async_trait]
impl ToolHost for ToolHostService {
    async fn list_tools(&self, _: Request<pb::ListToolsRequest>) -> Result<Response<pb::ListToolsResponse>, Status> {
        Ok(Response::new(pb::ListToolsResponse { tools: self.specs.to_vec() }))
    }

    async fn invoke(&self, req: Request<pb::InvokeRequest>) -> Result<Response<pb::InvokeResponse>, Status> {
        let r = req.into_inner();
        for (field, v) in [("tenant", &r.tenant), ("run_id", &r.run_id), ("idempotency_key", &r.idempotency_key)] {
            check_id(v).map_err(|e| invalid_field(field, e.to_string()))?;
        }
        check_step_id(&r.step_id).map_err(|e| invalid_field("step_id", e.to_string()))?;
        let Some(tool) = tools::find(&r.tool) else {
            return Err(Status::not_found(format!("tool '{}' is not hosted here", r.tool)));
        };
        let args: Value = serde_json::from_str(&r.args_json)
            .map_err(|e| invalid_field("args_json", format!("not valid JSON: {e}")))?;
        let digest = args_digest(&args);
        let signed = r
            .authorization
            .as_ref()
            .map(|a| SignedClaims {
                claims_json: a.claims_json.clone(),
                signature: a.signature.clone(),
                key_id: a.key_id.clone(),
            })
            .unwrap_or(SignedClaims { claims_json: vec![], signature: vec![], key_id: String::new() });
        if !signed.key_id.is_empty() && self.key(&signed.key_id).is_none() {
            // Possibly a rotated key: ask the policy once. Failure leaves the key unknown.
            let _ = self.refresh_keys().await;
        }
        let call = CallIdentity {
            tenant: &r.tenant,
            run_id: &r.run_id,
            step_id: &r.step_id,
            attempt: r.attempt,
            tool: &r.tool,
            args_sha256: &digest,
            idempotency_key: &r.idempotency_key,
        };
        if let Err(e) = auth::verify(&signed, |id| self.key(id), &call, now_ms()) {
            tracing::warn!(run_id = %r.run_id, step_id = %r.step_id, tool = %r.tool, error = %e, "refused unauthorized call");
            return Err(Status::permission_denied(format!("refused: {e}")));
        }
        let slot = self.slot(format!("{}\u{0}{}", r.tenant, r.idempotency_key));
        let mut ran = false;
        let first = slot
            .get_or_init(|| async {
                ran = true;
                let ctx = tools::CallContext {
                    run_id: &r.run_id,
                    step_id: &r.step_id,
                    attempt: r.attempt,
                    idempotency_key: &r.idempotency_key,
                };
                let outcome = match tool.run(&self.state, &args, &ctx).await {
                    Ok(out) => pb::invoke_response::Outcome::OutputJson(out.to_string()),
                    Err(e) => pb::invoke_response::Outcome::Error(e),
                };
                pb::InvokeResponse { outcome: Some(outcome), replayed: false }
            })
            .await;
        let mut resp = first.clone();
        resp.replayed = !ran;
        Ok(Response::new(resp))
    }
}

/// Adds the demo tool host's gRPC service to `routes`.
pub fn add_routes(routes: &mut RoutesBuilder, service: ToolHostService) {
    routes.add_service(ToolHostServer::new(service));
}

pub const SERVICES: &[&str] = &["warden.v1.ToolHost"];

pub async fn serve(
    config: &ToolsConfig,
    _tokens: warden_grpc::auth::Tokens,
    listener: TcpListener,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> anyhow::Result<()> {
    let service = ToolHostService::new(config)?;
    if let Err(e) = service.refresh_keys().await {
        tracing::warn!(error = %e, "policy keys not fetched yet; will fetch on first call");
    }
    let mut routes = Routes::builder();
    add_routes(&mut routes, service);
    warden_grpc::serve(listener, routes.routes(), SERVICES, shutdown).await?;
    Ok(())
}
