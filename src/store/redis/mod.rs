//! The Redis store: counters shared by every replica, decided with one script call per request or less
//! (requests that wait for a busy server share a call), on standalone Redis, Sentinel or Cluster.
//!
//! - Atomic: `decide.lua` checks every counter of a request and consumes them only if the request is
//!   allowed; one EVALSHA decides one or more requests, each on its own, in arrival order.
//! - Coalescing: requests that reach a server while its calls are in flight go together in its next
//!   call (see `coalesce`); an idle server gets each request at once.
//! - Leases: a hot fixed- or sliding-window counter is leased to this replica in part and admitted here
//!   without a call, never beyond the limit (see `lease`).
//! - Server time: the script reads `TIME`. Keys carry the window start (the reference key layout), which
//!   the client computes from its estimate of the server clock; a request whose key is for the wrong
//!   window is refused by the script before it touches anything, and the client retries it once with the
//!   server's time.
//! - Cluster: checks are grouped by server, whatever their slots, and one call decides a server's share of
//!   a request all-or-nothing (by slot instead while slots move under it: see `coalesce`). When one
//!   server denies the request, `refund.lua` gives back what the others consumed, so the fleet never
//!   admits more than the limit.
//! - Waiting: a request waits for Redis until its answer is due: shortly before the caller's gRPC deadline,
//!   or `redis.timeout` for callers without one. Each server has a circuit breaker that opens only when
//!   the server is failing (connections refused or lost, or no answer at all for
//!   `redis.unresponsive_after` while commands wait: see `node`); while open, requests are answered at
//!   once by the policy. fred reconnects with backoff; scripts are loaded at start, on reconnect, and again
//!   on NOSCRIPT.
//!
//! Beside this file: `script` (the calling contract of `decide.lua` and `refund.lua`), `coalesce`,
//! `lease`, `backend` (one Redis deployment and its connections), `node` (one server's health and
//! waiting for it), `config` (the client configuration for the settings), `options` (the settings
//! themselves), `tls`, `operator` (the operators' API: counters read and cleared, runtime limit
//! records), and `share` (the rate limit quota service's buckets, `share.lua`).

mod backend;
mod coalesce;
mod config;
mod lease;
mod node;
mod operator;
mod options;
mod script;
mod sentinel;
mod share;
mod tls;

pub use lease::LeaseStats;
pub use options::{RedisSettings, RedisTopology, Secret, SocketType};

use std::{
    collections::BTreeMap,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::Duration,
};

use bytes::{Bytes, BytesMut};
use fred::{prelude::*, types::scripts::Script};
use futures_util::future::join_all;
use smallvec::SmallVec;
use tokio::time::Instant;
use tokio_util::{sync::CancellationToken, task::TaskTracker};

use self::{
    backend::Backend,
    lease::{Ended, LeaseSettings, Leases, Settling, Taken},
    node::Node,
    script::{Grant, Part, PartReply, RefundCall, Return, Spec, DECIDE_LUA, REFUND_LUA},
};
use super::{
    Applied, Batch, Check, CounterStore, Deadline, Outcome, Role, StoreError, StoreHealth,
};
use crate::clock::Clock;

/// Counters in Redis.
#[derive(Debug)]
pub struct RedisStore {
    /// Where every limit counts, except those of the per-second Redis.
    main: Arc<Backend>,
    /// Limits whose unit is SECOND, when a per-second Redis is configured (`REDIS_PERSECOND`).
    per_second: Option<Arc<Backend>>,
    decide: Script,
    refund: Script,
    /// Commands whose callers stopped waiting, and the calls in flight, watched until they end.
    tasks: TaskTracker,
    /// Every Redis was connected and had the scripts loaded at least once.
    reached: AtomicBool,
    /// Quota this replica holds on hot counters.
    leases: Leases,
}

/// The checks of one script call: one backend, one hash slot, one server.
struct Group {
    /// 0 for the main backend, 1 for the per-second one.
    backend: usize,
    checks: Checks,
    node: Arc<Node>,
}

