//! `warden-executor`: the executor as its own process.

use clap::Parser;

#[derive(Parser)]
#[command(
    name = "warden-executor",
    version,
    about = "Warden executor (the Runs front door)"
)]
struct Args {
    /// TOML configuration file (also WARDEN_CONFIG).
    #[arg(long, env = "WARDEN_CONFIG")]
    config: Option<std::path::PathBuf>,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    warden_telemetry::init_tracing("warden-executor");
    let config = warden_config::WardenConfig::load(args.config.as_deref())?;
    let listener = warden_grpc::bind(&config.executor.listen).await?;
    warden_grpc::announce("executor", listener.local_addr()?);
    warden_executor::serve(&config.executor, listener, warden_grpc::shutdown_signal()).await
}
