//! The ledger's contract, run unchanged against SQLite and PostgreSQL.

use serde_json::json;
use warden_proto::v1 as pb;
use warden_testkit::MeshOptions;

use crate::*;

struct Fixture {
    mesh: warden_testkit::Mesh,
    ledger: LedgerClient<Ch>,
    run_id: String,
}

async fn fixture(backend: Backend) -> Fixture {
    let mesh = services_on(backend).await;
    let mut ledger = mesh.ledger();
    let run_id = empty_run(&mut ledger, "acme").await;
    Fixture { mesh, ledger, run_id }
}

fn note(run_id: &str, key: &str) -> pb::AppendEventRequest {
    pb::AppendEventRequest {
        tenant: "acme".into(),
        run_id: run_id.into(),
        epoch: 1,
        idempotency_key: key.into(),
        event_type: "run_started".into(),
        payload_json: json!({"note": key}).to_string(),
        step_id: String::new(),
    }
}

async fn concurrent_appends_are_contiguous_and_idempotent(backend: Backend) {
    let Fixture { mesh, mut ledger, run_id } = fixture(backend).await;
    let mut tasks = Vec::new();
    for w in 0..8 {
        let (mut l, r) = (mesh.ledger(), run_id.clone());
        tasks.push(tokio::spawn(async move {
            for i in 0..10 {
                let req = note(&r, &format!("w{w}-e{i}"));
                let first = l.append_event(req.clone()).await.expect("append").into_inner();
                // A retried append (same key) returns the first result.
                let again = l.append_event(req).await.expect("retry").into_inner();
                assert!(again.deduplicated && !first.deduplicated);
                assert_eq!(again.event, first.event);
            }
        }));
    }
    for t in tasks {
        t.await.expect("writer");
    }
    let evs = events(&mut ledger, "acme", &run_id).await;
    assert_eq!(evs.len(), 81, "run_submitted plus 80 appends, none doubled");
    for (i, e) in evs.iter().enumerate() {
        assert_eq!(e.seq, i as u64 + 1);
    }
    assert!(verify(&mut ledger, "acme", &run_id).await.valid);
}

#[tokio::test]
async fn concurrent_appends_are_contiguous_and_idempotent_on_sqlite() {
    concurrent_appends_are_contiguous_and_idempotent(Backend::Sqlite).await;
}

#[tokio::test]
async fn concurrent_appends_are_contiguous_and_idempotent_on_postgres() {
    concurrent_appends_are_contiguous_and_idempotent(Backend::Postgres).await;
}

/// A brief append answers every event without its payload, and otherwise as a whole answer
/// would: the seqs and hashes stored, and a repeat marked as such (with what was stored).
async fn brief_appends_answer_without_payloads(backend: Backend) {
    let Fixture { mesh: _mesh, mut ledger, run_id } = fixture(backend).await;
    let input = |key: &str| {
        let n = note(&run_id, key);
        pb::EventInput {
            idempotency_key: n.idempotency_key,
            event_type: n.event_type,
            payload_json: n.payload_json,
            step_id: n.step_id,
        }
    };
    let append = |events: Vec<pb::EventInput>, brief: bool| pb::AppendEventsRequest {
        tenant: "acme".into(),
        run_id: run_id.clone(),
        epoch: 1,
        events,
        brief,
    };
    let brief = ledger.append_events(append(vec![input("a"), input("b")], true)).await.expect("brief").into_inner();
    let whole = ledger.append_events(append(vec![input("b"), input("c")], false)).await.expect("whole").into_inner();
    let stored = events(&mut ledger, "acme", &run_id).await;
    let by_key = |key: &str| stored.iter().find(|e| e.idempotency_key == key).expect("stored").clone();
    for (answer, key) in brief.appended.iter().zip(["a", "b"]) {
        let event = answer.event.clone().expect("event");
        assert!(event.payload_json.is_empty(), "brief: {event:?}");
        assert!(!answer.deduplicated);
        let stored = by_key(key);
        assert_eq!((event.seq, &event.hash, &event.prev_hash), (stored.seq, &stored.hash, &stored.prev_hash));
        assert_eq!(event.idempotency_key, key);
    }
    // Whole answers carry the payload, the stored one for a repeat.
    assert!(whole.appended[0].deduplicated);
    for (answer, key) in whole.appended.iter().zip(["b", "c"]) {
        let event = answer.event.clone().expect("event");
        assert_eq!(event.payload_json, by_key(key).payload_json);
        assert_eq!(event.seq, by_key(key).seq);
    }
    let repeat = ledger.append_events(append(vec![input("c")], true)).await.expect("repeat").into_inner();
    assert!(repeat.appended[0].deduplicated, "a brief repeat is a repeat");
    assert_eq!(repeat.appended[0].event.as_ref().map(|e| e.seq), Some(by_key("c").seq));
}

#[tokio::test]
async fn brief_appends_answer_without_payloads_on_sqlite() {
    brief_appends_answer_without_payloads(Backend::Sqlite).await;
}

