//! `warden run …`: submit, status, tail, verify-ledger.

use std::path::{Path, PathBuf};

use anyhow::Context;
use serde_json::json;
use warden_grpc::auth::Ch;
use warden_grpc::convert::status_name;
use warden_proto::v1 as pb;
use warden_proto::v1::ledger_client::LedgerClient;
use warden_proto::v1::runs_client::RunsClient;

use crate::Target;

#[derive(clap::Subcommand)]
pub enum RunCommand {
    /// Submit a plan, or a goal for the planner's model; prints the run id (with --wait, the
    /// final status).
    Submit {
        #[arg(long, required_unless_present = "goal", conflicts_with = "goal")]
        plan: Option<PathBuf>,
        /// A goal: the planner asks the configured model for a plan ([planner.model]).
        #[arg(long)]
        goal: Option<String>,
        /// How recorded model calls are replayed when the run's planning runs again.
        #[arg(long, value_enum, default_value_t = ReplayPolicyArg::Strict)]
        replay_policy: ReplayPolicyArg,
        #[arg(long)]
        wait: bool,
        /// Makes the submission idempotent: resubmitting returns the first run.
        #[arg(long)]
        idempotency_key: Option<String>,
        /// The agent (within the tenant) the run acts for: the Cedar principal.
        #[arg(long)]
        agent: Option<String>,
        /// A capability handle the run may act under (repeatable; `warden caps issue`).
        #[arg(long = "capability", value_name = "HANDLE")]
        capabilities: Vec<String>,
        /// What a cancellation lets finish: `immediate` (no tool is invoked after the request)
        /// or `after-tool-call` (steps already authorized finish).
        #[arg(long, value_enum, default_value_t = CancelPolicyArg::Immediate)]
        cancel_policy: CancelPolicyArg,
    },
    /// Re-run a finished goal run's planning against its recorded model calls: `strict`
    /// replays only an exact match, `allow-prompt-drift` replays the recorded answer and
    /// records the drift, `fork-on-drift` starts a new run that asks the model. Prints the
    /// outcome, the differences and the plan (or the fork's run id).
    Replay {
        run_id: String,
        /// Default: the policy the run was submitted with.
        #[arg(long, value_enum)]
        policy: Option<ReplayPolicyArg>,
    },
    /// Ask to cancel a run; it ends `cancelled` by its cancel policy (prints the status at the
    /// time of the request, or with --wait the final one).
    Cancel {
        run_id: String,
        #[arg(long, default_value = "")]
        reason: String,
        #[arg(long)]
        wait: bool,
    },
    /// Ask to pause a run: nothing new starts, the steps in flight settle, then it is `paused`
    /// and holds no executor (prints the status at the time of the request, or with --wait
    /// `paused` once it took effect).
    Pause {
        run_id: String,
        #[arg(long, default_value = "")]
        reason: String,
        #[arg(long)]
        wait: bool,
    },
    /// Resume a paused run: it goes on from where it stopped (with --wait, until it ends or
    /// waits for someone again).
    Resume {
        run_id: String,
        #[arg(long, default_value = "")]
        reason: String,
        #[arg(long)]
        wait: bool,
    },
    /// Record the outcome an operator established for a step whose call has none (a run in
    /// `requires_reconciliation`); the run goes on.
    Reconcile {
        run_id: String,
        step_id: String,
        /// `completed` (with --output) or `failed`.
        #[arg(long)]
        outcome: String,
        /// The call's output as JSON, for `completed`.
        #[arg(long, default_value = "")]
        output: String,
        /// Who established the outcome (recorded).
        #[arg(long)]
        operator: String,
    },
    /// The run's execution trace: JSON (steps, attempts, decisions, edges, and `dag`); with
    /// --json only its execution DAG (frames, planner attempts, steps, branches, attempts,
    /// results; seed 001); with --dot that DAG as a Graphviz graph, frames and steps as nested
    /// clusters (`warden run trace RUN --dot | dot -Tsvg > trace.svg`).
    Trace {
        run_id: String,
        #[arg(long, conflicts_with = "json")]
        dot: bool,
        #[arg(long)]
        json: bool,
    },
    /// The run's lifecycle summary and steps.
    Status {
        run_id: String,
        #[arg(long)]
        json: bool,
    },
    /// A completed step's output as JSON, whether recorded inline or stored by reference.
    Output { run_id: String, step_id: String },
    /// The run's events: `seq<TAB>timestamp<TAB>event_type<TAB>step_id`.
    Tail {
        run_id: String,
        /// Keep streaming until the run ends.
        #[arg(long)]
        follow: bool,
        #[arg(long)]
        json: bool,
    },
    /// Run ids of the tenant, one per line (newest last), optionally by status.
    List {
        /// Only runs in these statuses (pending, active, completed, failed, …).
        #[arg(long = "status")]
        statuses: Vec<String>,
        #[arg(long, default_value_t = 100)]
        limit: u32,
        #[arg(long)]
        json: bool,
    },
    /// One receipt per tool call outcome: `seq<TAB>step<TAB>attempt<TAB>status<TAB>tool<TAB>decision<TAB>receipt_id`.
    Receipts {
        run_id: String,
        #[arg(long)]
        step: Option<String>,
        #[arg(long)]
        json: bool,
    },
    /// Latest run summaries, newest first: `seq<TAB>timestamp<TAB>type<TAB>payload`.
    Summaries {
        run_id: String,
        #[arg(long = "type")]
        summary_type: Option<String>,
        #[arg(long, default_value_t = 20)]
        limit: u32,
        #[arg(long)]
        json: bool,
    },
    /// Latest artifact values by key (`key<TAB>value`), or one key's history.
    Artifacts {
        run_id: String,
        #[arg(long)]
        key: Option<String>,
        #[arg(long, requires = "key")]
        history: bool,
        #[arg(long)]
        json: bool,
    },
    /// Write the run (events, receipts, signed head) as JSON Lines to stdout, for offline verification.
    Export { run_id: String },
    /// Recompute the run's hash chain: prints `valid` (exit 0) or `invalid` with the first bad seq (exit 1).
    VerifyLedger {
        run_id: String,
        #[arg(long)]
        json: bool,
    },
}

