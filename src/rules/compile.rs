//! Compiling validated rules files into a [`RuleSet`].
//!
//! The reference service's semantic checks (units, unlimited, replaces, duplicates, share_threshold) are
//! applied here with its messages, and ratelimitd's extensions (algorithms, burst, unit_multiplier,
//! several limits per rule, CIDR values) with messages naming the file, the rule and the field. A file
//! either compiles whole or the build fails with the first error.

use std::{collections::HashMap, sync::Arc};

use super::{
    error::{BuildError, LimitField, RuleError, RulePlace},
    model::{
        Level, Limit, Node, PathStep, RuleMap, RulePath, RuleSet, MAX_WINDOW_SECS,
        SLIDING_LOG_MAX_LIMIT,
    },
    pattern::{Cidr, Wildcard, WildcardIndex, CIDR_PREFIX},
    unit::Unit,
    yaml::{DescriptorSpec, DomainFile, RateLimitSpec},
};
use crate::algorithm::Algorithm;

impl RuleSet {
    /// Builds the rule set from parsed files, in the order given, counting with fixed windows unless a
    /// rule says otherwise. The error names the file it is about.
    pub fn build(
        files: &[(String, DomainFile)],
        merge_domains: bool,
    ) -> Result<RuleSet, BuildError> {
        Self::build_with(files, merge_domains, Algorithm::FixedWindow)
    }

    /// [`RuleSet::build`] with another default algorithm.
    pub fn build_with(
        files: &[(String, DomainFile)],
        merge_domains: bool,
        default_algorithm: Algorithm,
    ) -> Result<RuleSet, BuildError> {
        let mut set = RuleSet::default();
        // The composite keys of each domain's top level, which files merged into one domain share.
        let mut tops: HashMap<&str, Composites> = HashMap::new();
        // The file that declared each domain first.
        let mut firsts: HashMap<&str, &str> = HashMap::new();
        for (file_name, file) in files {
            let refused = |(error, rule): Refusal| BuildError {
                file: file_name.clone(),
                error,
                rule,
            };
            let first = *firsts.entry(file.domain.as_str()).or_insert(file_name);
            if first != file_name.as_str() && !merge_domains && !file.domain.is_empty() {
                let hidden = |name: &str| name.contains("..");
                let hint = if hidden(first) || hidden(file_name) {
                    "; one is a hidden copy a Kubernetes volume keeps beside its files: set RUNTIME_IGNOREDOTFILES=true"
                } else {
                    ""
                };
                return Err(refused((
                    RuleError::DuplicateDomain {
                        domain: file.domain.clone(),
                        first: first.to_owned(),
                        hint,
                    },
                    None,
                )));
            }
            let top = tops.entry(file.domain.as_str()).or_default();
            set.add_file(file, top, default_algorithm)
                .map_err(refused)?;
        }
        Ok(set)
    }

    fn add_file(
        &mut self,
        file: &DomainFile,
        top: &mut Composites,
        default_algorithm: Algorithm,
    ) -> Result<(), Refusal> {
        if file.domain.is_empty() {
            return Err((RuleError::EmptyDomain, None));
        }
        let name: Arc<str> = file.domain.as_str().into();
        let domain = self.domains.entry(file.domain.clone()).or_default();
        add_level(
            &mut domain.root,
            top,
            &file.descriptors,
            &name,
            None,
            default_algorithm,
        )
    }
}

/// The reference service's composite keys (`key_value`, or `key` alone) of a level's nodes, by which it
/// finds duplicates; needed only while the level is built.
type Composites = RuleMap<Box<str>, ()>;

/// A rule's name for a message, built only when a message needs it.
type RuleName<'a> = &'a dyn Fn() -> String;

/// Why a file does not compile, and the rule at fault when it is about one.
type Refusal = (RuleError, Option<Box<RulePlace>>);

/// How a node's written value meets a request's value, which decides where in its level it goes.
enum ValueMatch {
    /// No value: any value.
    Any,
    /// A plain value: exactly that value.
    Exact,
    /// `cidr:`: the addresses of a network.
    Cidr(Cidr),
    /// A value with `*`.
    Wildcard,
}

