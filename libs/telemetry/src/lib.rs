//! What every Warden binary does to be seen from outside: structured logs on stderr,
//! OpenTelemetry traces exported over OTLP, W3C trace context carried on every gRPC hop, and
//! Prometheus metrics on a `/metrics` port.
//!
//! - [`init_tracing`] installs one subscriber per process: an env-filtered fmt layer on stderr
//!   (`RUST_LOG`, default `info`) and — only when an OTLP endpoint is configured — a
//!   `tracing-opentelemetry` layer with its own filter, feeding a batch exporter.
//! - [`context`] moves W3C `traceparent`/`tracestate` in and out of gRPC metadata and HTTP
//!   headers, and reads the current span's W3C ids (receipts cite them).
//! - [`grpc::ServerLayer`] gives every gRPC request a server span whose parent is the caller's
//!   context, and counts it (the RED metrics).
//! - [`metrics`] installs the Prometheus recorder, serves `/metrics`, and names Warden's own
//!   metrics in one place.
//! - [`genai`] builds the model-call span with the OpenTelemetry GenAI semantic conventions.
//!
//! **Tracing off costs nothing per request.** Without an endpoint no OpenTelemetry layer is
//! installed and the fmt layer does not enable spans, so `info_span!` at Warden's call sites
//! is a disabled span (a cached callsite check), the server layer creates none, and no trace
//! context is read or written.

pub mod context;
pub mod genai;
pub mod grpc;
pub mod metrics;

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_subscriber::filter::{EnvFilter, FilterExt, filter_fn};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{Layer, Registry};
pub use warden_config::TelemetryConfig;

/// Whether this process exports traces (set once by [`init_tracing`]).
static EXPORTING: AtomicBool = AtomicBool::new(false);

/// Whether spans of this process are exported: callers skip work that only matters to a
/// trace (reading ids, injecting context) when they are not.
#[inline]
pub fn exporting() -> bool {
    EXPORTING.load(Ordering::Relaxed)
}

#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    #[error("invalid configuration key 'telemetry.otlp_protocol': '{0}' is not grpc or http/protobuf")]
    Protocol(String),
    #[error("OTLP exporter for {endpoint} could not be built: {source}")]
    Exporter { endpoint: String, source: opentelemetry_otlp::ExporterBuildError },
    #[error("cannot bind the metrics listener {addr}: {source}")]
    MetricsBind { addr: String, source: std::io::Error },
    #[error("the Prometheus recorder could not be installed: {0}")]
    Recorder(String),
}

/// Keeps the exporter of [`init_tracing`] alive; dropping it exports the spans still queued
/// (bounded by [`SHUTDOWN_TIMEOUT`]) and stops the exporter.
#[must_use = "dropping the guard stops trace export"]
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
}

/// The longest a shutting-down process waits for its last spans to be exported.
pub const SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(5);

impl Telemetry {
    /// Whether this guard owns an exporter (an endpoint was configured).
    pub fn exporting(&self) -> bool {
        self.provider.is_some()
    }

    /// Exports every finished span now (tests; `warden bench` between phases).
    pub fn flush(&self) {
        if let Some(p) = &self.provider
            && let Err(e) = p.force_flush()
        {
            tracing::warn!(error = %e, "trace flush failed");
        }
    }

    /// Exports the spans still queued and stops the exporter (bounded by [`SHUTDOWN_TIMEOUT`]),
    /// waiting on a blocking thread: the export may need the runtime's tasks (the gRPC
    /// exporter's channel), which a current-thread runtime could not run while its one thread
    /// waited here. A service's `main` calls this last; dropping the guard does the same
    /// waiting in place.
    pub async fn shutdown(mut self) {
        let Some(provider) = self.provider.take() else { return };
        if let Err(e) = tokio::task::spawn_blocking(move || stop(provider)).await {
            eprintln!("warning: trace export did not finish at shutdown: {e}");
        }
    }
}