/// What one refund.lua call gives back: the consumed checks of one slot of a decided part (`server_ms`:
/// when it was decided), each with its outcome.
struct Refund<'a> {
    group: &'a Group,
    server_ms: i64,
    slot: u16,
    checks: Vec<(usize, Outcome)>,
}

/// Indexes of checks of a batch. Inline for the requests most send, as are a request's groups and
/// their replies: the state of a request on Redis is boxed once, and these ride in it.
type Checks = SmallVec<[usize; 8]>;
type Groups = SmallVec<[Group; 1]>;

impl RedisStore {
    /// Builds the store and starts connecting in the background; it does not wait for Redis.
    /// `per_second`, when set, is a second Redis for limits whose unit is SECOND. `longest_wait` is the
    /// longest any request may wait for an answer (`overload.deadline`): commands still unanswered well
    /// after it are abandoned by the client, never replayed after a reconnect.
    pub fn connect(
        settings: &RedisSettings,
        per_second: Option<&RedisSettings>,
        jitter_max: u64,
        longest_wait: Duration,
    ) -> Result<Arc<Self>, StoreError> {
        let (decide, refund) = (Script::from_lua(DECIDE_LUA), Script::from_lua(REFUND_LUA));
        let scripts = [decide.clone(), refund.clone()];
        let tasks = TaskTracker::new();
        let connect = |name, s: &RedisSettings| {
            let command_timeout = longest_wait.max(s.timeout) + s.unresponsive_after.max(s.timeout);
            Backend::connect(
                name,
                s,
                command_timeout,
                scripts.clone(),
                jitter_max,
                tasks.clone(),
            )
        };
        let main = connect("main", settings)?;
        let per_second = per_second.map(|s| connect("per-second", s)).transpose()?;
        Ok(Arc::new(Self {
            main,
            per_second,
            decide,
            refund,
            tasks,
            reached: AtomicBool::new(false),
            leases: Leases::new(LeaseSettings {
                after: settings.lease_after,
                lease_for: settings.lease_for,
            }),
        }))
    }

    /// The time on the clock a check counts by (the server's, of the Redis it counts on), as this
    /// replica estimates it at local time `local_ms`: exact for the moment of the latest answer.
    pub fn clock_ms(&self, local_ms: u64, per_second: bool) -> u64 {
        let offset = self
            .backend(self.backend_of(per_second))
            .clock_offset_ms
            .load(Ordering::Relaxed);
        u64::try_from(
            i64::try_from(local_ms)
                .unwrap_or(i64::MAX)
                .saturating_add(offset),
        )
        .unwrap_or(0)
    }

    fn backends(&self) -> impl Iterator<Item = &Arc<Backend>> {
        std::iter::once(&self.main).chain(&self.per_second)
    }

    fn backend(&self, index: usize) -> &Backend {
        match (index, &self.per_second) {
            (1, Some(per_second)) => per_second,
            _ => &self.main,
        }
    }

    /// Waits until every connection is up and the scripts are loaded.
    pub async fn ready(&self) -> Result<(), StoreError> {
        let scripts = [self.decide.clone(), self.refund.clone()];
        for backend in self.backends() {
            backend.ready(&scripts).await?;
        }
        self.reached.store(true, Ordering::Relaxed);
        Ok(())
    }

    /// One server's part of a request, decided there within the request's deadline.
    async fn decide_part(
        &self,
        group: &Group,
        part: Part,
        deadline: Deadline,
    ) -> Result<PartReply, StoreError> {
        let backend = self.backend(group.backend);
        let (until, late) = Self::wait_bound(backend, deadline);
        backend.caller.decide(&group.node, part, until, late).await
    }

    /// When a call to `backend` stops waiting, and the error if that moment comes first.
    fn wait_bound(backend: &Backend, deadline: Deadline) -> (Instant, StoreError) {
        let now = Instant::now();
        let own = now + backend.timeout;
        if deadline.from_caller || deadline.at <= own {
            (
                deadline.at,
                StoreError::Deadline(deadline.at.saturating_duration_since(now)),
            )
        } else {
            (own, StoreError::Timeout(backend.timeout))
        }
    }

