//! gRPC plumbing every Warden server and client shares: serving with health and reflection
//! on a bound listener, rich `INVALID_ARGUMENT` errors that name the field, and lazily
//! connected channels.

pub mod auth;
pub mod catalog;
pub mod eager;
pub mod guard;
pub mod inproc;
pub mod keyfile;
pub mod launch;
pub mod mux;
pub mod tool_schema;
pub mod verify;

use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use tokio::net::{TcpListener, UnixListener};
use tonic::service::Routes;
use tonic::transport::{Endpoint, Server};
use tonic::{Code, Status};
use tonic_types::{ErrorDetails, StatusExt};

/// Largest gRPC message a Warden server or client accepts, decoded.
pub const MAX_MESSAGE_BYTES: usize = 8 << 20;

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("reflection descriptors are invalid: {0}")]
    Reflection(#[from] tonic_reflection::server::Error),
    #[error("transport failed: {0}")]
    Transport(#[from] tonic::transport::Error),
    #[error("cannot bind {addr}: {source}")]
    Bind { addr: String, source: std::io::Error },
}

/// How many connections the kernel may hold completed for a server before it accepts them (the
/// kernel caps it at `net.core.somaxconn`, 4096 on current kernels).
///
/// `TcpListener::bind`'s 128 (the standard library's and mio's value) overflowed on a burst: a
/// thousand clients connecting at once to an executor busy driving runs filled the queue, the
/// kernel dropped the handshakes it had no room for (`TcpExtListenOverflows`), and clients
/// whose retried handshake came late hit their connect timeout (`warden bench --batch-runs
/// 1000` failed about one try in three so).
pub const LISTEN_BACKLOG: u32 = 4096;

/// Binds `addr` (use port 0 for any free port), the first of its addresses that binds, with
/// `SO_REUSEADDR` except on Windows (as `TcpListener::bind`: there it would let another process
/// take a port in use) and a [`LISTEN_BACKLOG`] queue.
pub async fn bind(addr: &str) -> Result<TcpListener, ServeError> {
    let refused = |source| ServeError::Bind { addr: addr.to_string(), source };
    let mut last = None;
    for a in tokio::net::lookup_host(addr).await.map_err(refused)? {
        match listen(a) {
            Ok(l) => return Ok(l),
            Err(e) => last = Some(e),
        }
    }
    Err(refused(
        last.unwrap_or_else(|| {
            std::io::Error::new(std::io::ErrorKind::InvalidInput, "the address resolves to nothing")
        }),
    ))
}

fn listen(addr: std::net::SocketAddr) -> std::io::Result<TcpListener> {
    let socket = if addr.is_ipv4() { tokio::net::TcpSocket::new_v4()? } else { tokio::net::TcpSocket::new_v6()? };
    #[cfg(not(windows))]
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(LISTEN_BACKLOG)
}

/// Where a server listens: its TCP address, and a Unix domain socket beside it for clients on
/// the same node (see [`bind_unix`]).
pub struct Listeners {
    pub tcp: TcpListener,
    pub unix: Option<UnixSocket>,
}

impl From<TcpListener> for Listeners {
    fn from(tcp: TcpListener) -> Listeners {
        Listeners { tcp, unix: None }
    }
}

/// A bound Unix domain socket and the lock that makes it this process's (see [`bind_unix`]).
#[derive(Debug)]
pub struct UnixSocket {
    listener: UnixListener,
    file: SocketFile,
}

impl UnixSocket {
    pub fn path(&self) -> &std::path::Path {
        &self.file.path
    }
}

/// The socket's path, and an exclusive lock on `<path>.lock`, held while the process serves
/// the socket.
#[derive(Debug)]
struct SocketFile {
    path: std::path::PathBuf,
    _lock: std::fs::File,
}

/// Mode of a bound socket: the service's own user and group may connect (a peer under
/// another user of the same group included), nobody else.
const SOCKET_MODE: u32 = 0o660;

/// Binds a Unix domain socket at `path`, which clients reach as the endpoint `unix:<path>`.
///
/// Co-located services (a pod's containers sharing a volume, processes on one host) then talk
/// without the kernel's TCP/IP stack: the same HTTP/2 and gRPC, the same authentication as
/// over TCP (the routes' token checks), the same limits. The socket is made mode 0660; the
/// directory's permissions apply as well.
///
/// The server holds an exclusive lock on `<path>.lock` while it serves: a second server for
/// the same path is refused (even while the first still drains its calls after a stop), and
/// a socket file found while holding the lock was left by a server that died, so it is
/// replaced. A path that is not a socket, or a socket something else still answers on, is
/// refused rather than taken over.
pub async fn bind_unix(path: &str) -> Result<UnixSocket, ServeError> {
    use std::os::unix::fs::{FileTypeExt, OpenOptionsExt, PermissionsExt};
    let refused = |source| ServeError::Bind { addr: format!("unix:{path}"), source };
    let refuse = |kind, what: &str| refused(std::io::Error::new(kind, what.to_string()));
    // Only the service's own user may open (and so lock) it.
    let lock = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .mode(0o600)
        .open(format!("{path}.lock"))
        .map_err(refused)?;
    match lock.try_lock() {
        Ok(()) => {}
        Err(std::fs::TryLockError::WouldBlock) => {
            return Err(refuse(std::io::ErrorKind::AddrInUse, "another server holds this socket"));
        }
        Err(std::fs::TryLockError::Error(e)) => return Err(refused(e)),
    }
    match std::fs::symlink_metadata(path) {
        Ok(meta) if !meta.file_type().is_socket() => {
            return Err(refuse(std::io::ErrorKind::AlreadyExists, "the path exists and is not a socket"));
        }
        Ok(_) => {
            // No Warden server holds the lock: a server that died left it (nothing accepts
            // on it: refused), unless a process of another kind answers on it, or it cannot
            // be told (not ours to connect to, a full backlog) — then it is left alone.
            match tokio::net::UnixStream::connect(path).await {
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {}
                Ok(_) => return Err(refuse(std::io::ErrorKind::AddrInUse, "another process answers on this socket")),
                Err(e) => return Err(refused(e)),
            }
            std::fs::remove_file(path).map_err(refused)?;
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(refused(e)),
    }
    let listener = UnixListener::bind(path).map_err(refused)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(SOCKET_MODE)).map_err(refused)?;
    Ok(UnixSocket { listener, file: SocketFile { path: path.into(), _lock: lock } })
}

/// Serves `routes` on `listener` with gRPC health (every name in `services` reported
/// SERVING, plus the empty overall name) and reflection over the warden.v1 descriptors —
/// both `grpc.reflection.v1` and `grpc.reflection.v1alpha`, since grpcurl, grpcui, Postman
/// and evans still ask v1alpha — until `shutdown` resolves.
pub async fn serve(
    listener: impl Into<Listeners>,
    routes: Routes,
    services: &[&str],
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), ServeError> {
    serve_with_inproc(listener, None, routes, services, shutdown).await
}

/// [`serve`], and the same routes, layers included, to this process's own clients through
/// `inproc` (see [`inproc`]).
pub async fn serve_with_inproc(
    listener: impl Into<Listeners>,
    inproc: Option<inproc::Registration>,
    routes: Routes,
    services: &[&str],
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), ServeError> {
    let (reporter, health) = tonic_health::server::health_reporter();
    reporter.set_service_status("", tonic_health::ServingStatus::Serving).await;
    for s in services {
        reporter.set_service_status(*s, tonic_health::ServingStatus::Serving).await;
    }
    // One builder per version (building consumes it); both describe the same descriptors.
    let reflection = || {
        tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(warden_proto::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
    };
    let routes =
        routes.add_service(health).add_service(reflection().build_v1()?).add_service(reflection().build_v1alpha()?);
    // One stop for both servers.
    let (stop, stopping) = tokio::sync::watch::channel(());
    // The routes behind the server's layers: what in-memory and multiplexed calls reach.
    let local = {
        use tower::Layer as _;
        inproc::Local::new(warden_telemetry::grpc::ServerLayer.layer(routes.clone()))
    };
    // The stream of calls, on an HTTP/2 stream and on connections of frames alike.
    let calls = mux::Server::new(local.clone(), stopping.clone());
    let routes = routes.add_service(calls.clone());
    // No TLS here: connections of frames are sorted out before any acceptor would see them
    // (`mux::frames::sort`), so a server that adds one must put the sorting behind it too.
    let server = || {
        Server::builder()
            .initial_connection_window_size(CONNECTION_WINDOW)
            .max_concurrent_streams(MAX_CONCURRENT_STREAMS)
            // Outermost, so the span and the RED metrics cover everything a request meets,
            // authentication refusals included; the caller's trace context becomes its parent.
            .layer(warden_telemetry::grpc::ServerLayer)
            .add_routes(routes.clone())
    };
    let stopped = |mut stopping: tokio::sync::watch::Receiver<()>| async move {
        let _ = stopping.changed().await;
    };
    let Listeners { tcp, unix } = listener.into();
    let (unix, socket) = match unix {
        Some(UnixSocket { listener, file }) => (Some(listener), Some(file)),
        None => (None, None),
    };
    let signal = async move {
        shutdown.await;
        let _ = stop.send(());
        // New connections end with the stop; the file goes now, not once every call has
        // drained (the lock, held until this server ends, keeps a successor from binding).
        if let Some(file) = &socket {
            let _ = std::fs::remove_file(&file.path);
        }
        Ok(socket)
    };
    // Connections of frames are served as streams of calls; the rest are HTTP/2's (both with
    // no Nagle delay: agents' steps are latency-bound request/response calls).
    let (incoming, frames_drained) = mux::frames::sort(tcp, calls, stopping.clone());
    let network = async {
        let served = server().serve_with_incoming_shutdown(incoming, stopped(stopping.clone())).await;
        // A stop waits for the connections of frames as it waits for HTTP/2's.
        frames_drained.await;
        served
    };
    // This process's own clients call the routes, behind the same layer, in memory until the
    // stop (the registration, dropped then, sends later calls to the network).
    if let Some(registration) = &inproc {
        registration.serve(local);
    }
    let local = async {
        if let Some(registration) = inproc {
            stopped(stopping.clone()).await;
            drop(registration);
        }
        Ok::<(), tonic::transport::Error>(())
    };
    let node = async {
        match unix {
            Some(unix) => {
                let connections = tokio_stream::wrappers::UnixListenerStream::new(unix);
                server().serve_with_incoming_shutdown(connections, stopped(stopping.clone())).await
            }
            None => Ok(()),
        }
    };
    // The lock is released once every server has ended (or on an error, with the process).
    let (_socket, (), (), ()) = tokio::try_join!(signal, network, local, node)?;
    Ok(())
}

/// A channel that connects on first use and reconnects after failures, so services can
/// start in any order. Its calls carry this process's token (see [`auth`]).
pub fn channel(endpoint: &str) -> Result<auth::Ch, Status> {
    Ok(tonic::service::interceptor::InterceptedService::new(
        eager::Eager::new(raw_channel(endpoint)?),
        auth::Bearer::process(),
    ))
}

/// [`channel`] presenting `token` instead of the process's own.
pub fn channel_with_token(endpoint: &str, token: &str) -> Result<auth::Ch, Status> {
    Ok(tonic::service::interceptor::InterceptedService::new(
        eager::Eager::new(raw_channel(endpoint)?),
        auth::Bearer::new(Some(token))?,
    ))
}

/// A channel that never connects in memory (see [`inproc`]), even to an endpoint this process
/// serves: for a client that must see what a remote client sees (`warden bench`).
pub fn network_channel(endpoint: &str) -> Result<auth::Ch, Status> {
    Ok(tonic::service::interceptor::InterceptedService::new(
        eager::Eager::new(network(endpoint)?.connect_lazy().into()),
        auth::Bearer::process(),
    ))
}

fn raw_channel(endpoint: &str) -> Result<inproc::Link, Status> {
    Ok(inproc::Link::to(endpoint, network(endpoint)?.connect_lazy(), mux::carrier()))
}

fn network(endpoint: &str) -> Result<Endpoint, Status> {
    Ok(Endpoint::from_shared(endpoint.to_string())
        .map_err(|e| Status::invalid_argument(format!("invalid endpoint '{endpoint}': {e}")))?
        .connect_timeout(Duration::from_secs(2))
        .initial_connection_window_size(CONNECTION_WINDOW)
        .tcp_nodelay(true)
        .http2_keep_alive_interval(Duration::from_secs(20)))
}

/// The HTTP/2 connection window every server and client of the mesh asks for. hyper's
/// defaults are 1 MiB for a server and 5 MiB for a client.
///
/// h2 counts each small DATA frame (under 256 bytes) that has arrived but that no handler has
/// read yet against a budget of half the connection window, at up to 256 bytes a frame. Past
/// that budget it closes the connection with GOAWAY ENHANCE_YOUR_CALM ("too_many_data_frames"),
/// and every call on the connection fails. With a server's default window that is 2,000–4,000
/// small frames. An executor driving thousands of runs carries thousands of concurrent calls
/// on one connection to each peer, and a busy peer reads them in bursts: at 4,000 runs at
/// once the executor closed its connections this way. 16 MiB allows at least 32,768 frames
/// waiting. It also lets a peer leave that much unread on one connection, twice the largest
/// message.
pub const CONNECTION_WINDOW: u32 = 16 << 20;

/// The most calls one connection may have open at once on a Warden server; a peer's further
/// calls wait in its HTTP/2 client until one ends (HTTP/2's `SETTINGS_MAX_CONCURRENT_STREAMS`).
///
/// Without it (tonic's default) one connection could open streams without end, each holding a
/// decoded request and a handler, which is memory a caller decides. The bound is far above what
/// the mesh's own connections carry: an executor driving thousands of runs has a call per run
/// open to each peer, and a client's `WaitRun`s are one per run, held while the run goes; 4,000
/// runs at once on one channel were measured (BENCHMARKS.md, 2026-11-29 "later"). hyper's own
/// default, 200, would make such a client's submissions wait behind its waits.
pub const MAX_CONCURRENT_STREAMS: u32 = 16_384;

/// `INVALID_ARGUMENT` with a field violation: the client learns which field and why.
pub fn invalid_field(field: impl Into<String>, description: impl Into<String>) -> Status {
    let (field, description) = (field.into(), description.into());
    let message = format!("{field}: {description}");
    Status::with_error_details(
        Code::InvalidArgument,
        message,
        ErrorDetails::with_bad_request_violation(field, description),
    )
}

/// The same status with every field violation's field prefixed (`events[2].` + `step_id`), for
/// checks of one element of a repeated field; any other status passes unchanged.
pub fn prefix_field(status: Status, prefix: &str) -> Status {
    let violations = field_violations(&status);
    match violations.first() {
        Some((field, description)) if status.code() == Code::InvalidArgument => {
            invalid_field(format!("{prefix}{field}"), description.clone())
        }
        _ => status,
    }
}

/// The field violations carried by a status, as `(field, description)` pairs.
pub fn field_violations(status: &Status) -> Vec<(String, String)> {
    status
        .get_details_bad_request()
        .map(|b| b.field_violations.into_iter().map(|v| (v.field, v.description)).collect())
        .unwrap_or_default()
}

/// Requires a non-empty identifier field that passes [`warden_core::ids::check_id`]-style rules.
pub fn require_id(field: &str, value: &str, check: impl Fn(&str) -> Result<(), String>) -> Result<(), Status> {
    check(value).map_err(|reason| invalid_field(field, reason))
}

/// The address a listener is bound to, as an `http://` endpoint.
pub fn endpoint_of(addr: SocketAddr) -> String {
    format!("http://{addr}")
}

/// Prints the line process supervisors (the test harness, `make run`) wait for.
pub fn announce(service: &str, addr: SocketAddr) {
    println!("WARDEN_LISTENING {service} {}", endpoint_of(addr));
}

/// Resolves on SIGINT or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! { _ = ctrl_c => {}, _ = term => {} }
}

/// Unix milliseconds now.
pub fn now_ms() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as i64).unwrap_or_default()
}

