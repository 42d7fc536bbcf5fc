//! The Warden executor: the `Runs` front door, and the replicas that drive runs.
//!
//! A run is driven by whichever replica holds its lease (Redis, with a fencing epoch every
//! ledger write carries). The driver rebuilds the run from the ledger — completed steps are
//! reused, never re-executed — then schedules ready steps with bounded concurrency: resolve
//! templates, `Policy.Authorize` (recorded by the policy in the ledger), `tool_requested`,
//! `ToolHost.Invoke` carrying the signed authorization, then `tool_completed` or
//! `tool_failed`. A sweeper picks up every non-terminal run without a live lease, so no run
//! is lost between submit and completion.

pub mod driver;
pub mod output;
pub mod replay;
pub mod runs;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tonic::service::interceptor::InterceptedService;
use tonic::service::{Routes, RoutesBuilder};
use tracing::Instrument;
use warden_config::ExecutorConfig;
use warden_grpc::auth::{Ch, Tokens};
use warden_grpc::catalog::ToolCatalog;
use warden_lease::LeaseStore;
use warden_proto::v1 as pb;
use warden_proto::v1::capabilities_client::CapabilitiesClient;
use warden_proto::v1::ledger_client::LedgerClient;
use warden_proto::v1::planner_client::PlannerClient;
use warden_proto::v1::policy_client::PolicyClient;

/// Everything a replica needs, shared by the front door, the drivers and the sweeper.
#[derive(Clone)]
pub struct Executor {
    pub(crate) inner: Arc<Inner>,
}

pub(crate) struct Inner {
    pub id: String,
    /// Who holds leases: the id plus this process's boot id, so a replica restarted under the
    /// same id (a pod restarting in place) does not make its predecessor's leases look alive.
    pub lease_owner: String,
    pub config: ExecutorConfig,
    pub ledger: LedgerClient<Ch>,
    pub policy: PolicyClient<Ch>,
    pub capabilities: CapabilitiesClient<Ch>,
    pub planner: PlannerClient<Ch>,
    pub catalog: ToolCatalog,
    pub leases: LeaseStore,
    /// Runs this replica is driving right now, with their tenant where it is known before
    /// the driver reads the run (runs submitted here).
    pub driving: Mutex<HashMap<String, Option<String>>>,
    /// Cancel and pause tokens of the runs this replica holds the lease of.
    pub signals: Mutex<HashMap<String, RunTokens>>,
    /// Woken when this replica stops driving a run (it ended, blocked, or was handed off):
    /// `WaitRun` for a run driven here needs no ledger follower. Held by those waiting only.
    pub stopped_driving: Mutex<HashMap<String, Arc<Stopped>>>,
    /// Fires when this replica shuts down: its drivers start nothing new, let the steps in
    /// flight settle, record what waits, and release their leases for another replica.
    pub handoff: CancellationToken,
    /// Tools' compiled input and output schemas (arguments are checked before policy is
    /// asked, outputs before they are recorded).
    pub tool_schemas: warden_grpc::tool_schema::ToolSchemas,
    /// The configured output rules every output is vetted against.
    pub output_rules: output::OutputRules,
}

/// What `WaitRun` waits on for a run driven here.
#[derive(Default)]
pub(crate) struct Stopped {
    pub notify: tokio::sync::Notify,
    /// How the run stood when its driver stopped, when the driver knew its whole log (see
    /// `driver::known`): `GetRun`'s answer, without reading the log back.
    pub answer: std::sync::OnceLock<warden_proto::v1::Run>,
}

/// What a run's driver is told from outside it: fired once, for the drive they belong to.
#[derive(Clone, Default)]
pub(crate) struct RunTokens {
    /// Someone asked to cancel the run (see `Runs.CancelRun`).
    pub cancel: CancellationToken,
    /// Someone asked to pause the run (see `Runs.PauseRun`).
    pub pause: CancellationToken,
}

/// How long a shutting-down replica lets the steps in flight settle before it leaves.
const HANDOFF_DRAIN: Duration = Duration::from_secs(10);

/// How long the sweeper leaves a just-submitted run to the replica that took it.
const SUBMIT_GRACE_MS: i64 = 2_000;

