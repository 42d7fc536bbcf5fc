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
async fn create_plan_names_the_bad_field_or_the_missing_model() {
    let mesh = mesh_on(Backend::Sqlite).await;
    let mut planner = warden_proto::v1::planner_client::PlannerClient::new(mesh.planner.channel());
    let e = planner.create_plan(pb::CreatePlanRequest::default()).await.expect_err("no tenant");
    assert_field_violation(&e, "tenant");
    let ask = |goal: &str, replay_policy: i32| pb::CreatePlanRequest {
        tenant: "acme".into(),
        goal: goal.into(),
        replay_policy,
        ..Default::default()
    };
    assert_field_violation(&planner.create_plan(ask("x", 7)).await.expect_err("policy"), "replay_policy");
    assert_field_violation(&planner.create_plan(ask("", 0)).await.expect_err("goal"), "goal");
    let e = planner.create_plan(ask("plan something", 0)).await.expect_err("no model configured");
    assert_eq!(e.code(), tonic::Code::FailedPrecondition);
    assert!(e.message().contains("[planner.model]"), "{}", e.message());
}

/// A NUL byte in any string of any request is refused at the server's decoder — before a
/// handler, a database or a policy sees it — as INVALID_ARGUMENT naming the field. PostgreSQL
/// TEXT cannot store NUL: before, such a string failed in the database as a retryable-looking
/// UNAVAILABLE. Unary and server-streaming RPCs of every service, top-level, repeated and
/// nested fields.
#[tokio::test]
async fn nul_bytes_in_any_request_string_are_invalid_argument_naming_the_field() {
    use warden_proto::v1::approvals_client::ApprovalsClient;
    use warden_proto::v1::capabilities_client::CapabilitiesClient;
    use warden_proto::v1::planner_client::PlannerClient;

    let mesh = mesh_on(Backend::Postgres).await;
    let tenant = "acme";
    let run_id = bare_run(&mesh, tenant).await;
    let (mut ledger, mut runs, mut policy, mut tools) = (mesh.ledger(), mesh.runs(), mesh.policy(), mesh.tool_host());
    let mut approvals = ApprovalsClient::new(mesh.policy.channel_as(&mesh.token));
    let mut caps = CapabilitiesClient::new(mesh.policy.channel_as(&mesh.token));
    let mut planner = PlannerClient::new(mesh.planner.channel_as(&mesh.token));
    let t = || tenant.to_string();

    // Ledger.
    let summaries = pb::ListSummariesRequest {
        tenant: t(),
        run_id: run_id.clone(),
        summary_type: "tool\0".into(),
        ..Default::default()
    };
    assert_field_violation(&ledger.list_summaries(summaries).await.expect_err("refused"), "summary_type");
    let state = pb::GetStateRequest { tenant: t(), key: "k\0".into() };
    assert_field_violation(&ledger.get_state(state).await.expect_err("refused"), "key");
    let append = pb::AppendEventRequest {
        tenant: t(),
        run_id: run_id.clone(),
        event_type: "note".into(),
        payload_json: "{\"text\":\"a\0b\"}".into(),
        ..Default::default()
    };
    assert_field_violation(&ledger.append_event(append).await.expect_err("refused"), "payload_json");
    let stream = pb::StreamEventsRequest { tenant: t(), run_id: format!("{run_id}\0"), since_seq: 0, follow: true };
    assert_field_violation(&ledger.stream_events(stream).await.expect_err("refused (streaming)"), "run_id");

    // Runs: a repeated field names its element.
    let submit = |f: fn(&mut pb::SubmitRunRequest)| {
        let mut req = pb::SubmitRunRequest { tenant: t(), plan_json: HELLO.into(), ..Default::default() };
        f(&mut req);
        req
    };
    let handles = submit(|r| r.capability_handles = vec!["cap_ok".into(), "cap\0".into()]);
    assert_field_violation(&runs.submit_run(handles).await.expect_err("refused"), "capability_handles[1]");
    let goal = submit(|r| r.goal = "\0".into());
    assert_field_violation(&runs.submit_run(goal).await.expect_err("refused"), "goal");
    let get = pb::GetRunRequest { tenant: t(), run_id: format!("{run_id}\0") };
    assert_field_violation(&runs.get_run(get).await.expect_err("refused"), "run_id");

    // Policy.
    let authorize = pb::AuthorizeRequest {
        tenant: t(),
        run_id: run_id.clone(),
        step_id: "a".into(),
        attempt: 1,
        tool: "echo".into(),
        args_json: "{\"message\":\"\0\"}".into(),
        idempotency_key: "k1".into(),
        ..Default::default()
    };
    assert_field_violation(&policy.authorize(authorize.clone()).await.expect_err("refused"), "args_json");
    let check = pb::AuthorizeRequest { args_json: "{}".into(), tool: "echo\0".into(), ..authorize };
    assert_field_violation(&policy.check(check).await.expect_err("refused"), "tool");

    // Approvals (unary and streaming) and capabilities.
    let resolve = pb::ResolveApprovalRequest {
        tenant: t(),
        approval_id: "00000000-0000-0000-0000-000000000000".into(),
        approver: "ops\0".into(),
        reason: "ok".into(),
    };
    assert_field_violation(&approvals.approve(resolve).await.expect_err("refused"), "approver");
    let watch = pb::WatchApprovalsRequest { tenant: "acme\0".into() };
    assert_field_violation(&approvals.watch(watch).await.expect_err("refused (streaming)"), "tenant");
    let issue = pb::IssueCapabilityRequest {
        tenant: t(),
        tool_patterns: vec!["echo".into(), "kv.\0".into()],
        ttl_seconds: 60,
        ..Default::default()
    };
    assert_field_violation(&caps.issue(issue).await.expect_err("refused"), "tool_patterns[1]");
    let revoke = pb::RevokeCapabilityRequest { tenant: t(), capability_id: "c".into(), reason: "\0".into() };
    assert_field_violation(&caps.revoke(revoke).await.expect_err("refused"), "reason");

    // Planner and tool host; a nested message field is named by its path.
    let validate = pb::ValidatePlanRequest { tenant: t(), plan_json: format!("{HELLO}\0") };
    assert_field_violation(&planner.validate_plan(validate).await.expect_err("refused"), "plan_json");
    let auth = pb::SignedAuthorization { key_id: "key\0".into(), ..Default::default() };
    let invoke = pb::InvokeRequest { tenant: t(), authorization: Some(auth), ..Default::default() };
    assert_field_violation(&tools.invoke(invoke).await.expect_err("refused"), "authorization.key_id");

    // Nothing was written, and the backends still answer.
    let listed = ledger.list_runs(pb::ListLedgerRunsRequest::default()).await.expect("list").into_inner();
    assert_eq!(listed.runs.iter().map(|r| r.run_id.as_str()).collect::<Vec<_>>(), vec![run_id.as_str()]);
    let summaries = pb::ListSummariesRequest { tenant: t(), run_id, summary_type: "tool".into(), ..Default::default() };
    ledger.list_summaries(summaries).await.expect("a clean request still succeeds");
}
