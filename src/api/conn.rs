//! Accepting connections, on both listeners, with a bound on how many are open at once, and the
//! bounds each connection carries through its life.
//!
//! - **Places.** Past the listener's `max_connections` the accept loop waits for a connection to close:
//!   new clients wait in the kernel's backlog instead of costing memory or a file descriptor here. An
//!   accept that fails (out of file descriptors: EMFILE, ENFILE) pauses the loop briefly and is tried
//!   again; it never ends the loop or the listener.
//! - **Handshake** (gRPC). A connection must finish its TLS handshake and send the HTTP/2 client
//!   preface (24 bytes of magic and a SETTINGS frame) within `grpc.handshake_timeout` of its accept, or
//!   its reads and writes fail and the server drops it: silent connections cannot keep the places.
//! - **Idle** (gRPC). A connection on which no call has been in flight for `grpc.idle_timeout` is closed
//!   the same way (grpc-go's MaxConnectionIdle). Calls are counted by [`TrackCallsLayer`], which finds
//!   the connection's [`Activity`] in each request's extensions (tonic puts the connection's
//!   [`ConnectionInfo`] there). With no call in flight, closing loses nothing; the client reconnects on
//!   its next call. The close is not an HTTP/2 GOAWAY (tonic offers no per-connection graceful close),
//!   so a call the client sends at that very moment fails as on any lost connection. Bytes alone cannot
//!   tell idleness: HTTP/2 keep-alive PINGs flow on idle connections.
//! - **Stall** (HTTP). A connection that moves no byte either way for `http.idle_timeout` is closed: a
//!   stalled upload, a client that stops reading its answer.
//! - **Cut-off** (gRPC age). Connections are recycled by age (`grpc.max_connection_age`): tonic closes
//!   them gracefully at the age (HTTP/2 GOAWAY), and each connection is cut at the age plus the grace,
//!   whatever still runs on it. tonic's own `max_connection_age_grace` is not used: with it set, tonic
//!   skips the GOAWAY at the age and only closes the connection abruptly at the age plus the grace.
//!
//! Every timer is polled from the connection's own reads and writes, so an idle connection (a read
//! pending, nothing to write) is woken and closed on time, and nothing runs beside the connection.

use std::{
    future::Future,
    net::SocketAddr,
    pin::Pin,
    sync::{
        atomic::{AtomicU64, AtomicUsize, Ordering},
        Arc,
    },
    task::{Context, Poll, Waker},
    time::Duration,
};

use tokio::{
    io::{AsyncRead, AsyncWrite, ReadBuf},
    net::{TcpListener, TcpStream},
    sync::{OwnedSemaphorePermit, Semaphore},
    time::{Instant, Sleep},
};
use tokio_rustls::server::TlsStream;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::{
    codegen::http,
    transport::server::{Connected, TcpConnectInfo},
};

/// How long an accept loop pauses after a failed accept (out of file descriptors and the like), so that
/// it neither spins nor gives up: the connections that close meanwhile give the descriptors back.
const ACCEPT_RETRY: Duration = Duration::from_millis(50);
/// At most one warning about failed accepts per this long: under EMFILE every retry fails.
const ACCEPT_WARN_EVERY: Duration = Duration::from_secs(5);

/// When gRPC connections are recycled, from `grpc.max_connection_age` and `grpc.max_connection_age_grace`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectionAge {
    /// Age at which a connection is closed gracefully (GOAWAY); `None`: never.
    pub close_after: Option<Duration>,
    /// Age at which a connection is cut whatever still runs on it; `None`: never.
    pub cut_off_after: Option<Duration>,
}

impl ConnectionAge {
    /// The settings' age varied by up to ±10 %, as the reference does. tonic takes one age for every
    /// connection, so the variation is drawn once per process: replicas started together still spread
    /// their recycling. A zero age never recycles; a zero grace never cuts.
    pub fn draw(age: Duration, grace: Duration) -> Self {
        Self::with_factor(age, grace, rand::random_range(0.9..=1.1))
    }

