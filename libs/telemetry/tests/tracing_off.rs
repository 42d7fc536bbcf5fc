//! With tracing off (no OTLP endpoint) the write path's spans do not exist: every span macro
//! yields a disabled span, so a request pays one cached callsite check per span and nothing
//! more. Its own test binary, because it installs the process-wide subscriber.

#[test]
fn without_an_endpoint_no_span_is_created() {
    // SAFETY: the only thread of this test binary that reads the environment is this one,
    // before tracing is set up.
    #[allow(unsafe_code)]
    unsafe {
        std::env::remove_var("OTEL_EXPORTER_OTLP_ENDPOINT");
        std::env::remove_var("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT");
        std::env::set_var("RUST_LOG", "info");
    }
    let _guard =
        warden_telemetry::init_tracing("test", &warden_telemetry::TelemetryConfig::default()).expect("tracing set up");
    let step = tracing::info_span!(target: "warden_executor", "step", step_id = "a");
    assert!(step.is_disabled(), "an info span of Warden's own exists with tracing off");
    let inner = tracing::info_span!("ledger.append", events = 3);
    assert!(inner.is_disabled());
    // Log lines still go out at the filter's level.
    assert!(tracing::enabled!(tracing::Level::INFO));
}
