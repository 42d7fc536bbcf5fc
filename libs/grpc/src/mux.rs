//! The mesh's unary calls carried on one long-lived stream per connection.
//!
//! A unary gRPC call over HTTP/2 opens a stream of its own: the request leaves as HEADERS and
//! then DATA, and the answer comes back as HEADERS with DATA and then the trailers alone — four
//! writes, up to four wake-ups and two HPACK encodings and decodings per call, most of it
//! inside hyper's HTTP/2 code (measured with `strace` and `perf` on a chain of steps; see
//! docs/write-path.md). A step makes three such calls (`Authorize`, `AppendEvents`, `Invoke`).
//!
//! Here a client that calls a Warden server over the network opens one bidirectional stream,
//! `/warden.v1.Mux/Calls`, and sends each unary call on it as one message ([`Call`]: an id,
//! the method's path, the request's headers and its gRPC-framed body); the server answers each
//! with one message ([`Answer`]: the response's headers, body and trailers). A call is then one
//! DATA frame each way on a stream that is already open.
//!
//! Nothing about a call changes but its carriage:
//! - **Authority.** Each call carries its own headers (`authorization`, `grpc-timeout`, trace
//!   context) and is handed to the same routes, behind the same server layers (telemetry,
//!   authentication, decoding limits and checks), as a call on a stream of its own (the
//!   dispatch is [`crate::inproc`]'s, which serves a process's own clients in memory). The
//!   stream itself grants nothing: opening it needs no token, as a connection needs none.
//! - **Deadlines and cancellation.** The server keeps a call's `grpc-timeout`, and so does the
//!   client (tonic's channel does both for a unary call). A caller that drops its call sends a
//!   cancel, and the server drops the handler, as an HTTP/2 reset does.
//! - **Bounds.** A server runs at most [`MAX_IN_FLIGHT`] calls of one stream at once, as a
//!   connection holds at most [`crate::MAX_CONCURRENT_STREAMS`] streams, and says so when the
//!   stream opens; the client sends no more than that on it (the rest go alone). The server
//!   reads on past the bound (calls wait in their tasks, within their deadlines; cancels are
//!   read as they come) up to twice it, then reads no further. A server serves at most
//!   [`MAX_STREAMS`] streams, [`MAX_STREAMS_PER_CONNECTION`] of one connection. A request body
//!   over [`MAX_INLINE_BODY`] goes on a stream of its own, as does a call with more than
//!   [`MAX_HEADERS`] headers; an answer's body is bounded as a client bounds a message it
//!   decodes.
//! - **Only unary methods** (from the descriptors of `warden.v1` and `grpc.health.v1`) are
//!   carried; a server answers any other path `UNIMPLEMENTED`, since it collects each answer
//!   whole before sending it.
//! - **Failures.** While the stream opens, after it ends, and against a server that does not
//!   serve it (`UNIMPLEMENTED`, asked again after [`REFUSED_RETRY`]), calls go on streams of
//!   their own. Calls under way when the stream breaks fail `UNAVAILABLE` with the transport's
//!   error as their source ([`crate::broke_off`] is true), as on a broken connection. A server
//!   that stops sends a go-away; its client sends no more calls on that stream and ends its
//!   side once every call on it is answered; the server answers everything it read and then
//!   ends the stream too, so a stop loses no call. Past [`STOP_GRACE`] it reads no more (a
//!   client that kept sending has its unread calls fail as above) and lets the calls under way
//!   finish, unless the client does not read their answers.
//!
//! The same messages go just as well on a TCP connection of their own, in plain frames, without
//! HTTP/2 at all ([`frames`]): that is what a client uses for a TCP endpoint unless told
//! otherwise ([`carrier`]); the HTTP/2 stream serves Unix socket endpoints and
//! `WARDEN_MULTIPLEX=stream`. A client turns both off with `WARDEN_MULTIPLEX=off` (every call
//! then has a stream of its own); servers always offer both. A process's calls to itself go in memory ([`crate::inproc`]), and a
//! client that must see what a remote client sees (`crate::network_channel`) never uses it.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use http_body::Frame;
use http_body_util::BodyExt as _;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::{AbortHandle, JoinSet};
use tonic::body::Body;
use tonic::codegen::Bytes;
use tonic::transport::Channel;
use tonic::{Status, Streaming};
use tower::ServiceExt as _;

use crate::inproc::{Local, call_routes, deadline_of};

pub mod frames;

/// The path of the stream.
pub const PATH: &str = "/warden.v1.Mux/Calls";

/// The most calls of one stream a server runs at once: a connection's bound on streams.
pub const MAX_IN_FLIGHT: usize = crate::MAX_CONCURRENT_STREAMS as usize;

/// The largest request body sent on the stream; a larger one goes on a stream of its own, so a
/// large request does not hold the small ones behind it in the stream's flow-control window.
pub const MAX_INLINE_BODY: usize = 256 << 10;

/// The largest answer body carried: a gRPC frame of the largest message a Warden client
/// decodes ([`crate::MAX_MESSAGE_BYTES`]). A larger answer is refused `RESOURCE_EXHAUSTED`, as
/// the client's decoder would refuse it.
pub const MAX_ANSWER_BODY: usize = crate::MAX_MESSAGE_BYTES + 5;

/// Room for a message's headers and trailers, together.
const MAX_HEADER_BYTES: usize = 64 << 10;

/// The most headers and trailers, together, of a message.
pub const MAX_HEADERS: usize = 256;

/// The largest answer.
pub const MAX_MUX_MESSAGE: usize = MAX_ANSWER_BODY + MAX_HEADER_BYTES + 1024;

/// The largest call (a server decodes no larger).
pub const MAX_CALL_MESSAGE: usize = MAX_INLINE_BODY + MAX_HEADER_BYTES + 1024;

/// How long a stopping server goes on with a stream after its go-away: it reads calls and
/// cancels, and answers, until the client has ended its side and every call is answered or
/// this has passed; then the calls still under way are dropped.
pub const STOP_GRACE: Duration = Duration::from_secs(10);

/// How long a client whose server does not serve the stream waits before asking again.
pub const REFUSED_RETRY: Duration = Duration::from_secs(60);

/// How long a client waits before opening a stream again after one failed or broke.
const BROKEN_RETRY: Duration = Duration::from_millis(500);

/// How long a client waits for a stream to open before it gives up on it (and asks again
/// after [`BROKEN_RETRY`]); its calls go alone meanwhile.
const OPEN_TIMEOUT: Duration = Duration::from_secs(5);

/// One unary call, or the cancellation of one.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Call {
    /// Unique among the stream's calls under way.
    #[prost(uint64, tag = "1")]
    pub id: u64,
    /// The method, e.g. `/warden.v1.Ledger/AppendEvents`.
    #[prost(string, tag = "2")]
    pub path: String,
    #[prost(message, repeated, tag = "3")]
    pub headers: Vec<Header>,
    /// The gRPC-framed request message.
    #[prost(bytes = "bytes", tag = "4")]
    pub body: Bytes,
    /// Drop the call `id` (its caller gave up); no answer follows.
    #[prost(bool, tag = "5")]
    pub cancel: bool,
    /// On a connection of frames ([`frames`]): the client sends no more calls (an HTTP/2
    /// stream ends its side with END_STREAM instead). A connection that closes without it was
    /// lost, and its calls are dropped.
    #[prost(bool, tag = "6")]
    pub end: bool,
    /// On a connection of frames: the client is there and asks whether the server is; the
    /// server answers at once with an [`Answer`] of id 0 (no call has it).
    #[prost(bool, tag = "7")]
    pub ping: bool,
}

/// The answer to one call, or the server's go-away.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Answer {
    #[prost(uint64, tag = "1")]
    pub id: u64,
    /// The HTTP status (200 for every gRPC answer).
    #[prost(uint32, tag = "2")]
    pub status: u32,
    #[prost(message, repeated, tag = "3")]
    pub headers: Vec<Header>,
    /// The gRPC-framed answer message, empty for an answer that is only a status.
    #[prost(bytes = "bytes", tag = "4")]
    pub body: Bytes,
    #[prost(message, repeated, tag = "5")]
    pub trailers: Vec<Header>,
    /// The server is stopping: send no more calls on this stream, and end it.
    #[prost(bool, tag = "6")]
    pub goaway: bool,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Header {
    #[prost(string, tag = "1")]
    pub name: String,
    #[prost(bytes = "bytes", tag = "2")]
    pub value: Bytes,
}

/// The paths of the unary methods of `warden.v1` and `grpc.health.v1`: the calls carried.
pub fn unary_methods() -> &'static HashSet<String> {
    static UNARY: OnceLock<HashSet<String>> = OnceLock::new();
    UNARY.get_or_init(|| {
        let mut paths = HashSet::new();
        for encoded in [warden_proto::FILE_DESCRIPTOR_SET, tonic_health::pb::FILE_DESCRIPTOR_SET] {
            // Both are compiled in; a set that did not decode would carry nothing.
            let Ok(set) = <prost_types::FileDescriptorSet as prost::Message>::decode(encoded) else { continue };
            for file in &set.file {
                for service in &file.service {
                    for method in &service.method {
                        if !method.client_streaming() && !method.server_streaming() {
                            paths.insert(format!("/{}.{}/{}", file.package(), service.name(), method.name()));
                        }
                    }
                }
            }
        }
        paths
    })
}