/// Conversions between the domain's types and the wire's.
pub mod convert {
    use warden_core::auth::SignedClaims;
    use warden_core::events::RunStatus;
    use warden_proto::v1 as pb;

    /// Signed claims as they travel (authorizations, request and run acknowledgements).
    pub fn claims_to_wire(signed: SignedClaims) -> pb::SignedAuthorization {
        pb::SignedAuthorization { claims_json: signed.claims_json, signature: signed.signature, key_id: signed.key_id }
    }

    /// Signed claims as they arrived; absent ones are empty (verification calls them missing).
    pub fn claims_from_wire(a: Option<&pb::SignedAuthorization>) -> SignedClaims {
        a.map(|a| SignedClaims {
            claims_json: a.claims_json.clone(),
            signature: a.signature.clone(),
            key_id: a.key_id.clone(),
        })
        .unwrap_or(SignedClaims { claims_json: vec![], signature: vec![], key_id: String::new() })
    }

    pub fn status_to_proto(s: RunStatus) -> pb::RunStatus {
        match s {
            RunStatus::Pending => pb::RunStatus::Pending,
            RunStatus::Active => pb::RunStatus::Active,
            RunStatus::Paused => pb::RunStatus::Paused,
            RunStatus::Blocked => pb::RunStatus::Blocked,
            RunStatus::RequiresReconciliation => pb::RunStatus::RequiresReconciliation,
            RunStatus::Completed => pb::RunStatus::Completed,
            RunStatus::Failed => pb::RunStatus::Failed,
            RunStatus::Cancelled => pb::RunStatus::Cancelled,
            RunStatus::EmptyPlan => pb::RunStatus::EmptyPlan,
        }
    }

