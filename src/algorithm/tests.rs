//! Scenarios per algorithm, and properties checked against simple models over random hit sequences.

use proptest::prelude::*;

use super::*;

fn params(algorithm: Algorithm, limit: u64, window_ms: u64, burst: u64) -> Params {
    Params {
        algorithm,
        limit,
        window_ms,
        burst,
    }
}

/// Runs hits (time, cost) through an algorithm, consuming when allowed; returns the decisions.
fn run(p: &Params, hits: &[(u64, u64)]) -> Vec<Decision> {
    let mut state: Option<State> = None;
    hits.iter()
        .map(|&(t, cost)| {
            let (d, next) = decide(p, state.as_ref(), t, cost);
            if let (true, Some(next)) = (d.allowed, next) {
                state = Some(next);
            }
            d
        })
        .collect()
}

fn allowed(ds: &[Decision]) -> Vec<bool> {
    ds.iter().map(|d| d.allowed).collect()
}

#[test]
fn fixed_window_counts_per_aligned_window() {
    let p = params(Algorithm::FixedWindow, 2, 1000, 2);
    let ds = run(&p, &[(10_000, 1), (10_500, 1), (10_999, 1), (11_000, 1)]);
    assert_eq!(allowed(&ds), [true, true, false, true]);
    assert_eq!(ds[2].retry_ms, 1);
    assert_eq!(ds[0].remaining, 1);
}

#[test]
fn sliding_window_weights_the_previous_window() {
    let p = params(Algorithm::SlidingWindow, 10, 1000, 10);
    // 10 hits late in one window, then halfway into the next the previous counts for half: 5 left.
    let mut hits: Vec<(u64, u64)> = (0..10).map(|i| (10_900 + i, 1)).collect();
    hits.extend((0..6).map(|i| (11_500 + i, 1)));
    let ds = run(&p, &hits);
    assert!(ds[..10].iter().all(|d| d.allowed));
    assert_eq!(allowed(&ds[10..]), [true, true, true, true, true, false]);
    let denied = ds[15];
    // Each further 100 ms frees one hit of the previous window's weight.
    assert!(denied.retry_ms > 0 && denied.retry_ms <= 100, "{denied:?}");
    assert_eq!(ds[10].reset_ms, 12_000 + 1000 - 11_500);
}

#[test]
fn sliding_log_is_exact_over_any_window() {
    let p = params(Algorithm::SlidingLog, 3, 1000, 3);
    let ds = run(
        &p,
        &[
            (0, 1),
            (400, 1),
            (800, 1),
            (999, 1),
            (1000, 1),
            (1399, 1),
            (1400, 1),
        ],
    );
    assert_eq!(allowed(&ds), [true, true, true, false, true, false, true]);
    assert_eq!(ds[3].retry_ms, 1);
    assert_eq!(ds[2].reset_ms, 1000);
}

#[test]
fn token_bucket_and_gcra_allow_a_burst_then_the_refill_rate() {
    for algorithm in [Algorithm::TokenBucket, Algorithm::Gcra] {
        let p = params(algorithm, 10, 1000, 5);
        let ds = run(
            &p,
            &[
                (0, 1),
                (0, 1),
                (0, 1),
                (0, 1),
                (0, 1),
                (0, 1),
                (100, 1),
                (150, 1),
                (200, 1),
            ],
        );
        assert_eq!(
            allowed(&ds),
            [true, true, true, true, true, false, true, false, true],
            "{algorithm:?}"
        );
        assert_eq!(ds[5].retry_ms, 100, "{algorithm:?}");
        assert_eq!(ds[4].remaining, 0, "{algorithm:?}");
        assert_eq!(
            ds[4].reset_ms, 500,
            "{algorithm:?}: five tokens at 10 per second"
        );
    }
}

#[test]
fn costs_above_one_and_zero() {
    for algorithm in [
        Algorithm::FixedWindow,
        Algorithm::SlidingWindow,
        Algorithm::SlidingLog,
        Algorithm::TokenBucket,
        Algorithm::Gcra,
    ] {
        let p = params(algorithm, 10, 60_000, 10);
        let ds = run(
            &p,
            &[
                (1_000_000, 4),
                (1_000_000, 0),
                (1_000_000, 7),
                (1_000_000, 6),
            ],
        );
        assert_eq!(allowed(&ds), [true, true, false, true], "{algorithm:?}");
        assert_eq!(ds[0].remaining, 6, "{algorithm:?}");
        assert_eq!(ds[1].remaining, 6, "{algorithm:?}: a zero cost only checks");
        assert_eq!(ds[3].remaining, 0, "{algorithm:?}");
        // A cost above the capacity is never allowed, and its wait is bounded.
        let (d, _) = decide(&p, None, 1_000_000, 11);
        assert!(
            !d.allowed && d.retry_ms > 0 && d.retry_ms <= 120_000,
            "{algorithm:?}: {d:?}"
        );
    }
}

