//! The calling contract of `decide.lua` and `refund.lua`, as their headers state it: the keys and
//! arguments of a call, the codes inside them, and what a reply means. A change to a script's header is
//! a change here, and the other way round.
//!
//! A decide call carries one or more [`Part`]s: the checks of one request that one server decides (all
//! of a request's checks outside Cluster, those on one server on it, of one or more hash slots). The script decides the parts in
//! order, each all-or-nothing, and answers each with its own [`PartReply`].
//!
//! A check may ask for a quota lease (see `lease`): the script grants it with the request's own call, and
//! a call may give leased hits back ([`Return`]).
//!
//! Every number crosses as an integer; the scripts refuse anything outside 0 to 2^53 before they read or
//! write, and a part refuses to be built with one (so that one request can never spoil a call it shares
//! with others). Costs arrive already bounded (see [`Check::bounded_cost`]).

use std::collections::HashMap;

use bytes::Bytes;
use fred::types::{Key, Value};
use smallvec::SmallVec;

use super::{
    super::{Batch, Check, Outcome, Role, StoreError},
    coalesce::Unheld,
};
use crate::algorithm::{Algorithm, Decision};

pub const DECIDE_LUA: &str = include_str!("decide.lua");
pub const REFUND_LUA: &str = include_str!("refund.lua");

/// The largest integer the scripts accept (Lua numbers are doubles: exact up to here).
const MAX_INTEGER: u64 = 1 << 53;

/// decide.lua's scope of a part: how much of its request the part is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Scope {
    /// Some of its checks (those on one Cluster server): quota checks alone cannot deny.
    Part = 0,
    /// Every check of the request.
    Complete = 1,
    /// Some of its checks, and a check elsewhere already denies it: consume only what a denied request
    /// consumes.
    PartOfDenied = 2,
}

/// decide.lua's request flags: the scope plus this for consume-on-deny.
const CONSUME_ON_DENY: i64 = 4;

/// The role code of a check, as the script's header numbers them.
fn role_code(check: &Check) -> i64 {
    match check.role {
        Role::Enforce => 0,
        Role::Shadow => 1,
        Role::Quota if check.further_limit => 3,
        Role::Quota => 2,
    }
}

/// The algorithm id of a check, as the scripts' headers number them (one block per id in decide.lua).
/// decide.lua's id of the fixed window, the algorithm whose checks it answers with one integer.
const FIXED_WINDOW: i64 = 0;

fn algorithm_id(algorithm: Algorithm) -> i64 {
    match algorithm {
        Algorithm::FixedWindow => FIXED_WINDOW,
        Algorithm::SlidingWindow => 1,
        Algorithm::SlidingLog => 2,
        Algorithm::TokenBucket => 3,
        Algorithm::Gcra => 4,
    }
}

/// A limit spec as decide.lua numbers it: algorithm, limit, window (ms), burst, fixed-window start (s),
/// the role of the checks that name it, counts over its limit (1/0), debt.
pub type Spec = [i64; 8];

/// One check of a part.
#[derive(Debug, Clone)]
pub struct PartCheck {
    /// Its storage key.
    pub key: Bytes,
    /// The key's Cluster hash slot (0 outside Cluster).
    pub slot: u16,
    pub spec: Spec,
    cost: i64,
    /// Hits wanted in a quota lease beyond the cost (0: none).
    want: i64,
}

/// The checks of one request that one call decides, ready to travel in a call with others.
#[derive(Debug, Clone)]
pub struct Part {
    flags: i64,
    pub checks: Vec<PartCheck>,
    /// Room for the checks' answers, made where the part was: its reply is read into it, so that the
    /// caller that made the part frees both on its own thread, not the thread that sent the call.
    outcomes: Vec<Outcome>,
}

impl Part {
    /// Whether a check of the part asks for a quota lease.
    pub fn asks_lease(&self) -> bool {
        self.checks.iter().any(|check| check.want > 0)
    }

