//! Branches (seed 001): a step names ordered alternatives; a call that fails for good — a tool
//! error, a denial — moves the step to its next alternative, never trying the same call twice,
//! every branch and attempt kept in the record and in the trace's execution DAG.

use serde_json::{Value, json};
use tonic::Code;
use warden_proto::v1 as pb;

use crate::*;

async fn trace(mesh: &warden_testkit::Mesh, run: &str) -> Value {
    let t = mesh.runs().get_trace(pb::GetRunRequest { tenant: "acme".into(), run_id: run.into() }).await;
    serde_json::from_str(&t.expect("trace").into_inner().trace_json).expect("trace json")
}

/// `send` fails on its own call (a tool error) and on its first alternative, and completes on
/// its second, templated from its dependency; `nap` is denied by policy (the tenant may not
/// call `sleep`) and completes on its alternative. Every branch is recorded (`step_branched`)
/// and decided; a step whose alternatives all fail fails, saying what its last one came to.
async fn alternatives(backend: Backend) {
    let mesh = mesh_on(backend).await;
    let work = json!({"steps": [
        {"id": "fetch", "tool": "echo", "params": {"v": "data"}},
        {"id": "send", "tool": "fail", "params": {"message": "smtp down"}, "depends_on": ["fetch"],
         "alternatives": [{"tool": "fail", "params": {"message": "smtp still down"}},
                          {"tool": "text.upper", "params": {"text": "{{fetch.output.v}}"}}]},
        {"id": "nap", "tool": "sleep", "params": {"ms": 1},
         "alternatives": [{"tool": "echo", "params": {"instead": "of a nap"}}]},
    ]});
    let run = submit(&mesh, "acme", &work.to_string()).await;
    let done = settled(&mesh, "acme", &run).await;
    assert_eq!(done.status(), pb::RunStatus::Completed, "{}\n{}", done.reason, mesh.logs());
    let step = |id: &str| done.steps.iter().find(|s| s.id == id).unwrap_or_else(|| panic!("step {id}")).clone();
    assert_eq!(step("send").output_json, json!({"text": "DATA"}).to_string());
    assert_eq!(step("nap").output_json, json!({"instead": "of a nap"}).to_string());

    let evs = events(&mut mesh.ledger(), "acme", &run).await;
    let payload = |e: &pb::Event| serde_json::from_str::<Value>(&e.payload_json).expect("payload");
    let branched: Vec<(String, Value)> =
        evs.iter().filter(|e| e.event_type == "step_branched").map(|e| (e.step_id.clone(), payload(e))).collect();
    let mut seen: Vec<(&str, u64, &str, &str)> = branched
        .iter()
        .map(|(s, p)| {
            (
                s.as_str(),
                p["branch"].as_u64().unwrap_or(0),
                p["tool"].as_str().unwrap_or(""),
                p["failed_kind"].as_str().unwrap_or(""),
            )
        })
        .collect();
    seen.sort();
    assert_eq!(
        seen,
        [
            ("nap", 1, "echo", "policy_denied"),
            ("send", 1, "fail", "tool_error"),
            ("send", 2, "text.upper", "tool_error")
        ]
    );
    // Each branch is decided and requested under attempts of its own: 1, 2, 3 for send.
    let requested: Vec<(String, u64, String)> = evs
        .iter()
        .filter(|e| e.event_type == "tool_requested" && e.step_id == "send")
        .map(|e| {
            let p = payload(e);
            (e.step_id.clone(), p["attempt"].as_u64().unwrap_or(0), p["tool"].as_str().unwrap_or("").to_string())
        })
        .collect();
    let expected: Vec<(String, u64, String)> =
        [(1, "fail"), (2, "fail"), (3, "text.upper")].iter().map(|(a, t)| ("send".into(), *a, t.to_string())).collect();
    assert_eq!(requested, expected);
    let denied = evs.iter().filter(|e| e.event_type == "policy_decision" && e.step_id == "nap").map(payload);
    let outcomes: Vec<String> = denied.map(|p| p["outcome"].as_str().unwrap_or("").to_string()).collect();
    assert_eq!(outcomes, ["deny", "allow"], "the denial stands; the alternative was decided on its own");
    assert!(verify(&mut mesh.ledger(), "acme", &run).await.valid);

    // The execution DAG: branches, attempts and results, the failed ones kept.
    let t = trace(&mesh, &run).await;
    let dag = &t["dag"];
    let node = |id: &str| {
        dag["nodes"]
            .as_array()
            .expect("nodes")
            .iter()
            .find(|n| n["id"] == id)
            .cloned()
            .unwrap_or_else(|| panic!("{id}"))
    };
    assert_eq!(
        (node("branch:send:0")["status"].clone(), node("branch:send:0")["label"].clone()),
        (json!("failed"), json!("fail"))
    );
    assert_eq!(node("branch:send:1")["status"], "failed");
    assert_eq!(
        (node("branch:send:2")["status"].clone(), node("branch:send:2")["label"].clone()),
        (json!("succeeded"), json!("text.upper"))
    );
    assert_eq!(node("attempt:send:1")["status"], "error");
    assert_eq!(node("result:send")["kind"], "result");
    assert_eq!(node("frame:root")["kind"], "frame");
    let edges = dag["edges"].as_array().expect("edges");
    for (from, to, kind) in [
        ("frame:root", "step:send", "contains"),
        ("branch:send:0", "branch:send:1", "backtracked_to"),
        ("branch:send:1", "branch:send:2", "backtracked_to"),
        ("branch:send:2", "attempt:send:3", "executes"),
        ("attempt:send:3", "result:send", "produced"),
        ("step:fetch", "step:send", "depends_on"),
    ] {
        assert!(edges.contains(&json!({"from": from, "to": to, "kind": kind})), "{from} -> {to} ({kind}): {edges:?}");
    }

    // Every alternative failing: the step fails with its last branch's reason, the run too.
    let work = json!({"steps": [{"id": "only", "tool": "fail", "params": {"message": "first outage"},
                                 "alternatives": [{"tool": "fail", "params": {"message": "second outage"}}]}]});
    let run = submit(&mesh, "acme", &work.to_string()).await;
    let done = settled(&mesh, "acme", &run).await;
    assert_eq!(done.status(), pb::RunStatus::Failed);
    let only = done.steps.iter().find(|s| s.id == "only").expect("only");
    assert_eq!(only.status(), pb::StepStatus::Failed);
    assert!(only.error.contains("second outage") && !only.error.contains("first"), "{}", only.error);

    // A tenant that may call `flaky` and `sleep`.
    let mut opts = warden_testkit::MeshOptions::default();
    opts.tenants[0].1.extend(["flaky".to_string(), "sleep".to_string()]);
    let mesh = mesh_with(backend, opts).await;
    // Retries count within a branch: the third branch (attempts from 3) still gets the three
    // attempts its tool's STANDARD policy allows, and succeeds on its third.
    let work = json!({"steps": [{"id": "r", "tool": "fail", "params": {"message": "x"},
        "alternatives": [{"tool": "fail", "params": {"message": "y"}}, {"tool": "flaky", "params": {"succeed_on_attempt": 5}}]}]});
    let run = submit(&mesh, "acme", &work.to_string()).await;
    let done = settled(&mesh, "acme", &run).await;
    assert_eq!(done.status(), pb::RunStatus::Completed, "{}", done.reason);

    // Cancelling a run whose step moved to an alternative ends it cancelled.
    let work = json!({"steps": [{"id": "c", "tool": "fail", "params": {"message": "x"},
        "alternatives": [{"tool": "sleep", "params": {"ms": 3000}}]}]});
    let run = submit(&mesh, "acme", &work.to_string()).await;
    first_event(&mesh, "acme", &run, |e| e.event_type == "step_branched").await;
    let cancel = pb::CancelRunRequest { tenant: "acme".into(), run_id: run.clone(), reason: "stop".into() };
    mesh.runs().cancel_run(cancel).await.expect("cancel");
    let done = settled(&mesh, "acme", &run).await;
    assert_eq!(done.status(), pb::RunStatus::Cancelled, "{}\n{}", done.reason, mesh.logs());
    assert!(verify(&mut mesh.ledger(), "acme", &run).await.valid);
}

