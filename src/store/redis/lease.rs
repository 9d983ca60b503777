//! Quota leases for hot keys.
//!
//! A counter that nearly every request carries (`generic_key: global`, a tenant's total) puts every
//! request of the fleet on one Redis key, one Cluster slot. When a replica sees one counter take at least
//! `redis.lease_after` hits per second, the next request on it that goes to Redis anyway asks for a lease
//! of about what the counter takes in `redis.lease_for`. The script grants it while it is at most a
//! sixteenth of what the limit has left: it counts those hits at once, as if admitted, and hands them to
//! this replica, which admits requests from them itself until they are spent, the window ends, or it has
//! not used them for `redis.lease_for`. What is left is then given back (to the window it was leased
//! from; a fixed window that has ended has nothing to give back), and so is what a sliding window's
//! lease has left when its renewal is granted in the next window: each hit is spent in the window that
//! counted it. Counted hits plus what replicas hold never exceed the limit, so the fleet never admits
//! more than it; the last sixteenth of a limit is counted request by request, so when it runs out only
//! leases still held (each at most `lease_for` of one replica's traffic) wait to be spent or given back. Hits granted that no lease comes to hold (the request failed
//! or went away, or the lease it asked for ended meanwhile) go back with the reply that carried them
//! ([`super::coalesce::Unheld`]).
//!
//! Only fixed and sliding windows are leased: a hit counted early in those windows counts exactly like
//! the same hit counted later in the same window. (A bucket refilled in the meantime, or a log whose
//! entries leave the window by their time, would admit more than the limit.) Nor are limits that count
//! over their limit: their hits must reach Redis even when the request is denied.
//!
//! A check answered from a lease reports the quota this replica last saw, minus what it admitted since:
//! other replicas' hits since the grant are not in it.

use std::{
    collections::HashMap,
    hash::BuildHasher,
    pin::Pin,
    sync::{
        atomic::{AtomicU64, AtomicUsize, Ordering},
        Arc, Mutex,
    },
    time::Duration,
};

use bytes::Bytes;
use smallvec::{smallvec, SmallVec};
use tokio::{
    sync::{futures::OwnedNotified, Notify},
    time::Instant,
};

use super::{
    backend::lock,
    script::{Grant, Return, Spec},
};
use crate::{
    algorithm::{Algorithm, Params},
    store::{keys, Batch, Check, Outcome},
};

/// When leases are taken and for how long.
#[derive(Debug, Clone, Copy)]
pub struct LeaseSettings {
    /// Hits per second on one counter, at this replica, from which it is leased (0: never).
    pub after: u64,
    /// How long a lease lasts at most.
    pub lease_for: Duration,
}

/// Per check of a batch, on the stack for up to eight.
type PerCheck<T> = SmallVec<[T; 8]>;

/// What leases answered of one batch, and what its checks should ask for.
#[derive(Debug)]
pub struct Taken {
    /// Per check: the answer from a lease, whose hits were taken from it; `None` goes to Redis.
    pub local: PerCheck<Option<Outcome>>,
    /// Per check: hits to ask for in a lease with its call (0: none).
    pub want: PerCheck<u64>,
    /// Per check answered from a lease or asking for one: that lease. What goes back to it after the
    /// request, or a grant for it, goes to no other when it ended meanwhile (an operator's reset dropped
    /// it, or its renewal took too long) and another took its place.
    lease_of: PerCheck<u64>,
    /// Per check answered from a lease: when the hits it took were granted (the server's time), so
    /// that they go back to the window that counted them.
    granted_ms: PerCheck<u64>,
    /// A lease this request needs is empty while another request brings more: wait for it, then take
    /// again, rather than ask Redis alongside.
    pub wait: Option<Pin<Box<OwnedNotified>>>,
}

impl Taken {
    fn none(checks: usize) -> Self {
        Self {
            local: smallvec![None; checks],
            want: smallvec![0; checks],
            lease_of: smallvec![0; checks],
            granted_ms: smallvec![0; checks],
            wait: None,
        }
    }

    /// Whether any check is answered from a lease.
    pub fn any_local(&self) -> bool {
        self.local.iter().any(Option::is_some)
    }

    /// Whether every check is answered from a lease.
    pub fn all_local(&self) -> bool {
        self.local.iter().all(Option::is_some)
    }
}

