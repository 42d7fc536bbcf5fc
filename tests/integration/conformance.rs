//! Conformance tests named after DESIGN.md's invariants.

use std::time::Duration;

use ed25519_dalek::SigningKey;
use serde_json::json;
use sqlx::any::AnyPoolOptions;
use warden_core::auth::{AuthorizationClaims, sign};
use warden_core::canonical::{args_digest, canonical_json};
use warden_lease::LeaseStore;
use warden_proto::v1 as pb;
use warden_testkit::MeshOptions;

use crate::*;

fn limited_tenant() -> MeshOptions {
    let mut o = MeshOptions::default();
    o.tenants.push(("limited".into(), vec!["echo".into()]));
    o
}

fn authorize_request(run_id: &str, args: &Value) -> pb::AuthorizeRequest {
    pb::AuthorizeRequest {
        tenant: "acme".into(),
        run_id: run_id.into(),
        step_id: "s1".into(),
        attempt: 1,
        tool: "echo".into(),
        args_json: args.to_string(),
        capability_handle: String::new(),
        idempotency_key: format!("{run_id}:s1:1"),
        epoch: 0,
        agent: String::new(),
        retry_of: String::new(),
        caller_records: false,
        base_rules_only: false,
        ..Default::default()
    }
}

fn invoke(run_id: &str, args: &Value, auth: Option<pb::SignedAuthorization>) -> pb::InvokeRequest {
    pb::InvokeRequest {
        tenant: "acme".into(),
        run_id: run_id.into(),
        step_id: "s1".into(),
        attempt: 1,
        tool: "echo".into(),
        args_json: canonical_json(args),
        idempotency_key: format!("{run_id}:s1:1"),
        authorization: auth,
        request_ack: None,
    }
}

async fn k01_every_tool_call_cites_a_signed_allow_for_its_exact_arguments(backend: Backend) {
    let mesh = mesh_on(backend).await;
    let run_id = submit(&mesh, "acme", HELLO).await;
    assert_eq!(settled(&mesh, "acme", &run_id).await.status(), pb::RunStatus::Completed);
    let evs = events(&mut mesh.ledger(), "acme", &run_id).await;
    let requested: Vec<&pb::Event> = evs.iter().filter(|e| e.event_type == "tool_requested").collect();
    assert_eq!(requested.len(), 5);
    for r in requested {
        let p = payload(r);
        let decision = evs
            .iter()
            .find(|e| e.event_type == "policy_decision" && payload(e)["decision_id"] == p["decision_id"])
            .expect("the cited decision is in the ledger");
        let d = payload(decision);
        assert!(decision.seq < r.seq, "decided before requested");
        assert_eq!(d["outcome"], json!("allow"));
        assert_eq!(decision.step_id, r.step_id);
        assert_eq!(d["args_sha256"], json!(args_digest(&p["args"])), "allow is for these exact arguments");
    }
}

#[tokio::test]
async fn k01_every_tool_call_cites_a_signed_allow_for_its_exact_arguments_on_sqlite() {
    k01_every_tool_call_cites_a_signed_allow_for_its_exact_arguments(Backend::Sqlite).await;
}

#[tokio::test]
async fn k01_every_tool_call_cites_a_signed_allow_for_its_exact_arguments_on_postgres() {
    k01_every_tool_call_cites_a_signed_allow_for_its_exact_arguments(Backend::Postgres).await;
}

async fn k01_tool_host_refuses_unsigned_forged_expired_and_other_argument_calls(backend: Backend) {
    let mesh = services_on(backend).await;
    let run_id = planned_run(&mesh, "acme", &[("s1", "echo")]).await;
    let args = json!({"text": "pay 10"});
    let granted = mesh.policy().authorize(authorize_request(&run_id, &args)).await.expect("authorize").into_inner();
    assert_eq!(granted.decision.as_ref().expect("decision").outcome(), pb::Outcome::Allow);
    let auth = granted.authorization.expect("signed authorization");
    let mut host = mesh.tool_host();

    let refused = |r: Result<tonic::Response<pb::InvokeResponse>, tonic::Status>| r.expect_err("must be refused");
    let e = refused(host.invoke(invoke(&run_id, &args, None)).await);
    assert_eq!(e.code(), tonic::Code::PermissionDenied, "unsigned: {e:?}");

    let e = refused(host.invoke(invoke(&run_id, &json!({"text": "pay 10000"}), Some(auth.clone()))).await);
    assert!(e.code() == tonic::Code::PermissionDenied && e.message().contains("args_sha256"), "other args: {e:?}");

    let mut other_step = invoke(&run_id, &args, Some(auth.clone()));
    other_step.step_id = "s2".into();
    let e = refused(host.invoke(other_step).await);
    assert!(e.message().contains("step_id"), "replayed for another step: {e:?}");

    let mut tampered = auth.clone();
    tampered.claims_json = String::from_utf8(auth.claims_json.clone())
        .expect("utf8")
        .replace("\"attempt\":1", "\"attempt\":2")
        .into_bytes();
    let mut retry = invoke(&run_id, &args, Some(tampered));
    retry.attempt = 2;
    let e = refused(host.invoke(retry).await);
    assert!(e.message().contains("signature"), "tampered claims: {e:?}");

    let claims = |expires_at_ms: i64| AuthorizationClaims {
        v: 1,
        key_id: String::new(),
        decision_id: "forged".into(),
        tenant: "acme".into(),
        run_id: run_id.clone(),
        step_id: "s1".into(),
        attempt: 1,
        tool: "echo".into(),
        args_sha256: args_digest(&args),
        idempotency_key: format!("{run_id}:s1:1"),
        capability_id: String::new(),
        issued_at_ms: 0,
        expires_at_ms,
        ..AuthorizationClaims::default()
    };
    let to_wire = |s: warden_core::auth::SignedClaims| pb::SignedAuthorization {
        claims_json: s.claims_json,
        signature: s.signature,
        key_id: s.key_id,
    };
    let forged = sign(claims(i64::MAX), &SigningKey::from_bytes(&[42u8; 32]));
    let e = refused(host.invoke(invoke(&run_id, &args, Some(to_wire(forged)))).await);
    assert!(e.message().contains("unknown key"), "forged key: {e:?}");

    let seed: [u8; 32] = hex::decode(std::fs::read_to_string(mesh.dir.path().join("policy.key")).expect("key").trim())
        .expect("hex")
        .try_into()
        .expect("32 bytes");
    let expired = sign(claims(1), &SigningKey::from_bytes(&seed));
    let e = refused(host.invoke(invoke(&run_id, &args, Some(to_wire(expired)))).await);
    assert!(e.message().contains("expired"), "expired: {e:?}");

    // Authorized but not on the record: nothing runs until the ledger acknowledges the request.
    let e = refused(host.invoke(invoke(&run_id, &args, Some(auth.clone()))).await);
    assert!(e.message().contains("acknowledgement"), "unrecorded: {e:?}");
    let decision_id = granted.decision.as_ref().expect("decision").decision_id.clone();
    let ack = acknowledged(&mesh, "acme", &run_id, "s1", 1, "echo", &args, &decision_id).await;
    let recorded = pb::InvokeRequest { request_ack: Some(ack), ..invoke(&run_id, &args, Some(auth)) };
    let ok = host.invoke(recorded).await.expect("the exact authorized, recorded call runs").into_inner();
    assert_eq!(ok.outcome, Some(pb::invoke_response::Outcome::OutputJson(canonical_json(&args))));
}

#[tokio::test]
async fn k01_tool_host_refuses_unsigned_forged_expired_and_other_argument_calls_on_sqlite() {
    k01_tool_host_refuses_unsigned_forged_expired_and_other_argument_calls(Backend::Sqlite).await;
}

#[tokio::test]
async fn k01_tool_host_refuses_unsigned_forged_expired_and_other_argument_calls_on_postgres() {
    k01_tool_host_refuses_unsigned_forged_expired_and_other_argument_calls(Backend::Postgres).await;
}