#[test]
fn expiry_is_when_the_state_means_nothing_any_more() {
    let p = params(Algorithm::TokenBucket, 10, 1000, 10);
    let (_, s) = decide(&p, None, 5_000, 4);
    assert_eq!(expires_at_ms(&p, &s.unwrap(), 5_000), 5_400);
    let p = params(Algorithm::SlidingWindow, 10, 1000, 10);
    let (_, s) = decide(&p, None, 5_500, 1);
    assert_eq!(expires_at_ms(&p, &s.unwrap(), 5_500), 7_000);
}

/// Random hit sequences: sorted times within 10 s, costs 0..=3.
fn hits() -> impl Strategy<Value = Vec<(u64, u64)>> {
    prop::collection::vec((0u64..10_000, 0u64..=3), 1..200).prop_map(|mut v| {
        v.sort_by_key(|h| h.0);
        v.into_iter().map(|(t, c)| (1_000_000 + t, c)).collect()
    })
}

proptest! {
    #[test]
    fn token_bucket_never_admits_more_than_burst_plus_refill(hits in hits(), limit in 1u64..20, burst in 1u64..20) {
        // 1024 ms windows and power-of-two rates keep the float arithmetic exact.
        let p = params(Algorithm::TokenBucket, limit, 1024, burst);
        let ds = run(&p, &hits);
        let start = hits[0].0;
        let mut admitted = 0u64;
        for (d, &(t, cost)) in ds.iter().zip(&hits) {
            if d.allowed {
                admitted += cost;
            }
            let budget = burst as f64 + (t - start) as f64 * limit as f64 / 1024.0;
            prop_assert!(admitted as f64 <= budget + 1e-9, "admitted {} > {}", admitted, budget);
        }
    }

    #[test]
    fn sliding_log_never_exceeds_the_limit_in_any_window(hits in hits(), limit in 1u64..10, window in 1u64..3000) {
        let p = params(Algorithm::SlidingLog, limit, window, limit);
        let ds = run(&p, &hits);
        let admitted: Vec<(u64, u64)> = ds.iter().zip(&hits).filter(|(d, _)| d.allowed).map(|(_, h)| *h).collect();
        for &(t, _) in &admitted {
            let in_window: u64 = admitted.iter().filter(|&&(u, _)| u <= t && u + window > t).map(|h| h.1).sum();
            prop_assert!(in_window <= limit, "{} hits in the window ending at {}", in_window, t);
        }
    }

    #[test]
    fn sliding_window_admits_within_its_formula(hits in hits(), limit in 1u64..20, window in 1u64..3000) {
        let p = params(Algorithm::SlidingWindow, limit, window, limit);
        let ds = run(&p, &hits);
        let admitted: Vec<(u64, u64)> = ds.iter().zip(&hits).filter(|(d, _)| d.allowed).map(|(_, h)| *h).collect();
        for (d, &(t, cost)) in ds.iter().zip(&hits) {
            let start = t - t % window;
            let current: u64 = admitted.iter().filter(|&&(u, _)| u >= start && u <= t).map(|h| h.1).sum();
            let previous: u64 = admitted.iter().filter(|&&(u, _)| u >= start.saturating_sub(window) && u < start).map(|h| h.1).sum();
            let estimate = previous as f64 * (window - (t - start)) as f64 / window as f64 + current as f64;
            // After an admitted hit the estimate (which includes it) is within the limit.
            if d.allowed {
                prop_assert!(estimate <= limit as f64 + 1e-9);
            } else {
                prop_assert!(estimate + cost as f64 > limit as f64 - 1e-9);
            }
        }
    }

    #[test]
    fn gcra_decides_like_the_token_bucket(hits in hits(), shift in 0u32..4, burst in 1u64..20) {
        let limit = 1u64 << shift;
        let bucket = run(&params(Algorithm::TokenBucket, limit, 1024, burst), &hits);
        let gcra = run(&params(Algorithm::Gcra, limit, 1024, burst), &hits);
        prop_assert_eq!(allowed(&bucket), allowed(&gcra));
        for (b, g) in bucket.iter().zip(&gcra) {
            prop_assert_eq!(b.remaining, g.remaining);
        }
    }
}
