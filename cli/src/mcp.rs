//! `warden mcp serve`: Warden as an MCP server. An MCP client (an IDE, an agent framework) sees
//! the tenant's governed tools; each `tools/call` becomes a one-step Warden run — authorized,
//! recorded, receipted — and its outcome is the MCP result: the tool's output, or the denial
//! with its rule and reason, or "approval required" with the approval id.
//!
//! It reaches the mesh like every CLI command (`--endpoint`/`WARDEN_ENDPOINT`, the ledger and
//! policy endpoints, `--planner-endpoint` for the catalog). Over stdio (the default) it acts as
//! `--tenant` with `--token`. With `--http ADDR` it serves streamable HTTP, and a caller's
//! bearer token maps to a tenant (and agent) by the configuration's `[auth] tokens`, exactly as
//! the gRPC API maps it; the token is then presented to the mesh, which checks it again.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock, Implementation, ListToolsResult, MetaObject,
    PaginatedRequestParams, ServerCapabilities, ServerConfig, Tool, ToolAnnotations,
};
use rmcp::service::{RequestContext, RoleServer};
use rmcp::{ErrorData as McpError, ServerHandler, ServiceExt};
use serde_json::{Map, Value, json};
use tonic::service::Interceptor;
use warden_grpc::auth::{Ch, Scope, Tokens};
use warden_grpc::convert::status_name;
use warden_proto::v1 as pb;
use warden_proto::v1::approvals_client::ApprovalsClient;
use warden_proto::v1::ledger_client::LedgerClient;
use warden_proto::v1::planner_client::PlannerClient;
use warden_proto::v1::policy_client::PolicyClient;
use warden_proto::v1::runs_client::RunsClient;

use crate::Target;

#[derive(clap::Subcommand)]
pub enum McpCommand {
    /// Serve the tenant's governed tools to MCP clients: each `tools/call` is a one-step run.
    Serve(ServeArgs),
}

#[derive(clap::Args)]
pub struct ServeArgs {
    /// Serve streamable HTTP on ADDR (e.g. 127.0.0.1:7107; port 0 picks one) instead of stdio.
    #[arg(long, value_name = "ADDR")]
    http: Option<String>,
    /// The HTTP path of the MCP endpoint.
    #[arg(long, default_value = "/mcp", requires = "http")]
    path: String,
    /// The planner, whose catalog lists the tools (default: --endpoint, as `warden dev` serves
    /// every service there).
    #[arg(long, env = "WARDEN_PLANNER_ENDPOINT")]
    planner_endpoint: Option<String>,
    /// Offer only tools matching these patterns (exact names or a trailing `*`; repeatable).
    #[arg(long = "tools", value_name = "PATTERN")]
    tools: Vec<String>,
    /// The agent the runs act for (an agent's token fixes it).
    #[arg(long)]
    agent: Option<String>,
    /// Configuration whose `[auth] tokens` map HTTP callers' bearer tokens to tenants and
    /// agents (the mesh's file; also WARDEN_CONFIG).
    #[arg(long, env = "WARDEN_CONFIG")]
    config: Option<PathBuf>,
    /// How long one call waits for its run to end before answering that it still runs.
    #[arg(long, default_value_t = 120)]
    wait_secs: u64,
}

/// The MCP `_meta` key under which a result names its Warden run.
const META_KEY: &str = "warden/run";
/// The planned step of a call's one-step run.
const STEP: &str = "call";

