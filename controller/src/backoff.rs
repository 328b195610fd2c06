//! Bounded, jittered exponential backoff (no busy loops on a failing API server).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Retry settings of the publisher.
#[derive(Debug, Clone, PartialEq)]
pub struct BackoffConfig {
    /// First delay after a failure.
    pub initial: Duration,
    /// Largest delay between attempts (the publisher keeps retrying at this pace).
    pub max: Duration,
    /// Immediate re-read-and-retry rounds on 409 conflicts within one sync.
    pub conflict_retries: u32,
}

impl Default for BackoffConfig {
    fn default() -> Self {
        Self {
            initial: Duration::from_millis(100),
            max: Duration::from_secs(30),
            conflict_retries: 5,
        }
    }
}

/// Delay sequence: `initial * 2^n` capped at `max`, each with ±25 % jitter.
#[derive(Debug, Clone)]
pub struct Backoff {
    config: BackoffConfig,
    attempt: u32,
    seed: u64,
}

impl Backoff {
    /// Starts a sequence.
    pub fn new(config: BackoffConfig) -> Self {
        let seed = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0x9e37_79b9, |d| d.subsec_nanos().into());
        Self {
            config,
            attempt: 0,
            seed: seed | 1,
        }
    }

    /// Forgets past failures.
    pub fn reset(&mut self) {
        self.attempt = 0;
    }

    /// Failures since the last reset.
    pub fn attempts(&self) -> u32 {
        self.attempt
    }

    /// The delay before the next attempt.
    pub fn next_delay(&mut self) -> Duration {
        let base = self
            .config
            .initial
            .saturating_mul(1u32 << self.attempt.min(20))
            .min(self.config.max);
        self.attempt = self.attempt.saturating_add(1);
        // xorshift64: jitter only, no cryptographic need.
        self.seed ^= self.seed << 13;
        self.seed ^= self.seed >> 7;
        self.seed ^= self.seed << 17;
        let frac = (self.seed % 1000) as f64 / 1000.0; // [0, 1)
        base.mul_f64(0.75 + 0.5 * frac).min(self.config.max)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grows_jittered_and_stays_bounded() {
        let cfg = BackoffConfig {
            initial: Duration::from_millis(100),
            max: Duration::from_secs(2),
            conflict_retries: 1,
        };
        let mut b = Backoff::new(cfg);
        let d: Vec<Duration> = (0..10).map(|_| b.next_delay()).collect();
        assert!(
            d[0] >= Duration::from_millis(75) && d[0] <= Duration::from_millis(125),
            "{d:?}"
        );
        assert!(
            d[3] >= Duration::from_millis(600) && d[3] <= Duration::from_millis(1000),
            "{d:?}"
        );
        assert!(d.iter().all(|x| *x <= Duration::from_secs(2)));
        assert!(d[9] >= Duration::from_millis(1500));
        b.reset();
        assert!(b.next_delay() <= Duration::from_millis(125));
    }
}
