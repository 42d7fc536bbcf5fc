//! Authority holes an adversarial review found, each pinned by a test named for what it
//! proves: who may issue capabilities, record cost and create runs; what a capability, an
//! approval and an authorization cover; how runs waiting on approvals move on; and which
//! numbers the boundary refuses.

use std::time::Duration;

use serde_json::{Value, json};
use tonic::Code;
use warden_proto::v1 as pb;
use warden_proto::v1::approvals_client::ApprovalsClient;
use warden_proto::v1::capabilities_client::CapabilitiesClient;
use warden_proto::v1::policy_client::PolicyClient;
use warden_testkit::{Mesh, MeshOptions};

use crate::*;

const OPS: &str = "ops-token-0123456789abcdef";
const ACME: &str = "acme-token-0123456789abcdef";
const GLOBEX: &str = "globex-token-0123456789abcdef";
const MAILER: &str = "mailer-token-0123456789abcdef";
const INTERN: &str = "intern-token-0123456789abcdef";

/// A mesh with authentication on: operators, two tenants and two agents of acme.
fn with_tokens(opts: MeshOptions) -> MeshOptions {
    let mut opts = MeshOptions {
        auth_tokens: vec![
            (OPS.into(), "*".into()),
            (ACME.into(), "acme".into()),
            (GLOBEX.into(), "globex".into()),
            (MAILER.into(), "acme/mailer".into()),
            (INTERN.into(), "acme/intern".into()),
        ],
        service_token: OPS.into(),
        ..opts
    };
    if !opts.tenants.iter().any(|(t, _)| t == "globex") {
        opts.tenants.push(("globex".into(), vec!["echo".into()]));
    }
    opts
}

fn caps_as(mesh: &Mesh, token: &str) -> CapabilitiesClient<warden_grpc::auth::Ch> {
    CapabilitiesClient::new(mesh.policy.channel_as(token))
}

fn policy_as(mesh: &Mesh, token: &str) -> PolicyClient<warden_grpc::auth::Ch> {
    PolicyClient::new(mesh.policy.channel_as(token))
}

fn issue(tenant: &str, tools: &[&str]) -> pb::IssueCapabilityRequest {
    pb::IssueCapabilityRequest {
        tenant: tenant.into(),
        tool_patterns: tools.iter().map(|t| t.to_string()).collect(),
        ttl_seconds: 600,
        ..Default::default()
    }
}

fn call(tenant: &str, run: &str, step: &str, tool: &str, args: Value) -> pb::AuthorizeRequest {
    pb::AuthorizeRequest {
        tenant: tenant.into(),
        run_id: run.into(),
        step_id: step.into(),
        attempt: 1,
        tool: tool.into(),
        args_json: args.to_string(),
        idempotency_key: format!("{run}:{step}:1"),
        ..Default::default()
    }
}

fn outcome(r: &pb::AuthorizeResponse) -> (pb::Outcome, String) {
    let d = r.decision.clone().expect("decision");
    (d.outcome(), d.rule_id)
}

fn code<T>(r: Result<T, tonic::Status>) -> Code {
    match r {
        Ok(_) => Code::Ok,
        Err(s) => s.code(),
    }
}

/// High 1: a capability never carries more authority than its issuer holds. Operators issue
/// any scope; a tenant's own token only within `delegable_tools`; by default nothing.
#[tokio::test]
async fn a_tenant_token_issues_capabilities_only_within_what_it_may_delegate() {
    let opts = with_tokens(MeshOptions {
        executors: 0,
        tenant_extra: vec![("acme".into(), "delegable_tools = [\"kv.*\"]".into())],
        ..MeshOptions::default()
    });
    let mesh = mesh_with(Backend::Sqlite, opts).await;
    let mut acme = caps_as(&mesh, ACME);
    assert_eq!(code(acme.issue(issue("acme", &["*"])).await), Code::PermissionDenied, "a tenant minting '*'");
    assert_eq!(code(acme.issue(issue("acme", &["sleep"])).await), Code::PermissionDenied, "outside delegable");
    assert_eq!(code(acme.issue(issue("acme", &["kv*"])).await), Code::PermissionDenied, "wider than kv.*");
    assert_eq!(code(acme.issue(issue("acme", &["kv.put", "sleep"])).await), Code::PermissionDenied, "one too many");
    acme.issue(issue("acme", &["kv.put"])).await.expect("within kv.*");
    acme.issue(issue("acme", &["kv.*"])).await.expect("all of kv.*");
    let mut globex = caps_as(&mesh, GLOBEX);
    assert_eq!(code(globex.issue(issue("globex", &["echo"])).await), Code::PermissionDenied, "delegates nothing");
    let mut ops = caps_as(&mesh, OPS);
    ops.issue(issue("globex", &["*"])).await.expect("operators issue any scope");
    let listed = ops
        .list(pb::ListCapabilitiesRequest { tenant: "acme".into(), ..Default::default() })
        .await
        .expect("list")
        .into_inner();
    assert_eq!(listed.capabilities.len(), 2, "refused issues wrote nothing");
}

/// High 2 and Low 11: cost is the mesh's own record. No tenant or agent token records it —
/// not on another tenant's run (exhausting its budget), not 0 on its own steps ahead of time
/// (evading it) — and the mesh records it once per step attempt.
#[tokio::test]
async fn cost_is_recorded_by_the_mesh_only_and_once_per_attempt() {
    let opts = with_tokens(MeshOptions {
        executors: 0,
        budget_rules: vec![("acme".into(), 0, 3.0)],
        ..MeshOptions::default()
    });
    let mesh = mesh_with(Backend::Sqlite, opts).await;
    let run = planned_run(&mesh, "acme", &[("a", "echo"), ("b", "echo")]).await;
    let cost = |tenant: &str, attempt: u32, cost: f64| pb::RecordCostRequest {
        tenant: tenant.into(),
        run_id: run.clone(),
        step_id: "a".into(),
        cost,
        attempt,
    };
    for token in [ACME, MAILER, INTERN] {
        let r = policy_as(&mesh, token).record_cost(cost("acme", 1, 0.0)).await;
        assert_eq!(code(r), Code::PermissionDenied, "{token} pre-recording cost");
    }
    let r = policy_as(&mesh, GLOBEX).record_cost(cost("acme", 1, 1e12)).await;
    assert_eq!(code(r), Code::PermissionDenied, "another tenant's run");
    let mut ops = policy_as(&mesh, OPS);
    let e = ops.record_cost(cost("acme", 0, 1.0)).await.expect_err("attempt 0");
    assert_field_violation(&e, "attempt");
    let e = ops.record_cost(cost("acme", 1, 1e12)).await.expect_err("absurd cost");
    assert_field_violation(&e, "cost");
    ops.record_cost(cost("acme", 1, 2.0)).await.expect("first record");
    ops.record_cost(cost("acme", 1, 2.0)).await.expect("the same attempt again changes nothing");
    let d = ops.authorize(call("acme", &run, "b", "echo", json!({}))).await.expect("decide").into_inner();
    assert_eq!(outcome(&d).0, pb::Outcome::Allow, "2.0 of 3.0 spent: {d:?}");
    ops.record_cost(cost("acme", 2, 2.0)).await.expect("a second attempt costs again");
    let mut next = call("acme", &run, "b", "echo", json!({}));
    next.idempotency_key = format!("{run}:b:again");
    let d = ops.authorize(next).await.expect("decide").into_inner();
    assert_eq!(outcome(&d), (pb::Outcome::Deny, "run_budget_exhausted".into()));
}