/// Hits this replica holds on one counter.
#[derive(Debug)]
struct Lease {
    /// Which lease of this replica it is: a grant asked for one that ended goes to no other.
    id: u64,
    /// The limit it was leased for; a check with other parameters does not use it.
    params: Params,
    /// The key's Cluster slot and the spec it was leased under, to give hits back.
    slot: u16,
    spec: Spec,
    /// The backend the counter lives on (0 main, 1 per-second).
    backend: usize,
    /// Hits left to admit.
    left: u64,
    /// The quota this replica last learned was left (its own leased hits included), minus what it
    /// admitted since.
    remaining: u64,
    /// When the counter resets, as Redis said at the grant.
    reset_at: Instant,
    /// When the window it was leased in ends.
    window_ends: Instant,
    /// When the lease ends: `lease_for` after it was last used (or granted), or the end of its window if
    /// sooner. A lease in use lasts; one this replica stopped using goes back to the fleet.
    ends_at: Instant,
    /// Hits of the last grant: half of it left asks for more.
    last_grant: u64,
    /// The server time (ms) of the earliest grant whose hits may still be held: what is given back
    /// says it, so that a counter reset since then takes none of it.
    granted_ms: u64,
    /// A request on its way to Redis asks for more.
    renewing: bool,
    /// Redis refused the last ask (too little left): no new ask before then.
    ask_after: Instant,
    /// Woken when that request is answered.
    renewed: Arc<Notify>,
}

impl Lease {
    /// What it has left, to give back to the counter `key` (to the window of its earliest grant).
    fn give_back(&self, key: Bytes) -> Ended {
        Ended {
            backend: self.backend,
            give_back: Return {
                key,
                slot: self.slot,
                spec: self.spec,
                hits: self.left,
                granted_ms: self.granted_ms,
            },
        }
    }
}

/// What leases took for one request, settled exactly once: by [`Settling::finish`] once the request is
/// decided, by [`Settling::again`] when it goes again, or as a request that consumed nothing when it is
/// dropped before (an error, or a caller that went away), so that taken hits always go back and a
/// renewal never stays pending.
pub struct Settling<'a> {
    leases: &'a Leases,
    batch: &'a Batch,
    keys: &'a [Bytes],
    pub taken: Taken,
    done: bool,
}

impl<'a> Settling<'a> {
    pub fn new(leases: &'a Leases, batch: &'a Batch, keys: &'a [Bytes], taken: Taken) -> Self {
        Self {
            leases,
            batch,
            keys,
            taken,
            done: false,
        }
    }

    /// The request was decided: it consumed (or not), and these leases were granted. Returns, per
    /// check, whether a lease holds its grant now; the others are for the caller to give back.
    pub fn finish(
        mut self,
        consumed: bool,
        grants: &[(usize, Grant, u16, Spec)],
    ) -> PerCheck<bool> {
        self.done = true;
        let answered = self.taken.local.iter().filter(|o| o.is_some()).count() as u64;
        if answered > 0 {
            self.leases.answered.fetch_add(answered, Ordering::Relaxed);
        }
        self.leases
            .settle(self.batch, self.keys, &self.taken, consumed, grants)
    }

    /// The request goes again (a window or a Cluster slot moved): what leases answered goes back, to
    /// be taken again, and these leases were granted. Returns what [`Settling::finish`] does.
    pub fn again(mut self, grants: &[(usize, Grant, u16, Spec)]) -> PerCheck<bool> {
        self.done = true;
        self.leases
            .settle(self.batch, self.keys, &self.taken, false, grants)
    }
}

impl Drop for Settling<'_> {
    fn drop(&mut self) {
        if !self.done {
            self.leases
                .settle(self.batch, self.keys, &self.taken, false, &[]);
        }
    }
}

/// Leased hits to give back, of a lease that ended.
#[derive(Debug)]
pub struct Ended {
    pub backend: usize,
    pub give_back: Return,
}

/// Counters of the leases, for the metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LeaseStats {
    /// Leases held now.
    pub held: usize,
    /// Hits leased to this replica in all.
    pub granted: u64,
    /// Hits given back in all (that Redis took).
    pub returned: u64,
    /// Checks answered from a lease, without Redis.
    pub answered: u64,
}

/// A slot of the hot-counter table: the hits one counter took in the current and the previous second.
#[derive(Default)]
struct Heat {
    /// Hash of the counter key (0: free).
    tag: AtomicU64,
    /// The second (since `epoch`) in the high 32 bits, its hits in the low 32.
    now: AtomicU64,
    /// Hits in the second before.
    before: AtomicU64,
}

/// Slots of the hot-counter table: a counter shares one with the others of its hash.
const HEAT_SLOTS: usize = 4096;

/// The leases of one replica.
pub struct Leases {
    settings: LeaseSettings,
    heat: Box<[Heat]>,
    /// Seeded per process: a caller cannot aim keys at one slot of the table without knowing it (and
    /// at worst would keep a counter from being leased, which costs only the calls leases save).
    hasher: foldhash::fast::RandomState,
    held: Mutex<HashMap<Bytes, Lease>>,
    /// What leases had left of an earlier sliding window when a grant of the next one came, to give
    /// back with the next sweep (taken after `held` when both are).
    moved_on: Mutex<Vec<Ended>>,
    /// `held.len()`, read without the lock.
    count: AtomicUsize,
    /// The next lease's id.
    ids: AtomicU64,
    epoch: Instant,
    granted: AtomicU64,
    returned: AtomicU64,
    answered: AtomicU64,
}

impl std::fmt::Debug for Leases {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Leases")
            .field("settings", &self.settings)
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}