pub async fn run(target: &Target, policy_endpoint: Option<String>, cmd: McpCommand) -> anyhow::Result<i32> {
    let McpCommand::Serve(args) = cmd;
    let _telemetry = warden_telemetry::init_tracing("warden-mcp-serve", &Default::default())?;
    // Tokens map HTTP callers; over stdio the caller is this process (--tenant, --token).
    let tokens = match (&args.http, &args.config) {
        (Some(_), Some(path)) => Tokens::new(&warden_config::WardenConfig::load(Some(path))?.auth.tokens),
        _ => Tokens::default(),
    };
    let gateway = Gateway {
        inner: Arc::new(Inner {
            endpoint: target.endpoint.clone(),
            ledger_endpoint: target.ledger_endpoint.clone(),
            policy_endpoint: policy_endpoint.unwrap_or_else(|| target.endpoint.clone()),
            planner_endpoint: args.planner_endpoint.clone().unwrap_or_else(|| target.endpoint.clone()),
            tenant: target.tenant.clone(),
            agent: args.agent.clone().unwrap_or_default(),
            patterns: args.tools.clone(),
            wait: Duration::from_secs(args.wait_secs.max(1)),
            tokens,
            clients: Mutex::default(),
        }),
    };
    match &args.http {
        None => {
            // stdout is the MCP channel: everything else goes to stderr (tracing does).
            let served = gateway.serve(rmcp::transport::stdio()).await.context("starting MCP over stdio")?;
            served.waiting().await?;
            Ok(0)
        }
        Some(addr) => serve_http(gateway, addr, &args.path).await,
    }
}

async fn serve_http(gateway: Gateway, addr: &str, path: &str) -> anyhow::Result<i32> {
    use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
    use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};
    // The services' bind: a listen queue of `LISTEN_BACKLOG`, not tokio's 128, for many MCP
    // clients connecting at once.
    let listener = warden_grpc::bind(addr).await?;
    let bound = listener.local_addr()?;
    anyhow::ensure!(
        bound.ip().is_loopback() || gateway.inner.tokens.enabled(),
        "--http on {bound} (not loopback) needs [auth] tokens in --config: callers must be authenticated"
    );
    let mut hosts = vec!["localhost".to_string(), "127.0.0.1".to_string(), "::1".to_string()];
    if !bound.ip().is_loopback() {
        hosts.push(bound.ip().to_string());
    }
    let factory = gateway.clone();
    let service = StreamableHttpService::new(
        move || Ok(factory.clone()),
        Arc::new(LocalSessionManager::default()),
        StreamableHttpServerConfig::default().with_allowed_hosts(hosts),
    );
    let router = axum::Router::new()
        .nest_service(path, service)
        // Outermost: no request reaches MCP (or the mesh) before its bearer token is known.
        .layer(axum::middleware::from_fn_with_state(gateway.clone(), authenticate));
    eprintln!("warden mcp: serving MCP (streamable HTTP) on http://{bound}{path}");
    println!("WARDEN_MCP_LISTENING http://{bound}{path}");
    axum::serve(listener, router).with_graceful_shutdown(warden_grpc::shutdown_signal()).await?;
    Ok(0)
}

/// Maps the request's bearer token to its caller (401 when tokens are configured and the token
/// is missing or unknown), for the MCP handler to find in the request's parts.
async fn authenticate(
    axum::extract::State(gateway): axum::extract::State<Gateway>,
    mut request: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    use axum::response::IntoResponse;
    let header = request.headers().get(axum::http::header::AUTHORIZATION).and_then(|v| v.to_str().ok());
    match gateway.caller_for(header) {
        Ok(caller) => {
            request.extensions_mut().insert(caller);
            next.run(request).await
        }
        Err(why) => {
            let challenge = [(axum::http::header::WWW_AUTHENTICATE, "Bearer")];
            (axum::http::StatusCode::UNAUTHORIZED, challenge, why).into_response()
        }
    }
}

/// Who a request acts for, and the token it presents to the mesh (none: the process's).
#[derive(Clone, Debug)]
struct Caller {
    tenant: String,
    agent: String,
    token: Option<String>,
}

/// The mesh's services, as one caller reaches them.
#[derive(Clone)]
struct Mesh {
    runs: RunsClient<Ch>,
    planner: PlannerClient<Ch>,
    policy: PolicyClient<Ch>,
    approvals: ApprovalsClient<Ch>,
    ledger: LedgerClient<Ch>,
}

#[derive(Clone)]
struct Gateway {
    inner: Arc<Inner>,
}

