//! A blip is not a failure: restarts of a service shorter than the executors' outage grace
//! fail no run, record no denial and need no operator — every run completes, every effect
//! happens once, every chain verifies.

use std::time::Duration;

use serde_json::json;
use warden_proto::v1 as pb;
use warden_testkit::MeshOptions;

use crate::*;

fn graceful() -> MeshOptions {
    let mut opts = MeshOptions { outage_grace_ms: 30_000, ..MeshOptions::default() };
    opts.tenants[0].1.push("sleep".into());
    opts
}

/// No decision in the ledger is a transient error dressed as a deny.
fn assert_no_outage_recorded(evs: &[pb::Event]) {
    for e in evs {
        let p = payload(e);
        let rule = p["rule_id"].as_str().unwrap_or_default();
        let kind = p["kind"].as_str().unwrap_or_default();
        assert!(
            !matches!(rule, "policy_error" | "rate_limiter_unavailable")
                && !matches!(kind, "policy_unavailable" | "tool_host_unavailable"),
            "an outage was recorded as a decision or a failure: {} {p}",
            e.event_type
        );
    }
}

#[tokio::test]
async fn a_policy_restart_within_the_grace_fails_no_run() {
    let mut mesh = mesh_with(Backend::Sqlite, graceful()).await;
    mesh.policy.kill();
    let ids: Vec<String> = futures_join(&mesh, 3).await;
    tokio::time::sleep(Duration::from_millis(800)).await;
    mesh.policy.restart().expect("restart the policy service");
    for id in &ids {
        let run = settled(&mesh, "acme", id).await;
        assert_eq!(run.status(), pb::RunStatus::Completed, "{}", run.reason);
        let evs = events(&mut mesh.ledger(), "acme", id).await;
        assert_no_outage_recorded(&evs);
        assert!(verify(&mut mesh.ledger(), "acme", id).await.valid);
    }
}

#[tokio::test]
async fn a_tool_host_restart_mid_call_needs_no_operator() {
    let mut mesh = mesh_with(Backend::Sqlite, graceful()).await;
    let plan = plan(&[
        ("wait", "sleep", json!({"ms": 1500}), &[]),
        ("after", "echo", json!({"v": "{{wait.output}}"}), &["wait"]),
    ]);
    let id = submit(&mesh, "acme", &plan).await;
    first_event(&mesh, "acme", &id, |e| e.event_type == "tool_requested" && e.step_id == "wait").await;
    mesh.tools.kill();
    tokio::time::sleep(Duration::from_millis(500)).await;
    mesh.tools.restart().expect("restart the tool host");
    let run = settled(&mesh, "acme", &id).await;
    assert_eq!(run.status(), pb::RunStatus::Completed, "{}\n{}", run.reason, mesh.logs());
    let evs = events(&mut mesh.ledger(), "acme", &id).await;
    assert_no_outage_recorded(&evs);
    assert!(verify(&mut mesh.ledger(), "acme", &id).await.valid);
}

#[tokio::test]
async fn a_ledger_restart_within_the_grace_fails_no_run() {
    let mut mesh = mesh_with(Backend::Postgres, graceful()).await;
    let plan = plan(&[
        ("a", "sleep", json!({"ms": 300}), &[]),
        ("b", "echo", json!({"v": 1}), &["a"]),
        ("c", "echo", json!({"v": 2}), &["b"]),
    ]);
    let id = submit(&mesh, "acme", &plan).await;
    first_event(&mesh, "acme", &id, |e| e.event_type == "tool_requested" && e.step_id == "a").await;
    mesh.ledger.kill();
    tokio::time::sleep(Duration::from_millis(500)).await;
    mesh.ledger.restart().expect("restart the ledger");
    let run = settled(&mesh, "acme", &id).await;
    assert_eq!(run.status(), pb::RunStatus::Completed, "{}\n{}", run.reason, mesh.logs());
    let evs = events(&mut mesh.ledger(), "acme", &id).await;
    assert_no_outage_recorded(&evs);
    assert!(verify(&mut mesh.ledger(), "acme", &id).await.valid);
}

/// Submits `n` hello runs.
async fn futures_join(mesh: &warden_testkit::Mesh, n: usize) -> Vec<String> {
    let mut ids = Vec::new();
    for _ in 0..n {
        ids.push(submit(mesh, "acme", HELLO).await);
    }
    ids
}

