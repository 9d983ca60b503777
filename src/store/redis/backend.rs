//! One Redis deployment (a server, a Sentinel-watched master, or a Cluster): its connection pool, the
//! health of each of its servers, the Cluster slot map, and the estimate of its clock. The store has one
//! for all limits, and a second one for limits whose unit is SECOND when `REDIS_PERSECOND` asks for it.

use std::{
    collections::HashMap,
    sync::{
        atomic::{AtomicBool, AtomicI64, Ordering},
        Arc, Mutex,
    },
    time::Duration,
};

use arc_swap::ArcSwapOption;
use fred::{
    prelude::*,
    types::{
        cluster::ClusterRouting, config::Server, scripts::Script, MultipleKeys, MultipleValues,
    },
};

use tokio_util::task::TaskTracker;

use super::{
    coalesce::{asking, importing_closed, is_moved, Bounds, Caller, Next, Pauses, Route},
    config::client_config,
    load_scripts,
    node::{is_cluster_down, never_written, Node, Probe},
    redis_error,
    sentinel::Switches,
    RedisSettings, RedisTopology,
};
use crate::store::{breaker::Breaker, StoreError};

/// How each server's breaker and silence bound are set.
#[derive(Debug, Clone, Copy)]
struct NodeSettings {
    breaker_failures: u32,
    breaker_open_for: Duration,
    unresponsive_after: Duration,
}

impl NodeSettings {
    fn node(&self, name: String, direct: Option<Pool>) -> Arc<Node> {
        Arc::new(Node::new(
            name,
            Breaker::new(self.breaker_failures, self.breaker_open_for),
            self.unresponsive_after,
            direct,
        ))
    }
}

/// One Redis deployment and what this replica knows of it.
pub struct Backend {
    /// `main` or `per-second`, for logs.
    pub name: &'static str,
    pub pool: Pool,
    /// Sends the decide calls, coalescing the requests that wait for a server.
    pub caller: Arc<Caller>,
    pub cluster: bool,
    /// How long calls without a deadline of their own wait (`REDIS_TIMEOUT`).
    pub timeout: Duration,
    /// The server of a standalone or Sentinel setup; on Cluster, slots not mapped yet.
    single: Arc<Node>,
    /// Cluster masters by address, created when first used; shared with `caller`, which asks a master
    /// importing a slot for the keys already there.
    masters: Masters,
    /// The Cluster slot map, refreshed when the cluster changes.
    routing: ArcSwapOption<ClusterRouting>,
    node_settings: NodeSettings,
    /// Estimated server clock minus local clock, in milliseconds.
    pub clock_offset_ms: AtomicI64,
    /// Set by [`Backend::close`]: connection tasks that end are not started again.
    closing: AtomicBool,
    /// The connection errors logged lately.
    connection_errors: ErrorLog,
    /// The server the pooled connections last reached, outside a Cluster: a Sentinel failover moves
    /// them to another.
    master: Mutex<Option<Server>>,
    /// Itself, for the callbacks of connections made later (a Cluster master's own).
    this: std::sync::Weak<Backend>,
    /// What a Cluster master's own connections are made of.
    direct: Direct,
    /// The socket path when the server is reached by one; else servers are asked on their TCP port.
    unix_socket: Option<std::path::PathBuf>,
    /// On Sentinel: the subscription to the Sentinels' announcements of a new master, and the master
    /// the pooled connections are being moved to.
    switches: Mutex<Option<Switches>>,
    switching_to: Mutex<Option<Server>>,
}

/// The Cluster masters known from the slot map, by address.
#[derive(Debug, Default, Clone)]
pub struct Masters(Arc<Mutex<HashMap<Server, Arc<Node>>>>);