pub async fn runs_client(endpoint: &str) -> anyhow::Result<RunsClient<Ch>> {
    Ok(RunsClient::new(warden_grpc::channel(endpoint)?))
}

pub async fn ledger_client(endpoint: &str) -> anyhow::Result<LedgerClient<Ch>> {
    Ok(LedgerClient::new(warden_grpc::channel(endpoint)?).max_decoding_message_size(warden_grpc::MAX_MESSAGE_BYTES))
}

/// Renders a gRPC error with its field violations.
pub fn describe(status: &tonic::Status) -> String {
    let mut s = format!("{:?}: {}", status.code(), status.message());
    for (field, why) in warden_grpc::field_violations(status) {
        s.push_str(&format!("\n  field {field}: {why}"));
    }
    s
}

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum CancelPolicyArg {
    Immediate,
    AfterToolCall,
}

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum ReplayPolicyArg {
    Strict,
    AllowPromptDrift,
    ForkOnDrift,
}

impl ReplayPolicyArg {
    fn proto(self) -> pb::ReplayPolicy {
        match self {
            ReplayPolicyArg::Strict => pb::ReplayPolicy::Strict,
            ReplayPolicyArg::AllowPromptDrift => pb::ReplayPolicy::AllowPromptDrift,
            ReplayPolicyArg::ForkOnDrift => pb::ReplayPolicy::ForkOnDrift,
        }
    }
}

/// What a submission carries besides its plan.
#[derive(Default)]
pub struct SubmitOptions {
    /// Submit this goal instead of the plan file.
    pub goal: Option<String>,
    pub replay_policy: Option<ReplayPolicyArg>,
    pub idempotency_key: Option<String>,
    pub agent: Option<String>,
    pub capability_handles: Vec<String>,
    pub cancel_policy: Option<CancelPolicyArg>,
}

pub async fn submit(target: &Target, plan: &Path, o: SubmitOptions) -> anyhow::Result<String> {
    let SubmitOptions { goal, replay_policy, idempotency_key, agent, capability_handles, cancel_policy } = o;
    let cancel_policy = match cancel_policy {
        Some(CancelPolicyArg::AfterToolCall) => pb::CancelPolicy::AfterToolCall,
        _ => pb::CancelPolicy::Immediate,
    };
    let plan_json = match &goal {
        Some(_) => String::new(),
        None => std::fs::read_to_string(plan).with_context(|| format!("reading {}", plan.display()))?,
    };
    let resp = runs_client(&target.endpoint)
        .await?
        .submit_run(pb::SubmitRunRequest {
            tenant: target.tenant.clone(),
            plan_json,
            goal: goal.unwrap_or_default(),
            idempotency_key: idempotency_key.unwrap_or_default(),
            cancel_policy: cancel_policy as i32,
            agent: agent.unwrap_or_default(),
            capability_handles,
            replay_policy: replay_policy.map(|p| p.proto() as i32).unwrap_or_default(),
        })
        .await
        .map_err(|s| anyhow::anyhow!("submit refused: {}", describe(&s)))?;
    Ok(resp.into_inner().run_id)
}