    fn with_factor(age: Duration, grace: Duration, factor: f64) -> Self {
        if age.is_zero() {
            return Self {
                close_after: None,
                cut_off_after: None,
            };
        }
        // Saturates instead of panicking on absurdly long ages.
        let age = Duration::try_from_secs_f64(age.as_secs_f64() * factor).unwrap_or(Duration::MAX);
        Self {
            close_after: Some(age),
            cut_off_after: (!grace.is_zero()).then(|| age.saturating_add(grace)),
        }
    }
}

/// The bounds every connection of one listener carries; `None` leaves a bound off.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Bounds {
    /// From the accept: the TLS handshake (if any) and the HTTP/2 client preface must be done by then.
    pub handshake: Option<Duration>,
    /// Closed once no call has been in flight for this long (calls counted by [`TrackCallsLayer`]).
    pub idle: Option<Duration>,
    /// Closed once no byte has been read or written for this long.
    pub stall: Option<Duration>,
    /// From the accept: cut whatever still runs on it.
    pub cut_off: Option<Duration>,
}

/// Why a connection's reads and writes fail.
#[derive(Debug, Clone, Copy)]
enum Closed {
    CutOff,
    Handshake,
    Idle,
    Stall,
}

impl Closed {
    fn error(self) -> std::io::Error {
        let reason = match self {
            Self::CutOff => {
                "connection outlived grpc.max_connection_age plus grpc.max_connection_age_grace"
            }
            Self::Handshake => {
                "no TLS handshake and HTTP/2 preface within grpc.handshake_timeout of the accept"
            }
            Self::Idle => "no call in flight for grpc.idle_timeout",
            Self::Stall => "no byte read or written for http.idle_timeout",
        };
        std::io::Error::new(std::io::ErrorKind::TimedOut, reason)
    }
}

/// What is going on on one connection, shared between the connection and the calls made on it.
#[derive(Debug)]
pub struct Activity {
    /// The connection's accept: `idle_since` counts from it.
    origin: Instant,
    /// Calls begun and not yet answered in full.
    in_flight: AtomicUsize,
    /// Nanoseconds from `origin` to the end of the last call (0: none ended yet).
    idle_since: AtomicU64,
}

impl Activity {
    fn new(origin: Instant) -> Self {
        Self {
            origin,
            in_flight: AtomicUsize::new(0),
            idle_since: AtomicU64::new(0),
        }
    }

    /// Counts a call as in flight until the returned guard drops.
    pub fn begin(self: &Arc<Self>) -> CallGuard {
        self.in_flight.fetch_add(1, Ordering::AcqRel);
        CallGuard(self.clone())
    }

    /// Since when no call has been in flight; `None` while one is.
    fn idle_since(&self) -> Option<Instant> {
        if self.in_flight.load(Ordering::Acquire) > 0 {
            return None;
        }
        let nanos = self.idle_since.load(Ordering::Acquire);
        Some(self.origin + Duration::from_nanos(nanos))
    }
}

/// A call in flight on a connection; dropping it ends the call.
#[derive(Debug)]
pub struct CallGuard(Arc<Activity>);

