//! `warden bench`: a 100-step sequential plan of no-op (`echo`) calls and a batch of
//! concurrent runs, in the `warden dev` shape (one process, SQLite, in-process leases) and
//! in the production shape (separate processes, PostgreSQL with durable commits, Redis).
//!
//! Per-step latency is what the executor records in each `tool_completed` event
//! (`elapsed_us`: authorize, decision recorded, tool_requested recorded, tool invoked);
//! steps per second is steps over the wall time from submit to the terminal event.

use std::time::{Duration, Instant};

use anyhow::Context;
use hdrhistogram::Histogram;
use serde_json::{Value, json};
use warden_config::WardenConfig;
use warden_proto::v1 as pb;

use crate::run::{describe, ledger_client, runs_client};

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Shape {
    Dev,
    Prod,
    Both,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Suite {
    /// Steps through every service.
    Steps,
    /// The ledger alone.
    Ledger,
    /// Policy decisions.
    Policy,
    All,
}

#[derive(clap::Args)]
pub struct BenchArgs {
    /// What to measure.
    #[arg(long, value_enum, default_value = "all")]
    suite: Suite,
    #[command(flatten)]
    ledger: crate::bench_ledger::LedgerBenchArgs,
    /// Which deployment shape to measure.
    #[arg(long, value_enum, default_value = "both")]
    shape: Shape,
    /// Steps in the sequential plan.
    #[arg(long, default_value_t = 100)]
    steps: usize,
    /// How many times the sequential plan runs (one after another).
    #[arg(long, default_value_t = 3)]
    sequential_runs: usize,
    /// Runs submitted at once in the concurrent batch.
    #[arg(long, default_value_t = 50)]
    batch_runs: usize,
    /// Sequential steps in each run of the batch.
    #[arg(long, default_value_t = 10)]
    batch_steps: usize,
}

struct Endpoints {
    runs: String,
    ledger: String,
}

/// A chain of `n` echo steps, each depending on (and referencing) the previous one.
fn chain(n: usize) -> String {
    let steps: Vec<Value> = (0..n)
        .map(|i| {
            if i == 0 {
                json!({"id": "s0", "tool": "echo", "params": {"i": 0}})
            } else {
                json!({"id": format!("s{i}"), "tool": "echo", "params": {"i": i, "prev": format!("{{{{s{}.output.i}}}}", i - 1)}, "depends_on": [format!("s{}", i - 1)]})
            }
        })
        .collect();
    json!({"steps": steps}).to_string()
}

struct RunResult {
    wall: Duration,
    step_us: Vec<u64>,
}

/// Submits one plan and follows its events to the end.
async fn one_run(ep: &Endpoints, tenant: &str, plan: &str) -> anyhow::Result<RunResult> {
    let started = Instant::now();
    let run_id = runs_client(&ep.runs)
        .await?
        .submit_run(pb::SubmitRunRequest { tenant: tenant.into(), plan_json: plan.into(), ..Default::default() })
        .await
        .map_err(|s| anyhow::anyhow!("submit refused: {}", describe(&s)))?
        .into_inner()
        .run_id;
    let mut stream = ledger_client(&ep.ledger)
        .await?
        .stream_events(pb::StreamEventsRequest {
            tenant: tenant.into(),
            run_id: run_id.clone(),
            since_seq: 0,
            follow: true,
        })
        .await?
        .into_inner();
    let mut step_us = Vec::new();
    let mut last = String::new();
    while let Some(e) = stream.message().await? {
        if e.event_type == "tool_completed" {
            let p: Value = serde_json::from_str(&e.payload_json)?;
            step_us.push(p["elapsed_us"].as_u64().unwrap_or_default());
        }
        last = e.event_type;
    }
    anyhow::ensure!(last == "run_completed", "run {run_id} ended with {last}");
    Ok(RunResult { wall: started.elapsed(), step_us })
}

fn hist() -> Histogram<u64> {
    Histogram::new(3).unwrap_or_else(|e| panic!("histogram: {e}"))
}

fn ms(us: u64) -> String {
    format!("{:.2}ms", us as f64 / 1000.0)
}

async fn measure(shape: &str, ep: &Endpoints, tenant: &str, args: &BenchArgs) -> anyhow::Result<()> {
    // Warm-up: connections, catalog caches, SQLite/PostgreSQL page caches.
    one_run(ep, tenant, &chain(5)).await.context("warm-up run")?;

    let plan = chain(args.steps);
    let (mut steps, mut wall, mut n) = (hist(), Duration::ZERO, 0u64);
    for _ in 0..args.sequential_runs {
        let r = one_run(ep, tenant, &plan).await?;
        wall += r.wall;
        for us in r.step_us {
            steps.record(us.max(1))?;
            n += 1;
        }
    }
    println!(
        "{shape:<5} sequential {:>3}-step plan x{:<3} {:>6} steps  step p50 {:>8}  p99 {:>8}  {:>8.0} steps/s",
        args.steps,
        args.sequential_runs,
        n,
        ms(steps.value_at_quantile(0.5)),
        ms(steps.value_at_quantile(0.99)),
        n as f64 / wall.as_secs_f64()
    );

    let plan = chain(args.batch_steps);
    let started = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..args.batch_runs {
        let (ep, plan, tenant) =
            (Endpoints { runs: ep.runs.clone(), ledger: ep.ledger.clone() }, plan.clone(), tenant.to_string());
        tasks.push(tokio::spawn(async move { one_run(&ep, &tenant, &plan).await }));
    }
    let (mut steps, mut runs, mut n) = (hist(), hist(), 0u64);
    for t in tasks {
        let r = t.await??;
        runs.record(r.wall.as_micros() as u64)?;
        for us in r.step_us {
            steps.record(us.max(1))?;
            n += 1;
        }
    }
    let wall = started.elapsed();
    println!(
        "{shape:<5} batch {:>3} runs x {:>3} steps   {:>6} steps  step p50 {:>8}  p99 {:>8}  {:>8.0} steps/s  run p50 {} p99 {}",
        args.batch_runs,
        args.batch_steps,
        n,
        ms(steps.value_at_quantile(0.5)),
        ms(steps.value_at_quantile(0.99)),
        n as f64 / wall.as_secs_f64(),
        ms(runs.value_at_quantile(0.5)),
        ms(runs.value_at_quantile(0.99)),
    );
    Ok(())
}

async fn dev_shape(args: &BenchArgs) -> anyhow::Result<()> {
    let dir = tempfile_dir("warden-bench-dev")?;
    let listener = warden_grpc::bind("127.0.0.1:0").await?;
    let endpoint = warden_grpc::endpoint_of(listener.local_addr()?);
    let mut base = WardenConfig::default();
    base.planner.max_steps = args.steps.max(args.batch_steps);
    let config = crate::dev::dev_config(base, &dir, &endpoint);
    let mesh = crate::dev::start(config, listener).await?;
    let ep = Endpoints { runs: endpoint.clone(), ledger: endpoint };
    let r = measure("dev", &ep, "default", args).await;
    let _ = mesh.shutdown.send(());
    let _ = std::fs::remove_dir_all(&dir);
    r
}

async fn prod_shape(args: &BenchArgs) -> anyhow::Result<()> {
    let (pg, redis) = tokio::task::spawn_blocking(|| -> anyhow::Result<_> {
        Ok((warden_testkit::servers::start_postgres(false)?, warden_testkit::servers::start_redis()?))
    })
    .await??;
    let database_url = pg.create_database().await?;
    let mesh = warden_testkit::Mesh::start(warden_testkit::MeshOptions {
        database_url,
        redis_url: redis.url.clone(),
        tenants: vec![("default".into(), vec!["echo".into()])],
        max_steps: args.steps.max(args.batch_steps),
        lease_ttl_ms: 10_000,
        sweep_interval_ms: 2_000,
        executors: 1,
        ..Default::default()
    })
    .await?;
    let ep = Endpoints { runs: mesh.executors[0].endpoint.clone(), ledger: mesh.ledger.endpoint.clone() };
    measure("prod", &ep, "default", args).await
}

fn tempfile_dir(prefix: &str) -> anyhow::Result<std::path::PathBuf> {
    let dir = std::env::temp_dir().join(format!("{prefix}-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}

pub async fn run(args: BenchArgs) -> anyhow::Result<i32> {
    println!(
        "warden bench: build {}; step latency = executor-measured authorize+record+invoke per step",
        if cfg!(debug_assertions) { "debug (use --release for real figures)" } else { "release" }
    );
    if matches!(args.suite, Suite::Steps | Suite::All) {
        if matches!(args.shape, Shape::Dev | Shape::Both) {
            dev_shape(&args).await?;
        }
        if matches!(args.shape, Shape::Prod | Shape::Both) {
            prod_shape(&args).await?;
        }
    }
    if matches!(args.suite, Suite::Ledger | Suite::All) {
        crate::bench_ledger::run(&args.ledger).await?;
    }
    if matches!(args.suite, Suite::Policy | Suite::All) {
        crate::bench_policy::run().await?;
    }
    Ok(0)
}
