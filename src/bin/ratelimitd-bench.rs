//! `ratelimitd-bench`: a load generator for any Envoy rate limit service (RLS v3 over gRPC).
//!
//! Closed loop (`--concurrency` callers, each sending its next request when the last is answered) or
//! open loop (`--rate` requests per second on a fixed schedule; a request sent late because an earlier
//! answer was slow is measured from its scheduled time, so a stalled server is not hidden). Keys are drawn uniformly, from a Zipf distribution, or are
//! one hot key. Reports req/s, latency percentiles, answer counts and its own CPU time per request as
//! text or JSON.
//!
//! `ratelimitd-bench floor --addr ADDR` serves the bare gRPC floor instead: a tonic server with nothing
//! but the rate limit service, answering OK to every call with one status per descriptor (no rules, no
//! counters, no metrics, no layers). Driven by the same load, it shows what this machine's gRPC stack
//! costs, so that a service's CPU per request can be read against it.

use std::{
    collections::BTreeMap,
    io::Write,
    sync::Arc,
    time::{Duration, Instant},
};

use clap::{Parser, Subcommand, ValueEnum};
use rand::{rngs::SmallRng, Rng, SeedableRng};
use ratelimitd::proto::{
    rate_limit_descriptor::Entry,
    rate_limit_response::{Code, DescriptorStatus},
    rate_limit_service_server::{RateLimitService, RateLimitServiceServer},
    RateLimitDescriptor, RateLimitRequest, RateLimitResponse, RateLimitServiceClient,
};
use tokio_stream::StreamExt;
use tonic::transport::{Channel, Endpoint};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Distribution {
    /// Every key equally likely.
    Uniform,
    /// Zipf with exponent 1: a few keys get most of the traffic.
    Zipf,
    /// Every request on key 0 (an attack on one key).
    Hot,
}

#[derive(Debug, Parser)]
#[command(
    name = "ratelimitd-bench",
    version,
    about = "Load generator for Envoy rate limit services",
    args_conflicts_with_subcommands = true
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    load: Args,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Serve the bare gRPC floor: every call answered OK, one status per descriptor, nothing else.
    Floor {
        /// Where to listen.
        #[arg(long, default_value = "127.0.0.1:8081")]
        addr: std::net::SocketAddr,
    },
}

#[derive(Debug, Clone, clap::Args)]
struct Args {
    /// Address of the rate limit service.
    #[arg(long, default_value = "127.0.0.1:8081")]
    addr: String,
    /// Domain of the requests.
    #[arg(long, default_value = "bench")]
    domain: String,
    /// Entry key of every descriptor; values are `<n>` for key number n (plus `-<i>` for the i-th
    /// descriptor of a request).
    #[arg(long, default_value = "user")]
    key: String,
    /// Descriptors per request.
    #[arg(long, default_value_t = 1)]
    descriptors: usize,
    /// Distinct keys.
    #[arg(long, default_value_t = 10_000)]
    keys: u64,
    #[arg(long, value_enum, default_value_t = Distribution::Uniform)]
    distribution: Distribution,
    /// Concurrent callers (closed loop), or callers sharing the schedule (open loop).
    #[arg(long, default_value_t = 32)]
    concurrency: usize,
    /// HTTP/2 connections the callers share.
    #[arg(long, default_value_t = 4)]
    connections: usize,
    /// Target requests per second (open loop); 0 runs closed loop.
    #[arg(long, default_value_t = 0)]
    rate: u64,
    /// How long to send.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    duration: Duration,
    /// Unmeasured warm-up before the run.
    #[arg(long, default_value = "1s", value_parser = humantime::parse_duration)]
    warmup: Duration,
    /// Per-request deadline.
    #[arg(long, default_value = "1s", value_parser = humantime::parse_duration)]
    timeout: Duration,
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
    /// A label for the run, echoed in the report.
    #[arg(long, default_value = "")]
    label: String,
}

impl Args {
    /// Refuses the counts a run cannot have.
    fn check(&self) -> Result<(), Box<dyn std::error::Error>> {
        if self.concurrency == 0 || self.connections == 0 || self.descriptors == 0 {
            return Err("--concurrency, --connections and --descriptors must be at least 1".into());
        }
        Ok(())
    }

    /// Open loop with a target rate, closed loop without.
    fn mode(&self) -> &'static str {
        if self.rate > 0 {
            "open"
        } else {
            "closed"
        }
    }
}

/// Samples key numbers.
struct KeySampler {
    distribution: Distribution,
    keys: u64,
    /// Cumulative Zipf weights (zipf only).
    cdf: Vec<f64>,
}

