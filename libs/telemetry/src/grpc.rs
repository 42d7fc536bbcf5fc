//! The server side of every gRPC hop: a tower layer that gives each request a server span
//! whose parent is the caller's W3C context, and counts it (requests, errors, duration: the
//! RED metrics). The client side is an interceptor on every Warden channel
//! (`warden_grpc::auth::Bearer`, which calls [`crate::context::inject`]).

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Instant;

use tracing::Instrument;

/// Wraps a gRPC server's routes (see `warden_grpc::serve`).
#[derive(Clone, Copy, Debug, Default)]
pub struct ServerLayer;

impl<S> tower::Layer<S> for ServerLayer {
    type Service = ServerService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        ServerService { inner }
    }
}

#[derive(Clone, Debug)]
pub struct ServerService<S> {
    inner: S,
}

/// `/warden.v1.Ledger/AppendEvents` → (`warden.v1.Ledger`, `AppendEvents`).
fn split_path(path: &str) -> (&str, &str) {
    path.trim_start_matches('/').split_once('/').unwrap_or(("unknown", "unknown"))
}

/// The gRPC status code of a response: `grpc-status` in its headers (a trailers-only
/// response: every unary error); otherwise 0 (a status in the trailers, after a body, is a
/// success for unary calls — streams that fail midway are counted as their start answered).
fn status_code<B>(r: &http::Response<B>) -> u8 {
    r.headers().get("grpc-status").and_then(|v| v.to_str().ok()).and_then(|v| v.parse().ok()).unwrap_or(0)
}

/// Names of gRPC status codes, the `code` label's values.
fn code_name(code: u8) -> &'static str {
    match code {
        0 => "OK",
        1 => "CANCELLED",
        2 => "UNKNOWN",
        3 => "INVALID_ARGUMENT",
        4 => "DEADLINE_EXCEEDED",
        5 => "NOT_FOUND",
        6 => "ALREADY_EXISTS",
        7 => "PERMISSION_DENIED",
        8 => "RESOURCE_EXHAUSTED",
        9 => "FAILED_PRECONDITION",
        10 => "ABORTED",
        11 => "OUT_OF_RANGE",
        12 => "UNIMPLEMENTED",
        13 => "INTERNAL",
        14 => "UNAVAILABLE",
        15 => "DATA_LOSS",
        16 => "UNAUTHENTICATED",
        _ => "UNKNOWN",
    }
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

impl<S, ReqBody, ResBody> tower::Service<http::Request<ReqBody>> for ServerService<S>
where
    S: tower::Service<http::Request<ReqBody>, Response = http::Response<ResBody>> + Send,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = BoxFuture<Result<S::Response, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<ReqBody>) -> Self::Future {
        let started = Instant::now();
        let path = req.uri().path().to_string();
        let span = if crate::exporting() {
            let (service, method) = split_path(&path);
            let span = tracing::info_span!(
                "rpc",
                otel.name = %path,
                otel.kind = "server",
                otel.status_code = tracing::field::Empty,
                rpc.system = "grpc",
                rpc.service = %service,
                rpc.method = %method,
                rpc.grpc.status_code = tracing::field::Empty,
                trace_id = tracing::field::Empty,
            );
            crate::context::adopt(&span, req.headers());
            span
        } else {
            tracing::Span::none()
        };
        let future = span.in_scope(|| self.inner.call(req));
        let recorded = span.clone();
        Box::pin(
            async move {
                let result = future.await;
                let code = match &result {
                    Ok(r) => status_code(r),
                    Err(_) => 2,
                };
                if !recorded.is_disabled() {
                    recorded.record("rpc.grpc.status_code", code as i64);
                    // The semantic conventions' server errors; the rest are the caller's.
                    if matches!(code, 2 | 4 | 12 | 13 | 14 | 15) {
                        recorded.record("otel.status_code", "ERROR");
                    }
                }
                // An unknown method names whatever a caller sent: never a label.
                let (service, method) = if code == 12 { ("unknown", "unknown") } else { split_path(&path) };
                crate::metrics::rpc_served(service, method, code_name(code), started.elapsed());
                result
            }
            .instrument(span),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_split_into_service_and_method() {
        assert_eq!(split_path("/warden.v1.Ledger/AppendEvents"), ("warden.v1.Ledger", "AppendEvents"));
        assert_eq!(split_path("/nonsense"), ("unknown", "unknown"));
    }

    #[test]
    fn a_trailers_only_error_is_read_from_the_headers() {
        let ok = http::Response::new(());
        assert_eq!(status_code(&ok), 0);
        let mut denied = http::Response::new(());
        denied.headers_mut().insert("grpc-status", http::HeaderValue::from_static("7"));
        assert_eq!(code_name(status_code(&denied)), "PERMISSION_DENIED");
    }
}
