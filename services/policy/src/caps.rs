//! Capabilities (SPEC-KERN-01 §2.2): opaque handles userland cannot forge, scoped to tool,
//! action and resource patterns, time-bounded and revocable.
//!
//! A handle is `wcap_` + 64 hex chars of randomness, shown once at issue. The store keeps only
//! its SHA-256; the public `capability_id` (recorded in decisions, authorizations and
//! receipts) is derived from that hash and grants nothing by itself.
//!
//! Scope: the tool must match a tool pattern; when action (resource) patterns are set, the
//! call's `action` (`resource`) argument must be a string matching one. Patterns are exact
//! or end in one `*`.

use serde_json::Value;
use tonic::{Request, Response, Status};
use warden_core::ids::check_id;
use warden_grpc::{invalid_field, now_ms};
use warden_proto::v1 as pb;

use crate::server::PolicyService;
use crate::store::{CapabilityRow, PolicyStore};

/// The caller's scope on an empty request, so it can be checked after the request body was
/// taken apart.
fn carry_scope<T>(from: &Request<T>, mut to: Request<()>) -> Request<()> {
    if let Some(scope) = from.extensions().get::<warden_grpc::auth::Scope>() {
        to.extensions_mut().insert(scope.clone());
    }
    to
}

const PREFIX: &str = "wcap_";

/// The SHA-256 of a well-formed handle (None for anything Warden could not have issued).
pub fn handle_sha256(handle: &str) -> Option<String> {
    let hex_part = handle.strip_prefix(PREFIX)?;
    (hex_part.len() == 64 && hex_part.bytes().all(|b| b.is_ascii_hexdigit())).then(|| warden_core::sha256_hex(handle))
}

fn matches(pattern: &str, value: &str) -> bool {
    match pattern.strip_suffix('*') {
        Some(prefix) => value.starts_with(prefix),
        None => pattern == value,
    }
}

/// Whether every value `inner` matches is also matched by `outer` (both exact or with one
/// trailing `*`): a delegated pattern must stay within the delegator's.
pub fn within(inner: &str, outer: &str) -> bool {
    match (inner.strip_suffix('*'), outer.strip_suffix('*')) {
        (_, None) => inner == outer,
        (Some(prefix), Some(outer_prefix)) => prefix.starts_with(outer_prefix),
        (None, Some(outer_prefix)) => inner.starts_with(outer_prefix),
    }
}

/// A resource is matched by prefix, so it must be a normalized path first: `docs/*` must not
/// match `docs/../secrets/key`. Dot segments (also percent-encoded) and backslashes, which a
/// tool host may resolve into another path, are refused rather than normalized — a caller that
/// means `secrets/key` can say so. An encoded `%` is refused too (double encoding). Every
/// `Authorize` applies this to a `resource` argument, so Cedar policies see normalized paths.
pub(crate) fn normalized_resource(v: &str) -> Result<(), String> {
    let lowered = v.to_ascii_lowercase();
    let encoded = ["%2e", "%2f", "%5c", "%25"];
    if v.contains('\\') || encoded.iter().any(|e| lowered.contains(e)) {
        return Err(format!(
            "resource '{}' is not a normalized path (no backslashes or encoded dots and slashes)",
            v.escape_debug()
        ));
    }
    if v.split('/').any(|seg| seg == "." || seg == "..") {
        return Err(format!("resource '{}' is not a normalized path (no '.' or '..' segments)", v.escape_debug()));
    }
    Ok(())
}

/// Whether `cap` covers calling `tool` with `args`; the reason when it does not.
pub fn grants(cap: &CapabilityRow, tool: &str, args: &Value) -> Result<(), String> {
    if !cap.tool_patterns.iter().any(|p| matches(p, tool)) {
        return Err(format!("tool '{tool}' is outside {:?}", cap.tool_patterns));
    }
    for (field, patterns) in [("action", &cap.action_patterns), ("resource", &cap.resource_patterns)] {
        if patterns.is_empty() {
            continue;
        }
        let Some(v) = args.get(field).and_then(Value::as_str) else {
            return Err(format!("the call names no {field}"));
        };
        if field == "resource" {
            normalized_resource(v)?;
        }
        if !patterns.iter().any(|p| matches(p, v)) {
            return Err(format!("{field} '{v}' is outside {patterns:?}"));
        }
    }
    Ok(())
}

fn check_patterns(field: &str, patterns: &[String], required: bool) -> Result<(), Status> {
    if required && patterns.is_empty() {
        return Err(invalid_field(field, "name at least one pattern"));
    }
    if patterns.len() > 64 {
        return Err(invalid_field(field, "at most 64 patterns"));
    }
    for p in patterns {
        let body = p.strip_suffix('*').unwrap_or(p);
        let ok = p.len() <= 256 && !body.contains('*') && !p.is_empty() && p.chars().all(|c| !c.is_control());
        if !ok {
            return Err(invalid_field(field, format!("'{p}' is not a pattern (text with at most one trailing '*')")));
        }
    }
    Ok(())
}

