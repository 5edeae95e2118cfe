//! Batched sampling on the device: greedy, temperature, top-k, top-p, per-request seeds.
//!
//! Only the sampled ids cross to the host. Top-k / top-p thresholds and the inverse-CDF draw
//! are found by bisection with elementwise ops and row reductions, which needs no sort or
//! cumulative sum over the vocabulary (candle's `cumsum` is a V×V matmul) and runs the same on
//! every backend. The per-request randomness is one uniform number per row, drawn on the host
//! from the request's own seeded generator, so a request samples the same tokens whatever it
//! is batched with.

use crate::TokenLogprob;
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
    key: u64,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Self {
        let (rng, key) = match params.seed {
            Some(s) => (rand::rngs::StdRng::seed_from_u64(s), crate::dist::mix(s)),
            None => {
                let mut rng = rand::rngs::StdRng::from_os_rng();
                let key = rng.random();
                (rng, key)
            }
        };
        Self { params, rng, key }
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// The key of the request's counter-based draws (diffusion steps): `mix(seed)` for a seeded
    /// request, so a reference can reproduce them; random otherwise.
    pub fn key(&self) -> u64 {
        self.key
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
            logprobs: None,
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
    /// Report the token's log-probability and this many most likely alternatives.
    pub logprobs: Option<usize>,
}

impl RowSampling {
    pub fn greedy() -> Self {
        Self { temperature: 0.0, top_k: None, top_p: None, uniform: 0.0, greedy: true, forced: None, logprobs: None }
    }

    /// Whether the token's log-probability goes back with it.
    pub fn wants_logprob(&self) -> bool {
        self.forced.is_some() || self.logprobs.is_some()
    }
}

/// Tokens for `rows` (forced ones where given, sampled otherwise) and, for forced rows and rows
/// that ask, the token's log-probability under the untempered model distribution with the
/// asked number of most likely alternatives.
pub fn sample_or_force(logits: &Tensor, rows: &[RowSampling]) -> Result<(Vec<u32>, Vec<Option<TokenLogprob>>)> {
    let forced = rows.iter().filter(|r| r.forced.is_some()).count();
    let mut tokens = if forced == rows.len() { vec![0; rows.len()] } else { sample(logits, rows)? };
    for (t, r) in tokens.iter_mut().zip(rows) {
        if let Some(f) = r.forced {
            *t = f;
        }
    }
    let asking: Vec<usize> = (0..rows.len()).filter(|&r| rows[r].wants_logprob()).collect();
    let mut logprobs = vec![None; rows.len()];
    if asking.is_empty() {
        return Ok((tokens, logprobs));
    }
    let dev = logits.device();
    let idx = Tensor::new(asking.iter().map(|&r| r as u32).collect::<Vec<_>>().as_slice(), dev)?;
    let ids: Vec<u32> = asking.iter().map(|&r| tokens[r]).collect();
    // A model may hand over a view (Huginn narrows its padded vocabulary); index_select needs
    // contiguous rows.
    let picked = logits.to_dtype(DType::F32)?.contiguous()?.index_select(&idx, 0)?;
    let logp = candle_nn::ops::log_softmax(&picked, D::Minus1)?;
    let at = logp.gather(&Tensor::new(ids.as_slice(), dev)?.unsqueeze(1)?, 1)?.squeeze(1)?.to_vec1::<f32>()?;
    let n = asking.iter().map(|&r| rows[r].logprobs.unwrap_or(0)).max().unwrap_or(0);
    let top = top_n(&logp, n)?;
    for (i, (&r, lp)) in asking.iter().zip(at).enumerate() {
        let k = rows[r].logprobs.unwrap_or(0);
        logprobs[r] = Some(TokenLogprob { logprob: lp, top: top[i][..k.min(top[i].len())].to_vec() });
    }
    Ok((tokens, logprobs))
}

/// The `n` largest entries of each row of `values` `[rows, vocab]` as `(index, value)`, largest
/// first (ties to the lower index): `n` rounds of max, argmax and masking, which needs no sort
/// over the vocabulary (candle's CUDA sort is limited to short rows).
fn top_n(values: &Tensor, n: usize) -> Result<Vec<Vec<(u32, f32)>>> {
    let (r, v) = values.dims2()?;
    let mut out = vec![Vec::with_capacity(n); r];
    if n == 0 {
        return Ok(out);
    }
    let columns = Tensor::arange(0u32, v as u32, values.device())?.unsqueeze(0)?;
    let mut rest = values.clone();
    let masked = Tensor::full(f32::NEG_INFINITY, (r, v), values.device())?;
    let (mut ids, mut vals) = (Vec::with_capacity(n), Vec::with_capacity(n));
    for _ in 0..n.min(v) {
        let at = crate::ops::greedy_ids(&rest, v)?;
        vals.push(rest.gather(&at.unsqueeze(1)?, 1)?);
        ids.push(at.unsqueeze(1)?);
        let hit = columns.broadcast_eq(&at.unsqueeze(1)?)?;
        rest = hit.where_cond(&masked, &rest)?;
    }
    let ids = Tensor::cat(&ids, 1)?.to_vec2::<u32>()?;
    let vals = Tensor::cat(&vals, 1)?.to_vec2::<f32>()?;
    for (row, (i, x)) in out.iter_mut().zip(ids.into_iter().zip(vals)) {
        *row = i.into_iter().zip(x).collect();
    }
    Ok(out)
}

const THRESHOLD_ITERS: usize = 32;

/// In which order top-k and top-p cut a distribution. They differ when both are given: top-p
/// after top-k measures mass within the k survivors (renormalised), so it keeps fewer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FilterOrder {
    /// Both cuts on the full distribution, the survivors their intersection (Dream's sampler,
    /// and the looped models' sampling).
    #[default]
    TopPThenTopK,
    /// Top-p over the top-k survivors renormalised (SDAR's and LLaDA2.0's `generate`).
    TopKThenTopP,
}