impl std::ops::Deref for Masters {
    type Target = Mutex<HashMap<Server, Arc<Node>>>;

    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

impl Masters {
    /// The master at `server` if it is known and has connections of its own: where a key a slot's
    /// migration has moved there already is asked for (the Cluster client's own following of ASK
    /// sends the command back to the slot's old owner).
    pub fn importing(&self, server: &Server) -> Option<Arc<Node>> {
        lock(self)
            .get(server)
            .filter(|node| node.direct().is_some())
            .cloned()
    }
}

/// What a Cluster master's own pool of connections is made of: the Cluster's configuration, pointed
/// at that master alone.
struct Direct {
    config: Config,
    settings: RedisSettings,
    command_timeout: Duration,
    scripts: [Script; 2],
}

/// How long the same connection error of the same server is not logged again.
const CONNECTION_ERROR_LOG_EVERY: Duration = Duration::from_secs(10);

/// Which connection errors were logged, and when: the pooled connections each retry on their own, and
/// without it a Redis down or a wrong password wrote one line per connection per retry.
#[derive(Debug, Default)]
struct ErrorLog(Mutex<HashMap<(String, String), std::time::Instant>>);

impl ErrorLog {
    /// Whether this error of this server was not logged within [`CONNECTION_ERROR_LOG_EVERY`]; it counts
    /// as logged now if so.
    fn first_in_a_while(&self, server: &str, error: &str) -> bool {
        let mut logged = lock(&self.0);
        let now = std::time::Instant::now();
        // Forget what is old, so that the table stays as small as the errors of the last while.
        logged.retain(|_, at| now.duration_since(*at) < CONNECTION_ERROR_LOG_EVERY);
        match logged.entry((server.to_owned(), error.to_owned())) {
            std::collections::hash_map::Entry::Occupied(_) => false,
            std::collections::hash_map::Entry::Vacant(slot) => {
                slot.insert(now);
                true
            }
        }
    }
}

impl std::fmt::Debug for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Backend")
            .field("name", &self.name)
            .field("cluster", &self.cluster)
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

/// What a Redis's logins are made of, for the hint a refused one gets.
#[derive(Debug, Clone, Copy)]
struct Login {
    topology: RedisTopology,
    /// `REDIS_` or `REDIS_PERSECOND_`.
    variables: &'static str,
    /// The settings file's section: `redis` or `redis_per_second`.
    section: &'static str,
    /// Whether a password for the servers, and one for the Sentinels, is set.
    auth: bool,
    sentinel_auth: bool,
    /// Whether the connections use TLS (`REDIS_TLS`, a `rediss://` URL).
    tls: bool,
}

impl Login {
    fn of(name: &str, settings: &RedisSettings) -> Self {
        Self {
            topology: settings.topology,
            variables: variables_of(name),
            section: if name == "per-second" {
                "redis_per_second"
            } else {
                "redis"
            },
            auth: !settings.auth.0.is_empty(),
            sentinel_auth: !settings.sentinel_auth.0.is_empty(),
            tls: settings.tls || settings.url.starts_with("rediss://"),
        }
    }
}

/// What to set when a server refuses the connection's credentials or certificate: which password a refusal asks for is
/// not in Redis's message, and a Sentinel set has two (the servers' and the Sentinels' own). The Redis
/// client words every error met on its way through the Sentinels alike, whoever refused, so which of
/// the two is wanted is read from which is set.
fn auth_hint(message: &str, login: Login) -> String {
    let (v, section) = (login.variables, login.section);
    // The TLS files and checks are the main Redis's, which the per-second one shares.
    if message.contains("UnknownIssuer") {
        return " (the server's certificate is not signed by a CA in REDIS_TLS_CACERT)".into();
    }
    if message.contains("NotValidForName") {
        return format!(
            " (the server's certificate does not name the host of {v}URL: use a name it was issued for, or set REDIS_TLS_SKIP_HOSTNAME_VERIFICATION=true)"
        );
    }
    // A server that takes TLS only drops a plain connection at its first bytes.
    if !login.tls
        && (message.contains("Connection reset by peer") || message.contains("UnexpectedEof"))
    {
        return format!(
            " (if the server takes TLS connections only, set {v}TLS=true or write a rediss:// {v}URL)"
        );
    }
    let noauth = message.contains("NOAUTH");
    let refused = message.contains("WRONGPASS") || message.contains("invalid username-password");
    if login.topology == RedisTopology::Sentinel {
        if noauth {
            return match (login.auth, login.sentinel_auth) {
                (false, true) => format!(
                    " (the Redis servers want a password: set {v}AUTH, or {section}.auth)"
                ),
                (true, false) => format!(
                    " (the Sentinels want a password of their own: set {v}SENTINEL_AUTH, or {section}.sentinel_auth)"
                ),
                (false, false) => format!(
                    " (the Redis servers' password is {v}AUTH and the Sentinels' own {v}SENTINEL_AUTH: set the one they want)"
                ),
                (true, true) => format!(
                    " (check {v}AUTH for the Redis servers and {v}SENTINEL_AUTH for the Sentinels)"
                ),
            };
        }
        if refused {
            return format!(
                " (check {v}AUTH for the Redis servers and {v}SENTINEL_AUTH for the Sentinels)"
            );
        }
        if message.contains("Failed to connect to all sentinel nodes") {
            return format!(
                " (check the Sentinels' addresses in {v}URL, and their own password, {v}SENTINEL_AUTH)"
            );
        }
        return String::new();
    }
    if noauth {
        format!(" (the server wants a password: set {v}AUTH, or {section}.auth)")
    } else if refused {
        format!(" (check {v}AUTH)")
    } else {
        String::new()
    }
}

/// The prefix of the environment variables of the Redis named `name` (`main` or `per-second`).
fn variables_of(name: &str) -> &'static str {
    if name == "per-second" {
        "REDIS_PERSECOND_"
    } else {
        "REDIS_"
    }
}

/// How long a wait for a client's connection listens before reading its state again.
const CONNECTED_CHECK_EVERY: Duration = Duration::from_millis(100);

