//! Fixed windows aligned to the Unix epoch, as the reference service counts: a window of `w` seconds
//! starting at `floor(now / w) * w`, one counter per window.

/// Start of the window containing `now` (any unit: seconds or milliseconds since the epoch).
pub fn window_start(now: u64, window: u64) -> u64 {
    now - now % window
}

/// Time until the window containing `now` ends, in the unit of `now`: 1..=window, never 0.
pub fn seconds_until_reset(now: u64, window: u64) -> u64 {
    window - now % window
}

/// The verdict of one counter for one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Verdict {
    /// `count + cost` stays within the limit.
    pub allowed: bool,
    /// The count if this request's cost is added.
    pub count_after: u64,
}

/// Checks a cost against a counter: allowed while `count + cost <= limit`, so with a limit of N and a
/// cost of 1, hits 1..=N pass and hit N+1 is denied. A cost of 0 only checks that the counter is not
/// already over the limit.
pub fn check(count: u64, limit: u64, cost: u64) -> Verdict {
    let count_after = count.saturating_add(cost);
    Verdict {
        allowed: count_after <= limit,
        count_after,
    }
}

/// Quota left after a count (0 when over).
pub fn remaining(count: u64, limit: u64) -> u64 {
    limit.saturating_sub(count)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn windows_align_to_the_epoch_like_the_reference_keys() {
        // Reference examples: SECOND at 1234 -> 1234, MINUTE at 1234 -> 1200,
        // HOUR at 1 000 000 -> 997 200, DAY at 1 000 000 -> 950 400.
        assert_eq!(window_start(1234, 1), 1234);
        assert_eq!(window_start(1234, 60), 1200);
        assert_eq!(window_start(1_000_000, 3600), 997_200);
        assert_eq!(window_start(1_000_000, 86_400), 950_400);
        assert_eq!(seconds_until_reset(2222, 60), 58);
        assert_eq!(seconds_until_reset(1200, 60), 60);
    }

    #[test]
    fn limit_n_allows_n_hits_then_denies() {
        let mut count = 0;
        for hit in 1..=12u64 {
            let v = check(count, 10, 1);
            assert_eq!(v.allowed, hit <= 10, "hit {hit}");
            if v.allowed {
                count = v.count_after;
            }
        }
        assert_eq!(remaining(count, 10), 0);
        // Reference vectors: hits 3 landing on 5 of 20 -> OK, remaining 15; hits 7 landing on 22 -> over.
        assert_eq!(
            check(2, 20, 3),
            Verdict {
                allowed: true,
                count_after: 5
            }
        );
        assert_eq!(remaining(5, 20), 15);
        assert!(!check(15, 20, 7).allowed);
        // A zero limit denies every counted hit; a zero cost only checks.
        assert!(!check(0, 0, 1).allowed);
        assert!(check(10, 10, 0).allowed);
        assert!(!check(11, 10, 0).allowed);
    }

    proptest! {
        #[test]
        fn reset_is_within_one_window_and_lands_on_the_next_start(now in 0u64..4_000_000_000, w in 1u64..40_000_000) {
            let reset = seconds_until_reset(now, w);
            prop_assert!((1..=w).contains(&reset));
            prop_assert_eq!(window_start(now + reset, w), window_start(now, w) + w);
            prop_assert!(window_start(now, w) <= now);
        }
    }
}
