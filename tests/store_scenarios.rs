//! One scenario table, run unchanged against every store (the memory store, Redis standalone and a
//! 3-master Redis Cluster, where the checks of one request land in different hash slots) and every
//! algorithm; then random sequences must get the same decisions from the memory store and from Redis.

mod common;

use std::time::Duration;

use common::{
    now_ms,
    redis::{RedisCluster, RedisProcess},
    redis_store, ALGORITHMS,
};
use ratelimitd::{
    algorithm::{self, Algorithm, Params},
    settings::RedisTopology,
    store::{Applied, Batch, Check, CounterStore, Deadline, MemoryStore, Role, Store},
};

/// A store, an algorithm, and the prefix that keeps one scenario's keys apart from the others'.
#[derive(Clone, Copy)]
struct Case<'a> {
    store: &'a Store,
    prefix: &'static str,
    algorithm: Algorithm,
}

impl Case<'_> {
    /// A check; windows are long enough (an hour) that no refill or decay happens during a scenario.
    fn check(&self, key: &str, limit: u64, window_secs: u64, cost: u64, role: Role) -> Check {
        Check {
            key: format!("{}{}:{key}_", self.prefix, self.algorithm.name()),
            params: Params {
                algorithm: self.algorithm,
                limit,
                window_ms: window_secs * 1000,
                burst: limit,
                count_over_limit: false,
            },
            cost,
            role,
            further_limit: false,
            per_second: window_secs == 1,
            reported: false,
        }
    }

    /// A check of a limit that counts over its limit (a budget fed the usage reported after a response).
    fn budget(&self, key: &str, limit: u64, cost: u64, role: Role) -> Check {
        let mut check = self.check(key, limit, 3600, cost, role);
        check.params.count_over_limit = true;
        check
    }

    async fn apply(&self, checks: Vec<Check>, consume_on_deny: bool) -> Applied {
        let batch = Batch {
            checks,
            consume_on_deny,
            known_denied: false,
        };
        self.store
            .apply(&batch, now_ms(), Deadline::within(Duration::from_secs(5)))
            .await
            .expect("the store decides")
    }
}

async fn limit_n_allows_n_then_denies(c: Case<'_>) {
    for left in [2, 1, 0] {
        let a = c
            .apply(vec![c.check("k", 3, 3600, 1, Role::Enforce)], false)
            .await;
        assert!(!a.denied);
        assert_eq!(a.outcomes[0].remaining, left);
        // Fully reset within one window (two for a sliding window).
        assert!((1..=7200).contains(&a.outcomes[0].reset_after));
    }
    let a = c
        .apply(vec![c.check("k", 3, 3600, 1, Role::Enforce)], false)
        .await;
    assert!(a.denied && !a.outcomes[0].allowed);
    assert_eq!(a.outcomes[0].remaining, 0);
}

async fn a_denied_request_consumes_nothing(c: Case<'_>) {
    let both = || {
        vec![
            c.check("wide", 10, 3600, 1, Role::Enforce),
            c.check("narrow", 1, 3600, 1, Role::Enforce),
        ]
    };
    assert!(!c.apply(both(), false).await.denied);
    for _ in 0..3 {
        let a = c.apply(both(), false).await;
        assert!(a.denied);
        assert!(a.outcomes[0].allowed && !a.outcomes[1].allowed);
        assert_eq!(a.outcomes[0].remaining, 9, "wide keeps its quota");
    }
    let a = c
        .apply(vec![c.check("wide", 10, 3600, 1, Role::Enforce)], false)
        .await;
    assert_eq!(a.outcomes[0].remaining, 8);
}

async fn consume_on_deny_counts_every_check(c: Case<'_>) {
    let both = || {
        vec![
            c.check("wide", 10, 3600, 1, Role::Enforce),
            c.check("narrow", 1, 3600, 1, Role::Enforce),
        ]
    };
    c.apply(both(), true).await;
    let a = c.apply(both(), true).await;
    assert!(a.denied);
    assert_eq!(a.outcomes[0].remaining, 8);
    let a = c.apply(both(), true).await;
    assert_eq!(a.outcomes[0].remaining, 7);
}

