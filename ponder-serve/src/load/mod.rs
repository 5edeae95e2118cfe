//! Live load, as `benchmark_serving` measures it: requests sent at open-loop arrival times
//! (Poisson at a rate, or a burst), each token's arrival recorded, and the latency figures a
//! person choosing an engine for live traffic reads — time to first token, time per output
//! token, inter-token latency, end-to-end and normalized latency (end-to-end ÷ output tokens),
//! goodput under a latency objective — over a measurement window after a warm-up.
//!
//! Two drivers send the same arrivals: [`in_process`] through an [`ponder::EngineHandle`],
//! [`http`] through the OpenAI API of a server (`POST /v1/completions`, streamed).

mod drive;
mod summary;

pub use drive::{http, in_process};
pub use summary::{summarize, Percentiles, Slo, Summary};

use std::time::Duration;

/// One request of a trace: when it is sent (from the start of the run), its prompt ids and how
/// many tokens it generates (end of sequence ignored, so the work is the trace's).
#[derive(Debug, Clone, PartialEq)]
pub struct Arrival {
    pub at: Duration,
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
}

/// What happened to one request, times from the start of the run.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Record {
    /// When it was due to be sent (its arrival time).
    pub sent: Duration,
    /// When each output token arrived (a chunk carrying several tokens gives them one time).
    pub tokens: Vec<Duration>,
    /// When its last event arrived; `None` if it never ended within the run.
    pub ended: Option<Duration>,
    /// Why it failed (rejected, an error event, a dropped connection).
    pub error: Option<String>,
}

impl Record {
    /// Ended without error, with at least one token.
    pub fn completed(&self) -> bool {
        self.error.is_none() && self.ended.is_some() && !self.tokens.is_empty()
    }
}

/// Open-loop arrival times for `n` requests: exponential gaps of mean `1 / rate` (Poisson) from
/// a seeded generator, or all at once when `rate` is `None` (a burst).
pub fn arrival_times(n: usize, rate: Option<f64>, seed: u64) -> Vec<Duration> {
    let Some(rate) = rate else {
        return vec![Duration::ZERO; n];
    };
    let mut state = seed ^ 0x5DEE_CE66_D1CE_4E5B;
    let mut t = 0.0f64;
    (0..n)
        .map(|_| {
            state = splitmix(state);
            // (0, 1]: never ln(0).
            let u = ((state >> 11) as f64 + 1.0) / (1u64 << 53) as f64;
            t += -u.ln() / rate;
            Duration::from_secs_f64(t)
        })
        .collect()
}

fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A trace: `jobs` (prompt ids, output length; cycled) sent at `rate` requests per second for
/// `warmup + duration` seconds (at least one request), or all of them at once.
pub fn trace(jobs: &[(Vec<u32>, usize)], rate: Option<f64>, warmup: Duration, duration: Duration, seed: u64) -> Vec<Arrival> {
    let n = match rate {
        Some(r) => ((r * (warmup + duration).as_secs_f64()).round() as usize).max(1),
        None => jobs.len(),
    };
    arrival_times(n, rate, seed)
        .into_iter()
        .zip(jobs.iter().cycle())
        .map(|(at, (prompt, max_tokens))| Arrival { at, prompt: prompt.clone(), max_tokens: *max_tokens })
        .collect()
}
