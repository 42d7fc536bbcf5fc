//! In-process calls. When several services share one process (`warden dev`), their clients
//! call each other's handlers directly: the request a client encodes is handed to the served
//! routes, behind the same server layers (telemetry, authentication, decoding limits and
//! checks, errors are exactly those of a remote call), and the response body the routes make is
//! what the client decodes — no HTTP/2 framing, no connection task, no copy through a pipe, no
//! task per call. The handler runs in the caller's task, as a remote handler runs in one task
//! of its own; dropping the call drops the handler, as a remote client's reset does.
//!
//! A process registers the endpoint it serves ([`register`]) and hands the registration to
//! [`crate::serve_with_inproc`], which installs its routes. From then on every
//! [`crate::channel`] this process builds for exactly that endpoint string calls them in
//! memory; any other endpoint, and every client in another process, uses the network. A call
//! made before the routes are installed waits for them. Once the server stops (or the
//! registration is dropped unserved) the endpoint is forgotten: calls go over the network from
//! then on, and in memory again if it is registered anew. A stop does not wait for in-memory
//! calls under way: they run in their callers' tasks and end with them.

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Mutex, OnceLock};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::sync::watch;
use tonic::Status;
use tonic::body::Body;
use tonic::transport::Channel;
use tower::ServiceExt as _;
use tower::util::BoxCloneSyncService;

/// A served endpoint's routes behind its server layers.
pub(crate) type Local = BoxCloneSyncService<http::Request<Body>, http::Response<Body>, Infallible>;

/// What a registered endpoint is doing.
#[derive(Clone)]
enum State {
    /// Registered; its routes are not installed yet: calls wait.
    Starting,
    Serving(Local),
    /// Stopped, or never served: calls use the network.
    Gone,
}

type Registry = Mutex<HashMap<String, watch::Receiver<State>>>;

fn registry() -> &'static Registry {
    static REGISTRY: OnceLock<Registry> = OnceLock::new();
    REGISTRY.get_or_init(Default::default)
}

fn lock() -> std::sync::MutexGuard<'static, HashMap<String, watch::Receiver<State>>> {
    // The map holds no invariant a panicking holder could break: use it as left.
    registry().lock().unwrap_or_else(|e| e.into_inner())
}

/// This process serves an endpoint to its own clients (see [`register`]); hand it to
/// [`crate::serve_with_inproc`].
pub struct Registration {
    endpoint: String,
    state: watch::Sender<State>,
}

/// Declares that this process serves `endpoint` (as its clients will spell it, e.g.
/// `http://127.0.0.1:7100`): channels built for it from now on call it in memory. A second
/// registration of the same endpoint replaces the first.
pub fn register(endpoint: &str) -> Registration {
    let (state, watching) = watch::channel(State::Starting);
    lock().insert(endpoint.to_string(), watching);
    Registration { endpoint: endpoint.to_string(), state }
}

impl Registration {
    /// Calls reach `routes` from now on, until this registration is dropped.
    pub(crate) fn serve(&self, routes: Local) {
        self.state.send_replace(State::Serving(routes));
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.state.send_replace(State::Gone);
        let mut map = lock();
        // Only this registration's entry: a later one for the same endpoint stays.
        if map.get(&self.endpoint).is_some_and(|r| r.same_channel(&self.state.subscribe())) {
            map.remove(&self.endpoint);
        }
    }
}

/// The registration of `endpoint` in this process, if it is registered.
fn lookup(endpoint: &str) -> Option<watch::Receiver<State>> {
    lock().get(endpoint).cloned()
}

type BoxFuture = Pin<Box<dyn Future<Output = Result<http::Response<Body>, tonic::codegen::StdError>> + Send>>;

/// How a [`crate::channel`] reaches its endpoint.
#[derive(Clone)]
pub struct Link(Way);

#[derive(Clone)]
enum Way {
    /// Over the network, the unary calls on one stream when there is a multiplexer (see
    /// [`crate::mux`]).
    Network(Channel, Option<crate::mux::Client>),
    /// An endpoint this process registered: its routes while it serves them, the network
    /// otherwise.
    Local { endpoint: std::sync::Arc<str>, state: watch::Receiver<State>, network: Channel },
}