    /// The backend a check counts on.
    fn backend_of(&self, per_second: bool) -> usize {
        usize::from(per_second && self.per_second.is_some())
    }

    async fn decide_now(
        &self,
        first_batch: &Batch,
        local_ms: u64,
        deadline: Deadline,
    ) -> Result<Applied, StoreError> {
        // The time on each backend's clock, as this replica estimates it.
        // Saturating: the offset comes from a number in a Redis reply.
        let estimate = |b: &Backend| {
            (local_ms as i64).saturating_add(b.clock_offset_ms.load(Ordering::Relaxed))
        };
        let mut now_ms = [estimate(&self.main), estimate(self.backend(1))];
        // Window mismatches met so far: a replica whose estimate of the Redis clock is a little ahead
        // can meet one going back to the window before and another as Redis moves on to the next.
        let (mut mismatches_met, mut waited) = (0u8, false);
        // Set when a call carrying several slots of one Cluster master was refused because one of them
        // moved: the request then goes one slot per call.
        let mut by_slot = false;
        // After a window mismatch: the batch that goes again, whose checks counted over their limit on
        // the first try only check now, and those checks' answers from the first try. Boxed: it is rare,
        // and this future is part of every request's.
        let mut again: Option<Box<(Batch, Vec<Option<Outcome>>)>> = None;
        loop {
            let batch = again.as_deref().map_or(first_batch, |(b, _)| b);
            let server_ms =
                |c: &Check| u64::try_from(now_ms[self.backend_of(c.per_second)]).unwrap_or(0);
            let keys = storage_keys(batch, server_ms);
            let backend_of = |c: &Check| self.backend_of(c.per_second);
            let mut taken = self.leases.take(batch, &keys, backend_of, !waited);
            if let Some(renewed) = taken.wait.take() {
                // A lease it needs is being refilled: give back what it took, wait, take again.
                drop(Settling::new(&self.leases, batch, &keys, taken));
                waited = true;
                tokio::select! {
                    () = renewed => continue,
                    () = tokio::time::sleep_until(deadline.at) => {
                        return Err(StoreError::Deadline(Duration::ZERO));
                    }
                }
            }
            let leased = Settling::new(&self.leases, batch, &keys, taken);
            if leased.taken.all_local() {
                return Ok(answered_from_leases(batch, leased));
            }
            let remote: Checks = (0..batch.checks.len())
                .filter(|&i| leased.taken.local[i].is_none())
                .collect();
            let mut groups = self.groups(batch, &keys, remote, by_slot);
            self.admit(&groups)?;
            // A batch that goes again is never complete: its checks counted on the first try still weigh
            // in the decision, which only this side sees whole.
            let complete = groups.len() == 1 && !leased.taken.any_local() && again.is_none();
            let part = |group: &Group| {
                let now = u64::try_from(now_ms[group.backend]).unwrap_or(0);
                let slot_of = self.slot_of(group.backend);
                let wants = &leased.taken.want;
                Part::new(batch, &keys, &group.checks, complete, now, wants, slot_of)
            };
            let mut slots: SmallVec<[PartReply; 1]> = SmallVec::new();
            // Set when a server refused its part because one of its slots moved: the servers that
            // decided theirs keep the leases they granted and give back what they consumed, then the
            // request goes again, by slot.
            let mut moved = false;
            if let [group] = &groups[..] {
                // One server (always so on standalone and Sentinel): its part is made and its call
                // awaited as they are, without vectors of parts and calls.
                match self.decide_part(group, part(group)?, deadline).await {
                    // Refused before it wrote anything: nothing to give back.
                    Err(StoreError::SlotsMoved) if !by_slot => {
                        tracing::debug!("a call's Cluster slots moved; deciding one slot per call");
                        by_slot = true;
                        continue;
                    }
                    reply => slots.push(reply?),
                }
            } else {
                let parts = groups.iter().map(part).collect::<Result<Vec<_>, _>>()?;
                let pairs = groups.iter().zip(parts);
                let calls = pairs.map(|(group, part)| self.decide_part(group, part, deadline));
                let mut decided = Groups::new();
                let replies = join_all(calls).await;
                let mut failed = None;
                for (group, reply) in groups.into_iter().zip(replies) {
                    match reply {
                        Err(StoreError::SlotsMoved) if !by_slot => moved = true,
                        Err(err) => {
                            failed.get_or_insert(err);
                        }
                        Ok(reply) => {
                            slots.push(reply);
                            decided.push(group);
                        }
                    }
                }
                if let Some(err) = failed {
                    // A failed server fails the request, which the on_backend_error policy answers:
                    // what the other servers counted for it goes back, and their replies are dropped
                    // with it, giving back what they leased.
                    self.give_back_counted(batch, &keys, &decided, &slots);
                    return Err(err);
                }
                groups = decided;
            }
            self.record_clocks(&groups, &slots, local_ms);
            let grants = self.grants(batch, &keys, &groups, &slots, &server_ms);
            let mismatches: Vec<(usize, i64)> = groups
                .iter()
                .zip(&slots)
                .filter(|(_, s)| s.window_mismatch)
                .map(|(g, s)| (g.backend, s.server_ms))
                .collect();
            if moved || !mismatches.is_empty() {
                // What counts over its limit and was counted keeps that count and answer; the rest is
                // given back and decided again.
                hold(&groups, &mut slots, &leased.again(&grants));
                self.refund_consumed(batch, &keys, &groups, &slots, deadline)
                    .await?;
                if !mismatches.is_empty() {
                    if mismatches_met == 2 {
                        return Err(StoreError::Backend(
                            "the Redis clock moved across a window three times during one request"
                                .into(),
                        ));
                    }
                    mismatches_met += 1;
                }
                for (backend, server_ms) in mismatches {
                    tracing::debug!(local_ms, server_ms, "window moved on the server; retrying");
                    now_ms[backend] = server_ms;
                }
                if moved {
                    tracing::debug!("a call's Cluster slots moved; deciding one slot per call");
                    by_slot = true;
                }
                again = Some(Box::new(counted_once_again(
                    batch,
                    &groups,
                    &slots,
                    again.as_deref(),
                )));
                continue;
            }
            let mut outcomes = if complete {
                // One part with every check, in order: its answers are the request's.
                std::mem::take(&mut slots[0].outcomes)
            } else {
                in_batch_order(batch, &groups, &slots, &leased.taken)
            };
            if let Some((_, first)) = again.as_deref() {
                for (outcome, first) in outcomes.iter_mut().zip(first) {
                    *outcome = first.unwrap_or(*outcome);
                }
            }
            let denied = first_batch.is_denied(|i| outcomes[i].allowed);
            let consumed = !denied || batch.consume_on_deny;
            if !consumed && !complete {
                // Another slot, or a lease, denied what these consumed: give it back.
                self.refund_consumed(batch, &keys, &groups, &slots, deadline)
                    .await?;
                report_refunded(batch, &keys, &groups, &slots, &leased.taken, &mut outcomes);
            }
            hold(&groups, &mut slots, &leased.finish(consumed, &grants));
            return Ok(Applied { denied, outcomes });
        }
    }