/// High 3: runs enter the ledger only through `SubmitRun` (which has the planner validate the
/// plan) or the mesh's own token; a plan is an object.
#[tokio::test]
async fn runs_enter_the_ledger_only_through_submit_run() {
    let mesh = mesh_with(Backend::Sqlite, with_tokens(MeshOptions::default())).await;
    let too_long: Vec<Value> = (0..11).map(|i| json!({"id": format!("s{i}"), "tool": "echo"})).collect();
    let create = |plan: String| pb::CreateRunRequest { tenant: "acme".into(), plan_json: plan, ..Default::default() };
    for token in [ACME, MAILER] {
        let r = mesh.ledger_as(token).create_run(create(json!({ "steps": too_long }).to_string())).await;
        assert_eq!(code(r), Code::PermissionDenied, "{token} writing a run past the planner");
    }
    let listed = mesh
        .ledger_as(OPS)
        .list_runs(pb::ListLedgerRunsRequest { tenant: "acme".into(), ..Default::default() })
        .await
        .expect("list")
        .into_inner();
    assert!(listed.runs.is_empty(), "nothing was written: {listed:?}");
    let e = mesh.ledger_as(OPS).create_run(create("[]".into())).await.expect_err("an array is no plan");
    assert_field_violation(&e, "plan_json");
    let submit = pb::SubmitRunRequest { tenant: "acme".into(), plan_json: "[]".into(), ..Default::default() };
    let e = mesh.runs_as(ACME).submit_run(submit).await.expect_err("an array is no plan");
    assert_field_violation(&e, "plan_json");
    let ok = pb::SubmitRunRequest { tenant: "acme".into(), plan_json: HELLO.into(), ..Default::default() };
    let run = mesh.runs_as(ACME).submit_run(ok).await.expect("the front door").into_inner().run_id;
    assert_eq!(settled(&mesh, "acme", &run).await.status(), pb::RunStatus::Completed);
}

/// Medium 4: blocking again on the same decision after a resume is a new block, so the run
/// is `blocked` (holding no executor) rather than an `active` run the sweeper restarts forever.
#[tokio::test]
async fn a_run_blocking_again_on_the_same_decision_is_blocked_not_restarted_forever() {
    let opts = MeshOptions {
        approval_rules: vec![("acme".into(), vec!["email.send".into(), "kv.put".into()], vec![])],
        ..MeshOptions::default()
    };
    let mesh = mesh_with(Backend::Sqlite, opts).await;
    let plan = plan(&[
        ("mail", "email.send", json!({"to": "ops@example.com", "subject": "s", "body": "b"}), &[]),
        ("put", "kv.put", json!({"key": "k", "value": 1}), &[]),
    ]);
    let run = submit(&mesh, "acme", &plan).await;
    let blocked = first_event(&mesh, "acme", &run, |e| e.event_type == "run_blocked").await;
    let waiting_step = payload(&blocked)["step_id"].as_str().expect("step").to_string();
    let mut approvals = ApprovalsClient::new(mesh.policy.channel());
    let pending = warden_testkit::eventually(Duration::from_secs(30), || {
        let mut approvals = approvals.clone();
        async move {
            let req = pb::ListApprovalsRequest {
                tenant: "acme".into(),
                state: pb::ApprovalState::Pending as i32,
                ..Default::default()
            };
            let list = approvals.list(req).await.ok()?.into_inner().approvals;
            (list.len() == 2).then_some(list)
        }
    })
    .await
    .expect("both calls wait for approval");
    // Approve the call the run did not block on: the run resumes, that call runs, and the
    // other one blocks the run again on the same decision as before.
    let other = pending.iter().find(|a| a.step_id != waiting_step).expect("the other approval");
    approvals
        .approve(pb::ResolveApprovalRequest {
            tenant: "acme".into(),
            approval_id: other.approval_id.clone(),
            approver: "alice".into(),
            reason: "fine".into(),
        })
        .await
        .expect("approve");
    let mut ledger = mesh.ledger();
    let reblocked = warden_testkit::eventually(Duration::from_secs(60), || {
        let mut ledger = ledger.clone();
        let run = run.clone();
        async move {
            let evs = events(&mut ledger, "acme", &run).await;
            (evs.iter().filter(|e| e.event_type == "run_blocked").count() == 2).then_some(evs)
        }
    })
    .await
    .unwrap_or_else(|| panic!("the run never blocked again\n{}", mesh.logs()));
    let blocks: Vec<Value> = reblocked.iter().filter(|e| e.event_type == "run_blocked").map(payload).collect();
    assert_eq!(blocks[0]["decision_id"], blocks[1]["decision_id"], "blocked on the same decision again");
    // The sweeper looks every 500 ms: a run left `active` would be restarted over and over.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let evs = events(&mut ledger, "acme", &run).await;
    let starts = evs.iter().filter(|e| e.event_type == "run_started").count();
    assert_eq!(starts, 2, "one start per resume, no spinning: {starts}");
    let status = mesh
        .runs()
        .get_run(pb::GetRunRequest { tenant: "acme".into(), run_id: run.clone() })
        .await
        .expect("run")
        .into_inner();
    assert_eq!(status.status(), pb::RunStatus::Blocked);
    let done = status.steps.iter().find(|s| s.id != waiting_step).expect("approved step");
    assert_eq!(done.status(), pb::StepStatus::Completed);
}

/// Medium 4: a refused request creates nothing — an `Authorize` the ledger refuses for a stale
/// epoch leaves no pending approval behind.
#[tokio::test]
async fn an_authorize_refused_for_a_stale_epoch_leaves_no_approval_behind() {
    let opts = MeshOptions {
        executors: 0,
        approval_rules: vec![("acme".into(), vec!["email.send".into()], vec![])],
        ..MeshOptions::default()
    };
    let mesh = mesh_with(Backend::Sqlite, opts).await;
    let run = planned_run(&mesh, "acme", &[("mail", "email.send")]).await;
    mesh.ledger()
        .append_event(pb::AppendEventRequest {
            tenant: "acme".into(),
            run_id: run.clone(),
            epoch: 5,
            idempotency_key: "run_started:5".into(),
            event_type: "run_started".into(),
            payload_json: json!({"executor": "test", "epoch": 5}).to_string(),
            step_id: String::new(),
        })
        .await
        .expect("raise the epoch");
    let mail = json!({"to": "ops@example.com", "subject": "s", "body": "b"});
    let mut stale = call("acme", &run, "mail", "email.send", mail.clone());
    stale.epoch = 1;
    let e = mesh.policy().authorize(stale).await.expect_err("stale epoch");
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    let mut approvals = ApprovalsClient::new(mesh.policy.channel());
    let list = |mut a: ApprovalsClient<warden_grpc::auth::Ch>| async move {
        a.list(pb::ListApprovalsRequest { tenant: "acme".into(), ..Default::default() })
            .await
            .expect("list")
            .into_inner()
            .approvals
    };
    assert!(list(approvals.clone()).await.is_empty(), "a refused request created an approval");
    let mut current = call("acme", &run, "mail", "email.send", mail);
    current.epoch = 5;
    let d = mesh.policy().authorize(current).await.expect("decide").into_inner();
    assert_eq!(outcome(&d).0, pb::Outcome::ApprovalRequired);
    assert_eq!(list(approvals.clone()).await.len(), 1, "a recorded request has its approval");
    let _ = &mut approvals;
}

