//! Cedar policies in the running mesh: decisions through every service, reload without a
//! restart, and a bad change refused while the previous set stays live.

use std::time::Duration;

use serde_json::json;
use warden_proto::v1 as pb;
use warden_testkit::MeshOptions;

use crate::*;

const SCHEMA: &str = r#"
entity Tenant;
entity Tool;
action "text.upper" appliesTo { principal: [Tenant], resource: [Tool], context: { text: String } };
action "email.send" appliesTo {
  principal: [Tenant], resource: [Tool],
  context: { to: String, subject: String, body: String }
};
"#;

const POLICIES: &str = r#"
@id("acme-may-shout")
permit(principal == Tenant::"acme", action == Action::"text.upper", resource);
@id("acme-may-mail")
permit(principal == Tenant::"acme", action == Action::"email.send", resource);
@id("mail-stays-inside")
forbid(principal, action == Action::"email.send", resource) unless { context.to like "*@example.com" };
"#;

fn mail(to: &str) -> String {
    plan(&[
        ("shout", "text.upper", json!({"text": "hi"}), &[]),
        ("mail", "email.send", json!({"to": to, "subject": "s", "body": "{{shout.output.text}}"}), &["shout"]),
    ])
}

#[tokio::test]
async fn cedar_policies_decide_and_reload_without_a_restart() {
    let dir = tempfile::tempdir().expect("dir");
    std::fs::write(dir.path().join("schema.cedarschema"), SCHEMA).expect("schema");
    std::fs::write(dir.path().join("main.cedar"), POLICIES).expect("policies");
    let opts = MeshOptions { policy_dir: dir.path().display().to_string(), ..MeshOptions::default() };
    let mesh = mesh_with(Backend::Sqlite, opts).await;

    let inside = submit(&mesh, "acme", &mail("ops@example.com")).await;
    let first = settled(&mesh, "acme", &inside).await;
    assert_eq!(first.status(), pb::RunStatus::Completed, "{}", first.reason);
    let outside = submit(&mesh, "acme", &mail("leak@evil.test")).await;
    let run = settled(&mesh, "acme", &outside).await;
    assert_eq!(run.status(), pb::RunStatus::Failed);
    assert!(run.reason.contains("mail-stays-inside"), "{}", run.reason);
    assert_eq!(mesh.outbox().len(), 1, "only the inside mail went out");

    // Reload: a new file forbidding shouting takes effect without a restart.
    let forbid_shout = r#"@id("no-shouting") forbid(principal, action == Action::"text.upper", resource);"#;
    std::fs::write(dir.path().join("quiet.cedar"), forbid_shout).expect("write");
    let mut policy = mesh.policy();
    let check = |mut p: warden_proto::v1::policy_client::PolicyClient<warden_grpc::auth::Ch>| async move {
        p.check(pb::AuthorizeRequest {
            tenant: "acme".into(),
            run_id: "r".into(),
            step_id: "s".into(),
            attempt: 1,
            tool: "text.upper".into(),
            args_json: r#"{"text":"x"}"#.into(),
            capability_handle: String::new(),
            idempotency_key: "r:s:1".into(),
            epoch: 0,
            agent: String::new(),
            retry_of: String::new(),
            caller_records: false,
            base_rules_only: false,
            ..Default::default()
        })
        .await
        .expect("check")
        .into_inner()
    };
    let reloaded = warden_testkit::eventually(Duration::from_secs(20), || {
        let p = policy.clone();
        async move { (check(p).await.rule_id == "cedar:no-shouting").then_some(()) }
    })
    .await;
    assert!(reloaded.is_some(), "the new policy is live without a restart");

    // A bad change is refused; the live set stays (shouting is still forbidden).
    std::fs::remove_file(dir.path().join("quiet.cedar")).expect("remove");
    std::fs::write(dir.path().join("broken.cedar"), "permit(principal, action == Action::\"nope\", resource);")
        .expect("write");
    // Wait for the policy service to have seen (and refused) the change, then check.
    let log_path = mesh.policy.log.clone();
    let refused = warden_testkit::eventually(Duration::from_secs(20), || {
        let log = std::fs::read_to_string(&log_path).unwrap_or_default();
        async move { (log.contains("broken.cedar") && log.contains("refused")).then_some(()) }
    })
    .await;
    assert!(refused.is_some(), "the refusal is logged with the file");
    let d = check(policy.clone()).await;
    assert_eq!(d.rule_id, "cedar:no-shouting", "the previous set stays live");
    let _ = &mut policy;
}

fn approvals_client(
    mesh: &warden_testkit::Mesh,
) -> warden_proto::v1::approvals_client::ApprovalsClient<warden_grpc::auth::Ch> {
    warden_proto::v1::approvals_client::ApprovalsClient::new(mesh.policy.channel_as(&mesh.token))
}

async fn wait_status(mesh: &warden_testkit::Mesh, run_id: &str, want: pb::RunStatus) -> pb::Run {
    let found = warden_testkit::eventually(Duration::from_secs(60), || {
        let mut runs = mesh.runs();
        let id = run_id.to_string();
        async move {
            let run = runs.get_run(pb::GetRunRequest { tenant: "acme".into(), run_id: id }).await.ok()?.into_inner();
            (run.status() == want).then_some(run)
        }
    })
    .await;
    found.unwrap_or_else(|| panic!("run {run_id} never became {want:?}\n{}", mesh.logs()))
}

async fn pending(mesh: &warden_testkit::Mesh) -> Vec<pb::Approval> {
    approvals_client(mesh)
        .list(pb::ListApprovalsRequest {
            tenant: "acme".into(),
            state: pb::ApprovalState::Pending as i32,
            ..Default::default()
        })
        .await
        .expect("list")
        .into_inner()
        .approvals
}

fn resolve(id: &str, approver: &str) -> pb::ResolveApprovalRequest {
    pb::ResolveApprovalRequest {
        tenant: "acme".into(),
        approval_id: id.into(),
        approver: approver.into(),
        reason: "checked".into(),
    }
}

