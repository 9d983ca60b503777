//! One table of recomputations run on the memory store's shares (Rust, `share::apply`) and on a real
//! redis-server (`share.lua`): every grant, target, version, pool and sum must be the same, so that one
//! replica on memory and a fleet on Redis share a limit alike. Random sequences of subscriptions,
//! reports, pushes, refusals and fixed windows spent by others; then expiry on the server's clock.

mod common;

use std::{sync::Arc, time::Duration};

use common::redis::RedisProcess;
use proptest::{prelude::*, test_runner::TestRunner};
use ratelimitd::{
    clock::Clock,
    quota::{
        share::{Call, DemandUpdate, Given, LimitUse, Listed, Listing, Reply, WindowUse},
        state::{MemoryShares, RedisShares},
        Shares,
    },
    store::{redis::RedisSettings, RedisStore},
};

async fn redis_shares(redis: &RedisProcess) -> Shares {
    let settings = RedisSettings {
        url: redis.addr(),
        ..RedisSettings::default()
    };
    let store = RedisStore::connect(&settings, None, 0, Duration::from_secs(1)).unwrap();
    store.ready().await.unwrap();
    Shares::Redis(RedisShares::new(store))
}

/// One step of a table: who reports (or is pushed), what, and the rule's limits.
#[derive(Debug, Clone)]
struct Step {
    reporter: usize,
    demand: Option<f64>,
    pushed: Vec<usize>,
    rate: f64,
    /// A fixed window spent by others: its number, used, added, elapsed ms, and whether it is of the
    /// long length (the rule changed between reports).
    window: Option<(u64, f64, f64, u64, bool)>,
}

fn step() -> impl Strategy<Value = Step> {
    (
        0usize..6,
        prop::option::weighted(0.8, 0.0f64..400.0),
        prop::collection::vec(0usize..6, 0..4),
        prop::sample::select(vec![50.0, 100.0, 250.5]),
        prop::option::of((
            0u64..3,
            0.0f64..500.0,
            0.0f64..50.0,
            0u64..4_000,
            prop::bool::weighted(0.2),
        )),
    )
        .prop_map(|(reporter, demand, pushed, rate, window)| Step {
            reporter,
            demand,
            pushed,
            rate,
            window,
        })
}

/// The call of `step`; with `hold_ms`, a member that comes down counts at its old grant that long.
fn call(step: &Step, hold_ms: u64) -> Call {
    let mut members = vec![Listed {
        id: format!("m{}", step.reporter),
        demand: match step.demand {
            Some(rate) => DemandUpdate::Rate(rate),
            None => DemandUpdate::Unknown,
        },
        listing: Listing::Reported,
        // Now and then above what the bucket holds, as after the store lost it.
        sent_version: step.pushed.len() as u64 * 4,
    }];
    members.extend(
        step.pushed
            .iter()
            .filter(|p| **p != step.reporter)
            .map(|p| Listed {
                id: format!("m{p}"),
                demand: DemandUpdate::Keep,
                listing: Listing::Pushed,
                sent_version: 0,
            }),
    );
    Call {
        limits: vec![LimitUse {
            rate: step.rate,
            window: step.window.map(|(w, used, added, elapsed, long)| {
                let window_ms = if long { 24_000 } else { 8_000 };
                WindowUse {
                    start_ms: 1_000_000 + w * window_ms,
                    used: used.floor(),
                    added: added.floor(),
                    window_ms,
                    elapsed_ms: elapsed,
                    floor_ms: 200,
                }
            }),
        }],
        counts_for_ms: 600_000,
        hold_ms,
        max_members: 5,
        members,
    }
}

fn same(a: &Reply, b: &Reply) -> Result<(), String> {
    let close = |x: f64, y: f64| (x - y).abs() <= 1e-9 * x.abs().max(y.abs()).max(1.0);
    if a.members != b.members || !close(a.pool, b.pool) || !close(a.granted, b.granted) {
        return Err(format!("{a:?} != {b:?}"));
    }
    for (x, y) in a.given.iter().zip(&b.given) {
        let equal = match (x, y) {
            (
                Given::Share {
                    grant: g1,
                    target: t1,
                    changed: c1,
                    version: v1,
                },
                Given::Share {
                    grant: g2,
                    target: t2,
                    changed: c2,
                    version: v2,
                },
            ) => close(*g1, *g2) && close(*t1, *t2) && c1 == c2 && v1 == v2,
            (x, y) => x == y,
        };
        if !equal {
            return Err(format!("{x:?} != {y:?} in {a:?} / {b:?}"));
        }
    }
    Ok(())
}

