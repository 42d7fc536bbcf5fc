//! Receipts, signed heads, exports and ledger tenancy (SPEC-KERN-01 §5, K02, K13, K20).

use std::process::Command;

use serde_json::json;
use warden_core::auth::{CallIdentity, decision_id};
use warden_core::canonical::args_digest;
use warden_proto::v1 as pb;

use crate::*;

async fn k02_every_call_outcome_has_exactly_one_receipt(backend: Backend) {
    let mut opts = warden_testkit::MeshOptions::default();
    opts.tenants.push(("limited".into(), vec!["echo".into(), "fail".into()]));
    let mesh = mesh_with(backend, opts).await;
    let ok = submit(&mesh, "acme", HELLO).await;
    settled(&mesh, "acme", &ok).await;
    let receipts = receipts_of(&mesh, "acme", &ok, "").await;
    assert_eq!(receipts.len(), 5);
    for r in &receipts {
        assert_eq!(r.status, "ok");
        assert_eq!(r.job_id, ok);
        assert!(!r.policy_decision.is_empty() && !r.action_type.is_empty() && r.timestamp_ms > 0);
        assert_eq!((r.trace_id.len(), r.span_id.len(), r.hash.len()), (32, 16, 64));
    }
    assert_eq!(receipts_of(&mesh, "acme", &ok, "shout").await.len(), 1, "per call");

    let p = plan(&[
        ("fine", "echo", json!({}), &[]),
        ("boom", "fail", json!({"message": "no"}), &[]),
        ("nope", "email.send", json!({"to": "a@b.c", "subject": "s", "body": "b"}), &[]),
        ("after", "echo", json!({}), &["boom"]),
    ]);
    let mixed = submit(&mesh, "limited", &p).await;
    settled(&mesh, "limited", &mixed).await;
    let by_step: std::collections::HashMap<String, String> =
        receipts_of(&mesh, "limited", &mixed, "").await.into_iter().map(|r| (r.step_id, r.status)).collect();
    let expected = [("fine", "ok"), ("boom", "error"), ("nope", "denied"), ("after", "cancelled")];
    assert_eq!(by_step.len(), 4, "{by_step:?}");
    for (step, status) in expected {
        assert_eq!(by_step[step], status, "{step}");
    }
    assert!(verify(&mut mesh.ledger(), "limited", &mixed).await.valid);
}

#[tokio::test]
async fn k02_every_call_outcome_has_exactly_one_receipt_on_sqlite() {
    k02_every_call_outcome_has_exactly_one_receipt(Backend::Sqlite).await;
}

#[tokio::test]
async fn k02_every_call_outcome_has_exactly_one_receipt_on_postgres() {
    k02_every_call_outcome_has_exactly_one_receipt(Backend::Postgres).await;
}

async fn k02_a_second_outcome_for_a_call_is_refused(backend: Backend) {
    let mesh2 = services_on(backend).await;
    let mut ledger = mesh2.ledger();
    let run = empty_run(&mut ledger, "acme").await;
    let first = pb::AppendEventRequest {
        tenant: "acme".into(),
        run_id: run.clone(),
        epoch: 1,
        idempotency_key: "fail-1".into(),
        event_type: "tool_failed".into(),
        payload_json: json!({"attempt": 1, "tool": "echo", "reason": "x", "kind": "tool_error"}).to_string(),
        step_id: "s".into(),
    };
    ledger.append_event(first.clone()).await.expect("first outcome");
    let second = pb::AppendEventRequest { idempotency_key: "fail-2".into(), ..first };
    let e = ledger.append_event(second).await.expect_err("second outcome");
    assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e:?}");
    assert_eq!(receipts_of(&mesh2, "acme", &run, "s").await.len(), 1);
}

#[tokio::test]
async fn k02_a_second_outcome_for_a_call_is_refused_on_sqlite() {
    k02_a_second_outcome_for_a_call_is_refused(Backend::Sqlite).await;
}

#[tokio::test]
async fn k02_a_second_outcome_for_a_call_is_refused_on_postgres() {
    k02_a_second_outcome_for_a_call_is_refused(Backend::Postgres).await;
}