    /// The checks `checks` (indexes into the batch) of one request, whose storage keys are `keys` and
    /// slots `slot_of`; `complete` says whether they are all of its checks; `now_ms` is the server time
    /// the fixed-window keys were computed for; `wants` (per check of the batch, or empty) the lease
    /// hits each asks for. Refused when a number exceeds what the script takes.
    pub fn new(
        batch: &Batch,
        keys: &[Bytes],
        checks: &[usize],
        complete: bool,
        now_ms: u64,
        wants: &[u64],
        slot_of: impl Fn(&[u8]) -> u16,
    ) -> Result<Self, StoreError> {
        let scope = match (batch.known_denied, complete) {
            (true, _) => Scope::PartOfDenied,
            (false, true) => Scope::Complete,
            (false, false) => Scope::Part,
        };
        let flags = scope as i64
            + if batch.consume_on_deny {
                CONSUME_ON_DENY
            } else {
                0
            };
        // Sized first: collected through `Result`, a vector starts at four and grows past them.
        let mut part = Vec::with_capacity(checks.len());
        for &i in checks {
            let c = &batch.checks[i];
            part.push(PartCheck {
                key: keys[i].clone(),
                slot: slot_of(&keys[i]),
                spec: spec(c, now_ms)?,
                cost: integer(c.bounded_cost(), "cost")?,
                want: integer(wants.get(i).copied().unwrap_or(0), "lease")?,
            });
        }
        Ok(Self {
            flags,
            outcomes: Vec::with_capacity(part.len()),
            checks: part,
        })
    }

    /// About what the part adds to a call on the wire: its keys and integers.
    pub fn wire_bytes(&self) -> usize {
        self.checks.iter().map(|c| c.key.len() + 48).sum::<usize>() + 16
    }
}

/// Leased hits given back to a key, in a decide call.
#[derive(Debug, Clone)]
pub struct Return {
    pub key: Bytes,
    /// The key's Cluster hash slot (0 outside Cluster).
    pub slot: u16,
    /// The spec of the limit that leased them.
    pub spec: Spec,
    pub hits: u64,
    /// The server time (ms) of the earliest grant they came from: a reset of the counter since then
    /// (its mark says when) left them out of the counter, which then takes nothing back.
    pub granted_ms: u64,
}

/// The spec of a check whose fixed-window key was computed for `now_ms` (server time).
pub fn spec(check: &Check, now_ms: u64) -> Result<Spec, StoreError> {
    let p = &check.params;
    Ok([
        algorithm_id(p.algorithm),
        integer(p.limit, "limit")?,
        integer(p.window_ms, "window")?,
        integer(p.burst, "burst")?,
        integer(check.window_start_secs(now_ms).unwrap_or(0), "window start")?,
        role_code(check),
        i64::from(p.count_over_limit),
        integer(p.debt(), "debt")?,
    ])
}

/// A number as the scripts take it: a whole number up to 2^53.
fn integer(v: u64, what: &str) -> Result<i64, StoreError> {
    if v > MAX_INTEGER {
        return Err(StoreError::Backend(format!(
            "{what} {v} is above 2^53, more than the Redis store can count"
        )));
    }
    Ok(v as i64)
}

/// The keys and arguments of one decide.lua call.
pub struct DecideCall {
    /// The declared keys: all of them outside Cluster, those of the first hash slot on it.
    pub keys: Vec<Key>,
    pub args: Vec<Value>,
}

impl DecideCall {
    /// A call deciding `parts` in order, after giving back `returns`; `jitter` is the extra TTL (s) of
    /// the fixed-window counters it creates. On Cluster (`cluster`), the keys are grouped by hash slot and
    /// those of the first slot are declared, the others passed at the end of ARGV.
    pub fn new(parts: &[&Part], returns: &[Return], jitter: u64, cluster: bool) -> Self {
        let named = parts
            .iter()
            .flat_map(|p| &p.checks)
            .map(|c| (&c.key, c.slot))
            .chain(returns.iter().map(|r| (&r.key, r.slot)));
        let checks: usize = parts.iter().map(|p| p.checks.len()).sum();
        let keys = KeyNumbers::new(named, checks + returns.len(), cluster);
        // Specs are few (one per limit in the call): found by looking.
        let mut specs: SmallVec<[Spec; 4]> = SmallVec::new();
        for spec in parts
            .iter()
            .flat_map(|p| p.checks.iter().map(|c| c.spec))
            .chain(returns.iter().map(|r| r.spec))
        {
            if !specs.contains(&spec) {
                specs.push(spec);
            }
        }
        let spec_number = |spec: &Spec| specs.iter().position(|s| s == spec).unwrap_or(0) + 1;

        let wants = parts
            .iter()
            .flat_map(|p| &p.checks)
            .filter(|c| c.want > 0)
            .count();
        let mut ints = Packed::with_capacity(
            8 + keys.group_ends.len()
                + specs.len() * 8
                + parts.len() * 2
                + checks * 3
                + wants * 2
                + returns.len() * 4,
        );
        let push = |ints: &mut Packed, v: usize| ints.push(v as i64);
        ints.push(jitter.min(MAX_INTEGER) as i64);
        push(&mut ints, keys.distinct.len());
        push(&mut ints, keys.group_ends.len());
        for &end in &keys.group_ends {
            push(&mut ints, end);
        }
        push(&mut ints, specs.len());
        for &v in specs.iter().flatten() {
            ints.push(v);
        }
        push(&mut ints, parts.len());
        for part in parts {
            ints.push(part.flags);
            push(&mut ints, part.checks.len());
            for check in &part.checks {
                push(&mut ints, keys.number(&check.key));
                push(&mut ints, spec_number(&check.spec));
                ints.push(check.cost);
            }
        }
        push(&mut ints, wants);
        let numbered = parts.iter().flat_map(|p| &p.checks).enumerate();
        for (i, check) in numbered.filter(|(_, c)| c.want > 0) {
            push(&mut ints, i + 1);
            ints.push(check.want);
        }
        push(&mut ints, returns.len());
        for r in returns {
            push(&mut ints, keys.number(&r.key));
            push(&mut ints, spec_number(&r.spec));
            ints.push(r.hits.min(MAX_INTEGER) as i64);
            ints.push(r.granted_ms.min(MAX_INTEGER) as i64);
        }
        let mut args: Vec<Value> = Vec::with_capacity(1 + keys.distinct.len());
        args.push(Value::Bytes(ints.finish()));
        let declared = keys.declared();
        let mut call_keys = Vec::with_capacity(declared);
        for (i, (key, _)) in keys.distinct.iter().enumerate() {
            if i < declared {
                call_keys.push(Key::from((*key).clone()));
            } else {
                args.push(Value::Bytes((*key).clone()));
            }
        }
        Self {
            keys: call_keys,
            args,
        }
    }
}

