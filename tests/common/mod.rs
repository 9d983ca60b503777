//! Test harness: starts ratelimitd in-process on 127.0.0.1:0 with rules written to a temporary folder,
//! and talks to it with the generated gRPC client and plain HTTP/1.1 over real sockets.
#![allow(dead_code)]

pub mod certs;
pub mod measure;
pub mod redis;
pub mod rlqs;
pub mod statsd;
pub mod xds;

use std::{
    io::{BufRead, BufReader, Read, Write},
    net::{SocketAddr, TcpStream},
    process::{Child, Command, Stdio},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use ratelimitd::{
    clock::Clock,
    proto::{
        rate_limit_descriptor::{Entry, RateLimitOverride},
        RateLimitDescriptor, RateLimitRequest, RateLimitResponse, RateLimitServiceClient,
    },
    server::{self, Listeners},
    settings::Settings,
};
use tokio::{net::TcpListener, task::JoinHandle};
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;
use tonic_health::pb::health_check_response::ServingStatus;

/// A Redis store on `url`, connected and ready, as the service builds one (2 s timeout, 2 connections).
pub async fn redis_store(
    url: String,
    topology: ratelimitd::settings::RedisTopology,
) -> Arc<ratelimitd::store::RedisStore> {
    redis_store_as(url, topology, "").await
}

/// [`redis_store`] with `auth` (`password`, or `user:password`).
pub async fn redis_store_as(
    url: String,
    topology: ratelimitd::settings::RedisTopology,
    auth: &str,
) -> Arc<ratelimitd::store::RedisStore> {
    redis_store_from(ratelimitd::settings::RedisSettings {
        url,
        topology,
        auth: ratelimitd::store::redis::Secret(auth.into()),
        timeout: Duration::from_secs(2),
        pool_size: 2,
        ..Default::default()
    })
    .await
}

/// A Redis store of `settings`, connected and ready.
pub async fn redis_store_from(
    settings: ratelimitd::settings::RedisSettings,
) -> Arc<ratelimitd::store::RedisStore> {
    let store =
        ratelimitd::store::RedisStore::connect(&settings, None, 0, Duration::from_secs(1)).unwrap();
    tokio::time::timeout(Duration::from_secs(20), store.ready())
        .await
        .expect("redis ready in time")
        .unwrap();
    store
}

/// Milliseconds since the Unix epoch, as the stores take the time.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

/// How long to wait, when fewer than 15 seconds of the current minute are left, until the next minute
/// begins (Redis runs on this machine's clock): a test whose requests must all count in one per-minute
/// window waits this long first, so that a busy machine cannot spread them over two.
pub fn until_far_from_a_minute_end() -> Duration {
    let into_minute = now_ms() % 60_000;
    if into_minute > 45_000 {
        Duration::from_millis(60_000 - into_minute + 100)
    } else {
        Duration::ZERO
    }
}

/// For a test that counts in one hour window: near the end of one (a minute or less left), waits for
/// the next.
pub fn wait_for_room_in_the_hour_window() {
    let left = 3_600_000 - now_ms() % 3_600_000;
    if left < 60_000 {
        std::thread::sleep(Duration::from_millis(left + 1_000));
    }
}

/// Waits [`until_far_from_a_minute_end`].
pub async fn far_from_a_minute_end() {
    tokio::time::sleep(until_far_from_a_minute_end()).await;
}

/// Every algorithm, for tables that run each scenario under each.
pub const ALGORITHMS: [ratelimitd::algorithm::Algorithm; 5] = {
    use ratelimitd::algorithm::Algorithm::*;
    [FixedWindow, SlidingWindow, SlidingLog, TokenBucket, Gcra]
};

pub struct TestServer {
    pub grpc_addr: SocketAddr,
    pub http_addr: SocketAddr,
    /// The operators' API, when the settings enable it.
    pub admin_addr: Option<SocketAddr>,
    pub clock: Clock,
    pub shutdown: CancellationToken,
    pub handle: JoinHandle<Result<(), server::ServerError>>,
    _rules: tempfile::TempDir,
}

impl TestServer {
    /// Starts a server with the given rules files and settings changes, at a fixed manual time.
    pub async fn start(rules: &[(&str, &str)], tweak: impl FnOnce(&mut Settings)) -> Self {
        // 2 222 s after the epoch: 58 s before the end of a minute window.
        Self::start_at(rules, 2_222_000, tweak).await
    }

    pub async fn start_at(
        rules: &[(&str, &str)],
        now_millis: u64,
        tweak: impl FnOnce(&mut Settings),
    ) -> Self {
        Self::start_with_clock(rules, Clock::manual(now_millis), tweak).await
    }

    /// Starts a server with the given clock (e.g. `Clock::System` for a Redis backend).
    pub async fn start_with_clock(
        rules: &[(&str, &str)],
        clock: Clock,
        tweak: impl FnOnce(&mut Settings),
    ) -> Self {
        let dir = tempfile::tempdir().unwrap();
        for (name, text) in rules {
            std::fs::write(dir.path().join(name), text).unwrap();
        }
        let mut settings = Settings::default();
        settings.rules.path = Some(dir.path().to_owned());
        settings.shutdown.grace_period = Duration::from_secs(5);
        tweak(&mut settings);
        let admin = if settings.admin.enabled {
            Some(TcpListener::bind("127.0.0.1:0").await.unwrap())
        } else {
            None
        };
        let admin_addr = admin.as_ref().map(|l| l.local_addr().unwrap());
        let listeners = Listeners {
            grpc: TcpListener::bind("127.0.0.1:0").await.unwrap(),
            http: TcpListener::bind("127.0.0.1:0").await.unwrap(),
            prometheus: None,
            admin,
        };
        let grpc_addr = listeners.grpc.local_addr().unwrap();
        let http_addr = listeners.http.local_addr().unwrap();
        let shutdown = CancellationToken::new();
        let handle = tokio::spawn(server::run_with_clock(
            settings,
            listeners,
            shutdown.clone(),
            clock.clone(),
        ));
        Self {
            grpc_addr,
            http_addr,
            admin_addr,
            clock,
            shutdown,
            handle,
            _rules: dir,
        }
    }

    pub async fn client(&self) -> RateLimitServiceClient<Channel> {
        RateLimitServiceClient::connect(format!("http://{}", self.grpc_addr))
            .await
            .unwrap()
    }

    pub async fn channel(&self) -> Channel {
        Channel::from_shared(format!("http://{}", self.grpc_addr))
            .unwrap()
            .connect()
            .await
            .unwrap()
    }

    /// Waits until the gRPC health service reports SERVING for `ratelimit`.
    pub async fn wait_serving(&self, within: Duration) {
        self.wait_health(ServingStatus::Serving, within).await;
    }

    /// Waits until the gRPC health service reports `status` for `ratelimit`.
    pub async fn wait_health(&self, status: ServingStatus, within: Duration) {
        use tonic_health::pb::{health_client::HealthClient, HealthCheckRequest};
        let mut health = HealthClient::new(self.channel().await);
        let request = || HealthCheckRequest {
            service: "ratelimit".into(),
        };
        wait_for(&format!("health {status:?}"), within, async || {
            let now = health.check(request()).await.map(|r| r.into_inner().status);
            matches!(now, Ok(s) if s == status as i32).then_some(())
        })
        .await;
    }

    /// The value of an unlabelled series in `/metrics`, if it is there.
    pub async fn metric(&self, name: &str) -> Option<f64> {
        let (_, text) = self.http("GET", "/metrics", "").await;
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
    }

    /// Waits until this server holds no quota lease: every leased hit admitted or given back.
    pub async fn wait_leases_given_back(&self, within: Duration) {
        wait_for("leases given back", within, async || {
            (self.metric("ratelimitd_redis_leases").await == Some(0.0)).then_some(())
        })
        .await;
    }

    /// Stops the server and waits for it to return.
    pub async fn stop(self) {
        self.shutdown.cancel();
        self.handle.await.unwrap().unwrap();
    }

    /// Sends one HTTP/1.1 request and returns (status, body).
    pub async fn http(&self, method: &str, path: &str, body: &str) -> (u16, String) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut stream = tokio::net::TcpStream::connect(self.http_addr)
            .await
            .unwrap();
        stream
            .write_all(raw_request(method, path, body).as_bytes())
            .await
            .unwrap();
        let mut response = String::new();
        tokio::time::timeout(
            Duration::from_secs(10),
            stream.read_to_string(&mut response),
        )
        .await
        .expect("HTTP answer in time")
        .unwrap();
        parse_response(&response)
    }
}

