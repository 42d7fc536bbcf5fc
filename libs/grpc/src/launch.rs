//! What every service binary does before serving: parse `--config`, load and validate the
//! configuration, set up tracing and the metrics endpoint, bind the listen address and
//! announce both.

use clap::Parser;
use tokio::net::TcpListener;
use warden_config::WardenConfig;

#[derive(Parser)]
#[command(version, about = "A Warden service; configuration from --config and WARDEN_* variables")]
struct ServiceArgs {
    /// TOML configuration file (also WARDEN_CONFIG); WARDEN_SECTION__KEY variables override it.
    #[arg(long, env = "WARDEN_CONFIG")]
    config: Option<std::path::PathBuf>,
    /// Where to serve Prometheus metrics (`/metrics`), `host:port` or `off`; overrides
    /// `telemetry.metrics_listen`.
    #[arg(long, env = "WARDEN_METRICS_LISTEN")]
    metrics_listen: Option<String>,
}

pub struct Launched {
    pub config: WardenConfig,
    pub listener: TcpListener,
    /// The tokens this server accepts.
    pub tokens: crate::auth::Tokens,
    /// Exports the process's spans until dropped (at the end of `main`, after serving).
    pub telemetry: warden_telemetry::Telemetry,
}

/// Prepares `binary` to serve the section `service`, listening where `listen` says.
pub async fn launch(
    binary: &'static str,
    service: &str,
    listen: fn(&WardenConfig) -> &str,
) -> anyhow::Result<Launched> {
    let args = ServiceArgs::parse();
    let config = WardenConfig::load(args.config.as_deref())?;
    let telemetry = warden_telemetry::init_tracing(binary, &config.telemetry)?;
    crate::auth::set_client_token(&config.auth.token);
    let tokens = crate::auth::Tokens::new(&config.auth.tokens);
    // Announced before the gRPC address, which supervisors take as "started".
    warden_telemetry::metrics::start(service, args.metrics_listen.as_deref(), &config.telemetry.metrics_listen).await?;
    let listener = crate::bind(listen(&config)).await?;
    crate::announce(service, listener.local_addr()?);
    Ok(Launched { config, listener, tokens, telemetry })
}