async fn k01_ledger_refuses_tool_events_without_a_recorded_allow(backend: Backend) {
    let mesh = services_on(backend).await;
    let run_id = bare_run(&mesh, "acme").await;
    let mut ledger = mesh.ledger();
    let append = |event_type: &str, decision_id: &str| pb::AppendEventRequest {
        tenant: "acme".into(),
        run_id: run_id.clone(),
        epoch: 0,
        idempotency_key: format!("{event_type}-{decision_id}"),
        event_type: event_type.into(),
        payload_json: json!({"decision_id": decision_id, "output": 1}).to_string(),
        step_id: "s1".into(),
    };
    let e = ledger.append_event(append("tool_completed", "made-up")).await.expect_err("no such decision");
    assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e:?}");
    let mut missing = append("tool_requested", "x");
    missing.payload_json = "{}".into();
    assert_field_violation(&ledger.append_event(missing).await.expect_err("no citation"), "payload_json.decision_id");

    // A recorded deny does not count as an allow (acme may not call shell.exec).
    let mut req = authorize_request(&run_id, &json!({}));
    req.tool = "shell.exec".into();
    let d = mesh.policy().authorize(req).await.expect("decision").into_inner().decision.expect("decision");
    assert_eq!(d.outcome(), pb::Outcome::Deny);
    let e = ledger.append_event(append("tool_completed", &d.decision_id)).await.expect_err("a deny is no allow");
    assert!(e.message().contains("not an allow"), "{e:?}");
    let run = ledger
        .get_run(pb::GetLedgerRunRequest { tenant: "acme".into(), run_id: run_id.clone(), with_events: false })
        .await
        .expect("run")
        .into_inner();
    assert_eq!(run.last_seq, 2, "only run_submitted and the decision were written");
}

#[tokio::test]
async fn k01_ledger_refuses_tool_events_without_a_recorded_allow_on_sqlite() {
    k01_ledger_refuses_tool_events_without_a_recorded_allow(Backend::Sqlite).await;
}

#[tokio::test]
async fn k01_ledger_refuses_tool_events_without_a_recorded_allow_on_postgres() {
    k01_ledger_refuses_tool_events_without_a_recorded_allow(Backend::Postgres).await;
}

async fn k01_denied_tool_never_runs(backend: Backend) {
    let mesh = mesh_with(backend, limited_tenant()).await;
    let p = plan(&[
        ("hi", "echo", json!({"m": 1}), &[]),
        ("mail", "email.send", json!({"to": "a@b.c", "subject": "s", "body": "b"}), &["hi"]),
    ]);
    let id = submit(&mesh, "limited", &p).await;
    let run = settled(&mesh, "limited", &id).await;
    assert_eq!(run.status(), pb::RunStatus::Failed);
    assert!(run.reason.contains("default_deny"), "{}", run.reason);
    let mail = run.steps.iter().find(|s| s.id == "mail").expect("step");
    assert_eq!(mail.status(), pb::StepStatus::Denied);
    assert!(mesh.outbox().is_empty(), "nothing was sent");
    let evs = events(&mut mesh.ledger(), "limited", &id).await;
    assert!(
        !evs.iter().any(|e| e.step_id == "mail" && e.event_type.starts_with("tool_")),
        "no tool event for a denied step"
    );
}

#[tokio::test]
async fn k01_denied_tool_never_runs_on_sqlite() {
    k01_denied_tool_never_runs(Backend::Sqlite).await;
}

#[tokio::test]
async fn k01_denied_tool_never_runs_on_postgres() {
    k01_denied_tool_never_runs(Backend::Postgres).await;
}

async fn k03_every_decision_is_in_the_ledger_with_rule_and_reason(backend: Backend) {
    let mesh = mesh_with(backend, limited_tenant()).await;
    let p = plan(&[("a", "echo", json!({}), &[]), ("b", "text.upper", json!({"text": "x"}), &[])]);
    let id = submit(&mesh, "limited", &p).await;
    settled(&mesh, "limited", &id).await;
    let evs = events(&mut mesh.ledger(), "limited", &id).await;
    let decisions: Vec<Value> = evs.iter().filter(|e| e.event_type == "policy_decision").map(payload).collect();
    assert_eq!(decisions.len(), 2, "one decision per step, allow and deny alike");
    let outcomes: Vec<&str> = decisions.iter().map(|d| d["outcome"].as_str().expect("outcome")).collect();
    assert!(outcomes.contains(&"allow") && outcomes.contains(&"deny"), "{outcomes:?}");
    for d in &decisions {
        assert!(d["rule_id"].as_str().is_some_and(|r| !r.is_empty()), "{d}");
        assert!(d["reason"].as_str().is_some_and(|r| !r.is_empty()), "{d}");
        assert!(d["fingerprint"].as_str().is_some_and(|r| !r.is_empty()), "{d}");
    }
}

/// K03 when the executor that was to carry its decisions never does (it died, or it
/// misbehaves): the policy records each decision itself shortly after answering, the allow and
/// the deny alike, and a decision the executor did record is not recorded twice.
async fn k03_decisions_an_executor_never_records_still_reach_the_ledger(backend: Backend) {
    let mesh = services_on(backend).await;
    let run = planned_run(&mesh, "acme", &[("s1", "echo"), ("s2", "echo")]).await;
    let ask = |step: &str, tool: &str| pb::AuthorizeRequest {
        step_id: step.into(),
        tool: tool.into(),
        idempotency_key: format!("{run}:{step}:1"),
        caller_records: true,
        ..authorize_request(&run, &json!({"text": "hi"}))
    };
    let mut policy = mesh.policy();
    // One decision the caller records itself, as the executor does, with its request. Asked
    // first, so the policy's own copy of it is sent no later than those of the two below.
    let carried = policy.authorize(ask("s2", "echo")).await.expect("decide").into_inner();
    let record = pb::AppendEventRequest {
        tenant: "acme".into(),
        run_id: run.clone(),
        epoch: 0,
        idempotency_key: warden_core::events::decision_key(&carried.decision.clone().expect("decision").decision_id),
        event_type: "policy_decision".into(),
        payload_json: carried.decision_event_json.clone(),
        step_id: "s2".into(),
    };
    let mut ledger = mesh.ledger();
    ledger.append_event(record).await.expect("the caller's own copy");
    let allow = policy.authorize(ask("s1", "echo")).await.expect("decide").into_inner();
    let deny = policy.authorize(ask("s2", "kv.put")).await.expect("decide").into_inner();
    let ids: Vec<String> =
        [&allow, &deny, &carried].iter().map(|d| d.decision.clone().expect("decision").decision_id).collect();
    let outcome = |d: &pb::AuthorizeResponse| d.decision.as_ref().expect("decision").outcome();
    assert_eq!(outcome(&allow), pb::Outcome::Allow);
    assert_eq!(outcome(&deny), pb::Outcome::Deny);
    // Followed as the ledger commits: done once every decision is on record.
    let mut feed = ledger
        .stream_events(pb::StreamEventsRequest {
            tenant: "acme".into(),
            run_id: run.clone(),
            since_seq: 0,
            follow: true,
        })
        .await
        .expect("follow")
        .into_inner();
    let mut decisions: Vec<Value> = Vec::new();
    let all_recorded = tokio::time::timeout(Duration::from_secs(20), async {
        while !ids.iter().all(|id| decisions.iter().any(|d| d["decision_id"] == json!(id))) {
            match feed.message().await.expect("event") {
                Some(e) if e.event_type == "policy_decision" => decisions.push(payload(&e)),
                Some(_) => {}
                None => break,
            }
        }
    })
    .await;
    assert!(all_recorded.is_ok(), "decisions never recorded: {decisions:?}");
    // The carried decision's own copy went out with or before the others' (a repeat, which
    // writes nothing): what is on record now is all there will be.
    let evs = events(&mut ledger, "acme", &run).await;
    let decisions_now = evs.iter().filter(|e| e.event_type == "policy_decision").count();
    assert_eq!(decisions_now, 3, "each decision once: {decisions:?}");
    for d in &decisions {
        assert!(d["rule_id"].as_str().is_some_and(|r| !r.is_empty()), "{d}");
    }
}

