//! gRPC connection age over real sockets: after `grpc.max_connection_age` the server sends GOAWAY, a
//! call in flight on the connection still gets its answer, the client's next calls go over a new
//! connection, and a call still running after `grpc.max_connection_age_grace` is cut, in plaintext and
//! over TLS.
//!
//! A call is held in flight honestly: it is sent as a request stream whose end the test decides, and
//! the server answers a unary call only once the request stream has ended.

mod common;

use std::{
    net::SocketAddr,
    pin::Pin,
    sync::{Arc, Mutex},
    task::{Context, Poll},
    time::{Duration, Instant},
};

use common::{ask, descriptor, request, TestServer};
use hyper_util::rt::TokioIo;
use ratelimitd::{
    proto::{
        rate_limit_response::Code, RateLimitRequest, RateLimitResponse, RateLimitServiceClient,
    },
    settings::Settings,
};
use tokio::{
    io::{AsyncRead, AsyncWrite, ReadBuf},
    net::TcpStream,
    sync::mpsc,
    task::JoinHandle,
};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{
    codegen::http::uri::{PathAndQuery, Uri},
    transport::{Channel, Endpoint},
};

const RULES: &str =
    "domain: age\ndescriptors:\n  - key: user\n    rate_limit: {unit: minute, requests_per_unit: 100}\n";
const SHOULD_RATE_LIMIT: &str = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit";

fn question(user: &str) -> RateLimitRequest {
    request("age", vec![descriptor(&[("user", user)])])
}

fn aged(age: Duration, grace: Duration) -> impl FnOnce(&mut Settings) {
    move |s: &mut Settings| {
        s.grpc.max_connection_age = age;
        s.grpc.max_connection_age_grace = grace;
    }
}

/// What the client saw on one of its TCP connections.
#[derive(Debug, Clone, Copy)]
struct Seen {
    opened: Instant,
    /// When a GOAWAY frame from the server arrived.
    goaway: Option<Instant>,
    /// When the connection closed: the server's end of stream or a read error, or the client letting go
    /// of it (an HTTP/2 client may close first once a GOAWAY left it nothing to do).
    closed: Option<Instant>,
}

/// One client connection: what it saw, and the server's bytes not yet cut into HTTP/2 frames.
struct Watch {
    seen: Seen,
    unparsed: Vec<u8>,
}

impl Watch {
    /// Walks the complete HTTP/2 frames received (a 9-byte header: 24-bit length, type, flags, stream
    /// id); type 7 is GOAWAY.
    fn frames(&mut self) {
        while self.unparsed.len() >= 9 {
            let b = &self.unparsed;
            let len = u32::from_be_bytes([0, b[0], b[1], b[2]]) as usize;
            if b.len() < 9 + len {
                return;
            }
            if b[3] == 7 {
                self.seen.goaway.get_or_insert_with(Instant::now);
            }
            self.unparsed.drain(..9 + len);
        }
    }
}

/// A plaintext client connection that records the server's GOAWAY and the close.
struct Watched {
    io: TcpStream,
    watch: Arc<Mutex<Watch>>,
}

impl AsyncRead for Watched {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.io).poll_read(cx, buf);
        let mut watch = self.watch.lock().unwrap();
        match &polled {
            Poll::Ready(Ok(())) if buf.filled().len() > before => {
                watch.unparsed.extend_from_slice(&buf.filled()[before..]);
                watch.frames();
            }
            Poll::Ready(_) => {
                watch.seen.closed.get_or_insert_with(Instant::now);
            }
            Poll::Pending => {}
        }
        polled
    }
}

impl Drop for Watched {
    fn drop(&mut self) {
        let mut watch = self.watch.lock().unwrap();
        watch.seen.closed.get_or_insert_with(Instant::now);
    }
}

impl AsyncWrite for Watched {
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
}

/// The TCP connections a client channel opened, in order.
#[derive(Clone, Default)]
struct Connections(Arc<Mutex<Vec<Arc<Mutex<Watch>>>>>);

