//! Requests that wait for a busy Redis server travel together in one script call, and are still decided
//! one at a time, all-or-nothing, in arrival order: the same answers as the memory store deciding them
//! one after another (limits that count over their limit included), on standalone Redis and on a
//! 3-master Cluster (where one call carries the keys of several hash slots of one server); several
//! replicas on one Redis count every admitted hit once and never more than the limit; an idle store sends
//! each request at once; calls stay within their bounds.

mod common;

use std::{sync::Arc, time::Duration};

use common::{
    now_ms,
    redis::{command_calls, RedisCluster, RedisProcess},
    ALGORITHMS,
};
use futures_util::future::join_all;
use rand::{rngs::SmallRng, Rng, SeedableRng};
use ratelimitd::{
    algorithm::{Algorithm, Params},
    settings::{RedisSettings, RedisTopology},
    store::{Applied, Batch, Check, CounterStore, Deadline, MemoryStore, RedisStore, Role, Store},
};

async fn redis_store(
    url: String,
    topology: RedisTopology,
    tweak: impl FnOnce(&mut RedisSettings),
) -> Arc<RedisStore> {
    let mut settings = RedisSettings {
        url,
        topology,
        timeout: Duration::from_secs(5),
        pool_size: 2,
        ..RedisSettings::default()
    };
    tweak(&mut settings);
    let store = RedisStore::connect(&settings, None, 0, Duration::from_secs(5)).unwrap();
    tokio::time::timeout(Duration::from_secs(20), store.ready())
        .await
        .expect("redis ready in time")
        .unwrap();
    store
}

fn within() -> Deadline {
    Deadline::within(Duration::from_secs(5))
}

/// What a user sees of an answer.
fn view(a: &Applied) -> (bool, Vec<(bool, u64)>) {
    let outcomes = a
        .outcomes
        .iter()
        .map(|o| (o.allowed, o.remaining))
        .collect();
    (a.denied, outcomes)
}

/// A random trace of requests on a few keys: 1 to `max_checks` checks each, mixed roles and costs
/// (now and then the limit, one above it, or 2^64 - 1), consume-on-deny now and then; the limit of key
/// `e` counts over its limit (a budget fed reported usage), so its hits are counted whatever its
/// request's decision, the other checks of its request keeping their all-or-nothing. Windows of a day
/// keep time out of the comparison. Quota checks are now and then further limits of one descriptor.
fn trace(seed: u64, algorithm: Algorithm, requests: usize, max_checks: usize) -> Vec<Batch> {
    let mut rng = SmallRng::seed_from_u64(seed);
    let roles = [Role::Enforce, Role::Enforce, Role::Shadow, Role::Quota];
    (0..requests)
        .map(|_| {
            let mut batch = Batch {
                checks: (0..rng.random_range(1..=max_checks))
                    .map(|_| {
                        let key = ["a", "bb", "c", "dd", "e"][rng.random_range(0..5)];
                        let limit = [4, 7][key.len() % 2];
                        let cost =
                            [0, 1, 1, 1, 2, limit, limit + 1, u64::MAX][rng.random_range(0..8)];
                        Check {
                            key: format!("seed{seed}:{}:{key}_", algorithm.name()),
                            params: Params {
                                algorithm,
                                limit,
                                window_ms: 86_400_000,
                                burst: limit,
                                count_over_limit: key == "e",
                            },
                            cost,
                            role: roles[rng.random_range(0..4)],
                            further_limit: false,
                            per_second: false,
                            reported: false,
                        }
                    })
                    .collect(),
                consume_on_deny: rng.random_bool(0.2),
                known_denied: false,
            };
            // Now and then a quota check is a further limit of the quota descriptor before it.
            for i in 1..batch.checks.len() {
                let quota = |c: &Check| c.role == Role::Quota;
                if quota(&batch.checks[i - 1]) && quota(&batch.checks[i]) && rng.random_bool(0.5) {
                    batch.checks[i].further_limit = true;
                }
            }
            batch
        })
        .collect()
}

