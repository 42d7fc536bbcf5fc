//! `warden bench`: a 100-step sequential plan of no-op (`echo`) calls and a batch of
//! concurrent runs, in the `warden dev` shape (one process, SQLite, in-process leases) and
//! in the production shape (separate processes, PostgreSQL with durable commits, Redis).
//!
//! Everything is measured the way a client sees it: from `SubmitRun` to `WaitRun` answering
//! the terminal status. The chain's figure is that wall time divided by its steps; the batch's
//! is steps over the wall time of all runs; a run's fixed cost is the wall time of one-step
//! runs. Each workload is run a second time with every run followed on the ledger
//! (`StreamEvents`), for per-step p50 and p99 as a follower sees them (see [`followed_run`]);
//! the headline figures are taken without followers. The production shape also reports CPU
//! per step per process (from /proc) and, from PostgreSQL's `pg_stat_statements`, commits and
//! SQL statements per step (`WARDEN_BENCH_SQL=1` lists the most called statements).

use std::time::{Duration, Instant};

use anyhow::Context;
use hdrhistogram::Histogram;
use serde_json::{Value, json};
use warden_config::WardenConfig;
use warden_proto::v1 as pb;
use warden_proto::v1::ledger_client::LedgerClient;
use warden_proto::v1::runs_client::RunsClient;

use crate::run::describe;

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
    /// How long a run waits after its executor is killed (SIGKILL) until another replica
    /// drives it (production shape, two executors, default lease and liveness settings).
    Takeover,
    /// A run's fixed cost as the issue of the write path defines it, submit -> first tool
    /// call, read from the runs' traces (production shape, tracing on, an OTLP receiver in
    /// this process): the client cannot see when the tool host is called.
    FirstCall,
    /// Goal runs planned by a local llama.cpp server, and their replay (not part of `all`:
    /// it installs and compiles llama.cpp the first time).
    Planner,
    All,
}

#[derive(clap::Args)]
pub struct BenchArgs {
    /// What to measure.
    #[arg(long, value_enum, default_value = "all")]
    suite: Suite,
    #[command(flatten)]
    ledger: crate::bench_ledger::LedgerBenchArgs,
    #[command(flatten)]
    planner: crate::bench_planner::PlannerBenchArgs,
    /// Which deployment shape to measure.
    #[arg(long, value_enum, default_value = "both")]
    shape: Shape,
    /// Steps in the sequential plan.
    #[arg(long, default_value_t = 100, value_parser = clap::builder::TypedValueParser::map(clap::value_parser!(u16).range(1..), usize::from))]
    steps: usize,
    /// How many times the sequential plan runs (one after another).
    #[arg(long, default_value_t = 3)]
    sequential_runs: usize,
    /// Runs submitted at once in the concurrent batch.
    #[arg(long, default_value_t = 200)]
    batch_runs: usize,
    /// One-step runs measured one after another (a run's fixed cost).
    #[arg(long, default_value_t = 50)]
    fixed_runs: usize,
    /// Executor kills measured by the takeover suite.
    #[arg(long, default_value_t = 10)]
    takeovers: usize,
    /// Sequential steps in each run of the batch.
    #[arg(long, default_value_t = 10, value_parser = clap::builder::TypedValueParser::map(clap::value_parser!(u16).range(1..), usize::from))]
    batch_steps: usize,
    /// Tokio worker threads of each production-shape service. Default: the machine's cores
    /// shared among the five services (at least one each), as CPU limits would share a node
    /// among their pods; `TOKIO_WORKER_THREADS`, when set, wins.
    #[arg(long)]
    workers_per_service: Option<usize>,
    /// How the production shape's services reach each other: loopback TCP, or Unix domain
    /// sockets (`listen_unix`), as services sharing a node can. The bench's own client always
    /// uses TCP.
    #[arg(long, value_enum, default_value = "tcp")]
    transport: Transport,
    /// Connect anew for every run, as if each came from a client of its own. By default the
    /// runs share one channel (one HTTP/2 connection), as a gRPC client process's calls do.
    #[arg(long)]
    connect_per_run: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum Transport {
    Tcp,
    Unix,
}

/// Services of the production shape that share the machine's cores (ledger, policy,
/// planner, executor, tool host).
const PROD_SERVICES: usize = 5;

/// Worker threads per production-shape service: `TOKIO_WORKER_THREADS`, else the flag, else
/// the machine's cores over [`PROD_SERVICES`] (at least one).
fn workers_per_service(flag: Option<usize>) -> usize {
    let env = std::env::var("TOKIO_WORKER_THREADS").ok().and_then(|v| v.parse::<usize>().ok()).filter(|n| *n > 0);
    let cores = std::thread::available_parallelism().map(usize::from).unwrap_or(1);
    env.or(flag.filter(|n| *n > 0)).unwrap_or(cores / PROD_SERVICES).max(1)
}

#[derive(Clone)]
struct Endpoints {
    runs: String,
    /// The ledger, whose `StreamEvents` the followed passes read (see [`followed_run`]).
    ledger: String,
    /// The channels every run shares, unless each run connects anew (`--connect-per-run`).
    shared: Option<(RunsClient<warden_grpc::auth::Ch>, LedgerClient<warden_grpc::auth::Ch>)>,
}

impl Endpoints {
    fn new(runs: String, ledger: String, args: &BenchArgs) -> anyhow::Result<Endpoints> {
        let shared = if args.connect_per_run { None } else { Some((runs_client(&runs)?, ledger_client(&ledger)?)) };
        Ok(Endpoints { runs, ledger, shared })
    }

