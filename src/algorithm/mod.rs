//! Rate limit algorithms as pure arithmetic: state, time and cost in; verdict and new state out.
//! No I/O, no clock, no async: the stores run them (the memory store directly, the Redis script by
//! mirroring the same formulas in the same order), and the same scenarios check every implementation.
//!
//! Times are milliseconds since the Unix epoch. For every algorithm a [`Decision`] says whether the cost
//! fits, the quota left, the time until the state is fully reset (as if no hit had ever happened), and
//! the wait before the same cost would fit.
//!
//! A limit that counts over its limit ([`Params::count_over_limit`], for usage reported after the fact
//! such as LLM token counts) counts every cost it is given, also one it denies, up to [`Params::debt`]
//! past its capacity: fixed and sliding windows count beyond the limit, the sliding log records the hits,
//! the token bucket goes below zero and GCRA's theoretical arrival time moves ahead. Until time has paid
//! the excess back, every cost is denied, a check-only cost of 0 included.

pub mod fixed_window;
pub mod sliding_log;

pub use sliding_log::{Log, Record, SLIDING_LOG_ENTRIES_PER_HIT};

/// How a limit counts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum Algorithm {
    /// Epoch-aligned windows, one counter each (the reference service's).
    #[default]
    FixedWindow,
    /// Current window plus the previous one weighted by how much of it still overlaps the sliding window.
    SlidingWindow,
    /// One entry per counted request; exact over any window, memory proportional to the requests in a
    /// window.
    SlidingLog,
    /// A bucket of `burst` tokens refilled at `limit` per window.
    TokenBucket,
    /// Generic cell rate algorithm: the token bucket as one timestamp.
    Gcra,
}

impl Algorithm {
    pub const NAMES: &'static [&'static str] = &[
        "fixed_window",
        "sliding_window",
        "sliding_log",
        "token_bucket",
        "gcra",
    ];

    pub fn from_name(name: &str) -> Option<Self> {
        Some(match name {
            "fixed_window" => Self::FixedWindow,
            "sliding_window" => Self::SlidingWindow,
            "sliding_log" => Self::SlidingLog,
            "token_bucket" => Self::TokenBucket,
            "gcra" => Self::Gcra,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::FixedWindow => "fixed_window",
            Self::SlidingWindow => "sliding_window",
            Self::SlidingLog => "sliding_log",
            Self::TokenBucket => "token_bucket",
            Self::Gcra => "gcra",
        }
    }

    /// Whether `burst` means something for this algorithm.
    pub fn uses_burst(self) -> bool {
        matches!(self, Self::TokenBucket | Self::Gcra)
    }
}

impl serde::Serialize for Algorithm {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

impl<'de> serde::Deserialize<'de> for Algorithm {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let name = String::deserialize(d)?;
        Self::from_name(&name).ok_or_else(|| {
            serde::de::Error::custom(format!(
                "unknown algorithm {name:?}; use one of {}",
                Self::NAMES.join(", ")
            ))
        })
    }
}

/// The parameters of one limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Params {
    pub algorithm: Algorithm,
    /// Hits per window (token bucket and GCRA: the refill per window).
    pub limit: u64,
    /// Window length in milliseconds (unit x multiplier).
    pub window_ms: u64,
    /// Bucket capacity (token bucket, GCRA); equals `limit` unless set.
    pub burst: u64,
    /// Every cost is counted, also one the limit denies (`count_over_limit`: usage reported after the
    /// fact), up to [`Params::debt`] past the capacity; later costs are denied until it is paid back.
    pub count_over_limit: bool,
}

/// How far past its capacity a limit that counts over its limit may go, in capacities: one report,
/// however large, locks a key for at most this many refills of its bucket (or until its window ends).
pub const DEBT_CAPACITIES: u64 = 10;

impl Params {
    /// What the limit holds when full: the burst of a token bucket or GCRA, the limit otherwise.
    pub fn capacity(&self) -> u64 {
        if self.algorithm.uses_burst() {
            self.burst
        } else {
            self.limit
        }
    }

    /// How far past its capacity the state may go: [`DEBT_CAPACITIES`] x the capacity for a limit that
    /// counts over its limit, 0 for the others.
    pub fn debt(&self) -> u64 {
        if self.count_over_limit {
            self.capacity().saturating_mul(DEBT_CAPACITIES)
        } else {
            0
        }
    }

    /// The largest cost that can ever be decided differently from a larger one: every algorithm
    /// denies a cost above its capacity (the limit, or the burst) whatever its state and reports the
    /// same wait; it changes nothing, or (counting over the limit) at most fills the debt. Costs are
    /// bounded by this before any arithmetic or storage, so a caller's `hits_addend` of 2^64 - 1 does no
    /// more work, and writes no more, than one of capacity + debt + 1.
    pub fn bounded_cost(&self, cost: u64) -> u64 {
        let most = self.limit.max(self.burst).saturating_add(self.debt());
        cost.min(most.saturating_add(1))
    }
}

