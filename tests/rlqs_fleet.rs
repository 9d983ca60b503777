//! A simulated fleet of Envoys (`common::rlqs`, following Envoy's client) sharing one limit through the
//! rate limit quota service: on one replica with the memory store, and on one and two replicas sharing a
//! real redis-server. Reports every 200 ms and assignments of 1 s stand for Envoy's 5 s and 15 s, so
//! that a test of many periods takes seconds; the figures each test prints are the ones BENCHMARKS.md
//! quotes.
//!
//! What is asserted, as a user of the limit would notice it:
//! - the fleet's assignments never add up to more than the limit, and what it admits over the whole run
//!   (a minute, with demand moving all along, in one test) stays within the limit's rate plus the bursts
//!   its new token buckets started with;
//! - each Envoy gets its fair share by demand (an idle one does not hold what a busy one needs);
//! - an Envoy whose demand rises gets most of the limit within a few report periods;
//! - an Envoy that disappears keeps its share until its assignment's TTL, and then the others get it;
//! - the same bucket asked over `ShouldRateLimit` and over RLQS counts against one limit.

mod common;

use std::{
    sync::{Arc, Mutex},
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use common::{
    ask, descriptor,
    redis::{command_calls, RedisProcess},
    request,
    rlqs::{bucket, Bucket, Enforced, Envoy, Fallback, Rate},
    TestServer,
};
use ratelimitd::{clock::Clock, proto::rate_limit_response::Code};
use tokio::time::Instant;

const PERIOD: Duration = Duration::from_millis(200);
const TTL: Duration = Duration::from_secs(1);
/// The limit of the `shared` bucket, per second.
const LIMIT: f64 = 200.0;
/// What the Envoys share of it: a sixteenth is held back for Envoys that subscribe next.
const SHARED: f64 = LIMIT * 15.0 / 16.0;

const RULES: &str = r#"
domain: fleet
descriptors:
  - key: generic_key
    value: shared
    rate_limit: {unit: second, requests_per_unit: 200}
  - key: generic_key
    value: window
    rate_limit: {unit: second, unit_multiplier: 4, requests_per_unit: 400}
"#;

/// The replicas of one test, and the Redis they share when they do.
struct Fleet {
    servers: Vec<TestServer>,
    _redis: Option<RedisProcess>,
    epoch: Instant,
}

#[derive(Debug, Clone, Copy)]
enum Backend {
    Memory,
    Redis { replicas: usize },
}

impl Fleet {
    async fn start(backend: Backend) -> Self {
        let (replicas, redis) = match backend {
            Backend::Memory => (1, None),
            Backend::Redis { replicas } => (replicas, Some(RedisProcess::start(&[]))),
        };
        let mut servers = Vec::new();
        for _ in 0..replicas {
            let url = redis.as_ref().map(|r| r.addr());
            let s = TestServer::start_with_clock(&[("fleet.yaml", RULES)], Clock::System, |s| {
                s.rlqs.report_period = PERIOD;
                s.rlqs.assignment_ttl = TTL;
                if let Some(url) = url {
                    s.redis.url = url;
                }
            })
            .await;
            s.wait_serving(Duration::from_secs(10)).await;
            servers.push(s);
        }
        Self {
            servers,
            _redis: redis,
            epoch: Instant::now(),
        }
    }

    /// An Envoy reporting to replica `i % replicas`, denying requests while it has no assignment.
    fn envoy(&self, name: &str, i: usize) -> Arc<Envoy> {
        self.envoy_with(name, i, Fallback::DenyAll)
    }

    fn envoy_with(&self, name: &str, i: usize, fallback: Fallback) -> Arc<Envoy> {
        let server = &self.servers[i % self.servers.len()];
        Envoy::new(
            name,
            server.grpc_addr,
            "fleet",
            PERIOD,
            fallback,
            self.epoch,
        )
    }

    async fn stop(self) {
        for s in self.servers {
            s.stop().await;
        }
    }
}

fn shared() -> Bucket {
    bucket(&[("generic_key", "shared")])
}

/// Samples, every 20 ms until `until`, the sum of the rates the Envoys enforce on `b`, and returns the
/// largest seen.
async fn largest_sum(envoys: &[Arc<Envoy>], b: &Bucket, until: Instant) -> f64 {
    let mut largest: f64 = 0.0;
    while Instant::now() < until {
        let sum: f64 = envoys
            .iter()
            .filter_map(|e| e.enforced(b))
            .map(|e| e.rate())
            .sum();
        largest = largest.max(sum);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    largest
}

/// Fair shares by demand, and the limit held: 4 Envoys asking 10, 40, 300 and 300 a second of a
/// limit of 200 (187.5 shared, the rest held for newcomers) get about 10, 40, 57.5 and 57.5, and the
/// fleet never admits more than the limit allows.
async fn fair_shares_hold_the_limit(backend: Backend) {
    let fleet = Fleet::start(backend).await;
    let b = shared();
    let demands = [10.0, 40.0, 300.0, 300.0];
    let envoys: Vec<Arc<Envoy>> = demands
        .iter()
        .enumerate()
        .map(|(i, _)| fleet.envoy(&format!("e{i}"), i))
        .collect();
    let start = Instant::now();
    for (envoy, demand) in envoys.iter().zip(demands) {
        envoy.drive(b.clone(), Rate::new(demand));
    }
    let end = start + Duration::from_secs(6);
    let largest = largest_sum(&envoys, &b, end).await;
    let settled = start + Duration::from_secs(2);
    let secs = (end - settled).as_secs_f64();
    let rates: Vec<f64> = envoys
        .iter()
        .map(|e| e.admitted(&b, settled, end) as f64 / secs)
        .collect();
    let total: u64 = envoys.iter().map(|e| e.admitted(&b, start, end)).sum();
    let fresh: f64 = envoys.iter().map(|e| e.fresh_tokens()).sum();
    let run = (end - start).as_secs_f64();
    eprintln!(
        "{backend:?}: admitted per second after 2 s {rates:.1?}; whole run {total} in {run:.1} s \
         (limit x time = {:.0}, bursts of new token buckets {fresh:.0}); largest sum of assigned rates {largest:.1}",
        LIMIT * run
    );
    assert!(
        largest <= LIMIT * (1.0 + 1e-9),
        "assignments above the limit: {largest}"
    );
    assert!(
        total as f64 <= LIMIT * run + fresh + LIMIT * 0.05,
        "over-admitted: {total} > {} + {fresh}",
        LIMIT * run
    );
    assert!(fresh <= LIMIT * run * 0.25, "{fresh} tokens of new buckets");
    // The light ones get what they ask; the busy ones split the rest. A share is sized for the demand
    // reported plus a quarter and one request per report (17.5 and 55 a second here), so the busy ones
    // split what is left of that: 57.5 each.
    assert!(rates[0] >= 10.0 * 0.8, "{rates:?}");
    assert!(rates[1] >= 40.0 * 0.8, "{rates:?}");
    let sized = |rate: f64| rate * 1.25 + 1.0 / PERIOD.as_secs_f64();
    let busy_share = (SHARED - sized(10.0) - sized(40.0)) / 2.0;
    for &busy in &rates[2..] {
        assert!(
            (busy_share * 0.75..=busy_share * 1.25).contains(&busy),
            "{rates:?}"
        );
    }
    // And together they use what they share.
    let used: f64 = rates.iter().sum();
    assert!(used >= SHARED * 0.8, "{rates:?}");
    fleet.stop().await;
}

#[tokio::test]
async fn fair_shares_hold_the_limit_on_the_memory_store() {
    fair_shares_hold_the_limit(Backend::Memory).await;
}

#[tokio::test]
async fn fair_shares_hold_the_limit_on_one_replica_on_redis() {
    fair_shares_hold_the_limit(Backend::Redis { replicas: 1 }).await;
}

#[tokio::test]
async fn fair_shares_hold_the_limit_on_two_replicas_on_redis() {
    fair_shares_hold_the_limit(Backend::Redis { replicas: 2 }).await;
}

/// A minute of moving demand: 4 Envoys on 2 replicas on Redis, one of them asking 400 a second and the
/// others 20, the busy one changing every 5 s (25 report periods), so that shares keep moving all minute.
/// What the fleet admits over the minute stays within the limit's rate times the minute plus the tokens
/// the changed token buckets started with (each change may admit its `max_tokens` at once), and the
/// assigned rates never add up to more than the limit.
#[tokio::test]
async fn over_a_minute_of_moving_demand_the_fleet_admits_the_limit_plus_the_bursts() {
    let fleet = Fleet::start(Backend::Redis { replicas: 2 }).await;
    let b = shared();
    let envoys: Vec<Arc<Envoy>> = (0..4).map(|i| fleet.envoy(&format!("e{i}"), i)).collect();
    let rates: Vec<Arc<Rate>> = (0..4).map(|_| Rate::new(20.0)).collect();
    rates[0].set(400.0);
    let start = Instant::now();
    for (envoy, rate) in envoys.iter().zip(&rates) {
        envoy.drive(b.clone(), rate.clone());
    }
    let minute = Duration::from_secs(60);
    let mut largest: f64 = 0.0;
    for turn in 1..12 {
        largest =
            largest.max(largest_sum(&envoys, &b, start + Duration::from_secs(5 * turn)).await);
        let busy = turn as usize % 4;
        for (i, rate) in rates.iter().enumerate() {
            rate.set(if i == busy { 400.0 } else { 20.0 });
        }
    }
    largest = largest.max(largest_sum(&envoys, &b, start + minute).await);
    let end = start + minute;
    let total: u64 = envoys.iter().map(|e| e.admitted(&b, start, end)).sum();
    let fresh: f64 = envoys.iter().map(|e| e.fresh_tokens()).sum();
    let allowed = LIMIT * minute.as_secs_f64();
    eprintln!(
        "a minute, 2 replicas on Redis, the busy Envoy changing every 5 s: admitted {total} \
         (limit x minute = {allowed:.0}, {:+.2} %); tokens new token buckets started with {fresh:.0} \
         ({:.2} % of the limit x minute); largest sum of assigned rates {largest:.1}",
        (total as f64 - allowed) * 100.0 / allowed,
        fresh * 100.0 / allowed,
    );
    assert!(
        largest <= LIMIT * (1.0 + 1e-9),
        "assignments above the limit: {largest}"
    );
    assert!(
        total as f64 <= allowed + fresh + LIMIT * 0.05,
        "over-admitted: {total} > {allowed} + {fresh}"
    );
    // Shares that move all minute cost bursts, but few: not one per report.
    assert!(fresh <= allowed * 0.15, "{fresh} tokens of new buckets");
    // And the fleet uses what it shares of the limit while it asks for more.
    assert!(
        total as f64 >= SHARED * minute.as_secs_f64() * 0.8,
        "{total} of {allowed}"
    );
    fleet.stop().await;
}

/// Envoys that join while the limit is all handed out, with ALLOW_ALL as their no-assignment behaviour
/// (what a filter that must not deny before it hears from ratelimitd is set to): two busy Envoys on one
/// replica, then one more every second, four in all, the first on the other replica. Each newcomer is assigned a
/// share out of the reserve in answer to its subscription, so it admits without bound only for that
/// round trip; the fleet stays within the limit's rate plus the bursts of new token buckets plus what
/// the newcomers admitted before their first assignment, and the assigned rates never add up to more
/// than the limit.
#[tokio::test]
async fn envoys_that_join_allowing_all_are_bounded_at_once() {
    let fleet = Fleet::start(Backend::Redis { replicas: 2 }).await;
    let b = shared();
    let demand = 300.0;
    let start = Instant::now();
    // The first two on replica 0; the first newcomer on replica 1, which holds no other member of the
    // bucket, so that nothing but its own subscription can give it a share; then both replicas.
    let mut envoys: Vec<Arc<Envoy>> = (0..2)
        .map(|i| fleet.envoy_with(&format!("e{i}"), 0, Fallback::AllowAll))
        .collect();
    for e in &envoys {
        e.drive(b.clone(), Rate::new(demand));
    }
    // Each newcomer subscribes between the others' reports (their ticks fall on multiples of 200 ms
    // from the start, then 50, 100 and 150 ms past them): a subscription recomputed while another
    // member's report is between its charge and its share call sees that report's hits as spent by
    // others for that one call, and may find nothing free.
    let mut largest: f64 = 0.0;
    for (i, replica, offset) in [(2, 1, 1_050), (3, 0, 2_100), (4, 1, 3_150), (5, 0, 4_025)] {
        let at = start + Duration::from_millis(offset);
        largest = largest.max(largest_sum(&envoys, &b, at).await);
        let envoy = fleet.envoy_with(&format!("e{i}"), replica, Fallback::AllowAll);
        envoy.drive(b.clone(), Rate::new(demand));
        envoys.push(envoy);
    }
    largest = largest.max(largest_sum(&envoys, &b, start + Duration::from_secs(5)).await);
    let end = Instant::now();
    let run = (end - start).as_secs_f64();
    let mut before_first = Vec::new();
    for e in &envoys[2..] {
        let first = e.received().first().map(|r| r.at).expect("an assignment");
        before_first.push(e.admitted(&b, start, first));
    }
    let total: u64 = envoys.iter().map(|e| e.admitted(&b, start, end)).sum();
    let fresh: f64 = envoys.iter().map(|e| e.fresh_tokens()).sum();
    let waited: u64 = before_first.iter().sum();
    eprintln!(
        "4 Envoys joining (ALLOW_ALL until assigned), 2 replicas on Redis: admitted {total} in {run:.1} s \
         (limit x time = {:.0}); bursts of new token buckets {fresh:.0}; admitted by each newcomer before \
         its first assignment {before_first:?}; largest sum of assigned rates {largest:.1}",
        LIMIT * run
    );
    assert!(
        largest <= LIMIT * (1.0 + 1e-9),
        "assignments above the limit: {largest}"
    );
    // A round trip, not a report period: at 300 a second, half a period is 30 requests.
    for (i, n) in before_first.iter().enumerate() {
        assert!(
            (*n as f64) <= demand * PERIOD.as_secs_f64() / 2.0,
            "newcomer {i} admitted {n} before its first assignment"
        );
    }
    assert!(
        total as f64 <= LIMIT * run + fresh + waited as f64 + LIMIT * 0.05,
        "over-admitted: {total} > {} + {fresh} + {waited}",
        LIMIT * run
    );
    // The bursts of changed token buckets stay a small part of what the limit admits.
    assert!(fresh <= LIMIT * run * 0.25, "{fresh} tokens of new buckets");
    fleet.stop().await;
}

/// When the busy Envoy goes quiet and an idle one gets busy, the newly busy one gets most of the limit
/// within a few report periods.
async fn a_rising_envoy_gets_most_of_the_limit_within_a_few_periods(backend: Backend) {
    let fleet = Fleet::start(backend).await;
    let b = shared();
    let (a, busy, c) = (
        fleet.envoy("a", 0),
        fleet.envoy("busy", 1),
        fleet.envoy("c", 2),
    );
    let (rate_a, rate_busy) = (Rate::new(5.0), Rate::new(400.0));
    a.drive(b.clone(), rate_a.clone());
    busy.drive(b.clone(), rate_busy.clone());
    c.drive(b.clone(), Rate::new(5.0));
    let envoys = [a.clone(), busy.clone(), c.clone()];
    largest_sum(&envoys, &b, Instant::now() + Duration::from_secs(2)).await;
    let before = busy.enforced(&b).map(|e| e.rate()).unwrap_or(0.0);
    let changed = Instant::now();
    rate_a.set(400.0);
    rate_busy.set(5.0);
    // Most of the limit: 80 % of what the two light ones leave of the shared part.
    let most = (SHARED - 10.0) * 0.8;
    let mut reached = None;
    let mut largest: f64 = 0.0;
    while changed.elapsed() < Duration::from_secs(4) {
        let sum: f64 = envoys
            .iter()
            .filter_map(|e| e.enforced(&b))
            .map(|e| e.rate())
            .sum();
        largest = largest.max(sum);
        if reached.is_none() && a.enforced(&b).is_some_and(|e| e.rate() >= most) {
            reached = Some(changed.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let reached = reached.expect("the rising Envoy never got most of the limit");
    let periods = reached.as_secs_f64() / PERIOD.as_secs_f64();
    eprintln!(
        "{backend:?}: the busy Envoy had {before:.1}/s; the rising one had {most:.0}/s or more \
         {reached:?} ({periods:.1} report periods) after the change; largest sum of assigned rates {largest:.1}"
    );
    assert!(
        before >= most,
        "the busy one had most of it first: {before}"
    );
    assert!(periods <= 5.0, "{periods} periods");
    assert!(largest <= LIMIT * (1.0 + 1e-9), "{largest}");
    fleet.stop().await;
}

#[tokio::test]
async fn a_rising_envoy_gets_most_of_the_limit_within_a_few_periods_on_one_replica() {
    a_rising_envoy_gets_most_of_the_limit_within_a_few_periods(Backend::Redis { replicas: 1 })
        .await;
}

#[tokio::test]
async fn a_rising_envoy_gets_most_of_the_limit_within_a_few_periods_on_two_replicas() {
    a_rising_envoy_gets_most_of_the_limit_within_a_few_periods(Backend::Redis { replicas: 2 })
        .await;
}

/// An Envoy that disappears (no reports, no stream) holds its share until its assignment's TTL (it may
/// still be enforcing it, cut off from ratelimitd), then the others get it.
async fn a_vanished_envoy_gives_its_share_back_after_its_ttl(backend: Backend) {
    let fleet = Fleet::start(backend).await;
    let b = shared();
    let (gone, stays) = (fleet.envoy("gone", 0), fleet.envoy("stays", 1));
    gone.drive(b.clone(), Rate::new(300.0));
    stays.drive(b.clone(), Rate::new(300.0));
    let envoys = [gone.clone(), stays.clone()];
    largest_sum(&envoys, &b, Instant::now() + Duration::from_secs(2)).await;
    // Shares move in steps of an eighth at each report: on a busy machine the two may need a few more
    // periods to meet at about half each.
    let about_half = LIMIT / 2.0 * 0.8..=LIMIT / 2.0 * 1.1;
    let mut half = 0.0;
    let settle = Instant::now() + Duration::from_secs(3);
    while Instant::now() < settle {
        half = stays.enforced(&b).map(|e| e.rate()).unwrap_or(0.0);
        if about_half.contains(&half) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let last_assigned = gone.received().last().map(|r| r.at).expect("an assignment");
    gone.kill().await;
    let killed = Instant::now();
    // Not before the TTL of the last assignment it got.
    let held_until = last_assigned + TTL - Duration::from_millis(100);
    let mut held: f64 = 0.0;
    let mut released = None;
    while killed.elapsed() < TTL * 4 {
        let rate = stays.enforced(&b).map(|e| e.rate()).unwrap_or(0.0);
        if Instant::now() < held_until {
            held = held.max(rate);
        }
        if released.is_none() && rate >= LIMIT * 0.9 {
            released = Some(Instant::now());
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let released = released.expect("the share never came back");
    eprintln!(
        "{backend:?}: the other Envoy had {half:.1}/s, at most {held:.1}/s before the vanished one's TTL, \
         and {:.0}/s or more {:?} after the vanished one's last assignment (TTL {TTL:?} + 1 s margin)",
        LIMIT * 0.9,
        released - last_assigned
    );
    assert!(about_half.contains(&half), "{half}");
    assert!(
        held <= LIMIT / 2.0 * 1.1,
        "{held}: the share came back before the TTL"
    );
    assert!(
        released >= last_assigned + TTL,
        "{:?}",
        released - last_assigned
    );
    assert!(
        released <= last_assigned + TTL + Duration::from_secs(1) + PERIOD * 4,
        "{:?}",
        released - last_assigned
    );
    fleet.stop().await;
}

#[tokio::test]
async fn a_vanished_envoy_gives_its_share_back_after_its_ttl_on_one_replica() {
    a_vanished_envoy_gives_its_share_back_after_its_ttl(Backend::Redis { replicas: 1 }).await;
}

#[tokio::test]
async fn a_vanished_envoy_gives_its_share_back_after_its_ttl_on_two_replicas() {
    a_vanished_envoy_gives_its_share_back_after_its_ttl(Backend::Redis { replicas: 2 }).await;
}

/// Many Envoys of one bucket on one replica: a recomputation reads and writes every member of the
/// bucket, so their reports share them, at most one per tenth of a report period (each one a
/// `HGETALL` of the bucket in `share.lua`), and every Envoy is still answered and holds a share within
/// the limit.
#[tokio::test]
async fn envoys_of_one_bucket_share_its_recomputations() {
    let fleet = Fleet::start(Backend::Redis { replicas: 1 }).await;
    let redis = fleet._redis.as_ref().expect("a Redis fleet");
    let recomputations = || command_calls(&redis.cli(&["INFO", "commandstats"]), "hgetall");
    let b = shared();
    let envoys: Vec<Arc<Envoy>> = (0..40).map(|i| fleet.envoy(&format!("e{i}"), 0)).collect();
    let before = recomputations();
    let start = Instant::now();
    for envoy in &envoys {
        envoy.drive(b.clone(), Rate::new(2.0));
    }
    let largest = largest_sum(&envoys, &b, start + Duration::from_secs(3)).await;
    let recomputed = recomputations() - before;
    let elapsed = start.elapsed();
    let answers: usize = envoys.iter().map(|e| e.received().len()).sum();
    let holding = envoys
        .iter()
        .filter(|e| matches!(e.enforced(&b), Some(Enforced::Tokens { rate, .. }) if rate > 0.0))
        .count();
    eprintln!(
        "40 Envoys of one bucket for {elapsed:.2?}: {recomputed} recomputations, {answers} assignments \
         received, {holding} holding a share, largest sum of assigned rates {largest:.1}"
    );
    assert!(
        largest <= LIMIT * (1.0 + 1e-9),
        "assignments above the limit: {largest}"
    );
    assert_eq!(holding, envoys.len(), "every Envoy holds a share");
    let most = elapsed.as_secs_f64() / (PERIOD.as_secs_f64() / 10.0) + 2.0;
    assert!(
        recomputed as f64 <= most,
        "{recomputed} recomputations in {elapsed:?}: at most one per tenth of a period ({most:.0})"
    );
    assert!(
        answers as u64 >= 3 * recomputed,
        "{answers} assignments from {recomputed} recomputations"
    );
    fleet.stop().await;
}

/// Wall-clock seconds at instant `t`: fixed windows are aligned to the Unix epoch.
fn wall(t: Instant) -> f64 {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    now - Instant::now().saturating_duration_since(t).as_secs_f64()
}

/// The start of the `k`-th 4 s window after `t`.
fn window_start(t: Instant, k: u32) -> Instant {
    let first = (wall(t) / 4.0).ceil() * 4.0;
    t + Duration::from_secs_f64(first + 4.0 * f64::from(k) - wall(t))
}

/// The `window` bucket: 400 hits per 4 s window, 100 a second.
fn window() -> Bucket {
    bucket(&[("generic_key", "window")])
}

/// `ShouldRateLimit` sees what RLQS Envoys admitted: the counter of the same descriptor holds their
/// reported usage (up to one report period behind).
#[tokio::test]
async fn rls_callers_see_what_rlqs_envoys_admitted() {
    let fleet = Fleet::start(Backend::Redis { replicas: 2 }).await;
    let b = window();
    let envoy = fleet.envoy("envoy", 0);
    envoy.drive(b.clone(), Rate::new(300.0));
    let start = window_start(Instant::now(), 1);
    let asked_at = start + Duration::from_millis(2_500);
    tokio::time::sleep_until(asked_at).await;
    let mut client = fleet.servers[1].client().await;
    let answer = ask(
        &mut client,
        request("fleet", vec![descriptor(&[("generic_key", "window")])]),
    )
    .await;
    let remaining = i64::from(answer.statuses[0].limit_remaining);
    let admitted = envoy.admitted(&b, start, asked_at) as i64;
    // Usage of the last report period may not be reported yet; usage of the previous window's last
    // period may have been reported into this one.
    let late = PERIOD + Duration::from_millis(100);
    let unreported = envoy.admitted(&b, asked_at - late, asked_at) as i64;
    let carried = envoy.admitted(&b, start - late, start) as i64;
    eprintln!(
        "the Envoy admitted {admitted} in the window so far; ShouldRateLimit then had {remaining} left of 400"
    );
    assert!(admitted >= 150, "{admitted}");
    assert!(
        remaining <= 399 - admitted + unreported && remaining >= 399 - admitted - carried,
        "remaining {remaining}, admitted {admitted} (unreported up to {unreported}, carried up to {carried})"
    );
    fleet.stop().await;
}

/// RLQS Envoys see what `ShouldRateLimit` callers spend: with a service asking 40 a second over RLS, the
/// Envoy is assigned about the other 60 of the 100 a second, and in every whole window after the first
/// what both admitted stays within the 400 plus what one report period at the limit's rate and the
/// bursts of new token buckets can add.
#[tokio::test]
async fn rlqs_envoys_share_what_rls_callers_leave() {
    let fleet = Fleet::start(Backend::Redis { replicas: 2 }).await;
    let b = window();
    let envoy = fleet.envoy("envoy", 0);
    let rls_ok: Arc<Mutex<Vec<Instant>>> = Arc::default();
    let stop = tokio_util::sync::CancellationToken::new();
    let rls = {
        let (ok, stop) = (rls_ok.clone(), stop.clone());
        let mut client = fleet.servers[1].client().await;
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(25));
            loop {
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tick.tick() => {}
                }
                let answer = ask(
                    &mut client,
                    request("fleet", vec![descriptor(&[("generic_key", "window")])]),
                )
                .await;
                if answer.overall_code == Code::Ok as i32 {
                    ok.lock().unwrap().push(Instant::now());
                }
            }
        })
    };
    envoy.drive(b.clone(), Rate::new(300.0));
    // The first whole window is the start: the rate RLS callers spend is learnt over it.
    let now = Instant::now();
    let windows: Vec<Instant> = (2..=5).map(|k| window_start(now, k)).collect();
    tokio::time::sleep_until(windows[3]).await;
    stop.cancel();
    rls.await.unwrap();
    let ok = rls_ok.lock().unwrap().clone();
    for k in 0..3 {
        let (from, to) = (windows[k], windows[k + 1]);
        let by_rls = ok.iter().filter(|t| **t >= from && **t < to).count() as f64;
        let by_rlqs = envoy.admitted(&b, from, to) as f64;
        let fresh = envoy.fresh_tokens();
        eprintln!(
            "window {k}: ShouldRateLimit admitted {by_rls}, the Envoy {by_rlqs}, together {} of 400 \
             (bursts of new token buckets so far {fresh:.0})",
            by_rls + by_rlqs
        );
        assert!(
            by_rls + by_rlqs <= 400.0 + 100.0 * PERIOD.as_secs_f64() + fresh,
            "window {k}: {by_rls} + {by_rlqs} over the limit"
        );
        assert!(
            by_rls >= 160.0 * 0.9,
            "window {k}: RLS callers get what they ask: {by_rls}"
        );
        assert!(
            (60.0 * 4.0 * 0.7..=60.0 * 4.0 * 1.15).contains(&by_rlqs),
            "window {k}: the Envoy gets about what RLS leaves: {by_rlqs}"
        );
    }
    fleet.stop().await;
}