impl Backend {
    /// Builds the pool and starts connecting in the background; it does not wait for Redis. Commands
    /// still unanswered after `command_timeout` are abandoned by the client, never replayed after a
    /// reconnect. `scripts` are decide.lua and refund.lua; `jitter_max` is
    /// `EXPIRATION_JITTER_MAX_SECONDS`; calls whose callers stopped waiting end in `tasks`.
    pub fn connect(
        name: &'static str,
        settings: &RedisSettings,
        command_timeout: Duration,
        scripts: [Script; 2],
        jitter_max: u64,
        tasks: TaskTracker,
    ) -> Result<Arc<Self>, StoreError> {
        let config = client_config(settings)?;
        let unix_socket = match &config.server {
            ServerConfig::Unix { path } => Some(path.clone()),
            _ => None,
        };
        let pool = build_pool(
            config.clone(),
            settings,
            command_timeout,
            settings.pool_size,
        )?;
        let node_settings = NodeSettings {
            breaker_failures: settings.breaker_failures,
            breaker_open_for: settings.breaker_open_for,
            unresponsive_after: settings.unresponsive_after,
        };
        let cluster = settings.topology == RedisTopology::Cluster;
        let masters = Masters::default();
        let caller = Arc::new(Caller {
            pool: pool.clone(),
            masters: masters.clone(),
            script: scripts[0].clone(),
            cluster,
            jitter_max,
            bounds: Bounds {
                requests: settings.batch_max_requests.max(1),
                bytes: settings.batch_max_bytes.max(1),
                calls: settings.calls_in_flight.max(1),
            },
            tasks,
            give_back_within: settings.timeout,
        });
        let backend = Arc::new_cyclic(|this| Self {
            name,
            pool,
            caller,
            cluster,
            timeout: settings.timeout,
            single: node_settings.node(settings.url.clone(), None),
            masters,
            routing: ArcSwapOption::empty(),
            node_settings,
            clock_offset_ms: AtomicI64::new(0),
            closing: AtomicBool::new(false),
            connection_errors: ErrorLog::default(),
            unix_socket,
            switches: Mutex::new(None),
            switching_to: Mutex::new(None),
            master: Mutex::new(None),
            this: this.clone(),
            direct: Direct {
                config,
                settings: settings.clone(),
                command_timeout,
                scripts: scripts.clone(),
            },
        });
        let weak = Arc::downgrade(&backend);
        let switches = Switches::follow(
            &backend.direct.config,
            settings.connect_timeout,
            move |to| {
                if let Some(backend) = weak.upgrade() {
                    backend.master_switched(to);
                }
            },
        )?;
        *lock(&backend.switches) = switches;
        for client in backend.pool.clients() {
            let (scripts, reloading) = (scripts.clone(), client.clone());
            let weak = Arc::downgrade(&backend);
            client.on_reconnect(move |server| {
                let (scripts, client, weak) = (scripts.clone(), reloading.clone(), weak.clone());
                if let Some(backend) = weak.upgrade() {
                    backend.routing_changed(&client);
                    backend.connected_to(&server);
                }
                async move {
                    tracing::debug!(%server, "connected to Redis");
                    // It answers: whatever opened its breaker is over. A Cluster master's breaker
                    // follows the connections of its own that carry its calls.
                    if scripts_reloaded(&client, &scripts, &server).await {
                        if let Some(backend) = weak.upgrade().filter(|b| !b.cluster) {
                            backend.single.reconnected();
                        }
                    }
                    Ok(())
                }
            });
            if backend.cluster {
                let (weak, watched) = (Arc::downgrade(&backend), client.clone());
                client.on_cluster_change(move |_| {
                    if let Some(backend) = weak.upgrade() {
                        backend.routing_changed(&watched);
                    }
                    async { Ok(()) }
                });
            }
            let (weak, login, url) = (
                Arc::downgrade(&backend),
                Login::of(name, settings),
                settings.url.clone(),
            );
            client.on_error(move |(err, server)| {
                let backend = weak.upgrade();
                // On Cluster these connections carry no decision: each master's own do, and count
                // against its breaker (see `master_node`).
                let node = backend
                    .as_ref()
                    .filter(|b| !b.cluster)
                    .map(|b| b.single.clone());
                connection_error(backend, node, name, login, &url, &err, server);
                async { Ok(()) }
            });
        }
        for client in backend.pool.clients() {
            let weak = Arc::downgrade(&backend);
            supervise(
                client.clone(),
                name,
                move || {
                    weak.upgrade()
                        .is_some_and(|b| !b.closing.load(Ordering::Relaxed))
                },
                drop,
            );
        }
        Ok(backend)
    }

    /// The Cluster's slot map as `client` has it now; masters no longer in it are let go, their
    /// connections closed.
    fn routing_changed(&self, client: &Client) {
        let routing = client.cached_cluster_state().map(Arc::new);
        // Stored first: a master made from here on is made from this map (see `node_of`).
        self.routing.store(routing.clone());
        if let Some(routing) = routing.as_ref().filter(|_| self.cluster) {
            let primaries = routing.unique_primary_nodes();
            let gone: Vec<Arc<Node>> = {
                let mut masters = lock(&self.masters);
                let gone = masters
                    .iter()
                    .filter(|(server, _)| !primaries.contains(server))
                    .map(|(_, node)| node.clone())
                    .collect();
                masters.retain(|server, _| primaries.contains(server));
                gone
            };
            for node in gone {
                tracing::debug!(
                    server = node.name(),
                    "no longer a Cluster master: its connections are closed"
                );
                node.retire();
            }
        }
    }

    /// Whether the slot map as last read names `server` a master (no map yet: taken as one).
    fn is_master(&self, server: &Server) -> bool {
        self.routing
            .load()
            .as_ref()
            .is_none_or(|r| r.slots().iter().any(|range| range.primary == *server))
    }