/// Medium 6: approving a commit fixes what gets committed. The decision (and so its approval)
/// binds the digest of the exact staged deltas; a delta staged after it needs a new one.
#[tokio::test]
async fn an_approved_commit_commits_only_the_deltas_it_was_approved_for() {
    let opts = MeshOptions {
        executors: 0,
        tenants: vec![("acme".into(), vec!["commit_tx".into()])],
        approval_rules: vec![("acme".into(), vec!["commit_tx".into()], vec![])],
        ..MeshOptions::default()
    };
    let mesh = mesh_with(Backend::Sqlite, opts).await;
    let run = planned_run(&mesh, "acme", &[]).await;
    let mut l = mesh.ledger();
    let stage = |delta: Value| pb::ProposeStateDeltaRequest {
        tenant: "acme".into(),
        run_id: run.clone(),
        tx_id: "tx1".into(),
        delta_json: delta.to_string(),
        provenance_json: String::new(),
        epoch: 0,
    };
    let first = l.propose_state_delta(stage(json!({"set": {"limit": 10}}))).await.expect("stage").into_inner();
    let authorize = |digest: String| {
        let req = call("acme", &run, "commit-tx1", "commit_tx", json!({"tx_id": "tx1", "deltas_sha256": digest}));
        let mut p = mesh.policy();
        async move { p.authorize(req).await.expect("decide").into_inner() }
    };
    let asked = authorize(first.staged_sha256.clone()).await;
    assert_eq!(outcome(&asked).0, pb::Outcome::ApprovalRequired);
    let mut approvals = ApprovalsClient::new(mesh.policy.channel());
    let pending = approvals
        .list(pb::ListApprovalsRequest { tenant: "acme".into(), ..Default::default() })
        .await
        .expect("list")
        .into_inner()
        .approvals;
    approvals
        .approve(pb::ResolveApprovalRequest {
            tenant: "acme".into(),
            approval_id: pending[0].approval_id.clone(),
            approver: "alice".into(),
            reason: "limit 10 is fine".into(),
        })
        .await
        .expect("approve");
    let approved = authorize(first.staged_sha256.clone()).await;
    assert_eq!(outcome(&approved), (pb::Outcome::Allow, "approval_gate".into()));
    // Staged after the approval: the approved decision no longer covers the transaction.
    let second = l.propose_state_delta(stage(json!({"set": {"owner": "mallory"}}))).await.expect("stage").into_inner();
    assert_ne!(first.staged_sha256, second.staged_sha256);
    let commit = |decision: &pb::AuthorizeResponse| pb::CommitTxRequest {
        tenant: "acme".into(),
        run_id: run.clone(),
        tx_id: "tx1".into(),
        decision_id: decision.decision.clone().expect("decision").decision_id,
        epoch: 0,
    };
    let e = l.commit_tx(commit(&approved)).await.expect_err("more was staged than approved");
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    let state = l.get_state(pb::GetStateRequest { tenant: "acme".into(), key: "owner".into() }).await.expect("state");
    assert!(!state.into_inner().found, "nothing was committed");
    let again = authorize(second.staged_sha256.clone()).await;
    assert_eq!(outcome(&again).0, pb::Outcome::ApprovalRequired, "the new deltas need their own approval");
    let pending = approvals
        .list(pb::ListApprovalsRequest {
            tenant: "acme".into(),
            state: pb::ApprovalState::Pending as i32,
            ..Default::default()
        })
        .await
        .expect("list")
        .into_inner()
        .approvals;
    assert_eq!(pending.len(), 1);
    approvals
        .approve(pb::ResolveApprovalRequest {
            tenant: "acme".into(),
            approval_id: pending[0].approval_id.clone(),
            approver: "alice".into(),
            reason: "both deltas seen".into(),
        })
        .await
        .expect("approve");
    let approved = authorize(second.staged_sha256).await;
    assert_eq!(outcome(&approved), (pb::Outcome::Allow, "approval_gate".into()));
    let done = l.commit_tx(commit(&approved)).await.expect("the approved deltas commit").into_inner();
    assert_eq!(done.status, "committed");
    let state = l.get_state(pb::GetStateRequest { tenant: "acme".into(), key: "owner".into() }).await.expect("state");
    assert_eq!(state.into_inner().value_json, "\"mallory\"", "exactly what the second approval covered");
}

/// Medium 9: a capability bound to run X grants nothing in run Y, whether presented by handle
/// or attached.
#[tokio::test]
async fn a_capability_bound_to_one_run_grants_nothing_in_another() {
    let mesh = services_on(Backend::Sqlite).await;
    let x = planned_run(&mesh, "acme", &[("s", "sleep")]).await;
    let y = planned_run(&mesh, "acme", &[("s", "sleep")]).await;
    let mut caps = caps_as(&mesh, "");
    let cap = caps.issue(pb::IssueCapabilityRequest { run_id: x.clone(), ..issue("acme", &["sleep"]) }).await;
    let handle = cap.expect("issue").into_inner().handle;
    let mut in_y = call("acme", &y, "s", "sleep", json!({"ms": 1}));
    in_y.capability_handle = handle.clone();
    let d = mesh.policy().authorize(in_y).await.expect("decide").into_inner();
    assert_eq!(outcome(&d), (pb::Outcome::Deny, "capability_run".into()));
    assert!(d.authorization.is_none());
    let mut in_x = call("acme", &x, "s", "sleep", json!({"ms": 1}));
    in_x.capability_handle = handle;
    let d = mesh.policy().authorize(in_x).await.expect("decide").into_inner();
    assert_eq!(outcome(&d), (pb::Outcome::Allow, "capability".into()), "its own run");
}

/// Capability resources match by prefix, so they must be normalized paths: `docs/*` never
/// covers `docs/../secrets/key`.
#[tokio::test]
async fn a_capability_resource_pattern_does_not_match_a_path_that_climbs_out() {
    let mesh = services_on(Backend::Sqlite).await;
    let run = planned_run(&mesh, "acme", &[("a", "sleep"), ("b", "sleep"), ("c", "sleep"), ("d", "sleep")]).await;
    let mut caps = caps_as(&mesh, "");
    let req = pb::IssueCapabilityRequest { resource_patterns: vec!["docs/*".into()], ..issue("acme", &["sleep"]) };
    let handle = caps.issue(req).await.expect("issue").into_inner().handle;
    let mut req = call("acme", &run, "a", "sleep", json!({"ms": 1, "resource": "docs/readme"}));
    req.capability_handle = handle.clone();
    let d = mesh.policy().authorize(req).await.expect("decide").into_inner();
    assert_eq!(outcome(&d).0, pb::Outcome::Allow, "{d:?}");
    // Refused for every caller, before any rule (Cedar's `like` included) sees the path, and
    // recorded as a malformed request.
    for (step, resource) in [
        ("b", "docs/../secrets/key"),
        ("c", "docs/%2e%2e/secrets/key"),
        ("d", "docs/.\\..\\secrets"),
        ("a", "docs/%252e%252e/x"),
    ] {
        let mut req = call("acme", &run, step, "sleep", json!({"ms": 1, "resource": resource}));
        req.idempotency_key = format!("{run}:{step}:{}", resource.len());
        req.capability_handle = handle.clone();
        let e = mesh.policy().authorize(req).await.expect_err(resource);
        assert_field_violation(&e, "args_json.resource");
    }
    let recorded = events(&mut mesh.ledger(), "acme", &run).await;
    let malformed = recorded.iter().filter(|e| payload(e)["rule_id"] == json!("malformed_request")).count();
    assert_eq!(malformed, 4, "each refusal is a recorded deny");
}

