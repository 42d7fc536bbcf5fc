//! The console's security layer, applied to every response and request.
//!
//! - **Headers**: a strict Content-Security-Policy (only this origin's own scripts, styles and
//!   connections; no inline code, no framing, no `<base>`), `X-Content-Type-Options: nosniff`,
//!   `Referrer-Policy: no-referrer`, and `Cache-Control: no-store` on the API.
//! - **CSRF**: the token travels only in the `Authorization` header, set by the page's own
//!   `fetch` — never in a cookie — so a foreign page cannot make a request that carries it.
//!   State-changing requests are refused all the same without that header, with an `Origin`
//!   (or `Sec-Fetch-Site`) naming another site, or with a body that is not `application/json`
//!   (which a plain HTML form cannot send).
//! - **DNS rebinding**: a console listening on loopback answers only requests that name a
//!   loopback host, so a foreign name pointed at 127.0.0.1 reaches nothing.

use std::net::SocketAddr;

use axum::Router;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{HeaderMap, HeaderValue, Method, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};

use crate::error::ApiError;

/// The page's policy: its own scripts, styles and API only; images from itself or `data:`.
pub const CONTENT_SECURITY_POLICY: &str = "default-src 'self'; script-src 'self'; style-src 'self'; \
     img-src 'self' data:; connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'";

#[derive(Clone, Copy)]
struct Listen {
    loopback: bool,
}

/// Wraps the app in the security layer (outermost, so every answer — errors included — gets
/// the headers) and bounds request bodies.
pub fn secure(app: Router, listen: SocketAddr) -> Router {
    let state = Listen { loopback: listen.ip().is_loopback() };
    app.layer(middleware::from_fn_with_state(state, check_request))
        // Bodies are small JSON documents; anything larger is refused before it is read.
        .layer(DefaultBodyLimit::max(crate::MAX_BODY_BYTES))
        .layer(middleware::from_fn(add_headers))
}

async fn add_headers(request: Request, next: Next) -> Response {
    let api = request.uri().path().starts_with("/api/");
    let mut response = next.run(request).await;
    let h = response.headers_mut();
    h.insert(header::CONTENT_SECURITY_POLICY, HeaderValue::from_static(CONTENT_SECURITY_POLICY));
    h.insert(header::X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    h.insert(header::REFERRER_POLICY, HeaderValue::from_static("no-referrer"));
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    h.insert("cross-origin-opener-policy", HeaderValue::from_static("same-origin"));
    if api {
        h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    }
    response
}

async fn check_request(State(listen): State<Listen>, request: Request, next: Next) -> Response {
    match refuse(listen, request.method(), request.uri().path(), request.headers()) {
        Some(e) => e.into_response(),
        None => next.run(request).await,
    }
}

/// Why a request is refused, if it is.
fn refuse(listen: Listen, method: &Method, path: &str, headers: &HeaderMap) -> Option<ApiError> {
    let host = headers.get(header::HOST).and_then(|v| v.to_str().ok()).unwrap_or_default();
    if listen.loopback && !is_loopback_host(host) {
        return Some(ApiError::forbidden(format!("host '{host}' is not this console's (it serves loopback only)")));
    }
    if !path.starts_with("/api/") {
        return None;
    }
    if bearer(headers).is_none() {
        return Some(ApiError::unauthenticated("missing 'Authorization: Bearer <token>'"));
    }
    if matches!(*method, Method::GET | Method::HEAD | Method::OPTIONS) {
        return None;
    }
    if let Some(site) = headers.get("sec-fetch-site").and_then(|v| v.to_str().ok())
        && !matches!(site, "same-origin" | "none")
    {
        return Some(ApiError::forbidden(format!("cross-site request refused (sec-fetch-site: {site})")));
    }
    if let Some(origin) = headers.get(header::ORIGIN) {
        let origin = origin.to_str().unwrap_or_default();
        if !same_origin(origin, host) {
            return Some(ApiError::forbidden(format!("origin '{origin}' is not this console's")));
        }
    }
    let json = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|v| v.trim().eq_ignore_ascii_case("application/json"));
    if !json {
        return Some(ApiError::new(
            axum::http::StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported_media_type",
            "state-changing requests take 'Content-Type: application/json'",
        ));
    }
    None
}

