//! `warden-planner`: the planner service as its own process.

use clap::Parser;

#[derive(Parser)]
#[command(name = "warden-planner", version, about = "Warden planner service")]
struct Args {
    /// TOML configuration file (also WARDEN_CONFIG).
    #[arg(long, env = "WARDEN_CONFIG")]
    config: Option<std::path::PathBuf>,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    warden_telemetry::init_tracing("warden-planner");
    let config = warden_config::WardenConfig::load(args.config.as_deref())?;
    let listener = warden_grpc::bind(&config.planner.listen).await?;
    warden_grpc::announce("planner", listener.local_addr()?);
    warden_planner::serve(&config.planner, listener, warden_grpc::shutdown_signal()).await
}
