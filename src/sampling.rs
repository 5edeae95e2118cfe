//! Batched sampling on the device: greedy, temperature, top-k, top-p, per-request seeds.
//!
//! Only the sampled ids cross to the host. Top-k / top-p thresholds and the inverse-CDF draw
//! are found by bisection with elementwise ops and row reductions, which needs no sort or
//! cumulative sum over the vocabulary (candle's `cumsum` is a V×V matmul) and runs the same on
//! every backend. The per-request randomness is one uniform number per row, drawn on the host
//! from the request's own seeded generator, so a request samples the same tokens whatever it
//! is batched with.

use candle_core::{DType, Result, Tensor, D};
use rand::{Rng, SeedableRng};

/// Per-request sampling parameters.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy (argmax).
    pub temperature: f32,
    /// Keep only the `k` most probable tokens.
    pub top_k: Option<usize>,
    /// Keep the smallest set of most probable tokens whose mass reaches `p`.
    pub top_p: Option<f32>,
    /// Seed of the request's generator; `None` draws one from the OS.
    pub seed: Option<u64>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self { temperature: 0.0, top_k: None, top_p: None, seed: None }
    }
}

impl SamplingParams {
    pub fn greedy() -> Self {
        Self::default()
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0 || self.top_k == Some(1)
    }

    /// Checks the ranges; the message says which parameter is off.
    pub fn validate(&self) -> std::result::Result<(), String> {
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return Err(format!("temperature {} must be finite and >= 0", self.temperature));
        }
        if self.top_k == Some(0) {
            return Err("top_k must be >= 1".into());
        }
        if let Some(p) = self.top_p {
            if !(p > 0.0 && p <= 1.0) {
                return Err(format!("top_p {p} must be in (0, 1]"));
            }
        }
        Ok(())
    }
}

/// A request's sampling state: its parameters and its own random generator.
#[derive(Debug, Clone)]
pub struct Sampler {
    params: SamplingParams,
    rng: rand::rngs::StdRng,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Self {
        let rng = match params.seed {
            Some(s) => rand::rngs::StdRng::seed_from_u64(s),
            None => rand::rngs::StdRng::from_os_rng(),
        };
        Self { params, rng }
    }

    /// The row description for one draw (advances the generator only for random draws).
    pub fn next_row(&mut self) -> RowSampling {
        let uniform = if self.params.is_greedy() { 0.0 } else { self.rng.random::<f32>() };
        RowSampling {
            temperature: self.params.temperature,
            top_k: self.params.top_k,
            top_p: self.params.top_p,
            uniform,
            greedy: self.params.is_greedy(),
            forced: None,
        }
    }
}

/// One row of a sampling call.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RowSampling {
    pub temperature: f32,
    pub top_k: Option<usize>,
    pub top_p: Option<f32>,
    /// Uniform draw in [0, 1) for the inverse-CDF step.
    pub uniform: f32,
    pub greedy: bool,
    /// Teacher forcing: emit this token instead of sampling, and report its log-probability
    /// under the model (scoring, perplexity).
    pub forced: Option<u32>,
}

impl RowSampling {
    pub fn greedy() -> Self {
        Self { temperature: 0.0, top_k: None, top_p: None, uniform: 0.0, greedy: true, forced: None }
    }
}

/// Tokens for `rows` (forced ones where given, sampled otherwise) and, for forced rows, the
/// log-probability of the forced token under the untempered model distribution.
pub fn sample_or_force(logits: &Tensor, rows: &[RowSampling]) -> Result<(Vec<u32>, Vec<Option<f32>>)> {
    let forced: Vec<usize> = (0..rows.len()).filter(|&r| rows[r].forced.is_some()).collect();
    let mut tokens = if forced.len() == rows.len() { vec![0; rows.len()] } else { sample(logits, rows)? };
    let mut logprobs = vec![None; rows.len()];
    if !forced.is_empty() {
        let dev = logits.device();
        let idx = Tensor::new(forced.iter().map(|&r| r as u32).collect::<Vec<_>>().as_slice(), dev)?;
        let ids: Vec<u32> = forced.iter().map(|&r| rows[r].forced.expect("forced")).collect();
        // A model may hand over a view (Huginn narrows its padded vocabulary); index_select
        // needs contiguous rows.
        let picked = logits.to_dtype(DType::F32)?.contiguous()?.index_select(&idx, 0)?;
        let logp = candle_nn::ops::log_softmax(&picked, D::Minus1)?;
        let at = logp.gather(&Tensor::new(ids.as_slice(), dev)?.unsqueeze(1)?, 1)?.squeeze(1)?.to_vec1::<f32>()?;
        for ((&r, &t), lp) in forced.iter().zip(&ids).zip(at) {
            tokens[r] = t;
            logprobs[r] = Some(lp);
        }
    }
    Ok((tokens, logprobs))
}

