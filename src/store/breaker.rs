//! A circuit breaker in front of one Redis server. It opens only when the server itself is failing: its
//! connections are refused or lost ([`Breaker::failure`], after `failures` in a row), or it has not
//! answered anything at all for a while although commands wait for it ([`Breaker::trip`], a hung
//! server). A slow answer is not a failure: while answers keep arriving, calls wait their turn, up to
//! their deadline. Error replies (a script refusing a request, OOM, READONLY, a Cluster's MOVED and ASK)
//! are answers too: the server is alive, so they close the breaker rather than open it. A Cluster master
//! refusing every key (CLUSTERDOWN) opens it at once ([`Breaker::trip`], see `Node::cluster_down`).
//!
//! While open, requests are answered at once by the `on_backend_error` policy, without waiting; after
//! `open_for`, one probe is let through, and its outcome closes the breaker or opens it again.

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
    /// One probe is in flight since `since`; everything else is refused until it reports, or until
    /// another `open_for` has passed (a probe whose caller went away reports nothing).
    HalfOpen {
        since: Instant,
    },
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

    /// Whether a request may go to the server now. When the breaker has been open long enough, the
    /// caller that gets `true` is the probe.
    pub fn allow(&self) -> bool {
        let mut state = self.state();
        let now = Instant::now();
        match *state {
            State::Closed { .. } => true,
            State::Open { until } if now >= until => {
                *state = State::HalfOpen { since: now };
                true
            }
            State::HalfOpen { since } if now >= since + self.open_for => {
                *state = State::HalfOpen { since: now };
                true
            }
            State::Open { .. } | State::HalfOpen { .. } => false,
        }
    }

    /// Records an answer from the server (a result or an error reply): it is alive. Returns true when
    /// this closed an open breaker.
    pub fn success(&self) -> bool {
        let mut state = self.state();
        let was_open = !matches!(*state, State::Closed { .. });
        *state = State::Closed { failures: 0 };
        was_open
    }

    /// Records a connection-level failure (refused, lost, TLS or cluster routing); returns true when
    /// this failure opened the breaker.
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
            State::HalfOpen { .. } => true,
            State::Open { .. } => false,
        };
        if open {
            *state = State::Open {
                until: Instant::now() + self.open_for,
            };
        }
        open
    }

    /// Opens the breaker at once: the server has stopped answering. Returns true when this opened it
    /// (false when it was already open).
    pub fn trip(&self) -> bool {
        let mut state = self.state();
        let was_closed = !matches!(*state, State::Open { .. });
        *state = State::Open {
            until: Instant::now() + self.open_for,
        };
        was_closed
    }

    /// Whether it is open (in its pause, due for a probe, or with a probe out).
    #[cfg(test)]
    pub fn is_open(&self) -> bool {
        !matches!(*self.state(), State::Closed { .. })
    }

    /// Whether requests are answered without asking the server now: open and not yet due for a probe,
    /// or a probe out. An open breaker no request came to since its pause ended is not: the next
    /// request asks (the metric would otherwise say "open" for as long as the server gets no traffic,
    /// long after it came back).
    pub fn refusing(&self) -> bool {
        let now = Instant::now();
        match *self.state() {
            State::Closed { .. } => false,
            State::Open { until } => now < until,
            State::HalfOpen { since } => now < since + self.open_for,
        }
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
        assert!(b.success(), "the probe's answer closes it");
        assert!(b.allow() && b.allow() && !b.is_open());
    }

    #[tokio::test(start_paused = true)]
    async fn it_refuses_while_it_answers_without_asking_and_not_after() {
        let b = Breaker::new(1, Duration::from_millis(500));
        assert!(!b.refusing());
        assert!(b.failure());
        assert!(b.refusing());
        // No request since: the next one would ask the server.
        tokio::time::advance(Duration::from_millis(500)).await;
        assert!(b.is_open() && !b.refusing());
        // That request is the probe; the others are refused while it is out.
        assert!(b.allow());
        assert!(b.refusing());
        assert!(b.failure());
        assert!(b.refusing());
        // A probe whose caller went away: not refusing once another probe may go.
        tokio::time::advance(Duration::from_millis(500)).await;
        assert!(b.allow());
        tokio::time::advance(Duration::from_millis(500)).await;
        assert!(!b.refusing());
        assert!(b.allow() && b.success() && !b.refusing());
    }

    #[tokio::test(start_paused = true)]
    async fn a_hung_server_opens_it_at_once_and_a_lost_probe_is_replaced() {
        let b = Breaker::new(5, Duration::from_millis(500));
        assert!(
            b.trip(),
            "no answers at all: open without waiting for five failures"
        );
        assert!(!b.trip(), "already open");
        assert!(!b.allow());
        tokio::time::advance(Duration::from_millis(500)).await;
        assert!(b.allow(), "probe");
        assert!(!b.allow());
        // The probe's caller went away without reporting: another probe after another pause.
        tokio::time::advance(Duration::from_millis(500)).await;
        assert!(b.allow());
        assert!(b.success() && !b.is_open());
    }
}