impl Executor {
    pub async fn new(config: &ExecutorConfig) -> anyhow::Result<Executor> {
        let id = if config.executor_id.is_empty() {
            format!("executor-{}", &uuid::Uuid::new_v4().simple().to_string()[..12])
        } else {
            config.executor_id.clone()
        };
        let leases = LeaseStore::connect(&config.redis_url).await?;
        if config.redis_url.is_empty() {
            tracing::warn!("no executor.redis_url: using in-process leases (single executor only)");
        }
        let ledger = LedgerClient::new(warden_grpc::channel(&config.ledger_endpoint)?)
            .max_decoding_message_size(warden_grpc::MAX_MESSAGE_BYTES);
        Ok(Executor {
            inner: Arc::new(Inner {
                lease_owner: format!("{id}#{}", &uuid::Uuid::new_v4().simple().to_string()[..8]),
                id,
                config: config.clone(),
                ledger,
                policy: PolicyClient::new(warden_grpc::channel(&config.policy_endpoint)?),
                capabilities: CapabilitiesClient::new(warden_grpc::channel(&config.policy_endpoint)?),
                planner: PlannerClient::new(warden_grpc::channel(&config.planner_endpoint)?),
                catalog: ToolCatalog::new(&config.tool_hosts)?,
                leases,
                driving: Mutex::default(),
                signals: Mutex::default(),
                stopped_driving: Mutex::default(),
                handoff: CancellationToken::new(),
                tool_schemas: Default::default(),
                output_rules: output::OutputRules::new(&config.output_rules)?,
            }),
        })
    }

    pub fn id(&self) -> &str {
        &self.inner.id
    }

    /// The cancel and pause tokens of a run this replica drives (created on first use).
    pub(crate) fn run_tokens(&self, run_id: &str) -> RunTokens {
        let mut c = self.inner.signals.lock().unwrap_or_else(|p| p.into_inner());
        c.entry(run_id.to_string()).or_default().clone()
    }

    pub(crate) fn forget_run_tokens(&self, run_id: &str) {
        self.inner.signals.lock().unwrap_or_else(|p| p.into_inner()).remove(run_id);
    }

    /// Cancels or pauses the run at once if this replica drives it; other replicas notice the
    /// signal in the lease store.
    pub(crate) fn signal_here(&self, run_id: &str, signal: warden_lease::RunSignal) {
        if let Some(t) = self.inner.signals.lock().unwrap_or_else(|p| p.into_inner()).get(run_id) {
            match signal {
                warden_lease::RunSignal::Cancel => t.cancel.cancel(),
                warden_lease::RunSignal::Pause => t.pause.cancel(),
            }
        }
    }

    /// Keeps this replica alive in the lease store, so other replicas take its runs over
    /// soon after it dies (not after the lease TTL). Ends when the replica hands off.
    pub async fn heartbeat_forever(self) {
        let ttl = Duration::from_millis(self.inner.config.liveness_ttl_ms);
        let mut ok_since: Option<tokio::time::Instant> = None;
        loop {
            match self.inner.leases.heartbeat(&self.inner.lease_owner, ttl).await {
                Ok(()) => {
                    let since = *ok_since.get_or_insert_with(tokio::time::Instant::now);
                    // Others' liveness is read only once ours has held for a whole TTL: after a
                    // Redis outage every key lapsed, live holders' too, until they beat again.
                    self.inner.leases.trust_liveness(since.elapsed() >= ttl);
                }
                Err(e) => {
                    tracing::warn!(error = %e, "liveness heartbeat failed");
                    ok_since = None;
                    self.inner.leases.trust_liveness(false);
                }
            }
            // Beats on through a hand-off: the runs still settling are this replica's.
            tokio::time::sleep(ttl / 3).await;
        }
    }