/// Stops `provider`, waiting (bounded) for its batch processor's last export on its own thread.
fn stop(provider: SdkTracerProvider) {
    if let Err(e) = provider.shutdown_with_timeout(SHUTDOWN_TIMEOUT) {
        eprintln!("warning: trace export did not finish at shutdown: {e}");
    }
}

impl Drop for Telemetry {
    fn drop(&mut self) {
        if let Some(p) = self.provider.take() {
            stop(p);
        }
    }
}

/// The OTLP endpoint in effect: the configuration key, else `OTEL_EXPORTER_OTLP_ENDPOINT`
/// (or the traces-specific `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`); `None`: tracing is off.
fn endpoint(config: &TelemetryConfig) -> Option<String> {
    let env = |k: &str| std::env::var(k).ok().filter(|v| !v.trim().is_empty());
    if !config.otlp_endpoint.is_empty() {
        return Some(config.otlp_endpoint.clone());
    }
    env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT").or_else(|| env("OTEL_EXPORTER_OTLP_ENDPOINT"))
}

/// `grpc` or `http/protobuf`: the key, else `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL` /
/// `OTEL_EXPORTER_OTLP_PROTOCOL`, else `http/protobuf` (the OTLP exporter specification's default).
fn protocol(config: &TelemetryConfig) -> Result<bool, TelemetryError> {
    let env = |k: &str| std::env::var(k).ok().filter(|v| !v.trim().is_empty());
    let p = Some(config.otlp_protocol.clone())
        .filter(|p| !p.is_empty())
        .or_else(|| env("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"))
        .or_else(|| env("OTEL_EXPORTER_OTLP_PROTOCOL"))
        .unwrap_or_else(|| "http/protobuf".into());
    match p.as_str() {
        "grpc" => Ok(true),
        "http/protobuf" => Ok(false),
        other => Err(TelemetryError::Protocol(other.to_string())),
    }
}

/// Builds the batch exporter: it queues finished spans and exports them from its own thread
/// every `OTEL_BSP_SCHEDULE_DELAY` ms (default 5000) or when `OTEL_BSP_MAX_EXPORT_BATCH_SIZE`
/// spans wait; a full queue (`OTEL_BSP_MAX_QUEUE_SIZE`) drops spans rather than block a request.
/// The sampler comes from `OTEL_TRACES_SAMPLER`/`OTEL_TRACES_SAMPLER_ARG` (default
/// `parentbased_always_on`), the resource from `OTEL_SERVICE_NAME` and
/// `OTEL_RESOURCE_ATTRIBUTES`, with `service.name` defaulting to the binary's name.
fn provider(service: &str, config: &TelemetryConfig, endpoint: &str) -> Result<SdkTracerProvider, TelemetryError> {
    let grpc = protocol(config)?;
    let from_key = !config.otlp_endpoint.is_empty();
    let failed = |source| TelemetryError::Exporter { endpoint: endpoint.to_string(), source };
    let exporter = if grpc {
        let mut b = opentelemetry_otlp::SpanExporter::builder().with_tonic();
        if from_key {
            b = b.with_endpoint(endpoint);
        }
        b.build().map_err(failed)?
    } else {
        let mut b = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_protocol(opentelemetry_otlp::Protocol::HttpBinary);
        if from_key {
            // Like OTEL_EXPORTER_OTLP_ENDPOINT, the key is the collector's base URL.
            b = b.with_endpoint(format!("{}/v1/traces", endpoint.trim_end_matches('/')));
        }
        b.build().map_err(failed)?
    };
    let mut resource = opentelemetry_sdk::Resource::builder().with_attributes([
        opentelemetry::KeyValue::new("service.version", env!("CARGO_PKG_VERSION")),
        opentelemetry::KeyValue::new("service.instance.id", instance_id()),
    ]);
    if std::env::var("OTEL_SERVICE_NAME").map_or(true, |v| v.is_empty()) {
        resource = resource.with_service_name(service.to_string());
    }
    Ok(SdkTracerProvider::builder().with_batch_exporter(exporter).with_resource(resource.build()).build())
}

