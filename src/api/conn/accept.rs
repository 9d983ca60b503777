//! The accept loop: a connection is accepted only while it has a place among the open ones, and it
//! carries its listener's bounds from the moment of its accept.

use std::{sync::Arc, time::Duration};

use tokio::{
    net::{TcpListener, TcpStream},
    sync::{OwnedSemaphorePermit, Semaphore},
    time::Instant,
};
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;

use super::{bounds::Timers, deadline::later, Bounds, Counted};

/// How long an accept loop pauses after a failed accept (out of file descriptors and the like), so that
/// it neither spins nor gives up: the connections that close meanwhile give the descriptors back.
const ACCEPT_RETRY: Duration = Duration::from_millis(50);
/// At most one warning about failed accepts per this long: under EMFILE every retry fails.
const ACCEPT_WARN_EVERY: Duration = Duration::from_secs(5);

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
        self.bounds
            .handshake
            .map(|after| later(self.accepted, after))
    }

    /// This place for an HTTP/1 connection, which sends no HTTP/2 client preface to end the handshake
    /// bound: a TLS handshake is bounded by [`Place::handshake_deadline`] before, and the connection by
    /// its other bounds after (it would otherwise be cut at the handshake bound, however busy).
    pub fn http1(mut self) -> Self {
        self.bounds.handshake = None;
        self
    }

    /// The connection over `io` (the TCP stream, or the TLS stream over it), holding this place.
    pub fn connection<IO>(self, io: IO) -> Counted<IO> {
        let timers = Timers::arm(self.bounds, self.accepted);
        Counted::new(io, self.permit, timers)
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

#[cfg(test)]
mod tests {
    use super::*;

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