impl Drop for CallGuard {
    fn drop(&mut self) {
        let since = Instant::now().saturating_duration_since(self.0.origin);
        let nanos = u64::try_from(since.as_nanos()).unwrap_or(u64::MAX);
        // The end is stored before the count drops, so whoever sees no call in flight sees it.
        self.0.idle_since.fetch_max(nanos, Ordering::AcqRel);
        self.0.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Progress through the HTTP/2 client preface: 24 bytes of magic, then a SETTINGS frame (a 9-byte
/// header whose first 3 bytes are the payload length, then the payload). The bytes are not checked
/// here: the HTTP/2 server refuses a wrong preface by itself.
#[derive(Debug, Default)]
struct Preface {
    /// Bytes read so far.
    seen: usize,
    /// The SETTINGS frame's payload length, as far as read.
    length: [u8; 3],
}

impl Preface {
    const MAGIC: usize = 24;
    const FRAME_HEADER: usize = 9;

    /// Takes in the next bytes read; whether the preface is complete.
    fn advance(&mut self, read: &[u8]) -> bool {
        for (i, slot) in self.length.iter_mut().enumerate() {
            if let Some(b) = (Self::MAGIC + i)
                .checked_sub(self.seen)
                .and_then(|at| read.get(at))
            {
                *slot = *b;
            }
        }
        self.seen = self.seen.saturating_add(read.len());
        let [a, b, c] = self.length;
        let payload = u32::from_be_bytes([0, a, b, c]) as usize;
        self.seen >= Self::MAGIC + 3 && self.seen >= Self::MAGIC + Self::FRAME_HEADER + payload
    }
}

/// A timer checked on every read and write of a connection. Polling a tokio timer on every I/O call
/// costs enough to slow a busy connection measurably (`tests/redis_deadlines.rs`'s burst of 2 000
/// calls missed its deadlines with two timers polled per call), so the timer is polled only to register
/// the connection's task, once per task, and otherwise only asked whether it has fired.
#[derive(Debug)]
struct Deadline {
    timer: Pin<Box<Sleep>>,
    /// The task that will be woken when the timer fires.
    registered: Option<Waker>,
}

impl Deadline {
    fn at(when: Instant) -> Self {
        Self {
            timer: Box::pin(tokio::time::sleep_until(when)),
            registered: None,
        }
    }

    /// Whether the deadline has passed; makes sure the current task is woken when it does.
    fn passed(&mut self, cx: &mut Context<'_>) -> bool {
        if self.timer.is_elapsed() {
            return true;
        }
        if self
            .registered
            .as_ref()
            .is_some_and(|task| task.will_wake(cx.waker()))
        {
            return false;
        }
        // Outside the task's cooperative budget: a poll refused for budget would not register.
        let mut poll = tokio::task::unconstrained(self.timer.as_mut());
        if Pin::new(&mut poll).poll(cx).is_ready() {
            return true;
        }
        self.registered = Some(cx.waker().clone());
        false
    }

    fn reset(&mut self, when: Instant) {
        self.timer.as_mut().reset(when);
        self.registered = None;
    }
}

/// A timer re-armed from a moving start: it fires once `after` has passed since the latest start.
#[derive(Debug)]
struct Quiet {
    after: Duration,
    deadline: Deadline,
}

impl Quiet {
    fn new(start: Instant, after: Duration) -> Self {
        Self {
            after,
            deadline: Deadline::at(start + after),
        }
    }

    /// Whether `after` has passed since `since()` (`None`: not quiet now, look again in `after`).
    /// Also makes sure the task is woken when it may have.
    fn expired(&mut self, cx: &mut Context<'_>, since: impl Fn() -> Option<Instant>) -> bool {
        loop {
            if !self.deadline.passed(cx) {
                return false;
            }
            let now = Instant::now();
            let due = since().map_or(now + self.after, |start| start + self.after);
            if due <= now {
                return true;
            }
            self.deadline.reset(due);
        }
    }
}

/// A connection holding its place among the open ones until it is dropped, and failing its reads and
/// writes once one of its bounds is passed (see the module's documentation).
#[derive(Debug)]
pub struct Counted<IO> {
    io: IO,
    _place: OwnedSemaphorePermit,
    cut_off: Option<Deadline>,
    /// Until the preface is complete: its deadline and progress.
    handshake: Option<(Deadline, Preface)>,
    idle: Option<(Quiet, Arc<Activity>)>,
    /// The stall timer and the last time a byte moved.
    stall: Option<(Quiet, Instant)>,
    /// Present when calls are counted, for [`ConnectionInfo`].
    activity: Option<Arc<Activity>>,
}

impl<IO> Counted<IO> {
    /// Why the connection must close now, if it must; makes sure the connection's task is woken when
    /// one of its timers fires.
    fn closed(&mut self, cx: &mut Context<'_>) -> Option<Closed> {
        if let Some(deadline) = &mut self.cut_off {
            if deadline.passed(cx) {
                return Some(Closed::CutOff);
            }
        }
        if let Some((deadline, _)) = &mut self.handshake {
            if deadline.passed(cx) {
                return Some(Closed::Handshake);
            }
        }
        if let Some((quiet, activity)) = &mut self.idle {
            if quiet.expired(cx, || activity.idle_since()) {
                return Some(Closed::Idle);
            }
        }
        if let Some((quiet, last)) = &mut self.stall {
            let last = *last;
            if quiet.expired(cx, || Some(last)) {
                return Some(Closed::Stall);
            }
        }
        None
    }

    fn moved(&mut self) {
        if let Some((_, last)) = &mut self.stall {
            *last = Instant::now();
        }
    }
}

impl<IO: AsyncRead + Unpin> AsyncRead for Counted<IO> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        if let Some(closed) = self.closed(cx) {
            return Poll::Ready(Err(closed.error()));
        }
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.io).poll_read(cx, buf);
        if let Poll::Ready(Ok(())) = polled {
            let read = &buf.filled()[before..];
            if !read.is_empty() {
                self.moved();
                if let Some((_, preface)) = &mut self.handshake {
                    if preface.advance(read) {
                        self.handshake = None;
                    }
                }
            }
        }
        polled
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for Counted<IO> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        if let Some(closed) = self.closed(cx) {
            return Poll::Ready(Err(closed.error()));
        }
        let polled = Pin::new(&mut self.io).poll_write(cx, buf);
        if let Poll::Ready(Ok(1..)) = polled {
            self.moved();
        }
        polled
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        if let Some(closed) = self.closed(cx) {
            return Poll::Ready(Err(closed.error()));
        }
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        if let Some(closed) = self.closed(cx) {
            return Poll::Ready(Err(closed.error()));
        }
        let polled = Pin::new(&mut self.io).poll_write_vectored(cx, bufs);
        if let Poll::Ready(Ok(1..)) = polled {
            self.moved();
        }
        polled
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}

/// What tonic puts in the extensions of every request on a connection.
#[derive(Debug, Clone)]
pub struct ConnectionInfo {
    /// The client's address.
    pub remote: Option<SocketAddr>,
    /// The connection's calls, when they are counted (`grpc.idle_timeout`).
    pub activity: Option<Arc<Activity>>,
}

impl Connected for Counted<TcpStream> {
    type ConnectInfo = ConnectionInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        ConnectionInfo {
            remote: self.io.connect_info().remote_addr(),
            activity: self.activity.clone(),
        }
    }
}

