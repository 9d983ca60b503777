//! The Redis store: counters shared by every replica, decided with one script call per request (one per
//! hash slot on Redis Cluster), on standalone Redis, Sentinel or Cluster.
//!
//! - Atomic: `decide.lua` checks every counter of the request and consumes them only if the request is
//!   allowed, in one EVALSHA. Concurrent requests are pipelined by fred on each connection.
//! - Server time: the script reads `TIME`. Keys carry the window start (the reference key layout), which
//!   the client computes from its estimate of the server clock; a key for the wrong window is refused by
//!   the script before it touches anything, and the client retries once with the server's time.
//! - Cluster: checks are grouped by hash slot and the slots are asked concurrently. When one slot denies
//!   the request, `refund.lua` gives back what the others consumed, so the fleet never admits more than
//!   the limit.
//! - Failure: every request waits at most `redis.timeout`; a circuit breaker answers at once while Redis
//!   keeps failing. fred reconnects with backoff; scripts are loaded at start, on reconnect, and again on
//!   NOSCRIPT.

mod tls;

use std::{
    collections::BTreeMap,
    path::PathBuf,
    sync::{
        atomic::{AtomicI64, Ordering},
        Arc,
    },
    time::Duration,
};

use fred::{
    prelude::*,
    types::{
        config::{Server, ServerConfig},
        scripts::Script,
    },
};
use futures_util::future::join_all;

use super::{breaker::Breaker, Applied, Batch, CounterStore, Outcome, Role, StoreError};
use crate::{
    algorithm::{Algorithm, Decision},
    settings::{RedisSettings, RedisTopology, SocketType},
};

const DECIDE_LUA: &str = include_str!("decide.lua");
const REFUND_LUA: &str = include_str!("refund.lua");

/// Counters in Redis.
pub struct RedisStore {
    pool: Pool,
    decide: Script,
    refund: Script,
    cluster: bool,
    timeout: Duration,
    jitter_max: u64,
    breaker: Breaker,
    /// Estimated Redis clock minus local clock, in milliseconds.
    clock_offset_ms: AtomicI64,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field("cluster", &self.cluster)
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

/// The reply of one `decide.lua` call.
struct SlotReply {
    window_mismatch: bool,
    denied: bool,
    server_ms: i64,
    /// (allowed, remaining, reset) per check of the slot.
    outcomes: Vec<Outcome>,
}

impl RedisStore {
    /// Builds the store and starts connecting in the background; it does not wait for Redis.
    pub fn connect(settings: &RedisSettings, jitter_max: u64) -> Result<Arc<Self>, StoreError> {
        let config = client_config(settings)?;
        let pool = Builder::from_config(config)
            .with_connection_config(|c| {
                c.connection_timeout = settings.connect_timeout;
                c.internal_command_timeout = settings.connect_timeout;
                // Redirections (MOVED, ASK) during resharding count as attempts; redis.timeout bounds the wait.
                c.max_command_attempts = 3;
            })
            .with_performance_config(|p| {
                p.default_command_timeout = settings.timeout;
            })
            .set_policy(ReconnectPolicy::new_exponential(0, 50, 2_000, 2))
            .build_pool(settings.pool_size)
            .map_err(|e| StoreError::Config(e.to_string()))?;
        let store = Arc::new(Self {
            pool,
            decide: Script::from_lua(DECIDE_LUA),
            refund: Script::from_lua(REFUND_LUA),
            cluster: settings.topology == RedisTopology::Cluster,
            timeout: settings.timeout,
            jitter_max,
            breaker: Breaker::new(settings.breaker_failures, settings.breaker_open_for),
            clock_offset_ms: AtomicI64::new(0),
        });
        for client in store.pool.clients() {
            let (decide, refund, reloading) =
                (store.decide.clone(), store.refund.clone(), client.clone());
            client.on_reconnect(move |server| {
                let (decide, refund, client) = (decide.clone(), refund.clone(), reloading.clone());
                async move {
                    tracing::debug!(%server, "connected to Redis");
                    if let Err(err) = load_scripts(&client, &decide, &refund).await {
                        tracing::warn!(%server, "cannot load scripts after reconnecting: {err}");
                    }
                    Ok(())
                }
            });
            client.on_error(|(err, server)| async move {
                let server = server.map(|s| s.to_string()).unwrap_or_default();
                tracing::warn!(server, "Redis connection error: {err}");
                Ok(())
            });
        }
        let _ = store.pool.connect_pool();
        Ok(store)
    }