    /// The client a run's events are followed through.
    fn ledger(&self) -> anyhow::Result<LedgerClient<warden_grpc::auth::Ch>> {
        match &self.shared {
            Some((_, c)) => Ok(c.clone()),
            None => ledger_client(&self.ledger),
        }
    }

    /// The client a run is submitted and waited for through.
    fn runs(&self) -> anyhow::Result<RunsClient<warden_grpc::auth::Ch>> {
        match &self.shared {
            Some((c, _)) => Ok(c.clone()),
            None => runs_client(&self.runs),
        }
    }
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

/// A client as an outside one sees the mesh: over the network even when the dev mesh is
/// served by this process (its own services call each other in memory).
pub(crate) fn runs_client(endpoint: &str) -> anyhow::Result<RunsClient<warden_grpc::auth::Ch>> {
    Ok(RunsClient::new(warden_grpc::network_channel(endpoint)?))
}

/// [`runs_client`]'s ledger.
pub(crate) fn ledger_client(endpoint: &str) -> anyhow::Result<LedgerClient<warden_grpc::auth::Ch>> {
    Ok(LedgerClient::new(warden_grpc::network_channel(endpoint)?)
        .max_decoding_message_size(warden_grpc::MAX_MESSAGE_BYTES))
}

/// Submits one plan and waits for its end the way a client does (`Runs.WaitRun`): the wall
/// time is submit → terminal status as the client sees it.
async fn one_run(ep: &Endpoints, tenant: &str, plan: &str) -> anyhow::Result<Duration> {
    let started = Instant::now();
    let (mut runs, run_id) = submit(ep, tenant, plan).await?;
    completed(&mut runs, tenant, &run_id).await?;
    Ok(started.elapsed())
}

/// Submits one plan; returns the client it went through and the run's id.
async fn submit(
    ep: &Endpoints,
    tenant: &str,
    plan: &str,
) -> anyhow::Result<(RunsClient<warden_grpc::auth::Ch>, String)> {
    let mut runs = ep.runs()?;
    let run_id = runs
        .submit_run(pb::SubmitRunRequest { tenant: tenant.into(), plan_json: plan.into(), ..Default::default() })
        .await
        .map_err(|s| anyhow::anyhow!("submit refused: {}", describe(&s)))?
        .into_inner()
        .run_id;
    Ok((runs, run_id))
}

/// Waits for the run's end (`Runs.WaitRun`), which must be `completed`.
async fn completed(runs: &mut RunsClient<warden_grpc::auth::Ch>, tenant: &str, run_id: &str) -> anyhow::Result<()> {
    let run = runs
        .wait_run(pb::WaitRunRequest { tenant: tenant.into(), run_id: run_id.into(), timeout_ms: 600_000 })
        .await?
        .into_inner();
    anyhow::ensure!(run.status() == pb::RunStatus::Completed, "run {run_id} ended {:?}: {}", run.status(), run.reason);
    Ok(())
}

/// Requests a follower may receive while it catches up rather than as they are committed:
/// the first is recorded with the run itself, before `SubmitRun` answers, and the second may
/// be committed before the follower's subscription is in place. Intervals that start at one of
/// them are left out of [`followed_run`]'s.
const CAUGHT_UP_REQUESTS: usize = 2;

/// Runs one plan as [`one_run`] does while following its events on the ledger
/// (`StreamEvents`), and returns each step's wall time as a follower sees it: the interval
/// between the arrivals of consecutive `tool_requested` events. A step's request is published
/// to followers as it commits, so one interval is one step of the chain: the previous call,
/// the next decision, and the commit of its outcome with the next request. Intervals starting
/// at one of the first [`CAUGHT_UP_REQUESTS`] requests are left out.
async fn followed_run(ep: &Endpoints, tenant: &str, plan: &str) -> anyhow::Result<Vec<Duration>> {
    let (mut runs, run_id) = submit(ep, tenant, plan).await?;
    let follow = pb::StreamEventsRequest { tenant: tenant.into(), run_id: run_id.clone(), since_seq: 0, follow: true };
    let mut stream = ep.ledger()?.stream_events(follow).await?.into_inner();
    let mut arrivals = Vec::new();
    let followed = async {
        while let Some(e) = stream.message().await? {
            if e.event_type == warden_core::events::TOOL_REQUESTED {
                arrivals.push(Instant::now());
            }
            if warden_core::events::status_after(&e.event_type).is_some_and(|s| s.is_terminal()) {
                return Ok(());
            }
        }
        anyhow::bail!("the events of run {run_id} ended before the run did")
    };
    tokio::time::timeout(Duration::from_secs(600), followed).await.context("following a run")??;
    completed(&mut runs, tenant, &run_id).await?;
    Ok(arrivals.windows(2).skip(CAUGHT_UP_REQUESTS).map(|w| w[1] - w[0]).collect())
}

/// Adds a followed run's step times (see [`followed_run`]) to `h`, in microseconds.
fn record_steps(h: &mut Histogram<u64>, steps: Vec<Duration>) -> anyhow::Result<()> {
    for d in steps {
        h.record((d.as_micros() as u64).max(1))?;
    }
    Ok(())
}

/// Per-step p50 and p99 of followed runs (see [`followed_run`]), or why there are none.
fn followed_steps(h: &Histogram<u64>, runs: usize) -> String {
    if h.is_empty() {
        return format!("per step: none measured (runs of more than {} steps have some)", CAUGHT_UP_REQUESTS + 1);
    }
    format!(
        "per step, {runs} runs followed apart from the figure above: p50 {}  p99 {}  ({} steps)",
        ms(h.value_at_quantile(0.5)),
        ms(h.value_at_quantile(0.99)),
        h.len()
    )
}

fn hist() -> Histogram<u64> {
    Histogram::new(3).unwrap_or_else(|e| panic!("histogram: {e}"))
}

fn ms(us: u64) -> String {
    format!("{:.2}ms", us as f64 / 1000.0)
}

/// CPU time (user + system) of each process, in clock ticks, from /proc.
fn cpu_ticks(pids: &[u32]) -> std::collections::HashMap<u32, u64> {
    pids.iter()
        .filter_map(|pid| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
            // Fields after the parenthesised command name: state is field 3, utime 14, stime 15.
            let rest = stat.rsplit_once(')')?.1;
            let f: Vec<&str> = rest.split_whitespace().collect();
            Some((*pid, f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?))
        })
        .collect()
}

/// The children of `parent` (PostgreSQL's backends under its postmaster).
fn children(parent: u32) -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else { return Vec::new() };
    dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .ok()
                .and_then(|s| s.rsplit_once(')').and_then(|(_, r)| r.split_whitespace().nth(1)?.parse::<u32>().ok()))
                == Some(parent)
        })
        .collect()
}