#[tokio::test]
async fn brief_appends_answer_without_payloads_on_postgres() {
    brief_appends_answer_without_payloads(Backend::Postgres).await;
}

async fn bad_appends_write_nothing(backend: Backend) {
    let Fixture { mesh: _mesh, mut ledger, run_id } = fixture(backend).await;
    let cases: Vec<(pb::AppendEventRequest, tonic::Code, &str)> = vec![
        (
            pb::AppendEventRequest { payload_json: "{not json".into(), ..note(&run_id, "k1") },
            tonic::Code::InvalidArgument,
            "payload_json",
        ),
        (
            pb::AppendEventRequest { payload_json: "[1]".into(), ..note(&run_id, "k2") },
            tonic::Code::InvalidArgument,
            "payload_json",
        ),
        (
            pb::AppendEventRequest {
                payload_json: json!({"x": "y".repeat(2 << 20)}).to_string(),
                ..note(&run_id, "k3")
            },
            tonic::Code::InvalidArgument,
            "payload_json",
        ),
        (
            pb::AppendEventRequest { event_type: "made_up".into(), ..note(&run_id, "k4") },
            tonic::Code::InvalidArgument,
            "event_type",
        ),
        (
            pb::AppendEventRequest { idempotency_key: String::new(), ..note(&run_id, "") },
            tonic::Code::InvalidArgument,
            "idempotency_key",
        ),
        (
            pb::AppendEventRequest { run_id: "no such run".into(), ..note(&run_id, "k5") },
            tonic::Code::InvalidArgument,
            "run_id",
        ),
        (
            pb::AppendEventRequest { step_id: "a.b".into(), ..note(&run_id, "k6") },
            tonic::Code::InvalidArgument,
            "step_id",
        ),
    ];
    for (req, code, field) in cases {
        let e = ledger.append_event(req).await.expect_err("refused");
        assert_eq!(e.code(), code, "{field}: {e:?}");
        assert_field_violation(&e, field);
    }
    let e = ledger
        .append_event(pb::AppendEventRequest {
            run_id: "01900000-0000-7000-8000-000000000000".into(),
            ..note(&run_id, "k7")
        })
        .await
        .expect_err("unknown run");
    assert_eq!(e.code(), tonic::Code::NotFound);
    let e = ledger
        .append_event(pb::AppendEventRequest { tenant: "globex".into(), ..note(&run_id, "k8") })
        .await
        .expect_err("other tenant");
    assert_eq!(e.code(), tonic::Code::NotFound, "another tenant's run does not exist for it");
    let e = ledger
        .get_run(pb::GetLedgerRunRequest { tenant: "globex".into(), run_id: run_id.clone(), with_events: false })
        .await
        .expect_err("other tenant");
    assert_eq!(e.code(), tonic::Code::NotFound);
    let run = ledger
        .get_run(pb::GetLedgerRunRequest { tenant: "acme".into(), run_id: run_id.clone(), with_events: false })
        .await
        .expect("run")
        .into_inner();
    assert_eq!(run.last_seq, 1, "no refused append left anything");
    assert!(verify(&mut ledger, "acme", &run_id).await.valid);
}

#[tokio::test]
async fn bad_appends_get_the_right_code_and_write_nothing_on_sqlite() {
    bad_appends_write_nothing(Backend::Sqlite).await;
}

#[tokio::test]
async fn bad_appends_get_the_right_code_and_write_nothing_on_postgres() {
    bad_appends_write_nothing(Backend::Postgres).await;
}

async fn streams_resume_and_end_with_the_run(backend: Backend) {
    let Fixture { mesh, mut ledger, run_id } = fixture(backend).await;
    for i in 0..3 {
        ledger.append_event(note(&run_id, &format!("n{i}"))).await.expect("append");
    }
    let mut follow = ledger
        .stream_events(pb::StreamEventsRequest {
            tenant: "acme".into(),
            run_id: run_id.clone(),
            since_seq: 2,
            follow: true,
        })
        .await
        .expect("stream")
        .into_inner();
    let first = follow.message().await.expect("event").expect("some");
    assert_eq!(first.seq, 3, "resumes after since_seq");
    assert_eq!(follow.message().await.expect("event").expect("some").seq, 4);
    let mut writer = mesh.ledger();
    let r = run_id.clone();
    let finisher = tokio::spawn(async move {
        writer.append_event(note(&r, "n3")).await.expect("append");
        let done = pb::AppendEventRequest {
            event_type: "run_completed".into(),
            payload_json: r#"{"reason":""}"#.into(),
            ..note(&r, "done")
        };
        writer.append_event(done).await.expect("complete");
    });
    assert_eq!(follow.message().await.expect("event").expect("followed").seq, 5);
    let last = follow.message().await.expect("event").expect("followed");
    assert_eq!(last.event_type, "run_completed");
    assert!(follow.message().await.expect("clean end").is_none(), "the stream ends with the run");
    finisher.await.expect("finisher");
    let e = ledger.append_event(note(&run_id, "after-end")).await.expect_err("terminal runs take no events");
    assert_eq!(e.code(), tonic::Code::FailedPrecondition);
}

