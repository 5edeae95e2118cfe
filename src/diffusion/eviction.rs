//! Eviction policies: which masked tokens of a denoising step run past layer 1 (FOCUS, arXiv
//! 2601.23278). The runner scores a request's masked tokens by the attention they receive among
//! themselves at layers 0 and 1 ([`importance`]); a policy turns the rise Δ = I₁ − I₀ into a kept
//! set; evicted tokens produce no logits this step and stay masked.

use candle_core::{DType, Device, Result, Tensor};

/// One request's step as an eviction policy sees it. Masked tokens are listed in ascending
/// block position; `delta[i]` belongs to `positions[i]`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EvictionInput<'a> {
    pub delta: &'a [f32],
    /// Block offsets of the masked tokens, ascending.
    pub positions: &'a [u32],
    /// Running mean of tokens decoded per decoding step in this block (1 at block start).
    pub avg_decoded: f32,
    /// Rightmost block offset pushed through every layer in this block (−1 at block start).
    pub block_progress: i64,
}

/// Decides which masked tokens a step keeps. Unmasked tokens of the processing set are always
/// kept by the runner.
pub trait EvictionPolicy: std::fmt::Debug + Send + Sync {
    fn name(&self) -> String;
    /// `false`: the runner skips scoring (no eviction at all).
    fn scores(&self) -> bool {
        true
    }
    /// Whether each masked token (same order as `input.positions`) is kept. Keep at least one:
    /// a row with none kept is run whole (the step must be able to reveal a token).
    fn keep(&self, input: &EvictionInput) -> Vec<bool>;
}

/// Keep everything (the baseline).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NoEviction;

impl EvictionPolicy for NoEviction {
    fn name(&self) -> String {
        "none".into()
    }
    fn scores(&self) -> bool {
        false
    }
    fn keep(&self, input: &EvictionInput) -> Vec<bool> {
        vec![true; input.positions.len()]
    }
}

/// FOCUS: keep the tokens whose importance rose most from layer 0 to layer 1, within a budget
/// tied to how many tokens this block has been decoding per step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Focus {
    pub alpha: f32,
}

impl Default for Focus {
    fn default() -> Self {
        Self { alpha: 1.5 }
    }
}

impl Focus {
    pub fn new(alpha: f32) -> crate::Result<Self> {
        if !(alpha >= 1.0 && alpha.is_finite()) {
            return Err(crate::Error::InvalidOption(format!("FOCUS alpha {alpha} must be >= 1")));
        }
        Ok(Self { alpha })
    }

    /// Budget T = min(m, max(1, ⌈α · max(ā, 1)⌉)) (0 when nothing is masked).
    pub fn budget(&self, masked: usize, avg_decoded: f32) -> usize {
        if masked == 0 {
            return 0;
        }
        let t = (self.alpha * avg_decoded.max(1.0)).ceil().max(1.0) as usize;
        t.min(masked)
    }
}

impl EvictionPolicy for Focus {
    fn name(&self) -> String {
        format!("focus(alpha {})", self.alpha)
    }

    fn keep(&self, input: &EvictionInput) -> Vec<bool> {
        let m = input.positions.len();
        let t = self.budget(m, input.avg_decoded);
        if m <= t {
            return vec![true; m];
        }
        let d = input.delta;
        let mean = d.iter().map(|&x| x as f64).sum::<f64>() / m as f64;
        let var = d.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / m as f64;
        let cut = mean + var.sqrt();
        let above: Vec<bool> = d.iter().map(|&x| x as f64 >= cut).collect();
        let mut keep = if above.iter().filter(|&&k| k).count() >= t {
            above
        } else {
            // Top-T by Δ; ties (and NaN, ranked last) go to the earlier token.
            let key = |i: usize| {
                if d[i].is_nan() {
                    f32::NEG_INFINITY
                } else {
                    d[i]
                }
            };
            let mut order: Vec<usize> = (0..m).collect();
            order.sort_by(|&a, &b| key(b).total_cmp(&key(a)).then(a.cmp(&b)));
            let mut k = vec![false; m];
            for &i in &order[..t] {
                k[i] = true;
            }
            k
        };
        enforce_rules(&mut keep, input.positions, input.block_progress);
        keep
    }
}