/// What the production shape can count besides wall time: CPU per process and, from
/// PostgreSQL, commits and statements.
struct Counters {
    processes: Vec<(String, Vec<u32>)>,
    /// PostgreSQL's postmaster: its backends (found at each snapshot) and itself.
    postmaster: Option<u32>,
    db: Option<String>,
}

struct Snapshot {
    cpu: Vec<std::collections::HashMap<u32, u64>>,
    commits: i64,
    statements: i64,
    /// Bytes of WAL written so far (`pg_current_wal_lsn`, exact at any moment).
    wal_bytes: i64,
    /// With `WARDEN_BENCH_SQL=1`: the most called statements (calls, text).
    top: Vec<(i64, String)>,
    /// With `WARDEN_BENCH_SQL=1`: per table, rows inserted, rows updated and updates that were
    /// HOT (no index touched), read once every backend has sent its statistics.
    tables: Vec<(String, i64, i64, i64)>,
}

impl Counters {
    fn groups(&self) -> Vec<(String, Vec<u32>)> {
        let mut groups = self.processes.clone();
        if let Some(pm) = self.postmaster {
            let mut pids = children(pm);
            pids.push(pm);
            groups.push(("postgres".into(), pids));
        }
        groups
    }

    /// The counters as a workload starts (`starting`) or once it ended: the processes' CPU is
    /// read nearest the workload, after the database's counters at its start and before them
    /// at its end, so that the wait for the database's statistics is not counted.
    async fn snapshot(&self, starting: bool) -> Snapshot {
        let cpu_now = || -> Vec<_> { self.groups().iter().map(|(_, pids)| cpu_ticks(pids)).collect() };
        let mut cpu = if starting { Vec::new() } else { cpu_now() };
        let (mut commits, mut statements, mut wal_bytes, mut top, mut tables) = (0, 0, 0, Vec::new(), Vec::new());
        if let Some(url) = &self.db
            && let Ok(mut c) = <sqlx::PgConnection as sqlx::Connection>::connect(url).await
        {
            // Transactions (pg_stat_database's counters are flushed too lazily to read between
            // workloads): the services commit through BEGIN … COMMIT, and the ledger's batch
            // write of runs it holds in memory is one statement committed on its own (one
            // form for several runs' heads, another for one run's).
            commits = sqlx::query_scalar::<_, i64>(
                "SELECT COALESCE(sum(calls), 0)::bigint FROM pg_stat_statements
                 WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
                   AND (query ILIKE 'COMMIT%' OR query ILIKE 'WITH h %' OR query ILIKE 'WITH u AS (UPDATE runs %')",
            )
            .fetch_one(&mut c)
            .await
            .unwrap_or_default();
            statements = sqlx::query_scalar::<_, i64>(
                "SELECT COALESCE(sum(calls), 0)::bigint FROM pg_stat_statements
                 WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())",
            )
            .fetch_one(&mut c)
            .await
            .unwrap_or_default();
            wal_bytes = sqlx::query_scalar::<_, i64>("SELECT (pg_current_wal_lsn() - '0/0'::pg_lsn)::bigint")
                .fetch_one(&mut c)
                .await
                .unwrap_or_default();
            if std::env::var("WARDEN_BENCH_SQL").is_ok() {
                // A backend sends its table statistics at most once a second, and one gone idle
                // only 10 s after its last transaction (PostgreSQL 15's PGSTAT_IDLE_INTERVAL).
                tokio::time::sleep(std::time::Duration::from_secs(11)).await;
                tables = sqlx::query_as::<_, (String, i64, i64, i64)>(
                    "SELECT relname::text, n_tup_ins, n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables
                     WHERE n_tup_ins + n_tup_upd > 0 ORDER BY relname",
                )
                .fetch_all(&mut c)
                .await
                .unwrap_or_default();
                top = sqlx::query_as::<_, (i64, String)>(
                    "SELECT calls, left(regexp_replace(query, '\\s+', ' ', 'g'), 110) FROM pg_stat_statements
                     WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
                     ORDER BY calls DESC LIMIT 12",
                )
                .fetch_all(&mut c)
                .await
                .unwrap_or_default();
            }
        }
        if starting {
            cpu = cpu_now();
        }
        Snapshot { cpu, commits, statements, wal_bytes, top, tables }
    }

    /// One line per workload: per step, what each process spent and what the database did.
    fn report(&self, before: &Snapshot, after: &Snapshot, steps: u64) -> String {
        let tick_ms = 1000.0 / 100.0; // USER_HZ is 100 on Linux
        // A process seen only after (a backend opened meanwhile) counts from zero.
        let spent = |b: &std::collections::HashMap<u32, u64>, a: &std::collections::HashMap<u32, u64>| -> u64 {
            a.iter().map(|(pid, t)| t.saturating_sub(b.get(pid).copied().unwrap_or(0))).sum()
        };
        let names: Vec<String> = self.groups().into_iter().map(|(n, _)| n).collect();
        let mut total = 0;
        let mut parts: Vec<String> = names
            .iter()
            .zip(before.cpu.iter().zip(&after.cpu))
            .map(|(name, (b, a))| {
                let t = spent(b, a);
                total += t;
                format!("{name} {:.2}", t as f64 * tick_ms / steps as f64)
            })
            .collect();
        parts.push(format!("total {:.2}", total as f64 * tick_ms / steps as f64));
        let mut line = format!("cpu ms/step: {}", parts.join(", "));
        for (calls, query) in &after.top {
            let before = before.top.iter().find(|(_, q)| q == query).map(|(c, _)| *c).unwrap_or(0);
            line.push_str(&format!("\n        {:>6.2}/step  {}", (calls - before) as f64 / steps as f64, query));
        }
        for (table, ins, upd, hot) in &after.tables {
            let (b_ins, b_upd, b_hot) =
                before.tables.iter().find(|(t, ..)| t == table).map(|(_, i, u, h)| (*i, *u, *h)).unwrap_or_default();
            let per = |n: i64| n as f64 / steps as f64;
            line.push_str(&format!(
                "\n        table {table}: inserts/step {:.2}, updates/step {:.2} (HOT {:.2})",
                per(ins - b_ins),
                per(upd - b_upd),
                per(hot - b_hot)
            ));
        }
        if self.db.is_some() {
            line.push_str(&format!(
                "; commits/step {:.2}, SQL statements/step {:.1}, WAL kB/step {:.1}",
                (after.commits - before.commits) as f64 / steps as f64,
                (after.statements - before.statements) as f64 / steps as f64,
                (after.wal_bytes - before.wal_bytes) as f64 / 1024.0 / steps as f64
            ));
        }
        line
    }
}

