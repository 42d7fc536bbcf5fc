//! `warden-mcp`: MCP servers behind Warden. A tool host (`warden.v1.ToolHost`) configured with
//! MCP servers — a command spoken to over stdio, or a streamable HTTP URL — that lists their
//! tools into Warden's catalog as `mcp.<server>.<tool>` and forwards a call to the server only
//! after verifying it, exactly as every tool host must:
//!
//! - **Two proofs first.** The policy's signed authorization of exactly this call (tenant, run,
//!   step, attempt, tool, SHA-256 of the canonical arguments, idempotency key; unexpired) and
//!   the ledger's signed acknowledgement that the call's request is recorded. Without both,
//!   `PERMISSION_DENIED` and nothing reaches the server. Then the server's own fence: a server
//!   serves only the tenants its configuration names.
//! - **One outcome per key.** The first outcome of each (tenant, idempotency key) is written to
//!   SQLite before it is answered and replayed for the key afterwards, across restarts too; a
//!   call runs on its own task, so a caller hanging up never loses an outcome.
//! - **Failures are outcomes.** A server that cannot be started, crashes, hangs past
//!   `call_timeout_secs`, writes malformed JSON-RPC or lists a schema that is not JSON Schema
//!   yields a failed outcome naming the reason — recorded by the executor like any tool
//!   failure — and the host keeps serving; a broken connection is made again for the next call.
//! - **Effect classes** come from the operator's `effects`, else from the server's annotations,
//!   which are untrusted hints used only as defaults (see [`tools`]).
//!
//! Tool names, schemas and results are mapped in [`tools`], connections in [`upstream`], the
//! verification in [`warden_grpc::guard`] (shared with the demo tool host) and the outcome
//! store in [`outcomes`].

pub mod config;
pub mod outcomes;
pub mod tools;
pub mod upstream;

use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;
use tonic::service::{Routes, RoutesBuilder};
use tonic::{Request, Response, Status};
use warden_core::canonical::args_digest;
use warden_core::ids::{check_id, check_step_id};
use warden_grpc::{invalid_field, now_ms};
use warden_proto::v1 as pb;
use warden_proto::v1::tool_host_server::{ToolHost, ToolHostServer};

use crate::config::McpConfig;
use crate::outcomes::{InFlight, OutcomeStore, Recorded, StoreError};
use crate::upstream::Upstream;
use warden_grpc::guard::Guard;

pub const SERVICES: &[&str] = &["warden.v1.ToolHost"];

#[derive(Clone)]
pub struct McpHost {
    inner: Arc<Inner>,
}

struct Inner {
    upstreams: Vec<Arc<Upstream>>,
    guard: Guard,
    outcomes: OutcomeStore,
    in_flight: Arc<InFlight>,
    list_ttl: Duration,
}

fn store_unavailable(e: StoreError, what: &str) -> Status {
    tracing::warn!(error = %e, "{what}");
    Status::unavailable(format!("{what}: {e}"))
}

fn tool_error(code: &str, message: String) -> pb::ToolError {
    pb::ToolError { code: code.into(), message, retryable: false }
}

impl McpHost {
    /// Builds the host; servers are started on first use (see [`Self::start`]). Within a Tokio
    /// runtime.
    pub fn new(config: &McpConfig) -> anyhow::Result<McpHost> {
        let connect_timeout = Duration::from_millis(config.connect_timeout_ms);
        Ok(McpHost {
            inner: Arc::new(Inner {
                upstreams: config.servers.iter().map(|s| Arc::new(Upstream::new(s.clone(), connect_timeout))).collect(),
                guard: Guard::new(&config.policy_endpoint, &config.ledger_endpoint)?,
                outcomes: OutcomeStore::new(std::path::Path::new(&config.state_path))?,
                in_flight: Arc::default(),
                list_ttl: Duration::from_millis(config.list_ttl_ms),
            }),
        })
    }

    /// Opens the outcome store (a bad path stops the host here), fetches the keys, and starts
    /// every server and lists its tools, all servers at once, each within
    /// `connect_timeout_ms`. A server that does not come up is logged and tried again later.
    pub async fn start(&self) -> anyhow::Result<()> {
        // The workspace builds reqwest without a crypto provider of its own: ring, once per
        // process, before any HTTP client (an MCP server at an https:// URL) is built.
        let _ = rustls::crypto::ring::default_provider().install_default();
        self.inner.outcomes.ready().await?;
        if let Err(e) = self.inner.guard.refresh_policy_keys().await {
            tracing::warn!(error = %e, "policy keys not fetched yet; will fetch on first call");
        }
        if let Err(e) = self.inner.guard.refresh_ledger_keys().await {
            tracing::warn!(error = %e, "ledger keys not fetched yet; will fetch on first call");
        }
        let listings = self.inner.upstreams.iter().cloned().map(|u| async move {
            match u.refresh().await {
                Ok(tools) => tracing::info!(server = %u.name(), tools = tools.len(), "MCP server listed its tools"),
                Err(e) => tracing::warn!(server = %u.name(), error = %e, "MCP server not available yet"),
            }
        });
        run_all(listings).await;
        Ok(())
    }

