//! The calling contract of `decide.lua` and `refund.lua`, as their headers state it: the keys and
//! arguments of a call, the codes inside them, and what a reply means. A change to a script's header is
//! a change here, and the other way round.
//!
//! Every number crosses as an integer (`i64`); the scripts refuse anything outside 0 to 2^53 before they
//! read or write, and costs arrive already bounded (see [`Check::bounded_cost`]).

use super::super::{Batch, Check, Outcome, Role, StoreError};
use crate::algorithm::{Algorithm, Decision};

pub const DECIDE_LUA: &str = include_str!("decide.lua");
pub const REFUND_LUA: &str = include_str!("refund.lua");

/// decide.lua's ARGV before the per-check integers: consume on deny, scope, expiry jitter.
const DECIDE_HEADER_ARGS: usize = 3;
/// decide.lua's integers per check: algorithm, limit, window (ms), cost, role, burst, window start (s).
const DECIDE_ARGS_PER_CHECK: usize = 7;

/// decide.lua's ARGV[2]: how much of the request one call decides.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Scope {
    /// Some of its checks (a Cluster hash slot): quota checks alone cannot deny.
    Part = 0,
    /// Every check of the request.
    Complete = 1,
    /// Some of its checks, and a check elsewhere already denies it: consume only what a denied request
    /// consumes.
    PartOfDenied = 2,
}

/// The role code of a check, as the script's header numbers them.
fn role_code(role: Role) -> i64 {
    match role {
        Role::Enforce => 0,
        Role::Shadow => 1,
        Role::Quota => 2,
    }
}

/// The algorithm id of a check, as the scripts' headers number them (one block per id in decide.lua).
fn algorithm_id(algorithm: Algorithm) -> i64 {
    match algorithm {
        Algorithm::FixedWindow => 0,
        Algorithm::SlidingWindow => 1,
        Algorithm::SlidingLog => 2,
        Algorithm::TokenBucket => 3,
        Algorithm::Gcra => 4,
    }
}

/// The keys and arguments of one decide.lua call: the checks `checks` (indexes into the batch) of one
/// hash slot.
pub struct DecideCall {
    pub keys: Vec<String>,
    pub args: Vec<i64>,
}

impl DecideCall {
    /// `keys` are the storage keys of every check of the batch; `complete` says whether `checks` are all
    /// of them; `jitter` is the extra TTL (s) of new fixed-window counters; `now_ms` is the server time
    /// the fixed-window keys were computed for.
    pub fn new(
        batch: &Batch,
        keys: &[String],
        checks: &[usize],
        complete: bool,
        jitter: u64,
        now_ms: u64,
    ) -> Self {
        let scope = match (batch.known_denied, complete) {
            (true, _) => Scope::PartOfDenied,
            (false, true) => Scope::Complete,
            (false, false) => Scope::Part,
        };
        let mut args =
            Vec::with_capacity(DECIDE_HEADER_ARGS + checks.len() * DECIDE_ARGS_PER_CHECK);
        args.extend([
            i64::from(batch.consume_on_deny),
            scope as i64,
            to_i64(jitter),
        ]);
        let mut call_keys = Vec::with_capacity(checks.len());
        for &i in checks {
            let c = &batch.checks[i];
            call_keys.push(keys[i].clone());
            let p = &c.params;
            args.extend([
                algorithm_id(p.algorithm),
                to_i64(p.limit),
                to_i64(p.window_ms),
                to_i64(c.bounded_cost()),
                role_code(c.role),
                to_i64(p.burst),
                to_i64(c.window_start_secs(now_ms).unwrap_or(0)),
            ]);
        }
        Self {
            keys: call_keys,
            args,
        }
    }
}

/// decide.lua's reply status: decided.
const STATUS_DECIDED: i64 = 0;
/// decide.lua's reply status: a fixed-window key is for another window than the server's clock says;
/// nothing was read or written.
const STATUS_WINDOW_MISMATCH: i64 = 1;
/// decide.lua's reply before the per-check integers: status, denied, server time (ms).
const REPLY_HEADER: usize = 3;
/// decide.lua's reply integers per check: allowed (1/0), remaining, reset (ms), retry (ms).
const REPLY_PER_CHECK: usize = 4;

/// The reply of one decide.lua call.
#[derive(Debug)]
pub struct SlotReply {
    /// Nothing was decided: retry with keys for `server_ms`.
    pub window_mismatch: bool,
    /// The checks of this call deny the request.
    pub denied: bool,
    /// The server's time when it decided.
    pub server_ms: i64,
    /// One per check of the call, in order.
    pub outcomes: Vec<Outcome>,
}