struct Inner {
    endpoint: String,
    ledger_endpoint: String,
    policy_endpoint: String,
    planner_endpoint: String,
    /// The tenant and agent of stdio, and of `*` tokens over HTTP.
    tenant: String,
    agent: String,
    patterns: Vec<String>,
    wait: Duration,
    tokens: Tokens,
    /// Clients by the token they present (tokens come from the configuration: bounded).
    clients: Mutex<HashMap<Option<String>, Mesh>>,
}

fn matches(pattern: &str, tool: &str) -> bool {
    match pattern.strip_suffix('*') {
        Some(prefix) => tool.starts_with(prefix),
        None => pattern == tool,
    }
}

fn internal(e: impl std::fmt::Display) -> McpError {
    McpError::internal_error(e.to_string(), None)
}

impl Gateway {
    fn default_caller(&self) -> Caller {
        Caller { tenant: self.inner.tenant.clone(), agent: self.inner.agent.clone(), token: None }
    }

    /// The caller an HTTP `Authorization` header names, by the configured tokens (everyone is
    /// the default caller when none are configured).
    fn caller_for(&self, header: Option<&str>) -> Result<Caller, String> {
        if !self.inner.tokens.enabled() {
            return Ok(self.default_caller());
        }
        let token = header
            .and_then(|h| h.strip_prefix("Bearer "))
            .ok_or_else(|| "missing 'Authorization: Bearer <token>'".to_string())?;
        let mut probe = tonic::Request::new(());
        let value = format!("Bearer {token}").parse().map_err(|_| "the token is not valid header text".to_string())?;
        probe.metadata_mut().insert("authorization", value);
        let probe = self.inner.tokens.clone().call(probe).map_err(|s| s.message().to_string())?;
        let default = self.default_caller();
        let (tenant, agent) = match probe.extensions().get::<Scope>() {
            Some(Scope::Tenant(t) | Scope::Person { tenant: t, .. }) => (t.clone(), default.agent),
            Some(Scope::Agent { tenant, agent }) => (tenant.clone(), agent.clone()),
            Some(Scope::Any) | None => (default.tenant, default.agent),
        };
        Ok(Caller { tenant, agent, token: Some(token.to_string()) })
    }

    /// The caller of an MCP request: set by [`authenticate`] over HTTP, the default over stdio.
    fn caller(&self, context: &RequestContext<RoleServer>) -> Caller {
        context
            .extensions
            .get::<axum::http::request::Parts>()
            .and_then(|parts| parts.extensions.get::<Caller>().cloned())
            .unwrap_or_else(|| self.default_caller())
    }

    fn mesh(&self, caller: &Caller) -> Result<Mesh, McpError> {
        let mut clients = self.inner.clients.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(m) = clients.get(&caller.token) {
            return Ok(m.clone());
        }
        let channel = |endpoint: &str| match &caller.token {
            Some(t) => warden_grpc::channel_with_token(endpoint, t),
            None => warden_grpc::channel(endpoint),
        };
        let policy = channel(&self.inner.policy_endpoint).map_err(internal)?;
        let mesh = Mesh {
            runs: RunsClient::new(channel(&self.inner.endpoint).map_err(internal)?),
            planner: PlannerClient::new(channel(&self.inner.planner_endpoint).map_err(internal)?),
            approvals: ApprovalsClient::new(policy.clone()),
            policy: PolicyClient::new(policy),
            ledger: LedgerClient::new(channel(&self.inner.ledger_endpoint).map_err(internal)?),
        };
        clients.insert(caller.token.clone(), mesh.clone());
        Ok(mesh)
    }

