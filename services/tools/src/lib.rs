//! The demo tool host: `echo`, `text.upper`, `kv.put`, `kv.get`, `email.send` (appends to
//! an outbox file), `fail`, `sleep` and `flaky`. It shows what every Warden tool host must
//! do: verify the policy's signed authorization — signature, expiry, and that it names this
//! tenant, this tool, these exact canonical arguments and this idempotency key — before doing
//! anything, and return the first outcome for a repeated idempotency key instead of acting
//! twice, across restarts too.
//!
//! Idempotent replay: the first outcome of each (tenant, idempotency key) is written to a
//! SQLite file ([`ToolsConfig::state_file`]) *before* the call is answered, and every later
//! call with the key — concurrent, after a retry, or after the host restarted — gets that
//! outcome back with `replayed = true`. Concurrent calls with one key are serialized by an
//! in-memory in-flight guard that exists only while a call with the key is running, so memory
//! stays bounded by the calls in progress; the durable table answers everything else.
//! Pure tools (`echo`, `text.upper`, `fail`, `flaky`: no effect, nothing read, the answer a
//! function of the arguments and attempt) are the exception: a repeat is run again, which
//! answers it as a replay would, so their outcomes are not stored (`replayed` stays false).
//!
//! What no host can promise: a call in flight when the host dies has acted (or not) but has
//! no recorded outcome. The caller sees a broken call — an unknown outcome — and a call with
//! the key after the restart runs the tool again. The executor therefore re-invokes only
//! tools that declare `idempotent` (running again changes nothing); for the others
//! (`email.send`) it stops the run as `requires_reconciliation` for an operator to decide.

pub mod tools;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use serde_json::Value;
use tonic::service::{Routes, RoutesBuilder};
use tonic::{Request, Response, Status};
use warden_config::ToolsConfig;
use warden_core::canonical::args_digest;
use warden_core::ids::{check_id, check_step_id};
use warden_grpc::guard::Guard;
use warden_grpc::{invalid_field, now_ms};
use warden_proto::v1 as pb;
use warden_proto::v1::tool_host_server::{ToolHost, ToolHostServer};

use crate::tools::{Recorded, StateError, Tool};

/// (tenant, idempotency key).
type Key = (String, String);

/// Calls in flight by key: one async mutex per key, shared by every call holding a
/// [`Ticket`] for it. An entry is removed when its last ticket is dropped, so the map holds
/// only keys with a call in progress.
#[derive(Default)]
struct InFlight {
    by_key: Mutex<HashMap<Key, Arc<tokio::sync::Mutex<()>>>>,
}

impl InFlight {
    fn ticket(self: &Arc<Self>, key: Key) -> Ticket {
        let mut map = self.by_key.lock().unwrap_or_else(|p| p.into_inner());
        let slot = map.entry(key.clone()).or_default().clone();
        Ticket { in_flight: self.clone(), key, slot }
    }
}

/// A call's place in the queue of its key; dropping it (however the call ended) removes the
/// key's entry when no other call holds one.
struct Ticket {
    in_flight: Arc<InFlight>,
    key: Key,
    slot: Arc<tokio::sync::Mutex<()>>,
}

impl Ticket {
    /// Waits until no other call with the key runs; the turn lasts while the guard lives.
    async fn turn(&self) -> tokio::sync::MutexGuard<'_, ()> {
        self.slot.lock().await
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let mut map = self.in_flight.by_key.lock().unwrap_or_else(|p| p.into_inner());
        // Held by the map and this ticket only: no other call waits. Clones are made only
        // under the map lock, so the count cannot grow meanwhile.
        if Arc::strong_count(&self.slot) == 2 {
            map.remove(&self.key);
        }
    }
}

/// One verified call, owned so that it can run on its own task.
struct Call {
    request: pb::InvokeRequest,
    tool: Tool,
    args: Value,
    args_sha256: String,
}

impl Call {
    /// `first` answered as this call's outcome: only if it is the outcome of this very call.
    /// The authorization binds the key to one tool and argument digest, so a key met again
    /// with others means a caller reused it; replaying another call's outcome would tell it
    /// something false.
    fn replay(&self, first: Recorded) -> Result<Response<pb::InvokeResponse>, Status> {
        if first.tool != self.request.tool || first.args_sha256 != self.args_sha256 {
            return Err(Status::failed_precondition(format!(
                "idempotency key '{}' was first used for another call ({} with arguments {}); \
                 its outcome is not this call's",
                self.request.idempotency_key, first.tool, first.args_sha256
            )));
        }
        Ok(Response::new(pb::InvokeResponse { outcome: Some(first.outcome), replayed: true }))
    }
}

