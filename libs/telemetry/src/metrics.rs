//! Prometheus metrics: the process's recorder, its `/metrics` endpoint (text exposition
//! format), and every metric Warden records, named here so the list in the README stays true.
//!
//! Names follow Prometheus conventions (`_total` counters, `_seconds` histograms in base
//! units). Labels carry only bounded values: gRPC service, method and code; run, step and
//! attempt outcomes; policy rule ids (bounded by the loaded policy); tenants and models only
//! where configuration bounds them (see [`bounded`]). Never a run, step or request id.
//!
//! Without an installed recorder (unit tests, libraries) every call here is a no-op.

use std::net::SocketAddr;
use std::sync::OnceLock;
use std::time::Duration;

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

use crate::TelemetryError;

pub const RPC_REQUESTS: &str = "warden_grpc_server_requests_total";
pub const RPC_DURATION: &str = "warden_grpc_server_request_duration_seconds";
pub const RUNS_SUBMITTED: &str = "warden_runs_submitted_total";
pub const RUNS: &str = "warden_runs_total";
pub const STEPS: &str = "warden_steps_total";
pub const ATTEMPTS: &str = "warden_attempts_total";
pub const POLICY_DECISIONS: &str = "warden_policy_decisions_total";
pub const APPROVALS_PENDING: &str = "warden_approvals_pending";
pub const LEASE_ACQUISITIONS: &str = "warden_lease_acquisitions_total";
pub const LEASE_TAKEOVERS: &str = "warden_lease_takeovers_total";
pub const FENCING_REFUSALS: &str = "warden_fencing_refusals_total";
pub const LEDGER_APPEND_DURATION: &str = "warden_ledger_append_duration_seconds";
pub const LEDGER_BATCH_EVENTS: &str = "warden_ledger_batch_events";
pub const LEDGER_COMMIT_DURATION: &str = "warden_ledger_batch_commit_duration_seconds";
pub const MODEL_TOKENS: &str = "warden_model_tokens_total";
pub const MODEL_COST: &str = "warden_model_cost_usd";
pub const OUTPUTS_SANITIZED: &str = "warden_outputs_sanitized_total";
pub const LEDGER_RUNS_CREATED: &str = "warden_ledger_runs_created_total";
pub const LEDGER_RUNS_READ: &str = "warden_ledger_runs_read_total";
pub const LEDGER_SUBMISSIONS_REFUSED: &str = "warden_ledger_submissions_refused_total";
pub const WAIT_ANSWERS: &str = "warden_wait_answers_total";

/// Every metric with its help text: described at install, listed in the README.
pub const ALL: &[(&str, &str)] = &[
    (RPC_REQUESTS, "gRPC requests served, by service, method and status code"),
    (RPC_DURATION, "time to answer a gRPC request (to its response headers), by service and method"),
    (RUNS_SUBMITTED, "runs accepted by SubmitRun (deduplicated submissions not counted)"),
    (
        RUNS,
        "runs that reached a status: completed, failed, cancelled, blocked, paused, requires_reconciliation, empty_plan",
    ),
    (STEPS, "steps settled, by outcome: completed, failed (denials included), cancelled, blocked, unknown"),
    (ATTEMPTS, "tool call attempts, by outcome: completed, failed, retry, cancelled, blocked, unknown"),
    (POLICY_DECISIONS, "policy decisions, by outcome (allow, deny, approval_required) and rule id"),
    (APPROVALS_PENDING, "approvals waiting for a human"),
    (LEASE_ACQUISITIONS, "run leases acquired, by kind: fresh (a new run) or takeover (a run another holder had)"),
    (LEASE_TAKEOVERS, "runs taken over from another lease holder"),
    (FENCING_REFUSALS, "ledger writes refused for a stale fencing epoch"),
    (LEDGER_APPEND_DURATION, "time to append one group of events, queueing and commit included"),
    (LEDGER_BATCH_EVENTS, "events committed together in one ledger transaction"),
    (LEDGER_COMMIT_DURATION, "time to commit one ledger batch"),
    (MODEL_TOKENS, "model tokens, by tenant, model and type (input, output)"),
    (MODEL_COST, "model cost in US dollars since the process started, by tenant and model (only grows)"),
    (OUTPUTS_SANITIZED, "tool outputs withheld by the step pipeline, by rule (output_schema or output_rule:<name>)"),
    (
        LEDGER_SUBMISSIONS_REFUSED,
        "run submissions refused RESOURCE_EXHAUSTED because the ledger's admission queue was full",
    ),
    (
        LEDGER_RUNS_CREATED,
        "runs created by the ledger, by first_step: recorded (its decision and request in the same commit), refused, none",
    ),
    (
        WAIT_ANSWERS,
        "WaitRun answers, by source: driver (what the run's driver here recorded, without a read) or ledger (the run's log read back)",
    ),
    (
        LEDGER_RUNS_READ,
        "runs read from the database to decide appends (whole, or what a batch needs of a run too large to keep): not in the ledger's memory, moved on by another writer, or in a batch a refusal or a summary sent to the stored heads",
    ),
];