fn to_proto(c: CapabilityRow, handle: String) -> pb::Capability {
    pb::Capability {
        capability_id: c.capability_id,
        tenant: c.tenant,
        tool_patterns: c.tool_patterns,
        action_patterns: c.action_patterns,
        resource_patterns: c.resource_patterns,
        expires_at_ms: c.expires_at_ms,
        revoked: c.revoked,
        issued_at_ms: c.issued_at_ms,
        handle,
        revoke_reason: c.revoke_reason,
        run_id: c.run_id,
    }
}

#[derive(Clone)]
pub struct CapabilitiesService {
    policy: PolicyService,
    store: PolicyStore,
    max_ttl_secs: u64,
}

impl CapabilitiesService {
    pub fn new(policy: PolicyService) -> CapabilitiesService {
        CapabilitiesService { store: policy.store().clone(), max_ttl_secs: policy.max_capability_ttl_secs(), policy }
    }

    /// A capability never carries more authority than its issuer holds. Operators and the
    /// mesh (`*` tokens, or no authentication at all) issue any scope; a tenant's own token
    /// (a person's included) only tool patterns within what its policy lets it delegate
    /// (`policy.tenants.<t>.delegable_tools`, empty by default: nothing).
    fn may_issue<T>(&self, req: &Request<T>, tenant: &str, tool_patterns: &[String]) -> Result<(), Status> {
        if warden_grpc::auth::is_mesh(req) {
            return Ok(());
        }
        let delegable = self.policy.config().tenants.get(tenant).map(|t| t.delegable_tools.clone()).unwrap_or_default();
        if let Some(p) = tool_patterns.iter().find(|p| !delegable.iter().any(|d| within(p, d))) {
            return Err(Status::permission_denied(format!(
                "tenant '{tenant}' may not delegate '{p}': its token issues capabilities only within \
                 policy.tenants.{tenant}.delegable_tools {delegable:?}; operators issue the rest"
            )));
        }
        Ok(())
    }

    /// An agent's token attaches capabilities only to its own agent's runs.
    async fn may_attach<T>(&self, req: &Request<T>, tenant: &str, run_id: &str) -> Result<(), Status> {
        let Some(agent) = warden_grpc::auth::bound_agent(req) else { return Ok(()) };
        let owner = self.policy.run_agent(tenant, run_id).await?;
        if owner != agent {
            return Err(Status::permission_denied(format!(
                "agent '{agent}' attaches capabilities only to its own runs"
            )));
        }
        Ok(())
    }

    /// The tenant's capability, or NOT_FOUND (another tenant's does not exist for the caller).
    async fn owned(&self, tenant: &str, capability_id: &str) -> Result<CapabilityRow, Status> {
        check_id(tenant).map_err(|e| invalid_field("tenant", e.to_string()))?;
        check_id(capability_id).map_err(|e| invalid_field("capability_id", e.to_string()))?;
        match self.store.capability(capability_id).await? {
            Some(c) if c.tenant == tenant => Ok(c),
            _ => Err(Status::not_found(format!("capability '{capability_id}' not found"))),
        }
    }
}

#[tonic::async_trait]
impl pb::capabilities_server::Capabilities for CapabilitiesService {
    async fn issue(&self, req: Request<pb::IssueCapabilityRequest>) -> Result<Response<pb::Capability>, Status> {
        warden_grpc::auth::check(&req, &req.get_ref().tenant)?;
        warden_grpc::auth::forbid_agent(&req, "issue capabilities")?;
        let req_scope = Request::new(());
        let req_scope = carry_scope(&req, req_scope);
        let r = req.into_inner();
        check_id(&r.tenant).map_err(|e| invalid_field("tenant", e.to_string()))?;
        check_patterns("tool_patterns", &r.tool_patterns, true)?;
        check_patterns("action_patterns", &r.action_patterns, false)?;
        check_patterns("resource_patterns", &r.resource_patterns, false)?;
        if !r.run_id.is_empty() {
            check_id(&r.run_id).map_err(|e| invalid_field("run_id", e.to_string()))?;
        }
        if r.ttl_seconds == 0 || r.ttl_seconds > self.max_ttl_secs {
            return Err(invalid_field("ttl_seconds", format!("must be from 1 to {}", self.max_ttl_secs)));
        }
        self.may_issue(&req_scope, &r.tenant, &r.tool_patterns)?;
        let mut secret = [0u8; 32];
        getrandom::getrandom(&mut secret).map_err(|e| Status::internal(format!("no randomness: {e}")))?;
        let handle = format!("{PREFIX}{}", hex::encode(secret));
        let sha = warden_core::sha256_hex(&handle);
        let now = now_ms();
        let row = CapabilityRow {
            capability_id: format!("cap-{}", &sha[..24]),
            tenant: r.tenant,
            tool_patterns: r.tool_patterns,
            action_patterns: r.action_patterns,
            resource_patterns: r.resource_patterns,
            issued_at_ms: now,
            expires_at_ms: now.saturating_add((r.ttl_seconds as i64).saturating_mul(1000)),
            revoked: false,
            revoke_reason: String::new(),
            run_id: r.run_id,
        };
        self.store.insert_capability(&row, &sha).await?;
        tracing::info!(capability_id = %row.capability_id, tenant = %row.tenant, "capability issued");
        Ok(Response::new(to_proto(row, handle)))
    }

