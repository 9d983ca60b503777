//! decide.lua refuses a malformed call before it reads or writes anything: every integer must be a
//! whole number from 0 to 2^53, every index must name something the call carries, every count must fit
//! in what follows. A call the client could never send (the client checks numbers itself) still cannot
//! corrupt a counter. And leased hits a call gives back are taken off the window they were counted in.

mod common;

use common::redis::RedisProcess;

const DECIDE: &str = include_str!("../src/store/redis/decide.lua");

/// One fixed-window request on `key`, as the client lays it out: jitter, 1 key, 1 read group ending at
/// key 1, 1 spec (fixed window, limit 10, a minute, burst 10, window start, enforce, not counting over
/// its limit, no debt), 1 request (complete)
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
        0,
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

/// A Redis with decide.lua loaded: the server, the script's SHA, and the start (s) of this minute's window.
fn loaded() -> (RedisProcess, String, u64) {
    let redis = RedisProcess::start(&[]);
    let sha = redis.cli(&["SCRIPT", "LOAD", DECIDE]);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    (redis, sha, now - now % 60)
}

#[test]
fn malformed_calls_are_refused_before_anything_is_written() {
    let (redis, sha, start) = loaded();
    let key = format!("contract_k_{start}");
    let good = good_args(start);
    // A well-formed call decides: server time, then decided, not denied, and the fixed window's one
    // number, allowed with 9 left (9 + 1).
    let reply = call(&redis, &sha, &key, &good);
    assert!(reply.ends_with("\n0\n0\n10"), "{reply:?}");
    assert_eq!(redis.cli(&["GET", &key]), "1");

    let with = |i: usize, v: &str| {
        let mut args = good.clone();
        args[i] = v.to_string();
        args
    };
    let cases: Vec<(&str, Vec<String>)> = vec![
        ("a fraction", with(14, "1.5")),
        ("a negative cost", with(18, "-1")),
        ("above 2^53", with(6, "1152921504606846976")),
        ("not a number", with(7, "minute")),
        ("an unknown algorithm", with(5, "9")),
        ("an unknown role", with(10, "4")),
        ("a count-over-limit flag other than 0 or 1", with(11, "2")),
        ("a negative debt", with(12, "-1")),
        ("a key index past the keys", with(16, "2")),
        ("a spec index past the specs", with(17, "2")),
        ("a request flag out of range", with(14, "3")),
        ("a count past the call's end", with(15, "1000000")),
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

/// Leased hits of a sliding window given back after its window ended are taken off the window they
/// were counted in, found by the grant's time: the state's current count while it is still in that
/// window, its previous one once requests have moved it on to the next; never the new window's count,
/// nor the one before the grant's.
#[test]
fn a_sliding_window_gets_leased_hits_back_in_the_window_they_were_counted_in() {
    let (redis, sha, _) = loaded();
    const DAY_MS: u64 = 86_400_000;
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let today = now_ms - now_ms % DAY_MS;
    let yesterday = today - DAY_MS;
    // No request, no lease wanted, one return: key 1, spec 1 (sliding window, 100 a day), 4 hits,
    // granted yesterday at noon.
    let give_back: Vec<String> = [
        0, 1, 1, 1, 1, 1, 100, DAY_MS, 100, 0, 0, 0, 0, 0, 0, 1, 1, 1, 4,
    ]
    .iter()
    .copied()
    .chain([yesterday + DAY_MS / 2])
    .map(|n| n.to_string())
    .collect();
    let state = |key: &str| redis.cli(&["HMGET", key, "s", "c", "p"]);
    let cases = [
        // Not moved on since the grant (no request today yet): yesterday's own count.
        ("still", yesterday, (10, 5), (6, 5)),
        // Moved on to today by a request: yesterday's count is now the previous one.
        ("moved", today, (3, 10), (3, 6)),
    ];
    for (name, start, (current, previous), want) in cases {
        let key = format!("contract_sliding_{name}");
        redis.cli(&[
            "HSET",
            &key,
            "s",
            &start.to_string(),
            "c",
            &current.to_string(),
            "p",
            &previous.to_string(),
        ]);
        call(&redis, &sha, &key, &give_back);
        assert_eq!(
            state(&key),
            format!("{start}\n{}\n{}", want.0, want.1),
            "{name}"
        );
    }
}

/// A lease asked for beside a check of cost 0 (which counts nothing, so leaves the state as read) is not
/// granted, and the call is answered: on a sliding window that holds nothing, the grant used to read a
/// state that was not there and failed the whole call (every request it carried); on one whose state is
/// in a window that has passed, it was added to that window's count.
#[test]
fn a_check_of_cost_0_is_granted_no_lease() {
    let (redis, sha, _) = loaded();
    const DAY_MS: u64 = 86_400_000;
    // One request with one check: key 1, spec 1 (sliding window, 1 000 000 a day), cost 0; a lease of
    // 100 wanted for that check; no returns.
    let args: Vec<String> = [
        0, 1, 1, 1, 1, 1, 1_000_000, DAY_MS, 1_000_000, 0, 0, 0, 0, 1, 1, 1, 1, 1, 0, 1, 1, 100, 0,
    ]
    .iter()
    .map(u64::to_string)
    .collect();
    let reply = call(&redis, &sha, "contract_lease_absent", &args);
    assert!(!reply.contains("ERR"), "{reply}");
    assert_eq!(reply.lines().last(), Some("0"), "a lease granted: {reply}");
    assert_eq!(redis.cli(&["EXISTS", "contract_lease_absent"]), "0");

    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let yesterday = (now_ms - now_ms % DAY_MS - DAY_MS).to_string();
    let key = "contract_lease_stale";
    redis.cli(&["HSET", key, "s", &yesterday, "c", "1", "p", "0"]);
    let reply = call(&redis, &sha, key, &args);
    assert_eq!(reply.lines().last(), Some("0"), "a lease granted: {reply}");
    assert_eq!(
        redis.cli(&["HMGET", key, "s", "c", "p"]),
        format!("{yesterday}\n1\n0"),
        "the passed window's count changed"
    );
}

/// msgpack, written here by the format's rules (not by the client's own writer): an array of integers,
/// each in its shortest form, or any element given as raw bytes.
fn msgpack(elements: &[Element]) -> Vec<u8> {
    let mut out = Vec::new();
    match elements.len() {
        n @ 0..=15 => out.push(0x90 | n as u8),
        n => {
            out.push(0xdc);
            out.extend_from_slice(&(n as u16).to_be_bytes());
        }
    }
    for e in elements {
        match *e {
            Element::Int(v) if (0..=0x7f).contains(&v) => out.push(v as u8),
            Element::Int(v) if v >= 0 => {
                out.push(0xcf);
                out.extend_from_slice(&(v as u64).to_be_bytes());
            }
            Element::Int(v) => {
                out.push(0xd3);
                out.extend_from_slice(&v.to_be_bytes());
            }
            Element::Raw(bytes) => out.extend_from_slice(bytes),
        }
    }
    out
}

#[derive(Clone, Copy)]
enum Element {
    Int(i64),
    Raw(&'static [u8]),
}

/// EVALSHA with binary arguments, over RESP on a plain socket (redis-cli cannot pass a NUL byte): the
/// reply's bytes, read until Redis has sent nothing more for 200 ms.
fn call_raw(port: u16, sha: &str, key: &str, args: &[&[u8]]) -> Vec<u8> {
    use std::io::{Read, Write};
    let mut parts: Vec<&[u8]> = vec![b"EVALSHA", sha.as_bytes(), b"1", key.as_bytes()];
    parts.extend_from_slice(args);
    let mut command = format!("*{}\r\n", parts.len()).into_bytes();
    for part in parts {
        command.extend_from_slice(format!("${}\r\n", part.len()).as_bytes());
        command.extend_from_slice(part);
        command.extend_from_slice(b"\r\n");
    }
    let mut conn = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    conn.write_all(&command).unwrap();
    conn.set_read_timeout(Some(std::time::Duration::from_millis(200)))
        .unwrap();
    let mut reply = Vec::new();
    let mut buf = [0u8; 4096];
    while let Ok(n) = conn.read(&mut buf) {
        if n == 0 {
            break;
        }
        reply.extend_from_slice(&buf[..n]);
    }
    reply
}

/// A packed call's reply: one RESP bulk string holding a msgpack array of non-negative integers, read
/// here by the format's rules (the forms Redis's cmsgpack writes for them).
fn unpacked(reply: &[u8]) -> Vec<u64> {
    let text = String::from_utf8_lossy(reply);
    let header = reply
        .iter()
        .position(|&b| b == b'\n')
        .expect("a RESP header");
    assert!(reply.starts_with(b"$"), "not a bulk string: {text:?}");
    let len: usize = text[1..header - 1].parse().unwrap();
    let body = &reply[header + 1..header + 1 + len];
    let be = |at: usize, n: usize| {
        body[at..at + n]
            .iter()
            .fold(0u64, |v, &b| (v << 8) | u64::from(b))
    };
    let (n, mut at) = match body[0] {
        m @ 0x90..=0x9f => (usize::from(m & 0x0f), 1),
        0xdc => (be(1, 2) as usize, 3),
        m => panic!("not an array: {m:#x}"),
    };
    let mut out = Vec::new();
    for _ in 0..n {
        let (v, width) = match body[at] {
            m @ 0..=0x7f => (u64::from(m), 0),
            0xcc => (be(at + 1, 1), 1),
            0xcd => (be(at + 1, 2), 2),
            0xce => (be(at + 1, 4), 4),
            0xcf => (be(at + 1, 8), 8),
            m => panic!("not a non-negative integer: {m:#x}"),
        };
        out.push(v);
        at += 1 + width;
    }
    assert_eq!(at, len, "bytes left over in {text:?}");
    out
}

#[test]
fn packed_integers_decide_as_decimal_ones_and_are_refused_alike() {
    let (redis, sha, start) = loaded();
    let good: Vec<Element> = good_args(start)
        .iter()
        .map(|v| Element::Int(v.parse().unwrap()))
        .collect();
    // The same call as decimals and packed, on two keys: the same answer, the same counter.
    let decimal = call(
        &redis,
        &sha,
        &format!("contract_d_{start}"),
        &good_args(start),
    );
    let packed_key = format!("contract_p_{start}");
    // A packed call is answered packed, with what the decimal call answers.
    let reply = unpacked(&call_raw(redis.port, &sha, &packed_key, &[&msgpack(&good)]));
    let decimal: Vec<u64> = decimal.lines().map(|l| l.parse().unwrap()).collect();
    // Server time; decided, not denied; the fixed window's one number: allowed, 9 left (9 + 1).
    for answer in [&reply, &decimal] {
        assert_eq!(answer.len(), 4, "{answer:?}");
        assert_eq!(answer[1..], [0, 0, 10], "{answer:?}");
    }
    assert_eq!(redis.cli(&["GET", &packed_key]), "1");

    let with = |i: usize, e: Element| {
        let mut args = good.clone();
        args[i] = e;
        msgpack(&args)
    };
    let cases: Vec<(&str, Vec<u8>)> = vec![
        (
            "a fraction (a msgpack double)",
            with(14, Element::Raw(&[0xcb, 0x3f, 0xf8, 0, 0, 0, 0, 0, 0])),
        ),
        ("a negative cost", with(18, Element::Int(-1))),
        ("above 2^53", with(6, Element::Int(1 << 60))),
        (
            "a string that is no number",
            with(7, Element::Raw(&[0xa6, b'm', b'i', b'n', b'u', b't', b'e'])),
        ),
        ("nil", with(15, Element::Raw(&[0xc0]))),
        (
            "an array in place of a number",
            with(16, Element::Raw(&[0x91, 0x01])),
        ),
        ("a key index past the keys", with(16, Element::Int(2))),
        (
            "a count past the call's end",
            with(15, Element::Int(1_000_000)),
        ),
        ("more keys counted than given", with(1, Element::Int(2))),
        ("a call that ends early", msgpack(&good[..good.len() - 2])),
        ("a truncated array", msgpack(&good)[..10].to_vec()),
    ];
    for (what, blob) in cases {
        let reply = String::from_utf8_lossy(&call_raw(redis.port, &sha, &packed_key, &[&blob]))
            .into_owned();
        assert!(
            reply.starts_with('-') && reply.contains("ratelimitd"),
            "{what}: {reply:?}"
        );
        assert_eq!(
            redis.cli(&["GET", &packed_key]),
            "1",
            "{what} changed the counter"
        );
        assert_eq!(redis.cli(&["DBSIZE"]), "2", "{what} wrote a key");
    }
}