/// Waits until the run is terminal (or needs someone: an approval, an operator, a resume) and returns
/// it (`Runs.WaitRun`, asked again past its timeout).
pub async fn wait(target: &Target, run_id: &str) -> anyhow::Result<pb::Run> {
    let mut client = runs_client(&target.endpoint).await?;
    loop {
        let run = client
            .wait_run(pb::WaitRunRequest {
                tenant: target.tenant.clone(),
                run_id: run_id.to_string(),
                timeout_ms: 60_000,
            })
            .await
            .map_err(|s| anyhow::anyhow!("{}", describe(&s)))?
            .into_inner();
        use pb::RunStatus as S;
        if matches!(
            run.status(),
            S::Completed | S::Failed | S::Cancelled | S::EmptyPlan | S::RequiresReconciliation | S::Blocked | S::Paused
        ) {
            return Ok(run);
        }
    }
}

fn exit_code(run: &pb::Run) -> i32 {
    matches!(run.status(), pb::RunStatus::Completed | pb::RunStatus::EmptyPlan).then_some(0).unwrap_or(1)
}

fn run_json(run: &pb::Run) -> serde_json::Value {
    json!({
        "run_id": run.run_id,
        "tenant": run.tenant,
        "status": status_name(run.status),
        "reason": run.reason,
        "waiting_for": run.waiting_for,
        "direct_response": run.direct_response,
        "last_seq": run.last_seq,
        "created_at_ms": run.created_at_ms,
        "updated_at_ms": run.updated_at_ms,
        "steps": run.steps.iter().map(|s| json!({
            "id": s.id, "tool": s.tool,
            "status": pb::StepStatus::try_from(s.status).map(|x| x.as_str_name().trim_start_matches("STEP_STATUS_").to_lowercase()).unwrap_or_default(),
            "output": serde_json::from_str::<serde_json::Value>(&s.output_json).unwrap_or(serde_json::Value::Null),
            "error": s.error, "attempts": s.attempts,
        })).collect::<Vec<_>>(),
    })
}

fn print_status(run: &pb::Run) {
    println!("run      {}", run.run_id);
    println!("tenant   {}", run.tenant);
    println!("status   {}", status_name(run.status));
    if !run.reason.is_empty() {
        println!("reason   {}", run.reason);
    }
    if !run.waiting_for.is_empty() {
        println!("waiting  for {} (an outage, within the outage grace)", run.waiting_for.join(", "));
    }
    if !run.direct_response.is_empty() {
        println!("response {}", run.direct_response);
    }
    for s in run_json(run)["steps"].as_array().into_iter().flatten() {
        let detail = if s["error"].as_str().is_some_and(|e| !e.is_empty()) {
            s["error"].to_string()
        } else {
            s["output"].to_string()
        };
        println!(
            "  step {:<16} {:<12} {:<10} {}",
            s["id"].as_str().unwrap_or_default(),
            s["tool"].as_str().unwrap_or_default(),
            s["status"].as_str().unwrap_or_default(),
            detail
        );
    }
}

fn event_line(e: &pb::Event, as_json: bool) -> String {
    if as_json {
        let payload: serde_json::Value = serde_json::from_str(&e.payload_json).unwrap_or_default();
        json!({"seq": e.seq, "timestamp_ms": e.timestamp_ms, "event_type": e.event_type, "step_id": e.step_id,
               "epoch": e.epoch, "payload": payload, "hash": e.hash})
        .to_string()
    } else {
        format!("{}\t{}\t{}\t{}", e.seq, e.timestamp_ms, e.event_type, e.step_id)
    }
}

pub async fn tail(target: &Target, run_id: &str, follow: bool, as_json: bool) -> anyhow::Result<()> {
    let mut stream = ledger_client(&target.ledger_endpoint)
        .await?
        .stream_events(pb::StreamEventsRequest {
            tenant: target.tenant.clone(),
            run_id: run_id.to_string(),
            since_seq: 0,
            follow,
        })
        .await
        .map_err(|s| anyhow::anyhow!("{}", describe(&s)))?
        .into_inner();
    while let Some(e) = stream.message().await.map_err(|s| anyhow::anyhow!("{}", describe(&s)))? {
        println!("{}", event_line(&e, as_json));
    }
    Ok(())
}

pub async fn verify(target: &Target, run_id: &str, as_json: bool) -> anyhow::Result<i32> {
    let v = ledger_client(&target.ledger_endpoint)
        .await?
        .verify_run(pb::VerifyRunRequest { tenant: target.tenant.clone(), run_id: run_id.to_string() })
        .await
        .map_err(|s| anyhow::anyhow!("{}", describe(&s)))?
        .into_inner();
    if as_json {
        println!(
            "{}",
            json!({"valid": v.valid, "events": v.events, "first_bad_seq": v.first_bad_seq, "reason": v.reason, "head_hash": v.head_hash})
        );
    } else if v.valid {
        println!("valid");
    } else {
        println!("invalid: first bad seq {} ({})", v.first_bad_seq, v.reason);
    }
    Ok(if v.valid { 0 } else { 1 })
}

