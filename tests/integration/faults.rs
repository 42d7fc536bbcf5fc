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

/// While the policy service is down nothing runs, and the run says what it waits for
/// (`waiting_for: policy`, recorded as `run_waiting`); once it is back the run goes on.
#[tokio::test]
async fn a_policy_restart_within_the_grace_fails_no_run() {
    let mut mesh = mesh_with(Backend::Sqlite, graceful()).await;
    mesh.policy.kill();
    let ids: Vec<String> = futures_join(&mesh, 3).await;
    let wait = first_event(&mesh, "acme", &ids[0], |e| e.event_type == "run_waiting").await;
    assert_eq!(payload(&wait)["on"], json!("policy"), "{wait:?}");
    let run = mesh.runs().get_run(pb::GetRunRequest { tenant: "acme".into(), run_id: ids[0].clone() }).await;
    let run = run.expect("GetRun").into_inner();
    assert_eq!(run.status(), pb::RunStatus::Active);
    assert_eq!(run.waiting_for, vec!["policy".to_string()], "the run says what it waits for");
    let evs = events(&mut mesh.ledger(), "acme", &ids[0]).await;
    assert!(!evs.iter().any(|e| e.event_type == "tool_requested"), "nothing runs while policy is down");
    mesh.policy.restart().expect("restart the policy service");
    for id in &ids {
        let run = settled(&mesh, "acme", id).await;
        assert_eq!(run.status(), pb::RunStatus::Completed, "{}", run.reason);
        let evs = events(&mut mesh.ledger(), "acme", id).await;
        assert_no_outage_recorded(&evs);
        assert!(verify(&mut mesh.ledger(), "acme", id).await.valid);
    }
}

/// A host that stopped in the middle of an e-mail leaves the call marked started with no
/// outcome. Asked under that key, it says the call is in doubt, and the executor hands it to
/// an operator at once: nothing is sent again, nothing is recorded as a failure. (The call
/// waits for an approval first, so the test knows its key and can leave the host's mark.)
#[tokio::test]
async fn a_call_the_host_says_is_in_doubt_goes_to_an_operator_and_is_not_sent_again() {
    let mut opts = graceful();
    opts.approval_rules = vec![("acme".into(), vec!["email.send".into()], vec!["alice".into()])];
    let mesh = mesh_with(Backend::Sqlite, opts).await;
    let mail = json!({"to": "ops@example.com", "subject": "in doubt", "body": "b"});
    let id = submit(&mesh, "acme", &plan(&[("mail", "email.send", mail, &[])])).await;
    // What the host's own state file holds after it stopped mid-call: the mark, no outcome.
    let state = format!("sqlite://{}", mesh.dir.path().join("tools.db").display());
    let mut db = <sqlx::SqliteConnection as sqlx::Connection>::connect(&state).await.expect("tools.db");
    sqlx::query("INSERT INTO started (tenant, idempotency_key, started_at_ms) VALUES ('acme', ?, 1)")
        .bind(format!("{id}:mail:1"))
        .execute(&mut db)
        .await
        .expect("mark the call started");
    drop(db);
    crate::conformance::approve_pending(&mesh, &id, true).await;
    let run = settled(&mesh, "acme", &id).await;
    assert_eq!(run.status(), pb::RunStatus::RequiresReconciliation, "{}\n{}", run.reason, mesh.logs());
    assert!(run.reason.contains("in doubt"), "{}", run.reason);
    assert!(mesh.outbox().is_empty(), "the e-mail was not sent again");
    let evs = events(&mut mesh.ledger(), "acme", &id).await;
    let requested = evs.iter().find(|e| e.event_type == "tool_requested").expect("the call was requested");
    assert_eq!(payload(requested)["idempotency_key"], json!(format!("{id}:mail:1")), "the key the mark was left for");
    assert!(!evs.iter().any(|e| matches!(e.event_type.as_str(), "tool_failed" | "step_failed")), "no failure recorded");
    assert!(verify(&mut mesh.ledger(), "acme", &id).await.valid);
}

/// Redis is killed (every lease, liveness key and rate window gone with it) and restarted
/// under two executors mid-batch: the runs are picked up again, each effect happens once, no
/// outage is recorded as a decision, every chain verifies.
#[tokio::test]
async fn a_redis_restart_loses_no_run_and_repeats_no_effect() {
    let redis = std::sync::Arc::new(
        tokio::task::spawn_blocking(warden_testkit::servers::start_private_redis)
            .await
            .expect("join")
            .expect("a private Redis"),
    );
    let mut opts = graceful();
    opts.executors = 2;
    opts.redis_url = redis.url.clone();
    opts.rate_rules = vec![("acme".into(), 100_000)];
    let mesh = mesh_with(Backend::Postgres, opts).await;
    let ids = submit_mixed(&mesh, 6).await;
    first_event(&mesh, "acme", &ids[0], |e| e.event_type == "tool_requested").await;
    let r = redis.clone();
    tokio::task::spawn_blocking(move || r.restart(Duration::from_millis(300))).await.expect("join").expect("restart");
    assert_batch_whole(&mesh, &ids).await;
}