    /// A Cluster master's entry, with its own pool of connections to it alone, which carry its calls:
    /// the Cluster client connects to every master together, and one it cannot reach stops it for
    /// all of them, where a master's own connections stop only its requests. One connection per call
    /// its lane keeps in flight: more would spread the calls over more connection tasks, each woken
    /// for less (2 against 10 per master: the same CPU per request, Redis's a little lower).
    fn master_node(&self, server: &Server) -> Arc<Node> {
        let Direct {
            config,
            settings,
            command_timeout,
            scripts,
        } = &self.direct;
        let mut config = config.clone();
        config.server = ServerConfig::Centralized {
            server: server.clone(),
        };
        let pool = match build_pool(config, settings, *command_timeout, settings.calls_in_flight) {
            Ok(pool) => pool,
            Err(err) => {
                // Not expected (the Cluster's own settings built): its calls go through the Cluster
                // client instead.
                tracing::warn!(%server, "cannot make connections to this Cluster master alone: {err}");
                return self.node_settings.node(server.to_string(), None);
            }
        };
        let node = self
            .node_settings
            .node(server.to_string(), Some(pool.clone()));
        // Its errors name it, whether the client does or not.
        let (name, login, url) = (
            self.name,
            Login::of(self.name, settings),
            server.to_string(),
        );
        for client in pool.clients() {
            // The callbacks hold the node weakly, and no client: a client held by its own callback
            // would never be freed once retired.
            let (weak, scripts) = (Arc::downgrade(&node), scripts.clone());
            client.on_reconnect(move |server| {
                let (weak, scripts) = (weak.clone(), scripts.clone());
                async move {
                    tracing::debug!(%server, "connected to a Cluster master");
                    let Some(node) = weak.upgrade() else {
                        return Ok(());
                    };
                    let Some(client) = node.direct().map(|own| own.next().clone()) else {
                        return Ok(());
                    };
                    // The scripts are the server's: loaded on any of its connections.
                    if scripts_reloaded(&client, &scripts, &server).await {
                        node.reconnected();
                    }
                    Ok(())
                }
            });
            let (backend, master, url) = (self.this.clone(), Arc::downgrade(&node), url.clone());
            client.on_error(move |(err, lost)| {
                let master = master.upgrade();
                connection_error(backend.upgrade(), master, name, login, &url, &err, lost);
                async { Ok(()) }
            });
            let (backend, master, keeper) = (
                self.this.clone(),
                Arc::downgrade(&node),
                Arc::downgrade(&node),
            );
            supervise(
                client.clone(),
                name,
                move || {
                    backend
                        .upgrade()
                        .is_some_and(|b| !b.closing.load(Ordering::Relaxed))
                        && master.upgrade().is_some_and(|n| !n.is_retired())
                },
                move |task| match keeper.upgrade() {
                    Some(node) => node.own_task(task),
                    None => task.abort(),
                },
            );
        }
        node
    }

    /// Whether the Cluster the server is in has one master (a Cluster of one node, or a server that
    /// emulates Cluster mode): every key's slot is on the server asked, so it works as a single one.
    async fn serves_every_slot(&self) -> bool {
        let Ok(Value::Array(ranges)) = self.pool.next().cluster_slots::<Value>().await else {
            return false;
        };
        let mut masters = ranges.iter().filter_map(|range| match range {
            Value::Array(range) => range.get(2).map(|master| format!("{master:?}")),
            _ => None,
        });
        let first = masters.next();
        first.is_some() && masters.all(|m| Some(m) == first)
    }

