//! Bad input at the front door: the right code, the field named, nothing written.

use serde_json::json;
use warden_proto::v1 as pb;

use crate::*;

#[tokio::test]
async fn bad_submissions_name_the_field_and_write_nothing() {
    let mesh = mesh_on(Backend::Sqlite).await;
    let mut runs = mesh.runs();
    let submit = |tenant: &str, plan: String| pb::SubmitRunRequest {
        tenant: tenant.into(),
        plan_json: plan,
        ..Default::default()
    };
    let big = plan(&[("a", "echo", json!({"blob": "x".repeat(300 * 1024)}), &[])]);
    let cases = vec![
        (submit("acme", "{not json".into()), "plan_json"),
        (submit("acme", r#"{"steps":[{"id":"a","tool":"echo","parms":{}}]}"#.into()), "plan_json"),
        (submit("acme", r#"{"stepz":[]}"#.into()), "plan_json"),
        (submit("acme", big), "plan_json"),
        (submit("", HELLO.into()), "tenant"),
        (submit("bad tenant!", HELLO.into()), "tenant"),
        (submit("acme", plan(&[("a", "no.such.tool", json!({}), &[])])), "plan_json.steps[a].tool"),
        (
            submit("acme", plan(&[("a", "echo", json!({}), &["b"]), ("b", "echo", json!({}), &["a"])])),
            "plan_json.steps[a].depends_on",
        ),
        (submit("acme", plan(&[("a", "echo", json!({}), &["ghost"])])), "plan_json.steps[a].depends_on"),
        (
            submit("acme", plan(&[("a", "echo", json!({}), &[]), ("a", "echo", json!({}), &[])])),
            "plan_json.steps[a].id",
        ),
        (
            submit("acme", plan(&[("a", "echo", json!({"x": "{{b.output}}"}), &[]), ("b", "echo", json!({}), &[])])),
            "plan_json.steps[a].params",
        ),
        (submit("acme", plan(&[("bad id", "echo", json!({}), &[])])), "plan_json.steps[0].id"),
        (
            submit(
                "acme",
                plan(
                    &(0..11)
                        .map(|i| {
                            (Box::leak(format!("s{i}").into_boxed_str()) as &str, "echo", json!({}), &[] as &[&str])
                        })
                        .collect::<Vec<_>>(),
                ),
            ),
            "plan_json.steps",
        ),
        (
            pb::SubmitRunRequest { idempotency_key: "spaces are bad".into(), ..submit("acme", HELLO.into()) },
            "idempotency_key",
        ),
        (pb::SubmitRunRequest { cancel_policy: 99, ..submit("acme", HELLO.into()) }, "cancel_policy"),
        (pb::SubmitRunRequest { tenant: "acme".into(), ..Default::default() }, "plan_json"),
    ];
    for (req, field) in cases {
        let e = runs.submit_run(req).await.expect_err("refused");
        assert_field_violation(&e, field);
    }
    let e = runs
        .get_run(pb::GetRunRequest { tenant: "acme".into(), run_id: "01900000-0000-7000-8000-000000000000".into() })
        .await
        .expect_err("unknown");
    assert_eq!(e.code(), tonic::Code::NotFound);
    let e =
        runs.get_run(pb::GetRunRequest { tenant: "acme".into(), run_id: "../etc".into() }).await.expect_err("invalid");
    assert_field_violation(&e, "run_id");
    let listed = mesh.ledger().list_runs(pb::ListLedgerRunsRequest::default()).await.expect("list").into_inner();
    assert!(listed.runs.is_empty(), "no refused submission left a run: {:?}", listed.runs);
}

#[tokio::test]
async fn unimplemented_rpcs_say_so() {
    let mesh = mesh_on(Backend::Sqlite).await;
    let mut planner = warden_proto::v1::planner_client::PlannerClient::new(mesh.planner.channel());
    let e = planner.create_plan(pb::CreatePlanRequest::default()).await.expect_err("unimplemented");
    assert_eq!(e.code(), tonic::Code::Unimplemented);
}
