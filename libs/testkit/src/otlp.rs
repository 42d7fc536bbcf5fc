//! A real OTLP trace receiver for tests and benchmarks, built on the official OTLP protobuf
//! definitions (`opentelemetry-proto`): `TraceService/Export` over gRPC and `POST /v1/traces`
//! over HTTP/protobuf, each on a free loopback port. (No package registry reachable here ships
//! an OpenTelemetry Collector with an OTLP receiver.)

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{TraceService, TraceServiceServer};
use opentelemetry_proto::tonic::collector::trace::v1::{ExportTraceServiceRequest, ExportTraceServiceResponse};
use opentelemetry_proto::tonic::common::v1::{AnyValue, KeyValue, any_value};
use prost::Message;

/// One span as received, ids in lower-case hex.
#[derive(Debug, Clone, PartialEq)]
pub struct ReceivedSpan {
    /// `service.name` of the resource that sent it.
    pub service: String,
    pub name: String,
    pub trace_id: String,
    pub span_id: String,
    /// Empty for a root span.
    pub parent_span_id: String,
    /// OTLP `SpanKind`: 1 internal, 2 server, 3 client.
    pub kind: i32,
    pub attributes: BTreeMap<String, String>,
    /// `(trace_id, span_id)` of each linked span.
    pub links: Vec<(String, String)>,
    /// When it started and ended, in nanoseconds since the Unix epoch.
    pub start_unix_nano: u64,
    pub end_unix_nano: u64,
}

impl ReceivedSpan {
    pub fn attr(&self, key: &str) -> Option<&str> {
        self.attributes.get(key).map(String::as_str)
    }

    /// One JSON object: for timelines read by other tools.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "service": self.service, "name": self.name, "trace_id": self.trace_id,
            "span_id": self.span_id, "parent_span_id": self.parent_span_id, "kind": self.kind,
            "attributes": self.attributes, "start_unix_nano": self.start_unix_nano,
            "end_unix_nano": self.end_unix_nano,
        })
    }
}

fn value_text(v: &Option<AnyValue>) -> String {
    match v.as_ref().and_then(|v| v.value.as_ref()) {
        Some(any_value::Value::StringValue(s)) => s.clone(),
        Some(any_value::Value::IntValue(i)) => i.to_string(),
        Some(any_value::Value::DoubleValue(d)) => d.to_string(),
        Some(any_value::Value::BoolValue(b)) => b.to_string(),
        Some(other) => format!("{other:?}"),
        None => String::new(),
    }
}

fn attributes(kvs: &[KeyValue]) -> BTreeMap<String, String> {
    kvs.iter().map(|kv| (kv.key.clone(), value_text(&kv.value))).collect()
}

/// What the receiver got: every span (when kept) and a count.
#[derive(Clone, Default)]
struct Sink {
    spans: Arc<Mutex<Vec<ReceivedSpan>>>,
    count: Arc<AtomicU64>,
    keep: bool,
}

impl Sink {
    fn take(&self, request: ExportTraceServiceRequest) {
        let mut received = Vec::new();
        for rs in request.resource_spans {
            let resource = rs.resource.map(|r| attributes(&r.attributes)).unwrap_or_default();
            let service = resource.get("service.name").cloned().unwrap_or_default();
            for ss in rs.scope_spans {
                for s in ss.spans {
                    received.push(ReceivedSpan {
                        service: service.clone(),
                        name: s.name,
                        trace_id: hex::encode(&s.trace_id),
                        span_id: hex::encode(&s.span_id),
                        parent_span_id: hex::encode(&s.parent_span_id),
                        kind: s.kind,
                        attributes: attributes(&s.attributes),
                        links: s.links.iter().map(|l| (hex::encode(&l.trace_id), hex::encode(&l.span_id))).collect(),
                        start_unix_nano: s.start_time_unix_nano,
                        end_unix_nano: s.end_time_unix_nano,
                    });
                }
            }
        }
        self.count.fetch_add(received.len() as u64, Ordering::Relaxed);
        if self.keep {
            self.spans.lock().unwrap_or_else(|p| p.into_inner()).extend(received);
        }
    }
}

#[tonic::async_trait]
impl TraceService for Sink {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        self.take(request.into_inner());
        Ok(tonic::Response::new(ExportTraceServiceResponse { partial_success: None }))
    }
}

/// A running receiver; it stops when dropped.
pub struct OtlpReceiver {
    /// For `OTEL_EXPORTER_OTLP_PROTOCOL=grpc`.
    pub grpc_endpoint: String,
    /// For `OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf` (the base URL; exporters add `/v1/traces`).
    pub http_endpoint: String,
    sink: Sink,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for OtlpReceiver {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

impl OtlpReceiver {
    /// Starts both endpoints on free loopback ports, keeping every span received.
    pub async fn start() -> anyhow::Result<OtlpReceiver> {
        Self::start_on("127.0.0.1:0", "127.0.0.1:0", true).await
    }

    /// Starts on the given addresses; `keep: false` only counts (long benchmarks).
    pub async fn start_on(grpc: &str, http: &str, keep: bool) -> anyhow::Result<OtlpReceiver> {
        let sink = Sink { keep, ..Sink::default() };
        let grpc_listener = tokio::net::TcpListener::bind(grpc).await?;
        let http_listener = tokio::net::TcpListener::bind(http).await?;
        let grpc_endpoint = format!("http://{}", grpc_listener.local_addr()?);
        let http_endpoint = format!("http://{}", http_listener.local_addr()?);
        let service = TraceServiceServer::new(sink.clone());
        let grpc_task = tokio::spawn(async move {
            let incoming = tonic::transport::server::TcpIncoming::from(grpc_listener);
            let _ = tonic::transport::Server::builder().add_service(service).serve_with_incoming(incoming).await;
        });
        let http_sink = sink.clone();
        let app = axum::Router::new().route(
            "/v1/traces",
            axum::routing::post(move |body: axum::body::Bytes| {
                let sink = http_sink.clone();
                async move {
                    match ExportTraceServiceRequest::decode(body) {
                        Ok(request) => {
                            sink.take(request);
                            let answer = ExportTraceServiceResponse { partial_success: None }.encode_to_vec();
                            (axum::http::StatusCode::OK, [("content-type", "application/x-protobuf")], answer)
                        }
                        Err(e) => (
                            axum::http::StatusCode::BAD_REQUEST,
                            [("content-type", "text/plain")],
                            e.to_string().into_bytes(),
                        ),
                    }
                }
            }),
        );
        let http_task = tokio::spawn(async move {
            let _ = axum::serve(http_listener, app).await;
        });
        Ok(OtlpReceiver { grpc_endpoint, http_endpoint, sink, tasks: vec![grpc_task, http_task] })
    }

    /// Every span received so far.
    pub fn spans(&self) -> Vec<ReceivedSpan> {
        self.sink.spans.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// How many spans arrived (kept or not).
    pub fn count(&self) -> u64 {
        self.sink.count.load(Ordering::Relaxed)
    }

    /// Waits, at most `limit`, until `done` holds for the spans received; returns them either way.
    pub async fn wait_for(&self, limit: Duration, done: impl Fn(&[ReceivedSpan]) -> bool) -> Vec<ReceivedSpan> {
        crate::eventually(limit, || {
            let spans = self.spans();
            let ok = done(&spans);
            async move { ok.then_some(spans) }
        })
        .await
        .unwrap_or_else(|| self.spans())
    }
}
