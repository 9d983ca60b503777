//! Building the parts of the service from its settings: the store, the limiter in front of it (with the
//! deny cache, the local fallback and the hasher of sensitive values), the rules and their watcher (or
//! the xDS client that streams them), and the metrics read at scrape time. Nothing here binds a port or
//! waits for a backend.

use std::sync::{atomic::Ordering, Arc};

use super::{ServerError, Tasks};
use crate::{
    api::{health::Health, xds},
    clock::Clock,
    limiter::{self, Limiter},
    quota::{
        state::{MemoryShares, RedisShares, MEMORY_MEMBERS_PER_BUCKET},
        Quota, QuotaParts, Shares,
    },
    rules::{self, Rules},
    settings::{BackendKind, ConfigType, OnBackendError, Settings},
    store::{CounterStore, DenyCache, MemoryStore, RedisStore, Store, StoreHealth},
    telemetry::{
        metrics::{either_form, ServedRules},
        Metrics, TopOffenders,
    },
};

/// The configured store. Redis starts connecting in the background; nothing waits for it here.
pub(super) fn store(settings: &Settings) -> Result<Arc<Store>, ServerError> {
    let store = match settings.backend() {
        BackendKind::Memory => Store::Memory(MemoryStore::new(settings.memory.max_keys)),
        BackendKind::Redis => Store::Redis(
            RedisStore::connect(
                &settings.redis,
                settings.redis_per_second.as_ref(),
                settings.expiration_jitter_max_seconds,
                settings.overload.deadline,
            )
            .map_err(|e| ServerError::Setup(e.to_string()))?,
        ),
        BackendKind::Noop => {
            tracing::warn!("backend noop: every request is allowed and nothing is counted");
            Store::Noop
        }
    };
    Ok(Arc::new(store))
}

/// The limiter and the stores and cache it decides with.
pub(super) struct Deciding {
    pub limiter: Arc<Limiter>,
    /// The local deny cache, when enabled: cleared whenever the rules change.
    pub deny_cache: Option<Arc<DenyCache>>,
    /// Every store the limiter decides with: the configured one, then the local fallback's.
    pub stores: Vec<Arc<Store>>,
}

/// Builds the limiter in front of `store`, with the deny cache and, for `on_backend_error: local`, a
/// memory store of this replica's own to decide from while Redis cannot.
pub(super) fn limiter(
    settings: &Settings,
    rules: &Arc<Rules>,
    store: &Arc<Store>,
    clock: &Clock,
    metrics: &Arc<Metrics>,
) -> Deciding {
    let deny_cache = (settings.local_cache_max_entries > 0)
        .then(|| Arc::new(DenyCache::new(settings.local_cache_max_entries)));
    let fallback = (settings.backend() == BackendKind::Redis
        && settings.on_backend_error == OnBackendError::Local)
        .then(|| limiter::Fallback {
            store: Arc::new(Store::Memory(MemoryStore::new(settings.memory.max_keys))),
            replicas: settings.fallback.replicas,
        });
    let stores = std::iter::once(store.clone())
        .chain(fallback.as_ref().map(|f| f.store.clone()))
        .collect();
    let limiter = Arc::new(Limiter::new(
        rules.clone(),
        store.clone(),
        clock.clone(),
        limiter::Options {
            key_prefix: settings.cache_key_prefix.clone(),
            shadow_mode: settings.shadow_mode,
            quota_mode: settings.quota_mode,
            consume_on_deny: settings.consumes_on_deny(),
            response_headers: settings.response_headers,
            header_names: settings.header_names.clone(),
            request_limits: settings.request_limits.clone(),
            on_backend_error: settings.on_backend_error,
            sensitive: sensitive(settings),
            near_limit_ratio: settings.near_limit_ratio,
            metrics: metrics.clone(),
            deny_cache: deny_cache.clone(),
            overload: settings.overload.clone(),
            top: Arc::new(TopOffenders::new(
                settings.top_offenders.capacity,
                settings.top_offenders.interval,
            )),
            fallback,
            metric_values_per_rule: settings.metrics.max_values_per_rule,
            runtime_limits: settings.runtime_limits.clone(),
            default_algorithm: settings.rules.default_algorithm,
        },
    ));
    Deciding {
        limiter,
        deny_cache,
        stores,
    }
}

/// The rate limit quota service, unless `rlqs.enabled` is off: its buckets count on `store`, the counters
/// `ShouldRateLimit` counts on, and their shares live beside them (in Redis for the Redis store, so that
/// every replica shares them; in this process otherwise).
pub(super) fn quota(
    settings: &Settings,
    limiter: &Arc<Limiter>,
    store: &Arc<Store>,
    clock: &Clock,
    metrics: &Arc<Metrics>,
) -> Option<Arc<Quota>> {
    if !settings.rlqs.enabled {
        return None;
    }
    let shares = match &**store {
        Store::Redis(redis) => Shares::Redis(RedisShares::new(redis.clone())),
        Store::Memory(_) | Store::Noop => Shares::Memory(MemoryShares::new(
            clock.clone(),
            settings
                .rlqs
                .max_buckets
                .saturating_mul(MEMORY_MEMBERS_PER_BUCKET),
        )),
    };
    Some(Quota::new(QuotaParts {
        limiter: limiter.clone(),
        store: store.clone(),
        shares,
        settings: settings.rlqs.clone(),
        on_backend_error: settings.on_backend_error,
        store_wait: settings.overload.deadline,
        clock: clock.clone(),
        metrics: metrics.clone(),
    }))
}

