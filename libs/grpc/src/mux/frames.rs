//! The stream of calls on a TCP connection of its own, in plain frames instead of HTTP/2.
//!
//! On one HTTP/2 stream a call is one DATA frame each way (see the parent module), but each
//! frame still passes through hyper's connection task and h2's framing, flow control and
//! stream store on both sides: measured, the client's HTTP/2 connection task alone was about a
//! quarter of an executor's CPU in a chain of steps (docs/write-path.md). Here the same
//! messages, [`Call`] and [`Answer`], go on a TCP connection that carries nothing else, each
//! as one frame: a 4-byte big-endian length, then the message (tokio-util's
//! `LengthDelimitedCodec` reads them). A call is then one `write` and one `read` on each side,
//! and on the caller's side one task hand-over each way.
//!
//! - **Opening.** The client connects to the server's own address and port and sends
//!   [`MAGIC`]. A Warden server tells such a connection from an HTTP/2 one by its first byte (an
//!   HTTP/2 client's preface starts `PRI`; see `sort`), so one listener serves both. The
//!   server's first frame is its hello: an [`Answer`] of id 0 whose headers hold
//!   [`IN_FLIGHT_HEADER`], or whose trailers hold the status of a refusal (too many streams of
//!   calls). Anything else once the connection is made (a server that does not take frames, an
//!   older one, closes it or answers in HTTP/2; a proxy may answer anything) is taken as a
//!   refusal: the client's calls go alone, as against a server without the stream, and it
//!   asks again after [`super::REFUSED_RETRY`].
//! - **Liveness.** An HTTP/2 connection's pings tell a client its server is gone (a crashed
//!   host, a partition, a hung process) within [`KEEPALIVE_INTERVAL`] and
//!   [`KEEPALIVE_TIMEOUT`]; here the client pings ([`Call::ping`]) every
//!   [`KEEPALIVE_INTERVAL`], and if no frame at all arrives within [`KEEPALIVE_TIMEOUT`] of a
//!   ping, the connection is broken: its calls fail as broken off and the next call opens
//!   another. A server drops a connection that has sent nothing for [`CLIENT_SILENCE`], with
//!   its calls and its place among the streams of calls.
//! - **Everything else is the stream's**: the same calls handed to the same routes behind the
//!   same layers (authentication per call), the same bounds, deadlines, cancels, go-away and
//!   stop (`drive` on the server, `read` and `carry` on the client, in the parent module).
//!   The client ends its side with a call marked [`Call::end`], as an HTTP/2 stream's side
//!   ends with END_STREAM; a connection that closes before it was lost, and the server drops
//!   its calls, as on a reset connection. A frame longer than a side decodes, or one that does
//!   not decode, ends the connection, as a decoding error ends a stream.
//! - **Security.** A connection carries what an HTTP/2 connection to the same port carries, in
//!   the same clear text, and grants nothing: every call carries its own token and is checked
//!   on its own. No TLS is set up by the mesh today on either; one that is must carry these
//!   connections inside it too, or turn frames off (`WARDEN_MULTIPLEX=stream`).
//!
//! Only TCP endpoints (`http://host:port`) are reached this way; a Unix socket's endpoint is
//! reached on an HTTP/2 stream.

use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use futures::{FutureExt as _, Stream, StreamExt as _};
use prost::Message as _;
use prost::bytes::{BufMut as _, BytesMut};
use tokio::io::{AsyncReadExt as _, AsyncWrite, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot, watch};
use tokio_util::codec::{FramedRead, LengthDelimitedCodec};
use tonic::Status;

use super::{
    Answer, Call, Counted, Header, IN_FLIGHT_HEADER, Live, MAX_CALL_MESSAGE, MAX_MUX_MESSAGE, Server, Shared, bound_of,
    lock,
};

/// What a client sends first on a connection of frames. Its first byte is not an HTTP/2
/// preface's (`P`).
pub const MAGIC: &[u8; 16] = b"WARDEN-CALLS/1\r\n";
const _: () = assert!(MAGIC[0] != b'P');

/// How often a client pings its server: the HTTP/2 channels' keep-alive interval. (Shorter in
/// this crate's tests, which wait for a silent server to be noticed.)
pub const KEEPALIVE_INTERVAL: Duration = if cfg!(test) { Duration::from_millis(300) } else { Duration::from_secs(20) };

