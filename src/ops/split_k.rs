//! Decode projections split over k, summed by the norm that follows them.
//!
//! At a few rows a projection is a weight stream, and its output may have too few tiles to keep
//! every SM streaming: Ouro-1.4B's o_proj (2048 columns) is 32 tiles of 64 for 132 SMs on the
//! H200 and ran at ≈ 1.4 TB/s, its down projection needed cuBLAS's split-K and a reduce launch.
//! Cutting k into slices and computing every slice's partial product in one strided-batched
//! GEMM fills the GPU; the partials (f32, a few hundred KB at decode widths) are summed by the
//! row norm the projection feeds, so the split costs no launch. On the CPU, and where no split
//! pays (wide batches, dtypes without the kernels), the same ops run the projection whole.

use super::{add_rms_norm, residual_add_rms_norm};
use candle_core::{DType, Result, Tensor};

/// Output columns of one tile of cuBLAS's skinny decode GEMMs (its `…_64x16_…` / `…_64x8_…`
/// kernels on the H200): a projection to `n` columns keeps `n / 64` SMs streaming.
const TILE_COLUMNS: usize = 64;
/// Most slices a projection is cut into (on the H200 at 16 rows, Ouro-1.4B's o_proj ran
/// 6.0 / 5.3 / 4.8 / 4.8 µs whole and in 2 / 4 / 8 slices; down 11.2 / 8.6 / 8.3 / 8.1 µs).
const MAX_SPLITS: usize = 4;
/// Widest batch that is split: at 256 rows the partials' traffic would rival the weight's.
const DEFAULT_MAX_ROWS: usize = 64;

/// What a plan under `split` (a `KernelPolicy` split-k choice) starts from for `x`: the forced
/// slice count (`None` to plan), and k; `None` where nothing is split (off CUDA, in f32, or at
/// more rows than `split` allows — `planned_max_rows` where it plans).
fn plan_input(x: &Tensor, split: super::policy::SplitK, planned_max_rows: usize) -> Option<(Option<usize>, usize)> {
    let (forced, max_rows) = match split {
        super::policy::SplitK::Planned => (None, planned_max_rows),
        super::policy::SplitK::Forced { slices, max_rows } => (Some(slices.min(super::policy::MAX_FORCED_SPLITS)), max_rows),
    };
    let (rows, k) = x.dims2().ok()?;
    (x.device().is_cuda() && matches!(x.dtype(), DType::BF16 | DType::F16) && (1..=max_rows).contains(&rows)).then_some((forced, k))
}

/// How many k slices a projection of `x` (`[rows, k]`) to `n` columns runs as: enough that its
/// output tiles cover the SMs once (Ouro-1.4B's 2048-column o_proj and down: 4 on 132 SMs) —
/// or fewer, the most that keep every slice a whole number of 16-byte vectors — or `None` to
/// run it whole: on the CPU, in f32, at more rows than pay, where the whole projection already
/// fills the GPU (Huginn's 5280 columns ran 1–3 % slower split in 4), or where no split keeps
/// the slices aligned.
pub fn split_k_plan(x: &Tensor, n: usize) -> Option<usize> {
    let (forced, k) = plan_input(x, super::policy::current().split_k, DEFAULT_MAX_ROWS)?;
    let most = match forced {
        Some(s) => s,
        None => (multiprocessors(x)? / n.div_ceil(TILE_COLUMNS).max(1)).min(MAX_SPLITS),
    };
    (2..=most).rev().find(|&s| k % (s * 8) == 0)
}

/// Output columns of one block of the weight-only FP8 kernel, and its blocks an SM holds at once
/// (106 registers a thread at 16 rows, 8 warps a block).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
const FP8_BLOCK_COLUMNS: usize = 16;
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
const FP8_BLOCKS_AN_SM: usize = 2;
/// The kernel's warps, each a 64-wide chunk of k at a time: a slice of fewer chunks idles some.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
const FP8_WARPS: usize = 8;
/// Widest launch the FP8 plan splits: one m16 tile. On the H200 at 64 rows the split products
/// were slower than whole (Ouro-1.4B's down 21.2 against 18.4 µs in 2 slices; the CB step at
/// W 64 0.96×), at 1 and 16 rows faster (o_proj 1.05–1.09×, down 1.27×; the step 1.04–1.05×).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
const FP8_PLANNED_MAX_ROWS: usize = 16;