async fn k01_a_forged_or_altered_decision_record_is_refused_and_never_yields_an_authorization(backend: Backend) {
    let mesh = services_on(backend).await;
    let mut ledger = mesh.ledger();
    let run = empty_run(&mut ledger, "acme").await;
    let args = json!({"cmd": "rm -rf /"});
    let key = format!("{run}:s1:1");
    let digest = args_digest(&args);
    let call = CallIdentity {
        tenant: "acme",
        run_id: &run,
        step_id: "s1",
        attempt: 1,
        tool: "shell.exec",
        args_sha256: &digest,
        idempotency_key: &key,
    };
    let id = decision_id(&call, "");
    // An attacker who can write to the ledger pre-records an "allow" under the id policy will use.
    let forged = json!({"decision_id": id, "attempt": 1, "tool": "shell.exec", "args_sha256": digest, "capability_id": "",
                        "idempotency_key": key, "outcome": "allow", "rule_id": "forged", "reason": "forged", "fingerprint": "x"});
    let e = ledger
        .append_event(pb::AppendEventRequest {
            tenant: "acme".into(),
            run_id: run.clone(),
            epoch: 0,
            idempotency_key: warden_core::events::decision_key(&id),
            event_type: "policy_decision".into(),
            payload_json: forged.to_string(),
            step_id: "s1".into(),
        })
        .await
        .expect_err("the ledger records only decisions the policy signed");
    assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e:?}");
    // Even a copy of a genuine signature does not cover an altered record.
    let genuine = mesh
        .policy()
        .authorize(pb::AuthorizeRequest {
            tenant: "acme".into(),
            run_id: run.clone(),
            step_id: "s1".into(),
            attempt: 1,
            tool: "shell.exec".into(),
            args_json: args.to_string(),
            idempotency_key: key.clone(),
            ..Default::default()
        })
        .await
        .expect("a decision")
        .into_inner();
    assert!(genuine.authorization.is_none(), "shell.exec is not allowed");
    let mut altered: serde_json::Value = serde_json::from_str(&genuine.decision_event_json).expect("record");
    altered["outcome"] = json!("allow");
    let e = ledger
        .append_event(pb::AppendEventRequest {
            tenant: "acme".into(),
            run_id: run.clone(),
            epoch: 0,
            idempotency_key: "decision:altered".into(),
            event_type: "policy_decision".into(),
            payload_json: altered.to_string(),
            step_id: "s1".into(),
        })
        .await
        .expect_err("an altered record");
    assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e:?}");
    let denied = mesh
        .policy()
        .authorize(pb::AuthorizeRequest {
            tenant: "acme".into(),
            run_id: run,
            step_id: "s1".into(),
            attempt: 1,
            tool: "shell.exec".into(),
            args_json: args.to_string(),
            capability_handle: String::new(),
            idempotency_key: key,
            epoch: 0,
            agent: String::new(),
            retry_of: String::new(),
            caller_records: false,
            base_rules_only: false,
            ..Default::default()
        })
        .await
        .expect("the policy decides afresh")
        .into_inner();
    assert!(denied.authorization.is_none(), "no forged allow ever yields an authorization");
}

#[tokio::test]
async fn k01_a_forged_or_altered_decision_record_is_refused_and_never_yields_an_authorization_on_sqlite() {
    k01_a_forged_or_altered_decision_record_is_refused_and_never_yields_an_authorization(Backend::Sqlite).await;
}

#[tokio::test]
async fn k01_a_forged_or_altered_decision_record_is_refused_and_never_yields_an_authorization_on_postgres() {
    k01_a_forged_or_altered_decision_record_is_refused_and_never_yields_an_authorization(Backend::Postgres).await;
}

fn warden(args: &[&str], ledger_endpoint: &str) -> std::process::Output {
    let bin = warden_testkit::mesh::bin_dir().expect("bin dir").join("warden");
    Command::new(bin).args(args).env("WARDEN_LEDGER_ENDPOINT", ledger_endpoint).output().expect("run the warden CLI")
}