impl ValueMatch {
    fn of(spec: &DescriptorSpec, rule: RuleName<'_>) -> Result<ValueMatch, RuleError> {
        if let Some(net) = spec.value.strip_prefix(CIDR_PREFIX) {
            let cidr = Cidr::parse(net).map_err(|source| RuleError::MalformedCidr {
                rule: rule(),
                value: spec.value.clone(),
                source,
            })?;
            return Ok(ValueMatch::Cidr(cidr));
        }
        Ok(if spec.value.is_empty() {
            ValueMatch::Any
        } else if spec.value.contains('*') {
            ValueMatch::Wildcard
        } else {
            ValueMatch::Exact
        })
    }
}

/// Compiles the descriptors written at one depth under one parent into `level`, their children with
/// them; `composites` are those of the nodes `level` holds already. `parent` is the parent rule's path
/// (`None` at the top of `domain`). A rule's full key is built only for a message: built for every
/// rule, it made the time to compile grow with depth times rules.
fn add_level(
    level: &mut Level,
    composites: &mut Composites,
    specs: &[DescriptorSpec],
    domain: &Arc<str>,
    parent: Option<&Arc<RulePath>>,
    default_algorithm: Algorithm,
) -> Result<(), Refusal> {
    for spec in specs {
        let place = |name: String| {
            Some(Box::new(RulePlace {
                name,
                line: spec.line,
            }))
        };
        if spec.key.is_empty() {
            // Named by the rule it is written under, or its domain.
            let above = parent.map_or_else(|| domain.to_string(), |p| p.full_key());
            return Err((RuleError::EmptyKey, place(above)));
        }
        let step = PathStep {
            key: spec.key.as_str().into(),
            value: spec.value.as_str().into(),
            flags: spec.flags,
        };
        let at = match parent {
            Some(parent) => RulePath::under(parent, step),
            None => RulePath::top(domain.clone(), step),
        };
        let name = || at.full_key();
        let at_fault = |error| (error, place(name()));
        // The reference service keys a level by this string, so `key: a_b` and `key: a, value: b` are
        // duplicates there; they stay duplicates here, with its message, although matching tells them
        // apart.
        let composite = if spec.value.is_empty() {
            spec.key.clone()
        } else {
            format!("{}_{}", spec.key, spec.value)
        };
        if composites.contains_key(composite.as_str()) {
            return Err(at_fault(RuleError::DuplicateKey(name())));
        }
        let limits = compile_limits(spec, &name, default_algorithm).map_err(at_fault)?;
        let value_match = ValueMatch::of(spec, &name).map_err(at_fault)?;
        if spec.flags.share_threshold && matches!(value_match, ValueMatch::Any | ValueMatch::Exact)
        {
            return Err(at_fault(RuleError::ShareThresholdWithoutWildcard(
                composite,
            )));
        }
        let mut node = Node {
            limits,
            flags: spec.flags,
            at,
            metadata: spec.metadata.clone().map(Arc::new),
            children: Level::default(),
            counters: Default::default(),
        };
        add_level(
            &mut node.children,
            &mut Composites::default(),
            &spec.descriptors,
            domain,
            Some(&node.at),
            default_algorithm,
        )?;
        composites.insert(composite.into(), ());
        level.insert(spec, value_match, node);
    }
    // CIDRs longest prefix first, in file order among equal prefixes (a stable sort): once per level,
    // where an insertion in order moved every shorter prefix for each rule.
    for same_key in level.keys.values_mut() {
        same_key
            .cidrs
            .sort_by_key(|(cidr, _)| std::cmp::Reverse(cidr.prefix()));
        same_key.wildcard_index = WildcardIndex::build(same_key.wildcards.iter().map(|(w, _)| w));
    }
    Ok(())
}

