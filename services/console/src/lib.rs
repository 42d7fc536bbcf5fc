//! The Warden console: a single-page web app and the small HTTP JSON API behind it, served by
//! Warden itself (`warden console`, and beside `warden dev`).
//!
//! The console holds **no authority of its own**. Every API request carries the caller's bearer
//! token, which the console forwards unchanged to the mesh's gRPC services (Runs, Ledger,
//! Policy's Approvals and Capabilities); the mesh's own authorization decides what the token may
//! see and do, and an approval resolved here is resolved as the token's person. The console
//! keeps no session, no cookie and no token: the page keeps the token in `sessionStorage` and
//! sends it as `Authorization: Bearer` with `fetch`.
//!
//! Live updates are Server-Sent Events read with `fetch` and a stream reader (an `EventSource`
//! cannot send the `Authorization` header): a run's events follow `Ledger.StreamEvents`, the
//! approval inbox follows `Approvals.Watch`. The runs list polls every few seconds.
//!
//! The static assets (hand-written HTML, CSS and JavaScript, no build step) are compiled into the
//! binary, so serving the console needs nothing but the Rust toolchain.

pub mod api;
pub mod args;
pub mod assets;
pub mod error;
pub mod guard;
pub mod input;
pub mod live;
pub mod mesh;
pub mod views;

use std::future::Future;
use std::net::SocketAddr;

use axum::Router;
use tokio::net::TcpListener;

pub use error::ApiError;
pub use mesh::MeshEndpoints;

/// Largest request body the API reads (approvals' reasons, capability scopes): 64 KiB.
pub const MAX_BODY_BYTES: usize = 64 * 1024;

/// How the console is reached and where the mesh is.
#[derive(Clone, Debug)]
pub struct ConsoleConfig {
    pub mesh: MeshEndpoints,
    /// The address the console listens on: when it is a loopback address, requests must name a
    /// loopback host (a page on another site cannot reach the console by rebinding its name).
    pub listen: SocketAddr,
}

/// The console's routes: the app, its assets and the JSON API, behind the security layer.
pub fn router(config: &ConsoleConfig) -> Result<Router, ApiError> {
    let mesh = mesh::Mesh::new(&config.mesh)?;
    let app = Router::new().merge(assets::routes()).nest("/api", api::routes(mesh));
    Ok(guard::secure(app, config.listen))
}

/// Serves the console on `listener` until `shutdown` resolves.
pub async fn serve(
    listener: TcpListener,
    mesh: MeshEndpoints,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let listen = listener.local_addr()?;
    let app = router(&ConsoleConfig { mesh, listen }).map_err(|e| std::io::Error::other(e.message))?;
    tracing::info!(%listen, "console serving");
    axum::serve(listener, app).with_graceful_shutdown(shutdown).await
}

#[cfg(test)]
mod tests {
    use axum::body::Body;
    use axum::http::{Request, StatusCode, header};
    use tower::ServiceExt;

    use super::*;

    /// A console whose mesh is nowhere: these requests are answered before the mesh is asked.
    fn app() -> Router {
        let listen: SocketAddr = "127.0.0.1:7180".parse().expect("address");
        router(&ConsoleConfig { mesh: MeshEndpoints::single("http://127.0.0.1:9"), listen }).expect("router")
    }

    async fn send(request: Request<Body>) -> (StatusCode, axum::http::HeaderMap, serde_json::Value) {
        let response = app().oneshot(request).await.expect("answer");
        let (parts, body) = response.into_parts();
        let bytes = axum::body::to_bytes(body, MAX_BODY_BYTES).await.expect("body");
        let json = serde_json::from_slice(&bytes).unwrap_or(serde_json::Value::Null);
        (parts.status, parts.headers, json)
    }

    fn get(uri: &str, token: Option<&str>) -> Request<Body> {
        let mut r = Request::get(uri).header(header::HOST, "127.0.0.1:7180");
        if let Some(t) = token {
            r = r.header(header::AUTHORIZATION, format!("Bearer {t}"));
        }
        r.body(Body::empty()).expect("request")
    }

    #[tokio::test]
    async fn the_page_and_every_answer_carry_the_security_headers() {
        let (status, headers, _) = send(get("/", None)).await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(headers[header::CONTENT_SECURITY_POLICY], guard::CONTENT_SECURITY_POLICY);
        assert_eq!(headers[header::X_CONTENT_TYPE_OPTIONS], "nosniff");
        assert_eq!(headers[header::REFERRER_POLICY], "no-referrer");
        let (status, headers, body) = send(get("/api/runs?tenant=acme", None)).await;
        assert_eq!((status, body["error"]["code"].as_str()), (StatusCode::UNAUTHORIZED, Some("unauthenticated")));
        assert_eq!(headers[header::CONTENT_SECURITY_POLICY], guard::CONTENT_SECURITY_POLICY);
        assert_eq!(headers[header::CACHE_CONTROL], "no-store");
    }

    #[tokio::test]
    async fn bad_input_is_refused_naming_the_field_before_the_mesh_is_asked() {
        for (uri, field) in [
            ("/api/runs?tenant=no%20spaces", "tenant"),
            ("/api/runs?tenant=acme&status=done", "status"),
            ("/api/runs?tenant=acme&page_size=0", "page_size"),
            ("/api/runs?tenant=acme&bogus=1", "bogus"),
            ("/api/runs/..%2F..?tenant=acme", "run_id"),
            ("/api/runs/r1", "tenant"),
            ("/api/approvals?tenant=acme&state=maybe", "state"),
            ("/api/runs/r1/events?tenant=acme&since_seq=-1", "since_seq"),
        ] {
            let (status, _, body) = send(get(uri, Some("t"))).await;
            assert_eq!(status, StatusCode::BAD_REQUEST, "{uri}: {body}");
            assert_eq!(body["error"]["field"].as_str(), Some(field), "{uri}: {body}");
        }
        let (status, _, body) = send(get("/api/nothing", Some("t"))).await;
        assert_eq!((status, body["error"]["code"].as_str()), (StatusCode::NOT_FOUND, Some("not_found")));
    }

    #[tokio::test]
    async fn writes_need_json_within_the_size_bound() {
        let post = |body: Vec<u8>, content_type: &str| {
            Request::post("/api/approvals/apr-1/approve")
                .header(header::HOST, "127.0.0.1:7180")
                .header(header::AUTHORIZATION, "Bearer t")
                .header(header::CONTENT_TYPE, content_type)
                .body(Body::from(body))
                .expect("request")
        };
        let (status, _, _) = send(post(b"tenant=acme".to_vec(), "text/plain")).await;
        assert_eq!(status, StatusCode::UNSUPPORTED_MEDIA_TYPE);
        let (status, _, _) = send(post(vec![b' '; MAX_BODY_BYTES + 1], "application/json")).await;
        assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
        let (status, _, body) = send(post(br#"{"tenant":"acme"}"#.to_vec(), "application/json")).await;
        assert_eq!((status, body["error"]["field"].as_str()), (StatusCode::BAD_REQUEST, Some("reason")));
    }

    #[tokio::test]
    async fn a_mesh_that_is_down_is_503() {
        let (status, _, body) = send(get("/api/runs?tenant=acme", Some("t"))).await;
        assert_eq!(
            (status, body["error"]["code"].as_str()),
            (StatusCode::SERVICE_UNAVAILABLE, Some("unavailable")),
            "{body}"
        );
    }
}