/// What every workload is measured on: the shape's name, its endpoints, the tenant, the
/// bench's arguments and the CPU and statement counters.
#[derive(Clone, Copy)]
struct Workload<'a> {
    shape: &'a str,
    ep: &'a Endpoints,
    tenant: &'a str,
    args: &'a BenchArgs,
    counters: &'a Counters,
}

async fn measure(
    shape: &str,
    ep: &Endpoints,
    tenant: &str,
    args: &BenchArgs,
    counters: &Counters,
) -> anyhow::Result<()> {
    // Warm-up: connections, catalog caches, SQLite/PostgreSQL page caches.
    for _ in 0..3 {
        one_run(ep, tenant, &chain(5)).await.context("warm-up run")?;
    }

    // A run's fixed cost: one-step runs, one after another. A workload asked to run no
    // times is left out (no figure from nothing).
    if args.fixed_runs > 0 {
        let mut fixed = hist();
        for _ in 0..args.fixed_runs {
            fixed.record(one_run(ep, tenant, &chain(1)).await?.as_micros() as u64)?;
        }
        println!(
            "{shape:<5} one-step run (submit -> completed, {} runs): p50 {}  p99 {}",
            args.fixed_runs,
            ms(fixed.value_at_quantile(0.5)),
            ms(fixed.value_at_quantile(0.99))
        );
    }
    let on = Workload { shape, ep, tenant, args, counters };
    if args.sequential_runs > 0 {
        chain_workload(on).await?;
    }
    if args.batch_runs > 0 {
        batch_workload(on).await?;
    }
    Ok(())
}

