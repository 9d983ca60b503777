//! Statuses: the store's outcomes -> one status per descriptor, the overall code and the headers.
//!
//! A descriptor checked against several limits is reported under the one closest to denying it. Shadow
//! rules are reported OK whatever their counter says; global shadow mode only turns the overall code OK.

use super::{
    headers,
    plan::{Applicable, Limits, Resolved},
    Code, CurrentLimit, DescriptorStatus, Options, Response, Small,
};
use crate::{
    rules::Node,
    store::{Outcome, Role},
};

/// The limit a limited descriptor is reported under, with what its counter said: what the metrics and
/// `/debug/top` record.
pub(super) struct Verdict<'a> {
    /// The descriptor's position in the request.
    pub index: usize,
    /// Its rule (none for an override or a runtime limit).
    pub node: Option<&'a Node>,
    /// Its limit is an operator's runtime limit.
    pub runtime: bool,
    pub role: Role,
    /// What the limit holds when full: its requests per unit, or its burst for `token_bucket` and
    /// `gcra` (what "near the limit" is measured against).
    pub limit: u64,
    /// The most hits its check is decided on: past what the limit could ever allow, one more.
    pub most_hits: u64,
    pub outcome: Outcome,
    /// The local deny cache answered at least one of the descriptor's checks.
    pub from_cache: bool,
    /// Its limit counts every hit (`count_over_limit`), also in a request that is denied.
    pub counts_over: bool,
}

/// Every descriptor's status, and what the headers and the metrics need besides.
pub(super) struct Decided<'a> {
    statuses: Vec<DescriptorStatus>,
    /// Per descriptor, the position among its limits of the one its status reports (none for a
    /// descriptor without one), for the IETF headers.
    reported: Small<Option<usize>>,
    /// One per limited descriptor that has an outcome.
    pub verdicts: Small<Verdict<'a>>,
}

/// Reads the outcomes (one per check, in the order of the batch; `from_cache` likewise) into statuses.
pub(super) fn choose<'a>(
    resolved: &[Resolved<'a>],
    outcomes: &[Outcome],
    from_cache: &[bool],
) -> Decided<'a> {
    let mut reported = Small::new();
    let mut verdicts = Small::new();
    let mut check = 0;
    let statuses = resolved
        .iter()
        .enumerate()
        .map(|(index, r)| match *r {
            Resolved::NoLimit => {
                reported.push(None);
                DescriptorStatus::no_limit()
            }
            Resolved::Unlimited(_) => {
                reported.push(None);
                DescriptorStatus::unlimited()
            }
            Resolved::Limited {
                ref limits,
                node,
                role,
            } => {
                let checks = check..check + limits.len();
                check = checks.end;
                let from_cache = from_cache
                    .get(checks.clone())
                    .is_some_and(|c| c.contains(&true));
                let outcomes = outcomes.get(checks).unwrap_or_default();
                let Some((nth, applicable, outcome)) = closest(limits, outcomes) else {
                    reported.push(None);
                    return DescriptorStatus::no_limit();
                };
                reported.push(Some(nth));
                verdicts.push(Verdict {
                    index,
                    node,
                    // Runtime limits come as the limit of no rule (see `plan::resolve_one`).
                    runtime: node.is_none() && matches!(applicable, Applicable::Rule { .. }),
                    role,
                    limit: applicable.params().capacity(),
                    most_hits: applicable.params().bounded_cost(u64::MAX),
                    outcome,
                    from_cache,
                    counts_over: applicable.params().count_over_limit,
                });
                status(applicable.current_limit(), outcome, role)
            }
        })
        .collect();
    Decided {
        statuses,
        reported,
        verdicts,
    }
}

impl Decided<'_> {
    /// The answer: the statuses, the overall code and the headers for the caller's response
    /// (`resolved` is what the statuses were chosen from).
    pub fn into_response(
        self,
        resolved: &[Resolved<'_>],
        options: &Options,
        denied: bool,
    ) -> Response {
        let overall_code = overall(denied, options.shadow_mode);
        let response_headers = headers::build(
            options.response_headers,
            &options.header_names,
            &self.statuses,
            resolved,
            &self.reported,
            overall_code,
            options.quota_mode,
        );
        Response {
            overall_code,
            statuses: self.statuses,
            response_headers,
        }
    }
}

/// The descriptor's limit closest to denying, with its position and outcome: a denying one (the longest
/// wait first), else the one with the least quota left. `outcomes` are the limits' own, in order.
fn closest<'a>(
    limits: &Limits<'a>,
    outcomes: &[Outcome],
) -> Option<(usize, Applicable<'a>, Outcome)> {
    let mut chosen: Option<(usize, Applicable<'a>, Outcome)> = None;
    for (nth, (&applicable, &outcome)) in limits.iter().zip(outcomes).enumerate() {
        let closer =
            chosen
                .as_ref()
                .is_none_or(|(_, _, best)| match (outcome.allowed, best.allowed) {
                    (false, true) => true,
                    (false, false) => outcome.retry_after > best.retry_after,
                    (true, true) => outcome.remaining < best.remaining,
                    (true, false) => false,
                });
        if closer {
            chosen = Some((nth, applicable, outcome));
        }
    }
    chosen
}

/// A limited descriptor's status under its reported limit.
fn status(limit: CurrentLimit, outcome: Outcome, role: Role) -> DescriptorStatus {
    let over = !outcome.allowed && role != Role::Shadow;
    DescriptorStatus {
        code: if over { Code::OverLimit } else { Code::Ok },
        current_limit: Some(limit),
        limit_remaining: u32::try_from(outcome.remaining).unwrap_or(u32::MAX),
        duration_until_reset: Some(outcome.reset_after),
        retry_after: (!outcome.allowed).then_some(outcome.retry_after),
    }
}

/// The request's code: OVER_LIMIT when denied, unless global shadow mode answers OK regardless.
pub(super) fn overall(denied: bool, shadow_mode: bool) -> Code {
    if denied && !shadow_mode {
        Code::OverLimit
    } else {
        Code::Ok
    }
}

/// The statuses when the store could not decide and the policy answers anyway: every enforced (or
/// quota) descriptor over its first limit when `deny`, else every descriptor without a limit, since
/// nothing was counted.
pub(super) fn undecided(resolved: &[Resolved<'_>], deny: bool) -> Vec<DescriptorStatus> {
    resolved
        .iter()
        .map(|r| match r {
            Resolved::NoLimit => DescriptorStatus::no_limit(),
            Resolved::Unlimited(_) => DescriptorStatus::unlimited(),
            Resolved::Limited { limits, role, .. } if deny && *role != Role::Shadow => {
                DescriptorStatus {
                    code: Code::OverLimit,
                    current_limit: limits.first().map(Applicable::current_limit),
                    limit_remaining: 0,
                    duration_until_reset: None,
                    retry_after: None,
                }
            }
            Resolved::Limited { .. } => DescriptorStatus::no_limit(),
        })
        .collect()
}