    pub fn status_from_proto(s: pb::RunStatus) -> Option<RunStatus> {
        Some(match s {
            pb::RunStatus::Unspecified => return None,
            pb::RunStatus::Pending => RunStatus::Pending,
            pb::RunStatus::Active => RunStatus::Active,
            pb::RunStatus::Paused => RunStatus::Paused,
            pb::RunStatus::Blocked => RunStatus::Blocked,
            pb::RunStatus::RequiresReconciliation => RunStatus::RequiresReconciliation,
            pb::RunStatus::Completed => RunStatus::Completed,
            pb::RunStatus::Failed => RunStatus::Failed,
            pb::RunStatus::Cancelled => RunStatus::Cancelled,
            pb::RunStatus::EmptyPlan => RunStatus::EmptyPlan,
        })
    }

    /// Decodes a repeated status field; unknown numbers are an error naming `field`.
    pub fn statuses(field: &str, raw: &[i32]) -> Result<Vec<RunStatus>, tonic::Status> {
        raw.iter()
            .map(|&n| {
                pb::RunStatus::try_from(n)
                    .ok()
                    .and_then(status_from_proto)
                    .ok_or_else(|| super::invalid_field(field, format!("{n} is not a run status")))
            })
            .collect()
    }

    /// Lower-case name of a wire status (`completed`, `failed`, …).
    pub fn status_name(n: i32) -> &'static str {
        pb::RunStatus::try_from(n).ok().and_then(status_from_proto).map(RunStatus::as_str).unwrap_or("unspecified")
    }

    pub fn event_to_proto(e: &warden_core::chain::ChainedEvent) -> pb::Event {
        pb::Event { payload_json: warden_core::canonical::canonical_value(&e.body.payload), ..event_without_payload(e) }
    }

    /// [`event_to_proto`] without the payload (`payload_json` empty): for callers that asked
    /// not to have their own events sent back.
    pub fn event_without_payload(e: &warden_core::chain::ChainedEvent) -> pb::Event {
        pb::Event {
            run_id: e.body.run_id.clone(),
            seq: e.body.seq,
            event_type: e.body.event_type.clone(),
            payload_json: String::new(),
            step_id: e.body.step_id.clone(),
            epoch: e.body.epoch,
            idempotency_key: e.body.idempotency_key.clone(),
            timestamp_ms: e.body.timestamp_ms,
            prev_hash: e.prev_hash.clone(),
            hash: e.hash.clone(),
        }
    }

    /// The inverse of [`event_to_proto`]; a payload that is not JSON becomes a string.
    pub fn event_from_proto(e: &pb::Event) -> warden_core::chain::ChainedEvent {
        warden_core::chain::ChainedEvent {
            body: warden_core::chain::EventBody {
                run_id: e.run_id.clone(),
                seq: e.seq,
                event_type: e.event_type.clone(),
                payload: serde_json::from_str(&e.payload_json)
                    .unwrap_or_else(|_| serde_json::Value::String(e.payload_json.clone())),
                step_id: e.step_id.clone(),
                epoch: e.epoch,
                idempotency_key: e.idempotency_key.clone(),
                timestamp_ms: e.timestamp_ms,
            },
            prev_hash: e.prev_hash.clone(),
            hash: e.hash.clone(),
        }
    }
}