impl Link {
    /// In memory if this process has registered `endpoint`, over `network` otherwise, its
    /// unary calls on one stream or connection if there is a `carrier`.
    pub(crate) fn to(endpoint: &str, network: Channel, carrier: Option<crate::mux::Carrier>) -> Link {
        Link(match lookup(endpoint) {
            Some(state) => Way::Local { endpoint: endpoint.into(), state, network },
            None => {
                let mux = carrier.map(|carrier| crate::mux::Client::new(network.clone(), endpoint, carrier));
                Way::Network(network, mux)
            }
        })
    }
}

/// Always over the network.
impl From<Channel> for Link {
    fn from(network: Channel) -> Link {
        Link(Way::Network(network, None))
    }
}

impl tower::Service<http::Request<Body>> for Link {
    type Response = http::Response<Body>;
    type Error = tonic::codegen::StdError;
    type Future = BoxFuture;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        match &mut self.0 {
            Way::Network(channel, None) => channel.poll_ready(cx).map_err(Into::into),
            // Each call readies its own clone of the channel when it goes on a stream of its
            // own (a slot of the channel's buffer reserved here would wait for a call that
            // might go on the shared stream instead).
            Way::Network(_, Some(_)) => Poll::Ready(Ok(())),
            // Which way the call goes is known when it is made: a call that ends up on the
            // network readies its own clone of the channel.
            Way::Local { .. } => Poll::Ready(Ok(())),
        }
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        match &mut self.0 {
            Way::Network(channel, None) => {
                let call = channel.call(request);
                Box::pin(async move { call.await.map_err(Into::into) })
            }
            Way::Network(_, Some(mux)) => mux.call(request),
            Way::Local { endpoint, state, network } => {
                if matches!(*state.borrow(), State::Gone)
                    && let Some(again) = lookup(endpoint)
                {
                    // Registered anew since this link last looked.
                    *state = again;
                }
                // The usual case, served now: straight to the routes.
                let served = match &*state.borrow() {
                    State::Serving(routes) => Some(routes.clone()),
                    _ => None,
                };
                if let Some(routes) = served {
                    return Box::pin(async move { Ok(call_local(routes, request).await) });
                }
                let mut state = state.clone();
                let network = network.clone();
                Box::pin(async move {
                    let served = match state.wait_for(|s| !matches!(s, State::Starting)).await {
                        Ok(s) => match &*s {
                            State::Serving(routes) => Some(routes.clone()),
                            _ => None,
                        },
                        // The registration was dropped before its routes were installed.
                        Err(_) => None,
                    };
                    match served {
                        Some(routes) => Ok(call_local(routes, request).await),
                        None => network.oneshot(request).await.map_err(Into::into),
                    }
                })
            }
        }
    }
}

/// Calls `routes` with `request` as a remote server would: the request without the client's
/// own extensions (HTTP/2 carries none), the deadline its `grpc-timeout` sets (expired:
/// `CANCELLED "Timeout expired"`, tonic's answer), and a handler that panics answered with
/// `CANCELLED` (a remote handler's task ends, its stream is reset) instead of unwinding into
/// the caller's task.
pub(crate) async fn call_local(routes: Local, request: http::Request<Body>) -> http::Response<Body> {
    match deadline_of(request.headers()) {
        Some(deadline) => match tokio::time::timeout(deadline, call_routes(routes, request)).await {
            Ok(response) => response,
            Err(_) => Status::cancelled("Timeout expired").into_http(),
        },
        None => call_routes(routes, request).await,
    }
}

/// [`call_local`] without the deadline, for a caller that keeps it itself.
pub(crate) async fn call_routes(routes: Local, mut request: http::Request<Body>) -> http::Response<Body> {
    use futures::FutureExt as _;
    *request.extensions_mut() = http::Extensions::new();
    match std::panic::AssertUnwindSafe(routes.oneshot(request)).catch_unwind().await {
        Ok(Ok(response)) => response,
        Ok(Err(never)) => match never {},
        Err(_) => {
            tracing::error!("a handler panicked under an in-process call");
            Status::cancelled("the handler stopped").into_http()
        }
    }
}

