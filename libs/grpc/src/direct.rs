//! A client connection that sends each call from the caller's own task.
//!
//! tonic's `Channel` puts a `Buffer` in front of its connection: every call is handed to the
//! buffer's worker task, which asks the connection for the call's future and hands that back,
//! so each call wakes two tasks before hyper's HTTP/2 connection task sees it. [`Direct`] keeps
//! hyper's HTTP/2 sender itself (a cheap, shareable handle) and hands the request straight to
//! the connection task from the caller's task.
//!
//! What it keeps of `Channel`: the connection is made on first use (a lazy channel), at most
//! once at a time however many calls wait for it, in memory when this process serves the
//! endpoint (see [`crate::inproc`]), else over TCP with `TCP_NODELAY`, a 2 s connect timeout
//! and HTTP/2 keep-alive pings every 20 s. A closed connection is replaced on the next call. A
//! call that never reached the connection (it closed first) is sent once more on a new one; a
//! call that did may have been acted on and fails as sent, with hyper's error, which tonic
//! turns into a status exactly as it does for `Channel`. A connection that cannot be made fails
//! the call `UNAVAILABLE` with a [`ConnectError`] as the status's source: nothing was sent.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use http::Uri;
use http::uri::{PathAndQuery, Scheme};
use hyper::client::conn::http2::SendRequest;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::net::{TcpStream, UnixStream};
use tokio_util::either::Either;
use tonic::Status;
use tonic::body::Body;

const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
const KEEP_ALIVE_INTERVAL: Duration = Duration::from_secs(20);

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type Io = TokioIo<Either<tokio::io::DuplexStream, Either<TcpStream, UnixStream>>>;

/// A lazily connected HTTP/2 client for one endpoint, for tonic's generated clients. Clones
/// share the connection.
#[derive(Clone)]
pub struct Direct {
    shared: Arc<Shared>,
}

struct Shared {
    endpoint: String,
    scheme: Scheme,
    authority: http::uri::Authority,
    /// The socket's path for a `unix:<path>` endpoint.
    unix: Option<std::path::PathBuf>,
    /// Whether connections may be made in memory (when this process serves the endpoint).
    in_memory: bool,
    /// The current connection's sender and its number.
    current: Mutex<Option<(u64, SendRequest<Body>)>>,
    /// Held while a connection is being made, so concurrent calls make one.
    connecting: tokio::sync::Mutex<()>,
}

/// Why a connection could not be made: nothing of the call was sent.
#[derive(Debug)]
pub struct ConnectError(pub std::io::Error);

impl fmt::Display for ConnectError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "connect error: {}", self.0)
    }
}

impl std::error::Error for ConnectError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.0)
    }
}

impl fmt::Debug for Direct {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Direct").field("endpoint", &self.shared.endpoint).finish()
    }
}

impl Direct {
    /// A client for `endpoint` — `http://host:port` (port 80 when left out), or
    /// `unix:<path>` / `unix://<path>` for a Unix domain socket — connecting in memory when
    /// `in_memory` and this process serves it at the time of a connect.
    pub fn new(endpoint: &str, in_memory: bool) -> Result<Direct, Status> {
        let invalid = |why: &str| Status::invalid_argument(format!("invalid endpoint '{endpoint}': {why}"));
        let (scheme, authority, unix) = match endpoint.strip_prefix("unix:") {
            Some(path) => {
                let path = path.strip_prefix("//").unwrap_or(path);
                if path.is_empty() {
                    return Err(invalid("no socket path"));
                }
                (Scheme::HTTP, http::uri::Authority::from_static("localhost"), Some(path.into()))
            }
            None => {
                let uri: Uri = endpoint.parse().map_err(|e: http::uri::InvalidUri| invalid(&e.to_string()))?;
                let scheme = uri.scheme().cloned().ok_or_else(|| invalid("no scheme"))?;
                if scheme != Scheme::HTTP {
                    return Err(invalid("only http:// and unix: endpoints are served"));
                }
                (scheme, uri.authority().cloned().ok_or_else(|| invalid("no host"))?, None)
            }
        };
        Ok(Direct {
            shared: Arc::new(Shared {
                endpoint: endpoint.to_string(),
                scheme,
                authority,
                unix,
                in_memory,
                current: Mutex::default(),
                connecting: tokio::sync::Mutex::new(()),
            }),
        })
    }
}

