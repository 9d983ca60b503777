//! Planning a request: its descriptors -> the limits that apply to each -> one batch of checks.
//!
//! A descriptor resolves to no limit (unknown domain, no matching rule, an allow-listed rule), to an
//! unlimited rule, or to the limits of its rule, of the caller's override, or of an operator's runtime
//! limit (which wins over both, see `runtime`). `replaces` then drops the limits that others name, and
//! each remaining limit becomes one check of one counter.

use std::{borrow::Cow, sync::Arc};

use smallvec::{smallvec, SmallVec};

use super::{
    runtime::DomainLimits, CurrentLimit, Descriptor, LimitError, Options, Request, RequestLimits,
    Small,
};
use crate::{
    algorithm::{Algorithm, Params},
    rules::{Domain, Limit, Node, PathStep, Unit},
    store::{keys, Batch, Check, Role},
};

/// One limit a descriptor is checked against: one of its rule's, borrowed from the rules (or an
/// operator's runtime limit, borrowed from this replica's table, as the `rate_limit` of no rule), or the
/// caller's override. Two variants, so that it takes no more room than its largest (16 bytes). Small and copied freely; the status's [`CurrentLimit`] is made only for the limit
/// a descriptor is reported under.
#[derive(Debug, Clone, Copy)]
pub(super) enum Applicable<'a> {
    /// The limit at `index` of the rule's limits (0 for its `rate_limit`).
    Rule { limit: &'a Limit, index: usize },
    /// The caller's limit, counted in a fixed window of one unit.
    Override { requests_per_unit: u32, unit: Unit },
}

impl Applicable<'_> {
    /// How the limit counts.
    pub fn params(&self) -> Params {
        match *self {
            Applicable::Rule { limit, .. } => limit.params(),
            Applicable::Override {
                requests_per_unit,
                unit,
            } => {
                let limit = u64::from(requests_per_unit);
                Params {
                    algorithm: Algorithm::FixedWindow,
                    limit,
                    window_ms: unit.seconds() * 1000,
                    burst: limit,
                    count_over_limit: false,
                }
            }
        }
    }

    /// Position of the limit in its rule (0 for `rate_limit` and overrides), which its counter's key
    /// carries; a runtime limit's is that of the rule's limit with its algorithm and window, whose
    /// counter it shares, else [`keys::OWN_WINDOW`].
    pub fn index(&self) -> usize {
        match *self {
            Applicable::Rule { index, .. } => index,
            Applicable::Override { .. } => 0,
        }
    }

    pub fn requests_per_unit(&self) -> u32 {
        match *self {
            Applicable::Rule { limit, .. } => limit.requests_per_unit,
            Applicable::Override {
                requests_per_unit, ..
            } => requests_per_unit,
        }
    }

    pub fn unit(&self) -> Unit {
        match *self {
            Applicable::Rule { limit, .. } => limit.unit,
            Applicable::Override { unit, .. } => unit,
        }
    }

    /// The limit's name, which `replaces` refers to (overrides have none; a runtime limit's is only
    /// reported, see `apply_replaces`).
    pub fn name(&self) -> Option<&Arc<str>> {
        match self {
            Applicable::Rule { limit, .. } => limit.name.as_ref(),
            Applicable::Override { .. } => None,
        }
    }

    /// The limit as a status reports it.
    pub fn current_limit(&self) -> CurrentLimit {
        CurrentLimit {
            requests_per_unit: self.requests_per_unit(),
            unit: self.unit(),
            name: self.name().cloned(),
        }
    }
}

/// The limits of one descriptor; most have one or two.
pub(super) type Limits<'a> = SmallVec<[Applicable<'a>; 2]>;

/// What a descriptor resolved to before counting.
pub(super) enum Resolved<'a> {
    NoLimit,
    /// An unlimited rule: never counted, but its `replaces` still apply.
    Unlimited(&'a Node),
    Limited {
        limits: Limits<'a>,
        /// The rule, when the limits came from one (not from a request override).
        node: Option<&'a Node>,
        role: Role,
    },
}