/// How long after a ping a client waits for any frame before it takes the connection as
/// lost: the HTTP/2 channels' keep-alive timeout.
pub const KEEPALIVE_TIMEOUT: Duration = if cfg!(test) { Duration::from_secs(3) } else { Duration::from_secs(20) };

/// How long a server keeps a connection that sends nothing, not even the pings a live client
/// sends every [`KEEPALIVE_INTERVAL`].
pub const CLIENT_SILENCE: Duration = KEEPALIVE_INTERVAL.saturating_mul(2).saturating_add(KEEPALIVE_TIMEOUT);

/// The largest hello a client reads: a few headers, or a refusal's status.
const MAX_HELLO: usize = 64 << 10;

/// How long a server waits for a new connection's first byte before handing it to HTTP/2
/// (which then waits as it waits for any client), and then for the rest of [`MAGIC`].
const FIRST_BYTES_WAIT: Duration = Duration::from_secs(10);

/// How long a client waits for the server's hello (within the stream's opening time, so that a server that
/// never answers counts as one that does not take frames).
const HELLO_WAIT: Duration = Duration::from_secs(3);

/// Frames ready together are written together, up to about this many bytes a write.
const WRITE_BATCH: usize = 256 << 10;

/// The `host:port` a client of `endpoint` connects to for frames: only for `http://` endpoints
/// (a Unix socket's, or a TLS one, is reached on an HTTP/2 stream).
pub(crate) fn target_of(endpoint: &str) -> Option<String> {
    let uri: http::Uri = endpoint.parse().ok()?;
    if uri.scheme_str() != Some("http") {
        return None;
    }
    let authority = uri.authority()?;
    let port = authority.port_u16()?;
    Some(format!("{}:{port}", authority.host()))
}

fn codec(max: usize) -> LengthDelimitedCodec {
    LengthDelimitedCodec::builder().length_field_length(4).max_frame_length(max).new_codec()
}

type Frames = FramedRead<tokio::net::tcp::OwnedReadHalf, LengthDelimitedCodec>;

/// The messages of a connection's read side.
fn messages<M: prost::Message + Default>(frames: Frames) -> impl Stream<Item = Result<M, Status>> + Unpin + Send {
    frames.map(|frame| {
        let frame = frame.map_err(|e| Status::unavailable(format!("the connection of calls failed: {e}")))?;
        M::decode(frame.freeze()).map_err(|e| Status::internal(format!("a frame did not decode: {e}")))
    })
}

/// A connection's calls as [`super::drive`] reads a stream's: they end at the client's end;
/// the connection closing before it, or sending nothing for [`CLIENT_SILENCE`], is an error
/// (the connection was lost).
fn calls_of(read: tokio::net::tcp::OwnedReadHalf) -> impl Stream<Item = Result<Call, Status>> + Unpin + Send {
    struct Reading<S> {
        calls: S,
        last: Instant,
        check: Pin<Box<tokio::time::Sleep>>,
    }
    let calls = messages::<Call>(FramedRead::new(read, codec(MAX_CALL_MESSAGE)));
    let check = Box::pin(tokio::time::sleep(CLIENT_SILENCE));
    let reading = Reading { calls, last: Instant::now(), check };
    Box::pin(futures::stream::unfold(Some(reading), |reading| async move {
        let mut r = reading?;
        loop {
            tokio::select! {
                biased;
                read = r.calls.next() => {
                    r.last = Instant::now();
                    return match read {
                        Some(Ok(call)) if call.end => None,
                        Some(Ok(call)) => Some((Ok(call), Some(r))),
                        Some(Err(status)) => Some((Err(status), None)),
                        None => Some((Err(Status::unavailable("the connection of calls closed before its end")), None)),
                    };
                }
                () = &mut r.check => {
                    if r.last.elapsed() >= CLIENT_SILENCE {
                        return Some((Err(Status::unavailable("the client of a connection of calls went silent")), None));
                    }
                    let next = r.last + CLIENT_SILENCE;
                    r.check.as_mut().reset(next.into());
                }
            }
        }
    }))
}

