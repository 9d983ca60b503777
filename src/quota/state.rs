//! Where the buckets' members live: in this process for one replica (the memory store), or in Redis
//! beside the counters, so that every replica behind one Service shares them. Both recompute a bucket
//! atomically with [`share::apply`](super::share::apply): in the memory store under the bucket's lock,
//! in Redis as one call of `share.lua`, which mirrors it, made by the Redis store
//! (`store::redis::share`) as it makes the counters' calls.
//!
//! A bucket's state in Redis is a hash under `<prefix>{<domain>_<key>_<value>_...}:rlqs` (see
//! [`keys::bucket_key`](crate::store::keys::bucket_key)), one field per member (and one beside it while
//! the member is held at a share it just gave up), that expires with the last assignment counting in it.

use std::{
    collections::HashMap,
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc, Mutex,
    },
};

use super::{
    lock,
    share::{self, Bucket, Call, Reply},
};
use crate::{
    clock::Clock,
    store::{Deadline, RedisStore, StoreError},
};

/// Members the memory store keeps over all its buckets, per bucket the replica tracks
/// (`rlqs.max_buckets`): a newcomer past it is refused, as in a full bucket. A stream's members outlive it
/// by their assignment's TTL (its Envoy may still spend what it was granted), so streams that come and go
/// faster than that leave members behind; this bounds them, and the memory they hold, to as many again as
/// the buckets of the streams that are open.
pub const MEMORY_MEMBERS_PER_BUCKET: usize = 2;

/// The buckets' members.
#[derive(Debug)]
pub enum Shares {
    Memory(MemoryShares),
    Redis(RedisShares),
}

impl Shares {
    /// Recomputes the bucket under `key` (see [`share::apply`]), waiting for Redis no longer than
    /// `REDIS_TIMEOUT`.
    pub async fn share(&self, key: &str, call: &Call) -> Result<Reply, StoreError> {
        self.share_by(key, call, None).await
    }

    /// Recomputes the bucket under `key`; Redis is waited for until `deadline` at most (and never past
    /// `REDIS_TIMEOUT` when the deadline is not a caller's).
    pub async fn share_by(
        &self,
        key: &str,
        call: &Call,
        deadline: Option<Deadline>,
    ) -> Result<Reply, StoreError> {
        match self {
            Shares::Memory(m) => Ok(m.share(key, call)),
            Shares::Redis(r) => {
                let deadline = deadline.unwrap_or_else(|| Deadline::within(r.store.timeout()));
                r.store.share(key, call, deadline).await
            }
        }
    }

    /// Forgets buckets whose every member has expired (Redis expires them itself).
    pub fn sweep(&self) {
        if let Shares::Memory(m) = self {
            m.sweep();
        }
    }
}

/// Members in this process: exact for one replica.
#[derive(Debug)]
pub struct MemoryShares {
    buckets: Mutex<HashMap<String, Bucket>>,
    clock: Clock,
    /// Members held over all buckets.
    members: AtomicUsize,
    /// The most members held over all buckets ([`MEMORY_MEMBERS_PER_BUCKET`] times `rlqs.max_buckets`).
    max_members: usize,
}

impl MemoryShares {
    pub fn new(clock: Clock, max_members: usize) -> Self {
        Self {
            buckets: Mutex::new(HashMap::new()),
            clock,
            members: AtomicUsize::new(0),
            max_members,
        }
    }

    fn share(&self, key: &str, call: &Call) -> Reply {
        let now = self.clock.now_millis();
        let mut buckets = lock(&self.buckets);
        let held = self.members.load(Ordering::Relaxed);
        let bucket = buckets.entry(key.to_owned()).or_default();
        let before = bucket.members.len();
        // Room for newcomers: what the bucket allows, and what is left over all buckets.
        let room = self.max_members.saturating_sub(held).saturating_add(before);
        let call_within = Call {
            max_members: call.max_members.min(room),
            ..call.clone()
        };
        let reply = share::apply(bucket, now, &call_within);
        let after = bucket.members.len();
        if after == 0 {
            buckets.remove(key);
        }
        if after >= before {
            self.members.fetch_add(after - before, Ordering::Relaxed);
        } else {
            self.members.fetch_sub(before - after, Ordering::Relaxed);
        }
        reply
    }

    fn sweep(&self) {
        let now = self.clock.now_millis();
        let mut buckets = lock(&self.buckets);
        let mut removed = 0;
        buckets.retain(|_, bucket| {
            let before = bucket.members.len();
            bucket.members.retain(|_, m| m.expires_ms > now);
            removed += before - bucket.members.len();
            !bucket.members.is_empty()
        });
        self.members.fetch_sub(removed, Ordering::Relaxed);
    }

    /// Members held over all buckets, expired ones not yet swept included.
    pub fn len(&self) -> usize {
        self.members.load(Ordering::Relaxed)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Members in Redis, beside the counters: every call goes through the Redis store (its breaker, its
/// deadline, its errors; see `store::redis::share`).
#[derive(Debug)]
pub struct RedisShares {
    store: Arc<RedisStore>,
}

impl RedisShares {
    pub fn new(store: Arc<RedisStore>) -> Self {
        Self { store }
    }
}