impl Resolved<'_> {
    /// How the descriptor's checks weigh in the decision, when it has any.
    pub fn role(&self) -> Option<Role> {
        match self {
            Resolved::Limited { role, .. } => Some(*role),
            Resolved::NoLimit | Resolved::Unlimited(_) => None,
        }
    }
}

/// Refuses a request that is malformed or larger than `request_limits` allows.
pub(super) fn validate(request: &Request, limits: &RequestLimits) -> Result<(), LimitError> {
    if request.domain.is_empty() {
        return Err(LimitError::EmptyDomain);
    }
    if request.descriptors.is_empty() {
        return Err(LimitError::NoDescriptors);
    }
    // The message is built only for a request that breaks a limit.
    let check = |actual: usize, max: usize, setting: &'static str, what: &dyn Fn() -> String| {
        if actual > max {
            Err(LimitError::TooLarge {
                what: what(),
                actual,
                max,
                setting,
            })
        } else {
            Ok(())
        }
    };
    check(
        request.descriptors.len(),
        limits.max_descriptors,
        "request_limits.max_descriptors",
        &|| "the number of descriptors".into(),
    )?;
    for (i, d) in request.descriptors.iter().enumerate() {
        if d.limit.is_some() && !limits.allow_overrides {
            return Err(LimitError::OverrideRefused { index: i });
        }
        check(
            d.entries.len(),
            limits.max_entries,
            "request_limits.max_entries",
            &|| format!("the number of entries of descriptor {i}"),
        )?;
        for (j, e) in d.entries.iter().enumerate() {
            check(
                e.key.len(),
                limits.max_key_bytes,
                "request_limits.max_key_bytes",
                &|| format!("the key length of descriptor {i} entry {j}"),
            )?;
            check(
                e.value.len(),
                limits.max_value_bytes,
                "request_limits.max_value_bytes",
                &|| format!("the value length of descriptor {i} entry {j}"),
            )?;
        }
    }
    Ok(())
}

/// The runtime limits of a request's domain, and what looking a descriptor up in them needs.
pub(super) struct RuntimeLookup<'a> {
    pub limits: &'a DomainLimits,
    /// How values are shown (hashed) where runtime limits keep them.
    pub options: &'a Options,
    pub now_ms: u64,
}

/// The limits of every descriptor of the request, in order, after `replaces`. Without a domain (one no
/// rules file declares), nothing is limited.
pub(super) fn resolve<'a>(
    domain: Option<&'a Domain>,
    request: &Request,
    runtime: Option<&RuntimeLookup<'a>>,
) -> Result<Small<Resolved<'a>>, LimitError> {
    let mut resolved: Small<Resolved<'a>> = Small::new();
    for (index, descriptor) in request.descriptors.iter().enumerate() {
        resolved.push(match domain {
            None => Resolved::NoLimit,
            Some(domain) => resolve_one(domain, index, descriptor, runtime)?,
        });
    }
    apply_replaces(&mut resolved);
    Ok(resolved)
}

/// Whether the rule the descriptor matches now hashes a value that the runtime limit keeps raw (a rules
/// reload added `hash_value: true` after the limit was set, which the set refuses): the limit is then
/// ignored, with one warning, so that the raw value never reaches a counter key.
fn keeps_raw_what_the_rule_hashes(
    node: Option<&Node>,
    descriptor: &Descriptor,
    set: &super::runtime::Applied,
    runtime: &RuntimeLookup<'_>,
) -> bool {
    let Some(node) = node else {
        return false;
    };
    let path = node.path();
    let raw = path.iter().zip(&descriptor.entries).find(|(step, e)| {
        step.flags.hash_value
            && runtime.options.is_sensitive(&e.key, true)
            && !runtime.options.is_sensitive(&e.key, false)
    });
    let Some((_, entry)) = raw else {
        return false;
    };
    if !set
        .warned_unhashed
        .swap(true, std::sync::atomic::Ordering::Relaxed)
    {
        tracing::warn!(
            id = set.record.id,
            rule = %node.full_key(),
            "runtime limit {} ignored: rule '{}' now hashes the values of {:?} (hash_value: true), which the limit keeps raw; delete it, or add {:?} to hashed_keys and set it again",
            set.record.id, node.full_key(), entry.key, entry.key
        );
    }
    true
}

