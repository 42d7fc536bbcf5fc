//! Caller scoping. With `[auth] tokens` configured, every call to a Warden service carries
//! `authorization: Bearer <token>`; the token maps to one tenant, to one agent of a tenant
//! (`tenant/agent`), or to `*` (operators and the mesh's own services). A caller scoped to a tenant can only name that tenant; reads
//! across tenants need `*`. With no tokens configured (the `warden dev` default) calls are
//! not authenticated and the tenant named in each request is trusted.
//!
//! Health and reflection stay open, so probes and stock tooling work without a token.

use std::collections::BTreeMap;
use std::sync::{Arc, RwLock};

use tonic::metadata::{Ascii, MetadataValue};
use tonic::service::Interceptor;
use tonic::service::interceptor::InterceptedService;
use tonic::{Request, Status};

/// A channel whose calls carry this process's bearer token (when it has one), each request
/// sent ending with its data when its body is ready (see [`crate::eager`]).
pub type Ch = InterceptedService<crate::eager::Eager<crate::inproc::Link>, Bearer>;

static CLIENT_TOKEN: RwLock<Option<String>> = RwLock::new(None);

/// Sets the token this process presents when it calls other services.
pub fn set_client_token(token: &str) {
    *CLIENT_TOKEN.write().unwrap_or_else(|p| p.into_inner()) = (!token.is_empty()).then(|| token.to_string());
}

fn client_token() -> Option<String> {
    CLIENT_TOKEN.read().unwrap_or_else(|p| p.into_inner()).clone()
}

/// Adds the bearer token, and the caller's W3C trace context (`traceparent`, `tracestate`)
/// when the process exports traces, to every request of a client: every Warden channel
/// propagates the trace.
#[derive(Clone, Default)]
pub struct Bearer(Option<MetadataValue<Ascii>>);

impl Bearer {
    pub fn new(token: Option<&str>) -> Result<Bearer, Status> {
        token
            .map(|t| {
                format!("Bearer {t}")
                    .parse::<MetadataValue<Ascii>>()
                    .map_err(|_| Status::invalid_argument("token is not valid header text"))
            })
            .transpose()
            .map(Bearer)
    }

    /// The process's own token (see [`set_client_token`]).
    pub fn process() -> Bearer {
        Bearer::new(client_token().as_deref()).unwrap_or_default()
    }
}

impl Interceptor for Bearer {
    fn call(&mut self, mut request: Request<()>) -> Result<Request<()>, Status> {
        if let Some(v) = &self.0 {
            request.metadata_mut().insert("authorization", v.clone());
        }
        warden_telemetry::context::inject(request.metadata_mut());
        Ok(request)
    }
}

/// Who is calling, as established by [`Tokens`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Scope {
    /// Every tenant (operators, the mesh's services).
    Any,
    Tenant(String),
    /// One agent of a tenant: acts for the tenant, and only as that agent.
    Agent {
        tenant: String,
        agent: String,
    },
    /// One person of a tenant (`tenant@person`): acts for the tenant, and approves as that
    /// person.
    Person {
        tenant: String,
        person: String,
    },
}

/// The server side: token → scope. Empty = authentication off.
#[derive(Clone, Default)]
pub struct Tokens(Arc<BTreeMap<String, Scope>>);

impl Tokens {
    /// From configuration: token → tenant name, `tenant/agent`, or `*`.
    pub fn new(tokens: &BTreeMap<String, String>) -> Tokens {
        let scope = |s: &String| match s.split_once('/') {
            _ if s == "*" => Scope::Any,
            Some((tenant, agent)) => Scope::Agent { tenant: tenant.into(), agent: agent.into() },
            None => match s.split_once('@') {
                Some((tenant, person)) => Scope::Person { tenant: tenant.into(), person: person.into() },
                None => Scope::Tenant(s.clone()),
            },
        };
        Tokens(Arc::new(tokens.iter().map(|(t, s)| (t.clone(), scope(s))).collect()))
    }

    pub fn enabled(&self) -> bool {
        !self.0.is_empty()
    }
}