pub(super) fn put_frame(buf: &mut BytesMut, message: &impl prost::Message) {
    let len = message.encoded_len();
    buf.reserve(4 + len);
    // Every message sent is bounded far below 4 GiB (MAX_CALL_MESSAGE, MAX_MUX_MESSAGE).
    buf.put_u32(u32::try_from(len).unwrap_or(u32::MAX));
    // Room was reserved: encoding cannot run out of it.
    let _ = message.encode(buf);
}

/// Writes each message of `messages` as a frame until it ends (then shuts the write side: the
/// peer reads the end) or a write fails; those ready together go in one write.
async fn write_frames<M: prost::Message>(
    mut out: impl AsyncWrite + Unpin,
    mut messages: impl Stream<Item = M> + Unpin,
) -> std::io::Result<()> {
    let mut buf = BytesMut::with_capacity(8 << 10);
    while let Some(first) = messages.next().await {
        put_frame(&mut buf, &first);
        while buf.len() < WRITE_BATCH {
            match messages.next().now_or_never() {
                Some(Some(next)) => put_frame(&mut buf, &next),
                _ => break,
            }
        }
        out.write_all(&buf).await?;
        if buf.capacity() > WRITE_BATCH {
            // A large answer's room is given back.
            buf = BytesMut::with_capacity(8 << 10);
        } else {
            buf.clear();
        }
    }
    out.shutdown().await
}

fn in_flight_header(bound: usize) -> Header {
    Header { name: IN_FLIGHT_HEADER.to_string(), value: bound.to_string().into() }
}

// ---------------------------------------------------------------------------------------------
// The server side.

/// Accepts `listener`'s connections until `stopping` changes: each that opens with [`MAGIC`]
/// is served here as a stream of calls to `server`; the others come out of the returned
/// stream, for HTTP/2. The future resolves once accepting has stopped and every connection of
/// frames has ended (each ends as its stream does: [`super::drive`] keeps the stop's grace).
pub(crate) fn sort(
    listener: TcpListener,
    server: Server,
    stopping: watch::Receiver<()>,
) -> (impl Stream<Item = Result<TcpStream, std::io::Error>> + Send + 'static, impl Future<Output = ()> + Send) {
    let (http2, incoming) = mpsc::channel::<Result<TcpStream, std::io::Error>>(64);
    // A sender per task that must end before the server has: the accept loop and each
    // connection; the receiver sees the end once every one is gone.
    let (alive, mut ended) = mpsc::channel::<()>(1);
    tokio::spawn(accept(listener, server, stopping, http2, alive));
    let drained = async move {
        let _ = ended.recv().await;
    };
    (tokio_stream::wrappers::ReceiverStream::new(incoming), drained)
}