/// The limits of one descriptor of a known domain: an operator's runtime limit for exactly it, else the
/// caller's override, else its rule's.
fn resolve_one<'a>(
    domain: &'a Domain,
    index: usize,
    descriptor: &Descriptor,
    runtime: Option<&RuntimeLookup<'a>>,
) -> Result<Resolved<'a>, LimitError> {
    let set = runtime.and_then(|r| {
        let show = |key: &str, value| r.options.show(key, value, false);
        Some((r.limits.find(&descriptor.entries, r.now_ms, show)?, r))
    });
    if let Some((set, runtime)) = set {
        let node = domain.find(&descriptor.entries);
        if !keeps_raw_what_the_rule_hashes(node, descriptor, set, runtime) {
            // Counted like an override (no rule): always enforced, in the counter its values make, and
            // in the rule's own counter where a limit of the rule has its algorithm and window.
            let own = set.limit.params();
            let index = node
                .and_then(|node| {
                    node.limits.iter().position(|limit| {
                        let params = limit.params();
                        !limit.unlimited
                            && (params.algorithm, params.window_ms)
                                == (own.algorithm, own.window_ms)
                    })
                })
                .unwrap_or(keys::OWN_WINDOW);
            return Ok(Resolved::Limited {
                limits: smallvec![Applicable::Rule {
                    limit: &set.limit,
                    index
                }],
                node: None,
                role: Role::Enforce,
            });
        }
    }
    if let Some(over) = &descriptor.limit {
        let unit = over.unit.ok_or(LimitError::UnknownOverrideUnit { index })?;
        return Ok(Resolved::Limited {
            limits: smallvec![Applicable::Override {
                requests_per_unit: over.requests_per_unit,
                unit,
            }],
            node: None,
            role: Role::Enforce,
        });
    }
    Ok(match domain.find(&descriptor.entries) {
        None => Resolved::NoLimit,
        Some(node) => of_rule(node),
    })
}

/// The limits of a descriptor that matched the rule `node`.
pub(super) fn of_rule(node: &Node) -> Resolved<'_> {
    if node.limits.is_empty() {
        return Resolved::NoLimit;
    }
    if node.limits[0].unlimited {
        return Resolved::Unlimited(node);
    }
    Resolved::Limited {
        limits: node
            .limits
            .iter()
            .enumerate()
            .map(|(index, limit)| Applicable::Rule { limit, index })
            .collect(),
        node: Some(node),
        role: if node.flags.shadow_mode {
            Role::Shadow
        } else if node.flags.quota_mode {
            Role::Quota
        } else {
            Role::Enforce
        },
    }
}