impl Level {
    /// Adds the node `spec` describes where its kind of value belongs: wildcards in file order, CIDRs
    /// too until `add_level` orders them.
    fn insert(&mut self, spec: &DescriptorSpec, value_match: ValueMatch, node: Node) {
        let same_key = self.keys.entry(spec.key.as_str().into()).or_default();
        if matches!(value_match, ValueMatch::Cidr(_) | ValueMatch::Wildcard) {
            same_key.patterns.insert(spec.value.as_str().into(), ());
        }
        match value_match {
            // Put in prefix order once the level is built (see `add_level`).
            ValueMatch::Cidr(cidr) => same_key.cidrs.push((cidr, node)),
            ValueMatch::Wildcard => same_key.wildcards.push((Wildcard::new(&spec.value), node)),
            ValueMatch::Any => same_key.default = Some(node),
            ValueMatch::Exact => {
                same_key.values.insert(spec.value.as_str().into(), node);
            }
        }
    }
}

/// The limits of a rule: its `rate_limit` first, then its `rate_limits`.
fn compile_limits(
    spec: &DescriptorSpec,
    rule: RuleName<'_>,
    default_algorithm: Algorithm,
) -> Result<Vec<Limit>, RuleError> {
    let mut limits = Vec::with_capacity(1 + spec.rate_limits.len());
    if let Some(rate_limit) = &spec.rate_limit {
        limits.push(compile_limit(
            rate_limit,
            rule,
            LimitField::RateLimit,
            default_algorithm,
        )?);
    }
    for (i, rate_limit) in spec.rate_limits.iter().enumerate() {
        let field = LimitField::RateLimits(i);
        let limit = compile_limit(rate_limit, rule, field, default_algorithm)?;
        if limit.unlimited {
            return Err(RuleError::UnlimitedInRateLimits {
                rule: rule(),
                field,
            });
        }
        limits.push(limit);
    }
    Ok(limits)
}

/// A limit written outside a rules file (an operator's runtime limit), validated as the `rate_limit` of
/// a rule named `rule` would be; an unlimited one is refused, since it would count nothing.
pub fn compile_runtime_limit(
    spec: &RateLimitSpec,
    rule: &str,
    default_algorithm: Algorithm,
) -> Result<Limit, RuleError> {
    if spec.unlimited {
        return Err(RuleError::UnlimitedInRateLimits {
            rule: rule.into(),
            field: LimitField::RateLimit,
        });
    }
    compile_limit(
        spec,
        &|| rule.to_owned(),
        LimitField::RateLimit,
        default_algorithm,
    )
}

/// One limit of the rule `rule`, written at `field`.
fn compile_limit(
    spec: &RateLimitSpec,
    rule: RuleName<'_>,
    field: LimitField,
    default_algorithm: Algorithm,
) -> Result<Limit, RuleError> {
    let algorithm =
        algorithm_of(spec, default_algorithm).ok_or_else(|| RuleError::UnknownAlgorithm {
            rule: rule(),
            field,
            name: spec.algorithm.clone(),
        })?;
    if spec.burst.is_some() && !algorithm.uses_burst() {
        return Err(RuleError::BurstWithoutBucket {
            rule: rule(),
            field,
            algorithm,
        });
    }
    if spec.count_over_limit && spec.unlimited {
        return Err(RuleError::CountOverUnlimited {
            rule: rule(),
            field,
        });
    }
    let unit_multiplier =
        unit_multiplier_of(spec).map_err(|written| RuleError::UnitMultiplier {
            rule: rule(),
            field,
            written,
        })?;
    if algorithm == Algorithm::SlidingLog && spec.requests_per_unit > SLIDING_LOG_MAX_LIMIT {
        return Err(RuleError::SlidingLogTooLarge {
            rule: rule(),
            field,
        });
    }
    let unit = unit_of(spec)?;
    if let Some(unit) = unit {
        check_window(rule, field, unit, unit_multiplier, algorithm, spec)?;
    }
    let name = (!spec.name.is_empty()).then(|| Arc::<str>::from(spec.name.as_str()));
    let replaces = replaces_of(spec, name.as_deref())?;
    Ok(Limit {
        requests_per_unit: spec.requests_per_unit,
        unit: unit.unwrap_or(Unit::Second),
        unit_multiplier,
        algorithm,
        // A limit of 0 blocks everything: a bucket that is never refilled holds nothing either, as
        // GCRA counts it (a token bucket would otherwise admit its burst once, then never again).
        burst: match spec.requests_per_unit {
            0 => 0,
            per_unit => spec.burst.unwrap_or(u64::from(per_unit)),
        },
        count_over_limit: spec.count_over_limit,
        unlimited: spec.unlimited,
        name,
        replaces,
    })
}

