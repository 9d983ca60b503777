//! Top offenders: the descriptors most often denied over a recent interval, in fixed memory.
//!
//! A Space-Saving sketch of `capacity` entries counts denials: a descriptor already tracked is counted
//! exactly; a new one, when the sketch is full, takes the place of the least-counted entry and inherits
//! its count as an over-estimate (reported as `error`). Any descriptor denied more than `total /
//! capacity` times is guaranteed to be listed. Two sketches alternate every `interval`, so the list
//! covers between one and two intervals of history and forgets older attacks.

use std::{
    borrow::Cow,
    collections::HashMap,
    hash::{BuildHasher, RandomState},
    sync::Mutex,
    time::Duration,
};

use tokio::time::Instant;

#[derive(Debug, Default, Clone)]
struct Sketch {
    /// descriptor -> (count, error)
    entries: HashMap<String, (u64, u64)>,
}

/// A descriptor longer than this is kept as its first [`NAME_KEPT`] bytes, its length and a hash of it
/// (distinct descriptors stay distinct): a request may carry 64 KiB of them, and the sketch keeps its
/// names for a whole interval and copies them into every list.
const NAME_BYTES: usize = 512;
const NAME_KEPT: usize = 448;

/// `descriptor` as the sketch keeps it; `hasher` is seeded per sketch, so that nobody can work out two
/// long descriptors whose names are the same.
fn name<'d>(descriptor: &'d str, hasher: &RandomState) -> Cow<'d, str> {
    if descriptor.len() <= NAME_BYTES {
        return Cow::Borrowed(descriptor);
    }
    let mut end = NAME_KEPT;
    while !descriptor.is_char_boundary(end) {
        end -= 1;
    }
    Cow::Owned(format!(
        "{}... ({} bytes, #{:016x})",
        &descriptor[..end],
        descriptor.len(),
        hasher.hash_one(descriptor)
    ))
}

impl Sketch {
    fn add(&mut self, key: &str, capacity: usize) {
        if let Some(entry) = self.entries.get_mut(key) {
            entry.0 += 1;
            return;
        }
        if self.entries.len() < capacity {
            self.entries.insert(key.to_owned(), (1, 0));
            return;
        }
        let Some((evicted, (count, _))) = self
            .entries
            .iter()
            .min_by_key(|(_, (count, _))| *count)
            .map(|(k, v)| (k.clone(), *v))
        else {
            return;
        };
        self.entries.remove(&evicted);
        self.entries.insert(key.to_owned(), (count + 1, count));
    }
}

#[derive(Debug)]
struct Window {
    current: Sketch,
    previous: Sketch,
    started: Instant,
}

/// One line of the report.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Offender {
    /// `domain` then the entries as `key=value`, sensitive values hashed.
    pub descriptor: String,
    /// Denials counted (an over-estimate by at most `error`).
    pub denied: u64,
    pub error: u64,
}

/// The top-offenders sketch.
#[derive(Debug)]
pub struct TopOffenders {
    capacity: usize,
    interval: Duration,
    window: Mutex<Window>,
    /// Hashes the descriptors too long to keep whole.
    hasher: RandomState,
}

impl Default for TopOffenders {
    /// 100 descriptors over one to two minutes.
    fn default() -> Self {
        Self::new(100, Duration::from_secs(60))
    }
}

impl TopOffenders {
    pub fn new(capacity: usize, interval: Duration) -> Self {
        Self {
            capacity: capacity.max(1),
            interval,
            window: Mutex::new(Window {
                current: Sketch::default(),
                previous: Sketch::default(),
                started: Instant::now(),
            }),
            hasher: RandomState::new(),
        }
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    pub fn interval(&self) -> Duration {
        self.interval
    }

    fn window(&self) -> std::sync::MutexGuard<'_, Window> {
        let mut w = self.window.lock().unwrap_or_else(|p| p.into_inner());
        let elapsed = w.started.elapsed();
        if elapsed >= self.interval.saturating_mul(2) {
            w.previous = Sketch::default();
            w.current = Sketch::default();
            w.started = Instant::now();
        } else if elapsed >= self.interval {
            w.previous = std::mem::take(&mut w.current);
            w.started += self.interval;
        }
        w
    }

    /// Counts one denial of a descriptor.
    pub fn denied(&self, descriptor: &str) {
        let capacity = self.capacity;
        let name = name(descriptor, &self.hasher);
        self.window().current.add(&name, capacity);
    }

    /// The most denied descriptors of the last one to two intervals, most denied first.
    pub fn top(&self, limit: usize) -> Vec<Offender> {
        let w = self.window();
        let mut merged: HashMap<&str, (u64, u64)> = HashMap::new();
        for sketch in [&w.previous, &w.current] {
            for (key, (count, error)) in &sketch.entries {
                let e = merged.entry(key.as_str()).or_default();
                e.0 += count;
                e.1 += error;
            }
        }
        // Sorted by reference; only the names listed are copied.
        let mut sorted: Vec<(&str, (u64, u64))> = merged.into_iter().collect();
        sorted.sort_unstable_by(|a, b| b.1 .0.cmp(&a.1 .0).then_with(|| a.0.cmp(b.0)));
        sorted
            .into_iter()
            .take(limit)
            .map(|(descriptor, (denied, error))| Offender {
                descriptor: descriptor.to_owned(),
                denied,
                error,
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn finds_heavy_hitters_in_fixed_memory_and_forgets_old_ones() {
        let top = TopOffenders::new(10, Duration::from_secs(60));
        // A hot descriptor among 10 000 distinct ones denied once each.
        for i in 0..10_000 {
            top.denied(&format!("d user=cold{i}"));
            if i % 10 == 0 {
                top.denied("d user=attacker");
            }
        }
        let list = top.top(3);
        assert_eq!(list[0].descriptor, "d user=attacker");
        assert!(list[0].denied >= 1000 && list[0].denied - list[0].error <= 1000);
        assert!(
            top.window().current.entries.len() <= 10,
            "memory stays fixed"
        );

        tokio::time::advance(Duration::from_secs(61)).await;
        assert_eq!(
            top.top(1)[0].descriptor,
            "d user=attacker",
            "still within two intervals"
        );
        tokio::time::advance(Duration::from_secs(60)).await;
        assert!(top.top(1).is_empty(), "forgotten after two quiet intervals");
    }

    #[tokio::test(start_paused = true)]
    async fn long_descriptors_are_kept_short_and_apart() {
        let top = TopOffenders::new(10, Duration::from_secs(60));
        let long = |last: &str| format!("d {}={last}", "k".repeat(40_000));
        for _ in 0..3 {
            top.denied(&long("a"));
        }
        top.denied(&long("b"));
        top.denied("d user=short");
        let list = top.top(10);
        assert_eq!(list.len(), 3);
        assert_eq!(list[0].denied, 3, "{:?}", list[0].descriptor);
        assert_eq!(list[1].denied, 1);
        assert_ne!(list[0].descriptor, list[1].descriptor);
        for long in &list[..2] {
            assert!(
                long.descriptor.len() <= NAME_BYTES,
                "{}",
                long.descriptor.len()
            );
            assert!(long.descriptor.starts_with("d kkk"));
            assert!(
                long.descriptor.contains("(40004 bytes, #"),
                "{}",
                long.descriptor
            );
        }
        assert!(list.iter().any(|o| o.descriptor == "d user=short"));
        // Cut at a character's boundary.
        let wide = format!("d u={}", "é".repeat(1_000));
        top.denied(&wide);
        assert!(top
            .top(10)
            .iter()
            .any(|o| o.descriptor.starts_with("d u=é")));
    }
}