    /// Waits until every connection is up and the scripts are loaded.
    pub async fn ready(&self) -> Result<(), StoreError> {
        for client in self.pool.clients() {
            client.wait_for_connect().await.map_err(redis_error)?;
        }
        load_scripts(self.pool.next(), &self.decide, &self.refund)
            .await
            .map_err(redis_error)
    }

    /// Closes the connections.
    pub async fn close(&self) {
        let _ = self.pool.quit().await;
    }

    pub fn breaker_open(&self) -> bool {
        self.breaker.is_open()
    }

    /// Whether at least one connection to Redis is up.
    pub fn connected(&self) -> bool {
        self.pool.clients().iter().any(|c| c.is_connected())
    }

    async fn decide_now(&self, batch: &Batch, local_ms: u64) -> Result<Applied, StoreError> {
        let mut now_ms = local_ms as i64 + self.clock_offset_ms.load(Ordering::Relaxed);
        for _ in 0..2 {
            let now_ms_u = u64::try_from(now_ms).unwrap_or(0);
            let keys: Vec<String> = batch
                .checks
                .iter()
                .map(|c| c.storage_key(now_ms_u))
                .collect();
            let groups = self.slot_groups(&keys);
            let complete = groups.len() == 1;
            let replies = join_all(
                groups
                    .iter()
                    .map(|group| self.call_decide(batch, &keys, group, complete, now_ms_u)),
            )
            .await;
            let mut slots = Vec::with_capacity(replies.len());
            for reply in replies {
                slots.push(reply?);
            }
            if let Some(server_ms) = slots.iter().map(|s| s.server_ms).max() {
                self.clock_offset_ms
                    .store(server_ms - local_ms as i64, Ordering::Relaxed);
            }
            if let Some(mismatch) = slots.iter().find(|s| s.window_mismatch) {
                let server_ms = mismatch.server_ms;
                self.refund_consumed(batch, &keys, &groups, &slots).await?;
                tracing::debug!(local_ms, server_ms, "window moved on the server; retrying");
                now_ms = server_ms;
                continue;
            }
            let mut outcomes = vec![
                Outcome {
                    allowed: false,
                    remaining: 0,
                    reset_after: 0,
                    retry_after: 0,
                    retry_ms: 0,
                };
                batch.checks.len()
            ];
            for (group, slot) in groups.iter().zip(&slots) {
                for (&i, outcome) in group.iter().zip(&slot.outcomes) {
                    outcomes[i] = *outcome;
                }
            }
            let denied = batch.is_denied(|i| outcomes[i].allowed);
            if denied && !complete && !batch.consume_on_deny {
                // Another slot denied what these consumed: give it back.
                self.refund_consumed(batch, &keys, &groups, &slots).await?;
                for (group, slot) in groups.iter().zip(&slots) {
                    if !slot.denied {
                        for &i in group {
                            if outcomes[i].allowed {
                                outcomes[i].remaining = outcomes[i]
                                    .remaining
                                    .saturating_add(batch.checks[i].cost)
                                    .min(
                                        batch.checks[i]
                                            .params
                                            .burst
                                            .max(batch.checks[i].params.limit),
                                    );
                            }
                        }
                    }
                }
            }
            return Ok(Applied { denied, outcomes });
        }
        Err(StoreError::Backend(
            "the Redis clock moved across a window twice during one request".into(),
        ))
    }

    /// Indices of the checks, grouped by Cluster hash slot (one group outside Cluster).
    fn slot_groups(&self, keys: &[String]) -> Vec<Vec<usize>> {
        if !self.cluster {
            return vec![(0..keys.len()).collect()];
        }
        let mut by_slot: BTreeMap<u16, Vec<usize>> = BTreeMap::new();
        for (i, key) in keys.iter().enumerate() {
            by_slot
                .entry(fred::util::redis_keyslot(key.as_bytes()))
                .or_default()
                .push(i);
        }
        by_slot.into_values().collect()
    }

