//! Accepting gRPC connections with a bound on how many are open at once: past the bound the accept loop
//! waits for one to close, and new clients wait in the kernel's backlog instead of costing memory here.
//!
//! Connections are also recycled by age (`grpc.max_connection_age`): tonic closes them gracefully at
//! the age (HTTP/2 GOAWAY), and each accepted connection carries its own cut-off at the age plus the
//! grace, after which its reads and writes fail so that the HTTP/2 server drops it whatever still runs
//! on it. tonic's own `max_connection_age_grace` is not used: with it set, tonic skips the GOAWAY at the
//! age and only closes the connection abruptly at the age plus the grace.

use std::{
    future::Future,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
    time::Duration,
};

use tokio::{
    io::{AsyncRead, AsyncWrite, ReadBuf},
    net::{TcpListener, TcpStream},
    sync::{OwnedSemaphorePermit, Semaphore},
    time::Sleep,
};
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::transport::server::{Connected, TcpConnectInfo};

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

/// A connection holding its place among the open ones until it is dropped, and failing its reads and
/// writes once it is past its cut-off.
#[derive(Debug)]
pub struct Counted<IO> {
    io: IO,
    _place: OwnedSemaphorePermit,
    /// Fires at the connection's age plus grace, counted from its accept; `None`: never.
    cut_off: Option<Pin<Box<Sleep>>>,
}

impl<IO> Counted<IO> {
    /// Whether the cut-off has passed. Polling the timer also registers the connection's task to be
    /// woken at the cut-off, so an idle connection (a read pending, nothing to write) is cut on time.
    fn past_cut_off(&mut self, cx: &mut Context<'_>) -> bool {
        self.cut_off
            .as_mut()
            .is_some_and(|timer| timer.as_mut().poll(cx).is_ready())
    }
}

fn cut_off() -> std::io::Error {
    std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        "connection outlived grpc.max_connection_age plus grpc.max_connection_age_grace",
    )
}

impl<IO: AsyncRead + Unpin> AsyncRead for Counted<IO> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        if self.past_cut_off(cx) {
            return Poll::Ready(Err(cut_off()));
        }
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for Counted<IO> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        if self.past_cut_off(cx) {
            return Poll::Ready(Err(cut_off()));
        }
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        if self.past_cut_off(cx) {
            return Poll::Ready(Err(cut_off()));
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
        if self.past_cut_off(cx) {
            return Poll::Ready(Err(cut_off()));
        }
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}

impl Connected for Counted<TcpStream> {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.io.connect_info()
    }
}

/// Accepts connections while fewer than the bound are open.
#[derive(Debug)]
pub struct Acceptor {
    listener: TcpListener,
    places: Arc<Semaphore>,
    /// How long after its accept a connection is cut; `None`: never.
    cut_off_after: Option<Duration>,
}

impl Acceptor {
    pub fn new(listener: TcpListener, max_connections: usize) -> Self {
        Self {
            listener,
            places: Arc::new(Semaphore::new(
                max_connections.clamp(1, Semaphore::MAX_PERMITS),
            )),
            cut_off_after: None,
        }
    }

    /// Cuts every connection this long after its accept ([`ConnectionAge::cut_off_after`]).
    pub fn cut_off_after(mut self, after: Option<Duration>) -> Self {
        self.cut_off_after = after;
        self
    }

    /// The next connection, once there is room for it; `None` once `stop` is cancelled.
    pub async fn accept(&self, stop: &CancellationToken) -> Option<Counted<TcpStream>> {
        loop {
            let place = tokio::select! {
                _ = stop.cancelled() => return None,
                place = self.places.clone().acquire_owned() => place.ok()?,
            };
            let accepted = tokio::select! {
                _ = stop.cancelled() => return None,
                accepted = self.listener.accept() => accepted,
            };
            match accepted {
                Ok((io, _)) => {
                    let _ = io.set_nodelay(true);
                    return Some(Counted {
                        io,
                        _place: place,
                        cut_off: self
                            .cut_off_after
                            .map(|after| Box::pin(tokio::time::sleep(after))),
                    });
                }
                Err(err) => {
                    // Out of file descriptors and the like: wait instead of spinning.
                    tracing::warn!("gRPC accept failed: {err}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
    }

    /// Plaintext connections as a stream for the gRPC server.
    pub fn plaintext(
        self,
        stop: CancellationToken,
    ) -> ReceiverStream<std::io::Result<Counted<TcpStream>>> {
        let (tx, rx) = tokio::sync::mpsc::channel(128);
        tokio::spawn(async move {
            while let Some(conn) = self.accept(&stop).await {
                if tx.send(Ok(conn)).await.is_err() {
                    return;
                }
            }
        });
        ReceiverStream::new(rx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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

    #[tokio::test(start_paused = true)]
    async fn a_connection_past_its_cut_off_fails_its_reads_and_writes() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let acceptor = Acceptor::new(listener, 10).cut_off_after(Some(Duration::from_secs(5)));
        let stop = CancellationToken::new();
        let mut client = TcpStream::connect(addr).await.unwrap();
        let mut conn = acceptor.accept(&stop).await.unwrap();
        client.write_all(b"ping").await.unwrap();
        let mut buf = [0u8; 4];
        conn.read_exact(&mut buf).await.unwrap();
        conn.write_all(b"pong").await.unwrap();

        // Idle: the pending read is woken by the cut-off and fails.
        let started = tokio::time::Instant::now();
        let err = conn.read(&mut buf).await.unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::TimedOut);
        assert_eq!(started.elapsed(), Duration::from_secs(5));
        assert!(conn.write_all(b"late").await.is_err());
    }
}