    /// A key's Cluster slot on a backend (0 outside Cluster).
    fn slot_of(&self, backend: usize) -> impl Fn(&[u8]) -> u16 {
        let cluster = self.backend(backend).cluster;
        move |key| {
            if cluster {
                fred::util::redis_keyslot(key)
            } else {
                0
            }
        }
    }

    /// The leases granted in the replies, by check of the batch, with the slot and spec each was asked
    /// under (to give back what is left of it later).
    fn grants(
        &self,
        batch: &Batch,
        keys: &[Bytes],
        groups: &[Group],
        slots: &[PartReply],
        server_ms: &impl Fn(&Check) -> u64,
    ) -> Vec<(usize, Grant, u16, Spec)> {
        let mut grants = Vec::new();
        for (group, slot) in groups.iter().zip(slots) {
            for grant in &slot.grants {
                let i = group.checks[grant.check];
                let check = &batch.checks[i];
                if let Ok(spec) = script::spec(check, server_ms(check)) {
                    grants.push((i, *grant, self.slot_of(group.backend)(&keys[i]), spec));
                }
            }
        }
        grants
    }

    /// Gives back the hits of leases that ended, one call per server.
    async fn give_back(&self, ended: Vec<Ended>) {
        let mut by_server: Vec<(usize, Arc<Node>, Vec<Return>)> = Vec::new();
        for Ended { backend, give_back } in ended {
            let b = self.backend(backend);
            let node = b.node_for_slot(b.cluster.then_some(give_back.slot));
            match by_server
                .iter_mut()
                .find(|(i, n, _)| *i == backend && Arc::ptr_eq(n, &node))
            {
                Some((_, _, returns)) => returns.push(give_back),
                None => by_server.push((backend, node, vec![give_back])),
            }
        }
        let calls = by_server
            .into_iter()
            .map(|(backend, node, returns)| async move {
                let b = self.backend(backend);
                let until = Instant::now() + b.timeout;
                match b.caller.give_back(&node, &returns, until).await {
                    Ok(()) => self.leases.returned(returns.iter().map(|r| r.hits).sum()),
                    Err(err) => {
                        tracing::warn!(server = %node.name(), "could not give leased hits back: {err}");
                    }
                }
            });
        join_all(calls).await;
    }