/// Runs `tool` for the call `r`; a tool's error is an outcome like its output.
async fn run_tool(
    state: &tools::ToolState,
    tool: tools::Tool,
    args: &Value,
    r: &pb::InvokeRequest,
) -> pb::invoke_response::Outcome {
    let ctx = tools::CallContext {
        tenant: &r.tenant,
        run_id: &r.run_id,
        step_id: &r.step_id,
        attempt: r.attempt,
        idempotency_key: &r.idempotency_key,
    };
    match tool.run(state, args, &ctx).await {
        Ok(out) => pb::invoke_response::Outcome::OutputJson(out.to_string()),
        Err(e) => pb::invoke_response::Outcome::Error(e),
    }
}

fn state_unavailable(e: StateError, what: &str) -> Status {
    tracing::warn!(error = %e, "{what}");
    Status::unavailable(format!("{what}: {e}"))
}

#[derive(Clone)]
pub struct ToolHostService {
    state: Arc<tools::ToolState>,
    /// Checks each call's authorization and acknowledgement (`warden_grpc::guard`).
    guard: Guard,
    in_flight: Arc<InFlight>,
    /// What `ListTools` declares (timeouts and output schemas as configured).
    specs: Arc<Vec<pb::ToolSpec>>,
    /// Each declared tool's declaration digest and effect class (see `auth::check_declaration`).
    declared: Arc<HashMap<String, (String, &'static str)>>,
}

impl ToolHostService {
    /// Builds the service; the state file is opened on first use (see [`Self::ready`]).
    /// Must be called within a Tokio runtime.
    pub fn new(config: &ToolsConfig) -> anyhow::Result<ToolHostService> {
        let specs = Self::declared_specs(config);
        let declared = specs
            .iter()
            .map(|s| {
                let digest = warden_grpc::catalog::declaration_sha256(s);
                (s.name.clone(), (digest, warden_grpc::catalog::effect_name(s)))
            })
            .collect();
        Ok(ToolHostService {
            specs: Arc::new(specs),
            declared: Arc::new(declared),
            state: Arc::new(tools::ToolState::new(&config.outbox_path, &config.state_file())?),
            guard: Guard::new(&config.policy_endpoint, &config.ledger_endpoint)?,
            in_flight: Default::default(),
        })
    }

    /// The demo tools as this host declares them (timeouts, output schemas and effect classes
    /// as configured).
    fn declared_specs(config: &ToolsConfig) -> Vec<pb::ToolSpec> {
        tools::specs()
            .into_iter()
            .map(|mut s| {
                if let Some(t) = config.timeout_secs.get(&s.name) {
                    s.timeout_sec = *t;
                }
                if let Some(schema) = config.output_schemas.get(&s.name) {
                    s.output_schema_json = schema.clone();
                }
                if let Some(effect) = config.effects.get(&s.name) {
                    let e = warden_grpc::catalog::effect_from_name(effect);
                    s.effect = e as i32;
                    s.consequential = e == pb::Effect::Consequential;
                    s.read_only = e == pb::Effect::ReadOnly;
                }
                s
            })
            .collect()
    }

    /// Opens the state file and creates its tables now, so a bad `state_path` stops a server
    /// at start instead of failing its first call.
    pub async fn ready(&self) -> Result<(), StateError> {
        self.state.ready().await
    }

    /// Fetches the policy's verification keys (on start).
    pub async fn refresh_keys(&self) -> Result<(), Status> {
        self.guard.refresh_policy_keys().await
    }

    /// Fetches the ledger's keys (on start).
    pub async fn refresh_ledger_keys(&self) -> Result<(), Status> {
        self.guard.refresh_ledger_keys().await
    }

    /// Both proofs every call needs before anything happens: policy allowed exactly this call
    /// (the authorization), decided for the tool as this host declares it now (class,
    /// version, schemas), and the ledger durably recorded its request citing that allow (the
    /// acknowledgement) — so no effect happens outside the record. See `warden_grpc::guard`.
    async fn verify(&self, r: &pb::InvokeRequest, args_sha256: &str) -> Result<(), Status> {
        let declared = self.declared.get(&r.tool).map(|(digest, effect)| (digest.as_str(), *effect));
        self.guard.verify(r, args_sha256, declared).await.map(|_| ())
    }