pub async fn run(target: &Target, cmd: RunCommand) -> anyhow::Result<i32> {
    match cmd {
        RunCommand::Submit {
            plan,
            goal,
            replay_policy,
            wait: w,
            idempotency_key,
            agent,
            capabilities,
            cancel_policy,
        } => {
            let o = SubmitOptions {
                goal,
                replay_policy: Some(replay_policy),
                idempotency_key,
                agent,
                capability_handles: capabilities,
                cancel_policy: Some(cancel_policy),
            };
            let run_id = submit(target, plan.as_deref().unwrap_or(Path::new("")), o).await?;
            println!("{run_id}");
            if w {
                let run = wait(target, &run_id).await?;
                println!("{}", status_name(run.status));
                if !run.reason.is_empty() {
                    println!("reason: {}", run.reason);
                }
                return Ok(exit_code(&run));
            }
            Ok(0)
        }
        RunCommand::Replay { run_id, policy } => {
            let r = runs_client(&target.endpoint)
                .await?
                .replay_run(pb::ReplayRunRequest {
                    tenant: target.tenant.clone(),
                    run_id,
                    policy: policy.map(|p| p.proto() as i32).unwrap_or_default(),
                })
                .await
                .map_err(|s| anyhow::anyhow!("replay refused: {}", describe(&s)))?
                .into_inner();
            println!("{}", r.outcome);
            for d in &r.differences {
                println!("difference: {d}");
            }
            if !r.forked_run_id.is_empty() {
                println!("forked: {}", r.forked_run_id);
            } else {
                println!("{}", r.plan_json);
            }
            Ok(0)
        }
        RunCommand::Cancel { run_id, reason, wait: w } => {
            let status = runs_client(&target.endpoint)
                .await?
                .cancel_run(pb::CancelRunRequest { tenant: target.tenant.clone(), run_id: run_id.clone(), reason })
                .await
                .map_err(|s| anyhow::anyhow!("cancel refused: {}", describe(&s)))?
                .into_inner()
                .status;
            if w {
                let run = wait(target, &run_id).await?;
                println!("{}", status_name(run.status));
                return Ok(exit_code(&run));
            }
            println!("{}", status_name(status));
            Ok(0)
        }
        RunCommand::Pause { run_id, reason, wait: w } => {
            let status = runs_client(&target.endpoint)
                .await?
                .pause_run(pb::PauseRunRequest { tenant: target.tenant.clone(), run_id: run_id.clone(), reason })
                .await
                .map_err(|s| anyhow::anyhow!("pause refused: {}", describe(&s)))?
                .into_inner()
                .status;
            if w {
                let run = wait(target, &run_id).await?;
                println!("{}", status_name(run.status));
                return Ok(if run.status() == pb::RunStatus::Paused { 0 } else { exit_code(&run) });
            }
            println!("{}", status_name(status));
            Ok(0)
        }
        RunCommand::Resume { run_id, reason, wait: w } => {
            let status = runs_client(&target.endpoint)
                .await?
                .resume_run(pb::ResumeRunRequest { tenant: target.tenant.clone(), run_id: run_id.clone(), reason })
                .await
                .map_err(|s| anyhow::anyhow!("resume refused: {}", describe(&s)))?
                .into_inner()
                .status;
            if w {
                let run = wait(target, &run_id).await?;
                println!("{}", status_name(run.status));
                return Ok(exit_code(&run));
            }
            println!("{}", status_name(status));
            Ok(0)
        }
        RunCommand::Reconcile { run_id, step_id, outcome, output, operator } => {
            let req = pb::ReconcileStepRequest {
                tenant: target.tenant.clone(),
                run_id,
                step_id,
                outcome,
                output_json: output,
                operator,
            };
            let run = runs_client(&target.endpoint)
                .await?
                .reconcile_step(req)
                .await
                .map_err(|s| anyhow::anyhow!("reconcile refused: {}", describe(&s)))?
                .into_inner();
            println!("{}", status_name(run.status));
            Ok(0)
        }
        RunCommand::Trace { run_id, dot, json } => {
            let trace = runs_client(&target.endpoint)
                .await?
                .get_trace(pb::GetRunRequest { tenant: target.tenant.clone(), run_id })
                .await
                .map_err(|s| anyhow::anyhow!("{}", describe(&s)))?
                .into_inner();
            let t: serde_json::Value = serde_json::from_str(&trace.trace_json)?;
            if dot {
                print!("{}", trace_dot(&t));
            } else if json {
                println!("{}", serde_json::to_string_pretty(&t["dag"])?);
            } else {
                println!("{}", serde_json::to_string_pretty(&t)?);
            }
            Ok(0)
        }
        RunCommand::Output { run_id, step_id } => {
            let out = runs_client(&target.endpoint)
                .await?
                .get_step_output(pb::GetStepOutputRequest { tenant: target.tenant.clone(), run_id, step_id })
                .await
                .map_err(|s| anyhow::anyhow!("{}", describe(&s)))?
                .into_inner();
            println!("{}", out.output_json);
            Ok(0)
        }
        RunCommand::Status { run_id, json } => {
            let run = runs_client(&target.endpoint)
                .await?
                .get_run(pb::GetRunRequest { tenant: target.tenant.clone(), run_id })
                .await
                .map_err(|s| anyhow::anyhow!("{}", describe(&s)))?
                .into_inner();
            if json {
                println!("{}", run_json(&run));
            } else {
                print_status(&run);
            }
            Ok(0)
        }
        RunCommand::Tail { run_id, follow, json } => {
            tail(target, &run_id, follow, json).await?;
            Ok(0)
        }
        RunCommand::VerifyLedger { run_id, json } => verify(target, &run_id, json).await,
        RunCommand::List { statuses, limit, json } => list(target, &statuses, limit, json).await,
        RunCommand::Receipts { run_id, step, json } => receipts(target, &run_id, step, json).await,
        RunCommand::Export { run_id } => export(target, &run_id).await,
        RunCommand::Summaries { run_id, summary_type, limit, json } => {
            summaries(target, &run_id, summary_type, limit, json).await
        }
        RunCommand::Artifacts { run_id, key, history, json } => artifacts(target, &run_id, key, history, json).await,
    }
}

