//! Rate limit headers for the caller's response.
//!
//! `envoy` mode is the reference service's: three headers (limit, remaining, reset) describing one
//! descriptor, the one with the least quota left, or the (last) enforced descriptor that is over its
//! limit. Whenever headers are on, an OVER_LIMIT answer also carries `Retry-After`.

use super::{Code, DescriptorStatus};
use crate::{
    settings::{HeaderNames, ResponseHeaders},
    store::Role,
};

pub(super) fn build(
    mode: ResponseHeaders,
    names: &HeaderNames,
    statuses: &[DescriptorStatus],
    roles: &[Option<Role>],
    overall: Code,
) -> Vec<(String, String)> {
    match mode {
        ResponseHeaders::Off => Vec::new(),
        ResponseHeaders::Envoy => envoy(names, statuses, roles, overall),
    }
}

fn envoy(
    names: &HeaderNames,
    statuses: &[DescriptorStatus],
    roles: &[Option<Role>],
    overall: Code,
) -> Vec<(String, String)> {
    let mut chosen: Option<&DescriptorStatus> = None;
    let mut over: Option<&DescriptorStatus> = None;
    for (status, role) in statuses.iter().zip(roles) {
        let Some(role) = role else { continue };
        if chosen.is_none_or(|c| status.limit_remaining < c.limit_remaining) {
            chosen = Some(status);
        }
        if status.code == Code::OverLimit && *role != Role::Quota {
            over = Some(status);
        }
    }
    let Some(status) = over.or(chosen) else {
        return Vec::new();
    };
    let (Some(limit), Some(reset)) = (&status.current_limit, status.duration_until_reset) else {
        return Vec::new();
    };
    let mut headers = vec![
        (names.limit.clone(), limit.requests_per_unit.to_string()),
        (names.remaining.clone(), status.limit_remaining.to_string()),
        (names.reset.clone(), reset.to_string()),
    ];
    if overall == Code::OverLimit {
        let retry_after = statuses
            .iter()
            .filter(|s| s.code == Code::OverLimit)
            .filter_map(|s| s.retry_after.or(s.duration_until_reset))
            .max()
            .unwrap_or(reset);
        headers.push(("Retry-After".into(), retry_after.to_string()));
    }
    headers
}
