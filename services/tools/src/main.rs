//! `warden-tools`: the demo tool host as its own process.

use clap::Parser;

#[derive(Parser)]
#[command(name = "warden-tools", version, about = "Warden demo tool host")]
struct Args {
    /// TOML configuration file (also WARDEN_CONFIG).
    #[arg(long, env = "WARDEN_CONFIG")]
    config: Option<std::path::PathBuf>,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    warden_telemetry::init_tracing("warden-tools");
    let config = warden_config::WardenConfig::load(args.config.as_deref())?;
    let listener = warden_grpc::bind(&config.tools.listen).await?;
    warden_grpc::announce("tools", listener.local_addr()?);
    warden_tools::serve(&config.tools, listener, warden_grpc::shutdown_signal()).await
}