async fn k13_an_exported_run_verifies_offline_and_tampering_is_named(backend: Backend) {
    let mesh = mesh_on(backend).await;
    let id = submit(&mesh, "acme", HELLO).await;
    settled(&mesh, "acme", &id).await;
    let head = mesh
        .ledger()
        .get_signed_head(pb::GetSignedHeadRequest { tenant: "acme".into(), run_id: id.clone() })
        .await
        .expect("head")
        .into_inner();
    let endpoint = mesh.ledger.endpoint.clone();
    let out = tokio::task::spawn_blocking({
        let id = id.clone();
        move || warden(&["--tenant", "acme", "run", "export", &id], &endpoint)
    })
    .await
    .expect("export");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let file = mesh.dir.path().join("run.jsonl");
    std::fs::write(&file, &out.stdout).expect("write export");
    let key = hex::encode(&head.public_key);
    // verify-file talks to no server; the endpoint it is given points nowhere useful.
    let check = |path: std::path::PathBuf, key: String| {
        move || warden(&["ledger", "verify-file", path.to_str().expect("utf8"), "--key", &key], "http://127.0.0.1:1")
    };
    // Offline: the ledger is stopped before verifying.
    let mut mesh = mesh;
    mesh.ledger.kill();
    let ok = tokio::task::spawn_blocking(check(file.clone(), key.clone())).await.expect("verify");
    let text = String::from_utf8_lossy(&ok.stdout);
    assert!(ok.status.success() && text.starts_with("valid"), "{text}{}", String::from_utf8_lossy(&ok.stderr));

    let content = String::from_utf8(out.stdout).expect("utf8");
    let tampered = content.replacen("HELLO, WARDEN", "GOODBYE, WARDEN", 1);
    assert_ne!(tampered, content);
    let bad = mesh.dir.path().join("tampered.jsonl");
    std::fs::write(&bad, tampered).expect("write");
    let res = tokio::task::spawn_blocking(check(bad, key)).await.expect("verify");
    let text = String::from_utf8_lossy(&res.stdout);
    assert_eq!(res.status.code(), Some(1), "{text}");
    assert!(text.starts_with("invalid: line") && text.contains("seq"), "{text}");

    let other_key = hex::encode(ed25519_dalek::SigningKey::from_bytes(&[7u8; 32]).verifying_key().as_bytes());
    let res = tokio::task::spawn_blocking(check(file, other_key)).await.expect("verify");
    assert_eq!(res.status.code(), Some(1), "a head signed by another key is refused");
}

#[tokio::test]
async fn k13_an_exported_run_verifies_offline_and_tampering_is_named_on_sqlite() {
    k13_an_exported_run_verifies_offline_and_tampering_is_named(Backend::Sqlite).await;
}

#[tokio::test]
async fn k13_an_exported_run_verifies_offline_and_tampering_is_named_on_postgres() {
    k13_an_exported_run_verifies_offline_and_tampering_is_named(Backend::Postgres).await;
}

/// A head the ledger writes is stored with its MAC, not a signature: `GetSignedHead` signs
/// `{run_id, seq, hash}` once the MAC verifies, and `VerifyRun` accepts it. A MAC altered in
/// the store is refused by both (`DATA_LOSS`: no head is signed on it). A head signature
/// stored under the MAC's mark — what a ledger of the earlier version writes beside this one
/// during an upgrade — is still taken.
async fn a_head_stored_with_the_ledgers_mac_is_signed_when_asked(backend: Backend) {
    let mut opts = warden_testkit::MeshOptions::default();
    opts.tenants[0].1.push("sleep".into());
    let mesh = mesh_with(backend, opts).await;
    let work = plan(&[("first", "echo", json!({"n": 1}), &[]), ("nap", "sleep", json!({"ms": 60_000}), &["first"])]);
    let id = submit(&mesh, "acme", &work).await;
    let requested = first_event(&mesh, "acme", &id, |e| e.event_type == "tool_requested" && e.step_id == "nap").await;
    sqlx::any::install_default_drivers();
    let url = if mesh.database_url.starts_with("sqlite") {
        format!("{}?mode=rw", mesh.database_url)
    } else {
        mesh.database_url.clone()
    };
    let db = sqlx::any::AnyPoolOptions::new().max_connections(1).connect(&url).await.expect("open the database");
    let stored = || {
        let (db, id) = (db.clone(), id.clone());
        async move {
            let (proof, last_seq, mac): (String, i64, String) =
                sqlx::query_as(&format!("SELECT head_proof, last_seq, head_signature FROM runs WHERE run_id = '{id}'"))
                    .fetch_one(&db)
                    .await
                    .expect("the run's row");
            (proof, last_seq as u64, mac)
        }
    };
    let (proof, last_seq, mac) = stored().await;
    assert_eq!((proof.as_str(), last_seq, mac.len()), ("mac", requested.seq, 64), "the request is the head");

    let mut ledger = mesh.ledger();
    let signed_head = || {
        let (mut ledger, id) = (mesh.ledger(), id.clone());
        async move { ledger.get_signed_head(pb::GetSignedHeadRequest { tenant: "acme".into(), run_id: id }).await }
    };
    let head = signed_head().await.expect("a signed head").into_inner();
    assert_eq!((head.seq, head.hash.as_str()), (requested.seq, requested.hash.as_str()));
    let key =
        ed25519_dalek::VerifyingKey::from_bytes(&head.public_key.clone().try_into().expect("32 bytes")).expect("key");
    let as_signed = warden_core::head::Head { run_id: id.clone(), seq: head.seq, hash: head.hash.clone() };
    assert!(as_signed.verify(&head.signature, &key), "signed as any head is");
    assert!(verify(&mut ledger, "acme", &id).await.valid);

    let set = |signature: String| {
        let (db, id) = (db.clone(), id.clone());
        async move {
            sqlx::query(&format!("UPDATE runs SET head_signature = '{signature}' WHERE run_id = '{id}'"))
                .execute(&db)
                .await
                .expect("set the stored proof");
        }
    };
    set(format!("{}{}", if mac.starts_with('0') { "1" } else { "0" }, &mac[1..])).await;
    let e = signed_head().await.expect_err("no head is signed on a proof that does not verify");
    assert_eq!(e.code(), tonic::Code::DataLoss, "{e:?}");
    let v = verify(&mut ledger, "acme", &id).await;
    assert!(!v.valid && v.reason.contains("head"), "{v:?}");

    // A head signature under the MAC's mark, as an earlier ledger writes it.
    set(hex::encode(&head.signature)).await;
    assert!(verify(&mut ledger, "acme", &id).await.valid);
    let again = signed_head().await.expect("the stored signature").into_inner();
    assert_eq!(again.signature, head.signature);
}