/// The sequential chain, then the same chain followed, step by step.
async fn chain_workload(on: Workload<'_>) -> anyhow::Result<()> {
    let Workload { shape, ep, tenant, args, counters } = on;
    let plan = chain(args.steps);
    let mut per_step = hist();
    let before = counters.snapshot(true).await;
    for _ in 0..args.sequential_runs {
        let wall = one_run(ep, tenant, &plan).await?;
        per_step.record((wall.as_micros() as u64 / args.steps as u64).max(1))?;
    }
    let after = counters.snapshot(false).await;
    println!(
        "{shape:<5} {}-step chain x{}: {} per step end to end (min {}, max {})",
        args.steps,
        args.sequential_runs,
        ms(per_step.value_at_quantile(0.5)),
        ms(per_step.min()),
        ms(per_step.max()),
    );
    println!("{shape:<5}   {}", counters.report(&before, &after, (args.steps * args.sequential_runs) as u64));
    // Per step, from runs of their own, so following them costs the figure above nothing.
    let mut steps = hist();
    for _ in 0..args.sequential_runs {
        record_steps(&mut steps, followed_run(ep, tenant, &plan).await?)?;
    }
    println!("{shape:<5}   {}", followed_steps(&steps, args.sequential_runs));
    Ok(())
}

/// The concurrent batch, then the same batch with every run followed.
async fn batch_workload(on: Workload<'_>) -> anyhow::Result<()> {
    let Workload { shape, ep, tenant, args, counters } = on;
    let plan = chain(args.batch_steps);
    let before = counters.snapshot(true).await;
    let started = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..args.batch_runs {
        let (ep, plan, tenant) = (ep.clone(), plan.clone(), tenant.to_string());
        tasks.push(tokio::spawn(async move { one_run(&ep, &tenant, &plan).await }));
    }
    let mut runs = hist();
    for t in tasks {
        runs.record(t.await??.as_micros() as u64)?;
    }
    let wall = started.elapsed();
    let after = counters.snapshot(false).await;
    let n = (args.batch_runs * args.batch_steps) as u64;
    println!(
        "{shape:<5} {} runs x {} steps at once: {:.0} steps/s  (run p50 {}, p99 {})",
        args.batch_runs,
        args.batch_steps,
        n as f64 / wall.as_secs_f64(),
        ms(runs.value_at_quantile(0.5)),
        ms(runs.value_at_quantile(0.99)),
    );
    println!("{shape:<5}   {}", counters.report(&before, &after, n));
    // Per step, from a batch of its own, each run followed.
    let mut tasks = Vec::new();
    for _ in 0..args.batch_runs {
        let (ep, plan, tenant) = (ep.clone(), plan.clone(), tenant.to_string());
        tasks.push(tokio::spawn(async move { followed_run(&ep, &tenant, &plan).await }));
    }
    let mut steps = hist();
    for t in tasks {
        record_steps(&mut steps, t.await??)?;
    }
    println!("{shape:<5}   {}", followed_steps(&steps, args.batch_runs));
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
    let ep = Endpoints::new(endpoint.clone(), endpoint, args)?;
    let counters =
        Counters { processes: vec![("warden-dev".into(), vec![std::process::id()])], postmaster: None, db: None };
    let r = measure("dev", &ep, "default", args, &counters).await;
    let _ = mesh.shutdown.send(());
    let _ = std::fs::remove_dir_all(&dir);
    r
}

/// The production shape: PostgreSQL, Redis and the services as separate processes, one
/// executor, `workers` Tokio worker threads each, `env` added to theirs.
struct ProdShape {
    pg: warden_testkit::Postgres,
    // Kept for the mesh's life.
    _redis: warden_testkit::Redis,
    mesh: warden_testkit::Mesh,
}