/// Medium 10: an authorization is issued only for a step of the run's recorded plan and the
/// tool that step names.
#[tokio::test]
async fn policy_signs_only_calls_of_the_runs_recorded_plan() {
    let mesh = mesh_with(Backend::Sqlite, with_tokens(MeshOptions { executors: 0, ..MeshOptions::default() })).await;
    let run = planned_run(&mesh, "acme", &[("greet", "echo")]).await;
    let mut acme = policy_as(&mesh, ACME);
    let d = acme.authorize(call("acme", &run, "extra", "echo", json!({}))).await.expect("decide").into_inner();
    assert_eq!(outcome(&d), (pb::Outcome::Deny, "step_not_in_plan".into()));
    assert!(d.authorization.is_none());
    let d = acme.authorize(call("acme", &run, "greet", "kv.put", json!({"key": "k"}))).await.expect("decide");
    assert_eq!(outcome(&d.into_inner()), (pb::Outcome::Deny, "step_not_in_plan".into()), "another tool");
    let recorded = events(&mut mesh.ledger(), "acme", &run).await;
    let denies = recorded.iter().filter(|e| payload(e)["rule_id"] == json!("step_not_in_plan")).count();
    assert_eq!(denies, 2, "refusals are recorded decisions");
    // Only the mesh's executor may carry a decision into its own append: for anyone else the
    // flag is ignored and the decision is on the record before the answer.
    let mut own = call("acme", &run, "greet", "echo", json!({}));
    own.caller_records = true;
    let d = acme.authorize(own).await.expect("decide").into_inner();
    let id = d.decision.expect("decision").decision_id;
    let recorded = events(&mut mesh.ledger(), "acme", &run).await;
    assert!(recorded.iter().any(|e| payload(e)["decision_id"] == json!(id)), "recorded before the answer");
}

/// The policy takes a run's plan from the request (and skips reading it from the ledger) only
/// from the mesh and only as the ledger acknowledged it at creation: the genuine
/// acknowledgement of this run with the plan whose digest it signs. A wider plan under a
/// genuine acknowledgement, a forged acknowledgement, another run's, or any from a tenant, are
/// ignored: the recorded plan decides.
#[tokio::test]
async fn the_policy_takes_a_plan_from_the_request_only_as_the_ledger_acknowledged_it() {
    use crate::observability::{scrape, value};
    let mesh = mesh_with(Backend::Sqlite, with_tokens(MeshOptions { executors: 0, ..MeshOptions::default() })).await;
    let narrow = json!({"steps": [{"id": "greet", "tool": "echo"}]});
    let wider = json!({"steps": [{"id": "greet", "tool": "echo"}, {"id": "extra", "tool": "echo"}]});
    let create = |plan: &Value| {
        let mut ledger = mesh.ledger();
        let req = pb::CreateRunRequest { tenant: "acme".into(), plan_json: plan.to_string(), ..Default::default() };
        async move {
            let created = ledger.create_run(req).await.expect("create run").into_inner();
            (created.run.expect("run").run_id, created.run_ack.expect("a run with a plan is acknowledged"))
        }
    };
    let get_runs = || async {
        let ledger = scrape(&mesh.ledger.metrics_url).await;
        value(&ledger, "warden_grpc_server_requests_total", &[("method", "GetRun"), ("code", "OK")])
    };
    let with_plan = |run: &str, step: &str, ack: &pb::SignedAuthorization, plan: &Value| pb::AuthorizeRequest {
        run_ack: Some(ack.clone()),
        plan_json: plan.to_string(),
        ..call("acme", run, step, "echo", json!({}))
    };
    let mut executor = policy_as(&mesh, OPS);
    let mut acme = policy_as(&mesh, ACME);
    let before = get_runs().await;

    // This run's genuine acknowledgement, but a wider plan than the one it acknowledges.
    let (run, ack) = create(&narrow).await;
    let d = executor.authorize(with_plan(&run, "extra", &ack, &wider)).await.expect("decide").into_inner();
    assert_eq!(outcome(&d), (pb::Outcome::Deny, "step_not_in_plan".into()), "a plan other than the acknowledged one");
    // An acknowledgement of the wider plan signed by a key that is not the ledger's.
    let (run, _) = create(&narrow).await;
    let forged = warden_core::ack::sign_run_ack(
        "acme",
        &run,
        &warden_core::canonical::canonical_json(&wider),
        &ed25519_dalek::SigningKey::from_bytes(&[7u8; 32]),
    );
    let forged =
        pb::SignedAuthorization { claims_json: forged.claims_json, signature: forged.signature, key_id: forged.key_id };
    let d = executor.authorize(with_plan(&run, "extra", &forged, &wider)).await.expect("decide").into_inner();
    assert_eq!(outcome(&d), (pb::Outcome::Deny, "step_not_in_plan".into()), "a forged acknowledgement");
    // Another run's genuine acknowledgement of the wider plan.
    let (_, wide_ack) = create(&wider).await;
    let (run, _) = create(&narrow).await;
    let d = executor.authorize(with_plan(&run, "extra", &wide_ack, &wider)).await.expect("decide").into_inner();
    assert_eq!(outcome(&d), (pb::Outcome::Deny, "step_not_in_plan".into()), "another run's acknowledgement");
    // A tenant's genuine pair is not taken either: the shortcut is the executor's.
    let (run, ack) = create(&narrow).await;
    let d = acme.authorize(with_plan(&run, "greet", &ack, &narrow)).await.expect("decide").into_inner();
    assert_eq!(outcome(&d).0, pb::Outcome::Allow);
    // Each of those read the recorded plan from the ledger.
    assert_eq!(get_runs().await - before, 4.0, "the ledger was asked for each of those runs' plans");

    // The executor's genuine pair: taken as it is, nothing read back; it is this run's plan.
    let (run, ack) = create(&narrow).await;
    let d = executor.authorize(with_plan(&run, "greet", &ack, &narrow)).await.expect("decide").into_inner();
    assert_eq!(outcome(&d).0, pb::Outcome::Allow);
    assert_eq!(get_runs().await - before, 4.0, "the acknowledged plan was not read back");
    let d = executor.authorize(call("acme", &run, "extra", "echo", json!({}))).await.expect("decide").into_inner();
    assert_eq!(outcome(&d), (pb::Outcome::Deny, "step_not_in_plan".into()), "the acknowledged plan decides");
    assert_eq!(get_runs().await - before, 5.0, "a step outside the plan in hand is looked up once more");
}