/// `n` runs of five steps mixing a slow no-op, an e-mail (one per run, told apart by its
/// subject: run `i` sends "run i"), a key write and echoes.
async fn submit_mixed(mesh: &warden_testkit::Mesh, n: usize) -> Vec<String> {
    submit_mixed_from(mesh, 0, n).await
}

/// Runs `first..first + n` of [`submit_mixed`].
async fn submit_mixed_from(mesh: &warden_testkit::Mesh, first: usize, n: usize) -> Vec<String> {
    let mut ids = Vec::new();
    for i in first..first + n {
        let p = plan(&[
            ("a", "echo", json!({"n": i}), &[]),
            ("wait", "sleep", json!({"ms": 200}), &["a"]),
            (
                "mail",
                "email.send",
                json!({"to": "ops@example.com", "subject": format!("run {i}"), "body": "hi"}),
                &["wait"],
            ),
            ("put", "kv.put", json!({"key": format!("k{i}"), "value": i}), &["mail"]),
            ("last", "echo", json!({"v": "{{put.output}}"}), &["put"]),
        ]);
        ids.push(submit(mesh, "acme", &p).await);
    }
    ids
}

/// Every run of [`submit_mixed`] completed, sent its one e-mail once, recorded no outage as a
/// decision or a failure, and its chain verifies.
async fn assert_batch_whole(mesh: &warden_testkit::Mesh, ids: &[String]) {
    for id in ids {
        let run = settled(mesh, "acme", id).await;
        assert_eq!(run.status(), pb::RunStatus::Completed, "{id}: {}\n{}", run.reason, mesh.logs());
        let evs = events(&mut mesh.ledger(), "acme", id).await;
        assert_no_outage_recorded(&evs);
        assert!(verify(&mut mesh.ledger(), "acme", id).await.valid, "{id}");
    }
    let outbox = mesh.outbox();
    for i in 0..ids.len() {
        let sent = outbox.iter().filter(|m| m["subject"] == json!(format!("run {i}"))).count();
        assert_eq!(sent, 1, "run {i}'s e-mail went out {sent} times: {outbox:?}");
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

/// A successor finds a run's first call requested, decided while the run was created, and no
/// outcome. Asked again, it must be the same decision, or its request could not be the one
/// recorded. Here the tenant gained a budget meanwhile, so the policy decides its calls only
/// once a run is on record and will not decide this one again as it did: the call is not
/// asked any other way (that would be another decision), it goes to an operator as an
/// unknown outcome, and nothing after it runs.
#[tokio::test]
async fn a_first_call_the_policy_will_not_decide_again_goes_to_an_operator() {
    let mut opts = graceful();
    opts.executors = 2;
    opts.lease_ttl_ms = 600_000;
    // The first decision is always asked for while the run is created (never given up on a
    // busy machine), so the call taken over is one decided early.
    opts.executor_extra = "first_step_wait_ms = 20000".into();
    let mut mesh = mesh_with(Backend::Postgres, opts).await;
    let plan = plan(&[("wait", "sleep", json!({"ms": 2_000}), &[]), ("after", "echo", json!({"v": 1}), &["wait"])]);
    let id = submit(&mesh, "acme", &plan).await;
    let requested = first_event(&mesh, "acme", &id, |e| e.event_type == "tool_requested" && e.step_id == "wait").await;
    let evs = events(&mut mesh.ledger(), "acme", &id).await;
    let cited = payload(&requested)["decision_id"].clone();
    let decision = evs
        .iter()
        .find(|e| e.event_type == "policy_decision" && payload(e)["decision_id"] == cited)
        .expect("the decision the request cites");
    assert!(
        payload(decision)["plan_sha256"].as_str().is_some_and(|d| d.len() == 64),
        "decided while the run was created: {}",
        decision.payload_json
    );
    let owner = evs.iter().find(|e| e.event_type == "run_started").map(|e| payload(e)["executor"].clone());
    let dead = if owner == Some(json!("executor-0")) { 0 } else { 1 };
    mesh.executors[dead].kill();
    mesh.policy.set_env("WARDEN_POLICY__TENANTS__ACME__MAX_CALLS_PER_RUN", "100");
    mesh.policy.restart().expect("restart the policy with a budget for acme");

    let run = settled(&mesh, "acme", &id).await;
    assert_eq!(run.status(), pb::RunStatus::RequiresReconciliation, "{}\n{}", run.reason, mesh.logs());
    assert!(run.reason.contains("did not decide it again"), "{}", run.reason);
    let evs = events(&mut mesh.ledger(), "acme", &id).await;
    let last = evs.iter().rfind(|e| e.event_type == "run_started").map(|e| payload(e)["executor"].clone());
    assert_eq!(last, Some(json!(format!("executor-{}", 1 - dead))), "taken over");
    let count = |kind: &str| evs.iter().filter(|e| e.event_type == kind).count();
    assert_eq!(count("tool_requested"), 1, "the call was not requested again");
    assert_eq!(count("tool_completed") + count("tool_failed") + count("step_failed"), 0, "nor settled as anything");
    assert!(!evs.iter().any(|e| e.step_id == "after"), "nothing after it ran");
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

/// Fault injection at batch scale, the production shape: PostgreSQL and Redis of the test's
/// own, two executors, runs mixing a slow no-op, an e-mail, a key write and echoes. A wave of
/// runs is submitted before each fault, and the fault comes once the wave is under way:
/// SIGKILL of either executor, of the ledger and of the policy service; a rolling restart of
/// the tool host (SIGTERM: calls in flight finish first — a host killed in the middle of an
/// external effect leaves an outcome only an operator can establish, see
/// `a_tool_host_restart_mid_call_needs_no_operator` for the idempotent case); Redis killed
/// (every key gone) and PostgreSQL restarted under the ledger and the policy store. Every run
/// completes, every e-mail goes out once, no outage is recorded as a decision or a failure,
/// every chain verifies.
#[tokio::test]
async fn a_batch_rides_out_faults_of_every_service() {
    let (pg, redis) = tokio::task::spawn_blocking(|| {
        (
            warden_testkit::servers::start_private_postgres(true).expect("a private PostgreSQL"),
            warden_testkit::servers::start_private_redis().expect("a private Redis"),
        )
    })
    .await
    .expect("join");
    let (pg, redis) = (std::sync::Arc::new(pg), std::sync::Arc::new(redis));
    let mut opts = graceful();
    opts.executors = 2;
    opts.database_url = pg.create_database().await.expect("ledger database");
    opts.policy_database_url = pg.create_database().await.expect("policy database");
    opts.redis_url = redis.url.clone();
    opts.rate_rules = vec![("acme".into(), 100_000)];
    let mut mesh = warden_testkit::Mesh::start(opts).await.expect("mesh");
    let faults = ["executor-0", "ledger", "policy", "tools", "redis", "postgres", "executor-1"];
    let mut ids: Vec<String> = Vec::new();
    for fault in faults {
        let wave = submit_mixed_from(&mesh, ids.len(), 3).await;
        first_event(&mesh, "acme", &wave[0], |e| e.event_type == "tool_requested" && e.step_id == "wait").await;
        match fault {
            "executor-0" | "executor-1" => {
                let ex = &mut mesh.executors[if fault == "executor-0" { 0 } else { 1 }];
                ex.kill();
                ex.restart().expect("restart the executor");
            }
            "ledger" => {
                mesh.ledger.kill();
                mesh.ledger.restart().expect("restart the ledger");
            }
            "policy" => {
                mesh.policy.kill();
                mesh.policy.restart().expect("restart the policy service");
            }
            "tools" => {
                mesh.tools.terminate();
                mesh.tools.restart().expect("restart the tool host");
            }
            "redis" => {
                let r = redis.clone();
                tokio::task::spawn_blocking(move || r.restart(Duration::from_millis(100)))
                    .await
                    .expect("join")
                    .expect("restart Redis");
            }
            _ => {
                let p = pg.clone();
                tokio::task::spawn_blocking(move || p.restart()).await.expect("join").expect("restart PostgreSQL");
            }
        }
        ids.extend(wave);
    }
    assert_batch_whole(&mesh, &ids).await;
}

/// A ledger in front of the real one that loses the answer to the first `CreateRun` it
/// forwards: the creation is committed (the real ledger answered), the caller hears
/// UNAVAILABLE. A real ledger cannot be made to lose an answer after its commit on demand; every
/// other call goes through untouched.
#[derive(Clone)]
struct LosesACreationAnswer {
    upstream: tonic::transport::Channel,
    lost: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl tonic::server::NamedService for LosesACreationAnswer {
    const NAME: &'static str = "warden.v1.Ledger";
}

impl tower::Service<http::Request<tonic::body::Body>> for LosesACreationAnswer {
    type Response = http::Response<tonic::body::Body>;
    type Error = std::convert::Infallible;
    type Future = std::pin::Pin<Box<dyn std::future::Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, _: &mut std::task::Context<'_>) -> std::task::Poll<Result<(), Self::Error>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<tonic::body::Body>) -> Self::Future {
        use std::sync::atomic::Ordering;
        use tower::ServiceExt;
        let upstream = self.upstream.clone();
        let lose = req.uri().path() == "/warden.v1.Ledger/CreateRun" && self.lost.fetch_add(1, Ordering::SeqCst) == 0;
        Box::pin(async move {
            match upstream.oneshot(req).await {
                // The response's head comes once the ledger's handler returned: committed. Only
                // a success is lost (a refusal carries its status in the head).
                Ok(answer) if lose && answer.headers().get("grpc-status").is_none() => {
                    Ok(tonic::Status::unavailable("the answer was lost on the way").into_http())
                }
                Ok(answer) => Ok(answer.map(tonic::body::Body::new)),
                Err(e) => Ok(tonic::Status::unavailable(e.to_string()).into_http()),
            }
        })
    }
}

/// The ledger commits a run with its first request, and the executor never hears back. It
/// looks the run up by the id it picked and drives it: the submission succeeds, the e-mail (not
/// idempotent, so never sent on a guess) goes out once, and no operator is needed. Without the
/// lookup the submission failed and the request recorded with the run waited for an operator.
#[tokio::test]
async fn a_creation_whose_answer_was_lost_is_driven_not_left_to_an_operator() {
    let mut opts = graceful();
    // The first step always travels with the creation, however slow the machine.
    opts.executor_extra = "first_step_wait_ms = 20000".into();
    let mut mesh = mesh_with(Backend::Sqlite, opts).await;
    let upstream =
        tonic::transport::Endpoint::from_shared(mesh.ledger.endpoint.clone()).expect("ledger endpoint").connect_lazy();
    let lost = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let front = LosesACreationAnswer { upstream, lost: lost.clone() };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("address");
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(front)
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    let executor = &mut mesh.executors[0];
    executor.set_env("WARDEN_EXECUTOR__LEDGER_ENDPOINT", &format!("http://{addr}"));
    executor.restart().expect("restart the executor in front of the losing ledger");

    let mail = json!({"to": "ops@example.com", "subject": "once", "body": "b"});
    // `restart` returns once the executor announced its address: it is listening.
    let req = pb::SubmitRunRequest {
        tenant: "acme".into(),
        plan_json: plan(&[("mail", "email.send", mail, &[])]),
        ..Default::default()
    };
    let id = match mesh.runs().submit_run(req).await {
        Ok(r) => r.into_inner().run_id,
        Err(s) => panic!("a creation whose answer was lost failed the submission: {s:?}\n{}", mesh.logs()),
    };
    assert_eq!(lost.load(std::sync::atomic::Ordering::SeqCst), 1, "exactly one creation went through the front");

    let run = settled(&mesh, "acme", &id).await;
    assert_eq!(run.status(), pb::RunStatus::Completed, "{}", run.reason);
    assert_eq!(mesh.outbox().len(), 1, "the mail went out once");
    let evs = events(&mut mesh.ledger(), "acme", &id).await;
    let types: Vec<&str> = evs.iter().map(|e| e.event_type.as_str()).collect();
    assert_eq!(types.iter().filter(|t| **t == "tool_requested").count(), 1, "{types:?}");
    assert_eq!(types.iter().filter(|t| **t == "tool_completed").count(), 1, "{types:?}");
    // The request was recorded with the run, in the creation's commit: the answer that was
    // lost carried it.
    assert!(types.len() >= 5, "{types:?}");
    assert_eq!(&types[..5], ["run_submitted", "run_started", "tools_pinned", "policy_decision", "tool_requested"]);
    assert!(evs[..5].iter().all(|e| e.timestamp_ms == evs[0].timestamp_ms), "one commit: {evs:?}");
    assert_no_outage_recorded(&evs);
    assert!(verify(&mut mesh.ledger(), "acme", &id).await.valid);
    let listed = mesh
        .ledger()
        .list_runs(pb::ListLedgerRunsRequest { tenant: "acme".into(), ..Default::default() })
        .await
        .expect("ListRuns")
        .into_inner();
    assert_eq!(listed.runs.len(), 1, "one run for one submission");
}