/// The state of one counter.
#[derive(Debug, Clone, PartialEq)]
pub enum State {
    /// Hits in the epoch-aligned window starting at `start_ms`.
    FixedWindow { start_ms: u64, count: u64 },
    /// Hits in the window starting at `start_ms` and in the one before it.
    SlidingWindow {
        start_ms: u64,
        current: u64,
        previous: u64,
    },
    /// The requests still inside the window, oldest first: when each was counted and its cost.
    SlidingLog(Log),
    /// Tokens left at `last_ms`.
    TokenBucket { tokens: f64, last_ms: u64 },
    /// Theoretical arrival time, in microseconds.
    Gcra { tat_us: u64 },
}

/// The verdict for one cost at one instant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decision {
    pub allowed: bool,
    /// Quota left after this cost if allowed (0 when denied).
    pub remaining: u64,
    /// Time until the state is fully reset, after this cost if allowed.
    pub reset_ms: u64,
    /// When denied: the wait before the same cost would be allowed (0 when allowed).
    pub retry_ms: u64,
}

/// What a decision changes in a counter's state.
#[derive(Debug, Clone, PartialEq)]
pub enum Next {
    /// The state becomes this one.
    Set(State),
    /// The sliding log drops the entries that left the window and records these hits at now, in place.
    Log(Record),
}

impl Next {
    /// The state once this change is made to `state` (`None`: nothing stored yet).
    pub fn apply(self, p: &Params, state: Option<State>, now_ms: u64) -> State {
        match self {
            Self::Set(state) => state,
            Self::Log(record) => {
                let mut log = match state {
                    Some(State::SlidingLog(log)) => log,
                    _ => Log::default(),
                };
                log.record(p, record, now_ms);
                State::SlidingLog(log)
            }
        }
    }
}

/// Decides `cost` against `state` at `now_ms`. Returns the decision and, when the cost changes the
/// state, the state once it is consumed: an allowed cost above 0, or any cost on a fixed window, whose
/// counter counts every hit it is given (as the reference service does when asked to count denied
/// requests), or any cost above 0 of a limit that counts over its limit. `None` leaves the state as it
/// is.
pub fn decide(
    p: &Params,
    state: Option<&State>,
    now_ms: u64,
    cost: u64,
) -> (Decision, Option<State>) {
    let (decision, next) = decide_after(p, state, None, now_ms, cost);
    (
        decision,
        next.map(|next| next.apply(p, state.cloned(), now_ms)),
    )
}

/// [`decide`] for a store that changes state in place: `state` is the state as stored and `earlier`
/// what earlier checks of the same request will change in it; returns what this check changes on top
/// (a sliding log's hits accumulate, never copying the log).
pub fn decide_after(
    p: &Params,
    state: Option<&State>,
    earlier: Option<&Next>,
    now_ms: u64,
    cost: u64,
) -> (Decision, Option<Next>) {
    let state = match earlier {
        Some(Next::Set(state)) => Some(state),
        _ => state,
    };
    let (decision, next) = match p.algorithm {
        Algorithm::FixedWindow => wrap(fixed(p, state, now_ms, cost)),
        Algorithm::SlidingWindow => wrap(sliding_window(p, state, now_ms, cost)),
        Algorithm::SlidingLog => {
            let log = match state {
                Some(State::SlidingLog(log)) => Some(log),
                _ => None,
            };
            let earlier = match earlier {
                Some(Next::Log(record)) => *record,
                _ => Record::default(),
            };
            let (decision, record) = sliding_log::decide(p, log, earlier, now_ms, cost);
            (decision, Next::Log(record))
        }
        Algorithm::TokenBucket => wrap(token_bucket(p, state, now_ms, cost)),
        Algorithm::Gcra => wrap(gcra(p, state, now_ms, cost)),
    };
    let changes = cost > 0
        && (decision.allowed || p.algorithm == Algorithm::FixedWindow || p.count_over_limit);
    (decision, changes.then_some(next))
}

fn wrap((decision, state): (Decision, State)) -> (Decision, Next) {
    (decision, Next::Set(state))
}

/// What a counter holds at an instant, as an operator reads it: nothing here changes it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Usage {
    /// Hits the limit counts now: the window's count, the sliding window's estimate, the log's hits in
    /// the window, the tokens missing from the bucket, or GCRA's arrival time ahead of now in intervals.
    /// Past the limit (a limit that counts over it), more than the capacity.
    pub used: f64,
    /// Hits a request could still take now (0 when over).
    pub remaining: u64,
    /// Time until the state is as if no hit had happened.
    pub reset_ms: u64,
    /// A request of one hit would be denied now: the limit is at its capacity, or past it.
    pub over: bool,
}