    /// Whether the request may go to Redis: every backend it needs has a connection, and every server it
    /// needs lets it through its breaker. Every server of the request must be asked, or none: a refused
    /// slot would leave the others' consumption unrefunded.
    fn admit(&self, groups: &[Group]) -> Result<(), StoreError> {
        for group in groups {
            let backend = self.backend(group.backend);
            if !backend.reaches(&group.node) {
                if group.node.breaker.trip() {
                    tracing::warn!(server = %group.node.name(), backend = backend.name, "no connection to Redis: circuit breaker open");
                }
                return Err(StoreError::CircuitOpen("no connection to Redis"));
            }
        }
        // Each server once: a breaker lets one probe through at a time.
        let mut servers: SmallVec<[&Arc<Node>; 4]> = groups.iter().map(|g| &g.node).collect();
        servers.sort_by_key(|node| Arc::as_ptr(node));
        servers.dedup_by_key(|node| Arc::as_ptr(node));
        if servers.iter().any(|node| !node.breaker.allow()) {
            return Err(StoreError::CircuitOpen("Redis failing"));
        }
        Ok(())
    }

    /// Keeps each backend's clock estimate: the newest server time among its replies.
    fn record_clocks(&self, groups: &[Group], slots: &[PartReply], local_ms: u64) {
        for (index, backend) in self.backends().enumerate() {
            let newest = groups
                .iter()
                .zip(slots)
                .filter(|(g, _)| g.backend == index)
                .map(|(_, s)| s.server_ms)
                .max();
            if let Some(server_ms) = newest {
                backend
                    .clock_offset_ms
                    .store(server_ms.saturating_sub(local_ms as i64), Ordering::Relaxed);
            }
        }
    }

