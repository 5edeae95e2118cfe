//! Sampling a denoising step's tokens (temperature > 0) the way each family's own `generate`
//! does, on the device, batch-invariantly.
//!
//! A step draws a token for every masked position it reads out, and ranks the positions by a
//! confidence measured on the distribution the family names. The randomness is one uniform
//! number per readout, hashed from the request's key, the request's step count and the logits'
//! cache position: a request draws the same numbers whatever it is batched with and whichever
//! positions FOCUS keeps, and a reference given the seed reproduces them
//! (`tools/reference/diffusion_sampling.py`).

use super::Confidence;
use crate::dist::mix;
use crate::sampling::{filtered, inverse_cdf, tempered, DrawColumns, FilterOrder, RowSampling};
use candle_core::{Result, Tensor, D};

/// How a diffusion family draws a step's tokens when sampling.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DiffusionSampler {
    /// LLaDA's `generate`: the argmax of Gumbel-noised logits at temperature T, ranked by the
    /// untempered softmax's probability of the drawn token. The Gumbel-max draw is a draw from
    /// `softmax(logits / T)`; it is taken by inverse CDF (one uniform per position instead of
    /// one per vocabulary entry). LLaDA's sampler has no top-k / top-p; given, they cut the
    /// tempered distribution top-k first.
    Gumbel,
    /// SDAR's and LLaDA2.0's `generate` (top-k, then top-p) and Dream's (top-p, then top-k): a
    /// draw from the tempered, cut, renormalised distribution, whose probabilities the
    /// confidence is measured on.
    Filtered(FilterOrder),
}

/// A sampling request's draws for one denoising step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepDraw {
    pub temperature: f32,
    pub top_k: Option<usize>,
    pub top_p: Option<f32>,
    /// The request's key: `mix(seed)` of a seeded request (SplitMix64's finaliser), random otherwise.
    pub key: u64,
    /// Denoising steps the request ran before this one.
    pub step: u64,
}

impl StepDraw {
    /// The draw for the logits at cache position `position`.
    pub fn row(&self, position: u32) -> RowSampling {
        RowSampling {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            uniform: uniform(self.key, self.step, position),
            greedy: false,
            forced: None,
            logprobs: None,
        }
    }
}

/// A uniform number in [0, 1) on a 2⁻²⁴ grid (exact in f32) from `(key, step, position)`.
pub fn uniform(key: u64, step: u64, position: u32) -> f32 {
    let h = mix(mix(mix(key) ^ step) ^ u64::from(position));
    (h >> 40) as f32 / (1u64 << 24) as f32
}