fn to_headers(map: &http::HeaderMap) -> Vec<Header> {
    map.iter()
        .map(|(name, value)| Header {
            name: name.as_str().to_string(),
            value: Bytes::copy_from_slice(value.as_bytes()),
        })
        .collect()
}

/// The headers of a message; `None` if one is not a valid header or there are more than
/// [`MAX_HEADERS`].
fn from_headers(headers: Vec<Header>) -> Option<http::HeaderMap> {
    if headers.len() > MAX_HEADERS {
        return None;
    }
    let mut map = http::HeaderMap::with_capacity(headers.len());
    for h in headers {
        let name = http::HeaderName::from_bytes(h.name.as_bytes()).ok()?;
        let value = http::HeaderValue::from_maybe_shared(h.value).ok()?;
        map.append(name, value);
    }
    Some(map)
}

fn headers_size(headers: &[Header]) -> usize {
    headers.iter().map(|h| h.name.len() + h.value.len()).sum()
}

// ---------------------------------------------------------------------------------------------
// The server side.

/// The response header in which a server tells its client how many of the stream's calls it
/// runs at once: the client sends no more than that on the stream (the rest go alone).
pub const IN_FLIGHT_HEADER: &str = "warden-mux-in-flight";

/// The most streams of calls one server serves at once. Each may run [`MAX_IN_FLIGHT`] calls:
/// a peer that opened more could hold more handlers than this many connections can. The mesh
/// opens one per channel; a client refused (`RESOURCE_EXHAUSTED`) calls alone.
pub const MAX_STREAMS: usize = 1024;

/// The most streams of calls one TCP connection may have served at once (a channel opens one;
/// one more may open while an ending one drains), so a connection holds at most a few times
/// the handlers HTTP/2 lets it hold, and cannot take every stream of the server.
pub const MAX_STREAMS_PER_CONNECTION: usize = 2;

/// The in-flight bound an [`IN_FLIGHT_HEADER`] value says, if it is one a client can keep.
fn bound_of(value: &[u8]) -> Option<usize> {
    std::str::from_utf8(value)
        .ok()?
        .parse::<usize>()
        .ok()
        .filter(|n| (1..=tokio::sync::Semaphore::MAX_PERMITS).contains(n))
}

/// The stream's route: calls handed to `local` (a server's routes behind its layers).
#[derive(Clone)]
pub(crate) struct Server {
    local: Local,
    stopping: watch::Receiver<()>,
    max_in_flight: usize,
    grace: Duration,
    unary: &'static HashSet<String>,
    /// A permit per stream served.
    streams: Arc<tokio::sync::Semaphore>,
    /// Streams served per TCP connection (local and remote address).
    per_connection: Arc<Mutex<HashMap<(SocketAddr, SocketAddr), usize>>>,
}

/// A stream counted against its connection's [`MAX_STREAMS_PER_CONNECTION`] while it lasts.
struct Counted {
    per_connection: Arc<Mutex<HashMap<(SocketAddr, SocketAddr), usize>>>,
    connection: Option<(SocketAddr, SocketAddr)>,
}

impl Counted {
    /// Counts a stream of `connection` (a Unix socket's have none), if it has room.
    fn count(
        per_connection: &Arc<Mutex<HashMap<(SocketAddr, SocketAddr), usize>>>,
        connection: Option<(SocketAddr, SocketAddr)>,
    ) -> Option<Counted> {
        if let Some(key) = connection {
            let mut counts = lock(per_connection);
            let count = counts.entry(key).or_default();
            if *count >= MAX_STREAMS_PER_CONNECTION {
                return None;
            }
            *count += 1;
        }
        Some(Counted { per_connection: per_connection.clone(), connection })
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        if let Some(key) = self.connection {
            let mut counts = lock(&self.per_connection);
            if let Some(count) = counts.get_mut(&key) {
                *count -= 1;
                if *count == 0 {
                    counts.remove(&key);
                }
            }
        }
    }
}

impl tonic::server::NamedService for Server {
    const NAME: &'static str = "warden.v1.Mux";
}

impl Server {
    /// Serves calls to `local` until `stopping` changes (or its sender is dropped).
    pub(crate) fn new(local: Local, stopping: watch::Receiver<()>) -> Server {
        Server {
            local,
            stopping,
            max_in_flight: MAX_IN_FLIGHT,
            grace: STOP_GRACE,
            unary: unary_methods(),
            streams: Arc::new(tokio::sync::Semaphore::new(MAX_STREAMS)),
            per_connection: Arc::default(),
        }
    }

    #[cfg(test)]
    fn with_limits(mut self, max_in_flight: usize, grace: Duration) -> Server {
        self.max_in_flight = max_in_flight;
        self.grace = grace;
        self
    }

    fn serve(
        &self,
        calls: Streaming<Call>,
        permit: (tokio::sync::OwnedSemaphorePermit, Counted),
    ) -> tokio_stream::wrappers::ReceiverStream<Result<Answer, Status>> {
        // Every answer comes from a task of the stream's, at most twice the bound of them, and
        // the go-away is sent only if there is room: the channel's room is what a client that
        // does not read can make the server hold.
        let (answers, out) = mpsc::channel(2 * self.max_in_flight + 1);
        tokio::spawn(drive(self.clone(), calls, answers, permit));
        tokio_stream::wrappers::ReceiverStream::new(out)
    }
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

impl tower::Service<http::Request<Body>> for Server {
    type Response = http::Response<Body>;
    type Error = std::convert::Infallible;
    type Future = BoxFuture<Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        let server = self.clone();
        Box::pin(async move {
            if request.uri().path() != PATH {
                return Ok(Status::unimplemented(format!("no method '{}'", request.uri().path())).into_http());
            }
            let connection = request
                .extensions()
                .get::<tonic::transport::server::TcpConnectInfo>()
                .and_then(|c| Some((c.local_addr()?, c.remote_addr()?)));
            let (Ok(permit), Some(counted)) =
                (server.streams.clone().try_acquire_owned(), Counted::count(&server.per_connection, connection))
            else {
                return Ok(Status::resource_exhausted("too many streams of calls are open; call alone").into_http());
            };
            let permit = (permit, counted);
            let mut grpc = tonic::server::Grpc::new(tonic_prost::ProstCodec::<Answer, Call>::default())
                .max_decoding_message_size(MAX_CALL_MESSAGE)
                .max_encoding_message_size(MAX_MUX_MESSAGE);
            let bound = tonic::metadata::MetadataValue::from(server.max_in_flight as u64);
            let mut permit = Some(permit);
            let open = tower::service_fn(move |calls: tonic::Request<Streaming<Call>>| {
                let opened = permit.take().map(|permit| {
                    let mut response = tonic::Response::new(server.serve(calls.into_inner(), permit));
                    response.metadata_mut().insert(IN_FLIGHT_HEADER, bound.clone());
                    response
                });
                // tonic calls it once per request.
                async move { opened.ok_or_else(|| Status::internal("the stream was opened twice")) }
            });
            Ok(grpc.streaming(open, request).await)
        })
    }
}

/// Reads a stream's calls and runs each in a task of its own, at most the bound of them at
/// once (the rest wait in their tasks, their deadlines running, up to the bound again; past
/// that the server reads no further). Cancels are read as they come and drop their call.
///
/// It ends when the client ends its side (after answering every call read, unless the client
/// went away), when the stream breaks (dropping every call under way, as a reset connection
/// does), or, once the server stops (go-away), when the client has ended its side and every
/// call is answered or the grace has passed (then the calls still under way are dropped and
/// the stream ends; their callers see a broken call).
async fn drive(
    server: Server,
    mut calls: impl futures::Stream<Item = Result<Call, Status>> + Unpin,
    answers: mpsc::Sender<Result<Answer, Status>>,
    _stream: (tokio::sync::OwnedSemaphorePermit, Counted),
) {
    use futures::StreamExt as _;
    let slots = Arc::new(tokio::sync::Semaphore::new(server.max_in_flight));
    let mut running: JoinSet<u64> = JoinSet::new();
    let mut handles: HashMap<u64, AbortHandle> = HashMap::new();
    let mut stopping = server.stopping.clone();
    // Room for the go-away, whatever the answers waiting to be sent.
    let Ok(mut goaway) = answers.clone().reserve_owned().await.map(Some) else { return };
    let mut cutoff: Option<Pin<Box<tokio::time::Sleep>>> = None;
    let mut reading = true;
    loop {
        if !reading && running.is_empty() {
            return;
        }
        tokio::select! {
            biased;
            () = answers.closed() => return,
            () = async { cutoff.as_mut().expect("guarded").await }, if cutoff.is_some() => {
                // Past the grace: no more calls are read; those under way finish (as HTTP/2's
                // graceful stop lets a stream finish), unless the client does not read their
                // answers, which would hold the stop for good.
                reading = false;
                if answers.capacity() == 0 {
                    return;
                }
                cutoff = Some(Box::pin(tokio::time::sleep(server.grace)));
            }
            Some(done) = running.join_next(), if !running.is_empty() => {
                // A cancelled call's handle went when it was cancelled.
                if let Ok(id) = done {
                    handles.remove(&id);
                }
            }
            _ = stopping.changed(), if cutoff.is_none() => {
                if let Some(goaway) = goaway.take() {
                    goaway.send(Ok(Answer { goaway: true, ..Default::default() }));
                }
                cutoff = Some(Box::pin(tokio::time::sleep(server.grace)));
            }
            read = calls.next(), if reading && running.len() < 2 * server.max_in_flight => match read.transpose() {
                Ok(Some(call)) if call.ping => {
                    // No room means the client is not reading its answers: it hears nothing.
                    let _ = answers.try_send(Ok(Answer { id: 0, status: 200, ..Default::default() }));
                }
                Ok(Some(call)) if call.cancel => {
                    if let Some(handle) = handles.remove(&call.id) {
                        handle.abort();
                    }
                }
                Ok(Some(call)) => {
                    if handles.contains_key(&call.id) {
                        // The client's defect; its answers could no longer be told apart.
                        tracing::warn!(id = call.id, "a stream of calls reused the id of a call under way; ending it");
                        return;
                    }
                    let id = call.id;
                    let request = request_of(call, server.unary);
                    let (local, answers, slots) = (server.local.clone(), answers.clone(), slots.clone());
                    let handle = running.spawn(async move {
                        let answer = match request {
                            Ok(request) => run(id, local, request, slots).await,
                            Err(status) => answer_status(id, status),
                        };
                        let _ = answers.send(Ok(answer)).await;
                        id
                    });
                    handles.insert(id, handle);
                }
                Ok(None) => reading = false,
                Err(_) => return,
            },
        }
    }
}