impl Connections {
    /// A gRPC channel to `addr` whose every TCP connection is watched.
    async fn channel(&self, addr: SocketAddr) -> Channel {
        let connections = self.clone();
        let connector = tower::service_fn(move |_: Uri| {
            let connections = connections.clone();
            async move {
                let io = TcpStream::connect(addr).await?;
                let watch = Arc::new(Mutex::new(Watch {
                    seen: Seen {
                        opened: Instant::now(),
                        goaway: None,
                        closed: None,
                    },
                    unparsed: Vec::new(),
                }));
                connections.0.lock().unwrap().push(watch.clone());
                Ok::<_, std::io::Error>(TokioIo::new(Watched { io, watch }))
            }
        });
        Endpoint::from_shared(format!("http://{addr}"))
            .unwrap()
            .connect_with_connector(connector)
            .await
            .unwrap()
    }

    fn count(&self) -> usize {
        self.0.lock().unwrap().len()
    }

    fn seen(&self, index: usize) -> Seen {
        self.0.lock().unwrap()[index].lock().unwrap().seen
    }

    /// Waits until connection `index` shows what `what` looks for, or fails after `within`.
    async fn wait(&self, index: usize, within: Duration, what: fn(&Seen) -> bool) -> Seen {
        let deadline = Instant::now() + within;
        loop {
            let seen = self.seen(index);
            if what(&seen) {
                return seen;
            }
            assert!(Instant::now() < deadline, "not within {within:?}: {seen:?}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

/// A ShouldRateLimit call kept in flight: its request message is sent, its request stream stays open
/// until [`HeldCall::finish`], and the server answers only after that.
struct HeldCall {
    finish: Option<mpsc::Sender<RateLimitRequest>>,
    answer: JoinHandle<Result<tonic::Response<RateLimitResponse>, tonic::Status>>,
}

impl HeldCall {
    async fn start(channel: Channel, message: RateLimitRequest) -> Self {
        let (tx, rx) = mpsc::channel(1);
        tx.send(message).await.unwrap();
        let answer = tokio::spawn(async move {
            let mut grpc = tonic::client::Grpc::new(channel);
            grpc.ready()
                .await
                .map_err(|e| tonic::Status::unavailable(e.to_string()))?;
            grpc.client_streaming(
                tonic::Request::new(ReceiverStream::new(rx)),
                PathAndQuery::from_static(SHOULD_RATE_LIMIT),
                tonic_prost::ProstCodec::<RateLimitRequest, RateLimitResponse>::default(),
            )
            .await
        });
        Self {
            finish: Some(tx),
            answer,
        }
    }

    /// Ends the request stream and waits for the answer.
    async fn finish(mut self) -> Result<RateLimitResponse, tonic::Status> {
        self.finish.take();
        tokio::time::timeout(Duration::from_secs(5), self.answer)
            .await
            .expect("an answer once the request is complete")
            .unwrap()
            .map(tonic::Response::into_inner)
    }
}

/// A call on a channel whose connection the server has just closed. tonic's client can still hand one
/// call to the closed connection before it notices (CANCELLED "connection closed") and reconnects
/// for the next one, so a single retry is allowed: that race is the client's, not the server's.
async fn call_again(
    client: &mut RateLimitServiceClient<Channel>,
    message: RateLimitRequest,
) -> RateLimitResponse {
    match client.should_rate_limit(message.clone()).await {
        Ok(answer) => answer.into_inner(),
        Err(status) => {
            assert_eq!(status.code(), tonic::Code::Cancelled, "{status}");
            ask(client, message).await
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_its_age_a_connection_is_closed_gracefully_and_the_call_in_flight_gets_its_answer() {
    let age = Duration::from_secs(1);
    let server =
        TestServer::start(&[("age.yaml", RULES)], aged(age, Duration::from_secs(30))).await;
    let connections = Connections::default();
    let channel = connections.channel(server.grpc_addr).await;
    let mut client = RateLimitServiceClient::new(channel.clone());
    ask(&mut client, question("a")).await;
    let held = HeldCall::start(channel, question("held")).await;

    // GOAWAY at the age (±10 %), while the held call is still in flight: the connection stays open.
    let first = connections
        .wait(0, Duration::from_secs(5), |s| s.goaway.is_some())
        .await;
    let at = first.goaway.unwrap() - first.opened;
    assert!(
        at >= age * 85 / 100 && at <= age * 3 / 2,
        "GOAWAY {at:?} after the connection opened, the age is {age:?}"
    );
    assert!(first.closed.is_none(), "closed under a call in flight");
    assert!(!held.answer.is_finished(), "the held call was cut");

    // The call in flight at the GOAWAY is answered, then the old connection closes.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let answer = held.finish().await.expect("the call in flight is answered");
    assert_eq!(answer.overall_code, Code::Ok as i32);
    assert_eq!(answer.statuses[0].limit_remaining, 99, "counted");
    connections
        .wait(0, Duration::from_secs(3), |s| s.closed.is_some())
        .await;

    // The client's next calls go over a new connection.
    let answer = call_again(&mut client, question("a")).await;
    assert_eq!(answer.statuses[0].limit_remaining, 98);
    assert_eq!(
        connections.count(),
        2,
        "the next call opened a new connection"
    );
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_still_running_after_the_grace_is_cut() {
    let (age, grace) = (Duration::from_secs(1), Duration::from_secs(1));
    let server = TestServer::start(&[("age.yaml", RULES)], aged(age, grace)).await;
    let connections = Connections::default();
    let channel = connections.channel(server.grpc_addr).await;
    let held = HeldCall::start(channel.clone(), question("held")).await;

    let answer = tokio::time::timeout(Duration::from_secs(6), held.answer)
        .await
        .expect("the call was not cut after the age and the grace")
        .unwrap();
    let cut = connections.seen(0);
    let lived = cut.opened.elapsed();
    let status = answer.expect_err("a cut call has no answer");
    assert!(
        lived >= (age + grace) * 85 / 100 && lived <= (age + grace) * 3 / 2,
        "cut {lived:?} after the connection opened ({status})"
    );
    assert!(cut.goaway.is_some(), "GOAWAY came first");
    connections
        .wait(0, Duration::from_secs(1), |s| s.closed.is_some())
        .await;

    // The client carries on over a new connection.
    let mut client = RateLimitServiceClient::new(channel);
    call_again(&mut client, question("after")).await;
    assert_eq!(connections.count(), 2);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_tls_too_a_call_still_running_after_the_grace_is_cut() {
    let dir = tempfile::tempdir().unwrap();
    let certified = rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).unwrap();
    let (cert, key) = (dir.path().join("tls.crt"), dir.path().join("tls.key"));
    std::fs::write(&cert, certified.cert.pem()).unwrap();
    std::fs::write(&key, certified.key_pair.serialize_pem()).unwrap();
    let (age, grace) = (Duration::from_secs(1), Duration::from_secs(1));
    let server = TestServer::start(&[("age.yaml", RULES)], |s| {
        aged(age, grace)(s);
        s.grpc_tls.enabled = true;
        s.grpc_tls.cert = cert;
        s.grpc_tls.key = key;
    })
    .await;
    let tls = tonic::transport::ClientTlsConfig::new()
        .ca_certificate(tonic::transport::Certificate::from_pem(
            certified.cert.pem(),
        ))
        .domain_name("localhost");
    let channel = Endpoint::from_shared(format!("https://{}", server.grpc_addr))
        .unwrap()
        .tls_config(tls)
        .unwrap()
        .connect()
        .await
        .unwrap();
    let opened = Instant::now();
    let mut client = RateLimitServiceClient::new(channel.clone());
    ask(&mut client, question("a")).await;
    let held = HeldCall::start(channel, question("held")).await;

    let answer = tokio::time::timeout(Duration::from_secs(6), held.answer)
        .await
        .expect("the call was not cut after the age and the grace")
        .unwrap();
    let lived = opened.elapsed();
    let status = answer.expect_err("a cut call has no answer");
    assert!(
        lived >= (age + grace) * 85 / 100 && lived <= (age + grace) * 3 / 2,
        "cut {lived:?} after the connection opened ({status})"
    );
    server.stop().await;
}