/// The bearer token a request carries, if any.
pub fn bearer(headers: &HeaderMap) -> Option<&str> {
    let value = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    let token = value.strip_prefix("Bearer ").or_else(|| value.strip_prefix("bearer "))?.trim();
    (!token.is_empty()).then_some(token)
}

/// `origin` (`scheme://host[:port]`) names the host the request was sent to.
fn same_origin(origin: &str, host: &str) -> bool {
    let rest = origin.strip_prefix("http://").or_else(|| origin.strip_prefix("https://"));
    matches!(rest, Some(h) if !host.is_empty() && h.eq_ignore_ascii_case(host))
}

/// `localhost`, `127.x.y.z` or `[::1]`, with or without a port.
fn is_loopback_host(host: &str) -> bool {
    let name = match host.strip_prefix('[') {
        Some(v6) => v6.split(']').next().unwrap_or_default(),
        None => host.rsplit_once(':').map_or(host, |(h, _)| h),
    };
    name.eq_ignore_ascii_case("localhost") || name.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, HeaderValue::from_str(v).expect("header value"));
        }
        h
    }

    const LOOPBACK: Listen = Listen { loopback: true };

    #[test]
    fn hosts() {
        assert!(is_loopback_host("127.0.0.1:7180"));
        assert!(is_loopback_host("localhost"));
        assert!(is_loopback_host("[::1]:80"));
        assert!(!is_loopback_host("evil.example:7180"));
        assert!(!is_loopback_host(""));
    }

    #[test]
    fn a_post_needs_a_token_its_own_origin_and_json() {
        let ok = [
            ("host", "127.0.0.1:1"),
            ("authorization", "Bearer t"),
            ("origin", "http://127.0.0.1:1"),
            ("content-type", "application/json; charset=utf-8"),
        ];
        assert_eq!(refuse(LOOPBACK, &Method::POST, "/api/x", &headers(&ok)), None);
        let no_token = headers(&[ok[0], ok[2], ok[3]]);
        assert_eq!(refuse(LOOPBACK, &Method::POST, "/api/x", &no_token).map(|e| e.status.as_u16()), Some(401));
        let foreign = headers(&[ok[0], ok[1], ("origin", "http://evil.example"), ok[3]]);
        assert_eq!(refuse(LOOPBACK, &Method::POST, "/api/x", &foreign).map(|e| e.status.as_u16()), Some(403));
        let cross = headers(&[ok[0], ok[1], ("sec-fetch-site", "cross-site"), ok[3]]);
        assert_eq!(refuse(LOOPBACK, &Method::POST, "/api/x", &cross).map(|e| e.status.as_u16()), Some(403));
        let form = headers(&[ok[0], ok[1], ok[2], ("content-type", "application/x-www-form-urlencoded")]);
        assert_eq!(refuse(LOOPBACK, &Method::POST, "/api/x", &form).map(|e| e.status.as_u16()), Some(415));
        let rebound = headers(&[("host", "evil.example:1"), ok[1], ok[2], ok[3]]);
        assert_eq!(refuse(LOOPBACK, &Method::POST, "/api/x", &rebound).map(|e| e.status.as_u16()), Some(403));
    }

    #[test]
    fn the_app_itself_needs_no_token() {
        assert_eq!(refuse(LOOPBACK, &Method::GET, "/", &headers(&[("host", "localhost:1")])), None);
        let api = refuse(LOOPBACK, &Method::GET, "/api/runs", &headers(&[("host", "localhost:1")]));
        assert_eq!(api.map(|e| e.status.as_u16()), Some(401));
    }
}
