//! The limiter's own request and response types, and why a request could not be decided.
//!
//! They are the domain's, not the wire's: the API layer converts the gRPC and JSON forms at the edge.

use std::sync::Arc;

use crate::{
    rules::{EntryRef, Unit},
    store::StoreError,
};

/// A rate limit request.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Request {
    pub domain: String,
    pub descriptors: Vec<Descriptor>,
    /// Hits every descriptor costs unless it says otherwise; 0 is read as 1.
    pub hits_addend: u32,
}

/// One descriptor of a request.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Descriptor {
    pub entries: Vec<Entry>,
    /// A limit chosen by the caller instead of the rules' (honoured only for known domains).
    pub limit: Option<LimitOverride>,
    /// Hits this descriptor costs; `Some(0)` checks without counting.
    pub hits_addend: Option<u64>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Entry {
    pub key: String,
    pub value: String,
}

impl EntryRef for Entry {
    fn key(&self) -> &str {
        &self.key
    }
    fn value(&self) -> &str {
        &self.value
    }
}

/// A caller-chosen limit. `unit` is `None` when the wire value names no unit (UNKNOWN).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LimitOverride {
    pub requests_per_unit: u32,
    pub unit: Option<Unit>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Code {
    Ok,
    OverLimit,
}

/// The limit a descriptor was checked against.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CurrentLimit {
    pub requests_per_unit: u32,
    pub unit: Unit,
    pub name: Option<Arc<str>>,
}

/// The answer for one descriptor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DescriptorStatus {
    pub code: Code,
    /// Absent when no limit applied (no matching rule, allow-listed, unlimited or replaced).
    pub current_limit: Option<CurrentLimit>,
    pub limit_remaining: u32,
    /// Seconds until the counter resets; set whenever `current_limit` is.
    pub duration_until_reset: Option<u64>,
    /// When over its limit: seconds before the same request would be allowed (not on the wire; feeds
    /// `Retry-After`).
    pub retry_after: Option<u64>,
}

impl DescriptorStatus {
    pub(super) fn unlimited() -> Self {
        Self {
            code: Code::Ok,
            current_limit: None,
            limit_remaining: u32::MAX,
            duration_until_reset: None,
            retry_after: None,
        }
    }

    pub(super) fn no_limit() -> Self {
        Self {
            code: Code::Ok,
            current_limit: None,
            limit_remaining: 0,
            duration_until_reset: None,
            retry_after: None,
        }
    }
}

/// The answer for a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response {
    pub overall_code: Code,
    /// One per request descriptor, in order.
    pub statuses: Vec<DescriptorStatus>,
    /// Headers for the caller to add to its response.
    pub response_headers: Vec<(String, String)>,
}

/// Why a request could not be decided.
#[derive(Debug, Clone, thiserror::Error)]
pub enum LimitError {
    #[error("rate limit domain must not be empty")]
    EmptyDomain,
    #[error("rate limit descriptor list must not be empty")]
    NoDescriptors,
    #[error("no rate limit configuration loaded")]
    NoRules,
    #[error("request too large: {what} is {actual}, the limit is {max} ({setting})")]
    TooLarge {
        what: String,
        actual: usize,
        max: usize,
        setting: &'static str,
    },
    #[error("descriptor {index}: rate limit override has unit UNKNOWN; use SECOND, MINUTE, HOUR, DAY, WEEK, MONTH or YEAR")]
    UnknownOverrideUnit { index: usize },
    #[error("descriptor {index}: rate limit overrides are refused here (request_limits.allow_overrides is false)")]
    OverrideRefused { index: usize },
    #[error("{0}")]
    Store(#[from] StoreError),
    #[error("overloaded: {max} requests already being decided (overload.max_in_flight)")]
    Overloaded { max: usize },
    #[error("not decided within {0:?} (overload.deadline)")]
    Deadline(std::time::Duration),
}

impl LimitError {
    /// The request itself is at fault (as opposed to the service being unable to decide).
    pub fn is_invalid_request(&self) -> bool {
        matches!(
            self,
            Self::EmptyDomain
                | Self::NoDescriptors
                | Self::TooLarge { .. }
                | Self::UnknownOverrideUnit { .. }
                | Self::OverrideRefused { .. }
        )
    }
}