/// The per-row columns of a sampling call: temperature, k, p and the uniform draw, `[rows, 1]`.
pub(crate) struct DrawColumns {
    pub temperature: Tensor,
    pub k: Tensor,
    pub p: Tensor,
    pub uniform: Tensor,
}

impl DrawColumns {
    /// Greedy rows get temperature 1 (their draw is not used).
    pub fn new(rows: &[RowSampling], vocab: usize, dev: &candle_core::Device) -> Result<Self> {
        let col = |f: &dyn Fn(&RowSampling) -> f32| Tensor::from_vec(rows.iter().map(f).collect::<Vec<f32>>(), (rows.len(), 1), dev);
        Ok(Self {
            temperature: col(&|s| if s.greedy { 1.0 } else { s.temperature })?,
            k: col(&|s| s.top_k.map_or(vocab, |k| k.min(vocab)) as f32)?,
            p: col(&|s| s.top_p.unwrap_or(1.0))?,
            uniform: col(&|s| s.uniform)?,
        })
    }
}

/// `softmax(logits / temperature)` per row of f32 `logits`; the logits are shifted by the row's
/// maximum before dividing, so a tiny temperature sends the other logits to −∞ (greedy in the
/// limit) instead of overflowing them to +∞ (NaN probabilities).
pub(crate) fn tempered(logits: &Tensor, temperature: &Tensor) -> Result<Tensor> {
    let shifted = logits.broadcast_sub(&logits.max_keepdim(D::Minus1)?)?;
    candle_nn::ops::softmax_last_dim(&shifted.broadcast_div(temperature)?)
}

/// Largest `t` in `[0, max]` with `measure(t)` ≥ `goal`, per row, by bisection.
fn threshold(probs: &Tensor, goal: &Tensor, measure: impl Fn(&Tensor) -> Result<Tensor>) -> Result<Tensor> {
    let mut lo = Tensor::zeros((probs.dim(0)?, 1), DType::F32, probs.device())?;
    let mut hi = probs.max_keepdim(D::Minus1)?;
    for _ in 0..THRESHOLD_ITERS {
        let mid = ((&lo + &hi)? * 0.5)?;
        let ok = measure(&mid)?.ge(goal)?;
        lo = ok.where_cond(&mid, &lo)?;
        hi = ok.where_cond(&hi, &mid)?;
    }
    Ok(lo)
}