impl KeySampler {
    fn new(distribution: Distribution, keys: u64) -> Self {
        let keys = keys.max(1);
        let cdf = if distribution == Distribution::Zipf {
            let mut total = 0.0;
            (1..=keys)
                .map(|k| {
                    total += 1.0 / k as f64;
                    total
                })
                .collect()
        } else {
            Vec::new()
        };
        Self {
            distribution,
            keys,
            cdf,
        }
    }

    fn sample(&self, rng: &mut SmallRng) -> u64 {
        match self.distribution {
            Distribution::Uniform => rng.random_range(0..self.keys),
            Distribution::Hot => 0,
            Distribution::Zipf => {
                let x = rng.random_range(0.0..self.cdf[self.cdf.len() - 1]);
                self.cdf.partition_point(|&c| c < x) as u64
            }
        }
    }
}

#[derive(Debug, Default)]
struct Tally {
    /// Requests answered during the warm-up (not measured).
    warmup: u64,
    /// From when each request was due (open loop) or sent (closed loop) to its answer.
    latencies_us: Vec<u32>,
    /// From when each request was actually sent to its answer: the service and the network alone, without
    /// time spent waiting in this tool for a free caller or a late pacer.
    service_us: Vec<u32>,
    ok: u64,
    over_limit: u64,
    errors: BTreeMap<String, u64>,
}

impl Tally {
    fn merge(&mut self, other: Tally) {
        self.warmup += other.warmup;
        self.latencies_us.extend(other.latencies_us);
        self.service_us.extend(other.service_us);
        self.ok += other.ok;
        self.over_limit += other.over_limit;
        for (k, v) in other.errors {
            *self.errors.entry(k).or_default() += v;
        }
    }

    /// One measured answer: due at `scheduled`, sent at `sent`, answered at `done`.
    fn record(
        &mut self,
        scheduled: Instant,
        sent: Instant,
        done: Instant,
        result: Result<tonic::Response<RateLimitResponse>, tonic::Status>,
    ) {
        let micros = |from: Instant| {
            u32::try_from(done.duration_since(from).as_micros()).unwrap_or(u32::MAX)
        };
        self.latencies_us.push(micros(scheduled));
        self.service_us.push(micros(sent));
        match result {
            Ok(resp) => match Code::try_from(resp.into_inner().overall_code) {
                Ok(Code::Ok) => self.ok += 1,
                Ok(Code::OverLimit) => self.over_limit += 1,
                _ => *self.errors.entry("UNKNOWN code".into()).or_default() += 1,
            },
            Err(status) => {
                *self
                    .errors
                    .entry(format!("{:?}", status.code()))
                    .or_default() += 1
            }
        }
    }
}

fn request(args: &Args, sampler: &KeySampler, rng: &mut SmallRng) -> RateLimitRequest {
    let descriptors = (0..args.descriptors)
        .map(|i| {
            let key = sampler.sample(rng);
            let value = if args.descriptors == 1 {
                key.to_string()
            } else {
                format!("{key}-{i}")
            };
            RateLimitDescriptor {
                entries: vec![Entry {
                    key: args.key.clone(),
                    value,
                }],
                ..RateLimitDescriptor::default()
            }
        })
        .collect();
    RateLimitRequest {
        domain: args.domain.clone(),
        descriptors,
        hits_addend: 0,
    }
}

/// The open loop's schedule: send times, one per request, shared by the callers.
type Schedule = Arc<tokio::sync::Mutex<tokio::sync::mpsc::UnboundedReceiver<Instant>>>;

/// Emits the send times of an open-loop run at `rate` per second from `start` to `end`, from a thread of
/// its own: the async timer's millisecond ticks would release the requests in bursts, one per tick, and
/// the service would be measured under a load much burstier than the rate says.
fn pacer(rate: u64, start: Instant, end: Instant) -> Schedule {
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let interval = Duration::from_secs_f64(1.0 / rate as f64);
    std::thread::spawn(move || {
        let mut next = start;
        while next < end {
            let now = Instant::now();
            if next > now {
                std::thread::sleep(next - now);
            }
            // Everything due by now (the sleep wakes some tens of microseconds late).
            let now = Instant::now();
            while next <= now && next < end {
                if tx.send(next).is_err() {
                    return;
                }
                next += interval;
            }
        }
    });
    Arc::new(tokio::sync::Mutex::new(rx))
}

/// What every caller shares: the arguments, the keys, the clock of the run and, in open loop, the
/// schedule.
struct Workload {
    args: Args,
    sampler: KeySampler,
    /// Requests due before this are warm-up: answered, counted apart, not measured.
    measure_from: Instant,
    /// No request is sent from then on.
    end: Instant,
    /// The send times (open loop); `None`: closed loop.
    schedule: Option<Schedule>,
}