/// The distinct keys of a call in the order decide.lua numbers them (from 1): first seen first, and on
/// Cluster grouped by hash slot (the slot seen first first), with the end of each slot's group.
type KeyIndex<'a> = HashMap<&'a [u8], usize, foldhash::fast::RandomState>;

struct KeyNumbers<'a> {
    distinct: Vec<(&'a Bytes, u16)>,
    group_ends: SmallVec<[usize; 4]>,
    /// For calls with many keys: where each is in `distinct`. Hashed by foldhash, seeded per process:
    /// a call's keys are few, and this hashing is a good part of building a large call.
    index: Option<KeyIndex<'a>>,
}

impl<'a> KeyNumbers<'a> {
    /// Calls with more keys than this find them by hashing, fewer by looking.
    const LOOKED_UP: usize = 16;

    /// Numbers the `named` keys, at most `most` of them (sizes the vector and the index once).
    fn new(named: impl Iterator<Item = (&'a Bytes, u16)>, most: usize, cluster: bool) -> Self {
        let mut distinct: Vec<(&'a Bytes, u16)> = Vec::with_capacity(most);
        let mut index: Option<KeyIndex<'a>> = None;
        for (key, slot) in named {
            let seen = match &index {
                Some(index) => index.contains_key(&key[..]),
                None => distinct.iter().any(|(k, _)| k == &key),
            };
            if seen {
                continue;
            }
            distinct.push((key, slot));
            if let Some(index) = &mut index {
                index.insert(&key[..], distinct.len() - 1);
            } else if distinct.len() > Self::LOOKED_UP {
                let mut sized = KeyIndex::with_capacity_and_hasher(most, Default::default());
                sized.extend(distinct.iter().enumerate().map(|(i, (k, _))| (&k[..], i)));
                index = Some(sized);
            }
        }
        let mut group_ends = SmallVec::new();
        if cluster && distinct.len() > 1 {
            // Stable: within a slot, first seen first; slots in the order first seen.
            let mut first_seen: SmallVec<[u16; 8]> = SmallVec::new();
            for &(_, slot) in &distinct {
                if !first_seen.contains(&slot) {
                    first_seen.push(slot);
                }
            }
            distinct.sort_by_key(|&(_, slot)| first_seen.iter().position(|&s| s == slot));
            if let Some(index) = &mut index {
                for (i, (key, _)) in distinct.iter().enumerate() {
                    index.insert(&key[..], i);
                }
            }
            for (position, pair) in distinct.windows(2).enumerate() {
                if pair[0].1 != pair[1].1 {
                    group_ends.push(position + 1);
                }
            }
        }
        if !distinct.is_empty() {
            group_ends.push(distinct.len());
        }
        Self {
            distinct,
            group_ends,
            index,
        }
    }

    /// The number of a key of the call.
    fn number(&self, key: &Bytes) -> usize {
        let position = match &self.index {
            Some(index) => index.get(&key[..]).copied(),
            None => self.distinct.iter().position(|(k, _)| *k == key),
        };
        position.unwrap_or(0) + 1
    }

    /// How many keys the call declares: all of them, or on Cluster those of the first slot.
    fn declared(&self) -> usize {
        self.group_ends.first().copied().unwrap_or(0)
    }
}

/// A call's integers as one msgpack array, decide.lua's first argument: Redis takes it apart in C
/// (`cmsgpack.unpack`, one Lua table) instead of making an argument object and a Lua string of each
/// integer, and the client writes one bulk string instead of a frame per integer.
struct Packed {
    /// Five bytes kept in front for the array's header, then the integers.
    bytes: Vec<u8>,
    count: usize,
}

impl Packed {
    const HEADER: usize = 5;

    fn with_capacity(integers: usize) -> Self {
        let mut bytes = Vec::with_capacity(Self::HEADER + integers * 3);
        bytes.extend_from_slice(&[0; Self::HEADER]);
        Self { bytes, count: 0 }
    }

    /// Appends `v` in msgpack's shortest form. The script refuses a negative value (the form is kept so
    /// that it can).
    fn push(&mut self, v: i64) {
        self.count += 1;
        let b = &mut self.bytes;
        match u64::try_from(v) {
            Ok(v @ 0..=0x7f) => b.push(v as u8),
            Ok(v @ 0x80..=0xff) => b.extend_from_slice(&[0xcc, v as u8]),
            Ok(v @ 0x100..=0xffff) => {
                b.push(0xcd);
                b.extend_from_slice(&(v as u16).to_be_bytes());
            }
            Ok(v @ 0x1_0000..=0xffff_ffff) => {
                b.push(0xce);
                b.extend_from_slice(&(v as u32).to_be_bytes());
            }
            Ok(v) => {
                b.push(0xcf);
                b.extend_from_slice(&v.to_be_bytes());
            }
            Err(_) => {
                b.push(0xd3);
                b.extend_from_slice(&v.to_be_bytes());
            }
        }
    }

    /// The array: its header written into the room kept in front, and the bytes from there.
    fn finish(mut self) -> Bytes {
        let n = self.count;
        let start = if n < 16 {
            self.bytes[4] = 0x90 | n as u8;
            4
        } else if let Ok(n) = u16::try_from(n) {
            self.bytes[2] = 0xdc;
            self.bytes[3..5].copy_from_slice(&n.to_be_bytes());
            2
        } else {
            self.bytes[0] = 0xdd;
            self.bytes[1..5].copy_from_slice(&(n as u32).to_be_bytes());
            0
        };
        Bytes::from(self.bytes).slice(start..)
    }
}

/// The reply of a packed call: one msgpack array of the script's numbers, as Redis's `cmsgpack` writes
/// Lua numbers (an integer of any width, a double when one is not whole). A double is cut toward zero, as
/// Redis turns a Lua number into an integer reply; anything else, or bytes left over, is an error.
pub fn unpack_reply(bytes: &[u8]) -> Result<Vec<i64>, StoreError> {
    let bad = |what: &str| StoreError::Backend(format!("unexpected reply from decide.lua: {what}"));
    let mut rest = bytes;
    let mut take = |n: usize| -> Result<u64, StoreError> {
        if rest.len() < n {
            return Err(bad("it ends early"));
        }
        let (head, tail) = rest.split_at(n);
        rest = tail;
        Ok(head.iter().fold(0, |v, &b| (v << 8) | u64::from(b)))
    };
    let n = match take(1)? as u8 {
        m @ 0x90..=0x9f => u64::from(m & 0x0f),
        0xdc => take(2)?,
        0xdd => take(4)?,
        _ => return Err(bad("not an array")),
    };
    // Every element takes at least one byte: a header cannot make this allocate more than the reply.
    let mut out = Vec::with_capacity((n as usize).min(bytes.len()));
    for _ in 0..n {
        let v = match take(1)? as u8 {
            m @ 0x00..=0x7f => i64::from(m),
            m @ 0xe0..=0xff => i64::from(m as i8),
            0xcc => take(1)? as i64,
            0xcd => take(2)? as i64,
            0xce => take(4)? as i64,
            0xcf => i64::try_from(take(8)?).unwrap_or(i64::MAX),
            0xd0 => i64::from(take(1)? as u8 as i8),
            0xd1 => i64::from(take(2)? as u16 as i16),
            0xd2 => i64::from(take(4)? as u32 as i32),
            0xd3 => take(8)? as i64,
            0xca => f32::from_bits(take(4)? as u32) as i64,
            0xcb => f64::from_bits(take(8)?) as i64,
            _ => return Err(bad("an element is not a number")),
        };
        out.push(v);
    }
    if !rest.is_empty() {
        return Err(bad("bytes left over"));
    }
    Ok(out)
}

/// decide.lua's reply status of a part: decided.
const STATUS_DECIDED: i64 = 0;
/// decide.lua's reply status of a part: a fixed-window key is for another window than the server's clock
/// says; nothing of it was read or written.
const STATUS_WINDOW_MISMATCH: i64 = 1;
/// decide.lua's reply integers per check of any algorithm but the fixed window: allowed (1/0),
/// remaining, reset (ms), retry (ms).
const REPLY_PER_CHECK: usize = 4;

/// How many integers decide.lua answers for a check of `spec`: a fixed window's one (remaining + 1 when
/// allowed, 0 when denied; its reset is the window's end, which the client works out from the server
/// time), any other algorithm's [`REPLY_PER_CHECK`].
fn reply_len(spec: &Spec) -> usize {
    if spec[0] == FIXED_WINDOW {
        1
    } else {
        REPLY_PER_CHECK
    }
}

/// The decision on a check of `spec` from its reply integers `c` (of [`reply_len`]), at server time
/// `server_ms`.
fn decision(spec: &Spec, c: &[i64], server_ms: i64) -> Decision {
    if let [v] = *c {
        let window = spec[2];
        // A decided fixed window is at least a second long (the script skips shorter ones).
        let reset = window - server_ms.checked_rem(window).unwrap_or(0);
        let allowed = v > 0;
        return Decision {
            allowed,
            remaining: if allowed { non_negative(v - 1) } else { 0 },
            reset_ms: non_negative(reset),
            retry_ms: if allowed { 0 } else { non_negative(reset) },
        };
    }
    Decision {
        allowed: c[0] == 1,
        remaining: non_negative(c[1]),
        reset_ms: non_negative(c[2]),
        retry_ms: non_negative(c[3]),
    }
}

/// The answer to one part.
#[derive(Debug)]
pub struct PartReply {
    /// Nothing was decided: retry with keys for `server_ms`.
    pub window_mismatch: bool,
    /// The checks of this part deny the request.
    pub denied: bool,
    /// The server's time when it decided.
    pub server_ms: i64,
    /// One per check of the part, in order.
    pub outcomes: Vec<Outcome>,
    /// The leases granted to checks of the part that asked for one.
    pub grants: Vec<Grant>,
    /// The granted hits no lease holds yet, given back if the reply is dropped before one does (set
    /// when the reply reaches its caller).
    pub unheld: Option<Box<Unheld>>,
}

/// A quota lease granted to one check.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Grant {
    /// The check's position in its part.
    pub check: usize,
    /// Hits leased (0: none).
    pub hits: u64,
    /// The check's own answer: what was left after it (leased hits included) and its reset (ms).
    pub remaining: u64,
    pub reset_ms: u64,
    /// The server time (ms) of the call that granted it.
    pub server_ms: u64,
}

impl PartReply {
    /// Reads the reply of a call that carried `parts`, one answer per part, each into its part's room
    /// for answers; anything else than the header says is an error.
    pub fn parse_all(reply: &[i64], parts: &mut [&mut Part]) -> Result<Vec<Self>, StoreError> {
        let bad = || StoreError::Backend(format!("unexpected reply from decide.lua: {reply:?}"));
        let (&server_ms, mut rest) = reply.split_first().ok_or_else(bad)?;
        let mut replies = Vec::with_capacity(parts.len());
        for part in parts.iter_mut() {
            let [status, denied, tail @ ..] = rest else {
                return Err(bad());
            };
            rest = tail;
            match *status {
                STATUS_WINDOW_MISMATCH => replies.push(Self {
                    window_mismatch: true,
                    denied: false,
                    server_ms,
                    outcomes: Vec::new(),
                    grants: Vec::new(),
                    unheld: None,
                }),
                STATUS_DECIDED => {
                    let mut outcomes = std::mem::take(&mut part.outcomes);
                    outcomes.clear();
                    let mut grants = Vec::new();
                    for (i, check) in part.checks.iter().enumerate() {
                        let len = reply_len(&check.spec);
                        if rest.len() < len {
                            return Err(bad());
                        }
                        let (ints, tail) = rest.split_at(len);
                        rest = tail;
                        let decision = decision(&check.spec, ints, server_ms);
                        if check.want > 0 {
                            grants.push(Grant {
                                check: i,
                                hits: 0,
                                remaining: decision.remaining,
                                reset_ms: decision.reset_ms,
                                server_ms: non_negative(server_ms),
                            });
                        }
                        outcomes.push(Outcome::from(decision));
                    }
                    replies.push(Self {
                        window_mismatch: false,
                        denied: *denied == 1,
                        server_ms,
                        outcomes,
                        grants,
                        unheld: None,
                    });
                }
                _ => return Err(bad()),
            }
        }
        // One integer per lease asked, in call order, for every part (a part not decided was granted 0).
        let asked: usize = parts
            .iter()
            .map(|p| p.checks.iter().filter(|c| c.want > 0).count())
            .sum();
        if rest.len() != asked {
            return Err(bad());
        }
        let mut granted = rest.iter();
        for (part, reply) in parts.iter().zip(&mut replies) {
            let asked = part.checks.iter().filter(|c| c.want > 0).count();
            let hits: Vec<u64> = granted
                .by_ref()
                .take(asked)
                .map(|&g| non_negative(g))
                .collect();
            for (grant, hits) in reply.grants.iter_mut().zip(hits) {
                grant.hits = hits;
            }
        }
        Ok(replies)
    }