fn raw_request(method: &str, path: &str, body: &str) -> String {
    format!(
        "{method} {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
}

fn parse_response(response: &str) -> (u16, String) {
    let status = response
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    (status, body)
}

pub fn http_request(addr: SocketAddr, method: &str, path: &str, body: &str) -> (u16, String) {
    let mut stream = TcpStream::connect(addr).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    stream
        .write_all(raw_request(method, path, body).as_bytes())
        .unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    parse_response(&response)
}

/// Polls `probe` every 50 ms until it returns a value, and returns it; fails the test naming `what` when
/// `within` passes first. Tests wait on what they can observe (a metric, the health state, a log line)
/// rather than sleeping for a guessed time.
pub async fn wait_for<T>(
    what: &str,
    within: Duration,
    mut probe: impl AsyncFnMut() -> Option<T>,
) -> T {
    let deadline = Instant::now() + within;
    loop {
        if let Some(seen) = probe().await {
            return seen;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: not seen within {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Asks the server behind `client` one question and returns the answer; fails the test on an error status
/// (call `client.should_rate_limit` directly to look at one). Build the question with [`request`],
/// [`descriptor`], [`with_override`] and [`with_hits`].
pub async fn ask(
    client: &mut RateLimitServiceClient<Channel>,
    question: RateLimitRequest,
) -> RateLimitResponse {
    match client.should_rate_limit(question).await {
        Ok(answer) => answer.into_inner(),
        Err(status) => panic!("ShouldRateLimit failed: {status:?}"),
    }
}

/// A descriptor from (key, value) pairs.
pub fn descriptor(entries: &[(&str, &str)]) -> RateLimitDescriptor {
    RateLimitDescriptor {
        entries: entries
            .iter()
            .map(|(k, v)| Entry {
                key: k.to_string(),
                value: v.to_string(),
            })
            .collect(),
        ..RateLimitDescriptor::default()
    }
}

/// A descriptor with a request override.
pub fn with_override(
    mut d: RateLimitDescriptor,
    requests_per_unit: u32,
    unit: i32,
) -> RateLimitDescriptor {
    d.limit = Some(RateLimitOverride {
        requests_per_unit,
        unit,
    });
    d
}

/// A descriptor with its own `hits_addend` (0 checks without counting).
pub fn with_hits(mut d: RateLimitDescriptor, hits: u64) -> RateLimitDescriptor {
    d.hits_addend = Some(hits);
    d
}

/// A request in which each descriptor costs 1.
pub fn request(domain: &str, descriptors: Vec<RateLimitDescriptor>) -> RateLimitRequest {
    request_costing(domain, descriptors, 0)
}

/// A request whose `hits_addend` is what each descriptor costs (0 means 1).
pub fn request_costing(
    domain: &str,
    descriptors: Vec<RateLimitDescriptor>,
    hits_addend: u32,
) -> RateLimitRequest {
    RateLimitRequest {
        domain: domain.into(),
        descriptors,
        hits_addend,
    }
}

/// Listeners on loopback at free ports, in the reference's variables.
pub const LOOPBACK: [(&str, &str); 4] = [
    ("GRPC_HOST", "127.0.0.1"),
    ("GRPC_PORT", "0"),
    ("HOST", "127.0.0.1"),
    ("PORT", "0"),
];

/// The ratelimitd binary with a clean environment, loopback listeners on free ports and the rules in
/// `rules`; add what a test needs, then [`start_binary`].
pub fn binary(rules: &std::path::Path) -> Command {
    binary_under(&[], rules)
}

/// [`binary`] started by a wrapper command that runs it as its last argument (e.g.
/// `["/usr/bin/prlimit", "--nofile=64:64", "--"]`); an empty wrapper starts the binary itself.
pub fn binary_under(wrapper: &[&str], rules: &std::path::Path) -> Command {
    let bin = env!("CARGO_BIN_EXE_ratelimitd");
    let mut cmd = match wrapper.split_first() {
        Some((program, args)) => {
            let mut cmd = Command::new(program);
            cmd.args(args).arg(bin);
            cmd
        }
        None => Command::new(bin),
    };
    cmd.env_clear()
        .envs(LOOPBACK)
        .env("RATELIMITD_RULES__PATH", rules);
    cmd
}

/// A running binary, killed on drop.
pub struct Running {
    pub child: Child,
    pub grpc: SocketAddr,
    pub http: SocketAddr,
    /// Everything the process wrote to stderr so far.
    pub log: Arc<Mutex<String>>,
}

impl Running {
    /// Whether `/healthcheck` answers 200 (rules loaded, store reached) within `within`.
    pub fn serving_within(&self, within: Duration) -> bool {
        let deadline = Instant::now() + within;
        while Instant::now() < deadline {
            if http_request(self.http, "GET", "/healthcheck", "").0 == 200 {
                return true;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        false
    }

    /// Sends SIGTERM and waits for the process to exit; fails the test when it has not within `within`.
    pub async fn terminate(&mut self, within: Duration) -> std::process::ExitStatus {
        let pid = self.child.id().to_string();
        let sent = Command::new("kill").args(["-TERM", &pid]).status().unwrap();
        assert!(sent.success(), "kill -TERM {pid}");
        wait_for("the exit after SIGTERM", within, async || {
            self.child.try_wait().unwrap()
        })
        .await
    }

    /// Waits until the log holds `text`; fails the test with the log when `within` passes first. Blocks
    /// the calling thread: the process it waits on runs apart from the test.
    pub fn wait_log(&self, text: &str, within: Duration) {
        let deadline = Instant::now() + within;
        while !self.log.lock().unwrap().contains(text) {
            assert!(
                Instant::now() < deadline,
                "no {text:?} in the log within {within:?}:\n{}",
                self.log.lock().unwrap()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs `cmd` to its end and returns its output (for a start expected to be refused, whose messages are
/// short); fails the test when it still runs after `within`, killing it: a binary that serves where it
/// should have refused its settings fails the suite rather than hanging it.
pub fn output_within(cmd: &mut Command, within: Duration) -> std::process::Output {
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + within;
    while child.try_wait().unwrap().is_none() {
        if Instant::now() >= deadline {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!(
                "still running after {within:?}; its log:\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}

/// Starts the binary and reads the listening addresses from its log, which it keeps collecting.
pub fn start_binary(cmd: &mut Command) -> Running {
    let child = cmd
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let unbound: SocketAddr = ([0, 0, 0, 0], 0).into();
    // Owned by the guard from here on, so that a failed assertion still kills the process.
    let mut running = Running {
        child,
        grpc: unbound,
        http: unbound,
        log: Arc::new(Mutex::new(String::new())),
    };
    let mut lines = BufReader::new(running.child.stderr.take().unwrap()).lines();
    // A bound against a hang, not a measure: a debug build loading tens of thousands of rules on a busy
    // machine takes a good part of it.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        assert!(Instant::now() < deadline, "no listening line within 60 s");
        let Some(line) = lines.next() else {
            panic!(
                "ratelimitd exited early: {:?}\n{}",
                running.child.wait(),
                running.log.lock().unwrap()
            );
        };
        let line = line.unwrap();
        running.log.lock().unwrap().push_str(&(line.clone() + "\n"));
        if let Some(rest) = line.split("Listening for gRPC on '").nth(1) {
            running.grpc = rest.split('\'').next().unwrap().parse().unwrap();
            running.http = rest
                .split("HTTP on '")
                .nth(1)
                .and_then(|r| r.split('\'').next())
                .unwrap()
                .parse()
                .unwrap();
            // Keep draining the log so the child never blocks on a full pipe.
            let log = running.log.clone();
            std::thread::spawn(move || {
                for line in lines.map_while(Result::ok) {
                    log.lock().unwrap().push_str(&(line + "\n"));
                }
            });
            return running;
        }
    }
}