impl SlotReply {
    /// Reads the reply of a call with `checks` checks; anything else than the header says is an error.
    pub fn parse(reply: &[i64], checks: usize) -> Result<Self, StoreError> {
        let bad = || StoreError::Backend(format!("unexpected reply from decide.lua: {reply:?}"));
        if reply.len() < REPLY_HEADER {
            return Err(bad());
        }
        let (header, rest) = reply.split_at(REPLY_HEADER);
        let (status, denied, server_ms) = (header[0], header[1], header[2]);
        if status == STATUS_WINDOW_MISMATCH {
            return Ok(Self {
                window_mismatch: true,
                denied: false,
                server_ms,
                outcomes: Vec::new(),
            });
        }
        if status != STATUS_DECIDED || rest.len() != checks * REPLY_PER_CHECK {
            return Err(bad());
        }
        Ok(Self {
            window_mismatch: false,
            denied: denied == 1,
            server_ms,
            outcomes: rest
                .chunks_exact(REPLY_PER_CHECK)
                .map(|c| {
                    let ms = |v: i64| u64::try_from(v).unwrap_or(0);
                    Outcome::from(Decision {
                        allowed: c[0] == 1,
                        remaining: ms(c[1]),
                        reset_ms: ms(c[2]),
                        retry_ms: ms(c[3]),
                    })
                })
                .collect(),
        })
    }

    /// Whether the call consumed anything: it decided, and its checks allowed the request or the
    /// request consumes even when denied.
    pub fn consumed(&self, batch: &Batch) -> bool {
        !self.window_mismatch && (!self.denied || batch.consume_on_deny)
    }
}

/// refund.lua's integers per key: algorithm, hits to give back, window (ms), limit, burst.
const REFUND_ARGS_PER_KEY: usize = 5;

/// The keys and arguments of one refund.lua call: gives back what a decide.lua call consumed.
pub struct RefundCall {
    pub keys: Vec<String>,
    pub args: Vec<i64>,
}

impl RefundCall {
    /// For the call that decided `checks` and replied `slot`; `None` when it consumed nothing.
    pub fn new(batch: &Batch, keys: &[String], checks: &[usize], slot: &SlotReply) -> Option<Self> {
        if !slot.consumed(batch) {
            return None;
        }
        let call_keys: Vec<String> = checks.iter().map(|&i| keys[i].clone()).collect();
        let mut args = Vec::with_capacity(1 + checks.len() * REFUND_ARGS_PER_KEY);
        args.push(slot.server_ms);
        for (&i, outcome) in checks.iter().zip(&slot.outcomes) {
            let c = &batch.checks[i];
            args.extend([
                algorithm_id(c.params.algorithm),
                to_i64(consumed_hits(c, outcome)),
                to_i64(c.params.window_ms),
                to_i64(c.params.limit),
                to_i64(c.params.burst),
            ]);
        }
        Some(Self {
            keys: call_keys,
            args,
        })
    }
}

/// What a check consumed in a call that consumed: its cost when allowed, and every fixed-window hit
/// (decide.lua's `counts_denied`).
fn consumed_hits(check: &Check, outcome: &Outcome) -> u64 {
    if outcome.allowed || check.params.algorithm == Algorithm::FixedWindow {
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

    #[test]
    fn malformed_script_replies_are_errors_not_panics() {
        assert!(SlotReply::parse(&[], 1).is_err());
        assert!(SlotReply::parse(&[0, 0, 5, 1, 2, 3], 1).is_err());
        assert!(SlotReply::parse(&[7, 0, 5], 0).is_err());
        let r = SlotReply::parse(&[0, 1, 5, 0, 0, 2500, 1001], 1).unwrap();
        assert!(r.denied && !r.outcomes[0].allowed);
        assert_eq!(
            (r.outcomes[0].reset_after, r.outcomes[0].retry_after),
            (3, 2)
        );
        assert!(SlotReply::parse(&[1, 0, 5], 2).unwrap().window_mismatch);
    }

    #[test]
    fn a_call_passes_seven_integers_per_check_after_three_of_its_own() {
        let token_bucket = Check {
            key: "tb".into(),
            params: Params {
                algorithm: Algorithm::TokenBucket,
                limit: 10,
                window_ms: 60_000,
                burst: 20,
            },
            cost: 3,
            role: Role::Quota,
            per_second: false,
        };
        let batch = Batch {
            checks: vec![
                Check::fixed_window("fw_".into(), 5, 60, 1, Role::Shadow),
                token_bucket,
            ],
            consume_on_deny: true,
            known_denied: false,
        };
        let keys = ["fw_2220".to_owned(), "tb".to_owned()];
        let call = DecideCall::new(&batch, &keys, &[0, 1], true, 7, 2_222_000);
        assert_eq!(call.keys, keys);
        assert_eq!(
            call.args,
            [1, 1, 7, 0, 5, 60_000, 1, 1, 5, 2_220, 3, 10, 60_000, 3, 2, 20, 0]
        );
        let part = DecideCall::new(&batch, &keys, &[1], false, 0, 2_222_000);
        assert_eq!((part.args[1], part.keys.len()), (0, 1));
        let denied = Batch {
            known_denied: true,
            ..batch
        };
        assert_eq!(
            DecideCall::new(&denied, &keys, &[1], false, 0, 0).args[1],
            2
        );
    }
}
