//! Dividing one bucket's pool (the tokens per second its rule allows the fleet) among the Envoys that
//! report it: pure arithmetic on the bucket's state, no I/O and no clock. The Redis script `share.lua`
//! mirrors [`apply`] operation for operation, members in the same (id) order; the tests of
//! `tests/rlqs_shares.rs` run one table of calls on both.
//!
//! The **pool** is, for each limit of the bucket's rule, its rate `limit / window`, less, for a fixed
//! window, the rate `ρ` at which others (`ShouldRateLimit` callers) spend it: the hits its counter holds
//! that the Envoys' reports did not add, over the time the window has run (at least a report period).
//! Early in a window a few hits say little, so over its first quarter `ρ` moves from the previous
//! window's rate to this one's: `ρ = w·current + (1 − w)·previous`, `w = min(1, elapsed / (window / 4))`.
//! The bucket keeps, per window, what reports added and the rates. The smallest over the limits.
//!
//! A **reserve**, a sixteenth of the pool, is held back for members that hold nothing (an Envoy that
//! subscribes, or one still waiting for its share): the others share the rest, so that a newcomer is
//! granted something at once, on whichever replica it reports to, without waiting for the others to
//! report and give some back.
//!
//! Two numbers per member:
//! - its **target**, the max-min fair share of the pool less the reserve, by demand: when the members
//!   together ask for no more than that, each gets its demand plus an equal part of what is left (one
//!   part more stays unassigned); when they ask for more, a level `λ` is found with
//!   `Σ min(demandᵢ, λ) = pool − reserve` and each gets `min(demand, λ)`. An Envoy that asks for little
//!   holds little; one that claims more than it needs (its denials count as demand) gets at most `λ`,
//!   what every busy Envoy gets.
//! - its **grant**, the tokens per second it was last sent, which it enforces until its assignment
//!   expires. Grants move towards targets only in ways that keep the sum of what members count for
//!   (their grants, or more while they are held: see below) within the pool: a listed member above its
//!   target comes down first, then a listed member below its target goes up, by at most what no member
//!   counted for before the call beyond half the reserve (the other half absorbs targets that move a
//!   little before their members report); a member that holds nothing may take all that is free but half
//!   the reserve (or half of what is free, when less than that is), so that the next newcomer gets some
//!   too. What a member gives back is handed out only once its lower assignment has had time to arrive:
//!   the two assignments go out on different streams, and the one that goes up may be applied before the
//!   one that goes down. A member that comes down is **held** at its old grant for the call's hold time
//!   (half a report period, at most a second): the sum counts the larger of its grant and what it held,
//!   so that whatever either Envoy enforces meanwhile stays within the pool. A member not listed keeps
//!   its grant until its own report, or until it expires.
//!
//! Grants change only by an eighth or more (or to or from zero): every changed token bucket starts full
//! at the Envoy, so small changes would cost a burst each for little. While more than half the reserve
//! is spent, or owed to members that lack more than an eighth of their target, a listed member above
//! its target by less than an eighth comes down
//! by an eighth (and goes up again no sooner than its next recomputation): the reserve and the need are
//! met once the members have reported, and no member is sent a run of tiny decreases. When the pool shrinks by less than an
//! eighth (others spend a little more of a window), the grants may stay above it; they never go above
//! the largest pool they were granted from, and so never above the rule's rate.

use std::collections::BTreeMap;

/// What one Envoy of a bucket reported and was given, as the bucket's state keeps it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Member {
    /// Requests per second it reported (allowed + denied since its previous report); `None` until a
    /// report covers some time (its first report, the subscription, covers none).
    pub demand: Option<f64>,
    /// Tokens per second it was last assigned.
    pub grant: f64,
    /// Milliseconds since the epoch until which its grant counts: the TTL of its last assignment, plus
    /// a margin. After it, the member is forgotten.
    pub expires_ms: u64,
    /// Bumped at every assignment computed for it, so that a stream never sends an older one after a
    /// newer; never below what its stream says it sent (see [`Listed::sent_version`]).
    pub version: u64,
    /// What it held before its grant last came down: its Envoy may still enforce that until the lower
    /// assignment arrives, so it counts in the sum of grants until `held_until_ms`.
    pub held: f64,
    /// Milliseconds since the epoch until which `held` counts (0: nothing held).
    pub held_until_ms: u64,
}

impl Member {
    /// What it counts for in the sum of grants at `now_ms`: its grant, or what it held while that counts.
    pub fn counted(&self, now_ms: u64) -> f64 {
        if self.held_until_ms > now_ms {
            self.grant.max(self.held)
        } else {
            self.grant
        }
    }
}

/// How a member's demand changes in a call.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum DemandUpdate {
    /// No report from it: a member listed to be pushed a better share.
    Keep,
    /// A report that covers no time: a subscription.
    Unknown,
    /// Requests per second over the time its report covers.
    Rate(f64),
}

