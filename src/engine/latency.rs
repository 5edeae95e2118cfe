//! Latency distributions of a running engine (time to first token, inter-token latency) in
//! constant memory: a log-scale histogram whose buckets are 2 % wide, so percentiles are exact
//! to 2 % however many tokens an engine serves.

use std::time::Duration;

/// Smallest latency told apart (shorter ones fall in the first bucket).
const FLOOR_S: f64 = 1e-6;
/// Bucket `i` holds latencies up to `FLOOR_S · GROWTH^i`.
const GROWTH: f64 = 1.02;
/// 1 µs · 1.02^1400 ≈ 10^6 s: longer latencies fall in the last bucket.
const BUCKETS: usize = 1400;

/// A latency distribution; see the module docs.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LatencyHistogram {
    counts: Vec<u64>,
    total: u64,
    sum_s: f64,
    max_s: f64,
}

impl LatencyHistogram {
    pub fn record(&mut self, d: Duration) {
        let s = d.as_secs_f64();
        let i = if s <= FLOOR_S { 0 } else { ((s / FLOOR_S).ln() / GROWTH.ln()).ceil() as usize };
        let i = i.min(BUCKETS - 1);
        if self.counts.len() <= i {
            self.counts.resize(i + 1, 0);
        }
        self.counts[i] += 1;
        self.total += 1;
        self.sum_s += s;
        self.max_s = self.max_s.max(s);
    }

    /// Latencies recorded.
    pub fn count(&self) -> u64 {
        self.total
    }

    pub fn mean(&self) -> Option<Duration> {
        (self.total > 0).then(|| Duration::from_secs_f64(self.sum_s / self.total as f64))
    }

    pub fn max(&self) -> Option<Duration> {
        (self.total > 0).then(|| Duration::from_secs_f64(self.max_s))
    }

    /// The `q`-quantile (`q` in 0..=1; p99 is `0.99`): the upper edge of the bucket holding it,
    /// at most 2 % above the true value, never above the largest latency recorded.
    pub fn quantile(&self, q: f64) -> Option<Duration> {
        if self.total == 0 {
            return None;
        }
        let rank = ((q.clamp(0.0, 1.0) * self.total as f64).ceil() as u64).max(1);
        let mut seen = 0;
        for (i, &c) in self.counts.iter().enumerate() {
            seen += c;
            if seen >= rank {
                let edge = FLOOR_S * GROWTH.powi(i as i32);
                return Some(Duration::from_secs_f64(edge.min(self.max_s)));
            }
        }
        self.max()
    }

    /// Latencies recorded within `bound`, to the histogram's resolution (a bucket counts when
    /// its upper edge is at most `bound`): the cumulative counts a Prometheus histogram exports.
    pub fn count_within(&self, bound: Duration) -> u64 {
        let b = bound.as_secs_f64();
        self.counts.iter().enumerate().take_while(|&(i, _)| FLOOR_S * GROWTH.powi(i as i32) <= b * (1.0 + 1e-12)).map(|(_, &c)| c).sum()
    }

    /// The sum of every latency recorded.
    pub fn sum(&self) -> Duration {
        Duration::from_secs_f64(self.sum_s)
    }

    /// `(p50, p90, p99)`.
    pub fn p50_p90_p99(&self) -> Option<(Duration, Duration, Duration)> {
        Some((self.quantile(0.5)?, self.quantile(0.9)?, self.quantile(0.99)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cumulative_counts_and_the_sum() {
        let mut h = LatencyHistogram::default();
        for ms in [1, 2, 2, 50, 900] {
            h.record(Duration::from_millis(ms));
        }
        // A latency counts within a bound 2 % (a bucket) above it.
        let within = |us| h.count_within(Duration::from_micros(us));
        assert_eq!((within(0), within(1_030), within(3_000), within(100_000), within(10_000_000)), (0, 1, 3, 4, 5));
        assert_eq!(within(990), 0);
        assert!((h.sum().as_secs_f64() - 0.955).abs() < 1e-9);
    }

    #[test]
    fn quantiles_are_within_two_percent() {
        let mut h = LatencyHistogram::default();
        assert_eq!(h.quantile(0.5), None);
        for ms in 1..=1000 {
            h.record(Duration::from_micros(ms * 1000));
        }
        assert_eq!(h.count(), 1000);
        for (q, want_ms) in [(0.5, 500.0), (0.9, 900.0), (0.99, 990.0), (1.0, 1000.0)] {
            let got = h.quantile(q).unwrap().as_secs_f64() * 1e3;
            assert!(got >= want_ms * 0.999 && got <= want_ms * 1.02, "q{q}: {got} ms vs {want_ms}");
        }
        assert!((h.mean().unwrap().as_secs_f64() - 0.5005).abs() < 1e-9);
        assert_eq!(h.max(), Some(Duration::from_secs(1)));
        // Memory stays bounded by the bucket count, whatever is recorded.
        h.record(Duration::from_secs(10_000_000));
        h.record(Duration::ZERO);
        assert!(h.counts.len() <= BUCKETS);
    }
}