#[tokio::test]
async fn k03_decisions_an_executor_never_records_still_reach_the_ledger_on_sqlite() {
    k03_decisions_an_executor_never_records_still_reach_the_ledger(Backend::Sqlite).await;
}

#[tokio::test]
async fn k03_decisions_an_executor_never_records_still_reach_the_ledger_on_postgres() {
    k03_decisions_an_executor_never_records_still_reach_the_ledger(Backend::Postgres).await;
}

#[tokio::test]
async fn k03_every_decision_is_in_the_ledger_with_rule_and_reason_on_sqlite() {
    k03_every_decision_is_in_the_ledger_with_rule_and_reason(Backend::Sqlite).await;
}

#[tokio::test]
async fn k03_every_decision_is_in_the_ledger_with_rule_and_reason_on_postgres() {
    k03_every_decision_is_in_the_ledger_with_rule_and_reason(Backend::Postgres).await;
}

async fn k11_stale_lease_holder_cannot_append(backend: Backend) {
    let mesh = services_on(backend).await;
    let run_id = bare_run(&mesh, "acme").await;
    let leases = LeaseStore::connect(&warden_testkit::redis().url).await.expect("redis");
    let ttl = Duration::from_millis(300);
    let old = leases.acquire(&run_id, "old", ttl, 0).await.expect("redis").expect("free lease");
    let mut ledger = mesh.ledger();
    let append = |epoch: u64, key: &str| pb::AppendEventRequest {
        tenant: "acme".into(),
        run_id: run_id.clone(),
        epoch,
        idempotency_key: key.into(),
        event_type: "run_started".into(),
        payload_json: "{}".into(),
        step_id: String::new(),
    };
    ledger.append_event(append(old.epoch, "by-old-1")).await.expect("holder writes");
    // The old holder pauses past its lease; a new holder takes over.
    let new = warden_testkit::eventually(Duration::from_secs(10), || {
        let leases = leases.clone();
        let run_id = run_id.clone();
        async move { leases.acquire(&run_id, "new", ttl, 0).await.ok().flatten() }
    })
    .await
    .expect("lease expires and is taken over");
    assert!(new.epoch > old.epoch);
    ledger.append_event(append(new.epoch, "by-new-1")).await.expect("new holder writes");
    let e = ledger.append_event(append(old.epoch, "by-old-2")).await.expect_err("stale holder is fenced");
    assert!(warden_grpc::is_fenced(&e), "{e:?}");
    assert!(!leases.renew(&old, ttl).await.expect("redis"), "stale holder cannot renew");
    let run = ledger
        .get_run(pb::GetLedgerRunRequest { tenant: "acme".into(), run_id, with_events: false })
        .await
        .expect("run")
        .into_inner();
    assert_eq!((run.last_seq, run.max_epoch), (3, new.epoch), "the refused write left nothing behind");
}

#[tokio::test]
async fn k11_stale_lease_holder_cannot_append_on_sqlite() {
    k11_stale_lease_holder_cannot_append(Backend::Sqlite).await;
}

#[tokio::test]
async fn k11_stale_lease_holder_cannot_append_on_postgres() {
    k11_stale_lease_holder_cannot_append(Backend::Postgres).await;
}

/// Runs three hello plans, then alters, deletes and reorders stored rows directly.
async fn k13_tampering_is_detected(backend: Backend) {
    let mesh = mesh_on(backend).await;
    let mut ids = Vec::new();
    for _ in 0..4 {
        let id = submit(&mesh, "acme", HELLO).await;
        assert_eq!(settled(&mesh, "acme", &id).await.status(), pb::RunStatus::Completed);
        ids.push(id);
    }
    let mut ledger = mesh.ledger();
    for id in &ids {
        assert!(verify(&mut ledger, "acme", id).await.valid);
    }
    // The truncated run's last event is the one its recorded head names but the store lacks.
    let last = events(&mut ledger, "acme", &ids[3]).await.last().map(|e| e.seq).expect("events");
    sqlx::any::install_default_drivers();
    let url = if mesh.database_url.starts_with("sqlite") {
        format!("{}?mode=rw", mesh.database_url)
    } else {
        mesh.database_url.clone()
    };
    let db = AnyPoolOptions::new().max_connections(1).connect(&url).await.expect("open the database");
    let exec = |sql: String| {
        let db = db.clone();
        async move { sqlx::query(&sql).execute(&db).await.expect("tamper") }
    };
    exec(format!(
        "UPDATE events SET payload_json = '{{\"output\":\"forged\"}}' WHERE run_id = '{}' AND seq = 5",
        ids[0]
    ))
    .await;
    exec(format!("DELETE FROM events WHERE run_id = '{}' AND seq = 4", ids[1])).await;
    exec(format!("UPDATE events SET seq = 1000 WHERE run_id = '{}' AND seq = 6", ids[2])).await;
    exec(format!("UPDATE events SET seq = 6 WHERE run_id = '{}' AND seq = 7", ids[2])).await;
    exec(format!("UPDATE events SET seq = 7 WHERE run_id = '{}' AND seq = 1000", ids[2])).await;
    exec(format!(
        "DELETE FROM events WHERE run_id = '{}' AND seq = (SELECT MAX(seq) FROM events WHERE run_id = '{}')",
        ids[3], ids[3]
    ))
    .await;
    for (id, bad_seq, what) in
        [(&ids[0], 5, "altered"), (&ids[1], 4, "removed"), (&ids[2], 6, "reordered"), (&ids[3], last, "truncated")]
    {
        let v = verify(&mut ledger, "acme", id).await;
        assert!(!v.valid, "{what} event not detected");
        assert_eq!(v.first_bad_seq, bad_seq, "{what}: {}", v.reason);
    }
}

#[tokio::test]
async fn k13_altered_removed_or_reordered_events_fail_verification_on_sqlite() {
    k13_tampering_is_detected(Backend::Sqlite).await;
}

#[tokio::test]
async fn k13_altered_removed_or_reordered_events_fail_verification_on_postgres() {
    k13_tampering_is_detected(Backend::Postgres).await;
}

async fn k19_policy_unavailable_means_nothing_executes(backend: Backend) {
    let mut mesh = mesh_on(backend).await;
    mesh.policy.kill();
    let id = submit(&mesh, "acme", HELLO).await;
    let run = settled(&mesh, "acme", &id).await;
    assert_eq!(run.status(), pb::RunStatus::Failed);
    assert!(run.reason.contains("policy unavailable"), "the run says why: {}", run.reason);
    let evs = events(&mut mesh.ledger(), "acme", &id).await;
    assert!(!evs.iter().any(|e| e.event_type.starts_with("tool_")), "no tool was requested");
    assert!(mesh.outbox().is_empty());
    let failed = evs.iter().find(|e| e.event_type == "step_failed").expect("step_failed recorded");
    assert_eq!(payload(failed)["kind"], json!("policy_unavailable"));
}

#[tokio::test]
async fn k19_policy_unavailable_means_nothing_executes_on_sqlite() {
    k19_policy_unavailable_means_nothing_executes(Backend::Sqlite).await;
}

#[tokio::test]
async fn k19_policy_unavailable_means_nothing_executes_on_postgres() {
    k19_policy_unavailable_means_nothing_executes(Backend::Postgres).await;
}