/// Whether a check's counter may be leased. Never one that counts over its limit: its hits must be
/// counted in Redis even when its request is denied, which a lease answered here would not do. Nor hits
/// reported after the fact: they are counted in Redis, and their counter's heat is its requests'.
/// Nor one whose key cannot have a reset mark in its slot (see [`keys::reset_mark`]): what it gave back
/// after a reset would go into the new counter.
fn leasable(check: &Check) -> bool {
    matches!(
        check.params.algorithm,
        Algorithm::FixedWindow | Algorithm::SlidingWindow
    ) && !check.params.count_over_limit
        && check.bounded_cost() <= check.params.limit
        && !check.reported
        && keys::has_reset_mark(check.key.as_bytes())
}

/// Whether a sliding window's hits granted at `earlier` (server ms) were counted in another window than
/// those granted at `later`. (A fixed window's key names its window: its grants are all of one.)
fn in_another_window(check: &Check, earlier: u64, later: u64) -> bool {
    let window = check.params.window_ms.max(1);
    check.params.algorithm == Algorithm::SlidingWindow && earlier / window != later / window
}

/// The lease `id` on `key`, if it is still held (not ended, nor replaced by another).
fn held_lease<'h>(
    held: &'h mut HashMap<Bytes, Lease>,
    key: &Bytes,
    id: u64,
) -> Option<&'h mut Lease> {
    held.get_mut(key).filter(|lease| lease.id == id)
}