#[tokio::test]
async fn a_failed_or_denied_call_moves_the_step_to_its_next_alternative_on_sqlite() {
    alternatives(Backend::Sqlite).await;
}

#[tokio::test]
async fn a_failed_or_denied_call_moves_the_step_to_its_next_alternative_on_postgres() {
    alternatives(Backend::Postgres).await;
}

/// Alternatives naming unknown tools, too many of them, one repeating the step's call, params
/// that are not an object or break the tool's input schema: INVALID_ARGUMENT naming the
/// field, and nothing is written.
#[tokio::test]
async fn bad_alternatives_are_refused_naming_the_field_and_nothing_is_written() {
    let mesh = mesh_on(Backend::Sqlite).await;
    let with = |alts: Value| {
        json!({"steps": [{"id": "a", "tool": "echo", "params": {"n": 1}, "alternatives": alts}]}).to_string()
    };
    let cases = [
        (with(json!([{"tool": "no.such.tool"}])), "plan_json.steps[a].alternatives[0].tool"),
        (with(json!([{"tool": "echo", "params": "x"}])), "plan_json.steps[a].alternatives[0].params"),
        (with(json!([{"tool": "echo", "params": {"n": 1}}])), "plan_json.steps[a].alternatives[0].params"),
        (with(json!(vec![json!({"tool": "echo"}); 5])), "plan_json.steps[a].alternatives"),
        (with(json!([{"tool": "text.upper", "params": {"text": 3}}])), "steps[0].alternatives[0].params/text"),
        (with(json!([{"tool": "echo", "extra": true}])), "plan_json"),
    ];
    for (plan_json, field) in cases {
        let req = pb::SubmitRunRequest { tenant: "acme".into(), plan_json: plan_json.clone(), ..Default::default() };
        let e = mesh.runs().submit_run(req).await.expect_err(field);
        assert_eq!(e.code(), Code::InvalidArgument, "{plan_json}: {e:?}");
        assert_field_violation(&e, field);
    }
    let listed =
        mesh.ledger().list_runs(pb::ListLedgerRunsRequest { tenant: "acme".into(), ..Default::default() }).await;
    assert!(listed.expect("runs").into_inner().runs.is_empty(), "nothing written");
}