/// The limit's algorithm; `None` when it names none.
fn algorithm_of(spec: &RateLimitSpec, default_algorithm: Algorithm) -> Option<Algorithm> {
    if spec.algorithm.is_empty() {
        Some(default_algorithm)
    } else {
        Algorithm::from_name(&spec.algorithm)
    }
}

/// The limit's `unit_multiplier` (1 when absent), or the written number when it is not one.
fn unit_multiplier_of(spec: &RateLimitSpec) -> Result<u32, i64> {
    match spec.unit_multiplier {
        None => Ok(1),
        Some(m) => u32::try_from(m).ok().filter(|m| *m >= 1).ok_or(m),
    }
}

/// The limit's unit; `None` for an unlimited limit, which must not name one.
fn unit_of(spec: &RateLimitSpec) -> Result<Option<Unit>, RuleError> {
    match (spec.unlimited, Unit::from_name(&spec.unit)) {
        (false, Some(unit)) => Ok(Some(unit)),
        (false, None) => Err(RuleError::InvalidUnit(spec.unit.clone())),
        (true, None) => Ok(None),
        (true, Some(_)) => Err(RuleError::UnitWhenUnlimited),
    }
}

/// The names the limit replaces; none may be empty or the limit's own `name`.
fn replaces_of(spec: &RateLimitSpec, name: Option<&str>) -> Result<Box<[Arc<str>]>, RuleError> {
    spec.replaces
        .iter()
        .map(|r| {
            if r.is_empty() {
                Err(RuleError::EmptyReplaces)
            } else if name == Some(r.as_str()) {
                Err(RuleError::ReplacesItself)
            } else {
                Ok(Arc::from(r.as_str()))
            }
        })
        .collect()
}

