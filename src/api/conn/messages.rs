//! gRPC request messages handed to tonic only once they have arrived in full, and only for so long.
//!
//! A gRPC message starts with five bytes: a compression flag and its length. tonic reserves that length
//! as soon as it reads them, so a caller that sends the five bytes of a large message and nothing more
//! made the server hold the whole size for nothing: a thousand such calls on one connection, declaring
//! 4 MiB each, held 2 GB. Here the bytes of a message are held as they come (memory follows what was
//! sent) and given to tonic together, the length with them. A length past the called method's bound
//! (16 KiB for those not named) passes at once, for tonic to refuse with its own message.
//!
//! And a request must not take for ever: a call whose request is one message (every method but the
//! streams of RLQS and reflection) must send it and end its side of the stream within
//! `grpc.message_timeout` of the server first waiting for it (tonic reads a unary request to its end
//! before the service sees it); in a stream, once a message's first byte is here, the rest must follow
//! within that long. Otherwise the call ends with DEADLINE_EXCEEDED: half-sent calls no longer keep
//! their connection busy (and their memory held) until its age.

use std::{
    future::Future,
    pin::Pin,
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc,
    },
    task::{Context, Poll},
    time::Duration,
};

use bytes::BytesMut;
use http_body::Frame;
use tokio::time::Sleep;
use tonic::{body::Body, codegen::http, Status};

/// The decision method.
pub const SHOULD_RATE_LIMIT: &str = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit";
/// The rate limit quota service's stream.
pub const QUOTA_STREAM: &str =
    "/envoy.service.rate_limit_quota.v3.RateLimitQuotaService/StreamRateLimitQuotas";

/// The methods whose request is a stream of messages, with no bound between them.
const STREAMED: &[&str] = &[
    QUOTA_STREAM,
    "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
];

/// How the refusal of a request that did not arrive within `grpc.message_timeout` begins.
pub const MESSAGE_TIMEOUT: &str = "the request did not arrive in full within grpc.message_timeout";

/// How the refusal of a message that would take the held bytes past their bound begins.
pub const HELD_FULL: &str = "requests still arriving hold all this replica takes";

/// The compression flag and the length before each message.
const PREFIX: usize = 5;

/// The bytes of messages not yet whole held over every call, and their bound (`grpc.max_held_bytes`).
#[derive(Debug)]
pub struct HeldBytes {
    held: AtomicUsize,
    max: usize,
}

impl HeldBytes {
    pub fn new(max: usize) -> Self {
        Self {
            held: AtomicUsize::new(0),
            max,
        }
    }

    /// Takes `n` more bytes, if the bound allows them.
    fn take(&self, n: usize) -> bool {
        self.held
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |held| {
                held.checked_add(n).filter(|&after| after <= self.max)
            })
            .is_ok()
    }

    fn give_back(&self, n: usize) {
        self.held.fetch_sub(n, Ordering::Relaxed);
    }

    /// Bytes held now.
    pub fn held(&self) -> usize {
        self.held.load(Ordering::Relaxed)
    }
}

/// Wraps every request's body in [`WholeMessages`].
#[derive(Debug, Clone)]
pub struct WholeMessagesLayer {
    /// `grpc.message_timeout`.
    pub timeout: Duration,
    /// What every call's held bytes count against.
    pub held: Arc<HeldBytes>,
    /// The largest message a method takes, by path, and of the others: a longer one passes at once, for
    /// tonic to refuse (each service's own bound, set on it, says the same).
    pub largest: Arc<[(&'static str, usize)]>,
    pub largest_otherwise: usize,
}

impl<S> tower::Layer<S> for WholeMessagesLayer {
    type Service = WholeMessagesService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        WholeMessagesService {
            inner,
            bounds: self.clone(),
        }
    }
}

/// The service of [`WholeMessagesLayer`].
#[derive(Debug, Clone)]
pub struct WholeMessagesService<S> {
    inner: S,
    bounds: WholeMessagesLayer,
}

impl<S> tower::Service<http::Request<Body>> for WholeMessagesService<S>
where
    S: tower::Service<http::Request<Body>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        let path = request.uri().path();
        let streamed = STREAMED.contains(&path);
        let largest = self
            .bounds
            .largest
            .iter()
            .find(|(method, _)| *method == path)
            .map_or(self.bounds.largest_otherwise, |&(_, largest)| largest);
        let timeout = self.bounds.timeout;
        self.inner.call(request.map(|body| {
            Body::new(WholeMessages {
                body,
                held: BytesMut::new(),
                counted: 0,
                budget: self.bounds.held.clone(),
                trailers: None,
                timer: None,
                timeout,
                largest,
                unary: !streamed,
                passing: false,
                ended: false,
            })
        }))
    }
}

