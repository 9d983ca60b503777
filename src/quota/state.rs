//! Where the buckets' members live: in this process for one replica (the memory store), or in Redis
//! beside the counters, so that every replica behind one Service shares them. Both recompute a bucket
//! atomically with [`share::apply`](super::share::apply): in the memory store under the bucket's lock,
//! in Redis as one call of `share.lua`, which mirrors it.
//!
//! A bucket's state is a hash under `<prefix>{<domain>_<key>_<value>_...}:rlqs` (see
//! [`keys::bucket_key`](crate::store::keys::bucket_key)), one field per member, that expires with the last
//! assignment counting in it.

use std::{
    collections::HashMap,
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc, Mutex,
    },
};

use fred::{prelude::*, types::scripts::Script};

use super::share::{self, Bucket, Call, DemandUpdate, Given, Listing, Reply};
use crate::{
    clock::Clock,
    store::{RedisStore, StoreError},
};

/// The calling contract of the script is in its header.
const SHARE_LUA: &str = include_str!("share.lua");

/// Most members the memory store keeps over all its buckets: a newcomer past it is refused, as in a full
/// bucket. Every member is bounded by its stream's buckets and expires with its assignment; this bounds
/// what streams that come and go faster than their TTL could leave behind.
pub const MEMORY_MAX_MEMBERS: usize = 1_000_000;

/// The buckets' members.
#[derive(Debug)]
pub enum Shares {
    Memory(MemoryShares),
    Redis(RedisShares),
}

impl Shares {
    /// Recomputes the bucket under `key` (see [`share::apply`]).
    pub async fn share(&self, key: &str, call: &Call) -> Result<Reply, StoreError> {
        match self {
            Shares::Memory(m) => Ok(m.share(key, call)),
            Shares::Redis(r) => r.share(key, call).await,
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
}

impl MemoryShares {
    pub fn new(clock: Clock) -> Self {
        Self {
            buckets: Mutex::new(HashMap::new()),
            clock,
            members: AtomicUsize::new(0),
        }
    }

    fn share(&self, key: &str, call: &Call) -> Reply {
        let now = self.clock.now_millis();
        let mut buckets = self.buckets.lock().unwrap_or_else(|p| p.into_inner());
        let held = self.members.load(Ordering::Relaxed);
        let bucket = buckets.entry(key.to_owned()).or_default();
        let before = bucket.members.len();
        // Room for newcomers: what the bucket allows, and what is left over all buckets.
        let room = MEMORY_MAX_MEMBERS
            .saturating_sub(held)
            .saturating_add(before);
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
        let mut buckets = self.buckets.lock().unwrap_or_else(|p| p.into_inner());
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

/// Members in Redis, on the main Redis deployment of the counters (standalone, Sentinel or Cluster: a
/// bucket is one key).
#[derive(Debug)]
pub struct RedisShares {
    store: Arc<RedisStore>,
    script: Script,
}

impl RedisShares {
    pub fn new(store: Arc<RedisStore>) -> Self {
        Self {
            store,
            script: Script::from_lua(SHARE_LUA),
        }
    }

    async fn share(&self, key: &str, call: &Call) -> Result<Reply, StoreError> {
        let mut args: Vec<String> =
            Vec::with_capacity(3 + 7 * call.limits.len() + 4 * call.members.len());
        args.push(call.counts_for_ms.to_string());
        args.push(call.max_members.to_string());
        args.push(call.limits.len().to_string());
        for limit in &call.limits {
            args.push(number(limit.rate));
            match limit.window {
                Some(w) => {
                    args.push(w.start_ms.to_string());
                    args.push(number(w.used));
                    args.push(number(w.added));
                    args.push(w.window_ms.to_string());
                    args.push(w.elapsed_ms.to_string());
                    args.push(w.floor_ms.to_string());
                }
                None => args.extend(std::iter::repeat_n(String::new(), 6)),
            }
        }
        for listed in &call.members {
            args.push(listed.id.clone());
            args.push(match listed.demand {
                DemandUpdate::Keep => String::new(),
                DemandUpdate::Unknown => "-".into(),
                DemandUpdate::Rate(rate) => number(rate),
            });
            args.push(
                match listed.listing {
                    Listing::Reported => "r",
                    Listing::Pushed => "p",
                }
                .into(),
            );
            args.push(listed.sent_version.to_string());
        }
        let pool = self.store.pool();
        let reply: Vec<Value> = self
            .script
            .evalsha_with_reload(pool.next(), key, args)
            .await
            .map_err(|e| StoreError::Backend(format!("redis: {e}")))?;
        parse_reply(&reply, call.members.len())
    }
}

/// A number as the script reads it: the shortest text that reads back exactly.
fn number(x: f64) -> String {
    format!("{x:e}")
}

fn parse_reply(reply: &[Value], listed: usize) -> Result<Reply, StoreError> {
    let bad = || StoreError::Backend(format!("redis: unexpected share.lua reply {reply:?}"));
    if reply.len() != 3 + listed {
        return Err(bad());
    }
    let members = reply[0]
        .as_u64()
        .and_then(|n| usize::try_from(n).ok())
        .ok_or_else(bad)?;
    let text = |v: &Value| v.as_str().map(|s| s.to_string()).ok_or_else(bad);
    let granted = text(&reply[1])?.parse::<f64>().map_err(|_| bad())?;
    let pool = text(&reply[2])?.parse::<f64>().map_err(|_| bad())?;
    let mut given = Vec::with_capacity(listed);
    for value in &reply[3..] {
        let value = text(value)?;
        given.push(match value.as_str() {
            "full" => Given::Full,
            "gone" => Given::Gone,
            share => {
                let mut parts = share.split(' ');
                let mut next = || parts.next().ok_or_else(bad);
                let grant = next()?.parse::<f64>().map_err(|_| bad())?;
                let target = next()?.parse::<f64>().map_err(|_| bad())?;
                let changed = next()? == "1";
                let version = next()?.parse::<f64>().map_err(|_| bad())? as u64;
                Given::Share {
                    grant,
                    target,
                    changed,
                    version,
                }
            }
        });
    }
    Ok(Reply {
        given,
        pool,
        members,
        granted,
    })
}
