//! The sliding log: the time and hits of every request counted in the window, oldest first.
//!
//! Each entry keeps the running total of hits up to it, so the hits in the window, and how long a
//! denied cost waits for enough of them to leave, are found by binary search: a decision costs
//! O(log n) whatever the log holds, and a hit changes the log in place (the entries that left go, one is
//! added). The Redis script keeps the same entries in a sorted set, with their sum beside them, and
//! decides the same (src/store/redis/decide.lua).

use std::collections::VecDeque;

use super::{Decision, Params};

/// Most entries a sliding log that counts over its limit keeps, per hit of its limit: beyond, the
/// newest entry takes the new hits and moves to now, so memory stays bounded and the hits it holds leave
/// the window no sooner than they would have on their own.
pub const SLIDING_LOG_ENTRIES_PER_HIT: u64 = 2;

/// A denied cost's wait is looked for among this many of the oldest entries in the window at most: past
/// them it is when the last of them leaves, which is no later than the wait (a client told so asks again
/// early, and the deny cache forgets the denial early). A cost on a long log then reads a few hundred
/// entries, not the log; the Redis script reads no more either.
pub const WAIT_ENTRIES: usize = 256;

/// The requests still inside the window (or that left it since the last hit), oldest first. One entry per
/// request (or per instant), whatever its cost, so memory follows requests, never hits.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Log {
    /// When each entry was counted (ms) and the hits of every entry up to it, since `base`. Running
    /// totals wrap around: only their differences, the hits between two entries, mean something.
    entries: VecDeque<(u64, u64)>,
    /// The running total before the first entry.
    base: u64,
}

/// Hits one request (or the checks of one request on the same log so far) records at now: in a new
/// entry, or in the newest stored one, which then moves to now (`absorbs`; only a log that counts over its
/// limit does that).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Record {
    pub hits: u64,
    pub absorbs: bool,
}

impl Log {
    /// A log of these entries (time in ms, hits), oldest first.
    pub fn from_entries(entries: impl IntoIterator<Item = (u64, u64)>) -> Self {
        let mut log = Self::default();
        for (at, hits) in entries {
            let total = log.total_at(log.entries.len()).wrapping_add(hits);
            log.entries.push_back((at, total));
        }
        log
    }

    /// Every entry, oldest first: when it was counted and its hits.
    pub fn entries(&self) -> impl DoubleEndedIterator<Item = (u64, u64)> + '_ {
        (0..self.entries.len()).map(|i| (self.entries[i].0, self.hits_of(i)))
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// When the newest entry was counted.
    pub fn newest_ms(&self) -> Option<u64> {
        self.entries.back().map(|&(at, _)| at)
    }

    /// The running total before entry `i` (`len()`: after the last).
    fn total_at(&self, i: usize) -> u64 {
        if i == 0 {
            self.base
        } else {
            self.entries[i - 1].1
        }
    }

    fn hits_of(&self, i: usize) -> u64 {
        self.entries[i].1.wrapping_sub(self.total_at(i))
    }

    /// The first entry still in a window of `window_ms` at `now_ms`. Searched from the front in growing
    /// steps: few entries have left since the last hit, and those are the ones near the front, so a hit
    /// reads a few entries there rather than probing the whole log.
    fn first_live(&self, window_ms: u64, now_ms: u64) -> usize {
        let len = self.entries.len();
        let gone = |i: usize| self.entries[i].0.saturating_add(window_ms) <= now_ms;
        if len == 0 || !gone(0) {
            return 0;
        }
        // Entry `low` has left; the first that has not is in (low, high].
        let (mut low, mut step) = (0, 1);
        let mut high = loop {
            let next = low + step;
            if next >= len {
                break len;
            }
            if !gone(next) {
                break next;
            }
            (low, step) = (next, step * 2);
        };
        low += 1;
        while low < high {
            let mid = low + (high - low) / 2;
            if gone(mid) {
                low = mid + 1;
            } else {
                high = mid;
            }
        }
        low
    }

    /// The hits counted in the window at `now_ms`.
    pub fn live_hits(&self, window_ms: u64, now_ms: u64) -> u64 {
        let from = self.first_live(window_ms, now_ms);
        self.total_at(self.entries.len())
            .wrapping_sub(self.total_at(from))
    }

    /// Drops the entries that left the window and records `record` at `now_ms`.
    pub fn record(&mut self, p: &Params, record: Record, now_ms: u64) {
        let gone = self.first_live(p.window_ms, now_ms);
        if gone > 0 {
            self.base = self.total_at(gone);
            self.entries.drain(..gone);
        }
        if record.hits == 0 {
            return;
        }
        let total = self.total_at(self.entries.len()).wrapping_add(record.hits);
        match self.entries.back_mut() {
            Some(newest) if record.absorbs => *newest = (now_ms, total),
            _ => self.entries.push_back((now_ms, total)),
        }
    }
}