/// Why a member is listed in a call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Listing {
    /// It reported: it is answered now, so its assignment's TTL starts again.
    Reported,
    /// It did not report, but its stream is at hand: it is sent a new assignment if its grant changes.
    Pushed,
}

/// One member of a call.
#[derive(Debug, Clone, PartialEq)]
pub struct Listed {
    pub id: String,
    pub demand: DemandUpdate,
    pub listing: Listing,
    /// The version its stream last sent it (0 for none). A member the store lost (a Redis restart,
    /// flush or eviction) is created again above it, or the stream would drop its answers until the
    /// new versions caught up.
    pub sent_version: u64,
}

/// The state of one bucket: its members, and what reports added to each fixed window of its limits.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Bucket {
    /// By member id.
    pub members: BTreeMap<String, Member>,
    /// For each limit (by its position in the rule), the window reports last added to.
    pub windows: BTreeMap<usize, Window>,
}

/// What a bucket knows of one fixed window of a limit.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Window {
    /// Its start, ms since the epoch.
    pub start_ms: u64,
    /// Hits the Envoys' reports added to it.
    pub added: f64,
    /// The rate others spend it at, as last estimated.
    pub rate: f64,
    /// The rate others spent the previous window at.
    pub previous: f64,
}

/// One limit of the bucket's rule, as a call sees it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LimitUse {
    /// Its rate: tokens per second (`limit / window`).
    pub rate: f64,
    /// For a fixed window, what its counter says now.
    pub window: Option<WindowUse>,
}

/// A fixed window's counter after a report was added to it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WindowUse {
    /// The window's start, ms since the epoch.
    pub start_ms: u64,
    /// Hits the counter holds (the limit less what it has left), this report's included.
    pub used: f64,
    /// Hits this report added.
    pub added: f64,
    /// The window's length, in ms.
    pub window_ms: u64,
    /// Time the window has run, in ms.
    pub elapsed_ms: u64,
    /// Least time a rate is measured over: a report period (at most the window), in ms.
    pub floor_ms: u64,
}

/// One recomputation of a bucket.
#[derive(Debug, Clone, PartialEq)]
pub struct Call {
    /// The limits of the bucket's rule: the pool follows from them.
    pub limits: Vec<LimitUse>,
    /// How long an assignment sent now counts, in milliseconds: its TTL plus a margin.
    pub counts_for_ms: u64,
    /// How long a member that comes down still counts at its old grant, in milliseconds: the time its
    /// lower assignment may take to reach its Envoy.
    pub hold_ms: u64,
    /// Most members a bucket keeps; a newcomer past it is refused.
    pub max_members: usize,
    pub members: Vec<Listed>,
}

/// What a listed member is given.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Given {
    /// Its grant (tokens per second) and target, whether the grant changed in this call, and the version
    /// of this assignment.
    Share {
        grant: f64,
        target: f64,
        changed: bool,
        version: u64,
    },
    /// A newcomer to a bucket that already has `max_members` members.
    Full,
    /// A pushed member the bucket no longer has (it expired).
    Gone,
}

/// The outcome of a call.
#[derive(Debug, Clone, PartialEq)]
pub struct Reply {
    /// One per listed member, in order.
    pub given: Vec<Given>,
    /// Tokens per second the members share.
    pub pool: f64,
    /// Members the bucket has after the call.
    pub members: usize,
    /// Sum of their grants.
    pub granted: f64,
}

/// The part of the pool held back for members that hold nothing.
pub fn reserve(pool: f64) -> f64 {
    pool / 16.0
}

/// A grant changes only by more than an eighth, or to or from zero (a decrease that meets the reserve
/// or others' need steps by an eighth: see [`regrant`]).
pub fn significant(old: f64, new: f64) -> bool {
    new != old && (old == 0.0 || new == 0.0 || (new - old).abs() * 8.0 > old)
}

/// The max-min fair targets of `demands` in a pool of `pool` (see the module documentation).
pub fn targets(pool: f64, demands: &[f64]) -> Vec<f64> {
    let n = demands.len();
    let mut out = vec![0.0; n];
    if n == 0 {
        return out;
    }
    let mut asked = 0.0;
    for d in demands {
        asked += d;
    }
    if asked <= pool {
        let extra = (pool - asked) / (n as f64 + 1.0);
        for (t, d) in out.iter_mut().zip(demands) {
            *t = d + extra;
        }
        return out;
    }
    // Smallest demands first: each gets its demand while that is below an equal part of what is left.
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by(|&a, &b| demands[a].total_cmp(&demands[b]).then(a.cmp(&b)));
    let mut left = pool;
    let mut count = n as f64;
    let mut level = None;
    for &i in &order {
        let share = match level {
            Some(level) => level,
            None => left / count,
        };
        if level.is_none() && demands[i] <= share {
            out[i] = demands[i];
            left -= demands[i];
            count -= 1.0;
        } else {
            level = Some(share);
            out[i] = share;
        }
    }
    out
}