/// What `state` holds for the limit `p` at `now_ms`.
pub fn usage(p: &Params, state: Option<&State>, now_ms: u64) -> Usage {
    let (checked, _) = decide(p, state, now_ms, 0);
    let used = match state {
        None => 0.0,
        Some(State::FixedWindow { start_ms, count })
            if *start_ms == fixed_window::window_start(now_ms, p.window_ms) =>
        {
            *count as f64
        }
        Some(State::FixedWindow { .. }) => 0.0,
        Some(State::SlidingWindow {
            start_ms,
            current,
            previous,
        }) => {
            let start = fixed_window::window_start(now_ms, p.window_ms);
            let weight = (p.window_ms - (now_ms - start)) as f64 / p.window_ms as f64;
            if *start_ms == start {
                *previous as f64 * weight + *current as f64
            } else if *start_ms + p.window_ms == start {
                *current as f64 * weight
            } else {
                0.0
            }
        }
        Some(State::SlidingLog(log)) => log.live_hits(p.window_ms, now_ms) as f64,
        Some(State::TokenBucket { tokens, last_ms }) => {
            let refilled =
                now_ms.saturating_sub(*last_ms) as f64 * p.limit as f64 / p.window_ms as f64;
            (p.burst as f64 - (tokens + refilled).min(p.burst as f64)).max(0.0)
        }
        Some(State::Gcra { tat_us }) => {
            let interval_us = p.window_ms.saturating_mul(1000).div_ceil(p.limit.max(1)) as f64;
            ((*tat_us as f64 - now_ms as f64 * 1000.0) / interval_us).max(0.0)
        }
    };
    Usage {
        used,
        remaining: checked.remaining,
        reset_ms: checked.reset_ms,
        over: !decide(p, state, now_ms, 1).0.allowed,
    }
}

/// When `state` is equivalent to no state at all: the store may forget it then.
pub fn expires_at_ms(p: &Params, state: &State, now_ms: u64) -> u64 {
    match state {
        State::FixedWindow { start_ms, .. } => start_ms + p.window_ms,
        State::SlidingWindow { start_ms, .. } => start_ms + 2 * p.window_ms,
        State::SlidingLog(log) => log.newest_ms().map_or(now_ms, |last| last + p.window_ms),
        State::TokenBucket { tokens, last_ms } => {
            last_ms
                + ((p.burst as f64 - tokens).max(0.0) * p.window_ms as f64 / p.limit.max(1) as f64)
                    .ceil() as u64
        }
        State::Gcra { tat_us } => tat_us.div_ceil(1000),
    }
}

fn fixed(p: &Params, state: Option<&State>, now_ms: u64, cost: u64) -> (Decision, State) {
    let start_ms = fixed_window::window_start(now_ms, p.window_ms);
    let count = match state {
        Some(State::FixedWindow { start_ms: s, count }) if *s == start_ms => *count,
        _ => 0,
    };
    let verdict = fixed_window::check(count, p.limit, cost);
    // Counting over the limit, the count stops at the debt past it (and never goes down).
    let counted = if p.count_over_limit {
        verdict
            .count_after
            .min(count.max(p.limit.saturating_add(p.debt())))
    } else {
        verdict.count_after
    };
    let reset_ms = fixed_window::seconds_until_reset(now_ms, p.window_ms);
    let decision = Decision {
        allowed: verdict.allowed,
        remaining: if verdict.allowed {
            fixed_window::remaining(verdict.count_after, p.limit)
        } else {
            0
        },
        reset_ms,
        retry_ms: if verdict.allowed { 0 } else { reset_ms },
    };
    (
        decision,
        State::FixedWindow {
            start_ms,
            count: counted,
        },
    )
}

fn sliding_window(p: &Params, state: Option<&State>, now_ms: u64, cost: u64) -> (Decision, State) {
    let w = p.window_ms;
    let start = fixed_window::window_start(now_ms, w);
    let (mut current, mut previous) = (0, 0);
    if let Some(State::SlidingWindow {
        start_ms,
        current: c,
        previous: prev,
    }) = state
    {
        if *start_ms == start {
            (current, previous) = (*c, *prev);
        } else if *start_ms + w == start {
            previous = *c;
        }
    }
    let elapsed = now_ms - start;
    let weight = (w - elapsed) as f64 / w as f64;
    let estimate = previous as f64 * weight + current as f64;
    let limit = p.limit as f64;
    let allowed = estimate + cost as f64 <= limit;
    let (after_current, after_estimate) = if allowed {
        (current + cost, estimate + cost as f64)
    } else if p.count_over_limit {
        // Counted beyond the limit, up to the debt: the excess weighs on the next window too, through
        // its previous count.
        let ceiling = current.max(p.limit.saturating_add(p.debt()));
        ((current + cost).min(ceiling), estimate)
    } else {
        (current, estimate)
    };
    let reset_ms = if after_current > 0 {
        start + 2 * w - now_ms
    } else if previous > 0 {
        start + w - now_ms
    } else {
        0
    };
    let retry_ms = if allowed {
        0
    } else {
        sliding_window_wait(p, current, previous, elapsed, cost)
    };
    (
        Decision {
            allowed,
            remaining: if allowed {
                (limit - after_estimate).max(0.0).floor() as u64
            } else {
                0
            },
            reset_ms,
            retry_ms,
        },
        State::SlidingWindow {
            start_ms: start,
            current: after_current,
            previous,
        },
    )
}