impl tower::Service<http::Request<Body>> for Direct {
    type Response = http::Response<hyper::body::Incoming>;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, BoxError>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        // Readiness is the connection's, and is awaited inside the call.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<Body>) -> Self::Future {
        let shared = self.shared.clone();
        Box::pin(async move { shared.send(req).await })
    }
}

impl Shared {
    async fn send(&self, req: http::Request<Body>) -> Result<http::Response<hyper::body::Incoming>, BoxError> {
        let (mut parts, body) = req.into_parts();
        // tonic's clients give the path alone; the connection needs the whole target.
        let mut uri = http::uri::Parts::default();
        uri.scheme = Some(self.scheme.clone());
        uri.authority = Some(self.authority.clone());
        uri.path_and_query = parts.uri.path_and_query().cloned().or_else(|| Some(PathAndQuery::from_static("/")));
        parts.uri = Uri::from_parts(uri)?;
        let req = http::Request::from_parts(parts, body);

        let (number, mut sender) = self.sender(None).await?;
        match sender.try_send_request(req).await {
            Ok(response) => Ok(response),
            Err(mut e) => match e.take_message() {
                // The connection closed before the call reached it: once more on a new one.
                Some(req) => {
                    let (_, mut sender) = self.sender(Some(number)).await?;
                    Ok(sender.send_request(req).await?)
                }
                None => Err(e.into_error().into()),
            },
        }
    }

    /// The open connection's sender, or a new connection's (not connection `stale`, which a
    /// call found closed).
    async fn sender(&self, stale: Option<u64>) -> Result<(u64, SendRequest<Body>), Status> {
        if let Some(open) = self.open(stale) {
            return Ok(open);
        }
        let _one_at_a_time = self.connecting.lock().await;
        // Another call may have connected while this one waited.
        if let Some(open) = self.open(stale) {
            return Ok(open);
        }
        let io = self.connect().await.map_err(|e| {
            let mut status = Status::unavailable(format!("cannot connect to {}: {e}", self.endpoint));
            status.set_source(Arc::new(ConnectError(e)));
            status
        })?;
        let (sender, connection) = hyper::client::conn::http2::Builder::new(TokioExecutor::new())
            .timer(TokioTimer::new())
            .keep_alive_interval(KEEP_ALIVE_INTERVAL)
            .handshake::<_, Body>(io)
            .await
            .map_err(|e| {
                let mut status = Status::unavailable(format!("cannot connect to {}: {e}", self.endpoint));
                status.set_source(Arc::new(ConnectError(std::io::Error::other(e))));
                status
            })?;
        let endpoint = self.endpoint.clone();
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::debug!(%endpoint, error = %e, "client connection ended");
            }
        });
        let mut current = self.current.lock().unwrap_or_else(|p| p.into_inner());
        let number = current.as_ref().map_or(0, |(n, _)| n + 1);
        *current = Some((number, sender.clone()));
        Ok((number, sender))
    }

    fn open(&self, stale: Option<u64>) -> Option<(u64, SendRequest<Body>)> {
        let current = self.current.lock().unwrap_or_else(|p| p.into_inner());
        current.as_ref().filter(|(n, s)| Some(*n) != stale && !s.is_closed()).cloned()
    }

    async fn connect(&self) -> std::io::Result<Io> {
        if self.in_memory
            && let Some(stream) = crate::inproc::dial(&self.endpoint)
        {
            return Ok(TokioIo::new(Either::Left(stream)));
        }
        let timed_out = |_| std::io::Error::new(std::io::ErrorKind::TimedOut, "connect timed out");
        if let Some(path) = &self.unix {
            let stream =
                tokio::time::timeout(CONNECT_TIMEOUT, UnixStream::connect(path)).await.map_err(timed_out)??;
            return Ok(TokioIo::new(Either::Right(Either::Right(stream))));
        }
        let host = self.authority.host().trim_start_matches('[').trim_end_matches(']');
        let port = self.authority.port_u16().unwrap_or(80);
        let stream =
            tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect((host, port))).await.map_err(timed_out)??;
        stream.set_nodelay(true)?;
        Ok(TokioIo::new(Either::Right(Either::Left(stream))))
    }
}

