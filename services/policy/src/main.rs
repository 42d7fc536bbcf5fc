//! `warden-policy`: the policy service as its own process.

use clap::Parser;

#[derive(Parser)]
#[command(name = "warden-policy", version, about = "Warden policy service")]
struct Args {
    /// TOML configuration file (also WARDEN_CONFIG).
    #[arg(long, env = "WARDEN_CONFIG")]
    config: Option<std::path::PathBuf>,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    warden_telemetry::init_tracing("warden-policy");
    let config = warden_config::WardenConfig::load(args.config.as_deref())?;
    let listener = warden_grpc::bind(&config.policy.listen).await?;
    warden_grpc::announce("policy", listener.local_addr()?);
    warden_policy::serve(&config.policy, listener, warden_grpc::shutdown_signal()).await
}
