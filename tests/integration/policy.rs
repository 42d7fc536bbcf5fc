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
