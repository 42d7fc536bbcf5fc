//! In-process connections. When several services share one process (`warden dev`), their
//! clients reach each other through memory instead of loopback TCP: the same HTTP/2 and gRPC
//! (so authentication, telemetry, limits and errors are exactly those of a remote call), minus
//! the kernel's TCP stack, two system calls per frame and a socket wake-up per message.
//!
//! A process registers the endpoint it serves ([`register`]) and serves the returned
//! [`Incoming`] beside its listener ([`crate::serve_with_inproc`]). From then on every
//! [`crate::channel`] this process builds for exactly that endpoint string connects in memory;
//! any other endpoint, and every client in another process, uses the network as before. When
//! the `Incoming` is dropped the endpoint is forgotten: channels connect over TCP from then on
//! (those built while it was registered look it up again on every connect).

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::{Mutex, OnceLock};
use std::task::{Context, Poll};

use hyper_util::rt::TokioIo;
use tokio::io::DuplexStream;
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tokio_util::either::Either;

/// Bytes buffered in each direction of one in-process connection (HTTP/2 flow control still
/// bounds what is in flight; a larger message passes through in pieces).
const BUFFER_BYTES: usize = 256 << 10;

type Registry = Mutex<HashMap<String, mpsc::UnboundedSender<DuplexStream>>>;

fn registry() -> &'static Registry {
    static REGISTRY: OnceLock<Registry> = OnceLock::new();
    REGISTRY.get_or_init(Default::default)
}

fn lock() -> std::sync::MutexGuard<'static, HashMap<String, mpsc::UnboundedSender<DuplexStream>>> {
    // The map holds no invariant a panicking holder could break: use it as left.
    registry().lock().unwrap_or_else(|e| e.into_inner())
}

/// The connections this process's own clients open to an endpoint it serves; a stream of
/// server-side halves for [`crate::serve_with_inproc`].
pub struct Incoming {
    endpoint: String,
    sender: mpsc::UnboundedSender<DuplexStream>,
    connections: mpsc::UnboundedReceiver<DuplexStream>,
}

/// Declares that this process serves `endpoint` (as its clients will spell it, e.g.
/// `http://127.0.0.1:7100`): channels built for it from now on connect in memory. A second
/// registration of the same endpoint replaces the first.
pub fn register(endpoint: &str) -> Incoming {
    let (sender, connections) = mpsc::unbounded_channel();
    lock().insert(endpoint.to_string(), sender.clone());
    Incoming { endpoint: endpoint.to_string(), sender, connections }
}

impl Drop for Incoming {
    fn drop(&mut self) {
        let mut map = lock();
        // Only this registration's entry: a later one for the same endpoint stays.
        if map.get(&self.endpoint).is_some_and(|s| s.same_channel(&self.sender)) {
            map.remove(&self.endpoint);
        }
    }
}

impl tokio_stream::Stream for Incoming {
    type Item = std::io::Result<DuplexStream>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.connections.poll_recv(cx).map(|c| c.map(Ok))
    }
}

/// A connector for [`tonic::transport::Endpoint::connect_with_connector_lazy`] if this
/// process serves `endpoint`. It looks the endpoint up again on every connect: once the server
/// stopped (its registration dropped), the channel connects over TCP like any other, and
/// through memory again if the endpoint is registered anew.
pub(crate) fn connector(
    endpoint: &str,
) -> Option<
    impl tower::Service<
        tonic::transport::Uri,
        Response = TokioIo<Either<DuplexStream, TcpStream>>,
        Error = std::io::Error,
        Future = impl Send,
    > + Send
    + Clone
    + 'static,
> {
    lock().get(endpoint)?;
    let endpoint = endpoint.to_string();
    Some(tower::service_fn(move |uri: tonic::transport::Uri| {
        let sender = lock().get(&endpoint).cloned();
        async move {
            if let Some(sender) = sender {
                let (client, server) = tokio::io::duplex(BUFFER_BYTES);
                // Refused only if the server stopped since the lookup: the network, then.
                if sender.send(server).is_ok() {
                    return Ok(TokioIo::new(Either::Left(client)));
                }
            }
            let refused = || std::io::Error::new(std::io::ErrorKind::InvalidInput, format!("no host:port in {uri}"));
            let host = uri.host().ok_or_else(refused)?.trim_start_matches('[').trim_end_matches(']');
            let port = uri.port_u16().ok_or_else(refused)?;
            let stream = TcpStream::connect((host, port)).await?;
            stream.set_nodelay(true)?;
            Ok(TokioIo::new(Either::Right(stream)))
        }
    }))
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

    /// Nothing listens on the registered endpoint's port, so only a connection through memory
    /// can answer; a network channel to it, and any channel while no server is registered, find
    /// nothing; a channel built earlier reaches a server registered anew.
    #[tokio::test]
    async fn a_served_endpoint_is_reached_in_memory_and_forgotten_once_the_server_stops() {
        // Bound, never listening: connections to it are refused, and no other test gets the port.
        let held = tokio::net::TcpSocket::new_v4().expect("socket");
        held.bind("127.0.0.1:0".parse().expect("addr")).expect("bind");
        let endpoint = crate::endpoint_of(held.local_addr().expect("a free port"));
        let serve = |incoming: super::Incoming| async move {
            // The server's listener is elsewhere: `endpoint` is reached in memory or not at all.
            let listener = crate::bind("127.0.0.1:0").await.expect("bind");
            let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
            let server = tokio::spawn(async move {
                crate::serve_with_inproc(listener, Some(incoming), Routes::default(), &["warden.test"], async {
                    let _ = stopped.await;
                })
                .await
            });
            (stop, server)
        };

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
}