impl Workload {
    /// The keys of `args`, then the run's clock started now (and, in open loop, its pacer).
    fn start(args: Args) -> Self {
        let sampler = KeySampler::new(args.distribution, args.keys);
        let start = Instant::now();
        let measure_from = start + args.warmup;
        let end = measure_from + args.duration;
        let schedule = (args.rate > 0).then(|| pacer(args.rate, start, end));
        Self {
            args,
            sampler,
            measure_from,
            end,
            schedule,
        }
    }
}

/// One caller until the end of the workload: sends a request once its last is answered (closed
/// loop) or at the schedule's next time (open loop); what it measured.
async fn caller(workload: Arc<Workload>, channel: Channel, id: usize) -> Tally {
    let Workload {
        args,
        sampler,
        measure_from,
        end,
        schedule,
    } = &*workload;
    let mut client = RateLimitServiceClient::new(channel);
    let mut rng = SmallRng::seed_from_u64(id as u64 + 1);
    let mut tally = Tally::default();
    loop {
        let scheduled = match schedule {
            // Open loop: the next send time of the schedule. A request picked up after its time (every
            // caller was waiting for an answer) is measured from its time, so slow answers are not hidden
            // by sending fewer requests (coordinated omission).
            Some(schedule) => match schedule.lock().await.recv().await {
                Some(at) => at,
                None => break,
            },
            None if Instant::now() >= *end => break,
            None => Instant::now(),
        };
        let mut r = tonic::Request::new(request(args, sampler, &mut rng));
        r.set_timeout(args.timeout);
        let sent = Instant::now();
        let result = client.should_rate_limit(r).await;
        let done = Instant::now();
        if scheduled < *measure_from {
            tally.warmup += 1;
            continue;
        }
        tally.record(scheduled, sent, done, result);
    }
    tally
}

/// Runs one caller per `--concurrency`, spread over the connections, to the end of the workload; their
/// tallies summed.
async fn run(
    workload: Arc<Workload>,
    channels: &[Channel],
) -> Result<Tally, tokio::task::JoinError> {
    let tasks: Vec<_> = (0..workload.args.concurrency)
        .map(|id| {
            let channel = channels[id % channels.len()].clone();
            tokio::spawn(caller(workload.clone(), channel, id))
        })
        .collect();
    let mut total = Tally::default();
    for task in tasks {
        total.merge(task.await?);
    }
    Ok(total)
}

fn percentile(sorted: &[u32], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    f64::from(sorted[rank.clamp(1, sorted.len()) - 1]) / 1000.0
}

/// What a run measured, as reported.
struct Report {
    total: Tally,
    /// The measured part of the run, in seconds.
    elapsed: f64,
    /// Requests answered in the measured part.
    sent: usize,
    errors: u64,
    rps: f64,
    /// Latency percentiles in ms: p50, p90, p99, p99.9 and the maximum.
    latency: [f64; 5],
    /// Latency from send in ms: p50 and p99.
    service: [f64; 2],
    /// This tool's CPU time per request answered (warm-up included), in µs: what the load itself
    /// costs the machine it shares with the service.
    cpu_us_per_request: Option<f64>,
}

impl Report {
    fn new(mut total: Tally, duration: Duration, cpu: Option<Duration>) -> Self {
        total.latencies_us.sort_unstable();
        total.service_us.sort_unstable();
        let elapsed = duration.as_secs_f64();
        let sent = total.latencies_us.len();
        let latency = [50.0, 90.0, 99.0, 99.9, 100.0].map(|p| percentile(&total.latencies_us, p));
        let service = [50.0, 99.0].map(|p| percentile(&total.service_us, p));
        let answered = sent as u64 + total.warmup;
        let cpu_us_per_request = cpu.map(|cpu| cpu.as_secs_f64() * 1e6 / answered.max(1) as f64);
        Self {
            cpu_us_per_request,
            errors: total.errors.values().sum(),
            rps: sent as f64 / elapsed,
            total,
            elapsed,
            sent,
            latency,
            service,
        }
    }

    /// The report on `out`: one JSON object with `--json`, lines of text without.
    fn write(&self, args: &Args, out: &mut impl Write) -> std::io::Result<()> {
        if args.json {
            self.write_json(args, out)
        } else {
            self.write_text(args, out)
        }
    }