/// `ErrorInfo.reason` of a write refused for a stale fencing epoch.
pub const STALE_EPOCH: &str = "STALE_EPOCH";

/// `FAILED_PRECONDITION` marked as a fencing refusal, so callers can tell a lost lease
/// from other preconditions without parsing messages.
pub fn fenced(message: impl Into<String>) -> Status {
    let info = ErrorDetails::with_error_info(STALE_EPOCH, "warden.v1", std::collections::HashMap::new());
    Status::with_error_details(Code::FailedPrecondition, message, info)
}

/// `RESOURCE_EXHAUSTED` for a request refused because too many are waiting ahead of it:
/// nothing was done, and `RetryInfo` says when trying again is likely to be admitted.
pub fn busy(message: impl Into<String>, retry_after: Duration) -> Status {
    Status::with_error_details(Code::ResourceExhausted, message, ErrorDetails::with_retry_info(Some(retry_after)))
}

/// Whether `status` is a fencing refusal (see [`fenced`]).
pub fn is_fenced(status: &Status) -> bool {
    status.code() == Code::FailedPrecondition
        && status.get_details_error_info().is_some_and(|i| i.reason == STALE_EPOCH)
}

/// Whether the client's own transport failed under the call — the callee killed or the
/// connection reset mid-request — rather than the callee answering. A status the callee sent
/// has no source error. One the client made of a broken connection carries the transport
/// error, whatever code tonic gives it: mostly UNKNOWN, INTERNAL for most HTTP/2 errors, and
/// RESOURCE_EXHAUSTED for a GOAWAY ENHANCE_YOUR_CALM (which h2 sends when a connection's
/// small DATA frames pile up; see [`CONNECTION_WINDOW`]). Such a call decided nothing, so
/// callers treat it as an outage, not as the callee's answer.
///
/// A callee may also relay such a status from its own call downstream: it then arrives without
/// its source, but with tonic's message ([`H2_ERROR_PREFIX`]`…`), and is read the same way.
/// The caller asks again, which every call this is used for allows.
pub fn broke_off(status: &Status) -> bool {
    std::error::Error::source(status).is_some() || status.message().starts_with(H2_ERROR_PREFIX)
}