    /// The prefix of this Redis's environment variables: `REDIS_`, or `REDIS_PERSECOND_`.
    fn variables(&self) -> &'static str {
        variables_of(self.name)
    }

    /// Waits until every connection is up and the scripts are loaded.
    pub async fn ready(&self, scripts: &[Script; 2]) -> Result<(), StoreError> {
        wait_connected(&self.pool).await?;
        if !self.cluster {
            // A Cluster node answers calls on its own slots' keys only (MOVED, CROSSSLOT otherwise):
            // as a single server it would fail nearly every request. An error (a user refused INFO)
            // is passed over.
            let info = self
                .pool
                .next()
                .info::<String>(Some(fred::types::InfoKind::Cluster))
                .await;
            if info.is_ok_and(|text| text.contains("cluster_enabled:1"))
                && !self.serves_every_slot().await
            {
                let prefix = self.variables();
                return Err(StoreError::Backend(format!(
                    "redis: {} is a Cluster node: set {prefix}TYPE=cluster ({prefix}URL may name one or more of its nodes)",
                    super::config::shown(&self.direct.settings.url)
                )));
            }
        }
        load_scripts(self.pool.next(), scripts)
            .await
            .map_err(redis_error)?;
        if self.cluster {
            let primaries = self
                .pool
                .next()
                .cached_cluster_state()
                .map(|r| r.unique_primary_nodes())
                .unwrap_or_default();
            for server in primaries {
                let node = self.node_of(&server);
                let Some(pool) = node.direct() else {
                    continue;
                };
                // A master lost meanwhile is not waited for past a connection's time: the next
                // readiness check starts again from the slot map.
                let bound = self.direct.settings.connect_timeout * 2;
                tokio::time::timeout(bound, wait_connected(pool))
                    .await
                    .map_err(|_| {
                        StoreError::Backend(format!(
                            "redis: the Cluster master {server} did not take a connection within {bound:?}"
                        ))
                    })??;
            }
        }
        // A user that may load scripts but not run them would fail every call: not ready, saying why.
        // refund.lua with no keys changes nothing; any other answer (OOM among them) is Redis's own.
        let probe = scripts[1]
            .evalsha_with_reload::<i64, _, _>(self.pool.next(), Vec::<String>::new(), vec!["0"])
            .await;
        if let Err(err) = probe {
            if err.to_string().contains("NOPERM") {
                return Err(StoreError::Backend(format!(
                    "redis: {err} (the Redis user must be allowed EVALSHA and SCRIPT LOAD; SECURITY.md lists its commands)"
                )));
            }
        }
        // Calls refused before Redis was reached opened breakers; it answers now.
        self.single.answered();
        for node in lock(&self.masters).values() {
            node.answered();
        }
        Ok(())
    }

    /// Whether at least one connection is up: on Cluster, the Cluster client's or a master's own.
    pub fn connected(&self) -> bool {
        any_connected(&self.pool)
            || lock(&self.masters)
                .values()
                .any(|node| node.direct().is_some_and(any_connected))
    }

    /// Whether `node`'s calls can go now: a connection that carries them is up (its own on a Cluster
    /// master, else the deployment's), or all are being made again after the server closed them while
    /// it still takes new ones (an idle timeout): the calls wait for them.
    pub fn reaches(&self, node: &Node) -> bool {
        any_connected(node.direct().unwrap_or(&self.pool)) || node.reconnecting()
    }

    /// Runs `script` on `keys` (of one slot) of `node`'s server, on its own connections when it has
    /// them, following the slot while it moves until `until`: through the Cluster client once it has
    /// moved, to the importing master right after ASKING while the keys are already there, and again
    /// 2 to 32 ms later while they are on both sides.
    pub fn eval_on<R, K, V>(
        &self,
        node: &Arc<Node>,
        script: Script,
        keys: K,
        args: V,
        until: tokio::time::Instant,
    ) -> impl std::future::Future<Output = Result<R, Error>> + Send + 'static
    where
        R: FromValue + Send,
        K: Into<MultipleKeys> + Clone + Send + 'static,
        V: TryInto<MultipleValues> + Clone + Send + 'static,
        V::Error: Into<Error> + Send,
    {
        let own = node.direct().map(|p| p.next_connected().clone());
        let cluster = self.pool.next_connected().clone();
        let (masters, node) = (self.masters.clone(), node.clone());
        async move {
            let Some(own) = own else {
                return script.evalsha_with_reload(&cluster, keys, args).await;
            };
            let (mut pauses, mut unsent) = (Pauses::default(), false);
            loop {
                let err = match script
                    .evalsha_with_reload::<R, _, _>(&own, keys.clone(), args.clone())
                    .await
                {
                    // Never written (see `never_written`): sent again, once.
                    Err(err) if never_written(&err) && !unsent => {
                        unsent = true;
                        continue;
                    }
                    Err(err) if is_moved(&err) => err,
                    answered => return answered,
                };
                // A refusal is an answer: the wait below is not the server's silence.
                node.answered();
                if tokio::time::Instant::now() >= until {
                    return Err(err);
                }
                match Next::after(&err, Route::Node, &masters) {
                    Next::Cluster => return script.evalsha_with_reload(&cluster, keys, args).await,
                    Next::Asking(to) => return ask_on(&to, &script, keys, args).await,
                    Next::Pause => {}
                }
                let next = tokio::time::Instant::now() + pauses.next();
                if next >= until {
                    return Err(err);
                }
                tokio::time::sleep_until(next).await;
            }
        }
    }

    /// Whether a circuit breaker in front of one of its servers answers without asking it now.
    pub fn breaker_open(&self) -> bool {
        self.single.breaker.refusing()
            || lock(&self.masters)
                .values()
                .any(|node| node.breaker.refusing())
    }

    /// The Sentinels announced `to` as the master: the pooled connections go there now, not once the
    /// old master is demoted (see [`Switches`]).
    fn master_switched(&self, to: Server) {
        if self.closing.load(Ordering::Relaxed) || self.reached(&to) {
            return;
        }
        // Every Sentinel announces the switch: one move at a time.
        if lock(&self.switching_to).replace(to.clone()).as_ref() == Some(&to) {
            return;
        }
        tracing::warn!(
            backend = self.name,
            "the Sentinels switched the master to {to}: connecting to it"
        );
        let this = self.this.clone();
        tokio::spawn(async move {
            // The client asks one Sentinel for the master, which may not have heard of the switch yet
            // and name the old one: asked again until the connections reach the new master.
            for _ in 0..SWITCH_ATTEMPTS {
                let Some(backend) = this.upgrade() else {
                    return;
                };
                if backend.closing.load(Ordering::Relaxed) || backend.reached(&to) {
                    break;
                }
                if lock(&backend.switching_to).as_ref() != Some(&to) {
                    // Another switch came since: its own task follows it.
                    return;
                }
                if let Err(err) = backend.pool.force_reconnection().await {
                    tracing::warn!(
                        backend = backend.name,
                        "connecting to the new master: {err}"
                    );
                }
                drop(backend);
                tokio::time::sleep(SWITCH_PAUSE).await;
            }
            if let Some(backend) = this.upgrade() {
                let mut switching = lock(&backend.switching_to);
                if switching.as_ref() == Some(&to) {
                    *switching = None;
                }
            }
        });
    }

    /// Whether the pooled connections last reached `server` (its host and port).
    fn reached(&self, server: &Server) -> bool {
        lock(&self.master)
            .as_ref()
            .is_some_and(|m| m.host == server.host && m.port == server.port)
    }

    /// Notes that a pooled connection reached `server`. Outside a Cluster they all reach one server, and
    /// a new one is a Sentinel failover (or a name that resolves elsewhere): said once, not once per
    /// pooled connection.
    fn connected_to(&self, server: &Server) {
        if self.cluster {
            return;
        }
        let mut master = lock(&self.master);
        match master.replace(server.clone()) {
            Some(before) if before != *server => {
                tracing::warn!(
                    backend = self.name,
                    "Redis master is now {server} (was {before})"
                );
            }
            _ => {}
        }
    }

    /// Where `server` is asked whether it takes connections (see [`Node::connection_lost`]).
    fn probe(&self, server: &Server) -> Probe {
        match &self.unix_socket {
            Some(path) => Probe::Unix(path.clone()),
            None => Probe::Tcp(server.host.to_string(), server.port),
        }
    }

    /// The health of a server connected to: its master entry on Cluster, else the one server.
    fn node_of(&self, server: &Server) -> Arc<Node> {
        if !self.cluster {
            return self.single.clone();
        }
        if let Some(node) = lock(&self.masters).get(server) {
            return node.clone();
        }
        // Made outside the lock (it starts connecting); the first one in is kept.
        let made = self.master_node(server);
        let node = lock(&self.masters)
            .entry(server.clone())
            .or_insert_with(|| made.clone())
            .clone();
        if !Arc::ptr_eq(&node, &made) {
            made.retire();
        }
        // Read from a slot map replaced meanwhile, which no longer names it: not kept (its calls,
        // retired, go through the Cluster client, which follows the slots).
        if !self.is_master(server) {
            let mut masters = lock(&self.masters);
            if masters
                .get(server)
                .is_some_and(|kept| Arc::ptr_eq(kept, &node))
            {
                masters.remove(server);
            }
            drop(masters);
            node.retire();
        }
        node
    }

    /// The server a key's hash slot lives on, as this replica last saw the slot map (the one server
    /// outside Cluster).
    pub fn node_for_slot(&self, slot: Option<u16>) -> Arc<Node> {
        let Some(slot) = slot.filter(|_| self.cluster) else {
            return self.single.clone();
        };
        let mut routing = self.routing.load_full();
        if routing.is_none() {
            routing = self.pool.next().cached_cluster_state().map(Arc::new);
            self.routing.store(routing.clone());
        }
        match routing.as_ref().and_then(|r| r.get_server(slot)) {
            Some(server) => self.node_of(server),
            None => self.single.clone(),
        }
    }

    /// Closes the connections.
    pub async fn close(&self) {
        self.closing.store(true, Ordering::Relaxed);
        let switches = lock(&self.switches).take();
        if let Some(switches) = switches {
            switches.close().await;
        }
        let masters: Vec<Arc<Node>> = lock(&self.masters).values().cloned().collect();
        for node in masters {
            if let Some(pool) = node.direct() {
                let _ = pool.quit().await;
            }
        }
        let _ = self.pool.quit().await;
    }
}

