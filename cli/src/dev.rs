//! `warden dev`: the whole mesh in one process on one loopback port, SQLite under a local
//! directory, in-process leases; the services call each other in memory. With `--demo PLAN`,
//! it submits the plan, prints the run's events and the ledger verification, and keeps
//! serving.

use std::path::{Path, PathBuf};

use anyhow::Context;
use tonic::service::Routes;
use warden_config::{TenantPolicy, WardenConfig};

use crate::Target;

#[derive(clap::Args)]
pub struct DevArgs {
    /// Address to serve every service on (port 0 picks a free port).
    #[arg(long, default_value = DEFAULT_LISTEN)]
    listen: String,
    /// Directory for the SQLite ledger, the policy key and the outbox.
    #[arg(long, default_value = ".warden")]
    dir: PathBuf,
    /// Configuration file (also WARDEN_CONFIG).
    #[arg(long, env = "WARDEN_CONFIG")]
    config: Option<PathBuf>,
    /// Submit this plan once the mesh is up and show what happened.
    #[arg(long)]
    demo: Option<PathBuf>,
    /// Largest plan, in steps (the planner's max_steps).
    #[arg(long)]
    max_steps: Option<usize>,
    /// Address to serve the web console on, beside the mesh (a free port if the default is
    /// taken, or if the mesh is not on its default address).
    #[arg(long, default_value = crate::console::DEFAULT_LISTEN)]
    console: String,
    /// Do not serve the web console.
    #[arg(long)]
    no_console: bool,
    /// Where to serve Prometheus metrics (`/metrics`), `host:port` or `off`; overrides
    /// `telemetry.metrics_listen` (default 127.0.0.1:9100, a free port if that one is taken).
    #[arg(long, env = "WARDEN_METRICS_LISTEN")]
    metrics_listen: Option<String>,
}

const DEFAULT_LISTEN: &str = "127.0.0.1:7100";

/// Tools the `default` tenant may call in dev when the configuration names no tenants.
pub const DEV_TOOLS: &[&str] = &["echo", "text.upper", "kv.*", "email.send", "model.call"];

/// The dev mesh's configuration: every endpoint is the one dev endpoint.
pub fn dev_config(base: WardenConfig, dir: &Path, endpoint: &str) -> WardenConfig {
    let mut c = base;
    let path = |f: &str| dir.join(f).display().to_string();
    c.ledger.database_url = format!("sqlite://{}", path("ledger.db"));
    c.ledger.key_file = path("ledger.key");
    c.policy.key_file = path("policy.key");
    c.policy.database_url = format!("sqlite://{}", path("policy.db"));
    c.policy.ledger_endpoint = endpoint.into();
    c.policy.planner_endpoint = endpoint.into();
    c.ledger.policy_endpoint = endpoint.into();
    if c.policy.tenants.is_empty() {
        c.policy.tenants.insert(
            "default".into(),
            TenantPolicy { allow_tools: DEV_TOOLS.iter().map(|s| s.to_string()).collect(), ..Default::default() },
        );
    }
    c.planner.tool_hosts = dev_tool_hosts(endpoint, &c.planner.tool_hosts);
    c.executor.ledger_endpoint = endpoint.into();
    c.executor.policy_endpoint = endpoint.into();
    c.executor.planner_endpoint = endpoint.into();
    c.planner.policy_endpoint = endpoint.into();
    c.planner.ledger_endpoint = endpoint.into();
    c.executor.tool_hosts = dev_tool_hosts(endpoint, &c.executor.tool_hosts);
    c.executor.redis_url = String::new();
    c.tools.policy_endpoint = endpoint.into();
    c.tools.ledger_endpoint = endpoint.into();
    c.tools.outbox_path = path("outbox.jsonl");
    // With authentication on, the services in this process still call each other as the mesh:
    // without a configured service token, one is made for this process only.
    if !c.auth.tokens.is_empty() && c.auth.token.is_empty() {
        let mut secret = [0u8; 24];
        if getrandom::getrandom(&mut secret).is_ok() {
            c.auth.token = hex::encode(secret);
        }
    }
    // The services here are one process: the token they present is the mesh's.
    if !c.auth.tokens.is_empty() && !c.auth.token.is_empty() {
        c.auth.tokens.insert(c.auth.token.clone(), "*".into());
    }
    c
}

/// The dev endpoint (the demo tools, served in this process) first, then every tool host the
/// configuration adds — a Python tool host, say. The built-in default (the demo host's own
/// port, which dev does not serve) is dropped, so a configuration without hosts changes nothing.
fn dev_tool_hosts(endpoint: &str, configured: &[String]) -> Vec<String> {
    let builtin = warden_config::ExecutorConfig::default().tool_hosts;
    std::iter::once(endpoint.to_string())
        .chain(configured.iter().filter(|h| h.as_str() != endpoint && !builtin.contains(h)).cloned())
        .collect()
}

/// A running dev mesh.
pub struct DevMesh {
    pub shutdown: tokio::sync::oneshot::Sender<()>,
    pub served: tokio::task::JoinHandle<anyhow::Result<()>>,
}