async fn costs_above_one_and_zero_cost_checks(c: Case<'_>) {
    let a = c
        .apply(vec![c.check("k", 20, 3600, 3, Role::Enforce)], false)
        .await;
    assert_eq!(a.outcomes[0].remaining, 17);
    let a = c
        .apply(vec![c.check("k", 20, 3600, 0, Role::Enforce)], false)
        .await;
    assert!(a.outcomes[0].allowed);
    assert_eq!(a.outcomes[0].remaining, 17, "a zero cost only checks");
    let a = c
        .apply(vec![c.check("k", 20, 3600, 18, Role::Enforce)], false)
        .await;
    assert!(a.denied);
    let a = c
        .apply(vec![c.check("k", 20, 3600, 17, Role::Enforce)], false)
        .await;
    assert!(!a.denied);
    assert_eq!(a.outcomes[0].remaining, 0);
}

async fn shadow_never_denies_and_quota_denies_only_when_all_are_over(c: Case<'_>) {
    let a = c
        .apply(vec![c.check("s", 0, 3600, 1, Role::Shadow)], false)
        .await;
    assert!(!a.denied && !a.outcomes[0].allowed);
    let quota = || {
        vec![
            c.check("q1", 1, 3600, 1, Role::Quota),
            c.check("q2", 2, 3600, 1, Role::Quota),
        ]
    };
    assert!(!c.apply(quota(), false).await.denied);
    let a = c.apply(quota(), false).await;
    assert!(!a.denied, "q2 still has quota");
    assert!(!a.outcomes[0].allowed && a.outcomes[1].allowed);
    assert!(c.apply(quota(), false).await.denied);
}

/// A quota descriptor with two limits (a rule's `rate_limits`) is over when either is: with the other
/// quota descriptor over too, the request is denied, and nothing is consumed.
async fn a_quota_descriptor_is_over_when_any_of_its_limits_is(c: Case<'_>) {
    let request = || {
        let mut daily = c.check("q_daily", 100, 3600, 1, Role::Quota);
        daily.further_limit = true;
        vec![
            c.check("q_fast", 1, 3600, 1, Role::Quota),
            daily,
            c.check("q_other", 1, 3600, 1, Role::Quota),
        ]
    };
    assert!(!c.apply(request(), false).await.denied);
    let a = c.apply(request(), false).await;
    let allowed: Vec<bool> = a.outcomes.iter().map(|o| o.allowed).collect();
    assert_eq!(allowed, [false, true, false]);
    assert!(a.denied, "both quota descriptors are over");
    assert_eq!(a.outcomes[1].remaining, 99, "the daily limit as it stands");
    let daily = c.check("q_daily", 100, 3600, 0, Role::Enforce);
    let left = c.apply(vec![daily], false).await.outcomes[0].remaining;
    assert_eq!(left, 99, "the denied request consumed nothing");
}

async fn the_same_key_twice_counts_twice(c: Case<'_>) {
    let twice = vec![
        c.check("dup", 1, 3600, 1, Role::Enforce),
        c.check("dup", 1, 3600, 1, Role::Enforce),
    ];
    let a = c.apply(twice, true).await;
    assert!(a.outcomes[0].allowed && !a.outcomes[1].allowed);
}

/// Costs no limit could ever allow (2^63, 2^64 - 1, one above the limit) are denied like any cost
/// above the limit: nothing changes, nothing fails, and the quota stays whole; the limit itself fits,
/// and a check-only cost of 0 passes. The same counter twice with 1 and 2^64 - 1 is denied as a whole.
async fn extreme_costs_are_denied_without_changing_anything(c: Case<'_>) {
    for cost in [1u64 << 63, u64::MAX, 11] {
        let a = c
            .apply(vec![c.check("huge", 10, 3600, cost, Role::Enforce)], false)
            .await;
        assert!(a.denied && !a.outcomes[0].allowed, "cost {cost}");
        assert_eq!(a.outcomes[0].remaining, 0);
    }
    let zero = c
        .apply(vec![c.check("huge", 10, 3600, 0, Role::Enforce)], false)
        .await;
    assert!(!zero.denied);
    assert_eq!(zero.outcomes[0].remaining, 10, "nothing was consumed");
    let whole = c
        .apply(vec![c.check("huge", 10, 3600, 10, Role::Enforce)], false)
        .await;
    assert!(!whole.denied);
    assert_eq!(whole.outcomes[0].remaining, 0);

    let twice = vec![
        c.check("twice", 10, 3600, 1, Role::Enforce),
        c.check("twice", 10, 3600, u64::MAX, Role::Enforce),
    ];
    let a = c.apply(twice, false).await;
    assert!(a.denied && a.outcomes[0].allowed && !a.outcomes[1].allowed);
    let a = c
        .apply(vec![c.check("twice", 10, 3600, 10, Role::Enforce)], false)
        .await;
    assert!(!a.denied, "the denied request consumed nothing");

    // Counting denied requests too: only a fixed window counts a denied cost, and a huge one leaves it
    // over its limit for the window, as any cost above the limit would.
    let a = c
        .apply(
            vec![c.check("counted", 10, 3600, u64::MAX, Role::Enforce)],
            true,
        )
        .await;
    assert!(a.denied);
    let after = c
        .apply(vec![c.check("counted", 10, 3600, 1, Role::Enforce)], true)
        .await;
    assert_eq!(
        after.denied,
        c.algorithm == Algorithm::FixedWindow,
        "{:?}",
        c.algorithm
    );
}