/// The pool of a call (see the module documentation), recording what this report added to each window.
pub fn pool(windows: &mut BTreeMap<usize, Window>, limits: &[LimitUse]) -> f64 {
    let mut pool = f64::INFINITY;
    for (k, limit) in limits.iter().enumerate() {
        let mut rate = limit.rate;
        if let Some(w) = limit.window {
            let known = windows.get(&k).copied().unwrap_or_default();
            let spent = if w.start_ms.saturating_add(w.window_ms) <= known.start_ms {
                // A report of a window that ended before the one recorded began (it waited behind
                // reports of the next): the recorded window stands, and others spend at its rate.
                // A window of another length (the rule changed) is not one before.
                known.rate
            } else {
                let (added, previous) = if known.start_ms == w.start_ms {
                    (known.added + w.added, known.previous)
                } else {
                    (w.added, known.rate)
                };
                let others = (w.used - added).max(0.0);
                let current = others * 1000.0 / w.elapsed_ms.max(w.floor_ms).max(1) as f64;
                let weight = (w.elapsed_ms as f64 / (w.window_ms as f64 / 4.0).max(1.0)).min(1.0);
                let spent = weight * current + (1.0 - weight) * previous;
                windows.insert(
                    k,
                    Window {
                        start_ms: w.start_ms,
                        added,
                        rate: spent,
                        previous,
                    },
                );
                spent
            };
            rate = (rate - spent).max(0.0);
        }
        pool = pool.min(rate);
    }
    if pool == f64::INFINITY {
        0.0
    } else {
        pool
    }
}

/// Recomputes a bucket at `now_ms`: forgets expired members, takes the listed members' reports,
/// computes the pool, every target, and moves the listed members' grants (see the module
/// documentation).
pub fn apply(bucket: &mut Bucket, now_ms: u64, call: &Call) -> Reply {
    let pool = pool(&mut bucket.windows, &call.limits);
    let members = &mut bucket.members;
    members.retain(|_, m| m.expires_ms > now_ms);
    let mut given = vec![Given::Gone; call.members.len()];
    for (slot, listed) in given.iter_mut().zip(&call.members) {
        if let Some(member) = members.get_mut(&listed.id) {
            match listed.demand {
                DemandUpdate::Keep => {}
                DemandUpdate::Unknown => member.demand = None,
                DemandUpdate::Rate(rate) => member.demand = Some(rate),
            }
            member.version = member.version.max(listed.sent_version);
            *slot = Given::Share {
                grant: 0.0,
                target: 0.0,
                changed: false,
                version: 0,
            };
        } else if listed.listing == Listing::Reported {
            if members.len() >= call.max_members {
                *slot = Given::Full;
                continue;
            }
            let demand = match listed.demand {
                DemandUpdate::Rate(rate) => Some(rate),
                DemandUpdate::Keep | DemandUpdate::Unknown => None,
            };
            members.insert(
                listed.id.clone(),
                Member {
                    demand,
                    grant: 0.0,
                    expires_ms: now_ms.saturating_add(call.counts_for_ms),
                    version: listed.sent_version,
                    held: 0.0,
                    held_until_ms: 0,
                },
            );
            *slot = Given::Share {
                grant: 0.0,
                target: 0.0,
                changed: false,
                version: 0,
            };
        }
    }

    // Members in id order: the script sums and sorts in the same order.
    let ids: Vec<&String> = members.keys().collect();
    let shared = pool - reserve(pool);
    let estimate = shared / ids.len().max(1) as f64;
    let demands: Vec<f64> = members
        .values()
        .map(|m| m.demand.unwrap_or(estimate))
        .collect();
    let targets = targets(shared, &demands);
    let mut grants: Vec<f64> = members.values().map(|m| m.grant).collect();
    let counted: Vec<f64> = members.values().map(|m| m.counted(now_ms)).collect();
    // `ids` is sorted (a map's keys): a call listing many members of a large bucket stays
    // O(listed · log members).
    let index: Vec<Option<usize>> = call
        .members
        .iter()
        .map(|l| ids.binary_search(&&l.id).ok())
        .collect();
    let listed: Vec<usize> = index
        .iter()
        .zip(&given)
        .filter_map(|(i, g)| i.filter(|_| matches!(g, Given::Share { .. })))
        .collect();
    let before = grants.clone();
    regrant(pool, &mut grants, &counted, &targets, &listed);

    let ids: Vec<String> = ids.into_iter().cloned().collect();
    for (slot, (listed, i)) in given.iter_mut().zip(call.members.iter().zip(&index)) {
        let (Given::Share { .. }, Some(i)) = (*slot, *i) else {
            continue;
        };
        let changed = grants[i] != before[i];
        let Some(member) = members.get_mut(&ids[i]) else {
            continue;
        };
        if grants[i] < before[i] && call.hold_ms > 0 {
            // Held from its last decrease on, and never for less than a hold still running (a call
            // from a replica with a shorter report period).
            member.held = counted[i];
            member.held_until_ms = member
                .held_until_ms
                .max(now_ms.saturating_add(call.hold_ms));
        }
        member.grant = grants[i];
        if listed.listing == Listing::Reported || changed {
            member.version = member.version.saturating_add(1);
            member.expires_ms = now_ms.saturating_add(call.counts_for_ms);
        }
        *slot = Given::Share {
            grant: grants[i],
            target: targets[i],
            changed,
            version: member.version,
        };
    }
    let mut granted = 0.0;
    for g in &grants {
        granted += g;
    }
    Reply {
        given,
        pool,
        members: members.len(),
        granted,
    }
}