impl Leases {
    pub fn new(settings: LeaseSettings) -> Self {
        Self {
            settings,
            heat: (0..HEAT_SLOTS).map(|_| Heat::default()).collect(),
            hasher: foldhash::fast::RandomState::default(),
            held: Mutex::new(HashMap::new()),
            moved_on: Mutex::new(Vec::new()),
            count: AtomicUsize::new(0),
            ids: AtomicU64::new(1),
            epoch: Instant::now(),
            granted: AtomicU64::new(0),
            returned: AtomicU64::new(0),
            answered: AtomicU64::new(0),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Bytes, Lease>> {
        lock(&self.held)
    }

    /// Counts `hits` on the counter `key` and returns its rate: hits in the current second so far, or
    /// in the second before if more. Counters that share a slot take it from one another; a slot with
    /// few hits this second is taken by the next counter that asks.
    fn observe(&self, key: &str, hits: u64, now: Instant) -> u64 {
        let hash = self.hasher.hash_one(key) | 1;
        let heat = &self.heat[hash as usize % HEAT_SLOTS];
        let second = now.saturating_duration_since(self.epoch).as_secs() & 0xffff_ffff;
        let hits = hits.min(0xffff_ffff);
        let current = heat.now.load(Ordering::Relaxed);
        let (seen_second, seen_hits) = (current >> 32, current & 0xffff_ffff);
        if heat.tag.load(Ordering::Relaxed) != hash {
            if seen_second != second || seen_hits < 8 {
                heat.tag.store(hash, Ordering::Relaxed);
                heat.now.store(second << 32 | hits, Ordering::Relaxed);
                heat.before.store(0, Ordering::Relaxed);
            }
            return hits;
        }
        let updated = if seen_second == second {
            (seen_hits + hits).min(0xffff_ffff)
        } else {
            let before = if seen_second + 1 == second {
                seen_hits
            } else {
                0
            };
            heat.before.store(before, Ordering::Relaxed);
            hits
        };
        heat.now.store(second << 32 | updated, Ordering::Relaxed);
        updated.max(heat.before.load(Ordering::Relaxed))
    }

    /// Answers what leases can of `batch` (taking the hits), and says which of the other checks should
    /// ask for a lease. `keys` are the checks' storage keys, `backend_of` the backend of a check. With
    /// `may_wait`, a check whose lease is empty while more is on its way makes the request wait for it
    /// ([`Taken::wait`]).
    pub fn take(
        &self,
        batch: &Batch,
        keys: &[Bytes],
        backend_of: impl Fn(&Check) -> usize,
        may_wait: bool,
    ) -> Taken {
        let mut taken = Taken::none(batch.checks.len());
        if self.settings.after == 0 {
            return taken;
        }
        let now = Instant::now();
        for (i, check) in batch.checks.iter().enumerate() {
            if !leasable(check) {
                continue;
            }
            let cost = check.bounded_cost();
            let rate = self.observe(&check.key, cost.max(1), now);
            let size = self.size(rate, cost);
            // The script grants a lease only while it is a sixteenth of what is left at most, and only
            // beside hits it counts: a check that counts nothing (hits_addend 0) never asks for one.
            let hot = cost > 0
                && rate >= self.settings.after
                && size.saturating_mul(16) <= check.params.limit;
            if !hot && self.count.load(Ordering::Relaxed) == 0 {
                continue;
            }
            let mut held = self.lock();
            match held.get_mut(&keys[i]) {
                Some(lease) if lease.params == check.params && now < lease.ends_at => {
                    let low = lease.left.saturating_sub(cost) < lease.last_grant / 2;
                    if hot && low && !lease.renewing && now >= lease.ask_after {
                        // Ask for more with this request, while the others spend what is left.
                        lease.renewing = true;
                        taken.want[i] = size;
                        taken.lease_of[i] = lease.id;
                    } else if lease.renewing
                        && lease.left < cost
                        && may_wait
                        && taken.wait.is_none()
                    {
                        let mut renewed = Box::pin(lease.renewed.clone().notified_owned());
                        // Registered before the lock is released: the answer cannot slip past it.
                        renewed.as_mut().enable();
                        taken.wait = Some(renewed);
                    } else if lease.last_grant > 0 && lease.left >= cost {
                        lease.ends_at = (now + self.settings.lease_for).min(lease.window_ends);
                        lease.left -= cost;
                        taken.lease_of[i] = lease.id;
                        taken.granted_ms[i] = lease.granted_ms;
                        lease.remaining = lease.remaining.saturating_sub(cost);
                        taken.local[i] = Some(Outcome {
                            allowed: true,
                            remaining: lease.remaining,
                            reset_after: lease
                                .reset_at
                                .saturating_duration_since(now)
                                .as_millis()
                                .div_ceil(1000) as u64,
                            retry_after: 0,
                            retry_ms: 0,
                        });
                    }
                }
                // Ended and empty: a new one may be asked for now (one with hits left goes back with
                // the sweep first).
                Some(lease)
                    if lease.params == check.params
                        && hot
                        && !lease.renewing
                        && lease.left == 0
                        && now >= lease.ask_after =>
                {
                    taken.lease_of[i] =
                        self.placeholder(&mut held, keys, i, check, &backend_of, now);
                    taken.want[i] = size;
                }
                Some(_) => {}
                None if hot => {
                    taken.lease_of[i] =
                        self.placeholder(&mut held, keys, i, check, &backend_of, now);
                    taken.want[i] = size;
                }
                None => {}
            }
        }
        taken
    }

    /// An empty lease that a request is asking to fill: the requests after it go to Redis as before
    /// instead of asking too. Returns its id.
    fn placeholder(
        &self,
        held: &mut HashMap<Bytes, Lease>,
        keys: &[Bytes],
        i: usize,
        check: &Check,
        backend_of: &impl Fn(&Check) -> usize,
        now: Instant,
    ) -> u64 {
        let id = self.ids.fetch_add(1, Ordering::Relaxed);
        held.insert(
            keys[i].clone(),
            Lease {
                id,
                params: check.params,
                slot: 0,
                spec: [0; 8],
                backend: backend_of(check),
                left: 0,
                remaining: 0,
                reset_at: now,
                window_ends: now,
                ends_at: now + self.settings.lease_for,
                last_grant: 0,
                granted_ms: 0,
                renewing: true,
                ask_after: now,
                renewed: Arc::new(Notify::new()),
            },
        );
        self.count.store(held.len(), Ordering::Relaxed);
        id
    }

    /// Hits to ask for: what the counter's rate takes in `lease_for`, and at least what makes a counter
    /// hot in a second (`lease_after`) and four of this request.
    fn size(&self, rate: u64, cost: u64) -> u64 {
        let per_lease = rate.saturating_mul(self.settings.lease_for.as_millis() as u64) / 1000;
        per_lease
            .max(self.settings.after)
            .max(cost.saturating_mul(4))
    }

    /// After the request was decided: gives back what leases answered of a request that consumed
    /// nothing (`consumed` false), and records the grants of the checks that asked. `grants` are the
    /// grants by check index of the batch, with the slot and spec each was asked under.
    fn settle(
        &self,
        batch: &Batch,
        keys: &[Bytes],
        taken: &Taken,
        consumed: bool,
        grants: &[(usize, Grant, u16, Spec)],
    ) -> PerCheck<bool> {
        let mut holds = smallvec![false; taken.want.len()];
        if !taken.any_local() && taken.want.iter().all(|&w| w == 0) {
            return holds;
        }
        let now = Instant::now();
        let mut held = self.lock();
        if !consumed {
            for (i, _) in taken.local.iter().enumerate().filter(|(_, o)| o.is_some()) {
                if let Some(lease) = held_lease(&mut held, &keys[i], taken.lease_of[i]) {
                    let (check, taken_ms) = (&batch.checks[i], taken.granted_ms[i]);
                    let cost = check.bounded_cost();
                    if cost == 0 {
                        continue;
                    }
                    if in_another_window(check, taken_ms, lease.granted_ms) {
                        // The lease ran dry and was granted again in the next sliding window
                        // meanwhile: these hits were counted in the window before, and go back to it.
                        lock(&self.moved_on).push(Ended {
                            backend: lease.backend,
                            give_back: Return {
                                key: keys[i].clone(),
                                slot: lease.slot,
                                spec: lease.spec,
                                hits: cost,
                                granted_ms: taken_ms,
                            },
                        });
                    } else {
                        lease.left += cost;
                        lease.remaining = lease.remaining.saturating_add(cost);
                    }
                }
            }
        }
        for (i, want) in taken.want.iter().enumerate() {
            if *want == 0 {
                continue;
            }
            let Some(lease) = held_lease(&mut held, &keys[i], taken.lease_of[i]) else {
                continue;
            };
            lease.renewing = false;
            lease.renewed.notify_waiters();
            let Some(&(_, grant, slot, spec)) = grants.iter().find(|g| g.0 == i) else {
                continue;
            };
            if grant.hits == 0 {
                lease.ask_after = now + self.settings.lease_for;
                continue;
            }
            let check = &batch.checks[i];
            let reset_at = now + Duration::from_millis(grant.reset_ms);
            // A sliding window's reset is two windows after its start: its window ends one before.
            let window_ends = match check.params.algorithm {
                Algorithm::SlidingWindow => {
                    reset_at.checked_sub(Duration::from_millis(check.params.window_ms))
                }
                _ => Some(reset_at),
            }
            .unwrap_or(now);
            if lease.left > 0 && in_another_window(check, lease.granted_ms, grant.server_ms) {
                // A renewal answered in the sliding window after the one the lease's hits were counted
                // in: those go back to their window, not spent in this one (where the window they were
                // counted in weighs less than one, so each would admit more than its hit).
                lock(&self.moved_on).push(lease.give_back(keys[i].clone()));
                lease.left = 0;
            }
            if lease.left == 0 {
                lease.granted_ms = grant.server_ms;
            }
            lease.left += grant.hits;
            lease.remaining = grant.remaining;
            lease.reset_at = reset_at;
            lease.window_ends = window_ends;
            lease.ends_at = (now + self.settings.lease_for).min(window_ends);
            lease.last_grant = grant.hits;
            lease.slot = slot;
            lease.spec = spec;
            self.granted.fetch_add(grant.hits, Ordering::Relaxed);
            holds[i] = true;
        }
        holds
    }

    /// Removes the leases that ended (all of them with `all`), and returns what they have left to give
    /// back: nothing for a fixed window whose window is over.
    pub fn ended(&self, all: bool) -> Vec<Ended> {
        let mut ended = std::mem::take(&mut *lock(&self.moved_on));
        if self.count.load(Ordering::Relaxed) == 0 {
            return ended;
        }
        let now = Instant::now();
        let mut held = self.lock();
        held.retain(|key, lease| {
            // A lease being renewed waits for its request's answer (due within a second).
            let renewal_due = lease.renewing && now < lease.ends_at + Duration::from_secs(1);
            if !all && (now < lease.ends_at || renewal_due) {
                return true;
            }
            lease.renewed.notify_waiters();
            let over = lease.params.algorithm == Algorithm::FixedWindow && now >= lease.reset_at;
            if lease.left > 0 && !over {
                ended.push(lease.give_back(key.clone()));
            }
            false
        });
        self.count.store(held.len(), Ordering::Relaxed);
        ended
    }

    /// Ends every lease without giving back what it has left: after an operator changed counters (a
    /// reset deleted them, a runtime limit replaced the limit) those hits would be taken from a counter
    /// that never counted them. Left in the old one, they are at worst counted twice until it expires,
    /// which never admits more than a limit.
    pub fn drop_all(&self) {
        lock(&self.moved_on).clear();
        if self.count.load(Ordering::Relaxed) == 0 {
            return;
        }
        let mut held = self.lock();
        for lease in held.values() {
            lease.renewed.notify_waiters();
        }
        held.clear();
        self.count.store(0, Ordering::Relaxed);
    }

    /// How often the sweep looks for ended leases.
    pub fn sweep_every(&self) -> Option<Duration> {
        (self.settings.after > 0).then(|| {
            (self.settings.lease_for / 4).clamp(Duration::from_millis(10), Duration::from_secs(1))
        })
    }

    /// Counts `hits` of ended leases as given back: Redis took them.
    pub fn returned(&self, hits: u64) {
        self.returned.fetch_add(hits, Ordering::Relaxed);
    }

    pub fn stats(&self) -> LeaseStats {
        // Not the requests asking for a first grant: nothing is held there yet.
        let held = match self.count.load(Ordering::Relaxed) {
            0 => 0,
            _ => self.lock().values().filter(|l| l.last_grant > 0).count(),
        };
        LeaseStats {
            held,
            granted: self.granted.load(Ordering::Relaxed),
            returned: self.returned.load(Ordering::Relaxed),
            answered: self.answered.load(Ordering::Relaxed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::Role;

    fn leases() -> Leases {
        Leases::new(LeaseSettings {
            after: 10,
            lease_for: Duration::from_millis(200),
        })
    }

    fn batch(limit: u64, cost: u64) -> Batch {
        Batch {
            checks: vec![Check::fixed_window(
                "hot_".into(),
                limit,
                3600,
                cost,
                Role::Enforce,
            )],
            consume_on_deny: false,
            known_denied: false,
        }
    }

    fn keys() -> Vec<Bytes> {
        vec![Bytes::from_static(b"hot_3600")]
    }

    fn grant(hits: u64) -> (usize, Grant, u16, Spec) {
        let grant = Grant {
            check: 0,
            hits,
            remaining: 900,
            reset_ms: 60_000,
            server_ms: 1_000,
        };
        (0, grant, 0, [0, 1000, 3_600_000, 1000, 3600, 0, 0, 0])
    }

    /// [`grant`] of a sliding window of a minute, answered at `server_ms`.
    fn grant_at(hits: u64, server_ms: u64) -> (usize, Grant, u16, Spec) {
        let (i, mut grant, slot, spec) = grant(hits);
        grant.server_ms = server_ms;
        grant.reset_ms = 120_000 - server_ms % 60_000;
        (i, grant, slot, spec)
    }

    fn take(leases: &Leases, batch: &Batch) -> Taken {
        leases.take(batch, &keys(), |_| 0, true)
    }

    /// Sends `n` requests that all go to Redis (no lease yet), as a cold counter's do.
    fn warm(leases: &Leases, batch: &Batch, n: usize) {
        for _ in 0..n {
            let taken = take(leases, batch);
            assert!(!taken.any_local());
            Settling::new(leases, batch, &keys(), taken).finish(true, &[]);
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_hot_counter_asks_once_and_the_others_wait_for_the_grant() {
        let (leases, batch) = (leases(), batch(1000, 1));
        warm(&leases, &batch, 9);
        let asking = take(&leases, &batch);
        assert_eq!(
            asking.want[0], 10,
            "hot at 10 hits a second: a lease of at least that"
        );
        let waiting = take(&leases, &batch);
        assert!(waiting.wait.is_some() && !waiting.any_local());
        assert_eq!(waiting.want[0], 0);
        drop(Settling::new(&leases, &batch, &keys(), waiting));

        Settling::new(&leases, &batch, &keys(), asking).finish(true, &[grant(10)]);
        let stats = leases.stats();
        assert_eq!((stats.held, stats.granted), (1, 10));
        for left in (5..10).rev() {
            let taken = take(&leases, &batch);
            let outcome = taken.local[0].expect("answered from the lease");
            assert!(outcome.allowed);
            assert_eq!(outcome.reset_after, 60);
            Settling::new(&leases, &batch, &keys(), taken).finish(true, &[]);
            assert_eq!(leases.lock()[&keys()[0]].left, left);
        }
        // Half of the grant left: the next request asks for more while the others spend the rest.
        let renewing = take(&leases, &batch);
        assert!(!renewing.any_local() && renewing.want[0] > 0);
        assert!(take(&leases, &batch).local[0].is_some());
    }

    #[tokio::test(start_paused = true)]
    async fn the_metrics_count_leases_held_and_checks_answered_once() {
        let (leases, batch) = (leases(), batch(1000, 1));
        warm(&leases, &batch, 9);
        let asking = take(&leases, &batch);
        assert_eq!(leases.stats().held, 0, "asked for, nothing held yet");
        Settling::new(&leases, &batch, &keys(), asking).finish(true, &[grant(10)]);
        assert_eq!(leases.stats().held, 1);
        // Taken, then given back as its request goes again (it waited, failed or a window moved),
        // then taken and decided: one answer.
        drop(Settling::new(
            &leases,
            &batch,
            &keys(),
            take(&leases, &batch),
        ));
        Settling::new(&leases, &batch, &keys(), take(&leases, &batch)).again(&[]);
        assert_eq!(leases.stats().answered, 0);
        Settling::new(&leases, &batch, &keys(), take(&leases, &batch)).finish(true, &[]);
        assert_eq!(leases.stats().answered, 1);
        assert_eq!(leases.lock()[&keys()[0]].left, 9);
    }

    #[tokio::test(start_paused = true)]
    async fn reported_hits_never_heat_a_counter_nor_spend_its_lease() {
        let (leases, batch) = (leases(), batch(100_000, 1));
        let mut report = batch.clone();
        report.checks[0].reported = true;
        report.checks[0].cost = 500;
        // A report of 500 hits is no sign of a hot counter (500 requests in a second would be).
        let taken = take(&leases, &report);
        assert!(!taken.any_local() && taken.want[0] == 0);
        warm(&leases, &batch, 1);
        assert_eq!(take(&leases, &batch).want[0], 0, "one request: still cold");
        // A counter its requests made hot: a report goes to Redis, and leaves the lease alone.
        let leases = super::tests::leases();
        warm(&leases, &batch, 9);
        let asking = take(&leases, &batch);
        Settling::new(&leases, &batch, &keys(), asking).finish(true, &[grant(10)]);
        report.checks[0].cost = 1;
        let taken = take(&leases, &report);
        assert!(!taken.any_local() && taken.want[0] == 0);
        Settling::new(&leases, &report, &keys(), taken).finish(true, &[]);
        assert_eq!(leases.lock()[&keys()[0]].left, 10);
    }

    #[tokio::test(start_paused = true)]
    async fn hits_taken_for_a_request_that_consumed_nothing_go_back() {
        let (leases, batch) = (leases(), batch(1000, 3));
        warm(&leases, &batch, 3);
        let asking = take(&leases, &batch);
        Settling::new(&leases, &batch, &keys(), asking).finish(true, &[grant(12)]);
        let taken = take(&leases, &batch);
        assert!(taken.local[0].is_some());
        assert_eq!(leases.lock()[&keys()[0]].left, 9);
        // Denied by another check, or dropped on the way (an error, a caller gone): given back.
        drop(Settling::new(&leases, &batch, &keys(), taken));
        assert_eq!(leases.lock()[&keys()[0]].left, 12);
    }

    #[tokio::test(start_paused = true)]
    async fn what_was_taken_or_asked_for_a_lease_that_ended_goes_to_no_other() {
        let (leases, batch) = (leases(), batch(1000, 1));
        warm(&leases, &batch, 9);
        let asking = take(&leases, &batch);
        Settling::new(&leases, &batch, &keys(), asking).finish(true, &[grant(40)]);
        for _ in 0..20 {
            let taken = take(&leases, &batch);
            Settling::new(&leases, &batch, &keys(), taken).finish(true, &[]);
        }
        // Half spent: one request asks for more, another takes a hit it will not consume.
        let renewing = take(&leases, &batch);
        assert!(renewing.want[0] > 0);
        let spending = take(&leases, &batch);
        assert!(spending.local[0].is_some());
        // An operator's reset ends every lease, and the next request gets a new one, before those
        // two are settled.
        leases.drop_all();
        let asking = take(&leases, &batch);
        assert!(asking.want[0] > 0);
        Settling::new(&leases, &batch, &keys(), asking).finish(true, &[grant(20)]);
        let holds = Settling::new(&leases, &batch, &keys(), renewing).finish(true, &[grant(30)]);
        assert_eq!(
            holds[..],
            [false],
            "the grant is for the caller to give back"
        );
        drop(Settling::new(&leases, &batch, &keys(), spending));
        assert_eq!(
            leases.lock()[&keys()[0]].left,
            20,
            "the new lease's grant alone"
        );
        assert_eq!(leases.stats().granted, 60);
    }

    #[tokio::test(start_paused = true)]
    async fn a_sliding_window_lease_renewed_in_the_next_window_gives_back_what_it_had_left() {
        let leases = leases();
        let mut batch = batch(100_000, 1);
        batch.checks[0].params.algorithm = Algorithm::SlidingWindow;
        batch.checks[0].params.window_ms = 60_000;
        // Granted at 1 s and 31 s of the window from 0 to 60 s, then at 61 s, in the next one.
        let spend_until_renewing = |leases: &Leases| loop {
            let taken = take(leases, &batch);
            if taken.want[0] > 0 {
                return taken;
            }
            assert!(taken.local[0].is_some());
            Settling::new(leases, &batch, &keys(), taken).finish(true, &[]);
        };
        warm(&leases, &batch, 9);
        let asking = take(&leases, &batch);
        Settling::new(&leases, &batch, &keys(), asking).finish(true, &[grant_at(40, 1_000)]);
        let renewing = spend_until_renewing(&leases);
        let left = leases.lock()[&keys()[0]].left;
        assert!(left > 0);
        // In the same window, the grant joins what is left.
        Settling::new(&leases, &batch, &keys(), renewing).finish(true, &[grant_at(30, 31_000)]);
        assert_eq!(leases.lock()[&keys()[0]].left, left + 30);
        assert!(leases.ended(false).is_empty());

        let renewing = spend_until_renewing(&leases);
        let left = leases.lock()[&keys()[0]].left;
        Settling::new(&leases, &batch, &keys(), renewing).finish(true, &[grant_at(30, 61_000)]);
        assert_eq!(
            leases.lock()[&keys()[0]].left,
            30,
            "only the next window's grant is spent in it"
        );
        let ended = leases.ended(false);
        assert_eq!(ended.len(), 1, "the lease itself goes on");
        assert_eq!(
            (ended[0].give_back.hits, ended[0].give_back.granted_ms),
            (left, 1_000),
            "given back to the window that counted them"
        );
        let ended = leases.ended(true);
        assert_eq!(
            (ended[0].give_back.hits, ended[0].give_back.granted_ms),
            (30, 61_000)
        );
    }

    /// A request takes a sliding window lease's last hits, and while it waits for its other checks the
    /// lease is granted again in the next window; the request then consumes nothing: its hits go back
    /// to the window that counted them, not into the new window's lease.
    #[tokio::test(start_paused = true)]
    async fn hits_a_request_gives_back_after_the_window_moved_on_go_to_their_own_window() {
        let leases = leases();
        let mut batch = batch(100_000, 1);
        batch.checks[0].params.algorithm = Algorithm::SlidingWindow;
        batch.checks[0].params.window_ms = 60_000;
        warm(&leases, &batch, 9);
        let asking = take(&leases, &batch);
        Settling::new(&leases, &batch, &keys(), asking).finish(true, &[grant_at(10, 59_000)]);
        // Spent to its last hit by requests still waiting, one of which asks for more.
        let mut waiting = Vec::new();
        let renewing = loop {
            let taken = take(&leases, &batch);
            if taken.want[0] > 0 {
                break taken;
            }
            assert!(taken.local[0].is_some());
            waiting.push(taken);
        };
        while leases.lock()[&keys()[0]].left > 0 {
            waiting.push(take(&leases, &batch));
        }
        // The renewal is answered in the next window, with the lease empty.
        Settling::new(&leases, &batch, &keys(), renewing).finish(true, &[grant_at(20, 61_000)]);
        let given = waiting.len() as u64;
        for taken in waiting {
            // Denied by another of its checks: nothing consumed.
            drop(Settling::new(&leases, &batch, &keys(), taken));
        }
        assert_eq!(
            leases.lock()[&keys()[0]].left,
            20,
            "the new window's lease holds its own grant only"
        );
        let ended = leases.ended(false);
        assert_eq!(ended.len() as u64, given);
        assert!(ended
            .iter()
            .all(|e| (e.give_back.hits, e.give_back.granted_ms) == (1, 59_000)));
    }

    #[tokio::test(start_paused = true)]
    async fn an_unused_lease_ends_and_gives_back_what_is_left() {
        let (leases, batch) = (leases(), batch(1000, 1));
        warm(&leases, &batch, 9);
        let asking = take(&leases, &batch);
        Settling::new(&leases, &batch, &keys(), asking).finish(true, &[grant(40)]);
        let taken = take(&leases, &batch);
        Settling::new(&leases, &batch, &keys(), taken).finish(true, &[]);
        assert!(leases.ended(false).is_empty(), "in use");
        tokio::time::advance(Duration::from_millis(201)).await;
        let ended = leases.ended(false);
        assert_eq!(ended.len(), 1);
        assert_eq!(ended[0].give_back.hits, 39);
        assert_eq!(ended[0].give_back.spec, grant(0).3);
        assert_eq!(leases.stats().returned, 0, "counted once Redis took them");
        leases.returned(39);
        assert_eq!(leases.stats().returned, 39);
        assert_eq!(leases.stats().held, 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_fixed_window_that_ended_has_nothing_to_give_back() {
        let (leases, batch) = (leases(), batch(1000, 1));
        warm(&leases, &batch, 9);
        let asking = take(&leases, &batch);
        let mut short = grant(40);
        short.1.reset_ms = 100;
        Settling::new(&leases, &batch, &keys(), asking).finish(true, &[short]);
        tokio::time::advance(Duration::from_millis(150)).await;
        assert!(
            take(&leases, &batch).local[0].is_none(),
            "not spent past its window"
        );
        assert!(leases.ended(false).is_empty());
        assert_eq!(leases.stats().held, 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_refused_lease_is_not_asked_again_before_lease_for() {
        let (leases, batch) = (leases(), batch(1000, 1));
        warm(&leases, &batch, 9);
        let asking = take(&leases, &batch);
        Settling::new(&leases, &batch, &keys(), asking).finish(true, &[grant(0)]);
        for _ in 0..20 {
            let taken = take(&leases, &batch);
            assert_eq!(taken.want[0], 0);
            assert!(taken.wait.is_none(), "nobody waits for a refused lease");
            Settling::new(&leases, &batch, &keys(), taken).finish(true, &[]);
        }
        tokio::time::advance(Duration::from_millis(201)).await;
        assert!(take(&leases, &batch).want[0] > 0);
        // A limit a lease could never be a sixteenth of is not asked at all.
        let small = Leases::new(LeaseSettings {
            after: 10,
            lease_for: Duration::from_millis(200),
        });
        let tight = self::batch(100, 1);
        for _ in 0..50 {
            assert_eq!(take(&small, &tight).want[0], 0);
        }
    }

    #[tokio::test(start_paused = true)]
    async fn cold_counters_and_unleasable_algorithms_are_never_leased() {
        let leases = leases();
        let batch = batch(1000, 1);
        warm(&leases, &batch, 5);
        assert_eq!(leases.stats().held, 0);
        let mut bucket = batch.clone();
        bucket.checks[0].params.algorithm = Algorithm::TokenBucket;
        // Nor a fixed window that counts over its limit: its hits must reach Redis.
        let mut budget = batch.clone();
        budget.checks[0].params.count_over_limit = true;
        for _ in 0..50 {
            assert_eq!(take(&leases, &bucket).want[0], 0);
            assert_eq!(take(&leases, &budget).want[0], 0);
        }
        let off = Leases::new(LeaseSettings {
            after: 0,
            lease_for: Duration::from_millis(200),
        });
        for _ in 0..50 {
            assert_eq!(take(&off, &batch).want[0], 0);
        }
    }
}