/// K18: approvals bind to the argument digest; the run waits in `blocked` holding no
/// executor; approvals survive a policy restart; approving twice changes nothing; only
/// listed approvers may approve; a denial is never retried. The same run and step asking
/// with changed arguments gets no allow from the approval of the first ones: a new approval
/// is requested, and the approved arguments stay allowed.
async fn k18(backend: Backend) {
    let opts = MeshOptions {
        approval_rules: vec![("acme".into(), vec!["email.send".into()], vec!["alice".into()])],
        ..MeshOptions::default()
    };
    let mut mesh = mesh_with(backend, opts).await;

    let id = submit(&mesh, "acme", &mail("ops@example.com")).await;
    let blocked = wait_status(&mesh, &id, pb::RunStatus::Blocked).await;
    assert!(blocked.reason.contains("approval"), "{}", blocked.reason);
    assert!(mesh.outbox().is_empty(), "nothing is sent before the approval");
    let waiting = pending(&mesh).await;
    assert_eq!(waiting.len(), 1);
    let approval = waiting[0].clone();
    let args = json!({"to": "ops@example.com", "subject": "s", "body": "HI"});
    assert_eq!(approval.args_sha256, warden_core::canonical::args_digest(&args), "bound to the exact arguments");

    // Durable: the policy service restarts while the approval waits.
    mesh.policy.restart().expect("restart policy");
    assert_eq!(pending(&mesh).await.len(), 1, "the approval survived the restart");

    let e =
        approvals_client(&mesh).approve(resolve(&approval.approval_id, "mallory")).await.expect_err("not an approver");
    assert_eq!(e.code(), tonic::Code::PermissionDenied);
    let ok =
        approvals_client(&mesh).approve(resolve(&approval.approval_id, "alice")).await.expect("approve").into_inner();
    assert_eq!((ok.state(), ok.approver.as_str()), (pb::ApprovalState::Approved, "alice"));
    let again = approvals_client(&mesh)
        .approve(resolve(&approval.approval_id, "alice"))
        .await
        .expect("approving twice")
        .into_inner();
    assert_eq!(again, ok, "approving twice changes nothing");
    let done = settled(&mesh, "acme", &id).await;
    assert_eq!(done.status(), pb::RunStatus::Completed, "{}", done.reason);
    assert_eq!(mesh.outbox().len(), 1);

    // Changed arguments need a new approval.
    let other = submit(&mesh, "acme", &mail("finance@example.com")).await;
    wait_status(&mesh, &other, pb::RunStatus::Blocked).await;
    let fresh = pending(&mesh).await;
    assert_eq!(fresh.len(), 1);
    assert_ne!(fresh[0].approval_id, approval.approval_id);
    approvals_client(&mesh).deny(resolve(&fresh[0].approval_id, "alice")).await.expect("deny");
    let denied = settled(&mesh, "acme", &other).await;
    assert_eq!(denied.status(), pb::RunStatus::Failed);
    assert!(denied.reason.contains("human_denied"), "{}", denied.reason);
    assert_eq!(mesh.outbox().len(), 1, "the denied mail never went out");
    let e = approvals_client(&mesh).approve(resolve(&fresh[0].approval_id, "alice")).await.expect_err("already denied");
    assert_eq!(e.code(), tonic::Code::FailedPrecondition);

    // The same run and step, the arguments changed after the approval.
    let run = planned_run(&mesh, "acme", &[("m", "email.send")]).await;
    let mail_to = |to: &str| json!({"to": to, "subject": "s", "body": "b"});
    let ask = |args: serde_json::Value, key: &str| {
        let mut req = authorize(&run, "m", "email.send", args);
        req.idempotency_key = format!("{run}:m:{key}");
        let mut policy = mesh.policy();
        async move { policy.authorize(req).await.expect("authorize").into_inner().decision.expect("decision") }
    };
    let first = ask(mail_to("ops@example.com"), "1").await;
    assert_eq!(first.outcome(), pb::Outcome::ApprovalRequired);
    let asked = pending(&mesh).await;
    let asked = asked.iter().find(|a| a.run_id == run).expect("an approval for the run");
    approvals_client(&mesh).approve(resolve(&asked.approval_id, "alice")).await.expect("approve");
    let allowed = ask(mail_to("ops@example.com"), "1").await;
    assert_eq!((allowed.outcome(), allowed.rule_id.as_str()), (pb::Outcome::Allow, "approval_gate"));
    let changed = ask(mail_to("attacker@example.com"), "2").await;
    assert_eq!(changed.outcome(), pb::Outcome::ApprovalRequired, "changed arguments: {}", changed.reason);
    let renewed = pending(&mesh).await;
    let renewed: Vec<_> = renewed.iter().filter(|a| a.run_id == run).collect();
    assert_eq!(renewed.len(), 1, "a new approval, for the new arguments");
    assert_ne!(renewed[0].approval_id, asked.approval_id);
    assert_eq!(renewed[0].args_sha256, warden_core::canonical::args_digest(&mail_to("attacker@example.com")));
    assert_eq!(renewed[0].step_id, "m");
    // Reusing the approved call's key for other arguments is no way around it either.
    let mut req = authorize(&run, "m", "email.send", mail_to("attacker@example.com"));
    req.idempotency_key = format!("{run}:m:1");
    match mesh.policy().authorize(req).await {
        Ok(r) => assert_ne!(r.into_inner().decision.expect("decision").outcome(), pb::Outcome::Allow),
        Err(e) => assert!(matches!(e.code(), tonic::Code::InvalidArgument | tonic::Code::FailedPrecondition), "{e:?}"),
    }
}

#[tokio::test]
async fn k18_approvals_bind_to_the_argument_digest_and_wait_durably_on_sqlite() {
    k18(Backend::Sqlite).await;
}

#[tokio::test]
async fn k18_approvals_bind_to_the_argument_digest_and_wait_durably_on_postgres() {
    k18(Backend::Postgres).await;
}

/// `Approvals.Watch`: the tenant's approvals as they are, then each change — a new request, a
/// resolution, an expiry — as it happens; a watcher that joins later starts from the current
/// state.
#[tokio::test]
async fn approvals_watch_streams_the_current_state_then_each_change() {
    let opts = MeshOptions {
        executors: 0,
        approval_rules: vec![("acme".into(), vec!["email.send".into()], vec!["alice".into()])],
        policy_extra: "approval_ttl_secs = 3".into(),
        ..MeshOptions::default()
    };
    let mesh = mesh_with(Backend::Sqlite, opts).await;
    let run = planned_run(&mesh, "acme", &[("m1", "email.send"), ("m2", "email.send")]).await;
    let watch = || async {
        let req = pb::WatchApprovalsRequest { tenant: "acme".into() };
        approvals_client(&mesh).watch(req).await.expect("watch").into_inner()
    };
    let next = async |s: &mut tonic::Streaming<pb::Approval>| {
        // A guard against hanging, not a latency bound.
        let got = tokio::time::timeout(Duration::from_secs(60), s.message()).await;
        got.expect("a change arrives").expect("stream ok").expect("stream open")
    };
    let mut first = watch().await;
    let mail = |to: &str| json!({"to": to, "subject": "s", "body": "b"});
    let d = mesh.policy().authorize(authorize(&run, "m1", "email.send", mail("a@example.com"))).await.expect("ask");
    assert_eq!(d.into_inner().decision.expect("decision").outcome(), pb::Outcome::ApprovalRequired);
    let asked = next(&mut first).await;
    assert_eq!((asked.state(), asked.step_id.as_str()), (pb::ApprovalState::Pending, "m1"));
    // A three-second TTL: on a slow machine the approval may expire before it is approved;
    // either way the watcher sees it settle.
    let resolved = approvals_client(&mesh).approve(resolve(&asked.approval_id, "alice")).await;
    let settled_state = next(&mut first).await;
    assert_eq!(settled_state.approval_id, asked.approval_id);
    let want = if resolved.is_ok() { pb::ApprovalState::Approved } else { pb::ApprovalState::Expired };
    assert_eq!(settled_state.state(), want);

    let mut later = watch().await;
    let snapshot = next(&mut later).await;
    assert_eq!((snapshot.approval_id.as_str(), snapshot.state()), (asked.approval_id.as_str(), want));

    // Nobody answers the second request: both watchers see it expire.
    mesh.policy().authorize(authorize(&run, "m2", "email.send", mail("b@example.com"))).await.expect("ask");
    for w in [&mut first, &mut later] {
        let mut seen = next(w).await;
        if seen.state() == pb::ApprovalState::Pending {
            seen = next(w).await;
        }
        assert_eq!((seen.step_id.as_str(), seen.state()), ("m2", pb::ApprovalState::Expired));
    }
}