/// The deadline a request's `grpc-timeout` header sets, if it sets one (see [`grpc_timeout`]).
pub(crate) fn deadline_of(headers: &http::HeaderMap) -> Option<Duration> {
    headers.get("grpc-timeout").and_then(|v| v.to_str().ok()).and_then(grpc_timeout)
}

/// A `grpc-timeout` header's duration, read as tonic's server reads it (at most 8 digits, as
/// `u64` parses them, and a unit); `None` for anything else, which a remote server ignores too.
fn grpc_timeout(value: &str) -> Option<Duration> {
    if value.is_empty() {
        return None;
    }
    let (digits, unit) = value.split_at(value.len() - 1);
    if digits.len() > 8 {
        return None;
    }
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n.saturating_mul(3600)),
        "M" => Duration::from_secs(n.saturating_mul(60)),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use tonic::Code;
    use tonic::service::Routes;
    use tonic_health::pb::health_client::HealthClient;
    use tonic_health::pb::{HealthCheckRequest, health_check_response::ServingStatus};

    /// The `warden.test` health status a server answers on `channel`.
    pub(crate) async fn check(channel: crate::auth::Ch) -> Result<ServingStatus, tonic::Status> {
        let ask = HealthCheckRequest { service: "warden.test".into() };
        Ok(HealthClient::new(channel).check(ask).await?.into_inner().status())
    }

    /// An endpoint whose port is bound and never listening: connections to it are refused, and
    /// no other test gets the port while the socket is held.
    fn unserved_endpoint() -> (tokio::net::TcpSocket, String) {
        let held = tokio::net::TcpSocket::new_v4().expect("socket");
        held.bind("127.0.0.1:0".parse().expect("addr")).expect("bind");
        let endpoint = crate::endpoint_of(held.local_addr().expect("a free port"));
        (held, endpoint)
    }

    /// Serves no routes but health on a listener of its own, and to this process's clients of
    /// `registration`'s endpoint in memory; a stop, and the server's task.
    async fn serve(
        registration: super::Registration,
    ) -> (tokio::sync::oneshot::Sender<()>, tokio::task::JoinHandle<Result<(), crate::ServeError>>) {
        // The server's listener is elsewhere: the endpoint is reached in memory or not at all.
        let listener = crate::bind("127.0.0.1:0").await.expect("bind");
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(async move {
            crate::serve_with_inproc(listener, Some(registration), Routes::default(), &["warden.test"], async {
                let _ = stopped.await;
            })
            .await
        });
        (stop, server)
    }

    /// Nothing listens on the registered endpoint's port, so only a connection through memory
    /// can answer; a network channel to it, and any channel while no server is registered, find
    /// nothing; a channel built earlier reaches a server registered anew.
    #[tokio::test]
    async fn a_served_endpoint_is_reached_in_memory_and_forgotten_once_the_server_stops() {
        let (_held, endpoint) = unserved_endpoint();

        let (stop, server) = serve(super::register(&endpoint)).await;
        let early = crate::channel(&endpoint).expect("channel");
        assert_eq!(check(early.clone()).await.expect("answered in memory"), ServingStatus::Serving);
        let refused = check(crate::network_channel(&endpoint).expect("channel")).await.expect_err("nothing listens");
        assert_eq!(refused.code(), Code::Unavailable, "{refused:?}");

        let _ = stop.send(());
        server.await.expect("server task").expect("served");
        for channel in [early.clone(), crate::channel(&endpoint).expect("channel")] {
            let gone = check(channel).await.expect_err("the server stopped");
            assert_eq!(gone.code(), Code::Unavailable, "{gone:?}");
        }

        let (stop, server) = serve(super::register(&endpoint)).await;
        assert_eq!(check(early).await.expect("answered in memory again"), ServingStatus::Serving);
        let _ = stop.send(());
        server.await.expect("server task").expect("served");
    }

    /// A call made after the endpoint is registered but before its routes are installed waits
    /// for them, and is answered in memory.
    #[tokio::test]
    async fn a_call_before_the_server_starts_waits_for_it() {
        let (_held, endpoint) = unserved_endpoint();
        let registration = super::register(&endpoint);
        let early = tokio::spawn(check(crate::channel(&endpoint).expect("channel")));
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        assert!(!early.is_finished(), "nothing answers before the routes are installed");
        let (stop, server) = serve(registration).await;
        assert_eq!(early.await.expect("task").expect("answered in memory"), ServingStatus::Serving);
        let _ = stop.send(());
        server.await.expect("server task").expect("served");

        // A registration dropped without being served sends waiting calls to the network.
        let registration = super::register(&endpoint);
        let waiting = tokio::spawn(check(crate::channel(&endpoint).expect("channel")));
        drop(registration);
        let refused = waiting.await.expect("task").expect_err("nothing listens");
        assert_eq!(refused.code(), Code::Unavailable, "{refused:?}");
    }

    /// A service whose `Panic` method panics and whose every other method never answers.
    #[derive(Clone)]
    struct Trouble;

    impl tonic::server::NamedService for Trouble {
        const NAME: &'static str = "warden.test.Trouble";
    }

    impl tower::Service<http::Request<tonic::body::Body>> for Trouble {
        type Response = http::Response<tonic::body::Body>;
        type Error = std::convert::Infallible;
        type Future = std::pin::Pin<Box<dyn std::future::Future<Output = Result<Self::Response, Self::Error>> + Send>>;

        fn poll_ready(&mut self, _: &mut std::task::Context<'_>) -> std::task::Poll<Result<(), Self::Error>> {
            std::task::Poll::Ready(Ok(()))
        }

        fn call(&mut self, request: http::Request<tonic::body::Body>) -> Self::Future {
            let panics = request.uri().path().ends_with("/Panic");
            Box::pin(async move {
                if panics {
                    panic!("a handler's defect");
                }
                std::future::pending::<()>().await;
                Ok(http::Response::new(tonic::body::Body::default()))
            })
        }
    }

    /// As from a remote server: a handler that panics is answered `CANCELLED` and the caller's
    /// task goes on; a call past its `grpc-timeout` is answered `CANCELLED "Timeout expired"`.
    #[tokio::test]
    async fn a_panicking_or_overdue_handler_is_answered_as_a_remote_server_answers() {
        use tower::ServiceExt as _;
        let (_held, endpoint) = unserved_endpoint();
        let registration = super::register(&endpoint);
        let listener = crate::bind("127.0.0.1:0").await.expect("bind");
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(async move {
            crate::serve_with_inproc(listener, Some(registration), Routes::new(Trouble), &[], async {
                let _ = stopped.await;
            })
            .await
        });
        let link = super::Link::to(
            &endpoint,
            crate::network(&endpoint).expect("endpoint").connect_lazy(),
            Some(crate::mux::Carrier::Stream),
        );
        let call = |method: &str, timeout: Option<&str>| {
            let mut request = http::Request::builder().uri(format!("/warden.test.Trouble/{method}"));
            if let Some(t) = timeout {
                request = request.header("grpc-timeout", t);
            }
            link.clone().oneshot(request.body(tonic::body::Body::default()).expect("request"))
        };
        let status = |r: &http::Response<tonic::body::Body>| {
            tonic::Status::from_header_map(r.headers()).expect("a status in the headers")
        };
        let panicked = call("Panic", None).await.expect("answered");
        assert_eq!(status(&panicked).code(), Code::Cancelled, "{:?}", status(&panicked));
        let overdue = call("Wait", Some("20m")).await.expect("answered");
        assert_eq!(status(&overdue).code(), Code::Cancelled, "{:?}", status(&overdue));
        assert_eq!(status(&overdue).message(), "Timeout expired");
        let _ = stop.send(());
        server.await.expect("server task").expect("served");
    }

    #[test]
    fn grpc_timeouts_are_read_as_a_remote_server_reads_them() {
        use std::time::Duration;
        for (header, expected) in [
            ("1H", Some(Duration::from_secs(3600))),
            ("2M", Some(Duration::from_secs(120))),
            ("30S", Some(Duration::from_secs(30))),
            ("250m", Some(Duration::from_millis(250))),
            ("99999999u", Some(Duration::from_micros(99_999_999))),
            ("7n", Some(Duration::from_nanos(7))),
            ("123456789S", None),
            ("S", None),
            ("", None),
            ("5x", None),
            ("-5S", None),
            ("+5S", Some(Duration::from_secs(5))),
        ] {
            assert_eq!(super::grpc_timeout(header), expected, "{header:?}");
        }
    }
}