/// How many k slices the weight-only FP8 kernel cuts `x · Wᵀ` (`x` `[rows, k]`, W `[n, k]` in
/// E4M3) into under `KernelPolicy::fp8_split_k`: planned, up to 16 rows, enough that its
/// 16-column blocks fill every SM `FP8_BLOCKS_AN_SM` times (at most 4, each slice at least a
/// chunk a warp); forced, the count asked (at most a chunk a slice); `None` to run it whole (also
/// off CUDA and in f32).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub fn fp8_split_k_plan(x: &Tensor, n: usize) -> Option<usize> {
    let (forced, k) = plan_input(x, super::policy::current().fp8_split_k, FP8_PLANNED_MAX_ROWS)?;
    let chunks = k.div_ceil(64);
    let slices = match forced {
        Some(s) => s.min(chunks),
        None => (FP8_BLOCKS_AN_SM * multiprocessors(x)? / n.div_ceil(FP8_BLOCK_COLUMNS).max(1)).min(MAX_SPLITS).min(chunks / FP8_WARPS),
    };
    (slices >= 2).then_some(slices)
}

/// The composition of candle ops behind the weight-only FP8 kernel's k slices
/// (`ops::cuda::fp8_linear_partials`): `x` `[rows, k]` times the dequantized weight, in f32, over
/// the runs of 64-wide chunks of k the kernel gives each of `splits` slices (`[splits, rows, n]`).
/// The kernel applies a row's scale to each slice's f32 sum, so per-row weights agree up to the
/// order of sums; a block's scale it applies to each weight as it converts it to x's dtype,
/// which this composition keeps in f32 (2⁻⁹ relative a weight in bf16).
#[cfg_attr(not(feature = "testing"), allow(dead_code))]
pub fn fp8_linear_partials_reference(x: &Tensor, w: &crate::quant::Fp8Weight, splits: usize) -> Result<Tensor> {
    let (_, k) = x.dims2()?;
    let chunks = k.div_ceil(64);
    if splits == 0 || splits > chunks {
        candle_core::bail!("fp8_linear_partials: {k} columns do not cut into {splits} runs of 64-wide chunks");
    }
    let per = chunks.div_ceil(splits);
    let (x, w) = (x.to_dtype(DType::F32)?, w.dequantize(DType::F32)?);
    let n = w.dim(0)?;
    let parts = (0..splits)
        .map(|i| {
            let (a, b) = ((i * per * 64).min(k), ((i + 1) * per * 64).min(k));
            match b > a {
                true => x.narrow(1, a, b - a)?.matmul(&w.narrow(1, a, b - a)?.t()?),
                false => Tensor::zeros((x.dim(0)?, n), DType::F32, x.device()),
            }
        })
        .collect::<Result<Vec<_>>>()?;
    Tensor::stack(&parts, 0)
}

/// The SM count of `x`'s CUDA device; `None` elsewhere.
fn multiprocessors(x: &Tensor) -> Option<usize> {
    #[cfg(feature = "cuda")]
    if let candle_core::Device::Cuda(dev) = x.device() {
        return super::cuda::sm_count(dev).ok();
    }
    let _ = x;
    None
}

/// `x · wᵀ` (`x` `[rows, k]`, `w` `[n, k]`) as `splits` partial products over consecutive k
/// slices, f32 `[splits, rows, n]`; summed in slice order they are the product. On CUDA one
/// strided-batched cuBLAS GEMM; elsewhere [`linear_partials_reference`].
pub fn linear_partials(x: &Tensor, w: &Tensor, splits: usize) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() {
        return super::cuda::linear_partials(x, w, splits);
    }
    linear_partials_reference(x, w, splits)
}

/// The composition of candle ops behind [`linear_partials`]: each slice's product in f32.
pub fn linear_partials_reference(x: &Tensor, w: &Tensor, splits: usize) -> Result<Tensor> {
    let (_, k) = x.dims2()?;
    if splits == 0 || k % splits != 0 {
        candle_core::bail!("linear_partials: {k} columns do not split into {splits} slices");
    }
    let kc = k / splits;
    let (x, w) = (x.to_dtype(DType::F32)?, w.to_dtype(DType::F32)?);
    let parts = (0..splits).map(|i| x.narrow(1, i * kc, kc)?.matmul(&w.narrow(1, i * kc, kc)?.t()?)).collect::<Result<Vec<_>>>()?;
    Tensor::stack(&parts, 0)
}

