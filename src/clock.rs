//! Wall-clock time, injected so that window arithmetic can be tested at any instant.
//!
//! Fixed windows are aligned to the Unix epoch, so counting needs wall-clock seconds, not a monotonic
//! instant.

use std::{
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc,
    },
    time::{SystemTime, UNIX_EPOCH},
};

/// A source of the current time in milliseconds since the Unix epoch.
#[derive(Debug, Clone, Default)]
pub enum Clock {
    /// The system clock.
    #[default]
    System,
    /// A clock that only moves when told to (tests).
    Manual(Arc<AtomicU64>),
}

impl Clock {
    /// A manual clock starting at `millis`.
    pub fn manual(millis: u64) -> Self {
        Clock::Manual(Arc::new(AtomicU64::new(millis)))
    }

    pub fn now_millis(&self) -> u64 {
        match self {
            Clock::System => SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_millis() as u64)
                .unwrap_or(0),
            Clock::Manual(ms) => ms.load(Ordering::Relaxed),
        }
    }

    /// Moves a manual clock forward; no effect on the system clock.
    pub fn advance_millis(&self, millis: u64) {
        if let Clock::Manual(ms) = self {
            ms.fetch_add(millis, Ordering::Relaxed);
        }
    }
}