#[tokio::test]
async fn streams_resume_and_end_with_the_run_on_sqlite() {
    streams_resume_and_end_with_the_run(Backend::Sqlite).await;
}

#[tokio::test]
async fn streams_resume_and_end_with_the_run_on_postgres() {
    streams_resume_and_end_with_the_run(Backend::Postgres).await;
}

/// The services without an executor, on a PostgreSQL of their own (which the test restarts).
async fn services_on_private_postgres() -> (std::sync::Arc<warden_testkit::Postgres>, warden_testkit::Mesh) {
    let pg = std::sync::Arc::new(
        tokio::task::spawn_blocking(|| warden_testkit::servers::start_private_postgres(true))
            .await
            .expect("join")
            .expect("private postgres"),
    );
    let url = pg.create_database().await.expect("database");
    let options = warden_testkit::MeshOptions { database_url: url, executors: 0, ..Default::default() };
    (pg, warden_testkit::Mesh::start(options).await.expect("mesh"))
}

/// Reads right after PostgreSQL restarted, with the pool full of connections the restart cut:
/// each is answered (the ledger reads again on another connection), none is UNAVAILABLE.
#[tokio::test]
async fn reads_after_a_postgres_restart_are_answered() {
    let (pg, mesh) = services_on_private_postgres().await;
    let mut ledger = mesh.ledger();
    let run_id = empty_run(&mut ledger, "acme").await;
    let get = |l: &LedgerClient<Ch>| {
        let (mut l, r) = (l.clone(), run_id.clone());
        async move { l.get_run(pb::GetLedgerRunRequest { tenant: "acme".into(), run_id: r, with_events: false }).await }
    };
    // Reads at once, so the pool holds several connections.
    let reads: Vec<_> = (0..8).map(|_| tokio::spawn(get(&ledger))).collect();
    for r in reads {
        r.await.expect("join").expect("read before the restart");
    }
    let restarter = pg.clone();
    tokio::task::spawn_blocking(move || restarter.restart()).await.expect("join").expect("restart postgres");
    for i in 0..3 {
        let run = get(&ledger).await.unwrap_or_else(|s| panic!("read {i} after the restart: {s:?}")).into_inner();
        assert_eq!(run.run_id, run_id);
    }
    for e in events(&mut ledger, "acme", &run_id).await {
        assert!(e.seq > 0);
    }
}

/// PostgreSQL restarts in the middle of a stream of appends: writers see UNAVAILABLE, retry
/// with the same keys, and the run ends with no gap, no duplicate and a valid chain.
#[tokio::test]
async fn postgres_restart_mid_stream_loses_and_doubles_nothing() {
    let (pg, mesh) = services_on_private_postgres().await;
    let mut ledger = mesh.ledger();
    let run_id = empty_run(&mut ledger, "acme").await;
    const WRITERS: usize = 4;
    // Each writer goes on until PostgreSQL has restarted and then this many appends more, so
    // the stream spans the restart by construction (no pacing by the clock).
    const AFTER_RESTART: usize = 20;
    let unavailable = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let restarted = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut tasks = Vec::new();
    for w in 0..WRITERS {
        let (mut l, r, seen, done) = (mesh.ledger(), run_id.clone(), unavailable.clone(), restarted.clone());
        tasks.push(tokio::spawn(async move {
            let mut after = 0;
            let mut i = 0;
            while after < AFTER_RESTART {
                if done.load(std::sync::atomic::Ordering::Acquire) {
                    after += 1;
                }
                let req = note(&r, &format!("w{w}-e{i}"));
                // Retry with the same key until the ledger answers; bounded so a broken
                // ledger fails the test instead of hanging it.
                let mut tries = 0;
                loop {
                    // A client's retry backoff (not a wait for a condition).
                    match l.append_event(req.clone()).await {
                        Ok(_) => break,
                        Err(s) if s.code() == tonic::Code::Unavailable && tries < 600 => {
                            seen.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            tries += 1;
                            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                        }
                        Err(s) => panic!("append {w}/{i} failed: {s:?}"),
                    }
                }
                i += 1;
            }
            i
        }));
    }
    // Restart once the stream is under way.
    let probe = mesh.ledger();
    // Followed, not polled: the 21st event is the sign the appends are under way.
    first_event(&mesh, "acme", &run_id, |e| e.seq > 20).await;
    let restarter = pg.clone();
    tokio::task::spawn_blocking(move || restarter.restart()).await.expect("join").expect("restart postgres");
    // The first read after the restart is answered: every pooled connection the restart cut
    // is let go and the read asked again on another, inside the ledger.
    let at_restart = probe
        .clone()
        .get_run(pb::GetLedgerRunRequest { tenant: "acme".into(), run_id: run_id.clone(), with_events: false })
        .await
        .unwrap_or_else(|s| panic!("a read right after the restart: {s:?}"))
        .into_inner()
        .last_seq;
    // Only now do the writers count down their last appends: however long that read took,
    // the stream goes on past it (it once ended before a slow read under load).
    restarted.store(true, std::sync::atomic::Ordering::Release);
    let mut written = 0;
    for t in tasks {
        written += t.await.expect("writer");
    }
    assert!(at_restart < (1 + written) as u64, "the restart happened mid-stream");
    // Read as any client reads: the ledger itself reads again past connections the restart cut.
    let evs = events(&mut probe.clone(), "acme", &run_id).await;
    assert_eq!(evs.len(), 1 + written, "no event lost, none doubled");
    for (i, e) in evs.iter().enumerate() {
        assert_eq!(e.seq, i as u64 + 1, "no gap");
    }
    let keys: std::collections::HashSet<&str> = evs.iter().map(|e| e.idempotency_key.as_str()).collect();
    assert_eq!(keys.len(), evs.len());
    let verified = verify(&mut probe.clone(), "acme", &run_id).await;
    assert!(verified.valid);
    // Writers caught mid-call saw UNAVAILABLE and retried; others just waited for a connection.
    eprintln!(
        "appends answered UNAVAILABLE during the restart: {}",
        unavailable.load(std::sync::atomic::Ordering::Relaxed)
    );
    let _ = &mut ledger;
}

