//! Requests whose body is ready when they are sent go out ending with their data.
//!
//! tonic encodes a unary request into a body that yields the message, and learns only on the
//! next poll that nothing follows. hyper's HTTP/2 client sends each answer it gets as it gets
//! it, so a unary call went out as three frames, each flushed on its own: HEADERS, DATA, and
//! an empty DATA carrying END_STREAM — three `writev`s, and as many wake-ups of the server
//! (measured with strace on a chain of steps: ~8 writes per step from the executor for its
//! three calls). [`Eager`] takes what the body has ready at once, before the request is
//! handed on; when that is the whole body, the body says it has ended as soon as the last
//! data is taken, and the data goes out with END_STREAM in one frame.
//!
//! A body that is not ready at once (a streaming request) is left as it is: what was taken is
//! given first, the rest streams as before. Nothing is awaited, and at most [`MAX_TAKEN`]
//! frames are taken ahead (a stream that could make frames without end streams the rest), so
//! no request waits and no memory grows with what a body could still produce.

use std::collections::VecDeque;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};

use http_body::{Body as _, Frame, SizeHint};
use tonic::Status;
use tonic::body::Body;
use tonic::codegen::Bytes;

/// The most frames taken from a body before it is sent: a unary request has one.
pub const MAX_TAKEN: usize = 4;

/// A tonic client service whose requests' ready frames are taken before they are sent.
#[derive(Clone, Debug)]
pub struct Eager<S> {
    inner: S,
}

impl<S> Eager<S> {
    pub fn new(inner: S) -> Self {
        Eager { inner }
    }
}

impl<S> tower::Service<http::Request<Body>> for Eager<S>
where
    S: tower::Service<http::Request<Body>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<Body>) -> Self::Future {
        self.inner.call(req.map(Ready::take))
    }
}

/// A body's frames that were ready, then (if it had not ended) the body itself.
struct Ready {
    taken: VecDeque<Result<Frame<Bytes>, Status>>,
    rest: Option<Body>,
}

impl Ready {
    /// Polls `body` until it ends or has nothing ready. Its waker is a no-op: a body that was
    /// not ready is polled again, with the sender's waker, once it is sent on.
    fn take(mut body: Body) -> Body {
        let mut cx = Context::from_waker(Waker::noop());
        let mut taken = VecDeque::new();
        let rest = loop {
            if body.is_end_stream() {
                break None;
            }
            if taken.len() == MAX_TAKEN {
                break Some(body);
            }
            match Pin::new(&mut body).poll_frame(&mut cx) {
                Poll::Ready(Some(frame)) => {
                    let failed = frame.is_err();
                    taken.push_back(frame);
                    if failed {
                        // Nothing is polled after an error; it is given as it came.
                        break None;
                    }
                }
                Poll::Ready(None) => break None,
                Poll::Pending => break Some(body),
            }
        };
        Body::new(Ready { taken, rest })
    }
}

impl http_body::Body for Ready {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        if let Some(frame) = self.taken.pop_front() {
            return Poll::Ready(Some(frame));
        }
        match self.rest.as_mut() {
            Some(rest) => Pin::new(rest).poll_frame(cx),
            None => Poll::Ready(None),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.taken.is_empty() && self.rest.as_ref().is_none_or(|r| r.is_end_stream())
    }

    fn size_hint(&self) -> SizeHint {
        // Unknown, as the body's own: an exact hint would add a content-length header.
        match &self.rest {
            Some(rest) if self.taken.is_empty() => rest.size_hint(),
            _ => SizeHint::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn collect(mut body: Body) -> (Vec<Result<Bytes, String>>, Vec<bool>) {
        let mut cx = Context::from_waker(Waker::noop());
        let (mut out, mut ends) = (Vec::new(), vec![body.is_end_stream()]);
        loop {
            // The test bodies never wait on anything: a Pending (a stream yielding to its
            // scheduler) is polled again.
            match Pin::new(&mut body).poll_frame(&mut cx) {
                Poll::Ready(Some(frame)) => {
                    out.push(frame.map(|f| f.into_data().unwrap_or_default()).map_err(|s| s.message().to_string()));
                    ends.push(body.is_end_stream());
                }
                Poll::Ready(None) => break,
                Poll::Pending => {}
            }
        }
        (out, ends)
    }

    #[test]
    fn a_ready_body_ends_with_its_last_data() {
        let stream = tokio_stream::iter([
            Ok::<_, Status>(Frame::data(Bytes::from_static(b"a"))),
            Ok(Frame::data(Bytes::from_static(b"b"))),
        ]);
        let body = Ready::take(Body::new(http_body_util::StreamBody::new(stream)));
        let (frames, ends) = collect(body);
        assert_eq!(frames, vec![Ok(Bytes::from_static(b"a")), Ok(Bytes::from_static(b"b"))]);
        assert_eq!(ends, vec![false, false, true], "ended as the last data is taken, not one poll later");
    }

    #[test]
    fn a_body_not_ready_streams_the_rest_as_before() {
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, Status>>(4);
        tx.try_send(Ok(Frame::data(Bytes::from_static(b"first")))).expect("send");
        let body =
            Ready::take(Body::new(http_body_util::StreamBody::new(tokio_stream::wrappers::ReceiverStream::new(rx))));
        tx.try_send(Ok(Frame::data(Bytes::from_static(b"later")))).expect("send");
        tx.try_send(Err(Status::internal("broke"))).expect("send");
        drop(tx);
        let (frames, ends) = collect(body);
        assert_eq!(
            frames,
            vec![Ok(Bytes::from_static(b"first")), Ok(Bytes::from_static(b"later")), Err("broke".to_string())]
        );
        assert!(!ends[0], "a body with frames to give has not ended");
    }

    #[test]
    fn a_long_ready_stream_is_taken_only_so_far() {
        let frames = (0..100).map(|i| Ok::<_, Status>(Frame::data(Bytes::from(vec![i as u8]))));
        let body = Ready::take(Body::new(http_body_util::StreamBody::new(tokio_stream::iter(frames))));
        let (frames, _) = collect(body);
        assert_eq!(frames.len(), 100, "every frame, in order: the rest streamed");
        assert!(frames.iter().enumerate().all(|(i, f)| f.as_ref().is_ok_and(|b| b[..] == [i as u8])));
    }

    #[test]
    fn an_empty_body_stays_empty() {
        let (frames, ends) = collect(Ready::take(Body::empty()));
        assert!(frames.is_empty());
        assert_eq!(ends, vec![true]);
    }
}
