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

/// How a service binary's Tokio runtime runs its tasks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flavor {
    /// Every task, the I/O driver and the timers on the thread that runs `main`.
    CurrentThread,
    /// Tokio's work-stealing scheduler, `TOKIO_WORKER_THREADS` workers (by default one per
    /// core).
    MultiThread,
}

/// The runtime flavor for `WARDEN_RUNTIME` (`current`, `multi`) and `TOKIO_WORKER_THREADS` as
/// set in the environment (`None`: unset), on a machine of `cores` cores.
///
/// Without `WARDEN_RUNTIME`, a service given one worker (`TOKIO_WORKER_THREADS=1`, or a
/// machine or CPU quota of one core) runs on the current-thread runtime: measured on a
/// 2-core machine with the five services sharing it, the production batch's CPU per step
/// was about a sixth lower than with the multi-threaded scheduler restricted to one worker
/// (BENCHMARKS.md, 2026-12-07), and the two run the same code. More workers keep the
/// multi-threaded scheduler, whose point they are.
pub fn flavor(runtime: Option<&str>, workers: Option<&str>, cores: usize) -> Result<Flavor, String> {
    match runtime.map(str::trim) {
        Some("current") => return Ok(Flavor::CurrentThread),
        Some("multi") => return Ok(Flavor::MultiThread),
        Some("") | None => {}
        Some(other) => return Err(format!("WARDEN_RUNTIME must be 'current' or 'multi', not '{other}'")),
    }
    let workers = match workers {
        None => cores,
        Some(v) => match v.trim().parse::<usize>() {
            Ok(n) if n > 0 => n,
            _ => return Err(format!("TOKIO_WORKER_THREADS must be a positive integer, not '{v}'")),
        },
    };
    Ok(if workers == 1 { Flavor::CurrentThread } else { Flavor::MultiThread })
}

/// Runs a service binary's `main` future on the runtime [`flavor`] picks from the
/// environment, and returns what it returns.
pub fn run<F>(main: F) -> anyhow::Result<()>
where
    F: std::future::Future<Output = anyhow::Result<()>>,
{
    let var = |k: &str| std::env::var(k).ok();
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    let flavor = flavor(var("WARDEN_RUNTIME").as_deref(), var("TOKIO_WORKER_THREADS").as_deref(), cores)
        .map_err(anyhow::Error::msg)?;
    let mut builder = match flavor {
        Flavor::CurrentThread => tokio::runtime::Builder::new_current_thread(),
        // Reads TOKIO_WORKER_THREADS itself (checked above).
        Flavor::MultiThread => tokio::runtime::Builder::new_multi_thread(),
    };
    builder.enable_all().build()?.block_on(main)
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

#[cfg(test)]
mod tests {
    use super::{Flavor, flavor};

    #[test]
    fn one_worker_runs_on_the_current_thread_and_more_on_the_scheduler() {
        assert_eq!(flavor(None, None, 1), Ok(Flavor::CurrentThread));
        assert_eq!(flavor(None, None, 2), Ok(Flavor::MultiThread));
        assert_eq!(flavor(None, Some("1"), 8), Ok(Flavor::CurrentThread));
        assert_eq!(flavor(None, Some(" 1 "), 8), Ok(Flavor::CurrentThread));
        assert_eq!(flavor(None, Some("2"), 1), Ok(Flavor::MultiThread));
        assert_eq!(flavor(Some(""), Some("1"), 8), Ok(Flavor::CurrentThread));
        // WARDEN_RUNTIME wins either way.
        assert_eq!(flavor(Some("multi"), Some("1"), 1), Ok(Flavor::MultiThread));
        assert_eq!(flavor(Some("current"), Some("4"), 4), Ok(Flavor::CurrentThread));
    }

    #[test]
    fn a_setting_that_names_no_flavor_or_count_is_an_error_naming_the_variable() {
        for bad in ["0", "-1", "two", ""] {
            let e = flavor(None, Some(bad), 2).expect_err(bad);
            assert!(e.contains("TOKIO_WORKER_THREADS"), "{e}");
        }
        let e = flavor(Some("fast"), None, 2).expect_err("fast");
        assert!(e.contains("WARDEN_RUNTIME"), "{e}");
    }
}