async fn list_runs_pages_by_tenant_and_status(backend: Backend) {
    let mesh = services_on(backend).await;
    let mut l = mesh.ledger();
    let mut ids = Vec::new();
    for i in 0..7 {
        let tenant = if i % 2 == 0 { "acme" } else { "globex" };
        let id = l
            .create_run(pb::CreateRunRequest {
                tenant: tenant.into(),
                plan_json: r#"{"steps":[]}"#.into(),
                ..Default::default()
            })
            .await
            .expect("create")
            .into_inner()
            .run
            .expect("run")
            .run_id;
        if tenant == "acme" {
            ids.push(id);
        }
    }
    let done = pb::AppendEventRequest {
        event_type: "run_completed".into(),
        payload_json: r#"{"reason":""}"#.into(),
        ..note(&ids[0], "end")
    };
    l.append_event(done).await.expect("complete one");
    let mut seen = Vec::new();
    let mut token = String::new();
    loop {
        let page = l
            .list_runs(pb::ListLedgerRunsRequest {
                tenant: "acme".into(),
                statuses: vec![],
                page_size: 2,
                page_token: token.clone(),
            })
            .await
            .expect("page")
            .into_inner();
        assert!(page.runs.len() <= 2);
        assert!(page.runs.iter().all(|r| r.tenant == "acme"));
        seen.extend(page.runs.into_iter().map(|r| r.run_id));
        if page.next_page_token.is_empty() {
            break;
        }
        token = page.next_page_token;
    }
    let mut expected = ids.clone();
    expected.sort();
    assert_eq!(seen, expected, "every run of the tenant, once, in id order");
    let completed = l
        .list_runs(pb::ListLedgerRunsRequest {
            tenant: "acme".into(),
            statuses: vec![pb::RunStatus::Completed as i32],
            ..Default::default()
        })
        .await
        .expect("by status")
        .into_inner();
    assert_eq!(completed.runs.iter().map(|r| r.run_id.clone()).collect::<Vec<_>>(), [ids[0].clone()]);
    let e = l
        .list_runs(pb::ListLedgerRunsRequest { statuses: vec![42], ..Default::default() })
        .await
        .expect_err("bad status");
    assert_field_violation(&e, "statuses");
}

#[tokio::test]
async fn list_runs_pages_by_tenant_and_status_on_sqlite() {
    list_runs_pages_by_tenant_and_status(Backend::Sqlite).await;
}

#[tokio::test]
async fn list_runs_pages_by_tenant_and_status_on_postgres() {
    list_runs_pages_by_tenant_and_status(Backend::Postgres).await;
}

