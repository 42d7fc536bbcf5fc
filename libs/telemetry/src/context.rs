//! W3C trace context (`traceparent`, `tracestate`) in and out of gRPC metadata and HTTP
//! headers, and the W3C ids of a span. Everything here is a no-op while the process exports
//! no traces (see [`crate::exporting`]).

use opentelemetry::propagation::{Extractor, Injector};
use opentelemetry::trace::TraceContextExt;
use tracing_opentelemetry::OpenTelemetrySpanExt;

/// The W3C ids of a span: 32 and 16 lower-case hex characters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceIds {
    pub trace_id: String,
    pub span_id: String,
}

/// The W3C ids of `span`, when the process exports traces and the span is recorded.
pub fn ids(span: &tracing::Span) -> Option<TraceIds> {
    if !crate::exporting() || span.is_disabled() {
        return None;
    }
    let cx = span.context();
    let sc = cx.span().span_context().clone();
    sc.is_valid().then(|| TraceIds { trace_id: sc.trace_id().to_string(), span_id: sc.span_id().to_string() })
}

/// The W3C ids of the current span (see [`ids`]).
pub fn current_ids() -> Option<TraceIds> {
    ids(&tracing::Span::current())
}

/// Links `span` to `other` (work done once for several requests, such as a ledger batch
/// commit, names each request it served).
pub fn link(span: &tracing::Span, other: &tracing::Span) {
    if !crate::exporting() || span.is_disabled() || other.is_disabled() {
        return;
    }
    let sc = other.context().span().span_context().clone();
    if sc.is_valid() {
        span.add_link(sc);
    }
}

struct Metadata<'a>(&'a mut tonic::metadata::MetadataMap);

impl Injector for Metadata<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(k), Ok(v)) = (
            tonic::metadata::MetadataKey::from_bytes(key.as_bytes()),
            tonic::metadata::MetadataValue::try_from(value.as_str()),
        ) {
            self.0.insert(k, v);
        }
    }
}

struct Headers<'a>(&'a http::HeaderMap);

impl Extractor for Headers<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(|k| k.as_str()).collect()
    }
}

struct HeadersMut<'a>(&'a mut http::HeaderMap);

impl Injector for HeadersMut<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(k), Ok(v)) = (http::HeaderName::from_bytes(key.as_bytes()), http::HeaderValue::from_str(&value)) {
            self.0.insert(k, v);
        }
    }
}

/// Writes the current span's context into an outgoing gRPC request's metadata (every Warden
/// client channel does this, see `warden_grpc::auth::Bearer`).
pub fn inject(metadata: &mut tonic::metadata::MetadataMap) {
    if !crate::exporting() {
        return;
    }
    let cx = tracing::Span::current().context();
    opentelemetry::global::get_text_map_propagator(|p| p.inject_context(&cx, &mut Metadata(metadata)));
}

/// Writes the current span's context into an outgoing HTTP request's headers (for model
/// calls and other HTTP clients).
pub fn inject_http(headers: &mut http::HeaderMap) {
    if !crate::exporting() {
        return;
    }
    let cx = tracing::Span::current().context();
    opentelemetry::global::get_text_map_propagator(|p| p.inject_context(&cx, &mut HeadersMut(headers)));
}

/// The caller's context carried by an incoming request's headers (empty when there is none).
pub fn extract(headers: &http::HeaderMap) -> opentelemetry::Context {
    opentelemetry::global::get_text_map_propagator(|p| p.extract(&Headers(headers)))
}

/// Makes `span` a child of the context `headers` carry, when they carry one (a client's
/// `traceparent`), and records its `trace_id` field (if declared) so log lines inside it name
/// the trace.
pub fn adopt(span: &tracing::Span, headers: &http::HeaderMap) {
    if !crate::exporting() || span.is_disabled() {
        return;
    }
    let parent = extract(headers);
    if parent.span().span_context().is_valid() {
        let _ = span.set_parent(parent);
    }
    record_trace_id(span);
}

/// Records `span`'s own trace id in its `trace_id` field (declared `Empty` at creation), so
/// log lines inside it carry the id of the trace they belong to.
pub fn record_trace_id(span: &tracing::Span) {
    if let Some(ids) = ids(span) {
        span.record("trace_id", ids.trace_id.as_str());
    }
}