#[tokio::test]
async fn a_head_stored_with_the_ledgers_mac_is_signed_when_asked_on_sqlite() {
    a_head_stored_with_the_ledgers_mac_is_signed_when_asked(Backend::Sqlite).await;
}

#[tokio::test]
async fn a_head_stored_with_the_ledgers_mac_is_signed_when_asked_on_postgres() {
    a_head_stored_with_the_ledgers_mac_is_signed_when_asked(Backend::Postgres).await;
}

async fn k20_another_tenant_cannot_read_or_write_a_run_in_the_ledger(backend: Backend) {
    let mesh = mesh_on(backend).await;
    let id = submit(&mesh, "acme", HELLO).await;
    settled(&mesh, "acme", &id).await;
    let mut l = mesh.ledger();
    let t = || "globex".to_string();
    let codes = [
        l.get_run(pb::GetLedgerRunRequest { tenant: t(), run_id: id.clone(), with_events: false })
            .await
            .err()
            .map(|e| e.code()),
        l.verify_run(pb::VerifyRunRequest { tenant: t(), run_id: id.clone() }).await.err().map(|e| e.code()),
        l.list_receipts(pb::ListReceiptsRequest { tenant: t(), run_id: id.clone(), ..Default::default() })
            .await
            .err()
            .map(|e| e.code()),
        l.get_signed_head(pb::GetSignedHeadRequest { tenant: t(), run_id: id.clone() }).await.err().map(|e| e.code()),
        l.stream_events(pb::StreamEventsRequest { tenant: t(), run_id: id.clone(), since_seq: 0, follow: false })
            .await
            .err()
            .map(|e| e.code()),
        mesh.runs().get_run(pb::GetRunRequest { tenant: t(), run_id: id.clone() }).await.err().map(|e| e.code()),
    ];
    for c in codes {
        assert_eq!(c, Some(tonic::Code::NotFound));
    }
    let listed = mesh
        .runs()
        .list_runs(pb::ListRunsRequest { tenant: t(), ..Default::default() })
        .await
        .expect("list")
        .into_inner();
    assert!(listed.runs.is_empty());
}

#[tokio::test]
async fn k20_another_tenant_cannot_read_or_write_a_run_in_the_ledger_on_sqlite() {
    k20_another_tenant_cannot_read_or_write_a_run_in_the_ledger(Backend::Sqlite).await;
}

#[tokio::test]
async fn k20_another_tenant_cannot_read_or_write_a_run_in_the_ledger_on_postgres() {
    k20_another_tenant_cannot_read_or_write_a_run_in_the_ledger(Backend::Postgres).await;
}

