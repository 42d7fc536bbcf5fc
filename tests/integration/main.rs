//! Integration and conformance tests: every service a separate process, real gRPC, a real
//! Redis for leases and a real PostgreSQL (and SQLite) for the ledger.

mod agent;
mod bad_input;
mod bench;
mod branches;
mod conformance;
mod console;
mod deploy;
mod faults;
mod ledger;
mod lifecycle;
mod mcp;
mod mesh;
mod observability;
mod policy;
mod receipts;
mod scripted_model;
mod security;

use std::time::Duration;

use serde_json::Value;
use warden_grpc::auth::Ch;
use warden_proto::v1 as pb;
use warden_proto::v1::ledger_client::LedgerClient;
use warden_testkit::{Mesh, MeshOptions};

/// The two ledger backends every ledger test runs against.
#[derive(Clone, Copy, Debug)]
pub enum Backend {
    Sqlite,
    Postgres,
}

impl Backend {
    /// A fresh, empty database for one test (empty string: SQLite in the mesh's directory).
    pub async fn database_url(self) -> String {
        match self {
            Backend::Sqlite => String::new(),
            Backend::Postgres => warden_testkit::postgres().create_database().await.expect("create test database"),
        }
    }
}

/// A mesh on `backend` with Redis leases and the default tenants.
pub async fn mesh_on(backend: Backend) -> Mesh {
    mesh_with(backend, MeshOptions::default()).await
}

pub async fn mesh_with(backend: Backend, mut opts: MeshOptions) -> Mesh {
    opts.database_url = backend.database_url().await;
    // Policy state lives in its own database of the same backend.
    opts.policy_database_url = backend.database_url().await;
    if opts.redis_url.is_empty() {
        opts.redis_url = warden_testkit::redis().url.clone();
    }
    Mesh::start(opts).await.expect("start mesh")
}

/// A mesh without executors, for tests that write to the ledger or call policy and tools
/// themselves (an executor's sweeper would otherwise drive their runs).
pub async fn services_on(backend: Backend) -> Mesh {
    mesh_with(backend, MeshOptions { executors: 0, ..MeshOptions::default() }).await
}

/// A run created straight in the ledger, for tests that talk to policy and tools directly.
pub async fn bare_run(mesh: &warden_testkit::Mesh, tenant: &str) -> String {
    empty_run(&mut mesh.ledger(), tenant).await
}

/// A run created straight in the ledger (as the mesh) whose plan has these `(step, tool)`
/// steps, for tests that ask policy for decisions themselves: policy signs only calls of a
/// run's recorded plan.
pub async fn planned_run(mesh: &warden_testkit::Mesh, tenant: &str, steps: &[(&str, &str)]) -> String {
    let steps: Vec<Value> = steps.iter().map(|(id, tool)| serde_json::json!({"id": id, "tool": tool})).collect();
    let created = mesh
        .ledger()
        .create_run(pb::CreateRunRequest {
            tenant: tenant.into(),
            plan_json: serde_json::json!({ "steps": steps }).to_string(),
            ..Default::default()
        })
        .await
        .expect("create run");
    created.into_inner().run.expect("run").run_id
}

/// Records a call's `tool_requested` (as the mesh, citing `decision_id`) and returns the
/// ledger's acknowledgement, which a tool host needs besides the authorization.
#[allow(clippy::too_many_arguments)]
pub async fn acknowledged(
    mesh: &warden_testkit::Mesh,
    tenant: &str,
    run_id: &str,
    step_id: &str,
    attempt: u32,
    tool: &str,
    args: &Value,
    decision_id: &str,
) -> pb::SignedAuthorization {
    let key = format!("{run_id}:{step_id}:{attempt}");
    let appended = mesh
        .ledger()
        .append_event(pb::AppendEventRequest {
            tenant: tenant.into(),
            run_id: run_id.into(),
            epoch: 0,
            idempotency_key: format!("{key}:requested"),
            event_type: "tool_requested".into(),
            payload_json: serde_json::json!({
                "decision_id": decision_id, "attempt": attempt, "tool": tool, "args": args,
                "args_sha256": warden_core::canonical::args_digest(args), "idempotency_key": key,
            })
            .to_string(),
            step_id: step_id.into(),
        })
        .await
        .expect("record the request");
    appended.into_inner().request_ack.expect("the ledger acknowledges a recorded request")
}

/// A run with an empty plan, created through `ledger`.
pub async fn empty_run(ledger: &mut LedgerClient<Ch>, tenant: &str) -> String {
    let created = ledger
        .create_run(pb::CreateRunRequest {
            tenant: tenant.into(),
            plan_json: r#"{"steps":[]}"#.into(),
            ..Default::default()
        })
        .await
        .expect("create run");
    created.into_inner().run.expect("run").run_id
}

pub const HELLO: &str = include_str!("../../examples/hello.plan.json");