/// Decides `cost` on `log` as it is stored, after what the request's earlier checks of the same log
/// record (`earlier`); returns the decision and what the request records once this check is counted.
pub fn decide(
    p: &Params,
    log: Option<&Log>,
    earlier: Record,
    now_ms: u64,
    cost: u64,
) -> (Decision, Record) {
    let empty = Log::default();
    let log = log.unwrap_or(&empty);
    let from = log.first_live(p.window_ms, now_ms);
    let stored = log.entries.len() - from;
    let start = log.total_at(from);
    let count = log
        .total_at(log.entries.len())
        .wrapping_sub(start)
        .saturating_add(earlier.hits);
    let allowed = count.saturating_add(cost) <= p.limit;
    let retry_ms = if allowed {
        0
    } else if cost > p.limit {
        p.window_ms
    } else {
        // Enough of the oldest requests must leave the window to free `count + cost - limit` hits; those
        // recorded now (and the entry that took them in) leave last, a whole window from now.
        let must_leave = count + cost - p.limit;
        let usable = log.entries.len() - usize::from(earlier.absorbs);
        let (mut low, mut high) = (from, usable.max(from));
        while low < high {
            let mid = low + (high - low) / 2;
            if log.entries[mid].1.wrapping_sub(start) >= must_leave {
                high = mid;
            } else {
                low = mid + 1;
            }
        }
        // Saturating: entries are in time order unless the clock stepped back between two of them.
        let leaves = |i: usize| {
            log.entries[i]
                .0
                .saturating_add(p.window_ms)
                .saturating_sub(now_ms)
        };
        if low < usable && low - from < WAIT_ENTRIES {
            leaves(low)
        } else if usable.saturating_sub(from) > WAIT_ENTRIES {
            leaves(from + WAIT_ENTRIES - 1)
        } else {
            p.window_ms
        }
    };
    // Hits recorded: the cost when allowed; counting over the limit, as much of it as the debt holds.
    let hits = if allowed {
        cost
    } else if p.count_over_limit {
        cost.min(p.limit.saturating_add(p.debt()).saturating_sub(count))
    } else {
        0
    };
    let mut record = earlier;
    if hits > 0 {
        // A log that counts over its limit puts them in its newest entry when that one was counted at
        // this same instant, or when it already holds SLIDING_LOG_ENTRIES_PER_HIT x limit entries (the
        // entry then moves to now); so does the Redis script.
        if p.count_over_limit && earlier.hits == 0 && stored > 0 {
            let most = p.limit.saturating_mul(SLIDING_LOG_ENTRIES_PER_HIT);
            record.absorbs = log.newest_ms() == Some(now_ms) || stored as u64 >= most;
        }
        record.hits += hits;
    }
    let reset_ms = if record.hits > 0 {
        p.window_ms
    } else if stored > 0 {
        log.newest_ms().map_or(0, |last| {
            last.saturating_add(p.window_ms).saturating_sub(now_ms)
        })
    } else {
        0
    };
    (
        Decision {
            allowed,
            remaining: if allowed { p.limit - count - cost } else { 0 },
            reset_ms,
            retry_ms,
        },
        record,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algorithm::Algorithm;
    use rand::{rngs::SmallRng, Rng, SeedableRng};

    /// The log as the plain list it stands for, decided by reading every entry: what the running totals
    /// and binary searches must agree with.
    fn plain_decide(
        p: &Params,
        entries: &[(u64, u64)],
        earlier: Record,
        now_ms: u64,
        cost: u64,
    ) -> (Decision, Record) {
        let live: Vec<(u64, u64)> = entries
            .iter()
            .copied()
            .filter(|&(at, _)| at + p.window_ms > now_ms)
            .collect();
        let count = live.iter().map(|e| e.1).sum::<u64>() + earlier.hits;
        let allowed = count + cost <= p.limit;
        let mut retry_ms = 0;
        if !allowed {
            retry_ms = p.window_ms;
            if cost <= p.limit {
                let must_leave = count + cost - p.limit;
                let usable = &live[..live.len() - usize::from(earlier.absorbs)];
                let mut left = 0;
                for (i, &(at, hits)) in usable.iter().enumerate() {
                    left += hits;
                    if i == WAIT_ENTRIES - 1 || left >= must_leave {
                        if left >= must_leave || usable.len() > WAIT_ENTRIES {
                            retry_ms = at + p.window_ms - now_ms;
                        }
                        break;
                    }
                }
            }
        }
        let hits = if allowed {
            cost
        } else if p.count_over_limit {
            cost.min((p.limit + p.debt()).saturating_sub(count))
        } else {
            0
        };
        let mut record = earlier;
        if hits > 0 {
            if p.count_over_limit && earlier.hits == 0 && !live.is_empty() {
                record.absorbs = live.last().unwrap().0 == now_ms
                    || live.len() as u64 >= p.limit * SLIDING_LOG_ENTRIES_PER_HIT;
            }
            record.hits += hits;
        }
        let reset_ms = if record.hits > 0 {
            p.window_ms
        } else {
            live.last().map_or(0, |e| e.0 + p.window_ms - now_ms)
        };
        let remaining = if allowed { p.limit - count - cost } else { 0 };
        let decision = Decision {
            allowed,
            remaining,
            reset_ms,
            retry_ms,
        };
        (decision, record)
    }

    fn plain_record(p: &Params, entries: &mut Vec<(u64, u64)>, record: Record, now_ms: u64) {
        entries.retain(|&(at, _)| at + p.window_ms > now_ms);
        if record.hits == 0 {
            return;
        }
        match entries.last_mut() {
            Some(newest) if record.absorbs => *newest = (now_ms, newest.1 + record.hits),
            _ => entries.push((now_ms, record.hits)),
        }
    }

    /// Entries out of time order (the clock stepped back between two hits) never make a decision fail
    /// or wait past the time the latest entry leaves.
    #[test]
    fn a_log_written_across_a_clock_step_back_is_decided() {
        let p = Params {
            algorithm: Algorithm::SlidingLog,
            limit: 1,
            window_ms: 1_000,
            burst: 1,
            count_over_limit: false,
        };
        let hit = Record {
            hits: 1,
            absorbs: false,
        };
        let mut log = Log::default();
        log.record(&p, hit, 5_000);
        log.record(&p, hit, 3_000);
        // The entry of 5 000 leaves at 6 000.
        for cost in [0, 1, 2] {
            let (decision, _) = decide(&p, Some(&log), Record::default(), 4_100, cost);
            assert!(!decision.allowed, "{decision:?}");
            assert!(decision.retry_ms <= 1_900, "{decision:?}");
            assert!(decision.reset_ms <= 1_900, "{decision:?}");
        }
    }

    #[test]
    fn decides_as_a_plain_list_read_whole_would() {
        let mut rng = SmallRng::seed_from_u64(7);
        for round in 0..240 {
            // Small limits over short windows; one round in six long enough that a wait spans more
            // than WAIT_ENTRIES entries.
            let long = round % 6 == 0;
            let p = Params {
                algorithm: Algorithm::SlidingLog,
                limit: if long { 700 } else { rng.random_range(1..12) },
                window_ms: if long { 400 } else { rng.random_range(1..50) },
                burst: 0,
                count_over_limit: rng.random_bool(0.5),
            };
            let (mut log, mut plain) = (Log::default(), Vec::new());
            // Start the running totals near the end of their range: they wrap on the way.
            log.base = u64::MAX - rng.random_range(0..100);
            let mut now = 1_000_000;
            for step in 0..if long { 1_500 } else { 300 } {
                now += if long {
                    rng.random_range(0..2)
                } else {
                    [0, 0, 1, 2, 7, 30][rng.random_range(0..6)]
                };
                // A request of one to three checks of this log, recorded only when it consumes.
                let (mut record, mut plain_rec) = (Record::default(), Record::default());
                for _ in 0..rng.random_range(1..=3) {
                    let cost = [0, 1, 1, 2, 3, p.limit, p.limit + 1][rng.random_range(0..7)];
                    let (d, r) = decide(&p, Some(&log), record, now, cost);
                    let (pd, pr) = plain_decide(&p, &plain, plain_rec, now, cost);
                    assert_eq!(
                        (d, r),
                        (pd, pr),
                        "round {round} step {step}: {p:?} {plain:?}"
                    );
                    (record, plain_rec) = (r, pr);
                }
                if rng.random_bool(0.8) {
                    log.record(&p, record, now);
                    plain_record(&p, &mut plain, plain_rec, now);
                }
                let live: Vec<(u64, u64)> = log
                    .entries()
                    .filter(|&(at, _)| at + p.window_ms > now)
                    .collect();
                let plain_live: Vec<(u64, u64)> = plain
                    .iter()
                    .copied()
                    .filter(|&(at, _)| at + p.window_ms > now)
                    .collect();
                assert_eq!(live, plain_live, "round {round} step {step}");
                assert_eq!(
                    log.live_hits(p.window_ms, now),
                    plain_live.iter().map(|e| e.1).sum::<u64>()
                );
            }
        }
    }
}