/// With authentication on, a token scoped to one tenant can neither read nor write another
/// tenant's runs, whatever tenant its requests name (K20); operators' `*` tokens read across.
async fn k20_a_caller_scoped_to_one_tenant_never_reaches_another_tenants_runs(backend: Backend) {
    use tonic::Code;
    let (ops, acme, globex) =
        ("ops-token-0123456789abcdef", "acme-token-0123456789abcdef", "globex-token-0123456789abcdef");
    let mut opts = warden_testkit::MeshOptions {
        auth_tokens: vec![(ops.into(), "*".into()), (acme.into(), "acme".into()), (globex.into(), "globex".into())],
        service_token: ops.into(),
        ..Default::default()
    };
    opts.tenants.push(("globex".into(), vec!["echo".into()]));
    let mesh = mesh_with(backend, opts).await;
    let id = mesh
        .runs_as(acme)
        .submit_run(pb::SubmitRunRequest { tenant: "acme".into(), plan_json: HELLO.into(), ..Default::default() })
        .await
        .expect("acme submits with its own token")
        .into_inner()
        .run_id;
    assert_eq!(settled(&mesh, "acme", &id).await.status(), pb::RunStatus::Completed);

    let code = |r: Result<tonic::Response<pb::LedgerRun>, tonic::Status>| r.err().map(|e| e.code());
    let (mut g, mut a) = (mesh.ledger_as(globex), mesh.ledger_as(acme));
    let as_acme = || pb::GetLedgerRunRequest { tenant: "acme".into(), run_id: id.clone(), with_events: false };
    assert_eq!(code(g.get_run(as_acme()).await), Some(Code::PermissionDenied), "naming another tenant");
    assert_eq!(
        code(
            g.get_run(pb::GetLedgerRunRequest { tenant: "globex".into(), run_id: id.clone(), with_events: false })
                .await
        ),
        Some(Code::NotFound)
    );
    assert_eq!(
        code(
            g.get_run(pb::GetLedgerRunRequest { tenant: String::new(), run_id: id.clone(), with_events: false }).await
        ),
        Some(Code::PermissionDenied)
    );
    assert_eq!(code(mesh.ledger_as("").get_run(as_acme()).await), Some(Code::Unauthenticated), "no token");
    assert_eq!(
        code(mesh.ledger_as("wrong-token-0123456789abcdef").get_run(as_acme()).await),
        Some(Code::Unauthenticated)
    );
    assert!(a.get_run(as_acme()).await.is_ok(), "acme reads its own run");

    let e = g
        .stream_events(pb::StreamEventsRequest {
            tenant: "acme".into(),
            run_id: id.clone(),
            since_seq: 0,
            follow: false,
        })
        .await
        .expect_err("stream");
    assert_eq!(e.code(), Code::PermissionDenied);
    let e = g.verify_run(pb::VerifyRunRequest { tenant: "acme".into(), run_id: id.clone() }).await.expect_err("verify");
    assert_eq!(e.code(), Code::PermissionDenied);
    let write = pb::PutArtifactRequest {
        tenant: "acme".into(),
        run_id: id.clone(),
        epoch: 99,
        idempotency_key: "x1".into(),
        key: "k".into(),
        value_json: "1".into(),
    };
    assert_eq!(g.put_artifact(write).await.expect_err("write").code(), Code::PermissionDenied);
    let e = g.list_runs(pb::ListLedgerRunsRequest::default()).await.expect_err("all tenants");
    assert_eq!(e.code(), Code::PermissionDenied);
    let e = mesh
        .runs_as(globex)
        .submit_run(pb::SubmitRunRequest { tenant: "acme".into(), plan_json: HELLO.into(), ..Default::default() })
        .await
        .expect_err("submitting for another tenant");
    assert_eq!(e.code(), Code::PermissionDenied);
    let listed = mesh
        .runs_as(acme)
        .list_runs(pb::ListRunsRequest { tenant: "acme".into(), ..Default::default() })
        .await
        .expect("list");
    assert_eq!(listed.into_inner().runs.len(), 1);

    // Probes need no token.
    let mut health = tonic_health::pb::health_client::HealthClient::new(mesh.ledger.channel());
    let status = health
        .check(tonic_health::pb::HealthCheckRequest { service: String::new() })
        .await
        .expect("health")
        .into_inner();
    assert_eq!(status.status(), tonic_health::pb::health_check_response::ServingStatus::Serving);
}

#[tokio::test]
async fn k20_a_caller_scoped_to_one_tenant_never_reaches_another_tenants_runs_on_sqlite() {
    k20_a_caller_scoped_to_one_tenant_never_reaches_another_tenants_runs(Backend::Sqlite).await;
}

#[tokio::test]
async fn k20_a_caller_scoped_to_one_tenant_never_reaches_another_tenants_runs_on_postgres() {
    k20_a_caller_scoped_to_one_tenant_never_reaches_another_tenants_runs(Backend::Postgres).await;
}