/// The executor that drives a run is shut down cleanly mid-run: it lets the call in flight
/// settle, records it, releases the lease and leaves; the other replica takes the run over at
/// once (not after the lease TTL) and finishes it. Nothing is repeated, nothing is lost.
#[tokio::test]
async fn an_executor_shutting_down_hands_its_runs_off() {
    let mut opts = graceful();
    opts.executors = 2;
    opts.lease_ttl_ms = 600_000; // a takeover that waited for the lease would never come in time
    let mut mesh = mesh_with(Backend::Sqlite, opts).await;
    let plan = plan(&[
        ("wait", "sleep", json!({"ms": 800}), &[]),
        ("after", "echo", json!({"v": "{{wait.output}}"}), &["wait"]),
    ]);
    let id = submit(&mesh, "acme", &plan).await;
    first_event(&mesh, "acme", &id, |e| e.event_type == "tool_requested" && e.step_id == "wait").await;
    mesh.executors[0].terminate();
    let run = settled(&mesh, "acme", &id).await;
    assert_eq!(run.status(), pb::RunStatus::Completed, "{}\n{}", run.reason, mesh.logs());
    let evs = events(&mut mesh.ledger(), "acme", &id).await;
    let waited = evs.iter().filter(|e| e.event_type == "tool_completed" && e.step_id == "wait").count();
    assert_eq!(waited, 1, "the call in flight settled once, recorded by the leaving replica");
    let starts: Vec<serde_json::Value> = evs.iter().filter(|e| e.event_type == "run_started").map(payload).collect();
    assert_eq!(starts.last().map(|p| p["executor"].clone()), Some(json!("executor-1")), "{starts:?}");
    assert_no_outage_recorded(&evs);
    assert!(verify(&mut mesh.ledger(), "acme", &id).await.valid);
}

/// An executor killed mid-run (SIGKILL: no hand-off) is detected by its missing liveness, and
/// the other replica takes the run over long before the lease would have expired.
#[tokio::test]
async fn a_killed_executor_is_taken_over_before_its_lease_expires() {
    let mut opts = graceful();
    opts.executors = 2;
    // A takeover that waited for the lease to expire would not happen within the test's wait.
    opts.lease_ttl_ms = 600_000;
    let mut mesh = mesh_with(Backend::Postgres, opts).await;
    let plan = plan(&[
        ("wait", "sleep", json!({"ms": 500}), &[]),
        ("after", "echo", json!({"v": "{{wait.output}}"}), &["wait"]),
    ]);
    let id = submit(&mesh, "acme", &plan).await;
    first_event(&mesh, "acme", &id, |e| e.event_type == "tool_requested" && e.step_id == "wait").await;
    mesh.executors[0].kill();
    let run = settled(&mesh, "acme", &id).await;
    assert_eq!(run.status(), pb::RunStatus::Completed, "{}\n{}", run.reason, mesh.logs());
    let evs = events(&mut mesh.ledger(), "acme", &id).await;
    let started: Vec<&pb::Event> = evs.iter().filter(|e| e.event_type == "run_started").collect();
    assert_eq!(started.last().map(|e| payload(e)["executor"].clone()), Some(json!("executor-1")));
    let waited = evs.iter().filter(|e| e.event_type == "tool_completed" && e.step_id == "wait").count();
    assert_eq!(waited, 1, "the interrupted call is completed once (asked again under its key)");
    assert!(verify(&mut mesh.ledger(), "acme", &id).await.valid);
}

/// PostgreSQL itself restarts (fast shutdown: every connection dropped) under the ledger and
/// the policy store while a run is in flight: the run completes, nothing is recorded as a
/// decision or a failure, the chain verifies.
#[tokio::test]
async fn a_postgres_restart_within_the_grace_fails_no_run() {
    let pg = std::sync::Arc::new(
        tokio::task::spawn_blocking(|| warden_testkit::servers::start_private_postgres(true))
            .await
            .expect("join")
            .expect("a private PostgreSQL"),
    );
    let mut opts = graceful();
    opts.database_url = pg.create_database().await.expect("ledger database");
    opts.policy_database_url = pg.create_database().await.expect("policy database");
    opts.redis_url = warden_testkit::redis().url.clone();
    let mesh = warden_testkit::Mesh::start(opts).await.expect("mesh");
    let plan = plan(&[
        ("wait", "sleep", json!({"ms": 600}), &[]),
        ("after", "echo", json!({"v": "{{wait.output}}"}), &["wait"]),
        ("last", "echo", json!({"v": "{{after.output}}"}), &["after"]),
    ]);
    let id = submit(&mesh, "acme", &plan).await;
    first_event(&mesh, "acme", &id, |e| e.event_type == "tool_requested" && e.step_id == "wait").await;
    let restarter = pg.clone();
    tokio::task::spawn_blocking(move || restarter.restart()).await.expect("join").expect("restart postgres");
    let run = settled(&mesh, "acme", &id).await;
    assert_eq!(run.status(), pb::RunStatus::Completed, "{}\n{}", run.reason, mesh.logs());
    let evs = events(&mut mesh.ledger(), "acme", &id).await;
    assert_no_outage_recorded(&evs);
    assert!(verify(&mut mesh.ledger(), "acme", &id).await.valid);
}