/// With tokens, an approver is who their token says (`tenant@person`), not a name the caller
/// types: a plain tenant token cannot resolve a tenant's approvals that name approvers, a
/// person cannot approve under another name, and one not on the list may not approve.
#[tokio::test]
async fn approvers_are_who_their_tokens_say() {
    use tonic::Code;
    let (ops, tenant, alice, bob) = (
        "ops-token-0123456789abcdef",
        "acme-token-0123456789abcdef",
        "alice-token-0123456789abcdef",
        "bob-token-0123456789abcdef",
    );
    let opts = MeshOptions {
        executors: 0,
        approval_rules: vec![("acme".into(), vec!["email.send".into()], vec!["alice".into()])],
        auth_tokens: vec![
            (ops.into(), "*".into()),
            (tenant.into(), "acme".into()),
            (alice.into(), "acme@alice".into()),
            (bob.into(), "acme@bob".into()),
        ],
        service_token: ops.into(),
        ..MeshOptions::default()
    };
    let mesh = mesh_with(Backend::Sqlite, opts).await;
    let run = planned_run(&mesh, "acme", &[("m1", "email.send")]).await;
    let mail = json!({"to": "ops@example.com", "subject": "s", "body": "b"});
    let d = mesh.policy().authorize(authorize(&run, "m1", "email.send", mail)).await.expect("ask").into_inner();
    assert_eq!(d.decision.expect("decision").outcome(), pb::Outcome::ApprovalRequired);
    let id = pending(&mesh).await[0].approval_id.clone();
    let as_token = |token: &str, name: &str| {
        let mut c = warden_proto::v1::approvals_client::ApprovalsClient::new(mesh.policy.channel_as(token));
        let req = pb::ResolveApprovalRequest {
            tenant: "acme".into(),
            approval_id: id.clone(),
            approver: name.into(),
            reason: "checked".into(),
        };
        async move { c.approve(req).await.map(|r| r.into_inner()) }
    };
    let code = |r: Result<pb::Approval, tonic::Status>| r.expect_err("refused").code();
    assert_eq!(code(as_token(tenant, "alice").await), Code::PermissionDenied, "a tenant token is nobody");
    assert_eq!(code(as_token(alice, "carol").await), Code::PermissionDenied, "alice approves as alice");
    assert_eq!(code(as_token(bob, "").await), Code::PermissionDenied, "bob is not an approver");
    let ok = as_token(alice, "").await.expect("alice approves");
    assert_eq!((ok.state(), ok.approver.as_str()), (pb::ApprovalState::Approved, "alice"));
}

fn authorize(run: &str, step: &str, tool: &str, args: serde_json::Value) -> pb::AuthorizeRequest {
    pb::AuthorizeRequest {
        tenant: "acme".into(),
        run_id: run.into(),
        step_id: step.into(),
        attempt: 1,
        tool: tool.into(),
        args_json: args.to_string(),
        capability_handle: String::new(),
        idempotency_key: format!("{run}:{step}:1"),
        epoch: 0,
        agent: String::new(),
        retry_of: String::new(),
        caller_records: false,
        base_rules_only: false,
        ..Default::default()
    }
}

/// Maple: a consequential tool needs an explicit commitment (here a capability bound to the
/// run); built-in invariants then guard its arguments; safe tools pass with a recorded allow.
#[tokio::test]
async fn consequential_tools_need_a_commitment_and_invariants_guard_arguments() {
    let opts = MeshOptions {
        executors: 0,
        policy_extra: r#"consequential_tools = ["email.send"]
[[policy.invariants]]
kind = "email_domain_allowlist"
tool = "email.send"
field = "to"
domains = ["example.com"]
"#
        .into(),
        ..MeshOptions::default()
    };
    let mesh = mesh_with(Backend::Sqlite, opts).await;
    let run =
        planned_run(&mesh, "acme", &[("m1", "email.send"), ("m2", "email.send"), ("m3", "email.send"), ("e1", "echo")])
            .await;
    let mut policy = mesh.policy();
    let decide = |d: pb::AuthorizeResponse| {
        let x = d.decision.expect("decision");
        (x.outcome(), x.rule_id)
    };
    let inside = json!({"to": "ops@example.com", "subject": "s", "body": "b"});
    let d = policy.authorize(authorize(&run, "m1", "email.send", inside.clone())).await.expect("decide").into_inner();
    assert_eq!(decide(d), (pb::Outcome::Deny, "missing_commitment".to_string()));
    let safe = policy.authorize(authorize(&run, "e1", "echo", json!({}))).await.expect("decide").into_inner();
    assert_eq!(decide(safe), (pb::Outcome::Allow, "tenant_allowlist".to_string()), "safe tools pass, recorded");

    let mut caps = warden_proto::v1::capabilities_client::CapabilitiesClient::new(mesh.policy.channel());
    let cap = caps
        .issue(pb::IssueCapabilityRequest {
            tenant: "acme".into(),
            tool_patterns: vec!["email.send".into()],
            ttl_seconds: 600,
            run_id: run.clone(),
            ..Default::default()
        })
        .await
        .expect("issue")
        .into_inner();
    let ok = policy.authorize(authorize(&run, "m2", "email.send", inside)).await.expect("decide").into_inner();
    let claims: serde_json::Value =
        serde_json::from_slice(&ok.authorization.clone().expect("signed").claims_json).expect("claims");
    assert_eq!(decide(ok), (pb::Outcome::Allow, "capability".to_string()));
    assert_eq!(claims["capability_id"], json!(cap.capability_id));
    let outside = json!({"to": "leak@evil.test", "subject": "s", "body": "b"});
    let bad = policy.authorize(authorize(&run, "m3", "email.send", outside)).await.expect("decide").into_inner();
    assert_eq!(decide(bad), (pb::Outcome::Deny, "email_domain_allowlist".to_string()));
}

