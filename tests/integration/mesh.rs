//! One real run through every service, as separate processes.

use std::time::Duration;

use serde_json::json;
use warden_proto::v1 as pb;
use warden_testkit::MeshOptions;

use crate::*;

async fn hello_plan_runs_through_every_service(backend: Backend) {
    let mesh = mesh_on(backend).await;
    let run_id = submit(&mesh, "acme", HELLO).await;
    let run = settled(&mesh, "acme", &run_id).await;
    assert_eq!(run.status(), pb::RunStatus::Completed, "{}: {}\n{}", run.reason, run_id, mesh.logs());
    let outputs: std::collections::HashMap<String, Value> =
        run.steps.iter().map(|s| (s.id.clone(), serde_json::from_str(&s.output_json).unwrap_or(Value::Null))).collect();
    assert_eq!(outputs["shout"], json!({"text": "HELLO, WARDEN"}));
    assert_eq!(outputs["recall"]["value"], json!("HELLO, WARDEN"));
    let outbox = mesh.outbox();
    assert_eq!(outbox.len(), 1, "exactly one email");
    assert_eq!(outbox[0]["body"], json!("we said: HELLO, WARDEN"));

    let mut ledger = mesh.ledger();
    let evs = events(&mut ledger, "acme", &run_id).await;
    let types: Vec<&str> = evs.iter().map(|e| e.event_type.as_str()).collect();
    assert_eq!(types.first(), Some(&"run_submitted"));
    assert_eq!(types.last(), Some(&"run_completed"));
    assert_eq!(types.iter().filter(|t| **t == "tool_completed").count(), 5);
    // Dependency order: greet's completion precedes shout's request.
    let pos =
        |t: &str, step: &str| evs.iter().position(|e| e.event_type == t && e.step_id == step).expect("event present");
    assert!(pos("tool_completed", "greet") < pos("tool_requested", "shout"));
    for (i, e) in evs.iter().enumerate() {
        assert_eq!(e.seq, i as u64 + 1, "seq is contiguous");
    }
    let started = evs.iter().find(|e| e.event_type == "run_started").expect("run_started");
    assert!(started.epoch >= 1, "the executor writes under its lease epoch");
    assert!(verify(&mut ledger, "acme", &run_id).await.valid);
    let info = ledger.get_schema_info(pb::GetSchemaInfoRequest {}).await.expect("schema info").into_inner();
    assert_eq!(
        info.backend,
        match backend {
            Backend::Sqlite => "sqlite",
            Backend::Postgres => "postgres",
        }
    );
}

#[tokio::test]
async fn hello_plan_runs_through_every_service_on_sqlite() {
    hello_plan_runs_through_every_service(Backend::Sqlite).await;
}

#[tokio::test]
async fn hello_plan_runs_through_every_service_on_postgres() {
    hello_plan_runs_through_every_service(Backend::Postgres).await;
}