/// A run's first decision may be asked for while the run is being created (the executor's
/// `decide_while_creating`): the policy then decides against the plan the request carries,
/// and only for the mesh; the signed record names the plan's digest, and the ledger records
/// it only in a run whose recorded plan has that digest. A decision about a run that never
/// came to be (or not with that plan) is not lost: the policy's own copy is kept apart, and
/// its tenant can list it.
#[tokio::test]
async fn a_decision_asked_while_its_run_is_created_binds_to_the_plan_and_is_never_lost() {
    use warden_core::canonical::{canonical_json, sha256_hex};
    let mesh = mesh_with(Backend::Sqlite, with_tokens(MeshOptions { executors: 0, ..MeshOptions::default() })).await;
    let narrow = json!({"steps": [{"id": "greet", "tool": "echo"}]});
    let wider = json!({"steps": [{"id": "greet", "tool": "echo"}, {"id": "extra", "tool": "echo"}]});
    let digest = |plan: &Value| sha256_hex(canonical_json(plan).as_bytes());
    let early = |run: &str, step: &str, plan: &Value| pb::AuthorizeRequest {
        plan_json: canonical_json(plan),
        plan_sha256: digest(plan),
        caller_records: true,
        ..call("acme", run, step, "echo", json!({}))
    };
    let create = |run: &str, plan: &Value| {
        let mut ledger = mesh.ledger();
        let req = pb::CreateRunRequest {
            tenant: "acme".into(),
            run_id: run.into(),
            plan_json: plan.to_string(),
            ..Default::default()
        };
        async move { ledger.create_run(req).await.expect("create run").into_inner().run.expect("run").run_id }
    };
    let record_of = |d: &pb::AuthorizeResponse| serde_json::from_str::<Value>(&d.decision_event_json).expect("record");
    let mut executor = policy_as(&mesh, OPS);
    let mut acme = policy_as(&mesh, ACME);

    // A tenant cannot have a plan of its own decided against: the fields are ignored.
    let recorded = create("early-recorded", &narrow).await;
    let d = acme.authorize(early(&recorded, "extra", &wider)).await.expect("decide").into_inner();
    assert_eq!(outcome(&d), (pb::Outcome::Deny, "step_not_in_plan".into()), "the recorded plan decides");
    assert!(record_of(&d).get("plan_sha256").is_none(), "{}", d.decision_event_json);
    let e = acme.authorize(early("early-never", "greet", &narrow)).await.expect_err("no such run for a tenant");
    assert_eq!(e.code(), Code::NotFound, "{e:?}");
    // A digest that is not the plan's is refused, naming the field.
    let bad = pb::AuthorizeRequest { plan_sha256: digest(&wider), ..early("early-bad", "greet", &narrow) };
    let e = executor.authorize(bad).await.expect_err("a digest of another plan");
    assert_eq!(e.code(), Code::InvalidArgument);
    assert_eq!(warden_grpc::field_violations(&e)[0].0, "plan_sha256");

    // The mesh asks before the run exists: decided against the plan sent, the digest signed in.
    let d = executor.authorize(early("early-wide", "extra", &wider)).await.expect("decide").into_inner();
    assert_eq!(outcome(&d).0, pb::Outcome::Allow);
    assert_eq!(record_of(&d)["plan_sha256"], json!(digest(&wider)));
    // Created with another plan, the run's chain refuses that record.
    let wide_run = create("early-wide", &narrow).await;
    let append = |run: &str, d: &pb::AuthorizeResponse| pb::AppendEventsRequest {
        tenant: "acme".into(),
        run_id: run.into(),
        epoch: 0,
        events: vec![pb::EventInput {
            idempotency_key: warden_core::events::decision_key(&d.decision.clone().expect("decision").decision_id),
            event_type: "policy_decision".into(),
            payload_json: d.decision_event_json.clone(),
            step_id: record_of(d)["step_id"].as_str().expect("step").into(),
        }],
        brief: false,
    };
    let e = mesh.ledger_as(OPS).append_events(append(&wide_run, &d)).await.expect_err("another plan");
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    assert!(e.message().contains("not the run's recorded plan"), "{e:?}");
    // Created with the plan it was decided against, the record is taken.
    let d = executor.authorize(early("early-narrow", "greet", &narrow)).await.expect("decide").into_inner();
    let narrow_run = create("early-narrow", &narrow).await;
    mesh.ledger_as(OPS).append_events(append(&narrow_run, &d)).await.expect("the run's own plan");

    // Never created: the policy's own copy of the decision is kept apart, listed for its tenant.
    let lost = executor.authorize(early("early-lost", "greet", &narrow)).await.expect("decide").into_inner();
    let lost_id = lost.decision.clone().expect("decision").decision_id;
    let list = |token: &str, tenant: &str| {
        let mut ledger = mesh.ledger_as(token);
        let req = pb::ListUnboundDecisionsRequest { tenant: tenant.into(), ..Default::default() };
        async move { ledger.list_unbound_decisions(req).await }
    };
    let kept = warden_testkit::eventually(Duration::from_secs(20), || async {
        let listed = list(ACME, "acme").await.ok()?.into_inner().decisions;
        let wide = listed.iter().any(|k| k.run_id == "early-wide");
        listed.iter().find(|k| k.decision_id == lost_id).filter(|_| wide).cloned()
    })
    .await
    .expect("the decisions no run holds are kept");
    assert_eq!((kept.tenant.as_str(), kept.run_id.as_str(), kept.step_id.as_str()), ("acme", "early-lost", "greet"));
    assert_eq!(kept.payload_json, lost.decision_event_json, "as the policy signed it");
    let listed = list(OPS, "").await.expect("operators list every tenant's").into_inner().decisions;
    assert!(listed.iter().any(|k| k.decision_id == lost_id));
    // Only the tenant's own, and only with a token.
    assert_eq!(code(list(GLOBEX, "acme").await), Code::PermissionDenied);
    assert_eq!(code(list(ACME, "").await), Code::PermissionDenied);
    assert_eq!(code(list("", "acme").await), Code::Unauthenticated);
    let globex = list(GLOBEX, "globex").await.expect("its own").into_inner().decisions;
    assert!(globex.is_empty(), "{globex:?}");
    // The cursor pages through them; a made-up one is refused.
    let mut ledger = mesh.ledger_as(ACME);
    let page =
        |token: String| pb::ListUnboundDecisionsRequest { tenant: "acme".into(), page_size: 1, page_token: token };
    let first = ledger.list_unbound_decisions(page(String::new())).await.expect("page").into_inner();
    assert_eq!(first.decisions.len(), 1);
    let second = ledger.list_unbound_decisions(page(first.next_page_token.clone())).await.expect("page").into_inner();
    assert_ne!(second.decisions.first().map(|d| &d.decision_id), first.decisions.first().map(|d| &d.decision_id));
    let e = ledger.list_unbound_decisions(page("x".into())).await.expect_err("not a cursor");
    assert_eq!(warden_grpc::field_violations(&e)[0].0, "page_token");
}