/// K04: every mutating call carries an idempotency key — a decision, a tool invocation, a
/// ledger append, an artifact — and one without is refused naming the field, writing nothing.
async fn k04_mutating_calls_without_an_idempotency_key_are_rejected(backend: Backend) {
    let mesh = services_on(backend).await;
    let run_id = planned_run(&mesh, "acme", &[("s1", "echo")]).await;
    let args = json!({"text": "hi"});
    let before = events(&mut mesh.ledger(), "acme", &run_id).await.len();

    let mut decide = authorize_request(&run_id, &args);
    decide.idempotency_key = String::new();
    assert_field_violation(&mesh.policy().authorize(decide).await.expect_err("authorize"), "idempotency_key");
    let granted = mesh.policy().authorize(authorize_request(&run_id, &args)).await.expect("authorize").into_inner();
    let mut call = invoke(&run_id, &args, granted.authorization);
    call.idempotency_key = String::new();
    assert_field_violation(&mesh.tool_host().invoke(call).await.expect_err("invoke"), "idempotency_key");
    let append = pb::AppendEventRequest {
        tenant: "acme".into(),
        run_id: run_id.clone(),
        epoch: 0,
        idempotency_key: String::new(),
        event_type: "run_started".into(),
        payload_json: json!({"executor": "x", "epoch": 0}).to_string(),
        step_id: String::new(),
    };
    assert_field_violation(&mesh.ledger().append_event(append).await.expect_err("append"), "idempotency_key");
    let artifact = pb::PutArtifactRequest {
        tenant: "acme".into(),
        run_id: run_id.clone(),
        epoch: 0,
        idempotency_key: String::new(),
        key: "k".into(),
        value_json: "1".into(),
    };
    assert_field_violation(&mesh.ledger().put_artifact(artifact).await.expect_err("artifact"), "idempotency_key");
    let after = events(&mut mesh.ledger(), "acme", &run_id).await;
    assert_eq!(after.len(), before + 1, "only the keyed decision was recorded: {after:?}");
    assert!(mesh.outbox().is_empty());
}

#[tokio::test]
async fn k04_mutating_calls_without_an_idempotency_key_are_rejected_on_sqlite() {
    k04_mutating_calls_without_an_idempotency_key_are_rejected(Backend::Sqlite).await;
}

#[tokio::test]
async fn k04_mutating_calls_without_an_idempotency_key_are_rejected_on_postgres() {
    k04_mutating_calls_without_an_idempotency_key_are_rejected(Backend::Postgres).await;
}

/// K05: the same idempotency key returns the first outcome and never repeats the side effect
/// — sequentially or concurrently at the tool host, and at the ledger.
async fn k05_the_same_idempotency_key_returns_the_first_outcome_without_a_second_side_effect(backend: Backend) {
    let mesh = services_on(backend).await;
    let run_id = planned_run(&mesh, "acme", &[("s1", "email.send")]).await;
    let args = json!({"to": "ops@example.com", "subject": "once", "body": "b"});
    let decide = pb::AuthorizeRequest { tool: "email.send".into(), ..authorize_request(&run_id, &args) };
    let granted = mesh.policy().authorize(decide).await.expect("authorize").into_inner();
    let decision_id = granted.decision.clone().expect("decision").decision_id;
    let ack = acknowledged(&mesh, "acme", &run_id, "s1", 1, "email.send", &args, &decision_id).await;
    let call = pb::InvokeRequest {
        tool: "email.send".into(),
        request_ack: Some(ack),
        ..invoke(&run_id, &args, granted.authorization)
    };
    let mut calls = tokio::task::JoinSet::new();
    for _ in 0..4 {
        let (mut host, call) = (mesh.tool_host(), call.clone());
        calls.spawn(async move { host.invoke(call).await.expect("invoke").into_inner() });
    }
    let outcomes = calls.join_all().await;
    let again = mesh.tool_host().invoke(call).await.expect("invoke again").into_inner();
    assert!(outcomes.iter().all(|o| o.outcome == again.outcome), "one outcome for one key: {outcomes:?} / {again:?}");
    let fresh = outcomes.iter().filter(|o| !o.replayed).count() + usize::from(!again.replayed);
    assert_eq!(fresh, 1, "exactly one call ran, the rest were replays: {outcomes:?}");
    assert_eq!(mesh.outbox().len(), 1, "the mail went out once");

    let append = pb::AppendEventRequest {
        tenant: "acme".into(),
        run_id: run_id.clone(),
        epoch: 0,
        idempotency_key: "started-1".into(),
        event_type: "run_started".into(),
        payload_json: json!({"executor": "x", "epoch": 0}).to_string(),
        step_id: String::new(),
    };
    let first = mesh.ledger().append_event(append.clone()).await.expect("append").into_inner();
    let second = mesh.ledger().append_event(append).await.expect("append again").into_inner();
    assert!(!first.deduplicated && second.deduplicated);
    assert_eq!(first.event, second.event, "the first event is returned unchanged");
}

#[tokio::test]
async fn k05_the_same_idempotency_key_returns_the_first_outcome_without_a_second_side_effect_on_sqlite() {
    k05_the_same_idempotency_key_returns_the_first_outcome_without_a_second_side_effect(Backend::Sqlite).await;
}

#[tokio::test]
async fn k05_the_same_idempotency_key_returns_the_first_outcome_without_a_second_side_effect_on_postgres() {
    k05_the_same_idempotency_key_returns_the_first_outcome_without_a_second_side_effect(Backend::Postgres).await;
}

/// Waits until step `step` of the run is running (its tool call is requested).
async fn step_running(mesh: &warden_testkit::Mesh, run_id: &str, step: &str) {
    first_event(mesh, "acme", run_id, |e| e.event_type == "tool_requested" && e.step_id == step).await;
}