/// Runs a call once a slot is free, within its deadline counted from when it was read: the
/// answer its routes give, `CANCELLED "Timeout expired"` past the deadline (as tonic's server
/// answers), `CANCELLED` if anything under it panics.
async fn run(id: u64, local: Local, request: http::Request<Body>, slots: Arc<tokio::sync::Semaphore>) -> Answer {
    use futures::FutureExt as _;
    let deadline = deadline_of(request.headers());
    let answered = async move {
        let Ok(_slot) = slots.acquire_owned().await else {
            return answer_status(id, Status::unavailable("the stream of calls is closing"));
        };
        // The deadline is kept here, over the wait for a slot too: the routes need no timer of
        // their own.
        answer_of(id, call_routes(local, request).await).await
    };
    let answered = std::panic::AssertUnwindSafe(answered).catch_unwind();
    let answered = match deadline {
        Some(deadline) => match tokio::time::timeout(deadline, answered).await {
            Ok(answered) => answered,
            Err(_) => return answer_status(id, Status::cancelled("Timeout expired")),
        },
        None => answered.await,
    };
    answered.unwrap_or_else(|_| {
        tracing::error!("a handler panicked under a call of a stream of calls");
        answer_status(id, Status::cancelled("the handler stopped"))
    })
}

/// The HTTP request a call makes, as a client's own stream would have carried it.
fn request_of(call: Call, unary: &HashSet<String>) -> Result<http::Request<Body>, Status> {
    if !unary.contains(&call.path) {
        return Err(Status::unimplemented(format!("'{}' is not a unary Warden method", call.path)));
    }
    let headers = from_headers(call.headers).ok_or_else(|| {
        Status::invalid_argument(format!("a call's headers are not valid headers (at most {MAX_HEADERS})"))
    })?;
    let mut request = http::Request::new(Body::new(http_body_util::Full::new(call.body)));
    *request.method_mut() = http::Method::POST;
    *request.version_mut() = http::Version::HTTP_2;
    *request.uri_mut() = call.path.parse().map_err(|_| Status::invalid_argument("a call's path is not valid"))?;
    *request.headers_mut() = headers;
    Ok(request)
}

/// The answer a response makes: its headers, its whole body (up to [`MAX_ANSWER_BODY`]) and
/// its trailers.
async fn answer_of(id: u64, response: http::Response<Body>) -> Answer {
    let (parts, body) = response.into_parts();
    let mut answer = Answer {
        id,
        status: u32::from(parts.status.as_u16()),
        headers: to_headers(&parts.headers),
        ..Default::default()
    };
    match http_body_util::Limited::new(body, MAX_ANSWER_BODY).collect().await {
        Ok(collected) => {
            if let Some(trailers) = collected.trailers() {
                answer.trailers = to_headers(trailers);
            }
            // A unary answer is one frame: taken as it is, not copied.
            answer.body = collected.to_bytes();
        }
        Err(e) => {
            let status = match e.downcast::<Status>() {
                Ok(status) => *status,
                Err(e) if e.is::<http_body_util::LengthLimitError>() => Status::resource_exhausted(format!(
                    "the answer is larger than the {MAX_ANSWER_BODY} bytes a stream of calls carries"
                )),
                Err(e) => Status::internal(format!("the answer's body failed: {e}")),
            };
            // The headers sent, then the error's status in the trailers.
            let mut trailers = http::HeaderMap::new();
            let _ = status.add_header(&mut trailers);
            answer.trailers = to_headers(&trailers);
        }
    }
    let (headers, trailers) = (&answer.headers, &answer.trailers);
    if headers.len() + trailers.len() > MAX_HEADERS || headers_size(headers) + headers_size(trailers) > MAX_HEADER_BYTES
    {
        return answer_status(id, Status::internal("the answer's headers are too large to carry"));
    }
    if prost::Message::encoded_len(&answer) > MAX_MUX_MESSAGE {
        return answer_status(id, Status::resource_exhausted("the answer is too large to carry"));
    }
    answer
}

/// A trailers-only answer of `status`.
fn answer_status(id: u64, status: Status) -> Answer {
    let response = status.into_http::<Body>();
    Answer { id, status: 200, headers: to_headers(response.headers()), ..Default::default() }
}

// ---------------------------------------------------------------------------------------------
// The client side.

/// What a client carries its unary calls on when it does not make each a stream of its own.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Carrier {
    /// One long-lived HTTP/2 stream of the channel's connection (`/warden.v1.Mux/Calls`).
    Stream,
    /// A TCP connection of its own in plain frames ([`frames`]); a Unix socket's endpoint is
    /// reached on an HTTP/2 stream instead.
    Frames,
}

/// How this process's clients carry their calls (`WARDEN_MULTIPLEX`): `off` (a stream per
/// call; also `0`, `false`, `no`), `stream` (one HTTP/2 stream per connection), anything else
/// or unset: frames.
pub fn carrier() -> Option<Carrier> {
    static CARRIER: OnceLock<Option<Carrier>> = OnceLock::new();
    *CARRIER.get_or_init(|| match std::env::var("WARDEN_MULTIPLEX").unwrap_or_default().to_ascii_lowercase().as_str() {
        "0" | "off" | "false" | "no" => None,
        "stream" | "h2" | "http2" => Some(Carrier::Stream),
        _ => Some(Carrier::Frames),
    })
}

/// A channel's stream, shared by its clones.
#[derive(Clone)]
pub(crate) struct Client {
    shared: Arc<Shared>,
}

struct Shared {
    channel: Channel,
    state: Mutex<State>,
    unary: &'static HashSet<String>,
    /// The `host:port` to open a connection of frames to; an HTTP/2 stream if `None`.
    frames: Option<String>,
}

enum State {
    /// No stream; open one at the next call made after the instant.
    Idle(Instant),
    Opening,
    Open(Arc<Live>),
}

/// One open stream.
struct Live {
    /// `None` once the stream is ending: nothing more is sent on it.
    calls: Mutex<Option<mpsc::UnboundedSender<Call>>>,
    waiting: Mutex<HashMap<u64, oneshot::Sender<Result<Answer, Status>>>>,
    next: AtomicU64,
    /// A permit per call sent and neither answered nor cancelled: the server's bound.
    slots: Arc<tokio::sync::Semaphore>,
    /// The server said go away: no new call is sent; the stream ends once none is waiting.
    closing: AtomicBool,
}

impl Live {
    /// A stream open with `calls` to send on, the server running at most `bound` of them.
    fn new(calls: mpsc::UnboundedSender<Call>, bound: usize) -> Live {
        Live {
            calls: Mutex::new(Some(calls)),
            waiting: Mutex::default(),
            next: AtomicU64::new(1),
            slots: Arc::new(tokio::sync::Semaphore::new(bound)),
            closing: AtomicBool::new(false),
        }
    }

