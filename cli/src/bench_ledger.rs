//! `warden bench --suite ledger`: the ledger alone, in the production shape (a separate
//! ledger process on PostgreSQL with durable commits), over gRPC.
//!
//! - appends per second with many runs written concurrently;
//! - single-run sequential append latency p50/p99;
//! - `VerifyRun` and offline `verify-file` on a 100,000-event run.

use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use serde_json::json;
use warden_core::chain::{EventBody, GENESIS_HASH, link};
use warden_core::events;
use warden_proto::v1 as pb;

#[derive(clap::Args, Clone)]
pub struct LedgerBenchArgs {
    /// Runs written concurrently.
    #[arg(long, default_value_t = 128)]
    pub runs: usize,
    /// Appends per run in the concurrent test.
    #[arg(long, default_value_t = 100)]
    pub appends: usize,
    /// Events in the verification test.
    #[arg(long, default_value_t = 100_000)]
    pub verify_events: u64,
}

/// The `i`th decision of a run, signed with the mesh's policy key: the ledger records a
/// `policy_decision` only as the policy signed it, for its tenant, run and step.
fn decision(run_id: &str, i: usize, policy_key: &ed25519_dalek::SigningKey) -> pb::AppendEventRequest {
    let (decision_id, step_id) = (format!("{run_id}-d{i}"), format!("s{i}"));
    let payload = json!({"decision_id": decision_id, "tenant": "default", "run_id": run_id, "step_id": step_id,
                         "attempt": 1, "tool": "echo", "outcome": "allow", "rule_id": "tenant_allowlist",
                         "reason": "bench", "args_sha256": "00"});
    pb::AppendEventRequest {
        tenant: "default".into(),
        run_id: run_id.into(),
        epoch: 1,
        idempotency_key: events::decision_key(&decision_id),
        event_type: events::POLICY_DECISION.into(),
        payload_json: warden_core::decision::sign_decision(payload, policy_key).to_string(),
        step_id,
    }
}

/// A run of `n` events (a submit, then request/complete pairs) built in memory.
fn synthetic_run(run_id: &str, n: u64) -> Vec<warden_core::chain::ChainedEvent> {
    let mut prev = GENESIS_HASH.to_string();
    (1..=n)
        .map(|seq| {
            let (event_type, step_id, payload) = match seq {
                1 => (events::RUN_SUBMITTED, String::new(), json!({"tenant": "default", "plan": {"steps": []}})),
                s if s % 2 == 0 => (
                    events::TOOL_REQUESTED,
                    format!("s{}", s / 2),
                    json!({"attempt": 1, "tool": "echo", "args": {"i": s}}),
                ),
                s => (
                    events::TOOL_COMPLETED,
                    format!("s{}", s / 2),
                    json!({"attempt": 1, "tool": "echo", "output": {"i": s}}),
                ),
            };
            let e = link(
                EventBody {
                    run_id: run_id.into(),
                    seq,
                    event_type: event_type.into(),
                    payload,
                    step_id,
                    epoch: 1,
                    idempotency_key: format!("k{seq}"),
                    timestamp_ms: 1_795_000_000_000 + seq as i64,
                },
                &prev,
            );
            prev = e.hash.clone();
            e
        })
        .collect()
}

/// Most appends the concurrent test signs ahead (`--runs` x `--appends`).
const MAX_CONCURRENT_APPENDS: usize = 1_000_000;

fn ms(us: u64) -> String {
    format!("{:.2}ms", us as f64 / 1000.0)
}