    fn write_json(&self, args: &Args, out: &mut impl Write) -> std::io::Result<()> {
        let Self {
            total,
            elapsed,
            sent,
            errors,
            rps,
            latency: [p50, p90, p99, p999, max],
            service: [service_p50, service_p99],
            cpu_us_per_request,
        } = self;
        let report = serde_json::json!({
            "label": args.label,
            "addr": args.addr,
            "mode": args.mode(),
            "target_rate": args.rate,
            "concurrency": args.concurrency,
            "connections": args.connections,
            "descriptors": args.descriptors,
            "keys": args.keys,
            "distribution": format!("{:?}", args.distribution).to_lowercase(),
            "duration_s": elapsed,
            "requests": sent,
            "warmup_requests": total.warmup,
            "rps": rps,
            "ok": total.ok,
            "over_limit": total.over_limit,
            "errors": errors,
            "errors_by_code": total.errors,
            "latency_ms": {"p50": p50, "p90": p90, "p99": p99, "p99_9": p999, "max": max},
            "service_latency_ms": {"p50": service_p50, "p99": service_p99},
            "load_cpu_us_per_request": cpu_us_per_request,
        });
        writeln!(out, "{report}")
    }

    fn write_text(&self, args: &Args, out: &mut impl Write) -> std::io::Result<()> {
        let Self {
            total,
            elapsed,
            sent,
            errors,
            rps,
            latency: [p50, p90, p99, p999, max],
            service: [service_p50, service_p99],
            cpu_us_per_request,
        } = self;
        writeln!(
            out,
            "{}{} requests in {:.1}s: {:.0} req/s ({} mode, {} callers, {} connections, {} descriptor(s), {} {:?} keys)",
            if args.label.is_empty() { String::new() } else { format!("[{}] ", args.label) },
            sent,
            elapsed,
            rps,
            args.mode(),
            args.concurrency,
            args.connections,
            args.descriptors,
            args.keys,
            args.distribution,
        )?;
        writeln!(
            out,
            "latency ms: p50 {p50:.3}  p90 {p90:.3}  p99 {p99:.3}  p99.9 {p999:.3}  max {max:.3}"
        )?;
        writeln!(
            out,
            "from send, without waits in this tool: p50 {service_p50:.3}  p99 {service_p99:.3}"
        )?;
        writeln!(
            out,
            "answers: OK {}  OVER_LIMIT {}  errors {errors} {:?}",
            total.ok, total.over_limit, total.errors
        )?;
        match cpu_us_per_request {
            Some(us) => writeln!(out, "this tool's CPU: {us:.1} µs per request"),
            None => Ok(()),
        }
    }
}

/// The bare gRPC floor: the rate limit service alone, answering OK to every call.
#[derive(Debug, Clone, Copy)]
struct Floor;

#[tonic::async_trait]
impl RateLimitService for Floor {
    async fn should_rate_limit(
        &self,
        request: tonic::Request<RateLimitRequest>,
    ) -> Result<tonic::Response<RateLimitResponse>, tonic::Status> {
        let ok = Code::Ok as i32;
        let statuses = request
            .get_ref()
            .descriptors
            .iter()
            .map(|_| DescriptorStatus {
                code: ok,
                ..DescriptorStatus::default()
            })
            .collect();
        Ok(tonic::Response::new(RateLimitResponse {
            overall_code: ok,
            statuses,
            ..RateLimitResponse::default()
        }))
    }
}

/// The floor's gRPC server: tonic's defaults and the one service.
fn floor_server() -> tonic::transport::server::Router {
    tonic::transport::Server::builder().add_service(RateLimitServiceServer::new(Floor))
}

/// Serves the floor on `addr` until interrupted (SIGINT) or terminated.
async fn serve_floor(addr: std::net::SocketAddr) -> Result<(), Box<dyn std::error::Error>> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    // As ratelimitd's listener does: answers are sent at once, not held back by Nagle.
    let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener).map(|conn| {
        conn.inspect(|io| {
            let _ = io.set_nodelay(true);
        })
    });
    floor_server()
        .serve_with_incoming_shutdown(incoming, async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await?;
    Ok(())
}

/// CPU time this process has used so far (user plus system, every thread), from `/proc/self/stat`;
/// `None` where there is no such file.
fn cpu_time() -> Option<Duration> {
    cpu_of_stat(&std::fs::read_to_string("/proc/self/stat").ok()?)
}