/// Principals are tenants and their agents. A token bound to an agent (`acme/mailer`) fixes
/// the agent its runs act for and cannot name another; Cedar sees `Agent::"acme/mailer"`, a
/// member of `Tenant::"acme"`, so tenant-wide and per-agent policies both apply.
#[tokio::test]
async fn agents_are_cedar_principals_and_an_agent_token_cannot_pose_as_another() {
    use tonic::Code;
    let dir = tempfile::tempdir().expect("dir");
    let schema = r#"
entity Tenant;
entity Agent in [Tenant];
entity Tool;
action "text.upper" appliesTo { principal: [Tenant, Agent], resource: [Tool], context: { text: String } };
action "email.send" appliesTo {
  principal: [Tenant, Agent], resource: [Tool],
  context: { to: String, subject: String, body: String }
};
"#;
    let policies = r#"
@id("acme-shouts")
permit(principal in Tenant::"acme", action == Action::"text.upper", resource);
@id("only-the-mailer-mails")
permit(principal == Agent::"acme/mailer", action == Action::"email.send", resource);
"#;
    std::fs::write(dir.path().join("schema.cedarschema"), schema).expect("schema");
    std::fs::write(dir.path().join("main.cedar"), policies).expect("policies");
    let (ops, mailer, intern) =
        ("ops-token-0123456789abcdef", "mailer-token-0123456789abcdef", "intern-token-0123456789abcdef");
    let opts = MeshOptions {
        policy_dir: dir.path().display().to_string(),
        auth_tokens: vec![
            (ops.into(), "*".into()),
            (mailer.into(), "acme/mailer".into()),
            (intern.into(), "acme/intern".into()),
        ],
        service_token: ops.into(),
        ..MeshOptions::default()
    };
    let mesh = mesh_with(Backend::Sqlite, opts).await;
    let submit_as = |token: &'static str, agent: &str| {
        let req = pb::SubmitRunRequest {
            tenant: "acme".into(),
            plan_json: mail("ops@example.com"),
            agent: agent.into(),
            ..Default::default()
        };
        let mut runs = mesh.runs_as(token);
        async move { runs.submit_run(req).await.map(|r| r.into_inner().run_id) }
    };

    let by_mailer = submit_as(mailer, "").await.expect("the mailer submits");
    let run = settled(&mesh, "acme", &by_mailer).await;
    assert_eq!((run.status(), run.agent.as_str()), (pb::RunStatus::Completed, "mailer"), "{}", run.reason);
    let evs = events(&mut mesh.ledger(), "acme", &by_mailer).await;
    let recorded: Vec<Value> = evs.iter().filter(|e| e.event_type == "policy_decision").map(payload).collect();
    assert!(recorded.iter().all(|d| d["agent"] == json!("mailer")), "{recorded:?}");
    assert_eq!(recorded.last().map(|d| d["rule_id"].clone()), Some(json!("cedar:only-the-mailer-mails")));

    let by_intern = submit_as(intern, "").await.expect("the intern submits");
    let run = settled(&mesh, "acme", &by_intern).await;
    assert_eq!(run.status(), pb::RunStatus::Failed);
    assert!(run.reason.contains("cedar_default_deny") && run.reason.contains("acme/intern"), "{}", run.reason);
    let shout = run.steps.iter().find(|s| s.id == "shout").expect("shout");
    assert_eq!(shout.status(), pb::StepStatus::Completed, "the tenant-wide policy covers every agent");

    let posing = submit_as(intern, "mailer").await.expect_err("an agent token naming another agent");
    assert_eq!(posing.code(), Code::PermissionDenied, "{posing:?}");
    let mut policy = warden_proto::v1::policy_client::PolicyClient::new(mesh.policy.channel_as(intern));
    let mut req =
        authorize(&by_intern, "x", "email.send", json!({"to": "ops@example.com", "subject": "s", "body": "b"}));
    req.agent = "mailer".into();
    let e = policy.authorize(req).await.expect_err("posing at the policy service");
    assert_eq!(e.code(), Code::PermissionDenied);

    // An agent token carries an agent's authority, not the tenant's.
    let denied = |r: Result<(), tonic::Status>| r.expect_err("refused").code();
    let cancel = pb::CancelRunRequest { tenant: "acme".into(), run_id: by_mailer.clone(), reason: String::new() };
    assert_eq!(denied(mesh.runs_as(intern).cancel_run(cancel).await.map(|_| ())), Code::PermissionDenied);
    let reconcile = pb::ReconcileStepRequest {
        tenant: "acme".into(),
        run_id: by_intern.clone(),
        step_id: "mail".into(),
        outcome: "failed".into(),
        operator: "intern".into(),
        ..Default::default()
    };
    assert_eq!(denied(mesh.runs_as(intern).reconcile_step(reconcile).await.map(|_| ())), Code::PermissionDenied);
    let mut caps = warden_proto::v1::capabilities_client::CapabilitiesClient::new(mesh.policy.channel_as(intern));
    let issue = pb::IssueCapabilityRequest {
        tenant: "acme".into(),
        tool_patterns: vec!["email.send".into()],
        ttl_seconds: 60,
        ..Default::default()
    };
    assert_eq!(denied(caps.issue(issue).await.map(|_| ())), Code::PermissionDenied, "no minting authority");
    let mut approvals = warden_proto::v1::approvals_client::ApprovalsClient::new(mesh.policy.channel_as(intern));
    let approve = pb::ResolveApprovalRequest {
        tenant: "acme".into(),
        approval_id: "apr-x".into(),
        approver: "intern".into(),
        reason: String::new(),
    };
    assert_eq!(denied(approvals.approve(approve).await.map(|_| ())), Code::PermissionDenied);
    let forged = pb::AppendEventRequest {
        tenant: "acme".into(),
        run_id: by_intern.clone(),
        epoch: 99,
        idempotency_key: "decision:forged".into(),
        event_type: "policy_decision".into(),
        payload_json: json!({"decision_id": "forged", "outcome": "allow"}).to_string(),
        step_id: "mail".into(),
    };
    assert_eq!(denied(mesh.ledger_as(intern).append_event(forged).await.map(|_| ())), Code::PermissionDenied);
    let artifact = |run_id: &str| pb::PutArtifactRequest {
        tenant: "acme".into(),
        run_id: run_id.into(),
        epoch: 0,
        idempotency_key: "note-1".into(),
        key: "note".into(),
        value_json: "1".into(),
    };
    let theirs = mesh.ledger_as(intern).put_artifact(artifact(&by_mailer)).await.map(|_| ());
    assert_eq!(denied(theirs), Code::PermissionDenied, "another agent's run");
    let fencing = pb::PutArtifactRequest { epoch: u64::MAX, ..artifact(&by_intern) };
    let raised = mesh.ledger_as(intern).put_artifact(fencing).await.map(|_| ());
    assert_eq!(denied(raised), Code::PermissionDenied, "only lease holders raise a run's epoch");
    let mut policy_as_intern = warden_proto::v1::policy_client::PolicyClient::new(mesh.policy.channel_as(intern));
    let mut on_theirs = authorize(&by_mailer, "y", "text.upper", json!({"text": "x"}));
    on_theirs.agent = "intern".into();
    let e = policy_as_intern.authorize(on_theirs.clone()).await.expect_err("another agent's run");
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    let mut fenced = authorize(&by_intern, "y", "text.upper", json!({"text": "x"}));
    fenced.epoch = 7;
    assert_eq!(policy_as_intern.authorize(fenced).await.expect_err("epoch").code(), Code::PermissionDenied);
    let mut retry = authorize(&by_intern, "y", "text.upper", json!({"text": "x"}));
    (retry.attempt, retry.retry_of) = (2, "d1".into());
    assert_eq!(policy_as_intern.authorize(retry).await.expect_err("retry").code(), Code::PermissionDenied);

    let by_ops = submit_as(ops, "mailer").await.expect("an operator names the agent");
    assert_eq!(settled(&mesh, "acme", &by_ops).await.status(), pb::RunStatus::Completed);
    assert_eq!(mesh.outbox().len(), 2, "the mailer's two runs mailed; the intern's did not");
}

