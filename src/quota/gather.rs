//! How often one bucket is recomputed on this replica: at most once per interval (a tenth of the report
//! period). A recomputation reads and rewrites every member of the bucket, so a bucket whose every
//! Envoy set off one of its own cost its members squared per period: 200 Envoys sharing 100 buckets,
//! reporting each second, kept a replica's two cores busy. The reports that arrive within the interval
//! after a recomputation wait for the next one and are all listed in it, which then costs the bucket's
//! members once for all of them.
//!
//! A report of a bucket not recomputed here within the interval is recomputed at once, as before; the
//! others are answered on their streams when their turn comes, at most an interval later. Envoy does not
//! wait for an answer (it enforces what it holds, or its `no_assignment_behavior`, meanwhile), and an
//! assignment counts for its TTL, many intervals.

use std::{collections::HashMap, sync::Mutex, time::Duration};

use tokio::time::Instant;

use super::lock;

/// The turns of the buckets of this replica, by shares key.
#[derive(Debug)]
pub(super) struct Gathers<T> {
    every: Duration,
    buckets: Mutex<HashMap<String, Gather<T>>>,
}

#[derive(Debug)]
struct Gather<T> {
    /// When the bucket's last recomputation here began.
    last: Instant,
    /// Reports waiting for the next one, oldest first.
    waiting: Vec<T>,
}

/// What a report's turn is.
#[derive(Debug, PartialEq)]
pub(super) enum Turn<T> {
    /// Recompute now, with this report alone.
    Now(T),
    /// Queued behind reports already waiting: the first of them takes it along.
    Queued,
    /// Queued first: whoever gets this must call [`Gathers::take`] at `at` and recompute what it gives.
    First { at: Instant },
}

impl<T> Gathers<T> {
    pub fn new(every: Duration) -> Self {
        Self {
            every,
            buckets: Mutex::new(HashMap::new()),
        }
    }

    /// The least time between two recomputations of a bucket.
    pub fn every(&self) -> Duration {
        self.every
    }

    /// The turn of a report of the bucket under `key`.
    pub fn enter(&self, key: &str, report: T) -> Turn<T> {
        let now = Instant::now();
        let mut buckets = lock(&self.buckets);
        let Some(gather) = buckets.get_mut(key) else {
            buckets.insert(
                key.to_owned(),
                Gather {
                    last: now,
                    waiting: Vec::new(),
                },
            );
            return Turn::Now(report);
        };
        let due = gather.last + self.every;
        if gather.waiting.is_empty() && now >= due {
            gather.last = now;
            return Turn::Now(report);
        }
        gather.waiting.push(report);
        if gather.waiting.len() == 1 {
            Turn::First { at: due }
        } else {
            Turn::Queued
        }
    }

    /// The reports waiting for the bucket's next recomputation, which begins now.
    pub fn take(&self, key: &str) -> Vec<T> {
        let mut buckets = lock(&self.buckets);
        match buckets.get_mut(key) {
            Some(gather) => {
                gather.last = Instant::now();
                std::mem::take(&mut gather.waiting)
            }
            None => Vec::new(),
        }
    }

    /// Forgets the buckets that have nothing waiting and were not recomputed within the interval.
    pub fn sweep(&self) {
        let now = Instant::now();
        lock(&self.buckets).retain(|_, g| !g.waiting.is_empty() || now < g.last + self.every);
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        lock(&self.buckets).len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn one_recomputation_per_interval_takes_every_report_that_waited_for_it() {
        let gathers = Gathers::new(Duration::from_millis(500));
        assert_eq!(gathers.enter("b", 1), Turn::Now(1));
        let start = Instant::now();
        assert_eq!(
            gathers.enter("b", 2),
            Turn::First {
                at: start + Duration::from_millis(500)
            }
        );
        assert_eq!(gathers.enter("b", 3), Turn::Queued);
        // Another bucket has turns of its own.
        assert_eq!(gathers.enter("c", 9), Turn::Now(9));
        tokio::time::advance(Duration::from_millis(500)).await;
        // Due, but reports wait: a newcomer joins them rather than overtake them.
        assert_eq!(gathers.enter("b", 4), Turn::Queued);
        assert_eq!(gathers.take("b"), vec![2, 3, 4]);
        // The taken recomputation began now: the next report waits for the interval after it.
        tokio::time::advance(Duration::from_millis(100)).await;
        assert_eq!(
            gathers.enter("b", 5),
            Turn::First {
                at: start + Duration::from_millis(1000)
            }
        );
        assert_eq!(gathers.take("b"), vec![5]);
        tokio::time::advance(Duration::from_millis(500)).await;
        assert_eq!(gathers.enter("b", 6), Turn::Now(6));
    }

    #[tokio::test(start_paused = true)]
    async fn quiet_buckets_are_forgotten() {
        let gathers = Gathers::new(Duration::from_millis(500));
        assert_eq!(gathers.enter("b", 1), Turn::Now(1));
        assert!(matches!(gathers.enter("w", 1), Turn::Now(1)));
        assert!(matches!(gathers.enter("w", 2), Turn::First { .. }));
        gathers.sweep();
        assert_eq!(gathers.len(), 2);
        tokio::time::advance(Duration::from_millis(500)).await;
        gathers.sweep();
        // "b" is quiet; "w" has a report waiting.
        assert_eq!(gathers.len(), 1);
        assert_eq!(gathers.take("w"), vec![2]);
        tokio::time::advance(Duration::from_millis(500)).await;
        gathers.sweep();
        assert_eq!(gathers.len(), 0);
        assert!(gathers.take("w").is_empty());
    }
}