/// What `make run` shows: submit, wait, events, status, verification.
pub async fn demo(target: &Target, plan: &Path) -> anyhow::Result<()> {
    let run_id = submit(target, plan, SubmitOptions::default()).await?;
    println!("\nsubmitted {} as run {run_id}", plan.display());
    let run = wait(target, &run_id).await?;
    println!("\nevents (seq, timestamp, type, step):");
    tail(target, &run_id, false, false).await?;
    println!();
    print_status(&run);
    print!("\nledger verification: ");
    verify(target, &run_id, false).await?;
    Ok(())
}

async fn list(target: &Target, statuses: &[String], limit: u32, as_json: bool) -> anyhow::Result<i32> {
    let statuses = statuses
        .iter()
        .map(|s| {
            warden_core::events::RunStatus::parse(s)
                .map(|st| warden_grpc::convert::status_to_proto(st) as i32)
                .ok_or_else(|| anyhow::anyhow!("unknown status '{s}'"))
        })
        .collect::<anyhow::Result<Vec<i32>>>()?;
    let page = runs_client(&target.endpoint)
        .await?
        .list_runs(pb::ListRunsRequest {
            tenant: target.tenant.clone(),
            statuses,
            page_size: limit,
            page_token: String::new(),
        })
        .await
        .map_err(|s| anyhow::anyhow!("{}", describe(&s)))?
        .into_inner();
    for r in page.runs {
        if as_json {
            println!(
                "{}",
                json!({"run_id": r.run_id, "status": status_name(r.status), "reason": r.reason, "last_seq": r.last_seq, "created_at_ms": r.created_at_ms})
            );
        } else {
            println!("{}", r.run_id);
        }
    }
    Ok(0)
}

async fn receipts(target: &Target, run_id: &str, step: Option<String>, as_json: bool) -> anyhow::Result<i32> {
    let list = ledger_client(&target.ledger_endpoint)
        .await?
        .list_receipts(pb::ListReceiptsRequest {
            tenant: target.tenant.clone(),
            run_id: run_id.into(),
            step_id: step.unwrap_or_default(),
            page_size: 5000,
            after_seq: 0,
        })
        .await
        .map_err(|s| anyhow::anyhow!("{}", describe(&s)))?
        .into_inner();
    for r in list.receipts {
        if as_json {
            println!(
                "{}",
                json!({"receipt_id": r.receipt_id, "run_id": r.run_id, "step_id": r.step_id, "attempt": r.attempt, "seq": r.seq,
                       "status": r.status, "reason": r.reason, "action_type": r.action_type, "policy_decision": r.policy_decision,
                       "capability_id": r.capability_id, "tx_id": r.tx_id, "trace_id": r.trace_id, "span_id": r.span_id,
                       "job_id": r.job_id, "timestamp_ms": r.timestamp_ms, "event_hash": r.event_hash, "hash": r.hash})
            );
        } else {
            println!(
                "{}\t{}\t{}\t{}\t{}\t{}\t{}",
                r.seq, r.step_id, r.attempt, r.status, r.action_type, r.policy_decision, r.receipt_id
            );
        }
    }
    Ok(0)
}