/// A request body that yields each gRPC message whole (see the module's comment).
#[derive(Debug)]
pub struct WholeMessages {
    body: Body,
    /// What has come of a message not yet whole.
    held: BytesMut,
    /// How much of `held` is counted in `budget`.
    counted: usize,
    budget: Arc<HeldBytes>,
    /// Trailers that came while a message was held, given after it.
    trailers: Option<http::HeaderMap>,
    /// Armed while waiting for a message's bytes.
    timer: Option<Pin<Box<Sleep>>>,
    timeout: Duration,
    largest: usize,
    /// A unary request: bounded from the first wait to its end, not only within a message.
    unary: bool,
    /// Past a message longer than `largest`: everything passes as it comes.
    passing: bool,
    /// The body has ended.
    ended: bool,
}

/// How long the whole messages at the front of `bytes` are together (0: none).
fn whole(bytes: &[u8]) -> usize {
    let mut at = 0;
    while let Some(len) = declared(&bytes[at..]) {
        match (at + PREFIX).checked_add(len) {
            Some(end) if end <= bytes.len() => at = end,
            _ => break,
        }
    }
    at
}

/// The length the first message of `bytes` declares, once its prefix is there.
fn declared(bytes: &[u8]) -> Option<usize> {
    let prefix = bytes.get(..PREFIX)?;
    Some(u32::from_be_bytes([prefix[1], prefix[2], prefix[3], prefix[4]]) as usize)
}

type Polled = Poll<Option<Result<Frame<bytes::Bytes>, Status>>>;

impl WholeMessages {
    /// The first `upto` bytes held, as one frame.
    fn give(&mut self, upto: usize) -> Polled {
        let data = self.held.split_to(upto).freeze();
        self.recount();
        self.given(data)
    }

    /// Gives back to the budget what is no longer held.
    fn recount(&mut self) {
        let gone = self.counted.saturating_sub(self.held.len());
        self.budget.give_back(gone);
        self.counted -= gone;
    }

    /// `data`, a frame of whole messages (or of any bytes, once passing).
    fn given(&mut self, data: bytes::Bytes) -> Polled {
        if !self.unary {
            self.timer = None;
        }
        Poll::Ready(Some(Ok(Frame::data(data))))
    }

    /// Whether the wait for a message's bytes has lasted `timeout`, arming the timer on its first call.
    fn waited_too_long(&mut self, cx: &mut Context<'_>) -> bool {
        let timeout = self.timeout;
        let timer = self
            .timer
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(timeout)));
        timer.as_mut().poll(cx).is_ready()
    }
}

impl Drop for WholeMessages {
    fn drop(&mut self) {
        self.budget.give_back(self.counted);
    }
}

