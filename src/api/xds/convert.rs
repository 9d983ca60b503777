//! A control plane's response to a rule set: each `RateLimitConfig` resource becomes what a rules file
//! of the same content would parse into, named by the resource's `name`, and the whole set is compiled
//! as files are (all or nothing, `MERGE_DOMAIN_CONFIG` honoured), with the same messages.
//!
//! Units travel as enum numbers and are given to the rules as the enum's name, so a missing unit reads
//! `invalid rate limit unit 'UNKNOWN'`, as the reference says it.

use prost::Message;

use crate::{
    algorithm::Algorithm,
    proto::xds::{
        RateLimitConfig, RateLimitDescriptor, RateLimitPolicy, RateLimitUnit,
        RATE_LIMIT_CONFIG_TYPE,
    },
    rules::{
        DescriptorSpec, DomainFile, Fingerprint, LoadError, Loaded, ParseError, RateLimitSpec,
        RuleFlags,
    },
};

/// Why a response's rule set was refused: the NACK's message.
#[derive(Debug, thiserror::Error)]
pub enum RefusedSet {
    /// A resource that is not a `RateLimitConfig`.
    #[error("resource {index}: not a RateLimitConfig but {type_url}")]
    Type { index: usize, type_url: String },
    #[error("resource {index}: not a valid RateLimitConfig: {reason}")]
    Decode { index: usize, reason: String },
    /// Compiling failed without an answer (a bug: it panicked).
    #[error("the rules were not compiled: {0}")]
    Interrupted(String),
    /// The rules themselves, with the message a rules file would get, prefixed by the resource's name.
    #[error(transparent)]
    Rules(#[from] LoadError),
}

/// How a rule set is compiled: as the rules files would be.
#[derive(Debug, Clone, Copy)]
pub struct Compile {
    pub merge_domains: bool,
    pub default_algorithm: Algorithm,
}

/// A hash of a response's resources, whatever their order: equal fingerprints, equal rules. Taken before
/// anything is decoded, so that a set sent again is known without compiling it. Control planes list a
/// set's resources in no set order (go-control-plane ranges over a map), so an unchanged set may come
/// in another order on every response.
pub fn fingerprint(resources: &[prost_types::Any]) -> u64 {
    let mut sorted: Vec<&prost_types::Any> = resources.iter().collect();
    sorted.sort_unstable_by(|a, b| (&a.type_url, &a.value).cmp(&(&b.type_url, &b.value)));
    let mut fingerprint = Fingerprint::default();
    for resource in sorted {
        fingerprint.add(resource.type_url.as_bytes());
        fingerprint.add(&resource.value);
    }
    fingerprint.finish()
}

/// The rule set of a response's resources, compiled whole, in the order of their names (as rules files
/// are, by theirs): which of two resources of one domain a message names, or merges first, does not
/// depend on the order they came in.
pub fn rule_set(resources: &[prost_types::Any], compile: Compile) -> Result<Loaded, RefusedSet> {
    let mut parsed = Vec::with_capacity(resources.len());
    for (index, resource) in resources.iter().enumerate() {
        if resource.type_url != RATE_LIMIT_CONFIG_TYPE {
            return Err(RefusedSet::Type {
                index,
                type_url: resource.type_url.clone(),
            });
        }
        let config =
            RateLimitConfig::decode(resource.value.as_slice()).map_err(|e| RefusedSet::Decode {
                index,
                reason: e.to_string(),
            })?;
        // A resource without a name is still named in messages: by its place in the response.
        let name = if config.name.is_empty() {
            format!("resource {index}")
        } else {
            config.name.clone()
        };
        let file = domain_file(&config).map_err(|source| LoadError::Parse {
            file: name.clone(),
            source,
        })?;
        parsed.push((name, file, &resource.value));
    }
    parsed.sort_by(|a, b| (&a.0, a.2).cmp(&(&b.0, b.2)));
    let parsed = parsed
        .into_iter()
        .map(|(name, file, _)| (name, file))
        .collect();
    Loaded::build(
        parsed,
        fingerprint(resources),
        compile.merge_domains,
        compile.default_algorithm,
    )
    .map_err(|e| RefusedSet::Rules(e.into()))
}

/// What a rules file with the content of `config` would parse into.
pub fn domain_file(config: &RateLimitConfig) -> Result<DomainFile, ParseError> {
    Ok(DomainFile {
        domain: config.domain.clone(),
        descriptors: descriptors(&config.descriptors)?,
        // A resource's fields are typed: none is misplaced.
        ignored: Vec::new(),
    })
}

fn descriptors(list: &[RateLimitDescriptor]) -> Result<Vec<DescriptorSpec>, ParseError> {
    list.iter().map(descriptor).collect()
}

fn descriptor(d: &RateLimitDescriptor) -> Result<DescriptorSpec, ParseError> {
    Ok(DescriptorSpec {
        key: d.key.clone(),
        value: d.value.clone(),
        rate_limit: d.rate_limit.as_ref().map(policy),
        rate_limits: Vec::new(),
        descriptors: descriptors(&d.descriptors)?,
        flags: RuleFlags {
            shadow_mode: d.shadow_mode,
            quota_mode: d.quota_mode,
            detailed_metric: d.detailed_metric,
            ..RuleFlags::default()
        },
        metadata: d.metadata.as_ref().map(object).transpose()?,
        line: 0,
    })
}

fn policy(p: &RateLimitPolicy) -> RateLimitSpec {
    RateLimitSpec {
        unit: unit_name(p.unit),
        requests_per_unit: p.requests_per_unit,
        unlimited: p.unlimited,
        name: p.name.clone(),
        replaces: p.replaces.iter().map(|r| r.name.clone()).collect(),
        ..RateLimitSpec::default()
    }
}

/// The unit as a rules file would write it: the enum's name, or the number when it names none.
fn unit_name(unit: i32) -> String {
    RateLimitUnit::try_from(unit)
        .map_or_else(|_| unit.to_string(), |unit| unit.as_str_name().to_owned())
}

/// A protobuf `Struct` as the JSON object `metadata` holds.
fn object(
    s: &prost_types::Struct,
) -> Result<serde_json::Map<String, serde_json::Value>, ParseError> {
    s.fields
        .iter()
        .map(|(k, v)| Ok((k.clone(), json(v)?)))
        .collect()
}

fn json(v: &prost_types::Value) -> Result<serde_json::Value, ParseError> {
    use prost_types::value::Kind;
    use serde_json::Value;
    Ok(match &v.kind {
        None | Some(Kind::NullValue(_)) => Value::Null,
        Some(Kind::BoolValue(b)) => Value::Bool(*b),
        Some(Kind::NumberValue(n)) => serde_json::Number::from_f64(*n)
            .map(Value::Number)
            .ok_or(ParseError::MetadataNotFinite(*n))?,
        Some(Kind::StringValue(s)) => Value::String(s.clone()),
        Some(Kind::ListValue(list)) => {
            Value::Array(list.values.iter().map(json).collect::<Result<_, _>>()?)
        }
        Some(Kind::StructValue(s)) => Value::Object(object(s)?),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::xds::RateLimitReplace;

    fn any(config: &RateLimitConfig) -> prost_types::Any {
        prost_types::Any {
            type_url: RATE_LIMIT_CONFIG_TYPE.into(),
            value: config.encode_to_vec(),
        }
    }

    fn limited(key: &str, unit: RateLimitUnit, n: u32) -> RateLimitDescriptor {
        RateLimitDescriptor {
            key: key.into(),
            rate_limit: Some(RateLimitPolicy {
                unit: unit as i32,
                requests_per_unit: n,
                ..RateLimitPolicy::default()
            }),
            ..RateLimitDescriptor::default()
        }
    }

    const COMPILE: Compile = Compile {
        merge_domains: false,
        default_algorithm: Algorithm::FixedWindow,
    };

    #[test]
    fn a_resource_reads_like_the_rules_file_it_stands_for() {
        let config = RateLimitConfig {
            name: "gateway/httproute/api".into(),
            domain: "api".into(),
            descriptors: vec![RateLimitDescriptor {
                value: "GET".into(),
                shadow_mode: true,
                descriptors: vec![limited("user", RateLimitUnit::Week, 5)],
                ..limited("method", RateLimitUnit::Minute, 10)
            }],
        };
        let file = domain_file(&config).unwrap();
        let written = crate::rules::parse_file(
            "domain: api\ndescriptors:\n  - key: method\n    value: GET\n    shadow_mode: true\n    rate_limit: {unit: MINUTE, requests_per_unit: 10}\n    descriptors:\n      - key: user\n        rate_limit: {unit: WEEK, requests_per_unit: 5}\n",
        )
        .unwrap();
        // Rules from xDS have no lines in a file.
        fn unplaced(specs: &mut [crate::rules::DescriptorSpec]) {
            for spec in specs {
                spec.line = 0;
                unplaced(&mut spec.descriptors);
            }
        }
        let mut written = written;
        unplaced(&mut written.descriptors);
        assert_eq!(file, written);
    }

    #[test]
    fn refusals_carry_the_rules_file_message_prefixed_by_the_resource_name() {
        let good = RateLimitConfig {
            name: "good".into(),
            domain: "a".into(),
            descriptors: vec![limited("k", RateLimitUnit::Second, 1)],
        };
        let cases = [
            (
                RateLimitConfig {
                    name: "no-unit".into(),
                    domain: "b".into(),
                    descriptors: vec![limited("k", RateLimitUnit::Unknown, 1)],
                },
                "no-unit: invalid rate limit unit 'UNKNOWN'",
            ),
            (
                RateLimitConfig {
                    name: "again".into(),
                    ..good.clone()
                },
                // Taken in the order of their names: "again" first, then "good" repeats its domain.
                "good: duplicate domain 'a' in config file (first declared in again)",
            ),
            (
                RateLimitConfig {
                    name: "self".into(),
                    domain: "c".into(),
                    descriptors: vec![RateLimitDescriptor {
                        rate_limit: Some(RateLimitPolicy {
                            unit: RateLimitUnit::Hour as i32,
                            name: "n".into(),
                            replaces: vec![RateLimitReplace { name: "n".into() }],
                            ..RateLimitPolicy::default()
                        }),
                        key: "k".into(),
                        ..RateLimitDescriptor::default()
                    }],
                },
                "self: replaces should not contain name of same descriptor",
            ),
            (
                RateLimitConfig {
                    domain: "d".into(),
                    descriptors: vec![limited("", RateLimitUnit::Day, 1)],
                    ..RateLimitConfig::default()
                },
                "resource 1: descriptor has empty key",
            ),
        ];
        for (bad, want) in cases {
            let err = rule_set(&[any(&good), any(&bad)], COMPILE).unwrap_err();
            assert_eq!(err.to_string(), want);
        }
        let merged = rule_set(
            &[
                any(&good),
                any(&RateLimitConfig {
                    name: "more".into(),
                    descriptors: vec![limited("j", RateLimitUnit::Second, 1)],
                    ..good.clone()
                }),
            ],
            Compile {
                merge_domains: true,
                ..COMPILE
            },
        )
        .unwrap();
        assert_eq!(merged.files, ["good", "more"]);
        assert_eq!(merged.rules.domains.len(), 1);
    }

    #[test]
    fn resources_that_are_not_rule_sets_are_refused() {
        let wrong = prost_types::Any {
            type_url: "type.googleapis.com/envoy.config.cluster.v3.Cluster".into(),
            value: Vec::new(),
        };
        assert_eq!(
            rule_set(&[wrong], COMPILE).unwrap_err().to_string(),
            "resource 0: not a RateLimitConfig but type.googleapis.com/envoy.config.cluster.v3.Cluster"
        );
        let garbage = prost_types::Any {
            type_url: RATE_LIMIT_CONFIG_TYPE.into(),
            value: vec![0xff, 0xff, 0xff],
        };
        let err = rule_set(&[garbage], COMPILE).unwrap_err().to_string();
        assert!(
            err.starts_with("resource 0: not a valid RateLimitConfig: "),
            "{err}"
        );
        let nan = RateLimitConfig {
            name: "meta".into(),
            domain: "m".into(),
            descriptors: vec![RateLimitDescriptor {
                key: "k".into(),
                metadata: Some(prost_types::Struct {
                    fields: [(
                        "x".to_string(),
                        prost_types::Value {
                            kind: Some(prost_types::value::Kind::NumberValue(f64::NAN)),
                        },
                    )]
                    .into(),
                }),
                ..RateLimitDescriptor::default()
            }],
        };
        assert_eq!(
            rule_set(&[any(&nan)], COMPILE).unwrap_err().to_string(),
            "meta: error parsing metadata: NaN is not a finite number"
        );
    }

    #[test]
    fn the_same_resources_have_the_same_fingerprint() {
        let a = RateLimitConfig {
            name: "a".into(),
            domain: "a".into(),
            descriptors: vec![limited("k", RateLimitUnit::Second, 1)],
        };
        let b = RateLimitConfig {
            descriptors: vec![limited("k", RateLimitUnit::Second, 2)],
            ..a.clone()
        };
        let print = |c: &RateLimitConfig| rule_set(&[any(c)], COMPILE).unwrap().fingerprint;
        assert_eq!(print(&a), print(&a));
        assert_ne!(print(&a), print(&b));
        // Known before compiling, from the resources as they came, in whatever order.
        assert_eq!(fingerprint(&[any(&a)]), print(&a));
        assert_eq!(
            fingerprint(&[any(&a), any(&b)]),
            fingerprint(&[any(&b), any(&a)])
        );
        assert_ne!(fingerprint(&[any(&a), any(&b)]), fingerprint(&[any(&a)]));
    }
}