/// The hasher of sensitive values: HMAC-SHA256 under `hash_secret`, or unkeyed SHA-256 without one. Either
/// depends on the value alone, so every replica and every restart counts a value under the same key.
fn sensitive(settings: &Settings) -> Option<limiter::Sensitive> {
    let secret = Some(settings.hash_secret.0.as_bytes()).filter(|s| !s.is_empty());
    if secret.is_none() && !settings.hashed_keys.is_empty() {
        tracing::warn!(
            hashed_keys = ?settings.hashed_keys,
            "RATELIMITD_HASH_SECRET is not set: sensitive values are hashed with unkeyed SHA-256 (sha256-...), so anyone who can read the counter keys can confirm a guessed value; set RATELIMITD_HASH_SECRET (the same on every replica) to make the hash keyed (HMAC-SHA256)"
        );
    }
    // Built even with no `hashed_keys`: rule nodes marked `hash_value: true` are hashed regardless.
    Some(limiter::Sensitive::new(&settings.hashed_keys, secret))
}

/// Loads the rules into `rules`: from the files (and, with `rules.watch`, starts the watcher that reloads
/// them on change), or from the xDS control plane (starts the client that streams them). Every load that
/// changes the rules is logged, clears the deny cache, removes the metrics of the rules it took away and
/// tells `health` how many domains it has.
pub(super) fn load_rules(
    settings: &Settings,
    limiter: &Arc<Limiter>,
    rules: &Arc<Rules>,
    health: &Arc<Health>,
    deny_cache: Option<Arc<DenyCache>>,
    metrics: &Arc<Metrics>,
    tasks: &Tasks,
) {
    let stats = Arc::new(rules::ReloadStats::default());
    let on_loaded: rules::OnLoaded = {
        let (health, tasks, metrics) = (health.clone(), tasks.clone(), metrics.clone());
        let limiter = limiter.clone();
        Box::new(move |loaded: &rules::Loaded| {
            // Limits may have changed: remembered denials no longer hold.
            if let Some(cache) = &deny_cache {
                cache.clear();
            }
            forget_removed_rules(&metrics, &loaded.rules);
            let domains = loaded.rules.domains.len();
            let mut names: Vec<&String> = loaded.rules.domains.keys().collect();
            names.sort();
            for domain in names {
                tracing::info!(domain = %domain, "loading domain: {domain}");
            }
            tracing::warn!(
                files = loaded.files.len(),
                domains,
                fingerprint = format!("{:016x}", loaded.fingerprint),
                "rules loaded"
            );
            for warning in limiter.unreachable_rules(&loaded.rules) {
                tracing::warn!("{warning}");
            }
            health.rules_loaded(domains);
            let health = health.clone();
            tasks.spawn(async move { health.publish().await });
        })
    };
    let publisher = Arc::new(rules::Publisher::new(
        rules.clone(),
        stats.clone(),
        on_loaded,
    ));
    register_rules_metrics(metrics, rules, &stats);
    match settings.rules.config_type {
        ConfigType::File => load_files(settings, publisher, tasks),
        ConfigType::GrpcXdsSotw => {
            if let Some(path) = &settings.rules.path {
                tracing::warn!(
                    path = %path.display(),
                    "rules.path is set but CONFIG_TYPE=GRPC_XDS_SOTW takes every rule from the xDS server: {} is not read",
                    path.display()
                );
            }
            subscribe(settings, publisher, metrics, tasks)
        }
    }
}

/// Tells the metrics which rules are served now: the per-rule series of the rules `now` no longer has
/// go (with xDS, rules come and go as routes do, and their series would otherwise stay until the
/// process ends), and so do those carrying request values of rules that no longer ask for them. The
/// series of every rule still there keep counting.
fn forget_removed_rules(metrics: &Metrics, now: &rules::RuleSet) {
    let mut served = ServedRules::new();
    now.for_each_node(|domain, node| {
        // Two rules may be written alike (`a` + `b_c`, `a_b` + `c`): either may take request values.
        let form = served
            .entry(domain.into())
            .or_default()
            .entry(node.at.written_key().into())
            .or_default();
        *form = either_form(*form, node.label_form());
    });
    metrics.serve_rules(served);
}

