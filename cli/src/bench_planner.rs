//! `warden bench --suite planner`: goal runs planned by a local llama.cpp `llama-server`
//! (SmolLM2-135M-Instruct, installed and started like the tests' model server; or the
//! OpenAI-compatible server `--model-url` names), in the `warden dev` shape.
//!
//! - planning latency: from `run_submitted` to `plan_created` as the ledger recorded them,
//!   p50/p99, and per model call (`model_completed.latency_ms`), with tokens per call;
//! - what planning produced (a plan, or the fallback after the repair passes);
//! - the replay path: `Runs.ReplayRun` (strict) of each finished run, as the client sees it —
//!   every recorded completion served from the ledger, no model asked.

use std::time::Instant;

use hdrhistogram::Histogram;
use serde_json::Value;
use warden_config::WardenConfig;
use warden_proto::v1 as pb;

use crate::run::describe;

#[derive(clap::Args, Clone)]
pub struct PlannerBenchArgs {
    /// Goal runs planned (one after another).
    #[arg(long, default_value_t = 10)]
    pub goals: usize,
    /// An OpenAI-compatible base URL (…/v1) to plan with instead of a local llama-server.
    #[arg(long)]
    pub model_url: Option<String>,
    /// Largest answer per model call, in tokens.
    #[arg(long, default_value_t = 256)]
    pub max_tokens: u32,
}

fn hist() -> Histogram<u64> {
    Histogram::new(3).unwrap_or_else(|e| panic!("histogram: {e}"))
}

fn ms(us: u64) -> String {
    format!("{:.1}ms", us as f64 / 1000.0)
}

pub async fn run(args: &PlannerBenchArgs) -> anyhow::Result<()> {
    let (base_url, model, _server) = match &args.model_url {
        Some(url) => (url.clone(), "model".to_string(), None),
        None => {
            let s = tokio::task::spawn_blocking(warden_testkit::model::start_model_server).await??;
            (s.base_url.clone(), s.model.clone(), Some(s))
        }
    };
    let dir = std::env::temp_dir().join(format!("warden-bench-planner-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let listener = warden_grpc::bind("127.0.0.1:0").await?;
    let endpoint = warden_grpc::endpoint_of(listener.local_addr()?);
    let mut base = WardenConfig::default();
    base.planner.model.provider = "openai".into();
    base.planner.model.base_url = base_url.clone();
    base.planner.model.model = model;
    base.planner.model.max_tokens = args.max_tokens;
    base.planner.model.timeout_secs = 300;
    let config = crate::dev::dev_config(base, &dir, &endpoint);
    let mesh = crate::dev::start(config, listener).await?;
    let mut runs = crate::bench::runs_client(&endpoint)?;
    let mut ledger = crate::bench::ledger_client(&endpoint)?;
    let (mut planning, mut per_call, mut replays) = (hist(), hist(), hist());
    let (mut input_tokens, mut output_tokens, mut calls) = (0u64, 0u64, 0u64);
    let mut sources: std::collections::BTreeMap<String, usize> = Default::default();
    let goals = ["Echo the word hello.", "Store the value 42 under the key answer.", "Upper-case the text warden."];
    for i in 0..args.goals {
        let run_id = runs
            .submit_run(pb::SubmitRunRequest {
                tenant: "default".into(),
                goal: goals[i % goals.len()].into(),
                ..Default::default()
            })
            .await
            .map_err(|s| anyhow::anyhow!("submit refused: {}", describe(&s)))?
            .into_inner()
            .run_id;
        runs.wait_run(pb::WaitRunRequest { tenant: "default".into(), run_id: run_id.clone(), timeout_ms: 600_000 })
            .await?;
        let mut stream = ledger
            .stream_events(pb::StreamEventsRequest {
                tenant: "default".into(),
                run_id: run_id.clone(),
                since_seq: 0,
                follow: false,
            })
            .await?
            .into_inner();
        let (mut submitted, mut created) = (None, None);
        while let Some(e) = stream.message().await? {
            let p: Value = serde_json::from_str(&e.payload_json).unwrap_or_default();
            match e.event_type.as_str() {
                "run_submitted" => submitted = Some(e.timestamp_ms),
                "plan_created" => {
                    created = Some(e.timestamp_ms);
                    *sources.entry(p["source"].as_str().unwrap_or("?").to_string()).or_default() += 1;
                }
                "model_completed" => {
                    calls += 1;
                    input_tokens += p["usage"]["input_tokens"].as_u64().unwrap_or_default();
                    output_tokens += p["usage"]["output_tokens"].as_u64().unwrap_or_default();
                    per_call.record(p["latency_ms"].as_u64().unwrap_or_default() * 1000)?;
                }
                _ => {}
            }
        }
        if let (Some(s), Some(c)) = (submitted, created) {
            planning.record(((c - s).max(0) as u64) * 1000)?;
        }
        let started = Instant::now();
        runs.replay_run(pb::ReplayRunRequest { tenant: "default".into(), run_id, policy: 1 })
            .await
            .map_err(|s| anyhow::anyhow!("replay refused: {}", describe(&s)))?;
        replays.record(started.elapsed().as_micros() as u64)?;
    }
    let q = |h: &Histogram<u64>, p: f64| ms(h.value_at_quantile(p));
    println!("planner (dev shape, {base_url}, {} goal runs, max_tokens {}):", args.goals, args.max_tokens);
    println!("  planning (submit -> plan_created): p50 {} p99 {}", q(&planning, 0.5), q(&planning, 0.99));
    println!(
        "  per model call: p50 {} p99 {}; {} calls, {:.0} input and {:.0} output tokens per call",
        q(&per_call, 0.5),
        q(&per_call, 0.99),
        calls,
        input_tokens as f64 / calls.max(1) as f64,
        output_tokens as f64 / calls.max(1) as f64
    );
    println!("  plans by source: {sources:?}");
    println!("  replay (ReplayRun strict, recorded completions): p50 {} p99 {}", q(&replays, 0.5), q(&replays, 0.99));
    let _ = mesh.shutdown.send(());
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
