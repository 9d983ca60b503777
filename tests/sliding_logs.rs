//! Sliding logs on Redis: a decision costs the entries that left the window since the last call, not
//! the whole log, however many entries it holds; a log written by an earlier version (without the
//! `hits` member that holds the entries' sum) is counted whole once and kept from then on; and that
//! sum stays the entries' sum through expiry, budgets, denied requests and Cluster refunds. On the memory
//! store, a hit changes the log in place rather than copying it.

mod common;

use std::time::Duration;

use common::{
    measure::{bytes_allocated, Measuring},
    now_ms,
    redis::{RedisCluster, RedisProcess},
    redis_store, redis_store_as,
};
use ratelimitd::{
    algorithm::{self, Algorithm, Params},
    settings::{RedisSettings, RedisTopology},
    store::{Applied, Batch, Check, CounterStore, Deadline, MemoryStore, Role, Store},
};

#[global_allocator]
static GLOBAL: Measuring = Measuring;

const HOUR_MS: u64 = 3_600_000;

fn log_check(key: &str, limit: u64, window_ms: u64, cost: u64) -> Check {
    Check {
        key: key.into(),
        params: Params {
            algorithm: Algorithm::SlidingLog,
            limit,
            window_ms,
            burst: limit,
            count_over_limit: false,
        },
        cost,
        role: Role::Enforce,
        further_limit: false,
        per_second: false,
        reported: false,
    }
}

async fn apply(store: &Store, checks: Vec<Check>, consume_on_deny: bool) -> Applied {
    let batch = Batch {
        checks,
        consume_on_deny,
        known_denied: false,
    };
    store
        .apply(&batch, now_ms(), Deadline::within(Duration::from_secs(10)))
        .await
        .expect("the store decides")
}

/// The Redis key a check's counter went to.
fn redis_key(redis: &RedisProcess, pattern: &str) -> String {
    let found = redis.cli(&["--scan", "--pattern", pattern]);
    let keys: Vec<&str> = found.lines().collect();
    assert_eq!(keys.len(), 1, "one key for {pattern}: {keys:?}");
    keys[0].to_string()
}

/// Redis's time per script call since the last `CONFIG RESETSTAT`, in microseconds.
fn script_usec_per_call(redis: &RedisProcess) -> f64 {
    let stats = redis.cli(&["INFO", "commandstats"]);
    stats
        .lines()
        .find(|l| l.starts_with("cmdstat_evalsha:"))
        .and_then(|l| l.split("usec_per_call=").nth(1))
        .and_then(|v| v.split(',').next())
        .and_then(|v| v.parse().ok())
        .expect("script calls counted")
}

/// Redis's time in every command since the last `CONFIG RESETSTAT`, in microseconds.
fn usec_in_commands(redis: &RedisProcess) -> u64 {
    let stats = redis.cli(&["INFO", "commandstats"]);
    stats
        .lines()
        .filter(|l| !l.starts_with("cmdstat_info:") && !l.starts_with("cmdstat_config:"))
        .filter_map(|l| l.split("usec=").nth(1))
        .filter_map(|v| v.split(',').next()?.parse::<u64>().ok())
        .sum()
}

/// What the operators' API shows of a check's counter (`inspect`), at the server's time.
async fn inspect(store: &Store, check: Check) -> (algorithm::Usage, u64) {
    let read = store
        .read(std::slice::from_ref(&check), now_ms())
        .await
        .expect("the store reads");
    let usage = algorithm::usage(&check.params, read.states[0].as_ref(), read.now_ms);
    (usage, read.now_ms)
}