/// A budget of 10 fed reports of 3: the fourth takes it past its limit and is counted (answered over its
/// limit), and from then on every check is over, a check-only cost of 0 included.
async fn a_budget_counts_the_report_past_its_limit(c: Case<'_>) {
    for left in [7, 4, 1] {
        let a = c
            .apply(vec![c.budget("b", 10, 3, Role::Enforce)], false)
            .await;
        assert!(!a.denied);
        assert_eq!(a.outcomes[0].remaining, left);
    }
    let fourth = c
        .apply(vec![c.budget("b", 10, 3, Role::Enforce)], false)
        .await;
    assert!(fourth.denied && !fourth.outcomes[0].allowed);
    for cost in [0, 1] {
        let a = c
            .apply(vec![c.budget("b", 10, cost, Role::Enforce)], false)
            .await;
        assert!(a.denied, "cost {cost}: 12 of 10 were counted");
    }
    // A check of the budget beside another limit denies the request, and the other consumes nothing.
    let both = vec![
        c.check("other", 5, 3600, 1, Role::Enforce),
        c.budget("b", 10, 0, Role::Enforce),
    ];
    let a = c.apply(both, false).await;
    assert!(a.denied && a.outcomes[0].allowed);
    let a = c
        .apply(vec![c.check("other", 5, 3600, 1, Role::Enforce)], false)
        .await;
    assert_eq!(
        a.outcomes[0].remaining, 4,
        "the denied request consumed nothing"
    );
}

/// A budget's report is counted also when another check denies the request (on Cluster that check may
/// live on another node, whose denial makes the budget's node give back what else it consumed, never the
/// budget's hits); the other checks keep their all-or-nothing.
async fn a_budget_is_counted_when_another_check_denies(c: Case<'_>) {
    for _ in 0..2 {
        let a = c
            .apply(
                vec![
                    c.check("closed", 0, 3600, 1, Role::Enforce),
                    c.check("open", 10, 3600, 1, Role::Enforce),
                    c.budget("b", 10, 4, Role::Enforce),
                ],
                false,
            )
            .await;
        assert!(a.denied);
        assert!(!a.outcomes[0].allowed && a.outcomes[1].allowed && a.outcomes[2].allowed);
    }
    let a = c
        .apply(
            vec![
                c.check("open", 10, 3600, 0, Role::Enforce),
                c.budget("b", 10, 0, Role::Enforce),
            ],
            false,
        )
        .await;
    assert_eq!(a.outcomes[0].remaining, 10, "open gave back what it took");
    assert_eq!(a.outcomes[1].remaining, 2, "both reports of 4 were counted");
    // A report the budget itself cannot fit, beside a check that fits: counted, and the request denied.
    let a = c
        .apply(
            vec![
                c.check("open", 10, 3600, 1, Role::Enforce),
                c.budget("b", 10, 3, Role::Enforce),
            ],
            false,
        )
        .await;
    assert!(a.denied && a.outcomes[0].allowed && !a.outcomes[1].allowed);
    let a = c
        .apply(vec![c.check("open", 10, 3600, 0, Role::Enforce)], false)
        .await;
    assert_eq!(a.outcomes[0].remaining, 10);
    let a = c
        .apply(vec![c.budget("b", 10, 0, Role::Enforce)], false)
        .await;
    assert!(a.denied, "11 of 10 counted");
}

