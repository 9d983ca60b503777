//! The operators' API on Redis (see `store::operator`): counters read and cleared with plain commands,
//! one per key (a sliding log read by `inspect_log.lua`, in one step), each routed to its slot's server
//! on Cluster, at the server's time; runtime limit records in a hash beside their generation, both under
//! the hash tag `{ratelimitd}`, changed together by `records.lua`. Each command waits at most
//! `redis.timeout`. Besides what requests use, the API needs `+hgetall +hdel` of the least-privilege ACL
//! user (SECURITY.md), once a runtime limit has been set (until then a replica reads only the
//! generation, with GET).

use fred::{
    prelude::*,
    types::{ClusterHash, CustomCommand},
};
use futures_util::future::try_join_all;
use std::sync::LazyLock;

use super::{backend::Backend, redis_error, RedisStore};
use crate::{
    algorithm::{Algorithm, Log, State},
    store::{
        keys,
        operator::{Read, RecordKeys, Records},
        Check, StoreError,
    },
};

/// Changes the records and their generation together (its header says how).
static RECORDS_LUA: LazyLock<fred::types::scripts::Script> =
    LazyLock::new(|| fred::types::scripts::Script::from_lua(include_str!("records.lua")));

/// Reads a sliding log for an inspect, changing nothing (its header says how).
static INSPECT_LOG_LUA: LazyLock<fred::types::scripts::Script> =
    LazyLock::new(|| fred::types::scripts::Script::from_lua(include_str!("inspect_log.lua")));

/// Clears a counter that leases may hold hits of, and leaves its reset mark (its header says how).
static RESET_LUA: LazyLock<fred::types::scripts::Script> =
    LazyLock::new(|| fred::types::scripts::Script::from_lua(include_str!("reset.lua")));

/// How long a reset mark outlives the window of its counter: leases granted before the reset end with
/// their window, and what they have left reaches Redis within the sweep and its call's deadline.
const RESET_MARK_MARGIN_MS: u64 = 60_000;

/// How often a command that only reads is written: again on a new connection when the one it went on
/// closed before its answer (Redis restarting, a proxy or a firewall ending it). A command that
/// changes data is written once, as every command of a decision is (see `backend::build_pool`): the
/// change may have been made, and only its answer lost.
const READ_ATTEMPTS: u32 = 3;

/// One command, by name, routed by its first argument (a key), or to any server. A read is written
/// again when its answer is lost with its connection.
async fn command(
    backend: &Backend,
    name: &'static str,
    routed: ClusterHash,
    args: Vec<Value>,
) -> Result<Value, StoreError> {
    let reads = matches!(name, "TIME" | "GET" | "HMGET" | "HGETALL" | "ZRANGEBYSCORE");
    send(backend, name, routed, args, reads).await
}

/// `script`, which only reads, on `key` with `args`: loaded first if the server lost it, and written
/// again when its answer is lost with its connection.
async fn read_script(
    backend: &Backend,
    script: &fred::types::scripts::Script,
    key: &str,
    args: Vec<String>,
) -> Result<Value, StoreError> {
    let call = || {
        let argv = [script.sha1().to_string(), "1".to_owned(), key.to_owned()]
            .into_iter()
            .chain(args.iter().cloned())
            .map(Value::from)
            .collect();
        // EVALSHA sha numkeys key: routed by the key.
        send(backend, "EVALSHA", ClusterHash::Offset(2), argv, true)
    };
    match call().await {
        Err(StoreError::Backend(err)) if err.contains("NOSCRIPT") => {
            script
                .load(backend.pool.next_connected())
                .await
                .map_err(redis_error)?;
            call().await
        }
        answer => answer,
    }
}

async fn send(
    backend: &Backend,
    name: &'static str,
    routed: ClusterHash,
    args: Vec<Value>,
    reads: bool,
) -> Result<Value, StoreError> {
    let attempts = Options {
        max_attempts: reads.then_some(READ_ATTEMPTS),
        ..Options::default()
    };
    let client = backend.pool.next_connected().with_options(&attempts);
    let call = client.custom::<Value, _>(CustomCommand::new_static(name, routed, false), args);
    match tokio::time::timeout(backend.timeout, call).await {
        Ok(answer) => answer.map_err(redis_error),
        Err(_) => Err(StoreError::Timeout(backend.timeout)),
    }
}