impl http_body::Body for WholeMessages {
    type Data = bytes::Bytes;
    type Error = Status;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Polled {
        let this = &mut *self;
        loop {
            let ready = whole(&this.held);
            if ready > 0 {
                return this.give(ready);
            }
            if !this.passing && declared(&this.held).is_some_and(|len| len > this.largest) {
                this.passing = true;
            }
            if (this.passing || this.ended || this.trailers.is_some()) && !this.held.is_empty() {
                let all = this.held.len();
                return this.give(all);
            }
            if let Some(trailers) = this.trailers.take() {
                return Poll::Ready(Some(Ok(Frame::trailers(trailers))));
            }
            if this.ended {
                return Poll::Ready(None);
            }
            let frame = match Pin::new(&mut this.body).poll_frame(cx) {
                Poll::Ready(Some(Ok(frame))) => frame,
                Poll::Ready(Some(Err(status))) => return Poll::Ready(Some(Err(status))),
                Poll::Ready(None) => {
                    this.ended = true;
                    continue;
                }
                Poll::Pending => {
                    let waiting = this.unary || !this.held.is_empty();
                    if waiting && !this.passing && this.waited_too_long(cx) {
                        this.held.clear();
                        this.recount();
                        this.ended = true;
                        return Poll::Ready(Some(Err(Status::deadline_exceeded(format!(
                            "{MESSAGE_TIMEOUT} ({:?})",
                            this.timeout
                        )))));
                    }
                    return Poll::Pending;
                }
            };
            match frame.into_data() {
                // The usual request: whole messages in one piece, given as they are.
                Ok(data)
                    if this.passing || (this.held.is_empty() && whole(&data) == data.len()) =>
                {
                    return this.given(data);
                }
                Ok(data) => {
                    this.held.extend_from_slice(&data);
                    // A message past the method's bound passes at once (tonic refuses it naming the
                    // bound): not held, so not counted.
                    if declared(&this.held).is_some_and(|len| len > this.largest) {
                        continue;
                    }
                    if !this.budget.take(data.len()) {
                        this.held.clear();
                        this.recount();
                        this.ended = true;
                        return Poll::Ready(Some(Err(Status::resource_exhausted(format!(
                            "{HELD_FULL} ({} bytes, grpc.max_held_bytes): send it again",
                            this.budget.max
                        )))));
                    }
                    this.counted += data.len();
                }
                Err(frame) => {
                    if let Ok(trailers) = frame.into_trailers() {
                        this.trailers = Some(trailers);
                    }
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.held.is_empty() && self.trailers.is_none() && (self.ended || self.body.is_end_stream())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body::Body as _;
    use std::{collections::VecDeque, task::Waker};

    /// A body that answers each poll with the next of its steps, then ends.
    struct Steps(VecDeque<Polled>);

    impl http_body::Body for Steps {
        type Data = bytes::Bytes;
        type Error = Status;

        fn poll_frame(mut self: Pin<&mut Self>, _: &mut Context<'_>) -> Polled {
            self.0.pop_front().unwrap_or(Poll::Ready(None))
        }
    }

    fn data(bytes: &[u8]) -> Polled {
        Poll::Ready(Some(Ok(Frame::data(bytes::Bytes::copy_from_slice(bytes)))))
    }

    fn wrapped(steps: Vec<Polled>, unary: bool, largest: usize) -> WholeMessages {
        WholeMessages {
            body: Body::new(Steps(steps.into())),
            held: BytesMut::new(),
            counted: 0,
            budget: Arc::new(HeldBytes::new(usize::MAX)),
            trailers: None,
            timer: None,
            timeout: Duration::from_secs(10),
            largest,
            unary,
            passing: false,
            ended: false,
        }
    }

    fn next(body: &mut WholeMessages) -> Polled {
        let mut cx = Context::from_waker(Waker::noop());
        Pin::new(body).poll_frame(&mut cx)
    }

    /// The bytes of a data frame, `None` for anything else.
    fn bytes_of(polled: Polled) -> Option<Vec<u8>> {
        match polled {
            Poll::Ready(Some(Ok(frame))) => frame.into_data().ok().map(|d| d.to_vec()),
            _ => None,
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_message_in_pieces_comes_out_whole_in_order_with_its_trailers_after_it() {
        let (one, two) = (message(3), message(4));
        let both = [one.clone(), two.clone()].concat();
        let mut trailers = http::HeaderMap::new();
        trailers.insert("x-end", http::HeaderValue::from_static("1"));
        let mut body = wrapped(
            vec![
                data(&both[..2]),
                Poll::Pending,
                data(&[]),
                data(&both[2..10]),
                Poll::Pending,
                data(&both[10..14]),
                Poll::Ready(Some(Ok(Frame::trailers(trailers)))),
            ],
            false,
            1024,
        );
        assert!(next(&mut body).is_pending(), "two bytes of a prefix");
        assert_eq!(
            bytes_of(next(&mut body)),
            Some(one),
            "the first, once whole"
        );
        assert!(next(&mut body).is_pending());
        // The second is 3 bytes short when the trailers come: what is held goes first, as it is.
        assert_eq!(bytes_of(next(&mut body)), Some(two[..6].to_vec()));
        match next(&mut body) {
            Poll::Ready(Some(Ok(frame))) => assert!(frame.is_trailers()),
            other => panic!("{other:?}"),
        }
        assert!(matches!(next(&mut body), Poll::Ready(None)));
        assert!(body.is_end_stream());
    }

    #[tokio::test(start_paused = true)]
    async fn whole_messages_pass_as_they_are_and_a_length_past_the_bound_at_once() {
        let two = [message(2), message(0)].concat();
        let mut body = wrapped(vec![data(&two)], true, 1024);
        assert_eq!(bytes_of(next(&mut body)), Some(two));
        assert!(body.held.is_empty());
        // Declared past the bound: the prefix goes on at once (tonic refuses it), and what follows too.
        let big = message(2000);
        let mut body = wrapped(vec![data(&big[..5]), data(&big[5..9])], true, 1024);
        assert_eq!(bytes_of(next(&mut body)), Some(big[..5].to_vec()));
        assert_eq!(bytes_of(next(&mut body)), Some(big[5..9].to_vec()));
    }

    #[tokio::test(start_paused = true)]
    async fn a_unary_request_and_a_begun_message_must_arrive_within_the_timeout() {
        let timed_out = |polled: Polled| matches!(polled, Poll::Ready(Some(Err(status))) if status.code() == tonic::Code::DeadlineExceeded);
        // Unary, nothing sent yet: bounded.
        let mut body = wrapped(
            vec![Poll::Pending, Poll::Pending, Poll::Pending],
            true,
            1024,
        );
        assert!(next(&mut body).is_pending());
        tokio::time::advance(Duration::from_secs(9)).await;
        assert!(next(&mut body).is_pending());
        tokio::time::advance(Duration::from_secs(1)).await;
        assert!(timed_out(next(&mut body)));
        assert!(matches!(next(&mut body), Poll::Ready(None)));

        // A stream between messages waits for ever; within a message, 10 s from the first wait.
        let m = message(5);
        let mut body = wrapped(
            vec![
                Poll::Pending,
                data(&m),
                Poll::Pending,
                data(&m[..3]),
                Poll::Pending,
                Poll::Pending,
            ],
            false,
            1024,
        );
        assert!(next(&mut body).is_pending());
        tokio::time::advance(Duration::from_secs(60)).await;
        assert_eq!(bytes_of(next(&mut body)), Some(m.clone()));
        assert!(next(&mut body).is_pending());
        tokio::time::advance(Duration::from_secs(60)).await;
        assert!(next(&mut body).is_pending(), "three bytes held");
        tokio::time::advance(Duration::from_secs(10)).await;
        assert!(timed_out(next(&mut body)));
    }

    fn message(len: usize) -> Vec<u8> {
        let mut m = vec![0];
        m.extend_from_slice(&(len as u32).to_be_bytes());
        m.extend(std::iter::repeat_n(7u8, len));
        m
    }

    #[tokio::test(start_paused = true)]
    async fn the_bytes_held_over_every_call_are_bounded_and_given_back() {
        let budget = Arc::new(HeldBytes::new(20));
        let with_budget = |steps| {
            let mut body = wrapped(steps, true, 1024);
            body.budget = budget.clone();
            body
        };
        let one = message(10);
        // 12 of 15 bytes held.
        let mut first = with_budget(vec![data(&one[..12]), Poll::Pending, data(&one[12..])]);
        assert!(next(&mut first).is_pending());
        assert_eq!(budget.held(), 12);
        // Another call's 9 would make 21: refused, and what it held is given back.
        let mut second = with_budget(vec![data(&one[..4]), Poll::Pending, data(&one[4..13])]);
        assert!(next(&mut second).is_pending());
        assert_eq!(budget.held(), 16);
        match next(&mut second) {
            Poll::Ready(Some(Err(status))) => {
                assert_eq!(status.code(), tonic::Code::ResourceExhausted);
                assert!(
                    status.message().contains("grpc.max_held_bytes"),
                    "{status:?}"
                );
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(budget.held(), 12);
        // The first completes: its message goes on whole, and its bytes are no longer held.
        assert_eq!(bytes_of(next(&mut first)), Some(one.clone()));
        assert_eq!(budget.held(), 0);
        // A call that ends while holding gives its bytes back.
        let mut third = with_budget(vec![data(&one[..7]), Poll::Pending]);
        assert!(next(&mut third).is_pending());
        assert_eq!(budget.held(), 7);
        drop(third);
        assert_eq!(budget.held(), 0);
    }

    #[test]
    fn whole_messages_are_measured_by_their_prefixes() {
        assert_eq!(whole(&[]), 0);
        assert_eq!(whole(&message(0)), 5);
        assert_eq!(whole(&message(3)), 8);
        assert_eq!(whole(&message(3)[..7]), 0);
        let two = [message(3), message(2)].concat();
        assert_eq!(whole(&two), 15);
        assert_eq!(whole(&two[..12]), 8);
        assert_eq!(declared(&message(300)[..5]), Some(300));
        assert_eq!(declared(&message(300)[..4]), None);
        // A length at u32's end is not there yet.
        assert_eq!(whole(&[0, 255, 255, 255, 255, 1]), 0);
    }
}