impl Connected for Counted<TlsStream<TcpStream>> {
    type ConnectInfo = ConnectionInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        let tcp: TcpConnectInfo = self.io.get_ref().0.connect_info();
        ConnectionInfo {
            remote: tcp.remote_addr(),
            activity: self.activity.clone(),
        }
    }
}

/// An accepted connection's place among the open ones, and when it was accepted.
#[derive(Debug)]
pub struct Place {
    permit: OwnedSemaphorePermit,
    accepted: Instant,
    bounds: Bounds,
}

impl Place {
    /// When the handshake and preface must be done; `None`: no bound.
    pub fn handshake_deadline(&self) -> Option<Instant> {
        self.bounds.handshake.map(|after| self.accepted + after)
    }

    /// The connection over `io` (the TCP stream, or the TLS stream over it), holding this place.
    pub fn connection<IO>(self, io: IO) -> Counted<IO> {
        let Bounds {
            handshake,
            idle,
            stall,
            cut_off,
        } = self.bounds;
        let at = |after: Duration| Deadline::at(self.accepted + after);
        let activity = idle.map(|_| Arc::new(Activity::new(self.accepted)));
        Counted {
            io,
            _place: self.permit,
            cut_off: cut_off.map(at),
            handshake: handshake.map(|after| (at(after), Preface::default())),
            idle: idle
                .zip(activity.clone())
                .map(|(after, activity)| (Quiet::new(self.accepted, after), activity)),
            stall: stall.map(|after| (Quiet::new(self.accepted, after), self.accepted)),
            activity,
        }
    }
}

/// Accepts connections while fewer than the bound are open.
#[derive(Debug)]
pub struct Acceptor {
    listener: TcpListener,
    places: Arc<Semaphore>,
    /// The listener's name in logs.
    what: &'static str,
    bounds: Bounds,
}

impl Acceptor {
    pub fn new(listener: TcpListener, max_connections: usize, what: &'static str) -> Self {
        Self {
            listener,
            places: Arc::new(Semaphore::new(
                max_connections.clamp(1, Semaphore::MAX_PERMITS),
            )),
            what,
            bounds: Bounds::default(),
        }
    }