/// Latency buckets, in seconds: sub-millisecond appends to multi-second tool calls.
const SECONDS: &[f64] = &[0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0];
const BATCH: &[f64] = &[1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0];

static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();

/// Installs the process's Prometheus recorder (once; later calls return the same handle).
pub fn install() -> Result<PrometheusHandle, TelemetryError> {
    if let Some(h) = HANDLE.get() {
        return Ok(h.clone());
    }
    let failed = |e: metrics_exporter_prometheus::BuildError| TelemetryError::Recorder(e.to_string());
    let handle = PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), SECONDS)
        .map_err(failed)?
        .set_buckets_for_metric(Matcher::Full(LEDGER_BATCH_EVENTS.into()), BATCH)
        .map_err(failed)?
        .install_recorder()
        .map_err(failed)?;
    for (name, help) in ALL {
        match *name {
            n if n.ends_with("_total") => metrics::describe_counter!(n, *help),
            n if n == APPROVALS_PENDING || n == MODEL_COST => metrics::describe_gauge!(n, *help),
            n => metrics::describe_histogram!(n, *help),
        }
    }
    // Histograms keep their samples in rolling buffers that upkeep folds in; rendering does
    // too, but an unscraped process must not grow them without bound.
    let upkeep = handle.clone();
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_secs(5)).await;
            upkeep.run_upkeep();
        }
    });
    Ok(HANDLE.get_or_init(|| handle).clone())
}

/// Serves `/metrics` on `addr` (`host:port`; port 0 picks a free one). When `addr` is taken,
/// a free port of the same host is used instead, with a warning: the address is announced
/// either way (`WARDEN_METRICS <service> <url>` on stdout). Returns the bound address.
pub async fn serve(addr: &str) -> Result<SocketAddr, TelemetryError> {
    let handle = install()?;
    let bind_failed = |source| TelemetryError::MetricsBind { addr: addr.to_string(), source };
    let listener = match tokio::net::TcpListener::bind(addr).await {
        Ok(l) => l,
        Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => {
            let host = addr.rsplit_once(':').map_or("127.0.0.1", |(h, _)| h);
            tracing::warn!(addr, error = %e, "metrics address taken; serving metrics on a free port");
            tokio::net::TcpListener::bind(format!("{host}:0")).await.map_err(bind_failed)?
        }
        Err(e) => return Err(bind_failed(e)),
    };
    let bound = listener.local_addr().map_err(bind_failed)?;
    let app = axum::Router::new().route(
        "/metrics",
        axum::routing::get(move || {
            let handle = handle.clone();
            async move { ([(http::header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], handle.render()) }
        }),
    );
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::warn!(error = %e, "metrics endpoint stopped");
        }
    });
    Ok(bound)
}

/// The URL of a metrics endpoint bound to `addr`.
pub fn url(addr: SocketAddr) -> String {
    format!("http://{addr}/metrics")
}

/// `value` when `known` says configuration names it, else `"other"`: a label value a caller
/// cannot multiply (tenants, models).
pub fn bounded(value: &str, known: impl FnOnce(&str) -> bool) -> &str {
    if known(value) { value } else { "other" }
}

/// One gRPC request answered (the server layer).
pub fn rpc_served(service: &str, method: &str, code: &'static str, elapsed: Duration) {
    let (service, method) = (service.to_string(), method.to_string());
    metrics::counter!(RPC_REQUESTS, "service" => service.clone(), "method" => method.clone(), "code" => code)
        .increment(1);
    metrics::histogram!(RPC_DURATION, "service" => service, "method" => method).record(elapsed.as_secs_f64());
}

pub fn run_submitted() {
    metrics::counter!(RUNS_SUBMITTED).increment(1);
}

/// A run reached `status` (a terminal status, `blocked` or `requires_reconciliation`).
pub fn run_reached(status: &'static str) {
    metrics::counter!(RUNS, "status" => status).increment(1);
}

/// A `WaitRun` answered; `source` is `driver` or `ledger`.
pub fn wait_answered(source: &'static str) {
    metrics::counter!(WAIT_ANSWERS, "source" => source).increment(1);
}

pub fn step_settled(outcome: &'static str) {
    metrics::counter!(STEPS, "outcome" => outcome).increment(1);
}

/// A tool output withheld; `rule` is bounded by configuration (`output_schema` or a
/// configured output rule's name).
pub fn output_sanitized(rule: &str) {
    metrics::counter!(OUTPUTS_SANITIZED, "rule" => rule.to_string()).increment(1);
}