/// The user plus system time of a `/proc/PID/stat` line.
fn cpu_of_stat(stat: &str) -> Option<Duration> {
    // Linux reports both in clock ticks of USER_HZ, 100 per second on every architecture it runs on.
    const TICKS_PER_SECOND: u64 = 100;
    // The command name (field 2) is in parentheses and may hold spaces and parentheses: fields are
    // counted from the last `) `, which starts field 3; utime and stime are fields 14 and 15.
    let (_, rest) = stat.rsplit_once(") ")?;
    let mut fields = rest.split_ascii_whitespace().skip(11);
    let utime: u64 = fields.next()?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    Some(Duration::from_millis(
        (utime + stime) * 1000 / TICKS_PER_SECOND,
    ))
}

/// One HTTP/2 connection per `--connections`, all open before the run starts.
async fn connect(args: &Args) -> Result<Vec<Channel>, Box<dyn std::error::Error>> {
    let mut channels = Vec::with_capacity(args.connections);
    for _ in 0..args.connections {
        let endpoint = Endpoint::from_shared(format!("http://{}", args.addr))?
            .tcp_nodelay(true)
            .connect_timeout(Duration::from_secs(5));
        channels.push(endpoint.connect().await?);
    }
    Ok(channels)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let cli = Cli::parse();
    if let Some(Command::Floor { addr }) = cli.command {
        return serve_floor(addr).await;
    }
    let args = cli.load;
    args.check()?;
    let channels = connect(&args).await?;
    let cpu_before = cpu_time();
    let workload = Arc::new(Workload::start(args));
    let total = run(workload.clone(), &channels).await?;
    let cpu = cpu_before
        .zip(cpu_time())
        .map(|(before, after)| after - before);
    let report = Report::new(total, workload.args.duration, cpu);
    // Write errors are returned, not panicked on (a reader that went away).
    report.write(&workload.args, &mut std::io::stdout().lock())?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zipf_favours_low_keys_and_hot_is_one_key() {
        let mut rng = SmallRng::seed_from_u64(7);
        let zipf = KeySampler::new(Distribution::Zipf, 1000);
        let draws: Vec<u64> = (0..10_000).map(|_| zipf.sample(&mut rng)).collect();
        let first = draws.iter().filter(|&&k| k == 0).count();
        let last_half = draws.iter().filter(|&&k| k >= 500).count();
        assert!(
            first > last_half / 2,
            "key 0: {first}, keys 500..: {last_half}"
        );
        assert!(draws.iter().all(|&k| k < 1000));
        let hot = KeySampler::new(Distribution::Hot, 1000);
        assert!((0..100).all(|_| hot.sample(&mut rng) == 0));
    }

    #[tokio::test]
    async fn the_floor_answers_ok_with_one_status_per_descriptor() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(
            floor_server()
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
        );
        let mut client = RateLimitServiceClient::connect(format!("http://{addr}"))
            .await
            .unwrap();
        let args = Cli::parse_from(["ratelimitd-bench", "--descriptors", "3"]).load;
        let sampler = KeySampler::new(args.distribution, args.keys);
        let mut rng = SmallRng::seed_from_u64(1);
        let answer = client
            .should_rate_limit(request(&args, &sampler, &mut rng))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(answer.overall_code, Code::Ok as i32);
        assert_eq!(answer.statuses.len(), 3);
        assert!(answer.statuses.iter().all(|s| s.code == Code::Ok as i32));
    }

    #[test]
    fn the_load_and_the_floor_take_their_own_arguments() {
        let floor = Cli::try_parse_from(["ratelimitd-bench", "floor", "--addr", "127.0.0.1:9"]);
        assert!(matches!(
            floor.unwrap().command,
            Some(Command::Floor { addr }) if addr.port() == 9
        ));
        let load = Cli::try_parse_from(["ratelimitd-bench", "--rate", "5"]).unwrap();
        assert!(load.command.is_none() && load.load.rate == 5);
        assert!(Cli::try_parse_from(["ratelimitd-bench", "--rate", "5", "floor"]).is_err());
    }

    #[test]
    fn cpu_time_is_user_plus_system_whatever_the_command_name() {
        let stat = "4242 (tokio) (x) S 1 4242 4242 0 -1 4194560 900 0 0 0 250 37 0 0 20 0 3 0 1";
        assert_eq!(cpu_of_stat(stat), Some(Duration::from_millis(2870)));
        assert_eq!(cpu_of_stat("4242 (short) S 1"), None);
        assert!(cpu_time().is_some(), "/proc/self/stat is read on Linux");
    }

    #[test]
    fn percentiles_by_rank() {
        let v: Vec<u32> = (1..=1000).map(|x| x * 1000).collect();
        assert_eq!(percentile(&v, 50.0), 500.0);
        assert_eq!(percentile(&v, 99.0), 990.0);
        assert_eq!(percentile(&v, 100.0), 1000.0);
    }
}
