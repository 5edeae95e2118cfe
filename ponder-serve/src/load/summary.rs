//! The figures of one run: over the requests that arrived in the measurement window, throughput
//! and latency distributions, in `benchmark_serving`'s definitions.

use super::Record;
use serde::Serialize;
use std::time::Duration;

/// A latency objective: a request meets it when its time to first token and its time per
/// output token are within these.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Slo {
    pub ttft_ms: f64,
    pub tpot_ms: f64,
}

/// Mean and nearest-rank percentiles of a sample, in milliseconds (zeros when it is empty).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Percentiles {
    pub count: usize,
    pub mean: f64,
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub max: f64,
}

impl Percentiles {
    pub fn of(mut values: Vec<f64>) -> Self {
        if values.is_empty() {
            return Self::default();
        }
        values.sort_by(f64::total_cmp);
        let n = values.len();
        // Nearest rank: the smallest value with at least p % of the sample at or below it.
        let at = |p: f64| values[((p / 100.0 * n as f64).ceil() as usize).clamp(1, n) - 1];
        Self { count: n, mean: values.iter().sum::<f64>() / n as f64, p50: at(50.0), p90: at(90.0), p99: at(99.0), max: values[n - 1] }
    }
}

/// One run's figures over the requests that arrived in the window.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Summary {
    /// Requests that arrived in the window; of them completed, and failed or unfinished.
    pub requests: usize,
    pub completed: usize,
    pub failed: usize,
    /// From the window's start to the last measured request's end.
    pub duration_s: f64,
    /// Completed requests and their output tokens per second of `duration_s`.
    pub request_throughput: f64,
    pub output_throughput: f64,
    /// Time to first token: first token − arrival.
    pub ttft_ms: Percentiles,
    /// Time per output token after the first: (end-to-end − TTFT) ÷ (tokens − 1).
    pub tpot_ms: Percentiles,
    /// Inter-token latency: every gap between a request's consecutive tokens.
    pub itl_ms: Percentiles,
    /// End-to-end: last token − arrival.
    pub e2e_ms: Percentiles,
    /// End-to-end ÷ output tokens, per request.
    pub normalized_ms: Percentiles,
    /// Completed requests per second that met `slo`.
    pub goodput: f64,
    pub slo: Slo,
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// The figures of `records` that arrived in `[window.0, window.1)`.
pub fn summarize(records: &[Record], window: (Duration, Duration), slo: Slo) -> Summary {
    let measured: Vec<&Record> = records.iter().filter(|r| r.sent >= window.0 && r.sent < window.1).collect();
    let done: Vec<&Record> = measured.iter().copied().filter(|r| r.completed()).collect();
    let last_end = done.iter().filter_map(|r| r.tokens.last()).max().copied();
    let duration = last_end.map_or(window.1 - window.0, |e| e.saturating_sub(window.0)).max(Duration::from_micros(1)).as_secs_f64();
    let (mut ttft, mut tpot, mut itl, mut e2e, mut norm, mut good) = (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new(), 0usize);
    let mut tokens = 0usize;
    for r in &done {
        let first = ms(r.tokens[0].saturating_sub(r.sent));
        let total = ms(r.tokens[r.tokens.len() - 1].saturating_sub(r.sent));
        let per_token = (r.tokens.len() > 1).then(|| (total - first) / (r.tokens.len() - 1) as f64);
        ttft.push(first);
        e2e.push(total);
        norm.push(total / r.tokens.len() as f64);
        tpot.extend(per_token);
        itl.extend(r.tokens.windows(2).map(|w| ms(w[1].saturating_sub(w[0]))));
        tokens += r.tokens.len();
        good += usize::from(first <= slo.ttft_ms && per_token.is_none_or(|t| t <= slo.tpot_ms));
    }
    Summary {
        requests: measured.len(),
        completed: done.len(),
        failed: measured.len() - done.len(),
        duration_s: duration,
        request_throughput: done.len() as f64 / duration,
        output_throughput: tokens as f64 / duration,
        ttft_ms: Percentiles::of(ttft),
        tpot_ms: Percentiles::of(tpot),
        itl_ms: Percentiles::of(itl),
        e2e_ms: Percentiles::of(e2e),
        normalized_ms: Percentiles::of(norm),
        goodput: good as f64 / duration,
        slo,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(ms: u64) -> Duration {
        Duration::from_millis(ms)
    }

    #[test]
    fn figures_follow_their_definitions() {
        let records = vec![
            // Before the window: not measured.
            Record { sent: at(0), tokens: vec![at(5)], ended: Some(at(5)), error: None },
            // 3 tokens: TTFT 10, e2e 30, TPOT 10, normalized 10.
            Record { sent: at(100), tokens: vec![at(110), at(120), at(130)], ended: Some(at(130)), error: None },
            // 2 tokens: TTFT 50, e2e 90, TPOT 40, normalized 45.
            Record { sent: at(200), tokens: vec![at(250), at(290)], ended: Some(at(290)), error: None },
            // Failed: counted, not in the latencies.
            Record { sent: at(300), tokens: vec![], ended: None, error: Some("x".into()) },
        ];
        let s = summarize(&records, (at(100), at(1000)), Slo { ttft_ms: 20.0, tpot_ms: 20.0 });
        assert_eq!((s.requests, s.completed, s.failed), (3, 2, 1));
        assert!((s.duration_s - 0.190).abs() < 1e-9);
        assert_eq!((s.ttft_ms.p50, s.ttft_ms.p99), (10.0, 50.0));
        assert_eq!((s.tpot_ms.mean, s.e2e_ms.max), (25.0, 90.0));
        assert_eq!(s.normalized_ms.mean, 27.5);
        assert_eq!(s.itl_ms.count, 3);
        assert!((s.output_throughput - 5.0 / 0.190).abs() < 1e-9);
        // Only the first meets TTFT ≤ 20 ms and TPOT ≤ 20 ms.
        assert!((s.goodput - 1.0 / 0.190).abs() < 1e-9);
        assert_eq!(Percentiles::of(vec![]), Percentiles::default());
        let p = Percentiles::of((1..=100).map(f64::from).collect());
        assert_eq!((p.p50, p.p90, p.p99, p.max), (50.0, 90.0, 99.0, 100.0));
    }

    #[test]
    fn poisson_arrivals_have_the_asked_rate_and_a_burst_is_at_once() {
        let t = super::super::arrival_times(20_000, Some(50.0), 0);
        assert!(t.windows(2).all(|w| w[0] <= w[1]));
        let rate = t.len() as f64 / t.last().unwrap().as_secs_f64();
        assert!((rate - 50.0).abs() < 1.5, "{rate}");
        assert_eq!(super::super::arrival_times(20_000, Some(50.0), 0), t, "seeded");
        assert_ne!(super::super::arrival_times(100, Some(50.0), 1), t[..100].to_vec());
        assert!(super::super::arrival_times(5, None, 0).iter().all(|d| d.is_zero()));
    }
}