/// Loads the rules files, and starts watching them with `rules.watch`.
fn load_files(settings: &Settings, publisher: Arc<rules::Publisher>, tasks: &Tasks) {
    let source = settings.rules.source();
    let missing = matches!(std::fs::metadata(&source.root), Err(e) if e.kind() == std::io::ErrorKind::NotFound);
    if missing {
        // Otherwise the only sign is `files=0`, and every request is answered as for an unknown domain.
        let rules = &settings.rules;
        let why = if rules.path.is_none()
            && rules.runtime_root.is_none()
            && !rules.runtime_subdirectory.is_empty()
        {
            " (RUNTIME_SUBDIRECTORY is set and RUNTIME_ROOT is not: the reference's default root is read, as the reference reads it)"
        } else {
            ""
        };
        tracing::warn!(
            folder = %source.root.display(),
            "the rules folder {} does not exist{why}: no rules are loaded, and every request is answered OK as for an unknown domain, until it does",
            source.root.display()
        );
    }
    // Watching starts before the first load, so that a change made while it reads is loaded too.
    let watch = if settings.rules.watch {
        rules::RulesWatch::start(&source)
    } else {
        None
    };
    rules::reload(&source, &publisher);
    if let Some(watch) = watch {
        tasks.spawn(watch.run(publisher, settings.rules.reload_delay, tasks.stopping()));
    }
}

/// Starts the xDS client that streams the rules from the control plane.
fn subscribe(
    settings: &Settings,
    publisher: Arc<rules::Publisher>,
    metrics: &Metrics,
    tasks: &Tasks,
) {
    let compile = xds::Compile {
        merge_domains: settings.rules.merge_domains,
        default_algorithm: settings.rules.default_algorithm,
    };
    let client = xds::XdsClient::new(settings.xds.clone(), publisher, compile);
    let connected = client.connected();
    metrics.gauge_fn(
        "ratelimitd_xds_connected",
        "1 while the stream to the xDS control plane is open and answered.",
        Box::new(move || {
            let up = connected.load(Ordering::Relaxed);
            vec![(Vec::new(), f64::from(u8::from(up)))]
        }),
    );
    tasks.spawn(client.run(tasks.stopping()));
}

/// Metrics read at scrape time from the rules and their loads.
fn register_rules_metrics(metrics: &Metrics, rules: &Arc<Rules>, stats: &Arc<rules::ReloadStats>) {
    let s = stats.clone();
    metrics.counter_fn(
        "ratelimit_service_config_load_success",
        "Rules loads that succeeded (at start and on every change).",
        Box::new(move || vec![(Vec::new(), s.successes.load(Ordering::Relaxed) as f64)]),
    );
    let s = stats.clone();
    metrics.counter_fn(
        "ratelimit_service_config_load_error",
        "Rules loads refused because a file was invalid (the previous rules kept serving).",
        Box::new(move || vec![(Vec::new(), s.errors.load(Ordering::Relaxed) as f64)]),
    );
    let (s, r) = (stats.clone(), rules.clone());
    metrics.gauge_fn(
        "ratelimitd_rules_info",
        "The rules being served: fingerprint of their files and number of domains; the value is the domain count.",
        Box::new(move || {
            let domains = r.snapshot().map_or(0, |set| set.domains.len());
            let fingerprint = format!("{:016x}", s.fingerprint.load(Ordering::Relaxed));
            vec![(vec![("fingerprint", fingerprint)], domains as f64)]
        }),
    );
}

/// Metrics read at scrape time from the store.
pub(super) fn register_store_metrics(metrics: &Metrics, store: &Arc<Store>) {
    // A yes/no of the store's health, labelled with the store's name.
    let flag = |name, help, read: fn(&StoreHealth) -> bool| {
        let s = store.clone();
        metrics.gauge_fn(
            name,
            help,
            Box::new(move || {
                let value = f64::from(u8::from(read(&s.health())));
                vec![(vec![("backend", s.name().to_string())], value)]
            }),
        );
    };
    flag(
        "ratelimitd_backend_up",
        "1 when the counter store is reachable (Redis: at least one connection up).",
        |h| h.up,
    );
    flag(
        "ratelimitd_backend_breaker_open",
        "1 while the circuit breaker in front of Redis answers without asking it.",
        |h| h.breaker_open,
    );
    let leases = |read: fn(&crate::store::redis::LeaseStats) -> f64| {
        let s = store.clone();
        move || {
            s.health()
                .leases
                .map(|l| (Vec::new(), read(&l)))
                .into_iter()
                .collect()
        }
    };
    metrics.gauge_fn(
        "ratelimitd_redis_leases",
        "Quota leases this replica holds on hot Redis counters.",
        Box::new(leases(|l| l.held as f64)),
    );
    metrics.counter_fn(
        "ratelimitd_redis_lease_granted_hits_total",
        "Hits leased to this replica from hot Redis counters (counted in Redis at once, admitted here).",
        Box::new(leases(|l| l.granted as f64)),
    );
    metrics.counter_fn(
        "ratelimitd_redis_lease_returned_hits_total",
        "Leased hits this replica gave back unused when their lease ended.",
        Box::new(leases(|l| l.returned as f64)),
    );
    metrics.counter_fn(
        "ratelimitd_redis_lease_answers_total",
        "Checks answered from a lease, without a Redis call.",
        Box::new(leases(|l| l.answered as f64)),
    );
    let s = store.clone();
    metrics.gauge_fn(
        "ratelimitd_memory_store_counters",
        "Counters held by the memory store.",
        Box::new(move || {
            s.health()
                .counters
                .map(|n| (Vec::new(), n as f64))
                .into_iter()
                .collect()
        }),
    );
}