/// A consumer that reads slowly gets every event in order; the server only buffers a
/// bounded window (the stream waits for the client) and resumes from `since_seq`.
#[tokio::test]
async fn a_slow_stream_consumer_gets_every_event_in_order() {
    let Fixture { mesh: _mesh, mut ledger, run_id } = fixture(Backend::Sqlite).await;
    let batch: Vec<_> = (0..3000).map(|i| note(&run_id, &format!("e{i}"))).collect();
    let mut writer = ledger.clone();
    let writing = tokio::spawn(async move {
        for req in batch {
            writer.append_event(req).await.expect("append");
        }
    });
    writing.await.expect("writer");
    let mut stream = ledger
        .stream_events(pb::StreamEventsRequest {
            tenant: "acme".into(),
            run_id: run_id.clone(),
            since_seq: 0,
            follow: false,
        })
        .await
        .expect("stream")
        .into_inner();
    let mut expected = 1;
    while let Some(e) = stream.message().await.expect("event") {
        assert_eq!(e.seq, expected);
        expected += 1;
        if expected % 500 == 0 {
            // Slow consumer: the server is blocked on its bounded buffer meanwhile.
            tokio::task::yield_now().await;
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    }
    assert_eq!(expected, 3002, "run_submitted plus 3000 events");
}

/// Two ledger processes on one database (replicas behind a load balancer): each keeps the runs
/// it appended to in memory, so each must notice the other's appends before it writes. Appends
/// alternate between them; every one lands in order, a repeat through the other replica gets
/// the first answer, and fencing holds against a stale in-memory epoch.
async fn two_ledger_replicas_share_a_run(backend: Backend) {
    let Fixture { mesh, ledger: mut a, run_id } = fixture(backend).await;
    let replica = mesh.another_ledger().expect("second ledger");
    let mut b = LedgerClient::new(replica.channel());
    // A follower on A: A's own appends reach it from memory, B's only from the database.
    let mut follow = a
        .stream_events(pb::StreamEventsRequest {
            tenant: "acme".into(),
            run_id: run_id.clone(),
            since_seq: 0,
            follow: true,
        })
        .await
        .expect("stream")
        .into_inner();
    for i in 0..12u64 {
        let l = if i % 2 == 0 { &mut a } else { &mut b };
        let appended = l.append_event(note(&run_id, &format!("k{i}"))).await.expect("append").into_inner();
        assert_eq!(appended.event.expect("event").seq, i + 2, "append {i} lands right after the other replica's");
    }
    // A repeat through the replica that did not write it: the first answer, nothing new.
    let again = a.append_event(note(&run_id, "k1")).await.expect("repeat").into_inner();
    assert!(again.deduplicated);
    assert_eq!(again.event.expect("event").seq, 3);
    // B moves the run to epoch 5; A, which last saw epoch 1, must refuse epoch 1 from now on.
    b.append_event(pb::AppendEventRequest { epoch: 5, ..note(&run_id, "taken-over") }).await.expect("epoch 5");
    let e = a.append_event(note(&run_id, "stale")).await.expect_err("a stale epoch");
    assert!(warden_grpc::is_fenced(&e), "{e:?}");
    a.append_event(pb::AppendEventRequest { epoch: 5, ..note(&run_id, "after") }).await.expect("epoch 5 through A");
    let done = pb::AppendEventRequest {
        event_type: "run_completed".into(),
        payload_json: r#"{"reason":""}"#.into(),
        epoch: 5,
        ..note(&run_id, "done")
    };
    b.append_event(done).await.expect("completed through B");
    let mut followed = Vec::new();
    while let Some(e) = follow.message().await.expect("followed") {
        followed.push(e.seq);
    }
    assert_eq!(followed, (1..=16).collect::<Vec<u64>>(), "the follower saw every event once, in order, to the end");
    let evs = events(&mut a, "acme", &run_id).await;
    assert_eq!(evs.len(), 16, "run_submitted, 12 notes, the takeover, one more and the end; nothing doubled");
    for (i, e) in evs.iter().enumerate() {
        assert_eq!(e.seq, i as u64 + 1);
    }
    assert!(verify(&mut a, "acme", &run_id).await.valid);
    assert!(verify(&mut b, "acme", &run_id).await.valid);

    // Many runs at once: half written through A alone, half through both in turn. A's write
    // lanes batch runs of both kinds together while B moves some of them, and a batch with one
    // moved run must write nothing for any of its runs.
    let mut runs = Vec::new();
    for _ in 0..12 {
        runs.push(empty_run(&mut a, "acme").await);
    }
    let mut writers = Vec::new();
    for (n, run) in runs.iter().enumerate() {
        let (mut a, mut b, run) = (mesh.ledger(), LedgerClient::new(replica.channel()), run.clone());
        writers.push(tokio::spawn(async move {
            for i in 0..20usize {
                let l = if n % 2 == 0 && i % 2 == 1 { &mut b } else { &mut a };
                l.append_event(note(&run, &format!("m{i}"))).await.expect("append");
            }
        }));
    }
    for w in writers {
        w.await.expect("writer");
    }
    for run in &runs {
        let evs = events(&mut b, "acme", run).await;
        let seqs: Vec<u64> = evs.iter().map(|e| e.seq).collect();
        assert_eq!(seqs, (1..=21).collect::<Vec<u64>>(), "run {run}: contiguous, nothing lost or doubled");
        assert!(verify(&mut a, "acme", run).await.valid, "run {run}");
    }
}

#[tokio::test]
async fn two_ledger_replicas_share_a_run_on_sqlite() {
    two_ledger_replicas_share_a_run(Backend::Sqlite).await;
}

#[tokio::test]
async fn two_ledger_replicas_share_a_run_on_postgres() {
    two_ledger_replicas_share_a_run(Backend::Postgres).await;
}

/// Replanning as the ledger holds it, whoever appends: rounds in order, new steps under ids
/// the run never used, `steps` naming exactly them; and no pause once a cancellation was
/// requested (it would leave the request behind the pause). Refusals write nothing.
async fn revisions_and_pauses_are_held_to_what_they_mean(backend: Backend) {
    let mesh = services_on(backend).await;
    let mut ledger = mesh.ledger();
    let create = pb::CreateRunRequest { tenant: "acme".into(), goal: "g".into(), ..Default::default() };
    let run_id = ledger.create_run(create).await.expect("create").into_inner().run.expect("run").run_id;
    let append = |event_type: &str, key: &str, payload: serde_json::Value| pb::AppendEventRequest {
        tenant: "acme".into(),
        run_id: run_id.clone(),
        epoch: 1,
        idempotency_key: key.into(),
        event_type: event_type.into(),
        payload_json: payload.to_string(),
        step_id: String::new(),
    };
    let first =
        json!({"steps": [{"id": "a", "tool": "echo", "params": {}}, {"id": "b", "tool": "echo", "params": {}}]});
    ledger.append_event(append("plan_created", "created", json!({"plan": first}))).await.expect("plan_created");
    let before = events(&mut ledger, "acme", &run_id).await.len();
    let revised = |round: u32, ids: &[&str], steps: &[&str]| {
        let plan: Vec<_> = ids.iter().map(|id| json!({"id": id, "tool": "echo", "params": {}})).collect();
        json!({"round": round, "plan": {"steps": plan}, "steps": steps})
    };
    let refused = [
        (revised(2, &["c"], &["c"]), "payload_json.round"),
        (revised(1, &["a"], &["a"]), "payload_json.plan"),
        (revised(1, &["c", "d"], &["c"]), "payload_json.steps"),
    ];
    for (i, (payload, field)) in refused.into_iter().enumerate() {
        let e = ledger.append_event(append("plan_revised", &format!("bad{i}"), payload)).await.expect_err(field);
        assert_field_violation(&e, field);
    }
    assert_eq!(events(&mut ledger, "acme", &run_id).await.len(), before, "no refused revision left anything");
    ledger.append_event(append("plan_revised", "r1", revised(1, &["c"], &["c"]))).await.expect("round 1");
    let run = ledger
        .get_run(pb::GetLedgerRunRequest { tenant: "acme".into(), run_id: run_id.clone(), with_events: false })
        .await;
    let plan: serde_json::Value = serde_json::from_str(&run.expect("run").into_inner().plan_json).expect("plan");
    assert_eq!(plan["steps"][0]["id"], "c", "the round's plan is the run's plan");
    // Round 2 may not reuse the ids of round 1 nor those before it.
    let again = ledger.append_event(append("plan_revised", "r2", revised(2, &["b"], &["b"]))).await;
    assert_field_violation(&again.expect_err("a used id"), "payload_json.plan");

    ledger.append_event(append("run_started", "started", json!({}))).await.expect("started");
    ledger.append_event(append("run_cancel_requested", "cancel", json!({"reason": "stop"}))).await.expect("cancel");
    let paused = ledger.append_event(append("run_paused", "paused", json!({"reason": "paused"}))).await;
    assert_eq!(paused.expect_err("paused after a cancel request").code(), tonic::Code::FailedPrecondition);
    assert!(verify(&mut ledger, "acme", &run_id).await.valid);
}

#[tokio::test]
async fn revisions_and_pauses_are_held_to_what_they_mean_on_sqlite() {
    revisions_and_pauses_are_held_to_what_they_mean(Backend::Sqlite).await;
}

#[tokio::test]
async fn revisions_and_pauses_are_held_to_what_they_mean_on_postgres() {
    revisions_and_pauses_are_held_to_what_they_mean(Backend::Postgres).await;
}

/// `GetRun` with `with_events` answers the run's log with its row, as `StreamEvents` would,
/// up to 1 MiB of events; the executor's `GetRun` streams whatever did not fit, so its steps
/// are the whole log's however long. Nobody else's run is answered.
async fn a_run_read_with_its_events_is_its_whole_log(backend: Backend) {
    let mesh = mesh_on(backend).await;
    let get = |tenant: &str, run_id: &str, with_events| pb::GetLedgerRunRequest {
        tenant: tenant.into(),
        run_id: run_id.into(),
        with_events,
    };
    let mut ledger = mesh.ledger();

    let small = crate::submit(&mesh, "acme", &plan(&[("a", "echo", json!({"n": 1}), &[])])).await;
    crate::ended(&mesh, "acme", &small).await;
    let read = ledger.get_run(get("acme", &small, true)).await.expect("read").into_inner();
    assert_eq!(read.events, events(&mut ledger, "acme", &small).await, "the whole log, as streamed");
    assert_eq!(read.events.last().map(|e| e.seq), Some(read.last_seq));
    let plain = ledger.get_run(get("acme", &small, false)).await.expect("read").into_inner();
    assert!(plain.events.is_empty(), "events only when asked");
    assert_eq!(pb::LedgerRun { events: Vec::new(), ..read }, plain, "the same row either way");
    let other = ledger.get_run(get("globex", &small, true)).await.expect_err("another tenant's run");
    assert_eq!(other.code(), tonic::Code::NotFound);

    // Six steps echoing 200 kB each from the one before: the plan and every request carry
    // it (outcomes keep large outputs by reference), 1.4 MB of events in all.
    let big = "x".repeat(200_000);
    let params: Vec<serde_json::Value> = (0..6)
        .map(|i| if i == 0 { json!({"text": big}) } else { json!({"text": format!("{{{{s{}.output.text}}}}", i - 1)}) })
        .collect();
    let ids: Vec<String> = (0..6).map(|i| format!("s{i}")).collect();
    let deps: Vec<Vec<&str>> = (0..6).map(|i| if i == 0 { vec![] } else { vec![ids[i - 1].as_str()] }).collect();
    let steps: Vec<(&str, &str, serde_json::Value, &[&str])> =
        (0..6).map(|i| (ids[i].as_str(), "echo", params[i].clone(), &deps[i][..])).collect();
    let long = plan(&steps);
    let long = crate::submit(&mesh, "acme", &long).await;
    let run = crate::ended(&mesh, "acme", &long).await;
    let whole = events(&mut ledger, "acme", &long).await;
    let read = ledger.get_run(get("acme", &long, true)).await.expect("read").into_inner();
    assert!(
        !read.events.is_empty() && read.events.len() < whole.len(),
        "{} of {} events",
        read.events.len(),
        whole.len()
    );
    assert_eq!(read.events[..], whole[..read.events.len()], "a prefix of the log");
    let carried: usize = read.events.iter().map(prost::Message::encoded_len).sum();
    assert!(carried <= 1 << 20, "{carried} bytes of events");
    assert!(prost::Message::encoded_len(&read) < warden_grpc::MAX_MESSAGE_BYTES);
    // The executor's answer (WaitRun's, and GetRun's) folds the rest too.
    assert_eq!(run.status(), pb::RunStatus::Completed, "{:?}", run.reason);
    assert_eq!(run.steps.len(), 6);
    assert!(run.steps.iter().all(|s| s.status() == pb::StepStatus::Completed && s.attempts == 1), "{:?}", run.steps);
    let again = mesh.runs().get_run(pb::GetRunRequest { tenant: "acme".into(), run_id: long }).await.expect("get");
    assert_eq!(again.into_inner().steps, run.steps);
}

#[tokio::test]
async fn a_run_read_with_its_events_is_its_whole_log_on_sqlite() {
    a_run_read_with_its_events_is_its_whole_log(Backend::Sqlite).await;
}

#[tokio::test]
async fn a_run_read_with_its_events_is_its_whole_log_on_postgres() {
    a_run_read_with_its_events_is_its_whole_log(Backend::Postgres).await;
}

/// A burst of submissions larger than the ledger's admission queue (`ledger.max_pending_runs`,
/// here 2) is each either recorded whole and run to its end, or refused at once with
/// RESOURCE_EXHAUSTED and a retry hint, having written nothing. None times out waiting for a
/// database connection. A refused submission tried again later is admitted.
async fn a_burst_past_the_admission_queue_is_recorded_or_refused_whole(backend: Backend) {
    use tonic_types::StatusExt;
    let opts =
        MeshOptions { env: vec![("WARDEN_LEDGER__MAX_PENDING_RUNS".into(), "2".into())], ..MeshOptions::default() };
    let mesh = mesh_with(backend, opts).await;
    let plan = plan(&[("say", "echo", json!({"v": 1}), &[])]);
    let submit = |i: usize| {
        let mut runs = mesh.runs();
        let plan = plan.clone();
        async move {
            let req = pb::SubmitRunRequest {
                tenant: "acme".into(),
                plan_json: plan,
                idempotency_key: format!("burst-{i}"),
                ..Default::default()
            };
            runs.submit_run(req).await.map(|r| r.into_inner().run_id)
        }
    };
    let answers = futures::future::join_all((0..60).map(submit)).await;
    let mut admitted = Vec::new();
    let mut refused = Vec::new();
    for (i, answer) in answers.into_iter().enumerate() {
        match answer {
            Ok(run_id) => admitted.push(run_id),
            Err(s) => {
                assert_eq!(s.code(), tonic::Code::ResourceExhausted, "{s:?}");
                assert!(s.message().contains("ledger.max_pending_runs"), "{s:?}");
                assert!(s.get_details_retry_info().and_then(|r| r.retry_delay).is_some(), "a retry hint: {s:?}");
                refused.push(i);
            }
        }
    }
    let ledger = crate::observability::scrape(&mesh.ledger.metrics_url).await;
    let counted = crate::observability::value(&ledger, "warden_ledger_submissions_refused_total", &[]);
    assert_eq!(counted, refused.len() as f64, "every refusal counted");
    // Sixty at once through a queue of two: some are refused (the bound is the setting's).
    assert!(!refused.is_empty(), "{} admitted, none refused", admitted.len());
    // The refused wrote nothing: the tenant's runs are exactly the admitted ones.
    let listed = mesh
        .ledger()
        .list_runs(pb::ListLedgerRunsRequest { tenant: "acme".into(), page_size: 100, ..Default::default() })
        .await
        .expect("listed")
        .into_inner();
    let mut recorded: Vec<String> = listed.runs.into_iter().map(|r| r.run_id).collect();
    recorded.sort();
    let mut expected = admitted.clone();
    expected.sort();
    assert_eq!(recorded, expected, "{} refused", refused.len());
    // Refused submissions tried again (with their keys) are admitted once the queue drains.
    // Every submission of the burst has been answered, and a place is freed before its
    // answer goes out: the queue is empty, and one submission at a time never fills it.
    for i in refused {
        let run_id = submit(i).await.unwrap_or_else(|s| panic!("refused again: {s:?}"));
        admitted.push(run_id);
    }
    let mut l = mesh.ledger();
    for run_id in &admitted {
        let run = ended(&mesh, "acme", run_id).await;
        assert_eq!(run.status(), pb::RunStatus::Completed, "{run_id}: {}", run.reason);
        assert!(verify(&mut l, "acme", run_id).await.valid, "{run_id}");
    }
}

#[tokio::test]
async fn a_burst_past_the_admission_queue_is_recorded_or_refused_whole_on_sqlite() {
    a_burst_past_the_admission_queue_is_recorded_or_refused_whole(Backend::Sqlite).await;
}

#[tokio::test]
async fn a_burst_past_the_admission_queue_is_recorded_or_refused_whole_on_postgres() {
    a_burst_past_the_admission_queue_is_recorded_or_refused_whole(Backend::Postgres).await;
}

/// Every key the ledger and the policy service index by text compares byte by byte on
/// PostgreSQL (`COLLATE "C"`), whatever the database's own locale: identifiers sorted with
/// strcoll cost every index insert of a step, and would be ordered otherwise than on SQLite.
/// Read off every index key: the index's own collation for it, and its column's as declared
/// (of any string type) or its expression's. Before the migrations that set them, 29 of the
/// ledger's index keys were in the database's default collation.
#[tokio::test]
async fn indexed_identifiers_compare_bytewise_on_postgres() {
    use sqlx::Connection as _;
    let options = MeshOptions {
        database_url: Backend::Postgres.database_url().await,
        policy_database_url: Backend::Postgres.database_url().await,
        executors: 0,
        ..Default::default()
    };
    let (ledger_db, policy_db) = (options.database_url.clone(), options.policy_database_url.clone());
    let mesh = warden_testkit::Mesh::start(options).await.expect("mesh");
    // Each service announces its port before it has opened its store (and migrated), but
    // answers only once it has: one answer from each, and the catalogs are complete.
    mesh.ledger().get_ledger_keys(pb::GetLedgerKeysRequest {}).await.expect("ledger keys");
    mesh.policy().get_verification_keys(pb::GetVerificationKeysRequest {}).await.expect("policy keys");
    // The indexes of the service's own tables.
    const INDEXES: &str = "\
        FROM pg_index x
        JOIN pg_class i ON i.oid = x.indexrelid
        JOIN pg_class c ON c.oid = x.indrelid
        JOIN pg_namespace n ON n.oid = c.relnamespace";
    const OURS: &str = "n.nspname = current_schema() AND c.relname <> '_sqlx_migrations'";
    let count = format!("SELECT count(*) {INDEXES} WHERE {OURS}");
    // Each index key's collation as the index records it, and its column's as declared (an
    // expression's key has no column: attnum 0); 0 for a type without one.
    let not_bytewise = format!(
        "SELECT c.relname || ' (' || i.relname || ')' {INDEXES}
         CROSS JOIN LATERAL unnest(x.indkey::int2[], x.indcollation::oid[]) AS k (attnum, coll)
         LEFT JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum = k.attnum
         WHERE {OURS}
           AND (coalesce(k.coll, 0) NOT IN (0, 'pg_catalog.\"C\"'::regcollation)
                OR coalesce(a.attcollation, 0) NOT IN (0, 'pg_catalog.\"C\"'::regcollation))
         ORDER BY 1"
    );
    for (service, url) in [("ledger", ledger_db), ("policy", policy_db)] {
        let folder = format!("{}/../services/{service}/migrations/postgres", env!("CARGO_MANIFEST_DIR"));
        let migrations = std::fs::read_dir(&folder).expect("migrations").count() as i64;
        let mut conn = sqlx::PgConnection::connect(&url).await.expect("connect");
        let applied: i64 = sqlx::query_scalar("SELECT count(*) FROM _sqlx_migrations WHERE success")
            .fetch_one(&mut conn)
            .await
            .expect("migrations");
        assert_eq!(applied, migrations, "the {service}'s migrations, every one recorded");
        let indexes: i64 = sqlx::query_scalar(&count).fetch_one(&mut conn).await.expect("count indexes");
        assert!(indexes >= 10, "the {service}'s tables are there ({indexes} indexes)");
        let linguistic: Vec<String> = sqlx::query_scalar(&not_bytewise).fetch_all(&mut conn).await.expect("catalog");
        assert!(linguistic.is_empty(), "the {service}'s index keys not in \"C\": {linguistic:?}");
    }
}