    /// The catalog as the caller may use it: tools matching `--tools`, less those the tenant's
    /// allowlist does not name (a dry run per tool; listing is no grant — every call is still
    /// decided). Tools ruled by Cedar are all offered: their rules may depend on the arguments.
    async fn governed_tools(&self, caller: &Caller) -> Result<Vec<pb::ToolSpec>, McpError> {
        let mesh = self.mesh(caller)?;
        let listed = mesh
            .planner
            .clone()
            .list_tools(pb::ListToolsRequest { tenant: caller.tenant.clone() })
            .await
            .map_err(|s| internal(format!("the tool catalog is unavailable: {}", s.message())))?
            .into_inner()
            .tools;
        let wanted = listed
            .into_iter()
            .filter(|t| self.inner.patterns.is_empty() || self.inner.patterns.iter().any(|p| matches(p, &t.name)));
        let checks = wanted.map(|spec| {
            let mut policy = mesh.policy.clone();
            let dry_run = pb::AuthorizeRequest {
                tenant: caller.tenant.clone(),
                agent: caller.agent.clone(),
                run_id: "mcp-tools-list".into(),
                step_id: "list".into(),
                attempt: 1,
                tool: spec.name.clone(),
                args_json: "{}".into(),
                idempotency_key: "mcp-tools-list".into(),
                ..Default::default()
            };
            async move {
                match policy.check(dry_run).await {
                    Ok(d) => {
                        let d = d.into_inner();
                        let barred = d.outcome() == pb::Outcome::Deny && d.rule_id == "default_deny";
                        Ok((!barred).then_some(spec))
                    }
                    Err(s) if matches!(s.code(), tonic::Code::PermissionDenied | tonic::Code::Unauthenticated) => {
                        Err(McpError::invalid_request(s.message().to_string(), None))
                    }
                    // A dry run that fails hides nothing: the call is decided anyway.
                    Err(_) => Ok(Some(spec)),
                }
            }
        });
        let decided = futures::future::join_all(checks).await;
        decided.into_iter().filter_map(Result::transpose).collect()
    }

    /// One `tools/call` as a one-step run, answered with the run's outcome.
    async fn call(
        &self,
        caller: &Caller,
        params: CallToolRequestParams,
        cancelled: tokio_util::sync::CancellationToken,
    ) -> Result<CallToolResult, McpError> {
        let mesh = self.mesh(caller)?;
        let args = Value::Object(params.arguments.unwrap_or_default());
        let plan = json!({"steps": [{"id": STEP, "tool": params.name, "params": args}]});
        let submit = pb::SubmitRunRequest {
            tenant: caller.tenant.clone(),
            plan_json: plan.to_string(),
            agent: caller.agent.clone(),
            ..Default::default()
        };
        let run_id = match mesh.runs.clone().submit_run(submit).await {
            Ok(r) => r.into_inner().run_id,
            Err(s) => {
                let fields: Vec<String> =
                    warden_grpc::field_violations(&s).into_iter().map(|(f, d)| format!("{f}: {d}")).collect();
                let detail = if fields.is_empty() { s.message().to_string() } else { fields.join("; ") };
                let text = format!("Warden refused the call ({:?}): {detail}", s.code());
                return Ok(result(true, text, json!({"status": "refused", "code": format!("{:?}", s.code())}), None));
            }
        };
        let run = tokio::select! {
            run = self.wait(&mesh, caller, &run_id) => run?,
            _ = cancelled.cancelled() => {
                let cancel = pb::CancelRunRequest {
                    tenant: caller.tenant.clone(),
                    run_id: run_id.clone(),
                    reason: "the MCP client cancelled the call".into(),
                };
                if let Err(e) = mesh.runs.clone().cancel_run(cancel).await {
                    tracing::warn!(run_id = %run_id, error = %e, "cancelling an abandoned call's run failed");
                }
                return Err(McpError::internal_error("cancelled by the client", None));
            }
        };
        self.answer(&mesh, caller, run).await
    }

    /// Waits until the run ends or waits for a person, or `--wait-secs` pass.
    async fn wait(&self, mesh: &Mesh, caller: &Caller, run_id: &str) -> Result<pb::Run, McpError> {
        let deadline = tokio::time::Instant::now() + self.inner.wait;
        loop {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            let ask = pb::WaitRunRequest {
                tenant: caller.tenant.clone(),
                run_id: run_id.to_string(),
                timeout_ms: left.as_millis().max(1) as u64,
            };
            let run =
                mesh.runs.clone().wait_run(ask).await.map_err(|s| {
                    internal(format!("run {run_id} was submitted but cannot be followed: {}", s.message()))
                })?;
            let run = run.into_inner();
            use pb::RunStatus as S;
            let settled = !matches!(run.status(), S::Pending | S::Active | S::Unspecified);
            if settled || left.is_zero() {
                return Ok(run);
            }
        }
    }