async fn start_prod(args: &BenchArgs, workers: usize, env: Vec<(String, String)>) -> anyhow::Result<ProdShape> {
    let (pg, redis) = tokio::task::spawn_blocking(|| -> anyhow::Result<_> {
        Ok((warden_testkit::servers::start_postgres(false)?, warden_testkit::servers::start_redis()?))
    })
    .await??;
    let database_url = pg.create_database().await?;
    let mut env = env;
    env.push(("TOKIO_WORKER_THREADS".into(), workers.to_string()));
    let mesh = warden_testkit::Mesh::start(warden_testkit::MeshOptions {
        database_url,
        redis_url: redis.url.clone(),
        tenants: vec![("default".into(), vec!["echo".into()])],
        max_steps: args.steps.max(args.batch_steps),
        lease_ttl_ms: 10_000,
        sweep_interval_ms: 2_000,
        executors: 1,
        env,
        unix_sockets: args.transport == Transport::Unix,
        ..Default::default()
    })
    .await?;
    Ok(ProdShape { pg, _redis: redis, mesh })
}

async fn prod_shape(args: &BenchArgs) -> anyhow::Result<()> {
    let workers = workers_per_service(args.workers_per_service);
    println!(
        "prod  {PROD_SERVICES} services, {workers} Tokio worker thread(s) each, calling each other over {}, {}",
        match args.transport {
            Transport::Tcp => "loopback TCP",
            Transport::Unix => "Unix domain sockets",
        },
        // The services inherit the bench's environment, `WARDEN_MULTIPLEX` included.
        match (warden_grpc::mux::carrier(), args.transport) {
            (Some(warden_grpc::mux::Carrier::Frames), Transport::Tcp) =>
                "unary calls in frames on a connection of their own",
            (Some(_), _) => "unary calls on one HTTP/2 stream per connection",
            (None, _) => "a stream per call (WARDEN_MULTIPLEX=off)",
        }
    );
    let ProdShape { pg, _redis, mesh } = start_prod(args, workers, Vec::new()).await?;
    let ep = Endpoints::new(mesh.executors[0].endpoint.clone(), mesh.ledger.endpoint.clone(), args)?;
    let pid = |p: &warden_testkit::ServiceProcess| p.pid().into_iter().collect::<Vec<u32>>();
    let mut processes = vec![
        ("ledger".to_string(), pid(&mesh.ledger)),
        ("policy".to_string(), pid(&mesh.policy)),
        ("executor".to_string(), pid(&mesh.executors[0])),
        ("tools".to_string(), pid(&mesh.tools)),
        // A submission's plan is checked by the planner, and its lease taken in Redis.
        ("planner".to_string(), pid(&mesh.planner)),
        ("redis".to_string(), _redis.pid().into_iter().collect()),
    ];
    processes.push(("client".to_string(), vec![std::process::id()]));
    let db = mesh.database_url.clone();
    if let Ok(mut c) = <sqlx::PgConnection as sqlx::Connection>::connect(&db).await {
        let _ = sqlx::query("CREATE EXTENSION IF NOT EXISTS pg_stat_statements").execute(&mut c).await;
    }
    let counters = Counters { processes, postmaster: pg.pid(), db: Some(db) };
    measure("prod", &ep, "default", args, &counters).await
}

/// Span names of the first-call timeline (server spans, as the services name them).
const SUBMIT_SPAN: &str = "/warden.v1.Runs/SubmitRun";
const INVOKE_SPAN: &str = "/warden.v1.ToolHost/Invoke";
/// OTLP `SpanKind` of a server span.
const SERVER: i32 = 2;