/// How many times the pooled connections are moved to a master the Sentinels announced before the
/// replica waits for their next announcement, and the pause after each move.
const SWITCH_ATTEMPTS: usize = 20;
const SWITCH_PAUSE: Duration = Duration::from_millis(100);

/// How long a client whose connection task ended waits before it is connected again.
const RESTART_AFTER: Duration = Duration::from_millis(100);

/// A connection error of one of `backend`'s clients, on `server` when it names one.
fn connection_error(
    backend: Option<Arc<Backend>>,
    node: Option<Arc<Node>>,
    name: &'static str,
    login: Login,
    url: &str,
    err: &Error,
    server: Option<Server>,
) {
    // A connection the server closed: asked whether it still takes connections, which counts against
    // it only if not (an idle timeout closes a healthy server's connections).
    if let (Some(b), Some(lost), ErrorKind::IO) = (&backend, &server, err.kind()) {
        match &node {
            Some(node) => node.connection_lost(b.probe(lost), err.to_string()),
            None => tracing::debug!(server = %lost, backend = name, "Redis connection lost: {err}"),
        }
        return;
    }
    // The Cluster client's refused connections: each master's own report them, naming it (before
    // the slot map is read there are none: then it is the only report).
    let masters_report = || {
        backend
            .as_ref()
            .is_some_and(|b| b.cluster && !lock(&b.masters).is_empty())
    };
    if node.is_none() && *err.kind() == ErrorKind::IO && masters_report() {
        tracing::debug!(backend = name, "Redis Cluster connection error: {err}");
        return;
    }
    // The server took the connection and refuses every key: the Redis client ends a connection on
    // CLUSTERDOWN and makes another.
    if let Some(node) = node.as_ref().filter(|_| is_cluster_down(err)) {
        node.cluster_down(err);
        return;
    }
    // A refused connection counts against its server's breaker, as a call that fails on it does.
    if let Some(node) = node {
        node.refused();
        if node.breaker.failure() {
            tracing::warn!(
                server = node.name(),
                backend = name,
                "Redis connection failing: circuit breaker open"
            );
        }
    }
    let server = server.map_or_else(|| url.to_owned(), |s| s.to_string());
    let text = err.to_string();
    // Each pooled connection retries on its own: one line per error and server a while.
    if backend.is_none_or(|b| b.connection_errors.first_in_a_while(&server, &text)) {
        let hint = auth_hint(&text, login);
        tracing::warn!(
            server,
            backend = name,
            "Redis connection error: {text}{hint}"
        );
    }
}