    /// The MCP result of a run: its step's output, or why there is none.
    async fn answer(&self, mesh: &Mesh, caller: &Caller, run: pb::Run) -> Result<CallToolResult, McpError> {
        use pb::RunStatus as S;
        let step = run.steps.iter().find(|s| s.id == STEP).cloned().unwrap_or_default();
        let receipt = self.receipt(mesh, caller, &run.run_id).await;
        let mut meta = json!({"run_id": run.run_id, "status": status_name(run.status)});
        if let Some(r) = &receipt {
            meta["receipt_id"] = json!(r.receipt_id);
            meta["decision_id"] = json!(r.policy_decision);
            meta["receipt_status"] = json!(r.status);
        }
        let with = |extra: Value| {
            let mut m = meta.clone();
            if let (Some(m), Value::Object(x)) = (m.as_object_mut(), extra) {
                m.extend(x);
            }
            m
        };
        Ok(match run.status() {
            S::Completed => {
                let output: Value = serde_json::from_str(&step.output_json).unwrap_or(Value::Null);
                completed(output, meta)
            }
            S::Failed if step.status() == pb::StepStatus::Denied => {
                let (rule_id, reason) = self.denial(mesh, caller, &run.run_id).await;
                let text = format!("denied by policy rule '{rule_id}': {reason} (run {})", run.run_id);
                let structured = with(json!({"status": "denied", "rule_id": rule_id, "reason": reason}));
                result(true, text, structured.clone(), Some(structured))
            }
            S::Blocked => {
                let approval = self.approval_of(mesh, caller, &run).await;
                let text = format!(
                    "approval required: approval {approval} must be granted before this call runs (run {}; {}). \
                     `warden approvals approve {approval}` lets the run go on; its outcome is then in the ledger.",
                    run.run_id, run.reason
                );
                let structured = with(json!({"status": "approval_required", "approval_id": approval}));
                result(true, text, structured.clone(), Some(structured))
            }
            S::Pending | S::Active | S::Unspecified => {
                let text = format!(
                    "run {} is still running after {}s; follow it with `warden run status`",
                    run.run_id,
                    self.inner.wait.as_secs()
                );
                result(true, text, with(json!({})), None)
            }
            _ => {
                let why = if step.error.is_empty() { run.reason.clone() } else { step.error.clone() };
                let text = format!("the call {}: {why} (run {})", status_name(run.status), run.run_id);
                let structured = with(json!({"reason": why}));
                result(true, text, structured.clone(), Some(structured))
            }
        })
    }

    /// The receipt of the call's outcome, if the run has one.
    async fn receipt(&self, mesh: &Mesh, caller: &Caller, run_id: &str) -> Option<pb::Receipt> {
        let ask = pb::ListReceiptsRequest {
            tenant: caller.tenant.clone(),
            run_id: run_id.to_string(),
            step_id: STEP.into(),
            ..Default::default()
        };
        let receipts = mesh.ledger.clone().list_receipts(ask).await.ok()?.into_inner().receipts;
        receipts.into_iter().last()
    }

    /// The rule and reason of the call's recorded denial.
    async fn denial(&self, mesh: &Mesh, caller: &Caller, run_id: &str) -> (String, String) {
        let ask = pb::StreamEventsRequest {
            tenant: caller.tenant.clone(),
            run_id: run_id.to_string(),
            since_seq: 0,
            follow: false,
        };
        let mut found = (String::new(), String::new());
        if let Ok(stream) = mesh.ledger.clone().stream_events(ask).await {
            let mut stream = stream.into_inner();
            while let Ok(Some(e)) = stream.message().await {
                if e.event_type == "policy_decision" && e.step_id == STEP {
                    let p: Value = serde_json::from_str(&e.payload_json).unwrap_or_default();
                    let field = |k: &str| p.get(k).and_then(Value::as_str).unwrap_or_default().to_string();
                    found = (field("rule_id"), field("reason"));
                }
            }
        }
        found
    }