    /// The bounds every accepted connection carries.
    pub fn bounds(mut self, bounds: Bounds) -> Self {
        self.bounds = bounds;
        self
    }

    /// The next connection and its place, once there is room for it; `None` once `stop` is cancelled.
    pub async fn accept(&self, stop: &CancellationToken) -> Option<(TcpStream, Place)> {
        let mut warned: Option<Instant> = None;
        loop {
            let permit = tokio::select! {
                _ = stop.cancelled() => return None,
                permit = self.places.clone().acquire_owned() => permit.ok()?,
            };
            let accepted = tokio::select! {
                _ = stop.cancelled() => return None,
                accepted = self.listener.accept() => accepted,
            };
            match accepted {
                Ok((io, _)) => {
                    let _ = io.set_nodelay(true);
                    let place = Place {
                        permit,
                        accepted: Instant::now(),
                        bounds: self.bounds,
                    };
                    return Some((io, place));
                }
                Err(err) => {
                    // Out of file descriptors and the like: the client stays in the backlog; wait for
                    // descriptors to come back instead of spinning, and keep serving the open ones.
                    if warned.is_none_or(|at| at.elapsed() >= ACCEPT_WARN_EVERY) {
                        tracing::warn!(
                            "{} accept failed, retrying every {ACCEPT_RETRY:?}: {err}",
                            self.what
                        );
                        warned = Some(Instant::now());
                    }
                    drop(permit);
                    tokio::select! {
                        _ = stop.cancelled() => return None,
                        _ = tokio::time::sleep(ACCEPT_RETRY) => {}
                    }
                }
            }
        }
    }

    /// Plaintext connections as a stream for the gRPC server, until `stop`; `closed` is cancelled once
    /// the listening socket is closed (see [`Acceptor::close_then`]).
    pub fn plaintext(
        self,
        stop: CancellationToken,
        closed: CancellationToken,
    ) -> ReceiverStream<std::io::Result<Counted<TcpStream>>> {
        let (tx, rx) = tokio::sync::mpsc::channel(128);
        tokio::spawn(async move {
            let acceptor = self.close_then(closed);
            while let Some((io, place)) = acceptor.accept(&stop).await {
                if tx.send(Ok(place.connection(io))).await.is_err() {
                    return;
                }
            }
        });
        ReceiverStream::new(rx)
    }
}

/// An [`Acceptor`] that cancels a token once it is dropped, that is once its listening socket is
/// closed. The gRPC server's graceful shutdown (GOAWAY) waits for it: a client that reconnects at once
/// after the GOAWAY is then refused at connect (and tries another replica) instead of landing in a
/// backlog that is about to be reset.
#[derive(Debug)]
pub struct Closing {
    acceptor: Acceptor,
    _closed: tokio_util::sync::DropGuard,
}

impl std::ops::Deref for Closing {
    type Target = Acceptor;

    fn deref(&self) -> &Acceptor {
        &self.acceptor
    }
}

impl Acceptor {
    /// This acceptor, cancelling `closed` once dropped.
    pub fn close_then(self, closed: CancellationToken) -> Closing {
        Closing {
            acceptor: self,
            _closed: closed.drop_guard(),
        }
    }
}

/// Counts the calls in flight on each connection, for `grpc.idle_timeout`: a call is in flight from
/// its request until its whole answer (streams included) has been sent.
#[derive(Debug, Clone, Copy, Default)]
pub struct TrackCallsLayer;

impl<S> tower::Layer<S> for TrackCallsLayer {
    type Service = TrackCalls<S>;

    fn layer(&self, inner: S) -> Self::Service {
        TrackCalls { inner }
    }
}