/// Smallest wait after which `previous * weight + current + cost <= limit`.
fn sliding_window_wait(p: &Params, current: u64, previous: u64, elapsed: u64, cost: u64) -> u64 {
    let w = p.window_ms as f64;
    let limit = p.limit as f64;
    let cost = cost as f64;
    if cost > limit {
        return p.window_ms * 2 - elapsed;
    }
    let left_in_window = w - elapsed as f64;
    if current as f64 + cost <= limit && previous > 0 {
        // The previous window's share decays enough within this window.
        let t = left_in_window - (limit - current as f64 - cost) * w / previous as f64;
        return t.max(0.0).ceil() as u64;
    }
    // Next window: `current` becomes the previous window and decays from there.
    let t = if current == 0 {
        0.0
    } else {
        (w - (limit - cost) * w / current as f64).max(0.0)
    };
    (left_in_window + t).ceil() as u64
}

fn token_bucket(p: &Params, state: Option<&State>, now_ms: u64, cost: u64) -> (Decision, State) {
    let capacity = p.burst as f64;
    let per_ms = p.limit as f64 / p.window_ms as f64;
    let tokens = match state {
        Some(State::TokenBucket { tokens, last_ms }) => {
            let elapsed = now_ms.saturating_sub(*last_ms) as f64;
            (tokens + elapsed * per_ms).min(capacity)
        }
        _ => capacity,
    };
    let cost_f = cost as f64;
    let allowed = cost_f <= tokens;
    let after = if allowed {
        tokens - cost_f
    } else if p.count_over_limit {
        // Into debt, down to the debt bound, repaid at the refill rate.
        (tokens - cost_f).max((-(p.debt() as f64)).min(tokens))
    } else {
        tokens
    };
    let refill_ms = |missing: f64| {
        if per_ms > 0.0 {
            (missing / per_ms).max(0.0).ceil() as u64
        } else {
            // A bucket that never refills: report one window.
            p.window_ms
        }
    };
    let retry_ms = if allowed {
        0
    } else if cost_f > capacity {
        p.window_ms
    } else {
        refill_ms(cost_f - tokens)
    };
    (
        Decision {
            allowed,
            remaining: if allowed { after.floor() as u64 } else { 0 },
            reset_ms: refill_ms(capacity - after),
            retry_ms,
        },
        State::TokenBucket {
            tokens: after,
            last_ms: now_ms,
        },
    )
}

fn gcra(p: &Params, state: Option<&State>, now_ms: u64, cost: u64) -> (Decision, State) {
    // Emission interval (whole microseconds, rounded up, so that every time below is a whole number
    // and two requests at the same instant are decided exactly) and tolerance.
    let interval_us = p.window_ms.saturating_mul(1000).div_ceil(p.limit.max(1)) as f64;
    let capacity_us = interval_us * p.burst as f64;
    let now_us = now_ms as f64 * 1000.0;
    let tat = match state {
        Some(State::Gcra { tat_us }) => (*tat_us as f64).max(now_us),
        _ => now_us,
    };
    let new_tat = tat + cost as f64 * interval_us;
    let allowed = p.limit > 0 && new_tat - now_us <= capacity_us;
    let kept = if allowed {
        new_tat
    } else if p.count_over_limit {
        // Ahead of the capacity by at most the debt.
        let ceiling = now_us + interval_us * p.burst.saturating_add(p.debt()) as f64;
        new_tat.min(tat.max(ceiling))
    } else {
        tat
    };
    let remaining = ((capacity_us - (kept - now_us)) / interval_us)
        .floor()
        .max(0.0) as u64;
    let retry_ms = if allowed {
        0
    } else if p.limit == 0 || cost > p.burst {
        p.window_ms
    } else {
        ((new_tat - capacity_us - now_us) / 1000.0).max(0.0).ceil() as u64
    };
    (
        Decision {
            allowed,
            remaining: if allowed { remaining } else { 0 },
            reset_ms: ((kept - now_us) / 1000.0).max(0.0).ceil() as u64,
            retry_ms,
        },
        State::Gcra {
            tat_us: kept.ceil() as u64,
        },
    )
}

#[cfg(test)]
mod tests;