/// Fills a log as an earlier version leaves it: 50 000 live entries of one hit each, 36 ms apart over
/// the last half hour, 5 000 that have left an hour's window, and no `hits` member. Returns Redis's
/// time when it wrote them.
fn fill_as_an_earlier_version(redis: &RedisProcess, key: &str) -> u64 {
    let script = "local t = redis.call('TIME')
        local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
        for i = 0, 49999 do
          local at = now - 1800000 + i * 36
          redis.call('ZADD', KEYS[1], at, at .. ':' .. i .. ':1')
        end
        for i = 0, 4999 do
          local at = now - 3700000 + i
          redis.call('ZADD', KEYS[1], at, at .. ':' .. i .. ':1')
        end
        redis.call('ZREM', KEYS[1], 'hits')
        return now";
    redis.cli(&["EVAL", script, "1", key]).parse().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_log_is_decided_by_what_changed_not_by_its_length() {
    let redis = RedisProcess::start(&[]);
    // The first call counts 50 000 entries in one script: on a machine busy with the other tests that
    // can take past the 300 ms after which a silent Redis is taken for hung.
    let store = Store::Redis(
        common::redis_store_from(RedisSettings {
            url: redis.addr(),
            timeout: Duration::from_secs(2),
            unresponsive_after: Duration::from_secs(5),
            ..Default::default()
        })
        .await,
    );
    let long = |limit, cost| log_check("long:", limit, HOUR_MS, cost);

    let first = apply(&store, vec![long(100_000, 1)], false).await;
    assert_eq!(first.outcomes[0].remaining, 99_999);
    let key = redis_key(&redis, "*long:*");
    let filled_at = fill_as_an_earlier_version(&redis, &key);

    // Counted whole once: the 50 000 live entries and the first request's, not the 5 000 that left.
    let counted = apply(&store, vec![long(100_000, 1)], false).await;
    assert_eq!(counted.outcomes[0].remaining, 100_000 - 50_001 - 1);
    assert_eq!(
        redis.cli(&["ZCOUNT", &key, "(0", "+inf"]),
        "50002",
        "the entries that left the window are gone"
    );
    assert_eq!(redis.cli(&["ZSCORE", &key, "hits"]), "-50002");

    // From now on each call costs about what a call on a short log costs.
    assert_eq!(redis.cli(&["CONFIG", "RESETSTAT"]), "OK");
    for i in 1..=100 {
        let answer = apply(&store, vec![long(100_000, 1)], false).await;
        assert_eq!(answer.outcomes[0].remaining, 100_000 - 50_002 - i);
    }
    let long_usec = script_usec_per_call(&redis);
    apply(
        &store,
        vec![log_check("short:", 100_000, HOUR_MS, 1)],
        false,
    )
    .await;
    assert_eq!(redis.cli(&["CONFIG", "RESETSTAT"]), "OK");
    for _ in 0..100 {
        apply(
            &store,
            vec![log_check("short:", 100_000, HOUR_MS, 1)],
            false,
        )
        .await;
    }
    let short_usec = script_usec_per_call(&redis);
    eprintln!("Redis time per call: {long_usec} us on 50 000 entries, {short_usec} us on a few");
    assert!(
        long_usec < 10.0 * short_usec.max(5.0),
        "a call on 50 000 entries took {long_usec} us, on a few {short_usec} us"
    );

    // A denied request's wait reads the oldest entries it needs: with a limit of 50 000 on the 50 102
    // hits held, 103 must leave, the 103rd oldest entry being the last of them.
    let denied = apply(&store, vec![long(50_000, 1)], false).await;
    assert!(!denied.outcomes[0].allowed);
    let leaves_at = filled_at - 1_800_000 + 102 * 36 + HOUR_MS;
    let waited = now_ms().saturating_sub(filled_at) + 1_000;
    let retry = denied.outcomes[0].retry_ms;
    assert!(
        retry <= leaves_at - filled_at && retry + waited >= leaves_at - filled_at,
        "retry {retry} ms; the entry leaves {} ms after the fill",
        leaves_at - filled_at
    );
    // A cost that would need 50 102 hits to leave is told the wait of the 256th oldest entry (no later
    // than the real one), having read 257 entries, not 50 102.
    assert_eq!(redis.cli(&["CONFIG", "RESETSTAT"]), "OK");
    let denied = apply(&store, vec![long(100_000, 100_000)], false).await;
    assert!(!denied.outcomes[0].allowed);
    let leaves_at = filled_at - 1_800_000 + 255 * 36 + HOUR_MS;
    let waited = now_ms().saturating_sub(filled_at) + 1_000;
    let retry = denied.outcomes[0].retry_ms;
    assert!(
        retry <= leaves_at - filled_at && retry + waited >= leaves_at - filled_at,
        "retry {retry} ms; the 256th entry leaves {} ms after the fill",
        leaves_at - filled_at
    );
    let denied_usec = script_usec_per_call(&redis);
    eprintln!("a denied cost of the whole limit: {denied_usec} us");
    assert!(
        denied_usec < 20.0 * short_usec.max(5.0),
        "a denied cost of the whole limit took {denied_usec} us"
    );
    // Denied and read only: nothing changed.
    assert_eq!(redis.cli(&["ZSCORE", &key, "hits"]), "-50102");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_short_log_whose_sum_went_wrong_is_counted_from_its_entries() {
    let redis = RedisProcess::start(&[]);
    let store = Store::Redis(redis_store(redis.addr(), RedisTopology::Single).await);
    let check = || log_check("drift:", 10, HOUR_MS, 1);
    for _ in 0..3 {
        apply(&store, vec![check()], false).await;
    }
    let key = redis_key(&redis, "*drift:*");
    assert_eq!(redis.cli(&["ZSCORE", &key, "hits"]), "-3");
    // What a Cluster refund by an earlier version leaves during an upgrade: entries and sum disagree.
    redis.cli(&["ZADD", &key, "-9", "hits"]);
    let answer = apply(&store, vec![check()], false).await;
    assert_eq!(
        answer.outcomes[0].remaining,
        10 - 4,
        "counted from the entries"
    );
    assert_eq!(
        redis.cli(&["ZSCORE", &key, "hits"]),
        "-4",
        "and the sum set right"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inspecting_a_long_log_reads_what_a_decision_would() {
    let redis = RedisProcess::start(&[]);
    let store = Store::Redis(redis_store(redis.addr(), RedisTopology::Single).await);
    let long = |window_ms| log_check("long:", 100_000, window_ms, 0);
    apply(&store, vec![log_check("long:", 100_000, HOUR_MS, 1)], false).await;
    let key = redis_key(&redis, "*long:*");
    let filled_at = fill_as_an_earlier_version(&redis, &key);
    apply(&store, vec![log_check("long:", 100_000, HOUR_MS, 1)], false).await;
    assert_eq!(redis.cli(&["ZSCORE", &key, "hits"]), "-50002");

    let (usage, _) = inspect(&store, long(HOUR_MS)).await;
    assert_eq!(usage.used, 50_002.0);
    assert_eq!(usage.remaining, 100_000 - 50_002);
    let since = now_ms().saturating_sub(filled_at) + 1_000;
    assert!(
        usage.reset_ms <= HOUR_MS && usage.reset_ms + since >= HOUR_MS,
        "reset in {} ms: an hour after the newest hit",
        usage.reset_ms
    );
    // Through a window of 1 000 s, the 22 000-odd oldest entries have left it: counted beyond the
    // oldest eight read with the sum.
    let (usage, at) = inspect(&store, long(1_000_000)).await;
    let live = (0..50_000u64)
        .filter(|i| filled_at - 1_800_000 + i * 36 > at - 1_000_000)
        .count() as f64;
    assert_eq!(usage.used, live + 2.0);
    // Nothing changed: inspecting is reading.
    assert_eq!(redis.cli(&["ZSCORE", &key, "hits"]), "-50002");
    assert_eq!(redis.cli(&["ZCARD", &key]), "50003");

    // Redis's time for an inspect of the long log is about that of a log of three entries.
    assert_eq!(redis.cli(&["CONFIG", "RESETSTAT"]), "OK");
    for _ in 0..20 {
        inspect(&store, long(HOUR_MS)).await;
    }
    let long_usec = usec_in_commands(&redis) as f64 / 20.0;
    for _ in 0..3 {
        apply(&store, vec![log_check("short:", 100, HOUR_MS, 1)], false).await;
    }
    assert_eq!(redis.cli(&["CONFIG", "RESETSTAT"]), "OK");
    for _ in 0..20 {
        let (usage, _) = inspect(&store, log_check("short:", 100, HOUR_MS, 0)).await;
        assert_eq!(usage.used, 3.0);
    }
    let short_usec = usec_in_commands(&redis) as f64 / 20.0;
    eprintln!("Redis time per inspect: {long_usec} us on 50 002 entries, {short_usec} us on 3");
    assert!(
        long_usec < 10.0 * short_usec.max(5.0),
        "an inspect of 50 002 entries took {long_usec} us, of 3 {short_usec} us"
    );
}

/// The Redis ACL user SECURITY.md listed before sliding logs were read in part: no ZRANGE, ZSCORE or
/// ZINCRBY.
const EARLIER_ACL: &str = "ACL SETUSER earlier on >earlier-pass resetkeys ~* resetchannels -@all \
    +evalsha +eval +script|load +script|exists +ping +time +info +hello +select +client|setname \
    +get +mget +set +incrby +decrby +expire +pexpire +del +exists +hget +hmget +hset \
    +zadd +zrangebyscore +zremrangebyscore +zrem +zcard +cluster|slots +hgetall +hdel";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_user_set_up_for_earlier_versions_still_decides_sliding_logs() {
    let redis = RedisProcess::start(&[]);
    let acl: Vec<&str> = EARLIER_ACL
        .split_whitespace()
        .filter(|w| *w != "\\")
        .collect();
    assert_eq!(redis.cli(&acl), "OK");
    let store = redis_store_as(redis.addr(), RedisTopology::Single, "earlier:earlier-pass").await;
    let store = Store::Redis(store);
    let check = |cost| log_check("earlier:", 3, HOUR_MS, cost);
    for left in [2, 1, 0] {
        let answer = apply(&store, vec![check(1)], false).await;
        assert_eq!(answer.outcomes[0].remaining, left);
    }
    let denied = apply(&store, vec![check(1)], false).await;
    assert!(!denied.outcomes[0].allowed);
    assert!(denied.outcomes[0].retry_ms > HOUR_MS - 10_000);
    let key = redis_key(&redis, "*earlier:*");
    assert_eq!(redis.cli(&["ZSCORE", &key, "hits"]), "-3");

    // A Cluster refund as that user: the sum cannot be read or moved, so it goes, and the next call
    // counts the log from its entries.
    let newest = redis.cli(&["ZRANGE", &key, "-1", "-1", "WITHSCORES"]);
    let stamp = newest.lines().nth(1).unwrap().to_string();
    let refund = include_str!("../src/store/redis/refund.lua");
    let args = [
        "--user",
        "earlier",
        "--pass",
        "earlier-pass",
        "--no-auth-warning",
        "EVAL",
        refund,
        "1",
        &key,
        &stamp,
        "2",
        "1",
        "3600000",
        "3",
        "3",
    ];
    assert_eq!(common::redis::cli(redis.port, &args), "0");
    assert_eq!(redis.cli(&["ZSCORE", &key, "hits"]), "");
    let answer = apply(&store, vec![check(1)], false).await;
    assert_eq!(
        answer.outcomes[0].remaining, 0,
        "2 hits held, 1 more allowed"
    );
    assert_eq!(redis.cli(&["ZSCORE", &key, "hits"]), "-3");
    // The operators' API reads the log whole, as that user may.
    assert_eq!(inspect(&store, check(0)).await.0.used, 3.0);
}

/// Random requests on short windows, with budgets and denials: after each, every log's `hits` member
/// holds minus the sum of its entries. On a Cluster, a log's slot gives back what another slot's denial
/// undoes, and the member follows.
async fn the_sum_follows_the_entries(store: &Store, nodes: &[&RedisProcess], seed: u64) {
    use rand::{rngs::SmallRng, Rng, SeedableRng};
    let mut rng = SmallRng::seed_from_u64(seed);
    for step in 0..200 {
        let mut checks = Vec::new();
        for _ in 0..rng.random_range(1..=3) {
            let key = ["a", "b", "c", "d"][rng.random_range(0..4)];
            let cost = [0, 1, 1, 2, 3, 7][rng.random_range(0..6)];
            let mut check = log_check(&format!("sum{seed}:{key}"), 6, 300, cost);
            check.params.count_over_limit = key == "d";
            checks.push(check);
        }
        if rng.random_bool(0.3) {
            // A fixed window in another slot that soon denies: on a Cluster, what the logs' slots
            // consumed for the request is given back.
            checks.push(Check::fixed_window(
                format!("deny{seed}_"),
                20,
                3600,
                1,
                Role::Enforce,
            ));
        }
        apply(store, checks, rng.random_bool(0.2)).await;
        for node in nodes {
            for key in node
                .cli(&["--scan", "--pattern", &format!("*sum{seed}:*")])
                .lines()
            {
                let members = node.cli(&["ZRANGE", key, "0", "-1", "WITHSCORES"]);
                let lines: Vec<&str> = members.lines().collect();
                let mut held = 0i64;
                let mut sum = None;
                for pair in lines.chunks(2) {
                    if pair[0] == "hits" {
                        sum = Some(-pair[1].parse::<i64>().unwrap());
                    } else {
                        held += pair[0].rsplit(':').next().unwrap().parse::<i64>().unwrap();
                    }
                }
                if held > 0 || sum.is_some() {
                    assert_eq!(sum, Some(held), "step {step}, {key}: {members}");
                }
            }
        }
        if rng.random_bool(0.2) {
            tokio::time::sleep(Duration::from_millis(rng.random_range(50..300))).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sum_follows_the_entries_on_redis() {
    let redis = RedisProcess::start(&[]);
    let store = Store::Redis(redis_store(redis.addr(), RedisTopology::Single).await);
    the_sum_follows_the_entries(&store, &[&redis], 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sum_follows_the_entries_on_a_cluster() {
    let cluster = RedisCluster::start(false);
    let store = Store::Redis(redis_store(cluster.url(), RedisTopology::Cluster).await);
    let nodes: Vec<&RedisProcess> = cluster.masters.iter().collect();
    the_sum_follows_the_entries(&store, &nodes, 2).await;
}

/// A log whose entries in Redis claim more hits than a count can hold (written by hand, or damaged) is
/// inspected all the same, its count never above the hits really taken.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_log_whose_entries_claim_impossible_hits_is_inspected() {
    let redis = RedisProcess::start(&[]);
    let store = Store::Redis(redis_store(redis.addr(), RedisTopology::Single).await);
    let check = |cost| log_check("damaged:", 100, HOUR_MS, cost);
    for _ in 0..20 {
        apply(&store, vec![check(1)], false).await;
    }
    let key = redis_key(&redis, "*damaged:*");
    // Two entries from long ago, of 2^64 - 1 hits each.
    let most = u64::MAX.to_string();
    let (first, second) = (format!("1:1:{most}"), format!("2:2:{most}"));
    redis.cli(&["ZADD", &key, "1", &first, "2", &second]);
    let (usage, _) = inspect(&store, check(0)).await;
    assert!(usage.used <= 20.0, "{usage:?}");
}

/// On a Cluster, each log is inspected on the master that holds it, the script that reads it loaded
/// there on first use.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_cluster_each_log_is_inspected_where_it_lives() {
    let cluster = RedisCluster::start(false);
    let store = Store::Redis(redis_store(cluster.url(), RedisTopology::Cluster).await);
    let names = ["a:", "b:", "c:", "d:", "e:", "f:", "g:", "h:"];
    for (i, name) in names.iter().enumerate() {
        for _ in 0..=i {
            apply(&store, vec![log_check(name, 100, HOUR_MS, 1)], false).await;
        }
    }
    let holding = cluster
        .masters
        .iter()
        .filter(|m| m.cli(&["DBSIZE"]) != "0")
        .count();
    assert!(holding > 1, "the logs are spread over the masters");
    for (i, name) in names.iter().enumerate() {
        let (usage, _) = inspect(&store, log_check(name, 100, HOUR_MS, 0)).await;
        assert_eq!(usage.used, (i + 1) as f64, "{name}");
    }
}

#[test]
fn on_the_memory_store_a_log_grows_by_its_entries_not_by_copies() {
    let store = Store::Memory(MemoryStore::new(100));
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let t0 = now_ms();
    let check = || log_check("memory:", 100_000, HOUR_MS, 1);
    let decide = |at: u64| {
        let batch = Batch {
            checks: vec![check()],
            consume_on_deny: false,
            known_denied: false,
        };
        runtime
            .block_on(store.apply(&batch, at, Deadline::within(Duration::from_secs(1))))
            .unwrap()
    };
    // 20 000 requests a millisecond apart: 20 000 entries of 16 bytes. Copying the log for each hit
    // would allocate 20 000^2 / 2 entries, 3.2 GB.
    let (last, bytes) = bytes_allocated(|| {
        let mut last = None;
        for i in 0..20_000 {
            last = Some(decide(t0 + i));
        }
        last.unwrap()
    });
    eprintln!("20 000 hits on one log: {bytes} bytes allocated");
    assert_eq!(last.outcomes[0].remaining, 80_000);
    assert!(bytes < 16 << 20, "{bytes} bytes allocated for 20 000 hits");
    // An hour after the first, the first 5 000 have left the window and go.
    let later = decide(t0 + HOUR_MS + 4_999);
    assert_eq!(later.outcomes[0].remaining, 100_000 - 15_000 - 1);
}