/// Submit -> first tool call of `n` one-step runs, one after another, from their traces: from
/// the start of the executor's `SubmitRun` span to the start of the tool host's `Invoke` span
/// (one trace per run). Every service traces (sampling 1.0, a 100 ms export delay), which
/// adds to every hop: compare these figures with each other, not with untraced ones.
async fn first_call(args: &BenchArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.fixed_runs > 0, "--fixed-runs must be at least 1 for the first-call suite");
    let receiver = warden_testkit::otlp::OtlpReceiver::start().await?;
    let workers = workers_per_service(args.workers_per_service);
    let env = [
        // The traces-only variables win over the general ones: set both, so a shell's own
        // settings cannot send the spans elsewhere.
        ("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.grpc_endpoint.clone()),
        ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc".to_string()),
        ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", receiver.grpc_endpoint.clone()),
        ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc".to_string()),
        ("OTEL_TRACES_SAMPLER", "parentbased_traceidratio".to_string()),
        ("OTEL_TRACES_SAMPLER_ARG", "1.0".to_string()),
        ("OTEL_BSP_SCHEDULE_DELAY", "100".to_string()),
    ];
    let env = env.iter().map(|(k, v)| (k.to_string(), v.clone())).collect();
    let prod = start_prod(args, workers, env).await?;
    let mesh = &prod.mesh;
    let ep = Endpoints::new(mesh.executors[0].endpoint.clone(), mesh.ledger.endpoint.clone(), args)?;
    for _ in 0..3 {
        one_run(&ep, "default", &chain(1)).await.context("warm-up run")?;
    }
    let since = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?.as_nanos() as u64;
    for _ in 0..args.fixed_runs {
        one_run(&ep, "default", &chain(1)).await?;
    }
    // Spans are exported in batches, each service on its own schedule: wait (bounded) until
    // every measured run's trace is in and has every call any of them has.
    let complete = |spans: &[warden_testkit::otlp::ReceivedSpan]| {
        let timelines = first_calls(spans, since);
        // A trace's calls are distinct names: as many as all traces' together means all of them.
        let calls: std::collections::HashSet<&str> =
            timelines.iter().flat_map(|t| t.stages.iter().map(|(name, _, _)| name.as_str())).collect();
        timelines.len() >= args.fixed_runs && timelines.iter().all(|t| t.stages.len() == calls.len())
    };
    let spans = receiver.wait_for(Duration::from_secs(20), complete).await;
    let timelines = first_calls(&spans, since);
    anyhow::ensure!(!timelines.is_empty(), "no trace of a run reached the receiver");
    let mut total = hist();
    for t in &timelines {
        total.record(t.first_call_us.max(1))?;
    }
    println!(
        "prod  first tool call (submit -> tool host Invoke, traced, {} of {} runs, {workers} worker(s) per service): p50 {}  p99 {}",
        timelines.len(),
        args.fixed_runs,
        ms(total.value_at_quantile(0.5)),
        ms(total.value_at_quantile(0.99)),
    );
    // Where it goes: the median start of each server span before the call, from SubmitRun,
    // and the median time the server took to answer it.
    let mut starts: std::collections::HashMap<&str, (Vec<u64>, Vec<u64>)> = Default::default();
    for t in &timelines {
        for (name, at, took) in &t.stages {
            let (ats, tooks) = starts.entry(name.as_str()).or_default();
            ats.push(*at);
            tooks.push(*took);
        }
    }
    let median = |mut v: Vec<u64>| {
        v.sort_unstable();
        v[v.len() / 2]
    };
    // Spans in at least half of the traces, by their median start.
    let mut stages: Vec<(u64, u64, &str)> = starts
        .into_iter()
        .filter(|(_, (at, _))| at.len() * 2 >= timelines.len())
        .map(|(name, (at, took))| (median(at), median(took), name))
        .collect();
    stages.sort_unstable();
    let line: Vec<String> = stages.iter().map(|(at, _, name)| format!("{name} {}", ms(*at))).collect();
    println!("prod    median start from SubmitRun: {}", line.join(", "));
    let line: Vec<String> = stages.iter().map(|(_, took, name)| format!("{name} {}", ms(*took))).collect();
    println!("prod    median time to answer (server side): {}", line.join(", "));
    Ok(())
}

/// One run's trace, read for its first tool call.
struct FirstCall {
    first_call_us: u64,
    /// Server spans that started before the call: (name, µs after SubmitRun started, µs the
    /// server took to answer).
    stages: Vec<(String, u64, u64)>,
}

/// The traces rooted in a `SubmitRun` that started after `since` (Unix ns) and reached a tool
/// host's `Invoke`.
fn first_calls(spans: &[warden_testkit::otlp::ReceivedSpan], since: u64) -> Vec<FirstCall> {
    let mut traces: std::collections::HashMap<&str, Vec<&warden_testkit::otlp::ReceivedSpan>> = Default::default();
    for s in spans {
        traces.entry(s.trace_id.as_str()).or_default().push(s);
    }
    let mut out = Vec::new();
    for spans in traces.values() {
        let server = |name: &'static str| spans.iter().filter(move |s| s.kind == SERVER && s.name == name);
        let (Some(submit), Some(invoke)) =
            (server(SUBMIT_SPAN).next(), server(INVOKE_SPAN).map(|s| s.start_unix_nano).min())
        else {
            continue;
        };
        if submit.start_unix_nano < since || invoke < submit.start_unix_nano {
            continue;
        }
        let t0 = submit.start_unix_nano;
        // Each call's first occurrence in the trace, so a median counts each run once.
        let mut stages: Vec<(String, u64, u64)> = Vec::new();
        let mut before: Vec<_> = spans
            .iter()
            .filter(|s| s.kind == SERVER && s.start_unix_nano >= t0 && s.start_unix_nano <= invoke)
            .collect();
        before.sort_by_key(|s| s.start_unix_nano);
        for s in before {
            let name = s.name.trim_start_matches("/warden.v1.");
            if !stages.iter().any(|(n, _, _)| n == name) {
                let took = s.end_unix_nano.saturating_sub(s.start_unix_nano) / 1_000;
                stages.push((name.to_string(), (s.start_unix_nano - t0) / 1_000, took));
            }
        }
        out.push(FirstCall { first_call_us: (invoke - t0) / 1_000, stages });
    }
    out
}