    /// The checks `checks` (indexes into the batch) grouped by backend and, on Cluster, by server,
    /// each with its server.
    ///
    /// On Cluster the checks of one master form one group, whatever their slots, so that one call
    /// decides them together, all or nothing; `by_slot` makes one group per slot instead, for a
    /// request whose slots moved under such a call (each then goes through the client's redirection
    /// handling on its own).
    fn groups(&self, batch: &Batch, keys: &[Bytes], checks: Checks, by_slot: bool) -> Groups {
        if self.per_second.is_none() && !self.main.cluster {
            // One server decides every check.
            let node = self.main.node_for_slot(None);
            return smallvec::smallvec![Group {
                backend: 0,
                checks,
                node,
            }];
        }
        let mut groups = Groups::new();
        // Each distinct slot's group, found by a look through the few a request has.
        let mut slot_group: SmallVec<[(usize, Option<u16>, usize); 8]> = SmallVec::new();
        for i in checks {
            let backend = self.backend_of(batch.checks[i].per_second);
            let b = self.backend(backend);
            let slot = b.cluster.then(|| fred::util::redis_keyslot(&keys[i]));
            let known = slot_group
                .iter()
                .find(|(bk, sl, _)| *bk == backend && *sl == slot)
                .map(|&(_, _, g)| g);
            let g = known.unwrap_or_else(|| {
                let node = b.node_for_slot(slot);
                let same_server = (!by_slot)
                    .then(|| {
                        groups
                            .iter()
                            .position(|g| g.backend == backend && Arc::ptr_eq(&g.node, &node))
                    })
                    .flatten();
                let g = same_server.unwrap_or_else(|| {
                    groups.push(Group {
                        backend,
                        checks: Checks::new(),
                        node,
                    });
                    groups.len() - 1
                });
                slot_group.push((backend, slot, g));
                g
            });
            groups[g].checks.push(i);
        }
        groups
    }

    /// Gives back the hits of every slot that consumed for this request.
    async fn refund_consumed(
        &self,
        batch: &Batch,
        keys: &[Bytes],
        groups: &[Group],
        slots: &[PartReply],
        deadline: Deadline,
    ) -> Result<(), StoreError> {
        let calls = self.refund_calls(batch, keys, groups, slots, deadline);
        for result in join_all(calls).await {
            result?.map_err(redis_error)?;
        }
        Ok(())
    }

    /// [`Self::refund_consumed`] for a request that failed: sent at once and not waited for, within
    /// the servers' own bound (`REDIS_TIMEOUT`, each server's) rather than the request's deadline,
    /// which may have passed.
    fn give_back_counted(
        &self,
        batch: &Batch,
        keys: &[Bytes],
        groups: &[Group],
        slots: &[PartReply],
    ) {
        let timeout = self.main.timeout.max(self.backend(1).timeout);
        let deadline = Deadline::within(timeout);
        for call in self.refund_calls(batch, keys, groups, slots, deadline) {
            self.tasks.spawn(async move {
                if let Err(err) = call.await.and_then(|r| r.map_err(redis_error)) {
                    tracing::warn!(
                        "hits counted for a request that another Redis failed were not given back: {err}"
                    );
                }
            });
        }
    }

    /// The refund.lua calls that give back what the decided `slots` consumed, one per Cluster slot.
    fn refund_calls(
        &self,
        batch: &Batch,
        keys: &[Bytes],
        groups: &[Group],
        slots: &[PartReply],
        deadline: Deadline,
    ) -> Vec<
        impl std::future::Future<Output = Result<Result<i64, Error>, StoreError>> + Send + 'static,
    > {
        // One call per slot: refund.lua declares every key it gives back to.
        let mut refunds: Vec<Refund<'_>> = Vec::new();
        for (group, reply) in groups.iter().zip(slots) {
            if !reply.consumed(batch) {
                continue;
            }
            let (slot_of, first) = (self.slot_of(group.backend), refunds.len());
            for (&i, outcome) in group.checks.iter().zip(&reply.outcomes) {
                let slot = slot_of(&keys[i]);
                match refunds[first..].iter_mut().find(|r| r.slot == slot) {
                    Some(refund) => refund.checks.push((i, *outcome)),
                    None => refunds.push(Refund {
                        group,
                        server_ms: reply.server_ms,
                        slot,
                        checks: vec![(i, *outcome)],
                    }),
                }
            }
        }
        refunds
            .iter()
            .map(|refund| {
                let (group, checks) = (refund.group, &refund.checks);
                let RefundCall { keys, args } =
                    RefundCall::new(batch, keys, checks, refund.server_ms);
                let backend = self.backend(group.backend);
                let (until, late) = Self::wait_bound(backend, deadline);
                let call = backend.eval_on::<i64, _, _>(
                    &group.node,
                    self.refund.clone(),
                    keys,
                    args,
                    until,
                );
                group.node.wait(&self.tasks, call, until, late)
            })
            .collect()
    }
}