    /// A clean shutdown: nothing new starts, the steps in flight settle (for at most
    /// `drain`), every lease is released and the replica says it is gone, so other replicas
    /// take its runs over at once.
    pub async fn hand_off(&self, drain: Duration) {
        self.inner.handoff.cancel();
        let deadline = tokio::time::Instant::now() + drain;
        while !self.inner.driving.lock().unwrap_or_else(|p| p.into_inner()).is_empty()
            && tokio::time::Instant::now() < deadline
        {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        if let Err(e) = self.inner.leases.depart(&self.inner.lease_owner).await {
            tracing::warn!(error = %e, "departure not recorded; liveness will expire");
        }
        tracing::info!(executor_id = %self.inner.id, "handed off");
    }

    /// Whether this replica drives `run_id` now.
    pub(crate) fn drives(&self, run_id: &str) -> bool {
        self.inner.driving.lock().unwrap_or_else(|p| p.into_inner()).contains_key(run_id)
    }

    /// Whether this replica drives `run_id` now, submitted here for `tenant`: a run that is
    /// that tenant's and still going without a look at the ledger.
    pub(crate) fn drives_for(&self, run_id: &str, tenant: &str) -> bool {
        let d = self.inner.driving.lock().unwrap_or_else(|p| p.into_inner());
        d.get(run_id).is_some_and(|t| t.as_deref() == Some(tenant))
    }

    /// What wakes when this replica stops driving `run_id`.
    pub(crate) fn stopped_driving(&self, run_id: &str) -> Arc<Stopped> {
        let mut m = self.inner.stopped_driving.lock().unwrap_or_else(|p| p.into_inner());
        m.entry(run_id.to_string()).or_default().clone()
    }

    /// Whether `stopped` is what wakes when this replica stops driving `run_id` now: not
    /// when that drive stopped meanwhile (and perhaps another started).
    pub(crate) fn waits_on(&self, run_id: &str, stopped: &Arc<Stopped>) -> bool {
        let m = self.inner.stopped_driving.lock().unwrap_or_else(|p| p.into_inner());
        m.get(run_id).is_some_and(|n| Arc::ptr_eq(n, stopped))
    }

    /// Drops `stopped`, the waker of a run no longer driven here, when nobody else holds it.
    pub(crate) fn forget_stopped_driving(&self, run_id: &str, stopped: &Arc<Stopped>) {
        let mut m = self.inner.stopped_driving.lock().unwrap_or_else(|p| p.into_inner());
        let ours = m.get(run_id).is_some_and(|n| Arc::ptr_eq(n, stopped) && Arc::strong_count(n) <= 2);
        if ours && !self.drives(run_id) {
            m.remove(run_id);
        }
    }

    /// Whether anyone waits for this replica to stop driving `run_id`.
    pub(crate) fn waited_for(&self, run_id: &str) -> bool {
        self.inner.stopped_driving.lock().unwrap_or_else(|p| p.into_inner()).contains_key(run_id)
    }

    /// How `run_id` stands as its driver leaves it, for those waiting (see [`Stopped`]).
    pub(crate) fn left(&self, run_id: &str, answer: warden_proto::v1::Run) {
        if let Some(s) = self.inner.stopped_driving.lock().unwrap_or_else(|p| p.into_inner()).get(run_id) {
            let _ = s.answer.set(answer);
        }
    }

    fn done_driving(&self, run_id: &str) {
        self.inner.driving.lock().unwrap_or_else(|p| p.into_inner()).remove(run_id);
        if let Some(n) = self.inner.stopped_driving.lock().unwrap_or_else(|p| p.into_inner()).remove(run_id) {
            n.notify.notify_waiters();
        }
    }

    /// Starts driving `run_id` in the background unless this replica already is.
    pub fn dispatch(&self, run_id: String) {
        {
            let mut d = self.inner.driving.lock().unwrap_or_else(|p| p.into_inner());
            if d.contains_key(&run_id) {
                return;
            }
            d.insert(run_id.clone(), None);
        }
        let this = self.clone();
        // A child of whatever dispatched it (a resume, an approval), or a trace of its own
        // (the sweeper).
        let span = driver::run_span(&run_id);
        tokio::spawn(
            async move {
                if let Err(e) = driver::drive(&this, &run_id).await {
                    tracing::warn!(run_id = %run_id, error = %e, "run left for another attempt");
                }
                this.done_driving(&run_id);
            }
            .instrument(span),
        );
    }

    /// Drives a run this replica submitted and holds the lease of (see
    /// [`driver::drive_submitted`]).
    pub(crate) fn dispatch_submitted(
        &self,
        tenant: String,
        lease: warden_lease::RunLease,
        view: warden_core::run::RunView,
        how: driver::Submitted,
    ) {
        let run_id = lease.run_id.clone();
        // Never over a driver already here (the lease makes that impossible; were it not, the
        // entry without a tenant only costs WaitRun its shortcut).
        self.inner
            .driving
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(run_id.clone())
            .or_insert(Some(tenant.clone()));
        let this = self.clone();
        // A child of the SubmitRun request's span, so a client's `traceparent` is the run's parent.
        let span = driver::run_span(&run_id);
        tokio::spawn(
            async move {
                match driver::drive_submitted(&this, &tenant, lease, view, how).await {
                    Ok(()) => {}
                    Err(driver::DriveError::NotCreated) => {
                        tracing::debug!(run_id = %run_id, "run not created; not driven")
                    }
                    Err(e) => tracing::warn!(run_id = %run_id, error = %e, "run left for another attempt"),
                }
                this.done_driving(&run_id);
            }
            .instrument(span),
        );
    }

    /// Re-dispatches every non-terminal run without a live lease, forever.
    pub async fn sweep_forever(self) {
        let every = Duration::from_millis(self.inner.config.sweep_interval_ms);
        loop {
            if self.inner.handoff.is_cancelled() {
                return; // leaving: take nothing new
            }
            if let Err(e) = self.sweep_once().await {
                tracing::warn!(error = %e, "sweep failed");
            }
            tokio::select! {
                _ = tokio::time::sleep(every) => {}
                _ = self.inner.handoff.cancelled() => return,
            }
        }
    }

    /// One pass of the sweeper; returns how many runs it dispatched.
    pub async fn sweep_once(&self) -> anyhow::Result<usize> {
        let mut dispatched = 0;
        let mut page_token = String::new();
        loop {
            let page = self
                .inner
                .ledger
                .clone()
                .list_runs(pb::ListLedgerRunsRequest {
                    tenant: String::new(),
                    statuses: vec![pb::RunStatus::Pending as i32, pb::RunStatus::Active as i32],
                    page_size: 500,
                    page_token: page_token.clone(),
                })
                .await?
                .into_inner();
            let now = warden_grpc::now_ms();
            for run in page.runs {
                // A fresh submission is dispatched by the replica that took it, once its
                // capabilities are attached; the sweeper leaves it alone for a moment.
                if run.status() == pb::RunStatus::Pending && now - run.created_at_ms < SUBMIT_GRACE_MS {
                    continue;
                }
                let mine = self.drives(&run.run_id);
                if !mine && !self.inner.leases.is_held(&run.run_id).await? {
                    tracing::info!(run_id = %run.run_id, "sweeper picked up run without a live lease");
                    self.dispatch(run.run_id);
                    dispatched += 1;
                }
            }
            if page.next_page_token.is_empty() {
                return Ok(dispatched);
            }
            page_token = page.next_page_token;
        }
    }
}

pub const SERVICES: &[&str] = &["warden.v1.Runs"];

/// Adds the `Runs` front door to `routes`.
pub fn add_routes(routes: &mut RoutesBuilder, executor: Executor, tokens: &Tokens) {
    let server = pb::runs_server::RunsServer::new(runs::RunsService::new(executor));
    routes.add_service(InterceptedService::new(server, tokens.clone()));
}

/// Serves `Runs` and runs the sweeper until `shutdown`.
pub async fn serve(
    config: &ExecutorConfig,
    tokens: Tokens,
    listener: impl Into<warden_grpc::Listeners>,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> anyhow::Result<()> {
    let executor = Executor::new(config).await?;
    // Alive before it takes any lease, so no other replica mistakes its runs for orphans.
    let ttl = Duration::from_millis(config.liveness_ttl_ms);
    executor.inner.leases.heartbeat(&executor.inner.lease_owner, ttl).await?;
    let heartbeat = tokio::spawn(executor.clone().heartbeat_forever());
    tracing::info!(executor_id = executor.id(), "executor ready");
    let sweeper = tokio::spawn(executor.clone().sweep_forever());
    let mut routes = Routes::builder();
    add_routes(&mut routes, executor.clone(), &tokens);
    // On the signal the drivers start handing off at once (and waiting clients are answered),
    // while the server finishes the requests in flight.
    let handoff = executor.inner.handoff.clone();
    let shutdown = async move {
        shutdown.await;
        handoff.cancel();
    };
    let served = warden_grpc::serve(listener, routes.routes(), SERVICES, shutdown).await;
    sweeper.abort();
    executor.hand_off(HANDOFF_DRAIN).await;
    heartbeat.abort();
    served?;
    Ok(())
}
