//! What every service binary does before serving: parse `--config`, load and validate the
//! configuration, set up tracing and the metrics endpoint, bind the listen address and
//! announce both.

use clap::Parser;
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
    /// The TCP listener, and the Unix domain socket when the section names one.
    pub listener: crate::Listeners,
    /// The tokens this server accepts.
    pub tokens: crate::auth::Tokens,
    /// Exports the process's spans until dropped (at the end of `main`, after serving).
    pub telemetry: warden_telemetry::Telemetry,
}

/// Prepares `binary` to serve the section `service`, listening where `listen` says: its TCP
/// address, and its Unix domain socket path (empty: none).
pub async fn launch(
    binary: &'static str,
    service: &str,
    listen: fn(&WardenConfig) -> (&str, &str),
) -> anyhow::Result<Launched> {
    let args = ServiceArgs::parse();
    let config = WardenConfig::load(args.config.as_deref())?;
    let telemetry = warden_telemetry::init_tracing(binary, &config.telemetry)?;
    crate::auth::set_client_token(&config.auth.token);
    let tokens = crate::auth::Tokens::new(&config.auth.tokens);
    // Announced before the gRPC address, which supervisors take as "started".
    warden_telemetry::metrics::start(service, args.metrics_listen.as_deref(), &config.telemetry.metrics_listen).await?;
    let (tcp, unix) = listen(&config);
    let unix = match unix {
        "" => None,
        path => Some(crate::bind_unix(path).await?),
    };
    let tcp = crate::bind(tcp).await?;
    if let Some(socket) = &unix {
        tracing::info!(socket = %socket.path().display(), "also serving on a Unix domain socket");
    }
    // The TCP address last: supervisors take it as "started".
    crate::announce(service, tcp.local_addr()?);
    Ok(Launched { config, listener: crate::Listeners { tcp, unix }, tokens, telemetry })
}
