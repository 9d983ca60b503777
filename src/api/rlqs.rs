//! `envoy.service.rate_limit_quota.v3.RateLimitQuotaService` over tonic, and the wire <-> domain
//! conversions of its messages.
//!
//! Each stream has a task of the server's own that reads the Envoy's usage reports and hands them to
//! the quota service; the response stream sends whatever actions the service queues for the stream, its
//! answers and the shares other streams' reports freed. A stream ends when the Envoy closes it, when it
//! sends nothing for ten report periods, or when the server drains (UNAVAILABLE, so that the Envoy opens a
//! new one, on another replica).

use std::{
    pin::Pin,
    sync::{Arc, Mutex},
    time::Duration,
};

use futures_util::Stream as FuturesStream;
use tokio_util::{sync::CancellationToken, task::TaskTracker};
use tonic::{Code, Request, Response, Status, Streaming};

use crate::{
    proto::rlqs::{
        rate_limit_quota_response::{bucket_action, BucketAction as WireAction},
        rate_limit_quota_service_server::{RateLimitQuotaService, RateLimitQuotaServiceServer},
        rate_limit_strategy::{self, BlanketRule},
        BucketId, RateLimitQuotaResponse, RateLimitQuotaUsageReports, RateLimitStrategy,
        TokenBucket,
    },
    quota::{lock, Action, BucketAction, Quota, Report, Strategy, Usage},
};

/// A stream that sends nothing for this many report periods is closed.
const IDLE_PERIODS: u32 = 10;

/// The gRPC rate limit quota service.
#[derive(Debug, Clone)]
pub struct RateLimitQuotaApi {
    quota: Arc<Quota>,
    /// Where each stream's reading task runs: the server's own tasks, drained at shutdown.
    tasks: TaskTracker,
    /// Cancelled when the server drains: every stream ends.
    stop: CancellationToken,
}

impl RateLimitQuotaApi {
    pub fn new(quota: Arc<Quota>, tasks: TaskTracker, stop: CancellationToken) -> Self {
        Self { quota, tasks, stop }
    }

    pub fn into_server(self) -> RateLimitQuotaServiceServer<Self> {
        let max = self.quota.settings().max_message_bytes;
        RateLimitQuotaServiceServer::new(self).max_decoding_message_size(max)
    }
}

type ResponseStream =
    Pin<Box<dyn FuturesStream<Item = Result<RateLimitQuotaResponse, Status>> + Send>>;

#[tonic::async_trait]
impl RateLimitQuotaService for RateLimitQuotaApi {
    type StreamRateLimitQuotasStream = ResponseStream;

    async fn stream_rate_limit_quotas(
        &self,
        request: Request<Streaming<RateLimitQuotaUsageReports>>,
    ) -> Result<Response<ResponseStream>, Status> {
        let stream = self
            .quota
            .open()
            .map_err(|e| Status::resource_exhausted(e.to_string()))?;
        let actions = stream.actions();
        // Why the stream ended, for the response's status; set before the stream is dropped.
        let ending: Arc<Mutex<Option<Status>>> = Arc::default();
        let idle = self
            .quota
            .settings()
            .report_period
            .saturating_mul(IDLE_PERIODS);
        let (stop, end) = (self.stop.clone(), ending.clone());
        let max_bytes = self.quota.settings().max_message_bytes;
        let mut inbound = request.into_inner();
        self.tasks.spawn(async move {
            let why = loop {
                tokio::select! {
                    _ = stop.cancelled() => {
                        break Some(Status::unavailable(
                            "ratelimitd is shutting down: open a new stream",
                        ));
                    }
                    next = tokio::time::timeout(idle, inbound.message()) => match next {
                        Err(_) => break Some(Status::unavailable(format!(
                            "no usage report for {}: open a new stream",
                            humantime::format_duration(idle)
                        ))),
                        Ok(Ok(Some(reports))) => {
                            if let Err(refused) = stream.report(from_wire(reports)).await {
                                break Some(Status::invalid_argument(refused.to_string()));
                            }
                        }
                        Ok(Ok(None)) => break None,
                        Ok(Err(status)) => break Some(refusal(status, max_bytes)),
                    },
                }
            };
            *lock(&end) = why;
            drop(stream);
        });
        let responses = futures_util::stream::unfold(Some(actions), move |actions| {
            let ending = ending.clone();
            async move {
                let actions = actions?;
                match actions.next().await {
                    Some(list) => Some((Ok(to_wire(list)), Some(actions))),
                    None => {
                        let why = lock(&ending).take();
                        why.map(|status| (Err(status), None))
                    }
                }
            }
        });
        Ok(Response::new(Box::pin(responses)))
    }
}

/// Why reading the stream failed, as the Envoy is told: a report over `rlqs.max_message_bytes` (which
/// tonic's decoder refuses as OUT_OF_RANGE, or RESOURCE_EXHAUSTED once decompressed: the only statuses
/// it ends a stream's reading with for a message's size) is RESOURCE_EXHAUSTED naming the setting;
/// anything else as tonic saw it.
fn refusal(status: Status, max_bytes: usize) -> Status {
    if matches!(status.code(), Code::OutOfRange | Code::ResourceExhausted) {
        Status::resource_exhausted(format!(
            "usage report larger than {max_bytes} bytes (rlqs.max_message_bytes)"
        ))
    } else {
        status
    }
}

