//! Run lifecycle (progress, summaries, checkpoints, artifacts) and SPEC-KERN-01 transactions,
//! on both backends.

use serde_json::json;
use warden_core::canonical::canonical_json;
use warden_proto::v1 as pb;

use crate::*;

async fn lifecycle(backend: Backend) {
    let mesh = mesh_on(backend).await;
    let id = submit(&mesh, "acme", HELLO).await;
    settled(&mesh, "acme", &id).await;
    let mut l = mesh.ledger();
    let progress = l
        .get_run_progress(pb::GetRunProgressRequest { tenant: "acme".into(), run_id: id.clone() })
        .await
        .expect("progress")
        .into_inner();
    assert_eq!(progress.percent, 100);
    assert_eq!(progress.completed_stages, ["greet", "shout", "remember", "recall", "notify"]);

    let run = l
        .get_run(pb::GetLedgerRunRequest { tenant: "acme".into(), run_id: id.clone(), with_events: false })
        .await
        .expect("run")
        .into_inner();
    let epoch = run.max_epoch;
    let artifact = |key: &str, value: serde_json::Value, idem: &str| pb::PutArtifactRequest {
        tenant: "acme".into(),
        run_id: id.clone(),
        epoch,
        idempotency_key: idem.into(),
        key: key.into(),
        value_json: value.to_string(),
    };
    // Summaries still land after the run ended: they record, they do not act.
    l.put_artifact(artifact("report", json!({"v": 1}), "a1")).await.expect("artifact");
    l.put_artifact(artifact("report", json!({"v": 2}), "a2")).await.expect("artifact");
    l.put_artifact(artifact("score", json!(0.93), "a3")).await.expect("artifact");
    l.put_checkpoint(pb::PutCheckpointRequest {
        tenant: "acme".into(),
        run_id: id.clone(),
        epoch,
        idempotency_key: "c1".into(),
        name: "after-notify".into(),
        payload_json: r#"{"cursor": 5}"#.into(),
    })
    .await
    .expect("checkpoint");
    let latest = l
        .list_artifacts(pb::ListArtifactsRequest { tenant: "acme".into(), run_id: id.clone(), ..Default::default() })
        .await
        .expect("artifacts")
        .into_inner()
        .artifacts;
    let latest: Vec<(String, String)> = latest.into_iter().map(|a| (a.key, a.value_json)).collect();
    assert_eq!(latest, [("report".to_string(), r#"{"v":2}"#.to_string()), ("score".to_string(), "0.93".to_string())]);
    let history = l
        .list_artifacts(pb::ListArtifactsRequest {
            tenant: "acme".into(),
            run_id: id.clone(),
            key: "report".into(),
            history: true,
        })
        .await
        .expect("history")
        .into_inner()
        .artifacts;
    assert_eq!(history.iter().map(|a| a.value_json.as_str()).collect::<Vec<_>>(), [r#"{"v":1}"#, r#"{"v":2}"#]);
    let checkpoints = l
        .list_summaries(pb::ListSummariesRequest {
            tenant: "acme".into(),
            run_id: id.clone(),
            summary_type: "checkpoint::after-notify".into(),
            limit: 0,
        })
        .await
        .expect("summaries")
        .into_inner()
        .summaries;
    assert_eq!(checkpoints.len(), 1);
    assert_eq!(checkpoints[0].payload_json, r#"{"cursor":5}"#);

    let before = l
        .get_run(pb::GetLedgerRunRequest { tenant: "acme".into(), run_id: id.clone(), with_events: false })
        .await
        .expect("run")
        .into_inner()
        .last_seq;
    let huge = json!({"blob": "x".repeat(300 * 1024)});
    let e = l.put_artifact(artifact("big", huge, "a4")).await.expect_err("oversize");
    assert_field_violation(&e, "value_json");
    let e = l.put_artifact(artifact("bad key!", json!(1), "a5")).await.expect_err("bad key");
    assert_field_violation(&e, "key");
    let after = l
        .get_run(pb::GetLedgerRunRequest { tenant: "acme".into(), run_id: id.clone(), with_events: false })
        .await
        .expect("run")
        .into_inner()
        .last_seq;
    assert_eq!(before, after, "refused artifacts wrote nothing");
    assert!(verify(&mut l, "acme", &id).await.valid, "summaries are part of the chain");
}

#[tokio::test]
async fn run_lifecycle_progress_checkpoints_and_artifacts_on_sqlite() {
    lifecycle(Backend::Sqlite).await;
}

#[tokio::test]
async fn run_lifecycle_progress_checkpoints_and_artifacts_on_postgres() {
    lifecycle(Backend::Postgres).await;
}

async fn transactions(backend: Backend) {
    let mut opts = warden_testkit::MeshOptions { executors: 0, ..Default::default() };
    opts.tenants[0].1.push("commit_tx".into());
    let mesh = mesh_with(backend, opts).await;
    let mut l = mesh.ledger();
    let run = empty_run(&mut l, "acme").await;
    // A commit needs an allow for exactly it: tool `commit_tx`, arguments {"tx_id": …,
    // "deltas_sha256": …} naming the deltas staged in it.
    let authorize_commit = |tx: &'static str, staged: String| {
        let (mut p, run) = (mesh.policy(), run.clone());
        async move {
            p.authorize(pb::AuthorizeRequest {
                tenant: "acme".into(),
                run_id: run.clone(),
                step_id: format!("commit-{tx}"),
                attempt: 1,
                tool: "commit_tx".into(),
                args_json: json!({ "tx_id": tx, "deltas_sha256": staged }).to_string(),
                capability_handle: String::new(),
                idempotency_key: format!("{run}:commit-{tx}:1"),
                epoch: 0,
                agent: String::new(),
                retry_of: String::new(),
                caller_records: false,
                base_rules_only: false,
                ..Default::default()
            })
            .await
            .expect("authorize")
            .into_inner()
            .decision
            .expect("decision")
        }
    };
    let state = |mut l: LedgerClient<Ch>| async move {
        l.get_state(pb::GetStateRequest { tenant: "acme".into(), key: "balance".into() })
            .await
            .expect("state")
            .into_inner()
    };
    let propose = |tx: &str, delta: serde_json::Value| pb::ProposeStateDeltaRequest {
        tenant: "acme".into(),
        run_id: run.clone(),
        tx_id: tx.into(),
        delta_json: delta.to_string(),
        provenance_json: r#"{"source":"test"}"#.into(),
        epoch: 0,
    };
    let commit = |tx: &str, decision: &str| pb::CommitTxRequest {
        tenant: "acme".into(),
        run_id: run.clone(),
        tx_id: tx.into(),
        decision_id: decision.into(),
        epoch: 0,
    };
    let staged = l
        .propose_state_delta(propose("tx1", json!({"set": {"balance": 10}, "expect": {"balance": 0}})))
        .await
        .expect("stage")
        .into_inner()
        .staged_sha256;
    let allow = authorize_commit("tx1", staged).await;
    assert_eq!(allow.outcome(), pb::Outcome::Allow);
    assert!(!state(l.clone()).await.found, "staged effects are not committed state");

    let before = l
        .get_run(pb::GetLedgerRunRequest { tenant: "acme".into(), run_id: run.clone(), with_events: false })
        .await
        .expect("run")
        .into_inner()
        .last_seq;
    let e = l.commit_tx(commit("tx1", "no-such-decision")).await.expect_err("no allow");
    assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e:?}");
    let after = l
        .get_run(pb::GetLedgerRunRequest { tenant: "acme".into(), run_id: run.clone(), with_events: false })
        .await
        .expect("run")
        .into_inner()
        .last_seq;
    assert_eq!(before, after, "a refused commit writes nothing");

    let done = l.commit_tx(commit("tx1", &allow.decision_id)).await.expect("commit").into_inner();
    assert_eq!(done.status, "committed");
    let receipt = done.receipt.expect("a commit yields a receipt");
    assert_eq!(
        (receipt.status.as_str(), receipt.action_type.as_str(), receipt.tx_id.as_str()),
        ("ok", "commit_tx", "tx1")
    );
    let s = state(l.clone()).await;
    assert_eq!((s.found, s.value_json.as_str(), s.version), (true, "10", 1));
    let again =
        l.commit_tx(commit("tx1", &allow.decision_id)).await.expect("a retried commit is idempotent").into_inner();
    assert_eq!(again.receipt.expect("receipt").receipt_id, receipt.receipt_id);

    let e = l
        .rollback_tx(pb::RollbackTxRequest {
            tenant: "acme".into(),
            run_id: run.clone(),
            tx_id: "tx1".into(),
            reason: "oops".into(),
            epoch: 0,
        })
        .await
        .expect_err("committed");
    assert_eq!(e.code(), tonic::Code::FailedPrecondition);

    // A stale expectation: tx2 thought the key did not exist yet.
    let staged2 = l
        .propose_state_delta(propose("tx2", json!({"set": {"balance": 20}, "expect": {"balance": 0}})))
        .await
        .expect("stage")
        .into_inner()
        .staged_sha256;
    let e = l.commit_tx(commit("tx2", &allow.decision_id)).await.expect_err("tx1's allow does not commit tx2");
    assert!(e.message().contains("not a recorded allow"), "{e:?}");
    let allow2 = authorize_commit("tx2", staged2).await;
    let e = l.commit_tx(commit("tx2", &allow2.decision_id)).await.expect_err("precondition no longer holds");
    assert!(e.message().contains("version"), "{e:?}");
    let rolled = l
        .rollback_tx(pb::RollbackTxRequest {
            tenant: "acme".into(),
            run_id: run.clone(),
            tx_id: "tx2".into(),
            reason: "stale".into(),
            epoch: 0,
        })
        .await
        .expect("rollback")
        .into_inner();
    assert_eq!(rolled.receipt.expect("receipt").status, "cancelled");
    assert_eq!(state(l.clone()).await.version, 1, "the rolled-back delta never applied");

    // Delete, then write again: versions keep counting, so tx1's old expectation (0) is stale.
    let staged4 = l
        .propose_state_delta(propose("tx4", json!({"delete": ["balance"], "expect": {"balance": 1}})))
        .await
        .expect("stage")
        .into_inner()
        .staged_sha256;
    let allow4 = authorize_commit("tx4", staged4).await;
    l.commit_tx(commit("tx4", &allow4.decision_id)).await.expect("delete");
    let gone = state(l.clone()).await;
    assert!(!gone.found);
    let staged5 = l
        .propose_state_delta(propose("tx5", json!({"set": {"balance": 1}, "expect": {"balance": 0}})))
        .await
        .expect("stage")
        .into_inner()
        .staged_sha256;
    let allow5 = authorize_commit("tx5", staged5).await;
    let e =
        l.commit_tx(commit("tx5", &allow5.decision_id)).await.expect_err("a deleted key is not a never-written key");
    assert!(e.message().contains("version 2"), "{e:?}");

    let e = l.propose_state_delta(propose("tx3", json!({"sett": {}}))).await.expect_err("bad delta");
    assert_field_violation(&e, "delta_json.sett");
    assert!(verify(&mut l, "acme", &run).await.valid);
}

#[tokio::test]
async fn transactions_stage_commit_and_roll_back_on_sqlite() {
    transactions(Backend::Sqlite).await;
}

#[tokio::test]
async fn transactions_stage_commit_and_roll_back_on_postgres() {
    transactions(Backend::Postgres).await;
}

/// The step pipeline (seed 000 §4.1): arguments resolved from an earlier step's output are
/// checked against the tool's declared input schema before policy is asked. A mismatch fails
/// the step naming the field; no decision is made, nothing is requested, nothing is sent.
#[tokio::test]
async fn resolved_arguments_that_break_the_tools_input_schema_never_reach_policy_or_the_tool() {
    let mesh = mesh_on(Backend::Sqlite).await;
    let p = plan(&[
        ("a", "echo", json!({"v": {"x": 1}}), &[]),
        ("mail", "email.send", json!({"to": "{{a.output.v}}", "subject": "s", "body": "b"}), &["a"]),
    ]);
    let id = submit(&mesh, "acme", &p).await;
    let run = settled(&mesh, "acme", &id).await;
    assert_eq!(run.status(), pb::RunStatus::Failed, "{}", run.reason);
    let evs = events(&mut mesh.ledger(), "acme", &id).await;
    let failed = evs.iter().find(|e| e.event_type == "step_failed" && e.step_id == "mail").expect("the step failed");
    let p = payload(failed);
    assert_eq!(p["kind"], json!("invalid_arguments"), "{p}");
    assert_eq!(p["field"], json!("params/to"), "{p}");
    assert!(
        !evs.iter()
            .any(|e| e.step_id == "mail" && matches!(e.event_type.as_str(), "policy_decision" | "tool_requested")),
        "policy was not asked and nothing was requested"
    );
    assert!(mesh.outbox().is_empty());
    assert!(verify(&mut mesh.ledger(), "acme", &id).await.valid);
}

/// Literal params are checked against the tool's input schema at submission: a plan that
/// cannot run is refused whole, naming the field, and nothing is recorded.
#[tokio::test]
async fn a_plan_whose_literal_params_break_the_input_schema_is_refused_at_submission() {
    let mesh = mesh_on(Backend::Sqlite).await;
    let p = plan(&[
        ("a", "echo", json!({"v": 1}), &[]),
        ("mail", "email.send", json!({"to": 5, "subject": "s", "body": "b"}), &["a"]),
    ]);
    let req = pb::SubmitRunRequest { tenant: "acme".into(), plan_json: p, ..Default::default() };
    let e = mesh.runs().submit_run(req).await.expect_err("refused");
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    assert_field_violation(&e, "steps[1].params/to");
    let runs = mesh.runs().list_runs(pb::ListRunsRequest { tenant: "acme".into(), ..Default::default() }).await;
    assert!(runs.expect("list").into_inner().runs.is_empty(), "nothing was recorded");
}

/// The step pipeline's output half (seed 000 §9, §10): an output that breaks the tool's
/// declared output schema, or matches an output rule (a leaked credential), is recorded as
/// `"[Output sanitized]"` with the reason, its digest and size; the step keeps its status and
/// its receipt, and a later step templates from the sanitized value only. No outcome on record
/// carries what was withheld.
#[tokio::test]
async fn an_output_off_its_schema_or_leaking_a_credential_is_sanitized_and_the_step_completes() {
    let opts = MeshOptions {
        tools_extra: r#"output_schemas = { echo = '{"type": "object", "required": ["message"]}' }"#.into(),
        ..MeshOptions::default()
    };
    let mesh = mesh_with(Backend::Sqlite, opts).await;
    let secret = "sk-abcdefghijklmnopqrstuvwx0123";
    let p = plan(&[
        ("fine", "echo", json!({"message": "hi"}), &[]),
        ("shapeless", "echo", json!({"note": "no message here"}), &[]),
        ("leaky", "echo", json!({"message": format!("the key is {secret}")}), &[]),
        ("after", "text.upper", json!({"text": "{{leaky.output}}"}), &["leaky"]),
    ]);
    let id = submit(&mesh, "acme", &p).await;
    let run = settled(&mesh, "acme", &id).await;
    assert_eq!(run.status(), pb::RunStatus::Completed, "{}", run.reason);
    let step = |sid: &str| run.steps.iter().find(|s| s.id == sid).expect("step").clone();
    assert_eq!(step("fine").output_json, json!({"message": "hi"}).to_string());
    for sid in ["shapeless", "leaky"] {
        assert_eq!(step(sid).status(), pb::StepStatus::Completed, "{sid}: the status is preserved");
        assert_eq!(step(sid).output_json, json!("[Output sanitized]").to_string(), "{sid}");
    }
    assert_eq!(step("after").output_json, json!({"text": "[OUTPUT SANITIZED]"}).to_string());

    let evs = events(&mut mesh.ledger(), "acme", &id).await;
    let sanitized = |sid: &str| {
        let done = evs.iter().find(|e| e.event_type == "tool_completed" && e.step_id == sid).expect("completed");
        payload(done)["sanitized"].clone()
    };
    assert_eq!(sanitized("fine"), Value::Null);
    let shapeless = sanitized("shapeless");
    assert_eq!(shapeless["rule"], "output_schema", "{shapeless}");
    assert_eq!(shapeless["field"], "output/message", "{shapeless}");
    let leaky = sanitized("leaky");
    assert_eq!(leaky["rule"], "output_rule:openai_key", "{leaky}");
    let withheld = canonical_json(&json!({"message": format!("the key is {secret}")}));
    assert_eq!(leaky["output_sha256"], json!(warden_core::canonical::sha256_hex(withheld.as_bytes())));
    assert_eq!(leaky["output_bytes"], json!(withheld.len()));
    let outcomes = evs.iter().filter(|e| e.event_type == "tool_completed");
    assert!(outcomes.clone().count() == 4 && outcomes.clone().all(|e| !e.payload_json.contains(secret)));
    let receipts = receipts_of(&mesh, "acme", &id, "").await;
    assert_eq!(receipts.iter().filter(|r| r.status == "ok").count(), 4, "one ok receipt per call");
    assert!(verify(&mut mesh.ledger(), "acme", &id).await.valid);

    // A tool's error message goes through the rules too: the failure is recorded, its secret
    // is not.
    let p = plan(&[("oops", "fail", json!({"message": format!("auth failed for {secret}")}), &[])]);
    let id = submit(&mesh, "acme", &p).await;
    let run = settled(&mesh, "acme", &id).await;
    let oops = run.steps.iter().find(|s| s.id == "oops").expect("oops");
    assert_eq!((oops.status(), oops.error.as_str()), (pb::StepStatus::Failed, "[Output sanitized]"));
    let evs = events(&mut mesh.ledger(), "acme", &id).await;
    let failed = evs.iter().find(|e| e.event_type == "tool_failed").expect("tool_failed");
    assert_eq!(payload(failed)["sanitized"]["rule"], "output_rule:openai_key");
    let outcomes = evs.iter().filter(|e| matches!(e.event_type.as_str(), "tool_failed" | "run_failed"));
    assert!(
        outcomes.clone().count() == 2 && outcomes.clone().all(|e| !e.payload_json.contains(secret)),
        "no outcome carries it"
    );
}

/// `Runs.PauseRun` / `ResumeRun`: a pause lets the step in flight settle and starts nothing
/// new; the run is then `paused`, `WaitRun` answers it, and no executor holds it (the sweeper
/// leaves it alone); a resume makes it pending and it goes on from where it stopped, never
/// repeating the settled step. Pausing a paused run changes nothing; resuming a run that is
/// not paused, or pausing an ended one, is FAILED_PRECONDITION; another tenant's run is
/// NOT_FOUND, another agent's run PERMISSION_DENIED; a paused run can be cancelled.
async fn pause_and_resume(backend: Backend) {
    use tonic::Code;
    let (ops, owner, other) =
        ("ops-token-0123456789abcdef", "owner-token-0123456789abcd", "other-token-0123456789abcd");
    let mut opts = MeshOptions {
        auth_tokens: vec![
            (ops.into(), "*".into()),
            (owner.into(), "acme/owner".into()),
            (other.into(), "acme/other".into()),
            ("globex-token-0123456789abc".into(), "globex".into()),
        ],
        service_token: ops.into(),
        ..MeshOptions::default()
    };
    opts.tenants[0].1.push("sleep".into());
    let mesh = mesh_with(backend, opts).await;
    let work = plan(&[
        ("nap", "sleep", json!({"ms": 1500}), &[]),
        ("next", "echo", json!({"n": 1}), &["nap"]),
        ("last", "text.upper", json!({"text": "n={{next.output.n}}"}), &["next"]),
    ]);
    let req = pb::SubmitRunRequest { tenant: "acme".into(), plan_json: work, ..Default::default() };
    let id = mesh.runs_as(owner).submit_run(req).await.expect("submit").into_inner().run_id;
    first_event(&mesh, "acme", &id, |e| e.event_type == "tool_requested" && e.step_id == "nap").await;

    let pause = |token: &'static str, tenant: &str, run_id: &str| {
        let req = pb::PauseRunRequest { tenant: tenant.into(), run_id: run_id.into(), reason: "hold on".into() };
        let mut runs = mesh.runs_as(token);
        async move { runs.pause_run(req).await.map(|r| r.into_inner().status()) }
    };
    let resume = |token: &'static str, run_id: &str| {
        let req = pb::ResumeRunRequest { tenant: "acme".into(), run_id: run_id.into(), reason: "go".into() };
        let mut runs = mesh.runs_as(token);
        async move { runs.resume_run(req).await.map(|r| r.into_inner().status()) }
    };
    // Who may not.
    assert_eq!(pause(other, "acme", &id).await.expect_err("another agent").code(), Code::PermissionDenied);
    assert_eq!(
        pause("globex-token-0123456789abc", "acme", &id).await.expect_err("another tenant").code(),
        Code::PermissionDenied
    );
    assert_eq!(pause(ops, "globex", &id).await.expect_err("not globex's run").code(), Code::NotFound);
    let bad = pause(ops, "acme", "").await.expect_err("no run id");
    assert_field_violation(&bad, "run_id");
    assert_eq!(resume(owner, &id).await.expect_err("not paused").code(), Code::FailedPrecondition);

    assert_eq!(pause(owner, "acme", &id).await.expect("pause"), pb::RunStatus::Active);
    let wait = pb::WaitRunRequest { tenant: "acme".into(), run_id: id.clone(), timeout_ms: 60_000 };
    let paused = mesh.runs().wait_run(wait.clone()).await.expect("wait").into_inner();
    assert_eq!(paused.status(), pb::RunStatus::Paused, "{}", paused.reason);
    assert_eq!(paused.reason, "paused: hold on");
    let step = |run: &pb::Run, sid: &str| run.steps.iter().find(|s| s.id == sid).expect("step").status();
    assert_eq!(step(&paused, "nap"), pb::StepStatus::Completed, "the step in flight settled");
    assert_eq!(step(&paused, "next"), pb::StepStatus::Pending, "nothing new started");
    assert_eq!(pause(owner, "acme", &id).await.expect("again"), pb::RunStatus::Paused, "pausing twice changes nothing");
    // Nobody drives it: a few sweeps later it is still paused, with nothing more recorded.
    let before = events(&mut mesh.ledger(), "acme", &id).await.len();
    tokio::time::sleep(std::time::Duration::from_millis(1_500)).await;
    let still = mesh.runs().get_run(pb::GetRunRequest { tenant: "acme".into(), run_id: id.clone() }).await;
    assert_eq!(still.expect("get").into_inner().status(), pb::RunStatus::Paused);
    assert_eq!(events(&mut mesh.ledger(), "acme", &id).await.len(), before, "a paused run records nothing");

    assert_eq!(resume(other, &id).await.expect_err("another agent").code(), Code::PermissionDenied);
    assert_eq!(resume(owner, &id).await.expect("resume"), pb::RunStatus::Pending);
    let done = settled(&mesh, "acme", &id).await;
    assert_eq!(done.status(), pb::RunStatus::Completed, "{}", done.reason);
    assert_eq!(
        done.steps.iter().find(|s| s.id == "last").expect("last").output_json,
        json!({"text": "N=1"}).to_string()
    );
    let evs = events(&mut mesh.ledger(), "acme", &id).await;
    let count = |t: &str| evs.iter().filter(|e| e.event_type == t).count();
    assert_eq!((count("run_pause_requested"), count("run_paused"), count("run_resumed")), (1, 1, 1));
    let nap_calls = evs.iter().filter(|e| e.event_type == "tool_requested" && e.step_id == "nap").count();
    assert_eq!(nap_calls, 1, "the settled step was not run again");
    assert!(verify(&mut mesh.ledger(), "acme", &id).await.valid);
    assert_eq!(pause(owner, "acme", &id).await.expect_err("ended").code(), Code::FailedPrecondition);

    // A paused run can be cancelled.
    let work = plan(&[("nap", "sleep", json!({"ms": 500}), &[]), ("next", "echo", json!({}), &["nap"])]);
    let req = pb::SubmitRunRequest { tenant: "acme".into(), plan_json: work, ..Default::default() };
    let id = mesh.runs().submit_run(req).await.expect("submit").into_inner().run_id;
    pause(ops, "acme", &id).await.expect("pause");
    let wait = pb::WaitRunRequest { tenant: "acme".into(), run_id: id.clone(), timeout_ms: 60_000 };
    assert_eq!(mesh.runs().wait_run(wait).await.expect("wait").into_inner().status(), pb::RunStatus::Paused);
    let cancel = pb::CancelRunRequest { tenant: "acme".into(), run_id: id.clone(), reason: "never mind".into() };
    assert_eq!(mesh.runs().cancel_run(cancel).await.expect("cancel").into_inner().status(), pb::RunStatus::Paused);
    let run = settled(&mesh, "acme", &id).await;
    assert_eq!(run.status(), pb::RunStatus::Cancelled, "{}", run.reason);
    assert!(verify(&mut mesh.ledger(), "acme", &id).await.valid);
}

#[tokio::test]
async fn a_paused_run_settles_what_runs_holds_no_executor_and_goes_on_when_resumed_on_sqlite() {
    pause_and_resume(Backend::Sqlite).await;
}

#[tokio::test]
async fn a_paused_run_settles_what_runs_holds_no_executor_and_goes_on_when_resumed_on_postgres() {
    pause_and_resume(Backend::Postgres).await;
}

/// Outputs over `executor.inline_output_max_bytes` are stored by reference: the step's
/// `tool_completed` cites the SHA-256 and size of the output's canonical JSON instead of
/// carrying it (the chain commits to the digest), `GetRun` names the digest, `GetStepOutput`
/// reads the output back, and a driver that did not run the step (here: after a pause and a
/// resume) reads it from the ledger to resolve a later step's template. Only the mesh stores
/// outputs; only the run's tenant reads them.
async fn large_outputs(backend: Backend) {
    use tonic::Code;
    let (ops, acme, globex) = ("ops-token-0123456789abcdef", "acme-token-0123456789abcd", "globex-token-0123456789ab");
    let mut opts = MeshOptions {
        executor_extra: "inline_output_max_bytes = 2048".into(),
        auth_tokens: vec![(ops.into(), "*".into()), (acme.into(), "acme".into()), (globex.into(), "globex".into())],
        service_token: ops.into(),
        ..MeshOptions::default()
    };
    opts.tenants[0].1.push("sleep".into());
    let mesh = mesh_with(backend, opts).await;
    let big = "word ".repeat(1600);
    let p = plan(&[
        ("big", "echo", json!({"message": big}), &[]),
        ("nap", "sleep", json!({"ms": 800}), &["big"]),
        ("shout", "text.upper", json!({"text": "{{big.output.message}}"}), &["nap"]),
    ]);
    let req = pb::SubmitRunRequest { tenant: "acme".into(), plan_json: p, ..Default::default() };
    let id = mesh.runs_as(acme).submit_run(req).await.expect("submit").into_inner().run_id;
    first_event(&mesh, "acme", &id, |e| e.event_type == "tool_requested" && e.step_id == "nap").await;
    let pause = pb::PauseRunRequest { tenant: "acme".into(), run_id: id.clone(), reason: String::new() };
    mesh.runs_as(acme).pause_run(pause).await.expect("pause");
    let wait = pb::WaitRunRequest { tenant: "acme".into(), run_id: id.clone(), timeout_ms: 60_000 };
    assert_eq!(mesh.runs().wait_run(wait).await.expect("wait").into_inner().status(), pb::RunStatus::Paused);
    let resume = pb::ResumeRunRequest { tenant: "acme".into(), run_id: id.clone(), reason: String::new() };
    mesh.runs_as(acme).resume_run(resume).await.expect("resume");
    let run = settled(&mesh, "acme", &id).await;
    assert_eq!(run.status(), pb::RunStatus::Completed, "{}", run.reason);

    let stored = canonical_json(&json!({"message": big}));
    let sha256 = warden_core::canonical::sha256_hex(stored.as_bytes());
    let step = |sid: &str| run.steps.iter().find(|s| s.id == sid).expect("step").clone();
    let big_step = step("big");
    assert_eq!((big_step.output_json.as_str(), big_step.output_sha256.as_str()), ("", sha256.as_str()));
    assert_eq!(big_step.output_bytes, stored.len() as u64);
    assert!(step("shout").output_json.is_empty() && !step("shout").output_sha256.is_empty(), "stored too");

    let evs = events(&mut mesh.ledger(), "acme", &id).await;
    let done = evs.iter().find(|e| e.event_type == "tool_completed" && e.step_id == "big").expect("completed");
    let p = payload(done);
    assert_eq!(p["output_ref"], json!({"sha256": sha256, "bytes": stored.len()}), "{p}");
    assert!(p.get("output").is_none() && done.payload_json.len() < 2048, "the event stays small");
    assert!(verify(&mut mesh.ledger(), "acme", &id).await.valid);

    let output = |token: &'static str, tenant: &str, sid: &str| {
        let req = pb::GetStepOutputRequest { tenant: tenant.into(), run_id: id.clone(), step_id: sid.into() };
        let mut runs = mesh.runs_as(token);
        async move { runs.get_step_output(req).await.map(|r| r.into_inner()) }
    };
    let read = output(acme, "acme", "big").await.expect("read back");
    assert!(read.output_json == stored && read.output_sha256 == sha256, "the stored output, whole");
    let shout = output(acme, "acme", "shout").await.expect("read back");
    let shouted = canonical_json(&json!({"text": big.to_uppercase()}));
    assert!(shout.output_json == shouted, "templated from the stored output after the resume");
    let nap = output(acme, "acme", "nap").await.expect("inline");
    assert_eq!((nap.output_json.as_str(), nap.output_sha256.as_str()), (r#"{"slept_ms":800}"#, ""));
    assert_eq!(output(acme, "acme", "nope").await.expect_err("no such step").code(), Code::NotFound);
    assert_eq!(output(globex, "globex", "big").await.expect_err("another tenant").code(), Code::NotFound);

    let get = |tenant: &str, sha: &str| pb::GetOutputRequest {
        tenant: tenant.into(),
        run_id: id.clone(),
        sha256: sha.into(),
    };
    let e = mesh.ledger_as(globex).get_output(get("globex", &sha256)).await.expect_err("another tenant");
    assert_eq!(e.code(), Code::NotFound);
    let e = mesh.ledger_as(globex).get_output(get("acme", &sha256)).await.expect_err("acme's, with globex's token");
    assert_eq!(e.code(), Code::PermissionDenied);
    let e = mesh.ledger_as(acme).get_output(get("acme", "not-a-digest")).await.expect_err("bad digest");
    assert_field_violation(&e, "sha256");
    let ours = mesh.ledger_as(acme).get_output(get("acme", &sha256)).await.expect("the tenant reads it");
    assert!(ours.into_inner().output_json == stored);
    let put = pb::PutOutputRequest { tenant: "acme".into(), run_id: id.clone(), epoch: 99, output_json: "{}".into() };
    let e = mesh.ledger_as(acme).put_output(put).await.expect_err("only the mesh stores outputs");
    assert_eq!(e.code(), Code::PermissionDenied);
}

#[tokio::test]
async fn outputs_over_the_inline_limit_are_stored_by_reference_on_sqlite() {
    large_outputs(Backend::Sqlite).await;
}

#[tokio::test]
async fn outputs_over_the_inline_limit_are_stored_by_reference_on_postgres() {
    large_outputs(Backend::Postgres).await;
}

/// `WaitRun` answers a run driven on the replica it asks from what the run's driver recorded
/// (no read of the log back), and that answer is `GetRun`'s, read from the ledger, as of the
/// run's end: for a run that completes (with a nested output), one that fails, one denied by
/// policy. A run another writer appended to meanwhile (a cancellation) is answered from the
/// ledger's log. Counted by `warden_wait_answers_total`. (A run whose driver lost track — a
/// decision the policy recorded before the executor's copy arrived, on a loaded machine — is
/// answered from the log: so the count asks for at least one answer from a driver, not three.)
async fn wait_answers(backend: Backend) {
    let mut opts = MeshOptions::default();
    opts.tenants[0].1.push("sleep".into());
    let mesh = mesh_with(backend, opts).await;
    let answers = |scrape: &prometheus_parse::Scrape, source: &str| {
        crate::observability::value(scrape, "warden_wait_answers_total", &[("source", source)])
    };
    let before = crate::observability::scrape(&mesh.executors[0].metrics_url).await;
    // Each run's first step outlasts the time its WaitRun takes to arrive.
    let nap = || -> (&str, &str, serde_json::Value, &[&str]) { ("nap", "sleep", json!({"ms": 2000}), &[]) };
    let plans = [
        plan(&[nap(), ("out", "echo", json!({"z": 1.5, "a": {"y": [1, 2.0e0], "b": "x"}, "n": 10}), &["nap"])]),
        plan(&[nap(), ("no", "fail", json!({"message": "not today"}), &["nap"])]),
        plan(&[nap(), ("off", "flaky", json!({"succeed_on_attempt": 1}), &["nap"])]),
    ];
    let mut ids = Vec::new();
    for p in &plans {
        ids.push(submit(&mesh, "acme", p).await);
    }
    let cancelled = submit(&mesh, "acme", &plan(&[nap(), ("after", "echo", json!({}), &["nap"])])).await;
    let wait = |id: &str| {
        let req = pb::WaitRunRequest { tenant: "acme".into(), run_id: id.into(), timeout_ms: 120_000 };
        let mut runs = mesh.runs();
        async move { runs.wait_run(req).await.expect("wait").into_inner() }
    };
    let waits: Vec<_> = ids.iter().chain([&cancelled]).map(|id| tokio::spawn(wait(id))).collect();
    let cancel = pb::CancelRunRequest { tenant: "acme".into(), run_id: cancelled.clone(), reason: "stop".into() };
    mesh.runs().cancel_run(cancel).await.expect("cancel");
    let mut waited = Vec::new();
    for w in waits {
        waited.push(w.await.expect("waiter"));
    }
    let statuses: Vec<pb::RunStatus> = waited.iter().map(pb::Run::status).collect();
    use pb::RunStatus as S;
    assert_eq!(statuses, [S::Completed, S::Failed, S::Failed, S::Cancelled], "{}", mesh.logs());
    let after = crate::observability::scrape(&mesh.executors[0].metrics_url).await;
    let from_driver = answers(&after, "driver") - answers(&before, "driver");
    let from_ledger = answers(&after, "ledger") - answers(&before, "ledger");
    assert!(from_driver >= 1.0 && from_ledger >= 1.0, "driver {from_driver}, ledger {from_ledger}\n{}", mesh.logs());
    assert_eq!(from_driver + from_ledger, 4.0);

    for (id, from_wait) in ids.iter().chain([&cancelled]).zip(waited) {
        let get = pb::GetRunRequest { tenant: "acme".into(), run_id: id.clone() };
        let read = mesh.runs().get_run(get).await.expect("get").into_inner();
        // The policy may record a decision late (never anything that changes the answer but
        // the log's length); the answer is the run as of its end.
        // Only a late decision record or a summary can follow a run's end; the answer's
        // `last_seq` and `updated_at_ms` are its last event's.
        let log = events(&mut mesh.ledger(), "acme", id).await;
        let end = log.iter().find(|e| e.seq == from_wait.last_seq).expect("the answer's last event");
        assert_eq!(end.timestamp_ms, from_wait.updated_at_ms);
        assert!(
            log.iter()
                .filter(|e| e.seq > end.seq)
                .all(|e| warden_core::events::AFTER_END.contains(&e.event_type.as_str()))
        );
        assert_eq!(read.last_seq, log.last().expect("events").seq);
        let as_of_end = pb::Run { last_seq: from_wait.last_seq, updated_at_ms: from_wait.updated_at_ms, ..read };
        assert_eq!(from_wait, as_of_end);
    }
    let out = &waited_output(&mesh, &ids[0]).await;
    assert_eq!(out, &json!({"a": {"b": "x", "y": [1, 2]}, "n": 10, "z": 1.5}).to_string());
}

/// The output of a run's `out` step, as `GetRun` answers it.
async fn waited_output(mesh: &Mesh, id: &str) -> String {
    let get = pb::GetRunRequest { tenant: "acme".into(), run_id: id.into() };
    let run = mesh.runs().get_run(get).await.expect("get").into_inner();
    run.steps.into_iter().find(|s| s.id == "out").expect("out").output_json
}

#[tokio::test]
async fn wait_run_answers_from_the_driver_what_get_run_reads_from_the_log_on_sqlite() {
    wait_answers(Backend::Sqlite).await;
}

#[tokio::test]
async fn wait_run_answers_from_the_driver_what_get_run_reads_from_the_log_on_postgres() {
    wait_answers(Backend::Postgres).await;
}