/// The service of [`TrackCallsLayer`].
#[derive(Debug, Clone)]
pub struct TrackCalls<S> {
    inner: S,
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

impl<S, B> tower::Service<http::Request<B>> for TrackCalls<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<tonic::body::Body>>,
    S::Future: Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = S::Error;
    type Future = BoxFuture<Result<Self::Response, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let guard = request
            .extensions()
            .get::<ConnectionInfo>()
            .and_then(|info| info.activity.as_ref())
            .map(Activity::begin);
        let answer = self.inner.call(request);
        Box::pin(async move {
            let response = answer.await?;
            Ok(match guard {
                Some(guard) => response.map(|body| {
                    tonic::body::Body::new(Guarded {
                        body,
                        _guard: guard,
                    })
                }),
                None => response,
            })
        })
    }
}

/// An answer's body that keeps its call in flight until it is sent in full (or dropped).
struct Guarded {
    body: tonic::body::Body,
    _guard: CallGuard,
}

impl http_body::Body for Guarded {
    type Data = <tonic::body::Body as http_body::Body>::Data;
    type Error = <tonic::body::Body as http_body::Body>::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    const HOUR: Duration = Duration::from_secs(3600);

    #[test]
    fn the_age_varies_by_ten_percent_and_the_grace_follows_it() {
        for _ in 0..1000 {
            let age = ConnectionAge::draw(24 * HOUR, HOUR);
            let close = age.close_after.unwrap();
            assert!(
                close >= 24 * HOUR * 9 / 10 && close <= 24 * HOUR * 11 / 10,
                "{close:?}"
            );
            assert_eq!(age.cut_off_after, Some(close + HOUR));
        }
        let low = ConnectionAge::with_factor(10 * HOUR, HOUR, 0.9);
        assert_eq!(low.close_after, Some(9 * HOUR));
        assert_eq!(low.cut_off_after, Some(10 * HOUR));
    }

    #[test]
    fn zero_means_never() {
        let never = ConnectionAge {
            close_after: None,
            cut_off_after: None,
        };
        assert_eq!(ConnectionAge::draw(Duration::ZERO, HOUR), never);
        let no_cut = ConnectionAge::with_factor(HOUR, Duration::ZERO, 1.0);
        assert_eq!(
            (no_cut.close_after, no_cut.cut_off_after),
            (Some(HOUR), None)
        );
        let huge = ConnectionAge::with_factor(Duration::MAX, HOUR, 1.1);
        assert_eq!(huge.close_after, Some(Duration::MAX), "saturates, no panic");
    }

    #[test]
    fn the_preface_is_complete_after_the_magic_and_the_whole_settings_frame() {
        let magic = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
        // A SETTINGS frame with two settings (12 bytes of payload).
        let settings = [0u8, 0, 12, 4, 0, 0, 0, 0, 0];
        let mut whole = magic.to_vec();
        whole.extend_from_slice(&settings);
        whole.extend_from_slice(&[0; 12]);

        let mut at_once = Preface::default();
        assert!(at_once.advance(&whole));

        // A byte at a time: complete on the last byte of the payload, not before.
        let mut trickled = Preface::default();
        for (i, b) in whole.iter().enumerate() {
            assert_eq!(trickled.advance(&[*b]), i == whole.len() - 1, "byte {i}");
        }

        // An empty SETTINGS frame ends the preface with its header.
        let mut empty = Preface::default();
        assert!(!empty.advance(&whole[..26]));
        assert!(!empty.advance(&[0, 4, 0, 0, 0, 0]));
        assert!(empty.advance(&[0]));
    }

    async fn connected(bounds: Bounds) -> (TcpStream, Counted<TcpStream>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let acceptor = Acceptor::new(listener, 10, "test").bounds(bounds);
        let stop = CancellationToken::new();
        let client = TcpStream::connect(addr).await.unwrap();
        let (io, place) = acceptor.accept(&stop).await.unwrap();
        (client, place.connection(io))
    }