/// Export: the signed head is read first and the events cut at its seq, so the file is a
/// consistent snapshot even while the run is still moving.
async fn export(target: &Target, run_id: &str) -> anyhow::Result<i32> {
    let mut ledger = ledger_client(&target.ledger_endpoint).await?;
    let out = std::io::stdout();
    let mut out = std::io::BufWriter::new(out.lock());
    export_with(&mut ledger, target, run_id, &mut out).await?;
    Ok(0)
}

pub async fn export_with(
    ledger: &mut LedgerClient<Ch>,
    target: &Target,
    run_id: &str,
    out: &mut impl std::io::Write,
) -> anyhow::Result<()> {
    use warden_core::export::{FORMAT, Header, Line, SignedHeadLine};
    let err = |s: tonic::Status| anyhow::anyhow!("{}", describe(&s));
    let head = ledger
        .get_signed_head(pb::GetSignedHeadRequest { tenant: target.tenant.clone(), run_id: run_id.into() })
        .await
        .map_err(err)?
        .into_inner();
    let run = ledger
        .get_run(pb::GetLedgerRunRequest { tenant: target.tenant.clone(), run_id: run_id.into(), with_events: false })
        .await
        .map_err(err)?
        .into_inner();
    let mut emit = |line: &Line| -> anyhow::Result<()> { Ok(writeln!(out, "{}", serde_json::to_string(line)?)?) };
    emit(&Line::Header(Header {
        format: FORMAT.into(),
        run_id: run.run_id.clone(),
        tenant: run.tenant.clone(),
        status: status_name(run.status).into(),
        exported_at_ms: warden_grpc::now_ms(),
    }))?;
    let mut stream = ledger
        .stream_events(pb::StreamEventsRequest {
            tenant: target.tenant.clone(),
            run_id: run_id.into(),
            since_seq: 0,
            follow: false,
        })
        .await
        .map_err(err)?
        .into_inner();
    while let Some(e) = stream.message().await.map_err(err)? {
        if e.seq > head.seq {
            break;
        }
        emit(&Line::Event(warden_grpc::convert::event_from_proto(&e)))?;
    }
    let mut after_seq = 0;
    loop {
        let page = ledger
            .list_receipts(pb::ListReceiptsRequest {
                tenant: target.tenant.clone(),
                run_id: run_id.into(),
                step_id: String::new(),
                page_size: 5000,
                after_seq,
            })
            .await
            .map_err(err)?
            .into_inner();
        for r in page.receipts.into_iter().filter(|r| r.seq <= head.seq) {
            emit(&Line::Receipt(warden_core::receipt::Receipt {
                receipt_id: r.receipt_id,
                run_id: r.run_id,
                step_id: r.step_id,
                attempt: r.attempt,
                seq: r.seq,
                trace_id: r.trace_id,
                span_id: r.span_id,
                job_id: r.job_id,
                tx_id: r.tx_id,
                capability_id: r.capability_id,
                policy_decision: r.policy_decision,
                action_type: r.action_type,
                timestamp_ms: r.timestamp_ms,
                status: r.status,
                reason: r.reason,
                event_hash: r.event_hash,
                hash: r.hash,
            }))?;
        }
        if page.next_after_seq == 0 {
            break;
        }
        after_seq = page.next_after_seq;
    }
    emit(&Line::Head(SignedHeadLine {
        head: warden_core::head::Head { run_id: head.run_id, seq: head.seq, hash: head.hash },
        signature: hex::encode(head.signature),
        key_id: head.key_id,
        public_key: hex::encode(head.public_key),
    }))?;
    out.flush()?;
    Ok(())
}

async fn summaries(
    target: &Target,
    run_id: &str,
    kind: Option<String>,
    limit: u32,
    as_json: bool,
) -> anyhow::Result<i32> {
    let list = ledger_client(&target.ledger_endpoint)
        .await?
        .list_summaries(pb::ListSummariesRequest {
            tenant: target.tenant.clone(),
            run_id: run_id.into(),
            summary_type: kind.unwrap_or_default(),
            limit,
        })
        .await
        .map_err(|s| anyhow::anyhow!("{}", describe(&s)))?
        .into_inner();
    for s in list.summaries {
        if as_json {
            let payload: serde_json::Value = serde_json::from_str(&s.payload_json).unwrap_or_default();
            println!(
                "{}",
                json!({"seq": s.seq, "timestamp_ms": s.timestamp_ms, "summary_type": s.summary_type, "step_id": s.step_id, "payload": payload})
            );
        } else {
            println!("{}\t{}\t{}\t{}", s.seq, s.timestamp_ms, s.summary_type, s.payload_json);
        }
    }
    Ok(0)
}

