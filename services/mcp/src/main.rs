//! `warden-mcp`: the MCP tool host as its own process.

/// mimalloc rather than glibc's malloc, which spent about a sixth of the mesh's CPU under load
/// managing its free lists (BENCHMARKS.md).
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

use clap::Parser;

#[derive(Parser)]
#[command(
    version,
    about = "Warden MCP tool host: MCP servers' tools behind Warden's authorization, record and receipts"
)]
struct Args {
    /// TOML file with the `[mcp]` section (and `[auth] token`); WARDEN_MCP__KEY variables
    /// override it.
    #[arg(long, env = "WARDEN_CONFIG")]
    config: Option<std::path::PathBuf>,
    /// Where to serve Prometheus metrics (`/metrics`), `host:port` or `off` (default
    /// 127.0.0.1:9106). Traces follow the `OTEL_*` variables.
    #[arg(long, env = "WARDEN_METRICS_LISTEN")]
    metrics_listen: Option<String>,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let _telemetry = warden_telemetry::init_tracing("warden-mcp", &Default::default())?;
    warden_telemetry::metrics::start("mcp", args.metrics_listen.as_deref(), "").await?;
    let loaded = warden_mcp::config::Loaded::load(args.config.as_deref())?;
    // Before any client is built: each channel captures the token it presents when created.
    warden_grpc::auth::set_client_token(&loaded.token);
    let listener = warden_grpc::bind(&loaded.mcp.listen).await?;
    let host = warden_mcp::McpHost::new(&loaded.mcp)?;
    // Announced once the servers are up and listed, so "listening" means "tools known".
    host.start().await?;
    warden_grpc::announce("mcp", listener.local_addr()?);
    warden_mcp::serve(host, listener, warden_grpc::shutdown_signal()).await
}
