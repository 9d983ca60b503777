//! The accepted connection as the servers see it: a stream that holds its place and fails once one of
//! its bounds is passed, and what tonic learns of it for each request.

use std::{
    net::SocketAddr,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
};

use tokio::{
    io::{AsyncRead, AsyncWrite, ReadBuf},
    net::TcpStream,
    sync::OwnedSemaphorePermit,
};
use tokio_rustls::server::TlsStream;
use tonic::transport::server::{Connected, TcpConnectInfo};

use super::{bounds::Timers, Activity};

/// A connection holding its place among the open ones until it is dropped, and failing its reads and
/// writes once one of its bounds is passed (see [`conn`](super)).
#[derive(Debug)]
pub struct Counted<IO> {
    io: IO,
    _place: OwnedSemaphorePermit,
    /// Its bounds; they also hold its calls when they are counted, for [`ConnectionInfo`].
    timers: Timers,
}

impl<IO> Counted<IO> {
    /// `io` holding `place` under the bounds of `timers`.
    pub(super) fn new(io: IO, place: OwnedSemaphorePermit, timers: Timers) -> Self {
        Self {
            io,
            _place: place,
            timers,
        }
    }
}

impl<IO: AsyncRead + Unpin> AsyncRead for Counted<IO> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        if let Some(closed) = self.timers.closed(cx) {
            return Poll::Ready(Err(closed.error()));
        }
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.io).poll_read(cx, buf);
        if let Poll::Ready(Ok(())) = polled {
            self.timers.read(&buf.filled()[before..]);
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
        if let Some(closed) = self.timers.closed(cx) {
            return Poll::Ready(Err(closed.error()));
        }
        let polled = Pin::new(&mut self.io).poll_write(cx, buf);
        if let Poll::Ready(Ok(1..)) = polled {
            self.timers.moved();
        }
        polled
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        if let Some(closed) = self.timers.closed(cx) {
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
        if let Some(closed) = self.timers.closed(cx) {
            return Poll::Ready(Err(closed.error()));
        }
        let polled = Pin::new(&mut self.io).poll_write_vectored(cx, bufs);
        if let Poll::Ready(Ok(1..)) = polled {
            self.timers.moved();
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
            activity: self.timers.activity().cloned(),
        }
    }
}

impl Connected for Counted<TlsStream<TcpStream>> {
    type ConnectInfo = ConnectionInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        let tcp: TcpConnectInfo = self.io.get_ref().0.connect_info();
        ConnectionInfo {
            remote: tcp.remote_addr(),
            activity: self.timers.activity().cloned(),
        }
    }
}
