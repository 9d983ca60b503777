//! Accepting gRPC connections with a bound on how many are open at once: past the bound the accept loop
//! waits for one to close, and new clients wait in the kernel's backlog instead of costing memory here.

use std::{
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
    time::Duration,
};

use tokio::{
    io::{AsyncRead, AsyncWrite, ReadBuf},
    net::{TcpListener, TcpStream},
    sync::{OwnedSemaphorePermit, Semaphore},
};
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::transport::server::{Connected, TcpConnectInfo};

/// A connection holding its place among the open ones until it is dropped.
#[derive(Debug)]
pub struct Counted<IO> {
    io: IO,
    _place: OwnedSemaphorePermit,
}

impl<IO: AsyncRead + Unpin> AsyncRead for Counted<IO> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for Counted<IO> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
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
}

impl Acceptor {
    pub fn new(listener: TcpListener, max_connections: usize) -> Self {
        Self {
            listener,
            places: Arc::new(Semaphore::new(
                max_connections.clamp(1, Semaphore::MAX_PERMITS),
            )),
        }
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
                    return Some(Counted { io, _place: place });
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
