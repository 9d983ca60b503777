//! The bounds a connection carries, from the settings to the timers each connection arms at its
//! accept and checks on each of its reads and writes.

use std::{sync::Arc, task::Context, time::Duration};

use tokio::time::Instant;

use super::{
    calls::Activity,
    deadline::{later, Deadline, Quiet},
    preface::Preface,
};

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
    /// Closed once no call has been in flight for this long (calls counted by
    /// [`TrackCallsLayer`](super::TrackCallsLayer)).
    pub idle: Option<Duration>,
    /// Closed once no byte has been read or written for this long.
    pub stall: Option<Duration>,
    /// From the accept: cut whatever still runs on it.
    pub cut_off: Option<Duration>,
}

/// Why a connection's reads and writes fail.
#[derive(Debug, Clone, Copy)]
pub(super) enum Closed {
    CutOff,
    Handshake,
    Idle,
    Stall,
}

impl Closed {
    pub(super) fn error(self) -> std::io::Error {
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

/// The bounds of one connection, armed at its accept and checked on each of its reads and writes.
#[derive(Debug)]
pub(super) struct Timers {
    cut_off: Option<Deadline>,
    /// Until the preface is complete: its deadline and progress.
    handshake: Option<(Deadline, Preface)>,
    idle: Option<(Quiet, Arc<Activity>)>,
    /// The stall timer and the last time a byte moved.
    stall: Option<(Quiet, Instant)>,
}

impl Timers {
    /// `bounds`, counted from the connection's accept.
    pub(super) fn arm(bounds: Bounds, accepted: Instant) -> Self {
        let Bounds {
            handshake,
            idle,
            stall,
            cut_off,
        } = bounds;
        let at = |after: Duration| Deadline::at(later(accepted, after));
        Self {
            cut_off: cut_off.map(at),
            handshake: handshake.map(|after| (at(after), Preface::default())),
            idle: idle.map(|after| {
                let activity = Arc::new(Activity::new(accepted));
                (Quiet::new(accepted, after), activity)
            }),
            stall: stall.map(|after| (Quiet::new(accepted, after), accepted)),
        }
    }

    /// The connection's calls, when they are counted (an idle bound is set).
    pub(super) fn activity(&self) -> Option<&Arc<Activity>> {
        self.idle.as_ref().map(|(_, activity)| activity)
    }

    /// Why the connection must close now, if it must; makes sure the connection's task is woken when
    /// one of its timers fires.
    pub(super) fn closed(&mut self, cx: &mut Context<'_>) -> Option<Closed> {
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

    /// Takes in the bytes of a read: any byte is movement, and may complete the preface.
    pub(super) fn read(&mut self, read: &[u8]) {
        if read.is_empty() {
            return;
        }
        self.moved();
        if let Some((_, preface)) = &mut self.handshake {
            if preface.advance(read) {
                self.handshake = None;
            }
        }
    }

    /// A byte moved, either way: the stall bound counts from now.
    pub(super) fn moved(&mut self) {
        if let Some((_, last)) = &mut self.stall {
            *last = Instant::now();
        }
    }
}

#[cfg(test)]
mod tests {
    use tokio::{
        io::{AsyncReadExt, AsyncWriteExt},
        net::{TcpListener, TcpStream},
    };
    use tokio_util::sync::CancellationToken;
    use tonic::transport::server::Connected;

    use super::*;
    use crate::api::conn::{Acceptor, Counted};

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

    async fn connected(bounds: Bounds) -> (TcpStream, Counted<TcpStream>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let acceptor = Acceptor::new(listener, 10, "test").bounds(bounds);
        let stop = CancellationToken::new();
        let client = TcpStream::connect(addr).await.unwrap();
        let (io, place) = acceptor.accept(&stop).await.unwrap();
        (client, place.connection(io))
    }

    #[tokio::test]
    async fn bounds_of_centuries_never_fire_and_never_panic() {
        let huge = Duration::MAX;
        let (mut client, mut conn) = connected(Bounds {
            handshake: Some(huge),
            idle: Some(huge),
            stall: Some(huge),
            cut_off: Some(huge),
        })
        .await;
        client.write_all(b"ping").await.unwrap();
        let mut buf = [0u8; 4];
        conn.read_exact(&mut buf).await.unwrap();
        conn.write_all(b"pong").await.unwrap();
        client.read_exact(&mut buf).await.unwrap();
        assert_eq!(&buf, b"pong");
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
        let activity = conn.connect_info().activity.unwrap();
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
}