async fn accept(
    listener: TcpListener,
    server: Server,
    mut stopping: watch::Receiver<()>,
    http2: mpsc::Sender<Result<TcpStream, std::io::Error>>,
    alive: mpsc::Sender<()>,
) {
    loop {
        let accepted = tokio::select! {
            biased;
            _ = stopping.changed() => return,
            accepted = listener.accept() => accepted,
        };
        let stream = match accepted {
            Ok((stream, _)) => stream,
            Err(e) => {
                // Out of descriptors or memory: a moment before trying again, instead of
                // spinning; a connection that failed while queued costs nothing.
                if !matches!(
                    e.kind(),
                    std::io::ErrorKind::ConnectionAborted
                        | std::io::ErrorKind::ConnectionReset
                        | std::io::ErrorKind::ConnectionRefused
                ) {
                    tracing::warn!(error = %e, "accepting a connection failed");
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                continue;
            }
        };
        // Agents' steps are latency-bound request/response calls: no Nagle delay.
        let _ = stream.set_nodelay(true);
        let (server, http2, alive, mut stopped) = (server.clone(), http2.clone(), alive.clone(), stopping.clone());
        tokio::spawn(async move {
            let mut first = [0u8; 1];
            let peeked = tokio::select! {
                peeked = tokio::time::timeout(FIRST_BYTES_WAIT, stream.peek(&mut first)) => peeked,
                // A connection that has said nothing by the stop is dropped, not waited for.
                _ = stopped.changed() => return,
            };
            let frames = matches!(peeked, Ok(Ok(1))) && first[0] == MAGIC[0];
            if frames {
                serve(server, stream).await;
            } else {
                // Refused only once the server has stopped taking connections.
                let _ = http2.send(Ok(stream)).await;
            }
            drop(alive);
        });
    }
}

/// Serves one connection of frames as a stream of calls.
async fn serve(server: Server, mut stream: TcpStream) {
    let mut magic = [0u8; MAGIC.len()];
    let mut stopped = server.stopping.clone();
    let read = tokio::select! {
        read = tokio::time::timeout(FIRST_BYTES_WAIT, stream.read_exact(&mut magic)) => read,
        _ = stopped.changed() => return,
    };
    if !matches!(read, Ok(Ok(_))) || &magic != MAGIC {
        return;
    }
    let (read, write) = stream.into_split();
    // One stream per connection, by construction: nothing to count per connection.
    let permit = server.streams.clone().try_acquire_owned().ok().zip(Counted::count(&server.per_connection, None));
    let Some(permit) = permit else {
        let mut trailers = http::HeaderMap::new();
        let _ = Status::resource_exhausted("too many streams of calls are open; call alone").add_header(&mut trailers);
        let refusal = Answer { status: 200, trailers: super::to_headers(&trailers), ..Default::default() };
        let _ = write_frames(write, futures::stream::iter([refusal])).await;
        return;
    };
    let (answers, out) = mpsc::channel(2 * server.max_in_flight + 1);
    let hello = Answer { status: 200, headers: vec![in_flight_header(server.max_in_flight)], ..Default::default() };
    // The channel is new: the hello has room, and goes before any answer.
    if answers.try_send(Ok(hello)).is_err() {
        return;
    }
    // `drive` sends only answers; an error would have no call to go to.
    let out = tokio_stream::wrappers::ReceiverStream::new(out).filter_map(|a| std::future::ready(a.ok()));
    let mut writer = tokio::spawn(async move {
        if let Err(e) = write_frames(write, out).await {
            tracing::debug!(error = %e, "a connection of calls could not be written; ending it");
        }
    });
    let grace = server.grace;
    super::drive(server, calls_of(read), answers, permit).await;
    // Once `drive` and its calls are done, every sender is gone: the writer sends what is
    // left and ends the connection, within the grace (a client that does not read its last
    // answers would hold the connection, and a stop, for good).
    if tokio::time::timeout(grace, &mut writer).await.is_err() {
        writer.abort();
    }
}

// ---------------------------------------------------------------------------------------------
// The client side.

/// Opens a connection of frames to `target` and starts reading its answers. A server that
/// cannot be reached is `UNAVAILABLE`; one reached that answers anything but a hello
/// (nothing, HTTP/2, a frame too long) is `UNIMPLEMENTED`: it does not take frames.
pub(super) async fn open(shared: &Arc<Shared>, target: &str) -> Result<Arc<Live>, Status> {
    let stream = TcpStream::connect(target)
        .await
        .map_err(|e| Status::unavailable(format!("cannot connect to {target} for calls in frames: {e}")))?;
    let _ = stream.set_nodelay(true);
    let (read, mut write) = stream.into_split();
    let refused =
        |why: &dyn std::fmt::Display| Status::unimplemented(format!("{target} does not take calls in frames: {why}"));
    write.write_all(MAGIC).await.map_err(|e| refused(&e))?;
    let mut frames = FramedRead::new(read, codec(MAX_HELLO));
    let hello = match tokio::time::timeout(HELLO_WAIT, frames.next()).await {
        Ok(Some(Ok(hello))) => Answer::decode(hello.freeze()).map_err(|e| refused(&e))?,
        Ok(Some(Err(e))) => return Err(refused(&e)),
        Ok(None) => return Err(refused(&"it closed the connection")),
        Err(_) => return Err(refused(&"no hello in time")),
    };
    let bound = hello.headers.iter().find(|h| h.name == IN_FLIGHT_HEADER).and_then(|h| bound_of(&h.value));
    let Some(bound) = bound else {
        let refusal = super::from_headers(hello.trailers).and_then(|t| Status::from_header_map(&t));
        return Err(refusal.unwrap_or_else(|| refused(&"its hello did not say how many calls it runs at once")));
    };
    frames.decoder_mut().set_max_frame_length(MAX_MUX_MESSAGE);
    let (calls, outgoing) = mpsc::unbounded_channel::<Call>();
    let live = Arc::new(Live::new(calls, bound));
    let writer = tokio::spawn(async move {
        // Once the stream's sender is gone, the client's side ends: the server answers what it
        // read and then ends the connection. A failed write breaks the connection; the reader
        // sees it and fails the calls waiting.
        let end = Call { end: true, ..Default::default() };
        let calls = tokio_stream::wrappers::UnboundedReceiverStream::new(outgoing).chain(futures::stream::iter([end]));
        let _ = write_frames(write, calls).await;
    });
    let heard = Arc::new(AtomicBool::new(true));
    let (lost, noticed) = oneshot::channel();
    let answers = Watched { answers: messages::<Answer>(frames), heard: heard.clone(), lost: Some(noticed) };
    tokio::spawn(keepalive(Arc::downgrade(&live), heard, lost, writer.abort_handle()));
    tokio::spawn(super::read(Arc::downgrade(shared), Arc::downgrade(&live), answers));
    Ok(live)
}

/// Pings the server of `live` every [`KEEPALIVE_INTERVAL`] while the stream is open; when no
/// frame was heard within [`KEEPALIVE_TIMEOUT`] of a ping, stops the writer and tells the
/// reader the connection is lost. Ends with the stream (or once its reader has).
async fn keepalive(
    live: Weak<Live>,
    heard: Arc<AtomicBool>,
    mut lost: oneshot::Sender<()>,
    writer: tokio::task::AbortHandle,
) {
    loop {
        tokio::select! {
            () = tokio::time::sleep(KEEPALIVE_INTERVAL) => {}
            () = lost.closed() => return,
        }
        let Some(open) = live.upgrade() else { return };
        heard.store(false, Ordering::Relaxed);
        let pinged = lock(&open.calls)
            .as_ref()
            .is_some_and(|calls| calls.send(Call { ping: true, ..Default::default() }).is_ok());
        drop(open);
        if !pinged {
            // The stream is ending: its reader fails what still waits if the server goes.
            return;
        }
        tokio::select! {
            () = tokio::time::sleep(KEEPALIVE_TIMEOUT) => {}
            () = lost.closed() => return,
        }
        if !heard.load(Ordering::Relaxed) {
            tracing::debug!("a server of calls in frames answered no ping in time; the connection is taken as lost");
            writer.abort();
            let _ = lost.send(());
            return;
        }
    }
}

/// A connection's answers, noting each frame heard, and failing once the keep-alive says the
/// connection is lost.
struct Watched<S> {
    answers: S,
    heard: Arc<AtomicBool>,
    lost: Option<oneshot::Receiver<()>>,
}

impl<S: Stream<Item = Result<Answer, Status>> + Unpin> Stream for Watched<S> {
    type Item = Result<Answer, Status>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        if let Some(lost) = self.lost.as_mut()
            && let Poll::Ready(said) = Pin::new(lost).poll(cx)
        {
            self.lost = None;
            if said.is_ok() {
                let why = format!("the server answered no ping within {} s", KEEPALIVE_TIMEOUT.as_secs_f64());
                return Poll::Ready(Some(Err(Status::unavailable(why))));
            }
        }
        let next = Pin::new(&mut self.answers).poll_next(cx);
        if let Poll::Ready(Some(_)) = &next {
            self.heard.store(true, Ordering::Relaxed);
        }
        next
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn only_plain_tcp_endpoints_are_reached_in_frames() {
        assert_eq!(super::target_of("http://127.0.0.1:4100").as_deref(), Some("127.0.0.1:4100"));
        assert_eq!(super::target_of("http://localhost:4100/").as_deref(), Some("localhost:4100"));
        assert_eq!(super::target_of("http://[::1]:4100").as_deref(), Some("[::1]:4100"));
        for other in ["https://127.0.0.1:4100", "unix:/run/warden/ledger.sock", "http://127.0.0.1", "nonsense"] {
            assert_eq!(super::target_of(other), None, "{other}");
        }
    }
}