impl Interceptor for Tokens {
    fn call(&mut self, mut request: Request<()>) -> Result<Request<()>, Status> {
        if !self.enabled() {
            return Ok(request);
        }
        let presented = request
            .metadata()
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .ok_or_else(|| Status::unauthenticated("missing 'authorization: Bearer <token>'"))?;
        let scope = self.0.get(presented).cloned().ok_or_else(|| Status::unauthenticated("unknown token"))?;
        request.extensions_mut().insert(scope);
        Ok(request)
    }
}

/// Checks that the caller may act for `tenant` (empty: across tenants, operators only).
pub fn check<T>(request: &Request<T>, tenant: &str) -> Result<(), Status> {
    let scoped = match request.extensions().get::<Scope>() {
        None | Some(Scope::Any) => return Ok(()),
        Some(Scope::Tenant(t) | Scope::Agent { tenant: t, .. } | Scope::Person { tenant: t, .. }) => t,
    };
    if tenant.is_empty() {
        return Err(Status::permission_denied("reading across tenants needs an operator token"));
    }
    if scoped != tenant {
        return Err(Status::permission_denied(format!("this token acts for tenant '{scoped}' only")));
    }
    Ok(())
}

/// Whether the caller is the mesh itself or an operator (`*`), or authentication is off.
pub fn is_mesh<T>(request: &Request<T>) -> bool {
    matches!(request.extensions().get::<Scope>(), None | Some(Scope::Any))
}

/// Only the mesh's own services and operators (`*` tokens; anyone when authentication is
/// off): for writes that record what the mesh itself decided or did.
pub fn require_mesh<T>(request: &Request<T>, what: &str) -> Result<(), Status> {
    if is_mesh(request) {
        return Ok(());
    }
    Err(Status::permission_denied(format!("{what} needs an operator or service token")))
}

/// Refuses agent-bound tokens: for acts that take a tenant's authority, not an agent's
/// (resolving approvals, issuing capabilities, reconciling outcomes).
pub fn forbid_agent<T>(request: &Request<T>, what: &str) -> Result<(), Status> {
    match request.extensions().get::<Scope>() {
        Some(Scope::Agent { agent, .. }) => {
            Err(Status::permission_denied(format!("agent '{agent}' may not {what}; it needs a tenant token")))
        }
        _ => Ok(()),
    }
}

/// Who approves: a person's token approves as that person (`named` empty or the same); an
/// operator (`*`) or an unauthenticated mesh names the approver; a plain tenant token names
/// one only when the tenant keeps no approver list (`restricted` false).
pub fn approver<T>(request: &Request<T>, named: &str, restricted: bool) -> Result<String, Status> {
    match request.extensions().get::<Scope>() {
        Some(Scope::Agent { agent, .. }) => {
            Err(Status::permission_denied(format!("agent '{agent}' may not resolve approvals")))
        }
        Some(Scope::Person { person, .. }) if named.is_empty() || named == person => Ok(person.clone()),
        Some(Scope::Person { person, .. }) => {
            Err(Status::permission_denied(format!("this token approves as '{person}' only, not '{named}'")))
        }
        Some(Scope::Tenant(_)) if restricted => Err(Status::permission_denied(
            "this tenant's approvals are resolved with an approver's own token (tenant@person)",
        )),
        _ => Ok(named.to_string()),
    }
}

/// The person a request's token is bound to, if any.
pub fn bound_person<T>(request: &Request<T>) -> Option<String> {
    match request.extensions().get::<Scope>() {
        Some(Scope::Person { person, .. }) => Some(person.clone()),
        _ => None,
    }
}

/// The agent a request's token is bound to, if any.
pub fn bound_agent<T>(request: &Request<T>) -> Option<String> {
    match request.extensions().get::<Scope>() {
        Some(Scope::Agent { agent, .. }) => Some(agent.clone()),
        _ => None,
    }
}

/// The agent a request acts as: the one its token is bound to, else the one it names
/// (`claimed`, possibly empty). A bound token naming another agent is PERMISSION_DENIED.
pub fn agent<T>(request: &Request<T>, claimed: &str) -> Result<String, Status> {
    match request.extensions().get::<Scope>() {
        Some(Scope::Agent { agent, .. }) if claimed.is_empty() || claimed == agent => Ok(agent.clone()),
        Some(Scope::Agent { agent, .. }) => {
            Err(Status::permission_denied(format!("this token acts as agent '{agent}' only, not '{claimed}'")))
        }
        _ => Ok(claimed.to_string()),
    }
}