/// Seed 002's code invariants: `ast_validation_passed` refuses source that does not parse as
/// Python 3, `linter_passed` refuses code that breaks a selected lint rule; each deny names the
/// line and rule and is recorded in the ledger like every other decision.
#[tokio::test]
async fn python_invariants_refuse_code_that_does_not_parse_or_lint() {
    let opts = MeshOptions {
        executors: 0,
        policy_extra: r#"[[policy.invariants]]
kind = "ast_validation_passed"
tool = "echo"
field = "code"
[[policy.invariants]]
kind = "linter_passed"
tool = "echo"
field = "code"
select = ["E722", "S307", "T100"]
"#
        .into(),
        ..MeshOptions::default()
    };
    let mesh = mesh_with(Backend::Sqlite, opts).await;
    let run = planned_run(&mesh, "acme", &[("ok", "echo"), ("py2", "echo"), ("eval", "echo"), ("long", "echo")]).await;
    let mut policy = mesh.policy();
    let long = format!("x = '{}'\n", "a".repeat(200));
    let cases = [
        ("ok", "def area(r):\n    return 3.14159 * r ** 2\n", pb::Outcome::Allow, "tenant_allowlist", ""),
        ("py2", "x = 1\nprint 'hello'\n", pb::Outcome::Deny, "ast_validation_passed", "line 2: E999"),
        ("eval", "def f(s):\n    return eval(s)\n", pb::Outcome::Deny, "linter_passed", "line 2: S307"),
        ("long", long.as_str(), pb::Outcome::Allow, "tenant_allowlist", ""),
    ];
    for (step, code, outcome, rule, reason) in cases {
        let d = policy.authorize(authorize(&run, step, "echo", json!({"code": code}))).await.expect("decide");
        let d = d.into_inner().decision.expect("decision");
        assert_eq!((d.outcome(), d.rule_id.as_str()), (outcome, rule), "{step}: {}", d.reason);
        assert!(d.reason.contains(reason), "{step}: {}", d.reason);
    }
    let evs = events(&mut mesh.ledger(), "acme", &run).await;
    let recorded: Vec<Value> = evs.iter().filter(|e| e.event_type == "policy_decision").map(payload).collect();
    let rules: Vec<&str> = recorded.iter().filter_map(|p| p["rule_id"].as_str()).collect();
    assert_eq!(rules, ["tenant_allowlist", "ast_validation_passed", "linter_passed", "tenant_allowlist"]);
    assert!(recorded[2]["reason"].as_str().is_some_and(|r| r.contains("S307")), "{}", recorded[2]);
}

