//! Heap allocations on the hot path, counted by a global allocator: a decision on a counter that
//! already exists should cost a handful of allocations, not one per string it touches.

mod common;

use std::{
    alloc::{GlobalAlloc, Layout, System},
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc,
    },
};

use ratelimitd::{
    clock::Clock,
    limiter::{Descriptor, Entry, Limiter, Options, Request},
    rules::{parse_file, RuleSet, Rules},
    settings::{RedisSettings, RedisTopology},
    store::{DenyCache, MemoryStore, RedisStore, Store},
};

struct Counting;

static COUNTING: AtomicBool = AtomicBool::new(false);
static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if COUNTING.load(Ordering::Relaxed) {
            ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        }
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if COUNTING.load(Ordering::Relaxed) {
            ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        }
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

const RULES: &str = r#"
domain: edge
descriptors:
  - key: remote_address
    descriptors:
      - key: path
        value: /login
        descriptors:
          - key: method
            value: POST
            rate_limit: {unit: minute, requests_per_unit: 1000000}
  - key: user
    rate_limit: {unit: hour, requests_per_unit: 1}
"#;

fn limiter(deny_cache: bool) -> Limiter {
    limiter_on(Store::Memory(MemoryStore::new(1_000)), deny_cache)
}

fn limiter_on(store: Store, deny_cache: bool) -> Limiter {
    let rules = Rules::default();
    rules.replace(
        RuleSet::build(&[("edge.yaml".into(), parse_file(RULES).unwrap())], false).unwrap(),
    );
    Limiter::new(
        Arc::new(rules),
        Arc::new(store),
        Clock::System,
        Options {
            deny_cache: deny_cache.then(|| Arc::new(DenyCache::new(1_000))),
            ..Options::default()
        },
    )
}

fn request(pairs: &[(&str, &str)]) -> Request {
    Request {
        domain: "edge".into(),
        descriptors: vec![Descriptor {
            entries: pairs
                .iter()
                .map(|(k, v)| Entry {
                    key: k.to_string(),
                    value: v.to_string(),
                })
                .collect(),
            ..Descriptor::default()
        }],
        hits_addend: 0,
    }
}

/// Allocations of one decision of `request`, after a first one created its counters.
fn allocations_per_decision(limiter: &Limiter, request: &Request) -> u64 {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    allocations_per_decision_in(&runtime, limiter, request)
}

fn allocations_per_decision_in(
    runtime: &tokio::runtime::Runtime,
    limiter: &Limiter,
    request: &Request,
) -> u64 {
    // Pinned here, not handed to `block_on` whole: in a debug build it boxes a future of more than 2 KB,
    // an allocation of this test's own that would count as the decision's.
    let decide = || {
        let mut decision = std::pin::pin!(limiter.should_rate_limit(request));
        runtime.block_on(decision.as_mut()).unwrap();
    };
    decide();
    const ROUNDS: u64 = 100;
    ALLOCATIONS.store(0, Ordering::SeqCst);
    COUNTING.store(true, Ordering::SeqCst);
    for _ in 0..ROUNDS {
        decide();
    }
    COUNTING.store(false, Ordering::SeqCst);
    ALLOCATIONS.load(Ordering::SeqCst) / ROUNDS
}

#[test]
fn allocations_per_decision_stay_small() {
    // One test, so no other test's allocations are counted meanwhile.
    let allowed = allocations_per_decision(
        &limiter(false),
        &request(&[
            ("remote_address", "203.0.113.7"),
            ("path", "/login"),
            ("method", "POST"),
        ]),
    );
    let denied_cached = allocations_per_decision(&limiter(true), &request(&[("user", "alice")]));
    eprintln!(
        "allocations per decision: allowed {allowed}, denied from the deny cache {denied_cached}"
    );
    // What is left: the store's outcomes and the response's statuses (the batch and its counter keys
    // reuse what the decisions before them left on the thread).
    assert!(
        allowed <= 2,
        "an allowed decision allocated {allowed} times"
    );
    assert!(
        denied_cached <= 2,
        "a decision answered by the deny cache allocated {denied_cached} times"
    );

    // On Redis: the limiter's part as above, the script call, and the client's own work (counted
    // too: it runs on the same thread).
    let redis = common::redis::RedisProcess::start(&[]);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let store = runtime.block_on(async {
        let settings = RedisSettings {
            url: redis.addr(),
            topology: RedisTopology::Single,
            pool_size: 1,
            // Every decision a script call: with leases, the same counter hit again and again would
            // soon be answered from a lease, without Redis.
            lease_after: 0,
            ..RedisSettings::default()
        };
        let store =
            RedisStore::connect(&settings, None, 0, std::time::Duration::from_secs(1)).unwrap();
        store.ready().await.unwrap();
        store
    });
    let on_redis_limiter = limiter_on(Store::Redis(store), false);
    let login = |address: &str| {
        request(&[
            ("remote_address", address),
            ("path", "/login"),
            ("method", "POST"),
        ])
    };
    let on_redis = allocations_per_decision_in(&runtime, &on_redis_limiter, &login("203.0.113.7"));
    // Five descriptors, five counters: what grows with the checks is their keys.
    let mut five = login("203.0.113.7");
    for i in 1..5 {
        let more = login(&format!("203.0.113.{}", 7 + i));
        five.descriptors.extend(more.descriptors);
    }
    let on_redis_five = allocations_per_decision_in(&runtime, &on_redis_limiter, &five);
    eprintln!("allocations per decision on Redis: {on_redis}; with 5 descriptors {on_redis_five}");
    // Besides the limiter's: the request's boxed state, its storage keys (one buffer and its shared
    // handle), the request's part, its room for answers and its channel, the call (its arguments, and
    // fred's command, frame and reply), the task that sends it and its boxed command: 26 when this was
    // written. Here every call carries one request and finds the server idle, so it spawns the task
    // that sends it; under load a call's own allocations are shared by all it carries.
    assert!(
        on_redis <= 28,
        "a decision on Redis allocated {on_redis} times"
    );
    // Further checks share the first one's allocations: their keys go in the same buffer, their
    // indexes and answers in the same vectors (27 for five when this was written).
    assert!(
        on_redis_five <= on_redis + 2,
        "a decision of 5 descriptors on Redis allocated {on_redis_five} times ({on_redis} for one)"
    );
}