/// Services sharing a node may name each other by Unix domain socket (`listen_unix`,
/// `unix:` endpoints): a whole run goes through them — the mesh's services are given no other
/// address of each other — with the same authentication as over TCP: a call on a service's
/// socket without a token, or with another tenant's, is refused.
#[tokio::test]
async fn services_sharing_a_node_call_each_other_over_unix_sockets() {
    use tonic::Code;
    let (ops, acme, globex) = ("ops-token-0123456789abcdef", "acme-token-0123456789abcd", "globex-token-0123456789ab");
    let opts = MeshOptions {
        unix_sockets: true,
        auth_tokens: vec![(ops.into(), "*".into()), (acme.into(), "acme".into()), (globex.into(), "globex".into())],
        service_token: ops.into(),
        ..MeshOptions::default()
    };
    let mesh = mesh_with(Backend::Postgres, opts).await;
    let socket = mesh.dir.path().join("ledger.sock").display().to_string();
    let named = |key: &str| mesh.executors[0].env_var(key).unwrap_or_default().to_string();
    assert_eq!(named("WARDEN_EXECUTOR__LEDGER_ENDPOINT"), format!("unix:{socket}"));
    assert!(named("WARDEN_EXECUTOR__TOOL_HOSTS").contains("unix:"), "{}", named("WARDEN_EXECUTOR__TOOL_HOSTS"));

    let req = pb::SubmitRunRequest { tenant: "acme".into(), plan_json: HELLO.into(), ..Default::default() };
    let run_id = mesh.runs_as(acme).submit_run(req).await.expect("submit").into_inner().run_id;
    let run = settled(&mesh, "acme", &run_id).await;
    assert_eq!(run.status(), pb::RunStatus::Completed, "{}: {}\n{}", run.reason, run_id, mesh.logs());
    assert_eq!(mesh.outbox().len(), 1, "exactly one email");

    let endpoint = format!("unix:{socket}");
    let get = || pb::GetLedgerRunRequest { tenant: "acme".into(), run_id: run_id.clone(), with_events: false };
    let ledger = |token: &str| {
        pb::ledger_client::LedgerClient::new(warden_grpc::channel_with_token(&endpoint, token).expect("channel"))
    };
    let read = ledger(acme).get_run(get()).await.expect("the tenant reads its run over the socket");
    assert_eq!(read.into_inner().status(), pb::RunStatus::Completed);
    let bare = tonic::transport::Endpoint::from_shared(endpoint.clone()).expect("endpoint").connect_lazy();
    let nobody = pb::ledger_client::LedgerClient::new(bare).get_run(get()).await.expect_err("no token");
    assert_eq!(nobody.code(), Code::Unauthenticated, "{nobody:?}");
    let other = ledger(globex).get_run(get()).await.expect_err("another tenant's token");
    assert_eq!(other.code(), Code::PermissionDenied, "{other:?}");
    let mut ledger = ledger(ops);
    assert!(verify(&mut ledger, "acme", &run_id).await.valid);
}

