//! Timers cheap enough to be checked on every read and write of a connection.

use std::{
    future::Future,
    pin::Pin,
    task::{Context, Waker},
    time::Duration,
};

use tokio::time::{Instant, Sleep};

/// A timer checked on every read and write of a connection. Polling a tokio timer on every I/O call
/// costs enough to slow a busy connection measurably (`tests/redis_deadlines.rs`'s burst of 2 000
/// calls missed its deadlines with two timers polled per call), so the timer is polled only to register
/// the connection's task, once per task, and otherwise only asked whether it has fired.
#[derive(Debug)]
pub(super) struct Deadline {
    timer: Pin<Box<Sleep>>,
    /// The task that will be woken when the timer fires.
    registered: Option<Waker>,
}

impl Deadline {
    pub(super) fn at(when: Instant) -> Self {
        Self {
            timer: Box::pin(tokio::time::sleep_until(when)),
            registered: None,
        }
    }

    /// Whether the deadline has passed; makes sure the current task is woken when it does.
    pub(super) fn passed(&mut self, cx: &mut Context<'_>) -> bool {
        if self.timer.is_elapsed() {
            return true;
        }
        if self
            .registered
            .as_ref()
            .is_some_and(|task| task.will_wake(cx.waker()))
        {
            return false;
        }
        // Outside the task's cooperative budget: a poll refused for budget would not register.
        let mut poll = tokio::task::unconstrained(self.timer.as_mut());
        if Pin::new(&mut poll).poll(cx).is_ready() {
            return true;
        }
        self.registered = Some(cx.waker().clone());
        false
    }

    fn reset(&mut self, when: Instant) {
        self.timer.as_mut().reset(when);
        self.registered = None;
    }
}

/// `start + after`, with `after` at most a hundred years, which no connection lives to see: a bound
/// set to centuries would not fit in an `Instant`.
pub(super) fn later(start: Instant, after: Duration) -> Instant {
    const CENTURY: Duration = Duration::from_secs(100 * 365 * 24 * 3600);
    start + after.min(CENTURY)
}

/// A timer re-armed from a moving start: it fires once `after` has passed since the latest start.
#[derive(Debug)]
pub(super) struct Quiet {
    after: Duration,
    deadline: Deadline,
}

impl Quiet {
    pub(super) fn new(start: Instant, after: Duration) -> Self {
        Self {
            after,
            deadline: Deadline::at(later(start, after)),
        }
    }

    /// Whether `after` has passed since `since()` (`None`: not quiet now, look again in `after`).
    /// Also makes sure the task is woken when it may have.
    pub(super) fn expired(
        &mut self,
        cx: &mut Context<'_>,
        since: impl Fn() -> Option<Instant>,
    ) -> bool {
        loop {
            if !self.deadline.passed(cx) {
                return false;
            }
            let now = Instant::now();
            let due = later(since().unwrap_or(now), self.after);
            if due <= now {
                return true;
            }
            self.deadline.reset(due);
        }
    }
}
