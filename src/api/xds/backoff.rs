//! The waits between attempts to reach the control plane (`XDS_CLIENT_BACKOFF_*`): `initial` after the
//! first failure, doubling up to `max`, each varied at random by up to `random_factor` of itself when
//! `jitter` is on, and never longer than `max`. The reference passes its random factor to its backoff as the growth factor, so with
//! the default 0.5 its waits never grow past `initial`; here the variables mean what they say.

use std::time::Duration;

use super::BackoffSettings;

/// Where in its sequence of waits the client is.
#[derive(Debug, Clone)]
pub struct Backoff {
    settings: BackoffSettings,
    /// Failures since the last answered stream.
    attempt: u32,
}

impl Backoff {
    pub fn new(settings: &BackoffSettings) -> Self {
        Self {
            settings: settings.clone(),
            attempt: 0,
        }
    }

    /// Starts the sequence over: the control plane answered.
    pub fn reset(&mut self) {
        self.attempt = 0;
    }

    /// The wait before the next attempt.
    pub fn next_wait(&mut self) -> Duration {
        let wait = self.wait(self.attempt, rand::random::<f64>());
        self.attempt = self.attempt.saturating_add(1);
        wait
    }

    /// The wait after `attempt` failures, with `unit` (0 to 1) drawn at random.
    fn wait(&self, attempt: u32, unit: f64) -> Duration {
        let s = &self.settings;
        let doubled = s
            .initial
            .saturating_mul(2u32.saturating_pow(attempt.min(31)))
            .min(s.max);
        if !s.jitter || s.random_factor == 0.0 {
            return doubled;
        }
        // Uniform in [1 - factor, 1 + factor] times the wait.
        let scale = 1.0 + s.random_factor * (2.0 * unit.clamp(0.0, 1.0) - 1.0);
        doubled.mul_f64(scale).min(s.max)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn backoff(jitter: bool) -> Backoff {
        Backoff::new(&BackoffSettings {
            initial: Duration::from_secs(10),
            max: Duration::from_secs(60),
            random_factor: 0.5,
            jitter,
        })
    }

    #[test]
    fn waits_double_up_to_the_max() {
        let b = backoff(false);
        let waits: Vec<u64> = (0..6).map(|n| b.wait(n, 0.9).as_secs()).collect();
        assert_eq!(waits, [10, 20, 40, 60, 60, 60]);
        assert_eq!(b.wait(u32::MAX, 0.0), Duration::from_secs(60));
    }

    #[test]
    fn jitter_varies_each_wait_by_the_random_factor() {
        let b = backoff(true);
        assert_eq!(b.wait(0, 0.0), Duration::from_secs(5));
        assert_eq!(b.wait(0, 0.5), Duration::from_secs(10));
        assert_eq!(b.wait(0, 1.0), Duration::from_secs(15));
        // The max is the longest wait, jitter or not.
        assert_eq!(b.wait(5, 1.0), Duration::from_secs(60));
        assert_eq!(b.wait(5, 0.0), Duration::from_secs(30));
    }

    #[test]
    fn an_answer_starts_the_sequence_over() {
        let mut b = backoff(false);
        b.next_wait();
        b.next_wait();
        assert_eq!(b.next_wait(), Duration::from_secs(40));
        b.reset();
        assert_eq!(b.next_wait(), Duration::from_secs(10));
    }
}