    /// Ends the stream (the server then ends it too) if it is closing and no call waits.
    fn end_if_idle(&self) {
        if self.closing.load(Ordering::SeqCst) {
            // `calls` before `waiting`, as everywhere both are held.
            let mut calls = lock(&self.calls);
            if lock(&self.waiting).is_empty() {
                calls.take();
            }
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // Every holder leaves the maps and the state whole between statements.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Client {
    /// Carries the calls of `channel`, a channel to `endpoint`, on `carrier`.
    pub(crate) fn new(channel: Channel, endpoint: &str, carrier: Carrier) -> Client {
        let frames = match carrier {
            Carrier::Frames => frames::target_of(endpoint),
            Carrier::Stream => None,
        };
        Client {
            shared: Arc::new(Shared {
                channel,
                state: Mutex::new(State::Idle(Instant::now())),
                unary: unary_methods(),
                frames,
            }),
        }
    }

    /// Makes `request`: on the stream when it is open and the call is one it carries, on a
    /// stream of its own otherwise.
    pub(crate) fn call(
        &self,
        request: http::Request<Body>,
    ) -> BoxFuture<Result<http::Response<Body>, tonic::codegen::StdError>> {
        let live = if self.shared.unary.contains(request.uri().path()) { self.live() } else { None };
        let channel = self.shared.channel.clone();
        match live {
            Some(live) => Box::pin(carry(live, channel, request)),
            None => Box::pin(async move { channel.oneshot(request).await.map_err(Into::into) }),
        }
    }

    /// The open stream; if there is none, opens one (in the background) when it is time to.
    fn live(&self) -> Option<Arc<Live>> {
        let mut state = lock(&self.shared.state);
        match &*state {
            State::Open(live) => return Some(live.clone()),
            State::Opening => return None,
            State::Idle(after) if Instant::now() < *after => return None,
            State::Idle(_) => {}
        }
        *state = State::Opening;
        drop(state);
        let shared = self.shared.clone();
        tokio::spawn(async move {
            let opening = async {
                match &shared.frames {
                    Some(target) => frames::open(&shared, target).await,
                    None => open(&shared).await,
                }
            };
            let opened = tokio::time::timeout(OPEN_TIMEOUT, opening)
                .await
                .unwrap_or_else(|_| Err(Status::deadline_exceeded("the stream of calls did not open in time")));
            let mut state = lock(&shared.state);
            *state = match opened {
                // Unless it ended already (its reader found the state `Opening` and left it).
                Ok(live) if lock(&live.calls).is_some() => State::Open(live),
                Ok(_) => State::Idle(Instant::now() + BROKEN_RETRY),
                Err(status) => {
                    tracing::debug!(%status, "no stream of calls; calls go alone");
                    let refused = matches!(status.code(), tonic::Code::Unimplemented | tonic::Code::ResourceExhausted);
                    State::Idle(Instant::now() + if refused { REFUSED_RETRY } else { BROKEN_RETRY })
                }
            };
        });
        None
    }
}

/// Opens a stream and starts reading its answers.
async fn open(shared: &Arc<Shared>) -> Result<Arc<Live>, Status> {
    let (calls, outgoing) = mpsc::unbounded_channel();
    let mut grpc = tonic::client::Grpc::new(shared.channel.clone())
        .max_decoding_message_size(MAX_MUX_MESSAGE)
        .max_encoding_message_size(MAX_CALL_MESSAGE);
    grpc.ready().await.map_err(|e| Status::from_error(e.into()))?;
    let outgoing = tokio_stream::wrappers::UnboundedReceiverStream::new(outgoing);
    let answers = grpc
        .streaming(
            tonic::Request::new(outgoing),
            http::uri::PathAndQuery::from_static(PATH),
            tonic_prost::ProstCodec::<Call, Answer>::default(),
        )
        .await?;
    let bound = answers
        .metadata()
        .get(IN_FLIGHT_HEADER)
        .and_then(|v| bound_of(v.as_bytes()))
        .ok_or_else(|| Status::internal("the server did not say how many calls it runs at once"))?;
    let live = Arc::new(Live::new(calls, bound));
    tokio::spawn(read(Arc::downgrade(shared), Arc::downgrade(&live), answers.into_inner()));
    Ok(live)
}

/// Hands each answer to its caller until the stream ends; then fails the calls still waiting
/// and lets the next call open a stream again. It holds the channel and the stream's state
/// only weakly: once every clone of the channel and every call under way are gone, so is the
/// stream's sender, the stream ends, and so does this task.
async fn read(
    shared: Weak<Shared>,
    live: Weak<Live>,
    mut answers: impl futures::Stream<Item = Result<Answer, Status>> + Unpin,
) {
    use futures::StreamExt as _;
    let ended = loop {
        match answers.next().await.transpose() {
            Ok(Some(answer)) if answer.goaway => {
                if let Some(live) = live.upgrade() {
                    live.closing.store(true, Ordering::SeqCst);
                    live.end_if_idle();
                }
                forget(&shared, &live, Instant::now() + BROKEN_RETRY);
            }
            Ok(Some(answer)) => {
                if let Some(live) = live.upgrade() {
                    let caller = lock(&live.waiting).remove(&answer.id);
                    if let Some(caller) = caller {
                        let _ = caller.send(Ok(answer));
                    }
                    live.end_if_idle();
                }
            }
            Ok(None) => break Status::unavailable("the server ended the stream of calls"),
            Err(status) => break status,
        }
    };
    if let Some(live) = live.upgrade() {
        // First, so that an opener that has not yet installed it sees it ended.
        lock(&live.calls).take();
    }
    forget(&shared, &live, Instant::now() + BROKEN_RETRY);
    let Some(live) = live.upgrade() else { return };
    let waiting = std::mem::take(&mut *lock(&live.waiting));
    if !waiting.is_empty() {
        tracing::debug!(calls = waiting.len(), status = %ended, "a stream of calls ended under calls");
    }
    for (_, caller) in waiting {
        let _ = caller.send(Err(broken(&ended)));
    }
}

/// Makes the state idle if `live` is still the open stream.
fn forget(shared: &Weak<Shared>, live: &Weak<Live>, after: Instant) {
    let Some(shared) = shared.upgrade() else { return };
    let mut state = lock(&shared.state);
    if matches!(&*state, State::Open(open) if std::ptr::eq(Arc::as_ptr(open), live.as_ptr())) {
        *state = State::Idle(after);
    }
}

/// The status of a call the stream broke under: the client's transport failed, the callee did
/// not answer (see [`crate::broke_off`]).
fn broken(ended: &Status) -> Status {
    let mut status = Status::unavailable(format!("the stream of calls broke under the call: {}", ended.message()));
    status
        .set_source(Arc::new(std::io::Error::new(std::io::ErrorKind::ConnectionAborted, ended.message().to_string())));
    status
}

/// Sends the call of `request` on `live` and waits for its answer; alone when its body is too
/// large for the stream, the server runs as many of the stream's calls as it will, or the
/// stream is ending.
async fn carry(
    live: Arc<Live>,
    channel: Channel,
    request: http::Request<Body>,
) -> Result<http::Response<Body>, tonic::codegen::StdError> {
    let (parts, body) = request.into_parts();
    let body = body.collect().await?.to_bytes();
    let alone = |parts, body| async move {
        let request = http::Request::from_parts(parts, Body::new(http_body_util::Full::new(body)));
        channel.oneshot(request).await.map_err(Into::into)
    };
    let slot = live.slots.clone().try_acquire_owned();
    let (Ok(slot), false) = (slot, body.len() > MAX_INLINE_BODY || live.closing.load(Ordering::SeqCst)) else {
        drop(live);
        return alone(parts, body).await;
    };
    let deadline = deadline_of(&parts.headers);
    let id = live.next.fetch_add(1, Ordering::Relaxed);
    let (answered, answer) = oneshot::channel();
    lock(&live.waiting).insert(id, answered);
    let call = Call {
        id,
        path: parts.uri.path().to_string(),
        headers: to_headers(&parts.headers),
        body: body.clone(),
        cancel: false,
        end: false,
        ping: false,
    };
    // One the server would refuse to decode would end the stream under every call on it.
    let fits = call.headers.len() <= MAX_HEADERS && prost::Message::encoded_len(&call) <= MAX_CALL_MESSAGE;
    let sent = fits && lock(&live.calls).as_ref().is_some_and(|calls| calls.send(call).is_ok());
    if !sent {
        lock(&live.waiting).remove(&id);
        drop((slot, live));
        return alone(parts, body).await;
    }
    let mut pending = Pending { live: &live, id: Some(id), _slot: slot };
    let answer = match deadline {
        Some(deadline) => match tokio::time::timeout(deadline, answer).await {
            Ok(answer) => answer,
            // As tonic's channel answers a call past its deadline (the cancel follows on drop).
            Err(_) => return Err(Box::new(tonic::TimeoutExpired(()))),
        },
        None => answer.await,
    };
    pending.id = None;
    match answer {
        Ok(Ok(answer)) => Ok(response_of(answer)),
        Ok(Err(status)) => Err(Box::new(status)),
        // The reader dropped the call without an answer: only as the stream ends.
        Err(_) => Err(Box::new(broken(&Status::unavailable("the stream of calls ended")))),
    }
}

/// A call sent and not yet answered: dropping it cancels the call on the server. Its slot is
/// freed with it: the server reads the cancel before any call sent after it.
struct Pending<'a> {
    live: &'a Live,
    id: Option<u64>,
    _slot: tokio::sync::OwnedSemaphorePermit,
}

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        if let Some(id) = self.id {
            // Under `calls`, so the stream cannot end between the call leaving `waiting` and
            // its cancel being sent.
            let calls = lock(&self.live.calls);
            let waited = lock(&self.live.waiting).remove(&id).is_some();
            if waited && let Some(calls) = calls.as_ref() {
                let _ = calls.send(Call { id, cancel: true, ..Default::default() });
            }
            drop(calls);
            if waited {
                self.live.end_if_idle();
            }
        }
    }
}

