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
    /// Tokio's work-stealing scheduler.
    MultiThread,
}

/// The runtime for `WARDEN_RUNTIME` (`current`, `multi`) and `TOKIO_WORKER_THREADS` as set in
/// the environment (`None`: unset), on a machine of `cores` cores (what the process may use:
/// its affinity and CPU quota), for a binary that prefers `one_worker` when it has one worker:
/// the flavor, and the workers of a multi-threaded one.
///
/// Without `WARDEN_RUNTIME`, a service given one worker (`TOKIO_WORKER_THREADS=1`, or one
/// core) runs on the runtime it prefers for that case. The mesh's services prefer the
/// current-thread runtime: measured on a 2-core machine with the five services sharing it,
/// the production batch's CPU per step was about a sixth lower than with the multi-threaded
/// scheduler restricted to one worker (BENCHMARKS.md, 2026-12-07), and the code is the same.
/// The demo tool host keeps the scheduler: a call that waits on its state file hands the
/// others to another thread (`block_in_place`), which one thread could not. More workers
/// keep the scheduler, whose point they are.
fn flavor(
    runtime: Option<&str>,
    workers: Option<&str>,
    cores: usize,
    one_worker: Flavor,
) -> Result<(Flavor, usize), String> {
    let workers = match workers {
        None => cores.max(1),
        Some(v) => match v.trim().parse::<usize>() {
            Ok(n) if n > 0 => n,
            _ => return Err(format!("TOKIO_WORKER_THREADS must be a positive integer, not '{v}'")),
        },
    };
    let flavor = match runtime.map(str::trim) {
        Some("current") => Flavor::CurrentThread,
        Some("multi") => Flavor::MultiThread,
        Some("") | None if workers == 1 => one_worker,
        Some("") | None => Flavor::MultiThread,
        Some(other) => return Err(format!("WARDEN_RUNTIME must be 'current' or 'multi', not '{other}'")),
    };
    Ok((flavor, workers))
}

/// Runs a service binary's `main` future on the runtime [`flavor`] picks from the
/// environment (`one_worker`: the binary's preference when it has one worker), and returns
/// what it returns. A setting that names no runtime or worker count is an error, not a panic.
fn run<F>(one_worker: Flavor, main: F) -> anyhow::Result<()>
where
    F: std::future::Future<Output = anyhow::Result<()>>,
{
    let var = |k: &str| match std::env::var(k) {
        Ok(v) => Ok(Some(v)),
        Err(std::env::VarError::NotPresent) => Ok(None),
        Err(std::env::VarError::NotUnicode(_)) => Err(anyhow::anyhow!("{k} is not valid UTF-8")),
    };
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    let (runtime, workers) = (var("WARDEN_RUNTIME")?, var("TOKIO_WORKER_THREADS")?);
    let (flavor, workers) =
        flavor(runtime.as_deref(), workers.as_deref(), cores, one_worker).map_err(anyhow::Error::msg)?;
    let mut builder = match flavor {
        Flavor::CurrentThread => tokio::runtime::Builder::new_current_thread(),
        Flavor::MultiThread => {
            let mut b = tokio::runtime::Builder::new_multi_thread();
            // Given, so that Tokio does not read (and panic on) the variable itself.
            b.worker_threads(workers);
            b
        }
    };
    builder.enable_all().build()?.block_on(main)
}

/// A service binary's whole `main`: on the runtime [`run`] picks, [`launch`] `binary` for the
/// section `service`, serve with `serve` until the process is asked to stop, then export the
/// last spans (off the runtime's thread: `Telemetry::shutdown`) and return what serving
/// returned.
pub fn main<S, Fut>(
    binary: &'static str,
    service: &'static str,
    listen: fn(&WardenConfig) -> (&str, &str),
    one_worker: Flavor,
    serve: S,
) -> anyhow::Result<()>
where
    S: FnOnce(WardenConfig, crate::auth::Tokens, crate::Listeners) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<()>>,
{
    run(one_worker, async move {
        let Launched { config, listener, tokens, telemetry } = launch(binary, service, listen).await?;
        let served = serve(config, tokens, listener).await;
        // Last: the spans of the stop included.
        telemetry.shutdown().await;
        served
    })
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
    use super::Flavor::{CurrentThread as Current, MultiThread as Multi};
    use super::flavor;

    #[test]
    fn one_worker_runs_on_the_runtime_the_binary_prefers_and_more_on_the_scheduler() {
        assert_eq!(flavor(None, None, 1, Current), Ok((Current, 1)));
        assert_eq!(flavor(None, None, 1, Multi), Ok((Multi, 1)));
        assert_eq!(flavor(None, None, 2, Current), Ok((Multi, 2)));
        assert_eq!(flavor(None, Some("1"), 8, Current), Ok((Current, 1)));
        assert_eq!(flavor(None, Some(" 1 "), 8, Current), Ok((Current, 1)));
        assert_eq!(flavor(None, Some(" 2 "), 1, Current), Ok((Multi, 2)));
        assert_eq!(flavor(Some(""), Some("1"), 8, Current), Ok((Current, 1)));
        // WARDEN_RUNTIME wins either way.
        assert_eq!(flavor(Some("multi"), Some("1"), 1, Current), Ok((Multi, 1)));
        assert_eq!(flavor(Some("current"), Some("4"), 4, Multi), Ok((Current, 4)));
    }

    #[test]
    fn a_setting_that_names_no_flavor_or_count_is_an_error_naming_the_variable() {
        for runtime in [None, Some("multi"), Some("current")] {
            for bad in ["0", "-1", "two", ""] {
                let e = flavor(runtime, Some(bad), 2, Current).expect_err(bad);
                assert!(e.contains("TOKIO_WORKER_THREADS"), "{e}");
            }
        }
        let e = flavor(Some("fast"), None, 2, Current).expect_err("fast");
        assert!(e.contains("WARDEN_RUNTIME"), "{e}");
    }
}