/// Refuses a limit whose window, or whose time to refill a full burst, is longer than [`MAX_WINDOW_SECS`].
fn check_window(
    rule: RuleName<'_>,
    field: LimitField,
    unit: Unit,
    unit_multiplier: u32,
    algorithm: Algorithm,
    spec: &RateLimitSpec,
) -> Result<(), RuleError> {
    // At most u32::MAX years: far inside a u64.
    let window_secs = unit.seconds() * u64::from(unit_multiplier);
    if window_secs > MAX_WINDOW_SECS {
        return Err(RuleError::WindowTooLong {
            rule: rule(),
            field,
            unit_multiplier,
            unit,
            window_secs,
        });
    }
    if algorithm.uses_burst() {
        let burst = spec
            .burst
            .unwrap_or_else(|| u64::from(spec.requests_per_unit));
        // A bucket refills `requests_per_unit` per window (one per window when that is 0, as the
        // algorithms count it for expiry).
        let per_window = u64::from(spec.requests_per_unit.max(1));
        if u128::from(window_secs) * u128::from(burst)
            > u128::from(MAX_WINDOW_SECS) * u128::from(per_window)
        {
            return Err(RuleError::RefillTooLong {
                rule: rule(),
                field,
                burst,
                per_window,
                window_secs,
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        algorithm::Params,
        rules::{error::ParseError, yaml::parse_file},
    };

    fn build(files: &[(&str, &str)], merge: bool) -> Result<RuleSet, String> {
        let parsed = files
            .iter()
            .map(|(name, text)| Ok((name.to_string(), parse_file(text)?)))
            .collect::<Result<Vec<_>, ParseError>>()
            .map_err(|e| format!("{}: {e}", files[0].0))?;
        RuleSet::build(&parsed, merge).map_err(|e| e.to_string())
    }

    fn build_err(text: &str) -> String {
        build(&[("config.f.yaml", text)], false).unwrap_err()
    }

    #[test]
    fn every_semantic_error_uses_the_reference_message() {
        let cases = [
            ("descriptors: []\n", "config.f.yaml: config file cannot have empty domain"),
            ("", "config.f.yaml: config file cannot have empty domain"),
            ("domain: d\ndescriptors:\n  - value: v\n", "config.f.yaml: descriptor has empty key"),
            (
                "domain: d\ndescriptors:\n  - key: a\n    value: b\n  - key: a\n    value: b\n",
                "config.f.yaml: duplicate descriptor composite key 'd.a_b'",
            ),
            (
                "domain: d\ndescriptors:\n  - key: a_b\n  - key: a\n    value: b\n",
                "config.f.yaml: duplicate descriptor composite key 'd.a_b'",
            ),
            (
                "domain: d\ndescriptors:\n  - key: a\n    descriptors:\n      - key: s\n      - key: s\n",
                "config.f.yaml: duplicate descriptor composite key 'd.a.s'",
            ),
            (
                "domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: fortnight, requests_per_unit: 1}\n",
                "config.f.yaml: invalid rate limit unit 'fortnight'",
            ),
            (
                "domain: d\ndescriptors:\n  - key: a\n    rate_limit: {requests_per_unit: 1}\n",
                "config.f.yaml: invalid rate limit unit ''",
            ),
            (
                "domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: second, unlimited: true}\n",
                "config.f.yaml: should not specify rate limit unit when unlimited",
            ),
            (
                "domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: second, requests_per_unit: 1, replaces: [{name: ''}]}\n",
                "config.f.yaml: should not have an empty replaces entry",
            ),
            (
                "domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: second, requests_per_unit: 1, name: x, replaces: [{name: x}]}\n",
                "config.f.yaml: replaces should not contain name of same descriptor",
            ),
            (
                "domain: d\ndescriptors:\n  - key: a\n    value: b\n    share_threshold: true\n",
                "config.f.yaml: share_threshold can only be used with wildcard values (containing '*'), but found key 'a_b'",
            ),
        ];
        for (text, want) in cases {
            assert_eq!(build_err(text), want, "{text}");
        }
    }

    #[test]
    fn extension_errors_name_the_file_the_rule_and_the_field() {
        let cases = [
            (
                "domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: second, requests_per_unit: 1, algorithm: leaky}\n",
                "config.f.yaml: rule 'd.a': rate_limit.algorithm: unknown algorithm 'leaky'; use one of fixed_window, sliding_window, sliding_log, token_bucket, gcra",
            ),
            (
                "domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: second, requests_per_unit: 1, burst: 5}\n",
                "config.f.yaml: rule 'd.a': rate_limit.burst: burst means nothing for fixed_window; it sets the capacity of token_bucket and gcra",
            ),
            (
                "domain: d\ndescriptors:\n  - key: a\n    value: b\n    rate_limits:\n      - {unit: second, requests_per_unit: 1}\n      - {unit: day, requests_per_unit: 9, unit_multiplier: 0}\n",
                "config.f.yaml: rule 'd.a_b': rate_limits[1].unit_multiplier: must be a whole number of at least 1, not 0",
            ),
            (
                "domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: hour, requests_per_unit: 100001, algorithm: sliding_log}\n",
                "config.f.yaml: rule 'd.a': rate_limit.requests_per_unit: a sliding_log keeps one entry per counted request; use at most 100000, or sliding_window",
            ),
            (
                "domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unlimited: true, count_over_limit: true}\n",
                "config.f.yaml: rule 'd.a': rate_limit.count_over_limit: an unlimited limit counts nothing",
            ),
            (
                "domain: d\ndescriptors:\n  - key: a\n    rate_limits: [{unlimited: true}]\n",
                "config.f.yaml: rule 'd.a': rate_limits[0]: unlimited belongs in rate_limit, not in rate_limits",
            ),
            (
                "domain: d\ndescriptors:\n  - {key: ip, value: \"cidr:10.1.0.0/8\"}\n",
                "config.f.yaml: rule 'd.ip_cidr:10.1.0.0/8': value: malformed CIDR 'cidr:10.1.0.0/8': host bits are set; the network is 10.0.0.0/8",
            ),
            (
                "domain: d\ndescriptors:\n  - {key: ip, value: \"cidr:10.0.0.0/33\"}\n",
                "config.f.yaml: rule 'd.ip_cidr:10.0.0.0/33': value: malformed CIDR 'cidr:10.0.0.0/33': prefix '/33' must be 0 to 32",
            ),
            (
                "domain: d\ndescriptors:\n  - {key: ip, value: \"cidr:x/1\"}\n",
                "config.f.yaml: rule 'd.ip_cidr:x/1': value: malformed CIDR 'cidr:x/1': 'x' is not an IP address",
            ),
        ];
        for (text, want) in cases {
            assert_eq!(build_err(text), want, "{text}");
        }
        let err = build_err(
            "domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: hour, burst: -1}\n",
        );
        assert!(err.contains("burst"), "{err}");
    }

    #[test]
    fn windows_and_refill_times_are_bounded_at_ten_years() {
        let limit = |body: &str| {
            format!("domain: d\ndescriptors:\n  - key: a\n    rate_limit: {{{body}}}\n")
        };
        for ok in [
            "unit: year, unit_multiplier: 10, requests_per_unit: 1",
            "unit: day, unit_multiplier: 3650, requests_per_unit: 1, algorithm: sliding_window",
            "unit: second, unit_multiplier: 315360000, requests_per_unit: 1, algorithm: gcra",
            "unit: second, requests_per_unit: 10, algorithm: token_bucket, burst: 3153600000",
            "unit_multiplier: 4294967295, unlimited: true",
        ] {
            let text = limit(ok);
            assert!(build(&[("f", &text)], false).is_ok(), "{ok}");
        }
        let cases = [
            (
                "unit: year, unit_multiplier: 11, requests_per_unit: 1",
                "f: rule 'd.a': rate_limit.unit_multiplier: a window of 11 x YEAR (346896000 seconds) is longer than the longest a limit may have, 10 years (315360000 seconds)",
            ),
            (
                "unit: year, unit_multiplier: 4294967295, requests_per_unit: 1, algorithm: sliding_log",
                "f: rule 'd.a': rate_limit.unit_multiplier: a window of 4294967295 x YEAR (135446088615120000 seconds) is longer than the longest a limit may have, 10 years (315360000 seconds)",
            ),
            (
                "unit: second, unit_multiplier: 315360001, requests_per_unit: 1",
                "f: rule 'd.a': rate_limit.unit_multiplier: a window of 315360001 x SECOND (315360001 seconds) is longer than the longest a limit may have, 10 years (315360000 seconds)",
            ),
            (
                "unit: year, requests_per_unit: 1, algorithm: gcra, burst: 4294967295",
                "f: rule 'd.a': rate_limit.burst: refilling a burst of 4294967295 at 1 per 31536000 seconds takes longer than the longest a limit may take to reset, 10 years (315360000 seconds); lower burst or the window, or raise requests_per_unit",
            ),
            (
                "unit: day, requests_per_unit: 0, algorithm: token_bucket, burst: 3651",
                "f: rule 'd.a': rate_limit.burst: refilling a burst of 3651 at 1 per 86400 seconds takes longer than the longest a limit may take to reset, 10 years (315360000 seconds); lower burst or the window, or raise requests_per_unit",
            ),
        ];
        for (body, want) in cases {
            assert_eq!(
                build(&[("f", &limit(body))], false).unwrap_err(),
                want,
                "{body}"
            );
        }
    }

    #[test]
    fn extensions_compile_into_limits() {
        let set = build(
            &[(
                "f",
                "domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: second, requests_per_unit: 10, algorithm: token_bucket, burst: 20}\n    rate_limits:\n      - {unit: minute, requests_per_unit: 100, unit_multiplier: 5, algorithm: sliding_window}\n",
            )],
            false,
        )
        .unwrap();
        let limits = &set.domains["d"].root.node("a", "").unwrap().limits;
        assert_eq!(limits.len(), 2);
        assert_eq!(
            limits[0].params(),
            Params {
                algorithm: Algorithm::TokenBucket,
                limit: 10,
                window_ms: 1000,
                burst: 20,
                count_over_limit: false,
            }
        );
        assert_eq!(limits[1].window_secs(), 300);
        assert_eq!(limits[1].burst, 100, "burst defaults to the limit");
        let gcra = RuleSet::build_with(
            &[("f".into(), parse_file("domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: second, requests_per_unit: 1}\n").unwrap())],
            false,
            Algorithm::Gcra,
        )
        .unwrap();
        assert_eq!(
            gcra.domains["d"].root.node("a", "").unwrap().limits[0].algorithm,
            Algorithm::Gcra,
            "the default algorithm applies"
        );
    }

    #[test]
    fn duplicate_domains_are_refused_unless_merging() {
        let a = ("config.a.yaml", "domain: d\ndescriptors:\n  - key: a\n");
        let b = ("config.b.yaml", "domain: d\ndescriptors:\n  - key: b\n");
        assert_eq!(
            build(&[a, b], false).unwrap_err(),
            "config.b.yaml: duplicate domain 'd' in config file (first declared in config.a.yaml)"
        );
        let merged = build(&[a, b], true).unwrap();
        let root = &merged.domains["d"].root;
        assert!(root.node("a", "").is_some() && root.node("b", "").is_some());
        let b_again = ("config.c.yaml", "domain: d\ndescriptors:\n  - key: a\n");
        assert_eq!(
            build(&[a, b_again], true).unwrap_err(),
            "config.c.yaml: duplicate descriptor composite key 'd.a'"
        );
    }

    #[test]
    fn all_units_and_special_limits_compile() {
        let set = build(
            &[(
                "f",
                "domain: d\ndescriptors:\n  - {key: s, rate_limit: {unit: second, requests_per_unit: 1}}\n  - {key: w, rate_limit: {unit: WEEK, requests_per_unit: 1}}\n  - {key: m, rate_limit: {unit: month, requests_per_unit: 1}}\n  - {key: y, rate_limit: {unit: year, requests_per_unit: 1}}\n  - {key: u, rate_limit: {unlimited: true}}\n  - {key: z, rate_limit: {unit: hour, requests_per_unit: 0}}\n",
            )],
            false,
        )
        .unwrap();
        let root = &set.domains["d"].root;
        let unit = |k: &str| root.node(k, "").unwrap().limit().unwrap().unit.seconds();
        assert_eq!(unit("s"), 1);
        assert_eq!(unit("w"), 604_800);
        assert_eq!(unit("m"), 2_592_000);
        assert_eq!(unit("y"), 31_536_000);
        assert!(root.node("u", "").unwrap().limit().unwrap().unlimited);
        assert_eq!(
            root.node("z", "")
                .unwrap()
                .limit()
                .unwrap()
                .requests_per_unit,
            0
        );
    }

    #[test]
    fn a_refused_rule_is_placed_by_its_name_and_first_line() {
        let place = |text: &str| {
            let file = parse_file(text).unwrap();
            let err = RuleSet::build(&[("f.yaml".into(), file)], false).unwrap_err();
            err.rule.map(|r| (r.name.clone(), r.line))
        };
        // The innermost rule at fault, not the one it is written under.
        assert_eq!(
            place("domain: d\ndescriptors:\n  - key: a\n    descriptors:\n      - key: b\n        rate_limit: {unit: eon, requests_per_unit: 1}\n"),
            Some(("d.a.b".into(), 5))
        );
        // The second of two rules written alike.
        assert_eq!(
            place("domain: d\ndescriptors:\n  - key: a\n  - key: b\n  - key: a\n"),
            Some(("d.a".into(), 5))
        );
        // A rule without a key: named by the rule it is under.
        assert_eq!(
            place("domain: d\ndescriptors:\n  - key: a\n    descriptors:\n      - value: x\n"),
            Some(("d.a".into(), 5))
        );
        // A rule brought in by an alias: where the alias is, not its anchor.
        assert_eq!(
            place("domain: d\ndescriptors:\n  - &r {key: a}\n  - key: b\n  - *r\n"),
            Some(("d.a".into(), 5))
        );
        // Not about a rule.
        assert_eq!(place("domain: ''\ndescriptors:\n  - key: a\n"), None);
    }
}