pub async fn submit(mesh: &Mesh, tenant: &str, plan: &str) -> String {
    mesh.runs()
        .submit_run(pb::SubmitRunRequest { tenant: tenant.into(), plan_json: plan.into(), ..Default::default() })
        .await
        .unwrap_or_else(|s| panic!("submit failed: {s:?}"))
        .into_inner()
        .run_id
}

/// Waits for a run to settle; the bound only guards against a hung test, it is not a
/// performance assertion.
pub async fn settled(mesh: &Mesh, tenant: &str, run_id: &str) -> pb::Run {
    let mut runs = mesh.runs();
    let run = warden_testkit::eventually(Duration::from_secs(90), || {
        let mut runs = runs.clone();
        async move {
            let run = runs
                .get_run(pb::GetRunRequest { tenant: tenant.into(), run_id: run_id.into() })
                .await
                .ok()?
                .into_inner();
            use pb::RunStatus as S;
            matches!(run.status(), S::Completed | S::Failed | S::Cancelled | S::EmptyPlan | S::RequiresReconciliation)
                .then_some(run)
        }
    })
    .await;
    let _ = &mut runs;
    run.unwrap_or_else(|| panic!("run {run_id} did not settle\n{}", mesh.logs()))
}

/// Waits for a run's end the way a client does: `Runs.WaitRun`, which the driving executor
/// answers when the run stops (its timeout only guards against a hung test).
pub async fn ended(mesh: &Mesh, tenant: &str, run_id: &str) -> pb::Run {
    let req = pb::WaitRunRequest { tenant: tenant.into(), run_id: run_id.into(), timeout_ms: 3_600_000 };
    let run = mesh.runs().wait_run(req).await.unwrap_or_else(|s| panic!("WaitRun failed: {s:?}")).into_inner();
    let done = warden_grpc::convert::status_from_proto(run.status()).is_some_and(|s| s.is_terminal());
    assert!(done, "run {run_id} stopped {:?} without ending\n{}", run.status(), mesh.logs());
    run
}

pub async fn events(ledger: &mut LedgerClient<Ch>, tenant: &str, run_id: &str) -> Vec<pb::Event> {
    let mut s = ledger
        .stream_events(pb::StreamEventsRequest {
            tenant: tenant.into(),
            run_id: run_id.into(),
            since_seq: 0,
            follow: false,
        })
        .await
        .expect("stream events")
        .into_inner();
    let mut out = Vec::new();
    while let Some(e) = s.message().await.expect("event") {
        out.push(e);
    }
    out
}

/// The first event of the run (already recorded or still to come) that `wanted` accepts,
/// read from the ledger's following stream. The timeout only guards against a hang.
pub async fn first_event(mesh: &Mesh, tenant: &str, run_id: &str, wanted: impl Fn(&pb::Event) -> bool) -> pb::Event {
    let req = pb::StreamEventsRequest { tenant: tenant.into(), run_id: run_id.into(), since_seq: 0, follow: true };
    let mut stream = mesh.ledger().stream_events(req).await.expect("stream events").into_inner();
    let found = tokio::time::timeout(Duration::from_secs(60), async {
        while let Some(e) = stream.message().await.expect("event") {
            if wanted(&e) {
                return Some(e);
            }
        }
        None
    });
    found.await.ok().flatten().unwrap_or_else(|| panic!("run {run_id} never recorded the event\n{}", mesh.logs()))
}

pub fn payload(e: &pb::Event) -> Value {
    serde_json::from_str(&e.payload_json).expect("payload is JSON")
}

pub async fn verify(ledger: &mut LedgerClient<Ch>, tenant: &str, run_id: &str) -> pb::VerifyRunResponse {
    ledger
        .verify_run(pb::VerifyRunRequest { tenant: tenant.into(), run_id: run_id.into() })
        .await
        .expect("verify")
        .into_inner()
}

/// A plan of steps given as `(id, tool, params, depends_on)`.
pub fn plan(steps: &[(&str, &str, Value, &[&str])]) -> String {
    let steps: Vec<Value> = steps
        .iter()
        .map(|(id, tool, params, deps)| serde_json::json!({"id": id, "tool": tool, "params": params, "depends_on": deps}))
        .collect();
    serde_json::json!({ "steps": steps }).to_string()
}

/// Asserts a status is INVALID_ARGUMENT with a field violation on `field`.
#[track_caller]
pub fn assert_field_violation(status: &tonic::Status, field: &str) {
    assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status:?}");
    let fields = warden_grpc::field_violations(status);
    assert!(
        fields.iter().any(|(f, _)| f == field),
        "expected a violation on '{field}', got {fields:?} ({})",
        status.message()
    );
}

/// The run's receipts (of one step, or all with `step` empty).
pub async fn receipts_of(mesh: &warden_testkit::Mesh, tenant: &str, run_id: &str, step: &str) -> Vec<pb::Receipt> {
    mesh.ledger()
        .list_receipts(pb::ListReceiptsRequest {
            tenant: tenant.into(),
            run_id: run_id.into(),
            step_id: step.into(),
            ..Default::default()
        })
        .await
        .expect("receipts")
        .into_inner()
        .receipts
}
