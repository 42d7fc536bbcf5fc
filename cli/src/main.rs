//! `warden`: start a development mesh, submit and inspect runs, verify ledgers, benchmark.

/// mimalloc rather than glibc's malloc, which spent about a sixth of the mesh's CPU under load
/// managing its free lists (BENCHMARKS.md).
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

mod approvals;
mod bench;
mod bench_ledger;
mod bench_machine;
mod bench_planner;
mod bench_policy;
mod caps;
mod console;
mod dev;
mod ledger;
mod mcp;
mod policy;
mod run;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "warden",
    version,
    about = "Warden: an agent kernel where every tool call is authorized, recorded and replayable"
)]
struct Cli {
    /// The mesh's front door (the executor's Runs service).
    #[arg(long, global = true, env = "WARDEN_ENDPOINT", default_value = "http://127.0.0.1:7100")]
    endpoint: String,
    /// The ledger, when it is not served at --endpoint (production shape).
    #[arg(long, global = true, env = "WARDEN_LEDGER_ENDPOINT")]
    ledger_endpoint: Option<String>,
    /// The policy service, when it is not served at --endpoint (production shape).
    #[arg(long, global = true, env = "WARDEN_POLICY_ENDPOINT")]
    policy_endpoint: Option<String>,
    /// Bearer token to present (when the mesh authenticates callers).
    #[arg(long, global = true, env = "WARDEN_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// Tenant to act as.
    #[arg(long, global = true, env = "WARDEN_TENANT", default_value = "default")]
    tenant: String,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Every service in one process on loopback, SQLite under ./.warden/.
    Dev(dev::DevArgs),
    /// Submit and inspect runs.
    #[command(subcommand)]
    Run(run::RunCommand),
    /// Capability handles (policy service; --policy-endpoint, default --endpoint).
    #[command(subcommand)]
    Caps(caps::CapsCommand),
    /// Approvals waiting for (or given by) humans.
    #[command(subcommand)]
    Approvals(approvals::ApprovalsCommand),
    /// Validate Cedar policies; dry-run decisions.
    #[command(subcommand)]
    Policy(policy::PolicyCommand),
    /// Work with ledger exports offline.
    #[command(subcommand)]
    Ledger(ledger::LedgerCommand),
    /// The web console: runs, the approval inbox, receipts and capabilities (--listen ADDR).
    Console(console::ConsoleArgs),
    /// Warden as an MCP server: `warden mcp serve` (stdio, or --http ADDR).
    #[command(subcommand)]
    Mcp(mcp::McpCommand),
    /// Measure step latency and throughput (dev shape, and production shape with separate
    /// processes, PostgreSQL and Redis).
    Bench(bench::BenchArgs),
}

pub struct Target {
    pub endpoint: String,
    pub ledger_endpoint: String,
    pub tenant: String,
}

/// A CLI whose output is piped into `head` should stop quietly when the pipe closes, as
/// Unix tools do, instead of panicking on the failed write.
#[allow(unsafe_code)]
fn restore_sigpipe() {
    #[cfg(unix)]
    // SAFETY: resetting a signal disposition to its default at startup, before any thread.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

fn main() {
    restore_sigpipe();
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            std::process::exit(2);
        }
    };
    runtime.block_on(async_main());
}

async fn async_main() {
    let cli = Cli::parse();
    if let Some(t) = &cli.token {
        warden_grpc::auth::set_client_token(t);
    }
    let policy_endpoint = cli.policy_endpoint.clone();
    let target = Target {
        ledger_endpoint: cli.ledger_endpoint.clone().unwrap_or_else(|| cli.endpoint.clone()),
        endpoint: cli.endpoint,
        tenant: cli.tenant,
    };
    let result = match cli.command {
        Command::Dev(args) => dev::run(args).await,
        Command::Run(cmd) => run::run(&target, cmd).await,
        Command::Bench(args) => bench::run(args).await,
        Command::Ledger(cmd) => ledger::run(cmd),
        Command::Mcp(cmd) => mcp::run(&target, policy_endpoint.clone(), cmd).await,
        Command::Console(args) => {
            let endpoint = policy_endpoint.clone().unwrap_or_else(|| target.endpoint.clone());
            console::run(&target, &endpoint, args).await
        }
        Command::Caps(cmd) => {
            let endpoint = policy_endpoint.unwrap_or_else(|| target.endpoint.clone());
            caps::run(&target, &endpoint, cmd).await
        }
        Command::Approvals(cmd) => {
            let endpoint = policy_endpoint.clone().unwrap_or_else(|| target.endpoint.clone());
            approvals::run(&target, &endpoint, cmd).await
        }
        Command::Policy(cmd) => {
            let endpoint = policy_endpoint.unwrap_or_else(|| target.endpoint.clone());
            policy::run(&target, &endpoint, cmd).await
        }
    };
    match result {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::exit(2);
        }
    }
}