/// K16: cancellation follows the run's declared cancel policy. A step whose tool is already
/// working finishes and is recorded under either policy (an effect that started cannot be
/// un-started); nothing starts after the request. The policies part where a call is authorized
/// and requested but no host has received it yet (its host is down when the cancel lands):
/// `immediate` never sends it — the step is cancelled with a `cancelled` receipt citing its
/// allow — while `after_tool_call` lets that call go out once the host is back, records it,
/// and stops. A run blocked on an approval ends without its call; cancelling again changes
/// nothing; a run that ended otherwise cannot be cancelled.
async fn k16_cancellation(backend: Backend) {
    use tonic::Code;
    let mut opts = MeshOptions {
        approval_rules: vec![("acme".into(), vec!["email.send".into()], vec!["alice".into()])],
        // Long enough for a host outage to span the cancel and the host's return.
        outage_grace_ms: 60_000,
        ..MeshOptions::default()
    };
    opts.tenants[0].1.push("sleep".into());
    let mut mesh = mesh_with(backend, opts).await;
    let submit_with = |mesh: &warden_testkit::Mesh, plan_json: String, policy: pb::CancelPolicy| {
        let req = pb::SubmitRunRequest {
            tenant: "acme".into(),
            plan_json,
            cancel_policy: policy as i32,
            ..Default::default()
        };
        let mut runs = mesh.runs();
        async move { runs.submit_run(req).await.expect("submit").into_inner().run_id }
    };
    let cancel = |mesh: &warden_testkit::Mesh, run_id: &str| {
        let req = pb::CancelRunRequest { tenant: "acme".into(), run_id: run_id.into(), reason: "operator stop".into() };
        let mut runs = mesh.runs();
        async move { runs.cancel_run(req).await.map(|r| r.into_inner().status()) }
    };
    let policies = [(pb::CancelPolicy::Immediate, "immediate"), (pb::CancelPolicy::AfterToolCall, "after_tool_call")];
    for (policy, name) in policies {
        let work = plan(&[("nap", "sleep", json!({"ms": 4000}), &[]), ("after", "echo", json!({"n": 1}), &["nap"])]);
        let id = submit_with(&mesh, work, policy).await;
        step_running(&mesh, &id, "nap").await;
        assert_eq!(cancel(&mesh, &id).await.expect("cancel"), pb::RunStatus::Active);
        let run = settled(&mesh, "acme", &id).await;
        assert_eq!(run.status(), pb::RunStatus::Cancelled, "{name}: {}", run.reason);
        assert!(run.reason.contains("operator stop"), "{}", run.reason);
        let step = |sid: &str| run.steps.iter().find(|s| s.id == sid).expect("step").clone();
        assert_eq!(step("nap").status(), pb::StepStatus::Completed, "{name}: the started call finished");
        assert_eq!(step("after").status(), pb::StepStatus::Cancelled, "{name}: nothing new started");
        assert!(step("after").error.contains(name), "the policy is on record: {}", step("after").error);
        let receipts = receipts_of(&mesh, "acme", &id, "").await;
        let mut statuses: Vec<(&str, &str)> =
            receipts.iter().map(|r| (r.step_id.as_str(), r.status.as_str())).collect();
        statuses.sort();
        assert_eq!(statuses, [("after", "cancelled"), ("nap", "ok")], "{name}: one receipt per call");
        assert_eq!(
            cancel(&mesh, &id).await.expect("again"),
            pb::RunStatus::Cancelled,
            "cancelling twice changes nothing"
        );
        let evs = events(&mut mesh.ledger(), "acme", &id).await;
        assert_eq!(evs.iter().filter(|e| e.event_type == "run_cancel_requested").count(), 1);
        assert!(verify(&mut mesh.ledger(), "acme", &id).await.valid);
    }

    // Authorized and requested, not yet invoked: the mail's approval comes while its host is
    // down, so the executor holds the call (waiting out the outage) when the cancel lands.
    let mail = json!({"to": "ops@example.com", "subject": "s", "body": "b"});
    for (policy, name) in policies {
        let p = plan(&[("mail", "email.send", mail.clone(), &[]), ("after", "echo", json!({"n": 2}), &["mail"])]);
        let id = submit_with(&mesh, p, policy).await;
        first_event(&mesh, "acme", &id, |e| e.event_type == "run_blocked").await;
        mesh.tools.kill();
        approve_pending(&mesh, &id, true).await;
        first_event(&mesh, "acme", &id, |e| e.event_type == "run_waiting" && e.step_id == "mail").await;
        let evs = events(&mut mesh.ledger(), "acme", &id).await;
        assert!(evs.iter().any(|e| e.event_type == "tool_requested" && e.step_id == "mail"), "{name}: requested");
        assert_eq!(cancel(&mesh, &id).await.expect("cancel"), pb::RunStatus::Active);
        if policy == pb::CancelPolicy::AfterToolCall {
            mesh.tools.restart().expect("the tool host comes back");
        }
        let run = settled(&mesh, "acme", &id).await;
        assert_eq!(run.status(), pb::RunStatus::Cancelled, "{name}: {}", run.reason);
        let step = |sid: &str| run.steps.iter().find(|s| s.id == sid).expect("step").clone();
        let receipts = receipts_of(&mesh, "acme", &id, "").await;
        let mut statuses: Vec<(&str, &str)> =
            receipts.iter().map(|r| (r.step_id.as_str(), r.status.as_str())).collect();
        statuses.sort();
        if policy == pb::CancelPolicy::Immediate {
            assert_eq!(step("mail").status(), pb::StepStatus::Cancelled, "{name}: the call was never sent");
            assert_eq!(statuses, [("after", "cancelled"), ("mail", "cancelled")]);
            let evs = events(&mut mesh.ledger(), "acme", &id).await;
            let allow = evs
                .iter()
                .find(|e| e.event_type == "policy_decision" && e.step_id == "mail" && payload(e)["outcome"] == "allow")
                .map(|e| payload(e)["decision_id"].clone())
                .expect("the call's allow");
            let cancelled = receipts.iter().find(|r| r.step_id == "mail").expect("receipt");
            assert_eq!(json!(cancelled.policy_decision), allow, "the cancelled call's receipt cites its allow");
            mesh.tools.restart().expect("the tool host comes back");
            assert!(mesh.outbox().is_empty(), "{name}: no mail went out");
        } else {
            assert_eq!(step("mail").status(), pb::StepStatus::Completed, "{name}: the call went out");
            assert_eq!(statuses, [("after", "cancelled"), ("mail", "ok")]);
            assert_eq!(mesh.outbox().len(), 1, "{name}: exactly one mail");
        }
        assert!(verify(&mut mesh.ledger(), "acme", &id).await.valid);
    }

    let mail = plan(&[("mail", "email.send", mail, &[])]);
    let id = submit_with(&mesh, mail, pb::CancelPolicy::Immediate).await;
    first_event(&mesh, "acme", &id, |e| e.event_type == "run_blocked").await;
    assert_eq!(cancel(&mesh, &id).await.expect("cancel"), pb::RunStatus::Blocked);
    let run = settled(&mesh, "acme", &id).await;
    assert_eq!(run.status(), pb::RunStatus::Cancelled, "{}", run.reason);
    assert_eq!(mesh.outbox().len(), 1, "the gated mail never went out");

    let done = submit(&mesh, "acme", &plan(&[("only", "echo", json!({"n": 2}), &[])])).await;
    assert_eq!(settled(&mesh, "acme", &done).await.status(), pb::RunStatus::Completed);
    assert_eq!(cancel(&mesh, &done).await.expect_err("ended").code(), Code::FailedPrecondition);
    assert_eq!(cancel(&mesh, "no-such-run").await.expect_err("unknown").code(), Code::NotFound);
}

#[tokio::test]
async fn k16_cancellation_follows_the_declared_cancel_policy_on_sqlite() {
    k16_cancellation(Backend::Sqlite).await;
}

#[tokio::test]
async fn k16_cancellation_follows_the_declared_cancel_policy_on_postgres() {
    k16_cancellation(Backend::Postgres).await;
}

/// K16 across replicas: a cancellation that reaches an executor other than the one driving
/// the run is signalled through Redis, and the driver stops the run.
async fn k16_a_cancel_reaching_another_replica_stops_the_run(backend: Backend) {
    let mut opts = MeshOptions { executors: 2, ..MeshOptions::default() };
    opts.tenants[0].1.push("sleep".into());
    let mesh = mesh_with(backend, opts).await;
    let work = plan(&[("nap", "sleep", json!({"ms": 4000}), &[]), ("after", "echo", json!({"n": 1}), &["nap"])]);
    let id = submit(&mesh, "acme", &work).await;
    step_running(&mesh, &id, "nap").await;
    let evs = events(&mut mesh.ledger(), "acme", &id).await;
    let owner = evs.iter().find(|e| e.event_type == "run_started").map(|e| payload(e)["executor"].clone());
    let other = if owner == Some(json!("executor-0")) { 1 } else { 0 };
    let mut runs = warden_proto::v1::runs_client::RunsClient::new(mesh.executors[other].channel());
    let req = pb::CancelRunRequest { tenant: "acme".into(), run_id: id.clone(), reason: "from elsewhere".into() };
    runs.cancel_run(req).await.expect("cancel through the other replica");
    let run = settled(&mesh, "acme", &id).await;
    assert_eq!(run.status(), pb::RunStatus::Cancelled, "{}\n{}", run.reason, mesh.logs());
    let after = run.steps.iter().find(|s| s.id == "after").expect("after");
    assert_eq!(after.status(), pb::StepStatus::Cancelled);
}

#[tokio::test]
async fn k16_a_cancel_reaching_another_replica_stops_the_run_on_sqlite() {
    k16_a_cancel_reaching_another_replica_stops_the_run(Backend::Sqlite).await;
}

#[tokio::test]
async fn k16_a_cancel_reaching_another_replica_stops_the_run_on_postgres() {
    k16_a_cancel_reaching_another_replica_stops_the_run(Backend::Postgres).await;
}