/// FOCUS's rules after selection, in order: (1) a kept masked token's masked left neighbour
/// (adjacent position) is kept too, one pass over the pre-rule selection; (2) nothing kept →
/// everything kept; (3) every masked token left of the rightmost kept one and right of
/// `block_progress` is kept (deep-layer K/V for positions up to the rightmost kept one must
/// exist, and a position never pushed through in this block has none).
pub fn enforce_rules(keep: &mut [bool], positions: &[u32], block_progress: i64) {
    let m = keep.len();
    let selected = keep.to_vec();
    for i in 0..m.saturating_sub(1) {
        if selected[i + 1] && !selected[i] && positions[i] + 1 == positions[i + 1] {
            keep[i] = true;
        }
    }
    if !keep.iter().any(|&k| k) {
        keep.iter_mut().for_each(|k| *k = true);
        return;
    }
    let r = positions[(0..m).rev().find(|&i| keep[i]).expect("something kept")] as i64;
    for i in 0..m {
        let p = positions[i] as i64;
        if !keep[i] && p < r && p > block_progress {
            keep[i] = true;
        }
    }
}

/// Importance of each masked token at one layer, for every row at once: `q` `[R, M, heads, d]`
/// and `k` `[R, M, kv_heads, d]` are the rows' masked tokens (post q/k norm, post RoPE), padded
/// to `M`; `lens[r]` of them are real. Raw scores among a row's masked tokens (scaled by
/// d^-½, in f32), max-pooled over neighbours in the masked list (window 3), softmax over keys,
/// summed over heads and real queries → `[R, M]` f32 (padding columns 0), rounded through
/// `store_dtype` as the reference implementation stores it.
pub fn importance(q: &Tensor, k: &Tensor, lens: &[usize], store_dtype: DType) -> Result<Tensor> {
    let (r, m, heads, d) = q.dims4()?;
    let kvh = k.dim(2)?;
    let dev = q.device();
    if m == 0 || r == 0 {
        return Tensor::zeros((r, m), DType::F32, dev);
    }
    let group = heads / kvh;
    let q = q.to_dtype(DType::F32)?.permute((0, 2, 1, 3))?.contiguous()?; // [R, H, M, d]
    let k = k.to_dtype(DType::F32)?.permute((0, 2, 1, 3))?; // [R, KV, M, d]
    let k = k.unsqueeze(2)?.broadcast_as((r, kvh, group, m, d))?.reshape((r, heads, m, d))?;
    let s = (q.matmul(&k.t()?.contiguous()?)? / (d as f64).sqrt())?; // [R, H, M(i), M(j)]
    let key_bias = key_padding(lens, m, dev)?; // [R, 1, 1, M]: −∞ past a row's masked tokens
    let s = s.broadcast_add(&key_bias)?;
    let ninf = Tensor::full(f32::NEG_INFINITY, (r, heads, m, 1), dev)?;
    let left = Tensor::cat(&[&ninf, &s.narrow(3, 0, m - 1)?], 3)?;
    let right = Tensor::cat(&[&s.narrow(3, 1, m - 1)?, &ninf], 3)?;
    // Pooling would pull a real neighbour into the first padding column: mask keys again.
    let pooled = s.maximum(&left)?.maximum(&right)?.broadcast_add(&key_bias)?;
    let w = candle_nn::ops::softmax_last_dim(&pooled)?;
    // Padded query rows would add weight; drop them. Padded key columns are exactly 0 already,
    // but a row with no real key would be NaN: zero those with the same mask.
    let qmask = query_mask(lens, m, dev)?; // [R, 1, M, 1]
    let w = w.broadcast_mul(&qmask)?;
    let w = w.eq(&w)?.where_cond(&w, &w.zeros_like()?)?; // NaN → 0
    let imp = w.sum(1)?.sum(1)?; // [R, M(j)]
    imp.to_dtype(store_dtype)?.to_dtype(DType::F32)
}