/// Global quota mode (`QUOTA_MODE`, as the reference has it): every limited descriptor but a shadow
/// rule's is a quota descriptor, so the request is denied only when all of them are over, unless one
/// passes ([`passes_as_quota`]). Statuses still show OVER_LIMIT.
pub(super) fn global_quota_mode(resolved: &mut [Resolved<'_>]) {
    for r in resolved.iter_mut() {
        if let Resolved::Limited { role, .. } = r {
            if *role != Role::Shadow {
                *role = Role::Quota;
            }
        }
    }
}

/// Whether a quota descriptor of the request passes whatever the store says, so that its quota checks
/// deny nothing: a shadow rule's status is always OK, and a shadow rule with `quota_mode` is a quota
/// descriptor (every shadow rule is in global quota mode, and so is a descriptor that matched no
/// limit). Unlimited descriptors count for neither.
pub(super) fn passes_as_quota(resolved: &[Resolved<'_>], global: bool) -> bool {
    resolved.iter().any(|r| match r {
        Resolved::NoLimit => global,
        Resolved::Limited {
            role: Role::Shadow,
            node,
            ..
        } => global || node.is_some_and(|n| n.flags.quota_mode),
        Resolved::Limited { .. } | Resolved::Unlimited(_) => false,
    })
}

/// Drops every matched limit whose name another matched limit of the same request replaces
/// (unlimited limits replace too). Only limits of rules are replaced: not overrides (which have no name)
/// nor runtime limits (whatever name an operator gave them).
pub(super) fn apply_replaces(resolved: &mut [Resolved<'_>]) {
    let rules = || {
        resolved.iter().filter_map(|r| match r {
            Resolved::Unlimited(node)
            | Resolved::Limited {
                node: Some(node), ..
            } => Some(*node),
            _ => None,
        })
    };
    // Most requests match no limit that replaces another: nothing to gather.
    if !rules().any(|node| node.limits.iter().any(|l| !l.replaces.is_empty())) {
        return;
    }
    let replaced: Vec<Arc<str>> = rules()
        .flat_map(|node| node.limits.iter())
        .flat_map(|limit| limit.replaces.iter().cloned())
        .collect();
    if replaced.is_empty() {
        return;
    }
    for r in resolved.iter_mut() {
        if let Resolved::Limited {
            limits,
            node: Some(_),
            ..
        } = r
        {
            limits.retain(|a| a.name().is_none_or(|n| !replaced.contains(n)));
            if limits.is_empty() {
                *r = Resolved::NoLimit;
            }
        }
    }
}

/// Hits a descriptor of the request costs: its own `hits_addend`, else the request's (0 read as 1).
pub(super) fn hits(request: &Request, descriptor: &Descriptor) -> u64 {
    descriptor
        .hits_addend
        .unwrap_or(u64::from(request.hits_addend.max(1)))
}

/// One check per limit of every limited descriptor, in order, each on the counter its limit keeps for the
/// descriptor's values.
pub(super) fn batch(request: &Request, resolved: &[Resolved<'_>], options: &Options) -> Batch {
    build(
        request,
        resolved,
        options,
        Vec::with_capacity(resolved.len()),
        String::new,
    )
}

/// The batch of a request as [`batch`] makes it, in vectors and key strings that requests before it
/// left on this thread (see [`Recycled`]): once a thread has decided a few requests, planning one
/// allocates nothing.
pub(super) fn recycled_batch(
    request: &Request,
    resolved: &[Resolved<'_>],
    options: &Options,
) -> Recycled {
    let batch = SPARES
        .try_with(|spares| {
            let mut spares = spares.try_borrow_mut().ok()?;
            let mut checks = spares.checks.pop().unwrap_or_default();
            checks.reserve(resolved.len());
            let keys = &mut spares.keys;
            Some(build(request, resolved, options, checks, || {
                keys.pop().unwrap_or_default()
            }))
        })
        .ok()
        .flatten()
        .unwrap_or_else(|| batch(request, resolved, options));
    Recycled(batch)
}

/// What a thread keeps of dropped batches for the next ones, at most: vectors (one per request in
/// flight on the thread, up to this many), key strings, the capacity of one key string kept and that
/// of one vector (in checks).
const SPARE_VECTORS: usize = 8;
const SPARE_KEYS: usize = 32;
const SPARE_CHECKS: usize = 64;
const SPARE_KEY_BYTES: usize = 512;

/// Emptied check vectors and cleared key strings of dropped batches.
#[derive(Default)]
struct Spares {
    checks: Vec<Vec<Check>>,
    keys: Vec<String>,
}

thread_local! {
    static SPARES: std::cell::RefCell<Spares> = std::cell::RefCell::default();
}

/// A request's batch, which leaves its vector and key strings to the batches planned next on the thread
/// that drops it.
pub(super) struct Recycled(Batch);

impl std::ops::Deref for Recycled {
    type Target = Batch;

    fn deref(&self) -> &Batch {
        &self.0
    }
}

impl Drop for Recycled {
    fn drop(&mut self) {
        let mut checks = std::mem::take(&mut self.0.checks);
        let _ = SPARES.try_with(|spares| {
            let Ok(mut spares) = spares.try_borrow_mut() else {
                return;
            };
            for check in checks.drain(..) {
                let mut key = check.key;
                if spares.keys.len() < SPARE_KEYS && key.capacity() <= SPARE_KEY_BYTES {
                    key.clear();
                    spares.keys.push(key);
                }
            }
            if spares.checks.len() < SPARE_VECTORS && checks.capacity() <= SPARE_CHECKS {
                spares.checks.push(checks);
            }
        });
    }
}

/// The checks of a request's limits, in `checks` (empty), each key a string from `new_key` (empty).
fn build(
    request: &Request,
    resolved: &[Resolved<'_>],
    options: &Options,
    checks: Vec<Check>,
    mut new_key: impl FnMut() -> String,
) -> Batch {
    let mut batch = Batch {
        checks,
        consume_on_deny: options.consume_on_deny,
        known_denied: false,
    };
    // The store decides by the checks' roles: quota checks that cannot deny go as shadow ones.
    let quota_denies = !passes_as_quota(resolved, options.quota_mode);
    for (descriptor, r) in request.descriptors.iter().zip(resolved) {
        let Resolved::Limited { limits, node, role } = r else {
            continue;
        };
        let role = match *role {
            Role::Quota if !quota_denies => Role::Shadow,
            role => role,
        };
        let values = key_values(descriptor, *node, options);
        let cost = hits(request, descriptor);
        let key_len = options.key_prefix.len()
            + request.domain.len()
            + descriptor
                .entries
                .iter()
                .map(|e| e.key.len())
                .sum::<usize>()
            + values.iter().map(|v| v.len()).sum::<usize>()
            + 2 * descriptor.entries.len()
            + 48;
        for (nth, applicable) in limits.iter().enumerate() {
            let params = applicable.params();
            let mut key = new_key();
            key.reserve(key_len);
            keys::limit_key(
                &mut key,
                &options.key_prefix,
                &request.domain,
                descriptor
                    .entries
                    .iter()
                    .zip(&values)
                    .map(|(e, v)| (e.key.as_str(), v.as_ref())),
                params.algorithm,
                params.window_ms / 1000,
                applicable.index(),
            );
            batch.checks.push(Check {
                key,
                params,
                cost,
                role,
                further_limit: nth > 0,
                per_second: applicable.unit() == Unit::Second,
                reported: false,
            });
        }
    }
    batch
}

/// A descriptor's values as they go into counter keys: the rule's shared pattern where it shares one
/// counter among values, the hash of sensitive values, the others as they are.
pub(super) fn key_values<'a>(
    descriptor: &'a Descriptor,
    node: Option<&'a Node>,
    options: &Options,
) -> Small<Cow<'a, str>> {
    // Most rules neither share nor hash a level's value themselves: their keys need nothing from the
    // path (the values of `hashed_keys` are hashed either way, by `show`).
    let path = node
        .filter(|n| !n.at.values_as_sent())
        .map(Node::path)
        .unwrap_or_default();
    descriptor
        .entries
        .iter()
        .enumerate()
        .map(
            |(i, e)| match path.get(i).and_then(|step| step.shared_value()) {
                Some(pattern) => pattern.into(),
                None => options.show(&e.key, &e.value, hashed_at(&path, i)),
            },
        )
        .collect()
}

/// Whether the rule says `hash_value` at level `i` of its path (no path: a request override).
pub(super) fn hashed_at(path: &[&PathStep], i: usize) -> bool {
    path.get(i).is_some_and(|step| step.flags.hash_value)
}