/// `call` on the memory store and on the script; their replies, which must be the same.
async fn on_both(
    memory: &Shares,
    script: &Shares,
    key: &str,
    call: &Call,
) -> Result<Reply, String> {
    let m = memory.share(key, call).await.unwrap();
    let r = script.share(key, call).await.unwrap();
    same(&m, &r)?;
    Ok(m)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_script_and_the_memory_store_share_alike() {
    let redis = RedisProcess::start(&[]);
    let shares = Arc::new(redis_shares(&redis).await);
    let mut runner = TestRunner::new(ProptestConfig {
        cases: 48,
        ..ProptestConfig::default()
    });
    let handle = tokio::runtime::Handle::current();
    // No hold, or one that outlasts the table: the memory store's clock stands still, the server's
    // moves on by a few milliseconds.
    let steps = (
        prop::collection::vec(step(), 1..40),
        prop::sample::select(vec![0u64, 600_000]),
    );
    let case = std::sync::atomic::AtomicU32::new(0);
    let result = tokio::task::block_in_place(|| {
        runner.run(&steps, |(steps, hold_ms)| {
            let n = case.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let key = format!("{{table_{n}}}:rlqs");
            let memory = Shares::Memory(MemoryShares::new(Clock::manual(1_000_000), 1_000_000));
            for (i, step) in steps.iter().enumerate() {
                let c = call(step, hold_ms);
                handle
                    .block_on(on_both(&memory, &shares, &key, &c))
                    .map_err(|e| TestCaseError::fail(format!("step {i} {step:?}: {e}")))?;
            }
            Ok(())
        })
    });
    result.unwrap();
}

#[tokio::test]
async fn members_expire_on_the_servers_clock_and_their_grant_goes_back() {
    let redis = RedisProcess::start(&[]);
    let shares = redis_shares(&redis).await;
    let report = |id: &str, rate: f64, counts_for_ms: u64| Call {
        limits: vec![LimitUse {
            rate: 100.0,
            window: None,
        }],
        counts_for_ms,
        hold_ms: 100,
        max_members: 10,
        members: vec![Listed {
            id: id.into(),
            demand: DemandUpdate::Rate(rate),
            listing: Listing::Reported,
            sent_version: 0,
        }],
    };
    let key = "{expiry}:rlqs";
    shares.share(key, &report("a", 500.0, 300)).await.unwrap();
    let b = shares
        .share(key, &report("b", 500.0, 60_000))
        .await
        .unwrap();
    assert_eq!(b.members, 2);
    let Given::Share { grant, .. } = b.given[0] else {
        panic!("{b:?}")
    };
    assert_eq!(
        grant, 3.125,
        "a holds all but the reserve: b gets half of it"
    );
    tokio::time::sleep(Duration::from_millis(400)).await;
    let b = shares
        .share(key, &report("b", 500.0, 60_000))
        .await
        .unwrap();
    assert_eq!(b.members, 1, "a expired");
    assert!(
        matches!(b.given[0], Given::Share { grant, .. } if grant == 93.75),
        "{b:?}"
    );
    // The key expires with its last member.
    let ttl: i64 = redis.cli(&["PTTL", key]).parse().unwrap();
    assert!(ttl > 50_000 && ttl <= 60_000, "{ttl}");
}

/// A report in a bucket of a thousand members writes what changed, not the thousand: the members listed
/// for a push whose grant stays are not written again (`HSET` calls counted by the server itself).
#[tokio::test]
async fn a_call_writes_only_the_members_whose_fields_changed() {
    let redis = RedisProcess::start(&[]);
    let shares = redis_shares(&redis).await;
    let key = "{large}:rlqs";
    let listed = |id: usize, demand: DemandUpdate, listing: Listing| Listed {
        id: format!("m{id:04}"),
        demand,
        listing,
        sent_version: 0,
    };
    let call = |members: Vec<Listed>| Call {
        limits: vec![LimitUse {
            rate: 10_000.0,
            window: None,
        }],
        counts_for_ms: 600_000,
        hold_ms: 0,
        max_members: 2_000,
        members,
    };
    for id in 0..1_000 {
        let report = call(vec![listed(id, DemandUpdate::Rate(5.0), Listing::Reported)]);
        shares.share(key, &report).await.unwrap();
    }
    // Everyone listed: the ones above their share come down, and from the next call on the ones below
    // go up out of what was freed; then it is stable.
    let everyone = || {
        let mut members = vec![listed(0, DemandUpdate::Rate(5.0), Listing::Reported)];
        members.extend((1..1_000).map(|id| listed(id, DemandUpdate::Keep, Listing::Pushed)));
        call(members)
    };
    for _ in 0..2 {
        shares.share(key, &everyone()).await.unwrap();
    }
    redis.cli(&["CONFIG", "RESETSTAT"]);
    let reply = shares.share(key, &everyone()).await.unwrap();
    assert_eq!(reply.members, 1_000);
    let changed = reply
        .given
        .iter()
        .filter(|g| matches!(g, Given::Share { changed: true, .. }))
        .count();
    let info = redis.cli(&["INFO", "commandstats"]);
    let writes = common::redis::command_calls(&info, "hset");
    eprintln!("a call listing 1 000 members of 1 000: {changed} grants changed, {writes} HSET");
    // The reporter (its version and expiry move at every answer) and the ones whose grant changed.
    assert_eq!(writes, 1 + changed as u64, "{info}");
    assert!(changed < 10, "{changed} grants changed");
}

/// The Redis server's clock, in milliseconds since the epoch.
fn server_ms(redis: &RedisProcess) -> u64 {
    let time = redis.cli(&["TIME"]);
    let mut parts = time.split_whitespace().map(|p| p.parse::<u64>().unwrap());
    let (secs, micros) = (parts.next().unwrap(), parts.next().unwrap());
    secs * 1_000 + micros / 1_000
}

/// Expiry alike with time moving: members expire between calls, on the Redis server's clock for the
/// script and on a clock set to it before each call for the memory store. Calls are spaced by whole
/// tenths of a second and assignments count for a quarter of one second more, so that no call falls
/// within milliseconds of an expiry.
#[tokio::test]
async fn the_script_and_the_memory_store_expire_members_alike() {
    let redis = RedisProcess::start(&[]);
    let shares = redis_shares(&redis).await;
    let server_ms = || server_ms(&redis);
    let clock = Clock::manual(server_ms());
    let memory = Shares::Memory(MemoryShares::new(clock.clone(), 1_000_000));
    let key = "{moving}:rlqs";
    // (reporter, demand, pushed, tenths of a second to wait before the call)
    let table: &[(usize, Option<f64>, &[usize], u64)] = &[
        (0, None, &[], 0),
        (1, Some(80.0), &[0], 1),
        (2, Some(300.0), &[0, 1], 1),
        (0, Some(20.0), &[1, 2], 1),
        // 0.3 s on, everyone has expired: 3 is alone, and the push to 0 finds it gone.
        (3, None, &[0], 3),
        (0, Some(40.0), &[3], 1),
        (1, Some(500.0), &[0, 3], 2),
        // 0 (counted 0.3 s before) expires, 1 (0.2 s) does not.
        (2, Some(10.0), &[1], 2),
        (1, Some(500.0), &[2], 1),
        (4, None, &[1, 2], 5),
    ];
    // Each call at its planned time from the first: the time each step takes does not add up.
    let (start, mut tenths) = (tokio::time::Instant::now(), 0);
    for (i, (reporter, demand, pushed, wait)) in table.iter().enumerate() {
        tenths += wait;
        tokio::time::sleep_until(start + Duration::from_millis(100 * tenths)).await;
        let mut members = vec![Listed {
            id: format!("m{reporter}"),
            demand: match demand {
                Some(rate) => DemandUpdate::Rate(*rate),
                None => DemandUpdate::Unknown,
            },
            listing: Listing::Reported,
            sent_version: 0,
        }];
        members.extend(pushed.iter().map(|p| Listed {
            id: format!("m{p}"),
            demand: DemandUpdate::Keep,
            listing: Listing::Pushed,
            sent_version: 0,
        }));
        let call = Call {
            limits: vec![LimitUse {
                rate: 100.0,
                window: None,
            }],
            counts_for_ms: 250,
            hold_ms: 150,
            max_members: 10,
            members,
        };
        let now = server_ms();
        clock.advance_millis(now.saturating_sub(clock.now_millis()));
        let m = on_both(&memory, &shares, key, &call)
            .await
            .unwrap_or_else(|e| panic!("step {i}: {e}"));
        if i == 4 {
            assert_eq!(m.members, 1, "step {i}: the others expired: {m:?}");
            assert_eq!(m.given[1], Given::Gone, "{m:?}");
        }
    }
}

/// Holds run out alike on the server's clock: a member comes down twice, first in a call that holds it
/// for 2 s, then in one that holds for 50 ms (a replica with a shorter report period). It stays held for
/// the 2 s, so another member is not raised out of its old share until then, by the script as by the
/// memory store.
#[tokio::test]
async fn the_script_and_the_memory_store_end_holds_alike() {
    let redis = RedisProcess::start(&[]);
    let shares = redis_shares(&redis).await;
    let clock = Clock::manual(server_ms(&redis));
    let memory = Shares::Memory(MemoryShares::new(clock.clone(), 1_000_000));
    let key = "{held}:rlqs";
    // (member, demand, hold in ms, ms to wait before the call)
    let table: &[(&str, Option<f64>, u64, u64)] = &[
        ("a", None, 0, 0),
        ("b", None, 0, 0),
        ("a", Some(40.0), 2_000, 0),
        ("a", Some(1.0), 50, 100),
        ("b", Some(500.0), 50, 400),
        ("b", Some(500.0), 50, 1_700),
    ];
    let mut grants = Vec::new();
    for (i, (member, demand, hold_ms, wait)) in table.iter().enumerate() {
        tokio::time::sleep(Duration::from_millis(*wait)).await;
        let call = Call {
            limits: vec![LimitUse {
                rate: 100.0,
                window: None,
            }],
            counts_for_ms: 60_000,
            hold_ms: *hold_ms,
            max_members: 10,
            members: vec![Listed {
                id: member.to_string(),
                demand: demand.map_or(DemandUpdate::Unknown, DemandUpdate::Rate),
                listing: Listing::Reported,
                sent_version: 0,
            }],
        };
        let now = server_ms(&redis);
        clock.advance_millis(now.saturating_sub(clock.now_millis()));
        let m = on_both(&memory, &shares, key, &call)
            .await
            .unwrap_or_else(|e| panic!("step {i}: {e}"));
        let Given::Share { grant, .. } = m.given[0] else {
            panic!("step {i}: {m:?}")
        };
        grants.push(grant);
    }
    // a came down from all but the reserve; b kept what it had while a was held, and took a's old share
    // once the first hold was over.
    assert!(grants[0] == 93.75 && grants[3] < 20.0, "{grants:?}");
    assert_eq!(grants[4], grants[1], "{grants:?}");
    assert!(grants[5] > 60.0, "{grants:?}");
}

/// The memory store holds at most its bound of members over all its buckets: past it a newcomer is refused
/// as by a full bucket, whatever bucket it asks for, while members already held go on.
#[tokio::test]
async fn the_memory_store_holds_a_bounded_number_of_members_over_all_buckets() {
    let memory = Shares::Memory(MemoryShares::new(Clock::manual(1_000_000), 3));
    let report = |id: &str| Call {
        limits: vec![LimitUse {
            rate: 100.0,
            window: None,
        }],
        counts_for_ms: 60_000,
        hold_ms: 0,
        max_members: 10,
        members: vec![Listed {
            id: id.into(),
            demand: DemandUpdate::Rate(10.0),
            listing: Listing::Reported,
            sent_version: 0,
        }],
    };
    for (bucket, id) in [("x", "a"), ("x", "b"), ("y", "c")] {
        let reply = memory.share(bucket, &report(id)).await.unwrap();
        assert!(
            matches!(reply.given[0], Given::Share { .. }),
            "{id}: {reply:?}"
        );
    }
    for (bucket, id) in [("y", "d"), ("z", "e")] {
        let reply = memory.share(bucket, &report(id)).await.unwrap();
        assert_eq!(reply.given, vec![Given::Full], "{id}");
    }
    let again = memory.share("x", &report("a")).await.unwrap();
    assert!(matches!(again.given[0], Given::Share { .. }), "{again:?}");
}