/// K08: a step's timeout comes only from its tool's declaration. A plan cannot set one (an
/// unknown step field is refused), and a tool that outlives its declared `timeout_sec` leaves
/// its outcome unknown once the (idempotent) re-asks run out: the run waits for an operator.
/// A tool that declares none gets the 60 s fallback: its request records the 60,000 ms the
/// executor applies (the same value it waits with), while a declaring tool's records its own.
async fn k08_timeouts(backend: Backend) {
    let mut opts = MeshOptions {
        tools_extra: "timeout_secs = { sleep = 1, \"text.upper\" = 0 }".into(),
        ..MeshOptions::default()
    };
    opts.tenants[0].1.push("sleep".into());
    let mesh = mesh_with(backend, opts).await;
    // `text.upper` declares no timeout, `echo` the demo host's 10 s.
    let undeclared =
        submit(&mesh, "acme", &plan(&[("up", "text.upper", json!({"text": "x"}), &[]), ("e", "echo", json!({}), &[])]))
            .await;
    assert_eq!(settled(&mesh, "acme", &undeclared).await.status(), pb::RunStatus::Completed);
    let evs = events(&mut mesh.ledger(), "acme", &undeclared).await;
    let timeout_of = |sid: &str| {
        let e = evs.iter().find(|e| e.event_type == "tool_requested" && e.step_id == sid).expect("requested");
        payload(e)["timeout_ms"].clone()
    };
    assert_eq!(timeout_of("up"), json!(60_000), "no declaration: the 60 s fallback");
    assert_eq!(timeout_of("e"), json!(10_000), "the declared 10 s");

    let with_timeout = json!({"steps": [{"id": "nap", "tool": "sleep", "params": {"ms": 10}, "timeout_sec": 30}]});
    let req = pb::SubmitRunRequest { tenant: "acme".into(), plan_json: with_timeout.to_string(), ..Default::default() };
    let e = mesh.runs().submit_run(req).await.expect_err("a plan cannot carry a timeout");
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");

    let id = submit(&mesh, "acme", &plan(&[("nap", "sleep", json!({"ms": 8000}), &[])])).await;
    let run = settled(&mesh, "acme", &id).await;
    assert_eq!(run.status(), pb::RunStatus::RequiresReconciliation, "{}", run.reason);
    assert!(run.reason.contains("no answer within 1s"), "the declared 1 s applied: {}", run.reason);
}

#[tokio::test]
async fn k08_the_timeout_comes_only_from_the_tool_declaration_on_sqlite() {
    k08_timeouts(Backend::Sqlite).await;
}

#[tokio::test]
async fn k08_the_timeout_comes_only_from_the_tool_declaration_on_postgres() {
    k08_timeouts(Backend::Postgres).await;
}

fn retrying_mesh_options() -> MeshOptions {
    let mut opts = MeshOptions {
        executor_extra: "retry_backoff_base_ms = 10".into(),
        approval_rules: vec![("acme".into(), vec!["flaky".into()], vec!["alice".into()])],
        ..MeshOptions::default()
    };
    opts.tenants[0].1.push("flaky".into());
    opts.tenants.push(("limited".into(), vec!["echo".into()]));
    opts
}

fn rules_of(evs: &[pb::Event], step: &str) -> Vec<String> {
    evs.iter()
        .filter(|e| e.event_type == "policy_decision" && e.step_id == step)
        .map(|e| payload(e)["rule_id"].as_str().unwrap_or_default().to_string())
        .collect()
}

pub(crate) async fn approve_pending(mesh: &warden_testkit::Mesh, run_id: &str, approve: bool) -> usize {
    let mut approvals = warden_proto::v1::approvals_client::ApprovalsClient::new(mesh.policy.channel());
    // The run blocks once its approval is recorded; then the approval is listed.
    first_event(mesh, "acme", run_id, |e| e.event_type == "run_blocked").await;
    let req = pb::ListApprovalsRequest { tenant: "acme".into(), ..Default::default() };
    let all = approvals.list(req).await.expect("list").into_inner().approvals;
    let found: Vec<_> = all.into_iter().filter(|x| x.run_id == run_id).collect();
    assert!(!found.is_empty(), "an approval is requested");
    let req = pb::ResolveApprovalRequest {
        tenant: "acme".into(),
        approval_id: found[0].approval_id.clone(),
        approver: "alice".into(),
        reason: "ok".into(),
    };
    if approve {
        approvals.approve(req).await.expect("approve");
    } else {
        approvals.deny(req).await.expect("deny");
    }
    found.len()
}

/// K06: the pipeline order is fixed — decision, then the request, then the outcome, for
/// every attempt — and policy and approval skip on retry: a retried call is re-authorized
/// under the allow its first attempt got (rule `retry`) without a new approval, while every
/// attempt is still recorded, signed and receipted.
async fn k06_policy_and_approval_skip_on_retry_and_every_attempt_is_traced(backend: Backend) {
    let mesh = mesh_with(backend, retrying_mesh_options()).await;
    let id = submit(&mesh, "acme", &plan(&[("f", "flaky", json!({"succeed_on_attempt": 3}), &[])])).await;
    assert_eq!(approve_pending(&mesh, &id, true).await, 1);
    let run = settled(&mesh, "acme", &id).await;
    assert_eq!(run.status(), pb::RunStatus::Completed, "{}", run.reason);
    assert_eq!(run.steps[0].attempts, 3);
    let evs = events(&mut mesh.ledger(), "acme", &id).await;
    assert_eq!(rules_of(&evs, "f"), ["approval_required", "approval_gate", "retry", "retry"]);
    let approvals = warden_proto::v1::approvals_client::ApprovalsClient::new(mesh.policy.channel())
        .list(pb::ListApprovalsRequest { tenant: "acme".into(), ..Default::default() })
        .await
        .expect("list")
        .into_inner()
        .approvals;
    assert_eq!(approvals.iter().filter(|a| a.run_id == id).count(), 1, "one approval for all attempts");
    let first_allow = evs
        .iter()
        .find(|e| e.event_type == "policy_decision" && payload(e)["rule_id"] == json!("approval_gate"))
        .map(|e| payload(e)["decision_id"].clone())
        .expect("first allow");
    for attempt in 1..=3u64 {
        let at = |t: &str| {
            evs.iter().position(|e| e.event_type == t && payload(e)["attempt"] == json!(attempt) && e.step_id == "f")
        };
        let decision = evs
            .iter()
            .rposition(|e| {
                e.event_type == "policy_decision"
                    && payload(e)["attempt"] == json!(attempt)
                    && payload(e)["outcome"] == json!("allow")
            })
            .expect("an allow per attempt");
        let requested = at("tool_requested").expect("requested");
        let outcome = at(if attempt < 3 { "tool_failed" } else { "tool_completed" }).expect("outcome");
        assert!(decision < requested && requested < outcome, "attempt {attempt}: decision, request, outcome");
        if attempt < 3 {
            let retry = &payload(&evs[outcome])["retry"];
            assert_eq!(retry["next_attempt"], json!(attempt + 1));
            assert_eq!(retry["retry_of"], first_allow, "every retry names the first allow");
            assert_eq!(retry["backoff_ms"], json!(10 << (attempt - 1)), "backoff doubles");
        }
    }
    let receipts = receipts_of(&mesh, "acme", &id, "").await;
    let got: Vec<(u32, &str)> = receipts.iter().map(|r| (r.attempt, r.status.as_str())).collect();
    assert_eq!(got, [(1, "error"), (2, "error"), (3, "ok")], "one receipt per attempt");
    assert!(verify(&mut mesh.ledger(), "acme", &id).await.valid);

    // A retry naming an allow that is not the call's is refused (and recorded).
    let fresh = planned_run(&mesh, "acme", &[("s1", "echo")]).await;
    let mut forged = authorize_request(&fresh, &json!({"text": "x"}));
    forged.attempt = 2;
    forged.retry_of = first_allow.as_str().unwrap_or_default().to_string();
    let d = mesh.policy().authorize(forged).await.expect("decide").into_inner().decision.expect("decision");
    assert_eq!((d.outcome(), d.rule_id.as_str()), (pb::Outcome::Deny, "retry_unauthorized"));
}