    #[tokio::test(start_paused = true)]
    async fn a_connection_past_its_cut_off_fails_its_reads_and_writes() {
        let (mut client, mut conn) = connected(Bounds {
            cut_off: Some(Duration::from_secs(5)),
            ..Bounds::default()
        })
        .await;
        client.write_all(b"ping").await.unwrap();
        let mut buf = [0u8; 4];
        conn.read_exact(&mut buf).await.unwrap();
        conn.write_all(b"pong").await.unwrap();

        // Idle: the pending read is woken by the cut-off and fails.
        let started = Instant::now();
        let err = conn.read(&mut buf).await.unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::TimedOut);
        assert_eq!(started.elapsed(), Duration::from_secs(5));
        assert!(conn.write_all(b"late").await.is_err());
    }

    #[tokio::test(start_paused = true)]
    async fn a_connection_without_its_preface_in_time_fails_and_one_with_it_does_not() {
        let bounds = Bounds {
            handshake: Some(Duration::from_secs(10)),
            ..Bounds::default()
        };
        let (mut client, mut conn) = connected(bounds).await;
        let started = Instant::now();
        // Half of the magic, then silence.
        client.write_all(b"PRI * HTTP/2").await.unwrap();
        let mut buf = [0u8; 64];
        assert_eq!(conn.read(&mut buf).await.unwrap(), 12);
        let err = conn.read(&mut buf).await.unwrap_err();
        assert!(err.to_string().contains("grpc.handshake_timeout"), "{err}");
        assert_eq!(started.elapsed(), Duration::from_secs(10));

        let (mut client, mut conn) = connected(bounds).await;
        client
            .write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0")
            .await
            .unwrap();
        let mut preface = [0u8; 33];
        conn.read_exact(&mut preface).await.unwrap();
        let waiting = tokio::time::timeout(Duration::from_secs(60), conn.read(&mut buf)).await;
        assert!(waiting.is_err(), "still open after the handshake bound");
    }

    #[tokio::test(start_paused = true)]
    async fn a_connection_closes_once_idle_but_never_while_a_call_is_in_flight() {
        let (mut client, mut conn) = connected(Bounds {
            idle: Some(Duration::from_secs(300)),
            ..Bounds::default()
        })
        .await;
        let activity = conn.activity.clone().unwrap();
        let started = Instant::now();
        let call = activity.begin();
        // A call running longer than the idle bound keeps the connection.
        let mut buf = [0u8; 8];
        let waiting = tokio::time::timeout(Duration::from_secs(400), conn.read(&mut buf)).await;
        assert!(waiting.is_err(), "closed with a call in flight");
        drop(call);
        let ended = Instant::now();
        client.write_all(b"x").await.unwrap();
        assert_eq!(conn.read(&mut buf).await.unwrap(), 1, "bytes are no call");
        let err = conn.read(&mut buf).await.unwrap_err();
        assert!(err.to_string().contains("grpc.idle_timeout"), "{err}");
        assert_eq!(ended.elapsed(), Duration::from_secs(300));
        assert!(started.elapsed() >= Duration::from_secs(700));
    }

    #[tokio::test(start_paused = true)]
    async fn a_connection_that_moves_no_byte_closes_and_one_that_does_stays() {
        let (mut client, mut conn) = connected(Bounds {
            stall: Some(Duration::from_secs(30)),
            ..Bounds::default()
        })
        .await;
        let mut buf = [0u8; 8];
        for _ in 0..4 {
            tokio::time::sleep(Duration::from_secs(20)).await;
            client.write_all(b"x").await.unwrap();
            assert_eq!(conn.read(&mut buf).await.unwrap(), 1);
        }
        let quiet = Instant::now();
        let err = conn.read(&mut buf).await.unwrap_err();
        assert!(err.to_string().contains("http.idle_timeout"), "{err}");
        assert_eq!(quiet.elapsed(), Duration::from_secs(30));
    }

    #[tokio::test(start_paused = true)]
    async fn places_are_given_back_when_connections_close() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let acceptor = Acceptor::new(listener, 1, "test");
        let stop = CancellationToken::new();
        let _first_client = TcpStream::connect(addr).await.unwrap();
        let (io, place) = acceptor.accept(&stop).await.unwrap();
        let first = place.connection(io);
        let _second_client = TcpStream::connect(addr).await.unwrap();
        let waiting = tokio::time::timeout(Duration::from_secs(5), acceptor.accept(&stop)).await;
        assert!(waiting.is_err(), "a second place while the first is held");
        drop(first);
        assert!(acceptor.accept(&stop).await.is_some());
        stop.cancel();
        assert!(acceptor.accept(&stop).await.is_none());
    }
}