/// Connects `client` and connects it again whenever its connection task ends on an error while the
/// backend is in use. The task follows lost connections itself; it ends only on an error it does not
/// recover from (a redirection it could not follow, for one), after which the client would take
/// commands that no task sends, each waiting for its deadline, for the life of the process.
/// Each connection task is handed to `keep` as it starts (a retired master's are ended).
fn supervise(
    client: Client,
    name: &'static str,
    in_use: impl Fn() -> bool + Send + 'static,
    keep: impl Fn(tokio::task::AbortHandle) + Send + 'static,
) {
    tokio::spawn(async move {
        loop {
            let task = client.connect();
            keep(task.abort_handle());
            let ended = task.await;
            if !in_use() {
                return;
            }
            let why = match ended {
                Ok(Ok(())) => "it ended".to_owned(),
                Ok(Err(err)) if err.is_canceled() => return,
                Ok(Err(err)) => err.to_string(),
                Err(join) => join.to_string(),
            };
            // Each pooled client stops on its own, and one that cannot work (a Cluster client on a
            // server that is not in one) stops every time: a line per error a while.
            static STOPPED: std::sync::LazyLock<ErrorLog> =
                std::sync::LazyLock::new(ErrorLog::default);
            if STOPPED.first_in_a_while(name, &why) {
                let hint = if why.contains("cluster support disabled") {
                    let prefix = variables_of(name);
                    format!(
                        " (the server is not in a Cluster: set {prefix}TYPE to single or sentinel)"
                    )
                } else {
                    String::new()
                };
                tracing::warn!(
                    backend = name,
                    "Redis client stopped ({why}): connecting it again{hint}"
                );
            }
            tokio::time::sleep(RESTART_AFTER).await;
            // Closed meanwhile: not connected again.
            if !in_use() {
                return;
            }
        }
    });
}

/// Loads the scripts again on a connection just made (a restarted server has lost them); whether it
/// answered.
/// `script` on `keys` right after ASKING, on one of `master`'s own connections (it imports their
/// slot), loading the script there first when it lacks it.
async fn ask_on<R, K, V>(master: &Node, script: &Script, keys: K, args: V) -> Result<R, Error>
where
    R: FromValue,
    K: Into<MultipleKeys>,
    V: TryInto<MultipleValues>,
    V::Error: Into<Error>,
{
    let Some(client) = master.direct().map(|own| own.next_connected().clone()) else {
        return Err(importing_closed());
    };
    let keys = keys.into().inner();
    let args = match args.try_into().map_err(Into::into)? {
        Value::Null => Vec::new(),
        args => args.into_array(),
    };
    let ask = || {
        asking(
            client.clone(),
            script.sha1().clone(),
            keys.clone(),
            args.clone(),
        )
    };
    match ask().await {
        Err(err) if err.details().starts_with("NOSCRIPT") => {
            script.load(&client).await?;
            ask().await
        }
        answered => answered,
    }
}

async fn scripts_reloaded(client: &Client, scripts: &[Script; 2], server: &Server) -> bool {
    match load_scripts(client, scripts).await {
        Ok(()) => true,
        // Logged once as the Cluster refusing every key (see `Node::cluster_down`).
        Err(err) if is_cluster_down(&err) => {
            tracing::debug!(%server, "cannot load scripts after reconnecting: {err}");
            false
        }
        Err(err) => {
            tracing::warn!(%server, "cannot load scripts after reconnecting: {err}");
            false
        }
    }
}

fn any_connected(pool: &Pool) -> bool {
    pool.clients().iter().any(|c| c.is_connected())
}

/// Waits until every connection of `pool` is up.
async fn wait_connected(pool: &Pool) -> Result<(), StoreError> {
    for client in pool.clients() {
        // The client's wait reads its state, then listens for the next connection: one made in
        // between is missed, and the wait would never end (a replica up but never serving). It is
        // given a tenth of a second at a time, and the state read again.
        while !client.is_connected() {
            let next = tokio::time::timeout(CONNECTED_CHECK_EVERY, client.wait_for_connect());
            if let Ok(connected) = next.await {
                connected.map_err(redis_error)?;
            }
        }
    }
    Ok(())
}