/// How tonic begins the message of a status it made of an HTTP/2 error (see [`broke_off`]).
pub const H2_ERROR_PREFIX: &str = "h2 protocol error: ";

#[cfg(test)]
mod tests {
    use tonic::service::Routes;

    #[test]
    fn a_connection_broken_under_a_call_broke_off_and_a_callees_own_error_did_not() {
        let broken =
            tonic::Status::from_error(Box::new(std::io::Error::new(std::io::ErrorKind::BrokenPipe, "broken pipe")));
        assert_eq!(broken.code(), tonic::Code::Unknown);
        assert!(super::broke_off(&broken));
        assert!(!super::broke_off(&tonic::Status::unknown("the callee's own unknown error")));
        assert!(!super::broke_off(&tonic::Status::internal("a bug in the callee")));
        // A GOAWAY ENHANCE_YOUR_CALM, as tonic makes a status of it: RESOURCE_EXHAUSTED.
        let calm = tonic::Status::from_error(Box::new(h2::Error::from(h2::Reason::ENHANCE_YOUR_CALM)));
        assert_eq!(calm.code(), tonic::Code::ResourceExhausted);
        assert!(super::broke_off(&calm), "{calm:?}");
        let reset = tonic::Status::from_error(Box::new(h2::Error::from(h2::Reason::PROTOCOL_ERROR)));
        assert!(super::broke_off(&reset), "{reset:?}");
        // Such a status relayed by a callee: its message only.
        assert!(super::broke_off(&tonic::Status::internal(reset.message())));
        // A callee's own refusals are its answer.
        assert!(!super::broke_off(&tonic::Status::resource_exhausted("quota")));
    }