/// Kills the executor driving a run mid-call, `n` times, and measures the wait until the
/// other replica's `run_started` arrives, as a client following the run sees it.
async fn takeover(n: usize) -> anyhow::Result<()> {
    let redis = tokio::task::spawn_blocking(warden_testkit::servers::start_redis).await??;
    let mut tenant_tools = vec!["echo".to_string(), "sleep".to_string()];
    tenant_tools.sort();
    let mut mesh = warden_testkit::Mesh::start(warden_testkit::MeshOptions {
        redis_url: redis.url.clone(),
        tenants: vec![("default".into(), tenant_tools)],
        executors: 2,
        // The defaults a deployment gets (the testkit shortens them for tests).
        lease_ttl_ms: warden_config::ExecutorConfig::default().lease_ttl_ms,
        sweep_interval_ms: warden_config::ExecutorConfig::default().sweep_interval_ms,
        ..Default::default()
    })
    .await?;
    let plan = json!({"steps": [
        {"id": "wait", "tool": "sleep", "params": {"ms": 5000}},
        {"id": "after", "tool": "echo", "depends_on": ["wait"]},
    ]})
    .to_string();
    let mut waits = hist();
    for i in 0..n {
        // Alternate which replica submits (and so drives), restarting the one killed before.
        let (victim, survivor) = if i % 2 == 0 { (0, 1) } else { (1, 0) };
        let runs_ep = mesh.executors[victim].endpoint.clone();
        let run_id = runs_client(&runs_ep)?
            .submit_run(pb::SubmitRunRequest {
                tenant: "default".into(),
                plan_json: plan.clone(),
                ..Default::default()
            })
            .await?
            .into_inner()
            .run_id;
        let mut stream = ledger_client(&mesh.ledger.endpoint)?
            .stream_events(pb::StreamEventsRequest {
                tenant: "default".into(),
                run_id: run_id.clone(),
                since_seq: 0,
                follow: true,
            })
            .await?
            .into_inner();
        while let Some(e) = stream.message().await? {
            if e.event_type == "tool_requested" {
                break;
            }
        }
        mesh.executors[victim].kill();
        let killed = Instant::now();
        let successor = format!("executor-{survivor}");
        while let Some(e) = stream.message().await? {
            if e.event_type == "run_started" && e.payload_json.contains(&successor) {
                break;
            }
        }
        waits.record(killed.elapsed().as_micros() as u64)?;
        mesh.executors[victim].restart()?;
    }
    println!(
        "prod  takeover after SIGKILL ({n} kills, lease 10 s, liveness 1 s, sweep 1 s): p50 {}  p99 {}  max {}",
        ms(waits.value_at_quantile(0.5)),
        ms(waits.value_at_quantile(0.99)),
        ms(waits.max())
    );
    Ok(())
}

fn tempfile_dir(prefix: &str) -> anyhow::Result<std::path::PathBuf> {
    let dir = std::env::temp_dir().join(format!("{prefix}-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}

pub async fn run(args: BenchArgs) -> anyhow::Result<i32> {
    // The dev shape's services run in this process and trace like `warden dev` does: with
    // OTEL_EXPORTER_OTLP_ENDPOINT set, the cost of tracing is in the figures (the production
    // shape's processes inherit the variables).
    let telemetry = warden_telemetry::init_tracing_with("warden-bench", &Default::default(), "warn")?;
    println!(
        "warden bench: build {}; every figure as a client sees it (SubmitRun -> WaitRun); tracing {}",
        if cfg!(debug_assertions) { "debug (use --release for real figures)" } else { "release" },
        if telemetry.exporting() { "on (OTLP export)" } else { "off" },
    );
    // What a step is made of costs this much here: entries taken on other machines compare
    // through these units.
    if matches!(args.suite, Suite::Steps | Suite::FirstCall | Suite::All) {
        println!("{}", crate::bench_machine::units());
    }
    if matches!(args.suite, Suite::Steps | Suite::All) {
        if matches!(args.shape, Shape::Dev | Shape::Both) {
            dev_shape(&args).await?;
        }
        if matches!(args.shape, Shape::Prod | Shape::Both) {
            prod_shape(&args).await?;
        }
    }
    if matches!(args.suite, Suite::FirstCall | Suite::All) {
        first_call(&args).await?;
    }
    if matches!(args.suite, Suite::Takeover | Suite::All) {
        takeover(args.takeovers).await?;
    }
    if matches!(args.suite, Suite::Ledger | Suite::All) {
        crate::bench_ledger::run(&args.ledger).await?;
    }
    if matches!(args.suite, Suite::Policy | Suite::All) {
        crate::bench_policy::run().await?;
    }
    if args.suite == Suite::Planner {
        crate::bench_planner::run(&args.planner).await?;
    }
    Ok(0)
}