async fn artifacts(
    target: &Target,
    run_id: &str,
    key: Option<String>,
    history: bool,
    as_json: bool,
) -> anyhow::Result<i32> {
    let list = ledger_client(&target.ledger_endpoint)
        .await?
        .list_artifacts(pb::ListArtifactsRequest {
            tenant: target.tenant.clone(),
            run_id: run_id.into(),
            key: key.unwrap_or_default(),
            history,
        })
        .await
        .map_err(|s| anyhow::anyhow!("{}", describe(&s)))?
        .into_inner();
    for a in list.artifacts {
        if as_json {
            let value: serde_json::Value = serde_json::from_str(&a.value_json).unwrap_or_default();
            println!("{}", json!({"key": a.key, "value": value, "seq": a.seq, "timestamp_ms": a.timestamp_ms}));
        } else {
            println!("{}\t{}", a.key, a.value_json);
        }
    }
    Ok(0)
}

/// The trace's execution DAG as a Graphviz digraph: the root frame a cluster holding its
/// planner attempts and steps, each step a cluster holding its branches, attempts and result;
/// nodes labelled by what ran (tool or step id) and status, never by payloads.
fn trace_dot(t: &serde_json::Value) -> String {
    let quote = |s: &str| s.replace('\\', "\\\\").replace('"', "\\\"");
    let field = |v: &serde_json::Value, k: &str| v.get(k).and_then(|x| x.as_str()).unwrap_or_default().to_string();
    let dag = &t["dag"];
    let nodes: Vec<&serde_json::Value> = dag.get("nodes").and_then(|x| x.as_array()).into_iter().flatten().collect();
    let edges: Vec<&serde_json::Value> = dag.get("edges").and_then(|x| x.as_array()).into_iter().flatten().collect();
    // Which step a node belongs to (branches, attempts, results), by the edges that reach it.
    let mut owner: std::collections::HashMap<String, String> = std::collections::HashMap::new();
    for e in &edges {
        let (from, to) = (field(e, "from"), field(e, "to"));
        if matches!(field(e, "kind").as_str(), "tries" | "backtracked_to" | "executes" | "produced") {
            // Ids of nested frames' nodes are prefixed by their run (`<run>/step:…`).
            let local = from.rsplit('/').next().unwrap_or_default();
            let step = if local.starts_with("step:") { Some(from.clone()) } else { owner.get(&from).cloned() };
            if let Some(step) = step {
                owner.insert(to, step);
            }
        }
    }
    let shape = |kind: &str| match kind {
        "frame" => "folder",
        "planner_attempt" => "note",
        "step" => "box",
        "branch" => "diamond",
        "attempt" => "ellipse",
        "result" => "doublecircle",
        _ => "octagon",
    };
    let node_line = |n: &serde_json::Value| {
        let label = format!("{}\\n{}", quote(&field(n, "label")), quote(&field(n, "status")));
        format!("\"{}\" [shape={}, label=\"{label}\"];\n", quote(&field(n, "id")), shape(&field(n, "kind")))
    };
    let mut out = format!("digraph \"{}\" {{\n  rankdir=LR;\n  compound=true;\n", quote(&field(t, "run_id")));
    // A frame's cluster holds its planner attempts, its steps (each a cluster of its branches,
    // attempts and result) and, nested, the frames its steps opened.
    fn cluster(
        out: &mut String,
        frame: &serde_json::Value,
        nodes: &[&serde_json::Value],
        owner: &std::collections::HashMap<String, String>,
        line: &dyn Fn(&serde_json::Value) -> String,
        depth: usize,
    ) {
        let field = |v: &serde_json::Value, k: &str| v.get(k).and_then(|x| x.as_str()).unwrap_or_default().to_string();
        let quote = |s: &str| s.replace('\\', "\\\\").replace('"', "\\\"");
        let pad = "  ".repeat(depth + 1);
        let fid = field(frame, "id");
        out.push_str(&format!(
            "{pad}subgraph \"cluster_{}\" {{\n{pad}  label=\"frame {} ({})\";\n{pad}  {}",
            quote(&fid),
            quote(&field(frame, "label")),
            quote(&field(frame, "status")),
            line(frame)
        ));
        let inside = |n: &&&serde_json::Value| field(n, "frame_id") == fid && field(n, "kind") != "frame";
        for n in nodes.iter().filter(inside).filter(|n| field(n, "kind") == "planner_attempt") {
            out.push_str(&format!("{pad}  {}", line(n)));
        }
        for step in nodes.iter().filter(inside).filter(|n| field(n, "kind") == "step") {
            let sid = field(step, "id");
            out.push_str(&format!(
                "{pad}  subgraph \"cluster_{}\" {{\n{pad}    label=\"{}\";\n",
                quote(&sid),
                quote(&field(step, "label"))
            ));
            out.push_str(&format!("{pad}    {}", line(step)));
            for n in nodes.iter().filter(|n| owner.get(&field(n, "id")) == Some(&sid)) {
                out.push_str(&format!("{pad}    {}", line(n)));
            }
            out.push_str(&format!("{pad}  }}\n"));
        }
        if depth <= warden_core::plan::MAX_FRAME_DEPTH as usize {
            for child in nodes.iter().filter(|n| field(n, "kind") == "frame" && field(n, "parent_frame_id") == fid) {
                cluster(out, child, nodes, owner, line, depth + 1);
            }
        }
        out.push_str(&format!("{pad}}}\n"));
    }
    for root in nodes.iter().filter(|n| field(n, "kind") == "frame" && n.get("parent_frame_id").is_none()) {
        cluster(&mut out, root, &nodes, &owner, &node_line, 0);
    }
    for e in &edges {
        out.push_str(&format!(
            "  \"{}\" -> \"{}\" [label=\"{}\"];\n",
            quote(&field(e, "from")),
            quote(&field(e, "to")),
            quote(&field(e, "kind"))
        ));
    }
    out.push_str("}\n");
    out
}

