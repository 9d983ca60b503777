//! Code generated from `proto/`: the Envoy rate limit service v3 and the messages it uses, the rate limit
//! quota service (RLQS) v3 with the strategies it assigns, and the xDS discovery service with the rule
//! sets a control plane sends over it.
#![allow(clippy::all, missing_docs)]

pub mod envoy {
    pub mod service {
        pub mod ratelimit {
            pub mod v3 {
                tonic::include_proto!("envoy.service.ratelimit.v3");
            }
        }
        pub mod discovery {
            pub mod v3 {
                tonic::include_proto!("envoy.service.discovery.v3");
            }
        }
        pub mod rate_limit_quota {
            pub mod v3 {
                tonic::include_proto!("envoy.service.rate_limit_quota.v3");
            }
        }
    }
    pub mod extensions {
        pub mod common {
            pub mod ratelimit {
                pub mod v3 {
                    tonic::include_proto!("envoy.extensions.common.ratelimit.v3");
                }
            }
        }
    }
    pub mod r#type {
        pub mod v3 {
            tonic::include_proto!("envoy.r#type.v3");
        }
    }
    pub mod config {
        pub mod core {
            pub mod v3 {
                tonic::include_proto!("envoy.config.core.v3");
            }
        }
    }
}

pub mod google {
    pub mod rpc {
        tonic::include_proto!("google.rpc");
    }
}

/// The rule sets of envoyproxy/ratelimit's xDS API (`ratelimit.config.ratelimit.v3`).
pub mod ratelimit {
    pub mod config {
        pub mod ratelimit {
            pub mod v3 {
                tonic::include_proto!("ratelimit.config.ratelimit.v3");
            }
        }
    }
}

/// The encoded descriptor set of the served services (the rate limit service and the rate limit quota
/// service, with their imports), served by reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/rls_descriptor.bin"));

pub use envoy::{
    config::core::v3::HeaderValue,
    extensions::common::ratelimit::v3::{rate_limit_descriptor, RateLimitDescriptor},
    service::ratelimit::v3::{
        rate_limit_response, rate_limit_service_client::RateLimitServiceClient,
        rate_limit_service_server, RateLimitRequest, RateLimitResponse,
    },
};

/// What ratelimitd and a control plane say to each other, and the rules it carries.
pub mod xds {
    pub use super::envoy::{
        config::core::v3::Node,
        service::discovery::v3::{
            aggregated_discovery_service_client::AggregatedDiscoveryServiceClient,
            aggregated_discovery_service_server, DiscoveryRequest, DiscoveryResponse,
        },
    };
    pub use super::google::rpc::Status;
    pub use super::ratelimit::config::ratelimit::v3::{
        RateLimitConfig, RateLimitDescriptor, RateLimitPolicy, RateLimitReplace, RateLimitUnit,
    };

    /// The type URL of [`RateLimitConfig`] resources, the one type ratelimitd subscribes to.
    pub const RATE_LIMIT_CONFIG_TYPE: &str =
        "type.googleapis.com/ratelimit.config.ratelimit.v3.RateLimitConfig";
}

/// The rate limit quota service (RLQS): usage reports in, bucket actions out, on one stream per Envoy.
pub mod rlqs {
    pub use super::envoy::{
        r#type::v3::{rate_limit_strategy, RateLimitStrategy, TokenBucket},
        service::rate_limit_quota::v3::{
            rate_limit_quota_response,
            rate_limit_quota_service_client::RateLimitQuotaServiceClient,
            rate_limit_quota_service_server, rate_limit_quota_usage_reports, BucketId,
            RateLimitQuotaResponse, RateLimitQuotaUsageReports,
        },
    };
}
