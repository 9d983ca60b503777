//! decide.lua refuses a malformed call before it reads or writes anything: every integer must be a
//! whole number from 0 to 2^53, every index must name something the call carries, every count must fit
//! in what follows. A call the client could never send (the client checks numbers itself) still cannot
//! corrupt a counter.

mod common;

use common::redis::RedisProcess;

const DECIDE: &str = include_str!("../src/store/redis/decide.lua");

/// One fixed-window request on `key`, as the client lays it out: jitter, 1 key, 1 read group ending at
/// key 1, 1 spec (fixed window, limit 10, a minute, burst 10, window start, enforce), 1 request (complete)
/// with 1 check (key 1, spec 1, cost 1), no leases, no returns.
fn good_args(window_start: u64) -> Vec<String> {
    [
        0,
        1,
        1,
        1,
        1,
        0,
        10,
        60_000,
        10,
        window_start,
        0,
        1,
        1,
        1,
        1,
        1,
        1,
        0,
        0,
    ]
    .iter()
    .map(u64::to_string)
    .collect()
}

fn call(redis: &RedisProcess, sha: &str, key: &str, args: &[String]) -> String {
    let mut all = vec!["EVALSHA", sha, "1", key];
    all.extend(args.iter().map(String::as_str));
    redis.cli(&all)
}

#[test]
fn malformed_calls_are_refused_before_anything_is_written() {
    let redis = RedisProcess::start(&[]);
    let sha = redis.cli(&["SCRIPT", "LOAD", DECIDE]);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let start = now - now % 60;
    let key = format!("contract_k_{start}");
    let good = good_args(start);
    // A well-formed call decides: allowed, 9 left.
    let reply = call(&redis, &sha, &key, &good);
    assert!(reply.contains("\n0\n0\n1\n9\n"), "{reply:?}");
    assert_eq!(redis.cli(&["GET", &key]), "1");

    let with = |i: usize, v: &str| {
        let mut args = good.clone();
        args[i] = v.to_string();
        args
    };
    let cases: Vec<(&str, Vec<String>)> = vec![
        ("a fraction", with(12, "1.5")),
        ("a negative cost", with(16, "-1")),
        ("above 2^53", with(6, "1152921504606846976")),
        ("not a number", with(7, "minute")),
        ("an unknown algorithm", with(5, "9")),
        ("an unknown role", with(10, "3")),
        ("a key index past the keys", with(14, "2")),
        ("a spec index past the specs", with(15, "2")),
        ("a request flag out of range", with(12, "3")),
        ("a count past the call's end", with(13, "1000000")),
        ("arguments left over", {
            let mut args = good.clone();
            args.push("0".into());
            args
        }),
        ("a call that ends early", good[..good.len() - 2].to_vec()),
    ];
    for (what, args) in cases {
        let reply = call(&redis, &sha, &key, &args);
        assert!(
            reply.starts_with("ERR") || reply.contains("ratelimitd:"),
            "{what}: {reply:?}"
        );
        assert_eq!(redis.cli(&["GET", &key]), "1", "{what} changed the counter");
        assert_eq!(redis.cli(&["DBSIZE"]), "1", "{what} wrote a key");
    }
}
