//! What the operators' API asks of the limiter, off the request path: the limits a descriptor is counted
//! against and what their counters hold (inspect), clearing those counters (reset), and the runtime
//! limits (set, list, delete, and this replica's table refreshed from the store).
//!
//! A descriptor is planned exactly as a request carrying it (with `hits_addend` 0) would be, so the
//! counters inspected and reset are the ones requests count in. Every change moves the store's
//! generation on; each replica that sees it move (within `runtime_limits.refresh_interval`) reads the
//! runtime limits again, forgets the denials its deny cache remembers and drops its quota leases
//! (without giving their hits back: the counters they came from may be gone), so that the next
//! requests everywhere see the store as it is.

use super::{
    plan::{self, Resolved, RuntimeLookup},
    runtime::{id_of, Expiry, LimitSpec, RuntimeLimit, Table, MAX_EXPIRY_MS, MAX_NAME_BYTES},
    Descriptor, Entry, LimitError, Limiter, Request,
};
use crate::{
    algorithm::{self, Params, Usage},
    rules::{Domain, Node, RuleSet, Unit},
    store::{operator::RecordKeys, Check, StoreError},
};

/// The descriptor an operator names: a domain and its entries, with raw values.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    pub domain: String,
    pub entries: Vec<Entry>,
}

/// Why an operator's call could not be done.
#[derive(Debug, thiserror::Error)]
pub enum OperatorError {
    #[error("{0}")]
    Invalid(String),
    #[error("domain {0:?} has no rules loaded: runtime limits and counters belong to a domain with rules")]
    UnknownDomain(String),
    #[error("no runtime limit {0}")]
    NotFound(String),
    #[error("there are {max} runtime limits already, the most runtime_limits.max_limits allows; delete one first")]
    TooMany { max: usize },
    #[error(transparent)]
    Request(#[from] LimitError),
    #[error("the store could not answer: {0}")]
    Store(#[from] StoreError),
}

/// The limits of a descriptor and what their counters hold now.
#[derive(Debug, Clone)]
pub struct Inspection {
    pub domain: String,
    /// The descriptor's entries as counter keys show them (sensitive values hashed).
    pub descriptor: Vec<(String, String)>,
    /// The rule it matches, as `/rlconfig` names it.
    pub rule: Option<String>,
    /// The rule is `unlimited`: nothing is counted.
    pub unlimited: bool,
    pub limits: Vec<Inspected>,
}

/// One limit of an inspected descriptor.
#[derive(Debug, Clone)]
pub struct Inspected {
    /// The runtime limit's id; `None` for a limit of the rules.
    pub runtime_id: Option<String>,
    /// Whether requests count against it now (a runtime limit replaces its rule's limits).
    pub applies: bool,
    pub name: Option<String>,
    pub requests_per_unit: u32,
    pub unit: Unit,
    pub params: Params,
    pub usage: Usage,
}

/// A descriptor's limits, planned: each with its check (cost 0), in order: the runtime limit first.
struct Planned {
    inspection: Inspection,
    checks: Vec<Check>,
    /// The rule's counters are shared with other values (`share_threshold`, a shared `cidr:`).
    rule_shared: bool,
}

/// What a reset cleared.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reset {
    /// The descriptor, as counter keys show it (sensitive values hashed).
    pub descriptor: Vec<(String, String)>,
    /// Limits whose counters were cleared.
    pub limits: usize,
    /// Of those, the counters that held something.
    pub counters: usize,
}

impl Limiter {
    pub(super) fn record_keys(&self) -> RecordKeys {
        RecordKeys::new(&self.options.key_prefix)
    }

    /// The request a descriptor stands for: checked, not counted.
    fn request_of(target: &Target) -> Request {
        Request {
            domain: target.domain.clone(),
            descriptors: vec![Descriptor {
                entries: target.entries.clone(),
                limit: None,
                hits_addend: Some(0),
            }],
            hits_addend: 0,
        }
    }