    /// The services a reflection client of either version lists, and whether it can fetch
    /// the file declaring `warden.v1.Runs`.
    async fn reflect(endpoint: &str, alpha: bool) -> (Vec<String>, bool) {
        use tonic_reflection::pb::{v1, v1alpha};
        let channel = tonic::transport::Endpoint::from_shared(endpoint.to_string()).expect("endpoint").connect_lazy();
        if alpha {
            use v1alpha::server_reflection_request::MessageRequest as Ask;
            use v1alpha::server_reflection_response::MessageResponse as Answer;
            let mut client = v1alpha::server_reflection_client::ServerReflectionClient::new(channel);
            let ask = |m| v1alpha::ServerReflectionRequest { host: String::new(), message_request: Some(m) };
            let asks = [Ask::ListServices(String::new()), Ask::FileContainingSymbol("warden.v1.Runs".into())];
            let mut answers = client
                .server_reflection_info(tokio_stream::iter(asks.map(ask)))
                .await
                .expect("v1alpha reflection")
                .into_inner();
            let (mut names, mut file) = (Vec::new(), false);
            while let Some(a) = answers.message().await.expect("answer") {
                match a.message_response {
                    Some(Answer::ListServicesResponse(l)) => names = l.service.into_iter().map(|s| s.name).collect(),
                    Some(Answer::FileDescriptorResponse(f)) => file = !f.file_descriptor_proto.is_empty(),
                    other => panic!("unexpected answer {other:?}"),
                }
            }
            (names, file)
        } else {
            use v1::server_reflection_request::MessageRequest as Ask;
            use v1::server_reflection_response::MessageResponse as Answer;
            let mut client = v1::server_reflection_client::ServerReflectionClient::new(channel);
            let ask = |m| v1::ServerReflectionRequest { host: String::new(), message_request: Some(m) };
            let asks = [Ask::ListServices(String::new()), Ask::FileContainingSymbol("warden.v1.Runs".into())];
            let mut answers = client
                .server_reflection_info(tokio_stream::iter(asks.map(ask)))
                .await
                .expect("v1 reflection")
                .into_inner();
            let (mut names, mut file) = (Vec::new(), false);
            while let Some(a) = answers.message().await.expect("answer") {
                match a.message_response {
                    Some(Answer::ListServicesResponse(l)) => names = l.service.into_iter().map(|s| s.name).collect(),
                    Some(Answer::FileDescriptorResponse(f)) => file = !f.file_descriptor_proto.is_empty(),
                    other => panic!("unexpected answer {other:?}"),
                }
            }
            (names, file)
        }
    }