/// The trace sent all at once to Redis (so that it queues behind the first call and travels in few
/// calls), against the memory store deciding it one request after another.
async fn same_answers_when_coalesced(redis: &Store, seed: u64, max_checks: usize) {
    for algorithm in ALGORITHMS {
        let trace = trace(seed, algorithm, 200, max_checks);
        let memory = Store::Memory(MemoryStore::new(10_000));
        let mut expected = Vec::new();
        for batch in &trace {
            expected.push(view(
                &memory.apply(batch, now_ms(), within()).await.unwrap(),
            ));
        }
        let now = now_in_one_hour_window();
        let answers = join_all(trace.iter().map(|batch| redis.apply(batch, now, within()))).await;
        for (step, (answer, expected)) in answers.into_iter().zip(expected).enumerate() {
            let answer = view(&answer.expect("the store decides"));
            assert_eq!(
                answer, expected,
                "{algorithm:?} request {step}: {:?}",
                trace[step]
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn coalesced_requests_are_decided_one_at_a_time_in_arrival_order() {
    let redis = RedisProcess::start(&[]);
    let store = redis_store(redis.addr(), RedisTopology::Single, |s| {
        s.calls_in_flight = 1
    })
    .await;
    let before = command_calls(&redis.cli(&["INFO", "commandstats"]), "evalsha");
    same_answers_when_coalesced(&Store::Redis(store.clone()), 11, 3).await;
    let calls = command_calls(&redis.cli(&["INFO", "commandstats"]), "evalsha") - before;
    // 5 algorithms x 200 requests, at most 64 per call: far fewer calls than requests.
    assert!(
        calls < 5 * 200 / 4,
        "{calls} script calls for 1 000 requests"
    );
    store.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_cluster_one_call_carries_the_slots_of_one_server() {
    let cluster = RedisCluster::start(false);
    let store = one_call_at_a_time(&cluster).await;
    let before = cluster.calls("evalsha");
    // One check per request: each request is one part, the parts of many slots share calls.
    same_answers_when_coalesced(&Store::Redis(store.clone()), 12, 1).await;
    let calls = cluster.calls("evalsha") - before;
    assert!(
        calls < 5 * 200 / 4,
        "{calls} script calls for 1 000 requests"
    );
    store.close().await;
}

/// Requests of several checks on a Cluster: a request's checks on one server, whatever their slots,
/// are one part of one call, decided all-or-nothing there; across servers what a denying server's
/// request consumed elsewhere is given back. The decisions, and every counter after them, are the
/// memory store's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_cluster_a_requests_checks_on_one_server_are_decided_together() {
    let cluster = RedisCluster::start(false);
    let store = one_call_at_a_time(&cluster).await;
    let redis = Store::Redis(store.clone());
    for algorithm in ALGORITHMS {
        let trace = trace(13, algorithm, 200, 3);
        let memory = Store::Memory(MemoryStore::new(10_000));
        let mut expected = Vec::new();
        for batch in &trace {
            expected.push(
                memory
                    .apply(batch, now_ms(), within())
                    .await
                    .unwrap()
                    .denied,
            );
        }
        // One after another: a request decided on two servers is not one atomic step, and one sent
        // beside it may see what it consumed on one server before the other's refusal gives it back
        // (a denial more, never an admission more).
        for (step, (batch, denied)) in trace.iter().zip(expected).enumerate() {
            let answer = redis.apply(batch, now_ms(), within()).await;
            let answer = answer.expect("the store decides");
            assert_eq!(answer.denied, denied, "{algorithm:?} request {step}");
        }
        // Every counter holds what the memory store's holds: a probe that costs nothing sees the same
        // quota left on each.
        let mut probed = std::collections::BTreeSet::new();
        for check in trace.iter().flat_map(|b| &b.checks) {
            if !probed.insert(check.key.clone()) {
                continue;
            }
            let probe = Batch {
                checks: vec![Check {
                    cost: 0,
                    role: Role::Enforce,
                    further_limit: false,
                    ..check.clone()
                }],
                ..Batch::default()
            };
            let on_redis = redis.apply(&probe, now_ms(), within()).await.unwrap();
            let on_memory = memory.apply(&probe, now_ms(), within()).await.unwrap();
            assert_eq!(
                view(&on_redis),
                view(&on_memory),
                "{algorithm:?} {}",
                check.key
            );
        }
    }

    // Two counters in different slots of one master: one request on both is one call there.
    let now = now_in_one_hour_window();
    let (a, b) = two_slots_of_master_zero(&cluster, "pair", now);
    let before = cluster.calls("evalsha");
    let both = Batch {
        checks: vec![a.clone(), b.clone()],
        ..Batch::default()
    };
    assert!(!store.apply(&both, now, within()).await.unwrap().denied);
    assert_eq!(
        cluster.calls("evalsha") - before,
        1,
        "one call for two slots"
    );
    store.close().await;
}

/// Three replicas on one Redis send random requests at once: every counter holds exactly the hits the
/// fleet admitted on it, and never more than its limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_sharing_redis_count_each_admitted_hit_once() {
    let redis = RedisProcess::start(&[]);
    let mut fleet = Vec::new();
    for _ in 0..3 {
        fleet.push(
            redis_store(redis.addr(), RedisTopology::Single, |s| {
                s.calls_in_flight = 1
            })
            .await,
        );
    }
    let keys = ["k0", "k1", "k2", "k3"];
    let limit = 150;
    let traces: Vec<Vec<Batch>> = (0..3)
        .map(|replica| {
            let mut rng = SmallRng::seed_from_u64(replica);
            (0..300)
                .map(|_| {
                    let mut picked = keys.to_vec();
                    picked.truncate(rng.random_range(1..=3));
                    Batch {
                        checks: picked
                            .iter()
                            .map(|key| {
                                let cost = rng.random_range(0..=3);
                                Check::fixed_window(
                                    format!("fleet_{key}_"),
                                    limit,
                                    3600,
                                    cost,
                                    Role::Enforce,
                                )
                            })
                            .collect(),
                        consume_on_deny: false,
                        known_denied: false,
                    }
                })
                .collect()
        })
        .collect();
    let now = now_in_one_hour_window();
    let answers = join_all(fleet.iter().zip(&traces).map(|(store, trace)| async move {
        let store = Store::Redis(store.clone());
        join_all(trace.iter().map(|batch| store.apply(batch, now, within()))).await
    }))
    .await;
    let mut admitted = std::collections::BTreeMap::<String, u64>::new();
    for (trace, answers) in traces.iter().zip(answers) {
        for (batch, answer) in trace.iter().zip(answers) {
            let answer = answer.expect("the store decides");
            if !answer.denied {
                for check in &batch.checks {
                    *admitted.entry(check.storage_key(now)).or_default() += check.cost;
                }
            }
        }
    }
    for (key, hits) in admitted {
        let stored: u64 = redis.cli(&["GET", &key]).parse().unwrap_or(0);
        assert_eq!(stored, hits, "{key}: the counter holds what was admitted");
        assert!(stored <= limit, "{key}: {stored} over the limit of {limit}");
    }
    for store in fleet {
        store.close().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_store_sends_each_request_at_once_and_a_busy_one_within_bounds() {
    let redis = RedisProcess::start(&[]);
    let store = redis_store(redis.addr(), RedisTopology::Single, |s| {
        s.calls_in_flight = 1;
        s.batch_max_requests = 4;
    })
    .await;
    let store = Store::Redis(store);
    let batch = |i: usize| Batch {
        checks: vec![Check::fixed_window(
            format!("idle_{i}_"),
            10,
            3600,
            1,
            Role::Enforce,
        )],
        consume_on_deny: false,
        known_denied: false,
    };
    let calls = || command_calls(&redis.cli(&["INFO", "commandstats"]), "evalsha");

    // One after another: nothing waits, so every request is a call of its own, answered at once.
    let before = calls();
    for i in 0..20 {
        let started = std::time::Instant::now();
        assert!(
            !store
                .apply(&batch(i), now_ms(), within())
                .await
                .unwrap()
                .denied
        );
        assert!(
            started.elapsed() < Duration::from_secs(1),
            "no timer holds an idle request"
        );
    }
    assert_eq!(calls() - before, 20);

    // All at once: at most 4 per call.
    let before = calls();
    let trace: Vec<Batch> = (100..200).map(batch).collect();
    let now = now_in_one_hour_window();
    for answer in join_all(trace.iter().map(|b| store.apply(b, now, within()))).await {
        assert!(!answer.unwrap().denied);
    }
    let used = calls() - before;
    assert!(
        (25..100).contains(&used),
        "{used} calls for 100 requests at most 4 per call"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_too_large_to_count_fails_alone() {
    let redis = RedisProcess::start(&[]);
    let store = Store::Redis(
        redis_store(redis.addr(), RedisTopology::Single, |s| {
            s.calls_in_flight = 1
        })
        .await,
    );
    let fine = |i: usize| Batch {
        checks: vec![Check::fixed_window(
            format!("fine_{i}_"),
            10,
            3600,
            1,
            Role::Enforce,
        )],
        consume_on_deny: false,
        known_denied: false,
    };
    let mut huge = fine(999);
    huge.checks[0].params.limit = 1 << 60;
    let mut trace: Vec<Batch> = (0..10).map(fine).collect();
    trace.insert(5, huge);
    let now = now_in_one_hour_window();
    let answers = join_all(trace.iter().map(|b| store.apply(b, now, within()))).await;
    for (i, answer) in answers.into_iter().enumerate() {
        match answer {
            Err(err) if i == 5 => assert!(err.to_string().contains("2^53"), "{err}"),
            Ok(applied) if i != 5 => assert!(!applied.denied),
            other => panic!("request {i}: {other:?}"),
        }
    }
}

/// The owner of a key's slot among the masters, by `CLUSTER SLOTS` ports.
fn owner(cluster: &RedisCluster, slot: u16) -> usize {
    let slots = cluster.masters[0].cli(&["CLUSTER", "SLOTS"]);
    // Lines: start, end, ip, port, id, ... for each range.
    let lines: Vec<&str> = slots.lines().collect();
    for w in lines.windows(4) {
        if let (Ok(start), Ok(end), Ok(port)) = (
            w[0].parse::<u16>(),
            w[1].parse::<u16>(),
            w[3].parse::<u16>(),
        ) {
            if (start..=end).contains(&slot) {
                return cluster.masters.iter().position(|m| m.port == port).unwrap();
            }
        }
    }
    panic!("slot {slot} has no owner: {slots}");
}

/// A store on `cluster` that keeps one call in flight per server, so that requests sent at once queue
/// and share calls.
async fn one_call_at_a_time(cluster: &RedisCluster) -> Arc<RedisStore> {
    redis_store(cluster.url(), RedisTopology::Cluster, |s| {
        s.calls_in_flight = 1
    })
    .await
}

/// The time a test's hour-long counters are named at (their keys carry the window's start), with a
/// minute of the window left at least: Redis counts in the window of its own clock, so a test that
/// crossed into the next hour would look for keys of the last one and find none.
fn now_in_one_hour_window() -> u64 {
    common::wait_for_room_in_the_hour_window();
    now_ms()
}

/// A fixed-window counter of 1 000 an hour, checked at cost 1.
fn counter(name: String) -> Check {
    Check::fixed_window(name, 1_000, 3600, 1, Role::Enforce)
}

/// The hash slot of a counter's key at `now`.
fn slot_of(cluster: &RedisCluster, c: &Check, now: u64) -> u16 {
    cluster.masters[0]
        .cli(&["CLUSTER", "KEYSLOT", &c.storage_key(now)])
        .parse()
        .unwrap()
}

/// Two counters named `{prefix}{i}_`, in different slots of master 0.
fn two_slots_of_master_zero(cluster: &RedisCluster, prefix: &str, now: u64) -> (Check, Check) {
    let mut on_zero = (0..)
        .map(|i| counter(format!("{prefix}{i}_")))
        .filter(|c| owner(cluster, slot_of(cluster, c, now)) == 0);
    let first = on_zero.next().unwrap();
    let slot = slot_of(cluster, &first, now);
    let second = on_zero.find(|c| slot_of(cluster, c, now) != slot).unwrap();
    (first, second)
}

/// Gives the (empty) slot of `c` to master `to`, on every master.
fn move_slot_of(cluster: &RedisCluster, c: &Check, now: u64, to: usize) {
    let slot = slot_of(cluster, c, now).to_string();
    let to_id = cluster.masters[to].cli(&["CLUSTER", "MYID"]);
    for master in &cluster.masters {
        assert_eq!(
            master.cli(&["CLUSTER", "SETSLOT", &slot, "NODE", &to_id]),
            "OK"
        );
    }
}

/// Whether `store` admits `batch` (decided within the test's deadline).
async fn admitted(store: &Store, batch: &Batch, now: u64) -> bool {
    !store.apply(batch, now, within()).await.unwrap().denied
}

/// A request of one counter.
fn one(c: &Check) -> Batch {
    Batch {
        checks: vec![c.clone()],
        ..Batch::default()
    }
}

/// A slot migrating from master 0 to master 1, key by key, as `redis-cli --cluster reshard` moves it.
struct Migration<'a> {
    cluster: &'a RedisCluster,
    slot: String,
    to_id: String,
    now: u64,
}

impl<'a> Migration<'a> {
    fn start(cluster: &'a RedisCluster, slot: u16, now: u64) -> Self {
        let (from, to) = (&cluster.masters[0], &cluster.masters[1]);
        let (from_id, to_id) = (from.cli(&["CLUSTER", "MYID"]), to.cli(&["CLUSTER", "MYID"]));
        let slot = slot.to_string();
        let importing = ["CLUSTER", "SETSLOT", &slot, "IMPORTING", &from_id];
        assert_eq!(to.cli(&importing), "OK");
        let migrating = ["CLUSTER", "SETSLOT", &slot, "MIGRATING", &to_id];
        assert_eq!(from.cli(&migrating), "OK");
        Self {
            cluster,
            slot,
            to_id,
            now,
        }
    }

    /// Moves the key of `c` to master 1.
    fn migrate(&self, c: &Check) {
        let (key, port) = (
            c.storage_key(self.now),
            self.cluster.masters[1].port.to_string(),
        );
        let command = ["MIGRATE", "127.0.0.1", &port, "", "0", "5000", "KEYS", &key];
        assert_eq!(self.cluster.masters[0].cli(&command), "OK");
    }

    /// Gives the slot to master 1, on it first.
    fn end(&self) {
        for master in [1, 0, 2].map(|m| &self.cluster.masters[m]) {
            let node = ["CLUSTER", "SETSLOT", &self.slot, "NODE", &self.to_id];
            assert_eq!(master.cli(&node), "OK");
        }
    }
}

/// A fixed-window counter's count on one server (0 when it holds none).
fn count_on(node: &common::redis::RedisProcess, c: &Check, now: u64) -> u64 {
    node.cli(&["GET", &c.storage_key(now)]).parse().unwrap_or(0)
}

/// After a slot moved to another server, a replica's slot map is stale for a moment: a call carrying keys
/// of several slots of what it thinks is one server is refused before it writes anything (a key is no
/// longer there); its parts then go one slot per call, redirected by the client, and every request is
/// still decided exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_cluster_a_call_refused_after_a_slot_moved_is_sent_again_one_slot_per_call() {
    let cluster = RedisCluster::start(false);
    let store = Store::Redis(one_call_at_a_time(&cluster).await);
    let now = now_in_one_hour_window();
    // Two counters in different slots of master 0.
    let (staying, moving) = two_slots_of_master_zero(&cluster, "mig", now);
    // The replica learns the slot map before the move.
    assert!(admitted(&store, &one(&staying), now).await);
    // The slot (empty: nothing to migrate) now belongs to master 1, everywhere.
    let (from, to) = (&cluster.masters[0], &cluster.masters[1]);
    move_slot_of(&cluster, &moving, now, 1);

    // Requests on both counters at once: the first calls span both slots on master 0, which no longer
    // holds the moving one.
    let trace: Vec<Batch> = (0..120)
        .map(|i| one(if i % 2 == 0 { &staying } else { &moving }))
        .collect();
    for answer in join_all(trace.iter().map(|b| store.apply(b, now, within()))).await {
        assert!(!answer.expect("decided after the move").denied);
    }
    // Refused calls: rejected by a master that no longer holds its declared slot (MOVED), or failed
    // while reading an undeclared key another master holds.
    let refused: u64 = cluster
        .masters
        .iter()
        .map(|m| {
            let stats = m.cli(&["INFO", "commandstats"]);
            let field = |name: &str| -> u64 {
                stats
                    .lines()
                    .find(|l| l.starts_with("cmdstat_evalsha:"))
                    .and_then(|l| l.split(&format!("{name}=")).nth(1))
                    .and_then(|v| v.split(',').next())
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(0)
            };
            field("failed_calls") + field("rejected_calls")
        })
        .sum();
    assert!(refused > 0, "no call spanning slots was refused");
    let count = |node, c| count_on(node, c, now);
    assert_eq!(count(from, &staying), 61);
    assert_eq!(count(to, &moving), 60, "counted once, where the slot went");
}

/// The same with requests that each carry both counters, so that each is one part over two slots of what
/// the replica thinks is one server, and a budget on another server (a limit that counts over its limit,
/// so its hits are never given back): refused, such a part goes again one slot per call, and every
/// request is decided exactly once on each counter, the budget included.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_cluster_a_request_over_slots_of_which_one_moved_is_decided_again_by_slot() {
    let cluster = RedisCluster::start(false);
    let store = Store::Redis(one_call_at_a_time(&cluster).await);
    let now = now_in_one_hour_window();
    let (staying, moving) = two_slots_of_master_zero(&cluster, "both", now);
    let mut budget = (0..)
        .map(|i| counter(format!("budget{i}_")))
        .find(|c| owner(&cluster, slot_of(&cluster, c, now)) == 2)
        .unwrap();
    budget.params.count_over_limit = true;
    let of = |checks: Vec<Check>| Batch {
        checks,
        ..Batch::default()
    };
    // The replica learns the slot map before the move.
    let first = store.apply(&of(vec![staying.clone()]), now, within()).await;
    assert!(!first.unwrap().denied);
    let (from, to) = (&cluster.masters[0], &cluster.masters[1]);
    move_slot_of(&cluster, &moving, now, 1);

    let trace: Vec<Batch> = (0..60)
        .map(|_| of(vec![staying.clone(), moving.clone(), budget.clone()]))
        .collect();
    for answer in join_all(trace.iter().map(|b| store.apply(b, now, within()))).await {
        let answer = answer.expect("decided after the move");
        assert!(!answer.denied);
        assert!(answer.outcomes.iter().all(|o| o.allowed), "{answer:?}");
    }
    let count = |node, c| count_on(node, c, now);
    assert_eq!(count(from, &staying), 61, "counted once each");
    assert_eq!(count(to, &moving), 60, "counted once, where the slot went");
    assert_eq!(count(from, &moving), 0, "nothing left where the slot was");
    assert_eq!(
        count(&cluster.masters[2], &budget),
        60,
        "the budget counted once each"
    );
}

/// While a slot migrates, a key already moved is answered with ASK by its old master: it is decided on
/// the master importing it, the other slots of the old master as usual, and once the slot has moved,
/// on its new master; every hit is counted once, where the key is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_moved_mid_migration_is_decided_on_the_master_importing_it() {
    let cluster = RedisCluster::start(false);
    let store = Store::Redis(redis_store(cluster.url(), RedisTopology::Cluster, |_| {}).await);
    let now = now_in_one_hour_window();
    let (staying, moving) = two_slots_of_master_zero(&cluster, "ask", now);
    for c in [&staying, &moving] {
        assert!(admitted(&store, &one(c), now).await);
    }
    // The slot migrates from master 0 to master 1, and its one key has gone already: master 0 answers ASK.
    let (from, to) = (&cluster.masters[0], &cluster.masters[1]);
    let migration = Migration::start(&cluster, slot_of(&cluster, &moving, now), now);
    migration.migrate(&moving);
    for i in 0..12 {
        // More than the pool's connections: each could have ended one.
        let answer = store.apply(&one(&moving), now, within()).await;
        assert!(
            !answer
                .unwrap_or_else(|e| panic!("request {i} during the migration: {e}"))
                .denied
        );
        let other = store.apply(&one(&staying), now, within()).await;
        assert!(!other.expect("another slot of the server is decided").denied);
    }
    // A request another master denies: what it counted on the moved key is given back there.
    let full = (0..)
        .map(|i| Check::fixed_window(format!("full{i}_"), 1, 3600, 1, Role::Enforce))
        .find(|c| owner(&cluster, slot_of(&cluster, c, now)) == 2)
        .unwrap();
    assert!(admitted(&store, &one(&full), now).await);
    let both = Batch {
        checks: vec![moving.clone(), full.clone()],
        ..Batch::default()
    };
    let denied = store.apply(&both, now, within()).await;
    assert!(denied.expect("decided during the migration").denied);
    migration.end();
    for i in 0..20 {
        let answer = store.apply(&one(&moving), now, within()).await;
        assert!(
            !answer
                .unwrap_or_else(|e| panic!("request {i} after the migration: {e}"))
                .denied
        );
    }
    assert_eq!(
        count_on(to, &moving, now),
        1 + 12 + 20,
        "each hit counted once, the denied request's given back"
    );
    assert_eq!(count_on(from, &staying, now), 13);
}

/// Two counters of one request in one slot, while the slot migrates with one of them moved already:
/// Redis answers TRYAGAIN (keys on both sides). The request waits for the migration, sent again a few
/// milliseconds apart, without holding up the master's other requests (one call in flight per server
/// here), and is decided once the slot has moved, each counter counted once, on its new master.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_whose_slot_is_split_by_a_migration_waits_for_it_alone() {
    let cluster = RedisCluster::start(false);
    let store = Arc::new(Store::Redis(one_call_at_a_time(&cluster).await));
    let now = now_in_one_hour_window();
    // Two counters of master 0 in one slot, and one in another of its slots.
    let mut names = (0..)
        .map(|i| counter(format!("split{i}_")))
        .map(|c| (slot_of(&cluster, &c, now), c));
    let mut seen: Vec<(u16, Check)> = Vec::new();
    let (slot, a, b) = loop {
        let (slot, c) = names.next().unwrap();
        match seen.iter().find(|(s, _)| *s == slot) {
            Some((_, twin)) if owner(&cluster, slot) == 0 => break (slot, twin.clone(), c),
            _ => seen.push((slot, c)),
        }
    };
    let staying = names
        .find(|(s, _)| *s != slot && owner(&cluster, *s) == 0)
        .map(|(_, c)| c)
        .unwrap();
    let both = Batch {
        checks: vec![a.clone(), b.clone()],
        ..Batch::default()
    };
    assert!(admitted(&store, &both, now).await);
    assert!(admitted(&store, &one(&staying), now).await);

    let (from, to) = (&cluster.masters[0], &cluster.masters[1]);
    let migration = Migration::start(&cluster, slot, now);
    migration.migrate(&b);

    // It waits for the migration until its deadline: one long enough for the steps below on a
    // machine busy with the other tests' clusters.
    let waiting = tokio::spawn({
        let (store, both) = (store.clone(), both.clone());
        let deadline = Deadline::within(Duration::from_secs(30));
        async move { store.apply(&both, now, deadline).await }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        !waiting.is_finished(),
        "decided with its keys on both sides"
    );
    for _ in 0..5 {
        let started = std::time::Instant::now();
        let other = store.apply(&one(&staying), now, within()).await;
        assert!(!other.expect("another slot of master 0").denied);
        assert!(
            started.elapsed() < Duration::from_millis(500),
            "held up {:?} behind the waiting request",
            started.elapsed()
        );
    }
    let errors = from.cli(&["INFO", "errorstats"]);
    assert!(
        errors.lines().any(|l| l.starts_with("errorstat_TRYAGAIN:")),
        "master 0 answered TRYAGAIN: {errors}"
    );

    // The migration ends: the request is decided where its slot went.
    migration.migrate(&a);
    migration.end();
    let answer = waiting.await.unwrap().expect("decided after the migration");
    assert!(!answer.denied);
    assert_eq!(
        count_on(to, &a, now),
        2,
        "counted once, where the slot went"
    );
    assert_eq!(count_on(to, &b, now), 2);
    assert_eq!(count_on(from, &staying, now), 6);
}