pub fn attempt_settled(outcome: &'static str) {
    metrics::counter!(ATTEMPTS, "outcome" => outcome).increment(1);
}

/// A decision with its outcome and rule id (bounded by the loaded policy).
pub fn policy_decision(outcome: &'static str, rule_id: &str) {
    metrics::counter!(POLICY_DECISIONS, "outcome" => outcome, "rule" => rule_id.to_string()).increment(1);
}

pub fn approvals_pending(n: u64) {
    metrics::gauge!(APPROVALS_PENDING).set(n as f64);
}

/// A lease acquired; `takeover` when the run had a holder before (its epoch was above 0).
pub fn lease_acquired(takeover: bool) {
    let kind = if takeover { "takeover" } else { "fresh" };
    metrics::counter!(LEASE_ACQUISITIONS, "kind" => kind).increment(1);
    if takeover {
        metrics::counter!(LEASE_TAKEOVERS).increment(1);
    }
}

pub fn fencing_refused() {
    metrics::counter!(FENCING_REFUSALS).increment(1);
}

pub fn ledger_appended(elapsed: Duration) {
    metrics::histogram!(LEDGER_APPEND_DURATION).record(elapsed.as_secs_f64());
}

/// A run created; `first_step` is `recorded`, `refused` or `none` (see `CreateRunRequest.first_events`).
pub fn ledger_run_created(first_step: &'static str) {
    metrics::counter!(LEDGER_RUNS_CREATED, "first_step" => first_step).increment(1);
}

/// A run submission refused because the ledger's admission queue was full.
pub fn ledger_submission_refused() {
    metrics::counter!(LEDGER_SUBMISSIONS_REFUSED).increment(1);
}

/// Runs read from the database to decide appends (see [`LEDGER_RUNS_READ`]).
pub fn ledger_runs_read(n: usize) {
    metrics::counter!(LEDGER_RUNS_READ).increment(n as u64);
}

pub fn ledger_batch_committed(events: usize, elapsed: Duration) {
    metrics::histogram!(LEDGER_BATCH_EVENTS).record(events as f64);
    metrics::histogram!(LEDGER_COMMIT_DURATION).record(elapsed.as_secs_f64());
}

/// A model call's usage. `tenant` and `model` must be bounded (see [`bounded`]).
pub fn model_usage(tenant: &str, model: &str, input_tokens: u64, output_tokens: u64, cost_usd: f64) {
    let (tenant, model) = (tenant.to_string(), model.to_string());
    metrics::counter!(MODEL_TOKENS, "tenant" => tenant.clone(), "model" => model.clone(), "type" => "input")
        .increment(input_tokens);
    metrics::counter!(MODEL_TOKENS, "tenant" => tenant.clone(), "model" => model.clone(), "type" => "output")
        .increment(output_tokens);
    if cost_usd.is_finite() && cost_usd > 0.0 {
        // A sum of dollars is fractional and `metrics` counters are integers: a gauge that
        // only grows.
        metrics::gauge!(MODEL_COST, "tenant" => tenant, "model" => model).increment(cost_usd);
    }
}

/// The metrics address a service binary uses when neither `telemetry.metrics_listen` nor
/// `--metrics-listen` says otherwise: beside its gRPC default port (7100 + n → 9100 + n).
pub fn default_listen(service: &str) -> &'static str {
    match service {
        "ledger" => "127.0.0.1:9101",
        "policy" => "127.0.0.1:9102",
        "planner" => "127.0.0.1:9103",
        "tools" => "127.0.0.1:9105",
        "mcp" => "127.0.0.1:9106",
        // The executor, and `warden dev`, which serves every service on the executor's port.
        _ => "127.0.0.1:9100",
    }
}

/// Where a process serves metrics: the flag or `WARDEN_METRICS_LISTEN` (`flag`), else the
/// configuration key, else the service's default; `None` for `off`.
pub fn listen_address(flag: Option<&str>, configured: &str, service: &str) -> Option<String> {
    let chosen = flag.filter(|f| !f.is_empty()).unwrap_or(configured);
    match chosen {
        "off" => None,
        "" => Some(default_listen(service).to_string()),
        a => Some(a.to_string()),
    }
}

/// Starts the metrics endpoint of `service` and announces it (`WARDEN_METRICS <service> <url>`
/// on stdout, for process supervisors and the test harness).
pub async fn start(service: &str, flag: Option<&str>, configured: &str) -> Result<Option<SocketAddr>, TelemetryError> {
    let Some(addr) = listen_address(flag, configured, service) else { return Ok(None) };
    let bound = serve(&addr).await?;
    println!("WARDEN_METRICS {service} {}", url(bound));
    Ok(Some(bound))
}