/// The response an answer makes, as its own stream would have brought it.
fn response_of(answer: Answer) -> http::Response<Body> {
    let status = u16::try_from(answer.status).ok().and_then(|s| http::StatusCode::from_u16(s).ok());
    let headers = from_headers(answer.headers);
    let trailers = from_headers(answer.trailers);
    let (Some(status), Some(headers), Some(trailers)) = (status, headers, trailers) else {
        return Status::internal("the server's answer is not a valid response").into_http();
    };
    let body = Answered {
        data: (!answer.body.is_empty()).then_some(answer.body),
        trailers: (!trailers.is_empty()).then_some(trailers),
    };
    let mut response = http::Response::new(Body::new(body));
    *response.status_mut() = status;
    *response.headers_mut() = headers;
    response
}

/// An answer's body: its data, then its trailers.
struct Answered {
    data: Option<Bytes>,
    trailers: Option<http::HeaderMap>,
}

impl http_body::Body for Answered {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(mut self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        if let Some(data) = self.data.take() {
            return Poll::Ready(Some(Ok(Frame::data(data))));
        }
        Poll::Ready(self.trailers.take().map(|t| Ok(Frame::trailers(t))))
    }

    fn is_end_stream(&self) -> bool {
        self.data.is_none() && self.trailers.is_none()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        http_body::SizeHint::with_exact(self.data.as_ref().map_or(0, |d| d.len() as u64))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    use tonic::service::Routes;
    use tonic::{Code, Status};

    use super::{Answer, Call, Carrier, Header};

    /// Each of these runs twice: its calls carried on an HTTP/2 stream, and in frames.
    macro_rules! on_both_carriers {
        ($($name:ident),* $(,)?) => {
            $(
                mod $name {
                    #[tokio::test]
                    async fn on_a_stream() {
                        super::$name(super::Carrier::Stream).await
                    }
                    #[tokio::test]
                    async fn in_frames() {
                        super::$name(super::Carrier::Frames).await
                    }
                }
            )*
        };
    }

    on_both_carriers!(
        unary_calls_go_on_one_stream_and_are_answered_as_on_streams_of_their_own,
        a_stream_ends_with_its_channel,
        a_server_without_the_stream_is_called_alone,
        deadlines_cancellations_and_panics_end_the_handler_as_alone,
        a_stream_carries_at_most_its_bound_and_a_cancel_frees_a_slot,
        each_carried_call_is_authenticated_on_its_own,
        a_stop_answers_every_call_read_and_ends_the_stream,
        a_call_under_a_broken_stream_broke_off,
    );

    /// A channel to `endpoint` whose calls are carried on `carrier`, with the process's token.
    fn channel(endpoint: &str, carrier: Carrier) -> crate::auth::Ch {
        channel_with(endpoint, crate::auth::Bearer::process(), carrier)
    }

    fn channel_with_token(endpoint: &str, token: &str, carrier: Carrier) -> crate::auth::Ch {
        channel_with(endpoint, crate::auth::Bearer::new(Some(token)).expect("token"), carrier)
    }

    fn channel_with(endpoint: &str, bearer: crate::auth::Bearer, carrier: Carrier) -> crate::auth::Ch {
        let network = crate::network(endpoint).expect("endpoint").connect_lazy();
        let link = crate::inproc::Link::to(endpoint, network, Some(carrier));
        tonic::service::interceptor::InterceptedService::new(crate::eager::Eager::new(link), bearer)
    }

    /// A unary service at `warden.v1.Ledger`'s paths whose request and answer are a
    /// [`Header`]: `echo` answers whether the call came on the shared stream (`carried`: no
    /// connection of its own) or alone; `refuse` answers a field violation; `panic` panics;
    /// `hold` waits for a permit of `gate`.
    #[derive(Clone)]
    struct Probe {
        gate: Arc<tokio::sync::Semaphore>,
        running: Arc<AtomicUsize>,
        most: Arc<AtomicUsize>,
        ended: Arc<AtomicUsize>,
    }

    impl Default for Probe {
        fn default() -> Probe {
            Probe {
                gate: Arc::new(tokio::sync::Semaphore::new(0)),
                running: Arc::default(),
                most: Arc::default(),
                ended: Arc::default(),
            }
        }
    }

    impl tonic::server::NamedService for Probe {
        const NAME: &'static str = "warden.v1.Ledger";
    }

    /// A held call under way.
    struct Running(Probe);

    impl Running {
        fn new(probe: &Probe) -> Running {
            let now = probe.running.fetch_add(1, Ordering::SeqCst) + 1;
            probe.most.fetch_max(now, Ordering::SeqCst);
            Running(probe.clone())
        }
    }

    impl Drop for Running {
        fn drop(&mut self) {
            self.0.running.fetch_sub(1, Ordering::SeqCst);
            self.0.ended.fetch_add(1, Ordering::SeqCst);
        }
    }

    impl tower::Service<http::Request<tonic::body::Body>> for Probe {
        type Response = http::Response<tonic::body::Body>;
        type Error = std::convert::Infallible;
        type Future = super::BoxFuture<Result<Self::Response, Self::Error>>;

        fn poll_ready(&mut self, _: &mut std::task::Context<'_>) -> std::task::Poll<Result<(), Self::Error>> {
            std::task::Poll::Ready(Ok(()))
        }

        fn call(&mut self, request: http::Request<tonic::body::Body>) -> Self::Future {
            let carried = request.extensions().get::<tonic::transport::server::TcpConnectInfo>().is_none();
            if request.uri().path().ends_with("/VerifyRun") {
                // An answer whose body panics as it is read.
                return Box::pin(async { Ok(http::Response::new(tonic::body::Body::new(PanickingBody))) });
            }
            let probe = self.clone();
            Box::pin(async move {
                let mut grpc = tonic::server::Grpc::new(tonic_prost::ProstCodec::<Header, Header>::default());
                let answer = tower::service_fn(move |asked: tonic::Request<Header>| {
                    let probe = probe.clone();
                    async move {
                        let asked = asked.into_inner();
                        match asked.name.as_str() {
                            "refuse" => Err(crate::invalid_field("value", "refused by the probe")),
                            "panic" => panic!("the probe's defect"),
                            "hold" => {
                                let _running = Running::new(&probe);
                                probe.gate.acquire().await.expect("gate").forget();
                                let name = if carried { "held carried" } else { "held alone" }.to_string();
                                Ok(tonic::Response::new(Header { name, value: asked.value }))
                            }
                            _ => {
                                let name = if carried { "carried" } else { "alone" }.to_string();
                                Ok(tonic::Response::new(Header { name, value: asked.value }))
                            }
                        }
                    }
                });
                Ok(grpc.unary(answer, request).await)
            })
        }
    }

    /// A body that panics when polled.
    struct PanickingBody;

    impl http_body::Body for PanickingBody {
        type Data = tonic::codegen::Bytes;
        type Error = Status;

        fn poll_frame(
            self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Option<Result<http_body::Frame<Self::Data>, Status>>> {
            panic!("the body's defect")
        }
    }

    type Served = tokio::task::JoinHandle<Result<(), tonic::transport::Error>>;

    /// A server of `routes` (and, if `mux`, the shared stream running at most that many calls
    /// at once) on a port of its own; its endpoint, its stop, and its task.
    async fn serve(routes: Routes, mux: Option<usize>) -> (String, tokio::sync::watch::Sender<()>, Served) {
        let (endpoint, stop, server, _) = serve_counted(routes, mux, super::STOP_GRACE).await;
        (endpoint, stop, server)
    }

    /// [`serve`] with a stop's grace of `grace`, and the server's permits of streams (those
    /// not available are streams served).
    async fn serve_counted(
        routes: Routes,
        mux: Option<usize>,
        grace: Duration,
    ) -> (String, tokio::sync::watch::Sender<()>, Served, Arc<tokio::sync::Semaphore>) {
        use tower::Layer as _;
        let listener = crate::bind("127.0.0.1:0").await.expect("bind");
        let endpoint = crate::endpoint_of(listener.local_addr().expect("addr"));
        let (stop, stopping) = tokio::sync::watch::channel(());
        let local = crate::inproc::Local::new(warden_telemetry::grpc::ServerLayer.layer(routes.clone()));
        let mux_server = super::Server::new(local, stopping.clone()).with_limits(mux.unwrap_or(1), grace);
        let streams = mux_server.streams.clone();
        let frames_server = mux_server.clone();
        let routes = match mux {
            Some(_) => routes.add_service(mux_server),
            None => routes,
        };
        let mut stopped = stopping.clone();
        let stop_served = async move {
            let _ = stopped.changed().await;
        };
        let server = match mux {
            // The server of every Warden service: HTTP/2 and connections of frames on one port.
            Some(_) => {
                let (incoming, drained) = super::frames::sort(listener, frames_server, stopping.clone());
                tokio::spawn(async move {
                    let served = tonic::transport::Server::builder()
                        .add_routes(routes)
                        .serve_with_incoming_shutdown(incoming, stop_served)
                        .await;
                    drained.await;
                    served
                })
            }
            // An older server: HTTP/2 alone.
            None => {
                let incoming = tonic::transport::server::TcpIncoming::from(listener);
                tokio::spawn(
                    tonic::transport::Server::builder()
                        .add_routes(routes)
                        .serve_with_incoming_shutdown(incoming, stop_served),
                )
            }
        };
        (endpoint, stop, server, streams)
    }

    async fn ask(channel: crate::auth::Ch, name: &str, timeout: Option<Duration>) -> Result<Header, Status> {
        ask_with(channel, name, "payload".to_string(), timeout).await
    }

    async fn ask_with(
        channel: crate::auth::Ch,
        name: &str,
        value: String,
        timeout: Option<Duration>,
    ) -> Result<Header, Status> {
        let mut grpc = tonic::client::Grpc::new(channel);
        grpc.ready().await.map_err(Status::from_error)?;
        let mut request = tonic::Request::new(Header { name: name.into(), value: value.into() });
        if let Some(t) = timeout {
            request.set_timeout(t);
        }
        let path = http::uri::PathAndQuery::from_static("/warden.v1.Ledger/GetRun");
        let call = grpc.unary(request, path, tonic_prost::ProstCodec::<Header, Header>::default());
        // A call that hangs fails the test instead of holding it.
        Ok(tokio::time::timeout(Duration::from_secs(60), call).await.expect("the call ends")?.into_inner())
    }

    /// Asks `echo` until an answer came on the shared stream (the first call opens it); the
    /// number of calls that went alone before.
    async fn until_carried(channel: &crate::auth::Ch) -> usize {
        for alone in 0..200 {
            let answer = ask(channel.clone(), "echo", None).await.expect("echo");
            assert_eq!(answer.value, "payload");
            if answer.name == "carried" {
                return alone;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("no call went on the shared stream");
    }

    /// Waits (a bounded while) until `f` holds.
    async fn eventually(what: &str, f: impl Fn() -> bool) {
        for _ in 0..500 {
            if f() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("never: {what}");
    }

    #[test]
    fn only_unary_methods_are_carried() {
        let unary = super::unary_methods();
        for path in [
            "/warden.v1.Ledger/AppendEvents",
            "/warden.v1.Policy/Authorize",
            "/warden.v1.ToolHost/Invoke",
            "/warden.v1.Runs/WaitRun",
            "/grpc.health.v1.Health/Check",
        ] {
            assert!(unary.contains(path), "{path}");
        }
        for path in ["/warden.v1.Ledger/StreamEvents", "/grpc.health.v1.Health/Watch", super::PATH] {
            assert!(!unary.contains(path), "{path}");
        }
    }

    /// Calls go alone until the stream is open, then on it, answered as alone: messages,
    /// statuses and their details alike.
    async fn unary_calls_go_on_one_stream_and_are_answered_as_on_streams_of_their_own(carrier: Carrier) {
        let (endpoint, stop, server) = serve(Routes::new(Probe::default()), Some(64)).await;
        let channel = channel(&endpoint, carrier);
        let first = ask(channel.clone(), "echo", None).await.expect("echo");
        assert_eq!(first.name, "alone", "the first call opens the stream and goes alone");
        until_carried(&channel).await;
        let concurrent =
            futures::future::join_all((0..50).map(|i| ask_with(channel.clone(), "echo", format!("call {i}"), None)))
                .await;
        for (i, answer) in concurrent.into_iter().enumerate() {
            let answer = answer.expect("echo");
            assert_eq!((answer.name.as_str(), answer.value), ("carried", format!("call {i}").into_bytes().into()));
        }
        let refused = ask(channel.clone(), "refuse", None).await.expect_err("refused");
        assert_eq!(refused.code(), Code::InvalidArgument);
        assert_eq!(crate::field_violations(&refused), vec![("value".to_string(), "refused by the probe".to_string())]);
        assert!(!crate::broke_off(&refused), "the callee's own answer");
        let _ = stop.send(());
        server.await.expect("task").expect("served");
    }

    /// A channel's stream lasts as long as the channel: once every clone of it is gone, the
    /// stream ends and the server serves it no more.
    async fn a_stream_ends_with_its_channel(carrier: Carrier) {
        let (endpoint, stop, server, streams) =
            serve_counted(Routes::new(Probe::default()), Some(4), super::STOP_GRACE).await;
        let open = move || super::MAX_STREAMS - streams.available_permits();
        let channel = channel(&endpoint, carrier);
        until_carried(&channel).await;
        assert_eq!(open(), 1, "one stream served");
        drop(channel);
        eventually("the stream ends", || open() == 0).await;
        let _ = stop.send(());
        server.await.expect("task").expect("served");
    }

    /// A server without the stream (an older one) answers every call alone.
    async fn a_server_without_the_stream_is_called_alone(carrier: Carrier) {
        let (endpoint, stop, server) = serve(Routes::new(Probe::default()), None).await;
        let channel = channel(&endpoint, carrier);
        for _ in 0..20 {
            assert_eq!(ask(channel.clone(), "echo", None).await.expect("echo").name, "alone");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let _ = stop.send(());
        server.await.expect("task").expect("served");
    }

    /// A carried call past its deadline is answered as one alone (`CANCELLED`), and its handler
    /// is dropped; so is the handler of a call whose caller gave up; a handler's panic is
    /// answered `CANCELLED` and the stream goes on.
    async fn deadlines_cancellations_and_panics_end_the_handler_as_alone(carrier: Carrier) {
        let probe = Probe::default();
        let (endpoint, stop, server) = serve(Routes::new(probe.clone()), Some(64)).await;
        let channel = channel(&endpoint, carrier);
        until_carried(&channel).await;

        let overdue = ask(channel.clone(), "hold", Some(Duration::from_millis(50))).await.expect_err("overdue");
        assert_eq!(overdue.code(), Code::Cancelled, "{overdue:?}");
        eventually("the overdue handler is dropped", || probe.ended.load(Ordering::SeqCst) == 1).await;

        let abandoned = tokio::spawn(ask(channel.clone(), "hold", None));
        eventually("the held call runs", || probe.running.load(Ordering::SeqCst) == 1).await;
        abandoned.abort();
        eventually("the abandoned handler is dropped", || probe.ended.load(Ordering::SeqCst) == 2).await;

        let panicked = ask(channel.clone(), "panic", None).await.expect_err("panicked");
        assert_eq!(panicked.code(), Code::Cancelled, "{panicked:?}");
        // A panic while the answer's body is read, past the handler, is answered the same way.
        let mut grpc = tonic::client::Grpc::new(channel.clone());
        grpc.ready().await.expect("ready");
        let path = http::uri::PathAndQuery::from_static("/warden.v1.Ledger/VerifyRun");
        let asked = tonic::Request::new(Header::default());
        let call = grpc.unary(asked, path, tonic_prost::ProstCodec::<Header, Header>::default());
        let body_panicked = tokio::time::timeout(Duration::from_secs(60), call)
            .await
            .expect("answered")
            .expect_err("the body panicked");
        assert_eq!(body_panicked.code(), Code::Cancelled, "{body_panicked:?}");
        assert_eq!(ask(channel.clone(), "echo", None).await.expect("echo").name, "carried");
        let _ = stop.send(());
        server.await.expect("task").expect("served");
    }

    /// A client sends no more calls on the stream than the server runs at once (it said how
    /// many when the stream opened); the rest go alone. A cancelled call frees its slot.
    async fn a_stream_carries_at_most_its_bound_and_a_cancel_frees_a_slot(carrier: Carrier) {
        let probe = Probe::default();
        let (endpoint, stop, server) = serve(Routes::new(probe.clone()), Some(2)).await;
        let channel = channel(&endpoint, carrier);
        until_carried(&channel).await;
        let carried: Vec<_> = (0..2).map(|_| tokio::spawn(ask(channel.clone(), "hold", None))).collect();
        eventually("two calls run", || probe.running.load(Ordering::SeqCst) == 2).await;
        let third = tokio::spawn(ask(channel.clone(), "hold", None));
        eventually("the third runs too", || probe.running.load(Ordering::SeqCst) == 3).await;
        assert_eq!(ask(channel.clone(), "echo", None).await.expect("echo").name, "alone", "the stream is full");
        carried[0].abort();
        eventually("the cancelled handler is dropped", || probe.ended.load(Ordering::SeqCst) == 1).await;
        for _ in 0..100 {
            // The slot is freed once the cancelled caller's task has ended.
            if ask(channel.clone(), "echo", None).await.expect("echo").name == "carried" {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(ask(channel.clone(), "echo", None).await.expect("echo").name, "carried");
        probe.gate.add_permits(2);
        let [_, second] = <[_; 2]>::try_from(carried).map_err(|_| "two").expect("two");
        assert_eq!(second.await.expect("task").expect("answered").name, "held carried");
        assert_eq!(third.await.expect("task").expect("answered").name, "held alone");
        let _ = stop.send(());
        server.await.expect("task").expect("served");
    }

    /// Each carried call is authenticated on its own, as alone: no token, refused; the mesh's
    /// token, answered.
    async fn each_carried_call_is_authenticated_on_its_own(carrier: Carrier) {
        let tokens = crate::auth::Tokens::new(&[("mesh-token".to_string(), "*".to_string())].into());
        let routes = Routes::new(tonic::service::interceptor::InterceptedService::new(Probe::default(), tokens));
        let (endpoint, stop, server, streams) = serve_counted(routes, Some(8), super::STOP_GRACE).await;
        let open = move || super::MAX_STREAMS - streams.available_permits();
        let trusted = channel_with_token(&endpoint, "mesh-token", carrier);
        until_carried(&trusted).await;
        assert_eq!(open(), 1);
        let stranger = channel_with_token(&endpoint, "not-a-token", carrier);
        // Its own stream opens too (it needs no token); each call, on it or alone, is refused.
        for _ in 0..50 {
            let refused = ask(stranger.clone(), "echo", None).await.expect_err("refused");
            assert_eq!(refused.code(), Code::Unauthenticated, "{refused:?}");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(open(), 2, "the stranger's calls went on a stream of its own");
        let _ = stop.send(());
        server.await.expect("task").expect("served");
    }

    /// A stopping server answers the calls it has read, tells its client to go away and ends
    /// the stream once the client has ended its side: the stop completes, no call is lost.
    async fn a_stop_answers_every_call_read_and_ends_the_stream(carrier: Carrier) {
        let probe = Probe::default();
        // A grace longer than the test's patience: the stream must end because the client ended it.
        let (endpoint, stop, server, _) =
            serve_counted(Routes::new(probe.clone()), Some(8), Duration::from_secs(3600)).await;
        let channel = channel(&endpoint, carrier);
        until_carried(&channel).await;
        let held = tokio::spawn(ask(channel.clone(), "hold", None));
        eventually("the held call runs", || probe.running.load(Ordering::SeqCst) == 1).await;
        let _ = stop.send(());
        tokio::time::sleep(Duration::from_millis(50)).await;
        probe.gate.add_permits(1);
        assert_eq!(held.await.expect("task").expect("answered across the stop").name, "held carried");
        tokio::time::timeout(Duration::from_secs(30), server)
            .await
            .expect("the stop completes with the stream open")
            .expect("task")
            .expect("served");
    }

    /// A call under way when the connection breaks fails as a broken call ([`crate::broke_off`]),
    /// not as the callee's answer.
    async fn a_call_under_a_broken_stream_broke_off(carrier: Carrier) {
        let probe = Probe::default();
        let (endpoint, stop, server) = serve(Routes::new(probe.clone()), Some(64)).await;
        // The client reaches the server through a relay whose connections go with it.
        let relay_listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let relayed = crate::endpoint_of(relay_listener.local_addr().expect("addr"));
        let target = endpoint.trim_start_matches("http://").to_string();
        let relay = tokio::spawn(async move {
            let mut connections = tokio::task::JoinSet::new();
            loop {
                let (mut inbound, _) = relay_listener.accept().await.expect("accept");
                let target = target.clone();
                connections.spawn(async move {
                    let mut outbound = tokio::net::TcpStream::connect(target).await.expect("connect");
                    let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                });
            }
        });
        let channel = channel(&relayed, carrier);
        until_carried(&channel).await;
        let held = tokio::spawn(ask(channel.clone(), "hold", None));
        eventually("the held call runs", || probe.running.load(Ordering::SeqCst) == 1).await;
        relay.abort();
        let broken = held.await.expect("task").expect_err("the connection went");
        assert_eq!(broken.code(), Code::Unavailable, "{broken:?}");
        assert!(crate::broke_off(&broken), "{broken:?}");
        eventually("the server drops the handler", || probe.ended.load(Ordering::SeqCst) == 1).await;
        let _ = stop.send(());
        server.await.expect("task").expect("served");
    }

    /// A stream of calls opened by hand on `network`: its sender of calls, and its answers or
    /// the server's refusal.
    async fn open_raw(
        network: tonic::transport::Channel,
    ) -> (tokio::sync::mpsc::UnboundedSender<Call>, Result<tonic::Streaming<Answer>, Status>) {
        let mut grpc = tonic::client::Grpc::new(network);
        grpc.ready().await.expect("ready");
        let (calls, outgoing) = tokio::sync::mpsc::unbounded_channel::<Call>();
        let answers = grpc
            .streaming(
                tonic::Request::new(tokio_stream::wrappers::UnboundedReceiverStream::new(outgoing)),
                http::uri::PathAndQuery::from_static(super::PATH),
                tonic_prost::ProstCodec::<Call, Answer>::default(),
            )
            .await
            .map(tonic::Response::into_inner);
        (calls, answers)
    }

    /// One connection has at most its bound of streams served at once (`RESOURCE_EXHAUSTED`
    /// past it), so it cannot multiply the handlers it holds; a stream that ends frees its place.
    #[tokio::test]
    async fn a_connection_opens_at_most_its_bound_of_streams() {
        let (endpoint, stop, server) = serve(Routes::new(Probe::default()), Some(64)).await;
        let network = crate::network(&endpoint).expect("endpoint").connect_lazy();
        let mut opened = Vec::new();
        for _ in 0..super::MAX_STREAMS_PER_CONNECTION + 1 {
            let (calls, answer) = open_raw(network.clone()).await;
            opened.push((calls, answer));
        }
        let refused = opened.pop().expect("the last").1.expect_err("one too many on the connection");
        assert_eq!(refused.code(), Code::ResourceExhausted, "{refused:?}");
        assert!(opened.iter().all(|(_, a)| a.is_ok()));
        // Once one ends, another may open.
        drop(opened.pop());
        let mut reopened = None;
        for _ in 0..100 {
            let (calls, answer) = open_raw(network.clone()).await;
            if answer.is_ok() {
                reopened = Some((calls, answer));
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(reopened.is_some(), "a stream opens once another has ended");
        drop((opened, reopened));
        let _ = stop.send(());
        server.await.expect("task").expect("served");
    }

    /// What the stream does not carry is refused call by call: a method that is not unary, a
    /// header that is not one, too many headers. The server keeps a call's deadline. A reused
    /// id ends the stream.
    #[tokio::test]
    async fn a_stream_refuses_what_it_does_not_carry() {
        let (endpoint, stop, server) = serve(Routes::new(Probe::default()), Some(64)).await;
        let network = crate::network(&endpoint).expect("endpoint").connect_lazy();
        let (calls, answers) = open_raw(network).await;
        let mut answers = answers.expect("open");
        let status_of = |a: &Answer| {
            let headers = super::from_headers(a.headers.clone()).expect("headers");
            Status::from_header_map(&headers).expect("a status")
        };
        calls.send(Call { id: 1, path: "/warden.v1.Ledger/StreamEvents".into(), ..Default::default() }).expect("send");
        let answer = answers.message().await.expect("read").expect("an answer");
        assert_eq!((answer.id, status_of(&answer).code()), (1, Code::Unimplemented));
        let bad = Header { name: "bad name".into(), value: "x".into() };
        calls
            .send(Call { id: 2, path: "/warden.v1.Ledger/GetRun".into(), headers: vec![bad], ..Default::default() })
            .expect("send");
        let answer = answers.message().await.expect("read").expect("an answer");
        assert_eq!((answer.id, status_of(&answer).code()), (2, Code::InvalidArgument));
        let many = (0..300).map(|i| Header { name: format!("x-{i}"), value: Default::default() }).collect();
        calls
            .send(Call { id: 3, path: "/warden.v1.Ledger/GetRun".into(), headers: many, ..Default::default() })
            .expect("send");
        let answer = answers.message().await.expect("read").expect("an answer");
        assert_eq!((answer.id, status_of(&answer).code()), (3, Code::InvalidArgument));
        let hold = Header { name: "hold".into(), value: Default::default() };
        let body = grpc_framed(&hold);
        // The server keeps a call's deadline itself.
        let overdue = Header { name: "grpc-timeout".into(), value: "30m".into() };
        let path = "/warden.v1.Ledger/GetRun".to_string();
        calls
            .send(Call {
                id: 4,
                path: path.clone(),
                headers: vec![overdue],
                body: body.clone().into(),
                ..Default::default()
            })
            .expect("send");
        let answer = answers.message().await.expect("read").expect("an answer");
        assert_eq!((answer.id, status_of(&answer).code()), (4, Code::Cancelled));
        assert_eq!(status_of(&answer).message(), "Timeout expired");
        let held = Call { id: 5, path, body: body.into(), ..Default::default() };

        calls.send(held.clone()).expect("send");
        calls.send(held).expect("send");
        assert!(answers.message().await.ok().flatten().is_none(), "a reused id ends the stream");
        let _ = stop.send(());
        server.await.expect("task").expect("served");
    }

    /// `message` as a gRPC request body: uncompressed, its length, then its bytes.
    fn grpc_framed(message: &Header) -> Vec<u8> {
        let message = prost::Message::encode_to_vec(message);
        let mut framed = vec![0u8];
        framed.extend_from_slice(&u32::try_from(message.len()).expect("small").to_be_bytes());
        framed.extend_from_slice(&message);
        framed
    }

    /// A connection of frames opened by hand to `endpoint`: its writer, and its frames read.
    async fn open_frames(
        endpoint: &str,
    ) -> (
        tokio::net::tcp::OwnedWriteHalf,
        tokio_util::codec::FramedRead<tokio::net::tcp::OwnedReadHalf, tokio_util::codec::LengthDelimitedCodec>,
    ) {
        use tokio::io::AsyncWriteExt as _;
        let target = super::frames::target_of(endpoint).expect("a TCP endpoint");
        let (read, mut write) = tokio::net::TcpStream::connect(target).await.expect("connect").into_split();
        write.write_all(super::frames::MAGIC).await.expect("magic");
        let frames = tokio_util::codec::FramedRead::new(read, tokio_util::codec::LengthDelimitedCodec::new());
        (write, frames)
    }

    async fn send_frame(write: &mut tokio::net::tcp::OwnedWriteHalf, call: &Call) {
        use tokio::io::AsyncWriteExt as _;
        let mut frame = prost::bytes::BytesMut::new();
        super::frames::put_frame(&mut frame, call);
        write.write_all(&frame).await.expect("send");
    }

    /// The next answer read, `None` once the server ended the connection.
    async fn next_answer(
        frames: &mut tokio_util::codec::FramedRead<
            tokio::net::tcp::OwnedReadHalf,
            tokio_util::codec::LengthDelimitedCodec,
        >,
    ) -> Option<Answer> {
        use futures::StreamExt as _;
        let frame = tokio::time::timeout(Duration::from_secs(60), frames.next()).await.expect("the server answers");
        frame.and_then(Result::ok).map(|f| <Answer as prost::Message>::decode(f.freeze()).expect("an answer"))
    }

    fn status_of(answer: &Answer) -> Status {
        let headers = super::from_headers(answer.headers.clone()).expect("headers");
        let trailers = super::from_headers(answer.trailers.clone()).expect("trailers");
        Status::from_header_map(&headers).or_else(|| Status::from_header_map(&trailers)).expect("a status")
    }

    /// A connection of frames is told the server's bound first; then what it does not carry is
    /// refused call by call, as on an HTTP/2 stream; a reused id ends the connection, and so
    /// does a frame longer than a call may be.
    #[tokio::test]
    async fn a_connection_of_frames_refuses_what_it_does_not_carry() {
        let (endpoint, stop, server) = serve(Routes::new(Probe::default()), Some(64)).await;
        let (mut write, mut frames) = open_frames(&endpoint).await;
        let hello = next_answer(&mut frames).await.expect("the hello");
        assert_eq!(hello.id, 0);
        let bound = hello.headers.iter().find(|h| h.name == super::IN_FLIGHT_HEADER).expect("the bound");
        assert_eq!(&bound.value[..], b"64");

        send_frame(&mut write, &Call { id: 1, path: "/warden.v1.Ledger/StreamEvents".into(), ..Default::default() })
            .await;
        let answer = next_answer(&mut frames).await.expect("an answer");
        assert_eq!((answer.id, status_of(&answer).code()), (1, Code::Unimplemented));
        let bad = Header { name: "bad name".into(), value: "x".into() };
        let call = Call { id: 2, path: "/warden.v1.Ledger/GetRun".into(), headers: vec![bad], ..Default::default() };
        send_frame(&mut write, &call).await;
        let answer = next_answer(&mut frames).await.expect("an answer");
        assert_eq!((answer.id, status_of(&answer).code()), (2, Code::InvalidArgument));
        // An answer is the routes' own: a call without a token reaches the probe, which has
        // no authentication, and is answered.
        let body = grpc_framed(&Header { name: "echo".into(), value: "x".into() });
        let echo =
            Call { id: 3, path: "/warden.v1.Ledger/GetRun".into(), body: body.clone().into(), ..Default::default() };
        send_frame(&mut write, &echo).await;
        let answer = next_answer(&mut frames).await.expect("an answer");
        assert_eq!((answer.id, answer.status), (3, 200));
        let message: Header = prost::Message::decode(&answer.body[5..]).expect("the echo");
        assert_eq!(message.name, "carried");

        let hold = grpc_framed(&Header { name: "hold".into(), value: Default::default() });
        let held = Call { id: 4, path: "/warden.v1.Ledger/GetRun".into(), body: hold.into(), ..Default::default() };
        send_frame(&mut write, &held).await;
        send_frame(&mut write, &held).await;
        assert!(next_answer(&mut frames).await.is_none(), "a reused id ends the connection");

        let (mut write, mut frames) = open_frames(&endpoint).await;
        next_answer(&mut frames).await.expect("the hello");
        {
            use tokio::io::AsyncWriteExt as _;
            let too_long = u32::try_from(super::MAX_CALL_MESSAGE + 1).expect("small");
            write.write_all(&too_long.to_be_bytes()).await.expect("send");
        }
        assert!(next_answer(&mut frames).await.is_none(), "a frame too long ends the connection");
        let _ = stop.send(());
        server.await.expect("task").expect("served");
    }

    /// A server serving as many streams of calls as it may refuses a connection of frames in
    /// its hello; that client's calls go alone, answered.
    #[tokio::test]
    async fn a_full_server_refuses_a_connection_of_frames_and_its_calls_go_alone() {
        let (endpoint, stop, server, streams) =
            serve_counted(Routes::new(Probe::default()), Some(8), super::STOP_GRACE).await;
        let taken = streams.clone().acquire_many_owned(super::MAX_STREAMS as u32).await.expect("every permit");
        let (_write, mut frames) = open_frames(&endpoint).await;
        let refusal = next_answer(&mut frames).await.expect("the hello");
        assert_eq!(status_of(&refusal).code(), Code::ResourceExhausted);
        assert!(next_answer(&mut frames).await.is_none(), "the connection ends");
        let channel = channel(&endpoint, Carrier::Frames);
        for _ in 0..20 {
            assert_eq!(ask(channel.clone(), "echo", None).await.expect("echo").name, "alone");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        drop(taken);
        let _ = stop.send(());
        server.await.expect("task").expect("served");
    }

    /// A client of a server that does not take frames (one that speaks only HTTP/2, as an
    /// older Warden server) takes it as a refusal and asks again only after
    /// [`super::REFUSED_RETRY`], not after every broken stream's short wait.
    #[tokio::test]
    async fn a_server_that_does_not_take_frames_is_asked_again_only_much_later() {
        let (endpoint, stop, server) = serve(Routes::new(Probe::default()), None).await;
        let network = crate::network(&endpoint).expect("endpoint").connect_lazy();
        let client = super::Client::new(network, &endpoint, Carrier::Frames);
        assert!(client.live().is_none(), "it opens in the background");
        let later = std::time::Instant::now() + super::REFUSED_RETRY - Duration::from_secs(5);
        eventually(
            "the refusal is taken",
            || matches!(&*super::lock(&client.shared.state), super::State::Idle(after) if *after > later),
        )
        .await;
        let _ = stop.send(());
        server.await.expect("task").expect("served");
    }

    /// A server that goes silent with its connection open (a hung process, or the packets of a
    /// partition going nowhere) is noticed by the client's pings: the call under way fails as
    /// broken off, the next calls go on another connection; and the server, hearing nothing,
    /// drops the handler of the lost connection's call.
    #[tokio::test]
    async fn a_silent_server_is_noticed_by_the_pings_and_a_silent_client_by_the_server() {
        let probe = Probe::default();
        let (endpoint, stop, server) = serve(Routes::new(probe.clone()), Some(64)).await;
        let relay_listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let relayed = crate::endpoint_of(relay_listener.local_addr().expect("addr"));
        let target = endpoint.trim_start_matches("http://").to_string();
        let (silence, silent) = tokio::sync::watch::channel(false);
        let relay = tokio::spawn(async move {
            let mut connections = tokio::task::JoinSet::new();
            loop {
                let (inbound, _) = relay_listener.accept().await.expect("accept");
                let (target, mut silent) = (target.clone(), silent.clone());
                connections.spawn(async move {
                    let outbound = tokio::net::TcpStream::connect(target).await.expect("connect");
                    let (mut a, mut b) = (inbound, outbound);
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut a, &mut b) => {}
                        _ = async { let _ = silent.wait_for(|s| *s).await.map(|_| ()); } => {
                            // Both connections stay open, and nothing more crosses.
                            std::future::pending::<()>().await;
                        }
                    }
                });
            }
        });
        let channel = channel(&relayed, Carrier::Frames);
        until_carried(&channel).await;
        // Idle for longer than a server keeps a silent client: the pings keep it.
        tokio::time::sleep(super::frames::CLIENT_SILENCE + Duration::from_secs(1)).await;
        assert_eq!(ask(channel.clone(), "echo", None).await.expect("echo").name, "carried");
        let held = tokio::spawn(ask(channel.clone(), "hold", None));
        eventually("the held call runs", || probe.running.load(Ordering::SeqCst) == 1).await;
        silence.send(true).expect("silence");
        let broken = held.await.expect("task").expect_err("the server went silent");
        assert_eq!(broken.code(), Code::Unavailable, "{broken:?}");
        assert!(crate::broke_off(&broken), "{broken:?}");
        // The server hears nothing more on that connection and drops its call.
        eventually("the server drops the handler", || probe.ended.load(Ordering::SeqCst) == 1).await;
        relay.abort();
        let _ = stop.send(());
        server.await.expect("task").expect("served");
    }
}