    /// Whether the part consumed anything: it decided, and its checks allowed the request or the
    /// request consumes even when denied.
    pub fn consumed(&self, batch: &Batch) -> bool {
        !self.window_mismatch && (!self.denied || batch.consume_on_deny)
    }
}

fn non_negative(v: i64) -> u64 {
    u64::try_from(v).unwrap_or(0)
}

/// refund.lua's integers per key: algorithm, hits to give back, window (ms), limit, burst.
const REFUND_ARGS_PER_KEY: usize = 5;

/// The keys and arguments of one refund.lua call: gives back what a decided part consumed.
pub struct RefundCall {
    pub keys: Vec<Key>,
    pub args: Vec<i64>,
}

impl RefundCall {
    /// For `checks` (indexes into the batch, whose storage keys are `keys`, each with its outcome) of a
    /// part that consumed, decided at `server_ms`.
    pub fn new(batch: &Batch, keys: &[Bytes], checks: &[(usize, Outcome)], server_ms: i64) -> Self {
        let keys = checks
            .iter()
            .map(|&(i, _)| Key::from(keys[i].clone()))
            .collect();
        let mut args = Vec::with_capacity(1 + checks.len() * REFUND_ARGS_PER_KEY);
        args.push(server_ms);
        for &(i, ref outcome) in checks {
            let c = &batch.checks[i];
            args.extend([
                algorithm_id(c.params.algorithm),
                to_i64(consumed_hits(c, outcome)),
                to_i64(c.params.window_ms),
                to_i64(c.params.limit),
                to_i64(c.params.burst),
            ]);
        }
        Self { keys, args }
    }
}

/// What a check consumed in a part that consumed, to give back: its cost when allowed, and every
/// fixed-window hit (decide.lua's `counts_denied`); nothing of a limit that counts over its limit, whose
/// hits stay counted whatever the request's decision.
fn consumed_hits(check: &Check, outcome: &Outcome) -> u64 {
    if check.params.count_over_limit {
        0
    } else if outcome.allowed || check.params.algorithm == Algorithm::FixedWindow {
        check.bounded_cost()
    } else {
        0
    }
}

fn to_i64(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{algorithm::Params, store::Check};

    /// The integers of a call: its first argument, a msgpack array (read with the reply's reader, which
    /// its own test checks against bytes written by hand).
    fn ints(args: &[Value]) -> Vec<i64> {
        let Some(Value::Bytes(b)) = args.first() else {
            panic!("no packed integers: {args:?}");
        };
        unpack(b)
    }

    fn unpack(b: &[u8]) -> Vec<i64> {
        unpack_reply(b).unwrap()
    }

    #[test]
    fn a_packed_reply_reads_every_number_form_and_refuses_anything_else() {
        let mut reply = vec![0xdc, 0, 14];
        reply.extend_from_slice(&[0x00, 0x7f, 0xff, 0xe0]);
        reply.extend_from_slice(&[0xcc, 0xff, 0xcd, 0x01, 0x00, 0xce, 0x00, 0x01, 0x00, 0x00]);
        reply.extend_from_slice(&[0xcf, 0, 0, 0x01, 0x8b, 0xcf, 0xe8, 0x0d, 0x40]);
        reply.extend_from_slice(&[0xd0, 0x80, 0xd1, 0x80, 0x00, 0xd2, 0x80, 0, 0, 0]);
        reply.push(0xd3);
        reply.extend_from_slice(&(-1_700_000_000_000_i64).to_be_bytes());
        reply.push(0xca);
        reply.extend_from_slice(&2.75_f32.to_be_bytes());
        reply.push(0xcb);
        reply.extend_from_slice(&(-2.5_f64).to_be_bytes());
        assert_eq!(
            unpack_reply(&reply).unwrap(),
            [
                0,
                127,
                -1,
                -32,
                255,
                256,
                65_536,
                1_700_000_173_376,
                -128,
                -32_768,
                -2_147_483_648,
                -1_700_000_000_000,
                2,
                -2
            ]
        );
        assert_eq!(unpack_reply(&[0xdd, 0, 0, 0, 1, 0x05]).unwrap(), [5]);
        assert_eq!(unpack_reply(&[0x90]).unwrap(), Vec::<i64>::new());
        for bad in [
            &[][..],
            &[0x81, 0x01, 0x01],                   // a map
            &[0x92, 0x01, 0xa1, b'x'],             // a string element
            &[0x92, 0x01],                         // ends early
            &[0x91, 0xcd, 0x01],                   // a number cut short
            &[0x91, 0x01, 0x01],                   // bytes left over
            &[0xdd, 0xff, 0xff, 0xff, 0xff, 0x01], // a header far past the bytes
            &[0x91, 0xc0],                         // nil
        ] {
            assert!(unpack_reply(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn integers_are_packed_in_the_shortest_form_and_every_array_length_has_its_header() {
        let edges: [i64; 12] = [
            0,
            0x7f,
            0x80,
            0xff,
            0x100,
            0xffff,
            0x1_0000,
            0xffff_ffff,
            0x1_0000_0000,
            1 << 53,
            i64::MAX,
            -1,
        ];
        let mut packed = Packed::with_capacity(edges.len());
        for v in edges {
            packed.push(v);
        }
        let bytes = packed.finish();
        assert_eq!(unpack(&bytes), edges);
        // 1 + 1, 2, 2, 3, 3, 5, 5, 9, 9, 9, 9 bytes
        assert_eq!(
            bytes.len(),
            1 + 1 + 1 + 2 + 2 + 3 + 3 + 5 + 5 + 9 + 9 + 9 + 9
        );
        for n in [0, 15, 16, 65_535, 65_536] {
            let mut packed = Packed::with_capacity(n);
            for i in 0..n {
                packed.push(i as i64 % 100);
            }
            let bytes = packed.finish();
            let header = match n {
                0..=15 => 1,
                16..=65_535 => 3,
                _ => 5,
            };
            assert_eq!(bytes.len(), header + n, "{n} integers");
            assert_eq!(unpack(&bytes).len(), n);
        }
    }

    fn batch() -> Batch {
        let token_bucket = Check {
            key: "tb".into(),
            params: Params {
                algorithm: Algorithm::TokenBucket,
                limit: 10,
                window_ms: 60_000,
                burst: 20,
                count_over_limit: false,
            },
            cost: 3,
            role: Role::Quota,
            further_limit: false,
            per_second: false,
            reported: false,
        };
        Batch {
            checks: vec![
                Check::fixed_window("fw_".into(), 5, 60, 1, Role::Shadow),
                token_bucket,
            ],
            consume_on_deny: true,
            known_denied: false,
        }
    }

    fn keys() -> Vec<Bytes> {
        vec![Bytes::from_static(b"fw_2220"), Bytes::from_static(b"tb")]
    }

    #[test]
    fn malformed_script_replies_are_errors_not_panics() {
        let batch = batch();
        let mut part = Part::new(&batch, &keys(), &[0], true, 2_222_000, &[], |_| 0).unwrap();
        let mut parts = [&mut part];
        assert!(PartReply::parse_all(&[], &mut parts).is_err());
        // A fixed window answers one integer: none, or one too many, is an error.
        assert!(PartReply::parse_all(&[5, 0, 0], &mut parts).is_err());
        assert!(PartReply::parse_all(&[5, 7, 0], &mut parts).is_err());
        assert!(PartReply::parse_all(&[5, 0, 0, 1, 9], &mut parts).is_err());
        // Denied (0) at 57.5 s into the minute: the window ends in 2.5 s, the reset and the retry.
        let r = PartReply::parse_all(&[57_500, 0, 1, 0], &mut parts).unwrap();
        assert!(r[0].denied && !r[0].outcomes[0].allowed);
        let o = &r[0].outcomes[0];
        assert_eq!((o.remaining, o.reset_after, o.retry_ms), (0, 3, 2_500));
        // Allowed with 2 left (2 + 1).
        let r = PartReply::parse_all(&[60_001, 0, 0, 3], &mut parts).unwrap();
        let o = &r[0].outcomes[0];
        assert!(!r[0].denied && o.allowed);
        assert_eq!((o.remaining, o.reset_after, o.retry_ms), (2, 60, 0));
        assert!(PartReply::parse_all(&[5, 1, 0], &mut parts).unwrap()[0].window_mismatch);
    }

    #[test]
    fn a_call_numbers_distinct_keys_and_specs_and_lists_each_request() {
        let batch = batch();
        let keys = keys();
        let both = Part::new(&batch, &keys, &[0, 1], true, 2_222_000, &[], |_| 0).unwrap();
        let again = Part::new(&batch, &keys, &[1], false, 2_222_000, &[], |_| 0).unwrap();
        let call = DecideCall::new(&[&both, &again], &[], 7, false);
        assert_eq!(call.keys, vec![Key::from("fw_2220"), Key::from("tb")]);
        assert_eq!(
            ints(&call.args),
            [
                7, 2, // jitter, keys
                1, 2, // one read group ending at key 2
                2, 0, 5, 60_000, 5, 2_220, 1, 0, 0, 3, 10, 60_000, 20, 0, 2, 0,
                0, // two specs, with roles
                2, // two requests
                5, 2, 1, 1, 1, 2, 2, 3, // complete + consume on deny: fw, tb
                4, 1, 2, 2, 3, // a part: tb again
                0, 0, // no leases wanted or given back
            ]
        );
        let denied = Batch {
            known_denied: true,
            consume_on_deny: false,
            ..batch
        };
        let part = Part::new(&denied, &keys, &[1], false, 0, &[], |_| 0).unwrap();
        assert_eq!(part.flags, 2);
    }

    #[test]
    fn on_cluster_the_first_slot_is_declared_and_the_other_keys_follow_the_integers() {
        let batch = batch();
        let keys = keys();
        let slot = |k: &[u8]| if k == b"tb" { 9 } else { 3 };
        let second = Part::new(&batch, &keys, &[1], false, 2_222_000, &[], slot).unwrap();
        let first = Part::new(&batch, &keys, &[0], false, 2_222_000, &[], slot).unwrap();
        let call = DecideCall::new(&[&second, &first], &[], 0, true);
        assert_eq!(call.keys, vec![Key::from("tb")]);
        let tail = call.args.last().unwrap();
        assert!(matches!(tail, Value::Bytes(b) if &b[..] == b"fw_2220"));
        // Two read groups, one key each; `tb` is key 1.
        assert_eq!(ints(&call.args)[..5], [0, 2, 2, 1, 2]);
    }

    #[test]
    fn wanted_leases_and_hits_given_back_follow_the_requests() {
        let batch = batch();
        let keys = keys();
        let mut part = Part::new(&batch, &keys, &[0, 1], true, 2_222_000, &[0, 40], |_| 0).unwrap();
        let back = Return {
            key: Bytes::from_static(b"old_2160"),
            slot: 0,
            spec: [0, 5, 60_000, 5, 2_160, 0, 0, 0],
            hits: 7,
            granted_ms: 2_160_500,
        };
        let call = DecideCall::new(&[&part], &[back], 0, false);
        let args = ints(&call.args);
        // After the request: one lease wanted (check 2, 40 hits), one return (key 3, spec 3, 7 hits
        // granted at 2 160 500 ms).
        assert_eq!(&args[args.len() - 8..], [1, 2, 40, 1, 3, 3, 7, 2_160_500]);
        assert_eq!(call.keys.len(), 3);
        // The reply: the part's two checks (the fixed window's one integer, allowed with 4 left; the
        // token bucket's four), then the grant.
        let reply = [5, 0, 0, 5, 1, 9, 2000, 0, 40];
        let parsed = PartReply::parse_all(&reply, &mut [&mut part]).unwrap();
        assert_eq!(
            parsed[0].grants,
            [Grant {
                check: 1,
                hits: 40,
                remaining: 9,
                reset_ms: 2000,
                server_ms: 5,
            }]
        );
        assert!(PartReply::parse_all(&reply[..reply.len() - 1], &mut [&mut part]).is_err());
    }

    #[test]
    fn numbers_the_script_cannot_hold_refuse_the_part_alone() {
        let mut batch = batch();
        batch.checks[1].params.limit = (1 << 53) + 1;
        batch.checks[1].params.burst = 1 << 60;
        let err = Part::new(&batch, &keys(), &[0, 1], true, 0, &[], |_| 0).unwrap_err();
        assert!(err.to_string().contains("above 2^53"), "{err}");
        assert!(Part::new(&batch, &keys(), &[0], false, 0, &[], |_| 0).is_ok());
    }
}
