//! Code generated from `proto/`: the Envoy rate limit service v3 and the messages it uses.
#![allow(clippy::all, missing_docs)]

pub mod envoy {
    pub mod service {
        pub mod ratelimit {
            pub mod v3 {
                tonic::include_proto!("envoy.service.ratelimit.v3");
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

/// The encoded descriptor set of `proto/` (with its imports), served by reflection.
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