    /// The rules of a target's domain, refusing a target no request could be.
    fn domain_of<'r>(
        &self,
        rules: &'r RuleSet,
        target: &Target,
    ) -> Result<&'r Domain, OperatorError> {
        plan::validate(&Self::request_of(target), &self.options.request_limits)?;
        rules
            .domains
            .get(&target.domain)
            .ok_or_else(|| OperatorError::UnknownDomain(target.domain.clone()))
    }

    fn plan(&self, target: &Target) -> Result<Planned, OperatorError> {
        let rules = self.rules.snapshot().ok_or(LimitError::NoRules)?;
        let domain = self.domain_of(&rules, target)?;
        let request = Self::request_of(target);
        let node = domain.find(&target.entries);
        let path = node.map(Node::path).unwrap_or_default();
        let descriptor = target
            .entries
            .iter()
            .enumerate()
            .map(|(i, e)| {
                let shown = self
                    .options
                    .show(&e.key, &e.value, plan::hashed_at(&path, i));
                (e.key.clone(), shown.into_owned())
            })
            .collect();
        let mut planned = Planned {
            inspection: Inspection {
                domain: target.domain.clone(),
                descriptor,
                rule: node.map(Node::full_key),
                unlimited: false,
                limits: Vec::new(),
            },
            checks: Vec::new(),
            rule_shared: path.iter().any(|step| step.shared_value().is_some()),
        };
        let runtime = self.runtime.current();
        let lookup = runtime
            .as_deref()
            .and_then(|t| t.domain(&target.domain))
            .map(|limits| RuntimeLookup {
                limits,
                options: &self.options,
                now_ms: self.clock.now_millis(),
            });
        let set = lookup.as_ref().and_then(|r| {
            r.limits.find(&target.entries, r.now_ms, |k, v| {
                self.options.show(k, v, false)
            })
        });
        // A runtime limit the request path ignores (its rule now hashes a value it keeps raw) is shown
        // as not applying.
        let set = match set {
            Some(set) => {
                let resolved = plan::resolve(Some(domain), &request, lookup.as_ref())?;
                let applies = matches!(resolved[0], Resolved::Limited { node: None, .. });
                if applies {
                    self.add(
                        &mut planned,
                        &request,
                        &resolved,
                        Some(set.record.id.clone()),
                        true,
                    );
                }
                applies.then_some(set)
            }
            None => None,
        };
        let resolved = plan::resolve(Some(domain), &request, None)?;
        planned.inspection.unlimited = matches!(resolved[0], Resolved::Unlimited(_));
        self.add(&mut planned, &request, &resolved, None, set.is_none());
        Ok(planned)
    }

    /// Adds the limits of a resolved descriptor, with their checks.
    fn add(
        &self,
        planned: &mut Planned,
        request: &Request,
        resolved: &[Resolved<'_>],
        runtime_id: Option<String>,
        applies: bool,
    ) {
        let Resolved::Limited { limits, .. } = &resolved[0] else {
            return;
        };
        let batch = plan::batch(request, resolved, &self.options);
        for (applicable, check) in limits.iter().zip(batch.checks) {
            let params = applicable.params();
            planned.inspection.limits.push(Inspected {
                runtime_id: runtime_id.clone(),
                applies,
                name: applicable
                    .current_limit()
                    .name
                    .as_deref()
                    .map(str::to_owned),
                requests_per_unit: applicable.requests_per_unit(),
                unit: applicable.unit(),
                params,
                usage: algorithm::usage(&params, None, 0),
            });
            planned.checks.push(check);
        }
    }

    /// Every limit a descriptor is counted against (and those of its rule a runtime limit replaces),
    /// with what its counter holds, read from the store without counting anything.
    pub async fn inspect(&self, target: &Target) -> Result<Inspection, OperatorError> {
        self.refresh_runtime_limits().await?;
        let Planned {
            mut inspection,
            checks,
            ..
        } = self.plan(target)?;
        let read = self.shared.read(&checks, self.clock.now_millis()).await?;
        for (limit, state) in inspection.limits.iter_mut().zip(&read.states) {
            limit.usage = algorithm::usage(&limit.params, state.as_ref(), read.now_ms);
        }
        Ok(inspection)
    }

    /// Clears the counters of every limit a descriptor is counted against (every algorithm's state), in
    /// the store, so on every replica's view; the other replicas forget what they remember of them
    /// (denials, leases) when they see the change.
    pub async fn reset(&self, target: &Target) -> Result<Reset, OperatorError> {
        self.refresh_runtime_limits().await?;
        let Planned {
            inspection,
            checks,
            rule_shared,
        } = self.plan(target)?;
        // The descriptor's own counters: not those of the limits of its rule a runtime limit stands in
        // for when the rule shares them with other values (`share_threshold`, a shared `cidr:`).
        let checks: Vec<_> = checks
            .into_iter()
            .zip(&inspection.limits)
            .filter(|(_, limit)| limit.applies || !rule_shared)
            .map(|(check, _)| check)
            .collect();
        // This replica's leases end first, so that none of their hits goes back into a counter that
        // requests create again after the delete.
        self.shared.operator_changed();
        let counters = self.shared.clear(&checks, self.clock.now_millis()).await?;
        self.shared.announce(&self.record_keys()).await?;
        self.refresh_runtime_limits().await?;
        Ok(Reset {
            descriptor: inspection.descriptor,
            limits: checks.len(),
            counters,
        })
    }

    /// Sets (or replaces) the runtime limit of a descriptor; `expiry` ends it, at most [`MAX_EXPIRY_MS`]
    /// from now (by this replica's clock).
    pub async fn set_runtime_limit(
        &self,
        target: &Target,
        spec: LimitSpec,
        expiry: Option<Expiry>,
        set_by: &str,
    ) -> Result<RuntimeLimit, OperatorError> {
        let rules = self.rules.snapshot().ok_or(LimitError::NoRules)?;
        let domain = self.domain_of(&rules, target)?;
        if let Some(node) = domain.find(&target.entries) {
            self.refuse_unhashed(node, target)?;
        }
        let descriptor = self.stored_descriptor(target);
        let id = id_of(&target.domain, &descriptor);
        if spec.name.as_ref().is_some_and(|n| n.len() > MAX_NAME_BYTES) {
            return Err(OperatorError::Invalid(format!(
                "the name is longer than {MAX_NAME_BYTES} bytes"
            )));
        }
        // Kept as resolved here: every replica counts it the same way, whatever its own default.
        let mut spec = spec;
        spec.algorithm = spec.algorithm.or(Some(self.options.default_algorithm));
        spec.compile(
            &format!("runtime limit {id}"),
            self.options.default_algorithm,
        )
        .map_err(|e| OperatorError::Invalid(e.to_string()))?;
        let now_ms = self.clock.now_millis();
        let expires_at_ms = expiry.map(|e| expires_at(e, now_ms)).transpose()?;
        let record = RuntimeLimit {
            id,
            domain: target.domain.clone(),
            descriptor,
            limit: spec,
            expires_at_ms,
            set_at_ms: now_ms,
            set_by: set_by.to_owned(),
        };
        let text = serde_json::to_string(&record)
            .map_err(|e| OperatorError::Invalid(format!("cannot write the record: {e}")))?;
        // The store counts the limits in force (expired ones are purged after the set) in the step
        // that writes, so that replicas setting limits at once never hold more than the bound.
        let (keys, max) = (self.record_keys(), self.options.runtime_limits.max_limits);
        if !self
            .shared
            .put_record(&keys, &record.id, &text, max, now_ms)
            .await?
        {
            return Err(OperatorError::TooMany { max });
        }
        // Set: what follows only tidies up, and its failure must not make the caller (and the audit log)
        // take the limit for refused.
        self.after_change(&record.id).await;
        if let Err(err) = self.purge_expired().await {
            tracing::warn!(id = record.id, "expired runtime limits not deleted: {err}");
        }
        Ok(record)
    }

    /// A rule that hashes a value `hashed_keys` does not (`hash_value: true`) would have its raw value
    /// kept by a runtime limit: refused.
    fn refuse_unhashed(&self, node: &Node, target: &Target) -> Result<(), OperatorError> {
        for (step, entry) in node.path().iter().zip(&target.entries) {
            if step.flags.hash_value && !self.options.is_sensitive(&entry.key, false) {
                return Err(OperatorError::Invalid(format!(
                    "rule '{}' hashes the values of {:?} (hash_value: true); runtime limits hash the keys of hashed_keys only: add {:?} to hashed_keys to set a runtime limit on it",
                    node.full_key(), entry.key, entry.key
                )));
            }
        }
        Ok(())
    }

    /// Deletes a runtime limit by id; returns it as it was (`None`: a record that no longer read as a
    /// runtime limit, left out of force and logged as such, which is deleted all the same).
    pub async fn delete_runtime_limit(
        &self,
        id: &str,
    ) -> Result<Option<RuntimeLimit>, OperatorError> {
        self.refresh_runtime_limits().await?;
        let known = self
            .runtime
            .current()
            .and_then(|t| t.get(id).map(|a| a.record.clone()));
        let deleted = self
            .shared
            .delete_records(&self.record_keys(), &[id.to_owned()])
            .await?;
        if deleted > 0 {
            self.after_change(id).await;
        }
        match deleted {
            0 => Err(OperatorError::NotFound(id.to_owned())),
            _ => Ok(known),
        }
    }

    /// Reads the runtime limits again after a change made in the store, for this replica to apply it at
    /// once; when that fails, the change holds all the same, and this replica applies it with its next
    /// refresh, as the others do.
    async fn after_change(&self, id: &str) {
        if let Err(err) = self.refresh_runtime_limits().await {
            tracing::warn!(
                id,
                "runtime limit changed, but not read back yet (this replica applies it with its next refresh): {err}"
            );
        }
    }

    /// The id a descriptor's runtime limit has (or would have).
    pub fn runtime_limit_id(&self, target: &Target) -> Result<String, OperatorError> {
        Ok(id_of(&target.domain, &self.stored_descriptor(target)))
    }

    /// A target's entries as a runtime limit keeps them: sensitive values hashed as the settings say.
    fn stored_descriptor(&self, target: &Target) -> Vec<(String, String)> {
        target
            .entries
            .iter()
            .map(|e| {
                let value = self.options.show(&e.key, &e.value, false).into_owned();
                (e.key.clone(), value)
            })
            .collect()
    }

    /// The runtime limits in force, by id; expired ones are deleted from the store.
    pub async fn runtime_limits(&self) -> Result<Vec<RuntimeLimit>, OperatorError> {
        self.refresh_runtime_limits().await?;
        self.purge_expired().await?;
        let now_ms = self.clock.now_millis();
        Ok(self.runtime.current().map_or_else(Vec::new, |t| {
            t.all()
                .iter()
                .filter(|a| a.record.expires_at_ms.is_none_or(|at| now_ms < at))
                .map(|a| a.record.clone())
                .collect()
        }))
    }

    /// Deletes the records of runtime limits that have expired (they stopped applying at their expiry
    /// already).
    async fn purge_expired(&self) -> Result<(), OperatorError> {
        let now_ms = self.clock.now_millis();
        let expired: Vec<String> = self.runtime.current().map_or_else(Vec::new, |t| {
            t.all()
                .iter()
                .filter(|a| a.record.expires_at_ms.is_some_and(|at| at <= now_ms))
                .map(|a| a.record.id.clone())
                .collect()
        });
        if !expired.is_empty() {
            let purged = self
                .shared
                .purge_records(&self.record_keys(), &expired, now_ms)
                .await?;
            if purged > 0 {
                self.refresh_runtime_limits().await?;
            }
        }
        Ok(())
    }

    /// Reads the runtime limits again when the store's generation moved; then forgets what this replica
    /// remembers of the counters (denials, leases). Whether it moved.
    pub async fn refresh_runtime_limits(&self) -> Result<bool, StoreError> {
        let _one_at_a_time = self.runtime.refreshing.lock().await;
        let known = self.runtime.generation();
        let Some(records) = self.shared.records(&self.record_keys(), known).await? else {
            return Ok(false);
        };
        // Parsing every record is linear in them (tens of ms at the bound of 10 000): off the threads that
        // decide requests.
        let default_algorithm = self.options.default_algorithm;
        let (table, refused) = tokio::task::spawn_blocking(move || {
            Table::build(records.generation, &records.records, default_algorithm)
        })
        .await
        .map_err(|e| StoreError::Backend(format!("reading the runtime limits failed: {e}")))?;
        for (id, reason) in refused {
            tracing::warn!(id, "runtime limit left out: {reason}");
        }
        self.runtime.replace(table);
        if known.is_some() {
            if let Some(cache) = &self.options.deny_cache {
                cache.clear();
            }
            self.shared.operator_changed();
        }
        Ok(true)
    }
}

/// When a runtime limit set at `now_ms` ends, refused unless it is after `now_ms` and at most
/// [`MAX_EXPIRY_MS`] later.
fn expires_at(expiry: Expiry, now_ms: u64) -> Result<u64, OperatorError> {
    let at = match expiry {
        Expiry::In(within) => u64::try_from(within.as_millis())
            .ok()
            .and_then(|ms| now_ms.checked_add(ms)),
        Expiry::At(at) => at,
    };
    match at {
        Some(at) if at <= now_ms => Err(OperatorError::Invalid(
            "the expiry is not in the future".into(),
        )),
        Some(at) if at - now_ms <= MAX_EXPIRY_MS => Ok(at),
        _ => Err(OperatorError::Invalid(format!(
            "the expiry is more than {} days (10 years) away, the furthest a runtime limit may be set for; set none to keep it until deleted",
            MAX_EXPIRY_MS / 86_400_000
        ))),
    }
}