impl CounterStore for RedisStore {
    async fn apply(
        &self,
        batch: &Batch,
        now_millis: u64,
        deadline: Deadline,
    ) -> Result<Applied, StoreError> {
        self.decide_now(batch, now_millis, deadline).await
    }

    fn is_ready(&self) -> bool {
        self.reached.load(Ordering::Relaxed)
    }

    /// Tries [`RedisStore::ready`] every second until it succeeds.
    async fn until_ready(&self) {
        loop {
            match self.ready().await {
                Ok(()) => {
                    tracing::warn!("Redis connected and scripts loaded: serving");
                    return;
                }
                Err(err) => tracing::error!("Redis not ready, retrying: {err}"),
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    }

    /// Up when every Redis (the main one, and the per-second one when configured) has a connection up;
    /// the breaker is open when one in front of any of their servers is.
    fn health(&self) -> StoreHealth {
        StoreHealth {
            up: self.backends().all(|b| b.connected()),
            breaker_open: self.backends().any(|b| b.breaker_open()),
            counters: None,
            leases: Some(self.leases.stats()),
        }
    }

    /// Gives back the hits of leases that ended, until `stop`; then gives back every lease still held.
    async fn maintain(&self, _clock: &Clock, _every: Duration, stop: CancellationToken) {
        let Some(every) = self.leases.sweep_every() else {
            return;
        };
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = stop.cancelled() => break,
                _ = tick.tick() => {}
            }
            self.give_back(self.leases.ended(false)).await;
        }
        self.give_back(self.leases.ended(true)).await;
    }

    /// Waits briefly for the commands still watched, and what their answers start (leased hits given
    /// back, granted to requests that had stopped waiting), then closes the connections: closed first,
    /// those answers would find no connection to give their hits back on.
    async fn close(&self) {
        self.tasks.close();
        let _ = tokio::time::timeout(Duration::from_secs(1), self.tasks.wait()).await;
        for backend in self.backends() {
            backend.close().await;
        }
    }
}

/// The batch to send again after a window mismatch, and the answers to keep from this try: the checks
/// that count over their limit were counted by the parts that were decided, and must not be counted
/// twice. They go again as checks only that never deny (their first answer is the one that counts, and a
/// denial among them denies the request), the other checks as they were.
fn counted_once(
    batch: &Batch,
    groups: &[Group],
    slots: &[PartReply],
) -> (Batch, Vec<Option<Outcome>>) {
    let mut again = batch.clone();
    let mut first = vec![None; batch.checks.len()];
    for (group, slot) in groups.iter().zip(slots) {
        if slot.window_mismatch {
            continue;
        }
        for (&i, outcome) in group.checks.iter().zip(&slot.outcomes) {
            let check = &mut again.checks[i];
            if check.params.count_over_limit && check.cost > 0 {
                again.known_denied |= check.role == Role::Enforce && !outcome.allowed;
                check.cost = 0;
                check.role = Role::Shadow;
                first[i] = Some(*outcome);
            }
        }
    }
    (again, first)
}

/// `counted_once`, after `before` (an earlier try's): checks counted on an earlier try keep that try's
/// answers.
fn counted_once_again(
    batch: &Batch,
    groups: &[Group],
    slots: &[PartReply],
    before: Option<&(Batch, Vec<Option<Outcome>>)>,
) -> (Batch, Vec<Option<Outcome>>) {
    let (next, mut first) = counted_once(batch, groups, slots);
    if let Some((_, before)) = before {
        for (answer, earlier) in first.iter_mut().zip(before) {
            if earlier.is_some() {
                *answer = *earlier;
            }
        }
    }
    (next, first)
}