async fn on_key(
    backend: &Backend,
    name: &'static str,
    key: &str,
    more: &[&str],
) -> Result<Value, StoreError> {
    let args = std::iter::once(key)
        .chain(more.iter().copied())
        .map(|a| Value::from(a.to_owned()))
        .collect();
    command(backend, name, ClusterHash::FirstKey, args).await
}

fn unexpected(what: &str, value: &Value) -> StoreError {
    StoreError::Backend(format!("unexpected reply to {what} from Redis: {value:?}"))
}

/// A reply's text, if it is one (`None` for nil).
fn text(value: &Value) -> Option<String> {
    match value {
        Value::String(s) => Some(s.to_string()),
        Value::Bytes(b) => Some(String::from_utf8_lossy(b).into_owned()),
        Value::Integer(i) => Some(i.to_string()),
        Value::Double(d) => Some(d.to_string()),
        _ => None,
    }
}

fn number<T: std::str::FromStr>(value: &Value) -> Option<T> {
    text(value)?.parse().ok()
}

/// The items of an array reply, pairs of a map reply flattened (RESP3).
fn items(value: Value) -> Vec<Value> {
    match value {
        Value::Array(items) => items
            .into_iter()
            .flat_map(|item| match item {
                Value::Array(pair) => pair,
                one => vec![one],
            })
            .collect(),
        Value::Map(map) => map
            .inner()
            .into_iter()
            .flat_map(|(k, v)| [Value::from(k), v])
            .collect(),
        _ => Vec::new(),
    }
}

/// The entries `decide.lua` reads with the `hits` member (its LOG_HEAD).
const LOG_HEAD: usize = 8;

/// A sliding log's entries (time in ms, hits) in a reply of member and score pairs, without the `hits`
/// member that holds their sum (see decide.lua).
fn log_entries(v: &[Value]) -> impl Iterator<Item = (u64, u64)> + '_ {
    v.chunks_exact(2).filter_map(|pair| {
        let member = text(&pair[0]).filter(|m| m != "hits")?;
        let time = number::<f64>(&pair[1])? as u64;
        // `<time>:<seq>:<hits>`, or `<time>:<seq>` (1 hit) from earlier versions.
        let hits = member.splitn(3, ':').nth(2).and_then(|h| h.parse().ok());
        Some((time, hits.unwrap_or(1)))
    })
}

/// A sliding log read whole (nothing stored: `None`).
fn whole_log(v: &[Value]) -> Option<State> {
    let log = Log::from_entries(log_entries(v));
    (!log.is_empty()).then_some(State::SlidingLog(log))
}

impl RedisStore {
    /// The main Redis's time, in milliseconds since the epoch.
    async fn server_ms(&self) -> Result<u64, StoreError> {
        let reply = command(&self.main, "TIME", ClusterHash::Random, Vec::new()).await?;
        let parts = items(reply.clone());
        match (
            parts.first().and_then(number::<u64>),
            parts.get(1).and_then(number::<u64>),
        ) {
            (Some(secs), Some(micros)) => {
                Ok(secs.saturating_mul(1000).saturating_add(micros / 1000))
            }
            _ => Err(unexpected("TIME", &reply)),
        }
    }

    fn backend_for(&self, check: &Check) -> &Backend {
        self.backend(self.backend_of(check.per_second))
    }

    /// The state of each check's counter at the server's time.
    pub(crate) async fn read(&self, checks: &[Check], _local_ms: u64) -> Result<Read, StoreError> {
        let now_ms = self.server_ms().await?;
        let states = try_join_all(checks.iter().map(|c| self.state(c, now_ms))).await?;
        Ok(Read { now_ms, states })
    }

    async fn state(&self, check: &Check, now_ms: u64) -> Result<Option<State>, StoreError> {
        let backend = self.backend_for(check);
        let key = check.storage_key(now_ms);
        Ok(match check.params.algorithm {
            Algorithm::FixedWindow => {
                let count = number::<u64>(&on_key(backend, "GET", &key, &[]).await?);
                count.map(|count| State::FixedWindow {
                    start_ms: check.window_start_secs(now_ms).unwrap_or(0) * 1000,
                    count,
                })
            }
            Algorithm::Gcra => number::<u64>(&on_key(backend, "GET", &key, &[]).await?)
                .map(|tat_us| State::Gcra { tat_us }),
            Algorithm::SlidingWindow => {
                let v = items(on_key(backend, "HMGET", &key, &["s", "c", "p"]).await?);
                match (v.first(), v.get(1), v.get(2)) {
                    (Some(s), Some(c), Some(p)) => {
                        number::<u64>(s).map(|start_ms| State::SlidingWindow {
                            start_ms,
                            current: number(c).unwrap_or(0),
                            previous: number(p).unwrap_or(0),
                        })
                    }
                    _ => None,
                }
            }
            Algorithm::TokenBucket => {
                let v = items(on_key(backend, "HMGET", &key, &["t", "l"]).await?);
                match (
                    v.first().and_then(number::<f64>),
                    v.get(1).and_then(number::<u64>),
                ) {
                    (Some(tokens), Some(last_ms)) => Some(State::TokenBucket { tokens, last_ms }),
                    _ => None,
                }
            }
            Algorithm::SlidingLog => {
                self.log_state(backend, &key, check.params.window_ms, now_ms)
                    .await?
            }
        })
    }