/// [`importance`] for masked tokens given by index: `q` `[T, heads, d]` and `k` `[T, kv_heads, d]`
/// hold every token of a launch, `gather` `[R · m]` u32 the rows' masked token indices padded to
/// `m`. On CUDA (m ≤ 32, d ≤ 128) one kernel does it all (`kernels/focus.cu`); elsewhere the
/// tokens are gathered and [`importance`] runs.
pub fn importance_of(q: &Tensor, k: &Tensor, gather: &Tensor, lens: &[usize], m: usize, store_dtype: DType) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if q.device().is_cuda() && m <= 32 && q.dim(2)? <= 128 && q.dtype() == store_dtype {
        let lens_t = Tensor::new(lens.iter().map(|&l| l as u32).collect::<Vec<_>>().as_slice(), q.device())?;
        return crate::ops::cuda::focus_importance(q, k, gather, &lens_t, m);
    }
    let rows = lens.len();
    let pick = |t: &Tensor| -> Result<Tensor> {
        let (_, heads, d) = t.dims3()?;
        t.index_select(gather, 0)?.reshape((rows, m, heads, d))
    };
    importance(&pick(q)?, &pick(k)?, lens, store_dtype)
}

fn key_padding(lens: &[usize], m: usize, dev: &Device) -> Result<Tensor> {
    let v: Vec<f32> = lens.iter().flat_map(|&l| (0..m).map(move |j| if j < l { 0.0 } else { f32::NEG_INFINITY })).collect();
    Tensor::from_vec(v, (lens.len(), 1, 1, m), dev)
}

fn query_mask(lens: &[usize], m: usize, dev: &Device) -> Result<Tensor> {
    let v: Vec<f32> = lens.iter().flat_map(|&l| (0..m).map(move |i| if i < l { 1.0 } else { 0.0 })).collect();
    Tensor::from_vec(v, (lens.len(), 1, m, 1), dev)
}