/// The storage keys of the batch's checks, the fixed windows' for the server time `server_ms` says.
/// All in one buffer: a request's keys take two allocations (the buffer and its shared handle), not
/// two each, however many checks it has and however often a key is handed on.
fn storage_keys(batch: &Batch, server_ms: impl Fn(&Check) -> u64) -> Vec<Bytes> {
    // A window start takes at most 20 digits.
    let room = batch.checks.iter().map(|c| c.key.len() + 20).sum();
    let mut buffer = BytesMut::with_capacity(room);
    let mut keys = Vec::with_capacity(batch.checks.len());
    for check in &batch.checks {
        check.push_storage_key(server_ms(check), &mut buffer);
        keys.push(buffer.split().freeze());
    }
    keys
}

/// Takes the grants that leases hold now (`holds`, per check of the batch) out of what the replies give
/// back when dropped; the others (their lease ended while they were asked for) go back to Redis.
fn hold(groups: &[Group], slots: &mut [PartReply], holds: &[bool]) {
    for (group, slot) in groups.iter().zip(slots) {
        if let Some(unheld) = &mut slot.unheld {
            for grant in &slot.grants {
                if holds[group.checks[grant.check]] {
                    unheld.held(grant.check);
                }
            }
        }
    }
}

/// The outcomes of every slot and of the leases, in the order of the batch's checks.
fn in_batch_order(
    batch: &Batch,
    groups: &[Group],
    slots: &[PartReply],
    taken: &Taken,
) -> Vec<Outcome> {
    let mut outcomes: Vec<Outcome> = taken
        .local
        .iter()
        .map(|local| local.unwrap_or_default())
        .collect();
    outcomes.resize(batch.checks.len(), Outcome::default());
    for (group, slot) in groups.iter().zip(slots) {
        for (&i, outcome) in group.checks.iter().zip(&slot.outcomes) {
            outcomes[i] = *outcome;
        }
    }
    outcomes
}

/// The answer to a request every check of which a lease answered.
fn answered_from_leases(batch: &Batch, leased: Settling<'_>) -> Applied {
    let mut outcomes: Vec<Outcome> = leased
        .taken
        .local
        .iter()
        .map(|local| local.unwrap_or_default())
        .collect();
    let denied = batch.is_denied(|i| outcomes[i].allowed);
    let consumed = !denied || batch.consume_on_deny;
    if !consumed {
        give_back_in_report(batch, &leased.taken, &mut outcomes);
    }
    leased.finish(consumed, &[]);
    Applied { denied, outcomes }
}

/// A request that consumed nothing reports the leased quota as it stands: what its checks took from
/// leases goes back.
fn give_back_in_report(batch: &Batch, taken: &Taken, outcomes: &mut [Outcome]) {
    for (i, local) in taken.local.iter().enumerate() {
        if local.is_some() {
            outcomes[i].remaining = outcomes[i]
                .remaining
                .saturating_add(batch.checks[i].bounded_cost());
        }
    }
}

/// After a refund, reports the quota as it stands, as a denied request does everywhere: each allowed
/// check gets back what it, and earlier checks of its key in this request, consumed. A check that counts
/// over its limit was not given back: it reports what it counted.
fn report_refunded(
    batch: &Batch,
    keys: &[Bytes],
    groups: &[Group],
    slots: &[PartReply],
    taken: &Taken,
    outcomes: &mut [Outcome],
) {
    give_back_in_report(batch, taken, outcomes);
    for (group, slot) in groups.iter().zip(slots) {
        if slot.denied {
            continue;
        }
        let mut consumed: BTreeMap<&[u8], u64> = BTreeMap::new();
        for &i in &group.checks {
            let c = &batch.checks[i];
            if outcomes[i].allowed && !c.params.count_over_limit {
                let given_back = consumed.entry(&keys[i][..]).or_default();
                *given_back = given_back.saturating_add(c.bounded_cost());
                outcomes[i].remaining = outcomes[i]
                    .remaining
                    .saturating_add(*given_back)
                    .min(c.params.burst.max(c.params.limit));
            }
        }
    }
}

async fn load_scripts(client: &Client, scripts: &[Script; 2]) -> FredResult<()> {
    for script in scripts {
        script.load(client).await?;
    }
    Ok(())
}

fn redis_error(err: Error) -> StoreError {
    StoreError::Backend(format!("redis: {err}"))
}