#[tokio::test]
async fn direct_response_and_empty_plan_finish_without_tools() {
    let mesh = mesh_on(Backend::Sqlite).await;
    let id = submit(&mesh, "acme", r#"{"direct_response": "nothing to do", "reasoning": "trivial"}"#).await;
    let run = settled(&mesh, "acme", &id).await;
    assert_eq!((run.status(), run.direct_response.as_str()), (pb::RunStatus::Completed, "nothing to do"));
    let id = submit(&mesh, "acme", r#"{"steps": []}"#).await;
    assert_eq!(settled(&mesh, "acme", &id).await.status(), pb::RunStatus::EmptyPlan);
}

/// A run's first decision is asked for while the run is created
/// (`executor.decide_while_creating`, on by default): over a few runs submitted through the
/// mesh, first steps' decisions are recorded naming the digest of the run's recorded plan,
/// later steps' decisions name none, and every run completes with a chain that verifies.
async fn first_decisions_are_asked_for_while_runs_are_created(backend: Backend) {
    // The creation waits for the first step as long as it takes here (the default is a short
    // while, which a loaded machine may overrun: the step is then appended after, as before).
    let opts = MeshOptions { executor_extra: "first_step_wait_ms = 20000".into(), ..MeshOptions::default() };
    let mesh = mesh_with(backend, opts).await;
    let p = plan(&[("first", "echo", json!({"v": 1}), &[]), ("second", "echo", json!({"v": 2}), &["first"])]);
    let mut early = 0;
    for _ in 0..5 {
        let id = submit(&mesh, "acme", &p).await;
        let run = ended(&mesh, "acme", &id).await;
        assert_eq!(run.status(), pb::RunStatus::Completed, "{}: {id}\n{}", run.reason, mesh.logs());
        let mut ledger = mesh.ledger();
        assert!(verify(&mut ledger, "acme", &id).await.valid);
        let req = pb::GetLedgerRunRequest { tenant: "acme".into(), run_id: id.clone(), with_events: false };
        let recorded = ledger.get_run(req).await.expect("run").into_inner().plan_json;
        let digest = warden_core::canonical::sha256_hex(recorded.as_bytes());
        let evs = events(&mut ledger, "acme", &id).await;
        for e in evs.iter().filter(|e| e.event_type == "policy_decision") {
            if let Some(named) = payload(e).get("plan_sha256") {
                assert_eq!(named, &json!(digest), "the recorded plan's digest");
                assert_eq!(e.step_id, "first", "only a run's first calls are asked for early");
                early += 1;
            }
        }
        let decided: Vec<&str> =
            evs.iter().filter(|e| e.event_type == "policy_decision").map(|e| e.step_id.as_str()).collect();
        assert_eq!(decided, ["first", "second"], "one decision a step");
        // Recorded with the run: the tools it pinned, the first step's decision and request
        // follow `run_started` in the creation's commit (one timestamp, the creation's).
        let head: Vec<(&str, &str, i64)> =
            evs.iter().take(5).map(|e| (e.event_type.as_str(), e.step_id.as_str(), e.timestamp_ms)).collect();
        let at = evs[0].timestamp_ms;
        let expected = [
            ("run_submitted", "", at),
            ("run_started", "", at),
            ("tools_pinned", "", at),
            ("policy_decision", "first", at),
            ("tool_requested", "first", at),
        ];
        assert_eq!(head, expected);
    }
    assert_eq!(early, 5, "every first decision was asked for while its run was created\n{}", mesh.logs());
    // Each in its creation's commit, as the ledger counts them.
    let ledger = crate::observability::scrape(&mesh.ledger.metrics_url).await;
    let created = |first_step| {
        crate::observability::value(&ledger, "warden_ledger_runs_created_total", &[("first_step", first_step)])
    };
    assert_eq!((created("recorded"), created("refused"), created("none")), (5.0, 0.0, 0.0));
}

#[tokio::test]
async fn first_decisions_are_asked_for_while_runs_are_created_on_sqlite() {
    first_decisions_are_asked_for_while_runs_are_created(Backend::Sqlite).await;
}

#[tokio::test]
async fn first_decisions_are_asked_for_while_runs_are_created_on_postgres() {
    first_decisions_are_asked_for_while_runs_are_created(Backend::Postgres).await;
}

#[tokio::test]
async fn a_failed_step_cancels_its_dependents_and_keeps_independent_work() {
    let mesh = mesh_on(Backend::Sqlite).await;
    let p = plan(&[
        ("a", "echo", json!({"v": 1}), &[]),
        ("boom", "fail", json!({"message": "no"}), &["a"]),
        ("after", "echo", json!({"x": "{{boom.output}}"}), &["boom"]),
        ("later", "echo", json!({}), &["after"]),
        ("side", "echo", json!({"v": 2}), &[]),
    ]);
    let id = submit(&mesh, "acme", &p).await;
    let run = settled(&mesh, "acme", &id).await;
    assert_eq!(run.status(), pb::RunStatus::Failed);
    assert!(run.reason.contains("boom"), "{}", run.reason);
    let st = |id: &str| run.steps.iter().find(|s| s.id == id).expect("step").status();
    assert_eq!(st("a"), pb::StepStatus::Completed);
    assert_eq!(st("side"), pb::StepStatus::Completed);
    assert_eq!(st("boom"), pb::StepStatus::Failed);
    assert_eq!(st("after"), pb::StepStatus::Cancelled);
    assert_eq!(st("later"), pb::StepStatus::Cancelled);
}

#[tokio::test]
async fn a_resubmitted_idempotency_key_returns_the_first_run() {
    let mesh = mesh_on(Backend::Sqlite).await;
    let req = pb::SubmitRunRequest {
        tenant: "acme".into(),
        plan_json: HELLO.into(),
        idempotency_key: "order-42".into(),
        ..Default::default()
    };
    let first = mesh.runs().submit_run(req.clone()).await.expect("submit").into_inner();
    let second = mesh.runs().submit_run(req).await.expect("resubmit").into_inner();
    assert_eq!(first.run_id, second.run_id);
    assert!(!first.deduplicated && second.deduplicated);
    settled(&mesh, "acme", &first.run_id).await;
    assert_eq!(mesh.outbox().len(), 1, "the email went out once");
}

async fn k12_killing_an_executor_loses_no_run_and_repeats_no_completed_step(backend: Backend) {
    let mut opts = MeshOptions { executors: 2, ..MeshOptions::default() };
    opts.tenants[0].1.push("sleep".into());
    let mut mesh = mesh_with(backend, opts).await;
    let steps: Vec<Value> = (0..6)
        .map(|i| {
            let deps: Vec<String> = if i == 0 { vec![] } else { vec![format!("s{}", i - 1)] };
            json!({"id": format!("s{i}"), "tool": "sleep", "params": {"ms": 200}, "depends_on": deps})
        })
        .collect();
    let id = submit(&mesh, "acme", &json!({ "steps": steps }).to_string()).await;
    // Kill the executor that drives the run once its first step has completed.
    let mut ledger = mesh.ledger();
    let owner = warden_testkit::eventually(Duration::from_secs(60), || {
        let (mut l, id) = (ledger.clone(), id.clone());
        async move {
            let evs = events(&mut l, "acme", &id).await;
            evs.iter()
                .any(|e| e.event_type == "tool_completed")
                .then(|| evs.iter().find(|e| e.event_type == "run_started").map(|e| payload(e)["executor"].clone()))?
        }
    })
    .await
    .expect("first step completes");
    let idx = if owner == json!("executor-0") { 0 } else { 1 };
    mesh.executors[idx].kill();
    let run = settled(&mesh, "acme", &id).await;
    assert_eq!(run.status(), pb::RunStatus::Completed, "{}\n{}", run.reason, mesh.logs());
    let evs = events(&mut ledger, "acme", &id).await;
    for i in 0..6 {
        let done = evs.iter().filter(|e| e.event_type == "tool_completed" && e.step_id == format!("s{i}")).count();
        assert_eq!(done, 1, "step s{i} completed exactly once");
    }
    let epochs: std::collections::BTreeSet<u64> =
        evs.iter().filter(|e| e.event_type == "run_started").map(|e| e.epoch).collect();
    assert!(epochs.len() >= 2, "a second executor took over under a new epoch: {epochs:?}");
    assert!(verify(&mut ledger, "acme", &id).await.valid);
}

#[tokio::test]
async fn k12_killing_an_executor_loses_no_run_and_repeats_no_completed_step_on_sqlite() {
    k12_killing_an_executor_loses_no_run_and_repeats_no_completed_step(Backend::Sqlite).await;
}

#[tokio::test]
async fn k12_killing_an_executor_loses_no_run_and_repeats_no_completed_step_on_postgres() {
    k12_killing_an_executor_loses_no_run_and_repeats_no_completed_step(Backend::Postgres).await;
}

#[tokio::test]
async fn every_server_serves_health_and_reflection() {
    use tonic_health::pb::health_client::HealthClient;
    use tonic_health::pb::{HealthCheckRequest, health_check_response::ServingStatus};
    use tonic_reflection::pb::v1::ServerReflectionRequest;
    use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
    use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
    use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;

    let mesh = mesh_on(Backend::Sqlite).await;
    let cases = [
        (&mesh.ledger, "warden.v1.Ledger"),
        (&mesh.policy, "warden.v1.Policy"),
        (&mesh.tools, "warden.v1.ToolHost"),
        (&mesh.planner, "warden.v1.Planner"),
        (&mesh.executors[0], "warden.v1.Runs"),
    ];
    for (process, service) in cases {
        let mut health = HealthClient::new(process.channel());
        for name in ["", service] {
            let status =
                health.check(HealthCheckRequest { service: name.into() }).await.expect("health").into_inner().status();
            assert_eq!(status, ServingStatus::Serving, "{} '{name}'", process.name);
        }
        let mut reflection = ServerReflectionClient::new(process.channel());
        let request = ServerReflectionRequest {
            host: String::new(),
            message_request: Some(MessageRequest::ListServices(String::new())),
        };
        let mut responses =
            reflection.server_reflection_info(tokio_stream::iter([request])).await.expect("reflection").into_inner();
        let Some(MessageResponse::ListServicesResponse(list)) =
            responses.message().await.expect("answer").and_then(|r| r.message_response)
        else {
            panic!("{} answered no service list", process.name);
        };
        let names: Vec<String> = list.service.into_iter().map(|s| s.name).collect();
        assert!(names.iter().any(|n| n == service), "{} lists {names:?}", process.name);
    }
}

/// An unknown outcome waits for an operator: `ReconcileStep` records the outcome they
/// established (citing the call's allow and naming them), and the run goes on from there.
#[tokio::test]
async fn an_operator_reconciles_an_unknown_outcome_and_the_run_goes_on() {
    use tonic::Code;
    let mut opts = MeshOptions { tools_extra: "timeout_secs = { sleep = 1 }".into(), ..MeshOptions::default() };
    opts.tenants[0].1.push("sleep".into());
    let mesh = mesh_with(Backend::Sqlite, opts).await;
    let work = plan(&[
        ("nap", "sleep", json!({"ms": 8000}), &[]),
        ("after", "echo", json!({"slept": "{{nap.output.slept_ms}}"}), &["nap"]),
    ]);
    let id = submit(&mesh, "acme", &work).await;
    let run = settled(&mesh, "acme", &id).await;
    assert_eq!(run.status(), pb::RunStatus::RequiresReconciliation, "{}", run.reason);
    let cancel = pb::CancelRunRequest { tenant: "acme".into(), run_id: id.clone(), reason: String::new() };
    let e = mesh.runs().cancel_run(cancel).await.expect_err("reconcile first");
    assert_eq!(e.code(), Code::FailedPrecondition);

    let reconcile = |step: &str, outcome: &str, output: &str| pb::ReconcileStepRequest {
        tenant: "acme".into(),
        run_id: id.clone(),
        step_id: step.into(),
        outcome: outcome.into(),
        output_json: output.into(),
        operator: "oncall".into(),
    };
    let e = mesh.runs().reconcile_step(reconcile("nap", "maybe", "")).await.expect_err("bad outcome");
    assert_field_violation(&e, "outcome");
    let e = mesh.runs().reconcile_step(reconcile("nap", "completed", "{")).await.expect_err("bad output");
    assert_field_violation(&e, "output_json");
    let e = mesh.runs().reconcile_step(reconcile("after", "completed", "")).await.expect_err("not unknown");
    assert_eq!(e.code(), Code::FailedPrecondition);

    mesh.runs().reconcile_step(reconcile("nap", "completed", r#"{"slept_ms": 8000}"#)).await.expect("reconcile");
    let run = settled(&mesh, "acme", &id).await;
    assert_eq!(run.status(), pb::RunStatus::Completed, "{}", run.reason);
    let after = run.steps.iter().find(|s| s.id == "after").expect("after");
    assert_eq!(after.output_json, json!({"slept": 8000}).to_string(), "the reconciled output flows on");
    let evs = events(&mut mesh.ledger(), "acme", &id).await;
    let done = evs.iter().find(|e| e.event_type == "tool_completed" && e.step_id == "nap").expect("outcome");
    assert_eq!(payload(done)["reconciled_by"], json!("oncall"));
    assert!(verify(&mut mesh.ledger(), "acme", &id).await.valid);
    let e = mesh.runs().reconcile_step(reconcile("nap", "completed", "")).await.expect_err("already done");
    assert_eq!(e.code(), Code::FailedPrecondition);
}