#[cfg(test)]
mod tests {
    use serde_json::json;
    use warden_core::trace::TraceEvent;

    /// The DAG renders as nested clusters: the root frame holds the step, the step holds its
    /// branches, attempts and result; nodes are labelled by tool, not by payloads.
    #[test]
    fn a_trace_renders_as_nested_frame_and_step_clusters() {
        let plan = json!({"plan": {"steps": [{"id": "a", "tool": "fail", "params": {"secret": "hunter2"},
                                              "alternatives": [{"tool": "echo"}]}]}});
        let evs = [
            ("run_submitted", "", plan),
            ("tool_requested", "a", json!({"attempt": 1})),
            ("tool_failed", "a", json!({"attempt": 1, "reason": "no"})),
            ("step_branched", "a", json!({"branch": 1, "tool": "echo", "attempt": 2})),
            ("tool_requested", "a", json!({"attempt": 2})),
            ("tool_completed", "a", json!({"attempt": 2, "output": {}})),
        ];
        let owned = TraceEvent::numbered(&evs);
        let trace = warden_core::trace::build("r1", &owned);
        let mut t = serde_json::to_value(&trace).expect("json");
        t["dag"] = serde_json::to_value(warden_core::dag::of(&trace, "goal")).expect("dag");
        let dot = super::trace_dot(&t);
        let frame = dot.find("subgraph \"cluster_frame:root\"").expect("frame cluster");
        let step = dot.find("subgraph \"cluster_step:a\"").expect("step cluster");
        let branch = dot
            .find("\"branch:a:1\" [shape=diamond, label=\"echo\\nsucceeded\"]")
            .unwrap_or_else(|| panic!("branch node:\n{dot}"));
        assert!(frame < step && step < branch, "nested in order:\n{dot}");
        assert!(dot.contains("\"branch:a:0\" -> \"branch:a:1\" [label=\"backtracked_to\"]"), "{dot}");
        assert!(!dot.contains("hunter2"), "payloads are not labels");

        // A child frame's DAG nests inside the frame node of the step that opened it.
        let parent = [
            ("run_submitted", "", json!({"plan": {"steps": [{"id": "research", "subgoal": "find"}]}})),
            ("frame_opened", "research", json!({"child_run_id": "c1", "subgoal": "find", "depth": 1})),
        ];
        let owned = TraceEvent::numbered(&parent);
        let parent_trace = warden_core::trace::build("r2", &owned);
        let mut dag = warden_core::dag::of(&parent_trace, "plan");
        let mut child = warden_core::dag::of(&trace, "find");
        child.run_id = "c1".into();
        dag.nest("frame:c1", child);
        let mut t = serde_json::to_value(&parent_trace).expect("json");
        t["dag"] = serde_json::to_value(dag).expect("dag");
        let dot = super::trace_dot(&t);
        let root = dot.find("subgraph \"cluster_frame:root\"").expect("root cluster");
        let frame = dot.find("subgraph \"cluster_frame:c1\"").unwrap_or_else(|| panic!("child cluster:\n{dot}"));
        let inner = dot.find("subgraph \"cluster_c1/step:a\"").unwrap_or_else(|| panic!("the child's step:\n{dot}"));
        let closes = dot[frame..].find("\n    }\n").map(|i| i + frame).expect("the child cluster closes");
        assert!(root < frame && frame < inner && inner < closes, "nested:\n{dot}");
    }
}