    /// A burst of connections far larger than `TcpListener::bind`'s queue of 128, to a server
    /// that accepts none of them yet, completes every handshake: the kernel holds them all until
    /// the server gets to them (fewer if this kernel caps the queue lower, or this process may
    /// open fewer files: two per connection, client and server side, stay open).
    #[tokio::test]
    async fn a_burst_of_connections_beyond_1024_waits_in_the_queue_instead_of_being_dropped() {
        let somaxconn: usize = std::fs::read_to_string("/proc/sys/net/core/somaxconn")
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(1024);
        let open_files: usize = std::fs::read_to_string("/proc/self/limits")
            .ok()
            .and_then(|s| {
                let line = s.lines().find(|l| l.starts_with("Max open files"))?;
                line.split_whitespace().nth(3)?.parse().ok()
            })
            .unwrap_or(1024);
        let burst = 1500.min(somaxconn.saturating_sub(1)).min(open_files.saturating_sub(256) / 2);
        let listener = super::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let mut connects = tokio::task::JoinSet::new();
        for _ in 0..burst {
            connects.spawn(async move {
                tokio::time::timeout(std::time::Duration::from_secs(20), tokio::net::TcpStream::connect(addr)).await
            });
        }
        let mut held = Vec::new();
        while let Some(r) = connects.join_next().await {
            held.push(r.expect("task").expect("handshake completed, not dropped").expect("connected"));
        }
        assert_eq!(held.len(), burst);
        // And the server then accepts them in turn.
        for _ in 0..burst {
            listener.accept().await.expect("accept");
        }
    }

    /// A server tells every connection how many calls it may have open at once.
    #[tokio::test]
    async fn a_server_bounds_the_calls_open_on_one_connection() {
        let listener = super::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(super::serve(listener, Routes::default(), &[], async {
            let _ = stopped.await;
        }));
        let tcp = tokio::net::TcpStream::connect(addr).await.expect("connect");
        let (client, mut connection) = h2::client::handshake(tcp).await.expect("HTTP/2 handshake");
        // The server's SETTINGS arrive once the connection is driven.
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(30);
        while connection.max_concurrent_send_streams() == usize::MAX && tokio::time::Instant::now() < deadline {
            let _ = tokio::time::timeout(std::time::Duration::from_millis(20), &mut connection).await;
        }
        assert_eq!(connection.max_concurrent_send_streams(), super::MAX_CONCURRENT_STREAMS as usize);
        // A server stops once its connections have closed.
        drop((client, connection));
        let _ = stop.send(());
        server.await.expect("join").expect("served");
    }