    /// A sliding log as `usage` reads it, in as few entries as `decide.lua` reads for a decision, in one
    /// step (`inspect_log.lua`): the `hits` member and the oldest entries, then only those that left the
    /// window beyond them, and the newest. The entries between the oldest read and the newest are summed
    /// into the newest, which leaves the hits in the window and the reset exact. A short log, a log an
    /// earlier version wrote (no `hits`) and a Redis user without ZRANGE read the whole log, as a
    /// decision does.
    async fn log_state(
        &self,
        backend: &Backend,
        key: &str,
        window_ms: u64,
        now_ms: u64,
    ) -> Result<Option<State>, StoreError> {
        let gone_at = now_ms.saturating_sub(window_ms);
        let args = vec![gone_at.to_string(), LOG_HEAD.to_string()];
        let reply = read_script(backend, &INSPECT_LOG_LUA, key, args).await?;
        let parts: Vec<Vec<Value>> = match reply {
            Value::Array(parts) if parts.len() == 3 => parts.into_iter().map(items).collect(),
            other => return Err(unexpected("inspect_log.lua", &other)),
        };
        let (head, gone, newest) = (&parts[0], &parts[1], &parts[2]);
        // Short (or none), or read whole for a user without ZRANGE (nothing else read then).
        if head.len() < 2 * (LOG_HEAD + 1) || newest.is_empty() {
            return Ok(whole_log(head));
        }
        // Written by an earlier version, without `hits`: counted whole, as a decision counts it.
        if text(&head[0]).as_deref() != Some("hits") {
            let all = on_key(
                backend,
                "ZRANGEBYSCORE",
                key,
                &["-inf", "+inf", "WITHSCORES"],
            )
            .await?;
            return Ok(whole_log(&items(all)));
        }
        let total = number::<f64>(&head[1]).map_or(0, |sum| -sum as u64);
        let oldest: Vec<(u64, u64)> = log_entries(&head[2..]).collect();
        let gone: u64 = oldest
            .iter()
            .filter(|e| e.0 <= gone_at)
            .map(|e| e.1)
            .chain(log_entries(gone).map(|e| e.1))
            .fold(0, u64::saturating_add);
        let Some((newest_ms, _)) = log_entries(newest).next().filter(|e| e.0 > gone_at) else {
            return Ok(None);
        };
        let live: Vec<(u64, u64)> = oldest.into_iter().filter(|e| e.0 > gone_at).collect();
        let rest = total
            .saturating_sub(gone)
            .saturating_sub(live.iter().map(|e| e.1).fold(0, u64::saturating_add));
        let log = Log::from_entries(
            live.into_iter()
                .chain((rest > 0).then_some((newest_ms, rest))),
        );
        Ok((!log.is_empty()).then_some(State::SlidingLog(log)))
    }

    /// Deletes each check's counter (a fixed window's current one); returns how many existed. A fixed
    /// or sliding window's counter is deleted with its reset mark set, so that hits replicas still hold
    /// in leases of it are never given to the counter that takes its place.
    pub(crate) async fn clear(
        &self,
        checks: &[Check],
        _local_ms: u64,
    ) -> Result<usize, StoreError> {
        let now_ms = self.server_ms().await?;
        let deleted = try_join_all(checks.iter().map(|c| async move {
            let key = c.storage_key(now_ms);
            let backend = self.backend_for(c);
            let leased = matches!(
                c.params.algorithm,
                Algorithm::FixedWindow | Algorithm::SlidingWindow
            );
            let mark = keys::reset_mark(key.as_bytes()).filter(|_| leased);
            let Some(mark) = mark else {
                let reply = on_key(backend, "DEL", &key, &[]).await?;
                return Ok::<_, StoreError>(number::<usize>(&reply).unwrap_or(0));
            };
            let lasts = c.params.window_ms.saturating_add(RESET_MARK_MARGIN_MS);
            let call = RESET_LUA.evalsha_with_reload::<i64, _, _>(
                backend.pool.next_connected(),
                vec![Key::from(key), Key::from(bytes::Bytes::from(mark))],
                vec![Value::from(lasts.min(i64::MAX as u64) as i64)],
            );
            match tokio::time::timeout(backend.timeout, call).await {
                Ok(deleted) => Ok(usize::try_from(deleted.map_err(redis_error)?).unwrap_or(0)),
                Err(_) => Err(StoreError::Timeout(backend.timeout)),
            }
        }))
        .await?;
        Ok(deleted.into_iter().sum())
    }