/// A report as the quota service takes it: bucket ids as sorted entries, durations never negative.
pub fn from_wire(reports: RateLimitQuotaUsageReports) -> Report {
    Report {
        domain: reports.domain,
        usages: reports
            .bucket_quota_usages
            .into_iter()
            .map(|usage| {
                let mut bucket: Vec<(String, String)> = usage
                    .bucket_id
                    .map(|id| id.bucket.into_iter().collect())
                    .unwrap_or_default();
                bucket.sort();
                Usage {
                    bucket,
                    elapsed: usage.time_elapsed.map_or(Duration::ZERO, duration),
                    allowed: usage.num_requests_allowed,
                    denied: usage.num_requests_denied,
                }
            })
            .collect(),
    }
}

/// A protobuf duration, negative parts read as zero.
fn duration(d: prost_types::Duration) -> Duration {
    let secs = u64::try_from(d.seconds).unwrap_or(0);
    let nanos = u32::try_from(d.nanos).unwrap_or(0).min(999_999_999);
    Duration::new(secs, nanos)
}

/// Actions as one response.
pub fn to_wire(actions: Vec<BucketAction>) -> RateLimitQuotaResponse {
    RateLimitQuotaResponse {
        bucket_action: actions
            .into_iter()
            .map(|a| WireAction {
                bucket_id: Some(BucketId {
                    bucket: a.bucket.into_iter().collect(),
                }),
                bucket_action: Some(match a.action {
                    Action::Abandon => {
                        bucket_action::BucketAction::AbandonAction(bucket_action::AbandonAction {})
                    }
                    Action::Assign { strategy, ttl_secs } => {
                        bucket_action::BucketAction::QuotaAssignmentAction(
                            bucket_action::QuotaAssignmentAction {
                                assignment_time_to_live: Some(prost_types::Duration {
                                    seconds: i64::try_from(ttl_secs).unwrap_or(i64::MAX),
                                    nanos: 0,
                                }),
                                rate_limit_strategy: Some(strategy_to_wire(strategy)),
                            },
                        )
                    }
                }),
            })
            .collect(),
    }
}

fn strategy_to_wire(strategy: Strategy) -> RateLimitStrategy {
    let strategy = match strategy {
        Strategy::AllowAll => {
            rate_limit_strategy::Strategy::BlanketRule(BlanketRule::AllowAll as i32)
        }
        Strategy::DenyAll => {
            rate_limit_strategy::Strategy::BlanketRule(BlanketRule::DenyAll as i32)
        }
        Strategy::TokenBucket(b) => rate_limit_strategy::Strategy::TokenBucket(TokenBucket {
            max_tokens: b.max_tokens,
            tokens_per_fill: Some(b.tokens_per_fill),
            fill_interval: Some(prost_types::Duration {
                seconds: i64::from(b.fill_interval_secs),
                nanos: 0,
            }),
        }),
    };
    RateLimitStrategy {
        strategy: Some(strategy),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::rlqs::rate_limit_quota_usage_reports::BucketQuotaUsage;

    #[test]
    fn a_report_too_large_is_refused_by_its_code_naming_the_setting() {
        for refused in [
            Status::out_of_range("any text"),
            Status::resource_exhausted("any other text"),
        ] {
            let told = refusal(refused, 4096);
            assert_eq!(told.code(), Code::ResourceExhausted);
            assert_eq!(
                told.message(),
                "usage report larger than 4096 bytes (rlqs.max_message_bytes)"
            );
        }
        let other = refusal(Status::internal("broken frame"), 4096);
        assert_eq!(
            (other.code(), other.message()),
            (Code::Internal, "broken frame")
        );
    }

    #[test]
    fn reports_read_with_sorted_buckets_and_no_negative_time() {
        let report = from_wire(RateLimitQuotaUsageReports {
            domain: "edge".into(),
            bucket_quota_usages: vec![BucketQuotaUsage {
                bucket_id: Some(BucketId {
                    bucket: [("b", "2"), ("a", "1")]
                        .into_iter()
                        .map(|(k, v)| (k.into(), v.into()))
                        .collect(),
                }),
                time_elapsed: Some(prost_types::Duration {
                    seconds: -5,
                    nanos: -1,
                }),
                num_requests_allowed: 3,
                num_requests_denied: 4,
            }],
        });
        let usage = &report.usages[0];
        assert_eq!(
            usage.bucket,
            vec![("a".into(), "1".into()), ("b".into(), "2".into())]
        );
        assert_eq!(usage.elapsed, Duration::ZERO);
        assert_eq!((usage.allowed, usage.denied), (3, 4));
    }

    #[test]
    fn token_buckets_carry_tokens_per_fill_and_whole_seconds() {
        let response = to_wire(vec![BucketAction {
            bucket: vec![("k".into(), "v".into())],
            action: Action::Assign {
                strategy: Strategy::TokenBucket(crate::quota::TokenBucket {
                    max_tokens: 3,
                    tokens_per_fill: 16,
                    fill_interval_secs: 5,
                }),
                ttl_secs: 15,
            },
        }]);
        let Some(bucket_action::BucketAction::QuotaAssignmentAction(a)) =
            &response.bucket_action[0].bucket_action
        else {
            panic!("{response:?}")
        };
        assert_eq!(a.assignment_time_to_live.unwrap().seconds, 15);
        let Some(rate_limit_strategy::Strategy::TokenBucket(b)) =
            &a.rate_limit_strategy.as_ref().unwrap().strategy
        else {
            panic!("{a:?}")
        };
        assert_eq!(b.tokens_per_fill, Some(16));
        assert_eq!(
            b.fill_interval.unwrap(),
            prost_types::Duration {
                seconds: 5,
                nanos: 0
            }
        );
    }
}
