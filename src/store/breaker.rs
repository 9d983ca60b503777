//! A circuit breaker in front of a remote store: after `failures` consecutive failed requests it opens
//! and fails requests at once for `open_for`; then one probe request is let through, and its outcome
//! closes the breaker or opens it again. While Redis is down, callers get an answer in microseconds
//! instead of each waiting out a timeout.

use std::{sync::Mutex, time::Duration};

use tokio::time::Instant;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Closed {
        failures: u32,
    },
    Open {
        until: Instant,
    },
    /// One probe is in flight; everything else is refused until it reports.
    HalfOpen,
}

#[derive(Debug)]
pub struct Breaker {
    failures_to_open: u32,
    open_for: Duration,
    state: Mutex<State>,
}

impl Breaker {
    pub fn new(failures_to_open: u32, open_for: Duration) -> Self {
        Self {
            failures_to_open: failures_to_open.max(1),
            open_for,
            state: Mutex::new(State::Closed { failures: 0 }),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether a request may go to the store now.
    pub fn allow(&self) -> bool {
        let mut state = self.state();
        match *state {
            State::Closed { .. } => true,
            State::Open { until } if Instant::now() >= until => {
                *state = State::HalfOpen;
                true
            }
            State::Open { .. } | State::HalfOpen => false,
        }
    }

    /// Records a request the store answered.
    pub fn success(&self) {
        let mut state = self.state();
        if *state == State::HalfOpen {
            tracing::warn!("backend answered again: circuit breaker closed");
        }
        *state = State::Closed { failures: 0 };
    }

    /// Records a request the store failed; returns true when this failure opened the breaker.
    pub fn failure(&self) -> bool {
        let mut state = self.state();
        let open = match *state {
            State::Closed { failures } if failures + 1 >= self.failures_to_open => true,
            State::Closed { failures } => {
                *state = State::Closed {
                    failures: failures + 1,
                };
                false
            }
            State::HalfOpen => true,
            State::Open { .. } => false,
        };
        if open {
            *state = State::Open {
                until: Instant::now() + self.open_for,
            };
        }
        open
    }

    pub fn is_open(&self) -> bool {
        !matches!(*self.state(), State::Closed { .. })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn opens_after_consecutive_failures_and_probes_once_after_the_pause() {
        let b = Breaker::new(3, Duration::from_millis(500));
        assert!(b.allow());
        assert!(!b.failure());
        b.success();
        assert!(!b.failure() && !b.failure());
        assert!(b.failure(), "third failure in a row opens");
        assert!(!b.allow() && b.is_open());

        tokio::time::advance(Duration::from_millis(500)).await;
        assert!(b.allow(), "one probe after the pause");
        assert!(!b.allow(), "only one");
        assert!(b.failure(), "a failed probe opens again");
        assert!(!b.allow());

        tokio::time::advance(Duration::from_millis(500)).await;
        assert!(b.allow());
        b.success();
        assert!(b.allow() && b.allow() && !b.is_open());
    }
}
