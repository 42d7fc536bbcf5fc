//! The app's static files, compiled into the binary: hand-written HTML, CSS and JavaScript with
//! no build step, so serving the console needs nothing but the Rust toolchain. The page is one
//! document; its views are addressed by the URL fragment (`#/runs`, `#/approvals`, …).

use axum::Router;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;

/// `(path, content type, body)`.
pub const FILES: &[(&str, &str, &str)] = &[
    ("/", "text/html; charset=utf-8", include_str!("../static/index.html")),
    ("/app.css", "text/css; charset=utf-8", include_str!("../static/app.css")),
    ("/app.js", "text/javascript; charset=utf-8", include_str!("../static/app.js")),
    ("/dag.js", "text/javascript; charset=utf-8", include_str!("../static/dag.js")),
    ("/favicon.svg", "image/svg+xml", include_str!("../static/favicon.svg")),
];

fn serve(content_type: &'static str, body: &'static str) -> Response {
    let mut r = (StatusCode::OK, body).into_response();
    let h = r.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    // The assets change with the binary; a restarted console must not serve a stale script.
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    r
}

pub fn routes() -> Router {
    let mut router = Router::new();
    for &(path, content_type, body) in FILES {
        router = router.route(path, get(move || async move { serve(content_type, body) }));
    }
    router.route("/index.html", get(|| async { serve(FILES[0].1, FILES[0].2) })).fallback(not_found)
}

async fn not_found() -> Response {
    (StatusCode::NOT_FOUND, "not found").into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The page loads only its own files, and has no inline script or style the policy would
    /// block (no `<script>` body, no `style=` attribute, no `on…=` handler).
    #[test]
    fn the_page_has_no_inline_code() {
        let html = FILES[0].2;
        for (open, _) in html.match_indices("<script") {
            let tag_end = html[open..].find('>').map_or(html.len(), |i| open + i);
            assert!(html[open..tag_end].contains("src="), "inline script at {open}");
            assert!(html[tag_end..].starts_with("></script>"), "script with a body at {open}");
        }
        assert!(!html.contains("<style"), "inline stylesheet");
        assert!(!html.contains(" style="), "inline style attribute");
        for (i, _) in html.match_indices(" on") {
            let attr: String = html[i + 1..].chars().take_while(|c| c.is_ascii_alphabetic()).collect();
            assert!(!html[i + 1 + attr.len()..].starts_with('='), "inline handler {attr}");
        }
        for (_, _, body) in FILES.iter().filter(|(p, _, _)| p.ends_with(".js")) {
            assert!(!body.contains("eval("), "eval in a script");
            assert!(!body.contains("new Function"), "Function constructor in a script");
            assert!(!body.contains("innerHTML"), "scripts build the DOM with nodes, not markup");
        }
    }
}