    async fn call_decide(
        &self,
        batch: &Batch,
        keys: &[String],
        group: &[usize],
        complete: bool,
        now_ms: u64,
    ) -> Result<SlotReply, StoreError> {
        let jitter = if self.jitter_max == 0 {
            0
        } else {
            rand::random_range(0..=self.jitter_max)
        };
        let mut args: Vec<i64> = Vec::with_capacity(3 + group.len() * 7);
        args.extend([
            i64::from(batch.consume_on_deny),
            if batch.known_denied {
                2
            } else {
                i64::from(complete)
            },
            to_i64(jitter),
        ]);
        let mut group_keys = Vec::with_capacity(group.len());
        for &i in group {
            let c = &batch.checks[i];
            group_keys.push(keys[i].clone());
            let p = &c.params;
            args.extend([
                i64::from(p.algorithm.code()),
                to_i64(p.limit),
                to_i64(p.window_ms),
                to_i64(c.cost),
                match c.role {
                    Role::Enforce => 0,
                    Role::Shadow => 1,
                    Role::Quota => 2,
                },
                to_i64(p.burst),
                to_i64(c.window_start_secs(now_ms).unwrap_or(0)),
            ]);
        }
        let reply: Vec<i64> = self
            .decide
            .evalsha_with_reload(self.pool.next(), group_keys, args)
            .await
            .map_err(redis_error)?;
        parse_reply(&reply, group.len())
    }

