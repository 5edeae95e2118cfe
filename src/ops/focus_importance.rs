//! FOCUS's importance scores on the device: how much attention each masked token of a denoising
//! step receives from the other masked tokens at one layer. The host-side policy that turns the
//! scores into a kept set is `diffusion::eviction`.

use candle_core::{DType, Device, Result, Tensor};

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
#[cfg(any(test, feature = "testing"))]
#[allow(clippy::needless_range_loop)] // the formulas' indices, as written
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
            for (j, w) in want.iter().enumerate() {
                assert!((got[r][j] - w).abs() < 1e-5, "row {r} token {j}: {} vs {w}", got[r][j]);
            }
            assert!(got[r][lens[r]..mmax].iter().all(|&x| x == 0.0), "padding columns");
            // Each query's weights sum to 1: total importance = heads × masked tokens.
            let total: f32 = got[r][..lens[r]].iter().sum();
            assert!((total - (heads * lens[r]) as f32).abs() < 1e-4);
        }
    }
}
