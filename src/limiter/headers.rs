//! Rate limit headers for the caller's response.
//!
//! `envoy` mode is the reference service's: three headers (limit, remaining, reset) describing one
//! descriptor, the one with the least quota left, or the (last) enforced descriptor that is over its
//! limit. `ietf` mode sends the fields of the IETF httpapi ratelimit-headers draft: `RateLimit-Policy`
//! lists every limit that applied, each limit of each descriptor (`"name";q=<quota>;w=<window seconds>`),
//! and `RateLimit` describes the
//! same descriptor as `envoy` mode (`"name";r=<remaining>;t=<seconds to reset>`). Whenever headers are
//! on, an OVER_LIMIT answer also carries `Retry-After`.

use super::{
    plan::{passes_as_quota, Resolved},
    Code, DescriptorStatus, HeaderNames, ResponseHeaders,
};
use crate::store::Role;

/// The headers of an answer with these statuses, chosen from `resolved` (each descriptor's limits and
/// role); `reported` holds, per descriptor, the position among its limits of the one its status reports.
pub(super) fn build(
    mode: ResponseHeaders,
    names: &HeaderNames,
    statuses: &[DescriptorStatus],
    resolved: &[Resolved<'_>],
    reported: &[Option<usize>],
    overall: Code,
    quota_mode: bool,
) -> Vec<(String, String)> {
    if mode == ResponseHeaders::Off {
        return Vec::new();
    }
    let Some((index, status)) = closest(statuses, resolved) else {
        return Vec::new();
    };
    let (Some(limit), Some(reset)) = (&status.current_limit, status.duration_until_reset) else {
        return Vec::new();
    };
    let mut headers = match mode {
        ResponseHeaders::Off => return Vec::new(),
        ResponseHeaders::Envoy => vec![
            (names.limit.clone(), limit.requests_per_unit.to_string()),
            (names.remaining.clone(), status.limit_remaining.to_string()),
            (names.reset.clone(), reset.to_string()),
        ],
        ResponseHeaders::Ietf => {
            let mut policies = Vec::new();
            let mut chosen_name = String::new();
            for (i, (r, reported)) in resolved.iter().zip(reported).enumerate() {
                let (Resolved::Limited { limits, node, .. }, Some(reported)) = (r, reported) else {
                    continue;
                };
                for (nth, limit) in limits.iter().enumerate() {
                    // Named by its place in its rule, which `replaces` dropping another leaves as it is
                    // (an override or a runtime limit is its descriptor's only limit).
                    let in_rule = if node.is_some() { limit.index() } else { 0 };
                    let name = policy_name(limit.name().map(|n| &**n), i, in_rule);
                    let window = limit.params().window_ms / 1000;
                    policies.push(format!("{name};q={};w={window}", limit.requests_per_unit()));
                    if i == index && nth == *reported {
                        chosen_name = name;
                    }
                }
            }
            vec![
                ("RateLimit-Policy".into(), policies.join(", ")),
                (
                    "RateLimit".into(),
                    format!("{chosen_name};r={};t={reset}", status.limit_remaining),
                ),
            ]
        }
    };
    if overall == Code::OverLimit {
        headers.push((
            "Retry-After".into(),
            retry_after(statuses, resolved, quota_mode)
                .unwrap_or(reset)
                .to_string(),
        ));
    }
    headers
}

/// How long before the same request could be allowed: every enforced descriptor over its limit must
/// free (the longest of their waits), and when the quota descriptors deny it (all over, and none passing
/// as one: see [`passes_as_quota`]), one of them must free too (the shortest of theirs).
fn retry_after(
    statuses: &[DescriptorStatus],
    resolved: &[Resolved<'_>],
    quota_mode: bool,
) -> Option<u64> {
    let pairs = || statuses.iter().zip(resolved);
    let wait =
        |(s, _): (&DescriptorStatus, &Resolved<'_>)| s.retry_after.or(s.duration_until_reset);
    let quota = |(_, r): &(&DescriptorStatus, &Resolved<'_>)| r.role() == Some(Role::Quota);
    let over = |(s, _): &(&DescriptorStatus, &Resolved<'_>)| s.code == Code::OverLimit;
    let enforced = pairs()
        .filter(|pair| over(pair) && !quota(pair))
        .filter_map(wait)
        .max();
    let quota_denies = !passes_as_quota(resolved, quota_mode)
        && pairs().any(|pair| quota(&pair))
        && pairs().filter(quota).all(|pair| over(&pair));
    let first_quota = quota_denies
        .then(|| pairs().filter(quota).filter_map(wait).min())
        .flatten();
    enforced.max(first_quota)
}

/// A policy name as a structured-field string: the limit's `name`, or `d<descriptor index>` (a further
/// limit of its rule `d<descriptor index>.<its position in the rule>`).
fn policy_name(name: Option<&str>, index: usize, in_rule: usize) -> String {
    let raw = match (name, in_rule) {
        (Some(name), _) => name.to_owned(),
        (None, 0) => format!("d{index}"),
        (None, in_rule) => format!("d{index}.{in_rule}"),
    };
    let escaped: String = raw
        .chars()
        .filter(|c| (' '..='~').contains(c))
        .flat_map(|c| match c {
            '"' | '\\' => vec!['\\', c],
            c => vec![c],
        })
        .collect();
    format!("\"{escaped}\"")
}

/// The status the single-descriptor headers describe: the (last) enforced descriptor over its limit,
/// else the first with the least quota left.
fn closest<'a>(
    statuses: &'a [DescriptorStatus],
    resolved: &[Resolved<'_>],
) -> Option<(usize, &'a DescriptorStatus)> {
    let mut chosen: Option<(usize, &DescriptorStatus)> = None;
    let mut over: Option<(usize, &DescriptorStatus)> = None;
    for (i, (status, r)) in statuses.iter().zip(resolved).enumerate() {
        let Some(role) = r.role() else { continue };
        if chosen.is_none_or(|(_, c)| status.limit_remaining < c.limit_remaining) {
            chosen = Some((i, status));
        }
        if status.code == Code::OverLimit && role != Role::Quota {
            over = Some((i, status));
        }
    }
    over.or(chosen)
}