    /// The records, unless the generation is still `known`. No generation yet: no record was ever set,
    /// and the hash is not read.
    pub(crate) async fn records(
        &self,
        keys: &RecordKeys,
        known: Option<u64>,
    ) -> Result<Option<Records>, StoreError> {
        let generation =
            number::<u64>(&on_key(&self.main, "GET", &keys.generation, &[]).await?).unwrap_or(0);
        if known == Some(generation) {
            return Ok(None);
        }
        if generation == 0 {
            return Ok(Some(Records::default()));
        }
        let reply = on_key(&self.main, "HGETALL", &keys.records, &[]).await?;
        let mut records: Vec<(String, String)> = items(reply)
            .chunks_exact(2)
            .filter_map(|pair| Some((text(&pair[0])?, text(&pair[1])?)))
            .collect();
        records.sort();
        Ok(Some(Records {
            generation,
            records,
        }))
    }

    /// One change of the records by `records.lua`, with a new random generation; its reply: how many
    /// records it deleted, or -1 for a put refused.
    async fn change_records(
        &self,
        keys: &RecordKeys,
        change: &str,
        args: &[&str],
    ) -> Result<i64, StoreError> {
        // Never 0 (no generation yet), and below 2^63.
        let generation = (rand::random::<u64>() >> 1).max(1).to_string();
        let argv: Vec<String> = [generation.as_str(), change]
            .into_iter()
            .chain(args.iter().copied())
            .map(str::to_owned)
            .collect();
        let client = self.main.pool.next_connected();
        let call = RECORDS_LUA.evalsha_with_reload::<i64, _, _>(
            client,
            vec![keys.records.clone(), keys.generation.clone()],
            argv,
        );
        match tokio::time::timeout(self.main.timeout, call).await {
            Ok(reply) => reply.map_err(redis_error),
            Err(_) => Err(StoreError::Timeout(self.main.timeout)),
        }
    }

    /// Writes a record unless `most` records not expired by `now_ms` are held beside it (a new id):
    /// whether it was written.
    pub(crate) async fn put_record(
        &self,
        keys: &RecordKeys,
        id: &str,
        record: &str,
        most: usize,
        now_ms: u64,
    ) -> Result<bool, StoreError> {
        let (most, now) = (most.to_string(), now_ms.to_string());
        let reply = self
            .change_records(keys, "put", &[id, record, &most, &now])
            .await?;
        Ok(reply >= 0)
    }

    pub(crate) async fn delete_records(
        &self,
        keys: &RecordKeys,
        ids: &[String],
    ) -> Result<usize, StoreError> {
        let ids: Vec<&str> = ids.iter().map(String::as_str).collect();
        let deleted = self.change_records(keys, "delete", &ids).await?;
        Ok(usize::try_from(deleted).unwrap_or(0))
    }

    pub(crate) async fn purge_records(
        &self,
        keys: &RecordKeys,
        ids: &[String],
        now_ms: u64,
    ) -> Result<usize, StoreError> {
        let now = now_ms.to_string();
        let args: Vec<&str> = std::iter::once(now.as_str())
            .chain(ids.iter().map(String::as_str))
            .collect();
        let deleted = self.change_records(keys, "purge", &args).await?;
        Ok(usize::try_from(deleted).unwrap_or(0))
    }

    pub(crate) async fn announce(&self, keys: &RecordKeys) -> Result<(), StoreError> {
        self.change_records(keys, "announce", &[]).await?;
        Ok(())
    }

    /// Ends every quota lease without giving its hits back (see `Leases::drop_all`).
    pub(crate) fn drop_leases(&self) {
        self.leases.drop_all();
    }
}