/// Tells replicas of one service apart: host name and process id.
fn instance_id() -> String {
    let host = std::env::var("HOSTNAME")
        .ok()
        .or_else(|| std::fs::read_to_string("/etc/hostname").ok())
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "localhost".into());
    format!("{host}:{}", std::process::id())
}

/// The default log filter (`RUST_LOG` replaces it).
const DEFAULT_FILTER: &str = "info,h2=warn,hyper=warn,sqlx=warn,tower=warn";

/// Log lines on stderr at `env_filter`'s levels. Without export this layer enables no span,
/// so no span exists at all; with export it shows the spans around each line, whose
/// `trace_id` field ties the line to its trace.
fn log_layer<S>(env_filter: EnvFilter, exporting: bool) -> impl Layer<S> + Send + Sync
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_target(false)
        .with_filter(env_filter.and(filter_fn(move |m| exporting || !m.is_span())))
}

/// Installs the process's subscriber (a second call, as when several services share one
/// process, changes nothing and exports nothing more) and, when an OTLP endpoint is set
/// (`telemetry.otlp_endpoint` or `OTEL_EXPORTER_OTLP_ENDPOINT`), the OpenTelemetry layer and
/// the W3C trace-context propagator. Call it inside the Tokio runtime: the gRPC exporter
/// needs it. Keep the guard until the process ends.
pub fn init_tracing(service: &'static str, config: &TelemetryConfig) -> Result<Telemetry, TelemetryError> {
    init_tracing_with(service, config, DEFAULT_FILTER)
}

/// [`init_tracing`] with another default log filter (`RUST_LOG` still replaces it): tools
/// that print their own report, such as `warden bench`, log warnings only.
pub fn init_tracing_with(
    service: &'static str,
    config: &TelemetryConfig,
    default_filter: &str,
) -> Result<Telemetry, TelemetryError> {
    // The workspace builds reqwest (the OTLP HTTP exporter's client) without a crypto provider
    // of its own choosing: ring, installed once per process before any client is built.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let endpoint = endpoint(config);
    let provider = match &endpoint {
        Some(e) => Some(provider(service, config, e)?),
        None => None,
    };
    let exporting = provider.is_some();
    let env_filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_filter));
    // Warden's own spans only, at info and above: library internals (h2, sqlx, tower) would
    // multiply the spans per request without telling an operator more.
    let otel = provider.as_ref().map(|p| {
        tracing_opentelemetry::layer()
            .with_tracer(p.tracer("warden"))
            .with_location(false)
            .with_threads(false)
            .with_filter(filter_fn(|m| {
                m.is_span() && m.target().starts_with("warden") && *m.level() <= tracing::Level::INFO
            }))
    });
    // Two subscriber types rather than `.with(Option<layer>)`: a `None` layer answers
    // `Interest::always()` for every callsite, which would make the registry create every
    // span on the write path even with tracing off (measured: about a quarter more CPU per
    // step in every service).
    let installed = match otel {
        Some(otel) => Registry::default().with(otel).with(log_layer(env_filter, true)).try_init().is_ok(),
        None => Registry::default().with(log_layer(env_filter, false)).try_init().is_ok(),
    };
    if !installed {
        // Another service of this process set tracing up first; its guard owns the export.
        if let Some(p) = provider {
            let _ = p.shutdown();
        }
        return Ok(Telemetry { provider: None });
    }
    if exporting {
        opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
        EXPORTING.store(true, Ordering::Relaxed);
    }
    tracing::info!(
        service,
        version = env!("CARGO_PKG_VERSION"),
        otlp_endpoint = endpoint.as_deref().unwrap_or("none"),
        "tracing initialised"
    );
    Ok(Telemetry { provider })
}