    fn upstream(&self, name: &str) -> Option<&Arc<Upstream>> {
        self.inner.upstreams.iter().find(|u| u.name() == name)
    }

    /// The call's tool on its server: from the listing, or a fresh one if the tool is not in it
    /// (a server restarted with new tools).
    async fn find_tool(
        &self,
        upstream: &Upstream,
        name: &str,
        deadline: tokio::time::Instant,
    ) -> Result<tools::McpTool, pb::ToolError> {
        let (known, _) = upstream.tools(self.inner.list_ttl);
        if let Some(t) = known.iter().find(|t| t.name == name) {
            return Ok(t.clone());
        }
        let unavailable =
            |message: String| pb::ToolError { code: "mcp_server_unavailable".into(), message, retryable: true };
        let late =
            || format!("MCP server '{}' did not list its tools in time; nothing was sent to it", upstream.name());
        let fresh = tokio::time::timeout_at(deadline, upstream.refresh())
            .await
            .map_err(|_| unavailable(late()))?
            .map_err(unavailable)?;
        fresh.iter().find(|t| t.name == name).cloned().ok_or_else(|| {
            tool_error("mcp_unknown_tool", format!("MCP server '{}' lists no tool '{name}'", upstream.name()))
        })
    }

    /// Runs a verified call unless its key has an outcome; records the outcome before answering.
    async fn run_once(
        &self,
        r: pb::InvokeRequest,
        upstream: Arc<Upstream>,
        tool: String,
        args: Value,
        args_sha256: String,
    ) -> Result<Response<pb::InvokeResponse>, Status> {
        let ticket = self.inner.in_flight.ticket((r.tenant.clone(), r.idempotency_key.clone()));
        let _turn = ticket.turn().await;
        let recorded = self.inner.outcomes.outcome(&r.tenant, &r.idempotency_key).await;
        if let Some(first) = recorded.map_err(|e| store_unavailable(e, "outcomes unreadable; nothing was done"))? {
            return replay(&r, &args_sha256, first);
        }
        let outcome = match self.forward(&upstream, &tool, args).await {
            Ok(out) => pb::invoke_response::Outcome::OutputJson(out.to_string()),
            Err(e) => {
                tracing::warn!(run_id = %r.run_id, step_id = %r.step_id, tool = %r.tool, code = %e.code, error = %e.message, "MCP call failed");
                pb::invoke_response::Outcome::Error(e)
            }
        };
        let ours = Recorded { tool: r.tool.clone(), args_sha256: args_sha256.clone(), outcome };
        // Unrecorded, the outcome would not be replayed: UNAVAILABLE tells the executor to
        // treat it as unknown rather than rely on it.
        let (first, is_ours) = self
            .inner
            .outcomes
            .record(&r.tenant, &r.idempotency_key, &ours, now_ms())
            .await
            .map_err(|e| store_unavailable(e, "the call ran but its outcome could not be recorded"))?;
        if !is_ours {
            return replay(&r, &args_sha256, first);
        }
        Ok(Response::new(pb::InvokeResponse { outcome: Some(first.outcome), replayed: false }))
    }

    async fn forward(&self, upstream: &Upstream, tool: &str, args: Value) -> Result<Value, pb::ToolError> {
        // One deadline for everything the call needs, so the host answers before the executor
        // (waiting the tool's declared timeout_sec, 2 s longer) would give up on it.
        let deadline = tokio::time::Instant::now() + upstream.call_timeout();
        let found = self.find_tool(upstream, tool, deadline).await?;
        if let Some(problem) = found.schema_problem {
            return Err(tool_error(
                "mcp_invalid_schema",
                format!("tool '{tool}' of MCP server '{}' cannot be called: {problem}", upstream.name()),
            ));
        }
        let Value::Object(args) = args else {
            return Err(tool_error("invalid_arguments", format!("MCP tool arguments are an object, not {args}")));
        };
        upstream.call(tool, args, deadline).await
    }
}

/// `first` as this call's answer, only if it is the outcome of this very call: a key met
/// again with another tool or other arguments means a caller reused it.
fn replay(r: &pb::InvokeRequest, args_sha256: &str, first: Recorded) -> Result<Response<pb::InvokeResponse>, Status> {
    if first.tool != r.tool || first.args_sha256 != args_sha256 {
        return Err(Status::failed_precondition(format!(
            "idempotency key '{}' was first used for another call ({} with arguments {}); its outcome is not this call's",
            r.idempotency_key, first.tool, first.args_sha256
        )));
    }
    Ok(Response::new(pb::InvokeResponse { outcome: Some(first.outcome), replayed: true }))
}

