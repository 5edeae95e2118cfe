//! Synthetic serving workloads: seeded lognormal lengths and random prompt ids, the same on any
//! machine (real prompts are not needed to measure scheduling: with replayed exit depths the
//! tokens' values do not change the work).

/// One request of a workload: prompt ids and how many tokens to generate (eos ignored).
pub struct Job {
    pub prompt: Vec<u32>,
    pub new_tokens: usize,
}

fn lognormal(median: f64, sigma: f64, lo: usize, hi: usize, x: &mut u64) -> usize {
    let mut uniform = || {
        *x ^= *x << 13;
        *x ^= *x >> 7;
        *x ^= *x << 17;
        ((*x >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    };
    let z = (-2.0 * uniform().ln()).sqrt() * (std::f64::consts::TAU * uniform()).cos();
    ((median * (sigma * z).exp()).round() as usize).clamp(lo, hi)
}

/// Lognormal prompt and output lengths (median, σ, clipped to 8..=max). The defaults are
/// ShareGPT-like with short outputs: about half of all tokens are prompt tokens, which run full
/// depth in every mode. `bench_looped`'s decode-heavy Huginn runs use outputs of median 640,
/// max 2048.
#[derive(Debug, Clone, Copy)]
pub struct Lengths {
    pub prompt_median: f64,
    pub prompt_max: usize,
    pub output_median: f64,
    pub output_max: usize,
}

impl Default for Lengths {
    fn default() -> Self {
        Self { prompt_median: 128.0, prompt_max: 512, output_median: 160.0, output_max: 256 }
    }
}

impl Lengths {
    /// ShareGPT-like: long prompts and long answers (the default).
    pub fn sharegpt() -> Self {
        Self::default()
    }

    /// Alpaca-like: short instructions and short answers (medians 20 and 48 tokens), about a
    /// seventh of ShareGPT's output, as the CDB evaluation's knees on the two sets differ.
    pub fn alpaca() -> Self {
        Self { prompt_median: 20.0, prompt_max: 128, output_median: 48.0, output_max: 256 }
    }

    const PROMPT_SIGMA: f64 = 0.9;
    const OUTPUT_SIGMA: f64 = 0.7;

    /// The distribution as recorded in benchmark JSON (`workload`).
    pub fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "prompt": { "median": self.prompt_median, "sigma": Self::PROMPT_SIGMA, "min": 8, "max": self.prompt_max },
            "output": { "median": self.output_median, "sigma": Self::OUTPUT_SIGMA, "min": 8, "max": self.output_max },
        })
    }
}

/// `n` requests with lengths drawn from `len` (both at most half the context) and uniformly
/// random prompt ids; the same arguments give the same workload on any machine.
pub fn workload(n: usize, vocab: usize, max_context: usize, seed: u64, len: Lengths) -> Vec<Job> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|i| {
            let p = lognormal(len.prompt_median, Lengths::PROMPT_SIGMA, 8, len.prompt_max.min(max_context / 2), &mut x);
            let o = lognormal(len.output_median, Lengths::OUTPUT_SIGMA, 8, len.output_max.min(max_context / 2), &mut x);
            Job { prompt: random_ids(p, vocab, seed ^ ((i as u64 + 1) * 7919)), new_tokens: o }
        })
        .collect()
}

/// `n` token ids, uniform over the vocabulary, from a seeded xorshift.
pub fn random_ids(n: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % vocab as u64) as u32
        })
        .collect()
}
