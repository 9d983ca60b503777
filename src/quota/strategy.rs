//! A grant (tokens per second) as the strategy an Envoy enforces, written for how Envoy's filter reads
//! it.
//!
//! How Envoy's quota filter reads it (envoyproxy/envoy,
//! `source/extensions/filters/http/rate_limit_quota/global_client_impl.cc`: `createTokenBucketFromAction`
//! and `protoTokenBucketsEq`; `source/common/common/token_bucket_impl.cc`: `AtomicTokenBucketImpl`): it
//! builds a bucket of `max_tokens` that refills continuously at `tokens_per_fill / fill_interval` tokens
//! a second, with the interval read in whole seconds (under a second divides by zero), and that starts
//! full; it keeps the bucket it holds, tokens and all, when `max_tokens` and `tokens_per_fill` are equal
//! and the interval's *nanoseconds* are: it does not compare the interval's seconds. So:
//! - `tokens_per_fill` is always sent, and the interval is whole seconds, from 1 s up to an hour, the
//!   shortest that carries at least 16 tokens a fill, so the rate is exact to within about a sixteenth
//!   where it can be; it is rounded down, never up.
//! - `max_tokens` is `burst` seconds of the grant (at least one token): what a new bucket may admit at
//!   once, beyond its rate. That is what each changed assignment can cost beyond the limit, so the burst
//!   is short: a tenth of a report period, from 100 ms to a second. It may be below `tokens_per_fill` (1
//!   token and 16 per 54 s for 0.3 a second): the refill is continuous, so the rate is still the grant.
//! - When only the interval would change, `max_tokens` moves by one, so that the new assignment differs
//!   in more than the interval and is not taken for the one Envoy holds.

/// An Envoy's token bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenBucket {
    pub max_tokens: u32,
    pub tokens_per_fill: u32,
    pub fill_interval_secs: u32,
}

impl TokenBucket {
    /// Tokens per second it admits, sustained.
    pub fn rate(&self) -> f64 {
        f64::from(self.tokens_per_fill) / f64::from(self.fill_interval_secs)
    }
}

/// What an Envoy is told to do with a bucket's requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Strategy {
    AllowAll,
    DenyAll,
    TokenBucket(TokenBucket),
}

/// Longest fill interval sent: a grant below one token an hour is sent as DENY_ALL.
pub const MAX_FILL_INTERVAL_SECS: u32 = 3_600;

/// Tokens a fill carries at least, where an interval of at most an hour allows it.
const MIN_TOKENS_PER_FILL: f64 = 16.0;

/// The strategy of a grant of `grant` tokens per second with a capacity of `burst` seconds of it, given
/// what the Envoy was sent before for the bucket (see the module documentation).
pub fn for_grant(grant: f64, burst: f64, previous: Option<&Strategy>) -> Strategy {
    if grant.is_nan() || grant <= 0.0 {
        return Strategy::DenyAll;
    }
    let interval = (MIN_TOKENS_PER_FILL / grant)
        .ceil()
        .clamp(1.0, f64::from(MAX_FILL_INTERVAL_SECS));
    let per_fill = (grant * interval).floor().min(f64::from(u32::MAX));
    if per_fill < 1.0 {
        return Strategy::DenyAll;
    }
    let mut bucket = TokenBucket {
        max_tokens: (grant * burst).floor().clamp(1.0, f64::from(u32::MAX)) as u32,
        tokens_per_fill: per_fill as u32,
        fill_interval_secs: interval as u32,
    };
    if let Some(Strategy::TokenBucket(before)) = previous {
        if before.max_tokens == bucket.max_tokens
            && before.tokens_per_fill == bucket.tokens_per_fill
            && before.fill_interval_secs != bucket.fill_interval_secs
        {
            bucket.max_tokens = match bucket.max_tokens {
                u32::MAX => u32::MAX - 1,
                n => n + 1,
            };
        }
    }
    Strategy::TokenBucket(bucket)
}

#[cfg(test)]
mod tests {
    use proptest::{prop_assert, proptest};

    use super::*;

    fn bucket(s: Strategy) -> TokenBucket {
        match s {
            Strategy::TokenBucket(b) => b,
            other => panic!("not a token bucket: {other:?}"),
        }
    }

    #[test]
    fn large_grants_fill_every_second_with_the_burst_asked() {
        assert_eq!(
            bucket(for_grant(250.7, 1.0, None)),
            TokenBucket {
                max_tokens: 250,
                tokens_per_fill: 250,
                fill_interval_secs: 1
            }
        );
        assert_eq!(bucket(for_grant(250.7, 0.1, None)).max_tokens, 25);
    }

    #[test]
    fn small_grants_fill_less_often_and_never_round_up() {
        // 0.3 per second: 16 tokens every 54 s, one at a time.
        let b = bucket(for_grant(0.3, 1.0, None));
        assert_eq!(
            b,
            TokenBucket {
                max_tokens: 1,
                tokens_per_fill: 16,
                fill_interval_secs: 54
            }
        );
        assert!(b.rate() <= 0.3);
        // Less than one token an hour is no token at all.
        assert_eq!(for_grant(1.0 / 4_000.0, 1.0, None), Strategy::DenyAll);
        assert_eq!(for_grant(0.0, 1.0, None), Strategy::DenyAll);
        assert_eq!(for_grant(f64::NAN, 1.0, None), Strategy::DenyAll);
    }

    #[test]
    fn a_change_envoy_would_miss_moves_max_tokens() {
        // 16 tokens per 32 s and per 64 s differ only in the interval: the second one carries one more
        // token of burst, so that it differs in max_tokens too.
        let before = for_grant(0.5, 1.0, None);
        let after = bucket(for_grant(0.25, 1.0, Some(&before)));
        assert_eq!(bucket(before).tokens_per_fill, after.tokens_per_fill);
        assert_eq!(after.max_tokens, bucket(before).max_tokens + 1);
    }

    proptest! {
        #[test]
        fn the_rate_sent_is_never_above_the_grant_and_close_to_it_where_it_can_be(
            grant in 0.001f64..1e9,
        ) {
            match for_grant(grant, 0.5, None) {
                Strategy::TokenBucket(b) => {
                    prop_assert!(b.rate() <= grant);
                    prop_assert!(b.fill_interval_secs >= 1);
                    prop_assert!(f64::from(b.max_tokens) <= (grant * 0.5).max(1.0));
                    if grant >= 16.0 / f64::from(MAX_FILL_INTERVAL_SECS) {
                        prop_assert!(b.rate() >= grant * (1.0 - 1.0 / 15.0), "{b:?} for {grant}");
                    }
                }
                Strategy::DenyAll => prop_assert!(grant * f64::from(MAX_FILL_INTERVAL_SECS) < 1.0),
                Strategy::AllowAll => prop_assert!(false),
            }
        }
    }
}