/// Moves the grants of the `listed` members towards their targets without the sum of what all members
/// count for going above `pool`: decreases first, then increases out of what no member counted for
/// before the call beyond half the reserve (for a member that held nothing, all but half of what was
/// free). `counted` is what each member counts for before the call: its grant, or more while it is held
/// at what it had before it last came down.
///
/// What a decrease frees is not given in the same call, nor in any call while the member is held. The
/// lower grant and the higher one go out on different streams, and an Envoy may apply its new assignment
/// before the other has read its own: meanwhile both would be enforced at once, above the pool.
pub fn regrant(pool: f64, grants: &mut [f64], counted: &[f64], targets: &[f64], listed: &[usize]) {
    let reserve = reserve(pool);
    let mut total = 0.0;
    let mut need = 0.0;
    for ((g, c), t) in grants.iter().zip(counted).zip(targets) {
        total += c;
        if t > g && significant(*g, *t) {
            need += t - g;
        }
    }
    // More than half the reserve spent, or owed to members that wait for more.
    let short = total + need > pool - reserve / 2.0;
    let mut lowered = vec![false; grants.len()];
    for &j in listed {
        let (grant, target) = (grants[j], targets[j]);
        if target < grant {
            let new = if significant(grant, target) {
                target
            } else if short {
                target.min(grant - grant / 8.0)
            } else {
                continue;
            };
            // `total` keeps what it counted for: its room is for a later call.
            grants[j] = new;
            lowered[j] = true;
        }
    }
    for &j in listed {
        let (grant, target) = (grants[j], targets[j]);
        if target > grant && !lowered[j] {
            let room = if grant == 0.0 {
                let free = pool - total;
                (free - reserve / 2.0).max(free / 2.0)
            } else {
                pool - reserve / 2.0 - total
            };
            // Up to what it is held at costs nothing more: its Envoy may enforce that already.
            let new = target.min(counted[j] + room.max(0.0));
            if new > grant && significant(grant, new) {
                total += new.max(counted[j]) - counted[j];
                grants[j] = new;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    /// A call with no hold: each call of these tests comes after the assignments of the one before it
    /// arrived (`a_member_that_came_down_is_held_at_its_old_grant_until_its_assignment_arrived` has one).
    fn call(pool: f64, members: &[(&str, DemandUpdate, Listing)]) -> Call {
        Call {
            limits: vec![LimitUse {
                rate: pool,
                window: None,
            }],
            counts_for_ms: 10_000,
            hold_ms: 0,
            max_members: 100,
            members: members
                .iter()
                .map(|(id, demand, listing)| Listed {
                    id: id.to_string(),
                    demand: *demand,
                    listing: *listing,
                    sent_version: 0,
                })
                .collect(),
        }
    }

    fn grant(reply: &Reply, i: usize) -> f64 {
        match reply.given[i] {
            Given::Share { grant, .. } => grant,
            other => panic!("no share: {other:?}"),
        }
    }

    use DemandUpdate::{Keep, Rate, Unknown};
    use Listing::{Pushed, Reported};

    #[test]
    fn demand_below_the_pool_is_met_and_the_rest_spread_with_one_part_kept_free() {
        // 100 per second, demands 10 and 30: 60 left, a third each, a third unassigned.
        assert_eq!(targets(100.0, &[10.0, 30.0]), vec![30.0, 50.0]);
    }

    #[test]
    fn demand_above_the_pool_is_cut_at_one_level_for_the_busy_ones() {
        // 90 per second: the one asking 10 gets 10, the two busy ones 40 each.
        assert_eq!(targets(90.0, &[10.0, 100.0, 60.0]), vec![10.0, 40.0, 40.0]);
        // An Envoy claiming a huge demand gets no more than the other busy one.
        assert_eq!(targets(100.0, &[1e12, 80.0]), vec![50.0, 50.0]);
    }

    /// A limit of 800 per 8 s windows as a call of the window starting at `start_ms` sees it.
    fn at(start_ms: u64, used: f64, added: f64, elapsed_ms: u64) -> LimitUse {
        LimitUse {
            rate: 100.0,
            window: Some(WindowUse {
                start_ms,
                used,
                added,
                window_ms: 8_000,
                elapsed_ms,
                floor_ms: 200,
            }),
        }
    }

    #[test]
    fn what_others_spend_of_a_fixed_window_comes_off_the_pool_and_reports_do_not() {
        let mut windows = BTreeMap::new();
        let window = |used, added, elapsed| at(56_000, used, added, elapsed);
        // Reports added 300 of the 300 counted after 3 s: the whole rate is the Envoys'.
        assert_eq!(pool(&mut windows, &[window(300.0, 300.0, 3_000)]), 100.0);
        // 90 more counted by 4 s, of which reports added 30: others spend 60 in 4 s.
        assert_eq!(pool(&mut windows, &[window(390.0, 30.0, 4_000)]), 85.0);
        // A new window: half-way through its first quarter, half of the previous window's 15 a second
        // still counts.
        let next = at(64_000, 5.0, 5.0, 1_000);
        assert_eq!(pool(&mut windows, &[next]), 92.5);
        // The smallest of the limits, never below zero.
        let other = LimitUse {
            rate: 10.0,
            window: None,
        };
        assert_eq!(pool(&mut windows, &[next, other]), 10.0);
        assert_eq!(pool(&mut windows, &[at(64_000, 10_000.0, 0.0, 1_000)]), 0.0);
        assert_eq!(pool(&mut windows, &[]), 0.0);
    }

    /// A report of a window that comes after reports of the next one (its call waited) changes
    /// nothing recorded: the next window keeps the hits reports added to it.
    #[test]
    fn a_late_report_of_the_window_before_leaves_the_next_one_as_recorded() {
        let mut windows = BTreeMap::new();
        // The new window: 100 counted after 2 s, all of them added by a report.
        assert_eq!(
            pool(&mut windows, &[at(64_000, 100.0, 100.0, 2_000)]),
            100.0
        );
        let recorded = windows[&0];
        // The window before, reported late: the pool is what the new window leaves.
        assert_eq!(pool(&mut windows, &[at(56_000, 700.0, 50.0, 7_900)]), 100.0);
        assert_eq!(windows[&0], recorded);
        // The new window's next report: both reports' hits are the Envoys', none are others'.
        assert_eq!(pool(&mut windows, &[at(64_000, 150.0, 50.0, 3_000)]), 100.0);
        assert_eq!(windows[&0].added, 150.0);
        // The rule changed to 24 s windows: the one from 48 000 runs on past 64 000, and is recorded.
        let mut longer = at(48_000, 400.0, 10.0, 17_000);
        if let Some(w) = &mut longer.window {
            w.window_ms = 24_000;
        }
        pool(&mut windows, &[longer]);
        assert_eq!((windows[&0].start_ms, windows[&0].added), (48_000, 10.0));
    }

    #[test]
    fn a_subscriber_is_served_at_once_from_what_no_one_holds() {
        let mut m = Bucket::default();
        let r = apply(&mut m, 0, &call(100.0, &[("a", Unknown, Reported)]));
        // Alone, its demand is estimated as the whole pool less the reserve: it gets all of that.
        assert_eq!(grant(&r, 0), 93.75);
        // A second subscriber: the rest is all held, so it gets half the reserve, at once.
        let r = apply(&mut m, 1, &call(100.0, &[("b", Unknown, Reported)]));
        assert_eq!(grant(&r, 0), 3.125);
        // `a` reports 10 per second: it comes down, and `b` (listed for a push) keeps what it holds,
        // for `a` may not have applied its lower grant yet.
        let r = apply(
            &mut m,
            2,
            &call(100.0, &[("a", Rate(10.0), Reported), ("b", Keep, Pushed)]),
        );
        let (a, b) = (grant(&r, 0), grant(&r, 1));
        // Targets: a = 10 + 36.875/3, b = 46.875 + 36.875/3 (its demand estimated as half of 93.75).
        assert!((a - (10.0 + 36.875 / 3.0)).abs() < 1e-9, "{a}");
        assert_eq!(b, 3.125);
        // At the next recomputation `b` gets what `a` freed.
        let r = apply(&mut m, 3, &call(100.0, &[("b", Keep, Pushed)]));
        let b = grant(&r, 0);
        assert!(a + b <= 100.0 - 6.25);
        assert!((b - (46.875 + 36.875 / 3.0)).abs() < 1e-9, "{b}");
    }

    #[test]
    fn newcomers_are_granted_from_the_reserve_while_the_rest_is_all_held() {
        let mut m = Bucket::default();
        for who in ["a", "b", "a", "b"] {
            apply(&mut m, 0, &call(100.0, &[(who, Rate(500.0), Reported)]));
        }
        let held: f64 = m.members.values().map(|x| x.grant).sum();
        assert_eq!(held, 93.75, "the two busy ones share all but the reserve");
        // Three Envoys subscribe before either busy one reports again: each is granted something at
        // once, the next one half of what the last left, and the grants stay within the pool.
        let mut last = f64::INFINITY;
        for who in ["c", "d", "e"] {
            let r = apply(&mut m, 1, &call(100.0, &[(who, Unknown, Reported)]));
            let got = grant(&r, 0);
            assert!(got > 0.0 && got < last, "{who}: {got}");
            assert!(r.granted <= 100.0, "{r:?}");
            last = got;
        }
        // Once the busy ones have reported, the reserve is whole again.
        for who in ["a", "b"] {
            apply(&mut m, 2, &call(100.0, &[(who, Rate(500.0), Reported)]));
        }
        let held: f64 = m.members.values().map(|x| x.grant).sum();
        assert!(held <= 93.75 + 1e-9, "{held}");
    }

    #[test]
    fn a_member_that_must_make_room_comes_down_by_an_eighth_not_by_a_little() {
        let mut m = Bucket::default();
        for who in ["a", "b", "a", "b"] {
            apply(&mut m, 0, &call(100.0, &[(who, Rate(500.0), Reported)]));
        }
        // `c` asks 10 a second: a's and b's targets fall by 5, less than an eighth of their grants.
        apply(&mut m, 1, &call(100.0, &[("c", Rate(10.0), Reported)]));
        let before = m.members["a"].grant;
        let r = apply(&mut m, 2, &call(100.0, &[("a", Rate(500.0), Reported)]));
        let after = grant(&r, 0);
        let Given::Share { target, .. } = r.given[0] else {
            panic!()
        };
        assert!(
            target < before && (before - target) * 8.0 < before,
            "{before} {target}"
        );
        // It comes down, as `c` waits, but by an eighth: one fresh token bucket, not a run of them.
        assert!(
            after <= before * 7.0 / 8.0 * (1.0 + 1e-12),
            "{before} -> {after}"
        );
        assert!(after <= target);
    }

    #[test]
    fn a_rising_envoy_takes_only_what_the_others_have_given_back() {
        let mut m = Bucket::default();
        apply(&mut m, 0, &call(100.0, &[("a", Rate(50.0), Reported)]));
        apply(&mut m, 0, &call(100.0, &[("b", Rate(40.0), Reported)]));
        apply(&mut m, 0, &call(100.0, &[("a", Rate(50.0), Reported)]));
        // b rises to 200: its target is 46.875 (half the pool less the reserve), but a holds more
        // than its own until it reports.
        let r = apply(&mut m, 1, &call(100.0, &[("b", Rate(200.0), Reported)]));
        let held: f64 = m.members.values().map(|x| x.grant).sum();
        assert!(held <= 100.0, "{held}");
        assert!(grant(&r, 0) < 50.0);
        // a reports less: it comes down, and b (pushed) takes the rest up to its target once a's lower
        // grant was sent, at the next recomputation.
        let b = grant(&r, 0);
        let r = apply(
            &mut m,
            2,
            &call(100.0, &[("a", Rate(30.0), Reported), ("b", Keep, Pushed)]),
        );
        assert_eq!((grant(&r, 0), grant(&r, 1)), (30.0, b));
        let r = apply(&mut m, 3, &call(100.0, &[("b", Keep, Pushed)]));
        assert_eq!(grant(&r, 0), 63.75);
    }

    #[test]
    fn a_member_that_came_down_is_held_at_its_old_grant_until_its_assignment_arrived() {
        let held = |pool: f64, members: &[(&str, DemandUpdate, Listing)]| Call {
            hold_ms: 100,
            ..call(pool, members)
        };
        let mut m = Bucket::default();
        apply(&mut m, 0, &held(100.0, &[("a", Unknown, Reported)]));
        apply(&mut m, 0, &held(100.0, &[("b", Unknown, Reported)]));
        // a (93.75) reports 10 a second and comes down; b reports 500 a moment later, on another
        // replica, before a's lower assignment can have arrived: b gets nothing of what a gave back.
        let r = apply(&mut m, 10, &held(100.0, &[("a", Rate(10.0), Reported)]));
        let a = grant(&r, 0);
        assert!(a < 30.0, "{a}");
        let r = apply(&mut m, 20, &held(100.0, &[("b", Rate(500.0), Reported)]));
        assert_eq!(grant(&r, 0), 3.125, "{r:?}");
        assert_eq!(m.members["a"].counted(20), 93.75);
        // a comes down again meanwhile: it is still held at the larger of the two.
        let r = apply(&mut m, 50, &held(100.0, &[("a", Rate(2.0), Reported)]));
        assert!(grant(&r, 0) < a);
        assert_eq!(m.members["a"].counted(100), 93.75);
        // The hold runs from a's last decrease: at 150 ms it is over, and b gets its share.
        let r = apply(&mut m, 149, &held(100.0, &[("b", Rate(500.0), Reported)]));
        assert_eq!(grant(&r, 0), 3.125, "still held at 149 ms");
        let r = apply(&mut m, 150, &held(100.0, &[("b", Rate(500.0), Reported)]));
        let b = grant(&r, 0);
        assert!(b > 80.0 && b + m.members["a"].grant <= 100.0 - 6.25, "{b}");
    }

    #[test]
    fn a_shorter_hold_does_not_cut_short_one_still_running() {
        // Replicas with different report periods hold for different times: a member that comes down
        // again in a call with a shorter hold (or none) stays held as long as the first hold said.
        let mut m = Bucket::default();
        apply(&mut m, 0, &call(100.0, &[("a", Unknown, Reported)]));
        apply(&mut m, 0, &call(100.0, &[("b", Unknown, Reported)]));
        let long = Call {
            hold_ms: 1_000,
            ..call(100.0, &[("a", Rate(40.0), Reported)])
        };
        apply(&mut m, 10, &long);
        for hold_ms in [100, 0] {
            let short = Call {
                hold_ms,
                ..call(100.0, &[("a", Rate(1.0), Reported)])
            };
            apply(&mut m, 20, &short);
            assert_eq!(m.members["a"].counted(999), 93.75, "hold {hold_ms}");
        }
        let a = m.members["a"];
        assert!(a.grant < 20.0, "{a:?}");
        assert_eq!(a.counted(1_010), a.grant, "the first hold is over");
    }

    #[test]
    fn an_expired_member_gives_its_grant_back() {
        let mut m = Bucket::default();
        apply(&mut m, 0, &call(100.0, &[("a", Rate(80.0), Reported)]));
        apply(&mut m, 5_000, &call(100.0, &[("b", Rate(80.0), Reported)]));
        let r = apply(&mut m, 10_000, &call(100.0, &[("b", Rate(80.0), Reported)]));
        assert_eq!(r.members, 1);
        // a expired at 10 000 ms: b has the whole demand it asks for.
        assert!(grant(&r, 0) >= 80.0);
    }

    #[test]
    fn a_full_bucket_refuses_newcomers_and_pushes_to_the_forgotten_are_gone() {
        let mut m = Bucket::default();
        let mut c = call(10.0, &[("a", Rate(1.0), Reported)]);
        c.max_members = 1;
        apply(&mut m, 0, &c);
        c.members[0].id = "b".into();
        assert_eq!(apply(&mut m, 0, &c).given, vec![Given::Full]);
        let r = apply(&mut m, 0, &call(10.0, &[("z", Keep, Pushed)]));
        assert_eq!(r.given, vec![Given::Gone]);
    }

    #[test]
    fn small_changes_keep_the_grant_and_its_version_moves_only_when_sent() {
        let mut m = Bucket::default();
        apply(&mut m, 0, &call(100.0, &[("a", Rate(100.0), Reported)]));
        let r = apply(&mut m, 0, &call(100.0, &[("a", Rate(200.0), Reported)]));
        let Given::Share {
            changed, version, ..
        } = r.given[0]
        else {
            panic!()
        };
        assert!(!changed);
        assert_eq!(version, 2, "answered twice");
        let r = apply(&mut m, 0, &call(100.0, &[("a", Keep, Pushed)]));
        assert!(matches!(
            r.given[0],
            Given::Share {
                changed: false,
                version: 2,
                ..
            }
        ));
    }

    #[test]
    fn an_assignment_that_counts_for_ever_does_not_wrap_to_expire_at_once() {
        let mut m = Bucket::default();
        let mut c = call(100.0, &[("a", Rate(10.0), Reported)]);
        c.counts_for_ms = u64::MAX;
        apply(&mut m, 1_000, &c);
        let r = apply(&mut m, 2_000, &call(100.0, &[("b", Rate(10.0), Reported)]));
        assert_eq!(r.members, 2, "a still counts");
        assert_eq!(m.members["a"].expires_ms, u64::MAX);
    }

    #[test]
    fn a_member_the_store_lost_comes_back_above_the_version_its_stream_sent() {
        let mut m = Bucket::default();
        let mut c = call(100.0, &[("a", Rate(10.0), Reported)]);
        c.members[0].sent_version = 41;
        let r = apply(&mut m, 0, &c);
        assert!(
            matches!(r.given[0], Given::Share { version: 42, .. }),
            "{r:?}"
        );
        // A stored version behind the stream's (a store that lost part of its state) moves up too.
        m.members.get_mut("a").unwrap().version = 3;
        c.members[0].sent_version = 42;
        let r = apply(&mut m, 1, &c);
        assert!(
            matches!(r.given[0], Given::Share { version: 43, .. }),
            "{r:?}"
        );
    }

    proptest! {
        /// A pool that shrinks (others spending more of a window, a limit lowered): the grants never add
        /// up to more than the largest pool they were granted from, and once every member has reported
        /// again with its demand unchanged, not to more than the pool.
        #[test]
        fn grants_follow_a_shrinking_pool(
            steps in proptest::collection::vec(
                (0usize..5, 0.0f64..500.0, prop::bool::weighted(0.15), 0.5f64..1.0, prop::bool::ANY, 0u64..1_500),
                1..80,
            ),
            first in 10.0f64..1_000.0,
        ) {
            let mut m = Bucket::default();
            let (mut now, mut pool) = (0, first);
            let mut demands: BTreeMap<String, f64> = BTreeMap::new();
            let call = |pool: f64, members: Vec<(String, DemandUpdate, Listing)>| Call {
                limits: vec![LimitUse { rate: pool, window: None }],
                counts_for_ms: 5_000,
                hold_ms: 0,
                max_members: 10,
                members: members
                    .into_iter()
                    .map(|(id, demand, listing)| Listed { id, demand, listing, sent_version: 0 })
                    .collect(),
            };
            let live_sum = |m: &Bucket, now: u64| -> f64 {
                m.members.values().filter(|x| x.expires_ms > now).map(|x| x.grant).sum()
            };
            for (who, rate, shrink, factor, push_all, dt) in steps {
                now += dt;
                if shrink {
                    pool *= factor;
                }
                let id = format!("m{who}");
                demands.insert(id.clone(), rate);
                let mut members = vec![(id, Rate(rate), Reported)];
                if push_all {
                    for other in (0..5).filter(|o| *o != who) {
                        members.push((format!("m{other}"), Keep, Pushed));
                    }
                }
                apply(&mut m, now, &call(pool, members));
                let sum = live_sum(&m, now);
                prop_assert!(sum <= first * (1.0 + 1e-12), "{sum} > {first}");
            }
            // Every member reports once more, as it did last: the targets hold still meanwhile.
            let ids: Vec<String> = m.members.keys().cloned().collect();
            for id in ids {
                let rate = demands[&id];
                apply(&mut m, now, &call(pool, vec![(id, Rate(rate), Reported)]));
            }
            let sum = live_sum(&m, now);
            prop_assert!(sum <= pool * (1.0 + 1e-12), "{sum} > {pool} once all reported");
        }

        /// Whatever the reports, pushes, expiries and holds: an Envoy may enforce any grant its member had
        /// during the last hold time (an assignment sent then may still be on its way), and the largest
        /// of each member's, summed, never goes above the pool.
        #[test]
        fn grants_never_exceed_the_pool_even_while_assignments_are_on_their_way(
            steps in proptest::collection::vec(
                (0usize..6, 0u8..3, 0.0f64..500.0, prop::bool::ANY, 0u64..3_000),
                1..80,
            ),
            pool in 1.0f64..1_000.0,
            hold_ms in prop::sample::select(vec![0u64, 1, 700, 2_500]),
        ) {
            let mut m = Bucket::default();
            let mut now = 0;
            // Each member's grants since it joined, with when they were set.
            let mut history: BTreeMap<String, Vec<(u64, f64)>> = BTreeMap::new();
            for (who, kind, rate, push_all, dt) in steps {
                now += dt;
                let demand = match kind { 0 => Unknown, 1 => Rate(rate), _ => Rate(rate * 10.0) };
                let mut members = vec![(format!("m{who}"), demand, Reported)];
                if push_all {
                    for other in (0..6).filter(|o| *o != who) {
                        members.push((format!("m{other}"), Keep, Pushed));
                    }
                }
                let c = Call {
                    limits: vec![LimitUse { rate: pool, window: None }],
                    counts_for_ms: 5_000,
                    hold_ms,
                    max_members: 4,
                    members: members
                        .into_iter()
                        .map(|(id, demand, listing)| Listed { id, demand, listing, sent_version: 0 })
                        .collect(),
                };
                // Grants of members still counting now (one that expired joins again from 0, and its
                // Envoy's assignment expired with it).
                let old: BTreeMap<String, f64> = m
                    .members
                    .iter()
                    .filter(|(_, x)| x.expires_ms > now)
                    .map(|(id, x)| (id.clone(), x.grant))
                    .collect();
                history.retain(|id, _| old.contains_key(id));
                let r = apply(&mut m, now, &c);
                for (id, x) in &m.members {
                    history.entry(id.clone()).or_default().push((now, x.grant));
                }
                // What each Envoy may enforce: the grant in effect when the hold time began, and every
                // one set since (with no hold, the last two: the new one may be applied first).
                let from = now.saturating_sub(hold_ms);
                let either: f64 = history
                    .values()
                    .map(|h| {
                        let start = h.iter().rposition(|(t, _)| *t <= from && *t < now).unwrap_or(0);
                        let start = if hold_ms == 0 { start.max(h.len().saturating_sub(2)) } else { start };
                        h[start..].iter().map(|(_, g)| *g).fold(0.0, f64::max)
                    })
                    .sum();
                prop_assert!(either <= pool * (1.0 + 1e-12), "{either} > {pool} in flight at {now}");
                for (id, x) in &m.members {
                    let old = old.get(id).copied().unwrap_or(0.0);
                    let new = x.grant;
                    prop_assert!(
                        new == old || old == 0.0 || new == 0.0
                            || (new - old).abs() * 8.0 >= old * (1.0 - 1e-12),
                        "{id}: {old} -> {new}"
                    );
                }
                let counted: f64 = m.members.values().map(|x| x.counted(now)).sum();
                prop_assert!(counted <= pool * (1.0 + 1e-12), "{counted} > {pool}");
                prop_assert!(r.granted <= pool * (1.0 + 1e-12));
                prop_assert!(m.members.len() <= 4);
            }
        }
    }
}