    /// Runs `call` unless its key already has an outcome, and records the outcome before
    /// answering. Calls with one key take turns, so the tool runs at most once per key here.
    async fn run_once(&self, call: Call) -> Result<Response<pb::InvokeResponse>, Status> {
        let r = &call.request;
        let ticket = self.in_flight.ticket((r.tenant.clone(), r.idempotency_key.clone()));
        let _turn = ticket.turn().await;
        // A call that held the turn before this one has recorded its outcome by now (or, in
        // doubt, left its started mark).
        let recorded = self.state.outcome(&r.tenant, &r.idempotency_key).await;
        if let Some(first) = recorded.map_err(|e| state_unavailable(e, "outcomes unreadable; nothing was done"))? {
            return call.replay(first);
        }
        // A tool that is not idempotent is marked started before it acts. A mark without an
        // outcome is a call that may have acted (this host stopped mid-call, or could not
        // record the outcome): it is in doubt, and is never run again.
        if !call.tool.idempotent() {
            let first = self
                .state
                .mark_started(&r.tenant, &r.idempotency_key, now_ms())
                .await
                .map_err(|e| state_unavailable(e, "calls unmarkable; nothing was done"))?;
            if !first {
                tracing::warn!(run_id = %r.run_id, step_id = %r.step_id, tool = %r.tool, "call in doubt");
                return Err(Status::unknown(
                    "in doubt: this call was started before and its outcome was never recorded (the host \
                     stopped mid-call); it may have acted, so it is not run again",
                ));
            }
        }
        let outcome = run_tool(&self.state, call.tool, &call.args, r).await;
        let ours = Recorded { tool: r.tool.clone(), args_sha256: call.args_sha256.clone(), outcome };
        // Unrecorded, the outcome would not be replayed: the caller must treat it as unknown
        // (UNAVAILABLE is what the executor reads so) rather than rely on it.
        let recorded = self.state.record_outcome(&r.tenant, &r.idempotency_key, &ours, now_ms()).await;
        let (first, is_ours) =
            recorded.map_err(|e| state_unavailable(e, "the call ran but its outcome could not be recorded"))?;
        if !is_ours {
            return call.replay(first);
        }
        Ok(Response::new(pb::InvokeResponse { outcome: Some(first.outcome), replayed: false }))
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
        self.verify(&r, &digest).await?;
        // A pure tool (`Tool::pure`) is simply run, in the caller's task: it acts on nothing
        // and answers as a function of its arguments and attempt, so a repeat run again is
        // answered as a replay of a recorded outcome would be, and nothing about it is worth
        // a write to the state file (nor a turn among calls of its key). A key met again with
        // other arguments is then run for those, and answered truthfully for them.
        if tool.pure() {
            let outcome = run_tool(&self.state, tool, &args, &r).await;
            return Ok(Response::new(pb::InvokeResponse { outcome: Some(outcome), replayed: false }));
        }
        let call = Call { request: r, tool, args, args_sha256: digest };
        // The recorded outcome, if any, is read once, in turn with other calls of the key.
        // On its own task: a caller that hangs up (a timeout) must not stop the tool between
        // its effect and the recording of its outcome.
        let service = self.clone();
        tokio::spawn(async move { service.run_once(call).await })
            .await
            .map_err(|e| Status::unknown(format!("the tool call broke off; its outcome is unknown: {e}")))?
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
    listener: impl Into<warden_grpc::Listeners>,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> anyhow::Result<()> {
    let service = ToolHostService::new(config)?;
    service.ready().await?;
    if let Err(e) = service.refresh_keys().await {
        tracing::warn!(error = %e, "policy keys not fetched yet; will fetch on first call");
    }
    if let Err(e) = service.refresh_ledger_keys().await {
        tracing::warn!(error = %e, "ledger keys not fetched yet; will fetch on first call");
    }
    let mut routes = Routes::builder();
    add_routes(&mut routes, service);
    warden_grpc::serve(listener, routes.routes(), SERVICES, shutdown).await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use ed25519_dalek::SigningKey;
    use serde_json::json;
    use warden_core::auth::{AuthorizationClaims, key_id, sign};
    use warden_core::canonical::canonical_json;

    use super::*;

    /// The "policy" key the tests sign with; the host trusts it as if fetched from policy.
    fn policy_key() -> SigningKey {
        SigningKey::from_bytes(&[7; 32])
    }

    /// The "ledger" key the tests acknowledge requests with.
    fn ledger_key() -> SigningKey {
        SigningKey::from_bytes(&[8; 32])
    }

    /// A host over `dir` (outbox and default state file there) trusting [`policy_key`].
    fn host(dir: &std::path::Path) -> ToolHostService {
        host_with(dir, ToolsConfig::default())
    }

    /// [`host`], configured otherwise by `config` (its outbox and policy endpoint are set).
    fn host_with(dir: &std::path::Path, config: ToolsConfig) -> ToolHostService {
        // As in `warden dev`, where the host checks what the same process signed: every
        // refusal below must hold with the memo of own signatures on (`warden_core::signature`),
        // though this process signs the forgeries too.
        warden_core::signature::remember_own_signatures();
        let config = ToolsConfig {
            outbox_path: dir.join("outbox.jsonl").display().to_string(),
            // Never contacted: the signing key is known already.
            policy_endpoint: "http://127.0.0.1:9".into(),
            ..config
        };
        let service = ToolHostService::new(&config).expect("service");
        let vk = policy_key().verifying_key();
        service.guard.policy_keys.install([(key_id(&vk), vk.as_bytes().to_vec())]);
        let lk = ledger_key().verifying_key();
        service.guard.ledger_keys.install([(key_id(&lk), lk.as_bytes().to_vec())]);
        service
    }

    /// A request for one call, authorized like the policy would.
    fn call(tenant: &str, key: &str, tool: &str, args: Value) -> pb::InvokeRequest {
        declared_call(tenant, key, tool, args, "")
    }

    /// [`call`], its authorization naming the tool declaration `tool_sha256`.
    fn declared_call(tenant: &str, key: &str, tool: &str, args: Value, tool_sha256: &str) -> pb::InvokeRequest {
        let claims = AuthorizationClaims {
            v: 1,
            key_id: String::new(),
            decision_id: "d".into(),
            tenant: tenant.into(),
            run_id: "run1".into(),
            step_id: "s1".into(),
            attempt: 1,
            tool: tool.into(),
            args_sha256: args_digest(&args),
            idempotency_key: key.into(),
            capability_id: String::new(),
            issued_at_ms: now_ms(),
            expires_at_ms: now_ms() + 60_000,
            tool_sha256: tool_sha256.into(),
            ..AuthorizationClaims::default()
        };
        let signed = sign(claims, &policy_key());
        let ack = warden_core::ack::sign_ack(
            warden_core::ack::RequestAckClaims {
                v: 1,
                kind: String::new(),
                key_id: String::new(),
                tenant: tenant.into(),
                run_id: "run1".into(),
                step_id: "s1".into(),
                attempt: 1,
                decision_id: "d".into(),
                idempotency_key: key.into(),
                seq: 3,
                event_hash: "h".into(),
            },
            &ledger_key(),
        );
        pb::InvokeRequest {
            request_ack: Some(pb::SignedAuthorization {
                claims_json: ack.claims_json,
                signature: ack.signature,
                key_id: ack.key_id,
            }),
            tenant: tenant.into(),
            run_id: "run1".into(),
            step_id: "s1".into(),
            attempt: 1,
            tool: tool.into(),
            args_json: canonical_json(&args),
            idempotency_key: key.into(),
            authorization: Some(pb::SignedAuthorization {
                claims_json: signed.claims_json,
                signature: signed.signature,
                key_id: signed.key_id,
            }),
        }
    }

    async fn invoke(host: &ToolHostService, req: pb::InvokeRequest) -> pb::InvokeResponse {
        host.invoke(Request::new(req)).await.expect("invoke").into_inner()
    }

    fn output(resp: &pb::InvokeResponse) -> Value {
        match &resp.outcome {
            Some(pb::invoke_response::Outcome::OutputJson(text)) => serde_json::from_str(text).expect("json output"),
            other => panic!("expected an output, got {other:?}"),
        }
    }

    fn outbox(dir: &std::path::Path) -> Vec<String> {
        std::fs::read_to_string(dir.join("outbox.jsonl")).unwrap_or_default().lines().map(str::to_string).collect()
    }

    /// An authorization decided for another declaration of the tool (another class, version
    /// or schema than this host declares now) is refused; one naming this host's runs.
    #[tokio::test]
    async fn a_call_decided_for_another_declaration_of_the_tool_is_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        let host = host(dir.path());
        let mail = json!({"to": "ops@example.com", "subject": "s", "body": "b"});
        let spec = host.specs.iter().find(|s| s.name == "email.send").expect("declared").clone();
        let ours = warden_grpc::catalog::declaration_sha256(&spec);
        let read_only = pb::ToolSpec { effect: pb::Effect::ReadOnly as i32, ..spec };
        let other = warden_grpc::catalog::declaration_sha256(&read_only);
        let e = host
            .invoke(Request::new(declared_call("acme", "run1:s1:1", "email.send", mail.clone(), &other)))
            .await
            .expect_err("another declaration");
        assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e:?}");
        assert!(e.message().contains("tool_sha256"), "{e:?}");
        assert!(outbox(dir.path()).is_empty());
        let ok = invoke(&host, declared_call("acme", "run1:s2:1", "email.send", mail, &ours)).await;
        assert!(!ok.replayed);
        assert_eq!(outbox(dir.path()).len(), 1);
    }