/// `x · wᵀ` (`x` `[rows, k]`, `w` `[n, k]`) as f32 `[rows, n]` — the looped heads' logits. On
/// CUDA in bf16 / f16 one cuBLAS GEMM that accumulates and stores in f32 (no rounding to the
/// weights' dtype and no cast launch after it: at 256 rows Ouro's cast of the logits took longer
/// than the head's GEMM, 127 against 95 µs); elsewhere the product in `x`'s dtype, then cast.
pub fn linear_f32(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() && matches!(x.dtype(), DType::BF16 | DType::F16) && x.rank() == 2 {
        let rows = x.dim(0)?;
        return super::cuda::linear_partials(x, w, 1)?.reshape((rows, w.dim(0)?));
    }
    candle_nn::Module::forward(&candle_nn::Linear::new(w.clone(), None), x)?.to_dtype(DType::F32)
}

/// The sum of `parts` (`[splits, rows, n]`, f32) in slice order, rounded to `dtype`: the value
/// the unsplit projection stores.
pub fn sum_partials(parts: &Tensor, dtype: DType) -> Result<Tensor> {
    let mut sum = parts.get(0)?;
    for i in 1..parts.dim(0)? {
        sum = (sum + parts.get(i)?)?;
    }
    sum.to_dtype(dtype)
}

/// [`add_rms_norm`] with `x` given as partial products (`parts` f32 `[splits, rows, C]`):
/// `x = sum_partials(parts)` in the residual's dtype, then `(h, n)` as there. One launch on CUDA.
pub fn add_rms_norm_partials(residual: &Tensor, parts: &Tensor, w_x: &Tensor, w_next: &Tensor, eps: f64) -> Result<(Tensor, Tensor)> {
    #[cfg(feature = "cuda")]
    if residual.device().is_cuda() {
        let norm = super::into::NormAfter::Sandwich { w_x, w_next };
        return super::cuda::norm_of_partials(residual, parts, norm, eps as f32);
    }
    add_rms_norm(residual, &sum_partials(parts, residual.dtype())?, w_x, w_next, eps)
}

/// [`residual_add_rms_norm`] with `x` given as partial products, as [`add_rms_norm_partials`].
pub fn residual_add_rms_norm_partials(residual: &Tensor, parts: &Tensor, w: &Tensor, eps: f64) -> Result<(Tensor, Tensor)> {
    #[cfg(feature = "cuda")]
    if residual.device().is_cuda() {
        return super::cuda::norm_of_partials(residual, parts, super::into::NormAfter::PreNorm { w }, eps as f32);
    }
    residual_add_rms_norm(residual, &sum_partials(parts, residual.dtype())?, w, eps)
}

/// `add_rms_norm(residual, x · wᵀ, w_x, w_next)`: a projection (no bias) feeding a sandwich
/// norm, split over k where [`split_k_plan`] says it pays.
pub fn linear_add_rms_norm(residual: &Tensor, x: &Tensor, w: &Tensor, w_x: &Tensor, w_next: &Tensor, eps: f64) -> Result<(Tensor, Tensor)> {
    match split_k_plan(x, w.dim(0)?) {
        Some(splits) => add_rms_norm_partials(residual, &linear_partials(x, w, splits)?, w_x, w_next, eps),
        None => add_rms_norm(residual, &x.matmul(&w.t()?)?, w_x, w_next, eps),
    }
}

