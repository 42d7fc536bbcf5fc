//! What every service binary does before serving: parse `--config`, set up tracing, load
//! and validate the configuration, bind the listen address and announce it.

use clap::Parser;
use tokio::net::TcpListener;
use warden_config::WardenConfig;

#[derive(Parser)]
#[command(version, about = "A Warden service; configuration from --config and WARDEN_* variables")]
struct ServiceArgs {
    /// TOML configuration file (also WARDEN_CONFIG); WARDEN_SECTION__KEY variables override it.
    #[arg(long, env = "WARDEN_CONFIG")]
    config: Option<std::path::PathBuf>,
}

pub struct Launched {
    pub config: WardenConfig,
    pub listener: TcpListener,
    /// The tokens this server accepts.
    pub tokens: crate::auth::Tokens,
}

/// Prepares `binary` to serve the section `service`, listening where `listen` says.
pub async fn launch(
    binary: &'static str,
    service: &str,
    listen: fn(&WardenConfig) -> &str,
) -> anyhow::Result<Launched> {
    let args = ServiceArgs::parse();
    warden_telemetry::init_tracing(binary);
    let config = WardenConfig::load(args.config.as_deref())?;
    crate::auth::set_client_token(&config.auth.token);
    let tokens = crate::auth::Tokens::new(&config.auth.tokens);
    let listener = crate::bind(listen(&config)).await?;
    crate::announce(service, listener.local_addr()?);
    Ok(Launched { config, listener, tokens })
}