async fn run_all<F: std::future::Future<Output = ()> + Send + 'static>(futures: impl Iterator<Item = F>) {
    let mut set = tokio::task::JoinSet::new();
    for f in futures {
        set.spawn(f);
    }
    set.join_all().await;
}

#[tonic::async_trait]
impl ToolHost for McpHost {
    /// Every server's tools, or with a tenant only those of the servers serving it. Answers from
    /// the last listings at once; stale ones are refreshed in the background.
    async fn list_tools(&self, req: Request<pb::ListToolsRequest>) -> Result<Response<pb::ListToolsResponse>, Status> {
        let tenant = req.into_inner().tenant;
        let mut specs = Vec::new();
        for u in self.inner.upstreams.iter().filter(|u| u.config.admits(&tenant)) {
            let (tools, stale) = u.tools(self.inner.list_ttl);
            if stale {
                u.refresh_in_background();
            }
            specs.extend(tools.iter().map(|t| t.spec.clone()));
        }
        specs.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(Response::new(pb::ListToolsResponse { tools: specs }))
    }

    async fn invoke(&self, req: Request<pb::InvokeRequest>) -> Result<Response<pb::InvokeResponse>, Status> {
        let r = req.into_inner();
        for (field, v) in [("tenant", &r.tenant), ("run_id", &r.run_id), ("idempotency_key", &r.idempotency_key)] {
            check_id(v).map_err(|e| invalid_field(field, e.to_string()))?;
        }
        check_step_id(&r.step_id).map_err(|e| invalid_field("step_id", e.to_string()))?;
        let Some((server, tool)) = tools::split_name(&r.tool) else {
            return Err(Status::not_found(format!(
                "tool '{}' is not hosted here (MCP tools are mcp.<server>.<tool>)",
                r.tool
            )));
        };
        let Some(upstream) = self.upstream(server).cloned() else {
            return Err(Status::not_found(format!("tool '{}' is not hosted here: no MCP server '{server}'", r.tool)));
        };
        let tool = tool.to_string();
        let args: Value = serde_json::from_str(&r.args_json)
            .map_err(|e| invalid_field("args_json", format!("not valid JSON: {e}")))?;
        let digest = args_digest(&args);
        // Nothing about the call is acted on before both proofs are checked.
        let claims = self.inner.guard.verify(&r, &digest, None).await?;
        // Decided for the tool as this host lists it now (class, version, schemas).
        // A tool the server does not list now has no declaration to check the call against: it
        // is refused rather than passed on unchecked (the policy may have decided under a class
        // the tool never had).
        let (mut listed, stale) = upstream.tools(self.inner.list_ttl);
        if stale
            && !listed.iter().any(|t| t.spec.name == r.tool)
            && let Ok(fresh) = upstream.refresh().await
        {
            listed = fresh;
        }
        let Some(t) = listed.iter().find(|t| t.spec.name == r.tool) else {
            return Err(Status::failed_precondition(format!(
                "refused: MCP server '{server}' does not list tool '{tool}' now, so the call cannot be checked against its declaration"
            )));
        };
        let effect = warden_grpc::catalog::effect_name(&t.spec);
        warden_core::auth::check_declaration(&claims, &t.declaration_sha256, effect).map_err(|e| {
            Status::permission_denied(format!("refused: decided for another declaration of the tool: {e}"))
        })?;
        if !upstream.config.admits(&r.tenant) {
            tracing::warn!(tenant = %r.tenant, server = %server, "refused a call from a tenant the server does not serve");
            return Err(Status::permission_denied(format!(
                "refused: MCP server '{server}' does not serve tenant '{}'",
                r.tenant
            )));
        }
        let recorded = self.inner.outcomes.outcome(&r.tenant, &r.idempotency_key).await;
        if let Some(first) = recorded.map_err(|e| store_unavailable(e, "outcomes unreadable; nothing was done"))? {
            return replay(&r, &digest, first);
        }
        // On its own task: a caller that hangs up (its timeout) must not stop the call between
        // the server's effect and the recording of its outcome.
        let host = self.clone();
        tokio::spawn(async move { host.run_once(r, upstream, tool, args, digest).await })
            .await
            .map_err(|e| Status::unknown(format!("the call broke off; its outcome is unknown: {e}")))?
    }
}

/// Adds the MCP host's gRPC service to `routes`.
pub fn add_routes(routes: &mut RoutesBuilder, host: McpHost) {
    routes.add_service(ToolHostServer::new(host).max_decoding_message_size(warden_grpc::MAX_MESSAGE_BYTES));
}

/// Serves a started host (see [`McpHost::start`]) on `listener` until `shutdown`. Like every
/// tool host it needs no caller token: what it acts on is what the two proofs allow.
pub async fn serve(
    host: McpHost,
    listener: impl Into<warden_grpc::Listeners>,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> anyhow::Result<()> {
    let mut routes = Routes::builder();
    add_routes(&mut routes, host);
    warden_grpc::serve(listener, routes.routes(), SERVICES, shutdown).await?;
    Ok(())
}
