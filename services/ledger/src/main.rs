//! `warden-ledger`: the ledger service as its own process.

use clap::Parser;

#[derive(Parser)]
#[command(name = "warden-ledger", version, about = "Warden ledger service")]
struct Args {
    /// TOML configuration file (also WARDEN_CONFIG).
    #[arg(long, env = "WARDEN_CONFIG")]
    config: Option<std::path::PathBuf>,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    warden_telemetry::init_tracing("warden-ledger");
    let config = warden_config::WardenConfig::load(args.config.as_deref())?;
    let listener = warden_grpc::bind(&config.ledger.listen).await?;
    warden_grpc::announce("ledger", listener.local_addr()?);
    warden_ledger::serve(&config.ledger, listener, warden_grpc::shutdown_signal()).await
}