/// A pool of `config`'s connections as `settings` sets them. Commands still unanswered after
/// `command_timeout` are abandoned by the client, never replayed after a reconnect.
fn build_pool(
    config: Config,
    settings: &RedisSettings,
    command_timeout: Duration,
    size: usize,
) -> Result<Pool, StoreError> {
    let follows_redirections = config.server.is_clustered();
    Builder::from_config(config)
        .with_connection_config(|c| {
            c.connection_timeout = settings.connect_timeout;
            c.internal_command_timeout = settings.connect_timeout;
            if follows_redirections {
                // Redirections (MOVED, ASK) during resharding count as attempts. Fewer redirections
                // than attempts: the client follows an ASK by sending the command to the slot's
                // owner again, which answers ASK again, and a command whose attempts run out there
                // ends the client's connection task (fred 10.1); out of redirections, only the
                // command fails.
                c.max_command_attempts = 3;
                c.max_redirections = 2;
            } else {
                // A command is written once. The client would write it again on a new connection
                // when the one it was on closed before its answer came, and a script that ran and
                // lost only its answer would count its hits twice; it fails instead (the request is
                // answered by `on_backend_error`), its hits counted once.
                c.max_command_attempts = 1;
            }
        })
        .with_performance_config(|p| {
            p.default_command_timeout = command_timeout;
        })
        .set_policy(ReconnectPolicy::new_exponential(0, 50, 2_000, 2))
        .build_pool(size.max(1))
        .map_err(|e| StoreError::Config(e.to_string()))
}

pub(super) fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

#[cfg(test)]
mod tests {
    use super::{auth_hint, Login, RedisSettings, RedisTopology};

    fn login(name: &str, topology: RedisTopology, auth: &str, sentinel_auth: &str) -> Login {
        let mut settings = RedisSettings {
            topology,
            ..RedisSettings::default()
        };
        settings.auth.0 = auth.into();
        settings.sentinel_auth.0 = sentinel_auth.into();
        Login::of(name, &settings)
    }

    #[test]
    fn a_plain_connection_dropped_at_once_may_want_tls() {
        let reset = "IO Error: Os { code: 104, kind: ConnectionReset, message: \"Connection reset by peer\" }";
        let hint = auth_hint(reset, login("main", RedisTopology::Single, "", ""));
        assert!(hint.contains("set REDIS_TLS=true"), "{hint}");
        let hint = auth_hint(reset, login("per-second", RedisTopology::Single, "", ""));
        assert!(hint.contains("set REDIS_PERSECOND_TLS=true"), "{hint}");
        let mut settings = RedisSettings {
            tls: true,
            ..RedisSettings::default()
        };
        assert_eq!(auth_hint(reset, Login::of("main", &settings)), "");
        settings.tls = false;
        settings.url = "rediss://cache:6380".into();
        assert_eq!(auth_hint(reset, Login::of("main", &settings)), "");
    }

    #[test]
    fn a_refused_login_names_the_setting_to_set() {
        use RedisTopology::{Cluster, Sentinel, Single};
        // Every error on the way through the Sentinels reads alike, whoever refused.
        let noauth = "Sentinel Error: NOAUTH Authentication required.";
        let hint = auth_hint(noauth, login("main", Sentinel, "pw", ""));
        assert!(hint.contains("set REDIS_SENTINEL_AUTH"), "{hint}");
        let hint = auth_hint(noauth, login("main", Sentinel, "", "spw"));
        assert!(hint.contains("set REDIS_AUTH"), "{hint}");
        let hint = auth_hint(noauth, login("main", Sentinel, "", ""));
        assert!(
            hint.contains("REDIS_AUTH") && hint.contains("REDIS_SENTINEL_AUTH"),
            "{hint}"
        );
        let unreached = "Sentinel Error: Failed to connect to all sentinel nodes.";
        let hint = auth_hint(unreached, login("main", Sentinel, "", "wrong"));
        assert!(hint.contains("REDIS_SENTINEL_AUTH"), "{hint}");
        let master = "Auth Error: NOAUTH Authentication required.";
        let hint = auth_hint(master, login("main", Single, "", ""));
        assert!(hint.contains("set REDIS_AUTH, or redis.auth"), "{hint}");
        let wrong = "Auth Error: WRONGPASS invalid username-password pair or user is disabled.";
        assert_eq!(
            auth_hint(wrong, login("main", Cluster, "x", "")),
            " (check REDIS_AUTH)"
        );
        assert!(auth_hint(wrong, login("main", Sentinel, "x", "y")).contains("REDIS_SENTINEL_AUTH"));
        // The per-second Redis's own variables.
        assert_eq!(
            auth_hint(wrong, login("per-second", Single, "x", "")),
            " (check REDIS_PERSECOND_AUTH)"
        );
        let hint = auth_hint(master, login("per-second", Single, "", ""));
        assert!(
            hint.contains("REDIS_PERSECOND_AUTH, or redis_per_second.auth"),
            "{hint}"
        );
        assert_eq!(
            auth_hint(
                "IO Error: connection refused",
                login("main", Single, "", "")
            ),
            ""
        );
        let issuer = "IO Error: invalid peer certificate: UnknownIssuer";
        let hint = auth_hint(issuer, login("main", Single, "", ""));
        assert!(hint.contains("REDIS_TLS_CACERT"), "{hint}");
        // The per-second Redis shares the main one's TLS files.
        let hint = auth_hint(issuer, login("per-second", Single, "", ""));
        assert!(hint.contains(" REDIS_TLS_CACERT"), "{hint}");
    }
}