#[tokio::test]
async fn k06_policy_and_approval_skip_on_retry_and_every_attempt_is_traced_on_sqlite() {
    k06_policy_and_approval_skip_on_retry_and_every_attempt_is_traced(Backend::Sqlite).await;
}

#[tokio::test]
async fn k06_policy_and_approval_skip_on_retry_and_every_attempt_is_traced_on_postgres() {
    k06_policy_and_approval_skip_on_retry_and_every_attempt_is_traced(Backend::Postgres).await;
}

/// K07: policy and human denials are decisions, never retried — even for a tool whose
/// declared policy retries — and retryable failures stop at the declared number of attempts.
async fn k07_policy_denied_and_human_denied_are_never_retried(backend: Backend) {
    let mesh = mesh_with(backend, retrying_mesh_options()).await;
    let flaky = |n: u64| plan(&[("f", "flaky", json!({"succeed_on_attempt": n}), &[])]);

    let denied = submit(&mesh, "limited", &flaky(1)).await;
    let run = settled(&mesh, "limited", &denied).await;
    assert_eq!(run.status(), pb::RunStatus::Failed);
    assert_eq!(run.steps[0].status(), pb::StepStatus::Denied, "{}", run.reason);
    let evs = events(&mut mesh.ledger(), "limited", &denied).await;
    assert_eq!(rules_of(&evs, "f").len(), 1, "one decision, no retry");
    assert!(!evs.iter().any(|e| e.event_type == "tool_requested"));

    let refused = submit(&mesh, "acme", &flaky(1)).await;
    approve_pending(&mesh, &refused, false).await;
    let run = settled(&mesh, "acme", &refused).await;
    assert_eq!(run.status(), pb::RunStatus::Failed);
    assert!(run.reason.contains("human_denied"), "{}", run.reason);
    let evs = events(&mut mesh.ledger(), "acme", &refused).await;
    assert_eq!(rules_of(&evs, "f"), ["approval_required", "human_denied"], "never retried");
    assert!(!evs.iter().any(|e| e.event_type == "tool_requested"));

    let exhausted = submit(&mesh, "acme", &flaky(9)).await;
    approve_pending(&mesh, &exhausted, true).await;
    let run = settled(&mesh, "acme", &exhausted).await;
    assert_eq!(run.status(), pb::RunStatus::Failed, "STANDARD stops after 3 attempts");
    assert_eq!(run.steps[0].attempts, 3);
    let evs = events(&mut mesh.ledger(), "acme", &exhausted).await;
    assert_eq!(evs.iter().filter(|e| e.event_type == "tool_failed").count(), 3);
}

#[tokio::test]
async fn k07_policy_denied_and_human_denied_are_never_retried_on_sqlite() {
    k07_policy_denied_and_human_denied_are_never_retried(Backend::Sqlite).await;
}

#[tokio::test]
async fn k07_policy_denied_and_human_denied_are_never_retried_on_postgres() {
    k07_policy_denied_and_human_denied_are_never_retried(Backend::Postgres).await;
}

/// K09: every attempt is traced and a step is never overwritten: the run's trace has one node
/// per step id, each attempt in order with the decision it ran under and its outcome, the
/// step's policy and approval events, and the plan's edges.
async fn k09_every_attempt_is_traced_and_a_step_is_never_overwritten(backend: Backend) {
    let mesh = mesh_with(backend, retrying_mesh_options()).await;
    let work = plan(&[
        ("f", "flaky", json!({"succeed_on_attempt": 2}), &[]),
        ("g", "echo", json!({"got": "{{f.output}}"}), &["f"]),
    ]);
    let id = submit(&mesh, "acme", &work).await;
    approve_pending(&mesh, &id, true).await;
    assert_eq!(settled(&mesh, "acme", &id).await.status(), pb::RunStatus::Completed);
    let req = pb::GetRunRequest { tenant: "acme".into(), run_id: id.clone() };
    let trace = mesh.runs().get_trace(req).await.expect("trace").into_inner();
    let t: Value = serde_json::from_str(&trace.trace_json).expect("json");
    assert_eq!(t["status"], json!("completed"));
    let steps = t["steps"].as_array().expect("steps");
    let ids: Vec<&str> = steps.iter().filter_map(|s| s["step_id"].as_str()).collect();
    assert_eq!(ids, ["f", "g"], "one node per step");
    let f = &steps[0];
    let attempts: Vec<(u64, &str, &str)> = f["attempts"]
        .as_array()
        .expect("attempts")
        .iter()
        .map(|a| {
            let n = a["attempt"].as_u64().unwrap_or(0);
            (n, a["outcome"].as_str().unwrap_or(""), a["decision"]["rule_id"].as_str().unwrap_or(""))
        })
        .collect();
    assert_eq!(attempts, [(1, "error", "approval_gate"), (2, "ok", "retry")]);
    let rules: Vec<&str> =
        f["policy_events"].as_array().expect("events").iter().filter_map(|d| d["rule_id"].as_str()).collect();
    assert_eq!(rules, ["approval_required", "approval_gate", "retry"]);
    let approvals: Vec<&str> =
        f["approval_events"].as_array().expect("approvals").iter().filter_map(|a| a["kind"].as_str()).collect();
    assert_eq!(approvals, ["requested", "resolved"]);
    assert_eq!(steps[1]["attempts"][0]["outcome"], json!("ok"));
    assert_eq!(t["edges"], json!([{"from": "f", "to": "g", "kind": "depends_on"}]));
}

#[tokio::test]
async fn k09_every_attempt_is_traced_and_a_step_is_never_overwritten_on_sqlite() {
    k09_every_attempt_is_traced_and_a_step_is_never_overwritten(Backend::Sqlite).await;
}

#[tokio::test]
async fn k09_every_attempt_is_traced_and_a_step_is_never_overwritten_on_postgres() {
    k09_every_attempt_is_traced_and_a_step_is_never_overwritten(Backend::Postgres).await;
}

/// K16 with K12: a cancellation that meets a call whose executor died mid-call does not erase
/// the call — its effect may have started — the successor asks the tool host again under the
/// same key, records the outcome, and cancels only what had not started.
async fn k16_a_cancel_after_an_executor_died_mid_call_records_the_call(backend: Backend) {
    let mut opts = MeshOptions { executors: 2, ..MeshOptions::default() };
    opts.tenants[0].1.push("sleep".into());
    let mut mesh = mesh_with(backend, opts).await;
    let work = plan(&[("nap", "sleep", json!({"ms": 3000}), &[]), ("after", "echo", json!({"n": 1}), &["nap"])]);
    let id = submit(&mesh, "acme", &work).await;
    step_running(&mesh, &id, "nap").await;
    let evs = events(&mut mesh.ledger(), "acme", &id).await;
    let owner = evs.iter().find(|e| e.event_type == "run_started").map(|e| payload(e)["executor"].clone());
    let (dead, alive) = if owner == Some(json!("executor-0")) { (0, 1) } else { (1, 0) };
    mesh.executors[dead].kill();
    let mut runs = warden_proto::v1::runs_client::RunsClient::new(mesh.executors[alive].channel());
    let req = pb::CancelRunRequest { tenant: "acme".into(), run_id: id.clone(), reason: "stop".into() };
    runs.cancel_run(req).await.expect("cancel");
    let run = settled(&mesh, "acme", &id).await;
    assert_eq!(run.status(), pb::RunStatus::Cancelled, "{}\n{}", run.reason, mesh.logs());
    let step = |sid: &str| run.steps.iter().find(|s| s.id == sid).expect("step").status();
    assert_eq!(step("nap"), pb::StepStatus::Completed, "the call in flight is recorded, not erased");
    assert_eq!(step("after"), pb::StepStatus::Cancelled);
    let mut statuses: Vec<(String, String)> =
        receipts_of(&mesh, "acme", &id, "").await.into_iter().map(|r| (r.step_id, r.status)).collect();
    statuses.sort();
    assert_eq!(statuses, [("after".to_string(), "cancelled".to_string()), ("nap".into(), "ok".into())]);
    let evs = events(&mut mesh.ledger(), "acme", &id).await;
    let requested = evs.iter().filter(|e| e.event_type == "tool_requested" && e.step_id == "nap").count();
    assert_eq!(requested, 1, "asked again under the same key, not requested anew");
}