    /// A host declaring a tool consequential refuses an authorization decided under a milder
    /// class, or one naming no declaration (the policy asks for a commitment only when it
    /// knows the class): a caller cannot downgrade the tool by what it tells the policy.
    #[tokio::test]
    async fn a_consequential_tool_refuses_a_call_decided_under_a_milder_class_or_blind() {
        let dir = tempfile::tempdir().expect("tempdir");
        let effects = [("email.send".to_string(), "consequential".to_string())].into();
        let host = host_with(dir.path(), ToolsConfig { effects, ..ToolsConfig::default() });
        let mail = json!({"to": "ops@example.com", "subject": "s", "body": "b"});
        let spec = host.specs.iter().find(|s| s.name == "email.send").expect("declared").clone();
        assert_eq!(warden_grpc::catalog::effect_name(&spec), "consequential");
        let ours = warden_grpc::catalog::declaration_sha256(&spec);
        let blind = host.invoke(Request::new(call("acme", "run1:s1:1", "email.send", mail.clone()))).await;
        let e = blind.expect_err("no declaration named");
        assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e:?}");
        assert!(e.message().contains("consequential"), "{e:?}");
        // The right digest, but the class the policy was told is milder than declared.
        let mut milder = declared_call("acme", "run1:s2:1", "email.send", mail.clone(), &ours);
        let mut claims: AuthorizationClaims =
            serde_json::from_slice(&milder.authorization.as_ref().expect("auth").claims_json).expect("claims");
        claims.effect = "external".into();
        let signed = sign(claims, &policy_key());
        milder.authorization = Some(pb::SignedAuthorization {
            claims_json: signed.claims_json,
            signature: signed.signature,
            key_id: signed.key_id,
        });
        let e = host.invoke(Request::new(milder)).await.expect_err("milder class");
        assert!(e.message().contains("effect does not match"), "{e:?}");
        assert!(outbox(dir.path()).is_empty(), "no refused call sent mail");
    }