/// `probs` with everything outside the top-k / top-p survivors zeroed (not renormalised). A cut
/// keeps every token tied with its last survivor.
pub(crate) fn filtered(probs: &Tensor, k: &Tensor, p: &Tensor, order: FilterOrder) -> Result<Tensor> {
    let count = |t: &Tensor| probs.broadcast_ge(t)?.to_dtype(DType::F32)?.sum_keepdim(D::Minus1);
    let keep = |source: &Tensor, t: &Tensor| source * source.broadcast_ge(t)?.to_dtype(DType::F32)?;
    let t_k = threshold(probs, k, count)?;
    let (source, goal) = match order {
        FilterOrder::TopPThenTopK => (probs.clone(), p.clone()),
        FilterOrder::TopKThenTopP => {
            let top_k = keep(probs, &t_k)?;
            let goal = top_k.sum_keepdim(D::Minus1)?.mul(p)?;
            (top_k, goal)
        }
    };
    let t_p = threshold(&source, &goal, |t| keep(&source, t)?.sum_keepdim(D::Minus1))?;
    keep(probs, &t_k.maximum(&t_p)?)
}

/// Per row of `kept` (`[rows, vocab]`, non-negative, not normalised): the smallest index whose
/// prefix mass exceeds `uniform` × the row's mass — the inverse-CDF draw in vocabulary order.
/// Bisection on the index, so no cumulative sum over the vocabulary is materialised (candle's
/// `cumsum` is a V×V matmul).
pub(crate) fn inverse_cdf(kept: &Tensor, uniform: &Tensor) -> Result<Tensor> {
    let (r, v) = kept.dims2()?;
    let dev = kept.device();
    let target = (kept.sum_keepdim(D::Minus1)? * uniform)?;
    let idx = Tensor::arange(0u32, v as u32, dev)?.to_dtype(DType::F32)?.unsqueeze(0)?;
    let mut lo = Tensor::full(-1f32, (r, 1), dev)?; // prefix(lo) <= target
    let mut hi = Tensor::full((v - 1) as f32, (r, 1), dev)?; // prefix(hi) > target (or last)
    let iters = (usize::BITS - v.leading_zeros()) as usize + 1;
    for _ in 0..iters {
        let mid = ((&lo + &hi)? * 0.5)?.floor()?;
        let prefix = (kept * idx.broadcast_le(&mid)?.to_dtype(DType::F32)?)?.sum_keepdim(D::Minus1)?;
        let above = prefix.gt(&target)?;
        hi = above.where_cond(&mid, &hi)?;
        lo = above.where_cond(&lo, &mid)?;
    }
    hi.squeeze(1)?.to_dtype(DType::U32)
}

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
    let cols = DrawColumns::new(rows, v, logits.device())?;
    let probs = tempered(&logits, &cols.temperature)?;
    let kept = filtered(&probs, &cols.k, &cols.p, FilterOrder::TopPThenTopK)?;
    // Both readouts at the end: one wait for the device in a batch that mixes greedy and sampled rows.
    let drawn = inverse_cdf(&kept, &cols.uniform)?.to_vec1::<u32>()?;
    let greedy = greedy.to_vec1::<u32>()?;
    Ok(rows.iter().zip(greedy).zip(drawn).map(|((s, g), d)| if s.greedy { g } else { d }).collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn row(t: f32, k: Option<usize>, p: Option<f32>, u: f32) -> RowSampling {
        RowSampling { temperature: t, top_k: k, top_p: p, uniform: u, greedy: false, forced: None, logprobs: None }
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
        assert!(logp[0].as_ref().is_some_and(|p| p.logprob < 0.0) && logp[1].is_none());
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