/// Starts every service on `listen` in this process.
pub async fn start(config: WardenConfig, listener: tokio::net::TcpListener) -> anyhow::Result<DevMesh> {
    // Before any client is built: each channel captures the token it presents when created,
    // so with `[auth] tokens` set the services reach each other as the mesh.
    warden_grpc::auth::set_client_token(&config.auth.token);
    // Also before: the services' channels to this process's own endpoint connect in memory,
    // not through loopback TCP (outside clients and other tool hosts use the network).
    let inproc = warden_grpc::inproc::register(&warden_grpc::endpoint_of(listener.local_addr()?));
    // The policy, ledger and tool host sign and verify in this one process: a signature one of
    // them made is recognised when another checks it, without curve arithmetic
    // (`warden_core::signature`); anything signed elsewhere is verified in full.
    warden_core::signature::remember_own_signatures();
    let ledger = warden_ledger::open(&config.ledger).await.context("opening the ledger")?;
    let policy = warden_policy::build(&config.policy).await?;
    let planner = warden_planner::PlannerService::new(&config.planner)?;
    let tools = warden_tools::ToolHostService::new(&config.tools)?;
    let executor = warden_executor::Executor::new(&config.executor).await?;
    let tokens = warden_grpc::auth::Tokens::new(&config.auth.tokens);
    let mut routes = Routes::builder();
    warden_ledger::add_routes(&mut routes, ledger, &tokens);
    warden_policy::add_routes(&mut routes, policy, &tokens);
    warden_planner::add_routes(&mut routes, planner, &tokens);
    warden_tools::add_routes(&mut routes, tools);
    warden_executor::add_routes(&mut routes, executor.clone(), &tokens);
    let services: Vec<&str> = [
        warden_ledger::SERVICES,
        warden_policy::SERVICES,
        warden_planner::SERVICES,
        warden_tools::SERVICES,
        warden_executor::SERVICES,
    ]
    .concat();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let served = tokio::spawn(async move {
        let sweeper = tokio::spawn(executor.sweep_forever());
        let r = warden_grpc::serve_with_inproc(listener, Some(inproc), routes.routes(), &services, async {
            let _ = rx.await;
        })
        .await;
        sweeper.abort();
        Ok(r?)
    });
    Ok(DevMesh { shutdown: tx, served })
}

/// Serves the web console beside the mesh (the default port, or a free one if it is taken);
/// returns its URL.
async fn start_console(listen: &str, endpoint: &str) -> anyhow::Result<String> {
    let listener = match warden_grpc::bind(listen).await {
        Ok(l) => l,
        Err(e) if listen == crate::console::DEFAULT_LISTEN => {
            eprintln!("warden dev: console: {e}; using a free port instead");
            warden_grpc::bind("127.0.0.1:0").await?
        }
        Err(e) => return Err(e.into()),
    };
    let url = format!("{}/", warden_grpc::endpoint_of(listener.local_addr()?));
    let mesh = warden_console::MeshEndpoints::single(endpoint);
    tokio::spawn(async move {
        if let Err(e) = warden_console::serve(listener, mesh, warden_grpc::shutdown_signal()).await {
            tracing::error!(error = %e, "console stopped");
        }
    });
    Ok(url)
}

pub async fn run(args: DevArgs) -> anyhow::Result<i32> {
    let mut base = WardenConfig::load(args.config.as_deref())?;
    let _telemetry = warden_telemetry::init_tracing("warden-dev", &base.telemetry)?;
    if let Some(n) = args.max_steps {
        base.planner.max_steps = n;
    }
    std::fs::create_dir_all(&args.dir).with_context(|| format!("creating {}", args.dir.display()))?;
    let listener = match warden_grpc::bind(&args.listen).await {
        Ok(l) => l,
        // The default port is taken (another mesh?): serve on a free one instead.
        Err(e) if args.listen == DEFAULT_LISTEN => {
            eprintln!("warden dev: {e}; using a free port instead");
            warden_grpc::bind("127.0.0.1:0").await?
        }
        Err(e) => return Err(e.into()),
    };
    let endpoint = warden_grpc::endpoint_of(listener.local_addr()?);
    // The console sits beside the mesh: on 7180 beside the default 7100, and on a free port of
    // the same host when the mesh was put elsewhere (`--listen 127.0.0.1:0` in tests, say).
    let console_listen = if args.console == crate::console::DEFAULT_LISTEN && args.listen != DEFAULT_LISTEN {
        std::net::SocketAddr::new(listener.local_addr()?.ip(), 0).to_string()
    } else {
        args.console.clone()
    };
    let config = dev_config(base, &args.dir, &endpoint);
    config.validate()?;
    let metrics = warden_telemetry::metrics::listen_address(
        args.metrics_listen.as_deref(),
        &config.telemetry.metrics_listen,
        "executor",
    );
    let metrics = match metrics {
        Some(addr) => Some(warden_telemetry::metrics::serve(&addr).await?),
        None => None,
    };
    let mesh = start(config, listener).await?;
    println!("warden dev: ledger, policy, planner, executor and demo tools serving on {endpoint}");
    let console = match args.no_console {
        true => None,
        false => Some(start_console(&console_listen, &endpoint).await?),
    };
    if let Some(url) = &console {
        println!("console: {url}");
    }
    if let Some(addr) = metrics {
        println!("warden dev: metrics: {}", warden_telemetry::metrics::url(addr));
    }
    println!("warden dev: state in {}", args.dir.display());
    if let Some(plan) = &args.demo {
        let target = Target { endpoint: endpoint.clone(), ledger_endpoint: endpoint.clone(), tenant: "default".into() };
        crate::run::demo(&target, plan).await?;
    }
    println!();
    println!("Warden is serving on {endpoint} (Ctrl-C to stop). From another shell:");
    println!("  export WARDEN_ENDPOINT={endpoint}");
    println!("  cargo run -q -p warden -- run submit --plan examples/hello.plan.json --wait");
    println!("  cargo run -q -p warden -- run tail <RUN_ID> --follow");
    if let Some(url) = &console {
        println!("Or open {url} (without [auth] tokens, any token signs in).");
    }
    let DevMesh { shutdown, served, .. } = mesh;
    tokio::select! {
        _ = warden_grpc::shutdown_signal() => {
            let _ = shutdown.send(());
        }
        r = served => {
            r??;
            return Ok(0);
        }
    }
    Ok(0)
}