pub async fn run(args: &LedgerBenchArgs) -> anyhow::Result<()> {
    // The concurrent test's appends are signed ahead and held until sent (about 1 kB each).
    anyhow::ensure!(
        args.runs.saturating_mul(args.appends) <= MAX_CONCURRENT_APPENDS,
        "--runs x --appends is at most {MAX_CONCURRENT_APPENDS}"
    );
    let pg = tokio::task::spawn_blocking(|| warden_testkit::servers::start_postgres(false)).await??;
    let database_url = pg.create_database().await?;
    let mesh = warden_testkit::Mesh::start(warden_testkit::MeshOptions {
        database_url: database_url.clone(),
        executors: 0,
        tenants: vec![("default".into(), vec!["echo".into()])],
        ..Default::default()
    })
    .await?;
    let ledger = warden_proto::v1::ledger_client::LedgerClient::new(mesh.ledger.channel());
    let policy_key = warden_grpc::keyfile::load_or_create(&mesh.dir.path().join("policy.key"))?;
    let create = |mut l: warden_proto::v1::ledger_client::LedgerClient<warden_grpc::auth::Ch>| async move {
        let r = l
            .create_run(pb::CreateRunRequest {
                tenant: "default".into(),
                plan_json: r#"{"steps":[]}"#.into(),
                ..Default::default()
            })
            .await?
            .into_inner();
        anyhow::Ok(r.run.map(|r| r.run_id).unwrap_or_default())
    };

    // Concurrent runs.
    let mut ids = Vec::new();
    for _ in 0..args.runs {
        ids.push(create(ledger.clone()).await?);
    }
    // Signed before the clock starts: the figures are the ledger's, not the client's signing.
    let appends: Vec<Vec<pb::AppendEventRequest>> =
        ids.iter().map(|id| (0..args.appends).map(|i| decision(id, i, &policy_key)).collect()).collect();
    let started = Instant::now();
    let mut tasks = Vec::new();
    for requests in appends {
        let mut l = ledger.clone();
        tasks.push(tokio::spawn(async move {
            for request in requests {
                l.append_event(request).await?;
            }
            anyhow::Ok(())
        }));
    }
    for t in tasks {
        t.await??;
    }
    let total = args.runs * args.appends;
    let wall = started.elapsed();
    println!(
        "ledger  concurrent appends: {} runs x {} = {total} appends in {:.2}s  {:>8.0} appends/s",
        args.runs,
        args.appends,
        wall.as_secs_f64(),
        total as f64 / wall.as_secs_f64()
    );

    // One run, one writer.
    let id = create(ledger.clone()).await?;
    let mut l = ledger.clone();
    let mut h = Histogram::<u64>::new(3)?;
    for request in (0..1000).map(|i| decision(&id, i, &policy_key)).collect::<Vec<_>>() {
        let t = Instant::now();
        l.append_event(request).await?;
        h.record(t.elapsed().as_micros() as u64)?;
    }
    println!(
        "ledger  sequential appends, one run: 1000  p50 {}  p99 {}",
        ms(h.value_at_quantile(0.5)),
        ms(h.value_at_quantile(0.99))
    );

    // Verification of a long run: seeded through the ledger's import path, signed by the
    // ledger's own key, then verified over gRPC and offline from an export file.
    let run_id = format!("bench-{}", std::process::id());
    let chain = synthetic_run(&run_id, args.verify_events);
    let key = warden_grpc::keyfile::load_or_create(&mesh.dir.path().join("ledger.key"))?;
    let store = warden_ledger::LedgerStore::connect(&database_url, 4, key).await?;
    let seeded = Instant::now();
    store.import("default", &chain).await?;
    let seed_time = seeded.elapsed();
    let t = Instant::now();
    let v = l.verify_run(pb::VerifyRunRequest { tenant: "default".into(), run_id: run_id.clone() }).await?.into_inner();
    let verify_time = t.elapsed();
    anyhow::ensure!(v.valid, "seeded run does not verify: {}", v.reason);
    let file = mesh.dir.path().join("long.jsonl");
    export_to(&mut l, &run_id, &file).await?;
    let t = Instant::now();
    let lines = std::io::BufRead::lines(std::io::BufReader::new(std::fs::File::open(&file)?)).map_while(Result::ok);
    let report = warden_core::export::verify(lines, None).map_err(|e| anyhow::anyhow!("{e}"))?;
    let file_time = t.elapsed();
    println!(
        "ledger  {} events: import {:.2}s, VerifyRun {:.2}s ({:.0} events/s), verify-file {:.2}s ({:.0} events/s, {} receipts)",
        v.events,
        seed_time.as_secs_f64(),
        verify_time.as_secs_f64(),
        v.events as f64 / verify_time.as_secs_f64(),
        file_time.as_secs_f64(),
        report.events as f64 / file_time.as_secs_f64().max(1e-9),
        report.receipts,
    );
    drop(mesh);
    let _ = Duration::ZERO;
    Ok(())
}

async fn export_to(
    l: &mut warden_proto::v1::ledger_client::LedgerClient<warden_grpc::auth::Ch>,
    run_id: &str,
    path: &std::path::Path,
) -> anyhow::Result<()> {
    let target = crate::Target { endpoint: String::new(), ledger_endpoint: String::new(), tenant: "default".into() };
    let mut out = std::io::BufWriter::new(std::fs::File::create(path)?);
    crate::run::export_with(l, &target, run_id, &mut out).await
}