/// `residual_add_rms_norm(residual, x · wᵀ, w)`: a projection (no bias) added to the residual
/// stream before a norm, split over k where [`split_k_plan`] says it pays.
pub fn linear_residual_add_rms_norm(residual: &Tensor, x: &Tensor, w: &Tensor, w_norm: &Tensor, eps: f64) -> Result<(Tensor, Tensor)> {
    match split_k_plan(x, w.dim(0)?) {
        Some(splits) => residual_add_rms_norm_partials(residual, &linear_partials(x, w, splits)?, w_norm, eps),
        None => residual_add_rms_norm(residual, &x.matmul(&w.t()?)?, w_norm, eps),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn rand(shape: &[usize], seed: u64) -> Tensor {
        let n: usize = shape.iter().product();
        let mut s = seed;
        let v: Vec<f32> = (0..n)
            .map(|_| {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect();
        Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
    }

    fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
        (a - b).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap()
    }

    #[test]
    fn partials_sum_to_the_product() {
        let (x, w) = (rand(&[5, 64], 1), rand(&[24, 64], 2));
        let whole = x.matmul(&w.t().unwrap()).unwrap();
        for splits in [1, 2, 4, 8] {
            let parts = linear_partials(&x, &w, splits).unwrap();
            assert_eq!(parts.dims(), &[splits, 5, 24]);
            assert!(max_abs_diff(&sum_partials(&parts, DType::F32).unwrap(), &whole) < 1e-5);
        }
        assert!(linear_partials(&x, &w, 3).is_err(), "64 columns do not split into 3");
    }

    #[test]
    fn norms_of_partials_match_the_unsplit_ops() {
        let (x, w) = (rand(&[3, 32], 3), rand(&[16, 32], 4));
        let (res, w_x, w_next) = (rand(&[3, 16], 5), (rand(&[16], 6) + 1.5).unwrap(), (rand(&[16], 7) + 1.5).unwrap());
        let parts = linear_partials(&x, &w, 4).unwrap();
        let y = x.matmul(&w.t().unwrap()).unwrap();
        let (h, n) = add_rms_norm_partials(&res, &parts, &w_x, &w_next, 1e-6).unwrap();
        let (h_ref, n_ref) = add_rms_norm(&res, &y, &w_x, &w_next, 1e-6).unwrap();
        assert!(max_abs_diff(&h, &h_ref) < 1e-5 && max_abs_diff(&n, &n_ref) < 1e-5);
        let (h, n) = residual_add_rms_norm_partials(&res, &parts, &w_x, 1e-6).unwrap();
        let (h_ref, n_ref) = residual_add_rms_norm(&res, &y, &w_x, 1e-6).unwrap();
        assert!(max_abs_diff(&h, &h_ref) < 1e-5 && max_abs_diff(&n, &n_ref) < 1e-5);
    }

    #[test]
    fn the_cpu_never_splits() {
        let x = rand(&[4, 2048], 8).to_dtype(DType::BF16).unwrap();
        assert_eq!(split_k_plan(&x, 2048), None);
        let forced = super::super::policy::KernelPolicy { fp8_split_k: super::super::policy::SplitK::Forced { slices: 4, max_rows: 64 }, ..Default::default() };
        assert_eq!(super::super::policy::with_kernels(forced, || fp8_split_k_plan(&x, 2048)).0, None);
    }

    /// The FP8 kernel's slices are runs of 64-wide chunks of k (the last one short where k is
    /// off the chunk, or empty where the runs do not reach it); they sum to the dequantized
    /// product.
    #[test]
    fn fp8_partials_sum_to_the_dequantized_product() {
        let w = crate::quant::Fp8Weight::quantize(&rand(&[24, 208], 9)).unwrap();
        let x = rand(&[5, 208], 10);
        let whole = x.matmul(&w.dequantize(DType::F32).unwrap().t().unwrap()).unwrap();
        // 208 columns are 4 chunks (the last 16 wide): 3 slices are runs of 2, 2 and 0 chunks.
        for splits in [1, 2, 3, 4] {
            let parts = fp8_linear_partials_reference(&x, &w, splits).unwrap();
            assert_eq!(parts.dims(), &[splits, 5, 24]);
            assert!(max_abs_diff(&sum_partials(&parts, DType::F32).unwrap(), &whole) < 1e-4, "{splits} slices");
        }
        let three = fp8_linear_partials_reference(&x, &w, 3).unwrap();
        assert_eq!(three.get(2).unwrap().abs().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap(), 0.0, "the third run is empty");
        let first = x.narrow(1, 0, 128).unwrap().matmul(&w.dequantize(DType::F32).unwrap().narrow(1, 0, 128).unwrap().t().unwrap()).unwrap();
        assert!(max_abs_diff(&three.get(0).unwrap(), &first) < 1e-5, "the first run is chunks 0 and 1");
        assert!(fp8_linear_partials_reference(&x, &w, 5).is_err() && fp8_linear_partials_reference(&x, &w, 0).is_err());
    }
}