    /// Gives back the hits of every slot that consumed for this request.
    async fn refund_consumed(
        &self,
        batch: &Batch,
        keys: &[String],
        groups: &[Vec<usize>],
        slots: &[SlotReply],
    ) -> Result<(), StoreError> {
        let calls = groups.iter().zip(slots).filter_map(|(group, slot)| {
            let consumed = !slot.window_mismatch && (!slot.denied || batch.consume_on_deny);
            if !consumed {
                return None;
            }
            let refund_keys: Vec<String> = group.iter().map(|&i| keys[i].clone()).collect();
            let mut args: Vec<i64> = vec![slot.server_ms];
            for (&i, outcome) in group.iter().zip(&slot.outcomes) {
                let c = &batch.checks[i];
                // Only what was consumed: allowed checks, and every fixed-window hit.
                let hits = if outcome.allowed || c.params.algorithm == Algorithm::FixedWindow {
                    c.cost
                } else {
                    0
                };
                args.extend([
                    i64::from(c.params.algorithm.code()),
                    to_i64(hits),
                    to_i64(c.params.window_ms),
                    to_i64(c.params.limit),
                    to_i64(c.params.burst),
                ]);
            }
            Some(async move {
                self.refund
                    .evalsha_with_reload::<i64, _, _>(self.pool.next(), refund_keys, args)
                    .await
            })
        });
        for result in join_all(calls).await {
            result.map_err(redis_error)?;
        }
        Ok(())
    }
}

impl CounterStore for RedisStore {
    async fn apply(&self, batch: &Batch, now_millis: u64) -> Result<Applied, StoreError> {
        if !self.breaker.allow() {
            return Err(StoreError::CircuitOpen);
        }
        let result =
            match tokio::time::timeout(self.timeout, self.decide_now(batch, now_millis)).await {
                Ok(result) => result,
                Err(_) => Err(StoreError::Timeout(self.timeout)),
            };
        match &result {
            Ok(_) => self.breaker.success(),
            Err(err) => {
                if self.breaker.failure() {
                    tracing::warn!("Redis failing ({err}): circuit breaker open");
                }
            }
        }
        result
    }
}

fn to_i64(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

fn parse_reply(reply: &[i64], checks: usize) -> Result<SlotReply, StoreError> {
    let bad = || StoreError::Backend(format!("unexpected reply from decide.lua: {reply:?}"));
    let (&status, rest) = reply.split_first().ok_or_else(bad)?;
    let (&denied, rest) = rest.split_first().ok_or_else(bad)?;
    let (&server_ms, rest) = rest.split_first().ok_or_else(bad)?;
    if status == 1 {
        return Ok(SlotReply {
            window_mismatch: true,
            denied: false,
            server_ms,
            outcomes: Vec::new(),
        });
    }
    if status != 0 || rest.len() != checks * 4 {
        return Err(bad());
    }
    Ok(SlotReply {
        window_mismatch: false,
        denied: denied == 1,
        server_ms,
        outcomes: rest
            .chunks_exact(4)
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

async fn load_scripts(client: &Client, decide: &Script, refund: &Script) -> FredResult<()> {
    decide.load(client).await?;
    refund.load(client).await
}

fn redis_error(err: Error) -> StoreError {
    StoreError::Backend(format!("redis: {err}"))
}

/// Splits `host:port` (IPv6 in brackets allowed).
fn host_port(text: &str, default_port: u16) -> Result<(String, u16), StoreError> {
    let text = text.trim();
    let text = text
        .strip_prefix("redis://")
        .or_else(|| text.strip_prefix("rediss://"))
        .unwrap_or(text);
    let text = text.rsplit_once('@').map_or(text, |(_, host)| host);
    let text = text.split('/').next().unwrap_or(text);
    let (host, port) = match text.rsplit_once(':') {
        Some((host, port)) if !host.is_empty() && !port.contains(']') => (
            host,
            port.parse()
                .map_err(|_| StoreError::Config(format!("REDIS_URL: bad port in {text:?}")))?,
        ),
        _ => (text, default_port),
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    if host.is_empty() {
        return Err(StoreError::Config(format!(
            "REDIS_URL: no host in {text:?}"
        )));
    }
    Ok((host.to_owned(), port))
}

/// The fred configuration for the settings.
fn client_config(settings: &RedisSettings) -> Result<Config, StoreError> {
    // `password` or `user:password` (a Redis ACL user); empty: no authentication.
    let credentials = |auth: &str| match auth.split_once(':') {
        _ if auth.is_empty() => (None, None),
        Some((user, password)) => (Some(user.to_owned()), Some(password.to_owned())),
        None => (None, Some(auth.to_owned())),
    };
    let url = settings.url.trim();
    let tls = settings.tls || url.starts_with("rediss://");
    let is_path = url.starts_with('/');
    let unix = match settings.socket_type {
        Some(SocketType::Unix) => true,
        Some(SocketType::Tcp) => false,
        None => is_path,
    };
    let mut config = match settings.topology {
        RedisTopology::Single if unix => Config {
            server: ServerConfig::Unix {
                path: PathBuf::from(url),
            },
            ..Config::default()
        },
        RedisTopology::Single if url.starts_with("redis://") || url.starts_with("rediss://") => {
            Config::from_url(url).map_err(|e| StoreError::Config(format!("REDIS_URL: {e}")))?
        }
        RedisTopology::Single => {
            let (host, port) = host_port(url, 6379)?;
            Config {
                server: ServerConfig::new_centralized(host, port),
                ..Config::default()
            }
        }
        RedisTopology::Sentinel => {
            let (username, password) = credentials(&settings.sentinel_auth.0);
            let mut parts = url.split(',').map(str::trim).filter(|p| !p.is_empty());
            let service_name = parts.next().unwrap_or_default().to_owned();
            let hosts = parts
                .map(|p| host_port(p, 26379).map(|(h, p)| Server::new(h, p)))
                .collect::<Result<Vec<_>, _>>()?;
            if service_name.is_empty() || hosts.is_empty() {
                return Err(StoreError::Config(
                    "REDIS_URL: Sentinel needs `mastername,host:port[,host:port...]`".into(),
                ));
            }
            Config {
                server: ServerConfig::Sentinel {
                    hosts,
                    service_name,
                    username,
                    password,
                },
                ..Config::default()
            }
        }
        RedisTopology::Cluster => {
            let hosts = url
                .split(',')
                .map(str::trim)
                .filter(|p| !p.is_empty())
                .map(|p| host_port(p, 6379))
                .collect::<Result<Vec<_>, _>>()?;
            if hosts.is_empty() {
                return Err(StoreError::Config(
                    "REDIS_URL: Cluster needs `host:port[,host:port...]` seed nodes".into(),
                ));
            }
            Config {
                server: ServerConfig::new_clustered(hosts),
                ..Config::default()
            }
        }
    };
    config.fail_fast = false;
    // Without REDIS_AUTH, credentials in a `redis://user:password@...` URL stay.
    if !settings.auth.0.is_empty() {
        (config.username, config.password) = credentials(&settings.auth.0);
    }
    if tls {
        config.tls = Some(tls::connector(settings)?.into());
    }
    Ok(config)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(url: &str, topology: RedisTopology) -> RedisSettings {
        RedisSettings {
            url: url.into(),
            topology,
            ..RedisSettings::default()
        }
    }

    #[test]
    fn addresses_in_every_reference_form() {
        let c = client_config(&settings("redis.internal:6380", RedisTopology::Single)).unwrap();
        assert_eq!(
            c.server,
            ServerConfig::new_centralized("redis.internal", 6380)
        );
        let c = client_config(&settings("/var/run/redis.sock", RedisTopology::Single)).unwrap();
        assert!(matches!(c.server, ServerConfig::Unix { .. }));
        let c = client_config(&settings("redis://u:p@h:7000/0", RedisTopology::Single)).unwrap();
        assert_eq!(c.server, ServerConfig::new_centralized("h", 7000));
        let c = client_config(&settings(
            "mymaster, s1:26379, s2:26380",
            RedisTopology::Sentinel,
        ))
        .unwrap();
        assert_eq!(
            c.server,
            ServerConfig::new_sentinel(vec![("s1", 26379), ("s2", 26380)], "mymaster")
        );
        let c = client_config(&settings("a:7000,b:7001", RedisTopology::Cluster)).unwrap();
        assert_eq!(
            c.server,
            ServerConfig::new_clustered(vec![("a", 7000), ("b", 7001)])
        );
        assert!(client_config(&settings("mymaster", RedisTopology::Sentinel)).is_err());
        assert!(client_config(&settings("h:port", RedisTopology::Single)).is_err());
    }

    #[test]
    fn auth_takes_a_password_or_an_acl_user() {
        let mut s = settings("h:1", RedisTopology::Single);
        s.auth = crate::settings::Secret("pw".into());
        let c = client_config(&s).unwrap();
        assert_eq!((c.username, c.password.as_deref()), (None, Some("pw")));
        s.auth = crate::settings::Secret("app:pw".into());
        let c = client_config(&s).unwrap();
        assert_eq!(
            (c.username.as_deref(), c.password.as_deref()),
            (Some("app"), Some("pw"))
        );
        let c = client_config(&settings("redis://u:p@h:7000", RedisTopology::Single)).unwrap();
        assert_eq!(
            (c.username.as_deref(), c.password.as_deref()),
            (Some("u"), Some("p")),
            "without REDIS_AUTH the URL's credentials stay"
        );
    }

    #[test]
    fn sentinels_get_their_own_credentials_and_the_master_its_own() {
        let mut s = settings("mymaster,s1:26379", RedisTopology::Sentinel);
        s.auth = crate::settings::Secret("master-pw".into());
        let c = client_config(&s).unwrap();
        assert_eq!(c.password.as_deref(), Some("master-pw"));
        assert!(
            matches!(
                &c.server,
                ServerConfig::Sentinel {
                    username: None,
                    password: None,
                    ..
                }
            ),
            "no REDIS_SENTINEL_AUTH: the sentinels are asked without the master's password"
        );
        s.sentinel_auth = crate::settings::Secret("watcher:sentinel-pw".into());
        let c = client_config(&s).unwrap();
        assert_eq!(
            (c.username, c.password.as_deref()),
            (None, Some("master-pw"))
        );
        let ServerConfig::Sentinel {
            username, password, ..
        } = &c.server
        else {
            panic!("not a sentinel config: {:?}", c.server);
        };
        assert_eq!(
            (username.as_deref(), password.as_deref()),
            (Some("watcher"), Some("sentinel-pw"))
        );
    }

    #[test]
    fn malformed_script_replies_are_errors_not_panics() {
        assert!(parse_reply(&[], 1).is_err());
        assert!(parse_reply(&[0, 0, 5, 1, 2, 3], 1).is_err());
        assert!(parse_reply(&[7, 0, 5], 0).is_err());
        let r = parse_reply(&[0, 1, 5, 0, 0, 2500, 1001], 1).unwrap();
        assert!(r.denied && !r.outcomes[0].allowed);
        assert_eq!(
            (r.outcomes[0].reset_after, r.outcomes[0].retry_after),
            (3, 2)
        );
        assert!(parse_reply(&[1, 0, 5], 2).unwrap().window_mismatch);
    }
}
