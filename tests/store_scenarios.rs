//! One scenario table, run unchanged against every store: the memory store, Redis standalone and a
//! 3-master Redis Cluster (where the checks of one request land in different hash slots).

mod common;

use std::{
    sync::Arc,
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use common::redis::{RedisCluster, RedisProcess};
use ratelimitd::{
    settings::{RedisSettings, RedisTopology},
    store::{Applied, Batch, Check, CounterStore, MemoryStore, RedisStore, Role, Store},
};

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

/// A store plus the prefix that keeps one scenario's keys apart from the others'.
struct Case<'a> {
    store: &'a Store,
    prefix: &'static str,
}

impl Case<'_> {
    fn check(&self, key: &str, limit: u64, window: u64, cost: u64, role: Role) -> Check {
        Check {
            key: format!("{}{key}_", self.prefix),
            limit,
            window,
            cost,
            role,
        }
    }

    async fn apply(&self, checks: Vec<Check>, consume_on_deny: bool) -> Applied {
        let batch = Batch {
            checks,
            consume_on_deny,
        };
        self.store
            .apply(&batch, now_ms())
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
        assert!((1..=3600).contains(&a.outcomes[0].reset_after));
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

async fn the_same_key_twice_counts_twice(c: Case<'_>) {
    let twice = vec![
        c.check("dup", 1, 3600, 1, Role::Enforce),
        c.check("dup", 1, 3600, 1, Role::Enforce),
    ];
    let a = c.apply(twice, true).await;
    assert!(a.outcomes[0].allowed && !a.outcomes[1].allowed);
}

async fn a_new_window_starts_from_zero(c: Case<'_>) {
    // Start just after a second boundary so that both hits fall in one window.
    let wait = 1000 - now_ms() % 1000;
    tokio::time::sleep(Duration::from_millis(wait + 20)).await;
    assert!(
        !c.apply(vec![c.check("w", 1, 1, 1, Role::Enforce)], false)
            .await
            .denied
    );
    assert!(
        c.apply(vec![c.check("w", 1, 1, 1, Role::Enforce)], false)
            .await
            .denied
    );
    tokio::time::sleep(Duration::from_millis(1000)).await;
    assert!(
        !c.apply(vec![c.check("w", 1, 1, 1, Role::Enforce)], false)
            .await
            .denied
    );
}

macro_rules! run_all {
    ($store:expr, $($scenario:ident),+ $(,)?) => {{
        $(
            eprintln!("scenario {}", stringify!($scenario));
            $scenario(Case { store: $store, prefix: concat!(stringify!($scenario), ":") }).await;
        )+
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
        the_same_key_twice_counts_twice,
        a_new_window_starts_from_zero,
    );
}

async fn redis_store(url: String, topology: RedisTopology) -> Arc<RedisStore> {
    let settings = RedisSettings {
        url,
        topology,
        timeout: Duration::from_secs(2),
        pool_size: 2,
        ..RedisSettings::default()
    };
    let store = RedisStore::connect(&settings, 0).unwrap();
    tokio::time::timeout(Duration::from_secs(20), store.ready())
        .await
        .expect("redis ready in time")
        .unwrap();
    store
}

#[tokio::test]
async fn scenarios_on_the_memory_store() {
    run_table(&Store::Memory(MemoryStore::new(10_000))).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scenarios_on_redis_standalone() {
    let redis = RedisProcess::start(&[]);
    let store = redis_store(redis.addr(), RedisTopology::Single).await;
    run_table(&Store::Redis(store.clone())).await;
    // Every key written has a TTL.
    for key in redis.cli(&["--scan"]).lines() {
        let ttl: i64 = redis.cli(&["TTL", key]).parse().unwrap();
        assert!(ttl > 0, "{key} has no TTL");
    }
    store.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scenarios_on_redis_cluster() {
    let cluster = RedisCluster::start(false);
    let store = redis_store(cluster.url(), RedisTopology::Cluster).await;
    run_table(&Store::Redis(store.clone())).await;
    store.close().await;
}