/// Semantic idempotency sees branches: a call that claimed a key and failed frees it when its
/// step goes on to another alternative — the alternative's success is not that call's — so the
/// same call later is not a `semantic_duplicate`; a call that succeeded still blocks its key.
#[tokio::test]
async fn a_semantic_key_claimed_by_a_failed_branch_is_freed() {
    let extra = "[[policy.semantic_keys]]\ntool = \"fail\"\ntemplate = \"fail:{message}\"\n";
    let opts = warden_testkit::MeshOptions { policy_extra: extra.into(), ..warden_testkit::MeshOptions::default() };
    let mesh = mesh_with(Backend::Sqlite, opts).await;
    let work = json!({"steps": [{"id": "s", "tool": "fail", "params": {"message": "m"},
                                 "alternatives": [{"tool": "echo", "params": {"ok": true}}]}]});
    let run = submit(&mesh, "acme", &work.to_string()).await;
    assert_eq!(settled(&mesh, "acme", &run).await.status(), pb::RunStatus::Completed);
    let again = json!({"steps": [{"id": "t", "tool": "fail", "params": {"message": "m"}}]});
    let run = submit(&mesh, "acme", &again.to_string()).await;
    let done = settled(&mesh, "acme", &run).await;
    let t = done.steps.iter().find(|s| s.id == "t").expect("t");
    assert_eq!(t.status(), pb::StepStatus::Failed, "{}", t.error);
    assert!(!t.error.contains("semantic_duplicate"), "the key was freed by the failed branch: {}", t.error);
    let evs = events(&mut mesh.ledger(), "acme", &run).await;
    assert!(evs.iter().any(|e| e.event_type == "tool_requested"), "the call was allowed and made");
}

/// An alternative whose call renders the same semantic key as the failed call before it takes
/// the key over: what the key's holder came to is then the alternative's success, so a later
/// call with that key is a `semantic_duplicate` (a payment made by a later branch is never made
/// twice).
#[tokio::test]
async fn an_alternative_with_the_same_semantic_key_holds_it_when_it_succeeds() {
    let extra = "[[policy.semantic_keys]]\ntool = \"fail\"\ntemplate = \"pay:{message}\"\n\
                 [[policy.semantic_keys]]\ntool = \"echo\"\ntemplate = \"pay:{message}\"\n";
    let opts = warden_testkit::MeshOptions { policy_extra: extra.into(), ..warden_testkit::MeshOptions::default() };
    let mesh = mesh_with(Backend::Sqlite, opts).await;
    let work = json!({"steps": [{"id": "s", "tool": "fail", "params": {"message": "bob"},
                                 "alternatives": [{"tool": "echo", "params": {"message": "bob"}}]}]});
    let run = submit(&mesh, "acme", &work.to_string()).await;
    let done = settled(&mesh, "acme", &run).await;
    assert_eq!(done.status(), pb::RunStatus::Completed, "{}\n{}", done.reason, mesh.logs());
    let again = json!({"steps": [{"id": "t", "tool": "echo", "params": {"message": "bob"}}]});
    let run = submit(&mesh, "acme", &again.to_string()).await;
    let done = settled(&mesh, "acme", &run).await;
    let t = done.steps.iter().find(|s| s.id == "t").expect("t");
    assert_eq!(t.status(), pb::StepStatus::Denied, "the payment is not made twice: {}", t.error);
    assert!(t.error.contains("semantic_duplicate"), "{}", t.error);
    let evs = events(&mut mesh.ledger(), "acme", &run).await;
    assert!(!evs.iter().any(|e| e.event_type == "tool_requested"), "the duplicate never reached the tool");
}