/// The formulas written out directly, for tests: `q[i][h][d]`, `k[j][g][d]` of one row's masked
/// tokens → importance per key token (f64 accumulation).
pub fn importance_oracle(q: &[Vec<Vec<f32>>], k: &[Vec<Vec<f32>>]) -> Vec<f32> {
    let m = q.len();
    if m == 0 {
        return vec![];
    }
    let heads = q[0].len();
    let kvh = k[0].len();
    let d = q[0][0].len();
    let group = heads / kvh;
    let scale = 1.0 / (d as f64).sqrt();
    let mut imp = vec![0f64; m];
    for h in 0..heads {
        let g = h / group;
        for i in 0..m {
            let s: Vec<f64> = (0..m).map(|j| (0..d).map(|e| q[i][h][e] as f64 * k[j][g][e] as f64).sum::<f64>() * scale).collect();
            let p: Vec<f64> = (0..m)
                .map(|j| {
                    let mut x = s[j];
                    if j > 0 {
                        x = x.max(s[j - 1]);
                    }
                    if j + 1 < m {
                        x = x.max(s[j + 1]);
                    }
                    x
                })
                .collect();
            let mx = p.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let z: f64 = p.iter().map(|x| (x - mx).exp()).sum();
            for j in 0..m {
                imp[j] += (p[j] - mx).exp() / z;
            }
        }
    }
    imp.into_iter().map(|x| x as f32).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn input<'a>(delta: &'a [f32], positions: &'a [u32], avg: f32, progress: i64) -> EvictionInput<'a> {
        EvictionInput { delta, positions, avg_decoded: avg, block_progress: progress }
    }

    #[test]
    fn budget_follows_the_running_mean() {
        let f = Focus::default();
        assert_eq!(f.budget(32, 1.0), 2, "a new block keeps ceil(1.5)");
        assert_eq!(f.budget(32, 0.3), 2);
        assert_eq!(f.budget(32, 3.2), 5);
        assert_eq!(f.budget(3, 3.2), 3);
        assert_eq!(f.budget(0, 3.2), 0);
        assert!(Focus::new(0.5).is_err());
    }

    #[test]
    fn mean_plus_sigma_set_when_large_enough_else_top_t() {
        let f = Focus::new(1.0).unwrap();
        // m = 8, T = 2 (avg 2). Δ: two clear outliers at offsets 10, 20 → the μ+σ set.
        let pos = [2, 5, 8, 10, 13, 16, 20, 25];
        let d = [0.0, 0.1, 0.0, 5.0, 0.1, 0.0, 4.0, 0.0];
        let k = f.keep(&input(&d, &pos, 2.0, 30)); // progress beyond all: rule 3 inactive
        assert_eq!(k, vec![false, false, false, true, false, false, true, false]);
        // T = 3 > |μ+σ set| = 2 → top-3, the tie at 0.1 goes to the earlier token (offset 5).
        let k = f.keep(&input(&d, &pos, 3.0, 30));
        assert_eq!(k, vec![false, true, false, true, false, false, true, false]);
    }

    #[test]
    fn rules_fill_left_neighbours_and_the_unprocessed_gap() {
        // Selected: offset 7 only; 6 is masked and adjacent → kept (rule 1); progress 3: the
        // masked 4 and 5 lie left of 7 and right of progress → kept (rule 3); 1 and 2 stay out.
        let pos = [1, 2, 4, 5, 6, 7, 9];
        let mut keep = vec![false, false, false, false, false, true, false];
        enforce_rules(&mut keep, &pos, 3);
        assert_eq!(keep, vec![false, false, true, true, true, true, false]);
        // Rule 1 is one pass over the pre-rule selection: runs grow by one, not transitively.
        let pos = [0, 1, 2, 3];
        let mut keep = vec![false, false, false, true];
        enforce_rules(&mut keep, &pos, 10);
        assert_eq!(keep, vec![false, false, true, true]);
        // Nothing kept → everything.
        let mut none = vec![false; 3];
        enforce_rules(&mut none, &[0, 2, 4], -1);
        assert_eq!(none, vec![true; 3]);
        // First step of a block (progress −1): only a suffix right of the rightmost kept token
        // can be evicted.
        let mut first = vec![false, true, false, false];
        enforce_rules(&mut first, &[0, 3, 6, 9], -1);
        assert_eq!(first, vec![true, true, false, false]);
    }

    #[test]
    fn batched_importance_matches_the_oracle() {
        // Two rows with 5 and 3 masked tokens, 4 heads over 2 kv heads, d 8.
        let (heads, kvh, d, mmax) = (4, 2, 8, 5);
        let lens = [5usize, 3];
        let val = |r: usize, i: usize, h: usize, e: usize, s: f32| ((r * 977 + i * 131 + h * 31 + e * 7) as f32 * s).sin();
        let mut qv = vec![0f32; 2 * mmax * heads * d];
        let mut kv = vec![0f32; 2 * mmax * kvh * d];
        for r in 0..2 {
            for i in 0..lens[r] {
                for h in 0..heads {
                    for e in 0..d {
                        qv[((r * mmax + i) * heads + h) * d + e] = 2.0 * val(r, i, h, e, 0.37);
                    }
                }
                for g in 0..kvh {
                    for e in 0..d {
                        kv[((r * mmax + i) * kvh + g) * d + e] = 2.0 * val(r, i, g + 9, e, 0.53);
                    }
                }
            }
        }
        let q = Tensor::from_vec(qv.clone(), (2, mmax, heads, d), &Device::Cpu).unwrap();
        let k = Tensor::from_vec(kv.clone(), (2, mmax, kvh, d), &Device::Cpu).unwrap();
        let got = importance(&q, &k, &lens, DType::F32).unwrap().to_vec2::<f32>().unwrap();
        for r in 0..2 {
            let qr: Vec<Vec<Vec<f32>>> =
                (0..lens[r]).map(|i| (0..heads).map(|h| (0..d).map(|e| qv[((r * mmax + i) * heads + h) * d + e]).collect()).collect()).collect();
            let kr: Vec<Vec<Vec<f32>>> =
                (0..lens[r]).map(|i| (0..kvh).map(|g| (0..d).map(|e| kv[((r * mmax + i) * kvh + g) * d + e]).collect()).collect()).collect();
            let want = importance_oracle(&qr, &kr);
            for j in 0..lens[r] {
                assert!((got[r][j] - want[j]).abs() < 1e-5, "row {r} token {j}: {} vs {}", got[r][j], want[j]);
            }
            for j in lens[r]..mmax {
                assert_eq!(got[r][j], 0.0, "padding column");
            }
            // Each query's weights sum to 1: total importance = heads × masked tokens.
            let total: f32 = got[r][..lens[r]].iter().sum();
            assert!((total - (heads * lens[r]) as f32).abs() < 1e-4);
        }
    }
}