#[cfg(test)]
mod tests {
    use tonic::Code;
    use tonic::service::Routes;
    use tonic_health::pb::health_check_response::ServingStatus;

    use crate::inproc::tests::check;

    /// A health server on `addr` until the returned sender is used.
    async fn serve(addr: &str) -> (String, tokio::sync::oneshot::Sender<()>, tokio::task::JoinHandle<()>) {
        let listener = crate::bind(addr).await.expect("bind");
        let endpoint = crate::endpoint_of(listener.local_addr().expect("addr"));
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(async move {
            crate::serve(listener, Routes::default(), &["warden.test"], async {
                let _ = stopped.await;
            })
            .await
            .expect("served");
        });
        (endpoint, stop, server)
    }

    /// A client made before its server is up fails `UNAVAILABLE`, marked as never sent, and
    /// reaches the server once it is up; when the server restarts, the closed connection is
    /// replaced on the next call.
    #[tokio::test]
    async fn a_client_connects_when_it_can_and_again_after_its_server_restarts() {
        // A port nobody listens on yet (bound, then freed for the server below).
        let held = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = held.local_addr().expect("addr").to_string();
        drop(held);
        let client = crate::channel(&format!("http://{addr}")).expect("channel");

        let refused = check(client.clone()).await.expect_err("nothing listens");
        assert_eq!(refused.code(), Code::Unavailable, "{refused:?}");
        let source = std::error::Error::source(&refused).expect("the transport error is the source");
        assert!(format!("{source:?}").contains("ConnectError"), "marked as never sent: {source:?}");

        let (_, stop, server) = serve(&addr).await;
        assert_eq!(check(client.clone()).await.expect("connected"), ServingStatus::Serving);
        let _ = stop.send(());
        server.await.expect("server task");

        let (_, stop, server) = serve(&addr).await;
        for _ in 0..3 {
            assert_eq!(check(client.clone()).await.expect("reconnected"), ServingStatus::Serving);
        }
        let _ = stop.send(());
        server.await.expect("server task");
    }

    /// Many calls at once on a new client share its one connection and all get answers.
    #[tokio::test]
    async fn calls_at_once_share_one_new_connection() {
        let (endpoint, stop, server) = serve("127.0.0.1:0").await;
        let direct = super::Direct::new(&endpoint, false).expect("endpoint");
        let client = tonic::service::interceptor::InterceptedService::new(
            crate::eager::Eager::new(direct.clone()),
            crate::auth::Bearer::process(),
        );
        let calls: Vec<_> = (0..50).map(|_| tokio::spawn(check(client.clone()))).collect();
        for call in calls {
            assert_eq!(call.await.expect("task").expect("answered"), ServingStatus::Serving);
        }
        let current = direct.shared.current.lock().expect("lock").clone();
        assert_eq!(current.map(|(number, _)| number), Some(0), "one connection was made");
        let _ = stop.send(());
        server.await.expect("server task");
    }

    #[test]
    fn endpoints_are_checked() {
        for bad in ["127.0.0.1:7100", "https://example.com:443", "unix:", "http://"] {
            assert!(super::Direct::new(bad, false).is_err(), "{bad}");
        }
        for good in ["http://127.0.0.1:7100", "http://ledger", "unix:/run/w.sock", "unix:///run/w.sock"] {
            assert!(super::Direct::new(good, false).is_ok(), "{good}");
        }
    }
}