/// A run's creation may carry its first step — the decision and the request it allows — to
/// record them in the same commit. They are checked as an append checks them: only as the
/// policy signed them, only against the plan being recorded; refused, the run is created
/// without them and says why. A creation that cannot carry them is refused whole, writing
/// nothing; only the mesh creates runs at all.
#[tokio::test]
async fn a_run_created_with_its_first_step_records_it_only_as_the_policy_signed_it() {
    use crate::observability::{scrape, value};
    use warden_core::canonical::{args_digest, canonical_json, sha256_hex};
    let mesh = mesh_with(Backend::Sqlite, with_tokens(MeshOptions { executors: 0, ..MeshOptions::default() })).await;
    let plan = json!({"steps": [{"id": "greet", "tool": "echo"}]});
    let other = json!({"steps": [{"id": "greet", "tool": "echo"}, {"id": "extra", "tool": "echo"}]});
    let args = json!({"text": "hi"});
    let mut executor = policy_as(&mesh, OPS);
    let decide = |run: &str, p: &Value| pb::AuthorizeRequest {
        plan_json: canonical_json(p),
        plan_sha256: sha256_hex(canonical_json(p).as_bytes()),
        caller_records: true,
        epoch: 1,
        ..call("acme", run, "greet", "echo", args.clone())
    };
    let first_step = |run: &str, d: &pb::AuthorizeResponse, record: String| {
        let id = d.decision.clone().expect("decision").decision_id;
        let request = json!({"decision_id": id, "attempt": 1, "tool": "echo", "args": args,
                             "args_sha256": args_digest(&args), "idempotency_key": format!("{run}:greet:1")});
        vec![
            pb::EventInput {
                idempotency_key: warden_core::events::decision_key(&id),
                event_type: "policy_decision".into(),
                payload_json: record,
                step_id: "greet".into(),
            },
            pb::EventInput {
                idempotency_key: format!("{run}:greet:1:requested"),
                event_type: "tool_requested".into(),
                payload_json: request.to_string(),
                step_id: "greet".into(),
            },
        ]
    };
    let create = |run: &str, first_events: Vec<pb::EventInput>| pb::CreateRunRequest {
        tenant: "acme".into(),
        run_id: run.into(),
        plan_json: canonical_json(&plan),
        started_by: "executor-x".into(),
        epoch: 1,
        first_events,
        ..Default::default()
    };
    let types = |run: &str| {
        let mut ledger = mesh.ledger();
        let run = run.to_string();
        async move { events(&mut ledger, "acme", &run).await.into_iter().map(|e| e.event_type).collect::<Vec<_>>() }
    };

    // As the policy signed it, for the plan being recorded: one commit, and the request's
    // acknowledgement with it, on which the tool host acts.
    let d = executor.authorize(decide("first-ok", &plan)).await.expect("decide").into_inner();
    assert_eq!(outcome(&d).0, pb::Outcome::Allow);
    let req = create("first-ok", first_step("first-ok", &d, d.decision_event_json.clone()));
    let e = mesh.ledger_as(ACME).create_run(req.clone()).await.expect_err("only the mesh creates runs");
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    let created = mesh.ledger_as(OPS).create_run(req).await.expect("created").into_inner();
    assert_eq!((created.first_events_code, created.first_appended.len()), (0, 2), "{}", created.first_events_message);
    assert_eq!(created.run.expect("run").last_seq, 4);
    assert_eq!(types("first-ok").await, ["run_submitted", "run_started", "policy_decision", "tool_requested"]);
    assert!(verify(&mut mesh.ledger(), "acme", "first-ok").await.valid);
    let answer = mesh
        .tool_host()
        .invoke(pb::InvokeRequest {
            tenant: "acme".into(),
            run_id: "first-ok".into(),
            step_id: "greet".into(),
            attempt: 1,
            tool: "echo".into(),
            args_json: canonical_json(&args),
            idempotency_key: "first-ok:greet:1".into(),
            authorization: d.authorization.clone(),
            request_ack: created.first_appended[1].request_ack.clone(),
        })
        .await
        .expect("the host acts on a request recorded with its run")
        .into_inner();
    assert_eq!(answer.outcome, Some(pb::invoke_response::Outcome::OutputJson(canonical_json(&args))));

    // Altered after the policy signed it: the run is created, without its first step.
    let d = executor.authorize(decide("first-altered", &plan)).await.expect("decide").into_inner();
    let mut altered: Value = serde_json::from_str(&d.decision_event_json).expect("record");
    altered["reason"] = json!("approved by someone else");
    let created = mesh
        .ledger_as(OPS)
        .create_run(create("first-altered", first_step("first-altered", &d, altered.to_string())))
        .await
        .expect("created without its first step")
        .into_inner();
    assert_eq!(created.first_events_code, Code::PermissionDenied as i32, "{}", created.first_events_message);
    assert!(created.first_appended.is_empty());
    assert_eq!(created.run.expect("run").last_seq, 2, "created without them");
    // (The policy's own copy of the genuine record may reach the run later; never the altered.)
    let recorded = events(&mut mesh.ledger(), "acme", "first-altered").await;
    assert!(recorded.iter().all(|e| !e.payload_json.contains("someone else")), "{recorded:?}");

    // Decided against another plan than the one recorded: the same.
    let d = executor.authorize(decide("first-other", &other)).await.expect("decide").into_inner();
    let created = mesh
        .ledger_as(OPS)
        .create_run(create("first-other", first_step("first-other", &d, d.decision_event_json.clone())))
        .await
        .expect("created without its first step")
        .into_inner();
    assert_eq!(created.first_events_code, Code::PermissionDenied as i32, "{}", created.first_events_message);
    assert!(created.first_events_message.contains("not the run's recorded plan"), "{}", created.first_events_message);
    assert_eq!(created.run.expect("run").last_seq, 2, "created without them");

    // A creation that cannot carry a first step is refused whole: no run.
    let d = executor.authorize(decide("first-bad", &plan)).await.expect("decide").into_inner();
    let mut outcome_first = first_step("first-bad", &d, d.decision_event_json.clone());
    outcome_first[1].event_type = "tool_completed".into();
    let not_started = pb::CreateRunRequest {
        started_by: String::new(),
        epoch: 0,
        ..create("first-bad", first_step("first-bad", &d, d.decision_event_json.clone()))
    };
    let too_many =
        create("first-bad", (0..65).flat_map(|_| first_step("first-bad", &d, d.decision_event_json.clone())).collect());
    for (req, field) in [
        (create("first-bad", outcome_first), "first_events[1].event_type"),
        (not_started, "first_events"),
        (too_many, "first_events"),
    ] {
        let e = mesh.ledger_as(OPS).create_run(req).await.expect_err("refused whole");
        assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
        assert_eq!(warden_grpc::field_violations(&e)[0].0, field);
    }
    let req = pb::GetLedgerRunRequest { tenant: "acme".into(), run_id: "first-bad".into(), with_events: false };
    assert_eq!(code(mesh.ledger().get_run(req).await), Code::NotFound, "nothing written");

    let ledger = scrape(&mesh.ledger.metrics_url).await;
    let created = |first_step| value(&ledger, "warden_ledger_runs_created_total", &[("first_step", first_step)]);
    assert_eq!((created("recorded"), created("refused")), (1.0, 2.0));
}

/// Medium 10: a tool call cannot happen outside the record. A tenant holding a signed allow
/// for a planned step still cannot have the tool act by calling the host itself: the host also
/// needs the ledger's acknowledgement that the request is recorded, which only the mesh gets.
#[tokio::test]
async fn a_signed_allow_alone_cannot_make_a_tool_act_outside_the_record() {
    let mesh = mesh_with(Backend::Sqlite, with_tokens(MeshOptions { executors: 0, ..MeshOptions::default() })).await;
    let run = planned_run(&mesh, "acme", &[("mail", "email.send")]).await;
    let mail = json!({"to": "ops@example.com", "subject": "s", "body": "b"});
    let granted = policy_as(&mesh, ACME)
        .authorize(call("acme", &run, "mail", "email.send", mail.clone()))
        .await
        .expect("decide")
        .into_inner();
    assert_eq!(outcome(&granted).0, pb::Outcome::Allow, "a tenant may ask for decisions on its own run");
    let invoke = pb::InvokeRequest {
        tenant: "acme".into(),
        run_id: run.clone(),
        step_id: "mail".into(),
        attempt: 1,
        tool: "email.send".into(),
        args_json: warden_core::canonical::canonical_json(&mail),
        idempotency_key: format!("{run}:mail:1"),
        authorization: granted.authorization.clone(),
        request_ack: None,
    };
    let e = mesh.tool_host().invoke(invoke.clone()).await.expect_err("not on the record");
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    let forged = pb::AppendEventRequest {
        tenant: "acme".into(),
        run_id: run.clone(),
        epoch: 0,
        idempotency_key: "mine".into(),
        event_type: "tool_requested".into(),
        payload_json: json!({"decision_id": "x"}).to_string(),
        step_id: "mail".into(),
    };
    let e = mesh.ledger_as(ACME).append_event(forged.clone()).await.expect_err("only the mesh records requests");
    assert_eq!(e.code(), Code::PermissionDenied);
    let batch = |n: usize| pb::AppendEventsRequest {
        tenant: "acme".into(),
        run_id: run.clone(),
        epoch: 0,
        events: (0..n)
            .map(|i| pb::EventInput {
                idempotency_key: format!("mine-{i}"),
                event_type: forged.event_type.clone(),
                payload_json: forged.payload_json.clone(),
                step_id: forged.step_id.clone(),
            })
            .collect(),
        brief: false,
    };
    for token in [ACME, MAILER] {
        let e = mesh.ledger_as(token).append_events(batch(1)).await.expect_err("nor in a batch");
        assert_eq!(e.code(), Code::PermissionDenied, "{token}");
    }
    let e = mesh.ledger_as(OPS).append_events(batch(65)).await.expect_err("over the batch limit");
    assert_field_violation(&e, "events");
    // The policy's late decision records take decisions only, and only from the mesh.
    let decisions = |n: usize, event_type: &str| pb::RecordDecisionsRequest {
        decisions: (0..n)
            .map(|i| pb::AppendEventRequest {
                idempotency_key: format!("late-{i}"),
                event_type: event_type.to_string(),
                ..forged.clone()
            })
            .collect(),
    };
    for token in [ACME, MAILER] {
        let e = mesh
            .ledger_as(token)
            .record_decisions(decisions(1, "policy_decision"))
            .await
            .expect_err("a tenant records no decisions");
        assert_eq!(e.code(), Code::PermissionDenied, "{token}");
    }
    let e = mesh.ledger_as(OPS).record_decisions(decisions(1, "tool_requested")).await.expect_err("decisions only");
    assert_field_violation(&e, "decisions[0].event_type");
    let e = mesh.ledger_as(OPS).record_decisions(decisions(257, "policy_decision")).await.expect_err("over the limit");
    assert_field_violation(&e, "decisions");
    let e = mesh.ledger_as(OPS).record_decisions(decisions(0, "policy_decision")).await.expect_err("empty");
    assert_field_violation(&e, "decisions");
    assert!(mesh.outbox().is_empty(), "no effect happened");
    let recorded = events(&mut mesh.ledger(), "acme", &run).await;
    assert!(recorded.iter().all(|e| e.event_type != "tool_requested" && e.event_type != "tool_completed"));
}

