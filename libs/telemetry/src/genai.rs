//! The model-call span, with the OpenTelemetry GenAI semantic conventions (`gen_ai.*`), so
//! a model call reads the same in Warden's traces as in any GenAI-aware backend.
//!
//! ```no_run
//! use warden_telemetry::genai;
//! # async fn call_model() -> (String, String, u64, u64) { Default::default() }
//! # async fn example() {
//! let span = genai::model_call_span("anthropic", "claude-sonnet-4");
//! // Awaited inside the span: the HTTP call's headers get its `traceparent` through
//! // `warden_telemetry::context::inject_http`.
//! let (response_model, response_id, input, output) =
//!     tracing::Instrument::instrument(call_model(), span.clone()).await;
//! genai::record_response(&span, &response_model, &response_id, input, output);
//! # }
//! ```

/// A client span for one model call: `gen_ai.operation.name` = `chat`, `gen_ai.system` (the
/// provider: `openai`, `anthropic`, …) and `gen_ai.request.model` set; the response's model,
/// id and token usage are recorded later with [`record_response`]. Named `chat <model>` as
/// the conventions ask. Disabled (free) when the process exports no traces.
pub fn model_call_span(system: &str, request_model: &str) -> tracing::Span {
    model_call_span_for("chat", system, request_model)
}

/// [`model_call_span`] for another operation (`text_completion`, `embeddings`, …).
pub fn model_call_span_for(operation: &str, system: &str, request_model: &str) -> tracing::Span {
    tracing::info_span!(
        "gen_ai.model_call",
        otel.name = %format_args!("{operation} {request_model}"),
        otel.kind = "client",
        otel.status_code = tracing::field::Empty,
        gen_ai.operation.name = %operation,
        gen_ai.system = %system,
        gen_ai.provider.name = %system,
        gen_ai.request.model = %request_model,
        gen_ai.response.model = tracing::field::Empty,
        gen_ai.response.id = tracing::field::Empty,
        gen_ai.usage.input_tokens = tracing::field::Empty,
        gen_ai.usage.output_tokens = tracing::field::Empty,
        error.type = tracing::field::Empty,
    )
}

/// Records what the model answered: the model that answered, the response id and the token
/// usage.
pub fn record_response(
    span: &tracing::Span,
    response_model: &str,
    response_id: &str,
    input_tokens: u64,
    output_tokens: u64,
) {
    span.record("gen_ai.response.model", response_model);
    span.record("gen_ai.response.id", response_id);
    span.record("gen_ai.usage.input_tokens", input_tokens as i64);
    span.record("gen_ai.usage.output_tokens", output_tokens as i64);
}

/// Marks the call failed with `error_type` (an HTTP status, `timeout`, the provider's code).
pub fn record_error(span: &tracing::Span, error_type: &str) {
    span.record("error.type", error_type);
    span.record("otel.status_code", "ERROR");
}

#[cfg(test)]
mod tests {
    use opentelemetry::trace::TracerProvider as _;
    use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider};
    use tracing_subscriber::layer::SubscriberExt;

    /// The span an exporter receives carries the GenAI attributes, the later ones included.
    #[test]
    fn a_model_call_span_carries_the_genai_attributes() {
        let exporter = InMemorySpanExporter::default();
        let provider = SdkTracerProvider::builder().with_simple_exporter(exporter.clone()).build();
        let subscriber =
            tracing_subscriber::registry().with(tracing_opentelemetry::layer().with_tracer(provider.tracer("test")));
        tracing::subscriber::with_default(subscriber, || {
            let span = super::model_call_span("anthropic", "claude-sonnet-4");
            super::record_response(&span, "claude-sonnet-4-20250514", "msg_01", 120, 45);
        });
        provider.force_flush().expect("flush");
        let spans = exporter.get_finished_spans().expect("spans");
        assert_eq!(spans.len(), 1);
        let s = &spans[0];
        assert_eq!(s.name, "chat claude-sonnet-4");
        assert_eq!(s.span_kind, opentelemetry::trace::SpanKind::Client);
        let attr = |k: &str| {
            s.attributes.iter().find(|kv| kv.key.as_str() == k).map(|kv| kv.value.to_string()).unwrap_or_default()
        };
        assert_eq!(attr("gen_ai.system"), "anthropic");
        assert_eq!(attr("gen_ai.operation.name"), "chat");
        assert_eq!(attr("gen_ai.request.model"), "claude-sonnet-4");
        assert_eq!(attr("gen_ai.response.model"), "claude-sonnet-4-20250514");
        assert_eq!(attr("gen_ai.response.id"), "msg_01");
        assert_eq!(attr("gen_ai.usage.input_tokens"), "120");
        assert_eq!(attr("gen_ai.usage.output_tokens"), "45");
    }
}