    #[tokio::test]
    async fn email_send_with_the_same_key_after_a_restart_is_replayed_and_sent_once() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mail = json!({"to": "ops@example.com", "subject": "once", "body": "b"});
        let first = invoke(&host(dir.path()), call("acme", "run1:s1:1", "email.send", mail.clone())).await;
        assert!(!first.replayed);
        assert_eq!(outbox(dir.path()).len(), 1);

        // A new host process over the same files: nothing in memory survives.
        let restarted = host(dir.path());
        let again = invoke(&restarted, call("acme", "run1:s1:1", "email.send", mail)).await;
        assert!(again.replayed, "the second answer is the recorded first one");
        assert_eq!(again.outcome, first.outcome);
        assert_eq!(outbox(dir.path()).len(), 1, "the email went out once");
        assert!(dir.path().join("tools.db").is_file(), "state kept beside the outbox by default");
    }

    /// A host that stopped between marking a call started and recording its outcome cannot
    /// know whether the e-mail went out: a repeat of that call is answered "in doubt" and
    /// sends nothing; a call never started runs.
    #[tokio::test]
    async fn a_call_started_but_never_recorded_is_in_doubt_and_not_run_again() {
        let dir = tempfile::tempdir().expect("tempdir");
        let host = host(dir.path());
        // What a host that died mid-call leaves: the mark, no outcome.
        assert!(host.state.mark_started("acme", "run1:s1:1", 1).await.expect("mark"));
        let mail = json!({"to": "ops@example.com", "subject": "s", "body": "b"});
        let e = host
            .invoke(Request::new(call("acme", "run1:s1:1", "email.send", mail.clone())))
            .await
            .expect_err("in doubt");
        assert_eq!(e.code(), tonic::Code::Unknown, "{e:?}");
        assert!(e.message().starts_with("in doubt"), "{e:?}");
        assert!(outbox(dir.path()).is_empty(), "nothing was sent again");
        let fresh = invoke(&host, call("acme", "run1:s2:1", "email.send", mail)).await;
        assert!(!fresh.replayed);
        assert_eq!(outbox(dir.path()).len(), 1, "a call never started runs");
        assert!(tools::specs().iter().all(|t| t.detects_in_doubt));
    }

    #[tokio::test]
    async fn a_signed_allow_without_the_ledgers_acknowledgement_does_nothing() {
        let dir = tempfile::tempdir().expect("tempdir");
        let host = host(dir.path());
        let mail = json!({"to": "ops@example.com", "subject": "s", "body": "b"});
        let mut unrecorded = call("acme", "run1:s1:1", "email.send", mail.clone());
        unrecorded.request_ack = None;
        let e = host.invoke(Request::new(unrecorded)).await.expect_err("no acknowledgement");
        assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e:?}");
        // An acknowledgement of another attempt, or signed by someone other than the ledger.
        let mut other = call("acme", "run1:s1:1", "email.send", mail.clone());
        let ack_of_two = {
            let mut c = call("acme", "run1:s1:1", "email.send", mail.clone());
            c.attempt = 2;
            c.request_ack
        };
        other.request_ack = ack_of_two.map(|mut a| {
            a.claims_json =
                String::from_utf8(a.claims_json).expect("utf8").replace("\"attempt\":1", "\"attempt\":2").into_bytes();
            a
        });
        assert_eq!(host.invoke(Request::new(other)).await.expect_err("tampered").code(), tonic::Code::PermissionDenied);
        let mut forged = call("acme", "run1:s1:1", "email.send", mail.clone());
        let by_policy = sign(
            AuthorizationClaims {
                v: 1,
                key_id: String::new(),
                decision_id: "d".into(),
                tenant: "acme".into(),
                run_id: "run1".into(),
                step_id: "s1".into(),
                attempt: 1,
                tool: "email.send".into(),
                args_sha256: args_digest(&mail),
                idempotency_key: "run1:s1:1".into(),
                capability_id: String::new(),
                issued_at_ms: 0,
                expires_at_ms: i64::MAX,
                ..AuthorizationClaims::default()
            },
            &policy_key(),
        );
        forged.request_ack = Some(pb::SignedAuthorization {
            claims_json: by_policy.claims_json,
            signature: by_policy.signature,
            key_id: by_policy.key_id,
        });
        assert_eq!(
            host.invoke(Request::new(forged)).await.expect_err("policy's key").code(),
            tonic::Code::PermissionDenied
        );
        assert!(outbox(dir.path()).is_empty(), "nothing was sent");
        invoke(&host, call("acme", "run1:s1:1", "email.send", mail)).await;
        assert_eq!(outbox(dir.path()).len(), 1, "the acknowledged call runs");
    }

    /// `signed` signed again without the memo of own signatures, as by another process.
    fn signed_elsewhere(signed: &mut Option<pb::SignedAuthorization>, key: &SigningKey) {
        use ed25519_dalek::Signer;
        let s = signed.as_mut().expect("signed");
        s.signature = key.sign(&s.claims_json).to_bytes().to_vec();
    }

    #[tokio::test(flavor = "current_thread")]
    async fn concurrent_calls_signed_elsewhere_are_checked_together_and_each_refused_on_its_own() {
        let dir = tempfile::tempdir().expect("tempdir");
        let host = host(dir.path());
        // Calls whose signatures this process did not make, so each is checked on the curve;
        // handled together, their signatures are checked as a batch. Every third call's
        // acknowledgement, and every fifth call's authorization, has one byte changed.
        let calls: Vec<pb::InvokeRequest> = (0..30)
            .map(|i| {
                let mut c = call("acme", &format!("run1:s1:{i}"), "echo", json!({"i": i}));
                signed_elsewhere(&mut c.authorization, &policy_key());
                signed_elsewhere(&mut c.request_ack, &ledger_key());
                c
            })
            .collect();
        // All as signed: one batch that holds.
        let answers = futures::future::join_all(calls.iter().enumerate().map(|(i, c)| {
            let host = host.clone();
            async move { host.verify(c, &args_digest(&json!({"i": i}))).await }
        }))
        .await;
        assert!(answers.iter().all(Result::is_ok), "{answers:?}");
        let answers = futures::future::join_all(calls.iter().enumerate().map(|(i, c)| {
            let mut c = c.clone();
            if i % 3 == 0
                && let Some(a) = c.request_ack.as_mut()
            {
                a.signature[10] ^= 1;
            }
            if i % 5 == 0
                && let Some(a) = c.authorization.as_mut()
            {
                a.signature[40] ^= 1;
            }
            let host = host.clone();
            async move { (i, host.verify(&c, &args_digest(&json!({"i": i}))).await) }
        }))
        .await;
        for (i, answer) in answers {
            let acked = i % 3 != 0;
            match (i % 5 == 0, acked) {
                (true, _) => {
                    let e = answer.expect_err("altered authorization");
                    assert_eq!(e.message(), "refused: authorization signature does not verify", "call {i}");
                }
                (false, false) => {
                    let e = answer.expect_err("altered acknowledgement");
                    assert!(e.message().contains("no ledger acknowledgement"), "call {i}: {e:?}");
                }
                (false, true) => answer.unwrap_or_else(|e| panic!("call {i}: {e:?}")),
            }
        }
    }

    #[tokio::test]
    async fn tenant_b_cannot_read_or_overwrite_tenant_a_kv_value() {
        let dir = tempfile::tempdir().expect("tempdir");
        let host = host(dir.path());
        let put = json!({"key": "secret", "value": "a-only"});
        invoke(&host, call("tenant-a", "a:put:1", "kv.put", put)).await;

        let read = invoke(&host, call("tenant-b", "b:get:1", "kv.get", json!({"key": "secret"}))).await;
        assert_eq!(output(&read), json!({"key": "secret", "found": false, "value": null}));
        let put_b = invoke(&host, call("tenant-b", "b:put:1", "kv.put", json!({"key": "secret", "value": "b"}))).await;
        assert_eq!(output(&put_b)["previous"], Value::Null, "B sees no previous value of A's");

        let read_a = invoke(&host, call("tenant-a", "a:get:1", "kv.get", json!({"key": "secret"}))).await;
        assert_eq!(output(&read_a)["value"], json!("a-only"), "A's value is untouched");
        // The store is durable as well.
        let restarted = super::tests::host(dir.path());
        let read_a = invoke(&restarted, call("tenant-a", "a:get:2", "kv.get", json!({"key": "secret"}))).await;
        assert_eq!(output(&read_a)["value"], json!("a-only"));
    }

    #[tokio::test]
    async fn one_key_in_two_tenants_is_two_calls() {
        let dir = tempfile::tempdir().expect("tempdir");
        let host = host(dir.path());
        let mail = json!({"to": "ops@example.com", "subject": "s", "body": "b"});
        let a = invoke(&host, call("tenant-a", "same-key", "email.send", mail.clone())).await;
        let b = invoke(&host, call("tenant-b", "same-key", "email.send", mail)).await;
        assert!(!a.replayed && !b.replayed, "B is not handed A's outcome");
        assert_ne!(output(&a)["message_id"], output(&b)["message_id"]);
        assert_eq!(outbox(dir.path()).len(), 2);
    }

    #[test]
    fn only_tools_without_a_repeatable_effect_declare_themselves_idempotent() {
        let specs = tools::specs();
        let idempotent = |name: &str| specs.iter().find(|s| s.name == name).expect("declared").idempotent;
        assert!(!idempotent("email.send"), "sending twice sends two emails");
        for name in ["echo", "text.upper", "kv.get", "kv.put", "sleep", "fail", "flaky"] {
            assert!(idempotent(name), "{name}");
        }
    }

    #[tokio::test]
    async fn concurrent_calls_with_one_key_run_the_tool_once_and_leave_no_guard_behind() {
        let dir = tempfile::tempdir().expect("tempdir");
        let host = host(dir.path());
        let mail = json!({"to": "ops@example.com", "subject": "s", "body": "b"});
        let mut calls = tokio::task::JoinSet::new();
        for _ in 0..8 {
            let (host, req) = (host.clone(), call("acme", "k1", "email.send", mail.clone()));
            calls.spawn(async move { invoke(&host, req).await });
        }
        let answers = calls.join_all().await;
        assert_eq!(answers.iter().filter(|a| !a.replayed).count(), 1, "{answers:?}");
        assert!(answers.iter().all(|a| a.outcome == answers[0].outcome));
        assert_eq!(outbox(dir.path()).len(), 1);
        assert!(host.in_flight.by_key.lock().expect("map").is_empty(), "memory is held only while calls run");
    }

    #[tokio::test]
    async fn a_key_reused_for_another_call_is_refused_not_answered_with_the_first_outcome() {
        let dir = tempfile::tempdir().expect("tempdir");
        let host = host(dir.path());
        invoke(&host, call("acme", "k1", "kv.get", json!({"key": "a"}))).await;
        let e =
            host.invoke(Request::new(call("acme", "k1", "kv.get", json!({"key": "b"})))).await.expect_err("refused");
        assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e:?}");
        let e = host.invoke(Request::new(call("acme", "k1", "sleep", json!({"ms": 0})))).await;
        assert_eq!(e.expect_err("refused").code(), tonic::Code::FailedPrecondition);
    }

    #[tokio::test]
    async fn a_tool_error_is_an_outcome_replayed_like_any_other() {
        let dir = tempfile::tempdir().expect("tempdir");
        let bad = json!({"ms": 60_001});
        let failed = invoke(&host(dir.path()), call("acme", "k1", "sleep", bad.clone())).await;
        let again = invoke(&host(dir.path()), call("acme", "k1", "sleep", bad)).await;
        assert!(
            matches!(&failed.outcome, Some(pb::invoke_response::Outcome::Error(e)) if e.code == "invalid_arguments")
        );
        assert!(again.replayed);
        assert_eq!(again.outcome, failed.outcome);
    }

    /// A pure tool is run again for a repeat, which answers it as a replay would; nothing of
    /// it is stored, so a state file another writer holds does not stop it.
    #[tokio::test]
    async fn a_pure_tool_is_run_again_for_a_repeat_and_nothing_of_it_is_stored() {
        let dir = tempfile::tempdir().expect("tempdir");
        assert!(tools::Tool::Echo.pure() && !tools::Tool::KvGet.pure() && !tools::Tool::EmailSend.pure());
        host(dir.path()).ready().await.expect("the state file's tables");
        let first = invoke(&host(dir.path()), call("acme", "k1", "echo", json!({"n": 1}))).await;
        assert_eq!(output(&first), json!({"n": 1}));
        let failed = invoke(&host(dir.path()), call("acme", "k2", "fail", json!({"message": "no"}))).await;
        assert!(matches!(&failed.outcome, Some(pb::invoke_response::Outcome::Error(e)) if e.message == "no"));
        let other = rusqlite::Connection::open(dir.path().join("tools.db")).expect("open");
        let stored: i64 = other.query_row("SELECT count(*) FROM outcomes", [], |r| r.get(0)).expect("count");
        assert_eq!(stored, 0, "a pure tool's outcome is not stored");
        // Another writer holds the state file: a pure call does not need it.
        other.execute_batch("BEGIN IMMEDIATE; INSERT INTO kv VALUES ('t', 'other', '1');").expect("hold");
        for host in [host(dir.path()), host(dir.path())] {
            let again = invoke(&host, call("acme", "k1", "echo", json!({"n": 1}))).await;
            assert_eq!(again.outcome, first.outcome);
            assert!(!again.replayed, "run again, not replayed: {again:?}");
            assert_eq!(
                invoke(&host, call("acme", "k2", "fail", json!({"message": "no"}))).await.outcome,
                failed.outcome
            );
        }
        // A non-pure call still is not answered unrecorded.
        let e = host(dir.path()).invoke(Request::new(call("acme", "k3", "kv.get", json!({"key": "a"})))).await;
        assert_eq!(
            e.expect_err("unrecorded").code(),
            tonic::Code::Unavailable,
            "a first call is not answered unrecorded"
        );
    }

    #[test]
    fn the_state_file_defaults_to_tools_db_beside_the_outbox() {
        let mut c = ToolsConfig { outbox_path: "/var/lib/warden/outbox.jsonl".into(), ..ToolsConfig::default() };
        assert_eq!(c.state_file(), std::path::PathBuf::from("/var/lib/warden/tools.db"));
        c.outbox_path = "outbox.jsonl".into();
        assert_eq!(c.state_file(), std::path::PathBuf::from("tools.db"));
        c.state_path = "/data/state.db".into();
        assert_eq!(c.state_file(), std::path::PathBuf::from("/data/state.db"));
    }
}