const THRESHOLD_ITERS: usize = 32;

/// Samples one token per row of `logits` (`[rows, vocab]`, any float dtype).
pub fn sample(logits: &Tensor, rows: &[RowSampling]) -> Result<Vec<u32>> {
    let (r, v) = logits.dims2()?;
    if r != rows.len() {
        candle_core::bail!("sample: {r} logit rows for {} sampling rows", rows.len());
    }
    let logits = logits.to_dtype(DType::F32)?;
    // The greedy readout's argmax (first maximum on every device), so a greedy row's token does
    // not depend on whether its launch also samples.
    let greedy = crate::ops::greedy_ids(&logits, v)?;
    if rows.iter().all(|s| s.greedy) {
        return greedy.to_vec1::<u32>();
    }
    let dev = logits.device();
    let col = |f: &dyn Fn(&RowSampling) -> f32| Tensor::from_vec(rows.iter().map(f).collect::<Vec<f32>>(), (r, 1), dev);
    let temp = col(&|s| if s.greedy { 1.0 } else { s.temperature })?;
    let k = col(&|s| s.top_k.map_or(v, |k| k.min(v)) as f32)?;
    let p = col(&|s| s.top_p.unwrap_or(1.0))?;
    let u = col(&|s| s.uniform)?;

    // Shifted by the row's maximum before dividing, so a tiny temperature sends the other logits
    // to -inf (greedy in the limit) instead of overflowing them to +inf (NaN probabilities).
    let shifted = logits.broadcast_sub(&logits.max_keepdim(D::Minus1)?)?;
    let probs = candle_nn::ops::softmax_last_dim(&shifted.broadcast_div(&temp)?)?;
    // Largest t with count(probs >= t) >= k, and largest t with mass(probs >= t) >= p.
    let mut lo_k = Tensor::zeros((r, 1), DType::F32, dev)?;
    let mut hi_k = probs.max_keepdim(D::Minus1)?;
    let mut lo_p = lo_k.clone();
    let mut hi_p = hi_k.clone();
    for _ in 0..THRESHOLD_ITERS {
        let mid_k = ((&lo_k + &hi_k)? * 0.5)?;
        let count = probs.broadcast_ge(&mid_k)?.to_dtype(DType::F32)?.sum_keepdim(D::Minus1)?;
        let ok = count.ge(&k)?;
        lo_k = ok.where_cond(&mid_k, &lo_k)?;
        hi_k = ok.where_cond(&hi_k, &mid_k)?;

        let mid_p = ((&lo_p + &hi_p)? * 0.5)?;
        let kept = probs.broadcast_ge(&mid_p)?.to_dtype(DType::F32)?;
        let mass = (&probs * kept)?.sum_keepdim(D::Minus1)?;
        let ok = mass.ge(&p)?;
        lo_p = ok.where_cond(&mid_p, &lo_p)?;
        hi_p = ok.where_cond(&hi_p, &mid_p)?;
    }
    let threshold = lo_k.maximum(&lo_p)?;
    let kept = (&probs * probs.broadcast_ge(&threshold)?.to_dtype(DType::F32)?)?;
    let target = (kept.sum_keepdim(D::Minus1)? * &u)?;
    // Smallest index i with prefix mass(0..=i) > target, by bisection on i.
    let idx = Tensor::arange(0u32, v as u32, dev)?.to_dtype(DType::F32)?.unsqueeze(0)?;
    let mut lo = Tensor::full(-1f32, (r, 1), dev)?; // prefix(lo) <= target
    let mut hi = Tensor::full((v - 1) as f32, (r, 1), dev)?; // prefix(hi) > target (or last)
    let iters = (usize::BITS - v.leading_zeros()) as usize + 1;
    for _ in 0..iters {
        let mid = ((&lo + &hi)? * 0.5)?.floor()?;
        let prefix = (&kept * idx.broadcast_le(&mid)?.to_dtype(DType::F32)?)?.sum_keepdim(D::Minus1)?;
        let above = prefix.gt(&target)?;
        hi = above.where_cond(&mid, &hi)?;
        lo = above.where_cond(&lo, &mid)?;
    }
    // Both readouts at the end: one wait for the device in a batch that mixes greedy and sampled rows.
    let drawn = hi.squeeze(1)?.to_dtype(DType::U32)?.to_vec1::<u32>()?;
    let greedy = greedy.to_vec1::<u32>()?;
    Ok(rows.iter().zip(greedy).zip(drawn).map(|((s, g), d)| if s.greedy { g } else { d }).collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn row(t: f32, k: Option<usize>, p: Option<f32>, u: f32) -> RowSampling {
        RowSampling { temperature: t, top_k: k, top_p: p, uniform: u, greedy: false, forced: None }
    }

    #[test]
    fn greedy_and_inverse_cdf() {
        let probs = [0.1f32, 0.2, 0.3, 0.4];
        let logits: Vec<f32> = probs.iter().map(|p| p.ln()).collect();
        let l = Tensor::from_vec([logits.clone(), logits].concat(), (2, 4), &Device::Cpu).unwrap();
        assert_eq!(sample(&l, &[RowSampling::greedy(), RowSampling::greedy()]).unwrap(), vec![3, 3]);
        // CDF: 0.1, 0.3, 0.6, 1.0
        for (u, want) in [(0.05, 0), (0.15, 1), (0.5, 2), (0.65, 3), (0.999, 3)] {
            let got = sample(&l, &[row(1.0, None, None, u), RowSampling::greedy()]).unwrap();
            assert_eq!(got, vec![want, 3], "u={u}");
        }
        // top-k 2 keeps {0.3, 0.4}: renormalised CDF 3/7, 1.
        assert_eq!(sample(&l, &[row(1.0, Some(2), None, 0.4), row(1.0, Some(2), None, 0.5)]).unwrap(), vec![2, 3]);
        // top-p 0.65 keeps {0.4, 0.3} (mass 0.7).
        assert_eq!(sample(&l, &[row(1.0, None, Some(0.65), 0.0), row(1.0, None, Some(0.35), 0.99)]).unwrap(), vec![2, 3]);
    }

    #[test]
    fn tiny_temperatures_are_greedy_in_the_limit_and_views_can_be_forced() {
        let l = Tensor::from_vec(vec![1.0f32, 3.0, 2.0, -5.0, 0.5, 0.25], (2, 3), &Device::Cpu).unwrap();
        for t in [1e-40f32, 1e-30, f32::MIN_POSITIVE] {
            assert_eq!(sample(&l, &[row(t, None, None, 0.999), row(t, None, None, 0.0)]).unwrap(), vec![1, 1], "temperature {t}");
        }
        // A narrowed (non-contiguous) view of wider logits, as a padded vocabulary gives.
        let wide = Tensor::from_vec(vec![1.0f32, 3.0, 2.0, 9.0, -5.0, 0.5, 0.25, 9.0], (2, 4), &Device::Cpu).unwrap();
        let view = wide.narrow(1, 0, 3).unwrap();
        let forced = RowSampling { forced: Some(2), ..RowSampling::greedy() };
        let (tokens, logp) = sample_or_force(&view, &[forced, RowSampling::greedy()]).unwrap();
        assert_eq!(tokens, vec![2, 1]);
        assert!(logp[0].is_some_and(|p| p < 0.0) && logp[1].is_none());
    }

    #[test]
    fn seeded_sampler_is_reproducible() {
        let p = SamplingParams { temperature: 0.8, top_k: Some(5), top_p: Some(0.9), seed: Some(7) };
        let mut a = Sampler::new(p.clone());
        let mut b = Sampler::new(p);
        for _ in 0..5 {
            assert_eq!(a.next_row(), b.next_row());
        }
        assert!(SamplingParams { top_p: Some(0.0), ..Default::default() }.validate().is_err());
        assert!(SamplingParams { temperature: -1.0, ..Default::default() }.validate().is_err());
    }
}