    async fn revoke(&self, req: Request<pb::RevokeCapabilityRequest>) -> Result<Response<pb::Capability>, Status> {
        warden_grpc::auth::check(&req, &req.get_ref().tenant)?;
        warden_grpc::auth::forbid_agent(&req, "revoke capabilities")?;
        let r = req.into_inner();
        self.owned(&r.tenant, &r.capability_id).await?;
        if r.reason.is_empty() || r.reason.len() > 1024 || r.reason.contains('\0') {
            return Err(invalid_field("reason", "say why, in at most 1024 bytes"));
        }
        self.store.revoke(&r.capability_id, &r.reason).await?;
        tracing::info!(capability_id = %r.capability_id, "capability revoked");
        Ok(Response::new(to_proto(self.owned(&r.tenant, &r.capability_id).await?, String::new())))
    }

    async fn get(&self, req: Request<pb::GetCapabilityRequest>) -> Result<Response<pb::Capability>, Status> {
        warden_grpc::auth::check(&req, &req.get_ref().tenant)?;
        let r = req.into_inner();
        Ok(Response::new(to_proto(self.owned(&r.tenant, &r.capability_id).await?, String::new())))
    }

    async fn list(
        &self,
        req: Request<pb::ListCapabilitiesRequest>,
    ) -> Result<Response<pb::ListCapabilitiesResponse>, Status> {
        warden_grpc::auth::check(&req, &req.get_ref().tenant)?;
        let r = req.into_inner();
        check_id(&r.tenant).map_err(|e| invalid_field("tenant", e.to_string()))?;
        if !r.page_token.is_empty() {
            check_id(&r.page_token).map_err(|e| invalid_field("page_token", e.to_string()))?;
        }
        let size = match r.page_size {
            0 => 100,
            n if n > 1000 => return Err(invalid_field("page_size", "must be at most 1000")),
            n => n,
        };
        let rows = self.store.list(&r.tenant, &r.page_token, size).await?;
        let next_page_token = if rows.len() == size as usize {
            rows.last().map(|c| c.capability_id.clone()).unwrap_or_default()
        } else {
            String::new()
        };
        Ok(Response::new(pb::ListCapabilitiesResponse {
            capabilities: rows.into_iter().map(|c| to_proto(c, String::new())).collect(),
            next_page_token,
        }))
    }

    async fn attach(&self, req: Request<pb::AttachCapabilityRequest>) -> Result<Response<pb::Capability>, Status> {
        warden_grpc::auth::check(&req, &req.get_ref().tenant)?;
        let req_scope = carry_scope(&req, Request::new(()));
        let r = req.into_inner();
        check_id(&r.tenant).map_err(|e| invalid_field("tenant", e.to_string()))?;
        if !r.validate_only {
            check_id(&r.run_id).map_err(|e| invalid_field("run_id", e.to_string()))?;
        }
        let unknown = || invalid_field("capability_handle", "not a capability handle Warden issued");
        if !r.validate_only {
            self.may_attach(&req_scope, &r.tenant, &r.run_id).await?;
        }
        let sha = handle_sha256(&r.capability_handle).ok_or_else(unknown)?;
        let cap = self.store.by_handle(&sha).await?.ok_or_else(unknown)?;
        if cap.tenant != r.tenant {
            return Err(Status::permission_denied(format!(
                "capability {} belongs to another tenant",
                cap.capability_id
            )));
        }
        if cap.revoked {
            let why = format!("capability {} was revoked: {}", cap.capability_id, cap.revoke_reason);
            return Err(Status::failed_precondition(why));
        }
        let now = now_ms();
        if cap.expires_at_ms <= now {
            return Err(Status::failed_precondition(format!("capability {} has expired", cap.capability_id)));
        }
        if !cap.run_id.is_empty() && (r.validate_only || cap.run_id != r.run_id) {
            let why = format!("capability {} is bound to run {}", cap.capability_id, cap.run_id);
            return Err(Status::failed_precondition(why));
        }
        if !r.validate_only {
            self.store.attach(&r.tenant, &r.run_id, &cap.capability_id, now).await?;
            tracing::info!(capability_id = %cap.capability_id, run_id = %r.run_id, "capability attached");
        }
        Ok(Response::new(to_proto(cap, String::new())))
    }
}