    /// The pending approval the run waits on (from the approvals; else named in its reason).
    async fn approval_of(&self, mesh: &Mesh, caller: &Caller, run: &pb::Run) -> String {
        let ask = pb::ListApprovalsRequest {
            tenant: caller.tenant.clone(),
            state: pb::ApprovalState::Pending as i32,
            page_size: 1000,
            ..Default::default()
        };
        if let Ok(listed) = mesh.approvals.clone().list(ask).await
            && let Some(a) = listed.into_inner().approvals.into_iter().find(|a| a.run_id == run.run_id)
        {
            return a.approval_id;
        }
        run.reason.rsplit(' ').next().unwrap_or_default().to_string()
    }
}

/// An MCP result: text for the model, structured content for programs, and the run in `_meta`.
fn result(is_error: bool, text: String, meta: Value, structured: Option<Value>) -> CallToolResult {
    let mut r = if is_error {
        CallToolResult::error(vec![ContentBlock::text(text)])
    } else {
        CallToolResult::success(vec![ContentBlock::text(text)])
    };
    r.structured_content = structured;
    r.meta = Some(run_meta(meta));
    r
}

fn run_meta(meta: Value) -> MetaObject {
    let mut m = Map::new();
    m.insert(META_KEY.into(), meta);
    MetaObject(m)
}

/// A completed call: an MCP tool's own content when the tool was one (behind `warden-mcp`),
/// otherwise the output as JSON text, and the output as structured content when an object.
fn completed(output: Value, meta: Value) -> CallToolResult {
    let passed_through: Option<Vec<ContentBlock>> =
        output.get("content").and_then(|c| serde_json::from_value(c.clone()).ok()).filter(|c: &Vec<_>| !c.is_empty());
    let structured = match &output {
        Value::Object(o) if passed_through.is_some() => o.get("structuredContent").cloned(),
        Value::Object(_) => Some(output.clone()),
        _ => None,
    };
    let content = passed_through.unwrap_or_else(|| vec![ContentBlock::text(warden_core::canonical_json(&output))]);
    let mut r = CallToolResult::success(content);
    r.structured_content = structured;
    r.meta = Some(run_meta(meta));
    r
}

/// A Warden tool as an MCP tool: its name, description, input schema and effect class.
fn mcp_tool(spec: pb::ToolSpec) -> Tool {
    let schema = match serde_json::from_str::<Value>(&spec.input_schema_json) {
        Ok(Value::Object(o)) => o,
        _ => {
            let mut o = Map::new();
            o.insert("type".into(), json!("object"));
            o
        }
    };
    let annotations = ToolAnnotations::new()
        .read_only(spec.read_only)
        .destructive(warden_grpc::catalog::effect_name(&spec) != "read_only")
        .idempotent(spec.idempotent);
    Tool::new(spec.name, spec.description, Arc::new(schema)).with_annotations(annotations)
}

impl ServerHandler for Gateway {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
            .with_server_info(Implementation::new("warden", env!("CARGO_PKG_VERSION")))
            .with_instructions(
                "Every tool call is a Warden run: authorized by policy before it happens, recorded in a \
                 hash-chained ledger and receipted. A denial names the policy rule and reason; a call that \
                 needs a human answers with the approval id.",
            )
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, McpError> {
        let caller = self.caller(&context);
        let tools = self.governed_tools(&caller).await?;
        Ok(ListToolsResult::with_all_items(tools.into_iter().map(mcp_tool).collect()))
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, McpError> {
        let caller = self.caller(&context);
        tracing::info!(tenant = %caller.tenant, tool = %request.name, "MCP tools/call");
        Ok(self.call(&caller, request, context.ct.clone()).await?.into())
    }
}