/// A token bucket that never refills (`requests_per_unit: 0`) admits its burst once, and stays spent:
/// its state is kept, not forgotten a moment after it is written.
async fn a_bucket_that_never_refills_stays_spent(store: &Store) {
    let check = Check {
        key: "never:bucket_".into(),
        params: Params {
            algorithm: Algorithm::TokenBucket,
            limit: 0,
            window_ms: 1000,
            burst: 2,
            count_over_limit: false,
        },
        cost: 1,
        role: Role::Enforce,
        further_limit: false,
        per_second: false,
        reported: false,
    };
    let batch = Batch {
        checks: vec![check],
        ..Batch::default()
    };
    let deadline = || Deadline::within(Duration::from_secs(5));
    for _ in 0..2 {
        let a = store.apply(&batch, now_ms(), deadline()).await.unwrap();
        assert!(!a.denied, "the burst fits");
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
    let a = store.apply(&batch, now_ms(), deadline()).await.unwrap();
    assert!(a.denied, "a bucket that never refills stays spent");
}

/// Every algorithm at once: a 1-second limit of 1 is spent, denied with a wait of at most a second or
/// two, and free again two windows later.
async fn spent_limits_come_back_with_time(store: &Store) {
    // Start just after a second boundary so that both hits fall in one fixed window.
    let wait = 1000 - now_ms() % 1000;
    tokio::time::sleep(Duration::from_millis(wait + 20)).await;
    for algorithm in ALGORITHMS {
        let c = Case {
            store,
            prefix: "time:",
            algorithm,
        };
        let first = c
            .apply(vec![c.check("w", 1, 1, 1, Role::Enforce)], false)
            .await;
        assert!(!first.denied, "{algorithm:?}");
        let a = c
            .apply(vec![c.check("w", 1, 1, 1, Role::Enforce)], false)
            .await;
        assert!(a.denied, "{algorithm:?}");
        let retry = a.outcomes[0].retry_after;
        assert!(
            (1..=2).contains(&retry),
            "{algorithm:?}: {:?}",
            a.outcomes[0]
        );
    }
    tokio::time::sleep(Duration::from_millis(2100)).await;
    for algorithm in ALGORITHMS {
        let c = Case {
            store,
            prefix: "time:",
            algorithm,
        };
        let again = c
            .apply(vec![c.check("w", 1, 1, 1, Role::Enforce)], false)
            .await;
        assert!(!again.denied, "{algorithm:?}");
    }
}

macro_rules! run_all {
    ($store:expr, $($scenario:ident),+ $(,)?) => {{
        for algorithm in ALGORITHMS {
            $(
                eprintln!("scenario {} with {algorithm:?}", stringify!($scenario));
                let case = Case {
                    store: $store,
                    prefix: concat!(stringify!($scenario), ":"),
                    algorithm,
                };
                $scenario(case).await;
            )+
        }
    }};
}

async fn run_table(store: &Store) {
    run_all!(
        store,
        limit_n_allows_n_then_denies,
        a_denied_request_consumes_nothing,
        consume_on_deny_counts_every_check,
        costs_above_one_and_zero_cost_checks,
        shadow_never_denies_and_quota_denies_only_when_all_are_over,
        a_quota_descriptor_is_over_when_any_of_its_limits_is,
        the_same_key_twice_counts_twice,
        extreme_costs_are_denied_without_changing_anything,
        a_budget_counts_the_report_past_its_limit,
        a_budget_is_counted_when_another_check_denies,
    );
    spent_limits_come_back_with_time(store).await;
    a_bucket_that_never_refills_stays_spent(store).await;
}

/// Random sequences of requests (keys, costs, roles, consume_on_deny) get the same answers from both
/// stores; with `over`, two of the three keys count over their limit. Windows of a day keep time out of
/// the comparison.
async fn same_answers(memory: &Store, redis: &Store, seed: u64, over: bool) {
    use rand::{rngs::SmallRng, Rng, SeedableRng};
    let mut rng = SmallRng::seed_from_u64(seed);
    let roles = [Role::Enforce, Role::Enforce, Role::Shadow, Role::Quota];
    for algorithm in ALGORITHMS {
        let c = Case {
            store: memory,
            prefix: "random:",
            algorithm,
        };
        for step in 0..150 {
            let checks: Vec<Check> = (0..rng.random_range(1..=3))
                .map(|_| {
                    let key = ["a", "bb", "c"][rng.random_range(0..3)];
                    let limit = [3, 5][key.len() % 2];
                    let role = roles[rng.random_range(0..4)];
                    // Mostly small costs; now and then the limit, one above it, or 2^64 - 1.
                    let cost = [0, 1, 1, 2, 2, limit, limit + 1, u64::MAX][rng.random_range(0..8)];
                    let mut check = c.check(key, limit, 86_400, cost, role);
                    check.key = format!("seed{seed}:{over}:{}", check.key);
                    check.params.count_over_limit = over && key != "bb";
                    check
                })
                .collect();
            let batch = Batch {
                checks,
                consume_on_deny: rng.random_bool(0.2),
                known_denied: false,
            };
            let m = memory
                .apply(&batch, now_ms(), Deadline::within(Duration::from_secs(5)))
                .await
                .unwrap();
            let r = redis
                .apply(&batch, now_ms(), Deadline::within(Duration::from_secs(5)))
                .await
                .unwrap();
            let view = |a: &Applied| {
                let outcomes: Vec<(bool, u64)> = a
                    .outcomes
                    .iter()
                    .map(|o| (o.allowed, o.remaining))
                    .collect();
                (a.denied, outcomes)
            };
            assert_eq!(view(&m), view(&r), "{algorithm:?} step {step}: {batch:?}");
        }
    }
}

/// On Cluster, a request whose fixed-window key is for another window than the server's (its replica's
/// clock two hours ahead) goes again with keys for the server's time. A budget on another node, decided
/// and counted on the first try, is not counted again: the retry only checks it.
async fn a_budget_is_counted_once_when_its_request_goes_again(url: String) {
    // A store of its own, which has not learned the servers' clock yet.
    let store = Store::Redis(redis_store(url, RedisTopology::Cluster).await);
    let fixed = Check::fixed_window("again:fixed_".into(), 10, 3600, 1, Role::Enforce);
    let budget = Check {
        key: "again:budget_".into(),
        params: Params {
            algorithm: Algorithm::TokenBucket,
            limit: 10,
            window_ms: 3_600_000,
            burst: 10,
            count_over_limit: true,
        },
        cost: 4,
        role: Role::Enforce,
        further_limit: false,
        per_second: false,
        reported: false,
    };
    let slot = |key: &str| fred::util::redis_keyslot(key.as_bytes());
    assert_ne!(slot(&fixed.storage_key(now_ms())), slot(&budget.key));
    let batch = Batch {
        checks: vec![fixed, budget.clone()],
        ..Batch::default()
    };
    let deadline = || Deadline::within(Duration::from_secs(5));
    let a = store
        .apply(&batch, now_ms() + 2 * 3_600_000, deadline())
        .await
        .unwrap();
    assert!(!a.denied);
    assert_eq!((a.outcomes[0].remaining, a.outcomes[1].remaining), (9, 6));
    let check = Batch {
        checks: vec![Check { cost: 0, ..budget }],
        ..Batch::default()
    };
    let a = store.apply(&check, now_ms(), deadline()).await.unwrap();
    assert_eq!(
        a.outcomes[0].remaining, 6,
        "the report of 4 was counted once"
    );
    store.close().await;
}

/// What the operators' API asks of a store: every algorithm's counter read as the requests left it (and
/// as the memory store reads it), then cleared; runtime limit records written, read back by generation
/// and deleted.
async fn operator_calls(store: &Store) {
    let memory = Store::Memory(MemoryStore::new(100));
    for algorithm in ALGORITHMS {
        let c = Case {
            store,
            prefix: "operator:",
            algorithm,
        };
        let checks = vec![
            c.check("a", 10, 3600, 4, Role::Enforce),
            c.check("b", 10, 3600, 1, Role::Enforce),
        ];
        c.apply(checks.clone(), false).await;
        let m = Case {
            store: &memory,
            ..c
        };
        m.apply(checks.clone(), false).await;
        let usage = |read: ratelimitd::store::operator::Read| -> Vec<(f64, u64)> {
            checks
                .iter()
                .zip(&read.states)
                .map(|(check, state)| {
                    let u = algorithm::usage(&check.params, state.as_ref(), read.now_ms);
                    ((u.used * 10.0).round() / 10.0, u.remaining)
                })
                .collect()
        };
        let read = store.read(&checks, now_ms()).await.unwrap();
        assert_eq!(usage(read.clone()), [(4.0, 6), (1.0, 9)], "{algorithm:?}");
        assert_eq!(
            usage(memory.read(&checks, now_ms()).await.unwrap()),
            usage(read)
        );
        assert_eq!(
            store.clear(&checks, now_ms()).await.unwrap(),
            2,
            "{algorithm:?}"
        );
        let read = store.read(&checks, now_ms()).await.unwrap();
        assert_eq!(read.states, [None, None], "{algorithm:?}");
        let a = c
            .apply(vec![c.check("a", 10, 3600, 1, Role::Enforce)], false)
            .await;
        assert_eq!(
            a.outcomes[0].remaining, 9,
            "{algorithm:?}: counts from zero again"
        );
    }

    let keys = ratelimitd::store::operator::RecordKeys::new("operator:");
    let first = store.records(&keys, None).await.unwrap().unwrap();
    assert_eq!(first.generation, 0, "nothing set yet");
    assert!(store.records(&keys, Some(0)).await.unwrap().is_none());
    for (id, record) in [("one", "{\"a\":1}"), ("two", "{}")] {
        assert!(store.put_record(&keys, id, record, 2, 0).await.unwrap());
    }
    // Two held, room for two: a third is refused and changes nothing, the generation included.
    assert!(!store.put_record(&keys, "three", "{}", 2, 0).await.unwrap());
    let set = store.records(&keys, Some(0)).await.unwrap().unwrap();
    assert_ne!(set.generation, 0, "the generation moved on");
    assert_eq!(
        set.records,
        [
            ("one".into(), "{\"a\":1}".into()),
            ("two".into(), "{}".into())
        ]
    );
    assert!(store
        .records(&keys, Some(set.generation))
        .await
        .unwrap()
        .is_none());
    let ids = ["one".to_owned(), "none".to_owned()];
    assert_eq!(store.delete_records(&keys, &ids).await.unwrap(), 1);
    let deleted = store
        .records(&keys, Some(set.generation))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(deleted.records.len(), 1);
    store.announce(&keys).await.unwrap();
    let left = store
        .records(&keys, Some(deleted.generation))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(left.records.len(), 1, "announced: read again, unchanged");
    assert_ne!(left.generation, deleted.generation);
}

#[tokio::test]
async fn scenarios_on_the_memory_store() {
    run_table(&Store::Memory(MemoryStore::new(10_000))).await;
    operator_calls(&Store::Memory(MemoryStore::new(10_000))).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scenarios_on_redis_standalone() {
    let redis = RedisProcess::start(&[]);
    let store = redis_store(redis.addr(), RedisTopology::Single).await;
    let redis_store = Store::Redis(store.clone());
    run_table(&redis_store).await;
    operator_calls(&redis_store).await;
    let memory = Store::Memory(MemoryStore::new(10_000));
    same_answers(&memory, &redis_store, 1, false).await;
    same_answers(&memory, &redis_store, 1, true).await;
    // Every counter written, whatever its algorithm, has a TTL (runtime limits are kept until deleted).
    for key in redis.cli(&["--scan"]).lines() {
        if key.contains("{ratelimitd}:") {
            continue;
        }
        let ttl: i64 = redis.cli(&["TTL", key]).parse().unwrap();
        // -1 is a key without TTL; -2 one that expired since the scan.
        assert!(ttl != -1, "{key} has no TTL");
    }
    store.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scenarios_on_redis_cluster() {
    let cluster = RedisCluster::start(false);
    let store = redis_store(cluster.url(), RedisTopology::Cluster).await;
    let redis_store = Store::Redis(store.clone());
    run_table(&redis_store).await;
    operator_calls(&redis_store).await;
    let memory = Store::Memory(MemoryStore::new(10_000));
    same_answers(&memory, &redis_store, 2, false).await;
    same_answers(&memory, &redis_store, 2, true).await;
    store.close().await;
    a_budget_is_counted_once_when_its_request_goes_again(cluster.url()).await;
}
