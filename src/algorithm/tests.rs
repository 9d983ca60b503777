//! Scenarios per algorithm, and properties checked against simple models over random hit sequences.

use proptest::prelude::*;

use super::*;

fn params(algorithm: Algorithm, limit: u64, window_ms: u64, burst: u64) -> Params {
    Params {
        algorithm,
        limit,
        window_ms,
        burst,
        count_over_limit: false,
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

/// A limit that counts over its limit (a token budget fed the usage reported after each response).
fn budget(algorithm: Algorithm, limit: u64, window_ms: u64) -> Params {
    Params {
        count_over_limit: true,
        ..params(algorithm, limit, window_ms, limit)
    }
}

/// Runs hits through an algorithm the way the stores do: costs bounded first, and the state changed
/// whenever `decide` says so.
fn run_counted(p: &Params, state: &mut Option<State>, hits: &[(u64, u64)]) -> Vec<Decision> {
    hits.iter()
        .map(|&(t, cost)| {
            let (d, next) = decide(p, state.as_ref(), t, p.bounded_cost(cost));
            if let Some(next) = next {
                *state = Some(next);
            }
            d
        })
        .collect()
}

#[test]
fn a_budget_counts_the_report_that_takes_it_past_its_limit() {
    // 10 000 tokens a minute, reports of 3 000: the fourth is answered over its limit, and counted.
    let t0 = 60_000 * 1000;
    for algorithm in ALL {
        let p = budget(algorithm, 10_000, 60_000);
        let mut state = None;
        let reports = [(t0, 3000), (t0 + 1, 3000), (t0 + 2, 3000), (t0 + 3, 3000)];
        let ds = run_counted(&p, &mut state, &reports);
        assert_eq!(allowed(&ds), [true, true, true, false], "{algorithm:?}");
        // A check before the next request (cost 0) and a request costing 1 are both over now.
        for cost in [0, 1] {
            let (d, _) = decide(&p, state.as_ref(), t0 + 4, cost);
            assert!(
                !d.allowed,
                "{algorithm:?}: cost {cost} after 12 000 of 10 000"
            );
        }
        // The same reports without count_over_limit stop counting at 9 000: a check still passes.
        let mut plain = reports.to_vec();
        plain.push((t0 + 4, 0));
        let ds = run(&params(algorithm, 10_000, 60_000, 10_000), &plain);
        assert_eq!(
            allowed(&ds),
            [true, true, true, false, true],
            "{algorithm:?}: without count_over_limit"
        );
    }
}

#[test]
fn each_algorithm_pays_the_excess_back_as_its_formula_says() {
    let t0 = 60_000 * 1000;
    let over_at = |algorithm, after_ms: u64| {
        let p = budget(algorithm, 10_000, 60_000);
        let mut state = None;
        run_counted(&p, &mut state, &[(t0, 9000), (t0, 3000)]);
        let (d, _) = decide(&p, state.as_ref(), t0 + after_ms, 0);
        (!d.allowed, d.retry_ms)
    };
    // Fixed window: 12 000 until the window ends.
    assert_eq!(over_at(Algorithm::FixedWindow, 0), (true, 60_000));
    assert!(over_at(Algorithm::FixedWindow, 59_999).0);
    assert!(!over_at(Algorithm::FixedWindow, 60_000).0);
    // Sliding window: the next window starts under 12 000 x (W - e) / W, within 10 000 from e = W / 6.
    assert_eq!(over_at(Algorithm::SlidingWindow, 60_000), (true, 10_000));
    assert!(over_at(Algorithm::SlidingWindow, 69_999).0);
    assert!(!over_at(Algorithm::SlidingWindow, 70_000).0);
    // Sliding log: every hit stays a whole window.
    assert_eq!(over_at(Algorithm::SlidingLog, 59_999), (true, 1));
    assert!(!over_at(Algorithm::SlidingLog, 60_000).0);
    // Token bucket and GCRA: 2 000 tokens of debt, repaid at 10 000 a minute: 12 s.
    for algorithm in [Algorithm::TokenBucket, Algorithm::Gcra] {
        assert_eq!(over_at(algorithm, 0), (true, 12_000), "{algorithm:?}");
        assert!(over_at(algorithm, 11_999).0, "{algorithm:?}");
        assert!(!over_at(algorithm, 12_000).0, "{algorithm:?}");
    }
}

#[test]
fn one_huge_report_goes_no_further_than_the_debt_bound() {
    let t0 = 60_000 * 1000;
    for algorithm in ALL {
        let p = budget(algorithm, 100, 1000);
        let mut state = None;
        let ds = run_counted(&p, &mut state, &[(t0, u64::MAX), (t0, u64::MAX)]);
        assert!(!ds[0].allowed && !ds[1].allowed);
        let debt = 100 * DEBT_CAPACITIES;
        match state.as_ref().unwrap() {
            State::FixedWindow { count, .. } => assert_eq!(*count, 100 + debt),
            State::SlidingWindow { current, .. } => assert_eq!(*current, 100 + debt),
            State::SlidingLog(log) => {
                assert_eq!(log.entries().map(|e| e.1).sum::<u64>(), 100 + debt);
                assert_eq!(log.len(), 1, "one instant, one entry");
            }
            State::TokenBucket { tokens, .. } => assert_eq!(*tokens, -(debt as f64)),
            State::Gcra { tat_us } => {
                assert_eq!(*tat_us, t0 * 1000 + (100 + debt) * 10_000, "{algorithm:?}")
            }
        }
        // Locked for at most the debt's refill (buckets) or the window (the others), then free again.
        let (d, _) = decide(&p, state.as_ref(), t0, 0);
        let bound = if algorithm.uses_burst() {
            DEBT_CAPACITIES * 1000
        } else {
            2 * 1000
        };
        assert!(!d.allowed && d.retry_ms <= bound, "{algorithm:?}: {d:?}");
        let (d, _) = decide(&p, state.as_ref(), t0 + bound, 0);
        assert!(d.allowed, "{algorithm:?}: free after {bound} ms");
    }
}

#[test]
fn a_sliding_log_that_counts_over_keeps_at_most_two_entries_per_hit_of_its_limit() {
    let p = budget(Algorithm::SlidingLog, 5, 60_000);
    let mut state = None;
    // Reports of 1 every millisecond: past the limit, hits keep being recorded (up to the debt), in at
    // most 10 entries, and none of them leaves the window before it would have.
    let hits: Vec<(u64, u64)> = (0..40).map(|i| (1_000_000 + i, 1)).collect();
    run_counted(&p, &mut state, &hits);
    let Some(State::SlidingLog(log)) = &state else {
        panic!("a log")
    };
    assert_eq!(log.len(), 10);
    assert_eq!(log.entries().map(|e| e.1).sum::<u64>(), 40);
    assert_eq!(
        log.entries().next_back().unwrap(),
        (1_000_039, 31),
        "the newest took the rest in"
    );
    // 35 hits must leave before a hit fits: the newest entry leaves a whole window after its last hit.
    let (d, _) = decide(&p, state.as_ref(), 1_000_039, 1);
    assert_eq!(d.retry_ms, 60_000);
}

/// Every algorithm.
const ALL: [Algorithm; 5] = [
    Algorithm::FixedWindow,
    Algorithm::SlidingWindow,
    Algorithm::SlidingLog,
    Algorithm::TokenBucket,
    Algorithm::Gcra,
];

proptest! {
    #[test]
    fn a_budget_loses_no_hit_below_its_debt_bound(hits in hits(), limit in 1u64..20) {
        // A fixed window of a day holds every reported hit, up to limit + debt, whatever was allowed.
        let p = budget(Algorithm::FixedWindow, limit, 86_400_000);
        let mut state = None;
        let ds = run_counted(&p, &mut state, &hits);
        let mut total = 0u64;
        for (d, &(_, cost)) in ds.iter().zip(&hits) {
            prop_assert_eq!(d.allowed, total + cost <= limit);
            total = (total + cost).min(limit * (1 + DEBT_CAPACITIES));
        }
        let count = match state { Some(State::FixedWindow { count, .. }) => count, _ => 0 };
        prop_assert_eq!(count, total);
    }

    #[test]
    fn a_bucket_in_debt_repays_at_its_refill_rate(hits in hits(), limit in 1u64..20, burst in 1u64..20) {
        // 1024 ms windows and power-of-two rates keep the float arithmetic exact.
        let p = Params { count_over_limit: true, ..params(Algorithm::TokenBucket, limit, 1024, burst) };
        let mut state: Option<State> = None;
        let mut tokens = burst as f64;
        let mut last = hits[0].0;
        for &(t, cost) in &hits {
            tokens = (tokens + (t - last) as f64 * limit as f64 / 1024.0).min(burst as f64);
            last = t;
            let (d, next) = decide(&p, state.as_ref(), t, cost);
            prop_assert_eq!(d.allowed, cost as f64 <= tokens);
            tokens = (tokens - cost as f64).max(-((burst * DEBT_CAPACITIES) as f64));
            if let Some(next) = next { state = Some(next); }
        }
    }
}

#[test]
fn usage_reads_what_each_algorithm_holds_without_changing_it() {
    let t0 = 60_000 * 1000;
    for algorithm in ALL {
        let p = budget(algorithm, 10, 60_000);
        let mut state = None;
        run_counted(&p, &mut state, &[(t0, 4)]);
        let u = usage(&p, state.as_ref(), t0);
        assert_eq!(
            (u.used, u.remaining, u.over),
            (4.0, 6, false),
            "{algorithm:?}"
        );
        run_counted(&p, &mut state, &[(t0, 9)]);
        let u = usage(&p, state.as_ref(), t0);
        assert_eq!(
            (u.used, u.remaining, u.over),
            (13.0, 0, true),
            "{algorithm:?}"
        );
        assert!(u.reset_ms > 0, "{algorithm:?}");
        assert_eq!(usage(&p, None, t0).used, 0.0);
        // At its limit exactly, the next hit is denied: over, as a caller sees it.
        let mut state = None;
        run_counted(&p, &mut state, &[(t0, 10)]);
        let u = usage(&p, state.as_ref(), t0);
        assert_eq!(
            (u.used, u.remaining, u.over),
            (10.0, 0, true),
            "{algorithm:?}"
        );
    }
}