/// Low 11: an agent's token attaches capabilities only to its own agent's runs.
#[tokio::test]
async fn an_agent_token_attaches_capabilities_only_to_its_own_runs() {
    let mesh = mesh_with(Backend::Sqlite, with_tokens(MeshOptions { executors: 0, ..MeshOptions::default() })).await;
    let created = mesh
        .ledger_as(OPS)
        .create_run(pb::CreateRunRequest {
            tenant: "acme".into(),
            plan_json: plan(&[("s", "echo", json!({}), &[])]),
            agent: "mailer".into(),
            ..Default::default()
        })
        .await
        .expect("create")
        .into_inner();
    let run = created.run.expect("run").run_id;
    let handle = caps_as(&mesh, OPS).issue(issue("acme", &["echo"])).await.expect("issue").into_inner().handle;
    let attach = |h: &str| pb::AttachCapabilityRequest {
        tenant: "acme".into(),
        run_id: run.clone(),
        capability_handle: h.into(),
        validate_only: false,
    };
    let e = caps_as(&mesh, INTERN).attach(attach(&handle)).await.expect_err("the mailer's run");
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    caps_as(&mesh, MAILER).attach(attach(&handle)).await.expect("its own run");
}

/// Low 14: an approval that expires unanswered moves its run on: the call is denied
/// `approval_expired` and the run continues (and ends) by its plan.
#[tokio::test]
async fn an_expired_approval_moves_its_run_on() {
    let opts = MeshOptions {
        policy_extra: "approval_ttl_secs = 1".into(),
        approval_rules: vec![("acme".into(), vec!["email.send".into()], vec![])],
        ..MeshOptions::default()
    };
    let mesh = mesh_with(Backend::Sqlite, opts).await;
    let plan = plan(&[
        ("mail", "email.send", json!({"to": "ops@example.com", "subject": "s", "body": "b"}), &[]),
        ("after", "echo", json!({}), &["mail"]),
        ("aside", "echo", json!({}), &[]),
    ]);
    let run = submit(&mesh, "acme", &plan).await;
    first_event(&mesh, "acme", &run, |e| e.event_type == "run_blocked").await;
    let done = settled(&mesh, "acme", &run).await;
    assert_eq!(done.status(), pb::RunStatus::Failed, "{}", done.reason);
    assert!(done.reason.contains("approval_expired"), "{}", done.reason);
    let step = |id: &str| done.steps.iter().find(|s| s.id == id).expect("step").status();
    assert_eq!(step("aside"), pb::StepStatus::Completed);
    assert_eq!(step("after"), pb::StepStatus::Cancelled);
    assert!(mesh.outbox().is_empty(), "the expired call never ran");
}

/// Low 15: epochs are stored as BIGINT; one above i64::MAX is refused at the boundary instead
/// of wrapping negative and leaving the run undrivable.
#[tokio::test]
async fn an_epoch_beyond_the_signed_range_is_refused_and_the_run_stays_drivable() {
    let mesh = mesh_on(Backend::Sqlite).await;
    let run = planned_run(&mesh, "acme", &[("greet", "echo")]).await;
    let e = mesh
        .ledger()
        .append_event(pb::AppendEventRequest {
            tenant: "acme".into(),
            run_id: run.clone(),
            epoch: u64::MAX,
            idempotency_key: "summary-1".into(),
            event_type: "run_started".into(),
            payload_json: json!({"executor": "x", "epoch": 1}).to_string(),
            step_id: String::new(),
        })
        .await
        .expect_err("2^64-1");
    assert_field_violation(&e, "epoch");
    let mut req = call("acme", &run, "greet", "echo", json!({}));
    req.epoch = i64::MAX as u64 + 1;
    let e = mesh.policy().authorize(req).await.expect_err("2^63");
    assert_field_violation(&e, "epoch");
    let submitted = submit(&mesh, "acme", HELLO).await;
    assert_eq!(settled(&mesh, "acme", &submitted).await.status(), pb::RunStatus::Completed);
    let run = settled(&mesh, "acme", &run).await;
    assert_eq!(run.status(), pb::RunStatus::Completed, "the sweeper still drives it: {}", run.reason);
}

/// Low 12: `warden dev` works with authentication on: its services reach each other as the
/// mesh, and a tenant's token runs a plan through it.
#[tokio::test]
async fn warden_dev_serves_with_authentication_on() {
    use std::io::BufRead;
    let dir = tempfile::tempdir().expect("dir");
    let config = dir.path().join("warden.toml");
    std::fs::write(&config, format!("[auth.tokens]\n\"{ACME}\" = \"default\"\n")).expect("config");
    let bin = warden_testkit::mesh::bin_dir().expect("bin dir").join("warden");
    let mut cmd = std::process::Command::new(bin);
    cmd.args(["dev", "--listen", "127.0.0.1:0", "--dir"])
        .arg(dir.path().join("state"))
        .arg("--config")
        .arg(&config)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .stdin(std::process::Stdio::null());
    let mut child = warden_testkit::procs::spawn_tied(cmd, libc::SIGKILL).expect("spawn warden dev");
    let stdout = child.stdout.take().expect("stdout");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stdout).lines().map_while(Result::ok) {
            if let Some(endpoint) = line.split("serving on ").nth(1) {
                let _ = tx.send(endpoint.trim().to_string());
            }
        }
    });
    let endpoint = rx.recv_timeout(Duration::from_secs(60)).expect("warden dev announced its endpoint");
    let mut runs = warden_proto::v1::runs_client::RunsClient::new(
        warden_grpc::channel_with_token(&endpoint, ACME).expect("channel"),
    );
    let req = pb::SubmitRunRequest { tenant: "default".into(), plan_json: HELLO.into(), ..Default::default() };
    let run_id = runs.submit_run(req).await.expect("submit with a tenant token").into_inner().run_id;
    let done = warden_testkit::eventually(Duration::from_secs(60), || {
        let mut runs = runs.clone();
        let run_id = run_id.clone();
        async move {
            let r = runs.get_run(pb::GetRunRequest { tenant: "default".into(), run_id }).await.ok()?.into_inner();
            (r.status() == pb::RunStatus::Completed).then_some(r)
        }
    })
    .await;
    let anonymous = warden_proto::v1::runs_client::RunsClient::new(warden_grpc::channel(&endpoint).expect("channel"))
        .get_run(pb::GetRunRequest { tenant: "default".into(), run_id: run_id.clone() })
        .await;
    let _ = child.kill();
    let _ = child.wait();
    assert!(done.is_some(), "the run completed through warden dev with auth on");
    assert_eq!(code(anonymous), Code::Unauthenticated, "and auth is really on");
}

