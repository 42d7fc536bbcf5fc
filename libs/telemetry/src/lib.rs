//! One tracing setup for every Warden binary: an env-filtered fmt layer on stderr
//! (`RUST_LOG`, default `info`), with the service name on every line.

use tracing_subscriber::EnvFilter;

/// Installs the global subscriber; a second call (several services in one process) is a no-op.
pub fn init_tracing(service: &'static str) {
    let filter = EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| EnvFilter::new("info,h2=warn,hyper=warn,sqlx=warn,tower=warn"));
    let installed = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_target(false)
        .try_init()
        .is_ok();
    if installed {
        tracing::info!(service, version = env!("CARGO_PKG_VERSION"), "tracing initialised");
    }
}