#[tokio::test]
async fn k16_a_cancel_after_an_executor_died_mid_call_records_the_call_on_sqlite() {
    k16_a_cancel_after_an_executor_died_mid_call_records_the_call(Backend::Sqlite).await;
}

#[tokio::test]
async fn k16_a_cancel_after_an_executor_died_mid_call_records_the_call_on_postgres() {
    k16_a_cancel_after_an_executor_died_mid_call_records_the_call(Backend::Postgres).await;
}

/// K14: capability handles cannot be forged; expired, revoked, another tenant's and
/// out-of-scope ones are refused — each refusal a recorded deny — and an allow names the
/// capability it used (never the handle).
async fn k14_capabilities(backend: Backend) {
    use warden_proto::v1::capabilities_client::CapabilitiesClient;
    let mut opts = MeshOptions { executors: 0, ..MeshOptions::default() };
    opts.tenants.push(("globex".into(), vec![]));
    let mesh = mesh_with(backend, opts).await;
    let mut caps = CapabilitiesClient::new(mesh.policy.channel());
    let issue = |tenant: &str, tools: &[&str], resources: &[&str], ttl: u64| pb::IssueCapabilityRequest {
        tenant: tenant.into(),
        tool_patterns: tools.iter().map(|s| s.to_string()).collect(),
        action_patterns: vec![],
        resource_patterns: resources.iter().map(|s| s.to_string()).collect(),
        ttl_seconds: ttl,
        run_id: String::new(),
    };
    // globex's allowlist is empty: only a capability can let it act.
    let good = caps.issue(issue("globex", &["payments.*"], &["acct:42*"], 3600)).await.expect("issue").into_inner();
    assert!(good.handle.starts_with("wcap_") && !good.capability_id.contains(&good.handle[5..]));
    let short = caps.issue(issue("globex", &["payments.*"], &[], 1)).await.expect("issue").into_inner();
    let revoked = caps.issue(issue("globex", &["payments.*"], &[], 3600)).await.expect("issue").into_inner();
    caps.revoke(pb::RevokeCapabilityRequest {
        tenant: "globex".into(),
        capability_id: revoked.capability_id.clone(),
        reason: "rotated".into(),
    })
    .await
    .expect("revoke");
    let acmes = caps.issue(issue("acme", &["payments.*"], &[], 3600)).await.expect("issue").into_inner();

    let mut ledger = mesh.ledger();
    let run = planned_run(
        &mesh,
        "globex",
        &[
            ("s1", "payments.transfer"),
            ("s2", "payments.transfer"),
            ("s3", "payments.transfer"),
            ("s4", "payments.transfer"),
            ("s5", "payments.transfer"),
            ("s6", "payments.transfer"),
            ("s7", "email.send"),
            ("s8", "payments.transfer"),
            ("s9", "payments.transfer"),
        ],
    )
    .await;
    let policy = mesh.policy();
    let mut n = 0;
    let mut ask = |handle: &str, tool: &str, resource: &str| {
        n += 1;
        let req = pb::AuthorizeRequest {
            tenant: "globex".into(),
            run_id: run.clone(),
            step_id: format!("s{n}"),
            attempt: 1,
            tool: tool.into(),
            args_json: json!({"resource": resource, "amount": 5}).to_string(),
            capability_handle: handle.into(),
            idempotency_key: format!("{run}:s{n}:1"),
            epoch: 0,
            agent: String::new(),
            retry_of: String::new(),
            caller_records: false,
            base_rules_only: false,
            ..Default::default()
        };
        let mut p = policy.clone();
        async move { p.authorize(req).await.expect("a decision").into_inner() }
    };
    let ok = ask(&good.handle, "payments.transfer", "acct:4217").await;
    assert_eq!(ok.decision.as_ref().expect("decision").outcome(), pb::Outcome::Allow);
    let claims: Value = serde_json::from_slice(&ok.authorization.expect("signed").claims_json).expect("claims");
    assert_eq!(claims["capability_id"], json!(good.capability_id), "the authorization names the capability");

    // Expire the short one without sleeping in the test body: wait for the clock.
    warden_testkit::eventually(Duration::from_secs(5), || async {
        (warden_grpc::now_ms() > short.expires_at_ms).then_some(())
    })
    .await;
    let forged = format!("wcap_{}", "0".repeat(64));
    let cases = [
        (forged.as_str(), "payments.transfer", "acct:4217", "capability_invalid"),
        ("not-a-handle", "payments.transfer", "acct:4217", "capability_invalid"),
        (short.handle.as_str(), "payments.transfer", "acct:4217", "capability_expired"),
        (revoked.handle.as_str(), "payments.transfer", "acct:4217", "capability_revoked"),
        (acmes.handle.as_str(), "payments.transfer", "acct:4217", "capability_tenant"),
        (good.handle.as_str(), "email.send", "acct:4217", "capability_scope"),
        (good.handle.as_str(), "payments.transfer", "acct:99", "capability_scope"),
        ("", "payments.transfer", "acct:4217", "default_deny"),
    ];
    for (handle, tool, resource, rule) in cases {
        let d = ask(handle, tool, resource).await;
        let decision = d.decision.expect("decision");
        assert_eq!(
            (decision.outcome(), decision.rule_id.as_str()),
            (pb::Outcome::Deny, rule),
            "{handle} {tool} {resource}"
        );
        assert!(d.authorization.is_none());
    }
    let evs = events(&mut ledger, "globex", &run).await;
    let recorded: Vec<Value> = evs.iter().filter(|e| e.event_type == "policy_decision").map(payload).collect();
    assert_eq!(recorded.len(), 9, "every decision, allow or deny, is recorded");
    assert!(evs.iter().all(|e| !e.payload_json.contains("wcap_")), "no handle ever reaches the ledger");

    let e = caps
        .get(pb::GetCapabilityRequest { tenant: "acme".into(), capability_id: good.capability_id.clone() })
        .await
        .expect_err("another tenant's capability does not exist for acme");
    assert_eq!(e.code(), tonic::Code::NotFound);
    let listed = caps
        .list(pb::ListCapabilitiesRequest { tenant: "globex".into(), ..Default::default() })
        .await
        .expect("list")
        .into_inner();
    assert_eq!(listed.capabilities.len(), 3);
    assert!(listed.capabilities.iter().all(|c| c.handle.is_empty()), "handles are shown once");
    let e = caps.issue(issue("globex", &[], &[], 60)).await.expect_err("no tools");
    assert_field_violation(&e, "tool_patterns");
    let e = caps.issue(issue("globex", &["a*b"], &[], 60)).await.expect_err("bad pattern");
    assert_field_violation(&e, "tool_patterns");
    let e = caps.issue(issue("globex", &["x"], &[], 0)).await.expect_err("no ttl");
    assert_field_violation(&e, "ttl_seconds");
}

#[tokio::test]
async fn k14_capability_handles_cannot_be_forged_and_expired_or_revoked_ones_are_refused_on_sqlite() {
    k14_capabilities(Backend::Sqlite).await;
}

#[tokio::test]
async fn k14_capability_handles_cannot_be_forged_and_expired_or_revoked_ones_are_refused_on_postgres() {
    k14_capabilities(Backend::Postgres).await;
}
