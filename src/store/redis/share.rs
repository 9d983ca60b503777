//! The rate limit quota service's buckets in Redis, beside the counters on the main deployment
//! (standalone, Sentinel or Cluster: a bucket is one key, its hash tag that of the descriptor). One call
//! of `share.lua` recomputes a bucket atomically; the script mirrors `quota::share::apply`, and its
//! calling contract is in its header.
//!
//! A call goes the way the counters' calls go: refused at once while the bucket's server has no
//! connection or its circuit breaker is open, waited for no longer than the caller's deadline, and watched
//! by the server's health like every other command, with the store's errors.

use std::sync::LazyLock;

use fred::{prelude::*, types::scripts::Script};

use super::{redis_error, Group, RedisStore};
use crate::{
    quota::share::{Call, DemandUpdate, Given, Listing, Reply},
    store::{Deadline, StoreError},
};

/// The script, loaded on first use (and again on NOSCRIPT, after a restart or failover).
static SHARE: LazyLock<Script> = LazyLock::new(|| Script::from_lua(include_str!("share.lua")));

impl RedisStore {
    /// `REDIS_TIMEOUT` of the main deployment: the longest a call without a caller's deadline waits.
    pub fn timeout(&self) -> std::time::Duration {
        self.main.timeout
    }

    /// Recomputes the bucket under `key` with `call` (see `quota::share::apply`), on the Redis server's
    /// clock; gives up at `deadline`.
    pub async fn share(
        &self,
        key: &str,
        call: &Call,
        deadline: Deadline,
    ) -> Result<Reply, StoreError> {
        let backend = &self.main;
        let slot = backend
            .cluster
            .then(|| fred::util::redis_keyslot(key.as_bytes()));
        let node = backend.node_for_slot(slot);
        self.admit(&[Group {
            backend: 0,
            checks: Default::default(),
            node: node.clone(),
        }])?;
        let (key, args) = (key.to_owned(), arguments(call));
        let (until, late) = Self::wait_bound(backend, deadline);
        let command = backend.eval_on::<Vec<Value>, _, _>(&node, SHARE.clone(), key, args, until);
        let reply = node
            .wait(&self.tasks, command, until, late)
            .await?
            .map_err(redis_error)?;
        parse_reply(&reply, call.members.len())
    }
}

/// The script's ARGV for `call`.
fn arguments(call: &Call) -> Vec<String> {
    let mut args: Vec<String> =
        Vec::with_capacity(4 + 7 * call.limits.len() + 4 * call.members.len());
    args.push(call.counts_for_ms.to_string());
    args.push(call.hold_ms.to_string());
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
    args
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