/// The commitment through the front door: a run carries capability handles
/// (`SubmitRun.capability_handles`), checked before anything is written and attached before
/// it starts, so its consequential step runs under them — and the receipt names the
/// capability. Without one the step is `missing_commitment`; a bad handle writes nothing.
#[tokio::test]
async fn a_run_carries_its_commitment_as_capability_handles() {
    use tonic::Code;
    let mut opts =
        MeshOptions { policy_extra: r#"consequential_tools = ["email.send"]"#.into(), ..MeshOptions::default() };
    opts.tenants.push(("globex".into(), vec!["echo".into()]));
    let mesh = mesh_with(Backend::Sqlite, opts).await;
    let mut caps = warden_proto::v1::capabilities_client::CapabilitiesClient::new(mesh.policy.channel());
    let issue = |tenant: &str| pb::IssueCapabilityRequest {
        tenant: tenant.into(),
        tool_patterns: vec!["email.send".into()],
        ttl_seconds: 600,
        ..Default::default()
    };
    let cap = caps.issue(issue("acme")).await.expect("issue").into_inner();
    let theirs = caps.issue(issue("globex")).await.expect("issue").into_inner();
    let submit_with = |handles: Vec<String>| {
        let req = pb::SubmitRunRequest {
            tenant: "acme".into(),
            plan_json: mail("ops@example.com"),
            capability_handles: handles,
            ..Default::default()
        };
        let mut runs = mesh.runs();
        async move { runs.submit_run(req).await.map(|r| r.into_inner().run_id) }
    };

    let bare = submit_with(vec![]).await.expect("submit");
    let run = settled(&mesh, "acme", &bare).await;
    assert_eq!(run.status(), pb::RunStatus::Failed);
    assert!(run.reason.contains("missing_commitment"), "{}", run.reason);
    assert!(mesh.outbox().is_empty());

    let committed = submit_with(vec![cap.handle.clone()]).await.expect("submit with a capability");
    let run = settled(&mesh, "acme", &committed).await;
    assert_eq!(run.status(), pb::RunStatus::Completed, "{}", run.reason);
    assert_eq!(mesh.outbox().len(), 1);
    let receipts = receipts_of(&mesh, "acme", &committed, "").await;
    let mail_receipt = receipts.iter().find(|r| r.step_id == "mail").expect("the mail step's receipt");
    assert_eq!(mail_receipt.capability_id, cap.capability_id);
    let evs = events(&mut mesh.ledger(), "acme", &committed).await;
    assert!(!evs.iter().any(|e| e.payload_json.contains(&cap.handle)), "the handle is never recorded");

    let listed = |mesh: &warden_testkit::Mesh| {
        let mut runs = mesh.runs();
        async move {
            let req = pb::ListRunsRequest { tenant: "acme".into(), ..Default::default() };
            runs.list_runs(req).await.expect("list").into_inner().runs.len()
        }
    };
    let before = listed(&mesh).await;
    let forged = format!("wcap_{}", "0".repeat(64));
    let e = submit_with(vec![cap.handle.clone(), forged]).await.expect_err("forged handle");
    assert_field_violation(&e, "capability_handles[1]");
    let e = submit_with(vec![theirs.handle.clone()]).await.expect_err("another tenant's handle");
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    let revoke = pb::RevokeCapabilityRequest {
        tenant: "acme".into(),
        capability_id: cap.capability_id.clone(),
        reason: "rotated".into(),
    };
    caps.revoke(revoke).await.expect("revoke");
    let e = submit_with(vec![cap.handle.clone()]).await.expect_err("revoked handle");
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    assert_eq!(listed(&mesh).await, before, "a refused submission writes no run");
    assert_eq!(mesh.outbox().len(), 1);
}

/// Rotation: after the policy signs with a new key, the previous key stays published (not
/// current), so an authorization it signed still verifies at the tool host until it expires.
#[tokio::test]
async fn rotated_keys_keep_earlier_authorizations_verifiable() {
    let mut mesh = mesh_with(Backend::Sqlite, MeshOptions { executors: 0, ..MeshOptions::default() }).await;
    let run = planned_run(&mesh, "acme", &[("s1", "echo"), ("s2", "echo")]).await;
    let before =
        mesh.policy().authorize(authorize(&run, "s1", "echo", json!({"n": 1}))).await.expect("authorize").into_inner();
    let old_key = mesh.dir.path().join("policy.key");
    let new_key = mesh.dir.path().join("policy-2.key");
    mesh.policy.set_env("WARDEN_POLICY__KEY_FILE", &new_key.display().to_string());
    mesh.policy.set_env("WARDEN_POLICY__PREVIOUS_KEY_FILES", &format!("[\"{}\"]", old_key.display()));
    mesh.policy.restart().expect("restart with a new key");
    let keys =
        mesh.policy().get_verification_keys(pb::GetVerificationKeysRequest {}).await.expect("keys").into_inner().keys;
    assert_eq!(keys.len(), 2);
    assert_eq!(keys.iter().filter(|k| k.current).count(), 1);
    let after =
        mesh.policy().authorize(authorize(&run, "s2", "echo", json!({"n": 2}))).await.expect("authorize").into_inner();
    let (a, b) = (before.authorization.expect("old"), after.authorization.expect("new"));
    assert_ne!(a.key_id, b.key_id, "new authorizations use the new key");
    let ids = [before.decision.expect("old").decision_id, after.decision.expect("new").decision_id];
    for ((step, auth, n), decision_id) in [("s1", a, 1), ("s2", b, 2)].into_iter().zip(ids) {
        let ack = acknowledged(&mesh, "acme", &run, step, 1, "echo", &json!({"n": n}), &decision_id).await;
        let call = pb::InvokeRequest {
            tenant: "acme".into(),
            run_id: run.clone(),
            step_id: step.into(),
            attempt: 1,
            tool: "echo".into(),
            args_json: json!({"n": n}).to_string(),
            idempotency_key: format!("{run}:{step}:1"),
            authorization: Some(auth),
            request_ack: Some(ack),
        };
        mesh.tool_host().invoke(call).await.unwrap_or_else(|e| panic!("{step} verifies: {e:?}"));
    }
}

/// K15: budgets only grow; once the run's calls or cost reach the limit, every further call
/// is denied — a step no failure reaches included — and the run stops scheduling.
async fn k15_budgets_are_monotonic_and_a_breach_stops_scheduling(backend: Backend) {
    let opts = MeshOptions {
        tenants: vec![("acme".into(), vec!["echo".into()])],
        budget_rules: vec![("acme".into(), 3, 10.0)],
        ..MeshOptions::default()
    };
    let mesh = mesh_with(backend, opts).await;
    let chain: Vec<(&str, &str, serde_json::Value, &[&str])> = vec![
        ("a", "echo", json!({"cost": 6}), &[]),
        ("b", "echo", json!({"cost": 6}), &["a"]),
        ("c", "echo", json!({"cost": 1}), &["b"]),
        ("d", "echo", json!({}), &["c"]),
        // Ready with `c`, depending on nothing that failed: only the breach can stop it.
        ("e", "echo", json!({}), &["b"]),
    ];
    let id = submit(&mesh, "acme", &plan(&chain)).await;
    let run = settled(&mesh, "acme", &id).await;
    assert_eq!(run.status(), pb::RunStatus::Failed);
    let step = |s: &str| run.steps.iter().find(|x| x.id == s).expect("step").clone();
    let st = |s: &str| step(s).status();
    assert_eq!((st("a"), st("b")), (pb::StepStatus::Completed, pb::StepStatus::Completed));
    assert_eq!(st("c"), pb::StepStatus::Denied, "12 spent of 10: the next call is denied");
    assert_eq!(st("d"), pb::StepStatus::Cancelled);
    assert!(step("d").error.contains("dependency 'c'"), "d is the cascade: {}", step("d").error);
    assert_eq!(st("e"), pb::StepStatus::Denied, "the breach stops a step no failure reaches");
    assert!(step("e").error.contains("run_budget_exhausted"), "{}", step("e").error);
    assert!(run.reason.contains("run_budget_exhausted"), "{}", run.reason);

    let e = mesh
        .policy()
        .record_cost(pb::RecordCostRequest {
            tenant: "acme".into(),
            run_id: id.clone(),
            step_id: "a".into(),
            cost: -5.0,
            attempt: 1,
        })
        .await
        .expect_err("no refunds");
    assert_field_violation(&e, "cost");

    // The call limit: three calls per run.
    let calls: Vec<(&str, &str, serde_json::Value, &[&str])> = vec![
        ("a", "echo", json!({}), &[]),
        ("b", "echo", json!({}), &["a"]),
        ("c", "echo", json!({}), &["b"]),
        ("d", "echo", json!({}), &["c"]),
    ];
    let id = submit(&mesh, "acme", &plan(&calls)).await;
    let run = settled(&mesh, "acme", &id).await;
    assert!(run.reason.contains("run_call_limit"), "{}", run.reason);
    assert_eq!(run.steps.iter().filter(|s| s.status() == pb::StepStatus::Completed).count(), 3);
}

#[tokio::test]
async fn k15_budgets_are_monotonic_and_a_breach_stops_scheduling_on_sqlite() {
    k15_budgets_are_monotonic_and_a_breach_stops_scheduling(Backend::Sqlite).await;
}

#[tokio::test]
async fn k15_budgets_are_monotonic_and_a_breach_stops_scheduling_on_postgres() {
    k15_budgets_are_monotonic_and_a_breach_stops_scheduling(Backend::Postgres).await;
}

/// The steps the rate test asks for: three rounds of three.
const RATE_STEPS: [(&str, &str); 9] = [
    ("r0s0", "echo"),
    ("r0s1", "echo"),
    ("r0s2", "echo"),
    ("r1s0", "echo"),
    ("r1s1", "echo"),
    ("r1s2", "echo"),
    ("r2s0", "echo"),
    ("r2s1", "echo"),
    ("r2s2", "echo"),
];

/// Per-tenant rate windows live in Redis: over the limit within a minute, calls are denied.
#[tokio::test]
async fn tenant_rate_windows_deny_calls_over_the_limit() {
    let opts = MeshOptions { executors: 0, rate_rules: vec![("acme".into(), 2)], ..MeshOptions::default() };
    let mesh = mesh_with(Backend::Sqlite, opts).await;
    let run = planned_run(&mesh, "acme", &RATE_STEPS).await;
    // Three calls inside one window (retried if a minute boundary fell between them).
    for round in 0..3 {
        let minute = warden_grpc::now_ms() / 60_000;
        let mut rules = Vec::new();
        for i in 0..3 {
            let d = mesh
                .policy()
                .authorize(authorize(&run, &format!("r{round}s{i}"), "echo", json!({})))
                .await
                .expect("decide");
            rules.push(d.into_inner().decision.expect("decision").rule_id);
        }
        if warden_grpc::now_ms() / 60_000 != minute {
            continue;
        }
        assert_eq!(rules[2], "tenant_rate_limit", "{rules:?}");
        return;
    }
    panic!("could not stay inside one minute");
}

/// Semantic idempotency: the same semantic key after a success is a duplicate; while the
/// earlier call's outcome is unknown, it needs reconciliation; a failure frees the key.
#[tokio::test]
async fn semantic_keys_block_duplicates_and_unresolved_outcomes() {
    let extra = "[[policy.semantic_keys]]\ntool = \"email.send\"\ntemplate = \"mail:{to}:{subject}\"\n";
    let mesh = mesh_with(Backend::Sqlite, MeshOptions { policy_extra: extra.into(), ..MeshOptions::default() }).await;
    let first = submit(&mesh, "acme", &mail("ops@example.com")).await;
    assert_eq!(settled(&mesh, "acme", &first).await.status(), pb::RunStatus::Completed);
    let again = submit(&mesh, "acme", &mail("ops@example.com")).await;
    let run = settled(&mesh, "acme", &again).await;
    assert_eq!(run.status(), pb::RunStatus::Failed);
    assert!(run.reason.contains("semantic_duplicate"), "{}", run.reason);
    assert_eq!(mesh.outbox().len(), 1, "the duplicate mail never went out");

    // An allowed call whose outcome is not known yet blocks the same key elsewhere.
    let mut ledger = mesh.ledger();
    let bare = planned_run(&mesh, "acme", &[("m1", "email.send"), ("m2", "email.send"), ("m3", "email.send")]).await;
    let args = json!({"to": "cfo@example.com", "subject": "q3", "body": "b"});
    let mut policy = mesh.policy();
    let held = policy.authorize(authorize(&bare, "m1", "email.send", args.clone())).await.expect("decide").into_inner();
    let held = held.decision.expect("decision");
    assert_eq!(held.outcome(), pb::Outcome::Allow);
    let blocked =
        policy.authorize(authorize(&bare, "m2", "email.send", args.clone())).await.expect("decide").into_inner();
    assert_eq!(blocked.decision.expect("decision").rule_id, "semantic_requires_reconciliation");
    // The first call fails: the key is free again.
    ledger
        .append_event(pb::AppendEventRequest {
            tenant: "acme".into(),
            run_id: bare.clone(),
            epoch: 0,
            idempotency_key: "m1-failed".into(),
            event_type: "tool_failed".into(),
            payload_json: json!({"decision_id": held.decision_id, "attempt": 1, "tool": "email.send", "kind": "tool_error", "reason": "smtp down"})
                .to_string(),
            step_id: "m1".into(),
        })
        .await
        .expect("record the failure");
    let retry = policy.authorize(authorize(&bare, "m3", "email.send", args)).await.expect("decide").into_inner();
    assert_eq!(retry.decision.expect("decision").outcome(), pb::Outcome::Allow);
}

/// Malformed arguments get INVALID_ARGUMENT naming the field, and the refusal is recorded as
/// a deny; an identity that names no valid call is refused without a record.
#[tokio::test]
async fn malformed_requests_are_refused_and_recorded_as_denies() {
    let mesh = mesh_with(Backend::Sqlite, MeshOptions { executors: 0, ..MeshOptions::default() }).await;
    let run = planned_run(&mesh, "acme", &[("s1", "echo"), ("s2", "echo"), ("s3", "echo")]).await;
    let mut bad = authorize(&run, "s1", "echo", json!({}));
    bad.args_json = "{not json".into();
    let e = mesh.policy().authorize(bad).await.expect_err("malformed");
    assert_field_violation(&e, "args_json");
    let mut oversize = authorize(&run, "s2", "echo", json!({}));
    oversize.args_json = json!({"x": "y".repeat(2 << 20)}).to_string();
    assert_field_violation(&mesh.policy().authorize(oversize).await.expect_err("oversize"), "args_json");
    let mut no_key = authorize(&run, "s3", "echo", json!({}));
    no_key.idempotency_key = String::new();
    assert_field_violation(&mesh.policy().authorize(no_key).await.expect_err("K04"), "idempotency_key");
    let evs = events(&mut mesh.ledger(), "acme", &run).await;
    let denies: Vec<Value> = evs.iter().filter(|e| e.event_type == "policy_decision").map(payload).collect();
    assert_eq!(denies.len(), 2, "the two malformed calls are recorded; the keyless one names no call");
    assert!(denies.iter().all(|d| d["outcome"] == json!("deny") && d["rule_id"] == json!("malformed_request")));
}

/// A decision stage that fails (here its table is gone) is a recorded deny with its own
/// rule id, never an allow.
#[tokio::test]
async fn a_failing_policy_stage_is_a_recorded_deny() {
    let opts = MeshOptions {
        executors: 0,
        approval_rules: vec![("acme".into(), vec!["email.send".into()], vec![])],
        ..MeshOptions::default()
    };
    let mesh = mesh_with(Backend::Sqlite, opts).await;
    let run = planned_run(&mesh, "acme", &[("m1", "email.send")]).await;
    // The service announces its address before it has migrated its store: it answers only
    // once it has, so ask it something first — dropping a table mid-migration kills it.
    mesh.policy()
        .get_verification_keys(pb::GetVerificationKeysRequest {})
        .await
        .unwrap_or_else(|e| panic!("policy ready: {e:?}\n{}", mesh.logs()));
    sqlx::any::install_default_drivers();
    let url = format!("sqlite://{}?mode=rw", mesh.dir.path().join("policy.db").display());
    let db = sqlx::any::AnyPoolOptions::new().max_connections(1).connect(&url).await.expect("policy db");
    // SQLite may be busy with the policy service's own work for a moment: wait for the lock.
    sqlx::query("PRAGMA busy_timeout = 30000").execute(&db).await.expect("busy timeout");
    sqlx::query("DROP TABLE approvals").execute(&db).await.expect("break the approval stage");
    let answer = mesh
        .policy()
        .authorize(authorize(&run, "m1", "email.send", json!({"to": "a@example.com", "subject": "s", "body": "b"})))
        .await;
    let d = answer.unwrap_or_else(|e| panic!("a decision, not an error: {e:?}\n{}", mesh.logs())).into_inner();
    let decision = d.decision.expect("decision");
    assert_eq!((decision.outcome(), decision.rule_id.as_str()), (pb::Outcome::Deny, "policy_error"));
    assert!(d.authorization.is_none());
    let evs = events(&mut mesh.ledger(), "acme", &run).await;
    assert!(evs.iter().any(|e| e.event_type == "policy_decision" && payload(e)["rule_id"] == json!("policy_error")));
}

/// The intent-plan stage: configured tools need a recorded intent plan for the run; a call
/// carrying more than `max_cost_per_call` is denied.
#[tokio::test]
async fn intent_plans_and_per_call_cost_limits() {
    let opts = MeshOptions {
        executors: 0,
        policy_extra: "intent_required_tools = [\"kv.put\"]".into(),
        tenant_extra: vec![("acme".into(), "max_cost_per_call = 100.0".into())],
        ..MeshOptions::default()
    };
    let mesh = mesh_with(Backend::Sqlite, opts).await;
    let run = planned_run(&mesh, "acme", &[("p1", "kv.put"), ("p2", "kv.put"), ("e1", "echo")]).await;
    let rule = |d: pb::AuthorizeResponse| d.decision.expect("decision").rule_id;
    let mut policy = mesh.policy();
    let put = |step: &str| authorize(&run, step, "kv.put", json!({"key": "k", "value": 1}));
    assert_eq!(rule(policy.authorize(put("p1")).await.expect("decide").into_inner()), "missing_intent_plan");
    mesh.ledger()
        .put_summary(pb::PutSummaryRequest {
            tenant: "acme".into(),
            run_id: run.clone(),
            epoch: 0,
            idempotency_key: "intent-1".into(),
            summary_type: "policy::intent_plan".into(),
            payload_json: r#"{"intent": "store one key"}"#.into(),
            step_id: String::new(),
        })
        .await
        .expect("record the intent plan");
    assert_eq!(rule(policy.authorize(put("p2")).await.expect("decide").into_inner()), "tenant_allowlist");
    let pricey = authorize(&run, "e1", "echo", json!({"amount_usd": 250}));
    assert_eq!(rule(policy.authorize(pricey).await.expect("decide").into_inner()), "call_cost_limit");
}

/// A capability grants what the base rules do not permit, but never what a Cedar policy
/// forbids.
#[tokio::test]
async fn a_cedar_forbid_wins_over_a_capability() {
    let dir = tempfile::tempdir().expect("dir");
    std::fs::write(dir.path().join("schema.cedarschema"), SCHEMA).expect("schema");
    std::fs::write(dir.path().join("main.cedar"), POLICIES).expect("policies");
    let opts = MeshOptions { executors: 0, policy_dir: dir.path().display().to_string(), ..MeshOptions::default() };
    let mesh = mesh_with(Backend::Sqlite, opts).await;
    let run = planned_run(&mesh, "globex", &[("m1", "email.send"), ("m2", "email.send")]).await;
    let mut caps = warden_proto::v1::capabilities_client::CapabilitiesClient::new(mesh.policy.channel());
    let cap = caps
        .issue(pb::IssueCapabilityRequest {
            tenant: "globex".into(),
            tool_patterns: vec!["email.send".into()],
            ttl_seconds: 600,
            ..Default::default()
        })
        .await
        .expect("issue")
        .into_inner();
    let ask = |step: &str, to: &str| {
        let mut req = authorize(&run, step, "email.send", json!({"to": to, "subject": "s", "body": "b"}));
        req.tenant = "globex".into();
        req.capability_handle = cap.handle.clone();
        req
    };
    let rule = |d: pb::AuthorizeResponse| d.decision.expect("decision").rule_id;
    let mut policy = mesh.policy();
    // globex has no Cedar permit: the capability grants the call…
    assert_eq!(rule(policy.authorize(ask("m1", "ops@example.com")).await.expect("decide").into_inner()), "capability");
    // …but not past an explicit forbid.
    assert_eq!(
        rule(policy.authorize(ask("m2", "leak@evil.test")).await.expect("decide").into_inner()),
        "cedar:mail-stays-inside"
    );
}

/// Effect classes (SPEC-KERN-01 §4, Maple): a tool its host declares consequential needs an
/// explicit commitment though the policy's own list does not name it; the declaration the run
/// pinned is signed into the authorization; and a host that declares the tool otherwise after
/// the run pinned it (here: downgraded to read-only across a restart) gets no call of that run.
#[tokio::test]
async fn a_declared_effect_class_is_honoured_and_pinned_for_the_run() {
    let mut opts = MeshOptions {
        tools_extra: "effects = { \"email.send\" = \"consequential\" }".into(),
        ..MeshOptions::default()
    };
    opts.tenants[0].1.push("sleep".into());
    let mut mesh = mesh_with(Backend::Sqlite, opts).await;
    let listed = mesh.tool_host().list_tools(pb::ListToolsRequest::default()).await.expect("list").into_inner().tools;
    let spec = listed.iter().find(|t| t.name == "email.send").expect("email.send").clone();
    assert_eq!(spec.effect(), pb::Effect::Consequential, "{spec:?}");
    let declared = warden_grpc::catalog::declaration_sha256(&spec);

    let uncommitted = submit(&mesh, "acme", &mail("ops@example.com")).await;
    let run = settled(&mesh, "acme", &uncommitted).await;
    assert_eq!(run.status(), pb::RunStatus::Failed);
    assert!(run.reason.contains("missing_commitment"), "the declared class needs a commitment: {}", run.reason);
    assert!(mesh.outbox().is_empty());

    // With a capability the call runs, under an authorization naming the pinned declaration.
    let mut caps = warden_proto::v1::capabilities_client::CapabilitiesClient::new(mesh.policy.channel());
    let issue = pb::IssueCapabilityRequest {
        tenant: "acme".into(),
        tool_patterns: vec!["email.send".into()],
        ttl_seconds: 600,
        ..Default::default()
    };
    let handle = caps.issue(issue).await.expect("issue").into_inner().handle;
    let req = pb::SubmitRunRequest {
        tenant: "acme".into(),
        plan_json: mail("ops@example.com"),
        capability_handles: vec![handle.clone()],
        ..Default::default()
    };
    let committed = mesh.runs().submit_run(req).await.expect("submit").into_inner().run_id;
    let run = settled(&mesh, "acme", &committed).await;
    assert_eq!(run.status(), pb::RunStatus::Completed, "{}", run.reason);
    let evs = events(&mut mesh.ledger(), "acme", &committed).await;
    let pinned = evs.iter().find(|e| e.event_type == "tools_pinned").map(payload).expect("pinned");
    assert_eq!(pinned["tools"]["email.send"]["sha256"], json!(declared), "{pinned}");
    assert_eq!(pinned["tools"]["email.send"]["effect"], "consequential");
    let requested = evs.iter().find(|e| e.event_type == "tool_requested" && e.step_id == "mail").map(payload);
    assert_eq!(requested.expect("requested")["tool_sha256"], json!(declared));

    // The host declares the tool otherwise while a run that pinned it is under way.
    let nap = plan(&[
        ("nap", "sleep", json!({"ms": 1500}), &[]),
        ("mail", "email.send", json!({"to": "ops@example.com", "subject": "s", "body": "b"}), &["nap"]),
    ]);
    let req = pb::SubmitRunRequest {
        tenant: "acme".into(),
        plan_json: nap,
        capability_handles: vec![handle],
        ..Default::default()
    };
    let id = mesh.runs().submit_run(req).await.expect("submit").into_inner().run_id;
    first_event(&mesh, "acme", &id, |e| e.event_type == "tool_requested" && e.step_id == "nap").await;
    let config = mesh.dir.path().join("warden.toml");
    let text = std::fs::read_to_string(&config).expect("config");
    std::fs::write(&config, text.replace("\"email.send\" = \"consequential\"", "\"email.send\" = \"read_only\""))
        .expect("config");
    mesh.tools.restart().expect("restart the tool host");
    let run = settled(&mesh, "acme", &id).await;
    assert_eq!(run.status(), pb::RunStatus::Failed, "{}", run.reason);
    let mail_step = run.steps.iter().find(|s| s.id == "mail").expect("mail");
    let refused = mail_step.error.contains("changed its declaration") || mail_step.error.contains("tool_sha256");
    assert!(refused, "the executor or the host refuses the downgraded tool: {}", mail_step.error);
    assert_eq!(mesh.outbox().len(), 1, "only the earlier run's mail went out");
    assert!(verify(&mut mesh.ledger(), "acme", &id).await.valid);
}

/// A call that waited for an approval holds its semantic key under the decision that was
/// recorded (the approved one): once it succeeded, the same call elsewhere is a
/// `semantic_duplicate` — it neither waits on an outcome nobody can find nor, once the
/// authorization lapsed, goes ahead a second time.
#[tokio::test]
async fn an_approved_call_holds_its_semantic_key_under_the_recorded_decision() {
    let extra = "[[policy.semantic_keys]]\ntool = \"email.send\"\ntemplate = \"mail:{to}:{subject}\"\n";
    let opts = MeshOptions {
        policy_extra: extra.into(),
        approval_rules: vec![("acme".into(), vec!["email.send".into()], vec!["alice".into()])],
        ..MeshOptions::default()
    };
    let mesh = mesh_with(Backend::Sqlite, opts).await;
    let first = submit(&mesh, "acme", &mail("ops@example.com")).await;
    assert_eq!(crate::conformance::approve_pending(&mesh, &first, true).await, 1);
    assert_eq!(settled(&mesh, "acme", &first).await.status(), pb::RunStatus::Completed);
    let again = submit(&mesh, "acme", &mail("ops@example.com")).await;
    let run = settled(&mesh, "acme", &again).await;
    assert_eq!(run.status(), pb::RunStatus::Failed, "{}", run.reason);
    assert!(run.reason.contains("semantic_duplicate"), "{}", run.reason);
    assert_eq!(mesh.outbox().len(), 1, "the mail went out once");
}