    /// grpcurl, grpcui, Postman and evans ask `grpc.reflection.v1alpha`; newer clients ask v1.
    /// Both answer with the same services and descriptors.
    #[tokio::test]
    async fn reflection_answers_v1_and_v1alpha_clients_alike() {
        let listener = super::bind("127.0.0.1:0").await.expect("bind");
        let endpoint = super::endpoint_of(listener.local_addr().expect("addr"));
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(super::serve(listener, Routes::default(), &[], async {
            let _ = stopped.await;
        }));
        for alpha in [false, true] {
            let (names, file) = reflect(&endpoint, alpha).await;
            for service in ["warden.v1.Runs", "warden.v1.ToolHost", "grpc.health.v1.Health"] {
                assert!(names.iter().any(|n| n == service), "alpha={alpha}: {names:?}");
            }
            assert!(file, "alpha={alpha}: the file declaring warden.v1.Runs is served");
        }
        let _ = stop.send(());
        server.await.expect("server task").expect("served");
    }

    async fn health(endpoint: &str) -> Result<tonic_health::pb::health_check_response::ServingStatus, tonic::Status> {
        crate::inproc::tests::check(super::channel(endpoint).expect("channel")).await
    }

    /// A server answers on its Unix domain socket as on TCP; the socket file goes when the
    /// server stops; a stale one is replaced, while a live socket or a file that is not a
    /// socket is refused.
    #[tokio::test]
    async fn a_server_answers_on_its_unix_socket_too() {
        use tonic_health::pb::health_check_response::ServingStatus;
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("svc.sock").display().to_string();
        let serve = |unix| async {
            let tcp = super::bind("127.0.0.1:0").await.expect("bind");
            let endpoint = super::endpoint_of(tcp.local_addr().expect("addr"));
            let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
            let listeners = super::Listeners { tcp, unix: Some(unix) };
            let server = tokio::spawn(super::serve(listeners, Routes::default(), &["warden.test"], async {
                let _ = stopped.await;
            }));
            (endpoint, stop, server)
        };
        let (tcp, stop, server) = serve(super::bind_unix(&path).await.expect("bind the socket")).await;
        for endpoint in [format!("unix:{path}"), format!("unix://{path}"), tcp] {
            assert_eq!(health(&endpoint).await.expect(&endpoint), ServingStatus::Serving, "{endpoint}");
        }
        use std::os::unix::fs::PermissionsExt;
        let mode = |p: &str| std::fs::metadata(p).expect("metadata").permissions().mode() & 0o777;
        assert_eq!(mode(&path), 0o660, "the service's user and group may connect");
        assert_eq!(mode(&format!("{path}.lock")), 0o600, "only the service's user may take the lock");
        let taken = super::bind_unix(&path).await.expect_err("a served socket is not taken over");
        assert!(taken.to_string().contains("another server holds"), "{taken}");
        let _ = stop.send(());
        server.await.expect("server task").expect("served");
        assert!(!std::path::Path::new(&path).exists(), "the socket file goes with the server");

        // A socket nobody serves (its server died) is replaced.
        drop(std::os::unix::net::UnixListener::bind(&path).expect("a stale socket"));
        let (_, stop, server) = serve(super::bind_unix(&path).await.expect("the stale socket is replaced")).await;
        assert_eq!(health(&format!("unix:{path}")).await.expect("answered"), ServingStatus::Serving);
        let _ = stop.send(());
        server.await.expect("server task").expect("served");

        // A socket a process of another kind answers on is left to it.
        let other = dir.path().join("other.sock").display().to_string();
        let _answering = std::os::unix::net::UnixListener::bind(&other).expect("another process's socket");
        let refused = super::bind_unix(&other).await.expect_err("answered by another process");
        assert!(refused.to_string().contains("another process answers"), "{refused}");

        let file = dir.path().join("not-a-socket").display().to_string();
        std::fs::write(&file, b"data").expect("a file");
        let refused = super::bind_unix(&file).await.expect_err("not a socket");
        assert!(refused.to_string().contains("not a socket"), "{refused}");
        assert_eq!(std::fs::read(&file).expect("left alone"), b"data");
    }
}