/// Semantic idempotency, same class as Medium 4: a key is claimed only by a call whose whole
/// decision is an allow that was recorded. A refused request (a stale epoch) holds no key, and
/// a call allowed but never requested frees its key once its authorization can no longer act.
#[tokio::test]
async fn a_refused_or_never_requested_call_holds_no_semantic_key() {
    let opts = MeshOptions {
        executors: 0,
        policy_extra:
            "authorization_ttl_ms = 1500\n[[policy.semantic_keys]]\ntool = \"kv.put\"\ntemplate = \"put:{key}\"\n"
                .into(),
        ..MeshOptions::default()
    };
    let mesh = mesh_with(Backend::Sqlite, opts).await;
    let put = json!({"key": "limit", "value": 1});
    let x = planned_run(&mesh, "acme", &[("p", "kv.put")]).await;
    mesh.ledger()
        .append_event(pb::AppendEventRequest {
            tenant: "acme".into(),
            run_id: x.clone(),
            epoch: 3,
            idempotency_key: "run_started:3".into(),
            event_type: "run_started".into(),
            payload_json: json!({"executor": "test", "epoch": 3}).to_string(),
            step_id: String::new(),
        })
        .await
        .expect("raise the epoch");
    let mut stale = call("acme", &x, "p", "kv.put", put.clone());
    stale.epoch = 1;
    let e = mesh.policy().authorize(stale).await.expect_err("stale");
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    let y = planned_run(&mesh, "acme", &[("p", "kv.put")]).await;
    let d = mesh.policy().authorize(call("acme", &y, "p", "kv.put", put.clone())).await.expect("decide").into_inner();
    assert_eq!(outcome(&d), (pb::Outcome::Allow, "tenant_allowlist".into()), "the refused request claimed nothing");
    // y's call is allowed but never requested: until its authorization expires the key is
    // held; after, nothing can act on it any more and the key is free.
    let z = planned_run(&mesh, "acme", &[("p", "kv.put")]).await;
    let d = mesh.policy().authorize(call("acme", &z, "p", "kv.put", put.clone())).await.expect("decide").into_inner();
    assert_eq!(outcome(&d), (pb::Outcome::Deny, "semantic_requires_reconciliation".into()));
    tokio::time::sleep(Duration::from_millis(1600)).await;
    let mut again = call("acme", &z, "p", "kv.put", put);
    again.idempotency_key = format!("{z}:p:again");
    let d = mesh.policy().authorize(again).await.expect("decide").into_inner();
    assert_eq!(outcome(&d).0, pb::Outcome::Allow, "the unused claim lapsed: {d:?}");
}

/// Semantic idempotency across retries: a call that succeeds on a later attempt holds its key
/// (a retryable failure of attempt 1 does not free it), so a duplicate is still refused.
#[tokio::test]
async fn a_call_that_succeeds_on_retry_keeps_its_semantic_key() {
    let opts = MeshOptions {
        tenants: vec![("acme".into(), vec!["flaky".into()])],
        executor_extra: "retry_backoff_base_ms = 10".into(),
        policy_extra: "[[policy.semantic_keys]]\ntool = \"flaky\"\ntemplate = \"flaky:{tag}\"\n".into(),
        ..MeshOptions::default()
    };
    let mesh = mesh_with(Backend::Sqlite, opts).await;
    let flaky = plan(&[("f", "flaky", json!({"succeed_on_attempt": 2, "tag": "once"}), &[])]);
    let first = submit(&mesh, "acme", &flaky).await;
    let done = settled(&mesh, "acme", &first).await;
    assert_eq!(done.status(), pb::RunStatus::Completed, "{}", done.reason);
    let second = submit(&mesh, "acme", &flaky).await;
    let dup = settled(&mesh, "acme", &second).await;
    assert_eq!(dup.status(), pb::RunStatus::Failed);
    assert!(dup.reason.contains("semantic_duplicate"), "{}", dup.reason);
}

/// `Runs.WaitRun` answers a run still driven here without asking the ledger when the caller's
/// tenant submitted it; anyone else's wait is answered from the ledger as before, at once:
/// refused for a token of another tenant, NOT_FOUND for a run of another tenant, never held
/// until the run stops.
#[tokio::test]
async fn a_wait_for_another_tenants_run_in_flight_is_refused_at_once() {
    let mut opts = with_tokens(MeshOptions::default());
    opts.tenants.iter_mut().filter(|(t, _)| t == "acme").for_each(|(_, tools)| tools.push("sleep".into()));
    let mesh = mesh_with(Backend::Sqlite, opts).await;
    // Six naps of 8 s one after another (each under the tool's 10 s timeout): 48 s of run.
    let naps = json!({"ms": 8_000});
    let plan = plan(&[
        ("n0", "sleep", naps.clone(), &[]),
        ("n1", "sleep", naps.clone(), &["n0"]),
        ("n2", "sleep", naps.clone(), &["n1"]),
        ("n3", "sleep", naps.clone(), &["n2"]),
        ("n4", "sleep", naps.clone(), &["n3"]),
        ("n5", "sleep", naps, &["n4"]),
    ]);
    let req = pb::SubmitRunRequest { tenant: "acme".into(), plan_json: plan, ..Default::default() };
    let run_id = mesh.runs_as(ACME).submit_run(req).await.expect("submit").into_inner().run_id;
    let wait = |tenant: &str| pb::WaitRunRequest { tenant: tenant.into(), run_id: run_id.clone(), timeout_ms: 600_000 };
    let as_globex = mesh.runs_as(GLOBEX).wait_run(wait("acme")).await;
    assert_eq!(code(as_globex), Code::PermissionDenied, "a token of another tenant");
    let for_globex = mesh.runs_as(GLOBEX).wait_run(wait("globex")).await;
    assert_eq!(code(for_globex), Code::NotFound, "another tenant's run");
    // Answered while the run still runs (48 s of naps), not held until it stopped.
    let get = pb::GetLedgerRunRequest { tenant: "acme".into(), run_id: run_id.clone(), with_events: false };
    let now = mesh.ledger().get_run(get).await.expect("the run").into_inner();
    assert_eq!(now.status(), pb::RunStatus::Active, "answered while the run still runs, not held until it stops");
    let cancel = pb::CancelRunRequest { tenant: "acme".into(), run_id: run_id.clone(), reason: "enough".into() };
    mesh.runs_as(ACME).cancel_run(cancel).await.expect("cancel");
    let mine = mesh.runs_as(ACME).wait_run(wait("acme")).await.expect("its own").into_inner();
    assert_eq!(mine.status(), pb::RunStatus::Cancelled, "{mine:?}");
}