/// Per row of f32 `logits` `[n, vocab]` (−∞ at the mask token): the token `rows` draws and its
/// confidence `kind` on the distribution `sampler` names. Its bisections hold a few
/// `[n, vocab]` f32 temporaries: callers bound `n`.
pub fn sampled_readout(logits: &Tensor, rows: &[RowSampling], sampler: DiffusionSampler, kind: Confidence) -> Result<(Tensor, Tensor)> {
    if logits.dim(0)? != rows.len() {
        candle_core::bail!("sampled readout: {} logit rows for {} draws", logits.dim(0)?, rows.len());
    }
    let cols = DrawColumns::new(rows, logits.dim(1)?, logits.device())?;
    let order = match sampler {
        DiffusionSampler::Gumbel => FilterOrder::TopKThenTopP,
        DiffusionSampler::Filtered(order) => order,
    };
    let kept = filtered(&tempered(logits, &cols.temperature)?, &cols.k, &cols.p, order)?;
    let tokens = inverse_cdf(&kept, &cols.uniform)?;
    let dist = match sampler {
        DiffusionSampler::Gumbel => candle_nn::ops::softmax_last_dim(logits)?,
        DiffusionSampler::Filtered(_) => kept.broadcast_div(&kept.sum_keepdim(D::Minus1)?)?,
    };
    let confidence = match kind {
        Confidence::Probability => dist.gather(&tokens.unsqueeze(1)?, 1)?.squeeze(1)?,
        kind => super::runner::spread(&dist, &dist.argmax(D::Minus1)?, kind)?,
    };
    Ok((tokens, confidence))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn draw(t: f32, k: Option<usize>, p: Option<f32>, u: f32) -> RowSampling {
        RowSampling { temperature: t, top_k: k, top_p: p, uniform: u, greedy: false, forced: None, logprobs: None }
    }

    fn logits(probs: &[f32]) -> Tensor {
        Tensor::from_vec(probs.iter().map(|p| p.ln()).collect::<Vec<_>>(), (1, probs.len()), &Device::Cpu).unwrap()
    }

    fn one(l: &Tensor, row: RowSampling, sampler: DiffusionSampler, kind: Confidence) -> (u32, f32) {
        let (t, c) = sampled_readout(l, &[row], sampler, kind).unwrap();
        (t.to_vec1::<u32>().unwrap()[0], c.to_vec1::<f32>().unwrap()[0])
    }

    #[test]
    fn the_cut_order_decides_what_survives() {
        // Top-3 keeps {0.4, 0.3, 0.2} (mass 0.9); top-p 0.7 over it renormalised (0.44, 0.33,
        // 0.22) keeps two, over the full distribution (0.4, 0.3 = 0.7) also two; at p 0.75 the
        // orders differ: 0.44 + 0.33 = 0.78 ≥ 0.75 keeps two, 0.4 + 0.3 = 0.7 < 0.75 keeps three.
        let l = logits(&[0.1, 0.2, 0.3, 0.4]);
        let last = draw(1.0, Some(3), Some(0.75), 0.999);
        let k_first = DiffusionSampler::Filtered(FilterOrder::TopKThenTopP);
        let p_first = DiffusionSampler::Filtered(FilterOrder::TopPThenTopK);
        // Drawing near 1 in vocabulary order lands on the last survivor: index 3 either way; the
        // first survivor at u = 0 shows the difference.
        assert_eq!(one(&l, draw(1.0, Some(3), Some(0.75), 0.0), k_first, Confidence::Probability).0, 2);
        assert_eq!(one(&l, draw(1.0, Some(3), Some(0.75), 0.0), p_first, Confidence::Probability).0, 1);
        let (t, c) = one(&l, last, k_first, Confidence::Probability);
        assert_eq!(t, 3);
        assert!((c - 0.4 / 0.7).abs() < 1e-5, "renormalised over the two survivors: {c}");
        let (_, c) = one(&l, last, p_first, Confidence::Probability);
        assert!((c - 0.4 / 0.9).abs() < 1e-5, "renormalised over the three survivors: {c}");
    }

    #[test]
    fn gumbel_ranks_by_the_untempered_probability_and_margins_and_entropy_use_the_cut() {
        let l = logits(&[0.1, 0.2, 0.3, 0.4]);
        // At temperature 2 the tempered distribution is flatter; the confidence stays p(x0).
        let (t, c) = one(&l, draw(2.0, None, None, 0.0), DiffusionSampler::Gumbel, Confidence::Probability);
        assert_eq!(t, 0);
        assert!((c - 0.1).abs() < 1e-5, "{c}");
        let cut = DiffusionSampler::Filtered(FilterOrder::TopKThenTopP);
        let (_, m) = one(&l, draw(1.0, Some(2), None, 0.5), cut, Confidence::Margin);
        assert!((m - (0.4 - 0.3) / 0.7).abs() < 1e-5, "{m}");
        let (_, e) = one(&l, draw(1.0, Some(2), None, 0.5), cut, Confidence::NegEntropy);
        let want: f32 = [3.0f32 / 7.0, 4.0 / 7.0].iter().map(|q| q * (q + 1e-10).ln()).sum();
        assert!((e - want).abs() < 1e-5, "{e} vs {want}");
    }

    #[test]
    fn draws_are_keyed_by_step_and_position_and_spread_evenly() {
        let d = StepDraw { temperature: 1.0, top_k: None, top_p: None, key: mix(7), step: 3 };
        assert_eq!(d.row(10), d.row(10));
        assert_ne!(d.row(10).uniform, d.row(11).uniform);
        assert_ne!(d.row(10).uniform, StepDraw { step: 4, ..d }.row(10).uniform);
        let us: Vec<f32> = (0..4000).map(|p| d.row(p).uniform).collect();
        assert!(us.iter().all(|u| (0.0..1.0).contains(u)));
        let mean = us.iter().sum::<f32>() / us.len() as f32;
        assert!((mean - 0.5).abs() < 0.02, "mean {mean}");
    }
}
